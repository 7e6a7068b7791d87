# Types of the names kvcore/*.py use from _attention.pyx (the kernels' docstrings hold the
# shapes and dtypes).
import numpy as np

ROWS_MAX: int
ATTEND_OK: int
ATTEND_BAD_Q: int
ATTEND_OVERFLOW: int
TILE: int

def attend(q: np.ndarray, k_codes: np.ndarray, v_codes: np.ndarray, k_scales: np.ndarray | None,
           v_scales: np.ndarray | None, k_fmt: int, v_fmt: int, n: int, scale: float, causal: bool,
           out: np.ndarray, lse: np.ndarray | None = None) -> int: ...
def attend_paged(q: np.ndarray, k_codes: np.ndarray, v_codes: np.ndarray,
                 k_scales: np.ndarray | None, v_scales: np.ndarray | None, k_fmt: int,
                 v_fmt: int, page_size: int, tables: np.ndarray, lengths: np.ndarray, counts: np.ndarray,
                 scale: float, causal: bool, out: np.ndarray,
                 lse: np.ndarray | None = None) -> int: ...
def rope(x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray, neox: bool) -> None: ...
def stream_sum(buf: np.ndarray) -> int: ...
def fma_burn(rounds: int) -> int: ...
def tile_blocks(fmt: int, codes: np.ndarray, scales: np.ndarray | None, d: int, part: int, rounds: int,
                int8_scores: bool = False) -> float: ...
def quantize_query(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]: ...
