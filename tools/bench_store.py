"""Chunk store throughput: save and load of a 4,096-token int8 prefix (32 layers, Hkv 8,
D 128: 277 MB, 16 chunks of 256 tokens) through a KVStore on a directory and on a Redis
server, against the raw writes and reads of the same value bytes through the same
backend, and against the bare copy of the same positions into the pages of a KVPool
(page_size 16; what a load costs when there is nothing to fetch or check: recomputing
nothing).

    python tools/bench_cpu.py --only store      (or python tools/bench_store.py)

save = slice each chunk out of the snapshot, encode (header, copy into one value,
XXH3-128 of every byte), write (directory: temporary file + fsync + rename; Redis: SET);
its raw peer writes the already-encoded values the same way. load = one round trip for
the values, check every chunk (digest, header, tokens, codes) and copy it straight into
the pages of a new sequence of a KVPool; its raw peer reads the same bytes only, as the
load reads them (Backend.read_prefix: a directory's files into one reused buffer, Redis's
values in one pipeline). The Redis server is a redis-server started on a free loopback
port for the run (skipped, saying so, when none is on PATH).
"""
from __future__ import annotations

import os
import sys
import tempfile
import time
from typing import Callable

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))  # _servers: test servers
from _benchlib import print_table  # noqa: E402

import kvcore  # noqa: E402
from kvcore.snapshot import Snapshot  # noqa: E402
from kvcore.store import DirectoryBackend, KVStore, RedisBackend  # noqa: E402

LAYERS, POSITIONS, HEADS, HEAD_DIM, CHUNK, PAGE = 32, 4096, 8, 128, 256, 16
REPEAT = 5


def _prefix() -> tuple[Snapshot, np.ndarray]:
    """Random valid int8 codes and positive scales for POSITIONS positions, and token ids
    (one more than the positions: a load leaves the last token to compute)."""
    spec = kvcore.KVSpec(num_layers=LAYERS, num_kv_heads=HEADS, head_dim=HEAD_DIM,
                         capacity=POSITIONS, format="int8")
    rng = np.random.default_rng(0)
    codes = (LAYERS, POSITIONS, HEADS, HEAD_DIM)
    scales = (LAYERS, POSITIONS, HEADS, 1)
    snap = Snapshot(spec, POSITIONS, rng.integers(-127, 128, codes, dtype=np.int8),
                    rng.integers(-127, 128, codes, dtype=np.int8),
                    rng.random(scales, dtype=np.float32), rng.random(scales, dtype=np.float32))
    return snap, rng.integers(0, 128000, POSITIONS + 1)


def _time(fn: Callable[[], object], setup: Callable[[], object] | None = None) -> float:
    """Median seconds of fn over REPEAT runs after one warm-up, setup untimed before each."""
    times = []
    for r in range(REPEAT + 1):
        if setup:
            setup()
        t0 = time.perf_counter()
        fn()
        if r:
            times.append(time.perf_counter() - t0)
    return float(np.median(times))


def _rows(name: str, backend, snap: Snapshot, tokens: np.ndarray) -> list[list]:
    store = KVStore(backend, model="bench@1", spec=snap.spec, chunk_tokens=CHUNK)
    keys = store.keys(tokens)[:POSITIONS // CHUNK]
    pool = kvcore.KVPool(snap.spec, num_pages=POSITIONS // PAGE, page_size=PAGE)
    pool._storage[:] = 0  # touch every page once, as a pool in use has been
    clear = lambda: backend.delete(keys)  # noqa: E731

    def free_all() -> None:  # a load or copy takes every page: free them before the next
        for s in pool.sequences:
            pool.free(s)
    t_save = _time(lambda: store.save(snap, tokens), clear)
    values = backend.get_prefix(keys)
    assert len(values) == len(keys)
    t_put = _time(lambda: backend.put_many(list(zip(keys, values))), clear)
    result = store.load_into(pool, tokens)
    assert result.positions == POSITIONS, result.miss
    t_load = _time(lambda: store.load_into(pool, tokens), free_all)
    t_get = _time(lambda: sum(len(v) for v in backend.read_prefix(keys)))
    t_copy = _time(lambda: pool.restore(snap), free_all)
    gb = snap.nbytes / 1e9
    return [[name, "save", gb / t_save, "raw write of the values", gb / t_put, t_put / t_save],
            [name, "load into a pool sequence", gb / t_load, "raw read of the values",
             gb / t_get, t_get / t_load],
            [name, "load into a pool sequence", gb / t_load, "bare copy into the pages (no "
             "fetch)", gb / t_copy, t_copy / t_load]]


def main() -> None:
    from _servers import Server, binaries
    snap, tokens = _prefix()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        rows += _rows("directory (fsync)", DirectoryBackend(os.path.join(tmp, "kv")), snap, tokens)
        found = binaries()
        if found is None:
            print("(no redis-server on PATH: the Redis rows are skipped)")
        else:
            server = Server(found[0], os.path.join(tmp, "redis"))
            try:
                backend = RedisBackend(server.url)
                rows += _rows("redis (loopback)", backend, snap, tokens)
                backend.close()
            finally:
                server.stop()
    print_table(f"chunk store: int8, {LAYERS} layers x {POSITIONS} positions x {HEADS} heads x "
                f"{HEAD_DIM} ({snap.nbytes / 1e6:.0f} MB, {POSITIONS // CHUNK} chunks of "
                f"{CHUNK}), GB/s, median of {REPEAT}",
                ["backend", "ours", "GB/s", "peer", "GB/s", "ours / peer"], rows)


if __name__ == "__main__":
    main()
