"""Where chunk values live: one small interface, two backends.

A backend maps str keys to bytes values. Writes are atomic (a reader sees a whole value
or none); a long prompt's lookup is one round trip; every failure of the medium (a
server gone, a disk error) raises StoreError naming the backend and the operation.
"""
from __future__ import annotations

import hashlib
import os
import secrets
import time
from abc import ABC, abstractmethod
from typing import Iterator, Sequence

import numpy as np

from ..errors import RangeError, StoreError
from ..snapshot import _fsync_dir


class Backend(ABC):
    """The interface `KVStore` uses."""

    #: names the backend in messages: "redis 127.0.0.1:6379", "directory /var/kv"
    name: str

    @abstractmethod
    def get_prefix(self, keys: Sequence[str]) -> list[bytes]:
        """The values of the longest run of stored keys from keys[0], in order (one round
        trip): [] when keys[0] is not stored."""

    def read_prefix(self, keys: Sequence[str]) -> Iterator[memoryview | bytes]:
        """The values of get_prefix one at a time, each valid until the next is asked for
        (a backend may read them into one reused buffer). The default fetches them all
        with get_prefix (one round trip) first."""
        yield from self.get_prefix(keys)

    @abstractmethod
    def contains_prefix(self, keys: Sequence[str]) -> int:
        """How many keys from keys[0] on are stored, without reading their values."""

    @abstractmethod
    def put_many(self, items: Sequence[tuple[str, bytes]]) -> None:
        """Stores each (key, value), replacing any old value; each write is atomic."""

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
    more than a few thousand files). A write goes to a temporary file beside the target,
    is fsynced (fsync=True) and renamed over it, so a reader or a crash sees the old value
    or the new one, never part of one. Any number of processes may share a directory.

    max_bytes bounds the values' bytes (None: no bound): a write or a read marks a file
    used (its mtime, set from a clock that never repeats within the process; the files
    of one read are marked last to first, so a prefix's first chunk is its most recently
    used), and once a tenth of max_bytes has been written since the last sweep, a sweep
    lists the files and deletes the least recently used (oldest mtime) until at most
    0.9 x max_bytes remain: a prefix loses its last chunks first. Between sweeps the
    directory may pass the bound by that tenth.
    """

    def __init__(self, root: str | os.PathLike, *, fsync: bool = True,
                 max_bytes: int | None = None):
        if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int)
                                      or max_bytes < 1):
            raise RangeError(f"max_bytes must be a positive int or None, got {max_bytes!r}")
        self.root = os.path.abspath(os.fspath(root))
        self.fsync = bool(fsync)
        self.max_bytes = max_bytes
        self._since_sweep = max_bytes  # sweep at the first write: the directory may be full
        self._clock = 0  # the last mtime set, ns
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
            os.utime(path, ns=(self._clock, self._clock))
        except FileNotFoundError:
            pass

    def get_prefix(self, keys):
        out = []
        for key in keys:
            try:
                with open(self._path(key), "rb") as f:
                    out.append(f.read())
            except FileNotFoundError:
                break
            except OSError as e:
                raise self._fail(f"read of key {key!r}", e) from None
        if self.max_bytes is not None:
            for key in reversed(keys[:len(out)]):
                self._touch(self._path(key))
        return out

    def read_prefix(self, keys):
        """Each file read into one buffer reused for the next (no new memory per value,
        none touched for the first time: a load's values pass through the CPU's caches
        on their way to the pages)."""
        buf = np.empty(0, np.uint8)
        n = 0
        try:
            for key in keys:
                try:
                    f = open(self._path(key), "rb", buffering=0)
                except FileNotFoundError:
                    break
                except OSError as e:
                    raise self._fail(f"read of key {key!r}", e) from None
                try:
                    with f:
                        size = os.fstat(f.fileno()).st_size
                        if buf.nbytes < size:
                            buf = np.empty(size, np.uint8)
                        view = memoryview(buf)[:size]
                        got = 0
                        while got < size:
                            k = f.readinto(view[got:])
                            if not k:
                                break   # truncated meanwhile: the checksum refuses it
                            got += k
                except OSError as e:
                    raise self._fail(f"read of key {key!r}", e) from None
                n += 1
                yield view[:got]
        finally:
            if self.max_bytes is not None:
                for key in reversed(keys[:n]):
                    self._touch(self._path(key))

    def contains_prefix(self, keys):
        n = 0
        for key in keys:
            if not os.path.exists(self._path(key)):
                break
            n += 1
        return n

    def put_many(self, items):
        for key, value in items:
            path = self._path(key)
            directory = os.path.dirname(path)
            tmp = os.path.join(directory, f".{os.path.basename(path)}.{secrets.token_hex(8)}.tmp")
            try:
                os.makedirs(directory, exist_ok=True)
                with open(tmp, "xb") as f:
                    f.write(value)
                    if self.fsync:
                        f.flush()
                        os.fsync(f.fileno())
                os.replace(tmp, path)
                if self.fsync:
                    _fsync_dir(directory)
            except OSError as e:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
                raise self._fail(f"write of key {key!r}", e) from None
            if self.max_bytes is not None:
                self._touch(path)
                self._since_sweep += len(value)
                if self._since_sweep * 10 >= self.max_bytes:
                    self.sweep()

    def sweep(self) -> int:
        """Deletes the least recently used values until at most 0.9 x max_bytes remain
        (nothing without max_bytes); returns the bytes deleted. Files other processes
        delete meanwhile are skipped."""
        self._since_sweep = 0
        if self.max_bytes is None:
            return 0
        try:
            files = [f for a in _subdirs(self.root) for b in _subdirs(a) for f in _value_files(b)]
        except OSError as e:
            raise self._fail("sweep", e) from None
        total, freed = sum(size for _, size, _ in files), 0
        for _, size, path in sorted(files):
            if total - freed <= 0.9 * self.max_bytes:
                break
            try:
                os.unlink(path)
                freed += size
            except FileNotFoundError:
                pass
            except OSError as e:
                raise self._fail("sweep", e) from None
        return freed

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
        return [e.path for e in os.scandir(path) if len(e.name) == 2 and e.is_dir()]
    except FileNotFoundError:
        return []


def _value_files(path: str) -> list[tuple[int, int, str]]:
    """(mtime ns, size, path) of the value files in path (not the temporary ones);
    files deleted meanwhile are left out."""
    out = []
    try:
        entries = list(os.scandir(path))
    except FileNotFoundError:
        return out
    for e in entries:
        if e.name.startswith("."):
            continue
        try:
            st = e.stat()
        except FileNotFoundError:
            continue
        out.append((st.st_mtime_ns, st.st_size, e.path))
    return out


class RedisBackend(Backend):
    """Values in a Redis or Valkey server, or a Redis Cluster, through redis-py.

    `url` ("redis://host:port/0", "rediss://..." for TLS, "unix:///path.sock") builds a
    client that fails fast (connect timeout 2 s, read timeout 10 s, one retry without
    backoff, which also reconnects after a server restart); cluster=True makes it a
    RedisCluster client (any node's address: the others are discovered). `client` takes
    a redis.Redis or redis.cluster.RedisCluster built by the caller instead. ttl: seconds
    a value lives after its write (None: until the server evicts it).

    A write is one SET (atomic). A lookup is one pipeline of GETs: one round trip to a
    single server; on a cluster one round trip to each node holding some of the keys,
    sent together. No multi-key command is used (chunk keys lie in different slots, which
    spreads a long prefix over the cluster; MGET across slots is refused by Cluster).
    """

    def __init__(self, url: str | None = None, *, cluster: bool = False, client=None,
                 ttl: float | None = None):
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError as e:
            raise StoreError(f"RedisBackend needs redis-py (pip install 'kvcore[redis]'): {e}") from None
        if (url is None) == (client is None):
            raise StoreError("RedisBackend takes one of url or client")
        if ttl is not None and not (isinstance(ttl, (int, float)) and ttl > 0):
            raise RangeError(f"ttl must be a positive number of seconds or None, got {ttl!r}")
        # RedisClusterException (cluster unreachable, slot not covered) is no RedisError
        self._errors = (redis.exceptions.RedisError, redis.exceptions.RedisClusterException,
                        OSError)
        self._px = None if ttl is None else max(1, round(ttl * 1000))
        if client is None:
            opts = dict(socket_connect_timeout=2.0, socket_timeout=10.0,
                        retry=Retry(NoBackoff(), 1))
            try:
                if cluster:
                    from redis.cluster import RedisCluster
                    client = RedisCluster.from_url(url, **opts)
                else:
                    client = redis.Redis.from_url(url, **opts)
            except self._errors as e:
                raise StoreError(f"redis{' cluster' if cluster else ''} {url}: connect failed: "
                                 f"{type(e).__name__}: {e}") from None
        self.client = client
        self.cluster = type(client).__name__ == "RedisCluster"
        self.name = (f"redis cluster {url or 'client'}" if self.cluster
                     else f"redis {_address(client)}")

    def _pipeline(self, op: str, commands) -> list:
        try:
            pipe = self.client.pipeline(transaction=False)
            for name, *args in commands:
                getattr(pipe, name)(*args)
            return pipe.execute()
        except self._errors as e:
            raise self._fail(op, e) from None

    def get_prefix(self, keys):
        if not keys:
            return []
        out = []
        for value in self._pipeline(f"GET of {len(keys)} keys", [("get", k) for k in keys]):
            if value is None:
                break
            out.append(value)
        return out

    def contains_prefix(self, keys):
        if not keys:
            return 0
        found = self._pipeline(f"EXISTS of {len(keys)} keys", [("exists", k) for k in keys])
        n = 0
        while n < len(found) and found[n]:
            n += 1
        return n

    def put_many(self, items):
        if items:
            self._pipeline(f"SET of {len(items)} keys",
                           [("set", k, v, None, self._px) for k, v in items])

    def delete(self, keys):
        if keys:
            self._pipeline(f"DEL of {len(keys)} keys", [("delete", k) for k in keys])

    def close(self):
        try:
            self.client.close()
        except self._errors:
            pass


def _address(client) -> str:
    """host:port (or the socket path) a redis.Redis client connects to."""
    kw = getattr(getattr(client, "connection_pool", None), "connection_kwargs", {})
    return kw["path"] if "path" in kw else f"{kw.get('host', '?')}:{kw.get('port', '?')}"
