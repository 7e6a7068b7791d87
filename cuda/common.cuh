// kvcore device codecs, shared by every kernel in cuda/*.cu.
//
// 1. Format ids equal kvcore/formats.py: f32=0, f16=1, bf16=2, int8=3, fp8_e4m3=4,
//    fp8_e5m2=5, q8_0=6, q4_0=7, q4_1=8, q4_1ch=9 (q4_1 by channel over groups of 32
//    positions, K only: docs/formats.md; its group encoder is in encode.cuh). Kernel inputs (q, k, v) use the first three as
//    dtype ids.
// 2. Every encoder here is bit-identical to the CPU encoder of kvcore/_quant.pyx for
//    finite input (the CPU is the reference). Rules that need separate roundings use
//    the explicit __fdiv_rn / __fmul_rn intrinsics, so neither FMA contraction nor
//    --use_fast_math can change a code; build with tools/build_ptx.py.
// 3. Row rules (one row = D values of one position of one head; amax = max|x|):
//      int8      s = amax / 127 (f32),   q = rne(x / s) clamped to [-127, 127]; s = 0 -> q = 0
//      fp8_e4m3  s = amax / 448 (f32),   c = E4M3FN(x / s), RNE, saturating;  s = 0 -> c = 0
//      fp8_e5m2  s = amax / 57344 (f32), c = E5M2(x / s), RNE, saturating;    s = 0 -> c = 0
//      q8_0      per 32 values: d = amax / 127 (f32), id = d ? 1 / d : 0,
//                q = round-half-away(x * id), scale stored as f16(d) (RNE)
//      q4_0      per 32 values: max = the first x of largest |x|, d = max / -8, id = d ? 1 / d : 0,
//                q = u4(x * id + 8.5), scale f16(d)
//      q4_1      per 32 values: min, max (the last of equal values), d = (max - min) / 15,
//                id = d ? 1 / d : 0, q = u4((x - min) * id + 0.5), scales f16(d), f16(min)
//                (u4: numpy's float -> uint8 cast of the truncated value, at most 15: kv_u4)
//    A finite input |x| >= kv_input_limit(fmt) is refused (f16 and bf16: it would round
//    to inf; q8_0 and q4_0: its f16 block scale would; q4_1: the f16 bound; int8: 127 * s
//    would), as NaN and inf are by every format.
//    Decoding: x = code * scale (f32 multiply); q8_0 x = q * f32(f16 scale); q4_0
//    x = (q - 8) * f32(d); q4_1 x = q * f32(d) + f32(m) (two roundings).
//    4-bit codes: two per byte, byte j of a block holds value j (low nibble) and 16 + j.
// 4. Codes are passed around as their raw bits: f16/bf16 as uint16, fp8 as uint8.
#pragma once

#include <stdint.h>

#define KV_F32 0
#define KV_F16 1
#define KV_BF16 2
#define KV_INT8 3
#define KV_FP8_E4M3 4
#define KV_FP8_E5M2 5
#define KV_Q8_0 6
#define KV_Q4_0 7
#define KV_Q4_1 8
#define KV_Q4_1CH 9
#define KV_GROUP 32  // positions per group of q4_1ch (one q4_1 block per channel)

#define KV_Q8_0_BLOCK 32
#define KV_QK 32  // values per block of q8_0, q4_0, q4_1
#define KV_LN2 0.6931471805599453f  // ln 2, float: base-2 log-sum-exp -> natural
#define KV_LOG2E 1.4426950408889634f  // log2(e), float: natural logits -> base 2
#define KV_INT8_MAX 127.0f
#define KV_E4M3_MAX 448.0f
#define KV_E5M2_MAX 57344.0f
// The smallest |x| each format refuses (kvcore._quant.input_limit): f16 65520 and bf16
// 0x7f7f8000 round (to even) to inf; q8_0's f16 block scale max|x| / 127 would be inf
// from 8321040 (0x4afdf020) on; an int8 row of float32 max (0x7f7fffff) would decode
// to inf (127 * (max|x| / 127) rounds past it).
#define KV_F16_LIMIT 65520.0f
#define KV_BF16_LIMIT_BITS 0x7f7f8000
#define KV_Q8_0_LIMIT 8321040.0f
// q4_0: d = max / -8 is exact, so f16(d) is inf exactly from 8 * 65520 on; q4_1: the f16
// bound on every value (kvcore._quant.Q4_1_LIMIT: its f16 min and d are finite below it).
#define KV_Q4_0_LIMIT 524160.0f
#define KV_Q4_1_LIMIT KV_F16_LIMIT
#define KV_INT8_LIMIT_BITS 0x7f7fffff

// Bits of the device error flag (one int32 per cache; see docs/gpu.md).
#define KV_ERR_CAPACITY 1
#define KV_ERR_NONFINITE 2
#define KV_ERR_RANGE 4

// ---- f16 / bf16 -----------------------------------------------------------------

#ifdef KVCORE_EMU
// Host twins of the inline-PTX helpers below, for the CPU emulation (cuda/emu/kvemu.h):
// the same roundings in integer arithmetic.
__device__ __forceinline__ uint16_t kv_f32_to_f16(float x) { return kvemu::f32_to_f16_rn(x); }
__device__ __forceinline__ float kv_f16_to_f32(uint16_t h) { return kvemu::f16_to_f32(h); }
#else
// f32 -> IEEE binary16 bits, round to nearest even (overflow -> inf).
__device__ __forceinline__ uint16_t kv_f32_to_f16(float x) {
    uint16_t h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return h;
}

__device__ __forceinline__ float kv_f16_to_f32(uint16_t h) {
    float x;
    asm("cvt.f32.f16 %0, %1;" : "=f"(x) : "h"(h));
    return x;
}
#endif

// f32 -> bfloat16 bits, round to nearest even (finite input).
__device__ __forceinline__ uint16_t kv_f32_to_bf16(float x) {
    uint32_t u = __float_as_uint(x);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

__device__ __forceinline__ float kv_bf16_to_f32(uint16_t h) {
    return __uint_as_float(((uint32_t)h) << 16);
}

// ---- fp8 ------------------------------------------------------------------------

// f32 -> OCP E4M3FN bits: round to nearest even, |x| > 448 saturates to 448 (0x7E).
__device__ __forceinline__ uint8_t kv_f32_to_e4m3(float x) {
    uint32_t sign = (__float_as_uint(x) >> 24) & 0x80u;
    float a = fminf(fabsf(x), KV_E4M3_MAX);
    uint32_t code;
    if (a < 0.015625f) {  // below 2^-6: subnormal, units of 2^-9 (8 means 2^-6, code 0x08)
        code = (uint32_t)__float2int_rn(__fmul_rn(a, 512.0f));
    } else {
        uint32_t u = __float_as_uint(a);
        u += 0x7FFFFu + ((u >> 20) & 1u);       // RNE to 3 mantissa bits
        code = (u >> 20) - (120u << 3);         // rebias exponent 127 -> 7
    }
    return (uint8_t)(sign | code);
}

// f32 -> OCP E5M2 bits: round to nearest even, |x| > 57344 saturates to 57344 (0x7B).
__device__ __forceinline__ uint8_t kv_f32_to_e5m2(float x) {
    uint32_t sign = (__float_as_uint(x) >> 24) & 0x80u;
    float a = fminf(fabsf(x), KV_E5M2_MAX);
    uint32_t code;
    if (a < 6.103515625e-05f) {  // below 2^-14: subnormal, units of 2^-16
        code = (uint32_t)__float2int_rn(__fmul_rn(a, 65536.0f));
    } else {
        uint32_t u = __float_as_uint(a);
        u += 0xFFFFFu + ((u >> 21) & 1u);       // RNE to 2 mantissa bits
        code = (u >> 21) - (112u << 2);         // rebias exponent 127 -> 15
    }
    return (uint8_t)(sign | code);
}

// E4M3FN bits -> f32 (exact; the NaN code 0x7F/0xFF is never written by the encoder).
__device__ __forceinline__ float kv_e4m3_to_f32(uint8_t c) {
    float m = __uint_as_float(((uint32_t)(c & 0x7Fu)) << 20);
    return __uint_as_float(__float_as_uint(__fmul_rn(m, 0x1p120f)) | (((uint32_t)(c & 0x80u)) << 24));
}

// E5M2 bits -> f32 (exact; inf/NaN codes are never written by the encoder).
__device__ __forceinline__ float kv_e5m2_to_f32(uint8_t c) {
    float m = __uint_as_float(((uint32_t)(c & 0x7Fu)) << 21);
    return __uint_as_float(__float_as_uint(__fmul_rn(m, 0x1p112f)) | (((uint32_t)(c & 0x80u)) << 24));
}

// ---- scalar encoders used by the row rules -----------------------------------------

// int8 code of x for row scale s (s > 0): rne(x / s) clamped to [-127, 127].
__device__ __forceinline__ int8_t kv_int8_code(float x, float s) {
    int q = __float2int_rn(__fdiv_rn(x, s));
    return (int8_t)max(-127, min(127, q));
}

// Round half away from zero (C roundf), exact for every float.
__device__ __forceinline__ float kv_round_half_away(float v) {
    float t = truncf(v);
    return fabsf(__fsub_rn(v, t)) >= 0.5f ? __fadd_rn(t, copysignf(1.0f, v)) : t;
}

// q8_0 code of x for block inverse scale id = 1 / d (0 when d = 0). When 1 / d overflows
// (max|x| < ~3.7e-37) the codes saturate to +-127 and zeros stay 0, as on the CPU.
__device__ __forceinline__ int8_t kv_q8_0_code(float x, float id) {
    float r = fminf(fmaxf(kv_round_half_away(__fmul_rn(x, id)), -127.0f), 127.0f);
    return x == 0.0f ? (int8_t)0 : (int8_t)(int)r;
}

// numpy's np.trunc(v).astype(np.uint8).clip(0, 15) on x86, as gguf-py's q4_0 / q4_1 (and
// kvcore._quant._np_to_u4): the float -> int32 conversion of trunc(v) (NaN and values
// outside int32 give 0x80000000), its low byte, at most 15.
__device__ __forceinline__ uint32_t kv_u4(float v) {
    const float t = truncf(v);
    const uint32_t c = t > -2147483648.0f && t < 2147483648.0f ? (uint32_t)(int)t & 0xFFu : 0u;
    return c > 15u ? 15u : c;
}

// Row scale of int8 / fp8 rows, and q8_0 block scale d, from amax.
__device__ __forceinline__ float kv_row_scale(int fmt, float amax) {
    float div = fmt == KV_FP8_E4M3 ? KV_E4M3_MAX : fmt == KV_FP8_E5M2 ? KV_E5M2_MAX : KV_INT8_MAX;
    return __fdiv_rn(amax, div);
}

// Code of one value of an int8 / fp8 row with scale s (s = 0 gives code 0).
__device__ __forceinline__ uint8_t kv_scaled_code(int fmt, float x, float s) {
    if (s == 0.0f) return 0;
    if (fmt == KV_INT8) return (uint8_t)kv_int8_code(x, s);
    float y = __fdiv_rn(x, s);
    return fmt == KV_FP8_E4M3 ? kv_f32_to_e4m3(y) : kv_f32_to_e5m2(y);
}

// Element i of a float input array (dtype 0 f32, 1 f16, 2 bf16) as f32.
__device__ __forceinline__ float kv_load_input(const void* p, int dtype, long long i) {
    if (dtype == KV_F32) return ((const float*)p)[i];
    if (dtype == KV_F16) return kv_f16_to_f32(((const uint16_t*)p)[i]);
    return kv_bf16_to_f32(((const uint16_t*)p)[i]);
}

// The smallest |x| format fmt refuses (INFINITY: only NaN and inf are refused).
__device__ __forceinline__ float kv_input_limit(int fmt) {
    if (fmt == KV_F16) return KV_F16_LIMIT;
    if (fmt == KV_BF16) return __int_as_float(KV_BF16_LIMIT_BITS);
    if (fmt == KV_Q8_0) return KV_Q8_0_LIMIT;
    if (fmt == KV_Q4_0) return KV_Q4_0_LIMIT;
    if (fmt == KV_Q4_1 || fmt == KV_Q4_1CH) return KV_Q4_1_LIMIT;
    if (fmt == KV_INT8) return __int_as_float(KV_INT8_LIMIT_BITS);
    return __int_as_float(0x7f800000);
}

// Bytes of the codes / the scales of one head row of D values (docs/formats.md).
__device__ __forceinline__ int kv_code_row_bytes(int fmt, int D) {
    return fmt == KV_F32 ? 4 * D : (fmt == KV_F16 || fmt == KV_BF16) ? 2 * D : fmt >= KV_Q4_0 ? D / 2 : D;
}

__device__ __forceinline__ int kv_scale_row_bytes(int fmt, int D) {
    return fmt == KV_Q8_0 || fmt == KV_Q4_0 ? D / 16 : fmt == KV_Q4_1 || fmt == KV_Q4_1CH ? D / 8 : fmt >= KV_INT8 ? 4 : 0;
}
