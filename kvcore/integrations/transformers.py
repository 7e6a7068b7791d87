"""kvcore inside Hugging Face transformers: a `Cache` whose layers keep K/V in kvcore's
formats, and an attention function ("kvcore") that attends straight from the codes.

    import kvcore.integrations.transformers as kvhf   # registers attn_implementation "kvcore"
    model.set_attn_implementation("kvcore")           # or from_pretrained(..., attn_implementation="kvcore")
    out = model.generate(**inputs, past_key_values=kvhf.KVCoreCache(model.config, format="int8"))

How the two halves meet (docs/integrations.md):
1. `KVCoreLayer.update` takes the new K/V of a layer and returns two `KVCodes` handles
   instead of tensors: shaped like the history [B, Hkv, n, D], they hold no data, name the
   layer, and refuse every torch operation. No float copy of the history exists anywhere;
   another attention implementation fails loudly on them.
2. `kvcore_mask` (registered in `AttentionMaskInterface`) builds no mask: it returns None
   for causal and sliding-window causal attention, the 2-D padding mask when some
   positions are padding, and refuses what the kernel cannot express (bidirectional or
   chunked masks, overlays) before any layer writes.
3. `kvcore_attention` (registered in `AttentionInterface`) takes the layer from the handle,
   encodes the new positions' K/V into the layer's `kvcore.KVPool` (the real ones only, so
   each row holds its real positions in order and causal attention over them is exactly
   causal + padding), and runs `kvcore.decode_attention` on the codes with the module's
   scaling, soft-capping and sink logits. A sliding-window layer's pool has the window: it
   applies it and releases the pages no later query sees (memory follows W, not the
   length); the layer writes a long forward in chunks, so a long prefill holds about
   2 W positions a row. Its kernels run on at most torch.get_num_threads() threads
   (`_parallel.limit`: torch's budget, the results unchanged).

CPU only; transformers is imported here only (the `hf` extra). The tested transformers
range is pinned in pyproject.toml (`kvcore[hf]`).
"""
from __future__ import annotations

import math

import numpy as np
import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin, get_layer_types_and_kwargs
from transformers.masking_utils import (AttentionMaskInterface, and_masks, causal_mask_function,
                                        sliding_window_overlay)
from transformers.utils import logging

from .._parallel import limit
from ..attention import _check_scores, decode_attention
from ..errors import DTypeError, OutOfRangeError, ShapeError, StateError
from ..formats import get_pair, pair_name
from ..pool import KVPool
from ..spec import KVSpec, resolve_formats

logger = logging.get_logger(__name__)

ATTN_IMPLEMENTATION = "kvcore"
_MIN_CAPACITY = 256          # positions per row a growable full-attention layer starts with
_PAGE_SIZE = 16              # positions per pool page
_UNBOUNDED = 2**31 - 1       # positions per row without max_cache_len
_WINDOW_CHUNK = 256          # a sliding layer writes and attends at most max(W, this) columns at once
_USE_KVCORE = (f"run the model with attn_implementation={ATTN_IMPLEMENTATION!r} "
               f"(model.set_attn_implementation({ATTN_IMPLEMENTATION!r}))")
_LAYER_TYPES = ("full_attention", "sliding_attention")


class KVCodes(torch.Tensor):
    """What `KVCoreLayer.update` returns in place of K or V: a tensor with the history's
    shape [B, Hkv, n, D] and the model's dtype but no storage. It carries the layer
    (`.layer`) to `kvcore_attention`; any torch operation on it raises."""

    @staticmethod
    def __new__(cls, layer: "KVCoreLayer", shape: tuple[int, ...], dtype: torch.dtype):
        handle = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device="cpu")
        handle.layer = layer
        return handle

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise StateError(f"KVCoreCache keeps K/V as kvcore codes, not tensors ({func} was "
                         f"called on them): {_USE_KVCORE}")

    def __repr__(self) -> str:
        return f"KVCodes(shape={list(self.shape)}, dtype={self.dtype}, layer={self.layer!r})"


def _numpy_view(x: torch.Tensor) -> np.ndarray:
    """A float32/float16/bfloat16 CPU tensor as a numpy array of the same shape and strides
    (no copy; bfloat16 through an ml_dtypes view)."""
    x = x.detach()
    if x.dtype == torch.bfloat16:
        import ml_dtypes
        return x.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return x.numpy()


def _rows(x: torch.Tensor, select: np.ndarray | None = None) -> np.ndarray:
    """[B, H, T, D] -> numpy [positions, H, D] in row-major (b, t) order: every position
    (a view for B = 1) or those where select [B, T] is True (a copy of those only)."""
    a = _numpy_view(x).transpose(0, 2, 1, 3)            # [B, T, H, D]
    if select is not None:
        return a[select]
    return a[0] if a.shape[0] == 1 else a.reshape(-1, a.shape[2], a.shape[3])


class _Kept:
    """(a recording sliding layer) The last forward's last columns, written and left
    pending so that `crop` can roll back into them: their K/V rows as written (numpy [sum
    counts, Hkv, D], row b's counts[b] rows in turn) and the number of columns."""

    __slots__ = ("k", "v", "counts", "columns")

    def __init__(self, k: np.ndarray, v: np.ndarray, counts: list[int], columns: int):
        self.k, self.v, self.counts, self.columns = np.array(k), np.array(v), counts, columns


class KVCoreLayer(CacheLayerMixin):
    """One decoder layer's K/V in a one-layer `kvcore.KVPool`: batch row b is pool
    sequence `seqs[b]` (CPU).

    format: a name of kvcore.FORMATS, or a K/V pair's "<k>/<v>" (KVSpec.format). num_heads:
    the model's query heads (Hq).
    max_cache_len: positions one row holds at most; None: unbounded. window: None (full
    attention) or W, a sliding-window layer: its pool has window W, so the query at
    position p sees p - W < j <= p and a row holds about W + 16 positions, whatever its
    length (`is_sliding`). A full layer's pool starts with room for every row's first K/V
    (at least 256 positions each) and doubles its pages when a write needs more (each
    growth copies the codes once); a sliding layer's pool has room for about 2 W
    positions a row from the start. scores: decode_attention's ("float32", or the
    opt-in "int8" for K in int8 / q8_0 / q4_0 / q4_1).

    transformers sees `columns` positions per row (padding included: get_seq_length);
    the pool holds only the real ones: `update` keeps the new K/V and the attention
    writes their real positions once the mask says which they are. `real` (bool [B,
    columns], None while no column is padding) records which columns a row holds. Follows
    transformers' DynamicLayer conventions: `crop(-k)` drops the last k columns,
    `reset()` empties the layer and keeps its storage, `get_mask_sizes(q)` is
    (columns + q, 0); beam search reorders rows by forking pool sequences (full pages
    shared). A sliding layer rolls back as transformers' DynamicSlidingWindowLayer does:
    into the positions it still holds, and after `activate_past_recording()` into the
    last forward too.
    """

    is_compileable = False
    is_croppable = True

    def __init__(self, format: str, num_heads: int, max_cache_len: int | None = None,
                 window: int | None = None, scores: str = "float32"):
        super().__init__()
        self.format = pair_name(*get_pair(format))   # one name, or a K/V pair "<k>/<v>"
        self.scores = _check_scores(scores, get_pair(format)[0].name)
        self.num_heads = num_heads
        self.max_cache_len = max_cache_len
        self.window = window
        self.is_sliding = window is not None
        self.record_past = False
        self.pool: KVPool | None = None
        self.seqs: list[int] = []
        self.columns = 0
        self.real: np.ndarray | None = None
        self._new: tuple[torch.Tensor, torch.Tensor] | None = None   # K/V no attention wrote yet
        self._kept: _Kept | None = None
        self._broken: str | None = None

    def __repr__(self) -> str:
        window = "" if self.window is None else f", window={self.window}"
        return (f"KVCoreLayer(format={self.format!r}{window}, rows={len(self.seqs)}, "
                f"columns={self.columns}, pool={self.pool!r})")

    @property
    def _chunk(self) -> int:
        """Columns a sliding layer writes and attends at once."""
        return max(self.window or 0, _WINDOW_CHUNK)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Sizes the pool from the first K/V: [B, Hkv, T, D] CPU tensors of float32,
        float16 or bfloat16."""
        _check_states(key_states, value_states)
        b, hkv, t, d = key_states.shape
        spec = KVSpec(num_layers=1, num_kv_heads=hkv, head_dim=d,
                      capacity=self.max_cache_len or _UNBOUNDED, num_heads=self.num_heads,
                      format=self.format)
        self.dtype, self.device = key_states.dtype, key_states.device
        ps = math.lcm(_PAGE_SIZE, spec.k_fmt.group or 1)   # q4_1ch: pages of whole groups
        if self.window is None:
            per_row = -(-(self.max_cache_len or max(_MIN_CAPACITY, t)) // ps)
            self.pool = KVPool(spec, b * per_row, ps)
        else:   # the window's positions (from a page start), a chunk, a fork's partial page
            held = self.window + self._chunk + 2 * ps
            per_row = -(-min(held, self.max_cache_len or held) // ps) + 1
            self.pool = KVPool(spec, b * per_row, ps, window=self.window)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args,
               **kwargs) -> tuple[KVCodes, KVCodes]:
        """Takes the new positions (K/V [B, Hkv, T, D]) after every row's held ones and
        returns handles to the whole history (see KVCodes): never a float copy of it. The
        attention encodes them (the real ones); K/V that no attention took are encoded at
        the next call, every position as real."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        _check_states(key_states, value_states)
        self._settle()
        pool = self.pool
        spec = pool.spec
        b, _, t, _ = key_states.shape
        rows = len(self.seqs) if self.columns else b
        expected = (rows, spec.num_kv_heads, t, spec.head_dim)
        if tuple(key_states.shape) != expected or key_states.dtype != self.dtype:
            raise ShapeError(f"invalid K/V for this layer: expected {list(expected)} of "
                             f"{self.dtype}, got {list(key_states.shape)} of {key_states.dtype}")
        if not self.columns:                 # a new batch: one pool sequence per row
            for s in self.seqs:
                pool.free(s)
            self.seqs = [pool.new_sequence() for _ in range(b)]
            self.real = None
        self._new = (key_states, value_states)
        self.columns += t
        if self.real is not None:
            self.real = np.concatenate([self.real, np.ones((b, t), bool)], axis=1)
        shape = (b, spec.num_kv_heads, self.columns, spec.head_dim)
        return KVCodes(self, shape, self.dtype), KVCodes(self, shape, self.dtype)

    def _settle(self) -> None:
        """Commits what the last forward left: the positions a recording sliding layer
        kept pending, and K/V an update took that no attention wrote (written now, every
        position as real, with no attention)."""
        if self._kept is not None:
            self._kept = None
            self.pool.advance()
        self._flush()

    def _bounds(self, t: int) -> list[tuple[int, int]]:
        """The column ranges of t new columns written (and attended) at once: one for a
        full layer; a sliding layer's in chunks, the last one `_chunk` columns."""
        if self.window is None or t <= self._chunk:
            return [(0, t)]
        cuts = [0, *range(t % self._chunk or self._chunk, t + 1, self._chunk)]
        return list(zip(cuts, cuts[1:]))

    def _write(self, k: torch.Tensor, v: torch.Tensor, real: np.ndarray | None,
               attend: "_Attend | None") -> torch.Tensor | None:
        """Writes the new columns of K/V [B, Hkv, t, D] (the real ones: real bool [B, t],
        None: all) to the rows' pool sequences, in chunks (`_bounds`); with `attend`, the
        queries of each chunk attend once it is written, and the output [B, t, Hq, D]
        float32 is returned (zeros for padded queries). A recording sliding layer keeps
        the last chunk pending (`_Kept`); every other chunk is committed, so a sliding
        pool releases what the window left behind. On an error the forward's t columns
        are dropped again, as if it never ran (when the window left what that needs; else
        the layer refuses every later call until reset)."""
        b, t = k.shape[0], k.shape[2]
        bounds = self._bounds(t)
        record = self.window is not None and self.record_past and attend is not None
        before = [self.pool.length(s) for s in self.seqs]
        out = None
        try:
            for c0, c1 in bounds:
                sel = None if real is None else real[:, c0:c1]
                counts = [c1 - c0] * b if sel is None else sel.sum(axis=1).tolist()
                self._reserve(counts)            # may move the rows to a larger pool
                pool, seqs = self.pool, self.seqs
                kr, vr = _rows(k[:, :, c0:c1], sel), _rows(v[:, :, c0:c1], sel)
                pool.append_batch(kr, vr, seqs=seqs, layer=0,
                                  counts=None if counts == [1] * b else counts)
                if attend is not None:
                    out = attend(self, c0, c1, sel, counts, out, len(bounds) == 1)
                if record and c1 == t:
                    self._kept = _Kept(kr, vr, counts, c1 - c0)
                else:
                    pool.advance()
        except BaseException:
            self._kept = None
            try:
                for s, n in zip(self.seqs, before):
                    self.pool.truncate(s, n)
            except StateError as e:
                self._broken = (f"an error in a forward left this sliding-window layer "
                                f"partly written ({e}): reset() the cache")
            else:
                self._cut(t)
            raise
        return out

    def _reserve(self, counts: list[int], forks: int = 0) -> None:
        """Grows the pool (doubling its pages, at least to what it needs) when writing
        counts[b] more positions to row b, after `forks` forks, needs more pages than are
        free. The growth moves every row's held codes into the new pool once."""
        pool = self.pool
        held = [pool.length(s) for s in self.seqs]
        need = forks + sum(pool.pages_for(n + c) - pool.pages_for(n) for n, c in zip(held, counts))
        if need <= pool.num_free_pages:
            return
        distinct = pool.num_used_pages + need
        grown = KVPool(pool.spec, max(2 * pool.num_pages, distinct), pool.page_size,
                       window=self.window)
        self.seqs = [grown.restore(pool.snapshot(s)) for s in self.seqs]
        self.pool = grown

    def _new_columns(self, mask: torch.Tensor | None, t: int) -> np.ndarray | None:
        """Called by the attention with the mask of this forward (None: no padding, or a
        bool [B, columns] padding mask from kvcore_mask) for the T = t new columns the
        last update took: which of them are real (bool [B, t]), None when all are.
        Refuses (dropping the last update) a mask that disagrees with the held rows, or a
        padded column after a real one on a sliding layer."""
        if self._new is None or self._new[0].shape[2] != t:
            raise StateError(f"the kvcore attention needs the K/V of its layer's last update "
                             f"({t} new positions)")
        held = self.columns - t
        if mask is None:
            if self.real is not None:
                self._discard(t)
                raise StateError("this KVCoreCache holds padded rows: the attention_mask must "
                                 "mark them (generate's does), got none or one with no padding")
            return None
        m = mask.detach().numpy()
        if m.shape != (len(self.seqs), self.columns):
            self._discard(t)
            raise ShapeError(f"invalid shape of the padding mask: expected "
                             f"[{len(self.seqs)}, {self.columns}] (rows, held + new columns), "
                             f"got {list(m.shape)}")
        past = m[:, :held]
        if not (past.all() if self.real is None else np.array_equal(past, self.real[:, :held])):
            self._discard(t)
            raise StateError("the attention_mask changes which held positions are padding: "
                             "kvcore stores only the real ones, so a mask may mark new "
                             "positions only")
        new = m[:, held:]
        if new.all():
            return None
        seg = m[:, max(held - 1, 0):]        # the last held column and the new ones
        if self.window is not None and np.any(seg[:, 1:] < seg[:, :-1]):
            self._discard(t)
            raise StateError(f"a sliding-window layer (window {self.window}) takes padding "
                             f"before a row's first real position only (left padding): the "
                             f"window counts positions, and a padded column after a real one "
                             f"would shift it")
        if self.real is None:
            self.real = np.ones((len(self.seqs), self.columns), bool)
        self.real[:, held:] = new
        return new

    def _discard(self, columns: int) -> None:
        """Forgets the last update (`columns` new columns, none written)."""
        self._new = None
        self._cut(columns)

    def _cut(self, columns: int) -> None:
        self.columns -= columns
        if self.real is not None:
            self.real = self.real[:, :self.columns]
            if self.real.all():
                self.real = None

    def get_seq_length(self) -> int:
        return self.columns

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.columns + query_length, 0

    def get_max_length(self) -> int:
        return -1 if self.max_cache_len is None else self.max_cache_len

    def activate_past_recording(self) -> None:
        """As transformers' sliding layers: the positions of each forward stay where a
        `crop` can roll back into them, until that crop (a full layer always can)."""
        self.record_past = True

    def reset(self) -> None:
        """Empties the layer; its storage stays for the next batch."""
        for s in self.seqs:
            self.pool.free(s)
        self.seqs, self.columns, self.real, self._new = [], 0, None, None
        self._kept, self._broken = None, None

    def crop(self, tokens_to_remove: int) -> None:
        """crop(-k) drops the last k columns of every row (transformers' convention;
        crop(0) drops nothing and commits what a recording layer kept for a rollback). A
        sliding layer drops into its last forward's columns when recording
        (`activate_past_recording`), and elsewhere as far as it still holds every
        position the window needs at the new length (StateError otherwise, nothing
        changed)."""
        self._flush()
        drop = self._check_crop(tokens_to_remove)
        n, pool, kept = -tokens_to_remove, self.pool, self._kept
        if not n:
            self._settle()
            return
        self._kept = None
        if kept is not None and n <= kept.columns:
            for s in self.seqs:
                pool.truncate(s, pool.length(s))          # drops the pending positions
            keep = [c - d for c, d in zip(kept.counts, drop)]
            if sum(keep):
                starts = np.cumsum([0] + kept.counts[:-1])
                idx = np.concatenate([np.arange(a, a + c) for a, c in zip(starts, keep)])
                pool.append_batch(kept.k[idx], kept.v[idx], seqs=self.seqs, layer=0,
                                  counts=keep)
            pool.advance()
        else:   # past the kept columns, if any: they go, with committed ones
            for s, d in zip(self.seqs, drop):
                pool.truncate(s, pool.length(s) + pool.pending(s, 0) - d)
        self._cut(n)

    def _flush(self) -> None:
        """Writes K/V an update took that no attention wrote (every position as real)."""
        if self._broken:
            raise StateError(self._broken)
        if self._new is not None:
            k, v = self._new
            self._new = None
            self._write(k, v, None, None)

    def _check_crop(self, tokens_to_remove: int) -> list[int]:
        """The real positions crop(tokens_to_remove) drops from each row; raises (nothing
        changed) when it cannot: a positive count, more than the layer holds, or a sliding
        row that would need positions its window released."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes minus the number of positions to drop, got "
                             f"{tokens_to_remove}")
        n = -tokens_to_remove
        if n > self.columns:
            raise OutOfRangeError(f"crop({tokens_to_remove}) out of range: the layer holds "
                                  f"{self.columns} positions")
        drop = [n] * len(self.seqs) if self.real is None else \
            self.real[:, self.columns - n:].sum(axis=1).tolist()
        if not n or self.window is None or (self._kept is not None and n <= self._kept.columns):
            return drop
        pool = self.pool
        for s, d in zip(self.seqs, drop):
            m, first = pool.length(s) + pool.pending(s, 0) - d, pool.first_held(s)
            if first and m - self.window + 1 < first:
                raise StateError(
                    f"crop({tokens_to_remove}) out of reach of a sliding-window layer "
                    f"(window {self.window}): a row would hold {m} positions and need them "
                    f"from {m - self.window + 1}, but the window released those before "
                    f"{first}; call cache.activate_past_recording() before a forward to "
                    f"roll back into it (as transformers' sliding layers)")
        return drop

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keeps rows `indices` (in that order; a row may repeat): pool sequences forked
        (full pages shared), the old ones freed."""
        if not self.columns:
            return
        idx = torch.as_tensor(indices).reshape(-1).tolist()
        if not all(0 <= i < len(self.seqs) for i in idx):
            raise OutOfRangeError(f"batch indices out of range: expected 0 <= i < "
                                  f"{len(self.seqs)}, got {idx}")
        self._settle()
        self._reserve([0] * len(self.seqs), forks=len(idx))
        pool = self.pool
        forked = [pool.fork(self.seqs[i]) for i in idx]
        for s in self.seqs:
            pool.free(s)
        self.seqs = forked
        if self.real is not None:
            self.real = self.real[idx]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row b becomes the old row beam_idx[b]."""
        self.batch_select_indices(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.batch_select_indices(torch.arange(len(self.seqs)).repeat_interleave(repeats))


def _check_states(key_states: torch.Tensor, value_states: torch.Tensor) -> None:
    if key_states.shape != value_states.shape:
        raise ShapeError(f"K and V differ in shape: {list(key_states.shape)} and "
                         f"{list(value_states.shape)}")
    if key_states.ndim != 4 or key_states.shape[0] < 1:
        raise ShapeError(f"invalid shape of K/V: expected [batch, kv heads, positions, "
                         f"head_dim], got {list(key_states.shape)}")
    if key_states.device.type != "cpu" or value_states.device.type != "cpu":
        raise DTypeError(f"KVCoreCache runs on the CPU: got K/V on {key_states.device}")
    allowed = (torch.float32, torch.float16, torch.bfloat16)
    if key_states.dtype not in allowed or value_states.dtype not in allowed:
        raise DTypeError(f"invalid dtype of K/V: expected float32, float16 or bfloat16, got "
                         f"{key_states.dtype}")


class KVCoreCache(Cache):
    """A transformers `Cache` storing every layer's K/V in a kvcore format (CPU): a
    `kvcore.KVPool` per layer, one pool sequence per batch row, padded positions never
    stored.

    config: the model's config (its text config is used); the model must run with
    attn_implementation "kvcore". format: a name of kvcore.FORMATS ("f32", "f16", "bf16",
    "int8", "fp8_e4m3", "fp8_e5m2", "q8_0", "q4_0", "q4_1"; default "f16") for K and V;
    k_format / v_format: one side each (llama.cpp's -ctk / -ctv: k_format="q8_0",
    v_format="q4_0"; KIVI: k_format="q4_1ch", v_format="q4_1", full-attention layers
    only), as KVSpec takes them. max_cache_len: positions per row at most;
    None grows as needed. scores: "float32" (default) or "int8", decode_attention's opt-in
    int8 scores for K in int8, q8_0, q4_0 or q4_1 (docs/attention.md, "Int8 scores"; FormatError for
    another K format, RangeError for another value). The layers follow config's layer types: "full_attention" and
    "sliding_attention" (a pool with the config's sliding_window: it holds about W
    positions a row); any other type (chunked, linear or shared-KV layers) is refused.
    copy.deepcopy and pickle give an independent cache holding the same rows (the
    prompt reuse recipe: prefill once, deepcopy per request).
    """

    def __init__(self, config, format: str | None = None, max_cache_len: int | None = None, *,
                 k_format: str | None = None, v_format: str | None = None,
                 scores: str = "float32"):
        config = config.get_text_config(decoder=True)
        if config._attn_implementation != ATTN_IMPLEMENTATION:
            raise StateError(f"KVCoreCache needs the kvcore attention, the model runs "
                             f"{config._attn_implementation!r}: {_USE_KVCORE}")
        layer_types, layer_kwargs = get_layer_types_and_kwargs(config)
        other = sorted(set(layer_types) - set(_LAYER_TYPES))
        if other:
            raise StateError(f"KVCoreCache supports full-attention and sliding-window layers "
                             f"only, the model has {other} layers")
        windows = []
        for kind, kwargs in zip(layer_types, layer_kwargs):
            w = kwargs.get("sliding_window") if kind == "sliding_attention" else None
            if kind == "sliding_attention" and (isinstance(w, bool) or not isinstance(w, int)
                                                or w < 1):
                raise StateError(f"a sliding_attention layer needs config.sliding_window, "
                                 f"an int >= 1, got {w!r}")
            windows.append(w)
        if max_cache_len is not None and (isinstance(max_cache_len, bool)
                                          or not isinstance(max_cache_len, int)
                                          or max_cache_len <= 0):
            raise ShapeError(f"max_cache_len must be a positive int or None, got {max_cache_len!r}")
        self.format = pair_name(*resolve_formats(format, k_format, v_format))
        _check_scores(scores, get_pair(self.format)[0].name)
        super().__init__(layers=[KVCoreLayer(self.format, config.num_attention_heads,
                                             max_cache_len, w, scores) for w in windows])

    def crop(self, tokens_to_remove: int) -> None:
        """crop(-k) drops the last k positions of every layer (KVCoreLayer.crop), or of
        none: every layer is checked first."""
        for layer in self.layers:
            layer._flush()
        for layer in self.layers:
            layer._check_crop(tokens_to_remove)
        super().crop(tokens_to_remove)

    @property
    def memory_bytes(self) -> int:
        """Bytes of the layers' kvcore storage (allocated capacity, codes and scales)."""
        return sum(layer.pool.memory_bytes for layer in self.layers if layer.is_initialized)


class _Attend:
    """One attention call's queries and variants, run chunk by chunk by `KVCoreLayer._write`."""

    def __init__(self, query: torch.Tensor, scale: float | None, softcap: float | None,
                 sinks: np.ndarray | None):
        q = query.detach()
        self.q = q if q.dtype == torch.float32 else q.float()
        self.scale, self.softcap, self.sinks = scale, softcap, sinks

    def __call__(self, layer: KVCoreLayer, c0: int, c1: int, sel: np.ndarray | None,
                 counts: list[int], out: torch.Tensor | None, whole: bool) -> torch.Tensor:
        """Columns [c0, c1) of every row (the real ones: sel [B, c1 - c0]) attend to the
        rows' held positions, the new ones last; returns out [B, T, Hq, D] with them in."""
        b, hq, t, d = self.q.shape
        if sum(counts):
            rows = decode_attention(_rows(self.q[:, :, c0:c1], sel), layer.pool, 0,
                                    seqs=layer.seqs,
                                    counts=None if counts == [1] * b else counts,
                                    scale=self.scale, window=layer.window,
                                    softcap=self.softcap, sinks=self.sinks, scores=layer.scores)
            if whole and sel is None:
                return torch.from_numpy(rows).view(b, t, hq, d)
        if out is None:
            out = torch.zeros(b, t, hq, d)
        if sum(counts):
            part = out[:, c0:c1]
            if sel is None:
                part.copy_(torch.from_numpy(rows).view(b, c1 - c0, hq, d))
            else:
                part[torch.from_numpy(sel)] = torch.from_numpy(rows)
        return out


def kvcore_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                     value: torch.Tensor, attention_mask: torch.Tensor | None,
                     scaling: float | None = None, dropout: float = 0.0,
                     **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention function "kvcore": query [B, Hq, T, D] attends causally to
    each row's held positions, read from the codes; attention_mask is what kvcore_mask
    returned (None, or the bool [B, columns] padding mask: padded positions are never
    stored, padded queries get zeros). The variants the model passes apply:
    sliding_window (must be the layer's window: its pool applies it), softcap (Gemma 2's
    attn_logit_softcapping: c * tanh(s / c) on every score), s_aux (gpt-oss' sink logits
    [Hq], joining each softmax denominator). Returns ([B, T, Hq, D] in the query's dtype,
    None). key/value must be the KVCodes a KVCoreCache layer returned.
    output_attentions=True gets no weights (None), with a warning once, as transformers'
    sdpa attention."""
    if kwargs.get("output_attentions", False):
        logger.warning_once(f"`{ATTN_IMPLEMENTATION}` attention does not support "
                            "`output_attentions=True`. Please set your attention to `eager` "
                            "if you want any of these features.")
    if not isinstance(key, KVCodes) or not isinstance(value, KVCodes):
        raise StateError(f"attn_implementation {ATTN_IMPLEMENTATION!r} reads K/V from a "
                         f"KVCoreCache, got {type(key).__name__}: pass past_key_values="
                         f"KVCoreCache(model.config, format=...) and use_cache=True")
    layer = key.layer
    t = query.shape[2]
    refusal = _refusal(module, attention_mask, dropout, query, kwargs)
    variants = None if refusal else _variants(layer, query, kwargs)
    if refusal or isinstance(variants, str):
        if layer._new is not None and layer._new[0].shape[2] == t:
            layer._discard(t)                # the refused forward writes nothing
        raise StateError(refusal or variants)
    real = layer._new_columns(attention_mask, t)
    k, v = layer._new
    layer._new = None
    with limit(torch.get_num_threads()):     # within torch's threads, never beside them
        out = layer._write(k, v, real, _Attend(query, scaling, *variants))
    return out.to(query.dtype), None


def _refusal(module: torch.nn.Module, attention_mask: torch.Tensor | None, dropout: float,
             query: torch.Tensor, kwargs: dict) -> str | None:
    """Why the kvcore attention cannot run this call (None: it can)."""
    if attention_mask is not None and (attention_mask.ndim != 2
                                       or attention_mask.dtype != torch.bool):
        return ("kvcore attention applies its own causal mask: a custom attention mask of "
                f"shape {list(attention_mask.shape)} is not supported")
    if dropout or module.training or not getattr(module, "is_causal", True):
        return ("kvcore attention is causal inference only (no dropout, training or "
                "bidirectional attention)")
    if query.requires_grad and torch.is_grad_enabled():
        return ("kvcore attention has no backward: run under torch.no_grad() or "
                "torch.inference_mode()")
    return None


def _variants(layer: KVCoreLayer, query: torch.Tensor,
              kwargs: dict) -> tuple[float | None, np.ndarray | None] | str:
    """(softcap, sinks) of this call as decode_attention takes them, or why it cannot run
    (a string): the sliding window the module asks for must be its cache layer's."""
    if "sliding_window" in kwargs and kwargs["sliding_window"] != layer.window:
        return (f"the model attends with sliding_window={kwargs['sliding_window']!r}, its "
                f"KVCoreCache layer has window {layer.window!r}: build the KVCoreCache from "
                f"this model's config")
    softcap = kwargs.get("softcap")
    if softcap is not None and (isinstance(softcap, bool)
                                or not isinstance(softcap, (int, float))
                                or not math.isfinite(softcap) or softcap <= 0):
        return f"kvcore attention takes softcap as a finite float > 0, got {softcap!r}"
    s_aux, sinks = kwargs.get("s_aux"), None
    if s_aux is not None:
        hq = query.shape[1]
        if not isinstance(s_aux, torch.Tensor) or tuple(s_aux.shape) != (hq,):
            return (f"kvcore attention takes s_aux (sink logits) as a tensor of shape "
                    f"[{hq}] (one per query head), got "
                    f"{list(s_aux.shape) if isinstance(s_aux, torch.Tensor) else type(s_aux).__name__}")
        sinks = s_aux.detach().to(torch.float32).contiguous().numpy()
    return softcap, sinks


_AND_MASKS = and_masks(causal_mask_function).__code__
_WINDOW_OVERLAY = sliding_window_overlay(1).__code__


def _closure(fn, name: str):
    return fn.__closure__[fn.__code__.co_freevars.index(name)].cell_contents


def _mask_window(mask_function) -> int | None:
    """None for transformers' causal_mask_function, W for its
    sliding_window_causal_mask_function(W) (the causal mask and the sliding_window_overlay
    joined by and_masks, in either order); StateError for any other mask function."""
    if mask_function is causal_mask_function:
        return None
    if getattr(mask_function, "__code__", None) is _AND_MASKS:
        parts = _closure(mask_function, "mask_functions")
        if len(parts) == 2 and causal_mask_function in parts:
            overlay = parts[1] if parts[0] is causal_mask_function else parts[0]
            if getattr(overlay, "__code__", None) is _WINDOW_OVERLAY:
                w = _closure(overlay, "sliding_window")
                if isinstance(w, int) and not isinstance(w, bool) and w >= 1:
                    return w
    raise StateError(f"kvcore attention is causal attention, with or without a sliding "
                     f"window; this model asks for another mask "
                     f"({getattr(mask_function, '__qualname__', mask_function)})")


def kvcore_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0,
                kv_offset: int = 0, mask_function=causal_mask_function,
                attention_mask: torch.Tensor | None = None, local_size: int | None = None,
                **kwargs) -> torch.Tensor | None:
    """transformers mask function "kvcore": None for causal or sliding-window causal
    attention without padding (the kernel masks by position, a sliding layer's pool by
    its window), else the bool [B, kv_length] padding mask, which kvcore_attention
    honours by storing only the real positions. Refuses chunked or bidirectional windows
    and any other pattern, before a layer writes."""
    window = _mask_window(mask_function)
    config = kwargs.get("config")
    expected = None if config is None else getattr(config, "sliding_window", None)
    if (local_size is not None and local_size != window) or (
            window is not None and config is not None and window != expected):
        raise StateError(f"kvcore attention takes the sliding window of the model's config "
                         f"(sliding_window={expected!r}); this mask has window {window!r}, "
                         f"local_size={local_size!r}")
    if attention_mask is None:
        return None
    if tuple(attention_mask.shape) != (batch_size, kv_length) or kv_offset:
        raise ShapeError(f"invalid shape of attention_mask: expected [{batch_size}, "
                         f"{kv_length}] (rows, held + new positions), got "
                         f"{list(attention_mask.shape)} at offset {kv_offset}")
    return None if bool(attention_mask.all()) else attention_mask.to(torch.bool)


AttentionInterface.register(ATTN_IMPLEMENTATION, kvcore_attention)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, kvcore_mask)
