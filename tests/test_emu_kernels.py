"""The emulated kernels (kvcore/gpu/_emu/kernels.py, cuda/emu/): kvcore's own kernels
launched directly on the CPU against the CPU references, and the emulator's strictness
(races, divergent barriers, missing lanes, deadlocks, cp.async and shared-memory poison)
on the test kernels of tests/emu_cases/. Needs only a C++ compiler."""
import ctypes
import math
import os
import time

import ml_dtypes
import numpy as np
import pytest

import kvcore
from kvcore.errors import CudaError
from kvcore.formats import get_format
from kvcore.gpu import GPU_FORMATS
from kvcore.gpu._emu import kernels

from _attention_reference import reference_attention

pytestmark = [pytest.mark.emu,
              pytest.mark.skipif(not kernels.available(), reason="no C++ compiler (g++) on PATH")]

CASES_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "emu_cases")
IN_DTYPES = {"float32": (0, np.float32), "float16": (1, np.float16), "bfloat16": (2, ml_dtypes.bfloat16)}
LOG2E = 1.4426950408889634
POISON32 = 0xFFFFFFFF


def _launch(mod, kernel, grid, block, *args, seed=0, shmem=0):
    """Launches with numpy arrays passed as pointers, ctypes values as they are, and ints
    sized from the kernel's signature."""
    infos = mod.entries[kernel]
    vals = []
    for a, info in zip(args, infos):
        if isinstance(a, np.ndarray):
            vals.append(ctypes.c_void_p(a.ctypes.data))
        elif isinstance(a, ctypes._SimpleCData):
            vals.append(a)
        elif info.is_pointer:
            vals.append(ctypes.c_void_p(a))
        else:
            vals.append({4: ctypes.c_int32, 8: ctypes.c_int64}[info.size](a))
    params = (ctypes.c_void_p * len(vals))(*[ctypes.addressof(v) for v in vals])
    mod.launch(kernel, grid, block, shmem, params, seed)


def _site(marker):
    with open(os.path.join(CASES_DIR, "emu_cases.cu")) as f:
        for i, line in enumerate(f, 1):
            if f"// site: {marker}" in line:
                return f"emu_cases.cu:{i}"
    raise AssertionError(marker)


@pytest.fixture(scope="module")
def cases():
    return kernels.load("emu_cases", source_dir=CASES_DIR)


# ---- the module registry and the builder -----------------------------------------------------

def test_entries_from_the_signatures():
    mod = kernels.load("kv_append")
    assert set(mod.entries) == {"kv_append", "kv_advance"}
    P = kernels.ParamInfo
    assert mod.entries["kv_advance"] == (P(8, True),) * 3 + (P(4, False),) * 4
    sizes = [p.size for p in mod.entries["kv_append"]]
    assert sizes == [8, 8, 4, 8, 8] + [8] * 8 + [4] * 9    # ..., k_res, ..., k_fmt, v_fmt, M, Hkv, N, D, slot, T, mode
    attn = kernels.load("attention_q8_0")
    # (slot and paged storage) x (D 64, 128, 256, run-time D) x (1, 2, 4, 8 heads per block)
    assert len(attn.entries) == 32 and {"kv_attn_q8_0_d256_g8", "kv_pattn_q8_0_dx_g1"} <= set(attn.entries)
    assert [p.is_pointer for p in attn.entries["kv_attn_q8_0_d64_g1"]] == (
        [True] * 6 + [False] * 3 + [True] + [False] * 4 + [True] * 4 + [False] * 3 + [True])
    assert [p.is_pointer for p in attn.entries["kv_pattn_q8_0_dx_g1"]] == (
        [True] * 7 + [False] + [True] * 2 + [False] * 5 + [True] + [False] * 4 + [True] * 4
        + [False] * 3 + [True])   # the variants: window, sink_tokens, softcap2, sinks


def test_load_is_cached_and_a_build_error_names_the_compiler_error(tmp_path):
    assert kernels.load("rope") is kernels.load("rope")
    assert os.path.dirname(kernels.load("rope").path) == kernels.cache_dir()
    (tmp_path / "broken.cu").write_text('extern "C" __global__ void broken(int* p) { p[0] = undeclared_name; }\n')
    with pytest.raises(CudaError, match="(?s)building the emulated module broken failed.*undeclared_name"):
        kernels.load("broken", source_dir=str(tmp_path))


def test_builds_of_edited_sources_are_pruned(tmp_path, monkeypatch):
    """A new build keeps the KEEP_BUILDS most recently used builds of its module and
    variant and any used within PRUNE_AFTER_S; a cache hit renews its build's time."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cache = tmp_path / "kvcore" / "emu"
    cache.mkdir(parents=True)
    now, day = time.time(), kernels.PRUNE_AFTER_S
    rope = [f"rope-{i:024x}.so" for i in range(6)]
    ages = dict(zip(rope, [1, 2, 3, 4, 2 * day, 3 * day]))
    others = [f"rope-{9:024x}-asan.so", f"kv_append-{9:024x}.so", "rope-notahash.so"]
    ages |= dict.fromkeys(others, 5 * day)
    for name, age in ages.items():
        (cache / name).write_bytes(b"")
        os.utime(cache / name, (now - age, now - age))

    built = kernels._build("rope", kernels.default_source_dir(), False)   # a real build
    assert os.path.dirname(built) == str(cache)
    # kept: the new build and the 2 next most recent; beyond them the recent ones too
    assert sorted(os.listdir(cache)) == sorted([os.path.basename(built), *rope[:4], *others])
    later = now + 10 * day                             # now all are old: 3 remain
    assert sorted(kernels.prune("rope", False, now=later)) == [str(cache / n) for n in rope[2:4]]
    assert sorted(os.listdir(cache)) == sorted([os.path.basename(built), *rope[:2], *others])
    assert kernels.prune("rope", True, now=later) == []          # one asan build: kept
    os.utime(built, (now - 3 * day, now - 3 * day))
    assert kernels._build("rope", kernels.default_source_dir(), False) == built   # a hit:
    assert os.stat(built).st_mtime > now - 60                                   # renewed


def test_launch_checks_the_dims_like_the_device(cases):
    out = np.zeros(2, np.int32)
    for grid, block, what in [((1, 1, 1), (1025, 1, 1), "block"), ((1, 1, 1), (32, 32, 2), "block"),
                              ((1, 65536, 1), (32, 1, 1), "grid"), ((0, 1, 1), (32, 1, 1), "grid"),
                              ((1, 1, 1), (1, 1, 65), "block")]:
        with pytest.raises(kernels.KernelFault, match=what) as e:
            _launch(cases, "race_sum", grid, block, out, 1)
        assert e.value.code == "CUDA_ERROR_INVALID_VALUE"


@pytest.mark.skipif(kernels.asan_present(), reason="under ASan its redzones replace the canary")
def test_alloc_poisons_and_free_finds_an_overrun():
    p = kernels.alloc(100)
    assert ctypes.string_at(p, 100) == b"\xff" * 100
    kernels.free(p)
    p = kernels.alloc(100)
    ctypes.memset(p + 100, 0, 1)  # one byte past the end
    with pytest.raises(kernels.KernelFault, match="past the end of the allocation") as e:
        kernels.free(p)
    assert e.value.code == "CUDA_ERROR_ILLEGAL_ADDRESS"
    with pytest.raises(CudaError, match="not an allocation"):
        kernels.free(p)


@pytest.mark.skipif(kernels.asan_present(), reason="under ASan its redzones replace the canary")
def test_a_kernel_writing_past_an_allocation_is_reported_at_free(cases):
    n = 10
    p = kernels.alloc(4 * n)
    _launch(cases, "global_overrun", (1, 1, 1), (32, 1, 1), p, n)
    with pytest.raises(kernels.KernelFault, match="bytes 0..3 past the end"):
        kernels.free(p)


def test_shared_reads_in_bounds(cases):
    out = np.zeros(32, np.float32)
    _launch(cases, "shared_overrun", (1, 1, 1), (32, 1, 1), out, 31)
    assert (out == 1).all()


# ---- kvcore's kernels against the CPU references -------------------------------------------------

def _raw(a):
    return np.ascontiguousarray(a).view(np.uint8)


@pytest.mark.parametrize("fmt", GPU_FORMATS)
@pytest.mark.parametrize("in_dtype", list(IN_DTYPES))
def test_kv_append_bit_exact_with_quantize(fmt, in_dtype, rng):
    f = get_format(fmt)
    dt_id, dt = IN_DTYPES[in_dtype]
    M, Hkv, N, D = 3, 3, 5, 64
    S = f.scales_per_row(D)
    mod = kernels.load("kv_append")
    # strided inputs: [R][Hkv + 1][D + 8] storage, the kernel sees [R][Hkv][D]
    big = (rng.standard_normal((M, Hkv + 1, D + 8)) * rng.choice([1e-3, 1.0, 300.0], (M, Hkv + 1, 1)))
    big[0, 1] = 0.0                           # an all-zero row (scale 0)
    big[1, 2, 5] = 2.0 ** -20                 # subnormal in f16 / fp8 ranges
    if not f.block:
        big[2, 0, :4] = [0.5, 1.5, -2.5, 65504.0 if fmt not in ("f16",) else 1.0]
    x = big.astype(dt)
    k, v = x[:, :Hkv, :D], x[:, 1:, :D]  # kv_append takes one pair of strides for both
    isz = x.dtype.itemsize
    lengths = np.array([0, 2, 4], np.int32)
    err = np.zeros(M, np.int32)  # status per slot
    k_codes = np.full((M, Hkv, N, f.code_width(D) * f.code_bytes), 0xFF, np.uint8)
    v_codes = k_codes.copy()
    sbytes = S * (np.dtype(f.scale_dtype).itemsize if S else 0)
    k_scales = np.full((M, Hkv, N, max(sbytes, 1)), 0xFF, np.uint8)
    v_scales = k_scales.copy()
    heads = M * Hkv * 2
    _launch(mod, "kv_append", ((heads + 7) // 8, 1, 1), (256, 1, 1), k, v, dt_id,
            k.strides[0] // isz, k.strides[1] // isz, k_codes, v_codes,
            k_scales if S else 0, v_scales if S else 0, 0, lengths, err, 0, f.id, f.id, M, Hkv, N, D, -1, 1, 0,
            seed=3)
    assert (err == 0).all()
    for src, codes, scales in ((k, k_codes, k_scales), (v, v_codes, v_scales)):
        ref_codes, ref_scales = kvcore.quantize(src, fmt)
        for s in range(M):
            p = lengths[s]
            np.testing.assert_array_equal(codes[s, :, p], _raw(ref_codes[s]).reshape(Hkv, -1))
            if S:
                np.testing.assert_array_equal(scales[s, :, p], _raw(ref_scales[s]).reshape(Hkv, -1))
            others = np.delete(codes[s], p, axis=1)
            assert (others == 0xFF).all()


@pytest.mark.parametrize("fmt", ["int8", "q8_0", "bf16"])
def test_kv_append_rows_into_one_slot_and_refusals(fmt, rng):
    f = get_format(fmt)
    M, Hkv, N, D, T = 2, 2, 8, 32, 3
    S = f.scales_per_row(D)
    sb = S * (2 if fmt == "q8_0" else 4)
    mod = kernels.load("kv_append")
    x = rng.standard_normal((T, Hkv, D)).astype(np.float32)
    x[1, 1, 3] = np.nan
    lengths = np.array([1, 4], np.int32)
    err = np.zeros(M, np.int32)  # status per slot
    codes = np.full((M, Hkv, N, D * f.code_bytes), 0xFF, np.uint8)
    scales = np.full((M, Hkv, N, max(sb, 1)), 0xFF, np.uint8)
    args = (x, x, 0, Hkv * D, D, codes, codes.copy(), scales if S else 0, scales.copy() if S else 0, 0,
            lengths, err, 0, f.id, f.id, M, Hkv, N, D)
    _launch(mod, "kv_append", (2, 1, 1), (256, 1, 1), *args, 1, T, 0)
    assert list(err) == [0, 2]  # KV_ERR_NONFINITE for the NaN row, on its slot
    ref = kvcore.quantize(np.nan_to_num(x), fmt)
    for r in range(T):
        for h in range(Hkv):
            if (r, h) == (1, 1):
                assert (codes[1, h, 4 + r] == 0xFF).all()  # refused row: nothing written
                continue
            np.testing.assert_array_equal(codes[1, h, 4 + r], _raw(ref[0][r, h]))
            if S:
                np.testing.assert_array_equal(scales[1, h, 4 + r], _raw(ref[1][r, h]))
    assert (codes[0] == 0xFF).all()
    # capacity: 4 + 3 rows do not fit N = 6: nothing anywhere, KV_ERR_CAPACITY
    err[:] = 0
    fresh = np.full_like(codes, 0xFF)
    args = (x, x, 0, Hkv * D, D, fresh, fresh.copy(), scales if S else 0, scales.copy() if S else 0, 0,
            lengths, err, 0, f.id, f.id, M, Hkv, 6, D)
    _launch(mod, "kv_append", (2, 1, 1), (256, 1, 1), *args, 1, T, 0)
    assert list(err) == [0, 1] and (fresh == 0xFF).all()


def test_f16_conversions_exact(rng):
    """kv_f16_to_f32 over every finite f16 (through kv_append f16 -> f32 rows) and
    kv_f32_to_f16 on ties, subnormals and overflow (f32 -> f16 rows) against numpy."""
    mod = kernels.load("kv_append")
    bits = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    h = bits.view(np.float16)
    h = h[np.isfinite(h)]
    h = h[: h.size // 256 * 256].reshape(-1, 1, 256)
    R = h.shape[0]
    codes = np.full((R, 1, 1, 256 * 4), 0xFF, np.uint8)
    err = np.zeros(R, np.int32)  # status per slot
    _launch(mod, "kv_append", ((2 * R + 7) // 8, 1, 1), (256, 1, 1), h, h, 1, 256, 256, codes, codes.copy(),
            0, 0, 0, np.zeros(R, np.int32), err, 0, 0, 0, R, 1, 1, 256, -1, 1, 0)
    assert (err == 0).all()
    np.testing.assert_array_equal(codes.view(np.float32).reshape(R, 256), h.reshape(R, 256).astype(np.float32))
    # f32 -> f16: halfway points between neighbouring f16 values (ties to even), +-1 ulp of
    # f32 around them, subnormals, the overflow edge, and random values
    f16 = np.arange(0, 0x7C00, dtype=np.uint16).view(np.float16).astype(np.float64)
    mids = ((f16[:-1] + f16[1:]) / 2).astype(np.float32)
    x = np.concatenate([mids, np.nextafter(mids, np.float32(0)), np.nextafter(mids, np.float32(1e9)),
                        np.float32([65504, 65519.99, 2.0 ** -25, 2.0 ** -26, 3 * 2.0 ** -26, 1e-30]),
                        rng.standard_normal(4000).astype(np.float32) * 1000])
    x = np.concatenate([x, -x])
    x = x[np.abs(x) < 65520]
    x = np.concatenate([x, np.zeros(-x.size % 256, np.float32)]).reshape(-1, 1, 256)
    R = x.shape[0]
    codes = np.full((R, 1, 1, 512), 0xFF, np.uint8)
    _launch(mod, "kv_append", ((2 * R + 7) // 8, 1, 1), (256, 1, 1), x, x, 0, 256, 256, codes, codes.copy(),
            0, 0, 0, np.zeros(R, np.int32), err, 0, 1, 1, R, 1, 1, 256, -1, 1, 0)
    assert (err == 0).all()
    np.testing.assert_array_equal(codes.view(np.uint16).reshape(-1), x.astype(np.float16).view(np.uint16).reshape(-1))


@pytest.mark.parametrize("style,rotary_dim,dtype", [("neox", 64, "float32"), ("norm", 48, "float32"),
                                                    ("neox", 32, "float16")])
def test_rope_matches_apply_rope(style, rotary_dim, dtype, rng):
    mod = kernels.load("rope")
    M, hq, hk, D = 3, 4, 2, 64
    dt_id, dt = IN_DTYPES[dtype]
    q = rng.standard_normal((M, hq + 1, D)).astype(dt)[:, :hq]   # strided heads
    k = rng.standard_normal((M, hk, D)).astype(dt)
    lengths = np.array([0, 7, 100000], np.int32)
    offset, theta = 1, 10000.0
    pos = lengths.astype(np.int64) + offset
    ref_q = kvcore.apply_rope(q.astype(np.float32), pos, theta=theta, style=style, rotary_dim=rotary_dim)
    ref_k = kvcore.apply_rope(k.astype(np.float32), pos, theta=theta, style=style, rotary_dim=rotary_dim)
    isz = q.dtype.itemsize
    _launch(mod, "kv_rope", (M, 1, 1), (128, 1, 1), q, dt_id, q.strides[0] // isz, q.strides[1] // isz, hq,
            k, dt_id, k.strides[0] // isz, k.strides[1] // isz, hk, lengths, offset, rotary_dim,
            int(style == "neox"), ctypes.c_double(math.log2(theta)))
    if dtype == "float32":
        np.testing.assert_allclose(q, ref_q, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(k, ref_k, rtol=1e-6, atol=1e-6)
    else:
        np.testing.assert_allclose(q.astype(np.float32), ref_q, rtol=2e-3, atol=1e-3)
        np.testing.assert_allclose(k.astype(np.float32), ref_k, rtol=2e-3, atol=1e-3)


def _heads_per_block(group):
    return next(b for b in (8, 4, 2, 1) if group % b == 0)


def run_attention(fmt, D, group, Hkv, lengths, N, nsplit, rng, *, extra=0, seed=0, q_dtype="float32",
                  window=None, sink_tokens=0, sinks=None, softcap=None):
    """Launches kv_attn_<fmt> (and the merge) over a cache made with kvcore.quantize, with
    the variants of docs/variants.md (the query of slot m at its last position); returns
    (out, the float64 reference)."""
    f = get_format(fmt)
    M, Hq, GB = len(lengths), Hkv * group, _heads_per_block(group)
    kx = rng.standard_normal((M, Hkv, N, D)).astype(np.float32) * 2
    vx = rng.standard_normal((M, Hkv, N, D)).astype(np.float32)
    slots = []
    for x in (kx, vx):
        codes, scales = kvcore.quantize(x, fmt)
        slots.append(([np.ascontiguousarray(codes[m]) for m in range(M)],
                      [np.ascontiguousarray(scales[m]) for m in range(M)] if scales is not None else None,
                      kvcore.dequantize(codes, scales, fmt).astype(np.float64)))
    ptrs = [np.array([a.ctypes.data for a in s[0]], np.uint64) for s in slots]
    sptrs = [np.array([a.ctypes.data for a in s[1]] if s[1] else [0] * M, np.uint64) for s in slots]
    dt_id, dt = IN_DTYPES[q_dtype]
    q = rng.standard_normal((M, Hq, D)).astype(dt)
    lens = np.array(lengths, np.int32)
    out = np.full((M, Hq, D), np.nan, np.float32)
    ws_o = np.full((M, Hq, nsplit, D), np.nan, np.float32)
    ws_lse = np.full((M, Hq, nsplit), np.nan, np.float32)
    scale = 1.0 / math.sqrt(D)
    mod = kernels.load(f"attention_{fmt}")
    sinks32 = None if sinks is None else np.asarray(sinks, np.float32)
    dn = D if D in (64, 128, 256) else "x"   # other head_dims: the run-time-D instance
    _launch(mod, f"kv_attn_{fmt}_d{dn}_g{GB}", (nsplit, Hkv * group // GB, M), (128, 1, 1),
            ptrs[0], ptrs[1], sptrs[0], sptrs[1], 0, lens, extra, N, D, q, dt_id, Hq, group,
            ctypes.c_float(scale * LOG2E), out, 0, ws_o, ws_lse, window or 0, sink_tokens,
            ctypes.c_float(np.float32((softcap or 0.0) * LOG2E)),
            0 if sinks32 is None else sinks32, seed=seed)
    if nsplit > 1:
        _launch(kernels.load("attention"), "kv_attn_merge", (M * Hq, 1, 1), (D, 1, 1), ws_o, ws_lse, out,
                0, nsplit, D, seed=seed)
    K, V = slots[0][2], slots[1][2]
    ref = np.zeros((M, Hq, D))
    qf = q.astype(np.float64)
    for m in range(M):
        n = max(0, min(lengths[m] + extra, N))
        if n:
            ref[m] = reference_attention(qf[m], K[m, :, :n].transpose(1, 0, 2),
                                         V[m, :, :n].transpose(1, 0, 2), scale=scale,
                                         window=window, sink_tokens=sink_tokens, sinks=sinks32,
                                         softcap=softcap)
    return out, ref


@pytest.mark.parametrize("fmt,D,group,Hkv,lengths,N,nsplit", [
    ("int8", 128, 4, 2, [77, 0, 32], 128, 1),
    ("q8_0", 64, 2, 1, [300, 1], 320, 3),
    ("f16", 256, 1, 2, [17, 16], 40, 2),
    ("fp8_e4m3", 128, 8, 1, [65], 96, 1),
    ("fp8_e5m2", 64, 1, 1, [64, 63], 64, 4),
    ("bf16", 64, 2, 1, [5], 8, 1),
    ("f32", 128, 1, 1, [40], 40, 2),
])
def test_attention_against_float64(fmt, D, group, Hkv, lengths, N, nsplit, rng):
    out, ref = run_attention(fmt, D, group, Hkv, lengths, N, nsplit, rng, seed=len(lengths))
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("fmt,D", [("int8", 64), ("q8_0", 128), ("q8_0", 256), ("fp8_e4m3", 256), ("bf16", 128)])
def test_attention_full_slots(fmt, D, rng):
    """Slots filled to capacity (plus a pending position, clipped): every slot's codes and
    scales are their own exact-size allocation, so the ASan build (tools/emu_asan.py) sees
    any read past a full slot."""
    N = 96 if D < 256 else 48
    out, ref = run_attention(fmt, D, 2, 2, [N, N - 1], N, 3, rng, extra=1)
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("fmt,D,group,lengths,N,nsplit,window,sink_tokens,softcap,sinks", [
    ("int8", 64, 4, [100, 7, 0], 128, 1, 30, 3, None, None),       # sinks + window, one split
    ("q8_0", 96, 2, [300, 129], 320, 3, 150, 5, 20.0, True),      # split, a sink tile, run-time D
    ("f16", 128, 1, [40, 200], 200, 2, 64, 0, 2.0, True),         # window without sink positions
    ("fp8_e4m3", 64, 8, [90], 96, 1, 100, 4, None, True),         # window past the length
])
def test_attention_variants_against_float64(fmt, D, group, lengths, N, nsplit, window, sink_tokens,
                                            softcap, sinks, rng):
    """The variants of docs/variants.md on the emulated kernel itself (launched directly):
    window, sink positions, sink logits (an empty slot's out is 0), soft-capping, with one
    split and several (the sink logit joins split 0 only)."""
    Hq = 2 * group if fmt != "fp8_e4m3" else group
    s = rng.uniform(-2, 4, Hq).astype(np.float32) if sinks else None
    out, ref = run_attention(fmt, D, group, 2 if fmt != "fp8_e4m3" else 1, lengths, N, nsplit, rng,
                             seed=1, window=window, sink_tokens=sink_tokens, sinks=s,
                             softcap=softcap)
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=2e-5)


def test_attention_seed_independent(rng):
    """A race-free kernel gives the same bits whatever the thread order."""
    outs = [run_attention("int8", 64, 4, 1, [100], 128, 2, np.random.default_rng(1), seed=s)[0]
            for s in (0, 1, 2)]
    assert all((o.view(np.uint32) == outs[0].view(np.uint32)).all() for o in outs)


# ---- the emulator bites --------------------------------------------------------------------------

def test_missing_barrier_race_gives_a_wrong_sum_under_some_seed(cases):
    sums = []
    for seed in range(4):
        out = np.zeros(2, np.int32)
        _launch(cases, "race_sum", (1, 1, 1), (128, 1, 1), out, 0, seed=seed)
        sums.append(int(out[0]))
    assert any(s != 127 * 128 // 2 for s in sums)
    for seed in range(4):
        out = np.zeros(2, np.int32)
        _launch(cases, "race_sum", (1, 1, 1), (128, 1, 1), out, 1, seed=seed)
        assert out[0] == 127 * 128 // 2 and out[1] == 128


def _fault(cases, kernel, *args, block=(128, 1, 1)):
    with pytest.raises(kernels.KernelFault) as e:
        _launch(cases, kernel, (2, 1, 1), block, *args)
    assert e.value.code == "CUDA_ERROR_ILLEGAL_INSTRUCTION"
    assert kernel in e.value.message and "block (" in e.value.message
    return e.value.message


def test_divergent_barrier_faults(cases):
    msg = _fault(cases, "divergent_barrier", np.zeros(128, np.int32))
    assert "divergent barrier" in msg and _site("divergent A") in msg and _site("divergent B") in msg


def test_barrier_after_a_thread_exited_faults(cases):
    msg = _fault(cases, "barrier_after_exit", np.zeros(128, np.int32))
    assert _site("after exit") in msg and "thread (5,0,0)" in msg


def test_shuffle_with_a_missing_lane_faults(cases):
    msg = _fault(cases, "shuffle_missing_lane", np.zeros(128, np.float32))
    assert _site("missing lane") in msg and "lane 7" in msg


def test_deadlock_faults_and_names_every_wait(cases):
    msg = _fault(cases, "deadlock", np.zeros(128, np.float32))
    assert "deadlock" in msg and _site("deadlock shfl") in msg and _site("deadlock bar") in msg


def test_cp_async_destination_is_poison_until_its_wait(cases):
    src = np.arange(1, 9, dtype=np.float32)
    out = np.zeros(16, np.float32)
    _launch(cases, "cp_async_poison", (1, 1, 1), (32, 1, 1), src, out)
    bits = out.view(np.uint32)
    assert (bits[0:4] == POISON32).all()                        # before any wait
    np.testing.assert_array_equal(out[4:8], src[0:4])           # wait_group 1: first group landed
    assert (bits[12:16] == POISON32).all()                      # the second group still pending
    np.testing.assert_array_equal(out[8:12], [5, 6, 0, 0])      # src_bytes 8: zero-filled tail


def test_uninitialised_shared_memory_is_poison_in_every_block(cases):
    out = np.zeros((3, 64), np.uint32)
    _launch(cases, "uninit_shared", (3, 1, 1), (64, 1, 1), out)
    np.testing.assert_array_equal(out[:, :32], np.repeat(np.arange(3, dtype=np.uint32)[:, None], 32, 1))
    assert (out[:, 32:] == POISON32).all()


def test_warp_collectives_exchange_like_the_device(cases, rng):
    n = 64
    pred = (rng.random(n) < 0.5).astype(np.int32)
    pred[32:] = 1  # warp 1: all true
    out = np.zeros((n, 9), np.int32)
    _launch(cases, "collectives", (1, 1, 1), (n, 1, 1), pred, out, seed=5)
    t = np.arange(n)
    lane, wb = t % 32, t - t % 32
    for w in (0, 32):
        p = pred[w:w + 32]
        ballot = int(sum(int(b) << i for i, b in enumerate(p)))
        assert (out[w:w + 32, 0].view(np.uint32) == ballot).all()
        assert (out[w:w + 32, 1] == int(p.any())).all() and (out[w:w + 32, 2] == int(p.all())).all()
    np.testing.assert_array_equal(out[:, 3], (wb + (lane * 7) % 32) * 10)
    np.testing.assert_array_equal(out[:, 4], np.where(lane >= 3, t - 3, t) * 10)
    np.testing.assert_array_equal(out[:, 5], np.where(lane + 5 < 32, t + 5, t) * 10)
    x = lane ^ 5
    np.testing.assert_array_equal(out[:, 6], np.where(x // 8 == lane // 8, wb + x, t) * 10)
    assert (out[:, 7] == pred.sum()).all() and (out[:, 8] == int(pred.all())).all()


def _byte_perm(a, b, s):
    """CUDA's __byte_perm: nvcc masks the selector with 0x7777 before prmt.b32."""
    v = (int(b) << 32) | int(a)
    return sum(((v >> (8 * ((int(s) >> (4 * n)) & 7))) & 0xFF) << (8 * n) for n in range(4))


def test_intrinsics_round_like_the_device(cases, rng):
    x = np.concatenate([np.float32([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 2.0 ** 31, -2.0 ** 31, 3e9, -3e9, np.nan,
                                    np.inf, -np.inf, 65519.0, 65520.0, 1e-8, -0.0]),
                        (rng.standard_normal(1000) * 1e4).astype(np.float32)])
    n = x.size
    a = rng.integers(0, 2 ** 32, n, dtype=np.uint32)
    b = rng.integers(0, 2 ** 32, n, dtype=np.uint32)
    sel = rng.integers(0, 2 ** 32, n, dtype=np.uint32)  # high bits and bit 3 of nibbles: ignored
    f2i, perm, h = np.zeros(n, np.int32), np.zeros(n, np.uint32), np.zeros(n, np.uint16)
    _launch(cases, "intrinsics", (3, 1, 1), (96, 1, 1), x, a, b, sel, f2i, perm, h, n)
    with np.errstate(invalid="ignore"):
        want = np.clip(np.rint(x.astype(np.float64)), -2.0 ** 31, 2.0 ** 31 - 1)
    want = np.where(np.isnan(x), 0, want).astype(np.int64)
    np.testing.assert_array_equal(f2i, want)
    np.testing.assert_array_equal(perm, [_byte_perm(*t) for t in zip(a, b, sel)])
    with np.errstate(over="ignore"):
        h_want = x.astype(np.float16).view(np.uint16)
    h_want = np.where(np.isnan(x), 0x7FFF, h_want)
    np.testing.assert_array_equal(h, h_want)


def test_atomics_are_serialised(cases):
    n = np.zeros(1, np.uint64)
    _launch(cases, "atomic_count", (7, 2, 1), (96, 1, 1), n)
    assert n[0] == 7 * 2 * 96
