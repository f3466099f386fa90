"""Learned absolute position embedding (GPT-2's wpe): x[b, t] += W[start + t] for t < T.

The table W [ctx, d] has one row per position; a sequence of T tokens starting at position `start`
(0 in training, the cache length when decoding) adds rows start .. start+T−1. Backward: dx = dy, and
row start+t of dW is the sum over the batch of dy[:, t]; rows never used get 0.

    W = [[0, 0], [1, 1], [2, 2]];  position_forward(zeros [1, 2, 2], W, start=1)[0] == [[[1, 1], [2, 2]]]
"""
import numpy as np

from ..errors import UserError


def position_forward(x, W, start=0):
    """x [B, T, d], W [ctx, d] -> y [B, T, d] = x + W[start : start+T]."""
    T = x.shape[1]
    if start + T > W.shape[0]:
        raise UserError(f"position {start + T - 1} is past the position table ({W.shape[0]} positions)")
    return x + W[start:start + T], (start, W.shape)


def position_backward(dy, cache):
    """dy [B, T, d] -> dx [B, T, d] (dy itself), dW [ctx, d]."""
    start, shape = cache
    T = dy.shape[1]
    dW = np.zeros(shape, dtype=dy.dtype)
    dW[start:start + T] = dy.sum(axis=0)
    return dy, dW
