"""decode_attention(..., scores="int8"): the query rows quantized per block of 32 (bit-exact
with the documented rule), the scores integer dot products with K's int8 / q8_0 / q4_0 /
q4_1 codes.
Two proofs: against the float64 reference over the quantized queries the error is
rounding only; against the exact queries it stays within the documented bound."""
import numpy as np
import pytest
from _attention_reference import reference_attention
from test_attention import make_cache
from test_pool_attention import fill, pool_pages, shuffled_pool

import kvcore
from kvcore import (DTypeError, FormatError, KVSpec, RangeError, ShapeError, decode_attention)
from kvcore._attention import quantize_query

TOL = 1e-5
K_CODES = ["int8", "q8_0", "q4_0", "q4_1", "q8_0/q4_0", "int8/f16", "q8_0/f32",
           "q4_1/q4_0"]                                      # K with integer codes, any V


def quantize_rule(x):
    """The documented rule in numpy (docs/attention.md, "Int8 scores"): per block of 32
    values of each row, amax = max |x|; a block with amax < 2^-100 is all zeros; else s =
    127 / amax and qd = amax / 127 in float32, codes rint(x * s) (float32 product, half to
    even). Returns (codes int8 [n, d], qd float32 [n, ceil(d / 32)], qhat float32 [n, d])."""
    x = np.asarray(x, np.float32)
    n, d = x.shape
    nb = (d + 31) // 32
    xb = np.zeros((n, nb * 32), np.float32)
    xb[:, :d] = x
    xb = xb.reshape(n, nb, 32)
    amax = np.abs(xb).max(-1)
    zero = amax < np.float32(2.0 ** -100)
    with np.errstate(divide="ignore", over="ignore"):   # blocks cut to zeros; qd * 127 past max
        s = np.where(zero, np.float32(0), np.float32(127) / amax).astype(np.float32)
        qd = np.where(zero, np.float32(0), amax / np.float32(127)).astype(np.float32)
        codes = np.rint(xb * s[..., None]).astype(np.int8)
        qhat = (codes.astype(np.float32) * qd[..., None]).reshape(n, -1)[:, :d]
    return codes.reshape(n, -1)[:, :d], qd, qhat


def scaled_qhat(q, scale):
    """q-hat of q [T, Hq, D] at `scale` (the kernel quantizes scale * q), float64."""
    qs = (q * np.float32(scale)).astype(np.float32)
    return quantize_rule(qs.reshape(-1, q.shape[-1]))[2].reshape(q.shape).astype(np.float64)


def test_quantizer_is_the_documented_rule(rng):
    """Bit-exact on fresh random rows and on the edges: zeros, one value, float32's largest
    and smallest magnitudes, the 2^-100 cut, exact ties (x * s = k + 1/2), d off the block."""
    rows = [(rng.standard_normal((50, 128)) * 10.0 ** rng.integers(-30, 30, (50, 1))).astype(np.float32),
            rng.standard_t(2, (20, 96)).astype(np.float32)]
    edge = np.zeros((12, 64), np.float32)
    edge[1, 5] = 1.0                                           # one value in a block
    edge[2, :] = np.finfo(np.float32).max * np.sign(rng.standard_normal(64))
    edge[3, :32] = np.float32(2.0 ** -100)                     # at the cut: kept
    edge[3, 32:] = np.float32(2.0 ** -100) * np.float32(0.999)  # below it: zeros
    edge[4, :] = np.float32(1e-45)                             # subnormal: zeros
    edge[5, 0], edge[5, 1:32] = 127.0, np.arange(31) + 0.5     # s = 1: every k + 1/2 a tie
    edge[6, 0], edge[6, 1:32] = -127.0, -(np.arange(31) + 0.5)
    edge[7] = rng.standard_normal(64).astype(np.float32)
    edge[7, 40] = 1e30                                         # one outlier: its block only
    edge[8, :] = -3.0                                          # all amax: codes -127
    edge[9, ::2] = np.float32(3.4e38)
    edge[9, 1::2] = np.float32(-1e-38)
    edge[10] = np.float32(2.0 ** -126) * rng.standard_normal(64).astype(np.float32)
    edge[11, 31] = -5e-30
    rows += [edge]
    for d in (1, 3, 31, 33, 70):
        rows.append(rng.standard_normal((5, d)).astype(np.float32))
    for x in rows:
        codes, qd, qhat = quantize_query(np.ascontiguousarray(x))
        want_c, want_qd, want_qhat = quantize_rule(x)
        assert codes.tobytes() == want_c.tobytes()
        assert qd.tobytes() == want_qd.tobytes()
        assert qhat.tobytes() == want_qhat.tobytes()
        assert np.abs(codes.astype(np.int32)).max(initial=0) <= 127
    # ties went to even: x * s = k + 1/2 exactly
    codes = quantize_query(edge[5:7])[0]
    half = np.arange(31) + 0.5
    assert (codes[0, 1:32] == np.rint(half)).all() and (codes[0, 1:32] % 2 == 0).all()
    assert (codes[1, 1:32] == -np.rint(half)).all()
    assert (quantize_query(edge[4:5])[0] == 0).all()
    assert (quantize_query(edge[3:4])[0][0, :32] == 127).all()
    assert (quantize_query(edge[3:4])[0][0, 32:] == 0).all()


def bound(q, k, v, scale, causal=True):
    """The documented error bound of out against the exact queries (float64): with
    e_j = sum_i |x_i - qhat_i| |k_ji| (x = scale * q, the score error of position j) and
    eps = max_j e_j over the row's visible positions, |out' - out| <= (e^(2 eps) - 1)
    sum_j w_j |v_j|, w the exact softmax weights."""
    x = (q * np.float32(scale)).astype(np.float64)
    dx = np.abs(x - scaled_qhat(q, scale))                       # [T, Hq, D]
    T, hq, d = q.shape
    n, hkv = k.shape[:2]
    g = hq // hkv
    kh = np.repeat(np.abs(k.astype(np.float64)).transpose(1, 0, 2), g, axis=0)  # [Hq, n, D]
    vh = np.repeat(np.abs(v.astype(np.float64)).transpose(1, 0, 2), g, axis=0)
    e = np.einsum("thd,hnd->thn", dx, kh)
    visible = np.arange(n)[None, :] <= (n - T + np.arange(T))[:, None] if causal \
        else np.ones((T, n), bool)
    eps = np.where(visible[:, None, :], e, 0).max(-1)            # [T, Hq]
    s = np.einsum("thd,hnd->thn", x, np.repeat(k.astype(np.float64).transpose(1, 0, 2), g, 0))
    s = np.where(visible[:, None, :], s, -np.inf)
    w = np.exp(s - s.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    return np.expm1(2 * eps)[..., None] * np.einsum("thn,hnd->thd", w, vh)


@pytest.mark.parametrize("fmt", K_CODES)
@pytest.mark.parametrize("group, d", [(1, 64), (4, 128), (8, 128), (2, 96), (3, 160)])
@pytest.mark.parametrize("n, T", [(1, 1), (63, 1), (65, 1), (300, 1), (300, 3), (200, 40)])
def test_the_attention_of_the_quantized_queries(rng, fmt, group, d, n, T):
    """Against the float64 reference over q-hat (and the cache's own values): rounding only,
    split-wise (decode, G x T <= 128 rows) and row-wise (T = 40 x G > 128: the same q-hat in
    float32), 1 and 2 threads, the same bits on each call; and within the bound against q."""
    cache = make_cache(rng, fmt, 2, group, d, n, layers=1, dist="t3" if n % 2 else "normal")
    q = (rng.standard_normal((T, 2 * group, d)) * 2).astype(np.float32)
    k = cache.dequantize(0, "k")
    v = cache.dequantize(0, "v")
    scale = 1 / np.sqrt(d)
    want = reference_attention(scaled_qhat(q, scale), k, v, scale=1.0)
    exact = reference_attention(q, k, v, scale=scale)
    err_bound = bound(q, k, v, scale)
    for nt in (1, 2):
        kvcore.set_num_threads(nt)
        try:
            out = decode_attention(q, cache, 0, scores="int8")
            again = decode_attention(q, cache, 0, scores="int8")
        finally:
            kvcore.set_num_threads(0)
        assert out.tobytes() == again.tobytes()
        assert np.abs(out - want).max() < TOL * np.abs(want).max(), nt
        assert (np.abs(out - exact) <= err_bound + TOL * np.abs(exact).max()).all(), nt


@pytest.mark.parametrize("dist", ["normal", "t3", "outlier channels"])
def test_error_bound_is_met_and_not_vacuous(rng, dist):
    """Gaussian, heavy-tailed and outlier-channel queries (a few channels 30x the rest, as
    RoPE'd queries have): the error against the exact queries is within the bound and a few
    percent of the output at most. The bound sums the score errors' magnitudes (a worst
    case): within 100x of the error on Gaussian and t3 queries, looser with outliers, whose
    blocks' coarse steps mostly cancel."""
    cache = make_cache(rng, "q8_0", 2, 4, 128, 700, layers=1)
    q = rng.standard_normal((1, 8, 128)).astype(np.float32) if dist == "normal" else \
        rng.standard_t(3, (1, 8, 128)).astype(np.float32)
    if dist == "outlier channels":
        q[..., [3, 77, 100]] *= 30
    k, v = cache.dequantize(0, "k"), cache.dequantize(0, "v")
    exact = reference_attention(q, k, v, scale=None)
    b = bound(q, k, v, 1 / np.sqrt(128))
    err = np.abs(decode_attention(q, cache, 0, scores="int8") - exact)
    assert (err <= b + TOL * np.abs(exact).max()).all()
    if dist != "outlier channels":
        assert err.max() > b.max() / 100
    assert err.max() < 5e-2 * np.abs(exact).max()


@pytest.mark.parametrize("fmt", ["int8", "q8_0", "q4_0", "q4_1"])
def test_zero_and_extreme_queries(rng, fmt):
    """q = 0 (every code 0: uniform weights, the mean of V), one non-zero value, and q at
    magnitudes whose blocks span 2^-100 to 2^100."""
    cache = make_cache(rng, fmt, 1, 4, 64, 130, layers=1)
    k, v = cache.dequantize(0, "k"), cache.dequantize(0, "v")
    zero = np.zeros((4, 64), np.float32)
    out = decode_attention(zero, cache, 0, scores="int8")
    assert np.abs(out - v[:, 0].astype(np.float64).mean(0)).max() < TOL
    one = zero.copy()
    one[2, 33] = 3.0
    tiny = (rng.standard_normal((4, 64)) * 2.0 ** -110).astype(np.float32)
    tiny[:, 32:] = rng.standard_normal((4, 32)).astype(np.float32)
    for q in (one, tiny):
        want = reference_attention(scaled_qhat(q[None], 0.125)[0], k, v, scale=1.0)
        assert rel_err(decode_attention(q, cache, 0, scores="int8"), want) < TOL


def rel_err(out, ref):
    return float(np.abs(out - ref).max() / np.abs(ref).max())


@pytest.mark.parametrize("fmt", ["int8", "q8_0/q4_0", "q4_0", "q4_1/f16"])
@pytest.mark.parametrize("ps", [1, 16, 17])
def test_pool_is_the_cache_bit_for_bit(rng, fmt, ps):
    """A KVPool's sequences (shuffled pages, several tokens each) give the bits of a
    KVCache holding the same positions, with int8 scores as without."""
    spec = KVSpec(num_layers=1, num_kv_heads=2, head_dim=64, capacity=300, num_heads=16,
                  format=fmt)
    lengths = [1, 17, 64, 65, 290]
    pool = shuffled_pool(rng, spec, sum(pool_pages(n + 3, ps) for n in lengths), ps)
    seqs, caches = fill(rng, pool, lengths)
    counts = [1, 1, 3, 0, 2]
    q = rng.standard_normal((sum(counts), 16, 64)).astype(np.float32)
    out = decode_attention(q, pool, 0, seqs=seqs, counts=counts, scores="int8")
    at = 0
    for cache, t in zip(caches, counts):
        if t:
            assert out[at:at + t].tobytes() == \
                decode_attention(q[at:at + t], cache, 0, scores="int8").tobytes()
        at += t


def test_with_the_variants(rng):
    """A window with sink positions, sink logits and soft-capping act on the q-hat scores."""
    cache = make_cache(rng, "int8", 2, 4, 64, 200, layers=1)
    q = rng.standard_normal((5, 8, 64)).astype(np.float32)
    k, v = cache.dequantize(0, "k"), cache.dequantize(0, "v")
    sinks = rng.standard_normal(8).astype(np.float32)
    kw = dict(window=45, sink_tokens=3, sinks=sinks, softcap=2.0)
    want = reference_attention(scaled_qhat(q, 0.125), k, v, scale=1.0, **kw)
    out = decode_attention(q, cache, 0, scores="int8", **kw)
    assert rel_err(out, want) < 1e-4     # soft-capping's tanh: a few float32 ulp


@pytest.mark.parametrize("fmt", ["f32", "f16", "bf16", "fp8_e4m3", "fp8_e5m2", "f16/q8_0",
                                 "bf16/q4_0", "q4_1ch/q4_0"])
def test_k_formats_without_int8_codes_refused(rng, fmt):
    """A KVCache and a KVPool: FormatError naming the K format, out and the storage's
    bytes unchanged."""
    cache = make_cache(rng, fmt, 2, 4, 64, 20, layers=1)
    pool = shuffled_pool(rng, cache.spec.replace(capacity=64), 8, 32)
    seqs, _ = fill(rng, pool, [20, 33])
    q = rng.standard_normal((8, 64)).astype(np.float32)
    out = np.full_like(q, 7.0)
    before = cache._storage.tobytes(), pool._storage.tobytes()
    with pytest.raises(FormatError, match=r"scores='int8' reads K's integer codes: K format"):
        decode_attention(q, cache, 0, out=out, scores="int8")
    with pytest.raises(FormatError, match=r"scores='int8' reads K's integer codes: K format"):
        decode_attention(q[None].repeat(2, 0), pool, 0, seqs=seqs, scores="int8")
    assert (out == 7.0).all()
    assert (cache._storage.tobytes(), pool._storage.tobytes()) == before


@pytest.mark.parametrize("scores", ["int4", "INT8", "", 8, None, b"int8"])
def test_unknown_scores_refused(rng, scores):
    cache = make_cache(rng, "int8", 2, 4, 64, 20, layers=1)
    q = rng.standard_normal((8, 64)).astype(np.float32)
    out = np.full_like(q, 7.0)
    before = cache._storage.tobytes()
    with pytest.raises(RangeError, match=r"scores must be one of \('float32', 'int8'\)"):
        decode_attention(q, cache, 0, out=out, scores=scores)
    assert (out == 7.0).all() and cache._storage.tobytes() == before


def test_bad_queries_refused_as_without(rng):
    """Shapes, dtypes, NaN and overflow: the same errors as the float32 scores, out untouched."""
    cache = make_cache(rng, "int8", 2, 4, 64, 20, layers=1)
    out = np.full((8, 64), 7.0, np.float32)
    before = cache._storage.tobytes()
    with pytest.raises(ShapeError):
        decode_attention(np.zeros((8, 32), np.float32), cache, 0, scores="int8")
    with pytest.raises(DTypeError):
        decode_attention(np.zeros((8, 64)), cache, 0, scores="int8")
    q = np.ones((8, 64), np.float32)
    q[3, 9] = np.nan
    with pytest.raises(kvcore.NonFiniteError, match=r"non-finite value in q at index \(3, 9\)"):
        decode_attention(q, cache, 0, out=out, scores="int8")
    with pytest.raises(RangeError):
        decode_attention(np.full((8, 64), 3e38, np.float32), cache, 0, out=out, scores="int8",
                         scale=1.0)
    assert (out == 7.0).all() and cache._storage.tobytes() == before
