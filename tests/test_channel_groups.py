"""q4_1ch in a KVCache: K by channel over groups of 32 positions (KIVI's K layout), the
open group in a float16 residual, attention reading the codes (docs/formats.md, q4_1ch)."""
import copy
import pickle

import ml_dtypes
import numpy as np
import pytest

import kvcore
from kvcore import (FormatError, KVCache, KVPool, KVSpec, NonFiniteError, ShapeError,
                    Snapshot, SnapshotError, decode_attention, load_snapshot)

F32 = np.float32
G = 32


def kivi_spec(H=2, D=64, N=160, Hq=None, v="q4_1", L=2):
    return KVSpec(num_layers=L, num_kv_heads=H, head_dim=D, capacity=N, num_heads=Hq,
                  k_format="q4_1ch", v_format=v)


def filled(spec, k, v, step=None):
    """A cache holding k, v [n, Hkv, D] in every layer, appended `step` positions at a
    time (all at once when None)."""
    cache = KVCache(spec)
    step = step or len(k)
    for t in range(0, len(k), step):
        for layer in range(spec.num_layers):
            cache.append(layer, k[t:t + step], v[t:t + step])
        cache.advance()
    return cache


def want_keys(k):
    """K of positions [0, n) as the cache holds them: complete groups by the format's
    rule on their float16 values (kvcore.quantize of each head's group), the open group
    as float16."""
    n, full = len(k), len(k) // G * G
    k16 = k.astype(np.float16)
    out = k16.astype(F32)
    for g in range(0, full, G):
        codes, scales = kvcore.quantize(k16[g:g + G].swapaxes(0, 1), "q4_1ch")
        out[g:g + G] = kvcore.dequantize(codes, scales, "q4_1ch").swapaxes(0, 1)
    return out[:n]


def reference(q, k, v, scale, causal=True, window=0, sink_tokens=0, sinks=None, softcap=0):
    """float64 attention of q [T, Hq, D] over k, v [n, Hkv, D] (docs/variants.md):
    (out, lse)."""
    T, Hq, D = q.shape
    n, H = k.shape[:2]
    qg = q.astype(np.float64).reshape(T, H, Hq // H, D) * scale
    s = np.einsum("thgd,nhd->thgn", qg, k.astype(np.float64))
    if softcap:
        s = softcap * np.tanh(s / softcap)
    j, p = np.arange(n)[None, :], (n - T + np.arange(T))[:, None]
    visible = (j <= p) if causal else np.ones((T, n), bool)
    if window:
        visible &= (j > p - window) | (j < sink_tokens)
    s = np.where(visible[:, None, None, :], s, -np.inf)
    sink = (np.full((1, H, Hq // H, 1), -np.inf) if sinks is None
            else sinks.astype(np.float64).reshape(1, H, Hq // H, 1))
    m = np.maximum(s.max(-1, keepdims=True), sink)
    w = np.exp(s - m)
    total = w.sum(-1, keepdims=True) + np.exp(sink - m)
    out = np.einsum("thgn,nhd->thgd", w / total, v.astype(np.float64))
    return out.reshape(T, Hq, D), (m + np.log(total)).reshape(T, Hq)


@pytest.mark.parametrize("n", [1, 31, 32, 33, 64, 97])
@pytest.mark.parametrize("gqa", [1, 8])
def test_attention_reads_the_groups_and_the_residual(n, gqa, rng):
    H, D = 2, 64
    spec = kivi_spec(H=H, D=D, Hq=H * gqa)
    k = rng.standard_normal((n, H, D)).astype(F32)
    v = rng.standard_t(3, (n, H, D)).astype(F32)
    cache = filled(spec, k, v, step=None if n % 2 else 7)
    kd = cache.dequantize(1, "k")
    np.testing.assert_array_equal(kd, want_keys(k))
    vd = cache.dequantize(1, "v")
    for T, causal in ((1, True), (min(n, 5), True), (3, False)):
        q = rng.standard_normal((T, H * gqa, D)).astype(F32)
        out, lse = decode_attention(q, cache, 1, causal=causal, return_lse=True)
        want, want_lse = reference(q, kd, vd, F32(1 / np.sqrt(D)), causal)
        np.testing.assert_allclose(out, want, atol=2e-5, rtol=1e-4)
        np.testing.assert_allclose(lse, want_lse, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("v", ["q4_0", "q4_1", "q8_0", "f16", "int8"])
@pytest.mark.parametrize("D, gqa, T", [(32, 1, 1), (96, 3, 2), (128, 8, 1), (160, 2, 3)])
def test_head_dims_row_blocks_and_v_formats(v, D, gqa, T, rng):
    # 4-bit V decodes in registers, in pairs of vectors (the last register block one
    # pair where D / 32 is odd), other V formats through their decoded rows; the
    # scores and the weighted sums take the rows 4 at a time (R = 1, 6, 8, 6 rows)
    H, n = 2, 75
    spec = kivi_spec(H=H, D=D, Hq=H * gqa, N=n, v=v, L=1)
    k = rng.standard_normal((n, H, D)).astype(F32)
    vals = (rng.standard_t(3, (n, H, D)) * 4).astype(F32)
    cache = filled(spec, k, vals)
    q = rng.standard_normal((T, H * gqa, D)).astype(F32)
    out, lse = decode_attention(q, cache, 0, return_lse=True)
    want, want_lse = reference(q, cache.dequantize(0, "k"), cache.dequantize(0, "v"),
                               F32(1 / np.sqrt(D)))
    np.testing.assert_allclose(out, want, atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(lse, want_lse, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("n, T, gqa, causal, kw", [
    (150, 100, 4, True, {}),                    # 400 rows: work items of 64 rows, each
    (200, 37, 8, True, {}),                     # over the positions its last row sees
    (130, 130, 3, True, dict(window=45, sink_tokens=3)),
    (97, 40, 2, False, {}),
])
def test_prefill_in_row_items(n, T, gqa, causal, kw, rng):
    # many query rows (a prompt, chunked prefill): items of 64 rows whose last visible
    # position falls inside a group (its scores past it unread), against the reference,
    # and the same bits token by token at the end of the prompt
    H, D = 2, 96
    spec = kivi_spec(H=H, D=D, Hq=H * gqa, N=n, L=1)
    k = rng.standard_normal((n, H, D)).astype(F32)
    vals = rng.standard_t(3, (n, H, D)).astype(F32)
    cache = filled(spec, k, vals)
    q = rng.standard_normal((T, H * gqa, D)).astype(F32)
    out, lse = decode_attention(q, cache, 0, causal=causal, return_lse=True, **kw)
    want, want_lse = reference(q, cache.dequantize(0, "k"), cache.dequantize(0, "v"),
                               F32(1 / np.sqrt(D)), causal, **kw)
    np.testing.assert_allclose(out, want, atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(lse, want_lse, atol=2e-5, rtol=1e-5)
    kvcore.set_num_threads(1)
    try:
        np.testing.assert_array_equal(decode_attention(q, cache, 0, causal=causal, **kw), out)
    finally:
        kvcore.set_num_threads(0)


@pytest.mark.parametrize("v", ["q4_0", "q4_1"])
def test_zeros_and_largest_values(v, rng):
    # K and V of zeros (uniform weights, zero output), then values next to the formats'
    # limits (q4_0: 524160 / 1.1, q4_1 and the K groups: 65000)
    H, D, n = 2, 96, 70
    spec = kivi_spec(H=H, D=D, Hq=2 * H, N=n, v=v, L=1)
    zeros = np.zeros((n, H, D), F32)
    q = rng.standard_normal((1, 2 * H, D)).astype(F32)
    cache = filled(spec, zeros, zeros)
    out, lse = decode_attention(q, cache, 0, return_lse=True)
    np.testing.assert_array_equal(out, 0)
    np.testing.assert_allclose(lse, np.log(n), rtol=1e-6)
    top = 524160 / 1.1 if v == "q4_0" else 65000.0
    k = rng.uniform(-65000, 65000, (n, H, D)).astype(F32) / 1e4
    vals = rng.uniform(-top, top, (n, H, D)).astype(F32)
    cache = filled(spec, k, vals)
    out, lse = decode_attention(q, cache, 0, return_lse=True)
    want, want_lse = reference(q, cache.dequantize(0, "k"), cache.dequantize(0, "v"),
                               F32(1 / np.sqrt(D)))
    np.testing.assert_allclose(out, want, atol=top * 1e-6, rtol=1e-4)
    np.testing.assert_allclose(lse, want_lse, atol=2e-5, rtol=1e-5)


def test_variants(rng):
    # sliding window with sink positions, sink logits and soft-capping (docs/variants.md)
    H, D, G_ = 2, 64, 4
    spec = kivi_spec(H=H, D=D, Hq=H * G_, N=128)
    k = (rng.standard_normal((100, H, D)) * 3).astype(F32)
    v = rng.standard_t(3, (100, H, D)).astype(F32)
    cache = filled(spec, k, v)
    kd, vd = cache.dequantize(0, "k"), cache.dequantize(0, "v")
    q = rng.standard_normal((4, H * G_, D)).astype(F32)
    sinks = rng.standard_normal(H * G_).astype(F32)
    scale = F32(1 / np.sqrt(D))
    for kw in (dict(window=40, sink_tokens=5), dict(sinks=sinks), dict(softcap=5.0),
               dict(window=33, sinks=sinks, softcap=8.0)):
        out, lse = decode_attention(q, cache, 0, return_lse=True, **kw)
        want, want_lse = reference(q, kd, vd, scale, **kw)
        np.testing.assert_allclose(out, want, atol=2e-5, rtol=1e-4, err_msg=str(kw))
        np.testing.assert_allclose(lse, want_lse, atol=2e-5, rtol=1e-5, err_msg=str(kw))


def test_groups_are_gguf_q4_1_of_each_channel(rng):
    # the stored rows of a complete group are quantize's bytes of it (to the byte), and
    # the open group's rows are not written until it completes
    H, D = 3, 64
    spec = kivi_spec(H=H, D=D, L=1, v="f16")
    k = (rng.standard_t(2, (70, H, D)) * 10).astype(F32)
    cache = filled(spec, k, k, step=5)
    codes, scales = cache.keys(0), cache.key_scales(0)
    for g in (0, 32):
        want_c, want_s = kvcore.quantize(k[g:g + G].astype(np.float16).swapaxes(0, 1), "q4_1ch")
        assert codes[g:g + G].swapaxes(0, 1).tobytes() == want_c.tobytes()
        assert scales[g:g + G].swapaxes(0, 1).tobytes() == want_s.tobytes()
    assert not codes[64:].any() and not scales[64:].any()


def test_input_dtypes_and_edges(rng):
    # float16 / bfloat16 input, zeros and values next to the 65520 limit
    H, D = 1, 32
    spec = kivi_spec(H=H, D=D, L=1)
    k = np.zeros((40, H, D), F32)
    k[:, 0, 1] = rng.uniform(-65000, 65000, 40)
    k[:, 0, 2] = np.float32(65000.0)            # one value: d = 0 (bfloat16: 65024)
    for dtype in (F32, np.float16, ml_dtypes.bfloat16):
        cache = filled(spec, k.astype(dtype), k.astype(dtype), step=3)
        np.testing.assert_array_equal(cache.dequantize(0, "k"), want_keys(k.astype(dtype).astype(F32)))
        assert np.isfinite(cache.dequantize(0, "k")).all()
    q = np.zeros((1, H, D), F32)
    np.testing.assert_allclose(decode_attention(q, cache, 0), cache.dequantize(0, "v").mean(0)[None],
                               rtol=1e-5, atol=0.1)


def test_bad_input_changes_nothing(rng):
    H, D = 2, 64
    spec = kivi_spec(H=H, D=D, L=1)
    k = rng.standard_normal((40, H, D)).astype(F32)
    cache = filled(spec, k[:30], k[:30])
    before = (cache._storage.copy(), cache._groups.residual.copy())
    for bad, err in ((np.nan, NonFiniteError), (np.inf, NonFiniteError), (70000.0, FormatError)):
        x = k[30:40].copy()
        x[4, 1, 9] = bad
        with pytest.raises(err, match=r"k\[4, 1, 9\]"):
            cache.append(0, x, k[30:40])
        assert (cache.length, cache.pending(0)) == (30, 0)
        np.testing.assert_array_equal(cache._storage, before[0])
        np.testing.assert_array_equal(cache._groups.residual, before[1])
    with pytest.raises(ShapeError):
        cache.append(0, k[30:40, :, :32], k[30:40, :, :32])


def test_truncate_into_an_encoded_group(rng):
    # back into the open group: nothing lost; back into a group the residual no longer
    # holds: its kept positions hold their decoded values (what attention read)
    H, D = 2, 64
    spec = kivi_spec(H=H, D=D)
    k = rng.standard_normal((100, H, D)).astype(F32)
    cache = filled(spec, k[:70], k[:70])
    cache.truncate(66)
    np.testing.assert_array_equal(cache.dequantize(0, "k"), want_keys(k[:66]))
    decoded = cache.dequantize(0, "k")
    cache.truncate(40)
    np.testing.assert_array_equal(cache.dequantize(0, "k")[:32], decoded[:32])
    np.testing.assert_array_equal(cache.dequantize(0, "k")[32:],
                                  decoded[32:40].astype(np.float16).astype(F32))
    for layer in range(2):
        cache.append(layer, k[40:64], k[40:64])
    cache.advance()
    redone = np.concatenate([decoded[32:40].astype(np.float16).astype(F32), k[40:64]])
    np.testing.assert_array_equal(cache.dequantize(1, "k")[32:64], want_keys(redone))
    # a pending step dropped with the rest: truncate(length) after appends to one layer
    cache.append(0, k[64:70], k[64:70])
    cache.truncate(64)
    np.testing.assert_array_equal(cache.dequantize(0, "k")[32:64], want_keys(redone))


def test_copies_carry_the_residual(rng):
    H, D = 2, 64
    k = rng.standard_normal((45, H, D)).astype(F32)
    cache = filled(kivi_spec(H=H, D=D), k, k)
    q = rng.standard_normal((1, H, D)).astype(F32)
    want = decode_attention(q, cache, 0)
    for other in (copy.deepcopy(cache), pickle.loads(pickle.dumps(cache))):
        assert other._groups.residual is not cache._groups.residual
        np.testing.assert_array_equal(decode_attention(q, other, 0), want)
        np.testing.assert_array_equal(other.dequantize(1, "k"), cache.dequantize(1, "k"))


def test_what_is_refused_names_the_format(rng):
    spec = kivi_spec()
    with pytest.raises(FormatError, match="page_size must be a multiple of 32, got 16"):
        KVPool(spec, 4, 16)
    pool = KVPool(spec, 4, 32)
    with pytest.raises(FormatError, match="slot_mapping: K format q4_1ch encodes groups"):
        pool.slot_mapping([pool.new_sequence()], [1], np.zeros(1, np.int64))
    cache = filled(spec, *(rng.standard_normal((2, 5, 2, 64)).astype(F32)))


# -- KVPool: pages of whole groups, each sequence with its residual ----------------------

def pool_and_caches(rng, lengths, spec, page_size=32, num_pages=24, **kw):
    """A pool holding sequences of these lengths (written with append_batch in uneven
    steps) and a KVCache of each holding the same positions."""
    pool = KVPool(spec, num_pages, page_size, **kw)
    seqs = [pool.new_sequence() for _ in lengths]
    caches = [KVCache(spec) for _ in lengths]
    H, D = spec.num_kv_heads, spec.head_dim
    data = [rng.standard_normal((2, n, H, D)).astype(F32) for n in lengths]
    done = [0] * len(lengths)
    while done != list(lengths):
        counts = [min(n - d, int(rng.integers(1, 40))) for n, d in zip(lengths, done)]
        k = np.concatenate([x[0, d:d + c] for x, d, c in zip(data, done, counts)])
        v = np.concatenate([x[1, d:d + c] for x, d, c in zip(data, done, counts)])
        for layer in range(spec.num_layers):
            pool.append_batch(k, v, seqs=seqs, layer=layer, counts=counts)
            for x, d, c, cache in zip(data, done, counts, caches):
                cache.append(layer, x[0, d:d + c], x[1, d:d + c])
        pool.advance()
        for cache in caches:
            cache.advance()
        done = [d + c for d, c in zip(done, counts)]
    return pool, seqs, caches


def test_pool_equals_a_cache_of_each_sequence(rng):
    spec = kivi_spec(Hq=8, N=200)
    lengths = [5, 64, 97, 130]
    pool, seqs, caches = pool_and_caches(rng, lengths, spec, page_size=64, num_pages=12)
    q = rng.standard_normal((len(seqs), 8, 64)).astype(F32)
    out, lse = decode_attention(q, pool, 1, seqs=seqs, return_lse=True)
    for b, (s, cache) in enumerate(zip(seqs, caches)):
        np.testing.assert_array_equal(pool.dequantize(s, 1, "k"), cache.dequantize(1, "k"))
        one, one_lse = decode_attention(q[b], cache, 1, return_lse=True)
        np.testing.assert_array_equal(out[b], one)
        np.testing.assert_array_equal(lse[b], one_lse)
    sinks = rng.standard_normal(8).astype(F32)
    capped = decode_attention(q, pool, 1, seqs=seqs, softcap=4.0, sinks=sinks)
    for b, cache in enumerate(caches):
        np.testing.assert_array_equal(capped[b], decode_attention(q[b], cache, 1, softcap=4.0,
                                                                  sinks=sinks))
    # several tokens per sequence (causal), and a sequence without queries
    counts = [3, 0, 2, 1]
    qs = rng.standard_normal((sum(counts), 8, 64)).astype(F32)
    out = decode_attention(qs, pool, 0, seqs=seqs, counts=counts)
    at = 0
    for c, cache in zip(counts, caches):
        if c:
            np.testing.assert_array_equal(out[at:at + c], decode_attention(qs[at:at + c], cache, 0))
        at += c


def test_pool_fork_truncate_copies_and_free(rng):
    spec = kivi_spec(N=200)
    pool, (s,), (cache,) = pool_and_caches(rng, [90], spec)
    f = pool.fork(s)                 # shares pages 0-1, copies the partial page 2
    pool.truncate(f, 40)             # into a shared, encoded group: decoded into f's residual
    cut = copy.deepcopy(cache)
    cut.truncate(40)
    np.testing.assert_array_equal(pool.dequantize(f, 0, "k"), cut.dequantize(0, "k"))
    np.testing.assert_array_equal(pool.dequantize(s, 0, "k"), cache.dequantize(0, "k"))
    k = rng.standard_normal((30, 2, 64)).astype(F32)
    for layer in range(2):
        pool.append(k, k, seq=f, layer=layer)     # completes the group in a copied page
        cut.append(layer, k, k)
    pool.advance(f)
    cut.advance()
    for other in (pool, copy.deepcopy(pool), pickle.loads(pickle.dumps(pool))):
        np.testing.assert_array_equal(other.dequantize(f, 1, "k"), cut.dequantize(1, "k"))
        np.testing.assert_array_equal(other.dequantize(s, 1, "k"), cache.dequantize(1, "k"))
    q = rng.standard_normal((1, 2, 64)).astype(F32)
    np.testing.assert_array_equal(decode_attention(q, pool, 1, seqs=[f]), decode_attention(q, cut, 1))
    pool.free(f)
    assert f not in pool._groups


def test_fork_of_a_sequence_whose_pending_positions_completed_its_open_group(rng):
    # the fork holds the committed positions; seq's pending ones completed their group (and
    # wrote the next group's first slots of the residual): the fork's open group is what a
    # snapshot of those positions holds (decoded from the completed group), in every layer
    spec = kivi_spec(N=200)
    pool, (s,), (cache,) = pool_and_caches(rng, [40], spec)
    k = rng.standard_normal((30, 2, 64)).astype(F32)
    pool.append(k, k, seq=s, layer=0)        # layer 0: positions 40-69, pending
    pool.append(k[:5], k[:5], seq=s, layer=1)   # layer 1: 40-44, its group still open
    f = pool.fork(s)
    want = KVCache(spec)
    want.restore(pool.snapshot(s, 40))
    q = rng.standard_normal((1, 2, 64)).astype(F32)
    for layer in range(2):
        np.testing.assert_array_equal(pool.dequantize(f, layer, "k"), want.dequantize(layer, "k"))
        np.testing.assert_array_equal(decode_attention(q, pool, layer, seqs=[f]),
                                      decode_attention(q, want, layer))
    np.testing.assert_array_equal(pool.dequantize(f, 1, "k"), cache.dequantize(1, "k"))


def test_prefix_cache_matches_whole_groups(rng):
    spec = kivi_spec(N=200, L=1)
    pool = KVPool(spec, 12, 32, prefix_cache=True)
    tokens = np.arange(100)
    k = rng.standard_normal((100, 2, 64)).astype(F32)
    s = pool.new_sequence()
    pool.append(k, k, seq=s, layer=0)
    pool.advance(s, tokens=tokens)
    t, n = pool.match_prefix(tokens)
    assert n == 96                   # three full pages of one group each
    np.testing.assert_array_equal(pool.dequantize(t, 0, "k"), pool.dequantize(s, 0, "k")[:96])
    pool.truncate(t, 70)             # into a matched group: decoded from the cached page
    np.testing.assert_array_equal(pool.dequantize(t, 0, "k")[64:],
                                  pool.dequantize(s, 0, "k")[64:70].astype(np.float16).astype(F32))
    q = rng.standard_normal((1, 2, 64)).astype(F32)
    cache = filled(spec, k[:70], k[:70])
    cache.truncate(64)
    cache.append(0, pool.dequantize(t, 0, "k")[64:], k[64:70])
    cache.advance()
    np.testing.assert_array_equal(decode_attention(q, pool, 0, seqs=[t]),
                                  decode_attention(q, cache, 0))


# -- snapshots: the complete groups' codes and the open group's float16 ------------------

@pytest.mark.parametrize("n", [0, 40, 64, 70])
def test_snapshot_round_trips_through_a_file(n, rng, tmp_path):
    spec = kivi_spec()
    k = rng.standard_normal((70, 2, 64)).astype(F32)
    cache = filled(spec, k, k, step=9)
    snap = cache.snapshot(n)
    assert snap.k_residual.shape == (2, n % 32, 2, 64) and not snap.k_codes[:, n - n % 32:].any()
    snap.save(tmp_path / "s.safetensors")
    want = copy.deepcopy(cache)
    want.truncate(n)
    pool = KVPool(spec, 8, 32)
    s = pool.new_sequence()
    pool.append(k[:5], k[:5], seq=s, layer=0)       # replaced by the restore
    for loaded in (snap, load_snapshot(tmp_path / "s.safetensors")):
        other = KVCache(spec)
        other.restore(loaded)
        assert pool.restore(loaded, seq=s) == s
        for layer in range(2):
            np.testing.assert_array_equal(other.dequantize(layer, "k"), want.dequantize(layer, "k"))
            np.testing.assert_array_equal(pool.dequantize(s, layer, "k"), want.dequantize(layer, "k"))
        again = pool.snapshot(s)
        for name in ("k_codes", "k_scales", "v_codes", "v_scales", "k_residual"):
            np.testing.assert_array_equal(getattr(again, name), getattr(snap, name))


def test_bad_snapshots_are_refused(rng):
    spec = kivi_spec()
    k = rng.standard_normal((40, 2, 64)).astype(F32)
    snap = filled(spec, k, k).snapshot()
    parts = {name: getattr(snap, name) for name in ("k_codes", "v_codes", "k_scales", "v_scales")}
    with pytest.raises(SnapshotError, match=r"snapshot k_residual must be a numpy array"):
        Snapshot(spec, 40, **parts)
    res = snap.k_residual.copy()
    res[1, 3, 0, 5] = np.inf
    cache = KVCache(spec)
    with pytest.raises(SnapshotError, match=r"k_residual\[1, 3, 0, 5\] is not finite"):
        cache.restore(Snapshot(spec, 40, **parts, k_residual=res))
    assert cache.length == 0
    with pytest.raises(SnapshotError, match="snapshot of K format q4_1 has no residual"):
        Snapshot(spec.replace(k_format="q4_1"), 40, **parts, k_residual=res)


def test_requantize_to_and_from_q4_1ch(rng):
    # into q4_1ch: K as appends of the decoded values store it; out of it: its values
    spec = kivi_spec()
    k = rng.standard_normal((70, 2, 64)).astype(F32)
    f16 = filled(spec.replace(format="f16"), k, k)
    kivi = KVCache(spec)
    kivi.restore(f16.snapshot(), requantize=True)
    np.testing.assert_array_equal(kivi.dequantize(1, "k"), want_keys(k))
    back = KVCache(spec.replace(format="f32"))
    back.restore(kivi.snapshot(40), requantize=True)
    cut = copy.deepcopy(kivi)
    cut.truncate(40)        # the group of position 39, decoded to float16, as the snapshot's
    np.testing.assert_array_equal(back.dequantize(0, "k"), cut.dequantize(0, "k"))
    big = k.copy()
    big[3, 1, 2] = 70000.0
    with pytest.raises(SnapshotError, match=r"cannot requantize the f32 snapshot to q4_1ch: k, "
                                            r"layer 0: value out of range of format q4_1ch"):
        kivi.restore(filled(spec.replace(format="f32"), big, k).snapshot(), requantize=True)
    assert kivi.length == 70


def test_windowed_pool_releases_whole_groups(rng, tmp_path):
    # a windowed pool equals a KVCache attended with the same window and sink positions,
    # bit for bit, while it releases pages of whole groups; its snapshots (start > 0)
    # restore into another windowed pool
    spec = kivi_spec(Hq=8, N=400)
    W, S = 40, 3
    pool = KVPool(spec, 12, 32, window=W, sink_tokens=S)
    seq, cache = pool.new_sequence(), KVCache(spec)
    q = rng.standard_normal((1, 8, 64)).astype(F32)
    for step in range(30):
        k = rng.standard_normal((7, 2, 64)).astype(F32)
        for layer in range(2):
            pool.append(k, k, seq=seq, layer=layer)
            cache.append(layer, k, k)
        np.testing.assert_array_equal(decode_attention(q, pool, 1, seqs=[seq])[0],
                                      decode_attention(q, cache, 1, window=W, sink_tokens=S)[0])
        pool.advance(seq)
        cache.advance()
    assert pool.held(seq) == [(0, 32), (160, 210)]
    kept = np.r_[0:32, 160:210]
    np.testing.assert_array_equal(pool.dequantize(seq, 0, "k"), cache.dequantize(0, "k")[kept])
    snap = pool.snapshot(seq)
    assert (snap.start, snap.sink_end, snap.k_residual.shape) == (160, 32, (2, 18, 2, 64))
    snap.save(tmp_path / "w.safetensors")
    other = KVPool(spec, 12, 32, window=W, sink_tokens=S)
    t = other.restore(load_snapshot(tmp_path / "w.safetensors"))
    np.testing.assert_array_equal(decode_attention(q, other, 1, seqs=[t]),
                                  decode_attention(q, pool, 1, seqs=[seq]))
