"""Soft-capping (Gemma 2's attention scores and final logits): y = cap · tanh(x / cap), which keeps every value
within (−cap, cap) and leaves the small ones almost as they are. cap 0 means none (y = x).

Backward: with t = tanh(x / cap), dy/dx = 1 − t², so dx = dy · (1 − (y / cap)²).

    softcap_forward(np.array([0.1, 50.0, -500.0]), 50.0)[0] ≈ [0.1, 38.08, -50.0]
"""
import numpy as np


def softcap_forward(x, cap):
    """x [...] -> y [...] = cap · tanh(x / cap) (cap 0: y = x)."""
    if not cap:
        return x, (None, cap)
    c = x.dtype.type(cap)
    t = np.tanh(x / c)
    return t * c, (t, cap)


def softcap_backward(dy, cache):
    """dy [...] -> dx [...] = dy · (1 − tanh²(x / cap))."""
    t, cap = cache
    if not cap:
        return dy
    return dy * (1 - t * t)
