"""CPU benchmarks, every section against peers measured in the same run.

    python tools/bench_cpu.py [--only step,quant,attention,snapshot]

step: one decode step (append one position of K and V, [8, 128] float32, to each of 32
layers, then advance) in KVCache against a preallocated numpy cache written by slice
assignment and against growth by np.concatenate (how HF's DynamicCache grows); plus
the time of one `append` call. The other sections live in bench_<section>.py beside
this file, each with a main(); a section whose file does not exist yet is skipped.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _benchlib import median_time, print_table  # noqa: E402

import kvcore  # noqa: E402

LAYERS, HEADS, HEAD_DIM = 32, 8, 128
STEPS = 256          # steps per timed batch (positions [t, t + STEPS) of each layer)
CAPACITY = 4096      # the cache the steps write into, near its end
CONCAT_T = 1024      # concatenation copies the whole history each step: measured here


def _inputs(n: int) -> tuple[np.ndarray, np.ndarray]:
    """n distinct float32 [Hkv, D] steps for K and V: [n, Hkv, D] each."""
    rng = np.random.default_rng(0)
    return (rng.standard_normal((n, HEADS, HEAD_DIM), dtype=np.float32),
            rng.standard_normal((n, HEADS, HEAD_DIM), dtype=np.float32))


def _time_kvcache(fmt: str, ks: np.ndarray, vs: np.ndarray, t: int) -> float:
    """Seconds per step of KVCache in `fmt`, writing positions [t, t + STEPS)."""
    cache = kvcore.KVCache(kvcore.KVSpec(num_layers=LAYERS, num_kv_heads=HEADS,
                                         head_dim=HEAD_DIM, capacity=CAPACITY, format=fmt))
    cache._storage[:] = 0  # touch every page once, as a cache in use has been
    fill_k = np.zeros((t, HEADS, HEAD_DIM), np.float32)
    for layer in range(LAYERS):
        cache.append(layer, fill_k, fill_k)
    cache.advance()
    append, advance = cache.append, cache.advance

    def steps():
        cache.truncate(t)
        for s in range(STEPS):
            k, v = ks[s], vs[s]
            for layer in range(LAYERS):
                append(layer, k, v)
            advance()
    return median_time(steps, repeat=9, warmup=2) / STEPS


def _time_numpy_slices(ks: np.ndarray, vs: np.ndarray, t: int) -> float:
    """Seconds per step of a preallocated [L, N, Hkv, D] float32 pair, slice assignment."""
    K = np.zeros((LAYERS, CAPACITY, HEADS, HEAD_DIM), np.float32)
    V = np.zeros_like(K)

    def steps():
        for s in range(STEPS):
            k, v = ks[s], vs[s]
            p = t + s
            for layer in range(LAYERS):
                K[layer, p] = k
                V[layer, p] = v
    return median_time(steps, repeat=9, warmup=2) / STEPS


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


def _time_append_call(ks: np.ndarray, vs: np.ndarray, n: int = 2000) -> tuple[float, float]:
    """Seconds per call: one KVCache.append of one f32 position [8, 128] (K and V) into
    layer 0, and the numpy peer (two slice assignments), over n consecutive positions."""
    cache = kvcore.KVCache(kvcore.KVSpec(num_layers=1, num_kv_heads=HEADS, head_dim=HEAD_DIM,
                                         capacity=n, format="f32"))
    cache._storage[:] = 0
    append, k, v = cache.append, ks[0], vs[0]

    def ours():
        cache.reset()
        for _ in range(n):
            append(0, k, v)
    K = np.zeros((n, HEADS, HEAD_DIM), np.float32)
    V = np.zeros_like(K)

    def peer():
        for p in range(n):
            K[p] = k
            V[p] = v
    return (median_time(ours, repeat=15) / n, median_time(peer, repeat=15) / n)


def bench_step() -> None:
    ks, vs = _inputs(STEPS)
    t = CAPACITY - STEPS
    slices = _time_numpy_slices(ks, vs, t)
    rows = []
    for fmt in kvcore.FORMATS:
        ours = _time_kvcache(fmt, ks, vs, t)
        rows.append([f"kvcore KVCache {fmt}", t, ours * 1e6, slices / ours])
    rows.insert(1, ["numpy preallocated f32, slice assignment", t, slices * 1e6, 1.0])
    concat = _time_concat(ks, vs, CONCAT_T)
    rows.insert(2, ["numpy np.concatenate growth f32 (HF DynamicCache style)", CONCAT_T,
                    concat * 1e6, slices / concat])
    print_table(f"Decode step: append 1 position (K and V, f32 input [{HEADS}, {HEAD_DIM}]) "
                f"to each of {LAYERS} layers, then advance ({kvcore.max_threads()} threads)",
                ["implementation", "at t", "us / step", "speed vs numpy slices"], rows)
    ours, peer = _time_append_call(ks, vs)
    print_table("One append call: 1 position f32 [8, 128], K and V",
                ["implementation", "us / call"],
                [["kvcore KVCache.append (f32)", ours * 1e6],
                 ["numpy slice assignment x2 (K and V)", peer * 1e6]])


SECTIONS = {"step": bench_step, "quant": "bench_quant", "attention": "bench_attention",
            "snapshot": "bench_snapshot"}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(SECTIONS),
                        help=f"comma-separated sections of: {', '.join(SECTIONS)}")
    wanted = parser.parse_args(argv).only.split(",")
    unknown = [s for s in wanted if s not in SECTIONS]
    if unknown:
        parser.error(f"unknown section {', '.join(unknown)}: expected {', '.join(SECTIONS)}")
    b = kvcore._cache.build_info()
    print(f"kvcore {kvcore.__version__}, numpy {np.__version__}, {os.cpu_count()} CPUs, "
          f"OpenMP {'on' if kvcore.openmp_enabled() else 'off'}, ISA {' '.join(b['isa'])}")
    for name in wanted:
        section = SECTIONS[name]
        if callable(section):
            section()
        elif importlib.util.find_spec(section) is None:
            print(f"\n### {name}: skipped (tools/{section}.py does not exist yet)")
        else:
            importlib.import_module(section).main()


if __name__ == "__main__":
    main()
