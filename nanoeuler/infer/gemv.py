"""Matrix products over float32 and float16 weights for decoding, a panel of 64 outputs at a time.

A weight matrix W [out, in] is kept in kernel form (`pack`): panels of PANEL = 64 outputs, each stored input by
input, [in, 64]. A panel is one contiguous stream, and the kernel (`_panel_intrinsic`, written in LLVM IR:
numba compiled the loops below no better than dot products) runs it for up to 4 rows of x at once with the
4·4 accumulator vectors of 16 floats in registers:

    for i in range(in):      acc[r, :] += panel[i, :] · x[r, i]      (r < 4: 4 vector FMAs per row)

so there is no horizontal sum at all, and a weight is read once for 4 rows (from 1 to 32 rows this beats a dot
product per output compiled by numba, and OpenBLAS). Each output sums over `in` in order with fused
multiply-adds, not in NumPy's order, so results equal the reference to rounding (tests/test_infer_kernels.py
checks ≤ 1e-5 relative on the logits); a row's result is the same whichever rows share its pass. At one row a
step is bound by memory traffic (every weight is read once a token), which is why float16 weights (float16.py:
their IEEE bits, widened in the kernel) and the block types (qkernels.py) pay.

    W16 = half_bits(W)         # float16.py: W rounded to float16, as uint16 bits
    kernels.matvec(pack(W16), X, out) == X @ W.astype(np.float16).astype(np.float32).T     (to float32 rounding)

`gemv_panel` is one panel's outputs for every row; pool.py shares a product's panels among threads, and the
kernel kinds are told apart by the form's dtype (`form_kind`): 0 float32, 1 float16 bits, from QUANT on a block
type of qkernels.py (whose panels have the same 64 outputs).
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import carray, njit, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from . import qkernels

FAST = {"reassoc", "contract"}  # reorder sums, fuse multiply-adds; no assumptions on inf/nan
OPTS = dict(cache=True, nogil=True, error_model="numpy", fastmath=FAST)  # every float kernel of the decoding step
QUANT = 3  # kernel kinds from 3 on: block-quantized weights (qkernels.KINDS)

LANES = 16            # floats in one vector (an AVX-512 register; LLVM splits it where registers are narrower)
VECS = 4              # vectors of outputs a panel accumulates: 4 independent FMA chains per row
PANEL = LANES * VECS  # outputs per panel, the unit of work a thread claims
MAX_R = 4             # rows of X sharing one pass over a panel (4 rows x 4 vectors: 16 accumulators in registers)


def packed_shape(shape: tuple) -> tuple:
    """The shape of pack(W) for W of `shape`.  packed_shape((3, 100, 8)) -> (3, 2, 8, PANEL)"""
    *lead, O, I = shape
    return (*lead, -(-O // PANEL), I, PANEL)


def pack(W: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """The kernel form of W [..., out, in] (float32, or float16 bits as uint16): panels
    [..., ceil(out / PANEL), in, PANEL], panel b holding outputs b·PANEL .. b·PANEL + PANEL - 1 input by input
    (zeros pad the last one), so that a panel is one contiguous stream.

        pack(W)[..., b, i, j] == W[..., b·PANEL + j, i]

    out: where to write it (C-contiguous, packed_shape(W.shape), W's dtype), else a new array."""
    *lead, O, I = W.shape
    out = np.empty(packed_shape(W.shape), W.dtype) if out is None else out
    full = O // PANEL  # whole panels; then the last one, zero-padded
    out[..., :full, :, :] = W[..., :full * PANEL, :].reshape(*lead, full, PANEL, I).swapaxes(-1, -2)
    if full < out.shape[-3]:
        out[..., full, :, :] = 0
        out[..., full, :, :O - full * PANEL] = W[..., full * PANEL:, :].swapaxes(-1, -2)
    return out


@intrinsic
def f32_at(typingctx, addr):
    """The float32 pointer at address addr (an int64): carray(f32_at(a), shape) is the array there."""
    def codegen(context, builder, sig, args):
        return builder.inttoptr(args[0], ir.PointerType(ir.FloatType()))
    return types.CPointer(types.float32)(types.int64), codegen


def _panel_intrinsic(rows: int, half: bool):
    """An intrinsic (w, x, t, n_in) running one panel for `rows` rows of X, all addresses:

        t[r, j] = Σ_i panel[i, j] · x[r·n_in + i]      r < rows, j < PANEL, i < n_in (>= 1)

    with the panel [n_in, PANEL] float32 (or float16 bits) at w, t [rows, PANEL] float32. One loop over i
    keeps rows x VECS accumulator vectors in registers: per input i it loads the panel's PANEL weights once
    (float16 widened by one vcvtph2ps per LANES), broadcasts x[r, i] and makes rows x VECS fused multiply-adds.
    No horizontal sums (a dot-product kernel, such as NumPy-style code compiled through numba, needs one per
    output and row); each output sums over i in order, the same for any `rows`, so a row's result does not
    depend on how many rows share the pass."""
    f32, i64 = ir.FloatType(), ir.IntType(64)
    vec = ir.VectorType(f32, LANES)
    elt = ir.IntType(16) if half else f32

    def codegen(context, builder, sig, args):
        w, x, t, n_in = args
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vec, [vec, vec, vec]),
                                             f"llvm.fma.v{LANES}f32")
        wp, xp, tp = (builder.inttoptr(w, elt.as_pointer()), builder.inttoptr(x, f32.as_pointer()),
                      builder.inttoptr(t, f32.as_pointer()))
        entry, loop, done = builder.block, builder.append_basic_block("panel"), builder.append_basic_block("panel.end")
        zero, splat = ir.Constant(vec, [0.0] * LANES), ir.Constant(ir.VectorType(ir.IntType(32), LANES), [0] * LANES)
        builder.branch(loop)
        builder.position_at_end(loop)
        i = builder.phi(i64)
        acc = [builder.phi(vec) for _ in range(rows * VECS)]
        for a in acc:
            a.add_incoming(zero, entry)
        base = builder.mul(i, ir.Constant(i64, PANEL))
        ws = []
        for v in range(VECS):
            ptr = builder.gep(wp, [builder.add(base, ir.Constant(i64, v * LANES))])
            if half:
                bits = builder.load(builder.bitcast(ptr, ir.VectorType(elt, LANES).as_pointer()), align=2)
                ws.append(builder.fpext(builder.bitcast(bits, ir.VectorType(ir.HalfType(), LANES)), vec))
            else:
                ws.append(builder.load(builder.bitcast(ptr, vec.as_pointer()), align=4))
        new = []
        for r in range(rows):
            xr = builder.load(builder.gep(xp, [builder.add(builder.mul(ir.Constant(i64, r), n_in), i)]))
            xv = builder.shuffle_vector(builder.insert_element(ir.Constant(vec, ir.Undefined), xr,
                                                               ir.Constant(ir.IntType(32), 0)),
                                        ir.Constant(vec, ir.Undefined), splat)
            new += [builder.call(fma, [ws[v], xv, acc[r * VECS + v]]) for v in range(VECS)]
        i1 = builder.add(i, ir.Constant(i64, 1))
        i.add_incoming(ir.Constant(i64, 0), entry)
        i.add_incoming(i1, builder.block)
        for a, a1 in zip(acc, new):
            a.add_incoming(a1, builder.block)
        builder.cbranch(builder.icmp_signed("<", i1, n_in), loop, done)
        builder.position_at_end(done)
        for k, a in enumerate(new):
            builder.store(a, builder.bitcast(builder.gep(tp, [ir.Constant(i64, k * LANES)]), vec.as_pointer()), align=4)
        return context.get_dummy_value()

    def typer(typingctx, w, x, t, n_in):
        return types.void(types.int64, types.int64, types.int64, types.int64), codegen
    typer.__name__ = f"_panel{rows}_{'f16' if half else 'f32'}"
    return intrinsic(typer)


_p1, _p2, _p3, _p4 = (_panel_intrinsic(r, False) for r in range(1, 5))
_h1, _h2, _h3, _h4 = (_panel_intrinsic(r, True) for r in range(1, 5))


@njit(inline="always", **OPTS)
def _panel(half, k, w, x, t, n_in):
    """t[:k] = the panel at w for rows x .. (k <= MAX_R of them, n_in floats each; see _panel_intrinsic)."""
    if half:
        if k == 4:
            _h4(w, x, t, n_in)
        elif k == 3:
            _h3(w, x, t, n_in)
        elif k == 2:
            _h2(w, x, t, n_in)
        else:
            _h1(w, x, t, n_in)
    elif k == 4:
        _p4(w, x, t, n_in)
    elif k == 3:
        _p3(w, x, t, n_in)
    elif k == 2:
        _p2(w, x, t, n_in)
    else:
        _p1(w, x, t, n_in)


@njit(**OPTS)
def gemv_panel(half, Wa, Xa, Ya, n, O, I, add, b, T):
    """Outputs b·PANEL .. (at most O) of Y (+)= X @ Wᵀ for every row: W in kernel form (`pack`) at address Wa,
    X [n, I] and Y [n, O] float32 C-contiguous at Xa, Ya; the rows go MAX_R at a time, each group one pass
    over the panel (in L1 after the first). T [MAX_R, PANEL] float32 scratch."""
    w = Wa + b * I * PANEL * (2 if half else 4)
    o0 = b * PANEL
    m = min(PANEL, O - o0)
    Y = carray(f32_at(Ya), (n, O))
    r = 0
    while r < n:
        k = min(MAX_R, n - r)
        _panel(half, k, w, Xa + r * I * 4, T.ctypes.data, I)
        qkernels.store_rows(Y, T, r, k, o0, m, add)
        r += k


def form_kind(W):
    return 0


@overload(form_kind, inline="always")
def _form_kind_impl(W):
    """0: float32 panels, 1: float16 bits (uint16), from QUANT: a block type (uint8, told apart by the bytes of a
    panel's block: qkernels.KINDS, STRIDES)."""
    if W.dtype == types.uint8:
        return lambda W: qkernels.kind_of(W.shape[-1])
    half = isinstance(W.dtype, types.Integer)
    return (lambda W: 1) if half else (lambda W: 0)

