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

STEPS = 200


def _fill(graph, layer, q, k, v):
    graph.q(layer).copy_from_numpy(q)
    graph.k(layer).copy_from_numpy(k)
    graph.v(layer).copy_from_numpy(v)


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
@pytest.mark.parametrize("fmt", ["int8", "f16", "q8_0"])
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
        for g in graphs:
            for layer in range(L):
                _fill(g, layer, *inputs[layer])
        graphs[0].replay()
        graphs[1].step_eager()
        for g, c in zip(graphs, caches):
            g.synchronize()
            c.check()
        for layer in range(L):
            a, b = graphs[0].out(layer).to_numpy(), graphs[1].out(layer).to_numpy()
            np.testing.assert_array_equal(a, b, err_msg=f"step {step} layer {layer}")
            assert np.isfinite(a).all()
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
