"""The chunk store with the paged pool: a pool sequence saved, the longest stored prefix
loaded into a new pool sequence (through a directory and through a Redis server, from
another process), decoding bit-identical to computing everything."""
import numpy as np
import pytest

from kvcore import KVCache, KVPool
from kvcore.errors import CapacityError, RangeError
from kvcore.store import DirectoryBackend, KVStore

from _toy_model import decode, prefill
from test_store import C, share_through_server, spec_of

PAGE = 8


@pytest.mark.parametrize("fmt", ["int8", "bf16"])
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
