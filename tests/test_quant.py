"""kvcore.quantize / dequantize: bit-exact against independent references.

FP8, f16 and bf16 against ml_dtypes / numpy conversions; int8 and q8_0 against plain
numpy implementations of the documented rules (q8_0 mirrors ggml's
quantize_row_q8_0_ref line by line); q4_0 and q4_1 against gguf-py's own numpy
quantizers (tests/_ggml.py), byte for byte in ggml's block layout.
"""
import re

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import kvcore
from kvcore import _quant
from kvcore.errors import DTypeError, FormatError, NonFiniteError, ShapeError
from kvcore._quant import input_limit
from kvcore.quant import Q4_0_LIMIT, Q4_1_LIMIT, Q8_0_LIMIT

from _ggml import gguf_decode, gguf_encode, gguf_rows, to_ggml

FP8 = {"fp8_e4m3": (ml_dtypes.float8_e4m3fn, 448.0), "fp8_e5m2": (ml_dtypes.float8_e5m2, 57344.0)}
Q4 = ("q4_0", "q4_1")
QUANT8 = ("int8", "fp8_e4m3", "fp8_e5m2", "q8_0")
QUANT = QUANT8 + Q4
F32 = np.float32


# ---------------------------------------------------------------------------------
# References

def fp8_codes(v, name):
    """OCP FP8 codes (uint8) of float32 v: ml_dtypes' RNE conversion, saturated."""
    dtype, fmax = FP8[name]
    return np.clip(v, -fmax, fmax).astype(dtype).view(np.uint8)


def encode_fp8_raw(v, name):
    return _quant._encode_fp8_raw(np.ascontiguousarray(v, dtype=F32), kvcore.FORMATS[name].id)


def ref_quantize(x, name):
    """The documented rule in numpy float32 (q4_0 / q4_1: gguf-py); x float32 [..., D]."""
    if name in Q4:
        return gguf_encode(x, name)
    amax = np.abs(x).max(axis=-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        if name == "int8":
            scale = amax / F32(127)
            q = np.clip(np.rint(x / scale), -127, 127)
            return np.where(scale == 0, 0, q).astype(np.int8), scale
        if name in FP8:
            scale = amax / F32(FP8[name][1])
            return np.where(scale == 0, 0, fp8_codes(x / scale, name)).astype(np.uint8), scale
        # q8_0: ggml quantize_row_q8_0_ref
        blocks = x.reshape(x.shape[:-1] + (x.shape[-1] // 32, 32))
        d = np.abs(blocks).max(axis=-1, keepdims=True) / F32(127)
        inv = np.where(d != 0, F32(1) / d, F32(0))
        v = blocks * inv
        q = np.trunc(v.astype(np.float64) + np.copysign(0.5, v))   # roundf
        # where 1/d overflows (max|x| < ~3.7e-37) ggml's cast is undefined; kvcore saturates
        q = np.where(np.isinf(inv), np.sign(blocks) * 127, q)
        return q.astype(np.int8).reshape(x.shape), d[..., 0].astype(np.float16)


def ref_dequantize(codes, scales, name):
    if name in Q4:
        return gguf_decode(codes, scales, name)
    with np.errstate(over="ignore"):     # 127 * scale may round past float32 max
        if name == "int8":
            return codes.astype(F32) * scales
        if name in FP8:
            return codes.view(np.uint8).view(FP8[name][0]).astype(F32) * scales
    d = scales.astype(F32)[..., None]
    q = codes.astype(F32).reshape(codes.shape[:-1] + (codes.shape[-1] // 32, 32))
    return (q * d).reshape(codes.shape)


def raw(a):
    """Bytes of an array as an unsigned integer array (for bit comparisons)."""
    return np.ascontiguousarray(a).view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def assert_quantized_exact(x, name):
    codes, scales = kvcore.quantize(x, name)
    ref_codes, ref_scales = ref_quantize(np.asarray(x, dtype=F32), name)
    assert codes.shape == x.shape[:-1] + (kvcore.FORMATS[name].code_width(x.shape[-1]),)
    assert scales.shape == x.shape[:-1] + (kvcore.FORMATS[name].scales_per_row(x.shape[-1]),)
    np.testing.assert_array_equal(raw(codes), raw(ref_codes))
    np.testing.assert_array_equal(raw(scales), raw(ref_scales))
    np.testing.assert_array_equal(raw(kvcore.dequantize(codes, scales, name)),
                                  raw(ref_dequantize(codes, scales, name)))
    return codes, scales


def random_finite_f32(rng, n):
    """n float32 values whose bit patterns are uniform over all finite patterns
    (so every binade, subnormals included, appears in proportion)."""
    bits = rng.integers(0, 2**32, size=n, dtype=np.uint64).astype(np.uint32)
    bits = bits[(bits & 0x7F800000) != 0x7F800000]
    return bits.view(F32)


# ---------------------------------------------------------------------------------
# FP8 scalar encoders and decoders against ml_dtypes

@pytest.mark.parametrize("name", FP8)
def test_fp8_decode_every_code(name):
    codes = np.arange(256, dtype=np.uint8)
    out = kvcore.dequantize(codes, np.ones(1, F32), name)
    ref = codes.view(FP8[name][0]).astype(F32)
    nan = np.isnan(ref)
    np.testing.assert_array_equal(np.isnan(out), nan)
    np.testing.assert_array_equal(raw(out)[~nan], raw(ref)[~nan])


@pytest.mark.parametrize("name", FP8)
def test_fp8_encode_every_float16(name):
    v = np.arange(2**16, dtype=np.uint16).view(np.float16).astype(F32)
    v = v[np.isfinite(v)]
    np.testing.assert_array_equal(encode_fp8_raw(v, name), fp8_codes(v, name))


@pytest.mark.parametrize("name", FP8)
def test_fp8_encode_random_float32(name, rng):
    v = random_finite_f32(rng, 10_000_000)
    assert (np.abs(v) < np.finfo(F32).tiny).sum() > 1000     # subnormals are in the draw
    np.testing.assert_array_equal(encode_fp8_raw(v, name), fp8_codes(v, name))


@pytest.mark.parametrize("name", FP8)
def test_fp8_ties_go_to_even(name):
    dtype, fmax = FP8[name]
    values = np.arange(256, dtype=np.uint8).view(dtype).astype(np.float64)
    pos = np.unique(values[np.isfinite(values) & (values >= 0)])       # ascending, 0 .. max
    mid = ((pos[:-1] + pos[1:]) / 2).astype(F32)                     # exact in float32
    mid = np.concatenate([mid, -mid])
    got = encode_fp8_raw(mid, name)
    np.testing.assert_array_equal(got, fp8_codes(mid, name))
    assert not (got & 1).any()                                       # even mantissa wins
    near = np.concatenate([np.nextafter(mid, F32(np.inf)), np.nextafter(mid, F32(-np.inf))])
    np.testing.assert_array_equal(encode_fp8_raw(near, name), fp8_codes(near, name))


@pytest.mark.parametrize("name", FP8)
def test_fp8_saturates_above_largest_finite(name):
    dtype, fmax = FP8[name]
    max_code = int(np.array(fmax, F32).astype(dtype).view(np.uint8))
    big = np.array([fmax, np.nextafter(F32(fmax), F32(np.inf)), fmax * 1.0625, fmax * 1.07,
                    fmax * 2, 1e30, np.finfo(F32).max], dtype=F32)
    np.testing.assert_array_equal(encode_fp8_raw(big, name), max_code)
    np.testing.assert_array_equal(encode_fp8_raw(-big, name), max_code | 0x80)
    assert np.isnan(encode_fp8_raw(np.array([np.nan], F32), name).view(dtype).astype(F32)).all()


# ---------------------------------------------------------------------------------
# f16 / bf16 conversions

def _values_and_ties(dtype):
    """Every finite value of a 16-bit float type as float32, and the midpoints between
    adjacent magnitudes (ties, exact in float32)."""
    halves = np.arange(2**16, dtype=np.uint16).view(dtype).astype(F32)
    halves = halves[np.isfinite(halves)]
    pos = np.unique(np.abs(halves).astype(np.float64))
    return halves, ((pos[:-1] + pos[1:]) / 2).astype(F32)


@pytest.mark.parametrize("name,dtype", [("f16", np.float16), ("bf16", ml_dtypes.bfloat16)])
def test_half_formats_exact(name, dtype, rng):
    v = random_finite_f32(rng, 2_000_000)
    halves, mid = _values_and_ties(dtype)
    limit = input_limit(kvcore.FORMATS[name].id)  # past it the value would round to infinity
    for x in (v, halves, mid, -mid, np.nextafter(mid, F32(0))):
        x = x[np.abs(x) < limit]
        codes, scales = kvcore.quantize(x, name)
        assert scales is None
        np.testing.assert_array_equal(raw(codes), raw(x.astype(dtype)))
    every = np.arange(2**16, dtype=np.uint16).view(dtype)
    out = kvcore.dequantize(every, None, name)
    ref = every.astype(F32)
    nan = np.isnan(ref)
    np.testing.assert_array_equal(np.isnan(out), nan)
    np.testing.assert_array_equal(raw(out)[~nan], raw(ref)[~nan])


def test_scalar_f16_conversions(rng):
    # the path of CPUs without F16C, checked wherever the tests run
    halves, mid = _values_and_ties(np.float16)
    x = np.concatenate([random_finite_f32(rng, 1_000_000), halves, mid, -mid])
    x = x[np.abs(x) < 65520]
    every = np.arange(2**16, dtype=np.uint16)
    every = every[np.isfinite(every.view(np.float16))]
    bits, floats = _quant._f16_scalar(x, every)
    np.testing.assert_array_equal(bits, x.astype(np.float16).view(np.uint16))
    np.testing.assert_array_equal(raw(floats), raw(every.view(np.float16).astype(F32)))


def test_f32_is_a_copy(rng):
    x = rng.standard_normal((5, 3, 64)).astype(F32)
    codes, scales = kvcore.quantize(x, "f32")
    assert scales is None and not np.shares_memory(codes, x)
    np.testing.assert_array_equal(codes, x)
    np.testing.assert_array_equal(kvcore.dequantize(codes, None, "f32"), x)


# ---------------------------------------------------------------------------------
# Quantized formats against the numpy references

@pytest.mark.parametrize("name", QUANT)
@pytest.mark.parametrize("d", [32, 64, 128, 256, 1056])   # 1056: 33 blocks (decode_row converts
def test_exact_gaussian_and_heavy_tailed(name, d, rng):     # a row's scales 32 blocks at a time)
    assert_quantized_exact(rng.standard_normal((97, 3, d)).astype(F32), name)
    assert_quantized_exact(rng.standard_t(3, size=(33, d)).astype(F32), name)


@pytest.mark.parametrize("name", QUANT)
def test_exact_over_wide_magnitudes(name, rng):
    x = random_finite_f32(rng, 64 * 128)[: 63 * 128].reshape(63, 128)
    if name in ("q8_0",) + Q4:
        limit = input_limit(kvcore.FORMATS[name].id)
        x = np.clip(x, -limit / 2, limit / 2)
    x *= rng.choice(np.array([1.0, 1e-30, 1e-38, 1e-44], F32), size=(63, 1))  # tiny rows
    assert_quantized_exact(x, name)


@pytest.mark.parametrize("name", QUANT)
def test_exact_on_rounding_ties(name, rng):
    # rows whose scaled values land exactly on .5: int8 ties go to even, q8_0 away from 0
    x = (np.arange(-127, 128, dtype=F32) / 2)[: 32 * 7].reshape(7, 32)
    x[:, 0] = 127.0                                 # scale (d) = 1 exactly
    codes, _ = assert_quantized_exact(x, name)
    if name == "int8":
        assert codes[0, 2] == -62                  # -62.5 -> -62 (even)
    if name == "q8_0":
        assert codes[0, 2] == -63                  # -62.5 -> -63 (away from zero)


@pytest.mark.parametrize("name", QUANT)
def test_zero_rows_and_float32_max(name):
    x = np.zeros((4, 64), F32)
    x[1, 5] = np.finfo(F32).max
    x[2] = -np.finfo(F32).max
    x[3, ::3] = 1e-3
    limit = F32(input_limit(kvcore.FORMATS[name].id))   # q8_0: Q8_0_LIMIT; int8: float32 max
    if np.isfinite(limit):
        below = np.nextafter(limit, F32(0))
        x[1:3] = np.clip(x[1:3], -below, below)
    codes, scales = assert_quantized_exact(x, name)
    assert not raw(scales[0]).any() or name == "q4_0"     # q4_0: d = 0 / -8 = -0.0
    assert (scales[0].astype(F32) == 0).all()
    assert (raw(codes[0]) == (0x88 if name == "q4_0" else 0)).all()   # q4_0: q = 8 is zero
    assert np.isfinite(scales.astype(F32)).all()        # max|x| / 127 does not overflow
    assert np.isfinite(kvcore.dequantize(codes, scales, name)).all()   # nor 127 * scale


@pytest.mark.parametrize("name", QUANT)
def test_leading_shapes(name, rng):
    for shape in [(32,), (1, 32), (1, 1, 64), (0, 64), (2, 0, 3, 32), (3, 1, 2, 1, 32)]:
        x = rng.standard_normal(shape).astype(F32)
        assert_quantized_exact(x, name)


@pytest.mark.parametrize("name", QUANT + ("f16", "bf16"))
def test_any_strides(name, rng):
    base = rng.standard_normal((6, 5, 4, 256)).astype(F32)
    ref_codes, ref_scales = kvcore.quantize(np.ascontiguousarray(base[::-2, :, 1:3, ::2]), name)
    for x in (base[::-2, :, 1:3, ::2], base[::-2, :, 1:3, ::2].copy(order="F"),
              np.broadcast_to(base[0, 0, 0, ::2], (3, 128))):
        codes, scales = kvcore.quantize(x, name)
        want = ref_codes if x.shape == ref_codes.shape else kvcore.quantize(x.copy(), name)[0]
        np.testing.assert_array_equal(raw(codes), raw(want))
        assert codes.flags.c_contiguous
    # non-contiguous codes and scales decode the same
    full = kvcore.dequantize(ref_codes, ref_scales, name)
    np.testing.assert_array_equal(
        kvcore.dequantize(ref_codes[:, ::2], None if ref_scales is None else ref_scales[:, ::2],
                          name), full[:, ::2])


@pytest.mark.parametrize("name", QUANT)
@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
def test_half_inputs(name, dtype, rng):
    x = rng.standard_normal((9, 2, 64)).astype(dtype)
    codes, scales = kvcore.quantize(x, name)
    ref_codes, ref_scales = kvcore.quantize(x.astype(F32), name)
    np.testing.assert_array_equal(raw(codes), raw(ref_codes))
    np.testing.assert_array_equal(raw(scales), raw(ref_scales))
    np.testing.assert_array_equal(raw(kvcore.quantize(x[:, :, ::2], name)[0]),
                                  raw(kvcore.quantize(x[:, :, ::2].astype(F32), name)[0]))


def _dequantize_threads(codes, scales, name, n):
    """dequantize on 1 thread, to compare with n threads'."""
    kvcore.set_num_threads(1)
    try:
        return kvcore.dequantize(codes, scales, name)
    finally:
        kvcore.set_num_threads(n)


@pytest.mark.parametrize("name", QUANT)
def test_threads_agree(name, rng):
    # 601 rows of 128: past _parallel.PARALLEL_MIN_VALUES, so 2 threads share the rows
    x = rng.standard_normal((601, 128)).astype(F32)
    results = []
    for n in (1, 2, 0):
        kvcore.set_num_threads(n)
        results.append(kvcore.quantize(x, name))
        codes, scales = results[-1]
        np.testing.assert_array_equal(kvcore.dequantize(codes, scales, name),
                                      _dequantize_threads(codes, scales, name, n))
    for codes, scales in results[1:]:
        np.testing.assert_array_equal(raw(codes), raw(results[0][0]))
        np.testing.assert_array_equal(raw(scales), raw(results[0][1]))


@pytest.mark.parametrize("name", list(kvcore.FORMATS))
def test_out_arrays(name, rng):
    f = kvcore.FORMATS[name]
    rows = f.group or 3      # q4_1ch: groups of 32 positions
    x = rng.standard_normal((5, rows, 64)).astype(F32)[:, ::-1]    # strided input
    want_codes, want_scales = kvcore.quantize(x, name)
    for code_dtype in dict.fromkeys([f.code_dtype, want_codes.dtype]):
        codes = np.zeros(want_codes.shape, code_dtype)     # [5, rows, W], W = code_width(64)
        scales = np.zeros(want_scales.shape, want_scales.dtype) if f.quantized else None
        got = kvcore.quantize(x, name, out=(codes, scales))
        assert got[0] is codes and got[1] is scales
        np.testing.assert_array_equal(raw(codes), raw(want_codes))
        if f.quantized:
            np.testing.assert_array_equal(raw(scales), raw(want_scales))
    out = np.full((5, rows, 64), np.nan, F32)
    assert kvcore.dequantize(want_codes, want_scales, name, out=out) is out
    np.testing.assert_array_equal(out, kvcore.dequantize(want_codes, want_scales, name))


@pytest.mark.parametrize("name, bad", [("int8", np.nan), ("f16", 70000.0), ("q8_0", -1e7),
                                       ("q4_0", 6e5), ("q4_1", -70000.0)])
def test_refused_quantize_leaves_out_untouched(name, bad, rng):
    # rows before and after the refused one are valid: nothing is written anyway
    x = rng.standard_normal((300, 64)).astype(F32)
    x[150, 3] = bad
    codes, scales = kvcore.quantize(np.zeros((300, 64), F32), name)
    before = (codes.tobytes(), None if scales is None else scales.tobytes())
    with pytest.raises((NonFiniteError, FormatError), match=r"x\[150, 3\]"):
        kvcore.quantize(x, name, out=(codes, scales))
    assert (codes.tobytes(), None if scales is None else scales.tobytes()) == before


def test_bad_out_arrays(rng):
    x = rng.standard_normal((4, 32)).astype(F32)
    codes, scales = kvcore.quantize(x, "q8_0")
    with pytest.raises(DTypeError, match=r"invalid type of out: expected a \(codes, scales\) tuple"):
        kvcore.quantize(x, "q8_0", out=[codes, scales])
    with pytest.raises(ShapeError, match=r"invalid shape of out codes: expected \[4, 32\], got \[4, 16\]"):
        kvcore.quantize(x, "q8_0", out=(codes[:, :16], scales))
    with pytest.raises(DTypeError, match=r"invalid dtype of out scales: expected float16, got float32"):
        kvcore.quantize(x, "q8_0", out=(codes, scales.astype(F32)))
    with pytest.raises(ShapeError, match=r"out codes must be a writable C-contiguous array"):
        kvcore.quantize(x, "q8_0", out=(np.zeros((32, 4), np.int8).T, scales))
    frozen = codes.copy()
    frozen.flags.writeable = False
    with pytest.raises(ShapeError, match=r"out codes must be a writable"):
        kvcore.quantize(x, "q8_0", out=(frozen, scales))
    with pytest.raises(FormatError, match=r"format f16 has no scales: expected out scales None"):
        kvcore.quantize(x, "f16", out=(x.astype(np.float16), scales))
    with pytest.raises(ShapeError, match=r"out overlaps x"):
        kvcore.quantize(x, "f32", out=(x, None))
    with pytest.raises(ShapeError, match=r"invalid shape of out: expected \[4, 32\], got \[4, 31\]"):
        kvcore.dequantize(codes, scales, "q8_0", out=np.zeros((4, 31), F32))
    with pytest.raises(DTypeError, match=r"invalid dtype of out: expected float32, got float64"):
        kvcore.dequantize(codes, scales, "q8_0", out=np.zeros((4, 32)))
    with pytest.raises(ShapeError, match=r"out overlaps codes or scales"):
        kvcore.dequantize(x, None, "f32", out=x)


def test_codes_view_dtypes():
    x = np.ones((2, 32), F32)
    assert kvcore.quantize(x, "fp8_e4m3")[0].dtype == ml_dtypes.float8_e4m3fn
    assert kvcore.quantize(x, "fp8_e5m2")[0].dtype == ml_dtypes.float8_e5m2
    assert kvcore.quantize(x, "bf16")[0].dtype == ml_dtypes.bfloat16
    assert kvcore.quantize(x, "int8")[1].dtype == np.float32
    assert kvcore.quantize(x, "q8_0")[1].dtype == np.float16
    codes, scales = kvcore.quantize(x, "fp8_e4m3")
    np.testing.assert_array_equal(kvcore.dequantize(codes.view(np.uint8), scales, "fp8_e4m3"),
                                  kvcore.dequantize(codes, scales, "fp8_e4m3"))


# ---------------------------------------------------------------------------------
# Round-trip error bounds (property tests)

rows = hnp.arrays(F32, st.tuples(st.integers(1, 4), st.sampled_from([32, 64, 96])),
                  elements=st.floats(-1e6, 1e6, width=32))


def _q4_bound(x, scales, name):
    """q4_0 / q4_1 round trip error bound: a full step of the exact d (q4_0 clips the
    value opposite max: trunc(8 + 8.5) = 16 -> 15), plus 8 (q4_0) or 15 (q4_1) times the
    error of d's float16 rounding, plus that of q4_1's float16 min."""
    x64 = x.astype(np.float64)
    blocks = x64.reshape(x.shape[0], -1, 32)
    s = scales.astype(np.float64).reshape(x.shape[0], -1, 1 if name == "q4_0" else 2)
    if name == "q4_0":
        amax = np.abs(blocks).max(-1)
        d = amax / 8
        bound = d * (1 + 1e-5) + 8 * np.abs(d - np.abs(s[..., 0]))
    else:
        lo, hi = blocks.min(-1), blocks.max(-1)
        d = (hi - lo) / 15
        bound = d * (0.5 + 1e-5) + 15 * np.abs(d - s[..., 0]) + np.abs(lo - s[..., 1])
    return np.repeat(bound, 32, axis=-1) * (1 + 1e-6)


@settings(max_examples=60, deadline=None)
@given(x=rows, name=st.sampled_from(QUANT))
def test_round_trip_error_bound(x, name):
    if name in Q4:
        x = x / F32(20)                                 # below q4_1's 65520 limit
    codes, scales = kvcore.quantize(x, name)
    y = kvcore.dequantize(codes, scales, name)
    err = np.abs(y.astype(np.float64) - x)
    amax = np.abs(x.astype(np.float64)).max(axis=-1, keepdims=True)
    if name == "int8":
        bound = amax / 127 * (0.5 + 1e-5)                   # half a step
    elif name in Q4:
        bound = _q4_bound(x, scales, name)
    elif name == "q8_0":
        # half a step of the exact d, plus 127 times the error of d's float16 rounding
        d = np.abs(x.astype(np.float64)).reshape(x.shape[0], -1, 32).max(-1) / 127
        bound = np.repeat(d * (0.5 + 1e-5) + 127 * np.abs(d - scales.astype(np.float64)),
                          32, axis=-1)
    else:
        man = {"fp8_e4m3": 3, "fp8_e5m2": 2}[name]
        scale = scales.astype(np.float64)
        sub = np.ldexp(1.0, {"fp8_e4m3": -9, "fp8_e5m2": -16}[name]) * scale
        bound = np.maximum(np.abs(x) * 2.0**-(man + 1), sub / 2) * (1 + 1e-5)
    assert (err <= bound + 1e-30).all()


@settings(max_examples=40, deadline=None)
@given(x=rows, name=st.sampled_from(QUANT8))
def test_requantize_is_stable(x, name):
    # decoding and encoding again gives the same codes (idempotent on its own output)
    codes, scales = kvcore.quantize(x, name)
    again, _ = kvcore.quantize(kvcore.dequantize(codes, scales, name), name)
    if name != "q8_0":
        np.testing.assert_array_equal(raw(again), raw(codes))
    else:   # the fp16 scale moves the grid: near-idempotent where that scale is normal
        normal = np.repeat(scales.astype(F32) >= np.finfo(np.float16).tiny, 32, axis=-1)
        assert (np.abs(again.astype(int) - codes.astype(int))[normal] <= 1).all()


# ---------------------------------------------------------------------------------
# Errors

@pytest.mark.parametrize("name", QUANT + ("f16",))
def test_non_finite_names_the_first_index(name):
    x = np.ones((3, 4, 64), F32)
    x[2, 3, 63] = np.inf                       # the very last value
    with pytest.raises(NonFiniteError, match=r"non-finite value in x: x\[2, 3, 63\] = inf"):
        kvcore.quantize(x, name)
    x[1, 0, 7] = np.nan
    with pytest.raises(NonFiniteError, match=r"x\[1, 0, 7\] = nan"):
        kvcore.quantize(x[:, :, :], name)
    with pytest.raises(NonFiniteError, match=r"\[1, 0, 7\]"):
        kvcore.quantize(x.astype(np.float16), name)


@pytest.mark.parametrize("name, limit_bits", [("f16", 0x477FF000), ("bf16", 0x7F7F8000),
                                               ("q8_0", 0x4AFDF020), ("q4_0", 0x48FFF000),
                                               ("q4_1", 0x477FF000)])
def test_values_at_the_range_limit_are_refused(name, limit_bits):
    # f16 65520 and bf16 0x1.ffp127 round (to even) to infinity; q8_0's block scale would
    limit = np.uint32(limit_bits).view(F32)
    x = np.zeros((2, 32), F32)
    x[1, 4] = -limit
    with pytest.raises(FormatError, match=rf"out of range of format {name} in x: x\[1, 4\] = "
                                          rf"-{re.escape(str(limit))}, expected \|x\| < {re.escape(str(limit))} \("):
        kvcore.quantize(x, name)
    x[1, 4] = np.nextafter(-limit, F32(0))
    codes, scales = kvcore.quantize(x, name)
    decoded = kvcore.dequantize(codes, scales, name)
    assert np.isfinite(decoded).all()  # the largest float32 below the limit is stored finite
    if name == "q8_0":
        assert scales[1, 0] == np.float16(65504)
    if name == "q4_0":
        assert scales[1, 0] == np.float16(65504)     # d = 524159.97 / 8 rounds down
    if name == "q4_1":
        assert scales[1, 1] == np.float16(-65504)    # m = min


def test_bad_arguments():
    with pytest.raises(FormatError, match=r"head_dim divisible by 32, got 48"):
        kvcore.quantize(np.ones((2, 48), F32), "q8_0")
    with pytest.raises(FormatError, match=r"unknown format 'int4'"):
        kvcore.quantize(np.ones((2, 32), F32), "int4")
    with pytest.raises(DTypeError, match=r"invalid dtype of x: expected float32, float16 or "
                                         r"bfloat16, got float64"):
        kvcore.quantize(np.ones((2, 32)), "int8")
    with pytest.raises(DTypeError, match=r"expected an array \(numpy, DLPack or the buffer protocol\), got list"):
        kvcore.quantize([1.0, 2.0], "int8")
    with pytest.raises(ShapeError, match=r"expected \[\.\.\., D\], got \[\]"):
        kvcore.quantize(np.ones((), F32), "int8")
    codes, scales = kvcore.quantize(np.ones((3, 2, 64), F32), "q8_0")
    with pytest.raises(ShapeError, match=r"invalid shape of scales: expected \[3, 2, 2\], "
                                         r"got \[3, 2, 1\]"):
        kvcore.dequantize(codes, scales[..., :1], "q8_0")
    with pytest.raises(DTypeError, match=r"invalid dtype of scales: expected float16, got float32"):
        kvcore.dequantize(codes, scales.astype(F32), "q8_0")
    with pytest.raises(DTypeError, match=r"invalid dtype of codes: expected int8, got uint8"):
        kvcore.dequantize(codes.view(np.uint8), scales, "q8_0")
    with pytest.raises(DTypeError, match=r"invalid type of scales: expected an array "
                                         r"\(numpy, DLPack or the buffer protocol\), got NoneType"):
        kvcore.dequantize(codes, None, "int8")
    with pytest.raises(FormatError, match=r"format f16 has no scales"):
        kvcore.dequantize(np.ones(4, np.float16), np.ones(1, F32), "f16")


# ---------------------------------------------------------------------------------
# q4_0 / q4_1: byte for byte against gguf-py (ggml's block layout) on every edge

def _q4_cases(rng):
    """Rows of 64 (two blocks) over the edges of ggml's 4-bit rules."""
    n = 64
    ties = rng.integers(-16, 17, (n, 64)).astype(F32) / 2    # halves and integers
    ties[:, 0] = ties[:, 32] = -8.0            # q4_0: d = 1, id = 1: x + 8.5 on .5 / integers
    ties_q41 = rng.integers(0, 16, (n, 64)).astype(F32)
    ties_q41[:, [0, 32]], ties_q41[:, [1, 33]] = 0.0, 15.0   # q4_1: d = 1, m = 0
    ties_q41 -= F32(0.5) * (np.arange(n)[:, None] % 2)       # and a min of -0.5
    pm = rng.choice(np.array([1.0, -1.0, 0.5, -0.5, 0.0], F32), (n, 64))   # +-max in one block
    zeros = rng.choice(np.array([0.0, -0.0], F32), (n, 64))                 # signed zeros
    mixed_zero = np.abs(rng.standard_normal((n, 64))).astype(F32)
    mixed_zero[:, ::5] = rng.choice(np.array([0.0, -0.0], F32), (n, 13))    # min is a signed 0
    one_sign = np.abs(rng.standard_normal((n, 64))).astype(F32)
    below = {name: np.nextafter(F32(input_limit(kvcore.FORMATS[name].id)), F32(0))
             for name in Q4}
    return {
        "gaussian": rng.standard_normal((n, 64)).astype(F32),
        "heavy": rng.standard_t(2, (n, 64)).astype(F32),
        "ties": ties, "ties_q4_1": ties_q41, "plus_minus_max": pm, "signed_zeros": zeros,
        "zero_min": mixed_zero, "zero_max": -mixed_zero, "positive": one_sign,
        "negative": -one_sign,
        "one_value": np.full((n, 64), F32(0.3)) * rng.choice(np.array([1, -1], F32), (n, 1)),
        "subnormal": (rng.standard_normal((n, 64)) * 1e-39).astype(F32),
        "tiny": (rng.standard_normal((n, 64)) * 1e-44).astype(F32),
        "small_scale": (rng.standard_normal((n, 64)) * 3e-38).astype(F32),
        "largest": {name: rng.uniform(-1, 1, (n, 64)).astype(F32) * below[name]
                    for name in Q4},
        "at_largest": {name: np.where(rng.random((n, 64)) < 0.1, below[name] *
                                      rng.choice(np.array([1, -1], F32), (n, 64)),
                                      rng.standard_normal((n, 64)).astype(F32)).astype(F32)
                       for name in Q4},
        "wide": random_finite_f32(rng, 2 * n * 64)[: n * 64].reshape(n, 64),
    }


@pytest.mark.parametrize("name", Q4)
def test_q4_bit_identical_to_gguf(name, rng):
    """Every case in rows of 32 to 256 values, read three ways: in place (rows that follow
    each other in memory are one run of up to 512 values, encoded in groups of eight and
    four blocks: one reduction tree each; the block rule for a group with a block that
    needs a second look, and for a run's last one to three blocks), in reverse order
    (rows apart: each row alone, so a row of 32, 64 or 96 is one to three blocks by the
    block rule), and strided (gathered into a buffer, one run again). "mixed" puts
    blocks of every case side by side."""
    cases = {}
    for case, x in _q4_cases(rng).items():
        if isinstance(x, dict):
            x = x[name]
        if case == "wide":       # every binade below the limit (tiny blocks: 1/d overflows)
            lim = input_limit(kvcore.FORMATS[name].id)
            x = np.clip(x, -lim / 2, lim / 2) * rng.choice(
                np.array([1.0, 1e-30, 1e-38, 1e-44], F32), size=(x.shape[0], 1))
        cases[case] = x
    blocks = np.concatenate([x.reshape(-1, 32) for x in cases.values()])
    cases["mixed"] = rng.permutation(blocks)[: len(blocks) // 8 * 8].reshape(-1, 64)
    for case, x in cases.items():
        for width in (32, 64, 96, 128, 256):
            rows = x.reshape(-1)[: x.size // width * width].reshape(-1, width)
            want = gguf_rows(rows, name)
            spread = np.repeat(rows, 2, axis=1)[:, ::2]      # values 8 bytes apart
            for how, view in (("in place", rows), ("reversed", rows[::-1]), ("strided", spread)):
                codes, scales = kvcore.quantize(view, name)
                got = to_ggml(codes, scales, name)[::-1 if how == "reversed" else 1]
                bad = np.nonzero((got != want).any(axis=1))[0]
                assert not bad.size, (f"{case}, rows of {width} read {how}: rows {bad[:5]} "
                                      f"differ from gguf-py: {got[bad[0]]} vs {want[bad[0]]}")
            decoded = kvcore.dequantize(codes, scales, name)
            np.testing.assert_array_equal(raw(decoded), raw(gguf_decode(codes, scales, name)),
                                          err_msg=f"{case}, rows of {width}")
            assert np.isfinite(decoded).all()


@pytest.mark.parametrize("name", Q4)
def test_q4_refused_row_ends_a_run(name, rng):
    # rows at 0, 25d, 50d, 26d, 51d, 76d floats: row 4 follows row 2 in memory, with the
    # refused row 3 between them in the row order. Refused rows stay unwritten, the
    # others are each gguf-py's (the kernel's contract, which kvcore.quantize builds on).
    d = 64
    buf = rng.standard_normal(80 * d).astype(F32)
    x = np.lib.stride_tricks.as_strided(buf, (2, 3, d), (104 * d, 100 * d, 4))
    buf[26 * d + 5] = np.inf                                   # row 3
    f = kvcore.FORMATS[name]
    codes = np.full((6, f.code_width(d)), 0xAA, np.uint8)
    scales = np.full((6, f.scales_per_row(d)), 7, np.float16)
    walk = (x, *kvcore.quant._row_walk(x), 4, kvcore.quant._input_kind(x), f.id, codes, scales, d)
    assert _quant.quantize_rows(*walk) == 1
    assert (codes[3] == 0xAA).all() and (scales[3] == 7).all()
    rows = x.reshape(6, d)[[0, 1, 2, 4, 5]]
    got = to_ggml(codes[[0, 1, 2, 4, 5]], scales[[0, 1, 2, 4, 5]], name)
    np.testing.assert_array_equal(got, gguf_rows(rows, name))


def test_q4_layout_by_hand():
    # block of 32: byte j = value j (low nibble) | value 16 + j (high nibble)
    x = np.arange(-8, 24, dtype=F32)[None, :]      # max |x| = 23 (last): d = 23 / -8
    x[0, 0] = -32.0                                # now max = -32 (first): d = 4, id = 0.25
    codes, scales = kvcore.quantize(x, "q4_0")
    assert scales.dtype == np.float16 and scales.tolist() == [[4.0]]
    q = np.clip(np.trunc(x[0] * F32(0.25) + F32(8.5)), 0, 15).astype(np.uint8)
    assert codes.tolist() == [[int(q[j]) | int(q[16 + j]) << 4 for j in range(16)]]
    np.testing.assert_array_equal(kvcore.dequantize(codes, scales, "q4_0")[0],
                                  (q.astype(F32) - 8) * 4)
    x = np.linspace(-1, 2, 64, dtype=F32)[None, :]
    codes, scales = kvcore.quantize(x, "q4_1")
    assert codes.shape == (1, 32) and scales.shape == (1, 4)   # (d, m) per block
    assert scales[0, 1] == np.float16(-1.0) and scales[0, 3] == np.float16(x[0, 32])
    low, high = codes & 15, codes >> 4
    assert low[0, 0] == 0 and high[0, 15] == 15 and low[0, 16] == 0 and high[0, 31] == 15


def test_q4_decode_every_code_and_scale():
    # every 4-bit code under every finite float16 d (q4_0), and under d, m pairs (q4_1)
    d = np.arange(0, 2**16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    d = d[np.isfinite(d)]
    nib = np.arange(16, dtype=np.uint8)
    block = nib | nib[::-1] << 4                    # low nibbles 0..15, high 15..0
    codes = np.tile(block, (d.size, 1))
    got = kvcore.dequantize(codes, d[:, None], "q4_0")
    np.testing.assert_array_equal(raw(got), raw(gguf_decode(codes, d[:, None], "q4_0")))
    m = np.random.default_rng(5).permutation(d)
    dm = np.stack([np.abs(d), m], axis=1)
    got = kvcore.dequantize(codes, dm, "q4_1")
    np.testing.assert_array_equal(raw(got), raw(gguf_decode(codes, dm, "q4_1")))
    assert np.isfinite(got).all()


@pytest.mark.parametrize("name", Q4)
def test_q4_bad_input(name):
    with pytest.raises(FormatError, match=rf"format {name} needs head_dim divisible by 32, got 48"):
        kvcore.quantize(np.ones((2, 48), F32), name)
    with pytest.raises(FormatError, match=rf"format {name} needs head_dim divisible by 32, got 40"):
        kvcore.dequantize(np.ones((2, 20), np.uint8), np.ones((2, 1), np.float16), name)
    limit = Q4_0_LIMIT if name == "q4_0" else Q4_1_LIMIT
    x = np.ones((3, 64), F32)
    x[2, 40] = limit
    with pytest.raises(FormatError, match=rf"out of range of format {name} in x: x\[2, 40\]"):
        kvcore.quantize(x, name)
    codes, scales = kvcore.quantize(np.ones((3, 64), F32), name)
    with pytest.raises(ShapeError, match=r"invalid shape of out codes: expected \[3, 32\], got \[3, 64\]"):
        kvcore.quantize(x, name, out=(np.zeros((3, 64), np.uint8), scales))
    s = 2 if name == "q4_0" else 4
    with pytest.raises(ShapeError, match=rf"invalid shape of scales: expected \[3, {s}\]"):
        kvcore.dequantize(codes, scales[:, :1], name)


# ---------------------------------------------------------------------------------
# q4_1ch: q4_1 by channel over groups of 32 positions, against gguf-py's q4_1 of the
# transposed group

def test_q4_1ch_is_gguf_q4_1_of_each_channel(rng):
    # every edge case of q4_1 as channels: x [cases, 32 positions, 64 channels]
    for case, x in _q4_cases(rng).items():
        if isinstance(x, dict):
            x = x["q4_1"]
        if case == "wide":
            x = np.clip(x, -Q4_1_LIMIT / 2, Q4_1_LIMIT / 2)
        groups = x.reshape(-1, 64, 32).swapaxes(-1, -2)           # [g, 32, 64], strided
        codes, scales = kvcore.quantize(groups, "q4_1ch")
        assert codes.shape == groups.shape[:-1] + (32,) and scales.shape == groups.shape[:-1] + (4,)
        channels = np.ascontiguousarray(groups.swapaxes(-1, -2)).reshape(-1, 32)   # [g * 64, 32]
        want_codes, want_scales = gguf_encode(channels, "q4_1")    # [g * 64, 16], [g * 64, 2]
        # the group's bytes: channel c's 16 code bytes and (d, m), channel after channel
        assert codes.tobytes() == want_codes.tobytes(), case
        assert scales.tobytes() == want_scales.tobytes(), case
        decoded = kvcore.dequantize(codes, scales, "q4_1ch")
        want = gguf_decode(want_codes, want_scales, "q4_1").reshape(-1, 64, 32).swapaxes(-1, -2)
        np.testing.assert_array_equal(raw(decoded), raw(want), err_msg=case)


def test_q4_1ch_layout_by_hand():
    # channel c of a group: q4_1 of its 32 positions; row slot j holds channels
    # [j D/32, (j + 1) D/32), 16 code bytes and a (d, m) pair each
    x = np.zeros((32, 64), F32)
    x[:, 3] = np.arange(32, dtype=F32)           # channel 3: 0..31, d = 31/15, m = 0
    x[:, 2] = -1.0                               # channel 2: one value, d = 0, m = -1
    codes, scales = kvcore.quantize(x, "q4_1ch")
    assert codes.shape == (32, 32) and scales.shape == (32, 4)
    slot, at = divmod(3, 2)                       # D/32 = 2 channels per row slot
    block = codes[slot, 16 * at:16 * at + 16]
    q = np.clip(np.trunc(np.arange(32, dtype=F32) * (F32(1) / (F32(31) / F32(15))) + F32(0.5)), 0, 15)
    assert (block & 15).tolist() == q[:16].tolist() and (block >> 4).tolist() == q[16:].tolist()
    assert scales[1, 2:].tolist() == [np.float16(F32(31) / F32(15)), 0.0]
    assert scales[1, :2].tolist() == [0.0, -1.0] and not codes[1, :16].any()
    np.testing.assert_array_equal(kvcore.dequantize(codes, scales, "q4_1ch")[:, 2], -1.0)


def test_q4_1ch_bad_input(rng):
    x = rng.standard_normal((2, 32, 64)).astype(F32)
    with pytest.raises(ShapeError, match=r"q4_1ch encodes groups of 32 positions, expected "
                                         r"\[\.\.\., 32, 64\], got \[2, 31, 64\]"):
        kvcore.quantize(x[:, :31], "q4_1ch")
    with pytest.raises(FormatError, match="needs head_dim divisible by 32, got 48"):
        kvcore.quantize(x[..., :48], "q4_1ch")
    for bad, err in ((np.nan, NonFiniteError), (np.inf, NonFiniteError), (-70000.0, FormatError)):
        y = x.copy()
        y[1, 5, 7] = bad
        codes = np.zeros((2, 32, 32), np.uint8)
        with pytest.raises(err, match=r"x\[1, 5, 7\]"):
            kvcore.quantize(y, "q4_1ch", out=(codes, np.zeros((2, 32, 4), np.float16)))
        assert not codes.any()
    codes, scales = kvcore.quantize(x, "q4_1ch")
    with pytest.raises(ShapeError, match="encodes groups of 32 positions"):
        kvcore.dequantize(codes[:, :16], scales[:, :16], "q4_1ch")
