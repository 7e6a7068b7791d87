// Decode attention kernels kv_attn_q4_0_d<D>_g<GB> for the q4_0 format
// and kv_pattn_* (pool), D 64/128/256/x, GB 1/2/4/8; see attention.cuh.
#include "attention.cuh"

KV_ATTN_FORMAT(KV_Q4_0, q4_0)
