"""KVSpec: the shape and format of a KV cache, validated once, up front."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

from .errors import FormatError, SpecError
from .formats import FORMATS, Format, get_format, get_pair, pair_name

# Byte counts past this do not fit a Py_ssize_t / a device size_t; refuse them early.
MAX_BYTES = 2**63 - 1


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        try:
            import numpy as np
            if isinstance(value, np.integer):
                value = int(value)
            else:
                raise TypeError
        except TypeError:
            raise SpecError(f"{name} must be an int, got {type(value).__name__}") from None
    if value <= 0:
        raise SpecError(f"{name} must be positive, got {value}")
    return value


def resolve_formats(format: "str | Format | None", k_format: "str | Format | None" = None,
                    v_format: "str | Format | None" = None) -> tuple[Format, Format]:
    """(K format, V format) of KVSpec's arguments: format for both (a name, a Format or a
    pair name "<k>/<v>"; None: "f16"), k_format / v_format for one side each (a side not
    given takes format's). FormatError for an unknown name (naming the side), SpecError
    when format and a side given disagree."""
    both = get_pair("f16" if format is None else format)
    sides = []
    for i, (which, given) in enumerate((("k", k_format), ("v", v_format))):
        if given is None:
            sides.append(both[i])
            continue
        try:
            fmt = get_format(given)
        except FormatError as e:
            raise FormatError(f"{which}_format: {e}") from None
        if format is not None and fmt is not both[i]:
            raise SpecError(
                f"format={format!r} stores {which.upper()} as {both[i].name}, but "
                f"{which}_format={fmt.name!r}: give format= alone (both K and V) or "
                f"k_format= and v_format=")
        sides.append(fmt)
    return sides[0], sides[1]


@dataclass(frozen=True)
class KVSpec:
    """Shape and storage format of a KV cache.

    num_layers L, num_kv_heads Hkv, head_dim D, capacity N (positions per sequence),
    num_heads Hq (query heads; defaults to Hkv; GQA needs Hq % Hkv == 0), and the storage
    formats (names from kvcore.FORMATS): `format` for both K and V (default "f16"), or
    `k_format` / `v_format` for each side (llama.cpp's -ctk / -ctv: K q8_0 with V q4_0 is
    KVSpec(..., k_format="q8_0", v_format="q4_0")); a side not given takes `format`
    (default "f16"). `format` given with a side that disagrees is a SpecError.

    Once built, `k_format` and `v_format` are names, and `format` is the one name when
    they are the same, else the pair's name "<k>/<v>" (e.g. "q8_0/q4_0"; format= takes
    such a name too). `fmt` is the Format of both and raises FormatError when they differ;
    `k_fmt` / `v_fmt` are each side's (docs/formats.md, "K/V pairs").
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    capacity: int
    num_heads: int | None = None
    # None when not given; names (str) once built
    format: str = None        # type: ignore[assignment]
    k_format: str = None      # type: ignore[assignment]
    v_format: str = None      # type: ignore[assignment]

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "capacity"):
            object.__setattr__(self, name, _positive_int(name, getattr(self, name)))
        hq = self.num_kv_heads if self.num_heads is None else _positive_int("num_heads", self.num_heads)
        if hq % self.num_kv_heads:
            raise SpecError(
                f"num_heads must be a multiple of num_kv_heads (GQA), got num_heads={hq}, "
                f"num_kv_heads={self.num_kv_heads}")
        object.__setattr__(self, "num_heads", hq)
        k, v = resolve_formats(self.format, self.k_format, self.v_format)
        object.__setattr__(self, "k_format", k.name)
        object.__setattr__(self, "v_format", v.name)
        object.__setattr__(self, "format", pair_name(k, v))
        if v.group:
            raise FormatError(
                f"V format {v.name} stores values by channel over groups of {v.group} "
                f"positions, a K layout (KIVI's): V is stored per token, e.g. "
                f"KVSpec(k_format={v.name!r}, v_format='q4_1')")
        for which, fmt in (("K", k), ("V", v)) if k is not v else (("", k),):
            try:
                fmt.check_head_dim(self.head_dim)
            except FormatError as e:
                raise FormatError(f"{which} {e}" if which else str(e)) from None
        if self.memory_bytes > MAX_BYTES:
            raise SpecError(
                f"cache of {self.memory_bytes} bytes overflows a 64-bit size "
                f"(capacity={self.capacity}, bytes_per_position={self.bytes_per_position})")

    def __setstate__(self, state: dict[str, Any]) -> None:
        """pickle: a spec pickled before K/V pairs (no k_format / v_format) holds one
        format for both."""
        if "k_format" not in state:
            state = dict(state, k_format=state["format"], v_format=state["format"])
        self.__dict__.update(state)

    @property
    def fmt(self) -> Format:
        """The Format of K and V; FormatError when they differ (use k_fmt / v_fmt)."""
        if self.k_format != self.v_format:
            raise FormatError(
                f"this spec stores K as {self.k_format} and V as {self.v_format}: spec.fmt "
                f"names one format for both; use spec.k_fmt / spec.v_fmt")
        return FORMATS[self.k_format]

    @property
    def k_fmt(self) -> Format:
        """The Format of the K rows."""
        return FORMATS[self.k_format]

    @property
    def v_fmt(self) -> Format:
        """The Format of the V rows."""
        return FORMATS[self.v_format]

    @property
    def fmts(self) -> tuple[Format, Format]:
        """(K format, V format)."""
        return self.k_fmt, self.v_fmt

    @property
    def paired(self) -> bool:
        """True when K and V are stored in different formats."""
        return self.k_format != self.v_format

    @property
    def group_size(self) -> int:
        """Query heads per K/V head (GQA ratio)."""
        return cast(int, self.num_heads) // self.num_kv_heads   # an int once built

    @property
    def rows_per_position(self) -> int:
        """Head rows per position across the whole cache: L layers x Hkv heads x {K, V}."""
        return 2 * self.num_layers * self.num_kv_heads

    @property
    def bytes_per_position(self) -> int:
        """Bytes one position takes across all layers, K and V, codes and scales."""
        D = self.head_dim
        return self.num_layers * self.num_kv_heads * (self.k_fmt.row_bytes(D)
                                                      + self.v_fmt.row_bytes(D))

    @property
    def memory_bytes(self) -> int:
        """Exact bytes of one sequence's cache (what KVCache allocates)."""
        return self.capacity * self.bytes_per_position

    @property
    def fp32_equivalent_bytes(self) -> int:
        """Bytes the same cache would take in float32."""
        return self.capacity * self.rows_per_position * self.head_dim * 4

    @property
    def compression_ratio(self) -> float:
        return self.fp32_equivalent_bytes / self.memory_bytes

    def replace(self, **changes: Any) -> "KVSpec":
        """A copy with some fields changed (validated again). format= changes both K
        and V; k_format= / v_format= change one side and keep the other."""
        fields: dict[str, Any] = dict(num_layers=self.num_layers, num_kv_heads=self.num_kv_heads,
                      head_dim=self.head_dim, capacity=self.capacity,
                      num_heads=self.num_heads, format=self.format)
        if ("k_format" in changes or "v_format" in changes) and "format" not in changes:
            fields.update(format=None, k_format=self.k_format, v_format=self.v_format)
        fields.update(changes)
        return KVSpec(**fields)
