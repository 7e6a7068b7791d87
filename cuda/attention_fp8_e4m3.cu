// Decode attention kernels kv_attn_fp8_e4m3_d<D>_g<GB> for the fp8_e4m3 format
// and kv_pattn_* (pool), D 64/128/256/x, GB 1/2/4/8; see attention.cuh.
#include "attention.cuh"

KV_ATTN_FORMAT(KV_FP8_E4M3, fp8_e4m3)
