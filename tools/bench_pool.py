"""KVPool benchmarks against peers measured in the same run.

    python tools/bench_pool.py        (or: python tools/bench_cpu.py --only pool)

Attention: one new token per sequence, Hq = 32, Hkv = 8, D = 128, B sequences of a
context each (equal lengths, or ragged: uniform in [ctx / 2, 3 ctx / 2), the same total),
one layer. kvcore paged: one `decode_attention(q, pool, 0, seqs=...)` call over a pool of
16-position pages taken in a shuffled order (as a pool in use hands them out); contiguous:
the same positions in one KVCache per sequence, one `decode_attention` call each (what a
runtime without a pool runs); torch SDPA: the batch padded to the longest sequence with a
boolean mask, float32 (only when torch is installed). Per-token cost = time / positions.

Step write: a decode step of 32 sequences x 32 layers (one position, K and V, float32
input [8, 128], f16 storage): 32 `append_batch` calls and one `advance` (at 1 thread and
at kvcore.max_threads(): a call of 32 rows has 65,536 values, the row kernels' threshold
for threads) against 1,024 `KVCache.append` calls and 32 `advance` calls (each on the
calling thread); rounds rewrite positions [0, 64) after a truncate, in both.
"""
from __future__ import annotations

import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _benchlib import median_time, print_table  # noqa: E402

import kvcore  # noqa: E402

HQ, HKV, D, PAGE = 32, 8, 128, 16


def _lengths(rng, B: int, ctx: int, ragged: bool) -> list[int]:
    if not ragged:
        return [ctx] * B
    return [int(x) for x in rng.integers(ctx // 2, ctx + ctx // 2, B)]


def _attention_row(rng, fmt: str, B: int, ctx: int, ragged: bool) -> tuple[list, list[int]]:
    """The kvcore columns of one row, and the lengths (for the torch column)."""
    lengths = _lengths(rng, B, ctx, ragged)
    spec = kvcore.KVSpec(num_layers=1, num_kv_heads=HKV, head_dim=D, capacity=max(lengths),
                         num_heads=HQ, format=fmt)
    pool = kvcore.KVPool(spec, num_pages=sum(-(-n // PAGE) for n in lengths), page_size=PAGE)
    pool._table.free[:] = rng.permutation(pool.num_pages).tolist()   # pages in any order
    seqs = [pool.new_sequence() for _ in lengths]
    caches = []
    for s, n in zip(seqs, lengths):
        k = rng.standard_normal((n, HKV, D), dtype=np.float32)
        v = rng.standard_normal((n, HKV, D), dtype=np.float32)
        pool.append(k, v, seq=s, layer=0)
        cache = kvcore.KVCache(spec.replace(capacity=n))
        cache.append(0, k, v)
        caches.append(cache)
    q = rng.standard_normal((B, HQ, D), dtype=np.float32)
    out = np.empty_like(q)
    paged = median_time(lambda: kvcore.decode_attention(q, pool, 0, seqs=seqs, out=out),
                        repeat=7, warmup=2)

    def contiguous():
        for b, cache in enumerate(caches):
            kvcore.decode_attention(q[b], cache, 0, out=out[b])
    flat = median_time(contiguous, repeat=7, warmup=2)
    total = sum(lengths)
    return ([fmt, B, ctx, "ragged" if ragged else "equal", paged * 1e6, flat * 1e6,
             paged / flat, paged / total * 1e9], lengths)


def _torch_time(torch, lengths: list[int]) -> float:
    """SDPA float32 over [B, Hkv, max_len, D] K/V padded with a boolean mask."""
    rng = np.random.default_rng(2)
    B, m = len(lengths), max(lengths)
    k = torch.from_numpy(rng.standard_normal((B, HKV, m, D), dtype=np.float32))
    v = torch.from_numpy(rng.standard_normal((B, HKV, m, D), dtype=np.float32))
    mask = torch.from_numpy(np.arange(m)[None, :] < np.array(lengths)[:, None])[:, None, None, :]
    qt = torch.from_numpy(rng.standard_normal((B, HQ, 1, D), dtype=np.float32))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    with torch.inference_mode():
        return median_time(lambda: sdpa(qt, k, v, attn_mask=mask, enable_gqa=True),
                           repeat=7, warmup=2)


def bench_attention() -> None:
    rng = np.random.default_rng(0)
    header = ["format", "B", "context", "lengths", "paged us / call", "contiguous us",
              "paged / contiguous", "paged ns / position"]
    rows, lengths = [], []
    for fmt in ("f16", "int8"):
        for ctx in (1024, 4096):
            for B in (1, 8, 32):
                for ragged in ((False, True) if B > 1 else (False,)):
                    row, ls = _attention_row(rng, fmt, B, ctx, ragged)
                    rows.append(row)
                    lengths.append(ls)
    # torch last: its OpenMP threads spin after each call and would slow what follows
    try:
        import torch
        torch.set_num_threads(kvcore.max_threads())
        header.append("torch SDPA padded us")
        for row, ls in zip(rows, lengths):
            row.append(_torch_time(torch, ls) * 1e6)
    except ImportError:
        torch = None
    print_table(f"Paged decode attention, Hq {HQ}, Hkv {HKV}, D {D}, page size {PAGE}, "
                f"{kvcore.max_threads()} threads", header, rows)
    if torch is None:
        print("\ntorch SDPA padded: torch not installed (a bench-only peer)")


def bench_step_write() -> None:
    B, L, steps = 32, 32, 64
    spec = kvcore.KVSpec(num_layers=L, num_kv_heads=HKV, head_dim=D, capacity=steps, format="f16")
    rng = np.random.default_rng(1)
    k = rng.standard_normal((steps, B, HKV, D), dtype=np.float32)
    v = rng.standard_normal((steps, B, HKV, D), dtype=np.float32)
    pool = kvcore.KVPool(spec, num_pages=B * steps // PAGE, page_size=PAGE)
    seqs = [pool.new_sequence() for _ in range(B)]
    caches = [kvcore.KVCache(spec) for _ in range(B)]
    pool._storage[:] = 0            # touch every page once, as a pool in use has been
    for c in caches:
        c._storage[:] = 0

    def pooled():
        for s in seqs:
            pool.truncate(s, 0)
        for t in range(steps):
            kt, vt = k[t], v[t]
            for layer in range(L):
                pool.append_batch(kt, vt, seqs=seqs, layer=layer)
            pool.advance(seqs)

    def loop():
        for c in caches:
            c.reset()
        for t in range(steps):
            kt, vt = k[t], v[t]
            for b, c in enumerate(caches):
                kb, vb = kt[b], vt[b]
                for layer in range(L):
                    c.append(layer, kb, vb)
                c.advance()
    threads = kvcore.max_threads()

    def at(nt, fn):
        def call():
            kvcore.set_num_threads(nt)
            try:
                fn()
            finally:
                kvcore.set_num_threads(threads)
        return call
    loop_name = "Python loop of KVCache.append (1,024 calls + 32 advance)"
    fns = {f"kvcore KVPool.append_batch (32 calls + advance), {nt} thread(s)": at(nt, pooled)
           for nt in sorted({1, threads})}
    fns[loop_name] = loop
    times = _interleaved(fns)
    peer = times[loop_name]
    print_table(f"Decode step write: {B} sequences x {L} layers, 1 position each, f32 input "
                f"[{HKV}, {D}] into f16 storage",
                ["implementation", "us / step", "speed vs the loop"],
                [[name, secs / steps * 1e6, peer / secs] for name, secs in times.items()])


def _interleaved(fns: dict, rounds: int = 9) -> dict[str, float]:
    """Median seconds of one call of each fn, the fns timed in turn within each round so
    that a change of machine load hits them alike (the first round warms up)."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for r in range(rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            if r:
                times[name].append(time.perf_counter() - t0)
    return {name: float(np.median(ts)) for name, ts in times.items()}


def main(argv=None) -> None:
    bench_step_write()
    bench_attention()


if __name__ == "__main__":
    t0 = time.perf_counter()
    main()
    print(f"\n({time.perf_counter() - t0:.0f} s)")
