"""One validation helper, one message form.

    invalid shape of k: expected [T, 8, 128], got [1, 4, 128]
    invalid dtype of k: expected float32, float16 or bfloat16, got float64
    layer 40 out of range: expected 0 <= layer < 32
    non-finite value in k: k[1, 2, 3] = nan

ValueError-family errors for bad values, TypeError-family for wrong types.
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Iterable, Protocol, Sequence, TypeVar, Union

import numpy as np
from numpy.typing import DTypeLike

from ._dlpack import from_dlpack
from .errors import (DTypeError, FormatError, NonFiniteError, OutOfRangeError, RangeError,
                     ShapeError)


if TYPE_CHECKING:
    from .formats import Format


class SupportsDLPack(Protocol):
    """An array of another library that exports its memory through DLPack."""
    def __dlpack__(self, *args: Any, **kwargs: Any) -> Any: ...
    def __dlpack_device__(self) -> Any: ...


class SupportsBuffer(Protocol):
    """An object with the buffer protocol (memoryview, array.array, bytearray)."""
    def __buffer__(self, flags: int, /) -> memoryview: ...


AnyArray = Union[np.ndarray, SupportsDLPack, SupportsBuffer]
"""What an array argument takes: a numpy array, or an array check_ndarray reads in place."""

OutArray = TypeVar("OutArray", bound=AnyArray)
"""An out= argument: returned as the caller passed it."""


def _fmt_shape(shape: Iterable[object]) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


def check_ndarray(name: str, x: object) -> np.ndarray:
    """x as a numpy array over the same memory, never a copy: a numpy array itself; an
    array of another library through DLPack (`__dlpack__`: torch, JAX, CuPy, array-API
    arrays; bfloat16 and float8 as ml_dtypes types; refused unless in host memory, so a
    CUDA tensor passed to a CPU call raises here, naming its device); or any object with
    the buffer protocol (memoryview, array.array). Writes through the result land in x.
    Raises DTypeError for anything else, naming what it is. Masked arrays are refused:
    kernels read the data under the mask (NaN, inf, anything), so the caller fills or
    drops the masked values first (`x.filled(...)`)."""
    if isinstance(x, np.ndarray):
        if isinstance(x, np.ma.MaskedArray):
            raise DTypeError(f"invalid type of {name}: expected numpy.ndarray, got MaskedArray "
                             f"(masked arrays are not taken: fill them first, x.filled(value))")
        return x
    if hasattr(x, "__dlpack__"):
        return from_dlpack(name, x)
    try:
        view = memoryview(x)  # type: ignore[arg-type]
    except TypeError:
        raise DTypeError(f"invalid type of {name}: expected an array (numpy, DLPack or the "
                         f"buffer protocol), got {type(x).__name__}") from None
    try:
        return np.asarray(view)
    except (TypeError, ValueError) as e:   # a buffer format numpy does not read
        raise DTypeError(f"invalid dtype of {name}: numpy does not read this "
                         f"{type(x).__name__}'s buffer (format {view.format!r}): {e}") from e


def is_array(x: object) -> bool:
    """Whether check_ndarray would take x as an array rather than refuse its type: for
    arguments that are an array or a plain sequence (positions, counts)."""
    if isinstance(x, np.ndarray) or hasattr(x, "__dlpack__"):
        return True
    try:
        memoryview(x)  # type: ignore[arg-type]
    except TypeError:
        return False
    return True


def check_shape(name: str, x: np.ndarray, expected: Sequence[int | str]) -> None:
    """expected: ints must match; strings (like "T") match any size and name it."""
    ok = x.ndim == len(expected) and all(
        isinstance(e, str) or e == s for e, s in zip(expected, x.shape))
    if not ok:
        raise ShapeError(f"invalid shape of {name}: expected {_fmt_shape(expected)}, "
                         f"got {_fmt_shape(x.shape)}")


def check_dtype(name: str, x: np.ndarray, allowed: Sequence[DTypeLike]) -> None:
    dtypes = [np.dtype(a) for a in allowed]
    if x.dtype not in dtypes:
        names = [str(a) for a in dtypes]
        want = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]
        raise DTypeError(f"invalid dtype of {name}: expected {want}, got {x.dtype}")


def check_out(name: str, out: object, shape: Sequence[int | str],
              allowed: Sequence[DTypeLike]) -> np.ndarray:
    """An output array a caller passed (any array check_ndarray takes), of one of the
    allowed dtypes, of exactly `shape`, C-contiguous and writable; returned as the numpy
    array over its memory."""
    arr = check_ndarray(name, out)
    check_dtype(name, arr, allowed)
    check_shape(name, arr, shape)
    if not arr.flags.c_contiguous or not arr.flags.writeable:
        raise ShapeError(f"{name} must be a writable C-contiguous array")
    return arr


def check_index(name: str, value: object, limit: int) -> int:
    """0 <= value < limit, value an int (numpy ints too, bools not)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise DTypeError(f"invalid type of {name}: expected int, got {type(value).__name__}")
    value = int(value)
    if not 0 <= value < limit:
        raise OutOfRangeError(f"{name} {value} out of range: expected 0 <= {name} < {limit}")
    return value


def check_seq_id(value: object, name: str = "sequence id") -> int:
    """A sequence id: an int (numpy ints too). DTypeError for anything else, bools and
    floats included: 0.0, np.float64(0) and False hash and compare equal to 0, so a dict
    lookup would take them for sequence 0."""
    if value.__class__ is int:
        return value    # the hot path: a plain int
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return int(value)
    raise DTypeError(f"invalid type of {name}: expected int, got {type(value).__name__} "
                     f"({_short_repr(value)})")


def _short_repr(value: object, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def check_seq_ids(name: str, seqs: object) -> list[int]:
    """seqs (an iterable of sequence ids: a list, tuple, range or 1-D integer array) as a
    list of ints, each checked as check_seq_id does: DTypeError naming what it got
    (ShapeError for an array that is not 1-D)."""
    if isinstance(seqs, (str, bytes)) or not hasattr(seqs, "__iter__"):
        raise DTypeError(f"invalid type of {name}: expected a sequence of sequence ids (ints), "
                         f"got {type(seqs).__name__} ({_short_repr(seqs)})")
    if isinstance(seqs, np.ndarray) and seqs.ndim != 1:
        raise ShapeError(f"invalid shape of {name}: expected [B] (one id per sequence), got "
                         f"{_fmt_shape(seqs.shape)}")
    ids = list(seqs)    # iterable: checked above
    for b, s in enumerate(ids):
        if s.__class__ is not int:
            ids[b] = check_seq_id(s, f"{name}[{b}]")
    return ids


def check_int32(name: str, value: object) -> int:
    """An int (numpy ints too, bools not) that int32 holds: DTypeError, RangeError."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise DTypeError(f"invalid type of {name}: expected int, got {type(value).__name__} "
                         f"({_short_repr(value)})")
    value = int(value)
    if not -2**31 <= value < 2**31:
        raise RangeError(f"{name} {value} out of range: expected an int32, "
                         f"{-2**31} <= {name} <= {2**31 - 1}")
    return value


@functools.cache
def float_input_dtypes() -> tuple[np.dtype, ...]:
    """float32, float16, and ml_dtypes bfloat16 when ml_dtypes is installed."""
    out: list[np.dtype] = [np.dtype(np.float32), np.dtype(np.float16)]
    try:
        import ml_dtypes
        out.append(np.dtype(ml_dtypes.bfloat16))
    except ImportError:
        pass
    return tuple(out)


# Why a finite value at or past a format's input limit is refused (kvcore._quant.input_limit).
_LIMIT_REASON = {"f16": "it would round to float16 infinity",
                 "bf16": "it would round to bfloat16 infinity",
                 "q8_0": "its float16 block scale max|x|/127 would overflow",
                 "q4_0": "its float16 block scale max|x|/8 would overflow",
                 "q4_1": "a q4_1 block min or scale (max - min)/15 could overflow float16",
                 "q4_1ch": "a q4_1ch block min or scale (max - min)/15 could overflow float16",
                 "int8": "its decoded value 127 * (max|x|/127) would overflow float32"}


def check_values(name: str, x: np.ndarray, fmt: Format) -> None:
    """Raises for the first value of x (C order) that format `fmt` (a formats.Format)
    refuses: NonFiniteError for NaN/inf, FormatError for |x| >= its input limit
    (kvcore._quant.input_limit). The kernels check on the raw bits; this is the cold path
    that names the value once a kernel has refused a row."""
    from ._quant import input_limit
    limit = input_limit(fmt.id)
    x32 = x.astype(np.float32)
    refused = ~(np.abs(x32) < limit)
    if not refused.any():
        return
    flat = int(np.argmax(refused))
    value = x32.flat[flat]
    where = f"{name}[{', '.join(str(int(i)) for i in np.unravel_index(flat, x.shape))}] = {value!s}"
    if not np.isfinite(value):
        raise NonFiniteError(f"non-finite value in {name}: {where}")
    raise FormatError(f"value out of range of format {fmt.name} in {name}: {where}, expected "
                      f"|x| < {np.float32(limit)!s} ({_LIMIT_REASON[fmt.name]})")
