// Decode attention kernels kv_attn_q4_1ch_q4_1_d<D>_g<GB> for K in q4_1ch (by channel over
// groups of 32 positions, with the open group's float16 residual) and V in q4_1 (a K/V pair)
// and kv_pattn_* (pool), D 64/128/256/x, GB 1/2/4/8; see attention.cuh.
#include "attention.cuh"

KV_ATTN_PAIR(KV_Q4_1CH, KV_Q4_1, q4_1ch_q4_1)
