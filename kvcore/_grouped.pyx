# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Decode and causal attention over K stored by channel in groups of positions (q4_1ch).

1. `attend_grouped` takes q float32 [T, Hq, D] and one layer of a KVCache whose K format
   is q4_1ch (docs/formats.md): K codes uint8 [N, Hkv, D/2] and scales float16
   [N, Hkv, D/16] holding the complete groups of 32 positions, the open group's K in the
   residual float16 [32, Hkv, D] (slot p % 32), and V codes [N, Hkv, W] / scales
   [N, Hkv, S] in V's own per-token format; all C-contiguous. Positions [0, n) are read;
   query token t sees [0, n - T + t] (causal) or [0, n). Query head i reads kv head
   i // G (G = Hq / Hkv).
2. Threads take the kv heads. Per head, its R = T * G query rows are scaled first.
   Scores of a complete group, for 32 positions at once: sum_c (q_c d_c) code[c][t] plus
   sum_c q_c m_c, float32: per channel its 16 code bytes (low nibbles positions 0-15,
   high 16-31) widen once into 32 floats, then each row adds one broadcast q_c d_c times
   them (a multiply-add over 32 lanes the compiler vectorises). The open group's scores
   are dot products with its float16 rows.
3. A softmax per row (max subtracted, expf), then the weighted sum of V: each V row is
   decoded once per head (`_quant.decode_row`, D floats) and added to the R rows'
   accumulators. No float copy of K or V is made; per head: scores [R][n], accumulators
   [R][D] and one row of D floats.
4. The caller checks that every output is finite (attention.py), so a refused call leaves
   its out untouched.
"""
from libc.math cimport expf, logf
from libc.stdint cimport uint8_t, uint16_t
from libc.stdlib cimport calloc, free, malloc
from cython.parallel cimport prange
cimport numpy as cnp

from kvcore._quant cimport decode_row, f16_to_f32
from kvcore._parallel cimport num_threads

cnp.import_array()

cdef enum:
    GROUP = 32      # positions per group of q4_1ch
    F16 = 1         # format id of float16 rows (kvcore/formats.py)


cdef inline void _group_scores(const float* q, Py_ssize_t R, Py_ssize_t D,
                               const uint8_t* codes, Py_ssize_t code_stride,
                               const uint16_t* scales, Py_ssize_t scale_stride,
                               float* s, Py_ssize_t s_stride, float* lane,
                               float* bias) noexcept nogil:
    """OUT s[r * s_stride + t] (t < 32): the scores of the R rows of q [R][D] over one
    complete group. codes / scales: the group's first row slot of this head; slot j is
    code_stride / scale_stride elements further and holds channels [j D/32, (j+1) D/32),
    16 code bytes and a (d, m) pair each. lane: 32 floats, bias: R floats (scratch)."""
    cdef Py_ssize_t per_slot = D // GROUP, j, i, c, r, t
    cdef const uint8_t* b
    cdef const uint16_t* dm
    cdef float d, m, a
    cdef float* acc
    for r in range(R):
        bias[r] = 0
        for t in range(GROUP):
            s[r * s_stride + t] = 0
    for j in range(GROUP):
        for i in range(per_slot):
            c = j * per_slot + i
            b = codes + j * code_stride + 16 * i
            dm = scales + j * scale_stride + 2 * i
            d = f16_to_f32(dm[0])
            m = f16_to_f32(dm[1])
            for t in range(GROUP // 2):
                lane[t] = <float>(b[t] & 15)
                lane[t + GROUP // 2] = <float>(b[t] >> 4)
            for r in range(R):
                a = q[r * D + c] * d
                bias[r] += q[r * D + c] * m
                acc = s + r * s_stride
                for t in range(GROUP):
                    acc[t] += a * lane[t]
    for r in range(R):
        for t in range(GROUP):
            s[r * s_stride + t] += bias[r]


cdef void _head(const float* q, Py_ssize_t T, Py_ssize_t Hq, Py_ssize_t H, Py_ssize_t D,
                Py_ssize_t h, Py_ssize_t n, float scale, bint causal,
                const uint8_t* kc, const uint16_t* ks, const uint16_t* res,
                int v_fmt, const char* vc, Py_ssize_t v_code_row, const char* vs,
                Py_ssize_t v_scale_row, float* out, float* lse) noexcept nogil:
    """Attention of kv head h's R = T * G query rows (module comment); OUT rows of out
    [T, Hq, D] and lse [T, Hq] (NULL: not asked)."""
    cdef Py_ssize_t G = Hq // H, R = T * G, W = D // 2, S = D // 16
    cdef Py_ssize_t full = n - n % GROUP, r, p, c, t, g, lim
    cdef float* qs = <float*>malloc(R * D * sizeof(float))
    cdef float* s = <float*>malloc(R * n * sizeof(float))
    cdef float* acc = <float*>calloc(R * D, sizeof(float))
    cdef float* row = <float*>malloc((D + GROUP + R) * sizeof(float))
    cdef float mx, total, w, dot
    cdef const char* vsp
    for r in range(R):
        t, g = r // G, r % G
        for c in range(D):
            qs[r * D + c] = q[(t * Hq + h * G + g) * D + c] * scale
    for g in range(full // GROUP):
        p = g * GROUP
        _group_scores(qs, R, D, kc + (p * H + h) * W, H * W, ks + (p * H + h) * S, H * S,
                      s + p, n, row + D, row + D + GROUP)
    for p in range(full, n):
        decode_row(F16, res + ((p - full) * H + h) * D, NULL, D, row)
        for r in range(R):
            dot = 0
            for c in range(D):
                dot = dot + qs[r * D + c] * row[c]
            s[r * n + p] = dot
    for r in range(R):
        lim = n - T + r // G + 1 if causal else n
        mx = s[r * n]
        for p in range(1, lim):
            mx = s[r * n + p] if s[r * n + p] > mx else mx
        total = 0
        for p in range(lim):
            w = expf(s[r * n + p] - mx)
            s[r * n + p] = w
            total = total + w
        for p in range(lim, n):
            s[r * n + p] = 0
        if lse != NULL:
            lse[(r // G) * Hq + h * G + r % G] = mx + logf(total)
        qs[r * D] = 1 / total      # the row's normaliser (its scaled query is no longer read)
    for p in range(n):
        vsp = vs + (p * H + h) * v_scale_row if vs != NULL else NULL
        decode_row(v_fmt, vc + (p * H + h) * v_code_row, vsp, D, row)
        for r in range(R):
            w = s[r * n + p]
            if w != 0:
                for c in range(D):
                    acc[r * D + c] += w * row[c]
    for r in range(R):
        t, g = r // G, r % G
        for c in range(D):
            out[(t * Hq + h * G + g) * D + c] = acc[r * D + c] * qs[r * D]
    free(qs)
    free(s)
    free(acc)
    free(row)


def attend_grouped(const float[:, :, ::1] q, const uint8_t[:, :, ::1] k_codes,
                   const uint16_t[:, :, ::1] k_scales, const uint16_t[:, :, ::1] residual,
                   cnp.ndarray v_codes, v_scales, int v_fmt, Py_ssize_t n, float scale,
                   bint causal, float[:, :, ::1] out, float[:, ::1] lse=None) -> None:
    """q float32 [T, Hq, D]; k_codes uint8 [N, Hkv, D/2], k_scales float16 bits uint16
    [N, Hkv, D/16], residual float16 bits uint16 [32, Hkv, D]; v_codes [N, Hkv, W] and
    v_scales [N, Hkv, S] (or None) in V's format v_fmt; n positions (1 <= n <= N, causal:
    T <= n); OUT out float32 [T, Hq, D], lse float32 [T, Hq] or None. The caller checked
    every shape and dtype."""
    cdef Py_ssize_t T = q.shape[0], Hq = q.shape[1], D = q.shape[2], H = k_codes.shape[1], h
    cdef const char* vc = cnp.PyArray_BYTES(v_codes)
    cdef Py_ssize_t v_code_row = v_codes.shape[2] * v_codes.itemsize
    cdef const char* vs = NULL
    cdef Py_ssize_t v_scale_row = 0
    if v_scales is not None:
        vs = cnp.PyArray_BYTES(<cnp.ndarray>v_scales)
        v_scale_row = v_scales.shape[2] * v_scales.itemsize
    cdef float* lp = NULL if lse is None else &lse[0, 0]
    cdef int nt = min(num_threads(), <int>H)
    with nogil:
        for h in prange(H, num_threads=nt, schedule="dynamic"):
            _head(&q[0, 0, 0], T, Hq, H, D, h, n, scale, causal, &k_codes[0, 0, 0],
                  &k_scales[0, 0, 0], &residual[0, 0, 0], v_fmt, vc, v_code_row, vs,
                  v_scale_row, &out[0, 0, 0], lp)
