// kvcore decode attention straight from the compressed GPU cache (flash-decoding).
// The split kernel template; cuda/attention_<format>.cu instantiate it one PTX module per
// format (so a process JIT-compiles only the formats it uses), cuda/attention.cu merges.
//
// 1. Storage read (docs/gpu.md): per layer, device arrays of M slot base pointers
//      k_ptrs[M] -> K codes  [Hkv][N][D]  (code dtype of the format)
//      v_ptrs[M] -> V codes  [Hkv][N][D]
//      ks_ptrs[M] -> K scales [Hkv][N][S] (int8/fp8: S = 1 f32; q8_0: S = D/32 f16; unused
//      vs_ptrs[M] -> V scales [Hkv][N][S]  for f32/f16/bf16)
//    and lengths int32[M]. Slot m attends to positions [0, min(lengths[m] + extra, N)):
//    `extra` counts the positions appended but not yet committed (1 inside a decode step).
//    Everything is read on the device, so one captured graph serves every step.
// 2. Grid (nsplit, Hkv * G / GB, M), 128 threads. A block takes GB query heads of one kv
//    head (GB = G for G in 1, 2, 4, 8), so each K/V row is read from memory once per group
//    of query heads, and one split of the slot's positions: the chunk is computed on the
//    device from the slot's length, ceil(n / nsplit) rounded up to the tile, so short
//    slots use fewer splits and a graph needs no host-side length.
// 3. Tiles of T positions (T * D * code bytes = 4 KiB of K and as much of V) stream through
//    a cp.async pipeline of STAGES shared-memory stages (16-byte copies, coalesced: one
//    tile of one head is contiguous in the head-major layout). Per tile:
//      a. scores: thread (c, rg) dots its DPT dims of rows rg, rg + RG, ... with the GB
//         query vectors held in registers, dequantizing in registers (scales applied to
//         the partial dot; q8_0 per block of 32), partials to shared memory;
//      b. online softmax (base 2, q pre-scaled by log2(e) / sqrt(D)): one warp per head
//         sums the partials, takes the tile max, rescales its running sum;
//      c. values: acc[g][DPT] += p[g][row] * scale * v[row][dims], in float32 registers;
//         rescaling of acc only when a head's max moved (block-uniform branch).
// 4. Output: with nsplit == 1 the block writes out = acc / l (zeros for an empty slot);
//    otherwise it writes its normalized partial o and lse = m + log2(l) (-inf when the
//    split is empty) to the workspace and kv_attn_merge combines them (log-sum-exp).
// 5. Accumulation is float32 throughout; codes are converted exactly (int8 via the 2^23
//    trick, fp8 via f16 bit placement, f16 by cvt, bf16 by a shift).
#pragma once

#include "common.cuh"

#define KV_ATTN_THREADS 128
#define KV_ATTN_WARPS (KV_ATTN_THREADS / 32)
#define KV_TILE_BYTES 4096

// ---- exact vector decoders: 16 or 8 bytes of codes -> floats --------------------------

// 4 int8 codes -> 4 floats: bytes of (code + 128) placed under the exponent of 2^23.
__device__ __forceinline__ void kv_dec_i8x4(uint32_t w, float* f) {
    uint32_t x = w ^ 0x80808080u;
    f[0] = __uint_as_float(__byte_perm(x, 0x4B000000u, 0x7540)) - 8388736.0f;
    f[1] = __uint_as_float(__byte_perm(x, 0x4B000000u, 0x7541)) - 8388736.0f;
    f[2] = __uint_as_float(__byte_perm(x, 0x4B000000u, 0x7542)) - 8388736.0f;
    f[3] = __uint_as_float(__byte_perm(x, 0x4B000000u, 0x7543)) - 8388736.0f;
}

__device__ __forceinline__ void kv_dec_h2(uint32_t h2, float* f) {
    f[0] = kv_f16_to_f32((uint16_t)(h2 & 0xFFFFu));
    f[1] = kv_f16_to_f32((uint16_t)(h2 >> 16));
}

// 4 E5M2 codes -> 4 floats: an E5M2 code is the high byte of the f16 of the same value.
__device__ __forceinline__ void kv_dec_e5m2x4(uint32_t w, float* f) {
    kv_dec_h2(__byte_perm(w, 0u, 0x1404), f);
    kv_dec_h2(__byte_perm(w, 0u, 0x3424), f + 2);
}

// 4 E4M3FN codes -> 4 floats equal to value * 2^-8: sign to bit 15, exponent and mantissa
// bits to bits 13..7 of an f16 (exact, subnormals included; the 2^8 goes into the scale).
__device__ __forceinline__ void kv_dec_e4m3x4(uint32_t w, float* f) {
    uint32_t y0 = __byte_perm(w, 0u, 0x1404), y1 = __byte_perm(w, 0u, 0x3424);
    kv_dec_h2(((y0 >> 1) & 0x3F803F80u) | (y0 & 0x80008000u), f);
    kv_dec_h2(((y1 >> 1) & 0x3F803F80u) | (y1 & 0x80008000u), f + 2);
}

template <int FMT>
__device__ __forceinline__ void kv_dec_word(uint32_t w, float* f);
template <> __device__ __forceinline__ void kv_dec_word<KV_F32>(uint32_t w, float* f) { f[0] = __uint_as_float(w); }
template <> __device__ __forceinline__ void kv_dec_word<KV_F16>(uint32_t w, float* f) { kv_dec_h2(w, f); }
template <> __device__ __forceinline__ void kv_dec_word<KV_BF16>(uint32_t w, float* f) {
    f[0] = __uint_as_float(w << 16);
    f[1] = __uint_as_float(w & 0xFFFF0000u);
}
template <> __device__ __forceinline__ void kv_dec_word<KV_INT8>(uint32_t w, float* f) { kv_dec_i8x4(w, f); }
template <> __device__ __forceinline__ void kv_dec_word<KV_Q8_0>(uint32_t w, float* f) { kv_dec_i8x4(w, f); }
template <> __device__ __forceinline__ void kv_dec_word<KV_FP8_E4M3>(uint32_t w, float* f) { kv_dec_e4m3x4(w, f); }
template <> __device__ __forceinline__ void kv_dec_word<KV_FP8_E5M2>(uint32_t w, float* f) { kv_dec_e5m2x4(w, f); }

// ---- cp.async --------------------------------------------------------------------------

#ifdef KVCORE_EMU
// Host twins of the cp.async helpers below, for the CPU emulation (cuda/emu/kvemu.h).
__device__ __forceinline__ void kv_cp16(void* smem, const void* gmem, int src_bytes) {
    kvemu::cp_async((uint32_t)__cvta_generic_to_shared(smem), gmem, 16, src_bytes, __FILE__, __LINE__);
}

__device__ __forceinline__ void kv_cp4(void* smem, const void* gmem, int src_bytes) {
    kvemu::cp_async((uint32_t)__cvta_generic_to_shared(smem), gmem, 4, src_bytes, __FILE__, __LINE__);
}

__device__ __forceinline__ void kv_cp_commit() { kvemu::cp_commit(); }

template <int N>
__device__ __forceinline__ void kv_cp_wait() { kvemu::cp_wait(N); }
#else
// 16 bytes global -> shared; src_bytes 0 writes zeros and reads nothing.
__device__ __forceinline__ void kv_cp16(void* smem, const void* gmem, int src_bytes) {
    uint32_t s = (uint32_t)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(src_bytes));
}

__device__ __forceinline__ void kv_cp4(void* smem, const void* gmem, int src_bytes) {
    uint32_t s = (uint32_t)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(s), "l"(gmem), "r"(src_bytes));
}

__device__ __forceinline__ void kv_cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int N>
__device__ __forceinline__ void kv_cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }
#endif

// ---- the split kernel ------------------------------------------------------------------

template <int FMT, int D, int GB>
struct AttnCfg {
    static constexpr int CB = FMT == KV_F32 ? 4 : (FMT == KV_F16 || FMT == KV_BF16) ? 2 : 1;
    // scale bytes per row: int8/fp8 one f32, q8_0 D/32 f16
    static constexpr int SB = FMT == KV_Q8_0 ? D / 16 : FMT >= KV_INT8 ? 4 : 0;
    // dims per thread: one 16-byte vector of codes, at most 8 dims from 4 heads on, so
    // that q and acc (GB * DPT floats each) leave room for 2-4 blocks per SM
    static constexpr int DPT_CAP = GB >= 4 ? 8 : 32 / GB;
    static constexpr int DPT = (16 / CB) < DPT_CAP ? (16 / CB) : DPT_CAP;
    static constexpr int VB = DPT * CB;                    // code bytes per thread-row
    static constexpr int TPR = D / DPT;                    // threads per row
    static constexpr int RG = KV_ATTN_THREADS / TPR;       // row groups
    static constexpr int T = KV_TILE_BYTES / (D * CB);     // positions per tile
    static constexpr int RPT = T / RG;                     // rows per thread per tile
    static constexpr int STAGES = GB >= 8 ? 3 : 4;
    static constexpr int SCALE_BYTES = T * SB;             // per tile, K or V
    static constexpr int STAGE_BYTES = 2 * KV_TILE_BYTES + 2 * ((SCALE_BYTES + 15) / 16) * 16;
    static constexpr int HPW = (GB + KV_ATTN_WARPS - 1) / KV_ATTN_WARPS;  // heads per warp
    static constexpr int RW = (T + 31) / 32;               // rows per lane in the softmax
    static_assert(RPT >= 1 && T % RG == 0, "tile must cover the row groups");
    static_assert(TPR <= KV_ATTN_THREADS, "row wider than the block");
    static_assert(SB == 0 || DPT <= 32, "a thread's dims must stay in one q8_0 block");
    static_assert((RG / 2) * GB * D * 4 <= STAGES * STAGE_BYTES, "reduction buffer must fit");
};

// Scale of row r for the thread's dims starting at d0, read from a stage's scale bytes.
template <int FMT, int D>
__device__ __forceinline__ float kv_tile_scale(const unsigned char* s, int r, int d0) {
    if constexpr (FMT == KV_Q8_0) {
        const uint16_t* h = (const uint16_t*)s;
        return kv_f16_to_f32(h[r * (D / 32) + d0 / 32]);
    } else if constexpr (FMT == KV_FP8_E4M3) {
        return ((const float*)s)[r] * 256.0f;  // the decoder returns value * 2^-8
    } else if constexpr (FMT >= KV_INT8) {
        return ((const float*)s)[r];
    }
    return 1.0f;
}

// The thread's VB code bytes of one row (16 or 8, aligned) -> DPT floats.
template <int FMT, int D, int GB>
__device__ __forceinline__ void kv_load_row(const unsigned char* p, float* f) {
    using C = AttnCfg<FMT, D, GB>;
    constexpr int PER_WORD = 4 / C::CB;
    uint32_t w[4];
    if constexpr (C::VB == 16) {
        const uint4 u = *(const uint4*)p;
        w[0] = u.x; w[1] = u.y; w[2] = u.z; w[3] = u.w;
    } else {
        const uint2 u = *(const uint2*)p;
        w[0] = u.x; w[1] = u.y;
    }
#pragma unroll
    for (int i = 0; i < C::VB / 4; i++) kv_dec_word<FMT>(w[i], f + i * PER_WORD);
}

template <int FMT, int D, int GB>
__device__ __forceinline__ void kv_attn_split(
    const unsigned long long* __restrict__ k_ptrs, const unsigned long long* __restrict__ v_ptrs,
    const unsigned long long* __restrict__ ks_ptrs, const unsigned long long* __restrict__ vs_ptrs,
    const int* __restrict__ lengths, int extra, int capacity,
    const void* __restrict__ q, int q_dtype, int hq, int group, float qk_scale,
    float* __restrict__ out, float* __restrict__ ws_o, float* __restrict__ ws_lse) {
    using C = AttnCfg<FMT, D, GB>;
    __shared__ __align__(16) unsigned char stages[C::STAGES][C::STAGE_BYTES];
    __shared__ __align__(16) float part[GB * C::T * C::TPR];  // [g][row][c]
    __shared__ __align__(16) float prob[C::T * GB];          // [row][g]
    __shared__ float alpha_s[GB], m_s[GB], l_s[GB];

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int c = tid % C::TPR, rg = tid / C::TPR;
    const int split = blockIdx.x, nsplit = gridDim.x;
    const int groups = group / GB;
    const int kvh = blockIdx.y / groups;
    const int qh0 = kvh * group + (blockIdx.y % groups) * GB;
    const int slot = blockIdx.z;

    int n = lengths[slot] + extra;
    n = n < capacity ? n : capacity;
    n = n > 0 ? n : 0;
    int chunk = (n + nsplit - 1) / nsplit;
    chunk = (chunk + C::T - 1) / C::T * C::T;
    const int start = split * chunk;
    const int end = min(n, start + chunk);
    const size_t head_row0 = (size_t)kvh * capacity;  // first row of this head in the slot

    if (start >= end) {  // empty split (or empty slot): zeros, and lse -inf for the merge
        for (int i = tid; i < GB * D; i += KV_ATTN_THREADS) {
            size_t row = (size_t)slot * hq + qh0 + i / D;
            if (nsplit == 1) {
                out[row * D + i % D] = 0.0f;
            } else {
                ws_o[(row * nsplit + split) * D + i % D] = 0.0f;
                if (i % D == 0) ws_lse[row * nsplit + split] = -INFINITY;
            }
        }
        return;
    }

    const unsigned char* kbase = (const unsigned char*)k_ptrs[slot] + head_row0 * D * C::CB;
    const unsigned char* vbase = (const unsigned char*)v_ptrs[slot] + head_row0 * D * C::CB;
    const unsigned char* ksbase = nullptr;
    const unsigned char* vsbase = nullptr;
    if constexpr (C::SB > 0) {
        ksbase = (const unsigned char*)ks_ptrs[slot] + head_row0 * C::SB;
        vsbase = (const unsigned char*)vs_ptrs[slot] + head_row0 * C::SB;
    }
    const int ntiles = (end - start + C::T - 1) / C::T;

    // Issues the copies of tile t (rows past `end` are zero-filled, never read).
    auto issue = [&](int t) {
        if (t < ntiles) {
            unsigned char* st = stages[t % C::STAGES];
            const int row0 = start + t * C::T;
            const int rows = min(C::T, end - row0);
            const size_t off = (size_t)row0 * D * C::CB;
#pragma unroll
            for (int i = tid; i < KV_TILE_BYTES / 16; i += KV_ATTN_THREADS) {
                const bool ok = (i * 16) / (D * C::CB) < rows;
                kv_cp16(st + i * 16, kbase + (ok ? off + i * 16 : 0), ok ? 16 : 0);
                kv_cp16(st + KV_TILE_BYTES + i * 16, vbase + (ok ? off + i * 16 : 0), ok ? 16 : 0);
            }
            if constexpr (C::SB > 0) {
                unsigned char* ss = st + 2 * KV_TILE_BYTES;
                constexpr int SCALE_STRIDE = ((C::SCALE_BYTES + 15) / 16) * 16;
                const size_t soff = (size_t)row0 * C::SB;
                for (int i = tid; i < C::SCALE_BYTES / 4; i += KV_ATTN_THREADS) {
                    const bool ok = (i * 4) / C::SB < rows;
                    kv_cp4(ss + i * 4, ksbase + (ok ? soff + i * 4 : 0), ok ? 4 : 0);
                    kv_cp4(ss + SCALE_STRIDE + i * 4, vsbase + (ok ? soff + i * 4 : 0), ok ? 4 : 0);
                }
            }
        }
        kv_cp_commit();  // always one group per tile slot, so wait_group counts stay uniform
    };

#pragma unroll
    for (int t = 0; t < C::STAGES - 1; t++) issue(t);

    // q for this thread's dims of the GB heads, pre-scaled for base-2 softmax.
    float qr[GB][C::DPT];
#pragma unroll
    for (int g = 0; g < GB; g++) {
        const long long base = ((long long)slot * hq + qh0 + g) * D + c * C::DPT;
#pragma unroll
        for (int k = 0; k < C::DPT; k++) qr[g][k] = kv_load_input(q, q_dtype, base + k) * qk_scale;
    }
    float acc[GB][C::DPT];
#pragma unroll
    for (int g = 0; g < GB; g++)
#pragma unroll
        for (int k = 0; k < C::DPT; k++) acc[g][k] = 0.0f;
    float m_run[C::HPW], l_run[C::HPW];
#pragma unroll
    for (int h = 0; h < C::HPW; h++) { m_run[h] = -INFINITY; l_run[h] = 0.0f; }

    constexpr int SCALE_STRIDE = ((C::SCALE_BYTES + 15) / 16) * 16;
    for (int t = 0; t < ntiles; t++) {
        kv_cp_wait<C::STAGES - 2>();
        __syncthreads();  // tile t visible to all; every thread is done with tile t - 1
        issue(t + C::STAGES - 1);
        const unsigned char* st = stages[t % C::STAGES];
        const int rows = min(C::T, end - (start + t * C::T));

        // a. partial scores of the thread's dims
#pragma unroll
        for (int j = 0; j < C::RPT; j++) {
            const int r = rg + j * C::RG;
            float kf[C::DPT];
            kv_load_row<FMT, D, GB>(st + r * D * C::CB + c * C::VB, kf);
            const float sc = kv_tile_scale<FMT, D>(st + 2 * KV_TILE_BYTES, r, c * C::DPT);
#pragma unroll
            for (int g = 0; g < GB; g++) {
                float s = 0.0f;
#pragma unroll
                for (int k = 0; k < C::DPT; k++) s = fmaf(qr[g][k], kf[k], s);
                part[(g * C::T + r) * C::TPR + c] = s * sc;
            }
        }
        __syncthreads();

        // b. online softmax, one warp per head
#pragma unroll
        for (int h = 0; h < C::HPW; h++) {
            const int g = warp + h * KV_ATTN_WARPS;
            if (g < GB) {
                float s[C::RW];
                float tmax = -INFINITY;
#pragma unroll
                for (int i = 0; i < C::RW; i++) {
                    const int r = lane + 32 * i;
                    s[i] = -INFINITY;
                    if (r < rows) {
                        const float* pp = part + (g * C::T + r) * C::TPR;
                        float v = 0.0f;
                        for (int cc = 0; cc < C::TPR; cc++) v += pp[cc];
                        s[i] = v;
                    }
                    tmax = fmaxf(tmax, s[i]);
                }
#pragma unroll
                for (int o = 16; o > 0; o >>= 1) tmax = fmaxf(tmax, __shfl_xor_sync(0xFFFFFFFFu, tmax, o));
                const float m_new = fmaxf(m_run[h], tmax);
                const float a = exp2f(m_run[h] - m_new);  // 0 on the first tile (-inf)
                float psum = 0.0f;
#pragma unroll
                for (int i = 0; i < C::RW; i++) {
                    const int r = lane + 32 * i;
                    const float p = exp2f(s[i] - m_new);  // 0 for masked rows
                    if (r < C::T) prob[r * GB + g] = p;
                    psum += p;
                }
#pragma unroll
                for (int o = 16; o > 0; o >>= 1) psum += __shfl_xor_sync(0xFFFFFFFFu, psum, o);
                l_run[h] = l_run[h] * a + psum;
                m_run[h] = m_new;
                if (lane == 0) alpha_s[g] = a;
            }
        }
        __syncthreads();

        // c. values
#pragma unroll
        for (int g = 0; g < GB; g++) {
            const float a = alpha_s[g];
            if (a != 1.0f) {
#pragma unroll
                for (int k = 0; k < C::DPT; k++) acc[g][k] *= a;
            }
        }
#pragma unroll
        for (int j = 0; j < C::RPT; j++) {
            const int r = rg + j * C::RG;
            float vf[C::DPT];
            kv_load_row<FMT, D, GB>(st + KV_TILE_BYTES + r * D * C::CB + c * C::VB, vf);
            const float sc = kv_tile_scale<FMT, D>(st + 2 * KV_TILE_BYTES + SCALE_STRIDE, r, c * C::DPT);
#pragma unroll
            for (int g = 0; g < GB; g++) {
                const float pv = prob[r * GB + g] * sc;
#pragma unroll
                for (int k = 0; k < C::DPT; k++) acc[g][k] = fmaf(pv, vf[k], acc[g][k]);
            }
        }
    }
    kv_cp_wait<0>();  // only empty groups can be left; drain them before reusing stages

    // Reduce acc over the row groups (tree through shared memory), heads' m and l too.
#pragma unroll
    for (int h = 0; h < C::HPW; h++) {
        const int g = warp + h * KV_ATTN_WARPS;
        if (g < GB && lane == 0) { m_s[g] = m_run[h]; l_s[g] = l_run[h]; }
    }
    float* red = (float*)&stages[0][0];  // [RG/2][GB][D]
#pragma unroll
    for (int half = C::RG / 2; half >= 1; half >>= 1) {
        __syncthreads();
        if (rg >= half && rg < 2 * half) {
#pragma unroll
            for (int g = 0; g < GB; g++)
#pragma unroll
                for (int k = 0; k < C::DPT; k++) red[((rg - half) * GB + g) * D + c * C::DPT + k] = acc[g][k];
        }
        __syncthreads();
        if (rg < half) {
#pragma unroll
            for (int g = 0; g < GB; g++)
#pragma unroll
                for (int k = 0; k < C::DPT; k++) acc[g][k] += red[(rg * GB + g) * D + c * C::DPT + k];
        }
    }
    if (rg == 0) {
#pragma unroll
        for (int g = 0; g < GB; g++) {
            const float inv = 1.0f / l_s[g];  // l >= 1: the max row contributes 2^0
            const size_t row = (size_t)slot * hq + qh0 + g;
            float* dst = nsplit == 1 ? out + row * D : ws_o + (row * nsplit + split) * D;
#pragma unroll
            for (int k = 0; k < C::DPT; k += 4) {
                const float4 v = make_float4(acc[g][k] * inv, acc[g][k + 1] * inv,
                                             acc[g][k + 2] * inv, acc[g][k + 3] * inv);
                *(float4*)(dst + c * C::DPT + k) = v;
            }
            if (nsplit > 1 && c == 0) ws_lse[row * nsplit + split] = m_s[g] + log2f(l_s[g]);
        }
    }
}

#define KV_ATTN_ARGS                                                                        \
    const unsigned long long *k_ptrs, const unsigned long long *v_ptrs,                     \
        const unsigned long long *ks_ptrs, const unsigned long long *vs_ptrs,               \
        const int *lengths, int extra, int capacity, const void *q, int q_dtype, int hq,    \
        int group, float qk_scale, float *out, float *ws_o, float *ws_lse
#define KV_ATTN_PASS \
    k_ptrs, v_ptrs, ks_ptrs, vs_ptrs, lengths, extra, capacity, q, q_dtype, hq, group, qk_scale, out, ws_o, ws_lse

// kv_attn_<format>_d<D>_g<GB>: one (split, kv head x head group, slot) per block.
//   k_ptrs/v_ptrs [M] u64 -> codes [Hkv][N][D] of the format; ks_ptrs/vs_ptrs [M] u64 ->
//   scales [Hkv][N][S] (int8/fp8 f32, q8_0 f16; ignored by float formats); lengths [M]
//   int32; q [M][Hq][D] f32/f16/bf16 (q_dtype 0/1/2); out [M][Hq][D] f32 (nsplit == 1);
//   ws_o [M][Hq][nsplit][D] f32, ws_lse [M][Hq][nsplit] f32 (nsplit > 1).
#define KV_ATTN_INSTANCE(FMT, NAME, D, GB)                                                    \
    extern "C" __global__ void __launch_bounds__(KV_ATTN_THREADS)                             \
        kv_attn_##NAME##_d##D##_g##GB(KV_ATTN_ARGS) {                                         \
        kv_attn_split<FMT, D, GB>(KV_ATTN_PASS);                                              \
    }
#define KV_ATTN_GB(FMT, NAME, D) \
    KV_ATTN_INSTANCE(FMT, NAME, D, 1) KV_ATTN_INSTANCE(FMT, NAME, D, 2) \
    KV_ATTN_INSTANCE(FMT, NAME, D, 4) KV_ATTN_INSTANCE(FMT, NAME, D, 8)
#define KV_ATTN_FORMAT(FMT, NAME) KV_ATTN_GB(FMT, NAME, 64) KV_ATTN_GB(FMT, NAME, 128) KV_ATTN_GB(FMT, NAME, 256)
