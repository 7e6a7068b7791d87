"""Snapshot file throughput: save and load of a 32-layer, 4096-position int8 snapshot
(Hkv 8, D 128: 276 MB) against writing and reading the same bytes with numpy
tofile/fromfile, in the same run, in a temporary directory.

    python tools/bench_cpu.py --only snapshot      (or python tools/bench_snapshot.py)

save = header + data + SHA-256 and XXH3-128 digests (hashed on a worker thread while
writing) + fsync + rename; its like-for-like peer is tofile + fsync (tofile alone only
reaches the page cache and survives no crash). load reads the file into private memory
(a worker thread per tensor, each hashing what it just read): verify=True checks every
byte against its XXH3-128, verify="sha256" against its SHA-256; load without verify only
reads, and is timed together with restoring into a KVCache. The load peer is fromfile
(every byte read once, into memory of its own).
"""
from __future__ import annotations

import os
import sys
import tempfile
import time
from typing import Callable

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _benchlib import print_table  # noqa: E402

import kvcore  # noqa: E402
from kvcore.snapshot import Snapshot, load_snapshot  # noqa: E402

LAYERS, POSITIONS, HEADS, HEAD_DIM = 32, 4096, 8, 128
REPEAT = 5


def _snapshot() -> Snapshot:
    """Random valid int8 codes in [-127, 127] and positive float32 scales."""
    spec = kvcore.KVSpec(num_layers=LAYERS, num_kv_heads=HEADS, head_dim=HEAD_DIM,
                         capacity=POSITIONS, format="int8")
    rng = np.random.default_rng(0)
    codes = (LAYERS, POSITIONS, HEADS, HEAD_DIM)
    scales = (LAYERS, POSITIONS, HEADS, 1)
    return Snapshot(spec, POSITIONS,
                    rng.integers(-127, 128, codes, dtype=np.int8),
                    rng.integers(-127, 128, codes, dtype=np.int8),
                    rng.random(scales, dtype=np.float32), rng.random(scales, dtype=np.float32))


def _interleaved(fns: dict[str, Callable[[], object]]) -> dict[str, float]:
    """Median seconds of each fn over REPEAT rounds (after one warm-up round), the fns
    timed in turn within each round so that a change of machine load hits them alike."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for r in range(REPEAT + 1):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            if r:
                times[name].append(time.perf_counter() - t0)
    return {name: float(np.median(ts)) for name, ts in times.items()}


def main() -> None:
    snap = _snapshot()
    parts = [snap.k_scales, snap.v_scales, snap.k_codes, snap.v_codes]
    cache = kvcore.KVCache(snap.spec)
    cache._storage[:] = 0  # touch every page once, as a cache in use has been
    with tempfile.TemporaryDirectory() as tmp:
        ours, raw = os.path.join(tmp, "snap.safetensors"), os.path.join(tmp, "raw.bin")

        def tofile(fsync: bool) -> None:
            with open(raw, "wb") as f:
                for a in parts:
                    a.tofile(f)
                if fsync:
                    f.flush()
                    os.fsync(f.fileno())

        def fromfile() -> list[np.ndarray]:
            with open(raw, "rb") as f:
                return [np.fromfile(f, a.dtype, a.size).reshape(a.shape) for a in parts]

        def load_restore() -> None:
            cache.restore(load_snapshot(ours, verify=False))

        t = _interleaved({
            "save": lambda: snap.save(ours),
            "tofile+fsync": lambda: tofile(True),
            "tofile": lambda: tofile(False),
        })
        t.update(_interleaved({
            "load": lambda: load_snapshot(ours),
            "load sha256": lambda: load_snapshot(ours, verify="sha256"),
            "load+restore": load_restore,
            "fromfile": fromfile,
        }))
    gb = snap.nbytes / 1e9
    rows = [
        ["save (SHA-256 + XXH3-128, fsync, rename)", gb / t["save"], "tofile + fsync",
         gb / t["tofile+fsync"], t["tofile+fsync"] / t["save"]],
        ["save (SHA-256 + XXH3-128, fsync, rename)", gb / t["save"], "tofile (page cache only)",
         gb / t["tofile"], t["tofile"] / t["save"]],
        ["load, verify XXH3-128 (default)", gb / t["load"], "fromfile", gb / t["fromfile"],
         t["fromfile"] / t["load"]],
        ["load, verify SHA-256", gb / t["load sha256"], "fromfile", gb / t["fromfile"],
         t["fromfile"] / t["load sha256"]],
        ["load verify=False + restore into KVCache", gb / t["load+restore"], "fromfile",
         gb / t["fromfile"], t["fromfile"] / t["load+restore"]],
    ]
    print_table(f"snapshot files: int8, {LAYERS} layers x {POSITIONS} positions x {HEADS} "
                f"heads x {HEAD_DIM} ({snap.nbytes / 1e6:.0f} MB), GB/s, median of {REPEAT}",
                ["ours", "GB/s", "raw peer", "GB/s", "ours / raw"], rows)


if __name__ == "__main__":
    main()
