// Writes into a GpuKVPool: the paged append (quantize-on-append through a slot mapping).
//
// 1. One layer of the pool is token-major, as the CPU KVPool's storage: codes
//    [P * page_size][Hkv][D] (code dtype), scales [P * page_size][Hkv][S] (S = 1 f32 for
//    int8/fp8, D/32 f16 for q8_0, none for f32/f16/bf16). Slot r (a "row", vLLM's slot)
//    is position r % page_size of page r / page_size; its head h is row r * Hkv + h.
// 2. Where each input row goes comes from the device slot mapping (int64, written by the
//    host between steps), so one captured graph replays the same launch step after step.
// 3. Errors never trap: slot -1 is padding (its input is not read); any other slot outside
//    [0, num_slots) refuses the whole launch (nothing written anywhere) and ORs
//    KV_ERR_SLOT into *status; an input row holding NaN/inf is skipped and ORs
//    KV_ERR_NONFINITE, one past the format's range KV_ERR_RANGE (as kv_append.cu).
//    Two rows naming the same slot are not detected (the host never maps them so).
#include "encode.cuh"

#define KV_ERR_SLOT 8

// Appends T input rows to one layer.
//   k_in, v_in [T][Hkv][D] in_dtype (0 f32, 1 f16, 2 bf16); element strides s_r, s_h; D contiguous
//   k_codes, v_codes [num_slots][Hkv][D]; k_scales, v_scales [num_slots][Hkv][S] (layer bases)
//   slots int64[T]: row t goes to slot slots[t] (-1: skipped); status int32 (OR'ed)
// One warp per head row: warps [0, T*Hkv) write K, [T*Hkv, 2*T*Hkv) write V.
extern "C" __global__ void kv_paged_append(
        const void* __restrict__ k_in, const void* __restrict__ v_in, int in_dtype,
        long long s_r, long long s_h,
        void* k_codes, void* v_codes, void* k_scales, void* v_scales,
        const long long* __restrict__ slots, long long num_slots, int* status,
        int fmt, int T, int Hkv, int D) {
    const int lane = threadIdx.x & (WARP - 1);
    const long long warp = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / WARP;
    const long long rows = (long long)T * Hkv;
    if (warp >= 2 * rows) return;

    // The whole launch or nothing, so every warp checks every slot.
    bool bad = false;
    for (int t = lane; t < T; t += WARP) {
        const long long s = slots[t];
        bad |= s < -1 || s >= num_slots;
    }
    if (__any_sync(0xffffffffu, bad)) {
        if (warp == 0 && lane == 0) atomicOr(status, KV_ERR_SLOT);
        return;
    }

    const bool is_v = warp >= rows;
    const long long w = is_v ? warp - rows : warp;
    const int t = (int)(w / Hkv), h = (int)(w % Hkv);
    const long long slot = slots[t];
    if (slot < 0) return;
    const long long row = slot * Hkv + h;

    const int refused = encode_row_into(k_in, v_in, in_dtype, t * s_r + h * s_h, D, fmt, is_v,
                                        k_codes, v_codes, k_scales, v_scales, row, lane);
    if (refused && lane == 0) atomicOr(status, refused);
}

// ---- paged decode attention ------------------------------------------------------------

#define DEC_WARPS 4
#define DEC_MAX_R 8   // D / 32 values per lane: D <= 256

__device__ __forceinline__ float warp_sum(float v) {
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// The f32 scale of value i = lane + 32 * r of head row hr (int8/fp8: the row's; q8_0: its
// block's, block r; float formats: unused).
__device__ __forceinline__ float dec_scale(int fmt, const void* scales, long long hr, int S, int r) {
    if (fmt == KV_Q8_0) return kv_f16_to_f32(((const uint16_t*)scales)[hr * S + r]);
    if (fmt >= KV_INT8) return ((const float*)scales)[hr];
    return 1.0f;
}

// One new query token per sequence row b over its lengths[b] positions, read through
// block_tables[b] (pages in any physical order), in the storage's own format.
//   q, out float32 [B][Hq][D] (C order); codes/scales: one layer's bases, as kv_paged_append
//   block_tables int32 [B][max_pages], lengths int32 [B] (0: out row is zeros)
// Grid (Hq, B), DEC_WARPS warps: warp w takes positions w, w + DEC_WARPS, ...; lane l holds
// dims l + 32 r. Online softmax (natural base, float32) per warp, merged through shared
// memory by warp 0. D % 32 == 0, D <= 256, Hq % Hkv == 0.
extern "C" __global__ void kv_paged_decode(
        const float* __restrict__ q, float* __restrict__ out,
        const void* k_codes, const void* v_codes, const void* k_scales, const void* v_scales,
        const int* __restrict__ block_tables, const int* __restrict__ lengths, int max_pages,
        int page_size, int fmt, int Hq, int Hkv, int D, float scale) {
    __shared__ float s_m[DEC_WARPS], s_l[DEC_WARPS];
    __shared__ float s_acc[DEC_WARPS][DEC_MAX_R * WARP];
    const int h = blockIdx.x, b = blockIdx.y;
    const int lane = threadIdx.x & (WARP - 1), warp = threadIdx.x / WARP;
    const int kvh = h / (Hq / Hkv), R = D / WARP;
    const int S = fmt == KV_Q8_0 ? D / KV_Q8_0_BLOCK : 1;
    const int cb = kv_code_bytes(fmt);
    const int n = lengths[b];
    const float* qrow = q + ((long long)b * Hq + h) * D;
    float qv[DEC_MAX_R], acc[DEC_MAX_R];
    for (int r = 0; r < R; ++r) {
        qv[r] = qrow[lane + WARP * r];
        acc[r] = 0.0f;
    }
    float m = -INFINITY, l = 0.0f;
    for (int p = warp; p < n; p += DEC_WARPS) {
        const int page = block_tables[(long long)b * max_pages + p / page_size];
        const long long hr = ((long long)page * page_size + p % page_size) * Hkv + kvh;
        const char* kc = (const char*)k_codes + hr * D * cb;
        const char* vc = (const char*)v_codes + hr * D * cb;
        float dot = 0.0f;
        for (int r = 0; r < R; ++r)
            dot += qv[r] * kv_decode(fmt, kc, lane + WARP * r, dec_scale(fmt, k_scales, hr, S, r));
        const float s = warp_sum(dot) * scale;
        const float mn = fmaxf(m, s);
        const float c = expf(m - mn), w = expf(s - mn);
        l = l * c + w;
        for (int r = 0; r < R; ++r)
            acc[r] = acc[r] * c + w * kv_decode(fmt, vc, lane + WARP * r,
                                                dec_scale(fmt, v_scales, hr, S, r));
        m = mn;
    }
    if (lane == 0) {
        s_m[warp] = m;
        s_l[warp] = l;
    }
    for (int r = 0; r < R; ++r) s_acc[warp][lane + WARP * r] = acc[r];
    __syncthreads();
    if (warp != 0) return;
    float mx = -INFINITY;
    for (int w = 0; w < DEC_WARPS; ++w) mx = fmaxf(mx, s_m[w]);
    float wt[DEC_WARPS], total = 0.0f;
    for (int w = 0; w < DEC_WARPS; ++w) {
        wt[w] = expf(s_m[w] - mx);   // 0 for a warp without positions (when n > 0)
        total += s_l[w] * wt[w];
    }
    float* orow = out + ((long long)b * Hq + h) * D;
    for (int r = 0; r < R; ++r) {
        const int j = lane + WARP * r;
        float o = 0.0f;
        for (int w = 0; w < DEC_WARPS; ++w) o += s_acc[w][j] * wt[w];
        orow[j] = n > 0 ? o / total : 0.0f;
    }
}
