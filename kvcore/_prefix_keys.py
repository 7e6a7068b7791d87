"""Chained content keys of token prefixes: the same bytes in every process and machine.

The key of a block of tokens (a page of the prefix cache, a chunk of the store) is

    key = SHA-256(b"kvcore-prefix-v1" || parent || n || ids || extras)       (32 bytes)

    parent   the key of the block before it (32 bytes), or 32 zero bytes for the first
    n        the block's token count, uint64 little-endian
    ids      the block's token ids, int64 little-endian
    extras   uint32 LE count, then per extra (sorted by kind): the kind and the value,
             each as uint32 LE byte length + bytes, the value after a one-byte type tag
             (b"s" a str as UTF-8, b"b" bytes)

so a block's key names its whole prefix. Extras (an adapter name, a tenant's salt, ...)
are tagged by kind: {"adapter": "x"} and {"salt": "x"} never share a key, and every
variable-length field is length-prefixed, so no two different inputs share an encoding.
Only bytes enter the hash: no Python `hash`, no random seed.

The prefix cache (paged pool, per page) and the chunk store (`kvcore.store`, per chunk)
both chain keys with `chain_key`; a chunk store's keys also name the chunk size, so
stores and caches with different block sizes never mix keys.
"""
from __future__ import annotations

import hashlib
import operator
import struct
from typing import Mapping, Sequence, cast

import numpy as np

from ._validate import AnyArray, check_ndarray, is_array
from .errors import DTypeError, RangeError

KEY_BYTES = 32
ROOT = bytes(KEY_BYTES)  # the parent of the first block
_DOMAIN = b"kvcore-prefix-v1"

Extra = Mapping[str, "str | bytes"]


def token_array(tokens: Sequence[int] | AnyArray, name: str = "tokens") -> np.ndarray:
    """tokens (a sequence of ints, or an integer array of any library: a torch tensor of
    input ids) as a 1-D int64 array (a copy when it is not one): ints in [0, 2**63).
    DTypeError for a non-integer array or element, RangeError for a negative id."""
    if is_array(tokens):
        tokens = check_ndarray(name, tokens)
        if tokens.dtype.kind not in "iu" or tokens.ndim != 1:
            raise DTypeError(f"invalid {name}: expected a 1-D integer array, got "
                             f"{tokens.ndim}-D {tokens.dtype}")
        if tokens.dtype.kind == "u" and tokens.size and int(tokens.max()) >= 2**63:
            raise RangeError(f"{name} holds id {int(tokens.max())}: expected ids in [0, 2**63)")
        arr = tokens.astype(np.int64, copy=False)
    else:
        try:
            arr = np.array([operator.index(t) if not isinstance(t, bool) else None
                            for t in cast(Sequence[int], tokens)], dtype=np.int64)
        except (TypeError, ValueError, OverflowError) as e:
            raise DTypeError(f"invalid {name}: expected ints in [0, 2**63): {e}") from None
    if arr.size and int(arr.min()) < 0:
        at = int(np.argmin(arr))
        raise RangeError(f"{name}[{at}] = {int(arr[at])}: expected token ids >= 0")
    return arr


def encode_extra(extra: Extra | None) -> bytes:
    """The extras' canonical bytes (see the module docstring); b"" means none given."""
    if not extra:
        return struct.pack("<I", 0)
    if not isinstance(extra, Mapping):
        raise DTypeError(f"invalid type of extra: expected a mapping of kind -> str or bytes, "
                         f"got {type(extra).__name__}")
    for kind in extra:                   # before sorting: an int among str kinds cannot sort
        if not isinstance(kind, str):
            raise DTypeError(f"invalid extra kind {kind!r}: expected a str, got "
                             f"{type(kind).__name__}")
    out = [struct.pack("<I", len(extra))]
    for kind in sorted(extra):
        value = extra[kind]
        if isinstance(value, str):
            tagged = b"s" + _utf8(value, f"extra {kind!r}")
        elif isinstance(value, bytes):
            tagged = b"b" + value
        else:
            raise DTypeError(f"invalid extra {kind!r}: expected str or bytes, "
                             f"got {type(value).__name__}")
        k = _utf8(kind, "extra kind")
        out += [struct.pack("<I", len(k)), k, struct.pack("<I", len(tagged)), tagged]
    return b"".join(out)


def _utf8(text: str, name: str) -> bytes:
    """text as UTF-8; RangeError for a code point UTF-8 does not encode (a lone surrogate,
    U+D800..U+DFFF, as a str decoded with errors="surrogateescape" holds)."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as e:
        shown = repr(text) if len(text) <= 40 else repr(text[:40]) + "..."
        raise RangeError(f"invalid {name}: {shown} holds U+{ord(text[e.start]):04X} at index "
                         f"{e.start}, a lone surrogate that UTF-8 does not encode") from None


def chain_key(parent: bytes, ids: np.ndarray, extra_bytes: bytes) -> bytes:
    """The key of one block: parent (KEY_BYTES, ROOT for the first block), ids a 1-D
    int64 array (token_array), extra_bytes from encode_extra."""
    h = hashlib.sha256(_DOMAIN)
    h.update(parent)
    h.update(struct.pack("<Q", ids.size))
    h.update(ids.astype("<i8", copy=False).tobytes())
    h.update(extra_bytes)
    return h.digest()


def prefix_keys(tokens: Sequence[int] | np.ndarray, block: int,
                extra: Extra | None = None) -> list[bytes]:
    """The chained keys of the whole blocks of `block` tokens at the start of tokens:
    len(tokens) // block keys, key i naming tokens[0 : (i + 1) * block] and the extras."""
    if isinstance(block, bool) or not isinstance(block, (int, np.integer)) or block < 1:
        raise RangeError(f"block must be a positive int, got {block!r}")
    ids = token_array(tokens)
    extra_bytes = encode_extra(extra)
    keys, parent = [], ROOT
    for start in range(0, ids.size - block + 1, block):
        parent = chain_key(parent, ids[start:start + block], extra_bytes)
        keys.append(parent)
    return keys
