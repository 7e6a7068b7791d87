"""Attention variants inside transformers (docs/integrations.md, "Models and variants"):
sliding windows, hybrid stacks of sliding and global layers, attention logit
soft-capping and gpt-oss' sink logits, as transformers builds Mistral, Qwen2, Phi-3,
Gemma 2, Gemma 3, Cohere 2 and gpt-oss. Small random-weight models from configs (no
download), with a window W = 5 shorter than every prompt, run by HF's eager attention on
a DynamicCache built from the config (transformers' own sliding layers: the reference)
and by the kvcore attention on a KVCoreCache.

f32 storage must give eager's tokens and logits within float32 rounding (64 ulps of the
largest logit, as tests/test_hf.py), for greedy decoding, a left-padded batch of 3,
chunked prefill across the window's edge and beam search; crop rolls back as far as
transformers' sliding layers do; the variants are checked to change the reference's
logits (a kernel that ignored one would fail).
"""
import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from transformers import (Cache, Cohere2Config, Cohere2ForCausalLM, DynamicCache,  # noqa: E402
                          Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig,
                          GptOssConfig, GptOssForCausalLM, LlamaConfig, LlamaForCausalLM,
                          MistralConfig, MistralForCausalLM, Phi3Config, Phi3ForCausalLM,
                          Qwen2Config, Qwen2ForCausalLM)
from transformers.cache_utils import DynamicLayer  # noqa: E402

import kvcore  # noqa: E402
from kvcore.integrations import transformers as kvhf  # noqa: E402

W = 5                    # the window: shorter than every prompt below
PROMPT, NEW = 19, 12
LENGTHS = [19, 11, 5]    # the padded batch's prompts (left padded to 19)
S, F = "sliding_attention", "full_attention"
COMMON = dict(hidden_size=128, intermediate_size=128, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=256, max_position_embeddings=512,
              pad_token_id=0, bos_token_id=1, eos_token_id=2)

# family -> (model class, config class, config): all sliding (Mistral, Phi-3), or hybrid
# stacks (Qwen2's sliding layers from max_window_layers on; the others by layer_types)
FAMILIES = {
    "mistral": (MistralForCausalLM, MistralConfig, dict(head_dim=32)),
    "qwen2": (Qwen2ForCausalLM, Qwen2Config, dict(use_sliding_window=True, max_window_layers=1)),
    "phi3": (Phi3ForCausalLM, Phi3Config, {}),
    "gemma2": (Gemma2ForCausalLM, Gemma2Config,
               dict(head_dim=32, layer_types=[S, F], attn_logit_softcapping=5.0,
                    query_pre_attn_scalar=24)),
    "gemma3": (Gemma3ForCausalLM, Gemma3TextConfig,
               dict(head_dim=32, layer_types=[S, F], query_pre_attn_scalar=24)),
    "cohere2": (Cohere2ForCausalLM, Cohere2Config, dict(head_dim=32, layer_types=[S, F])),
    "gpt_oss": (GptOssForCausalLM, GptOssConfig,
                dict(head_dim=32, layer_types=[S, F], num_local_experts=4,
                     num_experts_per_tok=2, max_position_embeddings=131072)),
}
LAYER_TYPES = {"mistral": [S, S], "qwen2": [F, S], "phi3": [S, S], "gemma2": [S, F],
               "gemma3": [S, F], "cohere2": [S, F], "gpt_oss": [S, F]}


def _model(family, window=W, dtype=torch.float32, seed=0, **overrides):
    """A random 2-layer model whose attention is sharp: q/k projections scaled up (Gemma
    3's q/k norms instead), gpt-oss' sink logits drawn in [0, 8) so that they take a
    real share of each softmax."""
    cls, config_cls, extra = FAMILIES[family]
    torch.manual_seed(seed)
    config = config_cls(**{**COMMON, "num_hidden_layers": 2, "sliding_window": window,
                           **extra, **overrides})
    model = cls(config).eval()
    hq, hkv = config.num_attention_heads, config.num_key_value_heads
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            for name in ("q_proj", "k_proj"):
                if hasattr(attn, name):
                    getattr(attn, name).weight.mul_(6.0)
            if hasattr(attn, "qkv_proj"):                       # Phi-3: q, k, v stacked
                attn.qkv_proj.weight[:(hq + hkv) * attn.head_dim].mul_(6.0)
            for name in ("q_norm", "k_norm"):                   # Gemma 3: x * (1 + w)
                if hasattr(attn, name):
                    getattr(attn, name).weight.fill_(2.0)
            if hasattr(attn, "sinks"):
                attn.sinks.copy_(torch.rand(hq, generator=torch.Generator().manual_seed(3)) * 8)
    return model.to(dtype)


def _prompt(n=PROMPT, seed=1):
    return torch.randint(3, 256, (1, n), generator=torch.Generator().manual_seed(seed))


def _padded(lengths=LENGTHS):
    """Prompts of these lengths, left padded with token 0, and their attention mask."""
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, n in enumerate(lengths):
        ids[b, ids.shape[1] - n:] = _prompt(n, seed=b + 1)[0]
        mask[b, ids.shape[1] - n:] = 1
    return ids, mask


def _generate(model, impl, cache, ids, mask=None, new=NEW, **kw):
    model.set_attn_implementation(impl)
    out = model.generate(ids, attention_mask=torch.ones_like(ids) if mask is None else mask,
                         past_key_values=cache, max_new_tokens=new, min_new_tokens=new,
                         output_logits=True,
                         return_dict_in_generate=True, pad_token_id=0, **kw)
    return out.sequences, torch.stack(out.logits)


def _reference(model):
    """transformers' own cache for the model: sliding layers keep W - 1 positions."""
    return DynamicCache(config=model.config)


def _kvcore(model, fmt="f32", **kw):
    model.set_attn_implementation("kvcore")
    return kvhf.KVCoreCache(model.config, format=fmt, **kw)


def _assert_logits_close(got, want, ulps=64):
    """Within float32 rounding of the logits' scale (64 ulps of the largest)."""
    bound = ulps * np.finfo(np.float32).eps * want.abs().max().item()
    err = (got - want).abs().max().item()
    assert err <= bound, f"logits differ by {err:.3g}, float32 rounding bound {bound:.3g}"


def _logits(model, impl, cache, ids, mask=None):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model(ids, attention_mask=mask, past_key_values=cache).logits


family = pytest.mark.parametrize("family", list(FAMILIES))


@family
def test_the_variants_change_the_reference(family):
    """The layer types are what transformers builds (its own cache's sliding layers), the
    attention is sharp (the mean top weight of the last queries is far above uniform),
    and each variant changes eager's logits: the window (against one wider than the
    prompt), Gemma 2's soft-capping, gpt-oss' sink logits. So none can be ignored
    unnoticed."""
    model = _model(family)
    ref = _reference(model)
    assert [layer.is_sliding for layer in ref.layers] == [t == S for t in LAYER_TYPES[family]]
    windows = [layer.window for layer in _kvcore(model).layers]
    assert windows == [W if t == S else None for t in LAYER_TYPES[family]]
    ids = _prompt()
    model.set_attn_implementation("eager")
    with torch.no_grad():
        out = model(ids, output_attentions=True)
    want = out.logits
    top = torch.stack([a[0, :, -8:].max(-1).values.mean() for a in out.attentions])
    assert top.min().item() > 0.3, top           # uniform over the window: 1 / 5
    scale = want.abs().max().item()
    wide = _logits(_model(family, window=1000), "eager", DynamicCache(), ids)
    assert (wide - want).abs().max().item() > 0.05 * scale
    if family == "gemma2":
        uncapped = _model(family, attn_logit_softcapping=None)
        assert (_logits(uncapped, "eager", DynamicCache(), ids) - want).abs().max() > 0.05 * scale
    if family == "gpt_oss":
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.fill_(-1e4)        # no sink
        assert (_logits(model, "eager", DynamicCache(), ids) - want).abs().max() > 0.05 * scale


@family
def test_greedy_matches_eager(family):
    """f32: eager's greedy tokens and logits within float32 rounding over 12 new tokens
    past a 19-token prompt; the sliding layers hold only their window's pages."""
    model = _model(family)
    want_ids, want_logits = _generate(model, "eager", _reference(model), _prompt())
    cache = _kvcore(model)
    got_ids, got_logits = _generate(model, "kvcore", cache, _prompt())
    assert torch.equal(got_ids, want_ids)
    _assert_logits_close(got_logits, want_logits)
    n = PROMPT + NEW - 1
    assert cache.get_seq_length() == n
    for layer in cache.layers:
        (seq,) = layer.seqs
        assert layer.pool.length(seq) == n
        # a sliding row holds [first_held, n) with first_held the page of n - W + 1
        first = (n - W + 1) // 16 * 16 if layer.is_sliding else 0
        assert layer.pool.held(seq) == [(first, n)]


@family
def test_padded_batch_matches_eager(family):
    """Batch 3 of prompts of 19, 11 and 5 tokens, left padded: eager's tokens and logits
    (f32), each pool sequence holding only its row's real positions."""
    model = _model(family)
    ids, mask = _padded()
    want_ids, want_logits = _generate(model, "eager", _reference(model), ids, mask)
    cache = _kvcore(model)
    got_ids, got_logits = _generate(model, "kvcore", cache, ids, mask)
    assert torch.equal(got_ids, want_ids)
    _assert_logits_close(got_logits, want_logits)
    for layer in cache.layers:
        assert [layer.pool.length(s) for s in layer.seqs] == [n + NEW - 1 for n in LENGTHS]


@family
def test_chunked_prefill_across_the_window_edge(family):
    """The padded batch's prompts in pieces of 3, 1, 8 and 7 columns (each past W = 5
    columns after the last, so later queries see part of an earlier piece and not the
    rest), then a decode step: the logits of every real position equal eager's one pass."""
    model = _model(family)
    ids, mask = _padded()
    step = torch.randint(3, 256, (3, 1), generator=torch.Generator().manual_seed(8))
    full = torch.cat([mask, torch.ones(3, 1, dtype=torch.long)], dim=1)
    cache = _kvcore(model)
    parts = [_logits(model, "kvcore", cache, ids[:, a:b], mask[:, :b])
             for a, b in [(0, 3), (3, 4), (4, 12), (12, 19)]]
    parts.append(_logits(model, "kvcore", cache, step, full))
    ref = _reference(model)
    want = [_logits(model, "eager", ref, ids, mask), _logits(model, "eager", ref, step, full)]
    real = full.bool()
    _assert_logits_close(torch.cat(parts, dim=1)[real], torch.cat(want, dim=1)[real])


@family
def test_beam_search_matches_eager(family):
    """3 beams over a padded batch of 2: reorder_cache forks the (windowed) pool
    sequences; the beams equal eager's."""
    model = _model(family)
    ids, mask = _padded([19, 8])
    want, _ = _generate(model, "eager", _reference(model), ids, mask, new=8, num_beams=3)
    cache = _kvcore(model)
    reorders = []
    reorder = cache.reorder_cache
    cache.reorder_cache = lambda idx: (reorders.append(idx.tolist()), reorder(idx))
    got, _ = _generate(model, "kvcore", cache, ids, mask, new=8, num_beams=3)
    assert torch.equal(got, want)
    assert any(r != sorted(r) for r in reorders), reorders   # rows really moved
    for layer in cache.layers:
        assert len(layer.seqs) == 6 == len(layer.pool.sequences)


@family
def test_crop(family):
    """crop(-k) on a padded batch, then the dropped columns again: the same logits.
    Within what a sliding layer still holds it works at any time; past that only into
    the last forward once past recording is on (as transformers' sliding layers), and a
    crop out of reach is refused with nothing changed."""
    model = _model(family)
    ids, mask = _padded()
    steps = torch.randint(3, 256, (3, 4), generator=torch.Generator().manual_seed(9))
    full = torch.cat([mask, torch.ones(3, 4, dtype=torch.long)], dim=1)
    cache = _kvcore(model)
    prefill = _logits(model, "kvcore", cache, ids, mask)
    cache.crop(-4)                       # 15 columns: every row still holds what W needs
    assert cache.get_seq_length() == 15
    _assert_logits_close(_logits(model, "kvcore", cache, ids[:, -4:], mask), prefill[:, -4:])
    cache.activate_past_recording()
    first = _logits(model, "kvcore", cache, steps, full)
    lengths = lambda: [[layer.pool.length(s) + layer.pool.pending(s, 0) for s in layer.seqs]
                       for layer in cache.layers]          # recording: the last forward pending
    held = lengths()
    for k in (4, 3, 1):                  # into the last forward, past the window's pages
        cache.crop(-k)
        assert cache.get_seq_length() == 23 - k
        again = _logits(model, "kvcore", cache, steps[:, 4 - k:], full)
        _assert_logits_close(again, first[:, 4 - k:])
    assert lengths() == held
    cache.crop(0)                        # commits the recorded forward
    with pytest.raises(kvcore.StateError, match="out of reach.*activate_past_recording"):
        cache.crop(-4)                   # row 0 would need position 15, the window left 16
    assert cache.get_seq_length() == 23 and lengths() == held
    cache.crop(-2)                       # still held
    _assert_logits_close(_logits(model, "kvcore", cache, steps[:, 2:], full), first[:, 2:])


@pytest.mark.parametrize("family", ["mistral", "gemma2", "gpt_oss"])
def test_assisted_generation_equals_greedy(family):
    """Assisted generation turns past recording on and rolls the cache back with crop at
    every step (a poor assistant: most drafts rejected): the tokens equal greedy's."""
    model = _model(family)
    assistant = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=64,
                                             num_hidden_layers=1, num_attention_heads=2,
                                             vocab_size=256, pad_token_id=0)).eval()
    assistant.set_attn_implementation("sdpa")
    greedy, _ = _generate(model, "kvcore", _kvcore(model), _prompt())
    cache = _kvcore(model)
    crops = []
    crop = cache.crop
    cache.crop = lambda k: (crops.append(k), crop(k))
    assisted, _ = _generate(model, "kvcore", cache, _prompt(), assistant_model=assistant)
    assert torch.equal(assisted, greedy)
    assert any(k < 0 for k in crops), crops
    assert cache.get_seq_length() == PROMPT + NEW - 1


class _RoundTripLayer(DynamicLayer):
    """HF's own dynamic layer, fed K/V after a kvcore quantize/dequantize round trip."""

    def __init__(self, fmt):
        super().__init__()
        self.fmt = fmt

    def update(self, key_states, value_states, *args, **kwargs):
        return super().update(*(torch.from_numpy(kvcore.dequantize(
            *kvcore.quantize(x.detach().float().numpy(), self.fmt), self.fmt)) for x in
            (key_states, value_states)))


@pytest.mark.parametrize("family, fmt", [("mistral", "int8"), ("gemma2", "q8_0"),
                                         ("gpt_oss", "fp8_e4m3")])
def test_quantized_formats_match_eager_on_the_same_values(family, fmt):
    """One sliding layer (so both runs quantize the very same K/V): eager on the same
    quantize/dequantize round trip gives the same tokens and logits, padded batch."""
    model = _model(family, num_hidden_layers=1, layer_types=[S])
    ids, mask = _padded()
    want_ids, want_logits = _generate(model, "eager", Cache(layers=[_RoundTripLayer(fmt)]),
                                      ids, mask)
    cache = _kvcore(model, fmt)
    got_ids, got_logits = _generate(model, "kvcore", cache, ids, mask)
    assert torch.equal(got_ids, want_ids)
    _assert_logits_close(got_logits, want_logits)
    assert cache.layers[0].pool.spec.format == fmt and cache.layers[0].window == W


def test_kivi_pair_on_sliding_layers_matches_eager_on_the_stored_codes(monkeypatch):
    """K q4_1ch / V q4_1 (KIVI) in Mistral's sliding layers, a window of 39 over a
    70-token prompt and 12 new tokens (the window releases pages of whole groups): at every
    layer and step, kvcore's attention equals eager's on the dequantized codes the layer
    holds under the window's mask, within float32 rounding. (Read after the step's
    advance, which releases the pages no later query sees: rows are checked where their
    window is still held, every decode step's with W = 39.)"""
    from transformers import AttentionInterface
    from transformers.models.mistral.modeling_mistral import eager_attention_forward
    model = _model("mistral", window=39)
    real, errors = kvhf.kvcore_attention, []

    def checked(module, query, key, value, attention_mask, scaling=None, **kw):
        out, _ = real(module, query, key, value, attention_mask, scaling=scaling, **kw)
        pool, seq = key.layer.pool, key.layer.seqs[0]
        k, v = (torch.from_numpy(pool.dequantize(seq, 0, w, pending=True)).transpose(0, 1)[None]
                for w in "kv")
        t, held = query.shape[2], k.shape[2]          # held: the last positions, in order
        n = pool.length(seq) + pool.pending(seq, 0)
        p, j = torch.arange(n - t, n)[:, None], torch.arange(n - held, n)[None, :]
        mask = torch.zeros(1, 1, t, held).masked_fill(~((j <= p) & (j > p - 39)), float("-inf"))
        want, _ = eager_attention_forward(module, query, k, v, mask, scaling=scaling)
        ok = (p[:, 0] - 38 >= n - held)    # the rows whose window the layer still holds
        if ok.any():                          # (a prefill's advance released the rest)
            errors.append(((out - want)[:, ok].abs().max() / v.abs().max()).item())
        return out, None

    monkeypatch.setitem(AttentionInterface._global_mapping, "kvcore", checked)
    cache = _kvcore(model, "q4_1ch/q4_1")
    _generate(model, "kvcore", cache, _prompt(70))
    # every decode step in both layers (the prefill's advance released the pages of its
    # rows' early windows), with pages released
    assert len(errors) == 2 * (NEW - 1)
    assert cache.layers[0].pool.held(cache.layers[0].seqs[0])[0][0] > 0
    assert max(errors) < 16 * np.finfo(np.float32).eps, errors


def test_memory_follows_the_window():
    """A hybrid model (Qwen2: layer 0 full, layer 1 sliding with W = 8) over a 300-token
    prompt (written in chunks of 256 columns) and 40 new tokens: eager's logits; the
    sliding layer's pool never grows and its row holds fewer than W + 16 positions, the
    full layer all 339."""
    model = _model("qwen2", window=8)
    ids = _prompt(300)
    want_ids, want_logits = _generate(model, "eager", _reference(model), ids, new=40)
    cache = _kvcore(model)
    got_ids, got_logits = _generate(model, "kvcore", cache, ids, new=40)
    assert torch.equal(got_ids, want_ids)
    _assert_logits_close(got_logits, want_logits)
    full, sliding = cache.layers
    n = 339
    assert [full.pool.held(s) for s in full.seqs] == [[(0, n)]]
    (((first, end),),) = [sliding.pool.held(s) for s in sliding.seqs]
    assert end == n and n - first < 8 + 16 and sliding.pool.num_used_pages == 2
    # its pool was never grown: room for the window, a chunk of 256 and two pages
    assert sliding.pool.num_pages == -(-(8 + 256 + 32) // 16) + 1


def test_copies_of_a_sliding_cache():
    """copy.deepcopy of a prefilled KVCoreCache with sliding layers (the prompt reuse
    recipe): each copy's continuation equals eager's on a copy of its own cache."""
    model = _model("gemma2")
    ids = _prompt()
    results = {}
    for impl, cache in (("eager", _reference(model)), ("kvcore", _kvcore(model))):
        _logits(model, impl, cache, ids)
        results[impl] = [_logits(model, impl, copy.deepcopy(cache), torch.tensor([[t] * 3]))
                         for t in (7, 9)]
        assert cache.get_seq_length() == PROMPT
    for got, want in zip(results["kvcore"], results["eager"]):
        _assert_logits_close(got, want)


@pytest.mark.parametrize("family", ["gemma2", "gpt_oss"])
def test_bfloat16_models(family):
    """A bf16 model (soft-capping; bf16 sink logits widened to float32 exactly): within
    5% of eager's logits in bf16, on the same bf16 storage."""
    model = _model(family, dtype=torch.bfloat16)
    ids, mask = _padded()
    got = _logits(model, "kvcore", _kvcore(model, "bf16"), ids, mask).float()
    want = _logits(model, "eager", _reference(model), ids, mask).float()
    real = mask.bool()
    err = (got - want)[real].abs().max().item() / want[real].abs().max().item()
    assert err < 0.05, err   # the model dtype's rounding (eager attends in it)


def test_refusals():
    """What kvcore cannot express raises with nothing written: chunked-attention layers
    (the cache), a bidirectional model (the mask function, before any layer), a padded
    column after a real one on a sliding layer, a cache built for another window."""
    cfg = LlamaConfig(num_hidden_layers=1, hidden_size=64, num_attention_heads=2)
    cfg.attention_chunk_size = 4
    cfg._attn_implementation = "kvcore"
    with pytest.raises(kvcore.StateError, match="chunked_attention"):
        kvhf.KVCoreCache(cfg)
    model = _model("gemma3", use_bidirectional_attention=True)
    cache = _kvcore(model)
    with pytest.raises(kvcore.StateError, match="another mask"), torch.no_grad():
        model(_prompt(), past_key_values=cache)
    assert cache.get_seq_length() == 0
    model = _model("gemma2")
    ids, mask = _padded()
    cache = _kvcore(model)
    _logits(model, "kvcore", cache, ids, mask)
    lengths = lambda: [[layer.pool.length(s) for s in layer.seqs] for layer in cache.layers]
    hole = torch.cat([mask, torch.tensor([[0], [1], [1]])], dim=1)
    with pytest.raises(kvcore.StateError, match="left padding"):
        _logits(model, "kvcore", cache, torch.tensor([[3], [4], [5]]), hole)
    assert cache.get_seq_length() == 19 and lengths() == [LENGTHS] * 2
    # an error in the kernel (a NaN query) drops the forward's positions again
    weight = model.model.layers[0].self_attn.q_proj.weight
    saved = weight.detach().clone()
    with torch.no_grad():
        weight[0, 0] = float("nan")
    with pytest.raises(kvcore.NonFiniteError):
        _logits(model, "kvcore", cache, torch.tensor([[3], [4], [5]]),
                torch.cat([mask, torch.ones(3, 1, dtype=torch.long)], dim=1))
    assert cache.get_seq_length() == 19 and lengths() == [LENGTHS] * 2
    with torch.no_grad():
        weight.copy_(saved)
    other = copy.deepcopy(model.config)
    other.sliding_window = 7
    cache = kvhf.KVCoreCache(other)
    assert cache.layers[0].window == 7
    with pytest.raises(kvcore.StateError, match="sliding_window=5"):
        _logits(model, "kvcore", cache, ids, mask)
    assert cache.get_seq_length() == 0


def test_repeated_rows_grow_a_sliding_pool():
    """batch_repeat_interleave(40) on a prefilled sliding cache: the forks outgrow the
    pool, which moves the rows' held positions (windowed snapshots) into a larger one;
    decode steps then equal eager's."""
    model = _model("mistral")
    steps = torch.randint(3, 256, (40, 3), generator=torch.Generator().manual_seed(2))
    logits = {}
    for impl, cache in (("eager", _reference(model)), ("kvcore", _kvcore(model))):
        _logits(model, impl, cache, _prompt())
        pages = cache.layers[0].pool.num_pages if impl == "kvcore" else None
        cache.batch_repeat_interleave(40)
        logits[impl] = torch.cat([_logits(model, impl, cache, steps[:, i:i + 1])
                                  for i in range(3)], dim=1)
    _assert_logits_close(logits["kvcore"], logits["eager"])
    layer = cache.layers[0]
    assert layer.pool.num_pages > pages and len(layer.seqs) == 40
    assert all(layer.pool.held(s) == [(16, 22)] for s in layer.seqs)
