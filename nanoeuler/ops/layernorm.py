"""LayerNorm with weight and bias (GPT-2's norm): y = (x − mean(x)) / sqrt(var(x) + eps) · w + b.

Over the last axis of size d, with μ = mean(x), σ² = mean((x − μ)²) (biased, as PyTorch), r = 1/sqrt(σ² + eps)
and the normalised n = (x − μ)·r, let g = dy·w. Then

    dw = Σ_rows dy·n,    db = Σ_rows dy
    dx = r · (g − mean(g) − n · mean(g·n))

Derivation: n_j = (x_j − μ)·r, with ∂μ/∂x_i = 1/d and ∂r/∂x_i = −r³·(x_i − μ)/d = −r²·n_i/d, so
∂n_j/∂x_i = r·(δ_ij − 1/d) − n_j·r·n_i/d. Contracting with g_j: dx_i = r·(g_i − mean(g) − n_i·mean(g·n)).
(RMSNorm is the same without the centring: no −mean(g) term, see rmsnorm.py.)

    x = [[1, 2, 3]], w = [1, 1, 1], b = [0, 0, 0]  ->  y ≈ [[-1.2247, 0, 1.2247]]
"""
import numpy as np


def layernorm_forward(x, w, b, eps):
    """x [..., d], w [d], b [d] -> y [..., d]."""
    mu = np.mean(x, axis=-1, keepdims=True)                                             # [..., 1]
    xc = x - mu
    r = 1.0 / np.sqrt(np.mean(xc * xc, axis=-1, keepdims=True) + x.dtype.type(eps))  # [..., 1]
    n = xc * r
    return n * w + b, (n, r, w)


def layernorm_backward(dy, cache):
    """dy [..., d] -> dx [..., d], dw [d], db [d]."""
    n, r, w = cache
    g = dy * w
    dx = r * (g - np.mean(g, axis=-1, keepdims=True) - n * np.mean(g * n, axis=-1, keepdims=True))
    d = n.shape[-1]
    dw = np.sum((dy * n).reshape(-1, d), axis=0)
    db = np.sum(dy.reshape(-1, d), axis=0)
    return dx, dw, db
