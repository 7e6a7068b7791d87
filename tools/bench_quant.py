"""Quantize / dequantize throughput against peers measured in the same run.

    python tools/bench_quant.py [--shape 4096 8 128] [--threads 1 2] [--head-dims 64 128 256]
    python tools/bench_quant.py --per-row [--head-dims 64 128 256]     # the second table alone

Input: a float32 array [4096, 8, 128] (16 MiB, Gaussian). Every figure is GB/s of
float32 (bytes of the float side per second), so columns compare directly:
- `np.copyto`: copying the same float32 array into an existing one (the bandwidth
  ceiling; it reads and writes 16 MiB, more traffic than a quantizer's 16 + 4 MiB);
- `numpy`: a vectorised numpy implementation of the same rule (numpy runs one thread);
  for q4_0 / q4_1 gguf-py's own numpy quantizer (`gguf.quants`, llama.cpp's reference
  implementation in Python, the bytes kvcore matches) when it is installed;
- `ml_dtypes`: `astype` of the same float32 array to the FP8 / bfloat16 type (the
  conversion alone, without the scale);
- `torch`: `copy_` of the same float32 tensor into an existing float8 / float16 /
  bfloat16 tensor (the conversion alone), at the row's thread count (when torch is
  installed).
kvcore's figures are the public calls (`kvcore.quantize` / `kvcore.dequantize`),
allocation of their outputs included.

Then (alone with --per-row) the block formats' encoders, one thread, on 128 KiB of input
that stays in the L1/L2 cache: `kvcore.quantize` of float32 rows, and `KVCache.append`
(K and V, 8 kv heads) of float32 and float16 input, ns per row of head_dim values (the
best of 40 rounds of 50 calls of all the rows and of a quarter of them, taken in turn:
the slope between them, so a call's fixed cost cancels), and each format's time over
q8_0's. Its minimum is steady on a shared machine where the streaming figures above move
by 2x.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _benchlib import best_times, median_time, print_table  # noqa: E402

import kvcore  # noqa: E402

F32 = np.float32


def _numpy_quantize(name: str):
    """The documented rule, vectorised in numpy (None where numpy has no peer)."""
    if name == "int8":
        def run(x):
            scale = np.abs(x).max(axis=-1, keepdims=True) / F32(127)
            safe = np.where(scale == 0, F32(1), scale)
            return np.clip(np.rint(x / safe), -127, 127).astype(np.int8), scale
        return run
    if name == "q8_0":
        def run(x):
            b = x.reshape(x.shape[:-1] + (x.shape[-1] // 32, 32))
            d = np.abs(b).max(axis=-1, keepdims=True) / F32(127)
            inv = F32(1) / np.where(d == 0, F32(1), d) * (d != 0)
            v = b * inv
            q = np.trunc(v + np.copysign(F32(0.49999997), v)).astype(np.int8)
            return q.reshape(x.shape), d[..., 0].astype(np.float16)
        return run
    if name in ("fp8_e4m3", "fp8_e5m2"):
        import ml_dtypes
        dtype, fmax = ((ml_dtypes.float8_e4m3fn, 448.0) if name == "fp8_e4m3"
                       else (ml_dtypes.float8_e5m2, 57344.0))

        def run(x):
            scale = np.abs(x).max(axis=-1, keepdims=True) / F32(fmax)
            safe = np.where(scale == 0, F32(1), scale)
            return np.clip(x / safe, -fmax, fmax).astype(dtype), scale
        return run
    if name == "f16":
        return lambda x: x.astype(np.float16)
    if name in ("q4_0", "q4_1"):
        quants = _gguf()
        if quants is not None:
            kind = getattr(quants.GGMLQuantizationType, name.upper())
            return lambda x: quants.quantize(x.reshape(-1, x.shape[-1]), kind)
    return None


def _gguf():
    try:
        import gguf.quants as quants
    except ImportError:
        return None
    return quants


def _numpy_dequantize(name: str, codes, scales, x=None):
    if name in ("q4_0", "q4_1"):
        quants = _gguf()
        if quants is None:
            return None
        kind = getattr(quants.GGMLQuantizationType, name.upper())
        blocks = quants.quantize(x.reshape(-1, x.shape[-1]), kind)
        return lambda: quants.dequantize(blocks, kind)
    if name == "q8_0":
        q = codes.reshape(codes.shape[:-1] + (codes.shape[-1] // 32, 32)).astype(F32)
        return lambda: (q * scales.astype(F32)[..., None]).reshape(codes.shape)
    if scales is None:
        return lambda: codes.astype(F32)
    return lambda: codes.astype(F32) * scales


def _ml_dtypes_type(name: str):
    try:
        import ml_dtypes
    except ImportError:
        return None
    return {"fp8_e4m3": ml_dtypes.float8_e4m3fn, "fp8_e5m2": ml_dtypes.float8_e5m2,
            "bf16": ml_dtypes.bfloat16}.get(name)


def _torch_convert(name: str, x: np.ndarray):
    """torch's float32 -> code dtype conversion into an existing tensor, or None."""
    try:
        import torch
    except ImportError:
        return None, None
    dtype = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2,
             "f16": torch.float16, "bf16": torch.bfloat16}.get(name)
    if dtype is None:
        return None, torch
    src = torch.from_numpy(x)
    dst = torch.empty(src.shape, dtype=dtype)
    return (lambda: dst.copy_(src)), torch


def run(shape=(4096, 8, 128), threads=(1, 2), repeat: int = 9) -> None:
    """Prints one markdown table per thread count."""
    x = np.random.default_rng(0).standard_normal(shape).astype(F32)
    gbs = lambda t: x.nbytes / t / 1e9  # noqa: E731
    dst = np.empty_like(x)
    names = ["int8", "fp8_e4m3", "fp8_e5m2", "q8_0", "q4_0", "q4_1", "f16", "bf16"]

    peers = {}      # numpy and ml_dtypes run one thread: measure once
    for name in names:
        codes, scales = kvcore.quantize(x, name)
        nq = _numpy_quantize(name)
        dt = _ml_dtypes_type(name)
        ndq = _numpy_dequantize(name, codes, scales, x)
        peers[name] = (
            gbs(median_time(lambda: nq(x), repeat=repeat)) if nq else None,
            gbs(median_time(ndq, repeat=repeat)) if ndq else None,
            gbs(median_time(lambda: x.astype(dt), repeat=repeat)) if dt else None,
        )

    try:
        for n in threads:
            kvcore.set_num_threads(n)
            copy = gbs(median_time(lambda: np.copyto(dst, x), repeat=repeat))
            rows = [["np.copyto (ceiling)", copy, copy, "", "", "", "", "1.00", "", "", ""]]
            for name in names:
                codes, scales = kvcore.quantize(x, name)
                q = gbs(median_time(lambda: kvcore.quantize(x, name), repeat=repeat))
                dq = gbs(median_time(lambda: kvcore.dequantize(codes, scales, name), repeat=repeat))
                nq, ndq, ml = peers[name]
                convert, torch = _torch_convert(name, x)
                if torch is not None:
                    torch.set_num_threads(n)
                tc = gbs(median_time(convert, repeat=repeat)) if convert else None
                ratio = lambda a, b: f"{a / b:.2f}" if b else "-"  # noqa: E731
                rows.append([name, q, dq, nq or "-", ndq or "-", ml or "-", tc or "-", ratio(q, copy),
                             ratio(q, nq), ratio(q, ml), ratio(q, tc)])
            print_table(
                f"quantize / dequantize {list(shape)} float32, {n} thread(s) "
                f"(GB/s of float32; numpy and ml_dtypes: 1 thread; torch: {n})",
                ["format", "quantize", "dequantize", "numpy quantize", "numpy dequantize",
                 "ml_dtypes astype", "torch copy_", "quantize / copyto", "quantize / numpy",
                 "quantize / ml_dtypes", "quantize / torch"],
                rows)
    finally:
        kvcore.set_num_threads(0)       # back to OpenMP's default


def _slope_ns(run, n: int) -> float:
    """ns per row of run(m) (a call over its first m of n rows): the slope between a
    quarter and all of them, the two timed in turn (best of 40 x 50 calls)."""
    small, whole = best_times([lambda: run(n // 4), lambda: run(n)], repeat=40, number=50)
    return (whole - small) / (n - n // 4) * 1e9


def _append(name: str, k: np.ndarray, v: np.ndarray):
    """run(m) for _slope_ns: KVCache.append of the first m positions of k, v [T, Hkv, D]
    into an emptied cache of format `name`."""
    T, H, D = k.shape
    cache = kvcore.KVCache(kvcore.KVSpec(num_layers=1, num_kv_heads=H, head_dim=D,
                                         capacity=T, format=name))

    def run(m: int) -> None:
        cache.truncate(0)
        cache.append(0, k[:m], v[:m])
    return run


def run_per_row(head_dims=(64, 128, 256)) -> None:
    """Prints ns per row of the block formats' encoders, in cache, one thread:
    kvcore.quantize of float32 rows, and KVCache.append (K and V, Hkv 8) of float32 and
    float16 input."""
    rng = np.random.default_rng(0)
    names = ["q8_0", "q4_0", "q4_1"]
    rows = []
    kvcore.set_num_threads(1)
    try:
        for d in head_dims:
            x = rng.standard_normal((32768 // d, 1, d)).astype(F32)    # 128 KiB
            kv = rng.standard_normal((2, 2048 // d, 8, d)).astype(F32)   # 128 KiB
            ns = {}
            for name in names:
                ns[name, "quantize"] = _slope_ns(lambda m: kvcore.quantize(x[:m], name), len(x))
                for dt in (np.float32, np.float16):
                    k, v = kv.astype(dt)
                    # a position's K and V: 16 rows
                    ns[name, dt] = _slope_ns(_append(name, k, v), len(k)) / 16
            for name in names:
                rows.append([d, name] + [
                    f"{ns[name, w]:.3g} ({ns[name, w] / ns['q8_0', w]:.2f})"
                    for w in ("quantize", np.float32, np.float16)])
    finally:
        kvcore.set_num_threads(0)
    print_table("block encoders per row, in cache, 1 thread (ns per row of head_dim values, "
                "and the time over q8_0's; best of 40 x 50 calls)",
                ["head_dim", "format", "quantize float32", "KVCache.append float32",
                 "KVCache.append float16"], rows)


def main(argv: Sequence[str] = ()) -> None:
    """Runs with command-line style arguments (none: the defaults; tools/bench_cpu.py
    calls it that way)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", type=int, nargs="+", default=[4096, 8, 128])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--per-row", action="store_true", help="only the block encoders per row, in cache")
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128, 256])
    a = p.parse_args(list(argv))
    if not a.per_row:
        run(tuple(a.shape), tuple(a.threads))
    run_per_row(tuple(a.head_dims))


if __name__ == "__main__":
    main(sys.argv[1:])
