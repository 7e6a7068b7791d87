/* C shared by kvcore's Cython kernels (_quant.pyx, _grouped.pyx, _attention.pyx), each
   of which includes it (`cdef extern from "_f16_prefetch.h"`, before its own C block):
   float16 -> float32 conversion, and the prefetch of a run of bytes. Compiled into each
   extension; it ships in the sdist, not in the wheel. */
#ifndef KVCORE_F16_PREFETCH_H
#define KVCORE_F16_PREFETCH_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>
#if defined(__F16C__)
#include <immintrin.h>
#endif

/* One IEEE binary16 bit pattern h as float32, exactly (subnormals, inf, NaN and its
   payload), in integer work on the bits: the exponent rebiased, a subnormal through one
   exact float32 subtraction. */
static inline float kv_f16_to_f32(uint16_t h) {
    const uint32_t o = (uint32_t)(h & 0x7fff) << 13;
    const uint32_t exp = o & 0x0f800000;
    const uint32_t normal = o + (112u << 23);
    const uint32_t special = normal + (112u << 23);     /* inf / NaN: exponent 255 */
    const uint32_t biased = normal + (1u << 23), base = 113u << 23;
    float a, b, f;
    uint32_t sub, r;
    memcpy(&a, &biased, 4);
    memcpy(&b, &base, 4);
    f = a - b;                                          /* 2^-14 (1 + m 2^-10) - 2^-14 */
    memcpy(&sub, &f, 4);
    r = exp == 0x0f800000 ? special : normal;
    r = exp == 0 ? sub : r;
    r |= (uint32_t)(h & 0x8000) << 16;
    memcpy(&f, &r, 4);
    return f;
}

/* dst[k] = the binary16 bit patterns src[k] as float32, k < n (any alignment). With
   F16C (vcvtph2ps, 8, then 4, then 1 at a time) each is kv_f16_to_f32's value but for a
   signalling NaN, which comes out quiet (no kvcore encoder stores one); else
   kv_f16_to_f32 per value. */
static inline __attribute__((always_inline))
void kv_f16_to_f32_row(const uint16_t* src, ptrdiff_t n, float* dst) {
    ptrdiff_t k = 0;
#if defined(__F16C__)
    for (; k + 8 <= n; k += 8)
        _mm256_storeu_ps(dst + k, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(src + k))));
    if (k < n) {            /* the tail: one test only where n % 8 == 0 (the grouped kernel's) */
        if (k + 4 <= n) {   /* a 4-bit row of 128 values has 4 or 8 scales */
            _mm_storeu_ps(dst + k, _mm_cvtph_ps(_mm_loadl_epi64((const __m128i*)(src + k))));
            k += 4;
        }
        for (; k < n; k++)
            dst[k] = _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(src[k])));
    }
#else
    for (; k < n; k++)
        dst[k] = kv_f16_to_f32(src[k]);
#endif
}

/* The cache lines of the n bytes at p, into L2: every 64-byte line from the one holding
   p (p aligned down) to the one holding p + n - 1, each once, with locality hint 1
   (prefetcht2, as the attention kernel's other prefetches: docs/attention.md, item 9).
   Nothing for n <= 0. */
static inline __attribute__((always_inline))
void kv_prefetch_lines(const char* p, ptrdiff_t n) {
    for (const char* a = (const char*)((uintptr_t)p & ~(uintptr_t)63); a < p + n; a += 64)
        __builtin_prefetch(a, 0, 1);
}

#endif
