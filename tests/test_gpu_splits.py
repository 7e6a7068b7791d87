"""The split counts a device picks (issue 27, item 3). The decode kernels size their grid
from the resident blocks (kvcore.gpu.attention.split_kernel: the driver's occupancy query
times the SMs) and choose_splits; the emulated device answers the occupancy query from
cuda/resources.json (ptxas -v for sm_90). These tests compute, independently of kvcore and
of the emulator, the blocks an H100 keeps resident per SM from the same figures and the
H100's limits (132 SMs, 64K registers, 228 KB shared memory, 2048 threads and 32 blocks per
SM; registers by warp in units of 256, shared memory by block in units of 128 bytes plus
1 KB the driver reserves), the split counts that follow, and check that kvcore picks them
for every format at batch 1/8/64 and 1k/16k positions, and that the emulated runs launch
those grids (traced cuLaunchKernel). Nothing here runs on a real GPU: under the emulator,
every figure comes from ptxas' report, not from a device."""
import json
import math
import os

import numpy as np
import pytest

from kvcore import KVSpec
from kvcore.gpu.cache import GPU_FORMATS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
with open(os.path.join(ROOT, "cuda", "resources.json")) as f:
    RESOURCES = json.load(f)["modules"]

H100 = {"sms": 132, "regs": 65536, "smem": 228 * 1024, "threads": 2048, "blocks": 32}
THREADS = 128                      # the split kernel's block (cuda/attention.cuh)

# (Hq, Hkv, head_dim): MHA, GQA-4 (Llama-3-8B), GQA-8 (Llama-3-70B), GQA-8 at a run-time
# head_dim (the _dx instances)
SHAPES = [(32, 32, 128), (32, 8, 128), (64, 8, 128), (32, 4, 96)]
BATCHES = (1, 8, 64)
POSITIONS = (1024, 16384)


def resident_per_sm(regs: int, smem: int, threads: int = THREADS) -> int:
    """Blocks of `threads` an H100 keeps on one SM with these registers per thread and
    static shared bytes per block."""
    warps = -(-threads // 32)
    by_threads = H100["threads"] // (32 * warps)
    per_warp = -(-regs * 32 // 256) * 256
    by_regs = H100["regs"] // per_warp // warps if regs else H100["blocks"]
    per_block = -(-(smem + 1024) // 128) * 128
    by_smem = H100["smem"] // per_block
    return min(H100["blocks"], by_threads, by_regs, by_smem)


def expected_splits(blocks: int, resident: int, positions: int) -> int:
    """The fewest splits (at most 256, at most one per 128 positions) whose waves keep 90%
    of the resident blocks busy, else the busiest (docs/gpu.md, choose_splits)."""
    cap = max(1, min(256, math.ceil(positions / 128)))
    busy = [blocks * s / (math.ceil(blocks * s / resident) * resident) for s in range(1, cap + 1)]
    for s, b in enumerate(busy, 1):
        if b >= 0.9:
            return s
    return busy.index(max(busy)) + 1


def kernel(fmt, head_dim, group, paged):
    gb = next(b for b in (8, 4, 2, 1) if group % b == 0)
    d = head_dim if head_dim in (64, 128, 256) else "x"
    return f"kv_{'pattn' if paged else 'attn'}_{fmt}_d{d}_g{gb}", gb


def case(fmt, shape, batch, positions, paged):
    """(kernel name, heads per block, resident blocks on an H100, splits)."""
    hq, hkv, d = shape
    name, gb = kernel(fmt, d, hq // hkv, paged)
    regs, smem = RESOURCES[f"attention_{fmt}"][name]
    resident = resident_per_sm(regs, smem) * H100["sms"]
    blocks = batch * hkv * (hq // hkv // gb)
    return name, gb, resident, expected_splits(blocks, resident, positions)


@pytest.fixture(scope="module")
def gpu():
    from kvcore import gpu
    return gpu


def test_the_occupancy_rule_on_known_points():
    """The independent rule, on figures worked by hand (and the issue's: 185-231
    registers at 33-45 KB give 2 blocks of 128 threads per SM)."""
    assert resident_per_sm(32, 0) == 16                  # threads: 2048 / 128
    assert resident_per_sm(128, 0) == 4                  # 128 x 128 x 4 = 64K registers
    assert resident_per_sm(168, 0) == 3 and resident_per_sm(169, 0) == 2
    assert resident_per_sm(231, 45 * 1024) == resident_per_sm(185, 33 * 1024) == 2
    assert resident_per_sm(64, 56 * 1024) == 4           # 4 x (56 + 1) KB = 228 KB exactly
    assert resident_per_sm(64, 56 * 1024 + 1) == 3       # a byte more: 128 more per block
    assert expected_splits(8, 264, 16384) == 30 and expected_splits(512, 264, 16384) == 1
    assert expected_splits(8, 264, 1024) == 8            # capped at 1024 / 128 (64 / 264 busy)
    assert expected_splits(100, 264, 16384) == 5         # 500 / 528 = 0.947; 4: 400 / 528 < 0.9


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", GPU_FORMATS)
def test_split_counts_are_an_h100s(gpu, fmt):
    """For every shape, batch 1/8/64 and 1k/16k positions: the resident blocks kvcore reads
    (the emulated occupancy query from resources.json) and the splits a GpuKVCache plan
    and a GpuKVPool choose are those computed here from ptxas' figures and the H100's
    limits; the pool's are those of a constructed pool."""
    from kvcore.gpu import attention
    ctx = gpu.Context.get(0)
    assert ctx.sm_count == H100["sms"]
    seen = set()
    for shape in SHAPES:
        hq, hkv, d = shape
        for paged in (False, True):
            fn, gb, resident = attention.split_kernel(fmt, d, hq // hkv, ctx, paged=paged)
            for batch in BATCHES:
                for positions in POSITIONS:
                    name, gb2, resident2, splits = case(fmt, shape, batch, positions, paged)
                    assert (gb, resident) == (gb2, resident2), name
                    blocks = batch * hkv * (hq // hkv // gb)
                    assert attention.choose_splits(blocks, resident, positions) == splits, (
                        name, batch, positions)
                    seen.add(splits)
                    if paged:
                        spec = KVSpec(num_layers=1, num_kv_heads=hkv, num_heads=hq, head_dim=d,
                                      capacity=positions, format=fmt)
                        gp = gpu.GpuKVPool(spec, 2, 16, max_batch=batch,
                                           max_pages_per_seq=positions // 16)
                        assert gp.num_splits == splits, (name, batch, positions)
                        gp.free()
    assert len(seen) > 3        # the matrix reaches several split counts, not just 1


def traced(monkeypatch):
    """The (function, grid, block) of every cuLaunchKernel kvcore issues from now on."""
    from kvcore.gpu import driver
    seen, real = [], driver.call

    def spy(name, *args):
        if name == "cuLaunchKernel":
            seen.append((args[0], tuple(int(x) for x in args[1:4]), tuple(int(x) for x in args[4:7])))
        return real(name, *args)

    monkeypatch.setattr(driver, "call", spy)
    return seen


@pytest.mark.gpu
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("fmt", GPU_FORMATS)
def test_emulated_runs_launch_those_grids(gpu, fmt, batch, rng, monkeypatch):
    """A GpuKVPool step (16k positions of pages) and, up to batch 8, a GpuKVCache plan (1k
    positions; batch 64 would take 0.5 GiB of host memory) at GQA-8, head_dim 128: the
    split kernel is launched with grid (splits, Hkv x G / heads per block, rows) of the
    computed splits, then the merge over every (row, query head) when there are several.
    Rows hold a position at most, so the emulated blocks are short."""
    hq, hkv, d = 64, 8, 128
    shape = (hq, hkv, d)
    launches = traced(monkeypatch)
    # the pool
    name, gb, _, splits = case(fmt, shape, batch, 16384, True)
    spec = KVSpec(num_layers=1, num_kv_heads=hkv, num_heads=hq, head_dim=d, capacity=16384, format=fmt)
    gp = gpu.GpuKVPool(spec, 4, 16, max_batch=batch, max_pages_per_seq=1024)
    a = gp.new_sequence()
    gp.begin_step([a])
    k, v = (gpu.DeviceBuffer.from_numpy(rng.standard_normal((1, hkv, d)).astype(np.float32))
            for _ in range(2))
    gp.append(0, k.view((1, hkv, d), np.float32), v.view((1, hkv, d), np.float32))
    q = gpu.DeviceBuffer.from_numpy(rng.standard_normal((batch, hq, d)).astype(np.float32))
    out = gpu.DeviceBuffer.alloc(batch * hq * d * 4)
    del launches[:]
    gp.decode_attention(q.view((batch, hq, d), np.float32), out.view((batch, hq, d), np.float32), 0)
    gp.advance()
    want = [((splits, hkv * (hq // hkv) // gb, batch), (128, 1, 1))]
    if splits > 1:
        want.append(((batch * hq, 1, 1), (d, 1, 1)))
    assert [(g, b) for _, g, b in launches] == want, name
    assert launches[0][0] is gp._fn_decode.handle
    gp.free()
    if batch > 8:
        for buf in (q, out, k, v):
            buf.free()
        return
    # the cache
    name, gb, _, splits = case(fmt, shape, batch, 1024, False)
    cache = gpu.GpuKVCache(spec.replace(capacity=1024), batch)
    plan = gpu.AttentionPlan(cache, q_dtype="float32", max_length=1024)
    assert plan.num_splits == splits
    del launches[:]
    plan.run(q.view((batch, hq, d), np.float32), out.view((batch, hq, d), np.float32), 0)
    cache.check()
    want = [((splits, hkv * (hq // hkv) // gb, batch), (128, 1, 1))]
    if splits > 1:
        want.append(((batch * hq, 1, 1), (d, 1, 1)))
    assert [(g, b) for _, g, b in launches] == want, name
    assert launches[0][0] is plan._fn.handle
    plan.free()
    cache.free()
    for buf in (q, out, k, v):
        buf.free()


def test_the_docs_occupancy_table_is_the_tools():
    """docs/gpu.md's occupancy table is what tools/occupancy.py prints from the shipped
    cuda/resources.json (regenerate it after a PTX build)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("occupancy", os.path.join(ROOT, "tools", "occupancy.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    table = tool.markdown(tool.rows(RESOURCES, {}))
    with open(os.path.join(ROOT, "docs", "gpu.md")) as f:
        assert table in f.read(), "run python3 tools/occupancy.py and paste it into docs/gpu.md"
    # the tool's occupancy is the rule tested above
    for module, kernels in RESOURCES.items():
        for name, (regs, smem) in kernels.items():
            if name.startswith(("kv_attn_", "kv_pattn_")) and name != "kv_attn_merge":
                assert tool.resident(regs, smem, 128)[0] == resident_per_sm(regs, smem), name
