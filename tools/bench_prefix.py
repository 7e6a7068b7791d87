"""Prefix cache benchmarks, peers measured in the same run.

    python tools/bench_prefix.py        (or: python tools/bench_cpu.py --only prefix)

Match and commit, a 4,096-token prompt, pages of 16 (256 pages, each keyed by a chained
SHA-256): `match_prefix` of a prompt whose pages are all cached (255 pages found, the
last token left to compute), of one whose first page misses, and the commit
(`advance(seq, tokens=...)` of 4,096 positions: keys and registers 256 pages; the
append before it is not timed), and the commit of a decode step (one id; a page
registered every 16th step). Peers: one decode step of a 32-layer model in the same
run, its cache writes (32 `KVCache.append` of one f16 position [8, 128], then
`advance`) and its attention (32 `decode_attention` calls, Hq 32, over 4,096 f16
positions, 1 thread and kvcore.max_threads()).

Serving trace: requests over a few shared system prompts (each request: one of 4
prompts of 1,024 tokens, then its own 64-512 tokens, then 32 decoded tokens), 16 at a
time in a pool of 2,048 pages, admitted with `match_prefix` and committed with their
token ids; reports the hit rate (pages found / full pages asked for), the prompt
positions not recomputed, the pages saved at the peak (pages the running requests
reference, counted once per reference, against the pages in use) and evictions.
"""
from __future__ import annotations

import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _benchlib import median_time, print_table  # noqa: E402

import kvcore  # noqa: E402

PROMPT, PAGE = 4096, 16


def _tiny_pool(num_pages: int) -> kvcore.KVPool:
    """A 1-layer pool of small rows: the prefix cache's cost does not depend on them."""
    spec = kvcore.KVSpec(num_layers=1, num_kv_heads=1, head_dim=8, capacity=PROMPT,
                         format="f16")
    return kvcore.KVPool(spec, num_pages=num_pages, page_size=PAGE, prefix_cache=True)


def _commit_time(rounds: int = 9) -> float:
    """Median seconds of advance(seq, tokens=4,096 new ids): keys + registers 256 pages."""
    pool = _tiny_pool(PROMPT // PAGE)
    kv = np.zeros((PROMPT, 1, 8), np.float32)
    times = []
    for r in range(rounds):
        s = pool.new_sequence()
        pool.append(kv, kv, seq=s, layer=0)             # evicts the last round's cached pages
        ids = np.arange(PROMPT, dtype=np.int64) + r * PROMPT
        t0 = time.perf_counter()
        pool.advance(s, tokens=ids)
        times.append(time.perf_counter() - t0)
        pool.free(s)
    return float(np.median(times[2:]))


def _decode_commit_time(steps: int = 256) -> float:
    """Mean seconds of advance(seq, tokens=[id]) over `steps` one-position steps (the
    append before each is not timed)."""
    pool = _tiny_pool(steps // PAGE + 1)
    kv = np.zeros((1, 1, 8), np.float32)
    s = pool.new_sequence()
    spent = 0.0
    for i in range(steps):
        pool.append(kv, kv, seq=s, layer=0)
        t0 = time.perf_counter()
        pool.advance(s, tokens=[i])
        spent += time.perf_counter() - t0
    return spent / steps


def _match_times() -> tuple[float, float]:
    """Median seconds of match_prefix (+ free) of a cached 4,096-token prompt, of a miss."""
    pool = _tiny_pool(PROMPT // PAGE)
    ids = np.arange(PROMPT, dtype=np.int64)
    s = pool.new_sequence()
    kv = np.zeros((PROMPT, 1, 8), np.float32)
    pool.append(kv, kv, seq=s, layer=0)
    pool.advance(s, tokens=ids)
    pool.free(s)

    def match(tokens):
        def run():
            t, n = pool.match_prefix(tokens)
            pool.free(t)
        return run
    hit = median_time(match(ids), repeat=9)
    other = ids + PROMPT
    miss = median_time(match(other), repeat=9)
    t, n = pool.match_prefix(ids)
    assert n == PROMPT - PAGE, n
    return hit, miss


def _step_peers() -> dict[str, float]:
    """Seconds of the peers: a decode step's cache writes and its attention at 4,096."""
    spec = kvcore.KVSpec(num_layers=32, num_kv_heads=8, head_dim=128, capacity=64,
                         num_heads=32, format="f16")
    cache = kvcore.KVCache(spec)
    rng = np.random.default_rng(0)
    k = rng.standard_normal((8, 128), dtype=np.float32)

    def step():
        if cache.length == spec.capacity:
            cache.truncate(0)
        for layer in range(32):
            cache.append(layer, k, k)
        cache.advance()
    write = median_time(step, repeat=31, number=8)
    one = kvcore.KVCache(spec.replace(num_layers=1, capacity=PROMPT))
    kv = rng.standard_normal((PROMPT, 8, 128), dtype=np.float32)
    one.append(0, kv, kv)
    one.advance()
    q = rng.standard_normal((32, 128), dtype=np.float32)
    out = np.empty_like(q)
    before = kvcore.max_threads()
    attend = {}
    for threads in sorted({1, before}):
        kvcore.set_num_threads(threads)
        attend[threads] = 32 * median_time(lambda: kvcore.decode_attention(q, one, 0, out=out),
                                           repeat=9)
    kvcore.set_num_threads(before)
    peers = {"decode step cache writes (32 KVCache.append f16 [8, 128] + advance)": write}
    for threads, secs in attend.items():
        peers[f"decode step attention (32 layers x 4,096 f16 positions, {threads} "
              f"thread{'s' if threads > 1 else ''})"] = secs
    return peers


def serving_trace(requests: int = 160, *, prompts: int = 4, system: int = 1024,
                  batch: int = 16, num_pages: int = 2048, seed: int = 0) -> dict:
    """Runs the trace (see the module docstring); returns its figures."""
    rng = np.random.default_rng(seed)
    spec = kvcore.KVSpec(num_layers=1, num_kv_heads=1, head_dim=8, capacity=2048,
                         format="f16")
    pool = kvcore.KVPool(spec, num_pages=num_pages, page_size=PAGE, prefix_cache=True)
    systems = [rng.integers(0, 32000, system) for _ in range(prompts)]
    kv = np.zeros((spec.capacity, 1, 8), np.float32)
    queue = [np.concatenate([systems[rng.integers(prompts)],
                             rng.integers(0, 32000, int(rng.integers(64, 513)))])
             for _ in range(requests)]
    running: dict[int, list] = {}     # seq -> [tokens left to decode, next token]
    prompt_positions = matched = peak_refs = peak_used = 0
    spent = 0.0
    while queue or running:
        while queue and len(running) < batch:
            tokens = queue.pop()
            t0 = time.perf_counter()
            s, n = pool.match_prefix(tokens)
            spent += time.perf_counter() - t0
            pool.append(kv[:len(tokens) - n], kv[:len(tokens) - n], seq=s, layer=0)
            t0 = time.perf_counter()
            pool.advance(s, tokens=tokens[n:])
            spent += time.perf_counter() - t0
            prompt_positions += len(tokens)
            matched += n
            running[s] = [32, int(tokens[-1])]
        seqs = list(running)
        pool.append_batch(kv[:len(seqs)], kv[:len(seqs)], seqs=seqs, layer=0)
        pool.advance(seqs, tokens=[[running[s][1] + 1] for s in seqs])
        refs = sum(len(pool.page_table(s)) for s in seqs)
        if refs - pool.num_used_pages > peak_refs - peak_used:
            peak_refs, peak_used = refs, pool.num_used_pages
        for s in seqs:
            running[s][0] -= 1
            running[s][1] += 1
            if running[s][0] == 0:
                pool.free(s)
                del running[s]
    st = pool.stats
    return {"requests": requests, "hit_rate": st.hits / max(1, st.hits + st.misses),
            "matched": matched / prompt_positions, "peak_refs": peak_refs,
            "peak_used": peak_used, "evictions": st.evictions,
            "us_per_request": spent / requests * 1e6}


def main() -> None:
    commit = _commit_time()
    hit, miss = _match_times()
    peers = _step_peers()
    rows = [["match_prefix, all 256 pages cached (4,080 positions found) + free", hit * 1e6],
            ["match_prefix, first page misses + free", miss * 1e6],
            ["commit: advance(seq, tokens=4,096 ids), 256 pages keyed and registered",
             commit * 1e6],
            ["commit while decoding: advance(seq, tokens=[id]), mean of 256 steps "
             "(a page registered every 16th)", _decode_commit_time() * 1e6]]
    rows += [[name, secs * 1e6] for name, secs in peers.items()]
    print_table(f"Prefix cache, a {PROMPT:,}-token prompt, pages of {PAGE}, against one "
                "decode step of a 32-layer model (Hkv 8, D 128)", ["operation", "us"], rows)
    t = serving_trace()
    print_table(f"Serving trace: {t['requests']} requests over 4 system prompts of 1,024 "
                "tokens (+ 64-512 own tokens, 32 decoded), 16 at a time, 2,048 pages of 16",
                ["hit rate (pages)", "prompt positions matched", "pages referenced at peak",
                 "pages in use then", "pages saved", "evictions", "match + commit us / request"],
                [[t["hit_rate"], t["matched"], t["peak_refs"], t["peak_used"],
                  t["peak_refs"] - t["peak_used"], t["evictions"], t["us_per_request"]]])


if __name__ == "__main__":
    main()
