"""SwiGLU gate: h = silu(g) · u with silu(g) = g · σ(g). (The three linears live in the model.)

    d silu / dg = σ(g) · (1 + g · (1 − σ(g)))
"""
import numpy as np


def swiglu_forward(g, u):
    """g, u [..., F] -> h [..., F]."""
    s = 0.5 * (1.0 + np.tanh(0.5 * g))  # σ(g), without overflow for large |g|
    return g * s * u, (g, u, s)


def swiglu_backward(dh, cache):
    """dh [..., F] -> dg, du [..., F]."""
    g, u, s = cache
    silu = g * s
    dg = dh * u * s * (1.0 + g * (1.0 - s))
    du = dh * silu
    return dg, du
