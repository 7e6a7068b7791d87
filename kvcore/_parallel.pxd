cdef int num_threads() noexcept nogil
cdef int threads_for(Py_ssize_t values) noexcept nogil
cdef int run_threads(int n) noexcept nogil
