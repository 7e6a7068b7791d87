# Types of the names kvcore/*.py use from _grouped.pyx (its docstrings hold the shapes).
import numpy as np

def attend_grouped(q: np.ndarray, k_codes: np.ndarray, k_scales: np.ndarray,
                   residuals: np.ndarray, v_codes: np.ndarray, v_scales: np.ndarray | None,
                   v_fmt: int, page_size: int, tables: np.ndarray, lengths: np.ndarray,
                   counts: np.ndarray, scale: float, causal: bool, out: np.ndarray,
                   lse: np.ndarray | None = None, *, window: int = 0, sink_tokens: int = 0,
                   sinks: np.ndarray | None = None, softcap: float = 0.0) -> None: ...
