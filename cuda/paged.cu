// Writes into a GpuKVPool: the paged append (quantize-on-append through a slot mapping).
// (The pool's decode attention is the split kernel of attention.cuh, kv_pattn_*.)
//
// 1. One layer of the pool is token-major, as the CPU KVPool's storage: codes
//    [P * page_size][Hkv][W] (code dtype; W = D, or D/2 bytes for q4_0 / q4_1), scales
//    [P * page_size][Hkv][S] (S = 1 f32 for int8/fp8, D/32 f16 for q8_0 and q4_0, 2 D/32
//    f16 (d, m) for q4_1, none for f32/f16/bf16). Slot r (a "row", vLLM's slot)
//    is position r % page_size of page r / page_size; its head h is row r * Hkv + h.
// 2. Where each input row goes comes from the device slot mapping (int64, written by the
//    host between steps), so one captured graph replays the same launch step after step.
// 3. Errors never trap: slot -1 is padding (its input is not read); any other slot outside
//    [0, num_slots) refuses the whole launch (nothing written anywhere) and ORs
//    KV_ERR_SLOT into *status; an input row holding NaN/inf is skipped and ORs
//    KV_ERR_NONFINITE, one past the format's range KV_ERR_RANGE (as kv_append.cu).
//    Two rows naming the same slot are not detected (the host never maps them so).
// 5. K in q4_1ch (docs/formats.md; pages hold whole groups): each sequence of the step has a
//    float16 residual [Hkv][32][D] (res_slots[b] of k_res), and its rows go through
//    append_group (encode.cuh) as a GpuKVCache slot's run of rows does; the host launches
//    mode 1 (check only) then mode 2 (writes only when the status is clear), so that a
//    refused step leaves every residual as it was.
// 4. The slot mapping holds `cap` entries, packed: the step's rows first, then -1. A launch
//    of fewer input rows than the step has (slots[T] != -1: a graph captured for fewer
//    tokens than a later step's) refuses the whole launch and ORs KV_ERR_ROWS, so no
//    position of the step is left unwritten without an error.
#include "encode.cuh"

#define KV_ERR_SLOT 8
#define KV_ERR_ROWS 16

// Appends T input rows to one layer.
//   k_in, v_in [T][Hkv][D] in_dtype (0 f32, 1 f16, 2 bf16); element strides s_r, s_h; D contiguous
//   k_codes, v_codes [num_slots][Hkv][W]; k_scales, v_scales [num_slots][Hkv][S] (layer bases)
//   slots int64[cap]: row t goes to slot slots[t] (-1: skipped); status int32 (OR'ed)
//   k_res [R][Hkv][32][D] f16 (K q4_1ch's residuals; null otherwise); lengths int32
//   [max_batch] (each sequence's length after the step), q_offsets int32 [max_batch + 1]
//   (its rows, CSR), res_slots int32 [max_batch] (its residual): read for K q4_1ch only
//   k_fmt, v_fmt: the formats of K and of V (the same but for a K/V pair)
//   mode: 0 check and write each row; 1 check only; 2 write when *status is 0
// One warp per head row: warps [0, T*Hkv) write K, [T*Hkv, 2*T*Hkv) write V.
extern "C" __global__ void kv_paged_append(
        const void* __restrict__ k_in, const void* __restrict__ v_in, int in_dtype,
        long long s_r, long long s_h,
        void* k_codes, void* v_codes, void* k_scales, void* v_scales, void* k_res,
        const long long* __restrict__ slots, long long num_slots, int* status,
        const int* __restrict__ lengths, const int* __restrict__ q_offsets,
        const int* __restrict__ res_slots, int max_batch,
        int k_fmt, int v_fmt, int T, int cap, int Hkv, int D, int mode) {
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
    const bool short_launch = T < cap && slots[T] != -1;
    if (__any_sync(0xffffffffu, bad) || short_launch) {
        if (warp == 0 && lane == 0) atomicOr(status, short_launch ? KV_ERR_ROWS : KV_ERR_SLOT);
        return;
    }

    const bool is_v = warp >= rows;
    const long long w = is_v ? warp - rows : warp;
    const int t = (int)(w / Hkv), h = (int)(w % Hkv);
    const long long slot = slots[t];
    if (slot < 0 || (mode == 2 && *status != 0)) return;
    const long long row = slot * Hkv + h, in_base = t * s_r + h * s_h;
    const int fmt = is_v ? v_fmt : k_fmt;
    int refused = 0;
    if (mode == 1) {
        refused = check_row(is_v ? v_in : k_in, in_dtype, in_base, D, fmt, lane);
    } else if (fmt == KV_Q4_1CH) {                  // K by channel: row t of sequence b
        int b = 0, hi = max_batch;                  // the last b with q_offsets[b] <= t
        while (hi - b > 1) {
            const int mid = (b + hi) / 2;
            if (q_offsets[mid] <= t) b = mid; else hi = mid;
        }
        const int count = q_offsets[b + 1] - q_offsets[b];
        uint16_t* res = (uint16_t*)k_res + ((long long)res_slots[b] * Hkv + h) * KV_GROUP * D;
        append_group(k_in, in_dtype, in_base, s_r, D, lengths[b] - count, t - q_offsets[b], count,
                     (uint8_t*)k_codes + row * (D / 2), (long long)Hkv * (D / 2),
                     (uint16_t*)k_scales + row * (D / 16), (long long)Hkv * (D / 16), res, lane);
    } else {
        refused = encode_row_into(k_in, v_in, in_dtype, in_base, D, fmt, is_v, k_codes, v_codes,
                                  k_scales, v_scales, row, lane);
    }
    if (refused && lane == 0) atomicOr(status, refused);
}
