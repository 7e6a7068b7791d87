"""The prefix cache with a chunk store attached: chunks saved as `advance` completes them
(a StoreWriter), a miss continued in the store (another pool's prefix through a
directory or a Redis Cluster, another process's through a Redis server), loaded pages
registered as computed ones, and the store's faults (a corrupt value, a server killed)
reported as misses while the pool decodes on."""
import numpy as np
import pytest

from kvcore import KVCache, KVPool
from kvcore._prefix_keys import prefix_keys
from kvcore.errors import SpecError
from kvcore.store import DirectoryBackend, KVStore, RedisBackend, StoreWriter

from _toy_model import decode, prefill
from test_store import C, _GatedBackend, share_through_server, spec_of

PAGE = 8
PER = C // PAGE  # pages per chunk


def _store(tmp_path, spec, **kw):
    return KVStore(DirectoryBackend(tmp_path), model="m", spec=spec, chunk_tokens=C,
                   page_size=PAGE, **kw)


def _computed(spec, prompt, new):
    cache = KVCache(spec)
    prefill(cache, prompt)
    return cache, decode(cache, new)


def _saved_by_a_pool(store, spec, prompt):
    """A pool with the store and a writer attached computes prompt (its chunks are saved
    as advance completes them); returns that pool and its sequence."""
    with StoreWriter(store) as writer:
        pool = KVPool(spec, num_pages=40, page_size=PAGE, prefix_cache=True, store=store,
                      store_writer=writer)
        s, n = pool.match_prefix(prompt)
        assert n == 0
        prefill(pool, prompt[:C + 3], s)        # one chunk, then the rest: two advances
        prefill(pool, prompt[C + 3:], s)
    assert writer.stats.chunks_written == len(prompt) // C and writer.stats.failed == 0
    return pool, s


def test_chunk_keys_are_the_prefix_cache_page_keys(tmp_path, rng):
    spec = spec_of()
    prompt = rng.integers(0, 50000, 3 * C + 5)
    store = _store(tmp_path, spec)
    pages = prefix_keys(prompt, PAGE, {"salt": "t"})
    assert [k.rsplit(":", 1)[1] for k in store.keys(prompt, {"salt": "t"})] == \
        [pages[(i + 1) * PER - 1].hex() for i in range(3)]
    assert ".C16.P8:" in store.keys(prompt)[0]


@pytest.mark.parametrize("fmt", ["int8", "bf16", "f16/q4_0"])
def test_a_miss_is_loaded_from_another_pools_store_and_decodes_bit_identically(fmt, tmp_path,
                                                                               rng):
    spec = spec_of(fmt)
    prompt = rng.integers(0, 50000, 4 * C + 5)
    new = rng.integers(0, 50000, 4)
    a, sa = _saved_by_a_pool(_store(tmp_path, spec), spec, prompt)
    # another pool, its own store object over the same directory
    b = KVPool(spec, num_pages=40, page_size=PAGE, prefix_cache=True,
               store=_store(tmp_path, spec))
    s, n = b.match_prefix(prompt)
    assert n == 4 * C
    st = b.stats
    assert (st.hits, st.store_hits, st.misses, st.store_faults) == (0, 4 * PER, 0, 0)
    for layer in range(spec.num_layers):
        for x, y in zip(a._gather(sa, layer), b._gather(s, layer)):
            if x is not None:
                assert np.array_equal(x[:n].view(np.uint8), y.view(np.uint8))
    prefill(b, prompt[n:], s)
    cache, expected = _computed(spec, prompt, new)
    assert np.array_equal(decode(b, new, s).view(np.uint32), expected.view(np.uint32))
    # the loaded pages are registered as computed ones: the same prompt hits in memory
    b.free(s)
    t, m = b.match_prefix(prompt)
    st = b.stats
    assert m == 4 * C and (st.hits, st.store_hits, st.misses) == (4 * PER, 4 * PER, 0)
    prefill(b, prompt[m:], t)
    assert np.array_equal(decode(b, new, t).view(np.uint32), expected.view(np.uint32))


def test_the_store_continues_an_in_memory_hit_mid_chunk(tmp_path, rng):
    spec = spec_of()
    prompt = rng.integers(0, 50000, 4 * C + 1)
    new = rng.integers(0, 50000, 3)
    _saved_by_a_pool(_store(tmp_path, spec), spec, prompt)
    b = KVPool(spec, num_pages=40, page_size=PAGE, prefix_cache=True,
               store=_store(tmp_path, spec))
    s = b.new_sequence()
    prefill(b, prompt[:C + PAGE + 2], s)        # chunk 0 and one page of chunk 1 cached
    b.free(s)
    t, n = b.match_prefix(prompt)
    st = b.stats
    assert n == 4 * C and (st.hits, st.store_hits, st.misses) == (PER + 1, 3 * PER - 1, 0)
    prefill(b, prompt[n:], t)
    assert np.array_equal(decode(b, new, t).view(np.uint32),
                          _computed(spec, prompt, new)[1].view(np.uint32))


def test_a_corrupt_chunk_is_a_reported_miss_and_nothing_wrong_is_loaded(tmp_path, rng):
    spec = spec_of()
    prompt = rng.integers(0, 50000, 3 * C + 2)
    new = rng.integers(0, 50000, 3)
    store = _store(tmp_path, spec)
    _saved_by_a_pool(store, spec, prompt)
    path = store.backend._path(store.keys(prompt)[1])
    with open(path, "r+b") as f:               # flip one bit of chunk 1's codes
        f.seek(-100, 2)
        byte = f.read(1)
        f.seek(-100, 2)
        f.write(bytes([byte[0] ^ 0x10]))
    pool = KVPool(spec, num_pages=40, page_size=PAGE, prefix_cache=True,
                  store=_store(tmp_path, spec))
    s, n = pool.match_prefix(prompt)
    st = pool.stats
    assert n == C and (st.store_hits, st.misses, st.store_faults) == (PER, 2 * PER, 1)
    assert st.last_store_fault.startswith("chunk 1 refused: ") and "XXH3-128" in st.last_store_fault
    assert not store.backend.contains_prefix([store.keys(prompt)[1]])  # deleted
    prefill(pool, prompt[n:], s)
    assert np.array_equal(decode(pool, new, s).view(np.uint32),
                          _computed(spec, prompt, new)[1].view(np.uint32))


def test_a_pool_short_of_pages_keeps_the_chunks_that_fit(tmp_path, rng):
    spec = spec_of()
    prompt = rng.integers(0, 50000, 4 * C + 1)
    _saved_by_a_pool(_store(tmp_path, spec), spec, prompt)
    pool = KVPool(spec, num_pages=2 * PER + 1, page_size=PAGE, prefix_cache=True,
                  store=_store(tmp_path, spec))
    s, n = pool.match_prefix(prompt)
    assert n == 2 * C and pool.length(s) == 2 * C and pool.stats.store_faults == 0
    assert pool.num_free_pages == 1


def test_load_into_a_prefix_cache_pool_registers_the_loaded_pages(tmp_path, rng):
    spec = spec_of()
    prompt = rng.integers(0, 50000, 2 * C + 3)
    store = _store(tmp_path, spec)
    store.save(_computed(spec, prompt, [])[0].snapshot(), prompt)
    pool = KVPool(spec, num_pages=20, page_size=PAGE, prefix_cache=True)  # no store attached
    result = store.load_into(pool, prompt)
    assert (result.positions, result.snapshot, result.miss) == (2 * C, None, None)
    prefill(pool, prompt[2 * C:], result.seq)       # a keyed sequence: advance takes ids
    pool.free(result.seq)
    assert pool.match_prefix(prompt)[1] == 2 * C and pool.stats.hits == 2 * PER


def test_a_full_or_closed_writer_drops_chunks_and_advance_goes_on(tmp_path, rng):
    spec = spec_of()
    prompt = rng.integers(0, 50000, 5 * C)
    backend = _GatedBackend(tmp_path)               # writes wait at the gate
    store = KVStore(backend, model="m", spec=spec, chunk_tokens=C, page_size=PAGE)
    writer = StoreWriter(store, max_pending=1)
    pool = KVPool(spec, num_pages=40, page_size=PAGE, prefix_cache=True, store=store,
                  store_writer=writer)
    s, _ = pool.match_prefix(prompt)
    prefill(pool, prompt[:4 * C], s)    # 4 chunks: one at the gate, one queued, 2 dropped
    assert writer.stats.submitted == 4 and writer.stats.dropped >= 2
    backend.gate.set()
    writer.close()
    written = writer.stats.chunks_written
    assert written == 4 - writer.stats.dropped and writer.stats.failed == 0
    prefill(pool, prompt[4 * C:], s)    # the writer is closed: dropped, advance goes on
    assert writer.stats.dropped == 5 - written and pool.length(s) == 5 * C
    assert sum(backend.contains_prefix([k]) for k in store.keys(prompt)) == written


def test_attaching_a_store_is_checked(tmp_path):
    spec = spec_of()
    store = _store(tmp_path, spec)
    with pytest.raises(SpecError, match="needs prefix_cache=True"):
        KVPool(spec, 8, PAGE, store=store)
    with pytest.raises(SpecError, match="store page_size 8 does not match the pool's 16"):
        KVPool(spec, 8, 16, prefix_cache=True, store=store)
    with pytest.raises(SpecError, match="store format int8 does not match the pool's bf16"):
        KVPool(spec_of("bf16"), 8, PAGE, prefix_cache=True, store=store)
    with pytest.raises(SpecError, match=r"store format int8 does not match the pool's "
                                        r"int8/q4_0 \(K int8, V q4_0\)"):
        KVPool(spec_of("int8/q4_0"), 8, PAGE, prefix_cache=True, store=store)
    with StoreWriter(_store(tmp_path, spec)) as other:
        with pytest.raises(SpecError, match="StoreWriter of the same store"):
            KVPool(spec, 8, PAGE, prefix_cache=True, store=store, store_writer=other)
        with pytest.raises(SpecError, match="store_writer needs store="):
            KVPool(spec, 8, PAGE, prefix_cache=True, store_writer=other)


def test_two_processes_share_a_prefix_through_their_prefix_caches(redis_server, tmp_path, rng):
    got, out, expected = share_through_server(redis_server.url, spec_of("int8"), tmp_path, rng,
                                              reader="reader-prefix", writer="writer-prefix")
    # the prompt is 5 chunks + 7 tokens: all 5 chunks loaded (10 pages), then from memory
    assert got == dict(positions=5 * C, again=5 * C, hits=5 * PER, misses=0,
                       store_hits=5 * PER, store_faults=0)
    assert np.array_equal(out.view(np.uint32), expected.view(np.uint32))


def test_a_server_killed_is_a_reported_miss_and_the_pool_decodes_on(server_factory, rng):
    server = server_factory()
    spec = spec_of()
    prompt = rng.integers(0, 50000, 3 * C + 1)
    new = rng.integers(0, 50000, 3)
    store = KVStore(RedisBackend(server.url), model="m", spec=spec, chunk_tokens=C,
                    page_size=PAGE)
    with StoreWriter(store) as writer:
        pool = KVPool(spec, num_pages=40, page_size=PAGE, prefix_cache=True, store=store,
                      store_writer=writer)
        s, _ = pool.match_prefix(prompt)
        prefill(pool, prompt[:C], s)        # chunk 0 cached here and saved
        writer.flush()
        assert writer.stats.chunks_written == 1
        server.kill()
        prefill(pool, prompt[C:2 * C], s)   # chunk 1's save fails on the writer's thread
        writer.flush()
        assert writer.stats.failed == 1 and writer.stats.chunks_written == 1
    pool.free(s)
    t, n = pool.match_prefix(prompt)        # 2 chunks cached, the third asked of a dead server
    st = pool.stats
    assert n == 2 * C and st.store_faults == 1 and st.store_hits == 0
    assert st.last_store_fault.startswith(f"redis 127.0.0.1:{server.port}: GET of 1 keys failed")
    prefill(pool, prompt[n:], t)
    assert np.array_equal(decode(pool, new, t).view(np.uint32),
                          _computed(spec, prompt, new)[1].view(np.uint32))


def test_two_pools_share_a_prefix_through_a_redis_cluster(redis_cluster, rng):
    spec = spec_of()
    prompt = rng.integers(0, 50000, 8 * C + 3)
    new = rng.integers(0, 50000, 3)

    def store():  # each pool its own client, as two servers of a fleet
        return KVStore(RedisBackend(redis_cluster.url, cluster=True), model="fleet", spec=spec,
                       chunk_tokens=C, page_size=PAGE)
    _saved_by_a_pool(store(), spec, prompt)
    b = KVPool(spec, num_pages=40, page_size=PAGE, prefix_cache=True, store=store())
    s, n = b.match_prefix(prompt)
    assert n == 8 * C and b.stats.store_hits == 8 * PER and b.stats.store_faults == 0
    prefill(b, prompt[n:], s)
    assert np.array_equal(decode(b, new, s).view(np.uint32),
                          _computed(spec, prompt, new)[1].view(np.uint32))
