#!/usr/bin/env python3
"""GPU benchmarks, timed with CUDA events (median of repeats after warm-up), printed as
markdown tables with the peer measured in the same run.

    python3 tools/bench_gpu.py                  # every section
    python3 tools/bench_gpu.py append           # only some sections
    python3 tools/bench_gpu.py paged --batches 1,32 --contexts 4096 --formats f16,int8 --repeat 10

    python3 tools/bench_gpu.py --emulate --smoke paged   # tiny sizes on the emulator (a
                                                        # check that it runs: CPU times)
    python3 tools/bench_gpu.py --help

Sections live in SECTIONS (name -> function(smoke) printing its table); add one per kernel
family.
  append: one decode step (32 layers x M = 64 slots, Hkv = 8, D = 128, float16 input) of
          GpuKVCache.append + advance per format, replayed as a CUDA graph, against a graph
          of cuMemcpyDtoDAsync of the same input bytes (one copy per layer), same stream;
          also the step launched eagerly from Python. The mean of 8 steps (K q4_1ch: of 32,
          the last one encoding the group).
  paged:  GpuKVPool.decode_attention (one query token per sequence, Hq 32, Hkv 8, D 128,
          pages of 16 (K q4_1ch: 32, whole groups) in a shuffled physical order, q and out
          float32), batch 1/8/32/128 x context 1024/4096/16384 per format and K/V pair
          (--batches, --contexts, --formats: PAGED_FORMATS), replayed
          as a CUDA graph, against the same decode over a contiguous GpuKVCache
          (AttentionPlan.run: paged / contiguous), a graph of one cuMemcpyDtoDAsync of the
          same bytes (the K and V codes and scales the decode reads) and torch
          scaled_dot_product_attention (fp16, enable_gqa, contiguous
          [B, Hkv, N, D] K/V: the dense peer) on the same shapes; L2 flushed (a 256 MiB
          memset) before every timed launch. Needs torch with CUDA for the SDPA column
          (else "n/a"). The copy reads and writes the bytes, the decode only reads them:
          compare the GB/s columns (decode / copy = 0.5 is the copy's rate of bytes moved).
  tiers:  GpuKVPool's prefix hit of a 4096-token prompt (32 layers, Hkv 8, D 128, f16,
          pages of 16) from each tier: the GPU's own cache (no copy), the host tier (a
          page-locked KVPool: cuMemcpy3DAsync per page and region on the transfer stream)
          and the store (a DirectoryBackend: read, checked, copied in), as wall time of
          match_prefix until its copies ran, and GB/s of the prompt's bytes, against one
          cuMemcpyHtoDAsync of the same bytes from page-locked memory. Then a serving
          trace: requests over a few shared system prompts and unique tails, the GPU
          holding a few prompts, the host a few more, the store all: the share of the
          requests' full pages found on each tier (and computed: misses), and the time the
          compute stream spent waiting for transfers (CUDA events around its waits).
  attention, step: the GpuKVCache decode attention and DecodeGraph step against torch
          (tools/bench_gpu_attention.py; need torch with CUDA).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _benchlib import print_table  # noqa: E402

from kvcore import KVSpec  # noqa: E402
from kvcore.spec import resolve_formats  # noqa: E402
from kvcore import gpu  # noqa: E402
from kvcore.gpu import driver  # noqa: E402
from kvcore.gpu.attention import MAX_GRID_Z  # noqa: E402
from kvcore.gpu.attention import AttentionPlan  # noqa: E402
from kvcore.gpu.memory import PinnedHost  # noqa: E402


def time_ms(fn, stream: gpu.Stream, *, repeat: int = 20, warmup: int = 3,
            before=None) -> float:
    """Median milliseconds of fn() on `stream` between two CUDA events; `before()` runs
    untimed ahead of each call (resets and the like)."""
    start, end = gpu.Event.create(), gpu.Event.create()
    times = []
    for i in range(warmup + repeat):
        if before is not None:
            before()
        start.record(stream=stream)
        fn()
        end.record(stream=stream)
        end.synchronize()
        if i >= warmup:
            times.append(start.elapsed_ms(end))
    start.destroy()
    end.destroy()
    return float(np.median(times))


def capture(fn, stream: gpu.Stream):
    """fn's launches on `stream` captured into an instantiated graph; returns a replay
    function and a destroy function."""
    drv = driver.cuda()
    with stream.ctx:
        driver.call("cuStreamBeginCapture", stream.handle,
                    drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL)
        try:
            fn()
        finally:
            graph = driver.call("cuStreamEndCapture", stream.handle)
        exe = driver.call("cuGraphInstantiate", graph, 0)

    def destroy():
        with stream.ctx:
            driver.call("cuGraphExecDestroy", exe)
            driver.call("cuGraphDestroy", graph)

    def replay():
        with stream.ctx:
            driver.call("cuGraphLaunch", exe, stream.handle)
    return replay, destroy


def bench_append(opts) -> None:
    L, M, H, D, min_steps = (2, 4, 2, 64, 2) if opts.smoke else (32, 64, 8, 128, 8)
    rng = np.random.default_rng(0)
    rows = []
    for fmt in opts.formats:
        steps = max(min_steps, _k_group(fmt))    # K q4_1ch: a whole group, its encode included
        spec = KVSpec(num_layers=L, num_kv_heads=H, head_dim=D, capacity=steps, format=fmt)
        cache = gpu.GpuKVCache(spec, M)
        x = (rng.standard_normal((L, 2, M, H, D)) * 3).astype(np.float16)
        buf = gpu.DeviceBuffer.from_numpy(x)
        layer_bytes = 2 * M * H * D * 2
        kv = [(buf.view((M, H, D), np.float16, offset=l * layer_bytes),
               buf.view((M, H, D), np.float16, offset=l * layer_bytes + layer_bytes // 2))
              for l in range(L)]
        dst = gpu.DeviceBuffer.alloc(buf.nbytes)

        def step():
            for l in range(L):
                cache.append(l, *kv[l])
            cache.advance()

        def copy():
            with cache.ctx:
                for l in range(L):
                    driver.call("cuMemcpyDtoDAsync", driver.cuda().CUdeviceptr(dst.ptr + l * layer_bytes),
                                driver.cuda().CUdeviceptr(buf.ptr + l * layer_bytes), layer_bytes,
                                cache.stream.handle)

        def times(fn):
            return lambda: [fn() for _ in range(steps)]

        t_eager = time_ms(times(step), cache.stream, before=cache.reset) / steps
        g_step, free_step = capture(step, cache.stream)
        g_copy, free_copy = capture(copy, cache.stream)
        t_app = time_ms(times(g_step), cache.stream, before=cache.reset) / steps
        cache.check()
        t_cpy = time_ms(times(g_copy), cache.stream) / steps
        out_bytes = M * spec.bytes_per_position
        in_bytes = buf.nbytes
        rows.append([fmt, t_app * 1e3, (in_bytes + out_bytes) / (t_app * 1e-3) / 1e9,
                     t_cpy * 1e3, 2 * in_bytes / (t_cpy * 1e-3) / 1e9, t_app / t_cpy,
                     t_eager * 1e3])
        free_step()
        free_copy()
        for b in (buf, dst):
            b.free()
        cache.free()
    ctx = gpu.Context.get()
    print_table(f"append: one decode step, {L} layers x M={M} slots, Hkv={H}, D={D}, f16 input "
                f"({ctx.name}; graph of {L} appends + 1 advance vs graph of {L} DtoD copies "
                f"of the input bytes; eager = launched from Python)",
                ["format", "append step us", "GB/s (in+out)", "DtoD copy us",
                 "copy GB/s (r+w)", "append / copy", "eager step us"], rows)


PAGED_FORMATS = ("f16", "bf16", "f32", "int8", "fp8_e4m3", "fp8_e5m2", "q8_0", "q4_0", "q4_1",
                 "q8_0/q4_0", "q4_1ch/q4_1")
"""Formats and K/V pairs of the paged section; K q4_1ch takes pages of at least 32 (whole groups)."""
FLUSH_BYTES = 256 << 20     # more than the L2 of any GPU kvcore targets (H100: 50 MiB)


def _random_codes(rng, fmt, shape) -> np.ndarray:
    """Valid codes of `fmt` (finite values; the code dtype's bits)."""
    if fmt.name in ("f32", "f16"):
        return rng.standard_normal(shape).astype(fmt.code_dtype)
    if fmt.name == "bf16":     # bfloat16 bits: the top half of a float32
        return (rng.standard_normal(shape).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    if fmt.name in ("int8", "q8_0"):
        return rng.integers(-127, 128, shape).astype(fmt.code_dtype)
    return rng.integers(0, 0x7C, shape).astype(np.uint8).view(fmt.code_dtype)  # finite fp8; 4-bit pairs


def _fill(view, block: np.ndarray, stream) -> None:
    """Fills the C-contiguous device view with copies of `block` (its first pages): one host
    copy, then device-to-device copies doubling the filled part."""
    drv = driver.cuda()
    host = np.ascontiguousarray(block).view(np.uint8).reshape(-1)
    head = min(host.nbytes, view.nbytes)
    with view.ctx:
        driver.call("cuMemcpyHtoD", drv.CUdeviceptr(view.ptr), host.ctypes.data, head)
        done = head
        while done < view.nbytes:
            n = min(done, view.nbytes - done)
            driver.call("cuMemcpyDtoDAsync", drv.CUdeviceptr(view.ptr + done),
                        drv.CUdeviceptr(view.ptr), n, stream.handle)
            done += n


def _torch_cuda():
    """torch when it sees a CUDA device and kvcore is not emulated, else None."""
    if gpu.using_emulator():
        return None
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def _k_group(name: str) -> int:
    """Positions K of format (or pair) `name` encodes together: 32 for q4_1ch, else 0."""
    return resolve_formats(name)[0].group


def _fill_random(store, block: tuple, rng, stream) -> None:
    """Random valid codes and scales in layer 0 of a GpuKVCache or GpuKVPool (`block`: the
    leading shape of the copied block, ending with Hkv), and K q4_1ch's residuals."""
    D = store.spec.head_dim
    for f, codes, scales in zip(store.spec.fmts, (store.keys, store.values),
                                (store.key_scales, store.value_scales)):
        _fill(codes(0), _random_codes(rng, f, block + (f.code_width(D),)), stream)
        if f.quantized:
            _fill(scales(0), rng.uniform(0.001, 0.01, block + (f.scales_per_row(D),))
                  .astype(f.scale_dtype), stream)
    if store.spec.k_fmt.group:
        res = store.key_residual(0)
        _fill(res, rng.standard_normal(res.shape).astype(np.float16), stream)


def _contiguous(spec, B: int, N: int, q, out, rng, stream):
    """A GpuKVCache of B slots holding N random positions each and an AttentionPlan over it:
    (cache, plan, run) with run() the decode of q into out on `stream`."""
    cache = gpu.GpuKVCache(spec, B, stream=stream)
    _fill_random(cache, (1, spec.num_kv_heads, min(N, 64)), rng, stream)
    lengths = np.full(B, N, np.int32)
    cache.lengths.copy_from_numpy(lengths, stream=stream)
    stream.synchronize()
    plan = AttentionPlan(cache, q_dtype="float32")
    return cache, plan, lambda: plan.run(q, out, 0, stream=stream)


def bench_paged(opts) -> None:
    if opts.smoke:
        HQ, HKV, D, PS, batches, contexts, repeat = 4, 2, 64, 4, (1, 3), (5, 12), 2
    else:
        HQ, HKV, D, PS, batches, contexts, repeat = 32, 8, 128, 16, (1, 8, 32, 128), (1024, 4096, 16384), 20
    batches, contexts, repeat = opts.batches or batches, opts.contexts or contexts, opts.repeat or repeat
    smoke = opts.smoke
    torch = _torch_cuda()
    rng = np.random.default_rng(0)
    ctx = gpu.Context.get()
    flush = gpu.DeviceBuffer.alloc(FLUSH_BYTES >> (12 if smoke else 0))
    rows = []
    for B in batches:
        for N in contexts:
            if 2.5 * 2 * B * N * HKV * D * 2 > 0.7 * ctx.mem_get_info()[0]:
                continue   # torch's fp16 K/V must fit
            t_sdpa = None
            if torch is not None:
                st = torch.cuda.current_stream()
                k = torch.randn(B, HKV, N, D, device="cuda", dtype=torch.float16)
                v, qt = torch.randn_like(k), torch.randn(B, HQ, 1, D, device="cuda", dtype=torch.float16)
                sdpa = torch.nn.functional.scaled_dot_product_attention
                t_sdpa = time_ms(lambda: sdpa(qt, k, v, enable_gqa=True), st, repeat=repeat,
                                 before=lambda: flush.fill(0, stream=st))
                del k, v, qt
                torch.cuda.empty_cache()    # give its K/V back before the pools allocate
            for name in opts.formats:
                ps = max(PS, _k_group(name))            # K q4_1ch: pages of whole groups
                pages_per_seq = -(-N // ps)
                spec = KVSpec(num_layers=1, num_kv_heads=HKV, head_dim=D, capacity=pages_per_seq * ps,
                              num_heads=HQ, format=name)
                if 3.3 * B * pages_per_seq * ps * spec.bytes_per_position > 0.8 * ctx.mem_get_info()[0]:
                    continue   # the pool, the contiguous cache and the copy's destination must fit
                chunk = min(N - 1, MAX_GRID_Z // B)   # decode's rows: B x max_tokens
                pool = gpu.GpuKVPool(spec, B * pages_per_seq, ps, max_batch=B,
                                     max_pages_per_seq=pages_per_seq, max_tokens=chunk)
                pool._table.free[:] = rng.permutation(pool.num_pages).tolist()  # scattered pages
                _fill_random(pool, (min(pool.num_pages, 64), ps, HKV), rng, pool.stream)
                seqs = [pool.new_sequence() for _ in range(B)]
                for done in range(0, N - 1, chunk):  # N - 1 positions each (the random codes above)
                    pool.begin_step(seqs, [min(chunk, N - 1 - done)] * B)
                    pool.advance()
                pool.begin_step(seqs)               # the decode step: N positions each
                qo = gpu.DeviceBuffer.alloc(2 * B * HQ * D * 4)
                q = qo.view((B, HQ, D), np.float32)
                out = qo.view((B, HQ, D), np.float32, offset=B * HQ * D * 4)
                q.copy_from_numpy(rng.standard_normal((B, HQ, D)).astype(np.float32))
                kv_bytes = B * N * spec.bytes_per_position
                dst = gpu.DeviceBuffer.alloc(kv_bytes)

                def copy(src=pool.keys(0).ptr, dst=dst, n=kv_bytes, st=pool.stream):
                    with ctx:
                        driver.call("cuMemcpyDtoDAsync", driver.cuda().CUdeviceptr(dst.ptr),
                                    driver.cuda().CUdeviceptr(src), n, st.handle)

                cache, plan, contiguous = _contiguous(spec, B, N, q, out, rng, pool.stream)
                g_dec, free_dec = capture(lambda: pool.decode_attention(q, out, 0), pool.stream)
                g_con, free_con = capture(contiguous, pool.stream)
                g_cpy, free_cpy = capture(copy, pool.stream)
                flush_pool = lambda: flush.fill(0, stream=pool.stream)  # noqa: E731
                t_dec = time_ms(g_dec, pool.stream, repeat=repeat, before=flush_pool)
                t_con = time_ms(g_con, pool.stream, repeat=repeat, before=flush_pool)
                t_cpy = time_ms(g_cpy, pool.stream, repeat=repeat, before=flush_pool)
                pool.advance()
                if not np.isfinite(out.to_numpy()).all():
                    raise RuntimeError(f"decode of {name} gave a non-finite output")
                free_dec(), free_con(), free_cpy()
                dst.free(), qo.free()
                plan.free(), cache.free(), pool.free()
                sdpa_cols = ["n/a", "n/a"] if t_sdpa is None else [t_sdpa * 1e3, t_dec / t_sdpa]
                rows.append([name, B, N, ps, t_dec * 1e3, kv_bytes / (t_dec * 1e-3) / 1e9,
                             t_con * 1e3, t_dec / t_con,
                             t_cpy * 1e3, 2 * kv_bytes / (t_cpy * 1e-3) / 1e9, t_dec / t_cpy,
                             *sdpa_cols])
                print(f"paged row: {rows[-1]}", flush=True)   # kept if the run is cut short
    flush.free()
    where = ("EMULATOR: times are CPU times of the emulated kernels, not device figures"
             if gpu.using_emulator() else ctx.name)
    print_table(f"paged: GpuKVPool.decode_attention, one query token per sequence, Hq={HQ}, "
                f"Hkv={HKV}, D={D} ({where}; graph replays, L2 flushed; copy = "
                f"graph of one DtoD copy of the K/V bytes the decode reads; contiguous = the same "
                f"decode over a GpuKVCache; SDPA = torch fp16 enable_gqa on dense K/V)",
                ["format", "batch", "context", "page", "decode us", "decode GB/s (read)", "contiguous us",
                 "paged / contiguous", "copy us", "copy GB/s (r+w)", "decode / copy", "SDPA us",
                 "decode / SDPA"], rows)


def _tier_pools(spec, pages: int, host_pages: int, store, writer=None):
    from kvcore import KVPool
    host = KVPool(spec, host_pages, 16, prefix_cache=True) if host_pages else None
    return gpu.GpuKVPool(spec, pages, 16, max_batch=4, max_pages_per_seq=spec.capacity // 16,
                         max_tokens=spec.capacity, prefix_cache=True, host=host, store=store,
                         store_writer=writer)


def _prefill(pool, tokens, kv) -> None:
    """Computes the positions of tokens that match_prefix did not find (K = V = kv(n, m),
    the device rows n..m-1)."""
    s, n = pool.match_prefix(tokens)
    if n < len(tokens):
        pool.begin_step([s], [len(tokens) - n])
        for layer in range(pool.spec.num_layers):
            pool.append(layer, kv(n, len(tokens)), kv(n, len(tokens)))
        pool.advance(tokens=[tokens[n:]])
    pool.free_sequence(s)


def bench_tiers(opts) -> None:
    import tempfile
    from kvcore.store import DirectoryBackend, KVStore, StoreWriter
    L, H, D, N = (2, 2, 64, 64) if opts.smoke else (32, 8, 128, 4096)
    spec = KVSpec(num_layers=L, num_kv_heads=H, head_dim=D, capacity=N + 16, format="f16")
    pages = N // 16
    rng = np.random.default_rng(0)
    host_kv = rng.standard_normal((N + 16, H, D)).astype(np.float16)
    buf = gpu.DeviceBuffer.from_numpy(host_kv)

    def kv(a: int, b: int):
        return buf.view((b - a, H, D), np.float16, offset=a * H * D * 2)
    prompt = rng.integers(0, 50000, N).tolist()
    nbytes = N * spec.bytes_per_position
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        store = KVStore(DirectoryBackend(tmp), model="bench", spec=spec, chunk_tokens=256 if N >= 256 else 16,
                        page_size=16)
        with StoreWriter(store, max_pending=pages) as writer:
            pool = _tier_pools(spec, pages, pages + 1, store, writer)
            _prefill(pool, prompt, kv)
            pool._settle()
        # the peer: the same bytes in one copy from page-locked memory
        peer = np.zeros(nbytes, np.uint8)
        dst = gpu.DeviceBuffer.alloc(nbytes)
        pinned = PinnedHost(peer, pool.ctx)
        copy_ms = time_ms(lambda: dst.copy_from_host(peer, stream=pool.stream), pool.stream,
                          repeat=opts.repeat or 5, warmup=1)
        pinned.unpin()
        dst.free()

        def hit(tier: str) -> float:
            """ms of match_prefix(prompt) with its copies, the prompt cached on `tier` only
            (pushed off the GPU, which holds one prompt, by another first)."""
            times = []
            for _ in range(opts.repeat or 5):
                if tier != "GPU":
                    _prefill(pool, rng.integers(50000, 90000, N).tolist(), kv)
                before = (pool.stats.hits, pool.tier_stats.host_hits, pool.stats.store_hits)
                t0 = time.perf_counter()
                s, n = pool.match_prefix(prompt + [0])
                pool.stream.synchronize()
                pool._settle()
                times.append((time.perf_counter() - t0) * 1e3)
                after = (pool.stats.hits, pool.tier_stats.host_hits, pool.stats.store_hits)
                found = [b - a for a, b in zip(before, after)]
                assert n == N and found[["GPU", "host", "store"].index(tier)] == pages, (tier, found)
                pool.free_sequence(s)
            return float(np.median(times))

        for tier in ("GPU", "host", "store"):
            if tier == "store":
                pool.free()
                pool = _tier_pools(spec, pages, 0, store)
            ms = hit(tier)
            rows.append([tier, N, f"{nbytes / 2**20:.0f}", ms, nbytes / ms / 1e6, copy_ms,
                         nbytes / copy_ms / 1e6, copy_ms / ms if ms else 0.0])
        pool.free()
    note = " (EMULATOR: CPU times, not device figures)" if gpu.using_emulator() else ""
    print_table(f"tiers: prefix hit of a {N}-token prompt{note}",
                ["tier", "tokens", "MiB", "hit ms", "hit GB/s", "pinned copy ms", "copy GB/s",
                 "hit / copy (speed)"], rows)
    _serving_trace(opts, spec, kv)
    buf.free()


def _serving_trace(opts, spec, kv) -> None:
    """Requests over shared system prompts with unique tails: pages found per tier."""
    import tempfile
    from kvcore.store import DirectoryBackend, KVStore, StoreWriter
    rng = np.random.default_rng(1)
    N = spec.capacity - 16
    systems = [rng.integers(0, 50000, N * 3 // 4).tolist() for _ in range(6)]
    pages = N // 16
    with tempfile.TemporaryDirectory() as tmp:
        store = KVStore(DirectoryBackend(tmp), model="bench", spec=spec,
                        chunk_tokens=256 if N >= 256 else 16, page_size=16)
        with StoreWriter(store, max_pending=4 * pages) as writer:
            pool = _tier_pools(spec, 2 * pages + 4, 2 * pages, store, writer)
            waits = _time_waits(pool)
            requests = 0
            t0 = time.perf_counter()
            for i in rng.integers(0, len(systems), 12 if opts.smoke else 40):
                tail = rng.integers(50000, 60000, N - len(systems[i])).tolist()
                _prefill(pool, systems[i] + tail, kv)
                requests += 1
            pool.stream.synchronize()
            wall_ms = (time.perf_counter() - t0) * 1e3
            pool._settle()
            st, ts = pool.stats, pool.tier_stats
            waited_ms = sum(a.elapsed_ms(b) for a, b in waits)
            pool.free()
    found = {"GPU": st.hits, "host": ts.host_hits, "store": st.store_hits, "computed": st.misses}
    total = sum(found.values())
    print_table(f"tiers: serving trace ({requests} requests of {N} tokens over {len(systems)} "
                f"system prompts of {len(systems[0])}; GPU {2 * pages + 4} pages, host {2 * pages})",
                ["tier", "full pages", "share"],
                [[k, v, v / total if total else 0.0] for k, v in found.items()])
    print(f"compute stream waiting for transfers: {waited_ms:.3g} ms of {wall_ms:.3g} ms "
          f"({waited_ms / wall_ms:.1%})" + (" (EMULATOR: CPU times)" if gpu.using_emulator() else ""))


def _time_waits(pool) -> list:
    """Times every wait of the pool's stream for transfers: an event pair recorded around
    each `_await` (the stall: the copy's end past the stream's own work); the pairs are
    read at the end, so nothing synchronises meanwhile."""
    pairs, real = [], pool._await

    def timed(pages, ready=None):
        a, b = gpu.Event.create(pool.ctx), gpu.Event.create(pool.ctx)
        a.record(stream=pool.stream)
        real(pages, ready)
        b.record(stream=pool.stream)
        pairs.append((a, b))
    pool._await = timed
    return pairs


def _attention(opts) -> None:
    import bench_gpu_attention
    bench_gpu_attention.bench_attention()


def _step(opts) -> None:
    import bench_gpu_attention
    bench_gpu_attention.bench_step()


SECTIONS = {"append": bench_append, "paged": bench_paged, "tiers": bench_tiers,
            "attention": _attention, "step": _step}
SMOKE = ("append", "paged", "tiers")     # the sections with a --smoke size (no torch needed)


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="Sections: " + __doc__.split("add one per kernel\nfamily.")[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sections", nargs="*", metavar="SECTION",
                    help=f"some of {', '.join(SECTIONS)} (default: all; with --smoke: {', '.join(SMOKE)})")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes: a check that it runs (no torch)")
    ap.add_argument("--emulate", action="store_true", help="on the CPU emulator (CPU times, not device figures)")
    ap.add_argument("--batches", type=_ints, help="paged: batch sizes, e.g. 1,32,128")
    ap.add_argument("--contexts", type=_ints, help="paged: positions per sequence, e.g. 4096,16384")
    ap.add_argument("--formats", type=lambda t: tuple(x for x in t.split(",") if x), default=PAGED_FORMATS,
                    help="append, paged: formats (default: all seven)")
    ap.add_argument("--repeat", type=int, help="paged: timed replays per measurement (default 20)")
    opts = ap.parse_args(argv)
    names = opts.sections or (list(SMOKE) if opts.smoke else list(SECTIONS))
    unknown = [n for n in names if n not in SECTIONS] + [f for f in opts.formats if f not in PAGED_FORMATS]
    if unknown:
        print(f"unknown sections or formats {unknown}: expected some of {list(SECTIONS)}, "
              f"{list(PAGED_FORMATS)}", file=sys.stderr)
        return 2
    if opts.smoke and set(names) - set(SMOKE):
        print(f"--smoke runs only {list(SMOKE)}", file=sys.stderr)
        return 2
    if opts.emulate and not gpu.using_emulator():
        gpu.use_emulator()
    if not gpu.is_available():
        print("no usable CUDA device", file=sys.stderr)
        return 1
    t0 = time.perf_counter()
    for n in names:
        SECTIONS[n](opts)
    where = "EMULATOR: CPU times" if gpu.using_emulator() else gpu.Context.get().name
    print(f"bench_gpu: {', '.join(names)} in {time.perf_counter() - t0:.0f} s ({where})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
