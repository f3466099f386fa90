"""The fused decoding step: the KV-cache forward of a few new tokens (of one sequence, or one per sequence of
serve's batch) in one numba call, for every architecture of arch.py.

forward.py's `forward_hidden` (the readable NumPy reference) makes ~16 matrix products and ~100 small NumPy
calls per token; at one token a step each of them is too short for BLAS or NumPy to pay for its own
overhead (most of a token's time goes to the calls, not to the matrix-vector products). `step` here is
the same mathematics in one compiled call, layer after layer on preallocated rows, with what the model's
record chose read from `Weights` (empty arrays where an architecture has no such part):

    x = embed[tokens] · scale (+ pos[positions])                 [n, d]
    per layer:  h = norm(x);  qkv = h @ Wqkvᵀ (+ b)  (one GEMV)      [n, (H + 2·Hkv)·hd]
                q/k norms per head; RoPE on q and k at the layer's base; k, v written at their positions
                a = softmax(q·kᵀ / sqrt(hd)) v over positions 0 .. L0+r (row r; a window: its last W)
                x += post(a @ Woᵀ + b);  h = norm(x)
                x += post(act(h @ W_inᵀ + b) @ W_outᵀ + b)     act: SwiGLU, GeGLU or GELU
    h = norm(x)  (all rows, or the last only)                    [n|1, d]

and `matvec` is the matrix product of the heads (x [n, in] @ W[out, in]ᵀ) on the same machinery.
step.py's `forward_hidden` and weights.py's `linear` call them for one sequence of up to ROWS rows (plain
decoding, a prompt CHUNK rows at a time); `round_rows` runs a speculative round (the step, head 0 and its
argmax at every row); the batcher (`step.decode_rows`) a row per stream, any number (its prompts one at a
time); batches of sequences of equal positions stay on the NumPy path.

Where a layer's MLP weights are block-quantized (qkernels: llama.cpp's arithmetic, 8-bit activations), its
GELU is llama.cpp's too: a table of the 65,536 float16 values, so x is rounded to float16 and GELU(x) to
float16 (x itself beyond ±10; `_gelu_half`). Exact GELU alone leaves a Gemma 3 file's logits ~2e-2 from
llama.cpp's at its first position.

Matrix products: a weight matrix W [out, in] is kept in kernel form (`pack`): panels of PANEL = 64
outputs, each stored input by input, [in, 64]. A panel is one contiguous stream, and the kernel
(`_panel_intrinsic`, written in LLVM IR: numba compiled the loops below no better than dot products) runs
it for up to 4 rows of x at once with the 4·4 accumulator vectors of 16 floats in registers:

    for i in range(in):      acc[r, :] += panel[i, :] · x[r, i]      (r < 4: 4 vector FMAs per row)

so there is no horizontal sum at all, and a weight is read once for 4 rows (faster, from 1 to 32 rows, than
a dot product per output compiled by numba, and than OpenBLAS). Each output sums over `in` in order
with fused multiply-adds, not in NumPy's order, so results equal the reference to rounding
(tests/test_infer_kernels.py checks ≤ 1e-5 relative on the logits); a row's result is the same whichever rows
share its pass. At one row a step is bound by memory traffic: 31 MB of float32 weights per token on `big`.

float16 weights halve that traffic. They are kept as their IEEE half bits (uint16 arrays: numba has no
float16 type on the CPU) and widened in the kernel by an LLVM `fpext half -> float` that x86 executes as
one vcvtph2ps per 16 values (F16C); the arithmetic stays float32. A float16 model therefore decodes as the
float32 model whose weights were rounded to float16.

    W16 = half_bits(W)            # W.astype(np.float16).view(np.uint16)
    matvec(pack(W16), x[None], out) == x @ W.astype(np.float16).astype(np.float32).T   (to float32 rounding)

Threads: the products are cut into panels, and the calling thread and `threads - 1` helper threads
(`set_threads`; default the cores, at most 8) claim panels from a shared counter (a compare-and-swap, so
each panel runs once; see `_gemv`). The caller never waits for a helper to *arrive*: on a machine busier
than its cores a descheduled helper simply does fewer panels, where a fork-join pool (OpenMP, numba's
`prange`) stalls at every product until its last thread is scheduled again (on a loaded machine, a
collapse of the decoding speed). Every output is computed whole by one thread with the
same code, so the result does not depend on the number of threads, bit for bit. A step of many rows at
long positions (serve's streams) shares its attention the same way, a row and a key/value head per unit
(`_attention`).

Shapes: n new rows; L0 tokens already cached; d width; H / Hkv heads; hd head width; F SwiGLU width.
"""
from __future__ import annotations

import atexit
import os
import platform
import threading
from typing import NamedTuple

import numpy as np
from llvmlite import ir
from numba import carray, njit, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from ..fast.vmath import vexp
from ..ops.gelu import A as GELU_A
from ..ops.gelu import C as GELU_C
from . import qkernels

ROWS = 8          # most rows `linear` sends to the kernels (a speculative round: t1 + 7 drafts)
CHUNK = 32        # a prompt's tokens per fused call (step.forward_hidden)
ENABLED = True    # False: every decoding step takes the NumPy reference path (tests, bench; read by weights.Forms)
FAST = {"reassoc", "contract"}  # reorder sums, fuse multiply-adds; no assumptions on inf/nan
OPTS = dict(cache=True, nogil=True, error_model="numpy", fastmath=FAST)


# ---- float16 <-> float32 ------------------------------------------------------------------------------
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
_through_half = _widened("_through_half", types.float32, lambda b, x: b.fptrunc(x, ir.HalfType()))


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


@njit(**OPTS)
def _widen(bits, out):
    for i in range(bits.size):
        out[i] = to_f32(bits[i])


def widen(W: np.ndarray) -> np.ndarray:
    """A float16 array as float32 (exact; vcvtph2ps, ~10x NumPy's astype).  widen(np.ones(2, np.float16))"""
    W = np.ascontiguousarray(W)
    out = np.empty(W.shape, np.float32)
    _widen(W.reshape(-1).view(np.uint16), out.reshape(-1))
    return out


def half_bits(W: np.ndarray) -> np.ndarray:
    """W rounded to float16, as the uint16 bits the kernels read.  half_bits(np.ones(1)) -> [0x3C00]"""
    return np.ascontiguousarray(W, dtype=np.float16).view(np.uint16)


# ---- atomics, and arrays from addresses (the work-sharing protocol below) --------------------------
def _item_ptr(context, builder, arrty, arr, idx):
    ary = context.make_array(arrty)(context, builder, value=arr)
    return cgutils.get_item_pointer(context, builder, arrty, ary, [idx])


@intrinsic
def _load(typingctx, a, i):
    """a[i] (int64) read with acquire ordering."""
    def codegen(context, builder, sig, args):
        return builder.load_atomic(_item_ptr(context, builder, sig.args[0], args[0], args[1]), "acquire", 8)
    return types.int64(a, i), codegen


@intrinsic
def _store(typingctx, a, i, v):
    """a[i] = v (int64) with release ordering."""
    def codegen(context, builder, sig, args):
        builder.store_atomic(args[2], _item_ptr(context, builder, sig.args[0], args[0], args[1]), "release", 8)
        return context.get_dummy_value()
    return types.void(a, i, v), codegen


@intrinsic
def _add(typingctx, a, i, v):
    """a[i] += v atomically (int64)."""
    def codegen(context, builder, sig, args):
        return builder.atomic_rmw("add", _item_ptr(context, builder, sig.args[0], args[0], args[1]), args[2], "seq_cst")
    return types.int64(a, i, v), codegen


@intrinsic
def _cas(typingctx, a, i, old, new):
    """a[i] = new if a[i] == old, atomically (int64); whether it was."""
    def codegen(context, builder, sig, args):
        p = _item_ptr(context, builder, sig.args[0], args[0], args[1])
        return builder.extract_value(builder.cmpxchg(p, args[2], args[3], "seq_cst", "seq_cst"), 1)
    return types.boolean(a, i, old, new), codegen


@intrinsic
def _yield(typingctx):
    """sched_yield(): let another runnable thread have this core (a spinning thread on a busy machine)."""
    def codegen(context, builder, sig, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(32), []), "sched_yield")
        builder.call(fn, [])
        return context.get_dummy_value()
    return types.void(), codegen


_X86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")


@intrinsic
def _pause(typingctx):
    """The spin-wait hint (x86 `pause`: ~40-140 cycles, no memory-order speculation while polling)."""
    def codegen(context, builder, sig, args):
        if _X86:
            fnty = ir.FunctionType(ir.VoidType(), [])
            fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.x86.sse2.pause")
            builder.call(fn, [])
        return context.get_dummy_value()
    return types.void(), codegen


@intrinsic
def _f32_at(typingctx, addr):
    def codegen(context, builder, sig, args):
        return builder.inttoptr(args[0], ir.PointerType(ir.FloatType()))
    return types.CPointer(types.float32)(types.int64), codegen


@intrinsic
def _i64_at(typingctx, addr):
    def codegen(context, builder, sig, args):
        return builder.inttoptr(args[0], ir.PointerType(ir.IntType(64)))
    return types.CPointer(types.int64)(types.int64), codegen


# ---- small pieces (inlined into the kernels) -------------------------------------------------------
@njit(inline="always", **OPTS)
def _dot(w, x, n):
    """Σ w[:n]·x[:n] in float32."""
    s = np.float32(0.0)
    for i in range(n):
        s += w[i] * x[i]
    return s


# ---- the matrix product, a panel at a time ---------------------------------------------------------
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


def _panel_intrinsic(rows: int, half: bool):
    """An intrinsic (w, x, t, n_in) running one panel for `rows` rows of X, all addresses:

        t[r, j] = Σ_i panel[i, j] · x[r·n_in + i]      r < rows, j < PANEL, i < n_in (>= 1)

    with the panel [n_in, PANEL] float32 (or float16 bits) at w, t [rows, PANEL] float32. One loop over i
    keeps rows x VECS accumulator vectors in registers: per input i it loads the panel's PANEL weights once
    (float16 widened by one vcvtph2ps per LANES), broadcasts x[r, i] and makes rows x VECS fused multiply-adds.
    No horizontal sums (a dot-product kernel needs one per output and row, and NumPy-style code compiled
    through numba got them at ~2x this cost); each output sums over i in order, the same for any `rows`,
    so a row's result does not depend on how many rows share the pass."""
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
def _gemv_panel(half, Wa, Xa, Ya, n, O, I, add, b, T):
    """Outputs b·PANEL .. (at most O) of Y (+)= X @ Wᵀ for every row: W in kernel form (`pack`) at address Wa,
    X [n, I] and Y [n, O] float32 C-contiguous at Xa, Ya; the rows go MAX_R at a time, each group one pass
    over the panel (in L1 after the first). T [MAX_R, PANEL] float32 scratch."""
    w = Wa + b * I * PANEL * (2 if half else 4)
    o0 = b * PANEL
    m = min(PANEL, O - o0)
    Y = carray(_f32_at(Ya), (n, O))
    r = 0
    while r < n:
        k = min(MAX_R, n - r)
        _panel(half, k, w, Xa + r * I * 4, T.ctypes.data, I)
        qkernels.store_rows(Y, T, r, k, o0, m, add)
        r += k


def _kind(W):
    return 0


@overload(_kind, inline="always")
def _kind_impl(W):
    """0: float32 panels, 1: float16 bits (uint16), from 3: a block type (uint8, told apart by the bytes of a
    panel's block: qkernels.KINDS, STRIDES)."""
    if W.dtype == types.uint8:
        return lambda W: qkernels.kind_of(W.shape[-1])
    half = isinstance(W.dtype, types.Integer)
    return (lambda W: 1) if half else (lambda W: 0)


def _row_in(W):
    return 1


@overload(_row_in, inline="always")
def _row_in_impl(W):
    """Inputs per entry of a kernel form's second-last axis: a block type's block (32, K types 256), else 1."""
    return (lambda W: qkernels.block_inputs(qkernels.kind_of(W.shape[-1]))) if W.dtype == types.uint8 else \
        (lambda W: 1)


# The control block shared by the threads (int64): the claim word and the done count sit on their own
# cache lines; the descriptor says what the current job is: a matrix product (kind 0: float32 weights,
# 1: float16 bits; then W, out, in, X, n, Y, add) or a step's attention (kind ATTEND; see _attention).
CLAIM, DONE, STOP, GEN, DESC = 0, 8, 16, 24, 32
ATTEND = 2
QUANT = 3  # kinds from 3 on: block-quantized weights (qkernels.KINDS), descriptor + 8, + 9: xd, xs
SPIN = 8192  # polls (with `pause`: ~0.2-1 ms) a waiting thread spins before it yields its core to others


@njit(**OPTS)
def _run_claimed(ctl, w):
    """Claim panels of the job in the descriptor, if the claim word is still w (its next panel on): a
    quarter of those left (at least one), so that a job of many panels takes few claims ("guided"
    scheduling: each claim is a cache line passed between cores). Whether the claim succeeded."""
    kind = ctl[DESC]
    b, nb = w & 0xFFFF, (w >> 16) & 0xFFFF
    k = max(1, (nb - b) >> 2)
    if not _cas(ctl, CLAIM, w, w + k):
        return False
    if kind == ATTEND:
        _attend_units(ctl, b, b + k)
    else:
        Wa, O, I = ctl[DESC + 1], ctl[DESC + 2], ctl[DESC + 3]
        Xa, n, Ya, add = ctl[DESC + 4], ctl[DESC + 5], ctl[DESC + 6], ctl[DESC + 7] != 0
        T = np.empty((MAX_R, PANEL), np.float32)
        for j in range(b, b + k):
            if kind >= QUANT:
                qkernels.gemv_panel(kind, Wa, Xa, ctl[DESC + 8], ctl[DESC + 9], Ya, n, O, I, add, j, T)
            else:
                _gemv_panel(kind, Wa, Xa, Ya, n, O, I, add, j, T)
    _add(ctl, DONE, k)
    return True


@njit(**OPTS)
def _gemv(ctl, pooled, W, X, Y, add):
    """Y (+)= X @ Wᵀ: W in kernel form (`pack`: [panels, in, PANEL], or a block type's: qkernels.pack), X [n, in],
    Y [n, out] float32 C-contiguous, out <= panels·PANEL; by the calling thread and whichever helpers are awake
    (`_gemv_at`)."""
    _gemv_at(ctl, pooled, _kind(W), np.int64(W.ctypes.data), W.shape[0], X, Y, add)


@njit(**OPTS)
def _gemv_at(ctl, pooled, kind, Wa, nb, X, Y, add):
    """Y (+)= X @ Wᵀ for the kernel form of `kind` (0 float32, 1 float16 bits, from QUANT a block type) at address
    Wa, nb panels; X [n, in], Y [n, out] float32 C-contiguous. A block type quantizes X's rows to 8 bits per
    block once, as the type's products read them (qkernels.quantize_rows).

    The job is cut into panels. The caller publishes it (descriptor, done = 0, then the claim word
    g << 32 | panels << 16 | next panel, g a new job number), then claims panels itself like any helper; a
    claim is a compare-and-swap of the claim word, so a panel is run once, and a helper that read a stale
    descriptor fails its swap. The caller returns when `done` counts every panel. It never waits for a
    helper to arrive: a helper that is descheduled (a busy machine) leaves its share to the caller, where a
    fork-join pool (OpenMP) would stall every job until the helper runs again."""
    n, I = X.shape
    O = Y.shape[1]
    alone = not pooled or nb < 2 or nb > 0xFFFF  # (the claim word counts panels in 16 bits)
    T = np.empty((MAX_R, PANEL), np.float32)
    # The panel kernels are called with the types _run_claimed passes (int64 addresses, a bool that is no
    # literal True / False): each is compiled once into a kernel that calls it, not once per call site.
    Ya, flag = np.int64(Y.ctypes.data), bool(add)
    if kind >= QUANT:
        xq, xd, xs = qkernels.quantize_rows(kind, X)
        if alone:
            for b in range(nb):
                qkernels.gemv_panel(kind, Wa, np.int64(xq.ctypes.data), np.int64(xd.ctypes.data),
                                    np.int64(xs.ctypes.data), Ya, n, O, I, flag, b, T)
            return
        ctl[DESC], ctl[DESC + 1], ctl[DESC + 2], ctl[DESC + 3] = kind, Wa, O, I
        ctl[DESC + 4], ctl[DESC + 5], ctl[DESC + 6], ctl[DESC + 7] = xq.ctypes.data, n, Y.ctypes.data, add
        ctl[DESC + 8], ctl[DESC + 9] = xd.ctypes.data, xs.ctypes.data
        _run_pooled(ctl, nb)
        return
    if alone:
        for b in range(nb):
            _gemv_panel(kind, Wa, np.int64(X.ctypes.data), Ya, n, O, I, flag, b, T)
        return
    ctl[DESC], ctl[DESC + 1], ctl[DESC + 2], ctl[DESC + 3] = kind, Wa, O, I
    ctl[DESC + 4], ctl[DESC + 5], ctl[DESC + 6], ctl[DESC + 7] = X.ctypes.data, n, Y.ctypes.data, add
    _run_pooled(ctl, nb)


# A matrix of the fused step, as rows of a table [segments, SEG] int64: its rows stacked in segments, each in
# a weight type of its own (a file's q and k in Q5_0 beside v in Q8_0), by address: the segment's kind, the
# address of its kernel form, its outputs, its panels. The kernel forms live in one buffer, Weights.forms.
SEG = 4


@njit(**OPTS)
def _product(ctl, pooled, M, X, Y, add):
    """Y (+)= X @ Wᵀ for the segmented matrix M [segments, SEG] (see SEG): one segment straight into Y, several
    each into a temporary then into its columns of Y."""
    if M.shape[0] == 1:
        _gemv_at(ctl, pooled, M[0, 0], M[0, 1], M[0, 3], X, Y, add)
        return
    n, o = X.shape[0], 0
    for s in range(M.shape[0]):
        m = M[s, 2]
        T = np.empty((n, m), np.float32)
        _gemv_at(ctl, pooled, M[s, 0], M[s, 1], M[s, 3], X, T, False)
        for r in range(n):
            for j in range(m):
                Y[r, o + j] = Y[r, o + j] + T[r, j] if add else T[r, j]
        o += m


@njit(**OPTS)
def _run_pooled(ctl, nb):
    """Run the job in the descriptor, nb units (panels, or attention units), with whichever helpers are awake."""
    _store(ctl, DONE, 0)
    g = ctl[GEN] + 1
    ctl[GEN] = g
    _store(ctl, CLAIM, (g << 32) | (nb << 16))
    while True:
        w = _load(ctl, CLAIM)
        if (w & 0xFFFF) >= nb:
            break
        _run_claimed(ctl, w)
    spins = 0
    while _load(ctl, DONE) < nb:  # a helper is finishing its last claim (µs, unless it lost its core)
        spins += 1
        _pause()
        if spins > SPIN:
            _yield()


@njit(**OPTS)
def _serve(ctl, patience):
    """A helper thread: run blocks of whatever job is published, until STOP is set or no job came for
    `patience` polls (then return, to sleep in Python)."""
    idle = 0
    while _load(ctl, STOP) == 0:
        w = _load(ctl, CLAIM)
        if (w & 0xFFFF) < ((w >> 16) & 0xFFFF):
            if _run_claimed(ctl, w):
                idle = 0
            continue
        idle += 1
        _pause()
        if idle > SPIN:  # idle for a while (between calls, not between the jobs of a step): be polite
            _yield()
        if idle > patience:
            return 0
    return 1


@njit(**OPTS)
def _norm(x, w, b, eps, y):
    """y [n, d] = the norm of x row by row with weight w [d]: RMSNorm x·w / sqrt(mean(x²) + eps) when the bias b
    is empty (ops/rmsnorm.py), else LayerNorm (x − μ)·w / sqrt(var + eps) + b (ops/layernorm.py)."""
    n, d = x.shape
    for r in range(n):
        m = np.float32(0.0)
        if b.shape[0]:
            for j in range(d):
                m += x[r, j]
            m /= d
        ss = np.float32(0.0)
        for j in range(d):
            ss += (x[r, j] - m) * (x[r, j] - m)
        k = np.float32(1.0 / np.sqrt(ss / d + eps))
        if b.shape[0]:
            for j in range(d):
                y[r, j] = ((x[r, j] - m) * k) * w[j] + b[j]
        else:
            for j in range(d):
                y[r, j] = (x[r, j] * k) * w[j]


@njit(inline="always", **OPTS)
def _head_norm(x, base, hd, w, eps):
    """x[base : base+hd] := its RMSNorm with weight w [hd] (a q or k head, q/k norms)."""
    ss = np.float32(0.0)
    for i in range(hd):
        ss += x[base + i] * x[base + i]
    k = np.float32(1.0 / np.sqrt(ss / hd + eps))
    for i in range(hd):
        x[base + i] = (x[base + i] * k) * w[i]


@njit(inline="always", **OPTS)
def _gelu(x):
    """GELU, tanh approximation (ops/gelu.py), as x·σ(2u) with u = c·(x + a·x³): no tanh call."""
    u = np.float32(GELU_C) * (x + np.float32(GELU_A) * (x * x * x))
    return x / (np.float32(1.0) + vexp(np.float32(-2.0) * u))


@njit(inline="always", **OPTS)
def _gelu_half(x):
    """GELU as llama.cpp's CPU computes it (ggml_vec_gelu_f32 / geglu: GGML_GELU_FP16): its table holds GELU of
    every float16, rounded to float16, and x is looked up rounded to float16; 0 at x <= -10, x at x >= 10."""
    if x <= np.float32(-10.0):
        return np.float32(0.0)
    if x >= np.float32(10.0):
        return x
    return _through_half(_gelu(_through_half(x)))


@njit(inline="always", **OPTS)
def _rope(x, base, hd, cos, sin, t, out):
    """out[:hd] = x[base : base+hd] rotated to position t (rotate-half: i pairs with i + hd/2; ops/rope.py)."""
    h2 = hd // 2
    for i in range(h2):
        a, b = x[base + i], x[base + h2 + i]
        c, s = cos[t, i], sin[t, i]
        out[i] = a * c - b * s
        out[h2 + i] = b * c + a * s


def _tree_masks(w: int) -> tuple[list[int], list[int]]:
    """Shuffle masks of one step of the lane-wise sum of two vectors a, b (lanes 0..LANES-1 of a, then of b),
    each made of groups of 2w lanes (a group: the partial sums of one score): output group g takes the first
    w lanes (lo) and the last w (hi) of a's groups, then b's; lo + hi halves every group's width.

        LANES 16, w 8:  lo = [0..7, 16..23], hi = [8..15, 24..31]"""
    G = LANES // (2 * w)
    lo = [(LANES if g >= G else 0) + (g % G) * 2 * w + i for g in range(2 * G) for i in range(w)]
    return lo, [x + w for x in lo]


def _scores_intrinsic(nv: int):
    """An intrinsic (k, q, s, scale) making LANES attention scores at once, all addresses:

        s[l] = scale · Σ_i K[l, i] · q[i]       l < LANES, i < hd = nv·LANES (K's rows hd floats apart)

    K[l] · q is nv vector multiply-adds into one vector of LANES partial sums, and the LANES vectors are
    summed lane-wise together by a transposing tree (`_tree_masks`: 16 -> 8 -> 4 -> 2 -> 1 vectors, 30
    shuffles and 15 adds in all), where a dot product per position pays a horizontal sum of its own."""
    f32, i32, i64 = ir.FloatType(), ir.IntType(32), ir.IntType(64)
    vec, mask = ir.VectorType(f32, LANES), ir.VectorType(i32, LANES)

    def codegen(context, builder, sig, args):
        k, q, s, scale = args
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vec, [vec, vec, vec]),
                                             f"llvm.fma.v{LANES}f32")
        kp, qp = builder.inttoptr(k, f32.as_pointer()), builder.inttoptr(q, f32.as_pointer())

        def load(ptr, at):
            return builder.load(builder.bitcast(builder.gep(ptr, [ir.Constant(i64, at)]), vec.as_pointer()), align=4)
        qv = [load(qp, c * LANES) for c in range(nv)]
        parts = []
        for lane in range(LANES):
            acc = builder.fmul(load(kp, lane * nv * LANES), qv[0])
            for c in range(1, nv):
                acc = builder.call(fma, [load(kp, (lane * nv + c) * LANES), qv[c], acc])
            parts.append(acc)
        w = LANES // 2
        while len(parts) > 1:
            lo, hi = (ir.Constant(mask, m) for m in _tree_masks(w))
            parts = [builder.fadd(builder.shuffle_vector(a, b, lo), builder.shuffle_vector(a, b, hi))
                     for a, b in zip(parts[0::2], parts[1::2])]
            w //= 2
        one = builder.insert_element(ir.Constant(vec, ir.Undefined), scale, ir.Constant(i32, 0))
        out = builder.fmul(parts[0], builder.shuffle_vector(one, ir.Constant(vec, ir.Undefined),
                                                            ir.Constant(mask, [0] * LANES)))
        builder.store(out, builder.bitcast(builder.inttoptr(s, f32.as_pointer()), vec.as_pointer()), align=4)
        return context.get_dummy_value()

    def typer(typingctx, k, q, s, scale):
        return types.void(types.int64, types.int64, types.int64, types.float32), codegen
    typer.__name__ = f"_scores{nv}"
    return intrinsic(typer)


_s1, _s2, _s4, _s8 = (_scores_intrinsic(nv) for nv in (1, 2, 4, 8))


def _mix_intrinsic(nv: int):
    """An intrinsic (v, p, out, blocks) for the attention output, all addresses:

        out[i] = Σ_j p[j] · V[j, i]      j < blocks·S (blocks >= 1), i < hd = nv·LANES (V's rows hd floats apart)

    with S sets of nv accumulator vectors in registers, position j adding into set j mod S (S = 4, 2, 1 for
    nv = 1-2, 4, 8: independent chains of multiply-adds, at most 16 accumulators), summed at the end. The
    same loop compiled by numba kept `out` in memory, a store and a load between consecutive positions."""
    S = 4 if nv <= 2 else 2 if nv == 4 else 1
    f32, i32, i64 = ir.FloatType(), ir.IntType(32), ir.IntType(64)
    vec, mask = ir.VectorType(f32, LANES), ir.VectorType(i32, LANES)

    def codegen(context, builder, sig, args):
        v, p, out, blocks = args
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vec, [vec, vec, vec]),
                                             f"llvm.fma.v{LANES}f32")
        vp, pp, op = (builder.inttoptr(a, f32.as_pointer()) for a in (v, p, out))
        entry, loop, done = builder.block, builder.append_basic_block("mix"), builder.append_basic_block("mix.end")
        zero = ir.Constant(vec, [0.0] * LANES)
        builder.branch(loop)
        builder.position_at_end(loop)
        b = builder.phi(i64)
        acc = [builder.phi(vec) for _ in range(S * nv)]
        new = []
        for u in range(S):
            j = builder.add(builder.mul(b, ir.Constant(i64, S)), ir.Constant(i64, u))
            pj = builder.insert_element(ir.Constant(vec, ir.Undefined), builder.load(builder.gep(pp, [j])),
                                        ir.Constant(i32, 0))
            pj = builder.shuffle_vector(pj, ir.Constant(vec, ir.Undefined), ir.Constant(mask, [0] * LANES))
            row = builder.mul(j, ir.Constant(i64, nv * LANES))
            for c in range(nv):
                vc = builder.load(builder.bitcast(builder.gep(vp, [builder.add(row, ir.Constant(i64, c * LANES))]),
                                                  vec.as_pointer()), align=4)
                new.append(builder.call(fma, [vc, pj, acc[u * nv + c]]))
        b1 = builder.add(b, ir.Constant(i64, 1))
        b.add_incoming(ir.Constant(i64, 0), entry)
        b.add_incoming(b1, builder.block)
        for a, a1 in zip(acc, new):
            a.add_incoming(zero, entry)
            a.add_incoming(a1, builder.block)
        builder.cbranch(builder.icmp_signed("<", b1, blocks), loop, done)
        builder.position_at_end(done)
        for c in range(nv):
            total = new[c]
            for u in range(1, S):
                total = builder.fadd(total, new[u * nv + c])
            builder.store(total, builder.bitcast(builder.gep(op, [ir.Constant(i64, c * LANES)]), vec.as_pointer()),
                          align=4)
        return context.get_dummy_value()

    def typer(typingctx, v, p, out, blocks):
        return types.void(types.int64, types.int64, types.int64, types.int64), codegen
    typer.__name__ = f"_mix{nv}"
    return intrinsic(typer), S


(_m1, _S1), (_m2, _S2), (_m4, _S4), (_m8, _S8) = (_mix_intrinsic(nv) for nv in (1, 2, 4, 8))


@njit(inline="always", **OPTS)
def _mix(nv, v, p, out, Tk):
    """out = Σ_j p[j] V[j] over the first positions of Tk that fill whole blocks (see _mix_intrinsic), nv in
    1, 2, 4, 8; -> how many positions that was (0: out untouched)."""
    S = _S1 if nv == 1 else _S2 if nv == 2 else _S4 if nv == 4 else _S8
    blocks = Tk // S
    if blocks == 0:
        return 0
    if nv == 1:
        _m1(v, p, out, blocks)
    elif nv == 2:
        _m2(v, p, out, blocks)
    elif nv == 4:
        _m4(v, p, out, blocks)
    else:
        _m8(v, p, out, blocks)
    return blocks * S


@njit(inline="always", **OPTS)
def _scores(nv, k, q, s, scale):
    """LANES scores (see _scores_intrinsic) for head width nv·LANES, nv in 1, 2, 4, 8."""
    if nv == 1:
        _s1(k, q, s, scale)
    elif nv == 2:
        _s2(k, q, s, scale)
    elif nv == 4:
        _s4(k, q, s, scale)
    else:
        _s8(k, q, s, scale)


@njit(**OPTS)
def _attend(q, K, V, Tk, scale, p, out):
    """out [hd] = softmax(K[:Tk] q · scale) V[:Tk] (ops/attention.py for one query); p [>= Tk] scratch.
    Where hd is LANES x 1, 2, 4 or 8 scores go LANES positions at a time (`_scores`) and the output a few
    (`_mix`) in vector registers, else one by one."""
    hd = q.shape[0]
    nv = hd // LANES
    vector = hd % LANES == 0 and (nv == 1 or nv == 2 or nv == 4 or nv == 8)
    j = 0
    if vector:
        k0, q0, p0 = K.ctypes.data, q.ctypes.data, p.ctypes.data
        while j + LANES <= Tk:
            _scores(nv, k0 + j * hd * 4, q0, p0 + j * 4, scale)
            j += LANES
    for jj in range(j, Tk):
        p[jj] = _dot(K[jj], q, hd) * scale
    m = np.float32(-np.inf)
    for j in range(Tk):
        m = max(m, p[j])
    total = np.float32(0.0)
    for j in range(Tk):
        p[j] = vexp(p[j] - m)
        total += p[j]
    j = _mix(nv, V.ctypes.data, p.ctypes.data, out.ctypes.data, Tk) if vector else 0
    if j == 0:
        out[:] = 0
    for jj in range(j, Tk):
        vj, pj = V[jj], p[jj]
        for i in range(hd):
            out[i] += pj * vj[i]
    inv = np.float32(1.0) / total
    for i in range(hd):
        out[i] *= inv


# ---- a step's attention, one unit (a row and a key/value head) at a time ----------------------------
POOLED_ATTENTION = 1 << 17  # multiply-adds (positions x heads x hd, all rows) from which helpers share it


@njit(inline="always", **OPTS)
def _attend_unit(t, a, K, V, pos, slot, H, window, u, p):
    """Unit u = r·Hkv + g: row r's query heads of group g (hh // G == g) attend to key/value head g of its
    cache row, positions 0 .. pos[r] (a window W > 0: the last W of them). t [n, (H + 2·Hkv)·hd] the row's
    q (rotated) first; a [n, H·hd] out; K, V [B, Hkv, max_len, hd] one layer's cache; p [>= pos[r] + 1] scratch."""
    Hkv, hd = K.shape[1], K.shape[3]
    r, g = u // Hkv, u % Hkv
    G = H // Hkv
    j0 = max(0, pos[r] + 1 - window) if window > 0 else 0
    scale = np.float32(1.0 / np.sqrt(hd))
    for hh in range(g * G, (g + 1) * G):
        _attend(t[r, hh * hd:(hh + 1) * hd], K[slot[r], g, j0:], V[slot[r], g, j0:], pos[r] + 1 - j0, scale, p,
                a[r, hh * hd:(hh + 1) * hd])


@njit(**OPTS)
def _attend_units(ctl, u0, u1):
    """Units u0 .. u1 - 1 of the attention job in the descriptor (a helper's claim; see _attention)."""
    ta, tw, aa, ka, va = ctl[DESC + 1], ctl[DESC + 2], ctl[DESC + 3], ctl[DESC + 4], ctl[DESC + 5]
    pa, sa, H, Hkv = ctl[DESC + 6], ctl[DESC + 7], ctl[DESC + 8], ctl[DESC + 9]
    hd, L, B, n = ctl[DESC + 10], ctl[DESC + 11], ctl[DESC + 12], ctl[DESC + 13]
    window = ctl[DESC + 14]
    t, a = carray(_f32_at(ta), (n, tw)), carray(_f32_at(aa), (n, H * hd))
    K, V = carray(_f32_at(ka), (B, Hkv, L, hd)), carray(_f32_at(va), (B, Hkv, L, hd))
    pos, slot = carray(_i64_at(pa), n), carray(_i64_at(sa), n)
    p = np.empty(L, np.float32)
    for u in range(u0, u1):
        _attend_unit(t, a, K, V, pos, slot, H, window, u, p)


@njit(**OPTS)
def _attention(ctl, pooled, t, a, K, V, pos, slot, H, window, p):
    """Every row's attention of one layer (see _attend_unit), units shared with the helpers (as the panels
    of a matrix product) when there is enough of it: a batch of serve's streams, not one sequence's step.
    (The claim word counts units in 16 bits: more than 0xFFFF run on the calling thread.)"""
    n, Hkv, hd = t.shape[0], K.shape[1], K.shape[3]
    units = n * Hkv
    work = 0
    for r in range(n):
        work += (pos[r] + 1) * H * hd
    if pooled and 2 <= units <= 0xFFFF and work >= POOLED_ATTENTION and t.flags.c_contiguous and a.flags.c_contiguous \
            and K.flags.c_contiguous and V.flags.c_contiguous and pos.flags.c_contiguous and slot.flags.c_contiguous:
        ctl[DESC], ctl[DESC + 1], ctl[DESC + 2], ctl[DESC + 3] = ATTEND, t.ctypes.data, t.shape[1], a.ctypes.data
        ctl[DESC + 4], ctl[DESC + 5], ctl[DESC + 6], ctl[DESC + 7] = K.ctypes.data, V.ctypes.data, \
            pos.ctypes.data, slot.ctypes.data
        ctl[DESC + 8], ctl[DESC + 9], ctl[DESC + 10], ctl[DESC + 11] = H, Hkv, hd, K.shape[2]
        ctl[DESC + 12], ctl[DESC + 13], ctl[DESC + 14] = K.shape[0], n, window
        _run_pooled(ctl, units)
        return
    for u in range(units):
        _attend_unit(t, a, K, V, pos, slot, H, window, u, p)


# ---- the kernels ---------------------------------------------------------------------------------
@njit(**OPTS)
def gemv(ctl, pooled, W, X, out):
    """X [n, in] float32 @ Wᵀ, W [out, in] in kernel form (`pack` of float32, or float16 bits as uint16)
    -> [n, out] float32."""
    Y = np.empty((X.shape[0], out), np.float32)
    _gemv(ctl, pooled, W, X, Y, False)
    return Y


@njit(inline="always", **OPTS)
def _add_bias(y, b):
    """y [n, m] += b [m] on every row (nothing when b is empty: no bias)."""
    if b.shape[0]:
        for r in range(y.shape[0]):
            for j in range(y.shape[1]):
                y[r, j] += b[j]


@njit(**OPTS)
def _residual(ctl, pooled, W, b, inp, x, o, post, nb, eps, h):
    """x += post(inp @ Wᵀ + b) (W a segmented matrix, see SEG): a sub-block's output projection added to the
    residual stream x [n, d], with the
    architecture's post norm (post: its weight; nb its bias) when it has one (o, h [n, d] scratch)."""
    if post.shape[0] == 0 and b.shape[0] == 0:
        _product(ctl, pooled, W, inp, x, True)  # x += inp @ Wᵀ, no temporary
        return
    _product(ctl, pooled, W, inp, o, False)
    _add_bias(o, b)
    if post.shape[0]:
        _norm(o, post, nb, eps, h)
        x += h
    else:
        x += o


@njit(**OPTS)
def step(ctl, pooled, x0, pos, slot, D, eps, n_heads, kc, vc, cos, sin, last_only):
    """The forward of rows x0 [n, d] (the new tokens' looked-up embeddings, forward.embed), row r at position
    pos[r] of cache row slot[r] -> final normed hidden states [n|1, d], for every architecture (D: `Weights`,
    what the model's record in arch.py chose). One sequence: slot all 0, pos = L0, L0+1, ..; a batch of
    sequences: one row each.

    kc, vc [layers, B, Hkv, max_len, hd]: row r writes its key and value at (slot[r], pos[r]) and attends
    to positions 0 .. pos[r] of its slot (a windowed layer: the last D.window[l] of them; all rows write
    before any attends). cos, sin [kinds, m, hd/2]: the RoPE tables of positions 0 .. m-1, m > every pos[r]
    (cache.Rope.upto: not checked here), layer l's at D.rope[l] (-1: none)."""
    n, d = x0.shape
    n_layers, _, Hkv, _, hd = kc.shape
    H, F = n_heads, D.ffn
    Hhd = n_heads * hd
    for r in range(n):
        if pos[r] < 0 or pos[r] >= kc.shape[3] or slot[r] < 0 or slot[r] >= kc.shape[1]:
            raise IndexError("cache position or row out of range")
    x = x0.copy()
    h = np.empty((n, d), np.float32)
    o = np.empty((n, d), np.float32)                # a sub-block's output before its post norm
    t = np.empty((n, (H + 2 * Hkv) * hd), np.float32)  # q, k, v of the new rows
    a = np.empty((n, Hhd), np.float32)              # attention output
    gu = np.empty((n, D.mlp_in_width), np.float32)  # the MLP's input products (gated: [gate | up])
    s = np.empty((n, F), np.float32)
    p = np.empty(pos.max() + 1, np.float32)         # attention probabilities
    rot = np.empty(hd, np.float32)
    for l in range(n_layers):
        _norm(x, D.norms[l, 0], D.norm_biases[l, 0], eps, h)
        _product(ctl, pooled, D.mats[l, 0, :D.segments[l, 0]], h, t, False)
        _add_bias(t, D.qkv_bias[l])
        k_ = D.rope[l]
        for r in range(n):  # q/k norms, RoPE; the new keys and values go into the cache
            for hh in range(H + Hkv):
                base = hh * hd
                if D.qk_norms.shape[2]:
                    _head_norm(t[r], base, hd, D.qk_norms[l, 0 if hh < H else 1], eps)
                if k_ >= 0:
                    _rope(t[r], base, hd, cos[k_], sin[k_], pos[r], rot)
                    t[r, base:base + hd] = rot
            for g in range(Hkv):
                kc[l, slot[r], g, pos[r]] = t[r, Hhd + g * hd:Hhd + (g + 1) * hd]
                vc[l, slot[r], g, pos[r]] = t[r, Hhd + (Hkv + g) * hd:Hhd + (Hkv + g + 1) * hd]
        # Past the last layer's keys and values only the rows returned matter: with last_only, the last
        # row alone goes on (a prompt's or a window refill's other rows skip ~1/layers of their work).
        f = n - 1 if last_only and l == n_layers - 1 else 0
        _attention(ctl, pooled, t[f:], a[f:], kc[l], vc[l], pos[f:], slot[f:], H, D.window[l], p)
        _residual(ctl, pooled, D.mats[l, 1, :D.segments[l, 1]], D.wo_bias[l], a[f:], x[f:], o[f:],
                  D.norms[l, 2, :D.post], D.norm_biases[l, 2], eps, h[f:])
        _norm(x[f:], D.norms[l, 1], D.norm_biases[l, 1], eps, h[f:])
        _product(ctl, pooled, D.mats[l, 2, :D.segments[l, 2]], h[f:], gu[f:], False)
        _add_bias(gu[f:], D.mlp_in_bias[l])
        half = D.gelu_half[l]
        for r in range(f, n):  # the activation: SwiGLU silu(g)·u, GeGLU gelu(g)·u, or GELU
            for j in range(F):
                g_ = gu[r, j]
                if D.mlp == 0:
                    s[r, j] = g_ / (np.float32(1.0) + vexp(-g_)) * gu[r, F + j]
                else:
                    a_ = _gelu_half(g_) if half else _gelu(g_)
                    s[r, j] = a_ * gu[r, F + j] if D.mlp == 1 else a_
        _residual(ctl, pooled, D.mats[l, 3, :D.segments[l, 3]], D.mlp_out_bias[l], s[f:], x[f:], o[f:],
                  D.norms[l, 3, :D.post], D.norm_biases[l, 3], eps, h[f:])
    first = n - 1 if last_only else 0
    out = np.empty((n - first, d), np.float32)
    _norm(x[first:], D.norm, D.norm_bias, eps, out)
    return out


# ---- the threads ---------------------------------------------------------------------------------
class _Pool:
    """Helper threads for the kernels' matrix products (`_gemv`): `threads - 1` Python threads, each
    running `_serve` (numba, without the GIL) while there is work, asleep on an Event after a few idle
    milliseconds. A call takes the pool if no other thread holds it, else runs alone (same result)."""

    PATIENCE = 40000  # idle polls (the first SPIN spinning, then yielding: ms) before a helper sleeps

    def __init__(self):
        self.ctl = np.zeros(64, np.int64)
        self.lock = threading.Lock()
        self.threads = max(1, min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1))
        self.wakes: list[threading.Event] = []
        self.running: list[bool] = []  # helper i is in _serve (or about to be)

    def _helper(self, i: int) -> None:
        while True:
            self.wakes[i].wait()
            self.wakes[i].clear()
            if self.ctl[STOP] == 2:
                return
            _serve(self.ctl, self.PATIENCE)
            self.running[i] = False

    def acquire(self) -> bool:
        """Take the pool for one call, waking the helpers that sleep; False: run alone."""
        if self.threads < 2 or not self.lock.acquire(blocking=False):
            return False
        while len(self.wakes) < self.threads - 1:
            self.wakes.append(threading.Event())
            self.running.append(False)
            threading.Thread(target=self._helper, args=(len(self.wakes) - 1,), daemon=True,
                             name="nanoeuler-decode").start()
        for i in range(self.threads - 1):
            if not self.running[i]:
                self.running[i] = True
                self.wakes[i].set()
        return True

    def release(self) -> None:
        self.lock.release()

    def set_threads(self, n: int) -> None:
        """Use n threads (the caller's and n - 1 helpers) from the next call on."""
        with self.lock:
            self.ctl[STOP] = 1  # every helper goes to sleep; the next call wakes those it needs
            while any(self.running):
                threading.Event().wait(0.001)
            self.ctl[STOP] = 0
            self.threads = max(1, int(n))

    def close(self) -> None:
        self.ctl[STOP] = 2
        for wake in self.wakes:
            wake.set()


_POOL = _Pool()
atexit.register(_POOL.close)
if hasattr(os, "register_at_fork"):  # a forked child has none of the parent's threads: start afresh
    os.register_at_fork(after_in_child=lambda: globals().__setitem__("_POOL", _Pool()))


def start_helpers() -> None:
    """Start the helper threads now rather than at the first product: each loads its compiled loop (`_serve`,
    from numba's disk cache, ~0.1 s) while the caller goes on (packing a model's weights), then sleeps."""
    if _POOL.acquire():
        _POOL.release()


def set_threads(n: int) -> None:
    """Decode with n threads (default: the cores this process may use, at most 8)."""
    _POOL.set_threads(n)


def get_threads() -> int:
    return _POOL.threads


# ---- the Python side -----------------------------------------------------------------------------
class Weights(NamedTuple):
    """What `step` reads: every layer's four matrices segmented (see SEG; each segment's kernel form is `pack` of
    float32, float16 bits (uint16) or a block type's (qkernels.pack), kept alive by the layout), and its vectors
    stacked over the layers. What an architecture lacks is an empty array (a bias [layers, 0], LayerNorm biases
    [layers, 4, 0], q/k norms [layers, 2, 0])."""
    mats: np.ndarray          # [layers, 4, 3, SEG] int64: qkv, wo, mlp_in, mlp_out, each of up to 3 segments
    segments: np.ndarray      # [layers, 4] int64: how many segments each has
    ffn: int                  # F, the activation's width
    qkv_bias: np.ndarray      # [layers, (H + 2·Hkv)·hd] or [layers, 0]
    wo_bias: np.ndarray       # [layers, d] or [layers, 0]
    mlp_in_bias: np.ndarray   # [layers, 2F | F] or [layers, 0]
    mlp_out_bias: np.ndarray  # [layers, d] or [layers, 0]
    norms: np.ndarray         # [layers, 4, d] float32: attn_norm, ffn_norm, attn_post_norm, ffn_post_norm
    norm_biases: np.ndarray   # [layers, 4, d] (LayerNorm) or [layers, 4, 0]
    qk_norms: np.ndarray      # [layers, 2, hd] or [layers, 2, 0]
    norm: np.ndarray          # [d] float32
    norm_bias: np.ndarray     # [d] or [0]
    post: int                 # d with post norms, else 0 (norms[:, 2:, :post] is empty)
    mlp: int                  # 0 SwiGLU, 1 GeGLU, 2 GELU
    mlp_in_width: int         # 2F (gated) or F
    gelu_half: np.ndarray     # [layers] bool: GELU through float16 as llama.cpp (the MLP's weights in blocks)
    window: np.ndarray        # [layers] int64: each layer's window (0: none)
    rope: np.ndarray          # [layers] int64: each layer's RoPE table (cache.KVCache.kind; -1: none)
    forms: np.ndarray         # uint8: the buffer the segments point into (held here: alive as long as these are)


MLP_KINDS = {"swiglu": 0, "geglu": 1, "gelu": 2}


def segment(kind: int, Wk: np.ndarray, out: int) -> list[int]:
    """The SEG row of a kernel form Wk of `kind` with `out` outputs (Wk must stay alive while it is used)."""
    return [kind, Wk.ctypes.data, out, Wk.shape[0]]


def weights(cfg, W: dict, segments: list, forms: np.ndarray) -> Weights:
    """The fused step's weights from the inference layout W (forward.fuse_weights), per layer the four
    matrices' segments (lists of `segment` rows), and the buffer of their kernel forms."""
    from .cache import new_cache
    L, d, f32 = cfg.n_layers, cfg.dim, np.float32
    p = [f"layers.{i}." for i in range(L)]
    mats, counts = np.zeros((L, 4, 3, SEG), np.int64), np.zeros((L, 4), np.int64)
    for i, layer in enumerate(segments):
        for m, segs in enumerate(layer):
            counts[i, m] = len(segs)
            mats[i, m, :len(segs)] = segs

    def biases(m):
        return np.array([W[q + m + ".bias"] for q in p], f32) if W[p[0] + m + ".bias"] is not None else np.zeros((L, 0), f32)

    a = cfg.spec
    names = ("attn_norm", "ffn_norm", "attn_post_norm", "ffn_post_norm")
    norms = np.ones((L, 4, d), f32)
    norm_biases = np.zeros((L, 4, d if a.norm == "layer" else 0), f32)
    for i, q in enumerate(p):
        for j, name in enumerate(names):
            if q + name in W:
                norms[i, j], b = W[q + name]
                if b is not None:
                    norm_biases[i, j] = b
    qk = np.array([[W[q + "attn.q_norm"][0], W[q + "attn.k_norm"][0]] for q in p], f32) if a.qk_norm \
        else np.zeros((L, 2, 0), f32)
    nw, nb = W["norm"]
    return Weights(mats, counts, cfg.ffn_hidden, biases("qkv"), biases("wo"), biases("mlp_in"), biases("mlp_out"),
                   norms, norm_biases, qk, nw, nb if nb is not None else np.zeros(0, f32), d if a.post_norms else 0,
                   MLP_KINDS[a.mlp], cfg.ffn_hidden * (2 if a.gated else 1), mats[:, 2, 0, 0] >= QUANT,
                   np.array([cfg.window(i) for i in range(L)], np.int64), new_cache(cfg, 1, 1).kind, forms)


def forward(cfg, D: Weights, x: np.ndarray, k: np.ndarray, v: np.ndarray, L0: int, cos: np.ndarray,
            sin: np.ndarray, last_only: bool, slot: int = 0) -> np.ndarray:
    """Rows x [n, d] (embedded tokens) at positions L0.. of one sequence, cache row `slot` of k, v
    [layers, B, Hkv, max_len, hd] -> final normed hidden states [n|1, d]."""
    n = len(x)
    return forward_rows(cfg, D, x, np.arange(L0, L0 + n), np.full(n, slot, np.int64), k, v, cos, sin, last_only)


def forward_rows(cfg, D: Weights, x: np.ndarray, pos: np.ndarray, slot: np.ndarray, k: np.ndarray,
                 v: np.ndarray, cos: np.ndarray, sin: np.ndarray, last_only: bool = False) -> np.ndarray:
    """Rows x [n, d] (embedded tokens), row r at position pos[r] of cache row slot[r] of k, v
    [layers, B, Hkv, max_len, hd] (one sequence, or one row per sequence as the batcher steps) -> final normed
    hidden states [n|1, d]."""
    return on_pool(step, np.ascontiguousarray(x, dtype=np.float32), np.ascontiguousarray(pos, dtype=np.int64),
                   np.ascontiguousarray(slot, dtype=np.int64), D, np.float32(cfg.norm_eps), cfg.n_heads, k, v,
                   cos, sin, last_only)


def matvec(Wk: np.ndarray, X: np.ndarray, out: int) -> np.ndarray:
    """X [n, in] float32 @ Wᵀ, W [out, in] in kernel form Wk = pack(W) (float32 or float16 bits) -> [n, out],
    on the pool's threads."""
    return on_pool(gemv, Wk, np.ascontiguousarray(X, dtype=np.float32), out)


def round_rows(cfg, D: Weights, x: np.ndarray, pos: np.ndarray, slot: np.ndarray, k: np.ndarray, v: np.ndarray,
               cos: np.ndarray, sin: np.ndarray, head0: np.ndarray) -> tuple:
    """A speculative round's model work in one compiled call (`_round`): rows x [n, d] (embedded tokens) of one
    sequence -> (h [n, d], head-0 logits [n, V], their argmax [n])."""
    return on_pool(_round, np.ascontiguousarray(x, dtype=np.float32), pos, slot, D, np.float32(cfg.norm_eps),
                   cfg.n_heads, k, v, cos, sin, head0, cfg.vocab_size)


def on_pool(kernel, *args):
    """kernel(ctl, pooled, *args) on the pool: its helper threads share the work where no other call holds it.
    (A plain function: a contextlib context manager would cost many times more a call.)"""
    pool = _POOL
    held = pool.acquire()
    try:
        return kernel(pool.ctl, held, *args)
    finally:
        if held:
            pool.release()


@njit(**OPTS)
def _round(ctl, pooled, x0, pos, slot, D, eps, n_heads, kc, vc, cos, sin, head0, V):
    """A speculative round's model work in one compiled call: `step` over tokens [n] (hidden states
    h [n, d], all rows), head 0's logits [n, V] and their argmax [n] (the same kernels as a plain step's
    forward + matvec + argmax, so the same numbers) -> (h, logits, best)."""
    h = step(ctl, pooled, x0, pos, slot, D, eps, n_heads, kc, vc, cos, sin, False)
    n = h.shape[0]
    logits = np.empty((n, V), np.float32)
    _gemv(ctl, pooled, head0, h, logits, False)
    best = np.empty(n, np.int64)
    for r in range(n):
        best[r] = np.argmax(logits[r])
    return h, logits, best
