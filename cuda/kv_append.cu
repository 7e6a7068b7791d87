// Writes into a GpuKVCache: quantize-on-append and the commit of a step.
//
// 1. One layer of the cache, per slot, is head-major: codes [M][Hkv][N][W] (code dtype of
//    the format; W = D, or D/2 bytes for q4_0 / q4_1), scales [M][Hkv][N][S] (S = 1 f32 for
//    int8/fp8, D/32 f16 for q8_0 and q4_0, 2 D/32 f16 (d, m) for q4_1, none for
//    f32/f16/bf16). Kernels get the layer's base pointers; slot s, head h, position p
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
// 5. K in q4_1ch (by channel over groups of 32 positions, docs/formats.md): a row goes to
//    the slot's residual, float16 k_res [M][Hkv][32][D] (slot p mod 32), and a group is
//    encoded into its 32 row slots when its last position is written (from the float16
//    values, as the CPU does). T rows of one slot take two launches: mode 1 only checks
//    (status bits), mode 2 writes only the slots whose status is still clear, so that a
//    refused step leaves the residual of the committed positions untouched (a step
//    crossing a group boundary overwrites residual slots of the open group).
#include "encode.cuh"

// Appends one step to one layer.
//   k_in, v_in [R][Hkv][D] in_dtype (0 f32, 1 f16, 2 bf16); element strides s_r, s_h; D contiguous
//   k_codes, v_codes [M][Hkv][N][W] code dtype; k_scales, v_scales [M][Hkv][N][S] (layer bases)
//   k_fmt, v_fmt: the formats of K and of V (the same but for a K/V pair)
//   lengths int32[M] (read only), status int32[M] (OR'ed), active int32[M] or null
//   slot < 0: R = M, row r goes to slot r at position lengths[r] (when active[r] != 0)
//   slot >= 0: R = T rows go to slot `slot` at positions lengths[slot] + r
//   k_res: K q4_1ch's residual [M][Hkv][32][D] f16 of the layer (null for other formats)
//   mode: 0 check and write each row; 1 check only; 2 write the slots whose status is 0
//   (K q4_1ch with slot >= 0: mode 1, then mode 2)
// One warp per head row: warps [0, R*Hkv) write K, [R*Hkv, 2*R*Hkv) write V. Every value a
// warp branches on is the same in all its lanes (one slot per warp).
extern "C" __global__ void kv_append(
        const void* __restrict__ k_in, const void* __restrict__ v_in, int in_dtype,
        long long s_r, long long s_h,
        void* k_codes, void* v_codes, void* k_scales, void* v_scales, void* k_res,
        const int* __restrict__ lengths, int* status, const int* __restrict__ active,
        int k_fmt, int v_fmt, int M, int Hkv, int N, int D, int slot, int T, int mode) {
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
    if (mode == 2 && status[s] != 0) return;        // refused by the checking launch
    const int pos = len + (slot < 0 ? 0 : r);
    const long long head = (long long)s * Hkv + h, row = head * N + pos;
    const long long in_base = r * s_r + h * s_h;
    const int fmt = is_v ? v_fmt : k_fmt;
    int refused = 0;
    if (mode == 1) {
        refused = check_row(is_v ? v_in : k_in, in_dtype, in_base, D, fmt, lane);
    } else if (fmt == KV_Q4_1CH) {                  // K by channel (is_v is false)
        uint16_t* res = (uint16_t*)k_res + head * KV_GROUP * D;
        uint8_t* codes = (uint8_t*)k_codes + row * (D / 2);      // position pos's row
        uint16_t* scales = (uint16_t*)k_scales + row * (D / 16);
        if (slot >= 0) {
            append_group(k_in, in_dtype, in_base, s_r, D, len, r, T, codes, D / 2, scales, D / 16, res, lane);
        } else if (!(refused = check_row(k_in, in_dtype, in_base, D, fmt, lane))) {
            append_group(k_in, in_dtype, in_base, s_r, D, pos, 0, 1, codes, D / 2, scales, D / 16, res, lane);
        }
    } else {
        refused = encode_row_into(k_in, v_in, in_dtype, in_base, D, fmt, is_v, k_codes, v_codes,
                                  k_scales, v_scales, row, lane);
    }
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
