"""GPU decode attention and RoPE (kvcore.gpu.attention).

CPU-only: the planning rules and the split / log-sum-exp algorithm of the kernels,
emulated in numpy. `gpu`: every format, head_dim 64/128/256 and the run-time-D instance
(16, 80, 96, 112, 160, 192), GQA 1/4/8, lengths 1, 33, 4095, 4096, 4097 and 65536 with one
empty slot in the batch, q that overflows a naive exp, forced split counts, a grid that
does not follow the capacity; out and lse against a float64 reference on the dequantized
cache values. (The paged storage of the same kernel: tests/test_gpu_pool.py.)
RoPE against float64 numpy at position 100000.
"""
import math

import numpy as np
import pytest

from kvcore import KVSpec, get_format
from kvcore.errors import DTypeError, FormatError, ShapeError, StateError
from kvcore.gpu.attention import (MAX_SPLITS, MIN_SPLIT_POSITIONS, choose_splits, heads_per_block,
                                  tile_positions)
from kvcore.gpu.cache import GPU_FORMATS as FORMATS
from kvcore.snapshot import Snapshot

# Every head_dim kernel (64, 128, 256) with every group (1, 4, 8) for one format per code
# size and scale layout (f32: 4 bytes, f16: 2, int8: 1 with a row scale, q8_0: 1 with block
# scales), which is what sets a kernel's tiling; the formats that share one of those
# layouts (bf16, the FP8 pair) differ only in the word decoder, so each takes a Latin
# square (every head_dim once, every group once; the three together cover every pair).
MATRIX = [(f, d, g) for f in ("f32", "f16", "int8", "q8_0") for d in (64, 128, 256) for g in (1, 4, 8)]
MATRIX += [("bf16", 64, 1), ("bf16", 128, 8), ("bf16", 256, 4),
           ("fp8_e4m3", 64, 4), ("fp8_e4m3", 128, 1), ("fp8_e4m3", 256, 8),
           ("fp8_e5m2", 64, 8), ("fp8_e5m2", 128, 4), ("fp8_e5m2", 256, 1)]
# the 4-bit formats at a subset of head_dim x GQA: both thread layouts (16 dims from 8 code
# bytes at 1-2 heads a block, 8 from 4 bytes at 4-8) and q in shared memory (8 heads, D <= 128)
MATRIX += [("q4_0", 64, 1), ("q4_0", 128, 8), ("q4_0", 256, 4), ("q4_1", 64, 8), ("q4_1", 128, 4),
           ("q4_1", 256, 1)]
assert {f for f, _, _ in MATRIX} == set(FORMATS)   # every GPU format somewhere


# ----------------------------------------------------------------------------- helpers

def random_parts(spec, n, rng):
    """Valid random codes and scales of n positions: (k_codes, v_codes, k_scales, v_scales)
    token-major [L, n, Hkv, W] / [L, n, Hkv, S] (W = D, or D/2 for the 4-bit formats), each
    side in its own format."""

    def codes(f):
        shape = (spec.num_layers, n, spec.num_kv_heads, f.code_width(spec.head_dim))
        if f.name == "f32":
            return rng.standard_normal(shape, dtype=np.float32)
        if f.name == "f16":
            return rng.standard_normal(shape).astype(np.float16)
        if f.name == "bf16":
            return (rng.standard_normal(shape, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)
        if f.name in ("int8", "q8_0"):
            return rng.integers(-127, 128, shape, dtype=np.int8)
        c = rng.integers(0, 256, shape, dtype=np.uint8)
        if f.pack == 2:                          # two 4-bit codes a byte: all valid
            return c
        if f.name == "fp8_e4m3":
            c[(c & 0x7F) == 0x7F] ^= 1          # NaN -> 448 (0x7E)
        else:
            c[(c & 0x7F) >= 0x7C] &= 0xBF       # inf/NaN -> exponent 15
        return c

    def scales(f):
        if not f.quantized:
            return None
        s_shape = (spec.num_layers, n, spec.num_kv_heads, f.scales_per_row(spec.head_dim))
        top = {"int8": 2.0 / 127, "q8_0": 2.0 / 127, "fp8_e4m3": 2.0 / 448, "fp8_e5m2": 2.0 / 57344,
               "q4_0": 2.0 / 8, "q4_1": 4.0 / 15}[f.name]
        s = rng.uniform(0.25 * top, top, s_shape)
        if f.name == "q4_0":        # d = max / -8 takes either sign
            s *= rng.choice([-1.0, 1.0], s_shape)
        elif f.name == "q4_1":      # (d, m): m = the block's minimum, in [-2, 0)
            s[..., 1::2] = rng.uniform(-2.0, 0.0, s[..., 1::2].shape)
        return s.astype(f.scale_dtype)

    return codes(spec.k_fmt), codes(spec.v_fmt), scales(spec.k_fmt), scales(spec.v_fmt)


def dequantize(codes, scales, fmt):
    """float64 values of stored codes (exact decode, times the scale)."""
    import ml_dtypes
    f = get_format(fmt)
    if f.name == "bf16":
        return (codes.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    if f.name == "fp8_e4m3":
        x = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    elif f.name == "fp8_e5m2":
        x = codes.view(ml_dtypes.float8_e5m2).astype(np.float64)
    else:
        x = codes.astype(np.float64)
    if scales is None:
        return x
    s = scales.astype(np.float64)
    if f.pack == 2:   # 4-bit: byte j of a block holds value j (low nibble) and 16 + j (high)
        nb = x.shape[-1] // 16
        b = codes.reshape(*codes.shape[:-1], nb, 16)
        x = np.concatenate([b & 15, b >> 4], axis=-1).astype(np.float64)
        if f.name == "q4_0":
            return ((x - 8) * s[..., None]).reshape(*codes.shape[:-1], 32 * nb)
        d = s[..., 0::2, None].astype(np.float32)
        return (x.astype(np.float32) * d + s[..., 1::2, None].astype(np.float32)).astype(
            np.float64).reshape(*codes.shape[:-1], 32 * nb)   # float32 q * d + m, as stored
    if f.name == "q8_0":
        # explicit block count: a -1 cannot be inferred for an empty slot (size 0)
        return (x.reshape(*x.shape[:-1], x.shape[-1] // 32, 32) * s[..., None]).reshape(x.shape)
    return x * s


def reference(q, k, v, scale):
    """float64 attention of one slot: q [Hq, D], k, v [n, Hkv, D] -> [Hq, D] (zeros if n = 0)."""
    hq, d = q.shape
    n, hkv, _ = k.shape
    out = np.zeros((hq, d))
    if n == 0:
        return out
    g = hq // hkv
    for h in range(hq):
        s = k[:, h // g, :] @ q[h] * scale
        p = np.exp(s - s.max())
        out[h] = p @ v[:, h // g, :] / p.sum()
    return out


def reference_lse(q, k, scale):
    """float64 natural log-sum-exp of the scaled scores of q [Hq, D] over k [n, Hkv, D]."""
    g = q.shape[0] // k.shape[1]
    s = np.einsum("hd,nhd->hn", q, np.repeat(k, g, axis=1)) * scale
    top = s.max(axis=1)
    return top + np.log(np.exp(s - top[:, None]).sum(axis=1))


def float32_attention(q, k, v, scale):
    """The same in plain float32 numpy (the same-precision peer for the error bound)."""
    q, k, v = (np.asarray(a, np.float32) for a in (q, k, v))
    hq = q.shape[0]
    g = hq // k.shape[1]
    out = np.zeros(q.shape, np.float32)
    for h in range(hq):
        s = (k[:, h // g, :] @ q[h]) * np.float32(scale)
        p = np.exp(s - s.max())
        out[h] = (p @ v[:, h // g, :]) / p.sum()
    return out


def rel_err(out, ref):
    """max over query heads of ||out - ref|| / ||ref||."""
    num = np.linalg.norm(out - ref, axis=-1)
    den = np.maximum(np.linalg.norm(ref, axis=-1), 1e-30)
    return float((num / den).max())


# ----------------------------------------------------------------------------- CPU only

def test_heads_per_block():
    assert [heads_per_block(g) for g in (1, 2, 3, 4, 6, 8, 12, 16)] == [1, 2, 1, 4, 2, 8, 4, 8]


def test_tile_positions():
    assert tile_positions(get_format("int8"), 128) == 32
    assert tile_positions(get_format("f16"), 128) == 16
    assert tile_positions(get_format("f32"), 256) == 4
    # 4-bit: 2 KiB of codes, as many positions as q8_0's tiles
    assert [tile_positions(get_format("q4_1"), d) for d in (64, 128, 256)] == [64, 32, 16]


@pytest.mark.parametrize("blocks", [1, 8, 64, 256, 1024, 4096])
@pytest.mark.parametrize("max_length", [None, 1, 100, 4096, 65536])
def test_choose_splits_fills_the_gpu_without_tiny_splits(blocks, max_length):
    resident = 528  # 132 SMs x 4 blocks
    s = choose_splits(blocks, resident, max_length)
    cap = MAX_SPLITS if max_length is None else max(1, -(-max_length // MIN_SPLIT_POSITIONS))
    assert 1 <= s <= cap
    if blocks >= resident:
        assert s == 1  # already a full wave or more
    if blocks * s < 0.9 * resident:  # only when the splits ran out
        assert s == min(MAX_SPLITS, cap)


def test_choose_splits_from_the_device_and_batch():
    # batch 1, 8 kv heads: 60 splits make 480 of 528 blocks busy (a 4096-position slot
    # keeps 32 of them busy, chunks of 128; a 100-position slot one)
    assert choose_splits(8, 528) == 60
    assert choose_splits(8, 528, 4096) == 32
    # batch 32 x 8 heads = 256 blocks: 2 splits make one full wave (3 would spill into a second)
    assert choose_splits(256, 528) == 2


@pytest.mark.parametrize("n", [1, 31, 32, 33, 4095, 4097])
@pytest.mark.parametrize("nsplit", [1, 3, 8, 64])
def test_split_and_merge_algorithm(n, nsplit, rng):
    """The kernels' algorithm in numpy: chunk = max(ceil(n / nsplit), MIN_SPLIT_POSITIONS)
    rounded up to the tile, base-2 online softmax per tile, lse = m + log2(l), then the
    merge over the non-empty splits; equals softmax, and the merged lse (times ln 2) the
    natural log-sum-exp."""
    T, D = 32, 16
    s = rng.standard_normal(n) * 30 * math.log2(math.e)  # scores in base 2, large
    v = rng.standard_normal((n, D))
    chunk = -(-max(-(-n // nsplit), MIN_SPLIT_POSITIONS) // T) * T
    os_, lses = [], []
    for sp in range(nsplit):
        a, b = sp * chunk, min(n, sp * chunk + chunk)
        if a >= b:
            os_.append(np.zeros(D))
            lses.append(-np.inf)
            continue
        m, l, acc = -np.inf, 0.0, np.zeros(D)
        for t0 in range(a, b, T):
            st = s[t0:min(b, t0 + T)]
            m_new = max(m, st.max())
            alpha = 2.0 ** (m - m_new)
            p = 2.0 ** (st - m_new)
            l = l * alpha + p.sum()
            acc = acc * alpha + p @ v[t0:t0 + len(st)]
            m = m_new
        os_.append(acc / l)
        lses.append(m + math.log2(l))
    lses = np.array(lses)
    w = 2.0 ** (lses - lses.max())
    out = (w[:, None] * np.array(os_)).sum(0) / w.sum()
    p = np.exp2(s - s.max())
    np.testing.assert_allclose(out, p @ v / p.sum(), rtol=1e-12, atol=1e-12)
    lse = (lses.max() + math.log2(w.sum())) * math.log(2)
    assert lse == pytest.approx(np.log(np.exp(s * math.log(2) - s.max() * math.log(2)).sum())
                                + s.max() * math.log(2), rel=1e-12)


# ----------------------------------------------------------------------------- device

def _device_array(arr):
    from kvcore.gpu import DeviceBuffer
    return DeviceBuffer.from_numpy(arr).view(arr.shape, arr.dtype)


def _q_dtype(name):
    if name == "bfloat16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def _run_case(fmt, head_dim, group, lengths, q_dtype, rng, *, q_gain=1.0, num_splits=None,
              hkv=2):
    from kvcore.gpu import GpuKVCache
    from kvcore.gpu.attention import AttentionPlan
    spec = KVSpec(num_layers=1, num_kv_heads=hkv, head_dim=head_dim, capacity=max(max(lengths), 1),
                  num_heads=hkv * group, format=fmt)
    M = len(lengths)
    cache = GpuKVCache(spec, slots=M)
    try:
        kvs = []
        for m, n in enumerate(lengths):
            parts = random_parts(spec, n, rng)
            cache.scatter(Snapshot(spec, n, *parts), m)
            kvs.append((dequantize(parts[0], parts[2], spec.k_fmt)[0], dequantize(parts[1], parts[3], spec.v_fmt)[0]))
        qh = (rng.standard_normal((M, spec.num_heads, head_dim)) * q_gain).astype(_q_dtype(q_dtype))
        q = _device_array(qh)
        out = _device_array(np.full((M, spec.num_heads, head_dim), np.nan, np.float32))  # poisoned
        lse = _device_array(np.full((M, spec.num_heads), np.nan, np.float32))
        plan = AttentionPlan(cache, q_dtype=q_dtype, num_splits=num_splits)
        plan.run(q, out, 0, lse=lse)
        cache.check()
        got, got_lse = out.to_numpy(), lse.to_numpy()
        plan.free()
    finally:
        cache.free()
    assert np.isfinite(got).all(), "unwritten or non-finite output"
    q64 = qh.astype(np.float64)
    scale = 1.0 / math.sqrt(head_dim)
    results = []
    for m, (k, v) in enumerate(kvs):
        ref = reference(q64[m], k, v, scale)
        if lengths[m] == 0:
            assert (got[m] == 0).all(), "an empty slot must give zeros"
            assert (got_lse[m] == -np.inf).all()
            continue
        ref_lse = reference_lse(q64[m], k, scale)
        assert (np.abs(got_lse[m] - ref_lse) <= 2e-5 * (1 + np.abs(ref_lse))).all(), f"lse of slot {m}"
        results.append((m, got[m], ref, q64[m], k, v))
    return results, scale


LENGTHS = [1, 33, 0, 4095, 4096, 4097]


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,head_dim,group", MATRIX)
def test_attention_matches_float64(fmt, head_dim, group, rng):
    q_dtype = ("float32", "float16", "bfloat16")[(head_dim // 64 + group) % 3]
    tol = 1e-5 if q_dtype == "float32" else 1e-3
    results, _ = _run_case(fmt, head_dim, group, LENGTHS, q_dtype, rng)
    for m, got, ref, *_ in results:
        assert rel_err(got, ref) < tol, f"slot {m} (length {LENGTHS[m]})"


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,head_dim,group", [("q8_0/q4_0", 128, 8), ("q8_0/q4_0", 96, 2),
                                                ("f16/q4_0", 64, 1), ("f16/q4_0", 256, 4)])
def test_pair_attention_matches_float64(fmt, head_dim, group, rng):
    """K and V in two formats (GPU_PAIRS): the scores decode K's codes, the weighted sums
    V's, each by its own format, in one kernel (a thread's dims: the smaller count of both
    sides, at most 8; rows of two sizes); against float64 over each side's dequantized values."""
    results, _ = _run_case(fmt, head_dim, group, [300, 0, 1, 33], "float32", rng, num_splits=3)
    for m, got, ref, *_ in results:
        assert rel_err(got, ref) < 1e-5, f"slot {m}"


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["f32", "bf16", "int8", "q8_0"])
def test_attention_long_context(fmt, rng):
    """65536 positions: the splits and their merge are every format's; one float format of
    each width and the row- and block-scaled 8-bit ones (each format's decode: above)."""
    results, _ = _run_case(fmt, 128, 4, [65536, 0, 7], "float32", rng)
    for m, got, ref, *_ in results:
        assert rel_err(got, ref) < 1e-5, f"slot {m}"


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["f32", "int8", "fp8_e5m2"])
def test_attention_large_scores_do_not_overflow(fmt, rng):
    # scores in the thousands: exp(score) overflows float32 without the running max
    results, scale = _run_case(fmt, 128, 4, [4097, 300], "float32", rng, q_gain=300.0)
    for m, got, ref, q, k, v in results:
        peer = float32_attention(q, k, v, scale)
        assert rel_err(got, ref) <= 2 * rel_err(peer, ref) + 1e-6, f"slot {m}"


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 2, 7, 64])
def test_forced_split_counts(num_splits, rng):
    results, _ = _run_case("int8", 128, 4, [4097, 1, 0, 130], "float32", rng, num_splits=num_splits)
    for m, got, ref, *_ in results:
        assert rel_err(got, ref) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,head_dim,group", [
    ("f16", 80, 1), ("q8_0", 96, 8), ("int8", 112, 4), ("f32", 160, 2), ("fp8_e5m2", 192, 8),
    ("bf16", 16, 1), ("fp8_e4m3", 96, 1), ("q4_0", 96, 2), ("q4_1", 32, 4), ("q4_1", 224, 8)])
def test_attention_any_head_dim(fmt, head_dim, group, rng):
    """The run-time-D instance (every multiple of 16 up to 256 besides 64/128/256): q8_0 and
    q4_0 at D = 96 have rows of 3 f16 scales (not 4-byte aligned), f32 at 160 a row group
    count that is not a power of two, q4_1 at 32 one block a row; lengths across tiles and
    splits."""
    results, _ = _run_case(fmt, head_dim, group, [300, 0, 1, 33], "float32", rng, num_splits=3)
    for m, got, ref, *_ in results:
        assert rel_err(got, ref) < 1e-5, f"slot {m}"


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["q4_0", "q4_1"])
def test_4bit_decode_every_code_and_scale(fmt):
    """The kernel's 4-bit decode, exhaustively: the output of a one-position slot is its V
    row as the kernel decodes it (weight 1), here every code in every nibble of each block
    with every finite f16 scale (q4_0: d of either sign; q4_1: m, each with a d >= 0, every
    one of those too); it equals kvcore.dequantize value for value (zeros of either sign)."""
    import kvcore
    from kvcore.gpu import GpuKVCache
    from kvcore.gpu.attention import AttentionPlan
    h = np.arange(65536).astype(np.uint16)
    finite = h[(h & 0x7C00) != 0x7C00]                       # 63488 f16 values
    H = finite.size // 8                                      # rows of 8 blocks (D = 256)
    if fmt == "q4_0":
        scales = finite.reshape(H, 8)
    else:
        d = np.resize(finite[finite < 0x8000], finite.size)   # every d >= 0, repeated
        scales = np.stack([d, finite], axis=-1).reshape(H, 16)
    j = np.arange(16)
    codes = np.tile((j | (15 - j) << 4).astype(np.uint8), (H, 8))   # codes 0..15 and 15..0
    spec = KVSpec(num_layers=1, num_kv_heads=H, head_dim=256, capacity=1, num_heads=H, format=fmt)
    zeros = np.zeros((1, 1) + scales.shape, np.float16)
    snap = Snapshot(spec, 1, np.zeros((1, 1, H, 128), np.uint8), codes[None, None], zeros,
                    scales.view(np.float16)[None, None])
    cache = GpuKVCache(spec, slots=1)
    try:
        cache.restore(snap, 0)
        q = _device_array(np.zeros((1, H, 256), np.float32))
        out = _device_array(np.full((1, H, 256), np.nan, np.float32))
        plan = AttentionPlan(cache, q_dtype="float32")
        plan.run(q, out, 0)
        cache.check()
        got = out.to_numpy()[0]
        plan.free()
    finally:
        cache.free()
    assert np.array_equal(got, kvcore.dequantize(codes, scales.view(np.float16), fmt))


@pytest.mark.gpu
def test_grid_follows_the_device_not_the_capacity(rng, monkeypatch):
    """A 100-position decode in a 100000-capacity cache launches the grids that a
    128-capacity cache does (splits from the SMs and the batch; each block's positions
    from the slot's length on the device), with the same result, bit for bit."""
    from kvcore.gpu import GpuKVCache, driver
    from kvcore.gpu.attention import AttentionPlan
    launched = []
    real_launch = driver.launch

    def spy(fn, grid, *args, **kw):
        launched.append(grid)
        return real_launch(fn, grid, *args, **kw)

    monkeypatch.setattr(driver, "launch", spy)
    small = KVSpec(num_layers=1, num_kv_heads=2, head_dim=128, capacity=128, num_heads=8, format="int8")
    parts = random_parts(small, 100, rng)
    q = _device_array(rng.standard_normal((1, 8, 128)).astype(np.float32))
    runs = []
    for capacity in (128, 100_000):
        spec = small.replace(capacity=capacity)
        cache = GpuKVCache(spec, slots=1)
        cache.scatter(Snapshot(spec, 100, *parts), 0)
        out = _device_array(np.zeros((1, 8, 128), np.float32))
        plan = AttentionPlan(cache, q_dtype="float32")
        del launched[:]
        plan.run(q, out, 0)
        cache.check()
        runs.append((list(launched), out.to_numpy()))
        plan.free()
        cache.free()
    (grids_small, out_small), (grids_large, out_large) = runs
    assert grids_small == grids_large and grids_small[0][0] > 1   # split kernel and merge
    assert out_small.tobytes() == out_large.tobytes()
    ref = reference(q.to_numpy()[0].astype(np.float64), dequantize(parts[0], parts[2], "int8")[0],
                    dequantize(parts[1], parts[3], "int8")[0], 1 / math.sqrt(128))
    assert rel_err(out_large[0], ref) < 1e-5


@pytest.mark.gpu
def test_plan_validation(rng):
    from kvcore.gpu import GpuKVCache
    from kvcore.gpu.attention import AttentionPlan
    spec = KVSpec(num_layers=2, num_kv_heads=2, head_dim=64, capacity=64, num_heads=8, format="int8")
    cache = GpuKVCache(spec, slots=3)
    plan = AttentionPlan(cache, q_dtype="float32")
    q = _device_array(np.zeros((3, 8, 64), np.float32))
    out = _device_array(np.zeros((3, 8, 64), np.float32))
    with pytest.raises(ShapeError, match=r"invalid shape of q: expected \[3, 8, 64\], got \[3, 4, 64\]"):
        plan.run(_device_array(np.zeros((3, 4, 64), np.float32)), out, 0)
    with pytest.raises(DTypeError, match="invalid dtype of q: expected float32"):
        plan.run(_device_array(np.zeros((3, 8, 64), np.float16)), out, 0)
    with pytest.raises(DTypeError, match="invalid dtype of out: expected float32"):
        plan.run(q, _device_array(np.zeros((3, 8, 64), np.float16)), 0)
    with pytest.raises(IndexError, match="layer 2 out of range"):
        plan.run(q, out, 2)
    plan.free()
    with pytest.raises(StateError, match="make a new plan"):
        plan.run(q, out, 0)
    cache.free()
    cache = GpuKVCache(spec.replace(head_dim=40, format="f16"), slots=1)
    with pytest.raises(FormatError, match="head_dim a multiple of 16 from 16 to 256, got 40"):
        AttentionPlan(cache)
    cache.free()


@pytest.mark.gpu
def test_decode_attention_one_off(rng):
    from kvcore.gpu import GpuKVCache
    from kvcore.gpu.attention import decode_attention
    spec = KVSpec(num_layers=1, num_kv_heads=2, head_dim=128, capacity=300, num_heads=8, format="fp8_e4m3")
    cache = GpuKVCache(spec, slots=2)
    parts = random_parts(spec, 300, rng)
    cache.scatter(Snapshot(spec, 300, *parts), 1)
    qh = rng.standard_normal((2, 8, 128)).astype(np.float16)
    got = decode_attention(_device_array(qh), cache, 0).to_numpy()
    ref = reference(qh[1].astype(np.float64), dequantize(parts[0], parts[2], "fp8_e4m3")[0],
                    dequantize(parts[1], parts[3], "fp8_e4m3")[0], 1 / math.sqrt(128))
    assert (got[0] == 0).all()
    assert rel_err(got[1], ref) < 1e-3
    cache.free()


def _one_filled_slot(fmt, group, rng, n=157):
    """(spec, parts, GpuKVCache of 2 slots, KVCache): slot 1 and the KVCache hold the same n
    random positions, slot 0 is empty; Hkv 2, D 64, group query heads per kv head."""
    import kvcore
    from kvcore.gpu import GpuKVCache
    spec = KVSpec(num_layers=1, num_kv_heads=2, head_dim=64, capacity=200, num_heads=2 * group, format=fmt)
    parts = random_parts(spec, n, rng)
    cache = GpuKVCache(spec, slots=2)
    cache.scatter(Snapshot(spec, n, *parts), 1)
    cpu = kvcore.KVCache(spec)
    cpu.restore(Snapshot(spec, n, *parts))
    return spec, parts, cache, cpu


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["int8", "q8_0"])
@pytest.mark.parametrize("group", [1, 8])
def test_decode_attention_one_off_lse(fmt, group, rng):
    """return_lse gives (out, lse) as the CPU decode_attention does: lse [M, Hq] the
    natural log-sum-exp of each row's scaled scores, -inf for an empty slot."""
    import kvcore
    from kvcore.gpu.attention import decode_attention
    spec, parts, cache, cpu = _one_filled_slot(fmt, group, rng)
    q = rng.standard_normal((2, 2 * group, 64)).astype(np.float32)
    out, lse = decode_attention(_device_array(q), cache, 0, return_lse=True)
    out, lse = out.to_numpy(), lse.to_numpy()
    assert lse.shape == (2, 2 * group) and lse.dtype == np.float32
    assert (out[0] == 0).all() and np.isneginf(lse[0]).all()
    k = dequantize(parts[0], parts[2], fmt)[0]
    v = dequantize(parts[1], parts[3], fmt)[0]
    assert rel_err(out[1], reference(q[1].astype(np.float64), k, v, 1 / 8)) < 1e-5
    want = reference_lse(q[1].astype(np.float64), k, 1 / 8)
    assert np.abs(lse[1] - want).max() < 1e-5 * np.abs(want).max()
    cpu_out, cpu_lse = kvcore.decode_attention(q[1], cpu, 0, return_lse=True)
    assert np.abs(out[1] - cpu_out).max() < 2e-5 * np.abs(cpu_out).max()
    assert np.abs(lse[1] - cpu_lse).max() < 2e-6 * np.abs(cpu_lse).max()
    cache.free()


# ----------------------------------------------------------------------------- RoPE

def rope_reference(x, positions, theta, neox, rotary_dim):
    """float64 RoPE of x [M, H, D] (copied), slot m at positions[m]."""
    x = x.astype(np.float64).copy()
    half = rotary_dim // 2
    i = np.arange(half)
    ang = positions[:, None].astype(np.float64) * theta ** (-2.0 * i / rotary_dim)  # [M, half]
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    a = i if neox else 2 * i
    b = i + half if neox else 2 * i + 1
    x0, x1 = x[..., a].copy(), x[..., b].copy()
    x[..., a] = x0 * c - x1 * s
    x[..., b] = x0 * s + x1 * c
    return x


@pytest.mark.gpu
@pytest.mark.parametrize("style", ["neox", "norm"])
@pytest.mark.parametrize("dtype,rotary_dim", [("float32", 128), ("float16", 64), ("bfloat16", 96)])
def test_rope_at_large_positions(style, dtype, rotary_dim, rng):
    from kvcore.gpu import GpuKVCache
    from kvcore.gpu.attention import apply_rope
    spec = KVSpec(num_layers=1, num_kv_heads=2, head_dim=128, capacity=100100, num_heads=8, format="int8")
    cache = GpuKVCache(spec, slots=3)
    for m, n in enumerate((0, 5, 33)):
        cache.scatter(Snapshot(spec, n, *random_parts(spec, n, rng)), m)
    dt = _q_dtype(dtype)
    qh = rng.standard_normal((3, 8, 128)).astype(dt)
    kh = rng.standard_normal((3, 2, 128)).astype(dt)
    q, k = _device_array(qh), _device_array(kh)
    apply_rope(q, cache, k=k, style=style, rotary_dim=rotary_dim, offset=100000, theta=10000.0)
    cache.check()
    pos = np.array([100000, 100005, 100033])
    for x, xh in ((q, qh), (k, kh)):
        got = x.to_numpy().astype(np.float64)
        ref = rope_reference(xh, pos, 10000.0, style == "neox", rotary_dim)
        ulp = {"float32": 2.0 ** -23, "float16": 2.0 ** -10, "bfloat16": 2.0 ** -7}[dtype]
        # within one rounding of the output (relative to the row's size) plus float32 math
        err = np.abs(got - ref).max(axis=-1) / np.abs(ref).max(axis=-1)
        assert err.max() < ulp + 4e-7, err.max()
        np.testing.assert_array_equal(got[..., rotary_dim:], xh[..., rotary_dim:].astype(np.float64))
    cache.free()


@pytest.mark.gpu
def test_rope_validation():
    from kvcore.gpu import GpuKVCache
    from kvcore.gpu.attention import apply_rope
    spec = KVSpec(num_layers=1, num_kv_heads=2, head_dim=64, capacity=16, num_heads=4, format="f16")
    cache = GpuKVCache(spec, slots=2)
    q = _device_array(np.zeros((2, 4, 64), np.float32))
    with pytest.raises(ShapeError, match="invalid rotary_dim"):
        apply_rope(q, cache, rotary_dim=63)
    with pytest.raises(ShapeError, match="invalid style"):
        apply_rope(q, cache, style="gptj")
    with pytest.raises(ShapeError, match=r"invalid shape of k: expected \[2, 2, 64\]"):
        apply_rope(q, cache, k=q)
    cache.free()


@pytest.mark.parametrize("fmt", FORMATS)
def test_reference_helpers_agree_with_cpu_decode_attention(fmt, rng):
    """The random codes are ones the cache accepts, and dequantize + reference (what the
    GPU is checked against) agree with the CPU kvcore.decode_attention on them."""
    import kvcore
    spec = KVSpec(num_layers=1, num_kv_heads=2, head_dim=64, capacity=300, num_heads=8, format=fmt)
    parts = random_parts(spec, 300, rng)
    cpu = kvcore.KVCache(spec)
    cpu.restore(Snapshot(spec, 300, *parts))
    q = rng.standard_normal((8, 64)).astype(np.float32)
    ref = reference(q.astype(np.float64), dequantize(parts[0], parts[2], fmt)[0],
                    dequantize(parts[1], parts[3], fmt)[0], 1 / 8)
    assert rel_err(kvcore.decode_attention(q, cpu, 0).astype(np.float64), ref) < 1e-5


# ----------------------------------------------------------------------------- variants

def test_variants_checked_and_splits_bound():
    """check_variants is the CPU decode_attention's check (one rule, one message) and
    holds W and S to int32; a window bounds the splits at the W + S positions a query
    sees (with max_length, the smaller)."""
    from kvcore.errors import NonFiniteError, RangeError
    from kvcore.gpu.attention import check_variants, splits_bound
    spec = KVSpec(num_layers=1, num_kv_heads=2, head_dim=64, capacity=64, num_heads=8, format="int8")
    v = check_variants(spec, window=2**40, sink_tokens=np.int64(3), softcap=30,
                       sinks=np.zeros(8, np.float16))
    assert (v.window, v.sink_tokens, v.softcap) == (2**31 - 1, 3, 30.0)
    assert v.sinks.dtype == np.float32 and v.visible == 2**31 - 1
    assert check_variants(spec).visible is None and not check_variants(spec).any
    assert splits_bound(None, check_variants(spec, window=100, sink_tokens=4)) == 104
    assert splits_bound(50, check_variants(spec, window=100)) == 50
    assert splits_bound(None, check_variants(spec)) is None
    with pytest.raises(DTypeError, match="invalid type of window"):
        check_variants(spec, window=2.0)
    with pytest.raises(RangeError, match="window must be an int >= 1"):
        check_variants(spec, window=0)
    with pytest.raises(RangeError, match="needs causal"):
        check_variants(spec, window=4, causal=False)
    with pytest.raises(RangeError, match="needs a window"):
        check_variants(spec, sink_tokens=2)
    with pytest.raises(RangeError, match="softcap"):
        check_variants(spec, softcap=-1.0)
    with pytest.raises(RangeError, match="softcap"):
        check_variants(spec, softcap=3e38)   # finite float32, but c log2(e) is not
    with pytest.raises(ShapeError, match=r"sinks"):
        check_variants(spec, sinks=np.zeros(4, np.float32))
    with pytest.raises(DTypeError, match="sinks"):
        check_variants(spec, sinks=np.zeros(8, np.int32))
    with pytest.raises(NonFiniteError, match="sinks"):
        check_variants(spec, sinks=np.full(8, np.nan, np.float32))


def _variants_case(fmt, head_dim, group, lengths, rng, *, num_splits=None, q_gain=1.0, hkv=2,
                   **variants):
    """Runs an AttentionPlan with the variants over slots of `lengths` (the query of slot m
    at its last position) and checks out and lse against the float64 reference on the
    dequantized cache; returns (plan's num_splits, out, lse, slot parts) for more checks."""
    from kvcore.gpu import GpuKVCache
    from kvcore.gpu.attention import AttentionPlan
    from _attention_reference import reference_attention
    spec = KVSpec(num_layers=1, num_kv_heads=hkv, head_dim=head_dim, capacity=max(lengths),
                  num_heads=hkv * group, format=fmt)
    M = len(lengths)
    cache = GpuKVCache(spec, slots=M)
    try:
        parts = []
        for m, n in enumerate(lengths):
            parts.append(random_parts(spec, n, rng))
            cache.scatter(Snapshot(spec, n, *parts[-1]), m)
        qh = (rng.standard_normal((M, spec.num_heads, head_dim)) * q_gain).astype(np.float32)
        out = _device_array(np.full((M, spec.num_heads, head_dim), np.nan, np.float32))
        lse = _device_array(np.full((M, spec.num_heads), np.nan, np.float32))
        plan = AttentionPlan(cache, q_dtype="float32", num_splits=num_splits, **variants)
        try:
            plan.run(_device_array(qh), out, 0, lse=lse)
            cache.check()
            got, got_lse, nsplit = out.to_numpy(), lse.to_numpy(), plan.num_splits
        finally:
            plan.free()
    finally:
        cache.free()
    scale = 1 / math.sqrt(head_dim)
    for m, n in enumerate(lengths):
        k = dequantize(parts[m][0], parts[m][2], fmt)[0]
        v = dequantize(parts[m][1], parts[m][3], fmt)[0]
        ref, ref_lse = reference_attention(qh[m], k, v, scale=scale, return_lse=True, **variants)
        if n == 0:
            assert (got[m] == 0).all()
        else:
            assert rel_err(got[m], ref) < 1e-5, f"slot {m} (length {n})"
        finite = np.isfinite(ref_lse)
        assert (np.isneginf(got_lse[m]) == ~finite).all(), f"lse of slot {m}"
        assert (np.abs(got_lse[m][finite] - ref_lse[finite])
                <= 2e-5 * (1 + np.abs(ref_lse[finite]))).all(), f"lse of slot {m}"
    return nsplit, got, got_lse, parts


VARIANT_LENGTHS = [0, 1, 9, 70, 300]


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_variants_every_format(fmt, rng):
    """Every format with every variant (window, sink positions, sink logits, soft-capping),
    GQA 1 and 8 and a run-time head_dim in turn: a window of 200 over several splits (two of
    them holding positions, the sink logits in split 0 only), and a window of 40 that cuts
    tiles mid-way, in one split (its splits follow W + S, not the lengths); an empty slot
    gets out 0 and lse = its sink."""
    i = FORMATS.index(fmt)
    group = (1, 8)[i % 2]
    head_dim = (96, 64, 128)[i % 3] if get_format(fmt).block else (64, 80, 128)[i % 3]
    Hq = 2 * group
    sinks = rng.uniform(-1, 3, Hq).astype(np.float32)
    nsplit, *_ = _variants_case(fmt, head_dim, group, VARIANT_LENGTHS, rng, num_splits=3,
                                window=200, sink_tokens=3, sinks=sinks, softcap=4.0, q_gain=3.0)
    assert nsplit == 3
    nsplit, *_ = _variants_case(fmt, head_dim, group, VARIANT_LENGTHS, rng, window=40,
                                sink_tokens=5, sinks=sinks, softcap=4.0, q_gain=3.0)
    assert nsplit == 1   # 45 positions at most: one split, whatever the lengths


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,group,variants", [
    ("int8", 8, dict(window=33)),
    ("f16", 1, dict(window=100, sink_tokens=64)),           # sinks across a whole tile
    ("bf16", 8, dict(sinks="random")),                       # sink logits alone, every split
    ("fp8_e5m2", 1, dict(softcap=2.5)),                      # soft-capping alone
])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_each_variant_alone(fmt, group, variants, num_splits, rng):
    if variants.get("sinks") == "random":
        variants = dict(sinks=rng.normal(0, 3, 2 * group).astype(np.float32))
    _variants_case(fmt, 64, group, VARIANT_LENGTHS, rng, num_splits=num_splits, q_gain=2.0, **variants)


@pytest.mark.gpu
def test_window_covering_everything_is_the_plain_call_bit_for_bit(rng):
    """A window no shorter than any length (its sink positions inside it) reads what the
    plain call reads in the same order: the same bits, split or not."""
    for num_splits in (1, 3):
        a = _variants_case("q8_0", 64, 4, VARIANT_LENGTHS, np.random.default_rng(5), num_splits=num_splits)
        b = _variants_case("q8_0", 64, 4, VARIANT_LENGTHS, np.random.default_rng(5), num_splits=num_splits,
                           window=300, sink_tokens=7)
        assert a[1].tobytes() == b[1].tobytes() and a[2].tobytes() == b[2].tobytes()


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,group", [("int8", 1), ("q8_0", 8)])
def test_variants_one_off_equal_cpu_decode_attention(fmt, group, rng):
    """decode_attention(..., window, sink_tokens, sinks, softcap, return_lse=True) equals
    the CPU decode_attention with the same variants within float32 rounding; device sinks
    (a DeviceArray) give the same bits as host sinks."""
    import kvcore
    from kvcore.gpu.attention import decode_attention
    spec, parts, cache, cpu = _one_filled_slot(fmt, group, rng)
    q = (rng.standard_normal((2, 2 * group, 64)) * 3).astype(np.float32)
    sinks = rng.uniform(-2, 6, 2 * group).astype(np.float32)
    variants = dict(window=50, sink_tokens=4, softcap=3.0)
    out, lse = decode_attention(_device_array(q), cache, 0, return_lse=True, sinks=sinks, **variants)
    dsinks = _device_array(sinks)
    out2, lse2 = decode_attention(_device_array(q), cache, 0, return_lse=True, sinks=dsinks, **variants)
    out, lse, out2, lse2 = (x.to_numpy() for x in (out, lse, out2, lse2))
    assert out.tobytes() == out2.tobytes() and lse.tobytes() == lse2.tobytes()
    assert (out[0] == 0).all() and np.array_equal(lse[0], sinks)   # an empty slot: its sinks
    cpu_out, cpu_lse = kvcore.decode_attention(q[1], cpu, 0, return_lse=True, sinks=sinks, **variants)
    assert np.abs(out[1] - cpu_out).max() < 2e-5 * np.abs(cpu_out).max()
    assert np.abs(lse[1] - cpu_lse).max() < 2e-6 * np.abs(cpu_lse).max()
    cache.free()


@pytest.mark.gpu
def test_bad_variants_refused_before_anything(rng, monkeypatch):
    """Bad variants are refused by AttentionPlan, decode_attention and DecodeGraph with
    nothing launched and nothing allocated."""
    from kvcore.errors import NonFiniteError, RangeError
    from kvcore.gpu import GpuKVCache, driver, live_bytes
    from kvcore.gpu.attention import AttentionPlan, decode_attention
    from kvcore.gpu.graph import DecodeGraph
    spec = KVSpec(num_layers=1, num_kv_heads=2, head_dim=64, capacity=32, num_heads=4, format="int8")
    cache = GpuKVCache(spec, slots=2)
    q = _device_array(np.zeros((2, 4, 64), np.float32))
    launched = []
    monkeypatch.setattr(driver, "launch", lambda *a, **k: launched.append(a))
    bad = [(dict(window=0), RangeError), (dict(window=1.5), DTypeError),
           (dict(sink_tokens=-1, window=4), RangeError), (dict(sink_tokens=2), RangeError),
           (dict(softcap=0.0), RangeError), (dict(softcap=float("nan")), RangeError),
           (dict(sinks=np.zeros(3, np.float32)), ShapeError),
           (dict(sinks=np.array([0, 1, np.inf, 0], np.float32)), NonFiniteError),
           (dict(sinks=_device_array(np.zeros(4, np.float16))), DTypeError),
           (dict(sinks=_device_array(np.zeros(2, np.float32))), ShapeError)]
    before = live_bytes()   # the device sinks above included
    for kw, err in bad:
        with pytest.raises(err):
            AttentionPlan(cache, q_dtype="float32", **kw)
        with pytest.raises(err):
            decode_attention(q, cache, 0, **kw)
        with pytest.raises(err):
            DecodeGraph(cache, dtype="float32", **kw)
    assert launched == [] and live_bytes() == before
    monkeypatch.undo()
    cache.free()
