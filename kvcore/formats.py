"""The format table: how each storage format lays out one head row of D values.

A row (one position of one head, D values) is stored as D codes plus zero or more
scales, in two separate regions so that either can be viewed without a copy:

| name     | id | code dtype    | scales per row | scale dtype | rule |
|----------|----|---------------|----------------|-------------|------|
| f32      | 0  | float32       | 0              | -           | as is |
| f16      | 1  | float16       | 0              | -           | IEEE binary16, round to nearest even |
| bf16     | 2  | uint16 (bits) | 0              | -           | bfloat16, round to nearest even |
| int8     | 3  | int8          | 1              | float32     | s = max|x|/127, q = rne(x/s) in [-127, 127] |
| fp8_e4m3 | 4  | uint8 (bits)  | 1              | float32     | s = max|x|/448, OCP E4M3FN of x/s, RNE, saturating |
| fp8_e5m2 | 5  | uint8 (bits)  | 1              | float32     | s = max|x|/57344, OCP E5M2 of x/s, RNE, saturating |
| q8_0     | 6  | int8          | D/32           | float16     | ggml block of 32: d = max|x|/127, q = round-half-away(x/d) |
| q4_0     | 7  | uint8, 2/byte | D/32           | float16     | ggml block of 32: d = max/-8, q = trunc(x/d + 8.5) in [0, 15] |
| q4_1     | 8  | uint8, 2/byte | 2*D/32 (d, m)  | float16     | ggml block of 32: d = (max-min)/15, m = min, q = trunc((x-m)/d + 0.5) |
| q4_1ch   | 9  | uint8, 2/byte | 2*D/32 (d, m)  | float16     | q4_1 by channel: each channel's 32 values over a group of 32 positions (K only) |

The 4-bit formats pack two values per code byte (`pack` = 2): a row has
`code_width(D)` = D/2 codes. Byte j of block b holds value 32b + j in its low nibble and
value 32b + 16 + j in its high nibble (ggml's order).

`q4_1ch` (KIVI's key layout) is the one format whose rows are not encoded alone: it
applies q4_1's rule to each channel of a group of `group` = 32 consecutive positions of
one head (a block is one channel's 32 values along positions), and lays the group's bytes
out over its 32 row slots, so a row still has q4_1's W codes and S scales
(docs/formats.md, "q4_1ch"). It stores K only (V stays per token).

The numeric ids are shared with the Cython kernels and the CUDA kernels.
docs/formats.md gives the full byte layout.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import FormatError

F32, F16, BF16, INT8, FP8_E4M3, FP8_E5M2, Q8_0, Q4_0, Q4_1, Q4_1CH = range(10)
Q8_0_BLOCK = 32
QK = 32  # values per block of the ggml formats (q8_0, q4_0, q4_1)


@dataclass(frozen=True)
class Format:
    """One storage format. `code_dtype` is the numpy dtype of the stored codes; a code
    element holds `pack` values (2 for the 4-bit formats, 1 otherwise)."""

    name: str
    id: int
    code_dtype: np.dtype
    scale_dtype: np.dtype | None
    block: int  # values per block of scales; 0: one scale per row (or no scales)
    pack: int = 1  # values per code element
    block_scales: int = 1  # scales per block (q4_1: d and m)
    group: int = 0  # positions encoded together, per channel (q4_1ch: 32); 0: rows alone

    @property
    def quantized(self) -> bool:
        return self.scale_dtype is not None

    @property
    def code_bytes(self) -> int:
        return self.code_dtype.itemsize

    def scales_per_row(self, head_dim: int) -> int:
        """Scales per head row: 0 for float formats, 1 per row, D/32 for q8_0 and q4_0,
        2*D/32 for q4_1 ((d, m) per block)."""
        if self.scale_dtype is None:
            return 0
        return 1 if self.block == 0 else self.block_scales * (head_dim // self.block)

    def code_width(self, head_dim: int) -> int:
        """Code elements per head row: D, or D/2 for the 4-bit formats (two per byte)."""
        return head_dim // self.pack

    def code_row_bytes(self, head_dim: int) -> int:
        return self.code_width(head_dim) * self.code_bytes

    def scale_row_bytes(self, head_dim: int) -> int:
        if self.scale_dtype is None:
            return 0
        return self.scales_per_row(head_dim) * self.scale_dtype.itemsize

    def row_bytes(self, head_dim: int) -> int:
        """Bytes of one head row: codes plus scales."""
        return self.code_row_bytes(head_dim) + self.scale_row_bytes(head_dim)

    def check_head_dim(self, head_dim: int) -> None:
        if self.block and head_dim % self.block:
            raise FormatError(
                f"format {self.name} needs head_dim divisible by {self.block}, got {head_dim}")


_f32 = np.dtype(np.float32)
_f16 = np.dtype(np.float16)

FORMATS: dict[str, Format] = {
    f.name: f
    for f in (
        Format("f32", F32, _f32, None, 0),
        Format("f16", F16, _f16, None, 0),
        Format("bf16", BF16, np.dtype(np.uint16), None, 0),
        Format("int8", INT8, np.dtype(np.int8), _f32, 0),
        Format("fp8_e4m3", FP8_E4M3, np.dtype(np.uint8), _f32, 0),
        Format("fp8_e5m2", FP8_E5M2, np.dtype(np.uint8), _f32, 0),
        Format("q8_0", Q8_0, np.dtype(np.int8), _f16, QK),
        Format("q4_0", Q4_0, np.dtype(np.uint8), _f16, QK, pack=2),
        Format("q4_1", Q4_1, np.dtype(np.uint8), _f16, QK, pack=2, block_scales=2),
        Format("q4_1ch", Q4_1CH, np.dtype(np.uint8), _f16, QK, pack=2, block_scales=2,
               group=QK),
    )
}

QUANTIZED_FORMATS = tuple(n for n, f in FORMATS.items() if f.quantized)
ROW_FORMATS = tuple(n for n, f in FORMATS.items() if not f.group)
"""The formats that encode each row alone: they store K and V (q4_1ch stores K only)."""


def get_format(fmt: "str | Format") -> Format:
    """The format of kvcore.FORMATS a name or a Format stands for: a Format object must
    equal a table entry in every field, and the table's own instance is returned (the
    kernels trust its fields). Raises FormatError naming the known ones otherwise."""
    if isinstance(fmt, Format):
        known = FORMATS.get(fmt.name) if isinstance(fmt.name, str) else None
        if known is None or _fields(fmt) != _fields(known):
            raise FormatError(f"{fmt!r} is not a format of kvcore.FORMATS: expected one of "
                              f"{', '.join(FORMATS)} with the table's fields")
        return known
    try:
        return FORMATS[fmt]
    except (KeyError, TypeError):
        pass
    if isinstance(fmt, str) and PAIR_SEP in fmt:
        raise FormatError(f"{fmt!r} names a K/V pair, not one format: expected one of "
                          f"{', '.join(FORMATS)} here (a pair is KVSpec(k_format=, v_format=))")
    raise FormatError(f"unknown format {fmt!r}: expected one of {', '.join(FORMATS)}")


PAIR_SEP = "/"
"""K and V in different formats: the pair's name is "<K format>/<V format>" (e.g.
"q8_0/q4_0"), what `KVSpec.format` holds when they differ (docs/formats.md, "K/V pairs")."""


def pair_name(k: "str | Format", v: "str | Format") -> str:
    """The name of a K/V format pair: the format's name when both are the same, else
    "<k>/<v>" (e.g. "q8_0/q4_0")."""
    kn, vn = get_format(k).name, get_format(v).name
    return kn if kn == vn else f"{kn}{PAIR_SEP}{vn}"


def get_pair(fmt: "str | Format") -> tuple[Format, Format]:
    """(K format, V format) of a format name (both the same), a Format, or a pair name
    "<k>/<v>"; FormatError naming the side and the known formats otherwise."""
    if isinstance(fmt, str) and PAIR_SEP in fmt:
        parts = fmt.split(PAIR_SEP)
        if len(parts) != 2:
            raise FormatError(f"unknown format pair {fmt!r}: expected '<K format>/<V format>', "
                              f"each one of {', '.join(FORMATS)}")
        return _side("K", parts[0]), _side("V", parts[1])
    f = get_format(fmt)
    return f, f


def describe(name: str) -> str:
    """A format's name for messages: a pair's says each side ("q8_0/q4_0 (K q8_0, V
    q4_0)"), a single format's is its name."""
    k, sep, v = name.partition(PAIR_SEP)
    return f"{name} (K {k}, V {v})" if sep else name


def _side(which: str, fmt: object) -> Format:
    try:
        return get_format(fmt)  # type: ignore[arg-type]
    except FormatError as e:
        raise FormatError(f"{which} format: {e}") from None


def _fields(f: Format) -> tuple[object, ...]:
    """Every field of f, compared with exact types (a dtype-like object that claims
    equality with anything does not pass)."""
    return tuple((type(v), v.str if isinstance(v, np.dtype) else v)
                 for v in (f.name, f.id, f.code_dtype, f.scale_dtype, f.block, f.pack,
                           f.block_scales, f.group))


def view_dtype(fmt: "str | Format") -> np.dtype:
    """The dtype a caller sees codes as: ml_dtypes bfloat16 / float8 when ml_dtypes is
    installed, else the raw storage dtype (uint16 / uint8)."""
    f = get_format(fmt)
    extra = {"bf16": "bfloat16", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
    if f.name in extra:
        try:
            import ml_dtypes
        except ImportError:
            return f.code_dtype
        dtype: np.dtype = np.dtype(getattr(ml_dtypes, extra[f.name]))
        return dtype
    return f.code_dtype
