# cython: language_level=3
"""CPU decode attention that reads the stored codes of every format, and RoPE.

1. `attend` takes q float32 [T, Hq, D] and one layer's storage as it lies in a KVCache:
   codes [N, Hkv, D] (the format's code dtype) and scales [N, Hkv, S] (or None), all
   C-contiguous; n positions are valid. Query token t sees positions [0, n - T + t]
   (causal) or [0, n). Query head i reads K/V head i // G (G = Hq / Hkv).
2. Work items are (kv head, split of the positions), spread over OpenMP threads. An item
   holds the R = T * G query rows of its group (scaled, zero-padded to Dp, a multiple of
   8) and walks its positions in tiles of TILE: the scores of all R rows against the
   tile's K rows, an online-softmax update (running max m, sum l, float32), then the
   weighted sum of the tile's V rows into R float32 accumulators. Each K/V row is read
   once per item, for all the rows of its group.
3. Rows are dequantized in registers, 8 values at a time (the C block below): the codes
   are widened to 32-bit lanes and turned into float32 (int8, q8_0: convert; f16, bf16,
   FP8: move the sign, exponent and mantissa bits into float32 position and multiply by
   a power of two, exact for every finite code). int8/FP8 row scales multiply the score
   (K) and the softmax weight (V); q8_0 block scales multiply the 8 values. No float
   copy of the cache is made.
4. The score and accumulate loops hold 8 float32 vector accumulators (4 rows x 2
   positions, 4 rows x 16 columns) so that the multiply-adds of consecutive steps are
   independent; exp is a vectorised Cephes polynomial (about 2 ulp).
5. Items of one head are merged with a log-sum-exp reduction into out [T, Hq, D].
6. `rope` rotates float32 [T, H, D] in place; angles in float64.
"""
from libc.math cimport INFINITY, cos, exp, pow, sin
from libc.stdint cimport int64_t
from libc.stdlib cimport free, malloc
from libc.string cimport memset
from cython.parallel cimport prange, threadid

from kvcore._parallel cimport num_threads

import numpy as np

cdef extern from *:
    """
    #include <stdint.h>
    #include <string.h>
    typedef float kv_v8f __attribute__((vector_size(32)));
    typedef int32_t kv_v8i __attribute__((vector_size(32)));
    typedef uint32_t kv_v8u __attribute__((vector_size(32)));
    typedef int8_t kv_v8i8 __attribute__((vector_size(8)));
    typedef uint8_t kv_v8u8 __attribute__((vector_size(8)));
    typedef uint16_t kv_v8u16 __attribute__((vector_size(16)));
    #define KV_INLINE static inline __attribute__((always_inline))

    /* The build turns off implicit contraction (-ffp-contract=off, for the exact
       encoders); attention asks for fused multiply-adds explicitly where the CPU has them. */
    #if defined(__AVX__)
    #include <immintrin.h>
    #endif
    #if defined(__FMA__) && defined(__AVX__)
    KV_INLINE kv_v8f kv_fma(kv_v8f a, kv_v8f b, kv_v8f c) {
        return (kv_v8f)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c); }
    #else
    KV_INLINE kv_v8f kv_fma(kv_v8f a, kv_v8f b, kv_v8f c) { return a * b + c; }
    #endif

    /* Widening loads of 8 codes into 32-bit lanes (gcc turns the generic form into
       scalar inserts, so AVX2 gets its one-instruction forms). */
    #if defined(__AVX2__)
    KV_INLINE kv_v8u kv_widen_u8(const char* p) {
        return (kv_v8u)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p)); }
    KV_INLINE kv_v8i kv_widen_i8(const char* p) {
        return (kv_v8i)_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)); }
    KV_INLINE kv_v8u kv_widen_u16(const char* p) {
        return (kv_v8u)_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)); }
    #else
    KV_INLINE kv_v8u kv_widen_u8(const char* p) {
        kv_v8u8 c; memcpy(&c, p, 8); return __builtin_convertvector(c, kv_v8u); }
    KV_INLINE kv_v8i kv_widen_i8(const char* p) {
        kv_v8i8 c; memcpy(&c, p, 8); return __builtin_convertvector(c, kv_v8i); }
    KV_INLINE kv_v8u kv_widen_u16(const char* p) {
        kv_v8u16 h; memcpy(&h, p, 16); return __builtin_convertvector(h, kv_v8u); }
    #endif

    KV_INLINE kv_v8f kv_splat(float x) { return (kv_v8f){x, x, x, x, x, x, x, x}; }

    KV_INLINE float kv_hsum(kv_v8f v) {
        return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7])); }

    /* Lanes a + b of the pairs (a[0], a[1]), (b[0], b[1]), ... (like hadd). */
    KV_INLINE kv_v8f kv_pairs(kv_v8f a, kv_v8f b) {
        return __builtin_shufflevector(a, b, 0, 2, 8, 10, 4, 6, 12, 14)
             + __builtin_shufflevector(a, b, 1, 3, 9, 11, 5, 7, 13, 15); }

    /* The 8 horizontal sums of a[4][2], in the order a[0][0], a[0][1], a[1][0], ... */
    KV_INLINE kv_v8f kv_hsum8(kv_v8f a[4][2]) {
        kv_v8f x = kv_pairs(kv_pairs(a[0][0], a[0][1]), kv_pairs(a[1][0], a[1][1]));
        kv_v8f y = kv_pairs(kv_pairs(a[2][0], a[2][1]), kv_pairs(a[3][0], a[3][1]));
        /* x: the 4 sums of a[0..1][*] over lanes 0-3, then over lanes 4-7; y likewise */
        return __builtin_shufflevector(x, y, 0, 1, 2, 3, 8, 9, 10, 11)
             + __builtin_shufflevector(x, y, 4, 5, 6, 7, 12, 13, 14, 15); }

    KV_INLINE kv_v8f kv_bits(kv_v8u u) { kv_v8f f; memcpy(&f, &u, 32); return f; }

    /* f16 bits -> float32, exact for finite values (subnormals included). */
    KV_INLINE float kv_f16(uint16_t h) {
        uint32_t b = ((uint32_t)(h & 0x7FFF) << 13) | ((uint32_t)(h & 0x8000) << 16);
        float f; memcpy(&f, &b, 4); return f * 0x1p112f; }

    /* 8 values of a row from their codes at p, unscaled. */
    KV_INLINE kv_v8f kv_decode8(const int fmt, const char* p) {
        switch (fmt) {
        case 0: { kv_v8f v; memcpy(&v, p, 32); return v; }
        case 1: { kv_v8u u = kv_widen_u16(p);
                  return kv_bits(((u & 0x7FFF) << 13) | ((u & 0x8000) << 16)) * kv_splat(0x1p112f); }
        case 2: return kv_bits(kv_widen_u16(p) << 16);
        case 4: { kv_v8u u = kv_widen_u8(p);
                  return kv_bits(((u & 0x7F) << 20) | ((u & 0x80) << 24)) * kv_splat(0x1p120f); }
        case 5: { kv_v8u u = kv_widen_u8(p);
                  return kv_bits(((u & 0x7F) << 21) | ((u & 0x80) << 24)) * kv_splat(0x1p112f); }
        default: return __builtin_convertvector(kv_widen_i8(p), kv_v8f);
        }
    }

    /* Values [i, i + 8) of a row of d codes at p; values past d read as 0. `tail`
       (a constant) says whether i + 8 may pass d. */
    KV_INLINE kv_v8f kv_load8(const int fmt, const int tail, const char* p, int i, int d) {
        const int cb = fmt == 0 ? 4 : fmt <= 2 ? 2 : 1;
        if (!tail) return kv_decode8(fmt, p + (size_t)i * cb);
        char tmp[32] = {0};
        memcpy(tmp, p + (size_t)i * cb, (size_t)(d - i) * cb);
        return kv_decode8(fmt, tmp);
    }

    /* Scale of values [i, i + 8) of a row with scales at s: q8_0's block scale. */
    KV_INLINE float kv_block_scale(const char* s, int i) {
        uint16_t h; memcpy(&h, s + (i / 32) * 2, 2); return kv_f16(h); }

    /* Row scale applied to a dot product / a weight: int8 and FP8 only. */
    KV_INLINE float kv_row_scale(const int fmt, const char* s) {
        if (fmt == 3 || fmt == 4 || fmt == 5) { float f; memcpy(&f, s, 4); return f; }
        return 1.0f;
    }

    /* acc[r][p] += q[r][i .. i + 8) * row(p)[i .. i + 8) for R rows x P positions. */
    KV_INLINE void kv_dot_step(const int fmt, const int tail, const int R, const int P,
                               const char* c, ptrdiff_t cs, const char* sc, ptrdiff_t ss,
                               int i, int d, const float* q, int dp, kv_v8f acc[4][2]) {
        kv_v8f k[2];
        for (int p = 0; p < P; p++) {
            k[p] = kv_load8(fmt, tail, c + p * cs, i, d);
            if (fmt == 6) k[p] = k[p] * kv_splat(kv_block_scale(sc + p * ss, i));
        }
        for (int r = 0; r < R; r++) {
            kv_v8f qv; memcpy(&qv, q + (size_t)r * dp + i, 32);
            for (int p = 0; p < P; p++) acc[r][p] = kv_fma(qv, k[p], acc[r][p]);
        }
    }

    /* s[r * ls + j] = q[r] . row(j), for R rows x P positions (R <= 4, P <= 2), rows of
       q dp floats apart (zero-padded), row j's codes at c + j * cs, scales at sc + j * ss. */
    KV_INLINE void kv_dot_block(const int fmt, const int R, const int P,
                                const char* c, ptrdiff_t cs, const char* sc, ptrdiff_t ss,
                                int d, const float* q, int dp, float* s, int ls) {
        kv_v8f acc[4][2];
        for (int r = 0; r < 4; r++) for (int p = 0; p < 2; p++) acc[r][p] = kv_splat(0.0f);
        int i = 0;
        for (; i + 8 <= d; i += 8) kv_dot_step(fmt, 0, R, P, c, cs, sc, ss, i, d, q, dp, acc);
        if (i < d) kv_dot_step(fmt, 1, R, P, c, cs, sc, ss, i, d, q, dp, acc);
        kv_v8f sums = kv_hsum8(acc);
        for (int p = 0; p < P; p++) {
            float rs = kv_row_scale(fmt, sc + p * ss);
            for (int r = 0; r < R; r++) s[r * ls + p] = sums[2 * r + p] * rs;
        }
    }

    KV_INLINE void kv_scores_fmt(const int fmt, const char* c, ptrdiff_t cs, const char* sc,
                                 ptrdiff_t ss, int d, int np, const float* q, int dp, int nr,
                                 float* s, int ls) {
        for (int r0 = 0; r0 < nr; r0 += 4) {
            const int R = nr - r0 < 4 ? nr - r0 : 4;
            const float* qr = q + (size_t)r0 * dp;
            float* sr = s + (size_t)r0 * ls;
            for (int j = 0; j < np; j += 2) {
                const char* cj = c + j * cs; const char* sj = sc + j * ss;
                const int P = np - j < 2 ? 1 : 2;
                #define KV_DOT(RR, PP) kv_dot_block(fmt, RR, PP, cj, cs, sj, ss, d, qr, dp, sr + j, ls)
                if (P == 2) { switch (R) { case 4: KV_DOT(4, 2); break; case 3: KV_DOT(3, 2); break;
                                           case 2: KV_DOT(2, 2); break; default: KV_DOT(1, 2); } }
                else { switch (R) { case 4: KV_DOT(4, 1); break; case 3: KV_DOT(3, 1); break;
                                    case 2: KV_DOT(2, 1); break; default: KV_DOT(1, 1); } }
                #undef KV_DOT
            }
        }
    }

    /* Scores of nr query rows (q: nr x dp floats) against np K rows: s [nr][ls]. */
    static void kv_scores(int fmt, const char* c, ptrdiff_t cs, const char* sc, ptrdiff_t ss,
                          int d, int np, const float* q, int dp, int nr, float* s, int ls) {
        switch (fmt) {
        #define KV_CASE(F) case F: kv_scores_fmt(F, c, cs, sc, ss, d, np, q, dp, nr, s, ls); break;
        KV_CASE(0) KV_CASE(1) KV_CASE(2) KV_CASE(3) KV_CASE(4) KV_CASE(5) KV_CASE(6)
        #undef KV_CASE
        }
    }

    /* acc[r][i0 .. i0 + 8 * B) += sum_j w[r * lw + j] * row(j)[..], R rows (<= 4), B (<= 2)
       vectors of 8 columns (the last may pass d when `tail`); w holds the row scales. */
    KV_INLINE void kv_acc_block(const int fmt, const int tail, const int R, const int B,
                                const char* c, ptrdiff_t cs, const char* sc, ptrdiff_t ss,
                                int d, int np, const float* w, int lw, float* acc, int dp, int i0) {
        kv_v8f a[4][2];
        for (int r = 0; r < R; r++) for (int b = 0; b < B; b++)
            memcpy(&a[r][b], acc + (size_t)r * dp + i0 + 8 * b, 32);
        for (int j = 0; j < np; j++) {
            kv_v8f v[2];
            for (int b = 0; b < B; b++) {
                v[b] = kv_load8(fmt, tail && b == B - 1, c + j * cs, i0 + 8 * b, d);
                if (fmt == 6) v[b] = v[b] * kv_splat(kv_block_scale(sc + j * ss, i0 + 8 * b));
            }
            for (int r = 0; r < R; r++) {
                kv_v8f wr = kv_splat(w[r * lw + j]);
                for (int b = 0; b < B; b++) a[r][b] = kv_fma(wr, v[b], a[r][b]);
            }
        }
        for (int r = 0; r < R; r++) for (int b = 0; b < B; b++)
            memcpy(acc + (size_t)r * dp + i0 + 8 * b, &a[r][b], 32);
    }

    KV_INLINE void kv_acc_rows(const int fmt, const int R, const char* c, ptrdiff_t cs,
                               const char* sc, ptrdiff_t ss, int d, int np, const float* w,
                               int lw, float* acc, int dp) {
        int i0 = 0;
        for (; i0 + 16 <= d; i0 += 16) kv_acc_block(fmt, 0, R, 2, c, cs, sc, ss, d, np, w, lw, acc, dp, i0);
        if (i0 + 8 <= d) { kv_acc_block(fmt, 0, R, 1, c, cs, sc, ss, d, np, w, lw, acc, dp, i0); i0 += 8; }
        if (i0 < d) kv_acc_block(fmt, 1, R, 1, c, cs, sc, ss, d, np, w, lw, acc, dp, i0);
    }

    KV_INLINE void kv_accumulate_fmt(const int fmt, const char* c, ptrdiff_t cs, const char* sc,
                                     ptrdiff_t ss, int d, int np, float* w, int lw, int nr,
                                     float* acc, int dp) {
        if (fmt == 3 || fmt == 4 || fmt == 5)
            for (int j = 0; j < np; j++) {
                float rs = kv_row_scale(fmt, sc + j * ss);
                for (int r = 0; r < nr; r++) w[r * lw + j] *= rs;
            }
        for (int r0 = 0; r0 < nr; r0 += 4) {
            const float* wr = w + (size_t)r0 * lw;
            float* ar = acc + (size_t)r0 * dp;
            switch (nr - r0 < 4 ? nr - r0 : 4) {
            case 4: kv_acc_rows(fmt, 4, c, cs, sc, ss, d, np, wr, lw, ar, dp); break;
            case 3: kv_acc_rows(fmt, 3, c, cs, sc, ss, d, np, wr, lw, ar, dp); break;
            case 2: kv_acc_rows(fmt, 2, c, cs, sc, ss, d, np, wr, lw, ar, dp); break;
            default: kv_acc_rows(fmt, 1, c, cs, sc, ss, d, np, wr, lw, ar, dp);
            }
        }
    }

    /* acc [nr][dp] += w [nr][lw] x V rows (np of them); scales w by the row scales. */
    static void kv_accumulate(int fmt, const char* c, ptrdiff_t cs, const char* sc, ptrdiff_t ss,
                              int d, int np, float* w, int lw, int nr, float* acc, int dp) {
        switch (fmt) {
        #define KV_CASE(F) case F: kv_accumulate_fmt(F, c, cs, sc, ss, d, np, w, lw, nr, acc, dp); break;
        KV_CASE(0) KV_CASE(1) KV_CASE(2) KV_CASE(3) KV_CASE(4) KV_CASE(5) KV_CASE(6)
        #undef KV_CASE
        }
    }

    /* exp(x) for 8 lanes, x <= 88 (Cephes expf); lanes below -87.3 (and -inf) give 0. */
    KV_INLINE kv_v8f kv_exp8(kv_v8f x) {
        kv_v8i keep = x >= kv_splat(-87.3f);
        x = (kv_v8f)((kv_v8i)x & keep);  /* dropped lanes compute exp(0), then masked */
        kv_v8f t = x * kv_splat(1.44269504088896341f) + kv_splat(12582912.0f);
        kv_v8f n = t - kv_splat(12582912.0f);  /* round to nearest */
        kv_v8i ni; memcpy(&ni, &t, 32); ni = ni - 0x4B400000;
        kv_v8f r = x - n * kv_splat(0.693359375f) - n * kv_splat(-2.12194440e-4f);
        kv_v8f y = kv_splat(1.9875691500e-4f);
        y = y * r + kv_splat(1.3981999507e-3f);
        y = y * r + kv_splat(8.3334519073e-3f);
        y = y * r + kv_splat(4.1665795894e-2f);
        y = y * r + kv_splat(1.6666665459e-1f);
        y = y * r + kv_splat(5.0000001201e-1f);
        y = y * (r * r) + r + kv_splat(1.0f);
        kv_v8i e = (ni + 127) << 23;
        kv_v8f p; memcpy(&p, &e, 32);
        return (kv_v8f)((kv_v8i)(y * p) & keep);
    }

    /* s[j] = exp(s[j] - m) for j < n (n <= lw, s padded to a multiple of 8); returns the sum. */
    static float kv_exp_shift(float* s, int n, float m) {
        kv_v8f sum = kv_splat(0.0f), mv = kv_splat(m);
        for (int j = 0; j < n; j += 8) {
            kv_v8f x; memcpy(&x, s + j, 32);
            kv_v8f e = kv_exp8(x - mv);
            if (j + 8 > n) for (int k = n - j; k < 8; k++) e[k] = 0.0f;
            memcpy(s + j, &e, 32);
            sum = sum + e;
        }
        return kv_hsum(sum);
    }
    """
    void kv_scores(int fmt, const char* c, ptrdiff_t cs, const char* sc, ptrdiff_t ss,
                   int d, int npos, const float* q, int dp, int nr, float* s, int ls) noexcept nogil
    void kv_accumulate(int fmt, const char* c, ptrdiff_t cs, const char* sc, ptrdiff_t ss,
                       int d, int npos, float* w, int lw, int nr, float* acc, int dp) noexcept nogil
    float kv_exp_shift(float* s, int n, float m) noexcept nogil

cdef enum:
    TILE = 64        # positions per tile: K scores of a tile come before its V rows are read
    MIN_SPLIT = 256  # positions per split at least; heads are split only to feed every thread


cdef struct Layer:
    const char* kc
    const char* vc
    const char* ks
    const char* vs
    ptrdiff_t cs      # bytes between positions of one head's codes (Hkv * D * code bytes)
    ptrdiff_t ss      # bytes between positions of one head's scales (Hkv * S * scale bytes)
    ptrdiff_t ch      # bytes between heads of one position's codes (D * code bytes)
    ptrdiff_t sh      # bytes between heads of one position's scales
    int fmt
    int d


cdef void _attend_item(const Layer* L, int h, Py_ssize_t p0, Py_ssize_t p1,
                       const float* q, int nr, int dp, const Py_ssize_t* last,
                       float* m, float* l, float* acc, float* s) noexcept nogil:
    """Online softmax of nr query rows (IN q [nr][dp], scaled) over positions [p0, p1) of
    kv head h; row r sees positions <= last[r]. OUT m, l [nr], acc [nr][dp] (unnormalised),
    s [nr][TILE] scratch."""
    cdef Py_ssize_t j0, np_, vis, j
    cdef int r, i
    cdef float tmax, mnew, alpha
    for r in range(nr):
        m[r] = -INFINITY
        l[r] = 0
    memset(acc, 0, nr * dp * sizeof(float))
    j0 = p0
    while j0 < p1:
        np_ = min(TILE, p1 - j0)
        kv_scores(L.fmt, L.kc + j0 * L.cs + h * L.ch, L.cs, L.ks + j0 * L.ss + h * L.sh, L.ss,
                  L.d, <int>np_, q, dp, nr, s, TILE)
        for r in range(nr):
            vis = min(np_, last[r] - j0 + 1)   # visible positions of this tile for row r
            tmax = -INFINITY
            for j in range(vis):
                tmax = max(tmax, s[r * TILE + j])
            for j in range(max(vis, 0), np_):
                s[r * TILE + j] = -INFINITY
            if tmax > m[r]:
                mnew = tmax
                alpha = <float>exp(m[r] - mnew)
                l[r] *= alpha
                for i in range(dp):
                    acc[r * dp + i] *= alpha
                m[r] = mnew
            if vis > 0:
                l[r] += kv_exp_shift(s + r * TILE, <int>np_, m[r])
            else:
                memset(s + r * TILE, 0, np_ * sizeof(float))
        kv_accumulate(L.fmt, L.vc + j0 * L.cs + h * L.ch, L.cs, L.vs + j0 * L.ss + h * L.sh, L.ss,
                      L.d, <int>np_, s, TILE, nr, acc, dp)
        j0 += np_


def _bytes(a):
    """A C-contiguous array as uint8 [N, Hkv, bytes per row] (no copy); None stays None."""
    if a is None:
        return None
    if not a.flags.c_contiguous:
        raise ValueError("attention reads C-contiguous code and scale arrays")
    return a.view(np.uint8).reshape(a.shape[0], a.shape[1], -1)


def attend(const float[:, :, ::1] q, k_codes, v_codes, k_scales, v_scales, int fmt,
           Py_ssize_t n, float scale, bint causal, float[:, :, ::1] out):
    """out [T, Hq, D] float32 = softmax(scale * q K^T) V over positions [0, n).

    IN q float32 [T, Hq, D] C-contiguous; k_codes, v_codes [N, Hkv, D] code dtype of
    format id `fmt`; k_scales, v_scales [N, Hkv, S] scale dtype or None (S = 0); all
    C-contiguous. 1 <= n <= N, and T <= n when causal. OUT out (may be q itself).
    The caller (attention.py) validates; this only reads.
    """
    cdef const unsigned char[:, :, ::1] kc = _bytes(k_codes), vc = _bytes(v_codes)
    cdef const unsigned char[:, :, ::1] ks, vs
    cdef Layer L
    cdef Py_ssize_t T = q.shape[0], Hq = q.shape[1], D = q.shape[2], Hkv = kc.shape[1]
    cdef int G = <int>(Hq // Hkv), nr = <int>(T * G), dp = <int>((D + 7) // 8 * 8)
    cdef int threads = num_threads()
    cdef Py_ssize_t nsplit = min((n + MIN_SPLIT - 1) // MIN_SPLIT,
                                 max(1, (2 * threads + Hkv - 1) // Hkv))
    cdef Py_ssize_t chunk = (n + nsplit - 1) // nsplit
    cdef Py_ssize_t items = Hkv * nsplit, it, h, sp, t, g, r, i, p0
    cdef float[:, :, ::1] qs = np.zeros((Hkv, nr, dp), np.float32)
    cdef Py_ssize_t[::1] last = np.empty(nr, np.intp)
    cdef float[:, ::1] mp = np.empty((items, nr), np.float32), lp = np.empty((items, nr), np.float32)
    cdef float[:, :, ::1] ap = np.empty((items, nr, dp), np.float32)
    cdef float[:, :, ::1] sb = np.empty((threads, nr, TILE), np.float32)
    cdef float mx, w, den
    L.kc = <const char*>&kc[0, 0, 0]
    L.vc = <const char*>&vc[0, 0, 0]
    L.cs = kc.strides[0]
    L.ch = kc.strides[1]
    L.ks = L.vs = NULL
    L.ss = L.sh = 0
    if k_scales is not None:
        ks, vs = _bytes(k_scales), _bytes(v_scales)
        L.ks = <const char*>&ks[0, 0, 0]
        L.vs = <const char*>&vs[0, 0, 0]
        L.ss = ks.strides[0]
        L.sh = ks.strides[1]
    L.fmt = fmt
    L.d = <int>D
    for t in range(T):
        for g in range(G):
            last[t * G + g] = n - T + t if causal else n - 1
    for h in range(Hkv):
        for t in range(T):
            for g in range(G):
                for i in range(D):
                    qs[h, t * G + g, i] = q[t, h * G + g, i] * scale
    with nogil:
        for it in prange(items, num_threads=threads, schedule="static"):
            h = it // nsplit
            sp = it % nsplit
            p0 = sp * chunk
            _attend_item(&L, <int>h, p0, min(p0 + chunk, n), &qs[h, 0, 0], nr, dp, &last[0],
                         &mp[it, 0], &lp[it, 0], &ap[it, 0, 0],
                         &sb[threadid(), 0, 0])
        for h in range(Hkv):
            for r in range(nr):
                mx = -INFINITY
                for sp in range(nsplit):
                    mx = max(mx, mp[h * nsplit + sp, r])
                den = 0
                for sp in range(nsplit):
                    den = den + lp[h * nsplit + sp, r] * <float>exp(mp[h * nsplit + sp, r] - mx)
                for i in range(D):
                    out[r // G, h * G + r % G, i] = 0
                for sp in range(nsplit):
                    w = <float>exp(mp[h * nsplit + sp, r] - mx) / den
                    for i in range(D):
                        out[r // G, h * G + r % G, i] += w * ap[h * nsplit + sp, r, i]


def rope(float[:, :, :] x, const int64_t[::1] positions, double theta, bint neox,
         Py_ssize_t rotary_dim):
    """Rotates x in place. IN/OUT x float32 [T, H, D], any strides; IN positions int64
    [T]; rotary_dim even, <= D. NEOX pairs (i, i + rotary_dim/2), NORM pairs (2i, 2i+1);
    pair i turns by positions[t] * theta^(-2i / rotary_dim), in float64."""
    cdef Py_ssize_t T = x.shape[0], H = x.shape[1], half = rotary_dim // 2
    cdef Py_ssize_t t, i, hh, a, b
    cdef double ang, c, s, x0, x1
    for t in prange(T, nogil=True, num_threads=num_threads(), schedule="static"):
        for i in range(half):
            ang = positions[t] * pow(theta, -2.0 * i / rotary_dim)
            c = cos(ang)
            s = sin(ang)
            a = i if neox else 2 * i
            b = i + half if neox else 2 * i + 1
            for hh in range(H):
                x0 = x[t, hh, a]
                x1 = x[t, hh, b]
                x[t, hh, a] = <float>(x0 * c - x1 * s)
                x[t, hh, b] = <float>(x0 * s + x1 * c)
