"""Where chunk values live: one small interface, two backends.

A backend maps str keys to bytes values. Writes are atomic (a reader sees a whole value
or none); a long prompt's lookup is one round trip; every failure of the medium (a
server gone, a disk error) raises StoreError naming the backend and the operation.
"""
from __future__ import annotations

import hashlib
import os
import secrets
from abc import ABC, abstractmethod
from typing import Sequence

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
    """

    def __init__(self, root: str | os.PathLike, *, fsync: bool = True):
        self.root = os.path.abspath(os.fspath(root))
        self.fsync = bool(fsync)
        self.name = f"directory {self.root}"
        try:
            os.makedirs(self.root, exist_ok=True)
        except OSError as e:
            raise self._fail("create", e) from None

    def _path(self, key: str) -> str:
        h = hashlib.sha256(key.encode("utf-8")).hexdigest()
        return os.path.join(self.root, h[:2], h[2:4], h)

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
        return out

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

    def delete(self, keys):
        for key in keys:
            try:
                os.unlink(self._path(key))
            except FileNotFoundError:
                pass
            except OSError as e:
                raise self._fail(f"delete of key {key!r}", e) from None


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
        self._errors = (redis.exceptions.RedisError, OSError)
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
                raise StoreError(f"redis {url}: connect failed: {type(e).__name__}: {e}") from None
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
