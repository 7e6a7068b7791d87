// Kernels that test the GPU emulator itself (tests/test_emu_kernels.py): each either breaks
// a CUDA rule the emulator must catch, or pins down the semantics of one intrinsic.
// Built only by the emulator (no PTX); includes the project's cp.async helpers.
#include "../../cuda/attention.cuh"

// out[0] = sum of 0..blockDim.x-1, written by thread 0 after every thread stored its id;
// `sync` 0 leaves out the barrier (a race).
extern "C" __global__ void race_sum(int* out, int sync) {
    __shared__ int s[1024];
    s[threadIdx.x] = (int)threadIdx.x;
    if (sync) __syncthreads();
    if (threadIdx.x == 0) {
        int t = 0;
        for (int i = 0; i < (int)blockDim.x; i++) t += s[i];
        out[0] = t;
    }
    atomicAdd(out + 1, 1);  // a scheduling point after the sum
}

// Half the block at one __syncthreads, half at another.
extern "C" __global__ void divergent_barrier(int* out) {
    if (threadIdx.x < 64) {
        __syncthreads();  // site: divergent A
    } else {
        __syncthreads();  // site: divergent B
    }
    out[threadIdx.x] = 1;
}

// Thread 5 returns before the barrier the others reach.
extern "C" __global__ void barrier_after_exit(int* out) {
    if (threadIdx.x == 5) return;
    __syncthreads();  // site: after exit
    out[threadIdx.x] = 1;
}

// Lane 7 skips the full-warp shuffle.
extern "C" __global__ void shuffle_missing_lane(float* out) {
    float v = (float)threadIdx.x;
    if ((threadIdx.x & 31) != 7) v = __shfl_xor_sync(0xFFFFFFFFu, v, 1);  // site: missing lane
    out[threadIdx.x] = v;
}

// Lane 0 waits for lane 1 at a shuffle while lane 1 (and the rest) wait at the barrier.
extern "C" __global__ void deadlock(float* out) {
    float v = 1.0f;
    if (threadIdx.x == 0) v = __shfl_sync(0x3u, v, 1);  // site: deadlock shfl
    else __syncthreads();  // site: deadlock bar
    out[threadIdx.x] = v;
}

// Reads of a cp.async destination before and after its wait_group; src_bytes zero-fill.
//   out[0..3] before the wait, out[4..7] after; out[8..11] the zero-filled copy after.
extern "C" __global__ void cp_async_poison(const float* src, float* out) {
    __shared__ __align__(16) float buf[8];
    if (threadIdx.x == 0) {
        kv_cp16(buf, src, 16);
        kv_cp_commit();
        kv_cp16(buf + 4, src + 4, 8);  // 2 floats read, 2 zero-filled
        kv_cp_commit();
        for (int i = 0; i < 4; i++) out[i] = buf[i];
        kv_cp_wait<1>();  // the first group only
        for (int i = 0; i < 4; i++) out[4 + i] = buf[i];
        for (int i = 0; i < 4; i++) out[12 + i] = buf[4 + i];
        kv_cp_wait<0>();
        for (int i = 0; i < 4; i++) out[8 + i] = buf[4 + i];
    }
}

// Shared memory written only in part: the rest holds poison (0xFF bytes) in every block.
extern "C" __global__ void uninit_shared(unsigned* out) {
    __shared__ unsigned s[64];
    if (threadIdx.x < 32) s[threadIdx.x] = blockIdx.x;
    __syncthreads();
    out[blockIdx.x * 64 + threadIdx.x] = s[threadIdx.x];
}

// Warp collectives over partial masks: per thread [ballot, any, all, shfl_idx, shfl_up,
// shfl_down, shfl_xor width 8, syncthreads_count, syncthreads_and].
extern "C" __global__ void collectives(const int* pred, int* out) {
    const int t = threadIdx.x, lane = t & 31;
    const int p = pred[t];
    int* o = out + 9 * t;
    o[0] = (int)__ballot_sync(0xFFFFFFFFu, p);
    o[1] = __any_sync(0xFFFFFFFFu, p);
    o[2] = __all_sync(0xFFFFFFFFu, p);
    o[3] = __shfl_sync(0xFFFFFFFFu, t * 10, (lane * 7) & 31);
    o[4] = __shfl_up_sync(0xFFFFFFFFu, t * 10, 3);
    o[5] = __shfl_down_sync(0xFFFFFFFFu, t * 10, 5);
    o[6] = __shfl_xor_sync(0xFFFFFFFFu, t * 10, 5, 8);
    o[7] = __syncthreads_count(p);
    o[8] = __syncthreads_and(p);
}

// Intrinsics on arrays: per element [__float2int_rn, __byte_perm(a, b, sel), f16 bits].
extern "C" __global__ void intrinsics(const float* x, const unsigned* a, const unsigned* b,
                                      const unsigned* sel, int* f2i, unsigned* perm,
                                      unsigned short* h, int n) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        f2i[i] = __float2int_rn(x[i]);
        perm[i] = __byte_perm(a[i], b[i], sel[i]);
        h[i] = kv_f32_to_f16(x[i]);
    }
}

// Every thread of every block adds 1.
extern "C" __global__ void atomic_count(unsigned long long* n) { atomicAdd(n, 1ull); }

// Thread 0 writes p[n], one element past an n-element allocation.
extern "C" __global__ void global_overrun(float* p, int n) {
    if (threadIdx.x == 0) p[n] = 1.0f;  // site: global overrun
}

// Reads s[i] through a pointer (so only ASan's redzones, not UBSan's bounds, can see it):
// i = 32 is one past the array. Launched out of bounds only by tools/emu_asan.py --self-check.
extern "C" __global__ void shared_overrun(float* out, int i) {
    __shared__ float s[32];
    s[threadIdx.x] = 1.0f;
    __syncthreads();
    const float* p = s;
    out[threadIdx.x] = p[i];  // site: shared overrun
}

// The device FP8 encoders of common.cuh over n floats (tools/fp8_device_exhaustive.py).
extern "C" __global__ void encode_fp8(const float* x, unsigned char* e4m3, unsigned char* e5m2, long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        e4m3[i] = kv_f32_to_e4m3(x[i]);
        e5m2[i] = kv_f32_to_e5m2(x[i]);
    }
}
