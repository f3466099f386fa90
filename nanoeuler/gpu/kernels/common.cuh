// Helpers shared by every kernel file: bf16 <-> fp32 conversion and a block-wide sum.
//
// The Python loader (nanoeuler/gpu/kernels.py) pastes this file in place of `#include "common.cuh"`
// before handing the source to NVRTC, so no include path is needed at run time; the nvcc compile test
// passes `-I nanoeuler/gpu/kernels` instead.
//
// bf16 values travel as `unsigned short` (the top 16 bits of an IEEE float32) so that no CUDA header
// is needed: bf16 -> fp32 is a shift; fp32 -> bf16 rounds to nearest, ties to even:
//     1.0f = 0x3F800000 -> 0x3F80;   1.00390625f = 0x3F808000 -> 0x3F80 (tie, even);   1.01171875f = 0x3F818000 -> 0x3F82
#pragma once

typedef unsigned short bf16_t;

// -inf without math headers (NVRTC compiles without the host C library).
#define NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ float bf16_to_float(bf16_t b) {
    return __uint_as_float(((unsigned int)b) << 16);
}

__device__ __forceinline__ bf16_t float_to_bf16(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7F800000u) == 0x7F800000u && (u & 0x007FFFFFu)) {
        return (bf16_t)((u >> 16) | 0x0040u);  // NaN stays a (quiet) NaN
    }
    u += 0x7FFFu + ((u >> 16) & 1u);  // round to nearest, ties to even
    return (bf16_t)(u >> 16);
}

// Load an element of either storage type as fp32.
__device__ __forceinline__ float load_f32(const float* p, long long i) { return p[i]; }
__device__ __forceinline__ float load_f32(const bf16_t* p, long long i) { return bf16_to_float(p[i]); }

// Sum of `v` over all threads of the block; every thread gets the result.
// `scratch` must hold at least 32 floats of shared memory; blockDim.x must be a multiple of 32.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    __syncthreads();                      // scratch may still be in use by a previous call
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float total = 0.0f;
    for (int w = 0; w < n_warps; ++w) total += scratch[w];  // every thread reads the same values
    return total;
}

// Max of `v` over all threads of the block; every thread gets the result (same rules as block_sum).
__device__ __forceinline__ float block_max(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
    for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float m = NEG_INF;
    for (int w = 0; w < n_warps; ++w) m = fmaxf(m, scratch[w]);
    return m;
}
