# cython: language_level=3
"""Row encoders/decoders for every storage format, and the bulk kernels behind
kvcore.quantize / kvcore.dequantize.

1. A row is D float32 values (docs/formats.md gives each rule and the byte layout).
   encode_row / decode_row (declared in _quant.pxd) are what the cache and attention
   kernels call; they assume finite input (callers check it first).
2. Every conversion is branch-free integer work on the float32 bits, written so that the
   compiler vectorises the per-row loops (selects, not branches; no calls in the loops).
   FP8 decodes through two 256-entry tables built at import.
3. Rounding: f16, bf16, int8, fp8 round to nearest even; q8_0 rounds half away from
   zero (ggml's roundf); q4_0 / q4_1 truncate after adding 8.5 / 0.5, exactly as
   gguf-py's numpy reference (float32 throughout, its float->uint8 cast included). The build uses -ffp-contract=off, so x / scale and x * id are
   single float32 operations, exactly the documented rule.
4. Bulk kernels hand out chunks of 64 rows dynamically over an OpenMP prange
   (threads_for(values) from _parallel: one thread for a small call); input rows are addressed by byte offsets so that any
   input strides work without a copy of the input. Rows of a 4-bit format are encoded in
   runs, as one row (`_encode_run`): rows adjacent in the input, read in place, or any
   other rows once gathered into a chunk's buffer.
"""
from cython.parallel cimport parallel, prange, threadid
from libc.math cimport copysignf, ldexpf, nextafterf, rintf, truncf
from libc.stdint cimport INT32_MIN, int8_t, int32_t, int64_t, uint8_t, uint16_t, uint32_t
from libc.string cimport memcpy, memset
from cpython.mem cimport PyMem_Free, PyMem_Malloc

cimport numpy as cnp

from ._parallel cimport threads_for

cnp.import_array()

cdef enum:
    QK = 32                 # q8_0 / q4_0 / q4_1 block
    ROW_CHUNK = 64          # rows per unit of work in the bulk kernels
    RUN_VALUES = 512        # a run of rows ends once it holds this many values (_encode_run)
    ABS_MASK = 0x7fffffff
    F32_INF = 0x7f800000    # bits of +inf


ctypedef union _bits32:
    float f
    uint32_t u


cdef inline uint32_t _as_u32(float x) noexcept nogil:
    cdef _bits32 b
    b.f = x
    return b.u


cdef inline float _as_f32(uint32_t u) noexcept nogil:
    cdef _bits32 b
    b.u = u
    return b.f


# ---------------------------------------------------------------------------------
# Scalar conversions (inline workers; the pxd functions wrap them)

cdef inline uint16_t _f32_to_f16(float x) noexcept nogil:
    # IEEE binary16, round to nearest even; overflow -> inf; NaN -> quiet NaN (payload kept).
    cdef uint32_t u = _as_u32(x)
    cdef uint32_t sign = (u >> 16) & 0x8000
    cdef uint32_t a = u & ABS_MASK
    # normal results: rebias the exponent, round the 13 dropped bits to nearest even
    cdef uint32_t normal = (a - (112 << 23) + 0xfff + ((a >> 13) & 1)) >> 13
    # subnormal results (|x| < 2^-14): adding 0.5f aligns the binary point at 2^-24
    cdef uint32_t sub = _as_u32(_as_f32(a) + <float>0.5) - 0x3f000000
    cdef uint32_t big = 0x7e00 | ((a >> 13) & 0x3ff) if a > F32_INF else 0x7c00
    cdef uint32_t h = sub if a < (113 << 23) else normal
    h = big if a >= (143 << 23) else h
    return <uint16_t>(h | sign)


# float16 -> float32: one value (kv_f16_to_f32, exact) and rows (kv_f16_to_f32_row:
# F16C where the compiler targets it, else kv_f16_to_f32 per value), shared with the
# attention kernels
cdef extern from "_f16_prefetch.h":
    float kv_f16_to_f32(uint16_t h) noexcept nogil
    void kv_f16_to_f32_row(const uint16_t* src, Py_ssize_t n, float* dst) noexcept nogil


cdef extern from *:
    """
    /* Rows of float32 -> IEEE binary16 with the F16C instructions where the compiler
       targets them (vcvtps2ph rounds to nearest even, exactly the rule; callers never
       pass NaN, inf or values past 65520), else the scalar conversion below. */
    #if defined(__F16C__)
    #include <immintrin.h>
    #define KV_HAVE_F16C 1
    static inline void kv_f32_to_f16_f16c(const float* x, Py_ssize_t n, uint16_t* out) {
        Py_ssize_t j = 0;
        for (; j + 8 <= n; j += 8)
            _mm_storeu_si128((__m128i*)(out + j),
                             _mm256_cvtps_ph(_mm256_loadu_ps(x + j), _MM_FROUND_TO_NEAREST_INT));
        if (j + 4 <= n) {       /* a 4-bit row of 128 values has 4 or 8 scales */
            _mm_storel_epi64((__m128i*)(out + j), _mm_cvtps_ph(_mm_loadu_ps(x + j), _MM_FROUND_TO_NEAREST_INT));
            j += 4;
        }
        for (; j < n; j++)
            out[j] = (uint16_t)_mm_extract_epi16(_mm_cvtps_ph(_mm_set_ss(x[j]), _MM_FROUND_TO_NEAREST_INT), 0);
    }
    #else
    #define KV_HAVE_F16C 0
    static inline void kv_f32_to_f16_f16c(const float* x, Py_ssize_t n, uint16_t* out) {}
    #endif
    /* min and max of n finite floats, as vector reductions (which of two equal zeros
       each gives is unspecified: callers that care look again). */
    static inline void kv_minmax(const float* x, int n, float* mn, float* mx) {
        float a = x[0], b = x[0];
        #pragma omp simd reduction(min:a) reduction(max:b)
        for (int j = 0; j < n; j++) {
            a = x[j] < a ? x[j] : a;
            b = x[j] > b ? x[j] : b;
        }
        *mn = a;
        *mx = b;
    }
    /* The 16 bytes of a 4-bit block (ggml's order: byte j = value j | value 16 + j << 4)
       of q = min(trunc((x - sub) * id + add), 15) (q4_1, sub_min set) or
       min(trunc(x * id + add), 15) (q4_0) over 32 floats that all give a value in
       [0, 16.5]: vectors of the widest registers (16 lanes with AVX-512, else 8: GCC
       keeps a vector wider than any register on the stack, 5x slower), one truncating
       conversion each (the arithmetic of the scalar rule, one rounding per operation). */
    #if defined(__AVX512F__)
    #define KV_Q4W 16
    #else
    #define KV_Q4W 8
    #endif
    typedef float kv_q4f __attribute__((vector_size(4 * KV_Q4W)));
    typedef int32_t kv_q4i __attribute__((vector_size(4 * KV_Q4W)));
    typedef uint8_t kv_q4b __attribute__((vector_size(KV_Q4W)));
    #if defined(__AVX2__)
    #include <immintrin.h>
    #endif
    /* min and max of two vectors, one instruction each (no NaN reaches them) */
    #if KV_Q4W == 16
    #define KV_Q4MIN(a, b) ((kv_q4f)_mm512_min_ps((__m512)(a), (__m512)(b)))
    #define KV_Q4MAX(a, b) ((kv_q4f)_mm512_max_ps((__m512)(a), (__m512)(b)))
    #elif defined(__AVX2__)
    #define KV_Q4MIN(a, b) ((kv_q4f)_mm256_min_ps((__m256)(a), (__m256)(b)))
    #define KV_Q4MAX(a, b) ((kv_q4f)_mm256_max_ps((__m256)(a), (__m256)(b)))
    #else
    static inline kv_q4f kv_q4_pick(kv_q4i m, kv_q4f a, kv_q4f b) {
        return (kv_q4f)((m & (kv_q4i)a) | (~m & (kv_q4i)b));
    }
    #define KV_Q4MIN(a, b) kv_q4_pick((a) < (b), a, b)
    #define KV_Q4MAX(a, b) kv_q4_pick((a) > (b), a, b)
    #endif
    static inline void kv_round_pack_u4(const float* x, int sub_min, float sub, float id,
                                        float add, uint8_t* codes) {
        kv_q4i v[16 / KV_Q4W];      /* the bytes, one per int32 lane */
        const kv_q4f fifteen = (kv_q4f){} + 15.0f;
        for (int j = 0; j < 16; j += KV_Q4W) {
            kv_q4f lo, hi;
            memcpy(&lo, x + j, sizeof lo);
            memcpy(&hi, x + 16 + j, sizeof hi);
            /* min(v, 15) before the truncation: the same code for v in [0, 16.5] */
            if (sub_min) {              /* q4_1: (x - m) * id; q4_0: x * id */
                lo -= sub;
                hi -= sub;
            }
            kv_q4f fa = lo * id + add, fb = hi * id + add;
            fa = KV_Q4MIN(fa, fifteen);
            fb = KV_Q4MIN(fb, fifteen);
            const kv_q4i a = __builtin_convertvector(fa, kv_q4i);
            const kv_q4i b = __builtin_convertvector(fb, kv_q4i);
            v[j / KV_Q4W] = a | (b << 4);
        }
    #if KV_Q4W == 8 && defined(__AVX2__)
        /* two unsigned-saturating packs (values <= 255); GCC narrows 8 lanes byte by byte */
        const __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi32((__m256i)v[0], (__m256i)v[1]), 0xD8);
        const __m128i out = _mm_packus_epi16(_mm256_castsi256_si128(p), _mm256_extracti128_si256(p, 1));
        memcpy(codes, &out, 16);
    #else
        for (int j = 0; j < 16; j += KV_Q4W) {
            kv_q4b out = __builtin_convertvector(v[j / KV_Q4W], kv_q4b);
            /* in a register, then stored: GCC would fold the narrowing into a store
               (vpmovdb to memory), which Zen 4 runs at a fraction of the speed */
            __asm__("" : "+x"(out));
            memcpy(codes + j, &out, sizeof out);
        }
    #endif
    }
    /* A 4-bit block's scales, over 32 floats (finite, below the format's limit). q4_0:
       d = max / -8, max the value of the first largest |x|; q4_1: d = (max - min) / 15
       and m = min, of equal zeros the last one's (numpy's reductions: only the sign of a
       zero min or max can differ). Codes take id = 1 / d (0 when d == 0). */
    #define KV_Q4G 8        /* blocks in the largest group of one reduction tree */
    static inline float kv_last_zero(const float* xb) {
        int j = 31;
        while (xb[j] != 0.0f) j--;
        return xb[j];
    }
    /* The first value of largest |x| of a block whose min mn is -(its max mx): the first
       equal to mx or mn (a block of zeros: its first zero, of either sign). */
    static inline float kv_first_max_abs(const float* xb, float mn, float mx) {
        int j = 0;
        while (xb[j] != mx && xb[j] != mn) j++;
        return xb[j];
    }
    /* One block's scales (sc[0] = d, and sc[1] = m for q4_1) and id, by the rule above. */
    static inline void kv_q4_block_scales(const float* xb, int q41, float* sc, float* id) {
        float mn, mx, d;
        kv_minmax(xb, 32, &mn, &mx);
        if (q41) {                          /* rare: a zero min or max */
            if (mn == 0.0f) mn = kv_last_zero(xb);
            if (mx == 0.0f) mx = kv_last_zero(xb);
        } else if (mx == -mn) {             /* rare: max |x| of both signs, or zeros */
            mx = mn = kv_first_max_abs(xb, mn, mx);
        }
        /* q4_0: max |x| is mx or -mn (equal: both hold the first one); its / -8 is the
           product by -0.125, the same exact value rounded once */
        d = q41 ? (mx - mn) / 15.0f : (mx > -mn ? mx : mn) * -0.125f;
        *id = d != 0.0f ? 1.0f / d : 0.0f;
        sc[0] = d;
        if (q41) sc[1] = mn;
    }
    #if defined(__AVX2__)
    /* The scales (sc: d per block, or (d, m) pairs) and codes of a group of nb = 4 or 8
       blocks at once: the min of each block and the min of its negation (-max) are 2 nb
       sources reduced by one transpose tree (each step halves the lanes a source holds
       and pairs the vectors: about 2 nb - 1 min operations for all of them instead of
       2 nb horizontal reductions); the divisions and the choices run on 8-lane vectors
       (a group of 4 fills them twice), and the codes take id from the register (no store
       and reload on the way). A group takes the block rule instead (kv_q4_scales returns
       0, kv_q4_encode_group too, having written no code or scale) where a block needs a
       second look (a zero min of q4_1, a max |x| of both signs or zeros of q4_0; a zero
       max of q4_1 with a min that is not zero needs none, (+-0 - m) / 15 being the same
       value), or where an id overflows (tiny blocks: the conversions of inf and NaN). */
    typedef float kv_f8 __attribute__((vector_size(32)));
    typedef int32_t kv_i8 __attribute__((vector_size(32)));
    typedef float kv_dm8 __attribute__((vector_size(64)));   /* (d, m) of 8 blocks */
    /* The tree's steps: from two vectors whose sources each fill chunks of c lanes, the
       lower (LO) and upper (HI) halves of every chunk, a's into the chunk's first half
       and b's into its second (lane indices of the pair a | b), c = KV_Q4W, / 2, / 4
       (, / 8). */
    #if KV_Q4W == 16
    #define KV_T1LO 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23
    #define KV_T1HI 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31
    #define KV_T2LO 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27
    #define KV_T2HI 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31
    #define KV_T3LO 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29
    #define KV_T3HI 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31
    #define KV_T4LO 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30
    #define KV_T4HI 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31
    #else
    #define KV_T1LO 0, 1, 2, 3, 8, 9, 10, 11
    #define KV_T1HI 4, 5, 6, 7, 12, 13, 14, 15
    #define KV_T2LO 0, 1, 8, 9, 4, 5, 12, 13
    #define KV_T2HI 2, 3, 10, 11, 6, 7, 14, 15
    #define KV_T3LO 0, 8, 2, 10, 4, 12, 6, 14
    #define KV_T3HI 1, 9, 3, 11, 5, 13, 7, 15
    #endif
    #define KV_TREE(n, LO, HI) \
        for (int i = 0; i < (n); i++) \
            v[i] = KV_Q4MIN(__builtin_shufflevector(v[2 * i], v[2 * i + 1], LO), \
                            __builtin_shufflevector(v[2 * i], v[2 * i + 1], HI))
    /* Where source s (block b's min: s = b, its -max: s = nb + b) enters the tree so
       that it leaves it in lane s (step k moves bit k - 1 of a vector's index into a
       lane bit, from the top one down; with 8 lanes, index bit 3 of a group of 8 picks
       the last vector). */
    static inline int kv_q4_slot(int s, int nb) {
        const int r3 = (s & 1) << 2 | (s & 2) | (s >> 2 & 1);
    #if KV_Q4W == 16
        return nb == 8 ? (r3 << 1 | s >> 3) : r3;
    #else
        return r3 | (s & 8);
    #endif
    }
    typedef struct { kv_f8 mn, d, id; } kv_q4s;     /* a group's min, d and id per block */
    /* A group's scales by the tree; 0 where a block needs the block rule. */
    static inline __attribute__((always_inline))
    int kv_q4_scales(const float* x, int q41, const int nb, kv_q4s* s) {
        kv_q4f v[16];
        for (int b = 0; b < nb; b++) {
            const float* xb = x + 32 * b;
            kv_q4f lo, hi;
            memcpy(&lo, xb, sizeof lo);
            kv_q4f mn = lo, mx = lo;
            for (int j = KV_Q4W; j < 32; j += KV_Q4W) {
                memcpy(&hi, xb + j, sizeof hi);
                mn = KV_Q4MIN(mn, hi);
                mx = KV_Q4MAX(mx, hi);
            }
            v[kv_q4_slot(b, nb)] = mn;
            v[kv_q4_slot(nb + b, nb)] = -mx;
        }
        KV_TREE(nb, KV_T1LO, KV_T1HI);
        KV_TREE(nb / 2, KV_T2LO, KV_T2HI);
        KV_TREE(nb / 4, KV_T3LO, KV_T3HI);
        kv_f8 mn, mx;       /* block b in lane b (a group of 4: lanes 4-7 again) */
    #if KV_Q4W == 16
        if (nb == 8) {
            KV_TREE(1, KV_T4LO, KV_T4HI);
            mn = __builtin_shufflevector(v[0], v[0], 0, 1, 2, 3, 4, 5, 6, 7);
            mx = -__builtin_shufflevector(v[0], v[0], 8, 9, 10, 11, 12, 13, 14, 15);
        } else {            /* each source still holds 2 lanes: its even and odd one */
            const kv_f8 r = (kv_f8)_mm256_min_ps(
                (__m256)__builtin_shufflevector(v[0], v[0], 0, 2, 4, 6, 8, 10, 12, 14),
                (__m256)__builtin_shufflevector(v[0], v[0], 1, 3, 5, 7, 9, 11, 13, 15));
            mn = __builtin_shufflevector(r, r, 0, 1, 2, 3, 0, 1, 2, 3);
            mx = -__builtin_shufflevector(r, r, 4, 5, 6, 7, 4, 5, 6, 7);
        }
    #else
        if (nb == 8) {
            mn = v[0];
            mx = -v[1];
        } else {
            mn = __builtin_shufflevector(v[0], v[0], 0, 1, 2, 3, 0, 1, 2, 3);
            mx = -__builtin_shufflevector(v[0], v[0], 4, 5, 6, 7, 4, 5, 6, 7);
        }
    #endif
        const kv_i8 again = q41 ? mn == 0.0f : mx == -mn;
        kv_f8 d;
        if (q41) {
            d = (mx - mn) / 15.0f;
        } else {
            const kv_i8 up = mx > -mn;
            d = (kv_f8)((up & (kv_i8)mx) | (~up & (kv_i8)mn)) * -0.125f;
        }
        const kv_f8 id = (kv_f8)((d != 0.0f) & (kv_i8)(1.0f / d));
        const kv_i8 overflow = ((kv_i8)id & 0x7fffffff) == 0x7f800000;
        s->mn = mn;
        s->d = d;
        s->id = id;
        return !_mm256_movemask_ps((__m256)(again | overflow));
    }
    /* A group's scales into sc (float32: d, or (d, m) pairs) and its codes. */
    static inline __attribute__((always_inline))
    void kv_q4_codes(const float* x, int q41, const int nb, const kv_q4s* s, float* sc, uint8_t* codes) {
        const kv_f8 mn = s->mn, d = s->d, id = s->id;
        if (q41) {
            const kv_dm8 dm = __builtin_shufflevector(d, mn, 0, 8, 1, 9, 2, 10, 3, 11,
                                                      4, 12, 5, 13, 6, 14, 7, 15);
            memcpy(sc, &dm, 2 * nb * sizeof(float));
        } else {
            memcpy(sc, &d, nb * sizeof(float));
        }
        const float add = q41 ? 0.5f : 8.5f;
        for (int b = 0; b < nb; b++)
            kv_round_pack_u4(x + 32 * b, q41, mn[b], id[b], add, codes + 16 * b);
    }
    static inline __attribute__((always_inline))
    int kv_q4_group(const float* x, int q41, const int nb, float* sc, uint8_t* codes) {
        kv_q4s s;
        if (!kv_q4_scales(x, q41, nb, &s))
            return 0;
        kv_q4_codes(x, q41, nb, &s, sc, codes);
        return 1;
    }
    static inline int kv_q4_encode_group(const float* x, int q41, int nb, float* sc, uint8_t* codes) {
        return nb == 8 ? kv_q4_group(x, q41, 8, sc, codes) : kv_q4_group(x, q41, 4, sc, codes);
    }
    #if KV_HAVE_F16C
    /* Groups of 8 blocks, up to n of them, while the tree takes them: the scales of
       group g + 1 before the codes of group g (its divisions then run beside those
       codes); their float16 scales to h (S per block). Returns the blocks done. Both
       formats with AVX-512; q4_0 only with AVX2, whose 16 vector registers made q4_1
       10% slower this way (q4_0 5-17% faster): there q4_1 takes its groups one at a
       time. KV_Q4_AHEAD(q41): whether a run of that format takes this loop. */
    #define KV_Q4_AHEAD(q41) (!(q41) || KV_Q4W == 16)
    static inline int kv_q4_groups8(const float* x, int q41, int n, uint16_t* h, uint8_t* codes) {
        const int S = q41 ? 2 : 1;
        kv_q4s cur, next;
        float sc[16];
        if (n == 0 || !kv_q4_scales(x, q41, 8, &cur))
            return 0;
        for (int g = 0; g < n; g++) {
            const int more = g + 1 < n && kv_q4_scales(x + (ptrdiff_t)256 * (g + 1), q41, 8, &next);
            kv_q4_codes(x + (ptrdiff_t)256 * g, q41, 8, &cur, sc, codes + (ptrdiff_t)128 * g);
            kv_f32_to_f16_f16c(sc, 8 * S, h + (ptrdiff_t)8 * S * g);
            if (!more)
                return 8 * (g + 1);
            cur = next;
        }
        return 8 * n;
    }
    #endif
    #else
    static inline int kv_q4_encode_group(const float* x, int q41, int nb, float* sc, uint8_t* codes) { return 0; }
    #endif
    #ifndef KV_Q4_AHEAD
    #define KV_Q4_AHEAD(q41) 0
    static inline int kv_q4_groups8(const float* x, int q41, int n, uint16_t* h, uint8_t* codes) { return 0; }
    #endif
    /* The 32 floats of a 4-bit block's 16 code bytes (ggml's order):
       out = float(code - off) * s + m, two roundings (q4_0: off 8, m -0.0, which leaves
       every product as it is, -0.0 included; q4_1: off 0, m its min). */
    static inline void kv_unpack_u4(const uint8_t* codes, int off, float s, float m, float* out) {
    #if KV_Q4W == 8 && defined(__AVX2__)    /* GCC widens an 8-byte vector lane by lane */
        const __m128i x = _mm_loadu_si128((const __m128i*)codes), f = _mm_set1_epi8(15);
        const __m128i lo = _mm_and_si128(x, f), hi = _mm_and_si128(_mm_srli_epi16(x, 4), f);
        const __m128i part[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
        kv_q4f y[4];
        for (int k = 0; k < 4; k++)
            y[k] = __builtin_convertvector((kv_q4i)_mm256_cvtepu8_epi32(part[k]) - off, kv_q4f) * s + m;
        memcpy(out, y, sizeof y);
    #else
        uint8_t c[16];
        memcpy(c, codes, 16);      /* before any store to out (which the compiler cannot
                                      know apart from codes) */
        for (int j = 0; j < 16; j += KV_Q4W) {
            kv_q4b b;
            memcpy(&b, c + j, sizeof b);
            const kv_q4f lo = __builtin_convertvector(__builtin_convertvector(b & 15, kv_q4i) - off, kv_q4f) * s + m;
            const kv_q4f hi = __builtin_convertvector(__builtin_convertvector(b >> 4, kv_q4i) - off, kv_q4f) * s + m;
            memcpy(out + j, &lo, sizeof lo);
            memcpy(out + 16 + j, &hi, sizeof hi);
        }
    #endif
    }
    """
    int KV_HAVE_F16C
    void kv_unpack_u4(const uint8_t* codes, int off, float s, float m, float* out) noexcept nogil
    enum: KV_Q4G
    int kv_q4_encode_group(const float* x, int q41, int nb, float* sc, uint8_t* codes) noexcept nogil
    int kv_q4_groups8(const float* x, int q41, int n, uint16_t* h, uint8_t* codes) noexcept nogil
    bint KV_Q4_AHEAD(bint q41) noexcept nogil
    void kv_q4_block_scales(const float* xb, int q41, float* sc, float* id) noexcept nogil
    void kv_round_pack_u4(const float* x, int sub_min, float sub, float id, float add, uint8_t* codes) noexcept nogil
    void kv_f32_to_f16_f16c(const float* x, Py_ssize_t n, uint16_t* out) noexcept nogil


cdef inline void _f32_to_f16_row(const float* x, Py_ssize_t n, uint16_t* out) noexcept nogil:
    cdef Py_ssize_t j
    if KV_HAVE_F16C:
        kv_f32_to_f16_f16c(x, n, out)
    else:
        for j in range(n):
            out[j] = _f32_to_f16(x[j])


cdef inline uint16_t _f32_to_bf16(float x) noexcept nogil:
    # round to nearest even on the top 16 bits; overflow carries into inf; NaN stays quiet NaN
    cdef uint32_t u = _as_u32(x)
    cdef uint32_t r = (u + 0x7fff + ((u >> 16) & 1)) >> 16
    return <uint16_t>(((u >> 16) | 0x40) if (u & ABS_MASK) > F32_INF else r)


cdef inline float _bf16_to_f32(uint16_t h) noexcept nogil:
    return _as_f32(<uint32_t>h << 16)


cdef inline uint8_t _f32_to_fp8(float x, uint32_t man_bits, uint32_t bias,
                                uint32_t max_code, uint32_t nan_code) noexcept nogil:
    # OCP FP8 with `man_bits` mantissa bits and exponent bias `bias`, round to nearest
    # even, saturating at max_code (so finite input never gives NaN/inf); NaN -> nan_code.
    cdef uint32_t u = _as_u32(x)
    cdef uint32_t sign = (u >> 24) & 0x80
    cdef uint32_t a = u & ABS_MASK
    cdef uint32_t shift = 23 - man_bits
    # normal results: round the dropped bits to nearest even, rebias the exponent
    cdef uint32_t normal = ((a + ((<uint32_t>1 << (shift - 1)) - 1) + ((a >> shift) & 1)) >> shift) \
        - ((127 - bias) << man_bits)
    # subnormal results (|x| < 2^(1-bias)): adding 2^(24-bias-man_bits) aligns the binary
    # point at the smallest subnormal, and the float addition rounds to nearest even
    cdef uint32_t magic = (151 - bias - man_bits) << 23
    cdef uint32_t sub = _as_u32(_as_f32(a) + _as_f32(magic)) - magic
    cdef uint32_t c = sub if a < ((128 - bias) << 23) else normal
    c = max_code if c > max_code else c
    c = nan_code if a > F32_INF else c
    return <uint8_t>(c | sign)


cdef inline uint8_t _f32_to_e4m3(float x) noexcept nogil:
    return _f32_to_fp8(x, 3, 7, 0x7e, 0x7f)


cdef inline uint8_t _f32_to_e5m2(float x) noexcept nogil:
    return _f32_to_fp8(x, 2, 15, 0x7b, 0x7e)


cdef float _E4M3[256]
cdef float _E5M2[256]


cdef float _fp8_value(uint32_t c, uint32_t exp_bits, uint32_t man_bits, int bias,
                      bint has_inf) noexcept nogil:
    # Decodes one FP8 code from its fields (used once, to fill the tables).
    cdef uint32_t e = (c >> man_bits) & ((<uint32_t>1 << exp_bits) - 1)
    cdef uint32_t m = c & ((<uint32_t>1 << man_bits) - 1)
    cdef float v
    cdef float nan = _as_f32(0x7fc00000)
    if has_inf and e == (<uint32_t>1 << exp_bits) - 1:
        v = _as_f32(F32_INF) if m == 0 else nan
    elif not has_inf and (c & 0x7f) == 0x7f:
        v = nan
    elif e == 0:
        v = ldexpf(<float>m, 1 - bias - <int>man_bits)
    else:
        v = ldexpf(<float>((<uint32_t>1 << man_bits) | m), <int>e - bias - <int>man_bits)
    return -v if c & 0x80 else v


cdef void _fill_fp8_tables() noexcept nogil:
    cdef uint32_t c
    for c in range(256):
        _E4M3[c] = _fp8_value(c, 4, 3, 7, False)
        _E5M2[c] = _fp8_value(c, 5, 2, 15, True)


_fill_fp8_tables()


# The public scalar conversions of _quant.pxd.
cdef uint16_t f32_to_f16(float x) noexcept nogil:
    return _f32_to_f16(x)

cdef uint16_t f32_to_bf16(float x) noexcept nogil:
    return _f32_to_bf16(x)

cdef float f16_to_f32(uint16_t h) noexcept nogil:
    return kv_f16_to_f32(h)

cdef float bf16_to_f32(uint16_t h) noexcept nogil:
    return _bf16_to_f32(h)

cdef uint8_t f32_to_e4m3(float x) noexcept nogil:
    return _f32_to_e4m3(x)

cdef uint8_t f32_to_e5m2(float x) noexcept nogil:
    return _f32_to_e5m2(x)

cdef float e4m3_to_f32(uint8_t c) noexcept nogil:
    return _E4M3[c]

cdef float e5m2_to_f32(uint8_t c) noexcept nogil:
    return _E5M2[c]


# ---------------------------------------------------------------------------------
# Rows

cdef inline uint32_t _amax_bits(const float* x, Py_ssize_t n) noexcept nogil:
    # max |x| as float32 bits; for non-negative floats the integer order is the float
    # order, and any NaN/inf gives a value >= F32_INF.
    cdef uint32_t m = 0, b
    cdef Py_ssize_t j
    for j in range(n):
        b = _as_u32(x[j]) & ABS_MASK
        m = b if b > m else m
    return m


# Smallest |x| whose q8_0 block scale max|x|/127 rounds to float16 infinity (set at import).
cdef uint32_t _Q8_0_LIMIT_BITS = 0


cdef void _find_q8_0_limit() noexcept nogil:
    global _Q8_0_LIMIT_BITS
    cdef float a = <float>(65520.0 * 127.0)
    while _f32_to_f16(nextafterf(a, 0) / <float>127.0) == 0x7c00:
        a = nextafterf(a, 0)
    while _f32_to_f16(a / <float>127.0) != 0x7c00:
        a = nextafterf(a, <float>3.0e38)
    _Q8_0_LIMIT_BITS = _as_u32(a)


_find_q8_0_limit()

Q8_0_LIMIT = _as_f32(_Q8_0_LIMIT_BITS)
"""float: q8_0 refuses |x| >= this value (its float16 block scale would be infinite)."""

cdef enum:
    F16_LIMIT_BITS = 0x477ff000     # 65520: the midpoint past 65504 rounds (to even) to inf
    BF16_LIMIT_BITS = 0x7f7f8000    # the midpoint past bfloat16's largest finite value
    # q4_0: d = max / -8 is exact (a power of two), so fp16(d) is inf exactly from
    # |max| >= 8 * 65520 = 524160 on.
    Q4_0_LIMIT_BITS = 0x48fff000    # 524160.0
    # q4_1 stores m = min as float16: it refuses |x| >= 65520 (a bound on every value:
    # below it |min| < 65520 and d = (max - min) / 15 < 8736 are finite float16).
    Q4_1_LIMIT_BITS = F16_LIMIT_BITS

Q4_0_LIMIT = _as_f32(Q4_0_LIMIT_BITS)
"""float: q4_0 refuses |x| >= this value (524160.0: its float16 block scale max/-8 would be infinite)."""
Q4_1_LIMIT = _as_f32(Q4_1_LIMIT_BITS)
"""float: q4_1 refuses |x| >= this value (65520.0: a bound under which its float16 min and scale are finite)."""


cdef float _CODE_MAX[7]             # int8 / fp8: the largest code value, 127, 448, 57344
_CODE_MAX[:] = [0, 0, 0, 127, 448, 57344, 0]
cdef uint32_t _SCALED_LIMIT_BITS[7]  # int8 / fp8: set at import by _find_scaled_limits


cdef void _find_scaled_limits() noexcept nogil:
    # The smallest |x| whose row would not decode finite: its scale s = x / M (M the
    # largest code value) decodes as M * s, which overflows float32 for int8 from
    # FLT_MAX on (M = 127 is no power of two); fp8's M * (x / M) stays finite (inf: none).
    cdef int fmt
    cdef float m, a
    for fmt in range(INT8, FP8_E5M2 + 1):
        m = _CODE_MAX[fmt]
        a = _as_f32(F32_INF - 1)
        while _as_u32(m * (a / m)) == F32_INF:
            a = nextafterf(a, 0)
        _SCALED_LIMIT_BITS[fmt] = F32_INF if a == _as_f32(F32_INF - 1) else _as_u32(a) + 1


_find_scaled_limits()


cdef uint32_t input_limit_bits(int fmt) noexcept nogil:
    if fmt == F16:
        return F16_LIMIT_BITS
    if fmt == BF16:
        return BF16_LIMIT_BITS
    if fmt == Q8_0:
        return _Q8_0_LIMIT_BITS
    if fmt == Q4_0:
        return Q4_0_LIMIT_BITS
    if fmt == Q4_1 or fmt == Q4_1CH:
        return Q4_1_LIMIT_BITS
    if INT8 <= fmt <= FP8_E5M2:
        return _SCALED_LIMIT_BITS[fmt]
    return F32_INF


def input_limit(int fmt) -> float:
    """The smallest |x| format `fmt` refuses (inf: only NaN and inf are refused)."""
    return _as_f32(input_limit_bits(fmt))


def max_scale(int fmt) -> float:
    """The largest row scale the int8 / fp8 encoder produces (from the largest |x| below
    input_limit); a larger one would not decode finite. inf for the other formats."""
    if not INT8 <= fmt <= FP8_E5M2:
        return _as_f32(F32_INF)
    return _as_f32(input_limit_bits(fmt) - 1) / _CODE_MAX[fmt]   # below inf: FLT_MAX


cdef inline void _encode_int8(const float* x, Py_ssize_t d, float amax,
                              int8_t* codes, float* scales) noexcept nogil:
    cdef float scale = amax / <float>127.0
    cdef int q
    cdef Py_ssize_t j
    scales[0] = scale
    if scale == 0:                        # an all-zero row (or max|x| / 127 underflows)
        memset(codes, 0, d)
        return
    for j in range(d):
        # |x / scale| <= 127 * (1 + 2^-23) for a normal scale, < 255 for a subnormal one
        q = <int>rintf(x[j] / scale)
        q = -127 if q < -127 else q
        q = 127 if q > 127 else q
        codes[j] = <int8_t>q


cdef inline void _encode_e4m3(const float* x, Py_ssize_t d, float amax,
                              uint8_t* codes, float* scales) noexcept nogil:
    cdef float scale = amax / <float>448.0
    cdef Py_ssize_t j
    scales[0] = scale
    if scale == 0:
        memset(codes, 0, d)
        return
    for j in range(d):
        codes[j] = _f32_to_e4m3(x[j] / scale)


cdef inline void _encode_e5m2(const float* x, Py_ssize_t d, float amax,
                              uint8_t* codes, float* scales) noexcept nogil:
    cdef float scale = amax / <float>57344.0
    cdef Py_ssize_t j
    scales[0] = scale
    if scale == 0:
        memset(codes, 0, d)
        return
    for j in range(d):
        codes[j] = _f32_to_e5m2(x[j] / scale)


cdef inline void _round_q8_0_block(const float* x, float idd, int8_t* codes) noexcept nogil:
    # codes = roundf(x * id): adding copysign(0.5 - 2^-25, v) then truncating (the int
    # conversion) rounds half away from zero exactly; |x * id| <= 127 * (1 + 2^-22)
    cdef float v
    cdef int j
    for j in range(QK):
        v = x[j] * idd
        codes[j] = <int8_t>(<int>(v + copysignf(<float>0.49999997, v)))


cdef inline void _encode_q8_0(const float* x, Py_ssize_t d, int8_t* codes,
                              uint16_t* scales) noexcept nogil:
    # ggml quantize_row_q8_0_ref, block by block.
    cdef Py_ssize_t b, j
    cdef float dd, idd, v
    for b in range(d // QK):
        dd = _as_f32(_amax_bits(x + b * QK, QK)) / <float>127.0
        idd = <float>1.0 / dd if dd != 0 else <float>0.0
        scales[b] = _f32_to_f16(dd)
        if _as_u32(idd) != F32_INF:
            _round_q8_0_block(x + b * QK, idd, codes + b * QK)
        else:
            # 1/d overflows (max|x| < ~3.7e-37, where ggml's float->int8 cast is
            # undefined): codes saturate to +-127, zeros stay 0.
            for j in range(QK):
                v = x[b * QK + j]
                codes[b * QK + j] = 0 if v == 0 else (127 if v > 0 else -127)


cdef inline uint8_t _np_to_u4(float v) noexcept nogil:
    # numpy's np.trunc(v).astype(np.uint8).clip(0, 15) on x86: trunc, the float->int32
    # conversion (NaN and values outside int32 give 0x80000000), its low byte, min 15.
    cdef float t = truncf(v)
    cdef int32_t i = <int32_t>t if (t > <float>-2147483648.0 and t < <float>2147483648.0) else INT32_MIN
    cdef uint8_t c = <uint8_t>(i & 0xff)
    return 15 if c > 15 else c


cdef inline void _pack_q4_block(const uint8_t* q, uint8_t* codes) noexcept nogil:
    # ggml's order: byte j holds value j (low nibble) and value 16 + j (high nibble)
    cdef int j
    for j in range(QK // 2):
        codes[j] = q[j] | (q[j + QK // 2] << 4)


cdef inline bint _finite(float v) noexcept nogil:
    return (_as_u32(v) & ABS_MASK) < F32_INF


cdef inline void _encode_q4(const float* x, Py_ssize_t d, bint q41, uint8_t* codes,
                            uint16_t* scales) noexcept nogil:
    # gguf-py Q4_0.quantize_blocks / Q4_1.quantize_blocks (= ggml quantize_row_q4_0_ref /
    # _q4_1_ref): q4_0 q = trunc(x * id + 8.5), q4_1 q = trunc((x - m) * id + 0.5),
    # clipped to [0, 15]; id = 1/d (0 when d == 0). Groups of 8 blocks, then one of 4:
    # by the reduction tree where the build has it (kv_q4_groups8 runs of them; AVX2's
    # q4_1 kv_q4_encode_group one at a time), else (the last 1-3 blocks, or a group
    # the tree declines) the scales block by block, then the codes; a group's float32
    # scales go to float16 together.
    cdef int S = 2 if q41 else 1
    cdef float add = <float>0.5 if q41 else <float>8.5
    cdef float sc[2 * KV_Q4G]
    cdef float inv[KV_Q4G]
    cdef float sub
    cdef Py_ssize_t b0 = 0, nb = d // QK
    cdef int b, n, j
    cdef const float* xb
    cdef uint8_t q[QK]
    while b0 < nb:
        if KV_Q4_AHEAD(q41) and nb - b0 >= 8:
            b0 += kv_q4_groups8(x + b0 * QK, q41, <int>((nb - b0) // 8), scales + b0 * S,
                                codes + b0 * (QK // 2))
            if nb - b0 < 8:
                continue
            n = 8       # a group the tree declined
        else:
            n = 8 if nb - b0 >= 8 else (4 if nb - b0 >= 4 else <int>(nb - b0))
            if n >= 4 and kv_q4_encode_group(x + b0 * QK, q41, n, sc, codes + b0 * (QK // 2)):
                _f32_to_f16_row(sc, n * S, scales + b0 * S)
                b0 += n
                continue
        for b in range(n):
            kv_q4_block_scales(x + (b0 + b) * QK, q41, sc + b * S, inv + b)
        for b in range(n):
            xb = x + (b0 + b) * QK
            sub = sc[2 * b + 1] if q41 else <float>0.0
            if _finite(inv[b]):     # every value in [0, 16.5]: a plain truncating conversion
                kv_round_pack_u4(xb, q41, sub, inv[b], add, codes + (b0 + b) * (QK // 2))
            else:   # 1/d overflows: (x - m) * id is inf or NaN (0 * inf), numpy's conversions
                for j in range(QK):
                    q[j] = _np_to_u4((xb[j] - sub) * inv[b] + add)
                _pack_q4_block(q, codes + (b0 + b) * (QK // 2))
        _f32_to_f16_row(sc, n * S, scales + b0 * S)
        b0 += n


cdef inline void _encode_scaled(int fmt, const float* x, Py_ssize_t d, uint32_t amax_bits,
                                void* codes, void* scales) noexcept nogil:
    # encode_row with max|x| of the row already known (bits).
    cdef Py_ssize_t j
    cdef uint16_t* h
    if fmt == F32:
        memcpy(codes, x, d * sizeof(float))
    elif fmt == F16:
        _f32_to_f16_row(x, d, <uint16_t*>codes)
    elif fmt == BF16:
        h = <uint16_t*>codes
        for j in range(d):
            h[j] = _f32_to_bf16(x[j])
    elif fmt == INT8:
        _encode_int8(x, d, _as_f32(amax_bits), <int8_t*>codes, <float*>scales)
    elif fmt == FP8_E4M3:
        _encode_e4m3(x, d, _as_f32(amax_bits), <uint8_t*>codes, <float*>scales)
    elif fmt == FP8_E5M2:
        _encode_e5m2(x, d, _as_f32(amax_bits), <uint8_t*>codes, <float*>scales)
    elif fmt == Q8_0:
        _encode_q8_0(x, d, <int8_t*>codes, <uint16_t*>scales)
    elif fmt == Q4_0 or fmt == Q4_1 or fmt == Q4_1CH:
        _encode_q4(x, d, fmt != Q4_0, <uint8_t*>codes, <uint16_t*>scales)


cdef void encode_row(int fmt, const float* x, Py_ssize_t d, void* codes, void* scales) noexcept nogil:
    _encode_scaled(fmt, x, d, _amax_bits(x, d) if INT8 <= fmt <= FP8_E5M2 else 0,
                   codes, scales)


cdef void decode_row(int fmt, const void* codes, const void* scales, Py_ssize_t d, float* out) noexcept nogil:
    cdef Py_ssize_t j, b, b0, nb, per
    cdef float sc[64]
    cdef const uint16_t* h
    cdef const uint8_t* c8
    cdef const int8_t* q
    cdef float s
    if fmt == F32:
        memcpy(out, codes, d * sizeof(float))
    elif fmt == F16:
        kv_f16_to_f32_row(<const uint16_t*>codes, d, out)
    elif fmt == BF16:
        h = <const uint16_t*>codes
        for j in range(d):
            out[j] = _bf16_to_f32(h[j])
    elif fmt == INT8:
        q = <const int8_t*>codes
        s = (<const float*>scales)[0]
        for j in range(d):
            out[j] = <float>q[j] * s
    elif fmt == FP8_E4M3:
        c8 = <const uint8_t*>codes
        s = (<const float*>scales)[0]
        for j in range(d):
            out[j] = _E4M3[c8[j]] * s
    elif fmt == FP8_E5M2:
        c8 = <const uint8_t*>codes
        s = (<const float*>scales)[0]
        for j in range(d):
            out[j] = _E5M2[c8[j]] * s
    else:   # the block formats: each run of up to 32 blocks' float16 scales converted at once
        per = 2 if fmt == Q4_1 or fmt == Q4_1CH else 1
        q = <const int8_t*>codes
        for b0 in range(0, d // QK, 32):
            nb = min(32, d // QK - b0)
            kv_f16_to_f32_row(<const uint16_t*>scales + per * b0, per * nb, sc)
            for b in range(b0, b0 + nb):
                if fmt == Q8_0:
                    s = sc[b - b0]
                    for j in range(b * QK, b * QK + QK):
                        out[j] = <float>q[j] * s
                elif fmt == Q4_0:   # (code - 8) * d
                    kv_unpack_u4(<const uint8_t*>codes + b * (QK // 2), 8, sc[b - b0],
                                 <float>-0.0, out + b * QK)
                else:               # code * d + m
                    kv_unpack_u4(<const uint8_t*>codes + b * (QK // 2), 0, sc[2 * (b - b0)],
                                 sc[2 * (b - b0) + 1], out + b * QK)


# ---------------------------------------------------------------------------------
# Bulk kernels (called by kvcore/quant.py after validation)

cdef inline const float* _load_row(const char* src, Py_ssize_t stride, int in_kind,
                                   Py_ssize_t d, float* buf) noexcept nogil:
    # The row as contiguous float32: the input itself when it already is, else `buf`.
    cdef Py_ssize_t j
    if in_kind == F32 and stride == 4:
        return <const float*>src
    if in_kind == F32:
        for j in range(d):
            buf[j] = (<const float*>(src + j * stride))[0]
    elif in_kind == F16 and stride == 2:
        kv_f16_to_f32_row(<const uint16_t*>src, d, buf)
    elif in_kind == F16:
        for j in range(d):
            buf[j] = kv_f16_to_f32((<const uint16_t*>(src + j * stride))[0])
    else:
        for j in range(d):
            buf[j] = _bf16_to_f32((<const uint16_t*>(src + j * stride))[0])
    return buf


cdef inline void _encode_run(int fmt, const float* x, Py_ssize_t d, Py_ssize_t n, char* dst,
                             char* sdst, Py_ssize_t r0, Py_ssize_t code_row,
                             Py_ssize_t scale_row) noexcept nogil:
    # Rows r0 .. r0 + n - 1 of a 4-bit format, contiguous at x (n * d floats), as one row
    # (a row's runs of codes and scales end where the next row's begin).
    _encode_scaled(fmt, x, n * d, 0, dst + r0 * code_row, sdst + r0 * scale_row)


def quantize_rows(cnp.ndarray x, const int64_t[::1] outer, Py_ssize_t n_inner,
                  Py_ssize_t inner_stride, Py_ssize_t stride, int in_kind, int fmt,
                  cnp.ndarray codes, cnp.ndarray scales, Py_ssize_t d,
                  bint encode=True) -> int:
    """Encodes R = len(outer) * n_inner rows of D = d values into codes [R, W] (W =
    Format.code_width(D)) and scales [R, S] (both C-contiguous).

    IN x: the input array. Row r = o * n_inner + i starts outer[o] + i * inner_stride
    bytes after x's data pointer, its D values `stride` bytes apart, of kind F32 / F16 /
    BF16 (format ids). OUT codes, scales (None for float formats). Returns the number of
    rows refused (a non-finite value, or one at or past input_limit(fmt)); those rows
    are left unwritten and the caller raises. encode=False only counts them (codes and
    scales untouched).
    """
    cdef Py_ssize_t nrows = outer.shape[0] * n_inner
    cdef Py_ssize_t code_row = codes.shape[codes.ndim - 1] * codes.itemsize
    cdef Py_ssize_t scale_row = 0 if scales is None else scales.shape[scales.ndim - 1] * scales.itemsize
    cdef const char* src = <const char*>cnp.PyArray_DATA(x)
    cdef char* dst = <char*>cnp.PyArray_DATA(codes)
    cdef char* sdst = NULL if scales is None else <char*>cnp.PyArray_DATA(scales)
    cdef uint32_t limit = input_limit_bits(fmt)
    cdef uint32_t amax
    cdef const float* row
    cdef const float* run
    cdef float* mine
    cdef Py_ssize_t c, r, o, i, r0, n, bad = 0
    cdef Py_ssize_t nchunks = (nrows + ROW_CHUNK - 1) // ROW_CHUNK
    cdef int nt = threads_for(nrows * d)
    # The 4-bit formats encode rows that follow each other as one row (their blocks are
    # independent, and the output rows are adjacent too), so that short rows (head_dim
    # 64: two blocks; q4_1ch's channels: one) still fill the encoder's groups: rows read
    # in place when they are adjacent in x, any other rows (strided, float16, bfloat16)
    # once gathered into a thread's buffer, each in its run's next slot. A run ends at
    # RUN_VALUES values, at a refused row and at the end of a chunk. (q8_0's encoder goes
    # block by block: runs gain it nothing here, and cost the AVX2 build 5-10%.)
    cdef bint runs = fmt >= Q4_0
    cdef bint gather = not (in_kind == F32 and stride == 4)    # else read in place
    # a gathered row goes to slot n of its run (at most RUN_VALUES values: see below)
    cdef Py_ssize_t slots = (RUN_VALUES + d - 1) // d if runs else 1
    cdef float* work = <float*>PyMem_Malloc((nt * slots * d if gather else 1) * sizeof(float))
    if work == NULL:
        raise MemoryError(f"row buffers of {nt} x {slots * d} floats")
    try:
        with nogil, parallel(num_threads=nt):
            mine = work + threadid() * slots * d if gather else work
            # chunks of ROW_CHUNK rows: one division per chunk finds (o, i), then it
            # steps. Dynamic: a thread that the OS pauses does not hold the others up.
            for c in prange(nchunks, schedule="dynamic"):
                o = c * ROW_CHUNK // n_inner
                i = c * ROW_CHUNK - o * n_inner
                run = NULL
                r0 = n = 0
                for r in range(c * ROW_CHUNK, min(c * ROW_CHUNK + ROW_CHUNK, nrows)):
                    row = _load_row(src + outer[o] + i * inner_stride, stride, in_kind, d,
                                    mine + n * d)     # n: 0 without runs
                    amax = _amax_bits(row, d)
                    if amax >= limit:
                        bad += 1
                        if n:       # a refused row ends the run (it stays unwritten)
                            _encode_run(fmt, run, d, n, dst, sdst, r0, code_row, scale_row)
                            n = 0
                    elif encode and runs:
                        # not the next row of the run (in place only: a gathered row
                        # lies in the run's next slot)
                        if n and row != run + n * d:
                            _encode_run(fmt, run, d, n, dst, sdst, r0, code_row, scale_row)
                            n = 0
                        if n == 0:
                            run = row
                            r0 = r
                        n = n + 1
                        if n * d >= RUN_VALUES:     # encoded while its rows are in L1
                            _encode_run(fmt, run, d, n, dst, sdst, r0, code_row, scale_row)
                            n = 0
                    elif encode:
                        _encode_scaled(fmt, row, d, amax, dst + r * code_row,
                                       sdst + r * scale_row if sdst != NULL else NULL)
                    i = i + 1
                    if i == n_inner:
                        i = 0
                        o = o + 1
                if n:
                    _encode_run(fmt, run, d, n, dst, sdst, r0, code_row, scale_row)
    finally:
        PyMem_Free(work)
    return bad


def dequantize_rows(int fmt, cnp.ndarray codes, cnp.ndarray scales, float[:, ::1] out) -> None:
    """Decodes codes [R, W] (W = Format.code_width(D)) and scales [R, S] (C-contiguous;
    scales None for float formats) into out [R, D] float32."""
    cdef Py_ssize_t r, nrows = out.shape[0], d = out.shape[1]
    cdef Py_ssize_t code_row = codes.shape[codes.ndim - 1] * codes.itemsize
    cdef Py_ssize_t scale_row = 0 if scales is None else scales.shape[scales.ndim - 1] * scales.itemsize
    cdef const char* src = <const char*>cnp.PyArray_DATA(codes)
    cdef const char* ssrc = NULL if scales is None else <const char*>cnp.PyArray_DATA(scales)
    with nogil:
        for r in prange(nrows, schedule="dynamic", chunksize=ROW_CHUNK, num_threads=threads_for(nrows * d)):
            decode_row(fmt, src + r * code_row, ssrc + r * scale_row if ssrc != NULL else NULL,
                       d, &out[r, 0])


def _encode_fp8_raw(const float[::1] x, int fmt):
    """Internal test hook: FP8 codes (uint8 [n]) of x float32 [n], unscaled."""
    import numpy as np
    out = np.empty(x.shape[0], dtype=np.uint8)
    cdef uint8_t[::1] o = out
    cdef Py_ssize_t j
    with nogil:
        if fmt == FP8_E4M3:
            for j in range(x.shape[0]):
                o[j] = _f32_to_e4m3(x[j])
        else:
            for j in range(x.shape[0]):
                o[j] = _f32_to_e5m2(x[j])
    return out


def _f16_scalar(const float[::1] x, const uint16_t[::1] h):
    """Internal test hook: the scalar conversions that stand in for F16C on CPUs without
    it: (f16 bits [n] of x float32 [n], float32 [m] of h f16 bits [m])."""
    import numpy as np
    bits = np.empty(x.shape[0], dtype=np.uint16)
    floats = np.empty(h.shape[0], dtype=np.float32)
    cdef uint16_t[::1] b = bits
    cdef float[::1] f = floats
    cdef Py_ssize_t j
    with nogil:
        for j in range(x.shape[0]):
            b[j] = _f32_to_f16(x[j])
        for j in range(h.shape[0]):
            f[j] = kv_f16_to_f32(h[j])
    return bits, floats
