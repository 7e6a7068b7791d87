"""The chunk store with the paged pool: a pool sequence saved, the longest stored prefix
loaded into a new pool sequence (through a directory and through a Redis server, from
another process), decoding bit-identical to computing everything."""
import numpy as np
import pytest

from kvcore import KVCache, KVPool
from kvcore.errors import CapacityError, RangeError, SnapshotError
from kvcore.store import DirectoryBackend, KVStore

from _toy_model import decode, prefill
from test_store import C, share_through_server, spec_of

PAGE = 8


@pytest.mark.parametrize("fmt", ["int8", "bf16", "q8_0/q4_0"])
def test_a_pool_sequence_is_saved_and_loaded_into_a_new_sequence(fmt, tmp_path, rng):
    spec = spec_of(fmt)
    prompt = rng.integers(0, 50000, 3 * C + 3)
    new = rng.integers(0, 50000, 4)
    pool = KVPool(spec, num_pages=40, page_size=PAGE)
    s = pool.new_sequence()
    prefill(pool, prompt, s)
    store = KVStore(DirectoryBackend(tmp_path), model="m", spec=spec, chunk_tokens=C)
    assert store.save(pool.snapshot(s), prompt) == 3
    free = pool.num_free_pages
    result = store.load_into(pool, prompt)
    t = result.seq
    assert (result.positions, result.miss) == (3 * C, None)
    assert pool.length(t) == 3 * C and pool.num_free_pages == free - 3 * C // PAGE
    for layer in range(spec.num_layers):
        for a, b in zip(pool._gather(s, layer), pool._gather(t, layer)):
            if a is not None:
                assert np.array_equal(a[:3 * C].view(np.uint8), b.view(np.uint8))
    prefill(pool, prompt[3 * C:], t)
    got = decode(pool, new, t)
    cache = KVCache(spec)
    prefill(cache, prompt)
    assert np.array_equal(got.view(np.uint32), decode(cache, new).view(np.uint32))


def test_pool_loads_are_refused_whole(tmp_path, rng):
    spec = spec_of("int8")
    prompt = rng.integers(0, 50000, 4 * C + 1)
    store = KVStore(DirectoryBackend(tmp_path), model="m", spec=spec, chunk_tokens=C)
    cache = KVCache(spec)
    prefill(cache, prompt)
    store.save(cache.snapshot(), prompt)
    small = KVPool(spec, num_pages=4 * C // PAGE - 1, page_size=PAGE)  # one page short
    with pytest.raises(CapacityError):
        store.load_into(small, prompt)
    assert small.num_free_pages == small.num_pages and small.sequences == []
    with pytest.raises(RangeError, match="not a multiple of the pool's page_size 32"):
        store.load_into(KVPool(spec, num_pages=8, page_size=2 * C), prompt)


def test_two_processes_share_a_prefix_into_a_pool(redis_server, tmp_path, rng):
    loaded, got, expected = share_through_server(redis_server.url, spec_of("int8"), tmp_path,
                                                 rng, reader="reader-pool")
    assert loaded == 5 * C
    assert np.array_equal(got.view(np.uint32), expected.view(np.uint32))


def test_a_server_killed_mid_run_leaves_the_pool_decoding(server_factory, rng):
    from kvcore.errors import StoreError
    from kvcore.store import RedisBackend, StoreWriter
    server = server_factory()
    spec = spec_of("int8")
    prompt = rng.integers(0, 50000, 3 * C + 1)
    store = KVStore(RedisBackend(server.url), model="m", spec=spec, chunk_tokens=C)
    pool = KVPool(spec, num_pages=64, page_size=PAGE)
    s = pool.new_sequence()
    prefill(pool, prompt[:2 * C], s)
    with StoreWriter(store) as writer:
        writer.submit(pool.snapshot(s), prompt[:2 * C])
        writer.flush()
        server.kill()
        writer.submit(pool.snapshot(s), prompt[:2 * C])
        writer.flush()
        assert writer.stats.chunks_written == 2 and writer.stats.failed == 1
    used = pool.num_used_pages
    with pytest.raises(StoreError, match=f"redis 127.0.0.1:{server.port}: GET of 3 keys"):
        store.load_into(pool, prompt)
    assert pool.num_used_pages == used and pool.sequences == [s]  # nothing taken
    out = decode(pool, prompt[2 * C:], s)  # the pool decodes on
    cache = KVCache(spec)
    prefill(cache, prompt[:2 * C])
    assert np.array_equal(out.view(np.uint32), decode(cache, prompt[2 * C:]).view(np.uint32))


def test_load_into_refuses_a_pool_of_another_spec_changing_nothing(tmp_path, rng):
    """A pool of more layers got layer 0 copied into every layer, one of another format
    got codes cast (and, with a prefix cache, registered): now refused before any read."""
    spec = spec_of("int8", num_layers=1)
    prompt = rng.integers(0, 50000, 2 * C + 1)
    store = KVStore(DirectoryBackend(tmp_path), model="m", spec=spec, chunk_tokens=C,
                    page_size=PAGE)
    cache = KVCache(spec)
    prefill(cache, prompt)
    store.save(cache.snapshot(), prompt)
    for field, value in (("num_layers", 3), ("format", "f32"), ("format", "fp8_e4m3"),
                         ("num_kv_heads", 4), ("head_dim", 64)):
        other = spec_of("int8", num_layers=1, num_heads=4).replace(**{field: value})
        for prefix_cache in (False, True):
            pool = KVPool(other, num_pages=16, page_size=PAGE, prefix_cache=prefix_cache)
            with pytest.raises(SnapshotError, match=rf"^load_into: the target's {field} {value} "
                                                    rf"does not match the store's "
                                                    rf"{getattr(spec, field)}"):
                store.load_into(pool, prompt)
            assert pool.sequences == [] and pool.num_free_pages == pool.num_pages
            if prefix_cache:  # nothing registered, so nothing served later
                seq, n = pool.match_prefix(prompt)
                assert n == 0 and pool.stats.hits == 0
    assert store.load(prompt).positions == 2 * C  # the store is untouched


def test_a_prefix_cache_chunk_after_a_dropped_one_is_not_written(tmp_path, rng):
    """A chunk whose parent chunk was dropped (the writer's queue full) could never be
    hit: the writer skips it (stats.orphans_skipped) instead of storing an orphan."""
    import threading
    from kvcore.store import StoreWriter
    from test_store import value_files

    class Gated(DirectoryBackend):
        def __init__(self, root):
            super().__init__(root, fsync=False)
            self.gate, self.entered = threading.Event(), threading.Event()

        def put_many(self, items):
            self.entered.set()
            self.gate.wait(10)
            super().put_many(items)

    spec = spec_of("int8")
    backend = Gated(tmp_path)
    store = KVStore(backend, model="m", spec=spec, chunk_tokens=C, page_size=PAGE)
    writer = StoreWriter(store, max_pending=1)
    pool = KVPool(spec, num_pages=40, page_size=PAGE, prefix_cache=True, store=store,
                  store_writer=writer)
    prompt = rng.integers(0, 50000, 4 * C + 1)
    s, n = pool.match_prefix(prompt)
    assert n == 0
    prefill(pool, prompt[:C], s)              # chunk 0: the thread takes it (held at the gate)
    assert backend.entered.wait(10)
    prefill(pool, prompt[C:2 * C], s)         # chunk 1: queued
    prefill(pool, prompt[2 * C:3 * C], s)     # chunk 2: dropped, the queue is full
    assert writer.stats.dropped == 1
    backend.gate.set()
    writer.flush()
    prefill(pool, prompt[3 * C:4 * C], s)     # chunk 3: its parent, chunk 2, is not stored
    writer.close()
    assert len(value_files(tmp_path)) == store.lookup(prompt) // C == 2
    assert writer.stats.chunks_written == 2 and writer.stats.orphans_skipped == 1
