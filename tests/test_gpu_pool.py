"""GpuKVPool, on a device or under the emulator (--gpu, conftest.py).

The reference is the CPU KVPool driven by the same calls: the same PageTable gives the same
page ids, so every held page must hold the same bytes on both sides (and the codes must be
kvcore.quantize's). Device memory starts poisoned (0xFF), so a byte a kernel should not
write shows up."""
import contextlib

import numpy as np
import pytest

from kvcore import decode_attention as kvcore_attention
from kvcore.gpu.cache import GPU_FORMATS   # the formats the GPU kernels hold
from kvcore import (FORMATS, CapacityError, DTypeError, FormatError, KVPool, KVSpec,
                    NonFiniteError, OutOfRangeError, RangeError, ShapeError, SnapshotError,
                    StateError, quantize)

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


@contextlib.contextmanager
def captured(gpu, st):
    """Captures what the with-block launches on stream st (global mode, the stream's
    context current for the raw driver calls); yields a list that holds the instantiated
    graph and the graph, [exec, graph], once the block ends (the capture ends however the
    block does)."""
    drv, made = gpu.driver.cuda(), []
    with st.ctx:
        gpu.driver.call("cuStreamBeginCapture", st.handle,
                        drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL)
    try:
        yield made
    finally:
        with st.ctx:
            graph = gpu.driver.call("cuStreamEndCapture", st.handle)
    with st.ctx:
        made += [gpu.driver.call("cuGraphInstantiate", graph, 0), graph]


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
        cp.append_batch(k, v, seqs=seqs, layer=layer, counts=counts)
    assert gp.advance() == counts
    cp.advance(seqs)


def spy_copies(monkeypatch):
    """The (srcPitch, dstPitch, WidthInBytes, Height, Depth) of every cuMemcpy3DAsync
    kvcore issues from now on."""
    from kvcore.gpu import driver
    seen, real = [], driver.call

    def spy(name, *args):
        if name == "cuMemcpy3DAsync":
            p = args[0]
            seen.append((int(p.srcPitch), int(p.dstPitch), int(p.WidthInBytes), int(p.Height),
                         int(p.Depth)))
        return real(name, *args)

    monkeypatch.setattr(driver, "call", spy)
    return seen


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

@pytest.mark.parametrize("fmt", GPU_FORMATS)
def test_append_fork_truncate_equal_cpu_pool(gpu, rng, fmt):
    """Ragged steps, a fork whose next writes copy a shared page on the device, a truncate
    and a free: pages, refs and snapshots equal the CPU pool's after every step."""
    gp, cp = pools(gpu, fmt)
    dtype = IN_DTYPES[GPU_FORMATS.index(fmt) % 3]
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
    cp.append_batch(k0, k0, seqs=[a], layer=0), cp.append_batch(k0, k0, seqs=[a], layer=1)
    cp.advance([a])
    codes, scales = quantize(k0, fmt)
    row = cp._table.rows(a, 3, 4)[0]
    got = gp.keys(1).to_numpy().reshape(-1, H, FORMATS[fmt].code_width(D))[row]
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
        cp.append_batch(k[:2], k[:2], seqs=[a], layer=layer, counts=[2])
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


def test_append_of_fewer_rows_than_the_step_refused(gpu, rng):
    """An append whose k holds fewer rows than the step's new positions would leave
    positions to be committed unwritten: eagerly it is refused on the host; in a graph
    captured for fewer tokens than a later step's, the device refuses the whole launch
    and advance raises, commits nothing and leaves every byte of the pool as it was."""
    gp, cp = pools(gpu, "int8", max_batch=2, max_tokens=2)
    a, b = gp.new_sequence(), gp.new_sequence()
    cp.new_sequence(), cp.new_sequence()
    one, two = dev(gpu, inputs(rng, 1, np.float32)), dev(gpu, inputs(rng, 2, np.float32))
    gp.begin_step([a, b])
    with pytest.raises(ShapeError, match="the step has 2 new positions, k holds 1 rows"):
        gp.append(0, one, one)
    gp.free()

    gp, cp = pools(gpu, "int8", max_batch=2, max_tokens=2)
    a, b = gp.new_sequence(), gp.new_sequence()
    cp.new_sequence(), cp.new_sequence()
    st = gp.stream
    with captured(gpu, st) as made:
        for layer in range(L):
            gp.append(layer, one, one)              # captured for steps of one token
    before = gp._data.view((gp._data.nbytes,), np.uint8).to_numpy()
    for seqs, counts in (([a], [2]), ([a, b], [1, 1])):
        gp.begin_step(seqs, counts)
        with st.ctx:
            gpu.driver.call("cuGraphLaunch", made[0], st.handle)
        with pytest.raises(ShapeError, match="fewer input rows than the step's 2 new positions"):
            gp.advance()
        assert gp._data.view((gp._data.nbytes,), np.uint8).to_numpy().tobytes() == before.tobytes()
        assert gp.length(a) == gp.length(b) == 0
    gp.begin_step([b])                               # one token: the graph fits the step
    with st.ctx:
        gpu.driver.call("cuGraphLaunch", made[0], st.handle)
    assert gp.advance() == [1]
    x = one.to_numpy()
    for layer in range(L):
        cp.append_batch(x, x, seqs=[b], layer=layer, counts=[1])
    cp.advance([b])
    same_snapshot(gp.snapshot(b), cp.snapshot(b))
    with st.ctx:
        gpu.driver.call("cuGraphExecDestroy", made[0])
        gpu.driver.call("cuGraphDestroy", made[1])
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
    sequences join, fork and finish between steps (new block tables, lengths, query offsets
    and slots each step, 1 or 2 tokens per sequence): the pages equal the CPU pool's, the
    outputs a pool run eagerly, bit for bit, and the eager ones the CPU pool's attention."""
    B, T = 3, 2
    graphed, eager = (pools(gpu, "q8_0", max_batch=B, max_tokens=T)[0] for _ in range(2))
    cpu = KVPool(spec("q8_0"), 24, PS)
    inp = gpu.DeviceBuffer.alloc(L * 2 * B * T * H * D * 2)
    views = [[inp.view((B * T, H, D), np.float16, offset=((l * 2 + w) * B * T * H * D) * 2)
              for w in range(2)] for l in range(L)]
    R = B * T   # a row per input row: every new token of the step (causal)
    qo = gpu.DeviceBuffer.alloc(3 * L * R * H * D * 4)     # q, graphed out, eager out per layer
    q, out, ref = ([qo.view((R, H, D), np.float32, offset=((i * L + l) * R * H * D) * 4)
                    for l in range(L)] for i in range(3))
    st = graphed.stream
    with captured(gpu, st) as made:  # the raw driver calls of this test need the context current
        for layer in range(L):
            graphed.append(layer, views[layer][0], views[layer][1])
            graphed.decode_attention(q[layer], out[layer], layer)
        with pytest.raises(StateError, match="while a stream is capturing"):
            graphed.begin_step([])
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
        qo.copy_from_host(rng.standard_normal(3 * L * R * H * D).astype(np.float32))
        with st.ctx:
            gpu.driver.call("cuGraphLaunch", made[0], st.handle)
        for layer in range(L):
            keep += [dev(gpu, xs[layer, 0, :n]), dev(gpu, xs[layer, 1, :n])]
            eager.append(layer, keep[-2], keep[-1])
            eager.decode_attention(q[layer], ref[layer], layer)
            cpu.append_batch(xs[layer, 0, :n], xs[layer, 1, :n], seqs=seqs, layer=layer, counts=counts)
            want = kvcore_attention(q[layer].to_numpy()[:n], cpu, layer, seqs=seqs, counts=counts)
            np.testing.assert_allclose(ref[layer].to_numpy()[:n], want, rtol=2e-5, atol=2e-5)
        graphed.advance(), eager.advance(), cpu.advance(seqs)
        for layer in range(L):
            assert out[layer].to_numpy().tobytes() == ref[layer].to_numpy().tobytes()
    same_pages(graphed, cpu)
    same_pages(eager, cpu)
    with st.ctx:
        gpu.driver.call("cuGraphExecDestroy", made[0])
        gpu.driver.call("cuGraphDestroy", made[1])
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


def test_page_copies_pitch_is_one_page_however_large_the_pool(gpu, rng, monkeypatch):
    """Every page copy (copy-on-write, offload, bring_back) is one cuMemcpy3DAsync whose
    pitch on each side is one page of the region (the page is its y, the layer its z), so
    a pool whose layer region passes 2^31 - 1 bytes (the driver's largest pitch) copies
    as a small one does."""
    seen = spy_copies(monkeypatch)
    gp, cp = pools(gpu, "q8_0")
    a = gp.new_sequence()
    cp.new_sequence()
    step(gpu, gp, cp, [a], [PS + 1], rng, np.float32, [])
    gp.fork(a)                                     # the partial page is copied
    host = KVPool(spec("q8_0"), 10, PS)
    gp.bring_back(host, gp.offload(a, host))
    assert len(seen) >= 3 * 4                      # (fork, offload, bring_back) x 4 regions
    rows = {gp._row[r] * PS for r in gp._regions()}
    for src_pitch, dst_pitch, width, height, depth in seen:
        assert src_pitch == dst_pitch == width and width in rows and (height, depth) == (1, L)
    gp.free()


# ------------------------------------------------------------------ paged decode attention

def reference64(q, k, v, scale):
    """float64 (out, lse) of q [Hq, D] over k, v [n, Hkv, D] (GQA: head h reads kv h // G)."""
    G = q.shape[0] // k.shape[1]
    k, v = (np.repeat(x.astype(np.float64), G, axis=1) for x in (k, v))
    s = np.einsum("hd,nhd->hn", q.astype(np.float64), k) * scale
    top = s.max(axis=1, keepdims=True)
    w = np.exp(s - top)
    return (np.einsum("hn,nhd->hd", w / w.sum(axis=1, keepdims=True), v),
            top[:, 0] + np.log(w.sum(axis=1)))


DECODE_CASES = [   # format, GQA ratio, head_dim, page_size, max_pages_per_seq, q dtype
    ("f32", 1, 112, 4, 8, np.float32),     # 32 positions at most: one split
    ("f16", 8, 64, 4, 80, np.float16),
    ("bf16", 1, 64, 16, 8, np.float32),    # 128: one split
    ("int8", 8, 96, 4, 80, np.float32),
    ("fp8_e4m3", 8, 80, 16, 20, np.float32),
    ("fp8_e5m2", 1, 128, 4, 80, np.float32),
    ("q8_0", 8, 96, 4, 80, np.float32),    # 3 f16 scales per row: 2-byte aligned rows
    ("q4_0", 4, 96, 4, 80, np.float16),    # 48-byte code rows, 2-byte aligned scale rows
    ("q4_1", 2, 128, 16, 20, np.float32),  # (d, m) pairs
    ("q8_0/q4_0", 8, 128, 16, 20, np.float16),   # K/V pairs: each side in its format
    ("f16/q4_0", 1, 96, 4, 80, np.float32),      # K without scales, V's 2-byte aligned
]


@pytest.mark.parametrize("fmt,group,head_dim,ps,max_pages,q_dtype", DECODE_CASES)
def test_decode_attention_equals_cpu_pool(gpu, rng, fmt, group, head_dim, ps, max_pages, q_dtype):
    """A step of 2, 0, 3 and 1 new tokens (rows packed in step order, causal) for a short
    sequence, an empty one, a long one (split over the context when the tables allow more
    than 128 positions) and a new one (one position), pages in a shuffled physical order:
    out and lse equal the CPU pool's decode_attention on the same pages within float32
    rounding (causal and not), err against float64 at most about the CPU's; rows past the
    step's tokens give zeros and lse -inf."""
    Hkv, R = 2, 12
    s = KVSpec(num_layers=1, num_kv_heads=Hkv, head_dim=head_dim, capacity=max_pages * ps,
               num_heads=group * Hkv, format=fmt)
    Hq, pages = s.num_heads, 2 * max_pages + 4
    gp = gpu.GpuKVPool(s, pages, ps, max_batch=4, max_pages_per_seq=max_pages, max_tokens=3)
    cp = KVPool(s, pages, ps)
    assert (gp.num_splits > 1) == (max_pages * ps > 128)
    perm = rng.permutation(pages).tolist()
    gp._table.free[:] = perm
    cp._table.free[:] = list(perm)
    short, empty, long_, new = (cp.new_sequence() for _ in range(4))
    normal = lambda n: rng.standard_normal((n, Hkv, head_dim)).astype(np.float32)
    before = [5, max_pages * ps - 3]
    cp.append_batch(normal(sum(before)), normal(sum(before)), seqs=[short, long_], layer=0, counts=before)
    cp.advance([short, long_])
    for x in (short, empty, long_, new):
        assert gp.bring_back(cp, x) == x if cp.length(x) else gp.new_sequence() == x
    seqs, counts = [short, empty, long_, new], [2, 0, 3, 1]
    gp.begin_step(seqs, counts)
    k, v = normal(6), normal(6)
    kd, vd = dev(gpu, k), dev(gpu, v)
    gp.append(0, kd, vd)
    live = [x for x, c in zip(seqs, counts) if c]
    cp.append_batch(k, v, seqs=seqs, layer=0, counts=counts)
    q = rng.standard_normal((R, Hq, head_dim)).astype(q_dtype)
    qd = dev(gpu, q)
    q32 = q.astype(np.float32)[:6]
    buf = gpu.DeviceBuffer.alloc(4 * R * Hq * (head_dim + 1))
    out = buf.view((R, Hq, head_dim), np.float32)
    lse = buf.view((R, Hq), np.float32, offset=4 * R * Hq * head_dim)
    scale = 1 / np.sqrt(head_dim)
    for causal in (True, False):
        buf.fill(0xFF)
        gp.decode_attention(qd, out, 0, lse=lse, causal=causal)
        gp.check()
        got, got_lse = out.to_numpy(), lse.to_numpy()
        want, want_lse = kvcore_attention(q32, cp, 0, seqs=seqs, counts=counts, causal=causal,
                                          return_lse=True)
        np.testing.assert_allclose(got[:6], want, rtol=2e-5, atol=2e-5)
        np.testing.assert_allclose(got_lse[:6], want_lse, rtol=2e-6, atol=2e-6)
        assert (got[6:] == 0).all() and (got_lse[6:] == -np.inf).all()
        r = 0
        for x, c in zip(seqs, counts):
            kk, vv = (cp.dequantize(x, 0, w, pending=True) for w in ("k", "v"))
            for t in range(c):
                n = len(kk) - c + t + 1 if causal else len(kk)
                ref, ref_lse = reference64(q32[r], kk[:n], vv[:n], scale)
                err, cpu_err = np.abs(got[r] - ref).max(), np.abs(want[r] - ref).max()
                assert err <= 2 * cpu_err + 4 * 2**-24 * np.abs(ref).max(), (x, t)
                assert np.abs(got_lse[r] - ref_lse).max() <= 4e-6 * (1 + np.abs(ref_lse).max())
                r += 1
    gp.advance(), cp.advance(live)
    assert gp.length(new) == 1 and gp.length(empty) == 0 and gp.length(long_) == max_pages * ps
    buf.free()
    gp.free()


@pytest.mark.parametrize("fmt", ["f16", "q8_0"])
def test_a_windowed_pool_releases_pages_as_the_cpu_pool_does(gpu, rng, fmt):
    """GpuKVPool(window=, sink_tokens=) keeps the CPU KVPool's bookkeeping (the same
    PageTable): step after step (prefill chunks, a fork) both hold the same pages, -1
    where the window released one, and the same free list; decode_attention takes the
    pool's window (a larger one is refused) and equals the CPU pool's; snapshots hold
    the same positions, bit for bit; a windowed sequence goes to a windowed CPU pool and
    back, or restores into a new sequence, with the pages its window needs only."""
    W, S = 6, 2
    gp = gpu.GpuKVPool(spec(fmt), 24, PS, max_batch=4, max_pages_per_seq=16, max_tokens=7,
                       window=W, sink_tokens=S)
    cp = KVPool(spec(fmt), 24, PS, window=W, sink_tokens=S)
    assert (gp.window, gp.sink_tokens) == (W, S)
    a, b = gp.new_sequence(), gp.new_sequence()
    assert [cp.new_sequence(), cp.new_sequence()] == [a, b]
    keep, c = [], None
    for counts in ([7, 3], [1, 1], [5, 1], [1, 1], [1, 6], [1, 1], [2, 1]):
        seqs = [a, b] if c is None else [a, b, c]
        counts = counts + [1] * (len(seqs) - 2)
        q = rng.standard_normal((sum(counts), H, D)).astype(np.float32)
        gp.begin_step(seqs, counts)
        for layer in range(L):
            k, v = inputs(rng, sum(counts), np.float32), inputs(rng, sum(counts), np.float32)
            keep += [dev(gpu, k), dev(gpu, v)]
            gp.append(layer, keep[-2], keep[-1])
            cp.append_batch(k, v, seqs=seqs, layer=layer, counts=counts)
            out = dev(gpu, np.zeros_like(q))
            gp.decode_attention(dev(gpu, q), out, layer)
            want = kvcore_attention(q, cp, layer, seqs=seqs, counts=counts)
            np.testing.assert_allclose(out.to_numpy(), want, rtol=2e-5, atol=2e-5)
        assert gp.advance() == counts
        cp.advance(seqs)
        for x in seqs:
            assert gp.page_table(x).tolist() == cp.page_table(x).tolist()
            assert gp.first_held(x) == cp.first_held(x) and gp.held(x) == cp.held(x)
        assert gp._table.free == cp._table.free and gp._table.refs == cp._table.refs
        if c is None and cp.first_held(a):
            c = gp.fork(a)
            assert cp.fork(a) == c
    assert cp.first_held(a) > 0 and -1 in gp.page_table(a).tolist()
    gp.begin_step([a], [0])
    with pytest.raises(RangeError, match=f"takes window <= {W}"):
        gp.decode_attention(dev(gpu, q[:1]), dev(gpu, np.zeros_like(q[:1])), 0, window=W + 1)
    assert gp.advance() == [0]
    same_snapshot(gp.snapshot(a), cp.snapshot(a))
    assert gp.snapshot(a).start == cp.snapshot(a).start > 0
    host = KVPool(spec(fmt), 24, PS, window=W, sink_tokens=S)
    h = gp.offload(a, host)
    assert host.held(h) == cp.held(a)
    back = gp.bring_back(host, h)
    assert gp.held(back) == cp.held(a)
    same_snapshot(gp.snapshot(back), cp.snapshot(a))
    with pytest.raises(SnapshotError, match="window"):
        gpu.GpuKVPool(spec(fmt), 24, PS, max_batch=1, max_pages_per_seq=16).restore(cp.snapshot(a))
    gp.free()


WINDOW_CASES = [   # format, GQA ratio, head_dim, page_size, max_pages_per_seq, window, sink_tokens
    ("q8_0", 8, 64, 4, 24, 11, 3),       # one split; the windows start mid-page
    ("fp8_e4m3", 1, 80, 16, 24, 150, 5),  # several splits over the window (run-time D)
]


@pytest.mark.parametrize("fmt,group,head_dim,ps,max_pages,window,sink_tokens", WINDOW_CASES)
def test_decode_attention_window_with_released_pages(gpu, rng, fmt, group, head_dim, ps, max_pages,
                                                     window, sink_tokens):
    """A step of 3, 1, 2 and 0 new tokens with a sliding window, sink positions, sink logits
    and soft-capping: the block-table entries of every page wholly outside what the step's
    rows see are -1 (as a windowed pool that released them would have it), and page -1 of
    the decoded layer is poisoned (NaN codes and scales), so a read of one shows. out and
    lse equal the CPU pool's decode_attention with the same variants within float32
    rounding and the float64 reference within the usual bounds; a window with causal=False
    and a host sinks array first seen while capturing are refused, launching nothing."""
    from _attention_reference import reference_attention
    Hkv, R = 2, 8
    s = KVSpec(num_layers=2, num_kv_heads=Hkv, head_dim=head_dim, capacity=max_pages * ps,
               num_heads=group * Hkv, format=fmt)
    Hq, pages = s.num_heads, 3 * max_pages
    gp = gpu.GpuKVPool(s, pages, ps, max_batch=4, max_pages_per_seq=max_pages, max_tokens=2)
    cp = KVPool(s, pages, ps)
    perm = rng.permutation(pages).tolist()
    gp._table.free[:] = perm
    cp._table.free[:] = list(perm)
    long_, new, short, idle = (cp.new_sequence() for _ in range(4))
    normal = lambda n: rng.standard_normal((n, Hkv, head_dim)).astype(np.float32)
    before = {long_: max_pages * ps - 3, short: 2 * ps + 1, idle: 7}
    for layer in range(2):
        cp.append_batch(normal(sum(before.values())), normal(sum(before.values())),
                        seqs=list(before), layer=layer, counts=list(before.values()))
    cp.advance(list(before))
    for x in (long_, new, short, idle):
        assert gp.bring_back(cp, x) == x if cp.length(x) else gp.new_sequence() == x
    seqs, counts = [long_, new, short, idle], [3, 1, 2, 0]
    gp.begin_step(seqs, counts)
    for layer in range(2):
        k, v = normal(6), normal(6)
        gp.append(layer, dev(gpu, k), dev(gpu, v))
        cp.append_batch(k, v, seqs=seqs, layer=layer, counts=counts)
    gp.check()
    # release what no row sees: pages wholly outside [0, S) and [first window start, n)
    tables = gp.block_tables.to_numpy()
    released = 0
    for b, (x, c) in enumerate(zip(seqs, counts)):
        n = cp.length(x) + c
        lo = max(0, n - c + 1 - window) if c else n
        keep = set(range(-(-min(sink_tokens, lo) // ps))) | set(range(lo // ps, -(-n // ps)))
        for i in range(-(-n // ps)):
            if i not in keep:
                tables[b, i] = -1
                released += 1
    assert released >= 5
    gp.block_tables.copy_from_numpy(tables)
    for view in ((gp.keys(0), gp.values(0)) + ((gp.key_scales(0), gp.value_scales(0))
                                                if s.fmt.quantized else ())):
        host = view.to_numpy()
        host.view(np.uint8)[-1] = 0xFF     # layer 0's last page: what page -1 of layer 1 reads
        view.copy_from_numpy(host)
    sinks = rng.uniform(-1, 4, Hq).astype(np.float32)
    variants = dict(window=window, sink_tokens=sink_tokens, sinks=sinks, softcap=6.0)
    q = (rng.standard_normal((R, Hq, head_dim)) * 3).astype(np.float32)
    buf = gpu.DeviceBuffer.alloc(4 * R * Hq * (head_dim + 1))
    out = buf.view((R, Hq, head_dim), np.float32)
    lse = buf.view((R, Hq), np.float32, offset=4 * R * Hq * head_dim)
    buf.fill(0xFF)
    qd = dev(gpu, q)
    gp.decode_attention(qd, out, 1, lse=lse, **variants)
    gp.check()
    got, got_lse = out.to_numpy(), lse.to_numpy()
    want, want_lse = kvcore_attention(q[:6], cp, 1, seqs=seqs, counts=counts, return_lse=True,
                                      **variants)
    np.testing.assert_allclose(got[:6], want, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(got_lse[:6], want_lse, rtol=2e-6, atol=2e-6)
    assert (got[6:] == 0).all() and (got_lse[6:] == sinks).all()   # rows seeing nothing
    r = 0
    for x, c in zip(seqs, counts):
        if not c:
            continue
        kk, vv = (cp.dequantize(x, 1, w, pending=True) for w in ("k", "v"))
        ref, ref_lse = reference_attention(q[r:r + c], kk, vv, scale=1 / np.sqrt(head_dim),
                                           return_lse=True, **variants)
        err, cpu_err = np.abs(got[r:r + c] - ref).max(), np.abs(want[r:r + c] - ref).max()
        assert err <= 2 * cpu_err + 4 * 2**-24 * np.abs(ref).max(), x
        assert np.abs(got_lse[r:r + c] - ref_lse).max() <= 4e-6 * (1 + np.abs(ref_lse).max())
        r += c
    assert gp._window_splits(window + sink_tokens) == (2 if window > 128 else 1)  # W + S positions
    # refused: nothing launched (out stays as it is)
    buf.fill(0x7F)
    before_out = out.to_numpy().tobytes()
    from kvcore.errors import RangeError
    with pytest.raises(RangeError, match="needs causal"):
        gp.decode_attention(qd, out, 1, causal=False, window=window)
    with pytest.raises(ShapeError, match="sinks"):
        gp.decode_attention(qd, out, 1, sinks=sinks[:-1])
    st = gp.stream
    with captured(gpu, st) as made:
        with pytest.raises(StateError, match="host sinks are copied to the device at their "
                                             "first use"):
            gp.decode_attention(qd, out, 1, sinks=sinks + 1)
        gp.decode_attention(qd, out, 1, **variants)   # seen before: captured as it is
    assert out.to_numpy().tobytes() == before_out
    with st.ctx:
        gpu.driver.call("cuGraphLaunch", made[0], st.handle)
    gp.check()
    assert out.to_numpy().tobytes() == got.tobytes()
    with st.ctx:
        gpu.driver.call("cuGraphExecDestroy", made[0])
        gpu.driver.call("cuGraphDestroy", made[1])
    gp.advance()
    buf.free()
    gp.free()


def test_decode_attention_head_dims(gpu):
    """Every multiple of 16 up to 256 has a decode kernel; another head_dim keeps the pool
    (append, pages) but its decode_attention refuses, naming the supported ones."""
    from kvcore.gpu.attention import HEAD_DIMS
    assert HEAD_DIMS == tuple(range(16, 257, 16))
    gp = gpu.GpuKVPool(spec("f16").replace(head_dim=40), 4, PS, max_batch=1, max_pages_per_seq=1)
    q = gpu.DeviceBuffer.alloc(2 * H * 40 * 4)
    with pytest.raises(FormatError, match="head_dim a multiple of 16 from 16 to 256, got 40"):
        gp.decode_attention(q.view((1, H, 40), np.float32), q.view((1, H, 40), np.float32), 0)
    q.free()
    gp.free()


def test_decode_attention_refusals(gpu):
    gp, _ = pools(gpu, "f16")
    q = gpu.DeviceBuffer.alloc(4 * H * D * 4)
    with pytest.raises(ShapeError, match=r"invalid q: expected float32, float16 or bfloat16 "
                                         r"\[R, 2, 64\] with 1 <= R <= 12"):
        gp.decode_attention(q.view((2, H, 2 * D), np.float32), q.view((2, H, D), np.float32), 0)
    with pytest.raises(ShapeError, match="invalid out"):
        gp.decode_attention(q.view((4, H, D), np.float32), q.view((4, H, D), np.int32), 0)
    with pytest.raises(ShapeError, match=r"invalid shape of lse: expected \[4, 2\]"):
        gp.decode_attention(q.view((4, H, D), np.float32), q.view((4, H, D), np.float32), 0,
                            lse=q.view((4, 4), np.float32))
    a = gp.new_sequence()
    gp.begin_step([a], [3])
    with pytest.raises(ShapeError, match="the step has 3 new tokens, q holds 2 rows"):
        gp.decode_attention(q.view((2, H, D), np.float32), q.view((2, H, D), np.float32), 0)
    gp.advance()
    q.free()
    gp.free()


def test_append_and_decode_outside_a_step_refused(gpu, rng):
    """After advance() no step is open and the metadata is the last step's, whose positions
    are committed: an eager append would overwrite them (check() saw nothing). It, and
    decode_attention, now raise StateError naming the call and launch nothing. A launch
    into a capturing stream is let through (it runs when replayed, inside a step), and
    such a graph replayed after advance() writes nothing: the device slot mapping is -1
    once a step ends."""
    gp, cp = pools(gpu, "int8")
    a = gp.new_sequence()
    cp.new_sequence()
    keep = []
    step(gpu, gp, cp, [a], [2], rng, np.float32, keep)

    def data():
        return gp._data.view((gp._data.nbytes,), np.uint8).to_numpy().tobytes()

    before = data()
    assert (gp.slot_mapping.to_numpy() == -1).all()
    xs = inputs(rng, 2, np.float32)
    x = dev(gpu, xs)
    for layer in range(L):
        with pytest.raises(StateError, match=r"^GpuKVPool.append outside a step: call "
                                             r"begin_step\(seqs, counts\) first"):
            gp.append(layer, x, x)
    q = dev(gpu, rng.standard_normal((4, H, D)).astype(np.float32))
    out = dev(gpu, np.full((4, H, D), 7.0, np.float32))
    with pytest.raises(StateError, match="^GpuKVPool.decode_attention outside a step"):
        gp.decode_attention(q, out, 0)
    assert (out.to_numpy() == 7.0).all()
    gp.check()
    assert data() == before and gp.length(a) == 2
    same_pages(gp, cp)

    st = gp.stream
    with captured(gpu, st) as made:
        for layer in range(L):
            gp.append(layer, x, x)                   # captured: no step needed
    assert data() == before
    gp.begin_step([a])                               # in a step the replay writes it
    with st.ctx:
        gpu.driver.call("cuGraphLaunch", made[0], st.handle)
    assert gp.advance() == [1]
    for layer in range(L):
        cp.append_batch(xs[:1], xs[:1], seqs=[a], layer=layer)
    cp.advance([a])
    same_pages(gp, cp)
    before = data()
    with st.ctx:                                     # after advance: writes nothing
        gpu.driver.call("cuGraphLaunch", made[0], st.handle)
    gp.check()
    assert data() == before and gp.length(a) == 3
    same_pages(gp, cp)
    with st.ctx:
        gpu.driver.call("cuGraphExecDestroy", made[0])
        gpu.driver.call("cuGraphDestroy", made[1])
    gp.free()


@pytest.mark.parametrize("bad", [0.0, np.float64(0), True, False, "0", None], ids=repr)
def test_ids_that_are_not_ints_refused(gpu, rng, bad):
    """As the CPU pool: 0.0, np.float64(0) and False equal sequence 0 but are no ids: every
    call taking one raises DTypeError naming it and changes nothing; so do a
    non-iterable seqs or counts."""
    gp, cp = pools(gpu, "f16")
    a = gp.new_sequence()
    cp.new_sequence()
    step(gpu, gp, cp, [a], [2], rng, np.float32, [])
    snap = gp.snapshot(a)

    def state():
        t = gp._table
        return (list(t.free), list(t.refs), {s: (list(q.pages), q.length) for s, q in t.seqs.items()},
                t._next_id, gp._step, gp.block_tables.to_numpy().tobytes())

    before = state()
    calls = {"begin_step": lambda: gp.begin_step([bad]),
             "begin_step, two": lambda: gp.begin_step([a, bad], [1, 1]),
             "length": lambda: gp.length(bad), "page_table": lambda: gp.page_table(bad),
             "fork": lambda: gp.fork(bad), "truncate": lambda: gp.truncate(bad, 0),
             "free_sequence": lambda: gp.free_sequence(bad),
             "snapshot": lambda: gp.snapshot(bad),
             "restore": lambda: gp.restore(snap, seq=bad)}
    if bad is None:
        del calls["restore"]                          # seq=None: a new sequence
    for name, call in calls.items():
        with pytest.raises(DTypeError, match="invalid type of (sequence id|seqs)"):
            call()
        assert state() == before, name
    with pytest.raises(DTypeError, match="invalid type of seqs: expected a sequence of "
                                         "sequence ids"):
        gp.begin_step(a)
    with pytest.raises(DTypeError, match=r"invalid type of counts: .* got int \(5\)"):
        gp.begin_step([a], counts=5)
    assert state() == before
    gp.free()
