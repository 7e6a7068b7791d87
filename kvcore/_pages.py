"""Bookkeeping of a KVPool, with no memory of its own: which pages are free, how many
sequences hold each page, and per sequence its pages, committed length and pending
positions per layer. Testable alone; `KVPool` (pool.py) pairs it with the storage.

Position p of a sequence lives in row `pages[p // page_size] * page_size + p %
page_size` of every layer. A page is held by the sequences whose page list names it
(`refs[g]` of them) or free (in `free`, refs 0), never both. Writes are planned first
(`plan_write`: every check, nothing changed), then the storage is written, then the plan
is committed (`commit_write`), so that a refused write changes no count.

Room for a prefix cache (issue 15): a page whose refs drop to 0 goes back to `free`
through `_release` only, the one place a cached-but-unheld state would be added.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ._validate import check_index
from .errors import CapacityError, OutOfRangeError, StateError


class Seq:
    """One sequence: its pages in position order, committed length, pending per layer."""

    __slots__ = ("pages", "length", "pending")

    def __init__(self, num_layers: int):
        self.pages: list[int] = []
        self.length = 0
        self.pending = [0] * num_layers


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


class PageTable:
    """Pages, reference counts, free list and per-sequence tables of one pool."""

    def __init__(self, num_pages: int, page_size: int, num_layers: int, capacity: int):
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_layers = num_layers
        self.capacity = capacity              # positions one sequence may hold
        self.refs = [0] * num_pages
        self.free = list(range(num_pages - 1, -1, -1))   # a stack: page 0 is taken first
        self.seqs: dict[int, Seq] = {}
        self._next_id = 0

    # -- sequences -----------------------------------------------------------------

    def new(self) -> int:
        s = self._next_id
        self._next_id += 1
        self.seqs[s] = Seq(self.num_layers)
        return s

    def get(self, s: object) -> Seq:
        try:
            if not isinstance(s, bool):
                return self.seqs[s]  # type: ignore[index]  # any object: a miss is refused below
        except (KeyError, TypeError):
            pass
        raise StateError(f"unknown sequence {s!r}: never made by this pool, or freed")

    def free_seq(self, s: int) -> None:
        seq = self.get(s)
        self._release(seq.pages)
        del self.seqs[s]

    def truncate(self, s: int, n: int) -> None:
        """Keeps the first n committed positions, drops every pending one, and releases
        the pages past ceil(n / page_size)."""
        seq = self.get(s)
        if isinstance(n, bool) or not isinstance(n, int):
            n = check_index("n", n, seq.length + 1)
        if not 0 <= n <= seq.length:
            raise OutOfRangeError(f"truncate of sequence {s} to {n} out of range: expected "
                                  f"0 <= n <= length {seq.length}")
        keep = -(-n // self.page_size)
        self._release(seq.pages[keep:])
        del seq.pages[keep:]
        seq.length = n
        seq.pending = [0] * self.num_layers

    def fork(self, s: int) -> tuple[int, tuple[int, int] | None]:
        """A new sequence holding s's committed positions: s's full pages shared (refs + 1),
        its partial last page copied into a free page. Returns (id, (source, destination)
        page of the copy the caller makes, or None); CapacityError (nothing changed) when
        a copy is needed and no page is free."""
        seq = self.get(s)
        full, part = divmod(seq.length, self.page_size)
        if part and not self.free:
            raise CapacityError(f"fork of sequence {s} needs 1 free page for its partial last "
                                f"page ({part} of {self.page_size} positions), 0 of "
                                f"{self.num_pages} are free")
        t = self.new()
        new = self.seqs[t]
        new.pages = seq.pages[:full]
        new.length = seq.length
        for g in new.pages:
            self.refs[g] += 1
        copy = None
        if part:
            dst = self.free.pop()
            self.refs[dst] = 1
            new.pages.append(dst)
            copy = (seq.pages[full], dst)
        return t, copy

    def advance(self, ids: list[int]) -> list[int]:
        """Commits the pending positions of each sequence; all are checked first (every
        layer of a sequence must hold the same number: StateError names the layers)."""
        seqs = [self.get(s) for s in ids]
        if len(set(ids)) != len(ids):
            raise StateError(f"advance names a sequence twice: {ids}")
        for s, seq in zip(ids, seqs):
            p = seq.pending
            if p.count(p[0]) != len(p):
                raise StateError(f"advance of sequence {s} needs the same number of pending "
                                 f"positions in every layer: {_count_groups(p)}")
        out = []
        for seq in seqs:
            t = seq.pending[0]
            if t:
                seq.length += t
                seq.pending = [0] * self.num_layers
            out.append(t)
        return out

    # -- writes --------------------------------------------------------------------

    def plan_write(self, layer: int | None, ids: list[int], counts: list[int]) -> WritePlan:
        """Checks a write of counts[b] positions after the held ones of sequence ids[b] in
        `layer` (None: after the committed ones, for every layer: a reservation) and plans
        it; changes nothing. Raises StateError (unknown or repeated sequence),
        CapacityError (a sequence past `capacity`, or too few free pages for the call)."""
        ps, refs, free, table = self.page_size, self.refs, self.free, self.seqs
        nfree = len(free)
        plan = WritePlan(layer, [], [])
        rows, changes = plan.rows, plan.changes
        try:
            repeated = len(set(ids)) != len(ids)
        except TypeError:            # an unhashable id, refused by get below
            repeated = False
        if repeated:
            twice = next(s for i, s in enumerate(ids) if s in ids[:i])
            raise StateError(f"sequence {twice} appears twice in one write")
        short = []    # (sequence, pages it takes) for the error message
        take = 0
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
                                    f"{self.capacity} positions")
            if t == 0:
                continue
            pages = seq.pages
            first, last = end // ps, (stop - 1) // ps
            held = len(pages)
            shared = [i for i in range(first, min(last + 1, held)) if refs[pages[i]] > 1]
            new = None
            if shared or last >= held:
                new = pages.copy()
                before = take
                for i in shared:           # copy-on-write: the write gets its own copy
                    take += 1
                    dst = free[nfree - take] if take <= nfree else -1
                    plan.copies.append((pages[i], dst))
                    new[i] = dst
                for _ in range(held, last + 1):
                    take += 1
                    new.append(free[nfree - take] if take <= nfree else -1)
                short.append((s, take - before))
                pages = new
            if t == 1:
                rows.append(pages[first] * ps + end % ps)
            else:
                rows.extend([pages[p // ps] * ps + p % ps for p in range(end, stop)])
            changes.append((seq, new, t))
        if take > nfree:
            need = ", ".join(f"sequence {s}: {k}" for s, k in short)
            raise CapacityError(f"pool out of pages: the write needs {take} new pages ({need}), "
                                f"{nfree} of {self.num_pages} are free")
        plan.take = take
        return plan

    def commit_write(self, plan: WritePlan) -> None:
        """Applies a plan made by plan_write with no change to the table since."""
        refs = self.refs
        layer = plan.layer
        for seq, new, t in plan.changes:
            if new is not None:
                old = seq.pages
                for i, g in enumerate(new):
                    if i >= len(old):
                        refs[g] = 1
                    elif g != old[i]:       # copied: the source stays with its other holders
                        refs[old[i]] -= 1
                        refs[g] = 1
                seq.pages = new
            if layer is not None:
                seq.pending[layer] += t
        if plan.take:
            del self.free[len(self.free) - plan.take:]

    # -- reads ---------------------------------------------------------------------

    def rows(self, s: int, start: int, stop: int) -> list[int]:
        """Physical rows of positions [start, stop) of sequence s (held pages only)."""
        pages, ps = self.get(s).pages, self.page_size
        return [pages[p // ps] * ps + p % ps for p in range(start, stop)]

    def _release(self, pages: list[int]) -> None:
        refs, free = self.refs, self.free
        for g in reversed(pages):
            refs[g] -= 1
            if refs[g] == 0:
                free.append(g)


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
