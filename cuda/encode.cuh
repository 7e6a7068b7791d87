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

// Quantizes one head row of D input values into `codes` / `scales` (one warp, all lanes).
// Returns 0, or (writing nothing) KV_ERR_NONFINITE / KV_ERR_RANGE for a row holding NaN
// or inf / a finite |x| >= kv_input_limit(fmt).
__device__ int encode_row(const void* in, int in_dtype, long long base, int D, int fmt,
                          void* codes, void* scales, int lane) {
    const float limit = kv_input_limit(fmt);
    bool nonfinite = false, range = false;
    float amax = 0.0f;
    for (int j = lane; j < D; j += WARP) {
        float x = kv_load_input(in, in_dtype, base + j);
        nonfinite |= !isfinite(x);
        range |= isfinite(x) && fabsf(x) >= limit;
        amax = fmaxf(amax, fabsf(x));
    }
    if (__any_sync(0xffffffffu, nonfinite)) return KV_ERR_NONFINITE;
    if (__any_sync(0xffffffffu, range)) return KV_ERR_RANGE;

    if (fmt == KV_F32 || fmt == KV_F16 || fmt == KV_BF16) {
        for (int j = lane; j < D; j += WARP) {
            float x = kv_load_input(in, in_dtype, base + j);
            if (fmt == KV_F32) ((float*)codes)[j] = x;
            else if (fmt == KV_F16) ((uint16_t*)codes)[j] = kv_f32_to_f16(x);
            else ((uint16_t*)codes)[j] = kv_f32_to_bf16(x);
        }
    } else if (fmt == KV_Q8_0) {
        // D % 32 == 0: one warp pass is exactly one block of 32 values
        for (int b = 0; b < D / KV_Q8_0_BLOCK; ++b) {
            int j = b * KV_Q8_0_BLOCK + lane;
            float x = kv_load_input(in, in_dtype, base + j);
            float bmax = warp_max(fabsf(x));
            float d = __fdiv_rn(bmax, KV_INT8_MAX);
            float id = d != 0.0f ? __fdiv_rn(1.0f, d) : 0.0f;
            ((int8_t*)codes)[j] = kv_q8_0_code(x, id);
            if (lane == 0) ((uint16_t*)scales)[b] = kv_f32_to_f16(d);
        }
    } else {  // int8, fp8_e4m3, fp8_e5m2: one f32 scale per row
        float s = kv_row_scale(fmt, warp_max(amax));
        for (int j = lane; j < D; j += WARP)
            ((uint8_t*)codes)[j] = kv_scaled_code(fmt, kv_load_input(in, in_dtype, base + j), s);
        if (lane == 0) ((float*)scales)[0] = s;
    }
    return 0;
}

// Quantizes input row `base` of K (is_v false) or V into storage row `row` of a layer:
// codes at row * D * code bytes, scales at row * S * scale bytes (S = 0: none). Returns
// encode_row's status.
__device__ __forceinline__ int encode_row_into(const void* k_in, const void* v_in, int in_dtype,
                                               long long base, int D, int fmt, bool is_v,
                                               void* k_codes, void* v_codes, void* k_scales,
                                               void* v_scales, long long row, int lane) {
    const int cb = kv_code_bytes(fmt);
    const int S = fmt == KV_Q8_0 ? D / KV_Q8_0_BLOCK : (fmt >= KV_INT8 ? 1 : 0);
    const int sb = fmt == KV_Q8_0 ? 2 : 4;
    char* codes = (char*)(is_v ? v_codes : k_codes) + row * D * cb;
    char* scales = S ? (char*)(is_v ? v_scales : k_scales) + row * S * sb : nullptr;
    return encode_row(is_v ? v_in : k_in, in_dtype, base, D, fmt, codes, scales, lane);
}
