// FlashAttention on the tensor cores (WMMA, bf16 x bf16 -> fp32): the bf16 mode's attention.
//
// Same contract and same algorithm as flash_attention.cu (read that file first: shapes, the causal
// offset, the online softmax, the FlashAttention-2 backward), with every matrix product done by warps
// on 16x16x16 tiles through nvcuda::wmma instead of one thread per row:
//
//   flash_wmma_fwd      block = 4 warps = 64 query rows (16 per warp), key tiles of 32:
//                       S = Q Kᵀ (tensor cores) -> shared memory -> per-row online softmax by lanes 0..15
//                       (scale, mask, running max/sum, P rounded to bf16, O rows rescaled) -> O += P V
//                       (tensor cores, O kept in shared memory in fp32 so rows can be rescaled).
//   flash_wmma_bwd_dq   block = 64 query rows, key tiles of 32: S = Q Kᵀ, dP = dO Vᵀ, dS = P (dP − delta)·scale
//                       (bf16), dQ += dS K, accumulated in registers (fragments) over all key tiles.
//   flash_wmma_bwd_dkdv block = 64 key rows (16 per warp), query tiles of 16, over the G query heads of the
//                       kv head: Sᵀ = K Qᵀ, dPᵀ = V dOᵀ, Pᵀ, dSᵀ, then dV += Pᵀ dO and dK += dSᵀ Q in registers.
//
// q, k, v are bf16 (bits in unsigned short); dout, lse, delta and all outputs are fp32. P and dS are
// rounded to bf16 before their products (as FlashAttention-2 does), so results carry bf16-level error
// (~1e-3 relative), unlike the fp32 kernels' 1e-6: the bf16 checks use a bf16 tolerance.
// Head dimension: compile-time FA_HD, a multiple of 16 and at most 64 (shared memory stays under 48 KiB).
// Launch: fwd and dq grid (ceil(Tq / 64), H, B), dkdv grid (ceil(Tk / 64), Hkv, B); 128 threads each.
#include "common.cuh"
#include <cuda_bf16.h>
#include <mma.h>

using namespace nvcuda;

#ifndef FA_HD
#define FA_HD 64
#endif
#define WM_THREADS 128  // 4 warps
#define WM_WARPS 4

typedef __nv_bfloat16 wbf16;
typedef wmma::fragment<wmma::matrix_a, 16, 16, 16, wbf16, wmma::row_major> FragA;     // A[m][k] at p[m*ld + k]
typedef wmma::fragment<wmma::matrix_b, 16, 16, 16, wbf16, wmma::row_major> FragB;     // B[k][n] at p[k*ld + n]
typedef wmma::fragment<wmma::matrix_b, 16, 16, 16, wbf16, wmma::col_major> FragBT;    // B[k][n] at p[n*ld + k]
typedef wmma::fragment<wmma::accumulator, 16, 16, 16, float> FragC;

__device__ __forceinline__ const wbf16* as_wbf16(const bf16_t* p) { return reinterpret_cast<const wbf16*>(p); }

// dst[r][d] (rows x HD, bf16) = src rows row0 .. row0+rows-1 of a [*, HD] tensor; zeros past n_rows.
template <int HD, typename T>
__device__ __forceinline__ void load_tile_bf16(bf16_t* dst, const T* src, long long head_base, int row0, int rows,
                                               int n_rows) {
    for (int e = threadIdx.x; e < rows * HD; e += WM_THREADS) {
        const int r = e / HD, d = e % HD, i = row0 + r;
        dst[e] = i < n_rows ? float_to_bf16(load_f32(src, head_base + (long long)i * HD + d)) : (bf16_t)0;
    }
}

// acc (16 x 16) += A (16 x K16*16, row-major at a, leading dim lda) times B, for K16 steps of 16.
// B is either row-major [K][N] (FragB, element (k, n) at b[k*ldb + n]) or given by the rows of Bᵀ
// (FragBT, element (k, n) at b[n*ldb + k]); the caller passes the pointer to element (0, 0).
template <int K16, typename FB>
__device__ __forceinline__ void mma_rows(FragC& acc, const bf16_t* a, int lda, const bf16_t* b, int ldb,
                                         bool b_transposed) {
    for (int kk = 0; kk < K16; ++kk) {
        FragA fa;
        FB fb;
        wmma::load_matrix_sync(fa, as_wbf16(a + kk * 16), lda);
        wmma::load_matrix_sync(fb, as_wbf16(b_transposed ? b + kk * 16 : b + (long long)kk * 16 * ldb), ldb);
        wmma::mma_sync(acc, fa, fb, acc);
    }
}

// ---------------------------------------------------------------------------------------------------
template <int HD>
__device__ __forceinline__ void wmma_fwd_impl(const bf16_t* __restrict__ q, const bf16_t* __restrict__ k,
                                              const bf16_t* __restrict__ v, float* __restrict__ o,
                                              float* __restrict__ lse, int H, int Hkv, int Tq, int Tk, float scale) {
    constexpr int BM = 64, BN = 32;
    __shared__ __align__(32) bf16_t Qs[BM * HD];
    __shared__ __align__(32) bf16_t Ks[BN * HD];
    __shared__ __align__(32) bf16_t Vs[BN * HD];
    __shared__ __align__(32) float Ss[WM_WARPS * 16 * BN];   // each warp's 16 x BN scores
    __shared__ __align__(32) bf16_t Ps[WM_WARPS * 16 * BN];  // each warp's 16 x BN probabilities (bf16)
    __shared__ __align__(32) float Os[BM * HD];              // the block's output rows, unnormalised, fp32

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int b = blockIdx.z, h = blockIdx.y, hk = h / (H / Hkv);
    const int m0 = blockIdx.x * BM, offset = Tk - Tq;
    const long long q_head = ((long long)b * H + h) * Tq * HD;
    const long long kv_head = ((long long)b * Hkv + hk) * Tk * HD;
    float* S_w = Ss + warp * 16 * BN;
    bf16_t* P_w = Ps + warp * 16 * BN;

    load_tile_bf16<HD>(Qs, q, q_head, m0, BM, Tq);
    for (int e = threadIdx.x; e < BM * HD; e += WM_THREADS) Os[e] = 0.0f;

    // lanes 0..15 of each warp own one query row each: r = lane, row m0 + warp*16 + r
    const int r = lane & 15, i = m0 + warp * 16 + r;
    float m_run = NEG_INF, l_run = 0.0f;

    const int last_row = min(m0 + BM, Tq) - 1;
    const int n_end = min(Tk, last_row + offset + 1);
    for (int n0 = 0; n0 < n_end; n0 += BN) {
        __syncthreads();  // Q/O initialised; everyone is done with the previous K/V tile
        load_tile_bf16<HD>(Ks, k, kv_head, n0, BN, Tk);
        load_tile_bf16<HD>(Vs, v, kv_head, n0, BN, Tk);
        __syncthreads();

        // S_w = Q_w Kᵀ  (16 x BN): B = Kᵀ, element (d, j) = K[j][d] -> FragBT over the rows of K
        for (int cb = 0; cb < BN / 16; ++cb) {
            FragC acc;
            wmma::fill_fragment(acc, 0.0f);
            mma_rows<HD / 16, FragBT>(acc, Qs + warp * 16 * HD, HD, Ks + cb * 16 * HD, HD, true);
            wmma::store_matrix_sync(S_w + cb * 16, acc, BN, wmma::mem_row_major);
        }
        __syncwarp();
        if (lane < 16) {
            float m_tile = NEG_INF;
            for (int jj = 0; jj < BN; ++jj) {
                const int j = n0 + jj;
                const bool valid = i < Tq && j < Tk && j <= i + offset;
                const float s = valid ? S_w[r * BN + jj] * scale : NEG_INF;
                S_w[r * BN + jj] = s;
                m_tile = fmaxf(m_tile, s);
            }
            const float m_new = fmaxf(m_run, m_tile);
            const bool empty = m_new == NEG_INF;  // a padding row (i >= Tq): nothing visible, keep zeros
            const float c = empty ? 1.0f : expf(m_run - m_new);
            float sum = 0.0f;
            for (int jj = 0; jj < BN; ++jj) {
                const float p = empty ? 0.0f : expf(S_w[r * BN + jj] - m_new);
                P_w[r * BN + jj] = float_to_bf16(p);
                sum += p;
            }
            l_run = l_run * c + sum;
            m_run = m_new;
            float* O_row = Os + (warp * 16 + r) * HD;
            for (int d = 0; d < HD; ++d) O_row[d] *= c;
        }
        __syncwarp();
        // O_w += P_w V  (16 x HD): B = V rows n0.., row-major
        for (int cb = 0; cb < HD / 16; ++cb) {
            FragC acc;
            wmma::load_matrix_sync(acc, Os + warp * 16 * HD + cb * 16, HD, wmma::mem_row_major);
            mma_rows<BN / 16, FragB>(acc, P_w, BN, Vs + cb * 16, HD, false);
            wmma::store_matrix_sync(Os + warp * 16 * HD + cb * 16, acc, HD, wmma::mem_row_major);
        }
        __syncwarp();
    }
    if (lane < 16 && i < Tq) {
        const float inv_l = 1.0f / l_run;
        const float* O_row = Os + (warp * 16 + r) * HD;
        for (int d = 0; d < HD; ++d) o[q_head + (long long)i * HD + d] = O_row[d] * inv_l;
        lse[((long long)b * H + h) * Tq + i] = m_run + logf(l_run);
    }
}

// ---------------------------------------------------------------------------------------------------
template <int HD>
__device__ __forceinline__ void wmma_bwd_dq_impl(const bf16_t* __restrict__ q, const bf16_t* __restrict__ k,
                                                 const bf16_t* __restrict__ v, const float* __restrict__ dout,
                                                 const float* __restrict__ lse, const float* __restrict__ delta,
                                                 float* __restrict__ dq, int H, int Hkv, int Tq, int Tk,
                                                 float scale) {
    constexpr int BM = 64, BN = 32;
    __shared__ __align__(32) bf16_t Qs[BM * HD];
    __shared__ __align__(32) bf16_t dOs[BM * HD];
    __shared__ __align__(32) bf16_t Ks[BN * HD];
    __shared__ __align__(32) bf16_t Vs[BN * HD];
    __shared__ __align__(32) float Ss[WM_WARPS * 16 * BN];
    __shared__ __align__(32) float dPs[WM_WARPS * 16 * BN];
    __shared__ __align__(32) bf16_t dSs[WM_WARPS * 16 * BN];

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int b = blockIdx.z, h = blockIdx.y, hk = h / (H / Hkv);
    const int m0 = blockIdx.x * BM, offset = Tk - Tq;
    const long long row_base = ((long long)b * H + h) * Tq;  // lse / delta index of row 0
    const long long q_head = row_base * HD;
    const long long kv_head = ((long long)b * Hkv + hk) * Tk * HD;
    float* S_w = Ss + warp * 16 * BN;
    float* dP_w = dPs + warp * 16 * BN;
    bf16_t* dS_w = dSs + warp * 16 * BN;

    load_tile_bf16<HD>(Qs, q, q_head, m0, BM, Tq);
    load_tile_bf16<HD>(dOs, dout, q_head, m0, BM, Tq);
    const int r = lane & 15, i = m0 + warp * 16 + r;
    const float lse_i = i < Tq ? lse[row_base + i] : 0.0f;
    const float delta_i = i < Tq ? delta[row_base + i] : 0.0f;

    FragC dq_acc[HD / 16];
    for (int cb = 0; cb < HD / 16; ++cb) wmma::fill_fragment(dq_acc[cb], 0.0f);

    const int last_row = min(m0 + BM, Tq) - 1;
    const int n_end = min(Tk, last_row + offset + 1);
    for (int n0 = 0; n0 < n_end; n0 += BN) {
        __syncthreads();
        load_tile_bf16<HD>(Ks, k, kv_head, n0, BN, Tk);
        load_tile_bf16<HD>(Vs, v, kv_head, n0, BN, Tk);
        __syncthreads();
        for (int cb = 0; cb < BN / 16; ++cb) {  // S_w = Q_w Kᵀ and dP_w = dO_w Vᵀ (16 x BN)
            FragC s_acc, dp_acc;
            wmma::fill_fragment(s_acc, 0.0f);
            wmma::fill_fragment(dp_acc, 0.0f);
            mma_rows<HD / 16, FragBT>(s_acc, Qs + warp * 16 * HD, HD, Ks + cb * 16 * HD, HD, true);
            mma_rows<HD / 16, FragBT>(dp_acc, dOs + warp * 16 * HD, HD, Vs + cb * 16 * HD, HD, true);
            wmma::store_matrix_sync(S_w + cb * 16, s_acc, BN, wmma::mem_row_major);
            wmma::store_matrix_sync(dP_w + cb * 16, dp_acc, BN, wmma::mem_row_major);
        }
        __syncwarp();
        if (lane < 16) {
            for (int jj = 0; jj < BN; ++jj) {
                const int j = n0 + jj;
                const bool valid = i < Tq && j < Tk && j <= i + offset;
                const float p = valid ? expf(S_w[r * BN + jj] * scale - lse_i) : 0.0f;
                dS_w[r * BN + jj] = float_to_bf16(p * (dP_w[r * BN + jj] - delta_i) * scale);
            }
        }
        __syncwarp();
        for (int cb = 0; cb < HD / 16; ++cb)  // dQ_w += dS_w K  (16 x HD): B = K rows n0.., row-major
            mma_rows<BN / 16, FragB>(dq_acc[cb], dS_w, BN, Ks + cb * 16, HD, false);
    }
    // out through shared memory (S_w as a 16 x 16 staging tile, leading dim BN) so ragged rows are skipped
    for (int cb = 0; cb < HD / 16; ++cb) {
        __syncwarp();
        wmma::store_matrix_sync(S_w, dq_acc[cb], BN, wmma::mem_row_major);
        __syncwarp();
        if (lane < 16 && i < Tq)
            for (int d = 0; d < 16; ++d) dq[q_head + (long long)i * HD + cb * 16 + d] = S_w[r * BN + d];
    }
}

// ---------------------------------------------------------------------------------------------------
template <int HD>
__device__ __forceinline__ void wmma_bwd_dkdv_impl(const bf16_t* __restrict__ q, const bf16_t* __restrict__ k,
                                                   const bf16_t* __restrict__ v, const float* __restrict__ dout,
                                                   const float* __restrict__ lse, const float* __restrict__ delta,
                                                   float* __restrict__ dk, float* __restrict__ dv, int H, int Hkv,
                                                   int Tq, int Tk, float scale) {
    constexpr int BN = 64, BM = 16;  // key rows per block (16 per warp); query rows per tile
    __shared__ __align__(32) bf16_t Ks[BN * HD];
    __shared__ __align__(32) bf16_t Vs[BN * HD];
    __shared__ __align__(32) bf16_t Qs[BM * HD];
    __shared__ __align__(32) bf16_t dOs[BM * HD];
    __shared__ float lses[BM];
    __shared__ float deltas[BM];
    __shared__ __align__(32) float STs[WM_WARPS * 16 * BM];    // each warp's Sᵀ: 16 keys x BM queries
    __shared__ __align__(32) float dPTs[WM_WARPS * 16 * BM];
    __shared__ __align__(32) bf16_t PTs[WM_WARPS * 16 * BM];
    __shared__ __align__(32) bf16_t dSTs[WM_WARPS * 16 * BM];

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int b = blockIdx.z, hk = blockIdx.y, G = H / Hkv;
    const int n0 = blockIdx.x * BN, offset = Tk - Tq;
    const long long kv_head = ((long long)b * Hkv + hk) * Tk * HD;
    float* ST_w = STs + warp * 16 * BM;
    float* dPT_w = dPTs + warp * 16 * BM;
    bf16_t* PT_w = PTs + warp * 16 * BM;
    bf16_t* dST_w = dSTs + warp * 16 * BM;

    load_tile_bf16<HD>(Ks, k, kv_head, n0, BN, Tk);
    load_tile_bf16<HD>(Vs, v, kv_head, n0, BN, Tk);
    const int r = lane & 15, j = n0 + warp * 16 + r;  // lanes 0..15: key row j

    FragC dk_acc[HD / 16], dv_acc[HD / 16];
    for (int cb = 0; cb < HD / 16; ++cb) {
        wmma::fill_fragment(dk_acc[cb], 0.0f);
        wmma::fill_fragment(dv_acc[cb], 0.0f);
    }
    const int m_start = max(0, n0 - offset);  // earlier query rows see none of this block's keys
    for (int g = 0; g < G; ++g) {
        const long long row_base = ((long long)b * H + hk * G + g) * Tq;
        for (int m0 = m_start; m0 < Tq; m0 += BM) {
            __syncthreads();  // K/V loaded; everyone is done with the previous query tile
            load_tile_bf16<HD>(Qs, q, row_base * HD, m0, BM, Tq);
            load_tile_bf16<HD>(dOs, dout, row_base * HD, m0, BM, Tq);
            for (int ii = threadIdx.x; ii < BM; ii += WM_THREADS) {
                lses[ii] = m0 + ii < Tq ? lse[row_base + m0 + ii] : 0.0f;
                deltas[ii] = m0 + ii < Tq ? delta[row_base + m0 + ii] : 0.0f;
            }
            __syncthreads();
            for (int cb = 0; cb < BM / 16; ++cb) {  // Sᵀ_w = K_w Qᵀ, dPᵀ_w = V_w dOᵀ  (16 x BM)
                FragC s_acc, dp_acc;
                wmma::fill_fragment(s_acc, 0.0f);
                wmma::fill_fragment(dp_acc, 0.0f);
                mma_rows<HD / 16, FragBT>(s_acc, Ks + warp * 16 * HD, HD, Qs + cb * 16 * HD, HD, true);
                mma_rows<HD / 16, FragBT>(dp_acc, Vs + warp * 16 * HD, HD, dOs + cb * 16 * HD, HD, true);
                wmma::store_matrix_sync(ST_w + cb * 16, s_acc, BM, wmma::mem_row_major);
                wmma::store_matrix_sync(dPT_w + cb * 16, dp_acc, BM, wmma::mem_row_major);
            }
            __syncwarp();
            if (lane < 16) {
                for (int ii = 0; ii < BM; ++ii) {
                    const int i = m0 + ii;
                    const bool valid = i < Tq && j < Tk && j <= i + offset;
                    const float p = valid ? expf(ST_w[r * BM + ii] * scale - lses[ii]) : 0.0f;
                    PT_w[r * BM + ii] = float_to_bf16(p);
                    dST_w[r * BM + ii] = float_to_bf16(p * (dPT_w[r * BM + ii] - deltas[ii]) * scale);
                }
            }
            __syncwarp();
            for (int cb = 0; cb < HD / 16; ++cb) {  // dV_w += Pᵀ_w dO, dK_w += dSᵀ_w Q  (16 x HD)
                mma_rows<BM / 16, FragB>(dv_acc[cb], PT_w, BM, dOs + cb * 16, HD, false);
                mma_rows<BM / 16, FragB>(dk_acc[cb], dST_w, BM, Qs + cb * 16, HD, false);
            }
        }
    }
    for (int cb = 0; cb < HD / 16; ++cb) {  // out through ST_w / dPT_w as 16 x 16 staging tiles
        __syncwarp();
        wmma::store_matrix_sync(ST_w, dk_acc[cb], BM, wmma::mem_row_major);
        wmma::store_matrix_sync(dPT_w, dv_acc[cb], BM, wmma::mem_row_major);
        __syncwarp();
        if (lane < 16 && j < Tk) {
            for (int d = 0; d < 16; ++d) {
                dk[kv_head + (long long)j * HD + cb * 16 + d] = ST_w[r * BM + d];
                dv[kv_head + (long long)j * HD + cb * 16 + d] = dPT_w[r * BM + d];
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(WM_THREADS) flash_wmma_fwd(const bf16_t* q, const bf16_t* k, const bf16_t* v,
                                                                        float* o, float* lse, int H, int Hkv, int Tq,
                                                                        int Tk, float scale) {
    wmma_fwd_impl<FA_HD>(q, k, v, o, lse, H, Hkv, Tq, Tk, scale);
}

extern "C" __global__ void __launch_bounds__(WM_THREADS) flash_wmma_bwd_dq(const bf16_t* q, const bf16_t* k,
                                                                           const bf16_t* v, const float* dout,
                                                                           const float* lse, const float* delta,
                                                                           float* dq, int H, int Hkv, int Tq, int Tk,
                                                                           float scale) {
    wmma_bwd_dq_impl<FA_HD>(q, k, v, dout, lse, delta, dq, H, Hkv, Tq, Tk, scale);
}

extern "C" __global__ void __launch_bounds__(WM_THREADS) flash_wmma_bwd_dkdv(const bf16_t* q, const bf16_t* k,
                                                                             const bf16_t* v, const float* dout,
                                                                             const float* lse, const float* delta,
                                                                             float* dk, float* dv, int H, int Hkv,
                                                                             int Tq, int Tk, float scale) {
    wmma_bwd_dkdv_impl<FA_HD>(q, k, v, dout, lse, delta, dk, dv, H, Hkv, Tq, Tk, scale);
}
