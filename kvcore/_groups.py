"""The open group of a K format encoded by channel over groups of positions (q4_1ch).

q4_1ch encodes the 32 positions of a group of one head together (docs/formats.md,
q4_1ch), so a group's codes are written once its last position is there. Until then its
K values wait in the sequence's **residual**: float16 [L][G][Hkv][D] (G = 32), slot
p % G holding the K of position p, rounded to float16 (whose range holds every value
q4_1ch takes: |x| < 65520). Per layer the residual holds one group, `held[layer]` its
first position (-1: none): the open group of the layer's last written position; once a
group completes it is read from its codes only (as on the GPU, whose residual slots the
next group reuses). An append that completes a group encodes it from the residual into its G
row slots; decode attention and `dequantize` read complete groups from the codes and the
open group from the residual.

A truncation into a group that the residual does not hold decodes that group from its
codes into the residual: the positions kept there then hold their decoded values (what
attention read), rounded to float16, and are encoded again when the group completes anew.

The group's rows in storage are given by the caller, `row(p)`: the storage row of
position p (a KVCache's rows are its positions; a KVPool's come from the page table, and
its pages hold whole groups: page_size % G == 0, so a group's rows are consecutive).
"""
from __future__ import annotations

from typing import Callable, cast

import numpy as np

from ._validate import AnyArray, check_ndarray, check_values
from .formats import Format
from .quant import dequantize, quantize
from .spec import KVSpec

Rows = Callable[[int], int]
"""The storage row of a position (the first of a group: its G rows follow it)."""


class KeyGroups:
    """The residual of one sequence's K and the encoding of its groups (module comment).
    The K regions passed in are one layer's: codes uint8 [rows, Hkv, D/2], scales float16
    [rows, Hkv, D/16]."""

    __slots__ = ("fmt", "residual", "held")

    def __init__(self, spec: KVSpec):
        self.fmt = spec.k_fmt
        self.residual = np.zeros((spec.num_layers, self.fmt.group, spec.num_kv_heads,
                                  spec.head_dim), np.float16)
        self.held = [-1] * spec.num_layers

    def copy(self) -> KeyGroups:
        """An independent copy (a fork's, a copied cache's)."""
        new = KeyGroups.__new__(KeyGroups)
        new.fmt, new.residual, new.held = self.fmt, self.residual.copy(), list(self.held)
        return new

    def write(self, layer: int, pos: int, k: AnyArray, codes: np.ndarray, scales: np.ndarray,
              row: Rows) -> None:
        """K of positions [pos, pos + T) of `layer` into the residual, encoding each
        group it completes. k: [T, Hkv, D] or [Hkv, D], float32/float16/bfloat16, any
        strides, already checked (finite, below the format's limit) by the append."""
        x = k if k.__class__ is np.ndarray else check_ndarray("k", k)
        if x.ndim == 2:
            x = x[None]
        G, res = self.fmt.group, self.residual[layer]   # assignments round to float16
        t = 0
        while t < len(x):
            slot = (pos + t) % G
            take = min(G - slot, len(x) - t)
            res[slot:slot + take] = x[t:t + take]
            self.held[layer] = pos + t - slot
            t += take
            if slot + take == G:
                first = row(self.held[layer])
                c, s = quantize(res.swapaxes(0, 1), self.fmt)  # [Hkv, G, W], [Hkv, G, S]
                codes[first:first + G] = c.swapaxes(0, 1)
                scales[first:first + G] = cast(np.ndarray, s).swapaxes(0, 1)
                self.held[layer] = -1       # complete: read from its codes from now on

    def truncate(self, layer: int, n: int, codes: np.ndarray, scales: np.ndarray,
                 row: Rows) -> None:
        """The layer now holds positions [0, n), n <= its old end: the residual then
        holds the open group of n, decoded from its codes when it held another group."""
        G = self.fmt.group
        start = n - n % G
        if n % G and self.held[layer] != start:
            self.residual[layer] = self._decode(start, codes, scales, row)
            self.held[layer] = start

    def _decode(self, start: int, codes: np.ndarray, scales: np.ndarray, row: Rows) -> np.ndarray:
        """float32 [G, Hkv, D]: the complete group starting at position `start`."""
        first, G = row(start), self.fmt.group
        group = dequantize(codes[first:first + G].swapaxes(0, 1),
                           scales[first:first + G].swapaxes(0, 1), self.fmt)   # [Hkv, G, D]
        return group.swapaxes(0, 1)

    def open_group(self, layer: int, n: int, codes: np.ndarray, scales: np.ndarray,
                   row: Rows) -> np.ndarray:
        """float16 [n % G, Hkv, D], a new array: K of the open group of positions [0, n)
        (n <= the layer's end), from the residual, or decoded from the codes when the
        residual holds another group (a snapshot of fewer positions)."""
        G = self.fmt.group
        start = n - n % G
        if n == start or self.held[layer] == start:
            return self.residual[layer, :n - start].copy()
        return self._decode(start, codes, scales, row)[:n - start].astype(np.float16)

    def restore(self, n: int, open_values: np.ndarray) -> None:
        """Every layer now holds positions [0, n), the open group's K open_values
        float16 [L, n % G, Hkv, D] (a snapshot's)."""
        G = self.fmt.group
        self.residual[:, :n % G] = open_values
        self.held = [n - n % G if n % G else -1] * len(self.held)

    def dequantize(self, layer: int, spans: list[tuple[int, int]], codes: np.ndarray,
                   scales: np.ndarray, row: Rows, out: np.ndarray) -> None:
        """OUT out float32 [N, Hkv, D]: K of the positions of spans ([start, stop) ranges
        in order, N positions in all; each starts a group, as a windowed pool's held
        ranges do), complete groups decoded from the codes, the open group from the
        residual."""
        G, at = self.fmt.group, 0
        merged: list[tuple[int, int]] = []
        for a, b in spans:
            if merged and merged[-1][1] == a:
                merged[-1] = (merged[-1][0], b)
            elif b > a:
                merged.append((a, b))
        for a, b in merged:
            full = b - (b - a) % G
            for start in range(a, full, G):
                out[at:at + G] = self._decode(start, codes, scales, row)
                at += G
            out[at:at + b - full] = self.residual[layer, :b - full]
            at += b - full

def decode_positions(codes: np.ndarray, scales: np.ndarray, residual: np.ndarray,
                     fmt: Format) -> np.ndarray:
    """float32 [n, Hkv, D]: K of n positions from a grouped format's rows in position
    order (a snapshot's): codes uint8 [n, Hkv, D/2] and scales float16 [n, Hkv, D/16]
    (the complete groups' rows), residual float16 [n % G, Hkv, D] (the open group)."""
    n, G = len(codes), fmt.group
    full = n - n % G
    out = np.empty((n,) + residual.shape[1:], np.float32)
    if full:
        _by_group(out, full, G)[...] = dequantize(_by_group(codes, full, G),
                                                  _by_group(scales, full, G), fmt)
    out[full:] = residual
    return out


def encode_positions(x: np.ndarray, fmt: Format) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A grouped format's (codes uint8 [n, Hkv, D/2], scales float16 [n, Hkv, D/16],
    residual float16 [n % G, Hkv, D]) of x float32 [n, Hkv, D] in position order, as
    appends would store them: rounded to float16, complete groups encoded from those
    (the open group's rows of codes and scales are zeros). FormatError / NonFiniteError
    for a value q4_1ch refuses."""
    check_values("x", x, fmt)
    n, G = len(x), fmt.group
    full = n - n % G
    x16 = x.astype(np.float16)
    codes = np.zeros(x.shape[:2] + (fmt.code_width(x.shape[2]),), fmt.code_dtype)
    scales = np.zeros(x.shape[:2] + (fmt.scales_per_row(x.shape[2]),), np.float16)
    if full:
        c, s = quantize(_by_group(x16, full, G), fmt)
        _by_group(codes, full, G)[...] = c
        _by_group(scales, full, G)[...] = cast(np.ndarray, s)
    return codes, scales, x16[full:]


def _by_group(a: np.ndarray, full: int, G: int) -> np.ndarray:
    """Rows [0, full) of a [n, Hkv, X] as its groups [full / G, Hkv, G, X] (a view)."""
    return a[:full].reshape((full // G, G) + a.shape[1:]).swapaxes(1, 2)
