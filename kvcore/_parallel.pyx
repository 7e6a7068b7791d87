# cython: language_level=3
"""OpenMP thread control shared by every Cython kernel.

1. Kernels use `prange` with the thread count returned by `threads_for(values)`: all of
   `num_threads()` for a call of at least PARALLEL_MIN_VALUES values, else 1, since
   OpenMP's fork/join costs microseconds, more than a small call's work (one decode step).
2. Without OpenMP (compiler lacked -fopenmp) everything runs on one thread.
3. Fork: libgomp's thread pool does not survive `fork` (the child inherits a pool whose
   threads do not exist, and its next parallel region waits for them forever). A child
   forked by os.fork (multiprocessing's 'fork' start method too) is marked by an
   os.register_at_fork hook and runs every kernel on one thread, the calling one (a
   region of one thread never touches the pool); set_num_threads(n > 1) refuses there.
   Processes started by 'spawn' or 'forkserver' are fresh and use every thread.
4. Thread counts are capped at MAX_THREADS (4 x the CPUs): past it OpenMP only
   oversubscribes the cores, and far past it (1e5) the runtime fails to start its threads.
5. Contention: `num_threads()` fixes how a call's work is cut (decode attention's splits,
   hence its bits); `run_threads(n)` is how many threads run those pieces now: at most n,
   at most the `limit` in force (the transformers integration: torch's threads), and at
   most the CPUs that other processes' runnable threads leave idle (/proc/loadavg's
   running count minus this process's runnable threads, read at most every
   READ_INTERVAL_NS), at least 1. A
   thread that the scheduler parks behind a busy process would hold up every split of a
   static schedule; running its pieces on the threads that have a core costs no result
   bit. kvcore's idle workers spin briefly after each region, then sleep
   (kvcore/_omp_env.py): as threads of this process they never count, so a call right
   after another keeps its threads. A busy thread of the caller's own process is not seen
   either (`limit` or set_num_threads is the way to leave it a core). Decode attention
   asks this only for a call of few items per thread
   (`_attention._run`): with many, the threads take them as they come free.
"""
import contextlib
import os
from typing import Iterator

import numpy as np

from libc.stdint cimport int64_t

from .errors import DTypeError, RangeError, StateError

IF KVCORE_OPENMP:
    cimport openmp

cdef extern from *:
    """
    #if defined(__linux__)
    #include <dirent.h>
    #include <fcntl.h>
    #include <stdio.h>
    #include <string.h>
    #include <time.h>
    #include <unistd.h>
    /* Runnable threads of the system: /proc/loadavg's 4th field ("0.50 0.40 0.30 3/120
       4567": 3); -1 when unknown. */
    static int kv_running_threads(void) {
        char buf[128];
        int fields = 0, running = 0;
        ssize_t i = 0, got;
        int fd = open("/proc/loadavg", O_RDONLY);
        if (fd < 0) return -1;
        got = read(fd, buf, sizeof buf - 1);
        close(fd);
        for (; i < got && fields < 3; i++) fields += buf[i] == ' ';
        for (; i < got && buf[i] >= '0' && buf[i] <= '9'; i++)
            running = 10 * running + buf[i] - '0';
        return running > 0 ? running : -1;
    }
    /* Runnable threads of this process (state R in /proc/self/task/<tid>/stat, the
       caller's own included); -1 when unknown. */
    static int kv_running_own_threads(void) {
        DIR* dir = opendir("/proc/self/task");
        if (dir == NULL) return -1;
        struct dirent* e;
        char path[64], buf[256];
        int running = 0;
        while ((e = readdir(dir)) != NULL) {
            if (e->d_name[0] < '0' || e->d_name[0] > '9') continue;
            snprintf(path, sizeof path, "/proc/self/task/%.20s/stat", e->d_name);
            int fd = open(path, O_RDONLY);
            if (fd < 0) continue;   /* the thread ended meanwhile */
            ssize_t got = read(fd, buf, sizeof buf - 1);
            close(fd);
            if (got <= 0) continue;
            buf[got] = 0;
            const char* p = strrchr(buf, ')');   /* "tid (comm) S ...": comm may hold ')' */
            running += p != NULL && p[1] == ' ' && p[2] == 'R';
        }
        closedir(dir);
        return running > 0 ? running : -1;
    }
    static long long kv_now_ns(void) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
        return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
    }
    #else
    static int kv_running_threads(void) { return -1; }
    static int kv_running_own_threads(void) { return -1; }
    static long long kv_now_ns(void) { return 0; }
    #endif
    """
    int kv_running_threads() nogil
    int kv_running_own_threads() nogil
    long long kv_now_ns() nogil

cdef int _threads = 0   # 0: OpenMP's default (OMP_NUM_THREADS or all cores)
cdef bint _forked = False   # this process is a fork child: one thread (3.)
cdef int _limit = 0         # run_threads' cap (`limit`); 0: none
cdef bint _adaptive = True  # run_threads leaves out the CPUs other threads keep busy (5.)
cdef int _cpus = os.cpu_count() or 1
cdef int _idle = _cpus      # CPUs idle at the last read of /proc/loadavg
cdef int64_t _read_at = -(1 << 62)   # its time (kv_now_ns), ns
READ_INTERVAL_NS = 20_000_000
cdef int64_t _interval = READ_INTERVAL_NS

PARALLEL_MIN_VALUES = 1 << 16
cdef Py_ssize_t _parallel_min = PARALLEL_MIN_VALUES

MAX_THREADS = 4 * (os.cpu_count() or 1)
"""int: the most threads set_num_threads takes (and the most any kernel uses)."""
cdef int _max_threads = MAX_THREADS


def _after_fork_in_child() -> None:
    global _forked
    _forked = True


if hasattr(os, "register_at_fork"):   # POSIX: where there is fork
    os.register_at_fork(after_in_child=_after_fork_in_child)


def openmp_enabled() -> bool:
    """True when the extensions were built with OpenMP."""
    IF KVCORE_OPENMP:
        return True
    ELSE:
        return False


def max_threads() -> int:
    """Threads a parallel kernel uses now (1 in a forked child)."""
    return num_threads()


def set_num_threads(n) -> None:
    """Sets the threads kvcore's kernels use: n in [1, MAX_THREADS], or 0 for the default
    (OMP_NUM_THREADS or all cores, at most MAX_THREADS). In a process forked from another
    (os.fork, multiprocessing's 'fork') kernels run on one thread and n > 1 raises
    StateError: OpenMP's thread pool does not survive fork."""
    global _threads
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
        raise DTypeError(f"invalid type of threads: expected int, got {type(n).__name__}")
    n = int(n)
    if not 0 <= n <= MAX_THREADS:
        raise RangeError(f"threads must be in [0, {MAX_THREADS}], got {n} "
                         f"(0: the default; the cap is 4 x the {os.cpu_count()} CPUs)")
    if _forked and n > 1:
        raise StateError(f"set_num_threads({n}) in a forked child: OpenMP's thread pool does "
                         f"not survive fork, so kernels here run on one thread (start "
                         f"worker processes with the 'spawn' or 'forkserver' method to use more)")
    _threads = n


cdef int num_threads() noexcept nogil:
    cdef int n
    if _forked:
        return 1
    IF KVCORE_OPENMP:
        n = _threads if _threads > 0 else openmp.omp_get_max_threads()
        return n if n < _max_threads else _max_threads
    ELSE:
        return 1


cdef int threads_for(Py_ssize_t values) noexcept nogil:
    return run_threads(num_threads()) if values >= _parallel_min else 1


cdef int run_threads(int n) noexcept nogil:
    cdef int idle
    if n <= 1:
        return 1
    if _limit > 0 and n > _limit:
        n = _limit
    if _adaptive:
        idle = _idle_cpus()
        if n > idle:
            n = idle
    return n


cdef int _idle_cpus() noexcept nogil:
    """CPUs not taken by other processes' runnable threads: the CPUs minus the system's
    runnable threads, this process's not counted (the caller, and the OpenMP workers that
    spin a while after each parallel region: counted, they made back-to-back 2-thread
    decode calls run on one thread about half the time, 1.75x slower on an idle 2-core
    machine); at least 1. Read at most every _interval ns; all CPUs where the count is
    unknown (no /proc/loadavg: not Linux)."""
    global _idle, _read_at
    cdef int64_t now = kv_now_ns()
    cdef int running, own
    if now - _read_at < _interval:
        return _idle
    _read_at = now
    running = kv_running_threads()
    if running > 0:
        own = max(1, kv_running_own_threads())
        _idle = max(1, min(_cpus, _cpus - (running - own)))
    return _idle


@contextlib.contextmanager
def limit(n: int) -> Iterator[None]:
    """Within the block, kernels run on at most n threads (n >= 1; their work is cut as
    before, so results keep their bits): the transformers integration keeps kvcore within
    torch's threads. Not for concurrent use from several threads."""
    global _limit
    before = _limit
    _limit = max(1, int(n))
    try:
        yield
    finally:
        _limit = before


def set_adaptive(on: bool) -> bool:
    """Whether run_threads leaves out the CPUs other threads keep busy (default True);
    returns the previous setting (benchmarks compare both)."""
    global _adaptive, _read_at
    before = bool(_adaptive)
    _adaptive = bool(on)
    _read_at = -(1 << 62)
    return before


def idle_cpus() -> int:
    """The CPUs run_threads sees idle now (read afresh)."""
    global _read_at
    _read_at = -(1 << 62)
    return _idle_cpus()


def own_running_threads() -> int:
    """Runnable threads of this process now (the caller's included; -1 when unknown),
    which idle_cpus() leaves out."""
    return kv_running_own_threads()


def running(n: int) -> int:
    """run_threads(n): the threads a kernel cut for n threads runs on now."""
    return run_threads(n)
