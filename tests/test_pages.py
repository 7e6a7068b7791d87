"""PageTable, the pool's bookkeeping, alone: no storage, only counts and lists."""
import pytest

from kvcore._pages import PageTable
from kvcore.errors import CapacityError, OutOfRangeError, StateError


def table(pages=8, ps=4, layers=2, capacity=20, window=None, sinks=0):
    return PageTable(pages, ps, layers, capacity, None, window, sinks)


def write(t, layer, ids, counts):
    plan = t.plan_write(layer, ids, counts)
    t.commit_write(plan)
    return plan


def check(t):
    """free + held = P, refs = holders, no free page held (-1: released by a window)."""
    holders = [0] * t.num_pages
    for seq in t.seqs.values():
        for g in seq.pages:
            if g >= 0:
                holders[g] += 1
    assert holders == t.refs
    assert sorted(t.free) == [g for g in range(t.num_pages) if holders[g] == 0]
    assert len(set(t.free)) == len(t.free)


def test_pages_are_taken_when_a_write_first_needs_them():
    t = table()
    s = t.new()
    assert t.get(s).pages == [] and len(t.free) == 8
    plan = write(t, 0, [s], [5])
    assert plan.rows == [0, 1, 2, 3, 4] and plan.take == 2 and t.get(s).pages == [0, 1]
    write(t, 1, [s], [5])          # layer 1 finds the pages layer 0 took
    assert len(t.free) == 6 and t.get(s).pending == [5, 5]
    assert t.advance([s]) == [5] and t.get(s).length == 5
    check(t)


def test_batched_write_rows_follow_each_sequence_and_take_in_order():
    t = table()
    a, b = t.new(), t.new()
    plan = write(t, 0, [a, b], [1, 6])
    assert t.get(a).pages == [0] and t.get(b).pages == [1, 2]
    assert plan.rows == [0, 4, 5, 6, 7, 8, 9]
    check(t)


def test_refused_writes_change_nothing():
    t = table(pages=3, ps=4, capacity=10)
    a, b = t.new(), t.new()
    write(t, 0, [a], [4])
    before = (list(t.free), list(t.refs), list(t.get(a).pages), list(t.get(a).pending))
    with pytest.raises(CapacityError, match=r"sequence 1 full: layer 0 asked for position 10 "
                                            r"\(holds 0, appending 11\), capacity is 10"):
        t.plan_write(0, [a, b], [1, 11])
    with pytest.raises(CapacityError, match=r"the write needs 3 new pages \(sequence 0: 1, "
                                            r"sequence 1: 2\), 2 of 3 are free"):
        t.plan_write(0, [a, b], [1, 5])
    with pytest.raises(StateError, match="unknown sequence 7"):
        t.plan_write(0, [a, 7], [1, 1])
    with pytest.raises(StateError, match="sequence 0 appears twice"):
        t.plan_write(0, [a, a], [1, 1])
    assert before == (list(t.free), list(t.refs), list(t.get(a).pages), list(t.get(a).pending))
    check(t)


def test_fork_shares_full_pages_and_copies_the_partial_one():
    t = table()
    s = t.new()
    write(t, 0, [s], [6])
    write(t, 1, [s], [6])
    t.advance([s])
    u, copy = t.fork(s)
    assert t.get(u).pages[0] == t.get(s).pages[0] and t.refs[t.get(s).pages[0]] == 2
    assert copy == (t.get(s).pages[1], t.get(u).pages[1]) and t.refs[t.get(u).pages[1]] == 1
    assert t.get(u).length == 6 and t.get(u).pending == [0, 0]
    check(t)
    # a page-aligned length shares everything and copies nothing
    t.truncate(u, 4)
    w, copy = t.fork(u)
    assert copy is None and t.get(w).pages == [t.get(s).pages[0]] and t.refs[t.get(s).pages[0]] == 3
    check(t)


def test_write_into_a_shared_page_copies_it_first():
    t = table()
    s = t.new()
    write(t, 0, [s], [4])
    write(t, 1, [s], [4])
    t.advance([s])
    u, _ = t.fork(s)
    t.truncate(u, 2)                   # u's next write lands in the shared page 0
    shared = t.get(s).pages[0]
    plan = write(t, 0, [u], [1])
    assert plan.copies == [(shared, t.get(u).pages[0])] and t.get(u).pages[0] != shared
    assert t.refs[shared] == 1 and plan.rows == [t.get(u).pages[0] * 4 + 2]
    write(t, 1, [u], [1])              # layer 1 finds the copy: no second copy
    assert t.get(u).pending == [1, 1]
    check(t)


def test_a_write_into_a_page_its_sequences_share_copies_it_for_all_but_the_last():
    """One batched write to every holder of a shared page: each but the last takes a
    copy, the last writes in place (the page is its alone by then), as the same writes
    one call at a time would. (Each used to take a copy: the page kept no holder and
    never went back to the free list.)"""
    t = table(pages=5)
    s = t.new()
    write(t, 0, [s], [4])
    write(t, 1, [s], [4])
    t.advance([s])
    u, _ = t.fork(s)
    w, _ = t.fork(s)                   # page 0 held by s, u and w
    shared = t.get(s).pages[0]
    for x, n in ((s, 1), (u, 1), (w, 3)):
        t.truncate(x, n)               # the next write of each lands in page 0
    plan = write(t, 0, [u, s, w], [1, 2, 1])
    assert plan.take == 2 and [src for src, _ in plan.copies] == [shared, shared]
    assert shared not in t.get(u).pages + t.get(s).pages and t.get(w).pages == [shared]
    assert t.refs[shared] == 1 and plan.rows[-1] == shared * 4 + 3
    check(t)
    write(t, 1, [w, s, u], [1, 2, 1])  # layer 1 finds the pages layer 0 took
    assert len(t.free) == 2
    check(t)
    # so one free page is enough for two holders of a shared page
    t = table(pages=2)
    s = t.new()
    write(t, 0, [s], [4])
    write(t, 1, [s], [4])
    t.advance([s])
    u, _ = t.fork(s)
    t.truncate(s, 2)
    t.truncate(u, 2)
    assert write(t, 0, [s, u], [1, 1]).take == 1 and not t.free
    check(t)


def test_truncate_and_free_return_unheld_pages():
    t = table()
    s = t.new()
    write(t, 0, [s], [9])
    write(t, 1, [s], [9])
    t.advance([s])
    u, _ = t.fork(s)
    t.truncate(s, 3)
    assert t.get(s).pages == [t.get(u).pages[0]] and len(t.free) == 8 - 3   # u: 0, 1, copy
    t.free_seq(u)
    assert len(t.free) == 7
    t.free_seq(s)
    assert len(t.free) == 8 and not t.seqs
    with pytest.raises(StateError, match="unknown sequence 0"):
        t.free_seq(s)
    check(t)


def test_truncate_range_and_advance_rules():
    t = table()
    s = t.new()
    write(t, 0, [s], [2])
    with pytest.raises(StateError, match="layer 0 holds 2; layer 1 holds 0"):
        t.advance([s])
    with pytest.raises(OutOfRangeError, match="expected 0 <= n <= length 0"):
        t.truncate(s, 1)
    t.truncate(s, 0)
    assert t.get(s).pending == [0, 0] and t.get(s).pages == [] and len(t.free) == 8


def test_reservation_takes_pages_after_the_committed_positions():
    t = table()
    s = t.new()
    plan = write(t, None, [s], [5])
    assert plan.rows == [0, 1, 2, 3, 4] and t.get(s).pending == [0, 0] and t.get(s).length == 0
    check(t)


def step(t, ids, count=1):
    """One step of count positions to every layer of each of ids, committed."""
    for layer in range(t.num_layers):
        write(t, layer, ids, [count] * len(ids))
    return t.advance(ids)


@pytest.mark.parametrize("window, ps, sinks", [(1, 4, 0), (5, 4, 0), (6, 4, 2), (4, 1, 1),
                                               (3, 4, 9), (30, 4, 0)])
def test_window_releases_the_pages_no_query_sees(window, ps, sinks):
    """At each advance the pages whose positions all lie below length - W + 1, past the
    sink pages, read -1 and go back to the free list; a sequence holds at most
    ceil((W + ps - 1) / ps) + 1 pages past its sink pages, and every position the next
    query sees (sinks, and [length - W + 1, length)) is held."""
    t = table(pages=24, ps=ps, capacity=200, window=window, sinks=sinks)
    s = t.new()
    sink_pages = -(-sinks // ps)
    most = 0
    for n in range(1, 80):
        step(t, [s])
        seq = t.get(s)
        held = [i for i, g in enumerate(seq.pages) if g >= 0]
        assert held == [i for i in range(-(-n // ps))
                        if i < sink_pages or (i + 1) * ps > n - window + 1]
        first = max(0, (n - window + 1) // ps * ps)
        assert seq.start == (first if first > sink_pages * ps else 0)
        spans = t.held(seq)
        visible = set(range(min(sinks, n))) | set(range(max(0, n - window + 1), n))
        assert visible <= {p for a, b in spans for p in range(a, b)}
        most = max(most, len(held))
        check(t)
    assert most <= -(-(window + ps - 1) // ps) + 1 + sink_pages
    t.free_seq(s)
    assert len(t.free) == 24
    check(t)


def test_window_truncate_keeps_what_the_window_needs():
    """truncate may drop only what the window at the new length does not need: below
    that (released positions it would see) StateError, nothing changed; within the sink
    pages the sequence holds all of [0, n) again."""
    t = table(pages=8, ps=4, capacity=40, window=6, sinks=2)
    s = t.new()
    for _ in range(20):
        step(t, [s])
    seq = t.get(s)
    assert seq.start == 12 and t.held(seq) == [(0, 4), (12, 20)]
    before = (list(seq.pages), seq.length, seq.start, list(t.free), list(t.refs))
    with pytest.raises(StateError, match=r"truncate of sequence 0 to 16 positions needs "
                                         r"positions from 11 \(window 6\).*holds positions from "
                                         r"12 \(first_held\).*only to n >= 17"):
        t.truncate(s, 16)
    assert before == (list(seq.pages), seq.length, seq.start, list(t.free), list(t.refs))
    t.truncate(s, 17)
    assert t.held(seq) == [(0, 4), (12, 17)] and seq.pages[-1] >= 0
    step(t, [s])                       # the next write lands in a held page
    t.truncate(s, 3)                   # within the sink page
    assert seq.start == 0 and t.held(seq) == [(0, 3)] and len(seq.pages) == 1
    check(t)


def test_window_fork_shares_the_held_pages():
    t = table(pages=8, ps=4, capacity=40, window=5)
    s = t.new()
    for _ in range(14):
        step(t, [s])
    u, copy = t.fork(s)
    a, b = t.get(s), t.get(u)
    assert a.pages[:2] == b.pages[:2] == [-1, -1] and b.start == a.start == 8
    assert b.pages[2] == a.pages[2] and t.refs[a.pages[2]] == 2
    assert copy == (a.pages[3], b.pages[3])
    check(t)
    step(t, [s, u], 3)                 # both slide: the shared page leaves both
    assert t.refs[a.pages[3]] == 1 and a.pages[2] == b.pages[2] == -1
    check(t)
    t.free_seq(s)
    t.free_seq(u)
    assert len(t.free) == 8
