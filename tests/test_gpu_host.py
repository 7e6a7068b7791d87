"""Host-side rules of the GPU layer that a first run on a real device depends on: which
driver loads the shipped PTX, contexts pushed and popped at every entry (any thread may
call), handles released when their owner is collected, replay refused over freed memory,
and kvcore's synchronous calls refused while any of its streams captures.

The `emulator` fixture restarts the emulated machine with other settings (an older driver,
two devices); those tests run under the emulator only."""
import dataclasses
import gc
import glob
import os
import threading

import numpy as np
import pytest

from kvcore import KVSpec
from kvcore.errors import CudaError, StateError
from kvcore.gpu import _ptx as ptx

pytestmark = pytest.mark.gpu

CUDA_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "cuda")
SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=64, capacity=32, num_heads=4, format="int8")


@pytest.fixture
def emulator():
    """start(**use_emulator settings): a fresh emulated machine; the session's is restored
    afterwards. Skips on a real device."""
    from kvcore import gpu
    session = gpu._emu.config()
    if session is None:
        pytest.skip("the session runs kvcore on a real device")

    def start(**kw):
        gc.collect()
        gpu.use_emulator(**kw)

    yield start
    gc.collect()
    gpu.use_emulator(**dataclasses.asdict(session))


def _leaks_since(serial):
    from kvcore import gpu
    from kvcore.gpu._emu import driver as emu
    gc.collect()
    cached = {int(c.order_event._handle) for c in gpu.Context._contexts.values()
              if c.order_event is not None and c.order_event._handle is not None}
    return [x for x in emu.leaks_since(serial) if x.handle not in cached]


def _rows(rng, shape):
    return rng.standard_normal(shape).astype(np.float16)


def _step(gpu, cache, rng, *, stream=None):
    """One append of every layer and an advance; returns the inputs (kept alive)."""
    xs = [gpu.DeviceBuffer.from_numpy(_rows(rng, (cache.slots, 2, 64))) for _ in range(2)]
    kv = [x.view((cache.slots, 2, 64), np.float16) for x in xs]
    for layer in range(SPEC.num_layers):
        cache.append(layer, kv[0], kv[1], stream=stream)
    cache.advance(stream=stream)
    return xs


# ------------------------------------------------------------------ 1. PTX ISA

@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(CUDA_DIR, "*.ptx"))),
                         ids=os.path.basename)
def test_shipped_ptx_loads_on_drivers_from_cuda_12_2(path):
    m = ptx.parse(open(path, "rb").read())
    assert m.version <= (8, 2), f"{path}: .version {m.version_text} needs a driver newer than R535"
    assert ptx.first_driver(m.version) <= 12020
    assert m.target == "sm_80"


def test_kernels_load_and_run_on_a_cuda_12_2_driver(emulator, rng):
    emulator(driver_version=12020)
    from kvcore import gpu
    cache = gpu.GpuKVCache(SPEC, slots=2)
    xs = _step(gpu, cache, rng)
    q = gpu.DeviceBuffer.from_numpy(_rows(rng, (2, 4, 64)))
    gpu.apply_rope(q.view((2, 4, 64), np.float16), cache)
    out = gpu.decode_attention(q.view((2, 4, 64), np.float16), cache, 0)
    assert np.isfinite(out.to_numpy()).all() and list(cache.lengths_host()) == [1, 1]
    out.owner.free()
    for x in (q, *xs):
        x.free()
    cache.free()


def test_a_load_failure_names_the_driver_and_leaks_nothing(emulator, tmp_path, monkeypatch):
    """A module the driver cannot JIT (here: ISA 9.0 on a CUDA 12.2 driver): CudaError with
    the JIT log and the driver's version, and no stream or memory left behind."""
    emulator(driver_version=12020)
    from kvcore import gpu
    from kvcore.gpu import kernels
    from kvcore.gpu._emu import driver as emu
    shipped = kernels.ptx_path("kv_append")
    newer = tmp_path / "kv_append.ptx"
    text = open(shipped, "rb").read()
    newer.write_bytes(text.replace(b".version " + text.split(b".version ")[1].split(b"\n")[0],
                                   b".version 9.0", 1))
    monkeypatch.setattr(kernels, "ptx_path", lambda module: str(newer))
    mark = emu.live_serial()
    with pytest.raises(CudaError, match=r"(?s)UNSUPPORTED_PTX_VERSION.*the driver is CUDA 12\.2 "
                                        r"\(12020\).*JIT log:.*Unsupported \.version 9\.0"):
        gpu.GpuKVCache(SPEC, slots=2)
    assert _leaks_since(mark) == [] and gpu.live_bytes() == 0


# ------------------------------------------------------------------ 3. contexts and threads

def _in_thread(fn):
    """Runs fn on a new thread (no context current there); re-raises what it raised."""
    err = []

    def body():
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test's thread
            err.append(e)
    t = threading.Thread(target=body)
    t.start()
    t.join()
    if err:
        raise err[0]


def _current_context():
    from kvcore.gpu import driver
    driver.init()
    return int(driver.call("cuCtxGetCurrent") or 0)


def test_every_entry_works_from_a_worker_thread(rng):
    """Each public entry, called first thing on a fresh thread (no context current there),
    runs, and leaves that thread without a current context."""
    from kvcore import gpu
    from kvcore.gpu.graph import DecodeGraph
    cache = gpu.GpuKVCache(SPEC, slots=2)
    graph = DecodeGraph(cache, dtype="float16")
    plan = gpu.AttentionPlan(cache, q_dtype="float16", num_splits=2)
    q = gpu.DeviceBuffer.from_numpy(_rows(rng, (2, 4, 64)))
    out = gpu.DeviceBuffer.zeros(2 * 4 * 64 * 4)
    k = gpu.DeviceBuffer.from_numpy(_rows(rng, (2, 2, 64)))
    kv = k.view((2, 2, 64), np.float16)
    seen = {}
    steps = [
        ("append", lambda: cache.append(0, kv, kv)),
        ("append", lambda: cache.append(1, kv, kv)),
        ("advance", lambda: cache.advance()),
        ("check", lambda: cache.check()),
        ("length", lambda: seen.setdefault("length", cache.length(1))),
        ("truncate", lambda: cache.truncate(1, 0)),
        ("plan.run", lambda: plan.run(q.view((2, 4, 64), np.float16), out.view((2, 4, 64), np.float32), 0)),
        ("replay", lambda: graph.replay()),
        ("synchronize", lambda: graph.synchronize()),
        ("lengths", lambda: seen.setdefault("lengths", list(cache.lengths_host()))),
        ("to_numpy", lambda: seen.setdefault("out", out.view((2, 4, 64), np.float32).to_numpy())),
        ("DecodeGraph.destroy", graph.destroy), ("plan.free", plan.free),
        ("DeviceBuffer.free", q.free), ("DeviceBuffer.free", out.free), ("DeviceBuffer.free", k.free),
        ("GpuKVCache.free", cache.free),
    ]
    for name, fn in steps:
        def call():
            fn()
            seen[name + " current"] = _current_context()
        _in_thread(call)
        assert seen[name + " current"] == 0, f"{name} left its context current on the thread"
    assert seen["length"] == 1 and seen["lengths"] == [2, 1]
    assert np.isfinite(seen["out"]).all()


def test_the_threads_current_context_is_left_as_it_was(rng):
    """Context.get, every call and the GC finalizers leave the calling thread's current
    context alone (runtime-API code such as torch's relies on it)."""
    from kvcore import gpu
    seen = {}

    def work():
        seen["before"] = _current_context()
        gpu.Context.get(0)
        cache = gpu.GpuKVCache(SPEC, slots=2)
        xs = _step(gpu, cache, rng)
        cache.check()
        seen["after_calls"] = _current_context()
        del cache, xs
        gc.collect()  # the finalizers free memory and destroy the stream
        seen["after_gc"] = _current_context()

    _in_thread(work)
    assert seen == {"before": 0, "after_calls": 0, "after_gc": 0}


# ------------------------------------------------------------------ 8. lifetimes

def test_dropped_cache_and_graph_release_every_handle(emulator, rng):
    emulator()
    from kvcore import gpu
    from kvcore.gpu._emu import driver as emu
    from kvcore.gpu.graph import DecodeGraph
    mark = emu.live_serial()
    cache = gpu.GpuKVCache(SPEC, slots=2)
    graph = DecodeGraph(cache, dtype="float16")
    graph.replay()
    assert _leaks_since(mark) != []
    del graph, cache
    assert _leaks_since(mark) == [] and gpu.live_bytes() == 0


def test_replay_after_the_plan_was_freed_is_refused(rng):
    from kvcore import gpu
    from kvcore.gpu.graph import DecodeGraph
    cache = gpu.GpuKVCache(SPEC, slots=2)
    graph = DecodeGraph(cache, dtype="float16", max_length=SPEC.capacity)
    assert graph.plan.num_splits > 1 or graph.plan.workspace_bytes == 0
    graph.plan.free()
    with pytest.raises(StateError, match="AttentionPlan was freed"):
        graph.replay()
    with pytest.raises(StateError, match="AttentionPlan was freed"):
        graph.step_eager()
    cache.check()  # nothing ran
    assert list(cache.lengths_host()) == [0, 0]
    graph.destroy()
    cache.free()


# ------------------------------------------------------------------ capture seen on any kvcore stream

def test_sync_calls_refused_while_a_non_blocking_stream_captures_globally(rng):
    """A global-mode capture on a non-blocking stream does not show on the legacy stream;
    kvcore's allocations and synchronous copies are still refused with StateError, before
    the driver sees them, and the capture stays valid."""
    from kvcore import gpu
    from kvcore.gpu import driver
    cache = gpu.GpuKVCache(SPEC, slots=2)
    buf = gpu.DeviceBuffer.zeros(64)
    s = gpu.Stream.create(non_blocking=True)
    drv = driver.cuda()
    driver.call("cuCtxPushCurrent", s.ctx.handle)  # raw driver calls need the context current
    driver.call("cuStreamBeginCapture", s.handle,
                drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL)
    try:
        buf.fill(1, stream=s)
        for what, call in (("alloc", lambda: gpu.DeviceBuffer.alloc(64)),
                           ("free", buf.free),
                           ("copy", lambda: buf.copy_to_host(np.zeros(4, np.uint8))),
                           ("length", lambda: cache.length(0))):
            with pytest.raises(StateError, match="while a stream is capturing"):
                call()
    finally:
        graph = driver.call("cuStreamEndCapture", s.handle)  # still valid: no CudaError
        driver.call("cuGraphDestroy", graph)
        driver.call("cuCtxPopCurrent")
    s.destroy()
    buf.free()
    cache.free()


# ------------------------------------------------------------------ 2. devices

class _Foreign:
    """A foreign device array: CAI v3 only, or DLPack only (as torch and CuPy export)."""

    def __init__(self, arr, *, cai: bool):
        self.arr, self.cai = arr, cai

    @property
    def __cuda_array_interface__(self):
        if not self.cai:
            raise AttributeError("__cuda_array_interface__")
        return self.arr.__cuda_array_interface__

    def __dlpack_device__(self):
        return self.arr.__dlpack_device__()

    def __dlpack__(self, *, stream=None, **kwargs):
        return self.arr.__dlpack__()


@pytest.mark.parametrize("cai", [True, False], ids=["cai", "dlpack"])
def test_a_cache_on_device_1_with_foreign_inputs(emulator, rng, cai):
    emulator(devices=2)
    from kvcore import gpu
    from kvcore.errors import ShapeError
    from kvcore.quant import quantize
    c0, c1 = gpu.Context.get(0), gpu.Context.get(1)
    cache = gpu.GpuKVCache(SPEC, slots=2, device=1)
    x = _rows(rng, (2, 2, 64))
    on1 = gpu.DeviceBuffer.from_numpy(x, ctx=c1)
    on0 = gpu.DeviceBuffer.from_numpy(x, ctx=c0)
    k1 = _Foreign(on1.view((2, 2, 64), np.float16), cai=cai)
    k0 = _Foreign(on0.view((2, 2, 64), np.float16), cai=cai)
    with pytest.raises(ShapeError, match="invalid device of k: the array is on device 0, expected device 1"):
        cache.append(0, k0, k1)
    cache.append(0, k1, k1)
    cache.append(1, k1, k1)
    cache.advance()
    q = gpu.DeviceBuffer.from_numpy(_rows(rng, (2, 4, 64)), ctx=c1)
    gpu.apply_rope(_Foreign(q.view((2, 4, 64), np.float16), cai=cai), cache)
    out = gpu.decode_attention(_Foreign(q.view((2, 4, 64), np.float16), cai=cai), cache, 0)
    assert out.ctx is c1 and np.isfinite(out.to_numpy()).all()
    cache.check()
    codes, _ = quantize(x.astype(np.float32), "int8")
    assert np.array_equal(cache.keys(0).to_numpy()[:, :, 0], codes)
    for b in (out.owner, q, on0, on1):
        b.free()
    cache.free()


# ------------------------------------------------------------------ 7. synchronous calls wait for every stream

def test_sync_calls_wait_for_work_kvcore_queued_on_other_streams(rng):
    """append/advance on another stream, and a DecodeGraph replay (on the graph's stream),
    are seen by the next length()/check()/lengths_host() without synchronising those
    streams by hand (the emulator runs a queued stream only when something waits on it)."""
    from kvcore import gpu
    from kvcore.errors import NonFiniteError
    from kvcore.gpu.graph import DecodeGraph
    cache = gpu.GpuKVCache(SPEC, slots=2)
    s = gpu.Stream.create(non_blocking=True)
    xs = _step(gpu, cache, rng, stream=s)
    assert cache.length(0) == 1
    bad = gpu.DeviceBuffer.from_numpy(np.full((2, 2, 64), np.nan, np.float16))
    cache.append(0, bad.view((2, 2, 64), np.float16), bad.view((2, 2, 64), np.float16), stream=s)
    with pytest.raises(NonFiniteError):
        cache.check()
    graph = DecodeGraph(cache, dtype="float16")
    graph.replay()
    assert list(cache.lengths_host()) == [2, 2]
    cache.truncate(0, 1)  # after the replay finished: the replay's advance cannot overwrite it
    graph.synchronize()
    assert list(cache.lengths_host()) == [1, 2]
    graph.destroy()
    for x in (*xs, bad):
        x.free()
    s.destroy()
    cache.free()


# ------------------------------------------------------------------ 9. slots on gridDim.z

def test_a_plan_over_more_than_65535_slots_is_refused():
    from kvcore import gpu
    from kvcore.errors import ShapeError
    spec = KVSpec(num_layers=1, num_kv_heads=1, head_dim=64, capacity=1, format="int8")
    cache = gpu.GpuKVCache(spec, slots=65536)
    with pytest.raises(ShapeError, match="at most 65535 slots .* the cache has 65536"):
        gpu.AttentionPlan(cache, q_dtype="float32")
    cache.free()


# ------------------------------------------------------------------ 4/5/6. streams of foreign inputs and exports

class _Produced:
    """A foreign array written on its own non-blocking stream (still pending when handed
    over), exported as torch does: CAI without a stream (v2-like), and DLPack whose
    `__dlpack__(stream=s)` makes s wait for the producer's work (the DLPack contract)."""

    def __init__(self, gpu, x, *, cai_stream=None):
        self.gpu, self.host, self.cai_stream = gpu, np.ascontiguousarray(x), cai_stream
        self.buf = gpu.DeviceBuffer.alloc(self.host.nbytes)
        self.stream = gpu.Stream.create(non_blocking=True)
        self.buf.copy_from_host(self.host, stream=self.stream)
        self.arr = self.buf.view(x.shape, x.dtype)

    @property
    def __cuda_array_interface__(self):
        return dict(self.arr.__cuda_array_interface__, stream=self.cai_stream)

    def __dlpack_device__(self):
        return self.arr.__dlpack_device__()

    def __dlpack__(self, *, stream=None, **kwargs):
        if stream != -1:
            d, ctx = self.gpu.driver, self.arr.ctx
            ev = self.gpu.Event.create(ctx, timing=False)
            ev.record(stream=self.stream)
            d.call("cuCtxPushCurrent", ctx.handle)
            d.call("cuStreamWaitEvent", d.stream_handle(1 if stream is None else stream), ev.handle, 0)
            d.call("cuCtxPopCurrent")
            ev.destroy()
        return self.arr.__dlpack__()

    def free(self):
        self.stream.synchronize()
        self.stream.destroy()
        self.buf.free()


def test_inputs_with_cai_and_dlpack_are_taken_through_dlpack(rng):
    """torch's CAI names no stream; its DLPack orders the consumer. Through CAI the append
    would read the producer's memory before the copy (NaN poison under the emulator)."""
    from kvcore import gpu
    from kvcore.quant import quantize
    cache = gpu.GpuKVCache(SPEC, slots=2)
    x = _rows(rng, (2, 2, 64))
    k = _Produced(gpu, x)
    cache.append(0, k, k)
    cache.advance(slot=None)
    cache.check()
    codes, _ = quantize(x.astype(np.float32), "int8")
    assert np.array_equal(cache.keys(0).to_numpy()[:, :, 0], codes)
    k.free()
    cache.free()


class _CaiOnly:
    def __init__(self, arr, stream):
        self.__cuda_array_interface__ = dict(arr.__cuda_array_interface__, stream=stream)


def test_a_legacy_stream_input_while_capturing_is_a_clear_error(rng):
    """CAI "stream": 1 (CuPy's default) while the cache's stream captures: StateError
    before anything is recorded, and the capture stays valid; "stream": 0 is refused."""
    from kvcore import gpu
    from kvcore.errors import DTypeError
    from kvcore.gpu import driver
    cache = gpu.GpuKVCache(SPEC, slots=2)
    buf = gpu.DeviceBuffer.from_numpy(_rows(rng, (2, 2, 64)))
    arr = buf.view((2, 2, 64), np.float16)
    with pytest.raises(DTypeError, match="stream 0 is disallowed"):
        cache.append(0, _CaiOnly(arr, 0), _CaiOnly(arr, 0))
    drv = driver.cuda()
    driver.call("cuCtxPushCurrent", cache.ctx.handle)
    driver.call("cuStreamBeginCapture", cache.stream.handle,
                drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL)
    try:
        with pytest.raises(StateError, match="pending on the legacy default stream.*not part of the capture"):
            cache.append(0, _CaiOnly(arr, 1), _CaiOnly(arr, 1))
        cache.append(0, arr, arr)  # the capture goes on
    finally:
        graph = driver.call("cuStreamEndCapture", cache.stream.handle)  # valid: no CudaError
        driver.call("cuGraphDestroy", graph)
        driver.call("cuCtxPopCurrent")
    buf.free()
    cache.free()


def test_exports_order_the_consumer_after_the_caches_work(rng):
    """cache.keys(l).__dlpack__(stream=s) makes s wait for the append still queued on the
    cache's stream; CAI names the cache's stream."""
    from kvcore import gpu
    from kvcore.gpu import driver
    cache = gpu.GpuKVCache(SPEC, slots=2)
    keys = cache.keys(0)
    assert keys.__cuda_array_interface__["stream"] == cache.stream.ptr
    before = cache.lengths.to_numpy()  # synchronous: nothing queued yet
    xs = _step(gpu, cache, rng)  # queued on the cache's stream
    consumer = gpu.Stream.create(non_blocking=True)
    capsule = cache.lengths.__dlpack__(stream=consumer.ptr)
    assert capsule is not None
    out = np.zeros(2, np.int32)
    with cache.ctx:
        driver.call("cuMemcpyDtoHAsync", out.ctypes.data, driver.cuda().CUdeviceptr(cache.lengths.ptr),
                    out.nbytes, consumer.handle)
    consumer.synchronize()
    assert list(before) == [0, 0] and list(out) == [1, 1]
    del capsule
    consumer.destroy()
    for x in xs:
        x.free()
    cache.free()


# ------------------------------------------------------------------ 10. per-slot status

def test_one_bad_slot_does_not_stop_the_batch(rng):
    """A NaN row in slot 1 and a full slot 2: their steps are not committed, slot 0's is;
    the next check names both slots and why, and clears them."""
    from kvcore import gpu
    from kvcore.errors import NonFiniteError
    spec = KVSpec(num_layers=1, num_kv_heads=2, head_dim=64, capacity=2, num_heads=4, format="int8")
    cache = gpu.GpuKVCache(spec, slots=3)
    y = gpu.DeviceBuffer.from_numpy(_rows(rng, (2, 2, 64)))
    cache.append(0, y.view((2, 2, 64), np.float16), y.view((2, 2, 64), np.float16), slot=2)
    cache.advance(slot=2, steps=2)  # slot 2 is full
    x = _rows(rng, (3, 2, 64))
    x[1, 1, 5] = np.nan
    xb = gpu.DeviceBuffer.from_numpy(x)
    xv = xb.view((3, 2, 64), np.float16)
    cache.append(0, xv, xv)
    cache.advance()
    with pytest.raises(NonFiniteError, match=r"2 slot\(s\) \(slot 1: non-finite input \(NaN or inf\); "
                                             r"slot 2: capacity 2 reached\)"):
        cache.check()
    assert list(cache.lengths_host()) == [1, 0, 2]
    cache.check()  # cleared
    for b in (y, xb):
        b.free()
    cache.free()


def test_a_graph_replays_with_another_set_of_active_slots(rng):
    """Idle slots of a DecodeGraph are neither appended to nor committed."""
    from kvcore import gpu
    from kvcore.gpu.graph import DecodeGraph
    cache = gpu.GpuKVCache(SPEC, slots=3)
    graph = DecodeGraph(cache, dtype="float16")
    for layer in range(SPEC.num_layers):
        graph.k(layer).copy_from_numpy(_rows(rng, (3, 2, 64)))
        graph.v(layer).copy_from_numpy(_rows(rng, (3, 2, 64)))
    graph.active.copy_from_numpy(np.array([1, 0, 1], np.int32))
    for _ in range(3):
        graph.replay()
    graph.synchronize()
    graph.active.copy_from_numpy(np.array([0, 1, 0], np.int32))
    graph.replay()
    cache.check()
    assert list(cache.lengths_host()) == [3, 1, 3]
    graph.destroy()
    cache.free()
