"""Decode attention throughput against peers measured in the same run.

    python tools/bench_attention.py [--contexts 1024 4096 16384] [--threads 1 2]
    python tools/bench_attention.py --variants-only [--variant-formats f16 int8]

One new token (batch 1), Hq = 32 query heads, Hkv = 8 kv heads, D = 128. Every timed call
reads K/V that are not in the caches: each implementation cycles through enough copies
of its K/V to pass twice the last-level cache. Columns per context: microseconds per
call, GB/s of cache bytes read (K and V codes plus scales; float32 for the peers), that
rate as a share of the streaming-read probe's, and torch's time over ours (> 1: faster
than torch at the same thread count).
- probe: the memory limit of decode attention. `kvcore._attention.stream_sum` sums the
  same bytes (each format's own cache storage, the same copies cycled past the
  last-level cache) as 64-bit words on the same threads, one contiguous range per
  thread; its calls alternate with the attention calls in the same rounds (each reading
  a copy the other did not just read), so a change of machine load hits both alike. The
  peers (float32) are compared with the probe of the f32 cache, which holds their bytes.
- FMA limit: the other physical limit. Decode attention does 2 * G * D float32
  multiply-adds per position and kv head (G = Hq / Hkv) whatever the format;
  `kvcore._attention.fma_burn` times the kernel's own vector FMA on the same threads,
  in bursts between the attention calls. A call can take no less than the longer of the
  probe's time and the FMA time: `% limit` is that bound over the call's time, the table
  of limits says which one binds (the 8-bit formats at G = 4 are FMA-bound on 2-FMA-pipe
  cores: 1,024 multiply-adds per 256 bytes).
- goal lines at 4096 and 16384 positions: each format's share of the probe and of the
  limit (goal 90%), the int8 scores' share of the probe, and the 4-bit formats' goal (q4_0
  and q4_1 at no less than the 8-bit formats' share of the limit, and 1.6x faster than
  q8_0 at 16384 positions).
- in cache: ns per position and kv head of kvcore on one thread over a cache small enough
  to stay in the CPU caches (the slope between 128 and 512 positions, so fixed costs
  cancel), and the FMAs' share of it (2 * G * D multiply-adds at the measured rate): how
  efficiently the kernel runs its arithmetic, memory aside. Beside it the kernel's floor:
  its score block and value block alone (`kvcore._attention.tile_blocks`: the kernel's
  own code over one tile of 64 positions in L1, without the scale gathers, softmax,
  prefetch and merging), the FMAs' share of their sum (the highest `% limit` this
  kernel's arithmetic allows), and their share of the whole call's time.
- kvcore: `kvcore.decode_attention` on a KVCache in each format, and in the K/V pairs
  (`_benchlib.PAIRS`: K in the first format, V in the second; the goal lines are the
  formats'); "<fmt> scores=int8" (int8, q8_0, q4_0, q4_1): the opt-in int8 scores
  (`scores="int8"`: integer dot products, VNNI where the CPU has it), whose limit is the
  slower of the probe and the FMA time of the weighted sum of V alone (G * D float32
  multiply-adds per position and kv head: the scores are not float32 multiply-adds, the
  values still are; at G = 4 they bind the 4-bit formats on 2-FMA-pipe cores);
- numpy: float32 grouped matmul on head-major [Hkv, n, D] K/V (the stable softmax in
  between); numpy's BLAS runs its default threads whatever the row says;
- torch: `scaled_dot_product_attention` float32, [1, Hkv, n, D] K/V, enable_gqa=True.
- variants (docs/variants.md): what soft-capping (softcap=50) and sink logits cost a
  decode call at 4096 positions, and a sliding window of 4096 at 32768 positions, each
  against the plain call at 4096 in the same rounds (goal: at most 1.10x). The windowed
  caches are cycled so that the bytes the window reads pass twice the last-level cache.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from typing import Callable, Sequence

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _benchlib import PAIRS, best_time, best_times, copy_bandwidth, print_table  # noqa: E402

import kvcore  # noqa: E402
from kvcore import _attention  # noqa: E402
from kvcore._attention import fma_burn, stream_sum  # noqa: E402

HQ, HKV, D = 32, 8, 128
EIGHT_BIT = ("int8", "fp8_e4m3", "fp8_e5m2", "q8_0")
INT8_SCORES = ("int8", "q8_0", "q4_0", "q4_1")     # also timed with scores="int8"


def _labels() -> list[str]:
    """The kvcore rows: every format and pair, then the int8-scores rows."""
    return [*kvcore.formats.ROW_FORMATS, *PAIRS, *(f"{f} scores=int8" for f in INT8_SCORES)]


def _split_label(label: str) -> tuple[str, str]:
    """(format, scores) of a kvcore row's label."""
    fmt, _, scores = label.partition(" scores=")
    return fmt, scores or "float32"


def _llc_bytes() -> int:
    """Size of the last-level cache (32 MiB when the system does not say)."""
    try:
        with open("/sys/devices/system/cpu/cpu0/cache/index3/size") as f:
            text = f.read().strip()
        return int(text[:-1]) * {"K": 2**10, "M": 2**20}[text[-1]]
    except (OSError, ValueError, KeyError):
        return 32 * 2**20


def _copies(nbytes: int) -> int:
    """How many copies of nbytes pass twice the last-level cache (2 at least)."""
    return max(2, math.ceil(2 * _llc_bytes() / nbytes))


def _cycled_time(calls: Sequence[Callable[[], object]], rounds: int) -> float:
    """Median seconds of one call, the calls made in turn (each reads other memory)."""
    for fn in calls[:2]:
        fn()
    times = []
    for _ in range(rounds):
        for fn in calls:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return float(np.median(times))


def _rounds(copies: int) -> int:
    return max(2, 24 // copies)


def _paired_time(calls: Sequence[Callable[[], object]], probes: Sequence[Callable[[], object]],
                 rounds: int) -> tuple[float, float]:
    """Median seconds of one call and of one probe, made in turn: call i reads copy i, then
    the probe reads the copy half the cycle away (not in the caches either)."""
    c = len(calls)
    for i in range(min(2, c)):
        calls[i]()
        probes[(i + c // 2) % c]()
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(rounds):
        for i in range(c):
            for fn, ts in ((calls[i], times[0]), (probes[(i + c // 2) % c], times[1])):
                t0 = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t0)
    return float(np.median(times[0])), float(np.median(times[1]))


def _fma_rate(seconds: float = 0.005) -> float:
    """float32 multiply-adds per second on num_threads() threads, over about `seconds`."""
    rounds = 1000
    while True:
        t0 = time.perf_counter()
        done = fma_burn(rounds)
        dt = time.perf_counter() - t0
        if dt >= seconds:
            return done / dt
        rounds *= 2 if dt <= 0 else max(2, math.ceil(seconds / dt))


def _cache(fmt: str, k: np.ndarray, v: np.ndarray) -> kvcore.KVCache:
    """A one-layer KVCache in fmt holding K/V [n, HKV, D] (capacity n)."""
    spec = kvcore.KVSpec(num_layers=1, num_kv_heads=HKV, head_dim=D, capacity=k.shape[0],
                         num_heads=HQ, format=fmt)
    cache = kvcore.KVCache(spec)
    cache.append(0, k, v)
    cache.advance()
    return cache


def _kvcore_calls(label: str, k: np.ndarray, v: np.ndarray, q: np.ndarray):
    """Calls of decode_attention on copies of one cache in the label's format and scores,
    the probe's calls on the same copies' storage; bytes one call reads."""
    fmt, scores = _split_label(label)
    first = _cache(fmt, k, v)
    nbytes = first.spec.memory_bytes
    caches = [first] + [_cache(fmt, k, v) for _ in range(_copies(nbytes) - 1)]
    out = np.empty_like(q)
    assert all(c.memory_bytes == nbytes for c in caches)   # the probe reads the 12 KiB of gaps too
    return ([lambda c=c: kvcore.decode_attention(q, c, 0, out=out, scores=scores) for c in caches],
            [lambda c=c: stream_sum(c._storage) for c in caches], nbytes)


def _in_cache_ns(label: str, q: np.ndarray, rng: np.random.Generator,
                 sizes: tuple[int, int] = (128, 512), calls: int = 100, rounds: int = 5) -> float:
    """ns per position and kv head of decode_attention in the label's format and scores on
    the current threads, the cache in the CPU caches: the slope between the two sizes,
    fastest of `rounds`."""
    fmt, scores = _split_label(label)
    caches = {n: _cache(fmt, *rng.standard_normal((2, n, HKV, D), dtype=np.float32))
              for n in sizes}
    out = np.empty_like(q)
    small, large = best_times([lambda c=c: kvcore.decode_attention(q, c, 0, out=out, scores=scores)
                               for c in caches.values()], repeat=rounds, warmup=1, number=calls)
    return (large - small) / ((sizes[1] - sizes[0]) * HKV) * 1e9


def _blocks_ns(label: str, rng: np.random.Generator, rounds: int = 5) -> tuple[float, float] | None:
    """ns per position and kv head (G = HQ / HKV query rows) of the kernel's score block and
    value block alone, on one thread, over one tile of `_attention.TILE` positions in the
    L1 cache (`_attention.tile_blocks`: no scale gathers, softmax, prefetch or merging),
    the fastest of `rounds`; None for a format the split kernel does not read (q4_1ch)."""
    fmt, scores = _split_label(label)
    kf, vf = kvcore.formats.get_pair(fmt)
    if kf.group or vf.group:
        return None
    tile = _attention.TILE
    times = []
    for part, f in ((0, kf), (1, vf)):
        codes, scales = kvcore.quantize(rng.standard_normal((tile, D), dtype=np.float32), f.name)
        codes = np.ascontiguousarray(codes).view(np.uint8).reshape(tile, -1)
        scales = np.ascontiguousarray(scales, dtype=np.float32).reshape(tile, -1) if f.block else None
        reps = 20000
        best = best_time(lambda: _attention.tile_blocks(f.id, codes, scales, D, part, reps,
                                                        scores == "int8" and part == 0),
                         repeat=rounds, warmup=0)
        times.append(best / (reps * tile) * 1e9)
    return times[0], times[1]


def _numpy_calls(k: np.ndarray, v: np.ndarray, q: np.ndarray):
    """numpy float32 grouped matmul: s = q K^T per kv head, softmax, s V."""
    kh = np.ascontiguousarray(k.transpose(1, 0, 2))  # [Hkv, n, D]
    vh = np.ascontiguousarray(v.transpose(1, 0, 2))
    nbytes = kh.nbytes + vh.nbytes
    sets = [(kh, vh)] + [(kh.copy(), vh.copy()) for _ in range(_copies(nbytes) - 1)]
    qg = q.reshape(HKV, HQ // HKV, D) * np.float32(1 / math.sqrt(D))

    def call(kk, vv):
        s = np.matmul(qg, kk.transpose(0, 2, 1))       # [Hkv, G, n]
        s -= s.max(axis=-1, keepdims=True)
        np.exp(s, out=s)
        s /= s.sum(axis=-1, keepdims=True)
        return np.matmul(s, vv)                        # [Hkv, G, D]
    return [lambda kk=kk, vv=vv: call(kk, vv) for kk, vv in sets], nbytes


def _torch_calls(torch, k: np.ndarray, v: np.ndarray, q: np.ndarray):
    """torch SDPA float32 with enable_gqa on [1, Hkv, n, D] K/V."""
    kh = torch.from_numpy(np.ascontiguousarray(k.transpose(1, 0, 2)))[None]
    vh = torch.from_numpy(np.ascontiguousarray(v.transpose(1, 0, 2)))[None]
    nbytes = 2 * kh.numel() * 4
    sets = [(kh, vh)] + [(kh.clone(), vh.clone()) for _ in range(_copies(nbytes) - 1)]
    qt = torch.from_numpy(q)[None, :, None, :]           # [1, Hq, 1, D]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    return [lambda kk=kk, vv=vv: sdpa(qt, kk, vv, enable_gqa=True) for kk, vv in sets], nbytes


def main(argv: Sequence[str] = ()) -> dict[str, object]:
    """Runs with command-line style arguments (none: the defaults; tools/bench_cpu.py
    calls it that way). Returns the figures: {"times": {(implementation, threads):
    {context: (seconds, bytes read)}}, "probe": {(format, threads): {context: (seconds,
    bytes)}}, "fma": {threads: float32 multiply-adds per second}, "in_cache_ns": {format:
    ns per position and kv head in cache, 1 thread}, "copy_GBps": np.copyto bandwidth}
    (for --plot)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--variant-formats", nargs="+", default=["f16", "int8"],
                        help="formats of the variants section")
    parser.add_argument("--variants-only", action="store_true",
                        help="run only the variants section")
    args = parser.parse_args(argv)
    if args.variants_only:
        return {"variants": variants(args.variant_formats, args.threads)}
    try:
        import torch
    except ImportError:
        torch = None
    rng = np.random.default_rng(0)
    q = rng.standard_normal((HQ, D), dtype=np.float32)
    results: dict[tuple[str, int], dict[int, tuple[float, float]]] = {}
    probe: dict[tuple[str, int], dict[int, tuple[float, float]]] = {}
    bursts: dict[int, list[float]] = {}
    for n in args.contexts:
        k = rng.standard_normal((n, HKV, D), dtype=np.float32)
        v = rng.standard_normal((n, HKV, D), dtype=np.float32)
        ours = {label: _kvcore_calls(label, k, v, q) for label in _labels()}
        peers = {"numpy f32 grouped matmul": _numpy_calls(k, v, q)}
        if torch is not None:
            peers["torch SDPA f32 enable_gqa"] = _torch_calls(torch, k, v, q)
        for threads in args.threads:
            kvcore.set_num_threads(threads)
            if torch is not None:
                torch.set_num_threads(threads)
            for fmt, (calls, probes, nbytes) in ours.items():
                bursts.setdefault(threads, []).append(_fma_rate())
                secs, psecs = _paired_time(calls, probes, _rounds(len(calls)))
                results.setdefault((f"kvcore {fmt}", threads), {})[n] = (secs, nbytes)
                probe.setdefault((fmt, threads), {})[n] = (psecs, nbytes)
            for name, (calls, nbytes) in peers.items():
                secs = _cycled_time(calls, _rounds(len(calls)))
                results.setdefault((name, threads), {})[n] = (secs, nbytes)
        del ours, peers
    kvcore.set_num_threads(0)
    fma = {t: float(np.median(b)) for t, b in bursts.items()}

    def probe_gbps(name: str, threads: int, n: int) -> float:
        """The probe's GB/s over the bytes `name` reads (the peers': the f32 cache's)."""
        fmt = name.removeprefix("kvcore ") if name.startswith("kvcore ") else "f32"
        psecs, nbytes = probe[(fmt, threads)][n]
        return nbytes / psecs / 1e9

    def fma_secs(name: str, threads: int, n: int) -> float:
        """Seconds of a call's float32 multiply-adds at the measured rate: 2 * G * D per
        position and kv head (int8 scores: G * D, the weighted sum's alone)."""
        return (1 if name.endswith(" scores=int8") else 2) * HQ * D * n / fma[threads]

    def limit_gbps(name: str, threads: int, n: int) -> float:
        """GB/s over `name`'s bytes at the slower of the probe and the FMA limit."""
        nbytes = results[(name, threads)][n][1]
        return min(probe_gbps(name, threads, n), nbytes / fma_secs(name, threads, n) / 1e9)

    header = ["implementation", "threads"]
    for n in args.contexts:
        header += [f"us @{n}", f"GB/s @{n}", f"% probe @{n}", f"% limit @{n}", f"x torch @{n}"]
    rows = []
    for (name, threads), per_n in results.items():
        row = [name, threads]
        for n in args.contexts:
            secs, nbytes = per_n[n]
            ref = results.get(("torch SDPA f32 enable_gqa", threads), {}).get(n)
            gbps = nbytes / secs / 1e9
            row += [secs * 1e6, gbps, f"{gbps / probe_gbps(name, threads, n):.0%}",
                    f"{gbps / limit_gbps(name, threads, n):.0%}", ref[0] / secs if ref else "-"]
        rows.append(row)
    print_table(f"Decode attention, 1 new token, Hq={HQ}, Hkv={HKV}, D={D}, batch 1, "
                f"K/V cycled past the {_llc_bytes() >> 20} MiB last-level cache", header, rows)
    if torch is None:
        print("\ntorch SDPA f32 enable_gqa: torch not installed")
    print_table("Streaming-read probe: the same bytes summed on the same threads, GB/s",
                ["format", "threads"] + [f"@{n}" for n in args.contexts],
                [[fmt, t] + [per_n[n][1] / per_n[n][0] / 1e9 for n in args.contexts]
                 for (fmt, t), per_n in probe.items()])
    print_table("FMA limit: 2 * G * D float32 multiply-adds per position and kv head (int8 "
                "scores: G * D) at the measured FMA rate, as GB/s of each format's bytes (the "
                "probe's in brackets)",
                ["format", "threads", "G FMA/s"] + [f"@{n}" for n in args.contexts],
                [[fmt, t, fma[t] / 1e9] + [
                    f"{per_n[n][1] / fma_secs(fmt, t, n) / 1e9:.1f} "
                    f"({per_n[n][1] / per_n[n][0] / 1e9:.1f})" for n in args.contexts]
                 for (fmt, t), per_n in probe.items()])
    kvcore.set_num_threads(1)
    fma1 = fma.get(1) or _fma_rate()
    fma_ns = 2 * (HQ // HKV) * D / fma1 * 1e9
    in_cache = {label: _in_cache_ns(label, q, rng) for label in _labels()}
    blocks = {label: _blocks_ns(label, rng) for label in _labels()}
    kvcore.set_num_threads(0)

    def blocks_row(label: str) -> list[object]:
        b = blocks[label]
        if b is None:
            return ["-"] * 5
        fmas = fma_ns / 2 if label.endswith(" scores=int8") else fma_ns   # the values' FMAs
        return [b[0], b[1], b[0] + b[1], f"{fmas / (b[0] + b[1]):.0%}",
                f"{(b[0] + b[1]) / in_cache[label]:.0%}"]
    print_table(f"In cache, 1 thread: ns per position and kv head (the slope between 128 and "
                f"512 positions) and the FMAs' share of it ({fma_ns:.1f} ns at "
                f"{fma1 / 1e9:.1f} G multiply-adds/s); the kernel's score and value blocks "
                f"alone over one tile in L1 (the floor of its arithmetic), the FMAs' share of "
                f"them (the float32 multiply-adds they do: for int8 scores the values' only), "
                f"and their share of the whole",
                ["format", "ns", "FMA share", "scores alone", "values alone", "blocks",
                 "FMA share of blocks", "blocks / ns"],
                [[fmt, ns, f"{fma_ns / ns:.0%}", *blocks_row(fmt)] for fmt, ns in in_cache.items()])
    copy = copy_bandwidth(256 * 2**20)
    print(f"\nnp.copyto bandwidth (read + write): {copy:.1f} GB/s")
    for n in [c for c in (4096, 16384) if c in args.contexts]:
        for threads in args.threads:
            for what, bound in (("the probe", probe_gbps), ("the limit", limit_gbps)):
                share = {}
                for fmt in kvcore.formats.ROW_FORMATS:
                    secs, nbytes = results[(f"kvcore {fmt}", threads)][n]
                    share[fmt] = nbytes / secs / 1e9 / bound(f"kvcore {fmt}", threads, n)
                low, high = min(share, key=share.get), max(share, key=share.get)
                print(f"goal @{n}, {threads} thread{'s' if threads > 1 else ''}: every format "
                      f"at >= 90% of {what}; lowest {low} {share[low]:.0%}, highest {high} "
                      f"{share[high]:.0%}")
            eight, four = ("int8", "fp8_e4m3", "fp8_e5m2", "q8_0"), ("q4_0", "q4_1")
            lim = {f: _gbps(results[(f"kvcore {f}", threads)][n]) / limit_gbps(f"kvcore {f}", threads, n)
                   for f in eight + four}
            q8 = results[("kvcore q8_0", threads)][n][0]
            print(f"goal @{n}, {threads} thread{'s' if threads > 1 else ''}, 4-bit: % of the limit "
                  + ", ".join(f"{f} {lim[f]:.0%}" for f in four)
                  + f" (>= the 8-bit formats': {min(lim[f] for f in eight):.0%}-"
                  f"{max(lim[f] for f in eight):.0%}); x faster than q8_0: "
                  + ", ".join(f"{f} {q8 / results[(f'kvcore {f}', threads)][n][0]:.2f}" for f in four)
                  + " (>= 1.6 at 16384)")
            share = {f: _gbps(results[(f"kvcore {f} scores=int8", threads)][n])
                     / probe_gbps(f"kvcore {f} scores=int8", threads, n) for f in INT8_SCORES}
            print(f"goal @{n}, {threads} thread{'s' if threads > 1 else ''}, int8 scores: "
                  + ", ".join(f"{f} {x:.0%}" for f, x in share.items())
                  + " of the probe (>= 90%); float32 scores: "
                  + ", ".join(f"{f} {_gbps(results[(f'kvcore {f}', threads)][n]) / probe_gbps(f'kvcore {f}', threads, n):.0%}"
                              for f in INT8_SCORES))
    return {"times": results, "probe": probe, "fma": fma, "in_cache_ns": in_cache, "blocks_ns": blocks,
            "copy_GBps": copy, "variants": variants(args.variant_formats, args.threads)}


def _gbps(timed: tuple[float, float]) -> float:
    """GB/s of a (seconds, bytes) figure."""
    return timed[1] / timed[0] / 1e9


VARIANT_N, VARIANT_W, VARIANT_LONG = 4096, 4096, 32768


def variants(formats: Sequence[str], threads_list: Sequence[int],
             rounds: int = 15) -> dict[tuple[str, int], dict[str, float]]:
    """The variants' cost: seconds of one decode call (Hq = 32, Hkv = 8, D = 128, one new
    token) per format and thread count: plain, softcap=50 and sinks at VARIANT_N
    positions, window=VARIANT_W at VARIANT_LONG positions. Each round times every kind in
    turn (the order reversed every other round), a kind's time being its fastest call over
    one pass of its copies (each past the last-level cache); the figures are the medians
    over the rounds of those times and of each kind's time over the plain call's in the
    same round, which a change of the machine's load between rounds does not skew.
    Prints the table; returns {(format, threads): {kind: seconds, kind + " x": ratio}}."""
    rng = np.random.default_rng(1)
    q = rng.standard_normal((HQ, D), dtype=np.float32)
    out = np.empty_like(q)
    sinks = rng.standard_normal(HQ, dtype=np.float32)
    results: dict[tuple[str, int], dict[str, float]] = {}
    for fmt in formats:
        k = rng.standard_normal((VARIANT_LONG, HKV, D), dtype=np.float32)
        v = rng.standard_normal((VARIANT_LONG, HKV, D), dtype=np.float32)
        short = _cache(fmt, k[-VARIANT_N:], v[-VARIANT_N:])
        shorts = [short] + [_cache(fmt, k[-VARIANT_N:], v[-VARIANT_N:])
                            for _ in range(_copies(short.spec.memory_bytes) - 1)]
        window_bytes = short.spec.memory_bytes * VARIANT_W // VARIANT_N
        longs = [_cache(fmt, k, v) for _ in range(_copies(window_bytes))]
        kinds: dict[str, list[Callable[[], object]]] = {
            "plain": [lambda c=c: kvcore.decode_attention(q, c, 0, out=out) for c in shorts],
            "softcap": [lambda c=c: kvcore.decode_attention(q, c, 0, out=out, softcap=50.0)
                        for c in shorts],
            "sinks": [lambda c=c: kvcore.decode_attention(q, c, 0, out=out, sinks=sinks)
                      for c in shorts],
            "window": [lambda c=c: kvcore.decode_attention(q, c, 0, out=out, window=VARIANT_W)
                       for c in longs],
        }
        for threads in threads_list:
            kvcore.set_num_threads(threads)
            times: dict[str, list[float]] = {name: [] for name in kinds}
            for calls in kinds.values():
                calls[0]()
            for r in range(rounds):
                order = list(kinds) if r % 2 == 0 else list(kinds)[::-1]
                for name in order:
                    best = math.inf
                    for fn in kinds[name]:
                        t0 = time.perf_counter()
                        fn()
                        best = min(best, time.perf_counter() - t0)
                    times[name].append(best)
            res = {name: float(np.median(t)) for name, t in times.items()}
            res.update({f"{name} x": float(np.median(np.array(t) / np.array(times["plain"])))
                        for name, t in times.items()})
            results[(fmt, threads)] = res
        del shorts, longs, kinds
    kvcore.set_num_threads(0)
    rows = []
    for (fmt, threads), t in results.items():
        rows.append([fmt, threads, t["plain"] * 1e6] + [
            x for kind in ("softcap", "sinks", "window")
            for x in (t[kind] * 1e6, f"{t[kind + ' x']:.3f}")])
    print_table(f"Variants: decode, 1 new token, Hq={HQ}, Hkv={HKV}, D={D}, K/V past the "
                f"last-level cache; softcap=50 and sinks at {VARIANT_N} positions, "
                f"window={VARIANT_W} at {VARIANT_LONG}, each over plain at {VARIANT_N} "
                f"(goal <= 1.10)",
                ["format", "threads", f"plain us @{VARIANT_N}", "softcap us", "x plain",
                 "sinks us", "x plain", f"window us @{VARIANT_LONG}", "x plain"], rows)
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
