"""Checked calls into the CUDA driver API (cuda-python), and the handles built on it.

1. cuda-python is imported lazily, on the first call that needs it: importing kvcore or
   kvcore.gpu never needs it. Every call goes through its bindings (`cuda.bindings.driver`),
   on a GPU and under the emulator alike: `kvcore.gpu.use_emulator()` only puts the
   emulated libcuda (kvcore.gpu._emu) under them, for the whole process.
2. Every driver call goes through `call(name, *args)`: a CUresult other than
   CUDA_SUCCESS raises CudaError("cuMemAlloc: CUDA_ERROR_OUT_OF_MEMORY: out of memory").
3. `Context.get(device)` retains the device's primary context once per process; it never
   changes the calling thread's current context. Every public entry of the GPU layer runs
   its driver calls inside `with ctx:` (cuCtxPushCurrent / cuCtxPopCurrent, or the
   `in_context` decorator), so any thread may call it, and the thread's own current context
   (torch's, say) is what it was afterwards. GC finalizers do the same. `release()` gives
   the context back.
5. Streams and events created here own their handle and destroy it when collected (a
   weakref.finalize inside the context), so a dropped owner leaks nothing.
4. Raw handles are exposed as plain ints (`ptr` / `handle`); a stream argument is
   keyword-only everywhere and may be a Stream, an int handle, or None (the cache's own).
6. Without cuda-python (and without the emulator) the first driver call raises
   GpuUnavailableError (an ImportError) saying how to get one or the other.
7. Objects that own device memory or a driver handle (`DeviceOwner`) refuse copy.copy,
   copy.deepcopy and pickle with DeviceCopyError: a copy would share the memory and free it
   twice, a pickle cannot carry it; the message says how to move the content instead.
"""
from __future__ import annotations

import ctypes
import functools
import sys
import threading
import weakref

from ..errors import CudaError, DeviceCopyError, GpuUnavailableError, StateError

_lock = threading.Lock()
_driver_module = None
_emulated = False


NO_CUDA_PYTHON = ('cuda-python is not installed: pip install "kvcore[cuda]" (kvcore\'s GPU layer '
                  'calls the driver through its bindings, on a GPU and under '
                  'kvcore.gpu.use_emulator() alike)')


def _import_driver():
    try:
        from cuda.bindings import driver as mod
        return mod
    except ImportError as first:
        missing = isinstance(first, ModuleNotFoundError) and (
            first.name is None or first.name == "cuda" or first.name.startswith("cuda."))
        if missing:
            raise GpuUnavailableError(NO_CUDA_PYTHON, name="cuda") from None
        raise GpuUnavailableError(
            f"cuda-python is installed but does not import ({type(first).__name__}: {first}): "
            f'reinstall it (pip install --force-reinstall "kvcore[cuda]")', name="cuda") from first


def cuda():
    """The driver module every call goes to: cuda-python's `cuda.bindings.driver`, over the
    real libcuda or, after `use_emulator()`, the emulated one. Raises GpuUnavailableError
    (an ImportError) when cuda-python is missing."""
    global _driver_module
    if _driver_module is None:
        _driver_module = _import_driver()
    return _driver_module


class DeviceOwner:
    """Base of the GPU objects that own device memory or a driver handle: copy.copy,
    copy.deepcopy and pickle raise DeviceCopyError, naming the class, what it holds
    (`_holds`) and how to move its content instead (`_move`)."""

    __slots__ = ()
    _holds = "device memory"
    _move = ""

    def _refuse_copy(self, what: str):
        if what == "pickling":
            why = "which exists only in this process"
        else:
            why = "which a copy would share with the original (and release twice) instead of duplicating"
        raise DeviceCopyError(f"{what} a kvcore.gpu.{type(self).__name__} is refused: it holds "
                              f"{self._holds}, {why}; {self._move}")

    def __copy__(self):
        self._refuse_copy("copy.copy of")

    def __deepcopy__(self, memo):
        self._refuse_copy("copy.deepcopy of")

    def __reduce_ex__(self, protocol):
        self._refuse_copy("pickling")

    def __reduce__(self):
        self._refuse_copy("pickling")


def use_emulated_driver(reset) -> None:
    """Sends every call to cuda-python's bindings over the emulated libcuda (already
    installed by kvcore.gpu._emu), after `reset()` built the emulator's fresh state; forgets
    kvcore's contexts. Refused while kvcore holds contexts of the real driver, or emulated
    device memory (the reset would pull it away)."""
    global _driver_module, _available, _emulated
    with _lock:
        if Context._contexts and not _emulated:
            raise StateError(f"cannot switch to the emulator: kvcore already opened contexts "
                             f"on real device(s) {sorted(Context._contexts)}")
        live = {d: c.live_bytes for d, c in Context._contexts.items() if c.live_bytes}
        if live:
            raise StateError(f"cannot reset the emulator: kvcore device memory is still live "
                             f"(bytes per device: {live}); free it first")
        reset()
        Context._contexts.clear()
        _driver_module, _available, _emulated = _import_driver(), None, True


def backend_is_emulator() -> bool:
    return _emulated


def _error_text(err) -> str:
    drv = cuda()
    name_res, name = drv.cuGetErrorName(err)
    text_res, text = drv.cuGetErrorString(err)
    name = name.decode() if name_res == drv.CUresult.CUDA_SUCCESS and name else f"CUresult {int(err)}"
    text = text.decode() if text_res == drv.CUresult.CUDA_SUCCESS and text else "unknown error"
    detail = None
    if _emulated:  # the emulator says why it refused
        from ._emu import driver as emu
        detail = emu.error_detail(err)
    return f"{name}: {text}" + (f" ({detail})" if detail else "")


def check(name: str, result):
    """Checks the tuple a driver call returned; gives back the values after the CUresult
    (None, the one value, or a tuple)."""
    err, *values = result
    if err != cuda().CUresult.CUDA_SUCCESS:
        raise CudaError(f"{name}: {_error_text(err)}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def call(name: str, *args):
    """`cuda().<name>(*args)`, checked (see `check`)."""
    return check(name, getattr(cuda(), name)(*args))


def init() -> None:
    """cuInit(0), checked."""
    call("cuInit", 0)


def device_count() -> int:
    init()
    return call("cuDeviceGetCount")


def driver_version_text() -> str:
    """The driver's CUDA version as "CUDA 12.2 (12020)" (cuDriverGetVersion)."""
    try:
        v = call("cuDriverGetVersion")
    except CudaError as e:
        return f"of unknown version ({e})"
    return f"CUDA {v // 1000}.{v % 1000 // 10} ({v})"


_available: bool | None = None


def is_available() -> bool:
    """True when cuda-python imports, the driver initialises and a device exists (always,
    after use_emulator()). Never raises: whatever goes wrong on the way (no module, no
    libcuda, no device) is False."""
    global _available
    if _available is None:
        try:
            _available = _libcuda_loads() and device_count() > 0
        except Exception:  # ImportError, missing libcuda (RuntimeError), CudaError
            _available = False
    return _available


def _libcuda_loads() -> bool:
    """Whether a libcuda.so.1 loads (the driver's, or the emulated one once installed):
    asked before the bindings are, since some (cuda-bindings 12.8) remember a failed first
    load for the whole process, which would keep a later use_emulator() from working."""
    if not sys.platform.startswith("linux"):
        return True
    try:
        ctypes.CDLL("libcuda.so.1")
        return True
    except OSError:
        return False


# ---------------------------------------------------------------------------- context

class Context(DeviceOwner):
    """The retained primary context of one device, with its properties and the bytes of
    device memory kvcore holds in it (`live_bytes`)."""

    _holds = "the device's retained primary context"
    _move = "Context.get(device) gives the one Context of a device in each process"

    _contexts: dict[int, "Context"] = {}

    def __init__(self, ordinal: int, device, handle):
        self.ordinal = ordinal
        self._device = device
        self._handle = handle
        self.live_bytes = 0
        self.modules: dict[tuple[str, str], object] = {}  # kernels loaded in it (kernels.py)
        self.order_event: Event | None = None  # reused by order_after
        drv = cuda()
        attr = drv.CUdevice_attribute
        self.name = call("cuDeviceGetName", 256, device).split(b"\0")[0].decode()
        self.sm_count = self.attribute(attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        self.compute_capability = (
            self.attribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR),
            self.attribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR))
        self.total_memory = call("cuDeviceTotalMem", device)

    @classmethod
    def get(cls, device: int = 0) -> "Context":
        """The primary context of device `device`, retained on first use (the calling
        thread's current context is left as it is; use `with ctx:` to run in it)."""
        with _lock:
            ctx = cls._contexts.get(device)
            if ctx is None:
                n = device_count()
                if not 0 <= device < n:
                    raise CudaError(f"cuDeviceGet: device {device} out of range: "
                                    f"expected 0 <= device < {n}")
                dev = call("cuDeviceGet", device)
                handle = call("cuDevicePrimaryCtxRetain", dev)
                ctx = cls(device, dev, handle)
                cls._contexts[device] = ctx
        return ctx

    @property
    def handle(self):
        if self._handle is None:
            raise StateError(f"the primary context of device {self.ordinal} was released")
        return self._handle

    def __enter__(self) -> "Context":
        """Makes this context current on the calling thread until the `with` block ends
        (cuCtxPushCurrent); the thread's previous context is current again afterwards."""
        call("cuCtxPushCurrent", self.handle)
        return self

    def __exit__(self, *exc) -> None:
        call("cuCtxPopCurrent")

    def attribute(self, attr) -> int:
        return call("cuDeviceGetAttribute", attr, self._device)

    def mem_get_info(self) -> tuple[int, int]:
        """(free, total) bytes of device memory (cuMemGetInfo)."""
        with self:
            return call("cuMemGetInfo")

    def synchronize(self) -> None:
        with self:
            call("cuCtxSynchronize")

    def release(self) -> None:
        """Releases the primary context; refuses while kvcore memory is live in it."""
        if self.live_bytes:
            raise StateError(f"cannot release the context of device {self.ordinal}: "
                             f"{self.live_bytes} bytes of device memory are still live")
        with _lock:
            if self._handle is not None:
                self.modules.clear()
                call("cuDevicePrimaryCtxRelease", self._device)
                self._handle = None
                Context._contexts.pop(self.ordinal, None)

    def __repr__(self):
        cc = ".".join(map(str, self.compute_capability))
        return (f"Context(device={self.ordinal}, name={self.name!r}, sm_count={self.sm_count}, "
                f"cc={cc}, live_bytes={self.live_bytes})")


def in_context(method):
    """Runs `method` with its object's context (`self.ctx`) current on the calling thread
    (pushed before, popped after)."""
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self.ctx:
            return method(self, *args, **kwargs)
    return wrapper


def _destroy_in(ctx: Context, name: str, handle) -> None:
    """GC finalizer of an owned handle: `name`(handle) inside ctx (skipped once the context
    was released, which took the handle with it)."""
    if ctx._handle is None:
        return
    with ctx:
        call(name, handle)


def owned_handle(owner, ctx: Context, destroy: str, handle) -> weakref.finalize:
    """A finalizer that calls `destroy`(handle) inside ctx when `owner` is collected, or
    when called (then never again); not run at interpreter exit."""
    fin = weakref.finalize(owner, _destroy_in, ctx, destroy, handle)
    fin.atexit = False
    return fin


# ---------------------------------------------------------------------------- streams

class Stream(DeviceOwner):
    """A CUDA stream. `create()` owns a new one (destroyed by `destroy()`);
    `from_handle(h)` wraps one owned elsewhere (torch, CuPy)."""

    _holds = "a CUDA stream handle"
    _move = "make another with Stream.create()"

    _live: "weakref.WeakSet[Stream]" = weakref.WeakSet()  # every Stream alive (refuse_while_capturing)

    def __init__(self, ctx: Context, handle, owned: bool):
        self.ctx = ctx
        self._handle = handle
        self._owned = owned
        self._finalizer = owned_handle(self, ctx, "cuStreamDestroy", handle) if owned else None
        Stream._live.add(self)

    @classmethod
    def create(cls, ctx: Context | None = None, *, non_blocking: bool = False) -> "Stream":
        """A new stream; by default a blocking one, ordered after the legacy default
        stream (where torch and CuPy queue their work unless told otherwise). Destroyed
        by `destroy()` or when collected."""
        ctx = ctx or Context.get()
        f = cuda().CUstream_flags
        flags = f.CU_STREAM_NON_BLOCKING if non_blocking else f.CU_STREAM_DEFAULT
        with ctx:
            return cls(ctx, call("cuStreamCreate", flags), True)

    @classmethod
    def from_handle(cls, handle: int, ctx: Context | None = None) -> "Stream":
        return cls(ctx or Context.get(), cuda().CUstream(int(handle)), False)

    @property
    def handle(self):
        if self._handle is None:
            raise StateError("use of a destroyed stream")
        return self._handle

    @property
    def ptr(self) -> int:
        return int(self.handle)

    @in_context
    def synchronize(self) -> None:
        call("cuStreamSynchronize", self.handle)

    @in_context
    def is_capturing(self) -> bool:
        return is_capturing(self)

    def destroy(self) -> None:
        """Destroys an owned stream (idempotent); wrapped handles are only forgotten."""
        if self._finalizer is not None:
            self._finalizer()
        self._handle = None

    def __repr__(self):
        return f"Stream(0x{int(self._handle or 0):x}, owned={self._owned})"


def stream_handle(stream) -> object:
    """A CUstream from a Stream, an int handle (0 = legacy default stream), or anything
    with a `cuda_stream` / `ptr` attribute (CuPy, torch's `cuda_stream`)."""
    if isinstance(stream, Stream):
        return stream.handle
    if isinstance(stream, int):
        return cuda().CUstream(stream)
    for attr in ("cuda_stream", "ptr"):
        if hasattr(stream, attr):
            return cuda().CUstream(int(getattr(stream, attr)))
    raise TypeError(f"invalid type of stream: expected kvcore.gpu.Stream or int, "
                    f"got {type(stream).__name__}")


def is_capturing(stream) -> bool:
    """True when `stream` is capturing a graph, or when it is the legacy default stream
    and another stream captures in global mode (cuStreamIsCapturing)."""
    drv = cuda()
    err, status = drv.cuStreamIsCapturing(stream_handle(stream))
    if err == drv.CUresult.CUDA_ERROR_STREAM_CAPTURE_IMPLICIT:
        return True
    check("cuStreamIsCapturing", (err,))
    return status != drv.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE


def refuse_while_capturing(what: str, *streams) -> None:
    """Raises StateError when a capture would refuse `what` (it allocates or synchronises,
    which a capture cannot hold, and the driver would invalidate the capture): when any of
    `streams`, the legacy stream (which reports a capturing blocking stream), or any live
    kvcore Stream (of any context: a global-mode capture forbids these calls everywhere)
    is capturing. Runs with the caller's context current. A capture on a foreign stream
    that kvcore holds no Stream for, and that does not show on the legacy stream (a
    non-blocking one), is not seen: the driver then refuses with CudaError."""
    for s in (*streams, 0):
        if is_capturing(s):
            raise StateError(f"{what} would synchronise or allocate, which is not allowed "
                             f"while a stream is capturing a CUDA graph")
    for t in list(Stream._live):
        if t._handle is None or t.ctx._handle is None:
            continue
        with t.ctx:
            capturing = is_capturing(t)
        if capturing:
            raise StateError(f"{what} would synchronise or allocate, which is not allowed "
                             f"while a stream is capturing a CUDA graph ({t!r} captures)")


# ---------------------------------------------------------------------------- events

class Event(DeviceOwner):
    """A CUDA event with timing (for benchmarks) or without (for ordering)."""

    _holds = "a CUDA event handle"
    _move = "make another with Event.create()"

    def __init__(self, ctx: Context, handle):
        self.ctx = ctx
        self._handle = handle
        self._finalizer = owned_handle(self, ctx, "cuEventDestroy", handle)

    @classmethod
    def create(cls, ctx: Context | None = None, *, timing: bool = True) -> "Event":
        ctx = ctx or Context.get()
        flags = cuda().CUevent_flags
        f = flags.CU_EVENT_DEFAULT if timing else flags.CU_EVENT_DISABLE_TIMING
        with ctx:
            return cls(ctx, call("cuEventCreate", f))

    @property
    def handle(self):
        if self._handle is None:
            raise StateError("use of a destroyed event")
        return self._handle

    @in_context
    def record(self, *, stream) -> None:
        call("cuEventRecord", self.handle, stream_handle(stream))

    @in_context
    def synchronize(self) -> None:
        call("cuEventSynchronize", self.handle)

    @in_context
    def done(self) -> bool:
        """Whether the work before the event's record has run (cuEventQuery)."""
        err = cuda().cuEventQuery(self.handle)[0]
        if err == cuda().CUresult.CUDA_ERROR_NOT_READY:
            return False
        check("cuEventQuery", (err,))
        return True

    @in_context
    def elapsed_ms(self, end: "Event") -> float:
        """Milliseconds from this event to `end` (both recorded and complete)."""
        return call("cuEventElapsedTime", self.handle, end.handle)

    def destroy(self) -> None:
        self._finalizer()
        self._handle = None


def order_after(producer: int, consumer, ctx: Context, what: str = "an input") -> None:
    """Makes `consumer` wait for the work queued so far on stream handle `producer`
    (1 = legacy default stream, 2 = per-thread default), via an event recorded there; both
    streams of context `ctx`. While `consumer` captures, a producer outside that capture
    (the default streams, a stream not capturing) cannot become a dependency of the graph:
    StateError before anything is recorded (the driver would invalidate the capture)."""
    if ctx.order_event is None:
        ctx.order_event = Event.create(ctx, timing=False)
    ev = ctx.order_event.handle
    with ctx:
        if is_capturing(consumer) and (producer in (1, 2) or not is_capturing(producer)):
            name = {1: "the legacy default stream", 2: "the per-thread default stream"}.get(
                producer, f"stream 0x{producer:x}")
            raise StateError(f"{what} is pending on {name}, which is not part of the capture "
                             f"on the stream it is used on: a graph cannot wait for it; "
                             f"synchronise it before capturing")
        call("cuEventRecord", ev, cuda().CUstream(producer))
        call("cuStreamWaitEvent", stream_handle(consumer), ev, 0)


# ---------------------------------------------------------------------------- launches

# (.entry sizes, the args' ctypes or None) -> their ctypes, once their sizes matched
_LAUNCH_TYPES: dict[tuple[tuple[int, ...], tuple], tuple[type, ...]] = {}


def launch(fn, grid: tuple[int, int, int], block: tuple[int, int, int], args, *,
           stream, shmem: int = 0) -> None:
    """cuLaunchKernel of `fn` (a kernels.Kernel) with typed arguments: `args` is a sequence
    of (value, ctype) pairs, ctype None for a device pointer given as an int (passed as
    ctypes.c_void_p). CudaError when their number or byte sizes differ from the kernel's
    .entry (the driver would read past or short of them)."""
    values, kinds = zip(*args) if args else ((), ())
    types = _LAUNCH_TYPES.get((fn.params, kinds))
    if types is None:
        types = tuple(ctypes.c_void_p if t is None else t for t in kinds)
        sizes = tuple(ctypes.sizeof(t) for t in types)
        if sizes != fn.params:
            raise CudaError(f"cuLaunchKernel({fn.module}.{fn.name}): {len(sizes)} parameters of "
                            f"{list(sizes)} bytes given, the .entry declares {len(fn.params)} of "
                            f"{list(fn.params)} bytes")
        _LAUNCH_TYPES[(fn.params, kinds)] = types
    call("cuLaunchKernel", fn.handle, *grid, *block, shmem, stream_handle(stream), (values, types), 0)
