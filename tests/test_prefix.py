"""The prefix cache of a KVPool: keys, lookup, commit, eviction, counts, exact reuse, and
one test per bug of other runtimes it is built to avoid (named after it)."""
import os
import subprocess
import sys

import numpy as np
import pytest

import kvcore
from kvcore import KVPool, KVSpec
from kvcore._prefix_keys import prefix_keys
from kvcore.errors import CapacityError, DTypeError, RangeError, ShapeError, StateError

L, H, D, PS = 2, 2, 32, 4


def make_pool(pages=16, fmt="f16", capacity=64):
    spec = KVSpec(num_layers=L, num_kv_heads=H, head_dim=D, capacity=capacity, num_heads=4,
                  format=fmt)
    return KVPool(spec, num_pages=pages, page_size=PS, prefix_cache=True)


def kv_of(tokens, extra=None, heads=H, head_dim=D):
    """K/V [T, heads, head_dim] of each position: a function of (extras, ids up to it), as a
    model's."""
    out = np.empty((len(tokens), heads, head_dim), np.float32)
    for p in range(len(tokens)):
        seed = abs(hash((repr(extra), tuple(int(t) for t in tokens[:p + 1])))) % 2**63
        out[p] = np.random.default_rng(seed).standard_normal((heads, head_dim))
    return out


def prefill(pool, tokens, extra=None):
    """match_prefix, then compute and commit the rest; returns (seq, matched n)."""
    s, n = pool.match_prefix(tokens, extra=extra)
    kv = kv_of(tokens, extra)[n:]
    if len(kv):
        for layer in range(L):
            pool.append(kv, -kv, seq=s, layer=layer)
        pool.advance(s, tokens=tokens[n:])
    return s, n


def expect(pool, s, tokens, extra=None):
    """s reads back exactly the K/V of tokens (f16 storage)."""
    kv = kv_of(tokens, extra).astype(np.float16).astype(np.float32)
    for layer in range(L):
        assert np.array_equal(pool.dequantize(s, layer, "k"), kv)
        assert np.array_equal(pool.dequantize(s, layer, "v"), -kv)


def check_counts(pool):
    st = pool.stats
    assert st.free + st.cached + st.in_use == pool.num_pages
    held = {g for s in pool.sequences for g in pool.page_table(s).tolist() if g >= 0}
    assert st.in_use == len(held) == pool.num_used_pages
    assert st.cached == pool.num_cached_pages and st.free == pool.num_free_pages


def test_match_longest_full_pages_at_most_len_minus_one():
    pool = make_pool()
    prompt = list(range(100, 117))              # 17 tokens: 4 full pages + 1
    a, n = prefill(pool, prompt)
    assert n == 0 and pool.stats.misses == 4
    b, n = pool.match_prefix(prompt)            # 16 <= 17 - 1
    assert n == 16 and pool.page_table(b).tolist() == pool.page_table(a).tolist()[:4]
    c, n = pool.match_prefix(prompt[:16])       # at most 15: 3 pages
    assert n == 12
    d, n = pool.match_prefix(prompt[:9] + [0] * 8)   # diverges inside page 2
    assert n == 8
    e, n = pool.match_prefix([])
    assert n == 0 and pool.length(e) == 0
    for s, toks in ((b, prompt[:16]), (c, prompt[:12]), (d, prompt[:8])):
        expect(pool, s, toks)
    check_counts(pool)
    assert pool.stats.hits == 4 + 3 + 2


def test_partial_pages_never_shared():
    pool = make_pool()
    prompt = list(range(10))                    # 2 full pages + 2 positions
    a, _ = prefill(pool, prompt)
    pool.free(a)
    assert pool.num_cached_pages == 2           # the partial page went free
    b, n = pool.match_prefix(prompt + [7])
    assert n == 8


def test_free_keeps_pages_cached_until_reused_then_lru_leaf_first():
    pool = make_pool(pages=6)
    a, _ = prefill(pool, list(range(12)))       # pages A0 A1 A2
    pa = pool.page_table(a).tolist()
    b, _ = prefill(pool, [50] * 8)              # pages B0 B1
    pb = pool.page_table(b).tolist()
    pool.free(a)
    pool.free(b)
    assert pool.stats.cached == 5 and pool.stats.free == 1
    c = pool.new_sequence()                     # needs 3 pages: the free one, then evicts
    kv = kv_of(list(range(12)))
    for layer in range(L):
        pool.append(kv, kv, seq=c, layer=layer)
    # least recently released first, and a chain's leaf before its parent: A2, A1
    assert pool.stats.evictions == 2
    assert set(pool.page_table(c).tolist()) >= {pa[2], pa[1]}
    assert pool.match_prefix(list(range(12)) + [1])[1] == 4        # A0 still cached
    assert pool.match_prefix([50] * 9)[1] == 8                     # B untouched
    check_counts(pool)


def test_held_pages_never_evicted():
    pool = make_pool(pages=4)
    a, _ = prefill(pool, list(range(12)))       # 3 pages held
    s = pool.new_sequence()
    kv = kv_of([1] * 8)
    before = pool.stats
    with pytest.raises(CapacityError, match="needs 2 new pages.*1 of 4 are free, 0 cached"):
        pool.append(kv, kv, seq=s, layer=0)
    assert pool.stats == before
    expect(pool, a, list(range(12)))


def test_fork_of_matched_sequence_and_copy_on_write():
    pool = make_pool()
    prompt = list(range(30, 42))
    a, _ = prefill(pool, prompt)
    b, n = pool.match_prefix(prompt + [9])
    c = pool.fork(b)
    assert n == 12 and pool.page_table(c).tolist() == pool.page_table(a).tolist()
    pool.truncate(c, 6)                         # into the shared page 1: copied on write
    new = prompt[:6] + [77, 78]
    kv = kv_of(new)[6:]
    for layer in range(L):
        pool.append(kv, -kv, seq=c, layer=layer)
    pool.advance(c, tokens=new[6:])
    expect(pool, c, new)
    expect(pool, a, prompt)                     # the other holders never see the write
    expect(pool, b, prompt)
    assert pool.page_table(c)[1] not in pool.page_table(a).tolist()
    check_counts(pool)


@pytest.mark.parametrize("fmt", ["f16", "q8_0/q4_0"])
def test_reuse_is_exact_decode_attention_bit_for_bit(fmt):
    """(K q8_0 / V q4_0 too: matched pages hold both sides, each in its format.)"""
    pool = make_pool(pages=32, fmt=fmt)
    prompt = list(range(200, 223))
    a, _ = prefill(pool, prompt)                # computed everything
    pool.free(a)
    b, n = prefill(pool, prompt)                # matched 20, computed 3
    c = pool.new_sequence()                     # computed everything, in other pages
    kv = kv_of(prompt)
    for layer in range(L):
        pool.append(kv, -kv, seq=c, layer=layer)
    pool.advance(c, tokens=prompt)
    assert n == 20
    q = np.repeat(np.random.default_rng(1).standard_normal((1, 4, D)).astype(np.float32), 2, 0)
    cache = kvcore.KVCache(pool.spec)               # and a contiguous cache computing it all
    for layer in range(L):
        cache.append(layer, kv, -kv)
    cache.advance()
    for layer in range(L):
        out = kvcore.decode_attention(q, pool, layer, seqs=[b, c])
        assert out[0].tobytes() == out[1].tobytes()
        assert out[0].tobytes() == kvcore.decode_attention(q[0], cache, layer).tobytes()


def test_hash_collision_never_returns_another_prompts_kv(monkeypatch):
    import kvcore._pages as pages
    monkeypatch.setattr(pages, "chain_key", lambda parent, ids, extra: b"\x00" * 32)
    pool = make_pool()
    a, _ = prefill(pool, [1, 2, 3, 4, 5])       # page [1 2 3 4] under the one key
    b, n = pool.match_prefix([9, 9, 9, 9, 9])   # same key, other ids: no hit
    assert n == 0
    b2, n = pool.match_prefix([1, 2, 3, 4, 5])
    assert n == 4


def test_vllm_44701_extras_tagged_by_kind():
    """An adapter named "x" and a salt "x" (and no extra) never share a page."""
    pool = make_pool()
    prompt = list(range(9))
    prefill(pool, prompt, extra={"adapter": "x"})
    assert pool.match_prefix(prompt, extra={"salt": "x"})[1] == 0
    assert pool.match_prefix(prompt)[1] == 0
    assert pool.match_prefix(prompt, extra={"adapter": b"x"})[1] == 0   # bytes vs str
    s, n = pool.match_prefix(prompt, extra={"adapter": "x"})
    assert n == 8
    expect(pool, s, prompt[:8], {"adapter": "x"})
    assert len({tuple(prefix_keys(prompt, PS, e)) for e in
                (None, {"adapter": "x"}, {"salt": "x"}, {"adapter": b"x"})}) == 4


_KEYS = ("from kvcore._prefix_keys import prefix_keys; "
         "print(','.join(k.hex() for k in prefix_keys(list(range(40)), 16, "
         "{'adapter': 'x', 'salt': b'\\x01'})))")


def test_lmcache_1139_2136_keys_are_bytes_the_same_in_every_process():
    """Two processes with different hash seeds compute the same keys, and this one too."""
    outs = []
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        outs.append(subprocess.run([sys.executable, "-c", _KEYS], env=env, check=True,
                                   capture_output=True, text=True,
                                   cwd=os.path.dirname(os.path.dirname(__file__))).stdout.strip())
    here = ",".join(k.hex() for k in prefix_keys(list(range(40)), 16,
                                                  {"adapter": "x", "salt": b"\x01"}))
    assert outs[0] == outs[1] == here and len(here.split(",")) == 2


def test_vllm_49449_rolled_back_draft_never_answers_a_later_lookup():
    pool = make_pool()
    prompt = list(range(60, 66))                # 6 tokens, then a draft of 4 fills page 1
    s, _ = prefill(pool, prompt)
    draft = [1, 1, 1, 1]
    kv = kv_of(prompt + draft)[6:]
    for layer in range(L):
        pool.append(kv, -kv, seq=s, layer=layer)
    pool.advance(s, tokens=draft)               # committed for verification: page 1 full
    assert pool.match_prefix(prompt + draft + [0])[1] == 8
    pool.truncate(s, 7)                         # only one draft token accepted
    assert pool.match_prefix(prompt + draft + [0])[1] == 4
    pool.free(s)
    assert pool.match_prefix(prompt + draft + [0])[1] == 4
    check_counts(pool)


def test_sglang_35270_shared_page_never_double_counted():
    pool = make_pool(pages=8)
    prompt = list(range(13))
    a, _ = prefill(pool, prompt)                # 4 pages in use
    seqs = [pool.match_prefix(prompt)[0] for _ in range(3)]   # 3 x 3 shared pages
    seqs.append(pool.fork(seqs[0]))
    st = pool.stats
    assert (st.free, st.cached, st.in_use) == (4, 0, 4)
    for s in [a] + seqs:
        pool.free(s)
        check_counts(pool)
    st = pool.stats
    assert (st.free, st.cached, st.in_use) == (5, 3, 0)


def test_restored_sequence_is_not_keyed():
    pool = make_pool()
    prompt = list(range(9))
    a, _ = prefill(pool, prompt)
    snap = pool.snapshot(a)
    pool.free(a)
    r = pool.restore(snap)                      # no ids: its pages are never registered
    assert pool.num_cached_pages == 2
    pool.advance(r)                             # nothing pending: no tokens needed
    pool.free(r)
    assert pool.num_cached_pages == 2


def test_refused_calls_change_nothing():
    pool = make_pool()
    s, _ = pool.match_prefix([1, 2])
    kv = kv_of([1, 2, 3])
    for layer in range(L):
        pool.append(kv, kv, seq=s, layer=layer)
    before = (pool.stats, pool.length(s))
    with pytest.raises(StateError, match="needs the token ids of its 3 new positions"):
        pool.advance(s)
    with pytest.raises(ShapeError, match="expected 3 ids .* got 2"):
        pool.advance(s, tokens=[1, 2])
    with pytest.raises(RangeError, match=r"tokens\[1\] = -2"):
        pool.advance(s, tokens=[1, -2, 3])
    with pytest.raises(DTypeError):
        pool.advance(s, tokens=[1.5, 2, 3])
    with pytest.raises(ShapeError, match="expected 1 id arrays"):
        pool.advance([s], tokens=[[1, 2, 3], [4]])
    assert (pool.stats, pool.length(s)) == before
    assert pool.advance(s, tokens=np.array([1, 2, 3], np.uint16)) == 3


def test_without_prefix_cache():
    spec = KVSpec(num_layers=1, num_kv_heads=H, head_dim=D, capacity=8)
    pool = KVPool(spec, num_pages=2, page_size=PS)
    with pytest.raises(StateError, match="prefix_cache=True"):
        pool.match_prefix([1, 2, 3])
    s = pool.new_sequence()
    with pytest.raises(StateError, match="no prefix cache"):
        pool.advance(s, tokens=[])
    assert pool.stats == kvcore.PoolStats(2, 0, 0, 0, 0, 0)
    with pytest.raises(kvcore.SpecError, match="prefix_cache must be a bool"):
        KVPool(spec, num_pages=2, prefix_cache=1)


def test_eviction_takes_leaves_before_parents_then_any():
    """A0 is cached but names B1 (held) as its child: a newer leaf X0 goes first; when only
    A0 is left, it goes too (a write never fails while a cached page exists)."""
    pool = make_pool(pages=6)
    a, _ = prefill(pool, list(range(5)))             # A0 registered, A1 partial
    b = pool.new_sequence()                          # the same 4 ids, then 5 more, computed
    toks = list(range(9))
    kv = kv_of(toks)
    for layer in range(L):
        pool.append(kv, -kv, seq=b, layer=layer)
    pool.advance(b, tokens=toks)                     # B0 (a duplicate: not registered), B1
    pa = pool.page_table(a).tolist()
    pool.free(a)                                     # A0 cached, A1 free
    x, _ = prefill(pool, [40] * 4 + [1])             # X0 registered, X1 partial
    px = pool.page_table(x).tolist()
    pool.free(x)                                     # lru: A0, then X0 (newer)
    assert (pool.stats.free, pool.stats.cached) == (1, 2)
    c = pool.new_sequence()
    big = kv_of([7] * 8)
    for layer in range(L):
        pool.append(big, big, seq=c, layer=layer)              # 2 pages: the free one, then X0
    assert px[0] in pool.page_table(c).tolist() and pool.stats.evictions == 1
    m, n = pool.match_prefix(list(range(9)) + [0])   # A0 and B1 still found
    assert n == 8 and pool.page_table(m).tolist()[0] == pa[0]
    pool.free(m)                                     # A0 cached again, B1 held by b
    d = pool.new_sequence()
    for layer in range(L):
        pool.append(big[:4], big[:4], seq=d, layer=layer)      # no free page, no leaf: A0 goes
    assert pool.page_table(d).tolist() == [pa[0]] and pool.stats.evictions == 2
    assert pool.match_prefix(list(range(9)) + [0])[1] == 0
    check_counts(pool)
    expect(pool, b, toks)


def test_extras_of_mixed_kinds_or_lone_surrogates_refused():
    """Extras whose kinds mix str and int (which cannot be sorted) or holding a lone
    surrogate (which UTF-8 cannot encode) raise kvcore errors naming them, before the
    lookup: no sequence made, no counter moved."""
    pool = make_pool()
    prefill(pool, list(range(9)), {"a": "x"})
    before = (pool.stats, pool.sequences)
    cases = [
        (DTypeError, "invalid extra kind 1: expected a str, got int", {"a": "x", 1: "y"}),
        (DTypeError, "invalid extra kind b'a': expected a str, got bytes", {b"a": "x"}),
        (RangeError, r"invalid extra 'a': '\\ud800' holds U\+D800 at index 0, a lone "
                     r"surrogate that UTF-8 does not encode", {"a": "\ud800"}),
        (RangeError, r"invalid extra kind: 'x\\udcff' holds U\+DCFF at index 1",
         {"a": "x", "x\udcff": "y"}),
        (RangeError, r"invalid extra 'a': 'xxxxxxxxxx.*'\.\.\. holds U\+D800 at index 50",
         {"a": "x" * 50 + "\ud800"}),
    ]
    for error, match, extra in cases:
        with pytest.raises(error, match=match):
            pool.match_prefix(list(range(9)), extra)
        with pytest.raises(error, match=match):
            prefix_keys(list(range(8)), PS, extra)
        assert (pool.stats, pool.sequences) == before, match
    s, n = pool.match_prefix(list(range(9)), {"a": "x"})
    assert n == 8


# -- sliding windows ---------------------------------------------------------------------

def window_pool(pages=10, window=5, sinks=0, **kw):
    spec = KVSpec(num_layers=L, num_kv_heads=H, head_dim=D, capacity=64, num_heads=4,
                  format="f16")
    return KVPool(spec, num_pages=pages, page_size=PS, prefix_cache=True, window=window,
                  sink_tokens=sinks, **kw)


def expect_held(pool, s, tokens, extra=None):
    """s holds, at the positions it still holds, exactly the K/V of tokens (f16 storage);
    every page of a held position is a held page."""
    kv = kv_of(tokens, extra).astype(np.float16).astype(np.float32)
    at = np.concatenate([np.arange(a, b) for a, b in pool.held(s)])
    table = pool.page_table(s)
    assert (table[at // PS] >= 0).all()
    for layer in range(L):
        assert np.array_equal(pool.dequantize(s, layer, "k"), kv[at])
        assert np.array_equal(pool.dequantize(s, layer, "v"), -kv[at])


def cache_never_lies(pool, prompts):
    """Every registered page holds exactly the K/V of the prefix its key names (one of
    prompts, no extras), whether a sequence holds it or the window released it."""
    names = {}
    for tokens in prompts:
        for i, key in enumerate(prefix_keys(tokens, PS)):
            names[key] = tokens[:(i + 1) * PS]
    for g, e in pool._table.prefix.entries.items():
        kv = kv_of(names[e.key])[-PS:].astype(np.float16)
        for layer in range(L):
            k = pool._store.gather(layer, np.arange(g * PS, (g + 1) * PS))[0]
            assert k.tobytes() == kv.tobytes()


def test_window_prefix_cache_serves_only_whole_pages_of_their_key():
    """A windowed sequence registers each page as it fills, before the window releases
    it: a released registered page is cached (its bytes are still its key's K/V), an
    unregistered one free. A match walks the chain from page 0 as ever (a page whose
    parents were evicted is never reached) and the new sequence keeps only what its
    window needs; no page it holds lacks a position, no cached page holds another key's
    K/V, and free + cached + in_use = P throughout."""
    pool = window_pool(pages=10, window=5)
    a_tokens = list(range(100, 130))
    a, n = prefill(pool, a_tokens)
    assert n == 0 and pool.first_held(a) == 24 and pool.held(a) == [(24, 30)]
    st = pool.stats
    assert (st.cached, st.in_use, st.free) == (6, 2, 2)    # 7 full pages registered, 1 held
    check_counts(pool)
    expect_held(pool, a, a_tokens)
    # a second request for the same prompt: every full page from the cache, the early
    # ones released again at once
    b, n = prefill(pool, a_tokens + [7])
    assert n == 28 and pool.held(b) == [(24, 31)] and pool.stats.hits == 7
    expect_held(pool, b, a_tokens + [7])
    check_counts(pool)
    cache_never_lies(pool, [a_tokens, a_tokens + [7]])
    # other prompts take the free pages, then evict cached ones (leaves first)
    c_tokens = list(range(500, 521))
    c, n = prefill(pool, c_tokens)
    assert n == 0 and pool.stats.evictions > 0
    check_counts(pool)
    cache_never_lies(pool, [a_tokens, c_tokens])
    for s in (a, b, c):
        pool.free(s)
    check_counts(pool)
    # the chain is cut where a page was evicted: the match stops there, and what it
    # serves is the K/V of those very tokens
    index = pool._table.prefix
    keys = prefix_keys(a_tokens, PS)
    cached = 0
    while cached < len(keys) and keys[cached] in index.by_key:
        cached += 1
    assert cached < len(keys) and any(k in index.by_key for k in keys[cached:])
    d, n = prefill(pool, a_tokens + [8])
    assert n == cached * PS
    expect_held(pool, d, a_tokens + [8])
    cache_never_lies(pool, [a_tokens, c_tokens, a_tokens + [8]])
    check_counts(pool)


def test_window_sink_pages_stay_and_truncate_unregisters_what_it_cuts():
    pool = window_pool(pages=12, window=3, sinks=2)
    tokens = list(range(40, 64))
    s, _ = prefill(pool, tokens)
    assert pool.held(s) == [(0, 4), (20, 24)]
    t, n = prefill(pool, tokens[:22])                  # sink page and the window's pages
    assert n == 20 and pool.held(t) == [(0, 4), (20, 22)]
    expect_held(pool, t, tokens[:22])
    keys = prefix_keys(tokens, PS)
    index = pool._table.prefix
    assert all(k in index.by_key for k in keys)
    with pytest.raises(StateError, match="only to n >= 22"):
        pool.truncate(s, 21)
    assert all(k in index.by_key for k in keys)
    pool.truncate(s, 22)                               # cuts page 5: it leaves the cache
    assert keys[5] not in index.by_key and all(k in index.by_key for k in keys[:5])
    check_counts(pool)


def test_window_pool_and_the_chunk_store(tmp_path):
    """A windowed pool takes store= (lookups: the loaded chunks are committed, then the
    window releases what it does not need) but no store_writer (chunks start at 0); a
    store refuses a windowed sequence's snapshot, changing nothing."""
    from kvcore import SnapshotError, SpecError
    from kvcore.store import DirectoryBackend, KVStore, StoreWriter
    spec = KVSpec(num_layers=L, num_kv_heads=H, head_dim=D, capacity=64, num_heads=4,
                  format="f16")
    store = KVStore(DirectoryBackend(tmp_path, fsync=False), model="m", spec=spec,
                    chunk_tokens=2 * PS, page_size=PS)
    tokens = list(range(300, 327))
    plain = KVPool(spec, num_pages=16, page_size=PS, prefix_cache=True)
    p, _ = prefill(plain, tokens)
    assert store.save(plain.snapshot(p), tokens) == 3
    with pytest.raises(SpecError, match="store_writer= needs a pool without a window"):
        with StoreWriter(store) as writer:
            window_pool(store=store, store_writer=writer)
    pool = window_pool(pages=10, window=5, store=store)
    s, n = pool.match_prefix(tokens)
    assert n == 24 and pool.stats.store_hits == 6 and pool.held(s) == [(20, 24)]
    expect_held(pool, s, tokens[:24])
    check_counts(pool)
    result = store.load_into(pool, tokens)
    assert result.positions == 24 and pool.held(result.seq) == [(20, 24)]
    expect_held(pool, result.seq, tokens[:24])
    for layer in range(L):
        k, v = kv_of(tokens[:27])[24:], -kv_of(tokens[:27])[24:]
        pool.append(k, v, seq=s, layer=layer)
    pool.advance(s, tokens=tokens[24:27])
    snap = pool.snapshot(s)
    assert snap.start == 20
    before = sorted(p.name for p in tmp_path.rglob("*"))
    with pytest.raises(SnapshotError, match=r"a store saves chunks from position 0, and the "
                                            r"snapshot holds positions \[0, 0\) and \[20, 27\)"):
        store.save(snap, tokens)
    with StoreWriter(store) as writer:
        with pytest.raises(SnapshotError, match="a store saves chunks from position 0"):
            writer.submit(snap, tokens)
    assert sorted(p.name for p in tmp_path.rglob("*")) == before
