"""GELU, tanh approximation (GPT-2's "gelu_new", PyTorch's gelu(approximate="tanh")):

    y = ½·x·(1 + tanh(u)),    u = c·(x + a·x³),    c = sqrt(2/π), a = 0.044715

Backward, with t = tanh(u) and du/dx = c·(1 + 3a·x²):

    dy/dx = ½·(1 + t) + ½·x·(1 − t²)·c·(1 + 3a·x²)

    gelu_forward(np.array([0.0, 1.0]))[0] ≈ [0, 0.841192]
"""
import math

import numpy as np

C = math.sqrt(2.0 / math.pi)
A = 0.044715


def gelu_forward(x):
    """x [...] -> y [...] (same shape and dtype)."""
    c, a = x.dtype.type(C), x.dtype.type(A)
    t = np.tanh(c * (x + a * x * x * x))
    return x.dtype.type(0.5) * x * (1 + t), (x, t)


def gelu_backward(dy, cache):
    """dy [...] -> dx [...]."""
    x, t = cache
    c, a, half = x.dtype.type(C), x.dtype.type(A), x.dtype.type(0.5)
    return dy * (half * (1 + t) + half * x * (1 - t * t) * c * (1 + 3 * a * x * x))
