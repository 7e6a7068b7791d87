# cython: language_level=3
"""CPU decode attention that reads the stored codes of every format, and RoPE.

1. `attend` takes q float32 [T, Hq, D] and one layer's storage as it lies in a KVCache:
   codes [N, Hkv, D] (the format's code dtype) and scales [N, Hkv, S] (or None), all
   C-contiguous; n positions are valid. Query token t sees positions [0, n - T + t]
   (causal) or [0, n). Query head i reads K/V head i // G (G = Hq / Hkv); the R = T * G
   query rows of a group are scaled and zero-padded to Dp (D rounded up to 16).
   `attend_paged` does the same for many sequences of a KVPool in one call: one job per
   sequence, position p of a job in storage row table[p / ps] * ps + p % ps. A KVCache
   is the one-job case with the table [0] and ps = N: one code path.
2. Splits (split-wise jobs: at most 128 query rows per kv head, decode): each thread
   takes a contiguous range of positions over every kv head (equal
   ranges, multiples of 16), so it streams through the token-major storage in address
   order. It walks its range in tiles of KV_P positions; per tile and head: the scores of
   the R rows, an online-softmax update (running max m, lane sums l, float32), then the
   weighted sum of the tile's V rows into R float32 accumulators. Each K/V row is read
   once per group. Tiles are 64 logical positions whatever the pages (a tile looks up
   the row of each position, `kv_tile`), so the result never depends on where a row is
   stored. Split-wise, the next tile's codes (its runs of consecutive rows) are prefetched a few
   lines at a time between the current tile's score blocks, so the prefetches overlap
   the arithmetic; a split's first tile is prefetched in one burst, the next tile's
   scales in one burst as soon as its rows are known. The (job, split)
   items of a call share the threads (`_run`). The splits follow num_threads(); a call of
   fewer than 4 items per thread runs them on run_threads() (fewer while other processes
   keep the cores busy: one thread then runs several splits, the same bits), since one
   parked thread would hold up the call; more items are taken as threads come free.
3. Vectors are KV_W float32 lanes (GCC vector extensions): 16 (zmm) with AVX-512, 8 (ymm)
   otherwise, since GCC 12 keeps a vector wider than any register on the stack. Codes are
   dequantized in registers, KV_W at a time: int8/q8_0 widen and convert; q4_0/q4_1 widen
   KV_W bytes of a block once for both its halves, their low and high nibbles (ggml's
   order; kv_q4_halves); bf16 widens and shifts; f16 through F16C; fp8_e5m2 `c << 8` is
   an f16; fp8_e4m3 `(c << 7) & 0xbf80` (c sign-extended) is an f16 of value / 2^8. Widening loads, F16C and FMA are
   intrinsics under #if, with plain vector code where the ISA lacks them. No float copy
   of the cache is made.
4. Scales: int8/FP8 row scales (times 2^8 for e4m3) multiply a whole vector of KV_W
   scores (K) or softmax weights (V), from a per-tile transposed copy; q8_0 block scales
   (converted to float32 once per tile) multiply the decoded vectors; q4_0's, made
   (d, -8 d) pairs per tile, give q d - 8 d and q4_1's (d, m) pairs q d + m, one
   multiply-add each (exact products). With AVX-512 those multiply-adds run once per
   block on the codes 0 .. 15, and the block's codes index that table of 16 values
   (vpermps: both halves of a block from one widen; kv_q4_halves), the same values.
5. Scores: a register block of 4 query rows x KV_PB K rows accumulates over D; the KV_W
   dot products of one row with KV_W K rows are reduced by one transpose-add tree into a
   vector of KV_W scores (K rows taken in the tree's leaf order, so lane L is position L);
   a group of KV_W positions of 4 rows is a function of its own per format
   (kv_score_group_full), so that its loop has the general registers to itself.
   V: a register block of 4 rows x KV_CB column vectors walks the tile's positions (in
   passes of KV_VJ = 8 positions over all columns where rows lie a multiple of 4 KiB apart).
   exp is a vectorised Cephes polynomial (about 2 ulp); masked positions weigh 0.
   Row-wise jobs (more than KV_SPLIT_ROWS = 128 rows per kv head: prefill) run as work
   items of KV_ROWS = 256 rows instead: the rows in the vector lanes (q^T [D][KV_RS]),
   scores as FMAs of
   q^T rows with broadcast K values (KV_BP positions x KV_SV row vectors), each K/V tile
   decoded once per block; a block walks every split in turn, skips the tiles after its
   last visible position (the causal mask hides them from all its rows) and merges its
   rows itself; the threads take the blocks as they come free (kv_block_fmt). While a
   head's scores run, the next head's K and V rows (after the last head, the next tile's
   first head's) are prefetched, a share per score block (kv_prefetch_head).
   K and V may be stored in different formats (a K/V pair): the scores decode K's codes,
   the weighted sums V's, each through its own format's copy of the code (one copy per
   format, switched per tile and head); K and V in one format keep one kernel with the
   format a constant (KV_BY_FORMATS).
6. The splits are merged with a log-sum-exp reduction into the workspace (and, when
   asked, each row's log-sum-exp M + log L, natural log, into lse), then copied to out
   [T, Hq, D] only when every value of the call is finite: a score or a weighted sum of
   V past float32 (exp keeps NaN lanes NaN) refuses the call with out untouched.
7. `rope` rotates float32 [T, H, D] in place; angles in float64.
8. Int8 scores (`int8_scores`, opt-in; K int8, q8_0, q4_0 or q4_1): the scaled query rows quantized
   per block of 32 (kv_quant_row, `quantize_query`), the scores integer dot products of
   the codes (vpdpbusd with AVX-512 VNNI / AVX-VNNI, vpmaddubsw with AVX2, else int32
   multiplies) times the blocks' scales in float32 (kv_qscore_step); the weighted sum of
   V unchanged.
"""
from libc.math cimport cos, sin
from libc.stdint cimport int32_t, int64_t, uint64_t
from libc.stdlib cimport calloc
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy
from cython.parallel cimport prange, threadid

cimport numpy as cnp
import numpy as np

from kvcore._parallel cimport num_threads, run_threads, threads_for

cnp.import_array()

# kv_prefetch_lines (the cache lines of a run of bytes, into L2), used by the C below: C
# shared with _grouped
cdef extern from "_f16_prefetch.h":
    pass

cdef extern from *:
    """
    #include <math.h>
    #include <stdint.h>
    #include <stdlib.h>
    #include <string.h>
    #if defined(__AVX2__) || defined(__F16C__) || defined(__FMA__) || defined(__AVX512F__)
    #include <immintrin.h>
    #endif

    #define KV_INLINE static inline __attribute__((always_inline))
    enum { KV_F32, KV_F16, KV_BF16, KV_INT8, KV_E4M3, KV_E5M2, KV_Q8_0, KV_Q4_0, KV_Q4_1 };
    #define KV_EACH_FORMAT(X) X(KV_F32) X(KV_F16) X(KV_BF16) X(KV_INT8) X(KV_E4M3) \
                              X(KV_E5M2) X(KV_Q8_0) X(KV_Q4_0) X(KV_Q4_1)
    #define KV_ROW_SCALED(fmt) ((fmt) == KV_INT8 || (fmt) == KV_E4M3 || (fmt) == KV_E5M2)
    /* ggml's blocks of 32 values with float16 scales (q4_1: d, m pairs) */
    #define KV_BLOCKED(fmt) ((fmt) == KV_Q8_0 || (fmt) == KV_Q4_0 || (fmt) == KV_Q4_1)
    #define KV_Q4(fmt) ((fmt) == KV_Q4_0 || (fmt) == KV_Q4_1)
    #define KV_P 64            /* positions per tile (a multiple of 16) */
    #define KV_RB 4            /* query rows per register block */
    #define KV_VR 6            /* rows per value register block of a row-wise tile (kv_tile_values) */
    /* V rows per pass over the columns when rows lie a multiple of 4 KiB apart (f32 at
       Hkv = 8, D = 128): such rows share one L1 set, 8 ways, so a pass over all the
       tile's rows would evict each line before the next column block reads it again. */
    #define KV_VJ 8
    /* Lanes per vector: the widest registers (GCC 12 keeps a 16-lane vector that has no
       register of its size on the stack, so AVX2 gets 8 lanes), and the register blocks
       that fit 32 (AVX-512) or 16 registers. */
    /* KV_PIN(v): v stays in a register from here (an empty asm that "changes" it), so GCC
       does not fold its load into each use; nothing where a vector of KV_W floats is wider
       than one register (a build without AVX: two SSE registers) */
    #if defined(__AVX__)
    #define KV_PIN(v) __asm__("" : "+v"(v))
    #else
    #define KV_PIN(v) ((void)0)
    #endif
    #if defined(__AVX512F__)
    #define KV_W 16
    #define KV_PB 4            /* K rows per score register block: leaves of the tree */
    #define KV_CB 4            /* column vectors per V register block */
    #define KV_REP(x) {x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}
    #define KV_LANES {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}
    #else
    #define KV_W 8
    #define KV_PB 2
    #define KV_CB 2
    #define KV_REP(x) {x, x, x, x, x, x, x, x}
    #define KV_LANES {0, 1, 2, 3, 4, 5, 6, 7}
    #endif
    /* Prefetch bursts per score register block (kv_prefetch): one per 2 K rows, so a
       burst covers as few lines with 4 K rows per block as with 2 (bursts twice as
       large made f16/bf16 1.3-1.4x slower past the LLC on a Zen 4 core, docs/attention.md). */
    #define KV_PFB (KV_PB / 2)

    typedef float kv_vf __attribute__((vector_size(4 * KV_W)));      /* KV_W float32 */
    typedef int32_t kv_vi __attribute__((vector_size(4 * KV_W)));
    typedef uint32_t kv_vu __attribute__((vector_size(4 * KV_W)));
    typedef uint16_t kv_vh __attribute__((vector_size(2 * KV_W)));   /* KV_W uint16 */
    typedef int16_t kv_vs __attribute__((vector_size(2 * KV_W)));
    typedef int8_t kv_vb __attribute__((vector_size(KV_W)));         /* KV_W int8 */
    typedef uint8_t kv_vub __attribute__((vector_size(KV_W)));

    KV_INLINE kv_vf kv_splat(float x) { return (kv_vf)KV_REP(x); }
    KV_INLINE kv_vf kv_loadf(const float* p) { kv_vf v; memcpy(&v, p, sizeof v); return v; }
    KV_INLINE void kv_storef(float* p, kv_vf v) { memcpy(p, &v, sizeof v); }
    KV_INLINE kv_vf kv_max(kv_vf a, kv_vf b) { kv_vi g = a > b; return (kv_vf)((g & (kv_vi)a) | (~g & (kv_vi)b)); }

    /* a * b + c, fused where the CPU has FMA (the build passes -ffp-contract=off). */
    KV_INLINE kv_vf kv_fma(kv_vf a, kv_vf b, kv_vf c) {
    #if KV_W == 16
        return (kv_vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
    #elif defined(__FMA__)
        return (kv_vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
    #else
        return a * b + c;
    #endif
    }

    /* Widening loads of KV_W codes at p (GCC 12 scalarizes the generic conversions). */
    KV_INLINE kv_vi kv_widen_i8_i32(const char* p) {
    #if KV_W == 16
        return (kv_vi)_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p));
    #elif defined(__AVX2__)
        return (kv_vi)_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p));
    #else
        kv_vb b; memcpy(&b, p, sizeof b); return __builtin_convertvector(b, kv_vi);
    #endif
    }
    KV_INLINE kv_vu kv_widen_u16_u32(const char* p) {
    #if KV_W == 16
        return (kv_vu)_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p));
    #elif defined(__AVX2__)
        return (kv_vu)_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p));
    #else
        kv_vh h; memcpy(&h, p, sizeof h); return __builtin_convertvector(h, kv_vu);
    #endif
    }
    KV_INLINE kv_vh kv_widen_i8_i16(const char* p) {   /* sign-extended, as uint16 bits */
    #if KV_W == 16
        return (kv_vh)_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)p));
    #elif defined(__AVX2__)
        return (kv_vh)_mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i*)p));
    #else
        kv_vb b; memcpy(&b, p, sizeof b); return (kv_vh)__builtin_convertvector(b, kv_vs);
    #endif
    }
    KV_INLINE kv_vi kv_widen_u8_i32(const char* p) {
    #if KV_W == 16
        return (kv_vi)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
    #elif defined(__AVX2__)
        return (kv_vi)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p));
    #else
        kv_vub b; memcpy(&b, p, sizeof b); return __builtin_convertvector(b, kv_vi);
    #endif
    }
    KV_INLINE kv_vh kv_widen_u8_u16(const char* p) {
    #if KV_W == 16
        return (kv_vh)_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)p));
    #elif defined(__AVX2__)
        return (kv_vh)_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i*)p));
    #else
        kv_vub b; memcpy(&b, p, sizeof b); return __builtin_convertvector(b, kv_vh);
    #endif
    }

    /* KV_W IEEE binary16 bit patterns -> float32, exact for finite values. */
    KV_INLINE kv_vf kv_half(kv_vh h) {
    #if KV_W == 16
        return (kv_vf)_mm512_cvtph_ps((__m256i)h);
    #elif defined(__F16C__)
        return (kv_vf)_mm256_cvtph_ps((__m128i)h);
    #else
        kv_vu u = __builtin_convertvector(h, kv_vu);
        return (kv_vf)(((u & 0x7FFF) << 13) | ((u & 0x8000) << 16)) * kv_splat(0x1p112f);
    #endif
    }

    /* The 4-bit codes (q4_0 / q4_1, 0..15) of values [i, i + KV_W) of a row at p, two per
       byte in ggml's order: value i is in byte (i % 16) of block i / 32 (16 bytes), its
       low nibble when i % 32 < 16, else its high one. i is a multiple of KV_W (8 or 16):
       one vector lies in one half of a block, and d % 32 == 0 (no tail). */
    KV_INLINE kv_vi kv_codes4(const char* p, int i) {
        const kv_vi c = kv_widen_u8_i32(p + (size_t)(i / 32) * 16 + i % 16);
        return i & 16 ? c >> 4 : c & 15;
    }

    /* Values [i, i + KV_W) of a row of d codes at p as float32, unscaled (fp8_e4m3: the
       value / 2^8), every format but the 4-bit ones (kv_q4_halves). `tail` (a constant):
       i + KV_W passes d; values past d read as 0. */
    KV_INLINE kv_vf kv_load(const int fmt, const int tail, const char* p, int i, int d) {
        const int cb = fmt == KV_F32 ? 4 : fmt <= KV_BF16 ? 2 : 1;
        char tmp[4 * KV_W];
        p += (size_t)i * cb;
    #if KV_W == 16 && defined(__AVX512BW__) && defined(__AVX512VL__)
        /* masked loads (lanes past d read as 0): the memcpy below is a call, which would
           make GCC keep the caller's accumulators in memory (every vector register is
           caller-saved) */
        if (tail) {
            const __mmask16 m = (__mmask16)((1u << (d - i)) - 1);
            switch (fmt) {
            case KV_F32: return (kv_vf)_mm512_maskz_loadu_ps(m, p);
            case KV_F16: return kv_half((kv_vh)_mm256_maskz_loadu_epi16(m, p));
            case KV_BF16: return (kv_vf)((kv_vu)_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)) << 16);
            case KV_E4M3: return kv_half(((kv_vh)_mm256_cvtepi8_epi16(_mm_maskz_loadu_epi8(m, p)) << 7) & 0xBF80);
            case KV_E5M2: return kv_half((kv_vh)_mm256_cvtepu8_epi16(_mm_maskz_loadu_epi8(m, p)) << 8);
            default: return __builtin_convertvector((kv_vi)_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, p)), kv_vf);
            }
        }
    #endif
        if (tail) {
            memset(tmp, 0, sizeof tmp);
            memcpy(tmp, p, (size_t)(d - i) * cb);
            p = tmp;
        }
        switch (fmt) {
        case KV_F32: return kv_loadf((const float*)p);
        case KV_F16: { kv_vh h; memcpy(&h, p, sizeof h); return kv_half(h); }
        case KV_BF16: return (kv_vf)(kv_widen_u16_u32(p) << 16);
        case KV_E4M3: return kv_half((kv_widen_i8_i16(p) << 7) & 0xBF80);
        case KV_E5M2: return kv_half(kv_widen_u8_u16(p) << 8);
        default: return __builtin_convertvector(kv_widen_i8_i32(p), kv_vf);   /* int8, q8_0 */
        }
    }

    /* q4_0 / q4_1: values [32 b + h, + KV_W) (lo) and [32 b + 16 + h, + KV_W) (hi) of a
       row at p, h < 16 a multiple of KV_W: the low and high nibbles of the same KV_W bytes
       (ggml's order), widened once, under the block's scale pair ((d, -8 d) or (d, m) at
       bs[2 b]): c d + (-8 d) and c d + m, one multiply-add each. c d and 8 d are exact in
       float32 (a 4-bit integer times a float16 value), so they round once, exactly as
       kvcore.dequantize's (c - 8) * d and c * d + m: the same values. AVX-512 (h 0): the
       block's 16 values c d + m as a table (one multiply-add of 0 .. 15: each value
       exactly the one its code's own multiply-add gives) that the codes index (vpermps
       reads the low 4 bits of each lane: the low nibble as it is, the high one shifted
       down); one widen, one multiply-add, a shift and two permutes where two widens, a
       mask, a shift, two conversions and two multiply-adds were. */
    KV_INLINE void kv_q4_halves(const char* p, int b, int h, const float* bs, kv_vf* lo, kv_vf* hi) {
        const kv_vi c = kv_widen_u8_i32(p + (size_t)b * 16 + h);
        const kv_vf d = kv_splat(bs[2 * b]), m = kv_splat(bs[2 * b + 1]);
    #if KV_W == 16
        const __m512 table = (__m512)kv_fma(__builtin_convertvector((kv_vi)KV_LANES, kv_vf), d, m);
        *lo = (kv_vf)_mm512_permutexvar_ps((__m512i)c, table);
        *hi = (kv_vf)_mm512_permutexvar_ps((__m512i)(c >> 4), table);
    #else
        *lo = kv_fma(__builtin_convertvector(c & 15, kv_vf), d, m);
        *hi = kv_fma(__builtin_convertvector(c >> 4, kv_vf), d, m);
    #endif
    }

    /* Values [i, i + KV_W) of a row at p as their block makes them (bs: the row's float32
       block scales; NULL for other formats): kv_load, times d for q8_0 (d = bs[i / 32]);
       4-bit: one half of kv_q4_halves. */
    KV_INLINE kv_vf kv_decode(const int fmt, const int tail, const char* p, int i, int d, const float* bs) {
        if (KV_Q4(fmt)) {
            kv_vf lo, hi;
            kv_q4_halves(p, i / 32, i % 16, bs, &lo, &hi);
            return i & 16 ? hi : lo;
        }
        const kv_vf x = kv_load(fmt, tail, p, i, d);
        return fmt == KV_Q8_0 ? x * kv_splat(bs[i / 32]) : x;
    }

    /* dst[k] = the f16 values at src[k] as float32, k < n. */
    static void kv_halves(const char* src, int n, float* dst) {
        int k = 0;
        for (; k + KV_W <= n; k += KV_W) { kv_vh h; memcpy(&h, src + 2 * k, sizeof h); kv_storef(dst + k, kv_half(h)); }
        if (k < n) {
            kv_vh h = {0};
            memcpy(&h, src + 2 * k, (size_t)(n - k) * 2);
            kv_vf f = kv_half(h);
            memcpy(dst + k, &f, (size_t)(n - k) * 4);
        }
    }

    /* One level of the transpose-add tree: in each block of 2w lanes, the first w lanes
       get x's pairwise sums (lane + lane w further, or for w <= 2 neighbouring lanes) and
       the next w lanes y's. The levels w = KV_W / 2, ..., 2, 1 turn KV_W vectors into one
       vector of their KV_W horizontal sums, vector k in lane KV_LEAF_LANE[k]. */
    KV_INLINE kv_vf kv_comb(kv_vf x, kv_vf y, const int w) {
    #if KV_W == 16
        switch (w) {
        case 8: return __builtin_shufflevector(x, y, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
                     + __builtin_shufflevector(x, y, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
        case 4: return __builtin_shufflevector(x, y, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27)
                     + __builtin_shufflevector(x, y, 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
        case 2: return __builtin_shufflevector(x, y, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29)
                     + __builtin_shufflevector(x, y, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
        default: return __builtin_shufflevector(x, y, 0, 2, 16, 18, 4, 6, 20, 22, 8, 10, 24, 26, 12, 14, 28, 30)
                      + __builtin_shufflevector(x, y, 1, 3, 17, 19, 5, 7, 21, 23, 9, 11, 25, 27, 13, 15, 29, 31);
        }
    #else
        switch (w) {
        case 4: return __builtin_shufflevector(x, y, 0, 1, 2, 3, 8, 9, 10, 11)
                     + __builtin_shufflevector(x, y, 4, 5, 6, 7, 12, 13, 14, 15);
        case 2: return __builtin_shufflevector(x, y, 0, 1, 8, 9, 4, 5, 12, 13)
                     + __builtin_shufflevector(x, y, 2, 3, 10, 11, 6, 7, 14, 15);
        default: return __builtin_shufflevector(x, y, 0, 2, 8, 10, 4, 6, 12, 14)
                      + __builtin_shufflevector(x, y, 1, 3, 9, 11, 5, 7, 13, 15);
        }
    #endif
    }
    #if KV_W == 16
    static const unsigned char KV_LEAF_LANE[16] = {0, 8, 4, 12, 1, 9, 5, 13, 2, 10, 6, 14, 3, 11, 7, 15};
    #else
    static const unsigned char KV_LEAF_LANE[8] = {0, 4, 1, 5, 2, 6, 3, 7};
    #endif

    /* The levels w, w / 2, ... of the tree over v[0 .. n) (n a power of two); returns v[0]. */
    KV_INLINE kv_vf kv_tree(kv_vf* v, const int n, const int w) {
        #pragma GCC unroll 4
        for (int k = n, s = w; k > 1; k /= 2, s /= 2)
            #pragma GCC unroll 8
            for (int a = 0; a < k / 2; a++) v[a] = kv_comb(v[2 * a], v[2 * a + 1], s);
        return v[0];
    }

    KV_INLINE float kv_hmax(kv_vf v) {
    #if KV_W == 16
        v = kv_max(v, __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
        v = kv_max(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
        v = kv_max(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
        v = kv_max(v, __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));
    #else
        v = kv_max(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3));
        v = kv_max(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5));
        v = kv_max(v, __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6));
    #endif
        return v[0];
    }

    /* exp(x) for KV_W lanes, x <= 88 (Cephes expf); lanes below -87.3 (and -inf) give 0,
       NaN lanes (a score that overflowed float32) stay NaN, so that the result shows it. */
    KV_INLINE kv_vf kv_exp(kv_vf x) {
        kv_vi keep = ~(x < kv_splat(-87.3f));
        x = (kv_vf)((kv_vi)x & keep);   /* dropped lanes compute exp(0), then masked */
        kv_vf t = kv_fma(x, kv_splat(1.44269504088896341f), kv_splat(12582912.0f));
        kv_vf n = t - kv_splat(12582912.0f);   /* round to nearest */
        kv_vi e = ((kv_vi)t - 0x4B400000 + 127) << 23;
        kv_vf r = kv_fma(n, kv_splat(-0.693359375f), x);
        r = kv_fma(n, kv_splat(2.12194440e-4f), r);
        kv_vf y = kv_splat(1.9875691500e-4f);
        y = kv_fma(y, r, kv_splat(1.3981999507e-3f));
        y = kv_fma(y, r, kv_splat(8.3334519073e-3f));
        y = kv_fma(y, r, kv_splat(4.1665795894e-2f));
        y = kv_fma(y, r, kv_splat(1.6666665459e-1f));
        y = kv_fma(y, r, kv_splat(5.0000001201e-1f));
        y = kv_fma(y, r * r, r + kv_splat(1.0f));
        return (kv_vf)((kv_vi)(y * (kv_vf)e) & keep);
    }

    /* c tanh(s / c) for KV_W scores s (soft-capping; ic = 1 / c as float32), within a few
       float32 ulp of the float64 value: tanh(x) = x P(x^2) / Q(x^2), Eigen's rational
       approximation (numerator degree 13, denominator 6; relative error 1.3e-7 in exact
       arithmetic), x held to +-7.9988117 (+-7.9053111 without FMA: where the float32
       evaluation reaches 1, as Eigen's generic_fast_tanh_float), so a saturated score is
       +-c exactly. One division and about 15 other operations per vector: Cephes' tanhf
       (an exp, two divisions and a polynomial for small x, blended) took twice as long,
       for 1.4 ulp instead of 5 at most. Lanes whose score is not finite (a score
       past float32, or a masked lane's -inf) become NaN: the caller masks its lanes again
       afterwards, and a visible score that overflowed refuses the call as it would
       uncapped. */
    KV_INLINE kv_vf kv_softcap(kv_vf s, float c, float ic) {
    #if KV_W == 16 || defined(__FMA__)
        const float top = 7.99881172180175781f;   /* with FMAs */
    #else
        const float top = 7.90531110763549805f;
    #endif
        kv_vf x = s * kv_splat(ic);
    #if KV_W == 16   /* min, then max: a NaN lane becomes top (NaN again below) */
        x = (kv_vf)_mm512_max_ps(_mm512_min_ps((__m512)x, _mm512_set1_ps(top)), _mm512_set1_ps(-top));
    #elif defined(__AVX__)
        x = (kv_vf)_mm256_max_ps(_mm256_min_ps((__m256)x, _mm256_set1_ps(top)), _mm256_set1_ps(-top));
    #else
        kv_vi hi = x > kv_splat(top), lo = x < kv_splat(-top);
        x = (kv_vf)(((kv_vi)x & ~(hi | lo)) | ((kv_vi)kv_splat(top) & hi) | ((kv_vi)kv_splat(-top) & lo));
    #endif
        kv_vf z = x * x;
        kv_vf p = kv_fma(kv_splat(-2.76076847742355e-16f), z, kv_splat(2.00018790482477e-13f));
        p = kv_fma(p, z, kv_splat(-8.60467152213735e-11f));
        p = kv_fma(p, z, kv_splat(5.12229709037114e-08f));
        p = kv_fma(p, z, kv_splat(1.48572235717979e-05f));
        p = kv_fma(p, z, kv_splat(6.37261928875436e-04f));
        p = kv_fma(p, z, kv_splat(4.89352455891786e-03f));
        kv_vf qd = kv_fma(kv_splat(1.19825839466702e-06f), z, kv_splat(1.18534705686654e-04f));
        qd = kv_fma(qd, z, kv_splat(2.26843463243900e-03f));
        qd = kv_fma(qd, z, kv_splat(4.89352518554385e-03f));
        return (p * x) / qd * kv_splat(c) + (s - s);   /* s - s: 0, or NaN where s is not finite */
    }

    /* x - j0 held to [0, KV_P] (a bound within a tile of KV_P positions from j0). */
    KV_INLINE int32_t kv_rel(int64_t x, int64_t j0) {
        const int64_t t = x - j0;
        return (int32_t)(t < 0 ? 0 : t > KV_P ? KV_P : t);
    }

    /* One side of a layer's storage, K or V, in its own format (a K/V pair: two). */
    typedef struct {
        const char* c;           /* codes of storage row 0, head 0 */
        const char* sc;          /* scales of storage row 0, head 0 (NULL without scales) */
        ptrdiff_t cs, ch;        /* code bytes between rows (all heads), between heads */
        ptrdiff_t ss, sh;        /* scale bytes between rows, between heads */
        int fmt, s;              /* format id, scales per row */
    } kv_side;

    /* The attention of one sequence's new tokens (attend fills one per sequence). */
    typedef struct {
        kv_side k, v;            /* K's storage (the scores) and V's (the weighted sums) */
        int d, dp;               /* head dim, d rounded up to 16 */
        int hkv, g, t, r;        /* kv heads, group size, new tokens, rows per group (t * g) */
        const int32_t* table;    /* page of each page_size positions: position p is storage */
        int64_t ps;              /*   row table[p / ps] * ps + p % ps */
        int64_t n;               /* positions held */
        int64_t lo;              /* the first position any row sees past the sink positions:
                                    the window's splits cover [lo, n) (0 without a window) */
        int64_t sa;              /* sink positions below lo, [0, sa): one split of their own
                                    after the window's (0: none) */
        int64_t chunk;           /* positions per split of [lo, n) (a multiple of 16) */
        int nsw;                 /* splits of [lo, n): [lo + sp * chunk, min(n, lo + (sp + 1) * chunk)) */
        int nsplit;              /* nsw, plus 1 when sa > 0 (kv_split_range) */
        int64_t win;             /* window W (0: none): row r sees (last[r] - W, last[r]] */
        int64_t sink_n;          /* S: positions [0, S) stay visible beside the window */
        const float* sinks;      /* [hkv * g] sink logits (join each denominator) or NULL */
        float cap;               /* soft-capping c (0: none): scores become c tanh(s / c) */
        const float* qin;        /* IN [t][hkv * g][d] */
        float* out;              /* OUT [t][hkv * g][d] (may be qin) */
        float* lse;              /* OUT [t][hkv * g] log-sum-exp (base e) or NULL */
        float scale;             /* of q */
        int qi;                  /* int8 scores (kv_qscores): q quantized per block of 32 */
        float* w;                /* split-wise: nsplit split states (kv_split_floats each) */
        float* q;                /* split-wise: [hkv][r][dp] scaled queries, zero-padded */
        float* qx;               /* split-wise with qi: [hkv][r] int8 query records (KV_QREC
                                    floats each), else NULL */
        float* o;                /* the result [t][hkv * g][d] before it goes to out
                                    (split-wise: the memory of q, no longer read then) */
        int64_t* last;           /* [r]: the last position row r sees (kv_prepare) */
        int64_t* first;          /* [r]: the first position past the sink positions row r
                                    sees (kv_prepare; 0 without a window) */
    } kv_job;

    /* Split sp's positions [*p0, *p1): a split of the window's [lo, n), or the sink split
       [0, sa) (without a window: [sp * chunk, min(n, (sp + 1) * chunk)), as always). */
    KV_INLINE void kv_split_range(const kv_job* J, int sp, int64_t* p0, int64_t* p1) {
        if (sp < J->nsw) {
            *p0 = J->lo + sp * J->chunk;
            *p1 = *p0 + J->chunk < J->n ? *p0 + J->chunk : J->n;
        } else {
            *p0 = 0;
            *p1 = J->sa;
        }
    }

    /* Row-wise jobs (more than KV_SPLIT_ROWS rows: prefill, verification) are work items
       of KV_ROWS rows, each over all the job's splits in turn and merged at once;
       split-wise jobs (decode) are work items of one split of all rows, merged once all
       are done. */
    #define KV_ROWWISE(J) ((J)->r > KV_SPLIT_ROWS)

    /* Storage rows of a tile's np positions [j0, j0 + np): ph[j] (ph[j] = ph[np - 1] past
       np), and the tile as runs of consecutive rows: run i starts at row rs[i], rl[i] rows. */
    typedef struct { int64_t ph[KV_P]; int64_t rs[KV_P]; int rl[KV_P]; int nr, np; } kv_tile;

    KV_INLINE void kv_tile_rows(const kv_job* J, int64_t j0, int np, kv_tile* T) {
        int64_t pg = j0 / J->ps, off = j0 % J->ps, base = (int64_t)J->table[pg] * J->ps;
        T->nr = 0;
        T->np = np;
        for (int j = 0; j < np; j++) {
            T->ph[j] = base + off;
            if (j > 0 && T->ph[j] == T->ph[j - 1] + 1) T->rl[T->nr - 1]++;
            else { T->rs[T->nr] = T->ph[j]; T->rl[T->nr] = 1; T->nr++; }
            if (++off == J->ps && j + 1 < np) { off = 0; pg++; base = (int64_t)J->table[pg] * J->ps; }
        }
        for (int j = np; j < KV_P; j++) T->ph[j] = T->ph[np - 1];
    }

    /* One kv head's rows within a tile. */
    typedef struct {
        const char* c;           /* codes of storage row 0 of this head */
        ptrdiff_t cs;            /* code bytes between rows */
        const int64_t* ph;       /* [KV_P] storage rows of the tile's positions */
        const float* bs;         /* q8_0/q4_0/q4_1: block scales of the tile's first position (float32) */
        int bss;                 /* floats between positions of bs */
        int d;
    } kv_rows;

    #define KV_ROUND16(x) (((size_t)(x) + 15) / 16 * 16)
    /* Float32 tile scales per position and kv head of one side: its stored scales, q4_0's
       twice (each block's d and -8 d, as q4_1's d and m: kv_tile_scales). */
    KV_INLINE int kv_tile_s(const kv_side* x) { return x->fmt == KV_Q4_0 ? 2 * x->s : x->s; }
    /* Floats of one side's tile scales: KV_P * hkv * max(s, 1) of the side with more. */
    KV_INLINE size_t kv_scale_floats(const kv_job* J) {
        const int ks = kv_tile_s(&J->k), vs = kv_tile_s(&J->v), s = ks > vs ? ks : vs;
        return KV_ROUND16((size_t)KV_P * J->hkv * (s > 0 ? s : 1));
    }
    #define KV_ROWS 256        /* query rows per row-wise block (a multiple of KV_RB and KV_W) */
    #define KV_SPLIT_ROWS 128  /* the most query rows of a split-wise job (<= KV_ROWS) */
    /* Floats from one d of a row-wise block's queries q^T [d][KV_RS] to the next, and from
       one position of its scores sT [KV_P][KV_RS] to the next: KV_ROWS and one more cache
       line, an odd number of lines. At KV_ROWS floats (1 KiB) the 128 d of a row vector,
       or the 64 positions of a tile, fell in 4 of the 64 sets of a 32 KiB 8-way L1 and
       evicted each other at every pass of a score or value block. */
    #define KV_RS (KV_ROWS + 16)
    /* Floats of a split state of sr rows per head: m [hkv][sr], l [hkv][sr][KV_W], acc
       [hkv][sr][dp] (unnormalised); row r of head h is h * sr + r. */
    static size_t kv_state_floats(const kv_job* J, int sr) {
        size_t rows = (size_t)J->hkv * sr;
        return KV_ROUND16(rows) + rows * KV_W + rows * J->dp;
    }
    /* Floats of one split's state of all rows (split-wise jobs). */
    static size_t kv_split_floats(const kv_job* J) { return kv_state_floats(J, J->r); }
    /* Floats from one row of a decoded tile [KV_P][ts] to the next: dp, and one more
       cache line where dp is an even number of lines (at D = 128, 512 bytes apart, the
       64 rows' lines of one column block fell in 8 of the 64 sets of a 32 KiB 8-way L1,
       exactly as many lines as those sets hold). */
    KV_INLINE int kv_tile_stride(int dp) { return dp / 16 % 2 ? dp : dp + 16; }
    /* Floats of the scratch of a work item, without / with a row-wise block's own queries
       and split states. */
    static size_t kv_tile_scratch_floats(const kv_job* J) {
        return (size_t)KV_RS * KV_P + 2 * kv_scale_floats(J) + 2 * (size_t)KV_P * kv_tile_stride(J->dp);
    }
    /* One thread's scratch: scores [KV_P][KV_RS], K and V tile scales (kv_scale_floats)
       each, one head's K and V tile decoded [KV_P][ts] each; row-wise also the block's
       scaled queries [hkv][dp][KV_RS] and nsplit states of KV_ROWS rows. */
    static size_t kv_scratch_floats(const kv_job* J) {
        size_t x = kv_tile_scratch_floats(J);
        if (KV_ROWWISE(J)) x += (size_t)J->hkv * KV_RS * J->dp + (size_t)J->nsplit * kv_state_floats(J, KV_ROWS);
        return x;
    }
    /* Floats of the job's int8 query records (split-wise with qi: [hkv][r], else none). */
    static size_t kv_qrec_floats(const kv_job* J);
    /* Floats of the job's own buffers: last [r] and first [r] (int64), then split-wise the
       queries [hkv][r][dp] (later the result), row-wise the result [t][hkv * g][d]; then
       the int8 query records. */
    static size_t kv_job_floats(const kv_job* J) {
        size_t x = KV_ROWWISE(J) ? (size_t)J->t * J->hkv * J->g * J->d : (size_t)J->hkv * J->r * J->dp;
        return KV_ROUND16(4 * (size_t)J->r) + KV_ROUND16(x) + kv_qrec_floats(J);
    }
    /* Points J->last, J->first, J->q, J->o and J->qx into buf (kv_job_floats floats);
       returns the floats after. */
    static float* kv_job_place(kv_job* J, float* buf) {
        J->last = (int64_t*)buf;
        J->first = J->last + J->r;
        J->o = buf + KV_ROUND16(4 * (size_t)J->r);
        J->q = KV_ROWWISE(J) ? NULL : J->o;
        J->qx = kv_qrec_floats(J) ? buf + kv_job_floats(J) - kv_qrec_floats(J) : NULL;
        return buf + kv_job_floats(J);
    }

    static int kv_all_finite(const float* x, size_t n);

    /* The scales of a tile's rows (its runs of consecutive rows), into L2: a tile's scales
       are one contiguous run per run of rows, read whole by kv_tile_scales when the tile
       starts. Nothing for a side without scales. */
    KV_INLINE void kv_prefetch_scales(const kv_side* x, const kv_tile* T) {
        if (!x->sc) return;
        for (int i = 0; i < T->nr; i++) kv_prefetch_lines(x->sc + T->rs[i] * x->ss, T->rl[i] * x->ss);
    }

    /* Part `part` of `parts` of head h's K and V codes in tile T (its rows
       [np * part / parts, np * (part + 1) / parts)), into L2: a row-wise block decodes a
       head's rows of a tile at once, and would otherwise wait for each of them. */
    KV_INLINE void kv_prefetch_head(const kv_job* J, const kv_tile* T, int h, int part, int parts) {
        const char* k = J->k.c + h * J->k.ch;
        const char* v = J->v.c + h * J->v.ch;
        for (int j = T->np * part / parts; j < T->np * (part + 1) / parts; j++) {
            kv_prefetch_lines(k + T->ph[j] * J->k.cs, J->k.ch);
            kv_prefetch_lines(v + T->ph[j] * J->v.cs, J->v.ch);
        }
    }

    /* A stream of prefetches over the next tile's K and V codes (its runs of rows),
       issued a few lines at a time between the score blocks of the current tile, into
       L2 (prefetcht2), not L1: a tile's K and V (256 KiB in f16 at Hkv = 8, D = 128)
       are far larger than L1, and prefetching them into L1 (prefetcht0) made f16/bf16
       decode 3-4x slower on a Zen 4 core (docs/attention.md). */
    /* The stream counts K's bytes (cs: K's code bytes per row); V's rows (vcs bytes each)
       are prefetched in step, the same share of each run. */
    typedef struct { const char *k, *v; const kv_tile* t; ptrdiff_t cs, vcs; int run; size_t off, left, step; } kv_pf;
    KV_INLINE void kv_prefetch(kv_pf* f) {
        size_t b = f->step < f->left ? f->step : f->left;
        f->left -= b;
        while (b) {
            const size_t run = (size_t)f->t->rl[f->run] * f->cs - f->off;
            const size_t n = b < run ? b : run;
            const size_t at = (size_t)f->t->rs[f->run] * f->cs + f->off;
            if (f->vcs == f->cs) {
                for (size_t o = 0; o < n; o += 64) { __builtin_prefetch(f->k + at + o, 0, 1); __builtin_prefetch(f->v + at + o, 0, 1); }
            } else {
                const size_t va = (size_t)f->t->rs[f->run] * f->vcs + f->off * f->vcs / f->cs;
                for (size_t o = 0; o < n; o += 64) __builtin_prefetch(f->k + at + o, 0, 1);
                for (size_t o = 0; o < n * f->vcs / f->cs; o += 64) __builtin_prefetch(f->v + va + o, 0, 1);
            }
            b -= n;
            f->off += n;
            if (n == run) { f->run++; f->off = 0; }
        }
    }

    /* acc[r][p] += q[r][0 .. KV_W) . k[p], RB rows (dp floats apart) x KV_PB K rows. */
    KV_INLINE void kv_score_fmas(const int RB, const kv_vf k[KV_PB], const float* q, int dp,
                                 kv_vf acc[KV_RB][KV_PB]) {
        for (int r = 0; r < RB; r++) {
            kv_vf qv = kv_loadf(q + (size_t)r * dp);
            KV_PIN(qv);   /* one load of q, not one per FMA (GCC folds it into each) */
            for (int p = 0; p < KV_PB; p++) acc[r][p] = kv_fma(qv, k[p], acc[r][p]);
        }
    }

    /* acc[r][p] += q[r][i .. i + KV_W) . K row p [i .. i + KV_W), RB rows x KV_PB K rows. */
    KV_INLINE void kv_score_step(const int fmt, const int tail, const int RB, const char* const* row,
                                 const float* const* bs, int i, int d, const float* q, int dp,
                                 kv_vf acc[KV_RB][KV_PB]) {
        kv_vf k[KV_PB];
        for (int p = 0; p < KV_PB; p++) k[p] = kv_decode(fmt, tail, row[p], i, d, bs[p]);
        kv_score_fmas(RB, k, q + i, dp, acc);
    }

    /* kv_score_step over a whole 4-bit block (values [i, i + 32), i % 32 == 0), each
       pair of its halves from one kv_q4_halves, its vectors summed in kv_score_step's
       order (the high halves after every low one: the f32 kernel's bits). */
    KV_INLINE void kv_score_step_q4(const int RB, const char* const* row, const float* const* bs,
                                    int i, const float* q, int dp, kv_vf acc[KV_RB][KV_PB]) {
        kv_vf hi[16 / KV_W][KV_PB];
        for (int h = 0; h < 16 / KV_W; h++) {
            kv_vf lo[KV_PB];
            for (int p = 0; p < KV_PB; p++) kv_q4_halves(row[p], i / 32, KV_W * h, bs[p], &lo[p], &hi[h][p]);
            kv_score_fmas(RB, lo, q + i + KV_W * h, dp, acc);
        }
        for (int h = 0; h < 16 / KV_W; h++) kv_score_fmas(RB, hi[h], q + i + 16 + KV_W * h, dp, acc);
    }

    /* Int8 scores (J->qi, docs/attention.md "Int8 scores"): each scaled query row x is
       quantized per block of 32 values to int8 codes c and a float32 scale qd (q^ = qd c),
       and its scores against int8/q8_0/q4_0/q4_1 K rows are the blocks' integer dot
       products c . k, exact in int32, times qd (and the K block's scale) in float32; q4_0's
       codes k - 8 (the 8 x sum(c) in the integer sum), q4_1's k d + m (m x qd x sum(c) added
       per lane). A step reads KV_QC codes of a row; each int32 lane of it sums KV_QG
       consecutive products (one block's). */
    #if KV_W == 16 && defined(__AVX512VNNI__) && defined(__AVX512BW__)
    #define KV_QC 64           /* vpdpbusd: K's codes + 128 (unsigned) times q's codes */
    typedef __m512i kv_qv;
    #elif KV_W == 8 && defined(__AVX2__)
    #define KV_QC 32           /* AVX-VNNI vpdpbusd as above; without it vpmaddubsw of |k| and q with k's sign */
    typedef __m256i kv_qv;
    #else
    #define KV_QC KV_W         /* codes widened to int32 lanes and multiplied */
    typedef kv_vi kv_qv;
    #endif
    #define KV_QG (KV_QC / KV_W)
    #define KV_QD(d) (((d) + 63) / 64 * 64)   /* codes of a record: d rounded up to 64 */
    /* An int8 query row's record, KV_QREC(d) floats: codes int8 [KV_QD(d)] (0 past d),
       lane offsets int32 [KV_QD(d) / KV_QG] (-128 x the sum of the lane's codes: vpdpbusd
       reads K's codes offset by 128), lane scales float32 [KV_QD(d) / KV_QG] (the qd of
       the lane's block). */
    #define KV_QREC(d) KV_ROUND16(KV_QD(d) / 4 + 2 * KV_QD(d) / KV_QG)

    /* rec = the int8 record of x [d]: per block of 32 values (0 past d), amax its largest
       |x|, s = 127 / amax and qd = amax / 127 in float32, codes c = rint(x * s) (the
       product in float32, rounded half to even; |c| <= 127); a block with amax < 2^-100
       (s near float32's top) has codes 0 and qd 0. qhat, when not NULL: [d] the values
       qd * c as float32. */
    static void kv_quant_row(const float* x, int d, float* rec, float* qhat) {
        const int dq = KV_QD(d);
        int8_t* c = (int8_t*)rec;
        int32_t* z = (int32_t*)(rec + dq / 4);
        float* ls = (float*)(z + dq / KV_QG);
        float blk[32];
        for (int b = 0; b < dq; b += 32) {
            for (int i = 0; i < 32; i++) blk[i] = b + i < d ? x[b + i] : 0.0f;
            kv_vf m = kv_splat(0.0f);
            for (int i = 0; i < 32; i += KV_W) m = kv_max(m, (kv_vf)((kv_vi)kv_loadf(blk + i) & 0x7FFFFFFF));
            const float amax = kv_hmax(m);
            const int zero = amax < 0x1p-100f;
            const float s = zero ? 0.0f : 127.0f / amax, qd = zero ? 0.0f : amax / 127.0f;
            for (int i = 0; i < 32; i += KV_W) {
                /* + 1.5 x 2^23 - 1.5 x 2^23: rounds |v| <= 127 half to even (no FMA: the
                   build passes -ffp-contract=off) */
                const kv_vf v = kv_loadf(blk + i) * kv_splat(s);
                const kv_vf r = (v + kv_splat(12582912.0f)) - kv_splat(12582912.0f);
                const kv_vi ci = __builtin_convertvector(r, kv_vi);
                for (int k = 0; k < KV_W; k++) c[b + i + k] = (int8_t)ci[k];
                if (qhat) {
                    const kv_vf h = r * kv_splat(qd);
                    for (int k = 0; k < KV_W && b + i + k < d; k++) qhat[b + i + k] = h[k];
                }
            }
            for (int i = b; i < b + 32; i += KV_QG) {
                int32_t sum = 0;
                for (int k = 0; k < KV_QG; k++) sum += c[i + k];
                z[i / KV_QG] = -128 * sum;
                ls[i / KV_QG] = qd;
            }
        }
    }

    static size_t kv_qrec_floats(const kv_job* J) {
        return J->qi && !KV_ROWWISE(J) ? (size_t)J->hkv * J->r * KV_QREC(J->d) : 0;
    }

    /* KV_QC codes of a K row at p (tail: only n < KV_QC of them; the rest read as 0), as
       kv_qdot takes them. */
    KV_INLINE kv_qv kv_qk(const int tail, const char* p, int n) {
    #if KV_QC == 64
        const __m512i x = tail ? _mm512_maskz_loadu_epi8(((__mmask64)1 << n) - 1, p) : _mm512_loadu_si512(p);
        return _mm512_xor_si512(x, _mm512_set1_epi8((char)0x80));
    #elif KV_QC == 32
        __m256i x;
        if (tail) { char t[32] = {0}; memcpy(t, p, (size_t)n); memcpy(&x, t, 32); }
        else memcpy(&x, p, 32);
    #if defined(__AVXVNNI__)
        x = _mm256_xor_si256(x, _mm256_set1_epi8((char)0x80));
    #endif
        return x;
    #else
        kv_vb b = {0};
        memcpy(&b, p, tail ? (size_t)n : sizeof b);
        return __builtin_convertvector(b, kv_vi);
    #endif
    }
    /* KV_QC 4-bit codes (q4_0 / q4_1, unsigned 0..15) of a K row's values [i, i + KV_QC)
       at p, in value order (ggml's blocks: low nibbles of the 16 bytes are values 0..15,
       high ones 16..31); generic build: as int32 lanes, q4_0's minus 8. tail: only the
       first of two blocks is read (d % 32 == 0: a tail is one block). */
    KV_INLINE kv_qv kv_qk4(const int fmt, const int tail, const char* p, int i) {
    #if KV_QC == 64
        /* blocks b0, b1 -> [b0, b0, b1, b1] (16-byte quarters), then each quarter's bytes
           shifted right by 0 / 4 bits and masked: [lo b0, hi b0, lo b1, hi b1] */
        p += i / 2;
        const __m256i x = tail ? _mm256_maskz_loadu_epi8(0xFFFF, p) : _mm256_loadu_si256((const __m256i*)p);
        const __m512i v = _mm512_permutexvar_epi64(_mm512_set_epi64(3, 2, 3, 2, 1, 0, 1, 0), _mm512_castsi256_si512(x));
        (void)fmt;
        return _mm512_and_si512(_mm512_srlv_epi64(v, _mm512_set_epi64(4, 4, 0, 0, 4, 4, 0, 0)),
                                _mm512_set1_epi8(15));
    #elif KV_QC == 32   /* the block in both halves, the upper shifted by 4 bits */
        const __m256i x = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)(p + i / 2)));
        (void)fmt; (void)tail;
        return _mm256_and_si256(_mm256_srlv_epi64(x, _mm256_set_epi64x(4, 4, 0, 0)), _mm256_set1_epi8(15));
    #else
        (void)tail;
        return kv_codes4(p, i) - (fmt == KV_Q4_0 ? 8 : 0);
    #endif
    }
    /* KV_QC codes of a query record at p. */
    KV_INLINE kv_qv kv_qq(const int8_t* p) {
    #if KV_QC == KV_W
        kv_vb b; memcpy(&b, p, sizeof b); return __builtin_convertvector(b, kv_vi);
    #else
        kv_qv x; memcpy(&x, p, sizeof x); return x;
    #endif
    }
    /* Lane L: the sum of its KV_QG products of 4-bit K codes k (kv_qk4) and query codes
       q, exact (q4_0: of k - 8); z: the lane offsets of q's record (-128 x the lane's sum
       of q: q4_0's -8 x it is z / 16). */
    KV_INLINE kv_vi kv_qdot4(const int fmt, kv_qv k, kv_qv q, const int32_t* z) {
    #if KV_QC == 64
        const __m512i z0 = fmt == KV_Q4_0 ? _mm512_srai_epi32(_mm512_loadu_si512(z), 4) : _mm512_setzero_si512();
        return (kv_vi)_mm512_dpbusd_epi32(z0, k, q);
    #elif KV_QC == 32
        const __m256i z0 = fmt == KV_Q4_0 ? _mm256_srai_epi32(_mm256_loadu_si256((const __m256i*)z), 4) : _mm256_setzero_si256();
    #if defined(__AVXVNNI__)
        return (kv_vi)_mm256_dpbusd_avx_epi32(z0, k, q);
    #else   /* k <= 15: pairs <= 2 x 15 x 127, no saturation */
        return (kv_vi)_mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(k, q), _mm256_set1_epi16(1)), z0);
    #endif
    #else
        (void)fmt; (void)z;
        return k * q;
    #endif
    }
    /* Lane L: the sum of its KV_QG products of K codes k (kv_qk) and query codes q, exact;
       z: the lane offsets of q's record. */
    KV_INLINE kv_vi kv_qdot(kv_qv k, kv_qv q, const int32_t* z) {
    #if KV_QC == 64
        return (kv_vi)_mm512_dpbusd_epi32(_mm512_loadu_si512(z), k, q);
    #elif KV_QC == 32 && defined(__AVXVNNI__)
        return (kv_vi)_mm256_dpbusd_avx_epi32(_mm256_loadu_si256((const __m256i*)z), k, q);
    #elif KV_QC == 32   /* |k| x (q with k's sign): pairs <= 2 x 128 x 127, no saturation */
        (void)z;
        return (kv_vi)_mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(k, k), _mm256_sign_epi8(q, k)),
                                        _mm256_set1_epi16(1));
    #else
        (void)z;
        return k * q;
    #endif
    }
    /* Lane L of a step at i: b[s ((i + L KV_QG) / 32) + which] (the block of the lane's
       codes; s the block's floats: 2 for q4_1's (d, m) pairs, else 1; which: d 0, m 1).
       tail: the step's first block is the row's last; its value in every lane (nothing
       past the row is read). AVX-512: the two blocks' floats in one load, spread by one
       permute (not two broadcasts and a blend). */
    KV_INLINE kv_vf kv_qlanes(const float* b, int i, const int s, const int which, const int tail) {
        const float* p = b + s * (i / 32);
    #if KV_QC == 64
        if (tail) return kv_splat(p[which]);
        const __m128 x = s == 2 ? _mm_loadu_ps(p) : _mm_castpd_ps(_mm_load_sd((const double*)p));
        const int hi = s + which;
        const __m512i idx = _mm512_set_epi32(hi, hi, hi, hi, hi, hi, hi, hi,
                                             which, which, which, which, which, which, which, which);
        return (kv_vf)_mm512_permutexvar_ps(idx, _mm512_castps128_ps512(x));
    #else
        (void)tail;
        return kv_splat(p[which]);
    #endif
    }

    /* acc[r][p] += the scores' part of codes [i, i + KV_QC) of RB int8 query records (q,
       dp floats apart) with KV_PB K rows (int8, q8_0, q4_0 or q4_1 codes; the blocked
       formats' block scales bs). */
    KV_INLINE void kv_qscore_step(const int fmt, const int tail, const int RB, const char* const* row,
                                  const float* const* bs, int i, int d, const float* q, int dp,
                                  kv_vf acc[KV_RB][KV_PB]) {
        const int dq = KV_QD(d);
        kv_qv k[KV_PB];
        kv_vf kd[KV_PB], km[KV_PB];
        for (int p = 0; p < KV_PB; p++) {
            k[p] = KV_Q4(fmt) ? kv_qk4(fmt, tail, row[p], i) : kv_qk(tail, row[p] + i, d - i);
            if (KV_BLOCKED(fmt)) kd[p] = kv_qlanes(bs[p], i, KV_Q4(fmt) ? 2 : 1, 0, tail);
            if (fmt == KV_Q4_1) km[p] = kv_qlanes(bs[p], i, 2, 1, tail);
        }
        for (int r = 0; r < RB; r++) {
            const float* rec = q + (size_t)r * dp;
            const int32_t* z = (const int32_t*)(rec + dq / 4) + i / KV_QG;
            const kv_vf ls = kv_loadf(rec + dq / 4 + dq / KV_QG + i / KV_QG);
            const kv_qv qv = kv_qq((const int8_t*)rec + i);
            kv_vf lm = ls;      /* q4_1: qd x the lane's sum of q codes (z / -128, exact) */
            if (fmt == KV_Q4_1) {
                kv_vi zi;
                memcpy(&zi, z, sizeof zi);
                lm = ls * (__builtin_convertvector(zi, kv_vf) * kv_splat(-0x1p-7f));
            }
            for (int p = 0; p < KV_PB; p++) {
                const kv_vf x = __builtin_convertvector(KV_Q4(fmt) ? kv_qdot4(fmt, k[p], qv, z) : kv_qdot(k[p], qv, z), kv_vf);
                if (fmt == KV_Q4_1) acc[r][p] = kv_fma(lm, km[p], acc[r][p]);
                acc[r][p] = kv_fma(x, KV_BLOCKED(fmt) ? ls * kd[p] : ls, acc[r][p]);
            }
        }
    }

    /* out[r] lane L = q[r] . K row (j + L) of the tile, for RB rows (dp floats apart);
       rows past np are read as row np - 1 (the caller masks their lanes). `tail` (a
       constant): d is not a multiple of KV_W. The first tree levels take the block's
       accumulators as values: with kv_tree's array, or with the tail step in the same
       copy of the code, GCC 12 spilled all 16 AVX-512 accumulators to the stack after
       every block (12-14% of the in-cache time, docs/attention.md). */
    KV_INLINE void kv_score_group(const int fmt, const int qi, const int tail, const int RB, kv_rows k,
                                  int j, int np, const float* q, int dp, kv_vf out[KV_RB], kv_pf* pf) {
        kv_vf part[KV_RB][KV_W / KV_PB];
        for (int b = 0; b < KV_W / KV_PB; b++) {
            const char* row[KV_PB];
            const float* bs[KV_PB];
            kv_vf acc[KV_RB][KV_PB];
            kv_prefetch(pf);
            for (int p = 0; p < KV_PB; p++) {
                int pos = j + KV_LEAF_LANE[b * KV_PB + p];
                pos = pos < np ? pos : np - 1;
                row[p] = k.c + k.ph[pos] * k.cs;
                bs[p] = KV_BLOCKED(fmt) ? k.bs + (size_t)pos * k.bss : NULL;
                for (int r = 0; r < RB; r++) acc[r][p] = kv_splat(0.0f);
            }
            int i = 0;
            if (qi) {
                for (; i + KV_QC <= k.d; i += KV_QC) kv_qscore_step(fmt, 0, RB, row, bs, i, k.d, q, dp, acc);
                if (tail) kv_qscore_step(fmt, 1, RB, row, bs, i, k.d, q, dp, acc);
            } else if (KV_Q4(fmt)) {
                for (; i < k.d; i += 32) kv_score_step_q4(RB, row, bs, i, q, dp, acc);
            } else {
                for (; i + KV_W <= k.d; i += KV_W) kv_score_step(fmt, 0, RB, row, bs, i, k.d, q, dp, acc);
                if (tail) kv_score_step(fmt, 1, RB, row, bs, i, k.d, q, dp, acc);
            }
            for (int r = 0; r < RB; r++)
    #if KV_PB == 4
                part[r][b] = kv_comb(kv_comb(acc[r][0], acc[r][1], KV_W / 2),
                                     kv_comb(acc[r][2], acc[r][3], KV_W / 2), KV_W / 4);
    #else
                part[r][b] = kv_comb(acc[r][0], acc[r][1], KV_W / 2);
    #endif
            if (KV_PFB > 1) kv_prefetch(pf);
        }
        for (int r = 0; r < RB; r++) out[r] = kv_tree(part[r], KV_W / KV_PB, KV_W / 2 / KV_PB);
    }

    /* kv_score_group of KV_RB rows and no tail, one function per format (and per format
       of the int8 scores): inlined into the tile's loops, the group's inner loop kept the
       query rows' base and stride in vector registers and reloaded them at every step
       (GCC 12 left the general registers to the caller's values). */
    #define KV_GROUP_FN(F)                                                                         \
        static __attribute__((noinline)) void kv_score_group_##F(const int qi, kv_rows k, int j, \
                int np, const float* q, int dp, kv_vf out[KV_RB], kv_pf* pf) {                     \
            if (qi && (F == KV_INT8 || KV_BLOCKED(F)))   /* the int8 scores' formats */            \
                kv_score_group(F, 1, 0, KV_RB, k, j, np, q, dp, out, pf);                          \
            else kv_score_group(F, 0, 0, KV_RB, k, j, np, q, dp, out, pf);                         \
        }
    KV_EACH_FORMAT(KV_GROUP_FN)
    #undef KV_GROUP_FN
    KV_INLINE void kv_score_group_full(const int fmt, const int qi, kv_rows k, int j, int np, const float* q,
                                       int dp, kv_vf out[KV_RB], kv_pf* pf) {
        switch (fmt) {
        #define KV_CASE(F) case F: kv_score_group_##F(qi, k, j, np, q, dp, out, pf); break;
        KV_EACH_FORMAT(KV_CASE)
        #undef KV_CASE
        }
    }

    /* s[r][0 .. np) = scores of RB rows against the tile's np K rows, times the row scales
       rs [KV_P] (int8/FP8; NULL: none); lanes past np or past last[r] (position j0 + lane)
       are -inf. */
    KV_INLINE void kv_score_rows(const int fmt, const int qi, const int RB, kv_rows k, int np, const float* q,
                                 int dp, const float* rs, const int64_t* last, int64_t j0, float* s, kv_pf* pf) {
        const kv_vi lane = KV_LANES;
        for (int j = 0; j < np; j += KV_W) {
            kv_vf o[KV_RB];
            if (k.d % (qi ? KV_QC : KV_W)) kv_score_group(fmt, qi, 1, RB, k, j, np, q, dp, o, pf);
            else if (RB == KV_RB) kv_score_group_full(fmt, qi, k, j, np, q, dp, o, pf);
            else kv_score_group(fmt, qi, 0, RB, k, j, np, q, dp, o, pf);
            for (int r = 0; r < RB; r++) {
                kv_vf x = rs ? o[r] * kv_loadf(rs + j) : o[r];
                int64_t seen = last[r] - j0 + 1;
                int vis = (int)((seen < np ? seen : np) - j);   /* visible lanes */
                if (vis < KV_W) {
                    kv_vi keep = lane < (kv_vi)KV_REP(vis > 0 ? vis : 0);
                    x = (kv_vf)(((kv_vi)x & keep) | ((kv_vi)kv_splat(-INFINITY) & ~keep));
                }
                kv_storef(s + (size_t)r * KV_P + j, x);
            }
        }
    }

    /* acc[r][columns] += sum_j w[r * ws + j * wp] V row j [columns], RB rows, CB column
       vectors [i0 + step c, + KV_W) (the last one passes d when `tail`); a 4-bit pair
       16 apart is one block's two halves from one kv_q4_halves. */
    KV_INLINE void kv_value_block(const int fmt, const int tail, const int RB, const int CB, const int step,
                                  kv_rows v, int j0, int j1, const float* w, int ws, int wp, float* acc,
                                  int dp, int i0) {
        kv_vf a[KV_VR][KV_CB];
        for (int r = 0; r < RB; r++)
            for (int c = 0; c < CB; c++) a[r][c] = kv_loadf(acc + (size_t)r * dp + i0 + step * c);
        for (int j = j0; j < j1; j++) {
            const char* row = v.c + v.ph[j] * v.cs;
            kv_vf x[KV_CB];
            const float* bs = KV_BLOCKED(fmt) ? v.bs + (size_t)j * v.bss : NULL;
            if (KV_Q4(fmt) && step == 16 && CB % 2 == 0)   /* column pairs: a block's two halves */
                for (int c = 0; c < CB; c += 2)
                    kv_q4_halves(row, (i0 + step * c) / 32, (i0 + step * c) % 16, bs, &x[c], &x[c + 1]);
            else
                for (int c = 0; c < CB; c++) x[c] = kv_decode(fmt, tail && c == CB - 1, row, i0 + step * c, v.d, bs);
            for (int r = 0; r < RB; r++) {
                kv_vf wr = kv_splat(w[(size_t)r * ws + (size_t)j * wp]);
                for (int c = 0; c < CB; c++) a[r][c] = kv_fma(wr, x[c], a[r][c]);
            }
        }
        for (int r = 0; r < RB; r++)
            for (int c = 0; c < CB; c++) kv_storef(acc + (size_t)r * dp + i0 + step * c, a[r][c]);
    }

    KV_INLINE void kv_value_rows(const int fmt, const int RB, kv_rows v, int np, const float* w, int ws,
                                 int wp, float* acc, int dp) {
        const int vj = v.cs % 4096 == 0 ? KV_VJ : np;
        for (int j0 = 0; j0 < np; j0 += vj) {
            const int j1 = j0 + vj < np ? j0 + vj : np;
            int i0 = 0;
            if (KV_Q4(fmt) && KV_W == 8) {  /* column pairs 16 apart: a block's halves (kv_q4_halves) */
                for (; i0 < v.d; i0 += 32)
                    for (int h = 0; h < 16; h += KV_W)
                        kv_value_block(fmt, 0, RB, 2, 16, v, j0, j1, w, ws, wp, acc, dp, i0 + h);
                continue;
            }
            for (; i0 + KV_W * KV_CB <= v.d; i0 += KV_W * KV_CB)
                kv_value_block(fmt, 0, RB, KV_CB, KV_W, v, j0, j1, w, ws, wp, acc, dp, i0);
            for (; i0 + KV_W <= v.d; i0 += KV_W) kv_value_block(fmt, 0, RB, 1, KV_W, v, j0, j1, w, ws, wp, acc, dp, i0);
            if (i0 < v.d) kv_value_block(fmt, 1, RB, 1, KV_W, v, j0, j1, w, ws, wp, acc, dp, i0);
        }
    }

    /* Scores (s [R][KV_P]) of R rows, or (values) acc [R][dp] += weights x V rows (row r's
       weight of position j at w[r * ws + j * wp]), in register blocks of KV_RB rows. */
    KV_INLINE void kv_scores(const int fmt, const int qi, int R, kv_rows k, int np, const float* q, int dp,
                             const float* rs, const int64_t* last, int64_t j0, float* s, kv_pf* pf) {
        for (int r = 0; r < R; r += KV_RB) {
            const float* qr = q + (size_t)r * dp;
            float* sr = s + (size_t)r * KV_P;
            switch (R - r < KV_RB ? R - r : KV_RB) {
            case 1: kv_score_rows(fmt, qi, 1, k, np, qr, dp, rs, last + r, j0, sr, pf); break;
            case 2: kv_score_rows(fmt, qi, 2, k, np, qr, dp, rs, last + r, j0, sr, pf); break;
            case 3: kv_score_rows(fmt, qi, 3, k, np, qr, dp, rs, last + r, j0, sr, pf); break;
            default: kv_score_rows(fmt, qi, KV_RB, k, np, qr, dp, rs, last + r, j0, sr, pf);
            }
        }
    }
    KV_INLINE void kv_values(const int fmt, int R, kv_rows v, int np, const float* w, int ws, int wp,
                             float* acc, int dp) {
        for (int r = 0; r < R; r += KV_RB) {
            const float* wr = w + (size_t)r * ws;
            float* ar = acc + (size_t)r * dp;
            switch (R - r < KV_RB ? R - r : KV_RB) {
            case 1: kv_value_rows(fmt, 1, v, np, wr, ws, wp, ar, dp); break;
            case 2: kv_value_rows(fmt, 2, v, np, wr, ws, wp, ar, dp); break;
            case 3: kv_value_rows(fmt, 3, v, np, wr, ws, wp, ar, dp); break;
            default: kv_value_rows(fmt, KV_RB, v, np, wr, ws, wp, ar, dp);
            }
        }
    }

    /* kv_scores / kv_values / kv_decode_rows of a format id known at run time: one switch
       per tile and head into the copy of the code made for that format. A K/V pair reads
       K's codes in the scores and V's in the weighted sums, each side through its own
       format's copy, so the kernels are made once per format, never per pair. */
    static void kv_scores_of(int fmt, int R, kv_rows k, int np, const float* q, int dp,
                             const float* rs, const int64_t* last, int64_t j0, float* s, kv_pf* pf) {
        switch (fmt) {
        #define KV_CASE(F) case F: kv_scores(F, 0, R, k, np, q, dp, rs, last, j0, s, pf); break;
        KV_EACH_FORMAT(KV_CASE)
        #undef KV_CASE
        }
    }
    static void kv_values_of(int fmt, int R, kv_rows v, int np, const float* w, int ws, int wp,
                             float* acc, int dp) {
        switch (fmt) {
        #define KV_CASE(F) case F: kv_values(F, R, v, np, w, ws, wp, acc, dp); break;
        KV_EACH_FORMAT(KV_CASE)
        #undef KV_CASE
        }
    }

    /* Online-softmax update of R rows by one tile's scores s [R][KV_P] (np valid; masked
       lanes -inf): m [R] (running max), l [R][KV_W] (lane sums of the weights) and acc
       [R][dp] are rescaled when the max grows; s becomes the weights exp(s - m), times
       the V row scales vs [KV_P] when vs is not NULL. */
    static void kv_softmax(int R, int np, float* s, float* m, float* l, float* acc, int dp, const float* vs) {
        for (int r = 0; r < R; r++) {
            float* sr = s + (size_t)r * KV_P;
            kv_vf mx = kv_loadf(sr);
            for (int j = KV_W; j < np; j += KV_W) mx = kv_max(mx, kv_loadf(sr + j));
            float top = kv_hmax(mx);
            if (top > m[r]) {
                if (m[r] != -INFINITY) {
                    kv_vf a = kv_splat(expf(m[r] - top));
                    for (int i = 0; i < dp; i += KV_W) kv_storef(acc + (size_t)r * dp + i, kv_loadf(acc + (size_t)r * dp + i) * a);
                    kv_storef(l + KV_W * r, kv_loadf(l + KV_W * r) * a);
                }
                m[r] = top;
            }
            if (m[r] == -INFINITY) {   /* no visible position yet */
                memset(sr, 0, KV_P * sizeof(float));
                continue;
            }
            kv_vf mv = kv_splat(m[r]), sum = kv_loadf(l + KV_W * r);
            for (int j = 0; j < np; j += KV_W) {
                kv_vf e = kv_exp(kv_loadf(sr + j) - mv);
                sum = sum + e;
                kv_storef(sr + j, vs ? e * kv_loadf(vs + j) : e);
            }
            kv_storef(l + KV_W * r, sum);
        }
    }

    /* Whether a tile of np positions from j0 holds a position that a row whose window
       starts at `first` (the largest first of the tile's rows) does not see although it
       is not a sink position: the window's lower bound masks lanes of that tile. */
    KV_INLINE int kv_window_cuts(const kv_job* J, int64_t first, int64_t j0, int np) {
        const int64_t a = j0 > J->sink_n ? j0 : J->sink_n, b = j0 + np < first ? j0 + np : first;
        return a < b;
    }

    /* The variants on a split-wise tile's scores s [R][KV_P] (np positions from j0; lanes
       past np or past last[r] already -inf): soft-capping (J->cap > 0) of every score,
       then lanes that row r does not see (past last[r], or before first[r] and not below
       sink_n) set to -inf. */
    static void kv_split_variants(const kv_job* J, int R, int np, int64_t j0, const int64_t* first,
                                  const int64_t* last, float* s) {
        const kv_vi lane = KV_LANES;
        const int32_t sk = kv_rel(J->sink_n, j0);
        const float c = J->cap, ic = 1.0f / c;
        for (int r = 0; r < R; r++) {
            const int32_t lo = kv_rel(first[r], j0), hi0 = kv_rel(last[r] + 1, j0);
            const int32_t hi = hi0 < np ? hi0 : np;
            float* sr = s + (size_t)r * KV_P;
            for (int j = 0; j < np; j += KV_W) {
                kv_vi pos = lane + (kv_vi)KV_REP(j);
                kv_vi keep = (pos < (kv_vi)KV_REP(hi)) & ((pos >= (kv_vi)KV_REP(lo)) | (pos < (kv_vi)KV_REP(sk)));
                kv_vf x = kv_loadf(sr + j);
                if (c > 0.0f) x = kv_softcap(x, c, ic);
                kv_storef(sr + j, (kv_vf)(((kv_vi)x & keep) | ((kv_vi)kv_splat(-INFINITY) & ~keep)));
            }
        }
    }

    /* x [2 n] = the pairs (d, -8 d) of the n values d at x, in place (q4_0's tile scales:
       its values (q - 8) d are then q d + (-8 d), one multiply-add as q4_1's q d + m;
       -8 d is exact). */
    static void kv_pair_scales(float* x, size_t n) {
        size_t i = n;
        for (; i >= KV_W; i -= KV_W) {   /* from the end: the pairs land at or past what is read */
            const kv_vf d = kv_loadf(x + i - KV_W), m = d * kv_splat(-8.0f);
    #if KV_W == 16
            const kv_vf a = __builtin_shufflevector(d, m, 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
            const kv_vf b = __builtin_shufflevector(d, m, 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    #else
            const kv_vf a = __builtin_shufflevector(d, m, 0, 8, 1, 9, 2, 10, 3, 11);
            const kv_vf b = __builtin_shufflevector(d, m, 4, 12, 5, 13, 6, 14, 7, 15);
    #endif
            kv_storef(x + 2 * (i - KV_W), a);
            kv_storef(x + 2 * (i - KV_W) + KV_W, b);
        }
        while (i--) { const float d = x[i]; x[2 * i] = d; x[2 * i + 1] = -8.0f * d; }
    }

    /* The tile's scales of one side (fmt: its format, a constant in the kernels of one
       format) as float32 in out: int8/FP8 row scales of its np positions
       transposed to [hkv][KV_P] (zero past np; e4m3 times 2^8, the factor its decode
       leaves out), q8_0 block scales as stored, [np][hkv][s]. */
    KV_INLINE void kv_tile_scales(const int fmt, const kv_side* side, int hkv, const kv_tile* T, float* out) {
        const char* sc = side->sc;
        if (KV_BLOCKED(fmt)) {
            const int per = hkv * side->s;   /* scales of one position, contiguous */
            for (int i = 0, j = 0; i < T->nr; j += T->rl[i], i++)
                kv_halves(sc + T->rs[i] * side->ss, T->rl[i] * per, out + (size_t)j * per);
            if (fmt == KV_Q4_0) kv_pair_scales(out, (size_t)T->np * per);
        } else if (KV_ROW_SCALED(fmt)) {
            const float f = fmt == KV_E4M3 ? 256.0f : 1.0f;
            const ptrdiff_t ss = side->ss, sh = side->sh;
            const int np = T->np;
            for (int h = 0; h < hkv; h++) {
                const char* p = sc + h * sh;
                float* o = out + (size_t)h * KV_P;
                for (int j = 0; j < np; j++) { float x; memcpy(&x, p + T->ph[j] * ss, 4); o[j] = x * f; }
                for (int j = np; j < KV_P; j++) o[j] = 0.0f;
            }
        }
    }

    /* Head h's rows of one side within a tile; sc: the side's tile scales (kv_tile_scales). */
    KV_INLINE kv_rows kv_head_rows(const kv_side* x, const kv_job* J, const float* sc,
                                   const kv_tile* T, int h) {
        kv_rows r = {x->c + h * x->ch, x->cs, T->ph, KV_BLOCKED(x->fmt) ? sc + (size_t)h * kv_tile_s(x) : NULL,
                     J->hkv * kv_tile_s(x), J->d};
        return r;
    }

    /* out [KV_P][ts] = the np rows of x as float32 (dp floats of each ts), as kv_decode
       makes them (the values the score and value blocks compute from), zero past d. */
    KV_INLINE void kv_decode_rows(const int fmt, kv_rows x, int np, float* out, int dp, int ts) {
        for (int j = 0; j < np; j++) {
            const char* row = x.c + x.ph[j] * x.cs;
            float* o = out + (size_t)j * ts;
            const float* bs = KV_BLOCKED(fmt) ? x.bs + (size_t)j * x.bss : NULL;
            for (int i = 0; i < dp; i += KV_W) {
                kv_storef(o + i, i + KV_W <= x.d ? kv_decode(fmt, 0, row, i, x.d, bs)
                                 : i < x.d ? kv_decode(fmt, 1, row, i, x.d, bs) : kv_splat(0.0f));
            }
        }
    }
    static void kv_decode_rows_of(int fmt, kv_rows x, int np, float* out, int dp, int ts) {
        switch (fmt) {
        #define KV_CASE(F) case F: kv_decode_rows(F, x, np, out, dp, ts); break;
        KV_EACH_FORMAT(KV_CASE)
        #undef KV_CASE
        }
    }
    /* kv_scores / kv_values / kv_decode_rows in format f: its own copy when f is a
       constant format id, or (f = KV_ANY) through the switch into format rt's copy. */
    #define KV_ANY (-1)
    #define KV_CONST(f) ((f) == KV_ANY ? KV_F32 : (f))   /* no copy for KV_ANY itself */
    KV_INLINE void kv_scores_in(const int f, int rt, int R, kv_rows k, int np, const float* q, int dp,
                                const float* rs, const int64_t* last, int64_t j0, float* s, kv_pf* pf) {
        if (f == KV_ANY) kv_scores_of(rt, R, k, np, q, dp, rs, last, j0, s, pf);
        else kv_scores(KV_CONST(f), 0, R, k, np, q, dp, rs, last, j0, s, pf);
    }
    /* The int8 scores of R int8 query records (q, dp floats apart) with K in format fmt
       (int8, q8_0, q4_0 or q4_1, known at run time). */
    static void kv_qscores(int fmt, int R, kv_rows k, int np, const float* q, int dp,
                           const float* rs, const int64_t* last, int64_t j0, float* s, kv_pf* pf) {
        switch (fmt) {
        case KV_Q8_0: kv_scores(KV_Q8_0, 1, R, k, np, q, dp, rs, last, j0, s, pf); break;
        case KV_Q4_0: kv_scores(KV_Q4_0, 1, R, k, np, q, dp, rs, last, j0, s, pf); break;
        case KV_Q4_1: kv_scores(KV_Q4_1, 1, R, k, np, q, dp, rs, last, j0, s, pf); break;
        default: kv_scores(KV_INT8, 1, R, k, np, q, dp, rs, last, j0, s, pf);
        }
    }
    KV_INLINE void kv_values_in(const int f, int rt, int R, kv_rows v, int np, const float* w, int ws,
                                int wp, float* acc, int dp) {
        if (f == KV_ANY) kv_values_of(rt, R, v, np, w, ws, wp, acc, dp);
        else kv_values(KV_CONST(f), R, v, np, w, ws, wp, acc, dp);
    }
    KV_INLINE void kv_decode_rows_in(const int f, int rt, kv_rows x, int np, float* out, int dp, int ts) {
        if (f == KV_ANY) kv_decode_rows_of(rt, x, np, out, dp, ts);
        else kv_decode_rows(KV_CONST(f), x, np, out, dp, ts);
    }

    /* Rows [r0, r1) (at most KV_ROWS) of every kv head over the positions [p0, p1) of
       one split: queries q [hkv][sr][dp] and state w (kv_state_floats(sr)), row r of head
       h at h * sr + ro + r - r0; x: the thread's scratch (kv_tile_scratch_floats). Each row's arithmetic is the same whatever
       the row block: rows are independent. Tiles past the block's last visible position
       (the causal mask hides them from every row of the block) are skipped, which leaves
       each row's state exactly as processing them would (weights 0). */
    KV_INLINE void kv_split_fmt(const int kf0, const int vf0, const kv_job* J, const float* q, float* w,
                                int sr, int ro, int64_t p0, int64_t p1, int r0, int r1, float* x) {
        const int R = sr, H = J->hkv, dp = J->dp, nr = r1 - r0, qr = KV_QREC(J->d);
        const int kfmt = kf0 == KV_ANY ? J->k.fmt : kf0, vfmt = vf0 == KV_ANY ? J->v.fmt : vf0;
        const size_t rows = (size_t)H * R;
        const size_t sc = kv_scale_floats(J);
        float* m = w;
        float* l = m + KV_ROUND16(rows);
        float* acc = l + rows * KV_W;
        float* s = x;
        float* ksc = s + (size_t)KV_RS * KV_P;
        float* vsc = ksc + sc;
        const int ts = kv_tile_stride(dp);
        float* kf = vsc + sc;                 /* [KV_P][ts]: one head's K tile as float32 */
        float* vf = kf + (size_t)KV_P * ts;
        /* rows blocks of more than 2 register blocks decode each head's tile once, then
           read it as f32: the same values in the same operations */
        const int predecode = (kfmt != KV_F32 || vfmt != KV_F32) && nr > 2 * KV_RB;
        int64_t rowf[KV_P];
        for (int h = 0; h < H; h++) {
            const size_t hr = (size_t)h * R + ro;
            for (int r = 0; r < nr; r++) m[hr + r] = -INFINITY;
            memset(l + hr * KV_W, 0, (size_t)nr * KV_W * sizeof(float));
            memset(acc + hr * dp, 0, (size_t)nr * dp * sizeof(float));
        }
        /* the positions some row of the block sees: [p0, end) (last[] grows with r) */
        const int64_t end = J->last[r1 - 1] + 1 < p1 ? J->last[r1 - 1] + 1 : p1;
        if (end <= p0) return;
        /* Tiles of KV_P positions from p0 (the same tiles whatever the pages: the result
           never depends on where a position is stored); cur, then the next tile's rows. */
        kv_tile tiles[2];
        kv_tile *cur = &tiles[0], *nxt = &tiles[1];
        kv_tile_rows(J, p0, (int)(p1 - p0 < KV_P ? p1 - p0 : KV_P), cur);
        /* the first tile, which no earlier tile prefetched: one burst, into L2 */
        for (int i = 0; i < cur->nr; i++) {
            const char* k = J->k.c + cur->rs[i] * J->k.cs;
            const char* v = J->v.c + cur->rs[i] * J->v.cs;
            if (J->k.cs == J->v.cs) {
                for (size_t o = 0; o < (size_t)cur->rl[i] * J->k.cs; o += 64) {
                    __builtin_prefetch(k + o, 0, 1);
                    __builtin_prefetch(v + o, 0, 1);
                }
            } else {
                for (size_t o = 0; o < (size_t)cur->rl[i] * J->k.cs; o += 64) __builtin_prefetch(k + o, 0, 1);
                for (size_t o = 0; o < (size_t)cur->rl[i] * J->v.cs; o += 64) __builtin_prefetch(v + o, 0, 1);
            }
        }
        for (int64_t j0 = p0; j0 < end; j0 += KV_P) {
            const int np = cur->np;
            const int64_t next = j0 + KV_P + KV_P < end ? j0 + KV_P + KV_P : end;
            const size_t calls = (size_t)H * ((np + KV_W - 1) / KV_W) * (KV_W / KV_PB) * KV_PFB * ((nr + KV_RB - 1) / KV_RB);
            if (next > j0 + KV_P) {
                kv_tile_rows(J, j0 + KV_P, (int)((p1 - j0 - KV_P) < KV_P ? p1 - j0 - KV_P : KV_P), nxt);
                kv_prefetch_scales(&J->k, nxt);
                kv_prefetch_scales(&J->v, nxt);
            }
            kv_pf pf = {J->k.c, J->v.c, nxt, J->k.cs, J->v.cs, 0, 0,
                        next > j0 + KV_P ? (size_t)(next - j0 - KV_P) * J->k.cs : 0, 0};
            pf.step = (pf.left / calls + 63) / 64 * 64;
            kv_tile_scales(kfmt, &J->k, H, cur, ksc);
            kv_tile_scales(vfmt, &J->v, H, cur, vsc);
            /* soft-capping, or the window's lower bound inside this tile (multi-token
               rows: the later tokens' windows start later) */
            const int var = J->cap > 0.0f || kv_window_cuts(J, J->first[r1 - 1], j0, np);
            for (int h = 0; h < H; h++) {
                kv_rows k = kv_head_rows(&J->k, J, ksc, cur, h), v = kv_head_rows(&J->v, J, vsc, cur, h);
                const size_t hr = (size_t)h * R + ro;
                float* ah = acc + hr * dp;
                const float* rs = KV_ROW_SCALED(kfmt) ? ksc + (size_t)h * KV_P : NULL;
                if (predecode) {
                    /* each side not f32 decoded; both then read as f32 rows */
                    for (int j = 0; j < KV_P; j++) rowf[j] = j < np ? j : np - 1;
                    if (kfmt != KV_F32 && !J->qi) {
                        kv_decode_rows_in(kf0, kfmt, k, np, kf, dp, ts);
                        kv_rows kd = {(const char*)kf, (ptrdiff_t)ts * 4, rowf, NULL, 0, J->d};
                        k = kd;
                    }
                    if (vfmt != KV_F32) {
                        kv_decode_rows_in(vf0, vfmt, v, np, vf, dp, ts);
                        kv_rows vd = {(const char*)vf, (ptrdiff_t)ts * 4, rowf, NULL, 0, J->d};
                        v = vd;
                    }
                    if (J->qi) kv_qscores(kfmt, nr, k, np, J->qx + hr * qr, qr, rs, J->last + r0, j0, s, &pf);
                    else kv_scores(KV_F32, 0, nr, k, np, q + hr * dp, dp, rs, J->last + r0, j0, s, &pf);
                    if (var) kv_split_variants(J, nr, np, j0, J->first + r0, J->last + r0, s);
                    kv_softmax(nr, np, s, m + hr, l + hr * KV_W, ah, dp,
                               KV_ROW_SCALED(vfmt) ? vsc + (size_t)h * KV_P : NULL);
                    kv_values(KV_F32, nr, v, np, s, KV_P, 1, ah, dp);
                    continue;
                }
                if (J->qi) kv_qscores(kfmt, nr, k, np, J->qx + hr * qr, qr, rs, J->last + r0, j0, s, &pf);
                else kv_scores_in(kf0, kfmt, nr, k, np, q + hr * dp, dp, rs, J->last + r0, j0, s, &pf);
                if (var) kv_split_variants(J, nr, np, j0, J->first + r0, J->last + r0, s);
                kv_softmax(nr, np, s, m + hr, l + hr * KV_W, ah, dp,
                           KV_ROW_SCALED(vfmt) ? vsc + (size_t)h * KV_P : NULL);
                kv_values_in(vf0, vfmt, nr, v, np, s, KV_P, 1, ah, dp);
            }
            kv_tile* swap = cur; cur = nxt; nxt = swap;
        }
    }

    /* One copy of kv_split_fmt per format for K and V in the same format (the formats
       constants in it, as every kernel before pairs), and one for every K/V pair (KV_ANY:
       the scores and weighted sums switch to their format's copy per tile and head). */
    #define KV_BY_FORMATS(J, FN, ...) do {                                                   \
        if ((J)->k.fmt != (J)->v.fmt) { FN(KV_ANY, KV_ANY, __VA_ARGS__); break; }             \
        switch ((J)->k.fmt) {                                                                 \
        case KV_F32: FN(KV_F32, KV_F32, __VA_ARGS__); break;                                  \
        case KV_F16: FN(KV_F16, KV_F16, __VA_ARGS__); break;                                  \
        case KV_BF16: FN(KV_BF16, KV_BF16, __VA_ARGS__); break;                               \
        case KV_INT8: FN(KV_INT8, KV_INT8, __VA_ARGS__); break;                               \
        case KV_E4M3: FN(KV_E4M3, KV_E4M3, __VA_ARGS__); break;                               \
        case KV_E5M2: FN(KV_E5M2, KV_E5M2, __VA_ARGS__); break;                               \
        case KV_Q8_0: FN(KV_Q8_0, KV_Q8_0, __VA_ARGS__); break;                               \
        case KV_Q4_0: FN(KV_Q4_0, KV_Q4_0, __VA_ARGS__); break;                               \
        case KV_Q4_1: FN(KV_Q4_1, KV_Q4_1, __VA_ARGS__); break;                               \
        } } while (0)
    static void kv_split(const kv_job* J, const float* q, float* w, int sr, int ro, int64_t p0, int64_t p1,
                         int r0, int r1, float* x) {
        KV_BY_FORMATS(J, kv_split_fmt, J, q, w, sr, ro, p0, p1, r0, r1, x);
    }

    /* Row-wise blocks hold their KV_ROWS rows in the lanes: KV_BV row vectors. Scores
       sT [KV_P][KV_RS] of a tile are register blocks of KV_BP positions x KV_SV row
       vectors, each a sum over d of q^T [d][KV_RS] times one K value broadcast (no
       reduction across lanes); the online softmax runs on row vectors; the values are
       kv_values' with the weights read from sT. */
    #define KV_BV (KV_ROWS / KV_W)
    #if KV_W == 16
    #define KV_SV 4
    #define KV_BP 6
    #else
    #define KV_SV 2
    #define KV_BP 5
    #endif

    /* sT[p][rows] for positions [p0, p0 + P) (P <= KV_BP; kp[p]: the float32 K values
       of position p0 + p), KV_SV row vectors (qt [d][KV_RS] and sT from the first);
       times rs[p] (or not: NULL); lanes whose row's last position (lastrel, relative to
       the tile) is before p are -inf. */
    KV_INLINE void kv_block_scores(const int P, const float* const* kp, int d, const float* qt, const float* rs,
                                   const kv_vi* lastrel, int p0, float* sT) {
        kv_vf a[KV_BP][KV_SV];
        for (int p = 0; p < P; p++)
            for (int v = 0; v < KV_SV; v++) a[p][v] = kv_splat(0.0f);
        for (int i = 0; i < d; i++) {
            kv_vf qv[KV_SV];
            for (int v = 0; v < KV_SV; v++) {
                qv[v] = kv_loadf(qt + (size_t)i * KV_RS + v * KV_W);
                /* one load of each q vector, not one per FMA: GCC folded it into each of
                   the KV_BP FMAs and spilled accumulators (prefill 1.2-1.3x slower) */
                KV_PIN(qv[v]);
            }
            for (int p = 0; p < P; p++) {
                kv_vf kb = kv_splat(kp[p][i]);
                for (int v = 0; v < KV_SV; v++) a[p][v] = kv_fma(qv[v], kb, a[p][v]);
            }
        }
        for (int p = 0; p < P; p++) {
            const int pos = p0 + p;
            for (int v = 0; v < KV_SV; v++) {
                kv_vf x = rs ? a[p][v] * kv_splat(rs[pos]) : a[p][v];
                kv_vi keep = (kv_vi)KV_REP(pos) <= lastrel[v];
                x = (kv_vf)(((kv_vi)x & keep) | ((kv_vi)kv_splat(-INFINITY) & ~keep));
                kv_storef(sT + (size_t)pos * KV_RS + v * KV_W, x);
            }
        }
    }
    /* acc [nr][dp] += the tile's weights x its V rows, for a row-wise block: v the tile's
       V rows as float32 (vf), weights sT [KV_P][KV_RS] (row r's weight of position j at
       sT[j * KV_RS + r]); kv_values' value blocks (the same operations), KV_VR rows at a
       time. A function of its own: inlined into kv_block_fmt, the value block's column
       offsets and loop bound lived on the stack and were reloaded at every position, and
       its 8 accumulators (AVX2) were too few to hide the FMA latency. */
    static __attribute__((noinline)) void kv_tile_values(int nr, kv_rows v, int np, const float* sT,
                                                         float* acc, int dp) {
        int r = 0;
        for (; r + KV_VR <= nr; r += KV_VR)
            kv_value_rows(KV_F32, KV_VR, v, np, sT + r, 1, KV_RS, acc + (size_t)r * dp, dp);
        if (r < nr) kv_values(KV_F32, nr - r, v, np, sT + r, 1, KV_RS, acc + (size_t)r * dp, dp);
    }

    /* kv_block_scores of KV_BP positions, of 4 (a tile's last 64 % KV_BP = 4) and of one,
       each a function of its own (each position's score the same operations): inlined
       into kv_block_fmt (one copy per format and pair), its 24 accumulators and 4 q
       vectors shared the registers with the caller's and GCC 12 spilled some of them in
       the loop over d (causal prefill 1.2-1.3x slower, measured at 4k tokens). */
    static __attribute__((noinline)) void kv_block_scores_full(const float* const* kp, int d, const float* qt,
                                                               const float* rs, const kv_vi* lastrel, int p0, float* sT) {
        kv_block_scores(KV_BP, kp, d, qt, rs, lastrel, p0, sT);
    }
    static __attribute__((noinline)) void kv_block_scores_four(const float* const* kp, int d, const float* qt,
                                                               const float* rs, const kv_vi* lastrel, int p0, float* sT) {
        kv_block_scores(4, kp, d, qt, rs, lastrel, p0, sT);
    }
    static __attribute__((noinline)) void kv_block_scores_one(const float* const* kp, int d, const float* qt,
                                                              const float* rs, const kv_vi* lastrel, int p0, float* sT) {
        kv_block_scores(1, kp, d, qt, rs, lastrel, p0, sT);
    }

    /* The variants on a row-wise tile's scores sT [KV_P][KV_RS] (np positions from j0;
       lanes past a row's last position already -inf, lastrel: those last positions
       relative to j0): soft-capping (J->cap > 0), then the lanes of rows whose window
       (first [nr], the block's rows) starts after a position that is not a sink position
       set to -inf. */
    static void kv_block_variants(const kv_job* J, int np, int64_t j0, const int64_t* first, int nr,
                                  const kv_vi* lastrel, float* sT) {
        kv_vi firstrel[KV_BV];
        for (int v = 0; v < KV_BV; v++)
            for (int k = 0; k < KV_W; k++)
                firstrel[v][k] = v * KV_W + k < nr ? kv_rel(first[v * KV_W + k], j0) : 0;
        const float c = J->cap, ic = 1.0f / c;
        for (int p = 0; p < np; p++) {
            const kv_vi sink = (kv_vi)KV_REP(j0 + p < J->sink_n ? -1 : 0), pv = (kv_vi)KV_REP(p);
            for (int v = 0; v < KV_BV; v++) {
                float* sp = sT + (size_t)p * KV_RS + v * KV_W;
                kv_vi keep = (pv <= lastrel[v]) & (sink | (pv >= firstrel[v]));
                kv_vf x = kv_loadf(sp);
                if (c > 0.0f) x = kv_softcap(x, c, ic);
                kv_storef(sp, (kv_vf)(((kv_vi)x & keep) | ((kv_vi)kv_splat(-INFINITY) & ~keep)));
            }
        }
    }

    /* One row-wise block (rows [r0, r1), the rest of its KV_ROWS lanes masked) over the
       positions [p0, p1) of one split: queries qt [hkv][d][KV_RS], state w
       (kv_state_floats(KV_ROWS)), scratch x (kv_tile_scratch_floats). */
    KV_INLINE void kv_block_fmt(const int kf0, const int vf0, const kv_job* J, const float* qt, float* w,
                                int64_t p0, int64_t p1, int r0, int r1, float* x) {
        const int H = J->hkv, dp = J->dp, d = J->d, nr = r1 - r0;
        const int kfmt = kf0 == KV_ANY ? J->k.fmt : kf0, vfmt = vf0 == KV_ANY ? J->v.fmt : vf0;
        const size_t rows = (size_t)H * KV_ROWS;
        const size_t sc = kv_scale_floats(J);
        float* m = w;
        float* l = m + KV_ROUND16(rows);
        float* acc = l + rows * KV_W;
        float* sT = x;
        float* ksc = sT + (size_t)KV_RS * KV_P;
        float* vsc = ksc + sc;
        const int ts = kv_tile_stride(dp);
        float* kf = vsc + sc;
        float* vf = kf + (size_t)KV_P * ts;
        for (size_t i = 0; i < rows; i++) m[i] = -INFINITY;
        memset(l, 0, rows * KV_W * sizeof(float));
        memset(acc, 0, rows * dp * sizeof(float));
        const int64_t end = J->last[r1 - 1] + 1 < p1 ? J->last[r1 - 1] + 1 : p1;
        int64_t lastb[KV_ROWS];
        for (int r = 0; r < KV_ROWS; r++) lastb[r] = r < nr ? J->last[r0 + r] : -1;
        int64_t rowf[KV_P];
        kv_tile tiles[2];
        kv_tile *tile = &tiles[0], *nxt = &tiles[1];
        int64_t nj = -1;   /* the tile whose rows nxt holds */
        /* the first position past the sink positions that some row of the block sees
           (first[] grows with r): tiles wholly before it and past the sink positions are
           hidden from every row and not read (a windowed prefill costs T x W) */
        const int64_t first = J->first[r0];
        for (int64_t j0 = p0; j0 < end; j0 += KV_P) {
            const int np = (int)(p1 - j0 < KV_P ? p1 - j0 : KV_P);
            if (j0 + np <= first && j0 >= J->sink_n) continue;
            if (nj == j0) { kv_tile* t = tile; tile = nxt; nxt = t; }
            else kv_tile_rows(J, j0, np, tile);
            /* the next tile read (past the hidden ones), whose head 0 the last head
               prefetches */
            nj = j0 + KV_P;
            if (nj >= J->sink_n && nj + KV_P <= first) nj = p0 + (first - p0) / KV_P * KV_P;
            const int more = nj < end;
            if (more) {
                kv_tile_rows(J, nj, (int)(p1 - nj < KV_P ? p1 - nj : KV_P), nxt);
                kv_prefetch_scales(&J->k, nxt);
                kv_prefetch_scales(&J->v, nxt);
            }
            kv_tile_scales(kfmt, &J->k, H, tile, ksc);
            kv_tile_scales(vfmt, &J->v, H, tile, vsc);
            kv_vi lastrel[KV_BV];
            for (int v = 0; v < KV_BV; v++)
                for (int k = 0; k < KV_W; k++) {
                    int64_t t = lastb[v * KV_W + k] - j0;
                    lastrel[v][k] = (int32_t)(t < -1 ? -1 : t > KV_P ? KV_P : t);
                }
            for (int j = 0; j < KV_P; j++) rowf[j] = j < np ? j : np - 1;
            for (int h = 0; h < H; h++) {
                kv_rows k = kv_head_rows(&J->k, J, ksc, tile, h), v = kv_head_rows(&J->v, J, vsc, tile, h);
                const float* kp[KV_P];
                if (kfmt == KV_F32) {
                    for (int j = 0; j < KV_P; j++) kp[j] = (const float*)(k.c + k.ph[j] * k.cs);
                } else {
                    kv_decode_rows_in(kf0, kfmt, k, np, kf, dp, ts);
                    for (int j = 0; j < KV_P; j++) kp[j] = kf + (size_t)rowf[j] * ts;
                }
                /* V rows decoded (f32: copied) into vf, ts floats apart: the value
                   blocks walk the tile's rows once per block of rows, and f32 rows read in
                   place lie Hkv * D * 4 bytes apart (4 KiB at Hkv = 8, D = 128: a tile's
                   rows all in the same few L1 sets); copied, f32 causal prefill ran 1.2x
                   faster at 4096 tokens on a Zen 5 core */
                kv_decode_rows_in(vf0, vfmt, v, np, vf, dp, ts);
                const kv_rows vd = {(const char*)vf, (ptrdiff_t)ts * 4, rowf, NULL, 0, d};
                const float* q = qt + (size_t)h * d * KV_RS;
                const float* rs = KV_ROW_SCALED(kfmt) ? ksc + (size_t)h * KV_P : NULL;
                /* the next head's codes (after the last head: the next tile's first),
                   a share per full score block, so the requests overlap the arithmetic */
                const kv_tile* pt = h + 1 < H ? tile : more ? nxt : NULL;
                const int hn = h + 1 < H ? h + 1 : 0, nfull = np / KV_BP;
                const int parts = KV_BV / KV_SV * (nfull ? nfull : 1);
                if (pt && !nfull) kv_prefetch_head(J, pt, hn, 0, 1);
                for (int b = 0; b < KV_BV; b += KV_SV) {
                    const float* qb = q + b * KV_W;
                    float* sb = sT + b * KV_W;
                    int j = 0;
                    for (; j + KV_BP <= np; j += KV_BP) {
                        if (pt) kv_prefetch_head(J, pt, hn, b / KV_SV * nfull + j / KV_BP, parts);
                        kv_block_scores_full(kp + j, d, qb, rs, lastrel + b, j, sb);
                    }
                    for (; j + 4 <= np; j += 4) kv_block_scores_four(kp + j, d, qb, rs, lastrel + b, j, sb);
                    for (; j < np; j++) kv_block_scores_one(kp + j, d, qb, rs, lastrel + b, j, sb);
                }
                if (J->cap > 0.0f || kv_window_cuts(J, J->first[r1 - 1], j0, np))
                    kv_block_variants(J, np, j0, J->first + r0, nr, lastrel, sT);
                /* the online softmax of the row vectors */
                float* mh = m + (size_t)h * KV_ROWS;
                float* lh = l + (size_t)h * KV_ROWS * KV_W;
                float* ah = acc + (size_t)h * KV_ROWS * dp;
                const float* vs = KV_ROW_SCALED(vfmt) ? vsc + (size_t)h * KV_P : NULL;
                for (int b = 0; b < KV_BV; b++) {
                    kv_vf mx = kv_loadf(sT + b * KV_W);
                    for (int p = 1; p < np; p++) mx = kv_max(mx, kv_loadf(sT + (size_t)p * KV_RS + b * KV_W));
                    kv_vf mo = kv_loadf(mh + b * KV_W), mn = kv_max(mo, mx);
                    kv_vi grow = (mx > mo) & (mo > kv_splat(-INFINITY));
                    kv_vf alpha = kv_exp(mo - mn);   /* NaN where both are -inf: not taken */
                    float al[KV_W];
                    kv_storef(al, (kv_vf)(((kv_vi)alpha & grow) | ((kv_vi)kv_splat(1.0f) & ~grow)));
                    for (int k = 0; k < KV_W; k++) {
                        const int r = b * KV_W + k;
                        if (al[k] != 1.0f && r < nr) {
                            kv_vf a = kv_splat(al[k]);
                            for (int i = 0; i < dp; i += KV_W) kv_storef(ah + (size_t)r * dp + i, kv_loadf(ah + (size_t)r * dp + i) * a);
                            lh[(size_t)r * KV_W] *= al[k];
                        }
                    }
                    kv_storef(mh + b * KV_W, mn);
                    kv_vi seen = mn > kv_splat(-INFINITY);
                    kv_vf base = (kv_vf)((kv_vi)mn & seen);   /* 0 where no position is visible yet */
                    kv_vf sum = kv_splat(0.0f);
                    for (int p = 0; p < np; p++) {
                        float* sp = sT + (size_t)p * KV_RS + b * KV_W;
                        kv_vf e = kv_exp(kv_loadf(sp) - base);
                        sum = sum + e;
                        kv_storef(sp, vs ? e * kv_splat(vs[p]) : e);
                    }
                    float su[KV_W];
                    kv_storef(su, sum);
                    for (int k = 0; k < KV_W; k++) lh[(size_t)(b * KV_W + k) * KV_W] += su[k];
                }
                kv_tile_values(nr, vd, np, sT, ah, dp);
            }
        }
    }

    static void kv_block(const kv_job* J, const float* qt, float* w, int64_t p0, int64_t p1, int r0, int r1, float* x) {
        KV_BY_FORMATS(J, kv_block_fmt, J, qt, w, p0, p1, r0, r1, x);
    }

    /* dst [hkv][sr][dp] (row r of head h at h * sr + r - r0) = J->scale * J->qin
       [t][hkv * g][d] for rows [r0, r1), zero-padded; dst NULL: only the check. Returns 0
       when scale * q holds a non-finite value (x * 0 is NaN only for those: q non-finite,
       or scale * q past float32), else 1. */
    static int kv_scale_rows(const kv_job* J, int r0, int r1, float* dst, int sr) {
        const int H = J->hkv, G = J->g, d = J->d, dp = J->dp;
        const float scale = J->scale;
        kv_vf zv = kv_splat(0.0f);
        float z = 0.0f;
        for (int h = 0; h < H; h++)
            for (int r = r0; r < r1; r++) {
                const float* src = J->qin + ((size_t)(r / G) * H * G + (size_t)h * G + r % G) * d;
                float* o = dst ? dst + ((size_t)h * sr + r - r0) * dp : NULL;
                int i = 0;
                for (; i + KV_W <= d; i += KV_W) {
                    kv_vf x = kv_loadf(src + i) * kv_splat(scale);
                    zv = zv + x * kv_splat(0.0f);
                    if (o) kv_storef(o + i, x);
                }
                for (; i < d; i++) { float x = src[i] * scale; z = z + x * 0.0f; if (o) o[i] = x; }
                if (o) for (; i < dp; i++) o[i] = 0.0f;
            }
        for (int k = 0; k < KV_W; k++) z = z + zv[k];
        return z == 0.0f;
    }

    /* J->last [r] and J->first [r]; split-wise J->q = the scaled queries (row-wise: only
       their check, each work item scales its own rows), with qi also their int8 records
       J->qx. Returns kv_scale_rows' verdict. */
    static int kv_prepare(kv_job* J, float scale, int causal) {
        J->scale = scale;
        for (int r = 0; r < J->r; r++) J->last[r] = causal ? J->n - J->t + r / J->g : J->n - 1;
        for (int r = 0; r < J->r; r++)
            J->first[r] = J->win && J->last[r] >= J->win ? J->last[r] - J->win + 1 : 0;
        const int ok = kv_scale_rows(J, 0, J->r, J->q, J->r);
        if (ok && J->qx)
            for (size_t hr = 0; hr < (size_t)J->hkv * J->r; hr++)
                kv_quant_row(J->q + hr * J->dp, J->d, J->qx + hr * KV_QREC(J->d), NULL);
        return ok;
    }

    /* out [t][hkv * g][d] rows [r0, r1) of every head = the J->nsplit split states at w
       (stride floats apart, sr rows per head, row r at h * sr + ro + r - r0) merged by
       log-sum-exp and normalised; J->lse [t][hkv * g] = M + log(sum of the weights
       e^(s - M)) over the scores s (scaled, base e) when not NULL. Returns how many of
       the rows hold a value that is not finite. out may be J->q (split-wise, once every
       split is done). */
    static int kv_merge_rows(const kv_job* J, const float* w, size_t stride, int sr, int ro, int r0, int r1, float* out) {
        const int H = J->hkv, G = J->g, d = J->d, dp = J->dp, nsplit = J->nsplit;
        const size_t lo = KV_ROUND16((size_t)H * sr), ao = lo + (size_t)H * sr * KV_W;   /* offsets of l, acc */
        float c[nsplit];
        int bad = 0;
        for (int h = 0; h < H; h++)
            for (int r = r0; r < r1; r++) {
                const size_t hr = (size_t)h * sr + ro + r - r0;
                const size_t at = (size_t)(r / G) * H * G + (size_t)h * G + r % G;   /* [t][hq] */
                float top = J->sinks ? J->sinks[h * G + r % G] : -INFINITY, den = 0.0f;
                for (int sp = 0; sp < nsplit; sp++) top = w[sp * stride + hr] > top ? w[sp * stride + hr] : top;
                /* every row sees a position (its own), so top is -inf only when all its
                   scores overflowed to -inf: NaN follows, and the call is refused */
                float* o = out + at * d;
                for (int sp = 0; sp < nsplit; sp++) {
                    const float* l = w + sp * stride + lo + hr * KV_W;
                    float sum = 0.0f;
                    for (int k = 0; k < KV_W; k++) sum += l[k];
                    c[sp] = expf(w[sp * stride + hr] - top);
                    den += c[sp] * sum;
                }
                if (J->sinks) den += expf(J->sinks[h * G + r % G] - top);   /* joins the denominator only */
                for (int sp = 0; sp < nsplit; sp++) c[sp] /= den;
                if (J->lse) J->lse[at] = top + logf(den);
                const float* a = w + ao + hr * dp;
                int i = 0;
                for (; i + KV_W <= d; i += KV_W) {
                    kv_vf x = kv_splat(0.0f);
                    for (int sp = 0; sp < nsplit; sp++) x = kv_fma(kv_splat(c[sp]), kv_loadf(a + sp * stride + i), x);
                    kv_storef(o + i, x);
                }
                for (; i < d; i++) {
                    float x = 0.0f;
                    for (int sp = 0; sp < nsplit; sp++) x += c[sp] * a[sp * stride + i];
                    o[i] = x;
                }
                bad += !kv_all_finite(o, d);
            }
        return bad;
    }

    /* Split sp of a split-wise job, all its rows, with a thread's scratch x. */
    static void kv_split_item(const kv_job* J, int sp, float* x) {
        int64_t p0, p1;
        kv_split_range(J, sp, &p0, &p1);
        kv_split(J, J->q, J->w + sp * kv_split_floats(J), J->r, 0, p0, p1, 0, J->r, x);
    }

    /* A split-wise job's splits merged into J->o; returns the rows not finite. */
    static int kv_merge(const kv_job* J) {
        return kv_merge_rows(J, J->w, kv_split_floats(J), J->r, 0, 0, J->r, J->o);
    }

    /* A row-wise job's rows [r0, r1): scaled, attended over every split in turn, merged
       into J->o; x: the thread's scratch (kv_scratch_floats). Returns the rows not finite. */
    static int kv_rows_item(const kv_job* J, int r0, int r1, float* x) {
        const int H = J->hkv, G = J->g, d = J->d;
        float* qt = x + kv_tile_scratch_floats(J);    /* [hkv][d][KV_RS] */
        float* w = qt + (size_t)H * KV_RS * J->dp;
        const size_t stride = kv_state_floats(J, KV_ROWS);
        for (int h = 0; h < H; h++)
            for (int r = 0; r < KV_ROWS; r++) {
                float* o = qt + (size_t)h * d * KV_RS + r;
                if (r0 + r < r1) {
                    const int rr = r0 + r;
                    const float* src = J->qin + ((size_t)(rr / G) * H * G + (size_t)h * G + rr % G) * d;
                    if (J->qi) {   /* the scores of q^ (kv_quant_row), in float32 */
                        float row[d], rec[KV_QREC(d)];
                        for (int i = 0; i < d; i++) row[i] = src[i] * J->scale;
                        kv_quant_row(row, d, rec, row);
                        for (int i = 0; i < d; i++) o[(size_t)i * KV_RS] = row[i];
                    } else {
                        for (int i = 0; i < d; i++) o[(size_t)i * KV_RS] = src[i] * J->scale;
                    }
                } else {
                    for (int i = 0; i < d; i++) o[(size_t)i * KV_RS] = 0.0f;
                }
            }
        for (int sp = 0; sp < J->nsplit; sp++) {
            int64_t p0, p1;
            kv_split_range(J, sp, &p0, &p1);
            kv_block(J, qt, w + sp * stride, p0, p1, r0, r1, x);
        }
        return kv_merge_rows(J, w, stride, KV_ROWS, 0, r0, r1, J->o);
    }

    /* The wrapping sum of the 64-bit words [w0, w1) of p, read as a stream: one vector
       load and add per 4 * KV_W bytes, 4 accumulators. */
    typedef uint64_t kv_vq __attribute__((vector_size(4 * KV_W)));
    static uint64_t kv_stream_sum(const char* p, size_t w0, size_t w1) {
        const size_t lanes = sizeof(kv_vq) / 8;
        kv_vq a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
        size_t i = w0;
        for (; i + 4 * lanes <= w1; i += 4 * lanes) {
            kv_vq x0, x1, x2, x3;
            memcpy(&x0, p + 8 * i, sizeof x0);
            memcpy(&x1, p + 8 * (i + lanes), sizeof x1);
            memcpy(&x2, p + 8 * (i + 2 * lanes), sizeof x2);
            memcpy(&x3, p + 8 * (i + 3 * lanes), sizeof x3);
            a0 += x0; a1 += x1; a2 += x2; a3 += x3;
        }
        a0 += a1 + a2 + a3;
        uint64_t sum = 0;
        for (size_t k = 0; k < lanes; k++) sum += a0[k];
        for (; i < w1; i++) { uint64_t x; memcpy(&x, p + 8 * i, 8); sum += x; }
        return sum;
    }

    /* rounds x 12 independent chains of KV_W-lane multiply-adds, as the kernel issues them
       (kv_fma): more chains than any FMA unit's latency x throughput, so the rate is the
       unit's peak. Returns a value of the chains, which keeps them live. */
    static float kv_fma_burn(int64_t rounds, float seed) {
        const kv_vf m = kv_splat(0.99999994f), c = kv_splat(seed * 1e-7f);
        kv_vf a0 = kv_splat(seed), a1 = a0 + 1, a2 = a0 + 2, a3 = a0 + 3, a4 = a0 + 4, a5 = a0 + 5,
              a6 = a0 + 6, a7 = a0 + 7, a8 = a0 + 8, a9 = a0 + 9, a10 = a0 + 10, a11 = a0 + 11;
        for (int64_t n = 0; n < rounds; n++) {
            a0 = kv_fma(a0, m, c); a1 = kv_fma(a1, m, c); a2 = kv_fma(a2, m, c); a3 = kv_fma(a3, m, c);
            a4 = kv_fma(a4, m, c); a5 = kv_fma(a5, m, c); a6 = kv_fma(a6, m, c); a7 = kv_fma(a7, m, c);
            a8 = kv_fma(a8, m, c); a9 = kv_fma(a9, m, c); a10 = kv_fma(a10, m, c); a11 = kv_fma(a11, m, c);
            KV_PIN(a0); KV_PIN(a1); KV_PIN(a2); KV_PIN(a3); KV_PIN(a4); KV_PIN(a5);
            KV_PIN(a6); KV_PIN(a7); KV_PIN(a8); KV_PIN(a9); KV_PIN(a10); KV_PIN(a11);
        }
        kv_vf t = a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7 + a8 + a9 + a10 + a11;
        return t[0];
    }

    /* rounds passes of one of the kernel's blocks over one tile of KV_P positions of one kv
       head, KV_RB query rows (G = 4), d values: part 0 the scores (kv_scores_of, or with
       qi kv_qscores), part 1 the weighted sum of V (kv_values_of). codes: the tile's rows
       (cs bytes apart) in format fmt, bs: their block scales as float32 (s per row, as
       stored; the blocked formats). Only the blocks: no scale gathers, softmax, prefetch or merging,
       and the tile stays in the L1 cache: the kernel's arithmetic alone, its floor.
       buf: kv_tile_blocks_floats(d) floats. Returns a value of the results (live). */
    static size_t kv_tile_blocks_floats(int d) {
        return 2 * (size_t)KV_RB * KV_ROUND16(d) + (size_t)KV_RB * KV_P + (size_t)KV_RB * KV_QREC(d)
               + 2 * (size_t)KV_P * (d / 16 + 1);
    }
    static float kv_tile_blocks(int fmt, int part, int qi, int64_t rounds, const char* codes, ptrdiff_t cs,
                                const float* bs, int s, int d, float* buf) {
        const int dp = (int)KV_ROUND16(d), qr = (int)KV_QREC(d);
        float* q = buf;
        float* w = q + (size_t)KV_RB * dp;
        float* acc = w + (size_t)KV_RB * KV_P;
        float* qx = acc + (size_t)KV_RB * dp;
        float* ts = qx + (size_t)KV_RB * qr;    /* the tile scales (q4_0: pairs) */
        int64_t ph[KV_P], last[KV_RB];
        for (int j = 0; j < KV_P; j++) ph[j] = j;
        for (int r = 0; r < KV_RB; r++) {
            last[r] = KV_P - 1;
            for (int i = 0; i < dp; i++) {
                q[r * dp + i] = i < d ? 0.01f * (float)((r * 7 + i * 5) % 13 - 6) : 0.0f;
                acc[r * dp + i] = 0.0f;
            }
            for (int j = 0; j < KV_P; j++) w[r * KV_P + j] = 1.0f / KV_P;
            if (qi) kv_quant_row(q + (size_t)r * dp, d, qx + (size_t)r * qr, NULL);
        }
        const int tsn = fmt == KV_Q4_0 ? 2 * s : s;
        if (KV_BLOCKED(fmt)) {
            memcpy(ts, bs, (size_t)KV_P * s * sizeof(float));
            if (fmt == KV_Q4_0) kv_pair_scales(ts, (size_t)KV_P * s);
        }
        const kv_rows rows = {codes, cs, ph, KV_BLOCKED(fmt) ? ts : NULL, tsn, d};
        kv_pf pf;
        memset(&pf, 0, sizeof pf);
        for (int64_t n = 0; n < rounds; n++) {
            if (part == 1) kv_values_of(fmt, KV_RB, rows, KV_P, w, KV_P, 1, acc, dp);
            else if (qi) kv_qscores(fmt, KV_RB, rows, KV_P, qx, qr, NULL, last, 0, w, &pf);
            else kv_scores_of(fmt, KV_RB, rows, KV_P, q, dp, NULL, last, 0, w, &pf);
        }
        return w[0] + acc[0];
    }

    /* out [n] = kv_softcap of x [n] (the scores' soft-capping, for its accuracy test). */
    static void kv_softcap_array(const float* x, size_t n, float c, float* out) {
        const float ic = 1.0f / c;
        size_t i = 0;
        for (; i + KV_W <= n; i += KV_W) kv_storef(out + i, kv_softcap(kv_loadf(x + i), c, ic));
        if (i < n) {
            float buf[KV_W] = {0};
            memcpy(buf, x + i, (n - i) * 4);
            kv_storef(buf, kv_softcap(kv_loadf(buf), c, ic));
            memcpy(out + i, buf, (n - i) * 4);
        }
    }

    /* 1 when x [n] holds no NaN or inf. */
    /* s[j] = exp(s[j] - mx) for j < n (kv_exp: 0 below -87.3 and for -inf, NaN stays
       NaN); returns their sum (per-lane partial sums, then across the lanes). */
    static float kv_exp_sum(float* s, size_t n, float mx) {
        kv_vf acc = kv_splat(0.0f);
        size_t j = 0;
        for (; j + KV_W <= n; j += KV_W) {
            const kv_vf e = kv_exp(kv_loadf(s + j) - kv_splat(mx));
            kv_storef(s + j, e);
            acc += e;
        }
        if (j < n) {
            float t[KV_W];
            for (int i = 0; i < KV_W; i++) t[i] = j + i < n ? s[j + i] : -INFINITY;
            const kv_vf e = kv_exp(kv_loadf(t) - kv_splat(mx));
            kv_storef(t, e);
            for (size_t i = 0; j + i < n; i++) s[j + i] = t[i];
            acc += e;
        }
        float total = 0.0f;
        for (int i = 0; i < KV_W; i++) total += acc[i];
        return total;
    }

    static int kv_all_finite(const float* x, size_t n) {
        uint32_t bad = 0;
        for (size_t i = 0; i < n; i++) {
            uint32_t u;
            memcpy(&u, x + i, 4);
            bad |= (u & 0x7F800000u) == 0x7F800000u;
        }
        return !bad;
    }
    """
    ctypedef struct kv_side:
        const char* c
        const char* sc
        ptrdiff_t cs, ch, ss, sh
        int fmt, s
    ctypedef struct kv_job:
        kv_side k, v
        int d, dp, hkv, g, t, r
        const int32_t* table
        int64_t ps, n, lo, sa, chunk
        int nsw, nsplit
        int64_t win, sink_n
        const float* sinks
        float cap
        const float* qin
        float* out
        float* lse
        float scale
        int qi
        float* w
        float* q
        float* qx
        float* o
        int64_t* last
        int64_t* first
    size_t kv_split_floats(const kv_job* J) noexcept nogil
    size_t kv_scratch_floats(const kv_job* J) noexcept nogil
    enum: KV_ROWS
    size_t kv_job_floats(const kv_job* J) noexcept nogil
    float* kv_job_place(kv_job* J, float* buf) noexcept nogil
    int kv_prepare(kv_job* J, float scale, int causal) noexcept nogil
    void kv_split(const kv_job* J, const float* q, float* w, int sr, int ro, int64_t p0, int64_t p1,
                  int r0, int r1, float* x) noexcept nogil
    void kv_split_item(const kv_job* J, int sp, float* x) noexcept nogil
    int kv_merge(const kv_job* J) noexcept nogil
    int kv_rows_item(const kv_job* J, int r0, int r1, float* x) noexcept nogil
    bint KV_ROWWISE(const kv_job* J) noexcept nogil
    int kv_all_finite(const float* x, size_t n) noexcept nogil
    float kv_exp_sum(float* s, size_t n, float mx) noexcept nogil
    uint64_t kv_stream_sum(const char* p, size_t w0, size_t w1) noexcept nogil
    float kv_fma_burn(int64_t rounds, float seed) noexcept nogil
    size_t kv_tile_blocks_floats(int d) noexcept nogil
    float kv_tile_blocks(int fmt, int part, int qi, int64_t rounds, const char* codes, ptrdiff_t cs,
                         const float* bs, int s, int d, float* buf) noexcept nogil
    int KV_P
    int KV_RB
    enum: KV_F32, KV_F16, KV_BF16, KV_INT8, KV_E4M3, KV_E5M2, KV_Q8_0, KV_Q4_0, KV_Q4_1
    void kv_softcap_array(const float* x, size_t n, float c, float* out) noexcept nogil
    void kv_quant_row(const float* x, int d, float* rec, float* qhat) noexcept nogil
    size_t KV_QREC(int d) noexcept nogil
    int KV_QD(int d) noexcept nogil
    int KV_QG
    int KV_W
    int posix_memalign(void** p, size_t alignment, size_t size) noexcept nogil
    void free(void* p) noexcept nogil

cdef float exp_sum(float* s, Py_ssize_t n, float mx) noexcept nogil:
    """s[j] = exp(s[j] - mx) for j < n, vectorised (a few float32 ulp; 0 below -87.3 and
    for -inf); returns their sum. For the q4_1ch kernel's softmax (_grouped.pyx)."""
    return kv_exp_sum(s, <size_t>n, mx)


cdef void softcap(float* s, Py_ssize_t n, float c) noexcept nogil:
    """s[j] = c tanh(s[j] / c) for j < n in place, vectorised as this kernel's scores
    (kv_softcap: a few float32 ulp; a score that is not finite becomes NaN). For the
    q4_1ch kernel's softmax (_grouped.pyx)."""
    kv_softcap_array(s, <size_t>n, c, s)


cdef enum:
    MIN_SPLIT = 64   # positions per split at least (a split's start-up costs about that many)


cdef const char* _data(cnp.ndarray a, str name) except NULL:
    if not cnp.PyArray_IS_C_CONTIGUOUS(a):
        raise ValueError(f"attention reads C-contiguous arrays, {name} is not")
    return <const char*>cnp.PyArray_DATA(a)


ROWS_MAX = 2**31 - 1
"""The most query rows per kv head (T x Hq / Hkv) one job takes: the kernel counts them in
a C int."""

cdef enum:
    _OK = 0
    _BAD_Q = 1
    _OVERFLOW = 2

ATTEND_OK, ATTEND_BAD_Q, ATTEND_OVERFLOW = _OK, _BAD_Q, _OVERFLOW

cdef int32_t _page_zero = 0   # the page table of a KVCache: one page of N rows


cdef int _side(kv_side* x, cnp.ndarray codes, scales, int fmt, str which) except -1:
    """One side (K or V) of a layer's storage in its format."""
    x.c = _data(codes, f"{which}_codes")
    x.cs = codes.strides[0]
    x.ch = codes.strides[1]
    x.sc = NULL
    x.ss = x.sh = x.s = 0
    if scales is not None:
        x.sc = _data(scales, f"{which}_scales")
        x.ss = (<cnp.ndarray>scales).strides[0]
        x.sh = (<cnp.ndarray>scales).strides[1]
        x.s = <int>(<cnp.ndarray>scales).shape[2]
    x.fmt = fmt
    return 0


cdef int _layer_job(kv_job* J, cnp.ndarray k_codes, cnp.ndarray v_codes, k_scales, v_scales,
                    int k_fmt, int v_fmt, int hq) except -1:
    """The fields of J that every sequence of one layer shares."""
    _side(&J.k, k_codes, k_scales, k_fmt, "k")
    _side(&J.v, v_codes, v_scales, v_fmt, "v")
    J.d = <int>k_codes.shape[2] * (2 if k_fmt == KV_Q4_0 or k_fmt == KV_Q4_1 else 1)   # 2 codes per byte
    J.dp = (J.d + 15) // 16 * 16
    J.hkv = <int>k_codes.shape[1]
    J.g = hq // J.hkv
    return 0


cdef void _seq_job(kv_job* J, int T, int64_t n, int threads, int64_t window,
                   int64_t sink_tokens) noexcept nogil:
    """J's split of the positions its rows see: equal splits (multiples of 16), one per
    thread, MIN_SPLIT positions at least, of [lo, n), lo the first position the first
    token's window holds (0 without a window: [0, n), as always), then one split of the
    sink positions below lo, [0, min(S, lo)). The same for a sequence wherever its
    positions are stored; positions outside them (a window's past) are never read, their
    pages not even looked up. window 0: none (then sink_tokens is 0); causal with a window."""
    cdef int64_t m
    J.t = T
    J.r = T * J.g
    J.n = n
    J.win = window
    J.sink_n = sink_tokens
    J.lo = n - T + 1 - window if window and n - T + 1 > window else 0
    J.sa = min(sink_tokens, J.lo)
    m = n - J.lo
    J.nsw = <int>max(1, min(threads, m // MIN_SPLIT))
    J.chunk = ((m + J.nsw - 1) // J.nsw + 15) // 16 * 16
    J.nsw = <int>((m + J.chunk - 1) // J.chunk)
    J.nsplit = J.nsw + (1 if J.sa > 0 else 0)


cdef int _run(kv_job* jobs, int nj, float scale, bint causal, int threads) except -1:
    """Runs the jobs (fields set but q, o, last, w): one workspace, every job's q checked
    (_BAD_Q, nothing written, when a scaled q holds a non-finite value), then every work
    item on up to `threads` threads (run_threads' when the items are few): a split of a
    split-wise job (merged once all its splits are done), a block of KV_ROWS rows of a
    row-wise job (merged by the item). The results go to out when every value of every
    job is finite (else _OVERFLOW, nothing written but lse); returns _OK."""
    cdef size_t total = 0, scratch = 0
    cdef int b, it, sp, r0, nitems = 0, bad = 0, nt, status = _OK
    cdef bint one_split_each = nj == 1
    cdef void* buf = NULL
    cdef float* place
    cdef float* xs
    for b in range(nj):
        total += kv_job_floats(&jobs[b])
        scratch = max(scratch, kv_scratch_floats(&jobs[b]))
        if KV_ROWWISE(&jobs[b]):
            nitems += (jobs[b].r + KV_ROWS - 1) // KV_ROWS
            one_split_each = False
        else:
            total += jobs[b].nsplit * kv_split_floats(&jobs[b])
            nitems += jobs[b].nsplit
    nt = min(threads, nitems)
    if nitems < 4 * threads:   # a few items each: a parked thread would hold up the call
        nt = min(nt, run_threads(threads))
    total += max(nt, 1) * scratch
    cdef int* items = <int*>malloc(3 * max(nitems, 1) * sizeof(int))   # (job, split or -1, r0)
    if items == NULL or posix_memalign(&buf, 64, (total if total else 1) * sizeof(float)):
        free(items)
        raise MemoryError("decode attention: workspace allocation failed")
    xs = <float*>buf
    place = xs + max(nt, 1) * scratch
    it = 0
    for b in range(nj):
        place = kv_job_place(&jobs[b], place)
        if KV_ROWWISE(&jobs[b]):
            # the last rows first: under the causal mask they see the most positions
            for r0 in range((jobs[b].r - 1) // KV_ROWS * KV_ROWS, -1, -KV_ROWS):
                items[3 * it] = b
                items[3 * it + 1] = -1
                items[3 * it + 2] = r0
                it += 1
        else:
            jobs[b].w = place
            place += jobs[b].nsplit * kv_split_floats(&jobs[b])
            for sp in range(jobs[b].nsplit):
                items[3 * it] = b
                items[3 * it + 1] = sp
                items[3 * it + 2] = 0
                it += 1
    with nogil:
        if nj > 1 and nt > 1:
            for b in prange(nj, num_threads=nt, schedule="static"):
                bad += 1 - kv_prepare(&jobs[b], scale, causal)
        else:
            for b in range(nj):
                bad += 1 - kv_prepare(&jobs[b], scale, causal)
        if bad == 0:
            if nt <= 1:
                for it in range(nitems):
                    bad += _item(jobs, items, it, xs)
            elif one_split_each:   # equal splits of one sequence: one per thread (the
                # sink split, small, goes round to the first thread)
                for it in prange(nitems, num_threads=nt, schedule="static", chunksize=1):
                    bad += _item(jobs, items, it, xs + threadid() * scratch)
            else:           # unequal items: taken as threads come free
                for it in prange(nitems, num_threads=nt, schedule="dynamic"):
                    bad += _item(jobs, items, it, xs + threadid() * scratch)
            # split-wise jobs merged into their own q buffer (hkv * r * dp >= t * Hq * D
            # floats); out written only when the whole call is finite
            if nj > 1 and nt > 1:
                for b in prange(nj, num_threads=nt, schedule="static"):
                    if not KV_ROWWISE(&jobs[b]):
                        bad += kv_merge(&jobs[b])
            else:
                for b in range(nj):
                    if not KV_ROWWISE(&jobs[b]):
                        bad += kv_merge(&jobs[b])
            if bad == 0:
                for b in range(nj):
                    memcpy(jobs[b].out, jobs[b].o, _out_floats(&jobs[b]) * sizeof(float))
            else:
                status = _OVERFLOW
        else:
            status = _BAD_Q
        free(buf)
        free(items)
    return status


cdef inline size_t _out_floats(const kv_job* J) noexcept nogil:
    """Floats of a job's output rows: t * Hq * D."""
    return <size_t>J.t * J.hkv * J.g * J.d


cdef inline int _item(kv_job* jobs, const int* items, int it, float* scratch) noexcept nogil:
    """Work item `it` with a thread's scratch; returns the rows it made that are not finite
    (a row-wise block, merged here), else 0."""
    cdef kv_job* J = &jobs[items[3 * it]]
    cdef int sp = items[3 * it + 1]
    cdef int r0 = items[3 * it + 2]
    if sp < 0:
        return kv_rows_item(J, r0, min(J.r, r0 + KV_ROWS), scratch)
    kv_split_item(J, sp, scratch)
    return 0


cdef int _variant_job(kv_job* J, sinks, float softcap, int64_t window, int64_t sink_tokens,
                      bint causal, int hq, bint int8_scores) except -1:
    """The sink logits, soft-capping and int8 scores of J (window and sink_tokens are
    _seq_job's), after the checks the kernel relies on."""
    if int8_scores and J.k.fmt not in (3, 6, 7, 8):
        raise ValueError(f"attend: int8 scores read int8 (3), q8_0 (6), q4_0 (7) or q4_1 (8) "
                         f"K codes, not format {J.k.fmt}")
    J.qi = int8_scores
    if window < 0 or sink_tokens < 0 or (sink_tokens and not window) or (window and not causal):
        raise ValueError(f"attend: window {window}, sink_tokens {sink_tokens}, causal {causal}: "
                         f"a window needs causal, sink positions a window")
    if not softcap >= 0 or softcap == float("inf"):
        raise ValueError(f"attend: softcap {softcap} is not finite and >= 0")
    J.cap = softcap
    J.sinks = NULL
    if sinks is not None:
        if cnp.PyArray_TYPE(<cnp.ndarray>sinks) != cnp.NPY_FLOAT32 or \
                (<cnp.ndarray>sinks).ndim != 1 or (<cnp.ndarray>sinks).shape[0] != hq:
            raise ValueError(f"attend: sinks must be float32 [{hq}]")
        J.sinks = <const float*>_data(<cnp.ndarray>sinks, "sinks")
    return 0


def attend(cnp.ndarray q, cnp.ndarray k_codes, cnp.ndarray v_codes, k_scales, v_scales, int k_fmt,
           int v_fmt, Py_ssize_t n, float scale, bint causal, cnp.ndarray out, lse=None, *,
           int64_t window=0, int64_t sink_tokens=0, sinks=None, float softcap=0,
           bint int8_scores=False):
    """out [T, Hq, D] float32 = softmax(scale * q K^T) V over positions [0, n) of a
    KVCache's layer (storage row p holds position p: one page of N rows). Returns
    ATTEND_OK, or (out untouched) ATTEND_BAD_Q when scale * q holds a non-finite value and
    ATTEND_OVERFLOW when a score or the weighted sum of V overflowed float32 (the result
    is made in the workspace and copied to out only when every value is finite).

    IN q float32 [T, Hq, D]; k_codes [N, Hkv, W] code dtype of format id `k_fmt`, k_scales
    [N, Hkv, S] its scale dtype or None (S = 0); v_codes, v_scales the same in format id
    `v_fmt` (k_fmt, or another: a K/V pair; the scores read K's codes, the weighted sums
    V's); all C-contiguous.
    1 <= n <= N, T <= n when causal, T * Hq / Hkv <= ROWS_MAX. OUT out float32 [T, Hq, D]
    C-contiguous (may be q itself); lse float32 [T, Hq] C-contiguous or None. The caller
    (attention.py) validates shapes and dtypes; this only reads.
    Variants (docs/variants.md), all off by default: window W >= 1 (0: none; causal only):
    token t sees (p - W, p], p = n - T + t; sink_tokens S (with a window): positions
    [0, S) stay visible; sinks float32 [Hq] C-contiguous, finite, or None: a logit per
    query head in each softmax denominator (and lse); softcap c > 0 (0: none): scores
    become c tanh(s / c). Positions outside every row's window and the sink positions are
    never read. int8_scores (K int8, q8_0, q4_0 or q4_1): the scores of q^, each scaled query row
    quantized per block of 32 (quantize_query), as integer dot products with K's codes.
    """
    cdef kv_job J
    cdef Py_ssize_t rows = q.shape[0] * (q.shape[1] // k_codes.shape[1])
    if rows > ROWS_MAX:
        raise ValueError(f"attend: {rows} rows per kv head exceed a C int")
    _layer_job(&J, k_codes, v_codes, k_scales, v_scales, k_fmt, v_fmt, <int>q.shape[1])
    J.table = &_page_zero
    J.ps = k_codes.shape[0]
    J.qin = <const float*>_data(q, "q")
    J.out = <float*>_data(out, "out")
    J.lse = NULL if lse is None else <float*>_data(<cnp.ndarray>lse, "lse")
    _variant_job(&J, sinks, softcap, window, sink_tokens, causal, <int>q.shape[1], int8_scores)
    _seq_job(&J, <int>q.shape[0], n, num_threads(), window, sink_tokens)
    return _run(&J, 1, scale, causal, num_threads())


def attend_paged(cnp.ndarray q, cnp.ndarray k_codes, cnp.ndarray v_codes, k_scales, v_scales,
                 int k_fmt, int v_fmt, Py_ssize_t page_size, const int32_t[:, ::1] tables,
                 const int64_t[::1] lengths, const int64_t[::1] counts, float scale,
                 bint causal, cnp.ndarray out, lse=None, *, int64_t window=0,
                 int64_t sink_tokens=0, sinks=None, float softcap=0, bint int8_scores=False):
    """Attention of B sequences' new tokens, each over its own positions, in one call;
    returns ATTEND_OK, ATTEND_BAD_Q or ATTEND_OVERFLOW (out untouched), as `attend`.

    Sequence b has counts[b] query tokens (rows [c_b, c_b + counts[b]) of q, c_b the sum
    of the counts before it) and attends its positions [0, lengths[b]), position p in
    storage row tables[b, p // page_size] * page_size + p % page_size. Each sequence is
    split as `attend` splits a KVCache of the same positions, so its output is the same
    bits. IN q float32 [sum counts, Hq, D]; k_codes, v_codes [P * page_size, Hkv, W],
    scales [P * page_size, Hkv, S] or None, each side in its format (k_fmt, v_fmt); tables int32 [B, M] (M * page_size >= every
    length, entries < P); lengths, counts int64 [B] (counts[b] <= lengths[b] when causal,
    lengths[b] >= 1 when counts[b] >= 1, counts[b] * Hq / Hkv <= ROWS_MAX). OUT out as q
    (may be q); lse float32 [sum counts, Hq] or None. Checked by the caller (pool.py /
    attention.py). The variants as `attend`'s, the same for every sequence: with a window,
    a sequence's table entries of pages that hold none of the positions its rows see (the
    window's past, below the sink positions) are never read (they may be -1).
    """
    cdef Py_ssize_t B = lengths.shape[0], b, row = 0
    cdef int nj = 0, hq = <int>q.shape[1], d = <int>q.shape[2], threads = num_threads()
    cdef kv_job base
    cdef const float* qp = <const float*>_data(q, "q")
    cdef float* op = <float*>_data(out, "out")
    cdef float* lp = NULL if lse is None else <float*>_data(<cnp.ndarray>lse, "lse")
    _layer_job(&base, k_codes, v_codes, k_scales, v_scales, k_fmt, v_fmt, hq)
    _variant_job(&base, sinks, softcap, window, sink_tokens, causal, hq, int8_scores)
    cdef kv_job* jobs = <kv_job*>calloc(max(B, 1), sizeof(kv_job))
    if jobs == NULL:
        raise MemoryError("decode attention: job allocation failed")
    try:
        for b in range(B):
            if counts[b] > 0:
                jobs[nj] = base
                jobs[nj].table = &tables[b, 0]
                jobs[nj].ps = page_size
                jobs[nj].qin = qp + row * hq * d
                jobs[nj].out = op + row * hq * d
                jobs[nj].lse = NULL if lp == NULL else lp + row * hq
                _seq_job(&jobs[nj], <int>counts[b], lengths[b], threads, window, sink_tokens)
                nj += 1
            row += counts[b]
        return _run(jobs, nj, scale, causal, threads)
    finally:
        free(jobs)


def stream_sum(const unsigned char[::1] buf) -> int:
    """The wrapping uint64 sum of buf's 64-bit words (buf's length a multiple of 8) on
    num_threads() threads, each a contiguous range: the rate at which this machine streams
    bytes from memory to the vector registers on those threads, the memory limit of decode
    attention over the same bytes (tools/bench_attention.py's probe)."""
    cdef size_t words = buf.shape[0] // 8, per, w0
    cdef int nt = num_threads(), t
    cdef uint64_t total = 0
    if buf.shape[0] % 8:
        raise ValueError(f"stream_sum reads 64-bit words, got {buf.shape[0]} bytes")
    if words == 0:
        return 0
    cdef const char* p = <const char*>&buf[0]
    per = ((words + nt - 1) // nt + 7) // 8 * 8
    with nogil:
        for t in prange(nt, num_threads=nt, schedule="static"):
            w0 = min(words, t * per)
            total += kv_stream_sum(p, w0, min(words, w0 + per))
    return total


def softcap_values(const float[::1] x, float c, float[::1] out):
    """out = c * tanh(x / c) as the kernels compute it (soft-capping of the scores, c > 0
    finite; a non-finite x gives NaN): for its accuracy test."""
    if not 0 < c < float("inf") or out.shape[0] != x.shape[0]:
        raise ValueError("softcap_values: c finite > 0, and out of x's length")
    if x.shape[0]:
        kv_softcap_array(&x[0], x.shape[0], c, &out[0])


def quantize_query(const float[:, ::1] x):
    """(codes int8 [n, d], scales float32 [n, ceil(d / 32)], qhat float32 [n, d]) of the
    rows of x (finite) as int8 scores quantize the scaled query rows: per block of 32
    values, qhat = scales * codes (docs/attention.md, "Int8 scores"); for its tests."""
    cdef Py_ssize_t n = x.shape[0], r
    cdef int d = <int>x.shape[1], dq = KV_QD(d), b, nb = (d + 31) // 32
    codes = np.zeros((n, d), np.int8)
    scales = np.zeros((n, nb), np.float32)
    qhat = np.zeros((n, d), np.float32)
    cdef signed char[:, ::1] c = codes
    cdef float[:, ::1] sc = scales
    cdef float[:, ::1] qh = qhat
    cdef float* rec = <float*>malloc(KV_QREC(d) * sizeof(float))
    if rec == NULL:
        raise MemoryError
    try:
        for r in range(n):
            kv_quant_row(&x[r, 0], d, rec, &qh[r, 0])
            memcpy(&c[r, 0], rec, d)
            for b in range(nb):
                sc[r, b] = rec[dq // 4 + dq // KV_QG + b * 32 // KV_QG]
    finally:
        free(rec)
    return codes, scales, qhat


def fma_burn(int64_t rounds) -> int:
    """Runs rounds x 12 independent chains of vector multiply-adds (the kernel's float32
    vectors and FMA instruction) on each of num_threads() threads; returns the float32
    multiply-adds done. Timed, it gives this machine's arithmetic limit on those threads:
    decode attention needs 2 * G * D multiply-adds per position and kv head whatever the
    format (tools/bench_attention.py's FMA limit)."""
    cdef int nt = num_threads(), t
    cdef float sink = 0
    if rounds < 0:
        raise ValueError(f"fma_burn takes rounds >= 0, got {rounds}")
    with nogil:
        for t in prange(nt, num_threads=nt, schedule="static"):
            sink += kv_fma_burn(rounds, <float>(t + 1))
    return int(rounds) * 12 * KV_W * nt if sink == sink else 0


def tile_blocks(int fmt, const unsigned char[:, ::1] codes, scales, int d, int part, int64_t rounds,
                bint int8_scores=False) -> float:
    """Runs rounds passes of one block of the decode kernel on one thread over one tile of
    TILE = 64 positions of one kv head, in cache: codes [TILE, row bytes] the tile's rows
    in format id fmt (d values each), scales [TILE, S] float32 C-contiguous their block
    scales (q8_0, q4_0, q4_1; None for the other formats). part 0: the scores of G = 4 query rows (int8_scores: the
    int8 scores); part 1: their weighted sum of the V rows. Only the blocks, without a
    tile's other work (scale gathers, softmax, prefetch, merging): timed, the floor of
    the kernel's arithmetic (tools/bench_attention.py). Returns a value of the results."""
    # the kernel's own sizes (kvcore.formats holds them for the library; this module
    # imports no Python module of kvcore's): bytes per value, block scales per row
    cdef bint q4 = fmt == KV_Q4_0 or fmt == KV_Q4_1, blocked = q4 or fmt == KV_Q8_0
    cdef int code_bytes = 4 if fmt == KV_F32 else 2 if fmt <= KV_BF16 else 1   # q4: 1/2
    cdef const float[:, ::1] sc = scales if blocked else None
    if codes.shape[0] != KV_P or blocked and sc.shape[0] != KV_P:
        raise ValueError(f"tile_blocks takes {KV_P} rows, got {codes.shape[0]} and "
                         f"{sc.shape[0] if blocked else None}")
    if not KV_F32 <= fmt <= KV_Q4_1 or part not in (0, 1) or rounds < 0 or d < 1 \
            or codes.shape[1] * (2 if q4 else 1) < d * code_bytes \
            or blocked and (d % 32 or sc.shape[1] != d // 32 * (2 if fmt == KV_Q4_1 else 1)) \
            or (scales is not None) != blocked or int8_scores and not (blocked or fmt == KV_INT8):
        raise ValueError(f"tile_blocks: bad format id {fmt}, part {part}, rounds {rounds}, d {d}, "
                         f"row bytes {codes.shape[1]}, scales "
                         f"{None if scales is None else np.shape(scales)} or int8_scores {bool(int8_scores)}")
    cdef float* buf = <float*>malloc(kv_tile_blocks_floats(d) * sizeof(float))
    cdef float r
    if buf == NULL:
        raise MemoryError("tile_blocks")
    try:
        with nogil:
            r = kv_tile_blocks(fmt, part, int8_scores, rounds, <const char*>&codes[0, 0], codes.shape[1],
                               &sc[0, 0] if blocked else NULL, <int>sc.shape[1] if blocked else 0, d, buf)
    finally:
        free(buf)
    return r

TILE = KV_P
"""int: positions per tile of the decode kernel (tile_blocks' rows)."""


cdef void _rotate(char* x, Py_ssize_t es, const double* c, const double* s,
                  Py_ssize_t half, bint neox) noexcept nogil:
    """One head's rotary pairs in place: x its first value, es the byte stride between
    values; pair i (NEOX (i, i + half), NORM (2i, 2i + 1)) turns by (c[i], s[i])."""
    cdef Py_ssize_t i
    cdef double x0, x1
    cdef float* f = <float*>x
    cdef float v0, v1
    if es == 4 and (<size_t>x) % 4 == 0:   # unit stride: loops the compiler vectorises
        if neox:
            for i in range(half):
                x0 = f[i]
                x1 = f[i + half]
                f[i] = <float>(x0 * c[i] - x1 * s[i])
                f[i + half] = <float>(x0 * s[i] + x1 * c[i])
        else:
            for i in range(half):
                x0 = f[2 * i]
                x1 = f[2 * i + 1]
                f[2 * i] = <float>(x0 * c[i] - x1 * s[i])
                f[2 * i + 1] = <float>(x0 * s[i] + x1 * c[i])
        return
    cdef Py_ssize_t a, b
    for i in range(half):
        a = i if neox else 2 * i
        b = i + half if neox else 2 * i + 1
        memcpy(&v0, x + a * es, 4)
        memcpy(&v1, x + b * es, 4)
        x0, x1 = v0, v1
        v0 = <float>(x0 * c[i] - x1 * s[i])
        v1 = <float>(x0 * s[i] + x1 * c[i])
        memcpy(x + a * es, &v0, 4)
        memcpy(x + b * es, &v1, 4)


def rope(float[:, :, :] x, const int64_t[::1] positions, const double[::1] inv_freq,
         bint neox):
    """Rotates x in place. IN/OUT x float32 [T, H, D], any strides; IN positions int64
    [T]; inv_freq float64 [R/2] (R = rotary_dim, even, <= D): pair i turns by
    positions[t] * inv_freq[i], angle and rotation in float64. NEOX pairs (i, i + R/2),
    NORM pairs (2i, 2i + 1)."""
    cdef Py_ssize_t T = x.shape[0], H = x.shape[1], half = inv_freq.shape[0]
    cdef Py_ssize_t t, i, hh
    cdef double ang
    cdef double* cs
    cdef char* base = <char*>&x[0, 0, 0] if x.shape[0] and x.shape[1] else NULL
    cdef int failed = 0
    for t in prange(T, nogil=True, num_threads=threads_for(T * H * 2 * half), schedule="static"):
        cs = <double*>malloc(2 * half * sizeof(double))   # cos, then sin, of each pair
        if cs == NULL:
            failed += 1   # a reduction (a plain assignment in a prange is lastprivate)
        else:
            for i in range(half):
                ang = positions[t] * inv_freq[i]
                cs[i] = cos(ang)
                cs[half + i] = sin(ang)
            for hh in range(H):
                _rotate(base + t * x.strides[0] + hh * x.strides[1], x.strides[2], cs,
                        cs + half, half, neox)
            free(cs)
    if failed:
        raise MemoryError(f"rope: {2 * half} doubles of angles")
