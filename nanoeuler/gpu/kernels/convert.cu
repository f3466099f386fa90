// fp32 <-> bf16 conversion (bf16 stored as unsigned short bits; round to nearest, ties to even), and the
// casts the bf16 mixed-precision mode uses to feed cuBLAS and the bf16 FlashAttention variant.
// Grid-stride loops over n elements.
//
// Worked example: 1.0f -> 0x3F80 -> 1.0f;  3.14159f -> 0x4049 -> 3.140625f.
#include "common.cuh"

extern "C" __global__ void f32_to_bf16(const float* __restrict__ x, bf16_t* __restrict__ y, long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        y[i] = float_to_bf16(x[i]);
}

extern "C" __global__ void bf16_to_f32(const bf16_t* __restrict__ x, float* __restrict__ y, long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        y[i] = bf16_to_float(x[i]);
}
