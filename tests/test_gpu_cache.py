"""GpuKVCache and the layer under it, on a device or under the emulator (--gpu, conftest.py).

The reference is the CPU: kvcore.quantize for codes and scales, KVCache and
KVCache.snapshot / restore for layouts. Device memory is poisoned (0xA5) before
kernels run, so a byte a kernel should not write is caught."""
import ctypes

import numpy as np
import pytest

import kvcore
from kvcore.gpu.cache import GPU_FORMATS, GPU_PAIRS   # the formats and K/V pairs the GPU kernels hold
from kvcore import (CapacityError, FORMATS, FormatError, KVCache, KVSpec, NonFiniteError,
                    OutOfRangeError, ShapeError, SnapshotError, SpecError, StateError, quantize)

pytestmark = pytest.mark.gpu

ml_dtypes = pytest.importorskip("ml_dtypes")
POISON = 0xA5
IN_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


@pytest.fixture(scope="module")
def gpu():
    from kvcore import gpu
    return gpu


def rows(rng, shape, dtype, fmt="f32"):
    """Head rows with scales spread over 2^-12..2^12 and the edge rows: all zeros, signed
    zeros, tiny values, and a row of quarter steps (many exact halves after scaling)."""
    x = rng.standard_normal(shape) * np.exp2(rng.uniform(-12, 12, shape[:-1] + (1,)))
    flat = x.reshape(-1, shape[-1])
    if flat.shape[0] >= 4:
        flat[0] = 0.0
        flat[1] = -0.0
        flat[1, ::3] = 0.0
        flat[2] *= 1e-30
        d = shape[-1]
        flat[3] = (np.arange(d) % 64 - 31.5) * 0.25
    return x.astype(np.float32).astype(dtype)


def dev(gpu, x):
    """A device copy of numpy x, as a DeviceArray of x's dtype and shape."""
    buf = gpu.DeviceBuffer.from_numpy(x)
    return buf.view(x.shape, x.dtype)


def raw(fmt, a):
    return np.ascontiguousarray(a).view(FORMATS[fmt].code_dtype)


def poisoned(shape, dtype):
    return np.full(int(np.prod(shape)) * np.dtype(dtype).itemsize, POISON, np.uint8).view(dtype).reshape(shape)


def new_cache(gpu, spec, slots):
    cache = gpu.GpuKVCache(spec, slots)
    cache._data.fill(POISON)
    return cache


def device_state(cache, layer):
    out = [cache.keys(layer).to_numpy(), cache.values(layer).to_numpy()]
    if cache.spec.fmt.quantized:
        out += [cache.key_scales(layer).to_numpy(), cache.value_scales(layer).to_numpy()]
    return out


# ------------------------------------------------------------------ driver and memory

def test_context_and_properties(gpu):
    ctx = gpu.Context.get()
    assert ctx.sm_count > 0 and ctx.compute_capability >= (8, 0) and ctx.name
    free, total = ctx.mem_get_info()
    assert 0 < free <= total


def test_cuda_error_names_call_and_result(gpu):
    with pytest.raises(kvcore.CudaError, match=r"^cuMemAlloc: CUDA_ERROR_OUT_OF_MEMORY: out of memory"):
        gpu.DeviceBuffer.alloc(1 << 52)


def test_device_buffer_copies_free_and_accounting(gpu, rng):
    ctx = gpu.Context.get()
    before = ctx.live_bytes
    x = rng.standard_normal(1000).astype(np.float32)
    buf = gpu.DeviceBuffer.from_numpy(x)
    assert ctx.live_bytes == before + x.nbytes == before + buf.nbytes
    out = np.empty_like(x)
    buf.copy_to_host(out)
    assert np.array_equal(out, x)
    s = gpu.Stream.create()
    y = rng.standard_normal(1000).astype(np.float32)
    buf.copy_from_host(y, stream=s)
    out2 = np.empty_like(y)
    buf.copy_to_host(out2, stream=s)
    s.synchronize()
    assert np.array_equal(out2, y)
    assert np.array_equal(buf.view((10, 100), np.float32, offset=0).to_numpy(), y.reshape(10, 100))
    with pytest.raises(ShapeError, match="invalid view"):
        buf.view((1001,), np.float32)
    with pytest.raises(ShapeError, match="outside the buffer"):
        buf.copy_from_host(np.zeros(1001, np.float32))
    v = buf.view((1000,), np.float32)
    buf.free()
    buf.free()  # idempotent
    assert ctx.live_bytes == before
    with pytest.raises(StateError, match="freed DeviceBuffer"):
        buf.ptr
    with pytest.raises(StateError, match="freed DeviceBuffer"):
        buf.copy_to_host(out)
    with pytest.raises(StateError, match="freed DeviceBuffer"):
        v.to_numpy()
    s.destroy()


def test_events_time_a_copy(gpu):
    s = gpu.Stream.create()
    a, b = gpu.Event.create(), gpu.Event.create()
    buf = gpu.DeviceBuffer.alloc(1 << 24)
    a.record(stream=s)
    buf.fill(1, stream=s)
    b.record(stream=s)
    b.synchronize()
    assert a.elapsed_ms(b) > 0
    buf.free()
    for e in (a, b):
        e.destroy()
    s.destroy()


# ------------------------------------------------------------------ encoders: bit equality

def _check_against_cpu(gpu, fmt, in_dtype, D, rng, slots=4, L=2, H=3, N=9):
    spec = KVSpec(num_layers=L, num_kv_heads=H, head_dim=D, capacity=N, format=fmt)
    f = spec.fmt
    cache = new_cache(gpu, spec, slots)
    S = f.scales_per_row(D)
    exp = [[poisoned((slots, H, N, f.code_width(D)), f.code_dtype) for _ in range(2)] for _ in range(L)]
    exps = [[poisoned((slots, H, N, S), f.scale_dtype) for _ in range(2)] for _ in range(L)] if f.quantized else None
    keep = []

    def expect(layer, which, x, slot_pos):
        codes, scales = quantize(x, fmt)
        for i, (slot, pos) in enumerate(slot_pos):
            exp[layer][which][slot, :, pos] = raw(fmt, codes[i])
            if exps is not None:
                exps[layer][which][slot, :, pos] = scales[i]

    for t in range(3):  # three batched steps: one position for every slot
        for layer in range(L):
            k, v = rows(rng, (slots, H, D), in_dtype), rows(rng, (slots, H, D), in_dtype)
            keep += [dev(gpu, k), dev(gpu, v)]
            cache.append(layer, keep[-2], keep[-1])
            expect(layer, 0, k, [(s, t) for s in range(slots)])
            expect(layer, 1, v, [(s, t) for s in range(slots)])
        cache.advance()
    T = 5  # then T positions into one slot
    for layer in range(L):
        k, v = rows(rng, (T, H, D), in_dtype), rows(rng, (T, H, D), in_dtype)
        keep += [dev(gpu, k), dev(gpu, v)]
        cache.append(layer, keep[-2], keep[-1], slot=slots - 1)
        expect(layer, 0, k, [(slots - 1, 3 + i) for i in range(T)])
        expect(layer, 1, v, [(slots - 1, 3 + i) for i in range(T)])
    cache.advance(slot=slots - 1, steps=T)
    cache.check()
    assert list(cache.lengths_host()) == [3] * (slots - 1) + [3 + T]
    for layer in range(L):
        got = device_state(cache, layer)
        want = exp[layer] + (exps[layer] if exps is not None else [])
        for g, w in zip(got, want):
            assert g.view(np.uint8).tobytes() == w.view(np.uint8).tobytes()
    cache.free()


@pytest.mark.parametrize("fmt", GPU_FORMATS)
@pytest.mark.parametrize("in_dtype", list(IN_DTYPES))
def test_append_equals_cpu_encoder(gpu, fmt, in_dtype, rng):
    _check_against_cpu(gpu, fmt, IN_DTYPES[in_dtype], 64, rng)


@pytest.mark.parametrize("fmt, D", [(f, d) for f in GPU_FORMATS for d in (1, 40, 96, 256)
                                     if d % (FORMATS[f].block or 1) == 0])  # q8_0, q4_*: D % 32 == 0
def test_append_equals_cpu_encoder_head_dims(gpu, fmt, D, rng):
    _check_against_cpu(gpu, fmt, np.float32, D, rng, slots=5, L=1, H=2, N=12)


def q4_blocks(fmt, rng):
    """Blocks of 32 float32 values [B, 32] for the 4-bit encoders' edges: signed zeros,
    ties of |max| (q4_0 takes the first) and of min / max (q4_1 the last), codes at exact
    truncation ties (x * id + 8.5, (x - min) * id + 0.5 on a whole number), d = 0,
    subnormal d (1 / d past float32, or huge and inexact), the largest values below the
    format's limit, and random blocks over 2^-140..2^18, a multiple of 4 in all."""
    lim = np.float32(kvcore.quant.Q4_0_LIMIT if fmt == "q4_0" else kvcore.quant.Q4_1_LIMIT)
    top = np.nextafter(lim, np.float32(0))
    j = np.arange(32.0)
    z = np.zeros(32)
    crafted = [
        z, -z, np.where(j % 3 == 0, -0.0, 0.0), np.where(j % 3 == 2, -0.0, 0.0),
        np.r_[-3.0, 3.0, z[2:]], np.r_[3.0, -3.0, z[2:]], np.r_[z[:5], 2.0, -2.0, z[7:]],
        np.r_[-8.0, j[1:] / 2 - 8], np.r_[8.0, 8 - j[1:] / 2],     # q4_0: d = -1 / 1, all halves
        np.r_[0.0, 15.0, j[2:] / 2],                               # q4_1: d = 1, all halves
        np.full(32, 5.0), np.full(32, -1e-45), np.r_[7.0, np.full(31, -0.0)],
        (j - 16) * 1e-40, (j - 16) * 3e-39, (j - 17) * 2**-127, j * 1e-45,    # subnormal d
        np.r_[top, -top, (j[2:] - 16) * 1e4], np.r_[-top, top, j[2:]], np.r_[top, z[1:]],
        np.full(32, -top), np.r_[(j[:16] - 8) * top / 8, z[16:]],
    ]
    n = 64 + -len(crafted) % 4  # whole rows of 2 heads x 64 values
    rand = rng.standard_normal((n, 32)) * np.exp2(rng.uniform(-140, 18, (n, 1)))
    x = np.concatenate([np.array(crafted), rand]).astype(np.float32)
    return np.clip(x, -top, top)


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1"])
def test_q4_append_equals_cpu_on_edge_blocks(gpu, fmt, rng):
    """The device q4_0 / q4_1 encoders bit for bit against kvcore.quantize over q4_blocks
    (K) and their negations (V); the limit itself, of either sign, is refused."""
    x = q4_blocks(fmt, rng).reshape(-1, 2, 64)
    T = x.shape[0]
    spec = KVSpec(num_layers=1, num_kv_heads=2, head_dim=64, capacity=T, format=fmt)
    cache = new_cache(gpu, spec, 2)
    cache.append(0, dev(gpu, x), dev(gpu, -x), slot=0)
    cache.advance(slot=0, steps=T)
    cache.check()
    snap = cache.snapshot(0)
    for codes, scales, src in ((snap.k_codes, snap.k_scales, x), (snap.v_codes, snap.v_scales, -x)):
        want_codes, want_scales = quantize(src, fmt)
        assert codes[0].tobytes() == want_codes.tobytes()
        assert scales[0].view(np.uint16).tobytes() == want_scales.view(np.uint16).tobytes()
    lim = np.float32(kvcore.quant.Q4_0_LIMIT if fmt == "q4_0" else kvcore.quant.Q4_1_LIMIT)
    for bad in (lim, -lim):
        y = x[:1].copy()
        y[0, 1, 40] = bad
        cache.append(0, dev(gpu, y), dev(gpu, x[:1]), slot=1)
        cache.advance(slot=1)
        with pytest.raises(FormatError, match=f"slot 1: a value out of range of format {fmt}"):
            cache.check()
    assert list(cache.lengths_host()) == [T, 0]
    cache.free()


@pytest.mark.parametrize("fmt", GPU_PAIRS)
def test_pair_appends_and_snapshots_equal_the_cpu_cache(gpu, fmt, rng):
    """K and V in two formats: batched and one-slot appends store each side's
    kvcore.quantize codes (the CPU cache's snapshot, bit for bit), a CPU snapshot restores
    into a slot, each side's views have its format's shapes, and a value past V's limit
    (not K's) is refused naming both sides."""
    spec = KVSpec(num_layers=2, num_kv_heads=2, head_dim=96, capacity=12, format=fmt)
    cache = new_cache(gpu, spec, 3)
    cpus = [KVCache(spec) for _ in range(3)]
    keep = _append_steps(gpu, cache, dict(enumerate(cpus)), rng, steps=2)
    for layer in range(2):
        k, v = rows(rng, (5, 2, 96), np.float16), rows(rng, (5, 2, 96), np.float16)
        keep += [dev(gpu, k), dev(gpu, v)]
        cache.append(layer, keep[-2], keep[-1], slot=2)
        cpus[2].append(layer, k, v)
    cache.advance(slot=2, steps=5)
    cpus[2].advance()
    cache.check()
    for s in range(3):
        _same(cache.snapshot(s), cpus[s].snapshot())
    cache.restore(cpus[2].snapshot(), 0)
    _same(cache.snapshot(0), cpus[2].snapshot())
    kf, vf = spec.k_fmt, spec.v_fmt
    assert cache.keys(1).shape == (3, 2, 12, kf.code_width(96)) and cache.keys(1).dtype == kf.code_dtype
    assert cache.values(1).shape == (3, 2, 12, 48) and cache.value_scales(1).shape == (3, 2, 12, 3)
    if not kf.quantized:
        with pytest.raises(FormatError, match=rf"format {kf.name} has no scales \(K of {fmt}\)"):
            cache.key_scales(0)
    big = rows(rng, (3, 2, 96), np.float32)
    v = big.copy()
    v[1, 0, 5] = 6e5       # past q4_0's 524160, within K's range only for the K side
    cache.append(0, dev(gpu, big), dev(gpu, v))
    cache.advance()
    with pytest.raises(FormatError, match=rf"slot 1: a value out of range of format {fmt} "
                                          rf"\(K {kf.name}, V q4_0\).*\|v\| >= 524160"):
        cache.check()
    assert list(cache.lengths_host()) == [8, 2, 8]   # slot 1 refused, the others committed
    cache.free()


def test_append_reads_strided_input(gpu, rng):
    spec = KVSpec(num_layers=1, num_kv_heads=2, head_dim=64, capacity=4, format="int8")
    cache = new_cache(gpu, spec, 3)
    big = rows(rng, (3, 5, 64), np.float32)  # heads 0 and 2 of 5: strides (5*64*4, 2*64*4, 4)
    buf = gpu.DeviceBuffer.from_numpy(big)
    k = gpu.DeviceArray(buf.ctx, buf.ptr, (3, 2, 64), np.float32, owner=buf,
                        strides=(5 * 64 * 4, 2 * 64 * 4, 4))
    cache.append(0, k, k)
    cache.advance()
    cache.check()
    codes, scales = quantize(big[:, ::2][:, :2], "int8")
    assert np.array_equal(cache.keys(0).to_numpy()[:, :, 0], codes)
    assert np.array_equal(cache.value_scales(0).to_numpy()[:, :, 0], scales)
    cache.free()


# ------------------------------------------------------------------ errors on the device

def test_capacity_flag_writes_nothing(gpu, rng):
    spec = KVSpec(num_layers=2, num_kv_heads=2, head_dim=32, capacity=3, format="fp8_e4m3")
    cache = new_cache(gpu, spec, 2)
    x = dev(gpu, rows(rng, (2, 2, 32), np.float32))
    for _ in range(3):
        for layer in range(2):
            cache.append(layer, x, x)
        cache.advance()
    cache.check()
    before = [device_state(cache, l) for l in range(2)]
    cache.append(0, x, x)  # every slot is full
    cache.advance()
    with pytest.raises(CapacityError, match="would pass capacity 3"):
        cache.check()
    cache.check()  # cleared
    assert list(cache.lengths_host()) == [3, 3]
    cache.truncate(1, 1)
    y = dev(gpu, rows(rng, (3, 2, 32), np.float32))
    cache.append(0, y, y, slot=1)  # 1 + 3 > 3: all T rows or none
    cache.advance(slot=1, steps=3)
    with pytest.raises(CapacityError, match=r"1 slot\(s\) \(slot 1: capacity 3 reached\)"):
        cache.synchronize()
    after = [device_state(cache, l) for l in range(2)]
    for a, b in zip(before, after):
        for p, q in zip(a, b):
            assert p.tobytes() == q.tobytes()
    assert list(cache.lengths_host()) == [3, 1]
    cache.append(0, x, x)  # slot 1 has room, slot 0 does not: only slot 1 is written
    cache.append(1, x, x)
    cache.advance()
    with pytest.raises(CapacityError, match=r"\(slot 0: capacity 3 reached\)"):
        cache.check()
    assert list(cache.lengths_host()) == [3, 2]
    for layer in range(2):
        for p, q in zip(before[layer], device_state(cache, layer)):
            assert p[0].tobytes() == q[0].tobytes()
    cache.free()


def test_nonfinite_input_is_not_committed(gpu, rng):
    spec = KVSpec(num_layers=1, num_kv_heads=2, head_dim=32, capacity=4, format="q8_0")
    cache = new_cache(gpu, spec, 2)
    x = rows(rng, (2, 2, 32), np.float32)
    x[1, 1, 7] = np.nan
    cache.append(0, dev(gpu, x), dev(gpu, rows(rng, (2, 2, 32), np.float32)))
    cache.advance()
    with pytest.raises(NonFiniteError, match=r"slot 1: non-finite input"):
        cache.check()
    assert list(cache.lengths_host()) == [1, 0]  # slot 0's step committed
    big = rows(rng, (2, 2, 32), np.float32)
    big[0, 0, 0] = 1e7  # >= Q8_0_LIMIT: its float16 scale would be inf
    cache.append(0, dev(gpu, big), dev(gpu, big))
    cache.advance()
    with pytest.raises(FormatError, match="slot 0: a value out of range of format q8_0"):
        cache.check()
    assert list(cache.lengths_host()) == [1, 1]
    cache.free()


@pytest.mark.parametrize("fmt, limit_bits", [("f16", 0x477FF000), ("bf16", 0x7F7F8000)])
def test_values_past_the_half_range_are_not_committed(gpu, rng, fmt, limit_bits):
    # as on the CPU: the value would round to infinity, so the step is refused
    limit = np.uint32(limit_bits).view(np.float32)
    spec = KVSpec(num_layers=1, num_kv_heads=2, head_dim=32, capacity=4, format=fmt)
    cache = new_cache(gpu, spec, 2)
    x = rows(rng, (2, 2, 32), np.float32)
    x[1, 0, 31] = -limit
    cache.append(0, dev(gpu, x), dev(gpu, x))
    cache.advance()
    with pytest.raises(FormatError, match=f"out of range of format {fmt}"):
        cache.check()
    assert list(cache.lengths_host()) == [1, 0]  # only slot 1 was refused
    cache.reset()
    x[1, 0, 31] = np.nextafter(-limit, np.float32(0))  # the largest value below is taken
    cache.append(0, dev(gpu, x), dev(gpu, x))
    cache.advance()
    cpu = KVCache(KVSpec(num_layers=1, num_kv_heads=2, head_dim=32, capacity=1, format=fmt))
    for slot in range(2):
        cpu.reset()
        cpu.append(0, x[slot], x[slot])
        cpu.advance()
        _same(cache.snapshot(slot), cpu.snapshot())
    cache.free()


def test_append_validates(gpu, rng):
    spec = KVSpec(num_layers=2, num_kv_heads=2, head_dim=32, capacity=4, format="int8")
    cache = gpu.GpuKVCache(spec, 3)
    ok = dev(gpu, rows(rng, (3, 2, 32), np.float32))
    with pytest.raises(ShapeError, match=r"invalid shape of k: expected \[3, 2, 32\], got \[2, 2, 32\]"):
        cache.append(0, dev(gpu, rows(rng, (2, 2, 32), np.float32)), ok)
    with pytest.raises(kvcore.DTypeError, match="invalid dtype of k"):
        cache.append(0, dev(gpu, np.zeros((3, 2, 32), np.float64)), ok)
    with pytest.raises(OutOfRangeError, match="layer 2 out of range"):
        cache.append(2, ok, ok)
    with pytest.raises(ShapeError, match="with 1 <= T <= 4"):
        big = dev(gpu, rows(rng, (5, 2, 32), np.float32))
        cache.append(0, big, big, slot=0)
    with pytest.raises(kvcore.DTypeError, match="invalid type of k"):
        cache.append(0, np.zeros((3, 2, 32), np.float32), ok)
    with pytest.raises(OutOfRangeError, match="n 2 out of range"):
        cache.truncate(0, 2)
    cache.check()
    assert list(cache.lengths_host()) == [0, 0, 0]
    cache.free()


# ------------------------------------------------------------------ snapshots and scatter

def _cpu_cache(spec, rng, n):
    cpu = KVCache(spec)
    for _ in range(n):
        for layer in range(spec.num_layers):
            shape = (1, spec.num_kv_heads, spec.head_dim)
            cpu.append(layer, rows(rng, shape, np.float32), rows(rng, shape, np.float32))
        cpu.advance()
    return cpu


def _append_steps(gpu, cache, cpus, rng, steps):
    """`steps` decode steps of random float32 rows into every slot and layer of `cache`,
    slot s's rows appended to cpus[s] too (a dict slot -> KVCache); returns the device
    inputs, which must stay alive until the stream ran."""
    spec, keep = cache.spec, []
    shape = (cache.slots, spec.num_kv_heads, spec.head_dim)
    for _ in range(steps):
        for layer in range(spec.num_layers):
            k, v = rows(rng, shape, np.float32), rows(rng, shape, np.float32)
            keep += [dev(gpu, k), dev(gpu, v)]
            cache.append(layer, keep[-2], keep[-1])
            for s, cpu in cpus.items():
                cpu.append(layer, k[s:s + 1], v[s:s + 1])
        cache.advance()
        for cpu in cpus.values():
            cpu.advance()
    return keep


def _same(a, b):
    assert a.length == b.length
    for name in ("k_codes", "v_codes", "k_scales", "v_scales"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None)
        if x is not None:
            assert x.dtype == y.dtype and x.shape == y.shape
            assert x.view(np.uint8).tobytes() == y.view(np.uint8).tobytes()


@pytest.mark.parametrize("fmt", GPU_FORMATS)
def test_snapshots_move_between_cpu_and_gpu(gpu, fmt, rng):
    spec = KVSpec(num_layers=3, num_kv_heads=2, head_dim=64, capacity=20, format=fmt)
    cpu = _cpu_cache(spec, rng, 11)
    snap = cpu.snapshot()
    cache = new_cache(gpu, spec.replace(capacity=33), 3)
    cache.restore(snap, 1)
    assert list(cache.lengths_host()) == [0, 11, 0]
    _same(cache.snapshot(1), snap)
    assert cache.snapshot(0).length == 0
    # GPU appends land where the CPU cache puts the same rows
    cpu2 = KVCache(spec)
    keep = _append_steps(gpu, cache, {2: cpu2}, rng, steps=4)
    g = cache.snapshot(2)
    _same(g, cpu2.snapshot())
    cpu.restore(g)  # back to a CPU cache
    _same(cpu.snapshot(), cpu2.snapshot())
    with pytest.raises(SnapshotError):
        cache.restore(KVCache(spec.replace(head_dim=32)).snapshot(), 0)
    cache.free()


def test_scatter_from_a_one_slot_cache(gpu, rng):
    spec = KVSpec(num_layers=2, num_kv_heads=2, head_dim=32, capacity=16, format="int8")
    src = new_cache(gpu, spec.replace(capacity=8), 1)
    src.restore(_cpu_cache(spec, rng, 7).snapshot(), 0)
    dst = new_cache(gpu, spec, 3)
    dst.scatter(src, 2)
    assert list(dst.lengths_host()) == [0, 0, 7]
    _same(dst.snapshot(2), src.snapshot(0))
    other = _cpu_cache(spec, rng, 5).snapshot()
    dst.scatter(other, 0, layer=1)  # one layer from a CPU snapshot
    got = dst.snapshot(0)
    assert got.length == 5
    assert np.array_equal(got.k_codes[1], other.k_codes[1])
    assert np.array_equal(got.v_scales[1], other.v_scales[1])
    with pytest.raises(ShapeError, match="one-slot"):
        src.scatter(dst, 0)
    src.free()
    dst.free()


# ------------------------------------------------------------------ pointers, views, interop

def test_pointer_tables_and_views(gpu):
    spec = KVSpec(num_layers=3, num_kv_heads=2, head_dim=32, capacity=8, format="q8_0")
    cache = gpu.GpuKVCache(spec, 4)
    for layer in range(3):
        want = [cache.k_ptr(layer, s) for s in range(4)]
        assert list(cache.k_ptrs(layer).to_numpy()) == want
        assert list(cache.v_ptrs(layer).to_numpy()) == [cache.v_ptr(layer, s) for s in range(4)]
        assert list(cache.k_scale_ptrs(layer).to_numpy()) == [cache.k_scale_ptr(layer, s) for s in range(4)]
        assert list(cache.v_scale_ptrs(layer).to_numpy()) == [cache.v_scale_ptr(layer, s) for s in range(4)]
        assert cache.keys(layer).ptr == want[0]
        assert want[1] - want[0] == 2 * 8 * 32
    assert cache.keys(0).shape == (4, 2, 8, 32) and cache.key_scales(0).shape == (4, 2, 8, 1)
    assert cache.lengths.dtype == np.int32 and cache.lengths.shape == (4,)
    f16 = gpu.GpuKVCache(spec.replace(format="f16"), 2)
    with pytest.raises(kvcore.FormatError, match="has no scales"):
        f16.k_scale_ptr(0, 0)
    assert list(f16.k_scale_ptrs(0).to_numpy()) == [0, 0]
    cache.free()
    f16.free()


class _Producer:
    """A foreign device array as torch or CuPy export one: written on the producer's own
    non-blocking stream (still pending when handed over), exported through CAI v3 with that
    stream, or through DLPack only (then `__dlpack__(stream=s)` orders s after its work, as
    the DLPack spec asks of a producer)."""

    def __init__(self, gpu, x, *, cai: bool):
        self.gpu, self.cai = gpu, cai
        self.host = np.ascontiguousarray(x)  # alive until the copy ran
        self.buf = gpu.DeviceBuffer.alloc(x.nbytes)
        self.stream = gpu.Stream.create(non_blocking=True)
        self.buf.copy_from_host(self.host, stream=self.stream)
        self.arr = self.buf.view(x.shape, x.dtype)

    @property
    def __cuda_array_interface__(self):
        if not self.cai:
            raise AttributeError("__cuda_array_interface__")
        return dict(self.arr.__cuda_array_interface__, stream=self.stream.ptr)

    def __dlpack_device__(self):
        return self.arr.__dlpack_device__()

    @property
    def __dlpack__(self):
        if self.cai:  # CAI only: kvcore prefers DLPack when a producer has both
            raise AttributeError("__dlpack__")
        return self._dlpack

    def _dlpack(self, *, stream=None, **kwargs):
        if stream is not None and stream != -1:
            ev = self.gpu.Event.create(timing=False)
            ev.record(stream=self.stream)
            with ev.ctx:
                self.gpu.driver.call("cuStreamWaitEvent", self.gpu.driver.stream_handle(int(stream)), ev.handle, 0)
            ev.destroy()
        return self.arr.__dlpack__()

    def free(self):
        self.stream.synchronize()
        self.stream.destroy()
        self.buf.free()


@pytest.mark.parametrize("in_dtype", ["float16", "bfloat16"])
def test_append_waits_for_a_foreign_producer_stream(gpu, in_dtype, rng):
    # float16 through CAI v3 (its "stream" entry), bfloat16 through DLPack (its stream
    # argument): the cache's stream must wait for the producer's pending copy
    spec = KVSpec(num_layers=1, num_kv_heads=2, head_dim=32, capacity=8, format="int8")
    cache = new_cache(gpu, spec, 3)
    x = rows(rng, (2, 3, 2, 32), IN_DTYPES[in_dtype])
    k, v = (_Producer(gpu, x[i], cai=in_dtype == "float16") for i in range(2))
    cache.append(0, k, v)
    cache.advance()
    cache.check()
    for i, (name, scale_name) in enumerate((("keys", "key_scales"), ("values", "value_scales"))):
        codes, scales = quantize(x[i].astype(np.float32), "int8")
        assert np.array_equal(getattr(cache, name)(0).to_numpy()[:, :, 0], codes)
        assert np.array_equal(getattr(cache, scale_name)(0).to_numpy()[:, :, 0], scales)
    k.free()
    v.free()
    cache.free()


@pytest.mark.device
def test_dlpack_and_cai_with_torch(gpu, rng):
    torch = pytest.importorskip("torch")
    spec = KVSpec(num_layers=1, num_kv_heads=2, head_dim=32, capacity=8, format="int8")
    cache = new_cache(gpu, spec, 3)
    t = torch.from_dlpack(cache.keys(0))
    assert t.device.type == "cuda" and t.dtype == torch.int8 and tuple(t.shape) == (3, 2, 8, 32)
    assert t.data_ptr() == cache.k_ptr(0, 0)
    t[1, 0, 2].fill_(7)
    torch.cuda.synchronize()
    assert (cache.keys(0).to_numpy()[1, 0, 2] == 7).all()
    s = torch.from_dlpack(cache.key_scales(0))
    assert s.dtype == torch.float32 and s.data_ptr() == cache.k_scale_ptr(0, 0)
    # torch tensors as append input: bfloat16 through DLPack, float16 through CAI
    for dtype in (torch.bfloat16, torch.float16):
        k = torch.randn(3, 2, 32, device="cuda", dtype=dtype) * 3
        v = torch.randn(3, 2, 32, device="cuda", dtype=dtype)
        cache.append(0, k, v)
        cache.advance()
        cache.check()
        n = cache.length(0) - 1
        codes, scales = quantize(k.float().cpu().numpy(), "int8")
        assert np.array_equal(cache.keys(0).to_numpy()[:, :, n], codes)
        assert np.array_equal(cache.key_scales(0).to_numpy()[:, :, n], scales)
    del t, s
    cache.free()


@pytest.mark.device
def test_dlpack_and_cai_with_cupy(gpu):
    cp = pytest.importorskip("cupy")
    spec = KVSpec(num_layers=1, num_kv_heads=2, head_dim=32, capacity=8, format="f16")
    cache = new_cache(gpu, spec, 2)
    a = cp.from_dlpack(cache.values(0))
    assert a.dtype == cp.float16 and a.shape == (2, 2, 8, 32)
    assert a.data.ptr == cache.v_ptr(0, 0)
    b = cp.asarray(cache.lengths)  # __cuda_array_interface__
    assert b.data.ptr == cache.lengths.ptr
    a[0, 1, 3] = 1.5
    cp.cuda.Device().synchronize()
    assert (cache.values(0).to_numpy()[0, 1, 3] == np.float16(1.5)).all()
    x = cp.asarray(np.arange(2 * 2 * 32, dtype=np.float32).reshape(2, 2, 32) / 7)
    cache.append(0, x, x)
    cache.advance()
    cache.check()
    assert np.array_equal(cache.keys(0).to_numpy()[:, :, 0], cp.asnumpy(x).astype(np.float16))
    del a, b
    cache.free()


# ------------------------------------------------------------------ graphs

def test_graph_replay_equals_eager(gpu, rng):
    drv = gpu.driver.cuda()
    spec = KVSpec(num_layers=3, num_kv_heads=2, head_dim=64, capacity=128, format="fp8_e5m2")
    M, steps = 4, 100
    eager, graphed = new_cache(gpu, spec, M), new_cache(gpu, spec, M)
    xs = rows(rng, (steps, 3, 2, M, 2, 64), np.float16)  # step, layer, k/v, [M, Hkv, D]
    inp = gpu.DeviceBuffer.from_numpy(xs[0])  # fixed input buffer the graph reads
    views = [[inp.view((M, 2, 64), np.float16, offset=((l * 2 + w) * M * 2 * 64) * 2)
              for w in range(2)] for l in range(3)]
    st = graphed.stream
    with st.ctx:  # the raw driver calls below need the context current
        gpu.driver.call("cuStreamBeginCapture", st.handle,
                        drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL)
        try:
            for layer in range(3):
                graphed.append(layer, views[layer][0], views[layer][1])
            graphed.advance()
            with pytest.raises(StateError, match="while a stream is capturing"):
                graphed.snapshot(0)
            with pytest.raises(StateError, match="while a stream is capturing"):
                graphed.check()
        finally:
            graph = gpu.driver.call("cuStreamEndCapture", st.handle)
        exe = gpu.driver.call("cuGraphInstantiate", graph, 0)
        keep = []
        for t in range(steps):
            host = np.ascontiguousarray(xs[t])  # alive until the step's sync below
            inp.copy_from_host(host, stream=st)
            gpu.driver.call("cuGraphLaunch", exe, st.handle)
            for layer in range(3):
                keep += [dev(gpu, xs[t, layer, 0]), dev(gpu, xs[t, layer, 1])]
                eager.append(layer, keep[-2], keep[-1])
            eager.advance()
            st.synchronize()  # the host input is reused next step
        eager.check()
        graphed.check()
        assert list(graphed.lengths_host()) == [steps] * M
        for s in range(M):
            _same(graphed.snapshot(s), eager.snapshot(s))
        gpu.driver.call("cuGraphExecDestroy", exe)
        gpu.driver.call("cuGraphDestroy", graph)
        eager.free()
        graphed.free()


# ------------------------------------------------------------------ memory fit and lifetime

def test_fit_and_refusal_before_allocating(gpu):
    ctx = gpu.Context.get()
    spec = KVSpec(num_layers=32, num_kv_heads=8, head_dim=128, capacity=4096, format="int8")
    free, _ = ctx.mem_get_info()
    live = ctx.live_bytes
    too_many = gpu.max_slots_for_memory(spec, free) + 1
    with pytest.raises(SpecError, match=rf"GpuKVCache of {too_many} slots needs \d+ bytes, the device has \d+ free"):
        gpu.GpuKVCache(spec, too_many)
    assert ctx.live_bytes == live
    reserve = free - 3 * gpu.GpuLayout(spec, 1).total_bytes
    cache = gpu.GpuKVCache.fit(spec, reserve)
    assert 1 <= cache.slots <= 3
    cache.free()
    with pytest.raises(SpecError, match="one slot needs"):
        gpu.GpuKVCache.fit(spec, free)


def test_free_and_use_after_free(gpu):
    ctx = gpu.Context.get()
    live = ctx.live_bytes
    spec = KVSpec(num_layers=1, num_kv_heads=1, head_dim=32, capacity=4, format="bf16")
    cache = gpu.GpuKVCache(spec, 2)
    assert ctx.live_bytes == live + cache.memory_bytes
    g = cache.generation
    cache.free()
    cache.free()
    assert cache.generation == g + 1 and ctx.live_bytes == live
    for call in (lambda: cache.k_ptr(0, 0), lambda: cache.lengths, lambda: cache.check(),
                 lambda: cache.snapshot(0), lambda: cache.advance()):
        with pytest.raises(StateError, match="freed GpuKVCache"):
            call()
