#!/usr/bin/env python3
"""Every format's kernels end to end against the CPU implementation on the same data (the
`kernels` stage of tools/gpu_check.py, and the script compute-sanitizer runs):

- append (T rows per slot from float16, then one step of every slot from float32) and the
  paged pool's append (shuffled pages, ragged prefill, a decode step): codes and scales
  equal the CPU encoder's bit for bit (snapshots);
- decode attention, 1 split and 4 (the merge), and the pool's paged decode: within 1e-3 of
  kvcore.decode_attention, relative to the output's largest value (the device contracts
  FMAs, the CPU does not);
- RoPE at each slot's device length against kvcore.apply_rope;
- one DecodeGraph replay (RoPE + append + attention per layer, advance): its output
  against the CPU decode of the cache's snapshot with the rotated q;
- on a device with the memory, a pool whose layer region passes 2 GiB: its page copies
  (snapshot, a fork's partial page) equal the CPU's.

    python3 tools/gpu_kernels_check.py [--formats int8,q8_0] [--small] [--emulate]

One line per case, then "gpu_kernels_check: N passed, M failed"; exit status 1 when any
failed. A sticky device error (the context is lost) stops the run.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import kvcore  # noqa: E402
from kvcore import gpu  # noqa: E402

FORMATS = ("f32", "f16", "bf16", "int8", "fp8_e4m3", "fp8_e5m2", "q8_0", "q4_0", "q4_1")
TOL = 1e-3


def _close(got: np.ndarray, want: np.ndarray, what: str) -> float:
    err = float(np.abs(got.astype(np.float64) - want).max()) / max(float(np.abs(want).max()), 1e-6)
    if not err <= TOL:
        raise AssertionError(f"{what}: relative error {err:.2e} > {TOL}")
    return err


def _same(device: kvcore.Snapshot, cpu: kvcore.Snapshot, what: str) -> None:
    for part in ("k_codes", "v_codes", "k_scales", "v_scales"):
        a, b = getattr(device, part), getattr(cpu, part)
        if (a is None) != (b is None) or (a is not None and (
                a.shape != b.shape or a.tobytes() != b.tobytes())):
            raise AssertionError(f"{what}: {part} differs from the CPU encoder's")


class _Device:
    """Device copies of host arrays, freed together."""

    def __init__(self):
        self.bufs = []

    def __call__(self, x: np.ndarray):
        self.bufs.append(gpu.DeviceBuffer.from_numpy(x))
        return self.bufs[-1].view(x.shape, x.dtype)

    def free(self):
        for b in self.bufs:
            b.free()


def cache_case(fmt: str, D: int, group: int, rng, small: bool) -> str:
    L, Hkv, M = 2, 2, 3
    cap = 160 if small else 300                     # > 128 positions: 4 splits all hold work
    counts = (cap - 20, 37, 1)
    spec = kvcore.KVSpec(num_layers=L, num_kv_heads=Hkv, head_dim=D, capacity=cap,
                         num_heads=Hkv * group, format=fmt)
    cache, cpus, dev = gpu.GpuKVCache(spec, M), [kvcore.KVCache(spec) for _ in range(M)], _Device()
    try:
        for s, T in enumerate(counts):
            for layer in range(L):
                k, v = (rng.standard_normal((2, T, Hkv, D)) * 2).astype(np.float16)
                cache.append(layer, dev(k), dev(v), slot=s)
                cpus[s].append(layer, k, v)
            cache.advance(slot=s, steps=T)
            cpus[s].advance()
        for layer in range(L):
            k, v = rng.standard_normal((2, M, Hkv, D)).astype(np.float32)
            cache.append(layer, dev(k), dev(v))
            for s in range(M):
                cpus[s].append(layer, k[s], v[s])
        cache.advance()
        for c in cpus:
            c.advance()
        cache.check()
        for s in range(M):
            _same(cache.snapshot(s), cpus[s].snapshot(), f"slot {s}")
        q = rng.standard_normal((M, spec.num_heads, D)).astype(np.float16)
        out = dev(np.zeros(q.shape, np.float32))
        worst = 0.0
        for splits in (1, 4):
            plan = gpu.AttentionPlan(cache, q_dtype="float16", num_splits=splits)
            for layer in range(L):
                plan.run(dev(q), out, layer)
                cache.synchronize()
                got = out.to_numpy()
                for s in range(M):
                    want = kvcore.decode_attention(q[s].astype(np.float32), cpus[s], layer)
                    worst = max(worst, _close(got[s], want, f"decode, {splits} split(s), layer {layer}, slot {s}"))
            plan.free()
        x = rng.standard_normal((M, spec.num_heads, D)).astype(np.float32)
        xd = dev(x)
        gpu.apply_rope(xd, cache)
        cache.synchronize()
        for s, n in enumerate(cache.lengths_host()):
            _close(xd.to_numpy()[s], kvcore.apply_rope(x[s].copy(), int(n)), f"RoPE slot {s}")
        g = gpu.DecodeGraph(cache, dtype="float16")
        try:
            for layer in range(L):
                for buf, h in ((g.q(layer), spec.num_heads), (g.k(layer), Hkv), (g.v(layer), Hkv)):
                    buf.copy_from_numpy(rng.standard_normal((M, h, D)).astype(np.float16))
            g.replay()
            g.synchronize()
            cache.check()
            for s in range(M):
                cpu = kvcore.KVCache(spec)
                cpu.restore(cache.snapshot(s))
                for layer in range(L):
                    q_rot = g.q(layer).to_numpy()[s].astype(np.float32)
                    _close(g.out(layer).to_numpy()[s], kvcore.decode_attention(q_rot, cpu, layer),
                           f"graph replay, layer {layer}, slot {s}")
        finally:
            g.destroy()
        return f"max rel err {worst:.1e}"
    finally:
        dev.free()
        cache.free()


def pool_case(fmt: str, D: int, group: int, rng, small: bool) -> str:
    L, Hkv, PS = 2, 2, 16
    counts = [40, 1, 70] if small else [70, 1, 150]
    B, per_seq = len(counts), -(-(max(counts) + 1) // PS)
    spec = kvcore.KVSpec(num_layers=L, num_kv_heads=Hkv, head_dim=D, capacity=per_seq * PS,
                         num_heads=Hkv * group, format=fmt)
    pool = gpu.GpuKVPool(spec, B * per_seq + 4, PS, max_batch=B, max_pages_per_seq=per_seq,
                         max_tokens=max(counts))
    dev = _Device()
    try:
        pool._table.free[:] = rng.permutation(pool.num_pages).tolist()   # pages out of order
        seqs, cpus = [pool.new_sequence() for _ in range(B)], [kvcore.KVCache(spec) for _ in range(B)]
        q = rng.standard_normal((B, spec.num_heads, D)).astype(np.float32)
        out = dev(np.zeros(q.shape, np.float32))
        got = []
        for step in (counts, [1] * B):
            pool.begin_step(seqs, step)
            ends = np.cumsum([0] + step)
            for layer in range(L):
                k, v = (rng.standard_normal((2, int(ends[-1]), Hkv, D)) * 2).astype(np.float16)
                pool.append(layer, dev(k), dev(v))
                for b in range(B):
                    cpus[b].append(layer, k[ends[b]:ends[b + 1]], v[ends[b]:ends[b + 1]])
            if step is not counts:                          # the decode step: attend, then commit
                for layer in range(L):
                    pool.decode_attention(dev(q), out, layer)
                    pool.check()
                    got.append(out.to_numpy())
            pool.advance()
            for c in cpus:
                c.advance()
        worst = 0.0
        for b, s in enumerate(seqs):
            _same(pool.snapshot(s), cpus[b].snapshot(), f"pool sequence {s}")
            for layer in range(L):
                want = kvcore.decode_attention(q[b], cpus[b], layer)
                worst = max(worst, _close(got[layer][b], want, f"paged decode, layer {layer}, sequence {b}"))
        return f"max rel err {worst:.1e}, {pool.num_splits} split(s)"
    finally:
        dev.free()
        pool.free()


def big_pitch_case(fmt: str, D: int, group: int, rng, small: bool) -> str:
    """Page copies (snapshot, a fork's partial page) of a pool whose layer region passes
    2 GiB: the cuMemcpy3DAsync pitch of pool.py _copy_page goes past 2^31 - 1 bytes."""
    L, Hkv, PS, T = 2, 8, 16, 20
    spec = kvcore.KVSpec(num_layers=L, num_kv_heads=Hkv, head_dim=D, capacity=4 * PS,
                         num_heads=Hkv * group, format=fmt)
    page_bytes = PS * Hkv * spec.fmt.row_bytes(D)
    pages = 2**31 // page_bytes + 64
    if gpu.using_emulator() or gpu.Context.get().mem_get_info()[0] < 1.3 * 2 * L * pages * page_bytes:
        return "SKIPPED: needs a device with 2 x 2 GiB per layer free"
    pool, dev = gpu.GpuKVPool(spec, pages, PS, max_batch=1, max_pages_per_seq=4, max_tokens=T), _Device()
    try:
        s, cpu = pool.new_sequence(), kvcore.KVCache(spec)
        pool.begin_step([s], [T])
        for layer in range(L):
            k, v = rng.standard_normal((2, T, Hkv, D)).astype(np.float32)
            pool.append(layer, dev(k), dev(v))
            cpu.append(layer, k, v)
        pool.advance()
        cpu.advance()
        _same(pool.snapshot(s), cpu.snapshot(), "snapshot, pitch > 2 GiB")
        _same(pool.snapshot(pool.fork(s)), cpu.snapshot(), "fork, pitch > 2 GiB")
        return f"layer region {pages * page_bytes / 2**30:.2f} GiB"
    finally:
        dev.free()
        pool.free()


def cases(formats, small: bool):
    for fmt in formats:
        dims = [(128, 8)] if small else [(128, 8), (128, 1), (64, 4)]
        if kvcore.get_format(fmt).block:   # q8_0, q4_0, q4_1
            dims.append((96, 4))             # D % 64 == 32: 2-byte scale loads, the _dx kernel
        elif not small and fmt in ("f16", "int8"):
            dims.append((80, 2))             # a run-time head_dim (_dx kernel)
        for D, G in dims:
            yield f"cache {fmt} D={D} G={G}", cache_case, fmt, D, G
        yield f"pool {fmt} D={dims[0][0]} G=4", pool_case, fmt, dims[0][0], 4
    if not small:
        yield "pool f32 pitch > 2 GiB", big_pitch_case, "f32", 128, 1


def main(argv) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--formats", default=",".join(FORMATS), help="comma-separated formats")
    ap.add_argument("--small", action="store_true", help="fewer positions and shapes (sanitizers)")
    ap.add_argument("--emulate", action="store_true", help="on the CPU emulator (a dry run)")
    args = ap.parse_args(argv)
    if args.emulate:
        gpu.use_emulator()
    if not gpu.is_available():
        print("gpu_kernels_check: no usable CUDA device", file=sys.stderr)
        return 2
    ctx = gpu.Context.get()
    where = "EMULATOR" if gpu.using_emulator() else gpu.driver.driver_version_text()
    print(f"gpu_kernels_check on {ctx.name} ({where})", flush=True)
    rng = np.random.default_rng(0)
    passed = failed = 0
    for name, fn, fmt, D, G in cases([f for f in args.formats.split(",") if f], args.small):
        t0 = time.perf_counter()
        try:
            what = fn(fmt, D, G, rng, args.small)
            passed += not what.startswith("SKIPPED")
            print(f"{'SKIP' if what.startswith('SKIPPED') else 'PASS'} {name:24s} {time.perf_counter() - t0:6.1f} s  {what}", flush=True)
        except Exception as e:
            failed += 1
            print(f"FAIL {name:24s} {time.perf_counter() - t0:6.1f} s  {type(e).__name__}: {e}", flush=True)
            traceback.print_exc(limit=4)
            if isinstance(e, kvcore.CudaError) and any(w in str(e) for w in ("ILLEGAL", "MISALIGNED", "LAUNCH_FAILED")):
                print("gpu_kernels_check: a sticky device error: the context is lost, stopping", flush=True)
                break
    print(f"gpu_kernels_check: {passed} passed, {failed} failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
