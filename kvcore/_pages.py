"""Bookkeeping of a KVPool, with no memory of its own: which pages are free, how many
sequences hold each page, and per sequence its pages, committed length and pending
positions per layer. Testable alone; `KVPool` (pool.py) pairs it with the storage.

Position p of a sequence lives in row `pages[p // page_size] * page_size + p %
page_size` of every layer. A page is held by the sequences whose page list names it
(`refs[g]` of them) or free (in `free`, refs 0), never both. Writes are planned first
(`plan_write`: every check, nothing changed), then the storage is written, then the plan
is committed (`commit_write`), so that a refused write changes no count.

With a prefix cache (`_prefix.PrefixIndex`), a sequence also keeps its committed token
ids and the chained keys of its full pages; `advance` registers each page as it fills, a
page whose refs drop to 0 stays cached when registered (`_release`), and pages are taken
from the free list first, then from the cached ones in eviction order (`_Taker`).

With a sliding window W (and S sink positions; `window=`, `sink_tokens=`), a sequence holds
only what a future query can see: wherever positions commit (`slide`), the pages whose
positions all lie below length - W + 1 and past the sink pages are released and their
entries in the page list become -1. A sequence then holds positions [0, sink_pages *
page_size) (its sink pages, `sink_pages` = ceil(S / page_size)) and [start, length), with
start a multiple of page_size (start 0: all of [0, length)). Every position at or past
start is held, so writes never meet a -1 entry.

The table keeps the block tables of the last list of sequences attended (`batch`: page
lists padded with -1, committed lengths, pending per layer, as numpy arrays), so that a
decode step's attention calls build none. A write or advance of exactly that list updates
it in place; any other change of a sequence's pages, length, start or pending (or of the
set of sequences) drops it (`_drop`), and the next `batch` call builds it again.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

from ._validate import check_index, check_seq_id
from ._prefix import Entry, PrefixIndex
from ._prefix_keys import ROOT, chain_key, encode_extra
from .errors import CapacityError, OutOfRangeError, ShapeError, StateError


_NO_EXTRA = encode_extra(None)


class Seq:
    """One sequence: its pages in position order (-1: released by a sliding window),
    committed length, pending per layer, the first held position past its sink pages
    (`start`; 0 when it holds all of [0, length)); with a prefix cache, its committed token
    ids (int64 little-endian bytes; None: not keyed, e.g. restored from a snapshot), the
    keys of its full pages and its extras' bytes."""

    __slots__ = ("pages", "length", "pending", "ids", "keys", "extra", "start")

    def __init__(self, num_layers: int, keyed: bool = False, extra: bytes = b""):
        self.pages: list[int] = []
        self.length = 0
        self.pending = [0] * num_layers
        self.ids: bytearray | None = bytearray() if keyed else None
        self.keys: list[bytes] = []
        self.extra = extra
        self.start = 0


@dataclass
class WritePlan:
    """What a write of counts[b] positions to sequence ids[b] needs (PageTable.plan_write):
    the physical row of each written position in input order, the pages to copy first
    (source, destination: copy-on-write), the new page lists, the pages it takes."""

    layer: int | None
    rows: list[int]
    copies: list[tuple[int, int]]
    changes: list[tuple[Seq, list[int] | None, int]] = field(default_factory=list)
    take: int = 0
    evict: list[int] = field(default_factory=list)   # cached pages among those it takes
    ids: list[int] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)


class Batch:
    """The block tables of one list of sequences (`ids`, each once), as the attention
    kernel reads them: pages int32 [B, M] (each page list, -1 past its end and for a page
    a window released; M >= 1 the longest list), npages int64 [B] (page list lengths),
    lengths int64 [B] (committed), pending int64 [num_layers, B], starts int64 [B] (first
    held positions: `Seq.start`), ones int64 [B] (1s: one query each). Kept by PageTable
    (`batch`); valid while it is the table's."""

    __slots__ = ("ids", "pages", "npages", "lengths", "pending", "starts", "ones")

    def __init__(self, ids: list[int], seqs: list[Seq], num_layers: int):
        B = len(seqs)
        self.ids = ids
        self.npages = np.array([len(q.pages) for q in seqs], np.int64)
        self.pages = np.full((B, max(int(self.npages.max(initial=0)), 1)), -1, np.int32)
        for b, q in enumerate(seqs):
            self.pages[b, :len(q.pages)] = q.pages
        self.lengths = np.array([q.length for q in seqs], np.int64)
        self.pending = np.array([q.pending for q in seqs], np.int64).reshape(B, num_layers).T.copy()
        self.starts = np.array([q.start for q in seqs], np.int64)
        self.ones = np.ones(B, np.int64)


class _Taker:
    """The pages a call would take, in order, taking none: the free list's top first, then
    cached pages in eviction order. taker(t) is the t-th (1-based), -1 past the last."""

    __slots__ = ("free", "nfree", "prefix", "cached", "victims", "evicted")

    def __init__(self, free: list[int], prefix: PrefixIndex | None):
        self.free, self.nfree, self.prefix = free, len(free), prefix
        self.cached = len(prefix.lru) if prefix is not None else 0
        self.victims: Iterator[int] | None = None
        self.evicted: list[int] = []

    def __call__(self, t: int) -> int:
        if t <= self.nfree:
            return self.free[self.nfree - t]
        i = t - self.nfree
        if i > self.cached:
            return -1
        if self.victims is None:
            assert self.prefix is not None      # cached > 0 only with a prefix index
            self.victims = self.prefix.victims()
        while len(self.evicted) < i:
            self.evicted.append(next(self.victims))
        return self.evicted[i - 1]


class PageTable:
    """Pages, reference counts, free list and per-sequence tables of one pool."""

    def __init__(self, num_pages: int, page_size: int, num_layers: int, capacity: int,
                 prefix: PrefixIndex | None = None, window: int | None = None,
                 sink_tokens: int = 0):
        self.window = window                  # None: every position stays held
        self.sink_tokens = sink_tokens        # S: positions [0, S) stay visible (a window only)
        self.sink_pages = -(-sink_tokens // page_size) if window is not None else 0
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_layers = num_layers
        self.capacity = capacity              # positions one sequence may hold
        self.refs = [0] * num_pages
        self.free = list(range(num_pages - 1, -1, -1))   # a stack: page 0 is taken first
        self.seqs: dict[int, Seq] = {}
        self._next_id = 0
        self.prefix = prefix                  # None: no prefix cache
        self._batch: Batch | None = None      # the last list attended (module comment)

    def __getstate__(self) -> dict[str, object]:
        """Copies (deepcopy, pickle) leave the cached batch behind: it is built again."""
        return {**self.__dict__, "_batch": None}

    def _drop(self) -> None:
        """Forgets the cached batch: a sequence's pages, length, start or pending changed
        otherwise than `commit_write` and `advance` follow."""
        self._batch = None

    def batch(self, ids: list[int]) -> Batch:
        """The block tables of sequences ids (ints, each once: the caller checked), kept
        from the last call while nothing dropped them; StateError for an unknown id."""
        b = self._batch
        if b is None or b.ids != ids:
            b = self._batch = Batch(list(ids), [self.get(s) for s in ids], self.num_layers)
        return b

    def cached(self, ids: list[int]) -> bool:
        """Whether batch(ids) is kept from an earlier call (so checked before)."""
        return self._batch is not None and self._batch.ids == ids

    def available(self) -> int:
        """Pages a write may take: free ones, then cached ones (evicted)."""
        return len(self.free) + (len(self.prefix.lru) if self.prefix is not None else 0)

    def counts(self) -> tuple[int, int, int, int, int, int]:
        """(free, cached, in use, hits, misses, evictions): the pages of each kind (they add
        up to num_pages; a page held by several sequences counts once), then the prefix
        cache's counters (zeros without one)."""
        idx = self.prefix
        cached = len(idx.lru) if idx is not None else 0
        used = self.num_pages - len(self.free) - cached
        return (len(self.free), cached, used,
                *((idx.hits, idx.misses, idx.evictions) if idx is not None else (0, 0, 0)))

    def _short(self) -> str:
        """'3 of 8 are free' (and ', 2 cached' with a prefix cache): for CapacityError."""
        cached = f", {len(self.prefix.lru)} cached" if self.prefix is not None else ""
        return f"{len(self.free)} of {self.num_pages} are free{cached}"

    # -- sequences -----------------------------------------------------------------

    def new(self, extra: bytes | None = None) -> int:
        """A new empty sequence (keyed, with a prefix cache: `extra` its extras' bytes,
        default none); returns its id."""
        s = self._next_id
        self._next_id += 1
        keyed = self.prefix is not None
        self.seqs[s] = Seq(self.num_layers, keyed,
                           (_NO_EXTRA if extra is None else extra) if keyed else b"")
        return s

    def get(self, s: object) -> Seq:
        """The sequence of id s: StateError when there is none, DTypeError when s is not an
        int (check_seq_id: 0.0 or False would find sequence 0 by equality)."""
        seq = self.seqs.get(s if s.__class__ is int else check_seq_id(s))
        if seq is None:
            raise StateError(f"unknown sequence {s!r}: never made by this pool, or freed")
        return seq

    def free_seq(self, s: int) -> None:
        seq = self.get(s)
        self._release(seq.pages)
        del self.seqs[s]
        self._drop()

    def truncate(self, s: int, n: int) -> None:
        """Keeps the first n committed positions, drops every pending one, and releases
        the pages past ceil(n / page_size). With a window, StateError (nothing changed)
        when a position the window needs at length n was released (`check_cut`)."""
        seq = self.get(s)
        if isinstance(n, bool) or not isinstance(n, int):
            n = check_index("n", n, seq.length + 1)
        if not 0 <= n <= seq.length:
            raise OutOfRangeError(f"truncate of sequence {s} to {n} out of range: expected "
                                  f"0 <= n <= length {seq.length}")
        self.check_cut(s, seq, n, "truncate")
        self._drop()
        if seq.start and n <= self.sink_pages * self.page_size:
            seq.start = 0                 # within the sink pages: all of [0, n) is held
        keep = -(-n // self.page_size)
        if self.prefix is not None:       # a rolled-back page never answers a lookup
            for g in seq.pages[n // self.page_size:]:
                self.prefix.unregister(g)
            if seq.ids is not None:
                del seq.ids[8 * n:]
            del seq.keys[n // self.page_size:]
        self._release(seq.pages[keep:])
        del seq.pages[keep:]
        seq.length = n
        seq.pending = [0] * self.num_layers

    # -- the sliding window -----------------------------------------------------------

    def held(self, seq: Seq, n: int | None = None) -> list[tuple[int, int]]:
        """The positions of seq's first n (default: length) committed ones that it holds,
        as [start, stop) ranges in order: [(0, n)], or [(0, sink_pages * page_size),
        (start, n)] once a window released the pages between (the first range absent
        without sink positions). n must pass `check_cut` (the caller's)."""
        n = seq.length if n is None else n
        if not seq.start or n <= self.sink_pages * self.page_size:
            return [(0, n)] if n else []
        sinks = self.sink_pages * self.page_size
        return ([(0, sinks)] if sinks else []) + [(seq.start, n)]

    def check_cut(self, s: int, seq: Seq, n: int, what: str) -> None:
        """StateError unless seq, cut to its first n committed positions (truncate,
        snapshot), still holds every position the window needs there: the sink positions
        and [n - W + 1, n) (what the next query, at position n, sees)."""
        if not seq.start or n <= self.sink_pages * self.page_size:
            return
        assert self.window is not None              # start > 0 only with a window
        if n - self.window + 1 < seq.start:
            raise StateError(
                f"{what} of sequence {s} to {n} positions needs positions from "
                f"{max(0, n - self.window + 1)} (window {self.window}), but the window "
                f"released them: sequence {s} holds positions from {seq.start} "
                f"(first_held); a windowed sequence rolls back only to n >= "
                f"{seq.start + self.window - 1}")

    def slide(self, seq: Seq) -> None:
        """Releases the pages of seq that no query at a position >= its length can see:
        every position in them lies below length - W + 1 and past the sink positions
        (pages from sink_pages on). Their entries become -1; a registered page stays cached
        (its content is still the K/V of its key), another becomes free. No-op without a
        window."""
        if self.window is None:
            return
        ps = self.page_size
        cut = (seq.length - self.window + 1) // ps   # pages [0, cut) are out of every window
        if cut <= self.sink_pages or cut * ps <= seq.start:
            return
        pages = seq.pages
        first = max(self.sink_pages, seq.start // ps)
        gone = [g for g in pages[first:cut] if g >= 0]
        pages[first:cut] = [-1] * (cut - first)
        seq.start = cut * ps
        self._release(gone)
        self._drop()

    def place(self, s: int, n: int, start: int) -> list[int]:
        """(restore) Gives sequence s, empty, n committed positions that hold [0,
        sink_pages * page_size) and [start, n) (all of [0, n) when start is 0; start a
        multiple of page_size): a page for each page index holding one of them, taken as a
        write takes pages (free ones first, then cached ones, evicted), -1 for the others.
        The caller checked that enough pages are available. Returns the storage rows of
        the held positions, in order. s has no token ids afterwards: a snapshot carries
        none, so its pages are never registered in a prefix cache."""
        seq, ps, refs = self.get(s), self.page_size, self.refs
        count = -(-n // ps)
        held = list(range(count)) if not start else [*range(self.sink_pages),
                                                     *range(start // ps, count)]
        pick = _Taker(self.free, self.prefix)
        pages = [-1] * count
        for t, i in enumerate(held, 1):
            g = pick(t)
            assert g >= 0                  # the caller checked available()
            pages[i] = g
            refs[g] = 1
        taken = len(held)
        del self.free[len(self.free) - min(taken, pick.nfree):]
        if taken > pick.nfree:
            self._index.evict(pick.evicted[:taken - pick.nfree])
        seq.pages, seq.length, seq.start = pages, n, start
        seq.pending = [0] * self.num_layers
        seq.ids, seq.keys = None, []
        self._drop()
        return [pages[p // ps] * ps + p % ps for a, b in self.held(seq) for p in range(a, b)]

    def fork(self, s: int) -> tuple[int, tuple[int, int] | None]:
        """A new sequence holding s's committed positions: s's full pages shared (refs + 1),
        its partial last page copied into a free page. Returns (id, (source, destination)
        page of the copy the caller makes, or None); CapacityError (nothing changed) when
        a copy is needed and no page is free."""
        seq = self.get(s)
        full, part = divmod(seq.length, self.page_size)
        if part and not self.available():
            raise CapacityError(f"fork of sequence {s} needs 1 free page for its partial last "
                                f"page ({part} of {self.page_size} positions), {self._short()}")
        t = self.new(seq.extra)
        new = self.seqs[t]
        new.pages = seq.pages[:full]
        new.length = seq.length
        new.start = seq.start
        if seq.ids is not None:
            new.ids = seq.ids[:8 * seq.length]
            new.keys = seq.keys[:full]
        else:
            new.ids = None
        for g in new.pages:
            if g >= 0:                        # -1: released by the window
                self.refs[g] += 1
        copy = None
        if part:
            dst = self._take_one()
            self.refs[dst] = 1
            new.pages.append(dst)
            copy = (seq.pages[full], dst)
        return t, copy

    @property
    def _index(self) -> PrefixIndex:
        """The prefix index, on the paths that run only when the pool has one."""
        assert self.prefix is not None
        return self.prefix

    def _take_one(self) -> int:
        """Takes one page (the caller checked available()): a free one, else evicts."""
        if self.free:
            return self.free.pop()
        g = next(self._index.victims())
        self._index.evict([g])
        return g

    def match(self, tokens: np.ndarray, extra: bytes) -> tuple[int, int]:
        """A new sequence holding the longest run of cached full pages that starts tokens
        (int64 [T]), at most T - 1 positions; returns (id, positions)."""
        ps, index, refs = self.page_size, self._index, self.refs
        raw = tokens.astype("<i8", copy=False).tobytes()
        limit = max(0, (tokens.size - 1) // ps)
        parent, pages, keys = ROOT, list[int](), list[bytes]()
        for i in range(limit):
            key = chain_key(parent, tokens[i * ps:(i + 1) * ps], extra)
            g = index.find(parent, key, raw[8 * i * ps:8 * (i + 1) * ps], extra)
            if g is None:
                break
            pages.append(g)
            keys.append(key)
            parent = key
        index.hits += len(pages)
        index.misses += limit - len(pages)
        s = self.new(extra)
        seq = self.seqs[s]
        seq.pages, seq.keys, seq.length = pages, keys, len(pages) * ps
        seq.ids = bytearray(raw[:8 * seq.length])
        for g in pages:
            if refs[g] == 0:
                del index.lru[g]             # cached -> in use
            refs[g] += 1
        self.slide(seq)                      # a window keeps only the pages it sees
        return s, seq.length

    def advance(self, ids: list[int], tokens: list[np.ndarray] | None = None) -> list[int]:
        """Commits the pending positions of each sequence; all are checked first (every
        layer of a sequence must hold the same number: StateError names the layers).
        With a prefix cache, tokens[b] (int64 [pending]) are the ids of sequence ids[b]'s
        new positions (required for a keyed sequence), and each page that fills is
        registered."""
        seqs = [self.get(s) for s in ids]
        if len(set(ids)) != len(ids):
            raise StateError(f"advance names a sequence twice: {ids}")
        for s, seq in zip(ids, seqs):
            p = seq.pending
            if p.count(p[0]) != len(p):
                raise StateError(f"advance of sequence {s} needs the same number of pending "
                                 f"positions in every layer: {_count_groups(p)}")
        if tokens is not None or self.prefix is not None:
            self.check_tokens(ids, [seq.pending[0] for seq in seqs], tokens)
        kept = self._batch
        if kept is not None and kept.ids == ids:     # a decode step's advance
            kept.lengths += kept.pending[0]
            kept.pending[:] = 0
        else:
            self._drop()
        out = []
        for b, seq in enumerate(seqs):
            t = seq.pending[0]
            if t:
                seq.length += t
                seq.pending = [0] * self.num_layers
                if seq.ids is not None:
                    assert tokens is not None       # _check_tokens: a keyed sequence has them
                    seq.ids += tokens[b].astype("<i8", copy=False).tobytes()
                    self._register(seq)     # before the slide: a page fills, then leaves
                if self.window is not None:
                    self.slide(seq)
            out.append(t)
        return out

    def check_tokens(self, ids: list[int], counts: list[int],
                     tokens: list[np.ndarray] | None) -> None:
        """Checks the token ids `advance` would commit for counts[b] new positions of
        sequence ids[b] (StateError, ShapeError); changes nothing. Call it only with
        tokens, or with a prefix cache."""
        if self.prefix is None:
            raise StateError("advance got tokens, but this pool has no prefix cache "
                             "(made without prefix_cache=True)")
        if tokens is not None and len(tokens) != len(ids):
            raise ShapeError(f"invalid tokens: expected {len(ids)} id arrays (one per sequence), "
                             f"got {len(tokens)}")
        for b, (s, t) in enumerate(zip(ids, counts)):
            seq = self.get(s)
            if tokens is None:
                if t and seq.ids is not None:
                    raise StateError(f"advance of sequence {s} needs the token ids of its {t} "
                                     f"new positions (tokens=): the pool has a prefix cache")
            elif tokens[b].size != t:
                raise ShapeError(f"invalid tokens of sequence {s}: expected {t} ids (its pending "
                                 f"positions), got {tokens[b].size}")

    def _register(self, seq: Seq) -> None:
        """Keys and registers the full pages of seq past those it has keys for."""
        ps, keys, raw = self.page_size, seq.keys, seq.ids
        assert raw is not None                  # only keyed sequences register
        parent = keys[-1] if keys else ROOT
        for i in range(len(keys), seq.length // ps):
            ids = bytes(raw[8 * i * ps:8 * (i + 1) * ps])
            key = chain_key(parent, np.frombuffer(ids, "<i8"), seq.extra)
            keys.append(key)
            self._index.register(seq.pages[i], key, parent, ids, seq.extra)
            parent = key

    # -- writes --------------------------------------------------------------------

    def plan_write(self, layer: int | None, ids: list[int], counts: list[int]) -> WritePlan:
        """Checks a write of counts[b] positions after the held ones of sequence ids[b] in
        `layer` (None: after the committed ones, for every layer: a reservation) and plans
        it; changes nothing. A write into a page that others hold copies it first; when
        several of the call's sequences hold it, each but the last copies it and the last
        writes in place, as one call per sequence would (the caller makes every copy
        before it writes a row). Raises StateError (unknown or repeated sequence),
        CapacityError (a sequence past `capacity`, or too few free pages for the call)."""
        ps, refs, table = self.page_size, self.refs, self.seqs
        pick: _Taker | None = None   # made when a page is needed
        plan = WritePlan(layer, [], [], ids=ids, counts=counts)
        rows, changes = plan.rows, plan.changes
        try:
            repeated = len(set(ids)) != len(ids)
        except TypeError:            # an unhashable id, refused by get below
            repeated = False
        if repeated:
            for s in ids:
                self.get(s)          # a float or bool id equal to another: DTypeError first
            twice = next(s for i, s in enumerate(ids) if s in ids[:i])
            raise StateError(f"sequence {twice} appears twice in one write")
        short = []    # (sequence, pages it takes) for the error message
        take = 0
        moved: dict[int, int] = {}   # page -> holders this call's earlier copies took off it
        for s, t in zip(ids, counts):
            seq = table.get(s) if s.__class__ is int else None
            if seq is None:
                seq = self.get(s)    # raises the error for an unknown id
            end = seq.length if layer is None else seq.length + seq.pending[layer]
            if t == 1:    # the decode step: one position in a page the sequence holds alone
                pages = seq.pages
                i = end // ps
                if i < len(pages) and refs[pages[i]] == 1 and end < self.capacity:
                    rows.append(pages[i] * ps + end - i * ps)
                    changes.append((seq, None, 1))
                    continue
            stop = end + t
            if stop > self.capacity:
                where = "" if layer is None else f" layer {layer}"
                raise CapacityError(f"sequence {s} full:{where} asked for position {stop - 1} "
                                    f"(holds {end}, appending {t}), capacity is "
                                    f"{self.capacity} positions"
                                    + self._pending_hint(layer, [s]))
            if t == 0:
                continue
            pages = seq.pages
            first, last = end // ps, (stop - 1) // ps
            held = len(pages)
            # a page the call's earlier writes copied away from is shared by fewer: its
            # last holder writes in place (as one call per sequence would)
            shared = [i for i in range(first, min(last + 1, held))
                      if refs[pages[i]] - moved.get(pages[i], 0) > 1]
            new = None
            if shared or last >= held:
                if pick is None:
                    pick = _Taker(self.free, self.prefix)
                new = pages.copy()
                before = take
                for i in shared:           # copy-on-write: the write gets its own copy
                    take += 1
                    dst = pick(take)
                    plan.copies.append((pages[i], dst))
                    moved[pages[i]] = moved.get(pages[i], 0) + 1
                    new[i] = dst
                for _ in range(held, last + 1):
                    take += 1
                    new.append(pick(take))
                short.append((s, take - before))
                pages = new
            if t == 1:
                rows.append(pages[first] * ps + end % ps)
            else:
                rows.extend([pages[p // ps] * ps + p % ps for p in range(end, stop)])
            changes.append((seq, new, t))
        if take:
            assert pick is not None          # made when the first page was needed
            if take > pick.nfree + pick.cached:
                need = ", ".join(f"sequence {s}: {k}" for s, k in short)
                raise CapacityError(f"pool out of pages: the write needs {take} new pages "
                                    f"({need}), {self._short()}"
                                    + self._pending_hint(layer, ids))
            plan.evict = pick.evicted[:max(0, take - pick.nfree)]
        plan.take = take
        return plan

    def _pending_hint(self, layer: int | None, ids: list[int]) -> str:
        """For a CapacityError of a write to `layer` of sequences ids (all known): the
        positions of that layer they hold pending, and to advance; '' when none is."""
        if layer is None:
            return ""
        return pending_hint(layer, [(s, self.seqs[s].pending[layer]) for s in ids])

    def commit_write(self, plan: WritePlan) -> None:
        """Applies a plan made by plan_write with no change to the table since."""
        refs = self.refs
        layer = plan.layer
        paged = False
        for seq, new, t in plan.changes:
            if new is not None:
                paged = True
                old = seq.pages
                for i, g in enumerate(new):
                    if i >= len(old):
                        refs[g] = 1
                    elif g != old[i]:       # copied: the source stays with its other holders
                        refs[old[i]] -= 1
                        assert refs[old[i]] > 0     # plan_write: its last holder keeps it
                        refs[g] = 1
                seq.pages = new
            if layer is not None:
                seq.pending[layer] += t
        kept = self._batch
        if kept is not None and layer is not None and not paged and kept.ids == plan.ids:
            kept.pending[layer] += plan.counts       # a decode step's write
        else:
            self._drop()
        if plan.take:
            del self.free[len(self.free) - (plan.take - len(plan.evict)):]
            if plan.evict:
                self._index.evict(plan.evict)

    # -- reads ---------------------------------------------------------------------

    def rows(self, s: int, start: int, stop: int) -> list[int]:
        """Physical rows of positions [start, stop) of sequence s (held positions only)."""
        pages, ps = self.get(s).pages, self.page_size
        return [pages[p // ps] * ps + p % ps for p in range(start, stop)]

    def held_rows(self, s: int, n: int, pending: int = 0) -> list[int]:
        """Physical rows of the positions of s's first n committed ones that it holds
        (`held`), then of `pending` positions past its length, in order."""
        seq = self.get(s)
        pages, ps = seq.pages, self.page_size
        spans = self.held(seq, n)
        if pending:
            spans.append((seq.length, seq.length + pending))
        return [pages[p // ps] * ps + p % ps for a, b in spans for p in range(a, b)]

    # -- tiers: a GpuKVPool's pages moved to and from its host pool ----------------

    def plan_take(self, k: int) -> tuple[list[int], list[int]]:
        """The pages a call taking k would take, as a write takes them (free ones first,
        then cached ones in eviction order; fewer when fewer are available), and the
        cached ones among them; changes nothing. Give them to `extend`."""
        pick = _Taker(self.free, self.prefix)
        pages = []
        for t in range(1, k + 1):
            g = pick(t)
            if g < 0:
                break
            pages.append(g)
        return pages, pick.evicted[:max(0, len(pages) - pick.nfree)]

    def extend(self, s: int, pages: list[int], evicted: list[int],
               blocks: list[tuple[bytes, bytes]]) -> None:
        """Gives keyed sequence s (whole pages committed, nothing pending) `pages` (from
        plan_take, `evicted` the cached ones among them, with no change to the table
        since) as its next full pages, blocks[i] = (key, token ids as int64 bytes) of
        page i, each registered under its key (the caller fills their bytes)."""
        seq, index, ps = self.get(s), self._index, self.page_size
        assert seq.ids is not None and seq.length == len(seq.pages) * ps
        del self.free[len(self.free) - (len(pages) - len(evicted)):]
        if evicted:
            index.evict(evicted)
        parent = seq.keys[-1] if seq.keys else ROOT
        for g, (key, ids) in zip(pages, blocks):
            self.refs[g] = 1
            index.register(g, key, parent, ids, seq.extra)
            seq.pages.append(g)
            seq.keys.append(key)
            seq.ids += ids
            parent = key
        seq.length += len(pages) * ps
        self._drop()

    def admit(self, pages: list[int], evicted: list[int], entries: list[Entry]) -> None:
        """(a host pool) Registers `pages` (from plan_take, `evicted` the cached ones among
        them, with no change to the table since) as cached pages, page i under entries[i]
        (a PrefixIndex Entry of another pool: key, parent, ids, extra), most recent last;
        the caller copied their bytes in."""
        index = self._index
        del self.free[len(self.free) - (len(pages) - len(evicted)):]
        if evicted:
            index.evict(evicted)
        for g, e in zip(pages, entries):
            index.register(g, e.key, e.parent, e.ids, e.extra)
            index.lru[g] = None
        self._drop()

    def drop(self, pages: list[int]) -> None:
        """Unregisters cached pages whose bytes are no longer their key's: free."""
        for g in pages:
            assert self.refs[g] == 0
            self._index.unregister(g)
            self.free.append(g)
        self._drop()

    def hold(self, pages: list[int]) -> list[int]:
        """Takes one hold of each page (a cached one leaves the LRU: never evicted while
        held); returns the LRU order before, for `release` to put back."""
        order = list(self.prefix.lru) if self.prefix is not None else []
        for g in pages:
            if self.refs[g] == 0 and self.prefix is not None:
                self.prefix.lru.pop(g, None)
            self.refs[g] += 1
        return order

    def release(self, pages: list[int], order: list[int] | None = None) -> None:
        """Drops one hold of each page (as a sequence's free does); with `order` (what
        hold returned), the pages that become cached again take their old places."""
        self._release(pages)
        if order is not None and self.prefix is not None:
            lru = self.prefix.lru
            old = [g for g in order if g in lru]
            kept = set(old)
            self.prefix.lru = OrderedDict.fromkeys(old + [g for g in lru if g not in kept])
        self._drop()

    def _release(self, pages: list[int]) -> None:
        """Drops one hold of each page, the last first (so that a chain's leaf is the least
        recent); a page no one holds becomes cached when registered, free otherwise."""
        refs, free = self.refs, self.free
        cached = self.prefix.entries if self.prefix is not None else ()
        for g in reversed(pages):
            if g < 0:
                continue                    # released by the window already
            refs[g] -= 1
            if refs[g] == 0:
                if g in cached:
                    self._index.lru[g] = None
                else:
                    free.append(g)


def pending_hint(layer: int, pending: list[tuple[int | None, int]]) -> str:
    """'; 12 positions of layer 0 [of sequence 3] are pending: call advance() ...' for
    the (sequence or None, pending count) pairs of a refused write; '' when all are 0."""
    held = [(s, n) for s, n in pending if n]
    if not held:
        return ""
    if len(held) == 1:
        s, n = held[0]
        what = (f"{n} position{'s' if n != 1 else ''} of layer {layer}"
                + ("" if s is None else f" of sequence {s}") + (" are" if n != 1 else " is"))
    else:
        what = (f"positions of layer {layer} are pending ("
                + ", ".join(f"sequence {s}: {n}" for s, n in held) + ")")
    return (f"; {what}{'' if len(held) > 1 else ' pending'}: call advance() once every layer "
            f"holds the step's positions")


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
    for a, b in zip(xs, xs[1:] + [-1]):
        if b != a + 1:
            out.append(str(start) if start == a else f"{start}-{a}")
            start = b
    return ", ".join(out)


class TableViews:
    """What a pool whose bookkeeping is `self._table` (a PageTable) tells of its pages and
    sequences: KVPool's and GpuKVPool's, the same."""

    _table: PageTable

    @property
    def num_pages(self) -> int:
        return self._table.num_pages

    @property
    def num_free_pages(self) -> int:
        """Pages no sequence holds and no cache keeps."""
        return len(self._table.free)

    @property
    def num_cached_pages(self) -> int:
        """Pages of the prefix cache that no sequence holds (taken back when needed)."""
        return self._table.counts()[1]

    @property
    def num_used_pages(self) -> int:
        """Pages held by at least one sequence (a shared page counts once)."""
        return self._table.counts()[2]

    @property
    def sequences(self) -> list[int]:
        """Ids of the live sequences, oldest first."""
        return list(self._table.seqs)

    def length(self, seq: int) -> int:
        """Committed positions of seq, the same in every layer."""
        return self._table.get(seq).length

    def page_table(self, seq: int) -> np.ndarray:
        """The page ids seq holds, in position order: int32 [ceil(held / page_size)] (a
        copy); -1 for a page a window released."""
        return np.array(self._table.get(seq).pages, np.int32)
