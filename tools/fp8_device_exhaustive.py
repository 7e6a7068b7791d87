#!/usr/bin/env python3
"""Checks the device FP8 encoders (kv_f32_to_e4m3 / kv_f32_to_e5m2 of cuda/common.cuh, run
on the CPU emulator: the same source a GPU compiles) against ml_dtypes on all 2^32 float32
bit patterns.

    python tools/fp8_device_exhaustive.py [--jobs 2] [--chunk-bits 24]

Reference: ml_dtypes `astype` of the input clipped to +-largest finite (the device encoders
saturate, infinities included). NaN inputs are not compared: kvcore refuses them before any
encoder runs (kv_append's KV_ERR_NONFINITE). The encoders use only the _rn intrinsics and
integer operations, which the emulator reproduces exactly (docs/gpu.md, "Emulated
kernels"). Not part of CI (minutes). Exits 1 on any mismatch, printing the first few.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

import ml_dtypes
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # the kvcore beside these sources (and tests/emu_cases)
CASES = os.path.join(ROOT, "tests", "emu_cases")
REF = {"fp8_e4m3": (ml_dtypes.float8_e4m3fn, 448.0), "fp8_e5m2": (ml_dtypes.float8_e5m2, 57344.0)}


def check_chunk(start: int, size: int) -> dict[str, tuple[int, list[tuple[int, int, int]]]]:
    """Per format: mismatch count and up to 5 (input bits, device code, ml_dtypes code) of
    the float32 bit patterns [start, start + size)."""
    from kvcore.gpu._emu import kernels
    mod = kernels.load("emu_cases", source_dir=CASES)
    x = np.arange(start, start + size, dtype=np.uint64).astype(np.uint32).view(np.float32)
    got = {name: np.empty(size, np.uint8) for name in REF}
    vals = [ctypes.c_void_p(x.ctypes.data), ctypes.c_void_p(got["fp8_e4m3"].ctypes.data),
            ctypes.c_void_p(got["fp8_e5m2"].ctypes.data), ctypes.c_longlong(size)]
    params = (ctypes.c_void_p * 4)(*[ctypes.addressof(v) for v in vals])
    mod.launch("encode_fp8", (256, 1, 1), (256, 1, 1), 0, params, start)
    nan = np.isnan(x)
    out = {}
    for name, (dtype, fmax) in REF.items():
        with np.errstate(invalid="ignore", over="ignore"):
            want = np.clip(x, -fmax, fmax).astype(dtype).view(np.uint8)
        bad = (got[name] != want) & ~nan
        idx = np.flatnonzero(bad)[:5]
        out[name] = (int(bad.sum()), [(int(x.view(np.uint32)[i]), int(got[name][i]), int(want[i])) for i in idx])
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--chunk-bits", type=int, default=24)
    a = p.parse_args(argv)
    from kvcore.gpu._emu import kernels
    kernels.load("emu_cases", source_dir=CASES)  # build once, before the workers
    size = 1 << a.chunk_bits
    t0 = time.perf_counter()
    totals = {name: [0, []] for name in REF}
    with ProcessPoolExecutor(a.jobs) as pool:
        starts = range(0, 1 << 32, size)
        for res in pool.map(check_chunk, starts, [size] * len(starts)):
            for name, (n, ex) in res.items():
                totals[name][0] += n
                totals[name][1].extend(ex)
    dt = time.perf_counter() - t0
    for name, (total, examples) in totals.items():
        print(f"{name} (device encoder, emulated): {total} mismatches over the 2^32 float32 "
              f"patterns but NaN ({dt:.0f} s for both)")
        for bits, got, want in examples[:5]:
            print(f"  x bits 0x{bits:08x}: device 0x{got:02x}, ml_dtypes 0x{want:02x}")
    return 1 if any(t[0] for t in totals.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
