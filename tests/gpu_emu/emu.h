// A CPU emulation of the little CUDA the kernels in nanoeuler/gpu/kernels use, so their logic (indexing,
// masking, barriers, online softmax) can be tested on machines without a GPU: g++ compiles the .cu
// source as C++ with this header in front, and every CUDA thread of a block becomes a fiber.
//
//  - blocks run one after another; their threads are fibers that meet at __syncthreads (each runs up to
//    the barrier, then the next); a thread that returns early stops counting for the barrier, as on a GPU;
//  - __shared__ variables become `static` (one copy, shared by the block's threads; blocks are sequential);
//  - warp shuffles are emulated through a block-wide exchange buffer and two barriers, which is correct
//    only when every thread of the block calls them together (true for block_sum / block_max).
#pragma once
#include <ucontext.h>
#include <cmath>
#include <cstring>
#include <functional>
#include <math.h>
#include <type_traits>
#include <vector>

#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __launch_bounds__(x)
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))

struct emu_uint3 { unsigned int x, y, z; };
inline emu_uint3 threadIdx, blockIdx, blockDim, gridDim;
inline float emu_exchange[1024];

// A block's threads are fibers (ucontext) on the calling OS thread, run round-robin: each runs until it
// reaches __syncthreads (or returns), then the next one runs; when every live fiber has arrived, the
// barrier opens and the next round starts. A returned thread no longer counts, as on a GPU.
// The scheduler sets threadIdx before resuming a fiber, so kernels read it as usual.
struct EmuFibers {
    ucontext_t scheduler;
    std::vector<ucontext_t> ctx;
    std::vector<std::vector<char>> stacks;
    std::vector<char> done;
    unsigned current = 0;
    const std::function<void()>* body = nullptr;
};
inline EmuFibers* emu_fibers = nullptr;

inline void emu_fiber_main() {
    (*emu_fibers->body)();
    emu_fibers->done[emu_fibers->current] = 1;  // returning resumes the scheduler (uc_link)
}

inline void __syncthreads() { swapcontext(&emu_fibers->ctx[emu_fibers->current], &emu_fibers->scheduler); }

inline float __shfl_xor_sync(unsigned int, float v, int lane_mask) {
    emu_exchange[threadIdx.x] = v;
    __syncthreads();
    const float other = emu_exchange[threadIdx.x ^ lane_mask];
    __syncthreads();
    return other;
}

inline void emu_launch(unsigned gx, unsigned gy, unsigned gz, unsigned bx, const std::function<void()>& body) {
    const size_t stack_size = 256 * 1024;
    EmuFibers f;
    f.ctx.resize(bx);
    f.stacks.assign(bx, std::vector<char>(stack_size));
    f.done.assign(bx, 0);
    f.body = &body;
    emu_fibers = &f;
    blockDim = {bx, 1, 1};
    gridDim = {gx, gy, gz};
    for (unsigned z = 0; z < gz; ++z)
        for (unsigned y = 0; y < gy; ++y)
            for (unsigned x = 0; x < gx; ++x) {
                blockIdx = {x, y, z};
                for (unsigned t = 0; t < bx; ++t) {
                    f.done[t] = 0;
                    getcontext(&f.ctx[t]);
                    f.ctx[t].uc_stack.ss_sp = f.stacks[t].data();
                    f.ctx[t].uc_stack.ss_size = stack_size;
                    f.ctx[t].uc_link = &f.scheduler;
                    makecontext(&f.ctx[t], emu_fiber_main, 0);
                }
                for (bool live = true; live;) {  // one round = every live thread up to its next barrier
                    live = false;
                    for (unsigned t = 0; t < bx; ++t) {
                        if (f.done[t]) continue;
                        f.current = t;
                        threadIdx = {t, 0, 0};
                        swapcontext(&f.scheduler, &f.ctx[t]);
                        live |= !f.done[t];
                    }
                }
            }
    emu_fibers = nullptr;
}

inline float __uint_as_float(unsigned int u) { float f; std::memcpy(&f, &u, 4); return f; }
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline unsigned int __float_as_uint(float f) { unsigned int u; std::memcpy(&u, &f, 4); return u; }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }

// ---- warp-level matrix multiply (nvcuda::wmma), 16x16x16 bf16 -> fp32 only --------------------------
// Each thread holds the whole 16x16 tile (row-major) instead of its share: loads and products are
// repeated by the 32 lanes with identical results, which is equivalent as long as kernels only use
// load / store / fill / mma on fragments (never their elements). __syncwarp and the barriers inside
// store_matrix_sync are block-wide here, correct when every warp of the block reaches the same calls,
// as our kernels do.
inline void __syncwarp(unsigned int = 0xffffffffu) { __syncthreads(); }
struct __nv_bfloat16 { unsigned short bits; };

namespace nvcuda {
namespace wmma {
struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };

template <typename Use, int M, int N, int K, typename T, typename Layout = void>
struct fragment { float x[256]; };

inline float emu_bf16(const __nv_bfloat16* p, long long i) {
    const unsigned int u = (unsigned int)p[i].bits << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

template <typename Use, typename Layout>
inline void load_matrix_sync(fragment<Use, 16, 16, 16, __nv_bfloat16, Layout>& f, const __nv_bfloat16* p, unsigned ldm) {
    for (int r = 0; r < 16; ++r)
        for (int c = 0; c < 16; ++c)  // element (r, c) of the tile: A[m][k] or B[k][n]
            f.x[r * 16 + c] = std::is_same<Layout, row_major>::value ? emu_bf16(p, (long long)r * ldm + c)
                                                                      : emu_bf16(p, (long long)c * ldm + r);
}

inline void load_matrix_sync(fragment<accumulator, 16, 16, 16, float>& f, const float* p, unsigned ldm, layout_t l) {
    for (int r = 0; r < 16; ++r)
        for (int c = 0; c < 16; ++c) f.x[r * 16 + c] = l == mem_row_major ? p[r * ldm + c] : p[c * ldm + r];
}

// A store is collective: no lane may overwrite the tile before every lane has loaded what it needed,
// nor load it again before every lane has stored (barriers before and after; all warps store together).
inline void store_matrix_sync(float* p, const fragment<accumulator, 16, 16, 16, float>& f, unsigned ldm, layout_t l) {
    __syncthreads();
    for (int r = 0; r < 16; ++r)
        for (int c = 0; c < 16; ++c) (l == mem_row_major ? p[r * ldm + c] : p[c * ldm + r]) = f.x[r * 16 + c];
    __syncthreads();
}

inline void fill_fragment(fragment<accumulator, 16, 16, 16, float>& f, float v) {
    for (float& e : f.x) e = v;
}

template <typename LA, typename LB>
inline void mma_sync(fragment<accumulator, 16, 16, 16, float>& d,
                     const fragment<matrix_a, 16, 16, 16, __nv_bfloat16, LA>& a,
                     const fragment<matrix_b, 16, 16, 16, __nv_bfloat16, LB>& b,
                     const fragment<accumulator, 16, 16, 16, float>& c) {
    float out[256];
    for (int m = 0; m < 16; ++m)
        for (int n = 0; n < 16; ++n) {
            float acc = c.x[m * 16 + n];
            for (int k = 0; k < 16; ++k) acc += a.x[m * 16 + k] * b.x[k * 16 + n];
            out[m * 16 + n] = acc;
        }
    std::memcpy(d.x, out, sizeof out);
}
}  // namespace wmma
}  // namespace nvcuda
