cdef float exp_sum(float* s, Py_ssize_t n, float mx) noexcept nogil
cdef void softcap(float* s, Py_ssize_t n, float c) noexcept nogil
