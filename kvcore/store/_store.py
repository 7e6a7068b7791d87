"""KVStore: whole chunks of a sequence's K/V saved under content keys, and the longest
stored prefix of a prompt loaded back; StoreWriter: saving off the decode path."""
from __future__ import annotations

import logging
import queue
import re
import threading
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np

from .._prefix_keys import Extra, encode_extra, chain_key, token_array, ROOT
from ..errors import ChunkError, DTypeError, RangeError, SnapshotError, StateError, StoreError
from ..snapshot import Snapshot
from ..spec import KVSpec
from ._backends import Backend
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
        have, want = snapshot.spec, self.spec
        for name in ("format", "num_layers", "num_kv_heads", "head_dim"):
            if getattr(have, name) != getattr(want, name):
                raise SnapshotError(f"snapshot {name} {getattr(have, name)} does not match the "
                                    f"store's {getattr(want, name)}")
        ids, keys = self._chunks(tokens, extra, snapshot.length)
        start = self.backend.contains_prefix(keys)
        c = self.chunk_tokens
        names = [n for n in ("k_codes", "v_codes", "k_scales", "v_scales")
                 if getattr(snapshot, n) is not None]
        written = 0
        # One chunk at a time (one value's memory at once), last to first: a directory's
        # sweep (least recently written or read first) then drops a prefix's tail first.
        for i in reversed(range(start, len(keys))):
            parts = {n: getattr(snapshot, n)[:, i * c:(i + 1) * c] for n in names}
            value = encode_chunk(self._kind, keys[i], ids[i * c:(i + 1) * c], parts)
            self.backend.put_many([(keys[i], value)])
            written += 1
        return written

    def _save_chunk(self, content_key: bytes, ids: np.ndarray, parts: dict) -> int:
        """Saves one chunk given its content key (a prefix cache's key of its last page),
        its C token ids and its parts ([L, C, Hkv, D] codes, scales), unless the key is
        stored already (one round trip asks); returns the chunks written (0 or 1)."""
        key = self._key_head + content_key.hex()
        if self.backend.contains_prefix([key]):
            return 0
        self.backend.put_many([(key, encode_chunk(self._kind, key, ids, parts))])
        return 1

    # -- load ----------------------------------------------------------------------

    def lookup(self, tokens: Sequence[int] | np.ndarray, extra: Extra | None = None) -> int:
        """Positions `load` would find stored (without reading or checking the values)."""
        _, keys = self._chunks(tokens, extra, self._limit(tokens))
        return self.backend.contains_prefix(keys) * self.chunk_tokens

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
        match_prefix)."""
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


class _Fetch:
    """The checked chunks of one load, streamed: iterating yields (i, parts) for chunks
    i = first, first + 1, ... while they are stored and pass decode_chunk (parts: views
    valid until the next chunk is asked for); then `chunks` counts them, `miss` says
    why the run stopped (None: every key was found) and `fault` is set when a value was
    refused (the miss; logged and deleted from the store). One iteration; StoreError from
    the backend passes through (a prefix cache records it as the fault). `close()` ends
    it early (the caller's loop stopped)."""

    def __init__(self, store: KVStore, ids: np.ndarray, keys: list[str], first: int):
        self.store, self.ids, self.keys, self.first = store, ids, keys, first
        self.chunk_tokens = store.chunk_tokens
        self.chunks = 0
        self.miss: str | None = None
        self.fault: str | None = None
        self._gen = self._run()

    def __iter__(self) -> Iterator[tuple[int, dict]]:
        return self._gen

    def close(self) -> None:
        self._gen.close()

    def _run(self) -> Iterator[tuple[int, dict]]:
        store, keys, c = self.store, self.keys, self.chunk_tokens
        if self.first >= len(keys):
            return
        i = self.first
        values = store.backend.read_prefix(keys[i:])
        try:
            for value in values:
                try:
                    parts = decode_chunk(store._kind, keys[i], self.ids[i * c:(i + 1) * c], value)
                except ChunkError as e:
                    self.miss = self.fault = f"chunk {i} refused: {e}"
                    log.warning("%s: %s (key %s)", store.backend.name, self.miss, keys[i])
                    try:
                        store.backend.delete([keys[i]])
                    except StoreError as err:
                        log.warning("%s", err)
                    return
                yield i, parts
                i += 1
                self.chunks += 1
        finally:
            close = getattr(values, "close", None)
            if close is not None:
                close()
        if i < len(keys):
            self.miss = f"chunk {i} not stored"


@dataclass
class WriterStats:
    """Counts of a StoreWriter: saves submitted, chunks written, saves dropped because the
    queue was full, saves that failed (last_error: the latest failure's message)."""

    submitted: int = 0
    chunks_written: int = 0
    dropped: int = 0
    failed: int = 0
    last_error: str | None = None


class StoreWriter:
    """Saves snapshots to a KVStore on a background thread, off the decode path.

    `submit` queues (snapshot, tokens, extra) and returns at once; when `max_pending`
    saves already wait, the new one is dropped and counted (decoding never waits on the
    store). A save that fails (StoreError, a mismatched snapshot) is counted and logged,
    never raised into the caller. `flush` waits until every queued save is done; `close`
    flushes and stops the thread (also as a context manager).
    """

    def __init__(self, store: KVStore, *, max_pending: int = 8):
        if isinstance(max_pending, bool) or not isinstance(max_pending, int) or max_pending < 1:
            raise RangeError(f"max_pending must be a positive int, got {max_pending!r}")
        self.store = store
        self.stats = WriterStats()
        self._queue: queue.Queue = queue.Queue(max_pending)
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kvcore-store-writer", daemon=True)
        self._thread.start()

    def submit(self, snapshot: Snapshot, tokens: Sequence[int] | np.ndarray,
               extra: Extra | None = None) -> bool:
        """Queues a save; False when the queue was full and it was dropped."""
        if self._closed:
            raise StateError("StoreWriter.submit: the writer is closed")
        if not isinstance(snapshot, Snapshot):
            raise DTypeError(f"invalid type of snapshot: expected Snapshot, "
                             f"got {type(snapshot).__name__}")
        ids = token_array(tokens)  # bad arguments raise here, in the caller's thread
        encode_extra(extra)
        with self._lock:
            self.stats.submitted += 1
        return self._put((snapshot, ids, extra))

    def _put(self, item: tuple) -> bool:
        try:
            self._queue.put_nowait(item)
            return True
        except queue.Full:
            with self._lock:
                self.stats.dropped += 1
            return False

    def _submit_chunk(self, content_key: bytes, ids: np.ndarray, make_parts) -> bool:
        """Queues one chunk of a pool's prefix cache (KVStore._save_chunk): its content
        key, its token ids and a function returning its parts (called only when the queue
        has room: a dropped chunk costs no copy). False when dropped (the queue full, or
        the writer closed: a pool's advance never raises for its writer). Counted in stats
        as one save."""
        with self._lock:
            self.stats.submitted += 1
        if self._closed or self._queue.full():
            with self._lock:
                self.stats.dropped += 1
            return False
        return self._put((content_key, ids, make_parts()))

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                try:
                    n = (self.store._save_chunk(*item) if isinstance(item[0], bytes)
                         else self.store.save(*item))
                    with self._lock:
                        self.stats.chunks_written += n
                except (StoreError, SnapshotError, DTypeError, RangeError) as e:
                    with self._lock:
                        self.stats.failed += 1
                        self.stats.last_error = str(e)
                    log.warning("store writer: save failed: %s", e)
            finally:
                self._queue.task_done()

    def flush(self) -> None:
        """Waits until every save queued so far is done (written, or failed and counted)."""
        self._queue.join()

    def close(self) -> None:
        """Flushes, then stops the thread. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join()

    def __enter__(self) -> "StoreWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
