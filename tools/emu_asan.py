#!/usr/bin/env python3
"""Runs the GPU tests on the AddressSanitizer + UBSan build of the emulated kernels.

    python3 tools/emu_asan.py                                   # emulator + every gpu test
    python3 tools/emu_asan.py tests/test_gpu_attention.py -k q8_0   # any pytest arguments
    python3 tools/emu_asan.py --self-check   # an overrun of shared and of device memory is reported

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
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_ARGS = ["tests/test_emu_kernels.py", "tests/test_gpu_attention.py", "tests/test_gpu_cache.py",
                "tests/test_gpu_graph.py", "tests/test_gpu_layer.py", "tests/test_gpu_groups.py"]


class AsanPlugin:
    """Makes every emulated kernel of the session the ASan build (loaded in the child)."""

    def pytest_configure(self, config):
        os.environ.pop("LD_PRELOAD", None)  # loaded here; children (nvcc, g++) run without it
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


def overrun_main(kind: str) -> None:
    """Child of --self-check: one out-of-bounds access that ASan must report."""
    import ctypes
    import numpy as np
    from kvcore.gpu._emu import kernels
    mod = kernels.load("emu_cases", asan=True, source_dir=os.path.join(ROOT, "tests", "emu_cases"))
    n = 32
    buf = kernels.alloc(4 * n)
    out = np.zeros(n, np.float32)
    if kind == "shared":
        vals = [ctypes.c_void_p(out.ctypes.data), ctypes.c_int(n)]   # reads s[32]
    else:
        vals = [ctypes.c_void_p(buf), ctypes.c_int(n)]               # writes buf[32]
    params = (ctypes.c_void_p * 2)(*[ctypes.addressof(v) for v in vals])
    mod.launch(f"{kind}_overrun", (1, 1, 1), (32, 1, 1), 0, params, 0)


def _env() -> dict:
    env = dict(os.environ)
    env["LD_PRELOAD"] = libasan()
    env["ASAN_OPTIONS"] = "detect_leaks=0:abort_on_error=0:halt_on_error=1"
    env["UBSAN_OPTIONS"] = "print_stacktrace=1:halt_on_error=1"
    return env


def self_check() -> int:
    """Proves the ASan build bites: a shared-memory over-read and a device-memory overrun of
    a test kernel must each end in an ASan report naming the kernel's source line."""
    failures = 0
    # a shared array overrun through a pointer is seen by UBSan's object-size check first
    # (when the compiler knows the object) or by ASan's redzones around the static
    reports = {"shared": ("global-buffer-overflow", "insufficient space for an object"),
               "global": ("heap-buffer-overflow",)}
    for kind, names in reports.items():
        code = ("import sys; sys.path.insert(0, sys.argv[1]); import emu_asan; "
                "emu_asan.overrun_main(sys.argv[2])")
        res = subprocess.run([sys.executable, "-c", code, os.path.join(ROOT, "tools"), kind],
                             cwd=ROOT, env=_env(), capture_output=True, text=True)
        line = re.search(r"in \S*%s_overrun\S* (\S+emu_cases\.cu:\d+)" % kind, res.stderr)
        report = next((r for r in names if r in res.stderr), None)
        line = line or re.search(r"(\S+emu_cases\.cu:\d+):\d+: runtime error", res.stderr)
        ok = res.returncode != 0 and report is not None and line is not None
        failures += not ok
        print(f"{kind} memory overrun: {'reported' if ok else 'NOT reported'}: "
              f"{report if ok else res.stderr[-2000:]} at {line.group(1) if line else '?'}")
    return 1 if failures else 0


def main() -> int:
    if sys.argv[1:] == ["--self-check"]:
        return self_check()
    args = sys.argv[1:] or DEFAULT_ARGS
    env = _env()
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import emu_asan; "
            "sys.exit(emu_asan.child_main(sys.argv[2:]))")
    cmd = [sys.executable, "-c", code, os.path.join(ROOT, "tools"), "--gpu=emu", "-p", "no:cacheprovider", *args]
    print(f"LD_PRELOAD={env['LD_PRELOAD']} ASAN_OPTIONS={env['ASAN_OPTIONS']}", flush=True)
    return subprocess.run(cmd, cwd=ROOT, env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
