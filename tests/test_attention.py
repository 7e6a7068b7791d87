"""decode_attention against a float64 numpy reference computed on the cache's own
dequantized values: the kernel's error is rounding only."""
import numpy as np
import pytest

import kvcore
from kvcore import (DTypeError, KVCache, KVSpec, NonFiniteError, OutOfRangeError, RangeError,
                    ShapeError, StateError, decode_attention)

from _formats import PAIRS, sides

FORMATS = list(kvcore.formats.ROW_FORMATS)   # K and V in one format (q4_1ch is K only)
TOL = 1e-5
# K/V pairs: the scores read K's codes, the weighted sums V's; against the reference over
# each side's own dequantized values the error is rounding only, as for one format
WITH_PAIRS = FORMATS + PAIRS


def make_cache(rng, fmt, hkv, group, d, n, *, pending=0, layers=2, dist="normal"):
    """A cache with n committed positions in every layer (plus `pending` in layer 1)."""
    spec = KVSpec(num_layers=layers, num_kv_heads=hkv, head_dim=d, capacity=n + pending + 3,
                  num_heads=hkv * group, format=fmt)
    cache = KVCache(spec)
    draw = rng.standard_normal if dist == "normal" else (lambda s: rng.standard_t(3, s))
    for start in range(0, n, 1024):
        t = min(1024, n - start)
        for layer in range(layers):
            cache.append(layer, draw((t, hkv, d)).astype(np.float32),
                         draw((t, hkv, d)).astype(np.float32))
        cache.advance()
    if pending:
        cache.append(1, draw((pending, hkv, d)).astype(np.float32),
                     draw((pending, hkv, d)).astype(np.float32))
    return cache


def reference(q, cache, layer, scale=None, causal=True, dtype=np.float64):
    """Attention over cache.dequantize(layer) (committed + pending positions), computed
    in `dtype` (float64: the reference; float32: a plain same-precision implementation)."""
    k = cache.dequantize(layer, "k", pending=True).astype(dtype)  # [n, Hkv, D]
    v = cache.dequantize(layer, "v", pending=True).astype(dtype)
    q3 = q.reshape(-1, *q.shape[-2:]).astype(dtype)
    T, hq, d = q3.shape
    n, hkv = k.shape[:2]
    g = hq // hkv
    scale = dtype(1 / np.sqrt(d) if scale is None else scale)
    kh = np.repeat(k.transpose(1, 0, 2), g, axis=0)     # [Hq, n, D]
    vh = np.repeat(v.transpose(1, 0, 2), g, axis=0)
    s = np.einsum("thd,hnd->thn", q3, kh) * scale        # [T, Hq, n]
    if causal:
        visible = np.arange(n)[None, :] <= (n - T + np.arange(T))[:, None]  # [T, n]
        s = np.where(visible[:, None, :], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    out = np.einsum("thn,hnd->thd", p, vh) / p.sum(-1)[..., None]
    return out.reshape(q.shape)


def rel_err(out, ref):
    return float(np.abs(out - ref).max() / np.abs(ref).max())


@pytest.mark.parametrize("fmt", WITH_PAIRS)
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_formats_gqa_head_dims(rng, fmt, group, d):
    cache = make_cache(rng, fmt, 2, group, d, 97)
    q = rng.standard_normal((2 * group, d)).astype(np.float32)
    out = decode_attention(q, cache, 0)
    assert out.shape == q.shape and out.dtype == np.float32
    assert rel_err(out, reference(q, cache, 0)) < TOL


# Every format at every short length; at 3000 positions (many tiles, the threaded split)
# the one-row decode and the 5-row causal step take alternate formats, f32 both: each
# format one long case, each path over both 1-byte and wider codes.
_LONG = [(3000, 1, f) for f in FORMATS[0::2]] + [(3000, 5, f) for f in FORMATS[1::2]]
_LONG += [(3000, 5, "f32")] if "f32" in FORMATS[0::2] else [(3000, 1, "f32")]


@pytest.mark.parametrize("n, T, fmt", [(n, T, f) for n, T in [(1, 1), (31, 1), (31, 5), (32, 1),
                                                               (32, 5), (33, 1), (33, 5)]
                                       for f in FORMATS] + _LONG)
def test_lengths_and_new_tokens(rng, fmt, n, T):
    cache = make_cache(rng, fmt, 8, 4, 128, n, dist="t")
    q = rng.standard_normal((T, 32, 128)).astype(np.float32)
    assert rel_err(decode_attention(q, cache, 1), reference(q, cache, 1)) < TOL


@pytest.mark.parametrize("fmt", ["f32", "f16", "bf16", "int8", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("d", [3, 8, 70, 72])
def test_head_dims_off_the_vector_width(rng, fmt, d):
    cache = make_cache(rng, fmt, 2, 2, d, 45)
    q = rng.standard_normal((3, 4, d)).astype(np.float32)
    assert rel_err(decode_attention(q, cache, 0), reference(q, cache, 0)) < TOL


@pytest.mark.parametrize("fmt, d", [(f, d) for f in ["f32", "bf16", "int8", "q8_0"]
                                    for d in [16, 32, 48, 96, 160] if f != "q8_0" or d % 32 == 0])
def test_head_dims_off_the_column_blocks(rng, fmt, d):
    """D a multiple of the vector width but not of the V column block (64 lanes with
    AVX-512): the last columns go one vector at a time (q8_0 takes D % 32 == 0)."""
    cache = make_cache(rng, fmt, 2, 4, d, 70)
    q = rng.standard_normal((2, 8, d)).astype(np.float32)
    assert rel_err(decode_attention(q, cache, 0), reference(q, cache, 0)) < TOL


@pytest.mark.parametrize("fmt", WITH_PAIRS)
@pytest.mark.parametrize("n, T", [(15, 1), (16, 1), (17, 3), (63, 1), (64, 1), (65, 1),
                                  (66, 5), (127, 1), (128, 2), (129, 4)])
def test_tile_and_vector_boundaries(rng, fmt, n, T):
    """Lengths around the 16-position score groups and the 64-position tiles, with the
    causal limits of T > 1 rows crossing a tile boundary (n = 66, T = 5: rows see up to
    positions 61 .. 65)."""
    cache = make_cache(rng, fmt, 2, 4, 64, n)
    q = rng.standard_normal((T, 8, 64)).astype(np.float32)
    assert rel_err(decode_attention(q, cache, 0), reference(q, cache, 0)) < TOL


@pytest.mark.parametrize("fmt", ["f16", "int8", "fp8_e4m3", "q8_0", "q8_0/q4_0", "f32/q4_0",
                                 "q4_1/f32"])
@pytest.mark.parametrize("group, T", [(1, 1), (2, 1), (3, 1), (8, 1), (3, 5), (2, 3)])
def test_group_sizes_and_row_blocks(rng, fmt, group, T):
    """R = T * G query rows per kv head go in register blocks of 4: 1, 2, 3, 8, 15, 6."""
    cache = make_cache(rng, fmt, 3, group, 64, 150)
    q = rng.standard_normal((T, 3 * group, 64)).astype(np.float32)
    assert rel_err(decode_attention(q, cache, 0), reference(q, cache, 0)) < TOL


@pytest.mark.parametrize("threads", [2, 3, 4])
@pytest.mark.parametrize("n, T, causal", [(64, 1, True), (65, 1, True), (128, 1, True),
                                          (130, 5, True), (200, 3, False), (130, 60, True),
                                          (1000, 7, True)])
def test_splits_with_few_positions(rng, threads, n, T, causal):
    """Threads split the positions (64 at least each, multiples of 16). With n = 130 and
    T = 60 the first rows see no position of the last split: its state keeps m = -inf and
    weighs 0 in the merge."""
    cache = make_cache(rng, "fp8_e5m2", 2, 4, 64, n)
    q = rng.standard_normal((T, 8, 64)).astype(np.float32)
    kvcore.set_num_threads(threads)
    try:
        out = decode_attention(q, cache, 0, causal=causal)
    finally:
        kvcore.set_num_threads(0)
    assert rel_err(out, reference(q, cache, 0, causal=causal)) < TOL


@pytest.mark.parametrize("fmt", WITH_PAIRS + ["f32/q4_1"])
@pytest.mark.parametrize("n, T, group, d", [
    (200, 200, 4, 64),    # a whole prompt (T = n): 800 rows per kv head, blocks of 256
    (150, 150, 1, 96),    # T not a multiple of the 64-position tile, one block of 150 rows
    (300, 130, 1, 64),    # chunked prefill: 170 positions before the new tokens
    (97, 33, 8, 70),      # GQA 8 (264 rows: a last block of 8), D off the vector width
    (129, 129, 3, 3),     # G = 3 (a block boundary inside a token's rows), D = 3
    (70, 1, 8, 128),      # T = 1: one decode token, 8 rows
])
@pytest.mark.parametrize("threads", [1, 2])
def test_causal_prefill(rng, fmt, n, T, group, d, threads):
    """Many query rows per kv head (prefill, verification) run as blocks of 256 rows with
    the rows in the vector lanes; the causal mask's hidden tiles are skipped. Against the
    float64 reference, causal and not; the same bits on every call."""
    if any(kvcore.FORMATS[f].block for f in sides(fmt)) and d % 32:   # q8_0, q4_*: blocks of 32
        d = 96
    cache = make_cache(rng, fmt, 2, group, d, n, layers=1)
    q = rng.standard_normal((T, 2 * group, d)).astype(np.float32)
    kvcore.set_num_threads(threads)
    try:
        for causal in (True, False):
            out, lse = decode_attention(q, cache, 0, causal=causal, return_lse=True)
            assert rel_err(out, reference(q, cache, 0, causal=causal)) < TOL
            again = decode_attention(q, cache, 0, causal=causal)
            assert out.tobytes() == again.tobytes()
            assert np.isfinite(lse).all()
    finally:
        kvcore.set_num_threads(0)


def test_causal_prefill_lse(rng):
    """A row-wise call's log-sum-exp: the float64 log of the sum of exp(scores) over each
    row's visible positions."""
    cache = make_cache(rng, "int8", 2, 4, 64, 180, layers=1)
    q = rng.standard_normal((90, 8, 64)).astype(np.float32)
    _, lse = decode_attention(q, cache, 0, return_lse=True)
    k = np.repeat(cache.dequantize(0, "k").astype(np.float64), 4, axis=1)   # [n, Hq, D]
    s = np.einsum("thd,nhd->thn", q.astype(np.float64), k) / np.sqrt(64)
    visible = np.arange(180)[None, :] <= (90 + np.arange(90))[:, None]
    s = np.where(visible[:, None, :], s, -np.inf)
    top = s.max(-1)
    want = top + np.log(np.exp(s - top[..., None]).sum(-1))
    assert np.abs(lse - want).max() < 1e-4 * np.abs(want).max()


def test_threads_agree(rng):
    """Every thread count gives the reference's result (the split states are merged in
    order, so one thread count always gives the same bits)."""
    cache = make_cache(rng, "int8", 8, 4, 128, 777)
    q = rng.standard_normal((2, 32, 128)).astype(np.float32)
    ref = reference(q, cache, 0)
    outs = []
    for threads in (1, 2, 3):
        kvcore.set_num_threads(threads)
        try:
            outs.append(decode_attention(q, cache, 0))
            np.testing.assert_array_equal(decode_attention(q, cache, 0), outs[-1])
        finally:
            kvcore.set_num_threads(0)
    assert all(rel_err(o, ref) < TOL for o in outs)


@pytest.mark.parametrize("fmt", ["f16", "bf16", "fp8_e4m3", "fp8_e5m2"])
def test_every_finite_code(rng, fmt):
    """Codes written straight into the cache: every finite FP8 code (subnormals, the
    largest, both zeros), or random f16/bf16 bit patterns with every exponent (V) and
    every exponent below 1 (K, zeros and subnormals included; larger K would give scores
    whose float32 rounding alone passes TOL). The kernel's decode (F16C, shifts) must
    agree with the cache's own (tables, scalar code)."""
    n, hkv, d = 96, 2, 64
    cache = make_cache(rng, fmt, hkv, 4, d, n)
    kc, vc, ks, vs = cache._layer_arrays(0)   # internal: raw code and scale views
    if fmt.startswith("fp8"):
        bad = {0x7F, 0xFF} if fmt == "fp8_e4m3" else set(range(0x7C, 0x80)) | set(range(0xFC, 0x100))
        finite = np.array([c for c in range(256) if c not in bad], np.uint8)
        for arr in (kc, vc):
            arr.view(np.uint8)[:n] = rng.permuted(np.resize(finite, n * hkv * d)).reshape(n, hkv, d)
        for arr in (ks, vs):
            arr[:n] = rng.uniform(0.001, 0.01, (n, hkv, 1)).astype(np.float32)
    else:
        mant_bits, bias, top = (10, 15, 30) if fmt == "f16" else (7, 127, 127 + 60)
        for arr, most in ((kc, bias - 1), (vc, top)):
            exp = rng.integers(0, most + 1, (n, hkv, d)).astype(np.uint16)
            mant = rng.integers(0, 2**mant_bits, (n, hkv, d)).astype(np.uint16)
            sign = rng.integers(0, 2, (n, hkv, d)).astype(np.uint16) << 15
            arr.view(np.uint16)[:n] = sign | (exp << mant_bits) | mant
    q = rng.standard_normal((3, 8, d)).astype(np.float32)
    out = decode_attention(q, cache, 0, scale=0.05)
    assert rel_err(out, reference(q, cache, 0, scale=0.05)) < TOL


@pytest.mark.parametrize("threads", [1, 2])
def test_long_context_split_across_threads(rng, threads):
    """One kv head and a long context: the positions are split and merged (log-sum-exp)."""
    cache = make_cache(rng, "q8_0", 1, 8, 128, 5000, layers=1)
    q = rng.standard_normal((5, 8, 128)).astype(np.float32)
    kvcore.set_num_threads(threads)
    try:
        out = decode_attention(q, cache, 0)
    finally:
        kvcore.set_num_threads(0)  # back to the default
    assert rel_err(out, reference(q, cache, 0)) < TOL


@pytest.mark.parametrize("fmt", FORMATS)
def test_scores_past_exp_overflow(rng, fmt):
    """q . k around 1e4: a softmax without the running max overflows exp. A float32 score
    of size S carries a rounding error of about S * 2^-24 (times a few for the sum over
    D) into the weights of near-tied positions: that is the bound here (the one-winner
    test below holds such scores to TOL)."""
    cache = make_cache(rng, fmt, 2, 4, 128, 300)
    q = (rng.standard_normal((2, 8, 128)) * 1000).astype(np.float32)
    out = decode_attention(q, cache, 0, scale=1.0)
    assert np.isfinite(out).all()
    k = np.repeat(cache.dequantize(0, "k").astype(np.float64), 4, axis=1)  # [n, Hq, D]
    top = np.abs(np.einsum("thd,nhd->thn", q.astype(np.float64), k)).max()
    assert top > 5000
    assert rel_err(out, reference(q, cache, 0, scale=1.0)) < TOL + 16 * 2.0**-24 * top


def test_large_scores_one_winner(rng):
    """Scores near 1e4 with one clear winner: the output is that position's V row."""
    cache = make_cache(rng, "int8", 2, 4, 128, 300)
    k = cache.dequantize(0, "k")
    q = np.stack([k[123, 0] * 80] * 4 + [k[7, 1] * 80] * 4).astype(np.float32)  # [8, 128]
    out = decode_attention(q, cache, 0, scale=1.0)
    assert rel_err(out, reference(q, cache, 0, scale=1.0)) < TOL


def test_pending_positions_and_non_causal(rng):
    cache = make_cache(rng, "int8", 4, 2, 64, 40, pending=5)
    q = rng.standard_normal((5, 8, 64)).astype(np.float32)
    for causal in (True, False):
        out = decode_attention(q, cache, 1, causal=causal, scale=0.3)
        assert rel_err(out, reference(q, cache, 1, scale=0.3, causal=causal)) < TOL


def test_out_buffer_and_strided_q(rng):
    cache = make_cache(rng, "fp8_e4m3", 2, 4, 64, 50)
    big = rng.standard_normal((3, 8, 128)).astype(np.float32)
    q = big[:, :, ::2]                                  # non-contiguous [3, 8, 64]
    out = np.empty((3, 8, 64), np.float32)
    got = decode_attention(q, cache, 0, out=out)
    assert np.shares_memory(got, out)
    assert rel_err(out, reference(q, cache, 0)) < TOL
    q2 = np.ascontiguousarray(q)
    expect = decode_attention(q2, cache, 0)
    assert decode_attention(q2, cache, 0, out=q2) is q2   # in place over q
    np.testing.assert_array_equal(q2, expect)


def test_errors(rng):
    cache = make_cache(rng, "int8", 2, 4, 64, 4)
    q = np.zeros((8, 64), np.float32)
    with pytest.raises(ShapeError, match=r"invalid shape of q: expected \[8, 64\], got \[4, 64\]"):
        decode_attention(q[:4], cache, 0)
    with pytest.raises(ShapeError, match=r"expected \[T, 8, 64\], got \[1, 8, 32\]"):
        decode_attention(np.zeros((1, 8, 32), np.float32), cache, 0)
    with pytest.raises(DTypeError, match="invalid dtype of q: expected float32, got float64"):
        decode_attention(q.astype(np.float64), cache, 0)
    bad = q.copy()
    bad[7, 63] = np.nan
    with pytest.raises(NonFiniteError, match=r"non-finite value in q at index \(7, 63\)"):
        decode_attention(bad, cache, 0)
    bad[7, 63] = 0
    bad[2, 5] = -np.inf
    with pytest.raises(NonFiniteError, match=r"non-finite value in q at index \(2, 5\)"):
        decode_attention(bad, cache, 0, out=bad)       # in place: refused before writing
    assert bad[2, 5] == -np.inf and not bad[:2].any()
    with pytest.raises(OutOfRangeError, match="layer 2 out of range: expected 0 <= layer < 2"):
        decode_attention(q, cache, 2)
    with pytest.raises(StateError, match="T=5 new tokens needs at least 5 positions, layer 0 holds 4"):
        decode_attention(np.zeros((5, 8, 64), np.float32), cache, 0)
    with pytest.raises(ShapeError, match=r"invalid shape of out: expected \[8, 64\], got \[8, 65\]"):
        decode_attention(q, cache, 0, out=np.empty((8, 65), np.float32))
    with pytest.raises(DTypeError, match="invalid type of cache: expected KVCache, got dict"):
        decode_attention(q, {}, 0)
    cache.reset()
    with pytest.raises(StateError, match="empty cache: layer 0 holds 0 positions"):
        decode_attention(q, cache, 0)


def test_demo_decode_loop(rng):
    """The demo's decode loop on a small model: the f32 row is the reference itself and
    every format's attention error stays near its storage error."""
    from kvcore import _demo
    pools = _demo.model_pools(rng, 16, 2, 8, 64)
    rows = _demo.decode_rows(list(kvcore.formats.ROW_FORMATS), pools, layers=2, prompt=40, steps=3)
    errors = {r[0]: float(r[3]) for r in rows}
    assert errors["f32"] == 0 and 0 < errors["f16"] < 1e-3 and errors["q8_0"] < 0.1
    assert all(float(r[4]) > 0 for r in rows)


@pytest.mark.parametrize("threads", [1, 2])
def test_benchmark_probes(rng, threads):
    """The two limits tools/bench_attention.py measures: stream_sum is the wrapping uint64
    sum of the words whatever the threads; fma_burn counts the multiply-adds it ran."""
    from kvcore._attention import fma_burn, stream_sum
    words = rng.integers(0, 2**64, size=1001, dtype=np.uint64)
    kvcore.set_num_threads(threads)
    try:
        assert stream_sum(words.view(np.uint8)) == int(words.sum(dtype=np.uint64))
        assert stream_sum(np.zeros(0, np.uint8)) == 0
        with pytest.raises(ValueError, match="64-bit words, got 12 bytes"):
            stream_sum(np.zeros(12, np.uint8))
        assert fma_burn(0) == 0
        assert fma_burn(5) in {5 * 12 * lanes * threads for lanes in (8, 16)}
        with pytest.raises(ValueError, match="rounds >= 0, got -1"):
            fma_burn(-1)
    finally:
        kvcore.set_num_threads(0)


@pytest.mark.parametrize("fmt", kvcore.formats.ROW_FORMATS)
@pytest.mark.parametrize("d", [128, 64])
def test_tile_blocks(rng, fmt, d):
    """tile_blocks (the kernel floor of tools/bench_attention.py) runs the kernel's own
    score and value blocks: row 0's score of position 0 is q . K row 0 and, after one
    round, row 0's weighted sum of V is the mean of value 0 over the tile (the values
    before a row scale: int8/FP8 row scales are the softmax's, e4m3's decode / 2^8)."""
    from kvcore._attention import TILE, tile_blocks
    from kvcore.attention import _INT8_SCORE_FORMATS
    f = kvcore.formats.get_format(fmt)
    x = rng.standard_normal((TILE, d), dtype=np.float32)
    codes, scales = kvcore.quantize(x, fmt)
    if f.scale_dtype is not None and not f.block:     # the row scales left out
        scales = np.ones_like(scales)
    want = kvcore.dequantize(codes, scales, fmt).astype(np.float64)
    if fmt == "fp8_e4m3":
        want /= 256
    raw = np.ascontiguousarray(codes).view(np.uint8).reshape(TILE, -1)
    sc = np.ascontiguousarray(scales, dtype=np.float32).reshape(TILE, -1) if f.block else None
    q0 = 0.01 * ((np.arange(d) * 5) % 13 - 6)            # the block's query row 0
    assert tile_blocks(f.id, raw, sc, d, 0, 3) == pytest.approx(q0 @ want[0], rel=1e-5, abs=1e-6)
    assert tile_blocks(f.id, raw, sc, d, 1, 1) == pytest.approx(
        1 / TILE + want[:, 0].mean(), rel=1e-5, abs=1e-6)   # + the weight of position 0
    int8_scores = fmt in _INT8_SCORE_FORMATS
    if int8_scores:   # the int8 scores of q^ (q quantized per block of 32): q0's within 1%
        assert tile_blocks(f.id, raw, sc, d, 0, 1, True) == pytest.approx(q0 @ want[0], rel=0.01, abs=0.01)
    for bad in (dict(fmt=9), dict(part=2), dict(rounds=-1), dict(d=2 * d + 64),
                dict(scales=np.zeros((TILE, 17), np.float32)) if f.block
                else dict(scales=np.zeros((TILE, 1), np.float32)),
                dict(int8_scores=not int8_scores) if not int8_scores else dict(fmt=-1)):
        args = dict(fmt=f.id, codes=raw, scales=sc, d=d, part=0, rounds=1, int8_scores=False) | bad
        with pytest.raises(ValueError, match="tile_blocks: bad"):
            tile_blocks(*args.values())
    with pytest.raises(ValueError, match="takes 64 rows, got 63"):
        tile_blocks(f.id, raw[:63], sc if sc is None else sc[:63], d, 0, 1)


# ---------------------------------------------------------------- variants (docs/variants.md)
# Every variant against the float64 reference of tests/_attention_reference.py, on the
# cache's own dequantized K/V.

from _attention_reference import reference_attention  # noqa: E402

SOFTCAP_TOL = 8 * 2.0**-24   # per unit of c: the capped scores' few-ulp tanh, times c


def variant_cases(rng, hq, n, T):
    """(name, kwargs) of the variants and their edges for T tokens over n positions."""
    big = rng.standard_normal(hq).astype(np.float32) * 3
    return [
        ("window 1", dict(window=1)),
        ("window >= n", dict(window=n + 5)),
        ("window mid-tile", dict(window=37)),
        ("window edge of the first token", dict(window=n - T + 1)),
        ("sinks outside the window", dict(window=40, sink_tokens=4)),
        ("sinks overlapping the window", dict(window=n - T - 10, sink_tokens=n - T - 5)),
        ("sink logits", dict(sinks=big)),
        ("a dominant sink logit", dict(sinks=np.full(hq, 25.0, np.float32))),
        ("softcap small", dict(softcap=0.3)),
        ("softcap large", dict(softcap=50.0)),
        ("everything", dict(window=45, sink_tokens=3, sinks=big, softcap=2.0)),
    ]


def check_variant(q, cache, layer, kw, threads=(1, 2), scale=None):
    """decode_attention with kw against the reference (out and lse), on each thread count;
    the same bits on each call."""
    k = cache.dequantize(layer, "k", pending=True)
    v = cache.dequantize(layer, "v", pending=True)
    ref, ref_lse = reference_attention(q, k, v, scale=scale, return_lse=True, **kw)
    tol = TOL + SOFTCAP_TOL * kw.get("softcap", 0)
    for nt in threads:
        kvcore.set_num_threads(nt)
        try:
            out, lse = decode_attention(q, cache, layer, scale=scale, return_lse=True, **kw)
            again = decode_attention(q, cache, layer, scale=scale, **kw)
        finally:
            kvcore.set_num_threads(0)
        assert out.tobytes() == again.tobytes()
        assert rel_err(out, ref) < tol, (kw, nt)
        assert np.abs(lse - ref_lse).max() < 1e-5 * max(1, np.abs(ref_lse).max()), (kw, nt)


@pytest.mark.parametrize("fmt", WITH_PAIRS)
def test_variants_every_format(rng, fmt):
    """Each variant and its edges, one token and T = 5 (rows 0..4 see windows ending at
    n - 5 .. n - 1), every format, 1 and 2 threads."""
    n = 200
    cache = make_cache(rng, fmt, 2, 4, 64, n, layers=1)
    for T in (1, 5):
        q = rng.standard_normal((T, 8, 64)).astype(np.float32)
        for _, kw in variant_cases(rng, 8, n, T):
            check_variant(q, cache, 0, kw)


@pytest.mark.parametrize("group, d", [(1, 3), (1, 70), (8, 3), (8, 70), (8, 128)])
def test_variants_gqa_and_odd_head_dims(rng, group, d):
    cache = make_cache(rng, "int8", 2, group, d, 150, layers=1)
    q = rng.standard_normal((3, 2 * group, d)).astype(np.float32)
    sinks = rng.standard_normal(2 * group).astype(np.float32)
    for kw in (dict(window=20, sink_tokens=2), dict(sinks=sinks, softcap=1.5),
               dict(window=64, sinks=sinks, softcap=20.0)):
        check_variant(q, cache, 0, kw, threads=(2,))


@pytest.mark.parametrize("fmt", ["f16", "int8", "q8_0", "q4_0"])
@pytest.mark.parametrize("T, group", [(20, 2), (60, 4), (200, 1)])
def test_variants_multi_token_across_the_window_edge(rng, fmt, T, group):
    """T tokens whose windows start T positions apart, crossing tile boundaries: split-wise
    (T x G <= 128 rows per kv head) and row-wise (more: prefill blocks of 256 rows, whose
    tiles before every row's window are skipped), 1 to 3 threads."""
    n = 330
    cache = make_cache(rng, fmt, 2, group, 64, n, layers=1)
    q = rng.standard_normal((T, 2 * group, 64)).astype(np.float32)
    for kw in (dict(window=70), dict(window=50, sink_tokens=6, softcap=5.0),
               dict(window=130, sinks=np.full(2 * group, 1.0, np.float32))):
        check_variant(q, cache, 0, kw, threads=(1, 3))


def test_window_covering_everything_is_the_plain_call(rng):
    """A window that holds every position a row sees, no sink positions, no sink logits, no
    cap: the same bits as the plain call (one and many tokens, split-wise and row-wise)."""
    cache = make_cache(rng, "bf16", 2, 4, 64, 300, layers=1)
    for T in (1, 7, 100):
        q = rng.standard_normal((T, 8, 64)).astype(np.float32)
        plain, plain_lse = decode_attention(q, cache, 0, return_lse=True)
        for kw in (dict(window=300), dict(window=10**30), dict(window=300, sink_tokens=0),
                   dict(window=None, sink_tokens=0, sinks=None, softcap=None)):
            out, lse = decode_attention(q, cache, 0, return_lse=True, **kw)
            assert out.tobytes() == plain.tobytes() and lse.tobytes() == plain_lse.tobytes()


def test_window_never_reads_the_positions_before_it(rng):
    """NaN K and V written (raw codes) into the positions no row sees, between the sink
    positions and the window: a kernel that read them (even masked: weight 0 x NaN) would
    give NaN and refuse the call. n = 5000: the window's 300 positions, and 4 sinks."""
    n, W, S, T = 5000, 300, 4, 3
    cache = make_cache(rng, "f32", 2, 4, 64, n, layers=1)
    k, v = cache.dequantize(0, "k"), cache.dequantize(0, "v")
    kc, vc, _, _ = cache._layer_arrays(0)
    kc[S:n - T - W + 1] = np.nan
    vc[S:n - T - W + 1] = np.nan
    q = rng.standard_normal((T, 8, 64)).astype(np.float32)
    for nt in (1, 2):
        kvcore.set_num_threads(nt)
        try:
            out = decode_attention(q, cache, 0, window=W, sink_tokens=S)
        finally:
            kvcore.set_num_threads(0)
        want = reference_attention(q, k, v, scale=None, window=W, sink_tokens=S)
        assert rel_err(out, want) < TOL


def test_dominant_sink_logit(rng):
    """A sink logit far above every score takes all the weight: out is 0 (every weight
    exp(s - sink) underflows) and lse the sink; one a little above: out small, still within
    rounding of the reference."""
    cache = make_cache(rng, "fp8_e4m3", 2, 4, 64, 100, layers=1)
    q = rng.standard_normal((2, 8, 64)).astype(np.float32)
    sinks = np.full(8, 3e4, np.float32)
    out, lse = decode_attention(q, cache, 0, sinks=sinks, return_lse=True)
    assert not out.any() and (lse == sinks).all()
    check_variant(q, cache, 0, dict(sinks=np.linspace(8, 12, 8).astype(np.float32)))


def test_softcap_of_large_scores(rng):
    """Scores near 1e4 capped at c = 30: the capped scores lie in [-30, 30], so the call is
    as accurate as for small scores (the raw scores' float32 error is flattened by tanh)."""
    cache = make_cache(rng, "int8", 2, 4, 128, 300, layers=1)
    q = (rng.standard_normal((2, 8, 128)) * 1000).astype(np.float32)
    check_variant(q, cache, 0, dict(softcap=30.0), scale=1.0)


def test_softcap_values():
    """The kernels' c * tanh(x / c) (kvcore._attention.softcap_values) over every 251st
    float32 in [2^-30, 16) (times c) and its negatives, against float64: within 6 ulp
    (Eigen's rational approximation: 1.3e-7 relative in exact arithmetic, 4.9 ulp measured
    over every 3rd float32); tanh(+-inf) and NaN give NaN (a score past float32 refuses the
    call, capped or not)."""
    from kvcore._attention import softcap_values
    lo, hi = np.float32(2.0**-30).view(np.uint32), np.float32(16).view(np.uint32)
    x = np.arange(lo, hi, 251, dtype=np.uint32).view(np.float32)
    for c in (1.0, 0.125, 50.0):
        xc = (x * np.float32(c)).astype(np.float32)
        out = np.empty_like(xc)
        softcap_values(xc, c, out)
        want = c * np.tanh(xc.astype(np.float64) / c)
        ulp = np.spacing(np.abs(want).astype(np.float32)).astype(np.float64)
        assert (np.abs(out - want) / ulp).max() < 6, c
        neg = np.empty_like(xc)
        softcap_values(-xc, c, neg)
        assert (neg == -out).all()
    special = np.array([np.inf, -np.inf, np.nan, 0.0, -0.0, 16.0, 3e38, -3e38], np.float32)
    out = np.empty_like(special)
    softcap_values(special, 2.0, out)
    assert np.isnan(out[:3]).all() and not out[3:5].any()
    assert (out[5:7] == 2.0).all() and out[7] == -2.0   # saturated: c itself


def test_sinks_in_other_float_dtypes(rng):
    """float16 (and bfloat16, with ml_dtypes) sink logits are converted exactly: the same
    bits as their float32 values; an array of another library goes through DLPack."""
    cache = make_cache(rng, "f16", 2, 4, 64, 50, layers=1)
    q = rng.standard_normal((8, 64)).astype(np.float32)
    s16 = rng.standard_normal(8).astype(np.float16)
    want = decode_attention(q, cache, 0, sinks=s16.astype(np.float32))
    assert decode_attention(q, cache, 0, sinks=s16).tobytes() == want.tobytes()
    assert decode_attention(q, cache, 0, sinks=s16.astype(np.float32)[::-1][::-1]
                            ).tobytes() == want.tobytes()
    ml_dtypes = pytest.importorskip("ml_dtypes")
    sb = s16.astype(ml_dtypes.bfloat16)
    assert decode_attention(q, cache, 0, sinks=sb).tobytes() == \
        decode_attention(q, cache, 0, sinks=sb.astype(np.float32)).tobytes()


@pytest.mark.parametrize("kw, error, match", [
    (dict(window=0), RangeError, "window must be an int >= 1"),
    (dict(window=-3), RangeError, "window must be an int >= 1"),
    (dict(window=4.0), DTypeError, r"invalid type of window: expected int, got float"),
    (dict(window=True), DTypeError, "invalid type of window: expected int, got bool"),
    (dict(window=8, causal=False), RangeError, "a window needs causal=True"),
    (dict(window=8, sink_tokens=-1), RangeError, "sink_tokens must be an int >= 0"),
    (dict(sink_tokens=2), RangeError, "sink_tokens=2 needs a window"),
    (dict(window=8, sink_tokens=1.0), DTypeError, "invalid type of sink_tokens"),
    (dict(softcap=0.0), RangeError, "softcap must be a finite float32 > 0"),
    (dict(softcap=-1), RangeError, "softcap must be a finite float32 > 0"),
    (dict(softcap=float("inf")), RangeError, "softcap must be a finite float32 > 0"),
    (dict(softcap=float("nan")), RangeError, "softcap must be a finite float32 > 0"),
    (dict(softcap=1e39), RangeError, "softcap must be a finite float32 > 0"),
    (dict(softcap=1e-50), RangeError, "softcap must be a finite float32 > 0"),
    (dict(softcap=10**400), RangeError, "softcap must be a finite float32 > 0"),
    (dict(softcap="5"), DTypeError, "invalid type of softcap: expected float, got str"),
    (dict(softcap=True), DTypeError, "invalid type of softcap: expected float, got bool"),
    (dict(sinks=np.zeros(4, np.float32)), ShapeError,
     r"invalid shape of sinks: expected \[8\], got \[4\]"),
    (dict(sinks=np.zeros((1, 8), np.float32)), ShapeError, "invalid shape of sinks"),
    (dict(sinks=np.zeros(8)), DTypeError, "invalid dtype of sinks: expected float32"),
    (dict(sinks=np.zeros(8, np.int32)), DTypeError, "invalid dtype of sinks"),
    (dict(sinks=[0.0] * 8), DTypeError, "invalid type of sinks"),
    (dict(sinks=np.array([0, 0, 0, np.inf, 0, 0, 0, 0], np.float32)), NonFiniteError,
     r"non-finite value in sinks: sinks\[3\] = inf"),
    (dict(sinks=np.full(8, np.nan, np.float16)), NonFiniteError, "non-finite value in sinks"),
])
def test_variants_refused_with_out_untouched(rng, kw, error, match):
    cache = make_cache(rng, "int8", 2, 4, 64, 20, layers=1)
    q = rng.standard_normal((2, 8, 64)).astype(np.float32)
    out = np.full_like(q, 7.0)
    with pytest.raises(error, match=match):
        decode_attention(q, cache, 0, out=out, **kw)
    assert (out == 7.0).all()


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1"])
@pytest.mark.parametrize("T, group", [(1, 4), (5, 4), (200, 4)])
def test_q4_kernel_reads_the_values_dequantize_gives(rng, fmt, T, group):
    """The kernel decodes 4-bit codes (nibbles in ggml's order, (q - 8) d and q d + m) to
    exactly kvcore.dequantize's values: the same bits as the f32 kernel over a cache that
    holds those values, decode, split-wise and row-wise (T x G = 800 rows), with variants."""
    cache = make_cache(rng, fmt, 2, group, 128, 300, layers=1)
    f32 = KVCache(cache.spec.replace(format="f32"))
    f32.append(0, cache.dequantize(0, "k"), cache.dequantize(0, "v"))
    f32.advance()
    q = rng.standard_normal((T, 2 * group, 128)).astype(np.float32)
    sinks = rng.standard_normal(2 * group).astype(np.float32)
    for kw in ({}, dict(window=70, sink_tokens=3), dict(sinks=sinks, softcap=20.0)):
        for threads in (1, 2):
            kvcore.set_num_threads(threads)
            try:
                got = decode_attention(q, cache, 0, **kw)
                want = decode_attention(q, f32, 0, **kw)
            finally:
                kvcore.set_num_threads(0)
            assert got.tobytes() == want.tobytes(), (kw, threads)
