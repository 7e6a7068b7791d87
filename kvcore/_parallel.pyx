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
"""
import os

import numpy as np

from .errors import DTypeError, RangeError, StateError

IF KVCORE_OPENMP:
    cimport openmp

cdef int _threads = 0   # 0: OpenMP's default (OMP_NUM_THREADS or all cores)
cdef bint _forked = False   # this process is a fork child: one thread (3.)

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
    return num_threads() if values >= _parallel_min else 1
