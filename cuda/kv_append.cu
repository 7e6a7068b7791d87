// Writes into a GpuKVCache: quantize-on-append and the commit of a step.
//
// 1. One layer of the cache, per slot, is head-major: codes [M][Hkv][N][D] (code dtype of
//    the format), scales [M][Hkv][N][S] (S = 1 f32 for int8/fp8, D/32 f16 for q8_0, none
//    for f32/f16/bf16). Kernels get the layer's base pointers; slot s, head h, position p
//    is row (s * Hkv + h) * N + p.
// 2. The write position comes from the device lengths, so one captured graph replays the
//    same launches step after step; kv_advance commits the step afterwards.
// 3. Errors never trap, and stay with their slot: status int32[M] holds bits per slot. A
//    write that would pass the slot's capacity writes nothing for that slot and ORs
//    KV_ERR_CAPACITY into status[s]; an input row holding NaN/inf is skipped and ORs
//    KV_ERR_NONFINITE, one holding a finite value past the format's range
//    (kv_input_limit) KV_ERR_RANGE. kv_advance does not commit a slot whose status is set,
//    so its failed step never becomes visible, and commits the others; the host turns the
//    bits into an exception naming the slots at its next sync, and clears them.
// 4. active (int32[M], or null for every slot): with slot < 0, a slot whose entry is 0 is
//    neither written nor committed (idle slots of a replayed graph).
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

// Appends one step to one layer.
//   k_in, v_in [R][Hkv][D] in_dtype (0 f32, 1 f16, 2 bf16); element strides s_r, s_h; D contiguous
//   k_codes, v_codes [M][Hkv][N][D] code dtype; k_scales, v_scales [M][Hkv][N][S] (layer bases)
//   lengths int32[M] (read only), status int32[M] (OR'ed), active int32[M] or null
//   slot < 0: R = M, row r goes to slot r at position lengths[r] (when active[r] != 0)
//   slot >= 0: R = T rows go to slot `slot` at positions lengths[slot] + r
// One warp per head row: warps [0, R*Hkv) write K, [R*Hkv, 2*R*Hkv) write V. Every value a
// warp branches on is the same in all its lanes (one slot per warp).
extern "C" __global__ void kv_append(
        const void* __restrict__ k_in, const void* __restrict__ v_in, int in_dtype,
        long long s_r, long long s_h,
        void* k_codes, void* v_codes, void* k_scales, void* v_scales,
        const int* __restrict__ lengths, int* status, const int* __restrict__ active,
        int fmt, int M, int Hkv, int N, int D, int slot, int T) {
    const int lane = threadIdx.x & (WARP - 1);
    const long long warp = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / WARP;
    const int R = slot < 0 ? M : T;
    const long long rows = (long long)R * Hkv;
    if (warp >= 2 * rows) return;

    const bool is_v = warp >= rows;
    const long long w = is_v ? warp - rows : warp;
    const int r = (int)(w / Hkv), h = (int)(w % Hkv);
    const int s = slot < 0 ? r : slot;
    if (slot < 0 && active != nullptr && active[s] == 0) return;
    // Capacity of this warp's slot only (the T rows of one slot: all of them or none).
    const int len = lengths[s];
    if (slot < 0 ? len >= N : len > N - T) {
        if (lane == 0 && h == 0 && !is_v && (slot < 0 || r == 0)) atomicOr(&status[s], KV_ERR_CAPACITY);
        return;
    }
    const int pos = len + (slot < 0 ? 0 : r);
    const long long row = ((long long)s * Hkv + h) * N + pos;

    const int cb = kv_code_bytes(fmt);
    const int S = fmt == KV_Q8_0 ? D / KV_Q8_0_BLOCK : (fmt >= KV_INT8 ? 1 : 0);
    const int sb = fmt == KV_Q8_0 ? 2 : 4;
    char* codes = (char*)(is_v ? v_codes : k_codes) + row * D * cb;
    char* scales = S ? (char*)(is_v ? v_scales : k_scales) + row * S * sb : nullptr;
    const void* in = is_v ? v_in : k_in;
    const int refused = encode_row(in, in_dtype, r * s_r + h * s_h, D, fmt, codes, scales, lane);
    if (refused && lane == 0) atomicOr(&status[s], refused);
}

// Commits a step: slot < 0: lengths[s] += 1 for every active slot; slot >= 0:
// lengths[slot] += T.
//   lengths int32[M] (read/write), status int32[M] (read; OR'ed with KV_ERR_CAPACITY),
//   active int32[M] or null (slot < 0 only)
// A slot whose status is set, or that would pass N (then KV_ERR_CAPACITY), is not
// committed; the others are. One block.
extern "C" __global__ void kv_advance(int* lengths, int* status, const int* active,
                                      int M, int N, int slot, int T) {
    if (slot < 0) {
        for (int s = threadIdx.x; s < M; s += blockDim.x) {
            if ((active != nullptr && active[s] == 0) || status[s] != 0) continue;
            if (lengths[s] >= N) status[s] |= KV_ERR_CAPACITY;
            else lengths[s] += 1;
        }
    } else if (threadIdx.x == 0 && status[slot] == 0) {
        if (lengths[slot] > N - T) status[slot] |= KV_ERR_CAPACITY;
        else lengths[slot] += T;
    }
}
