"""Linear map without bias, weights in PyTorch [out, in] orientation: y = x @ W.T."""
import numpy as np


def linear_forward(x, W):
    """x [..., in], W [out, in] -> y [..., out]."""
    return x @ W.T, (x, W)


def linear_backward(dy, cache):
    """dy [..., out] -> dx [..., in], dW [out, in]."""
    x, W = cache
    dx = dy @ W
    dW = dy.reshape(-1, dy.shape[-1]).T @ x.reshape(-1, x.shape[-1])  # [out, N] @ [N, in]
    return dx, dW
