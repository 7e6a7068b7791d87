"""copy.deepcopy, copy.copy and pickle (the default protocol and 5, in band and out of
band) of KVCache and KVPool: the copy equals the original (storage bytes, lengths,
pending positions, page tables, the prefix index and its LRU order, stats; attention
bit for bit), and the two are independent: each is then driven on its own, with other
values, and must end exactly as a fresh object driven the same way (so no write reaches
the other, in either direction). Copies are refused while another thread is inside the
object, and for pools tied to a chunk store's writer (or, for pickle, to a store)."""
import copy
import mmap
import pickle
import threading

import numpy as np
import pytest
from _blocking import BlockingLayer

import kvcore
from kvcore import KVCache, KVCacheError, KVPool, KVSpec, StateError
from kvcore.store import DirectoryBackend, KVStore, StoreWriter

from _toy_model import kv, prefill, query

FORMATS = list(kvcore.formats.ROW_FORMATS)   # K and V in one format (q4_1ch is K only)
PROMPT = np.arange(100, 113)          # 13 tokens: 3 full pages of 4 and one position


def spec_of(fmt, **kw):
    fields = dict(num_layers=2, num_kv_heads=2, head_dim=32, capacity=64, num_heads=4,
                  format=fmt)
    fields.update(kw)
    return KVSpec(**fields)


def _out_of_band(x):
    buffers = []
    data = pickle.dumps(x, protocol=5, buffer_callback=buffers.append)
    return pickle.loads(data, buffers=buffers)


COPIES = {"deepcopy": copy.deepcopy, "copy": copy.copy,
          "pickle": lambda x: pickle.loads(pickle.dumps(x)),
          "pickle5": lambda x: pickle.loads(pickle.dumps(x, protocol=5)),
          "pickle5-out-of-band": _out_of_band}


def attention(obj):
    """Every layer's decode attention, as uint32 bits: a KVCache's, or each sequence's of a
    pool (one call over all of them, and one per sequence)."""
    spec, out = obj.spec, []
    for layer in range(spec.num_layers):
        if isinstance(obj, KVCache):
            out.append(kvcore.decode_attention(query(spec, layer), obj, layer))
            continue
        seqs = obj.sequences
        q = np.stack([query(spec, 7 * layer + s) for s in seqs])
        out.append(kvcore.decode_attention(q, obj, layer, seqs=seqs))
        out += [kvcore.decode_attention(q[i:i + 1], obj, layer, seqs=[s])
                for i, s in enumerate(seqs)]
    return [a.view(np.uint32).tolist() for a in out]


def assert_own_storage(new, old):
    """new's storage is fresh pages of its own, and its views and writable arrays lie in
    it (not in the original's)."""
    assert not np.shares_memory(new._storage, old._storage)
    assert new._storage.ctypes.data % mmap.PAGESIZE == 0
    assert np.shares_memory(new._layer_arrays(1)[0], new._storage)
    if isinstance(new, KVCache):
        assert np.shares_memory(new.keys(1, pending=True), new._storage)
        assert not np.shares_memory(new.keys(1, pending=True), old._storage)


# -- KVCache ---------------------------------------------------------------------------

def build_cache(fmt):
    """13 committed positions, and 2 pending in layer 0."""
    cache = KVCache(spec_of(fmt))
    prefill(cache, PROMPT)
    cache.append(0, *kv(cache.spec, 0, np.array([5, 6]), cache.length))
    return cache


def drive_cache(cache, salt):
    """Completes the step, rolls back into the prompt and writes other positions."""
    cache.append(1, *kv(cache.spec, 1, np.array([5, 6]), cache.length))
    cache.advance()
    cache.truncate(9)
    prefill(cache, np.arange(5) * 31 + salt)
    cache.append(1, *kv(cache.spec, 1, np.array([salt]), cache.length))


def cache_state(cache):
    layers = range(cache.spec.num_layers)
    return (cache._storage.tobytes(), cache.length, [cache.pending(i) for i in layers],
            [cache.keys(i, pending=True).tobytes() + cache.values(i, pending=True).tobytes()
             for i in layers])


@pytest.mark.parametrize("how", list(COPIES))
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_cache_copy_is_equal_and_independent(fmt, how):
    cache = build_cache(fmt)
    new = COPIES[how](cache)
    assert type(new) is KVCache and new is not cache
    assert new.spec == cache.spec and cache_state(new) == cache_state(cache)
    assert attention(new) == attention(cache)
    assert_own_storage(new, cache)
    drive_cache(cache, salt=1)
    drive_cache(new, salt=2)
    for obj, salt in ((cache, 1), (new, 2)):
        ref = build_cache(fmt)
        drive_cache(ref, salt)
        assert cache_state(obj) == cache_state(ref)
        assert attention(obj) == attention(ref)
    assert cache_state(new) != cache_state(cache)


# -- KVPool ----------------------------------------------------------------------------

def build_pool(fmt):
    """A pool with a prefix cache in every state: sequence 0 holds the prompt, 1 is its
    fork (three full pages shared, the partial one copied) with one position pending in
    layer 0, 2 found the prompt's pages (hits) and added one position, and 3 ended
    leaving two registered pages cached (in LRU order) and a freed one."""
    pool = KVPool(spec_of(fmt), num_pages=12, page_size=4, prefix_cache=True)
    a = pool.new_sequence()
    prefill(pool, PROMPT, a)
    b = pool.fork(a)
    c, n = pool.match_prefix(np.append(PROMPT[:12], 7))
    prefill(pool, np.array([7]), c)
    d = pool.new_sequence()
    prefill(pool, np.arange(9) + 500, d)
    pool.free(d)
    pool.append(*kv(pool.spec, 0, np.array([9]), pool.length(b)), seq=b, layer=0)
    assert n == 12 and pool.stats.hits == 3 and pool.num_cached_pages == 2
    assert max(pool._table.refs) == 3 and pool.pending(b, 0) == 1
    return pool


def drive_pool(pool, salt):
    """Completes sequence 1's step, rolls sequence 0 back into the shared pages and
    rewrites them (copy-on-write), looks the prompt up again (one page left registered),
    and fills the pool so that the cached pages are evicted."""
    spec = pool.spec
    pool.append(*kv(spec, 1, np.array([9]), pool.length(1)), seq=1, layer=1)
    pool.advance(1, tokens=[9])
    pool.truncate(0, 6)
    prefill(pool, np.arange(5) * 31 + salt, 0)
    e, n = pool.match_prefix(PROMPT)
    prefill(pool, PROMPT[n:] + salt, e)
    f = pool.new_sequence()
    prefill(pool, np.arange(8) + 7 * salt, f)
    pool.append(*kv(spec, 0, np.array([salt]), pool.length(2)), seq=2, layer=0)
    assert pool.stats.evictions == 2 and pool.num_free_pages == 0


def pool_state(pool):
    t = pool._table
    idx = t.prefix
    seqs = {s: (list(q.pages), q.length, list(q.pending), bytes(q.ids), list(q.keys), q.extra)
            for s, q in t.seqs.items()}
    entries = {g: (e.key, e.parent, e.ids, e.extra) for g, e in idx.entries.items()}
    tables = {s: pool.page_table(s).tolist() for s in pool.sequences}
    return (pool._storage.tobytes(), list(t.free), list(t.refs), t._next_id, seqs, tables,
            dict(idx.by_key), entries, dict(idx.children), list(idx.lru), pool.stats,
            pool.num_free_pages, pool.num_cached_pages, pool.num_used_pages)


@pytest.mark.parametrize("how", list(COPIES))
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_pool_copy_is_equal_and_independent(fmt, how):
    pool = build_pool(fmt)
    new = COPIES[how](pool)
    assert type(new) is KVPool and new is not pool
    assert pool_state(new) == pool_state(pool)
    assert attention(new) == attention(pool)
    assert (new.spec, new.page_size, repr(new)) == (pool.spec, pool.page_size, repr(pool))
    assert_own_storage(new, pool)
    drive_pool(pool, salt=1)
    drive_pool(new, salt=2)
    for obj, salt in ((pool, 1), (new, 2)):
        ref = build_pool(fmt)
        drive_pool(ref, salt)
        assert pool_state(obj) == pool_state(ref)
        assert attention(obj) == attention(ref)
    assert pool_state(new) != pool_state(pool)


def test_pickle_protocol_5_sends_the_storage_out_of_band():
    """With protocol 5 the storage is one buffer handed to buffer_callback (no copy in the
    pickle); in band, the pickle holds the bytes once."""
    for obj in (build_cache("int8"), build_pool("f16")):
        buffers = []
        data = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
        assert len(data) < 20_000 and len(buffers) == 1
        assert buffers[0].raw().nbytes == obj._storage.nbytes   # the regions and the gaps
        for protocol in (5, pickle.DEFAULT_PROTOCOL):
            assert obj.memory_bytes < len(pickle.dumps(obj, protocol=protocol)) \
                < obj.memory_bytes + 20_000


# -- refusals --------------------------------------------------------------------------

@pytest.mark.parametrize("what", ["cache", "pool"])
def test_no_copy_while_another_thread_is_inside(what):
    obj = build_cache("int8") if what == "cache" else build_pool("int8")
    state = cache_state if what == "cache" else pool_state
    inside, go = threading.Event(), threading.Event()
    errors = []

    def hold():
        try:
            layer = BlockingLayer(0, inside, go)
            obj.dequantize(layer, "k") if what == "cache" else obj.dequantize(0, layer, "k")
        except BaseException as e:    # noqa: BLE001 - reported below
            errors.append(e)
    t = threading.Thread(target=hold)
    t.start()
    try:
        assert inside.wait(60)
        before = state(obj)
        name = type(obj).__name__
        for op, call in [("deepcopy", copy.deepcopy), ("copy", copy.copy),
                         ("pickle", pickle.dumps),
                         ("pickle", lambda x: pickle.dumps(x, protocol=5))]:
            with pytest.raises(StateError, match=f"^{op}: this {name} is in use by another "
                                                 f"thread"):
                call(obj)
            assert state(obj) == before
    finally:
        go.set()
        t.join(60)
    assert not t.is_alive() and not errors
    assert state(copy.deepcopy(obj)) == state(obj)


def test_a_pool_with_a_store_writer_refuses_copies(tmp_path):
    spec = spec_of("int8")
    store = KVStore(DirectoryBackend(tmp_path), model="m", spec=spec, chunk_tokens=4,
                    page_size=4)
    with StoreWriter(store) as writer:
        pool = KVPool(spec, num_pages=8, page_size=4, prefix_cache=True, store=store,
                      store_writer=writer)
        s = pool.new_sequence()
        prefill(pool, PROMPT, s)
        before = pool_state(pool)
        for call in (copy.deepcopy, copy.copy, pickle.dumps,
                     lambda x: pickle.dumps(x, protocol=5)):
            with pytest.raises(KVCacheError, match="attached to a StoreWriter"):
                call(pool)
            assert pool_state(pool) == before
        writer.flush()
        assert writer.stats.chunks_written == 3
    assert store.lookup(PROMPT) == 12


def test_a_pool_with_a_store_shares_it_in_a_deepcopy_and_refuses_pickle(tmp_path):
    spec = spec_of("int8")
    store = KVStore(DirectoryBackend(tmp_path), model="m", spec=spec, chunk_tokens=4,
                    page_size=4)
    cache = KVCache(spec)
    prefill(cache, PROMPT)
    store.save(cache.snapshot(), PROMPT)
    pool = KVPool(spec, num_pages=8, page_size=4, prefix_cache=True, store=store)
    new = copy.deepcopy(pool)
    assert new._kv is store
    s, n = new.match_prefix(PROMPT)              # loaded from the shared store
    assert n == 12 and new.stats.store_hits == 3 and pool.sequences == []
    before = pool_state(pool)
    for protocol in (pickle.DEFAULT_PROTOCOL, 5):
        with pytest.raises(KVCacheError, match="cannot pickle a KVPool attached to a chunk "
                                               "store .*copy.deepcopy shares the store"):
            pickle.dumps(pool, protocol=protocol)
        assert pool_state(pool) == before
