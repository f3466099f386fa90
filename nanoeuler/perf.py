"""Throughput helpers: the machine's float32 matmul peak (for MFU) and model FLOPs per token."""
from __future__ import annotations

import time
from functools import cache

import numpy as np


@cache
def matmul_peak_flops(n: int = 1024, seconds: float = 0.3) -> float:
    """Best observed float32 FLOP/s of an n×n matmul over about `seconds` (measured once per process)."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    out = np.empty((n, n), dtype=np.float32)
    np.matmul(a, b, out=out)
    best, deadline = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < deadline or best == float("inf"):
        t = time.perf_counter()
        np.matmul(a, b, out=out)
        best = min(best, time.perf_counter() - t)
    return 2 * n ** 3 / best


def mfu(n_params: int, tokens_per_second: float, peak: float | None = None, passes: int = 6) -> float:
    """Model FLOPs utilisation: passes·N·tokens/s (6: forward, dx and dW of every weight) over the measured
    matmul peak."""
    return passes * n_params * tokens_per_second / (peak or matmul_peak_flops())
