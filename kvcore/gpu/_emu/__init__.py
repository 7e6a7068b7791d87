"""The GPU emulator: kvcore's own CUDA kernels compiled for the CPU (`kernels`) behind an
emulated driver (`driver`) that enforces the real driver's rules. Selected for the whole
process by `kvcore.gpu.use_emulator()`; see docs/gpu.md, "Emulated driver".

Nothing here is imported until the emulator is asked for.
"""
from __future__ import annotations

import numbers

from ...errors import ShapeError


def use_emulator(*, devices: int = 1, seed: int = 0, memory_bytes: int = 2 << 30,
                 driver_version: int = 13000, asan: bool = False) -> None:
    """Runs kvcore's GPU layer on the CPU from now on, for this process: the project's CUDA
    kernels compiled by the host C++ compiler, under an emulated driver with the real
    driver's rules (current context per thread, queued streams, capture refusals, launch
    checks against the PTX, bounds-checked copies). Slow and exact; for machines without a
    GPU, as numba's CUDA simulator.

    devices: emulated GPUs (each sm_90, 132 SMs); memory_bytes: memory of each (cuMemAlloc
    past it is CUDA_ERROR_OUT_OF_MEMORY); driver_version: what cuDriverGetVersion answers
    (13000 = CUDA 13.0; it decides which PTX ISA loads); seed: the seed of the order in which
    kernel threads run between barriers (advanced per launch); asan: run the kernels built
    with AddressSanitizer (needs a process started with libasan preloaded).

    Calling it again resets the emulated machine (refused while kvcore device memory is
    live). Refused (StateError) once kvcore opened a context on a real device.

    The kernels are built by $CXX when set, else by g++ on PATH; without a compiler that
    runs, GpuUnavailableError (naming what was looked for), and the emulator stays off.
    """
    for name, value, low in (("devices", devices, 1), ("memory_bytes", memory_bytes, 1),
                             ("driver_version", driver_version, 1000), ("seed", seed, 0)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
            raise ShapeError(f"invalid {name}: expected an int >= {low}, got {value!r}")
    if not isinstance(asan, bool):
        raise ShapeError(f"invalid asan: expected a bool, got {asan!r}")
    from . import kernels
    kernels.find_compiler()   # GpuUnavailableError now, not at the first cache; nothing changed
    from .. import driver as gpu_driver
    gpu_driver.cuda()         # the emulator runs under cuda-python's bindings: GpuUnavailableError
    from . import driver as emu_driver
    emu_driver.install(kernels.libcuda(asan=asan))
    config = emu_driver.Config(int(devices), int(seed), int(memory_bytes), int(driver_version), asan)
    gpu_driver.use_emulated_driver(reset=lambda: emu_driver.reset(config))


def using_emulator() -> bool:
    """True when kvcore's GPU layer runs on the emulator (after use_emulator())."""
    from .. import driver as gpu_driver
    return gpu_driver.backend_is_emulator()


def leaks() -> list:
    """What is still live on the emulated devices (device memory, streams, events, graphs,
    graph execs), each with where it was created, plus what was still live when a context
    was released. Empty when the emulator is not in use."""
    if not using_emulator():
        return []
    from . import driver as emu_driver
    return emu_driver.leaks()


def config():
    """The emulated machine's settings (kvcore.gpu._emu.driver.Config), or None when the
    emulator is not in use."""
    if not using_emulator():
        return None
    from . import driver as emu_driver
    return emu_driver.config()


__all__ = ["use_emulator", "using_emulator", "leaks", "config"]
