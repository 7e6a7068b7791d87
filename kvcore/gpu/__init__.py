"""kvcore's GPU layer on cuda-python's driver API (imported lazily: importing this package
never needs cuda-python or a GPU; `is_available()` says whether one is usable).

    from kvcore import gpu
    if gpu.is_available():
        cache = gpu.GpuKVCache(spec, slots=64)
        cache.append(layer, k, v)      # k, v: device [M, Hkv, D] float32/float16/bfloat16
        cache.advance()
        cache.check()                  # raises CapacityError / NonFiniteError naming the slots

Without a GPU, `gpu.use_emulator()` runs the same code on the CPU: kvcore's CUDA kernels
compiled by the host C++ compiler ($CXX, else g++), under an emulated driver with the real
driver's rules. Without cuda-python and without the emulator, making any GPU object raises
GpuUnavailableError (an ImportError) saying so. GPU objects that own device memory refuse
copy.copy, copy.deepcopy and pickle (DeviceCopyError): move their content with snapshot()
and restore().

See docs/gpu.md for layouts, per-slot status, streams, contexts, graph capture and the
emulator.
"""
from .attention import AttentionPlan, apply_rope, decode_attention
from .cache import GPU_GROUPED_PAIRS, GPU_FORMATS, GPU_PAIRS, GpuKVCache, GpuLayout, max_slots_for_memory
from .driver import (Context, CudaError, DeviceCopyError, Event, GpuUnavailableError, Stream,
                     is_available)
from .graph import DecodeGraph
from .memory import DeviceArray, DeviceBuffer, as_device_array
from .pool import GpuKVPool
from ._emu import use_emulator, using_emulator


def live_bytes(device: int = 0) -> int:
    """Bytes of device memory kvcore holds on `device` (0 when its context is not open)."""
    ctx = Context._contexts.get(device)
    return 0 if ctx is None else ctx.live_bytes


__all__ = ["GPU_GROUPED_PAIRS", "GPU_FORMATS", "GPU_PAIRS", "AttentionPlan", "apply_rope", "decode_attention", "DecodeGraph", "GpuKVCache", "GpuKVPool",
           "GpuLayout", "max_slots_for_memory", "Context", "CudaError", "DeviceCopyError",
           "GpuUnavailableError", "Event", "Stream", "is_available", "DeviceArray", "DeviceBuffer",
           "as_device_array", "live_bytes", "use_emulator", "using_emulator"]
