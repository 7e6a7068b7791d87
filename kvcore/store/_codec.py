"""The chunk value: a versioned, self-describing, checksummed encoding of one chunk.

    [8 bytes magic b"KVCHUNK1"][16 bytes XXH3-128 of everything after them][body]
    body: a safetensors blob (the snapshot file's encoding, kvcore.snapshot):
    [u64 LE header length][JSON header, space-padded][token_ids][K scales][V scales][K codes][V codes]

The header's metadata names the chunk version, the store key the value was written
under, the model, the format, the layout, num_layers / num_kv_heads / head_dim and the
chunk's token count; token_ids (int64 [C]) are the chunk's tokens; the parts are a
Snapshot's arrays for the chunk's C positions ([L, C, Hkv, D] codes, [L, C, Hkv, S]
scales). The digest covers every byte after it; the magic and the digest are checked
by their own comparison, so a change to any byte of a value is caught.

`decode_chunk` refuses (ChunkError naming the reason) a value that is truncated, longer
than any chunk of its kind can be (`ChunkKind.max_value_bytes`), corrupt, of another
format or version, written under another key, or that holds other
tokens, other shapes or a code the format never stores: the caller treats it as a miss.
"""
from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import xxhash

from ..errors import ChunkError, SnapshotError
from ..snapshot import (Snapshot, _check_values, _encode_header, _layout,
                        _parse_table)
from ..spec import KVSpec

MAGIC = b"KVCHUNK1"  # the last byte is the chunk format's version
LAYOUT = "token-major-1"  # parts [L][C][Hkv][D] codes, [L][C][Hkv][S] scales, token ids first
_PREFIX = len(MAGIC) + 16
_MAX_HEADER_BYTES = 1 << 20
_TOKENS = "token_ids"


@dataclass(frozen=True)
class ChunkKind:
    """What every chunk of one store shares: the key's fields other than the content."""

    model: str
    spec: KVSpec  # its format, num_layers, num_kv_heads and head_dim
    chunk_tokens: int

    def metadata(self, key: str) -> dict[str, str]:
        s = self.spec
        return {"chunk_version": MAGIC[-1:].decode(), "key": key, "model": self.model,
                "format": s.format, "layout": LAYOUT, "num_layers": str(s.num_layers),
                "num_kv_heads": str(s.num_kv_heads), "head_dim": str(s.head_dim),
                "chunk_tokens": str(self.chunk_tokens)}

    def layout(self):
        """(name, shape, dtype) of each tensor of a value, in order."""
        spec = self.spec.replace(capacity=max(self.spec.capacity, self.chunk_tokens))
        return ([(_TOKENS, (self.chunk_tokens,), np.dtype(np.int64))]   # whole groups of
                + [part for part in _layout(spec, self.chunk_tokens)    # q4_1ch: no open one
                   if part[0] != "k_residual"])

    @cached_property
    def max_value_bytes(self) -> int:
        """The most bytes a value of this kind can have: magic, digest, the header's
        length field, the longest header decode_chunk reads (1 MiB) and the tensors' exact
        bytes. A longer value is refused before it is read."""
        data = sum(math.prod(shape) * dt.itemsize for _, shape, dt in self.layout())
        return _PREFIX + 8 + _MAX_HEADER_BYTES + data


def encode_chunk(kind: ChunkKind, key: str, token_ids: np.ndarray, parts: dict) -> bytes:
    """The value of one chunk. token_ids: int64 [C]; parts: k_codes, v_codes, k_scales,
    v_scales as in a Snapshot of C positions (C-contiguous, or a slice of positions of a
    C-contiguous snapshot array: copied once, into the value)."""
    arrays = [(name, np.asarray(token_ids if name == _TOKENS else parts[name], dtype))
              for name, _, dtype in kind.layout()]
    header = _encode_header(kind.metadata(key), arrays)
    pieces = [p for _, a in arrays for p in _pieces(a)]
    h = xxhash.xxh3_128()
    h.update(header)
    for p in pieces:
        h.update(p)
    return b"".join([MAGIC, h.digest(), header, *pieces])


def _pieces(arr: np.ndarray) -> list[memoryview]:
    """arr's bytes in C order as contiguous pieces: no copy when arr is C-contiguous, or
    each arr[i] is (a chunk's positions of a snapshot array: one piece per layer)."""
    if arr.flags.c_contiguous:
        return [memoryview(arr.reshape(-1).view(np.uint8))]
    if arr.ndim > 1 and all(a.flags.c_contiguous for a in arr):
        return [p for a in arr for p in _pieces(a)]
    return _pieces(np.ascontiguousarray(arr))


def decode_chunk(kind: ChunkKind, key: str, token_ids: np.ndarray, value) -> dict:
    """The parts of a chunk value, checked (see the module docstring): {name: read-only
    array over the value's bytes} for the names of kind.layout() but token_ids.
    ChunkError names the first defect found."""
    view = memoryview(value).cast("B")
    n = view.nbytes
    if n < _PREFIX + 8:
        raise ChunkError(f"value of {n} bytes is too short for a chunk (truncated)")
    if n > kind.max_value_bytes:
        raise ChunkError(f"value of {n} bytes is longer than any chunk of this store can be "
                         f"({kind.max_value_bytes} bytes)")
    magic = bytes(view[:len(MAGIC)])
    if magic != MAGIC:
        if magic[:-1] == MAGIC[:-1]:
            raise ChunkError(f"chunk format version {magic[-1:]!r} is not the {MAGIC[-1:]!r} "
                             f"this kvcore reads")
        raise ChunkError(f"not a kvcore chunk: the value starts with {magic!r}")
    h = xxhash.xxh3_128()
    h.update(view[_PREFIX:])
    if h.digest() != bytes(view[len(MAGIC):_PREFIX]):
        raise ChunkError(f"the value's {n} bytes do not match its XXH3-128: corrupt or "
                         f"truncated")
    body = view[_PREFIX:]
    (header_len,) = struct.unpack("<Q", body[:8])
    if header_len > min(body.nbytes - 8, _MAX_HEADER_BYTES):
        raise ChunkError(f"header length {header_len} exceeds the value (truncated)")
    try:
        table = json.loads(bytes(body[8:8 + header_len]).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ChunkError(f"header is not valid JSON: {type(e).__name__}: {e}") from None
    meta = table.pop("__metadata__", None) if isinstance(table, dict) else None
    want = kind.metadata(key)
    if not isinstance(meta, dict):
        raise ChunkError("header has no metadata: not a kvcore chunk")
    diff = sorted(k for k in set(want) | set(meta) if k != "key" and meta.get(k) != want.get(k))
    if diff:
        raise ChunkError("chunk does not match the store's: " + ", ".join(
            f"{k} {str(meta.get(k))[:60]!r} (expected {str(want.get(k))[:60]!r})" for k in diff))
    if meta["key"] != key:
        raise ChunkError(f"chunk was written under key {meta['key'][:200]!r}, not this one")
    layout = kind.layout()
    data = body[8 + header_len:]
    try:
        offsets = _parse_table(table, layout, data.nbytes)
    except SnapshotError as e:
        raise ChunkError(f"chunk tensors: {e}") from None
    arrays = {name: np.frombuffer(data[offsets[name]:offsets[name] + math.prod(shape) * dt.itemsize],
                                  dt).reshape(shape)
              for name, shape, dt in layout}
    stored = arrays.pop(_TOKENS)
    if not np.array_equal(stored, token_ids):
        at = int(np.argmax(stored != token_ids))
        raise ChunkError(f"chunk holds other tokens (position {at}: {int(stored[at])}, "
                         f"expected {int(token_ids[at])}): a key collision")
    spec = kind.spec.replace(capacity=max(kind.spec.capacity, kind.chunk_tokens))
    try:
        _check_values(Snapshot(spec, kind.chunk_tokens, **arrays))
    except SnapshotError as e:
        raise ChunkError(f"chunk values: {e}") from None
    return arrays

