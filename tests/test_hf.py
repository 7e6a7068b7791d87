"""kvcore inside transformers, checked against transformers itself: random-weight Llama
models built from configs (no download), run by HF's eager attention on a DynamicCache
(the reference) and by the kvcore attention on a KVCoreCache.

f32 storage must give eager's tokens and logits within float32 rounding; every other
format must match eager run on the same quantize/dequantize round trip of K/V (so any
difference left is float32 rounding, never the kernel's). transformers and torch are in
the test extra: these tests run in CI, they do not skip.
"""
import numpy as np
import pytest
import torch
from transformers import AttentionInterface, Cache, DynamicCache, LlamaConfig, LlamaForCausalLM
from transformers.cache_utils import DynamicLayer
from transformers.models.llama.modeling_llama import eager_attention_forward

import kvcore
from kvcore.integrations import transformers as kvhf

FORMATS = list(kvcore.FORMATS)
# (Hq, Hkv, D): GQA ratios 1 and 4, head_dim 64 and 128
SHAPES = [(4, 4, 64), (8, 2, 128), (4, 1, 64), (2, 2, 128)]
PROMPT, NEW = 19, 12


def _model(hq, hkv, d, dtype=torch.float32, layers=2, seed=0, **config):
    """A random Llama whose q/k projections are scaled up so that attention is far from
    uniform (checked by test_reference_attention_is_peaked)."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=layers,
                      num_attention_heads=hq, num_key_value_heads=hkv, head_dim=d,
                      vocab_size=1000, max_position_embeddings=512, **config)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(6.0)
            layer.self_attn.k_proj.weight.mul_(6.0)
    return model.to(dtype)


def _prompt(n=PROMPT, seed=1):
    return torch.randint(0, 1000, (1, n), generator=torch.Generator().manual_seed(seed))


class _RoundTripLayer(DynamicLayer):
    """HF's own dynamic layer, fed K/V after a kvcore quantize/dequantize round trip."""

    def __init__(self, fmt):
        super().__init__()
        self.fmt = fmt

    def update(self, key_states, value_states, *args, **kwargs):
        return super().update(_round_trip(key_states, self.fmt),
                              _round_trip(value_states, self.fmt))


def _round_trip(x, fmt):
    codes, scales = kvcore.quantize(x.detach().float().numpy(), fmt)
    return torch.from_numpy(kvcore.dequantize(codes, scales, fmt)).to(x.dtype)


def _reference_cache(model, fmt):
    n = model.config.num_hidden_layers
    return DynamicCache() if fmt == "f32" else Cache(layers=[_RoundTripLayer(fmt) for _ in range(n)])


def _generate(model, impl, cache, ids=None, **kw):
    model.set_attn_implementation(impl)
    ids = _prompt() if ids is None else ids
    out = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
                         max_new_tokens=NEW, output_logits=True, return_dict_in_generate=True,
                         pad_token_id=0, **kw)
    return out.sequences, torch.stack(out.logits)


def _assert_logits_close(got, want, ulps=64):
    """Within float32 rounding of the logits' scale (64 ulps of the largest)."""
    bound = ulps * np.finfo(np.float32).eps * want.abs().max().item()
    err = (got - want).abs().max().item()
    assert err <= bound, f"logits differ by {err:.3g}, float32 rounding bound {bound:.3g}"


def _kvcore_cache(model, fmt, **kw):
    model.set_attn_implementation("kvcore")
    return kvhf.KVCoreCache(model.config, format=fmt, **kw)


@pytest.fixture(scope="module", params=SHAPES, ids=lambda s: f"hq{s[0]}-hkv{s[1]}-d{s[2]}")
def shape(request):
    return request.param


def test_reference_attention_is_peaked(shape):
    """The test models attend sharply (mean top attention weight well above uniform), so
    a kernel that blurred or dropped positions would change the logits."""
    model = _model(*shape)
    model.set_attn_implementation("eager")
    with torch.no_grad():
        attn = model(_prompt(), output_attentions=True).attentions
    top = torch.stack([a[0, :, -8:].max(-1).values.mean() for a in attn])
    assert top.min().item() > 0.5, top


def test_f32_matches_eager(shape):
    """f32 storage: eager's greedy tokens and logits within float32 rounding (2 layers)."""
    model = _model(*shape)
    want_ids, want_logits = _generate(model, "eager", DynamicCache())
    cache = _kvcore_cache(model, "f32")
    got_ids, got_logits = _generate(model, "kvcore", cache)
    assert torch.equal(got_ids, want_ids)
    _assert_logits_close(got_logits, want_logits)
    assert cache.get_seq_length() == PROMPT + NEW - 1
    layer = cache.layers[0]
    assert layer.keys is None and layer.values is None      # no tensor copy of the history


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape1", SHAPES[:2], ids=lambda s: f"hq{s[0]}-hkv{s[1]}-d{s[2]}")
def test_greedy_matches_eager_on_the_same_values(shape1, fmt):
    """One layer, so both runs quantize the very same K/V (with more layers a float32
    rounding difference in one layer's output can move a later layer's K across a
    rounding boundary of the format: test_every_layer_matches_eager_on_the_stored_codes
    checks those layer by layer)."""
    model = _model(*shape1, layers=1)
    want_ids, want_logits = _generate(model, "eager", _reference_cache(model, fmt))
    cache = _kvcore_cache(model, fmt)
    got_ids, got_logits = _generate(model, "kvcore", cache)
    assert torch.equal(got_ids, want_ids)
    _assert_logits_close(got_logits, want_logits)
    assert cache.layers[0].kv.spec.format == fmt


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_layer_matches_eager_on_the_stored_codes(fmt, monkeypatch):
    """In a 2-layer GQA-4 model, at every layer and step (prefill and decode), the kvcore
    attention equals HF's eager attention run on the dequantized codes the layer holds,
    within float32 rounding."""
    model = _model(8, 2, 128)
    kvcore_attention = kvhf.kvcore_attention
    errors = []

    def checked(module, query, key, value, attention_mask, scaling=None, **kw):
        out, _ = kvcore_attention(module, query, key, value, attention_mask, scaling=scaling, **kw)
        kv = key.layer.kv
        k, v = (torch.from_numpy(kv.dequantize(0, w)).transpose(0, 1)[None] for w in "kv")
        t, n = query.shape[2], k.shape[2]
        causal = torch.ones(t, n, dtype=torch.bool).tril(n - t)
        mask = torch.zeros(1, 1, t, n).masked_fill(~causal, float("-inf"))
        want, _ = eager_attention_forward(module, query, k, v, mask, scaling=scaling)
        errors.append(((out - want).abs().max() / v.abs().max()).item())
        return out, None

    monkeypatch.setitem(AttentionInterface._global_mapping, "kvcore", checked)
    _generate(model, "kvcore", _kvcore_cache(model, fmt))
    assert len(errors) == 2 * NEW
    assert max(errors) < 16 * np.finfo(np.float32).eps, errors


def test_quantized_formats_differ_from_f32():
    """The round-trip reference is not a no-op: int8 storage changes the logits."""
    model = _model(4, 4, 64, layers=1)
    _, f32 = _generate(model, "kvcore", _kvcore_cache(model, "f32"))
    _, int8 = _generate(model, "kvcore", _kvcore_cache(model, "int8"))
    assert (f32 - int8).abs().max().item() > 1e-4


def test_sampling_matches_eager():
    model = _model(8, 2, 128)
    torch.manual_seed(5)
    want, _ = _generate(model, "eager", DynamicCache(), do_sample=True, top_k=50)
    torch.manual_seed(5)
    got, _ = _generate(model, "kvcore", _kvcore_cache(model, "f32"), do_sample=True, top_k=50)
    assert torch.equal(got, want)


@pytest.mark.parametrize("fmt", ["f32", "int8"])
def test_assisted_generation_equals_greedy(fmt):
    """The assistant (another random model) drafts tokens the main model mostly rejects,
    so the main cache is rolled back with crop(-k) at many steps."""
    model, assistant = _model(8, 2, 128), _model(4, 4, 64, layers=1, seed=7)
    assistant.set_attn_implementation("sdpa")
    greedy, _ = _generate(model, "kvcore", _kvcore_cache(model, fmt))
    cache = _kvcore_cache(model, fmt)
    crops = []
    crop = cache.crop
    cache.crop = lambda k: (crops.append(k), crop(k))
    assisted, _ = _generate(model, "kvcore", cache, assistant_model=assistant)
    assert torch.equal(assisted, greedy)
    assert any(k < 0 for k in crops), crops
    assert cache.get_seq_length() == PROMPT + NEW - 1


@pytest.mark.parametrize("fmt", ["f32", "q8_0"])
def test_chunked_prefill_equals_one_pass(fmt):
    model = _model(8, 2, 128)
    ids = _prompt(40)
    with torch.no_grad():
        whole = model(ids, past_key_values=_kvcore_cache(model, fmt)).logits
        cache = _kvcore_cache(model, fmt)
        parts = [model(ids[:, a:b], past_key_values=cache).logits
                 for a, b in [(0, 7), (7, 8), (8, 29), (29, 40)]]
        model.set_attn_implementation("eager")
        ref = model(ids, past_key_values=_reference_cache(model, fmt)).logits
    _assert_logits_close(torch.cat(parts, dim=1), whole)
    _assert_logits_close(whole, ref)
    assert cache.get_seq_length() == 40


def test_reset_and_growth():
    """A cache reused after reset() gives the same tokens; a cache that starts small
    (max_cache_len=None grows by doubling) gives the same as one sized up front."""
    model = _model(4, 1, 64)
    ids = _prompt(300)
    sized = _kvcore_cache(model, "int8", max_cache_len=400)
    first, _ = _generate(model, "kvcore", sized, ids=ids)
    sized.reset()
    assert sized.get_seq_length() == 0
    again, _ = _generate(model, "kvcore", sized, ids=ids)
    grown_cache = _kvcore_cache(model, "int8")
    grown, _ = _generate(model, "kvcore", grown_cache, ids=ids)
    assert torch.equal(first, again) and torch.equal(first, grown)
    assert grown_cache.layers[0].kv.spec.capacity == 600   # 300 -> 600 at the first decode step
    assert sized.memory_bytes == 2 * sized.layers[0].kv.memory_bytes


@pytest.mark.parametrize("dtype, fmt", [(torch.bfloat16, "int8"), (torch.bfloat16, "bf16"),
                                        (torch.float16, "f32"), (torch.float16, "fp8_e4m3")])
def test_half_precision_models(dtype, fmt):
    """bf16/f16 models run: K/V arrive in the model dtype and are encoded as given,
    queries are widened to float32, the output cast back; the logits stay within 5% of
    eager's on the same quantize/dequantize round trip (eager attends in the model
    dtype, so it is the less precise of the two)."""
    model = _model(8, 2, 128, dtype=dtype)
    ids, logits = _generate(model, "kvcore", _kvcore_cache(model, fmt))
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
    with torch.no_grad():
        got = model(ids[:, :-1], past_key_values=_kvcore_cache(model, fmt)).logits.float()
        model.set_attn_implementation("eager")
        want = model(ids[:, :-1], past_key_values=_reference_cache(model, fmt)).logits.float()
    err = (got - want).abs().max().item() / want.abs().max().item()
    assert err < 0.05, err   # the model dtype's rounding (eager attends in it)


def test_refusals():
    model = _model(4, 1, 64)
    with pytest.raises(kvcore.StateError, match="attn_implementation='kvcore'"):
        model.set_attn_implementation("sdpa")
        kvhf.KVCoreCache(model.config)
    cache = _kvcore_cache(model, "int8")
    # a padded batch is refused before any layer writes
    ids = torch.cat([_prompt(6), _prompt(6, seed=2)])
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    with pytest.raises(kvcore.StateError, match="padding"), torch.no_grad():
        model(ids, attention_mask=mask, past_key_values=cache)
    assert cache.get_seq_length() == 0
    with pytest.raises(kvcore.ShapeError, match="batch size 1"), torch.no_grad():
        model(ids, past_key_values=cache)
    # the kvcore attention without a KVCoreCache, and a KVCoreCache under another attention
    with pytest.raises(kvcore.StateError, match="KVCoreCache"), torch.no_grad():
        model(_prompt(6), past_key_values=DynamicCache())
    with torch.no_grad():
        model(_prompt(6), past_key_values=cache)
    model.set_attn_implementation("eager")
    with pytest.raises(kvcore.StateError, match="kvcore codes"), torch.no_grad():
        model(_prompt(1), past_key_values=cache)
    with pytest.raises(ValueError, match="minus the number"):
        cache.crop(3)
    with pytest.raises(kvcore.OutOfRangeError):
        cache.crop(-99)


def test_other_attention_patterns_refused():
    """Sliding-window layers are refused by the cache, a bidirectional mask by the mask
    function (before any layer writes)."""
    from transformers import MistralConfig
    with pytest.raises(kvcore.StateError, match="sliding_attention"):
        cfg = MistralConfig(num_hidden_layers=1, sliding_window=4)
        cfg._attn_implementation = "kvcore"
        kvhf.KVCoreCache(cfg)
    model = _model(4, 1, 64, layers=1, is_causal=False)
    cache = _kvcore_cache(model, "f32")
    with pytest.raises(kvcore.StateError, match="another mask"), torch.no_grad():
        model(_prompt(6), past_key_values=cache)
    assert cache.get_seq_length() == 0


def test_import_kvcore_does_not_import_transformers():
    import subprocess
    import sys
    code = "import sys, kvcore; print('transformers' in sys.modules, 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_readme_example_prints_what_it_says():
    import contextlib
    import io
    import os
    import re
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "README.md")) as f:
        code = re.search(r"## In Hugging Face transformers\n.*?```python\n(.*?)```", f.read(),
                         re.S).group(1)
    expected = [m.group(1).strip() for m in re.finditer(r"^print\(.*\)\s*#(.*)$", code, re.M)]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md transformers example", "exec"), {})
    assert out.getvalue().splitlines() == expected and expected
