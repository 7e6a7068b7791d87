"""KVSpec: the shape and format of a KV cache, validated once, up front."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

from .errors import SpecError
from .formats import Format, get_format

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


@dataclass(frozen=True)
class KVSpec:
    """Shape and storage format of a KV cache.

    num_layers L, num_kv_heads Hkv, head_dim D, capacity N (positions per sequence),
    num_heads Hq (query heads; defaults to Hkv; GQA needs Hq % Hkv == 0), format (a
    name from kvcore.FORMATS).
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    capacity: int
    num_heads: int | None = None
    format: str = "f16"

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "capacity"):
            object.__setattr__(self, name, _positive_int(name, getattr(self, name)))
        hq = self.num_kv_heads if self.num_heads is None else _positive_int("num_heads", self.num_heads)
        if hq % self.num_kv_heads:
            raise SpecError(
                f"num_heads must be a multiple of num_kv_heads (GQA), got num_heads={hq}, "
                f"num_kv_heads={self.num_kv_heads}")
        object.__setattr__(self, "num_heads", hq)
        fmt = get_format(self.format)
        object.__setattr__(self, "format", fmt.name)
        fmt.check_head_dim(self.head_dim)
        if self.memory_bytes > MAX_BYTES:
            raise SpecError(
                f"cache of {self.memory_bytes} bytes overflows a 64-bit size "
                f"(capacity={self.capacity}, bytes_per_position={self.bytes_per_position})")

    @property
    def fmt(self) -> Format:
        return get_format(self.format)

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
        return self.rows_per_position * self.fmt.row_bytes(self.head_dim)

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
        """A copy with some fields changed (validated again)."""
        fields: dict[str, Any] = dict(num_layers=self.num_layers, num_kv_heads=self.num_kv_heads,
                      head_dim=self.head_dim, capacity=self.capacity,
                      num_heads=self.num_heads, format=self.format)
        fields.update(changes)
        return KVSpec(**fields)
