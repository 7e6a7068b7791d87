"""KVPool: one pool of fixed-size pages serving many sequences on the CPU.

Storage is `_storage.Storage` with rows = num_pages * page_size: page g is rows
[g * page_size, (g + 1) * page_size) of every layer, K and V, codes and scales (a
KVCache is the case of one page of `capacity` rows). The bookkeeping (free list,
reference counts, page lists, lengths, pending counts) is `_pages.PageTable`'s. Every
write is planned by the table (all checks, nothing changed), written by the storage's
checked writer (which checks the values before a byte is written and copies shared
pages first), then committed to the table: a refused call changes no byte and no count.

With `prefix_cache=True` the table also keeps a `_prefix.PrefixIndex`: full pages are
registered by content key as they fill (`advance(seq, tokens=...)`), `match_prefix`
starts a sequence on the longest cached run of them, and pages no sequence holds stay
cached until a write needs a page and none is free (docs/design.md, Prefix cache).
With a chunk store attached (`store=`), a lookup continues in the store past the cached
pages, and chunks that fill at `advance` are queued to a `StoreWriter` (docs/store.md).
With `window=W` every layer is a sliding layer: wherever positions commit, the pages no
future query can see are released and read -1 in the page tables (docs/design.md, Sliding
windows).
copy.deepcopy and pickle copy the storage, the table and the counters and rebuild the
rest (docs/design.md, Copies).
"""
from __future__ import annotations

import copy
import functools
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Sequence, cast

import numpy as np

from ._cache import decode_rows
from ._groups import KeyGroups, Rows
from ._guard import CallGuard
from ._pages import PageTable
from ._prefix import PrefixIndex
from ._prefix_keys import ROOT, chain_key, encode_extra, token_array
from ._storage import LayerArrays, Storage
from ._validate import (AnyArray, OutArray, check_index, check_int32, check_ndarray, check_out,
                        check_seq_id, check_seq_ids, is_array)
from ._window import WindowViews, check_window, restore_need, snapshot_index, snapshot_span
from .errors import (CapacityError, DTypeError, FormatError, OutOfRangeError, ShapeError,
                     SpecError, StateError, StoreError)
from .snapshot import _PART_NAMES, Snapshot, detached, fit_snapshot, snapshot_parts
from .formats import describe
from .spec import KVSpec

if TYPE_CHECKING:
    from .store import KVStore, StoreWriter

_EMPTY_ROWS = np.zeros(0, np.int64)
log = logging.getLogger("kvcore.store")


@dataclass(frozen=True)
class PoolStats:
    """Page counts of a KVPool (free + cached + in_use = num_pages; a page held by several
    sequences counts once) and its prefix cache's counters since it was made: pages a
    `match_prefix` found cached (hits), pages it loaded from the attached store
    (store_hits), full pages it asked for and found in neither (misses), cached pages
    taken back for new writes (evictions), and the store's faults: lookups that failed
    (a server gone, a disk error) or stopped at a refused (corrupt, foreign) chunk, the
    latest one's message in last_store_fault."""

    free: int
    cached: int
    in_use: int
    hits: int
    misses: int
    evictions: int
    store_hits: int = 0
    store_faults: int = 0
    last_store_fault: str | None = None


class KVPool(WindowViews):
    """Pages of K/V storage shared by many sequences, in any format of kvcore.FORMATS.

    `spec.capacity` is the most positions one sequence may hold; the pool holds
    num_pages * page_size positions in all. Sequences are int ids (`new_sequence`).
    Positions are appended per layer and sequence (pending) and committed with
    `advance`, as in a KVCache; pages are taken when a write first needs them.
    One call at a time: a call that finds another thread inside the pool raises
    StateError and changes nothing (as a KVCache; docs/design.md, Threads).

    prefix_cache=True: full pages are found again by their content (`match_prefix`),
    `advance` takes the token ids of the committed positions, and a page no sequence
    holds stays cached (evictable, least recently used first) until it is needed.

    store (a kvcore.store.KVStore of this spec's format and shapes, with this page_size;
    needs prefix_cache=True): `match_prefix` loads the stored chunks past the cached
    pages (checked, registered as cached pages). store_writer (a StoreWriter of that
    store): each whole chunk that `advance` completes is copied out of the pages and
    queued to it (saved on its thread; dropped and counted when its queue is full).

    A K q4_1ch pool (K by channel over groups of 32 positions) needs page_size % 32 == 0:
    its pages hold whole groups, and each sequence keeps its open group in a float16
    residual (docs/formats.md, q4_1ch).

    window=W (an int >= 1; None: none) makes every layer of the pool a sliding layer: the
    query at position p sees positions p - W < j <= p, plus the first sink_tokens=S
    positions (an int >= 0, only with a window). Wherever positions commit (advance,
    match_prefix, restore), the pages no later query can see are released (back to the
    free list, or cached when registered), so a sequence holds about W + page_size
    positions plus its sink pages, whatever its length; their entries in page_table,
    block_tables and csr read -1 (`first_held`, docs/design.md, Sliding windows). A
    windowed pool takes no store_writer (its chunks start at position 0).
    """

    def __init__(self, spec: KVSpec, num_pages: int, page_size: int = 16, *,
                 window: int | None = None, sink_tokens: int = 0,
                 prefix_cache: bool = False, store: KVStore | None = None,
                 store_writer: StoreWriter | None = None):
        if not isinstance(spec, KVSpec):
            raise SpecError(f"KVPool needs a KVSpec, got {type(spec).__name__}")
        for name, value in (("num_pages", num_pages), ("page_size", page_size)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise SpecError(f"{name} must be a positive int, got {value!r}")
        _check_grouped(spec, int(page_size))
        if not isinstance(prefix_cache, bool):
            raise SpecError(f"prefix_cache must be a bool, got {prefix_cache!r}")
        win, sinks = check_window(window, sink_tokens)
        ps = int(page_size)
        kv, writer = _attached(spec, ps, prefix_cache, store, store_writer, win)
        self._attach(spec, ps, Storage(spec, int(num_pages) * ps),
                     PageTable(int(num_pages), ps, spec.num_layers, spec.capacity,
                               PrefixIndex() if prefix_cache else None, win, sinks), kv, writer)

    def _attach(self, spec: KVSpec, page_size: int, store: Storage, table: PageTable,
                kv: KVStore | None, writer: StoreWriter | None,
                counters: tuple[int, int, str | None] = (0, 0, None)) -> None:
        """Sets every attribute: the storage (and what is derived from it), the table,
        the chunk store and its writer, the store counters and a fresh guard (also after
        a copy: nothing derived is copied)."""
        self._spec = spec
        self._ps = page_size
        self._store = store
        self._storage = store.array
        self._table = table
        self._num_layers = spec.num_layers
        self._guard = CallGuard("KVPool")   # one call at a time (docs/design.md, Threads)
        self._kv, self._writer = kv, writer
        self._store_hits, self._store_faults, self._last_fault = counters
        # a grouped K format's residual of each sequence that has one (_groups.py)
        self._groups: dict[int, KeyGroups] = {}

    # -- copies --------------------------------------------------------------------

    def __deepcopy__(self, memo: dict[int, Any]) -> KVPool:
        """An independent pool holding the same bytes (on fresh pages), sequences, page
        tables, prefix cache and counters; an attached store is shared, not copied.
        StateError while another thread is inside, or with a store_writer."""
        return self._copy("deepcopy", memo)

    def __copy__(self) -> KVPool:
        """As copy.deepcopy: two pools never share storage."""
        return self._copy("copy", {})

    def _copy(self, op: str, memo: dict[int, Any]) -> KVPool:
        with self._guard(op):
            self._refuse_copy(op)
            new = type(self).__new__(type(self))
            memo[id(self)] = new
            new._attach(self._spec, self._ps, copy.deepcopy(self._store, memo),
                        copy.deepcopy(self._table, memo), self._kv, None, self._counters())
            new._groups = self._groups_copy()
            return new

    def __getstate__(self) -> dict[str, Any]:
        """pickle: the spec, the storage (its bytes: one buffer with protocol 5), the table
        and the counters. StateError while another thread is inside, or when a chunk
        store is attached; the bytes are read as the pickler writes them, so no other
        thread may write the pool until dumps returns."""
        with self._guard("pickle"):
            self._refuse_copy("pickle")
            return {"spec": self._spec, "page_size": self._ps, "storage": self._store,
                    "table": copy.deepcopy(self._table), "counters": self._counters(),
                    "groups": self._groups_copy()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._attach(state["spec"], state["page_size"], state["storage"], state["table"],
                     None, None, state["counters"])
        self._groups = state.get("groups", {})

    def _groups_copy(self) -> dict[int, KeyGroups]:
        return {s: g.copy() for s, g in self._groups.items()}

    def _counters(self) -> tuple[int, int, str | None]:
        return self._store_hits, self._store_faults, self._last_fault

    def _refuse_copy(self, op: str) -> None:
        """StateError when the pool cannot be copied by `op` ("deepcopy", "copy",
        "pickle"): a store writer (a thread and a queue) is this pool's alone, and a
        pickle cannot carry a store's backend."""
        if self._writer is not None:
            raise StateError(f"{op}: cannot copy a KVPool attached to a StoreWriter "
                             f"(store_writer=): its thread and queue serve this pool only; "
                             f"copy a pool made without store_writer=")
        if op == "pickle" and self._kv is not None:
            raise StateError("pickle: cannot pickle a KVPool attached to a chunk store "
                             "(store=): its backend (a directory or a server connection) "
                             "belongs to this process; copy.deepcopy shares the store, or "
                             "pickle a pool made without store=")

    # -- sequences -----------------------------------------------------------------

    def new_sequence(self) -> int:
        """A new empty sequence (no page yet); returns its id. With a prefix cache it is
        keyed with no extras (`match_prefix` starts one with extras)."""
        with self._guard("new_sequence"):
            return self._table.new()

    def match_prefix(self, tokens: Sequence[int] | np.ndarray,
                     extra: Mapping[str, str | bytes] | None = None) -> tuple[int, int]:
        """A new sequence holding, by reference, the longest run of cached full pages that
        starts `tokens` (ints >= 0, or a 1-D integer array) under the same extras (kind ->
        str or bytes, e.g. {"adapter": "x", "salt": b"..."}), at most len(tokens) - 1
        positions (the last token's query is still computed). Returns (seq, n): its n
        committed positions are tokens[:n] (a multiple of page_size); append and
        `advance(seq, tokens=tokens[n:...])` the rest. StateError without a prefix cache.

        With a chunk store attached (store=), the sequence goes on with the stored chunks
        that follow the cached pages (docs/store.md). The store's lookup runs without the
        pool's guard (other threads' calls go on while it waits on a server or a disk);
        then the guard is taken again, the cached pages are matched again (the cache may
        have changed meanwhile) and the chunks that still follow them are placed. A failed
        lookup or a refused chunk is no exception: a counted fault (stats.store_faults).
        Atomic: a call that raises (StateError when another thread is inside at either
        step, or anything unforeseen) leaves no sequence, no page taken and the counters
        as they were."""
        with self._guard("match_prefix"):
            if self._table.prefix is None:
                raise StateError("match_prefix needs a pool made with prefix_cache=True")
            ids = token_array(tokens)
            extra_bytes = encode_extra(extra)
            fetch = None if self._kv is None else self._store_fetch(ids, extra_bytes)
            if fetch is None:
                return self._table.match(ids, extra_bytes)
        chunks = consult_store(fetch)       # without the guard: the round trip
        try:
            with self._guard("match_prefix"):
                return self._place_stored(ids, extra_bytes, fetch, chunks)
        finally:
            fetch.release()

    def free(self, seq: int) -> None:
        """Ends a sequence: its pages that no other sequence holds become free (cached
        instead, with a prefix cache, when registered: full pages of committed tokens)."""
        with self._guard("free"):
            self._table.free_seq(seq)
            self._groups.pop(seq, None)

    def truncate(self, seq: int, n: int) -> None:
        """Keeps the first n committed positions of seq (0 <= n <= length) and drops every
        pending one; pages past the last kept position are released. With a prefix cache,
        the page it cuts into and those it drops leave the cache (whoever holds them).
        With a window: StateError (nothing changed) when the window at length n would see
        a released position, i.e. unless n >= first_held(seq) + window - 1 (or n within
        the sink pages)."""
        with self._guard("truncate"):
            self._table.truncate(seq, n)
            if self._spec.k_fmt.group:
                groups = self._groups_of(seq)
                for layer in range(self._num_layers):
                    groups.truncate(layer, n, *self._k_regions(layer), self._row_of(seq))

    def fork(self, seq: int) -> int:
        """A new sequence holding seq's committed positions: full pages are shared (a later
        write to a shared page copies it first), the partial last page is copied now.
        CapacityError (nothing changed) when that copy finds no free page. A windowed
        sequence's fork holds the same positions (the same first_held)."""
        with self._guard("fork"):
            t, copy = self._table.fork(seq)
            if copy is not None:
                self._store.writer.copy_pages(np.array([[copy[0] * self._ps, copy[1] * self._ps]],
                                                       np.int64), self._ps)
            if seq in self._groups:
                # the fork's open group as a snapshot holds it: decoded from its codes
                # where seq's pending positions completed the group
                groups = self._groups[t] = self._groups[seq].copy()
                for layer in range(self._num_layers):
                    groups.truncate(layer, self._table.get(t).length, *self._k_regions(layer),
                                    self._row_of(t))
            return t

    # -- writing -------------------------------------------------------------------

    def append(self, k: AnyArray, v: AnyArray, *, seq: int, layer: int) -> None:
        """Encodes T positions of one layer of one sequence after its held ones, pending
        until `advance`, as KVCache.append: k, v float32, float16 or bfloat16, [T, Hkv, D]
        or [Hkv, D], any strides. seq and layer are keyword-only (two ints that a
        positional call could swap). Atomic: a refused call (ShapeError, DTypeError,
        NonFiniteError, FormatError, OutOfRangeError, StateError for an unknown sequence,
        CapacityError past spec.capacity or with too few free pages, naming the layer's
        pending positions when some are) changes nothing."""
        with self._guard("append"):
            if layer.__class__ is not int or not 0 <= layer < self._num_layers:
                layer = check_index("layer", layer, self._num_layers)
            k, v = check_ndarray("k", k), check_ndarray("v", v)
            self._write(layer, [seq], [k.shape[0] if k.ndim == 3 else 1], k, v)

    def append_batch(self, k: AnyArray, v: AnyArray, *, seqs: Sequence[int], layer: int,
                     counts: Sequence[int] | AnyArray | None = None) -> None:
        """One layer's new positions of many sequences in one call: counts[b] positions
        (default 1 each) after the held ones of seqs[b], taken in order from k, v (float32,
        float16 or bfloat16, [sum counts, Hkv, D], any strides), pending until `advance`.
        seqs, layer and counts are keyword-only. Atomic over the whole call, as `append`;
        a sequence may appear once."""
        with self._guard("append_batch"):
            if layer.__class__ is not int or not 0 <= layer < self._num_layers:
                layer = check_index("layer", layer, self._num_layers)
            seqs = check_seq_ids("seqs", seqs)
            counts = [1] * len(seqs) if counts is None else _counts(counts, len(seqs))
            k, v = check_ndarray("k", k), check_ndarray("v", v)
            if k.ndim != 3:
                raise ShapeError(f"invalid shape of k: expected [T, {self._spec.num_kv_heads}, "
                                 f"{self._spec.head_dim}], got {list(k.shape)}")
            if k.shape[0] != sum(counts):
                raise ShapeError(f"invalid shape of k: expected [{sum(counts)}, "
                                 f"{self._spec.num_kv_heads}, {self._spec.head_dim}] (the sum of "
                                 f"counts), got {list(k.shape)}")
            self._write(layer, seqs, counts, k, v)

    def _write(self, layer: int, seqs: list[int], counts: list[int], k: np.ndarray,
               v: np.ndarray) -> None:
        plan = self._table.plan_write(layer, seqs, counts)
        ps = self._ps
        rows = np.array(plan.rows, np.int64) if plan.rows else _EMPTY_ROWS
        copies = (np.array(plan.copies, np.int64) * ps) if plan.copies else None
        ends = [self._held(s, layer) for s in seqs] if self._spec.k_fmt.group else None
        self._store.writer.write(layer, 0, k, v, rows, copies, ps)
        self._table.commit_write(plan)
        if ends is not None:     # K by channel: each sequence's groups (_groups.py)
            at = 0
            for s, t, end in zip(seqs, counts, ends):
                self._groups_of(s).write(layer, end, k[at:at + t] if k.ndim == 3 else k,
                                         *self._k_regions(layer), self._row_of(s))
                at += t

    def _groups_of(self, seq: int) -> KeyGroups:
        """The residual of seq (a grouped K format's; made at its first need)."""
        groups = self._groups.get(seq)
        if groups is None:
            groups = self._groups[seq] = KeyGroups(self._spec)
        return groups

    def _row_of(self, seq: int) -> Rows:
        """The storage row of each position of seq, through its page table."""
        pages, ps = self._table.get(seq).pages, self._ps
        return lambda p: pages[p // ps] * ps + p % ps

    def _k_regions(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """K codes [rows, Hkv, W] and scales [rows, Hkv, S] of one layer (a grouped K
        format's: it has scales), writable."""
        r = self._store.regions
        return r["k_codes"][layer], r["k_scales"][layer]

    def advance(self, seqs: int | Iterable[int] | None = None, *,
                tokens: Sequence[int] | AnyArray | Sequence[Sequence[int] | AnyArray] | None = None
                ) -> int | list[int]:
        """Commits the pending positions of one sequence (returns the count), of several
        (returns their counts) or of every sequence (None; counts in `sequences` order).
        Every layer of a sequence must hold the same number pending (StateError names
        them); all are checked before any is committed.
        With a prefix cache, `tokens` are the ids of the committed positions: for one
        sequence a 1-D sequence of ints (or integer array) of its pending count, for
        several a list of them, one per sequence (in `sequences` order for None); each
        page that fills is registered. Required for a sequence that has ids (every one
        but those restored from a snapshot)."""
        with self._guard("advance"):
            if seqs is None:
                one, ids = False, list(self._table.seqs)
            elif seqs.__class__ is int:
                one, ids = True, [seqs]
            elif isinstance(seqs, (int, np.integer, float, np.floating, np.bool_)):
                one, ids = True, [check_seq_id(seqs, "seqs")]   # a bool or float: DTypeError
            else:
                one, ids = False, check_seq_ids("seqs", seqs)
            arrays = None
            if tokens is not None:
                many = cast(Sequence[Sequence[int] | AnyArray], tokens)
                arrays = ([token_array(cast(Sequence[int] | AnyArray, tokens))] if one else
                          [token_array(t, f"tokens[{b}]") for b, t in enumerate(many)])
            counts = self._table.advance(ids, arrays)
            if self._writer is not None:
                for s, t in zip(ids, counts):
                    self._queue_chunks(s, t)
            return counts[0] if one else counts

    def slot_mapping(self, seqs: Sequence[int], counts: Sequence[int] | AnyArray,
                     out: OutArray) -> OutArray:
        """Reserves and exports the storage rows ("slots", vLLM's slot_mapping) of the next
        counts[b] positions after the committed ones of seqs[b]: out int64 [M], C-contiguous,
        M >= sum counts, gets them in order, then -1 (skip) to its end. Pages are taken
        (copy-on-write included) as an append would: atomic, CapacityError with the
        numbers. Row r is page r // page_size, offset r % page_size."""
        with self._guard("slot_mapping"):
            if self._spec.k_fmt.group:
                raise FormatError(f"slot_mapping: K format {self._spec.k_format} encodes "
                                  f"groups of {self._spec.k_fmt.group} positions at append; "
                                  f"rows written by others cannot hold them")
            seqs = check_seq_ids("seqs", seqs)
            counts = _counts(counts, len(seqs))
            arr = check_ndarray("out", out)
            arr = check_out("out", arr, (arr.shape[0],) if arr.ndim == 1 else ("M",), [np.int64])
            if arr.shape[0] < sum(counts):
                raise ShapeError(f"out holds {arr.shape[0]} slots, the positions need "
                                 f"{sum(counts)}")
            plan = self._table.plan_write(None, seqs, counts)
            if plan.copies:
                self._store.writer.copy_pages(np.array(plan.copies, np.int64) * self._ps, self._ps)
            self._table.commit_write(plan)
            arr[:len(plan.rows)] = plan.rows
            arr[len(plan.rows):] = -1
            return out

    # -- state ---------------------------------------------------------------------

    @property
    def spec(self) -> KVSpec:
        return self._spec

    @property
    def page_size(self) -> int:
        return self._ps

    @property
    def stats(self) -> PoolStats:
        """Free, cached and in-use pages, and the prefix cache's counters (PoolStats)."""
        return PoolStats(*self._table.counts(), self._store_hits, self._store_faults,
                         self._last_fault)

    def pending(self, seq: int, layer: int) -> int:
        """Positions appended to `layer` of seq since its last advance."""
        return self._table.get(seq).pending[check_index("layer", layer, self._num_layers)]

    def pages_for(self, n: int) -> int:
        """Pages that n positions of one sequence take: ceil(n / page_size)."""
        return -(-int(n) // self._ps)

    # -- exports for runtimes ----------------------------------------------------------

    def _held(self, seq: int, layer: int | None) -> int:
        s = self._table.get(seq)
        if layer is None:
            return s.length
        return s.length + s.pending[check_index("layer", layer, self._num_layers)]

    def block_tables(self, seqs: Sequence[int], out: OutArray, *, layer: int | None = None,
                     fill: int = -1) -> OutArray:
        """out int32 [B, M] (C-contiguous, writable): row b holds the pages of seqs[b]'s
        positions (committed, plus `layer`'s pending ones when given), then `fill`
        (vLLM's block table): an int32 (DTypeError, RangeError otherwise). A page a window
        released reads -1 (whatever fill is). ShapeError when M is too small or out
        overlaps the pool's storage; a refused call writes nothing."""
        with self._guard("block_tables"):
            if fill.__class__ is not int or not -2**31 <= fill < 2**31:
                fill = check_int32("fill", fill)
            seqs = check_seq_ids("seqs", seqs)
            tabs = [self._table.get(s).pages[:self.pages_for(self._held(s, layer))] for s in seqs]
            arr = check_ndarray("out", out)
            width = max((len(t) for t in tabs), default=0)
            arr = check_out("out", arr, (len(seqs), arr.shape[-1] if arr.ndim == 2 else "M"),
                            [np.int32])
            if arr.shape[1] < width:
                raise ShapeError(f"invalid shape of out: expected [{len(seqs)}, >= {width}], "
                                 f"got {list(arr.shape)}")
            if np.may_share_memory(arr, self._storage):
                raise ShapeError("out overlaps the pool's storage")
            arr[:] = fill
            for b, t in enumerate(tabs):
                arr[b, :len(t)] = t
            return out

    def csr(self, seqs: Sequence[int], indptr: AnyArray, indices: AnyArray,
            last_page_len: AnyArray, *, layer: int | None = None,
            released: int | None = None) -> int:
        """The page tables of seqs in FlashInfer's CSR form, written into the caller's
        int32 arrays: indptr [B + 1], indices [>= nnz] (pages of seqs[b] at
        indices[indptr[b]:indptr[b + 1]]), last_page_len [B] (positions in the last page,
        1..page_size; 0 for an empty sequence). Positions: committed, plus `layer`'s
        pending ones when given. Returns nnz. ShapeError when two of the arrays overlap
        (or one overlaps the pool's storage); a refused call writes nothing.
        A sequence with pages a window released: their entries hold `released` (an int32,
        e.g. a page id the kernel never reads, or -1 for one that skips them; positions keep
        their place, so position p is still in entry p // page_size); StateError without
        it (no entry may name a page the sequence does not hold)."""
        with self._guard("csr"):
            if released is not None and (released.__class__ is not int
                                         or not -2**31 <= released < 2**31):
                released = check_int32("released", released)
            seqs = check_seq_ids("seqs", seqs)
            tabs = [(self._table.get(s).pages[:self.pages_for(n)], n)
                    for s, n in ((s, self._held(s, layer)) for s in seqs)]
            if any(self._table.get(s).start for s in seqs):
                s = next(s for s in seqs if self._table.get(s).start)
                if released is None:
                    raise StateError(
                        f"csr: sequence {s} holds positions from {self._table.get(s).start} "
                        f"only (window {self.window} released the pages before): pass "
                        f"released= (the int32 its entries get) or use block_tables (-1)")
                tabs = [([released if g < 0 else g for g in t], n) for t, n in tabs]
            nnz = sum(len(t) for t, _ in tabs)
            ptr = check_out("indptr", indptr, (len(seqs) + 1,), [np.int32])
            last = check_out("last_page_len", last_page_len, (len(seqs),), [np.int32])
            idx = check_ndarray("indices", indices)
            idx = check_out("indices", idx, (idx.shape[0] if idx.ndim == 1 else "nnz",),
                            [np.int32])
            if idx.shape[0] < nnz:
                raise ShapeError(f"indices holds {idx.shape[0]} entries, the tables need "
                                 f"{nnz}")
            outs = (("indptr", ptr), ("indices", idx), ("last_page_len", last))
            for i, (name, one) in enumerate(outs):   # C-contiguous: bounds overlap is overlap
                for other, two in outs[i + 1:]:
                    if np.may_share_memory(one, two):
                        raise ShapeError(f"{other} overlaps {name}: the three outputs must "
                                         f"not share memory")
                if np.may_share_memory(one, self._storage):
                    raise ShapeError(f"{name} overlaps the pool's storage")
            at = 0
            ptr[0] = 0
            for b, (t, n) in enumerate(tabs):
                idx[at:at + len(t)] = t
                at += len(t)
                ptr[b + 1] = at
                last[b] = n - (len(t) - 1) * self._ps if t else 0
            return nnz

    # -- reads ---------------------------------------------------------------------

    def _rows(self, seq: int, layer: int, pending: bool) -> np.ndarray:
        layer = check_index("layer", layer, self._num_layers)
        s = self._table.get(seq)
        return np.array(self._table.held_rows(seq, s.length, s.pending[layer] if pending else 0),
                        np.int64)

    def _gather(self, seq: int, layer: int, *, pending: bool = False) -> LayerArrays:
        """(k_codes, v_codes, k_scales, v_scales) of seq's held positions in one layer
        (`held`, then the pending ones when asked), copied in position order (raw code
        dtype; scales None when S = 0). Internal (tests)."""
        return self._store.gather(layer, self._rows(seq, layer, pending))

    def dequantize(self, seq: int, layer: int, which: str, *, pending: bool = False) -> np.ndarray:
        """K (which="k") or V ("v") of seq's committed positions (and pending ones when
        asked) decoded: float32 [n, Hkv, D], a new array. A windowed sequence gives the
        positions it holds (`held`), in order."""
        with self._guard("dequantize"):
            if which not in ("k", "v"):
                raise OutOfRangeError(f"which {which!r} out of range: expected 'k' or 'v'")
            rows = self._rows(seq, layer, pending)
            k_codes, v_codes, k_scales, v_scales = self._store.gather(layer, rows)
            codes, scales = (k_codes, k_scales) if which == "k" else (v_codes, v_scales)
            out = np.empty(codes.shape[:2] + (self._spec.head_dim,), np.float32)
            if which == "k" and self._spec.k_fmt.group:
                s = self._table.get(seq)
                spans = self._table.held(s) + ([(s.length, s.length + s.pending[layer])]
                                               if pending else [])
                self._groups_of(seq).dequantize(layer, spans, *self._k_regions(layer),
                                                self._row_of(seq), out)
            else:
                decode_rows(self._spec.fmts[which == "v"].id, codes, scales, out)
            return out

    # -- snapshots -----------------------------------------------------------------

    def snapshot(self, seq: int, n: int | None = None) -> Snapshot:
        """Committed positions [0, n) of seq (n defaults to its length) as the Snapshot a
        KVCache makes: restores into a KVCache, a GpuKVCache or a pool sequence.
        A windowed sequence that released pages gives the positions it holds: [0,
        sink_end) and [start, n) (Snapshot.start = first_held(seq)), which only a windowed
        KVPool restores; n must leave every position the window needs at n held
        (StateError otherwise, as truncate)."""
        with self._guard("snapshot"):
            table = self._table
            s = table.get(seq)
            length = s.length
            if not s.start:
                rows = np.array(table.rows(seq, 0, length), np.int64)
                return snapshot_parts(self._spec, length, n,
                                      lambda layer, count: self._store.gather(layer, rows[:count]),
                                      open_group=self._open_group(seq))
            n, start, sink_end = snapshot_span(table, seq, n)
            rows = np.array(table.held_rows(seq, n), np.int64)
            return snapshot_parts(self._spec, n, n,
                                  lambda layer, count: self._store.gather(layer, rows),
                                  start=start, sink_end=sink_end,
                                  open_group=self._open_group(seq))

    def restore(self, snapshot: Snapshot, *, seq: int | None = None,
                requantize: bool = False) -> int:
        """A sequence holding a snapshot's positions (length = snapshot.length, nothing
        pending): a new one, or `seq`, whose content and pages it replaces; returns its id.
        Checked as KVCache.restore (SnapshotError; requantize=True re-encodes another
        format), StateError for an unknown seq, and CapacityError when the pool has too few
        pages (free ones, plus those only seq holds): a refused call changes nothing.
        A windowed pool keeps only the pages its window needs at snapshot.length, and
        takes a snapshot of a windowed sequence (Snapshot.start > 0) when it holds every
        position this pool's window and sink positions need there, on this pool's pages
        (SnapshotError otherwise); a pool without a window refuses such a snapshot."""
        with self._guard("restore"):
            table = self._table
            snap = detached(fit_snapshot(self._spec, snapshot, requantize=requantize,
                                         windowed=table.window is not None), self._storage)
            start = restore_need(table, snap, seq)
            if seq is None:
                seq = table.new()
            else:
                table.truncate(seq, 0)
            restored = table.get(seq)
            rows = np.array(table.place(seq, snap.length, start), np.int64)
            at = snapshot_index(snap, table.held(restored))
            for layer in range(self._num_layers):
                for name, arr in zip(("k_codes", "v_codes", "k_scales", "v_scales"),
                                     self._store.layer_arrays(layer)):
                    if arr is not None:
                        part = getattr(snap, name)[layer]
                        arr[rows] = part if at is None else part[at]
            if snap.k_residual is not None:
                self._groups[seq] = KeyGroups(self._spec)
                self._groups[seq].restore(snap.length, snap.k_residual)
            return seq

    def _open_group(self, seq: int) -> Callable[[int, int], np.ndarray] | None:
        """A grouped K format's open group of seq's first n positions in a layer
        (snapshot_parts' open_group), None for other formats."""
        if not self._spec.k_fmt.group:
            return None
        groups, row = self._groups_of(seq), self._row_of(seq)
        return lambda layer, n: groups.open_group(layer, n, *self._k_regions(layer), row)

    # -- the chunk store (docs/store.md) ---------------------------------------------

    def _store_fetch(self, ids: np.ndarray, extra: bytes) -> Any:
        """(match_prefix, the guard held) The store fetch (KVStore._fetch) of the chunks
        past the cached pages that start ids, continuing their key chain; None when the
        cached pages hold every whole chunk a lookup may ask for. Reads the prefix index,
        changes nothing."""
        assert self._kv is not None
        ps, index = self._ps, self._table._index
        raw = ids.astype("<i8", copy=False).tobytes()
        parent, keys = ROOT, list[bytes]()
        for i in range(max(0, (ids.size - 1) // ps)):
            key = chain_key(parent, ids[i * ps:(i + 1) * ps], extra)
            if index.find(parent, key, raw[8 * i * ps:8 * (i + 1) * ps], extra) is None:
                break
            keys.append(key)
            parent = key
        fetch = self._kv._fetch(ids, extra, len(keys) * ps,
                                min(ids.size - 1, self._spec.capacity), keys)
        return fetch if fetch.first < len(fetch.keys) else None

    def _place_stored(self, ids: np.ndarray, extra: bytes, fetch: Any,
                      chunks: list[tuple[int, dict[str, np.ndarray]]]) -> tuple[int, int]:
        """(match_prefix, the guard held again) A new sequence on the cached pages that
        start ids now, continued with the fetched chunks that follow them (none when the
        cache lost pages before the first fetched chunk meanwhile; those it gained are not
        loaded again); counts the hits, the pages loaded and the fetch's fault. Anything
        raised: the sequence is freed and the counters are as before."""
        table, index = self._table, self._table._index
        counts = index.hits, index.misses
        s = None
        try:
            s, n = table.match(ids, extra)
            loaded = self._write_stored(s, chunks, fetch.chunk_tokens, ids, partial=True)
        except BaseException:
            if s is not None:
                table.free_seq(s)
            index.hits, index.misses = counts
            raise
        if fetch.fault is not None:
            self._store_faults += 1
            self._last_fault = fetch.fault
        pages = loaded // self._ps
        self._store_hits += pages
        index.misses -= pages
        return s, n + loaded

    def _restore_stored(self, fetch: Any, ids: np.ndarray, extra: bytes) -> tuple[int | None, int]:
        """KVStore.load_into: a new sequence holding the chunks of a store fetch
        (registered when the pool has a prefix cache); (its id, positions), (None, 0)
        when none was found. The chunks are read and checked first, without the guard;
        StoreError then, or CapacityError when placing them: nothing changed."""
        chunks = fetch.collect()
        try:
            with self._guard("restore"):
                table = self._table
                s = table.new(extra)
                try:
                    n = self._write_stored(s, chunks, fetch.chunk_tokens, ids, partial=False)
                except BaseException:
                    table.free_seq(s)
                    raise
                if n == 0:
                    table.free_seq(s)
                    return None, 0
                return s, n
        finally:
            fetch.release()

    def _write_stored(self, s: int, chunks: list[tuple[int, dict[str, np.ndarray]]], c: int,
                      ids: np.ndarray, *, partial: bool) -> int:
        """Writes checked chunks ((i, parts) of chunk i, C = c positions each, in order:
        KVStore._fetch) after sequence s's committed positions (a multiple of page_size,
        nothing pending) into pages taken as a write takes them, then commits them (ids
        joined, full pages registered); returns the positions written. A chunk's
        positions before the sequence's end (already held) are skipped; a chunk that
        starts past it ends the run (a gap). CapacityError: with partial, the chunks
        written before stay; without, the sequence is as before and the error raised
        (as for anything else raised)."""
        table = self._table
        seq = table.get(s)
        start = end = seq.length
        try:
            for i, parts in chunks:
                if (i + 1) * c <= end:
                    continue                  # held already
                skip = end - i * c
                if skip < 0:
                    break                     # a gap: never K/V away from its position
                try:
                    plan = table.plan_write(None, [s], [c - skip])
                except CapacityError:
                    if not partial:
                        raise
                    break
                table.commit_write(plan)
                seq.length = end + c - skip   # the next chunk's rows follow these
                table._drop()                 # (a length set here, not by the table)
                self._put_rows(np.array(plan.rows, np.int64), parts, skip)
                end = seq.length
        except BaseException:
            table.truncate(s, start)
            raise
        if seq.ids is not None and end > start:
            seq.ids += ids[start:end].astype("<i8", copy=False).tobytes()
            table._register(seq)
        table.slide(seq)                      # a window keeps only the pages it sees
        return end - start

    def _put_rows(self, rows: np.ndarray, parts: dict[str, np.ndarray], skip: int) -> None:
        """Copies positions skip.. of a chunk's parts ([L, C, Hkv, D or S]) into rows,
        every layer at once, one slice per run of consecutive rows (one run when the
        chunk's pages are consecutive, as a fresh pool's are)."""
        cut = np.flatnonzero(np.diff(rows) != 1) + 1
        runs = list(zip([0, *cut.tolist()], [*cut.tolist(), rows.size]))
        starts = rows[[a for a, _ in runs]].tolist()
        for name, dst in self._store.regions.items():     # [L, rows, Hkv, D or S]
            src = parts[name]
            for r, (a, b) in zip(starts, runs):
                dst[:, r:r + b - a] = src[:, skip + a:skip + b]

    def _queue_chunks(self, s: int, added: int) -> None:
        """Queues to the store writer the whole chunks of sequence s that its last
        `added` committed positions completed, each copied out of the pages now (decoding
        may reuse them later)."""
        assert self._writer is not None and self._kv is not None
        c = self._kv.chunk_tokens
        for j, key, ids, parent in completed_chunks(self._table, s, added, c):
            rows = np.array(self._table.rows(s, j * c, (j + 1) * c), np.int64)
            self._writer._submit_chunk(key, ids, functools.partial(self._chunk_parts, rows),
                                       parent=parent)

    def _chunk_parts(self, rows: np.ndarray) -> dict[str, np.ndarray]:
        """The parts of the given rows, [L, rows, Hkv, D or S] each, copied."""
        parts: dict[str, np.ndarray] = {}
        for layer in range(self._num_layers):
            for name, src in zip(_PART_NAMES, self._store.layer_arrays(layer)):
                if src is not None:
                    if name not in parts:
                        parts[name] = np.empty((self._num_layers, rows.size, *src.shape[1:]),
                                               src.dtype)
                    np.take(src, rows, axis=0, out=parts[name][layer])
        return parts

    # -- layout and memory ---------------------------------------------------------

    @property
    def layout(self) -> dict[str, dict[str, Any]]:
        """The storage, region by region in address order: byte offset, byte count, shape
        [L, P * page_size, Hkv, D or S] and dtype (docs/formats.md)."""
        return self._store.layout

    @property
    def strides(self) -> dict[str, tuple[int, ...]]:
        """Byte strides of each region over (layer, row, head, element); page g starts at
        row g * page_size."""
        return self._store.strides

    @property
    def memory_bytes(self) -> int:
        """Bytes of the K/V regions: num_pages * page_size * spec.bytes_per_position (the
        allocation adds gaps under 4 KiB between regions: docs/formats.md)."""
        return self._store.nbytes

    def _layer_arrays(self, layer: int) -> LayerArrays:
        """Writable views of one layer's rows (as KVCache._layer_arrays, rows = P * ps)."""
        return self._store.layer_arrays(check_index("layer", layer, self._num_layers))

    def __repr__(self) -> str:
        s = self._spec
        return (f"KVPool(layers={s.num_layers}, kv_heads={s.num_kv_heads}, head_dim={s.head_dim}, "
                f"format={s.format!r}, pages={self.num_pages}x{self._ps}, "
                + (f"window={self.window}, sink_tokens={self.sink_tokens}, "
                   if self.window is not None else "") +
                f"used={self.num_used_pages}, sequences={len(self._table.seqs)}"
                + (f", cached={self.num_cached_pages})" if self._table.prefix else ")"))


def consult_store(fetch: Any) -> list[tuple[int, dict[str, np.ndarray]]]:
    """(match_prefix, without the pool's guard) The chunks of a store fetch, read and
    checked: a lookup that fails (StoreError, or any other exception of the store) keeps
    the chunks checked before it and is the fetch's fault (logged), as a refused chunk is."""
    chunks: list[tuple[int, dict[str, np.ndarray]]] = []
    try:
        fetch.collect(chunks)
    except Exception as e:  # noqa: BLE001 (a fault of the store: counted, never raised)
        fetch.fault = str(e) if isinstance(e, StoreError) else f"{type(e).__name__}: {e}"
        log.warning("prefix cache: store lookup failed: %s", fetch.fault)
    return chunks


def completed_chunks(table: PageTable, s: int, added: int, c: int
                     ) -> list[tuple[int, bytes, np.ndarray, bytes | None]]:
    """The whole chunks of c positions that the last `added` committed positions of keyed
    sequence s completed: (chunk index j, the content key of its last page, its c token
    ids, the key of the chunk before it or None), for a store writer."""
    seq = table.get(s)
    if seq.ids is None or not added:
        return []
    per = c // table.page_size
    return [(j, seq.keys[(j + 1) * per - 1],
             np.frombuffer(bytes(seq.ids[8 * j * c:8 * (j + 1) * c]), "<i8"),
             seq.keys[j * per - 1] if j else None)
            for j in range((seq.length - added) // c, seq.length // c)]


def _check_grouped(spec: KVSpec, page_size: int) -> None:
    """FormatError when a grouped K format (q4_1ch) cannot live in this pool: its pages
    must hold whole groups (so do the pages a window releases)."""
    group = spec.k_fmt.group
    if group and page_size % group:
        raise FormatError(f"K format {spec.k_format} encodes groups of {group} positions: "
                          f"page_size must be a multiple of {group}, got {page_size}")


def _attached(spec: KVSpec, page_size: int, prefix_cache: bool, store: Any,
              writer: Any, window: int | None) -> tuple[Any, Any]:
    """(store, writer) checked against the pool's spec, page size and window (SpecError)."""
    if window is not None and writer is not None:
        raise SpecError(f"store_writer= needs a pool without a window: a store saves chunks "
                        f"from position 0, and window={window} releases the pages a query no "
                        f"longer sees (store= alone, for lookups, is taken)")
    if store is None and writer is None:
        return None, None
    from .store import KVStore, StoreWriter
    if store is None:
        raise SpecError("store_writer needs store= (the KVStore it writes to)")
    if not isinstance(store, KVStore):
        raise SpecError(f"store must be a kvcore.store.KVStore, got {type(store).__name__}")
    if not prefix_cache:
        raise SpecError("store= needs prefix_cache=True: the store continues the prefix "
                        "cache's lookups")
    for name in ("format", "num_layers", "num_kv_heads", "head_dim"):
        if getattr(store.spec, name) != getattr(spec, name):
            have, want = getattr(store.spec, name), getattr(spec, name)
            if name == "format":
                have, want = describe(have), describe(want)
            raise SpecError(f"store {name} {have} does not match the pool's {want}")
    if store.page_size != page_size:
        raise SpecError(f"store page_size {store.page_size} does not match the pool's "
                        f"{page_size}: their content keys would differ")
    if writer is not None and not (isinstance(writer, StoreWriter) and writer.store is store):
        raise SpecError("store_writer must be a kvcore.store.StoreWriter of the same store")
    return store, writer


def _counts(counts: object, n: int) -> list[int]:
    """counts as a list of n ints >= 0 (a list, tuple or integer array of any library)."""
    if is_array(counts):
        arr = check_ndarray("counts", counts)
        if arr.dtype.kind not in "iu":
            raise DTypeError(f"invalid dtype of counts: expected an integer type, got "
                             f"{arr.dtype}")
        if arr.ndim != 1:
            raise ShapeError(f"invalid shape of counts: expected [{n}] (one per sequence), "
                             f"got {list(arr.shape)}")
        counts = arr.tolist()
    elif isinstance(counts, (str, bytes)) or not hasattr(counts, "__iter__"):
        raise DTypeError(f"invalid type of counts: expected a sequence of ints >= 0 (one per "
                         f"sequence) or an integer array, got {type(counts).__name__} "
                         f"({counts!r})")
    values: list[Any] = list(counts)  # type: ignore[call-overload]  # iterable: checked above
    if len(values) != n:
        raise ShapeError(f"invalid shape of counts: expected [{n}] (one per sequence), "
                         f"got [{len(values)}]")
    for c in values:
        if isinstance(c, bool) or not isinstance(c, (int, np.integer)):
            raise DTypeError(f"counts must be ints >= 0, got {type(c).__name__} {c!r}")
        if c < 0:
            raise ShapeError(f"counts must be ints >= 0, got {c!r}")
    return [int(c) for c in values]
