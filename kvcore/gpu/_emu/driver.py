"""The emulated CUDA driver: the part of `cuda.bindings.driver` that kvcore calls, on the CPU,
with the driver's rules enforced (selected by `kvcore.gpu.use_emulator()`).

1. Same surface as cuda-python: every call returns `(CUresult, *values)`; `CUresult` and the
   other enums are IntEnums with the real names and numbers (from cuda.h); handles
   (`CUstream`, `CUdeviceptr`, ...) are small classes that `int()` works on.
2. State: `reset(...)` builds a fresh emulator (devices, memory, driver version, seed); one
   lock serialises every call, as one GPU would. A failed call also leaves a reason for the
   calling thread (`error_detail(code)`): kvcore's `driver.check` appends it to the message.
3. Contexts: one primary context per device, a current-context stack per OS thread; calls
   that need a context fail with CUDA_ERROR_NOT_INITIALIZED before cuInit and
   CUDA_ERROR_INVALID_CONTEXT without a current one. A kernel fault is sticky: every later
   call in that context returns it, with the fault's message (kernel, thread, file:line).
4. Memory: device memory is host memory from `kernels.alloc` (poisoned when allocated and
   freed). Every copy, memset and pointer parameter of a launch must lie inside one live
   allocation of the current context's device; freed memory is refused at the API and
   faults (CUDA_ERROR_ILLEGAL_ADDRESS) when a graph replays over it.
5. Streams are queues that run only when the program waits: a stream, event or context
   synchronise, a blocking copy or memset (queued on the legacy stream, which waits for
   every blocking stream but not for non-blocking ones), a query (which makes progress and
   answers CUDA_ERROR_NOT_READY once). Events mark a position in a queue; cuStreamWaitEvent
   makes a stream wait for it. Async copies read and write host memory when they run.
6. Capture: a capturing stream records nodes instead of queueing; cross-stream capture by
   event record/wait (fork and join) works. A call the driver refuses while capturing fails
   with its documented error and invalidates the capture (cuStreamEndCapture then returns
   CUDA_ERROR_STREAM_CAPTURE_INVALIDATED). A graph exec replays the nodes (kernel parameters
   by value, as captured) in a seeded topological order.
7. Modules: only kvcore's shipped images load (compared byte for byte); a PTX ISA newer than
   the emulated driver reads fails with CUDA_ERROR_UNSUPPORTED_PTX_VERSION and a JIT log.
   Launches are checked against the PTX `.entry` (parameter count and byte sizes) and the
   device limits, then run by `kernels.load(module).launch(...)` when the queue runs.
"""
from __future__ import annotations

import ctypes
import enum
import hashlib
import itertools
import json
import os
import random
import sys
import threading
import time
from bisect import bisect_left, bisect_right
from dataclasses import dataclass

from . import ptx as _ptx

# ============================================================================ enums

_RESULTS = """
SUCCESS=0 INVALID_VALUE=1 OUT_OF_MEMORY=2 NOT_INITIALIZED=3 DEINITIALIZED=4 PROFILER_DISABLED=5
PROFILER_NOT_INITIALIZED=6 PROFILER_ALREADY_STARTED=7 PROFILER_ALREADY_STOPPED=8 STUB_LIBRARY=34
CALL_REQUIRES_NEWER_DRIVER=36 DEVICE_UNAVAILABLE=46 NO_DEVICE=100 INVALID_DEVICE=101
DEVICE_NOT_LICENSED=102 INVALID_IMAGE=200 INVALID_CONTEXT=201 CONTEXT_ALREADY_CURRENT=202
MAP_FAILED=205 UNMAP_FAILED=206 ARRAY_IS_MAPPED=207 ALREADY_MAPPED=208 NO_BINARY_FOR_GPU=209
ALREADY_ACQUIRED=210 NOT_MAPPED=211 NOT_MAPPED_AS_ARRAY=212 NOT_MAPPED_AS_POINTER=213
ECC_UNCORRECTABLE=214 UNSUPPORTED_LIMIT=215 CONTEXT_ALREADY_IN_USE=216
PEER_ACCESS_UNSUPPORTED=217 INVALID_PTX=218 INVALID_GRAPHICS_CONTEXT=219
NVLINK_UNCORRECTABLE=220 JIT_COMPILER_NOT_FOUND=221 UNSUPPORTED_PTX_VERSION=222
JIT_COMPILATION_DISABLED=223 UNSUPPORTED_EXEC_AFFINITY=224 UNSUPPORTED_DEVSIDE_SYNC=225
CONTAINED=226 INVALID_SOURCE=300 FILE_NOT_FOUND=301 SHARED_OBJECT_SYMBOL_NOT_FOUND=302
SHARED_OBJECT_INIT_FAILED=303 OPERATING_SYSTEM=304 INVALID_HANDLE=400 ILLEGAL_STATE=401
LOSSY_QUERY=402 NOT_FOUND=500 NOT_READY=600 ILLEGAL_ADDRESS=700 LAUNCH_OUT_OF_RESOURCES=701
LAUNCH_TIMEOUT=702 LAUNCH_INCOMPATIBLE_TEXTURING=703 PEER_ACCESS_ALREADY_ENABLED=704
PEER_ACCESS_NOT_ENABLED=705 PRIMARY_CONTEXT_ACTIVE=708 CONTEXT_IS_DESTROYED=709 ASSERT=710
TOO_MANY_PEERS=711 HOST_MEMORY_ALREADY_REGISTERED=712 HOST_MEMORY_NOT_REGISTERED=713
HARDWARE_STACK_ERROR=714 ILLEGAL_INSTRUCTION=715 MISALIGNED_ADDRESS=716
INVALID_ADDRESS_SPACE=717 INVALID_PC=718 LAUNCH_FAILED=719 COOPERATIVE_LAUNCH_TOO_LARGE=720
TENSOR_MEMORY_LEAK=721 NOT_PERMITTED=800 NOT_SUPPORTED=801 SYSTEM_NOT_READY=802
SYSTEM_DRIVER_MISMATCH=803 COMPAT_NOT_SUPPORTED_ON_DEVICE=804 MPS_CONNECTION_FAILED=805
MPS_RPC_FAILURE=806 MPS_SERVER_NOT_READY=807 MPS_MAX_CLIENTS_REACHED=808
MPS_MAX_CONNECTIONS_REACHED=809 MPS_CLIENT_TERMINATED=810 CDP_NOT_SUPPORTED=811
CDP_VERSION_MISMATCH=812 STREAM_CAPTURE_UNSUPPORTED=900 STREAM_CAPTURE_INVALIDATED=901
STREAM_CAPTURE_MERGE=902 STREAM_CAPTURE_UNMATCHED=903 STREAM_CAPTURE_UNJOINED=904
STREAM_CAPTURE_ISOLATION=905 STREAM_CAPTURE_IMPLICIT=906 CAPTURED_EVENT=907
STREAM_CAPTURE_WRONG_THREAD=908 TIMEOUT=909 GRAPH_EXEC_UPDATE_FAILURE=910 EXTERNAL_DEVICE=911
INVALID_CLUSTER_SIZE=912 FUNCTION_NOT_LOADED=913 INVALID_RESOURCE_TYPE=914
INVALID_RESOURCE_CONFIGURATION=915 KEY_ROTATION=916 UNKNOWN=999
"""


def _pairs(text: str, prefix: str) -> list[tuple[str, int]]:
    out = []
    for item in text.split():
        name, value = item.split("=")
        out.append((name if name.startswith("CUDA_SUCCESS") else prefix + name, int(value)))
    return out


CUresult = enum.IntEnum("CUresult", [("CUDA_SUCCESS", 0)] + [
    p for p in _pairs(_RESULTS, "CUDA_ERROR_") if p[1] != 0], module=__name__)

# What the real driver's cuGetErrorString says for the codes this emulator returns.
_TEXTS = {
    0: "no error", 1: "invalid argument", 2: "out of memory", 3: "initialization error",
    4: "driver shutting down", 100: "no CUDA-capable device is detected",
    101: "invalid device ordinal", 200: "device kernel image is invalid",
    201: "invalid device context", 209: "no kernel image is available for execution on the device",
    218: "a PTX JIT compilation failed",
    222: "the provided PTX was compiled with an unsupported toolchain.",
    400: "invalid resource handle", 401: "the operation cannot be performed in the present state",
    500: "named symbol not found", 600: "device not ready",
    700: "an illegal memory access was encountered",
    701: "too many resources requested for launch",
    709: "context is destroyed", 715: "an illegal instruction was encountered",
    719: "unspecified launch failure", 801: "operation not supported",
    900: "operation not permitted when stream is capturing",
    901: "operation failed due to a previous error during capture",
    902: "operation would result in a merge of separate capture sequences",
    903: "capture was not ended in the same stream as it began",
    904: "capturing stream has unjoined work",
    905: "dependency created on uncaptured work in another stream",
    906: "operation would make the legacy stream depend on a capturing blocking stream",
    907: "operation not permitted on an event last recorded in a capturing stream",
    908: "attempt to terminate a thread-local capture sequence from another thread",
    999: "unknown error",
}


def _enum(name: str, members: dict[str, int]):
    return enum.IntEnum(name, list(members.items()), module=__name__)


CUdevice_attribute = _enum("CUdevice_attribute", {
    "CU_DEVICE_ATTRIBUTE_" + k: v for k, v in dict(
        MAX_THREADS_PER_BLOCK=1, MAX_BLOCK_DIM_X=2, MAX_BLOCK_DIM_Y=3, MAX_BLOCK_DIM_Z=4,
        MAX_GRID_DIM_X=5, MAX_GRID_DIM_Y=6, MAX_GRID_DIM_Z=7, MAX_SHARED_MEMORY_PER_BLOCK=8,
        TOTAL_CONSTANT_MEMORY=9, WARP_SIZE=10, MAX_PITCH=11, MAX_REGISTERS_PER_BLOCK=12,
        CLOCK_RATE=13,
        MULTIPROCESSOR_COUNT=16, INTEGRATED=18, CONCURRENT_KERNELS=31, PCI_BUS_ID=33,
        PCI_DEVICE_ID=34, MEMORY_CLOCK_RATE=36, GLOBAL_MEMORY_BUS_WIDTH=37, L2_CACHE_SIZE=38,
        MAX_THREADS_PER_MULTIPROCESSOR=39, ASYNC_ENGINE_COUNT=40, UNIFIED_ADDRESSING=41,
        COMPUTE_CAPABILITY_MAJOR=75, COMPUTE_CAPABILITY_MINOR=76,
        MAX_SHARED_MEMORY_PER_MULTIPROCESSOR=81, MAX_REGISTERS_PER_MULTIPROCESSOR=82,
        COOPERATIVE_LAUNCH=95, MAX_SHARED_MEMORY_PER_BLOCK_OPTIN=97,
        MAX_BLOCKS_PER_MULTIPROCESSOR=106, MEMORY_POOLS_SUPPORTED=115).items()})
CUpointer_attribute = _enum("CUpointer_attribute", {
    "CU_POINTER_ATTRIBUTE_" + k: v for k, v in dict(
        CONTEXT=1, MEMORY_TYPE=2, DEVICE_POINTER=3, HOST_POINTER=4, P2P_TOKENS=5,
        SYNC_MEMOPS=6, BUFFER_ID=7, IS_MANAGED=8, DEVICE_ORDINAL=9,
        IS_LEGACY_CUDA_IPC_CAPABLE=10, RANGE_START_ADDR=11, RANGE_SIZE=12, MAPPED=13).items()})
CUmemorytype = _enum("CUmemorytype", {"CU_MEMORYTYPE_HOST": 1, "CU_MEMORYTYPE_DEVICE": 2,
                                      "CU_MEMORYTYPE_ARRAY": 3, "CU_MEMORYTYPE_UNIFIED": 4})
CUstreamCaptureStatus = _enum("CUstreamCaptureStatus", {
    "CU_STREAM_CAPTURE_STATUS_NONE": 0, "CU_STREAM_CAPTURE_STATUS_ACTIVE": 1,
    "CU_STREAM_CAPTURE_STATUS_INVALIDATED": 2})
CUstreamCaptureMode = _enum("CUstreamCaptureMode", {
    "CU_STREAM_CAPTURE_MODE_GLOBAL": 0, "CU_STREAM_CAPTURE_MODE_THREAD_LOCAL": 1,
    "CU_STREAM_CAPTURE_MODE_RELAXED": 2})
CUstream_flags = _enum("CUstream_flags", {"CU_STREAM_DEFAULT": 0, "CU_STREAM_NON_BLOCKING": 1})
CUevent_flags = _enum("CUevent_flags", {"CU_EVENT_DEFAULT": 0, "CU_EVENT_BLOCKING_SYNC": 1,
                                        "CU_EVENT_DISABLE_TIMING": 2, "CU_EVENT_INTERPROCESS": 4})
CUfunction_attribute = _enum("CUfunction_attribute", {
    "CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK": 0, "CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES": 1,
    "CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES": 3, "CU_FUNC_ATTRIBUTE_NUM_REGS": 4,   # (not emulated)
    "CU_FUNC_ATTRIBUTE_PTX_VERSION": 5, "CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES": 8})
CUjit_option = _enum("CUjit_option", {
    "CU_JIT_" + k: v for k, v in dict(
        MAX_REGISTERS=0, THREADS_PER_BLOCK=1, WALL_TIME=2, INFO_LOG_BUFFER=3,
        INFO_LOG_BUFFER_SIZE_BYTES=4, ERROR_LOG_BUFFER=5, ERROR_LOG_BUFFER_SIZE_BYTES=6,
        OPTIMIZATION_LEVEL=7, TARGET_FROM_CUCONTEXT=8, TARGET=9, FALLBACK_STRATEGY=10,
        GENERATE_DEBUG_INFO=11, LOG_VERBOSE=12, GENERATE_LINE_INFO=13, CACHE_MODE=14).items()})


# ============================================================================ handles

class _Handle:
    """A driver handle: an opaque address. `int(h)` gives it; equal addresses compare equal."""

    __slots__ = ("_value",)

    def __init__(self, init_value=0):
        self._value = int(init_value)

    def __int__(self):
        return self._value

    def getPtr(self) -> int:
        return self._value

    def __eq__(self, other):
        return type(other) is type(self) and other._value == self._value

    def __hash__(self):
        return hash((type(self).__name__, self._value))

    def __repr__(self):
        return f"<{type(self).__name__} 0x{self._value:x}>"


class CUdevice(_Handle):
    __slots__ = ()


class CUcontext(_Handle):
    __slots__ = ()


class CUstream(_Handle):
    __slots__ = ()


class CUevent(_Handle):
    __slots__ = ()


class CUdeviceptr(_Handle):
    __slots__ = ()


class CUmodule(_Handle):
    __slots__ = ()


class CUfunction(_Handle):
    __slots__ = ()


class CUgraph(_Handle):
    __slots__ = ()


class CUgraphExec(_Handle):
    __slots__ = ()


class CUgraphNode(_Handle):
    __slots__ = ()


CU_STREAM_LEGACY = CUstream(1)
CU_STREAM_PER_THREAD = CUstream(2)


class CUDA_MEMCPY3D:
    """The 3D copy descriptor (the fields cuMemcpy3D reads; every one defaults to 0)."""

    _FIELDS = ("srcXInBytes", "srcY", "srcZ", "srcLOD", "srcMemoryType", "srcHost", "srcDevice",
               "srcArray", "srcPitch", "srcHeight", "dstXInBytes", "dstY", "dstZ", "dstLOD",
               "dstMemoryType", "dstHost", "dstDevice", "dstArray", "dstPitch", "dstHeight",
               "WidthInBytes", "Height", "Depth")

    def __init__(self):
        for f in self._FIELDS:
            setattr(self, f, 0)


# ============================================================================ state

class _Fail(Exception):
    """An API call's refusal: the CUresult and the reason (error_detail)."""

    def __init__(self, code: int, detail: str):
        super().__init__(detail)
        self.code = CUresult(code)
        self.detail = detail


def _where() -> str:
    """The first caller outside kvcore.gpu: where a resource was created (leak reports)."""
    pkg = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    f = sys._getframe(2)
    inner = None
    while f is not None:
        fn = f.f_code.co_filename
        if not fn.startswith(pkg):
            site = f"{fn}:{f.f_lineno} in {f.f_code.co_name}"
            return site if inner is None else f"{site} (via {inner})"
        if not fn.startswith(os.path.dirname(__file__)):  # the outermost kvcore.gpu frame
            inner = f"{os.path.basename(fn)}:{f.f_lineno} {f.f_code.co_name}"
        f = f.f_back
    return inner or "?"


@dataclass
class Leak:
    """A resource still live: kind ("memory", "stream", "event", "graph", "graphExec"),
    its handle, device, bytes (memory only) and where it was created."""
    kind: str
    handle: int
    device: int
    nbytes: int
    where: str

    def __str__(self):
        size = f" {self.nbytes} bytes" if self.kind == "memory" else ""
        return f"{self.kind} 0x{self.handle:x}{size} on device {self.device}, created at {self.where}"


class _Resource:
    kind = "?"

    def __init__(self, emu: "_Emulator", ctx: "_Context | None"):
        self.handle = emu.new_handle(self)
        self.ctx = ctx
        self.where = _where()
        self.serial = next(emu.serials)


class _Alloc(_Resource):
    kind = "memory"

    def __init__(self, emu, ctx, ptr: int, size: int):
        self.ptr, self.size = ptr, size
        super().__init__(emu, ctx)
        self.live = True

    def describe(self) -> str:
        return f"[0x{self.ptr:x}, 0x{self.ptr + self.size:x}) ({self.size} bytes, allocated at {self.where})"


class _Op:
    """One queued operation of a stream: runs once every dependency ran."""

    __slots__ = ("label", "fn", "deps", "done", "ctx")

    def __init__(self, label: str, fn, deps: list, ctx):
        self.label, self.fn, self.deps, self.done, self.ctx = label, fn, deps, False, ctx


class _Stream(_Resource):
    kind = "stream"

    def __init__(self, emu, ctx, blocking: bool, name: str, fixed: int | None = None):
        if fixed is None:
            super().__init__(emu, ctx)
        else:  # the legacy / per-thread streams: no handle of their own
            self.handle, self.ctx, self.where, self.serial = fixed, ctx, "", 0
        self.blocking = blocking
        self.name = name
        self.last: _Op | None = None
        self.capture: _Capture | None = None
        self.tail: list[_Node] = []   # capture dependencies of the next node

    def pending(self) -> bool:
        return self.last is not None and not self.last.done


class _Event(_Resource):
    kind = "event"

    def __init__(self, emu, ctx, flags: int):
        super().__init__(emu, ctx)
        self.timing = not flags & CUevent_flags.CU_EVENT_DISABLE_TIMING
        self.op: _Op | None = None
        self.time: float | None = None
        self.captured: tuple[_Capture, list] | None = None


class _Node:
    """A captured operation of a graph: `run()` performs it; `deps` are the nodes before it."""

    __slots__ = ("label", "run", "deps", "index")

    def __init__(self, label, run, deps, index):
        self.label, self.run, self.deps, self.index = label, run, list(deps), index


class _Capture:
    def __init__(self, emu, origin: _Stream, mode: int):
        self.id = next(emu.capture_ids)
        self.origin = origin
        self.mode = mode
        self.thread = threading.get_ident()
        self.nodes: list[_Node] = []
        self.streams: list[_Stream] = [origin]
        self.invalid: str | None = None  # the reason, once invalidated


class _Graph(_Resource):
    kind = "graph"

    def __init__(self, emu, ctx, nodes):
        super().__init__(emu, ctx)
        self.nodes = nodes


class _GraphExec(_Graph):
    kind = "graphExec"

    def __init__(self, emu, ctx, nodes):
        super().__init__(emu, ctx, nodes)


class _Module(_Resource):
    kind = "module"

    def __init__(self, emu, ctx, name: str, info: _ptx.PtxModule | None, impl):
        super().__init__(emu, ctx)
        self.name, self.info, self.impl = name, info, impl
        self.functions: dict[str, _Function] = {}
        # kernel -> (registers, static shared bytes) as ptxas assigns them on sm_90
        self.resources: dict[str, tuple[int, int]] = _resources().get(name, {})


class _Function(_Resource):
    kind = "function"

    def __init__(self, emu, module: _Module, name: str, params):
        super().__init__(emu, module.ctx)
        self.module, self.name, self.params = module, name, params  # params: ((size, is_ptr), ...)
        self.max_dynamic_shared = 48 * 1024


class _Context:
    def __init__(self, emu: "_Emulator", device: "_Device"):
        self.handle = emu.new_handle(self)
        self.device = device
        self.refs = 0
        self.alive = True
        self.fault: tuple[int, str] | None = None
        self.legacy = _Stream(emu, self, True, "the legacy default stream", fixed=1)
        self.per_thread: dict[int, _Stream] = {}
        self.resources: dict[int, _Resource] = {}   # handle -> stream/event/alloc/graph/module
        self.orphans: list[_Op] = []                # pending work of destroyed streams

    def streams(self):
        yield self.legacy
        yield from self.per_thread.values()
        yield from (r for r in self.resources.values() if isinstance(r, _Stream))


class _Device:
    def __init__(self, ordinal: int, memory_bytes: int):
        self.ordinal = ordinal
        self.total = memory_bytes
        self.used = 0
        self.ctx: _Context | None = None
        self.name = f"kvcore emulated GPU {ordinal} (CPU; sm_90, 16 SMs)"


@dataclass(frozen=True)
class Config:
    """The emulated machine: devices, memory per device, cuDriverGetVersion, the seed of
    the thread shuffling (advanced per launch), and whether kernels run AddressSanitizer builds."""
    devices: int = 1
    seed: int = 0
    memory_bytes: int = 2 << 30
    driver_version: int = 13000
    asan: bool = False


# An H100 (sm_90, 132 SMs). The split decode kernel sizes its grid from the resident
# blocks (SMs x the occupancy, from ptxas' registers and shared memory: resources.json),
# so the emulator launches the grids, and takes the split counts, that a device does.
SM_COUNT = 132
COMPUTE_CAPABILITY = (9, 0)
SHARED_PER_BLOCK = 48 * 1024
SHARED_PER_BLOCK_OPTIN = 227 * 1024
SHARED_PER_SM = 228 * 1024
MAX_PITCH = 2**31 - 1          # bytes: the largest pitch of a 2D/3D copy (sm_90 devices)
_ATTRIBUTES = {
    "MAX_THREADS_PER_BLOCK": 1024, "MAX_BLOCK_DIM_X": 1024, "MAX_BLOCK_DIM_Y": 1024,
    "MAX_BLOCK_DIM_Z": 64, "MAX_GRID_DIM_X": 2**31 - 1, "MAX_GRID_DIM_Y": 65535,
    "MAX_GRID_DIM_Z": 65535, "MAX_SHARED_MEMORY_PER_BLOCK": SHARED_PER_BLOCK,
    "TOTAL_CONSTANT_MEMORY": 65536, "WARP_SIZE": 32, "MAX_PITCH": MAX_PITCH,
    "MAX_REGISTERS_PER_BLOCK": 65536,
    "CLOCK_RATE": 1980000, "MULTIPROCESSOR_COUNT": SM_COUNT, "INTEGRATED": 0,
    "CONCURRENT_KERNELS": 1, "PCI_DEVICE_ID": 0, "MEMORY_CLOCK_RATE": 2619000,
    "GLOBAL_MEMORY_BUS_WIDTH": 5120, "L2_CACHE_SIZE": 50 * 1024 * 1024,
    "MAX_THREADS_PER_MULTIPROCESSOR": 2048, "ASYNC_ENGINE_COUNT": 3, "UNIFIED_ADDRESSING": 1,
    "COMPUTE_CAPABILITY_MAJOR": COMPUTE_CAPABILITY[0],
    "COMPUTE_CAPABILITY_MINOR": COMPUTE_CAPABILITY[1],
    "MAX_SHARED_MEMORY_PER_MULTIPROCESSOR": SHARED_PER_SM,
    "MAX_REGISTERS_PER_MULTIPROCESSOR": 65536, "COOPERATIVE_LAUNCH": 1,
    "MAX_SHARED_MEMORY_PER_BLOCK_OPTIN": SHARED_PER_BLOCK_OPTIN,
    "MAX_BLOCKS_PER_MULTIPROCESSOR": 32, "MEMORY_POOLS_SUPPORTED": 0,
}


_HANDLES = itertools.count(0x7e0000001000, 0x40)


def _kernels():
    from . import kernels  # the host-compiled kernel modules (built on first use)
    return kernels


class _Emulator:
    def __init__(self, config: Config):
        self.config = config
        self.lock = threading.RLock()
        self.tls = threading.local()
        self.initialized = False
        self.devices = [_Device(i, config.memory_bytes) for i in range(config.devices)]
        self.handles: dict[int, object] = {}
        self.dead: dict[int, str] = {}            # destroyed handle -> what it was
        self.next_handle = _HANDLES  # shared by every reset: an old handle is never reissued
        self.serials = itertools.count(1)
        self.capture_ids = itertools.count(1)
        self.launches = 0
        self.allocs: list[_Alloc] = []            # live, sorted by ptr
        self.starts: list[int] = []
        self.freed: dict[int, _Alloc] = {}        # recently freed, by ptr (for messages)
        self.released_leaks: list[Leak] = []
        self.captures: list[_Capture] = []

    # ------------------------------------------------------------------ handles

    def new_handle(self, obj) -> int:
        h = next(self.next_handle)
        self.handles[h] = obj
        return h

    def lookup(self, handle, types: tuple, what: str):
        if handle is None:
            raise _Fail(CUresult.CUDA_ERROR_INVALID_HANDLE, f"{what} is NULL")
        h = int(handle)
        obj = self.handles.get(h)
        if obj is None or not isinstance(obj, types):
            if h in self.dead:
                raise _Fail(CUresult.CUDA_ERROR_INVALID_HANDLE,
                            f"{what} 0x{h:x} was destroyed ({self.dead[h]})")
            raise _Fail(CUresult.CUDA_ERROR_INVALID_HANDLE, f"{what} 0x{h:x} is not a live handle")
        return obj

    def kill(self, res, why: str) -> None:
        self.handles.pop(res.handle, None)
        self.dead[res.handle] = why
        if res.ctx is not None:
            res.ctx.resources.pop(res.handle, None)

    # ------------------------------------------------------------------ contexts

    @property
    def stack(self) -> list:
        s = getattr(self.tls, "stack", None)
        if s is None:
            s = self.tls.stack = []
        return s

    def need_init(self) -> None:
        if not self.initialized:
            raise _Fail(CUresult.CUDA_ERROR_NOT_INITIALIZED, "cuInit has not been called")

    def current(self, *, sticky: bool = True) -> _Context:
        self.need_init()
        if not self.stack:
            raise _Fail(CUresult.CUDA_ERROR_INVALID_CONTEXT,
                        "no context is current on this thread (cuCtxSetCurrent / cuCtxPushCurrent)")
        ctx = self.stack[-1]
        if not ctx.alive:
            raise _Fail(CUresult.CUDA_ERROR_INVALID_CONTEXT,
                        f"the current context (device {ctx.device.ordinal}'s primary context) "
                        f"was released")
        if sticky:
            self.check_fault(ctx)
        return ctx

    @staticmethod
    def check_fault(ctx: _Context) -> None:
        if ctx.fault is not None:
            code, message = ctx.fault
            raise _Fail(code, f"a kernel fault in this context (sticky: every later call in "
                              f"the context fails): {message}")

    def device(self, dev) -> _Device:
        self.need_init()
        n = int(dev)
        if not 0 <= n < len(self.devices):
            raise _Fail(CUresult.CUDA_ERROR_INVALID_DEVICE,
                        f"device {n} out of range: expected 0 <= device < {len(self.devices)}")
        return self.devices[n]

    def context(self, handle) -> _Context:
        ctx = self.lookup(handle, (_Context,), "context")
        if not ctx.alive:
            raise _Fail(CUresult.CUDA_ERROR_INVALID_CONTEXT, "the context was released")
        return ctx

    def release_context(self, ctx: _Context) -> None:
        """Destroys a primary context whose last reference went: what is still live in it
        is recorded as leaked, then freed."""
        ctx.alive = False
        ctx.device.ctx = None
        for res in list(ctx.resources.values()):
            if isinstance(res, (_Alloc, _Stream, _Event, _Graph)):
                self.released_leaks.append(self.leak(res))
            if isinstance(res, _Alloc):
                self.free(res)
            self.kill(res, "its context was released")
        self.kill_handle(ctx.handle, "the primary context was released")

    def kill_handle(self, h: int, why: str) -> None:
        self.handles.pop(h, None)
        self.dead[h] = why

    def leak(self, res) -> Leak:
        return Leak(res.kind, res.handle if not isinstance(res, _Alloc) else res.ptr,
                    res.ctx.device.ordinal, getattr(res, "size", 0), res.where)

    # ------------------------------------------------------------------ memory

    def alloc(self, ctx: _Context, size: int) -> _Alloc:
        dev = ctx.device
        if dev.used + size > dev.total:
            raise _Fail(CUresult.CUDA_ERROR_OUT_OF_MEMORY,
                        f"{size} bytes requested, {dev.total - dev.used} of {dev.total} free "
                        f"on device {dev.ordinal}")
        ptr = _kernels().alloc(size)
        a = _Alloc(self, ctx, ptr, size)
        ctx.resources[a.handle] = a
        dev.used += size
        i = bisect_right(self.starts, ptr)
        self.starts.insert(i, ptr)
        self.allocs.insert(i, a)
        self.freed.pop(ptr, None)
        return a

    def free(self, a: _Alloc) -> None:
        """Forgets and frees a (kernels.free poisons it; it raises KernelFault, after freeing,
        when a kernel or copy wrote past the end)."""
        i = bisect_left(self.starts, a.ptr)
        del self.allocs[i], self.starts[i]
        a.live = False
        a.ctx.device.used -= a.size
        a.ctx.resources.pop(a.handle, None)
        self.freed[a.ptr] = a
        if len(self.freed) > 4096:
            self.freed.pop(next(iter(self.freed)))
        _kernels().free(a.ptr)

    def find(self, ptr: int) -> _Alloc | None:
        i = bisect_right(self.starts, ptr) - 1
        if i >= 0:
            a = self.allocs[i]
            if a.ptr <= ptr < a.ptr + a.size:
                return a
        return None

    def range(self, ctx: _Context, ptr, n: int, what: str) -> _Alloc:
        """The live allocation of ctx's device holding [ptr, ptr + n); refuses otherwise."""
        p = int(ptr)
        if n < 0:
            raise _Fail(CUresult.CUDA_ERROR_INVALID_VALUE, f"{what}: negative size {n}")
        a = self.find(p)
        rng = f"[0x{p:x}, 0x{p + n:x})"
        if a is None:
            old = next((f for f in self.freed.values() if f.ptr <= p < f.ptr + f.size), None)
            if old is not None:
                raise _Fail(CUresult.CUDA_ERROR_INVALID_VALUE,
                            f"{what}: {rng} lies in freed device memory (use after free of "
                            f"{old.describe()})")
            raise _Fail(CUresult.CUDA_ERROR_INVALID_VALUE,
                        f"{what}: {rng} is not inside any live device allocation")
        if p + n > a.ptr + a.size:
            raise _Fail(CUresult.CUDA_ERROR_INVALID_VALUE,
                        f"{what}: {rng} runs {p + n - a.ptr - a.size} bytes past the end of the "
                        f"allocation {a.describe()}")
        if a.ctx is not ctx:
            raise _Fail(CUresult.CUDA_ERROR_INVALID_VALUE,
                        f"{what}: {rng} is memory of device {a.ctx.device.ordinal}, the current "
                        f"context is device {ctx.device.ordinal}'s")
        return a

    # ------------------------------------------------------------------ streams

    def stream(self, ctx: _Context, handle) -> _Stream:
        h = 0 if handle is None else int(handle)
        if h in (0, 1):
            return ctx.legacy
        if h == 2:
            tid = threading.get_ident()
            s = ctx.per_thread.get(tid)
            if s is None:
                s = ctx.per_thread[tid] = _Stream(self, ctx, True, "the per-thread default stream",
                                                  fixed=2)
            return s
        s = self.lookup(h, (_Stream,), "stream")
        return s

    def captures_in(self, ctx: _Context) -> list[_Capture]:
        return [c for c in self.captures if c.origin.ctx is ctx]

    def invalidate(self, capture: _Capture, why: str) -> None:
        if capture.invalid is None:
            capture.invalid = why

    def refuse_unsafe(self, ctx: _Context, what: str) -> None:
        """A potentially unsafe call (allocation, synchronous copy, context sync) while a
        capture prohibits it: this thread's capture unless relaxed, any thread's global one."""
        me = threading.get_ident()
        bad = [c for c in self.captures if c.invalid is None and (
            (c.thread == me and c.mode != CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED)
            or c.mode == CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL)]
        if bad:
            for c in bad:
                self.invalidate(c, f"{what} was called while it captured")
            raise _Fail(CUresult.CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,
                        f"{what} is not permitted while {bad[0].origin.name} 0x{bad[0].origin.handle:x} "
                        f"captures (mode {CUstreamCaptureMode(bad[0].mode).name}); the capture is invalidated")

    def refuse_legacy_join(self, s: _Stream, what: str) -> None:
        """Work on the legacy stream would wait for a capturing blocking stream."""
        if s is not s.ctx.legacy:
            return
        bad = [c for c in self.captures_in(s.ctx)
               if any(t.blocking for t in c.streams)]
        if bad:
            for c in bad:
                self.invalidate(c, f"{what} on the legacy stream would have joined it")
            raise _Fail(CUresult.CUDA_ERROR_STREAM_CAPTURE_IMPLICIT,
                        f"{what} on the legacy stream would wait for the capturing blocking "
                        f"stream 0x{bad[0].origin.handle:x}; the capture is invalidated")

    def refuse_capturing(self, s: _Stream, what: str) -> None:
        """A synchronize/query of a capturing stream (or of the legacy stream while a blocking
        stream captures)."""
        if s.capture is not None:
            self.invalidate(s.capture, f"{what} was called on a capturing stream")
            raise _Fail(CUresult.CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,
                        f"{what} of stream 0x{s.handle:x}, which is capturing; the capture is invalidated")
        self.refuse_legacy_join(s, what)

    def enqueue(self, s: _Stream, label: str, fn, deps=()) -> _Op:
        """Queues fn on s (not capturing): after s's previous op, the extra deps, and the
        legacy-stream rules (legacy waits for blocking streams, blocking streams for legacy)."""
        ctx = s.ctx
        need = [d for d in deps if not d.done]
        if s.pending():
            need.append(s.last)
        if s is ctx.legacy:
            need += [t.last for t in ctx.streams() if t is not s and t.blocking and t.pending()]
            need += [o for o in ctx.orphans if not o.done]
        elif s.blocking and ctx.legacy.pending():
            need.append(ctx.legacy.last)
        op = _Op(label, fn, need, ctx)
        s.last = op
        return op

    def complete(self, target: _Op | None) -> None:
        """Runs target and everything it depends on, dependencies first."""
        if target is None or target.done:
            return
        stack = [target]
        while stack:
            op = stack[-1]
            if op.done:
                stack.pop()
                continue
            waiting = [d for d in op.deps if not d.done]
            if waiting:
                stack.extend(waiting)
                continue
            stack.pop()
            self.execute(op)

    def execute(self, op: _Op) -> None:
        op.done = True
        op.deps = []
        ctx = op.ctx
        if ctx.fault is not None or not ctx.alive:
            return  # work behind a fault never runs
        try:
            op.fn()
        except _Fault as f:
            ctx.fault = (f.code, f.message)
        op.fn = None

    def synchronize_ctx(self, ctx: _Context) -> None:
        for s in list(ctx.streams()):
            self.complete(s.last)
        for o in ctx.orphans:
            self.complete(o)
        ctx.orphans = [o for o in ctx.orphans if not o.done]

    def after_wait(self, ctx: _Context) -> None:
        """What a synchronising call returns once the work ran: a fault it hit."""
        self.check_fault(ctx)

    def next_seed(self) -> int:
        self.launches += 1
        return (self.config.seed * 1_000_003 + self.launches) & 0x7FFFFFFFFFFFFFFF

    # ------------------------------------------------------------------ capture

    def add_node(self, s: _Stream, label: str, run) -> _Node:
        c = s.capture
        node = _Node(label, run, s.tail, len(c.nodes))
        c.nodes.append(node)
        s.tail = [node]
        return node

    def end_capture(self, c: _Capture) -> None:
        for s in c.streams:
            s.capture, s.tail = None, []
        self.captures.remove(c)


class _Fault(Exception):
    """A kernel or copy fault while a queue ran: becomes the context's sticky error."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = CUresult(code)
        self.message = message


_emu: _Emulator = _Emulator(Config())


def reset(config: Config) -> None:
    """Replaces the emulated machine by a fresh one (every handle of the old one is gone;
    its device memory is freed)."""
    global _emu
    old = _emu
    with old.lock:
        for a in list(old.allocs):
            old.free(a)
        _emu = _Emulator(config)


def config() -> Config:
    return _emu.config


def leaks() -> list[Leak]:
    """Live streams, events, graphs and device allocations of every context, and what was
    still live when a context was released (a release frees it, and reports it here)."""
    with _emu.lock:
        out = list(_emu.released_leaks)
        for dev in _emu.devices:
            if dev.ctx is not None:
                out += [_emu.leak(r) for r in sorted(dev.ctx.resources.values(), key=lambda r: r.serial)
                        if isinstance(r, (_Alloc, _Stream, _Event, _Graph))]
        return out


def live_serial() -> int:
    """A counter of created resources: leaks created after a given value are newer."""
    return next(_emu.serials)


def leaks_since(serial: int) -> list[Leak]:
    """The live resources (as `leaks()`) created after `live_serial()` returned `serial`."""
    with _emu.lock:
        out = []
        for dev in _emu.devices:
            if dev.ctx is not None:
                out += [_emu.leak(r) for r in sorted(dev.ctx.resources.values(), key=lambda r: r.serial)
                        if isinstance(r, (_Alloc, _Stream, _Event, _Graph)) and r.serial > serial]
        return out


def error_detail(code) -> str | None:
    """Why the calling thread's last failed call returned `code` (None when it did not)."""
    last = getattr(_emu.tls, "error", None)
    if last is not None and last[0] == int(code):
        return last[1]
    return None


# ============================================================================ API plumbing

def _api(nvalues: int):
    """Wraps an implementation into a driver call: (CUDA_SUCCESS, *values) or, on _Fail,
    (code, None, ...) with the reason stored for error_detail."""
    def wrap(impl):
        def call(*args):
            emu = _emu
            with emu.lock:
                try:
                    values = impl(emu, *args)
                except _Fail as f:
                    emu.tls.error = (int(f.code), f.detail)
                    return (f.code,) + (None,) * nvalues
            if nvalues == 0:
                return (CUresult.CUDA_SUCCESS,)
            if nvalues == 1:
                return (CUresult.CUDA_SUCCESS, values)
            return (CUresult.CUDA_SUCCESS, *values)
        call.__name__ = call.__qualname__ = impl.__name__
        call.__doc__ = impl.__doc__
        return call
    return wrap


def _fail(code, detail: str):
    raise _Fail(code, detail)


def _int(value, what: str) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise TypeError(f"{what}: expected an int, got {type(value).__name__}") from None


def _host_address(obj, what: str) -> int:
    """A host pointer: an int address, or a buffer (numpy array, bytearray) kept by the caller."""
    if isinstance(obj, int):
        return obj
    if hasattr(obj, "ctypes"):
        return obj.ctypes.data
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(obj))
    except TypeError:
        raise TypeError(f"{what}: expected a host address (int) or a writable buffer, "
                        f"got {type(obj).__name__}") from None


# ============================================================================ init, devices

@_api(0)
def cuInit(emu, flags):
    if _int(flags, "cuInit flags") != 0:
        _fail(CUresult.CUDA_ERROR_INVALID_VALUE, f"cuInit flags must be 0, got {flags}")
    emu.initialized = True


@_api(1)
def cuDriverGetVersion(emu):
    return emu.config.driver_version


@_api(1)
def cuDeviceGetCount(emu):
    emu.need_init()
    return len(emu.devices)


@_api(1)
def cuDeviceGet(emu, ordinal):
    return CUdevice(emu.device(ordinal).ordinal)


@_api(1)
def cuDeviceGetName(emu, length, dev):
    name = emu.device(dev).name.encode()[:max(int(length) - 1, 0)]
    return name + b"\0" * (int(length) - len(name))


@_api(1)
def cuDeviceTotalMem(emu, dev):
    return emu.device(dev).total


@_api(1)
def cuDeviceGetAttribute(emu, attrib, dev):
    emu.device(dev)
    try:
        name = CUdevice_attribute(int(attrib)).name.removeprefix("CU_DEVICE_ATTRIBUTE_")
    except ValueError:
        _fail(CUresult.CUDA_ERROR_INVALID_VALUE, f"device attribute {int(attrib)} is not emulated")
    if name == "PCI_BUS_ID":
        return int(dev) + 1
    return _ATTRIBUTES[name]


# ============================================================================ contexts

@_api(1)
def cuDevicePrimaryCtxRetain(emu, dev):
    d = emu.device(dev)
    if d.ctx is None:
        d.ctx = _Context(emu, d)
    d.ctx.refs += 1
    return CUcontext(d.ctx.handle)


@_api(0)
def cuDevicePrimaryCtxRelease(emu, dev):
    d = emu.device(dev)
    if d.ctx is None:
        _fail(CUresult.CUDA_ERROR_INVALID_CONTEXT, f"device {d.ordinal}'s primary context is not retained")
    for c in emu.captures_in(d.ctx):
        emu.invalidate(c, "its context was released")
    d.ctx.refs -= 1
    if d.ctx.refs == 0:
        emu.release_context(d.ctx)


@_api(0)
def cuCtxSetCurrent(emu, ctx):
    emu.need_init()
    stack = emu.stack
    c = None if ctx is None or int(ctx) == 0 else emu.context(ctx)
    if c is None:
        if stack:
            stack.pop()
        return
    if stack:
        stack[-1] = c
    else:
        stack.append(c)


@_api(1)
def cuCtxGetCurrent(emu):
    emu.need_init()
    stack = emu.stack
    return CUcontext(stack[-1].handle if stack and stack[-1].alive else 0)


@_api(0)
def cuCtxPushCurrent(emu, ctx):
    emu.need_init()
    emu.stack.append(emu.context(ctx))


@_api(1)
def cuCtxPopCurrent(emu):
    emu.need_init()
    if not emu.stack:
        _fail(CUresult.CUDA_ERROR_INVALID_CONTEXT, "no context is current on this thread")
    return CUcontext(emu.stack.pop().handle)


@_api(1)
def cuCtxGetDevice(emu):
    return CUdevice(emu.current().device.ordinal)


@_api(0)
def cuCtxSynchronize(emu):
    ctx = emu.current()
    emu.refuse_unsafe(ctx, "cuCtxSynchronize")
    emu.synchronize_ctx(ctx)
    emu.after_wait(ctx)


# ============================================================================ memory

@_api(1)
def cuMemGetInfo(emu):
    d = emu.current().device
    return (d.total - d.used, d.total)


@_api(1)
def cuMemAlloc(emu, bytesize):
    ctx = emu.current()
    n = _int(bytesize, "cuMemAlloc bytesize")
    emu.refuse_unsafe(ctx, "cuMemAlloc")
    if n <= 0:
        _fail(CUresult.CUDA_ERROR_INVALID_VALUE, f"cuMemAlloc of {n} bytes")
    return CUdeviceptr(emu.alloc(ctx, n).ptr)


@_api(0)
def cuMemFree(emu, dptr):
    ctx = emu.current()
    p = int(dptr)
    emu.refuse_unsafe(ctx, "cuMemFree")
    a = emu.find(p)
    if a is None or a.ptr != p:
        old = emu.freed.get(p)
        if old is not None and a is None:
            _fail(CUresult.CUDA_ERROR_INVALID_VALUE, f"double free of {old.describe()}")
        _fail(CUresult.CUDA_ERROR_INVALID_VALUE,
              f"0x{p:x} is not the start of a live device allocation")
    if a.ctx is not ctx:
        _fail(CUresult.CUDA_ERROR_INVALID_VALUE,
              f"0x{p:x} was allocated in device {a.ctx.device.ordinal}'s context, the current "
              f"one is device {ctx.device.ordinal}'s")
    emu.synchronize_ctx(ctx)  # cuMemFree waits for the device, as the driver's does
    emu.after_wait(ctx)
    kernels = _kernels()
    try:
        emu.free(a)
    except kernels.KernelFault as e:  # the canary past the end was overwritten
        ctx.fault = (getattr(CUresult, e.code, CUresult.CUDA_ERROR_ILLEGAL_ADDRESS), e.message)
        emu.check_fault(ctx)


def _copy_op(emu, ctx, dst, src, n, dst_dev: bool, src_dev: bool, what: str):
    """The run function of a copy: re-checks device ranges when it runs (a graph may replay
    after a free), then moves the bytes."""
    def run():
        for p, is_dev in ((dst, dst_dev), (src, src_dev)):
            a = emu.find(p) if is_dev else None
            if is_dev and (a is None or a.ctx is not ctx or a.ptr + a.size < p + n):
                raise _Fault(CUresult.CUDA_ERROR_ILLEGAL_ADDRESS,
                             f"{what}: [0x{p:x}, 0x{p + n:x}) is not inside a live allocation "
                             f"when the copy runs (freed after it was queued or captured?)")
        ctypes.memmove(dst, src, n)
    return run


def _memset_op(emu, ctx, dst, value, n, what):
    def run():
        a = emu.find(dst)
        if a is None or a.ctx is not ctx or a.ptr + a.size < dst + n:
            raise _Fault(CUresult.CUDA_ERROR_ILLEGAL_ADDRESS,
                         f"{what}: [0x{dst:x}, 0x{dst + n:x}) is not inside a live allocation "
                         f"when the memset runs (freed after it was queued or captured?)")
        ctypes.memset(dst, value, n)
    return run


def _submit(emu, ctx, s: _Stream, label: str, run, *, sync: bool) -> None:
    """Captures run into s's graph, or queues it on s (and waits for it when sync)."""
    if s.capture is not None:
        if s.capture.invalid is None:
            emu.add_node(s, label, run)
        else:
            _fail(CUresult.CUDA_ERROR_STREAM_CAPTURE_INVALIDATED,
                  f"{label}: the capture was invalidated earlier ({s.capture.invalid})")
        return
    emu.refuse_legacy_join(s, label)
    op = emu.enqueue(s, label, run)
    if sync:
        emu.complete(op)
        emu.after_wait(ctx)


def _memcpy(emu, kind: str, dst, src, n, stream, sync: bool):
    ctx = emu.current()
    n = _int(n, f"cuMemcpy{kind} ByteCount")
    name = f"cuMemcpy{kind}" + ("" if sync else "Async")
    if sync:
        emu.refuse_unsafe(ctx, name)
    dst_dev, src_dev = kind[-1] == "D", kind[0] == "D"
    d = int(dst) if dst_dev else _host_address(dst, f"{name} dstHost")
    s_ = int(src) if src_dev else _host_address(src, f"{name} srcHost")
    if n == 0:
        return
    if dst_dev:
        emu.range(ctx, d, n, f"{name} destination")
    if src_dev:
        emu.range(ctx, s_, n, f"{name} source")
    s = ctx.legacy if sync else emu.stream(ctx, stream)
    _check_stream_ctx(s, ctx, name)
    _submit(emu, ctx, s, name, _copy_op(emu, ctx, d, s_, n, dst_dev, src_dev, name), sync=sync)


def _check_stream_ctx(s: _Stream, ctx: _Context, what: str) -> None:
    if s.ctx is not ctx:
        _fail(CUresult.CUDA_ERROR_INVALID_HANDLE,
              f"{what}: stream 0x{s.handle:x} belongs to device {s.ctx.device.ordinal}'s context, "
              f"the current context is device {ctx.device.ordinal}'s")


@_api(0)
def cuMemcpyHtoD(emu, dstDevice, srcHost, ByteCount):
    _memcpy(emu, "HtoD", dstDevice, srcHost, ByteCount, None, True)


@_api(0)
def cuMemcpyDtoH(emu, dstHost, srcDevice, ByteCount):
    _memcpy(emu, "DtoH", dstHost, srcDevice, ByteCount, None, True)


@_api(0)
def cuMemcpyDtoD(emu, dstDevice, srcDevice, ByteCount):
    _memcpy(emu, "DtoD", dstDevice, srcDevice, ByteCount, None, True)


@_api(0)
def cuMemcpyHtoDAsync(emu, dstDevice, srcHost, ByteCount, hStream):
    _memcpy(emu, "HtoD", dstDevice, srcHost, ByteCount, hStream, False)


@_api(0)
def cuMemcpyDtoHAsync(emu, dstHost, srcDevice, ByteCount, hStream):
    _memcpy(emu, "DtoH", dstHost, srcDevice, ByteCount, hStream, False)


@_api(0)
def cuMemcpyDtoDAsync(emu, dstDevice, srcDevice, ByteCount, hStream):
    _memcpy(emu, "DtoD", dstDevice, srcDevice, ByteCount, hStream, False)


def _memset(emu, dst, value, n, stream, sync: bool):
    ctx = emu.current()
    name = "cuMemsetD8" + ("" if sync else "Async")
    if sync:
        emu.refuse_unsafe(ctx, name)
    value, n, d = _int(value, "uc"), _int(n, "N"), int(dst)
    if not 0 <= value <= 255:
        _fail(CUresult.CUDA_ERROR_INVALID_VALUE, f"{name}: value {value} is not a byte")
    if n == 0:
        return
    emu.range(ctx, d, n, name)
    s = ctx.legacy if sync else emu.stream(ctx, stream)
    _check_stream_ctx(s, ctx, name)
    _submit(emu, ctx, s, name, _memset_op(emu, ctx, d, value, n, name), sync=sync)


@_api(0)
def cuMemsetD8(emu, dstDevice, uc, N):
    _memset(emu, dstDevice, uc, N, None, True)


@_api(0)
def cuMemsetD8Async(emu, dstDevice, uc, N, hStream):
    _memset(emu, dstDevice, uc, N, hStream, False)


def _memcpy3d(emu, p, stream, sync: bool):
    ctx = emu.current()
    name = "cuMemcpy3D" + ("" if sync else "Async")
    if sync:
        emu.refuse_unsafe(ctx, name)
    w, h, depth = int(p.WidthInBytes), int(p.Height), int(p.Depth)
    if w == 0 or h == 0 or depth == 0:
        return
    sides = {}
    for side in ("src", "dst"):
        mt = int(getattr(p, side + "MemoryType"))
        pitch, height = int(getattr(p, side + "Pitch")), int(getattr(p, side + "Height"))
        x, y, z = (int(getattr(p, side + k)) for k in ("XInBytes", "Y", "Z"))
        if mt == CUmemorytype.CU_MEMORYTYPE_DEVICE:
            base, dev = int(getattr(p, side + "Device")), True
        elif mt == CUmemorytype.CU_MEMORYTYPE_HOST:
            base, dev = _host_address(getattr(p, side + "Host"), f"{name} {side}Host"), False
        else:
            _fail(CUresult.CUDA_ERROR_INVALID_VALUE, f"{name}: {side}MemoryType {mt} is not emulated")
        if pitch > MAX_PITCH:
            _fail(CUresult.CUDA_ERROR_INVALID_VALUE,
                  f"{name}: {side}Pitch {pitch} passes the device's largest pitch {MAX_PITCH} "
                  f"(CU_DEVICE_ATTRIBUTE_MAX_PITCH)")
        if pitch < x + w or (depth > 1 and height < y + h):
            _fail(CUresult.CUDA_ERROR_INVALID_VALUE,
                  f"{name}: {side}Pitch {pitch} / {side}Height {height} do not hold rows of "
                  f"{w} bytes at x={x} / {h} rows at y={y}")
        start = base + z * pitch * height + y * pitch + x
        last = start + (depth - 1) * pitch * height + (h - 1) * pitch + w
        if dev:
            emu.range(ctx, start, last - start, f"{name} {side}")
        sides[side] = (start, pitch * height, pitch, dev)
    (src, sslice, spitch, sdev), (dst, dslice, dpitch, ddev) = sides["src"], sides["dst"]

    def run():
        for q, is_dev in ((src, sdev), (dst, ddev)):
            if is_dev and emu.find(q) is None:
                raise _Fault(CUresult.CUDA_ERROR_ILLEGAL_ADDRESS,
                             f"{name}: 0x{q:x} is not inside a live allocation when the copy runs")
        for k in range(depth):
            for j in range(h):
                ctypes.memmove(dst + k * dslice + j * dpitch, src + k * sslice + j * spitch, w)

    s = ctx.legacy if sync else emu.stream(ctx, stream)
    _check_stream_ctx(s, ctx, name)
    _submit(emu, ctx, s, name, run, sync=sync)


@_api(0)
def cuMemcpy3D(emu, pCopy):
    _memcpy3d(emu, pCopy, None, True)


@_api(0)
def cuMemcpy3DAsync(emu, pCopy, hStream):
    _memcpy3d(emu, pCopy, hStream, False)


def _pointer_value(emu, a: _Alloc | None, attr: int, ptr: int):
    A = CUpointer_attribute
    if attr == A.CU_POINTER_ATTRIBUTE_CONTEXT:
        return CUcontext(a.ctx.handle if a else 0)
    if attr == A.CU_POINTER_ATTRIBUTE_MEMORY_TYPE:
        return CUmemorytype.CU_MEMORYTYPE_DEVICE if a else 0
    if attr == A.CU_POINTER_ATTRIBUTE_DEVICE_POINTER:
        return CUdeviceptr(ptr if a else 0)
    if attr == A.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL:
        return a.ctx.device.ordinal if a else -2
    if attr == A.CU_POINTER_ATTRIBUTE_RANGE_START_ADDR:
        return CUdeviceptr(a.ptr if a else 0)
    if attr == A.CU_POINTER_ATTRIBUTE_RANGE_SIZE:
        return a.size if a else 0
    if attr == A.CU_POINTER_ATTRIBUTE_BUFFER_ID:
        return a.handle if a else 0
    if attr in (A.CU_POINTER_ATTRIBUTE_IS_MANAGED, A.CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE):
        return False
    if attr == A.CU_POINTER_ATTRIBUTE_MAPPED:
        return a is not None
    if attr == A.CU_POINTER_ATTRIBUTE_SYNC_MEMOPS:
        return False
    _fail(CUresult.CUDA_ERROR_INVALID_VALUE, f"pointer attribute {attr} is not emulated")


@_api(1)
def cuPointerGetAttribute(emu, attribute, ptr):
    emu.need_init()
    p = int(ptr)
    a = emu.find(p)
    if a is None:
        _fail(CUresult.CUDA_ERROR_INVALID_VALUE, f"0x{p:x} is not a device pointer of a live allocation")
    return _pointer_value(emu, a, int(attribute), p)


@_api(1)
def cuPointerGetAttributes(emu, numAttributes, attributes, ptr):
    emu.need_init()
    if int(numAttributes) != len(attributes):
        _fail(CUresult.CUDA_ERROR_INVALID_VALUE, "numAttributes differs from len(attributes)")
    p = int(ptr)
    a = emu.find(p)  # an unknown pointer gives the NULL values, not an error
    return [_pointer_value(emu, a, int(x), p) for x in attributes]


# ============================================================================ streams

@_api(1)
def cuStreamCreate(emu, Flags):
    ctx = emu.current()
    f = _int(Flags, "cuStreamCreate Flags")
    if f not in (0, 1):
        _fail(CUresult.CUDA_ERROR_INVALID_VALUE, f"stream flags {f}")
    s = _Stream(emu, ctx, f == CUstream_flags.CU_STREAM_DEFAULT,
                "non-blocking stream" if f else "blocking stream")
    ctx.resources[s.handle] = s
    return CUstream(s.handle)


@_api(0)
def cuStreamDestroy(emu, hStream):
    ctx = emu.current()
    s = emu.stream(ctx, hStream)
    if s.handle in (1, 2):
        _fail(CUresult.CUDA_ERROR_INVALID_HANDLE, "the default streams cannot be destroyed")
    if s.capture is not None:
        emu.invalidate(s.capture, "a capturing stream was destroyed")
    if s.pending():  # the device finishes its work, then releases it
        s.ctx.orphans.append(s.last)
    emu.kill(s, "cuStreamDestroy")


@_api(0)
def cuStreamSynchronize(emu, hStream):
    ctx = emu.current()
    s = emu.stream(ctx, hStream)
    emu.refuse_capturing(s, "cuStreamSynchronize")
    emu.check_fault(s.ctx)
    emu.complete(s.last)
    emu.after_wait(s.ctx)


@_api(0)
def cuStreamQuery(emu, hStream):
    ctx = emu.current()
    s = emu.stream(ctx, hStream)
    emu.refuse_capturing(s, "cuStreamQuery")
    emu.check_fault(s.ctx)
    if s.pending():  # the work goes on, but was not finished when asked
        emu.complete(s.last)
        _fail(CUresult.CUDA_ERROR_NOT_READY, "work was still pending on the stream")
    emu.after_wait(s.ctx)


@_api(0)
def cuStreamWaitEvent(emu, hStream, hEvent, Flags):
    ctx = emu.current()
    s = emu.stream(ctx, hStream)
    ev = emu.lookup(hEvent, (_Event,), "event")
    if ev.captured is not None:
        cap, nodes = ev.captured
        if cap not in emu.captures:
            _fail(CUresult.CUDA_ERROR_STREAM_CAPTURE_ISOLATION,
                  "the event was recorded in a capture that has ended")
        if s.capture is None:  # fork: s joins the capture
            if s is ctx.legacy:
                emu.invalidate(cap, "the legacy stream waited on a captured event")
                _fail(CUresult.CUDA_ERROR_STREAM_CAPTURE_IMPLICIT,
                      "the legacy stream cannot join a capture; the capture is invalidated")
            s.capture, s.tail = cap, list(nodes)
            cap.streams.append(s)
        elif s.capture is cap:  # join
            s.tail = s.tail + [n for n in nodes if n not in s.tail]
        else:
            emu.invalidate(cap, "two captures would merge")
            emu.invalidate(s.capture, "two captures would merge")
            _fail(CUresult.CUDA_ERROR_STREAM_CAPTURE_MERGE,
                  "the stream captures into another graph than the event's")
        return
    if s.capture is not None:
        emu.invalidate(s.capture, "it waited on an event recorded outside the capture")
        _fail(CUresult.CUDA_ERROR_STREAM_CAPTURE_ISOLATION,
              f"stream 0x{s.handle:x} captures and the event was recorded outside the capture; "
              f"the capture is invalidated")
    if ev.op is None or ev.op.done:
        return
    emu.refuse_legacy_join(s, "cuStreamWaitEvent")
    emu.enqueue(s, "cuStreamWaitEvent", lambda: None, deps=[ev.op])


@_api(1)
def cuStreamIsCapturing(emu, hStream):
    ctx = emu.current()
    s = emu.stream(ctx, hStream)
    if s.capture is not None:
        return (CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_INVALIDATED if s.capture.invalid
                else CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_ACTIVE)
    if s is ctx.legacy and any(t.blocking for c in emu.captures_in(ctx) for t in c.streams):
        _fail(CUresult.CUDA_ERROR_STREAM_CAPTURE_IMPLICIT,
              "a blocking stream captures: the legacy stream would join it")
    return CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE


@_api(6)
def cuStreamGetCaptureInfo(emu, hStream):
    ctx = emu.current()
    s = emu.stream(ctx, hStream)
    if s.capture is None:
        if s is ctx.legacy and any(t.blocking for c in emu.captures_in(ctx) for t in c.streams):
            _fail(CUresult.CUDA_ERROR_STREAM_CAPTURE_IMPLICIT,
                  "a blocking stream captures: the legacy stream would join it")
        return (CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE, 0, None, [], [], 0)
    c = s.capture
    status = (CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_INVALIDATED if c.invalid
              else CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_ACTIVE)
    deps = [CUgraphNode(n.index + 1) for n in s.tail]
    return (status, c.id, CUgraph(0), deps, [None] * len(deps), len(deps))


@_api(0)
def cuStreamBeginCapture(emu, hStream, mode):
    ctx = emu.current()
    s = emu.stream(ctx, hStream)
    m = _int(mode, "cuStreamBeginCapture mode")
    if m not in (0, 1, 2):
        _fail(CUresult.CUDA_ERROR_INVALID_VALUE, f"capture mode {m}")
    if s is ctx.legacy:
        _fail(CUresult.CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, "the legacy stream cannot capture")
    if s.capture is not None:
        _fail(CUresult.CUDA_ERROR_ILLEGAL_STATE, f"stream 0x{s.handle:x} is already capturing")
    c = _Capture(emu, s, m)
    s.capture, s.tail = c, []
    emu.captures.append(c)


@_api(1)
def cuStreamEndCapture(emu, hStream):
    ctx = emu.current(sticky=False)
    s = emu.stream(ctx, hStream)
    c = s.capture
    if c is None:
        _fail(CUresult.CUDA_ERROR_ILLEGAL_STATE, f"stream 0x{s.handle:x} is not capturing")
    if c.origin is not s:
        emu.invalidate(c, "cuStreamEndCapture was called on a forked stream")
        _fail(CUresult.CUDA_ERROR_STREAM_CAPTURE_UNMATCHED,
              "cuStreamEndCapture on a stream that joined the capture, not its origin")
    if c.mode != CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED and c.thread != threading.get_ident():
        _fail(CUresult.CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD,
              "the capture began on another thread")
    tail = s.tail
    emu.end_capture(c)
    if c.invalid is not None:
        _fail(CUresult.CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, f"the capture was invalidated: {c.invalid}")
    emu.check_fault(ctx)
    joined, todo = set(), list(tail)
    while todo:
        n = todo.pop()
        if n.index not in joined:
            joined.add(n.index)
            todo += n.deps
    loose = [n for n in c.nodes if n.index not in joined]
    if loose:
        _fail(CUresult.CUDA_ERROR_STREAM_CAPTURE_UNJOINED,
              f"{len(loose)} captured operation(s) ({loose[0].label}, ...) on forked streams were "
              f"not joined back into the origin stream")
    g = _Graph(emu, ctx, c.nodes)
    ctx.resources[g.handle] = g
    return CUgraph(g.handle)


# ============================================================================ events

@_api(1)
def cuEventCreate(emu, Flags):
    ctx = emu.current()
    f = _int(Flags, "cuEventCreate Flags")
    if f & ~0x7:
        _fail(CUresult.CUDA_ERROR_INVALID_VALUE, f"event flags {f}")
    ev = _Event(emu, ctx, f)
    ctx.resources[ev.handle] = ev
    return CUevent(ev.handle)


@_api(0)
def cuEventDestroy(emu, hEvent):
    emu.current()
    emu.kill(emu.lookup(hEvent, (_Event,), "event"), "cuEventDestroy")


@_api(0)
def cuEventRecord(emu, hEvent, hStream):
    ctx = emu.current()
    ev = emu.lookup(hEvent, (_Event,), "event")
    s = emu.stream(ctx, hStream)
    if ev.ctx is not s.ctx:
        _fail(CUresult.CUDA_ERROR_INVALID_HANDLE, "the event and the stream belong to different contexts")
    if s.capture is not None:
        if s.capture.invalid is not None:
            _fail(CUresult.CUDA_ERROR_STREAM_CAPTURE_INVALIDATED,
                  f"the capture was invalidated earlier ({s.capture.invalid})")
        ev.captured, ev.op, ev.time = (s.capture, list(s.tail)), None, None
        return
    emu.refuse_legacy_join(s, "cuEventRecord")

    def stamp():
        ev.time = time.perf_counter()
    ev.captured, ev.time = None, None
    ev.op = emu.enqueue(s, "cuEventRecord", stamp)


def _event_ready(emu, ev: _Event, what: str) -> None:
    if ev.captured is not None:
        _fail(CUresult.CUDA_ERROR_CAPTURED_EVENT, f"{what} of an event last recorded in a capture")


@_api(0)
def cuEventSynchronize(emu, hEvent):
    emu.current(sticky=False)
    ev = emu.lookup(hEvent, (_Event,), "event")
    _event_ready(emu, ev, "cuEventSynchronize")
    emu.check_fault(ev.ctx)
    emu.complete(ev.op)
    emu.after_wait(ev.ctx)


@_api(0)
def cuEventQuery(emu, hEvent):
    emu.current(sticky=False)
    ev = emu.lookup(hEvent, (_Event,), "event")
    _event_ready(emu, ev, "cuEventQuery")
    emu.check_fault(ev.ctx)
    if ev.op is not None and not ev.op.done:
        emu.complete(ev.op)
        _fail(CUresult.CUDA_ERROR_NOT_READY, "the event's work was still pending")
    emu.after_wait(ev.ctx)


@_api(1)
def cuEventElapsedTime(emu, hStart, hEnd):
    emu.current()
    a = emu.lookup(hStart, (_Event,), "start event")
    b = emu.lookup(hEnd, (_Event,), "end event")
    for ev in (a, b):
        _event_ready(emu, ev, "cuEventElapsedTime")
        if not ev.timing:
            _fail(CUresult.CUDA_ERROR_INVALID_HANDLE, "an event created with CU_EVENT_DISABLE_TIMING")
        if ev.op is None:
            _fail(CUresult.CUDA_ERROR_INVALID_HANDLE, "an event that was never recorded")
    if not (a.op.done and b.op.done) or a.time is None or b.time is None:
        _fail(CUresult.CUDA_ERROR_NOT_READY, "an event has not completed")
    return (b.time - a.time) * 1000.0


# ============================================================================ modules

_shipped_cache: dict[tuple, dict[bytes, str]] = {}


def _shipped() -> dict[bytes, str]:
    """sha256 of every shipped module image (PTX, and any cubin/fatbin beside it) -> module name."""
    from .. import kernels as gpu_kernels
    dirs = [d for d in (gpu_kernels._PKG_DIR, gpu_kernels._REPO_DIR) if os.path.isdir(d)]
    files = sorted(os.path.join(d, f) for d in dirs for f in os.listdir(d)
                   if f.endswith((".ptx", ".cubin", ".fatbin")))
    key = tuple((f, os.stat(f).st_mtime_ns, os.stat(f).st_size) for f in files)
    table = _shipped_cache.get(key)
    if table is None:
        table = {}
        for f in files:
            with open(f, "rb") as fh:
                table[hashlib.sha256(fh.read().rstrip(b"\0")).digest()] = \
                    os.path.splitext(os.path.basename(f))[0]
        _shipped_cache.clear()
        _shipped_cache[key] = table
    return table


def _jit_log(options, values, text: str) -> None:
    """Writes text into the CU_JIT_ERROR_LOG_BUFFER option's buffer (NUL-terminated,
    truncated to CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES)."""
    opts = [int(o) for o in options]
    if CUjit_option.CU_JIT_ERROR_LOG_BUFFER not in opts:
        return
    buf = values[opts.index(CUjit_option.CU_JIT_ERROR_LOG_BUFFER)]
    size = len(buf)
    if CUjit_option.CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES in opts:
        size = min(size, int(values[opts.index(CUjit_option.CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES)]))
    data = text.encode()[:max(size - 1, 0)] + b"\0"
    buf[:len(data)] = data


def _load(emu, image, options=(), values=()) -> CUmodule:
    ctx = emu.current()
    if len(options) != len(values):
        _fail(CUresult.CUDA_ERROR_INVALID_VALUE, "JIT options and values differ in number")
    if not isinstance(image, (bytes, bytearray, memoryview)):
        _fail(CUresult.CUDA_ERROR_INVALID_VALUE,
              f"the emulator takes the image as bytes, got {type(image).__name__}")
    data = bytes(image).rstrip(b"\0")
    info = None
    if b".version" in data[:4096]:
        try:
            info = _ptx.parse(data)
        except _ptx.PtxError as e:
            _jit_log(options, values, f"ptxas application ptx input: {e}")
            _fail(CUresult.CUDA_ERROR_INVALID_PTX, str(e))
        need = _ptx.first_driver(info.version)
        have = emu.config.driver_version
        if need is None or need > have:
            newest = _ptx.newest_isa(have)
            cur = f"{newest[0]}.{newest[1]}" if newest else "none"
            _jit_log(options, values,
                     f"ptxas application ptx input, line 1; fatal   : Unsupported .version "
                     f"{info.version_text}; current version is '{cur}'\n"
                     f"ptxas fatal   : Ptx assembly aborted due to errors")
            _fail(CUresult.CUDA_ERROR_UNSUPPORTED_PTX_VERSION,
                  f"PTX ISA {info.version_text} needs a driver of CUDA "
                  f"{(need or 0) // 1000}.{(need or 0) % 1000 // 10} or newer; the emulated driver "
                  f"is {have} (reads PTX ISA up to {cur})")
        if info.target.startswith("sm_") and int("".join(c for c in info.target[3:] if c.isdigit()) or 0) > \
                COMPUTE_CAPABILITY[0] * 10 + COMPUTE_CAPABILITY[1]:
            _jit_log(options, values, f"ptxas fatal   : target {info.target} is newer than the device (sm_90)")
            _fail(CUresult.CUDA_ERROR_INVALID_PTX, f".target {info.target} is newer than sm_90")
    name = _shipped().get(hashlib.sha256(data).digest())
    if name is None:
        _fail(CUresult.CUDA_ERROR_INVALID_IMAGE,
              "the emulator runs only kvcore's shipped modules, and this image equals none of them")
    impl = _kernels().load(name, asan=emu.config.asan)
    if info is not None:
        for entry, params in info.entries.items():
            have_p = impl.entries.get(entry)
            if have_p is None or [p.size for p in have_p] != [p.size for p in params]:
                _fail(CUresult.CUDA_ERROR_INVALID_IMAGE,
                      f"module {name}: .entry {entry} ({[p.size for p in params]} parameter bytes) "
                      f"differs from the host build's kernel "
                      f"({None if have_p is None else [p.size for p in have_p]})")
    _jit_log(options, values, "")
    m = _Module(emu, ctx, name, info, impl)
    ctx.resources[m.handle] = m
    return CUmodule(m.handle)


@_api(1)
def cuModuleLoadData(emu, image):
    return _load(emu, image)


@_api(1)
def cuModuleLoadDataEx(emu, image, numOptions, options, optionValues):
    options, values = list(options or ()), list(optionValues or ())
    if int(numOptions) != len(options):
        _fail(CUresult.CUDA_ERROR_INVALID_VALUE, "numOptions differs from len(options)")
    return _load(emu, image, options, values)


@_api(0)
def cuModuleUnload(emu, hmod):
    emu.current()
    m = emu.lookup(hmod, (_Module,), "module")
    for f in m.functions.values():
        emu.kill(f, "its module was unloaded")
    emu.kill(m, "cuModuleUnload")


@_api(1)
def cuModuleGetFunction(emu, hmod, name):
    emu.current()
    m = emu.lookup(hmod, (_Module,), "module")
    key = name.decode() if isinstance(name, (bytes, bytearray)) else str(name)
    f = m.functions.get(key)
    if f is None:
        entries = m.info.entries if m.info is not None else m.impl.entries
        if key not in entries or key not in m.impl.entries:
            _fail(CUresult.CUDA_ERROR_NOT_FOUND, f"module {m.name} has no kernel {key!r}")
        params = tuple((p.size, bool(p.is_pointer)) for p in m.impl.entries[key])
        f = m.functions[key] = _Function(emu, m, key, params)
    return CUfunction(f.handle)


def _resources() -> dict[str, dict[str, tuple[int, int]]]:
    """module -> kernel -> (registers, static shared bytes): the shipped resources.json
    (tools/build_ptx.py writes it from ptxas -v for sm_90)."""
    if not _resources_cache:
        from .. import kernels as gpu_kernels
        for d in (gpu_kernels._PKG_DIR, gpu_kernels._REPO_DIR):
            path = os.path.join(d, "resources.json")
            if os.path.exists(path):
                with open(path) as fh:
                    modules = json.load(fh)["modules"]
                _resources_cache.update({m: {k: (int(r), int(b)) for k, (r, b) in ks.items()}
                                         for m, ks in modules.items()})
                break
    return _resources_cache


_resources_cache: dict[str, dict[str, tuple[int, int]]] = {}


def _registers(f: _Function) -> int:
    return f.module.resources.get(f.name, (0, 0))[0]


def _static_shared(f: _Function) -> int:
    return f.module.resources.get(f.name, (0, 0))[1]


@_api(1)
def cuFuncGetAttribute(emu, attrib, hfunc):
    emu.current()
    f = emu.lookup(hfunc, (_Function,), "function")
    a = int(attrib)
    if a == CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK:
        return 1024
    if a == CUfunction_attribute.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES:
        return _static_shared(f)
    if a == CUfunction_attribute.CU_FUNC_ATTRIBUTE_NUM_REGS:
        return _registers(f)
    if a == CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES:
        return f.max_dynamic_shared
    if a == CUfunction_attribute.CU_FUNC_ATTRIBUTE_PTX_VERSION and f.module.info is not None:
        return f.module.info.version[0] * 10 + f.module.info.version[1]
    _fail(CUresult.CUDA_ERROR_INVALID_VALUE, f"function attribute {a} is not emulated")


@_api(0)
def cuFuncSetAttribute(emu, hfunc, attrib, value):
    emu.current()
    f = emu.lookup(hfunc, (_Function,), "function")
    if int(attrib) != CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES:
        _fail(CUresult.CUDA_ERROR_INVALID_VALUE, f"function attribute {int(attrib)} is not emulated")
    v = _int(value, "value")
    if not 0 <= v <= SHARED_PER_BLOCK_OPTIN - _static_shared(f):
        _fail(CUresult.CUDA_ERROR_INVALID_VALUE,
              f"{v} bytes of dynamic shared memory: at most {SHARED_PER_BLOCK_OPTIN - _static_shared(f)}")
    f.max_dynamic_shared = v


@_api(1)
def cuOccupancyMaxActiveBlocksPerMultiprocessor(emu, func, blockSize, dynamicSMemSize):
    """Blocks per SM from the thread, register and shared-memory limits of sm_90, with the
    registers and static shared memory ptxas gives the kernel (resources.json): registers
    are allocated per warp in units of 256, 64K per SM."""
    emu.current()
    f = emu.lookup(func, (_Function,), "function")
    threads = _int(blockSize, "blockSize")
    if not 1 <= threads <= 1024:
        _fail(CUresult.CUDA_ERROR_INVALID_VALUE, f"block size {threads}")
    warps = -(-threads // 32)
    blocks = min(32, 64 // warps)
    regs = _registers(f)
    if regs:
        per_warp = -(-regs * 32 // 256) * 256
        blocks = min(blocks, 65536 // per_warp // warps)
    shared = _static_shared(f) + _int(dynamicSMemSize, "dynamicSMemSize")
    if shared:
        blocks = min(blocks, SHARED_PER_SM // (shared + 1024))
    return blocks


# ============================================================================ launches

_SCALAR_CTYPES = (ctypes.c_bool, ctypes.c_char, ctypes.c_wchar, ctypes.c_byte, ctypes.c_ubyte,
                  ctypes.c_short, ctypes.c_ushort, ctypes.c_int, ctypes.c_uint, ctypes.c_long,
                  ctypes.c_ulong, ctypes.c_longlong, ctypes.c_ulonglong, ctypes.c_size_t,
                  ctypes.c_float, ctypes.c_double)


def _param_bytes(values, types) -> list[bytes]:
    """The bytes of each (value, ctype) kernel parameter, with cuda-python's rules
    (12.6-13.x `_HelperKernelParams`): type None only for a binding object (`getPtr`:
    a CUdeviceptr) or an enum; c_void_p for an int, a c_void_p or a binding object; a
    scalar ctype for what it converts; anything else is a TypeError, as there."""
    out = []
    for v, t in zip(values, types):
        if t is None:
            if not (callable(getattr(v, "getPtr", None)) or isinstance(v, enum.Enum)):
                raise TypeError(f"Provided argument is of type {type(v)} but expected Type "
                                f"{ctypes.Structure}, {ctypes.c_void_p} or CUDA Binding structure "
                                f"with getPtr() attribute")
            out.append(bytes(ctypes.c_uint64(int(v))) if not isinstance(v, enum.Enum)
                       else bytes(ctypes.c_int(v.value)))
        elif t is ctypes.c_void_p:
            if isinstance(v, (int, ctypes.c_void_p)):
                out.append(bytes(ctypes.c_uint64((v.value or 0) if isinstance(v, ctypes.c_void_p) else v)))
            elif callable(getattr(v, "getPtr", None)):
                out.append(bytes(ctypes.c_uint64(int(v))))
            else:
                raise TypeError(f"Provided argument is of type {type(v)} but expected Type {int}, "
                                f"{ctypes.c_void_p} or CUDA Binding structure with getPtr() attribute")
        elif t in _SCALAR_CTYPES:
            out.append(bytes(v if isinstance(v, t) else t(v)))
        else:
            raise TypeError(f"Unsupported type: {t!r}")
    return out


def _kernel_run(emu, ctx, f: _Function, grid, block, shmem, params: list[bytes], label: str):
    def run():
        for i, ((size, is_ptr), raw) in enumerate(zip(f.params, params)):
            if is_ptr:
                p = int.from_bytes(raw, "little")
                a = emu.find(p) if p else None
                if p and (a is None or a.ctx is not ctx):
                    raise _Fault(CUresult.CUDA_ERROR_ILLEGAL_ADDRESS,
                                 f"{label}: pointer parameter {i} (0x{p:x}) points to no live "
                                 f"allocation of device {ctx.device.ordinal} when the kernel runs "
                                 f"(freed after the launch was queued or captured?)")
        bufs = [ctypes.create_string_buffer(raw, len(raw)) for raw in params]
        argv = (ctypes.c_void_p * len(bufs))(*[ctypes.addressof(b) for b in bufs])
        kernels = _kernels()
        try:
            f.module.impl.launch(f.name, grid, block, shmem, argv, emu.next_seed())
        except kernels.KernelFault as e:
            raise _Fault(getattr(CUresult, e.code, CUresult.CUDA_ERROR_LAUNCH_FAILED), str(e.message)) from None
    return run


@_api(0)
def cuLaunchKernel(emu, f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ,
                   sharedMemBytes, hStream, kernelParams, extra):
    ctx = emu.current()
    fn = emu.lookup(f, (_Function,), "function")
    label = f"cuLaunchKernel({fn.module.name}.{fn.name})"
    if fn.module.ctx is not ctx:
        _fail(CUresult.CUDA_ERROR_INVALID_HANDLE,
              f"{label}: the function's module was loaded in device {fn.module.ctx.device.ordinal}'s "
              f"context, the current context is device {ctx.device.ordinal}'s")
    grid = tuple(_int(x, "grid dimension") for x in (gridDimX, gridDimY, gridDimZ))
    block = tuple(_int(x, "block dimension") for x in (blockDimX, blockDimY, blockDimZ))
    limits_g, limits_b = (2**31 - 1, 65535, 65535), (1024, 1024, 64)
    if any(not 1 <= g <= lim for g, lim in zip(grid, limits_g)):
        _fail(CUresult.CUDA_ERROR_INVALID_VALUE, f"{label}: grid {grid} outside 1..{limits_g}")
    if any(not 1 <= b <= lim for b, lim in zip(block, limits_b)) or block[0] * block[1] * block[2] > 1024:
        _fail(CUresult.CUDA_ERROR_INVALID_VALUE,
              f"{label}: block {block} outside 1..{limits_b} or more than 1024 threads")
    shmem = _int(sharedMemBytes, "sharedMemBytes")
    if shmem < 0 or shmem > fn.max_dynamic_shared:
        _fail(CUresult.CUDA_ERROR_INVALID_VALUE,
              f"{label}: {shmem} bytes of dynamic shared memory, at most {fn.max_dynamic_shared} "
              f"without cuFuncSetAttribute")
    if not isinstance(extra, int):  # the bindings' `void_ptr extra`: None is a TypeError
        raise TypeError(f"an integer is required for `extra`, got {type(extra).__name__}")
    if extra:
        _fail(CUresult.CUDA_ERROR_INVALID_VALUE, f"{label}: `extra` is not emulated")
    if kernelParams is None or kernelParams == 0:
        values, types = (), ()
    elif (isinstance(kernelParams, tuple) and len(kernelParams) == 2
          and isinstance(kernelParams[0], tuple) and isinstance(kernelParams[1], tuple)):
        values, types = kernelParams
        if len(values) != len(types):
            raise TypeError("Argument 'kernelParams' has tuples with different length")
    else:  # lists included, as the bindings refuse them
        raise TypeError("Argument 'kernelParams' is not a valid type: tuple[tuple[Any, ...], "
                        "tuple[Any, ...]] or PyObject implimenting Buffer Protocol or Int")
    if len(values) != len(fn.params):
        _fail(CUresult.CUDA_ERROR_INVALID_VALUE,
              f"{label}: {len(values)} parameters given, the .entry takes {len(fn.params)}")
    raw = _param_bytes(values, types)
    ptx_params = fn.module.info.entries[fn.name] if fn.module.info is not None else None
    for i, (b, (size, is_ptr)) in enumerate(zip(raw, fn.params)):
        want = ptx_params[i].size if ptx_params is not None else size
        if len(b) != want:
            _fail(CUresult.CUDA_ERROR_INVALID_VALUE,
                  f"{label}: parameter {i} is {len(b)} bytes, the .entry declares {want} "
                  f"({ptx_params[i].type if ptx_params else 'bytes'})")
        if is_ptr:
            p = int.from_bytes(b, "little")
            if p:
                a = emu.find(p)
                if a is None or a.ctx.device is not ctx.device:
                    old = next((x for x in emu.freed.values() if x.ptr <= p < x.ptr + x.size), None)
                    why = (f"it lies in freed memory {old.describe()}" if old is not None and a is None
                           else "it is not inside a live allocation of device "
                                f"{ctx.device.ordinal}")
                    _fail(CUresult.CUDA_ERROR_INVALID_VALUE,
                          f"{label}: pointer parameter {i} (0x{p:x}): {why}")
    s = emu.stream(ctx, hStream)
    _check_stream_ctx(s, ctx, label)
    _submit(emu, ctx, s, label, _kernel_run(emu, ctx, fn, grid, block, shmem, raw, label), sync=False)


# ============================================================================ graphs

@_api(1)
def cuGraphInstantiate(emu, hGraph, flags):
    ctx = emu.current()
    g = emu.lookup(hGraph, (_Graph,), "graph")
    if isinstance(g, _GraphExec):
        _fail(CUresult.CUDA_ERROR_INVALID_VALUE, "cuGraphInstantiate of a graph exec")
    e = _GraphExec(emu, ctx, list(g.nodes))
    ctx.resources[e.handle] = e
    return CUgraphExec(e.handle)


def _replay(emu, nodes: list[_Node]):
    """Runs the nodes in a topological order drawn from the seed (any order the edges allow)."""
    def run():
        rng = random.Random(emu.next_seed())
        indeg = {n.index: len(n.deps) for n in nodes}
        after: dict[int, list[_Node]] = {n.index: [] for n in nodes}
        for n in nodes:
            for d in n.deps:
                after[d.index].append(n)
        ready = [n for n in nodes if not n.deps]
        while ready:
            n = ready.pop(rng.randrange(len(ready)))
            n.run()
            for m in after[n.index]:
                indeg[m.index] -= 1
                if indeg[m.index] == 0:
                    ready.append(m)
    return run


@_api(0)
def cuGraphLaunch(emu, hGraphExec, hStream):
    ctx = emu.current()
    e = emu.lookup(hGraphExec, (_GraphExec,), "graph exec")
    s = emu.stream(ctx, hStream)
    _check_stream_ctx(s, ctx, "cuGraphLaunch")
    if e.ctx is not ctx:
        _fail(CUresult.CUDA_ERROR_INVALID_HANDLE, "cuGraphLaunch: the graph exec belongs to another context")
    _submit(emu, ctx, s, "cuGraphLaunch", _replay(emu, e.nodes), sync=False)


@_api(0)
def cuGraphDestroy(emu, hGraph):
    emu.current(sticky=False)
    g = emu.lookup(hGraph, (_Graph,), "graph")
    if isinstance(g, _GraphExec):
        _fail(CUresult.CUDA_ERROR_INVALID_VALUE, "cuGraphDestroy of a graph exec (use cuGraphExecDestroy)")
    emu.kill(g, "cuGraphDestroy")


@_api(0)
def cuGraphExecDestroy(emu, hGraphExec):
    emu.current(sticky=False)
    emu.kill(emu.lookup(hGraphExec, (_GraphExec,), "graph exec"), "cuGraphExecDestroy")


# ============================================================================ errors

def cuGetErrorName(error):
    try:
        return (CUresult.CUDA_SUCCESS, CUresult(int(error)).name.encode())
    except ValueError:
        return (CUresult.CUDA_ERROR_INVALID_VALUE, None)


def cuGetErrorString(error):
    try:
        code = CUresult(int(error))
    except ValueError:
        return (CUresult.CUDA_ERROR_INVALID_VALUE, None)
    text = _TEXTS.get(int(code), code.name.removeprefix("CUDA_ERROR_").replace("_", " ").lower())
    return (CUresult.CUDA_SUCCESS, text.encode())
