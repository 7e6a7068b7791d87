"""CPU benchmarks, every section against peers measured in the same run.

    python tools/bench_cpu.py [--only step,quant,attention,prefill,snapshot,pool,prefix,store,accuracy,contention] [--plot DIR]

step: one decode step (append one position of K and V, [8, 128] float32, to each of 32
layers, then advance) in KVCache against a preallocated numpy cache written by slice
assignment and against growth by np.concatenate (how HF's DynamicCache grows). As in
decoding, every step writes positions that were never written before (the caches' pages
are touched first, so no page faults are timed); plus the time of one `append` call. The other sections live in bench_<section>.py beside
this file, each with a main() (attention: decode attention against a streaming-read
probe and peers; prefill: causal prefill against torch SDPA is_causal; pool: paged
attention, the step's writes and its overhead around the kernels; contention: busy
processes competing for the cores, against one thread). --plot DIR
writes PNGs (matplotlib, the `bench` extra) of
the sections that draw: attention (GB/s against context per format, beside the peers)
and accuracy (round-trip and attention error per format), captioned with the command
and the machine.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from typing import Callable

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _benchlib import print_table  # noqa: E402

import kvcore  # noqa: E402

LAYERS, HEADS, HEAD_DIM = 32, 8, 128
STEPS = 256          # steps per timed batch
ROUNDS = 11          # timed batches of each implementation (2 of them warm-up)
CAPACITY = 4096      # the cache: batch r writes positions [T0 + r * STEPS, T0 + (r + 1) * STEPS)
T0 = CAPACITY - ROUNDS * STEPS   # so every batch writes positions never written before
CONCAT_T = 1024      # concatenation copies the whole history each step: measured here


def _inputs(n: int) -> tuple[np.ndarray, np.ndarray]:
    """n distinct float32 [Hkv, D] steps for K and V: [n, Hkv, D] each."""
    rng = np.random.default_rng(0)
    return (rng.standard_normal((n, HEADS, HEAD_DIM), dtype=np.float32),
            rng.standard_normal((n, HEADS, HEAD_DIM), dtype=np.float32))


def _interleaved(fns: dict[str, Callable[[], object]], rounds: int = ROUNDS) -> dict[str, float]:
    """Median seconds of one call of each fn, the fns timed in turn within each round so
    that a change of machine load hits them alike (the first two rounds warm up)."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for r in range(rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            if r >= 2:
                times[name].append(time.perf_counter() - t0)
    return {name: float(np.median(ts)) for name, ts in times.items()}


def _kvcache_steps(fmt: str, ks: np.ndarray, vs: np.ndarray) -> Callable[[], None]:
    """A KVCache in `fmt` holding T0 positions; each call makes the next STEPS decode steps."""
    cache = kvcore.KVCache(kvcore.KVSpec(num_layers=LAYERS, num_kv_heads=HEADS,
                                         head_dim=HEAD_DIM, capacity=CAPACITY, format=fmt))
    cache._storage[:] = 0  # touch every page once, as a cache in use has been
    fill = np.zeros((T0, HEADS, HEAD_DIM), np.float32)
    for layer in range(LAYERS):
        cache.append(layer, fill, fill)
    cache.advance()
    append, advance = cache.append, cache.advance

    def steps():
        for s in range(STEPS):
            k, v = ks[s], vs[s]
            for layer in range(LAYERS):
                append(layer, k, v)
            advance()
    return steps


def _numpy_steps(ks: np.ndarray, vs: np.ndarray) -> Callable[[], None]:
    """The same steps into a preallocated [L, N, Hkv, D] float32 pair by slice assignment,
    each call at the next STEPS positions."""
    K = np.zeros((LAYERS, CAPACITY, HEADS, HEAD_DIM), np.float32)
    V = np.zeros_like(K)
    K[:] = 0  # touch every page once (np.zeros maps them lazily)
    V[:] = 0
    end = [T0]

    def steps():
        t = end[0]
        for s in range(STEPS):
            k, v = ks[s], vs[s]
            for layer in range(LAYERS):
                K[layer, t + s] = k
                V[layer, t + s] = v
        end[0] = t + STEPS
    return steps


def _time_concat(ks: np.ndarray, vs: np.ndarray, t: int, steps: int = 8) -> float:
    """Seconds per step of per-layer [Hkv, t, D] float32 arrays grown by np.concatenate
    along t (HF DynamicCache's torch.cat on dim -2), starting from t positions."""
    times = []
    for _ in range(3):
        K = [np.ones((HEADS, t, HEAD_DIM), np.float32) for _ in range(LAYERS)]
        V = [np.ones((HEADS, t, HEAD_DIM), np.float32) for _ in range(LAYERS)]
        t0 = time.perf_counter()
        for s in range(steps):
            k, v = ks[s][:, None], vs[s][:, None]
            for layer in range(LAYERS):
                K[layer] = np.concatenate([K[layer], k], axis=1)
                V[layer] = np.concatenate([V[layer], v], axis=1)
        times.append((time.perf_counter() - t0) / steps)
    return float(np.median(times))


def _append_calls(k: np.ndarray, v: np.ndarray, n: int = 64, batches: int = 50):
    """Call loops for the per-call cost of one KVCache.append of one f32 position [8, 128]
    (K and V) into layer 0, and of the numpy peer (two slice assignments): n positions
    (256 KiB, cache-resident) written over and over, so what is left is per-call cost."""
    cache = kvcore.KVCache(kvcore.KVSpec(num_layers=1, num_kv_heads=HEADS, head_dim=HEAD_DIM,
                                         capacity=n, format="f32"))
    append, reset = cache.append, cache.reset
    K = np.zeros((n, HEADS, HEAD_DIM), np.float32)
    V = np.zeros_like(K)

    def ours():
        for _ in range(batches):
            reset()
            for _ in range(n):
                append(0, k, v)

    def peer():
        for _ in range(batches):
            for p in range(n):
                K[p] = k
                V[p] = v
    return {"kvcore KVCache.append (f32)": ours,
            "numpy slice assignment x2 (K and V)": peer}, n * batches


def bench_step() -> None:
    ks, vs = _inputs(STEPS)
    fns = {"numpy preallocated f32, slice assignment": _numpy_steps(ks, vs)}
    fns.update({f"kvcore KVCache {fmt}": _kvcache_steps(fmt, ks, vs)
                for fmt in kvcore.formats.ROW_FORMATS})
    per_step = {name: secs / STEPS for name, secs in _interleaved(fns).items()}
    peer = per_step["numpy preallocated f32, slice assignment"]
    window = f"{T0 + 2 * STEPS}-{CAPACITY}"  # the timed rounds
    rows = [[name, window, secs * 1e6, peer / secs] for name, secs in per_step.items()]
    concat = _time_concat(ks, vs, CONCAT_T)
    rows.insert(1, ["numpy np.concatenate growth f32 (HF DynamicCache style)", CONCAT_T,
                    concat * 1e6, peer / concat])
    print_table(f"Decode step: append 1 position (K and V, f32 input [{HEADS}, {HEAD_DIM}]) "
                f"to each of {LAYERS} layers, then advance ({kvcore.max_threads()} threads)",
                ["implementation", "at t", "us / step", "speed vs numpy slices"], rows)
    calls, n = _append_calls(ks[0], vs[0])
    print_table("One append call: 1 position f32 [8, 128], K and V, into cache-resident memory",
                ["implementation", "us / call"],
                [[name, secs / n * 1e6] for name, secs in _interleaved(calls, rounds=17).items()])


SECTIONS = {"step": bench_step, "quant": "bench_quant", "attention": "bench_attention",
            "prefill": "bench_prefill", "snapshot": "bench_snapshot", "pool": "bench_pool",
            "prefix": "bench_prefix",
            "store": "bench_store",
            "accuracy": "bench_accuracy",
            "contention": "bench_contention"}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(SECTIONS),
                        help=f"comma-separated sections of: {', '.join(SECTIONS)}")
    parser.add_argument("--plot", metavar="DIR",
                        help="write PNG figures of the attention and accuracy sections here")
    args = parser.parse_args(argv)
    wanted = args.only.split(",")
    unknown = [s for s in wanted if s not in SECTIONS]
    if unknown:
        parser.error(f"unknown section {', '.join(unknown)}: expected {', '.join(SECTIONS)}")
    if args.plot:
        import _plots
        _plots._pyplot()   # refuse now, not after the benchmarks, when matplotlib is missing
    b = kvcore._cache.build_info()
    machine = (f"{_cpu_model()}, {os.cpu_count()} CPUs, kvcore {kvcore.__version__} "
               f"(OpenMP {'on' if kvcore.openmp_enabled() else 'off'}, ISA {' '.join(b['isa'])})")
    print(f"{machine}, numpy {np.__version__}")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    results = {}
    for name in wanted:
        section = SECTIONS[name]
        if callable(section):
            results[name] = section()
        else:
            results[name] = importlib.import_module(section).main()
    if args.plot:
        command = "python tools/bench_cpu.py " + " ".join(argv if argv is not None else sys.argv[1:])
        if load is not None:   # other work on the machine moves the timings: say how much
            machine += f"; load average {load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end"
        for path in _plots.write(results, args.plot, f"{command}\n{machine}"):
            print(f"wrote {path}")


def _cpu_model() -> str:
    """The CPU's name (Linux /proc/cpuinfo; platform.processor() elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform
    return platform.processor() or "unknown CPU"


if __name__ == "__main__":
    main()
