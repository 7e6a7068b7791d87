// kvcore decode attention: the log-sum-exp merge of the splits written by the
// kv_attn_<format>_d<D>_g<GB> kernels (cuda/attention.cuh, one module per format).
#include "common.cuh"

// kv_attn_merge: one block of D threads per (slot, query head).
//   ws_o [M][Hq][nsplit][D] f32, ws_lse [M][Hq][nsplit] f32 (base 2; -inf = empty split)
//   -> out [M][Hq][D] f32 = sum_i 2^(lse_i - max) o_i / sum_i 2^(lse_i - max); zeros when
//   every split is empty.
extern "C" __global__ void kv_attn_merge(const float* __restrict__ ws_o, const float* __restrict__ ws_lse,
                                         float* __restrict__ out, int nsplit, int D) {
    const size_t row = blockIdx.x;
    const int d = threadIdx.x;
    const float* lse = ws_lse + row * nsplit;
    float mx = -INFINITY;
    for (int i = 0; i < nsplit; i++) mx = fmaxf(mx, lse[i]);
    float num = 0.0f, den = 0.0f;
    if (mx != -INFINITY) {
        for (int i = 0; i < nsplit; i++) {
            const float w = exp2f(lse[i] - mx);
            den += w;
            num = fmaf(w, ws_o[(row * nsplit + i) * D + d], num);
        }
    }
    out[row * D + d] = den > 0.0f ? num / den : 0.0f;
}
