cdef int num_threads() noexcept nogil
