"""Nothing lost, nothing crashed (issue 17): the defects a hostile test of the CPU library
found, one section each. Fork and thread tests run real processes and threads, bounded in
time, so that a regression fails instead of hanging; scenarios that crashed the process
(segfault, SIGBUS) run in a child interpreter."""
import dataclasses
import os
import signal
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
from _blocking import BlockingLayer

import kvcore
from kvcore import (DTypeError, FormatError, KVCache, KVCacheError, KVSpec, NonFiniteError,
                    OutOfRangeError, RangeError, ShapeError, Snapshot, SnapshotError, StateError,
                    load_snapshot)
from kvcore.formats import FORMATS, ROW_FORMATS, Format
from kvcore._quant import input_limit

ALL = list(ROW_FORMATS)   # K and V in one format (q4_1ch is K only)
F32MAX = float(np.finfo(np.float32).max)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make(fmt="f32", *, layers=1, heads=2, head_dim=32, capacity=8, num_heads=None) -> KVCache:
    return KVCache(KVSpec(num_layers=layers, num_kv_heads=heads, head_dim=head_dim,
                          capacity=capacity, num_heads=num_heads, format=fmt))


def run_python(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Runs code in a fresh interpreter (this checkout's kvcore) in its own session; on
    timeout the whole session (forked grandchildren too) is killed and the test fails."""
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"child interpreter hung (killed after {timeout} s):\n{out}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out)


def run_thread(fn, *args):
    """Starts fn(*args) on a daemon thread; returns (thread, box) with box["error"] the
    exception it raised, if any."""
    box = {}

    def body():
        try:
            fn(*args)
        except BaseException as e:  # noqa: BLE001 (handed to the test)
            box["error"] = e
    t = threading.Thread(target=body, daemon=True)
    t.start()
    return t, box


def unchanged(cache, call, error, match=None):
    """call() raises error (matching match) and leaves the cache byte-identical."""
    before = cache._storage.tobytes(), cache.length, [cache.pending(i) for i in
                                                      range(cache.spec.num_layers)]
    with pytest.raises(error, match=match):
        call()
    assert (cache._storage.tobytes(), cache.length,
            [cache.pending(i) for i in range(cache.spec.num_layers)]) == before


# ------------------------------------------------------------------ 1. fork

def test_forked_child_runs_parallel_kernels():
    """A child forked after its parent ran OpenMP kernels runs every parallel kernel (on
    one thread), with os.fork and with a multiprocessing.Pool of the 'fork' method, and
    refuses to be given more threads (libgomp's pool does not survive fork)."""
    r = run_python("""
        import multiprocessing, os, sys
        import numpy as np
        import kvcore

        def work(seed):
            rng = np.random.default_rng(seed)
            x = rng.standard_normal((512, 8, 128), dtype=np.float32)   # 524288 values
            codes, scales = kvcore.quantize(x, "int8")
            back = kvcore.dequantize(codes, scales, "int8")
            spec = kvcore.KVSpec(num_layers=1, num_kv_heads=8, head_dim=128, capacity=512,
                                 num_heads=8, format="int8")
            cache = kvcore.KVCache(spec)
            cache.append(0, x, x)
            cache.advance()
            q = rng.standard_normal((8, 128), dtype=np.float32)
            out = kvcore.decode_attention(q, cache, 0)
            kvcore.apply_rope(x, np.arange(512))
            assert np.isfinite(out).all() and np.abs(back - cache.dequantize(0, "k")).max() == 0
            return kvcore.max_threads()

        kvcore.set_num_threads(2)
        threads = 2 if kvcore.openmp_enabled() else 1
        assert work(0) == threads            # the parent's OpenMP pool is started
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                assert work(1) == 1
                try:
                    kvcore.set_num_threads(2)
                    code = 4
                except kvcore.StateError as e:
                    assert "fork" in str(e), e
                kvcore.set_num_threads(1)
                kvcore.set_num_threads(0)
                assert work(2) == 1
            except BaseException as e:
                print("child failed:", repr(e), flush=True)
                code = 3
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, status
        with multiprocessing.get_context("fork").Pool(2) as pool:
            assert pool.map_async(work, range(4)).get(timeout=60) == [1, 1, 1, 1]
        assert work(5) == threads             # the parent keeps its threads
        print("ok")
    """)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout


# ------------------------------------------------------- 2. Format objects

def bad_formats():
    i8, q8 = FORMATS["int8"], FORMATS["q8_0"]
    return {"int8-no-scale-dtype": dataclasses.replace(i8, scale_dtype=None),
            "q8_0-block-64": dataclasses.replace(q8, block=64),
            "unknown-id": Format("f64", 9, np.dtype(np.float64), None, 0),
            "int8-with-id-of-f32": dataclasses.replace(i8, id=0),
            "f32-with-int8-codes": dataclasses.replace(FORMATS["f32"], code_dtype=np.dtype(np.int8))}


@pytest.mark.parametrize("name", list(bad_formats()))
def test_only_the_table_formats_reach_a_kernel(name):
    bad = bad_formats()[name]
    x = np.ones((4, 64), np.float32)
    with pytest.raises(FormatError, match="is not a format of kvcore.FORMATS"):
        kvcore.quantize(x, bad)
    with pytest.raises(FormatError, match="is not a format of kvcore.FORMATS"):
        kvcore.dequantize(np.zeros((4, 64), np.int8), np.ones((4, 2), np.float16), bad)
    with pytest.raises(FormatError, match="is not a format of kvcore.FORMATS"):
        KVSpec(num_layers=1, num_kv_heads=1, head_dim=64, capacity=1, format=bad)


def test_an_equal_format_object_is_the_table_one():
    twin = dataclasses.replace(FORMATS["q8_0"])
    assert twin is not FORMATS["q8_0"] and kvcore.get_format(twin) is FORMATS["q8_0"]
    x = np.random.default_rng(0).standard_normal((3, 64)).astype(np.float32)
    for a, b in zip(kvcore.quantize(x, twin), kvcore.quantize(x, "q8_0")):
        assert a.tobytes() == b.tobytes()


# ------------------------------------------------- 3, 4. loaded snapshots

def test_snapshot_file_truncated_after_load_restores_safely(tmp_path):
    """Truncating or replacing the file after load neither kills the process (SIGBUS
    before) nor changes what restore writes."""
    r = run_python(f"""
        import numpy as np, os, kvcore
        spec = kvcore.KVSpec(num_layers=2, num_kv_heads=2, head_dim=64, capacity=4096,
                             format="f32")
        cache = kvcore.KVCache(spec)
        x = np.random.default_rng(0).standard_normal((4096, 2, 64)).astype(np.float32)
        for layer in range(2):
            cache.append(layer, x, x)
        cache.advance()
        path = {str(tmp_path / "snap.safetensors")!r}
        cache.snapshot().save(path)
        snap = kvcore.load_snapshot(path)
        os.truncate(path, 4096)                        # shrink it under the loaded snapshot
        other = kvcore.KVCache(spec)
        other.restore(snap)
        assert other._storage.tobytes() == cache._storage.tobytes()
        print("ok")
    """)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), (r.returncode, r.stdout)


@pytest.mark.parametrize("verify", [True, "sha256", False])
def test_restore_writes_only_the_bytes_that_were_verified(tmp_path, verify):
    cache = make("f32", capacity=4)
    ones = np.ones((2, 2, 32), np.float32)
    cache.append(0, ones, ones)
    cache.advance()
    path = tmp_path / "snap.safetensors"
    cache.snapshot().save(path)
    snap = load_snapshot(path, verify=verify)
    raw = bytearray(path.read_bytes())
    data = raw.find(np.float32(1).tobytes())
    raw[data:data + 4] = np.float32(1234.5).tobytes()
    with open(path, "r+b") as f:  # in place: the same inode, the same size
        f.write(raw)
    other = make("f32", capacity=4)
    other.restore(snap)
    assert (other.dequantize(0, "k") == 1).all() and (other.dequantize(0, "v") == 1).all()
    for name in ("k_codes", "v_codes"):
        arr = getattr(snap, name)
        with pytest.raises(ValueError):
            arr.flags.writeable = True


# -------------------------------------------------------------- 5. threads

def test_a_cache_in_use_by_another_thread_refuses_every_call(tmp_path):
    cache = make("int8", capacity=8, num_heads=4)
    rng = np.random.default_rng(0)
    k, v = (rng.standard_normal((2, 2, 32)).astype(np.float32) for _ in range(2))
    cache.append(0, k, v)
    cache.advance()
    snap = cache.snapshot()
    inside, go = threading.Event(), threading.Event()
    t, box = run_thread(cache.append, BlockingLayer(0, inside, go), k, v)
    try:
        assert inside.wait(60)
        q = np.zeros((4, 32), np.float32)
        calls = {"append": lambda: cache.append(0, k, v), "advance": cache.advance,
                 "truncate": lambda: cache.truncate(1), "reset": cache.reset,
                 "restore": lambda: cache.restore(snap), "snapshot": cache.snapshot,
                 "dequantize": lambda: cache.dequantize(0, "k"),
                 "decode_attention": lambda: kvcore.decode_attention(q, cache, 0)}
        for op, call in calls.items():
            unchanged(cache, call, StateError, f"{op}.*in use by another thread")
    finally:
        go.set()
        t.join(60)
    assert not t.is_alive() and "error" not in box
    assert cache.pending(0) == 2
    cache.advance()
    assert cache.keys(0)[2:].tobytes() == cache.keys(0)[:2].tobytes()


def test_threads_appending_to_one_cache_lose_nothing():
    """Two threads append large steps (the kernel runs without the GIL) to one layer at
    once: each append either lands whole, K and V from the same call, or raises
    StateError; nothing is lost silently."""
    T, H, D, rounds = 64, 8, 128, 40
    cache = make("f32", heads=H, head_dim=D, capacity=2 * T * rounds)
    done = {0: [], 1: []}
    refused = []
    start = threading.Barrier(2)

    def appender(who):
        start.wait(60)
        for i in range(rounds):
            value = np.float32(1000 * who + i + 1)
            k = np.full((T, H, D), value, np.float32)
            try:
                cache.append(0, k, -k)
                done[who].append(value)
            except StateError as e:
                assert "append" in str(e) and "another thread" in str(e)
                refused.append(value)

    threads = [run_thread(appender, who) for who in (0, 1)]
    for t, box in threads:
        t.join(120)
        assert not t.is_alive() and "error" not in box, box
    n = cache.pending(0)
    assert n == T * (len(done[0]) + len(done[1]))
    cache.advance()
    keys, values = cache.keys(0).reshape(-1, T, H * D), cache.values(0).reshape(-1, T, H * D)
    landed = []
    for kb, vb in zip(keys, values):
        assert (kb == kb[0, 0]).all() and (vb == -kb).all()   # one call's K and V, whole
        landed.append(kb[0, 0])
    assert sorted(landed) == sorted(done[0] + done[1])
    assert [x for x in landed if x < 1000] == done[0]         # each thread's in its order


# ------------------------------------------------------- 6. set_num_threads

def test_set_num_threads_validates():
    before = kvcore.max_threads()
    cap = kvcore._parallel.MAX_THREADS
    try:
        for bad, error in [(2.5, DTypeError), (True, DTypeError), ("2", DTypeError),
                           (-1, RangeError), (cap + 1, RangeError), (100000, RangeError),
                           (2**70, RangeError)]:
            with pytest.raises(error) as e:
                kvcore.set_num_threads(bad)
            assert isinstance(e.value, KVCacheError)
            assert kvcore.max_threads() == before
        with pytest.raises(RangeError, match=rf"threads must be in \[0, {cap}\], got 100000"):
            kvcore.set_num_threads(100000)
        kvcore.set_num_threads(np.int64(1))
        assert kvcore.max_threads() == 1
        kvcore.set_num_threads(cap)
        assert kvcore.max_threads() == cap
    finally:
        kvcore.set_num_threads(0)


# ------------------------------------------------------------ 7. masked arrays

def masked(x):
    m = np.ma.masked_array(x, mask=np.zeros(x.shape, bool), copy=True)
    m.data.flat[0] = np.nan
    m.mask.flat[0] = True
    return m


def test_masked_arrays_are_refused_everywhere():
    cache = make("int8", capacity=4, num_heads=2)
    x = np.ones((1, 2, 32), np.float32)
    cache.append(0, x, x)
    cache.advance()
    msg = "masked arrays are not taken"
    unchanged(cache, lambda: cache.append(0, masked(x), x), DTypeError, msg)
    unchanged(cache, lambda: cache.append(0, x, masked(x)), DTypeError, msg)
    with pytest.raises(DTypeError, match=msg):
        kvcore.quantize(masked(x), "int8")
    codes, scales = kvcore.quantize(x, "int8")
    with pytest.raises(DTypeError, match=msg):
        kvcore.dequantize(np.ma.masked_array(codes), scales, "int8")
    with pytest.raises(DTypeError, match=msg):
        kvcore.dequantize(codes, np.ma.masked_array(scales), "int8")
    with pytest.raises(DTypeError, match=msg):
        kvcore.dequantize(codes, scales, "int8", out=np.ma.masked_array(np.empty(x.shape, np.float32)))
    q = np.ones((2, 32), np.float32)
    with pytest.raises(DTypeError, match=msg):
        kvcore.decode_attention(masked(q), cache, 0)
    with pytest.raises(DTypeError, match=msg):
        kvcore.decode_attention(q, cache, 0, out=np.ma.masked_array(np.empty_like(q)))
    with pytest.raises(DTypeError, match=msg):
        kvcore.apply_rope(masked(q), 0)
    with pytest.raises(DTypeError, match=msg):
        kvcore.apply_rope(x, np.ma.masked_array([0]))
    snap = cache.snapshot()
    parts = {n: getattr(snap, n) for n in ("k_codes", "v_codes", "k_scales", "v_scales")}
    inf_scales = np.ma.masked_array(parts["k_scales"], mask=np.ones(parts["k_scales"].shape, bool))
    with pytest.raises(DTypeError, match=msg):
        Snapshot(snap.spec, snap.length, **{**parts, "k_scales": inf_scales})
    f16 = make("f16", capacity=4)
    codes = np.ma.masked_array(np.full((1, 1, 2, 32), np.inf, np.float16), mask=True)
    with pytest.raises(DTypeError, match=msg):
        Snapshot(f16.spec, 1, codes, codes)


# ------------------------------------------- 8. finite in, non-finite out

@pytest.mark.parametrize("scale", [1e39, -1e39, 0.0, -0.5, 1e-50, np.float64(4e38)])
def test_attention_scale_must_be_a_positive_float32(scale):
    cache = make("f32", num_heads=2)
    x = np.ones((1, 2, 32), np.float32)
    cache.append(0, x, x)
    q = np.ones((2, 32), np.float32)
    with pytest.raises(RangeError, match="scale must be a finite positive float32"):
        kvcore.decode_attention(q, cache, 0, scale=scale)


@pytest.mark.parametrize("fmt", ["f32", "f16", "bf16", "int8"])
def test_attention_scores_past_float32_are_refused_with_the_numbers(fmt):
    cache = make(fmt, num_heads=4)
    big = 6e4 if fmt == "f16" else 1e30
    k = np.full((3, 2, 32), big, np.float32)
    cache.append(0, k, np.ones_like(k))
    cache.advance()
    q = np.full((4, 32), 1e36, np.float32)
    keep = q.copy()
    with pytest.raises(RangeError, match=r"scores .* reach .*e\+\d\d.* float32"):
        kvcore.decode_attention(q, cache, 0, scale=1.0, out=q)
    assert q.tobytes() == keep.tobytes()  # out (here q itself) is left untouched


def test_attention_weighted_values_past_float32_are_refused():
    cache = make("f32", num_heads=2)
    v = np.full((4, 2, 32), 3e38, np.float32)
    cache.append(0, np.zeros_like(v), v)
    with pytest.raises(RangeError, match="float32"):
        kvcore.decode_attention(np.ones((2, 32), np.float32), cache, 0)


def test_attention_q_times_scale_past_float32_is_refused():
    cache = make("f32", num_heads=2)
    x = np.ones((1, 2, 32), np.float32)
    cache.append(0, x, x)
    with pytest.raises(RangeError, match="float32"):
        kvcore.decode_attention(np.full((2, 32), 3e38, np.float32), cache, 0, scale=100.0)


@pytest.mark.parametrize("fmt", ALL)
@pytest.mark.parametrize("sign", [1, -1])
def test_every_format_stores_only_what_decodes_finite(fmt, sign):
    """At +-FLT_MAX and at the largest value each format takes: a value is either refused
    (FormatError, nothing written) or stored so that it decodes finite."""
    limit = np.float32(input_limit(FORMATS[fmt].id))
    largest = np.nextafter(limit, np.float32(0)) if np.isfinite(limit) else np.float32(F32MAX)
    for value in (np.float32(F32MAX), largest, limit):
        if not np.isfinite(value):
            continue
        x = np.full((1, 2, 32), sign * value, np.float32)
        x[0, 0, 1] = 1.0
        cache = make(fmt, capacity=2)
        if abs(value) >= limit:
            unchanged(cache, lambda: cache.append(0, x, x), FormatError, "out of range")
            with pytest.raises(FormatError):
                kvcore.quantize(x, fmt)
            continue
        cache.append(0, x, x)
        cache.advance()
        back = cache.dequantize(0, "k")
        assert np.isfinite(back).all(), (fmt, value, back.max())
        codes, scales = kvcore.quantize(x, fmt)
        assert np.isfinite(kvcore.dequantize(codes, scales, fmt)).all()


def test_int8_refuses_flt_max_and_names_why():
    cache = make("int8")
    x = np.full((1, 2, 32), F32MAX, np.float32)
    unchanged(cache, lambda: cache.append(0, x, x), FormatError,
              r"k\[0, 0, 0\] = 3.4028235e\+38, expected \|x\| < .*decoded value .* would overflow")


# ---------------------------------------------------- 9. int overflow of sizes

def test_attention_refuses_row_counts_past_a_c_int():
    """T x Hq/Hkv = 65537 x 65536 rows per kv head wrapped in a C int (to 65536) and left
    the other rows untouched (before the fix, with q = np.zeros of 17 GB of untouched
    pages). Here q is a zero-stride view of one float: the call is refused before q is
    read or copied."""
    G = 1 << 16
    cache = make("f32", heads=1, head_dim=1, capacity=1, num_heads=G)
    cache.append(0, np.ones((1, 1, 1), np.float32), np.ones((1, 1, 1), np.float32))
    q = np.lib.stride_tricks.as_strided(np.zeros(1, np.float32), (G + 1, G, 1), (0, 0, 0))
    with pytest.raises(RangeError, match=r"65537 x 65536 = 4295032832 .*\(2147483647\)"):
        kvcore.decode_attention(q, cache, 0, causal=False)


# --------------------------------------------------- 10. read-only views

@pytest.mark.parametrize("fmt", ["f32", "int8"])
def test_views_cannot_be_made_writable(fmt):
    cache = make(fmt, capacity=2, num_heads=2)
    x = np.ones((1, 2, 32), np.float32)
    cache.append(0, x, x)
    cache.advance()
    views = [cache.keys(0), cache.values(0), cache.keys(0, pending=True)]
    if fmt == "int8":
        views += [cache.key_scales(0), cache.value_scales(0)]
    for view in views:
        with pytest.raises(ValueError):
            view.flags.writeable = True
        alias = np.lib.stride_tricks.as_strided(view, writeable=True)
        assert not alias.flags.writeable
    if fmt == "f32":
        out = cache.keys(0)[0]          # [Hkv, D] float32 = [Hq, D]: a would-be out
        q = np.ones((2, 32), np.float32)
        for call in (lambda: kvcore.decode_attention(q, cache, 0, out=out),
                     lambda: kvcore.apply_rope(out, 0),
                     lambda: kvcore.dequantize(np.zeros((2, 32), np.float32), None, "f32", out=out)):
            unchanged(cache, call, ShapeError, "writable")
        inner = cache._layer_arrays(0)[0][0]   # the writable internal view
        unchanged(cache, lambda: kvcore.decode_attention(q, cache, 0, out=inner), ShapeError,
                  "overlaps the cache's storage")


# ------------------------------------------------ 11. Snapshot construction

def test_snapshot_construction_is_validated():
    cache = make("int8", capacity=4)
    x = np.ones((2, 2, 32), np.float32)
    cache.append(0, x, x)
    cache.advance()
    s = cache.snapshot()
    parts = dict(k_codes=s.k_codes, v_codes=s.v_codes, k_scales=s.k_scales, v_scales=s.v_scales)
    for length in (2.0, None, True, "2", np.float32(2)):
        with pytest.raises(DTypeError, match="invalid type of length: expected int"):
            Snapshot(s.spec, length, **parts)
    with pytest.raises(DTypeError, match="invalid type of spec: expected KVSpec, got str"):
        Snapshot("x", 2, **parts)
    assert Snapshot(s.spec, np.int64(2), **parts).length == 2
    with pytest.raises(SnapshotError, match=r"snapshot k_codes: expected \[1, 2, 2, 32\] int8"):
        Snapshot(s.spec, 2, **{**parts, "k_codes": s.k_codes.astype(np.int16)})


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3", "fp8_e5m2"])
def test_restore_refuses_scales_the_encoder_never_produces(fmt):
    cache = make(fmt, capacity=4)
    x = np.ones((2, 2, 32), np.float32)
    cache.append(0, x, x)
    cache.advance()
    s = cache.snapshot()
    scales = s.k_scales.copy()
    scales[0, 1, 1, 0] = np.float32(3.4e38)
    bad = Snapshot(s.spec, 2, s.k_codes, s.v_codes, scales, s.v_scales)
    other = make(fmt, capacity=4)
    unchanged(other, lambda: other.restore(bad), SnapshotError,
              r"k_scales\[0, 1, 1, 0\] = .* is not a value format")


@pytest.mark.parametrize("fmt", ["f32", "int8", "q8_0"])
def test_snapshot_of_the_cache_own_views_restores_like_a_copy(fmt):
    cache = make(fmt, capacity=4)
    rng = np.random.default_rng(1)
    k, v = (rng.standard_normal((3, 2, 32)).astype(np.float32) for _ in range(2))
    cache.append(0, k, v)
    cache.advance()
    want_k, want_v = cache.dequantize(0, "k"), cache.dequantize(0, "v")
    kc, vc, ks, vs = (None if a is None else a[None, :3] for a in cache._layer_arrays(0))
    swapped = Snapshot(cache.spec, 3, vc, kc, vs, ks)
    cache.restore(swapped)
    assert cache.dequantize(0, "k").tobytes() == want_v.tobytes()
    assert cache.dequantize(0, "v").tobytes() == want_k.tobytes()


# ------------------------------------------------ 12. errors of the hierarchy

def test_errors_are_in_the_hierarchy():
    cache = make("f32", num_heads=2)
    x = np.ones((1, 2, 32), np.float32)
    cache.append(0, x, x)
    q = np.ones((2, 32), np.float32)
    with pytest.raises(RangeError):
        kvcore.set_num_threads(-1)
    with pytest.raises(DTypeError, match="invalid type of scale: expected float, got str"):
        kvcore.decode_attention(q, cache, 0, scale="0.1")
    with pytest.raises(DTypeError, match="invalid type of scale: expected float, got bool"):
        kvcore.decode_attention(q, cache, 0, scale=True)
    for theta in (10**400, float("inf"), float("nan"), 0.0, -1.0):
        with pytest.raises(RangeError, match="theta must be a finite positive number"):
            kvcore.apply_rope(q, 0, theta=theta)
    with pytest.raises(DTypeError, match="invalid type of theta"):
        kvcore.apply_rope(q, 0, theta="1e4")
    y = np.ones((2, 2, 32), np.float32)
    for positions in (np.array([0, 2**64 - 1], np.uint64), np.array([0, -1]),
                      np.array([2**63], np.uint64).repeat(2)):
        keep = y.copy()
        with pytest.raises(OutOfRangeError, match="position"):
            kvcore.apply_rope(y, positions)
        assert y.tobytes() == keep.tobytes()
    for bad in (np.nan, np.inf, -np.inf):
        y[1, 0, 3] = bad
        keep = y.copy()
        with pytest.raises(NonFiniteError, match=r"non-finite value in x: x\[1, 0, 3\]"):
            kvcore.apply_rope(y, np.array([0, 1]))
        assert y.tobytes() == keep.tobytes()
