"""Matrix products on cuBLAS: fp32 (optionally TF32) through CuPy, and bf16 x bf16 -> fp32 through cublasGemmEx.

CuPy has no bfloat16 dtype, so bf16 tensors are kept as uint16 arrays holding the top 16 bits of the
fp32 value (`to_bf16` / `from_bf16`, kernels in convert.cu) and multiplied with `cublasGemmEx`
(A, B in CUDA_R_16BF, C in CUDA_R_32F, fp32 accumulation) on the tensor cores.

Row-major trick: cuBLAS is column-major, and a row-major [r, c] array read column-major is its
transpose. So for row-major C[M, N] = op(A)[M, K] @ op(B)[K, N] we ask cuBLAS for the column-major
Cᵀ[N, M] = op(B)ᵀ @ op(A)ᵀ, i.e. gemm(op_b, op_a, N, M, K, B, A), with leading dimensions = the
row-major row lengths. Example: y = x @ Wᵀ (x [M, K], W [N, K]) is gemm_bf16(x, W, trans_b=True).

TF32 (`set_tf32(True)`) lets fp32 products use the tensor cores with 10-bit mantissas: much faster,
but ~1e-3 relative error, so the gradient checks run with it off (the default).
"""
from __future__ import annotations

import numpy as np

from .runtime import blocks_for, get_kernel, require_cupy, THREADS

# cuBLAS / CUDA enum values (cublas_api.h, library_types.h)
CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
CUDA_R_32F, CUDA_R_16BF = 0, 14
CUBLAS_COMPUTE_32F = 68
CUBLAS_GEMM_DEFAULT = -1
CUBLAS_POINTER_MODE_HOST = 0


def set_tf32(enabled: bool) -> None:
    """Route fp32 CuPy matmuls through TF32 tensor cores (True) or exact fp32 (False, the default)."""
    cp = require_cupy()
    from cupy._core import _routines_linalg as rl
    rl.set_compute_type(np.float32, rl.COMPUTE_TYPE_TF32 if enabled else rl.COMPUTE_TYPE_DEFAULT)
    del cp


def to_bf16(x):
    """fp32 cupy array -> uint16 cupy array of bf16 bits (round to nearest even), same shape."""
    cp = require_cupy()
    x = cp.ascontiguousarray(x, dtype=cp.float32)
    y = cp.empty(x.shape, dtype=cp.uint16)
    n = x.size
    get_kernel("convert", "f32_to_bf16")((blocks_for(n),), (THREADS,), (x, y, np.int64(n)))
    return y


def from_bf16(x):
    """uint16 cupy array of bf16 bits -> fp32 cupy array, same shape."""
    cp = require_cupy()
    x = cp.ascontiguousarray(x)
    y = cp.empty(x.shape, dtype=cp.float32)
    n = x.size
    get_kernel("convert", "bf16_to_f32")((blocks_for(n),), (THREADS,), (x, y, np.int64(n)))
    return y


def gemm_bf16(a, b, trans_a: bool = False, trans_b: bool = False):
    """Row-major 2-D bf16 (uint16) a, b -> fp32 op(a) @ op(b), op = transpose where asked.

    a is [M, K] (or [K, M] with trans_a), b is [K, N] (or [N, K] with trans_b); result [M, N] float32.
    """
    cp = require_cupy()
    from cupy_backends.cuda.libs import cublas
    assert a.dtype == cp.uint16 and b.dtype == cp.uint16 and a.ndim == 2 and b.ndim == 2
    a = cp.ascontiguousarray(a)
    b = cp.ascontiguousarray(b)
    M, K = (a.shape[1], a.shape[0]) if trans_a else a.shape
    Kb, N = (b.shape[1], b.shape[0]) if trans_b else b.shape
    if K != Kb:
        raise ValueError(f"gemm_bf16: inner dimensions differ ({K} vs {Kb})")
    c = cp.empty((M, N), dtype=cp.float32)
    if M == 0 or N == 0:
        return c
    if K == 0:
        c.fill(0)
        return c
    alpha = np.array(1.0, dtype=np.float32)
    beta = np.array(0.0, dtype=np.float32)
    handle = cp.cuda.device.get_cublas_handle()
    cublas.setStream(handle, cp.cuda.get_current_stream().ptr)
    cublas.setPointerMode(handle, CUBLAS_POINTER_MODE_HOST)  # alpha and beta live in host memory
    # column-major: Cᵀ[N, M] = op(B)ᵀ[N, K] @ op(A)ᵀ[K, M]; lda/ldb/ldc = row-major row lengths
    cublas.gemmEx(handle,
                  CUBLAS_OP_T if trans_b else CUBLAS_OP_N,
                  CUBLAS_OP_T if trans_a else CUBLAS_OP_N,
                  N, M, K,
                  alpha.ctypes.data,
                  b.data.ptr, CUDA_R_16BF, b.shape[1],
                  a.data.ptr, CUDA_R_16BF, a.shape[1],
                  beta.ctypes.data,
                  c.data.ptr, CUDA_R_32F, N,
                  CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT)
    return c
