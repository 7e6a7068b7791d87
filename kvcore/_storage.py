"""The CPU storage of K/V rows, shared by KVCache (one sequence) and KVPool (pages).

One allocation (fresh anonymous pages: zero-filled, page-aligned) of the regions'
`rows * spec.bytes_per_position` bytes and a gap of under 4 KiB before each region but the
first, never written, that starts region i at i * SKEW bytes modulo 4096 (`storage_bytes`):

    [K scales] gap [V scales] gap [K codes] gap [V codes]
    codes:  [L][rows][Hkv][W]  the format's code dtype  (token-major: a step is one block;
                               W = fmt.code_width(D): D, or D/2 for the 4-bit formats)
    scales: [L][rows][Hkv][S]  the format's scale dtype (no scale regions when S = 0)

K and V each follow their own format (spec.k_fmt, spec.v_fmt): their W, S and dtypes may
differ, and the regions are then ordered widest element first (`region_shapes`).

A KVCache has rows = capacity, row p holding position p. A KVPool of P pages of
page_size positions has rows = P * page_size, and page g is rows [g * page_size,
(g + 1) * page_size) of every layer (docs/formats.md). The checked writes are
`_cache.RowWriter`'s; this class holds no bookkeeping.

copy.deepcopy copies the bytes once, straight into fresh pages; pickle keeps the spec,
the row count and the one uint8 array (with protocol 5 a single buffer, out of band when
the pickler takes a buffer_callback). Either way the regions, views and writer are built
again over the new pages, never copied.
"""
from __future__ import annotations

import mmap
from math import prod
from typing import Any, Optional, Tuple

import numpy as np

from . import _cache
from .errors import SnapshotError
from .formats import view_dtype
from .spec import KVSpec

REGIONS = ("k_codes", "v_codes", "k_scales", "v_scales")   # the order of layer_arrays
SKEW = 2048
"""Region i starts at the first offset past region i - 1 that is i * SKEW modulo 4096, so
that row p of K and row p of V (of codes, and of scales) lie half a page apart modulo
4096 and never share an L1 set. Packed end to end, K row p and V row p of a large storage
lay a multiple of 2^27 or 2^28 bytes apart (a KVCache of 131072 f16 positions at Hkv = 8,
D = 128: 256 MiB of K codes; a pool of 32 x 4096 int8 positions: 128 MiB), and decode
attention ran 1.4-2x slower on an AMD Zen 5 core (docs/attention.md, "Address aliasing").
The gaps (under 4 KiB each) are never written."""

LayerArrays = Tuple[np.ndarray, np.ndarray, Optional[np.ndarray], Optional[np.ndarray]]
"""(k_codes, v_codes, k_scales, v_scales) of one layer; scales None when S = 0."""


HUGE = 2 << 20
"""Allocations of at least this many bytes ask for transparent huge pages (madvise), as
numpy does for its large arrays: decode attention past the last-level cache ran 2-15%
faster over them on a Zen 5 core, one thread (docs/attention.md, "Address aliasing")."""


def zeroed_pages(nbytes: int) -> np.ndarray:
    """uint8 [nbytes] on fresh anonymous pages: zero-filled, page-aligned, private to
    this process (copied on write across fork), returned to the OS when freed; huge pages
    where the kernel gives them (HUGE)."""
    flags = {"flags": mmap.MAP_PRIVATE} if hasattr(mmap, "MAP_PRIVATE") else {}
    try:
        pages = mmap.mmap(-1, nbytes, **flags)
    except OSError as e:
        raise MemoryError(f"cannot allocate the cache's {nbytes} bytes: {e.strerror}") from e
    if nbytes >= HUGE and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            pages.madvise(mmap.MADV_HUGEPAGE)
        except OSError:     # a kernel without transparent huge pages: 4 KiB pages then
            pass
    return np.frombuffer(pages, dtype=np.uint8)


def region_shapes(spec: KVSpec, rows: int) -> list[tuple[str, tuple[int, ...], np.dtype]]:
    """(name, shape, dtype) of each region of a storage of `rows` rows, in memory order:
    [K scales][V scales][K codes][V codes] (no scale region of a side whose format has
    none), ordered by element size, widest first (stable), so that every region starts
    aligned to its element size when K and V differ (K f16 codes after q4_0's float16 V
    scales); with one format for both this is the order above."""
    L, H, D = spec.num_layers, spec.num_kv_heads, spec.head_dim
    shapes: list[tuple[str, tuple[int, ...], np.dtype]] = []
    for which, fmt in zip("kv", spec.fmts):
        if fmt.scale_dtype is not None:
            shapes.append((f"{which}_scales", (L, rows, H, fmt.scales_per_row(D)), fmt.scale_dtype))
    for which, fmt in zip("kv", spec.fmts):
        shapes.append((f"{which}_codes", (L, rows, H, fmt.code_width(D)), fmt.code_dtype))
    return sorted(shapes, key=lambda x: -x[2].itemsize)


def region_offsets(shapes: list[tuple[str, tuple[int, ...], np.dtype]]) -> tuple[list[int], int]:
    """(byte offset of each region of `shapes`, the allocation's bytes): the regions in
    order, region i at the first offset past the one before that is i * SKEW modulo 4096."""
    offsets, end = [], 0
    for i, (_, shape, dtype) in enumerate(shapes):
        offsets.append(end + (i * SKEW - end) % 4096)
        end = offsets[-1] + prod(shape) * dtype.itemsize
    return offsets, end


def storage_bytes(spec: KVSpec, rows: int) -> int:
    """Bytes of the allocation of a storage of `rows` rows: rows * spec.bytes_per_position
    of regions and the gaps between them."""
    return region_offsets(region_shapes(spec, rows))[1]


class Storage:
    """Rows of every layer in one allocation (module comment), with its checked writer."""

    def __init__(self, spec: KVSpec, rows: int):
        self._build(spec, rows, zeroed_pages(storage_bytes(spec, rows)))

    def _build(self, spec: KVSpec, rows: int, array: np.ndarray) -> None:
        """Regions, writer and read-only views over `array` (uint8, storage_bytes(spec,
        rows) bytes, page-aligned)."""
        self.spec, self.rows = spec, rows
        shapes = region_shapes(spec, rows)
        self.array = array
        self.regions: dict[str, np.ndarray] = {}
        self.offsets: dict[str, int] = {}
        for (name, shape, dtype), offset in zip(shapes, region_offsets(shapes)[0]):
            nbytes = prod(shape) * dtype.itemsize
            self.regions[name] = self.array[offset:offset + nbytes].view(dtype).reshape(shape)
            self.offsets[name] = offset
        r = self.regions
        self.writer = _cache.RowWriter(spec.k_fmt, spec.v_fmt, r["k_codes"], r["v_codes"],
                                       r.get("k_scales"), r.get("v_scales"))
        # Views handed out come from an array over a read-only buffer of the same pages,
        # so that no view (nor any view of a view) can be made writable again.
        frozen = np.frombuffer(memoryview(self.array.data).toreadonly(), np.uint8)
        self.read_only = {
            name: frozen[self.offsets[name]:self.offsets[name] + arr.nbytes]
            .view(view_dtype(spec.fmts[name[0] == "v"]) if name.endswith("codes") else arr.dtype)
            .reshape(arr.shape)
            for name, arr in r.items()}

    @property
    def nbytes(self) -> int:
        """Bytes of the regions, rows * spec.bytes_per_position (the gaps not counted)."""
        return self.rows * self.spec.bytes_per_position

    def __deepcopy__(self, memo: dict[int, Any]) -> "Storage":
        """A storage of the same rows on fresh pages holding the same bytes (one copy)."""
        array = zeroed_pages(self.array.nbytes)
        np.copyto(array, self.array)
        new = Storage.__new__(Storage)
        new._build(self.spec, self.rows, array)
        memo[id(self)] = new
        return new

    def __getstate__(self) -> dict[str, Any]:
        """pickle: the spec, the row count and the uint8 array (nothing derived)."""
        return {"spec": self.spec, "rows": self.rows, "array": self.array}

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Copies the pickled bytes into fresh pages (aligned, private) and builds the
        regions, views and writer over them; SnapshotError when their size is not the
        spec's."""
        spec, rows, data = state["spec"], state["rows"], state["array"]
        nbytes = storage_bytes(spec, rows)
        if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.shape != (nbytes,):
            got = (f"{type(data).__name__}" if not isinstance(data, np.ndarray)
                   else f"{data.dtype} {list(data.shape)}")
            raise SnapshotError(f"pickled storage: expected uint8 [{nbytes}] ({rows} rows of "
                                f"{spec.bytes_per_position} bytes and the gaps), got {got}")
        array = zeroed_pages(nbytes)
        np.copyto(array, data)
        self._build(spec, rows, array)

    def layer_arrays(self, layer: int) -> LayerArrays:
        """(k_codes, v_codes, k_scales, v_scales) of one layer: writable views of every
        row, codes [rows, Hkv, D] in the raw code dtype, scales [rows, Hkv, S] or None."""
        r = self.regions
        sk, sv = r.get("k_scales"), r.get("v_scales")
        return (r["k_codes"][layer], r["v_codes"][layer], None if sk is None else sk[layer],
                None if sv is None else sv[layer])

    def gather(self, layer: int, rows: np.ndarray) -> LayerArrays:
        """(k_codes, v_codes, k_scales, v_scales) of the given rows of one layer, copied
        in their order: codes [n, Hkv, D], scales [n, Hkv, S] or None."""
        kc, vc, ks, vs = self.layer_arrays(layer)
        return kc[rows], vc[rows], None if ks is None else ks[rows], None if vs is None else vs[rows]

    @property
    def layout(self) -> dict[str, dict[str, Any]]:
        return {name: {"offset": self.offsets[name], "nbytes": arr.nbytes,
                       "shape": arr.shape, "dtype": str(arr.dtype)}
                for name, arr in self.regions.items()}

    @property
    def strides(self) -> dict[str, tuple[int, ...]]:
        return {name: arr.strides for name, arr in self.regions.items()}
