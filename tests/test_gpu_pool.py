"""GpuKVPool, on a device or under the emulator (--gpu, conftest.py).

The reference is the CPU KVPool driven by the same calls: the same PageTable gives the same
page ids, so every held page must hold the same bytes on both sides (and the codes must be
kvcore.quantize's). Device memory starts poisoned (0xFF), so a byte a kernel should not
write shows up."""
import numpy as np
import pytest

from kvcore import decode_attention as kvcore_attention
from kvcore import (FORMATS, CapacityError, FormatError, KVPool, KVSpec, NonFiniteError,
                    OutOfRangeError, ShapeError, StateError, quantize)

pytestmark = pytest.mark.gpu

ml_dtypes = pytest.importorskip("ml_dtypes")
IN_DTYPES = (np.float32, np.float16, ml_dtypes.bfloat16)
L, H, D, PS = 2, 2, 64, 4


@pytest.fixture(scope="module")
def gpu():
    from kvcore import gpu
    return gpu


def spec(fmt="int8", capacity=64):
    return KVSpec(num_layers=L, num_kv_heads=H, head_dim=D, capacity=capacity, format=fmt)


def inputs(rng, n, dtype):
    """[n, H, D] rows with scales spread over 2^-8..2^8, an all-zero row and a tiny one."""
    x = rng.standard_normal((n, H, D)) * np.exp2(rng.uniform(-8, 8, (n, H, 1)))
    if n >= 2:
        x[0, 0] = 0.0
        x[1, 1] *= 1e-30
    return x.astype(np.float32).astype(dtype)


def dev(gpu, x):
    return gpu.DeviceBuffer.from_numpy(np.ascontiguousarray(x)).view(x.shape, x.dtype)


def same_snapshot(a, b):
    assert a.length == b.length and a.spec.format == b.spec.format
    for name in ("k_codes", "v_codes", "k_scales", "v_scales"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            assert x.shape == y.shape and x.tobytes() == y.tobytes(), name


def same_pages(gp, cp):
    """Every held page, every layer and region: the device bytes equal the CPU pool's;
    every page no sequence holds is free."""
    assert gp._table.refs == cp._table.refs and gp._table.free == cp._table.free
    held = {g for seq in cp.sequences for g in cp.page_table(seq).tolist()}
    assert sorted(gp._table.free) == sorted(set(range(gp.num_pages)) - held)
    for seq in cp.sequences:
        n = cp.length(seq)
        rows = np.array(cp._table.rows(seq, 0, n), np.int64)
        for layer in range(L):
            views = [gp.keys(layer), gp.values(layer)]
            if gp.spec.fmt.quantized:
                views += [gp.key_scales(layer), gp.value_scales(layer)]
            for v, want in zip(views, cp._layer_arrays(layer)):
                got = v.to_numpy().reshape((-1,) + v.shape[2:])[rows]
                assert got.tobytes() == want[rows].tobytes()


def step(gpu, gp, cp, seqs, counts, rng, dtype, keep):
    """One step of counts[b] new positions for seqs[b] on both pools."""
    gp.begin_step(seqs, counts)
    for layer in range(L):
        k, v = inputs(rng, sum(counts), dtype), inputs(rng, sum(counts), dtype)
        keep += [dev(gpu, k), dev(gpu, v)]
        gp.append(layer, keep[-2], keep[-1])
        cp.append_batch(layer, seqs, k, v, counts)
    assert gp.advance() == counts
    cp.advance(seqs)


def pools(gpu, fmt, pages=24, **kw):
    kw = {"max_batch": 4, "max_pages_per_seq": 8, "max_tokens": 3, **kw}
    return gpu.GpuKVPool(spec(fmt), pages, PS, **kw), KVPool(spec(fmt), pages, PS)


# ------------------------------------------------------------------ layout and metadata

def test_layout_views_and_metadata(gpu, rng):
    gp, cp = pools(gpu, "q8_0")
    assert gp.offsets["k_codes"] == 0 and all(o % 256 == 0 for o in gp.offsets.values())
    assert gp.keys(1).shape == (24, PS, H, D) and gp.key_scales(0).shape == (24, PS, H, 2)
    assert gp.block_tables.shape == (4, 8) and gp.slot_mapping.shape == (12,)
    addresses = (gp.block_tables.ptr, gp.lengths.ptr, gp.slot_mapping.ptr, gp.status.ptr)
    a, b = gp.new_sequence(), gp.new_sequence()
    assert (a, b) == (cp.new_sequence(), cp.new_sequence())
    keep = []
    step(gpu, gp, cp, [a, b], [3, 2], rng, np.float32, keep)
    gp.begin_step([b, a], [1, 2])
    assert addresses == (gp.block_tables.ptr, gp.lengths.ptr, gp.slot_mapping.ptr, gp.status.ptr)
    want_slots = cp.slot_mapping([b, a], [1, 2], np.zeros(3, np.int64))   # reserves pages
    tables = gp.block_tables.to_numpy()
    assert list(tables[0]) == list(cp.page_table(b)) + [-1] * 7     # 3 positions: 1 page
    assert list(tables[1]) == list(cp.page_table(a)) + [-1] * 6     # 5 positions: 2 pages
    assert (tables[2:] == -1).all()
    assert list(gp.lengths.to_numpy()) == [3, 5, 0, 0]
    assert list(gp.slot_mapping.to_numpy()) == list(want_slots) + [-1] * 9
    with pytest.raises(StateError, match="inside a step"):
        gp.fork(a)
    k = inputs(rng, 3, np.float16)
    x = dev(gpu, k)
    for layer in range(L):
        gp.append(layer, x, x)
    gp.advance()
    assert (gp.length(a), gp.length(b)) == (5, 3)
    gp.free()


def test_metadata_refusals_change_nothing(gpu):
    gp, _ = pools(gpu, "f16", pages=3, max_batch=2, max_pages_per_seq=2, max_tokens=5)
    a, b, c = gp.new_sequence(), gp.new_sequence(), gp.new_sequence()
    before = (list(gp._table.free), gp.block_tables.to_numpy().tobytes())
    with pytest.raises(ShapeError, match="max_batch is 2"):
        gp.begin_step([a, b, c])
    with pytest.raises(CapacityError, match="block tables hold 8"):
        gp.begin_step([a], [9])
    with pytest.raises(ShapeError, match="slot mapping holds 10"):
        gp.begin_step([a, b], [6, 5])
    with pytest.raises(CapacityError, match="pool out of pages"):
        gp.begin_step([a, b], [5, 5])
    with pytest.raises(StateError, match="without begin_step"):
        gp.advance()
    with pytest.raises(ShapeError, match=r"expected \[1\] \(one per sequence\)"):
        gp.begin_step([a], [1, 1])
    with pytest.raises(ShapeError, match="counts must be ints >= 0, got -1"):
        gp.begin_step([a], [-1])
    with pytest.raises(StateError, match="unknown sequence 99"):
        gp.begin_step([99])
    assert before == (list(gp._table.free), gp.block_tables.to_numpy().tobytes())
    gp.free()
    with pytest.raises(StateError, match="after free"):
        gp.new_sequence()


# ------------------------------------------------------------------ paged append

@pytest.mark.parametrize("fmt", list(FORMATS))
def test_append_fork_truncate_equal_cpu_pool(gpu, rng, fmt):
    """Ragged steps, a fork whose next writes copy a shared page on the device, a truncate
    and a free: pages, refs and snapshots equal the CPU pool's after every step."""
    gp, cp = pools(gpu, fmt)
    dtype = IN_DTYPES[list(FORMATS).index(fmt) % 3]
    keep = []
    a, b = gp.new_sequence(), gp.new_sequence()
    cp.new_sequence(), cp.new_sequence()
    step(gpu, gp, cp, [a, b], [3, 1], rng, dtype, keep)
    # the codes of the first step are kvcore.quantize's
    k0 = inputs(np.random.default_rng(0), 3, dtype)[1:2]
    gp.begin_step([a], [1])
    x = dev(gpu, k0)
    for layer in range(L):
        gp.append(layer, x, x)
    gp.advance()
    cp.append_batch(0, [a], k0, k0), cp.append_batch(1, [a], k0, k0)
    cp.advance([a])
    codes, scales = quantize(k0, fmt)
    row = cp._table.rows(a, 3, 4)[0]
    got = gp.keys(1).to_numpy().reshape(-1, H, D)[row]
    assert got.tobytes() == np.ascontiguousarray(codes[0]).view(FORMATS[fmt].code_dtype).tobytes()
    if scales is not None:
        assert gp.key_scales(1).to_numpy().reshape(-1, H, scales.shape[-1])[row].tobytes() \
            == scales[0].tobytes()
    for counts in ([2, 3], [1, 1], [3, 0]):
        step(gpu, gp, cp, [a, b], counts, rng, dtype, keep)
        same_pages(gp, cp)
    c = gp.fork(a)                      # a: 10 positions, page 3 half full: copied on the device
    assert c == cp.fork(a)
    d = gp.fork(b)                      # b: 5 positions, page 2 partial
    assert d == cp.fork(b)
    step(gpu, gp, cp, [c, a, d], [2, 1, 3], rng, dtype, keep)   # no page shared by a write
    same_pages(gp, cp)
    gp.truncate(a, 2), cp.truncate(a, 2)             # a's first page is now shared with c
    step(gpu, gp, cp, [a], [3], rng, dtype, keep)    # copy-on-write of that page
    same_pages(gp, cp)
    gp.free_sequence(b), cp.free(b)
    step(gpu, gp, cp, [d, c], [1, 2], rng, dtype, keep)
    same_pages(gp, cp)
    e = gp.fork(c)                      # c: 14 positions; e shares its 3 full pages
    assert e == cp.fork(c)
    for s, n in ((c, 5), (e, 6)):       # both next write into their shared page 1
        gp.truncate(s, n), cp.truncate(s, n)
    step(gpu, gp, cp, [e, c], [1, 1], rng, dtype, keep)   # e copies it, c writes in place
    assert gp.page_table(c)[1] != gp.page_table(e)[1]
    same_pages(gp, cp)
    for s in cp.sequences:
        same_snapshot(gp.snapshot(s), cp.snapshot(s))
    same_snapshot(gp.snapshot(c, 4), cp.snapshot(c, 4))
    gp.free()


def test_padding_slots_skipped(gpu, rng):
    """Slot -1 rows are neither read (their input is NaN) nor written; the status stays clear."""
    gp, cp = pools(gpu, "fp8_e4m3", max_batch=3, max_tokens=2)
    a = gp.new_sequence()
    cp.new_sequence()
    gp.begin_step([a], [2])
    data = gp._data
    k = np.full((6, H, D), np.nan, np.float32)
    k[:2] = inputs(rng, 2, np.float32)
    x = dev(gpu, k)
    before = [gp.keys(layer).to_numpy().copy() for layer in range(L)]
    for layer in range(L):
        gp.append(layer, x, x)
        cp.append_batch(layer, [a], k[:2], k[:2], [2])
    gp.advance(), cp.advance([a])
    same_pages(gp, cp)
    rows = set(cp._table.rows(a, 0, 2))
    for layer in range(L):
        after = gp.keys(layer).to_numpy().reshape(-1, H, D)
        old = before[layer].reshape(-1, H, D)
        for r in range(after.shape[0]):
            if r not in rows:
                assert after[r].tobytes() == old[r].tobytes()
    assert data is gp._data
    gp.free()


@pytest.mark.parametrize("bad", [24 * PS, 10**12, -2])
def test_slot_outside_pool_refused_by_status(gpu, rng, bad):
    gp, _ = pools(gpu, "int8")
    a = gp.new_sequence()
    gp.begin_step([a], [2])
    slots = gp.slot_mapping.to_numpy()
    slots[1] = bad
    gp.slot_mapping.copy_from_numpy(slots)
    before = gp._data.view((gp._data.nbytes,), np.uint8).to_numpy()
    x = dev(gpu, inputs(rng, 2, np.float32))
    gp.append(0, x, x)
    with pytest.raises(OutOfRangeError, match=f"outside the pool's {24 * PS}"):
        gp.advance()
    assert gp._data.view((gp._data.nbytes,), np.uint8).to_numpy().tobytes() == before.tobytes()
    assert gp.length(a) == 0
    gp.check()                           # cleared
    gp.free()


def test_nonfinite_and_out_of_range_rows(gpu, rng):
    gp, _ = pools(gpu, "f16")
    a = gp.new_sequence()
    gp.begin_step([a], [2])
    k = inputs(rng, 2, np.float32)
    k[1, 0, 5] = np.inf
    x = dev(gpu, k)
    gp.append(0, x, x)
    with pytest.raises(NonFiniteError):
        gp.advance()
    assert gp.length(a) == 0
    gp.begin_step([a], [1])
    y = dev(gpu, np.full((1, H, D), 70000.0, np.float32))
    gp.append(1, y, y)
    with pytest.raises(FormatError, match="out of range of format f16"):
        gp.advance()
    gp.free()


def test_graph_replay_while_tables_change_equals_eager(gpu, rng):
    """One graph of every layer's append and decode attention, captured once, replayed while
    sequences join, fork and finish between steps (new block tables, lengths and slots each
    step): the pages equal the CPU pool's, the outputs a pool run eagerly, bit for bit."""
    drv = gpu.driver.cuda()
    B, T = 3, 2
    graphed, eager = (pools(gpu, "q8_0", max_batch=B, max_tokens=T)[0] for _ in range(2))
    cpu = KVPool(spec("q8_0"), 24, PS)
    inp = gpu.DeviceBuffer.alloc(L * 2 * B * T * H * D * 2)
    views = [[inp.view((B * T, H, D), np.float16, offset=((l * 2 + w) * B * T * H * D) * 2)
              for w in range(2)] for l in range(L)]
    qo = gpu.DeviceBuffer.alloc(3 * L * B * H * D * 4)     # q, graphed out, eager out per layer
    q, out, ref = ([qo.view((B, H, D), np.float32, offset=((i * L + l) * B * H * D) * 4)
                    for l in range(L)] for i in range(3))
    st = graphed.stream
    with st.ctx:  # the raw driver calls of this test need the context current
        gpu.driver.call("cuStreamBeginCapture", st.handle,
                        drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL)
    try:
        for layer in range(L):
            graphed.append(layer, views[layer][0], views[layer][1])
            graphed.decode_attention(q[layer], out[layer], layer)
        with pytest.raises(StateError, match="while a stream is capturing"):
            graphed.begin_step([])
    finally:
        with st.ctx:
            graph = gpu.driver.call("cuStreamEndCapture", st.handle)
    with st.ctx:
        exe = gpu.driver.call("cuGraphInstantiate", graph, 0)
    for p in (graphed, eager, cpu):
        p.new_sequence(), p.new_sequence()
    schedule = [([0, 1], [2, 1]), ([1, 0], [1, 1]), ("fork", 0), ([2, 0, 1], [1, 1, 1]),
                ("free", 1), ([2, 0], [2, 1]), ("new", None), ([3, 2, 0], [1, 1, 1])]
    keep = []
    for what, arg in schedule:
        if what == "fork":
            assert graphed.fork(arg) == eager.fork(arg) == cpu.fork(arg)
            continue
        if what == "free":
            graphed.free_sequence(arg), eager.free_sequence(arg), cpu.free(arg)
            continue
        if what == "new":
            assert graphed.new_sequence() == eager.new_sequence() == cpu.new_sequence()
            continue
        seqs, counts = what, arg
        n = sum(counts)
        xs = inputs(rng, L * 2 * B * T, np.float16).reshape(L, 2, B * T, H, D)
        graphed.begin_step(seqs, counts)
        eager.begin_step(seqs, counts)
        inp.copy_from_host(xs)
        qo.copy_from_host(rng.standard_normal(3 * L * B * H * D).astype(np.float32))
        with st.ctx:
            gpu.driver.call("cuGraphLaunch", exe, st.handle)
        for layer in range(L):
            keep += [dev(gpu, xs[layer, 0, :n]), dev(gpu, xs[layer, 1, :n])]
            eager.append(layer, keep[-2], keep[-1])
            eager.decode_attention(q[layer], ref[layer], layer)
            cpu.append_batch(layer, seqs, xs[layer, 0, :n], xs[layer, 1, :n], counts)
        graphed.advance(), eager.advance(), cpu.advance(seqs)
        for layer in range(L):
            assert out[layer].to_numpy().tobytes() == ref[layer].to_numpy().tobytes()
    same_pages(graphed, cpu)
    same_pages(eager, cpu)
    with st.ctx:
        gpu.driver.call("cuGraphExecDestroy", exe)
        gpu.driver.call("cuGraphDestroy", graph)
    inp.free(), qo.free()
    graphed.free()
    eager.free()


# ------------------------------------------------------------------ offload

@pytest.mark.parametrize("fmt", ["bf16", "int8", "q8_0"])
def test_offload_and_bring_back_bit_identical(gpu, rng, fmt):
    gp, cp = pools(gpu, fmt)
    keep = []
    a, b = gp.new_sequence(), gp.new_sequence()
    cp.new_sequence(), cp.new_sequence()
    for counts in ([3, 2], [3, 3], [1, 0]):
        step(gpu, gp, cp, [a, b], counts, rng, np.float32, keep)
    host = KVPool(spec(fmt), 10, 8)                    # another page size: content moves
    h = gp.offload(a, host)
    same_snapshot(host.snapshot(h), cp.snapshot(a))
    free_before = gp.num_free_pages
    gp.free_sequence(a)
    assert gp.num_free_pages == free_before + 2
    back = gp.bring_back(host, h)
    same_snapshot(gp.snapshot(back), cp.snapshot(a))
    gp.bring_back(host, h, seq=b)                      # in place of b
    same_snapshot(gp.snapshot(b), cp.snapshot(a))
    empty = gp.new_sequence()
    same_snapshot(gp.snapshot(empty), cp.snapshot(cp.new_sequence()))
    small = gpu.GpuKVPool(spec(fmt), 1, PS, max_batch=1, max_pages_per_seq=4)
    with pytest.raises(CapacityError, match="needs 2 pages, 1 of 1 are free"):
        small.bring_back(host, h)
    assert small.sequences == [] and small.num_free_pages == 1
    small.free()
    gp.free()


# ------------------------------------------------------------------ paged decode attention

def reference64(q, k, v):
    """float64 attention of q [Hq, D] over k, v [n, Hkv, D] (GQA: head h reads kv h // G)."""
    G = q.shape[0] // k.shape[1]
    k, v = (np.repeat(x.astype(np.float64), G, axis=1) for x in (k, v))
    s = np.einsum("hd,nhd->hn", q.astype(np.float64), k) / np.sqrt(q.shape[-1])
    w = np.exp(s - s.max(axis=1, keepdims=True))
    return np.einsum("hn,nhd->hd", w / w.sum(axis=1, keepdims=True), v)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_decode_attention_equals_cpu_pool(gpu, rng, fmt):
    """One query token per sequence, GQA 2, pages taken in a shuffled physical order, a long,
    a short, a one-position and an empty sequence, and rows past the step's sequences: the
    CPU pool's decode_attention on the same pages, within float32 rounding; zeros where a
    row attends nothing."""
    s = KVSpec(num_layers=L, num_kv_heads=H, head_dim=D, capacity=64, num_heads=2 * H, format=fmt)
    gp = gpu.GpuKVPool(s, 24, PS, max_batch=4, max_pages_per_seq=8, max_tokens=3)
    cp = KVPool(s, 24, PS)
    perm = rng.permutation(24).tolist()
    gp._table.free[:] = perm
    cp._table.free[:] = list(perm)
    a, b, d, e = (gp.new_sequence() for _ in range(4))
    for _ in range(4):
        cp.new_sequence()
    normal = lambda n: rng.standard_normal((n, H, D)).astype(np.float32)
    keep = []
    for counts in ([3, 2], [3, 3], [3, 0], [2, 1]):
        gp.begin_step([a, b], counts)
        for layer in range(L):
            k, v = normal(sum(counts)), normal(sum(counts))
            keep += [dev(gpu, k), dev(gpu, v)]
            gp.append(layer, keep[-2], keep[-1])
            cp.append_batch(layer, [a, b], k, v, counts)
        gp.advance(), cp.advance([a, b])
    q_buf = gpu.DeviceBuffer.alloc(4 * 2 * H * D * 4)
    o_buf = gpu.DeviceBuffer.alloc(4 * 2 * H * D * 4)
    q_dev, o_dev = q_buf.view((4, 2 * H, D), np.float32), o_buf.view((4, 2 * H, D), np.float32)
    for seqs, counts in (([a, b, d, e], [1, 1, 1, 0]), ([b, a], [1, 1])):
        live = [x for x, c in zip(seqs, counts) if c]
        gp.begin_step(seqs, counts)
        q = rng.standard_normal((4, 2 * H, D)).astype(np.float32)
        q_dev.copy_from_numpy(q)
        for layer in range(L):
            k, v = normal(len(live)), normal(len(live))
            keep += [dev(gpu, k), dev(gpu, v)]
            gp.append(layer, keep[-2], keep[-1])
            cp.append_batch(layer, live, k, v)
            o_buf.fill(0xFF)
            gp.decode_attention(q_dev, o_dev, layer)
            gp.check()
            got = o_dev.to_numpy()
            want = kvcore_attention(q[:len(live)], cp, layer, seqs=live)
            np.testing.assert_allclose(got[:len(live)], want, rtol=2e-5, atol=2e-5)
            for i, x in enumerate(live):   # error against float64: at most ~the CPU's
                ref = reference64(q[i], cp.dequantize(x, layer, "k", pending=True),
                                  cp.dequantize(x, layer, "v", pending=True))
                err, cpu_err = np.abs(got[i] - ref).max(), np.abs(want[i] - ref).max()
                assert err <= 2 * cpu_err + 4 * 2**-24 * np.abs(ref).max()
            assert (got[len(live):] == 0).all()
        gp.advance(), cp.advance(live)
    assert gp.length(d) == 1 and gp.length(e) == 0
    q_buf.free(), o_buf.free()
    gp.free()


def test_decode_attention_refusals(gpu):
    gp, _ = pools(gpu, "f16")
    q = gpu.DeviceBuffer.alloc(4 * H * D * 4)
    with pytest.raises(ShapeError, match=r"invalid q: expected float32 \[4, 2, 64\]"):
        gp.decode_attention(q.view((2, H, D), np.float32), q.view((2, H, D), np.float32), 0)
    with pytest.raises(ShapeError, match="invalid out"):
        gp.decode_attention(q.view((4, H, D), np.float32), q.view((4, H, D), np.int32), 0)
    q.free()
    gp.free()
