"""A deterministic stand-in for a model's K/V projections, the same in every process:
the K and V of token t at position p in layer l are fixed functions of (t, p, l) in
float32, so two processes that see the same tokens compute the same K/V bit for bit."""
import numpy as np

import kvcore


def kv(spec: kvcore.KVSpec, layer: int, tokens: np.ndarray, start: int):
    """float32 K, V [len(tokens), Hkv, D] of tokens at positions start, start + 1, ..."""
    h, d = spec.num_kv_heads, spec.head_dim
    t = np.asarray(tokens, np.float32)[:, None, None]
    p = np.arange(start, start + len(tokens), dtype=np.float32)[:, None, None]
    j = np.arange(h * d, dtype=np.float32).reshape(1, h, d)
    k = np.sin(t * 0.37 + j * 0.011 + p * 0.05 + layer).astype(np.float32)
    v = np.cos(t * 0.23 - j * 0.007 + p * 0.03 - layer).astype(np.float32)
    return k, v


def prefill(cache, tokens: np.ndarray, seq: int | None = None) -> None:
    """Appends tokens after the positions of a KVCache (or of sequence seq of a KVPool),
    every layer, and advances (giving the pool the token ids when it has a prefix
    cache)."""
    if seq is None:
        start = cache.length
        for layer in range(cache.spec.num_layers):
            cache.append(layer, *kv(cache.spec, layer, tokens, start))
        cache.advance()
    else:
        start = cache.length(seq)
        for layer in range(cache.spec.num_layers):
            cache.append(*kv(cache.spec, layer, tokens, start), seq=seq, layer=layer)
        keyed = cache._table.prefix is not None  # a prefix cache takes the token ids
        cache.advance(seq, tokens=tokens if keyed else None)


def query(spec: kvcore.KVSpec, step: int) -> np.ndarray:
    """A fixed float32 query [Hq, D] for decode step `step`."""
    j = np.arange(spec.num_heads * spec.head_dim, dtype=np.float32)
    return np.sin(j * 0.013 + step).astype(np.float32).reshape(spec.num_heads, spec.head_dim)


def decode(cache, tokens: np.ndarray, seq: int | None = None) -> np.ndarray:
    """Feeds tokens one at a time (append, advance) to a KVCache (or sequence seq of a
    KVPool), attending after each in every layer: float32 [len(tokens), L, Hq, D], every
    attention output."""
    spec = cache.spec
    out = np.empty((len(tokens), spec.num_layers, spec.num_heads, spec.head_dim), np.float32)
    for i, t in enumerate(tokens):
        prefill(cache, np.array([t]), seq)
        for layer in range(spec.num_layers):
            if seq is None:
                out[i, layer] = kvcore.decode_attention(query(spec, i), cache, layer)
            else:
                out[i, layer] = kvcore.decode_attention(query(spec, i)[None], cache, layer,
                                                        seqs=[seq])[0]
    return out
