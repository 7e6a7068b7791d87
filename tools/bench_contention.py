"""kvcore under contention: busy processes competing for the same cores.

    python tools/bench_contention.py     (or: python tools/bench_cpu.py --only contention)

For 0, 1 and 2 competing processes (`python -c "while True: pass"`, started and killed
by this script, by pid), each workload at three thread settings, timed in turn within
each round: 1 thread; kvcore.max_threads() threads as kvcore runs them (the work cut for
that many threads, run on the CPUs that other runnable threads leave idle:
kvcore/_parallel.pyx, 5.); the same with that adaptation off (every split on its own
thread, whatever the load). kvcore before both changes: that last row with libgomp's
default wait (`GOMP_SPINCOUNT=300000 python tools/bench_contention.py`). Workloads:
decode_attention over one KVCache layer of 4096 positions (Hq 32, Hkv 8, D 128; f16 and
int8) and the demo's decode loop (`python -m kvcore demo --quick`: 4 layers, a 128-token
prompt, 8 new tokens, int8; per token). Ratio: time / the 1-thread time under the same
contention (<= 1: no slower).
How kvcore's OpenMP workers wait (kvcore/_omp_env.py) is printed above the table.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _benchlib import print_table  # noqa: E402

import kvcore  # noqa: E402
from kvcore import _demo, _omp_env, _parallel  # noqa: E402

HQ, HKV, D, N = 32, 8, 128, 4096
ROUNDS = 9


def _attention_call(fmt: str, rng):
    spec = kvcore.KVSpec(num_layers=1, num_kv_heads=HKV, head_dim=D, capacity=N,
                         num_heads=HQ, format=fmt)
    cache = kvcore.KVCache(spec)
    k = rng.standard_normal((N, HKV, D), dtype=np.float32)
    cache.append(0, k, k)
    cache.advance()
    q = rng.standard_normal((HQ, D), dtype=np.float32)
    out = np.empty_like(q)

    def calls():   # 8 calls: seconds per call = time / 8
        for _ in range(8):
            kvcore.decode_attention(q, cache, 0, out=out)
    return calls, 8


def _demo_loop(rng):
    pools = _demo.model_pools(rng, 256, HKV, HQ, D)
    q = _demo.QUICK
    return lambda: _demo.decode_format("int8", pools, layers=q.layers, prompt=q.prompt,
                                       steps=q.steps)[1], q.steps


def _settings(threads: int):
    """(name, fn running a timed call under that setting) of the three thread settings."""
    def under(nt, adaptive):
        def run(fn):
            kvcore.set_num_threads(nt)
            before = _parallel.set_adaptive(adaptive)
            try:
                return fn()
            finally:
                _parallel.set_adaptive(before)
                kvcore.set_num_threads(threads)
        return run
    return [("1", under(1, True)), (f"{threads} (kvcore)", under(threads, True)),
            (f"{threads}, not adaptive", under(threads, False))]


def _timed(fn) -> float:
    """Seconds of fn: what it returns when it times itself (the demo loop), else the wall."""
    t0 = time.perf_counter()
    got = fn()
    return got if isinstance(got, float) else time.perf_counter() - t0


def main(argv=None) -> None:
    threads = kvcore.max_threads()
    rng = np.random.default_rng(0)
    work = {f"decode_attention {fmt}, {N} positions": _attention_call(fmt, rng)
            for fmt in ("f16", "int8")}
    work["demo decode loop (--quick, int8), per token"] = _demo_loop(rng)
    settings = _settings(threads)
    rows = []
    for busy in (0, 1, 2):
        procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                 for _ in range(busy)]
        try:
            time.sleep(0.2)   # the competitors are running
            times = {(w, s): [] for w in work for s, _ in settings}
            for r in range(ROUNDS):
                for w, (fn, per) in work.items():
                    for s, run in settings:
                        secs = run(lambda: _timed(fn)) / per
                        if r:
                            times[w, s].append(secs)
        finally:
            for p in procs:
                p.kill()
                p.wait()
        for w in work:
            one = float(np.median(times[w, "1"]))
            for s, _ in settings:
                t = float(np.median(times[w, s]))
                rows.append([w, busy, s, t * 1e6, t / one])
    print(f"\nkvcore's OpenMP workers wait: {_omp_env.WAIT}")
    print_table(f"Contention: busy competing processes on the {os.cpu_count()} CPUs",
                ["workload", "competing processes", "threads", "us / call", "vs 1 thread"],
                rows)


if __name__ == "__main__":
    main()
