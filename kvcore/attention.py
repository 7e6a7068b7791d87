"""decode_attention, merge_attention and apply_rope: validation and output allocation
around the kernels of _attention.pyx (docs/attention.md describes the kernel)."""
from __future__ import annotations

import functools
import math
from typing import Any, Literal, NamedTuple, Sequence, cast, overload

import numpy as np

from . import _attention, _grouped
from ._groups import KeyGroups
from ._pages import Batch
from ._storage import LayerArrays
from ._validate import (AnyArray, OutArray, check_dtype, check_index, check_ndarray, check_out,
                        check_seq_ids, check_shape, float_input_dtypes, is_array)
from .formats import Format
from .spec import KVSpec
from .cache import KVCache
from .errors import (DTypeError, FormatError, NonFiniteError, OutOfRangeError, RangeError,
                     ShapeError, StateError)
from .pool import KVPool, _counts

ROPE_STYLES = ("neox", "norm")


@overload
def decode_attention(q: AnyArray, cache: KVCache | KVPool, layer: int, *,
                     seqs: Sequence[int] | None = None,
                     counts: Sequence[int] | AnyArray | None = None,
                     scale: float | None = None, causal: bool = True,
                     out: OutArray | None = None,
                     return_lse: Literal[False] = False, window: int | None = None,
                     sink_tokens: int = 0, sinks: AnyArray | None = None,
                     softcap: float | None = None,
                     scores: Literal["float32", "int8"] = "float32") -> np.ndarray | OutArray: ...
@overload
def decode_attention(q: AnyArray, cache: KVCache | KVPool, layer: int, *,
                     seqs: Sequence[int] | None = None,
                     counts: Sequence[int] | AnyArray | None = None,
                     scale: float | None = None, causal: bool = True,
                     out: OutArray | None = None,
                     return_lse: Literal[True], window: int | None = None,
                     sink_tokens: int = 0, sinks: AnyArray | None = None,
                     softcap: float | None = None,
                     scores: Literal["float32", "int8"] = "float32"
                     ) -> tuple[np.ndarray | OutArray, np.ndarray]: ...
def decode_attention(q: AnyArray, cache: KVCache | KVPool, layer: int, *,
                     seqs: Sequence[int] | None = None,
                     counts: Sequence[int] | AnyArray | None = None,
                     scale: float | None = None, causal: bool = True,
                     out: OutArray | None = None,
                     return_lse: bool = False, window: int | None = None,
                     sink_tokens: int = 0, sinks: AnyArray | None = None,
                     softcap: float | None = None,
                     scores: Literal["float32", "int8"] = "float32") -> Any:
    """Attention of new tokens' queries over one layer of a KVCache or of sequences of a
    KVPool, read in the storage's own format.

    KVCache: q float32 [Hq, D] (one new token) or [T, Hq, D] (T new tokens), any strides;
    the layer's n = length + pending(layer) positions are attended.
    KVPool: seqs (B sequence ids, each once); q float32 [B, Hq, D] (one new token per
    sequence) or, with counts (B ints >= 0), [sum counts, Hq, D]: rows [c_b, c_b +
    counts[b]) (c_b the sum of the counts before b) are sequence b's tokens; sequence b
    attends its n_b = length + pending(layer) positions, read through its pages.
    Causal: token t of T new tokens sees positions [0, n - T + t] (the new tokens are the
    last T positions: chunked prefill, speculative verification); causal=False: all n.
    scale: a finite positive float32 (defaults to 1 / sqrt(D)). out: float32 of q's
    shape, C-contiguous, outside the storage, written and returned (may be q itself);
    allocated when None.
    Returns out, or (out, lse) with return_lse: lse float32 of q's shape without D, the
    natural-log log-sum-exp of each row's scaled scores (merge_attention's input).
    Variants (docs/variants.md; all off by default, and a call without them computes what
    it always did, bit for bit):
    window: an int W >= 1, causal only: the token at position p sees (p - W, p].
    sink_tokens: an int S >= 0, with a window: positions [0, S) stay visible too (j <= p).
    sinks: [Hq] float32 (float16/bfloat16 converted), finite: a logit per query head that
    joins the softmax's denominator (and lse) and adds no value.
    softcap: a finite float c > 0: every score s becomes c * tanh(s / c).
    scores: "float32" (the default: float32 arithmetic on the decoded K values) or
    "int8", opt-in, for K stored as int8, q8_0, q4_0 or q4_1: each scaled query row is
    quantized per block of 32 values (q8_0's blocks, float32 scales) and its scores are
    integer dot products with K's codes (VNNI where the CPU has it), so the result is the
    attention of the quantized queries; its error bound is in docs/attention.md, "Int8 scores".
    Raises RangeError (out untouched) when scale * q, a score or the weighted sum of V
    would pass the float32 range. A pool sequence's rows equal, bit for bit, this call on
    a KVCache holding the same positions with the same thread count (docs/attention.md).
    """
    if isinstance(cache, KVPool):
        with cache._guard("decode_attention"):
            window, sink_tokens = cache._attention_window(window, sink_tokens)
            var = _check_variants(cache.spec, causal, window, sink_tokens, sinks, softcap,
                                  scores)
            return _pool_attention(q, cache, layer, seqs, counts, scale, causal, out,
                                   return_lse, var)
    if not isinstance(cache, KVCache):
        raise DTypeError(f"invalid type of cache: expected KVCache, got {type(cache).__name__} "
                         f"(or a KVPool with seqs)")
    if seqs is not None or counts is not None:
        raise StateError("seqs and counts are for a KVPool; a KVCache holds one sequence")
    with cache._guard("decode_attention"):
        var = _check_variants(cache.spec, causal, window, sink_tokens, sinks, softcap, scores)
        return _attend(q, cache, layer, scale, causal, out, return_lse, var)


class _Variants(NamedTuple):
    """The variants of a call as the kernels take them (0 / None / False: off)."""
    window: int
    sink_tokens: int
    sinks: np.ndarray | None
    softcap: float
    int8_scores: bool

    @property
    def kwargs(self) -> dict[str, Any]:
        """The kernels' keyword arguments (none for the plain call; int8_scores only when
        on: the grouped kernel, q4_1ch's, has no int8 scores)."""
        if self is _NO_VARIANTS:
            return {}
        kw = self._asdict()
        if not self.int8_scores:
            del kw["int8_scores"]
        return kw

    def window_start(self, n: int, T: int) -> int:
        """The first position past the sink positions that any of the T tokens over n
        positions sees (the kernel's lo): the positions read are [0, min(S, lo)) and
        [lo, n)."""
        return n - T + 1 - self.window if self.window and n - T + 1 > self.window else 0


_NO_VARIANTS = _Variants(0, 0, None, 0.0, False)
SCORES = ("float32", "int8")
_INT8_SCORE_FORMATS = ("int8", "q8_0", "q4_0", "q4_1")
_FLOAT32_MAX = float(np.finfo(np.float32).max)


def _check_variants(spec: KVSpec, causal: bool, window: object, sink_tokens: object,
                    sinks: object, softcap: object, scores: object = "float32") -> _Variants:
    """The variants checked (docs/variants.md): DTypeError for a type, RangeError for a
    value or a combination the call does not take, ShapeError / NonFiniteError for sinks,
    FormatError for int8 scores over a K format without int8 codes."""
    if window is None and sinks is None and softcap is None and type(sink_tokens) is int \
            and sink_tokens == 0 and scores == "float32":
        return _NO_VARIANTS   # the common call
    scores = _check_scores(scores, spec.k_format)
    w = 0
    if window is not None:
        w = _int_arg("window", window)
        if w < 1:
            raise RangeError(f"window must be an int >= 1 (positions a query sees, its own "
                             f"included), got {w}")
        if not causal:
            raise RangeError("a window needs causal=True: the query at position p sees "
                             "(p - window, p]; causal=False attends every position")
    s = _int_arg("sink_tokens", sink_tokens)
    if s < 0:
        raise RangeError(f"sink_tokens must be an int >= 0, got {s}")
    if s and not w:
        raise RangeError(f"sink_tokens={s} needs a window: sink positions stay visible "
                         f"beside a sliding window")
    arr = None
    if sinks is not None:
        arr = sinks if type(sinks) is np.ndarray else check_ndarray("sinks", sinks)
        if arr.dtype != np.float32:
            check_dtype("sinks", arr, float_input_dtypes())
            arr = arr.astype(np.float32)        # float16/bfloat16: exact
        if arr.shape != (_query_heads(spec),):
            check_shape("sinks", arr, [_query_heads(spec)])
        if not arr.flags.c_contiguous:
            arr = np.ascontiguousarray(arr)
        if not np.isfinite(arr).all():
            bad = int(np.argmax(~np.isfinite(arr)))
            raise NonFiniteError(f"non-finite value in sinks: sinks[{bad}] = {arr[bad]!s}")
    cap = 0.0
    if softcap is not None:
        if isinstance(softcap, bool) or not isinstance(softcap, (int, float, np.integer,
                                                                 np.floating)):
            raise DTypeError(f"invalid type of softcap: expected float, got "
                             f"{type(softcap).__name__}")
        try:
            value = float(softcap)
        except OverflowError:   # an int past the float range
            value = math.inf
        cap = float(np.float32(value)) if 0 < value <= _FLOAT32_MAX else 0.0
        if not cap > 0:   # NaN, inf, <= 0, past float32 or below its smallest value
            raise RangeError(f"softcap must be a finite float32 > 0, got {softcap!r}")
    return _Variants(min(w, _INT64_MAX), min(s, _INT64_MAX), arr, cap, scores == "int8")


def _check_scores(scores: object, k_format: str) -> str:
    """scores checked (one of SCORES; "int8" only for K int8, q8_0, q4_0 or q4_1): RangeError for a
    value, FormatError for the K format."""
    if not isinstance(scores, str) or scores not in SCORES:
        raise RangeError(f"scores must be one of {SCORES}, got {scores!r}")
    if scores == "int8" and k_format not in _INT8_SCORE_FORMATS:
        raise FormatError(f"scores='int8' reads K's integer codes: K format {k_format!r} "
                          f"is not one of {_INT8_SCORE_FORMATS}")
    return scores


def _int_arg(name: str, value: object) -> int:
    """An int argument (numpy ints too, bools not)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise DTypeError(f"invalid type of {name}: expected int, got {type(value).__name__} "
                         f"({value!r:.40})")
    return int(value)


def _attend(q: AnyArray, cache: KVCache, layer: int, scale: float | None, causal: bool,
            out: AnyArray | None, return_lse: bool, var: _Variants) -> Any:
    spec = cache.spec
    layer = check_index("layer", layer, spec.num_layers)
    q = _check_q(q, spec)
    n = cache.length + cache.pending(layer)
    q3 = q.reshape(-1, q.shape[-2], spec.head_dim) if q.ndim == 2 else q
    T = q3.shape[0]
    if n == 0:
        raise StateError(f"decode_attention on an empty cache: layer {layer} holds 0 positions")
    if causal and T > n:
        raise StateError(f"causal attention of T={T} new tokens needs at least {T} positions, "
                         f"layer {layer} holds {n}")
    _check_rows(T, spec)
    scale = _check_scale(scale, spec.head_dim)
    arr = _out(out, q, cache._storage)
    lse = np.empty(q.shape[:-1], np.float32) if return_lse else None
    arrays = cache._layer_arrays(layer)
    if cache._groups is not None:
        _attend_grouped(q3, spec, arrays, [cache._groups], layer, spec.capacity,
                        np.zeros((1, 1), np.int32), np.array([n], np.int64),
                        np.array([T], np.int64), scale, causal, arr.reshape(q3.shape),
                        None if lse is None else lse.reshape(q3.shape[:2]), var)
        return _result(arr if out is None else out, lse)
    status = _attention.attend(np.ascontiguousarray(q3), *arrays, spec.k_fmt.id, spec.v_fmt.id,
                               n, scale, bool(causal), arr.reshape(q3.shape),
                               None if lse is None else lse.reshape(q3.shape[:2]),
                               **var.kwargs)
    if status != _attention.ATTEND_OK:
        _raise_non_finite(q)
        raise _overflow_error(q3, spec.fmts, arrays, np.arange(n), n, scale, causal, var, layer)
    return _result(arr if out is None else out, lse)


def _attend_grouped(q: np.ndarray, spec: KVSpec, arrays: LayerArrays,
                    groups: list[KeyGroups], layer: int, page_size: int, tables: np.ndarray,
                    lengths: np.ndarray, counts: np.ndarray, scale: float, causal: bool,
                    out: np.ndarray, lse: np.ndarray | None, var: _Variants) -> None:
    """decode_attention over a K stored by channel in groups (q4_1ch, _grouped.pyx) of B
    sequences: q float32 [sum counts, Hq, D]; arrays: the layer's regions; groups: each
    sequence's residual; tables int32 [B, M], lengths, counts int64 [B] as attend_paged
    takes them; OUT out [sum counts, Hq, D], lse [sum counts, Hq] or None, written only
    when every value is finite (else RangeError or NonFiniteError, out untouched)."""
    k_codes, v_codes, k_scales, v_scales = arrays
    residuals = [g.residual[layer] for g in groups]     # kept alive for the call
    o = np.empty(out.shape, np.float32)
    m = None if lse is None else np.empty(lse.shape, np.float32)
    _grouped.attend_grouped(np.ascontiguousarray(q), k_codes, np.asarray(k_scales).view(np.uint16),
                            np.array([r.ctypes.data for r in residuals], np.uint64),
                            v_codes, v_scales, spec.v_fmt.id, page_size, tables, lengths,
                            counts, scale, causal, o, m, **var.kwargs)
    if not (np.isfinite(o).all() and (m is None or np.isfinite(m).all())):
        _raise_non_finite(q)
        raise RangeError(f"decode_attention of layer {layer} overflows float32 (K format "
                         f"{spec.k_format}): a score scale * q.k or a weighted sum of V "
                         f"passes 3.4028235e+38")
    out[...] = o
    if lse is not None:
        lse[...] = m


def _pool_attention(q: AnyArray, pool: KVPool, layer: int, seqs: Sequence[int] | None,
                    counts: object, scale: float | None, causal: bool, out: AnyArray | None,
                    return_lse: bool, var: _Variants) -> Any:
    spec = pool.spec
    layer = check_index("layer", layer, spec.num_layers)
    if seqs is None:
        raise StateError("decode_attention on a KVPool needs seqs: the sequence ids")
    seqs = check_seq_ids("seqs", seqs)
    B = len(seqs)
    table = pool._table
    known = table.cached(seqs)          # checked by an earlier call: distinct, known ids
    if not known and len(set(seqs)) != B:
        raise StateError(f"decode_attention names a sequence twice: {seqs}")
    q = check_ndarray("q", q)
    check_dtype("q", q, [np.float32])
    if counts is None:
        check_shape("q", q, [B, _query_heads(spec), spec.head_dim])
        count_list = None
    else:
        count_list = _counts(counts, B)
        check_shape("q", q, [sum(count_list), _query_heads(spec), spec.head_dim])
    if not known:
        _check_sequences(pool, seqs, count_list, layer, causal, var)
    batch = table.batch(seqs)
    lengths = batch.lengths + batch.pending[layer]
    c = batch.ones if count_list is None else np.array(count_list, np.int64)
    # the first position past the sink positions that a sequence's rows see (its kernel
    # lo; n for a sequence without queries: none); None without a window (all 0)
    lo = (np.where(c > 0, np.maximum(lengths - c + 1 - var.window, 0), lengths)
          if var.window else None)
    if known:   # the checks of _check_sequences, on arrays; it raises the first error
        bad = (c > 0) & (lengths == 0)
        if causal:
            bad |= c > lengths
        if lo is not None:
            bad |= lo < batch.starts
        if bad.any() or count_list and max(count_list) * spec.group_size > _attention.ROWS_MAX:
            _check_sequences(pool, seqs, count_list, layer, causal, var)
    ps = pool.page_size
    tables = _tables(batch, lengths, c, count_list is None, lo, var.sink_tokens, ps)
    scale = _check_scale(scale, spec.head_dim)
    arr = _out(out, q, pool._storage)
    lse = np.empty(q.shape[:-1], np.float32) if return_lse else None
    arrays = pool._layer_arrays(layer)
    q = np.ascontiguousarray(q)
    if spec.k_fmt.group:
        _attend_grouped(q, spec, arrays, [pool._groups_of(s) for s in seqs], layer, ps, tables,
                        lengths, c, scale, causal, arr, lse, var)
        return _result(arr if out is None else out, lse)
    status = _attention.attend_paged(q, *arrays, spec.k_fmt.id, spec.v_fmt.id, ps, tables,
                                     lengths, c, scale, bool(causal), arr, lse, **var.kwargs)
    if status != _attention.ATTEND_OK:
        _raise_non_finite(q)
        at = 0   # the cold path: the first sequence whose attention overflows, with its numbers
        for b, (s, t, n) in enumerate(zip(seqs, c.tolist(), lengths.tolist())):
            if t and _attention.attend_paged(
                    q[at:at + t], *arrays, spec.k_fmt.id, spec.v_fmt.id, pool.page_size,
                    tables[b:b + 1], np.array([n], np.int64), np.array([t], np.int64), scale, bool(causal),
                    np.empty((t,) + q.shape[1:], np.float32), **var.kwargs
                    ) != _attention.ATTEND_OK:
                positions = np.arange(n)
                rows = tables[b, positions // ps].astype(np.int64) * ps + positions % ps
                raise _overflow_error(q[at:at + t], spec.fmts, arrays, rows, n, scale, causal,
                                      var, layer, f"sequence {s}, ")
            at += t
        raise AssertionError("the batch overflowed, but no sequence alone does")
    return _result(arr if out is None else out, lse)


def _check_sequences(pool: KVPool, seqs: list[int], counts: list[int] | None, layer: int,
                     causal: bool, var: _Variants) -> None:
    """StateError for the first sequence that is unknown, empty (with queries), holds
    fewer positions than its causal queries or whose rows' window starts before the
    positions it holds (first_held: a windowed sequence is attended with its step's
    tokens pending); RangeError past the kernel's row count."""
    for s, t in zip(seqs, counts or [1] * len(seqs)):
        seq = pool._table.get(s)
        n = seq.length + seq.pending[layer]
        if t and n == 0:
            raise StateError(f"decode_attention on an empty sequence: sequence {s} holds 0 "
                             f"positions in layer {layer}")
        if causal and t > n:
            raise StateError(f"causal attention of T={t} new tokens needs at least {t} "
                             f"positions, sequence {s} holds {n} in layer {layer}")
        if t and var.window_start(n, t) < seq.start:
            raise StateError(f"decode_attention of sequence {s}: its {t} new token(s) over "
                             f"{n} positions in layer {layer} see positions from "
                             f"{var.window_start(n, t)} (window {var.window}), but the window "
                             f"released those before {seq.start} (first_held): attend a "
                             f"step's tokens before its advance")
        _check_rows(t, pool.spec)


def _tables(batch: Batch, lengths: np.ndarray, counts: np.ndarray, one_each: bool,
            lo: np.ndarray | None, sink_tokens: int, ps: int) -> np.ndarray:
    """The block tables of a call, int32 [B, M]: sequence b's pages that hold positions
    its rows see ([0, min(S, lo)) and [lo, n), lo None: 0 for every sequence with
    queries), -1 elsewhere (a windowed pool may have released those pages). The table's
    own array when that is all of every page list (a decode step without a window)."""
    end = -(-lengths // ps)
    if lo is None:
        if one_each and (end == batch.npages).all():
            return batch.pages
        lo = np.where(counts > 0, 0, lengths)
    cols = np.arange(batch.pages.shape[1])
    keep = (cols >= (lo // ps)[:, None]) & (cols < end[:, None])
    if sink_tokens:
        keep |= cols < (-(-np.minimum(sink_tokens, lo) // ps))[:, None]
    return np.where(keep, batch.pages, np.int32(-1))


def _result(out: object, lse: np.ndarray | None) -> Any:
    """What decode_attention returns: out (the caller's own out object when given), or
    (out, lse) when lse was asked for."""
    return out if lse is None else (out, lse)


def _check_q(q: AnyArray, spec: KVSpec) -> np.ndarray:
    arr = check_ndarray("q", q)
    check_dtype("q", arr, [np.float32])
    if arr.ndim == 2:
        check_shape("q", arr, [_query_heads(spec), spec.head_dim])
    else:
        check_shape("q", arr, ["T", _query_heads(spec), spec.head_dim])
    return arr


def _query_heads(spec: KVSpec) -> int:
    """Hq: spec.num_heads, an int once the spec is built."""
    return cast(int, spec.num_heads)


def _check_rows(T: int, spec: KVSpec) -> None:
    rows = T * spec.group_size
    if rows > _attention.ROWS_MAX:
        raise RangeError(f"decode_attention: T x Hq/Hkv = {T} x {spec.group_size} = {rows} "
                         f"query rows per kv head, more than the kernel counts "
                         f"({_attention.ROWS_MAX})")


def _out(out: AnyArray | None, q: np.ndarray, storage: np.ndarray) -> np.ndarray:
    """The numpy array over the caller's out (checked), or a new one."""
    if out is None:
        return np.empty(q.shape, np.float32)
    arr = check_out("out", out, q.shape, [np.float32])
    if np.shares_memory(arr, storage):
        raise ShapeError("out overlaps the cache's storage")
    return arr


def _raise_non_finite(q: np.ndarray) -> None:
    """Raises NonFiniteError naming q's first non-finite value, if it has one (the kernel
    checks q as it reads it)."""
    if not np.isfinite(q).all():
        bad = np.argwhere(~np.isfinite(q))[0]
        raise NonFiniteError(f"non-finite value in q at index {tuple(int(i) for i in bad)}")


def _check_scale(scale: object, head_dim: int) -> float:
    """The softmax scale as the float32 the kernel uses: finite and positive."""
    if scale is None:
        return float(np.float32(1.0 / math.sqrt(head_dim)))
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.integer, np.floating)):
        raise DTypeError(f"invalid type of scale: expected float, got {type(scale).__name__}")
    try:
        value = float(scale)
    except OverflowError:   # an int past the float range: finite, but too large
        value = math.inf
    if isinstance(scale, (float, np.floating)) and not math.isfinite(value):
        raise NonFiniteError(f"scale must be finite, got {scale}")
    with np.errstate(over="ignore"):
        s32 = np.float32(value)
    if not (math.isfinite(s32) and s32 > 0):
        raise RangeError(f"scale must be a finite positive float32, got {scale!r} "
                         f"(as float32: {s32!s}; float32 holds up to 3.4028235e+38)")
    return float(s32)


def _overflow_error(q3: np.ndarray, fmts: tuple[Format, Format], arrays: LayerArrays, rows: np.ndarray, n: int,
                    scale: float, causal: bool, var: _Variants, layer: int,
                    where: str = "") -> RangeError:
    """The error of an attention call whose float32 computation overflowed, with the
    numbers: the largest |scale * q.k| (before any soft-capping) over the visible positions
    and the largest |V| over the positions read, computed in float64 (the cold path of a
    refused call). rows [n]: the storage row of each position (only the rows of positions
    some token sees are read)."""
    from .quant import dequantize
    k_codes, v_codes, k_scales, v_scales = arrays
    T, Hq, D = q3.shape
    j = np.arange(n)
    p = n - T + np.arange(T)
    visible = (j[None, :] <= p[:, None]) if causal else np.ones((T, n), bool)   # [T, n]
    if var.window:
        visible &= (j[None, :] > p[:, None] - var.window) | (j[None, :] < var.sink_tokens)
    read = visible.any(0)
    rows, visible = rows[read], visible[:, read]
    k = dequantize(k_codes[rows], None if k_scales is None else k_scales[rows], fmts[0]
                   ).astype(np.float64)     # [positions read, Hkv, D]
    v = dequantize(v_codes[rows], None if v_scales is None else v_scales[rows], fmts[1])
    Hkv = k.shape[1]
    qg = q3.astype(np.float64).reshape(T, Hkv, Hq // Hkv, D) * scale
    with np.errstate(over="ignore", invalid="ignore"):
        scores = np.abs(np.einsum("thgd,nhd->thgn", qg, k))
    scores = np.where(visible[:, None, None, :], scores, 0.0)
    with np.errstate(over="ignore"):
        qmax = float(np.abs(q3).max()) * scale
    return RangeError(
        f"decode_attention of {where}layer {layer} overflows float32: the scores scale * q.k reach "
        f"{float(np.nanmax(scores)):.4g} (|scale * q| up to {qmax:.4g}, |V| up to "
        f"{float(np.abs(v).max()):.4g} over {rows.size} positions); float32 holds up to "
        f"3.4028235e+38")


def merge_attention(o1: AnyArray, lse1: AnyArray, o2: AnyArray,
                    lse2: AnyArray) -> tuple[np.ndarray, np.ndarray]:
    """Merges two attention results over disjoint sets of positions into the result over
    their union (FlashInfer's merge_state; cascade attention over a shared prefix).

    o1, o2: float32 [..., Hq, D]; lse1, lse2: float32 [..., Hq], natural-log
    log-sum-exp of each row's scores (decode_attention(..., return_lse=True)); -inf
    marks a row that saw no position (its o is ignored). Returns (o, lse) new arrays:
    o = (e^(lse1 - m) o1 + e^(lse2 - m) o2) / (e^(lse1 - m) + e^(lse2 - m)),
    lse = m + log(e^(lse1 - m) + e^(lse2 - m)), m = max(lse1, lse2), in float32; a
    row that neither side saw gets o = 0, lse = -inf.
    """
    o1, lse1, o2, lse2 = (check_ndarray(name, x) for name, x in
                          (("o1", o1), ("lse1", lse1), ("o2", o2), ("lse2", lse2)))
    for name, x in (("o1", o1), ("lse1", lse1), ("o2", o2), ("lse2", lse2)):
        check_dtype(name, x, [np.float32])
    if o1.ndim < 2:
        raise ShapeError(f"invalid shape of o1: expected [..., Hq, D], got {list(o1.shape)}")
    check_shape("o2", o2, list(o1.shape))
    check_shape("lse1", lse1, list(o1.shape[:-1]))
    check_shape("lse2", lse2, list(o1.shape[:-1]))
    for name, x in (("lse1", lse1), ("lse2", lse2)):
        if np.isnan(x).any() or np.isposinf(x).any():
            raise NonFiniteError(f"{name} holds NaN or +inf")
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        m = np.maximum(lse1, lse2)
        seen = np.isfinite(m)
        m0 = np.where(seen, m, np.float32(0))
        w1 = np.exp(lse1 - m0)
        w2 = np.exp(lse2 - m0)
        den = w1 + w2
        part1 = np.where((w1 > 0)[..., None], w1[..., None] * o1, np.float32(0))
        part2 = np.where((w2 > 0)[..., None], w2[..., None] * o2, np.float32(0))
        o = np.where(seen[..., None], (part1 + part2) / np.where(seen, den, 1)[..., None],
                     np.float32(0)).astype(np.float32)
        lse = np.where(seen, m0 + np.log(den), -np.inf).astype(np.float32)
    return o, lse


def apply_rope(x: OutArray, positions: int | Sequence[int] | AnyArray, *,
               theta: float = 10000.0, style: str = "neox", rotary_dim: int | None = None,
               inv_freq: AnyArray | None = None, attention_factor: float = 1.0) -> OutArray:
    """Rotary position embedding, in place.

    x: float32, shape [T, H, D] with positions an int array [T], or [H, D] with one int
    position; any strides, writable, finite. positions: 0 <= p < 2**63. style "neox"
    rotates the pairs (i, i + R/2) (split halves), "norm" the pairs (2i, 2i + 1)
    (adjacent), R = rotary_dim (default D, even, <= D); dims past R are left alone. Pair i
    turns by position * theta^(-2i/R) (theta a finite positive number), the angle
    computed in float64. Returns x. A refused call leaves x untouched.
    inv_freq: float64 [R/2], finite, >= 0: a model's own table (Llama 3, linear, dynamic
    NTK, YaRN, LongRoPE scaling: kvcore.rope_frequencies) used instead of theta; pair i
    turns by position * inv_freq[i] and R defaults to 2 * len(inv_freq).
    attention_factor: a finite positive number the R rotated dims are multiplied by, as
    transformers multiplies cos and sin (YaRN, LongRoPE).
    """
    a = check_ndarray("x", x)
    check_dtype("x", a, [np.float32])
    if a.ndim not in (2, 3):
        raise ShapeError(f"invalid shape of x: expected [T, H, D] or [H, D], got "
                         f"[{', '.join(map(str, a.shape))}]")
    if not a.flags.writeable:
        raise ShapeError("x must be writable (apply_rope rotates in place)")
    if style not in ROPE_STYLES:
        raise FormatError(f"unknown rope style {style!r}: expected 'neox' or 'norm'")
    D = a.shape[-1]
    freq = None if inv_freq is None else check_ndarray("inv_freq", inv_freq)
    R = rotary_dim if rotary_dim is not None else D if freq is None else 2 * _len(freq)
    if isinstance(R, bool) or not isinstance(R, (int, np.integer)) or not 0 < R <= D or R % 2:
        raise ShapeError(f"rotary_dim must be an even int in [2, {D}], got {rotary_dim!r}")
    theta = _check_theta(theta)
    pos = np.asarray(check_ndarray("positions", positions) if is_array(positions) else positions)
    if pos.dtype.kind not in "iu":
        raise DTypeError(f"invalid dtype of positions: expected an integer type, got {pos.dtype}")
    x3 = a
    if a.ndim == 2:
        if pos.size != 1:
            raise ShapeError(f"invalid shape of positions: x [H, D] takes one position, "
                             f"got {pos.size}")
        x3 = a[np.newaxis]
    check_shape("positions", pos.reshape(-1) if a.ndim == 2 else pos, [x3.shape[0]])
    if pos.size and (pos.min() < 0 or pos.max() > _INT64_MAX):
        bad = pos.reshape(-1)[(pos.reshape(-1) < 0) | (pos.reshape(-1) > _INT64_MAX)][0]
        raise OutOfRangeError(f"position {int(bad)} out of range: expected 0 <= position < 2**63")
    finite = np.isfinite(a)
    if not finite.all():
        idx = np.unravel_index(int(np.argmin(finite)), a.shape)
        where = ", ".join(str(int(i)) for i in idx)
        raise NonFiniteError(f"non-finite value in x: x[{where}] = {a[idx]!s}")
    table = _inv_freq(theta, int(R)) if freq is None else _check_inv_freq(freq, int(R))
    _check_attention_factor(attention_factor, x3[..., :R])
    _attention.rope(x3, np.ascontiguousarray(pos.reshape(-1), dtype=np.int64), table,
                    style == "neox")
    if attention_factor != 1:
        x3[..., :R] *= np.float32(attention_factor)
    return x


def _len(inv_freq: np.ndarray) -> int:
    return inv_freq.shape[0] if inv_freq.ndim == 1 else 0


def _check_inv_freq(inv_freq: np.ndarray, rotary_dim: int) -> np.ndarray:
    check_dtype("inv_freq", inv_freq, [np.float64])
    check_shape("inv_freq", inv_freq, [rotary_dim // 2])
    if not (np.isfinite(inv_freq).all() and (inv_freq >= 0).all()):
        raise NonFiniteError("inv_freq must be finite and >= 0")
    return np.ascontiguousarray(inv_freq)


def _check_attention_factor(factor: object, rotated: np.ndarray) -> None:
    """A finite positive number that keeps the rotated dims (|pair| <= sqrt(2) max|x|)
    inside float32."""
    if isinstance(factor, bool) or not isinstance(factor, (int, float, np.integer, np.floating)):
        raise DTypeError(f"invalid type of attention_factor: expected float, got "
                         f"{type(factor).__name__}")
    if not (math.isfinite(factor) and factor > 0):
        raise RangeError(f"attention_factor must be a finite positive number, got {factor!r}")
    if factor <= 1 or not rotated.size:
        return
    top = float(np.abs(rotated).max())
    if math.sqrt(2) * top * factor > float(np.finfo(np.float32).max):
        raise RangeError(f"attention_factor {factor!r} times |x| up to {top:.4g} passes the "
                         f"float32 range (3.4028235e+38)")


_INT64_MAX = np.iinfo(np.int64).max


def _check_theta(theta: object) -> float:
    if isinstance(theta, bool) or not isinstance(theta, (int, float, np.integer, np.floating)):
        raise DTypeError(f"invalid type of theta: expected float, got {type(theta).__name__}")
    try:
        value = float(theta)
    except OverflowError:   # an int past the float range
        value = math.inf
    if not (math.isfinite(value) and value > 0):
        raise RangeError(f"theta must be a finite positive number, got {theta!r}")
    return value


@functools.lru_cache(maxsize=64)
def _inv_freq(theta: float, rotary_dim: int) -> np.ndarray:
    """theta^(-2i / rotary_dim) for i < rotary_dim / 2, float64, read-only (cached: a
    model asks for the same table at every layer and step)."""
    i = np.arange(rotary_dim // 2, dtype=np.float64)
    table = np.power(theta, -2.0 * i / rotary_dim)
    table.flags.writeable = False
    return table
