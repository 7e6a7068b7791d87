#!/usr/bin/env python3
"""The `attention` and `step` sections of tools/bench_gpu.py (bench_attention, bench_step;
also runnable alone: python3 tools/bench_gpu_attention.py).

attention: Hq = 32, Hkv = 8, D = 128, batch 1/8/32/128, context 1024/4096/16384/32768:
  our decode attention per format (q float16, out float32) against torch
  scaled_dot_product_attention fp16 with enable_gqa=True on the same shapes, a
  device-to-device copy's bandwidth (bytes read + written), and our KV bytes read per
  second as a fraction of it. CUDA events on one stream, L2 flushed (a 256 MiB write)
  before every timed launch, median of REPEAT; cache contents are random codes.
step: one 32-layer decode step (RoPE + append + attention per layer, then advance) of
  a DecodeGraph, replayed, against the same step launched kernel by kernel.
Needs torch with CUDA (a peer only; the library never imports it).
"""
from __future__ import annotations

import math
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _benchlib import print_table  # noqa: E402

HQ, HKV, D = 32, 8, 128
BATCHES = (1, 8, 32, 128)
CONTEXTS = (1024, 4096, 16384, 32768)
FORMATS = ("f16", "bf16", "f32", "int8", "fp8_e4m3", "fp8_e5m2", "q8_0", "q4_0", "q4_1",
           "q4_1ch/q4_1")   # K q4_1ch (KIVI's layout) with V q4_1
REPEAT = 15


class _Timer:
    """Median event time (ms) of fn on torch's current stream, L2 flushed before each."""

    def __init__(self, torch):
        self.torch = torch
        self.flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")

    def __call__(self, fn, repeat=REPEAT) -> float:
        torch = self.torch
        fn()
        times = []
        for _ in range(repeat):
            self.flush.fill_(1)
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        return float(np.median(times))


def copy_bandwidth(torch, timer) -> float:
    """Device-to-device copy of 2 GiB, GB/s counting bytes read plus written."""
    src = torch.randn(512 << 20, device="cuda")
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    del src, dst
    return 2 * (2 << 30) / (ms * 1e-3) / 1e9


def _fill_random(torch, cache, ctx_len):
    """Random valid codes and scales in every slot (and K q4_1ch's residual), lengths =
    ctx_len (torch, in place)."""
    for f, arr in zip(cache.spec.fmts, (cache.keys(0), cache.values(0))):
        t = torch.as_tensor(arr, device="cuda")
        if f.name == "f32":
            t.normal_()
        elif f.name == "f16":
            t.copy_(torch.randn(t.shape, device="cuda", dtype=torch.float16))
        elif f.name == "bf16":
            t.view(torch.int16).copy_(torch.randn(t.shape, device="cuda", dtype=torch.bfloat16).view(torch.int16))
        elif f.name in ("int8", "q8_0"):
            t.random_(-127, 128)
        else:  # fp8: finite codes only; 4-bit: any byte
            t.random_(0, 0x7C)
    for f, scales in zip(cache.spec.fmts, (cache.key_scales, cache.value_scales)):
        if f.quantized:
            torch.as_tensor(scales(0), device="cuda").uniform_(0.001, 0.01)
    if cache.spec.k_fmt.group:
        torch.as_tensor(cache.key_residual(0), device="cuda").normal_()
    torch.as_tensor(cache.lengths, device="cuda").fill_(ctx_len)
    torch.cuda.synchronize()


def attention_section(torch, timer, copy_gbs) -> None:
    from kvcore import KVSpec
    from kvcore.gpu import GpuKVCache
    from kvcore.gpu.attention import AttentionPlan
    stream = torch.cuda.current_stream().cuda_stream
    times, fracs = [], []
    free = torch.cuda.mem_get_info()[0]
    for batch in BATCHES:
        for ctx_len in CONTEXTS:
            fp16_kv = 2 * batch * HKV * ctx_len * D * 2
            if 2.2 * fp16_kv > 0.8 * free:
                continue  # torch's K/V plus our largest cache (f32) must fit
            k = torch.randn(batch, HKV, ctx_len, D, device="cuda", dtype=torch.float16)
            v = torch.randn_like(k)
            qt = torch.randn(batch, HQ, 1, D, device="cuda", dtype=torch.float16)
            sdpa = torch.nn.functional.scaled_dot_product_attention
            t_torch = timer(lambda: sdpa(qt, k, v, enable_gqa=True))
            del k, v
            row_t, row_f = [batch, ctx_len, t_torch * 1e3], [batch, ctx_len]
            q = torch.randn(batch, HQ, D, device="cuda", dtype=torch.float16)
            out = torch.empty(batch, HQ, D, device="cuda", dtype=torch.float32)
            for fmt in FORMATS:
                spec = KVSpec(num_layers=1, num_kv_heads=HKV, head_dim=D, capacity=ctx_len,
                              num_heads=HQ, format=fmt)
                cache = GpuKVCache(spec, slots=batch)
                _fill_random(torch, cache, ctx_len)
                plan = AttentionPlan(cache, q_dtype="float16")
                ms = timer(lambda: plan.run(q, out, 0, stream=stream))
                assert torch.isfinite(out).all()
                plan.free()
                cache.free()
                kv_bytes = batch * ctx_len * spec.bytes_per_position
                gbs = kv_bytes / (ms * 1e-3) / 1e9
                row_t.append(f"{ms * 1e3:.1f} ({t_torch / ms:.2f}x)")
                row_f.append(f"{gbs / copy_gbs:.2f}")
            times.append(row_t)
            fracs.append(row_f)
            del q, out
            torch.cuda.empty_cache()
    print_table("decode attention: time in us (speed-up over torch SDPA fp16 enable_gqa)",
                ["batch", "context", "torch fp16 us", *FORMATS], times)
    print_table(f"decode attention: KV bytes read per second / copy bandwidth ({copy_gbs:.0f} GB/s)",
                ["batch", "context", *FORMATS], fracs)


def step_section(torch, timer) -> None:
    from kvcore import KVSpec
    from kvcore.gpu import GpuKVCache
    from kvcore.gpu.graph import DecodeGraph
    rows = []
    batch, start, steps = 32, 4096, 40
    for fmt in ("f16", "int8"):
        spec = KVSpec(num_layers=32, num_kv_heads=HKV, head_dim=D, capacity=start + 4 * steps,
                      num_heads=HQ, format=fmt)
        cache = GpuKVCache(spec, slots=batch)
        for layer in range(spec.num_layers):
            for arr in (cache.keys(layer), cache.values(layer)):
                t = torch.as_tensor(arr, device="cuda")
                if fmt == "f16":
                    t.copy_(torch.randn(t.shape, device="cuda", dtype=torch.float16))
                else:
                    t.random_(-127, 128)
            if spec.fmt.quantized:
                for arr in (cache.key_scales(layer), cache.value_scales(layer)):
                    torch.as_tensor(arr, device="cuda").uniform_(0.001, 0.01)
        torch.as_tensor(cache.lengths, device="cuda").fill_(start)
        graph = DecodeGraph(cache, dtype="float16")
        for layer in range(spec.num_layers):
            for buf in (graph.q(layer), graph.k(layer), graph.v(layer)):
                torch.as_tensor(buf, device="cuda").copy_(
                    torch.randn(buf.shape, device="cuda", dtype=torch.float16))
        torch.cuda.synchronize()
        s = torch.cuda.current_stream().cuda_stream
        t_graph = timer(lambda: graph.replay(stream=s), repeat=steps)
        t_eager = timer(lambda: graph.step_eager(stream=s), repeat=steps)
        torch.cuda.synchronize()
        cache.check()
        rows.append([fmt, batch, start, t_graph * 1e3, t_eager * 1e3, t_eager / t_graph])
        graph.destroy()
        cache.free()
    print_table("one 32-layer decode step (Hq 32, Hkv 8, D 128): CUDA graph replay vs eager launches",
                ["format", "batch", "context", "graph us", "eager us", "eager / graph"], rows)


def _torch_and_timer():
    import torch
    if not torch.cuda.is_available():
        raise SystemExit("torch sees no CUDA device: the attention benchmarks need it as the peer")
    return torch, _Timer(torch)


def bench_attention() -> None:
    """The `attention` section of tools/bench_gpu.py."""
    torch, timer = _torch_and_timer()
    print(f"device: {torch.cuda.get_device_name()}")
    copy_gbs = copy_bandwidth(torch, timer)
    print(f"device-to-device copy: {copy_gbs:.0f} GB/s (read + write)")
    attention_section(torch, timer, copy_gbs)


def bench_step() -> None:
    """The `step` section of tools/bench_gpu.py."""
    torch, timer = _torch_and_timer()
    step_section(torch, timer)


def main() -> int:
    bench_attention()
    bench_step()
    return 0


if __name__ == "__main__":
    sys.exit(main())
