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
7. Modules: only kvcore's shipped images load (compared byte for byte), whole or one kernel
   cut out (kvcore.gpu._ptx.entry_image, what kvcore loads); a PTX ISA newer than
   the emulated driver reads fails with CUDA_ERROR_UNSUPPORTED_PTX_VERSION and a JIT log.
   Launches read each parameter with the byte size its PTX `.entry` declares (as the
   driver does), are checked against the device limits, then run by
   `kernels.load(module).launch(...)` when the queue runs.
"""
from __future__ import annotations

import ctypes
import enum
import gc
import hashlib
import itertools
import json
import os
import random
import sys
import threading
import time
import traceback
from bisect import bisect_left, bisect_right
from dataclasses import dataclass

from .. import _ptx

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


# ============================================================================ structs

class CUDA_MEMCPY3D(ctypes.Structure):
    """cuda.h's CUDA_MEMCPY3D (_v2): what cuMemcpy3D reads, as the bindings lay it out."""
    _fields_ = [(side + f, t) for side in ("src", "dst") for f, t in (
        ("XInBytes", ctypes.c_size_t), ("Y", ctypes.c_size_t), ("Z", ctypes.c_size_t),
        ("LOD", ctypes.c_size_t), ("MemoryType", ctypes.c_int), ("Host", ctypes.c_void_p),
        ("Device", ctypes.c_uint64), ("Array", ctypes.c_void_p), ("reserved", ctypes.c_void_p),
        ("Pitch", ctypes.c_size_t), ("Height", ctypes.c_size_t))] + [
        ("WidthInBytes", ctypes.c_size_t), ("Height", ctypes.c_size_t), ("Depth", ctypes.c_size_t)]


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
        yield from [r for r in list(self.resources.values()) if isinstance(r, _Stream)]


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
        self.pinned: dict[int, tuple[int, int]] = {}   # cuMemHostRegister: start -> (bytes, flags)

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


# ============================================================================ the C ABI

_H = ctypes.c_uint64            # an opaque handle (CUcontext, CUstream, ...) or a CUdeviceptr
_I, _U, _Z, _F = ctypes.c_int, ctypes.c_uint, ctypes.c_size_t, ctypes.c_float
_P = ctypes.POINTER

# name -> [(since, until, C function)]: the entry points cuGetProcAddress hands out, each for
# the driver API versions [since, until) whose C prototype it has (cudaTypedefs.h's PFN_*).
_ENTRIES: dict[str, list[tuple[int, int | None, object]]] = {}


def _api(*argtypes, since: int, until: int | None = None, name: str | None = None):
    """Makes `impl(emu, *args)` the emulated libcuda's entry point `name` (default: impl's)
    for API versions [since, until): a C function `CUresult (argtypes...)` that runs impl
    under the emulator's lock and returns CUDA_SUCCESS, or the code of the _Fail it raised
    (its reason kept for error_detail). Anything else impl raises is an emulator bug:
    CUDA_ERROR_UNKNOWN, with the traceback as the reason, never a silent success."""
    def wrap(impl):
        def entry(*args):
            emu = _emu
            with emu.lock:
                collecting = gc.isenabled()   # no finalizer (a destroy through the driver)
                gc.disable()                  # may run in the middle of the emulator's state
                try:
                    impl(emu, *args)
                except _Fail as f:
                    emu.tls.error = (int(f.code), f.detail)
                    return int(f.code)
                except BaseException as e:  # noqa: B036 - nothing may cross the C boundary
                    emu.tls.error = (int(CUresult.CUDA_ERROR_UNKNOWN),
                                     f"the emulated driver failed: {type(e).__name__}: {e}\n"
                                     f"{traceback.format_exc()}")
                    return int(CUresult.CUDA_ERROR_UNKNOWN)
                finally:
                    if collecting:
                        gc.enable()
            return 0
        fn = ctypes.CFUNCTYPE(ctypes.c_int, *argtypes)(entry)
        _ENTRIES.setdefault(name or impl.__name__, []).append((since, until, fn))
        return impl
    return wrap


def _resolve(symbol: bytes, version: int, flags: int) -> int:
    """cuGetProcAddress: the entry point of `symbol` for API `version`, 0 when none. The
    per-thread default stream variants (flags CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM)
    are not emulated: 0."""
    if flags & 2:
        return 0
    for since, until, fn in _ENTRIES.get(symbol.decode(), ()):
        if since <= version and (until is None or version < until):
            return ctypes.cast(fn, ctypes.c_void_p).value
    return 0


_RESOLVER = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int, ctypes.c_uint64)(_resolve)
_library = None


def install(path: str) -> None:
    """Loads the emulated libcuda.so.1 at `path` (kvcore.gpu._emu.kernels.libcuda()) under the
    driver's soname, before cuda-python's bindings look for one, and points its
    cuGetProcAddress at this module. Raises StateError when this process already loaded
    another libcuda.so.1 (a real driver: the bindings would keep using it)."""
    global _library
    if _library is not None:
        return
    try:
        ctypes.CDLL("libcuda.so.1", mode=os.RTLD_NOLOAD)
        loaded = True
    except OSError:
        loaded = False
    lib = ctypes.CDLL(path, mode=os.RTLD_GLOBAL)
    found = ctypes.CDLL("libcuda.so.1", mode=os.RTLD_NOLOAD | os.RTLD_GLOBAL)
    if loaded or not hasattr(found, "kvemu_set_resolver"):
        from ...errors import StateError
        raise StateError("cannot run the GPU emulator in this process: it already loaded the "
                         "CUDA driver's libcuda.so.1 (a real GPU's); start a new process")
    lib.kvemu_set_resolver.argtypes = [ctypes.c_void_p]
    lib.kvemu_set_resolver(ctypes.cast(_RESOLVER, ctypes.c_void_p))
    _library = lib


def _fail(code, detail: str):
    raise _Fail(code, detail)


def _put(out, value, what: str) -> None:
    """Writes an output parameter (*out = value); a NULL one is CUDA_ERROR_INVALID_VALUE."""
    if not out:
        _fail(CUresult.CUDA_ERROR_INVALID_VALUE, f"{what} is NULL")
    out[0] = value


# ============================================================================ init, devices

@_api(_U, since=2000)
def cuInit(emu, flags):
    if flags != 0:
        _fail(CUresult.CUDA_ERROR_INVALID_VALUE, f"cuInit flags must be 0, got {flags}")
    emu.initialized = True


@_api(_P(_I), since=2020)
def cuDriverGetVersion(emu, version):
    _put(version, emu.config.driver_version, "driverVersion")


@_api(_P(_I), since=2000)
def cuDeviceGetCount(emu, count):
    emu.need_init()
    _put(count, len(emu.devices), "count")


@_api(_P(_I), _I, since=2000)
def cuDeviceGet(emu, device, ordinal):
    _put(device, emu.device(ordinal).ordinal, "device")


@_api(_H, _I, _I, since=2000)
def cuDeviceGetName(emu, name, length, dev):
    text = emu.device(dev).name.encode()[:max(length - 1, 0)]
    if not name or length <= 0:
        _fail(CUresult.CUDA_ERROR_INVALID_VALUE, f"name buffer 0x{name:x} of {length} bytes")
    ctypes.memmove(name, text + b"\0", len(text) + 1)


@_api(_P(_Z), _I, since=3020)
def cuDeviceTotalMem(emu, nbytes, dev):
    _put(nbytes, emu.device(dev).total, "bytes")


@_api(_P(_I), _I, _I, since=2000)
def cuDeviceGetAttribute(emu, value, attrib, dev):
    emu.device(dev)
    try:
        name = CUdevice_attribute(attrib).name.removeprefix("CU_DEVICE_ATTRIBUTE_")
    except ValueError:
        _fail(CUresult.CUDA_ERROR_INVALID_VALUE, f"device attribute {attrib} is not emulated")
    _put(value, dev + 1 if name == "PCI_BUS_ID" else _ATTRIBUTES[name], "pi")


# ============================================================================ contexts

@_api(_P(_H), _I, since=7000)
def cuDevicePrimaryCtxRetain(emu, pctx, dev):
    d = emu.device(dev)
    if not pctx:
        _fail(CUresult.CUDA_ERROR_INVALID_VALUE, "pctx is NULL")
    if d.ctx is None:
        d.ctx = _Context(emu, d)
    d.ctx.refs += 1
    pctx[0] = d.ctx.handle


@_api(_I, since=11000)
def cuDevicePrimaryCtxRelease(emu, dev):
    d = emu.device(dev)
    if d.ctx is None:
        _fail(CUresult.CUDA_ERROR_INVALID_CONTEXT, f"device {d.ordinal}'s primary context is not retained")
    for c in emu.captures_in(d.ctx):
        emu.invalidate(c, "its context was released")
    d.ctx.refs -= 1
    if d.ctx.refs == 0:
        emu.release_context(d.ctx)


@_api(_H, since=4000)
def cuCtxSetCurrent(emu, ctx):
    emu.need_init()
    stack = emu.stack
    c = None if ctx == 0 else emu.context(ctx)
    if c is None:
        if stack:
            stack.pop()
        return
    if stack:
        stack[-1] = c
    else:
        stack.append(c)


@_api(_P(_H), since=4000)
def cuCtxGetCurrent(emu, pctx):
    emu.need_init()
    stack = emu.stack
    _put(pctx, stack[-1].handle if stack and stack[-1].alive else 0, "pctx")


@_api(_H, since=4000)
def cuCtxPushCurrent(emu, ctx):
    emu.need_init()
    emu.stack.append(emu.context(ctx))


@_api(_P(_H), since=4000)
def cuCtxPopCurrent(emu, pctx):
    emu.need_init()
    if not emu.stack:
        _fail(CUresult.CUDA_ERROR_INVALID_CONTEXT, "no context is current on this thread")
    handle = emu.stack.pop().handle
    if pctx:
        pctx[0] = handle


@_api(_P(_I), since=2000, until=13000)
def cuCtxGetDevice(emu, device):
    _put(device, emu.current().device.ordinal, "device")


@_api(since=2000, until=13000)
def cuCtxSynchronize(emu):
    ctx = emu.current()
    emu.refuse_unsafe(ctx, "cuCtxSynchronize")
    emu.synchronize_ctx(ctx)
    emu.after_wait(ctx)


# ============================================================================ memory

@_api(_P(_Z), _P(_Z), since=3020)
def cuMemGetInfo(emu, free, total):
    d = emu.current().device
    _put(free, d.total - d.used, "free")
    _put(total, d.total, "total")


@_api(_P(_H), _Z, since=3020)
def cuMemAlloc(emu, dptr, n):
    ctx = emu.current()
    emu.refuse_unsafe(ctx, "cuMemAlloc")
    if not dptr:
        _fail(CUresult.CUDA_ERROR_INVALID_VALUE, "dptr is NULL")
    if n <= 0:
        _fail(CUresult.CUDA_ERROR_INVALID_VALUE, f"cuMemAlloc of {n} bytes")
    dptr[0] = emu.alloc(ctx, n).ptr


@_api(_H, since=3020)
def cuMemFree(emu, p):
    ctx = emu.current()
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


# host memory registered (page-locked) by cuMemHostRegister: start -> (bytes, flags)
_HOST_REGISTER_FLAGS = 0xF   # PORTABLE 1, DEVICEMAP 2, IOMEMORY 4, READ_ONLY 8


@_api(_H, _Z, _U, since=4000)
def cuMemHostRegister(emu, p, n, flags):
    ctx = emu.current()
    emu.refuse_unsafe(ctx, "cuMemHostRegister")
    if not p or n == 0:
        _fail(CUresult.CUDA_ERROR_INVALID_VALUE, f"cuMemHostRegister of {n} bytes at 0x{p or 0:x}")
    if flags & ~_HOST_REGISTER_FLAGS:
        _fail(CUresult.CUDA_ERROR_INVALID_VALUE, f"cuMemHostRegister flags 0x{flags:x}")
    for start, (size, _) in emu.pinned.items():
        if start < p + n and p < start + size:
            _fail(CUresult.CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED,
                  f"[0x{p:x}, 0x{p + n:x}) overlaps the registered [0x{start:x}, 0x{start + size:x})")
    emu.pinned[p] = (n, flags)


@_api(_H, since=4000)
def cuMemHostUnregister(emu, p):
    ctx = emu.current()
    emu.refuse_unsafe(ctx, "cuMemHostUnregister")
    if p not in emu.pinned:
        _fail(CUresult.CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED,
              f"0x{p or 0:x} is not the start of a registered host range")
    del emu.pinned[p]


def _unpinned_check(emu, p: int, n: int, what: str):
    """For a copy queued now with host side [p, p + n): a check its run makes, failing when
    the registration that held the range then is gone (the driver would copy from pages it
    no longer pins, or fault)."""
    start = next((a for a, (size, _) in emu.pinned.items() if a <= p and p + n <= a + size), None)

    def check():
        if start is not None and start not in emu.pinned:
            raise _Fault(CUresult.CUDA_ERROR_ILLEGAL_ADDRESS,
                         f"{what}: host [0x{p:x}, 0x{p + n:x}) was unregistered "
                         f"(cuMemHostUnregister) before the copy ran")
    return check


@_api(_P(_U), _H, since=2030)
def cuMemHostGetFlags(emu, flags, p):
    for start, (size, f) in emu.pinned.items():
        if start <= (p or 0) < start + size:
            _put(flags, f, "pFlags")
            return
    _fail(CUresult.CUDA_ERROR_INVALID_VALUE, f"0x{p or 0:x} is not in registered host memory")


def _copy_op(emu, ctx, dst, src, n, dst_dev: bool, src_dev: bool, what: str):
    """The run function of a copy: re-checks device ranges when it runs (a graph may replay
    after a free) and that the host side is still registered if it was, then moves the bytes."""
    pinned = [_unpinned_check(emu, q, n, what) for q, dev in ((dst, dst_dev), (src, src_dev))
              if not dev]

    def run():
        for check in pinned:
            check()
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


def _memcpy(emu, kind: str, dst: int, src: int, n: int, stream: int | None):
    """cuMemcpy<kind> (stream None) or cuMemcpy<kind>Async; kind is HtoD, DtoH or DtoD."""
    ctx = emu.current()
    sync = stream is None
    name = f"cuMemcpy{kind}" + ("" if sync else "Async")
    if sync:
        emu.refuse_unsafe(ctx, name)
    dst_dev, src_dev = kind[-1] == "D", kind[0] == "D"
    if n == 0:
        return
    for p, is_dev, side in ((dst, dst_dev, "destination"), (src, src_dev, "source")):
        if is_dev:
            emu.range(ctx, p, n, f"{name} {side}")
        elif not p:
            _fail(CUresult.CUDA_ERROR_INVALID_VALUE, f"{name}: the host {side} is NULL")
    s = ctx.legacy if sync else emu.stream(ctx, stream)
    _check_stream_ctx(s, ctx, name)
    _submit(emu, ctx, s, name, _copy_op(emu, ctx, dst, src, n, dst_dev, src_dev, name), sync=sync)


def _check_stream_ctx(s: _Stream, ctx: _Context, what: str) -> None:
    if s.ctx is not ctx:
        _fail(CUresult.CUDA_ERROR_INVALID_HANDLE,
              f"{what}: stream 0x{s.handle:x} belongs to device {s.ctx.device.ordinal}'s context, "
              f"the current context is device {ctx.device.ordinal}'s")


@_api(_H, _H, _Z, since=3020)
def cuMemcpyHtoD(emu, dst, src, n):
    _memcpy(emu, "HtoD", dst, src, n, None)


@_api(_H, _H, _Z, since=3020)
def cuMemcpyDtoH(emu, dst, src, n):
    _memcpy(emu, "DtoH", dst, src, n, None)


@_api(_H, _H, _Z, since=3020)
def cuMemcpyDtoD(emu, dst, src, n):
    _memcpy(emu, "DtoD", dst, src, n, None)


@_api(_H, _H, _Z, _H, since=3020)
def cuMemcpyHtoDAsync(emu, dst, src, n, stream):
    _memcpy(emu, "HtoD", dst, src, n, stream)


@_api(_H, _H, _Z, _H, since=3020)
def cuMemcpyDtoHAsync(emu, dst, src, n, stream):
    _memcpy(emu, "DtoH", dst, src, n, stream)


@_api(_H, _H, _Z, _H, since=3020)
def cuMemcpyDtoDAsync(emu, dst, src, n, stream):
    _memcpy(emu, "DtoD", dst, src, n, stream)


def _memset(emu, dst: int, value: int, n: int, stream: int | None):
    ctx = emu.current()
    sync = stream is None
    name = "cuMemsetD8" + ("" if sync else "Async")
    if sync:
        emu.refuse_unsafe(ctx, name)
    if n == 0:
        return
    emu.range(ctx, dst, n, name)
    s = ctx.legacy if sync else emu.stream(ctx, stream)
    _check_stream_ctx(s, ctx, name)
    _submit(emu, ctx, s, name, _memset_op(emu, ctx, dst, value, n, name), sync=sync)


@_api(_H, ctypes.c_ubyte, _Z, since=3020)
def cuMemsetD8(emu, dst, value, n):
    _memset(emu, dst, value, n, None)


@_api(_H, ctypes.c_ubyte, _Z, _H, since=3020)
def cuMemsetD8Async(emu, dst, value, n, stream):
    _memset(emu, dst, value, n, stream)


def _memcpy3d(emu, p, stream: int | None):
    ctx = emu.current()
    sync = stream is None
    name = "cuMemcpy3D" + ("" if sync else "Async")
    if sync:
        emu.refuse_unsafe(ctx, name)
    if not p:
        _fail(CUresult.CUDA_ERROR_INVALID_VALUE, f"{name}: pCopy is NULL")
    p = p[0]
    w, h, depth = p.WidthInBytes, p.Height, p.Depth
    if w == 0 or h == 0 or depth == 0:
        return
    sides = {}
    for side in ("src", "dst"):
        mt = getattr(p, side + "MemoryType")
        pitch, height = getattr(p, side + "Pitch"), getattr(p, side + "Height")
        x, y, z = (getattr(p, side + k) for k in ("XInBytes", "Y", "Z"))
        if mt == CUmemorytype.CU_MEMORYTYPE_DEVICE:
            base, dev = getattr(p, side + "Device"), True
        elif mt == CUmemorytype.CU_MEMORYTYPE_HOST:
            base, dev = getattr(p, side + "Host") or 0, False
            if not base:
                _fail(CUresult.CUDA_ERROR_INVALID_VALUE, f"{name}: {side}Host is NULL")
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
    span = (depth - 1) * max(sslice, dslice) + (h - 1) * max(spitch, dpitch) + w
    pinned = [_unpinned_check(emu, q, span, name) for q, dev in ((src, sdev), (dst, ddev)) if not dev]

    def run():
        for check in pinned:
            check()
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


@_api(_P(CUDA_MEMCPY3D), since=3020)
def cuMemcpy3D(emu, p):
    _memcpy3d(emu, p, None)


@_api(_P(CUDA_MEMCPY3D), _H, since=3020)
def cuMemcpy3DAsync(emu, p, stream):
    _memcpy3d(emu, p, stream)


# CUpointer_attribute -> the C type of its value (cuda.h: cuPointerGetAttribute)
_POINTER_VALUE_TYPES = {1: ctypes.c_uint64, 2: ctypes.c_uint, 3: ctypes.c_uint64, 4: ctypes.c_uint64,
                        6: ctypes.c_uint, 7: ctypes.c_ulonglong, 8: ctypes.c_uint, 9: ctypes.c_int,
                        10: ctypes.c_uint, 11: ctypes.c_uint64, 12: ctypes.c_size_t,
                        13: ctypes.c_uint}


def _pointer_value(emu, a: _Alloc | None, attr: int, ptr: int) -> int:
    A = CUpointer_attribute
    if attr == A.CU_POINTER_ATTRIBUTE_CONTEXT:
        return a.ctx.handle if a else 0
    if attr == A.CU_POINTER_ATTRIBUTE_MEMORY_TYPE:
        return CUmemorytype.CU_MEMORYTYPE_DEVICE if a else 0
    if attr == A.CU_POINTER_ATTRIBUTE_DEVICE_POINTER:
        return ptr if a else 0
    if attr == A.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL:
        return a.ctx.device.ordinal if a else -2
    if attr == A.CU_POINTER_ATTRIBUTE_RANGE_START_ADDR:
        return a.ptr if a else 0
    if attr == A.CU_POINTER_ATTRIBUTE_RANGE_SIZE:
        return a.size if a else 0
    if attr == A.CU_POINTER_ATTRIBUTE_BUFFER_ID:
        return a.handle if a else 0
    if attr in (A.CU_POINTER_ATTRIBUTE_IS_MANAGED, A.CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE,
                A.CU_POINTER_ATTRIBUTE_SYNC_MEMOPS):
        return 0
    if attr == A.CU_POINTER_ATTRIBUTE_MAPPED:
        return int(a is not None)
    _fail(CUresult.CUDA_ERROR_INVALID_VALUE, f"pointer attribute {attr} is not emulated")


def _put_pointer_value(emu, out: int, a, attr: int, ptr: int) -> None:
    value = _pointer_value(emu, a, attr, ptr)
    if not out:
        _fail(CUresult.CUDA_ERROR_INVALID_VALUE, f"the value of pointer attribute {attr} has NULL storage")
    _POINTER_VALUE_TYPES[attr].from_address(out).value = value


@_api(_H, _I, _H, since=4000)
def cuPointerGetAttribute(emu, data, attribute, ptr):
    emu.need_init()
    a = emu.find(ptr)
    if a is None:
        _fail(CUresult.CUDA_ERROR_INVALID_VALUE, f"0x{ptr:x} is not a device pointer of a live allocation")
    _put_pointer_value(emu, data, a, attribute, ptr)


@_api(_U, _P(_I), _P(_H), _H, since=7000)
def cuPointerGetAttributes(emu, count, attributes, data, ptr):
    emu.need_init()
    if count and not (attributes and data):
        _fail(CUresult.CUDA_ERROR_INVALID_VALUE, "attributes or data is NULL")
    a = emu.find(ptr)  # an unknown pointer gives the NULL values, not an error
    for i in range(count):
        _put_pointer_value(emu, data[i], a, attributes[i], ptr)


# ============================================================================ streams

@_api(_P(_H), _U, since=2000)
def cuStreamCreate(emu, phStream, flags):
    ctx = emu.current()
    if flags not in (0, 1):
        _fail(CUresult.CUDA_ERROR_INVALID_VALUE, f"stream flags {flags}")
    if not phStream:
        _fail(CUresult.CUDA_ERROR_INVALID_VALUE, "phStream is NULL")
    s = _Stream(emu, ctx, flags == CUstream_flags.CU_STREAM_DEFAULT,
                "non-blocking stream" if flags else "blocking stream")
    ctx.resources[s.handle] = s
    phStream[0] = s.handle


@_api(_H, since=4000)
def cuStreamDestroy(emu, hStream):
    ctx = emu.current()
    s = emu.stream(ctx, hStream)
    if s.handle in (1, 2) or hStream == 0:
        _fail(CUresult.CUDA_ERROR_INVALID_HANDLE, "the default streams cannot be destroyed")
    if s.capture is not None:
        emu.invalidate(s.capture, "a capturing stream was destroyed")
    if s.pending():  # the device finishes its work, then releases it
        s.ctx.orphans.append(s.last)
    emu.kill(s, "cuStreamDestroy")


@_api(_H, since=2000)
def cuStreamSynchronize(emu, hStream):
    ctx = emu.current()
    s = emu.stream(ctx, hStream)
    emu.refuse_capturing(s, "cuStreamSynchronize")
    emu.check_fault(s.ctx)
    emu.complete(s.last)
    emu.after_wait(s.ctx)


@_api(_H, since=2000)
def cuStreamQuery(emu, hStream):
    ctx = emu.current()
    s = emu.stream(ctx, hStream)
    emu.refuse_capturing(s, "cuStreamQuery")
    emu.check_fault(s.ctx)
    if s.pending():  # the work goes on, but was not finished when asked
        emu.complete(s.last)
        _fail(CUresult.CUDA_ERROR_NOT_READY, "work was still pending on the stream")
    emu.after_wait(s.ctx)


@_api(_H, _H, _U, since=3020)
def cuStreamWaitEvent(emu, hStream, hEvent, flags):
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


def _capture_status(emu, ctx: _Context, s: _Stream) -> int:
    if s.capture is not None:
        return (CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_INVALIDATED if s.capture.invalid
                else CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_ACTIVE)
    if s is ctx.legacy and any(t.blocking for c in emu.captures_in(ctx) for t in c.streams):
        _fail(CUresult.CUDA_ERROR_STREAM_CAPTURE_IMPLICIT,
              "a blocking stream captures: the legacy stream would join it")
    return CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE


@_api(_H, _P(_I), since=10000)
def cuStreamIsCapturing(emu, hStream, status):
    ctx = emu.current()
    _put(status, _capture_status(emu, ctx, emu.stream(ctx, hStream)), "captureStatus")


def _capture_info(emu, hStream, status, capture_id, graph, deps, edges, count):
    """cuStreamGetCaptureInfo (v2 without `edges`, v3 with): every output is optional. The
    dependency (and edge data) arrays stay valid until this thread's next call."""
    ctx = emu.current()
    s = emu.stream(ctx, hStream)
    code = _capture_status(emu, ctx, s)
    tail = s.tail if s.capture is not None else []
    emu.tls.capture_nodes = (_H * max(len(tail), 1))(*[n.index + 1 for n in tail])
    emu.tls.capture_edges = (ctypes.c_uint64 * max(len(tail), 1))()   # CUgraphEdgeData: 8 zero bytes
    for out, value in ((status, code), (capture_id, s.capture.id if s.capture else 0), (graph, 0),
                       (deps, ctypes.addressof(emu.tls.capture_nodes) if tail else 0),
                       (edges, ctypes.addressof(emu.tls.capture_edges) if tail else 0),
                       (count, len(tail))):
        if out:
            out[0] = value


@_api(_H, _P(_I), _P(ctypes.c_uint64), _P(_H), _P(_H), _P(_Z), since=11030, until=12030,
      name="cuStreamGetCaptureInfo")
def cuStreamGetCaptureInfo_v2(emu, hStream, status, capture_id, graph, deps, count):
    _capture_info(emu, hStream, status, capture_id, graph, deps, None, count)


@_api(_H, _P(_I), _P(ctypes.c_uint64), _P(_H), _P(_H), _P(_H), _P(_Z), since=12030,
      name="cuStreamGetCaptureInfo")
def cuStreamGetCaptureInfo_v3(emu, hStream, status, capture_id, graph, deps, edges, count):
    _capture_info(emu, hStream, status, capture_id, graph, deps, edges, count)


@_api(_H, _I, since=10010)
def cuStreamBeginCapture(emu, hStream, mode):
    ctx = emu.current()
    s = emu.stream(ctx, hStream)
    if mode not in (0, 1, 2):
        _fail(CUresult.CUDA_ERROR_INVALID_VALUE, f"capture mode {mode}")
    if s is ctx.legacy:
        _fail(CUresult.CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, "the legacy stream cannot capture")
    if s.capture is not None:
        _fail(CUresult.CUDA_ERROR_ILLEGAL_STATE, f"stream 0x{s.handle:x} is already capturing")
    c = _Capture(emu, s, mode)
    s.capture, s.tail = c, []
    emu.captures.append(c)


@_api(_H, _P(_H), since=10000)
def cuStreamEndCapture(emu, hStream, phGraph):
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
    if not phGraph:
        _fail(CUresult.CUDA_ERROR_INVALID_VALUE, "phGraph is NULL")
    g = _Graph(emu, ctx, c.nodes)
    ctx.resources[g.handle] = g
    phGraph[0] = g.handle


# ============================================================================ events

@_api(_P(_H), _U, since=2000)
def cuEventCreate(emu, phEvent, flags):
    ctx = emu.current()
    if flags & ~0x7:
        _fail(CUresult.CUDA_ERROR_INVALID_VALUE, f"event flags {flags}")
    if not phEvent:
        _fail(CUresult.CUDA_ERROR_INVALID_VALUE, "phEvent is NULL")
    ev = _Event(emu, ctx, flags)
    ctx.resources[ev.handle] = ev
    phEvent[0] = ev.handle


@_api(_H, since=4000)
def cuEventDestroy(emu, hEvent):
    emu.current()
    emu.kill(emu.lookup(hEvent, (_Event,), "event"), "cuEventDestroy")


@_api(_H, _H, since=2000)
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


@_api(_H, since=2000)
def cuEventSynchronize(emu, hEvent):
    emu.current(sticky=False)
    ev = emu.lookup(hEvent, (_Event,), "event")
    _event_ready(emu, ev, "cuEventSynchronize")
    emu.check_fault(ev.ctx)
    emu.complete(ev.op)
    emu.after_wait(ev.ctx)


@_api(_H, since=2000)
def cuEventQuery(emu, hEvent):
    emu.current(sticky=False)
    ev = emu.lookup(hEvent, (_Event,), "event")
    _event_ready(emu, ev, "cuEventQuery")
    emu.check_fault(ev.ctx)
    if ev.op is not None and not ev.op.done:
        emu.complete(ev.op)
        _fail(CUresult.CUDA_ERROR_NOT_READY, "the event's work was still pending")
    emu.after_wait(ev.ctx)


@_api(_P(_F), _H, _H, since=2000)   # v1 and v2 (12.8) share the prototype
def cuEventElapsedTime(emu, ms, hStart, hEnd):
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
    _put(ms, (b.time - a.time) * 1000.0, "pMilliseconds")


# ============================================================================ modules

_shipped_cache: dict[tuple, dict[bytes, str]] = {}


def _shipped() -> dict[bytes, str]:
    """sha256 of every shipped module image (PTX, and any cubin/fatbin beside it), and of
    the module of each of a PTX module's kernels alone (_ptx.entry_image, what kvcore
    loads) -> module name."""
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
                data = fh.read().rstrip(b"\0")
            name = os.path.splitext(os.path.basename(f))[0]
            table[hashlib.sha256(data).digest()] = name
            if f.endswith(".ptx"):
                for kernel in _ptx.parse(data).entries:
                    table[hashlib.sha256(_ptx.entry_image(data, kernel)).digest()] = name
        _shipped_cache.clear()
        _shipped_cache[key] = table
    return table


def _image(address: int) -> bytes:
    """The module image at `address`, as the driver sizes it: an ELF cubin by its section
    header table, a fatbin by its header, PTX text up to its NUL."""
    if not address:
        _fail(CUresult.CUDA_ERROR_INVALID_VALUE, "the image is NULL")
    prefix = ctypes.string_at(address)              # up to the first NUL
    if prefix.startswith(b"\x7fELF"):
        if prefix[4:6] != b"\x02\x01":
            _fail(CUresult.CUDA_ERROR_INVALID_IMAGE, "an ELF image that is not 64-bit little-endian")
        head = ctypes.string_at(address, 64)
        if int.from_bytes(head[0x12:0x14], "little") != 190:   # EM_CUDA
            _fail(CUresult.CUDA_ERROR_INVALID_IMAGE, "an ELF image whose machine is not EM_CUDA")
        shoff = int.from_bytes(head[0x28:0x30], "little")
        size = shoff + int.from_bytes(head[0x3A:0x3C], "little") * int.from_bytes(head[0x3C:0x3E], "little")
        return ctypes.string_at(address, size)
    if prefix.startswith(b"\x50\xed\x55\xba"):    # fatbin: magic, version, header size, body size
        head = ctypes.string_at(address, 16)
        return ctypes.string_at(address, int.from_bytes(head[6:8], "little") + int.from_bytes(head[8:16], "little"))
    return prefix


def _jit_log(options: list[int], values: list[int], text: str) -> None:
    """Writes text into the CU_JIT_ERROR_LOG_BUFFER option's buffer (NUL-terminated,
    truncated to CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES, which the driver requires with it)."""
    if CUjit_option.CU_JIT_ERROR_LOG_BUFFER not in options:
        return
    buf = values[options.index(CUjit_option.CU_JIT_ERROR_LOG_BUFFER)]
    if CUjit_option.CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES not in options:
        _fail(CUresult.CUDA_ERROR_INVALID_VALUE, "CU_JIT_ERROR_LOG_BUFFER without its size option")
    size = values[options.index(CUjit_option.CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES)]
    if size and buf:
        data = text.encode()[:size - 1] + b"\0"
        ctypes.memmove(buf, data, len(data))


def _load(emu, out, image: int, options: list[int], values: list[int]) -> None:
    ctx = emu.current()
    data = _image(image).rstrip(b"\0")
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
              "the emulator runs only kvcore's shipped modules (or one kernel cut out of one), "
              "and this image equals none of them")
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
    if not out:
        _fail(CUresult.CUDA_ERROR_INVALID_VALUE, "module is NULL")
    m = _Module(emu, ctx, name, info, impl)
    ctx.resources[m.handle] = m
    out[0] = m.handle


@_api(_P(_H), _H, since=2000)
def cuModuleLoadData(emu, module, image):
    _load(emu, module, image, [], [])


@_api(_P(_H), _H, _U, _P(_I), _P(_H), since=2010)
def cuModuleLoadDataEx(emu, module, image, count, options, values):
    if count and not (options and values):
        _fail(CUresult.CUDA_ERROR_INVALID_VALUE, f"{count} JIT options with NULL options or values")
    _load(emu, module, image, [options[i] for i in range(count)], [values[i] for i in range(count)])


@_api(_H, since=2000)
def cuModuleUnload(emu, hmod):
    emu.current()
    m = emu.lookup(hmod, (_Module,), "module")
    for f in m.functions.values():
        emu.kill(f, "its module was unloaded")
    emu.kill(m, "cuModuleUnload")


@_api(_P(_H), _H, ctypes.c_char_p, since=2000)
def cuModuleGetFunction(emu, hfunc, hmod, name):
    emu.current()
    m = emu.lookup(hmod, (_Module,), "module")
    if name is None:
        _fail(CUresult.CUDA_ERROR_INVALID_VALUE, "name is NULL")
    key = name.decode(errors="replace")
    f = m.functions.get(key)
    if f is None:
        entries = m.info.entries if m.info is not None else m.impl.entries
        if key not in entries or key not in m.impl.entries:
            _fail(CUresult.CUDA_ERROR_NOT_FOUND, f"module {m.name} has no kernel {key!r}")
        params = tuple((p.size, bool(p.is_pointer)) for p in m.impl.entries[key])
        f = m.functions[key] = _Function(emu, m, key, params)
    _put(hfunc, f.handle, "hfunc")


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


@_api(_P(_I), _I, _H, since=2020)
def cuFuncGetAttribute(emu, pi, attrib, hfunc):
    emu.current()
    f = emu.lookup(hfunc, (_Function,), "function")
    A = CUfunction_attribute
    if attrib == A.CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK:
        value = 1024
    elif attrib == A.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES:
        value = _static_shared(f)
    elif attrib == A.CU_FUNC_ATTRIBUTE_NUM_REGS:
        value = _registers(f)
    elif attrib == A.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES:
        value = f.max_dynamic_shared
    elif attrib == A.CU_FUNC_ATTRIBUTE_PTX_VERSION and f.module.info is not None:
        value = f.module.info.version[0] * 10 + f.module.info.version[1]
    else:
        _fail(CUresult.CUDA_ERROR_INVALID_VALUE, f"function attribute {attrib} is not emulated")
    _put(pi, value, "pi")


@_api(_H, _I, _I, since=9000)
def cuFuncSetAttribute(emu, hfunc, attrib, value):
    emu.current()
    f = emu.lookup(hfunc, (_Function,), "function")
    if attrib != CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES:
        _fail(CUresult.CUDA_ERROR_INVALID_VALUE, f"function attribute {attrib} is not emulated")
    if not 0 <= value <= SHARED_PER_BLOCK_OPTIN - _static_shared(f):
        _fail(CUresult.CUDA_ERROR_INVALID_VALUE,
              f"{value} bytes of dynamic shared memory: at most {SHARED_PER_BLOCK_OPTIN - _static_shared(f)}")
    f.max_dynamic_shared = value


@_api(_P(_I), _H, _I, _Z, since=6050)
def cuOccupancyMaxActiveBlocksPerMultiprocessor(emu, numBlocks, func, threads, dynamic_shared):
    """Blocks per SM from the thread, register and shared-memory limits of sm_90, with the
    registers and static shared memory ptxas gives the kernel (resources.json): registers
    are allocated per warp in units of 256, 64K per SM."""
    emu.current()
    f = emu.lookup(func, (_Function,), "function")
    if not 1 <= threads <= 1024:
        _fail(CUresult.CUDA_ERROR_INVALID_VALUE, f"block size {threads}")
    warps = -(-threads // 32)
    blocks = min(32, 64 // warps)
    regs = _registers(f)
    if regs:
        per_warp = -(-regs * 32 // 256) * 256
        blocks = min(blocks, 65536 // per_warp // warps)
    shared = _static_shared(f) + dynamic_shared
    if shared:
        blocks = min(blocks, SHARED_PER_SM // (shared + 1024))
    _put(numBlocks, blocks, "numBlocks")


# ============================================================================ launches

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


@_api(_H, _U, _U, _U, _U, _U, _U, _U, _H, _H, _H, since=4000)
def cuLaunchKernel(emu, f, gx, gy, gz, bx, by, bz, shmem, hStream, kernelParams, extra):
    """Reads each parameter from kernelParams[i] with the size its .entry declares, as the
    driver does (it cannot tell a wrong size: kvcore.gpu.driver.launch checks them)."""
    ctx = emu.current()
    fn = emu.lookup(f, (_Function,), "function")
    label = f"cuLaunchKernel({fn.module.name}.{fn.name})"
    if fn.module.ctx is not ctx:
        _fail(CUresult.CUDA_ERROR_INVALID_HANDLE,
              f"{label}: the function's module was loaded in device {fn.module.ctx.device.ordinal}'s "
              f"context, the current context is device {ctx.device.ordinal}'s")
    grid, block = (gx, gy, gz), (bx, by, bz)
    limits_g, limits_b = (2**31 - 1, 65535, 65535), (1024, 1024, 64)
    if any(not 1 <= g <= lim for g, lim in zip(grid, limits_g)):
        _fail(CUresult.CUDA_ERROR_INVALID_VALUE, f"{label}: grid {grid} outside 1..{limits_g}")
    if any(not 1 <= b <= lim for b, lim in zip(block, limits_b)) or bx * by * bz > 1024:
        _fail(CUresult.CUDA_ERROR_INVALID_VALUE,
              f"{label}: block {block} outside 1..{limits_b} or more than 1024 threads")
    if shmem > fn.max_dynamic_shared:
        _fail(CUresult.CUDA_ERROR_INVALID_VALUE,
              f"{label}: {shmem} bytes of dynamic shared memory, at most {fn.max_dynamic_shared} "
              f"without cuFuncSetAttribute")
    if extra:
        _fail(CUresult.CUDA_ERROR_INVALID_VALUE, f"{label}: `extra` is not emulated")
    if fn.params and not kernelParams:
        _fail(CUresult.CUDA_ERROR_INVALID_VALUE,
              f"{label}: kernelParams is NULL, the .entry takes {len(fn.params)} parameters")
    argv = (ctypes.c_void_p * len(fn.params)).from_address(kernelParams) if fn.params else ()
    raw = []
    for i, (size, is_ptr) in enumerate(fn.params):
        if not argv[i]:
            _fail(CUresult.CUDA_ERROR_INVALID_VALUE, f"{label}: kernelParams[{i}] is NULL")
        b = ctypes.string_at(argv[i], size)
        raw.append(b)
        p = int.from_bytes(b, "little") if is_ptr else 0
        if p:
            a = emu.find(p)
            if a is None or a.ctx.device is not ctx.device:
                old = next((x for x in emu.freed.values() if x.ptr <= p < x.ptr + x.size), None)
                why = (f"it lies in freed memory {old.describe()}" if old is not None and a is None
                       else f"it is not inside a live allocation of device {ctx.device.ordinal}")
                _fail(CUresult.CUDA_ERROR_INVALID_VALUE, f"{label}: pointer parameter {i} (0x{p:x}): {why}")
    s = emu.stream(ctx, hStream)
    _check_stream_ctx(s, ctx, label)
    _submit(emu, ctx, s, label, _kernel_run(emu, ctx, fn, grid, block, shmem, raw, label), sync=False)


# ============================================================================ graphs

@_api(_P(_H), _H, ctypes.c_ulonglong, since=11040)
def cuGraphInstantiateWithFlags(emu, phGraphExec, hGraph, flags):
    ctx = emu.current()
    g = emu.lookup(hGraph, (_Graph,), "graph")
    if isinstance(g, _GraphExec):
        _fail(CUresult.CUDA_ERROR_INVALID_VALUE, "cuGraphInstantiate of a graph exec")
    if flags:
        _fail(CUresult.CUDA_ERROR_INVALID_VALUE, f"graph instantiate flags {flags} are not emulated")
    if not phGraphExec:
        _fail(CUresult.CUDA_ERROR_INVALID_VALUE, "phGraphExec is NULL")
    e = _GraphExec(emu, ctx, list(g.nodes))
    ctx.resources[e.handle] = e
    phGraphExec[0] = e.handle


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


@_api(_H, _H, since=10000)
def cuGraphLaunch(emu, hGraphExec, hStream):
    ctx = emu.current()
    e = emu.lookup(hGraphExec, (_GraphExec,), "graph exec")
    s = emu.stream(ctx, hStream)
    _check_stream_ctx(s, ctx, "cuGraphLaunch")
    if e.ctx is not ctx:
        _fail(CUresult.CUDA_ERROR_INVALID_HANDLE, "cuGraphLaunch: the graph exec belongs to another context")
    _submit(emu, ctx, s, "cuGraphLaunch", _replay(emu, e.nodes), sync=False)


@_api(_H, since=10000)
def cuGraphDestroy(emu, hGraph):
    emu.current(sticky=False)
    g = emu.lookup(hGraph, (_Graph,), "graph")
    if isinstance(g, _GraphExec):
        _fail(CUresult.CUDA_ERROR_INVALID_VALUE, "cuGraphDestroy of a graph exec (use cuGraphExecDestroy)")
    emu.kill(g, "cuGraphDestroy")


@_api(_H, since=10000)
def cuGraphExecDestroy(emu, hGraphExec):
    emu.current(sticky=False)
    emu.kill(emu.lookup(hGraphExec, (_GraphExec,), "graph exec"), "cuGraphExecDestroy")


# ============================================================================ errors

_STRINGS: dict[str, bytes] = {}   # what cuGetErrorName/String handed out: alive for the process


def _static_string(text: str) -> bytes:
    return _STRINGS.setdefault(text, text.encode())


def _code(error: int) -> CUresult:
    try:
        return CUresult(error)
    except ValueError:
        _fail(CUresult.CUDA_ERROR_INVALID_VALUE, f"{error} is not a CUresult")


@_api(_I, _P(ctypes.c_char_p), since=6000)
def cuGetErrorName(emu, error, pStr):
    _put(pStr, _static_string(_code(error).name), "pStr")


@_api(_I, _P(ctypes.c_char_p), since=6000)
def cuGetErrorString(emu, error, pStr):
    code = _code(error)
    text = _TEXTS.get(int(code), code.name.removeprefix("CUDA_ERROR_").replace("_", " ").lower())
    _put(pStr, _static_string(text), "pStr")
