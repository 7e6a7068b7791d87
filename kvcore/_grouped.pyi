# Types of the names kvcore/*.py use from _grouped.pyx (its docstrings hold the shapes).
import numpy as np

def attend_grouped(q: np.ndarray, k_codes: np.ndarray, k_scales: np.ndarray,
                   residual: np.ndarray, v_codes: np.ndarray, v_scales: np.ndarray | None,
                   v_fmt: int, n: int, scale: float, causal: bool, out: np.ndarray,
                   lse: np.ndarray | None = None) -> None: ...
