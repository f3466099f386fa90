"""RMSNorm (weight only): y = x / sqrt(mean(x²) + eps) * w.

Backward, with r = 1/sqrt(mean(x²) + eps), n = x·r, g = dy·w over the last axis of size d:
    dx = r · (g − n · mean(g·n)),    dw = Σ_rows dy·n
"""
import numpy as np


def rmsnorm_forward(x, w, eps):
    """x [..., d], w [d] -> y [..., d]."""
    r = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + x.dtype.type(eps))  # [..., 1]
    n = x * r
    return n * w, (n, r, w)


def rmsnorm_backward(dy, cache):
    """dy [..., d] -> dx [..., d], dw [d]."""
    n, r, w = cache
    g = dy * w
    dx = r * (g - n * np.mean(g * n, axis=-1, keepdims=True))
    dw = np.sum((dy * n).reshape(-1, n.shape[-1]), axis=0)
    return dx, dw
