#!/usr/bin/env python3
"""GPU benchmarks, timed with CUDA events (median of repeats after warm-up), printed as
markdown tables with the peer measured in the same run.

    python3 tools/bench_gpu.py                  # every section
    python3 tools/bench_gpu.py append           # only some sections

Sections live in SECTIONS (name -> function printing its table); add one per kernel family.
  append: one decode step (32 layers x M = 64 slots, Hkv = 8, D = 128, float16 input) of
          GpuKVCache.append + advance per format, replayed as a CUDA graph, against a graph
          of cuMemcpyDtoDAsync of the same input bytes (one copy per layer), same stream;
          also the step launched eagerly from Python.
"""
from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _benchlib import print_table  # noqa: E402

from kvcore import KVSpec  # noqa: E402
from kvcore import gpu  # noqa: E402
from kvcore.gpu import driver  # noqa: E402


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


def bench_append() -> None:
    L, M, H, D, steps = 32, 64, 8, 128, 8
    rng = np.random.default_rng(0)
    rows = []
    for fmt in ("f16", "bf16", "f32", "int8", "fp8_e4m3", "fp8_e5m2", "q8_0"):
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
        f = spec.fmt
        out_bytes = 2 * L * M * H * f.row_bytes(D)
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


SECTIONS = {"append": bench_append}


def main(argv: list[str]) -> int:
    names = argv or list(SECTIONS)
    unknown = [n for n in names if n not in SECTIONS]
    if unknown:
        print(f"unknown sections {unknown}: expected some of {list(SECTIONS)}", file=sys.stderr)
        return 2
    if not gpu.is_available():
        print("no usable CUDA device", file=sys.stderr)
        return 1
    for n in names:
        SECTIONS[n]()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
