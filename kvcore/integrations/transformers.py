"""kvcore inside Hugging Face transformers: a `Cache` whose layers keep K/V in kvcore's
formats, and an attention function ("kvcore") that attends straight from the codes.

    import kvcore.integrations.transformers as kvhf   # registers attn_implementation "kvcore"
    model.set_attn_implementation("kvcore")           # or from_pretrained(..., attn_implementation="kvcore")
    out = model.generate(**inputs, past_key_values=kvhf.KVCoreCache(model.config, format="int8"))

How the two halves meet (docs/integrations.md):
1. `KVCoreLayer.update` encodes the new K/V into the layer's `kvcore.KVPool` (batch row b
   is pool sequence b) and returns two `KVCodes` handles instead of tensors: shaped like
   the history [B, Hkv, n, D], they hold no data, name the layer, and refuse every torch
   operation. No float copy of the history exists anywhere; another attention
   implementation fails loudly on them.
2. `kvcore_mask` (registered in `AttentionMaskInterface`) builds no mask: it returns None
   for plain causal attention, the 2-D padding mask when some positions are padding, and
   refuses what the kernel cannot express (sliding windows, bidirectional masks) before
   any layer writes.
3. `kvcore_attention` (registered in `AttentionInterface`) takes the layer from the handle,
   drops the padded new positions from its pool (so each row holds only its real
   positions, in order, and causal attention over them is exactly causal + padding),
   and runs `kvcore.decode_attention` on the pool's codes: each row's real new queries
   attend causally to the row's held positions (the new ones last).

CPU only; transformers is imported here only (the `hf` extra). The tested transformers
range is pinned in pyproject.toml (`kvcore[hf]`).
"""
from __future__ import annotations

import numpy as np
import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin, get_layer_types_and_kwargs
from transformers.masking_utils import AttentionMaskInterface, causal_mask_function
from transformers.utils import logging

from ..attention import decode_attention
from ..errors import DTypeError, OutOfRangeError, ShapeError, StateError
from ..formats import get_format
from ..pool import KVPool
from ..spec import KVSpec

logger = logging.get_logger(__name__)

ATTN_IMPLEMENTATION = "kvcore"
_MIN_CAPACITY = 256          # positions per row a growable layer starts with
_PAGE_SIZE = 16              # positions per pool page
_UNBOUNDED = 2**31 - 1       # positions per row without max_cache_len
_USE_KVCORE = (f"run the model with attn_implementation={ATTN_IMPLEMENTATION!r} "
               f"(model.set_attn_implementation({ATTN_IMPLEMENTATION!r}))")


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


class KVCoreLayer(CacheLayerMixin):
    """One decoder layer's K/V in a one-layer `kvcore.KVPool`: batch row b is pool
    sequence `seqs[b]` (CPU).

    format: a name of kvcore.FORMATS. num_heads: the model's query heads (Hq).
    max_cache_len: positions one row holds at most; None: unbounded. The pool starts
    with room for every row's first K/V (at least 256 positions each) and doubles its
    pages when a write needs more (each growth copies the codes once).

    transformers sees `columns` positions per row (padding included: get_seq_length);
    the pool holds only the real ones: `update` writes every new position, and the
    attention drops the padded ones again when the mask says so (`_apply_padding`).
    `real` (bool [B, columns], None while no column is padding) records which columns a
    row holds. Follows transformers' DynamicLayer conventions: `crop(-k)` drops the
    last k columns, `reset()` empties the layer and keeps its storage,
    `get_mask_sizes(q)` is (columns + q, 0); beam search reorders rows by forking pool
    sequences (full pages shared).
    """

    is_compileable = False
    is_croppable = True
    is_sliding = False

    def __init__(self, format: str, num_heads: int, max_cache_len: int | None = None):
        super().__init__()
        self.format = get_format(format).name
        self.num_heads = num_heads
        self.max_cache_len = max_cache_len
        self.pool: KVPool | None = None
        self.seqs: list[int] = []
        self.columns = 0
        self.real: np.ndarray | None = None
        self._new: tuple[torch.Tensor, torch.Tensor] | None = None   # the last update's K/V

    def __repr__(self) -> str:
        return (f"KVCoreLayer(format={self.format!r}, rows={len(self.seqs)}, "
                f"columns={self.columns}, pool={self.pool!r})")

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Sizes the pool from the first K/V: [B, Hkv, T, D] CPU tensors of float32,
        float16 or bfloat16."""
        _check_states(key_states, value_states)
        b, hkv, t, d = key_states.shape
        spec = KVSpec(num_layers=1, num_kv_heads=hkv, head_dim=d,
                      capacity=self.max_cache_len or _UNBOUNDED, num_heads=self.num_heads,
                      format=self.format)
        per_row = -(-(self.max_cache_len or max(_MIN_CAPACITY, t)) // _PAGE_SIZE)
        self.dtype, self.device = key_states.dtype, key_states.device
        self.pool = KVPool(spec, b * per_row, _PAGE_SIZE)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args,
               **kwargs) -> tuple[KVCodes, KVCodes]:
        """Encodes the new positions (K/V [B, Hkv, T, D]) after every row's held ones and
        returns handles to the whole history (see KVCodes): never a float copy of it."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        _check_states(key_states, value_states)
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
        self._reserve([t] * b)
        self.pool.append_batch(_rows(key_states), _rows(value_states), seqs=self.seqs, layer=0,
                               counts=None if t == 1 else [t] * b)          # None: 1 each
        self.pool.advance()
        self.columns += t
        if self.real is not None:
            self.real = np.concatenate([self.real, np.ones((b, t), bool)], axis=1)
        self._new = (key_states, value_states)
        shape = (b, spec.num_kv_heads, self.columns, spec.head_dim)
        return KVCodes(self, shape, self.dtype), KVCodes(self, shape, self.dtype)

    def _reserve(self, counts: list[int], forks: int = 0) -> None:
        """Grows the pool (doubling its pages, at least to what it needs) when writing
        counts[b] more positions to row b, after `forks` forks, needs more pages than are
        free. The growth moves every row's codes into the new pool once."""
        pool = self.pool
        held = [pool.length(s) for s in self.seqs]
        need = forks + sum(pool.pages_for(n + c) - pool.pages_for(n) for n, c in zip(held, counts))
        if need <= pool.num_free_pages:
            return
        distinct = sum(pool.pages_for(n) for n in held) + need
        grown = KVPool(pool.spec, max(2 * pool.num_pages, distinct), pool.page_size)
        self.seqs = [grown.restore(pool.snapshot(s)) for s in self.seqs]
        self.pool = grown

    def _apply_padding(self, mask: torch.Tensor | None, t: int) -> np.ndarray | None:
        """Called by the attention with the mask of this forward (None: no padding, or a
        bool [B, columns] padding mask from kvcore_mask) for the T = t new columns the
        last update wrote. Drops the padded ones of them from the pool and returns which
        new columns are real (bool [B, t]), or None when all are. Refuses (undoing the last
        update) a mask that disagrees with the held rows."""
        new_kv, self._new = self._new, None
        held = self.columns - t
        if mask is None:
            if self.real is not None:
                self._drop(t)
                raise StateError("this KVCoreCache holds padded rows: the attention_mask must "
                                 "mark them (generate's does), got none or one with no padding")
            return None
        m = mask.detach().numpy()
        if m.shape != (len(self.seqs), self.columns):
            self._drop(t)
            raise ShapeError(f"invalid shape of the padding mask: expected "
                             f"[{len(self.seqs)}, {self.columns}] (rows, held + new columns), "
                             f"got {list(m.shape)}")
        past = m[:, :held]
        if not (past.all() if self.real is None else np.array_equal(past, self.real[:, :held])):
            self._drop(t)
            raise StateError("the attention_mask changes which held positions are padding: "
                             "kvcore stores only the real ones, so a mask may mark new "
                             "positions only")
        new = m[:, held:]
        if new.all():
            return None
        if new_kv is None or new_kv[0].shape[2] != t:
            raise StateError(f"the kvcore attention needs the K/V of its layer's last update "
                             f"({t} new positions)")
        pool, cut = self.pool, np.flatnonzero(~new.all(axis=1))
        for b in cut:
            pool.truncate(self.seqs[b], pool.length(self.seqs[b]) - t)
        keep = new[cut]
        k, v = (_rows(x[torch.from_numpy(cut)], keep) for x in new_kv)
        pool.append_batch(k, v, seqs=[self.seqs[b] for b in cut], layer=0,
                          counts=keep.sum(axis=1))
        pool.advance()
        if self.real is None:
            self.real = np.ones((len(self.seqs), self.columns), bool)
        self.real[:, held:] = new
        return new

    def _drop(self, columns: int) -> None:
        """Drops the last `columns` columns of every row (their real positions)."""
        pool = self.pool
        kept = self.columns - columns
        for b, s in enumerate(self.seqs):
            real = columns if self.real is None else int(self.real[b, kept:].sum())
            pool.truncate(s, pool.length(s) - real)
        self.columns = kept
        if self.real is not None:
            self.real = self.real[:, :kept]
            if self.real.all():
                self.real = None

    def get_seq_length(self) -> int:
        return self.columns

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.columns + query_length, 0

    def get_max_length(self) -> int:
        return -1 if self.max_cache_len is None else self.max_cache_len

    def reset(self) -> None:
        """Empties the layer; its storage stays for the next batch."""
        for s in self.seqs:
            self.pool.free(s)
        self.seqs, self.columns, self.real, self._new = [], 0, None, None

    def crop(self, tokens_to_remove: int) -> None:
        """crop(-k) drops the last k columns of every row (transformers' convention;
        crop(0) is a no-op)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes minus the number of positions to drop, got "
                             f"{tokens_to_remove}")
        if -tokens_to_remove > self.columns:
            raise OutOfRangeError(f"crop({tokens_to_remove}) out of range: the layer holds "
                                  f"{self.columns} positions")
        if tokens_to_remove:
            self._drop(-tokens_to_remove)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keeps rows `indices` (in that order; a row may repeat): pool sequences forked
        (full pages shared), the old ones freed."""
        if not self.columns:
            return
        idx = torch.as_tensor(indices).reshape(-1).tolist()
        if not all(0 <= i < len(self.seqs) for i in idx):
            raise OutOfRangeError(f"batch indices out of range: expected 0 <= i < "
                                  f"{len(self.seqs)}, got {idx}")
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
    "int8", "fp8_e4m3", "fp8_e5m2", "q8_0"). max_cache_len: positions per row at most;
    None grows as needed. Only full-attention decoder layers (no sliding windows).
    copy.deepcopy and pickle give an independent cache holding the same rows (the
    prompt reuse recipe: prefill once, deepcopy per request).
    """

    def __init__(self, config, format: str = "f16", max_cache_len: int | None = None):
        config = config.get_text_config(decoder=True)
        if config._attn_implementation != ATTN_IMPLEMENTATION:
            raise StateError(f"KVCoreCache needs the kvcore attention, the model runs "
                             f"{config._attn_implementation!r}: {_USE_KVCORE}")
        layer_types, _ = get_layer_types_and_kwargs(config)
        other = sorted(set(layer_types) - {"full_attention"})
        if other:
            raise StateError(f"KVCoreCache supports full-attention layers only, the model has {other}")
        if max_cache_len is not None and (isinstance(max_cache_len, bool)
                                          or not isinstance(max_cache_len, int)
                                          or max_cache_len <= 0):
            raise ShapeError(f"max_cache_len must be a positive int or None, got {max_cache_len!r}")
        self.format = get_format(format).name
        super().__init__(layers=[KVCoreLayer(self.format, config.num_attention_heads, max_cache_len)
                                 for _ in layer_types])

    @property
    def memory_bytes(self) -> int:
        """Bytes of the layers' kvcore storage (allocated capacity, codes and scales)."""
        return sum(layer.pool.memory_bytes for layer in self.layers if layer.is_initialized)


def kvcore_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                     value: torch.Tensor, attention_mask: torch.Tensor | None,
                     scaling: float | None = None, dropout: float = 0.0,
                     **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention function "kvcore": query [B, Hq, T, D] attends causally to
    each row's held positions, read from the codes; attention_mask is what kvcore_mask
    returned (None, or the bool [B, columns] padding mask: padded positions are dropped
    from the pool, padded queries get zeros). Returns ([B, T, Hq, D] in the query's
    dtype, None). key/value must be the KVCodes a KVCoreCache layer returned.
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
    b, hq, t, d = query.shape
    refusal = _refusal(module, attention_mask, dropout, query, kwargs)
    if refusal:
        layer._drop(t)                       # the refused forward writes nothing
        layer._new = None
        raise StateError(refusal)
    real = layer._apply_padding(attention_mask, t)
    q = query.detach()
    q = q if q.dtype == torch.float32 else q.float()
    rows = _rows(q, real)                    # [queries, Hq, D]
    counts = (None if t == 1 else [t] * b) if real is None else real.sum(axis=1)  # None: 1 each
    out = decode_attention(rows, layer.pool, 0, seqs=layer.seqs, counts=counts, scale=scaling)
    if real is None:
        full = torch.from_numpy(out).view(b, t, hq, d)
    else:
        full = torch.zeros(b, t, hq, d)
        full[torch.from_numpy(real)] = torch.from_numpy(out)
    return full.to(query.dtype), None


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
    unsupported = [k for k in ("sliding_window", "softcap", "s_aux") if kwargs.get(k) is not None]
    if unsupported:
        return f"kvcore attention does not support {unsupported}"
    if query.requires_grad and torch.is_grad_enabled():
        return ("kvcore attention has no backward: run under torch.no_grad() or "
                "torch.inference_mode()")
    return None


def kvcore_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0,
                kv_offset: int = 0, mask_function=causal_mask_function,
                attention_mask: torch.Tensor | None = None, local_size: int | None = None,
                **kwargs) -> torch.Tensor | None:
    """transformers mask function "kvcore": None for plain causal attention without
    padding (the kernel masks by position), else the bool [B, kv_length] padding mask,
    which kvcore_attention honours by storing only the real positions. Refuses sliding or
    chunked windows and any other pattern, before a layer writes."""
    if mask_function is not causal_mask_function or local_size is not None:
        raise StateError(f"kvcore attention is plain causal attention; this model asks for "
                         f"another mask ({getattr(mask_function, '__name__', mask_function)}, "
                         f"local_size={local_size})")
    if attention_mask is None:
        return None
    if tuple(attention_mask.shape) != (batch_size, kv_length) or kv_offset:
        raise ShapeError(f"invalid shape of attention_mask: expected [{batch_size}, "
                         f"{kv_length}] (rows, held + new positions), got "
                         f"{list(attention_mask.shape)} at offset {kv_offset}")
    return None if bool(attention_mask.all()) else attention_mask.to(torch.bool)


AttentionInterface.register(ATTN_IMPLEMENTATION, kvcore_attention)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, kvcore_mask)
