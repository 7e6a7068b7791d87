"""End to end in transformers: `generate` on a random-weight Llama with the context in
the cache, kvcore (KVCoreCache + the "kvcore" attention) in each format against
DynamicCache + SDPA and transformers' QuantizedCache (fp8; quanto and hqq where they
import), all on the same threads.

    python tools/bench_hf.py [--contexts 1024,4096,16384] [--new 32] [--threads 2]
                             [--layers 4] [--impls kvcore-int8,sdpa,...] [--rounds 1]
                             [--batch 1]

Each row runs in its own process (peak memory is that process's ru_maxrss). The model:
hidden 2048, 32 query heads, 8 kv heads, head_dim 128, MLP 4096, vocab 8000, float32,
random weights, built from a config (no download). kvcore-<format>+int8-scores: the same
cache with the opt-in int8 scores (KVCoreCache(scores="int8")). The context is written into the cache
as random K/V of N positions (chunks of 512, QuantizedCache in one piece; a real prefill of 16k tokens takes minutes on
2 cores, and is not what is measured), then `generate` runs on N + 1 prompt tokens: one
forward of the last prompt token, then `--new` - 1 decode steps.
--batch B runs B rows, each with its own random context of N positions (no padding:
tests/test_hf.py checks padded batches; here every row is full length), and
tokens/s = B / the median time between two steps' logits (the first forward and
generate's setup are not counted; the median keeps other processes' bursts out). peak MB: the process's peak RSS minus its RSS
after the model was built (the cache plus whatever attention allocates: QuantizedCache
decodes the whole history to floats every step). cache MB: the bytes the cache holds
(kvcore: its storage; DynamicCache: its tensors; '-' where the backend hides them).

    python tools/bench_hf.py --window 1024 [--tokens 16384] [--new 64]
                             [--window-impls kvcore-f16,kvcore-int8,dynamic-sdpa]

measures instead the cache memory of a sliding-window model: a random-weight Mistral
(every layer sliding, window W; --layers layers (2), hidden 256, 8 query heads, 8 kv heads,
head_dim 128, MLP 512, vocab 1000, float32) `generate`s --new tokens after a prompt of
--tokens - --new tokens. kvcore-<format>: a KVCoreCache, the prompt in generate's one
forward (the sliding layers write and attend it in chunks of max(W, 256) columns).
dynamic-sdpa: transformers' DynamicCache(config) (its sliding layers keep W - 1
positions) with SDPA, the prompt first written by model(chunk) calls of the same chunk
size (one 16k forward would build a 16k x 16k mask), then generate. At every attention
call (the peak: the layer's new positions are written and not yet released) the bytes the
layers hold are counted (kvcore: pages in use; DynamicCache: the tensors' storages); the
table gives the peak over the generation, what is held at the end, the storage
allocated, and the bytes a full-attention cache of the same format needs for the same
positions (computed: positions x layers x bytes per position).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _benchlib import print_table  # noqa: E402

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, MLP, VOCAB = 2048, 32, 8, 128, 4096, 8000
CHUNK = 512
KVCORE_FORMATS = ["f32", "f16", "bf16", "int8", "fp8_e4m3", "fp8_e5m2", "q8_0"]
INT8_SCORES = "+int8-scores"     # kvcore-<format>+int8-scores: KVCoreCache(scores="int8")
IMPLS = ([f"kvcore-{f}" for f in KVCORE_FORMATS] +
         [f"kvcore-{f}{INT8_SCORES}" for f in ("int8", "q8_0")] +
         ["sdpa", "quantized-fp8", "quantized-quanto-int4", "quantized-hqq-int8"])


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def _cpu_name() -> str:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.machine()


def _cache(impl: str, model, capacity: int):
    from transformers import DynamicCache, QuantizedCache
    if impl.startswith("kvcore-"):
        from kvcore.integrations.transformers import KVCoreCache
        model.set_attn_implementation("kvcore")
        fmt = impl.removeprefix("kvcore-").removesuffix(INT8_SCORES)
        return KVCoreCache(model.config, format=fmt, max_cache_len=capacity,
                           scores="int8" if impl.endswith(INT8_SCORES) else "float32")
    model.set_attn_implementation("sdpa")
    if impl == "sdpa":
        return DynamicCache(config=model.config)
    if impl == "quantized-fp8":
        return QuantizedCache("fp8", model.config)
    _, backend, bits = impl.split("-")
    return QuantizedCache(backend, model.config, nbits=int(bits.removeprefix("int")))


def _cache_mb(cache) -> float | None:
    from transformers import DynamicCache
    if hasattr(cache, "memory_bytes"):
        return cache.memory_bytes / 2**20
    if type(cache) is DynamicCache:
        return sum(l.keys.nbytes + l.values.nbytes for l in cache.layers) / 2**20
    return None


def child(impl: str, context: int, new: int, threads: int, layers: int, batch: int) -> dict:
    import torch
    import kvcore
    from transformers import LlamaConfig, LlamaForCausalLM, LogitsProcessorList
    torch.set_num_threads(threads)
    kvcore.set_num_threads(threads)
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=HIDDEN, intermediate_size=MLP, num_hidden_layers=layers,
                      num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                      head_dim=HEAD_DIM, vocab_size=VOCAB, max_position_embeddings=32768)
    model = LlamaForCausalLM(cfg).eval()
    base_mb = _rss_mb()
    cache = _cache(impl, model, context + new + 1)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        # QuantizedCache re-quantizes its whole history on updates past its residual
        # window: it takes the context in one update per layer (the float copy that makes
        # is no larger than the one it decodes at every step)
        chunk = context if impl.startswith("quantized") else CHUNK
        for start in range(0, context, chunk):
            t = min(chunk, context - start)
            for layer in range(layers):
                k, v = (torch.randn(batch, KV_HEADS, t, HEAD_DIM, generator=gen) for _ in "kv")
                cache.update(k, v, layer)
        del k, v
        ids = torch.randint(0, VOCAB, (batch, context + 1), generator=gen)
        stamps = []

        def stamp(input_ids, scores):   # a logits processor: called once per new token
            stamps.append(time.perf_counter())
            return scores

        out = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=new,
                             min_new_tokens=new, do_sample=False, pad_token_id=0,
                             logits_processor=LogitsProcessorList([stamp]))
    assert out.shape == (batch, context + 1 + new) and len(stamps) == new
    step = statistics.median(b - a for a, b in zip(stamps, stamps[1:]))
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"impl": impl, "context": context, "tokens_per_s": batch / step,
            "peak_mb": peak_mb - base_mb, "cache_mb": _cache_mb(cache)}


def window_memory(window: int, tokens: int, new: int, layers: int, impls: list[str],
                  threads: int) -> list[list]:
    """The rows of the sliding-window memory table (see the module docstring)."""
    import torch
    import kvcore
    from transformers import AttentionInterface, DynamicCache, MistralConfig, MistralForCausalLM
    import kvcore.integrations.transformers as kvhf
    torch.set_num_threads(threads)
    kvcore.set_num_threads(threads)
    torch.manual_seed(0)
    cfg = MistralConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=layers,
                        num_attention_heads=8, num_key_value_heads=8, head_dim=128,
                        vocab_size=1000, max_position_embeddings=tokens + 1,
                        sliding_window=window)
    model = MistralForCausalLM(cfg).eval()
    ids = torch.randint(0, 1000, (1, tokens - new), generator=torch.Generator().manual_seed(1))
    chunk = max(window, kvhf._WINDOW_CHUNK)
    rows = []
    for impl in impls:
        peak = [0, 0]          # bytes the layers hold, positions a row holds in one layer
        if impl.startswith("kvcore-"):
            model.set_attn_implementation("kvcore")
            cache = kvhf.KVCoreCache(model.config, format=impl.removeprefix("kvcore-"))
            attend, name = kvhf.decode_attention, "decode_attention"

            def counted(q, pool, layer, **kw):   # the new positions are written, not released
                pools = [l.pool for l in cache.layers if l.is_initialized]
                peak[0] = max(peak[0], sum(p.num_used_pages * p.memory_bytes // p.num_pages
                                           for p in pools))
                peak[1] = max(peak[1], max(p.length(s) + p.pending(s, 0) - p.first_held(s)
                                           for p in pools for s in p.sequences))
                return attend(q, pool, layer, **kw)
            target = kvhf
        elif impl == "dynamic-sdpa":
            model.set_attn_implementation("sdpa")
            cache = DynamicCache(config=model.config)
            attend, name = AttentionInterface._global_mapping["sdpa"], "sdpa"

            def counted(module, query, key, value, *a, **kw):
                # each other layer holds the storage its W - 1 kept positions are a view of
                others = sum(l.keys.untyped_storage().nbytes() + l.values.untyped_storage().nbytes()
                             for i, l in enumerate(cache.layers)
                             if l.is_initialized and i != module.layer_idx)
                peak[0] = max(peak[0], others + key.nbytes + value.nbytes)
                peak[1] = max(peak[1], key.shape[2])
                return attend(module, query, key, value, *a, **kw)
            target = AttentionInterface._global_mapping
        else:
            raise ValueError(f"unknown impl {impl!r}: kvcore-<format> or dynamic-sdpa")
        t0 = time.perf_counter()
        if target is kvhf:
            kvhf.decode_attention = counted
        else:
            target[name] = counted
        try:
            with torch.no_grad():
                if impl == "dynamic-sdpa":   # one 16k forward would build a 16k x 16k mask
                    for a in range(0, ids.shape[1] - 1, chunk):
                        b = min(a + chunk, ids.shape[1] - 1)
                        model(ids[:, a:b], past_key_values=cache)
                out = model.generate(ids, attention_mask=torch.ones_like(ids),
                                     past_key_values=cache, max_new_tokens=new,
                                     min_new_tokens=new, do_sample=False, pad_token_id=0)
        finally:
            if target is kvhf:
                kvhf.decode_attention = attend
            else:
                target[name] = attend
        seconds = time.perf_counter() - t0
        assert out.shape[1] == tokens and cache.get_seq_length() == tokens - 1
        if impl == "dynamic-sdpa":
            position_bytes = 2 * 8 * 128 * 4          # K and V, 8 kv heads, head_dim 128, f32
            held_end = max(l.keys.shape[2] for l in cache.layers)
            allocated = sum(l.keys.untyped_storage().nbytes() + l.values.untyped_storage().nbytes()
                            for l in cache.layers)
            prefill = f"model(chunk) x {-(-(ids.shape[1] - 1) // chunk)}, then generate"
        else:
            pool = cache.layers[0].pool
            position_bytes = pool.memory_bytes / pool.num_pages / pool.page_size
            held_end = max(p.length(s) - p.first_held(s) for p in (l.pool for l in cache.layers)
                           for s in p.sequences)
            allocated = cache.memory_bytes
            prefill = "generate (one forward)"
        full = (tokens - 1) * layers * position_bytes
        rows.append([impl, prefill, tokens - 1, peak[1], held_end, peak[0] / 2**20,
                     allocated / 2**20, full / 2**20, peak[0] / full, seconds])
        del cache
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", default="1024,4096,16384")
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (4; --window: 2)")
    ap.add_argument("--impls", default=",".join(IMPLS))
    ap.add_argument("--rounds", type=int, default=1,
                    help="passes over the impls per context (every other one in reverse "
                         "order); tokens/s is the best pass, its range is shown")
    ap.add_argument("--batch", type=int, default=1, help="rows generated together")
    ap.add_argument("--window", type=int, default=None,
                    help="measure a sliding-window model's cache memory instead (W)")
    ap.add_argument("--tokens", type=int, default=16384,
                    help="--window: positions of the generation (prompt + new)")
    ap.add_argument("--window-impls", default="kvcore-f16,kvcore-int8,dynamic-sdpa",
                    help="--window: caches measured")
    ap.add_argument("--child", nargs=2, metavar=("IMPL", "CONTEXT"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.window is not None:
        layers = a.layers or 2
        print(f"machine: {_cpu_name()}, {os.cpu_count()} CPUs; threads {a.threads}; model: "
              f"Mistral, {layers} layers (all sliding, window {a.window}), hidden 256, 8 "
              f"heads / 8 kv heads, head_dim 128, float32; {a.tokens - a.new} prompt tokens "
              f"+ {a.new} new")
        print_table(f"sliding-window cache memory over a generation (window {a.window})",
                    ["cache", "prompt written by", "positions", "peak positions held / row / layer",
                     "held at the end", "peak held MB (all layers)", "allocated MB",
                     "full cache MB (computed)", "peak / full", "s"],
                    window_memory(a.window, a.tokens, a.new, layers,
                                  a.window_impls.split(","), a.threads))
        return
    a.layers = a.layers or 4
    if a.child:
        print(json.dumps(child(a.child[0], int(a.child[1]), a.new, a.threads, a.layers,
                               a.batch)))
        return
    print(f"machine: {_cpu_name()}, {os.cpu_count()} CPUs; "
          f"threads {a.threads}; model: {a.layers} layers, hidden {HIDDEN}, {HEADS} heads / "
          f"{KV_HEADS} kv heads, head_dim {HEAD_DIM}, float32; batch {a.batch}; {a.new} new "
          f"tokens per row")
    rows = []
    for context in map(int, a.contexts.split(",")):
        impls = a.impls.split(",")
        runs: dict[str, list[dict]] = {impl: [] for impl in impls}
        for r in range(a.rounds):
            for impl in impls if r % 2 == 0 else impls[::-1]:
                result = _run_child(impl, context, a)
                if result:
                    runs[impl].append(result)
        best = {impl: max(rs, key=lambda x: x["tokens_per_s"]) for impl, rs in runs.items() if rs}
        ref = best.get("sdpa")
        for impl, b in best.items():
            speeds = [x["tokens_per_s"] for x in runs[impl]]
            rows.append([impl, a.batch, context, b["tokens_per_s"],
                         f"{min(speeds):.3g}-{max(speeds):.3g}",
                         b["tokens_per_s"] / ref["tokens_per_s"] if ref else "-",
                         max(x["peak_mb"] for x in runs[impl]),
                         "-" if b["cache_mb"] is None else b["cache_mb"]])
    print_table("generate: tokens/s and memory", ["cache + attention", "batch", "context",
                "tokens/s", f"range over {a.rounds} runs", "x DynamicCache+SDPA", "peak MB over the model",
                "cache MB"], rows)


def _run_child(impl: str, context: int, a) -> dict | None:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", impl, str(context),
           "--new", str(a.new), "--threads", str(a.threads), "--layers", str(a.layers),
           "--batch", str(a.batch)]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode:
        err = (p.stderr.strip().splitlines() or ["?"])[-1]
        print(f"{impl} @ {context}: failed: {err}", file=sys.stderr)
        return None
    return json.loads(p.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
