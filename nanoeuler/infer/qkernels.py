"""Matrix products with block-quantized weights (Q8_0, Q4_0, Q4_1: quant.py) in integers, for decoding and
prompts: Y [n, out] (+)= X [n, in] @ Wᵀ with W kept in its 8 or 4 bits.

As llama.cpp does, the activations are quantized too, per block of 32 to 8 bits (`quantize_x`: xq int8, a
float16 scale dx and the block sum sx = Σ xq), and each block's dot product is an integer one, made by
AVX512-VNNI's `vpdpbusd` (16 lanes, each += 4 unsigned bytes x 4 signed bytes), then scaled:

    y[o] = Σ_blocks dw·dx·(Σ_i qw_i·xq_i)              Q8_0: qw = q ∈ -127..127   Q4_0: qw = q - 8, q ∈ 0..15
    y[o] = Σ_blocks dw·dx·(Σ_i q_i·xq_i) + mw·dx·sx    Q4_1: w = dw·q + mw

`vpdpbusd` wants the weights unsigned: they are stored as u = q + 128 (Q8_0) or the 4-bit q itself, and
the offset comes back as Σ qw·xq = Σ u·xq - offset·sx (integers, exact). So a quantized product equals the
float product of the dequantized weights and the dequantized 8-bit activations to float32 rounding
(tests/test_quant.py), and is as close to the float32 product as 8-bit activations allow.

Kernel form (`pack`, made once at load from the GGUF bytes): panels of PANEL = 64 outputs, each one stream
block after block: per block the 64 float16 scales dw (Q4_1: then the 64 minimums), then the integers in
4 vectors of 16 outputs, each vector in sub-vectors of 64 bytes that hold 4 consecutive inputs per output
(the 4 bytes `vpdpbusd` multiplies in one lane):

    Q8_0  byte [v, s, j, k]   = q[16v + j, 4s + k] + 128                       s < 8   (2176 bytes a block)
    Q4_x  byte [v, s, j, k]   = q[16v + j, 8s + k] | q[16v + j, 8s + 4 + k] << 4  s < 4   (1152 | 1280)

A panel runs for up to MAX_R rows at once (one pass over its bytes); every output is computed whole by one
thread with the same code, so results do not depend on the thread count nor on which rows share a pass.
Bytes per weight as llama.cpp's files: Q8_0 1.0625, Q4_0 0.5625, Q4_1 0.625 (float32 4, float16 2): the
decode step reads every weight once, so its speed is these bytes.
"""
from __future__ import annotations

import functools

import numpy as np
from llvmlite import ir
from numba import carray, njit, types
from numba.extending import intrinsic

from ..errors import UserError
from .quant import QK, WTYPES

LANES = 16            # int32 / float32 lanes of one AVX-512 vector: outputs per vector
VECS = 4              # vectors of outputs per panel
PANEL = LANES * VECS  # outputs per panel, the unit of work a thread takes
MAX_R = 4             # rows of X sharing one pass over a panel
KINDS = {"q8_0": 3, "q4_0": 4, "q4_1": 5}  # kernel kinds (kernels.py's: 0 float32, 1 float16, 2 attention)
OPTS = dict(cache=True, nogil=True, error_model="numpy")


def cpu_has_vnni() -> bool:
    """Whether the CPU numba compiles for has AVX512-VNNI (`vpdpbusd`) and AVX512BW."""
    import llvmlite.binding as ll
    f = ll.get_host_cpu_features()
    return bool(f.get("avx512vnni", False) and f.get("avx512bw", False))


VNNI = cpu_has_vnni()  # what the kernels are compiled for (without it: portable IR, slow, never run by choice)
AVAILABLE = VNNI       # whether quantized decoding is offered (tests set it False to see the refusal)


def require() -> None:
    """Refuse quantized decoding on a CPU without AVX512-VNNI (one line; no silent slow path)."""
    if not AVAILABLE:
        raise UserError("q8_0 / q4_0 / q4_1 decoding needs a CPU with AVX512-VNNI (vpdpbusd), which this one "
                        "lacks; use --dtype float16 or float32")


# ---- the kernel form ------------------------------------------------------------------------------------
def _layout(kind: int) -> tuple[int, int, int]:
    """(header bytes, integer bytes, offset) of one block of a panel: scales first, then the integers."""
    if kind == 3:
        return 2 * PANEL, PANEL * QK, 128
    return (2 if kind == 4 else 4) * PANEL, PANEL * QK // 2, 8 if kind == 4 else 0


def pack(B: np.ndarray, name: str, n_in: int) -> np.ndarray:
    """The kernel form of a quantized matrix: B its GGUF bytes [..., out, n_in / 32 · bytes per block]
    (quant.py) -> uint8 [..., ceil(out / PANEL), n_in / 32, block bytes] (see the module docstring; zero rows
    pad the last panel).  pack(quantize(W, "q8_0"), "q8_0", W.shape[-1])"""
    if B.ndim > 2:
        return np.stack([pack(b, name, n_in) for b in B])
    kind, t = KINDS[name], WTYPES[name]
    O, nb = B.shape[0], n_in // QK
    P = -(-O // PANEL)
    blocks = np.zeros((P * PANEL, nb, t.nbytes), np.uint8)
    blocks[:O] = B.reshape(O, nb, t.nbytes)
    scales = 2 if name == "q4_1" else 1
    head = blocks[..., :2 * scales].reshape(P, PANEL, nb, scales, 2).transpose(0, 2, 3, 1, 4)  # [P, nb, sc, 64, 2]
    if name == "q8_0":
        u = blocks[..., 2:] ^ np.uint8(128)                                  # int8 q -> q + 128
        body = u.reshape(P, VECS, LANES, nb, 8, 4).transpose(0, 3, 1, 4, 2, 5)  # [P, nb, v, s, j, k]
    else:
        q = np.concatenate([blocks[..., 2 * scales:] & np.uint8(15), blocks[..., 2 * scales:] >> np.uint8(4)], -1)
        q = q.reshape(P, VECS, LANES, nb, 4, 2, 4)                          # input 8s + 4h + k
        body = (q[..., 0, :] | (q[..., 1, :] << np.uint8(4))).transpose(0, 3, 1, 4, 2, 5)
    return np.ascontiguousarray(np.concatenate([head.reshape(P, nb, -1), body.reshape(P, nb, -1)], axis=2))


# ---- one panel, in LLVM IR --------------------------------------------------------------------------------
I8, I16, I32, I64, F32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64), ir.FloatType()
IVEC, FVEC, HVEC = ir.VectorType(I32, LANES), ir.VectorType(F32, LANES), ir.VectorType(I16, LANES)


def ir_at(builder, ptr, off, ty):
    """A pointer to a `ty` at byte (or element) offset `off` of ptr."""
    return builder.bitcast(builder.gep(ptr, [off]), ty.as_pointer())


def ir_splat(builder, s, vty):
    """The scalar s in every lane of a vector of type vty."""
    v = builder.insert_element(ir.Constant(vty, ir.Undefined), s, ir.Constant(I32, 0))
    return builder.shuffle_vector(v, ir.Constant(vty, ir.Undefined), ir.Constant(IVEC, [0] * LANES))


def ir_halves(builder, bp, blk, at_byte):
    """The VECS vectors of a block's 64 float16 (scales or minimums) at byte at_byte of block blk, as float32."""
    out = []
    for v in range(VECS):
        bits = builder.load(ir_at(builder, bp, builder.add(blk, ir.Constant(I64, at_byte + 32 * v)), HVEC), align=2)
        out.append(builder.fpext(builder.bitcast(bits, ir.VectorType(ir.HalfType(), LANES)), FVEC))
    return out


def ir_close_loop(builder, i, acc, new, entry, n, again, out):
    """End a loop body: the counter phi i runs 0, 1, .. while < n, each accumulator phi of acc starts at zero
    (from the block entry) and carries its value in new; then branch back to `again` or on to `out`."""
    i1 = builder.add(i, ir.Constant(I64, 1))
    i.add_incoming(ir.Constant(I64, 0), entry)
    i.add_incoming(i1, builder.block)
    for a, a1 in zip(acc, new):
        a.add_incoming(ir.Constant(FVEC, [0.0] * LANES), entry)
        a.add_incoming(a1, builder.block)
    builder.cbranch(builder.icmp_signed("<", i1, n), again, out)
    builder.position_at_end(out)


def ir_function(builder, name, ret, args):
    mod = builder.module
    return mod.globals.get(name) or ir.Function(mod, ir.FunctionType(ret, args), name)


def ir_opaque(builder, a, zero, i: int):
    """a + (zero >> (56 + i)): the same value as a when zero < 2^56 (an address), but LLVM cannot prove the
    copies for different i equal, so loads from addresses made from them are not merged: a value used by
    several vectors is then loaded again where it is used (vpdpbusd's memory operand) instead of being held
    in a register across them (which spilled the accumulators to the stack)."""
    return builder.add(a, builder.lshr(zero, ir.Constant(I64, 56 + i)))


def ir_dot4(builder, acc, u, x, vnni: bool):
    """acc + per lane the dot product of 4 unsigned bytes of u and 4 signed bytes of x (<16 x i32> each):
    one `vpdpbusd`, or where the CPU lacks it the same in portable IR (widen, multiply, add the 4 products)
    so that the float kernels, which compile this path too, still compile there."""
    if vnni:
        return builder.call(ir_function(builder, "llvm.x86.avx512.vpdpbusd.512", IVEC, [IVEC] * 3), [acc, u, x])
    wide, bytes_ = ir.VectorType(I32, 4 * LANES), ir.VectorType(I8, 4 * LANES)
    p = builder.mul(builder.zext(builder.bitcast(u, bytes_), wide), builder.sext(builder.bitcast(x, bytes_), wide))
    for k in range(4):
        acc = builder.add(acc, builder.shuffle_vector(p, p, ir.Constant(IVEC, [4 * j + k for j in range(LANES)])))
    return acc


def ir_weights(builder, kind: int, bp, blk, v: int, hi16: bool = False) -> list:
    """Vector v of a panel's block at byte blk: 8 <16 x i32>, [u]: 16 outputs x the 4 unsigned bytes of
    inputs 4u .. 4u + 3 (Q4_x: each 64 bytes split into low and high nibbles, one and / shift + and each;
    hi16: the high nibbles left in place, 16 q, one and)."""
    head = _layout(kind)[0]
    if kind == 3:
        return [builder.load(ir_at(builder, bp, builder.add(blk, ir.Constant(I64, head + (v * 8 + u) * 64)), IVEC),
                             align=1) for u in range(8)]
    lo4, hi4, wv = ir.Constant(IVEC, [0x0F0F0F0F] * LANES), ir.Constant(IVEC, [-0x0F0F0F10] * LANES), []
    for s in range(4):
        at = builder.add(blk, ir.Constant(I64, head + (v * 4 + s) * 64))
        raw = builder.load(ir_at(builder, bp, at, IVEC), align=1)
        hi = builder.and_(raw, hi4) if hi16 else builder.and_(builder.lshr(raw, ir.Constant(IVEC, [4] * LANES)), lo4)
        wv += [builder.and_(raw, lo4), hi]
    return wv


def ir_row_dot(builder, start, wv, xp, at, chains: int, vnni: bool, hi16: bool = False):
    """start + Σ_u wv[u]·(x's 4 bytes at byte at + 4u of xp, broadcast): 8 `vpdpbusd` in `chains` independent
    chains (1 row: 2, even and odd u, to hide their latency), the x bytes loaded where used (vpdpbusd's
    memory operand). hi16: the odd u hold 16 q (ir_weights), their chain is exactly 16 times its sum."""
    ia = [start] + [ir.Constant(IVEC, [0] * LANES)] * (chains - 1)
    for u in range(8):
        xi = builder.load(ir_at(builder, xp, builder.add(at, ir.Constant(I64, 4 * u)), I32), align=1)
        ia[u % chains] = ir_dot4(builder, ia[u % chains], wv[u], ir_splat(builder, xi, IVEC), vnni)
    if hi16:
        ia[1] = builder.ashr(ia[1], ir.Constant(IVEC, [4] * LANES))
    return functools.reduce(builder.add, ia)


def _panel_intrinsic(kind: int, vnni: bool = VNNI):
    """An intrinsic (k, w, xq, xd, xs, t, nb, n_in) running one panel for k <= MAX_R rows, all addresses:

        t[r, j] = Σ_b dw[b, j]·xd[r, b]·(Σ_i u[b, j, i]·xq[r, 32b + i] - offset·xs[r, b])  (Q4_1: + mw·xd·xs)

    the panel at w (nb blocks, see `pack`), xq int8 [k, n_in], xd, xs float32 [k, nb], t [k, PANEL] float32.
    Per block and vector of 16 outputs: its integers are loaded once into 8 registers (Q4_x: split into
    nibbles) and each row makes a chain of 8 `vpdpbusd` against its activation bytes, broadcast from memory,
    starting from -offset·xs (the sum stays an exact integer), then one int -> float conversion and
    multiply-add. Only the k·VECS float accumulators and one vector's weights stay in registers (weights
    held for every vector at once, or x held across vectors, spilled: 84 against 126 GMAC/s at 4 rows).
    One loop per row count, chosen by a switch on k."""
    head, body, offset = _layout(kind)

    def loop(builder, rows, w, xq, xd, xs, t, nb, n_in):
        fma = ir_function(builder, f"llvm.fma.v{LANES}f32", FVEC, [FVEC] * 3)
        bp = builder.inttoptr(w, I8.as_pointer())
        xdp, xsp = builder.inttoptr(xd, F32.as_pointer()), builder.inttoptr(xs, F32.as_pointer())
        entry, body_ = builder.block, builder.append_basic_block(f"qpanel{rows}")
        builder.branch(body_)
        builder.position_at_end(body_)
        b = builder.phi(I64)
        acc = [builder.phi(FVEC) for _ in range(rows * VECS)]
        blk = builder.mul(b, ir.Constant(I64, head + body))
        dw = ir_halves(builder, bp, blk, 0)
        mw = ir_halves(builder, bp, blk, 2 * PANEL) if kind == 5 else None
        xat, start, dx, dxs = [], [], [], []
        for r in range(rows):
            xat.append(builder.add(builder.mul(ir.Constant(I64, r), n_in), builder.mul(b, ir.Constant(I64, QK))))
            rb = builder.add(builder.mul(ir.Constant(I64, r), nb), b)
            d, s = builder.load(builder.gep(xdp, [rb])), builder.load(builder.gep(xsp, [rb]))
            dx.append(ir_splat(builder, d, FVEC))
            dxs.append(ir_splat(builder, builder.fmul(d, s), FVEC) if kind == 5 else None)
            start.append(ir_splat(builder, builder.mul(builder.fptosi(s, I32), ir.Constant(I32, -offset)), IVEC))
        new = [None] * (rows * VECS)
        hi16 = rows == 1 and kind != 3  # one row: 2 ops per 64 nibble bytes, not 3
        for v in range(VECS):
            wv = ir_weights(builder, kind, bp, blk, v, hi16)
            xp = builder.inttoptr(ir_opaque(builder, xq, xd, v), I8.as_pointer())
            for r in range(rows):
                ia = ir_row_dot(builder, start[r], wv, xp, xat[r], 2 if rows == 1 else 1, vnni, hi16)
                a = builder.call(fma, [builder.sitofp(ia, FVEC), builder.fmul(dw[v], dx[r]), acc[r * VECS + v]])
                new[r * VECS + v] = builder.call(fma, [mw[v], dxs[r], a]) if kind == 5 else a
        ir_close_loop(builder, b, acc, new, entry, nb, body_, builder.append_basic_block(f"qpanel{rows}.out"))
        tp = builder.inttoptr(t, F32.as_pointer())
        for k, a in enumerate(new):
            builder.store(a, ir_at(builder, tp, ir.Constant(I64, k * LANES), FVEC), align=4)

    def codegen(context, builder, sig, args):
        k, rest = args[0], args[1:]
        done = builder.append_basic_block("qpanel.done")
        cases = [builder.append_basic_block(f"rows{rows}") for rows in range(1, MAX_R + 1)]
        switch = builder.switch(k, cases[0])
        for rows, case in enumerate(cases, 1):
            switch.add_case(ir.Constant(I64, rows), case)
            builder.position_at_end(case)
            loop(builder, rows, *rest)
            builder.branch(done)
        builder.position_at_end(done)
        return context.get_dummy_value()

    def typer(typingctx, k, w, xq, xd, xs, t, nb, n_in):
        return types.void(*[types.int64] * 8), codegen
    typer.__name__ = f"_qpanel{kind}{'' if vnni else '_portable'}"
    return intrinsic(typer)


_q8_0, _q4_0, _q4_1 = (_panel_intrinsic(kind) for kind in (3, 4, 5))


@njit(inline="always", **OPTS)
def _panel(kind, k, w, xq, xd, xs, t, nb, n_in):
    """t[:k] = the panel at w for k <= MAX_R rows (see _panel_intrinsic)."""
    if kind == 3:
        _q8_0(k, w, xq, xd, xs, t, nb, n_in)
    elif kind == 4:
        _q4_0(k, w, xq, xd, xs, t, nb, n_in)
    else:
        _q4_1(k, w, xq, xd, xs, t, nb, n_in)


@njit(inline="always", **OPTS)
def store_rows(Y, T, r, k, o0, m, add):
    """Y[r + q, o0 : o0 + m] (+)= T[q, :m] for q < k: a panel's outputs for k rows into their place."""
    for q in range(k):
        y = Y[r + q]
        if add:
            for j in range(m):
                y[o0 + j] += T[q, j]
        else:
            for j in range(m):
                y[o0 + j] = T[q, j]


# ---- activations ------------------------------------------------------------------------------------------
@intrinsic
def _round_half(typingctx, x):
    """x (float32) rounded to float16 and back: fptrunc then fpext."""
    def codegen(context, builder, sig, args):
        return builder.fpext(builder.fptrunc(args[0], ir.HalfType()), ir.FloatType())
    return types.float32(types.float32), codegen


@intrinsic
def _quantize_block(typingctx, x, q, d, s):
    """One block of 32 activations at address x (float32) -> q (int8 [32]), d, s (float32) at their addresses,
    as quant.quantize_x8 rounds them, in two 16-lane vectors: max |x| (exact in any order), one scalar 127 / max,
    a product and a round-to-even (vrndscaleps) per lane, the integers' sum. (The scalar loop numba made of it
    cost ~1 ns an activation, on the calling thread before the products share out.)"""
    def codegen(context, builder, sig, args):
        xa, qa, da, sa = args
        fv = [builder.load(ir_at(builder, builder.inttoptr(xa, F32.as_pointer()), ir.Constant(I64, 16 * h), FVEC),
                           align=4) for h in range(2)]
        fabs = ir_function(builder, f"llvm.fabs.v{LANES}f32", FVEC, [FVEC])
        top = builder.call(ir_function(builder, f"llvm.maxnum.v{LANES}f32", FVEC, [FVEC] * 2),
                           [builder.call(fabs, [fv[0]]), builder.call(fabs, [fv[1]])])
        amax = builder.call(ir_function(builder, f"llvm.vector.reduce.fmax.v{LANES}f32", F32, [FVEC]), [top])
        inv = builder.select(builder.fcmp_ordered(">", amax, ir.Constant(F32, 0.0)),
                             builder.fdiv(ir.Constant(F32, 127.0), amax), ir.Constant(F32, 0.0))
        rint = ir_function(builder, f"llvm.rint.v{LANES}f32", FVEC, [FVEC])
        total = ir.Constant(I32, 0)
        for h in range(2):
            qi = builder.fptosi(builder.call(rint, [builder.fmul(fv[h], ir_splat(builder, inv, FVEC))]), IVEC)
            builder.store(builder.trunc(qi, ir.VectorType(I8, LANES)),
                          ir_at(builder, builder.inttoptr(qa, I8.as_pointer()), ir.Constant(I64, 16 * h),
                                ir.VectorType(I8, LANES)), align=1)
            total = builder.add(total, builder.call(ir_function(builder, f"llvm.vector.reduce.add.v{LANES}i32", I32,
                                                                [IVEC]), [qi]))
        half = builder.fdiv(amax, ir.Constant(F32, 127.0))
        builder.store(builder.fpext(builder.fptrunc(half, ir.HalfType()), F32), builder.inttoptr(da, F32.as_pointer()))
        builder.store(builder.sitofp(total, F32), builder.inttoptr(sa, F32.as_pointer()))
        return context.get_dummy_value()
    return types.void(types.int64, types.int64, types.int64, types.int64), codegen


@njit(**OPTS)
def quantize_x(X, xq, xd, xs):
    """Rows X float32 [n, k] -> xq int8 [n, k], xd, xs float32 [n, k / 32] (quant.quantize_x8, in numba), each
    row contiguous, a block at a time (_quantize_block)."""
    n, k = X.shape
    if X.strides[1] != 4 or xq.strides[1] != 1 or xd.strides[1] != 4 or xs.strides[1] != 4:
        raise ValueError("quantize_x needs rows of contiguous elements")
    for r in range(n):
        x, q = X.ctypes.data + r * X.strides[0], xq.ctypes.data + r * xq.strides[0]
        d, s = xd.ctypes.data + r * xd.strides[0], xs.ctypes.data + r * xs.strides[0]
        for b in range(k // QK):
            _quantize_block(x + b * QK * 4, q + b * QK, d + b * 4, s + b * 4)


# ---- the product ------------------------------------------------------------------------------------------
@intrinsic
def _f32_at(typingctx, addr):
    def codegen(context, builder, sig, args):
        return builder.inttoptr(args[0], ir.PointerType(ir.FloatType()))
    return types.CPointer(types.float32)(types.int64), codegen


STRIDES = tuple(sum(_layout(k)[:2]) if k in KINDS.values() else 0 for k in range(6))  # bytes of a panel's block


@njit(**OPTS)
def gemv_panel(kind, Wa, xqa, xda, xsa, Ya, n, O, I, add, p, T):
    """Outputs p·PANEL .. (at most O) of Y (+)= X @ Wᵀ for every row, all addresses: panel p of W's kernel
    form at Wa (`pack`), X quantized by `quantize_x` (xq int8 [n, I], xd, xs float32 [n, I / 32]), Y [n, O]
    float32; rows MAX_R at a time, each group one pass over the panel. T [MAX_R, PANEL] float32 scratch."""
    nb = I // QK
    w = Wa + p * nb * STRIDES[kind]
    o0 = p * PANEL
    m = min(PANEL, O - o0)
    Y = carray(_f32_at(Ya), (n, O))
    r = 0
    while r < n:
        k = min(MAX_R, n - r)
        _panel(kind, k, w, xqa + r * I, xda + r * nb * 4, xsa + r * nb * 4, T.ctypes.data, nb, I)
        store_rows(Y, T, r, k, o0, m, add)
        r += k


@njit(**OPTS)
def panels(kind, W, xq, xd, xs, Y, add, p0, p1):
    """Panels p0 .. p1 - 1 of Y (+)= X @ Wᵀ (see gemv_panel), arrays C-contiguous."""
    T = np.empty((MAX_R, PANEL), np.float32)
    for p in range(p0, p1):
        gemv_panel(kind, W.ctypes.data, xq.ctypes.data, xd.ctypes.data, xs.ctypes.data, Y.ctypes.data, Y.shape[0],
                   Y.shape[1], xq.shape[1], add, p, T)
