"""apply_rope against a float64 numpy reference."""
import numpy as np
import pytest

from kvcore import DTypeError, FormatError, ShapeError, apply_rope


def reference(x, positions, theta, style, rotary_dim):
    x = x.astype(np.float64)
    r = rotary_dim
    inv = theta ** (-np.arange(0, r, 2, dtype=np.float64) / r)          # [R/2]
    ang = np.asarray(positions, np.float64).reshape(-1)[:, None] * inv   # [T, R/2]
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    ia = np.arange(r // 2) if style == "neox" else np.arange(0, r, 2)
    ib = ia + r // 2 if style == "neox" else ia + 1
    out = x.copy()
    out[..., ia] = x[..., ia] * c - x[..., ib] * s
    out[..., ib] = x[..., ia] * s + x[..., ib] * c
    return out


@pytest.mark.parametrize("style", ["neox", "norm"])
@pytest.mark.parametrize("rotary_dim", [None, 32])
@pytest.mark.parametrize("theta", [10000.0, 500000.0])
def test_against_float64(rng, style, rotary_dim, theta):
    positions = np.array([0, 1, 100000, 7, 4095], np.int64)
    x = rng.standard_normal((5, 6, 128)).astype(np.float32)
    r = 128 if rotary_dim is None else rotary_dim
    expect = reference(x, positions, theta, style, r)
    got = apply_rope(x, positions, theta=theta, style=style, rotary_dim=rotary_dim)
    assert got is x
    np.testing.assert_allclose(x, expect, rtol=0, atol=2e-6 * np.abs(expect).max())
    np.testing.assert_array_equal(x[0], expect[0].astype(np.float32))  # position 0: identity
    if rotary_dim is not None:
        np.testing.assert_array_equal(x[..., r:], expect[..., r:].astype(np.float32))


def test_one_token_and_strided(rng):
    x = rng.standard_normal((8, 64)).astype(np.float32)
    expect = reference(x[None], [100000], 10000.0, "norm", 64)[0]
    apply_rope(x, 100000, style="norm")
    np.testing.assert_allclose(x, expect, rtol=0, atol=2e-6 * np.abs(expect).max())
    big = rng.standard_normal((3, 4, 2, 64)).astype(np.float32)
    view = big[:, :, 1, :]                              # [3, 4, 64], non-contiguous
    expect = reference(view, [1, 2, 3], 10000.0, "neox", 64)
    apply_rope(view, np.array([1, 2, 3], np.int32))
    np.testing.assert_allclose(big[:, :, 1, :], expect, rtol=0, atol=2e-6 * np.abs(expect).max())


@pytest.mark.parametrize("style", ["neox", "norm"])
@pytest.mark.parametrize("layout", ["every other", "reversed", "many tokens"])
def test_any_last_axis_stride(rng, style, layout):
    # element strides other than one float (the kernel's byte-stride path), and enough
    # tokens for the threaded path
    t = 600 if layout == "many tokens" else 3
    big = rng.standard_normal((t, 4, 128)).astype(np.float32)
    x, rest = {"every other": (big[:, :, ::2], big[:, :, 1::2]),
               "reversed": (big[:, :, 64:][:, :, ::-1], big[:, :, :64]),
               "many tokens": (big[:, :, :64], big[:, :, 64:])}[layout]
    positions = rng.integers(0, 200000, t)
    expect = reference(x, positions, 10000.0, style, 64)
    untouched = rest.copy()
    apply_rope(x, positions, style=style)
    np.testing.assert_allclose(x, expect, rtol=0, atol=2e-6 * np.abs(expect).max())
    np.testing.assert_array_equal(rest, untouched)  # the values around x are not written


def test_errors():
    x = np.zeros((2, 4, 16), np.float32)
    with pytest.raises(ShapeError, match=r"rotary_dim must be an even int in \[2, 16\], got 7"):
        apply_rope(x, [0, 1], rotary_dim=7)
    with pytest.raises(ShapeError, match=r"rotary_dim must be an even int in \[2, 16\], got 18"):
        apply_rope(x, [0, 1], rotary_dim=18)
    with pytest.raises(FormatError, match="unknown rope style 'gptj'"):
        apply_rope(x, [0, 1], style="gptj")
    with pytest.raises(DTypeError, match="invalid dtype of x: expected float32, got float64"):
        apply_rope(x.astype(np.float64), [0, 1])
    with pytest.raises(DTypeError, match="invalid dtype of positions: expected an integer type"):
        apply_rope(x, [0.0, 1.0])
    with pytest.raises(ShapeError, match=r"invalid shape of positions: expected \[2\], got \[3\]"):
        apply_rope(x, [0, 1, 2])
    with pytest.raises(ShapeError, match="x must be writable"):
        ro = x.copy()
        ro.flags.writeable = False
        apply_rope(ro, [0, 1])
