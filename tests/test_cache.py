"""KVCache: round trips for every format against independent references, views,
strides, sizes, bookkeeping, and the atomic-write rule (a refused call leaves storage
byte-identical and lengths unchanged)."""
import re

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvcore
from kvcore import (CapacityError, DTypeError, FormatError, KVCache, KVSpec, NonFiniteError,
                    OutOfRangeError, ShapeError, SpecError, StateError)
from kvcore.cache import _Cells
from kvcore.formats import FORMATS, ROW_FORMATS, view_dtype
from kvcore._quant import input_limit
from kvcore._storage import SKEW, storage_bytes
from kvcore.quant import Q4_0_LIMIT, Q4_1_LIMIT, Q8_0_LIMIT

from _formats import PAIRS, sides
from _ggml import gguf_encode

ALL = list(ROW_FORMATS)   # K and V in one format (q4_1ch is K only)
INPUT_DTYPES = [np.float32, np.float16, ml_dtypes.bfloat16]


def make(fmt="f32", *, layers=2, heads=8, head_dim=128, capacity=16) -> KVCache:
    return KVCache(KVSpec(num_layers=layers, num_kv_heads=heads, head_dim=head_dim,
                          capacity=capacity, format=fmt))


def randn(rng, shape, dtype=np.float32, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(dtype)


# -- independent references: numpy / ml_dtypes implementations of each rule ----------

def ref_encode(x, fmt: str):
    """(codes in the raw code dtype, scales or None) of x [..., D] by the documented rule."""
    x = np.asarray(x).astype(np.float32)
    f32 = np.float32
    if fmt == "f32":
        return x.copy(), None
    if fmt == "f16":
        return x.astype(np.float16), None
    if fmt == "bf16":
        return x.astype(ml_dtypes.bfloat16).view(np.uint16), None
    if fmt in ("q4_0", "q4_1"):
        return gguf_encode(x, fmt)
    amax = np.abs(x).max(axis=-1, keepdims=True)
    if fmt == "q8_0":
        blocks = x.reshape(x.shape[:-1] + (-1, 32))
        d = np.abs(blocks).max(axis=-1, keepdims=True) / f32(127)
        with np.errstate(divide="ignore"):
            inv = np.where(d != 0, f32(1) / d, f32(0)).astype(f32)
        v = (blocks * inv).astype(np.float64)  # exact; ggml's roundf: half away from 0
        q = np.trunc(v + np.copysign(0.5, v)).astype(np.int8).reshape(x.shape)
        return q, d[..., 0].astype(np.float16)
    fmax = {"int8": 127, "fp8_e4m3": 448, "fp8_e5m2": 57344}[fmt]
    scale = amax / f32(fmax)
    with np.errstate(invalid="ignore", divide="ignore"):
        y = np.where(scale != 0, x / scale, f32(0)).astype(f32)
    if fmt == "int8":
        return np.clip(np.rint(y), -127, 127).astype(np.int8), scale
    dt = ml_dtypes.float8_e4m3fn if fmt == "fp8_e4m3" else ml_dtypes.float8_e5m2
    return y.astype(dt).view(np.uint8), scale


def raw(a):
    return None if a is None else a.view(FORMATS_RAW[a.dtype]) if a.dtype in FORMATS_RAW else a


FORMATS_RAW = {view_dtype(f): FORMATS[f].code_dtype for f in FORMATS}


def assert_held(cache, layer, k, v, *, start=0, pending=False):
    """Positions [start, start + T) of `layer` hold k, v [T, Hkv, D] encoded exactly (each
    side in its format)."""
    for x, fmt, codes, scales in ((k, cache.spec.k_format, cache.keys(layer, pending=pending),
                              cache.key_scales(layer, pending=pending)),
                             (v, cache.spec.v_format, cache.values(layer, pending=pending),
                              cache.value_scales(layer, pending=pending))):
        want_c, want_s = ref_encode(x, fmt)
        t = len(x)
        np.testing.assert_array_equal(raw(codes[start:start + t]), want_c)
        if want_s is None:
            assert scales is None
        else:
            np.testing.assert_array_equal(scales[start:start + t], want_s)


def state(cache):
    return (cache._storage.copy(), cache.length,
            [cache.pending(i) for i in range(cache.spec.num_layers)])


def assert_unchanged(cache, before):
    storage, length, pending = before
    assert cache.length == length
    assert [cache.pending(i) for i in range(cache.spec.num_layers)] == pending
    assert np.array_equal(cache._storage, storage), "a refused call changed the storage"


# -- round trips --------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ALL + PAIRS)
@pytest.mark.parametrize("dtype", INPUT_DTYPES, ids=lambda d: np.dtype(d).name)
def test_round_trip_every_format(fmt, dtype, rng):
    cache = make(fmt, layers=3, capacity=12)
    steps = [(randn(rng, (t, 8, 128), dtype, 3.0), randn(rng, (t, 8, 128), dtype))
             for t in (5, 1, 6)]
    start = 0
    for k, v in steps:
        for layer in range(3):
            cache.append(layer, k, v)
        assert cache.advance() == len(k)
        start += len(k)
    assert cache.length == 12
    start = 0
    for k, v in steps:
        for layer in range(3):
            assert_held(cache, layer, k, v, start=start)
        start += len(k)


@pytest.mark.parametrize("fmt", [f for f in kvcore.QUANTIZED_FORMATS if f in ROW_FORMATS])
def test_quantized_equals_kvcore_quantize(fmt, rng):
    cache = make(fmt)
    k = randn(rng, (7, 8, 128), np.float32, 10.0)
    k[2, 3] = 0.0  # an all-zero row: scale 0, codes 0
    v = rng.standard_t(3, (7, 8, 128)).astype(np.float32)
    cache.append(0, k, v)
    for x, codes, scales in ((k, cache.keys(0, pending=True), cache.key_scales(0, pending=True)),
                             (v, cache.values(0, pending=True), cache.value_scales(0, pending=True))):
        want_c, want_s = kvcore.quantize(x, fmt)
        np.testing.assert_array_equal(raw(codes), raw(want_c))
        np.testing.assert_array_equal(scales, want_s)
        np.testing.assert_array_equal(cache.dequantize(0, "k" if x is k else "v", pending=True),
                                      kvcore.dequantize(want_c, want_s, fmt))


@pytest.mark.parametrize("fmt", ALL + PAIRS)
def test_dequantize_is_a_float32_copy(fmt, rng):
    cache = make(fmt)
    kf, fmt = sides(fmt)   # fmt: V's
    k, v = randn(rng, (3, 8, 128)), randn(rng, (3, 8, 128))
    cache.append(0, k, v)
    cache.append(1, k, v)
    cache.advance()
    out = cache.dequantize(0, "v")
    assert out.dtype == np.float32 and out.shape == (3, 8, 128) and out.flags.writeable
    assert not np.shares_memory(out, cache._storage)
    want = ref_encode(v, fmt)
    np.testing.assert_array_equal(out, kvcore.dequantize(want[0], want[1], fmt))
    want = ref_encode(k, kf)
    np.testing.assert_array_equal(cache.dequantize(0, "k"), kvcore.dequantize(*want, kf))
    if fmt == "f32":
        np.testing.assert_array_equal(out, v)
    with pytest.raises(OutOfRangeError, match="which 'q' out of range"):
        cache.dequantize(0, "q")
    into = np.full((3, 8, 128), np.nan, np.float32)
    assert cache.dequantize(0, "v", out=into) is into
    np.testing.assert_array_equal(into, out)
    with pytest.raises(ShapeError, match=r"invalid shape of out: expected \[3, 8, 128\], got \[2, 8, 128\]"):
        cache.dequantize(0, "v", out=into[:2])
    if fmt == "f32":
        with pytest.raises(ShapeError, match="out overlaps the cache's storage"):
            cache.dequantize(0, "v", out=cache._layer_arrays(1)[0][:3])


@pytest.mark.parametrize("fmt", ALL)
def test_views_are_read_only_and_zero_copy(fmt, rng):
    cache = make(fmt)
    k, v = randn(rng, (2, 8, 128)), randn(rng, (2, 8, 128))
    cache.append(0, k, v)
    w = cache.spec.fmt.code_width(128)
    assert cache.keys(0).shape == (0, 8, w)
    assert cache.keys(0, pending=True).shape == (2, 8, w)
    cache.append(1, k, v)
    cache.advance()
    s = cache.spec.fmt.scales_per_row(128)
    views = [cache.keys(1), cache.values(1)]
    w = cache.spec.fmt.code_width(128)
    assert all(a.dtype == view_dtype(fmt) and a.shape == (2, 8, w) for a in views)
    if s:
        views += [cache.key_scales(1), cache.value_scales(1)]
        assert views[2].shape == (2, 8, s) and views[2].dtype == cache.spec.fmt.scale_dtype
    else:
        assert cache.key_scales(1) is None and cache.value_scales(1) is None
    for a in views:
        assert not a.flags.writeable
        assert np.shares_memory(a, cache._storage)
        with pytest.raises(ValueError, match="read-only"):
            a[0] = 0


def test_layer_arrays_are_writable_full_capacity_views():
    cache = make("q8_0", capacity=5)
    kc, vc, ks, vs = cache._layer_arrays(1)
    assert kc.shape == vc.shape == (5, 8, 128) and kc.dtype == np.int8
    assert ks.shape == vs.shape == (5, 8, 4) and ks.dtype == np.float16
    for a in (kc, vc, ks, vs):
        assert a.flags.writeable and np.shares_memory(a, cache._storage)
    kc[0, 0, 0] = 7
    cache.append(0, np.zeros((8, 128), np.float32), np.zeros((8, 128), np.float32))
    cache.append(1, np.zeros((8, 128), np.float32), np.zeros((8, 128), np.float32))
    cache.advance()
    assert cache.keys(1)[0, 0, 0] == 0  # the append overwrote it
    assert cache._layer_arrays(0)[2] is not None and make("f16")._layer_arrays(0)[2] is None


# -- input layouts ------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["f32", "bf16", "int8", "q8_0"])
@pytest.mark.parametrize("dtype", INPUT_DTYPES, ids=lambda d: np.dtype(d).name)
def test_any_strides_equal_contiguous(fmt, dtype, rng):
    base = randn(rng, (6, 16, 256), dtype)
    layouts = {
        "negative": base[::-2, ::-2, ::-2],                     # [3, 8, 128]
        "transposed": np.ascontiguousarray(base[:3, :8, :128].transpose(2, 1, 0)).transpose(2, 1, 0),
        "inner stride 2": base[:3, :8, ::2],
        "broadcast t": np.broadcast_to(base[0, :8, :128], (3, 8, 128)),
    }
    unaligned = np.frombuffer(b"\0" + np.ascontiguousarray(base[:3, :8, :128]).tobytes(),
                              dtype=dtype, offset=1).reshape(3, 8, 128)
    assert not unaligned.flags.aligned
    layouts["unaligned"] = unaligned
    for name, x in layouts.items():
        cache = make(fmt, layers=1)
        cache.append(0, x, x[::-1])
        cache.advance()
        assert_held(cache, 0, np.ascontiguousarray(x), np.ascontiguousarray(x[::-1]))


@pytest.mark.parametrize("fmt", ALL + PAIRS)
def test_two_dim_input_is_one_position(fmt, rng):
    cache = make(fmt, layers=1)
    k, v = randn(rng, (8, 128)), randn(rng, (8, 128), np.float16)[:, ::-1]
    cache.append(0, k, v)
    assert cache.pending(0) == 1
    cache.advance()
    assert_held(cache, 0, k[None], v[None])


def test_zero_positions_is_a_no_op(rng):
    cache = make(layers=2)
    cache.append(0, np.zeros((0, 8, 128), np.float32), np.zeros((0, 8, 128), np.float32))
    assert cache.pending(0) == 0
    assert cache.advance() == 0 and cache.length == 0


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("heads", [1, 8])
@pytest.mark.parametrize("fmt", ["f16", "fp8_e4m3", "q8_0"])
def test_sizes_up_to_the_last_position(fmt, heads, head_dim, rng):
    cache = make(fmt, layers=2, heads=heads, head_dim=head_dim, capacity=3)
    xs = [randn(rng, (t, heads, head_dim)) for t in (2, 1)]
    for x in xs:
        cache.append(0, x, -x)
        cache.append(1, -x, x)
        cache.advance()
    assert cache.length == 3
    assert_held(cache, 0, xs[1], -xs[1], start=2)       # the last position
    assert_held(cache, 1, -xs[0], xs[0], start=0)
    with pytest.raises(CapacityError):
        cache.append(0, xs[1], xs[1])


def test_capacity_one(rng):
    cache = make("int8", layers=1, capacity=1)
    x = randn(rng, (1, 8, 128))
    cache.append(0, x, x)
    cache.advance()
    assert_held(cache, 0, x, x)
    with pytest.raises(CapacityError, match=r"asked for position 1 .*capacity is 1 "):
        cache.append(0, x, x)



def test_capacity_error_names_the_pending_positions(rng):
    """A cache filled by appends never advanced says so: how many positions of the layer
    are pending, and to call advance() after each step; a full cache with nothing
    pending does not."""
    cache = make("int8", layers=2, capacity=16)
    x = randn(rng, (12, 8, 128))
    cache.append(0, x[:4], x[:4])
    cache.append(1, x[:4], x[:4])
    cache.advance()
    cache.append(0, x[:11], x[:11])            # a loop that forgot advance()
    before = state(cache)
    with pytest.raises(CapacityError, match=r"^cache full: layer 0 asked for position 16 \(holds "
                       r"15, appending 2\), capacity is 16 positions; 11 positions of layer 0 "
                       r"are pending: call advance\(\) once every layer holds the step's "
                       r"positions$"):
        cache.append(0, x[:2], x[:2])
    assert_unchanged(cache, before)
    cache.truncate(4)
    cache.append(0, x[:11], x[:11])
    cache.append(0, x[:1], x[:1])
    with pytest.raises(CapacityError, match=r"; 12 positions of layer 0 are pending: call"):
        cache.append(0, x[:1], x[:1])
    cache.truncate(0)
    cache.append(1, x[:1], x[:1])
    with pytest.raises(CapacityError, match=r"; 1 position of layer 1 is pending: call"):
        cache.append(1, randn(rng, (16, 8, 128)), randn(rng, (16, 8, 128)))
    cache.truncate(0)
    for layer in range(2):
        cache.append(layer, randn(rng, (16, 8, 128)), randn(rng, (16, 8, 128)))
    cache.advance()
    with pytest.raises(CapacityError) as e:     # full, nothing pending: no hint
        cache.append(0, x[:1], x[:1])
    assert str(e.value) == ("cache full: layer 0 asked for position 16 (holds 16, appending "
                            "1), capacity is 16 positions")

@pytest.mark.parametrize("fmt", ["f32", "f16", "bf16", "int8"])
@pytest.mark.parametrize("head_dim", [5, 33, 128])
@pytest.mark.parametrize("t", [1, 80])
def test_fresh_and_rewritten_positions(fmt, head_dim, t, rng):
    # first writes of 2-4 byte codes go out with non-temporal stores, rewrites after a
    # truncate with normal ones; t = 80 of 8 heads passes the threshold for threads, and
    # odd head_dims put rows at every alignment
    cache = make(fmt, layers=2, head_dim=head_dim, capacity=2 * t + 1)
    first = [randn(rng, (t, 8, head_dim)) for _ in range(4)]
    for layer in range(2):
        cache.append(layer, first[2 * layer], first[2 * layer + 1][:, :, ::-1].copy())
    cache.advance()
    assert_held(cache, 1, first[2], first[3][:, :, ::-1])
    cache.truncate(t // 2)
    again = [randn(rng, (t + 1, 8, head_dim), np.float16) for _ in range(2)]
    for layer in range(2):
        cache.append(layer, again[layer], again[1 - layer])
    cache.advance()
    assert cache.length == t // 2 + t + 1
    for layer in range(2):
        assert_held(cache, layer, first[2 * layer][: t // 2], first[2 * layer + 1][: t // 2, :, ::-1])
        assert_held(cache, layer, again[layer], again[1 - layer], start=t // 2)


def test_large_appends_use_threads_and_match_one_thread(rng):
    # over _parallel.PARALLEL_MIN_VALUES, so rows are spread over threads
    x = randn(rng, (64, 8, 128), np.float16)
    results = []
    for threads in (1, 2):
        kvcore.set_num_threads(threads)
        try:
            cache = make("q8_0", layers=1, capacity=128)
            cache.append(0, x, x[::-1])
            bad = x.copy()
            bad[63, 7, 127] = np.inf
            before = state(cache)
            with pytest.raises(NonFiniteError, match=r"k\[63, 7, 127\] = inf"):
                cache.append(0, bad, x)
            assert_unchanged(cache, before)
            results.append(cache._storage.copy())
        finally:
            kvcore.set_num_threads(0)
    assert np.array_equal(*results)
    cache.advance()
    assert_held(cache, 0, x, x[::-1])


# -- memory and layout --------------------------------------------------------------

def test_memory_is_exact_and_aligned():
    cache = make("int8", layers=32, capacity=10)
    spec = cache.spec
    assert cache.memory_bytes == spec.memory_bytes == cache._store.nbytes
    assert cache.memory_bytes == 10 * 32 * 8 * 2 * (128 + 4)
    assert cache._storage.nbytes == storage_bytes(spec, 10) == 350208 + 327680
    assert cache.fp32_equivalent_bytes == 10 * 32 * 8 * 2 * 128 * 4
    assert cache.compression_ratio == pytest.approx(512 / 132) and round(cache.compression_ratio, 2) == 3.88
    assert cache._storage.ctypes.data % 64 == 0 and cache._storage.dtype == np.uint8
    layout = cache.layout
    assert list(layout) == ["k_scales", "v_scales", "k_codes", "v_codes"]
    # region i at the first offset past region i - 1 that is i * SKEW modulo 4096
    assert [r["offset"] for r in layout.values()] == [0, 10240, 20480, 20480 + 327680 + 2048]
    assert layout["k_codes"]["shape"] == (32, 10, 8, 128) and layout["k_scales"]["dtype"] == "float32"
    assert sum(r["nbytes"] for r in layout.values()) == cache.memory_bytes
    assert cache.strides["k_codes"] == (10 * 8 * 128, 8 * 128, 128, 1)
    assert cache.strides["v_scales"] == (10 * 8 * 4, 8 * 4, 4, 4)
    f16 = make("f16")
    assert list(f16.layout) == ["k_codes", "v_codes"] and f16.compression_ratio == 2.0


@pytest.mark.parametrize("fmt, capacity", [("f16", 131072), ("f32", 65536), ("int8", 262144),
                                           ("q8_0", 262144), ("q4_0", 524288), ("int8", 131072)])
def test_k_and_v_rows_are_not_aliased(fmt, capacity):
    """Same-shaped regions (K and V codes, K and V scales) start half a page apart modulo
    4096, never a multiple of 2^27 bytes apart as they did packed end to end (row p of K and
    of V then shared their L1 set and micro-tag, and decode attention ran 1.4-2x slower on
    a Zen 5 core: a 128k-position f16 cache, a pool of 32 x 4096 int8 positions)."""
    lay = make(fmt, layers=1, heads=8, head_dim=128, capacity=capacity).layout
    assert SKEW == 2048
    for a, b in (("k_codes", "v_codes"), ("k_scales", "v_scales")):
        if a in lay:
            assert (lay[b]["offset"] - lay[a]["offset"]) % 4096 == 2048, (a, b)
            assert lay[a]["offset"] + lay[a]["nbytes"] <= lay[b]["offset"] \
                < lay[a]["offset"] + lay[a]["nbytes"] + 4096


def test_a_step_is_one_contiguous_block(rng):
    cache = make("f32", capacity=4)
    cache.append(0, randn(rng, (2, 8, 128)), randn(rng, (2, 8, 128)))
    cache.append(1, randn(rng, (2, 8, 128)), randn(rng, (2, 8, 128)))
    cache.advance()
    assert cache.keys(1).flags.c_contiguous
    offset = cache.keys(1).ctypes.data - cache._storage.ctypes.data
    assert offset == cache.layout["k_codes"]["offset"] + 1 * 4 * 8 * 128 * 4


# -- bookkeeping --------------------------------------------------------------------

def test_cells_alone():
    cells = _Cells(3)
    cells.pending = [2, 2, 2]
    assert cells.commit() == 2 and cells.length == 2 and cells.end(1) == 2
    cells.pending = [1, 0, 1]
    with pytest.raises(StateError, match=r"in every layer: layers 0, 2 hold 1; layer 1 holds 0$"):
        cells.commit()
    assert cells.length == 2 and cells.pending == [1, 0, 1]


def test_advance_needs_equal_pending(rng):
    cache = make(layers=4)
    x = randn(rng, (1, 8, 128))
    assert cache.advance() == 0  # nothing pending: a no-op
    cache.append(0, x, x)
    cache.append(1, x, x)
    before = state(cache)
    with pytest.raises(StateError, match=r"layers 0-1 hold 1; layers 2-3 hold 0$"):
        cache.advance()
    assert_unchanged(cache, before)
    cache.append(2, x, x)
    cache.append(3, x, x)
    assert cache.advance() == 1 and cache.length == 1


def test_truncate_and_reset(rng):
    cache = make(layers=2, capacity=8)
    xs = [randn(rng, (1, 8, 128)) for _ in range(4)]
    for x in xs:
        cache.append(0, x, x)
        cache.append(1, x, x)
        cache.advance()
    cache.append(0, xs[0], xs[0])
    cache.truncate(2)
    assert cache.length == 2 and cache.pending(0) == 0
    cache.append(0, xs[3], xs[3])
    cache.append(1, xs[3], xs[3])
    cache.advance()
    assert_held(cache, 0, xs[3], xs[3], start=2)
    assert_held(cache, 0, xs[1], xs[1], start=1)
    cache.truncate(3)  # n == length is allowed
    cache.reset()
    assert cache.length == 0 and cache.keys(0).shape == (0, 8, 128)
    cache.truncate(0)


# -- atomicity ----------------------------------------------------------------------

def _good(shape=(1, 8, 128)):
    return np.ones(shape, np.float32)


def _with(value, where, dtype=np.float32, shape=(2, 8, 128)):
    x = np.ones(shape, dtype)
    x[where] = value
    return x


BAD_CALLS = {
    # name: (call on a cache [L=2, Hkv=8, D=128, N=4] holding 2 committed + 1 pending in layer 0, error, match)
    "ndim 1": (lambda c: c.append(0, _good((128,)), _good((128,))), ShapeError,
               r"invalid shape of k: expected \[T, 8, 128\], got \[128\]"),
    "ndim 4": (lambda c: c.append(0, _good((1, 1, 8, 128)), _good((1, 1, 8, 128))), ShapeError,
               r"expected \[T, 8, 128\], got \[1, 1, 8, 128\]"),
    "heads": (lambda c: c.append(0, _good((1, 4, 128)), _good((1, 4, 128))), ShapeError,
              r"invalid shape of k: expected \[T, 8, 128\], got \[1, 4, 128\]"),
    "head_dim 2d": (lambda c: c.append(0, _good((8, 64)), _good((8, 64))), ShapeError,
                    r"expected \[8, 128\], got \[8, 64\]"),
    "k, v differ": (lambda c: c.append(0, _good((1, 8, 128)), _good((2, 8, 128))), ShapeError,
                    r"invalid shape of v: expected \[1, 8, 128\], got \[2, 8, 128\]"),
    "k, v ndim differ": (lambda c: c.append(0, _good((1, 8, 128)), _good((8, 128))), ShapeError,
                         r"invalid shape of v: expected \[1, 8, 128\], got \[8, 128\]"),
    "int": (lambda c: c.append(0, np.ones((1, 8, 128), np.int32), _good()), DTypeError,
            r"invalid dtype of k: expected float32, float16 or bfloat16, got int32"),
    "complex": (lambda c: c.append(0, _good(), np.ones((1, 8, 128), np.complex64)), DTypeError,
                r"dtype of v: .* got complex64"),
    "object": (lambda c: c.append(0, _good().astype(object), _good()), DTypeError, r"got object"),
    "float64": (lambda c: c.append(0, _good(), _good().astype(np.float64)), DTypeError,
                r"dtype of v: .* got float64"),
    "big-endian": (lambda c: c.append(0, _good().astype(">f4"), _good()), DTypeError, r"got >f4"),
    "list": (lambda c: c.append(0, [[0.0] * 128] * 8, _good()), DTypeError,
             r"invalid type of k: expected an array \(numpy, DLPack or the buffer protocol\), got list"),
    "nan k first": (lambda c: c.append(1, _with(np.nan, (0, 0, 0)), _good((2, 8, 128))),
                    NonFiniteError, r"non-finite value in k: k\[0, 0, 0\] = nan"),
    "inf k last": (lambda c: c.append(1, _with(np.inf, (1, 7, 127)), _good((2, 8, 128))),
                   NonFiniteError, r"in k: k\[1, 7, 127\] = inf"),
    "-inf v last": (lambda c: c.append(1, _good((2, 8, 128)), _with(-np.inf, (1, 7, 127))),
                    NonFiniteError, r"in v: v\[1, 7, 127\] = -inf"),
    "nan v last f16": (lambda c: c.append(1, _good((2, 8, 128)), _with(np.nan, (1, 7, 127), np.float16)),
                       NonFiniteError, r"in v: v\[1, 7, 127\] = nan"),
    "inf v last bf16 2d": (lambda c: c.append(1, _good((8, 128)),
                                              _with(np.inf, (7, 127), ml_dtypes.bfloat16, (8, 128))),
                           NonFiniteError, r"in v: v\[7, 127\] = inf"),
    "nan strided": (lambda c: c.append(1, _with(np.nan, (1, 7, 254), shape=(2, 8, 256))[:, :, ::2],
                                       _good((2, 8, 128))), NonFiniteError, r"k\[1, 7, 127\] = nan"),
    "capacity + 1": (lambda c: c.append(0, _good((2, 8, 128)), _good((2, 8, 128))), CapacityError,
                     r"layer 0 asked for position 4 \(holds 3, appending 2\), capacity is 4 positions"),
    "layer -1": (lambda c: c.append(-1, _good(), _good()), OutOfRangeError,
                 r"layer -1 out of range: expected 0 <= layer < 2"),
    "layer 2": (lambda c: c.append(2, _good(), _good()), OutOfRangeError,
                r"layer 2 out of range: expected 0 <= layer < 2"),
    "layer float": (lambda c: c.append(1.0, _good(), _good()), DTypeError,
                    r"invalid type of layer: expected int, got float"),
    "truncate past length": (lambda c: c.truncate(3), OutOfRangeError,
                             r"truncate to 3 out of range: expected 0 <= n <= length 2"),
    "truncate negative": (lambda c: c.truncate(-1), OutOfRangeError, r"truncate to -1"),
    "truncate float": (lambda c: c.truncate(1.5), DTypeError, r"invalid type of n"),
    "advance unequal": (lambda c: c.advance(), StateError,
                        r"same number of pending positions in every layer: layer 0 holds 1; layer 1 holds 0"),
}


@pytest.mark.parametrize("fmt", ALL)
@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_refused_calls_change_nothing(case, fmt, rng):
    call, error, match = BAD_CALLS[case]
    cache = make(fmt, capacity=4)
    for _ in range(2):
        for layer in range(2):
            cache.append(layer, randn(rng, (1, 8, 128)), randn(rng, (1, 8, 128)))
        cache.advance()
    cache.append(0, randn(rng, (1, 8, 128)), randn(rng, (1, 8, 128)))
    before = state(cache)
    with pytest.raises(error, match=match):
        call(cache)
    assert_unchanged(cache, before)


# The smallest finite |x| each format refuses (the value, or q8_0's block scale, would round
# to infinity), and the largest stored value of the float just below it.
LIMITS = {"f16": (65520.0, 65504.0),
          "bf16": (np.uint32(0x7F7F8000).view(np.float32), np.uint32(0x7F7F0000).view(np.float32)),
          "q8_0": (Q8_0_LIMIT, None), "q4_0": (Q4_0_LIMIT, None), "q4_1": (Q4_1_LIMIT, None)}


@pytest.mark.parametrize("fmt", list(LIMITS))
def test_values_past_the_format_range_are_refused(fmt):
    limit, stored = LIMITS[fmt]
    assert np.float32(limit) == np.float32(input_limit(kvcore.FORMATS[fmt].id))
    cache = make(fmt)
    k = np.ones((1, 8, 128), np.float32)
    k[0, 5, 64] = -limit
    before = state(cache)
    with pytest.raises(FormatError, match=rf"out of range of format {fmt} in k: k\[0, 5, 64\] = "
                                          rf"-{re.escape(str(np.float32(limit)))}, expected \|x\| < "):
        cache.append(0, k, np.ones_like(k))
    if fmt != "bf16":  # bfloat16 input past float16's range (bf16 holds every bfloat16)
        big = np.full((1, 8, 128), 2.0**30 if fmt in ("q8_0", "q4_0") else 65536.0, ml_dtypes.bfloat16)
        with pytest.raises(FormatError, match=r"in v: v\[0, 0, 0\]"):
            cache.append(0, np.ones_like(k), big)
    assert_unchanged(cache, before)
    below = np.nextafter(np.float32(limit), np.float32(0))
    k[0, 5, 64] = -below
    cache.append(0, k, k)  # the largest float32 below the limit is taken
    assert_held(cache, 0, k, k, pending=True)
    if stored is not None:
        assert cache.dequantize(0, "k", pending=True)[0, 5, 64] == -stored


@pytest.mark.parametrize("fmt", PAIRS + ["f32/q4_1", "q4_0/bf16"])
def test_pair_views_and_storage(fmt, rng):
    """Each side's codes and scales in its own format: views, shapes, dtypes, the bytes of
    the one allocation (spec.memory_bytes), every region aligned to its element size
    (regions widest element first: K f16 codes after q4_0's float16 V scales)."""
    kf, vf = (FORMATS[f] for f in sides(fmt))
    cache = make(fmt, layers=3, heads=3, head_dim=64, capacity=7)   # odd row counts
    assert cache.memory_bytes == cache.spec.memory_bytes
    assert cache._storage.nbytes == storage_bytes(cache.spec, 7)
    assert 0 <= cache._storage.nbytes - cache.memory_bytes < 4096 * (len(cache.layout) - 1)
    k, v = randn(rng, (7, 3, 64)), randn(rng, (7, 3, 64))
    for layer in range(3):
        cache.append(layer, k, v)
    cache.advance()
    for f, codes, scales in ((kf, cache.keys(2), cache.key_scales(2)),
                             (vf, cache.values(2), cache.value_scales(2))):
        assert codes.shape == (7, 3, f.code_width(64)) and codes.dtype == view_dtype(f)
        assert codes.ctypes.data % f.code_bytes == 0
        if f.quantized:
            assert scales.shape == (7, 3, f.scales_per_row(64)) and scales.dtype == f.scale_dtype
            assert scales.ctypes.data % f.scale_dtype.itemsize == 0
        else:
            assert scales is None
    assert_held(cache, 2, k, v)
    for region in cache._store.layout.values():
        assert region["offset"] % np.dtype(region["dtype"]).itemsize == 0
    kc, vc, ks, vs = cache._layer_arrays(0)
    assert kc.dtype == kf.code_dtype and vc.dtype == vf.code_dtype
    assert (ks is None) == (not kf.quantized) and (vs is None) == (not vf.quantized)


def test_pair_limits_are_each_sides():
    """K f16 refuses 70000 (past float16), V q4_0 takes it: each side checks its own
    format's range; a refused call changes nothing."""
    cache = make("f16/q4_0", layers=1)
    big = np.full((1, 8, 128), 70000.0, np.float32)
    before = state(cache)
    with pytest.raises(FormatError, match=r"out of range of format f16 in k: k\[0, 0, 0\]"):
        cache.append(0, big, big)
    assert_unchanged(cache, before)
    cache.append(0, np.ones_like(big), big)
    assert_held(cache, 0, np.ones_like(big), big, pending=True)


def test_spec_is_required():
    with pytest.raises(SpecError, match="KVCache needs a KVSpec, got dict"):
        KVCache({"num_layers": 1})


# -- random sequences of good and bad calls ------------------------------------------

_OPS = st.lists(st.tuples(
    st.sampled_from(["append", "append", "append", "advance", "truncate"]),
    st.integers(-1, 2),                       # layer
    st.integers(0, 3),                        # T (or truncate target)
    st.sampled_from([None, None, "nan", "inf", "float64", "heads", "kv"]),  # a defect
    st.integers(0, 2**32 - 1)), max_size=25)


@settings(max_examples=200, deadline=None)
@given(fmt=st.sampled_from(ALL), ops=_OPS)
def test_random_call_sequences(fmt, ops):
    """Against a model of what each layer holds: every call either does what the model
    says or raises and leaves storage byte-identical and lengths unchanged."""
    L, H, D, N = 2, 2, 32, 5
    cache = make(fmt, layers=L, heads=H, head_dim=D, capacity=N)
    held = [[] for _ in range(L)]   # per layer: the positions' inputs, committed + pending
    length = 0
    for op, layer, t, defect, seed in ops:
        rng = np.random.default_rng(seed)
        before = state(cache)
        if op == "append":
            k, v = randn(rng, (t, H, D), np.float16), randn(rng, (t, H, D))
            if defect in ("nan", "inf") and t:
                v[rng.integers(t), rng.integers(H), rng.integers(D)] = np.nan if defect == "nan" else -np.inf
            elif defect == "float64":
                k = k.astype(np.float64)
            elif defect == "heads":
                k, v = k[:, :1], v[:, :1]
            elif defect == "kv":
                v = v[:, :, :-1]
            bad = (layer not in range(L) or (defect in ("nan", "inf") and t)
                   or defect in ("float64", "heads", "kv") or len(held[layer]) + t > N)
            if bad:
                with pytest.raises(kvcore.KVCacheError):
                    cache.append(layer, k, v)
                assert_unchanged(cache, before)
            else:
                cache.append(layer, k, v)
                held[layer] += [(k[i], v[i]) for i in range(t)]
        elif op == "advance":
            counts = {len(h) - length for h in held}
            if len(counts) > 1:
                with pytest.raises(StateError):
                    cache.advance()
                assert_unchanged(cache, before)
            else:
                length += counts.pop()
                cache.advance()
        else:
            if t > length:
                with pytest.raises(OutOfRangeError):
                    cache.truncate(t)
                assert_unchanged(cache, before)
            else:
                cache.truncate(t)
                length = t
                held = [h[:t] for h in held]
        assert cache.length == length
        assert [cache.pending(i) for i in range(L)] == [len(h) - length for h in held]
    for layer in range(L):
        if held[layer]:
            ks, vs = (np.stack(x) for x in zip(*held[layer]))
            assert_held(cache, layer, ks, vs, pending=True)


def test_allocation_failure_names_the_bytes(monkeypatch):
    import errno
    import mmap

    def refuse(*args, **kwargs):
        raise OSError(errno.ENOMEM, "Cannot allocate memory")
    monkeypatch.setattr(mmap, "mmap", refuse)
    with pytest.raises(MemoryError, match=r"cannot allocate the cache's 4096 bytes"):
        make("f32", layers=1, heads=1, head_dim=128, capacity=4)


@pytest.mark.skipif(not hasattr(__import__("mmap"), "MADV_HUGEPAGE"), reason="no MADV_HUGEPAGE")
def test_large_storage_asks_for_huge_pages(monkeypatch):
    """Storage of 2 MiB or more is madvised for transparent huge pages (decode past the LLC
    2-15% faster on a Zen 5 core); a smaller one is not; a kernel that refuses the advice
    still gets its storage."""
    import mmap

    from kvcore import _storage
    asked, real = [], mmap.mmap

    class Recording(real):
        def madvise(self, option, *args):
            asked.append((len(self), option))
            if refuse:
                raise OSError(22, "Invalid argument")
            return super().madvise(option, *args)
    monkeypatch.setattr(mmap, "mmap", Recording)
    refuse = False
    assert _storage.zeroed_pages(_storage.HUGE).nbytes == _storage.HUGE
    assert _storage.zeroed_pages(_storage.HUGE - 4096).nbytes == _storage.HUGE - 4096
    assert asked == [(_storage.HUGE, mmap.MADV_HUGEPAGE)]
    refuse = True
    cache = make("f16", layers=1, heads=8, head_dim=128, capacity=4096)   # 16 MiB
    assert asked[-1] == (cache._storage.nbytes, mmap.MADV_HUGEPAGE)
    assert cache.memory_bytes == 16 << 20 and not cache._storage.any()
