// kvcore rotary position embedding (RoPE) on the device, for the token of a decode step.
//
// 1. Slot m's token sits at position lengths[m] + offset (the device lengths of the
//    GpuKVCache: inside a decode step, before append/advance, offset = 0), so a captured
//    graph rotates by the right angle step after step without host work.
// 2. Pair i of the first rotary_dim dims turns by pos * theta^(-2i / rotary_dim):
//    NEOX pairs (i, i + rotary_dim / 2), NORM pairs (2i, 2i + 1); dims past rotary_dim
//    are left alone. Same rule as the CPU kvcore.apply_rope.
// 3. Angles are computed in float64 (the exponent, the product and sin/cos with full
//    range reduction), once per (slot, pair), then rounded to float32: at position 10^5 a
//    float32 angle would be off by ~4e-3 rad, this is off by ~1e-7. The rotation itself
//    is float32; f16/bf16 inputs are rounded back to nearest even.
#include "common.cuh"

#define KV_ROPE_THREADS 128
#define KV_ROPE_MAX_HALF 128  // rotary_dim <= 256

__device__ __forceinline__ void kv_store_input(void* p, int dtype, long long i, float x) {
    if (dtype == KV_F32) ((float*)p)[i] = x;
    else if (dtype == KV_F16) ((uint16_t*)p)[i] = kv_f32_to_f16(x);
    else ((uint16_t*)p)[i] = kv_f32_to_bf16(x);
}

// kv_rope: one block per slot, rotating q and k of that slot in place.
//   q [M][hq][D] dtype q_dtype (0 f32, 1 f16, 2 bf16), element strides q_sm, q_sh, D contiguous
//   k [M][hk][D] dtype k_dtype, element strides k_sm, k_sh (hk = 0: no k)
//   lengths int32[M]; position of slot m = lengths[m] + offset
//   rotary_dim even, <= min(D, 256); neox 1 = NEOX pairs, 0 = NORM pairs
extern "C" __global__ void __launch_bounds__(KV_ROPE_THREADS)
kv_rope(void* q, int q_dtype, long long q_sm, long long q_sh, int hq,
        void* k, int k_dtype, long long k_sm, long long k_sh, int hk,
        const int* __restrict__ lengths, int offset, int rotary_dim, int neox, double log2_theta) {
    __shared__ float cs[KV_ROPE_MAX_HALF], sn[KV_ROPE_MAX_HALF];
    const int m = blockIdx.x, half = rotary_dim / 2;
    const double pos = (double)lengths[m] + (double)offset;
    for (int i = threadIdx.x; i < half; i += KV_ROPE_THREADS) {
        const double inv_freq = exp2(-(2.0 * i / rotary_dim) * log2_theta);
        double s, c;
        sincos(pos * inv_freq, &s, &c);
        cs[i] = (float)c;
        sn[i] = (float)s;
    }
    __syncthreads();
    for (int w = threadIdx.x; w < (hq + hk) * half; w += KV_ROPE_THREADS) {
        const int h = w / half, i = w % half;
        void* x;
        int dtype;
        long long base;
        if (h < hq) {
            x = q; dtype = q_dtype; base = m * q_sm + h * q_sh;
        } else {
            x = k; dtype = k_dtype; base = m * k_sm + (h - hq) * k_sh;
        }
        const long long a = base + (neox ? i : 2 * i), b = base + (neox ? i + half : 2 * i + 1);
        const float x0 = kv_load_input(x, dtype, a), x1 = kv_load_input(x, dtype, b);
        kv_store_input(x, dtype, a, x0 * cs[i] - x1 * sn[i]);
        kv_store_input(x, dtype, b, x0 * sn[i] + x1 * cs[i]);
    }
}
