"""rope_frequencies: the inverse-frequency table and attention factor of a model's RoPE,
in float64, from a transformers-style `rope_parameters` dict (what `apply_rope` takes as
`inv_freq` and `attention_factor`).

Each rope_type follows transformers' ROPE_INIT_FUNCTIONS (modeling_rope_utils.py), which
compute the same formulas in float32; tests/test_rope_scaling.py checks every type
against them.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from .errors import FormatError, ShapeError

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")


def rope_frequencies(rope_parameters: dict[str, Any], head_dim: int, *,
                     max_position_embeddings: int | None = None,
                     seq_len: int | None = None) -> tuple[np.ndarray, float]:
    """(inv_freq, attention_factor) of a model's rotary embedding.

    rope_parameters: transformers' `config.rope_parameters` (or a legacy `rope_scaling`
    dict with "type" and "rope_theta" added): "rope_type" one of ROPE_TYPES, "rope_theta",
    optional "partial_rotary_factor" (rotary dims R = int(head_dim * factor)), and the
    type's own keys (factor, low_freq_factor, beta_fast, short_factor, ...).
    max_position_embeddings: the model's config value (dynamic; yarn and longrope
    without "factor"). seq_len: the current sequence length (dynamic: the table grows
    past max_position_embeddings; longrope: long_factor past the original length).
    Returns inv_freq float64 [R/2] (pair i turns by position * inv_freq[i]) and the
    factor transformers multiplies cos and sin by (1.0 except yarn and longrope).
    """
    p = dict(rope_parameters)
    rope_type = p.get("rope_type", p.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise FormatError(f"unknown rope_type {rope_type!r}: expected one of {', '.join(ROPE_TYPES)}")
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0:
        raise ShapeError(f"head_dim must be a positive int, got {head_dim!r}")
    base = float(_need(p, rope_type, "rope_theta"))
    dim = int(head_dim * p.get("partial_rotary_factor", 1.0))
    if dim < 2:
        raise ShapeError(f"rotary dims int(head_dim * partial_rotary_factor) = {dim}, expected >= 2")
    exponents = np.arange(0, dim, 2, dtype=np.float64) / dim

    if rope_type == "dynamic":
        mpe = _need_mpe(max_position_embeddings, rope_type)
        factor = float(_need(p, rope_type, "factor"))
        seq = mpe if seq_len is None else max(seq_len, mpe)
        base = base * ((factor * seq / mpe) - (factor - 1)) ** (dim / (dim - 2))
    inv_freq = 1.0 / base ** exponents
    attention_factor = 1.0

    if rope_type == "linear":
        inv_freq /= float(_need(p, rope_type, "factor"))
    elif rope_type == "llama3":
        inv_freq = _llama3(inv_freq, p)
    elif rope_type == "yarn":
        inv_freq, attention_factor = _yarn(base, dim, exponents, p, max_position_embeddings)
    elif rope_type == "longrope":
        inv_freq, attention_factor = _longrope(base, exponents, p, max_position_embeddings, seq_len)
    inv_freq.flags.writeable = False
    return inv_freq, float(attention_factor)


def _need(p: dict[str, Any], rope_type: str, key: str) -> Any:
    if p.get(key) is None:
        raise FormatError(f"rope_parameters of rope_type {rope_type!r} need {key!r}")
    return p[key]


def _need_mpe(max_position_embeddings: int | None, rope_type: str) -> int:
    if max_position_embeddings is None:
        raise FormatError(f"rope_type {rope_type!r} needs max_position_embeddings")
    return max_position_embeddings


def _llama3(inv_freq: np.ndarray, p: dict[str, Any]) -> np.ndarray:
    """Llama 3.1: long wavelengths divided by factor, short ones kept, a smooth ramp between."""
    factor = float(_need(p, "llama3", "factor"))
    low = float(_need(p, "llama3", "low_freq_factor"))
    high = float(_need(p, "llama3", "high_freq_factor"))
    old_len = float(_need(p, "llama3", "original_max_position_embeddings"))
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
    return np.where(medium, smoothed, scaled)


def _yarn(base: float, dim: int, exponents: np.ndarray, p: dict[str, Any],
          max_position_embeddings: int | None) -> tuple[np.ndarray, float]:
    """YaRN: interpolated (divided by factor) and extrapolated tables blended by a linear
    ramp over the pairs between the beta_fast and beta_slow rotation counts."""
    original = float(_need(p, "yarn", "original_max_position_embeddings"))
    factor = p.get("factor")
    if factor is None:
        factor = _need_mpe(max_position_embeddings, "yarn") / original
    factor = float(factor)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        m, m_all = p.get("mscale"), p.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001   # as transformers: no zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    pos_freqs = base ** exponents
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, attention_factor


def _longrope(base: float, exponents: np.ndarray, p: dict[str, Any], max_position_embeddings: int | None,
              seq_len: int | None) -> tuple[np.ndarray, float]:
    """LongRoPE: per-pair factors, long_factor past the original length, short_factor below."""
    original = float(_need(p, "longrope", "original_max_position_embeddings"))
    factor = p.get("factor")
    if factor is None:
        factor = _need_mpe(max_position_embeddings, "longrope") / original
    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    key = "long_factor" if seq_len and seq_len > original else "short_factor"
    ext = np.asarray(_need(p, "longrope", key), dtype=np.float64)
    if ext.shape != exponents.shape:
        raise ShapeError(f"invalid shape of {key}: expected [{exponents.size}], got "
                         f"[{', '.join(map(str, ext.shape))}]")
    return 1.0 / (ext * base ** exponents), attention_factor
