"""KVPool: storage layout, writes (one and batched), copy-on-write, atomic refusals,
exports for runtimes, snapshots both ways. Every stored byte is checked against a
KVCache fed the same positions (its writes are checked against kvcore.quantize in
test_cache.py)."""

import numpy as np
import pytest
from _formats import PAIRS
from _blocking import BlockingLayer

import kvcore
from kvcore._storage import storage_bytes
from kvcore import (CapacityError, DTypeError, KVCache, KVPool, KVSpec, NonFiniteError,
                    OutOfRangeError, ShapeError, SnapshotError, SpecError, StateError)

FORMATS = list(kvcore.formats.ROW_FORMATS)   # K and V in one format (q4_1ch is K only)
L, H, D = 2, 2, 64


def spec(fmt="f16", capacity=40, **kw):
    return KVSpec(num_layers=L, num_kv_heads=H, head_dim=D, capacity=capacity, format=fmt, **kw)


def steps(rng, t):
    return (rng.standard_normal((t, H, D)).astype(np.float32),
            rng.standard_normal((t, H, D)).astype(np.float32))


def assert_same(pool, seq, cache, *, pending=False):
    """seq's codes and scales in every layer equal the cache's, byte for byte."""
    for layer in range(L):
        n = cache.length + (cache.pending(layer) if pending else 0)
        assert pool.length(seq) + (pool.pending(seq, layer) if pending else 0) == n
        for got, want in zip(pool._gather(seq, layer, pending=pending), cache._layer_arrays(layer)):
            if want is None:
                assert got is None
            else:
                assert got.tobytes() == want[:n].tobytes()


def state(pool):
    return (pool._storage.tobytes(), list(pool._table.free), list(pool._table.refs),
            {s: (list(q.pages), q.length, list(q.pending)) for s, q in pool._table.seqs.items()},
            pool._table._next_id)


def test_layout_pages_are_rows_of_every_layer():
    s = spec("int8")
    pool = KVPool(s, num_pages=5, page_size=16)
    assert pool.memory_bytes == 5 * 16 * s.bytes_per_position == pool._store.nbytes
    assert pool._storage.nbytes == storage_bytes(s, 80)
    lay = pool.layout
    assert list(lay) == ["k_scales", "v_scales", "k_codes", "v_codes"]
    assert lay["k_codes"]["shape"] == (L, 80, H, D) and lay["k_scales"]["shape"] == (L, 80, H, 1)
    assert pool.strides["k_codes"] == (80 * H * D, H * D, D, 1)
    assert pool._storage.ctypes.data % 64 == 0
    # a KVCache is the one-page case: the same layout with rows = capacity
    cache = KVCache(s.replace(capacity=80))
    assert cache.layout == lay and cache.strides == pool.strides


def test_constructor_checks():
    with pytest.raises(SpecError, match="num_pages must be a positive int, got 0"):
        KVPool(spec(), num_pages=0)
    with pytest.raises(SpecError, match="page_size must be a positive int, got 2.0"):
        KVPool(spec(), num_pages=2, page_size=2.0)
    with pytest.raises(SpecError, match="KVPool needs a KVSpec"):
        KVPool({}, num_pages=2)


@pytest.mark.parametrize("fmt", FORMATS + PAIRS)
@pytest.mark.parametrize("ps", [1, 16, 17])
def test_writes_store_what_a_cache_stores(rng, fmt, ps):
    s = spec(fmt)
    pool = KVPool(s, num_pages=3 * 40 // ps + 3, page_size=ps)
    seqs = [pool.new_sequence() for _ in range(3)]
    caches = [KVCache(s) for _ in seqs]
    # a prefill of ragged lengths (one sequence empty), then decode steps, batched
    for counts in ([0, 17, 33], [1, 1, 1], [2, 0, 1], [1, 1, 1]):
        for layer in range(L):
            k, v = steps(rng, sum(counts))
            pool.append_batch(k, v, seqs=seqs, layer=layer, counts=counts)
            at = 0
            for c, cache in zip(counts, caches):
                cache.append(layer, k[at:at + c], v[at:at + c])
                at += c
        for s_, c in zip(seqs, caches):
            assert_same(pool, s_, c, pending=True)
        assert pool.advance(seqs) == counts
        for c in caches:
            c.advance()
    # one-sequence appends, [Hkv, D] input too, then a half-written step
    k, v = steps(rng, 1)
    pool.append(k[0], v[0], seq=seqs[0], layer=0)
    caches[0].append(0, k[0], v[0])
    for s_, c in zip(seqs, caches):
        assert_same(pool, s_, c)
        assert_same(pool, s_, c, pending=True)
        for which in "kv":
            assert np.array_equal(pool.dequantize(s_, 1, which), c.dequantize(1, which))
    assert pool.num_used_pages == sum(pool.pages_for(c.length + c.pending(0)) for c in caches)


def test_batched_write_input_forms(rng):
    pool = KVPool(spec("bf16"), num_pages=8, page_size=4)
    a, b = pool.new_sequence(), pool.new_sequence()
    ref = [KVCache(spec("bf16")) for _ in range(2)]
    k, v = steps(rng, 3)
    kb = k.astype(np.float16)[:, :, ::-1]     # float16, negative strides
    pool.append_batch(kb, v, seqs=(a, b), layer=0, counts=np.array([1, 2], np.int32))
    ref[0].append(0, kb[:1], v[:1])
    ref[1].append(0, kb[1:], v[1:])
    pool.append_batch(k[:2], v[:2], seqs=[a, b], layer=1)   # default counts: one each
    ref[0].append(1, k[0], v[0])
    ref[1].append(1, k[1], v[1])
    assert pool.advance(a) == 1
    assert pool.pending(b, 0) == 2 and pool.pending(b, 1) == 1
    ref[0].advance()
    assert_same(pool, a, ref[0])
    assert_same(pool, b, ref[1], pending=True)


def test_ids_are_keyword_only_and_positional_calls_change_nothing(rng):
    """seq/seqs and layer are keyword-only: the old positional forms (where seq and layer,
    two ints, could be swapped silently) raise TypeError and write nothing."""
    pool = KVPool(spec("int8"), num_pages=8, page_size=4)
    a, b = pool.new_sequence(), pool.new_sequence()
    k, v = steps(rng, 2)
    pool.append(k, v, seq=b, layer=1)
    before = state(pool)
    calls = [lambda: pool.append(a, 0, k, v),             # the old order
             lambda: pool.append(0, a, k, v),             # the old order, ids swapped
             lambda: pool.append(k, v, a, 0),
             lambda: pool.append(k, v, a, layer=0),
             lambda: pool.append_batch(0, [a, b], k, v, [1, 1]),
             lambda: pool.append_batch(0, [a, b], k, v),
             lambda: pool.append_batch(k, v, [a, b], 0)]
    for call in calls:
        with pytest.raises(TypeError, match="positional argument"):
            call()
        assert state(pool) == before
    pool.append(k, v, seq=a, layer=0)
    pool.append_batch(k[:1], v[:1], layer=1, seqs=[a])
    assert [pool.pending(a, 0), pool.pending(a, 1), pool.pending(b, 1)] == [2, 1, 2]


def test_refused_writes_change_no_byte_and_no_count(rng):
    pool = KVPool(spec("q8_0", capacity=12), num_pages=4, page_size=4)
    a, b = pool.new_sequence(), pool.new_sequence()
    k, v = steps(rng, 6)
    pool.append_batch(k, v, seqs=[a, b], layer=0, counts=[3, 3])
    before = state(pool)
    bad = k.copy()
    bad[4, 1, 7] = np.nan
    cases = [
        (NonFiniteError, r"non-finite value in k: k\[4, 1, 7\] = nan",
         lambda: pool.append_batch(bad, v, seqs=[a, b], layer=0, counts=[3, 3])),
        (kvcore.FormatError, "value out of range of format q8_0",
         lambda: pool.append_batch(k * 1e7, v, seqs=[a, b], layer=1, counts=[3, 3])),
        (ShapeError, r"expected \[5, 2, 64\] \(the sum of counts\), got \[6, 2, 64\]",
         lambda: pool.append_batch(k, v, seqs=[a, b], layer=0, counts=[2, 3])),
        (ShapeError, r"invalid shape of v: expected \[6, 2, 64\], got \[5, 2, 64\]",
         lambda: pool.append_batch(k, v[:5], seqs=[a, b], layer=0, counts=[3, 3])),
        (DTypeError, "invalid dtype of k",
         lambda: pool.append(k.astype(np.float64), v, seq=a, layer=0)),
        (DTypeError, "invalid type of k",
         lambda: pool.append_batch([1.0], v, seqs=[a], layer=0, counts=[1])),
        (ShapeError, r"invalid shape of counts: expected \[2\]",
         lambda: pool.append_batch(k, v, seqs=[a, b], layer=0, counts=[6])),
        (ShapeError, "counts must be ints >= 0, got -1",
         lambda: pool.append_batch(k, v, seqs=[a, b], layer=0, counts=[7, -1])),
        (StateError, "unknown sequence 9",
         lambda: pool.append_batch(k, v, seqs=[a, 9], layer=0, counts=[3, 3])),
        (StateError, "sequence 0 appears twice",
         lambda: pool.append_batch(k, v, seqs=[a, a], layer=0, counts=[3, 3])),
        (OutOfRangeError, "layer 2 out of range", lambda: pool.append(k, v, seq=a, layer=2)),
        (CapacityError, r"sequence 1 full: layer 0 asked for position 12 \(holds 3, appending 10\)",
         lambda: pool.append_batch(*steps(rng, 11), seqs=[a, b], layer=0, counts=[1, 10])),
        (CapacityError, r"the write needs 3 new pages \(sequence 0: 1, sequence 1: 2\), 2 of 4 are free",
         lambda: pool.append_batch(*steps(rng, 12), seqs=[a, b], layer=0, counts=[4, 8])),
    ]
    for error, match, call in cases:
        with pytest.raises(error, match=match):
            call()
        assert state(pool) == before, match



def test_capacity_errors_name_the_pending_positions(rng):
    """Past spec.capacity or out of pages while positions are pending (appends never
    advanced), the error says how many, of which layer and sequence, and to call
    advance(); with nothing pending it does not."""
    pool = KVPool(spec("int8", capacity=12), num_pages=5, page_size=4)
    a, b = pool.new_sequence(), pool.new_sequence()
    hint = "call advance\\(\\) once every layer holds the step's positions$"
    pool.append(*steps(rng, 10), seq=a, layer=0)
    before = state(pool)
    with pytest.raises(CapacityError, match="^sequence 0 full: layer 0 asked for position 12 "
                       "\\(holds 10, appending 3\\), capacity is 12 positions; 10 positions of "
                       "layer 0 of sequence 0 are pending: " + hint):
        pool.append(*steps(rng, 3), seq=a, layer=0)
    assert state(pool) == before
    pool.append(*steps(rng, 1), seq=b, layer=0)
    pool.append(*steps(rng, 2), seq=b, layer=1)
    before = state(pool)
    with pytest.raises(CapacityError, match="^pool out of pages: .*, 1 of 5 are free; 1 "
                       "position of layer 0 of sequence 1 is pending: " + hint):
        pool.append(*steps(rng, 8), seq=b, layer=0)
    with pytest.raises(CapacityError, match="^pool out of pages: .*; positions of layer 0 are "
                       "pending \\(sequence 1: 1, sequence 0: 10\\): " + hint):
        pool.append_batch(*steps(rng, 9), seqs=[b, a], layer=0, counts=[8, 1])
    with pytest.raises(CapacityError, match="; 2 positions of layer 1 of sequence 1 are "
                       "pending: " + hint):
        pool.append_batch(*steps(rng, 15), seqs=[a, b], layer=1, counts=[8, 7])
    assert state(pool) == before
    pool.truncate(a, 0)
    pool.truncate(b, 0)
    c = pool.new_sequence()
    for layer in range(L):
        pool.append_batch(*steps(rng, 20), seqs=[a, b, c], layer=layer, counts=[8, 8, 4])
    pool.advance()
    for call in (lambda: pool.append(*steps(rng, 1), seq=c, layer=0),
                 lambda: pool.append(*steps(rng, 5), seq=a, layer=0)):
        with pytest.raises(CapacityError) as e:     # nothing pending: no hint
            call()
        assert " pending" not in str(e.value) and "advance" not in str(e.value)

def test_fork_shares_full_pages_and_writes_never_reach_another_sequence(rng):
    s = spec("int8")
    pool = KVPool(s, num_pages=12, page_size=4)
    a = pool.new_sequence()
    ca = KVCache(s)
    k, v = steps(rng, 6)
    for layer in range(L):
        pool.append(k, v, seq=a, layer=layer)
        ca.append(layer, k, v)
    pool.advance(a)
    ca.advance()
    used = pool.num_used_pages
    b = pool.fork(a)                       # shares page 0, copies the partial page 1
    assert pool.num_used_pages == used + 1
    assert pool.page_table(b)[0] == pool.page_table(a)[0]
    assert pool.page_table(b)[1] != pool.page_table(a)[1]
    cb = KVCache(s)
    cb.restore(ca.snapshot())
    assert_same(pool, b, cb)
    # b rewrites position 2 (inside the shared page): the page is copied first
    pool.truncate(b, 2)
    cb.truncate(2)
    k2, v2 = steps(rng, 3)
    for layer in range(L):
        pool.append(k2, v2, seq=b, layer=layer)
        cb.append(layer, k2, v2)
    pool.advance(b)
    cb.advance()
    assert pool.page_table(b)[0] != pool.page_table(a)[0]
    assert_same(pool, a, ca)
    assert_same(pool, b, cb)
    # the forked sequence's writes into its copied tail leave a alone too
    c = pool.fork(a)
    for layer in range(L):
        pool.append(k2[:1], v2[:1], seq=c, layer=layer)
    assert_same(pool, a, ca)
    pool.free(a)
    pool.free(b)
    pool.free(c)
    assert pool.num_free_pages == 12 and pool.sequences == []


def test_one_write_to_every_holder_of_a_shared_page(rng):
    """b and a share page 0 (a fork, then truncates into it); one append_batch writes to
    both: b takes a copy and a writes in place, over a row b's copy keeps (copies are
    made before any row is written). Nothing leaks: 2 pages used, the rest free."""
    s = spec("q8_0")
    pool = KVPool(s, num_pages=3, page_size=4)
    a = pool.new_sequence()
    ca = KVCache(s)
    k, v = steps(rng, 4)
    for layer in range(L):
        pool.append(k, v, seq=a, layer=layer)
        ca.append(layer, k, v)
    pool.advance(a)
    ca.advance()
    b = pool.fork(a)
    cb = KVCache(s)
    cb.restore(ca.snapshot())
    for seq, cache, n in ((a, ca, 1), (b, cb, 3)):
        pool.truncate(seq, n)
        cache.truncate(n)
    k2, v2 = steps(rng, 2)
    for layer in range(L):
        pool.append_batch(k2, v2, seqs=[b, a], layer=layer)
        cb.append(layer, k2[:1], v2[:1])
        ca.append(layer, k2[1:], v2[1:])
    assert pool.advance([b, a]) == [1, 1]
    ca.advance()
    cb.advance()
    assert_same(pool, a, ca)
    assert_same(pool, b, cb)
    assert pool.num_used_pages == 2 and pool.num_free_pages == 1
    pool.free(a)
    pool.free(b)
    assert pool.num_free_pages == 3


def test_fork_without_a_free_page_is_refused():
    pool = KVPool(spec(capacity=8), num_pages=2, page_size=4)
    a = pool.new_sequence()
    pool.append(np.ones((5, H, D), np.float32), np.ones((5, H, D), np.float32), seq=a, layer=0)
    pool.append(np.ones((5, H, D), np.float32), np.ones((5, H, D), np.float32), seq=a, layer=1)
    pool.advance()
    before = state(pool)
    with pytest.raises(CapacityError, match="fork of sequence 0 needs 1 free page .* 0 of 2"):
        pool.fork(a)
    assert state(pool) == before


def test_counts_a_scheduler_needs(rng):
    pool = KVPool(spec(), num_pages=10, page_size=4)
    a = pool.new_sequence()
    assert pool.num_pages == 10 and pool.page_size == 4 and pool.num_free_pages == 10
    pool.append(*steps(rng, 9), seq=a, layer=0)
    assert pool.num_used_pages == 3 and pool.num_free_pages == 7 and pool.pages_for(9) == 3
    assert pool.length(a) == 0 and pool.pending(a, 0) == 9 and pool.pending(a, 1) == 0
    with pytest.raises(StateError, match="layer 0 holds 9; layer 1 holds 0"):
        pool.advance(a)
    pool.truncate(a, 0)
    assert pool.num_used_pages == 0
    assert "KVPool(layers=2" in repr(pool)


def test_block_tables_csr_and_slot_mapping(rng):
    pool = KVPool(spec(), num_pages=10, page_size=4)
    a, b, c = (pool.new_sequence() for _ in range(3))
    for layer in range(L):
        pool.append_batch(*steps(rng, 14), seqs=[a, b, c], layer=layer, counts=[5, 0, 9])
    pool.advance()
    ta, tc = pool.page_table(a).tolist(), pool.page_table(c).tolist()
    assert len(ta) == 2 and len(tc) == 3 and pool.page_table(b).dtype == np.int32
    bt = np.full((3, 4), 99, np.int32)
    pool.block_tables([a, b, c], bt)
    assert bt.tolist() == [ta + [-1, -1], [-1] * 4, tc + [-1]]
    with pytest.raises(ShapeError, match=r"expected \[3, >= 3\], got \[3, 2\]"):
        pool.block_tables([a, b, c], np.zeros((3, 2), np.int32))
    with pytest.raises(DTypeError, match="invalid dtype of out"):
        pool.block_tables([a], np.zeros((1, 4), np.int64))
    indptr, last = np.zeros(4, np.int32), np.zeros(3, np.int32)
    indices = np.full(8, -7, np.int32)
    assert pool.csr([a, b, c], indptr, indices, last) == 5
    assert indptr.tolist() == [0, 2, 2, 5] and indices[:5].tolist() == ta + tc
    assert last.tolist() == [1, 0, 1]
    with pytest.raises(ShapeError, match="indices holds 4 entries, the tables need 5"):
        pool.csr([a, b, c], indptr, np.zeros(4, np.int32), last)
    # a pending position counts with layer=
    pool.append(*steps(rng, 1), seq=a, layer=0)
    pool.csr([a], indptr[:2], indices, last[:1], layer=0)
    assert last[0] == 2
    pool.truncate(a, 5)
    # slot mapping reserves the pages of the next positions: slot = page * 4 + offset
    slots = np.zeros(8, np.int64)
    pool.slot_mapping([a, b], [4, 2], slots)
    ta = pool.page_table(a).tolist()
    assert slots.tolist() == [ta[1] * 4 + 1, ta[1] * 4 + 2, ta[1] * 4 + 3, ta[2] * 4,
                              pool.page_table(b)[0] * 4, pool.page_table(b)[0] * 4 + 1, -1, -1]
    assert pool.length(a) == 5 and pool.pending(a, 0) == 0
    with pytest.raises(ShapeError, match="out holds 1 slots, the positions need 2"):
        pool.slot_mapping([a], [2], np.zeros(1, np.int64))
    before = state(pool)
    with pytest.raises(CapacityError, match="pool out of pages"):
        pool.slot_mapping([c], [27], np.zeros(27, np.int64))
    assert state(pool) == before


@pytest.mark.parametrize("fmt", FORMATS + PAIRS)
def test_snapshots_both_ways(rng, fmt, tmp_path):
    s = spec(fmt)
    pool = KVPool(s, num_pages=30, page_size=3)
    other = pool.new_sequence()      # interleave pages with another sequence
    a = pool.new_sequence()
    cache = KVCache(s)
    for t in (4, 1, 7):
        k, v = steps(rng, t)
        for layer in range(L):
            pool.append_batch(np.concatenate([k[:1], k]), np.concatenate([v[:1], v]),
                              seqs=[other, a], layer=layer, counts=[1, t])
            cache.append(layer, k, v)
        pool.advance()
        cache.advance()
    snap = pool.snapshot(a)
    want = cache.snapshot()
    for name in ("k_codes", "v_codes", "k_scales", "v_scales"):
        x, y = getattr(snap, name), getattr(want, name)
        assert (x is None and y is None) or x.tobytes() == y.tobytes()
    assert pool.snapshot(a, 5).length == 5
    # pool -> KVCache
    back = KVCache(s)
    back.restore(snap)
    assert back._storage[:].tobytes() == cache._storage.tobytes()
    # KVCache -> file -> pool
    path = tmp_path / "snap.safetensors"
    cache.snapshot().save(path)
    b = pool.restore(kvcore.load_snapshot(path))
    assert_same(pool, b, cache)
    with pytest.raises(OutOfRangeError, match="expected 0 <= n <= length 12"):
        pool.snapshot(a, 13)
    # into an existing sequence: its pages are replaced (shared ones stay with the others)
    c = pool.fork(a)
    used = pool.num_used_pages
    assert pool.restore(cache.snapshot(5), seq=c) == c
    assert pool.length(c) == 5 and pool.pending(c, 0) == 0
    assert pool.num_used_pages == used + 2   # c shared a's 4 full pages; 5 positions take 2
    back.restore(cache.snapshot(5))
    assert_same(pool, c, back)
    assert_same(pool, a, cache)
    with pytest.raises(StateError, match="unknown sequence 99"):
        pool.restore(snap, seq=99)
    before = state(pool)
    with pytest.raises(SnapshotError, match="does not match"):
        pool.restore(KVCache(spec(fmt, capacity=4).replace(head_dim=32)).snapshot())
    small = KVPool(s, num_pages=3, page_size=3)
    with pytest.raises(CapacityError, match="restoring 12 positions needs 4 pages, 3 of 3"):
        small.restore(snap)
    assert state(pool) == before and small.sequences == []


def test_a_pool_in_use_by_another_thread_refuses_every_call(rng):
    import threading
    pool = KVPool(spec("int8"), num_pages=8, page_size=4)
    a = pool.new_sequence()
    k, v = steps(rng, 2)
    for layer in range(L):
        pool.append(k, v, seq=a, layer=layer)
    pool.advance()
    snap = pool.snapshot(a)
    inside, go = threading.Event(), threading.Event()
    errors = []

    def hold():
        try:
            pool.append(k, v, seq=a, layer=BlockingLayer(0, inside, go))
        except BaseException as e:    # noqa: BLE001 - reported below
            errors.append(e)
    t = threading.Thread(target=hold)
    t.start()
    try:
        assert inside.wait(60)
        before = state(pool)
        q = np.zeros((1, 2, D), np.float32)
        calls = {"append": lambda: pool.append(k, v, seq=a, layer=0),
                 "append_batch": lambda: pool.append_batch(k, v, seqs=[a], layer=0, counts=[2]),
                 "advance": pool.advance, "truncate": lambda: pool.truncate(a, 1),
                 "fork": lambda: pool.fork(a), "free": lambda: pool.free(a),
                 "new_sequence": pool.new_sequence, "restore": lambda: pool.restore(snap),
                 "snapshot": lambda: pool.snapshot(a),
                 "dequantize": lambda: pool.dequantize(a, 0, "k"),
                 "slot_mapping": lambda: pool.slot_mapping([a], [1], np.zeros(1, np.int64)),
                 "block_tables": lambda: pool.block_tables([a], np.zeros((1, 2), np.int32)),
                 "decode_attention": lambda: kvcore.decode_attention(q, pool, 0, seqs=[a])}
        for op, call in calls.items():
            with pytest.raises(StateError, match=f"{op}: this KVPool is in use by another thread"):
                call()
            assert state(pool) == before
    finally:
        go.set()
        t.join(60)
    assert not t.is_alive() and not errors
    assert pool.pending(a, 0) == 2 and pool.pending(a, 1) == 0


BAD_IDS = [0.0, np.float64(0), True, False, np.bool_(False), 0.5, None, "0", [0]]


@pytest.mark.parametrize("bad", BAD_IDS, ids=repr)
def test_ids_that_are_not_ints_are_refused_everywhere(rng, bad):
    """0.0, np.float64(0) and False hash and compare equal to 0: every call that takes a
    sequence id refuses anything but an int (numpy ints too) with DTypeError naming it,
    and changes nothing (not sequence 0 found by equality)."""
    pool = KVPool(spec(), num_pages=6, page_size=4)
    a, b = pool.new_sequence(), pool.new_sequence()
    for layer in range(L):
        pool.append(*steps(rng, 5), seq=a, layer=layer)
    pool.advance()
    pool.append(*steps(rng, 1), seq=a, layer=0)
    snap = pool.snapshot(a)
    before = state(pool)
    k, v = steps(rng, 1)
    calls = {
        "append": lambda: pool.append(k, v, seq=bad, layer=1),
        "append_batch": lambda: pool.append_batch(k, v, seqs=[bad], layer=1),
        "append_batch, two": lambda: pool.append_batch(*steps(rng, 2), seqs=[a, bad], layer=1),
        "advance": lambda: pool.advance(bad),
        "advance, list": lambda: pool.advance([bad]),
        "length": lambda: pool.length(bad),
        "pending": lambda: pool.pending(bad, 0),
        "page_table": lambda: pool.page_table(bad),
        "fork": lambda: pool.fork(bad),
        "truncate": lambda: pool.truncate(bad, 0),
        "free": lambda: pool.free(bad),
        "snapshot": lambda: pool.snapshot(bad),
        "restore": lambda: pool.restore(snap, seq=bad),
        "dequantize": lambda: pool.dequantize(bad, 0, "k"),
        "block_tables": lambda: pool.block_tables([bad], np.zeros((1, 4), np.int32)),
        "csr": lambda: pool.csr([bad], np.zeros(2, np.int32), np.zeros(4, np.int32),
                                np.zeros(1, np.int32)),
        "slot_mapping": lambda: pool.slot_mapping([bad], [1], np.zeros(2, np.int64)),
    }
    if bad is None or isinstance(bad, list):   # advance(None): every sequence; a list: ids
        calls["advance"] = lambda: pool.advance([[bad]])
    if bad is None:
        del calls["restore"]                   # restore(seq=None): a new sequence
    for name, call in calls.items():
        with pytest.raises(DTypeError, match="invalid type of (sequence id|seqs)"):
            call()
        assert state(pool) == before, name
    # numpy ints are ids
    assert pool.length(np.int64(a)) == 5 and pool.pending(np.int32(a), 0) == 1


def test_plain_python_errors_become_kvcore_errors(rng):
    """advance(True / 0.5), a non-iterable seqs or counts and a 2-D counts array raise
    kvcore errors (never a bare TypeError) and change nothing."""
    pool = KVPool(spec(), num_pages=6, page_size=4)
    a = pool.new_sequence()
    pool.append(*steps(rng, 1), seq=a, layer=0)
    pool.append(*steps(rng, 1), seq=a, layer=1)
    before = state(pool)
    k, v = steps(rng, 1)
    cases = [
        (DTypeError, r"invalid type of seqs: expected int, got bool \(True\)",
         lambda: pool.advance(True)),
        (DTypeError, r"invalid type of seqs: expected int, got float \(0.5\)",
         lambda: pool.advance(0.5)),
        (DTypeError, r"invalid type of seqs: expected int, got float64",
         lambda: pool.advance(np.float64(0))),
        (DTypeError, r"invalid type of counts: expected a sequence of ints >= 0 .* got int \(5\)",
         lambda: pool.append_batch(k, v, seqs=[a], layer=0, counts=5)),
        (DTypeError, r"counts must be ints >= 0, got float 1.0",
         lambda: pool.append_batch(k, v, seqs=[a], layer=0, counts=[1.0])),
        (ShapeError, r"invalid shape of counts: expected \[1\] \(one per sequence\), got \[1, 1\]",
         lambda: pool.append_batch(k, v, seqs=[a], layer=0, counts=np.ones((1, 1), np.int64))),
        (DTypeError, r"invalid type of seqs: expected a sequence of sequence ids \(ints\), got int",
         lambda: pool.append_batch(k, v, seqs=a, layer=0)),
        (DTypeError, "invalid type of seqs: .* got str",
         lambda: pool.block_tables("0", np.zeros((1, 4), np.int32))),
        (DTypeError, r"invalid type of seqs: expected a sequence of sequence ids \(ints\), got int",
         lambda: pool.slot_mapping(a, [1], np.zeros(4, np.int64))),
    ]
    for error, match, call in cases:
        with pytest.raises(error, match=match):
            call()
        assert state(pool) == before, match
    assert pool.advance(np.int64(a)) == 1


@pytest.mark.parametrize("fill, error, match", [
    (2**40, kvcore.RangeError, r"fill 1099511627776 out of range: expected an int32, "
                               r"-2147483648 <= fill <= 2147483647"),
    (-2**31 - 1, kvcore.RangeError, "fill -2147483649 out of range"),
    ("x", DTypeError, r"invalid type of fill: expected int, got str \('x'\)"),
    (None, DTypeError, r"invalid type of fill: expected int, got NoneType"),
    (float("nan"), DTypeError, r"invalid type of fill: expected int, got float \(nan\)"),
    (1.7, DTypeError, r"invalid type of fill: expected int, got float \(1.7\)"),
    (np.float64(2.0), DTypeError, "invalid type of fill: expected int, got float64"),
    (True, DTypeError, r"invalid type of fill: expected int, got bool"),
], ids=repr)
def test_block_tables_fill_must_be_an_int32(rng, fill, error, match):
    """A fill that is not an int32 is refused before a byte of out is written (1.7 was
    written as 1; 2**40, 'x', None and nan raised numpy's own errors)."""
    pool = KVPool(spec(), num_pages=6, page_size=4)
    a = pool.new_sequence()
    for layer in range(L):
        pool.append(*steps(rng, 5), seq=a, layer=layer)
    pool.advance()
    out = np.full((1, 4), 99, np.int32)
    with pytest.raises(error, match=match):
        pool.block_tables([a], out, fill=fill)
    assert (out == 99).all()
    for ok in (np.int32(-7), -2**31, 2**31 - 1, np.uint8(0)):
        pool.block_tables([a], out, fill=ok)
        assert out.tolist() == [pool.page_table(a).tolist() + [int(ok)] * 2]


def test_csr_refuses_overlapping_outputs(rng):
    """indptr, indices and last_page_len that share memory (views of one buffer) would
    write over each other and give a corrupt table: ShapeError naming the two, nothing
    written; an output over the pool's own storage is refused too."""
    pool = KVPool(spec(), num_pages=10, page_size=4)
    a, b = pool.new_sequence(), pool.new_sequence()
    for layer in range(L):
        pool.append_batch(*steps(rng, 14), seqs=[a, b], layer=layer, counts=[5, 9])
    pool.advance()
    buf = np.full(32, -7, np.int32)
    cases = [
        ("indices overlaps indptr", (buf[0:3], buf[2:10], buf[20:22])),
        ("last_page_len overlaps indptr", (buf[0:3], buf[10:18], buf[1:3])),
        ("last_page_len overlaps indices", (buf[0:3], buf[10:18], buf[17:19])),
        ("indices overlaps indptr", (buf[0:3], buf[0:8], buf[0:2])),
    ]
    for match, (indptr, indices, last) in cases:
        with pytest.raises(ShapeError, match=match):
            pool.csr([a, b], indptr, indices, last)
        assert (buf == -7).all(), match
    storage = pool._storage[:64].view(np.int32)
    before = state(pool)
    with pytest.raises(ShapeError, match="indices overlaps the pool's storage"):
        pool.csr([a, b], buf[0:3], storage, buf[20:22])
    with pytest.raises(ShapeError, match="out overlaps the pool's storage"):
        pool.block_tables([a, b], storage[:6].reshape(2, 3))
    assert state(pool) == before and (buf == -7).all()
    # adjacent, not overlapping: taken
    assert pool.csr([a, b], buf[0:3], buf[3:8], buf[8:10]) == 5
    assert buf[:3].tolist() == [0, 2, 5] and buf[8:10].tolist() == [1, 1]


# -- sliding windows (docs/design.md, Sliding windows) ---------------------------------------

def test_window_constructor_checks():
    for kw, match in ((dict(window=0), r"window must be None or an int >= 1 .*got 0"),
                      (dict(window=-3), "got -3"), (dict(window=2.0), "got 2.0"),
                      (dict(window=True), "got True"),
                      (dict(window=4, sink_tokens=-1), "sink_tokens must be an int >= 0, got -1"),
                      (dict(window=4, sink_tokens=1.0), "got 1.0"),
                      (dict(sink_tokens=2), r"sink_tokens=2 needs a window \(window=W\)")):
        with pytest.raises(SpecError, match=match):
            KVPool(spec(), num_pages=2, page_size=4, **kw)
    pool = KVPool(spec(), num_pages=2, page_size=4, window=np.int64(3), sink_tokens=np.int32(1))
    assert (pool.window, pool.sink_tokens) == (3, 1) and type(pool.window) is int
    assert "window=3, sink_tokens=1" in repr(pool)
    plain = KVPool(spec(), num_pages=2, page_size=4)
    assert (plain.window, plain.sink_tokens) == (None, 0) and "window" not in repr(plain)


@pytest.mark.parametrize("fmt, window, ps, sinks", [("f16", 7, 4, 0), ("int8", 5, 3, 4),
                                                     ("q8_0", 1, 2, 1), ("bf16", 16, 16, 2)])
def test_window_memory_follows_the_window(rng, fmt, window, ps, sinks):
    """Two sequences decode 120 positions each in a pool whose pages hold far less than
    their histories: each holds at most ceil((W + ps - 1) / ps) + 1 pages past its sink
    pages after every step, free + used = P, and every held position reads back exactly
    the bytes a KVCache fed the same positions holds there (dequantize: the held
    positions, in order)."""
    sink_pages = -(-sinks // ps)
    bound = -(-(window + ps - 1) // ps) + 1 + sink_pages
    s = spec(fmt, capacity=200)
    pool = KVPool(s, num_pages=2 * bound + 2, page_size=ps, window=window, sink_tokens=sinks)
    seqs = [pool.new_sequence(), pool.new_sequence()]
    caches = [KVCache(s), KVCache(s)]
    for n in range(1, 121):
        k, v = steps(rng, 2)
        for layer in range(L):
            pool.append_batch(k, v, seqs=seqs, layer=layer)
            for b, cache in enumerate(caches):
                cache.append(layer, k[b:b + 1], v[b:b + 1])
        assert pool.advance() == [1, 1]
        for cache in caches:
            cache.advance()
        for seq in seqs:
            table = pool.page_table(seq)
            assert len(table) == pool.pages_for(n)
            assert (table >= 0).sum() <= bound
            first = pool.first_held(seq)
            assert first % ps == 0 and first <= max(0, n - window + 1)
            assert (table[sink_pages:first // ps] == -1).all() and (table[first // ps:] >= 0).all()
        assert pool.num_free_pages + pool.num_used_pages == pool.num_pages
    for seq, cache in zip(seqs, caches):
        spans = pool.held(seq)
        assert spans[-1][1] == 120 and spans[-1][0] == pool.first_held(seq) > 0
        at = np.concatenate([np.arange(a, b) for a, b in spans])
        for layer in range(L):
            for got, want in zip(pool._gather(seq, layer), cache._layer_arrays(layer)):
                assert (got is None) == (want is None)
                if want is not None:
                    assert got.tobytes() == want[at].tobytes()
            assert pool.dequantize(seq, layer, "v").tobytes() == \
                cache.dequantize(layer, "v")[at].tobytes()
    for seq in seqs:
        pool.free(seq)
    assert pool.num_free_pages == pool.num_pages


def test_window_exports_and_rollback(rng):
    """page_table and block_tables give -1 for released pages, csr refuses them unless
    told what to write there; slot_mapping maps only new positions (always held); a
    truncate below what the window needs is refused with nothing changed; fork shares
    the held pages; a prefill releases at its advance."""
    pool = KVPool(spec(capacity=64), num_pages=12, page_size=4, window=6, sink_tokens=2)
    a = pool.new_sequence()
    for layer in range(L):
        pool.append(*steps(rng, 23), seq=a, layer=layer)
    assert pool.page_table(a).tolist() == list(range(6)) and pool.first_held(a) == 0
    assert pool.advance(a) == 23          # the prefill's pages are released at its advance
    ta = pool.page_table(a).tolist()
    assert ta[1:4] == [-1, -1, -1] and min(ta[:1] + ta[4:]) >= 0
    assert pool.first_held(a) == 16 and pool.held(a) == [(0, 4), (16, 23)]
    assert pool.num_free_pages == 12 - 3
    bt = np.full((1, 8), 99, np.int32)
    pool.block_tables([a], bt, fill=-5)
    assert bt.tolist() == [ta + [-5, -5]]
    indptr, indices, last = np.zeros(2, np.int32), np.zeros(8, np.int32), np.zeros(1, np.int32)
    before = (indptr.copy(), indices.copy(), last.copy())
    with pytest.raises(StateError, match=r"csr: sequence 0 holds positions from 16 only "
                                         r"\(window 6 released the pages before\): pass released="):
        pool.csr([a], indptr, indices, last)
    assert all(np.array_equal(x, y) for x, y in zip(before, (indptr, indices, last)))
    with pytest.raises(DTypeError, match="invalid type of released"):
        pool.csr([a], indptr, indices, last, released=1.0)
    assert pool.csr([a], indptr, indices, last, released=0) == 6
    assert indices[:6].tolist() == [0 if g < 0 else g for g in ta] and last.tolist() == [3]
    slots = np.zeros(3, np.int64)
    pool.slot_mapping([a], [3], slots)
    assert slots.tolist() == [ta[5] * 4 + 3, pool.page_table(a)[6] * 4, pool.page_table(a)[6] * 4 + 1]
    pool.truncate(a, 23)
    # rollback: only to a length whose window the held positions still cover (>= 16 + 5)
    before = state(pool)
    with pytest.raises(StateError, match="only to n >= 21"):
        pool.truncate(a, 20)
    assert state(pool) == before and pool.first_held(a) == 16
    pool.truncate(a, 21)
    assert pool.held(a) == [(0, 4), (16, 21)]
    b = pool.fork(a)
    tb = pool.page_table(b).tolist()
    assert tb[:5] == pool.page_table(a).tolist()[:5] and pool.held(b) == pool.held(a)
    assert pool._table.refs[tb[4]] == 2 and tb[5] != pool.page_table(a)[5]
    for layer in range(L):
        assert pool.dequantize(b, layer, "k").tobytes() == pool.dequantize(a, layer, "k").tobytes()
    pool.truncate(b, 3)                   # within the sink page: all of [0, 3) held again
    assert pool.held(b) == [(0, 3)] and pool.first_held(b) == 0
    assert pool.page_table(b).tolist() == [ta[0]]


def test_window_copies_keep_the_window(rng):
    import copy
    import pickle
    pool = KVPool(spec(), num_pages=8, page_size=4, window=5, sink_tokens=1)
    a = pool.new_sequence()
    for layer in range(L):
        pool.append(*steps(rng, 13), seq=a, layer=layer)
    pool.advance(a)
    for other in (copy.deepcopy(pool), pickle.loads(pickle.dumps(pool))):
        assert (other.window, other.sink_tokens) == (5, 1) and other.held(a) == pool.held(a)
        assert other.page_table(a).tolist() == pool.page_table(a).tolist()
        for layer in range(L):
            assert other.dequantize(a, layer, "k").tobytes() == \
                pool.dequantize(a, layer, "k").tobytes()


def test_decode_attention_window_defaults_from_the_pool():
    """What kvcore.decode_attention applies on a pool (KVPool._attention_window): a pool
    without a window passes the caller's values on; a windowed pool gives its own window
    and sink positions when none is asked, takes a smaller window or fewer sink
    positions (they see a subset of what is held), refuses more."""
    plain = KVPool(spec(), num_pages=2, page_size=4)
    assert plain._attention_window(None, 0) == (None, 0)
    assert plain._attention_window(9, 2) == (9, 2)
    pool = KVPool(spec(), num_pages=2, page_size=4, window=8, sink_tokens=2)
    assert pool._attention_window(None, 0) == (8, 2)
    assert pool._attention_window(None, None) == (8, 2)
    assert pool._attention_window(None, 1) == (8, 1)
    assert pool._attention_window(4, 0) == (4, 0)
    assert pool._attention_window(8, None) == (8, 0)
    assert pool._attention_window("x", 0) == ("x", 0)        # left to decode_attention's checks
    for window, sinks, match in ((9, 0, "takes window <= 8, got 9"),
                                 (None, 3, "takes sink_tokens <= 2, got 3"),
                                 (8, 3, "takes sink_tokens <= 2, got 3")):
        with pytest.raises(kvcore.RangeError, match=match):
            pool._attention_window(window, sinks)


@pytest.mark.parametrize("window, ps, sinks", [(6, 4, 2), (1, 4, 0), (5, 3, 0), (4, 1, 1)])
def test_decode_attention_on_a_windowed_pool(rng, window, ps, sinks):
    """Attention over a windowed pool, each step attended before its advance (the
    documented order), never reads a released page: it equals, bit for bit, a KVCache
    holding the whole history with the same window, prefill chunks included. The call
    names no window: decode_attention takes the pool's."""
    s = spec("f32", capacity=64, num_heads=4)
    pool = KVPool(s, num_pages=16, page_size=ps, window=window, sink_tokens=sinks)
    cache = KVCache(s)
    a = pool.new_sequence()
    for t in (11, 1, 7, 1, 1, 3, 1, 1, 1, 1):
        k, v = steps(rng, t)
        q = rng.standard_normal((t, 4, D)).astype(np.float32)
        for layer in range(L):
            pool.append(k, v, seq=a, layer=layer)
            cache.append(layer, k, v)
            got = kvcore.decode_attention(q, pool, layer, seqs=[a], counts=[t])
            want = kvcore.decode_attention(q, cache, layer, window=window, sink_tokens=sinks)
            assert got.tobytes() == want.tobytes()
        pool.advance(a)
        cache.advance()
    assert pool.first_held(a) > 0
    with pytest.raises(kvcore.RangeError, match=f"takes window <= {window}"):
        kvcore.decode_attention(q[:1], pool, 0, seqs=[a], window=window + 1)
