"""gguf-py's numpy quantizers (`gguf.quants`, gguf==0.19.*) as the oracle of q4_0 / q4_1.

ggml interleaves each block's scales and codes (q4_0: 2 bytes of d, 16 bytes of codes;
q4_1: d, m, 16 bytes); kvcore keeps codes [..., D/2] and scales [..., S] apart. These
helpers convert between the two, so tests compare kvcore with gguf-py byte for byte.
"""
import numpy as np
import pytest

SCALE_BYTES = {"q4_0": 2, "q4_1": 4}


def _quant(name):
    quants = pytest.importorskip("gguf.quants")
    return {"q4_0": quants.Q4_0, "q4_1": quants.Q4_1}[name]


def gguf_rows(x, name):
    """gguf-py's bytes of x float32 [R, D] (D % 32 == 0): uint8 [R, D / 32 * block bytes]."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    with np.errstate(all="ignore"):     # gguf-py casts inf / NaN (1/d overflows) to uint8
        return _quant(name).quantize_rows(x).reshape(x.shape[0], -1)


def to_ggml(codes, scales, name):
    """kvcore's codes [R, D/2] and scales [R, S] as ggml rows: uint8 [R, D / 32 * block bytes]."""
    r, nb = codes.shape[0], codes.shape[1] // 16
    s = np.ascontiguousarray(scales).view(np.uint8).reshape(r, nb, SCALE_BYTES[name])
    c = np.ascontiguousarray(codes).view(np.uint8).reshape(r, nb, 16)
    return np.concatenate([s, c], axis=-1).reshape(r, -1)


def gguf_encode(x, name):
    """(codes uint8 [..., D/2], scales float16 [..., S]) of x float32 [..., D] by gguf-py."""
    x = np.asarray(x, dtype=np.float32)
    lead, d = x.shape[:-1], x.shape[-1]
    if x.size == 0:
        f = {"q4_0": 1, "q4_1": 2}[name]
        return np.zeros(lead + (d // 2,), np.uint8), np.zeros(lead + (f * d // 32,), np.float16)
    rows = gguf_rows(x.reshape(-1, d), name).reshape(-1, d // 32, SCALE_BYTES[name] + 16)
    scales = np.ascontiguousarray(rows[..., :SCALE_BYTES[name]]).view(np.float16)
    codes = np.ascontiguousarray(rows[..., SCALE_BYTES[name]:])
    return codes.reshape(lead + (d // 2,)), scales.reshape(lead + (-1,))


def gguf_decode(codes, scales, name):
    """float32 [..., D] of kvcore-layout codes [..., D/2] and scales [..., S], by gguf-py."""
    codes = np.asarray(codes).view(np.uint8)
    lead, w = codes.shape[:-1], codes.shape[-1]
    if codes.size == 0:
        return np.zeros(lead + (2 * w,), np.float32)
    rows = to_ggml(codes.reshape(-1, w), np.asarray(scales).reshape(-1, scales.shape[-1]), name)
    out = _quant(name).dequantize_rows(rows).astype(np.float32, copy=False)
    return out.reshape(lead + (2 * w,))
