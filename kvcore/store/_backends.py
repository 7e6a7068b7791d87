"""Where chunk values live: one small interface, two backends.

A backend maps str keys to bytes values. Writes are atomic (a reader sees a whole value
or none); a long prompt's lookup is one round trip; every failure of the medium (a
server gone, a disk error) raises StoreError naming the backend and the operation.
"""
from __future__ import annotations

import errno
import hashlib
import logging
import math
import os
import queue
import secrets
import socket
import stat
import threading
import time
import urllib.parse
from abc import ABC, abstractmethod
from typing import Iterable, Iterator, Sequence

import numpy as np

from ..errors import DTypeError, RangeError, StoreError
from ..snapshot import _fsync_dir

_log = logging.getLogger("kvcore.store")


class RefusedValue(bytes):
    """What a backend returns in place of a stored value it would not read (not a
    regular file, longer than any chunk can be): empty, `reason` says why. The store
    reports it as a refused chunk (a miss) and deletes it."""

    reason: str

    def __new__(cls, reason: str) -> "RefusedValue":
        value = super().__new__(cls, b"")
        value.reason = reason
        return value


class Backend(ABC):
    """The interface `KVStore` uses."""

    #: names the backend in messages: "redis 127.0.0.1:6379", "directory /var/kv"
    name: str

    @abstractmethod
    def get_prefix(self, keys: Sequence[str]) -> list[bytes]:
        """The values of the longest run of stored keys from keys[0], in order (one round
        trip): [] when keys[0] is not stored."""

    def read_prefix(self, keys: Sequence[str],
                    max_value_bytes: int | None = None) -> Iterator[memoryview | bytes]:
        """The values of get_prefix one at a time, each valid until the next is asked for
        (a backend may read them into one reused buffer). A value longer than
        max_value_bytes (the caller's bound on any valid value) is a RefusedValue, read
        no further where the backend can tell its length first; so is a stored thing that
        is no value (a directory backend's FIFO). The default fetches them all with
        get_prefix (one round trip) first."""
        for value in self.get_prefix(keys):
            if max_value_bytes is not None and len(value) > max_value_bytes:
                value = RefusedValue(f"the value of {len(value)} bytes is longer than any "
                                     f"chunk of this store can be ({max_value_bytes} bytes)")
            yield value
            if isinstance(value, RefusedValue):
                return

    @abstractmethod
    def contains_prefix(self, keys: Sequence[str]) -> int:
        """How many keys from keys[0] on are stored, without reading their values."""

    @abstractmethod
    def put_many(self, items: Sequence[tuple[str, bytes]]) -> None:
        """Stores each (key, value), replacing any old value; each write is atomic."""

    def put_prefix(self, items: Iterable[tuple[str, bytes]]) -> None:
        """Stores the chunks of one prefix, given head first (items may be a generator:
        one value in memory at a time). The default writes each with put_many as it
        comes, so a failure midway leaves a head (the chunks before it), which loads use;
        a backend may stage them and make them visible together."""
        for item in items:
            self.put_many([item])

    @abstractmethod
    def delete(self, keys: Sequence[str]) -> None:
        """Removes the keys (absent ones are ignored)."""

    def close(self) -> None:
        """Releases connections or handles (the backend may not be used afterwards)."""

    def _fail(self, op: str, e: BaseException) -> StoreError:
        return StoreError(f"{self.name}: {op} failed: {type(e).__name__}: {e}")


class DirectoryBackend(Backend):
    """Values as files under `root` (created if missing): the file of key k is
    root/ab/cd/<SHA-256 hex of k> (ab, cd: its first hex digits, so no directory holds
    more than a few thousand files). A write goes to a temporary file beside the target
    (".<name>.<random>.tmp"), is fsynced (fsync=True) and renamed over it, so a reader or a
    crash sees the old value or the new one, never part of one. Any number of processes
    may share a directory. `put_prefix` (a save's chunks) renames its files only after
    every one is written, the head last: a save cut short (a crash, an exit, a full disk)
    leaves temporary files, never a tail whose head is missing.

    A value file is opened without blocking and without following a symbolic link, then
    checked with fstat: anything but a regular file (a FIFO, a socket, a device, a
    symbolic link), or a file longer than the caller's `max_value_bytes`, is a
    `RefusedValue` (the store reports it as a refused chunk and deletes it), never a
    hang or a read of a huge file. A directory where a value should be is a StoreError.

    max_bytes bounds the values' bytes and the temporary files' (None: no bound): a
    write or a read marks a file used (its mtime, set from a clock that never repeats
    within the process; the files of one read or save are marked last to first, so a
    prefix's first chunk is its most recently used), and once a tenth of max_bytes has
    been written since the last sweep, a sweep lists the files and deletes the least
    recently used (oldest mtime) until at most 0.9 x max_bytes remain: a prefix loses its
    last chunks first. Between sweeps the directory may pass the bound by that tenth
    (and by the temporary files of writes in progress, which no sweep deletes). Every
    sweep (the first write of a backend runs one, with or without max_bytes) first
    deletes the stale temporary files: those older than TEMP_MAX_AGE_S seconds that no
    write of this backend holds (left by a write killed partway).
    """

    #: a temporary file older than this (seconds since its last write) that no write of
    #: this backend holds is a dead write's, deleted by the next sweep
    TEMP_MAX_AGE_S = 600

    def __init__(self, root: str | os.PathLike, *, fsync: bool = True,
                 max_bytes: int | None = None):
        if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int)
                                      or max_bytes < 1):
            raise RangeError(f"max_bytes must be a positive int or None, got {max_bytes!r}")
        self.root = os.path.abspath(os.fspath(root))
        self.fsync = bool(fsync)
        self.max_bytes = max_bytes
        self._since_sweep: int | None = None  # None: sweep at the first write (leftovers)
        self._clock = 0  # the last mtime set, ns
        self._live: set[str] = set()  # temporary files of this backend's writes in progress
        self.name = f"directory {self.root}"
        try:
            os.makedirs(self.root, exist_ok=True)
        except OSError as e:
            raise self._fail("create", e) from None

    def _path(self, key: str) -> str:
        h = hashlib.sha256(key.encode("utf-8")).hexdigest()
        return os.path.join(self.root, h[:2], h[2:4], h)

    def _touch(self, path: str) -> None:
        """Marks a file used now (mtime), later than every file this process marked."""
        self._clock = max(time.time_ns(), self._clock + 1)
        try:
            os.utime(path, ns=(self._clock, self._clock), follow_symlinks=False)
        except FileNotFoundError:
            pass

    def _open(self, key: str, max_value_bytes: int | None):
        """(fd, size) of key's value file, None when there is none, or a RefusedValue:
        opened without blocking (a FIFO would block open() forever) and without following
        a symbolic link, then checked by fstat."""
        path = self._path(key)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        except OSError as e:
            try:
                mode = os.lstat(path).st_mode
            except OSError:
                mode = None
            if mode is not None and not stat.S_ISREG(mode) and not stat.S_ISDIR(mode):
                return RefusedValue(f"the value's file is {_file_kind(mode)}, not a regular file")
            raise self._fail(f"read of key {key!r}", e) from None
        try:
            st = os.fstat(fd)
            if stat.S_ISDIR(st.st_mode):
                raise IsADirectoryError(errno.EISDIR, "a directory where the value's file "
                                                      "should be", path)
            refused = None
            if not stat.S_ISREG(st.st_mode):
                refused = RefusedValue(f"the value's file is {_file_kind(st.st_mode)}, not a "
                                       f"regular file")
            elif max_value_bytes is not None and st.st_size > max_value_bytes:
                refused = RefusedValue(f"the value's file of {st.st_size} bytes is longer than "
                                       f"any chunk of this store can be ({max_value_bytes} "
                                       f"bytes)")
        except OSError as e:
            os.close(fd)
            raise self._fail(f"read of key {key!r}", e) from None
        if refused is not None:
            os.close(fd)
            return refused
        return fd, st.st_size

    def _read(self, key: str, fd: int, size: int, buf: np.ndarray | None) -> memoryview:
        """The file's bytes (at most size: a file truncated meanwhile gives fewer, which the
        checksum refuses), into buf when it is large enough (else fresh memory); closes fd."""
        try:
            with open(fd, "rb", buffering=0) as f:
                view = memoryview(buf if buf is not None and buf.nbytes >= size
                                  else np.empty(size, np.uint8))[:size]
                got = 0
                while got < size:
                    k = f.readinto(view[got:])
                    if not k:
                        break
                    got += k
                return view[:got]
        except OSError as e:
            raise self._fail(f"read of key {key!r}", e) from None

    def get_prefix(self, keys):
        out: list = []
        for key in keys:
            opened = self._open(key, None)
            if opened is None:
                break
            if isinstance(opened, RefusedValue):
                out.append(opened)
                break
            out.append(self._read(key, *opened, None).tobytes())
        if self.max_bytes is not None:
            for key in reversed(keys[:len(out)]):
                self._touch(self._path(key))
        return out

    def read_prefix(self, keys, max_value_bytes=None):
        """Each file read into one buffer reused for the next (no new memory per value,
        none touched for the first time: a load's values pass through the CPU's caches
        on their way to the pages)."""
        buf = np.empty(0, np.uint8)
        n = 0
        try:
            for key in keys:
                opened = self._open(key, max_value_bytes)
                if opened is None:
                    break
                if isinstance(opened, RefusedValue):
                    yield opened
                    break
                fd, size = opened
                if buf.nbytes < size:
                    try:
                        buf = np.empty(size, np.uint8)
                    except BaseException:
                        os.close(fd)
                        raise
                view = self._read(key, fd, size, buf)
                n += 1
                yield view
        finally:
            if self.max_bytes is not None:
                for key in reversed(keys[:n]):
                    self._touch(self._path(key))

    def contains_prefix(self, keys):
        n = 0
        for key in keys:
            try:
                if not stat.S_ISREG(os.lstat(self._path(key)).st_mode):
                    break  # not a value: a load refuses it, a save replaces it
            except FileNotFoundError:
                break
            except OSError as e:
                raise self._fail(f"stat of key {key!r}", e) from None
            n += 1
        return n

    def _stage(self, key: str, value) -> tuple[str, str]:
        """Writes value to a new temporary file beside key's file (fsynced with fsync=True);
        (its path, the target path). The temporary file is held (self._live) until
        _commit or _drop."""
        path = self._path(key)
        directory = os.path.dirname(path)
        tmp = os.path.join(directory, f".{os.path.basename(path)}.{secrets.token_hex(8)}.tmp")
        self._live.add(tmp)
        try:
            os.makedirs(directory, exist_ok=True)
            with open(tmp, "xb") as f:
                f.write(value)
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
        except BaseException as e:
            self._drop([tmp])
            if isinstance(e, OSError):
                raise self._fail(f"write of key {key!r}", e) from None
            raise
        return tmp, path

    def _drop(self, temps) -> None:
        for tmp in temps:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            self._live.discard(tmp)

    def _commit(self, staged: list[tuple[str, str, str]]) -> None:
        """Renames staged (key, tmp, path) in order over their targets, then fsyncs their
        directories; a failure deletes the temporary files not yet renamed (StoreError)."""
        done = 0
        try:
            for key, tmp, path in staged:
                try:
                    os.replace(tmp, path)
                except OSError as e:
                    raise self._fail(f"write of key {key!r}", e) from None
                self._live.discard(tmp)
                done += 1
            if self.fsync:
                for directory in dict.fromkeys(os.path.dirname(p) for _, _, p in staged):
                    try:
                        _fsync_dir(directory)
                    except OSError as e:
                        raise self._fail(f"write of {len(staged)} keys", e) from None
        finally:
            self._drop([tmp for _, tmp, _ in staged[done:]])
        if self.max_bytes is not None:
            for _, _, path in staged:
                self._touch(path)

    def _wrote(self, nbytes: int) -> None:
        """Counts bytes written; sweeps at the first write and after each tenth of
        max_bytes (temporary files held by this backend are never swept)."""
        if self._since_sweep is None:
            self.sweep()
        self._since_sweep = (self._since_sweep or 0) + nbytes
        if self.max_bytes is not None and self._since_sweep * 10 >= self.max_bytes:
            self.sweep()

    def put_many(self, items):
        for key, value in items:
            tmp, path = self._stage(key, value)
            self._commit([(key, tmp, path)])
            self._wrote(len(value))

    def put_prefix(self, items):
        """Each value written to its temporary file as it comes (one in memory at a time),
        then all renamed into place, last to first: the head appears last, so a save cut
        short leaves no chunk whose head is missing (only temporary files, which a sweep
        deletes once stale), and the head is the most recently used."""
        staged: list[tuple[str, str, str]] = []
        try:
            for key, value in items:
                tmp, path = self._stage(key, value)
                staged.append((key, tmp, path))
                self._wrote(len(value))
        except BaseException:
            self._drop([tmp for _, tmp, _ in staged])
            raise
        self._commit(staged[::-1])

    def sweep(self) -> int:
        """Deletes the stale temporary files (older than TEMP_MAX_AGE_S, held by no write
        of this backend), then, with max_bytes, the least recently used values until at
        most 0.9 x max_bytes remain, temporary files counted; returns the bytes deleted.
        Files other processes delete meanwhile are skipped."""
        self._since_sweep = 0
        live = frozenset(self._live)
        stale_before = time.time_ns() - int(self.TEMP_MAX_AGE_S * 1e9)
        try:
            files = [f for a in _subdirs(self.root) for b in _subdirs(a) for f in _value_files(b)]
        except OSError as e:
            raise self._fail("sweep", e) from None
        total, freed = sum(size for _, size, _, _ in files), 0
        values = []
        for mtime, size, path, temp in files:
            if not temp:
                values.append((mtime, size, path))
            elif path not in live and mtime < stale_before:
                freed += self._unlink(path, size)
        if self.max_bytes is None:
            return freed
        for _, size, path in sorted(values):
            if total - freed <= 0.9 * self.max_bytes:
                break
            freed += self._unlink(path, size)
        return freed

    def _unlink(self, path: str, size: int) -> int:
        """size when path was deleted, 0 when another process deleted it first."""
        try:
            os.unlink(path)
            return size
        except FileNotFoundError:
            return 0
        except OSError as e:
            raise self._fail("sweep", e) from None

    def delete(self, keys):
        for key in keys:
            try:
                os.unlink(self._path(key))
            except FileNotFoundError:
                pass
            except OSError as e:
                raise self._fail(f"delete of key {key!r}", e) from None


def _subdirs(path: str) -> list[str]:
    """The fan-out directories (two hex digits) in path."""
    try:
        return [e.path for e in os.scandir(path)
                if len(e.name) == 2 and e.is_dir(follow_symlinks=False)]
    except FileNotFoundError:
        return []


def _value_files(path: str) -> list[tuple[int, int, str, bool]]:
    """(mtime ns, size, path, temporary) of the files in path: values, anything else at a
    value's name, and temporary files (".<name>.<random>.tmp"); files deleted meanwhile
    are left out."""
    out = []
    try:
        entries = list(os.scandir(path))
    except FileNotFoundError:
        return out
    for e in entries:
        temp = e.name.startswith(".")
        if temp and not e.name.endswith(".tmp"):
            continue
        try:
            st = e.stat(follow_symlinks=False)
        except FileNotFoundError:
            continue
        if stat.S_ISDIR(st.st_mode):
            continue
        out.append((st.st_mtime_ns, st.st_size, e.path, temp))
    return out


def _file_kind(mode: int) -> str:
    """'a FIFO', 'a symbolic link', ... for a file's st_mode."""
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISLNK, "a symbolic link"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return f"a file of mode {mode:o}"


class RedisBackend(Backend):
    """Values in a Redis or Valkey server, or a Redis Cluster, through redis-py.

    `url` ("redis://host:port/0", "rediss://..." for TLS, "unix:///path.sock"; a password
    as "redis://:password@host:port" or "redis://user:password@...") builds a client;
    cluster=True makes it a RedisCluster client (any node's address: the others are
    discovered). `client` takes a redis.Redis or redis.cluster.RedisCluster built by the
    caller instead (with decode_responses=True too: values are read as bytes either way).
    ttl: seconds a value lives after its write (None: until the server evicts it).

    Deadlines, in seconds: connect_timeout bounds each connect and read_timeout each
    socket read of the client built from `url` (a caller's client keeps its own);
    `deadline` bounds every call to the server, whatever the client and however many
    nodes it reaches: a lookup (its GETs, or a save's EXISTS), a write, a delete. The
    call runs on one of the backend's worker threads (at most WORKERS at once); the
    caller waits for it until the deadline, then gets a StoreError, and the call's
    sockets are shut down, which ends it. A call that finds a connection broken is tried
    once more within the deadline (a server restarted since the last call). A cluster
    whose node failed, did not answer in time or answered a redirect (MOVED, ASK,
    CLUSTERDOWN, TRYAGAIN) reads its slot map again after the call, on the worker thread
    (the caller does not wait for it; at most once a second).

    A write is one SET (atomic). A lookup is one round trip of GETs to a single server;
    on a cluster the keys are grouped by the node that holds their slot and sent to every
    node before any answer is read: one round trip per node, together. No multi-key
    command is used (chunk keys lie in different slots, which spreads a long prefix over
    the cluster; MGET across slots is refused by Cluster). A reply to GET that is not a
    value (an integer, an array, WRONGTYPE) is a RefusedValue (a refused chunk).

    The backend's name (in every StoreError, log line and repr) carries no credential:
    "redis 127.0.0.1:6379", "redis cluster redis://10.0.0.7:7000/0"; a password of the
    URL or the client is also masked ("***") in the messages of the errors it reports.
    """

    #: the most calls of one backend that run at once (more wait for a worker, within
    #: their deadline)
    WORKERS = 8

    def __init__(self, url: str | None = None, *, cluster: bool = False, client=None,
                 ttl: float | None = None, connect_timeout: float = 2.0,
                 read_timeout: float = 5.0, deadline: float = 10.0):
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.cluster import RedisCluster
            from redis.retry import Retry
        except ImportError as e:
            raise StoreError(f"RedisBackend needs redis-py (pip install 'kvcore[redis]'): {e}") from None
        if (url is None) == (client is None):
            raise StoreError("RedisBackend takes one of url or client")
        if ttl is not None and not (isinstance(ttl, (int, float)) and not isinstance(ttl, bool)
                                    and 0 < ttl < math.inf):
            raise RangeError(f"ttl must be a positive number of seconds or None, got {ttl!r}")
        for what, value in (("connect_timeout", connect_timeout), ("read_timeout", read_timeout),
                            ("deadline", deadline)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not 0 < value < math.inf:
                raise RangeError(f"{what} must be a positive, finite number of seconds, "
                                 f"got {value!r}")
        self._px = None if ttl is None else max(1, round(ttl * 1000))
        self.connect_timeout, self.read_timeout = float(connect_timeout), float(read_timeout)
        self.deadline = float(deadline)
        self._redis = redis
        self._lock = threading.Lock()
        self._workers: _Workers | None = None
        self._closed = False
        self._refreshing, self._next_refresh = False, 0.0
        if client is None:
            if not isinstance(url, str):
                raise DTypeError(f"invalid type of url: expected str, got {type(url).__name__}")
            self._secrets = _url_secrets(url)
            self.name = f"redis{' cluster' if cluster else ''} {_url_name(url)}"
            opts = dict(socket_connect_timeout=self.connect_timeout,
                        socket_timeout=self.read_timeout)
            try:
                if cluster:   # node clients never retry (redis-py); this backend retries
                    client = RedisCluster.from_url(url, **opts)
                else:
                    client = redis.Redis.from_url(url, retry=Retry(NoBackoff(), 0), **opts)
            except Exception as e:  # noqa: BLE001 (a bad URL, a cluster unreachable, ...)
                raise StoreError(f"{self.name}: connect failed: "
                                 f"{self._scrub(f'{type(e).__name__}: {e}')}") from None
        elif not isinstance(client, (redis.Redis, RedisCluster)):
            raise DTypeError(f"invalid type of client: expected a redis.Redis or a "
                             f"redis.cluster.RedisCluster, got {type(client).__name__}")
        self.client = client
        self.cluster = isinstance(client, RedisCluster)
        if url is None:
            self._secrets = _client_secrets(client)
            if self.cluster:
                node = client.get_default_node()
                self.name = "redis cluster" + (f" {node.name}" if node is not None else "")
        if not self.cluster:
            self.name = f"redis {_address(client)}"

    def __repr__(self) -> str:
        return f"RedisBackend({self.name!r}, deadline={self.deadline:g})"

    # -- messages ------------------------------------------------------------------

    def _scrub(self, message: str) -> str:
        """An error's text with every credential of the URL or the client masked (the
        name needs none: it never holds one)."""
        for secret in self._secrets:
            message = message.replace(secret, "***")
        return message

    def _fail(self, op: str, e: BaseException) -> StoreError:
        try:
            text = f"{type(e).__name__}: {e}"
        except Exception:  # noqa: BLE001 (str() of the exception failed)
            text = type(e).__name__
        return StoreError(f"{self.name}: {op} failed: {self._scrub(text)}")

    # -- calls ---------------------------------------------------------------------

    def _call(self, op: str, commands: list[tuple]) -> list:
        """The replies to commands ((NAME, key, *args) each), in order, an error reply as
        its ResponseError: run on a worker thread, waited for at most `deadline` seconds.
        StoreError when the server or the client fails, or the deadline passes."""
        job = _Job(commands, time.monotonic() + self.deadline)
        try:
            self._pool().submit(self._serve, job)
        except RuntimeError as e:   # closed, or the interpreter is shutting down
            raise self._fail(op, e) from None
        if not job.done.wait(self.deadline):
            job.interrupt()
            raise StoreError(f"{self.name}: {op} failed: no answer within the deadline of "
                             f"{self.deadline:g} s")
        if job.error is not None:
            raise self._fail(op, job.error)
        return job.value

    def _pool(self) -> "_Workers":
        with self._lock:
            if self._closed:
                raise RuntimeError("the backend is closed")
            if self._workers is None or self._workers.pid != os.getpid():   # a forked child's
                self._workers = _Workers(self.WORKERS)
            return self._workers

    def _serve(self, job: "_Job") -> None:
        """(a worker thread) One call: its replies or its exception into the job; then, on
        a cluster whose slot map may be stale, reads the map again."""
        if not job.start():
            return                       # its caller gave up before it started
        errors = self._redis.exceptions
        refresh = False
        try:
            try:
                replies = self._exchange(job)
            except errors.ConnectionError as e:   # a broken connection: once more
                if isinstance(e, errors.AuthenticationError) or job.interrupted \
                        or time.monotonic() >= job.deadline:
                    raise
                replies = self._exchange(job)
            refresh = self.cluster and any(_redirect(r, errors) for r in replies)
            job.finish(replies, None)
        except BaseException as e:  # noqa: BLE001 (reported to the caller as a StoreError)
            refresh = self.cluster
            job.finish(None, e)
        if refresh:
            self._refresh()

    def _exchange(self, job: "_Job") -> list:
        """Sends the job's commands to the servers that hold their keys (every request
        written before any reply is read) and reads the replies."""
        commands = job.commands
        if self.cluster:
            groups: dict[str, tuple[object, list[int]]] = {}
            for i, command in enumerate(commands):
                node = self.client.get_node_from_key(command[1])
                if node.name not in groups:
                    groups[node.name] = (self.client.get_redis_connection(node), [])
                groups[node.name][1].append(i)
            targets = list(groups.values())
        else:
            targets = [(self.client, list(range(len(commands))))]
        replies: list = [None] * len(commands)
        held: list[list] = []            # [pool, connection, every reply read]
        try:
            for server, indices in targets:
                pool = server.connection_pool
                conn = _connection(pool)   # a new one connects (connect and read timeouts)
                held.append([pool, conn, False])
                job.hold(conn)
                conn.send_packed_command(conn.pack_commands([commands[i] for i in indices]))
            for (_, conn, _), (_, indices) in zip(held, targets):
                for i in indices:
                    try:
                        replies[i] = conn.read_response(disable_decoding=True)
                    except self._redis.exceptions.ResponseError as e:
                        replies[i] = e
            for entry in held:
                entry[2] = True
        finally:
            for pool, conn, clean in held:
                if not clean:
                    conn.disconnect()    # replies unread: never reused
                pool.release(conn)
        return replies

    def _refresh(self) -> None:
        """(a worker thread, after a cluster call failed) Reads the slot map again: at most
        one at a time, at most once a second."""
        with self._lock:
            if self._refreshing or time.monotonic() < self._next_refresh or self._closed:
                return
            self._refreshing = True
        try:
            self.client.nodes_manager.initialize()
        except Exception as e:  # noqa: BLE001 (the next failure tries again)
            _log.info("%s: reading the slot map failed: %s", self.name,
                      self._scrub(f"{type(e).__name__}: {e}"))
        finally:
            with self._lock:
                self._refreshing = False
                self._next_refresh = time.monotonic() + 1.0

    # -- the interface -------------------------------------------------------------

    def get_prefix(self, keys):
        if not keys:
            return []
        op = f"GET of {len(keys)} keys"
        out: list = []
        for reply in self._call(op, [("GET", k) for k in keys]):
            if reply is None:
                break
            if isinstance(reply, bytes):
                out.append(reply)
                continue
            if isinstance(reply, self._redis.exceptions.ResponseError) \
                    and not str(reply).startswith("WRONGTYPE"):
                raise self._fail(op, reply)   # the server refused the GET: a failed lookup
            out.append(RefusedValue(f"the server answered GET with {_describe(reply)}, "
                                    f"not a value"))
            break
        return out

    def contains_prefix(self, keys):
        if not keys:
            return 0
        op = f"EXISTS of {len(keys)} keys"
        n = 0
        for reply in self._call(op, [("EXISTS", k) for k in keys]):
            if isinstance(reply, self._redis.exceptions.ResponseError):
                raise self._fail(op, reply)
            if not (isinstance(reply, int) and reply > 0):
                break
            n += 1
        return n

    def put_many(self, items):
        if not items:
            return
        op = f"SET of {len(items)} keys"
        px = () if self._px is None else ("PX", self._px)
        for reply in self._call(op, [("SET", k, v, *px) for k, v in items]):
            if isinstance(reply, self._redis.exceptions.ResponseError):
                raise self._fail(op, reply)
            if reply != b"OK":
                raise StoreError(f"{self.name}: {op} failed: the server answered "
                                 f"{_describe(reply)}, not OK")

    def delete(self, keys):
        if not keys:
            return
        op = f"DEL of {len(keys)} keys"
        for reply in self._call(op, [("DEL", k) for k in keys]):
            if isinstance(reply, self._redis.exceptions.ResponseError):
                raise self._fail(op, reply)

    def close(self):
        with self._lock:
            self._closed = True
            workers, self._workers = self._workers, None
        if workers is not None:
            workers.close()
        try:
            self.client.close()
        except Exception:  # noqa: BLE001 (closing: nothing to report to)
            pass


class _Workers:
    """The threads that run a RedisBackend's calls: at most `size`, started as calls need
    them; a call waits in the queue for a free one. Daemon threads: one stuck on a server
    (in a connect or handshake, which no deadline interrupts) never holds up the exit.
    A thread idle for IDLE_S seconds ends."""

    IDLE_S = 30.0

    def __init__(self, size: int):
        self.size, self.pid = size, os.getpid()
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = self._idle = self._queued = 0
        self._closed = False

    def submit(self, fn, job) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError("the backend is closed")
            self._queued += 1
            self._jobs.put((fn, job))
            if self._queued > self._idle and self._threads < self.size:
                threading.Thread(target=self._run, name="kvcore-redis", daemon=True).start()
                self._threads += 1

    def _run(self) -> None:
        while True:
            with self._lock:
                self._idle += 1
            try:
                item = self._jobs.get(timeout=self.IDLE_S)
            except queue.Empty:
                with self._lock:
                    self._idle -= 1
                    if not self._queued:       # idle: the thread ends (a backend never
                        self._threads -= 1     # closed leaves none behind)
                        return
                continue
            with self._lock:
                self._idle -= 1
                if item is None:
                    self._threads -= 1
                    return
                self._queued -= 1
            fn, job = item
            try:
                fn(job)            # RedisBackend._serve: reports into the job
            except BaseException:  # noqa: BLE001 (the thread serves the next call)
                pass
            del item, fn, job

    def close(self) -> None:
        """Stops the threads once the calls queued so far are done."""
        with self._lock:
            self._closed = True
            for _ in range(self._threads):
                self._jobs.put(None)


class _Job:
    """One call of a RedisBackend, run on a worker thread: its commands, its deadline
    (time.monotonic), the connections it holds (shut down by `interrupt`), and its
    outcome (value or error, then `done` is set)."""

    __slots__ = ("commands", "deadline", "done", "value", "error", "interrupted", "_lock",
                 "_conns", "_started")

    def __init__(self, commands: list[tuple], deadline: float):
        self.commands, self.deadline = commands, deadline
        self.done = threading.Event()
        self.value: list | None = None
        self.error: BaseException | None = None
        self.interrupted = self._started = False
        self._lock = threading.Lock()
        self._conns: list = []

    def start(self) -> bool:
        """False when the caller gave up before a worker took the job."""
        with self._lock:
            self._started = not self.interrupted
            return self._started

    def hold(self, conn) -> None:
        """Registers a connection of the job (shut down if the caller gives up)."""
        with self._lock:
            self._conns.append(conn)
            if self.interrupted:
                _shut(conn)

    def finish(self, value: list | None, error: BaseException | None) -> None:
        self.value, self.error = value, error
        self.done.set()

    def interrupt(self) -> None:
        """The caller gave up: the job does not start, or its sockets are shut down (a
        blocked read returns at once; a connect or handshake in progress ends at its own
        timeouts)."""
        with self._lock:
            self.interrupted = True
            conns = list(self._conns)
        for conn in conns:
            _shut(conn)


def _shut(conn) -> None:
    """Shuts a redis-py connection's socket down (the thread reading it gets EOF)."""
    sock = getattr(conn, "_sock", None)
    if sock is not None:
        try:
            socket.socket.shutdown(sock, socket.SHUT_RDWR)   # the TCP socket under any TLS
        except (OSError, TypeError, ValueError):
            pass


def _connection(pool):
    """A connection from a redis-py pool, connected (redis-py < 5.3 names a command)."""
    try:
        return pool.get_connection()
    except TypeError:
        return pool.get_connection("GET")


def _redirect(reply, errors) -> bool:
    """Whether a reply is a cluster's redirect or refusal: its slot map may be stale."""
    return isinstance(reply, errors.ResponseError) and str(reply).split(" ", 1)[0] in (
        "MOVED", "ASK", "CLUSTERDOWN", "TRYAGAIN")


def _describe(reply) -> str:
    """A reply's kind in words: 'an integer (5)', 'an array of 2', 'an error (WRONGTYPE ...)'."""
    if isinstance(reply, BaseException):
        return f"an error ({str(reply)[:100]})"
    if isinstance(reply, bool):
        return f"a boolean ({reply})"
    if isinstance(reply, int):
        return f"an integer ({reply})"
    if isinstance(reply, (list, tuple, set, dict)):
        return f"an array of {len(reply)}" if not isinstance(reply, dict) else "a map"
    if isinstance(reply, bytes):
        return f"{len(reply)} bytes"
    return f"a {type(reply).__name__}"


def _address(client) -> str:
    """host:port (or the socket path), then /db when not 0, that a redis.Redis client
    connects to: no credential."""
    kw = getattr(getattr(client, "connection_pool", None), "connection_kwargs", {})
    where = kw["path"] if "path" in kw else f"{kw.get('host', '?')}:{kw.get('port', '?')}"
    db = kw.get("db", 0)
    return where if not db else f"{where}/{db}"


def _url_name(url: str) -> str:
    """A Redis URL without its credentials and query: scheme://host:port, then /db when
    the URL names one (unix://path for a socket)."""
    try:
        u = urllib.parse.urlsplit(url)
        if u.scheme == "unix":
            return f"unix://{u.path}"
        host, port = u.hostname or "localhost", u.port or 6379
    except ValueError:
        return "(an invalid URL)"
    db = u.path.strip("/")
    return (f"{u.scheme}://{f'[{host}]' if ':' in host else host}:{port}"
            + (f"/{db}" if db.isdigit() else ""))


def _url_secrets(url: str) -> tuple[str, ...]:
    """What must never be shown of a Redis URL: its password (as written and decoded)
    and a password= of its query; longest first."""
    found: set[str] = set()
    try:
        u = urllib.parse.urlsplit(url)
        if u.password:
            found |= {u.password, urllib.parse.unquote(u.password)}
        for name, values in urllib.parse.parse_qs(u.query).items():
            if name.lower() == "password":
                found.update(values)
    except ValueError:
        pass
    return tuple(sorted((s for s in found if s), key=len, reverse=True))


def _client_secrets(client) -> tuple[str, ...]:
    """The password a caller's redis-py client authenticates with, if any."""
    kw = (getattr(getattr(client, "connection_pool", None), "connection_kwargs", None)
          or getattr(getattr(client, "nodes_manager", None), "connection_kwargs", None) or {})
    password = kw.get("password")
    return (password,) if isinstance(password, str) and password else ()
