"""`vexp`: an exp that numba can vectorise (float32), for the fused kernels of the fast engine.

numba has no vector math library here (no SVML), so `math.exp` inside a loop is a scalar libm call,
slower than NumPy's own SIMD `np.exp`. `vexp` computes float32 exp from plain arithmetic,
which LLVM turns into vector code as fast as NumPy's (bench/kernels_vs_numpy.py, docs/benchmarks.md):

    exp(x) = 2^k · exp(r),  k = round(x / ln 2),  r = x − k·ln 2 ∈ [−ln2/2, ln2/2]   (Cody–Waite split of ln 2)
    exp(r) ≈ 1 + r + r²·p(r)   (degree-5 minimax p, the Cephes expf coefficients)
    2^k built directly from its exponent bits.

Accuracy: ≤ 4 ulp (relative error 2·10⁻⁷) on [−87, 88]; x < −87 gives 0, x > 88 saturates at 1.65·10³⁸
(our kernels only call it on x ≤ 0 or where the result is divided into 1). float64 inputs use math.exp,
exact to the last bit, so the float64 gradient check sees the true function.

    vexp(np.float32(1.0)) == np.float32(2.7182817)
"""
import math

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic, overload


@intrinsic
def _pow2_f32(typingctx, k):
    """2**k for an integral float32 k in [−126, 127], from the exponent bits: ((int(k) + 127) << 23) as float."""
    sig = types.float32(types.float32)

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        ki = builder.fptosi(args[0], i32)
        bits = builder.shl(builder.add(ki, ir.Constant(i32, 127)), ir.Constant(i32, 23))
        return builder.bitcast(bits, ir.FloatType())

    return sig, codegen


def vexp(x):
    """exp(x); inside numba code float32 takes the vectorisable path described above."""
    return math.exp(x)


@overload(vexp)
def _vexp_impl(x):
    if isinstance(x, types.Float) and x.bitwidth == 32:
        def impl(x):
            lo, hi = np.float32(-87.0), np.float32(88.0)
            xc = x if x > lo else lo
            xc = xc if xc < hi else hi
            k = np.floor(xc * np.float32(1.4426950408889634) + np.float32(0.5))
            r = xc - k * np.float32(0.693359375)
            r = r - k * np.float32(-2.12194440e-4)
            p = np.float32(1.9875691500e-4)
            p = p * r + np.float32(1.3981999507e-3)
            p = p * r + np.float32(8.3334519073e-3)
            p = p * r + np.float32(4.1665795894e-2)
            p = p * r + np.float32(1.6666665459e-1)
            p = p * r + np.float32(5.0000001201e-1)
            y = (p * r * r + r + np.float32(1.0)) * _pow2_f32(k)
            return y if x > lo else np.float32(0.0)
        return impl

    def impl(x):
        return math.exp(x)
    return impl
