# Types of the names kvcore/*.py use from _quant.pyx.
import numpy as np

Q8_0_LIMIT: float
Q4_0_LIMIT: float
Q4_1_LIMIT: float

def input_limit(fmt: int) -> float: ...
def max_scale(fmt: int) -> float: ...
def quantize_rows(x: np.ndarray, outer: np.ndarray, n_inner: int, inner_stride: int,
                  stride: int, in_kind: int, fmt: int, codes: np.ndarray,
                  scales: np.ndarray | None, d: int, encode: bool = True) -> int: ...
def dequantize_rows(fmt: int, codes: np.ndarray, scales: np.ndarray | None,
                    out: np.ndarray) -> None: ...
