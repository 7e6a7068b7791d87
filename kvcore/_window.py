"""Sliding windows of the pools (KVPool, GpuKVPool): their arguments, the views both pools
give of what a windowed sequence holds, and the rules of its snapshots and restores
(docs/design.md, Sliding windows). The bookkeeping itself is `_pages.PageTable`'s."""
from __future__ import annotations

from typing import Any

import numpy as np

from ._pages import PageTable, TableViews
from .errors import CapacityError, DTypeError, OutOfRangeError, RangeError, SnapshotError, SpecError
from .snapshot import Snapshot

_NO_POSITIONS = np.zeros(0, np.int64)


def check_window(window: object, sink_tokens: object) -> tuple[int | None, int]:
    """(window, sink_tokens) of a pool, checked (SpecError): window None or an int >= 1,
    sink_tokens an int >= 0, and > 0 only with a window."""
    if window is not None and (isinstance(window, bool)
                               or not isinstance(window, (int, np.integer)) or window < 1):
        raise SpecError(f"window must be None or an int >= 1 (positions a query sees, its "
                        f"own included), got {window!r}")
    if isinstance(sink_tokens, bool) or not isinstance(sink_tokens, (int, np.integer)) \
            or sink_tokens < 0:
        raise SpecError(f"sink_tokens must be an int >= 0, got {sink_tokens!r}")
    if sink_tokens and window is None:
        raise SpecError(f"sink_tokens={sink_tokens} needs a window (window=W): without one "
                        f"every position stays visible")
    return (None if window is None else int(window)), int(sink_tokens)


class WindowViews(TableViews):
    """What a pool whose bookkeeping is `self._table` (a PageTable) tells of its window (and,
    TableViews, of its pages and sequences)."""

    _table: PageTable

    @property
    def window(self) -> int | None:
        """W of a sliding-window pool (the query at p sees p - W < j <= p), None: none."""
        return self._table.window

    @property
    def sink_tokens(self) -> int:
        """S: the first S positions stay visible beside the window (0 without a window)."""
        return self._table.sink_tokens

    def first_held(self, seq: int) -> int:
        """The first position of seq past its sink pages that it still holds: 0 until a
        window released a page, then a multiple of page_size; seq holds [first_held,
        length) and, with sink_tokens, its sink pages' positions [0, ceil(S / page_size)
        * page_size) (`held`)."""
        return self._table.get(seq).start

    def held(self, seq: int) -> list[tuple[int, int]]:
        """The committed positions seq holds, as [start, stop) ranges in position order:
        [(0, length)] (none when empty), or once a window released pages, [(0, sink end),
        (first_held, length)] (the first absent without sink positions). dequantize and
        snapshots hold these positions, in this order."""
        return self._table.held(self._table.get(seq))

    def _attention_window(self, window: object, sink_tokens: object) -> tuple[Any, Any]:
        """(decode_attention) The window and sink positions a call on this pool applies:
        the caller's, unchanged, on a pool without a window; on a windowed pool the pool's
        when window is None (sink_tokens None or 0 then take the pool's too), else the
        caller's when they see no position the pool released (window <= W, sink_tokens
        <= S): RangeError otherwise. Values that are not ints are passed on unchanged, for
        decode_attention's own checks."""
        W, S = self._table.window, self._table.sink_tokens
        if W is None:
            return window, sink_tokens
        if window is None:
            window = W
            if sink_tokens is None or (sink_tokens.__class__ is int and sink_tokens == 0):
                return W, S
        if sink_tokens is None:
            sink_tokens = 0
        for name, value, most in (("window", window, W), ("sink_tokens", sink_tokens, S)):
            if isinstance(value, (int, np.integer)) and not isinstance(value, bool) \
                    and value > most:
                raise RangeError(f"decode_attention on a pool of window {W} and sink_tokens "
                                 f"{S} takes {name} <= {most}, got {value}: the pool released "
                                 f"the positions it would see")
        return window, sink_tokens


def snapshot_span(table: PageTable, seq: int, n: object) -> tuple[int, int, int]:
    """(n, start, sink_end) of a snapshot of the first n (None: length) committed positions
    of a sequence a window released pages of: it holds [0, sink_end) and [start, n).
    DTypeError / OutOfRangeError for a bad n, StateError when the window at n would need
    a released position (`PageTable.check_cut`)."""
    s = table.get(seq)
    if n is None:
        n = s.length
    elif isinstance(n, bool) or not isinstance(n, (int, np.integer)):
        raise DTypeError(f"invalid type of n: expected int or None, got {type(n).__name__}")
    if not 0 <= n <= s.length:
        raise OutOfRangeError(f"snapshot of {n} positions out of range: expected "
                              f"0 <= n <= length {s.length}")
    n = int(n)
    table.check_cut(seq, s, n, "snapshot")
    spans = table.held(s, n)
    if not spans or not spans[-1][0]:
        return n, 0, 0
    return n, spans[-1][0], spans[0][1] if len(spans) > 1 else 0


def restore_start(table: PageTable, snap: Snapshot) -> int:
    """(restore, a checked snapshot) The first held position past the sink pages of the
    sequence restoring snap makes: 0 (all of [0, length)) without a window or when the
    window needs every page; else the window's first page at snap.length (as an advance
    to that length leaves it), or the snapshot's own start when later. SnapshotError when
    snap lacks a position the pool's window or sink positions need at its length, or its
    held positions do not fall on this pool's pages."""
    ps, n = table.page_size, snap.length
    if table.window is None:
        return 0
    cut = (n - table.window + 1) // ps
    start = cut * ps if cut > table.sink_pages else 0
    if not snap.start:
        return start
    sinks = table.sink_pages * ps
    where = f"the snapshot holds positions [0, {snap.sink_end}) and [{snap.start}, {n})"
    if n - table.window + 1 < snap.start:
        raise SnapshotError(f"{where}, but this pool's window {table.window} needs "
                            f"positions from {max(0, n - table.window + 1)} at length {n}")
    if snap.sink_end < sinks:
        raise SnapshotError(f"{where}, but this pool keeps its sink pages, positions "
                            f"[0, {sinks}) (sink_tokens {table.sink_tokens}, page_size {ps})")
    start = max(start, snap.start)
    if start % ps:
        raise SnapshotError(f"{where}: its first held position {snap.start} does not "
                            f"start a page of this pool (page_size {ps})")
    return start


def restore_need(table: PageTable, snap: Snapshot, seq: int | None) -> int:
    """(restore, a checked snapshot) The first held position (`restore_start`) of the
    sequence restoring snap, after checking that the pool has the pages it takes (free or
    cached ones, plus those only `seq`, the sequence it replaces, holds): CapacityError
    with the numbers otherwise."""
    start = restore_start(table, snap)
    own = 0 if seq is None else sum(g >= 0 and table.refs[g] == 1 for g in table.get(seq).pages)
    need = -(-snap.length // table.page_size)
    if start:
        need -= start // table.page_size - table.sink_pages
    if need > table.available() + own:
        raise CapacityError(f"pool out of pages: restoring {snap.length} positions needs "
                            f"{need} pages, {table._short()}"
                            + (f" and sequence {seq} alone holds {own}" if own else ""))
    return start


def positions(spans: list[tuple[int, int]]) -> np.ndarray:
    """int64 [sum of lengths]: the positions of [start, stop) spans, in order."""
    return np.concatenate([np.arange(a, b) for a, b in spans]) if spans else _NO_POSITIONS


def snapshot_index(snap: Snapshot, spans: list[tuple[int, int]]) -> np.ndarray | None:
    """The indices into a snapshot's position axis of the positions in spans (each held
    by the snapshot), in order; None when they are all of its positions, in order."""
    at = positions(spans)
    if snap.start:
        at = np.where(at < snap.sink_end, at, at - snap.start + snap.sink_end)
    if at.size == snap.k_codes.shape[1] and (at.size == 0 or (at[0] == 0 and at[-1] == at.size - 1)):
        return None
    return at
