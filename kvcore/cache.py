"""KVCache: the CPU key/value cache of one sequence.

Storage is one allocation of exactly `spec.memory_bytes` bytes (fresh anonymous pages:
zero-filled, page-aligned, so every region is 64-byte aligned), in four regions:

    [K scales][V scales][K codes][V codes]
    codes:  [L][N][Hkv][D]  the format's code dtype  (token-major: a step is one block)
    scales: [L][N][Hkv][S]  the format's scale dtype (no scale regions when S = 0)

`_Cells` keeps the bookkeeping (committed length, pending positions per layer) apart
from the storage; the checked writes are `_cache.RowWriter`'s.
"""
from __future__ import annotations

import mmap
from math import prod

import numpy as np

from . import _cache
from ._guard import CallGuard
from ._validate import check_index, check_out
from .errors import OutOfRangeError, ShapeError, SpecError, StateError
from .formats import view_dtype
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


def _count_groups(counts: list[int]) -> str:
    """'layers 0-2 hold 1; layers 3-31 hold 0': layers grouped by their count."""
    groups: dict[int, list[int]] = {}
    for layer, c in enumerate(counts):
        groups.setdefault(c, []).append(layer)
    return "; ".join(f"layers {_ranges(ls)} hold {c}" if len(ls) > 1 else f"layer {ls[0]} holds {c}"
                     for c, ls in groups.items())


def _ranges(xs: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2, 5, 7-8' (xs sorted)."""
    out, start = [], xs[0]
    for a, b in zip(xs, xs[1:] + [None]):
        if b != a + 1:
            out.append(str(start) if start == a else f"{start}-{a}")
            start = b
    return ", ".join(out)


def _zeroed_pages(nbytes: int) -> np.ndarray:
    """uint8 [nbytes] on fresh anonymous pages: zero-filled, page-aligned, private to
    this process (copied on write across fork), returned to the OS when freed."""
    flags = {"flags": mmap.MAP_PRIVATE} if hasattr(mmap, "MAP_PRIVATE") else {}
    try:
        pages = mmap.mmap(-1, nbytes, **flags)
    except OSError as e:
        raise MemoryError(f"cannot allocate the cache's {nbytes} bytes: {e.strerror}") from e
    return np.frombuffer(pages, dtype=np.uint8)


class KVCache:
    """The key/value cache of one sequence on the CPU, in any format of kvcore.FORMATS.

    Positions are appended per layer (`append`, pending) and committed for every layer at
    once (`advance`). Views are read-only and zero-copy; `dequantize` is the explicit copy.
    One call at a time: a call that finds another thread inside the cache raises
    StateError and changes nothing (docs/design.md, Threads).
    """

    def __init__(self, spec: KVSpec):
        if not isinstance(spec, KVSpec):
            raise SpecError(f"KVCache needs a KVSpec, got {type(spec).__name__}")
        self._spec = spec
        fmt = spec.fmt
        L, N, H, D = spec.num_layers, spec.capacity, spec.num_kv_heads, spec.head_dim
        S = fmt.scales_per_row(D)
        regions = [("k_scales", (L, N, H, S), fmt.scale_dtype),
                   ("v_scales", (L, N, H, S), fmt.scale_dtype)] if S else []
        regions += [("k_codes", (L, N, H, D), fmt.code_dtype),
                    ("v_codes", (L, N, H, D), fmt.code_dtype)]
        self._storage = _zeroed_pages(spec.memory_bytes)
        self._regions: dict[str, np.ndarray] = {}
        self._offsets: dict[str, int] = {}
        offset = 0
        for name, shape, dtype in regions:
            nbytes = prod(shape) * dtype.itemsize
            self._regions[name] = self._storage[offset:offset + nbytes].view(dtype).reshape(shape)
            self._offsets[name] = offset
            offset += nbytes
        r = self._regions
        self._writer = _cache.RowWriter(fmt, r["k_codes"], r["v_codes"],
                                        r.get("k_scales"), r.get("v_scales"))
        # Views handed out come from an array over a read-only buffer of the same pages,
        # so that no view (nor any view of a view) can be made writable again.
        frozen = np.frombuffer(memoryview(self._storage).toreadonly(), np.uint8)
        self._read_only = {
            name: frozen[self._offsets[name]:self._offsets[name] + arr.nbytes]
            .view(view_dtype(fmt) if name.endswith("codes") else arr.dtype).reshape(arr.shape)
            for name, arr in r.items()}
        self._num_layers = L
        self._cells = _Cells(L)
        self._guard = CallGuard("KVCache")   # one call at a time (docs/design.md, Threads)

    # -- writing -------------------------------------------------------------------

    def append(self, layer: int, k: np.ndarray, v: np.ndarray) -> None:
        """Encodes T positions of one layer after its held ones; they stay pending (seen
        only with `pending=True`) until `advance()`.

        k, v: float32, float16 or ml_dtypes bfloat16, shape [T, Hkv, D] or [Hkv, D]
        (T = 1), any strides; the same shape (dtypes may differ). Atomic: a refused call
        (ShapeError, DTypeError, NonFiniteError, CapacityError, OutOfRangeError, and
        FormatError for a value past the format's range: f16 |x| >= 65520, bf16 past
        its largest finite value, q8_0 |x| >= Q8_0_LIMIT) writes nothing.
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
            pending[layer] += self._writer.write(layer, cells.length + pending[layer], k, v)
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
            self._cells.truncate(n)

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
                   out: np.ndarray | None = None) -> np.ndarray:
        """K (which="k") or V ("v") of the held positions decoded: float32 [n, Hkv, D], a
        new array, or out (float32 of that shape, C-contiguous, writable)."""
        if which not in ("k", "v"):
            raise OutOfRangeError(f"which {which!r} out of range: expected 'k' or 'v'")
        with self._guard("dequantize"):
            layer, n = self._held(layer, pending)
            codes = self._regions[f"{which}_codes"][layer, :n]
            scales = self._regions.get(f"{which}_scales")
            if out is None:
                out = np.empty(codes.shape, dtype=np.float32)
            else:
                check_out("out", out, codes.shape, [np.float32])
                self._check_outside("out", out)
            _cache.decode_rows(self._spec.fmt.id, codes,
                               None if scales is None else scales[layer, :n], out)
        return out

    def _check_outside(self, name: str, arr: np.ndarray) -> None:
        """Raises ShapeError when arr (an output array) overlaps the storage."""
        if np.shares_memory(arr, self._storage):
            raise ShapeError(f"{name} overlaps the cache's storage")

    def _layer_arrays(self, layer: int):
        """(k_codes, v_codes, k_scales, v_scales) of one layer: writable full-capacity
        views, codes [N, Hkv, D] in the raw code dtype, scales [N, Hkv, S] or None.
        Positions [0, length + pending(layer)) are valid. Internal (docs/design.md)."""
        layer = check_index("layer", layer, self._num_layers)
        r = self._regions
        return (r["k_codes"][layer], r["v_codes"][layer],
                r["k_scales"][layer] if "k_scales" in r else None,
                r["v_scales"][layer] if "v_scales" in r else None)

    # -- layout and memory ---------------------------------------------------------

    @property
    def layout(self) -> dict:
        """The storage, region by region in address order: byte offset, byte count,
        shape and dtype. Codes [L, N, Hkv, D], scales [L, N, Hkv, S] (token-major)."""
        return {name: {"offset": self._offsets[name], "nbytes": arr.nbytes,
                       "shape": arr.shape, "dtype": str(arr.dtype)}
                for name, arr in self._regions.items()}

    @property
    def strides(self) -> dict[str, tuple[int, ...]]:
        """Byte strides of each region over (layer, position, head, element)."""
        return {name: arr.strides for name, arr in self._regions.items()}

    @property
    def memory_bytes(self) -> int:
        """Bytes of the storage, exactly (spec.memory_bytes)."""
        return self._storage.nbytes

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
