#!/usr/bin/env python3
"""Runs the GPU tests on the AddressSanitizer + UBSan build of the emulated kernels.

    python3 tools/emu_asan.py                                   # emulator + every gpu test
    python3 tools/emu_asan.py tests/test_gpu_attention.py -k q8_0   # any pytest arguments

pytest runs in a child process with the compiler's libasan preloaded (ASAN_OPTIONS
detect_leaks=0: the interpreter is not instrumented and would report its own allocations)
and --gpu=emu; a plugin selects the sanitizer build everywhere: kvcore.gpu.use_emulator
(asan=True) and kernels.load / build_all(asan=True), i.e. the kernels compiled with
-fsanitize=address,undefined. Shared memory keeps ASan's redzones there (cuda/emu/kvemu.h)
and device memory is ASan's malloc, so an out-of-bounds access of a kernel aborts the run
with ASan's report naming the source line; UBSan stops at the first undefined behaviour.
Exit status: pytest's, or ASan's (non-zero) on a report.
"""
from __future__ import annotations

import functools
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_ARGS = ["tests/test_emu_kernels.py", "tests/test_gpu_attention.py", "tests/test_gpu_cache.py",
                "tests/test_gpu_graph.py", "tests/test_gpu_layer.py"]


class AsanPlugin:
    """Makes every emulated kernel of the session the ASan build (loaded in the child)."""

    def pytest_configure(self, config):
        from kvcore import gpu
        from kvcore.gpu._emu import kernels
        gpu.use_emulator = functools.partial(gpu.use_emulator, asan=True)
        load, build_all = kernels.load, kernels.build_all
        kernels.load = lambda module, *, asan=False, source_dir=None: load(module, asan=True, source_dir=source_dir)
        kernels.build_all = lambda *, asan=False, source_dir=None: build_all(asan=True, source_dir=source_dir)


def libasan() -> str:
    path = subprocess.run(["g++", "-print-file-name=libasan.so"], capture_output=True, text=True,
                          check=True).stdout.strip()
    if not os.path.isabs(path) or not os.path.exists(path):
        sys.exit(f"g++ has no libasan.so (got {path!r}): install the compiler's sanitizer runtime")
    return os.path.realpath(path)


def child_main(args: list[str]) -> int:
    import pytest
    return pytest.main(args, plugins=[AsanPlugin()])


def main() -> int:
    args = sys.argv[1:] or DEFAULT_ARGS
    env = dict(os.environ)
    env["LD_PRELOAD"] = libasan()
    env["ASAN_OPTIONS"] = "detect_leaks=0:abort_on_error=0:halt_on_error=1"
    env["UBSAN_OPTIONS"] = "print_stacktrace=1:halt_on_error=1"
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import emu_asan; "
            "sys.exit(emu_asan.child_main(sys.argv[2:]))")
    cmd = [sys.executable, "-c", code, os.path.join(ROOT, "tools"), "--gpu=emu", "-p", "no:cacheprovider", *args]
    print(f"LD_PRELOAD={env['LD_PRELOAD']} ASAN_OPTIONS={env['ASAN_OPTIONS']}", flush=True)
    return subprocess.run(cmd, cwd=ROOT, env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
