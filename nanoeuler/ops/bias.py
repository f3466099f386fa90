"""Bias add over the last axis: y = x + b. Each row receives the same b, so db sums dy over rows.

    x [B, T, d] + b [d];  db = Σ_{B,T} dy,  dx = dy

    bias_backward(np.ones((2, 3, 4)), (4,))  ->  (ones [2, 3, 4], [6, 6, 6, 6])
"""
import numpy as np


def bias_forward(x, b):
    """x [..., n], b [n] -> y [..., n]."""
    return x + b, b.shape


def bias_backward(dy, cache):
    """dy [..., n] -> dx [..., n] (dy itself), db [n]."""
    (n,) = cache
    return dy, np.sum(dy.reshape(-1, n), axis=0)
