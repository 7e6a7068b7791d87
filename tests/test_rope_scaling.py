"""RoPE as models use it: kvcore.rope_frequencies against transformers' own
ROPE_INIT_FUNCTIONS for every scaling type, and apply_rope with a model's table and
attention factor against a float64 rotation at positions up to 128k. Without torch and
transformers (the GPU image has no transformers) the module skips."""
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from transformers import LlamaConfig  # noqa: E402
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

import kvcore  # noqa: E402

HEAD_DIM = 128
MPE = 131072
POSITIONS = np.array([0, 1, 4095, 5000, 8191, 8192, 32767, 65536, 100003, 131071])
# (rope_parameters, max_position_embeddings, seq_len)
CASES = {
    "default": ({"rope_type": "default", "rope_theta": 10000.0}, MPE, None),
    "linear": ({"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}, MPE, None),
    "dynamic": ({"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}, 4096, 3 * 4096 + 5),
    "dynamic-short": ({"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}, 4096, 100),
    "llama3": ({"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}, MPE, None),
    "yarn": ({"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
              "original_max_position_embeddings": 32768}, MPE, None),
    "yarn-mscale": ({"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                     "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
                     "mscale": 1.0, "mscale_all_dim": 0.707}, MPE, None),
    "yarn-partial": ({"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 8.0,
                      "original_max_position_embeddings": 16384, "attention_factor": 1.2,
                      "partial_rotary_factor": 0.5, "truncate": False}, MPE, None),
    "longrope-long": ({"rope_type": "longrope", "rope_theta": 10000.0,
                       "original_max_position_embeddings": 4096,
                       "short_factor": list(np.linspace(1.0, 1.5, 64)),
                       "long_factor": list(np.linspace(1.0, 40.0, 64))}, MPE, 9000),
    "longrope-short": ({"rope_type": "longrope", "rope_theta": 10000.0,
                        "original_max_position_embeddings": 4096,
                        "short_factor": list(np.linspace(1.0, 1.5, 64)),
                        "long_factor": list(np.linspace(1.0, 40.0, 64))}, MPE, 1000),
}


def _hf(params, mpe, seq_len):
    """transformers' own table (float32) and attention factor for these parameters."""
    cfg = LlamaConfig(hidden_size=HEAD_DIM * 4, num_attention_heads=4, head_dim=HEAD_DIM,
                      max_position_embeddings=mpe, rope_parameters=dict(params))
    fn = (ROPE_INIT_FUNCTIONS.get(params["rope_type"]) or
          (lambda c, d, seq_len=None: _default_hf(c)))
    inv_freq, factor = fn(cfg, "cpu", seq_len=seq_len)
    return inv_freq.double().numpy(), factor


def _default_hf(cfg):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    return LlamaRotaryEmbedding.compute_default_rope_parameters(cfg)


@pytest.mark.parametrize("case", list(CASES))
def test_tables_match_transformers(case):
    params, mpe, seq_len = CASES[case]
    inv_freq, factor = kvcore.rope_frequencies(params, HEAD_DIM, max_position_embeddings=mpe,
                                               seq_len=seq_len)
    want, want_factor = _hf(params, mpe, seq_len)
    assert inv_freq.dtype == np.float64 and inv_freq.shape == want.shape
    # transformers computes in float32: equal within a few float32 ulps
    np.testing.assert_allclose(inv_freq, want, rtol=8 * np.finfo(np.float32).eps, atol=0)
    assert factor == pytest.approx(want_factor, rel=1e-12)


def test_scaled_tables_differ_from_theta():
    """Why the table is needed: llama3's table turns the low-frequency pairs 8x slower,
    so a theta-only rotation is radians off at positions >= 5000."""
    inv_freq, _ = kvcore.rope_frequencies(CASES["llama3"][0], HEAD_DIM)
    plain = 500000.0 ** (-np.arange(0, HEAD_DIM, 2) / HEAD_DIM)
    assert (5000 * np.abs(plain - inv_freq)).max() > 1.0


def _rotate64(x, positions, inv_freq, factor, neox=True):
    """float64 reference: rotate the first R dims of x [T, H, D], multiply them by factor."""
    x = x.astype(np.float64)
    half = inv_freq.size
    ang = positions[:, None].astype(np.float64) * inv_freq[None, :]        # [T, R/2]
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    out = x.copy()
    if neox:
        a, b = x[..., :half], x[..., half:2 * half]
        out[..., :half], out[..., half:2 * half] = a * c - b * s, b * c + a * s
    else:
        a, b = x[..., 0:2 * half:2], x[..., 1:2 * half:2]
        out[..., 0:2 * half:2], out[..., 1:2 * half:2] = a * c - b * s, b * c + a * s
    out[..., :2 * half] *= factor
    return out


@pytest.mark.parametrize("case", ["llama3", "yarn-mscale", "yarn-partial", "dynamic", "longrope-long"])
@pytest.mark.parametrize("style", ["neox", "norm"])
def test_apply_rope_with_a_model_table(case, style, rng):
    params, mpe, seq_len = CASES[case]
    inv_freq, factor = kvcore.rope_frequencies(params, HEAD_DIM, max_position_embeddings=mpe,
                                               seq_len=seq_len)
    x = rng.standard_normal((POSITIONS.size, 3, HEAD_DIM)).astype(np.float32)
    want = _rotate64(x, POSITIONS, inv_freq, factor, neox=style == "neox")
    got = kvcore.apply_rope(x.copy(), POSITIONS, inv_freq=inv_freq, attention_factor=factor,
                            style=style)
    bound = 4 * np.finfo(np.float32).eps * np.abs(x).max() * max(factor, 1.0)
    assert np.abs(got - want).max() <= bound
    # the unrotated dims past R are left alone (partial rotary)
    R = 2 * inv_freq.size
    assert np.array_equal(got[..., R:], x[..., R:])


def test_apply_rope_matches_transformers_rotation():
    """transformers' own rotation of a YaRN model (its LlamaRotaryEmbedding table and
    attention scaling, its apply_rotary_pos_emb, angles taken in float64) equals
    apply_rope with rope_frequencies, to the float32 rounding of transformers' table."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb
    params = CASES["yarn"][0]
    cfg = LlamaConfig(hidden_size=HEAD_DIM * 4, num_attention_heads=4, head_dim=HEAD_DIM,
                      max_position_embeddings=MPE, rope_parameters=dict(params))
    emb = LlamaRotaryEmbedding(cfg)
    hf_table = emb.inv_freq.double()
    angles = torch.from_numpy(POSITIONS).double()[:, None] * hf_table[None, :]
    angles = torch.cat((angles, angles), dim=-1)[None]                   # [1, T, D]
    cos, sin = angles.cos() * emb.attention_scaling, angles.sin() * emb.attention_scaling
    x = torch.randn(1, 2, POSITIONS.size, HEAD_DIM, dtype=torch.float64,
                    generator=torch.Generator().manual_seed(0)).float().double()
    want, _ = apply_rotary_pos_emb(x, x, cos, sin)                       # [1, H, T, D]
    inv_freq, factor = kvcore.rope_frequencies(params, HEAD_DIM)
    assert factor == emb.attention_scaling and factor > 1
    got = kvcore.apply_rope(x[0].transpose(0, 1).float().numpy().copy(), POSITIONS,
                            inv_freq=inv_freq, attention_factor=factor)
    # the tables differ by float32 rounding: |d angle| <= position * |d inv_freq|
    dangle = (POSITIONS[:, None] * np.abs(hf_table.numpy() - inv_freq)[None]).max()
    err = np.abs(got - want[0].transpose(0, 1).numpy()).max()
    assert err <= (dangle + 8 * np.finfo(np.float32).eps) * factor * x.abs().max().item()


def test_bad_tables_refused(rng):
    x = rng.standard_normal((2, 1, 8)).astype(np.float32)
    before = x.copy()
    with pytest.raises(kvcore.DTypeError, match="inv_freq"):
        kvcore.apply_rope(x, np.arange(2), inv_freq=np.ones(4, np.float32))
    with pytest.raises(kvcore.ShapeError, match=r"inv_freq: expected \[2\]"):
        kvcore.apply_rope(x, np.arange(2), inv_freq=np.ones(4), rotary_dim=4)
    with pytest.raises(kvcore.NonFiniteError, match="inv_freq"):
        kvcore.apply_rope(x, np.arange(2), inv_freq=np.array([1.0, math.nan, 0.5, 0.1]))
    with pytest.raises(kvcore.RangeError, match="attention_factor"):
        kvcore.apply_rope(x, np.arange(2), inv_freq=np.ones(4), attention_factor=0.0)
    with pytest.raises(kvcore.RangeError, match="float32 range"):
        kvcore.apply_rope(x, np.arange(2), inv_freq=np.ones(4), attention_factor=1e39)
    assert np.array_equal(x, before)
    with pytest.raises(kvcore.FormatError, match="unknown rope_type"):
        kvcore.rope_frequencies({"rope_type": "ntk-by-parts", "rope_theta": 1e4}, 64)
    with pytest.raises(kvcore.FormatError, match="low_freq_factor"):
        kvcore.rope_frequencies({"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}, 64)
    with pytest.raises(kvcore.FormatError, match="max_position_embeddings"):
        kvcore.rope_frequencies({"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}, 64)
    # R = 2 * len(inv_freq) by default: only the first 4 dims turn
    y = x.copy()
    kvcore.apply_rope(y, np.array([3, 7]), inv_freq=np.array([1.0, 0.25]))
    assert np.array_equal(y[..., 4:], x[..., 4:]) and not np.array_equal(y[..., :4], x[..., :4])
