"""Device memory: DeviceBuffer owns one allocation; DeviceArray is a typed view of device
memory (ours or another library's) that torch, CuPy and JAX can wrap without a copy.

1. DeviceBuffer.alloc / zeros / from_numpy are the factories; `ptr` is a plain int and
   `nbytes` the exact size. `free()` is idempotent; any use after it raises StateError.
   Live bytes are counted on the owning Context (`Context.live_bytes`).
2. Copies: `copy_from_host` / `copy_to_host` are synchronous without a stream and
   asynchronous on `stream=` (the numpy array must then stay alive and untouched until the
   stream reaches the copy). Synchronous calls refuse while a stream captures.
3. Interop, both ways: `__cuda_array_interface__` (v3) and DLPack (`__dlpack__`,
   `__dlpack_device__`, a "dltensor" PyCapsule holding a DLManagedTensor built with
   ctypes); `as_device_array(obj)` reads either from a foreign array.
4. PinnedHost page-locks an existing numpy array's bytes (cuMemHostRegister) so that
   async copies to and from it run by DMA, without the driver's staging copy.
"""
from __future__ import annotations

import ctypes
import math
import weakref

import numpy as np

from ..errors import DTypeError, ShapeError, StateError
from . import driver
from .driver import Context, call

# ------------------------------------------------------------------------- buffers


def _free(ctx: Context, ptr: int, nbytes: int) -> None:
    with ctx:
        call("cuMemFree", driver.cuda().CUdeviceptr(ptr))
    ctx.live_bytes -= nbytes


class DeviceBuffer(driver.DeviceOwner):
    """One device allocation of `nbytes` bytes at `ptr` in context `ctx`. Also a uint8
    DeviceArray of shape [nbytes] for interop. Not copyable nor picklable (DeviceCopyError)."""

    _holds = "device memory"
    _move = ("copy the bytes instead: buf.copy_to_host(out) (or view(...).to_numpy()) gives "
             "a host copy, DeviceBuffer.from_numpy(host) a new buffer holding it")

    def __init__(self, ctx: Context, ptr: int, nbytes: int):
        self.ctx = ctx
        self._ptr = ptr
        self.nbytes = nbytes
        self._finalizer = weakref.finalize(self, _free, ctx, ptr, nbytes)
        self._finalizer.atexit = False  # process teardown frees device memory itself

    @classmethod
    def alloc(cls, nbytes: int, *, ctx: Context | None = None) -> "DeviceBuffer":
        """Uninitialised device memory of `nbytes` (> 0) bytes (cuMemAlloc)."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, (int, np.integer)) or nbytes <= 0:
            raise ShapeError(f"invalid size of device buffer: expected a positive int, got {nbytes!r}")
        ctx = ctx or Context.get()
        with ctx:
            driver.refuse_while_capturing("DeviceBuffer.alloc")
            ptr = int(call("cuMemAlloc", int(nbytes)))
        ctx.live_bytes += int(nbytes)
        return cls(ctx, ptr, int(nbytes))

    @classmethod
    def zeros(cls, nbytes: int, *, ctx: Context | None = None) -> "DeviceBuffer":
        buf = cls.alloc(nbytes, ctx=ctx)
        buf.fill(0)
        return buf

    @classmethod
    def from_numpy(cls, arr: np.ndarray, *, ctx: Context | None = None) -> "DeviceBuffer":
        """A new buffer holding the bytes of `arr` (any shape; copied C-contiguous)."""
        arr = np.ascontiguousarray(arr)
        buf = cls.alloc(max(arr.nbytes, 1), ctx=ctx)
        buf.copy_from_host(arr)
        return buf

    @property
    def ptr(self) -> int:
        if not self._finalizer.alive:
            raise StateError("use of a freed DeviceBuffer")
        return self._ptr

    @property
    def freed(self) -> bool:
        return not self._finalizer.alive

    def free(self) -> None:
        """Releases the allocation; a second call does nothing."""
        if self._finalizer.alive:
            with self.ctx:
                driver.refuse_while_capturing("DeviceBuffer.free")
            self._finalizer()

    @driver.in_context
    def fill(self, byte: int, *, stream=None) -> None:
        """Sets every byte to `byte` (cuMemsetD8; on `stream` when given)."""
        dptr = driver.cuda().CUdeviceptr(self.ptr)
        if stream is None:
            driver.refuse_while_capturing("DeviceBuffer.fill")
            call("cuMemsetD8", dptr, byte, self.nbytes)
        else:
            call("cuMemsetD8Async", dptr, byte, self.nbytes, driver.stream_handle(stream))

    def _host_range(self, arr: np.ndarray, offset: int, name: str) -> None:
        if not isinstance(arr, np.ndarray):
            raise DTypeError(f"invalid type of {name}: expected numpy.ndarray, got {type(arr).__name__}")
        if not arr.flags.c_contiguous:
            raise ShapeError(f"invalid layout of {name}: expected C-contiguous")
        if offset < 0 or offset + arr.nbytes > self.nbytes:
            raise ShapeError(f"invalid range of {name}: bytes [{offset}, {offset + arr.nbytes}) "
                             f"outside the buffer's {self.nbytes}")

    @driver.in_context
    def copy_from_host(self, arr: np.ndarray, *, offset: int = 0, stream=None) -> None:
        """Copies the bytes of C-contiguous `arr` to [offset, offset + arr.nbytes)."""
        self._host_range(arr, offset, "arr")
        if arr.nbytes == 0:
            return
        dst = driver.cuda().CUdeviceptr(self.ptr + offset)
        if stream is None:
            driver.refuse_while_capturing("DeviceBuffer.copy_from_host")
            call("cuMemcpyHtoD", dst, arr.ctypes.data, arr.nbytes)
        else:
            call("cuMemcpyHtoDAsync", dst, arr.ctypes.data, arr.nbytes, driver.stream_handle(stream))

    @driver.in_context
    def copy_to_host(self, out: np.ndarray, *, offset: int = 0, stream=None) -> np.ndarray:
        """Copies bytes [offset, offset + out.nbytes) into C-contiguous `out`; returns out."""
        self._host_range(out, offset, "out")
        if not out.flags.writeable:
            raise ShapeError("invalid out: the array is read-only")
        if out.nbytes == 0:
            return out
        src = driver.cuda().CUdeviceptr(self.ptr + offset)
        if stream is None:
            driver.refuse_while_capturing("DeviceBuffer.copy_to_host")
            call("cuMemcpyDtoH", out.ctypes.data, src, out.nbytes)
        else:
            call("cuMemcpyDtoHAsync", out.ctypes.data, src, out.nbytes, driver.stream_handle(stream))
        return out

    def view(self, shape, dtype, *, offset: int = 0, producer=None) -> "DeviceArray":
        """A C-contiguous typed view [shape] dtype starting `offset` bytes in; `producer`
        as in DeviceArray."""
        dtype = np.dtype(dtype)
        shape = tuple(int(s) for s in shape)
        nbytes = math.prod(shape) * dtype.itemsize
        if offset < 0 or offset % dtype.itemsize or offset + nbytes > self.nbytes:
            raise ShapeError(f"invalid view {list(shape)} {dtype} at byte {offset} of a "
                             f"{self.nbytes}-byte buffer")
        return DeviceArray(self.ctx, lambda: self.ptr + offset, shape, dtype, owner=self,
                           producer=producer)

    # a DeviceBuffer is its own uint8 [nbytes] array
    @property
    def __cuda_array_interface__(self):
        return self.view((self.nbytes,), np.uint8).__cuda_array_interface__

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        return self.view((self.nbytes,), np.uint8).__dlpack__(stream=stream)

    def __dlpack_device__(self):
        return (_KDL_CUDA, self.ctx.ordinal)

    def __repr__(self):
        state = "freed" if self.freed else f"0x{self._ptr:x}"
        return f"DeviceBuffer({state}, nbytes={self.nbytes})"


# ------------------------------------------------------------------------- arrays

def _unpin(ctx: Context, ptr: int, array: np.ndarray) -> None:
    with ctx:
        call("cuMemHostUnregister", ptr)
    del array   # the bytes stay alive until they are unregistered


class PinnedHost:
    """The bytes of a C-contiguous numpy array page-locked (cuMemHostRegister, flags 0) for
    `ctx`'s copies while this lives: async copies to and from them are DMA, not staged.
    Holds the array (its memory cannot go away while registered). `unpin()` (or garbage
    collection) unregisters: the caller waits first for the copies that use the bytes.
    StateError when the range is already page-locked (by another PinnedHost, say)."""

    def __init__(self, array: np.ndarray, ctx: Context):
        if not isinstance(array, np.ndarray) or not array.flags.c_contiguous or array.nbytes == 0:
            raise ShapeError("PinnedHost needs a non-empty C-contiguous numpy array")
        self.ptr, self.nbytes = array.ctypes.data, array.nbytes
        with ctx:
            driver.refuse_while_capturing("PinnedHost")
            if driver.cuda().cuMemHostGetFlags(self.ptr)[0] == driver.cuda().CUresult.CUDA_SUCCESS:
                raise StateError(f"host memory at 0x{self.ptr:x} ({self.nbytes} bytes) is "
                                 f"page-locked already (attached to another GpuKVPool?)")
            call("cuMemHostRegister", self.ptr, self.nbytes, 0)
        self._finalizer = weakref.finalize(self, _unpin, ctx, self.ptr, array)
        self._finalizer.atexit = False

    @property
    def pinned(self) -> bool:
        return self._finalizer.alive

    def unpin(self) -> None:
        """Unregisters the bytes; a second call does nothing."""
        self._finalizer()


class DeviceArray(driver.DeviceOwner):
    """A typed view of device memory: `ptr`, `shape`, `dtype`, `strides` (bytes; C order
    when made by DeviceBuffer.view). Keeps `owner` (a DeviceBuffer or a foreign array)
    alive; a view of a freed DeviceBuffer raises StateError on use. Not copyable nor
    picklable (DeviceCopyError)."""

    _holds = "a view of device memory"
    _move = ("copy the data instead: arr.to_numpy() gives a host copy (which pickles), "
             "DeviceBuffer.from_numpy(host) a new device buffer holding it")

    def __init__(self, ctx: Context, ptr, shape, dtype, *, owner=None, strides=None, producer=None):
        self.ctx = ctx
        # what queues work on this memory (a GpuKVCache): its `stream` and
        # `order_consumer(stream)`, used by the exports to order a consumer after that work
        self.producer = producer
        self._ptr = ptr if callable(ptr) else (lambda p=int(ptr): p)
        self.shape = tuple(shape)
        self.dtype = np.dtype(dtype)
        self.strides = tuple(strides) if strides is not None else _c_strides(self.shape, self.dtype.itemsize)
        self.owner = owner

    @property
    def ptr(self) -> int:
        return self._ptr()

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    @property
    def is_c_contiguous(self) -> bool:
        return self.size == 0 or all(
            n == 1 or s == c for n, s, c in zip(self.shape, self.strides,
                                                  _c_strides(self.shape, self.dtype.itemsize)))

    def to_numpy(self) -> np.ndarray:
        """A host copy (synchronous) of a C-contiguous view."""
        if not self.is_c_contiguous:
            raise ShapeError("invalid layout: to_numpy needs a C-contiguous view")
        out = np.empty(self.shape, self.dtype)
        if out.nbytes:
            with self.ctx:
                driver.refuse_while_capturing("DeviceArray.to_numpy")
                call("cuMemcpyDtoH", out.ctypes.data, driver.cuda().CUdeviceptr(self.ptr), out.nbytes)
        return out

    @driver.in_context
    def copy_from_numpy(self, arr: np.ndarray, *, stream=None) -> None:
        """Writes `arr` (same shape, cast to this dtype) into a C-contiguous view."""
        if not self.is_c_contiguous:
            raise ShapeError("invalid layout: copy_from_numpy needs a C-contiguous view")
        if tuple(arr.shape) != self.shape:
            raise ShapeError(f"invalid shape of arr: expected {list(self.shape)}, got {list(arr.shape)}")
        src = np.ascontiguousarray(arr, dtype=self.dtype)
        if not src.nbytes:
            return
        dst = driver.cuda().CUdeviceptr(self.ptr)
        if stream is None:
            driver.refuse_while_capturing("DeviceArray.copy_from_numpy")
            call("cuMemcpyHtoD", dst, src.ctypes.data, src.nbytes)
        else:
            call("cuMemcpyHtoDAsync", dst, src.ctypes.data, src.nbytes, driver.stream_handle(stream))

    @property
    def __cuda_array_interface__(self):
        typestr = self.dtype.str
        if self.dtype.kind == "V" or typestr[1] not in "iufb":  # ml_dtypes: export raw bits
            typestr = f"|u{self.dtype.itemsize}" if self.dtype.itemsize == 1 else f"<u{self.dtype.itemsize}"
        # CAI v3: "stream" is where the producer's work is pending (the consumer syncs with
        # it); None when kvcore queued none (a plain buffer)
        stream = None if self.producer is None else self.producer.stream.ptr
        return {"shape": self.shape, "typestr": typestr, "data": (self.ptr, False),
                "strides": None if self.is_c_contiguous else self.strides,
                "version": 3, "stream": stream}

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        """A "dltensor" capsule. `stream` (DLPack's rule for CUDA: None = the legacy default
        stream, 1 legacy, 2 per-thread, any other a stream handle, -1 no ordering) waits
        for the work kvcore queued on this memory (a GpuKVCache's) via events."""
        if copy:
            raise BufferError("kvcore DeviceArray exports without copying only (copy=True)")
        if stream == 0:
            raise BufferError("DLPack stream 0 is ambiguous: pass 1 (legacy default stream), "
                              "2 (per-thread default stream) or a stream handle")
        if self.producer is not None and stream != -1:
            self.producer.order_consumer(1 if stream is None else int(stream))
        return _make_dlpack_capsule(self)

    def __dlpack_device__(self):
        return (_KDL_CUDA, self.ctx.ordinal)

    def __repr__(self):
        return f"DeviceArray(ptr=0x{self.ptr:x}, shape={list(self.shape)}, dtype={self.dtype})"


def _c_strides(shape, itemsize) -> tuple[int, ...]:
    strides, acc = [], itemsize
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(strides))


def as_device_array(obj, name: str = "array", *, stream=None, ctx: Context | None = None) -> DeviceArray:
    """A DeviceArray view of `obj`: a DeviceArray / DeviceBuffer, anything with
    `__cuda_array_interface__` (CuPy, torch, Numba), or a DLPack producer on a CUDA device
    (torch bfloat16, JAX). Its device is read from the pointer (cuPointerGetAttribute) or
    DLPack's device; `ctx` (the context the caller launches in) refuses another device
    with ShapeError. `stream` is the stream the caller will use it on: it waits for the
    producer's pending work (the CAI "stream" entry, or DLPack's stream argument).
    No copy is made."""
    if isinstance(obj, DeviceBuffer):
        obj = obj.view((obj.nbytes,), np.uint8)
    if isinstance(obj, DeviceArray):
        _same_device(name, obj.ctx.ordinal, ctx)
        return obj
    if isinstance(obj, np.ndarray):
        raise DTypeError(f"invalid type of {name}: expected a device array, got numpy.ndarray "
                         f"(copy it with DeviceBuffer.from_numpy)")
    if hasattr(obj, "__dlpack__") and hasattr(obj, "__dlpack_device__"):
        # preferred: the producer orders `stream` after its own work (torch's CAI names
        # no stream at all)
        return _from_dlpack(obj, ctx, stream, name)
    cai = None
    try:
        cai = obj.__cuda_array_interface__
    except (AttributeError, TypeError, RuntimeError):  # torch: TypeError for bfloat16,
        pass                                          # RuntimeError with requires_grad
    if cai is not None:
        ptr = int(cai["data"][0])
        actx = Context.get(_device_of(ptr, name)) if ptr else (ctx or Context.get())
        _same_device(name, actx.ordinal, ctx)
        producer = cai.get("stream")  # CAI v3: absent/None = no sync needed; 0 disallowed
        if producer is not None and int(producer) == 0:
            raise DTypeError(f"invalid __cuda_array_interface__ of {name}: stream 0 is "
                             f"disallowed (1 = legacy default stream, 2 = per-thread)")
        if producer is not None and stream is not None and int(producer) != int(driver.stream_handle(stream)):
            driver.order_after(int(producer), stream, actx, name)
        dtype = np.dtype(cai["typestr"])
        shape = tuple(cai["shape"])
        return DeviceArray(actx, ptr, shape, dtype, owner=obj, strides=cai.get("strides"))
    raise DTypeError(f"invalid type of {name}: expected a device array (DeviceArray, "
                     f"__cuda_array_interface__ or DLPack), got {type(obj).__name__}")


def _device_of(ptr: int, name: str) -> int:
    """The ordinal of the device whose memory `ptr` points into (cuPointerGetAttribute)."""
    drv = driver.cuda()
    driver.init()
    err, ordinal = drv.cuPointerGetAttribute(
        drv.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ptr)
    if err != drv.CUresult.CUDA_SUCCESS or int(ordinal) < 0:
        raise DTypeError(f"invalid {name}: 0x{ptr:x} is not device memory the CUDA driver "
                         f"knows ({driver._error_text(err) if err else 'no device'})")
    return int(ordinal)


def _same_device(name: str, ordinal: int, ctx: Context | None) -> None:
    if ctx is not None and ordinal != ctx.ordinal:
        raise ShapeError(f"invalid device of {name}: the array is on device {ordinal}, "
                         f"expected device {ctx.ordinal} (where it is used)")


# ------------------------------------------------------------------------- DLPack (ctypes)

_KDL_CUDA = 2
_DL_CODES = {"i": 0, "u": 1, "f": 2, "b": 1}  # bool as 8-bit unsigned
_DL_BFLOAT = 4


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    pass


_DLDeleter = ctypes.CFUNCTYPE(None, ctypes.POINTER(_DLManagedTensor))
_DLManagedTensor._fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p),
                             ("deleter", _DLDeleter)]

_CapsuleDestructor = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_DLTENSOR = b"dltensor"
_USED_DLTENSOR = b"used_dltensor"

_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, _CapsuleDestructor]
_capsule_is_valid = ctypes.pythonapi.PyCapsule_IsValid
_capsule_is_valid.restype = ctypes.c_int
_capsule_is_valid.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
_capsule_get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_get_pointer.restype = ctypes.c_void_p
_capsule_get_pointer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
_capsule_set_name = ctypes.pythonapi.PyCapsule_SetName
_capsule_set_name.restype = ctypes.c_int
_capsule_set_name.argtypes = [ctypes.py_object, ctypes.c_char_p]

# Exported tensors alive in some consumer: address of the DLManagedTensor -> holder.
_exported: dict[int, "_Export"] = {}


class _Export:
    """Keeps one exported DLManagedTensor, its shape/strides and the source array alive
    until the consumer calls the deleter."""

    def __init__(self, arr: DeviceArray):
        itemsize = arr.dtype.itemsize
        if any(s % itemsize for s in arr.strides):
            raise BufferError("DLPack needs strides that are multiples of the item size")
        n = arr.ndim
        self.shape = (ctypes.c_int64 * max(n, 1))(*arr.shape)
        self.strides = (ctypes.c_int64 * max(n, 1))(*(s // itemsize for s in arr.strides))
        self.source = arr
        m = self.managed = _DLManagedTensor()
        m.dl_tensor.data = arr.ptr
        m.dl_tensor.device = _DLDevice(_KDL_CUDA, arr.ctx.ordinal)
        m.dl_tensor.ndim = n
        m.dl_tensor.dtype = _dl_dtype(arr.dtype)
        m.dl_tensor.shape = self.shape
        m.dl_tensor.strides = self.strides
        m.dl_tensor.byte_offset = 0
        m.manager_ctx = None
        m.deleter = _dl_deleter


def _dl_dtype(dtype: np.dtype) -> _DLDataType:
    bits = dtype.itemsize * 8
    if dtype.name == "bfloat16":
        return _DLDataType(_DL_BFLOAT, 16, 1)
    if dtype.kind in _DL_CODES:
        return _DLDataType(_DL_CODES[dtype.kind], bits, 1)
    return _DLDataType(1, bits, 1)  # ml_dtypes float8: exported as raw uint8 bits


@_DLDeleter
def _dl_deleter(managed):
    _exported.pop(ctypes.addressof(managed.contents), None)


@_CapsuleDestructor
def _capsule_destructor(capsule):
    # A consumer renames the capsule to "used_dltensor" and owns the tensor from then on;
    # a capsule that dies unconsumed still owns it and deletes it here.
    if _capsule_is_valid(capsule, _DLTENSOR):
        addr = _capsule_get_pointer(capsule, _DLTENSOR)
        _exported.pop(addr, None)


def _make_dlpack_capsule(arr: DeviceArray):
    holder = _Export(arr)
    addr = ctypes.addressof(holder.managed)
    _exported[addr] = holder
    return _capsule_new(addr, _DLTENSOR, _capsule_destructor)


def _from_dlpack(obj, ctx: Context | None, stream, name: str) -> DeviceArray:
    dev_type, dev_id = obj.__dlpack_device__()
    if int(dev_type) != _KDL_CUDA:
        raise DTypeError(f"invalid device of {name}: expected a CUDA device, got DLPack "
                         f"device ({int(dev_type)}, {int(dev_id)})")
    _same_device(name, int(dev_id), ctx)
    ctx = Context.get(int(dev_id))
    sh = -1 if stream is None else int(driver.stream_handle(stream))
    capsule = obj.__dlpack__(stream=sh if sh != 0 else 1)
    if not _capsule_is_valid(id(capsule), _DLTENSOR):
        raise DTypeError(f"invalid DLPack capsule of {name}: expected a \"dltensor\" capsule")
    addr = _capsule_get_pointer(id(capsule), _DLTENSOR)
    m = _DLManagedTensor.from_address(addr)
    t = m.dl_tensor
    code, bits = t.dtype.code, t.dtype.bits
    if t.dtype.lanes != 1:
        raise DTypeError(f"invalid dtype of {name}: vector DLPack types are not supported")
    if code == _DL_BFLOAT and bits == 16:
        from .._validate import float_input_dtypes
        bf = [d for d in float_input_dtypes() if d.name == "bfloat16"]
        dtype = bf[0] if bf else np.dtype(np.uint16)
    else:
        kind = {0: "i", 1: "u", 2: "f"}.get(code)
        if kind is None:
            raise DTypeError(f"invalid dtype of {name}: DLPack type code {code} is not supported")
        dtype = np.dtype(f"{kind}{bits // 8}")
    shape = tuple(t.shape[i] for i in range(t.ndim))
    strides = (None if not t.strides else
               tuple(t.strides[i] * dtype.itemsize for i in range(t.ndim)))
    ptr = t.data + t.byte_offset
    # Consume: the tensor stays valid while `obj` lives (we keep it as owner), so the
    # producer's bookkeeping can be released right away.
    _capsule_set_name(capsule, _USED_DLTENSOR)
    if m.deleter:
        m.deleter(ctypes.pointer(m))
    return DeviceArray(ctx, ptr, shape, dtype, owner=obj, strides=strides)
