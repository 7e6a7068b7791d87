"""GpuKVPool: the KVPool's pages in device memory, with graph-safe step metadata.

1. Storage: one device allocation of four 256-byte-aligned regions [K codes][V codes]
   [K scales][V scales], each token-major as the CPU pool's storage (kvcore/_storage.py):
       codes  [L][P * page_size][Hkv][W]  code dtype (W = D, or D/2 bytes for q4_0 / q4_1)
       scales [L][P * page_size][Hkv][S]  scale dtype (S = 0: the scale regions are empty)
   Page g is rows [g * page_size, (g + 1) * page_size) of every layer, as on the CPU, so a
   page is the same bytes in both pools and a step's new position of every head is one
   contiguous block (docs/gpu.md, "GpuKVPool", says why token-major).
2. Bookkeeping: kvcore._pages.PageTable, the CPU pool's own class (sequences, page lists,
   reference counts, fork with copy-on-write, truncate, free), kept on the host. Page
   copies (copy-on-write) are cuMemcpy3DAsync device-to-device on the pool's stream.
3. Step metadata, one device allocation of fixed address and capacity:
       block_tables int32 [max_batch][max_pages_per_seq]  (-1 past a sequence's pages)
       lengths      int32 [max_batch]     positions each row holds once the step is written
       q_offsets    int32 [max_batch + 1] CSR: the step's new tokens (input rows) of row b
                                          are [q_offsets[b], q_offsets[b + 1])
       slot_mapping int64 [max_batch * max_tokens]  the slot of each input row, -1 padding
       status       int32                  device error bits (kept apart from the rest)
   `begin_step` writes them into a host staging array of the same layout and copies it in
   one cuMemcpyHtoDAsync; `append` only launches (capturable; refused outside a step
   unless captured); `advance` synchronises, turns the status into an exception or commits
   the step's positions to the table, and sets the device slot mapping to -1.
   A DecodeGraph (graph.py) captures RoPE + append + decode_attention of every layer once
   and replays it between begin_step and advance.
4. One call at a time (CallGuard, as the CPU KVPool): every public call that writes the
   pool or reads its tables refuses a second thread with StateError (`_one_call`).
5. Decode attention: the split kernel of the GpuKVCache (cuda/attention.cuh) reading the
   pages through the block tables (its paged storage), for every new token of the step
   (causal), splits fixed at construction from the device and max_batch (workspace
   allocated once), so `decode_attention` only launches. The variants (docs/variants.md:
   window, sink_tokens, sinks, softcap) are run-time arguments of the same kernel; a
   window takes fewer splits (W + S positions at most), within the same workspace.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from .._guard import CallGuard
from ..attention import _check_scale
from .._pages import PageTable
from .._prefix import PrefixIndex
from .._prefix_keys import ROOT, chain_key, encode_extra, token_array
from .._storage import REGIONS, region_shapes, zeroed_pages
from .._validate import check_index, check_seq_ids
from .._window import (WindowViews, check_window, positions, restore_need, snapshot_index,
                       snapshot_span)
from ..errors import (CapacityError, CudaError, FormatError, NonFiniteError,
                      OutOfRangeError, ShapeError, SpecError, StateError)
from ..formats import describe
from ..pool import KVPool, PoolStats, _attached, _check_grouped, _counts, completed_chunks, consult_store
from ..quant import dequantize
from ..snapshot import Snapshot, fit_snapshot, snapshot_parts
from ..spec import KVSpec
from . import driver, kernels
from .cache import check_gpu_format, largest_divisor_at_most, no_residual, range_limits, region_format
from .attention import (MAX_GRID_Z, check_grouped_k, check_head_dim, check_lse, check_variants, choose_splits,
                        launch_split, split_kernel, splits_bound)
from .cache import _check_input
from .driver import Context, Event, Stream
from .memory import DeviceArray, DeviceBuffer, PinnedHost, as_device_array

ERR_NONFINITE, ERR_RANGE, ERR_SLOT, ERR_ROWS = 2, 4, 8, 16   # status bits (cuda/paged.cu)
_APPEND_WARPS = 4


def _one_call(method):
    """`method` under the pool's CallGuard (docs/design.md, Threads): a second thread calling
    any guarded method meanwhile gets StateError, having changed nothing. The guard is not
    reentrant: guarded methods call unguarded internals, and a caller holding the guard
    across several calls (DecodeGraph) calls `GpuKVPool.<method>.__wrapped__(pool, ...)`."""
    op = f"GpuKVPool.{method.__name__}"

    @functools.wraps(method)
    def guarded(self, *args, **kwargs):
        if not self._guard.acquire(False):
            self._guard.refuse(op)
        try:
            return method(self, *args, **kwargs)
        finally:
            self._guard.release()
    return guarded


def page_pieces(page_size: int, row: int, max_pitch: int) -> int:
    """k: the rows a page copy cuts a page of page_size positions of `row` bytes into, so
    that the pitch (page_size / k positions) is at most max_pitch: 1 when a page fits,
    else page_size / d for the largest divisor d of page_size with d * row <= max_pitch."""
    if page_size * row <= max_pitch:
        return 1
    return page_size // largest_divisor_at_most(page_size, max_pitch // row)


def _align(n: int) -> int:
    return (n + 255) // 256 * 256


@dataclass(frozen=True)
class TierStats:
    """A GpuKVPool's host tier since it was made: pages match_prefix found there and
    brought back (host_hits), cached pages the GPU took back and moved there (demoted) or
    dropped for want of room (dropped); and now, pages brought back that no step has
    waited for yet (gpu_pending) and host pages whose copy may still run (host_pending)."""
    host_hits: int
    demoted: int
    dropped: int
    gpu_pending: int
    host_pending: int


class _Tier:
    """The transfer stream of a host tier and the copies in flight on it."""

    def __init__(self, stream: Stream | None):
        self.stream = stream
        self.ready: dict[int, Event] = {}     # GPU page -> the copy that writes it
        self.reading: dict[int, Event] = {}   # GPU page -> the last copy out of it (store)
        # (event, host pages a copy writes, host pages a copy reads: held until it ran,
        #  what to do once it ran: submit a chunk to the store writer, release a fetch)
        self.pending: list[tuple[Event, list[int], list[int], list]] = []
        self.awaited: set[int] = set()       # events the pool's stream waits for (ids)
        self.known: set[int] = set()         # ... and has passed: done (no query needed)
        self.host_hits = self.demoted = self.dropped = 0


def _runs(moves: list) -> list[tuple[int, Any, int]]:
    """(GPU page, host page) pairs (_transfer) as (g, h, n): the n pairs from (g, h) on,
    consecutive on both sides (pages of the same arrays); n = 1 for a host tier page."""
    runs: list[tuple[int, Any, int]] = []
    for g, h in moves:
        if runs and not isinstance(h, int):
            g0, h0, n = runs[-1]
            if not isinstance(h0, int) and h0[0] is h[0] and (g, h[1]) == (g0 + n, h0[1] + n):
                runs[-1] = (g0, h0, n + 1)
                continue
        runs.append((g, h, 1))
    return runs


def _check_host(host, spec: KVSpec, page_size: int, prefix_cache: bool, window) -> KVPool | None:
    """The host tier `host=` names, checked (SpecError naming what differs)."""
    if host is None:
        return None
    if not isinstance(host, KVPool):
        raise SpecError(f"host must be a kvcore.KVPool, got {type(host).__name__}")
    if not prefix_cache or host._table.prefix is None:
        raise SpecError("a host tier needs prefix_cache=True on both pools")
    if window is not None or host.window is not None:
        raise SpecError("a host tier under a sliding window is not supported")
    hs = host.spec
    mine = (spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.format, page_size)
    theirs = (hs.num_layers, hs.num_kv_heads, hs.head_dim, hs.format, host.page_size)
    if mine != theirs:
        raise SpecError(f"the host pool holds (layers, kv heads, head_dim, format, page_size) "
                        f"{theirs}, this pool {mine}")
    return host


def _positive(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise SpecError(f"{name} must be a positive int, got {value!r}")
    return int(value)


class GpuKVPool(WindowViews, driver.DeviceOwner):
    """num_pages pages of page_size positions of `spec` in device memory, shared by many
    sequences (int ids, as KVPool's); see the module docstring for the layout.

    max_batch, max_pages_per_seq and max_tokens (new positions per step, all sequences
    together up to max_batch * max_tokens) fix the metadata buffers, whose addresses never
    change: a graph captured over `append` replays after the tables changed.

    prefix_cache=True: a prefix cache, as KVPool's (the same PageTable and PrefixIndex, so
    the same content keys): `match_prefix` starts a sequence on the cached full pages of a
    token prefix, `advance(tokens=)` registers the pages a step fills, freed sequences leave
    their registered pages cached, and a step short of free pages takes cached ones back,
    least recently used first. Shared pages are copied on the device before a write.

    host=KVPool(same spec and page_size, prefix_cache=True): a host tier. Cached pages the
    GPU takes back go to it (same keys) instead of being dropped, and `match_prefix` goes
    on from the GPU's cached pages with the host's, bringing them back. Copies run on a
    transfer stream of their own, ordered by events: a step waits only for the pages it
    touches (`tier_stats`). The host pool's memory is page-locked (cuMemHostRegister)
    while attached, until `free()`, so that the copies are DMA. The host pool is the GPU
    pool's while attached: use it only through the GPU pool.

    store=KVStore, store_writer=StoreWriter (as KVPool's, prefix_cache=True): the store
    tier. `match_prefix` goes on past the GPU's and the host's pages with the stored
    chunks that follow (read and checked on the host, copied in on the transfer stream;
    a failed lookup is a counted fault, `stats`), and each whole chunk a step completes
    is copied out on the transfer stream and submitted to the writer once the copy ran
    (at a later advance or match_prefix, or at free).

    window=W, sink_tokens=S: a sliding-window pool, as KVPool's (the same PageTable): each
    advance releases the pages no later query sees (-1 in the block tables), so a
    sequence holds about W + page_size positions plus its sink pages; decode_attention
    applies the window unless given a smaller one. The block tables still index pages by
    position: max_pages_per_seq bounds a sequence's length, not its memory.

    K q4_1ch (KVSpec(k_format="q4_1ch", v_format="q4_1" or "q4_0"); page_size a multiple
    of 32): each live sequence holds one of max_sequences (default max_batch) float16
    residuals, its open group (docs/gpu.md, "K q4_1ch"); one more sequence is refused.

    Not copyable nor picklable (DeviceCopyError): move a sequence with snapshot() and
    restore(), or offload() it into a CPU KVPool.
    """

    _holds = "device memory (its pages and step metadata) and a stream"
    _move = ("move the content instead: pool.snapshot(seq) gives a host Snapshot (which "
             "pickles, or snapshot.save(path)), and other.restore(snapshot) makes a sequence "
             "of it in another GpuKVPool; pool.offload(seq, host_pool) copies it into a CPU KVPool")

    def __init__(self, spec: KVSpec, num_pages: int, page_size: int = 16, *, max_batch: int,
                 max_pages_per_seq: int, max_tokens: int = 1, window: int | None = None,
                 sink_tokens: int = 0, prefix_cache: bool = False, host: KVPool | None = None,
                 store=None, store_writer=None, max_sequences: int | None = None, device: int = 0):
        if not isinstance(spec, KVSpec):
            raise SpecError(f"GpuKVPool needs a KVSpec, got {type(spec).__name__}")
        check_gpu_format(spec, "GpuKVPool")
        P, ps = _positive("num_pages", num_pages), _positive("page_size", page_size)
        self.max_batch = _positive("max_batch", max_batch)
        self.max_pages_per_seq = _positive("max_pages_per_seq", max_pages_per_seq)
        self.max_tokens = _positive("max_tokens", max_tokens)
        self.spec, self.page_size = spec, ps
        _check_grouped(spec, ps)
        # K q4_1ch: a residual per live sequence (its open group), max_sequences of them
        self.max_sequences = (_positive("max_sequences", max_sequences) if max_sequences is not None
                              else self.max_batch) if spec.k_fmt.group else 0
        self._guard = CallGuard("GpuKVPool")   # one call at a time (docs/design.md, Threads)
        win, sinks = check_window(window, sink_tokens)
        if not isinstance(prefix_cache, bool):
            raise SpecError(f"prefix_cache must be a bool, got {prefix_cache!r}")
        self._table = PageTable(P, ps, spec.num_layers, spec.capacity,
                                PrefixIndex() if prefix_cache else None, win, sinks)
        self._host = _check_host(host, spec, ps, prefix_cache, win)
        self._kv, self._writer = _attached(spec, ps, prefix_cache, store, store_writer, win)
        if self._kv is not None and win is not None:
            raise SpecError("a store tier under a sliding window is not supported on the GPU "
                            "pool (its lookups would place pages the window then releases "
                            "while their copies run)")
        self._store_hits = self._store_faults = 0
        self._last_fault: str | None = None
        L, H, D = spec.num_layers, spec.num_kv_heads, spec.head_dim
        # region -> bytes of one row (slot) of it: each side in its own format
        rows = P * ps
        self._row = {r: H * (region_format(spec, r).code_row_bytes(D) if r.endswith("codes")
                             else region_format(spec, r).scale_row_bytes(D)) for r in REGIONS}
        self.offsets, off = {}, 0
        for region in REGIONS:
            self.offsets[region] = off
            off += _align(L * rows * self._row[region])
        self.offsets["k_residual"] = off      # [L][max_sequences][Hkv][32][D] float16
        self._res_bytes = H * spec.k_fmt.group * D * 2      # one sequence's, one layer's
        data_bytes = off + _align(L * self.max_sequences * self._res_bytes)
        B, M, T = self.max_batch, self.max_pages_per_seq, self.max_batch * self.max_tokens
        self.meta_offsets = {"block_tables": 0, "lengths": _align(4 * B * M)}
        self.meta_offsets["q_offsets"] = self.meta_offsets["lengths"] + _align(4 * B)
        self.meta_offsets["slot_mapping"] = self.meta_offsets["q_offsets"] + _align(4 * (B + 1))
        self.meta_offsets["res_slots"] = self.meta_offsets["slot_mapping"] + _align(8 * T)
        self.meta_offsets["status"] = self.meta_offsets["res_slots"] + _align(4 * B)
        meta_bytes = self.meta_offsets["status"] + 256
        self.ctx = Context.get(device)
        with self.ctx:
            self._create(data_bytes, meta_bytes)

    def _create(self, data_bytes: int, meta_bytes: int) -> None:
        # kernels first: a driver that cannot load them leaves nothing behind
        self._fn_append = kernels.function("paged", "kv_paged_append", self.ctx)
        # page copies cut a page into k rows when one passes the device's largest pitch
        limit = self.ctx.attribute(driver.cuda().CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_PITCH)
        self._page_pieces = {r: page_pieces(self.page_size, self._row[r], limit) for r in REGIONS}
        driver.refuse_while_capturing("GpuKVPool()")
        self._plan_decode()
        P, ps = self.num_pages, self.page_size
        B, M, T = self.max_batch, self.max_pages_per_seq, self.max_batch * self.max_tokens
        free, _ = self.ctx.mem_get_info()
        ws_bytes = self._ws_bytes()
        if data_bytes + meta_bytes + ws_bytes > free:
            raise SpecError(f"GpuKVPool of {P} pages of {ps} positions needs "
                            f"{data_bytes + meta_bytes + ws_bytes} bytes, the device has "
                            f"{free} free")
        self.stream = Stream.create(self.ctx)
        self.generation = 0
        tiered = self._host is not None or self._kv is not None
        self._tier = _Tier(Stream.create(self.ctx, non_blocking=True) if tiered else None)
        self._ws: DeviceBuffer | None = None
        self._sinks: dict[bytes, DeviceBuffer] = {}   # host sinks uploaded, by content
        try:
            self._data = DeviceBuffer.alloc(data_bytes, ctx=self.ctx)
            self._meta = DeviceBuffer.zeros(meta_bytes, ctx=self.ctx)
            if ws_bytes:
                self._ws = DeviceBuffer.alloc(ws_bytes, ctx=self.ctx)
            # the host tier's pages page-locked: its copies are DMA on the transfer stream
            self._pinned = PinnedHost(self._host._storage, self.ctx) if self._host else None
        except BaseException:
            for buf in ("_ws", "_meta", "_data"):
                if getattr(self, buf, None) is not None:
                    getattr(self, buf).free()
            self.stream.destroy()
            if self._tier.stream is not None:
                self._tier.stream.destroy()
            raise
        # host staging of [block tables][lengths][q offsets][slot mapping], page-aligned
        self._staging = zeroed_pages(self.meta_offsets["status"])
        self._host_tables = self._view_staging("block_tables", (B, M), np.int32)
        self._host_lengths = self._view_staging("lengths", (B,), np.int32)
        self._host_q_offsets = self._view_staging("q_offsets", (B + 1,), np.int32)
        self._host_slots = self._view_staging("slot_mapping", (T,), np.int64)
        self._host_res = self._view_staging("res_slots", (B,), np.int32)
        self._res: dict[int, int] = {}                  # K q4_1ch: seq -> its residual
        self._res_free = list(range(self.max_sequences))[::-1]
        self._host_tables[:] = -1
        self._host_slots[:] = -1
        self._meta.copy_from_host(self._staging)
        self._step: tuple[list[int], list[int]] | None = None

    def _plan_decode(self) -> None:
        """The decode kernel and its splits, fixed for the pool's life: splits from the
        device and max_batch (one token per sequence) alone, never from lengths (each block
        takes its share of its row's length on the device). A head_dim the kernel does not
        take leaves decode_attention refusing (append and the rest work)."""
        s = self.spec
        self._decode_error: Exception | None = None
        self._fn_decode = self._fn_merge = None
        self.num_splits = 1
        rows = self.max_batch * self.max_tokens
        try:
            check_head_dim(s.head_dim, "GpuKVPool.decode_attention")
            check_grouped_k(s, "GpuKVPool.decode_attention")
        except FormatError as e:
            self._decode_error = e
            return
        if rows > MAX_GRID_Z:
            self._decode_error = ShapeError(
                f"GpuKVPool.decode_attention takes at most {MAX_GRID_Z} query rows (the grid's "
                f"z dimension), max_batch x max_tokens is {rows}")
            return
        self._fn_decode, self._gb, resident = split_kernel(s.format, s.head_dim, s.group_size,
                                                           self.ctx, paged=True)
        self._fn_merge = kernels.function("attention", "kv_attn_merge", self.ctx)
        blocks = self.max_batch * s.num_kv_heads * (s.group_size // self._gb)
        self.num_splits = choose_splits(blocks, resident, self.max_pages_per_seq * self.page_size)
        # splits of a windowed decode (fewer: W + S positions at most), by bound
        most = self.num_splits
        self._window_splits = functools.lru_cache(maxsize=64)(
            lambda bound: min(most, choose_splits(blocks, resident, bound)))

    def _ws_bytes(self) -> int:
        """Bytes of the split workspace: o [rows][Hq][splits][D] and lse [rows][Hq][splits]."""
        if self.num_splits == 1:
            return 0
        s = self.spec
        return 4 * self.max_batch * self.max_tokens * s.num_heads * self.num_splits * (s.head_dim + 1)

    def _view_staging(self, name: str, shape, dtype) -> np.ndarray:
        off = self.meta_offsets[name]
        n = int(np.prod(shape)) * np.dtype(dtype).itemsize
        return self._staging[off:off + n].view(dtype).reshape(shape)

    # ------------------------------------------------------------------ state

    def _alive(self) -> None:
        if self._data.freed:
            raise StateError("GpuKVPool used after free()")

    @property
    def tier_stats(self) -> TierStats:
        """The host tier's counters (TierStats; zeros without one)."""
        t = self._tier
        return TierStats(t.host_hits, t.demoted, t.dropped, len(t.ready),
                         sum(len(w) + len(r) for _, w, r, _ in t.pending))

    @property
    def stats(self) -> PoolStats:
        """Free, cached and in-use pages, the prefix cache's counters and the store's
        (PoolStats, as KVPool's)."""
        return PoolStats(*self._table.counts(), self._store_hits, self._store_faults,
                         self._last_fault)

    @property
    def memory_bytes(self) -> int:
        """Device bytes allocated (data, metadata, the decode's split workspace and the
        copies of host sinks given to decode_attention)."""
        return (self._data.nbytes + self._meta.nbytes + (0 if self._ws is None else self._ws.nbytes)
                + sum(b.nbytes for b in self._sinks.values()))

    # ------------------------------------------------------------------ device views

    def _meta_view(self, name: str, shape, dtype) -> DeviceArray:
        self._alive()
        return self._meta.view(shape, dtype, offset=self.meta_offsets[name])

    @property
    def block_tables(self) -> DeviceArray:
        """Device int32 [max_batch, max_pages_per_seq]: row b = the pages of the step's
        b-th sequence, then -1 (written by begin_step)."""
        return self._meta_view("block_tables", (self.max_batch, self.max_pages_per_seq), np.int32)

    @property
    def lengths(self) -> DeviceArray:
        """Device int32 [max_batch]: positions row b holds once the step is written (0 past
        the step's sequences)."""
        return self._meta_view("lengths", (self.max_batch,), np.int32)

    @property
    def q_offsets(self) -> DeviceArray:
        """Device int32 [max_batch + 1]: the step's input rows of row b are
        [q_offsets[b], q_offsets[b + 1]) (written by begin_step; the total past the
        step's sequences)."""
        return self._meta_view("q_offsets", (self.max_batch + 1,), np.int32)

    @property
    def slot_mapping(self) -> DeviceArray:
        """Device int64 [max_batch * max_tokens]: slot (page * page_size + offset) of each
        input row of the step, -1 for padding."""
        return self._meta_view("slot_mapping", (self.max_batch * self.max_tokens,), np.int64)

    @property
    def status(self) -> DeviceArray:
        """Device int32 [1]: bit 2 non-finite input, 4 value out of range, 8 slot outside
        the pool; raised and cleared by check()/advance()."""
        return self._meta_view("status", (1,), np.int32)

    def _region_view(self, region: str, layer: int) -> DeviceArray:
        self._alive()
        layer = check_index("layer", layer, self.spec.num_layers)
        s, f = self.spec, region_format(self.spec, region)
        if region.endswith("scales") and not f.quantized:
            raise FormatError(f"format {f.name} has no scales"
                              + (f" ({region[0].upper()} of {s.format})" if s.paired else ""))
        width = f.code_width(s.head_dim) if region.endswith("codes") else f.scales_per_row(s.head_dim)
        dtype = f.code_dtype if region.endswith("codes") else f.scale_dtype
        rows = self.num_pages * self.page_size
        return self._data.view((self.num_pages, self.page_size, s.num_kv_heads, width), dtype,
                               offset=self.offsets[region] + layer * rows * self._row[region])

    def keys(self, layer: int) -> DeviceArray:
        """K codes of `layer`: [P, page_size, Hkv, W] code dtype (W = D, or D/2 for q4_0 / q4_1)."""
        return self._region_view("k_codes", layer)

    def values(self, layer: int) -> DeviceArray:
        return self._region_view("v_codes", layer)

    def key_scales(self, layer: int) -> DeviceArray:
        """K scales of `layer`: [P, page_size, Hkv, S]; FormatError without scales."""
        return self._region_view("k_scales", layer)

    def value_scales(self, layer: int) -> DeviceArray:
        return self._region_view("v_scales", layer)

    def key_residual(self, layer: int) -> DeviceArray:
        """K q4_1ch's residuals of `layer`: float16 [max_sequences, Hkv, 32, D], one per live
        sequence (which one is the pool's to choose), slot p mod 32 holding position p of
        its open group; FormatError for every other K format."""
        self._alive()
        layer = check_index("layer", layer, self.spec.num_layers)
        if not self.max_sequences:
            raise no_residual(self.spec)
        s = self.spec
        return self._data.view((self.max_sequences, s.num_kv_heads, s.k_fmt.group, s.head_dim),
                               np.float16, offset=self._residual_base(layer) - self._data.ptr)

    # ------------------------------------------------------------------ page copies

    def _regions(self) -> tuple[str, ...]:
        return tuple(r for r in REGIONS if self._row[r])

    def _copy_page(self, region: str, page: int, *, dst_page: int | None = None,
                   host: np.ndarray | None = None, index: int = 0, to_host: bool = False,
                   stream: Stream | None = None) -> None:
        """One page of `region`, every layer, in one cuMemcpy3DAsync on `stream` (default the
        pool's): to page dst_page, or between the device and page `index` of host
        [L][k * page_size][Hkv][W] (C order). Each side is pages of page_bytes in slices of
        a layer (z = the layer), a page being k rows of page_bytes / k (the pitch; y = k *
        the page), k = 1 unless a page passes the device's largest pitch (2^31 - 1 bytes;
        _page_pieces), so no pitch passes the driver's limit however large the pool or its
        pages."""
        drv = driver.cuda()
        L, ps = self.spec.num_layers, self.page_size
        k = self._page_pieces[region]
        pitch = ps // k * self._row[region]
        p = drv.CUDA_MEMCPY3D()

        def side(name, kind, address, g, pages):
            setattr(p, name + "MemoryType", kind)
            if kind == drv.CUmemorytype.CU_MEMORYTYPE_HOST:
                setattr(p, name + "Host", address)
            else:
                setattr(p, name + "Device", drv.CUdeviceptr(address))
            setattr(p, name + "Pitch", pitch)
            setattr(p, name + "Height", pages * k)   # a layer: pages pages of k rows
            setattr(p, name + "Y", g * k)

        device = (drv.CUmemorytype.CU_MEMORYTYPE_DEVICE, self._data.ptr + self.offsets[region])
        if host is None:
            side("src", *device, page, self.num_pages)
            side("dst", *device, dst_page, self.num_pages)
        else:
            h, d = ("dst", "src") if to_host else ("src", "dst")
            side(h, drv.CUmemorytype.CU_MEMORYTYPE_HOST, host.ctypes.data, index,
                 host.nbytes // L // (ps * self._row[region]))
            side(d, *device, page, self.num_pages)
        p.WidthInBytes = pitch
        p.Height = k
        p.Depth = L
        driver.call("cuMemcpy3DAsync", p, (stream or self.stream).handle)

    def _copy_run(self, page: int, host: dict[str, np.ndarray], index: int, n: int, *,
                  to_host: bool, stream: Stream, touched: list, pairs: list) -> None:
        """n consecutive pages from GPU page `page` on, every region and layer, to pages
        index.. of host arrays ([L][pages * page_size][Hkv][W] C order, by region name: a
        store chunk's, pageable memory) or from them (to_host False), on `stream`; `touched`
        gets `pairs` once the first copy is queued. One cuMemcpyHtoDAsync / DtoHAsync of
        n pages per region and layer. From pageable memory the driver stages a copy
        through page-locked buffers, a 3-D one row by row: a few large 1-D copies per
        chunk, not a 3-D copy per page (_copy_page)."""
        drv, ps, L = driver.cuda(), self.page_size, self.spec.num_layers
        copies = []                     # (device address, host address, bytes)
        for region in self._regions():
            row, arr = self._row[region], host[region]
            dev = self._data.ptr + self.offsets[region] + page * ps * row
            at = arr.ctypes.data + index * ps * row
            copies += [(dev + z * self.num_pages * ps * row, at + z * arr.strides[0], n * ps * row)
                       for z in range(L)]
        for k, (d, h, size) in enumerate(copies):
            d = drv.CUdeviceptr(d)
            if to_host:
                driver.call("cuMemcpyDtoHAsync", h, d, size, stream.handle)
            else:
                driver.call("cuMemcpyHtoDAsync", d, h, size, stream.handle)
            if k == 0:
                touched += pairs

    def _copy_pages(self, copies) -> None:
        for src, dst in copies:
            for region in self._regions():
                self._copy_page(region, src, dst_page=dst)

    # ------------------------------------------------------------------ the host tier

    def _settle(self, *, wait: bool = True) -> None:
        """Retires the copies of the transfer stream known to be done (wait: all of them,
        waiting on the host for the last event): drops the holds of the host pages they
        read. Known done, without asking the device: the copies up to the last event the
        pool's stream waited for and then passed (`_sync`), since the transfer stream runs
        its copies in order. The host pool's bytes are its own again once all are
        retired. Needed by no copy: a host page a queued copy reads is held (never taken
        back) until it is retired, and copies into host pages run in order. Copies out to
        the store (no step waits for them) are asked for (cuEventQuery) once the copies
        before them are retired; retiring one submits its chunks to the store writer."""
        t = self._tier
        if wait and t.pending:
            t.pending[-1][0].synchronize()
            last = len(t.pending)
        else:
            last = max((i + 1 for i, (ev, *_) in enumerate(t.pending) if id(ev) in t.known),
                       default=0)
            while last < len(t.pending) and t.pending[last][3] and t.pending[last][0].done():
                last += 1
        done = t.pending[:last]
        for ev, _, held, then in done:
            if held:
                self._host._table.release(held)
            for fn in then:
                fn()
        gone = {id(ev) for ev, *_ in done}
        t.ready = {g: e for g, e in t.ready.items() if id(e) not in gone}
        t.reading = {g: e for g, e in t.reading.items() if id(e) not in gone}
        for ev, *_ in done:
            ev.destroy()
        t.pending = t.pending[last:]
        t.known -= gone
        t.awaited -= gone

    def _sync(self) -> None:
        """Synchronises the pool's stream: the transfers it waited for are done too."""
        self.stream.synchronize()
        self._tier.known |= self._tier.awaited

    def _transfer(self, moves, *, to_host: bool, written: list[int], read: list[int],
                  touched: list, then: list | None = None) -> Event:
        """Copies (GPU page, host page) pairs on the transfer stream, after the pool's work
        so far (which may still use the GPU pages), every region and layer; returns the
        event that marks them done (kept in pending with the host pages they write/read
        and `then`, run once they ran). A host page is page h of the host tier, or
        (arrays, h): page h of [L][pages * page_size][Hkv][W] arrays by region name (a
        store chunk's). `touched` gets each pair as soon as a copy of it is queued (what
        a failure left written)."""
        t = self._tier
        driver.order_after(self.stream.ptr, t.stream, self.ctx, "the pool's work")
        i = 0
        for g, h, n in _runs(moves):
            if isinstance(h, int):      # the host tier's (page-locked): page by page
                for region in self._regions():
                    self._copy_page(region, g, host=self._host._store.regions[region], index=h,
                                    to_host=to_host, stream=t.stream)
                    if not touched or touched[-1] != (g, h):
                        touched.append((g, h))
            else:
                self._copy_run(g, *h, n, to_host=to_host, stream=t.stream, touched=touched,
                               pairs=moves[i:i + n])
            i += n
        ev = Event.create(self.ctx, timing=False)
        ev.record(stream=t.stream)
        t.pending.append((ev, written, read, then or []))
        return ev

    def _demote(self, pages: list[int]):
        """Queues the copies of cached GPU pages about to be taken back to the host tier,
        each under its key (unless the host has it, or no room: dropped), into host pages
        taken as a write takes them; returns (commit, undo). commit(wait) records them in
        the host table and, with wait, makes the pool's stream wait for these copies (a
        caller that writes the pages on it; a bring-back's copies in follow them on the
        transfer stream); undo() drops the cached host pages the copies overwrote, for a
        caller whose later step failed. A failed copy undoes and raises: with free host pages
        taken, both pools are as they were. A host page a queued copy still writes may be
        taken again: the later copy runs after it, on the same stream."""
        nothing = (lambda wait: None, lambda: None)
        if self._host is None or not pages:
            return nothing
        self._settle(wait=False)
        host, t = self._host._table, self._tier
        entries = [self._table.prefix.entries[g] for g in pages]
        moving = [(g, e) for g, e in zip(pages, entries) if e.key not in host.prefix.by_key]
        slots, evicted = host.plan_take(len(moving))
        dropped, moving = len(moving) - len(slots), moving[:len(slots)]
        touched: list[tuple[int, int]] = []

        def undo():
            host.drop([h for _, h in touched if h in evicted])

        done: list[Event] = []

        def commit(wait: bool):
            t.dropped += dropped
            if moving:
                host.admit(slots, evicted, [e for _, e in moving])
                if wait:
                    driver.call("cuStreamWaitEvent", self.stream.handle, done[0].handle, 0)
                    t.awaited.add(id(done[0]))
                t.demoted += len(moving)

        if moving:
            try:
                done.append(self._transfer([(g, h) for (g, _), h in zip(moving, slots)],
                                           to_host=True, written=slots, read=[], touched=touched))
            except BaseException:
                undo()
                raise
        return commit, undo

    def _bring_back(self, s: int, ids: np.ndarray) -> int:
        """After match_prefix's GPU pages: the host tier's pages that go on with the prefix
        copied into GPU pages (taken as a step takes them: cached ones demoted first), as
        many as the GPU has room for; returns s's committed positions. No step of s (nor
        fork or snapshot) runs before the copies: it waits for their event. A failed copy
        raises with no sequence made, dropping only cached pages a queued copy overwrote."""
        table, ps = self._table, self.page_size
        seq = table.get(s)
        self._settle(wait=False)
        host = self._host._table
        raw = ids.astype("<i8", copy=False).tobytes()
        parent = seq.keys[-1] if seq.keys else ROOT
        chain: list[tuple[int, bytes, bytes]] = []
        for i in range(len(seq.pages), max(0, (ids.size - 1) // ps)):
            key = chain_key(parent, ids[i * ps:(i + 1) * ps], seq.extra)
            block = raw[8 * i * ps:8 * (i + 1) * ps]
            h = host.prefix.find(parent, key, block, seq.extra)
            if h is None:
                break
            chain.append((h, key, block))
            parent = key
        pages, evicted = table.plan_take(len(chain))
        chain = chain[:len(pages)]
        if not chain:
            return seq.length
        held = [h for h, _, _ in chain]
        order = host.hold(held)
        self._copy_in(s, pages, evicted, held, [(key, block) for _, key, block in chain],
                      read=held, failed=lambda: host.release(held, order))
        self._tier.host_hits += len(chain)
        return seq.length

    def _copy_in(self, s: int, pages: list[int], evicted: list[int], sources: list,
                 blocks: list[tuple[bytes, bytes]], *, failed, read: Sequence[int] = (),
                 then: Sequence = ()) -> None:
        """Copies `sources` (host tier pages, or (arrays, index): _transfer) into GPU
        `pages` taken by plan_take (the cached ones among them, `evicted`, demoted first)
        on the transfer stream, then extends sequence s with them under `blocks` ((key,
        token bytes) each) as hits; no step of s runs before the copies (`ready`). A
        failed copy: `failed()` runs, cached GPU pages a queued copy overwrote are
        dropped, s is freed, and it raises."""
        table, touched = self._table, []
        try:
            commit, undo = self._demote(evicted)
            try:
                ev = self._transfer(list(zip(pages, sources)), to_host=False, written=[],
                                    read=list(read), touched=touched, then=list(then))
            except BaseException:
                undo()
                raise
        except BaseException:
            failed()
            table.drop([g for g, _ in touched if g in evicted])
            table.free_seq(s)
            raise
        commit(wait=False)
        for g in pages:
            self._tier.ready[g] = ev
        table.extend(s, pages, evicted, blocks)
        table.prefix.misses -= len(pages)

    def _await(self, pages, ready: dict[int, Event] | None = None) -> None:
        """The pool's stream waits for the copies that bring `pages` back (an event each);
        given `ready` = the tier's `reading`: for the copies out of pages about to be
        written."""
        ready = self._tier.ready if ready is None else ready
        if not ready:
            return
        events = {id(e): e for e in (ready.pop(g, None) for g in pages) if e is not None}
        for e in events.values():
            driver.call("cuStreamWaitEvent", self.stream.handle, e.handle, 0)
            self._tier.awaited.add(id(e))

    # ------------------------------------------------------------------ the store

    def _load_stored(self, s: int, ids: np.ndarray, extra: bytes) -> int:
        """After the GPU's and the host's pages: the store's chunks that go on with the
        prefix, read and checked (a failed lookup or a refused chunk is a counted fault, as
        KVPool's), copied into GPU pages taken as a step takes them (cached ones demoted
        first), as many as the GPU and the block tables have room for; returns s's
        committed positions. The copies run on the transfer stream (no step of s runs
        before their event); the fetch's buffers are released once they ran. A failed
        copy raises with no sequence made, as _bring_back."""
        table, ps = self._table, self.page_size
        seq = table.get(s)
        limit = min(ids.size - 1, self.spec.capacity, self.max_pages_per_seq * ps)
        fetch = self._kv._fetch(ids, extra, seq.length, limit, seq.keys)
        if fetch.first >= len(fetch.keys):
            return seq.length
        chunks = consult_store(fetch)
        c, start = fetch.chunk_tokens, seq.length
        moves, blocks = [], []          # (arrays, page in chunk), (key, token bytes) per page
        parent = seq.keys[-1] if seq.keys else ROOT
        raw = ids.astype("<i8", copy=False).tobytes()
        for i, parts in chunks:
            if i * c > start + len(moves) * ps:
                break                   # a gap
            for j in range(c // ps):
                p = i * c + j * ps      # the page's first position
                if p < start + len(moves) * ps:
                    continue            # held already
                key = chain_key(parent, ids[p:p + ps], extra)
                moves.append((parts, j))
                blocks.append((key, raw[8 * p:8 * (p + ps)]))
                parent = key
        pages, evicted = table.plan_take(len(moves))
        pages.sort()                    # consecutive ones are copied as one run (_runs)
        moves, blocks = moves[:len(pages)], blocks[:len(pages)]
        if fetch.fault is not None:
            self._store_faults += 1
            self._last_fault = fetch.fault
        if not moves:
            fetch.release()
            return seq.length
        def failed():
            with contextlib.suppress(CudaError):
                self._tier.stream.synchronize()   # the copies queued still read the fetch's
            fetch.release()

        self._copy_in(s, pages, evicted, moves, blocks, then=[fetch.release],
                      failed=failed)
        self._store_hits += len(pages)
        return seq.length

    def _save_chunks(self, seqs: list[int], added: list[int]) -> None:
        """(advance) The whole chunks the step completed, copied out of their GPU pages into
        host arrays on the transfer stream, after the step; each is submitted to the store
        writer once its copy ran (`_settle`). Until then a step that writes one of those
        pages waits for the copy (`reading`). A copy that cannot be queued: CudaError (the
        caller counts it as a store fault; the step stays committed)."""
        assert self._kv is not None and self._writer is not None
        c, ps = self._kv.chunk_tokens, self.page_size
        moves, then = [], []
        for s, n in zip(seqs, added):
            pages = self._table.get(s).pages
            for j, key, ids, parent in completed_chunks(self._table, s, n, c):
                parts = {name: np.empty(shape, dtype)
                         for name, shape, dtype in region_shapes(self.spec, c)
                         if name in self._regions()}
                moves += [(g, (parts, k)) for k, g in enumerate(pages[j * c // ps:(j + 1) * c // ps])]
                then.append(functools.partial(self._writer._submit_chunk, key, ids,
                                              functools.partial(dict, parts), parent=parent))
        if moves:
            ev = self._transfer(moves, to_host=True, written=[], read=[], touched=[], then=then)
            for g, _ in moves:
                self._tier.reading[g] = ev

    # ------------------------------------------------------------------ sequences

    def _host_call(self, what: str) -> None:
        """Checks that the pool is usable from the host now: alive, not capturing."""
        self._alive()
        driver.refuse_while_capturing(f"GpuKVPool.{what}", self.stream)

    def _idle(self, what: str) -> None:
        self._host_call(what)
        if self._step is not None:
            raise StateError(f"GpuKVPool.{what} inside a step: advance() it first")

    def _residual_offset(self, layer: int, seq: int) -> int:
        """Byte offset of seq's residual [Hkv][32][D] float16 in `layer` (K q4_1ch)."""
        return self._residual_base(layer) - self._data.ptr + self._res[seq] * self._res_bytes

    def _need_residual(self, what: str) -> None:
        """CapacityError, before anything changes, when a K q4_1ch pool has no residual
        left for one more sequence."""
        if self.max_sequences and not self._res_free:
            raise CapacityError(f"GpuKVPool.{what}: every one of the {self.max_sequences} residuals "
                                f"(K {self.spec.k_format}'s open groups, max_sequences) is held by a "
                                f"live sequence: free one, or make the pool with a larger max_sequences")

    def _take_residual(self, seq: int) -> int:
        if self.max_sequences:
            self._res[seq] = self._res_free.pop()
        return seq

    def _residual_host(self, seq: int) -> np.ndarray:
        """seq's residual, every layer: float16 [L][Hkv][32][D] (synchronises)."""
        s = self.spec
        out = np.empty((s.num_layers, s.num_kv_heads, s.k_fmt.group, s.head_dim), np.float16)
        for layer in range(s.num_layers):
            self._data.copy_to_host(out[layer], offset=self._residual_offset(layer, seq), stream=self.stream)
        self._sync()
        return out

    def _write_residual(self, seq: int, res: np.ndarray) -> None:
        """seq's residual of every layer from float16 [L][Hkv][32][D] (synchronises)."""
        for layer in range(self.spec.num_layers):
            self._data.copy_from_host(np.ascontiguousarray(res[layer]),
                                      offset=self._residual_offset(layer, seq), stream=self.stream)
        self._sync()

    def _open_group(self, seq: int, parts: dict) -> Any:
        """snapshot_parts' open_group of seq (K q4_1ch; None otherwise): the open group of
        its first n positions, float16 [n % 32, Hkv, D], from its residual when that group
        is the sequence's own open group, else decoded from the gathered codes (parts)."""
        if not self.max_sequences:
            return None
        G, length = self.spec.k_fmt.group, self._table.get(seq).length
        res = self._residual_host(seq)

        def open_group(layer: int, n: int) -> np.ndarray:
            start = n - n % G
            if start == length - length % G:
                return np.ascontiguousarray(res[layer, :, :n - start].swapaxes(0, 1))
            group = dequantize(parts["k_codes"][layer, start:start + G].swapaxes(0, 1),
                               parts["k_scales"][layer, start:start + G].swapaxes(0, 1), self.spec.k_fmt)
            return group.swapaxes(0, 1)[:n - start].astype(np.float16)
        return open_group

    @_one_call
    @driver.in_context
    def new_sequence(self) -> int:
        """A new empty sequence (no page yet); returns its id. K q4_1ch: CapacityError when
        max_sequences live sequences hold every residual."""
        self._idle("new_sequence")
        self._need_residual("new_sequence")
        return self._take_residual(self._table.new())

    @_one_call
    @driver.in_context
    def match_prefix(self, tokens, extra=None) -> tuple[int, int]:
        """A new sequence holding, by reference, the longest run of cached full pages that
        starts `tokens` (ints >= 0, or a 1-D integer array) under the same extras, at most
        len(tokens) - 1 positions, as KVPool.match_prefix (the same keys); returns (seq, n):
        its n committed positions are tokens[:n]. Step the rest with begin_step / append /
        advance(tokens=...). StateError without a prefix cache. No device work: the pages
        are shared, and copied on the device before a step writes into one."""
        self._idle("match_prefix")
        if self._table.prefix is None:
            raise StateError("match_prefix needs a pool made with prefix_cache=True")
        ids = token_array(tokens)
        extra_bytes = encode_extra(extra)
        self._need_residual("match_prefix")
        s, n = self._table.match(ids, extra_bytes)
        self._take_residual(s)        # n is whole pages, so whole groups: no open group
        if self._host is not None:
            n = self._bring_back(s, ids)
        if self._kv is not None:
            n = self._load_stored(s, ids, extra_bytes)
        return s, n

    @_one_call
    @driver.in_context
    def free_sequence(self, seq: int) -> None:
        """Releases seq's pages (a page shared with a fork stays with it; with a prefix
        cache a registered page no one holds stays cached)."""
        self._idle("free_sequence")
        self._table.free_seq(seq)
        if seq in self._res:
            self._res_free.append(self._res.pop(seq))

    @_one_call
    @driver.in_context
    def truncate(self, seq: int, n: int) -> None:
        """Keeps the first n positions of seq (0 <= n <= length), releasing later pages."""
        self._idle("truncate")
        G = self.spec.k_fmt.group
        length = self._table.get(seq).length
        if G and isinstance(n, (int, np.integer)) and 0 < n <= length and n % G and n - n % G + G <= length:
            # into a complete group: decoded into the residual (as the CPU's), read first
            start = n - n % G
            parts = self._gather(seq)
            group = dequantize(parts["k_codes"][:, start:start + G].swapaxes(1, 2),
                               parts["k_scales"][:, start:start + G].swapaxes(1, 2), self.spec.k_fmt)
            self._table.truncate(seq, n)
            self._write_residual(seq, group.astype(np.float16))
            return
        self._table.truncate(seq, n)

    @_one_call
    @driver.in_context
    def fork(self, seq: int) -> int:
        """A new sequence holding seq's positions: full pages shared, the partial last page
        copied on the device (CapacityError, nothing changed, when no page is free)."""
        self._idle("fork")
        self._need_residual("fork")
        self._await(self._table.get(seq).pages)
        t, copy = self._table.fork(seq)
        if copy is not None:
            self._await([copy[1]], self._tier.reading)
            self._copy_pages([copy])
        if self.max_sequences:
            self._take_residual(t)
            ptr = driver.cuda().CUdeviceptr
            for layer in range(self.spec.num_layers):
                driver.call("cuMemcpyDtoDAsync", ptr(self._data.ptr + self._residual_offset(layer, t)),
                            ptr(self._data.ptr + self._residual_offset(layer, seq)), self._res_bytes,
                            self.stream.handle)
        return t

    # ------------------------------------------------------------------ steps

    @_one_call
    @driver.in_context
    def begin_step(self, seqs: Sequence[int], counts: Sequence[int] | None = None) -> None:
        """Plans a step of counts[b] (default 1) new positions for seqs[b]: takes their pages
        (copy-on-write of shared ones on the device), writes the block tables, lengths and
        slot mapping (rows in seqs order, packed, then -1) into the metadata buffers with
        one host-to-device copy. Synchronises the pool's stream first (the staging array
        is reused). A refused call (StateError, ShapeError, CapacityError) changes nothing."""
        self._idle("begin_step")
        seqs = check_seq_ids("seqs", seqs)
        counts = [1] * len(seqs) if counts is None else _counts(counts, len(seqs))
        if len(seqs) > self.max_batch:
            raise ShapeError(f"a step of {len(seqs)} sequences, the pool's max_batch is "
                             f"{self.max_batch}")
        T = self.max_batch * self.max_tokens
        if sum(counts) > T:
            raise ShapeError(f"a step of {sum(counts)} new positions, the slot mapping holds "
                             f"{T} (max_batch x max_tokens)")
        limit = self.max_pages_per_seq * self.page_size
        for s, c in zip(seqs, counts):
            if self._table.get(s).length + c > limit:
                raise CapacityError(f"sequence {s} would hold {self._table.get(s).length + c} "
                                    f"positions, the block tables hold {limit} "
                                    f"({self.max_pages_per_seq} pages of {self.page_size})")
        plan = self._table.plan_write(None, seqs, counts)
        self._sync()
        self._demote(plan.evict)[0](wait=True)   # before the step's copies and writes reuse them
        self._await([g for s in seqs for g in self._table.get(s).pages])
        self._await([r // self.page_size for r in plan.rows] + [d for _, d in plan.copies],
                    self._tier.reading)
        self._copy_pages(plan.copies)
        self._table.commit_write(plan)
        self._host_tables[:] = -1
        self._host_lengths[:] = 0
        self._host_slots[:] = -1
        self._host_res[:] = 0
        self._host_q_offsets[0] = 0
        self._host_q_offsets[1:] = sum(counts)
        self._host_q_offsets[1:len(counts) + 1] = np.cumsum(counts)
        for b, (s, c) in enumerate(zip(seqs, counts)):
            pages = self._table.get(s).pages
            n = self._table.get(s).length + c
            used = -(-n // self.page_size)
            self._host_tables[b, :used] = pages[:used]
            self._host_lengths[b] = n
            self._host_res[b] = self._res.get(s, 0)
        self._host_slots[:len(plan.rows)] = plan.rows
        self._meta.copy_from_host(self._staging, stream=self.stream)
        self._step = (seqs, counts)

    @_one_call
    @driver.in_context
    def append(self, layer: int, k, v, *, stream=None) -> None:
        """Quantizes input rows t of k, v (device float32/float16/bfloat16 [T, Hkv, D], last
        axis contiguous, T <= max_batch * max_tokens) into `layer` at slot_mapping[t]
        (-1: skipped). Launch only (no sync; capturable). T must cover the step's new
        positions: fewer is refused here (ShapeError) and, in a replayed graph, by the
        device (the launch writes nothing; advance raises). A slot outside the pool writes
        nothing and sets the status; so does (for its row) a non-finite or out-of-range value.
        Outside a step (no begin_step since the last advance) StateError, nothing launched,
        unless the stream is capturing (the graph replays inside a step)."""
        self._alive()
        s = self.spec
        layer = check_index("layer", layer, s.num_layers)
        st = self.stream if stream is None else stream
        k = as_device_array(k, "k", stream=st)
        v = as_device_array(v, "v", stream=st)
        for name, x in (("k", k), ("v", v)):
            _check_input(name, x, ["T", s.num_kv_heads, s.head_dim])
        if v.shape != k.shape or v.dtype != k.dtype or v.strides != k.strides:
            raise ShapeError(f"invalid v: expected the shape, dtype and strides of k "
                             f"({list(k.shape)} {k.dtype}), got {list(v.shape)} {v.dtype}")
        T = k.shape[0]
        if not 1 <= T <= self.max_batch * self.max_tokens:
            raise ShapeError(f"invalid shape of k: expected [T, {s.num_kv_heads}, {s.head_dim}] "
                             f"with 1 <= T <= {self.max_batch * self.max_tokens}, got {list(k.shape)}")
        n = self._step_positions()
        if n is None:
            self._refuse_outside_step("append", st)
        elif n > T:
            raise ShapeError(f"invalid k: the step has {n} new positions, k holds {T} rows")
        in_dtype = {"float32": 0, "float16": 1, "bfloat16": 2}[k.dtype.name]
        isz = k.dtype.itemsize
        rows = self.num_pages * self.page_size
        base = [self._data.ptr + self.offsets[r] + layer * rows * self._row[r] if self._row[r] else 0
                for r in REGIONS]
        meta, off = self._meta.ptr, self.meta_offsets
        warps = 2 * T * s.num_kv_heads
        args = [
            (k.ptr, None), (v.ptr, None), (in_dtype, ctypes.c_int),
            (k.strides[0] // isz, ctypes.c_longlong), (k.strides[1] // isz, ctypes.c_longlong),
            *((b, None) for b in base), (self._residual_base(layer), None),
            (meta + off["slot_mapping"], None), (rows, ctypes.c_longlong),
            (meta + off["status"], None), (meta + off["lengths"], None),
            (meta + off["q_offsets"], None), (meta + off["res_slots"], None),
            (self.max_batch, ctypes.c_int),
            (s.k_fmt.id, ctypes.c_int), (s.v_fmt.id, ctypes.c_int), (T, ctypes.c_int),
            (self.max_batch * self.max_tokens, ctypes.c_int), (s.num_kv_heads, ctypes.c_int),
            (s.head_dim, ctypes.c_int)]
        # K q4_1ch: check every row (mode 1), then write (mode 2): a refused step leaves
        # every residual as it was (cuda/paged.cu)
        for mode in (1, 2) if self.max_sequences else (0,):
            driver.launch(self._fn_append, ((warps + _APPEND_WARPS - 1) // _APPEND_WARPS, 1, 1),
                          (32 * _APPEND_WARPS, 1, 1), args + [(mode, ctypes.c_int)], stream=st)

    def _residual_base(self, layer: int) -> int:
        """Address of `layer`'s residuals [max_sequences][Hkv][32][D] (0: not K q4_1ch)."""
        return (self._data.ptr + self.offsets["k_residual"]
                + layer * self.max_sequences * self._res_bytes) if self.max_sequences else 0

    @_one_call
    @driver.in_context
    def decode_attention(self, q, out, layer: int, *, lse=None, causal: bool = True,
                         scale: float | None = None, stream=None, window: int | None = None,
                         sink_tokens: int = 0, sinks=None, softcap: float | None = None) -> None:
        """Attention of the step's new tokens over `layer` of their sequences, read through
        the block tables in the storage's format. Input row r (as append's: sequence b's
        tokens are rows [q_offsets[b], q_offsets[b + 1]), in begin_step's order) is token
        t of the T_b new tokens of b, and sees positions [0, lengths[b] - T_b + t + 1)
        (causal; causal=False: all lengths[b]), as kvcore.decode_attention on the CPU pool.
        Launch only (no sync; capturable): call it after `append` of the layer, before
        `advance`. q: device [R, Hq, D] float32, float16 or bfloat16, C-contiguous, R <=
        max_batch * max_tokens (rows past the step's tokens give zeros; a step with more
        tokens than R is refused); out: float32 [R, Hq, D], C-contiguous, 16-byte aligned;
        lse: None or float32 [R, Hq], the natural log-sum-exp of each row's scaled scores
        (-inf for a row that sees nothing). scale: default 1/sqrt(D). FormatError for a
        head_dim the kernel does not take (kvcore.gpu.attention.HEAD_DIMS); StateError
        outside a step, as append.
        Variants (docs/variants.md, kvcore.gpu.attention.check_variants): window W (causal
        only: token t at position p sees p - W < j <= p; pages wholly outside what a row
        sees are never read, and may be -1 in the block tables; a windowed pool's own
        window and sink_tokens when none are given), sink_tokens S (positions
        [0, S) stay visible beside the window), softcap c, sinks float32 [Hq]: a device
        array (read in place) or a host array, uploaded once per distinct content and kept
        until free() (a host array not seen before is refused while capturing: pass a
        device array to a graph). Refused input launches nothing."""
        self._alive()
        if self._decode_error is not None:
            raise self._decode_error
        s = self.spec
        layer = check_index("layer", layer, s.num_layers)
        scale = _check_scale(scale, s.head_dim)
        st = self.stream if stream is None else stream
        qa = as_device_array(q, "q", stream=st)
        rows_max = self.max_batch * self.max_tokens
        R = qa.shape[0] if qa.ndim == 3 else 0
        if (qa.ndim != 3 or not 1 <= R <= rows_max or qa.shape[1:] != (s.num_heads, s.head_dim)
                or qa.dtype.name not in kernels.INPUT_DTYPES or not qa.is_c_contiguous
                or qa.ptr % qa.dtype.itemsize):
            raise ShapeError(f"invalid q: expected float32, float16 or bfloat16 [R, {s.num_heads}, "
                             f"{s.head_dim}] with 1 <= R <= {rows_max}, C-contiguous, got "
                             f"{qa.dtype} {list(qa.shape)} strides {list(qa.strides)}")
        n = self._step_positions()
        if n is not None and n > R:
            raise ShapeError(f"invalid q: the step has {n} new tokens, q holds "
                             f"{R} rows")
        oa = as_device_array(out, "out", stream=st)
        if oa.dtype != np.float32 or oa.shape != qa.shape or not oa.is_c_contiguous or oa.ptr % 16:
            raise ShapeError(f"invalid out: expected float32 {list(qa.shape)} C-contiguous, "
                             f"16-byte aligned, got {oa.dtype} {list(oa.shape)} strides "
                             f"{list(oa.strides)} at 0x{oa.ptr:x}")
        lse_ptr = check_lse(lse, R, s.num_heads, st, self.ctx)
        window, sink_tokens = self._attention_window(window, sink_tokens)
        v = check_variants(s, window=window, sink_tokens=sink_tokens, sinks=sinks,
                           softcap=softcap, causal=causal, stream=st, ctx=self.ctx)
        if n is None:
            self._refuse_outside_step("decode_attention", st)
        sinks_ptr = self._sinks_ptr(v.sinks, st)
        bound = splits_bound(None, v)
        nsplit = self.num_splits if bound is None else self._window_splits(bound)
        n_rows = self.num_pages * self.page_size
        base = [self._data.ptr + self.offsets[r] + layer * n_rows * self._row[r] if self._row[r] else 0
                for r in REGIONS]
        meta = self._meta.ptr
        storage = [*((b, None) for b in base), (self._residual_base(layer), None),
                   (meta + self.meta_offsets["res_slots"], None),
                   (meta + self.meta_offsets["block_tables"], None),
                   (self.max_pages_per_seq, ctypes.c_int),
                   (meta + self.meta_offsets["lengths"], None),
                   (meta + self.meta_offsets["q_offsets"], None),
                   (self.max_batch, ctypes.c_int), (self.page_size, ctypes.c_int),
                   (s.num_kv_heads, ctypes.c_int), (int(bool(causal)), ctypes.c_int)]
        ws_o = ws_lse = 0
        if nsplit > 1:
            ws_o = self._ws.ptr
            ws_lse = ws_o + 4 * R * s.num_heads * nsplit * s.head_dim
        launch_split(self._fn_decode, self._fn_merge, storage, qa.shape, s.num_kv_heads,
                     s.group_size, self._gb, nsplit, qa.ptr, kernels.INPUT_DTYPES[qa.dtype.name],
                     scale, oa.ptr, lse_ptr, ws_o, ws_lse, st, v.launch_args(sinks_ptr))

    def _sinks_ptr(self, sinks, stream) -> int:
        """Device address of checked sinks: a device array's own, or the pool's copy of a
        host array (uploaded at its first use, synchronously: complete before any later
        launch reads it; never rewritten, so a launch still queued reads what it was given)."""
        if sinks is None:
            return 0
        if not isinstance(sinks, np.ndarray):
            return sinks.ptr
        key = sinks.tobytes()
        buf = self._sinks.get(key)
        if buf is None:
            if driver.is_capturing(stream):
                raise StateError("GpuKVPool.decode_attention: host sinks are copied to the device "
                                 "at their first use, which a capture cannot hold: pass a device "
                                 "array (DecodeGraph does), or call once eagerly first; nothing "
                                 "was launched")
            if len(self._sinks) >= 1024:
                raise StateError("GpuKVPool.decode_attention: 1024 distinct host sinks arrays were "
                                 "uploaded already: pass device arrays")
            buf = self._sinks[key] = DeviceBuffer.from_numpy(sinks, ctx=self.ctx)
        return buf.ptr

    @_one_call
    @driver.in_context
    def check(self) -> None:
        """Synchronises the pool's stream; raises (and clears) a status set since: ShapeError
        (an append of fewer input rows than the step's new positions), OutOfRangeError (a
        slot outside the pool), NonFiniteError, FormatError (a value past the format's range)."""
        self._host_call("check")
        self._raise_status(self._step_positions())

    def _refuse_outside_step(self, what: str, stream) -> None:
        """StateError for an eager launch that reads the step's metadata (slot mapping,
        block tables, lengths) when no step is begun: they are the last step's, whose
        positions advance() committed, so an append would overwrite them. A launch into a
        capturing stream is let through: it runs when the graph replays, and a replay
        belongs inside a step (DecodeGraph refuses one outside; advance() sets the device
        slot mapping to -1, so an append replayed after it writes nothing)."""
        if not driver.is_capturing(stream):
            raise StateError(f"GpuKVPool.{what} outside a step: call begin_step(seqs, counts) "
                             f"first (the launch reads the step's slot mapping and tables; the "
                             f"last step's positions were committed by advance()); nothing "
                             f"was launched")

    def _step_positions(self) -> int | None:
        """New positions of the step begun by begin_step (None: no step)."""
        return None if self._step is None else sum(self._step[1])

    def _raise_status(self, positions: int | None) -> None:
        """Raises (and clears) the device status; positions: the step's new positions."""
        self._sync()
        flag = np.zeros(1, np.int32)
        self._meta.copy_to_host(flag, offset=self.meta_offsets["status"])
        if not flag[0]:
            return
        self._meta.copy_from_host(np.zeros(1, np.int32), offset=self.meta_offsets["status"])
        if flag[0] & ERR_ROWS:
            n = "" if positions is None else f"{positions} "
            raise ShapeError(f"a GPU paged append had fewer input rows than the step's {n}new "
                             f"positions (a graph captured for fewer tokens?); nothing was "
                             f"written by that launch")
        if flag[0] & ERR_SLOT:
            raise OutOfRangeError(f"a GPU paged append got a slot outside the pool's "
                                  f"{self.num_pages * self.page_size} (or one below -1); "
                                  f"nothing was written by that launch")
        if flag[0] & ERR_NONFINITE:
            raise NonFiniteError("a GPU paged append got non-finite input (NaN or inf); "
                                 "its row was not written")
        raise FormatError(f"a GPU paged append got a value out of range of format "
                          f"{describe(self.spec.format)} ({range_limits(self.spec)}); its row "
                          f"was not written")

    @_one_call
    @driver.in_context
    def advance(self, tokens=None) -> list[int]:
        """Ends the step begun by begin_step: synchronises and, when the status is clear,
        commits its positions (returns the counts); else raises as check() and commits
        nothing (the pages taken stay with their sequences, to be written again).
        With a prefix cache, `tokens` are the ids of the step's new positions, one 1-D
        sequence of ints (or integer array) per sequence of the step, in begin_step's
        order, each of its count; each page that fills is registered. Required for a
        sequence that has ids (all but those restored from a snapshot). Tokens that do not
        fit (ShapeError, StateError) are refused before the step ends: it stays open."""
        self._host_call("advance")
        if self._step is None:
            raise StateError("GpuKVPool.advance without begin_step")
        seqs, counts = self._step
        arrays = None if tokens is None else [token_array(t, f"tokens[{b}]") for b, t in enumerate(tokens)]
        if arrays is not None or self._table.prefix is not None:
            self._table.check_tokens(seqs, counts, arrays)   # before the step ends
        self._step = None
        try:
            self._raise_status(sum(counts))
        finally:
            self._unmap_slots()
        table = self._table
        for s, c in zip(seqs, counts):
            table.get(s).pending = [c] * self.spec.num_layers
        done = table.advance(seqs, arrays)
        if self._writer is not None:
            try:
                self._save_chunks(seqs, done)
            except CudaError as e:   # the step is committed: its chunks are not saved
                with contextlib.suppress(CudaError):
                    self._tier.stream.synchronize()   # copies queued still write the arrays
                self._store_faults += 1
                self._last_fault = f"copy out to the store failed: {e}"
        if self._tier.stream is not None:
            self._settle(wait=False)
        return done

    def _unmap_slots(self) -> None:
        """Sets the device slot mapping to -1 (padding) once a step ends (ordered on the
        pool's stream; begin_step synchronises it before the staging is rewritten): an
        append launched later outside a step, by a graph captured without DecodeGraph's
        checks, writes nothing instead of overwriting the step's committed positions."""
        self._host_slots[:] = -1
        self._meta.copy_from_host(self._host_slots, offset=self.meta_offsets["slot_mapping"],
                                  stream=self.stream)

    # ------------------------------------------------------------------ snapshots, offload

    def _gather(self, seq: int) -> dict[str, np.ndarray | None]:
        """Every region of seq's held pages, [L][pages * page_size][Hkv][W] (host copies)."""
        s = self.spec
        pages = self._table.get(seq).pages
        self._await(pages)
        out = dict.fromkeys(REGIONS)
        for region in self._regions():
            f = region_format(s, region)
            codes = region.endswith("codes")
            width = f.code_width(s.head_dim) if codes else f.scales_per_row(s.head_dim)
            host = np.empty((s.num_layers, len(pages) * self.page_size, s.num_kv_heads, width),
                            f.code_dtype if codes else f.scale_dtype)
            for i, g in enumerate(pages):
                if g >= 0:                  # -1: released by the window
                    self._copy_page(region, g, host=host, index=i, to_host=True)
            out[region] = host
        self._sync()
        return out

    @_one_call
    @driver.in_context
    def snapshot(self, seq: int, n: int | None = None) -> Snapshot:
        """Committed positions [0, n) of seq (n defaults to its length) as the Snapshot every
        kvcore cache makes (token-major k_codes [L, n, Hkv, W], scales [L, n, Hkv, S])."""
        self._idle("snapshot")
        self._sync()
        table = self._table
        if not table.get(seq).start:
            parts = self._gather(seq)
            return snapshot_parts(self.spec, self.length(seq), n, lambda layer, count: tuple(
                None if parts[r] is None else parts[r][layer, :count] for r in REGIONS),
                open_group=self._open_group(seq, parts))
        n, start, sink_end = snapshot_span(table, seq, n)
        at = positions(table.held(table.get(seq), n))
        parts = self._gather(seq)
        return snapshot_parts(self.spec, n, n, lambda layer, count: tuple(
            None if parts[r] is None else parts[r][layer, at] for r in REGIONS),
            start=start, sink_end=sink_end, open_group=self._open_group(seq, parts))

    @_one_call
    @driver.in_context
    def restore(self, snapshot: Snapshot, *, seq: int | None = None,
                requantize: bool = False) -> int:
        """A sequence holding a snapshot's positions: a new one, or `seq`, whose content and
        pages it replaces; returns its id. Checked as KVPool.restore (SnapshotError,
        StateError, CapacityError with the numbers); a refused call changes nothing."""
        self._idle("restore")
        table = self._table
        snap = fit_snapshot(self.spec, snapshot, requantize=requantize,
                            windowed=table.window is not None)
        start = restore_need(table, snap, seq)
        if seq is None:
            self._need_residual("restore")
        self._sync()
        if seq is None:
            seq = self._take_residual(table.new())
        else:
            table.truncate(seq, 0)
        if self._host is not None:       # no window: every page of the snapshot is taken
            self._demote(table.plan_take(-(-snap.length // self.page_size))[1])[0](wait=True)
        table.place(seq, snap.length, start)
        restored = table.get(seq)
        self._await([g for g in restored.pages if g >= 0], self._tier.reading)
        at = positions(table.held(restored))      # the positions it holds, in order
        index = snapshot_index(snap, table.held(restored))
        hosts = []
        for region in self._regions():
            part = getattr(snap, region)
            host = np.zeros((part.shape[0], len(restored.pages) * self.page_size) + part.shape[2:],
                            part.dtype)
            host[:, at] = part if index is None else part[:, index]
            hosts.append(host)                    # alive until the stream has copied it
            for i, g in enumerate(restored.pages):
                if g >= 0:
                    self._copy_page(region, g, host=host, index=i)
        if self.max_sequences:                    # the open group (K q4_1ch)
            res = np.zeros((self.spec.num_layers, self.spec.num_kv_heads, self.spec.k_fmt.group,
                            self.spec.head_dim), np.float16)
            open_ = snap.k_residual
            res[:, :, :open_.shape[1]] = open_.swapaxes(1, 2)
            self._write_residual(seq, res)
        self._sync()
        return seq

    @driver.in_context
    def offload(self, seq: int, host_pool) -> int:
        """Copies seq's committed positions into a new sequence of the CPU KVPool `host_pool`
        (same layers, heads, head_dim, format), bit-identical; returns its id there. seq
        stays (free it to release its pages)."""
        return host_pool.restore(self.snapshot(seq))

    @driver.in_context
    def bring_back(self, host_pool, host_seq: int, *, seq: int | None = None) -> int:
        """Copies sequence host_seq of the CPU KVPool `host_pool` into this pool (a new
        sequence, or in place of `seq`), bit-identical; returns its id here."""
        return self.restore(host_pool.snapshot(host_seq), seq=seq)

    # ------------------------------------------------------------------ lifetime

    @property
    def freed(self) -> bool:
        return self._data.freed

    @_one_call
    @driver.in_context
    def free(self) -> None:
        """Releases the device memory and the pool's stream; bumps `generation`. A second
        call does nothing; any other use afterwards raises StateError."""
        if self._data.freed:
            return
        driver.refuse_while_capturing("GpuKVPool.free", self.stream)
        self._sync()
        if self._tier.stream is not None:
            self._settle()
            self._tier.stream.destroy()
            if self._pinned is not None:
                self._pinned.unpin()
        self._meta.free()
        self._data.free()
        if self._ws is not None:
            self._ws.free()
        for buf in self._sinks.values():
            buf.free()
        self._sinks.clear()
        self.stream.destroy()
        self.generation += 1

    def __repr__(self) -> str:
        s = self.spec
        return (f"GpuKVPool(layers={s.num_layers}, kv_heads={s.num_kv_heads}, head_dim="
                f"{s.head_dim}, format={s.format!r}, pages={self.num_pages}x{self.page_size}, "
                f"used={self.num_used_pages}, sequences={len(self._table.seqs)}"
                + (", freed" if self.freed else "") + ")")
