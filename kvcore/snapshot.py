"""Snapshots: a compact copy of a cache's first n positions (codes and scales, no
capacity padding) plus the spec, shared by the CPU and the GPU caches.

Files are safetensors files (docs/snapshots.md gives the layout and the checks):

    [u64 LE header length][JSON header, space-padded][K scales][V scales][K codes][V codes]

`Snapshot.save` writes a temporary file beside the target, fsyncs it and renames it
into place; `load_snapshot` validates the header against the file's size before it
reads any data, reads the tensors into private memory and checks their digests over the
bytes read (XXH3-128 by default, SHA-256 on request): nothing done to the file after
load reaches the snapshot.
"""
from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import io
import json
import math
import operator
import os
import re
import secrets
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Protocol, cast

import numpy as np
import xxhash

from .errors import (DTypeError, FormatError, KVCacheError, OutOfRangeError,
                     SnapshotError, SpecError)
from ._quant import max_scale
from ._validate import check_ndarray
from .formats import Format, get_pair, pair_name
from ._storage import region_shapes
from .spec import KVSpec

if TYPE_CHECKING:
    from .cache import KVCache

FILE_VERSION = 3  # 3 adds start and sink_end (a windowed sequence's snapshot), 2 XXH3-128
# digests; a snapshot of all its positions is still written as version 2 (older kvcore reads
# it), and versions 1 (SHA-256 only) and 2 still load
_WINDOWED_VERSION = 3
# Per-tensor digests in the metadata (hex, fixed width): SHA-256, the content address any
# tool can recompute, and XXH3-128, which load checks by default (over 10x faster).
class _Hash(Protocol):
    """What save and load use of a hash object (hashlib's and xxhash's)."""
    @property
    def digest_size(self) -> int: ...
    def update(self, data: memoryview, /) -> None: ...
    def hexdigest(self) -> str: ...


_DIGESTS: dict[str, Callable[[], _Hash]] = {"sha256": hashlib.sha256,
                                            "xxh3_128": xxhash.xxh3_128}
_MAX_HEADER_BYTES = 16 * 2**20  # ours take ~1 KiB; a larger length field is a lie
_DATA_ALIGN = 64  # the tensor data starts at a multiple of this offset in the file
_ST_DTYPES = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16",
              np.dtype(np.uint16): "U16", np.dtype(np.int8): "I8", np.dtype(np.uint8): "U8",
              np.dtype(np.int64): "I64"}  # I64: the token ids of store chunks
_SPEC_KEYS = ("num_layers", "num_kv_heads", "head_dim", "capacity", "num_heads")
_UINT = re.compile(r"0|[1-9][0-9]{0,18}")
_PARALLEL_HASH_BYTES = 1 << 20  # below this, hashing on worker threads costs more than it saves
_WRITE_CHUNK = 32 << 20  # save writes, starts write-back and hashes in pieces of this size
_READ_CHUNK = 1 << 20  # load reads and hashes in pieces of this size (hashed while cached)


@dataclass(frozen=True, eq=False)
class Snapshot:
    """Positions [0, length) of every layer of a cache, or, for a sequence of a windowed
    KVPool that released pages (start > 0), its held positions [0, sink_end) and
    [start, length): N = sink_end + length - start positions in all, in that order.

    k_codes, v_codes: [L, N, Hkv, W], the format's code dtype, C-contiguous.
    k_scales, v_scales: [L, N, Hkv, S], the format's scale dtype; None when the
    format has no scales (S = 0). K and V each in their own format (spec.k_fmt,
    spec.v_fmt: the same one, or a K/V pair).
    start, sink_end: 0 <= sink_end < start <= length, or both 0 (all positions held).
    k_residual: a grouped K format's (q4_1ch) open group, float16 [L, length % 32, Hkv, D]
    (K of positions [length - length % 32, length): the last rows held, whose rows of
    k_codes and k_scales are zeros), C-contiguous (None when length % 32 == 0 stands for
    no rows); None for every other K format (docs/formats.md, q4_1ch). Its start and
    sink_end are multiples of 32 (a windowed pool releases whole groups).
    """

    spec: KVSpec
    length: int
    k_codes: np.ndarray
    v_codes: np.ndarray
    k_scales: np.ndarray | None = None
    v_scales: np.ndarray | None = None
    start: int = 0
    sink_end: int = 0
    k_residual: np.ndarray | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.spec, KVSpec):
            raise DTypeError(f"invalid type of spec: expected KVSpec, got {type(self.spec).__name__}")
        for name in ("length", "start", "sink_end"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise DTypeError(f"invalid type of {name}: expected int, got "
                                 f"{type(value).__name__}")
            object.__setattr__(self, name, int(value))
        s = self.spec
        if not 0 <= self.length <= s.capacity:
            raise SnapshotError(
                f"snapshot length {self.length} out of range: expected 0 <= length <= {s.capacity}")
        if (self.start or self.sink_end) and not 0 <= self.sink_end < self.start <= self.length:
            raise SnapshotError(f"snapshot start {self.start} and sink_end {self.sink_end} out "
                                f"of range: expected 0 <= sink_end < start <= length "
                                f"{self.length}, or both 0")
        for which, f in zip("kv", s.fmts):
            code_shape = (s.num_layers, self.held, s.num_kv_heads, f.code_width(s.head_dim))
            scale_shape = (s.num_layers, self.held, s.num_kv_heads, f.scales_per_row(s.head_dim))
            _check_part(f"{which}_codes", getattr(self, f"{which}_codes"), code_shape, f.code_dtype)
            arr = getattr(self, f"{which}_scales")
            if f.scale_dtype is not None:
                _check_part(f"{which}_scales", arr, scale_shape, f.scale_dtype)
            elif arr is not None:
                side = f"{which.upper()} " if s.paired else ""
                raise SnapshotError(f"snapshot of {side}format {f.name} has no scales, "
                                    f"got {which}_scales")
        group = s.k_fmt.group
        if group:
            if self.k_residual is None and self.length % group == 0:   # no open group
                object.__setattr__(self, "k_residual", np.zeros(
                    (s.num_layers, 0, s.num_kv_heads, s.head_dim), np.float16))
            if self.start % group or self.sink_end % group:
                raise SnapshotError(f"a snapshot of K format {s.k_format} holds whole "
                                    f"groups of {group} positions: got start {self.start}, "
                                    f"sink_end {self.sink_end}")
            _check_part("k_residual", self.k_residual, (s.num_layers, self.length % group,
                        s.num_kv_heads, s.head_dim), np.dtype(np.float16))
        elif self.k_residual is not None:
            raise SnapshotError(f"snapshot of K format {s.k_format} has no residual, got "
                                f"k_residual")

    @property
    def held(self) -> int:
        """Positions the arrays hold: length, or sink_end + length - start."""
        return self.length - self.start + self.sink_end

    @property
    def nbytes(self) -> int:
        """Bytes of codes and scales held."""
        return sum(a.nbytes for a in (self.k_codes, self.v_codes, self.k_scales, self.v_scales,
                                      self.k_residual) if a is not None)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Writes the snapshot to `path` as a safetensors file (docs/snapshots.md).

        Atomic: the bytes go to a temporary file in the same directory, which is fsynced
        and renamed over `path`; a crash mid-save leaves any old file at `path` intact.
        The data is written in 32 MiB pieces, each one's write-back to the disk started at
        once, while a worker thread per tensor hashes its pieces as they are written
        (SHA-256 and XXH3-128 per tensor).
        """
        path = os.fspath(path)
        parts = [(name, getattr(self, name)) for name, _, _ in _layout(self.spec, self.held)]
        meta = _metadata(self.spec, self.length, self.start, self.sink_end)
        meta.update({f"{algo}_{name}": "0" * new().digest_size * 2
                     for algo, new in _DIGESTS.items() for name, _ in parts})
        meta["sha256"] = "0" * 64
        # The digests are fixed-width hex, so the placeholder header has the final length.
        header = _encode_header(meta, parts)
        tmp = os.path.join(os.path.dirname(path) or ".",
                           f".{os.path.basename(path)}.{secrets.token_hex(8)}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        try:
            try:
                digests = _write_hashed(fd, len(header), [a for _, a in parts])
                meta.update({f"{algo}_{name}": d for (name, _), per_algo in zip(parts, digests)
                             for algo, d in per_algo.items()})
                meta["sha256"] = _metadata_digest(meta)
                _pwrite_all(fd, _encode_header(meta, parts), 0)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
        _fsync_dir(os.path.dirname(path) or ".")


def _check_part(name: str, arr: object, shape: tuple[int, ...], dtype: np.dtype) -> None:
    if not isinstance(arr, np.ndarray):
        raise SnapshotError(f"snapshot {name} must be a numpy array, got {type(arr).__name__}")
    check_ndarray(f"snapshot {name}", arr)   # refuses masked arrays
    if arr.shape != shape or arr.dtype != dtype:
        raise SnapshotError(f"snapshot {name}: expected {list(shape)} {dtype}, "
                            f"got {list(arr.shape)} {arr.dtype}")
    if not arr.flags.c_contiguous:
        raise SnapshotError(f"snapshot {name} must be C-contiguous")


# ------------------------------------------------------------------ take / restore

def take_snapshot(cache: "KVCache", n: int | None = None) -> Snapshot:
    """Copies committed positions [0, n) of every layer (n defaults to cache.length) out
    of a CPU KVCache into a new Snapshot (compact token-major arrays, no capacity padding).
    Pending positions are never included."""
    groups = cache._groups
    return snapshot_parts(cache.spec, cache.length, n, lambda layer, count: tuple(
        None if a is None else a[:count] for a in cache._layer_arrays(layer)),
        open_group=None if groups is None else lambda layer, count: groups.open_group(
            layer, count, *cache._k_regions(layer), operator.index))


def snapshot_parts(spec: KVSpec, length: int, n: int | None,
                   layer_parts: Callable[[int, int], Iterable[np.ndarray | None]], *,
                   start: int = 0, sink_end: int = 0,
                   open_group: Callable[[int, int], np.ndarray] | None = None) -> Snapshot:
    """A Snapshot of positions [0, n) (n defaults to length; OutOfRangeError unless
    0 <= n <= length) of a sequence of `spec`: layer_parts(layer, N) gives (k_codes,
    v_codes, k_scales, v_scales) of that layer's N held positions of [0, n) (all n of
    them; with start > 0, [0, sink_end) and [start, n)), token-major [N, Hkv, D] /
    [N, Hkv, S] or None (shared by KVCache and KVPool). A grouped K format's (q4_1ch):
    open_group(layer, n) gives the K of the open group of [0, n), float16
    [n % 32, Hkv, D] (KeyGroups.open_group)."""
    if n is None:
        n = length
    elif isinstance(n, bool) or not isinstance(n, (int, np.integer)):
        raise DTypeError(f"invalid type of n: expected int or None, got {type(n).__name__}")
    if not 0 <= n <= length:
        raise OutOfRangeError(f"snapshot of {n} positions out of range: expected "
                              f"0 <= n <= length {length}")
    n = int(n)
    held = n - start + sink_end
    parts = {name: np.empty(shape, dtype) for name, shape, dtype in _layout(spec, held)}
    for layer in range(spec.num_layers):
        for name, arr in zip(_PART_NAMES, layer_parts(layer, held)):
            if arr is not None:
                parts[name][layer] = arr
        if open_group is not None:
            full = held - n % spec.k_fmt.group      # the open group: the last rows held
            parts["k_codes"][layer, full:] = 0      # hold no codes
            parts["k_scales"][layer, full:] = 0
            parts["k_residual"][layer] = open_group(layer, n)
    return Snapshot(spec, n, **parts, start=start, sink_end=sink_end)


def restore_snapshot(cache: "KVCache", snap: Snapshot, *, requantize: bool = False) -> None:
    """Replaces a CPU KVCache's content with a snapshot: positions [0, snap.length) of
    every layer, length = snap.length, nothing pending. Atomic: everything is checked
    (see `fit_snapshot`) before a byte of the cache is written. Positions past the new
    length are not cleared (as after truncate)."""
    snap = detached(fit_snapshot(cache.spec, snap, requantize=requantize), cache._storage)
    n = snap.length
    for layer in range(cache.spec.num_layers):
        for name, arr in zip(_PART_NAMES, cache._layer_arrays(layer)):
            if arr is not None:
                arr[:n] = getattr(snap, name)[layer]
    if cache._groups is not None:
        cache._groups.restore(n, cast(np.ndarray, snap.k_residual))
    cells = cache._cells
    cells.length = n
    cells.pending = [0] * cache.spec.num_layers


def detached(snap: Snapshot, storage: np.ndarray) -> Snapshot:
    """snap, or a copy of it when one of its arrays lies in `storage` (the storage a
    restore is about to overwrite)."""
    if any(a is not None and np.may_share_memory(a, storage)
           for a in (snap.k_codes, snap.v_codes, snap.k_scales, snap.v_scales)):
        snap = dataclasses.replace(snap, **{name: getattr(snap, name).copy()
                                            for name in _PART_NAMES
                                            if getattr(snap, name) is not None})
    return snap


def fit_snapshot(spec: KVSpec, snap: Snapshot, *, requantize: bool = False,
                 windowed: bool = False) -> Snapshot:
    """The snapshot to write into a cache of `spec`, checked; shared by the CPU and GPU
    caches' restore.

    A snapshot of a windowed sequence (start > 0: positions [sink_end, start) were
    released) is refused unless `windowed` (a KVPool with a window, which checks the
    positions against its own window): a cache without a window would attend to
    positions it does not hold.

    Refuses (SnapshotError) a snapshot of another num_layers, num_kv_heads or head_dim,
    one longer than spec.capacity, one of another format unless requantize=True, and one
    holding a value its format's encoder never produces (NaN/inf float codes, FP8 NaN
    codes, int8/q8_0 code -128, non-finite scales, negative ones (but q4_0's d and
    q4_1's m), int8/fp8 scales past
    _quant.max_scale, which would not decode finite). num_heads and capacity
    may differ: they do not change what a position stores. With requantize=True a
    snapshot of another format is decoded to float32 and re-encoded with
    kvcore.quantize, layer by layer, into a new Snapshot of spec's format (SnapshotError
    when a value does not fit that format, e.g. past the float16 range).
    """
    if not isinstance(snap, Snapshot):
        raise DTypeError(f"invalid type of snapshot: expected Snapshot, "
                         f"got {type(snap).__name__}")
    if snap.start and not windowed:
        raise SnapshotError(
            f"the snapshot holds positions [0, {snap.sink_end}) and [{snap.start}, "
            f"{snap.length}) of a windowed KVPool's sequence (the window released the rest): "
            f"only a KVPool with a window (KVPool(..., window=W)) restores it")
    have, want = snap.spec, spec
    for key in ("num_layers", "num_kv_heads", "head_dim"):
        if getattr(have, key) != getattr(want, key):
            raise SnapshotError(f"snapshot {key} {getattr(have, key)} does not match the "
                                f"cache's {getattr(want, key)}")
    if snap.length > want.capacity:
        raise SnapshotError(f"snapshot of {snap.length} positions exceeds the cache's "
                            f"capacity {want.capacity}")
    if have.format != want.format and not requantize:
        if have.paired or want.paired:
            raise SnapshotError(
                f"snapshot formats K {have.k_format} / V {have.v_format} do not match the "
                f"cache's K {want.k_format} / V {want.v_format} (pass requantize=True to "
                f"re-encode)")
        raise SnapshotError(f"snapshot format {have.format} does not match the cache's "
                            f"{want.format} (pass requantize=True to re-encode)")
    _check_values(snap)
    if have.format == want.format:
        return snap
    converted = _requantize(snap, want)
    _check_values(converted)
    return converted


_PART_NAMES = ("k_codes", "v_codes", "k_scales", "v_scales")  # the order of _layer_arrays


def _bad_codes(codes: np.ndarray, fmt: Format) -> np.ndarray:
    """Mask of codes the format's encoder never produces from finite input."""
    bad: np.ndarray
    if fmt.name in ("f32", "f16"):
        bad = ~np.isfinite(codes)
    elif fmt.name == "bf16":
        bad = (codes & 0x7F80) == 0x7F80  # exponent all ones: inf or NaN
    elif fmt.name == "fp8_e4m3":
        bad = (codes & 0x7F) == 0x7F  # E4M3FN's only NaN; it has no inf
    elif fmt.name == "fp8_e5m2":
        bad = (codes & 0x7F) >= 0x7C  # inf and NaN
    elif fmt.pack == 2:
        bad = np.zeros(codes.shape, dtype=bool)  # q4_0, q4_1: every nibble is a code
    else:
        bad = codes == -128  # int8, q8_0: codes lie in [-127, 127]
    return bad


#: 16-bit float codes: their exponent bits (all ones: inf or NaN)
_EXPONENT_BITS = {"f16": 0x7C00, "bf16": 0x7F80}


def _finite_bits(arr: np.ndarray, exponent: int) -> bool:
    """True when no 16-bit float code of arr ([L, ...], any layout) has every bit of
    `exponent` set (inf or NaN): a masked max per layer into one reused uint16 buffer
    (numpy's float16 min and max convert each element: ~70x slower)."""
    bits, mask = arr.view(np.uint16), np.uint16(exponent)
    out = np.empty(arr.shape[1:], np.uint16)
    return all(np.bitwise_and(layer, mask, out=out).max() != mask for layer in bits)


def _all_valid(arr: np.ndarray, name: str, fmt: Format, top: float) -> bool:
    """True when a whole part is surely valid by reductions alone (no mask, no temporary
    array of more than a layer): int8/q8_0 codes by their min, f16/bf16 codes by their
    exponent bits, other float codes and scales by their min and max (a NaN makes both
    NaN). False: look closer."""
    if not arr.size:
        return True
    if name.endswith("codes") and fmt.name in _EXPONENT_BITS:
        return _finite_bits(arr, _EXPONENT_BITS[fmt.name])
    if name.endswith("scales") and fmt.block_scales == 2:
        return False   # q4_1, q4_1ch: d >= 0, m of any sign: _bad_scales looks at each
    if name.endswith("scales") or fmt.name == "f32":
        lo, hi = float(arr.min()), float(arr.max())
        signed = fmt.name == "q4_0"   # d = max / -8 has either sign
        return bool(np.isfinite(lo) and np.isfinite(hi)
                    and (not name.endswith("scales") or signed or (lo >= 0 and hi <= top)))
    return fmt.pack == 2 or (fmt.name in ("int8", "q8_0") and int(arr.min()) > -128)


def _bad_scales(scales: np.ndarray, fmt: Format, top: float) -> np.ndarray:
    """Mask of scales the format's encoder never produces from accepted input: non-finite
    ones; negative ones or past `top` except q4_0's d (either sign) and q4_1's m (every
    second scale, either sign; q4_1ch's too)."""
    bad: np.ndarray = ~np.isfinite(scales)
    if fmt.block_scales == 2:
        bad[..., 0::2] |= ~(scales[..., 0::2] >= 0)
    elif fmt.name != "q4_0":
        bad |= ~((scales >= 0) & (scales <= top))
    return bad


def _check_values(snap: Snapshot) -> None:
    """Raises SnapshotError naming the first impossible code or scale (layer by layer, so
    the temporaries stay one layer's size); each side (K, V) by its own format."""
    for name in _PART_NAMES:
        arr = getattr(snap, name)
        if arr is None:
            continue
        fmt = snap.spec.fmts[name[0] == "v"]
        top = max_scale(fmt.id)  # inf for q8_0: every finite float16 scale decodes finite
        if _all_valid(arr, name, fmt, top):
            continue
        for layer in range(snap.spec.num_layers):
            part = arr[layer]
            bad = (_bad_codes(part, fmt) if name.endswith("codes")
                   else _bad_scales(part, fmt, top))
            if bad.any():
                idx = np.unravel_index(int(np.argmax(bad)), part.shape)
                where = ", ".join(str(i) for i in (layer, *map(int, idx)))
                raise SnapshotError(f"snapshot {name}[{where}] = {part[idx]!r} is not a value "
                                    f"format {fmt.name} stores")
    res = snap.k_residual
    if res is not None and not np.isfinite(res).all():
        where = ", ".join(str(int(i)) for i in np.argwhere(~np.isfinite(res))[0])
        raise SnapshotError(f"snapshot k_residual[{where}] is not finite: the open group of "
                            f"format {snap.spec.k_format} holds finite float16 values")


def _requantize(snap: Snapshot, want: KVSpec) -> Snapshot:
    """snap decoded to float32 and re-encoded in want's formats (K in want.k_fmt, V in
    want.v_fmt), layer by layer; a q4_1ch K as appends would store the decoded values
    (_groups.encode_positions)."""
    from ._groups import decode_positions, encode_positions
    from .quant import dequantize, quantize
    spec = snap.spec.replace(format=want.format)
    parts = {name: np.empty(shape, dtype) for name, shape, dtype in _layout(spec, snap.held)}
    for which in ("k", "v"):
        src, fmt = snap.spec.fmts[which == "v"], spec.fmts[which == "v"]
        codes, scales = getattr(snap, f"{which}_codes"), getattr(snap, f"{which}_scales")
        for layer in range(spec.num_layers):
            if src.group:      # q4_1ch K: complete groups, then the open one's float16
                x = decode_positions(codes[layer], scales[layer],
                                     cast(np.ndarray, snap.k_residual)[layer], src)
            else:
                x = dequantize(codes[layer], None if scales is None else scales[layer], src)
            s: np.ndarray | None
            try:
                if fmt.group:
                    c, s, parts["k_residual"][layer] = encode_positions(x, fmt)
                else:
                    c, s = quantize(x, fmt)
            except KVCacheError as e:
                raise SnapshotError(f"cannot requantize the {src.name} snapshot to {fmt.name}: "
                                    f"{which}, layer {layer}: {e}") from None
            parts[f"{which}_codes"][layer] = c.view(fmt.code_dtype)
            if s is not None:
                parts[f"{which}_scales"][layer] = s
    return Snapshot(spec, snap.length, **parts, start=snap.start, sink_end=snap.sink_end)


# ---------------------------------------------------------------------------- files

def _layout(spec: KVSpec, length: int) -> list[tuple[str, tuple[int, ...], np.dtype]]:
    """(name, shape, dtype) of each tensor, in file order: widest element first (scales
    before codes; with a K/V pair, sorted by element size), so every tensor starts
    aligned to its element size: the storage's own order (_storage.region_shapes)."""
    parts = [(name, shape[:1] + (length,) + shape[2:], dtype)
             for name, shape, dtype in region_shapes(spec, 1)]
    if spec.k_fmt.group:        # q4_1ch's open group, float16: among the 2-byte tensors
        parts.append(("k_residual", (spec.num_layers, length % spec.k_fmt.group,
                                     spec.num_kv_heads, spec.head_dim), np.dtype(np.float16)))
    return sorted(parts, key=lambda part: -part[2].itemsize)


def _metadata(spec: KVSpec, length: int, start: int = 0, sink_end: int = 0) -> dict[str, str]:
    """The metadata before the digests: version 2 for a snapshot of all its positions,
    3 with start and sink_end for a windowed sequence's (start > 0)."""
    from . import __version__
    meta = {"file_version": str(_WINDOWED_VERSION if start else 2),
            "kvcore_version": __version__, "format": spec.format, "length": str(length)}
    if start:
        meta.update(start=str(start), sink_end=str(sink_end))
    meta.update({k: str(getattr(spec, k)) for k in _SPEC_KEYS})
    return meta


def _metadata_digest(meta: dict[str, str]) -> str:
    """SHA-256 of every metadata entry but "sha256" itself (the tensor digests included),
    as sorted compact JSON: it covers the whole header's meaning."""
    body = {k: v for k, v in meta.items() if k != "sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":"))
                          .encode()).hexdigest()


def _encode_header(meta: dict[str, str], parts: list[tuple[str, np.ndarray]]) -> bytes:
    """The 8-byte length plus the JSON header, space-padded so the data starts at a
    multiple of _DATA_ALIGN."""
    table: dict[str, object] = {"__metadata__": meta}
    begin = 0
    for name, arr in parts:
        table[name] = {"dtype": _ST_DTYPES[arr.dtype], "shape": list(arr.shape),
                       "data_offsets": [begin, begin + arr.nbytes]}
        begin += arr.nbytes
    text = json.dumps(table, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % _DATA_ALIGN)
    return struct.pack("<Q", len(text)) + text


def _bytes_of(arr: np.ndarray) -> memoryview:
    return arr.reshape(-1).view(np.uint8).data


def _pwrite_all(fd: int, buf: bytes | memoryview, offset: int) -> None:
    view = memoryview(buf)
    while view.nbytes:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _fsync_dir(directory: str) -> None:
    """Makes the rename durable (POSIX); Windows cannot open a directory for fsync."""
    if os.name == "nt":
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_hashed(fd: int, offset: int, arrays: list[np.ndarray]) -> list[dict[str, str]]:
    """Writes the arrays' bytes back to back from `offset` of fd, in _WRITE_CHUNK pieces,
    and returns each array's digests ({algorithm: hex} over _DIGESTS). Each piece's
    write-back to the disk starts as soon as it is written (Linux sync_file_range), so the
    final fsync has little left to do; a worker thread per array hashes its pieces in
    order as they are written, so hashing runs beside the writes, and the hashing of one
    array beside that of the next (both hashes release the GIL)."""
    hashes = [{algo: new() for algo, new in _DIGESTS.items()} for _ in arrays]
    if sum(a.nbytes for a in arrays) < _PARALLEL_HASH_BYTES:
        for per_algo, arr in zip(hashes, arrays):
            _pwrite_all(fd, _bytes_of(arr), offset)
            _update(per_algo, _bytes_of(arr))
            offset += arr.nbytes
    else:
        hashed = []
        workers = [ThreadPoolExecutor(max_workers=1) for _ in arrays]  # one: pieces in order
        try:
            for per_algo, arr, worker in zip(hashes, arrays, workers):
                data = _bytes_of(arr)
                for begin in range(0, len(data), _WRITE_CHUNK):
                    piece = data[begin:begin + _WRITE_CHUNK]
                    _pwrite_all(fd, piece, offset)
                    _start_writeback(fd, offset, len(piece))
                    offset += len(piece)
                    hashed.append(worker.submit(_update, per_algo, piece))
            for f in hashed:
                f.result()
        finally:
            for worker in workers:
                worker.shutdown(cancel_futures=True)
    return [{algo: h.hexdigest() for algo, h in per_algo.items()} for per_algo in hashes]


def _update(hashes: dict[str, _Hash], data: memoryview) -> None:
    for h in hashes.values():
        h.update(data)  # update() releases the GIL on large data; the constructor does not


def _find_sync_file_range() -> Any:
    """libc's sync_file_range (Linux), or None where there is none."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError, TypeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _find_sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2  # start write-back of the range's dirty pages, do not wait


def _start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Asks the kernel to start writing a just-written range to the disk (no wait). Only a
    speed-up: fsync still makes the file durable, so a failure here is ignored."""
    if _sync_file_range is not None:
        _sync_file_range(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)


def _read_hashed(f: io.BufferedReader, views: list[memoryview], starts: list[int],
                 algo: str | None) -> list[str | None]:
    """Fills each view with the file's bytes from its start offset and returns each
    view's hex digest (None when algo is None), hashed over the bytes just read into it,
    _READ_CHUNK at a time (while they are in the CPU's cache). Large reads run a worker
    thread per view (os.preadv and the hashes release the GIL). SnapshotError when the
    file ends early (it shrank since its size was checked)."""

    def one(view: memoryview, pos: int) -> str | None:
        h = _DIGESTS[algo]() if algo else None
        for begin in range(0, view.nbytes, _READ_CHUNK):
            piece = view[begin:begin + _READ_CHUNK]
            _pread_into(f, piece, pos + begin)
            if h is not None:
                h.update(piece)
        return h.hexdigest() if h is not None else None

    if sum(v.nbytes for v in views) < _PARALLEL_HASH_BYTES or not hasattr(os, "preadv"):
        return [one(v, pos) for v, pos in zip(views, starts)]
    with ThreadPoolExecutor(max_workers=len(views)) as pool:
        return list(pool.map(one, views, starts))


def _pread_into(f: io.BufferedReader, view: memoryview, offset: int) -> None:
    """Fills view with the file's bytes from offset (os.preadv where there is one: no
    shared file position, so threads may read at once)."""
    while view.nbytes:
        if hasattr(os, "preadv"):
            n = os.preadv(f.fileno(), [view], offset)
        else:
            f.seek(offset)
            n = f.readinto(view)
        if not n:
            raise SnapshotError(f"snapshot file {f.name!r} ended at byte {offset} while "
                                f"loading (it shrank since load began)")
        view, offset = view[n:], offset + n


def load_snapshot(path: str | os.PathLike[str], *, verify: bool | str = True) -> Snapshot:
    """Reads a snapshot file written by `Snapshot.save` into memory of its own.

    Everything is checked before a byte of data is read: the header length against the
    file size, the metadata (file version, format, spec, its own SHA-256), each tensor's
    dtype, shape and byte range, and that the tensors tile the data exactly. The data is
    then read into private memory (no mapping of the file stays behind: what happens to
    the file after load cannot reach the snapshot) and every tensor's bytes, as read, are
    checked against the digest in the header: verify=True (the default) checks XXH3-128
    (corruption: flipped bytes, lost writes; about 15 GB/s per core), verify="sha256" the
    SHA-256 (what any tool can recompute; about 1.2 GB/s per core), verify=False skips
    the digests. Version 1 files carry only SHA-256, so verify=True checks that. Any defect
    raises SnapshotError naming it. The tensors are read-only numpy arrays (their base is
    a read-only buffer: they cannot be made writable), so a restore writes exactly the
    bytes that were verified.
    """
    if verify not in (True, False, "sha256"):
        raise SnapshotError(f"verify must be True, False or 'sha256', got {verify!r}")
    path = os.fspath(path)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 8:
            raise SnapshotError(f"snapshot file {path!r}: {size} bytes is too short for the "
                                f"8-byte header length of a safetensors file")
        (header_len,) = struct.unpack("<Q", f.read(8))
        if header_len > size - 8:
            raise SnapshotError(f"snapshot file {path!r}: header length {header_len} exceeds "
                                f"the {size - 8} bytes after the length field (truncated file?)")
        if header_len > _MAX_HEADER_BYTES:
            raise SnapshotError(f"snapshot file {path!r}: header length {header_len} exceeds "
                                f"the limit of {_MAX_HEADER_BYTES} bytes")
        raw = f.read(header_len)
        try:
            spec, (length, start, sink_end), meta, offsets = _parse_header(raw,
                                                                           size - 8 - header_len)
        except SnapshotError as e:
            raise SnapshotError(f"snapshot file {path!r}: {e}") from None
        layout = _layout(spec, length - start + sink_end)
        data = np.empty(size - 8 - header_len, np.uint8)
        views = [data[offsets[name]:offsets[name] + math.prod(shape) * dtype.itemsize].data
                 for name, shape, dtype in layout]
        algo = None
        if verify:
            algo = "xxh3_128" if verify is True and "xxh3_128_k_codes" in meta else "sha256"
        digests = _read_hashed(f, views, [8 + header_len + offsets[name] for name, _, _ in layout],
                               algo)
    for (name, _, _), digest in zip(layout, digests):
        if algo and digest != meta[f"{algo}_{name}"]:
            raise SnapshotError(
                f"snapshot file {path!r}: the bytes of {name} do not match their {algo} "
                f"(header {meta[f'{algo}_{name}']}, data {digest}): corrupt data")
    frozen = np.frombuffer(data.data.toreadonly(), np.uint8)
    arrays = {name: frozen[offsets[name]:offsets[name] + math.prod(shape) * dtype.itemsize]
              .view(dtype).reshape(shape) for name, shape, dtype in layout}
    return Snapshot(spec, length, **arrays, start=start, sink_end=sink_end)


def _parse_header(raw: bytes, data_len: int
                  ) -> tuple[KVSpec, tuple[int, int, int], dict[str, str], dict[str, int]]:
    """Validates the JSON header against the data section's size; returns
    (spec, (length, start, sink_end), metadata, {tensor name: offset in the data section})."""
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise SnapshotError(f"header is not valid JSON: {type(e).__name__}: {e}") from None
    if not isinstance(header, dict):
        raise SnapshotError(f"header must be a JSON object, got {type(header).__name__}")
    meta = header.pop("__metadata__", None)
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise SnapshotError("header has no __metadata__ of strings: not a kvcore snapshot")
    spec, span = _parse_metadata(meta)
    length, start, sink_end = span
    layout = _layout(spec, length - start + sink_end)
    return spec, span, meta, _parse_table(header, layout, data_len)


def _meta_uint(meta: dict[str, str], key: str) -> int:
    value = meta[key]
    if not _UINT.fullmatch(value):
        raise SnapshotError(f"metadata {key} must be a non-negative decimal integer below "
                            f"10**19, got {value[:40]!r}")
    return int(value)


def _parse_metadata(meta: dict[str, str]) -> tuple[KVSpec, tuple[int, int, int]]:
    """The spec and (length, start, sink_end); start and sink_end are 0 in files before
    version 3 and in version 3 files of a snapshot of all its positions."""
    if "file_version" not in meta:
        raise SnapshotError("metadata has no file_version: not a kvcore snapshot")
    version = _meta_uint(meta, "file_version")
    if version > FILE_VERSION:
        raise SnapshotError(f"file version {version} is newer than this kvcore reads "
                            f"(up to {FILE_VERSION}): upgrade kvcore")
    if version < 1:
        raise SnapshotError(f"unknown file version {version}: expected 1..{FILE_VERSION}")
    try:
        fmts = get_pair(meta.get("format"))  # type: ignore[arg-type]  # None: refused
    except FormatError as e:
        raise SnapshotError(f"metadata format: {e}") from None
    fmt_name = pair_name(*fmts)
    names = ([f"{w}_scales" for w, f in zip("kv", fmts) if f.quantized]
             + ["k_codes", "v_codes"] + (["k_residual"] if fmts[0].group else []))
    algos = ["sha256"] if version == 1 else list(_DIGESTS)
    expected = {"file_version", "kvcore_version", "format", "length", "sha256",
                *_SPEC_KEYS, *(f"{algo}_{n}" for algo in algos for n in names)}
    if version >= _WINDOWED_VERSION:
        expected |= {"start", "sink_end"}
    if set(meta) != expected:
        missing, extra = sorted(expected - set(meta)), sorted(set(meta) - expected)
        raise SnapshotError(f"metadata keys differ from a file of format {fmt_name}: "
                            f"missing {missing}, unexpected {[k[:40] for k in extra]}")
    if _metadata_digest(meta) != meta["sha256"]:
        raise SnapshotError("the metadata does not match its SHA-256: corrupt header")
    try:
        sizes: dict[str, Any] = {k: _meta_uint(meta, k) for k in _SPEC_KEYS}
        spec = KVSpec(**sizes, format=fmt_name)
    except (SpecError, FormatError) as e:
        raise SnapshotError(f"metadata spec: {e}") from None
    length = _meta_uint(meta, "length")
    if length > spec.capacity:
        raise SnapshotError(f"metadata length {length} exceeds capacity {spec.capacity}")
    start = sink_end = 0
    if version >= _WINDOWED_VERSION:
        start, sink_end = _meta_uint(meta, "start"), _meta_uint(meta, "sink_end")
        if not 0 <= sink_end < start <= length:
            raise SnapshotError(f"metadata start {start} and sink_end {sink_end} out of range: "
                                f"expected 0 <= sink_end < start <= length {length}")
    return spec, (length, start, sink_end)


def _parse_table(table: dict[str, Any], layout: list[tuple[str, tuple[int, ...], np.dtype]],
                 data_len: int) -> dict[str, int]:
    """Checks each tensor entry against the layout the metadata implies, and that the
    entries tile the data section exactly; returns each tensor's offset."""
    names = [name for name, _, _ in layout]
    if set(table) != set(names):
        missing, extra = sorted(set(names) - set(table)), sorted(set(table) - set(names))
        raise SnapshotError(f"tensors differ from the format's: missing {missing}, "
                            f"unexpected {[k[:40] for k in extra]}")
    want_total = sum(math.prod(shape) * dtype.itemsize for _, shape, dtype in layout)
    if want_total != data_len:
        raise SnapshotError(f"the data section is {data_len} bytes but the metadata describes "
                            f"{want_total} (truncated or extended file?)")
    spans = []
    for name, shape, dtype in layout:
        entry = table[name]
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            raise SnapshotError(f"tensor {name}: expected an object with dtype, shape and "
                                f"data_offsets")
        if entry["dtype"] != _ST_DTYPES[dtype]:
            raise SnapshotError(f"tensor {name}: dtype {str(entry['dtype'])[:40]!r} does not "
                                f"match the metadata (expected {_ST_DTYPES[dtype]})")
        if entry["shape"] != list(shape) or not _all_ints(entry["shape"]):
            raise SnapshotError(f"tensor {name}: shape {str(entry['shape'])[:80]} does not "
                                f"match the metadata (expected {list(shape)})")
        span = entry["data_offsets"]
        nbytes = math.prod(shape) * dtype.itemsize
        if (not isinstance(span, list) or len(span) != 2 or not _all_ints(span)
                or not 0 <= span[0] <= span[1] or span[1] - span[0] != nbytes):
            raise SnapshotError(f"tensor {name}: data_offsets {str(span)[:80]} do not span "
                                f"its {nbytes} bytes")
        spans.append((span[0], span[1], name))
    end = 0
    for begin, stop, name in sorted(spans):
        if begin != end:
            raise SnapshotError(f"tensor {name} starts at byte {begin} of the data, expected "
                                f"{end}: tensors must tile the data without gaps or overlaps")
        end = stop
    return {name: begin for begin, _, name in spans}


def _all_ints(values: list[Any]) -> bool:
    return all(type(v) is int for v in values)
