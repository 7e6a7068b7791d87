"""decode_attention and apply_rope: validation and output allocation around the
kernels of _attention.pyx (docs/attention.md describes the kernel)."""
from __future__ import annotations

import functools
import math

import numpy as np

from . import _attention
from ._validate import check_dtype, check_index, check_ndarray, check_out, check_shape
from .cache import KVCache
from .errors import DTypeError, FormatError, NonFiniteError, ShapeError, StateError

ROPE_STYLES = ("neox", "norm")


def decode_attention(q: np.ndarray, cache: KVCache, layer: int, *, scale: float | None = None,
                     causal: bool = True, out: np.ndarray | None = None) -> np.ndarray:
    """Attention of new tokens' queries over one layer of a cache, read in its own format.

    q: float32, shape [Hq, D] (one new token) or [T, Hq, D] (T new tokens), any strides.
    The layer's committed plus pending positions, n of them, are attended; with causal,
    token t sees positions [0, n - T + t] (the T new tokens are the last T positions).
    scale: defaults to 1 / sqrt(D). out: float32 of q's shape, C-contiguous, written and
    returned (may be q itself); allocated when None.
    Returns float32 of q's shape.
    """
    if not isinstance(cache, KVCache):
        raise DTypeError(f"invalid type of cache: expected KVCache, got {type(cache).__name__}")
    spec = cache.spec
    layer = check_index("layer", layer, spec.num_layers)
    check_ndarray("q", q)
    check_dtype("q", q, [np.float32])
    if q.ndim == 2:
        check_shape("q", q, [spec.num_heads, spec.head_dim])
    else:
        check_shape("q", q, ["T", spec.num_heads, spec.head_dim])
    n = cache.length + cache.pending(layer)
    q3 = q.reshape(-1, spec.num_heads, spec.head_dim) if q.ndim == 2 else q
    T = q3.shape[0]
    if n == 0:
        raise StateError(f"decode_attention on an empty cache: layer {layer} holds 0 positions")
    if causal and T > n:
        raise StateError(f"causal attention of T={T} new tokens needs at least {T} positions, "
                         f"layer {layer} holds {n}")
    if scale is None:
        scale = 1.0 / math.sqrt(spec.head_dim)
    elif not math.isfinite(scale):
        raise NonFiniteError(f"scale must be finite, got {scale}")
    if out is None:
        out = np.empty(q.shape, np.float32)
    else:
        check_out("out", out, q.shape, [np.float32])
    k_codes, v_codes, k_scales, v_scales = cache._layer_arrays(layer)
    if not _attention.attend(np.ascontiguousarray(q3), k_codes, v_codes, k_scales, v_scales,
                             spec.fmt.id, n, float(scale), bool(causal), out.reshape(q3.shape)):
        bad = np.argwhere(~np.isfinite(q))[0]   # the kernel checks q as it reads it
        raise NonFiniteError(f"non-finite value in q at index {tuple(int(i) for i in bad)}")
    return out


def apply_rope(x: np.ndarray, positions: "int | np.ndarray", *, theta: float = 10000.0,
               style: str = "neox", rotary_dim: int | None = None,
               inv_freq: np.ndarray | None = None, attention_factor: float = 1.0) -> np.ndarray:
    """Rotary position embedding, in place.

    x: float32, shape [T, H, D] with positions an int array [T], or [H, D] with one int
    position; any strides, writable. style "neox" rotates the pairs (i, i + R/2) (split
    halves), "norm" the pairs (2i, 2i + 1) (adjacent), R = rotary_dim (default D, even,
    <= D); dims past R are left alone. Pair i turns by position * theta^(-2i/R), the
    angle computed in float64. Returns x.
    inv_freq: float64 [R/2], finite, >= 0: a model's own table (Llama 3, linear, dynamic
    NTK, YaRN, LongRoPE scaling: kvcore.rope_frequencies) used instead of theta; pair i
    turns by position * inv_freq[i] and R defaults to 2 * len(inv_freq).
    attention_factor: a finite positive number the R rotated dims are multiplied by, as
    transformers multiplies cos and sin (YaRN, LongRoPE).
    """
    check_ndarray("x", x)
    check_dtype("x", x, [np.float32])
    if x.ndim not in (2, 3):
        raise ShapeError(f"invalid shape of x: expected [T, H, D] or [H, D], got "
                         f"[{', '.join(map(str, x.shape))}]")
    if not x.flags.writeable:
        raise ShapeError("x must be writable (apply_rope rotates in place)")
    if style not in ROPE_STYLES:
        raise FormatError(f"unknown rope style {style!r}: expected 'neox' or 'norm'")
    D = x.shape[-1]
    R = rotary_dim if rotary_dim is not None else D if inv_freq is None else 2 * _len(inv_freq)
    if isinstance(R, bool) or not isinstance(R, (int, np.integer)) or not 0 < R <= D or R % 2:
        raise ShapeError(f"rotary_dim must be an even int in [2, {D}], got {rotary_dim!r}")
    if not (isinstance(theta, (int, float, np.floating)) and math.isfinite(theta) and theta > 0):
        raise ShapeError(f"theta must be a finite positive number, got {theta!r}")
    pos = np.asarray(positions)
    if pos.dtype.kind not in "iu":
        raise DTypeError(f"invalid dtype of positions: expected an integer type, got {pos.dtype}")
    x3 = x
    if x.ndim == 2:
        if pos.size != 1:
            raise ShapeError(f"invalid shape of positions: x [H, D] takes one position, "
                             f"got {pos.size}")
        x3 = x[np.newaxis]
    check_shape("positions", pos.reshape(-1) if x.ndim == 2 else pos, [x3.shape[0]])
    table = _inv_freq(float(theta), int(R)) if inv_freq is None else _check_inv_freq(inv_freq, R)
    if not (isinstance(attention_factor, (int, float, np.floating)) and
            math.isfinite(attention_factor) and attention_factor > 0):
        raise ShapeError(f"attention_factor must be a finite positive number, got {attention_factor!r}")
    _attention.rope(x3, np.ascontiguousarray(pos.reshape(-1), dtype=np.int64), table,
                    style == "neox")
    if attention_factor != 1:
        x3[..., :R] *= np.float32(attention_factor)
    return x


def _len(inv_freq) -> int:
    return inv_freq.shape[0] if isinstance(inv_freq, np.ndarray) and inv_freq.ndim == 1 else 0


def _check_inv_freq(inv_freq: np.ndarray, rotary_dim: int) -> np.ndarray:
    check_ndarray("inv_freq", inv_freq)
    check_dtype("inv_freq", inv_freq, [np.float64])
    check_shape("inv_freq", inv_freq, [rotary_dim // 2])
    if not (np.isfinite(inv_freq).all() and (inv_freq >= 0).all()):
        raise NonFiniteError("inv_freq must be finite and >= 0")
    return np.ascontiguousarray(inv_freq)


@functools.lru_cache(maxsize=64)
def _inv_freq(theta: float, rotary_dim: int) -> np.ndarray:
    """theta^(-2i / rotary_dim) for i < rotary_dim / 2, float64, read-only (cached: a
    model asks for the same table at every layer and step)."""
    i = np.arange(rotary_dim // 2, dtype=np.float64)
    table = np.power(theta, -2.0 * i / rotary_dim)
    table.flags.writeable = False
    return table
