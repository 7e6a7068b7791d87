"""Two builds of kvcore's attention kernels timed against each other in one process.

    python tools/ab_attention.py A B [--formats f16 int8 ...] [--positions 1024]
                                 [--tokens T] [--threads 1] [--calls 10]

A and B are built copies of the `_attention` extension module (the .so files), or `-`
for the one `import kvcore` loads; two different files (Python hands back the module it
already made for a file it loaded before, so copy a build before rebuilding in place). Each call of `decode_attention` (T query tokens, causal,
over a cache of `--positions`, Hq = 32, Hkv = 8, D = 128) runs once with each build, the
order swapped at every call, so that a change of machine load (on a shared guest, often
10-30% within a minute) hits both builds alike. Prints per format the least and median
time of each build, the median of the per-call ratios A / B (> 1: B faster), and whether
the two builds' outputs are the same bits.
"""
from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import os
import sys
import time
from types import ModuleType

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _benchlib import print_table  # noqa: E402

import kvcore  # noqa: E402
import kvcore.attention as _front  # noqa: E402

HQ, HKV, D = 32, 8, 128


def _load(path: str, name: str) -> ModuleType:
    """The extension module at path, imported as `name._attention` (its init symbol)."""
    if path == "-":
        return _front._attention
    loader = importlib.machinery.ExtensionFileLoader(f"{name}._attention", path)
    spec = importlib.util.spec_from_file_location(f"{name}._attention", path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def _row(fmt: str, builds: tuple[ModuleType, ModuleType], n: int, t: int, calls: int) -> list:
    k_format, v_format = (fmt.split("/") + [fmt])[:2]
    spec = kvcore.KVSpec(num_layers=1, num_kv_heads=HKV, head_dim=D, capacity=n, num_heads=HQ,
                         k_format=k_format, v_format=v_format)
    cache = kvcore.KVCache(spec)
    rng = np.random.default_rng(0)
    cache.append(0, *rng.standard_normal((2, n, HKV, D), dtype=np.float32))
    cache.advance()
    q = rng.standard_normal((t, HQ, D), dtype=np.float32)
    outs = [np.empty_like(q), np.empty_like(q)]
    times: list[list[float]] = [[], []]
    installed = _front._attention
    try:
        for i in range(calls):
            for b in ((0, 1) if i % 2 == 0 else (1, 0)):
                _front._attention = builds[b]
                t0 = time.perf_counter()
                kvcore.decode_attention(q, cache, 0, out=outs[b])
                times[b].append(time.perf_counter() - t0)
    finally:
        _front._attention = installed
    a, b = np.array(times[0]) * 1e3, np.array(times[1]) * 1e3
    same = np.array_equal(outs[0].view(np.uint32), outs[1].view(np.uint32))
    return [fmt, a.min(), np.median(a), b.min(), np.median(b), float(np.median(a / b)),
            "same" if same else "differ"]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--formats", nargs="+", default=["f32", "f16", "int8", "q8_0", "q4_0"])
    p.add_argument("--positions", type=int, default=1024)
    p.add_argument("--tokens", type=int, default=None, help="query tokens (default: --positions)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--calls", type=int, default=10)
    args = p.parse_args(argv)
    builds = (_load(args.a, "build_a"), _load(args.b, "build_b"))
    kvcore.set_num_threads(args.threads)
    t = args.tokens or args.positions
    rows = [_row(fmt, builds, args.positions, t, args.calls) for fmt in args.formats]
    print_table(f"A/B: {t} tokens over {args.positions} positions, Hq={HQ}, Hkv={HKV}, D={D}, "
                f"{args.threads} thread(s), {args.calls} calls of each build alternated",
                ["format", "A min ms", "A median ms", "B min ms", "B median ms",
                 "median A/B", "bits"], rows)


if __name__ == "__main__":
    main()
