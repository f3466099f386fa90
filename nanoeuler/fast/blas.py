"""NumPy's own OpenBLAS, reached through ctypes for the two things NumPy does not expose: its thread count
(parallel.py) and a product that accumulates into its output, `matmul_add`.

`np.matmul(a, b, out=c)` can only overwrite c; gemm itself computes c = α·a·b + β·c. A sum of products over
chunks of rows (a head's weight gradient, Σ_chunks dlogitsᵀ·h, fast/engine.py) with β = 1 costs one pass
over c per chunk, where a temporary and `c += t` cost three and the temporary's memory.

    c = np.zeros((3, 2), np.float32)
    matmul_add(a.T, b, c); matmul_add(a2.T, b2, c)      # c == a.T @ b + a2.T @ b2
"""
from __future__ import annotations

import ctypes
import glob
import os

import numpy as np


def _find_openblas():
    """NumPy's bundled OpenBLAS: (library, symbol prefix, symbol suffix), or None."""
    libdir = os.path.join(os.path.dirname(np.__file__), os.pardir, "numpy.libs")
    for path in sorted(glob.glob(os.path.join(libdir, "lib*openblas*.so*"))):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for prefix, suffix in (("scipy_openblas_", "64_"), ("openblas_", "")):
            if hasattr(lib, f"{prefix}set_num_threads{suffix}"):
                return lib, prefix, suffix
    return None


def _thread_count_calls(found):
    """(set_num_threads, get_num_threads) of the library, or (None, None)."""
    if found is None:
        return None, None
    lib, prefix, suffix = found
    setter, getter = getattr(lib, f"{prefix}set_num_threads{suffix}"), getattr(lib, f"{prefix}get_num_threads{suffix}")
    setter.argtypes, setter.restype, getter.restype = [ctypes.c_int], None, ctypes.c_int
    return setter, getter


def _gemm_calls(found) -> dict:
    """dtype -> cblas ?gemm of the library's 64-bit-integer interface (scipy-openblas), where it has one."""
    if found is None or found[1] != "scipy_openblas_":
        return {}
    lib, i64, ptr = found[0], ctypes.c_int64, ctypes.c_void_p
    calls = {}
    for dtype, letter, real in ((np.float32, "s", ctypes.c_float), (np.float64, "d", ctypes.c_double)):
        fn = getattr(lib, f"scipy_cblas_{letter}gemm64_", None)
        if fn is not None:
            fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, i64, i64, i64, real, ptr, i64, ptr, i64,
                           real, ptr, i64]
            fn.restype = None
            calls[np.dtype(dtype)] = fn
    return calls


_FOUND = _find_openblas()
set_threads, get_threads = _thread_count_calls(_FOUND)
_GEMM = _gemm_calls(_FOUND)
ROW_MAJOR, NO_TRANS, TRANS = 101, 111, 112   # cblas enums


def _operand(a):
    """(transposed?, leading dimension) of a 2-D array as a row-major gemm operand, or None when neither
    its rows nor its columns are contiguous."""
    size = a.itemsize
    if a.strides[1] == size and a.strides[0] % size == 0 and a.strides[0] >= max(1, a.shape[1]) * size:
        return NO_TRANS, a.strides[0] // size
    if a.strides[0] == size and a.strides[1] % size == 0 and a.strides[1] >= max(1, a.shape[0]) * size:
        return TRANS, a.strides[1] // size
    return None


def matmul_add(a, b, out) -> None:
    """out [m, n] += a [m, k] @ b [k, n]: one gemm with β = 1 when the three share a float dtype that NumPy's
    OpenBLAS serves and each has contiguous rows or columns (out: rows), else through a temporary."""
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0] or out.shape != (a.shape[0], b.shape[1]):
        raise ValueError(f"matmul_add: {a.shape} @ {b.shape} into {out.shape}")
    gemm = _GEMM.get(out.dtype)
    ops = (_operand(a), _operand(b)) if gemm is not None and a.dtype == b.dtype == out.dtype else (None, None)
    if None in ops or out.strides[1] != out.itemsize or 0 in a.shape + b.shape:
        out += a @ b
        return
    (ta, lda), (tb, ldb) = ops
    m, k = a.shape
    n = b.shape[1]
    gemm(ROW_MAJOR, ta, tb, m, n, k, 1.0, a.ctypes.data, lda, b.ctypes.data, ldb, 1.0, out.ctypes.data,
         out.strides[0] // out.itemsize)
