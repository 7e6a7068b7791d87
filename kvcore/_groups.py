"""The open group of a K format encoded by channel over groups of positions (q4_1ch).

q4_1ch encodes the 32 positions of a group of one head together (docs/formats.md,
q4_1ch), so a group's codes are written once its last position is there. Until then its
K values wait in the **residual**: float16 [L][G][Hkv][D] (G = 32), slot p % G holding
the K of position p, rounded to float16 (whose range holds every value q4_1ch takes:
|x| < 65520). Each layer's residual holds the group of the layer's last held position,
open or just completed. An append that completes a group encodes it from the residual
into its G row slots; decode attention and `dequantize` read complete groups from the
codes and the open group from the residual.

A truncation into a group that the residual no longer holds decodes that group from its
codes into the residual: the positions kept there then hold their decoded values (what
attention read for them), rounded to float16, and are encoded again when the group
completes anew.
"""
from __future__ import annotations

from typing import cast

import numpy as np

from ._storage import Storage
from ._validate import AnyArray, check_ndarray
from .quant import dequantize, quantize
from .spec import KVSpec


class KeyGroups:
    """The residual of one sequence's K (module comment), and the encoding of its
    groups into the K regions of its storage (rows = positions: a KVCache's)."""

    def __init__(self, spec: KVSpec, store: Storage, residual: np.ndarray | None = None):
        """store: the storage whose K regions (codes uint8 [L, N, Hkv, D/2], scales
        float16 [L, N, Hkv, D/16]) hold the complete groups; residual: float16
        [L, G, Hkv, D] to take over (a copy's), else zeros."""
        self.fmt = spec.k_fmt
        self.codes, self.scales = store.regions["k_codes"], store.regions["k_scales"]
        shape = (spec.num_layers, self.fmt.group, spec.num_kv_heads, spec.head_dim)
        self.residual = np.zeros(shape, np.float16) if residual is None else residual

    def write(self, layer: int, pos: int, k: AnyArray) -> None:
        """K of positions [pos, pos + T) of `layer` into the residual, encoding each
        group it completes. k: [T, Hkv, D] or [Hkv, D], float32/float16/bfloat16, any
        strides, already checked (finite, below the format's limit) by the append."""
        x = check_ndarray("k", k)
        x = x.reshape((-1,) + self.residual.shape[2:]).astype(np.float16, copy=False)
        G, res = self.fmt.group, self.residual[layer]
        t = 0
        while t < len(x):
            slot = (pos + t) % G
            take = min(G - slot, len(x) - t)
            res[slot:slot + take] = x[t:t + take]
            t += take
            if slot + take == G:
                self._encode(layer, pos + t - G)

    def _encode(self, layer: int, start: int) -> None:
        """The layer's residual, a complete group, into rows [start, start + G)."""
        rows = slice(start, start + self.fmt.group)
        codes, scales = quantize(self.residual[layer].swapaxes(0, 1), self.fmt)
        self.codes[layer, rows] = codes.swapaxes(0, 1)       # [Hkv, G, W] -> [G, Hkv, W]
        self.scales[layer, rows] = cast(np.ndarray, scales).swapaxes(0, 1)   # q4_1ch has scales

    def truncate(self, layer: int, end: int, n: int) -> None:
        """The layer keeps positions [0, n) of [0, end): its residual then holds the
        group of position n - 1, decoded from its codes when it held another one."""
        G = self.fmt.group
        start = (n - 1) // G * G
        if n == 0 or start == (end - 1) // G * G:
            return
        rows = slice(start, start + G)
        group = dequantize(self.codes[layer, rows].swapaxes(0, 1),
                           self.scales[layer, rows].swapaxes(0, 1), self.fmt)   # [Hkv, G, D]
        self.residual[layer] = group.swapaxes(0, 1)

    def dequantize(self, layer: int, n: int, out: np.ndarray) -> None:
        """OUT out float32 [n, Hkv, D]: K of positions [0, n) of the layer, complete
        groups decoded from the codes, the open group from the residual."""
        G = self.fmt.group
        full = n - n % G
        if full:
            codes, scales = self.codes[layer], self.scales[layer]
            _by_group(out, full, G)[...] = dequantize(_by_group(codes, full, G),
                                                      _by_group(scales, full, G), self.fmt)
        out[full:n] = self.residual[layer, :n - full]


def _by_group(a: np.ndarray, full: int, G: int) -> np.ndarray:
    """Rows [0, full) of a [N, Hkv, X] as its groups [full / G, Hkv, G, X] (a view)."""
    return a[:full].reshape((full // G, G) + a.shape[1:]).swapaxes(1, 2)
