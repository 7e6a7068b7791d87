"""Accuracy of every format against float64, on the shapes of a model's cache.

    python tools/bench_accuracy.py [--positions 4096]

- round trip: `kvcore.quantize` then `kvcore.dequantize` of [positions, 8, 128] float32
  data, Gaussian and Student-t(3) (heavy-tailed, as values are); relative RMS error
  sqrt(sum (x' - x)^2 / sum x^2) in float64;
- attention: `kvcore.decode_attention` of one new token (Hq = 32, Hkv = 8, D = 128) over
  a cache of that many positions in each format, keys Gaussian with 4 channels per head
  10x larger (as real keys have), values Student-t(3), against softmax(q K^T / sqrt(D)) V
  computed in float64 from the unquantized K and V; peer: the same attention in numpy
  float32 (a plain same-precision implementation);
- K/V pairs (KVSpec(k_format=, v_format=), llama.cpp's -ctk / -ctv): the attention of a
  cache storing K in one format and V in another ("K q8_0 / V q4_0"), no round trip of
  their own (each side's is its format's row); among them KIVI's K q4_1ch (by channel
  over groups of 32 positions) / V q4_1 (per token);
- int8 scores: the attention of the int8, q8_0, q4_0 and q4_1 caches with
  `scores="int8"` (the query quantized per block of 32, integer dot products:
  docs/attention.md, "Int8 scores");
- round trip K: the attention's keys (outlier channels) through each format, q4_1ch by
  its groups of 32 positions of a head: where per-channel K beats per-token K.
  q4_1ch, a K format, has no attention row of its own (its V would be per channel).
Deterministic (seeded data): the figures do not move between runs.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _benchlib import PAIRS, print_table  # noqa: E402

import kvcore  # noqa: E402

HQ, HKV, D, OUTLIERS = 32, 8, 128, 4


def rel_rms(approx: np.ndarray, exact: np.ndarray) -> float:
    a, e = approx.astype(np.float64), exact.astype(np.float64)
    return float(np.sqrt(np.sum((a - e) ** 2) / np.sum(e ** 2)))


def round_trip(x: np.ndarray, fmt: str) -> float:
    """Relative RMS error of x [n, Hkv, D] quantized and decoded in fmt; a grouped format
    (q4_1ch) encodes groups of its 32 positions of each head."""
    group = kvcore.get_format(fmt).group
    if group:
        x = x.reshape(-1, group, HKV, D).swapaxes(1, 2)      # [n / 32, Hkv, 32, D]
    codes, scales = kvcore.quantize(x, fmt)
    return rel_rms(kvcore.dequantize(codes, scales, fmt), x)


def _attention64(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """softmax(q K^T / sqrt(D)) V in float64: q [Hq, D], k, v [n, Hkv, D] -> [Hq, D]."""
    g = HQ // HKV
    qg = q.astype(np.float64).reshape(HKV, g, D) / np.sqrt(D)
    s = np.einsum("hgd,nhd->hgn", qg, k.astype(np.float64))
    s = np.exp(s - s.max(axis=-1, keepdims=True))
    s /= s.sum(axis=-1, keepdims=True)
    return np.einsum("hgn,nhd->hgd", s, v.astype(np.float64)).reshape(HQ, D)


def _attention32(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """The same in numpy float32 (the peer)."""
    g = HQ // HKV
    qg = q.reshape(HKV, g, D) * np.float32(1 / np.sqrt(D))
    s = np.matmul(qg, k.transpose(1, 2, 0))
    s = np.exp(s - s.max(axis=-1, keepdims=True))
    s /= s.sum(axis=-1, keepdims=True)
    return np.matmul(s, v.transpose(1, 0, 2)).reshape(HQ, D)


def measure(positions: int = 4096) -> dict[str, dict[str, float]]:
    """{row name: {"round trip gauss", "round trip t(3)", "round trip K", "attention"}:
    relative RMS}."""
    rng = np.random.default_rng(0)
    gauss = rng.standard_normal((positions, HKV, D)).astype(np.float32)
    heavy = rng.standard_t(3, (positions, HKV, D)).astype(np.float32)
    q = rng.standard_normal((HQ, D)).astype(np.float32)
    k = rng.standard_normal((positions, HKV, D)).astype(np.float32)
    for h in range(HKV):
        k[:, h, rng.choice(D, OUTLIERS, replace=False)] *= 10
    v = rng.standard_t(3, (positions, HKV, D)).astype(np.float32)
    ref = _attention64(q, k, v)
    out: dict[str, dict[str, float]] = {}
    for fmt in (*kvcore.FORMATS, *PAIRS):
        row = {}
        if fmt in kvcore.FORMATS:
            for label, x in (("round trip gauss", gauss), ("round trip t(3)", heavy),
                             ("round trip K", k)):
                row[label] = round_trip(x, fmt)
        if fmt in kvcore.FORMATS and fmt not in kvcore.formats.ROW_FORMATS:   # K only
            out[f"kvcore {fmt}"] = row
            continue
        spec = kvcore.KVSpec(num_layers=1, num_kv_heads=HKV, head_dim=D, capacity=positions,
                             num_heads=HQ, format=fmt)
        cache = kvcore.KVCache(spec)
        cache.append(0, k, v)
        cache.advance()
        row["attention"] = rel_rms(kvcore.decode_attention(q, cache, 0), ref)
        name = fmt if not spec.paired else f"K {spec.k_format} / V {spec.v_format}"
        out[f"kvcore {name}"] = row
        if fmt in ("int8", "q8_0", "q4_0", "q4_1"):
            out[f"kvcore {fmt} scores=int8"] = {"attention": rel_rms(
                kvcore.decode_attention(q, cache, 0, scores="int8"), ref)}
    out["numpy f32 attention"] = {"attention": rel_rms(_attention32(q, k, v), ref)}
    return out


def main(argv: Sequence[str] = ()) -> dict[str, dict[str, float]]:
    """Prints the table and returns the figures (tools/bench_cpu.py --plot draws them)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--positions", type=int, default=4096)
    args = parser.parse_args(argv)
    res = measure(args.positions)
    cols = ["round trip gauss", "round trip t(3)", "round trip K", "attention"]
    print_table(f"Accuracy against float64: relative RMS error, {args.positions} positions, "
                f"Hq={HQ}, Hkv={HKV}, D={D}", ["implementation"] + cols,
                [[name] + [f"{row[c]:.2e}" if c in row else "-" for c in cols]
                 for name, row in res.items()])
    return res


if __name__ == "__main__":
    main(sys.argv[1:])
