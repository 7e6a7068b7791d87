"""kvcore inside Hugging Face transformers: a `Cache` whose layers keep K/V in kvcore's
formats, and an attention function ("kvcore") that attends straight from the codes.

    import kvcore.integrations.transformers as kvhf   # registers attn_implementation "kvcore"
    model.set_attn_implementation("kvcore")           # or from_pretrained(..., attn_implementation="kvcore")
    out = model.generate(**inputs, past_key_values=kvhf.KVCoreCache(model.config, format="int8"))

How the two halves meet (docs/integrations.md):
1. `KVCoreLayer.update` encodes the new K/V into the layer's `kvcore.KVCache` and returns
   two `KVCodes` handles instead of tensors: shaped like the history [B, Hkv, n, D], they
   hold no data, name the layer, and refuse every torch operation. No float copy of the
   history exists anywhere; another attention implementation fails loudly on them.
2. `kvcore_attention` (registered in `AttentionInterface`) takes the layer from the handle
   and runs `kvcore.decode_attention` on its codes: the T new queries attend causally to
   the n held positions (the new ones last).
3. `kvcore_mask` (registered in `AttentionMaskInterface`) builds no mask: it refuses what
   the kernel cannot express (padding, sliding windows, bidirectional masks) before any
   layer writes, and returns None for plain causal attention.

Batch size 1 on the CPU; transformers is imported here only (the `hf` extra). The tested
transformers range is pinned in pyproject.toml (`kvcore[hf]`).
"""
from __future__ import annotations

import numpy as np
import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin, get_layer_types_and_kwargs
from transformers.masking_utils import AttentionMaskInterface, causal_mask_function

from ..attention import decode_attention
from ..cache import KVCache
from ..errors import DTypeError, ShapeError, StateError
from ..formats import get_format
from ..spec import KVSpec

ATTN_IMPLEMENTATION = "kvcore"
_MIN_CAPACITY = 256          # positions a growable layer starts with
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


def _numpy_rows(x: torch.Tensor) -> np.ndarray:
    """[1, H, T, D] float32/float16/bfloat16 tensor -> numpy [T, H, D] view (no copy)."""
    x = x.detach()[0].transpose(0, 1)
    if x.dtype == torch.bfloat16:
        import ml_dtypes
        return x.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return x.numpy()


class KVCoreLayer(CacheLayerMixin):
    """One decoder layer's K/V in a `kvcore.KVCache` (one layer, batch 1, CPU).

    format: a name of kvcore.FORMATS. num_heads: the model's query heads (Hq).
    max_cache_len: positions held at most; None grows the storage by doubling (each
    growth copies the codes once). Follows transformers' DynamicLayer conventions:
    `crop(-k)` drops the last k positions, `reset()` empties the layer and keeps its
    storage, `get_mask_sizes(q)` is (held + q, 0).
    """

    is_compileable = False
    is_croppable = True
    is_sliding = False

    def __init__(self, format: str, num_heads: int, max_cache_len: int | None = None):
        super().__init__()
        self.format = get_format(format).name
        self.num_heads = num_heads
        self.max_cache_len = max_cache_len
        self.kv: KVCache | None = None

    def __repr__(self) -> str:
        return f"KVCoreLayer(format={self.format!r}, kv={self.kv!r})"

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Sizes the kvcore cache from the first K/V: [1, Hkv, T, D] CPU tensors of
        float32, float16 or bfloat16."""
        _check_states(key_states, value_states)
        _, hkv, t, d = key_states.shape
        capacity = self.max_cache_len or max(_MIN_CAPACITY, t)
        self.dtype, self.device = key_states.dtype, key_states.device
        self.kv = KVCache(KVSpec(num_layers=1, num_kv_heads=hkv, head_dim=d, capacity=capacity,
                                 num_heads=self.num_heads, format=self.format))
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args,
               **kwargs) -> tuple[KVCodes, KVCodes]:
        """Encodes the new positions (K/V [1, Hkv, T, D]) after the held ones and returns
        handles to the whole history (see KVCodes): never a float copy of it."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        _check_states(key_states, value_states)
        spec = self.kv.spec
        expected = (1, spec.num_kv_heads, key_states.shape[2], spec.head_dim)
        if tuple(key_states.shape) != expected or key_states.dtype != self.dtype:
            raise ShapeError(f"invalid K/V for this layer: expected {list(expected)} of "
                             f"{self.dtype}, got {list(key_states.shape)} of {key_states.dtype}")
        n = self.kv.length + key_states.shape[2]
        if n > spec.capacity and self.max_cache_len is None:
            self._grow(n)
        self.kv.append(0, _numpy_rows(key_states), _numpy_rows(value_states))
        self.kv.advance()
        shape = (1, spec.num_kv_heads, n, spec.head_dim)
        return KVCodes(self, shape, self.dtype), KVCodes(self, shape, self.dtype)

    def _grow(self, n: int) -> None:
        """Moves the codes into a cache of at least n positions (double the capacity)."""
        old = self.kv
        spec = old.spec
        capacity = max(n, 2 * spec.capacity)
        self.kv = KVCache(KVSpec(num_layers=1, num_kv_heads=spec.num_kv_heads,
                                 head_dim=spec.head_dim, capacity=capacity,
                                 num_heads=spec.num_heads, format=spec.format))
        self.kv.restore(old.snapshot())

    def get_seq_length(self) -> int:
        return self.kv.length if self.is_initialized else 0

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1 if self.max_cache_len is None else self.max_cache_len

    def reset(self) -> None:
        """Empties the layer; its storage stays for the next sequence."""
        if self.is_initialized:
            self.kv.reset()

    def crop(self, tokens_to_remove: int) -> None:
        """crop(-k) drops the last k positions (transformers' convention; crop(0) is a no-op)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes minus the number of positions to drop, got "
                             f"{tokens_to_remove}")
        if tokens_to_remove and self.is_initialized:
            self.kv.truncate(self.kv.length + tokens_to_remove)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise StateError("KVCoreCache holds batch size 1: beam search is not supported")


def _check_states(key_states: torch.Tensor, value_states: torch.Tensor) -> None:
    if key_states.shape != value_states.shape:
        raise ShapeError(f"K and V differ in shape: {list(key_states.shape)} and "
                         f"{list(value_states.shape)}")
    if key_states.ndim != 4 or key_states.shape[0] != 1:
        raise ShapeError(f"KVCoreCache holds batch size 1 (padded batches are not supported "
                         f"yet): got K/V of shape {list(key_states.shape)}")
    if key_states.device.type != "cpu" or value_states.device.type != "cpu":
        raise DTypeError(f"KVCoreCache runs on the CPU: got K/V on {key_states.device}")
    allowed = (torch.float32, torch.float16, torch.bfloat16)
    if key_states.dtype not in allowed or value_states.dtype not in allowed:
        raise DTypeError(f"invalid dtype of K/V: expected float32, float16 or bfloat16, got "
                         f"{key_states.dtype}")


class KVCoreCache(Cache):
    """A transformers `Cache` storing every layer's K/V in a kvcore format (batch 1, CPU).

    config: the model's config (its text config is used); the model must run with
    attn_implementation "kvcore". format: a name of kvcore.FORMATS ("f32", "f16", "bf16",
    "int8", "fp8_e4m3", "fp8_e5m2", "q8_0"). max_cache_len: positions per layer at most;
    None grows as needed. Only full-attention decoder layers (no sliding windows).
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
        return sum(layer.kv.memory_bytes for layer in self.layers if layer.is_initialized)


def kvcore_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                     value: torch.Tensor, attention_mask: torch.Tensor | None,
                     scaling: float | None = None, dropout: float = 0.0,
                     **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention function "kvcore": query [1, Hq, T, D] attends causally to
    the layer's held positions, read from the codes. Returns ([1, T, Hq, D] in the query's
    dtype, None). key/value must be the KVCodes a KVCoreCache layer returned."""
    if not isinstance(key, KVCodes) or not isinstance(value, KVCodes):
        raise StateError(f"attn_implementation {ATTN_IMPLEMENTATION!r} reads K/V from a "
                         f"KVCoreCache, got {type(key).__name__}: pass past_key_values="
                         f"KVCoreCache(model.config, format=...) and use_cache=True")
    if attention_mask is not None:
        raise StateError("kvcore attention applies its own causal mask: a custom attention "
                         f"mask of shape {list(attention_mask.shape)} is not supported")
    if dropout or module.training or not getattr(module, "is_causal", True):
        raise StateError("kvcore attention is causal inference only (no dropout, training "
                         "or bidirectional attention)")
    unsupported = [k for k in ("sliding_window", "softcap", "s_aux") if kwargs.get(k) is not None]
    if unsupported:
        raise StateError(f"kvcore attention does not support {unsupported}")
    if query.requires_grad and torch.is_grad_enabled():
        raise StateError("kvcore attention has no backward: run under torch.no_grad() or "
                         "torch.inference_mode()")
    q = query.detach()[0].transpose(0, 1)           # [T, Hq, D]
    q = q.numpy() if q.dtype == torch.float32 else q.float().numpy()
    out = decode_attention(q, key.layer.kv, 0, scale=scaling)
    return torch.from_numpy(out).unsqueeze(0).to(query.dtype), None


def kvcore_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0,
                kv_offset: int = 0, mask_function=causal_mask_function,
                attention_mask: torch.Tensor | None = None, local_size: int | None = None,
                **kwargs) -> None:
    """transformers mask function "kvcore": None for plain causal attention (the kernel
    masks by position); refuses a padding mask, sliding/chunked windows and any other
    pattern, before a layer writes."""
    if mask_function is not causal_mask_function or local_size is not None:
        raise StateError(f"kvcore attention is plain causal attention; this model asks for "
                         f"another mask ({getattr(mask_function, '__name__', mask_function)}, "
                         f"local_size={local_size})")
    if attention_mask is not None and not bool(attention_mask.all()):
        raise StateError(f"kvcore attention does not support padding yet: the attention_mask "
                         f"of shape {list(attention_mask.shape)} masks "
                         f"{int((~attention_mask.bool()).sum())} positions")
    return None


AttentionInterface.register(ATTN_IMPLEMENTATION, kvcore_attention)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, kvcore_mask)
