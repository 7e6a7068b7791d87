// Decode attention kernels kv_attn_f16_q4_0_d<D>_g<GB> for K in f16 and V in q4_0 (a K/V pair)
// and kv_pattn_* (pool), D 64/128/256/x, GB 1/2/4/8; see attention.cuh.
#include "attention.cuh"

KV_ATTN_PAIR(KV_F16, KV_Q4_0, f16_q4_0)
