"""Matmuls for the fast engine: each one split by output rows over the cores, single-threaded BLAS per part.

Why: OpenBLAS's own threads synchronise by spinning. When the cores are shared with other processes
and one of its threads is descheduled, the other spins waiting for it; measured here with the machine
loaded, a [384, 4096] @ [4096, 1024] weight-gradient matmul took 72 ms of CPU (180 ms wall) on 2 BLAS
threads and 36 ms of CPU on one. So during a training step OpenBLAS is set to one thread and each
matmul's output rows are split into `PARTS` blocks computed concurrently from Python threads (NumPy
releases the GIL inside BLAS). The split is fixed, so results are bit-identical run to run.

If NumPy's BLAS is not an OpenBLAS we can find (another build), nothing is changed: `matmul` is
np.matmul and BLAS threads itself.

    with single_threaded_blas():
        matmul(x, w.T, out=y)          # y [M, n] = x [M, k] @ w.T, rows of y split over the cores
"""
from __future__ import annotations

import contextlib
import ctypes
import glob
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

MIN_ROWS_PER_PART = 64


def _find_openblas():
    """(set_num_threads, get_num_threads) of NumPy's bundled OpenBLAS, or (None, None)."""
    libdir = os.path.join(os.path.dirname(np.__file__), os.pardir, "numpy.libs")
    for path in sorted(glob.glob(os.path.join(libdir, "lib*openblas*.so*"))):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for set_name, get_name in (("scipy_openblas_set_num_threads64_", "scipy_openblas_get_num_threads64_"),
                                   ("openblas_set_num_threads", "openblas_get_num_threads")):
            if hasattr(lib, set_name) and hasattr(lib, get_name):
                setter, getter = getattr(lib, set_name), getattr(lib, get_name)
                setter.argtypes, setter.restype, getter.restype = [ctypes.c_int], None, ctypes.c_int
                return setter, getter
    return None, None


_set_threads, _get_threads = _find_openblas()
PARTS = len(os.sched_getaffinity(0)) if _set_threads is not None and hasattr(os, "sched_getaffinity") else 1
_pool: ThreadPoolExecutor | None = None
_depth = 0


@contextlib.contextmanager
def single_threaded_blas():
    """OpenBLAS on one thread inside the block (the previous count is restored after); re-entrant."""
    global _depth
    if _set_threads is None or PARTS == 1:
        yield
        return
    prev = _get_threads() if _depth == 0 else None
    if _depth == 0:
        _set_threads(1)
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if _depth == 0:
            _set_threads(prev)


def matmul(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> np.ndarray:
    """out [M, n] = a [M, k] @ b [k, n], the rows of out in PARTS blocks on PARTS threads (inside
    `single_threaded_blas`); one plain np.matmul when small or when BLAS threads itself."""
    global _pool
    M = out.shape[0]
    if PARTS == 1 or _depth == 0 or M < MIN_ROWS_PER_PART * PARTS:
        return np.matmul(a, b, out=out)
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=PARTS - 1, thread_name_prefix="nanoeuler-blas")
    bounds = [M * i // PARTS for i in range(PARTS + 1)]
    futures = [_pool.submit(np.matmul, a[lo:hi], b, out=out[lo:hi]) for lo, hi in zip(bounds[1:-1], bounds[2:])]
    np.matmul(a[:bounds[1]], b, out=out[:bounds[1]])
    for f in futures:
        f.result()
    return out
