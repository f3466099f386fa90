// Rotary position embedding, rotate-half pairing (dimension i rotates with i + hd/2, as HF Llama), fp32.
//
// For row (b, h, t) of x [B, H, T, hd] and pair i < hd/2, with c = cos[t, i], s = sign * sin[t, i]:
//     y[i] = x[i] * c - x[i + hd/2] * s,     y[i + hd/2] = x[i + hd/2] * c + x[i] * s
// sign = +1 is the forward; sign = -1 rotates by the opposite angle, which is the backward (a rotation's
// transpose is its inverse). One thread per pair, grid-stride loop. y must not alias x.
//
// rope_rotate_bf16 writes y as bf16 bits (the bf16 mode: rotated q and k only feed the bf16 attention).
//
// Worked example, hd = 2, angle 90 degrees (c = 0, s = 1): x = [1, 0] -> y = [0, 1]; backward: [0, 1] -> [1, 0].
#include "common.cuh"

template <typename TOut>
__device__ __forceinline__ TOut rope_store(float v);
template <>
__device__ __forceinline__ float rope_store<float>(float v) { return v; }
template <>
__device__ __forceinline__ bf16_t rope_store<bf16_t>(float v) { return float_to_bf16(v); }

template <typename TOut>
__device__ __forceinline__ void rope_impl(const float* __restrict__ x, const float* __restrict__ cos_t,
                                          const float* __restrict__ sin_t, TOut* __restrict__ y,
                                          long long n_pairs, int T, int half, float sign) {
    for (long long p = (long long)blockIdx.x * blockDim.x + threadIdx.x; p < n_pairs;
         p += (long long)gridDim.x * blockDim.x) {
        const int i = (int)(p % half);
        const long long row = p / half;   // index of (b, h, t) in [B, H, T]
        const int t = (int)(row % T);
        const long long a_at = row * (2LL * half) + i, b_at = a_at + half;
        const float c = cos_t[(long long)t * half + i], s = sign * sin_t[(long long)t * half + i];
        const float a = x[a_at], b = x[b_at];
        y[a_at] = rope_store<TOut>(a * c - b * s);
        y[b_at] = rope_store<TOut>(b * c + a * s);
    }
}
extern "C" __global__ void rope_rotate(const float* __restrict__ x, const float* __restrict__ cos_t,
                                       const float* __restrict__ sin_t, float* __restrict__ y,
                                       long long n_pairs, int T, int half, float sign) {
    rope_impl<float>(x, cos_t, sin_t, y, n_pairs, T, half, sign);
}

extern "C" __global__ void rope_rotate_bf16(const float* __restrict__ x, const float* __restrict__ cos_t,
                                            const float* __restrict__ sin_t, bf16_t* __restrict__ y,
                                            long long n_pairs, int T, int half, float sign) {
    rope_impl<bf16_t>(x, cos_t, sin_t, y, n_pairs, T, half, sign);
}
