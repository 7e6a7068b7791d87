"""Threads under contention (kvcore/_parallel.pyx, 5.; kvcore/_omp_env.py): the threads a
kernel runs on (`running`: capped by `limit`, and by the CPUs other runnable threads leave
idle) never change a result bit, since the work is cut by num_threads() alone; kvcore sets
a short OpenMP spin only when nobody chose a wait, and leaves no variable behind."""
import os
import subprocess
import sys

import numpy as np
import pytest

import kvcore
from kvcore import KVCache, KVPool, KVSpec, _parallel, decode_attention


@pytest.fixture
def two_threads():
    kvcore.set_num_threads(2)
    try:
        yield
    finally:
        kvcore.set_num_threads(0)


def test_running_threads_follow_the_limit_and_the_idle_cpus(two_threads):
    cpus = os.cpu_count()
    assert 1 <= _parallel.idle_cpus() <= cpus
    assert _parallel.running(1) == 1 and _parallel.running(0) == 1
    before = _parallel.set_adaptive(False)
    try:
        assert _parallel.running(5) == 5
        with _parallel.limit(3):
            assert _parallel.running(5) == 3
            with _parallel.limit(1):
                assert _parallel.running(5) == 1
            assert _parallel.running(5) == 3
        with pytest.raises(ZeroDivisionError):
            with _parallel.limit(2):
                1 / 0
        assert _parallel.running(5) == 5
    finally:
        _parallel.set_adaptive(before)
    assert 1 <= _parallel.running(5) <= min(5, cpus)


def _runnable() -> int:
    """/proc/loadavg's count of runnable threads of the system."""
    with open("/proc/loadavg") as f:
        return int(f.read().split()[3].split("/")[0])


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="counts threads in /proc")
def test_threads_of_this_process_do_not_count_as_busy(two_threads):
    """kvcore's OpenMP workers spin a while after each parallel region; counted as busy
    CPUs, they made back-to-back 2-thread decode calls run on one thread about half the
    time. A thread of this process in a GIL-free numpy loop stands in for them: idle_cpus()
    is the CPUs minus the runnable threads of other processes only, so that thread never
    takes a CPU from the count. idle_cpus() reads the system's count and this process's at
    two moments, so a thread that stops or starts between them (the spinning one waiting
    for the GIL, another process waking) can shift one read: most reads taken while the
    counts stood still (equal before and after) must match, where counting this process's
    threads would miss every one."""
    import threading
    stop = threading.Event()
    big = np.ones(1 << 20)

    def spin():
        while not stop.is_set():
            np.sin(big, out=big)
    worker = threading.Thread(target=spin)
    worker.start()
    cpus, seen = os.cpu_count(), []
    try:
        for _ in range(800):
            own = _parallel.own_running_threads()
            others = _runnable() - own
            idle = _parallel.idle_cpus()
            own_after = _parallel.own_running_threads()
            if own >= 2 and own_after >= 2 and _runnable() - own_after == others:
                seen.append((idle, max(1, min(cpus, cpus - others)), others, own))
                if len(seen) == 40:
                    break
    finally:
        stop.set()
        worker.join()
    assert len(seen) >= 10, f"the spinning thread was seen running at only {len(seen)} reads"
    missed = [s for s in seen if s[0] != s[1]]
    assert len(missed) * 4 <= len(seen), (
        f"{len(missed)} of {len(seen)} reads (idle, expected, others, own): {missed[:8]}")


@pytest.mark.parametrize("fmt", ["f16", "int8", "q8_0"])
def test_fewer_running_threads_give_the_same_bits(rng, two_threads, fmt):
    """Decode attention (a KVCache, a pool batch, a prefill), quantize and append cut
    for 2 threads give the same bytes run on 1 thread (limit) and on 2 (adaptation off)."""
    spec = KVSpec(num_layers=1, num_kv_heads=2, head_dim=64, capacity=700, num_heads=8,
                  format=fmt)
    k = rng.standard_normal((700, 2, 64)).astype(np.float32)
    q1 = rng.standard_normal((8, 64)).astype(np.float32)
    q3 = rng.standard_normal((3, 8, 64)).astype(np.float32)
    qp = rng.standard_normal((300, 8, 64)).astype(np.float32)
    big = rng.standard_normal((512, 2, 64)).astype(np.float32)   # 65,536 values: threads

    def run():
        cache = KVCache(spec)
        cache.append(0, k, k)
        pool = KVPool(spec, num_pages=100, page_size=16)
        seqs = [pool.new_sequence() for _ in range(3)]
        pool.append_batch(k[:600], k[:600], seqs=seqs, layer=0, counts=[123, 400, 77])
        wrote = KVCache(spec.replace(capacity=512))
        wrote.append(0, big, big)
        return [decode_attention(q1, cache, 0), decode_attention(qp, cache, 0),
                decode_attention(q3, pool, 0, seqs=seqs), kvcore.quantize(big, fmt)[0],
                wrote._storage.copy()]
    before = _parallel.set_adaptive(False)
    try:
        two = run()
        with _parallel.limit(1):
            one = run()
    finally:
        _parallel.set_adaptive(before)
    adaptive = run()
    for a, b, c in zip(two, one, adaptive):
        assert a.tobytes() == b.tobytes() == c.tobytes()


def _child(code: str, **env: str) -> list[str]:
    """What a fresh interpreter prints, with the OpenMP wait variables as given only."""
    base = {k: v for k, v in os.environ.items()
            if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    root = os.path.dirname(os.path.dirname(os.path.abspath(kvcore.__file__)))
    base["PYTHONPATH"] = os.pathsep.join([root, base.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", code], env={**base, **env}, check=True,
                         capture_output=True, text=True, timeout=120)
    return out.stdout.split("\n")[:-1]


_SHOW = ("import os, sys, subprocess, kvcore\n"
         "print(kvcore._omp_env.WAIT)\n"
         "print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'))\n"
         "print(subprocess.run([sys.executable, '-c', 'import os; "
         "print(os.environ.get(\"GOMP_SPINCOUNT\"))'], capture_output=True, text=True)"
         ".stdout.strip())\n")


def test_short_spin_only_when_nobody_chose_a_wait():
    """Set for the runtime kvcore loads, then taken out of os.environ (children and later
    runtimes never see it); a user's OMP_WAIT_POLICY or GOMP_SPINCOUNT is kept as is."""
    assert _child(_SHOW) == ["spin 10000 rounds, then sleep (GOMP_SPINCOUNT, set by kvcore "
                             "at import)", "None None", "None"]
    assert _child(_SHOW, OMP_WAIT_POLICY="active") == [
        "as set by the user (OMP_WAIT_POLICY=active)", "active None", "None"]
    assert _child(_SHOW, GOMP_SPINCOUNT="1000") == [
        "as set by the user (GOMP_SPINCOUNT=1000)", "None 1000", "1000"]


def test_a_runtime_loaded_first_keeps_its_wait():
    """One OpenMP runtime serves the process: when one is loaded before kvcore (torch
    brings its own), kvcore sets nothing."""
    pytest.importorskip("torch")
    wait = _child("import torch, kvcore; print(kvcore._omp_env.WAIT)")[0]
    assert wait.startswith("as set by the runtime loaded before kvcore (") and "gomp" in wait
