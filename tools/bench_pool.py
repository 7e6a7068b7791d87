"""KVPool benchmarks against peers measured in the same run.

    python tools/bench_pool.py        (or: python tools/bench_cpu.py --only pool)
    python tools/bench_pool.py --paged   (the paged = contiguous table only)

Attention: one new token per sequence, Hq = 32, Hkv = 8, D = 128, B sequences of a
context each (equal lengths, or ragged: uniform in [ctx / 2, 3 ctx / 2), the same total),
one layer. kvcore paged: one `decode_attention(q, pool, 0, seqs=...)` call over a pool of
16-position pages taken in a shuffled order (as a pool in use hands them out); contiguous:
the same positions in one KVCache per sequence, one `decode_attention` call each (what a
runtime without a pool runs); torch SDPA: the batch padded to the longest sequence with a
boolean mask, float32 (only when torch is installed). Per-token cost = time / positions.

Paged = contiguous (issue 34): every format and K/V pair, 4096 and 16384 positions, B = 1
and 32 sequences of equal length, one thread: one `decode_attention` call over a pool of
16-position pages in a shuffled order against one call per sequence on KVCaches holding the
same positions, timed in turn within each round (median); "shuffled / contiguous" is the
goal's ratio (<= 1.10).

Step write: a decode step of 32 sequences x 32 layers (one position, K and V, float32
input [8, 128], f16 storage): 32 `append_batch` calls and one `advance` (at 1 thread and
at kvcore.max_threads(): a call of 32 rows has 65,536 values, the row kernels' threshold
for threads) against 1,024 `KVCache.append` calls and 32 `advance` calls (each on the
calling thread); rounds rewrite positions [0, 64) after a truncate, in both.

Step overhead: a decode step of 32 sequences x L layers (L = 32, fewer where the pool
would pass MAX_POOL_BYTES; the row says) at 512 and 4096 positions: per layer one
`append_batch` and one `decode_attention(q, pool, layer, seqs=...)`, then one `advance`;
4 steps per round, one of them starting a new page, then a truncate back (untimed).
Against it, in turn within each round, the same steps' kernels called directly with
arguments built beforehand: the write kernel (`RowWriter.write` of the step's 32 rows)
and `_attention.attend_paged`. In kernels: their time / the step's. Overhead per call:
the same steps with both kernels doing nothing (what runs around them: checks, tables,
bookkeeping), / (2 L + 1) calls; overhead / step: that time / the step's.
"""
from __future__ import annotations

import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _benchlib import median_time, print_table  # noqa: E402

import kvcore  # noqa: E402
from kvcore import _attention  # noqa: E402

HQ, HKV, D, PAGE = 32, 8, 128, 16
MAX_POOL_BYTES = 4 << 30   # the step-overhead pools: layers cut to stay below this


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


def _paged_row(rng, fmt: str, B: int, ctx: int) -> list:
    """One row of the paged = contiguous table (module comment)."""
    spec = kvcore.KVSpec(num_layers=1, num_kv_heads=HKV, head_dim=D, capacity=ctx,
                         num_heads=HQ, format=fmt)
    pool = kvcore.KVPool(spec, num_pages=B * (ctx // PAGE), page_size=PAGE)
    pool._table.free[:] = rng.permutation(pool.num_pages).tolist()   # pages in any order
    seqs = [pool.new_sequence() for _ in range(B)]
    k = rng.standard_normal((ctx, HKV, D), dtype=np.float32)
    v = rng.standard_normal((ctx, HKV, D), dtype=np.float32)
    caches = [kvcore.KVCache(spec) for _ in range(B)]
    for s, cache in zip(seqs, caches):
        pool.append(k, v, seq=s, layer=0)
        cache.append(0, k, v)
    q = rng.standard_normal((B, HQ, D), dtype=np.float32)
    out = np.empty_like(q)

    def contiguous():
        for b, cache in enumerate(caches):
            kvcore.decode_attention(q[b], cache, 0, out=out[b])
    times = _interleaved({"paged": lambda: kvcore.decode_attention(q, pool, 0, seqs=seqs, out=out),
                          "contiguous": contiguous}, rounds=8 if B * ctx > 65536 else 16)
    paged, flat = times["paged"], times["contiguous"]
    return [fmt, B, ctx, paged * 1e3, flat * 1e3, paged / flat,
            spec.bytes_per_position * B * ctx / paged / 1e9]


def bench_paged() -> None:
    """The paged = contiguous table, on one thread (the module comment)."""
    from _benchlib import PAIRS
    rng = np.random.default_rng(4)
    threads = kvcore.max_threads()
    kvcore.set_num_threads(1)
    try:
        rows = [_paged_row(rng, fmt, B, ctx)
                for fmt in [f for f in kvcore.FORMATS if f != "q4_1ch"]
                + [p for p in PAIRS if not p.startswith("q4_1ch")]
                for ctx in (4096, 16384) for B in (1, 32)]
    finally:
        kvcore.set_num_threads(threads)
    print_table(f"Paged = contiguous: one decode_attention over pages of {PAGE} in a shuffled "
                f"order vs one call per sequence on KVCaches, Hq {HQ}, Hkv {HKV}, D {D}, 1 thread",
                ["format", "B", "positions", "shuffled pages ms", "contiguous ms",
                 "shuffled / contiguous", "paged GB/s"], rows)


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


def _step_row(fmt: str, ctx: int, rng, B: int = 32, steps: int = 4) -> list:
    """One row of the step-overhead table: a pool of B sequences holding ctx - 2 positions
    (so that the round's third step starts a page), each round `steps` decode steps."""
    spec = kvcore.KVSpec(num_layers=32, num_kv_heads=HKV, head_dim=D, capacity=ctx + steps,
                         num_heads=HQ, format=fmt)
    L = min(32, MAX_POOL_BYTES // (B * (ctx + PAGE) * spec.bytes_per_position // 32))
    spec = spec.replace(num_layers=L)
    pool = kvcore.KVPool(spec, num_pages=B * -(-(ctx + steps) // PAGE), page_size=PAGE)
    seqs = [pool.new_sequence() for _ in range(B)]
    start = ctx - 2
    fill = rng.standard_normal((B * start, HKV, D), dtype=np.float32)
    for layer in range(L):
        pool.append_batch(fill, fill, seqs=seqs, layer=layer, counts=[start] * B)
    pool.advance(seqs)
    del fill
    k = rng.standard_normal((steps, B, HKV, D), dtype=np.float32)
    q = rng.standard_normal((B, HQ, D), dtype=np.float32)
    out = np.empty_like(q)

    def step_round():
        for t in range(steps):
            for layer in range(L):
                pool.append_batch(k[t], k[t], seqs=seqs, layer=layer)
                kvcore.decode_attention(q, pool, layer, seqs=seqs, out=out)
            pool.advance(seqs)

    def rewind():
        for s in seqs:
            pool.truncate(s, start)
    step_round()   # takes the round's pages (a truncate gives them back, a round again)
    tables = np.empty((B, pool.pages_for(start + steps)), np.int32)
    pool.block_tables(seqs, tables)
    pages = tables[:, (start + np.arange(steps)) // PAGE].astype(np.int64)
    rows = [np.ascontiguousarray(pages[:, t] * PAGE + (start + t) % PAGE) for t in range(steps)]
    lengths = [np.full(B, start + t + 1, np.int64) for t in range(steps)]
    ones = np.ones(B, np.int64)
    scale = float(np.float32(1 / np.sqrt(D)))
    writer, arrays = pool._store.writer, [pool._layer_arrays(layer) for layer in range(L)]

    def write_kernels():
        for t in range(steps):
            for layer in range(L):
                writer.write(layer, 0, k[t], k[t], rows[t], None, PAGE)

    def attention_kernels():
        for t in range(steps):
            for layer in range(L):
                _attention.attend_paged(q, *arrays[layer], spec.k_fmt.id, spec.v_fmt.id, PAGE, tables,
                                        lengths[t], ones, scale, True, out, None)

    rewind()
    times = _interleaved({"step": step_round, "write": write_kernels,
                          "attend": attention_kernels}, rounds=7, between=rewind)
    step, write, attend = (times[n] / steps for n in ("step", "write", "attend"))
    alone = _without_kernels(pool, lambda: _interleaved({"x": step_round}, rounds=21,
                                                        between=rewind)["x"]) / steps
    return [fmt, ctx, L, step * 1e3, write * 1e3, attend * 1e3,
            f"{(write + attend) / step:.1%}", alone / (2 * L + 1) * 1e6,
            f"{alone / step:.2%}"]


class _NoKernel:
    """Stands for a kernel module or writer: every kernel returns at once, as if done."""

    def __init__(self, real):
        self._real = real

    def __getattr__(self, name):
        return getattr(self._real, name)

    def attend_paged(self, *args, **kwargs):
        return _attention.ATTEND_OK

    def write(self, *args):
        return 0


def _without_kernels(pool, fn):
    """fn() with the pool's write kernel and the attention kernel doing nothing: the time
    of what runs around them."""
    import kvcore.attention as attention
    writer = pool._store.writer
    attention._attention, pool._store.writer = _NoKernel(_attention), _NoKernel(writer)
    try:
        return fn()
    finally:
        attention._attention, pool._store.writer = _attention, writer


def bench_step_overhead() -> None:
    rng = np.random.default_rng(3)
    rows = [_step_row(fmt, ctx, rng) for ctx in (512, 4096) for fmt in ("f16", "int8")]
    print_table(f"Decode step of a pool: 32 sequences x L layers (append_batch + "
                f"decode_attention per layer, then advance), Hq {HQ}, Hkv {HKV}, D {D}, page "
                f"size {PAGE}, {kvcore.max_threads()} threads",
                ["format", "positions", "L", "step ms", "write kernel ms",
                 "attention kernel ms", "in kernels", "overhead us / call",
                 "overhead / step"], rows)


def _interleaved(fns: dict, rounds: int = 9, between=None) -> dict[str, float]:
    """Median seconds of one call of each fn, the fns timed in turn within each round so
    that a change of machine load hits them alike (the first round warms up); `between`
    (untimed) runs after each call."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for r in range(rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            if r:
                times[name].append(time.perf_counter() - t0)
            if between is not None:
                between()
    return {name: float(np.median(ts)) for name, ts in times.items()}


def main(argv=None) -> None:
    import argparse
    parser = argparse.ArgumentParser(description="KVPool benchmarks (the module comment)")
    parser.add_argument("--paged", action="store_true", help="the paged = contiguous table only")
    args = parser.parse_args(argv or [])
    bench_paged()
    if args.paged:
        return
    bench_step_write()
    bench_step_overhead()
    bench_attention()


if __name__ == "__main__":
    t0 = time.perf_counter()
    main(sys.argv[1:])
    print(f"\n({time.perf_counter() - t0:.0f} s)")
