"""KVCache: the CPU key/value cache of one sequence.

Storage is one allocation of `spec.memory_bytes` bytes of regions and gaps under 4 KiB
between them (`_storage.Storage` with rows = capacity: the one-sequence case of a KVPool's
pages, one page of N rows in order):

    [K scales] gap [V scales] gap [K codes] gap [V codes]
    codes:  [L][N][Hkv][D]  the format's code dtype  (token-major: a step is one block)
    scales: [L][N][Hkv][S]  the format's scale dtype (no scale regions when S = 0)

`_Cells` keeps the bookkeeping (committed length, pending positions per layer) apart
from the storage; the checked writes are `_cache.RowWriter`'s. copy.deepcopy and pickle
copy the storage and the positions and rebuild the rest (docs/design.md, Copies).
"""
from __future__ import annotations

import copy
import operator
from typing import Any

import numpy as np

from . import _cache
from ._groups import KeyGroups
from ._guard import CallGuard
from ._pages import _count_groups, pending_hint
from ._storage import Storage as _Storage
from ._storage import LayerArrays
from ._validate import AnyArray, OutArray, check_index, check_out
from .errors import CapacityError, OutOfRangeError, ShapeError, SpecError, StateError
from .snapshot import Snapshot, restore_snapshot, take_snapshot
from .spec import KVSpec


class _Cells:
    """Positions of one cache, no storage: `length` committed positions (the same in
    every layer) and, per layer, `pending` positions appended after them since the last
    advance."""

    __slots__ = ("length", "pending")

    def __init__(self, num_layers: int):
        self.length = 0
        self.pending = [0] * num_layers

    def end(self, layer: int) -> int:
        """The position the layer's next append writes first."""
        return self.length + self.pending[layer]

    def commit(self) -> int:
        """Commits the pending positions when every layer holds the same number; returns
        it (0 when nothing is pending: a no-op)."""
        pending = self.pending
        t = pending[0]
        if pending.count(t) != len(pending):
            raise StateError("advance needs the same number of pending positions in every "
                             f"layer: {_count_groups(pending)}")
        self.length += t
        self.pending = [0] * len(pending)
        return t

    def truncate(self, n: int) -> None:
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
            check_index("n", n, self.length + 1)  # raises the type error
        if not 0 <= n <= self.length:
            raise OutOfRangeError(f"truncate to {n} out of range: expected 0 <= n <= "
                                  f"length {self.length}")
        self.length = int(n)
        self.pending = [0] * len(self.pending)


class KVCache:
    """The key/value cache of one sequence on the CPU, in any format of kvcore.FORMATS.

    Positions are appended per layer (`append`, pending) and committed for every layer at
    once (`advance`). Views are read-only and zero-copy; `dequantize` is the explicit copy.
    One call at a time: a call that finds another thread inside the cache raises
    StateError and changes nothing (docs/design.md, Threads).
    A K q4_1ch cache (K by channel over groups of 32 positions) keeps the open group's K
    in a float16 residual until the group completes (docs/formats.md, q4_1ch): `keys`
    and `key_scales` are its raw row slots, `dequantize(layer, "k")` its values.
    """

    def __init__(self, spec: KVSpec):
        if not isinstance(spec, KVSpec):
            raise SpecError(f"KVCache needs a KVSpec, got {type(spec).__name__}")
        self._attach(spec, _Storage(spec, spec.capacity))  # one page of `capacity` rows

    def _attach(self, spec: KVSpec, store: _Storage, length: int = 0,
                pending: list[int] | None = None, groups: KeyGroups | None = None) -> None:
        """Sets every attribute: the storage, what is derived from it (views, writer),
        the positions, a grouped K format's residual (_groups.py; groups: a copy's, or
        None for a new one) and a fresh guard (also after a copy: nothing derived is
        copied)."""
        self._spec = spec
        self._groups = groups if groups is not None or not spec.k_fmt.group else KeyGroups(spec)
        self._store = store
        self._storage = store.array
        self._regions = store.regions
        self._writer = store.writer
        self._read_only = store.read_only
        self._num_layers = spec.num_layers
        self._cells = _Cells(spec.num_layers)
        self._cells.length = length
        if pending is not None:
            self._cells.pending = pending
        self._guard = CallGuard("KVCache")   # one call at a time (docs/design.md, Threads)

    # -- copies --------------------------------------------------------------------

    def __deepcopy__(self, memo: dict[int, Any]) -> KVCache:
        """An independent cache holding the same bytes and positions (pending ones too):
        its storage is a copy on fresh pages. StateError while another thread is inside."""
        return self._copy("deepcopy", memo)

    def __copy__(self) -> KVCache:
        """As copy.deepcopy: two caches never share storage."""
        return self._copy("copy", {})

    def _copy(self, op: str, memo: dict[int, Any]) -> KVCache:
        with self._guard(op):
            new = type(self).__new__(type(self))
            memo[id(self)] = new
            cells = self._cells
            new._attach(self._spec, copy.deepcopy(self._store, memo), cells.length,
                        list(cells.pending), self._groups_copy())
            return new

    def __getstate__(self) -> dict[str, Any]:
        """pickle: the spec, the storage (its bytes: one buffer with protocol 5) and the
        positions. StateError while another thread is inside; the bytes are read as the
        pickler writes them, so no other thread may write the cache until dumps returns."""
        with self._guard("pickle"):
            cells = self._cells
            return {"spec": self._spec, "storage": self._store, "length": cells.length,
                    "pending": list(cells.pending), "groups": self._groups_copy()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._attach(state["spec"], state["storage"], state["length"], state["pending"],
                     state.get("groups"))

    def _groups_copy(self) -> KeyGroups | None:
        """A copy of the grouped K format's residual (None without one)."""
        return None if self._groups is None else self._groups.copy()

    def _k_regions(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """K codes [N, Hkv, W] and scales [N, Hkv, S] of one layer (a grouped K format's:
        it has scales), writable."""
        return self._regions["k_codes"][layer], self._regions["k_scales"][layer]

    # -- writing -------------------------------------------------------------------

    def append(self, layer: int, k: AnyArray, v: AnyArray) -> None:
        """Encodes T positions of one layer after its held ones; they stay pending (seen
        only with `pending=True`) until `advance()`.

        k, v: float32, float16 or bfloat16 (ml_dtypes; or a torch / DLPack / buffer-protocol
        CPU array, read in place), shape [T, Hkv, D] or [Hkv, D] (T = 1), any strides; the same shape (dtypes may differ). Atomic: a refused call
        (ShapeError, DTypeError, NonFiniteError, CapacityError, OutOfRangeError, and
        FormatError for a value past the format's range: f16 |x| >= 65520, bf16 past
        its largest finite value, q8_0 |x| >= Q8_0_LIMIT) writes nothing. A CapacityError
        while positions of the layer are pending says how many (call advance() after
        each step's appends).
        """
        guard = self._guard   # the hot path of a decode step: the guard inlined (_guard.py)
        if not guard.acquire(False):
            guard.refuse("append")
        try:
            if layer.__class__ is not int or not 0 <= layer < self._num_layers:
                layer = check_index("layer", layer, self._num_layers)
            # _Cells.end / _Cells.add written out inline
            cells = self._cells
            pending = cells.pending
            pos = cells.length + pending[layer]
            pending[layer] += self._writer.write(layer, pos, k, v)
            if self._groups is not None:    # K by channel: its groups (_groups.py)
                self._groups.write(layer, pos, k, *self._k_regions(layer), operator.index)
        except CapacityError as e:
            if not pending[layer]:
                raise
            raise CapacityError(f"{e}{pending_hint(layer, [(None, pending[layer])])}") from None
        finally:
            guard.release()

    def advance(self) -> int:
        """Commits the pending positions of every layer and returns how many. Every layer
        must hold the same number (StateError names the layers that differ); with none
        pending anywhere it is a no-op that returns 0."""
        guard = self._guard   # once per decode step: inlined as in append
        if not guard.acquire(False):
            guard.refuse("advance")
        try:
            return self._cells.commit()
        finally:
            guard.release()

    def truncate(self, n: int) -> None:
        """Keeps the first n committed positions (0 <= n <= length) and drops every pending
        one. Storage is not cleared: positions past n are simply no longer held."""
        with self._guard("truncate"):
            cells = self._cells
            cells.truncate(n)
            if self._groups is not None:
                for layer in range(self._num_layers):
                    self._groups.truncate(layer, cells.length, *self._k_regions(layer),
                                          operator.index)

    def reset(self) -> None:
        """Empties the cache (length 0, nothing pending), like truncate(0)."""
        with self._guard("reset"):
            self._cells.truncate(0)

    # -- snapshots -----------------------------------------------------------------

    def snapshot(self, n: int | None = None) -> Snapshot:
        """A compact copy of committed positions [0, n) of every layer (n defaults to
        `length`; pending positions are never included): codes [L, n, Hkv, D] and scales
        [L, n, Hkv, S] plus the spec (docs/snapshots.md). OutOfRangeError unless
        0 <= n <= length."""
        with self._guard("snapshot"):
            return take_snapshot(self, n)

    def restore(self, snapshot: Snapshot, *, requantize: bool = False) -> None:
        """Replaces the content with a snapshot: positions [0, snapshot.length) of every
        layer, length = snapshot.length, nothing pending. Refuses (SnapshotError, cache
        untouched) another num_layers, num_kv_heads or head_dim, a snapshot longer than
        the capacity, values the format never stores, and another format unless
        requantize=True, which re-encodes it (e.g. an f16 snapshot into an int8 cache).
        A snapshot whose arrays lie in this cache's own storage is copied first."""
        with self._guard("restore"):
            restore_snapshot(self, snapshot, requantize=requantize)

    # -- state ---------------------------------------------------------------------

    @property
    def spec(self) -> KVSpec:
        return self._spec

    @property
    def length(self) -> int:
        """Committed positions, the same in every layer."""
        return self._cells.length

    def pending(self, layer: int) -> int:
        """Positions appended to `layer` since the last advance."""
        return self._cells.pending[check_index("layer", layer, self._num_layers)]

    # -- views ---------------------------------------------------------------------

    def _held(self, layer: int, pending: bool) -> tuple[int, int]:
        layer = check_index("layer", layer, self._num_layers)
        return layer, self._cells.end(layer) if pending else self._cells.length

    def _view(self, region: str, layer: int, pending: bool) -> np.ndarray:
        layer, n = self._held(layer, pending)
        return self._read_only[region][layer, :n]

    def keys(self, layer: int, *, pending: bool = False) -> np.ndarray:
        """K codes of the committed positions (and pending ones when asked): read-only,
        zero-copy, [n, Hkv, D] in the format's view dtype (formats.view_dtype)."""
        return self._view("k_codes", layer, pending)

    def values(self, layer: int, *, pending: bool = False) -> np.ndarray:
        """V codes, as `keys`."""
        return self._view("v_codes", layer, pending)

    def key_scales(self, layer: int, *, pending: bool = False) -> np.ndarray | None:
        """K scales [n, Hkv, S], read-only, zero-copy; None when the format has none."""
        return self._view("k_scales", layer, pending) if "k_scales" in self._regions else None

    def value_scales(self, layer: int, *, pending: bool = False) -> np.ndarray | None:
        """V scales, as `key_scales`."""
        return self._view("v_scales", layer, pending) if "v_scales" in self._regions else None

    def dequantize(self, layer: int, which: str, *, pending: bool = False,
                   out: OutArray | None = None) -> np.ndarray | OutArray:
        """K (which="k") or V ("v") of the held positions decoded: float32 [n, Hkv, D], a
        new array, or out (float32 of that shape, C-contiguous, writable)."""
        if which not in ("k", "v"):
            raise OutOfRangeError(f"which {which!r} out of range: expected 'k' or 'v'")
        with self._guard("dequantize"):
            layer, n = self._held(layer, pending)
            codes = self._regions[f"{which}_codes"][layer, :n]
            scales = self._regions.get(f"{which}_scales")
            shape = (n, self._spec.num_kv_heads, self._spec.head_dim)
            if out is None:
                arr = np.empty(shape, dtype=np.float32)
            else:
                arr = check_out("out", out, shape, [np.float32])
                self._check_outside("out", arr)
            if which == "k" and self._groups is not None:
                self._groups.dequantize(layer, [(0, n)], *self._k_regions(layer),
                                        operator.index, arr)
            else:
                _cache.decode_rows(self._spec.fmts[which == "v"].id, codes,
                                   None if scales is None else scales[layer, :n], arr)
        return arr if out is None else out

    def _check_outside(self, name: str, arr: np.ndarray) -> None:
        """Raises ShapeError when arr (an output array) overlaps the storage."""
        if np.shares_memory(arr, self._storage):
            raise ShapeError(f"{name} overlaps the cache's storage")

    def _layer_arrays(self, layer: int) -> LayerArrays:
        """(k_codes, v_codes, k_scales, v_scales) of one layer: writable full-capacity
        views, codes [N, Hkv, D] in the raw code dtype, scales [N, Hkv, S] or None.
        Positions [0, length + pending(layer)) are valid. Internal (docs/design.md)."""
        return self._store.layer_arrays(check_index("layer", layer, self._num_layers))

    # -- layout and memory ---------------------------------------------------------

    @property
    def layout(self) -> dict[str, dict[str, Any]]:
        """The storage, region by region in address order: byte offset, byte count,
        shape and dtype. Codes [L, N, Hkv, D], scales [L, N, Hkv, S] (token-major)."""
        return self._store.layout

    @property
    def strides(self) -> dict[str, tuple[int, ...]]:
        """Byte strides of each region over (layer, position, head, element)."""
        return self._store.strides

    @property
    def memory_bytes(self) -> int:
        """Bytes of the K/V regions, exactly spec.memory_bytes (the allocation adds
        gaps under 4 KiB between regions: docs/formats.md)."""
        return self._store.nbytes

    @property
    def fp32_equivalent_bytes(self) -> int:
        """Bytes the same cache would take in float32."""
        return self._spec.fp32_equivalent_bytes

    @property
    def compression_ratio(self) -> float:
        """fp32_equivalent_bytes / memory_bytes (int8 at D = 128: 512 / 132 = 3.88)."""
        return self._spec.compression_ratio

    def __repr__(self) -> str:
        s = self._spec
        return (f"KVCache(layers={s.num_layers}, kv_heads={s.num_kv_heads}, "
                f"head_dim={s.head_dim}, capacity={s.capacity}, format={s.format!r}, "
                f"length={self.length})")
