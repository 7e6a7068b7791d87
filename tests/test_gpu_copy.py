"""GPU objects that own device memory or a driver handle refuse copy.copy, copy.deepcopy
and pickle with DeviceCopyError (a KVCacheError and a TypeError) saying what they hold and
how to move the content; never a shallow copy sharing device pointers (a double free) nor
a pickle of raw addresses. The way the message points to (snapshot, pickle the Snapshot,
restore into a new object) works. On a device or under the emulator (--gpu, conftest.py)."""
import copy
import pickle

import numpy as np
import pytest

from kvcore import KVCacheError, KVSpec

pytestmark = pytest.mark.gpu

SPEC = KVSpec(num_layers=1, num_kv_heads=2, head_dim=64, capacity=32, num_heads=4, format="int8")


@pytest.fixture(scope="module")
def gpu():
    from kvcore import gpu
    return gpu


def _refused(gpu, obj, holds: str, move: str) -> None:
    """copy.copy, copy.deepcopy and pickle (every protocol) of obj, alone and inside a
    container, raise DeviceCopyError naming the class, what it holds and what to do."""
    name = f"kvcore.gpu.{type(obj).__name__}"
    attempts = [("copy.copy of", copy.copy), ("copy.deepcopy of", copy.deepcopy),
                ("copy.deepcopy of", lambda o: copy.deepcopy({"held": [o]}))]
    attempts += [("pickling", lambda o, p=p: pickle.dumps(o, protocol=p))
                 for p in range(pickle.HIGHEST_PROTOCOL + 1)]
    attempts += [("pickling", lambda o: pickle.dumps({"held": [o]}))]
    for what, attempt in attempts:
        with pytest.raises(gpu.DeviceCopyError) as e:
            attempt(obj)
        message = str(e.value)
        assert message.startswith(f"{what} a {name} is refused: it holds {holds}"), message
        assert move in message, message
        assert isinstance(e.value, KVCacheError) and isinstance(e.value, TypeError)


def test_device_buffer_and_array_refuse_copies(gpu):
    buf = gpu.DeviceBuffer.from_numpy(np.arange(16, dtype=np.float32))
    arr = buf.view((4, 4), np.float32)
    try:
        _refused(gpu, buf, "device memory, which", "DeviceBuffer.from_numpy(host)")
        _refused(gpu, arr, "a view of device memory", "arr.to_numpy() gives a host copy")
        # the way the message points to, and the original untouched
        moved = gpu.DeviceBuffer.from_numpy(pickle.loads(pickle.dumps(arr.to_numpy())))
        assert np.array_equal(moved.view((4, 4), np.float32).to_numpy(), arr.to_numpy())
        assert np.array_equal(arr.to_numpy().ravel(), np.arange(16, dtype=np.float32))
        moved.free()
    finally:
        buf.free()


def test_cache_and_plan_refuse_copies_and_move_by_snapshot(gpu, rng):
    cache = gpu.GpuKVCache(SPEC, 2)
    other = gpu.GpuKVCache(SPEC, 2)
    plan = gpu.AttentionPlan(cache, num_splits=2)
    try:
        k = rng.standard_normal((3, 2, 64)).astype(np.float32)
        v = rng.standard_normal((3, 2, 64)).astype(np.float32)
        kb, vb = gpu.DeviceBuffer.from_numpy(k), gpu.DeviceBuffer.from_numpy(v)
        cache.append(0, kb.view(k.shape, k.dtype), vb.view(v.shape, v.dtype), slot=1)
        cache.advance(slot=1, steps=3)
        cache.check()
        kb.free(), vb.free()
        _refused(gpu, cache, "device memory (its K/V codes, scales and metadata) and a stream",
                 "cache.snapshot(slot) gives a host Snapshot")
        assert plan.workspace_bytes > 0
        _refused(gpu, plan, "device memory (its split workspace)", "AttentionPlan(cache, ...)")
        # the way the message points to: a pickled snapshot restored into another cache
        snap = pickle.loads(pickle.dumps(cache.snapshot(1)))
        other.restore(snap, 0)
        assert other.lengths_host().tolist() == [3, 0]
        for a, b in zip(cache.snapshot(1).__dict__.values(), other.snapshot(0).__dict__.values()):
            assert np.array_equal(a, b) if isinstance(a, np.ndarray) else a == b
        assert cache.lengths_host().tolist() == [0, 3]   # the original is untouched
    finally:
        plan.free()
        other.free()
        cache.free()


def test_pool_refuses_copies_and_moves_by_snapshot(gpu, rng):
    pool = gpu.GpuKVPool(SPEC, 8, 16, max_batch=2, max_pages_per_seq=2, max_tokens=4)
    other = gpu.GpuKVPool(SPEC, 8, 16, max_batch=2, max_pages_per_seq=2)
    try:
        seq = pool.new_sequence()
        pool.begin_step([seq], [5])
        k = rng.standard_normal((5, 2, 64)).astype(np.float32)
        kb = gpu.DeviceBuffer.from_numpy(k)
        pool.append(0, kb.view(k.shape, k.dtype), kb.view(k.shape, k.dtype))
        pool.advance()
        kb.free()
        _refused(gpu, pool, "device memory (its pages and step metadata) and a stream",
                 "pool.snapshot(seq) gives a host Snapshot")
        moved = other.restore(pickle.loads(pickle.dumps(pool.snapshot(seq))))
        assert other.length(moved) == pool.length(seq) == 5
        assert np.array_equal(other.snapshot(moved).k_codes, pool.snapshot(seq).k_codes)
    finally:
        other.free()
        pool.free()


def test_graph_stream_event_and_context_refuse_copies(gpu):
    cache = gpu.GpuKVCache(SPEC, 2)
    graph = gpu.DecodeGraph(cache, dtype="float32")
    stream = gpu.Stream.create()
    event = gpu.Event.create()
    try:
        _refused(gpu, graph, "device memory (its input and output buffers) and a captured CUDA graph",
                 "DecodeGraph(storage, ...)")
        _refused(gpu, stream, "a CUDA stream handle", "Stream.create()")
        _refused(gpu, event, "a CUDA event handle", "Event.create()")
        _refused(gpu, gpu.Context.get(), "the device's retained primary context", "Context.get(device)")
        graph.replay()            # still works after the refused copies
        graph.synchronize()
    finally:
        event.destroy()
        stream.destroy()
        graph.destroy()
        cache.free()
