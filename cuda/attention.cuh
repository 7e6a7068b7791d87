// kvcore decode attention straight from the compressed GPU cache (flash-decoding).
// The split kernel template; cuda/attention_<format>.cu instantiate it one PTX module per
// format (so a process JIT-compiles only the formats it uses), cuda/attention_<k>_<v>.cu
// per K/V pair of two formats (K in one, V in the other; only kvcore.gpu.GPU_PAIRS),
// cuda/attention.cu merges.
//
// 1. Storage (docs/gpu.md): the kernel reads K/V codes and scales of one layer through a
//    storage policy, the only part that differs between the stores:
//      KvSlotStorage  (GpuKVCache, kv_attn_*): per-slot head-major [Hkv][N][D] codes and
//        [Hkv][N][S] scales from device arrays of slot base pointers; slot m sees
//        min(lengths[m] + extra, N) positions (`extra`: appended, not yet committed).
//      KvPagedStorage (GpuKVPool, kv_pattn_*): the pool's token-major layer
//        [P * page_size][Hkv][D] through block tables; query row r of the step is token t
//        of sequence b by CSR q_offsets, and sees lengths[b] - count_b + t + 1 (causal).
//    (S = 1 f32 for int8/fp8, D/32 f16 for q8_0 and q4_0, 2 D/32 f16 (d, m) for q4_1,
//    none for f32/f16/bf16; 4-bit codes are D/2 bytes a row.) Everything is read on the
//    device, so one captured graph serves every step.
// 2. Grid (nsplit, Hkv * G / GB, rows), 128 threads. A block takes GB query heads of one
//    kv head (GB = G for G in 1, 2, 4, 8), so each K/V row is read from memory once per
//    group of query heads, and one split of the row's positions: the chunk is computed on
//    the device from the row's length, max(ceil(n / nsplit), KV_MIN_SPLIT) rounded up to
//    the tile, so short rows leave splits empty and the grid needs no host-side length.
// 3. Tiles of T positions (T * row code bytes <= 4 KiB of K and as much of V, 2 KiB for
//    4-bit codes; T <= 64 except for tiny D) stream through a cp.async pipeline of STAGES shared-memory stages
//    (16-byte copies, one head row of D * code bytes at a time, at the storage's row(p)).
//    Per tile:
//      a. scores: thread (c, rg) dots its DPT dims of rows rg, rg + RG, ... with the GB
//         query vectors held in registers, dequantizing in registers (scales applied to
//         the partial dot; q8_0 and q4_0 per block of 32; q4_1 decodes q * d + m per
//         value), partials to shared memory;
//      b. online softmax (base 2, q pre-scaled by log2(e) / sqrt(D)): one warp per head
//         sums the partials, takes the tile max, rescales its running sum;
//      c. values: acc[g][DPT] += p[g][row] * scale * v[row][dims], in float32 registers;
//         rescaling of acc only when a head's max moved (block-uniform branch).
// 4. Output: with nsplit == 1 the block writes out = acc / l (zeros for an empty row) and
//    the natural lse; otherwise it writes its normalized partial o and lse = m + log2(l)
//    (-inf when the split is empty, o then unwritten) to the workspace and kv_attn_merge
//    combines them (log-sum-exp).
// 5. Accumulation is float32 throughout; codes are converted exactly (int8 and 4-bit via
//    the 2^23 trick, fp8 via f16 bit placement, f16 by cvt, bf16 by a shift). A thread's
//    4-bit codes are 4 or 8 bytes of one block, dims j and 16 + j of it (AttnCfg::kofs).
// 6. Head dims: D = 64, 128, 256 are compiled as constants; the _dx instances take any
//    multiple of 16 up to 256 at run time (q8_0, q4_0, q4_1: of 32; same code, D not
//    folded).
// 7. Variants (docs/variants.md), run-time arguments of every instance (0 / null: off, and
//    the kernel computes exactly what it does without them): window W and sink_tokens S
//    select the positions the query at n - 1 sees, [0, min(S, n - W)) and [n - W, n)
//    (the host refuses a window with causal=False, as the CPU kernels do);
//    splits and tiles cut only those (visible indices, sinks first), so the work follows
//    W + S and no other position is read (a windowed pool's pages outside it may be -1).
//    softcap2 = c log2(e) caps the base-2 scores: s <- softcap2 tanh(s / softcap2). sinks
//    [Hq] f32 (natural logits, null: none) join the denominator once, in split 0's
//    epilogue (an empty row: out 0, lse = sink), so kv_attn_merge needs no change.
#pragma once

#include "common.cuh"

#define KV_ATTN_THREADS 128
#define KV_ATTN_WARPS (KV_ATTN_THREADS / 32)
#define KV_TILE_BYTES 4096     // K codes per stage (AttnCfg::TB: half for 4-bit codes)
#define KV_MAX_TILE 64         // positions per tile at most (the fixed head_dims reach it at
                               // int8/fp8/q8_0 D = 64; it bounds the run-time-D shared memory)
#define KV_MIN_SPLIT 128       // a split covers at least this many positions (if it has any)
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

// 4 bytes of 4-bit codes -> 8 floats: the low nibbles (f[0..3]), then the high ones
// (f[4..7]), each minus `bias` (8: q4_0, 0: q4_1); exact, by the 2^23 trick.
template <int BIAS>
__device__ __forceinline__ void kv_dec_u4x8(uint32_t w, float* f) {
    const uint32_t lo = w & 0x0F0F0F0Fu, hi = (w >> 4) & 0x0F0F0F0Fu;
    constexpr float base = 8388608.0f + BIAS;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        f[i] = __uint_as_float(__byte_perm(lo, 0x4B000000u, 0x7540 + i)) - base;
        f[4 + i] = __uint_as_float(__byte_perm(hi, 0x4B000000u, 0x7540 + i)) - base;
    }
}
template <> __device__ __forceinline__ void kv_dec_word<KV_Q4_0>(uint32_t w, float* f) { kv_dec_u4x8<8>(w, f); }
template <> __device__ __forceinline__ void kv_dec_word<KV_Q4_1>(uint32_t w, float* f) { kv_dec_u4x8<0>(w, f); }

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

// ---- storages: where the block's kv head keeps position p ------------------------------
// A storage names the block's query row (of q, out, lse), how many positions it sees (n),
// the bases of its kv head's K/V codes and scales, and row(p): position p's codes lie at
// k + row(p) * RBK, its scales at ks + row(p) * SBK, V's at v + row(p) * RBV and vs + row(p)
// * SBV (RB*, SB*: bytes of one head row's codes
// and scales). The split kernel reads nothing else of the storage.

// A GpuKVCache slot (blockIdx.z = slot m): per-slot head-major [Hkv][N][D] from k_ptrs[m]
// etc.; sees min(lengths[m] + extra, N) positions; row(p) = p.
struct KvSlotStorage {
    const unsigned char *k, *v, *ks, *vs;
    const unsigned char* kr;  // K q4_1ch: the head's residual [32][D] f16 (else null)
    int qrow, n, full;        // full: positions in complete groups (K q4_1ch; else n)
    __device__ __forceinline__ size_t row(int p) const { return (size_t)p; }
};

__device__ __forceinline__ KvSlotStorage kv_slot_storage(
    const unsigned long long* k_ptrs, const unsigned long long* v_ptrs,
    const unsigned long long* ks_ptrs, const unsigned long long* vs_ptrs, const unsigned char* k_res,
    const int* lengths, int extra, int capacity, int kvh, int hkv, int RBK, int RBV, int SBK, int SBV,
    int RBR) {
    const int m = blockIdx.z;
    const size_t head = (size_t)kvh * capacity;  // first row of this head in the slot
    KvSlotStorage s;
    s.k = (const unsigned char*)k_ptrs[m] + head * RBK;
    s.v = (const unsigned char*)v_ptrs[m] + head * RBV;
    s.ks = SBK ? (const unsigned char*)ks_ptrs[m] + head * SBK : nullptr;
    s.vs = SBV ? (const unsigned char*)vs_ptrs[m] + head * SBV : nullptr;
    const int n = lengths[m] + extra;
    s.qrow = m;
    s.n = n < 0 ? 0 : (n < capacity ? n : capacity);
    s.kr = RBR ? k_res + ((size_t)m * hkv + kvh) * KV_GROUP * RBR : nullptr;
    s.full = RBR ? s.n - s.n % KV_GROUP : s.n;
    return s;
}

// A GpuKVPool step (blockIdx.z = query row r of the step): one layer token-major
// [P * page_size][Hkv][D]. Row r is token t = r - q_offsets[b] of sequence b, where
// q_offsets[b] <= r < q_offsets[b + 1] (CSR, int32 [max_batch + 1]; rows from
// q_offsets[max_batch] on belong to no sequence and see nothing). With count_b =
// q_offsets[b + 1] - q_offsets[b] new tokens among lengths[b] positions, token t sees the
// first lengths[b] - count_b + t + 1 (causal) or all lengths[b]. Position p is offset
// p % page_size of page block_tables[b][p / page_size]: row(p) = (page * page_size +
// p % page_size) * Hkv, the kv head's offset being in the bases.
struct KvPagedStorage {
    const unsigned char *k, *v, *ks, *vs;
    const unsigned char* kr;  // K q4_1ch: the sequence's residual [32][D] f16 (else null)
    const int* table;
    int page_size, hkv, qrow, n, full;  // full: positions in complete groups (K q4_1ch; else n)
    __device__ __forceinline__ size_t row(int p) const {
        return ((size_t)table[p / page_size] * page_size + p % page_size) * hkv;
    }
};

__device__ __forceinline__ KvPagedStorage kv_paged_storage(
    const unsigned char* k_codes, const unsigned char* v_codes,
    const unsigned char* k_scales, const unsigned char* v_scales, const unsigned char* k_res,
    const int* res_slots, const int* block_tables, int max_pages, const int* lengths,
    const int* q_offsets, int max_batch, int page_size, int hkv, int causal, int kvh, int RBK,
    int RBV, int SBK, int SBV, int RBR) {
    const int r = blockIdx.z;
    int lo = 0, hi = max_batch;  // the last b with q_offsets[b] <= r (q_offsets[0] = 0)
    while (hi - lo > 1) {
        const int mid = (lo + hi) / 2;
        if (q_offsets[mid] <= r) lo = mid; else hi = mid;
    }
    const int t = r - q_offsets[lo], count = q_offsets[lo + 1] - q_offsets[lo];
    int n = 0, len = 0;
    if (t < count) {
        len = min(lengths[lo], max_pages * page_size);
        n = causal ? len - count + t + 1 : len;
        n = n < 0 ? 0 : (n < len ? n : len);
    }
    KvPagedStorage s;
    s.k = k_codes + (size_t)kvh * RBK;
    s.v = v_codes + (size_t)kvh * RBV;
    s.ks = SBK ? k_scales + (size_t)kvh * SBK : nullptr;
    s.vs = SBV ? v_scales + (size_t)kvh * SBV : nullptr;
    s.table = block_tables + (size_t)lo * max_pages;
    s.page_size = page_size;
    s.hkv = hkv;
    s.qrow = r;
    s.n = n;
    // the residual holds the positions after the sequence's last complete group, of all
    // `len` (the step's tokens see fewer, causal, but read what the step left)
    s.kr = RBR ? k_res + ((size_t)res_slots[lo] * hkv + kvh) * KV_GROUP * RBR : nullptr;
    s.full = RBR ? len - len % KV_GROUP : n;
    return s;
}

// ---- the split kernel ------------------------------------------------------------------

// One side's codes (K or V) of format FMT at DPT dims per thread.
template <int FMT, int DPT>
struct KvSide {
    static constexpr int CB = FMT == KV_F32 ? 4 : (FMT == KV_F16 || FMT == KV_BF16) ? 2 : 1;
    static constexpr int PACK = FMT >= KV_Q4_0 ? 2 : 1;    // values per code byte
    // q4_1ch (K only): a group's 32 row slots hold its channels' blocks (docs/formats.md);
    // a thread's dims are consecutive, read by kv_group_krow instead of kv_load_row
    static constexpr bool GROUPED = FMT == KV_Q4_1CH;
    static constexpr int VB = DPT * CB / PACK;             // code bytes per thread-row
    // code bytes of a stage: 4 KiB; 2 KiB for 4-bit codes, whose tiles then hold as many
    // positions as q8_0's (the partial scores, positions x threads per row, and the
    // stages must fit the 48 KiB of static shared memory)
    static constexpr int TB = KV_TILE_BYTES / PACK;
    // Element k of thread c is dim d0(c) + kofs(k): dim c * DPT + k, except for the 4-bit
    // formats, whose byte j of a block holds dims j (low nibble) and 16 + j (high): the
    // thread's word i (code bytes c * VB + 4i.., all in one block) gives elements 8i..8i+3
    // (low nibbles) and 8i+4..8i+7 (high), kv_dec_u4x8's order. kofs(k)..kofs(k) + 3 are
    // consecutive for k % 4 == 0.
    __host__ __device__ static constexpr int d0(int c) {
        return PACK == 1 || GROUPED ? c * DPT : c * VB / 16 * 32 + c * VB % 16;
    }
    __host__ __device__ static constexpr int kofs(int k) {
        return PACK == 1 || GROUPED ? k : k / 4 % 2 * 16 + k / 8 * 4 + k % 4;
    }
    __host__ __device__ static constexpr int rb(int D) { return D * CB / PACK; }  // code bytes per head row
    __host__ __device__ static constexpr int sb(int D) {   // scale bytes per head row
        return FMT == KV_Q8_0 || FMT == KV_Q4_0 ? D / 16 : FMT == KV_Q4_1 || GROUPED ? D / 8 : FMT >= KV_INT8 ? 4 : 0;
    }
};

// Dims per thread of a format: one 16-byte vector of codes, at most 16 dims (4-bit codes:
// 8 bytes; 32 dims took 211 registers), at most 8 from 4 heads on, so that q and acc
// (GB * DPT floats each) leave room for 2-4 blocks per SM.
__host__ __device__ constexpr int kv_dpt(int fmt, int gb) {
    const int cb = fmt == KV_F32 ? 4 : (fmt == KV_F16 || fmt == KV_BF16) ? 2 : 1;
    const int dims = 16 * (fmt >= KV_Q4_0 ? 2 : 1) / cb, cap = gb >= 4 ? 8 : 16;
    return dims < cap ? dims : cap;
}

// K in format KF, V in format VF (the same for one format), GB query heads per block.
template <int KF, int VF, int GB>
struct AttnCfg {
    // dims per thread: the smaller of both sides', at most 8 for a K/V pair (16 made ptxas
    // spill on sm_80)
    static constexpr int DPT_KV = kv_dpt(KF, GB) < kv_dpt(VF, GB) ? kv_dpt(KF, GB) : kv_dpt(VF, GB);
    static constexpr int DPT = KF == VF || DPT_KV < 8 ? DPT_KV : 8;
    using K = KvSide<KF, DPT>;
    using V = KvSide<VF, DPT>;
    // K in q4_1ch: a tile is one group of 32 positions (its row slots hold it whole), the
    // stages sized for 32 rows of the largest D; the partial scores are summed over the
    // row's threads by shuffles (head_dims whose threads per row divide 32: 32, 64, 128, 256)
    static constexpr bool GROUPED = K::GROUPED;
    __host__ __device__ static constexpr int tbk(int DT) { return GROUPED ? KV_GROUP * K::rb(DT ? DT : 256) : K::TB; }
    __host__ __device__ static constexpr int tbv(int DT) { return GROUPED ? KV_GROUP * V::rb(DT ? DT : 256) : V::TB; }
    static constexpr int STAGES = GB >= 8 ? 3 : 4;
    static constexpr int HPW = (GB + KV_ATTN_WARPS - 1) / KV_ATTN_WARPS;  // heads per warp
    // q in shared memory (q_s, read where it is used) instead of registers: at GB 8 and
    // DPT 8, q and acc take 2 x 8 x 8 = 128 registers, and ptxas gave 167-225 in all (2-3
    // blocks per SM on sm_90); with q_s it fits 128 without spills, and
    // __launch_bounds__(128, 4) asks for 4 blocks per SM (min_blocks; docs/gpu.md,
    // "Occupancy and bytes in flight").
    // Not for f32 (DPT 4: 4 blocks already), nor the 1-byte formats at D = 256 or a
    // run-time D (the 8 KiB of q_s would pass the 48 KiB of static shared memory).
    __host__ __device__ static constexpr bool qs(int DT) {
        return GB >= 8 && DPT == 8 && ((K::CB == 2 && V::CB == 2) || (DT > 0 && DT <= 128));
    }
    // __launch_bounds__' minimum blocks per SM (0: none, as without the argument; nvcc then
    // writes no .minnctapersm). 3 for the int8 pool kernels: at 4 (128 registers) ptxas
    // spills 4-24 bytes on sm_80 (none on sm_90).
    // 3 too for the pool kernels of a K/V pair at 4 heads, or with q_s (at 128 registers
    // ptxas spills 4-52 bytes on sm_80).
    // 2 for the pool kernels of K q4_1ch: without it ptxas spilled 8 bytes at 72 registers
    // (d64_g2 on sm_90), with 3 or 4 more.
    __host__ __device__ static constexpr int min_blocks(int DT, bool paged) {
        return GROUPED && paged ? 2 : KF != VF && paged && (GB == 4 || qs(DT)) ? 3
             : qs(DT) ? (KF == KV_INT8 && paged ? 3 : 4) : 0;
    }
    static_assert(32 % DPT == 0, "a thread's dims must stay in one q8_0 / q4 block");
    // Geometry of head_dim D (a multiple of 16 up to 256; q8_0, q4_0, q4_1: of 32):
    __host__ __device__ static constexpr int tpr(int D) { return D / DPT; }  // threads per row
    __host__ __device__ static constexpr int rg(int D) { return KV_ATTN_THREADS / tpr(D); }  // row groups
    // positions per tile: <= a stage's codes of K and of V and <= KV_MAX_TILE positions
    // (unless one row group pass takes more: small D), a whole number of row-group passes
    __host__ __device__ static constexpr int tile(int D) {
        return GROUPED ? KV_GROUP : rg(D) * (rows_cap(D) / rg(D) > 0 ? rows_cap(D) / rg(D) : 1);
    }
    __host__ __device__ static constexpr int rows_cap(int D) {
        const int k = K::TB / K::rb(D), v = V::TB / V::rb(D), kv = k < v ? k : v;
        return kv < KV_MAX_TILE ? kv : KV_MAX_TILE;
    }
    // Bounds over the head_dims of an instance: DT, or every one when DT == 0 (multiples of
    // 32 for the 4-bit formats, whose DPT of 32 at GB 1 leaves D = 16 no thread).
    __host__ __device__ static constexpr int max_over(int DT, int what) {
        int m = 0;
        constexpr int step = K::PACK == 2 || V::PACK == 2 ? 32 : 16;
        for (int D = DT ? DT : step; D <= (DT ? DT : 256); D += step) {
            const int x = what == 0 ? tile(D) : what == 1 ? tile(D) * (GROUPED ? 1 : tpr(D))
                        : what == 2 ? tile(D) * K::sb(D) : what == 4 ? tile(D) * V::sb(D)
                        : (rg(D) / 2) * D * 4 * GB;
            m = x > m ? x : m;
        }
        return m;
    }
    __host__ __device__ static constexpr int t_max(int DT) { return max_over(DT, 0); }
    __host__ __device__ static constexpr int part_max(int DT) { return max_over(DT, 1); }
    __host__ __device__ static constexpr int red_max(int DT) { return max_over(DT, 3); }
    // A stage: K codes at 0, V codes at V_OFF, K scales at ks_off, V scales at vs_off;
    // padded so that the stages hold the reduction buffer (only the 4-bit formats' smaller
    // stages at D = 256 need it).
    __host__ __device__ static constexpr int v_off(int DT) { return tbk(DT); }
    // K and V rows of the same code and scale bytes (one format): copied in one loop
    static constexpr bool SAME_ROWS = K::CB == V::CB && K::PACK == V::PACK && K::sb(32) == V::sb(32);
    __host__ __device__ static constexpr int ks_off(int DT) { return tbk(DT) + tbv(DT); }
    __host__ __device__ static constexpr int vs_off(int DT) { return ks_off(DT) + (max_over(DT, 2) + 15) / 16 * 16; }
    __host__ __device__ static constexpr int stage_bytes(int DT) {
        return vs_off(DT) + (max_over(DT, 4) + 15) / 16 * 16 > (red_max(DT) + STAGES * 16 - 1) / (STAGES * 16) * 16
            ? vs_off(DT) + (max_over(DT, 4) + 15) / 16 * 16 : (red_max(DT) + STAGES * 16 - 1) / (STAGES * 16) * 16;
    }
};

// The thread's DPT decoded codes f of row r (dims in one block, the first d0) and a
// stage's scale bytes s -> the factor of the row's partial dot (K) or weight (V): the row
// or block scale, 1 for the float formats. q4_1 instead dequantizes f in place, f = q * d
// + m with the CPU's two roundings (m does not factor out), and returns 1.
template <int FMT, int DPT>
__device__ __forceinline__ float kv_tile_dequant(const unsigned char* s, int r, int d0, int D, float* f) {
    if constexpr (FMT == KV_Q8_0 || FMT == KV_Q4_0) {
        const uint16_t* h = (const uint16_t*)s;
        return kv_f16_to_f32(h[r * (D / 32) + d0 / 32]);
    } else if constexpr (FMT == KV_Q4_1) {
        float dm[2];  // (d, m) of the block: one aligned 4-byte word
        kv_dec_h2(((const uint32_t*)s)[r * (D / 32) + d0 / 32], dm);
#pragma unroll
        for (int k = 0; k < DPT; k++) f[k] = __fadd_rn(__fmul_rn(f[k], dm[0]), dm[1]);
    } else if constexpr (FMT == KV_FP8_E4M3) {
        return ((const float*)s)[r] * 256.0f;  // the decoder returns value * 2^-8
    } else if constexpr (FMT >= KV_INT8) {
        return ((const float*)s)[r];
    }
    return 1.0f;
}

// K in q4_1ch: the thread's DPT consecutive dims d0.. of tile row r. A complete group (the
// tile, T = 32 row slots): channel c's 16 code bytes at codes + 16 c (ggml's nibble order:
// positions 0..15 low, 16..31 high), its (d, m) at scale word c, decoded q * d + m in the
// CPU's two roundings; the open group: the head's float16 residual res [32][D] (global
// memory; tiles start groups, so row r is residual slot r).
template <int DPT>
__device__ __forceinline__ void kv_group_krow(const unsigned char* codes, const unsigned char* scales,
                                              const unsigned char* res, bool open, int r, int d0,
                                              int D, float* f) {
    if (open) {
        const uint4* p = (const uint4*)((const uint16_t*)res + (size_t)r * D + d0);
#pragma unroll
        for (int k = 0; k < DPT; k += 8) {
            const uint4 u = p[k / 8];
            kv_dec_h2(u.x, f + k); kv_dec_h2(u.y, f + k + 2); kv_dec_h2(u.z, f + k + 4); kv_dec_h2(u.w, f + k + 6);
        }
    } else {
        const int shift = (r >> 4) << 2, b = r & 15;
#pragma unroll
        for (int k = 0; k < DPT; k++) {
            float dm[2];
            kv_dec_h2(((const uint32_t*)scales)[d0 + k], dm);
            const float q = (float)((codes[16 * (d0 + k) + b] >> shift) & 15);
            f[k] = __fadd_rn(__fmul_rn(q, dm[0]), dm[1]);
        }
    }
}

// The thread's VB code bytes of one row (16, 8 or 4, aligned) of side S (a KvSide of
// format FMT) -> DPT floats (in the order of KvSide::kofs).
template <int FMT, class S>
__device__ __forceinline__ void kv_load_row(const unsigned char* p, float* f) {
    using C = S;
    constexpr int PER_WORD = 4 * C::PACK / C::CB;
    uint32_t w[4];
    if constexpr (C::VB == 16) {
        const uint4 u = *(const uint4*)p;
        w[0] = u.x; w[1] = u.y; w[2] = u.z; w[3] = u.w;
    } else if constexpr (C::VB == 8) {
        const uint2 u = *(const uint2*)p;
        w[0] = u.x; w[1] = u.y;
    } else {  // 4-bit codes from 4 heads on: 4 bytes, 8 dims
        w[0] = *(const uint32_t*)p;
    }
#pragma unroll
    for (int i = 0; i < C::VB / 4; i++) kv_dec_word<FMT>(w[i], f + i * PER_WORD);
}

// 4 floats from shared memory (16-byte aligned), loaded where they are used: a volatile
// load, so that nvcc does not hoist a whole q (GB x DPT floats) into registers (it did,
// with plain loads: 80-450 bytes of spills at 128 registers).
__device__ __forceinline__ void kv_lds4(const float* p, float* f) {
#ifdef KVCORE_EMU
    f[0] = p[0]; f[1] = p[1]; f[2] = p[2]; f[3] = p[3];
#else
    const uint32_t a = (uint32_t)__cvta_generic_to_shared(p);
    asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];\n"
                 : "=f"(f[0]), "=f"(f[1]), "=f"(f[2]), "=f"(f[3]) : "r"(a));
#endif
}

// One side's scale rows of a tile (a K/V pair: each side on its own): rows [0, rows) of
// SB bytes from base + row(p0 + r) * SB into dst, 4-byte copies, or 2-byte loads when SB
// is not a multiple of 4 (q8_0 / q4_0 at D % 64 == 32); nothing without scales (HAS false).
template <bool HAS, class Src>
__device__ __forceinline__ void kv_copy_scales(unsigned char* dst, const unsigned char* base, int SB,
                                               int T, int rows, int p0, const Src& src, int tid) {
    if constexpr (HAS) {
        const int n = SB % 4 == 0 ? SB / 4 : SB / 2, w = SB % 4 == 0 ? 4 : 2;
        for (int i = tid; i < T * n; i += KV_ATTN_THREADS) {
            const int r = i / n;
            const bool ok = r < rows;
            const size_t off = ok ? src.row(p0 + r) * SB + (size_t)(i - r * n) * w : 0;
            if (w == 4) kv_cp4(dst + i * 4, base + off, ok ? 4 : 0);
            else ((uint16_t*)dst)[i] = ok ? *(const uint16_t*)(base + off) : 0;
        }
    }
}

// The kv head of the block: blockIdx.y = kv head x groups of GB query heads.
__device__ __forceinline__ int kv_block_kvh(int group, int gb) { return blockIdx.y / (group / gb); }

// One (split, GB query heads of one kv head, query row) per block; DT = head_dim, or 0
// for the instance that takes any supported head_dim at run time (d).
template <int KF, int VF, int DT, int GB, class Src>
__device__ __forceinline__ void kv_attn_split(
    const Src& src, int d, const void* __restrict__ q, int q_dtype, int hq, int group, float qk_scale,
    float* __restrict__ out, float* __restrict__ lse_out, float* __restrict__ ws_o,
    float* __restrict__ ws_lse, int window, int sink_tokens, float softcap2,
    const float* __restrict__ sinks) {
    using C = AttnCfg<KF, VF, GB>;
    using K = typename C::K;
    using V = typename C::V;
    constexpr int T_MAX = C::t_max(DT), RW = (T_MAX + 31) / 32;
    constexpr int KS_OFF = C::ks_off(DT), VS_OFF = C::vs_off(DT), STAGE_BYTES = C::stage_bytes(DT);
    constexpr int V_OFF = C::v_off(DT);
    static_assert(C::red_max(DT) <= C::STAGES * STAGE_BYTES, "reduction buffer must fit");
    __shared__ __align__(16) unsigned char stages[C::STAGES][STAGE_BYTES];
    __shared__ __align__(16) float part[GB * C::part_max(DT)];  // [g][row][c]
    __shared__ __align__(16) float prob[T_MAX * GB];           // [row][g]
    constexpr bool QS = C::qs(DT);
    __shared__ __align__(16) float q_s[QS ? GB * (DT ? DT : 256) : 4];  // [g][D] (QS)
    __shared__ float alpha_s[GB], m_s[GB], l_s[GB], inv_s[GB], cap_s;
    __shared__ int win_s[5];

    const int D = DT ? DT : d;
    const int RBK = K::rb(D), RBV = V::rb(D), SBK = K::sb(D), SBV = V::sb(D);
    const int TPR = C::tpr(D), RG = C::rg(D);
    const int T = C::tile(D), RPT = T / RG;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int c = tid % TPR, rg = tid / TPR;  // threads with rg >= RG only copy and reduce
    const int split = blockIdx.x, nsplit = gridDim.x;
    const int qh0 = kv_block_kvh(group, GB) * group + (blockIdx.y % (group / GB)) * GB;
    const size_t row0_out = (size_t)src.qrow * hq + qh0;  // output row of head qh0

    // The positions the query (at n - 1) sees: the window [lo, n), lo = max(n - window, 0),
    // and the sink positions [0, s_end) below it (all n without a window, or when the
    // sink positions reach the window). They are numbered by "visible indices": the sink
    // positions first, padded to whole tiles ([0, s_pad), rows from s_end on masked as a
    // tile's tail is), then the window, visible index v being position v + shift. Splits
    // and tiles cut the visible indices, so the work follows the window, a tile never
    // spans the gap, and no position outside what the query sees (no page, in the pool)
    // is read. Without a window: s_pad = shift = 0, visible index = position.
    // K q4_1ch: tiles start groups, so the window's tiles start at lo rounded down to a
    // group, and the positions in [gap_lo, gap_hi) (what the query does not see between
    // the sinks and the window) are masked as a tile's tail is; when no whole group lies
    // in the gap, one run from 0 takes the sinks, the gap and the window.
    const int n = src.n;
    int lo = window > 0 && n > window ? n - window : 0;
    if (sink_tokens >= lo) lo = 0;                       // the sinks reach the window
    int s_end = lo > 0 ? sink_tokens : 0;
    int gap_lo = 0, gap_hi = 0;
    if constexpr (C::GROUPED) {
        gap_lo = s_end;
        gap_hi = lo;
        lo -= lo % KV_GROUP;
        if (lo <= (s_end + T - 1) / T * T) lo = s_end = 0;
    }
    const int s_pad = (s_end + T - 1) / T * T;
    const int shift = lo - s_pad;
    const int nv = n - shift;

    // The split's visible indices: chunks of at least KV_MIN_SPLIT, whole tiles, computed
    // from the row's own count (a short row leaves the later splits empty).
    int chunk = (nv + nsplit - 1) / nsplit;
    chunk = chunk > KV_MIN_SPLIT ? chunk : KV_MIN_SPLIT;
    chunk = (chunk + T - 1) / T * T;
    const int start = split * chunk;
    const int end = min(nv, start + chunk);
    // Tile t of the split: its first position and its valid rows (a sink tile's end at
    // s_end). w = {s_pad, shift, min(end, s_end)}, in registers before the tile loop and
    // from shared memory in it (see cap_s below).
    auto tile_pos = [&](int t, const int* w) { const int v0 = start + t * T; return v0 < w[0] ? v0 : v0 + w[1]; };
    auto tile_rows = [&](int t, const int* w) {
        const int v0 = start + t * T;
        return min(T, (v0 < w[0] ? w[2] : end) - v0);
    };

    if (start >= end) {  // empty split (or row): out zeros / lse -inf for the merge
        // With sink logits, split 0 carries them: an empty row's lse is its sink, and with
        // several splits split 0 hands the merge a zero partial of lse = sink.
        const bool sink = sinks != nullptr && split == 0;
        if (nsplit == 1 || sink) {  // out [row][D], or ws_o [row][nsplit][D] at split 0
            float* dst = (nsplit == 1 ? out : ws_o) + row0_out * nsplit * D;
            for (int g = 0; g < GB; g++)
                for (int i = tid; i < D; i += KV_ATTN_THREADS) dst[(size_t)g * nsplit * D + i] = 0.0f;
        }
        for (int g = tid; g < GB; g += KV_ATTN_THREADS) {
            const float s = sink ? sinks[qh0 + g] : -INFINITY;
            if (nsplit > 1) ws_lse[(row0_out + g) * nsplit + split] = s * KV_LOG2E;
            else if (lse_out) lse_out[row0_out + g] = s;
        }
        return;
    }
    const int ntiles = (end - start + T - 1) / T;

    // Issues the copies of tile t (rows past `end` are zero-filled, never read).
    auto issue = [&](int t, const int* w) {
        if (t < ntiles) {
            unsigned char* st = stages[t % C::STAGES];
            const int p0 = tile_pos(t, w);
            // K q4_1ch: a complete group's 32 row slots hold every position's channels, so
            // all are copied even where only some rows are seen (a sink tile)
            const int rows = C::GROUPED && p0 + T <= src.full ? T : tile_rows(t, w);
            // 16-byte pieces of the K and V rows: one loop over both when their rows are
            // of the same size (one format), else one over each
            const int pk = RBK / 16, pv = RBV / 16;
            auto piece = [&](int i, int pieces, int rbytes, bool& ok) -> size_t {
                const int r = i / pieces;
                ok = r < rows;
                return ok ? src.row(p0 + r) * rbytes + (size_t)(i - r * pieces) * 16 : 0;
            };
            if constexpr (C::SAME_ROWS) {
                for (int i = tid; i < T * pk; i += KV_ATTN_THREADS) {
                    bool ok;
                    const size_t off = piece(i, pk, RBK, ok);
                    kv_cp16(st + i * 16, src.k + off, ok ? 16 : 0);
                    kv_cp16(st + V_OFF + i * 16, src.v + off, ok ? 16 : 0);
                }
            } else {
                for (int i = tid; i < T * pk; i += KV_ATTN_THREADS) {
                    bool ok;
                    const size_t off = piece(i, pk, RBK, ok);
                    kv_cp16(st + i * 16, src.k + off, ok ? 16 : 0);
                }
                for (int i = tid; i < T * pv; i += KV_ATTN_THREADS) {
                    bool ok;
                    const size_t off = piece(i, pv, RBV, ok);
                    kv_cp16(st + V_OFF + i * 16, src.v + off, ok ? 16 : 0);
                }
            }
            if constexpr (C::SAME_ROWS && K::sb(16) > 0) {
                unsigned char* ss = st + KS_OFF;
                const int SB = SBK;
                if (SB % 4 == 0) {
                    const int wpr = SB / 4;
                    for (int i = tid; i < T * wpr; i += KV_ATTN_THREADS) {
                        const int r = i / wpr;
                        const bool ok = r < rows;
                        const size_t off = ok ? src.row(p0 + r) * SB + (size_t)(i - r * wpr) * 4 : 0;
                        kv_cp4(ss + i * 4, src.ks + off, ok ? 4 : 0);
                        kv_cp4(st + VS_OFF + i * 4, src.vs + off, ok ? 4 : 0);
                    }
                } else {  // q8_0 / q4_0 with D % 64 == 32: rows of 2-byte scales, loaded directly
                    const int hpr = SB / 2;
                    for (int i = tid; i < T * hpr; i += KV_ATTN_THREADS) {
                        const int r = i / hpr;
                        const bool ok = r < rows;
                        uint16_t a = 0, b = 0;
                        if (ok) {
                            const size_t off = src.row(p0 + r) * SB + (size_t)(i - r * hpr) * 2;
                            a = *(const uint16_t*)(src.ks + off);
                            b = *(const uint16_t*)(src.vs + off);
                        }
                        ((uint16_t*)ss)[i] = a;
                        ((uint16_t*)(st + VS_OFF))[i] = b;
                    }
                }
            } else if constexpr (!C::SAME_ROWS) {   // each side's scales (none for a float side)
                kv_copy_scales<K::sb(16) != 0>(st + KS_OFF, src.ks, SBK, T, rows, p0, src, tid);
                kv_copy_scales<V::sb(16) != 0>(st + VS_OFF, src.vs, SBV, T, rows, p0, src, tid);
            }
        }
        kv_cp_commit();  // always one group per tile slot, so wait_group counts stay uniform
    };

    {
        const int w[3] = {s_pad, shift, min(end, s_end)};
#pragma unroll
        for (int t = 0; t < C::STAGES - 1; t++) issue(t, w);
    }
    // The variants' values are read from shared memory in the tile loop (written here,
    // visible after its first barrier): loop-invariant arguments there let nvcc unswitch
    // the loop on them, which cost up to 36 registers (2 blocks per SM instead of 3 for
    // f16/bf16 at GB 8).
    if (tid == 0) {
        cap_s = softcap2;
        win_s[0] = s_pad;
        win_s[1] = shift;
        win_s[2] = min(end, s_end);
        win_s[3] = gap_lo;
        win_s[4] = gap_hi;
    }

    // q for this thread's dims of the GB heads, pre-scaled for base-2 softmax.
    // (QS: every dim of the GB heads into q_s, visible after the tile loop's first barrier.)
    float qr[QS ? 1 : GB][C::DPT];
    if constexpr (QS) {
        for (int i = tid; i < GB * D; i += KV_ATTN_THREADS)
            q_s[i] = kv_load_input(q, q_dtype, (long long)row0_out * D + i) * qk_scale;
    } else {
#pragma unroll
        for (int g = 0; g < GB; g++) {
            const long long base = (long long)(row0_out + g) * D + K::d0(c);
#pragma unroll
            for (int k = 0; k < C::DPT; k++) qr[g][k] = kv_load_input(q, q_dtype, base + K::kofs(k)) * qk_scale;
        }
    }
    float acc[GB][C::DPT];
#pragma unroll
    for (int g = 0; g < GB; g++)
#pragma unroll
        for (int k = 0; k < C::DPT; k++) acc[g][k] = 0.0f;
    float m_run[C::HPW], l_run[C::HPW];
#pragma unroll
    for (int h = 0; h < C::HPW; h++) { m_run[h] = -INFINITY; l_run[h] = 0.0f; }

    for (int t = 0; t < ntiles; t++) {
        kv_cp_wait<C::STAGES - 2>();
        __syncthreads();  // tile t visible to all; every thread is done with tile t - 1
        issue(t + C::STAGES - 1, win_s);
        const unsigned char* st = stages[t % C::STAGES];
        const int rows = tile_rows(t, win_s);

        // a. partial scores of the thread's dims
        // (K q4_1ch: the tile is one group, complete (codes) or open (the residual))
        const int p0 = tile_pos(t, win_s);
        const bool open = C::GROUPED && p0 >= src.full;
        if (rg < RG) {
#pragma unroll
            for (int j = 0; j < RPT; j++) {
                const int r = rg + j * RG;
                float kf[C::DPT];
                float sc = 1.0f;
                if constexpr (C::GROUPED) {
                    kv_group_krow<C::DPT>(st, st + KS_OFF, src.kr, open, r, K::d0(c), D, kf);
                } else {
                    kv_load_row<KF, K>(st + r * RBK + c * K::VB, kf);
                    sc = kv_tile_dequant<KF, C::DPT>(st + KS_OFF, r, K::d0(c), D, kf);
                }
#pragma unroll
                for (int g = 0; g < GB; g++) {
                    float qv[C::DPT];
                    if constexpr (QS) {
#pragma unroll
                        for (int k = 0; k < C::DPT; k += 4) kv_lds4(q_s + g * D + K::d0(c) + K::kofs(k), qv + k);
                    } else {
#pragma unroll
                        for (int k = 0; k < C::DPT; k++) qv[k] = qr[g][k];
                    }
                    float s = 0.0f;
#pragma unroll
                    for (int k = 0; k < C::DPT; k++) s = fmaf(qv[k], kf[k], s);
                    if constexpr (C::GROUPED) {  // the row's TPR threads: consecutive lanes
                        for (int o = TPR / 2; o > 0; o >>= 1) s += __shfl_xor_sync(0xFFFFFFFFu, s, o);
                        if (c == 0) part[g * T + r] = s;
                    } else {
                        part[(g * T + r) * TPR + c] = s * sc;
                    }
                }
            }
        }
        __syncthreads();

        // b. online softmax, one warp per head
#pragma unroll
        for (int h = 0; h < C::HPW; h++) {
            const int g = warp + h * KV_ATTN_WARPS;
            if (g < GB) {
                float s[RW];
                float tmax = -INFINITY;
#pragma unroll
                for (int i = 0; i < RW; i++) {
                    const int r = lane + 32 * i;
                    s[i] = -INFINITY;
                    if (r < rows && !(C::GROUPED && p0 + r >= win_s[3] && p0 + r < win_s[4])) {
                        float v = 0.0f;
                        if constexpr (C::GROUPED) {
                            v = part[g * T + r];
                        } else {
                            const float* pp = part + (g * T + r) * TPR;
                            for (int cc = 0; cc < TPR; cc++) v += pp[cc];
                        }
                        // soft-capping (base 2: softcap2 = c log2(e)); masked rows stay -inf
                        const float cap = cap_s;  // (from shared memory: see below)
                        s[i] = cap > 0.0f ? cap * tanhf(v / cap) : v;
                    }
                    tmax = fmaxf(tmax, s[i]);
                }
#pragma unroll
                for (int o = 16; o > 0; o >>= 1) tmax = fmaxf(tmax, __shfl_xor_sync(0xFFFFFFFFu, tmax, o));
                const float m_new = fmaxf(m_run[h], tmax);
                const float a = exp2f(m_run[h] - m_new);  // 0 on the first tile (-inf)
                float psum = 0.0f;
#pragma unroll
                for (int i = 0; i < RW; i++) {
                    const int r = lane + 32 * i;
                    const float p = exp2f(s[i] - m_new);  // 0 for masked rows
                    if (r < T) prob[r * GB + g] = p;
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
        if (rg < RG) {
#pragma unroll
            for (int j = 0; j < RPT; j++) {
                const int r = rg + j * RG;
                float vf[C::DPT];
                kv_load_row<VF, V>(st + V_OFF + r * RBV + c * V::VB, vf);
                const float sc = kv_tile_dequant<VF, C::DPT>(st + VS_OFF, r, V::d0(c), D, vf);
#pragma unroll
                for (int g = 0; g < GB; g++) {
                    const float pv = prob[r * GB + g] * sc;
#pragma unroll
                    for (int k = 0; k < C::DPT; k++) acc[g][k] = fmaf(pv, vf[k], acc[g][k]);
                }
            }
        }
    }
    kv_cp_wait<0>();  // only empty groups can be left; drain them before reusing stages

    // Reduce acc over the row groups (halving through shared memory), heads' m and l too.
#pragma unroll
    for (int h = 0; h < C::HPW; h++) {
        const int g = warp + h * KV_ATTN_WARPS;
        if (g < GB && lane == 0) {
            float m = m_run[h], l = l_run[h], a = 1.0f;
            if (sinks != nullptr && split == 0) {  // the sink joins the denominator once
                const float s2 = sinks[qh0 + g] * KV_LOG2E;
                const float mm = fmaxf(m, s2);
                a = exp2f(m - mm);
                l = l * a + exp2f(s2 - mm);
                m = mm;
            }
            m_s[g] = m;
            l_s[g] = l;
            inv_s[g] = a / l;  // l >= 1 (the max row contributes 2^0); a = 1: exactly 1 / l
        }
    }
    float* red = (float*)&stages[0][0];  // [RG/2][GB][D]
    for (int live = RG; live > 1;) {
        const int half = (live + 1) / 2;  // groups [half, live) hand their acc to [0, live - half)
        __syncthreads();
        if (rg >= half && rg < live) {
#pragma unroll
            for (int g = 0; g < GB; g++)
#pragma unroll
                for (int k = 0; k < C::DPT; k++) red[((rg - half) * GB + g) * D + c * C::DPT + k] = acc[g][k];
        }
        __syncthreads();
        if (rg < live - half) {
#pragma unroll
            for (int g = 0; g < GB; g++)
#pragma unroll
                for (int k = 0; k < C::DPT; k++) acc[g][k] += red[(rg * GB + g) * D + c * C::DPT + k];
        }
        live = half;
    }
    if (rg == 0) {
#pragma unroll
        for (int g = 0; g < GB; g++) {
            const float inv = inv_s[g];
            const size_t row = row0_out + g;
            float* dst = nsplit == 1 ? out + row * D : ws_o + (row * nsplit + split) * D;
#pragma unroll
            for (int k = 0; k < C::DPT; k += 4) {
                const float4 v = make_float4(acc[g][k] * inv, acc[g][k + 1] * inv,
                                             acc[g][k + 2] * inv, acc[g][k + 3] * inv);
                *(float4*)(dst + V::d0(c) + V::kofs(k)) = v;
            }
            if (c == 0) {
                const float lse2 = m_s[g] + log2f(l_s[g]);  // base 2, of the scaled (capped) scores
                if (nsplit > 1) ws_lse[row * nsplit + split] = lse2;
                else if (lse_out) lse_out[row] = lse2 * KV_LN2;
            }
        }
    }
}

// Arguments every instance shares: d the head_dim (read by the _dx instances only);
// q [R][Hq][D] f32/f16/bf16 (q_dtype 0/1/2); qk_scale = softmax scale * log2(e); out
// [R][Hq][D] f32 and lse [R][Hq] f32 (natural log; null: not written) when nsplit == 1,
// else ws_o [R][Hq][nsplit][D] and ws_lse [R][Hq][nsplit] (base 2) for kv_attn_merge.
// Variants (0 / null: off): window, sink_tokens (ints), softcap2 = softcap * log2(e),
// sinks [Hq] f32 natural-log sink logits.
#define KV_ATTN_ARGS                                                                         \
    int d, const void *q, int q_dtype, int hq, int group, float qk_scale, float *out,        \
        float *lse, float *ws_o, float *ws_lse, int window, int sink_tokens, float softcap2, \
        const float *sinks
#define KV_ATTN_PASS d, q, q_dtype, hq, group, qk_scale, out, lse, ws_o, ws_lse, window, \
        sink_tokens, softcap2, sinks

// kv_attn_<format>_d<D>_g<GB> (a pair: <format> = <k>_<v>): GpuKVCache slots. Grid
//   (nsplit, Hkv * G / GB, M). k_ptrs/v_ptrs [M] u64 -> codes [Hkv][N][W] of K's / V's
//   format; ks_ptrs/vs_ptrs [M] u64 -> scales [Hkv][N][S] (int8/fp8 f32, q8_0/q4_0/q4_1
//   f16; ignored by float formats); k_res: K q4_1ch's residual [M][Hkv][32][D] f16 of the
//   layer (ignored by every other K format); lengths [M] int32 (+ extra, at most capacity N).
// kv_pattn_<format>_d<D>_g<GB>: GpuKVPool step rows (KvPagedStorage). Grid (nsplit,
//   Hkv * G / GB, R). k_codes.. v_scales: one layer's bases; k_res [R][Hkv][32][D] f16 and
//   res_slots int32 [max_batch]: K q4_1ch's residuals and each sequence's (ignored by every
//   other K format); block_tables int32 [max_batch][max_pages]; lengths int32 [max_batch];
//   q_offsets int32 [max_batch + 1].
// D is 64, 128, 256 or x (any multiple of 16 up to 256, given as d).
#define KV_ATTN_SLOT(KF, VF, NAME, DN, DT, GB)                                                 \
    extern "C" __global__ void __launch_bounds__(KV_ATTN_THREADS, AttnCfg<KF, VF, GB>::min_blocks(DT, false)) kv_attn_##NAME##_d##DN##_g##GB( \
        const unsigned long long* k_ptrs, const unsigned long long* v_ptrs,                    \
        const unsigned long long* ks_ptrs, const unsigned long long* vs_ptrs,                  \
        const unsigned char* k_res, const int* lengths, int extra, int capacity, KV_ATTN_ARGS) { \
        using C = AttnCfg<KF, VF, GB>;                                                         \
        const int D = DT ? DT : d;                                                             \
        kv_attn_split<KF, VF, DT, GB>(                                                         \
            kv_slot_storage(k_ptrs, v_ptrs, ks_ptrs, vs_ptrs, k_res, lengths, extra, capacity, \
                            kv_block_kvh(group, GB), gridDim.y * GB / group, C::K::rb(D),      \
                            C::V::rb(D), C::K::sb(D), C::V::sb(D), C::GROUPED ? 2 * D : 0),    \
            KV_ATTN_PASS);                                                                     \
    }
#define KV_ATTN_PAGED(KF, VF, NAME, DN, DT, GB)                                                \
    extern "C" __global__ void __launch_bounds__(KV_ATTN_THREADS, AttnCfg<KF, VF, GB>::min_blocks(DT, true)) kv_pattn_##NAME##_d##DN##_g##GB( \
        const unsigned char* k_codes, const unsigned char* v_codes,                            \
        const unsigned char* k_scales, const unsigned char* v_scales,                          \
        const unsigned char* k_res, const int* res_slots,                                      \
        const int* block_tables, int max_pages, const int* lengths, const int* q_offsets,      \
        int max_batch, int page_size, int hkv, int causal, KV_ATTN_ARGS) {                     \
        using C = AttnCfg<KF, VF, GB>;                                                         \
        const int D = DT ? DT : d;                                                             \
        kv_attn_split<KF, VF, DT, GB>(                                                         \
            kv_paged_storage(k_codes, v_codes, k_scales, v_scales, k_res, res_slots,           \
                             block_tables, max_pages, lengths, q_offsets, max_batch,           \
                             page_size, hkv, causal, kv_block_kvh(group, GB), C::K::rb(D),     \
                             C::V::rb(D), C::K::sb(D), C::V::sb(D), C::GROUPED ? 2 * D : 0),   \
            KV_ATTN_PASS);                                                                     \
    }
#define KV_ATTN_INSTANCE(KF, VF, NAME, DN, DT, GB) \
    KV_ATTN_SLOT(KF, VF, NAME, DN, DT, GB) KV_ATTN_PAGED(KF, VF, NAME, DN, DT, GB)
#define KV_ATTN_GB(KF, VF, NAME, DN, DT, EACH) \
    EACH(KF, VF, NAME, DN, DT, 1) EACH(KF, VF, NAME, DN, DT, 2) \
    EACH(KF, VF, NAME, DN, DT, 4) EACH(KF, VF, NAME, DN, DT, 8)
#define KV_ATTN_DIMS(KF, VF, NAME, EACH) \
    KV_ATTN_GB(KF, VF, NAME, 64, 64, EACH) KV_ATTN_GB(KF, VF, NAME, 128, 128, EACH) \
    KV_ATTN_GB(KF, VF, NAME, 256, 256, EACH) KV_ATTN_GB(KF, VF, NAME, x, 0, EACH)
// Every instance of K in format KF and V in VF (one format: KF == VF), named NAME.
#define KV_ATTN_PAIR(KF, VF, NAME) KV_ATTN_DIMS(KF, VF, NAME, KV_ATTN_INSTANCE)
#define KV_ATTN_FORMAT(FMT, NAME) KV_ATTN_PAIR(FMT, FMT, NAME)
