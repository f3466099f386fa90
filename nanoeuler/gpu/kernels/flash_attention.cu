// FlashAttention forward and backward: causal, grouped-query, tiled, online softmax, no T x T matrix.
//
// Shapes (all contiguous, row-major):
//     q, dq, o, dout   [B, H,   Tq, HD]        lse, delta  [B, H, Tq]
//     k, v, dk, dv     [B, Hkv, Tk, HD]        query head h reads kv head h / (H / Hkv)
// Queries are the LAST Tq of the Tk positions (Tq == Tk in training; Tq < Tk when decoding with a KV
// cache), so query row i sits at absolute position i + (Tk - Tq) and may see keys j <= i + (Tk - Tq).
//
// Forward, per query row i (one thread per row), over tiles of BN keys staged in shared memory:
//     s_j = (q_i . k_j) * scale                     masked keys get s_j = -inf
//     m'  = max(m, max_j s_j);  c = exp(m - m')     running max, and the rescale of what came before
//     l   = l * c + sum_j exp(s_j - m')             running softmax denominator
//     acc = acc * c + sum_j exp(s_j - m') v_j       running numerator
// then o_i = acc / l and lse_i = m + log(l), the log-sum-exp that the backward uses to rebuild
// p_ij = exp(s_ij - lse_i) exactly, tile by tile, without ever storing P.
//
// Backward (FlashAttention-2), with delta_i = sum_d dout_id * o_id precomputed by the caller:
//     p_ij = exp(s_ij - lse_i),  dp_ij = dout_i . v_j,  ds_ij = p_ij (dp_ij - delta_i)
//     dq_i = scale * sum_j ds_ij k_j                          (kernel flash_bwd_dq:   a thread per query row)
//     dk_j = scale * sum_i ds_ij q_i,  dv_j = sum_i p_ij dout_i (kernel flash_bwd_dkdv: a thread per key row;
//            the sum over i also runs over the G = H / Hkv query heads that share kv head j's head, which is
//            how grouped-query attention's dk and dv are reduced — no atomics, deterministic)
//
// Two storage types for q, k, v: float (fp32) and bf16_t (bf16 bits). Everything else — o, lse, dout,
// delta, dq, dk, dv — is fp32, and all arithmetic is fp32.
//
// The head dimension is a compile-time constant (registers hold whole rows): the Python loader compiles
// this file once per head dimension with -DFA_HD=<hd>. Kernel names: flash_fwd_f32, flash_fwd_bf16,
// flash_bwd_dq_f32, flash_bwd_dq_bf16, flash_bwd_dkdv_f32, flash_bwd_dkdv_bf16.
// Launch: forward and dq use grid (ceil(Tq / FA_BM), H, B) and FA_BM threads;
//         dkdv uses grid (ceil(Tk / fa_bwd_bn), Hkv, B) and fa_bwd_bn threads (see the constants below).
#include "common.cuh"

#ifndef FA_HD
#define FA_HD 64
#endif

// Query rows per block in the forward and dq kernels (one thread each).
#define FA_BM 64

// Keys per shared-memory tile in the forward and dq kernels: two tiles of BN x HD floats (k and v).
template <int HD> struct FaConst {
    static constexpr int BN = HD <= 64 ? 32 : 16;        // fwd / dq: keys per tile (16 KiB of k+v at HD=64)
    static constexpr int BWD_BN = HD <= 64 ? 64 : 32;    // dkdv: key rows per block (one thread each)
    static constexpr int BWD_BM = HD <= 64 ? 16 : 8;     // dkdv: query rows per shared-memory tile
};

// ---------------------------------------------------------------------------------------------------
template <typename T, int HD>
__device__ __forceinline__ void flash_fwd_impl(const T* __restrict__ q, const T* __restrict__ k,
                                               const T* __restrict__ v, float* __restrict__ o,
                                               float* __restrict__ lse, int H, int Hkv, int Tq, int Tk,
                                               float scale) {
    constexpr int BM = FA_BM, BN = FaConst<HD>::BN;
    __shared__ float ks[BN][HD];
    __shared__ float vs[BN][HD];
    __shared__ float ss[BN][BM];  // this tile's scores; column threadIdx.x belongs to one thread

    const int b = blockIdx.z, h = blockIdx.y, hk = h / (H / Hkv);
    const int i = blockIdx.x * BM + threadIdx.x;  // this thread's query row
    const int offset = Tk - Tq;                   // query row i is absolute position i + offset
    const bool active = i < Tq;
    const long long q_row = (((long long)b * H + h) * Tq + i) * HD;
    const long long kv_head = ((long long)b * Hkv + hk) * Tk * HD;

    float qr[HD], acc[HD];
#pragma unroll
    for (int d = 0; d < HD; ++d) {
        qr[d] = active ? load_f32(q, q_row + d) * scale : 0.0f;  // fold the scale into q once
        acc[d] = 0.0f;
    }
    float m = NEG_INF, l = 0.0f;

    // The block's last row sees keys up to (last row + offset): no tile beyond that is loaded.
    const int last_row = min(blockIdx.x * BM + BM, Tq) - 1;
    const int n_end = min(Tk, last_row + offset + 1);
    for (int n0 = 0; n0 < n_end; n0 += BN) {
        __syncthreads();  // every thread is done with the previous tile
        for (int e = threadIdx.x; e < BN * HD; e += BM) {
            const int jj = e / HD, d = e % HD, j = n0 + jj;
            ks[jj][d] = j < Tk ? load_f32(k, kv_head + (long long)j * HD + d) : 0.0f;
            vs[jj][d] = j < Tk ? load_f32(v, kv_head + (long long)j * HD + d) : 0.0f;
        }
        __syncthreads();
        if (!active) continue;

        float m_tile = NEG_INF;
#pragma unroll 1
        for (int jj = 0; jj < BN; ++jj) {
            const int j = n0 + jj;
            float dot = 0.0f;
#pragma unroll
            for (int d = 0; d < HD; ++d) dot += qr[d] * ks[jj][d];  // all threads read the same ks: broadcast
            const float s = (j < Tk && j <= i + offset) ? dot : NEG_INF;
            ss[jj][threadIdx.x] = s;
            m_tile = fmaxf(m_tile, s);
        }
        // Key 0 is visible to every row and lies in the first tile, so m_new is finite from then on;
        // on the first tile m = -inf gives c = 0, which multiplies l = 0 and acc = 0.
        const float m_new = fmaxf(m, m_tile);
        const float c = expf(m - m_new);
        l *= c;
#pragma unroll
        for (int d = 0; d < HD; ++d) acc[d] *= c;
#pragma unroll 1
        for (int jj = 0; jj < BN; ++jj) {
            const float p = expf(ss[jj][threadIdx.x] - m_new);  // masked: exp(-inf) = 0
            l += p;
#pragma unroll
            for (int d = 0; d < HD; ++d) acc[d] += p * vs[jj][d];
        }
        m = m_new;
    }
    if (active) {
        const float inv_l = 1.0f / l;
#pragma unroll
        for (int d = 0; d < HD; ++d) o[q_row + d] = acc[d] * inv_l;
        lse[((long long)b * H + h) * Tq + i] = m + logf(l);
    }
}

// ---------------------------------------------------------------------------------------------------
template <typename T, int HD>
__device__ __forceinline__ void flash_bwd_dq_impl(const T* __restrict__ q, const T* __restrict__ k,
                                                  const T* __restrict__ v, const float* __restrict__ dout,
                                                  const float* __restrict__ lse, const float* __restrict__ delta,
                                                  float* __restrict__ dq, int H, int Hkv, int Tq, int Tk,
                                                  float scale) {
    constexpr int BM = FA_BM, BN = FaConst<HD>::BN;
    __shared__ float ks[BN][HD];
    __shared__ float vs[BN][HD];

    const int b = blockIdx.z, h = blockIdx.y, hk = h / (H / Hkv);
    const int i = blockIdx.x * BM + threadIdx.x;
    const int offset = Tk - Tq;
    const bool active = i < Tq;
    const long long row = ((long long)b * H + h) * Tq + i;  // index into lse / delta
    const long long q_row = row * HD;
    const long long kv_head = ((long long)b * Hkv + hk) * Tk * HD;

    float qr[HD], dor[HD], dqa[HD];
#pragma unroll
    for (int d = 0; d < HD; ++d) {
        qr[d] = active ? load_f32(q, q_row + d) : 0.0f;
        dor[d] = active ? dout[q_row + d] : 0.0f;
        dqa[d] = 0.0f;
    }
    const float lse_i = active ? lse[row] : 0.0f;
    const float delta_i = active ? delta[row] : 0.0f;

    const int last_row = min(blockIdx.x * BM + BM, Tq) - 1;
    const int n_end = min(Tk, last_row + offset + 1);
    for (int n0 = 0; n0 < n_end; n0 += BN) {
        __syncthreads();
        for (int e = threadIdx.x; e < BN * HD; e += BM) {
            const int jj = e / HD, d = e % HD, j = n0 + jj;
            ks[jj][d] = j < Tk ? load_f32(k, kv_head + (long long)j * HD + d) : 0.0f;
            vs[jj][d] = j < Tk ? load_f32(v, kv_head + (long long)j * HD + d) : 0.0f;
        }
        __syncthreads();
        if (!active) continue;
#pragma unroll 1
        for (int jj = 0; jj < BN; ++jj) {
            const int j = n0 + jj;
            if (j < Tk && j <= i + offset) {
                float s = 0.0f, dp = 0.0f;
#pragma unroll
                for (int d = 0; d < HD; ++d) {
                    s += qr[d] * ks[jj][d];
                    dp += dor[d] * vs[jj][d];
                }
                const float p = expf(s * scale - lse_i);
                const float ds = p * (dp - delta_i);
#pragma unroll
                for (int d = 0; d < HD; ++d) dqa[d] += ds * ks[jj][d];
            }
        }
    }
    if (active) {
#pragma unroll
        for (int d = 0; d < HD; ++d) dq[q_row + d] = dqa[d] * scale;
    }
}

// ---------------------------------------------------------------------------------------------------
template <typename T, int HD>
__device__ __forceinline__ void flash_bwd_dkdv_impl(const T* __restrict__ q, const T* __restrict__ k,
                                                    const T* __restrict__ v, const float* __restrict__ dout,
                                                    const float* __restrict__ lse,
                                                    const float* __restrict__ delta, float* __restrict__ dk,
                                                    float* __restrict__ dv, int H, int Hkv, int Tq, int Tk,
                                                    float scale) {
    constexpr int BN = FaConst<HD>::BWD_BN, BM = FaConst<HD>::BWD_BM;
    // This block's own k and v rows; each thread reads only its own row, so rows are padded by one
    // float: thread t reads bank (t*(HD+1) + d) % 32, which differs across a warp for every HD used.
    __shared__ float ksh[BN][HD + 1];
    __shared__ float vsh[BN][HD + 1];
    // A tile of query rows (and their dout, lse, delta); every thread reads the same entry: broadcast.
    __shared__ float qs[BM][HD];
    __shared__ float dos[BM][HD];
    __shared__ float lses[BM];
    __shared__ float deltas[BM];

    const int b = blockIdx.z, hk = blockIdx.y, G = H / Hkv;
    const int n0 = blockIdx.x * BN;
    const int j = n0 + threadIdx.x;  // this thread's key row
    const int offset = Tk - Tq;
    const bool active = j < Tk;
    const long long kv_head = ((long long)b * Hkv + hk) * Tk * HD;

    for (int e = threadIdx.x; e < BN * HD; e += BN) {  // coalesced load of the block's k and v rows
        const int jj = e / HD, d = e % HD, jr = n0 + jj;
        ksh[jj][d] = jr < Tk ? load_f32(k, kv_head + (long long)jr * HD + d) : 0.0f;
        vsh[jj][d] = jr < Tk ? load_f32(v, kv_head + (long long)jr * HD + d) : 0.0f;
    }
    // (the first __syncthreads inside the loop below orders these writes before any read)

    float dka[HD], dva[HD];
#pragma unroll
    for (int d = 0; d < HD; ++d) {
        dka[d] = 0.0f;
        dva[d] = 0.0f;
    }

    // Key n0 is first seen by query row n0 - offset; earlier rows contribute nothing to this block.
    const int m_start = max(0, n0 - offset);
    for (int g = 0; g < G; ++g) {
        const int h = hk * G + g;
        const long long head_row0 = ((long long)b * H + h) * Tq;  // row index of (b, h, 0)
        for (int m0 = m_start; m0 < Tq; m0 += BM) {
            __syncthreads();  // the previous query tile is consumed (and the k/v rows above are written)
            for (int e = threadIdx.x; e < BM * HD; e += BN) {
                const int ii = e / HD, d = e % HD, i = m0 + ii;
                qs[ii][d] = i < Tq ? load_f32(q, (head_row0 + i) * HD + d) : 0.0f;
                dos[ii][d] = i < Tq ? dout[(head_row0 + i) * HD + d] : 0.0f;
            }
            for (int ii = threadIdx.x; ii < BM; ii += BN) {
                const int i = m0 + ii;
                lses[ii] = i < Tq ? lse[head_row0 + i] : 0.0f;
                deltas[ii] = i < Tq ? delta[head_row0 + i] : 0.0f;
            }
            __syncthreads();
            if (!active) continue;
#pragma unroll 1
            for (int ii = 0; ii < BM; ++ii) {
                const int i = m0 + ii;
                if (i >= Tq || j > i + offset) continue;  // past the end, or key j is in row i's future
                float s = 0.0f, dp = 0.0f;
#pragma unroll
                for (int d = 0; d < HD; ++d) {
                    s += qs[ii][d] * ksh[threadIdx.x][d];
                    dp += dos[ii][d] * vsh[threadIdx.x][d];
                }
                const float p = expf(s * scale - lses[ii]);
                const float ds = p * (dp - deltas[ii]);
#pragma unroll
                for (int d = 0; d < HD; ++d) {
                    dva[d] += p * dos[ii][d];
                    dka[d] += ds * qs[ii][d];
                }
            }
        }
    }
    if (active) {
        const long long k_row = kv_head + (long long)j * HD;
#pragma unroll
        for (int d = 0; d < HD; ++d) {
            dk[k_row + d] = dka[d] * scale;
            dv[k_row + d] = dva[d];
        }
    }
}

// ---------------------------------------------------------------------------------------------------
// extern "C" entry points (plain names for cupy.RawModule.get_function), one set per storage type.
#define FA_ENTRY_POINTS(SUFFIX, T)                                                                        \
    extern "C" __global__ void __launch_bounds__(FA_BM) flash_fwd_##SUFFIX(                              \
        const T* q, const T* k, const T* v, float* o, float* lse, int H, int Hkv, int Tq, int Tk,         \
        float scale) {                                                                                    \
        flash_fwd_impl<T, FA_HD>(q, k, v, o, lse, H, Hkv, Tq, Tk, scale);                                 \
    }                                                                                                     \
    extern "C" __global__ void __launch_bounds__(FA_BM) flash_bwd_dq_##SUFFIX(                           \
        const T* q, const T* k, const T* v, const float* dout, const float* lse, const float* delta,      \
        float* dq, int H, int Hkv, int Tq, int Tk, float scale) {                                         \
        flash_bwd_dq_impl<T, FA_HD>(q, k, v, dout, lse, delta, dq, H, Hkv, Tq, Tk, scale);                \
    }                                                                                                     \
    extern "C" __global__ void __launch_bounds__(FaConst<FA_HD>::BWD_BN) flash_bwd_dkdv_##SUFFIX(        \
        const T* q, const T* k, const T* v, const float* dout, const float* lse, const float* delta,      \
        float* dk, float* dv, int H, int Hkv, int Tq, int Tk, float scale) {                              \
        flash_bwd_dkdv_impl<T, FA_HD>(q, k, v, dout, lse, delta, dk, dv, H, Hkv, Tq, Tk, scale);          \
    }

FA_ENTRY_POINTS(f32, float)
FA_ENTRY_POINTS(bf16, bf16_t)

