"""Snapshots: a compact copy of a cache's first n positions (codes and scales, no
capacity padding) plus the spec, shared by the CPU and the GPU caches."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import SnapshotError
from .spec import KVSpec


@dataclass(frozen=True, eq=False)
class Snapshot:
    """Positions [0, length) of every layer of a cache.

    k_codes, v_codes: [L, length, Hkv, D], the format's code dtype, C-contiguous.
    k_scales, v_scales: [L, length, Hkv, S], the format's scale dtype; None when the
    format has no scales (S = 0).
    """

    spec: KVSpec
    length: int
    k_codes: np.ndarray
    v_codes: np.ndarray
    k_scales: np.ndarray | None = None
    v_scales: np.ndarray | None = None

    def __post_init__(self):
        s, f = self.spec, self.spec.fmt
        if not 0 <= self.length <= s.capacity:
            raise SnapshotError(
                f"snapshot length {self.length} out of range: expected 0 <= length <= {s.capacity}")
        code_shape = (s.num_layers, self.length, s.num_kv_heads, s.head_dim)
        scale_shape = (s.num_layers, self.length, s.num_kv_heads, f.scales_per_row(s.head_dim))
        for name in ("k_codes", "v_codes"):
            _check_part(name, getattr(self, name), code_shape, f.code_dtype)
        for name in ("k_scales", "v_scales"):
            arr = getattr(self, name)
            if f.quantized:
                _check_part(name, arr, scale_shape, f.scale_dtype)
            elif arr is not None:
                raise SnapshotError(f"snapshot of format {f.name} has no scales, got {name}")

    @property
    def nbytes(self) -> int:
        """Bytes of codes and scales held."""
        return sum(a.nbytes for a in (self.k_codes, self.v_codes, self.k_scales, self.v_scales)
                   if a is not None)


def _check_part(name: str, arr, shape, dtype) -> None:
    if not isinstance(arr, np.ndarray):
        raise SnapshotError(f"snapshot {name} must be a numpy array, got {type(arr).__name__}")
    if arr.shape != shape or arr.dtype != dtype:
        raise SnapshotError(f"snapshot {name}: expected {list(shape)} {dtype}, "
                            f"got {list(arr.shape)} {arr.dtype}")
    if not arr.flags.c_contiguous:
        raise SnapshotError(f"snapshot {name} must be C-contiguous")
