// Quantizing one head row on the device (one warp): the row rules of common.cuh applied to
// D input values, written as the format's codes and scales. Shared by kv_append.cu
// and the paged append (paged.cu).
#pragma once

#include "common.cuh"

#define WARP 32

__device__ __forceinline__ float warp_max(float v) {
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

__device__ __forceinline__ float warp_min(float v) {
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fminf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// One 4-bit block (q4_0 / q4_1) of 32 values, value `lane` in x of each lane (finite,
// |x| below the format's limit): writes the block's 16 code bytes and its f16 scales
// (q4_0: d; q4_1: d, m), as kvcore/_quant.pyx _encode_q4_0 / _encode_q4_1.
__device__ __forceinline__ void encode_q4_block(int fmt, float x, uint8_t* codes, uint16_t* scales,
                                                int lane) {
    float d, id, v;
    if (fmt == KV_Q4_0) {
        // max: the signed value of the first lane holding the largest |x|
        const float amax = warp_max(fabsf(x));
        const float mx = __shfl_sync(0xffffffffu, x, __ffs(__ballot_sync(0xffffffffu, fabsf(x) == amax)) - 1);
        d = __fdiv_rn(mx, -8.0f);
        id = d != 0.0f ? __fdiv_rn(1.0f, d) : 0.0f;
        v = __fadd_rn(__fmul_rn(x, id), 8.5f);
        if (lane == 0) scales[0] = kv_f32_to_f16(d);
    } else {
        // min and max: of equal values the last lane's (only a zero's sign can differ)
        const float lo = warp_min(x), hi = warp_max(x);
        const float mn = __shfl_sync(0xffffffffu, x, 31 - __clz(__ballot_sync(0xffffffffu, x == lo)));
        const float mx = __shfl_sync(0xffffffffu, x, 31 - __clz(__ballot_sync(0xffffffffu, x == hi)));
        d = __fdiv_rn(__fsub_rn(mx, mn), 15.0f);
        id = d != 0.0f ? __fdiv_rn(1.0f, d) : 0.0f;
        v = __fadd_rn(__fmul_rn(__fsub_rn(x, mn), id), 0.5f);
        if (lane == 0) { scales[0] = kv_f32_to_f16(d); scales[1] = kv_f32_to_f16(mn); }
    }
    const uint32_t q = kv_u4(v);
    const uint32_t q_hi = __shfl_down_sync(0xffffffffu, q, 16);  // value 16 + lane
    if (lane < 16) codes[lane] = (uint8_t)(q | q_hi << 4);
}

// Checks one head row of D input values (one warp): 0, KV_ERR_NONFINITE for NaN or inf, or
// KV_ERR_RANGE for a finite |x| >= kv_input_limit(fmt); the same answer in every lane.
__device__ int check_row(const void* in, int in_dtype, long long base, int D, int fmt, int lane) {
    const float limit = kv_input_limit(fmt);
    bool nonfinite = false, range = false;
    for (int j = lane; j < D; j += WARP) {
        const float x = kv_load_input(in, in_dtype, base + j);
        nonfinite |= !isfinite(x);
        range |= isfinite(x) && fabsf(x) >= limit;
    }
    if (__any_sync(0xffffffffu, nonfinite)) return KV_ERR_NONFINITE;
    return __any_sync(0xffffffffu, range) ? KV_ERR_RANGE : 0;
}

// q4_1ch (docs/formats.md): one warp encodes a complete group of one head, lane t holding
// position t of the group; x(c) is the lane's value of channel c (float16-rounded, as the
// CPU's residual holds it). Channel c = j D/32 + i goes to the group's row slot j: its 16
// code bytes at codes + j code_stride + 16 i, its (d, m) at scales + j scale_stride + 2 i
// (uint16 units), by the q4_1 rule (encode_q4_block), bit-identical to kvcore.quantize.
template <class X>
__device__ void encode_group(const X& x, int D, uint8_t* codes, long long code_stride,
                             uint16_t* scales, long long scale_stride, int lane) {
    const int per = D / KV_GROUP;  // channels per row slot
    for (int c = 0; c < D; c++) {
        const int j = c / per, i = c % per;
        encode_q4_block(KV_Q4_1, x(c), codes + j * code_stride + 16 * i,
                        scales + j * scale_stride + 2 * i, lane);
    }
}

// The float16 rounding of an input value, as a float (what q4_1ch's residual holds).
__device__ __forceinline__ float kv_round_f16(float x) { return kv_f16_to_f32(kv_f32_to_f16(x)); }

// The K warp of one head of one sequence for a K in q4_1ch (kv_append.cu, paged.cu), for
// input row r (at k_in + in_base, rows s_r apart) of the T rows written at positions
// [len, len + T) (one position: T = 1, r = 0). The warp of row 0, and of each row that
// starts a group, takes the group its row starts: when the rows complete it, it is encoded
// (encode_group) from the residual's positions before len and the input's; the warp of
// row 0 then writes the positions of the last, open group into the residual (after its own
// group read it). codes / scales: the row of the warp's position (rows of consecutive
// positions code_stride bytes / scale_stride uint16 apart: a group's 32 rows are
// consecutive, in a cache's head and in a pool's page alike), res [32][D] the residual.
__device__ void append_group(const void* k_in, int in_dtype, long long in_base, long long s_r,
                             int D, int len, int r, int T, uint8_t* codes, long long code_stride,
                             uint16_t* scales, long long scale_stride, uint16_t* res, int lane) {
    const int pos = len + r;
    auto input = [&](int p, int c) {               // position p's input value (float16-rounded)
        return kv_round_f16(kv_load_input(k_in, in_dtype, in_base + (p - pos) * s_r + c));
    };
    auto to_residual = [&](int p_lo, int p_hi) {   // input positions [p_lo, p_hi) -> residual
        for (int p = p_lo; p < p_hi; p++)
            for (int c = lane; c < D; c += WARP) res[(p % KV_GROUP) * D + c] = kv_f32_to_f16(input(p, c));
    };
    const int g0 = pos - pos % KV_GROUP, end = len + T;
    if (r != 0 && pos != g0) return;               // not the start of a group
    if (g0 + KV_GROUP <= end) {                     // the group completes: encode it
        const int t = g0 + lane;                    // the lane's position
        encode_group([&](int c) {
            return t < len ? kv_f16_to_f32(res[(t % KV_GROUP) * D + c]) : input(t, c);
        }, D, codes - (pos - g0) * code_stride, code_stride, scales - (pos - g0) * scale_stride,
           scale_stride, lane);
    } else if (r != 0) {
        return;                                     // the open group: the first row's warp
    }
    if (r == 0) {
        const int open = end - end % KV_GROUP;      // the positions of the open group
        if (open < end) {
            __syncwarp(0xffffffffu);                // the group above has read the residual
            to_residual(open > pos ? open : pos, end);
        }
    }
}

// Quantizes one head row of D input values into `codes` / `scales` (one warp, all lanes).
// Returns 0, or (writing nothing) check_row's KV_ERR_NONFINITE / KV_ERR_RANGE.
__device__ int encode_row(const void* in, int in_dtype, long long base, int D, int fmt,
                          void* codes, void* scales, int lane) {
    const int refused = check_row(in, in_dtype, base, D, fmt, lane);
    if (refused) return refused;

    if (fmt == KV_F32 || fmt == KV_F16 || fmt == KV_BF16) {
        for (int j = lane; j < D; j += WARP) {
            float x = kv_load_input(in, in_dtype, base + j);
            if (fmt == KV_F32) ((float*)codes)[j] = x;
            else if (fmt == KV_F16) ((uint16_t*)codes)[j] = kv_f32_to_f16(x);
            else ((uint16_t*)codes)[j] = kv_f32_to_bf16(x);
        }
    } else if (fmt == KV_Q8_0) {
        // D % 32 == 0: one warp pass is exactly one block of 32 values
        for (int b = 0; b < D / KV_QK; ++b) {
            int j = b * KV_QK + lane;
            float x = kv_load_input(in, in_dtype, base + j);
            float bmax = warp_max(fabsf(x));
            float d = __fdiv_rn(bmax, KV_INT8_MAX);
            float id = d != 0.0f ? __fdiv_rn(1.0f, d) : 0.0f;
            ((int8_t*)codes)[j] = kv_q8_0_code(x, id);
            if (lane == 0) ((uint16_t*)scales)[b] = kv_f32_to_f16(d);
        }
    } else if (fmt == KV_Q4_0 || fmt == KV_Q4_1) {
        const int S = fmt == KV_Q4_0 ? 1 : 2;  // scales per block
        for (int b = 0; b < D / KV_QK; ++b)
            encode_q4_block(fmt, kv_load_input(in, in_dtype, base + b * KV_QK + lane),
                            (uint8_t*)codes + b * (KV_QK / 2), (uint16_t*)scales + b * S, lane);
    } else {  // int8, fp8_e4m3, fp8_e5m2: one f32 scale per row
        float amax = 0.0f;
        for (int j = lane; j < D; j += WARP) amax = fmaxf(amax, fabsf(kv_load_input(in, in_dtype, base + j)));
        float s = kv_row_scale(fmt, warp_max(amax));
        for (int j = lane; j < D; j += WARP)
            ((uint8_t*)codes)[j] = kv_scaled_code(fmt, kv_load_input(in, in_dtype, base + j), s);
        if (lane == 0) ((float*)scales)[0] = s;
    }
    return 0;
}

// Quantizes input row `base` of K (is_v false) or V into storage row `row` of a layer:
// codes at row * kv_code_row_bytes, scales at row * kv_scale_row_bytes (0: none).
// Returns encode_row's status.
__device__ __forceinline__ int encode_row_into(const void* k_in, const void* v_in, int in_dtype,
                                               long long base, int D, int fmt, bool is_v,
                                               void* k_codes, void* v_codes, void* k_scales,
                                               void* v_scales, long long row, int lane) {
    const int sb = kv_scale_row_bytes(fmt, D);
    char* codes = (char*)(is_v ? v_codes : k_codes) + row * kv_code_row_bytes(fmt, D);
    char* scales = sb ? (char*)(is_v ? v_scales : k_scales) + row * sb : nullptr;
    return encode_row(is_v ? v_in : k_in, in_dtype, base, D, fmt, codes, scales, lane);
}
