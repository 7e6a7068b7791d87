"""DecodeGraph: a whole decode step (RoPE + append + attention per layer, then advance)
captured once and replayed. 200 replays equal 200 eager steps bit for bit; the eager
steps equal the CPU kvcore.decode_attention and a float64 reference on the same cache
content; a stale graph refuses to replay."""
import math

import numpy as np
import pytest

import kvcore
from kvcore import KVSpec
from kvcore.errors import DTypeError, StateError
from kvcore.snapshot import Snapshot

from test_gpu_attention import dequantize, random_parts, reference, rel_err

STEPS = 130   # slot lengths 0/5/40 grow past the 64- and 128-position tiles


def _fill(graph, layer, q, k, v):
    graph.q(layer).copy_from_numpy(q)
    graph.k(layer).copy_from_numpy(k)
    graph.v(layer).copy_from_numpy(v)


def _step_twins(graphs, caches, inputs, step):
    """One step of two twin graphs on the same inputs [layer] = (q, k, v): the first
    replayed, the second run eagerly; their outputs must be equal. Returns the outputs."""
    for g in graphs:
        for layer, qkv in enumerate(inputs):
            _fill(g, layer, *qkv)
    graphs[0].replay()
    graphs[1].step_eager()
    for g, c in zip(graphs, caches):
        g.synchronize()
        c.check()
    outs = []
    for layer in range(len(inputs)):
        a, b = graphs[0].out(layer).to_numpy(), graphs[1].out(layer).to_numpy()
        np.testing.assert_array_equal(a, b, err_msg=f"step {step} layer {layer}")
        outs.append(b)
    return outs


def _cpu_check(cache, spec, layer, q_rot, got):
    """The GPU output of one step against the CPU decode_attention and float64 on the
    snapshot of every slot (taken after the step: the new position is committed)."""
    for m in range(cache.slots):
        snap = cache.snapshot(m)
        k = dequantize(snap.k_codes[layer], snap.k_scales[layer] if snap.k_scales is not None else None, spec.format)
        v = dequantize(snap.v_codes[layer], snap.v_scales[layer] if snap.v_scales is not None else None, spec.format)
        ref = reference(q_rot[m].astype(np.float64), k, v, 1 / math.sqrt(spec.head_dim))
        assert rel_err(got[m], ref) < 1e-3, f"slot {m} vs float64"
        cpu = kvcore.KVCache(spec)
        cpu.restore(snap)
        theirs = np.asarray(kvcore.decode_attention(q_rot[m].astype(np.float32), cpu, layer))
        assert rel_err(got[m], theirs.astype(np.float64)) < 1e-3, f"slot {m} vs CPU decode_attention"


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["f16", "q8_0"])     # a float and a scaled format
def test_replay_equals_eager_equals_cpu(fmt, rng):
    from kvcore.gpu import GpuKVCache
    from kvcore.gpu.graph import DecodeGraph
    spec = KVSpec(num_layers=2, num_kv_heads=2, head_dim=128, capacity=512, num_heads=8, format=fmt)
    M, L = 3, spec.num_layers
    caches = [GpuKVCache(spec, slots=M) for _ in range(2)]
    for m, n in enumerate((0, 5, 40)):
        parts = random_parts(spec, n, rng)
        for c in caches:
            c.scatter(Snapshot(spec, n, *parts), m)
    graphs = [DecodeGraph(c, dtype="float16", style="neox") for c in caches]
    checks = {0, 1, 77, STEPS - 1}
    for step in range(STEPS):
        inputs = [(rng.standard_normal((M, 8, 128)).astype(np.float16),
                   rng.standard_normal((M, 2, 128)).astype(np.float16),
                   rng.standard_normal((M, 2, 128)).astype(np.float16)) for _ in range(L)]
        for layer, b in enumerate(_step_twins(graphs, caches, inputs, step)):
            assert np.isfinite(b).all()
            if step in checks:
                _cpu_check(caches[1], spec, layer, graphs[1].q(layer).to_numpy(), b)
    lengths = caches[0].lengths_host()
    np.testing.assert_array_equal(lengths, np.array([0, 5, 40]) + STEPS)
    np.testing.assert_array_equal(lengths, caches[1].lengths_host())
    for g in graphs:
        g.destroy()
    for c in caches:
        c.free()


@pytest.mark.gpu
def test_stale_graph_refuses(rng):
    from kvcore.gpu import GpuKVCache
    from kvcore.gpu.graph import DecodeGraph
    spec = KVSpec(num_layers=1, num_kv_heads=1, head_dim=64, capacity=8, num_heads=2, format="fp8_e4m3")
    cache = GpuKVCache(spec, slots=2)
    graph = DecodeGraph(cache, dtype="float32", rope=False)
    for name in ("q", "k", "v"):
        getattr(graph, name)(0).copy_from_numpy(np.ones(getattr(graph, name)(0).shape, np.float32))
    graph.replay()
    graph.synchronize()
    np.testing.assert_array_equal(cache.lengths_host(), [1, 1])
    out = graph.out(0).to_numpy()
    np.testing.assert_allclose(out, 1.0, rtol=1e-6)  # one position whose v is all ones
    cache.free()
    with pytest.raises(StateError, match="capture a new DecodeGraph"):
        graph.replay()
    graph.destroy()
    with pytest.raises(StateError, match="destroyed DecodeGraph"):
        graph.replay()


@pytest.mark.gpu
def test_graph_validation():
    from kvcore.gpu import GpuKVCache
    from kvcore.gpu.graph import DecodeGraph
    spec = KVSpec(num_layers=1, num_kv_heads=1, head_dim=64, capacity=8, format="f16")
    cache = GpuKVCache(spec, slots=1)
    with pytest.raises(DTypeError, match="invalid dtype"):
        DecodeGraph(cache, dtype="float64")
    cache.free()


@pytest.mark.gpu
def test_replay_with_variants_equals_eager_and_cpu(rng):
    """A DecodeGraph with a sliding window, sink positions, sink logits and soft-capping:
    over a GpuKVCache, replays equal eager steps bit for bit (host sinks in one graph, the
    same values as a device array in the other), and the CPU decode_attention with the same
    variants and the float64 reference; the window passes slot lengths during the steps."""
    from kvcore.gpu import GpuKVCache
    from kvcore.gpu.graph import DecodeGraph
    from _attention_reference import reference_attention
    spec = KVSpec(num_layers=2, num_kv_heads=2, head_dim=64, capacity=64, num_heads=16, format="q8_0")
    M, L, steps = 3, spec.num_layers, 6
    sinks = rng.uniform(-1, 3, 16).astype(np.float32)
    variants = dict(window=12, sink_tokens=2, softcap=5.0)
    caches = [GpuKVCache(spec, slots=M) for _ in range(2)]
    for m, n in enumerate((0, 9, 40)):
        parts = random_parts(spec, n, rng)
        for c in caches:
            c.scatter(Snapshot(spec, n, *parts), m)
    from test_gpu_attention import _device_array
    dsinks = _device_array(sinks)
    graphs = [DecodeGraph(caches[0], dtype="float32", sinks=sinks, **variants),
              DecodeGraph(caches[1], dtype="float32", sinks=dsinks, **variants)]
    assert graphs[0].plan.num_splits == 1   # W + S = 14 positions at most
    for step in range(steps):
        inputs = [tuple((rng.standard_normal(shape) * 2).astype(np.float32)
                        for shape in ((M, 16, 64), (M, 2, 64), (M, 2, 64))) for _ in range(L)]
        _step_twins(graphs, caches, inputs, step)
    for layer in range(L):
        q_rot, got = graphs[1].q(layer).to_numpy(), graphs[1].out(layer).to_numpy()
        for m in range(M):
            snap = caches[1].snapshot(m)
            scales = (None, None) if snap.k_scales is None else (snap.k_scales[layer], snap.v_scales[layer])
            k = dequantize(snap.k_codes[layer], scales[0], spec.format)
            v = dequantize(snap.v_codes[layer], scales[1], spec.format)
            ref = reference_attention(q_rot[m], k, v, scale=1 / 8, sinks=sinks, **variants)
            assert rel_err(got[m], ref) < 1e-5, f"slot {m} vs float64"
            cpu = kvcore.KVCache(spec)
            cpu.restore(snap)
            theirs = kvcore.decode_attention(q_rot[m], cpu, layer, sinks=sinks, **variants)
            assert rel_err(got[m], theirs.astype(np.float64)) < 2e-5, f"slot {m} vs CPU"
    for g in graphs:
        g.destroy()
    for c in caches:
        c.free()


@pytest.mark.gpu
def test_pool_graph_with_variants_equals_cpu_pool(rng):
    """A DecodeGraph over a GpuKVPool with the variants (host sinks: the graph keeps its own
    device copy) equals the CPU KVPool's decode_attention with the same variants, step
    after step while the window moves past page boundaries; refused variants capture
    nothing."""
    from kvcore import KVPool
    from kvcore.errors import RangeError
    from kvcore.gpu import GpuKVPool, live_bytes
    from kvcore.gpu.graph import DecodeGraph
    spec = KVSpec(num_layers=1, num_kv_heads=1, head_dim=64, capacity=64, num_heads=8, format="int8")
    gp, cp = GpuKVPool(spec, 16, 4, max_batch=2, max_pages_per_seq=8), KVPool(spec, 16, 4)
    before = live_bytes()
    with pytest.raises(RangeError, match="needs a window"):
        DecodeGraph(gp, dtype="float32", rope=False, sink_tokens=3)
    assert live_bytes() == before
    sinks = rng.uniform(0, 3, 8).astype(np.float16)          # converted exactly
    variants = dict(window=6, sink_tokens=1, softcap=3.0)
    g = DecodeGraph(gp, dtype="float32", rope=False, sinks=sinks, **variants)
    a, b = gp.new_sequence(), gp.new_sequence()
    assert [cp.new_sequence(), cp.new_sequence()] == [a, b]
    for step in range(11):
        seqs = [a, b] if step % 3 else [b]
        q = (rng.standard_normal((2, 8, 64)) * 3).astype(np.float32)
        k, v = (rng.standard_normal((2, 1, 64)).astype(np.float32) for _ in range(2))
        gp.begin_step(seqs)
        _fill(g, 0, q, k, v)
        g.replay()
        gp.advance()
        got = g.out(0).to_numpy()[:len(seqs)]
        n = len(seqs)
        cp.append_batch(k[:n], v[:n], seqs=seqs, layer=0)
        want = kvcore.decode_attention(q[:n], cp, 0, seqs=seqs, sinks=sinks, **variants)
        cp.advance(seqs)
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5, err_msg=f"step {step}")
    assert gp.length(b) == 11
    g.destroy()
    gp.free()
