"""Checks kvcore's FP8 encoders against ml_dtypes on all 2^32 float32 bit patterns.

    python tools/fp8_exhaustive.py [--formats fp8_e4m3 fp8_e5m2] [--jobs 2] [--chunk-bits 24]

Reference: ml_dtypes `astype` of the input clipped to +-largest finite (kvcore saturates
where ml_dtypes overflows to NaN / inf), compared bit for bit; NaN inputs must give a NaN
code. Not part of CI: it takes minutes (ml_dtypes converts ~0.5 GB/s per core).
Exits 1 on any mismatch, printing the first few.
"""
from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ProcessPoolExecutor

import ml_dtypes
import numpy as np

from kvcore import FORMATS, _quant

REF = {"fp8_e4m3": (ml_dtypes.float8_e4m3fn, 448.0), "fp8_e5m2": (ml_dtypes.float8_e5m2, 57344.0)}


def check_chunk(name: str, start: int, size: int) -> tuple[int, list[tuple[int, int, int]]]:
    """Mismatch count and up to 5 (input bits, kvcore code, ml_dtypes code) of the float32
    bit patterns [start, start + size)."""
    dtype, fmax = REF[name]
    x = np.arange(start, start + size, dtype=np.uint64).astype(np.uint32).view(np.float32)
    got = _quant._encode_fp8_raw(x, FORMATS[name].id)
    with np.errstate(invalid="ignore", over="ignore"):
        want = np.clip(x, -fmax, fmax).astype(dtype)
    nan = np.isnan(x)
    bad = np.where(nan, ~np.isnan(got.view(dtype).astype(np.float32)), got != want.view(np.uint8))
    idx = np.flatnonzero(bad)[:5]
    return int(bad.sum()), [(int(x.view(np.uint32)[i]), int(got[i]), int(want.view(np.uint8)[i]))
                            for i in idx]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--formats", nargs="+", default=list(REF), choices=list(REF))
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--chunk-bits", type=int, default=24)
    a = p.parse_args(argv)
    size = 1 << a.chunk_bits
    failed = False
    for name in a.formats:
        t0 = time.perf_counter()
        total, examples = 0, []
        with ProcessPoolExecutor(a.jobs) as pool:
            starts = range(0, 1 << 32, size)
            for n, ex in pool.map(check_chunk, [name] * len(starts), starts, [size] * len(starts)):
                total += n
                examples.extend(ex)
        dt = time.perf_counter() - t0
        print(f"{name}: {total} mismatches over 2^32 float32 patterns ({dt:.0f} s)")
        for bits, got, want in examples[:5]:
            print(f"  x bits 0x{bits:08x}: kvcore 0x{got:02x}, ml_dtypes 0x{want:02x}")
        failed |= total > 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
