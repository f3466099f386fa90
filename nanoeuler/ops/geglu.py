"""GeGLU gate (Gemma's MLP): h = gelu_tanh(g) · u. (The three linears live in the model.)

With gelu' from gelu.py:   dg = dh · u · gelu'(g),    du = dh · gelu(g)

    geglu_forward(np.array([1.0]), np.array([2.0]))[0] ≈ [1.682384]   (2 · gelu(1) = 2 · 0.841192)
"""
from .gelu import gelu_backward, gelu_forward


def geglu_forward(g, u):
    """g, u [..., F] -> h [..., F]."""
    a, c_gelu = gelu_forward(g)
    return a * u, (a, u, c_gelu)


def geglu_backward(dh, cache):
    """dh [..., F] -> dg, du [..., F]."""
    a, u, c_gelu = cache
    return gelu_backward(dh * u, c_gelu), dh * a
