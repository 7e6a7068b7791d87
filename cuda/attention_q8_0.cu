// Decode attention kernels kv_attn_q8_0_d<D>_g<GB> for the q8_0 format
// and kv_pattn_* (pool), D 64/128/256/x, GB 1/2/4/8; see attention.cuh.
#include "attention.cuh"

KV_ATTN_FORMAT(KV_Q8_0, q8_0)
