"""The emulated CUDA driver (kvcore.gpu._emu.driver) keeps the real driver's rules: a current
context per thread, streams that run only when waited on (a missing dependency reads stale
data), capture refusals that invalidate the capture, graph replay, launch checks against
the PTX .entry, bounds-checked copies, use after free, out of memory, leak reports, two
devices, the PTX ISA a driver version reads.

Each test starts a fresh emulated machine (`machine(...)`) and restores the session's after.
"""
import ctypes
import dataclasses
import gc
import json
import os
import threading

import numpy as np
import pytest

import kvcore
from kvcore import gpu
from kvcore.errors import CudaError, ShapeError, StateError
from kvcore.gpu import kernels as gpu_kernels
from kvcore.gpu._emu import driver as emu
from cuda.bindings import driver as drv   # the calls go through cuda-python's real bindings
from kvcore.gpu import _ptx as ptx

pytestmark = [pytest.mark.gpu, pytest.mark.emu]

R = drv.CUresult
MODES = drv.CUstreamCaptureMode


@pytest.fixture
def machine():
    """start(**config) -> cuda-python's driver bindings over a fresh emulated machine
    (kvcore.gpu.use_emulator), cuInit done, device 0's primary context current; the
    session's machine is restored after."""
    session = gpu._emu.config()

    def start(init=True, **kw):
        gc.collect()
        gpu.use_emulator(**kw)
        if init:
            ok(drv.cuInit(0))
            ctx = ok(drv.cuDevicePrimaryCtxRetain(ok(drv.cuDeviceGet(0))))
            ok(drv.cuCtxSetCurrent(ctx))
        return drv

    yield start
    gc.collect()
    gpu.use_emulator(**(dataclasses.asdict(session) if session is not None else {}))


def ok(result):
    err, *values = result
    assert err == R.CUDA_SUCCESS, f"{err.name}: {emu.error_detail(err)}"
    return None if not values else values[0] if len(values) == 1 else tuple(values)


def fails(result, code, match=None):
    assert result[0] == code, f"expected {code.name}, got {result[0].name}"
    if match is not None:
        detail = emu.error_detail(code)
        assert detail is not None and match in detail, detail


def read(ptr, n, dtype=np.uint8):
    out = np.empty(n, dtype)
    ok(drv.cuMemcpyDtoH(out.ctypes.data, ptr, out.nbytes))
    return out


def write(ptr, arr):
    ok(drv.cuMemcpyHtoD(ptr, arr.ctypes.data, arr.nbytes))


# ------------------------------------------------------------------ contexts, threads

def test_calls_need_cuinit_and_a_current_context(machine):
    d = machine(init=False)
    fails(d.cuDeviceGetCount(), R.CUDA_ERROR_NOT_INITIALIZED)
    fails(d.cuMemAlloc(16), R.CUDA_ERROR_NOT_INITIALIZED)
    ok(d.cuDriverGetVersion())  # needs no cuInit, as the real one
    ok(d.cuInit(0))
    fails(d.cuMemAlloc(16), R.CUDA_ERROR_INVALID_CONTEXT, "no context is current")
    ctx = ok(d.cuDevicePrimaryCtxRetain(ok(d.cuDeviceGet(0))))
    ok(d.cuCtxPushCurrent(ctx))
    p = ok(d.cuMemAlloc(16))
    seen = {}

    def worker():  # another OS thread has no current context until it sets one
        seen["before"] = d.cuMemAlloc(16)[0]
        seen["current"] = int(ok(d.cuCtxGetCurrent()))
        ok(d.cuCtxSetCurrent(ctx))
        q = ok(d.cuMemAlloc(16))
        ok(d.cuMemFree(q))
        seen["after"] = R.CUDA_SUCCESS
    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen == {"before": R.CUDA_ERROR_INVALID_CONTEXT, "current": 0, "after": R.CUDA_SUCCESS}
    assert int(ok(d.cuCtxPopCurrent())) == int(ctx)
    fails(d.cuMemFree(p), R.CUDA_ERROR_INVALID_CONTEXT)
    fails(d.cuCtxPopCurrent(), R.CUDA_ERROR_INVALID_CONTEXT)
    ok(d.cuCtxSetCurrent(ctx))
    ok(d.cuMemFree(p))
    fails(d.cuDeviceGet(1), R.CUDA_ERROR_INVALID_DEVICE)
    ok(d.cuDevicePrimaryCtxRelease(ok(d.cuDeviceGet(0))))
    fails(d.cuMemAlloc(16), R.CUDA_ERROR_INVALID_CONTEXT, "was released")


def test_driver_version_and_device_properties(machine):
    d = machine(driver_version=12020, memory_bytes=1 << 20)
    assert ok(d.cuDriverGetVersion()) == 12020
    dev = ok(d.cuDeviceGet(0))
    A = d.CUdevice_attribute
    assert ok(d.cuDeviceGetAttribute(A.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev)) == 132
    assert (ok(d.cuDeviceGetAttribute(A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev)),
            ok(d.cuDeviceGetAttribute(A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev))) == (9, 0)
    assert ok(d.cuDeviceTotalMem(dev)) == 1 << 20
    assert ok(d.cuDeviceGetName(64, dev)).split(b"\0")[0].startswith(b"kvcore emulated GPU 0")
    assert ok(d.cuGetErrorName(R.CUDA_ERROR_STREAM_CAPTURE_INVALIDATED)) == b"CUDA_ERROR_STREAM_CAPTURE_INVALIDATED"
    assert int(R.CUDA_ERROR_UNSUPPORTED_PTX_VERSION) == 222 and int(R.CUDA_ERROR_STREAM_CAPTURE_IMPLICIT) == 906


# ------------------------------------------------------------------ memory

def test_out_of_range_copy_use_after_free_double_free(machine):
    d = machine()
    p = int(ok(d.cuMemAlloc(64)))
    host = np.arange(64, dtype=np.uint8)
    write(p, host)
    assert np.array_equal(read(p, 64), host)
    big = np.zeros(65, np.uint8)
    fails(d.cuMemcpyHtoD(p, big.ctypes.data, 65), R.CUDA_ERROR_INVALID_VALUE, "runs 1 bytes past the end")
    fails(d.cuMemcpyDtoH(big.ctypes.data, p + 8, 57), R.CUDA_ERROR_INVALID_VALUE, "past the end")
    fails(d.cuMemsetD8(p - 1, 0, 4), R.CUDA_ERROR_INVALID_VALUE, "not inside any live device allocation")
    fails(d.cuMemsetD8(12345, 0, 4), R.CUDA_ERROR_INVALID_VALUE)
    ok(d.cuMemFree(p))
    fails(d.cuMemcpyDtoH(big.ctypes.data, p, 8), R.CUDA_ERROR_INVALID_VALUE, "use after free")
    fails(d.cuMemsetD8(p, 0, 8), R.CUDA_ERROR_INVALID_VALUE, "freed device memory")
    fails(d.cuMemFree(p), R.CUDA_ERROR_INVALID_VALUE, "double free")
    q = int(ok(d.cuMemAlloc(64)))
    fails(d.cuMemFree(q + 8), R.CUDA_ERROR_INVALID_VALUE, "not the start")
    fails(d.cuMemcpyDtoD(q, q + 32, 33), R.CUDA_ERROR_INVALID_VALUE, "past the end")
    assert read(q, 4).tolist() == [0xFF] * 4  # new memory is poisoned
    ok(d.cuMemFree(q))


def test_out_of_memory_and_mem_get_info(machine):
    d = machine(memory_bytes=1 << 20)
    assert ok(d.cuMemGetInfo()) == (1 << 20, 1 << 20)
    p = ok(d.cuMemAlloc(3 << 18))
    assert ok(d.cuMemGetInfo()) == (1 << 18, 1 << 20)
    fails(d.cuMemAlloc((1 << 18) + 1), R.CUDA_ERROR_OUT_OF_MEMORY, "262145 bytes requested, 262144")
    q = ok(d.cuMemAlloc(1 << 18))
    ok(d.cuMemFree(p))
    ok(d.cuMemFree(q))
    assert ok(d.cuMemGetInfo()) == (1 << 20, 1 << 20)
    # through kvcore: the message names call, result and the emulator's reason
    if gpu.using_emulator():
        with pytest.raises(CudaError, match=r"^cuMemAlloc: CUDA_ERROR_OUT_OF_MEMORY: out of memory "
                                            r"\(2097152 bytes requested, 1048576 of 1048576 free"):
            gpu.DeviceBuffer.alloc(2 << 20)


def test_leaks_are_reported(machine):
    d = machine()
    mark = emu.live_serial()
    p = ok(d.cuMemAlloc(100))
    s = ok(d.cuStreamCreate(0))
    ev = ok(d.cuEventCreate(0))
    leaked = emu.leaks_since(mark)
    assert [(x.kind, x.nbytes) for x in leaked] == [("memory", 100), ("stream", 0), ("event", 0)]
    assert all("test_emu_driver.py" in x.where for x in leaked), leaked
    ok(d.cuStreamDestroy(s))
    ok(d.cuEventDestroy(ev))
    assert [x.kind for x in emu.leaks_since(mark)] == ["memory"]
    ok(d.cuDevicePrimaryCtxRelease(ok(d.cuDeviceGet(0))))  # release frees it, and reports it
    assert [(x.kind, x.handle) for x in emu.leaks()] == [("memory", int(p))]


def test_pointer_attributes_and_two_devices(machine):
    d = machine(devices=2)
    ctx0 = ok(d.cuCtxGetCurrent())
    p0 = int(ok(d.cuMemAlloc(256)))
    ctx1 = ok(d.cuDevicePrimaryCtxRetain(ok(d.cuDeviceGet(1))))
    ok(d.cuCtxSetCurrent(ctx1))
    p1 = int(ok(d.cuMemAlloc(128)))
    A = d.CUpointer_attribute
    attrs = [A.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, A.CU_POINTER_ATTRIBUTE_CONTEXT,
             A.CU_POINTER_ATTRIBUTE_MEMORY_TYPE, A.CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
             A.CU_POINTER_ATTRIBUTE_RANGE_SIZE]
    got = ok(d.cuPointerGetAttributes(len(attrs), attrs, p1 + 100))
    assert got[0] == 1 and int(got[1]) == int(ctx1)   # 12.9.0 compares handles by identity
    assert d.CUmemorytype(got[2]) == d.CUmemorytype.CU_MEMORYTYPE_DEVICE
    assert int(got[3]) == p1 and got[4] == 128
    assert ok(d.cuPointerGetAttribute(A.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, p0 + 3)) == 0
    assert int(ok(d.cuPointerGetAttribute(A.CU_POINTER_ATTRIBUTE_CONTEXT, p0))) == int(ctx0)
    fails(d.cuPointerGetAttribute(A.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, 8), R.CUDA_ERROR_INVALID_VALUE)
    # an unknown pointer gives the NULL values: ordinal -2 (which 12.9.0 reads as an unsigned int)
    assert ok(d.cuPointerGetAttributes(1, attrs[:1], 8))[0] in (-2, 2**32 - 2)
    # device 0's memory is not device 1's: copies and frees in the wrong context are refused
    fails(d.cuMemsetD8(p0, 0, 4), R.CUDA_ERROR_INVALID_VALUE, "memory of device 0")
    fails(d.cuMemFree(p0), R.CUDA_ERROR_INVALID_VALUE, "device 0's context")
    ok(d.cuMemFree(p1))
    ok(d.cuCtxSetCurrent(ctx0))
    ok(d.cuMemFree(p0))


def test_two_devices_through_kvcore(machine):
    if not gpu.using_emulator():
        pytest.skip("the session runs kvcore on a real device; kvcore's backend stays there")
    machine(devices=2, init=False)
    c0, c1 = gpu.Context.get(0), gpu.Context.get(1)
    assert (c0.ordinal, c1.ordinal) == (0, 1) and c0.handle != c1.handle
    b1 = gpu.DeviceBuffer.from_numpy(np.arange(8, dtype=np.int32), ctx=c1)
    assert c1.live_bytes == 32 and c0.live_bytes == 0
    assert np.array_equal(b1.view((8,), np.int32).to_numpy(), np.arange(8))
    b1.free()
    with pytest.raises(CudaError, match="out of range"):
        gpu.Context.get(2)


# ------------------------------------------------------------------ streams and events

def test_streams_run_only_when_waited_on(machine):
    d = machine()
    p = int(ok(d.cuMemAlloc(16)))
    ok(d.cuMemsetD8(p, 1, 16))
    nb = ok(d.cuStreamCreate(d.CUstream_flags.CU_STREAM_NON_BLOCKING))
    blocking = ok(d.cuStreamCreate(d.CUstream_flags.CU_STREAM_DEFAULT))
    ok(d.cuMemsetD8Async(p, 2, 16, nb))
    # a blocking copy is ordered on the legacy stream, which does not wait for a
    # non-blocking stream: it reads what was there before
    assert read(p, 16).tolist() == [1] * 16
    ok(d.cuStreamSynchronize(nb))
    assert read(p, 16).tolist() == [2] * 16
    # a blocking stream's work is waited for by the legacy stream
    ok(d.cuMemsetD8Async(p, 3, 16, blocking))
    assert read(p, 16).tolist() == [3] * 16
    # the legacy stream's work comes before a blocking stream's later work
    q = int(ok(d.cuMemAlloc(16)))
    ok(d.cuMemsetD8(q, 0, 16))
    ok(d.cuMemsetD8Async(p, 4, 16, 0))
    ok(d.cuMemcpyDtoDAsync(q, p, 16, blocking))
    ok(d.cuStreamSynchronize(blocking))
    assert read(q, 16).tolist() == [4] * 16
    # query makes progress but answers NOT_READY while work was pending
    ok(d.cuMemsetD8Async(p, 5, 16, nb))
    fails(d.cuStreamQuery(nb), R.CUDA_ERROR_NOT_READY)
    ok(d.cuStreamQuery(nb))
    for s in (nb, blocking):
        ok(d.cuStreamDestroy(s))
    fails(d.cuStreamSynchronize(nb), R.CUDA_ERROR_INVALID_HANDLE, "destroyed")
    ok(d.cuMemFree(p))
    ok(d.cuMemFree(q))


def test_cross_stream_dependency_needs_an_event(machine):
    d = machine()
    src, dst = int(ok(d.cuMemAlloc(32))), int(ok(d.cuMemAlloc(32)))
    ok(d.cuMemsetD8(src, 0, 32))
    ok(d.cuMemsetD8(dst, 0, 32))
    a, b = (ok(d.cuStreamCreate(d.CUstream_flags.CU_STREAM_NON_BLOCKING)) for _ in range(2))
    ev = ok(d.cuEventCreate(d.CUevent_flags.CU_EVENT_DISABLE_TIMING))
    # without a dependency, b copies src before a writes it: stale data
    ok(d.cuMemsetD8Async(src, 7, 32, a))
    ok(d.cuMemcpyDtoDAsync(dst, src, 32, b))
    ok(d.cuStreamSynchronize(b))
    assert read(dst, 32).tolist() == [0] * 32
    ok(d.cuStreamSynchronize(a))
    # with the event, syncing b alone runs a's write first
    ok(d.cuMemsetD8Async(src, 9, 32, a))
    ok(d.cuEventRecord(ev, a))
    ok(d.cuStreamWaitEvent(b, ev, 0))
    ok(d.cuMemcpyDtoDAsync(dst, src, 32, b))
    ok(d.cuStreamSynchronize(b))
    assert read(dst, 32).tolist() == [9] * 32
    for h in (a, b):
        ok(d.cuStreamDestroy(h))
    ok(d.cuEventDestroy(ev))
    ok(d.cuMemFree(src))
    ok(d.cuMemFree(dst))


def test_async_copies_touch_host_memory_when_they_run(machine):
    d = machine()
    p = int(ok(d.cuMemAlloc(8)))
    s = ok(d.cuStreamCreate(d.CUstream_flags.CU_STREAM_NON_BLOCKING))
    host = np.full(8, 1, np.uint8)
    ok(d.cuMemcpyHtoDAsync(p, host.ctypes.data, 8, s))
    host[:] = 2  # the copy has not run yet: it reads this
    out = np.zeros(8, np.uint8)
    ok(d.cuMemcpyDtoHAsync(out.ctypes.data, p, 8, s))
    assert out.tolist() == [0] * 8
    ok(d.cuStreamSynchronize(s))
    assert out.tolist() == [2] * 8
    ok(d.cuStreamDestroy(s))
    ok(d.cuMemFree(p))


def test_host_registration_is_checked_and_held_by_queued_copies(machine):
    d = machine()
    p = int(ok(d.cuMemAlloc(64)))
    s = ok(d.cuStreamCreate(d.CUstream_flags.CU_STREAM_NON_BLOCKING))
    host = np.arange(64, dtype=np.uint8)
    fails(d.cuMemHostGetFlags(host.ctypes.data), R.CUDA_ERROR_INVALID_VALUE, "not in registered")
    fails(d.cuMemHostUnregister(host.ctypes.data), R.CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED)
    ok(d.cuMemHostRegister(host.ctypes.data, 64, 0))
    assert ok(d.cuMemHostGetFlags(host.ctypes.data + 63)) == 0
    fails(d.cuMemHostRegister(host.ctypes.data + 8, 8, 0),
          R.CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED, "overlaps")
    fails(d.cuMemHostUnregister(host.ctypes.data + 8), R.CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED)
    ok(d.cuMemcpyHtoDAsync(p, host.ctypes.data, 64, s))       # queued, not run yet
    ok(d.cuMemHostUnregister(host.ctypes.data))
    fails(d.cuStreamSynchronize(s), R.CUDA_ERROR_ILLEGAL_ADDRESS, "was unregistered")


def test_a_3d_copy_pitch_past_the_devices_largest_is_refused(machine):
    """cuMemcpy3D takes pitches up to CU_DEVICE_ATTRIBUTE_MAX_PITCH (2^31 - 1 bytes):
    a larger one is CUDA_ERROR_INVALID_VALUE naming it, and nothing is copied."""
    d = machine()
    assert ok(d.cuDeviceGetAttribute(d.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_PITCH, 0)) == 2**31 - 1
    p = int(ok(d.cuMemAlloc(64)))
    write(p, np.zeros(64, np.uint8))
    host = np.full(64, 7, np.uint8)
    for pitch, code in ((2**31, R.CUDA_ERROR_INVALID_VALUE), (32, R.CUDA_SUCCESS)):
        c = d.CUDA_MEMCPY3D()
        c.srcMemoryType, c.srcHost = d.CUmemorytype.CU_MEMORYTYPE_HOST, host.ctypes.data
        c.srcPitch, c.srcHeight = 32, 1
        c.dstMemoryType, c.dstDevice = d.CUmemorytype.CU_MEMORYTYPE_DEVICE, d.CUdeviceptr(p)
        c.dstPitch, c.dstHeight = pitch, 1
        c.WidthInBytes, c.Height, c.Depth = 16, 1, 1
        if code == R.CUDA_SUCCESS:
            ok(d.cuMemcpy3D(c))
        else:
            fails(d.cuMemcpy3D(c), code, "passes the device's largest pitch 2147483647")
            assert read(p, 64).tolist() == [0] * 64
    assert read(p, 64).tolist() == [7] * 16 + [0] * 48
    ok(d.cuMemFree(p))


def test_event_timing_and_queries(machine):
    d = machine()
    s = ok(d.cuStreamCreate(0))
    a, b = ok(d.cuEventCreate(0)), ok(d.cuEventCreate(0))
    untimed = ok(d.cuEventCreate(d.CUevent_flags.CU_EVENT_DISABLE_TIMING))
    fails(d.cuEventElapsedTime(a, b), R.CUDA_ERROR_INVALID_HANDLE, "never recorded")
    p = int(ok(d.cuMemAlloc(1 << 20)))
    ok(d.cuEventRecord(a, s))
    ok(d.cuMemsetD8Async(p, 1, 1 << 20, s))
    ok(d.cuEventRecord(b, s))
    ok(d.cuEventRecord(untimed, s))
    fails(d.cuEventElapsedTime(a, b), R.CUDA_ERROR_NOT_READY)
    fails(d.cuEventQuery(b), R.CUDA_ERROR_NOT_READY)
    ok(d.cuEventSynchronize(b))
    assert ok(d.cuEventElapsedTime(a, b)) > 0
    fails(d.cuEventElapsedTime(a, untimed), R.CUDA_ERROR_INVALID_HANDLE, "DISABLE_TIMING")
    for e in (a, b, untimed):
        ok(d.cuEventDestroy(e))
    fails(d.cuEventSynchronize(a), R.CUDA_ERROR_INVALID_HANDLE)
    ok(d.cuStreamDestroy(s))
    ok(d.cuMemFree(p))


def test_per_thread_default_stream_and_capture_info(machine):
    d = machine()
    p = int(ok(d.cuMemAlloc(8)))
    ok(d.cuMemsetD8(p, 0, 8))
    ok(d.cuMemsetD8Async(p, 4, 8, d.CU_STREAM_PER_THREAD))  # blocking: the legacy stream waits
    assert read(p, 8).tolist() == [4] * 8
    seen = {}

    def worker():  # another thread's per-thread stream is another stream
        ok(d.cuCtxSetCurrent(ctx))
        seen["busy"] = d.cuStreamQuery(d.CU_STREAM_PER_THREAD)[0]
    ctx = ok(d.cuCtxGetCurrent())
    ok(d.cuMemsetD8Async(p, 5, 8, d.CU_STREAM_PER_THREAD))
    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen == {"busy": R.CUDA_SUCCESS}
    fails(d.cuStreamQuery(d.CU_STREAM_PER_THREAD), R.CUDA_ERROR_NOT_READY)
    s = ok(d.cuStreamCreate(d.CUstream_flags.CU_STREAM_NON_BLOCKING))
    info = ok(d.cuStreamGetCaptureInfo(s))   # (status, id, graph, deps[, edges], n): 12.x / 13.x
    assert info[0] == d.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE and info[-1] == 0
    ok(d.cuStreamBeginCapture(s, MODES.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL))
    ok(d.cuMemsetD8Async(p, 1, 8, s))
    info = ok(d.cuStreamGetCaptureInfo(s))
    assert info[0] == d.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_ACTIVE
    assert int(info[1]) > 0 and info[-1] == 1 and len(info[3]) == 1
    # a non-blocking capture leaves the legacy stream free
    assert ok(d.cuStreamIsCapturing(0)) == d.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE
    ok(d.cuGraphDestroy(ok(d.cuStreamEndCapture(s))))
    ok(d.cuStreamDestroy(s))
    ok(d.cuMemFree(p))


# ------------------------------------------------------------------ capture and graphs

def _refusals(d, s, p, other):
    """(name, call, expected error) of calls the driver refuses while s captures globally."""
    host = np.zeros(8, np.uint8)
    ev = ok(d.cuEventCreate(0))
    ok(d.cuEventRecord(ev, other))  # recorded outside the capture
    return [
        ("cuMemcpyHtoD", lambda: d.cuMemcpyHtoD(p, host.ctypes.data, 8), R.CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED),
        ("cuMemsetD8", lambda: d.cuMemsetD8(p, 0, 8), R.CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED),
        ("cuMemAlloc", lambda: d.cuMemAlloc(8), R.CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED),
        ("cuMemFree", lambda: d.cuMemFree(p), R.CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED),
        ("cuCtxSynchronize", lambda: d.cuCtxSynchronize(), R.CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED),
        ("cuStreamSynchronize", lambda: d.cuStreamSynchronize(s), R.CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED),
        ("cuStreamQuery", lambda: d.cuStreamQuery(s), R.CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED),
        ("legacy-stream memset", lambda: d.cuMemsetD8Async(p, 0, 8, 0), R.CUDA_ERROR_STREAM_CAPTURE_IMPLICIT),
        ("record on the legacy stream", lambda: d.cuEventRecord(ev, d.CU_STREAM_LEGACY), R.CUDA_ERROR_STREAM_CAPTURE_IMPLICIT),
        ("wait on uncaptured work", lambda: d.cuStreamWaitEvent(s, ev, 0), R.CUDA_ERROR_STREAM_CAPTURE_ISOLATION),
    ], ev


def test_capture_refusals_invalidate_the_capture(machine):
    d = machine()
    p = int(ok(d.cuMemAlloc(64)))
    s = ok(d.cuStreamCreate(0))
    other = ok(d.cuStreamCreate(d.CUstream_flags.CU_STREAM_NON_BLOCKING))
    cases, ev = _refusals(d, s, p, other)
    for name, call, code in cases:
        ok(d.cuStreamBeginCapture(s, MODES.CU_STREAM_CAPTURE_MODE_GLOBAL))
        ok(d.cuMemsetD8Async(p, 1, 64, s))
        # asking is not refused: the legacy stream answers IMPLICIT, the capture lives on
        assert d.cuStreamIsCapturing(0)[0] == R.CUDA_ERROR_STREAM_CAPTURE_IMPLICIT
        assert ok(d.cuStreamIsCapturing(s)) == d.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_ACTIVE
        assert call()[0] == code, name
        assert ok(d.cuStreamIsCapturing(s)) == d.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_INVALIDATED, name
        fails(d.cuStreamEndCapture(s), R.CUDA_ERROR_STREAM_CAPTURE_INVALIDATED)
        assert ok(d.cuStreamIsCapturing(s)) == d.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE
    # relaxed mode permits the "unsafe" calls (an allocation), not the legacy stream's join
    ok(d.cuStreamBeginCapture(s, MODES.CU_STREAM_CAPTURE_MODE_RELAXED))
    q = ok(d.cuMemAlloc(8))
    ok(d.cuMemFree(q))
    g = ok(d.cuStreamEndCapture(s))
    ok(d.cuGraphDestroy(g))
    fails(d.cuStreamBeginCapture(0, MODES.CU_STREAM_CAPTURE_MODE_GLOBAL), R.CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED)
    fails(d.cuStreamEndCapture(s), R.CUDA_ERROR_ILLEGAL_STATE)
    ok(d.cuEventDestroy(ev))
    for h in (s, other):
        ok(d.cuStreamDestroy(h))
    ok(d.cuMemFree(p))


def test_capture_invalidation_reaches_kvcore(machine):
    if not gpu.using_emulator():
        pytest.skip("the session runs kvcore on a real device")
    machine(init=False)
    buf = gpu.DeviceBuffer.zeros(64)
    s = gpu.Stream.create()
    drv = gpu.driver.cuda()
    with s.ctx:  # raw driver calls need the context current (kvcore's entries push their own)
        gpu.driver.call("cuStreamBeginCapture", s.handle, drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL)
        buf.fill(3, stream=s)
        with pytest.raises(CudaError, match="cuMemcpyDtoH: CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED.*invalidated"):
            gpu.driver.call("cuMemcpyDtoH", np.zeros(4, np.uint8).ctypes.data, drv.CUdeviceptr(buf.ptr), 4)
        with pytest.raises(CudaError, match="cuStreamEndCapture: CUDA_ERROR_STREAM_CAPTURE_INVALIDATED"):
            gpu.driver.call("cuStreamEndCapture", s.handle)
    s.destroy()
    buf.free()


def test_graph_replay_with_fork_and_join(machine):
    d = machine(seed=3)
    a, b = int(ok(d.cuMemAlloc(16))), int(ok(d.cuMemAlloc(16)))
    out = int(ok(d.cuMemAlloc(32)))
    origin, side = (ok(d.cuStreamCreate(d.CUstream_flags.CU_STREAM_NON_BLOCKING)) for _ in range(2))
    fork, join = ok(d.cuEventCreate(2)), ok(d.cuEventCreate(2))
    host = np.full(16, 5, np.uint8)
    ok(d.cuStreamBeginCapture(origin, MODES.CU_STREAM_CAPTURE_MODE_GLOBAL))
    ok(d.cuMemcpyHtoDAsync(a, host.ctypes.data, 16, origin))
    ok(d.cuEventRecord(fork, origin))
    ok(d.cuStreamWaitEvent(side, fork, 0))          # side joins the capture
    ok(d.cuMemsetD8Async(b, 6, 16, side))
    ok(d.cuMemcpyDtoDAsync(out + 16, a, 16, side))  # after the HtoD, through the fork
    ok(d.cuEventRecord(join, side))
    ok(d.cuStreamWaitEvent(origin, join, 0))        # and back
    ok(d.cuMemcpyDtoDAsync(out, b, 16, origin))
    assert ok(d.cuStreamIsCapturing(side)) == d.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_ACTIVE
    fails(d.cuEventSynchronize(join), R.CUDA_ERROR_CAPTURED_EVENT)
    fails(d.cuStreamEndCapture(side), R.CUDA_ERROR_STREAM_CAPTURE_UNMATCHED)
    fails(d.cuStreamEndCapture(origin), R.CUDA_ERROR_STREAM_CAPTURE_INVALIDATED)
    # again, properly ended
    ok(d.cuStreamBeginCapture(origin, MODES.CU_STREAM_CAPTURE_MODE_GLOBAL))
    ok(d.cuMemcpyHtoDAsync(a, host.ctypes.data, 16, origin))
    ok(d.cuEventRecord(fork, origin))
    ok(d.cuStreamWaitEvent(side, fork, 0))
    ok(d.cuMemsetD8Async(b, 6, 16, side))
    ok(d.cuMemcpyDtoDAsync(out + 16, a, 16, side))
    ok(d.cuEventRecord(join, side))
    ok(d.cuStreamWaitEvent(origin, join, 0))
    ok(d.cuMemcpyDtoDAsync(out, b, 16, origin))
    graph = ok(d.cuStreamEndCapture(origin))
    assert ok(d.cuStreamIsCapturing(side)) == d.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE
    exe = ok(d.cuGraphInstantiate(graph, 0))
    for value in (5, 8):  # the graph reads the host buffer when it runs
        host[:] = value
        ok(d.cuMemsetD8(out, 0, 32))
        ok(d.cuGraphLaunch(exe, origin))
        assert read(out, 32).tolist() == [0] * 32  # nothing ran yet (non-blocking stream)
        ok(d.cuStreamSynchronize(origin))
        assert read(out, 32).tolist() == [6] * 16 + [value] * 16
    ok(d.cuGraphExecDestroy(exe))
    ok(d.cuGraphDestroy(graph))
    fails(d.cuGraphLaunch(exe, origin), R.CUDA_ERROR_INVALID_HANDLE, "cuGraphExecDestroy")
    fails(d.cuGraphInstantiate(graph, 0), R.CUDA_ERROR_INVALID_HANDLE)
    for e in (fork, join):
        ok(d.cuEventDestroy(e))
    for s in (origin, side):
        ok(d.cuStreamDestroy(s))
    for p in (a, b, out):
        ok(d.cuMemFree(p))


def test_unjoined_fork_and_replay_over_freed_memory(machine):
    d = machine()
    a = int(ok(d.cuMemAlloc(16)))
    origin, side = ok(d.cuStreamCreate(0)), ok(d.cuStreamCreate(0))
    fork = ok(d.cuEventCreate(2))
    ok(d.cuStreamBeginCapture(origin, MODES.CU_STREAM_CAPTURE_MODE_GLOBAL))
    ok(d.cuEventRecord(fork, origin))
    ok(d.cuStreamWaitEvent(side, fork, 0))
    ok(d.cuMemsetD8Async(a, 1, 16, side))
    fails(d.cuStreamEndCapture(origin), R.CUDA_ERROR_STREAM_CAPTURE_UNJOINED)
    # a graph that writes memory freed after capture faults when replayed: sticky
    ok(d.cuStreamBeginCapture(origin, MODES.CU_STREAM_CAPTURE_MODE_GLOBAL))
    ok(d.cuMemsetD8Async(a, 1, 16, origin))
    graph = ok(d.cuStreamEndCapture(origin))
    exe = ok(d.cuGraphInstantiate(graph, 0))
    ok(d.cuMemFree(a))
    ok(d.cuGraphLaunch(exe, origin))
    fails(d.cuStreamSynchronize(origin), R.CUDA_ERROR_ILLEGAL_ADDRESS, "not inside a live allocation")
    fails(d.cuMemAlloc(8), R.CUDA_ERROR_ILLEGAL_ADDRESS, "sticky")


# ------------------------------------------------------------------ modules and launches

def _image(module):
    with open(gpu_kernels.ptx_path(module), "rb") as f:
        return f.read() + b"\0"


def test_ptx_headers_and_entries_of_every_shipped_module():
    import glob
    import os
    paths = sorted(glob.glob(os.path.join(os.path.dirname(gpu_kernels.ptx_path("rope")), "*.ptx")))
    assert len(paths) == 17   # 11 attention formats and pairs, 2 K q4_1ch pairs, merge, append, paged, rope
    for path in paths:
        m = ptx.parse(open(path, "rb").read())
        assert m.address_size == 64 and m.target.startswith("sm_") and m.entries
        assert ptx.first_driver(m.version) is not None, path
    rope = ptx.parse(_image("rope"))
    assert [p.size for p in rope.entries["kv_rope"]] == [8, 4, 8, 8, 4, 8, 4, 8, 8, 4, 8, 4, 4, 4, 8]
    assert ptx.newest_isa(12020) == (8, 2) and ptx.newest_isa(13000) == (9, 0)
    assert ptx.first_driver((8, 6)) == 12070 and ptx.newest_isa(12060) == (8, 5)
    with pytest.raises(ptx.PtxError, match="no .version"):
        ptx.parse(b"\x7fELF binary")
    parsed = ptx.parse(".version 8.0\n.target sm_80\n.visible .entry k(.param .align 8 .b8 k_param_0[16], .param .f32 x)\n{}")
    assert [(p.type, p.size) for p in parsed.entries["k"]] == [("b8", 16), ("f32", 4)]


def test_module_load_refuses_newer_ptx_and_foreign_images(machine):
    d = machine(driver_version=12020)
    ok(d.cuModuleLoadData(_image("rope")))  # the shipped ISA 7.0 loads
    log = bytearray(4096)
    opts = [d.CUjit_option.CU_JIT_ERROR_LOG_BUFFER, d.CUjit_option.CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES]
    newer = _image("rope").replace(b".version 7.0", b".version 9.0", 1)
    fails(d.cuModuleLoadDataEx(newer, 2, opts, [log, len(log)]),
          R.CUDA_ERROR_UNSUPPORTED_PTX_VERSION, "needs a driver of CUDA 13.0")
    assert b"Unsupported .version 9.0; current version is '8.2'" in bytes(log)
    fails(d.cuModuleLoadData(b"\x7fELF not ours"), R.CUDA_ERROR_INVALID_IMAGE, "not 64-bit little-endian")
    fails(d.cuModuleLoadData(b"// a PTX of nobody\n"), R.CUDA_ERROR_INVALID_IMAGE, "shipped modules")
    d = machine()
    edited = _image("rope").rstrip(b"\0") + b"\n// edited\n"
    fails(d.cuModuleLoadData(edited), R.CUDA_ERROR_INVALID_IMAGE)


def test_occupancy_from_ptxas_registers_and_shared_memory(machine):
    """The emulated function attributes and occupancy are a device's: the registers and
    static shared memory ptxas gives each kernel on sm_90 (cuda/resources.json, checked
    against ptxas by tools/build_ptx.py --check), registers allocated per warp in units of
    256 (64K per SM), 228 KB of shared memory per SM with 1 KB per block reserved."""
    d = machine()
    F = d.CUfunction_attribute
    with open(os.path.join(os.path.dirname(gpu_kernels.ptx_path("rope")), "resources.json")) as f:
        table = json.load(f)["modules"]
    for module, kernel in (("attention_q8_0", "kv_attn_q8_0_d128_g8"), ("attention_f32", "kv_pattn_f32_d64_g1"),
                           ("rope", "kv_rope"), ("attention", "kv_attn_merge")):
        regs, smem = table[module][kernel]
        fn = ok(d.cuModuleGetFunction(ok(d.cuModuleLoadData(_image(module))), kernel.encode()))
        assert ok(d.cuFuncGetAttribute(F.CU_FUNC_ATTRIBUTE_NUM_REGS, fn)) == regs
        assert ok(d.cuFuncGetAttribute(F.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, fn)) == smem
        for threads in (128, 256):
            by_regs = 65536 // (-(-regs * 32 // 256) * 256) // (threads // 32)
            by_smem = (228 * 1024) // (smem + 1024) if smem else 32
            got = ok(d.cuOccupancyMaxActiveBlocksPerMultiprocessor(fn, threads, 0))
            assert got == min(32, 64 // (threads // 32), by_regs, by_smem), (kernel, threads)
    mod = ok(d.cuModuleLoadData(_image("attention_q8_0")))
    for kernel, blocks in ((b"kv_attn_q8_0_d256_g8", 2), (b"kv_attn_q8_0_d128_g8", 4)):  # 214, 123 registers
        fn = ok(d.cuModuleGetFunction(mod, kernel))
        assert ok(d.cuOccupancyMaxActiveBlocksPerMultiprocessor(fn, 128, 0)) == blocks, kernel


def test_launch_checks_against_the_entry(machine):
    d = machine()
    mod = ok(d.cuModuleLoadData(_image("kv_append")))
    fails(d.cuModuleGetFunction(mod, b"kv_nothing"), R.CUDA_ERROR_NOT_FOUND, "no kernel 'kv_nothing'")
    fn = ok(d.cuModuleGetFunction(mod, b"kv_advance"))
    meta = int(ok(d.cuMemAlloc(64)))
    ok(d.cuMemsetD8(meta, 0, 64))
    c_int, ptr = ctypes.c_int, ctypes.c_void_p
    good = ((meta, meta + 16, 0, 4, 8, -1, 1), (ptr, ptr, ptr, c_int, c_int, c_int, c_int))

    def launch(params, grid=(1, 1, 1), block=(32, 1, 1), shmem=0, stream=0):
        return d.cuLaunchKernel(fn, *grid, *block, shmem, stream, params, 0)

    fails(launch(((meta + 64,) + good[0][1:], good[1])), R.CUDA_ERROR_INVALID_VALUE,
          "pointer parameter 0")
    fails(launch(good, block=(1025, 1, 1)), R.CUDA_ERROR_INVALID_VALUE, "more than 1024 threads")
    fails(launch(good, grid=(1, 1, 65536)), R.CUDA_ERROR_INVALID_VALUE, "grid")
    fails(launch(good, shmem=64 * 1024), R.CUDA_ERROR_INVALID_VALUE, "dynamic shared memory")
    # lengths [0, 0, 0, 0] + 1 for every slot
    ok(launch(good))
    ok(d.cuCtxSynchronize())
    assert read(meta, 4, np.int32).tolist() == [1, 1, 1, 1]
    ok(d.cuMemFree(meta))
    # a function of device 0's module cannot launch in device 1's context
    d = machine(devices=2)
    mod = ok(d.cuModuleLoadData(_image("kv_append")))
    fn = ok(d.cuModuleGetFunction(mod, b"kv_advance"))
    ok(d.cuCtxSetCurrent(ok(d.cuDevicePrimaryCtxRetain(ok(d.cuDeviceGet(1))))))
    fails(d.cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, 0, ((0, 0, 0, 4, 8, -1, 1), good[1]), 0),
          R.CUDA_ERROR_INVALID_HANDLE, "loaded in device 0's context")
    ok(d.cuModuleUnload(mod))
    fails(d.cuModuleGetFunction(mod, b"kv_advance"), R.CUDA_ERROR_INVALID_HANDLE)


def test_launch_parameters_take_what_the_real_bindings_take(machine):
    # cuda-bindings 12.9-13.x (real, here): a raw pointer is (int, c_void_p); type None only for a binding
    # object (CUdeviceptr); kernelParams a tuple of two tuples; extra an int (0)
    d = machine()
    mod = ok(d.cuModuleLoadData(_image("kv_append")))
    fn = ok(d.cuModuleGetFunction(mod, b"kv_advance"))
    meta = int(ok(d.cuMemAlloc(64)))
    ok(d.cuMemsetD8(meta, 0, 64))
    c_int, ptr = ctypes.c_int, ctypes.c_void_p
    values, types = (meta, meta + 16, 0, 4, 8, -1, 1), (ptr, ptr, ptr, c_int, c_int, c_int, c_int)

    def launch(params, extra=0):
        return d.cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, 0, params, extra)

    with pytest.raises(TypeError, match="CUDA Binding structure with getPtr"):
        launch((values, (None,) + types[1:]))                  # (int, None)
    with pytest.raises(TypeError, match="kernelParams' is not a valid type"):
        launch((list(values), list(types)))
    with pytest.raises(TypeError, match="different length"):
        launch((values, types[:6]))
    with pytest.raises(TypeError, match="Unsupported type"):
        launch((values, types[:3] + (ctypes.c_char_p,) + types[4:]))
    with pytest.raises(TypeError, match="an integer is required"):
        launch((values, types), extra=None)
    ok(launch(((d.CUdeviceptr(meta), ctypes.c_void_p(meta + 16)) + values[2:],
               (None, ptr) + types[2:])))
    ok(d.cuCtxSynchronize())
    assert read(meta, 4, np.int32).tolist() == [1, 1, 1, 1]
    ok(d.cuMemFree(meta))


def test_kvcore_launches_in_the_real_bindings_form(monkeypatch):
    calls = []
    monkeypatch.setattr(gpu.driver, "call", lambda name, *args: calls.append((name, args)))
    fn = gpu_kernels.Kernel("m", "k", "fn", (8, 4))
    gpu.driver.launch(fn, (1, 2, 3), (32, 1, 1), [(0x1000, None), (7, ctypes.c_int)], stream=0)
    (name, args), = calls
    assert name == "cuLaunchKernel" and args[:8] == ("fn", 1, 2, 3, 32, 1, 1, 0)
    assert args[9] == ((0x1000, 7), (ctypes.c_void_p, ctypes.c_int)) and args[10] == 0


def test_kvcore_checks_launch_parameters_against_the_entry(machine):
    """The driver reads kernelParams blindly, as many and as large as the .entry declares:
    kvcore's launch checks the count and byte sizes first (on a device as here)."""
    machine(init=False)
    fn = gpu_kernels.function("kv_append", "kv_advance")
    assert fn.params == (8, 8, 8, 4, 4, 4, 4)
    buf = gpu.DeviceBuffer.alloc(64)
    args = [(buf.ptr, None), (buf.ptr + 16, None), (0, None)] + [(v, ctypes.c_int) for v in (4, 8, -1, 1)]
    with pytest.raises(CudaError, match=r"kv_advance\): 6 parameters of \[8, 8, 8, 4, 4, 4\] bytes given, "
                                        r"the .entry declares 7 of \[8, 8, 8, 4, 4, 4, 4\]"):
        gpu.driver.launch(fn, (1, 1, 1), (32, 1, 1), args[:6], stream=0)
    with pytest.raises(CudaError, match=r"7 parameters of \[8, 8, 8, 8, 4, 4, 4\] bytes given"):
        gpu.driver.launch(fn, (1, 1, 1), (32, 1, 1), args[:3] + [(4, ctypes.c_longlong)] + args[4:], stream=0)
    buf.free()


def test_a_kernel_fault_is_sticky_and_named(machine, monkeypatch):
    d = machine()
    mod = ok(d.cuModuleLoadData(_image("kv_append")))
    fn = ok(d.cuModuleGetFunction(mod, b"kv_advance"))
    impl = emu._emu.handles[int(mod)].impl
    kernels = pytest.importorskip("kvcore.gpu._emu.kernels")

    def fault(*args):
        raise kernels.KernelFault("CUDA_ERROR_ILLEGAL_INSTRUCTION",
                                  "kv_advance block (0,0,0) thread 5: __syncthreads reached from "
                                  "two places (cuda/kv_append.cu:321)")
    monkeypatch.setattr(impl, "launch", fault)
    meta = int(ok(d.cuMemAlloc(64)))
    params = ((meta, meta + 32, 0, 4, 8, -1, 1), (ctypes.c_void_p,) * 3 + (ctypes.c_int,) * 4)
    ok(d.cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, 0, params, 0))  # queued, not run
    fails(d.cuCtxSynchronize(), R.CUDA_ERROR_ILLEGAL_INSTRUCTION, "cuda/kv_append.cu:321")
    fails(d.cuMemAlloc(8), R.CUDA_ERROR_ILLEGAL_INSTRUCTION, "sticky")
    fails(d.cuMemsetD8(meta, 0, 4), R.CUDA_ERROR_ILLEGAL_INSTRUCTION)


# ------------------------------------------------------------------ the public switch

def test_use_emulator_validates_and_answers():
    with pytest.raises(ShapeError, match="invalid devices: expected an int >= 1, got 0"):
        gpu.use_emulator(devices=0)
    with pytest.raises(ShapeError, match="invalid memory_bytes"):
        gpu.use_emulator(memory_bytes=1.5)
    if gpu.using_emulator():
        assert gpu.is_available()
        assert isinstance(kvcore.gpu._emu.leaks(), list)
        buf = gpu.DeviceBuffer.alloc(8)
        with pytest.raises(StateError, match="kvcore device memory is still live"):
            gpu.use_emulator(seed=1)
        buf.free()
    else:
        with pytest.raises(StateError, match="real device"):
            gpu.use_emulator()


def test_a_missing_stream_dependency_reads_stale_data_through_kvcore(machine):
    # a foreign producer whose CAI names no stream: the cache's stream does not wait for
    # its pending copy, so the append reads the poison still there (NaN: the step is refused)
    if not gpu.using_emulator():
        pytest.skip("the session runs kvcore on a real device")
    machine(init=False)
    spec = kvcore.KVSpec(num_layers=1, num_kv_heads=2, head_dim=32, capacity=4, format="int8")
    cache = gpu.GpuKVCache(spec, 2)
    producer = gpu.Stream.create(non_blocking=True)
    x = np.ones((2, 2, 32), np.float32)
    buf = gpu.DeviceBuffer.alloc(x.nbytes)
    buf.copy_from_host(x, stream=producer)

    class Foreign:
        def __init__(self, stream):
            self.__cuda_array_interface__ = dict(buf.view(x.shape, x.dtype).__cuda_array_interface__,
                                                 stream=stream)
    cache.append(0, Foreign(None), Foreign(None))
    cache.advance()
    with pytest.raises(kvcore.NonFiniteError):
        cache.check()
    cache.append(0, Foreign(producer.ptr), Foreign(producer.ptr))  # ordered: reads the ones
    cache.advance()
    cache.check()
    assert cache.length(0) == 1 and (cache.keys(0).to_numpy()[:, :, 0] == 127).all()
    producer.synchronize()
    producer.destroy()
    buf.free()
    cache.free()
