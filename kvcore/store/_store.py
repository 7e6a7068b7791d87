"""KVStore: whole chunks of a sequence's K/V saved under content keys, and the longest
stored prefix of a prompt loaded back; StoreWriter: saving off the decode path."""
from __future__ import annotations

import collections
import logging
import math
import os
import re
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np

from .._prefix_keys import Extra, encode_extra, chain_key, token_array, ROOT
from ..errors import (ChunkError, DTypeError, FormatError, KVCacheError, RangeError,
                      SnapshotError, StateError, StoreError)
from ..snapshot import Snapshot
from ..formats import describe
from ..spec import KVSpec
from ._backends import Backend, RefusedValue
from ._codec import LAYOUT, ChunkKind, decode_chunk, encode_chunk

log = logging.getLogger("kvcore.store")
KEY_VERSION = "1"


def _check_name(what: str, value: object) -> str:
    """A key field: 1-200 printable ASCII characters, no space, no brace (a brace would
    make Redis Cluster slot the key by a hash tag)."""
    if not isinstance(value, str) or not re.fullmatch(r"[\x21-\x7a|~]{1,200}", value):
        raise DTypeError(f"invalid {what} {str(value)[:80]!r}: expected 1-200 printable ASCII "
                         f"characters without spaces or braces (e.g. a model name and "
                         f"revision, 'meta-llama/Llama-3.1-8B@5206a32')")
    return value


@dataclass
class LoadResult:
    """What `KVStore.load` found.

    positions: positions loaded (chunks * chunk_tokens); snapshot: them (`load`; None
    when 0, and from `load_into` a pool, which writes the chunks straight into pages);
    miss: why the run of chunks stopped before the prompt's end (None when every whole
    chunk the prompt allows was loaded): "chunk 3 not stored", or "chunk 2 refused: <the
    ChunkError>" for a corrupt, truncated, foreign or mismatched value (deleted from the
    store so that the next save replaces it); seq: the pool sequence `load_into` made.
    """

    positions: int
    chunks: int
    snapshot: Snapshot | None
    miss: str | None
    seq: int | None = None


class KVStore:
    """Chunks of K/V saved to and loaded from a backend, keyed by content.

    model: the caller's name for everything that makes K/V valid besides the tokens and
    the shapes (model and revision, RoPE settings, ...): 1-200 printable ASCII characters
    without spaces or braces. spec: format, num_layers, num_kv_heads, head_dim of the
    caches and pools it serves (capacity: the most positions `load` returns).
    chunk_tokens: positions per chunk (a multiple of page_size and of the page_size of
    the pools it loads into); only whole chunks are saved. page_size: the block of the
    content keys' chain, the page size of the pools whose prefix caches it serves (their
    page keys and its chunk keys are then the same keys). prefix: the first field of
    every key (a namespace on a shared server).

    A chunk's key is "<prefix>:1:<model>:<format>:<layout>:L<L>.H<Hkv>.D<D>.C<C>.P<P>:<hex>",
    hex the chained content key (chained per page_size tokens, kvcore._prefix_keys) of
    the tokens up to the chunk's end and the extras: the prefix cache's key of the
    chunk's last page. Its value is kvcore.store._codec's (docs/store.md).
    """

    def __init__(self, backend: Backend, *, model: str, spec: KVSpec, chunk_tokens: int = 256,
                 page_size: int = 16, prefix: str = "kvcore"):
        if not isinstance(backend, Backend):
            raise DTypeError(f"invalid type of backend: expected a kvcore.store Backend, "
                             f"got {type(backend).__name__}")
        if not isinstance(spec, KVSpec):
            raise DTypeError(f"invalid type of spec: expected KVSpec, got {type(spec).__name__}")
        if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
            raise RangeError(f"chunk_tokens must be a positive int, got {chunk_tokens!r}")
        if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
            raise RangeError(f"page_size must be a positive int, got {page_size!r}")
        if chunk_tokens % page_size:
            raise RangeError(f"chunk_tokens {chunk_tokens} is not a multiple of page_size "
                             f"{page_size}")
        if chunk_tokens % (spec.k_fmt.group or 1):
            raise FormatError(f"K format {spec.k_format} encodes groups of {spec.k_fmt.group} "
                              f"positions: chunk_tokens must be a multiple of "
                              f"{spec.k_fmt.group}, got {chunk_tokens}")
        _check_name("prefix", prefix)
        self.backend = backend
        self.spec = spec
        self.chunk_tokens = chunk_tokens
        self.page_size = page_size
        self._kind = ChunkKind(_check_name("model", model), spec, chunk_tokens)
        self._key_head = (f"{prefix}:{KEY_VERSION}:{model}:{spec.format}:{LAYOUT}:"
                          f"L{spec.num_layers}.H{spec.num_kv_heads}.D{spec.head_dim}."
                          f"C{chunk_tokens}.P{page_size}:")

    @property
    def model(self) -> str:
        return self._kind.model

    # -- keys ----------------------------------------------------------------------

    def _chunks(self, tokens, extra: Extra | None,
                limit: int | None = None) -> tuple[np.ndarray, list[str]]:
        """(token ids int64, the keys of the whole chunks within the first `limit` ids,
        default all)."""
        ids = token_array(tokens)
        end = ids.size if limit is None else min(limit, ids.size)
        return ids, self._chunk_keys(ids, encode_extra(extra), end)

    def _chunk_keys(self, ids: np.ndarray, extra_bytes: bytes, end: int,
                    page_keys: Sequence[bytes] = ()) -> list[str]:
        """The keys of the whole chunks of ids[:end]: the page chain's key at each chunk's
        end. page_keys: the chain's first keys when the caller has them (a prefix cache's
        matched pages), continued from there."""
        p, per = self.page_size, self.chunk_tokens // self.page_size
        chain = list(page_keys[:end // p])
        parent = chain[-1] if chain else ROOT
        for i in range(len(chain), end // self.chunk_tokens * per):
            parent = chain_key(parent, ids[i * p:(i + 1) * p], extra_bytes)
            chain.append(parent)
        return [self._key_head + chain[(j + 1) * per - 1].hex()
                for j in range(end // self.chunk_tokens)]

    def keys(self, tokens: Sequence[int] | np.ndarray, extra: Extra | None = None) -> list[str]:
        """The keys of the whole chunks of tokens (len(tokens) // chunk_tokens of them)."""
        return self._chunks(tokens, extra)[1]

    # -- save ----------------------------------------------------------------------

    def save(self, snapshot: Snapshot, tokens: Sequence[int] | np.ndarray,
             extra: Extra | None = None) -> int:
        """Saves the whole chunks of a sequence: snapshot holds its first positions, tokens
        the ids of its first positions; the whole chunks within both are saved (a partial
        last chunk is not). Chunks already stored at the start are skipped (one round trip
        asks); returns the chunks written. StoreError when the backend fails (the chunks
        written before stay: each is whole)."""
        if not isinstance(snapshot, Snapshot):
            raise DTypeError(f"invalid type of snapshot: expected Snapshot, "
                             f"got {type(snapshot).__name__}")
        _check_from_zero(snapshot)
        have, want = snapshot.spec, self.spec
        for name in ("format", "num_layers", "num_kv_heads", "head_dim"):
            if getattr(have, name) != getattr(want, name):
                a, b = getattr(have, name), getattr(want, name)
                if name == "format":
                    a, b = describe(a), describe(b)
                raise SnapshotError(f"snapshot {name} {a} does not match the store's {b}")
        ids, keys = self._chunks(tokens, extra, snapshot.length)
        start = self.backend.contains_prefix(keys)
        c = self.chunk_tokens
        names = [n for n in ("k_codes", "v_codes", "k_scales", "v_scales")
                 if getattr(snapshot, n) is not None]

        def chunks():  # one chunk encoded at a time (one value's memory at once)
            for i in range(start, len(keys)):
                parts = {n: getattr(snapshot, n)[:, i * c:(i + 1) * c] for n in names}
                yield keys[i], encode_chunk(self._kind, keys[i], ids[i * c:(i + 1) * c], parts)
        # head first: a directory makes them visible together, the head last (a save cut
        # short leaves no tail without its head); another backend keeps the head it wrote
        self.backend.put_prefix(chunks())
        return len(keys) - start

    def _save_chunk(self, content_key: bytes, ids: np.ndarray, parts: dict,
                    parent: bytes | None = None) -> str:
        """Saves one chunk given its content key (a prefix cache's key of its last page),
        its C token ids, its parts ([L, C, Hkv, D] codes, scales) and the content key of
        the chunk before it (None for a prompt's first chunk); one round trip asks whether
        the key is stored already, and the chunk before it: a chunk whose parent is not
        stored could never be hit (a load needs every chunk before it) and is not written.
        Returns "written", "stored" (already) or "orphan" (not written)."""
        key = self._key_head + content_key.hex()
        if parent is None:
            if self.backend.contains_prefix([key]):
                return "stored"
        else:
            found = self.backend.contains_prefix([self._key_head + parent.hex(), key])
            if found == 0:
                return "orphan"
            if found == 2:
                return "stored"
        self.backend.put_many([(key, encode_chunk(self._kind, key, ids, parts))])
        return "written"

    # -- load ----------------------------------------------------------------------

    def lookup(self, tokens: Sequence[int] | np.ndarray, extra: Extra | None = None) -> int:
        """Positions `load` would find stored (without reading or checking the values)."""
        _, keys = self._chunks(tokens, extra, self._limit(tokens))
        try:
            return self.backend.contains_prefix(keys) * self.chunk_tokens
        except StoreError:
            raise
        except Exception as e:
            raise self.backend._fail(f"lookup of {len(keys)} keys", e) from None

    def _limit(self, tokens) -> int:
        return min(len(tokens) - 1, self.spec.capacity)

    def load(self, tokens: Sequence[int] | np.ndarray, extra: Extra | None = None) -> LoadResult:
        """The longest run of stored, valid whole chunks from the prompt's start, at most
        len(tokens) - 1 positions (the last token's query must still be computed) and at
        most spec.capacity. One round trip fetches the values; every chunk is checked
        (checksum, format, key, model, shapes, tokens, codes) before it is used; the
        first one refused ends the run (LoadResult.miss says why; it is deleted from the
        store). StoreError when the backend fails."""
        ids = token_array(tokens)
        fetch = self._fetch(ids, encode_extra(extra), 0, self._limit(tokens))
        c, out = self.chunk_tokens, None
        for i, parts in fetch:  # each chunk copied once, into the snapshot's arrays
            if out is None:
                out = {name: np.empty((a.shape[0], len(fetch.keys) * c, *a.shape[2:]), a.dtype)
                       for name, a in parts.items()}
            for name, a in parts.items():
                out[name][:, i * c:(i + 1) * c] = a
        n = fetch.chunks * c
        if out is None:
            return LoadResult(0, 0, None, fetch.miss)
        parts = {name: a if a.shape[1] == n else np.ascontiguousarray(a[:, :n])
                 for name, a in out.items()}
        return LoadResult(n, fetch.chunks, Snapshot(self.spec, n, **parts), fetch.miss)

    def _fetch(self, ids: np.ndarray, extra_bytes: bytes, start: int, limit: int,
               page_keys: Sequence[bytes] = ()) -> "_Fetch":
        """The checked chunks from the one holding position `start` (a multiple of
        page_size) to the last whole one within ids[:limit], streamed (_Fetch)."""
        keys = self._chunk_keys(ids, extra_bytes, min(limit, ids.size, self.spec.capacity),
                                page_keys)
        return _Fetch(self, ids, keys, start // self.chunk_tokens)

    def load_into(self, target, tokens: Sequence[int] | np.ndarray,
                  extra: Extra | None = None) -> LoadResult:
        """load, then restore what was found: into a new sequence of a KVPool (its id in
        result.seq; none is made when nothing was found; the chunks are copied straight
        into its pages) or into a KVCache (replacing its content when something was
        found; a GPU cache or pool: its own restore). The target is written only with
        chunks that passed every check; a refused load leaves it unchanged (a pool with
        too few free pages raises its CapacityError, the pool unchanged). A pool's
        page_size must divide chunk_tokens; a KVPool with a prefix cache registers the
        loaded pages (the sequence then takes token ids at advance, as one from
        match_prefix).

        A target whose format, num_layers, num_kv_heads or head_dim differ from the
        store's is refused before anything is read (SnapshotError naming both values):
        no sequence is made, no page taken, no byte written."""
        spec = getattr(target, "spec", None)
        if not isinstance(spec, KVSpec):
            raise DTypeError(f"invalid type of target: expected a KVCache or a KVPool (CPU "
                             f"or GPU), got {type(target).__name__}")
        for name in ("format", "num_layers", "num_kv_heads", "head_dim"):
            have, want = getattr(spec, name), getattr(self.spec, name)
            if have != want:
                if name == "format":
                    have, want = describe(have), describe(want)
                raise SnapshotError(f"load_into: the target's {name} {have} does not match "
                                    f"the store's {want}: its chunks cannot be restored "
                                    f"there (nothing was changed)")
        page_size = getattr(target, "page_size", None)
        if page_size is not None and self.chunk_tokens % page_size:
            raise RangeError(f"chunk_tokens {self.chunk_tokens} is not a multiple of the "
                             f"pool's page_size {page_size}")
        if hasattr(target, "_restore_stored"):   # a KVPool: chunks go straight into pages
            ids, extra_bytes = token_array(tokens), encode_extra(extra)
            fetch = self._fetch(ids, extra_bytes, 0, min(self._limit(tokens),
                                                         target.spec.capacity))
            seq, n = target._restore_stored(fetch, ids, extra_bytes)
            return LoadResult(n, n // self.chunk_tokens, None, fetch.miss, seq)
        result = self.load(tokens, extra)   # a KVCache, a GPU cache or pool: its restore
        if result.snapshot is not None:
            seq = target.restore(result.snapshot)
            result.seq = seq if isinstance(seq, int) else None
        return result


def _check_from_zero(snapshot: Snapshot) -> None:
    """SnapshotError for a snapshot of a windowed pool's sequence (start > 0): chunks are
    positions from 0, and it no longer holds them."""
    if snapshot.start:
        raise SnapshotError(f"a store saves chunks from position 0, and the snapshot holds "
                            f"positions [0, {snapshot.sink_end}) and [{snapshot.start}, "
                            f"{snapshot.length}) only (a windowed KVPool's sequence): save it "
                            f"before its window released a page, or from a pool without a "
                            f"window")


class _Staging:
    """The buffers a pool's lookups copy values into (held from the fetch, which runs
    without the pool's guard, until the chunks are placed under it), kept for the next
    lookup up to max_bytes in all: fresh memory for each lookup would cost a page fault
    per 4 KiB (277 MB of a 4,096-token prefix: as long as reading it)."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._reset()

    def _reset(self) -> None:
        self._lock = threading.Lock()
        self._spare: list[np.ndarray] = []
        self._bytes = 0

    def take(self, size: int) -> np.ndarray:
        """A buffer of at least size bytes: the smallest spare one that fits, else new
        (rounded up to 64 KiB: a store's values differ by a few header bytes)."""
        with self._lock:
            fits = [i for i, b in enumerate(self._spare) if b.nbytes >= size]
            if fits:
                buf = self._spare.pop(min(fits, key=lambda i: self._spare[i].nbytes))
                self._bytes -= buf.nbytes
                return buf
        return np.empty(-(-size // 65536) * 65536, np.uint8)

    def give(self, bufs: list[np.ndarray]) -> None:
        with self._lock:
            for buf in bufs:
                if self._bytes + buf.nbytes <= self.max_bytes:
                    self._spare.append(buf)
                    self._bytes += buf.nbytes


#: one per process: up to 256 MiB of staging kept between lookups
_STAGING = _Staging(256 << 20)
if hasattr(os, "register_at_fork"):   # a lock held by another thread at a fork
    os.register_at_fork(after_in_child=_STAGING._reset)


class _Fetch:
    """The checked chunks of one load, streamed: iterating yields (i, parts) for chunks
    i = first, first + 1, ... while they are stored and pass decode_chunk (parts: views
    valid until the next chunk is asked for); then `chunks` counts them, `miss` says
    why the run stopped (None: every key was found) and `fault` is set when a value was
    refused (the miss; logged and, when the codec refused it, deleted from the store).
    One iteration. Every failure of the backend is a StoreError (another exception is
    wrapped in one: a prefix cache records it as the fault); every failure of the codec
    is a refused chunk, so nothing else escapes. `close()` ends it early (the caller's
    loop stopped)."""

    def __init__(self, store: KVStore, ids: np.ndarray, keys: list[str], first: int):
        self.store, self.ids, self.keys, self.first = store, ids, keys, first
        self.chunk_tokens = store.chunk_tokens
        self.chunks = 0
        self.miss: str | None = None
        self.fault: str | None = None
        self._staged: list[np.ndarray] = []   # collect's buffers, until release()
        self._gen = self._run()

    def __iter__(self) -> Iterator[tuple[int, dict]]:
        return self._gen

    def close(self) -> None:
        self._gen.close()

    def collect(self, into: list | None = None) -> list[tuple[int, dict]]:
        """Every checked chunk at once, instead of iterating: (i, parts) each, appended to
        `into` (a new list by default) as they are checked, every value in memory of its
        own (a value the backend read into its reused buffer is copied into a staging
        buffer: parts stay valid until `release()`; a StoreError midway leaves the chunks
        before it there). A pool's lookup fetches and checks them without its guard, then
        places them under it and releases them."""
        self._gen.close()
        out = [] if into is None else into
        out.extend(self._run(own=True))
        return out

    def release(self) -> None:
        """Gives collect's staging buffers back for the next lookup: its chunks' parts must
        not be used any more."""
        staged, self._staged = self._staged, []
        _STAGING.give(staged)

    def _stage(self, value) -> memoryview:
        """A copy of value in a staging buffer of this fetch."""
        n = len(value) if isinstance(value, bytearray) else value.nbytes
        buf = _STAGING.take(n)
        self._staged.append(buf)
        buf[:n] = np.frombuffer(value, np.uint8)
        return memoryview(buf)[:n]

    def _run(self, own: bool = False) -> Iterator[tuple[int, dict]]:
        store, keys, c = self.store, self.keys, self.chunk_tokens
        backend = store.backend
        if self.first >= len(keys):
            return
        i = self.first
        op = f"read of {len(keys) - i} keys"
        try:
            values = iter(backend.read_prefix(keys[i:],
                                              max_value_bytes=store._kind.max_value_bytes))
        except StoreError:
            raise
        except Exception as e:
            raise backend._fail(op, e) from None
        try:
            while True:
                try:
                    value = next(values)
                except StopIteration:
                    break
                except StoreError:
                    raise
                except Exception as e:
                    raise backend._fail(op, e) from None
                try:
                    if isinstance(value, RefusedValue):
                        raise ChunkError(value.reason)
                    if own and isinstance(value, (memoryview, bytearray)):
                        value = self._stage(value)   # not the backend's reused buffer
                    parts = decode_chunk(store._kind, keys[i], self.ids[i * c:(i + 1) * c], value)
                except ChunkError as e:
                    self._refuse(i, str(e), delete=True)
                    return
                except Exception as e:  # the codec failed otherwise (MemoryError, ...)
                    self._refuse(i, f"{type(e).__name__}: {e}", delete=False)
                    return
                yield i, parts
                i += 1
                self.chunks += 1
        finally:
            close = getattr(values, "close", None)
            if close is not None:
                try:
                    close()
                except Exception as e:  # noqa: BLE001 (the values are no longer needed)
                    log.warning("%s: closing a read failed: %s: %s", backend.name,
                                type(e).__name__, e)
        if i < len(keys):
            self.miss = f"chunk {i} not stored"

    def _refuse(self, i: int, why: str, *, delete: bool) -> None:
        """Chunk i ends the run: the miss and the fault, logged; deleted from the store when
        its value is bad (so that the next save writes it again)."""
        backend = self.store.backend
        self.miss = self.fault = f"chunk {i} refused: {why}"
        log.warning("%s: %s (key %s)", backend.name, self.miss, self.keys[i])
        if delete:
            try:
                backend.delete([self.keys[i]])
            except Exception as err:  # noqa: BLE001 (the miss is reported either way)
                log.warning("%s: delete of a refused chunk failed: %s: %s", backend.name,
                            type(err).__name__, err)


@dataclass
class WriterStats:
    """Counts of a StoreWriter: saves submitted, chunks written, saves dropped (the queue
    was full, the writer closed or its thread gone, or discarded by a close that timed
    out), saves that failed (last_error: the latest failure's message), and a prefix
    cache's chunks not written because the chunk before them is not stored (they could
    never be hit)."""

    submitted: int = 0
    chunks_written: int = 0
    dropped: int = 0
    failed: int = 0
    last_error: str | None = None
    orphans_skipped: int = 0


_WRITERS: "weakref.WeakSet[StoreWriter]" = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for writer in list(_WRITERS):
        writer._reset_after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class StoreWriter:
    """Saves snapshots to a KVStore on a background thread, off the decode path.

    `submit` queues (snapshot, tokens, extra) and returns at once; when `max_pending`
    saves already wait, the new one is dropped and counted (decoding never waits on the
    store). Any exception a save raises (StoreError, a mismatched snapshot, MemoryError,
    a bug) is counted (stats.failed, stats.last_error) and logged, never raised into the
    caller, and the thread goes on with the next save. If the thread still ends (an
    exception that is no Exception, such as an asynchronous SystemExit: it is counted the
    same way), `submit` drops and counts every save from then on (returns False) and
    `flush`/`close` return at once. `flush(timeout)` waits until every queued save is
    done, at most `timeout` seconds, and returns how many are not; `close(timeout)`
    flushes, stops the thread and returns how many saves were lost (also as a context
    manager). In a child forked from the process that made it, the writer starts empty,
    with fresh stats and a thread of its own at its first submit (the parent's queue is
    the parent's to save).
    """

    #: the default wait of flush and close, seconds
    TIMEOUT_S = 60.0

    def __init__(self, store: KVStore, *, max_pending: int = 8):
        if isinstance(max_pending, bool) or not isinstance(max_pending, int) or max_pending < 1:
            raise RangeError(f"max_pending must be a positive int, got {max_pending!r}")
        self.store = store
        self.max_pending = max_pending
        self._closed = False
        self._reset()
        _WRITERS.add(self)
        with self._cond:
            self._start()

    def _reset(self) -> None:
        """A fresh, empty state with no thread (at start, and in a forked child)."""
        self.stats = WriterStats()
        self._cond = threading.Condition(threading.Lock())  # guards everything below, stats
        self._items: collections.deque = collections.deque()
        self._busy = 0            # saves the thread has taken and not finished (0 or 1)
        self._stop = False        # close: the thread ends once the queue is empty
        self._thread: threading.Thread | None = None
        self._running = False     # the thread runs its loop (False once it ended)

    def _reset_after_fork(self) -> None:
        """In a forked child: the parent's thread does not exist here, and its lock may
        have been held at the fork; a new state, the thread started at the first submit."""
        self._reset()

    def _start(self) -> bool:
        """(with the lock) Starts the thread unless one was started; True while it runs.
        A thread that cannot be started is reported (stats.last_error) and tried again at
        the next submit."""
        if self._thread is None and not self._closed:
            thread = threading.Thread(target=self._run, args=(self._cond, self._items),
                                      name="kvcore-store-writer", daemon=True)
            self._running = True
            try:
                thread.start()
            except Exception as e:  # noqa: BLE001 (RuntimeError: can't start new thread)
                self._running = False
                self.stats.last_error = f"the writer's thread cannot start: {e}"
                log.warning("store writer: %s", self.stats.last_error)
                return False
            self._thread = thread
        return self._running

    def submit(self, snapshot: Snapshot, tokens: Sequence[int] | np.ndarray,
               extra: Extra | None = None) -> bool:
        """Queues a save; False when it was dropped (counted in stats.dropped): the queue
        was full, or the writer's thread has ended (stats.last_error says why). StateError
        when the writer is closed."""
        if self._closed:
            raise StateError("StoreWriter.submit: the writer is closed")
        if not isinstance(snapshot, Snapshot):
            raise DTypeError(f"invalid type of snapshot: expected Snapshot, "
                             f"got {type(snapshot).__name__}")
        _check_from_zero(snapshot)
        ids = token_array(tokens)  # bad arguments raise here, in the caller's thread
        encode_extra(extra)
        with self._cond:
            self.stats.submitted += 1
            if not self._room():
                return False
            self._items.append((snapshot, ids, extra))
            self._cond.notify_all()
        return True

    def _room(self) -> bool:
        """(with the lock) Whether a save can be queued now; counts it dropped if not."""
        if self._closed or not self._start() or len(self._items) >= self.max_pending:
            self.stats.dropped += 1
            return False
        return True

    def _submit_chunk(self, content_key: bytes, ids: np.ndarray, make_parts,
                      parent: bytes | None = None) -> bool:
        """Queues one chunk of a pool's prefix cache (KVStore._save_chunk): its content
        key, its token ids, a function returning its parts (called only when the queue
        has room: a dropped chunk costs no copy) and the content key of the chunk before
        it (None: the first). False when dropped (the queue full, the writer closed or its
        thread ended: a pool's advance never raises for its writer). Counted in stats as
        one save."""
        with self._cond:
            self.stats.submitted += 1
            if not self._room():
                return False
        item = (content_key, ids, make_parts(), parent)
        with self._cond:
            self._items.append(item)
            self._cond.notify_all()
        return True

    def _save(self, item: tuple) -> None:
        if isinstance(item[0], bytes):
            status = self.store._save_chunk(*item)
            with self._cond:
                if status == "written":
                    self.stats.chunks_written += 1
                elif status == "orphan":
                    self.stats.orphans_skipped += 1
        else:
            n = self.store.save(*item)
            with self._cond:
                self.stats.chunks_written += n

    def _failed(self, e: BaseException, what: str) -> None:
        try:
            message = f"{type(e).__name__}: {e}" if not isinstance(e, KVCacheError) else str(e)
        except Exception:  # noqa: BLE001 (str() of the exception failed too)
            message = type(e).__name__
        with self._cond:
            self.stats.failed += 1
            self.stats.last_error = f"{what}{message}"
        log.warning("store writer: %s%s", what, message)

    def _run(self, cond: threading.Condition, items: collections.deque) -> None:
        # cond and items are this thread's (a forked child makes new ones)
        try:
            while True:
                with cond:
                    while not items and not self._stop:
                        cond.wait()
                    if not items:
                        return
                    item = items.popleft()
                    self._busy = 1
                try:
                    self._save(item)
                except Exception as e:  # noqa: BLE001 (counted; the thread goes on)
                    self._failed(e, "save failed: ")
                finally:
                    item = None
                    with cond:
                        self._busy = 0
                        cond.notify_all()
        except BaseException as e:  # noqa: BLE001 (SystemExit, ...: reported, not silent)
            self._failed(e, "the writer's thread ended (every later save is dropped): ")
        finally:
            with cond:
                self._running = False
                cond.notify_all()

    def _pending(self) -> int:
        """(with the lock) Saves queued or in progress."""
        return len(self._items) + self._busy

    def _wait(self, timeout: float, what: str) -> None:
        """(with the lock) Waits until no save is pending, the thread has ended, or timeout
        seconds have passed."""
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) \
                or not math.isfinite(timeout) or timeout < 0:
            raise RangeError(f"{what}: timeout must be a finite number of seconds >= 0, "
                             f"got {timeout!r}")
        deadline = time.monotonic() + timeout
        while self._pending() and self._running:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._cond.wait(left)

    def flush(self, timeout: float = TIMEOUT_S) -> int:
        """Waits until every save queued so far is done (written, or failed and counted),
        at most timeout seconds (default 60); returns how many are not done (0: all).
        When the thread has ended, returns at once: those saves will never be done
        (stats.last_error says why; close discards them)."""
        with self._cond:
            self._wait(timeout, "StoreWriter.flush")
            return self._pending()

    def close(self, timeout: float = TIMEOUT_S) -> int:
        """Flushes (at most timeout seconds, default 60), then stops the thread; returns
        how many saves were lost: those still queued at the timeout, or when the thread
        had ended, are discarded (counted in stats.dropped), plus one the thread was still
        running (it finishes or fails on its own; counted when it does). Idempotent (a
        second close returns 0)."""
        with self._cond:
            if self._closed:
                return 0
            self._wait(timeout, "StoreWriter.close")
            self._closed = self._stop = True
            lost = len(self._items)
            self._items.clear()
            self.stats.dropped += lost
            lost += self._busy
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and not lost:
            thread.join(1.0)  # the thread sees the stop and ends at once
        return lost

    def __enter__(self) -> "StoreWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
