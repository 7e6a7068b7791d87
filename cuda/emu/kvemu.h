// kvemu: the CUDA execution model on the CPU, for kvcore's own kernels (cuda/*.cu) compiled
// by the host C++ compiler with -DKVCORE_EMU (kvcore/gpu/_emu/kernels.py builds them).
//
// 1. Threads. Every thread of a block is its own fiber with its own stack (mmap'd, guard
//    page below, reused across blocks and launches); a hand-written x86-64 context switch
//    (callee-saved registers + rsp), ucontext elsewhere. Blocks run one at a time, in an
//    order shuffled from the launch seed; inside a block a thread runs until its next
//    scheduling point (barrier, warp collective, cp.async wait, atomic, exit), then the
//    scheduler resumes a runnable thread picked at random (same PRNG), so that a missing
//    barrier gives a wrong answer under some seed.
// 2. Barriers (__syncthreads, _or/_and/_count) wait for every thread of the block: reached
//    from two source places, reached by some thread while another one exited (or exiting
//    while others wait) is a fault. Warp collectives (__shfl*_sync, __any/__all/
//    __ballot_sync, __syncwarp) wait for every lane of their mask and exchange values then;
//    a mask that leaves out the calling lane, names a lane that does not exist or exited,
//    or a lane waiting at another collective or with another mask is a fault. No runnable
//    thread while some are not done is a deadlock fault listing where each one waits.
//    Faults name the kernel, block, thread and file:line of the barrier/collective.
// 3. Shared memory: `__shared__` variables are function-local statics; all of a module's
//    live in one place (normal build: thread_local, the module's TLS block; ASan build:
//    plain statics, which keep ASan's redzones) that is filled with 0xFF (NaN bits) before
//    every block.
// 4. cp.async is modelled least favourably: the destination holds 0xFF from the issue until
//    the wait_group of the issuing thread that covers its group; the source is read then.
// 5. Intrinsics round as on the device (IEEE float ops, built with -ffp-contract=off; the
//    _rn intrinsics are plain IEEE ops); exp2f/log2f/exp2/sincos are libm's (correctly
//    rounded or within 1 ulp; the device's exp2f/log2f are within 2 ulp: results of the
//    softmax can differ in the last bits, never the encoders).
#pragma once

#ifndef KVCORE_EMU
#error "cuda/emu/kvemu.h is the host emulation of CUDA: build with -DKVCORE_EMU"
#endif

#include <limits.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <type_traits>

// ---- keywords --------------------------------------------------------------------------

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
// `used` keeps the compiler from folding reads of a shared variable it sees no store to.
#ifdef __SANITIZE_ADDRESS__
#define __shared__ static __attribute__((used))
#else
#define __shared__ static thread_local __attribute__((used))
#endif

// ---- vector types -----------------------------------------------------------------------

struct uint3 { unsigned x, y, z; };
struct dim3 { unsigned x, y, z; };
struct __align__(8) uint2 { unsigned x, y; };
struct __align__(16) uint4 { unsigned x, y, z, w; };
struct __align__(8) int2 { int x, y; };
struct __align__(16) int4 { int x, y, z, w; };
struct __align__(8) float2 { float x, y; };
struct __align__(16) float4 { float x, y, z, w; };
inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }
inline float2 make_float2(float x, float y) { return float2{x, y}; }
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return uint4{x, y, z, w}; }
inline uint2 make_uint2(unsigned x, unsigned y) { return uint2{x, y}; }

// ---- the runtime's view for the kernel code ------------------------------------------------

namespace kvemu {

struct Fiber;
struct FiberIds { uint3 tid; };
extern FiberIds* kvemu_cur_ids;  // the running thread's ids (first member of its Fiber)
extern uint3 kvemu_block;
extern dim3 kvemu_bdim, kvemu_gdim;

enum Collective { SHFL_IDX, SHFL_UP, SHFL_DOWN, SHFL_XOR, VOTE_ANY, VOTE_ALL, VOTE_BALLOT, SYNCWARP };
enum Barrier { BAR_SYNC, BAR_OR, BAR_AND, BAR_COUNT };
enum Fault { OK = 0, ILLEGAL_INSTRUCTION = 1, ILLEGAL_ADDRESS = 2, LAUNCH_FAILED = 3,
             INVALID_VALUE = 4, MISALIGNED_ADDRESS = 5 };

int barrier(int kind, int pred, const char* file, int line);
uint64_t collective(int kind, unsigned mask, uint64_t value, int arg, int width,
                    const char* file, int line);
void yield_point();
[[noreturn]] void fault(int code, const char* fmt, ...) __attribute__((format(printf, 2, 3)));

// cp.async: the issue (shared address from __cvta_generic_to_shared), commit and wait_group.
void cp_async(uint32_t smem, const void* gmem, int size, int src_bytes, const char* file, int line);
void cp_commit();
void cp_wait(int n);
size_t cvta_to_shared(const void* p, const char* file, int line);

inline uint32_t f2u(float x) { uint32_t u; memcpy(&u, &x, 4); return u; }
inline float u2f(uint32_t u) { float x; memcpy(&x, &u, 4); return x; }

// f32 -> binary16 bits as cvt.rn.f16.f32: round to nearest even, overflow to inf,
// subnormals kept, NaN -> the canonical 0x7FFF (sign kept). Integer arithmetic only.
inline uint16_t f32_to_f16_rn(float x) {
    const uint32_t u = f2u(x), sign = (u >> 16) & 0x8000u, a = u & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return (uint16_t)(sign | 0x7FFFu);
    const uint32_t e = a >> 23;
    if (e >= 143) return (uint16_t)(sign | 0x7C00u);  // >= 2^16 (and inf)
    if (e >= 113) {                                     // normal binary16 range (>= 2^-14)
        const uint32_t r = (a + 0xFFFu + ((a >> 13) & 1u)) >> 13;  // carries into e: inf
        return (uint16_t)(sign | (r - (112u << 10)));
    }
    if (e == 0) return (uint16_t)sign;  // f32 subnormal: far below half of 2^-24
    // value = m * 2^(e - 150); in units of 2^-24 that is m >> (126 - e), rounded to even
    const uint32_t m = (a & 0x7FFFFFu) | 0x800000u, shift = 126 - e;  // shift >= 14
    if (shift > 24) return (uint16_t)sign;  // < 2^-25 (m < 2^24): rounds to 0
    uint32_t q = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (q & 1u))) q++;
    return (uint16_t)(sign | q);
}

// binary16 bits -> f32 as cvt.f32.f16 (exact; NaN keeps sign and payload, made quiet).
inline float f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
    if (e == 31) return u2f(sign | 0x7F800000u | (m << 13) | (m ? 0x400000u : 0u));
    if (e != 0) return u2f(sign | ((e + 112u) << 23) | (m << 13));
    if (m == 0) return u2f(sign);
    int k = 0;  // subnormal: normalise m * 2^-24
    uint32_t mm = m;
    while (!(mm & 0x400u)) { mm <<= 1; k++; }
    return u2f(sign | ((uint32_t)(113 - k) << 23) | ((mm & 0x3FFu) << 13));
}

template <class T>
inline uint64_t to_bits(T v) {
    static_assert(sizeof(T) == 4 || sizeof(T) == 8, "shuffles move 4 or 8 bytes");
    uint64_t b = 0;
    memcpy(&b, &v, sizeof(T));
    return b;
}
template <class T>
inline T from_bits(uint64_t b) {
    T v;
    memcpy(&v, &b, sizeof(T));
    return v;
}
template <class T>
inline T shfl(int kind, const char* file, int line, unsigned mask, T v, int arg, int width = 32) {
    return from_bits<T>(collective(kind, mask, to_bits(v), arg, width, file, line));
}
inline void syncwarp(const char* file, int line, unsigned mask = 0xFFFFFFFFu) {
    collective(SYNCWARP, mask, 0, 0, 32, file, line);
}

template <class T>
inline T atomic_rmw(T* p, T v, int op);

}  // namespace kvemu

#define threadIdx (::kvemu::kvemu_cur_ids->tid)
#define blockIdx (::kvemu::kvemu_block)
#define blockDim (::kvemu::kvemu_bdim)
#define gridDim (::kvemu::kvemu_gdim)
#define warpSize 32

// ---- barriers and warp collectives (file:line of the call recorded) ----------------------

#define __syncthreads() ((void)::kvemu::barrier(::kvemu::BAR_SYNC, 1, __FILE__, __LINE__))
#define __syncthreads_or(p) ::kvemu::barrier(::kvemu::BAR_OR, (p) != 0, __FILE__, __LINE__)
#define __syncthreads_and(p) ::kvemu::barrier(::kvemu::BAR_AND, (p) != 0, __FILE__, __LINE__)
#define __syncthreads_count(p) ::kvemu::barrier(::kvemu::BAR_COUNT, (p) != 0, __FILE__, __LINE__)
#define __syncwarp(...) ::kvemu::syncwarp(__FILE__, __LINE__, ##__VA_ARGS__)
#define __any_sync(m, p) ((int)::kvemu::collective(::kvemu::VOTE_ANY, (m), (p) != 0, 0, 32, __FILE__, __LINE__))
#define __all_sync(m, p) ((int)::kvemu::collective(::kvemu::VOTE_ALL, (m), (p) != 0, 0, 32, __FILE__, __LINE__))
#define __ballot_sync(m, p) ((unsigned)::kvemu::collective(::kvemu::VOTE_BALLOT, (m), (p) != 0, 0, 32, __FILE__, __LINE__))
#define __shfl_sync(...) ::kvemu::shfl(::kvemu::SHFL_IDX, __FILE__, __LINE__, __VA_ARGS__)
#define __shfl_up_sync(...) ::kvemu::shfl(::kvemu::SHFL_UP, __FILE__, __LINE__, __VA_ARGS__)
#define __shfl_down_sync(...) ::kvemu::shfl(::kvemu::SHFL_DOWN, __FILE__, __LINE__, __VA_ARGS__)
#define __shfl_xor_sync(...) ::kvemu::shfl(::kvemu::SHFL_XOR, __FILE__, __LINE__, __VA_ARGS__)

#define __cvta_generic_to_shared(p) ::kvemu::cvta_to_shared((p), __FILE__, __LINE__)

// ---- intrinsics ------------------------------------------------------------------------

inline unsigned __float_as_uint(float x) { return ::kvemu::f2u(x); }
inline float __uint_as_float(unsigned u) { return ::kvemu::u2f(u); }
inline int __float_as_int(float x) { return (int)::kvemu::f2u(x); }
inline float __int_as_float(int i) { return ::kvemu::u2f((uint32_t)i); }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __frcp_rn(float a) { return 1.0f / a; }
inline float __fsqrt_rn(float a) { return sqrtf(a); }
inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
// As on the device: __ffs(0) = 0, __clz(0) = 32.
inline int __ffs(int x) { return x ? __builtin_ctz((unsigned)x) + 1 : 0; }
inline int __clz(int x) { return x ? __builtin_clz((unsigned)x) : 32; }

// cvt.rni.s32.f32: round to nearest even, saturating, NaN -> 0.
inline int __float2int_rn(float x) {
    if (x != x) return 0;
    if (x >= 2147483648.0f) return INT_MAX;
    if (x < -2147483648.0f) return INT_MIN;
    return (int)nearbyintf(x);  // the default rounding mode: to nearest even
}
inline int __float2int_rz(float x) {
    if (x != x) return 0;
    if (x >= 2147483648.0f) return INT_MAX;
    if (x < -2147483648.0f) return INT_MIN;
    return (int)x;
}

// __byte_perm as nvcc compiles it: `and.b32 s, s, 0x7777` then prmt.b32 (default mode), so
// result byte n is byte ((s >> 4n) & 7) of {b, a}: prmt's sign-replicate bit 3 and the
// selector's high 16 bits never take effect.
inline unsigned __byte_perm(unsigned a, unsigned b, unsigned s) {
    const uint64_t v = ((uint64_t)b << 32) | a;
    unsigned r = 0;
    for (int n = 0; n < 4; n++) r |= ((unsigned)(v >> (8 * ((s >> (4 * n)) & 7u))) & 0xFFu) << (8 * n);
    return r;
}

inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline unsigned long long min(unsigned long long a, unsigned long long b) { return a < b ? a : b; }
inline unsigned long long max(unsigned long long a, unsigned long long b) { return a > b ? a : b; }
inline float min(float a, float b) { return fminf(a, b); }
inline float max(float a, float b) { return fmaxf(a, b); }

// ---- atomics: serialised (one OS thread runs a block) and a scheduling point -------------

namespace kvemu {
enum AtomicOp { A_ADD, A_SUB, A_MIN, A_MAX, A_OR, A_AND, A_XOR, A_EXCH };
void check_atomic(const void* p, size_t size);
template <class T>
inline T atomic_rmw(T* p, T v, int op) {
    check_atomic(p, sizeof(T));
    yield_point();
    const T old = *p;
    switch (op) {
        case A_ADD: *p = old + v; break;
        case A_SUB: *p = old - v; break;
        case A_MIN: *p = v < old ? v : old; break;
        case A_MAX: *p = v > old ? v : old; break;
        case A_EXCH: *p = v; break;
        default:
            if constexpr (std::is_integral<T>::value) {
                if (op == A_OR) *p = old | v;
                else if (op == A_AND) *p = old & v;
                else *p = old ^ v;
            }
    }
    return old;
}
}  // namespace kvemu

#define KVEMU_ATOMIC(name, op)                                                                                       \
    inline int name(int* p, int v) { return ::kvemu::atomic_rmw<int>(p, v, op); }                                   \
    inline unsigned name(unsigned* p, unsigned v) { return ::kvemu::atomic_rmw<unsigned>(p, v, op); }               \
    inline unsigned long long name(unsigned long long* p, unsigned long long v) {                                   \
        return ::kvemu::atomic_rmw<unsigned long long>(p, v, op);                                                   \
    }
KVEMU_ATOMIC(atomicAdd, ::kvemu::A_ADD)
KVEMU_ATOMIC(atomicSub, ::kvemu::A_SUB)
KVEMU_ATOMIC(atomicMin, ::kvemu::A_MIN)
KVEMU_ATOMIC(atomicMax, ::kvemu::A_MAX)
KVEMU_ATOMIC(atomicOr, ::kvemu::A_OR)
KVEMU_ATOMIC(atomicAnd, ::kvemu::A_AND)
KVEMU_ATOMIC(atomicXor, ::kvemu::A_XOR)
KVEMU_ATOMIC(atomicExch, ::kvemu::A_EXCH)
#undef KVEMU_ATOMIC
inline float atomicAdd(float* p, float v) { return ::kvemu::atomic_rmw<float>(p, v, ::kvemu::A_ADD); }
inline float atomicExch(float* p, float v) { return ::kvemu::atomic_rmw<float>(p, v, ::kvemu::A_EXCH); }
inline int atomicCAS(int* p, int cmp, int v) {
    ::kvemu::check_atomic(p, 4);
    ::kvemu::yield_point();
    const int old = *p;
    if (old == cmp) *p = v;
    return old;
}
