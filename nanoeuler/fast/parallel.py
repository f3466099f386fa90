"""Every core busy during a step: the batch is cut into one sub-batch per core ("part"), and each part's
forward and backward run start to finish in their own thread, on single-threaded BLAS and the serial
numba kernels (both release the GIL). The threads meet only where the parts' gradients are summed.

Why not let BLAS and the kernels thread themselves: at the sizes of our presets (a [4096, 128] activation
is 2 MiB) every op is short, and a step has ~100 of them. Splitting each op over the cores costs a
hand-off and a wait per op, and OpenBLAS's threads spin while they wait: when the cores are shared and
one thread is descheduled, the other burns its time. Whole sub-batches per thread need no waiting at all.

The split is a fixed function of the batch size and the number of cores, so a run is bit-identical run to
run on the same machine (on a machine with another core count the sums are grouped differently: equal
to rounding). If NumPy's BLAS is not an OpenBLAS we can set to one thread, PARTS is 1 and BLAS threads itself.

    with single_threaded_blas():
        run_parts(lambda k: work_on(part[k]), n)     # part 0 in this thread, the others on the pool
"""
from __future__ import annotations

import contextlib
import os
from concurrent.futures import ThreadPoolExecutor

from .blas import get_threads as _get_threads
from .blas import set_threads as _set_threads

PARTS = len(os.sched_getaffinity(0)) if _set_threads is not None and hasattr(os, "sched_getaffinity") else 1
_pool: ThreadPoolExecutor | None = None
_pool_size = 0
_depth = 0


@contextlib.contextmanager
def single_threaded_blas():
    """OpenBLAS on one thread inside the block (the previous count is restored after); re-entrant."""
    global _depth
    if _set_threads is None:
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


@contextlib.contextmanager
def blas_threads(n: int):
    """OpenBLAS on n threads inside the block (the previous count restored after); a no-op without OpenBLAS."""
    if _set_threads is None:
        yield
        return
    prev = _get_threads()
    _set_threads(n)
    try:
        yield
    finally:
        _set_threads(prev)


def run_parts(fn, n: int) -> None:
    """fn(0), ..., fn(n-1) at once: fn(0) in the calling thread, the rest on a pool (exceptions re-raised)."""
    global _pool, _pool_size
    if n == 1:
        fn(0)
        return
    if _pool_size < n - 1:
        _pool_size = max(n - 1, PARTS - 1)
        _pool = ThreadPoolExecutor(max_workers=_pool_size, thread_name_prefix="nanoeuler-part")
    futures = [_pool.submit(fn, k) for k in range(1, n)]
    try:
        fn(0)
    finally:
        for f in futures:
            f.result()


def chunks(n: int, parts: int) -> list[tuple[int, int]]:
    """[0, n) cut into `parts` contiguous ranges as equal as can be.  chunks(5, 2) == [(0, 2), (2, 5)]"""
    return [(n * k // parts, n * (k + 1) // parts) for k in range(parts)]
