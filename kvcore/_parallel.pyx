# cython: language_level=3
"""OpenMP thread control shared by every Cython kernel.

1. Kernels use `prange` with the thread count returned by `threads_for(values)`: all of
   `num_threads()` for a call of at least PARALLEL_MIN_VALUES values, else 1, since
   OpenMP's fork/join costs microseconds, more than a small call's work (one decode step).
2. Without OpenMP (compiler lacked -fopenmp) everything runs on one thread.
"""
IF KVCORE_OPENMP:
    cimport openmp

cdef int _threads = 0   # 0: OpenMP's default (OMP_NUM_THREADS or all cores)

PARALLEL_MIN_VALUES = 1 << 16
cdef Py_ssize_t _parallel_min = PARALLEL_MIN_VALUES


def openmp_enabled() -> bool:
    """True when the extensions were built with OpenMP."""
    IF KVCORE_OPENMP:
        return True
    ELSE:
        return False


def max_threads() -> int:
    """Threads a parallel kernel uses now."""
    IF KVCORE_OPENMP:
        return _threads if _threads > 0 else openmp.omp_get_max_threads()
    ELSE:
        return 1


def set_num_threads(int n) -> None:
    """Sets the threads kvcore's kernels use (n >= 1), or back to the default (n = 0)."""
    global _threads
    if n < 0:
        raise ValueError(f"threads must be >= 0, got {n}")
    _threads = n


cdef int num_threads() noexcept nogil:
    IF KVCORE_OPENMP:
        return _threads if _threads > 0 else openmp.omp_get_max_threads()
    ELSE:
        return 1


cdef int threads_for(Py_ssize_t values) noexcept nogil:
    return num_threads() if values >= _parallel_min else 1
