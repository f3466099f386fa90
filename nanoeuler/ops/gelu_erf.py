"""GELU, exact (GPT-NeoX's / BERT's "gelu", PyTorch's gelu(approximate="none")): x times the standard normal CDF.

    y = x·Φ(x),    Φ(x) = ½·(1 + erf(x/√2))

Backward, with the normal density φ(x) = exp(−x²/2)/√(2π):

    dy/dx = Φ(x) + x·φ(x)

It differs from the tanh form (gelu.py) by up to ~5e-4 (near |x| ≈ 2). NumPy has no erf: `erf` is math.erf
compiled elementwise by numba (libm's, within an ulp in float64, so the float64 gradient check sees the true
function; float32 results are rounded to float32).

    gelu_erf_forward(np.array([0.0, 1.0]))[0] ≈ [0, 0.841345]
"""
import math

import numpy as np
from numba import vectorize

INV_SQRT2 = 1.0 / math.sqrt(2.0)
INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


@vectorize(cache=True)   # (compiled per dtype at its first call)
def erf(x):
    """The error function, elementwise (math.erf)."""
    return math.erf(x)


def gelu_erf_forward(x):
    """x [...] -> y [...] (same shape and dtype)."""
    half = x.dtype.type(0.5)
    cdf = half * (1 + erf(x * x.dtype.type(INV_SQRT2)).astype(x.dtype, copy=False))   # (a float64 loop may serve)
    return x * cdf, (x, cdf)


def gelu_erf_backward(dy, cache):
    """dy [...] -> dx [...]."""
    x, cdf = cache
    pdf = x.dtype.type(INV_SQRT_2PI) * np.exp(x.dtype.type(-0.5) * x * x)
    return dy * (cdf + x * pdf)
