"""float16 <-> float32 inside the decoding kernels, where numba has no float16 type.

A float16 weight is kept as its IEEE half bits (a uint16 array) and widened in the kernel by an LLVM
`fpext half -> float`, which x86 executes as one vcvtph2ps per 16 values (F16C); the arithmetic stays float32.
A float16 model therefore decodes as the float32 model whose weights were rounded to float16.

    W16 = half_bits(W)        # W.astype(np.float16).view(np.uint16): what gemv.pack lays out in panels
    widen(W16) == W.astype(np.float16).astype(np.float32)     (exact, both ways of writing it)
    to_f32(v)                 one weight as float32 inside a kernel: float32 as is, uint16 as float16 bits
    through_half(x)           x rounded to the nearest float16 (ties to even), inside a kernel (kernels._gelu_half)
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic, overload


def _widened(name: str, arg, narrow):
    """A numba intrinsic `name`(v: arg) -> float32: the float16 narrow(builder, v) widened (fpext) to float."""
    def typer(typingctx, v):
        def codegen(context, builder, signature, args):
            return builder.fpext(narrow(builder, args[0]), ir.FloatType())
        return types.float32(arg), codegen
    typer.__name__ = name
    return intrinsic(typer)


# the float16 whose IEEE bits are `bits` (uint16), as float32: bitcast to half, fpext
_half_to_f32 = _widened("_half_to_f32", types.uint16, lambda b, bits: b.bitcast(bits, ir.HalfType()))
# x (float32) rounded to the nearest float16 (ties to even), as float32: fptrunc, fpext
through_half = _widened("through_half", types.float32, lambda b, x: b.fptrunc(x, ir.HalfType()))


def to_f32(v):
    """A weight as float32: float32 as is, uint16 read as float16 bits.  to_f32(np.uint16(0x3C00)) == 1.0"""
    if isinstance(v, np.uint16):
        return np.float32(v.view(np.float16))
    return np.float32(v)


@overload(to_f32, inline="always")
def _to_f32_impl(v):
    if isinstance(v, types.Integer) and v.bitwidth == 16 and not v.signed:
        return lambda v: _half_to_f32(v)
    return lambda v: np.float32(v)


@njit(cache=True, nogil=True)
def _widen(bits, out):
    for i in range(bits.size):
        out[i] = to_f32(bits[i])


def widen(W: np.ndarray) -> np.ndarray:
    """A float16 array as float32 (exact; by vcvtph2ps, faster than NumPy's astype: docs/benchmarks.md).
    widen(np.ones(2, np.float16)) -> [1.0, 1.0] float32"""
    W = np.ascontiguousarray(W)
    out = np.empty(W.shape, np.float32)
    _widen(W.reshape(-1).view(np.uint16), out.reshape(-1))
    return out


def half_bits(W: np.ndarray) -> np.ndarray:
    """W rounded to float16, as the uint16 bits the kernels read.  half_bits(np.ones(1)) -> [0x3C00]"""
    return np.ascontiguousarray(W, dtype=np.float16).view(np.uint16)
