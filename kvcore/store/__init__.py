"""Chunks of K/V stored and shared through a local directory or a Redis/Valkey server
(docs/store.md): `KVStore` over a `DirectoryBackend` or a `RedisBackend`, and
`StoreWriter` to save off the decode path."""
from ._backends import Backend, DirectoryBackend, RedisBackend, RefusedValue
from ._codec import decode_chunk, encode_chunk
from ._store import KVStore, LoadResult, StoreWriter, WriterStats

__all__ = ["Backend", "DirectoryBackend", "RedisBackend", "RefusedValue", "KVStore",
           "LoadResult", "StoreWriter", "WriterStats", "encode_chunk", "decode_chunk"]
