// Fused AdamW step on one fp32 tensor (the fp32 master weights), elementwise, grid-stride loop.
// Exactly the update of nanoeuler/optim.py (and torch.optim.AdamW), with the scalars precomputed by the caller:
//     m <- b1 * m + (1 - b1) * g
//     v <- b2 * v + (1 - b2) * g^2
//     p <- p * decay                              decay = 1 - lr * weight_decay (1 for vectors)
//     p <- p - step * m / (sqrt(v) / bc2_sqrt + eps)     step = lr / (1 - b1^t),  bc2_sqrt = sqrt(1 - b2^t)
// One read of p, g, m, v and one write of p, m, v per element, instead of a dozen NumPy temporaries.
extern "C" __global__ void adamw_step(float* __restrict__ p, const float* __restrict__ g, float* __restrict__ m,
                                      float* __restrict__ v, long long n, float b1, float one_minus_b1, float b2,
                                      float one_minus_b2, float decay, float step, float bc2_sqrt, float eps) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const float gi = g[i];
        const float mi = b1 * m[i] + one_minus_b1 * gi;
        const float vi = b2 * v[i] + one_minus_b2 * (gi * gi);
        m[i] = mi;
        v[i] = vi;
        const float denom = sqrtf(vi) / bc2_sqrt + eps;
        p[i] = p[i] * decay - step * mi / denom;
    }
}
