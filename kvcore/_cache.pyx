# cython: language_level=3
"""CPU cache kernels: checked, atomic row writes into a KVCache's or a KVPool's storage.

1. `RowWriter` holds the base addresses of one storage's four regions (codes
   [L][N][Hkv][D], scales [L][N][Hkv][S], N rows) and its sizes, K's and V's each in its
   own format (the same one, or two: a K/V pair); `_storage.Storage` owns
   the array, `KVCache` / `KVPool` the bookkeeping, and they tell `write` where to write:
   rows [pos, pos + T) (a KVCache), or a list of T rows (a pool's pages, several
   sequences in one call), after copying whole pages first when asked (copy-on-write,
   only once the input has passed every check).
2. `RowWriter.write(layer, pos, k, v)` checks everything before it writes a byte: k and v
   are arrays (numpy, or any array `_validate.check_ndarray` takes in place: DLPack, the
   buffer protocol) of float32, float16 or ml_dtypes bfloat16 in native byte order, of
   the same shape [T, Hkv, D] or [Hkv, D] (any strides, negative too), positions
   [pos, pos + T) fit the capacity, and every value is finite and below the format's
   `_quant.input_limit` (f16, bf16, q8_0), tested on the raw input bits without conversion.
   K rows of a grouped format (q4_1ch) are checked here and encoded by the caller, a
   group of positions at a time (`_groups.KeyGroups`).
3. Then each row (t, h) is encoded into storage at position pos + t with
   `_quant.encode_row`: an aligned unit-stride float32 row is read in place; any other
   row is first gathered through its strides into a small per-thread buffer (f16/bf16
   rows are widened by `_quant.decode_row`). No array of the step is made. Rows of 2-4
   byte codes (f32, f16, bf16) bound for positions never written before go out with
   non-temporal stores (`kv_stream_copy`): none of those lines is cached, and a normal
   store would first read each line from memory. Everything else is encoded straight
   into the storage; a position's Hkv rows of a block format, adjacent in the input,
   as one row (`_set_runs`).
4. Rows are spread over OpenMP threads (without the GIL) only when a call holds at least
   `_parallel.PARALLEL_MIN_VALUES` values; a smaller call, such as a decode step (T = 1),
   runs on the calling thread with the GIL held and the writer's own row buffer, so one
   append costs a few hundred nanoseconds plus the bytes.
5. `decode_rows` is the reverse (codes + scales -> float32), for `KVCache.dequantize`.
6. `build_info` reports how the kernels were compiled (`python -m kvcore info`).
"""
from libc.stdint cimport int64_t, uint16_t, uint32_t
from libc.string cimport memcpy
from cpython.mem cimport PyMem_Calloc, PyMem_Free, PyMem_Malloc
from cython.parallel cimport parallel, prange, threadid
cimport numpy as cnp

from kvcore._quant cimport BF16, F16, F32, Q8_0, decode_row, encode_row, input_limit_bits
from kvcore._parallel cimport threads_for

import numpy as np

from .errors import CapacityError
from ._validate import check_dtype, check_ndarray, check_shape, check_values, float_input_dtypes

cnp.import_array()

cdef extern from *:
    """
    #if defined(__GNUC__) || defined(__clang__)
    #define KVCORE_COMPILER __VERSION__
    #else
    #define KVCORE_COMPILER "unknown"
    #endif
    #ifdef __OPTIMIZE__
    #define KVCORE_OPTIMIZED 1
    #else
    #define KVCORE_OPTIMIZED 0
    #endif
    static const char* kvcore_isa(void) {
        return ""
    #ifdef __SSE4_2__
            " SSE4.2"
    #endif
    #ifdef __AVX__
            " AVX"
    #endif
    #ifdef __AVX2__
            " AVX2"
    #endif
    #ifdef __FMA__
            " FMA"
    #endif
    #ifdef __F16C__
            " F16C"
    #endif
    #ifdef __AVX512F__
            " AVX512F"
    #endif
    #ifdef __ARM_NEON
            " NEON"
    #endif
            ;
    }
    """
    const char* KVCORE_COMPILER
    int KVCORE_OPTIMIZED
    const char* kvcore_isa()


cdef extern from *:
    """
    #include <string.h>
    #if defined(__SSE2__)
    #include <immintrin.h>
    /* Copies n bytes with non-temporal stores where dst is 16-byte aligned: a cache row is
       written once and not read back by this call, so its lines need not be fetched
       first (a normal store reads each line it misses). kv_stream_fence() orders them. */
    static inline void kv_stream_copy(char* dst, const char* src, size_t n) {
        size_t head = (size_t)(-(uintptr_t)dst) & 15;
        if (head > n) head = n;
        memcpy(dst, src, head);
        dst += head; src += head; n -= head;
        for (; n >= 16; n -= 16, dst += 16, src += 16)
            _mm_stream_si128((__m128i*)dst, _mm_loadu_si128((const __m128i*)src));
        memcpy(dst, src, n);
    }
    static inline void kv_stream_fence(void) { _mm_sfence(); }
    #else
    static inline void kv_stream_copy(char* dst, const char* src, size_t n) { memcpy(dst, src, n); }
    static inline void kv_stream_fence(void) {}
    #endif
    """
    void kv_stream_copy(char* dst, const char* src, size_t n) noexcept nogil
    void kv_stream_fence() noexcept nogil

# Input kinds: the format ids of the same float types, so that `decode_row(kind, ...)`
# widens a raw input row to float32.
cdef enum:
    IN_F32 = F32
    IN_F16 = F16
    IN_BF16 = BF16
    WORK_PER_VALUE = 12   # bytes of row buffers per value of a row (_encode_one)

cdef int _bf16_num = -1
try:
    import ml_dtypes
    _bf16_num = np.dtype(ml_dtypes.bfloat16).num
except ImportError:
    pass


cdef struct Job:
    # one checked append: rows r in [0, 2*T*H): K rows first, then V rows; the arrays of
    # two are [K, V] (each side has its own format)
    int fmt[2]
    uint32_t limit[2]        # refuse |x| >= this (float32 bits): _quant.input_limit_bits
    Py_ssize_t T, H, D
    const char* src[2]       # IN: k, v data (element [0, 0, 0])
    Py_ssize_t s0[2]         # byte strides over t (0 for [Hkv, D] input), h, d
    Py_ssize_t s1[2]
    Py_ssize_t s2[2]
    int kind[2]
    bint direct[2]           # rows are aligned and unit-stride: read in place
    char* codes[2]           # OUT: codes of row (pos, head 0) of the layer, K and V (with
    char* scales[2]          #   `rows`: of row 0); scales of the same row (NULL when S = 0)
    const int64_t* rows      # [T]: the storage row of input t, or NULL: rows pos + t
    Py_ssize_t code_row[2]   # bytes of one row's codes / scales
    Py_ssize_t scale_row[2]
    bint stream[2]           # codes go to storage with non-temporal stores (_encode_one)
    Py_ssize_t first         # rows before it are checked, not encoded: the K rows of a
                             #   grouped format (q4_1ch), which its caller encodes by group
    Py_ssize_t run[2]        # rows encoded as one (1, or H: _set_runs)


cdef int _kind(object x):
    """IN_* of a numpy array we take, or -1."""
    if not cnp.PyArray_Check(x):
        return -1
    cdef cnp.ndarray a = <cnp.ndarray>x
    if not cnp.PyArray_ISNOTSWAPPED(a):
        return -1
    cdef int n = cnp.PyArray_TYPE(a)
    if n == cnp.NPY_FLOAT32:
        return IN_F32
    if n == cnp.NPY_FLOAT16:
        return IN_F16
    if n == _bf16_num and _bf16_num >= 0:
        return IN_BF16
    return -1


cdef inline bint _row_ok(const char* p, Py_ssize_t d, Py_ssize_t s, int kind,
                        uint32_t limit) noexcept nogil:
    """Every one of d values at p (byte stride s) is finite and |x| < limit, the bits of
    a float32 (_quant.input_limit_bits): max of the magnitude bits, no conversion."""
    cdef Py_ssize_t i
    cdef uint32_t u32, m32 = 0
    cdef uint16_t u16, m16 = 0
    if kind == IN_F32:
        if s == 4:
            for i in range(d):
                memcpy(&u32, p + 4 * i, 4)
                u32 &= 0x7fffffffu
                m32 = u32 if u32 > m32 else m32
        else:
            for i in range(d):
                memcpy(&u32, p + i * s, 4)
                u32 &= 0x7fffffffu
                m32 = u32 if u32 > m32 else m32
        return m32 < limit
    if s == 2:
        for i in range(d):
            memcpy(&u16, p + 2 * i, 2)
            u16 &= 0x7fff
            m16 = u16 if u16 > m16 else m16
    else:
        for i in range(d):
            memcpy(&u16, p + i * s, 2)
            u16 &= 0x7fff
            m16 = u16 if u16 > m16 else m16
    if kind == IN_F16:   # every finite float16 lies below every format's limit
        return m16 < 0x7c00
    return (<uint32_t>m16 << 16) < limit


cdef inline const char* _row_src(const Job* j, Py_ssize_t r, int w) noexcept nogil:
    """Input row r of the job (w: 0 for a K row, 1 for a V row)."""
    cdef Py_ssize_t q = r - w * j.T * j.H
    return j.src[w] + (q // j.H) * j.s0[w] + (q % j.H) * j.s1[w]


cdef Py_ssize_t _count_bad_rows(const Job* j, int nt) noexcept nogil:
    """Rows of k and v that hold a value the format refuses (NaN, inf, past its limit)."""
    cdef Py_ssize_t r, th = j.T * j.H, bad = 0
    cdef int w
    if nt > 1:
        for r in prange(2 * th, num_threads=nt, schedule="static"):
            w = 1 if r >= th else 0
            bad += <Py_ssize_t>(not _row_ok(_row_src(j, r, w), j.D, j.s2[w], j.kind[w], j.limit[w]))
    else:
        for r in range(2 * th):
            w = 1 if r >= th else 0
            bad += <Py_ssize_t>(not _row_ok(_row_src(j, r, w), j.D, j.s2[w], j.kind[w], j.limit[w]))
    return bad


cdef inline void _encode_one(const Job* j, Py_ssize_t r, Py_ssize_t n, char* work) noexcept nogil:
    """Row r of the job into storage, or rows r .. r + n - 1 (n > 1: a run, _set_runs),
    m = n * D values. work: m * 12 bytes (D raw input values of a row read through its
    strides, never in a run; m floats; a row's codes before they are streamed to the
    storage, never in a run)."""
    cdef int w = 1 if r >= j.T * j.H else 0
    cdef const char* p = _row_src(j, r, w)
    cdef Py_ssize_t i, d = j.D, m = n * j.D, s = j.s2[w], q = r - w * j.T * j.H
    cdef Py_ssize_t o = q if j.rows == NULL else j.rows[q // j.H] * j.H + q % j.H
    cdef char* scales = j.scales[w] + o * j.scale_row[w] if j.scales[w] != NULL else NULL
    cdef float* buf = <float*>(work + 4 * m)
    cdef char* codes = work + 8 * m
    if not j.direct[w]:
        if j.kind[w] == IN_F32:
            for i in range(d):
                memcpy(work + 4 * i, p + i * s, 4)
        else:
            for i in range(d):
                memcpy(work + 2 * i, p + i * s, 2)
        p = work
    cdef char* dst = j.codes[w] + o * j.code_row[w]
    if j.kind[w] != IN_F32:
        decode_row(j.kind[w], p, NULL, m, buf)
        p = <const char*>buf
    if not j.stream[w]:
        encode_row(j.fmt[w], <const float*>p, m, dst, scales)
    elif j.fmt[w] == F32:   # f32 storage: the floats themselves
        kv_stream_copy(dst, p, j.code_row[w])
    else:
        encode_row(j.fmt[w], <const float*>p, d, codes, scales)
        kv_stream_copy(dst, codes, j.code_row[w])


cdef inline void _encode_unit(const Job* j, Py_ssize_t u, Py_ssize_t nk, char* work) noexcept nogil:
    """Unit u of the job: K's units (nk, of j.run[0] rows each, from j.first) come first,
    then V's (of j.run[1] rows)."""
    if u < nk:
        _encode_one(j, j.first + u * j.run[0], j.run[0], work)
    else:
        _encode_one(j, j.T * j.H + (u - nk) * j.run[1], j.run[1], work)


cdef void _encode_rows(const Job* j, int nt, char* work) noexcept nogil:
    """work: nt blocks of WORK_PER_VALUE * H * D bytes, one per thread (_encode_one)."""
    cdef Py_ssize_t u, block = j.H * j.D * WORK_PER_VALUE
    cdef Py_ssize_t nk = (j.T * j.H - j.first) // j.run[0]
    cdef Py_ssize_t n = nk + j.T * j.H // j.run[1]
    cdef char* mine
    if nt > 1:
        with parallel(num_threads=nt):
            mine = work + threadid() * block
            for u in prange(n, schedule="static"):
                _encode_unit(j, u, nk, mine)
            kv_stream_fence()
    else:
        for u in range(n):
            _encode_unit(j, u, nk, work)
        kv_stream_fence()


cdef void _set_runs(Job* j, int nt) noexcept nogil:
    """A position's H rows of a block format (q8_0, q4_0, q4_1) that lie one after
    another in the input, read in place, are one run, encoded as one row of H * D
    values: their blocks are independent, and their codes and scales are adjacent in
    storage, so the 4-bit encoder fills its groups of eight blocks at head_dim 64 too,
    and a run costs one call and one widening of float16 / bfloat16 input (which,
    one row at a time through the row buffer, ran at two speeds from process to
    process on a Zen 4: q8_0 24.7 or 35.8 ns a row at head_dim 64; runs: 21.0). No
    runs where nt threads would get fewer than 4 each (few positions of many heads):
    rows then spread better."""
    cdef int w
    cdef bint enough = nt == 1 or 2 * j.T >= 4 * nt
    for w in range(2):
        j.run[w] = j.H if (enough and j.fmt[w] >= Q8_0 and j.direct[w] and not j.stream[w]
                           and j.s1[w] == (4 if j.kind[w] == IN_F32 else 2) * j.D) else 1


cdef void _set_input(Job* j, int i, cnp.ndarray x, int kind) noexcept:
    """Input i (0: k, 1: v) of the job: address, byte strides, kind, whether in place."""
    cdef cnp.npy_intp* st = cnp.PyArray_STRIDES(x)
    j.src[i] = cnp.PyArray_BYTES(x)
    if cnp.PyArray_NDIM(x) == 3:
        j.s0[i], j.s1[i], j.s2[i] = st[0], st[1], st[2]
    else:
        j.s0[i], j.s1[i], j.s2[i] = 0, st[0], st[1]
    j.kind[i] = kind
    j.direct[i] = cnp.PyArray_ISALIGNED(x) and j.s2[i] == (4 if kind == IN_F32 else 2)


def _raise_bad_input(k, v, Py_ssize_t H, Py_ssize_t D):
    """Raises the error that says what is wrong with k or v (the checks' cold path)."""
    allowed = float_input_dtypes()
    for name, x in (("k", k), ("v", v)):
        check_ndarray(name, x)
        check_dtype(name, x, allowed)
    check_shape("k", k, (H, D) if k.ndim == 2 else ("T", H, D))
    check_shape("v", v, k.shape)
    raise AssertionError("unreachable: the input passed every check")


cdef class RowWriter:
    """Checked, atomic writes of k/v rows into one cache's storage (module comment)."""

    cdef object _keep          # the region arrays (keep the storage alive)
    cdef object _formats       # (K, V) formats.Format
    cdef char* _codes[2]       # [K, V] throughout
    cdef char* _scales[2]
    cdef int _fmt[2]
    cdef uint32_t _limit[2]
    cdef bint _grouped_k       # K's format encodes groups of positions (q4_1ch): see Job.first
    cdef char* _work           # H * D * WORK_PER_VALUE bytes: row buffers of a single-threaded write
    cdef Py_ssize_t* _fresh    # [L]: positions from here on were never written (see write)
    cdef Py_ssize_t _L, _N, _H, _D
    cdef Py_ssize_t _code_row[2]
    cdef Py_ssize_t _scale_row[2]

    def __init__(self, k_fmt, v_fmt, cnp.ndarray k_codes, cnp.ndarray v_codes, k_scales, v_scales):
        """k_fmt, v_fmt: the formats.Format of K and of V (the same one, or two);
        k_codes, v_codes: [L, N, Hkv, W] C-contiguous, each side's code dtype
        (W = fmt.code_width(D): D, or D/2 for the 4-bit formats);
        k_scales, v_scales: [L, N, Hkv, S] C-contiguous, each side's scale dtype, or None
        (S = 0)."""
        self._keep = (k_codes, v_codes, k_scales, v_scales)
        self._formats = (k_fmt, v_fmt)
        self._grouped_k = k_fmt.group != 0
        cdef Py_ssize_t D = k_codes.shape[3] * k_fmt.pack
        self._work = <char*>PyMem_Malloc(k_codes.shape[2] * D * WORK_PER_VALUE)
        self._fresh = <Py_ssize_t*>PyMem_Calloc(k_codes.shape[0], sizeof(Py_ssize_t))
        if self._work == NULL or self._fresh == NULL:
            raise MemoryError(f"a row buffer of {k_codes.shape[2] * D * WORK_PER_VALUE} bytes")
        self._L, self._N = k_codes.shape[0], k_codes.shape[1]
        self._H, self._D = k_codes.shape[2], D
        cdef int w
        for w, (fmt, codes, scales) in enumerate(((k_fmt, k_codes, k_scales),
                                                  (v_fmt, v_codes, v_scales))):
            self._fmt[w] = fmt.id
            self._limit[w] = input_limit_bits(fmt.id)
            self._codes[w] = cnp.PyArray_BYTES(<cnp.ndarray>codes)
            self._code_row[w] = codes.shape[3] * codes.itemsize
            if scales is None:
                self._scales[w] = NULL
                self._scale_row[w] = 0
            else:
                self._scales[w] = cnp.PyArray_BYTES(<cnp.ndarray>scales)
                self._scale_row[w] = scales.shape[3] * scales.itemsize

    def __dealloc__(self):
        PyMem_Free(self._work)
        PyMem_Free(self._fresh)

    def write(self, Py_ssize_t layer, Py_ssize_t pos, k, v, rows=None, copies=None,
              Py_ssize_t copy_rows=0) -> int:
        """Encodes k, v (float32/float16/bfloat16, [T, Hkv, D] or [Hkv, D], any strides)
        into rows [pos, pos + T) of `layer`, or with rows (int64 [T], C-contiguous, each
        < N) input t into row rows[t]; returns T. copies (int64 [C, 2] C-contiguous, or
        None): before the rows are written, rows [src, src + copy_rows) of every layer are
        copied to [dst, dst + copy_rows) for each (src, dst) (copy-on-write of a page).
        The caller checked layer, pos, rows and copies; this checks the rest, all before
        writing a byte. k, v: any array _validate.check_ndarray takes (a torch tensor is
        read in place)."""
        if not cnp.PyArray_CheckExact(k):
            k = check_ndarray("k", k)
        if not cnp.PyArray_CheckExact(v):
            v = check_ndarray("v", v)
        cdef int kk = _kind(k), kv = _kind(v)
        if kk < 0 or kv < 0:
            _raise_bad_input(k, v, self._H, self._D)
        cdef cnp.ndarray a = <cnp.ndarray>k, b = <cnp.ndarray>v
        cdef int nd = cnp.PyArray_NDIM(a), i
        cdef cnp.npy_intp* da = cnp.PyArray_DIMS(a)
        cdef cnp.npy_intp* db = cnp.PyArray_DIMS(b)
        cdef bint ok = (nd == 2 or nd == 3) and cnp.PyArray_NDIM(b) == nd \
            and da[nd - 2] == self._H and da[nd - 1] == self._D
        if ok:
            for i in range(nd):
                ok = ok and da[i] == db[i]
        if not ok:
            _raise_bad_input(k, v, self._H, self._D)
        cdef Py_ssize_t T = da[0] if nd == 3 else 1
        cdef cnp.ndarray ra
        cdef const int64_t* rp = NULL
        cdef Py_ssize_t lo = pos, hi = pos + T
        if rows is not None:
            ra = <cnp.ndarray>rows
            if cnp.PyArray_SIZE(ra) != T:
                raise ValueError(f"rows holds {cnp.PyArray_SIZE(ra)} rows for {T} positions")
            rp = <const int64_t*>cnp.PyArray_DATA(ra)
            hi = pos
            if T:
                lo, hi = rp[0], rp[0] + 1
            for i in range(1, T):
                lo = rp[i] if rp[i] < lo else lo
                hi = rp[i] + 1 if rp[i] >= hi else hi
        elif T > self._N - pos:
            raise CapacityError(
                f"cache full: layer {layer} asked for position {pos + T - 1} "
                f"(holds {pos}, appending {T}), capacity is {self._N} positions")

        cdef Job j
        j.T, j.H, j.D = T, self._H, self._D
        j.rows = rp
        j.first = T * self._H if self._grouped_k else 0
        cdef Py_ssize_t first = (layer * self._N + (pos if rp == NULL else 0)) * self._H
        _set_input(&j, 0, a, kk)
        _set_input(&j, 1, b, kv)
        for i in range(2):
            j.fmt[i], j.limit[i] = self._fmt[i], self._limit[i]
            j.code_row[i], j.scale_row[i] = self._code_row[i], self._scale_row[i]
            # Rows of 2-4 byte codes bound for lines never written before (none of them in
            # the CPU's caches) go out with non-temporal stores, which skip fetching each
            # line first: a decode step writes half the memory traffic. Lines written
            # before (a rewrite after truncate, as in speculative decoding) may be cached:
            # normal stores.
            j.stream[i] = self._fmt[i] <= BF16 and lo >= self._fresh[layer]
            j.codes[i] = self._codes[i] + first * self._code_row[i]
            j.scales[i] = self._scales[i] + first * self._scale_row[i] if self._scale_row[i] else NULL

        cdef int nt = threads_for(2 * T * self._H * self._D)
        _set_runs(&j, nt)
        cdef Py_ssize_t bad
        cdef char* work
        if nt == 1:
            # a small call (a decode step): a few microseconds at most, so it keeps the GIL,
            # which also makes the writer's own row buffer safe to use
            bad = _count_bad_rows(&j, 1)
            if bad == 0:
                if copies is not None:
                    self._copy(copies, copy_rows)
                _encode_rows(&j, 1, self._work)
        else:
            work = <char*>PyMem_Malloc(nt * self._H * self._D * WORK_PER_VALUE)
            if work == NULL:
                raise MemoryError(f"row buffers of {nt} x {self._H * self._D * WORK_PER_VALUE} bytes")
            with nogil:
                bad = _count_bad_rows(&j, nt)
            if bad == 0:
                if copies is not None:
                    self._copy(copies, copy_rows)
                with nogil:
                    _encode_rows(&j, nt, work)
            PyMem_Free(work)
        if bad:
            check_values("k", k, self._formats[0])
            check_values("v", v, self._formats[1])
            raise AssertionError(f"append refused {bad} rows that hold no refused value")
        self._fresh[layer] = max(self._fresh[layer], hi)
        return T

    def copy_pages(self, cnp.ndarray copies, Py_ssize_t n) -> None:
        """The copies of `write` alone (fork's copy of a partial page): copies int64
        [C, 2] C-contiguous of (src, dst) first rows, checked by the caller."""
        self._copy(copies, n)

    cdef void _copy(self, cnp.ndarray copies, Py_ssize_t n):
        """Rows [src, src + n) -> [dst, dst + n) of every layer, K and V, codes and scales,
        for each (src, dst) row of copies (int64 [C, 2])."""
        cdef const int64_t* c = <const int64_t*>cnp.PyArray_DATA(copies)
        cdef Py_ssize_t i, layer, w, src, dst, rows_per_layer = self._N * self._H
        for i in range(cnp.PyArray_DIM(copies, 0)):
            for layer in range(self._L):
                src = layer * rows_per_layer + c[2 * i] * self._H
                dst = layer * rows_per_layer + c[2 * i + 1] * self._H
                for w in range(2):
                    memcpy(self._codes[w] + dst * self._code_row[w],
                           self._codes[w] + src * self._code_row[w], n * self._H * self._code_row[w])
                    if self._scale_row[w]:
                        memcpy(self._scales[w] + dst * self._scale_row[w],
                               self._scales[w] + src * self._scale_row[w],
                               n * self._H * self._scale_row[w])


def build_info() -> dict:
    """How this extension was compiled: compiler, optimisation on, the instruction-set
    extensions the compiler targeted (what -march=native found on the build machine)."""
    return {"compiler": KVCORE_COMPILER.decode(), "optimized": bool(KVCORE_OPTIMIZED),
            "isa": kvcore_isa().decode().split()}


def decode_rows(int fmt, cnp.ndarray codes, scales, cnp.ndarray out) -> None:
    """codes [n, Hkv, W] (the format's code dtype, W = code_width(D)) and scales [n, Hkv, S]
    (its scale dtype; None when S = 0), both C-contiguous -> OUT out [n, Hkv, D] float32,
    C-contiguous."""
    cdef Py_ssize_t d = out.shape[2], rows = codes.shape[0] * codes.shape[1], r
    cdef Py_ssize_t code_row = codes.shape[2] * codes.itemsize
    cdef Py_ssize_t scale_row = 0 if scales is None else scales.shape[2] * scales.itemsize
    cdef const char* c = cnp.PyArray_BYTES(codes)
    cdef const char* s = NULL if scales is None else cnp.PyArray_BYTES(<cnp.ndarray>scales)
    cdef float* o = <float*>cnp.PyArray_DATA(out)
    cdef int nt = threads_for(rows * d)
    with nogil:
        if nt > 1:
            for r in prange(rows, num_threads=nt, schedule="static"):
                decode_row(fmt, c + r * code_row, s + r * scale_row if s != NULL else NULL,
                           d, o + r * d)
        else:
            for r in range(rows):
                decode_row(fmt, c + r * code_row, s + r * scale_row if s != NULL else NULL,
                           d, o + r * d)
