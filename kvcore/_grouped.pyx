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
2. Threads take the (sequence, kv head) items. Per item, its R = T * G query rows are
   scaled first.
   Scores of a complete group, for its 32 positions at once: the group's values decode
   once into floats [D][32] (per channel its 16 code bytes, low nibbles positions 0-15,
   high 16-31, each code * d + m: the stored values exactly, two float32 roundings as
   `dequantize`; the slot's scales converted together), then each row adds one broadcast
   q_c times channel c's 32 values per channel (a fused multiply-add over 32 lanes the
   compiler vectorises: two zmm or four ymm registers) into one of 4 sets of 32
   accumulators (c % 4: independent chains, sums of D/4 terms), summed pairwise at the
   end. (Splitting the score into sum_c (q_c d_c)
   code + sum_c q_c m_c saves nothing here and cancels: m is the group's minimum.) The
   open group's scores are dot products with its float16 rows.
   A head's rows lie Hkv rows apart (token-major storage), so the next group's row
   slots (one per slot of the current group, while it decodes), and the next tile's V
   rows and their scales, are prefetched by hand. With a window, groups and
   V tiles that no row sees are skipped (a windowed pool may have released their pages).
3. A softmax per row (max subtracted, the attention kernel's vector exp), then the
   weighted sum of V in tiles of V_TILE positions: the tile's V rows are decoded once per
   head (`_quant.decode_row`), then each row adds them, weighed (fused multiply-adds), to
   its accumulators, 64 columns at a time held in registers across the tile (position by
   position: the order of a plain loop; four independent vector chains). No float copy of K or V is made; per
   head: scores [R][n], accumulators [R][D], one tile of V rows [V_TILE][D] and one
   group's values [D][32] as floats.
4. The caller checks that every output is finite (attention.py), so a refused call leaves
   its out untouched.
"""
from libc.math cimport INFINITY, expf, fmaf, logf, tanhf
from libc.stdint cimport int32_t, int64_t, uint8_t, uint16_t, uint64_t
from libc.stdlib cimport calloc, free, malloc
from libc.string cimport memcpy
from cython.parallel cimport prange
cimport numpy as cnp

import numpy as np

from kvcore._attention cimport exp_sum
from kvcore._quant cimport F16, decode_row
from kvcore._parallel cimport num_threads

cnp.import_array()

cdef enum:
    GROUP = 32      # positions per group of q4_1ch
    GROUP_BYTES = 16    # code bytes of one channel's group (two 4-bit codes per byte)
    V_TILE = 16         # V rows decoded, then weighed, at a time


cdef inline void _group_scores(const float* q, Py_ssize_t R, Py_ssize_t D,
                               const uint8_t* codes, Py_ssize_t code_stride,
                               const uint16_t* scales, Py_ssize_t scale_stride,
                               float* s, Py_ssize_t s_stride, float* lanes,
                               const uint8_t* next_codes, const uint16_t* next_scales) noexcept nogil:
    """OUT s[r * s_stride + t] (t < 32): the scores of the R rows of q [R][D] over one
    complete group. codes / scales: the group's first row slot of this head; slot j is
    code_stride / scale_stride elements further and holds channels [j D/32, (j+1) D/32),
    16 code bytes and a (d, m) pair each. lanes: D * 32 floats of scratch: the group's
    values [D][32], then D / 16 floats for a slot's scales. next_codes / next_scales: the
    next group's first slot, prefetched slot by slot (NULL: none)."""
    cdef Py_ssize_t per_slot = D // GROUP, j, i, c, r, t
    cdef const uint8_t* b
    cdef float* lane
    cdef float d, m
    cdef float acc[4][GROUP]
    cdef uint8_t by[GROUP_BYTES]
    cdef float* dm = lanes + D * GROUP      # a slot's (d, m) pairs as float32
    for j in range(GROUP):          # decode the group once: channel c -> lanes[c]
        if next_codes != NULL:      # the next group's slot j: spread over the slots, the
                                    # requests overlap the decode (a burst of the group's
                                    # 64 lines at its start left a third of the scores
                                    # waiting past the LLC)
            _prefetch(next_codes + j * code_stride, 16 * per_slot)
            _prefetch(next_scales + j * scale_stride, 4 * per_slot)
        decode_row(F16, scales + j * scale_stride, NULL, 2 * per_slot, dm)
        for i in range(per_slot):
            c = j * per_slot + i
            b = codes + j * code_stride + 16 * i
            d = dm[2 * i]
            m = dm[2 * i + 1]
            lane = lanes + c * GROUP
            memcpy(by, b, GROUP_BYTES)      # a local copy: no store to lane may alias it,
            for t in range(GROUP // 2):     # and loops of one store each: both vectorise
                lane[t] = <float>(by[t] & 15) * d + m
            for t in range(GROUP // 2):
                lane[t + GROUP // 2] = <float>(by[t] >> 4) * d + m
    for r in range(R):
        # per row: 4 x 32 accumulators (channel c into acc[c % 4]: four independent
        # chains, and sums of D/4 terms), one broadcast q_c per channel
        for i in range(4):
            for t in range(GROUP):
                acc[i][t] = 0
        for c in range(0, D, 4):
            for i in range(4):
                _axpy(q[r * D + c + i], lanes + (c + i) * GROUP, acc[i])
        for t in range(GROUP):
            s[r * s_stride + t] = (acc[0][t] + acc[1][t]) + (acc[2][t] + acc[3][t])


cdef inline void _axpy(float a, const float* x, float* y) noexcept nogil:
    """y[t] += a * x[t] (one rounding) for the 32 positions of a group."""
    cdef Py_ssize_t t
    for t in range(GROUP):
        y[t] = fmaf(a, x[t], y[t])


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
    cdef Py_ssize_t j
    cdef float mx = -INFINITY, total = 0, c = var.softcap
    for j in range(n):
        if (causal and j > p) or (var.window and j <= p - var.window and j >= var.sink_tokens):
            s[j] = -INFINITY        # not seen
        elif c != 0:
            s[j] = c * tanhf(s[j] / c)
        mx = s[j] if s[j] > mx else mx
    if var.sinks != NULL:
        mx = var.sinks[head] if var.sinks[head] > mx else mx
        total = expf(var.sinks[head] - mx)
    total = total + exp_sum(s, n, mx)   # exp(-inf) = 0
    if lse != NULL:
        lse[0] = mx + logf(total)
    inv[0] = 1 / total


cdef extern from *:
    """
    /* acc[c] += w[t] * vt[t][c] (one rounding) for t < m, position by position, over D (a
       multiple of 32) in blocks of 4 vectors held in registers across the m rows (four
       independent chains; the last block of D % 64 == 32 columns: 2 AVX-512 vectors). */
    #if defined(__AVX512F__)
    #include <immintrin.h>
    typedef __m512 kvg_v;
    #define KVG_W 16
    #define kvg_load _mm512_loadu_ps
    #define kvg_store _mm512_storeu_ps
    #define kvg_fma _mm512_fmadd_ps
    #define kvg_splat _mm512_set1_ps
    #elif defined(__AVX2__) && defined(__FMA__)
    #include <immintrin.h>
    typedef __m256 kvg_v;
    #define KVG_W 8
    #define kvg_load _mm256_loadu_ps
    #define kvg_store _mm256_storeu_ps
    #define kvg_fma _mm256_fmadd_ps
    #define kvg_splat _mm256_set1_ps
    #endif
    #ifdef KVG_W
    static inline __attribute__((always_inline)) void kvg_block(
            float* acc, const float* w, const float* vt, Py_ssize_t m, Py_ssize_t D, const int nv) {
        kvg_v a[4];
        for (int k = 0; k < nv; k++) a[k] = kvg_load(acc + k * KVG_W);
        for (Py_ssize_t t = 0; t < m; t++) {
            const kvg_v x = kvg_splat(w[t]);
            for (int k = 0; k < nv; k++) a[k] = kvg_fma(x, kvg_load(vt + t * D + k * KVG_W), a[k]);
        }
        for (int k = 0; k < nv; k++) kvg_store(acc + k * KVG_W, a[k]);
    }
    static void kvg_weighted_sum(float* acc, const float* w, const float* vt, Py_ssize_t m, Py_ssize_t D) {
        Py_ssize_t c = 0;
        for (; c + 4 * KVG_W <= D; c += 4 * KVG_W) kvg_block(acc + c, w, vt + c, m, D, 4);
        if (c < D) kvg_block(acc + c, w, vt + c, m, D, (int)((D - c) / KVG_W));   /* 32 columns */
    }
    #else
    #include <math.h>
    static void kvg_weighted_sum(float* acc, const float* w, const float* vt, Py_ssize_t m, Py_ssize_t D) {
        for (Py_ssize_t c = 0; c < D; c++)
            for (Py_ssize_t t = 0; t < m; t++) acc[c] = fmaf(w[t], vt[t * D + c], acc[c]);
    }
    #endif
    """
    void kvg_weighted_sum(float* acc, const float* w, const float* vt, Py_ssize_t m,
                          Py_ssize_t D) noexcept nogil


cdef extern from *:
    void __builtin_prefetch(const void* p) noexcept nogil


cdef inline void _prefetch(const void* p, Py_ssize_t nbytes) noexcept nogil:
    """Asks for the cache lines of nbytes at p."""
    cdef Py_ssize_t i
    for i in range(0, nbytes, 64):
        __builtin_prefetch(<const char*>p + i)


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


cdef void _head(const float* q, Py_ssize_t T, Py_ssize_t Hq, Py_ssize_t H, Py_ssize_t D,
                Py_ssize_t h, Py_ssize_t n, float scale, bint causal,
                const int32_t* table, Py_ssize_t ps,
                const uint8_t* kc, const uint16_t* ks, const uint16_t* res,
                int v_fmt, const char* vc, Py_ssize_t v_code_row, const char* vs,
                Py_ssize_t v_scale_row, const Variants* var, float* out,
                float* lse) noexcept nogil:
    """Attention of kv head h's R = T * G query rows of one sequence (module comment):
    q [T, Hq, D] its rows, n its positions, position p in storage row _row(table, ps, p),
    res its residual [32, Hkv, D]; OUT its rows of out [T, Hq, D] and lse [T, Hq] (NULL:
    not asked)."""
    cdef Py_ssize_t G = Hq // H, R = T * G, W = D // 2, S = D // 16
    cdef Py_ssize_t full = n - n % GROUP, r, p, p0, m, c, t, g, first, nxt, lo, sink_end
    cdef float* qs = <float*>malloc(R * D * sizeof(float))
    cdef float* s = <float*>malloc(R * n * sizeof(float))
    cdef float* acc = <float*>calloc(R * D, sizeof(float))
    cdef float* row = <float*>malloc(D * sizeof(float))
    cdef float* vt = <float*>malloc(V_TILE * D * sizeof(float))
    cdef float* lanes = <float*>malloc((D * GROUP + D // 16) * sizeof(float))
    cdef const char* vsp
    cdef const uint8_t* nc
    cdef const uint16_t* nsc
    for r in range(R):
        t, g = r // G, r % G
        for c in range(D):
            qs[r * D + c] = q[(t * Hq + h * G + g) * D + c] * scale
    # with a window, the positions no row sees: [sink_end, lo) (their pages may be
    # released: -1 in the table); groups and tiles wholly inside are skipped
    lo = n - T + 1 - var.window if var.window and n - T + 1 > var.window else 0
    sink_end = min(var.sink_tokens, lo)
    for g in range(full // GROUP):
        p = g * GROUP
        if sink_end <= p and p + GROUP <= lo:
            continue
        first = _row(table, ps, p)      # a group's rows follow each other (ps % 32 == 0)
        nc = NULL
        nsc = NULL
        if p + GROUP < full and p + GROUP >= lo:   # the next group's rows, prefetched a
            nxt = _row(table, ps, p + GROUP)       # slot at a time by _group_scores
            nc = kc + (nxt * H + h) * W
            nsc = ks + (nxt * H + h) * S
        _group_scores(qs, R, D, kc + (first * H + h) * W, H * W, ks + (first * H + h) * S,
                      H * S, s + p, n, lanes, nc, nsc)
    for p in range(full, n):
        decode_row(F16, res + ((p - full) * H + h) * D, NULL, D, row)
        for r in range(R):
            s[r * n + p] = _dot(qs + r * D, row, D)
    for r in range(R):
        _softmax(s + r * n, n, n - T + r // G, causal, var, h * G + r % G,
                 lse + (r // G) * Hq + h * G + r % G if lse != NULL else NULL, qs + r * D)
    for g in range((n + V_TILE - 1) // V_TILE):
        p0 = g * V_TILE
        m = min(V_TILE, n - p0)
        if sink_end <= p0 and p0 + m <= lo:
            continue
        for t in range(m):              # the tile's V rows decoded: vt [m][D]
            p = p0 + t
            first = _row(table, ps, p)
            if p + V_TILE < n and p + V_TILE >= lo:   # the next tile's row (H rows apart)
                nxt = _row(table, ps, p + V_TILE) * H + h
                _prefetch(vc + nxt * v_code_row, v_code_row)
                if vs != NULL:
                    _prefetch(vs + nxt * v_scale_row, v_scale_row)
            vsp = vs + (first * H + h) * v_scale_row if vs != NULL else NULL
            decode_row(v_fmt, vc + (first * H + h) * v_code_row, vsp, D, vt + t * D)
        for r in range(R):
            kvg_weighted_sum(acc + r * D, s + r * n + p0, vt, m, D)
    for r in range(R):
        t, g = r // G, r % G
        for c in range(D):
            out[(t * Hq + h * G + g) * D + c] = acc[r * D + c] * qs[r * D]
    free(qs)
    free(s)
    free(acc)
    free(row)
    free(vt)
    free(lanes)


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
    cdef Py_ssize_t b, h, item
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
    cdef Variants var
    var.window, var.sink_tokens, var.softcap = window, sink_tokens, softcap
    var.sinks = NULL if sinks is None else &sinks[0]
    cdef int nt = min(num_threads(), <int>(B * H))
    with nogil:
        for item in prange(B * H, num_threads=nt, schedule="dynamic"):
            b, h = item // H, item % H
            if counts[b] == 0:
                continue
            _head(&q[first[b], 0, 0], counts[b], Hq, H, D, h, lengths[b], scale, causal,
                  &tables[b, 0], page_size, &k_codes[0, 0, 0], &k_scales[0, 0, 0],
                  <const uint16_t*>residuals[b], v_fmt, vc, v_code_row, vs, v_scale_row,
                  &var, &out[first[b], 0, 0], lp + first[b] * Hq if lp != NULL else NULL)
