"""Arrays of other libraries (torch, JAX, CuPy, any array-API array) as numpy arrays over
the same memory, through DLPack, without importing those libraries.

1. The device is asked first (`__dlpack_device__`): only memory the CPU reads
   (`HOST_DEVICES`) is taken; a CUDA tensor is refused before anything is exported.
2. The array is exported once (`__dlpack__`, versioned when the producer can, so a
   read-only flag travels) and the capsule's dtype is read. numpy reads every DLPack
   dtype kvcore takes except bfloat16 and the float8 types: those are relabelled in the
   capsule, which is ours until numpy consumes it, as unsigned ints of the same width
   and viewed as the ml_dtypes type (refused, naming ml_dtypes, when it is not installed).
3. numpy's `from_dlpack` then builds the array from that capsule: same memory, same
   strides, the producer's buffer kept alive and released by the capsule's deleter.
"""
from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from .errors import DTypeError

# DLDeviceType values (dlpack.h) of memory the CPU reads: what numpy's from_dlpack takes.
HOST_DEVICES = {1: "cpu", 3: "cuda_host", 11: "rocm_host", 13: "cuda_managed"}
_OTHER_DEVICES = {2: "cuda", 4: "opencl", 7: "vulkan", 8: "metal", 9: "vpi", 10: "rocm",
                  12: "ext_dev", 14: "oneapi", 15: "webgpu", 16: "hexagon", 17: "maia"}

_DL_UINT = 1
# (DLDataTypeCode, bits) numpy does not read -> the ml_dtypes type of the same bits
_ML_DTYPES = {(4, 16): "bfloat16", (10, 8): "float8_e4m3fn", (12, 8): "float8_e5m2"}


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensorHead(ctypes.Structure):
    """The fields of DLTensor up to its dtype (the rest is not read here)."""
    _fields_ = [("data", ctypes.c_void_p), ("device_type", ctypes.c_int32),
                ("device_id", ctypes.c_int32), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType)]


class _DLManagedTensorVersionedHead(ctypes.Structure):
    """DLManagedTensorVersioned (DLPack >= 1.0): version, manager, deleter, flags, tensor.
    The legacy DLManagedTensor starts with its DLTensor."""
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32),
                ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p),
                ("flags", ctypes.c_uint64), ("dl_tensor", _DLTensorHead)]


# Function objects of our own, built from prototypes: the shared ctypes.pythonapi.* objects
# carry whatever argtypes the last module to use them set.
_capsule_valid = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_IsValid", ctypes.pythonapi))
_capsule_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi))


class _Exported:
    """A capsule already taken from its producer, handed to numpy.from_dlpack."""

    __slots__ = ("_capsule", "_device")

    def __init__(self, capsule: Any, device: tuple[int, int]):
        self._capsule = capsule
        self._device = device

    def __dlpack__(self, **kwargs: Any) -> Any:
        return self._capsule

    def __dlpack_device__(self) -> tuple[int, int]:
        return self._device


def device_name(device_type: int, device_id: int) -> str:
    """'cuda:0', 'cpu:0', or 'device type 99:0' for a value dlpack.h does not name."""
    kind = HOST_DEVICES.get(device_type) or _OTHER_DEVICES.get(device_type)
    return f"{kind or f'device type {device_type}'}:{device_id}"


def from_dlpack(name: str, x: Any) -> np.ndarray:
    """x (an object with `__dlpack__` and `__dlpack_device__`) as a numpy array over its
    memory (no copy). DTypeError naming the reason when x lives on a device the CPU does
    not read, refuses to export (torch: a tensor that requires grad), or holds a dtype
    numpy and ml_dtypes do not read."""
    what = type(x).__name__
    try:
        device_type, device_id = (int(d) for d in x.__dlpack_device__())
    except Exception as e:   # a producer's own error: named, not passed through
        raise DTypeError(f"invalid type of {name}: {what}.__dlpack_device__() failed: {e}") from e
    if device_type not in HOST_DEVICES:
        raise DTypeError(f"invalid device of {name}: expected an array in host memory (cpu), "
                         f"got a {what} on {device_name(device_type, device_id)} (copy it to "
                         f"the host first, e.g. tensor.cpu())")
    try:
        try:
            capsule = x.__dlpack__(stream=None, max_version=(1, 0))
        except TypeError:   # a producer older than DLPack 1.0: the legacy capsule
            capsule = x.__dlpack__()
    except Exception as e:
        raise DTypeError(f"invalid type of {name}: {what} refused to export its memory "
                         f"through DLPack: {e}") from e
    view = _relabel(name, capsule)
    try:
        arr = np.from_dlpack(_Exported(capsule, (device_type, device_id)))
    except (BufferError, RuntimeError, TypeError, ValueError) as e:
        raise DTypeError(f"invalid dtype of {name}: numpy does not read this {what} "
                         f"through DLPack: {e}") from e
    return arr if view is None else arr.view(view)


def _relabel(name: str, capsule: object) -> np.dtype | None:
    """For a dtype numpy does not read but ml_dtypes does (bfloat16, float8): relabels the
    capsule's dtype as the unsigned int of its width and returns the ml_dtypes dtype to
    view the array as; None for every other dtype (numpy reads it, or refuses it)."""
    if _capsule_valid(capsule, b"dltensor_versioned"):
        head = _DLManagedTensorVersionedHead.from_address(
            _capsule_pointer(capsule, b"dltensor_versioned")).dl_tensor
    elif _capsule_valid(capsule, b"dltensor"):
        head = _DLTensorHead.from_address(_capsule_pointer(capsule, b"dltensor"))
    else:
        raise DTypeError(f"invalid type of {name}: __dlpack__ returned {type(capsule).__name__}, "
                         f"not a DLPack capsule")
    ml_name = _ML_DTYPES.get((head.dtype.code, head.dtype.bits))
    if ml_name is None:
        return None
    try:
        import ml_dtypes
    except ImportError:
        raise DTypeError(f"invalid dtype of {name}: {ml_name} arrays need ml_dtypes "
                         f"(pip install ml_dtypes), which is not installed") from None
    head.dtype.code = _DL_UINT
    dtype: np.dtype = np.dtype(getattr(ml_dtypes, ml_name))
    return dtype
