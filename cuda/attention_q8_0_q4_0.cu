// Decode attention kernels kv_attn_q8_0_q4_0_d<D>_g<GB> for K in q8_0 and V in q4_0 (a K/V pair)
// and kv_pattn_* (pool), D 64/128/256/x, GB 1/2/4/8; see attention.cuh.
#include "attention.cuh"

KV_ATTN_PAIR(KV_Q8_0, KV_Q4_0, q8_0_q4_0)
