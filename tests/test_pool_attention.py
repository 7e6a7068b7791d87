"""Batched paged decode attention over a KVPool: bit for bit the KVCache result for every
sequence whatever the page order, against a float64 reference on odd sizes, several
query tokens per sequence (causal), log-sum-exp and merge_attention."""
import numpy as np
import pytest
from _formats import PAIRS

import kvcore
from kvcore import (KVCache, KVPool, KVSpec, NonFiniteError, ShapeError, StateError,
                    decode_attention, merge_attention)

FORMATS = list(kvcore.formats.ROW_FORMATS)   # K and V in one format (q4_1ch is K only)
TOL = 1e-5


def shuffled_pool(rng, spec, num_pages, page_size):
    """A pool whose pages are taken in a random order."""
    pool = KVPool(spec, num_pages=num_pages, page_size=page_size)
    pool._table.free[:] = rng.permutation(num_pages).tolist()   # any order is a valid free list
    return pool


def fill(rng, pool, lengths, pending=0, layers=None):
    """New sequences of the given lengths written together in ragged batched steps (so
    their pages interleave), plus `pending` positions in the last layer; returns the
    ids and KVCaches holding the same positions."""
    spec = pool.spec
    L, H, D = spec.num_layers, spec.num_kv_heads, spec.head_dim
    seqs = [pool.new_sequence() for _ in lengths]
    caches = [KVCache(spec) for _ in lengths]
    left = list(lengths)
    while any(left):
        counts = [min(c, int(rng.integers(1, 20))) for c in left]
        for layer in range(L):
            k = rng.standard_t(3, (sum(counts), H, D)).astype(np.float32)
            v = rng.standard_normal((sum(counts), H, D)).astype(np.float32)
            pool.append_batch(k, v, seqs=seqs, layer=layer, counts=counts)
            at = 0
            for c, cache in zip(counts, caches):
                cache.append(layer, k[at:at + c], v[at:at + c])
                at += c
        pool.advance()
        for c in caches:
            c.advance()
        left = [a - c for a, c in zip(left, counts)]
    if pending:
        k = rng.standard_normal((pending * len(seqs), H, D)).astype(np.float32)
        pool.append_batch(k, k, seqs=seqs, layer=L - 1, counts=[pending] * len(seqs))
        for b, c in enumerate(caches):
            c.append(L - 1, k[b * pending:(b + 1) * pending], k[b * pending:(b + 1) * pending])
    return seqs, caches


def reference(q, k, v, scale=None, causal=True):
    """float64 attention of q [T, Hq, D] over k, v [n, Hkv, D]; also the log-sum-exp."""
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    T, hq, d = q.shape
    n, hkv = k.shape[:2]
    g = hq // hkv
    scale = 1 / np.sqrt(d) if scale is None else scale
    kh = np.repeat(k.transpose(1, 0, 2), g, axis=0)
    vh = np.repeat(v.transpose(1, 0, 2), g, axis=0)
    s = np.einsum("thd,hnd->thn", q, kh) * scale
    if causal:
        visible = np.arange(n)[None, :] <= (n - T + np.arange(T))[:, None]
        s = np.where(visible[:, None, :], s, -np.inf)
    m = s.max(-1, keepdims=True)
    p = np.exp(s - m)
    return (np.einsum("thn,hnd->thd", p, vh) / p.sum(-1)[..., None],
            (m[..., 0] + np.log(p.sum(-1))))


def rel_err(out, ref):
    return float(np.abs(out - ref).max() / np.abs(ref).max())


@pytest.mark.parametrize("fmt", FORMATS + PAIRS)
@pytest.mark.parametrize("ps", [1, 16, 17])
def test_bit_identical_to_a_kvcache_whatever_the_page_order(rng, fmt, ps):
    spec = KVSpec(num_layers=2, num_kv_heads=2, head_dim=64, capacity=400, num_heads=8,
                  format=fmt)
    lengths = [1, ps - 1 or 2, ps, ps + 1, 64, 65, 300]
    pool = shuffled_pool(rng, spec, sum(pool_pages(n + 3, ps) for n in lengths), ps)
    seqs, caches = fill(rng, pool, lengths, pending=2)
    q = rng.standard_normal((len(seqs), 8, 64)).astype(np.float32)
    counts = [1, 2, 0, 2, 1, 1, 3]
    qt = rng.standard_normal((sum(counts), 8, 64)).astype(np.float32)
    threads = kvcore.max_threads()
    try:
        for nt in sorted({1, 2, threads}):
            kvcore.set_num_threads(nt)
            for layer in (0, 1):
                out, lse = decode_attention(q, pool, layer, seqs=seqs, return_lse=True)
                many = decode_attention(qt, pool, layer, seqs=seqs, counts=counts)
                at = 0
                for b, cache in enumerate(caches):
                    want, want_lse = decode_attention(q[b], cache, layer, return_lse=True)
                    assert out[b].tobytes() == want.tobytes(), (nt, layer, b)
                    assert lse[b].tobytes() == want_lse.tobytes()
                    t = counts[b]
                    if t:
                        assert many[at:at + t].tobytes() == \
                            decode_attention(qt[at:at + t], cache, layer).tobytes()
                    at += t
    finally:
        kvcore.set_num_threads(threads)


@pytest.mark.parametrize("fmt", ["f32", "bf16", "int8", "fp8_e4m3", "q8_0", "q4_1"] + PAIRS)
def test_prefill_of_many_sequences(rng, fmt):
    """Prompts of several sequences in one call (T_b * G past 128 rows: row-wise
    jobs, the causal skip), pages shuffled: each sequence bit for bit its KVCache's
    result and the float64 reference's within rounding."""
    spec = KVSpec(num_layers=1, num_kv_heads=2, head_dim=64, capacity=300, num_heads=8,
                  format=fmt)
    lengths = [40, 150, 260]
    pool = shuffled_pool(rng, spec, sum(pool_pages(n, 16) for n in lengths), 16)
    seqs, caches = fill(rng, pool, lengths)
    counts = [40, 150, 100]                       # whole prompts, and a chunk of the last
    q = rng.standard_normal((sum(counts), 8, 64)).astype(np.float32)
    for nt in (1, 2):
        kvcore.set_num_threads(nt)
        try:
            out = decode_attention(q, pool, 0, seqs=seqs, counts=counts)
            at = 0
            for s, t, cache in zip(seqs, counts, caches):
                assert out[at:at + t].tobytes() == decode_attention(q[at:at + t], cache, 0).tobytes()
                want, _ = reference(q[at:at + t], pool.dequantize(s, 0, "k"),
                                    pool.dequantize(s, 0, "v"))
                assert rel_err(out[at:at + t], want) < TOL
                at += t
        finally:
            kvcore.set_num_threads(0)


def pool_pages(n, ps):
    return -(-n // ps)


@pytest.mark.parametrize("fmt", FORMATS + PAIRS)
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("d", [64, 96, 128, 256])
def test_against_float64_reference(rng, fmt, group, d):
    ps = [1, 16, 17][(group + d) % 3]
    spec = KVSpec(num_layers=1, num_kv_heads=2, head_dim=d, capacity=200, num_heads=2 * group,
                  format=fmt)
    lengths = [1, ps + 1, 150]
    pool = shuffled_pool(rng, spec, sum(pool_pages(n, ps) for n in lengths), ps)
    seqs, _ = fill(rng, pool, lengths)
    counts = [1, 2, 5]
    q = rng.standard_normal((8, 2 * group, d)).astype(np.float32)
    out, lse = decode_attention(q, pool, 0, seqs=seqs, counts=counts, return_lse=True)
    at = 0
    for s, t in zip(seqs, counts):
        want, want_lse = reference(q[at:at + t], pool.dequantize(s, 0, "k"),
                                   pool.dequantize(s, 0, "v"))
        assert rel_err(out[at:at + t], want) < TOL
        assert np.abs(lse[at:at + t] - want_lse).max() < 1e-4 * max(1, np.abs(want_lse).max())
        at += t


@pytest.mark.parametrize("ps", [1, 16, 17])
def test_non_causal_scale_and_out(rng, ps):
    spec = KVSpec(num_layers=1, num_kv_heads=4, head_dim=128, capacity=100, num_heads=16,
                  format="int8")
    pool = shuffled_pool(rng, spec, 20 * 2, ps if ps > 1 else 4)
    seqs, _ = fill(rng, pool, [ps - 1 or 1, 70])
    q = rng.standard_normal((4, 16, 128)).astype(np.float32)
    out = np.empty_like(q)
    got = decode_attention(q, pool, 0, seqs=seqs, counts=[2, 2], causal=False, scale=0.3, out=out)
    assert got is out
    for b, s in enumerate(seqs):
        want, _ = reference(q[2 * b:2 * b + 2], pool.dequantize(s, 0, "k"),
                            pool.dequantize(s, 0, "v"), scale=0.3, causal=False)
        assert rel_err(out[2 * b:2 * b + 2], want) < TOL


def test_merge_attention_is_cascade_attention(rng):
    """A prefix held by one sequence and a suffix by another: merging their results with
    their lse gives the attention over the whole (non-causal)."""
    spec = KVSpec(num_layers=1, num_kv_heads=2, head_dim=64, capacity=300, num_heads=8,
                  format="f32")
    pool = shuffled_pool(rng, spec, 40, 16)
    (pre, suf, whole), _ = fill(rng, pool, [200, 37, 0])
    k = np.concatenate([pool.dequantize(pre, 0, "k"), pool.dequantize(suf, 0, "k")])
    v = np.concatenate([pool.dequantize(pre, 0, "v"), pool.dequantize(suf, 0, "v")])
    pool.append(k, v, seq=whole, layer=0)
    q = rng.standard_normal((3, 8, 64)).astype(np.float32)
    o1, l1 = decode_attention(q, pool, 0, seqs=[pre], counts=[3], causal=False, return_lse=True)
    o2, l2 = decode_attention(q, pool, 0, seqs=[suf], counts=[3], causal=False, return_lse=True)
    o, lse = merge_attention(o1, l1, o2, l2)
    want, want_lse = reference(q, k, v, causal=False)
    assert rel_err(o, want) < TOL and np.abs(lse - want_lse).max() < 1e-4
    ow, lw = decode_attention(q, pool, 0, seqs=[whole], counts=[3], causal=False, return_lse=True)
    assert rel_err(o, ow) < TOL and np.abs(lse - lw).max() < 1e-4
    # a side that saw nothing (lse -inf) is the identity; both empty gives 0, -inf
    empty = np.full_like(l1, -np.inf)
    o3, l3 = merge_attention(o1, l1, np.full_like(o1, np.nan), empty)
    assert np.array_equal(o3, o1) and np.array_equal(l3, l1)
    o4, l4 = merge_attention(o1, empty, o1, empty)
    assert not o4.any() and np.all(l4 == -np.inf)
    with pytest.raises(ShapeError, match=r"invalid shape of lse2: expected \[3, 8\]"):
        merge_attention(o1, l1, o2, l2[:2])
    with pytest.raises(NonFiniteError, match="lse1 holds NaN or \\+inf"):
        merge_attention(o1, np.full_like(l1, np.nan), o2, l2)


def test_errors(rng):
    spec = KVSpec(num_layers=2, num_kv_heads=2, head_dim=64, capacity=50, num_heads=4,
                  format="f16")
    pool = KVPool(spec, num_pages=10, page_size=8)
    (a, b, e), _ = fill(rng, pool, [5, 9, 0])
    q = np.zeros((2, 4, 64), np.float32)
    with pytest.raises(StateError, match="needs seqs"):
        decode_attention(q, pool, 0)
    with pytest.raises(StateError, match="names a sequence twice"):
        decode_attention(q, pool, 0, seqs=[a, a])
    with pytest.raises(StateError, match="unknown sequence 7"):
        decode_attention(q, pool, 0, seqs=[a, 7])
    with pytest.raises(StateError, match="empty sequence: sequence 2 holds 0 positions in layer 0"):
        decode_attention(q, pool, 0, seqs=[a, e])
    with pytest.raises(StateError, match="T=6 new tokens needs at least 6 positions, sequence 0 holds 5"):
        decode_attention(np.zeros((7, 4, 64), np.float32), pool, 0, seqs=[a, b], counts=[6, 1])
    with pytest.raises(ShapeError, match=r"invalid shape of q: expected \[3, 4, 64\], got \[2, 4, 64\]"):
        decode_attention(q, pool, 0, seqs=[a, b], counts=[1, 2])
    with pytest.raises(ShapeError, match=r"invalid shape of q: expected \[2, 4, 64\], got \[4, 64\]"):
        decode_attention(q[0], pool, 0, seqs=[a, b])
    bad = q.copy()
    bad[1, 3, 5] = np.inf
    with pytest.raises(NonFiniteError, match=r"non-finite value in q at index \(1, 3, 5\)"):
        decode_attention(bad, pool, 0, seqs=[a, b], out=bad)
    assert bad[1, 3, 5] == np.inf and not bad[0].any()
    # a sequence with no query token may be empty; zero tokens in all gives an empty result
    out = decode_attention(q[:1], pool, 0, seqs=[a, e], counts=[1, 0])
    assert out.shape == (1, 4, 64)
    out, lse = decode_attention(q[:0], pool, 0, seqs=[e], counts=[0], return_lse=True)
    assert out.shape == (0, 4, 64) and lse.shape == (0, 4)
    with pytest.raises(StateError, match="seqs and counts are for a KVPool"):
        decode_attention(q[0], KVCache(spec), 0, seqs=[0])


def test_overflow_is_refused_with_out_untouched(rng):
    """A score past float32 in one sequence refuses the whole call, naming that sequence."""
    spec = KVSpec(num_layers=1, num_kv_heads=2, head_dim=64, capacity=40, num_heads=4,
                  format="f32")
    pool = KVPool(spec, num_pages=10, page_size=8)
    a, b = pool.new_sequence(), pool.new_sequence()
    small = rng.standard_normal((20, 2, 64)).astype(np.float32)
    pool.append_batch(np.concatenate([small, small * 1e30]), np.concatenate([small, small]),
                      seqs=[a, b], layer=0, counts=[20, 20])
    q = np.full((2, 4, 64), 1e20, np.float32)
    out = np.full_like(q, 7.0)
    with pytest.raises(kvcore.RangeError, match="decode_attention of sequence 1, layer 0 "
                                                "overflows float32"):
        decode_attention(q, pool, 0, seqs=[a, b], out=out)
    assert (out == 7.0).all()
    assert np.isfinite(decode_attention(q[:1], pool, 0, seqs=[a])).all()


def test_seqs_that_are_not_int_ids_refused(rng):
    """seqs holding a list, a float or a bool (0.0 and False equal sequence 0), or not a
    sequence at all, raise DTypeError naming the item; out is not written."""
    from kvcore import DTypeError
    spec = KVSpec(num_layers=1, num_kv_heads=2, head_dim=64, capacity=40, num_heads=4,
                  format="f16")
    pool = KVPool(spec, num_pages=10, page_size=8)
    (a, b), _ = fill(rng, pool, [5, 9])
    q = rng.standard_normal((2, 4, 64)).astype(np.float32)
    out = np.full_like(q, 7.0)
    cases = [
        (r"invalid type of seqs\[0\]: expected int, got list \(\[0\]\)", [[0], b]),
        (r"invalid type of seqs\[1\]: expected int, got float \(0.0\)", [b, 0.0]),
        (r"invalid type of seqs\[0\]: expected int, got float64", [np.float64(0), b]),
        (r"invalid type of seqs\[1\]: expected int, got bool \(False\)", [b, False]),
        (r"invalid type of seqs: expected a sequence of sequence ids \(ints\), got int", a),
    ]
    for match, seqs in cases:
        with pytest.raises(DTypeError, match=match):
            decode_attention(q, pool, 0, seqs=seqs, out=out)
        assert (out == 7.0).all()
    got = decode_attention(q, pool, 0, seqs=np.array([a, b]), out=out)
    assert got is out and not (out == 7.0).any()


class _Recorder:
    """kvcore.attention's _attention module, recording what attend_paged gets."""

    def __init__(self):
        from kvcore import _attention
        self._real, self.calls = _attention, []

    def __getattr__(self, name):
        return getattr(self._real, name)

    def attend_paged(self, q, kc, vc, ks, vs, kf, vf, ps, tables, lengths, counts, *args, **kw):
        self.calls.append((tables.copy(), lengths.copy(), counts.copy()))
        return self._real.attend_paged(q, kc, vc, ks, vs, kf, vf, ps, tables, lengths, counts,
                                       *args, **kw)


def fresh_tables(pool, seqs, layer, counts, window, sinks):
    """The block tables of a call built from the pool's public state: per sequence the
    pages holding positions its rows see ([0, min(S, lo)) and [lo, n)), -1 elsewhere."""
    ps = pool.page_size
    ns = [pool.length(s) + pool.pending(s, layer) for s in seqs]
    out = np.full((len(seqs), max([-(-n // ps) for n in ns] + [1])), -1, np.int32)
    for b, (s, n, t) in enumerate(zip(seqs, ns, counts)):
        pages = pool.page_table(s)
        lo = (max(n - t + 1 - window, 0) if window else 0) if t else n
        out[b, lo // ps:-(-n // ps)] = pages[lo // ps:-(-n // ps)]
        sink_end = -(-min(sinks, lo) // ps)
        out[b, :sink_end] = pages[:sink_end]
    return out, ns


@pytest.mark.parametrize("window, sinks", [(None, 0), (6, 2), (5, 0)])
def test_kept_block_tables_are_never_stale(rng, monkeypatch, window, sinks):
    """The pool's table keeps the block tables of the last list attended between calls
    (PageTable.batch). Random steps, single writes, writes to part of the list, forks,
    truncates, frees, restores and window slides run between attention calls over the
    same list (and others): every call's tables, lengths and counts equal those built
    afresh, and its output equals, bit for bit, a call after the kept tables are dropped."""
    L, H, D, ps = 2, 2, 32, 4
    spec = KVSpec(num_layers=L, num_kv_heads=H, head_dim=D, capacity=200, num_heads=4,
                  format="int8")
    pool = KVPool(spec, num_pages=300, page_size=ps, window=window, sink_tokens=sinks)
    rec = _Recorder()
    monkeypatch.setattr(kvcore.attention, "_attention", rec)
    live = [pool.new_sequence() for _ in range(3)]

    def kv(n):
        return rng.standard_normal((n, H, D)).astype(np.float32)

    def attend(seqs, layer, counts=None):
        ns = [pool.length(s) + pool.pending(s, layer) for s in seqs]
        if not seqs or min(ns) == 0:
            return
        if counts is not None:
            counts = [int(rng.integers(0, min(n, 3) + 1)) for n in ns]
        q = rng.standard_normal((len(seqs) if counts is None else sum(counts), 4, D)
                                ).astype(np.float32)
        try:
            out = decode_attention(q, pool, layer, seqs=seqs, counts=counts)
        except StateError as e:      # a window's past, released: refused either way
            assert window and "first_held" in str(e)
            pool._table._drop()
            with pytest.raises(StateError, match=str(e).replace("(", r"\(").replace(")", r"\)")):
                decode_attention(q, pool, layer, seqs=seqs, counts=counts)
            return
        tables, lengths, got_counts = rec.calls[-1]
        want, ns = fresh_tables(pool, seqs, layer, counts or [1] * len(seqs), window, sinks)
        assert (tables[:, :want.shape[1]] == want).all() and (tables[:, want.shape[1]:] == -1).all()
        assert lengths.tolist() == ns and got_counts.tolist() == (counts or [1] * len(seqs))
        pool._table._drop()
        again = decode_attention(q, pool, layer, seqs=seqs, counts=counts)
        assert out.tobytes() == again.tobytes()

    def step(seqs):
        for layer in range(L):
            pool.append_batch(kv(len(seqs)), kv(len(seqs)), seqs=seqs, layer=layer)
            attend(seqs, layer)
            attend(seqs, layer)          # the kept tables, unchanged
        pool.advance(seqs)

    for s in live:
        for layer in range(L):
            pool.append(kv(5), kv(5), seq=s, layer=layer)
    pool.advance()
    for i in range(120):
        op = rng.integers(0, 8)
        live.sort()
        if op <= 2:
            step(live)
        elif op == 3 and len(live) < 5:
            live.append(pool.fork(live[int(rng.integers(len(live)))]))
        elif op == 4:
            s = live[int(rng.integers(len(live)))]
            try:
                pool.truncate(s, max(1, pool.length(s) - int(rng.integers(0, 4))))
            except StateError:       # below what the window keeps: refused
                pass
        elif op == 5 and len(live) > 2:
            pool.free(live.pop(int(rng.integers(len(live)))))
        elif op == 6:                # part of the list written, attended mid-step
            part = live[:int(rng.integers(1, len(live) + 1))]
            pool.append_batch(kv(len(part)), kv(len(part)), seqs=part, layer=0)
            attend(live, 0, counts=True)
            attend(live, 1)
            pool.append_batch(kv(len(part)), kv(len(part)), seqs=part, layer=1)
            pool.advance(part)
        elif op == 7:
            a, b = (live[int(j)] for j in rng.permutation(len(live))[:2])
            pool.restore(pool.snapshot(a), seq=b)
        attend(live, int(rng.integers(L)), counts=True if rng.integers(3) == 0 else None)


def test_a_window_past_released_is_refused(rng):
    """On a windowed pool, attention whose rows would see positions the window released
    (a step attended after its advance) raises StateError naming first_held, with out
    untouched, instead of reading a page the sequence no longer holds."""
    spec = KVSpec(num_layers=1, num_kv_heads=2, head_dim=32, capacity=64, num_heads=4,
                  format="f16")
    pool = KVPool(spec, num_pages=12, page_size=4, window=6, sink_tokens=2)
    s = pool.new_sequence()
    x = rng.standard_normal((13, 2, 32)).astype(np.float32)
    pool.append(x, x, seq=s, layer=0)
    pool.advance(s)
    assert pool.first_held(s) == 8
    q = rng.standard_normal((1, 4, 32)).astype(np.float32)
    out = np.full_like(q, 7.0)
    for window in (None, 5, None):   # refused before the tables are kept, then after
        if window:
            assert np.isfinite(decode_attention(q, pool, 0, seqs=[s], window=window)).all()
            assert pool._table.cached([s])
            continue
        with pytest.raises(StateError, match=r"see positions from 7 \(window 6\), but the "
                                             r"window released those before 8 \(first_held\)"):
            decode_attention(q, pool, 0, seqs=[s], out=out)
        assert (out == 7.0).all()
    pool.append(x[:1], x[:1], seq=s, layer=0)      # the next step, pending: attended
    assert np.isfinite(decode_attention(q, pool, 0, seqs=[s], out=out)).all()
