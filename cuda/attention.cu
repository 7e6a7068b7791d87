// kvcore decode attention: the log-sum-exp merge of the splits written by the
// kv_attn_* / kv_pattn_* kernels (cuda/attention.cuh, one module per format).
#include "common.cuh"

// kv_attn_merge: one block of D threads per (query row, query head).
//   ws_o [R][Hq][nsplit][D] f32, ws_lse [R][Hq][nsplit] f32 (base 2; -inf = empty split,
//   whose ws_o is not read) -> out [R][Hq][D] f32 = sum_i 2^(lse_i - max) o_i / sum_i
//   2^(lse_i - max), zeros when every split is empty; lse [R][Hq] f32 (null: not written)
//   = (max + log2(sum_i 2^(lse_i - max))) ln 2, the natural log-sum-exp, -inf when empty.
extern "C" __global__ void kv_attn_merge(const float* __restrict__ ws_o, const float* __restrict__ ws_lse,
                                         float* __restrict__ out, float* __restrict__ lse,
                                         int nsplit, int D) {
    const size_t row = blockIdx.x;
    const int d = threadIdx.x;
    const float* ls = ws_lse + row * nsplit;
    float mx = -INFINITY;
    for (int i = 0; i < nsplit; i++) mx = fmaxf(mx, ls[i]);
    float num = 0.0f, den = 0.0f;
    if (mx != -INFINITY) {
        for (int i = 0; i < nsplit; i++) {
            if (ls[i] == -INFINITY) continue;
            const float w = exp2f(ls[i] - mx);
            den += w;
            num = fmaf(w, ws_o[(row * nsplit + i) * D + d], num);
        }
    }
    out[row * D + d] = den > 0.0f ? num / den : 0.0f;
    if (lse && d == 0) lse[row] = den > 0.0f ? (mx + log2f(den)) * KV_LN2 : -INFINITY;
}
