"""Typed (issue 18, item 2): kvcore ships py.typed and its public API type-checks under
`mypy --strict` (the top-level modules, as `[tool.mypy]` in pyproject.toml says), and a
user's code that calls it is checked against its hints: numpy arrays and DLPack arrays
pass, a list where an array goes does not."""
import glob
import os
import subprocess
import sys
import textwrap
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

USER_CODE = '''
from typing import Any

import numpy as np

import kvcore


class Tensor:
    """torch.Tensor's DLPack methods, as torch declares them."""
    def __dlpack__(self, *, stream: Any | None = -1, max_version: tuple[int, int] | None = None,
                   dl_device: Any = None, copy: bool | None = None) -> Any:
        return None

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)


spec = kvcore.KVSpec(num_layers=1, num_kv_heads=2, head_dim=64, capacity=8, format="int8")
cache = kvcore.KVCache(spec)
cache.append(0, np.zeros((2, 64), np.float32), Tensor())
out: np.ndarray = kvcore.decode_attention(np.zeros((2, 64), np.float32), cache, 0)
o, lse = kvcore.decode_attention(Tensor(), cache, 0, return_lse=True)
t: Tensor | np.ndarray = kvcore.decode_attention(Tensor(), cache, 0, out=Tensor())
codes, scales = kvcore.quantize(memoryview(b"x"), "int8")
x: Tensor = kvcore.apply_rope(Tensor(), 3)
n: int = kvcore.KVPool(spec, num_pages=4).csr([0], Tensor(), Tensor(), Tensor())
kvcore.quantize([1.0, 2.0], "int8")  # type: ignore[arg-type]
kvcore.dequantize(codes, scales, "int8", out=3)  # type: ignore[arg-type]
'''


def test_py_typed_ships():
    assert os.path.isfile(os.path.join(ROOT, "kvcore", "py.typed"))
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        assert '"py.typed", "*.pyi"' in f.read()


def test_mypy_strict_passes(tmp_path):
    """One mypy run over kvcore/*.py (strict) and a user's file. The user file's two bad
    calls carry `type: ignore` comments: strict mypy reports an ignore that silences
    nothing, so a hint loosened to accept them fails this test too."""
    pytest.importorskip("mypy")
    user = tmp_path / "user_code.py"
    user.write_text(textwrap.dedent(USER_CODE))
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "cache"),
                        *sorted(glob.glob("kvcore/*.py", root_dir=ROOT)), str(user)], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    took = time.perf_counter() - t0
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Success: no issues found" in r.stdout
    assert took < 60, f"mypy took {took:.0f} s"
