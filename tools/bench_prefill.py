"""Causal prefill attention against torch SDPA is_causal, measured in the same run.

    python tools/bench_prefill.py [--tokens 1024 4096] [--threads 1 2] [--rounds 3]

T new tokens attend a cache holding exactly those T positions (token t sees positions
[0, t]): Hq = 32, Hkv = 8, D = 128, batch 1, every format and the K/V pairs
(`_benchlib.PAIRS`: K in the first format, V in the second). The peer is
`torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
enable_gqa=True)` float32 on [1, H, T, D] tensors (its own layout, made once, not timed).
"kvcore f32 causal=False" is the same call without the mask: the work a causal call skips.
Within each round every implementation is timed once, in turn, so that a change of
machine load hits all alike; the table gives the median over the rounds and SDPA's time
over ours (> 1: faster than SDPA on the same threads).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Callable, Sequence

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _benchlib import PAIRS, print_table  # noqa: E402

import kvcore  # noqa: E402

HQ, HKV, D = 32, 8, 128
SDPA = "torch SDPA f32 is_causal"


def _calls(torch, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> dict[str, Callable[[], object]]:
    """The timed calls of one prompt of T = len(q) tokens."""
    T = q.shape[0]
    calls: dict[str, Callable[[], object]] = {}
    for fmt in (*kvcore.formats.ROW_FORMATS, *PAIRS):
        cache = kvcore.KVCache(kvcore.KVSpec(num_layers=1, num_kv_heads=HKV, head_dim=D,
                                             capacity=T, num_heads=HQ, format=fmt))
        cache.append(0, k, v)
        out = np.empty_like(q)
        calls[f"kvcore {fmt}"] = lambda c=cache, o=out: kvcore.decode_attention(q, c, 0, out=o)
        if fmt == "f32":
            calls["kvcore f32 causal=False"] = lambda c=cache, o=out: kvcore.decode_attention(
                q, c, 0, causal=False, out=o)
    if torch is not None:
        qt, kt, vt = (torch.from_numpy(np.ascontiguousarray(x.transpose(1, 0, 2)))[None]
                      for x in (q, k, v))
        sdpa = torch.nn.functional.scaled_dot_product_attention
        calls[SDPA] = lambda: sdpa(qt, kt, vt, is_causal=True, enable_gqa=True)
    return calls


def _interleaved(fns: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """Median seconds of each fn, the fns timed in turn within each round (one warm-up
    call each first)."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: float(np.median(ts)) for name, ts in times.items()}


def _torch_isa_like_kvcore() -> None:
    """A kvcore build without AVX-512 (an AVX2 machine, or KVCORE_MARCH=x86-64-v3 on an
    AVX-512 one) is compared with torch on AVX2 too, as torch runs on an AVX2 machine: its
    own kernels (ATEN_CPU_CAPABILITY), MKL's and oneDNN's. Only before torch is imported,
    and not over a setting the caller made."""
    if "AVX512F" in kvcore._cache.build_info()["isa"] or "torch" in sys.modules:
        return
    for name, value in (("ATEN_CPU_CAPABILITY", "avx2"), ("MKL_ENABLE_INSTRUCTIONS", "AVX2"),
                        ("ONEDNN_MAX_CPU_ISA", "AVX2")):
        os.environ.setdefault(name, value)


def main(argv: Sequence[str] = ()) -> dict[tuple[str, int], dict[int, float]]:
    """Runs with command-line style arguments (none: the defaults). Returns {(implementation,
    threads): {tokens: seconds}}."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    _torch_isa_like_kvcore()
    try:
        import torch
    except ImportError:
        torch = None
    rng = np.random.default_rng(0)
    results: dict[tuple[str, int], dict[int, float]] = {}
    for T in args.tokens:
        q, k, v = (rng.standard_normal((T, h, D), dtype=np.float32) for h in (HQ, HKV, HKV))
        calls = _calls(torch, q, k, v)
        for threads in args.threads:
            kvcore.set_num_threads(threads)
            if torch is not None:
                torch.set_num_threads(threads)
            for name, secs in _interleaved(calls, args.rounds).items():
                results.setdefault((name, threads), {})[T] = secs
        del calls
    kvcore.set_num_threads(0)
    header = ["implementation", "threads"]
    for T in args.tokens:
        header += [f"ms @{T}", f"x SDPA @{T}"]
    rows = []
    for (name, threads), per_t in results.items():
        row: list[object] = [name, threads]
        for T in args.tokens:
            ref = results.get((SDPA, threads), {}).get(T)
            row += [per_t[T] * 1e3, ref / per_t[T] if ref else "-"]
        rows.append(row)
    isa = "" if torch is None else f"; torch on {torch.backends.cpu.get_cpu_capability()}"
    print_table(f"Causal prefill: T tokens over T positions, Hq={HQ}, Hkv={HKV}, D={D}, "
                f"batch 1 ({args.rounds} rounds, median; kvcore built for "
                f"{' '.join(kvcore._cache.build_info()['isa'])}{isa})", header, rows)
    if torch is None:
        print(f"\n{SDPA}: torch not installed")
    else:
        for T in args.tokens:
            for threads in args.threads:
                ratios = {name: results[(SDPA, threads)][T] / results[(name, threads)][T]
                          for name, t in results if t == threads and name.startswith("kvcore ")
                          and "causal=False" not in name}
                low = min(ratios, key=ratios.get)
                print(f"goal @{T}, {threads} thread{'s' if threads > 1 else ''}: every format at "
                      f">= 1x SDPA is_causal; lowest {low.removeprefix('kvcore ')} "
                      f"{ratios[low]:.2f}x")
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
