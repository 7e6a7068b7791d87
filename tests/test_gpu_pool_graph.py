"""DecodeGraph over a GpuKVPool (issue 20, items 2 and 5) and the pool's thread guard.

One graph of RoPE + paged append + paged decode attention for every layer is captured once
per pool and replayed while sequences join, finish and fork (copy-on-write) and cross page
boundaries between steps; the host rewrites the block tables, lengths and slot mapping in
place (GpuKVPool.begin_step) before each replay. The reference is a second pool running
the same steps eagerly (bit for bit) and the CPU KVPool fed the same rotated inputs (pages
byte for byte, attention within float32 rounding). TensorRT-LLM#18769 (a replayed graph
reading stale tables) is the bug these tests would catch."""
import threading

import numpy as np
import pytest

from kvcore import FORMATS, KVPool, KVSpec, SpecError, StateError
from kvcore.gpu.cache import GPU_FORMATS   # the formats the GPU kernels hold
from kvcore import apply_rope as cpu_rope
from kvcore import decode_attention as cpu_attention

from test_gpu_pool import D, H, L, PS, dev, same_pages
from _blocking import BlockingLayer

pytestmark = pytest.mark.gpu

HQ, B, PAGES = 2 * H, 3, 24


@pytest.fixture(scope="module")
def gpu():
    from kvcore import gpu
    return gpu


def make_spec(fmt):
    return KVSpec(num_layers=L, num_kv_heads=H, head_dim=D, capacity=32, num_heads=HQ, format=fmt)


class Side:
    """A GpuKVPool with its DecodeGraph, stepped by replay or eagerly."""

    def __init__(self, gpu, spec, perm, replay, **graph_kw):
        self.pool = gpu.GpuKVPool(spec, PAGES, PS, max_batch=B, max_pages_per_seq=8, max_tokens=3)
        self.pool._table.free[:] = list(perm)            # pages in a shuffled physical order
        self.graph = gpu.DecodeGraph(self.pool, dtype="float16", **graph_kw)
        self.replay = replay

    def step(self, seqs, q, k, v, junk):
        """One decode step of seqs: rows past them hold `junk` (padding: never read)."""
        n = len(seqs)
        self.pool.begin_step(seqs)
        for layer in range(L):
            for buf, x in ((self.graph.q(layer), q), (self.graph.k(layer), k), (self.graph.v(layer), v)):
                full = junk.standard_normal(buf.shape).astype(buf.dtype) * 100
                full[:n] = x[layer]
                buf.copy_from_numpy(full)
        (self.graph.replay if self.replay else self.graph.step_eager)()
        assert self.pool.advance() == [1] * n

    def outs(self):
        return [self.graph.out(layer).to_numpy() for layer in range(L)]

    def free(self):
        self.graph.destroy()
        self.pool.free()


def prefill(gpu, sides, cpu, seqs, counts, rng):
    """A multi-position step outside the graph (the pool's own append), on every pool."""
    xs = [rng.standard_normal((sum(counts), H, D)).astype(np.float16) for _ in range(2 * L)]
    keep = [dev(gpu, x) for x in xs]
    for side in sides:
        side.pool.begin_step(seqs, counts)
        for layer in range(L):
            side.pool.append(layer, keep[2 * layer], keep[2 * layer + 1])
        side.pool.advance()
    for layer in range(L):
        cpu.append_batch(xs[2 * layer], xs[2 * layer + 1], seqs=seqs, layer=layer, counts=counts)
    cpu.advance(seqs)


@pytest.mark.parametrize("fmt", GPU_FORMATS)
def test_replay_while_sequences_join_finish_fork_equals_eager_and_cpu_pool(gpu, rng, fmt):
    spec = make_spec(fmt)
    perm = rng.permutation(PAGES).tolist()
    graphed, eager = Side(gpu, spec, perm, True), Side(gpu, spec, perm, False)
    cpu = KVPool(spec, PAGES, PS)
    cpu._table.free[:] = list(perm)
    sides = (graphed, eager)

    def each(call):
        got = [call(p) for p in (graphed.pool, eager.pool, cpu)]
        assert got[0] == got[1] == got[2]
        return got[0]

    a, b = each(lambda p: p.new_sequence()), each(lambda p: p.new_sequence())
    prefill(gpu, sides, cpu, [a, b], [5, 3], rng)

    def decode(seqs):
        n = len(seqs)
        q = rng.standard_normal((L, n, HQ, D)).astype(np.float16)
        k = rng.standard_normal((L, n, H, D)).astype(np.float16)
        v = rng.standard_normal((L, n, H, D)).astype(np.float16)
        positions = np.array([cpu.length(s) for s in seqs])
        graphed.step(seqs, q, k, v, np.random.default_rng(1))
        eager.step(seqs, q, k, v, np.random.default_rng(2))   # other padding junk
        outs = graphed.outs()
        for layer, (x, y) in enumerate(zip(outs, eager.outs())):
            assert x.tobytes() == y.tobytes(), f"layer {layer}: replay != eager"
            assert (x[n:] == 0).all()                        # padding rows: zero length
        for layer in range(L):
            q_rot = graphed.graph.q(layer).to_numpy()[:n].astype(np.float32)
            k_rot = graphed.graph.k(layer).to_numpy()[:n]
            want_q = cpu_rope(q[layer].astype(np.float32), positions)
            np.testing.assert_allclose(q_rot, want_q, rtol=2e-3, atol=2e-3)
            want_k = cpu_rope(k[layer].astype(np.float32), positions)
            np.testing.assert_allclose(k_rot.astype(np.float32), want_k, rtol=2e-3, atol=2e-3)
            cpu.append_batch(k_rot, v[layer], seqs=seqs, layer=layer)
            want = cpu_attention(q_rot, cpu, layer, seqs=seqs)
            np.testing.assert_allclose(outs[layer][:n], want, rtol=2e-5, atol=2e-5)
        cpu.advance(seqs)

    decode([a, b])                     # b crosses into its second page
    decode([b, a])                     # rows swapped
    c = each(lambda p: p.new_sequence())
    decode([c, a, b])                  # c joins (its first position), a full batch
    d = each(lambda p: p.fork(a))      # a holds 8: two full pages shared
    each(lambda p: p.truncate(d, 6))   # d writes into a's shared second page next
    shared = list(graphed.pool.page_table(d))
    assert list(graphed.pool.page_table(a)) == shared and graphed.pool._table.refs[shared[1]] == 2
    decode([d, a])                     # copy-on-write of that page in begin_step
    own = list(graphed.pool.page_table(d))
    assert own[0] == shared[0] and own[1] != shared[1]
    assert list(graphed.pool.page_table(a))[:2] == shared and graphed.pool._table.refs[shared[1]] == 1
    each(lambda p: p.free_sequence(b) if p is not cpu else p.free(b))   # b finishes
    decode([a, c, d])
    decode([d])                        # a batch of one: two padding rows
    for _ in range(3):
        decode([c, d, a])
    same_pages(graphed.pool, cpu)
    same_pages(eager.pool, cpu)
    for side in sides:
        side.free()


def test_tables_written_after_capture_are_the_ones_read(gpu, rng):
    """Item 2: the graph is captured before any sequence exists (all tables -1, lengths 0),
    then replayed over tables rewritten in place: rows swapped, a batch that grows and
    shrinks, a forked sequence. The same q in every row makes stale tables visible: each
    row's output must be its own sequence's attention and differ from the other rows'.
    A kernel argument holding a host value from capture (a length, a page, a count of
    rows) would fail this test."""
    spec = make_spec("int8")
    perm = rng.permutation(PAGES).tolist()
    side = Side(gpu, spec, perm, True, rope=False)
    cpu = KVPool(spec, PAGES, PS)
    cpu._table.free[:] = list(perm)
    addresses = [getattr(side.pool, n).ptr for n in ("block_tables", "lengths", "slot_mapping")]
    a, b = side.pool.new_sequence(), side.pool.new_sequence()
    cpu.new_sequence(), cpu.new_sequence()
    prefill(gpu, (side,), cpu, [a, b], [6, 1], rng)
    one_q = rng.standard_normal((HQ, D)).astype(np.float16).astype(np.float32)   # exact in the f16 q
    tables = []

    def decode(seqs):
        n = len(seqs)
        q = np.broadcast_to(one_q, (L, n, HQ, D)).copy()
        k = rng.standard_normal((L, n, H, D)).astype(np.float16)
        v = rng.standard_normal((L, n, H, D)).astype(np.float16)
        side.step(seqs, q, k, v, np.random.default_rng(3))
        assert [getattr(side.pool, x).ptr for x in ("block_tables", "lengths", "slot_mapping")] == addresses
        tables.append(side.pool.block_tables.to_numpy().tobytes())
        for layer, out in enumerate(side.outs()):
            cpu.append_batch(k[layer], v[layer], seqs=seqs, layer=layer)
            want = cpu_attention(q[layer], cpu, layer, seqs=seqs)
            np.testing.assert_allclose(out[:n], want, rtol=2e-5, atol=2e-5)
            for i in range(1, n):      # another row's answer is far from this row's
                assert np.abs(want[i] - want[0]).max() > 1e-2
            assert (out[n:] == 0).all()
        cpu.advance(seqs)

    decode([a, b])
    decode([b, a])
    c = side.pool.fork(a)
    assert c == cpu.fork(a)
    decode([c, b, a])
    decode([b])
    decode([a, c])
    assert len(set(tables)) == len(tables)      # every replay saw other tables
    same_pages(side.pool, cpu)
    side.free()


def test_pool_graph_refusals(gpu, rng):
    spec = make_spec("f16")
    pool = gpu.GpuKVPool(spec, PAGES, PS, max_batch=B, max_pages_per_seq=8, max_tokens=3)
    with pytest.raises(SpecError, match="max_length applies to a GpuKVCache"):
        gpu.DecodeGraph(pool, max_length=8)
    graph = gpu.DecodeGraph(pool, dtype="bfloat16")
    assert graph.plan is None and graph.rows == B and graph.stream is pool.stream
    assert graph.q(0).dtype == graph.k(1).dtype and graph.k(1).shape == (B, H, D)
    with pytest.raises(StateError, match="no active set"):
        graph.active
    a = pool.new_sequence()
    with pytest.raises(StateError, match="got no step"):
        graph.replay()
    pool.begin_step([a], [2])
    with pytest.raises(StateError, match=r"got counts \[2\]"):
        graph.step_eager()
    x = dev(gpu, np.zeros((2, H, D), np.float32))
    for layer in range(L):
        pool.append(layer, x, x)
    pool.advance()
    pool.begin_step([a])
    other = gpu.Stream.create(pool.ctx)
    with pytest.raises(StateError, match="replays on the pool's stream"):
        graph.replay(stream=other)
    graph.replay(stream=pool.stream)
    pool.advance()
    assert pool.length(a) == 3
    other.destroy()
    pool.free()
    with pytest.raises(StateError, match="capture a new DecodeGraph"):
        graph.replay()
    graph.destroy()
    with pytest.raises(StateError, match="destroyed DecodeGraph"):
        graph.replay()


def test_a_pool_in_use_by_another_thread_refuses_every_call(gpu, rng):
    """While one thread is inside a GpuKVPool call, every guarded call of another thread,
    and a DecodeGraph step over that pool, raises StateError naming the call and changes
    nothing (the CPU KVPool's rule, docs/design.md "Threads")."""
    spec = make_spec("q8_0")
    pool = gpu.GpuKVPool(spec, PAGES, PS, max_batch=B, max_pages_per_seq=8, max_tokens=3)
    graph = gpu.DecodeGraph(pool, dtype="float32")
    host = KVPool(spec, PAGES, PS)
    a = pool.new_sequence()
    kv = dev(gpu, rng.standard_normal((2, H, D)).astype(np.float32))
    pool.begin_step([a], [2])
    for layer in range(L):
        pool.append(layer, kv, kv)
    pool.advance()
    snap = pool.snapshot(a)
    pool.begin_step([a])
    inside, go = threading.Event(), threading.Event()
    errors = []

    def hold():
        try:
            pool.append(BlockingLayer(0, inside, go), kv, kv)
        except BaseException as e:    # noqa: BLE001 - reported below
            errors.append(e)

    def state():
        t = pool._table
        return (list(t.free), list(t.refs), {s: (list(q.pages), q.length) for s, q in t.seqs.items()},
                pool._step, pool.block_tables.to_numpy().tobytes(), graph.q(0).to_numpy().tobytes())

    t = threading.Thread(target=hold)
    t.start()
    try:
        assert inside.wait(60)
        before = state()
        q = graph.q(0)
        calls = {"GpuKVPool.new_sequence": pool.new_sequence,
                 "GpuKVPool.free_sequence": lambda: pool.free_sequence(a),
                 "GpuKVPool.truncate": lambda: pool.truncate(a, 1),
                 "GpuKVPool.fork": lambda: pool.fork(a),
                 "GpuKVPool.begin_step": lambda: pool.begin_step([a]),
                 "GpuKVPool.append": lambda: pool.append(0, kv, kv),
                 "GpuKVPool.decode_attention": lambda: pool.decode_attention(q, graph.out(0), 0),
                 "GpuKVPool.check": pool.check, "GpuKVPool.advance": pool.advance,
                 "GpuKVPool.snapshot": lambda: pool.snapshot(a),
                 "GpuKVPool.restore": lambda: pool.restore(snap),
                 "GpuKVPool.offload": lambda: pool.offload(a, host),
                 "GpuKVPool.free": pool.free,
                 "DecodeGraph.replay": graph.replay, "DecodeGraph.step_eager": graph.step_eager}
        for op, call in calls.items():
            name = "GpuKVPool.snapshot" if op == "GpuKVPool.offload" else op   # offload snapshots
            with pytest.raises(StateError, match=f"{name}: this GpuKVPool is in use by another thread"):
                call()
            assert state() == before, op
    finally:
        go.set()
        t.join(60)
    assert not t.is_alive() and not errors
    graph.replay()        # the step goes on once the other thread is out
    pool.advance()
    assert pool.length(a) == 3
    graph.destroy()
    pool.free()


class _BlockingStream:
    """A stream argument whose handle waits for `go`: holds a DecodeGraph call inside."""

    def __init__(self, stream, inside, go):
        self._stream, self.inside, self.go = stream, inside, go

    @property
    def cuda_stream(self):
        self.inside.set()
        assert self.go.wait(60)
        return int(self._stream.ptr)


def test_a_graph_in_use_by_another_thread_refuses(gpu):
    from kvcore.gpu import GpuKVCache
    spec = KVSpec(num_layers=1, num_kv_heads=1, head_dim=64, capacity=8, num_heads=2, format="int8")
    cache = GpuKVCache(spec, slots=2)
    graph = gpu.DecodeGraph(cache, dtype="float32", rope=False)
    for name in ("q", "k", "v"):
        getattr(graph, name)(0).copy_from_numpy(np.ones(getattr(graph, name)(0).shape, np.float32))
    inside, go = threading.Event(), threading.Event()
    errors = []

    def hold():
        try:
            graph.replay(stream=_BlockingStream(graph.stream, inside, go))
        except BaseException as e:    # noqa: BLE001 - reported below
            errors.append(e)
    t = threading.Thread(target=hold)
    t.start()
    try:
        assert inside.wait(60)
        for op, call in (("replay", graph.replay), ("step_eager", graph.step_eager),
                         ("destroy", graph.destroy)):
            with pytest.raises(StateError, match=f"DecodeGraph.{op}: this DecodeGraph is in use"):
                call()
    finally:
        go.set()
        t.join(60)
    assert not t.is_alive() and not errors
    graph.synchronize()
    np.testing.assert_array_equal(cache.lengths_host(), [1, 1])    # one replay, not two
    graph.destroy()
    cache.free()
