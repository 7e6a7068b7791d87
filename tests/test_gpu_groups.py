"""K in q4_1ch (by channel over groups of 32 positions, KIVI's layout) in a GpuKVCache, on a
device or under the emulator (--gpu, conftest.py).

The reference is the CPU KVCache fed the same rows: its snapshot (codes, scales and the
open group's float16 residual) byte for byte after every kind of write, truncate and
restore, and its decode attention within float32 rounding (itself checked against float64
in tests/test_channel_groups.py). Device memory is poisoned (0xA5) before anything runs,
so a byte the kernels should not write, or read before writing, shows."""
import numpy as np
import pytest

import kvcore
from kvcore import (CapacityError, FormatError, KVCache, KVSpec, NonFiniteError,
                    decode_attention)

pytestmark = pytest.mark.gpu

ml_dtypes = pytest.importorskip("ml_dtypes")
POISON = 0xA5
PARTS = ("k_codes", "v_codes", "k_scales", "v_scales", "k_residual")


@pytest.fixture(scope="module")
def gpu():
    from kvcore import gpu
    return gpu


def spec_of(D=64, H=2, Hq=4, N=200, L=2, v="q4_1"):
    return KVSpec(num_layers=L, num_kv_heads=H, head_dim=D, capacity=N, num_heads=Hq,
                  k_format="q4_1ch", v_format=v)


def dev(gpu, x):
    x = np.ascontiguousarray(x)
    return gpu.DeviceBuffer.from_numpy(x).view(x.shape, x.dtype)


def new_cache(gpu, spec, slots):
    cache = gpu.GpuKVCache(spec, slots)
    cache._data.fill(POISON)
    return cache


def keys(rng, shape, dtype=np.float32):
    """K rows with a few outlier channels (KIVI's case), scales spread over 2^-8..2^8, and
    edge rows: zeros, signed zeros, tiny values, values near q4_1ch's limit."""
    x = rng.standard_normal(shape) * np.exp2(rng.uniform(-8, 8, shape[:-1] + (1,)))
    x[..., ::17] *= 10
    flat = x.reshape(-1, shape[-1])
    if flat.shape[0] > 8:
        flat[0] = 0.0
        flat[1] = -0.0
        flat[2] *= 1e-30
        flat[3, ::5] = 65280.0         # near q4_1ch's limit, exact in float16 and bfloat16
        flat[4] = (np.arange(shape[-1]) % 64 - 31.5) * 0.25
    return x.astype(np.float32).astype(dtype)


def assert_same(gcache, slot, cpu):
    got, want = gcache.snapshot(slot), cpu.snapshot()
    assert got.length == want.length
    for name in PARTS:
        a, b = getattr(got, name), getattr(want, name)
        assert a.shape == b.shape, (name, a.shape, b.shape)
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8), err_msg=f"slot {slot} {name}")


@pytest.mark.parametrize("v_fmt, D, dtype", [("q4_1", 64, np.float32), ("q4_0", 32, np.float16),
                                             ("q4_1", 128, ml_dtypes.bfloat16), ("q4_0", 256, np.float32)])
def test_writes_equal_the_cpu_cache(gpu, rng, v_fmt, D, dtype):
    """Runs of T rows into one slot (T = 1, 5, 27, 32, 33, 70: inside a group, up to its
    end, across one and several boundaries), then steps of every slot: the GPU's bytes are
    the CPU's after each, residual included."""
    spec = spec_of(D=D, v=v_fmt, N=320)
    M = 3
    g = new_cache(gpu, spec, M)
    cpus = [KVCache(spec) for _ in range(M)]
    H = spec.num_kv_heads
    done = 0
    for T in (1, 5, 27, 32, 33, 70):
        k, v = keys(rng, (T, H, D), dtype), keys(rng, (T, H, D), dtype)
        for layer in range(spec.num_layers):
            g.append(layer, dev(gpu, k), dev(gpu, v), slot=1)
            cpus[1].append(layer, k, v)
        g.advance(slot=1, steps=T)
        cpus[1].advance()
        done += T
        assert_same(g, 1, cpus[1])
    for step in range(40):
        k, v = keys(rng, (M, H, D), dtype), keys(rng, (M, H, D), dtype)
        for layer in range(spec.num_layers):
            g.append(layer, dev(gpu, k), dev(gpu, v))
            for m in range(M):
                cpus[m].append(layer, k[m], v[m])
        g.advance()
        for c in cpus:
            c.advance()
        if step in (0, 30, 31, 39):
            for m in range(M):
                assert_same(g, m, cpus[m])
    assert g.lengths_host().tolist() == [40, done + 40, 40]
    res = g.key_residual(0).to_numpy()             # the view: slot p % 32 of the open group
    n = done + 40
    np.testing.assert_array_equal(res[1, :, :n % 32].view(np.uint16),
                                  cpus[1].snapshot().k_residual[0].swapaxes(0, 1).view(np.uint16))
    g.free()


@pytest.mark.parametrize("D, Hq, H", [(32, 2, 2), (64, 8, 1), (128, 16, 2), (256, 4, 2)])
def test_attention_equals_the_cpu(gpu, rng, D, Hq, H):
    """Decode attention over complete groups and the open group (lengths 0, 1, 31, 32, 33,
    64, 97, 130), inside a step (pending=1: the appended position, a group it completes
    included), GQA 1 to 8; with sink logits and soft-capping; with sliding windows and
    sink positions whose edges fall inside groups (masked there), a gap of whole groups
    between them, or none."""
    spec = spec_of(D=D, H=H, Hq=Hq, N=160, L=1)
    lengths = [0, 1, 31, 32, 33, 64, 97, 130]
    M = len(lengths)
    g = new_cache(gpu, spec, M)
    cpus = [KVCache(spec) for _ in range(M)]
    for m, n in enumerate(lengths):
        if n:
            k, v = keys(rng, (n, H, D)), keys(rng, (n, H, D))
            g.append(0, dev(gpu, k), dev(gpu, v), slot=m)
            g.advance(slot=m, steps=n)
            cpus[m].append(0, k, v)
            cpus[m].advance()
    q = rng.standard_normal((M, Hq, D)).astype(np.float32)
    sinks = rng.uniform(-1, 2, Hq).astype(np.float32)

    def check(pending, **variants):
        plan = gpu.AttentionPlan(g, q_dtype="float32", **variants)
        out = gpu.DeviceBuffer.alloc(4 * q.size).view(q.shape, np.float32)
        plan.run(dev(gpu, q), out, 0, pending=pending)
        got = out.to_numpy()
        for m, c in enumerate(cpus):
            if c.length + pending == 0:                  # an empty slot: zeros (sinks too)
                np.testing.assert_array_equal(got[m], 0.0)
                continue
            want = decode_attention(q[m:m + 1], c, 0, **variants)[0]
            # float32 rounding, relative to the output's scale (V rows span 2^-8..2^12)
            np.testing.assert_allclose(got[m], want, rtol=3e-5, atol=3e-5 * (1 + np.abs(want).max()),
                                       err_msg=f"length {c.length} {variants}")
        plan.free()

    check(0)
    check(0, sinks=sinks, softcap=5.0)
    for window, sink_tokens in ((1, 0), (5, 0), (40, 0), (64, 3), (45, 40), (70, 33), (100, 1)):
        check(0, window=window, sink_tokens=sink_tokens)
    k, v = keys(rng, (M, H, D)), keys(rng, (M, H, D))     # a step: 32 and 64 -> 33, 65; 31 -> 32
    g.append(0, dev(gpu, k), dev(gpu, v))
    for m, c in enumerate(cpus):
        c.append(0, k[m], v[m])
    check(1)
    check(1, window=33, sink_tokens=2, softcap=3.0)
    g.free()


def test_refused_writes_change_nothing(gpu, rng):
    """NaN in a run of rows that crosses a group boundary (whose writes would overwrite
    the residual of the committed positions), a value past q4_1ch's limit in a step, and
    a run past capacity: each refused, nothing changed, and the next writes go on equal
    to the CPU's."""
    spec = spec_of(D=64, N=100)
    H, D = spec.num_kv_heads, spec.head_dim
    g = new_cache(gpu, spec, 2)
    cpus = [KVCache(spec) for _ in range(2)]
    k, v = keys(rng, (45, H, D)), keys(rng, (45, H, D))
    for layer in range(2):
        g.append(layer, dev(gpu, k), dev(gpu, v), slot=0)
        cpus[0].append(layer, k, v)
    g.advance(slot=0, steps=45)
    cpus[0].advance()
    before = g.snapshot(0)

    bad = keys(rng, (40, H, D))
    bad[30, 1, 7] = np.nan                           # position 75: the run crosses 64
    for layer in range(2):
        g.append(layer, dev(gpu, bad), dev(gpu, bad), slot=0)
    g.advance(slot=0, steps=40)
    with pytest.raises(NonFiniteError, match="slot 0: non-finite"):
        g.check()
    big = keys(rng, (2, H, D))
    big[0, 0, 3] = 65520.0                           # q4_1ch's limit: refused
    for layer in range(2):
        g.append(layer, dev(gpu, big), dev(gpu, big))
    g.advance()
    with pytest.raises(FormatError, match=r"slot 0: a value out of range.*\|k\| >= 65520"):
        g.check()
    for layer in range(2):
        g.append(layer, dev(gpu, keys(rng, (60, H, D))), dev(gpu, keys(rng, (60, H, D))), slot=0)
    g.advance(slot=0, steps=60)
    with pytest.raises(CapacityError, match="capacity 100"):
        g.check()
    after = g.snapshot(0)
    for name in PARTS:
        np.testing.assert_array_equal(getattr(after, name).view(np.uint8),
                                      getattr(before, name).view(np.uint8), err_msg=name)
    assert g.lengths_host().tolist() == [45, 1]     # slot 1's step was committed
    for layer in range(2):
        g.append(layer, dev(gpu, bad[:30]), dev(gpu, bad[:30]), slot=0)
        cpus[0].append(layer, bad[:30], bad[:30])
    g.advance(slot=0, steps=30)
    cpus[0].advance()
    assert_same(g, 0, cpus[0])
    g.free()


def test_truncate_restore_and_scatter(gpu, rng):
    """truncate into the open group keeps its float16 values; into a complete group it
    decodes that group into the residual (as the CPU does: what attention read, rounded to
    float16); restore of a CPU snapshot, scatter from a one-slot cache and a snapshot back
    to a CPU cache carry the open group."""
    spec = spec_of(D=64, N=200)
    H, D = spec.num_kv_heads, spec.head_dim
    g = new_cache(gpu, spec, 2)
    cpu = KVCache(spec)
    k, v = keys(rng, (140, H, D)), keys(rng, (140, H, D))
    for layer in range(2):
        g.append(layer, dev(gpu, k), dev(gpu, v), slot=0)
        cpu.append(layer, k, v)
    g.advance(slot=0, steps=140)
    cpu.advance()
    for n in (135, 128, 100, 96, 70, 64, 40):        # open group, boundaries, complete groups
        g.truncate(0, n)
        cpu.truncate(n)
        assert_same(g, 0, cpu)
        more = keys(rng, (n % 7 + 20, H, D))
        for layer in range(2):
            g.append(layer, dev(gpu, more), dev(gpu, more), slot=0)
            cpu.append(layer, more, more)
        g.advance(slot=0, steps=len(more))
        cpu.advance()
        assert_same(g, 0, cpu)
    g.restore(cpu.snapshot(), 1)                     # CPU -> GPU
    assert_same(g, 1, cpu)
    one = new_cache(gpu, spec, 1)
    one.restore(g.snapshot(1), 0)                    # GPU -> GPU, then device to device
    g.truncate(1, 3)
    g.scatter(one, 1)
    assert_same(g, 1, cpu)
    back = KVCache(spec)                             # GPU -> CPU
    back.restore(g.snapshot(1))
    q = rng.standard_normal((1, spec.num_heads, D)).astype(np.float32)
    np.testing.assert_array_equal(decode_attention(q, back, 1), decode_attention(q, cpu, 1))
    one.free()
    g.free()


def test_a_graph_replays_a_step_over_it(gpu, rng):
    """DecodeGraph over a q4_1ch cache (append, attention with pending=1, advance, captured
    once) across the group boundaries of 40 steps, equal to the CPU step by step."""
    spec = spec_of(D=64, H=1, Hq=2, N=64, L=1)
    g = new_cache(gpu, spec, 2)
    cpus = [KVCache(spec) for _ in range(2)]
    graph = gpu.DecodeGraph(g, dtype="float32", rope=False)
    for step in range(40):
        q = rng.standard_normal((2, 2, 64)).astype(np.float32)
        k, v = keys(rng, (2, 1, 64)), keys(rng, (2, 1, 64))
        for name, x in (("q", q), ("k", k), ("v", v)):
            getattr(graph, name)(0).copy_from_numpy(x)
        graph.replay()
        graph.synchronize()
        got = graph.out(0).to_numpy()
        for m, c in enumerate(cpus):
            c.append(0, k[m], v[m])
            want = decode_attention(q[m:m + 1], c, 0)[0]
            c.advance()
            np.testing.assert_allclose(got[m], want, rtol=3e-5, atol=3e-5 * (1 + np.abs(want).max()),
                                       err_msg=f"step {step}")
    for m in range(2):
        assert_same(g, m, cpus[m])
    graph.destroy()
    g.free()


def test_what_the_gpu_refuses_names_it(gpu):
    """head_dims whose threads per row do not divide a warp (attention only), and pairs
    with another V format: FormatError naming the format, nothing allocated."""
    before = gpu.live_bytes()
    with pytest.raises(FormatError, match="K format q4_1ch and V format int8"):
        gpu.GpuKVCache(spec_of(v="int8"), 1)
    with pytest.raises(FormatError, match="K format q4_1ch and V format int8"):
        gpu.GpuKVPool(spec_of(v="int8"), 4, 32, max_batch=1, max_pages_per_seq=2)
    assert gpu.live_bytes() == before
    odd = new_cache(gpu, spec_of(D=96), 1)            # stores and moves; attention refused
    with pytest.raises(FormatError, match="needs head_dim 32, 64, 128 or 256 on the GPU, got 96"):
        gpu.AttentionPlan(odd)
    odd.free()
    f16 = new_cache(gpu, KVSpec(num_layers=1, num_kv_heads=1, head_dim=32, capacity=4,
                                format="f16"), 1)
    with pytest.raises(FormatError, match="K format f16 has no residual"):
        f16.key_residual(0)
    f16.free()
    f16 = gpu.GpuKVPool(f16.spec, 2, 16, max_batch=1, max_pages_per_seq=1)
    with pytest.raises(FormatError, match="K format f16 has no residual"):
        f16.key_residual(0)
    f16.free()


def test_cpu_layouts_are_shared(gpu):
    """GpuLayout: the residual region follows the scales, [L][M][Hkv][32][D] float16."""
    spec = spec_of(D=64, H=2, L=3, N=96)
    lay = gpu.GpuLayout(spec, 5)
    assert lay.residual_shape == (3, 5, 2, 32, 64)
    assert lay.residual_bytes == 3 * 5 * 2 * 32 * 64 * 2
    assert lay.offsets["k_residual"] % 256 == 0
    assert lay.offsets["k_residual"] >= lay.offsets["v_scales"] + lay.region_bytes("v_scales")
    assert lay.residual_offset(2, 4) == lay.offsets["k_residual"] + (2 * 5 + 4) * 2 * 32 * 64 * 2
    assert lay.data_bytes >= lay.offsets["k_residual"] + lay.residual_bytes
    assert gpu.GpuLayout(kvcore.KVSpec(num_layers=1, num_kv_heads=1, head_dim=32, capacity=4,
                                       format="q4_1"), 1).residual_bytes == 0


# -- GpuKVPool: pages of whole groups, a residual per sequence ---------------------------

def pool_step(gpu, gp, cp, seqs, counts, rng, keep):
    """One step of counts[b] new positions for seqs[b] on the GPU pool and the CPU one."""
    H, D = gp.spec.num_kv_heads, gp.spec.head_dim
    gp.begin_step(seqs, counts)
    for layer in range(gp.spec.num_layers):
        k, v = keys(rng, (sum(counts), H, D)), keys(rng, (sum(counts), H, D))
        keep += [dev(gpu, k), dev(gpu, v)]
        gp.append(layer, keep[-2], keep[-1])
        cp.append_batch(k, v, seqs=seqs, layer=layer, counts=counts)
    assert gp.advance() == list(counts)
    cp.advance(seqs)


def assert_same_seq(gp, cp, seq, cpu_seq=None):
    """The GPU pool's sequence seq byte for byte the CPU pool's cpu_seq (default: seq)."""
    got, want = gp.snapshot(seq), cp.snapshot(seq if cpu_seq is None else cpu_seq)
    assert got.length == want.length
    for name in PARTS:
        a, b = getattr(got, name), getattr(want, name)
        assert a.shape == b.shape, (name, a.shape, b.shape)
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8), err_msg=f"seq {seq} {name}")


@pytest.mark.parametrize("v_fmt, D", [("q4_1", 64), ("q4_0", 128)])
def test_pool_equals_the_cpu_pool(gpu, rng, v_fmt, D):
    """Prefill runs and decode steps of several sequences in one step (runs crossing group
    and page boundaries), a fork, truncates into the open and into a complete group, a
    snapshot restored: the GPU pool's bytes (residuals included) and decode attention equal
    the CPU KVPool's."""
    spec = spec_of(D=D, H=2, Hq=4, N=400, v=v_fmt)
    gp = gpu.GpuKVPool(spec, 24, 32, max_batch=4, max_pages_per_seq=12, max_tokens=80,
                       max_sequences=6)
    cp = kvcore.KVPool(spec, 24, 32)
    gp._data.fill(POISON)
    keep = []
    a, b = gp.new_sequence(), gp.new_sequence()
    assert [a, b] == [cp.new_sequence(), cp.new_sequence()]
    pool_step(gpu, gp, cp, [a, b], [45, 70], rng, keep)
    for i in range(20):
        pool_step(gpu, gp, cp, [a, b], [1, 1 + (i == 7) * 30], rng, keep)
    for s in (a, b):
        assert_same_seq(gp, cp, s)
    f = gp.fork(a)
    assert f == cp.fork(a)
    pool_step(gpu, gp, cp, [f, a], [3, 40], rng, keep)
    gp.truncate(b, 110); cp.truncate(b, 110)     # into the open group of 121
    gp.truncate(a, 70); cp.truncate(a, 70)       # into a complete group
    for s in (a, b, f):
        assert_same_seq(gp, cp, s)
    pool_step(gpu, gp, cp, [a, b, f], [5, 1, 33], rng, keep)
    r = gp.restore(cp.snapshot(b))
    assert r == cp.restore(cp.snapshot(b))
    pool_step(gpu, gp, cp, [r, a], [2, 1], rng, keep)
    for s in (a, b, f, r):
        assert_same_seq(gp, cp, s)
    seqs = [a, b, f, r]
    q = rng.standard_normal((4, spec.num_heads, D)).astype(np.float32)
    gp.begin_step(seqs, [1] * 4)
    k, v = keys(rng, (4, 2, D)), keys(rng, (4, 2, D))
    out = gpu.DeviceBuffer.alloc(4 * q.size).view(q.shape, np.float32)
    for layer in range(2):
        gp.append(layer, dev(gpu, k), dev(gpu, v))
        cp.append_batch(k, v, seqs=seqs, layer=layer)
        for variants in ({}, {"window": 50, "sink_tokens": 4}):
            gp.decode_attention(dev(gpu, q), out, layer, **variants)
            got = out.to_numpy()
            want = decode_attention(q, cp, layer, seqs=seqs, **variants)
            np.testing.assert_allclose(got, want, rtol=3e-5, atol=3e-5 * (1 + np.abs(want).max()),
                                       err_msg=str(variants))
    gp.advance()
    cp.advance(seqs)
    for s in seqs:
        assert_same_seq(gp, cp, s)
    for layer in range(2):     # the public view: each sequence's open group is one of its rows
        rows = gp.key_residual(layer).to_numpy().view(np.uint16)       # [S, Hkv, 32, D]
        for s in seqs:
            want = cp.snapshot(s).k_residual[layer].swapaxes(0, 1).view(np.uint16)   # [Hkv, n % 32, D]
            m = want.shape[1]
            if m:
                assert sum(np.array_equal(r[:, :m], want) for r in rows) == 1, (layer, s, m)
    with pytest.raises(IndexError, match="layer"):
        gp.key_residual(2)
    gp.free()


def test_pool_refusals_change_nothing(gpu, rng):
    """A NaN in a step's run that crosses a group boundary: refused, every sequence as it
    was; max_sequences residuals: one more sequence refused, freeing one makes room; a
    page_size that is not a multiple of 32 refused."""
    spec = spec_of(D=64)
    with pytest.raises(FormatError, match="page_size must be a multiple of 32, got 16"):
        gpu.GpuKVPool(spec, 8, 16, max_batch=2, max_pages_per_seq=4)
    gp = gpu.GpuKVPool(spec, 12, 32, max_batch=2, max_pages_per_seq=6, max_tokens=50, max_sequences=2)
    cp = kvcore.KVPool(spec, 12, 32)
    keep = []
    a, b = gp.new_sequence(), gp.new_sequence()
    cp.new_sequence(), cp.new_sequence()
    pool_step(gpu, gp, cp, [a, b], [40, 10], rng, keep)
    with pytest.raises(CapacityError, match="every one of the 2 residuals"):
        gp.new_sequence()
    with pytest.raises(CapacityError, match="max_sequences"):
        gp.fork(a)
    before = [gp.snapshot(s) for s in (a, b)]
    gp.begin_step([a, b], [30, 1])
    bad = keys(rng, (31, 2, 64))
    bad[20, 0, 5] = np.nan                       # position 60 of a: the run crosses 64
    for layer in range(2):
        gp.append(layer, dev(gpu, bad), dev(gpu, bad))
    with pytest.raises(NonFiniteError):
        gp.advance()
    for s, snap in zip((a, b), before):
        after = gp.snapshot(s)
        for name in PARTS:
            np.testing.assert_array_equal(getattr(after, name).view(np.uint8),
                                          getattr(snap, name).view(np.uint8), err_msg=name)
    gp.free_sequence(b)
    cp.free(b)
    c = gp.new_sequence()
    assert c == cp.new_sequence()
    pool_step(gpu, gp, cp, [a, c], [30, 33], rng, keep)
    for s in (a, c):
        assert_same_seq(gp, cp, s)
    gp.free()


def test_pool_graph_and_prefix_cache(gpu, rng):
    """A DecodeGraph over a q4_1ch pool replayed across group boundaries, and a sequence
    started on a cached prefix (whole pages, so whole groups: no open group) and stepped on:
    equal to the CPU pool."""
    spec = spec_of(D=64, H=1, Hq=2, L=1, N=256)
    gp = gpu.GpuKVPool(spec, 16, 32, max_batch=2, max_pages_per_seq=8, max_tokens=70,
                       prefix_cache=True, max_sequences=3)
    cp = kvcore.KVPool(spec, 16, 32, prefix_cache=True)
    keep = []
    tokens = rng.integers(0, 1000, 100)
    a = gp.new_sequence()
    assert a == cp.new_sequence()
    gp.begin_step([a], [70])
    k, v = keys(rng, (70, 1, 64)), keys(rng, (70, 1, 64))
    keep += [dev(gpu, k), dev(gpu, v)]
    gp.append(0, keep[-2], keep[-1])
    cp.append_batch(k, v, seqs=[a], layer=0, counts=[70])
    gp.advance(tokens=[tokens[:70]])
    cp.advance([a], tokens=[tokens[:70]])
    s, n = gp.match_prefix(tokens)
    assert (s, n) == cp.match_prefix(tokens) and n == 64
    graph = gpu.DecodeGraph(gp, dtype="float32", rope=False)
    for step in range(40):
        seqs = [a, s]
        q = rng.standard_normal((2, 2, 64)).astype(np.float32)
        k, v = keys(rng, (2, 1, 64)), keys(rng, (2, 1, 64))
        gp.begin_step(seqs)
        for name, x in (("q", q), ("k", k), ("v", v)):
            getattr(graph, name)(0).copy_from_numpy(x)
        graph.replay()
        ids = [tokens[70 + step:71 + step] if step < 30 else [step], [step]]
        gp.advance(tokens=ids)
        got = graph.out(0).to_numpy()
        cp.append_batch(k, v, seqs=seqs, layer=0)
        want = decode_attention(q, cp, 0, seqs=seqs)
        cp.advance(seqs, tokens=ids)
        np.testing.assert_allclose(got, want, rtol=3e-5, atol=3e-5 * (1 + np.abs(want).max()),
                                   err_msg=f"step {step}")
    for seq in (a, s):
        assert_same_seq(gp, cp, seq)
    graph.destroy()
    gp.free()


def test_windowed_pool(gpu, rng):
    """A sliding-window q4_1ch pool (window 50, 3 sink positions: pages of whole groups
    released): causal decode attention of steps of 1 to 31 tokens and the snapshots of the
    held positions equal the CPU pool's."""
    spec = spec_of(D=64, H=2, Hq=4, L=1, N=400, v="q4_0")
    gp = gpu.GpuKVPool(spec, 16, 32, max_batch=2, max_pages_per_seq=12, max_tokens=40,
                       window=50, sink_tokens=3)
    cp = kvcore.KVPool(spec, 16, 32, window=50, sink_tokens=3)
    a, b = gp.new_sequence(), gp.new_sequence()
    assert [a, b] == [cp.new_sequence(), cp.new_sequence()]
    keep = []
    for step in range(30):
        counts = [1 + (step % 7 == 0) * 20, 1 + (step % 5 == 0) * 30]
        k, v = keys(rng, (sum(counts), 2, 64)), keys(rng, (sum(counts), 2, 64))
        q = rng.standard_normal((sum(counts), 4, 64)).astype(np.float32)
        gp.begin_step([a, b], counts)
        keep += [dev(gpu, k), dev(gpu, v)]
        gp.append(0, keep[-2], keep[-1])
        cp.append_batch(k, v, seqs=[a, b], layer=0, counts=counts)
        out = gpu.DeviceBuffer.alloc(4 * q.size).view(q.shape, np.float32)
        gp.decode_attention(dev(gpu, q), out, 0)
        want = decode_attention(q, cp, 0, seqs=[a, b], counts=counts)
        np.testing.assert_allclose(out.to_numpy(), want, rtol=3e-5,
                                   atol=3e-5 * (1 + np.abs(want).max()), err_msg=f"step {step}")
        gp.advance()
        cp.advance([a, b])
    assert gp.page_table(b).tolist()[1] == -1            # released pages
    for s in (a, b):
        assert_same_seq(gp, cp, s)
    gp.free()


def test_the_tiers_of_a_pool(gpu, tmp_path):
    """Host tier and store (issue 32, item 1: the prefix cache and the store): whole-group
    pages evicted to a host KVPool come back, and the chunks a pool saved come back into a
    fresh pool, each sequence then byte for byte the CPU KVPool's that computed every prompt
    (residual included: the prompt's open group is computed after the matched pages)."""
    from kvcore.store import DirectoryBackend, KVStore, StoreWriter
    spec = spec_of(D=64, H=2, Hq=4, N=256)
    kv_of = lambda tokens: keys(np.random.default_rng(tokens[0]), (len(tokens), 2, 64))  # noqa: E731
    store = KVStore(DirectoryBackend(str(tmp_path)), model="m", spec=spec, chunk_tokens=32, page_size=32)
    writer = StoreWriter(store)
    host = kvcore.KVPool(spec, 16, 32, prefix_cache=True)
    ref = kvcore.KVPool(spec, 64, 32, prefix_cache=True)
    keep = []

    def prefill(g, tokens):
        s, n = g.match_prefix(tokens)
        r, m = ref.match_prefix(tokens)
        kv = kv_of(tokens)
        g.begin_step([s], [len(tokens) - n])
        for layer in range(2):
            keep.extend([dev(gpu, kv[n:]), dev(gpu, -kv[n:])])
            g.append(layer, keep[-2], keep[-1])
            if len(tokens) > m:
                ref.append(kv[m:], -kv[m:], seq=r, layer=layer)
        g.advance(tokens=[tokens[n:]])
        if len(tokens) > m:
            ref.advance(r, tokens=tokens[m:])
        assert_same_seq(g, ref, s, r)
        return s, n, r

    g = gpu.GpuKVPool(spec, 6, 32, max_batch=2, max_pages_per_seq=8, max_tokens=80,
                      prefix_cache=True, host=host, store=store, store_writer=writer)
    g._data.fill(POISON)
    prompts = [list(range(1000 * i, 1000 * i + 70)) for i in range(1, 5)]  # 2 groups + 6
    for p in prompts:                  # 6 GPU pages: the later prompts evict the earlier
        s, n, r = prefill(g, p)
        assert n == 0
        g.free_sequence(s), ref.free(r)
    assert g.tier_stats.demoted >= 2
    s, n, r = prefill(g, prompts[0] + [5, 6, 7])          # from the host tier
    assert n == 64 and g.tier_stats.host_hits == 2
    g.free_sequence(s), ref.free(r)
    g.free()
    writer.close()
    assert writer.stats.chunks_written == 8 and writer.stats.failed == 0
    fresh = gpu.GpuKVPool(spec, 6, 32, max_batch=2, max_pages_per_seq=8, max_tokens=80,
                          prefix_cache=True, store=store)
    s, n, r = prefill(fresh, prompts[1] + [9])            # from the store
    assert n == 64 and fresh.stats.store_hits == 2       # 2 chunks of one page each
    fresh.free()
