// SwiGLU gate, fp32, elementwise over n entries (grid-stride loop):
//     forward:  s = sigmoid(g) = 0.5 * (1 + tanh(g / 2)),  h = g * s * u
//     backward: dg = dh * u * s * (1 + g * (1 - s)),      du = dh * g * s
// The tanh form of the sigmoid never overflows, and matches the NumPy reference formula.
//
// swiglu_forward_bf16 writes h as bf16 bits instead (the bf16 mode: h only feeds the down projection's
// bf16 matrix product, so the fp32 copy and a separate cast pass are skipped).
//
// Worked example: g = 0 -> s = 0.5, h = 0; dg = dh * u * 0.5, du = 0.
#include "common.cuh"

__device__ __forceinline__ float sigmoid_tanh(float g) { return 0.5f * (1.0f + tanhf(0.5f * g)); }

extern "C" __global__ void swiglu_forward(const float* __restrict__ g, const float* __restrict__ u,
                                          float* __restrict__ h, long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const float gi = g[i], s = sigmoid_tanh(gi);
        h[i] = gi * s * u[i];
    }
}

extern "C" __global__ void swiglu_forward_bf16(const float* __restrict__ g, const float* __restrict__ u,
                                               bf16_t* __restrict__ h, long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const float gi = g[i], s = sigmoid_tanh(gi);
        h[i] = float_to_bf16(gi * s * u[i]);
    }
}

extern "C" __global__ void swiglu_backward(const float* __restrict__ dh, const float* __restrict__ g,
                                           const float* __restrict__ u, float* __restrict__ dg,
                                           float* __restrict__ du, long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const float gi = g[i], s = sigmoid_tanh(gi), d = dh[i];
        dg[i] = d * u[i] * s * (1.0f + gi * (1.0f - s));
        du[i] = d * gi * s;
    }
}
