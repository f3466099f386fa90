"""A scalar multiplier: y = c·x, so dx = c·dy (Granite's embedding, residual, attention and logits multipliers,
Config.MULTIPLIERS). The factor is rounded to x's dtype, as the model computes in it.

    scale_forward(np.ones(3), 0.5)  ->  ([0.5, 0.5, 0.5], 0.5);   scale_backward(np.ones(3), 0.5) -> [0.5, 0.5, 0.5]
"""


def scale_forward(x, c: float):
    """x [...] -> c·x [...] (the cache: c)."""
    return x * x.dtype.type(c), c


def scale_backward(dy, cache):
    """dy [...] -> dx = c·dy [...]."""
    return dy * dy.dtype.type(cache)
