"""quantize / dequantize: rows of any leading shape to and from every storage format.

The rules and byte layouts are in docs/formats.md; the kernels in _quant.pyx.
"""
from __future__ import annotations

import math
from typing import TypeVar, cast

import numpy as np

from . import _quant
from ._validate import (AnyArray, OutArray, check_dtype, check_ndarray, check_out, check_shape,
                        check_values, float_input_dtypes)
from .errors import DTypeError, FormatError, ShapeError
from .formats import BF16, F16, F32, Format, get_format, view_dtype

Q8_0_LIMIT: float = _quant.Q8_0_LIMIT
"""q8_0 refuses |x| >= Q8_0_LIMIT (8321040.0 = 65520 * 127): the block scale
max|x| / 127 would round to float16 infinity."""
Q4_0_LIMIT: float = _quant.Q4_0_LIMIT
"""q4_0 refuses |x| >= Q4_0_LIMIT (524160.0 = 65520 * 8): the block scale max / -8
would round to float16 infinity (exactly: d depends on max|x| alone)."""
Q4_1_LIMIT: float = _quant.Q4_1_LIMIT
"""q4_1 refuses |x| >= Q4_1_LIMIT (65520.0): a bound on every value under which the
float16 block min and scale (max - min) / 15 are finite (stricter than ggml, which stores
a block such as [70000, 0, ...] with a finite min)."""

_QuantOut = TypeVar("_QuantOut", bound="tuple[AnyArray, AnyArray | None]")
"""quantize's out=: (codes, scales) arrays, returned as the caller passed them."""

_INPUT_KIND = {np.dtype(np.float32): F32, np.dtype(np.float16): F16}


def _input_kind(x: np.ndarray) -> int:
    return _INPUT_KIND.get(x.dtype, BF16)  # dtype already checked: the rest is bfloat16


def _row_walk(x: np.ndarray) -> tuple[np.ndarray, int, int]:
    """How the kernel walks the rows of x [..., D] in C order without copying x:
    (outer byte offsets int64 [R_outer], n_inner, inner byte stride), row
    o * n_inner + i starting at outer[o] + i * inner stride. Leading axes that are
    contiguous with each other are merged first, so a C-contiguous x has one outer row."""
    dims = [(n, s) for n, s in zip(x.shape[:-1], x.strides[:-1]) if n != 1]
    merged: list[tuple[int, int]] = []
    for n, s in dims:
        if merged and merged[-1][1] == n * s:
            merged[-1] = (merged[-1][0] * n, s)
        else:
            merged.append((n, s))
    if not merged or 0 in x.shape[:-1]:
        merged = [(0 if 0 in x.shape[:-1] else 1, 0)]
    n_inner, inner_stride = merged[-1]
    outer = np.zeros([n for n, _ in merged[:-1]], dtype=np.int64)
    for axis, (n, s) in enumerate(merged[:-1]):
        shape = [1] * outer.ndim
        shape[axis] = n
        outer += (np.arange(n, dtype=np.int64) * s).reshape(shape)
    return outer.reshape(-1), n_inner, inner_stride


def quantize(x: AnyArray, fmt: "str | Format", *, out: _QuantOut | None = None,
             ) -> tuple[np.ndarray, np.ndarray | None] | _QuantOut:
    """Encodes rows of D values in a storage format.

    x: float32, float16 or bfloat16 (ml_dtypes), shape [..., D], any strides (read in
    place: no copy of x is made; a torch / DLPack / buffer-protocol CPU array too). fmt: a format name or Format; q8_0, q4_0, q4_1 and q4_1ch need D % 32 == 0.
    q4_1ch encodes groups: x [..., 32, D] is groups of 32 positions of one head each
    (x[..., t, c]: position t, channel c), every channel's 32 values one q4_1 block;
    codes [..., 32, D/2] and scales [..., 32, D/16] are the group's bytes as they lie in
    its 32 row slots (docs/formats.md, q4_1ch).
    Returns (codes, scales), both new C-contiguous arrays:
      codes [..., W] of view_dtype(fmt), W = fmt.code_width(D) (D, or D/2 for q4_0 and
        q4_1: uint8, two values per byte): int8, uint8, float16, float32, or ml_dtypes
        bfloat16 / float8_e4m3fn / float8_e5m2 (uint16 / uint8 without ml_dtypes);
      scales [..., S], S = fmt.scales_per_row(D): float32 (S = 1) for int8 and fp8,
        float16 (S = D/32) for q8_0 and q4_0, float16 (d, m) pairs (S = 2*D/32) for
        q4_1; None for f32, f16 and bf16.
    out: (codes, scales) to write instead, of those shapes and dtypes (codes in the raw
    or the view dtype), C-contiguous, writable; returned as given. A refused call
    leaves them untouched (x is checked in a first pass).
    Raises NonFiniteError for NaN/inf (naming the first bad index), FormatError for a
    value past the format's range (f16 |x| >= 65520, bf16 |x| >= 0x1.ffp127: they would
    round to infinity; q8_0 |x| >= Q8_0_LIMIT, q4_0 Q4_0_LIMIT, q4_1 and q4_1ch Q4_1_LIMIT),
    ShapeError / DTypeError for bad arrays.
    """
    f = get_format(fmt)
    x = check_ndarray("x", x)
    check_dtype("x", x, float_input_dtypes())
    if x.ndim == 0:
        raise ShapeError("invalid shape of x: expected [..., D], got []")
    d = x.shape[-1]
    f.check_head_dim(d)
    _check_group("x", x.shape, f)
    lead = x.shape[:-1]
    code_shape, scale_shape = lead + (f.code_width(d),), lead + (f.scales_per_row(d),)
    result: tuple[np.ndarray, np.ndarray | None] | _QuantOut
    if out is None:
        codes = np.empty(code_shape, dtype=f.code_dtype)
        scales = None if f.scale_dtype is None else np.empty(scale_shape, dtype=f.scale_dtype)
        result = (codes.view(view_dtype(f)), scales)
    else:
        codes, scales = _check_quantize_out(out, f, code_shape, scale_shape)
        result = out
        if any(a is not None and np.shares_memory(x, a) for a in (codes, scales)):
            raise ShapeError("out overlaps x")
        codes = codes.view(f.code_dtype)
    rows = x
    if f.group:   # the kernel's rows are the channels of each group: [..., D, group]
        rows = np.swapaxes(x, -1, -2)
        codes, scales = _channel_major(codes, d), _channel_major(cast(np.ndarray, scales), d)
    walk = (rows, *_row_walk(rows), rows.strides[-1], _input_kind(x), f.id, codes, scales,
            rows.shape[-1])
    bad = _quant.quantize_rows(*walk, encode=out is None)
    if not bad and out is not None:
        bad = _quant.quantize_rows(*walk)
    if bad:
        check_values("x", x, f)
        raise AssertionError(f"quantize refused {bad} rows that hold no refused value")
    return result


def _check_group(name: str, shape: tuple[int, ...], f: Format) -> None:
    """ShapeError unless a grouped format's array (q4_1ch) is [..., group, D or W]."""
    if f.group and (len(shape) < 2 or shape[-2] != f.group):
        got = ", ".join(map(str, shape))
        raise ShapeError(f"invalid shape of {name}: format {f.name} encodes groups of "
                         f"{f.group} positions, expected [..., {f.group}, {shape[-1]}], got [{got}]")


def _channel_major(a: np.ndarray, d: int) -> np.ndarray:
    """A grouped format's codes [..., group, W] or scales [..., group, S], C-contiguous,
    as the channel rows they hold: [..., D, group / 2] or [..., D, 2] (the same bytes,
    docs/formats.md, q4_1ch)."""
    return a.reshape(a.shape[:-2] + (d, -1))


def _check_quantize_out(out: object, f: Format, code_shape: tuple[int, ...],
                        scale_shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray | None]:
    if not isinstance(out, tuple) or len(out) != 2:
        raise DTypeError(f"invalid type of out: expected a (codes, scales) tuple, "
                         f"got {type(out).__name__}")
    codes = check_out("out codes", out[0], code_shape,
                      list(dict.fromkeys([f.code_dtype, view_dtype(f)])))
    scales = None
    if f.scale_dtype is not None:
        scales = check_out("out scales", out[1], scale_shape, [f.scale_dtype])
    elif out[1] is not None:
        raise FormatError(f"format {f.name} has no scales: expected out scales None, "
                          f"got {type(out[1]).__name__}")
    if scales is not None and np.shares_memory(codes, scales):
        raise ShapeError("out codes and scales overlap")
    return codes, scales


def dequantize(codes: AnyArray, scales: AnyArray | None, fmt: "str | Format", *,
               out: OutArray | None = None) -> np.ndarray | OutArray:
    """Decodes codes and scales back to float32.

    codes: shape [..., W], fmt's code dtype (raw or its ml_dtypes view dtype); W = D, or
    D/2 for q4_0 / q4_1 (two values per byte, D = 2 W).
    scales: shape [..., S] of fmt's scale dtype for int8/fp8/q8_0/q4_0/q4_1, None for
    f32/f16/bf16.
    q4_1ch: codes [..., 32, D/2] and scales [..., 32, D/16], groups as quantize gives them.
    Non-contiguous codes or scales are first copied to C order (one copy each).
    Returns float32 [..., D] (a new array, or out: float32 of that shape, C-contiguous,
    writable): code * scale for int8/fp8, code * float32(d) per 32-value block for q8_0,
    d * (q - 8) for q4_0, d * q + m for q4_1, the value itself for the float formats.
    """
    f = get_format(fmt)
    c = check_ndarray("codes", codes)
    check_dtype("codes", c, list(dict.fromkeys([f.code_dtype, view_dtype(f)])))
    if c.ndim == 0:
        raise ShapeError("invalid shape of codes: expected [..., D], got []")
    d = c.shape[-1] * f.pack
    f.check_head_dim(d)
    _check_group("codes", c.shape, f)
    lead = c.shape[:-1]
    s = None
    if f.scale_dtype is not None:
        s = check_ndarray("scales", scales)
        check_dtype("scales", s, [f.scale_dtype])
        check_shape("scales", s, lead + (f.scales_per_row(d),))
        s = np.ascontiguousarray(s)
    elif scales is not None:
        raise FormatError(f"format {f.name} has no scales: expected scales=None, "
                          f"got {type(scales).__name__}")
    if out is None:
        arr = np.empty(lead + (d,), dtype=np.float32)
    else:
        arr = check_out("out", out, lead + (d,), [np.float32])
        if np.shares_memory(arr, c) or (s is not None and np.shares_memory(arr, s)):
            raise ShapeError("out overlaps codes or scales")
    c = np.ascontiguousarray(c).view(f.code_dtype)
    if f.group:   # decoded channel by channel, [..., D, group], then laid out by position
        channels = np.empty(lead[:-1] + (d, f.group), np.float32)
        _quant.dequantize_rows(f.id, _channel_major(c, d), _channel_major(cast(np.ndarray, s), d),
                               channels.reshape(-1, f.group))
        arr[...] = np.swapaxes(channels, -1, -2)
    else:
        _quant.dequantize_rows(f.id, c, s, arr.reshape(math.prod(lead), d))
    return arr if out is None else out
