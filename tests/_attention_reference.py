"""The float64 reference of every attention variant (docs/variants.md), for the CPU and GPU
kernels' tests alike: computed from K/V already dequantized (the cache's own values), so
a kernel's difference from it is its rounding only.

    reference_attention(q, k, v, *, scale, causal=True, window=None, sink_tokens=0,
                        sinks=None, softcap=None, return_lse=False)

q: [T, Hq, D] (or [Hq, D]: one token); k, v: [n, Hkv, D]; any float dtype, computed in
float64. The T query tokens are the last T of the n positions (token t at p = n - T + t).
Returns out float64 of q's shape, or (out, lse) with lse float64 of q's shape without D.
"""
from __future__ import annotations

import numpy as np


def visible_positions(n: int, T: int, *, causal: bool = True, window: int | None = None,
                      sink_tokens: int = 0) -> np.ndarray:
    """bool [T, n]: whether token t (at position n - T + t) sees position j: j <= p (causal)
    and, with a window W, p - W < j or j < sink_tokens."""
    j = np.arange(n)[None, :]
    p = (n - T + np.arange(T))[:, None]
    seen = j <= p if causal else np.ones((T, n), bool)
    if window is not None:
        if not causal:
            raise ValueError("a window needs causal=True")
        seen &= (j > p - window) | (j < sink_tokens)
    elif sink_tokens:
        raise ValueError("sink_tokens needs a window")
    return seen


def reference_attention(q, k, v, *, scale, causal=True, window=None, sink_tokens=0, sinks=None,
                        softcap=None, return_lse=False):
    """float64 attention with the variants of docs/variants.md (see the module docstring).
    scale: the softmax scale (None: 1 / sqrt(D)); sinks: [Hq] logits joining each head's
    denominator; softcap: c, the scores become c * tanh(s / c). A row that sees no position
    and has no sink gets out = 0 and lse = -inf."""
    q = np.asarray(q, np.float64)
    k = np.asarray(k, np.float64)
    v = np.asarray(v, np.float64)
    q3 = q[None] if q.ndim == 2 else q
    T, hq, d = q3.shape
    n, hkv = k.shape[:2]
    g = hq // hkv
    scale = 1 / np.sqrt(d) if scale is None else float(scale)
    kh = np.repeat(k.transpose(1, 0, 2), g, axis=0)            # [Hq, n, D]
    vh = np.repeat(v.transpose(1, 0, 2), g, axis=0)
    s = np.einsum("thd,hnd->thn", q3, kh) * scale               # [T, Hq, n]
    if softcap is not None:
        s = softcap * np.tanh(s / softcap)
    seen = visible_positions(n, T, causal=causal, window=window, sink_tokens=sink_tokens)
    s = np.where(seen[:, None, :], s, -np.inf)
    sink = (np.full(hq, -np.inf) if sinks is None
            else np.asarray(sinks, np.float64).reshape(hq))
    top = np.maximum(s.max(-1, initial=-np.inf), sink[None, :])   # [T, Hq]
    any_seen = np.isfinite(top)
    m = np.where(any_seen, top, 0.0)
    p = np.exp(s - m[..., None])                                 # 0 where not seen
    den = p.sum(-1) + np.exp(sink[None, :] - m)
    with np.errstate(invalid="ignore", divide="ignore"):
        out = np.where(any_seen[..., None],
                       np.einsum("thn,hnd->thd", p, vh) / np.where(any_seen, den, 1)[..., None],
                       0.0)
        lse = np.where(any_seen, m + np.log(np.where(any_seen, den, 1)), -np.inf)
    if q.ndim == 2:
        out, lse = out[0], lse[0]
    return (out, lse) if return_lse else out
