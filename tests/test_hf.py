"""kvcore inside transformers, checked against transformers itself: random-weight Llama
models built from configs (no download), run by HF's eager attention on a DynamicCache
(the reference) and by the kvcore attention on a KVCoreCache.

f32 storage must give eager's tokens and logits within float32 rounding; every other
format must match eager run on the same quantize/dequantize round trip of K/V (so any
difference left is float32 rounding, never the kernel's). transformers and torch are in
the test extra (CI runs these tests); without them the module skips, as test_interop.py.
"""
import copy
import logging
import pickle

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from transformers import (AttentionInterface, Cache, DynamicCache, LlamaConfig,  # noqa: E402
                          LlamaForCausalLM)
from transformers.cache_utils import DynamicLayer  # noqa: E402
from transformers.models.llama.modeling_llama import eager_attention_forward  # noqa: E402

import kvcore  # noqa: E402
from kvcore.integrations import transformers as kvhf  # noqa: E402
from _formats import PAIRS, sides  # noqa: E402

FORMATS = list(kvcore.formats.ROW_FORMATS)   # K and V in one format (q4_1ch is K only)
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
    """HF's own dynamic layer, fed K/V after a kvcore quantize/dequantize round trip (K in
    K's format, V in V's: a K/V pair "<k>/<v>" too)."""

    def __init__(self, fmt):
        super().__init__()
        self.fmts = sides(fmt)

    def update(self, key_states, value_states, *args, **kwargs):
        return super().update(_round_trip(key_states, self.fmts[0]),
                              _round_trip(value_states, self.fmts[1]))


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


@pytest.mark.parametrize("fmt", FORMATS + PAIRS)
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
    assert cache.layers[0].pool.spec.format == fmt


def _errors_against_eager(model, cache, monkeypatch, ids=None, query_of=None):
    """Runs generate with the kvcore attention checked at every layer and step (prefill
    and decode) against HF's eager attention on the dequantized codes the layer holds;
    query_of(query, scaling) gives the (query, scaling) eager takes (default: the same).
    Returns each call's largest error over max |V|."""
    kvcore_attention = kvhf.kvcore_attention
    errors = []

    def checked(module, query, key, value, attention_mask, scaling=None, **kw):
        out, _ = kvcore_attention(module, query, key, value, attention_mask, scaling=scaling, **kw)
        layer = key.layer
        k, v = (torch.from_numpy(layer.pool.dequantize(layer.seqs[0], 0, w)).transpose(0, 1)[None]
                for w in "kv")
        t, n = query.shape[2], k.shape[2]
        causal = torch.ones(t, n, dtype=torch.bool).tril(n - t)
        mask = torch.zeros(1, 1, t, n).masked_fill(~causal, float("-inf"))
        q, s = (query, scaling) if query_of is None else query_of(query, scaling)
        want, _ = eager_attention_forward(module, q, k, v, mask, scaling=s)
        errors.append(((out - want).abs().max() / v.abs().max()).item())
        return out, None

    monkeypatch.setitem(AttentionInterface._global_mapping, "kvcore", checked)
    _generate(model, "kvcore", cache, ids=ids)
    return errors


@pytest.mark.parametrize("fmt, prompt", [(f, PROMPT) for f in FORMATS + PAIRS]
                         + [("q4_1ch/q4_1", 58)])
def test_every_layer_matches_eager_on_the_stored_codes(fmt, prompt, monkeypatch):
    """In a 2-layer GQA-4 model, at every layer and step (prefill and decode), the kvcore
    attention equals HF's eager attention run on the dequantized codes the layer holds,
    within float32 rounding. KIVI's K q4_1ch / V q4_1: a prompt of 58 completes a group of
    32 positions in the prefill and another while decoding."""
    model = _model(8, 2, 128)
    errors = _errors_against_eager(model, _kvcore_cache(model, fmt), monkeypatch, _prompt(prompt))
    assert len(errors) == 2 * NEW
    assert max(errors) < 16 * np.finfo(np.float32).eps, errors


@pytest.mark.parametrize("fmt", ["int8", "q8_0/q4_0"])
def test_int8_scores_match_eager_on_the_quantized_queries(fmt, monkeypatch):
    """KVCoreCache(scores="int8"): at every layer and step (a 19-token prefill, row-wise,
    and decode) the kvcore attention equals HF's eager attention on the stored codes with
    the query that int8 scores quantize (per block of 32 of scale * q, the documented
    rule), within float32 rounding; the setting survives a deepcopy, and a K format without
    int8 codes or an unknown value is refused when the cache is made."""
    from kvcore._attention import quantize_query

    def quantized(query, scaling):
        scaled = (query.float() * np.float32(scaling)).numpy().reshape(-1, query.shape[-1])
        return torch.from_numpy(quantize_query(np.ascontiguousarray(scaled))[2]).view(query.shape), 1.0

    model = _model(8, 2, 128)
    errors = _errors_against_eager(model, _kvcore_cache(model, fmt, scores="int8"), monkeypatch,
                                   query_of=quantized)
    assert len(errors) == 2 * NEW
    assert max(errors) < 16 * np.finfo(np.float32).eps, errors
    cache = _kvcore_cache(model, fmt, scores="int8")
    assert all(layer.scores == "int8" for layer in cache.layers)
    assert copy.deepcopy(cache).layers[0].scores == "int8"
    with pytest.raises(kvcore.FormatError, match="scores='int8' reads K's integer codes: K format "
                                                 "'f16'"):
        _kvcore_cache(model, "f16/int8", scores="int8")
    with pytest.raises(kvcore.RangeError, match="scores must be one of"):
        _kvcore_cache(model, "int8", scores="int4")


def test_pair_formats_by_side():
    """KVCoreCache(k_format=, v_format=) as KVSpec takes them (llama.cpp's -ctk / -ctv):
    every layer's pool stores K and V each in its format; format= with a side that
    disagrees is refused naming both, an unknown side naming it."""
    model = _model(4, 4, 64, layers=2)
    cache = _kvcore_cache(model, None, k_format="q8_0", v_format="q4_0")
    assert cache.format == "q8_0/q4_0"
    _generate(model, "kvcore", cache)
    assert all(layer.pool.spec.fmts == (kvcore.FORMATS["q8_0"], kvcore.FORMATS["q4_0"])
               for layer in cache.layers)
    assert _kvcore_cache(model, None, k_format="q8_0").format == "q8_0/f16"
    with pytest.raises(kvcore.SpecError, match="format='int8' stores K as int8, but "
                                               "k_format='q8_0'"):
        _kvcore_cache(model, "int8", k_format="q8_0")
    with pytest.raises(kvcore.FormatError, match="v_format: unknown format 'q2_k'"):
        _kvcore_cache(model, None, v_format="q2_k")


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
    # 19 pages of 16 positions to start (300 positions), doubled when position 305 comes
    assert grown_cache.layers[0].pool.num_pages == 38
    assert sized.memory_bytes == 2 * sized.layers[0].pool.memory_bytes


@pytest.mark.parametrize("fmt", ["f32", "int8"])
def test_prompt_cache_reused_through_deepcopy(fmt):
    """transformers' prompt reuse recipe ("Re-use Cache to continue generation"): prefill a
    prompt cache once, copy.deepcopy it per request, generate from the copy. Two
    continuations of one prompt give the tokens of the same recipe on HF's own cache
    (DynamicCache; for int8, one layer fed the same round trip of K/V), each request
    equals one on a prompt cache prefilled for it alone (bit for bit), and the prompt
    cache is left as it was."""
    model = _model(8, 2, 128, layers=2 if fmt == "f32" else 1)
    prompt = _prompt()
    continuations = [_prompt(5, seed=11), _prompt(9, seed=12)]

    def prefilled(impl):
        model.set_attn_implementation(impl)
        cache = (_reference_cache(model, fmt) if impl == "eager"
                 else kvhf.KVCoreCache(model.config, format=fmt))
        with torch.no_grad():
            return model(prompt, past_key_values=cache).past_key_values

    def request(cache, continuation):
        ids = torch.cat([prompt, continuation], dim=1)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
                             max_new_tokens=NEW, output_logits=True, pad_token_id=0,
                             return_dict_in_generate=True)
        return out.sequences, torch.stack(out.logits)

    results = {}
    for impl in ("eager", "kvcore"):
        prompt_cache = prefilled(impl)
        results[impl] = [request(copy.deepcopy(prompt_cache), c) for c in continuations]
        assert prompt_cache.get_seq_length() == PROMPT
    for (got, got_logits), (want, want_logits) in zip(results["kvcore"], results["eager"]):
        assert torch.equal(got, want)
        _assert_logits_close(got_logits, want_logits)
    for c, (got, got_logits) in zip(continuations, results["kvcore"]):
        alone, alone_logits = request(prefilled("kvcore"), c)
        assert torch.equal(got, alone) and torch.equal(got_logits, alone_logits)
    layer = prompt_cache.layers[0]
    assert [layer.pool.length(s) for s in layer.seqs] == [PROMPT]


def test_cache_copies_are_independent():
    """copy.deepcopy and pickle (default protocol and 5) of a KVCoreCache holding a padded
    batch: each copy holds the same rows (real positions only), a step run on it gives
    the logits that step gives on the original, bit for bit, and leaves the original as
    it was."""
    model = _model(8, 2, 128)
    ids, mask = _padded()
    cache = _kvcore_cache(model, "q8_0")
    step = torch.randint(0, 1000, (3, 2), generator=torch.Generator().manual_seed(4))
    full = torch.cat([mask, torch.ones(3, 2, dtype=torch.long)], dim=1)
    lengths = lambda c: [[layer.pool.length(s) for s in layer.seqs] for layer in c.layers]
    with torch.no_grad():
        model(ids, attention_mask=mask, past_key_values=cache)
        held = lengths(cache)
        copies = [copy.deepcopy(cache), pickle.loads(pickle.dumps(cache)),
                  pickle.loads(pickle.dumps(cache, protocol=5))]
        got = []
        for c in copies:
            assert type(c) is kvhf.KVCoreCache and lengths(c) == held
            for a, b in zip(c.layers, cache.layers):
                assert a.pool is not b.pool and np.array_equal(a.real, b.real)
                assert a.pool._storage.tobytes() == b.pool._storage.tobytes()
            got.append(model(step, attention_mask=full, past_key_values=c).logits)
            assert lengths(cache) == held and cache.get_seq_length() == 19
        want = model(step, attention_mask=full, past_key_values=cache).logits
    assert all(torch.equal(g, want) for g in got)
    assert lengths(cache) == [[n + 2 for n in LENGTHS]] * 2 == lengths(copies[0])


def test_output_attentions_warns_once_and_gives_none(monkeypatch, caplog):
    """As transformers' sdpa attention: output_attentions=True logs a warning (once) and
    the kvcore attention returns None weights."""
    model = _model(4, 1, 64)
    weights = []

    def spy(*args, **kwargs):
        out, w = kvhf.kvcore_attention(*args, **kwargs)
        weights.append(w)
        return out, w

    monkeypatch.setitem(AttentionInterface._global_mapping, "kvcore", spy)
    logging.Logger.warning_once.cache_clear()     # transformers' once-per-message cache
    cache = _kvcore_cache(model, "int8")
    with caplog.at_level(logging.WARNING), torch.no_grad():
        out = model(_prompt(6), past_key_values=cache, output_attentions=True)
        model(_prompt(1), past_key_values=cache, output_attentions=True)
        model(_prompt(1), past_key_values=cache)
    said = [r for r in caplog.records if "output_attentions" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING
    assert said[0].getMessage() == ("`kvcore` attention does not support "
                                    "`output_attentions=True`. Please set your attention to "
                                    "`eager` if you want any of these features.")
    assert weights == [None] * 6 and not any(a is not None for a in out.attentions)
    assert cache.get_seq_length() == 8

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


LENGTHS = [19, 11, 5]     # the padded batch's prompts (left padded to 19)


def _padded(lengths=LENGTHS):
    """Prompts of these lengths, left padded with token 0 (as generate expects for
    decoder-only models), and their attention mask."""
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, n in enumerate(lengths):
        ids[b, ids.shape[1] - n:] = _prompt(n, seed=b + 1)[0]
        mask[b, ids.shape[1] - n:] = 1
    return ids, mask


def _generate_batch(model, impl, cache, ids, mask, **kw):
    model.set_attn_implementation(impl)
    out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=NEW,
                         output_logits=True, return_dict_in_generate=True, pad_token_id=0, **kw)
    return out.sequences, torch.stack(out.logits)


def test_padded_batch_matches_eager_and_each_row_alone():
    """Batch 3, left padded: f32 gives eager's tokens and logits per row, each row equals
    that row generated alone at batch 1, and the pool holds only real positions."""
    model = _model(8, 2, 128)
    ids, mask = _padded()
    want_ids, want_logits = _generate_batch(model, "eager", DynamicCache(), ids, mask)
    cache = _kvcore_cache(model, "f32")
    got_ids, got_logits = _generate_batch(model, "kvcore", cache, ids, mask)
    assert torch.equal(got_ids, want_ids)
    _assert_logits_close(got_logits, want_logits)
    for layer in cache.layers:
        assert [layer.pool.length(s) for s in layer.seqs] == [n + NEW - 1 for n in LENGTHS]
    assert cache.get_seq_length() == max(LENGTHS) + NEW - 1
    for b, n in enumerate(LENGTHS):
        alone_ids, alone_logits = _generate(model, "kvcore", _kvcore_cache(model, "f32"),
                                            ids=_prompt(n, seed=b + 1))
        assert torch.equal(alone_ids[0], got_ids[b, max(LENGTHS) - n:])
        _assert_logits_close(alone_logits[:, 0], got_logits[:, b])


@pytest.mark.parametrize("fmt", [f for f in FORMATS if f != "f32"])
def test_padded_batch_matches_eager_on_the_same_values(fmt):
    """Every other format: eager on the same quantize/dequantize round trip of K/V gives
    the same tokens and logits, row by row (one layer, as above)."""
    model = _model(4, 1, 64, layers=1)
    ids, mask = _padded()
    want_ids, want_logits = _generate_batch(model, "eager", _reference_cache(model, fmt), ids, mask)
    got_ids, got_logits = _generate_batch(model, "kvcore", _kvcore_cache(model, fmt), ids, mask)
    assert torch.equal(got_ids, want_ids)
    _assert_logits_close(got_logits, want_logits)


def test_padded_batch_sampling_and_chunked_prefill():
    model = _model(4, 4, 64)
    ids, mask = _padded()
    torch.manual_seed(5)
    want, _ = _generate_batch(model, "eager", DynamicCache(), ids, mask, do_sample=True, top_k=50)
    torch.manual_seed(5)
    got, _ = _generate_batch(model, "kvcore", _kvcore_cache(model, "f32"), ids, mask,
                             do_sample=True, top_k=50)
    assert torch.equal(got, want)
    # the padded prompt in two chunks (the first cut inside every row's padding but one)
    with torch.no_grad():
        whole = model(ids, attention_mask=mask, past_key_values=_kvcore_cache(model, "int8")).logits
        cache = _kvcore_cache(model, "int8")
        parts = [model(ids[:, a:b], attention_mask=mask[:, :b], past_key_values=cache).logits
                 for a, b in [(0, 10), (10, 19)]]
    real = mask.bool()
    _assert_logits_close(torch.cat(parts, dim=1)[real], whole[real])


def test_crop_with_a_padded_batch():
    """crop(-k) on a batch drops the last k columns of every row (only real positions are
    stored, so a row drops the real ones among them): running the dropped columns again
    gives the same logits as the first time. Assisted generation itself is batch 1 in
    transformers (it refuses a batch, before the cache is touched)."""
    model = _model(8, 2, 128)
    ids, mask = _padded()
    cache = _kvcore_cache(model, "q8_0")
    steps = torch.randint(0, 1000, (3, 4), generator=torch.Generator().manual_seed(9))
    full = torch.cat([mask, torch.ones(3, 4, dtype=torch.long)], dim=1)
    with torch.no_grad():
        model(ids, attention_mask=mask, past_key_values=cache)
        first = model(steps, attention_mask=full, past_key_values=cache).logits
        for k in (4, 10):        # the second crop cuts into the prompts and row 2's padding
            cache.crop(-k)
            assert cache.get_seq_length() == 23 - k
            again = model(torch.cat([ids, steps], dim=1)[:, -k:], attention_mask=full,
                          past_key_values=cache).logits
            _assert_logits_close(again[:, -4:], first)
    for layer in cache.layers:
        assert [layer.pool.length(s) for s in layer.seqs] == [n + 4 for n in LENGTHS]
    assistant = _model(4, 4, 64, layers=1, seed=7)
    assistant.set_attn_implementation("sdpa")
    empty = _kvcore_cache(model, "f32")
    with pytest.raises(ValueError, match="batch_size = 1"):
        _generate_batch(model, "kvcore", empty, ids, mask, assistant_model=assistant)
    assert empty.get_seq_length() == 0


@pytest.mark.parametrize("lengths, fmt", [([PROMPT], "int8"), ([19, 8], "f32")],
                         ids=["batch1-int8", "padded-batch2-f32"])
def test_beam_search_matches_eager(lengths, fmt):
    """Beam search reorders rows (reorder_cache) by forking pool sequences: the beams
    equal eager's (on the same round trip of K/V; one layer for int8, as above)."""
    model = _model(8, 2, 128, layers=2 if fmt == "f32" else 1)
    ids, mask = _padded(lengths)
    want, _ = _generate_batch(model, "eager", _reference_cache(model, fmt), ids, mask, num_beams=3)
    cache = _kvcore_cache(model, fmt)
    reorders = []
    reorder = cache.reorder_cache
    cache.reorder_cache = lambda idx: (reorders.append(idx.tolist()), reorder(idx))
    got, _ = _generate_batch(model, "kvcore", cache, ids, mask, num_beams=3)
    assert torch.equal(got, want)
    assert any(r != sorted(r) for r in reorders), reorders   # rows really moved
    layer = cache.layers[0]
    assert len(layer.seqs) == 3 * len(lengths) == len(layer.pool.sequences)


def test_reset_takes_another_batch_size():
    model = _model(4, 1, 64)
    ids, mask = _padded()
    cache = _kvcore_cache(model, "int8")
    batch, _ = _generate_batch(model, "kvcore", cache, ids, mask)
    cache.reset()
    alone, _ = _generate(model, "kvcore", cache, ids=_prompt(11, seed=2))
    assert torch.equal(alone[0], batch[1, 8:])
    assert len(cache.layers[0].pool.sequences) == 1


def test_refusals():
    model = _model(4, 1, 64)
    with pytest.raises(kvcore.StateError, match="attn_implementation='kvcore'"):
        model.set_attn_implementation("sdpa")
        kvhf.KVCoreCache(model.config)
    cache = _kvcore_cache(model, "int8")
    # a padded batch: the next step must bring a mask that keeps the held padding, and the
    # same rows; a refused step writes nothing in any layer
    ids = torch.cat([_prompt(6), _prompt(6, seed=2)])
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    with torch.no_grad():
        model(ids, attention_mask=mask, past_key_values=cache)
    lengths = lambda: [[layer.pool.length(s) for s in layer.seqs] for layer in cache.layers]
    assert lengths() == [[6, 4]] * 2
    step = torch.tensor([[3], [4]])
    for bad, error, match in [(None, kvcore.StateError, "holds padded rows"),
                              (torch.ones(2, 7, dtype=torch.long), kvcore.StateError,
                               "holds padded rows"),
                              (torch.tensor([[1] * 7, [1, 0, 0] + [1] * 4]), kvcore.StateError,
                               "changes which held positions"),
                              (torch.ones(2, 9, dtype=torch.long), kvcore.ShapeError,
                               "attention_mask"),
                              (torch.zeros(2, 1, 1, 7), kvcore.StateError, "custom attention mask")]:
        with pytest.raises(error, match=match), torch.no_grad():
            model(step, attention_mask=bad, past_key_values=cache)
        assert cache.get_seq_length() == 6 and lengths() == [[6, 4]] * 2
    with pytest.raises(kvcore.ShapeError, match="invalid K/V"), torch.no_grad():
        model(step[:1], past_key_values=cache)           # the batch size changed
    assert cache.get_seq_length() == 6 and lengths() == [[6, 4]] * 2
    cache.reset()
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
    """Chunked-attention layers are refused by the cache, a bidirectional mask by the mask
    function (before any layer writes). Sliding windows: tests/test_hf_variants.py."""
    with pytest.raises(kvcore.StateError, match="chunked_attention"):
        cfg = LlamaConfig(num_hidden_layers=1)
        cfg.attention_chunk_size = 4
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


def test_kvcore_kernels_run_within_torchs_threads(monkeypatch):
    """Inside the model's forward kvcore's kernels run on at most torch.get_num_threads()
    threads (they share torch's OpenMP workers, never add threads beside them); the
    tokens are those of eager."""
    model = _model(4, 4, 64, layers=1)
    seen = []
    write = kvhf.KVCoreLayer._write

    def recording(self, *args):
        seen.append(kvcore._parallel.running(kvcore._parallel.MAX_THREADS))
        return write(self, *args)
    monkeypatch.setattr(kvhf.KVCoreLayer, "_write", recording)
    before, adaptive = torch.get_num_threads(), kvcore._parallel.set_adaptive(False)
    torch.set_num_threads(1)
    try:
        got, _ = _generate(model, "kvcore", _kvcore_cache(model, "f32"))
        assert kvcore._parallel.running(2) == 2       # outside the forward: no limit
    finally:
        torch.set_num_threads(before)
        kvcore._parallel.set_adaptive(adaptive)
    assert seen and set(seen) == {1}
    want, _ = _generate(model, "eager", DynamicCache())
    assert torch.equal(got, want)
