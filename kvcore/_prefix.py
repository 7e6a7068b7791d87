"""The prefix cache's index of a KVPool, with no memory of its own: which pages hold which
token prefix (by content key), and which of them no sequence holds (cached, evictable),
least recently used first. `PageTable` (_pages.py) owns the pages and asks it.

A registered page is a full page of committed positions whose content is the K/V of one
token prefix: its key is `_prefix_keys.chain_key(parent key, its ids, extras)`, and the
entry keeps the parent key, the ids (int64 little-endian bytes) and the extras' bytes, so
that a lookup compares the content itself, not only the hash. Pages are in one of three
states: free (in the table's free list), cached (registered, held by no sequence: in
`lru`), in use (held by >= 1 sequence, registered or not).

Eviction takes cached pages least recently used first, leaves before parents: a page
whose key is the parent of another registered page waits until that child is gone (when
every cached page has a registered child, the least recent goes anyway).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Iterator


class Entry:
    """One registered page: its key, its parent's key, its token ids and extras (bytes)."""

    __slots__ = ("key", "parent", "ids", "extra")

    def __init__(self, key: bytes, parent: bytes, ids: bytes, extra: bytes):
        self.key, self.parent, self.ids, self.extra = key, parent, ids, extra


class PrefixIndex:
    """Content keys of full pages, and the cached (unheld) ones in LRU order."""

    def __init__(self) -> None:
        self.by_key: dict[bytes, int] = {}          # key -> page
        self.entries: dict[int, Entry] = {}         # page -> its entry
        self.children: dict[bytes, int] = {}        # key -> registered pages it is parent of
        self.lru: OrderedDict[int, None] = OrderedDict()   # cached pages, oldest first
        self.hits = self.misses = self.evictions = 0

    def find(self, parent: bytes, key: bytes, ids: bytes, extra: bytes) -> int | None:
        """The page registered under key, when its parent, ids and extras are these."""
        g = self.by_key.get(key)
        if g is None:
            return None
        e = self.entries[g]
        if e.ids != ids or e.parent != parent or e.extra != extra:
            return None            # a hash collision: never another prefix's K/V
        return g

    def register(self, page: int, key: bytes, parent: bytes, ids: bytes, extra: bytes) -> None:
        """Registers a full, committed page under key, unless the key or the page already
        is (the first copy of a prefix stays the one found)."""
        if key in self.by_key or page in self.entries:
            return
        self.by_key[key] = page
        self.entries[page] = Entry(key, parent, ids, extra)
        self.children[parent] = self.children.get(parent, 0) + 1

    def unregister(self, page: int) -> None:
        """Forgets a page (a held one, or a cached one: then it leaves the LRU too)."""
        e = self.entries.pop(page, None)
        if e is None:
            return
        del self.by_key[e.key]
        left = self.children[e.parent] - 1
        if left:
            self.children[e.parent] = left
        else:
            del self.children[e.parent]
        self.lru.pop(page, None)

    def victims(self) -> Iterator[int]:
        """Cached pages in eviction order (least recently used leaf first), changing
        nothing: a plan takes as many as it needs."""
        order = list(self.lru)
        gone: dict[bytes, int] = {}                 # children evicted so far, per key
        done = [False] * len(order)
        entries, children = self.entries, self.children
        start = 0                                   # order[:start] are all done
        for _ in range(len(order)):
            while done[start]:
                start += 1
            pick = start                            # the fallback: the least recent
            for i in range(start, len(order)):
                e = entries[order[i]]
                if not done[i] and children.get(e.key, 0) == gone.get(e.key, 0):
                    pick = i
                    break
            done[pick] = True
            parent = entries[order[pick]].parent
            gone[parent] = gone.get(parent, 0) + 1
            yield order[pick]

    def evict(self, pages: list[int]) -> None:
        for g in pages:
            self.unregister(g)
        self.evictions += len(pages)
