"""Copies within the driver's limits (issue 27, item 6): the driver refuses a cuMemcpy3D
whose pitch passes CU_DEVICE_ATTRIBUTE_MAX_PITCH (2^31 - 1 bytes). GpuKVCache copies
(snapshot, restore/scatter from the host, scatter from another cache) and GpuKVPool page
copies (fork, snapshot, restore, offload, bring_back) cut their copies so that no pitch
passes it, however large a head's or a page's region.

Two kinds of test, since a cache whose head region passes 2 GiB would take more than 4 GiB
of host memory under the emulator (its device memory is host memory, poisoned at
allocation):
  - the copy plans (kvcore.gpu.cache.plan_copy3d, kvcore.gpu.pool.page_pieces) of caches
    and pools of many GiB, pure arithmetic: every pitch within 2^31 - 1, and the bytes
    moved exactly those of the naive copy;
  - real copies under the emulator with its largest pitch lowered (the emulated device
    answers CU_DEVICE_ATTRIBUTE_MAX_PITCH and refuses larger pitches at the lowered
    value), so the cut copies run on small caches and pools, bit-identical to the CPU."""
import numpy as np
import pytest

from kvcore import KVCache, KVPool, KVSpec
from kvcore.gpu.cache import MAX_PITCH, CopySide, GpuLayout, plan_copy3d
from kvcore.gpu.pool import page_pieces

from test_gpu_pool import spy_copies


@pytest.fixture(scope="module")
def gpu():
    from kvcore import gpu
    return gpu


# ------------------------------------------------------------------ plans (no device)

def moved(plan):
    """The (src, dst, bytes) segments a plan copies, adjacent pieces merged."""
    segs = []
    for c in plan:
        (_, sa, sp, sh), (_, da, dp, dh) = c.src, c.dst
        for z in range(c.depth):
            for y in range(c.height):
                segs.append((sa + z * sp * sh + y * sp, da + z * dp * dh + y * dp, c.width))
    return merged(segs)


def merged(segs):
    """(src, dst, bytes) segments sorted, adjacent ones (on both sides) joined."""
    out = []
    for s, d, w in sorted(segs):
        if out and out[-1][0] + out[-1][2] == s and out[-1][1] + out[-1][2] == d:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + w)
        else:
            out.append((s, d, w))
    return out


def naive(row, heads, n, depth, a, b):
    """What the copy must move: per layer and head, rows [0, n) from a to b."""
    segs = []
    for layer in range(depth):
        for h in range(heads):
            at = [x.address + ((layer * x.layer_heads) + h) * x.head_rows * row for x in (a, b)]
            segs.append((at[0], at[1], n * row))
    return merged(segs)


def check_plan(row, heads, n, depth, a, b, limit=MAX_PITCH):
    plan = plan_copy3d(row, heads, n, depth, a, b, limit)
    for c in plan:
        assert c.src[2] <= limit and c.dst[2] <= limit, c
        assert c.width <= min(c.src[2], c.dst[2])
        assert c.height <= min(c.src[3], c.dst[3]) or c.depth == 1, c
    assert moved(plan) == naive(row, heads, n, depth, a, b)
    return plan


BIG = KVSpec(num_layers=3, num_kv_heads=4, head_dim=256, capacity=3 << 20, format="f32")


@pytest.mark.parametrize("n", [1, 7, 96, 1 << 20, (1 << 20) + 7, 3 << 20])
def test_cache_copies_past_2gib_keep_every_pitch_within_the_drivers_limit(n):
    """A GpuKVCache whose head region is 3 GiB (f32, head_dim 256, capacity 3 * 2^20; a
    layer region of 24 GiB per slot): the snapshot, host restore and cache-to-cache copies
    of n positions of slot 1 have no pitch past 2^31 - 1 and move exactly the naive bytes
    (per layer and head, n rows). Plans only: nothing is allocated."""
    if n == (1 << 20) + 7:    # gcd(n, capacity) = 1: rows of one position (width 1 KiB)
        n = 7 * 1021          # (the same shape, with fewer segments to enumerate)
    lay = GpuLayout(BIG, 2)
    row, H, L = 1024, BIG.num_kv_heads, BIG.num_layers
    assert lay.strides("k_codes")[2] == BIG.capacity * row > MAX_PITCH
    dev = CopySide(True, (1 << 40) + lay.slot_offset("k_codes", 0, 1), BIG.capacity, 2 * H)
    host = CopySide(False, 1 << 20, n, H)
    plans = [check_plan(row, H, n, L, dev, host), check_plan(row, H, n, L, host, dev)]
    one = GpuLayout(BIG.replace(capacity=(3 << 20) - 1024), 1)   # scatter from a one-slot cache
    src = CopySide(True, 1 << 44, one.spec.capacity, H)
    if n <= one.spec.capacity:
        plans.append(check_plan(row, H, n, L, src, dev))
    for plan in plans:
        assert len(plan) == L                                   # one copy per layer


def test_cache_copies_within_the_limit_stay_one_copy():
    """A head region within the limit: one cuMemcpy3D over every layer, pitch = the head."""
    s = KVSpec(num_layers=5, num_kv_heads=2, head_dim=128, capacity=1 << 20, format="int8")
    row = 128
    dev = CopySide(True, 4096, s.capacity, 3 * 2)
    host = CopySide(False, 0, 1000, 2)
    plan = check_plan(row, 2, 1000, 5, dev, host)
    assert len(plan) == 1 and plan[0].src[2] == s.capacity * row and plan[0].depth == 5


@pytest.mark.parametrize("limit", [128, 1000, 4096, 4097])
def test_cache_copy_plans_under_smaller_limits(limit):
    """The cut takes the largest piece of d positions (d dividing n and both heads' rows)
    with d * row within the limit; a row is never cut."""
    row = 128
    a = CopySide(True, 1 << 30, 48, 6)
    for n in (1, 6, 24, 30, 40):
        for b in (CopySide(False, 0, n, 2), CopySide(True, 1 << 32, 40, 2)):
            plan = check_plan(row, 2, n, 3, a, b, limit)
            if 48 * row > limit:
                d = plan[0].width // row
                assert len(plan) == 3 and d * row <= limit
                assert all(n % d == 0 and x % d == 0 for x in (48, b.head_rows))


@pytest.mark.parametrize("page_size,row,limit,pieces", [
    (16, 4096, MAX_PITCH, 1),               # a page within the limit: one row per page
    (1 << 16, 1 << 16, MAX_PITCH, 4),       # a 4 GiB page: 4 rows of 1 GiB
    (3 * (1 << 16), 1 << 15, MAX_PITCH, 4),  # 6 GiB: 4 rows of 3 * 2^14 positions (1.5 GiB)
    (16, 256, 1024, 4), (16, 256, 1000, 8), (12, 256, 1024, 3), (7, 256, 1024, 7)])
def test_page_copies_cut_a_page_past_the_limit_into_rows(page_size, row, limit, pieces):
    """GpuKVPool page copies: a page of page_size positions of `row` bytes (all kv heads of
    a position) is k rows of page_size / k positions, the fewest whose pitch fits."""
    k = page_pieces(page_size, row, limit)
    assert k == pieces and page_size % k == 0 and page_size // k * row <= limit


# ------------------------------------------------------------------ real copies, lowered limit

LOW = 4096


@pytest.fixture
def low_pitch(gpu, monkeypatch):
    """The emulated device's largest pitch lowered to LOW bytes (what it answers for
    CU_DEVICE_ATTRIBUTE_MAX_PITCH and what cuMemcpy3D refuses past), and a list of the
    (srcPitch, dstPitch, WidthInBytes, Height, Depth) of every cuMemcpy3DAsync kvcore issues."""
    if not gpu.using_emulator():
        pytest.skip("lowers the emulated device's largest pitch: emulator only")
    from kvcore.gpu._emu import driver as emu
    monkeypatch.setattr(emu, "MAX_PITCH", LOW)
    monkeypatch.setitem(emu._ATTRIBUTES, "MAX_PITCH", LOW)
    return spy_copies(monkeypatch)


def cpu_cache(spec, rng, n):
    cpu = KVCache(spec)
    shape = (1, spec.num_kv_heads, spec.head_dim)
    for _ in range(n):
        for layer in range(spec.num_layers):
            cpu.append(layer, rng.standard_normal(shape).astype(np.float32),
                       rng.standard_normal(shape).astype(np.float32))
        cpu.advance()
    return cpu


def same(a, b):
    assert a.length == b.length
    for name in ("k_codes", "v_codes", "k_scales", "v_scales"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None)
        if x is not None:
            assert x.shape == y.shape and x.view(np.uint8).tobytes() == y.view(np.uint8).tobytes()


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["f16", "q8_0"])
def test_cache_copies_run_cut_under_a_lowered_limit(gpu, low_pitch, rng, fmt):
    """Head regions of 48 rows of 128 code bytes (6 KiB) past a largest pitch of 4 KiB:
    restore (host -> device), snapshot (device -> host) and scatter from a one-slot cache
    (device -> device) cut their copies (one per layer, pitch d rows), the emulated driver
    checks each pitch, and every byte lands where the CPU cache has it."""
    spec = KVSpec(num_layers=2, num_kv_heads=2, head_dim=64 if fmt == "f16" else 128,
                  capacity=48, format=fmt)
    row = spec.fmt.code_row_bytes(spec.head_dim)
    assert row == 128
    snap = cpu_cache(spec, rng, 30).snapshot()
    cache = gpu.GpuKVCache(spec, 3)
    assert cache._max_pitch == LOW
    cache.restore(snap, 1)
    same(cache.snapshot(1), snap)
    one = gpu.GpuKVCache(spec.replace(capacity=42), 1)
    one.restore(snap, 0)
    cache.scatter(one, 2)
    same(cache.snapshot(2), snap)
    assert all(sp <= LOW and dp <= LOW for sp, dp, *_ in low_pitch)
    cut = [c for c in low_pitch if c[2] == 6 * row]   # d = gcd(30, 48) = 6 positions
    assert len(cut) == 5 * 2 * 2    # (2 restores, scatter, 2 snapshots) x K/V codes x layers
    # the uncut copy is what the emulated driver refuses at this limit
    cache._max_pitch = 2**31 - 1
    with pytest.raises(gpu.CudaError, match="largest pitch"):
        cache.snapshot(1)
    one.free()
    cache.free()


@pytest.mark.gpu
def test_pool_page_copies_run_cut_under_a_lowered_limit(gpu, low_pitch, rng, monkeypatch):
    """Pages of 32 positions of 256 bytes (8 KiB) past a largest pitch of 4 KiB: restore,
    fork (copy-on-write of the partial page), snapshot, offload and bring_back copy each
    page as 2 rows of 16 positions, bit-identical to the CPU pool."""
    spec = KVSpec(num_layers=2, num_kv_heads=2, head_dim=64, capacity=128, format="f16")
    snap = cpu_cache(spec, rng, 40).snapshot()
    gp = gpu.GpuKVPool(spec, 8, 32, max_batch=2, max_pages_per_seq=4)
    assert gp._page_pieces["k_codes"] == 2
    a = gp.restore(snap)
    same(gp.snapshot(a), snap)
    b = gp.fork(a)
    same(gp.snapshot(b), snap)
    host = KVPool(spec, 8, 32)
    h = host.restore(gp.snapshot(a))
    same(host.snapshot(h), snap)
    h = gp.offload(b, host)
    same(host.snapshot(h), snap)
    c = gp.bring_back(host, h)
    same(gp.snapshot(c), snap)
    assert low_pitch and all(sp == dp == w == 16 * 256 and height == 2
                             for sp, dp, w, height, _ in low_pitch)
    gp.free()
