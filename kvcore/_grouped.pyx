# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Decode and causal attention over K stored by channel in groups of positions (q4_1ch).

1. `attend_grouped` takes q float32 [T, Hq, D] and one layer of a KVCache or a KVPool
   whose K format is q4_1ch (docs/formats.md): K codes uint8 [rows, Hkv, D/2] and scales
   float16 [rows, Hkv, D/16] holding the complete groups of 32 positions, each
   sequence's open group in its residual float16 [32, Hkv, D] (slot p % 32), and V codes
   [rows, Hkv, W] / scales [rows, Hkv, S] in V's own per-token format; all C-contiguous.
   Sequence b's positions [0, n_b) are read through its page table (a KVCache: one page
   of N rows); its query token t of T sees [0, n_b - T + t] (causal) or [0, n_b). Query
   head i reads kv head i // G (G = Hq / Hkv).
2. Threads take the work items: (sequence, kv head, ROWS = 64 of its T * G query rows),
   the last rows first; a causal item reads the positions its last row sees. Per item,
   its R query rows are scaled first.
   Scores of a complete group, for its 32 positions at once, rows 4 at a time
   (kvg_group_scores): the slots' scales are converted to float32 (d, m) per channel,
   then per channel its 16 code bytes are widened once into vector lanes, low nibbles
   positions 0-15 and high 16-31 (AVX-512: one vector each; AVX2: two passes of 8
   bytes), each code * d + m in registers (the stored values exactly: code * d is exact,
   so one rounding as `dequantize`'s two), and each row adds q_c times them (fused
   multiply-adds into 2 vectors per row: per row and position one chain over the
   channels in order, whatever the row count). With more than KVG_DECODE_ROWS = 8 rows
   (prefill) the group is decoded once into floats [D][32] (the same values) that the row
   blocks load instead. (Splitting
   the score into sum_c (q_c d_c) code + sum_c q_c m_c would cancel: m is the group's
   minimum.) The open group's scores are dot products with its float16 rows.
   A head's rows lie Hkv rows apart (token-major storage), so the next group's row
   slots (one per slot of the current group, while it decodes), and the next tile's V
   rows and their scales, are prefetched by hand. With a window, groups and
   V tiles that no row sees are skipped (a windowed pool may have released their pages).
3. A softmax per row (max subtracted; the attention kernel's vector exp and
   soft-capping), then the weighted sum of V in tiles of V_TILE positions
   (kvg_weighted_sum): rows 4 at a time, columns in register blocks (AVX-512: 64, AVX2:
   16) held across the tile, position by position (the order of a plain loop), one
   broadcast weight per row and position.
   q4_0 / q4_1 V decode in registers as K does (a tile's scales as float32 (d, m) pairs
   first, q4_0's as (d, -8 d)), a block's low and high nibbles from one widen, once per 4
   rows (more than 8 rows: once per tile, as other formats); other V formats decode once
   per tile and head into floats (`_quant.decode_row`) that the block loads.
   No float copy of K or V is made; per item: scores [R][n], accumulators [R][D], one
   tile of decoded V rows [V_TILE][D] and its scales, one group's scales [D][2] and
   values [D][32] as floats (_scratch_floats), in one scratch per thread for the call.
4. The caller checks that every output is finite (attention.py), so a refused call leaves
   its out untouched.
"""
from libc.math cimport INFINITY, expf, fmaf, logf
from libc.stdint cimport int32_t, int64_t, uint8_t, uint16_t, uint64_t
from libc.stdlib cimport free, malloc
from libc.stddef cimport ptrdiff_t
from libc.string cimport memset
from cython.parallel cimport prange, threadid
cimport numpy as cnp

import numpy as np

from kvcore._attention cimport exp_sum, softcap as softcap_scores
from kvcore._quant cimport F16, Q4_0, Q4_1, decode_row
from kvcore._parallel cimport num_threads

cnp.import_array()

cdef enum:
    GROUP = 32      # positions per group of q4_1ch
    GROUP_BYTES = 16    # code bytes of one channel's group (two 4-bit codes per byte)
    V_TILE = 16         # V rows decoded, then weighed, at a time
    ROWS = 64           # query rows per work item (its scores: ROWS x the positions)


cdef struct Variants:
    # docs/variants.md; 0 / NULL: off
    int64_t window           # the query at position p sees (p - window, p]
    int64_t sink_tokens      # and [0, sink_tokens)
    const float* sinks       # [Hq]: a logit per query head in the softmax's denominator
    float softcap            # scores s become softcap * tanh(s / softcap)


cdef inline void _softmax(float* s, Py_ssize_t n, Py_ssize_t p, bint causal,
                          const Variants* var, Py_ssize_t head, float* lse,
                          float* inv) noexcept nogil:
    """The scores s [n] of the query at position p (query head `head`) become its softmax
    weights, unnormalised (0 where it sees nothing); OUT lse (NULL: not asked) and inv,
    1 / the denominator."""
    cdef Py_ssize_t j, hi = min(p + 1, n) if causal else n     # it sees [0, hi) but
    cdef Py_ssize_t w1 = min(p + 1 - var.window, hi) if var.window else 0   # [sink_tokens, w1)
    cdef float mx, total = 0, c = var.softcap
    if c != 0:
        softcap_scores(s, hi, c)    # the attention kernel's, vectorised
    for j in range(var.sink_tokens, w1):
        s[j] = -INFINITY
    mx = kvg_max(s, hi)
    if var.sinks != NULL:
        mx = var.sinks[head] if var.sinks[head] > mx else mx
        total = expf(var.sinks[head] - mx)
    total = total + exp_sum(s, hi, mx)  # exp(-inf) = 0
    for j in range(hi, n):
        s[j] = 0
    if lse != NULL:
        lse[0] = mx + logf(total)
    inv[0] = 1 / total


# C shared with _quant and _attention: kv_f16_to_f32_row (float16 scales as float32, in
# the C below) and kv_prefetch_lines (the cache lines of a run of bytes, into L2)
cdef extern from "_f16_prefetch.h":
    void kv_prefetch_lines(const char* p, ptrdiff_t n) noexcept nogil


cdef extern from *:
    """
    #include <math.h>
    #if defined(__AVX512F__)
    #include <immintrin.h>
    typedef __m512 kvg_v;
    #define KVG_W 16
    #define KVG_CV 4            /* column vectors per register block of the weighted sum */
    #define kvg_load _mm512_loadu_ps
    #define kvg_store _mm512_storeu_ps
    #define kvg_fma _mm512_fmadd_ps
    #define kvg_splat _mm512_set1_ps
    #define kvg_zero _mm512_setzero_ps
    #define kvg_maxv _mm512_max_ps    /* a lane NaN in the first: the second's */
    /* 16 bytes at p as 16 int32 lanes */
    #define kvg_widen(p) _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(p)))
    #define kvg_low4(x) _mm512_cvtepi32_ps(_mm512_and_si512(x, _mm512_set1_epi32(15)))
    #define kvg_high4(x) _mm512_cvtepi32_ps(_mm512_srli_epi32(x, 4))
    #elif defined(__AVX2__) && defined(__FMA__)
    #include <immintrin.h>
    typedef __m256 kvg_v;
    #define KVG_W 8
    #define KVG_CV 2
    #define kvg_load _mm256_loadu_ps
    #define kvg_store _mm256_storeu_ps
    #define kvg_fma _mm256_fmadd_ps
    #define kvg_splat _mm256_set1_ps
    #define kvg_zero _mm256_setzero_ps
    #define kvg_maxv _mm256_max_ps
    #define kvg_widen(p) _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(p)))
    #define kvg_low4(x) _mm256_cvtepi32_ps(_mm256_and_si256(x, _mm256_set1_epi32(15)))
    #define kvg_high4(x) _mm256_cvtepi32_ps(_mm256_srli_epi32(x, 4))
    #endif
    #define KVG_AI static inline __attribute__((always_inline))
    /* f(1), ..., f(4) for nr = 1 .. 4: the row count a constant of each copy */
    #define KVG_BY_ROWS(nr, f) switch (nr) { case 4: f(4); break; case 3: f(3); break; \\
                                             case 2: f(2); break; default: f(1); }

    /* The largest of s[0 .. n) (-inf for n = 0); NaN values are passed over (each a score
       past float32, which exp keeps NaN in the sum). */
    static inline float kvg_max(const float* s, Py_ssize_t n) {
        float mx = -INFINITY, part[16];
        Py_ssize_t j = 0;
    #ifdef KVG_W
        kvg_v m = kvg_splat(-INFINITY);
        for (; j + KVG_W <= n; j += KVG_W) m = kvg_maxv(kvg_load(s + j), m);   /* NaN: m */
        kvg_store(part, m);
        for (int i = 0; i < KVG_W; i++) mx = part[i] > mx ? part[i] : mx;
    #else
        (void)part;
    #endif
        for (; j < n; j++) mx = s[j] > mx ? s[j] : mx;
        return mx;
    }

    /* The (d, m) pairs of a q4_0 / q4_1 row's nb blocks as float32 dst [nb][2] from its
       float16 scales: q4_1's pairs as stored, q4_0's d as (d, -8 d) (exact: code * d - 8 d
       is (code - 8) * d). */
    static inline void kvg_q4_scales(const uint16_t* src, Py_ssize_t nb, int q41, float* dst) {
        if (q41) {
            kv_f16_to_f32_row(src, 2 * nb, dst);
            return;
        }
        kv_f16_to_f32_row(src, nb, dst + nb);
        for (Py_ssize_t b = 0; b < nb; b++) {
            dst[2 * b] = dst[nb + b];
            dst[2 * b + 1] = -8 * dst[nb + b];
        }
    }

    #ifdef KVG_W
    /* The 4-bit codes of KVG_W bytes at p, low nibbles and high nibbles, as code * d + m
       (one rounding; code * d is exact): OUT lo, hi. AVX-512: the 16 values c * d + m of
       the codes 0 .. 15 as a table (one multiply-add: each the value its code's own
       multiply-add gives) that the codes index (vpermps reads an index's low 4 bits: the
       low nibble as it is, the high one shifted down), as the attention kernel's
       kv_q4_halves. */
    KVG_AI void kvg_q4_pair(const uint8_t* p, float d, float m, kvg_v* lo, kvg_v* hi) {
        const __typeof__(kvg_widen(p)) x = kvg_widen(p);
    #if KVG_W == 16
        const __m512 table = _mm512_fmadd_ps(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11,
                                                             12, 13, 14, 15),
                                             kvg_splat(d), kvg_splat(m));
        *lo = _mm512_permutexvar_ps(x, table);
        *hi = _mm512_permutexvar_ps(_mm512_srli_epi32(x, 4), table);
    #else
        *lo = kvg_fma(kvg_low4(x), kvg_splat(d), kvg_splat(m));
        *hi = kvg_fma(kvg_high4(x), kvg_splat(d), kvg_splat(m));
    #endif
    }
    #endif

    /* The scores of NR (a constant, 1 .. 4) rows of q [NR][D] over one complete q4_1ch
       group: s[r * ss + t], t < 32. codes: the group's slot 0 of this head, slot j at
       codes + j * cs holding channels [j D/32, (j+1) D/32) of 16 bytes each (byte b:
       position b in its low nibble, 16 + b in its high one); dm: the group's (d, m) per
       channel as float32 [D][2]. Each channel's values decode in registers, code * d + m
       (one rounding: code * d is exact), KVG_W positions of the low and of the high
       nibbles at a time, and every row adds q_c times them (fused multiply-adds; per row
       and position one chain over c in order, whatever NR). pf / pfs: the next group's
       slot 0 codes / scales (scale slots pss apart), whose slot j is prefetched while
       slot j decodes (NULL: none). */
    KVG_AI void kvg_scores_rows(const float* q, Py_ssize_t D, const int NR, const uint8_t* codes,
                                Py_ssize_t cs, const float* dm, const float* lanes, const int DEC,
                                float* s, Py_ssize_t ss, const uint8_t* pf, const uint16_t* pfs,
                                Py_ssize_t pss) {
        const Py_ssize_t per = D / 32;
    #ifdef KVG_W
        for (int h = 0; h < 16; h += KVG_W) {   /* bytes [h, h + KVG_W) of each channel */
            kvg_v lo[4], hi[4];
            for (int r = 0; r < NR; r++) lo[r] = hi[r] = kvg_zero();
            for (Py_ssize_t j = 0; j < 32; j++) {
                const uint8_t* b = codes + j * cs + h;
                if (pf != NULL && h == 0) {
                    for (Py_ssize_t o = 0; o < 16 * per; o += 64) __builtin_prefetch(pf + j * cs + o);
                    __builtin_prefetch(pfs + j * pss);
                }
                for (Py_ssize_t i = 0; i < per; i++, b += 16) {
                    const Py_ssize_t c = j * per + i;
                    kvg_v vl, vh;
                    if (DEC) {      /* decoded once for all the rows (kvg_group_scores) */
                        vl = kvg_load(lanes + c * 32 + h);
                        vh = kvg_load(lanes + c * 32 + 16 + h);
                        __asm__("" : "+v"(vl), "+v"(vh));   /* loaded once for the NR rows */
                    } else {
                        kvg_q4_pair(b, dm[2 * c], dm[2 * c + 1], &vl, &vh);
                    }
                    for (int r = 0; r < NR; r++) {
                        const kvg_v qc = kvg_splat(q[r * D + c]);
                        lo[r] = kvg_fma(qc, vl, lo[r]);
                        hi[r] = kvg_fma(qc, vh, hi[r]);
                    }
                }
            }
            for (int r = 0; r < NR; r++) {
                kvg_store(s + r * ss + h, lo[r]);
                kvg_store(s + r * ss + 16 + h, hi[r]);
            }
        }
    #else
        (void)pf; (void)pfs; (void)pss; (void)lanes; (void)DEC;
        for (int r = 0; r < NR; r++)
            for (int t = 0; t < 32; t++) {
                float a = 0;
                for (Py_ssize_t c = 0; c < D; c++) {
                    const uint8_t byte = codes[(c / per) * cs + (c % per) * 16 + t % 16];
                    const float code = (float)(t < 16 ? byte & 15 : byte >> 4);
                    a = fmaf(q[r * D + c], code * dm[2 * c] + dm[2 * c + 1], a);
                }
                s[r * ss + t] = a;
            }
    #endif
    }

    #define KVG_DECODE_ROWS 8   /* more rows than this: a group is decoded once, into floats */

    /* s[r * ss + t] (t < 32): the scores of the R rows of q [R][D] over one complete
       group (kvg_scores_rows, rows 4 at a time); dm: scratch of 2 D floats; lanes: of D x
       32 floats. More than KVG_DECODE_ROWS rows (prefill): the group's values are decoded
       once into lanes [D][32] (the same values), which the row blocks load instead of
       decoding the codes each. */
    static void kvg_group_scores(const float* q, Py_ssize_t R, Py_ssize_t D, const uint8_t* codes,
                                 Py_ssize_t cs, const uint16_t* scales, Py_ssize_t scs, float* dm,
                                 float* lanes, float* s, Py_ssize_t ss, const uint8_t* pf,
                                 const uint16_t* pfs) {
        const Py_ssize_t per = D / 32;
        const int dec = R > KVG_DECODE_ROWS;
        for (Py_ssize_t j = 0; j < 32; j++) kv_f16_to_f32_row(scales + j * scs, 2 * per, dm + 2 * per * j);
    #ifdef KVG_W
        if (dec)
            for (Py_ssize_t c = 0; c < D; c++)
                for (int h = 0; h < 16; h += KVG_W) {
                    kvg_v lo, hi;
                    kvg_q4_pair(codes + (c / per) * cs + (c % per) * 16 + h, dm[2 * c], dm[2 * c + 1],
                                &lo, &hi);
                    kvg_store(lanes + c * 32 + h, lo);
                    kvg_store(lanes + c * 32 + 16 + h, hi);
                }
    #endif
        for (Py_ssize_t r = 0; r < R; r += 4) {
            const int nr = R - r < 4 ? (int)(R - r) : 4;
            const uint8_t* p = r == 0 ? pf : NULL;
            #define KVG_SCORES(NR) kvg_scores_rows(q + r * D, D, NR, codes, cs, dm, lanes, 0, s + r * ss, ss, p, pfs, scs)
            #define KVG_SCORES_DEC(NR) kvg_scores_rows(q + r * D, D, NR, codes, cs, dm, lanes, 1, s + r * ss, ss, p, pfs, scs)
            if (dec) { KVG_BY_ROWS(nr, KVG_SCORES_DEC) }
            else { KVG_BY_ROWS(nr, KVG_SCORES) }
            #undef KVG_SCORES
            #undef KVG_SCORES_DEC
        }
    }

    #ifdef KVG_W
    /* V's values in pairs of vectors: pair i of a row is its values [32 b + o, + KVG_W)
       ("low") and [32 b + 16 + o, + KVG_W) ("high"), b = i / KVG_PH, o = KVG_W (i % KVG_PH):
       for q4_0 / q4_1 the low and high nibbles of the same KVG_W code bytes. */
    #define KVG_PH (16 / KVG_W)      /* pairs per block of 32 values */

    /* acc[r * D + c] += w[r * ws + t] * v_t[c] (one rounding) for the NR (a constant, 1 .. 4)
       rows, t < m position by position, over the np (1 or KVG_CV / 2) pairs from pair i0:
       NR x 2 np accumulators held in registers across the m positions. Q4 (a constant):
       v_t decoded from rows[t] (q4_0 / q4_1 codes) with the (d, m) pairs dm [m][D / 16]
       (q4_0: (d, -8 d)), code * d + m (kvg_q4_pair); else v_t = vt + t * D, floats. */
    KVG_AI void kvg_value_block(float* acc, const float* w, Py_ssize_t ws, const float* vt,
                                const uint8_t* const* rows, const float* dm, Py_ssize_t m,
                                Py_ssize_t D, Py_ssize_t i0, const int NR, const int np,
                                const int Q4) {
        kvg_v a[4][KVG_CV], x[KVG_CV];
        Py_ssize_t col[KVG_CV];
        for (int k = 0; k < 2 * np; k++) {
            const Py_ssize_t i = i0 + k / 2;
            col[k] = 32 * (i / KVG_PH) + KVG_W * (i % KVG_PH) + 16 * (k % 2);
        }
        for (int r = 0; r < NR; r++)
            for (int k = 0; k < 2 * np; k++) a[r][k] = kvg_load(acc + r * D + col[k]);
        for (Py_ssize_t t = 0; t < m; t++) {
            for (int k = 0; k < 2 * np; k += 2) {
                if (Q4) {
                    const Py_ssize_t b = col[k] / 32;
                    kvg_q4_pair(rows[t] + 16 * b + col[k] % 16, dm[t * (D / 16) + 2 * b],
                                dm[t * (D / 16) + 2 * b + 1], &x[k], &x[k + 1]);
                } else {   /* loaded once for the NR rows (the empty asm keeps GCC from
                              folding the load into each row's FMA) */
                    x[k] = kvg_load(vt + t * D + col[k]);
                    x[k + 1] = kvg_load(vt + t * D + col[k + 1]);
                    __asm__("" : "+v"(x[k]), "+v"(x[k + 1]));
                }
            }
            for (int r = 0; r < NR; r++) {
                const kvg_v wr = kvg_splat(w[r * ws + t]);
                for (int k = 0; k < 2 * np; k++) a[r][k] = kvg_fma(wr, x[k], a[r][k]);
            }
        }
        for (int r = 0; r < NR; r++)
            for (int k = 0; k < 2 * np; k++) kvg_store(acc + r * D + col[k], a[r][k]);
    }

    /* The register blocks of the R rows (4 at a time) and of the D / 32 * KVG_PH pairs
       (KVG_CV / 2 at a time, the last block of one pair where they do not divide). */
    KVG_AI void kvg_value_blocks(float* acc, const float* w, Py_ssize_t ws, Py_ssize_t R,
                                 const float* vt, const uint8_t* const* rows, const float* dm,
                                 Py_ssize_t m, Py_ssize_t D, const int Q4) {
        const Py_ssize_t npairs = D / 32 * KVG_PH;
        for (Py_ssize_t r = 0; r < R; r += 4) {
            const int nr = R - r < 4 ? (int)(R - r) : 4;
            for (Py_ssize_t i = 0; i < npairs; i += KVG_CV / 2) {
                #define KVG_VALUES(NR) kvg_value_block(acc + r * D, w + r * ws, ws, vt, rows, dm, m, D, i, NR, KVG_CV / 2, Q4)
                #define KVG_VALUES1(NR) kvg_value_block(acc + r * D, w + r * ws, ws, vt, rows, dm, m, D, i, NR, 1, Q4)
                if (npairs - i >= KVG_CV / 2) { KVG_BY_ROWS(nr, KVG_VALUES) }
                else { KVG_BY_ROWS(nr, KVG_VALUES1) }
                #undef KVG_VALUES
                #undef KVG_VALUES1
            }
        }
    }
    #endif

    /* The weighted sum of one tile of V for R rows: acc[r * D + c] += w[r * ws + t] * v_t[c]
       for t < m, position by position (one rounding each: the order of a plain loop), D a
       multiple of 32. rows != NULL: V in q4_0 / q4_1, v_t decoded in registers from
       rows[t] with its (d, m) pairs dm [m][D / 16] as float32 (q4_0: (d, -8 d)); else
       v_t = vt + t * D, decoded floats [m][D]. */
    static void kvg_weighted_sum(float* acc, const float* w, Py_ssize_t ws, Py_ssize_t R,
                                 const float* vt, const uint8_t* const* rows, const float* dm,
                                 Py_ssize_t m, Py_ssize_t D) {
    #ifdef KVG_W
        if (rows != NULL) kvg_value_blocks(acc, w, ws, R, vt, rows, dm, m, D, 1);
        else kvg_value_blocks(acc, w, ws, R, vt, rows, dm, m, D, 0);
    #else
        for (Py_ssize_t r = 0; r < R; r++)
            for (Py_ssize_t c = 0; c < D; c++)
                for (Py_ssize_t t = 0; t < m; t++) {
                    const float* p = dm + t * (D / 16) + 2 * (c / 32);
                    const uint8_t byte = rows != NULL ? rows[t][c / 32 * 16 + c % 16] : 0;
                    const float v = rows == NULL ? vt[t * D + c]
                                    : (float)(c % 32 < 16 ? byte & 15 : byte >> 4) * p[0] + p[1];
                    acc[r * D + c] = fmaf(w[r * ws + t], v, acc[r * D + c]);
                }
    #endif
    }
    """
    void kvg_group_scores(const float* q, Py_ssize_t R, Py_ssize_t D, const uint8_t* codes,
                          Py_ssize_t cs, const uint16_t* scales, Py_ssize_t scs, float* dm,
                          float* lanes, float* s, Py_ssize_t ss, const uint8_t* pf,
                          const uint16_t* pfs) noexcept nogil
    enum: KVG_DECODE_ROWS
    void kvg_weighted_sum(float* acc, const float* w, Py_ssize_t ws, Py_ssize_t R,
                          const float* vt, const uint8_t* const* rows, const float* dm,
                          Py_ssize_t m, Py_ssize_t D) noexcept nogil
    void kvg_q4_scales(const uint16_t* src, Py_ssize_t nb, int q41, float* dst) noexcept nogil
    float kvg_max(const float* s, Py_ssize_t n) noexcept nogil


cdef inline float _dot(const float* x, const float* y, Py_ssize_t D) noexcept nogil:
    """sum x[c] y[c] over D (a multiple of 32) in 4 interleaved partial sums."""
    cdef float part[4]
    cdef Py_ssize_t c, i
    for i in range(4):
        part[i] = 0
    for c in range(0, D, 4):
        for i in range(4):
            part[i] = fmaf(x[c + i], y[c + i], part[i])
    return (part[0] + part[1]) + (part[2] + part[3])


cdef inline Py_ssize_t _row(const int32_t* table, Py_ssize_t ps, Py_ssize_t p) noexcept nogil:
    """The storage row of position p through a page table of pages of ps rows."""
    return <Py_ssize_t>table[p // ps] * ps + p % ps


cdef inline Py_ssize_t _scratch_floats(Py_ssize_t R, Py_ssize_t n, Py_ssize_t D) noexcept nogil:
    """Floats of scratch for R query rows over n positions: scaled queries [R][D],
    accumulators [R][D], scores [R][n rounded up to 32], a residual row [D], a tile of
    decoded V rows [V_TILE][D], a group's (d, m) pairs [D][2], a 4-bit V tile's
    [V_TILE][D / 16], a group's decoded values [D][32]."""
    return (2 * R * D + R * ((n + GROUP - 1) // GROUP * GROUP) + D + V_TILE * D + 2 * D
            + V_TILE * (D // 16) + D * GROUP)


cdef void _rows(const float* q, Py_ssize_t T, Py_ssize_t Hq, Py_ssize_t H, Py_ssize_t D,
               Py_ssize_t h, Py_ssize_t r0, Py_ssize_t r1, Py_ssize_t n, float scale,
               bint causal, const int32_t* table, Py_ssize_t ps,
               const uint8_t* kc, const uint16_t* ks, const uint16_t* res,
               int v_fmt, const char* vc, Py_ssize_t v_code_row, const char* vs,
               Py_ssize_t v_scale_row, const Variants* var, float* out,
               float* lse, float* work) noexcept nogil:
    """Attention of query rows [r0, r1) (at most ROWS) of kv head h of one sequence
    (module comment; row r is token r // G, query head h G + r % G): q [T, Hq, D] its
    tokens, n its positions, position p in storage row _row(table, ps, p), res its residual
    [32, Hkv, D]; OUT those rows of out [T, Hq, D] and lse [T, Hq] (NULL: not asked).
    work: _scratch_floats(r1 - r0, n, D) floats of scratch."""
    cdef Py_ssize_t G = Hq // H, R = r1 - r0, W = D // 2, S = D // 16
    cdef Py_ssize_t full = n - n % GROUP, r, p, p0, m, c, t, g, first, nxt, lo, sink_end
    # the positions any of the rows sees: [0, nv) (causal: up to the last row's token);
    # a row's scores ns apart (whole groups: the last one read may pass nv)
    cdef Py_ssize_t nv = n - T + (r1 - 1) // G + 1 if causal else n
    cdef Py_ssize_t ns = (nv + GROUP - 1) // GROUP * GROUP
    cdef float* qs = work               # the layout of _scratch_floats
    cdef float* acc = qs + R * D
    cdef float* s = acc + R * D
    cdef float* row = s + R * ns
    cdef float* vt = row + D
    cdef float* dm = vt + V_TILE * D
    cdef float* vdm = dm + 2 * D
    cdef float* lanes = vdm + V_TILE * S
    cdef const uint8_t* vrows[V_TILE]
    # 4-bit V decoded in registers per 4 rows, or for more rows (prefill) once per tile
    cdef bint v4 = (v_fmt == Q4_0 or v_fmt == Q4_1) and R <= KVG_DECODE_ROWS
    cdef const char* vsp
    cdef const uint8_t* nc
    cdef const uint16_t* nsc
    memset(acc, 0, R * D * sizeof(float))
    for r in range(R):
        t, g = (r0 + r) // G, (r0 + r) % G
        for c in range(D):
            qs[r * D + c] = q[(t * Hq + h * G + g) * D + c] * scale
    # with a window, the positions no row sees: [sink_end, lo) (their pages may be
    # released: -1 in the table); groups and tiles wholly inside are skipped
    lo = n - T + r0 // G + 1 - var.window if var.window and n - T + r0 // G + 1 > var.window else 0
    sink_end = min(var.sink_tokens, lo)
    for g in range(min(full, nv + GROUP - 1) // GROUP):
        p = g * GROUP
        if sink_end <= p and p + GROUP <= lo:
            continue
        first = _row(table, ps, p)      # a group's rows follow each other (ps % 32 == 0)
        nc = NULL
        nsc = NULL
        if p + GROUP < min(full, nv) and p + GROUP >= lo:  # the next group's rows,
            nxt = _row(table, ps, p + GROUP)    # prefetched a slot at a time
            nc = kc + (nxt * H + h) * W
            nsc = ks + (nxt * H + h) * S
        kvg_group_scores(qs, R, D, kc + (first * H + h) * W, H * W, ks + (first * H + h) * S,
                         H * S, dm, lanes, s + p, ns, nc, nsc)
    for p in range(full, nv):
        decode_row(F16, res + ((p - full) * H + h) * D, NULL, D, row)
        for r in range(R):
            s[r * ns + p] = _dot(qs + r * D, row, D)
    for r in range(R):
        t, g = (r0 + r) // G, (r0 + r) % G
        _softmax(s + r * ns, nv, n - T + t, causal, var, h * G + g,
                 lse + t * Hq + h * G + g if lse != NULL else NULL, qs + r * D)
    for g in range((nv + V_TILE - 1) // V_TILE):
        p0 = g * V_TILE
        m = min(V_TILE, nv - p0)
        if sink_end <= p0 and p0 + m <= lo:
            continue
        # a tile's rows follow each other (a page holds whole tiles: ps % 32 == 0, or one
        # page holds everything); the next tile's, prefetched row by row (H rows apart)
        first = _row(table, ps, p0)
        nxt = _row(table, ps, p0 + V_TILE) if p0 + V_TILE < nv and p0 + V_TILE >= lo else -1
        for t in range(m):              # the tile's V rows: decoded into vt [m][D], or
                                        # 4-bit: their codes and (d, m) pairs vdm [m][S]
            if nxt >= 0 and p0 + V_TILE + t < nv:
                kv_prefetch_lines(vc + ((nxt + t) * H + h) * v_code_row, v_code_row)
                if vs != NULL:
                    kv_prefetch_lines(vs + ((nxt + t) * H + h) * v_scale_row, v_scale_row)
            vsp = vs + ((first + t) * H + h) * v_scale_row if vs != NULL else NULL
            if v4:
                vrows[t] = <const uint8_t*>vc + ((first + t) * H + h) * v_code_row
                kvg_q4_scales(<const uint16_t*>vsp, D // GROUP, v_fmt == Q4_1, vdm + t * S)
            else:
                decode_row(v_fmt, vc + ((first + t) * H + h) * v_code_row, vsp, D, vt + t * D)
        kvg_weighted_sum(acc, s + p0, ns, R, vt, vrows if v4 else NULL, vdm, m, D)
    for r in range(R):
        t, g = (r0 + r) // G, (r0 + r) % G
        for c in range(D):
            out[(t * Hq + h * G + g) * D + c] = acc[r * D + c] * qs[r * D]


def attend_grouped(const float[:, :, ::1] q, const uint8_t[:, :, ::1] k_codes,
                   const uint16_t[:, :, ::1] k_scales, const uint64_t[::1] residuals,
                   cnp.ndarray v_codes, v_scales, int v_fmt, Py_ssize_t page_size,
                   const int32_t[:, ::1] tables, const int64_t[::1] lengths,
                   const int64_t[::1] counts, float scale, bint causal,
                   float[:, :, ::1] out, float[:, ::1] lse=None, *, int64_t window=0,
                   int64_t sink_tokens=0, const float[::1] sinks=None,
                   float softcap=0) -> None:
    """Attention of B sequences (a KVCache: B = 1, one page of N rows, table [[0]]).
    q float32 [sum counts, Hq, D]: rows [c_b, c_b + counts[b]) are sequence b's tokens
    (c_b the sum of the counts before b); k_codes uint8 [rows, Hkv, D/2] and k_scales
    float16 bits uint16 [rows, Hkv, D/16]; residuals uint64 [B]: the address of sequence
    b's residual float16 [32, Hkv, D] of this layer (C-contiguous, alive for the call);
    v_codes [rows, Hkv, W] and v_scales [rows, Hkv, S] (or None) in V's format v_fmt;
    tables int32 [B, M]: sequence b's pages, position p in row
    tables[b, p / page_size] * page_size + p % page_size (page_size % 32 == 0 unless one
    page holds everything); lengths int64 [B]: its positions n_b (>= counts[b] when causal,
    >= 1 with queries); OUT out float32 [sum counts, Hq, D], lse float32 [sum counts, Hq]
    or None. Variants (docs/variants.md; 0 / None: off): window, sink_tokens, sinks
    float32 [Hq], softcap. The caller checked every shape, dtype and value."""
    cdef Py_ssize_t B = tables.shape[0], Hq = q.shape[1], D = q.shape[2], H = k_codes.shape[1]
    cdef Py_ssize_t G = Hq // H, b, h, item, r0
    cdef const char* vc = cnp.PyArray_BYTES(v_codes)
    cdef Py_ssize_t v_code_row = v_codes.shape[2] * v_codes.itemsize
    cdef const char* vs = NULL
    cdef Py_ssize_t v_scale_row = 0
    if v_scales is not None:
        vs = cnp.PyArray_BYTES(<cnp.ndarray>v_scales)
        v_scale_row = v_scales.shape[2] * v_scales.itemsize
    cdef float* lp = NULL if lse is None else &lse[0, 0]
    cdef int64_t[::1] first = np.zeros(B, np.int64)      # each sequence's first query row
    for b in range(1, B):
        first[b] = first[b - 1] + counts[b - 1]
    # work items: (sequence, kv head, ROWS query rows of it), the last rows first (causal:
    # they see the most positions)
    # (item k of sequence b's H * c_b: kv head k // c_b, chunk c_b - 1 - k % c_b)
    chunks = (np.asarray(counts) * G + ROWS - 1) // ROWS
    per_seq = chunks * H
    cdef int64_t[::1] item_b = np.repeat(np.arange(B, dtype=np.int64), per_seq)
    k = np.arange(len(item_b), dtype=np.int64) - np.repeat(np.cumsum(per_seq) - per_seq, per_seq)
    c = np.repeat(chunks, per_seq)
    cdef int64_t[::1] item_h = k // c
    cdef int64_t[::1] item_r0 = (c - 1 - k % c) * ROWS
    cdef Variants var
    var.window, var.sink_tokens, var.softcap = window, sink_tokens, softcap
    var.sinks = NULL if sinks is None else &sinks[0]
    cdef int nt = min(num_threads(), <int>max(1, len(item_b)))
    cdef Py_ssize_t rows = min(ROWS, np.asarray(counts).max(initial=0) * G)
    cdef Py_ssize_t longest = np.asarray(lengths).max(initial=0)
    cdef Py_ssize_t per = _scratch_floats(rows, longest, D)
    cdef float* work = <float*>malloc(nt * per * sizeof(float))
    if work == NULL:
        raise MemoryError(f"decode attention (K q4_1ch): {nt} x {per} floats of scratch "
                          f"({rows} query rows over {longest} positions)")
    with nogil:
        for item in prange(item_b.shape[0], num_threads=nt, schedule="dynamic"):
            b, h, r0 = item_b[item], item_h[item], item_r0[item]
            _rows(&q[first[b], 0, 0], counts[b], Hq, H, D, h, r0,
                  min(r0 + ROWS, counts[b] * G), lengths[b], scale, causal, &tables[b, 0],
                  page_size, &k_codes[0, 0, 0], &k_scales[0, 0, 0],
                  <const uint16_t*>residuals[b], v_fmt, vc, v_code_row, vs, v_scale_row,
                  &var, &out[first[b], 0, 0], lp + first[b] * Hq if lp != NULL else NULL,
                  work + threadid() * per)
    free(work)
