"""Token embedding: a row lookup. The backward scatters-adds each position's gradient into its row.

    W = [[0, 0], [1, 1], [2, 2]];  embedding_forward([[2, 1]], W)[0] == [[[2, 2], [1, 1]]]
"""
import numpy as np


def embedding_forward(ids, W):
    """ids int [B, T], W [V, d] -> x [B, T, d]."""
    return W[ids], (ids, W.shape)


def embedding_backward(dx, cache):
    """dx [B, T, d] -> dW [V, d] (rows of repeated ids accumulate)."""
    ids, shape = cache
    dW = np.zeros(shape, dtype=dx.dtype)
    np.add.at(dW, ids.reshape(-1), dx.reshape(-1, shape[1]))
    return dW
