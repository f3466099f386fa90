// Softmax cross-entropy with ignored rows, fp32. One block per row of logits z [N, V]; targets int64 [N],
// a target < 0 means "no loss, no gradient".
//
//     ce_forward:  lse = max(z) + log(sum exp(z - max(z))),  loss = lse - z[t]  (0 where ignored)
//     ce_backward: dz = (exp(z - lse) - onehot(t)) * scale on valid rows, 0 on ignored rows,
//                  with scale = dloss / n_valid supplied by the caller.
// ce_backward may write in place (dz == z): every element is read and then written by the same thread,
// which is how the training step turns the [K, B, T, V] logits into their gradient without a second buffer.
//
// Worked example, V = 2: z = [0, 0], t = 1 -> lse = log 2, loss = 0.6931; dz = [0.5, -0.5] * scale.
#include "common.cuh"

extern "C" __global__ void ce_forward(const float* __restrict__ z, const long long* __restrict__ targets,
                                      float* __restrict__ loss, float* __restrict__ lse, int N, int V) {
    __shared__ float scratch[32];
    const int row = blockIdx.x;
    if (row >= N) return;
    const float* zr = z + (long long)row * V;
    float m = NEG_INF;
    for (int c = threadIdx.x; c < V; c += blockDim.x) m = fmaxf(m, zr[c]);
    m = block_max(m, scratch);
    float se = 0.0f;
    for (int c = threadIdx.x; c < V; c += blockDim.x) se += expf(zr[c] - m);
    se = block_sum(se, scratch);
    if (threadIdx.x == 0) {
        const float l = m + logf(se);
        const long long t = targets[row];
        lse[row] = l;
        loss[row] = t >= 0 ? l - zr[t] : 0.0f;
    }
}

extern "C" __global__ void ce_backward(const float* z, const float* __restrict__ lse,
                                       const long long* __restrict__ targets, float* dz, int N, int V,
                                       float scale) {
    const int row = blockIdx.x;
    if (row >= N) return;
    const long long base = (long long)row * V, t = targets[row];
    const float l = lse[row];
    for (int c = threadIdx.x; c < V; c += blockDim.x) {
        const float p = expf(z[base + c] - l);
        dz[base + c] = t >= 0 ? (p - (c == t ? 1.0f : 0.0f)) * scale : 0.0f;
    }
}
