"""Matrix products with block-quantized weights (quant.py: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) in
integers, for decoding and prompts: Y [n, out] (+)= X [n, in] @ Wᵀ with W kept in its 4 to 8 bits.

As llama.cpp does, the activations are quantized too (`quantize_x`), to 8 bits, in the blocks llama.cpp pairs
with the weight type (its `vec_dot_type`): blocks of 32 with a float16 scale for the 32-weight types (Q8_0,
and Q8_1 for Q4_1 / Q5_1, whose block sums d·Σq are float16 too), blocks of 256 with a float32 scale and sums
per 16 for the K types (Q8_K). Each product of 4 weights and 4 activations is an integer one, made by
AVX512-VNNI's `vpdpbusd` (16 lanes, each += 4 unsigned bytes x 4 signed bytes), then:

    32-weight types   y[o] = Σ_b dw·dx·(Σ_i qw_i·xq_i)  (+ mw·sx: Q4_1, Q5_1; sx Q8_1's d·Σq)  qw = q - offset
    Q4_K, Q5_K        y[o] = Σ_B dx·(dw·Σ_j sc_j·(Σ_i∈j q_i·xq_i) - dmin·Σ_j mn_j·sx_j)   j: 8 sub-blocks
    Q6_K              y[o] = Σ_B dx·dw·Σ_j sc_j·(Σ_i∈j qw_i·xq_i)                          j: 16 sub-blocks

`vpdpbusd` wants the weights unsigned: they are stored as u = q (Q8_0: q + 128) and the offset comes back
as Σ qw·xq = Σ u·xq - offset·sx (sx: the activations' sum over the block or sub-block; integers, exact).
Inside a K super-block everything is an exact int32: each sub-block's dot times its 6- or 8-bit scale
(`vpmulld`), the minimums' Σ_j mn_j·sx_j by `vpdpwssd` (pairs of int16: mn_j zero-extended, sx_j the
activations' sums per 32, which fit in 16 bits); then one conversion to float per super-block. So a
quantized product equals the float product of the dequantized weights and the dequantized 8-bit
activations to float32 rounding (Q4_1, Q5_1: their minimums times Q8_1's float16 sums; tests/test_quant.py).

Kernel form (`pack`, made once at load from the GGUF bytes): panels of PANEL = 64 outputs = 4 vectors of
16. The integers of 16 outputs x 32 inputs (a "group") are 8 sub-vectors u of 64 bytes, lane j holding
inputs 4u .. 4u + 3 of output j (the 4 bytes `vpdpbusd` multiplies in one lane):

    8 bits   byte [u, j, k] = q[j, 4u + k]                                    (512 bytes)
    4 bits   byte [s, j, k] = q[j, 8s + k] | q[j, 8s + 4 + k] << 4   s < 4    (256 bytes: u = 2s, 2s + 1)
    5 bits   the 4 bits' bytes of the low nibbles, then a plane of 8 x 64 bits: bit 4j + k of word u = bit 4
             of q[j, 4u + k], OR-ed in as 16 by one masked move (`vpmovm2b`-like select)   (320 bytes)
    6 bits   the same with two planes (bits 4 and 5)                                          (384 bytes)

    32-weight types: panel [blocks][64 float16 d][64 float16 m: Q4_1, Q5_1][vector v: one group]
        (block bytes Q8_0 2176, Q4_0 1152, Q4_1 1280, Q5_0 1408, Q5_1 1536)
    K types: panel [vector v: one stream][super-blocks][strip header][8 groups], the header of 16 outputs:
        d [16] float16; Q4_K, Q5_K: dmin [16] float16, sc [8 j][16] uint8, mn [4 t][16][2] uint8 (mn_2t,
        mn_2t+1 side by side: vpdpwssd's pair); Q6_K: sc [16 j][16] int8
        (super-block bytes for the panel Q4_K 9472, Q5_K 11520, Q6_K 13440)

A 32-weight panel runs block after block with its 4 x rows float accumulators in registers; a K panel one
vector (16 outputs) at a time, its stream super-block after super-block (its rows' int32 sums, float
accumulators and one group's weights fit the 32 registers). Either runs up to MAX_R rows per pass; every
output is computed whole by one thread with the same code, so results depend neither on the thread count
nor on which rows share a pass. Bytes per weight are the file's (Q4_K, Q5_K: + 4 bytes per 256 weights, their
6-bit scales and minimums kept as bytes): the decode step reads every weight once.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np
from llvmlite import ir
from numba import carray, njit, types
from numba.extending import intrinsic

from ..errors import UserError
from .quant import QK, QK_K, WTYPES, block_types, unpack

LANES = 16            # int32 / float32 lanes of one AVX-512 vector: outputs per vector
VECS = 4              # vectors of outputs per panel
PANEL = LANES * VECS  # outputs per panel, the unit of work a thread takes
MAX_R = 4             # rows of X sharing one pass over a panel
# kernel kinds, from the weight types' rows (gemv.py's: 0 float32, 1 float16; pool.py's: 2 attention); from K_KINDS on,
# 256-weight super-blocks (activations Q8_K); Q8_1: the kinds whose activations keep block sums d·Σq in float16
KINDS = {n: WTYPES[n].kind for n in block_types()}
K_KINDS = min(KINDS[n] for n in KINDS if WTYPES[n].activations == "q8_k")
Q8_1 = tuple(KINDS[n] for n in KINDS if WTYPES[n].activations == "q8_1")
OPTS = dict(cache=True, nogil=True, error_model="numpy")


def cpu_isa() -> str:
    """The integer products the CPU numba compiles for offers: "vnni" (AVX512-VNNI with AVX512BW: `vpdpbusd`),
    "avx2" (`vpmaddubsw`, `vpmaddwd`), or "portable" (neither: plain IR, slow, compiled but never run by choice)."""
    import llvmlite.binding as ll
    f = ll.get_host_cpu_features()
    if f.get("avx512vnni", False) and f.get("avx512bw", False):
        return "vnni"
    return "avx2" if f.get("avx2", False) else "portable"


ISA = cpu_isa()                # what the kernels are compiled for
AVAILABLE = ISA != "portable"  # whether quantized decoding is offered (tests set it False to see the refusal)


def require() -> None:
    """Refuse quantized decoding on a CPU with neither AVX2 nor AVX512-VNNI (one line; no silent slow path)."""
    if not AVAILABLE:
        raise UserError("block-quantized decoding (q8_0, q4_0, ...) needs a CPU with AVX2 or AVX512-VNNI, which "
                        "this one lacks; use --dtype float16 or float32")


# ---- the kernel form ------------------------------------------------------------------------------------
class Geometry(NamedTuple):
    """How a kind's panel is laid out (see the module docstring)."""
    block: int    # inputs per block (32) or super-block (256)
    bits: int     # bits of a weight's integer
    offset: int   # qw = u - offset
    minimum: str  # "": none, "m": a float16 minimum per block (Q4_1, Q5_1), "k": dmin·mn_j (Q4_K, Q5_K)
    subs: int     # scales per super-block (K types), 1 otherwise
    signed: bool  # the scales are int8 (Q6_K), else uint8
    head: int     # bytes before the groups: a block's scales (32-weight types), a strip's header (K types)
    group: int    # bytes of one group (16 outputs x 32 inputs)

    @property
    def stride(self) -> int:
        """Bytes of one block (super-block) of a whole panel."""
        if self.block == QK:
            return self.head + VECS * self.group
        return VECS * (self.head + self.block // QK * self.group)


def _geometry(name: str) -> Geometry:
    bits = {"q8_0": 8, "q4_0": 4, "q4_1": 4, "q5_0": 5, "q5_1": 5, "q4_k": 4, "q5_k": 5, "q6_k": 6}[name]
    offset = {"q8_0": 128, "q4_0": 8, "q5_0": 16, "q6_k": 32}.get(name, 0)
    minimum = {"q4_1": "m", "q5_1": "m", "q4_k": "k", "q5_k": "k"}.get(name, "")
    group = 512 if bits == 8 else 256 + 64 * (bits - 4)
    if WTYPES[name].block == QK:
        return Geometry(QK, bits, offset, minimum, 1, False, 2 * PANEL * (2 if minimum else 1), group)
    subs = 16 if name == "q6_k" else 8
    head = 2 * LANES + (2 * LANES + 8 * LANES if minimum else 0) + subs * LANES  # d, [dmin, mn], sc
    return Geometry(QK_K, bits, offset, minimum, subs, name == "q6_k", head, group)


GEOMETRY = {name: _geometry(name) for name in KINDS}
NAMES = {k: n for n, k in KINDS.items()}  # kind -> its type's name
# by kind: the bytes of a panel's block, by which kind_of tells the kind of a kernel form: no two alike
STRIDES = tuple(GEOMETRY[NAMES[k]].stride if k in NAMES else 0 for k in range(max(NAMES) + 1))
if len(set(STRIDES[min(NAMES):])) != len(NAMES):
    raise ImportError("two kernel kinds have panels of the same bytes a block: kind_of could not tell them apart")


def _per_panel(a: np.ndarray, P: int, nb: int) -> np.ndarray:
    """Per-output numbers a [O, nb, ...] -> [P·PANEL, nb, ...] (zero rows pad the last panel)."""
    out = np.zeros((P * PANEL, nb, *a.shape[2:]), a.dtype)
    out[:len(a)] = a
    return out


@njit(**OPTS)
def place_groups(q, bits, gpb, panel_bytes, vec_bytes, block_bytes, head, group_bytes, out):
    """Write the groups of q uint8 [O, in] (each weight's integer) into out, uint8 [P · panel_bytes]: the group
    of panel p, vector v and inputs 32G .. 32G + 31 at byte
        p·panel_bytes + v·vec_bytes + (G // gpb)·block_bytes + head + (G % gpb)·group_bytes
    in the module docstring's layout (8 bits: byte [u, j, k]; else the nibbles' bytes [s, j, k], then the
    planes of bits 4, 5); the outputs of the last panel past O are zeros. Each byte is written once, whole
    (a plane's byte holds the bits of outputs j and j + 1: the even one writes it, the odd one adds to it)."""
    O, n_groups = q.shape[0], q.shape[1] // QK
    for p in range(out.shape[0] // panel_bytes):
        for v in range(VECS):
            for G in range(n_groups):
                at = p * panel_bytes + v * vec_bytes + (G // gpb) * block_bytes + head + (G % gpb) * group_bytes
                c = G * QK
                for j in range(LANES):
                    o = p * PANEL + v * LANES + j
                    real = o < O
                    o = min(o, O - 1)
                    if bits == 8:
                        for u in range(QK // 4):
                            for k in range(4):
                                out[at + 64 * u + 4 * j + k] = q[o, c + 4 * u + k] if real else 0
                        continue
                    for s in range(4):                     # inputs 8s + k (low nibble) and 8s + 4 + k (high)
                        for k in range(4):
                            lo, hi = q[o, c + 8 * s + k] & 15, q[o, c + 8 * s + 4 + k] & 15
                            out[at + 64 * s + 4 * j + k] = (lo | (hi << 4)) if real else 0
                    for plane in range(bits - 4):          # bit 4j + k of word u: bit 4 + plane of input 4u + k
                        for u in range(QK // 4):
                            nib = 0
                            for k in range(4):
                                nib |= ((q[o, c + 4 * u + k] >> (4 + plane)) & 1) << k
                            at_byte = at + 256 + 64 * plane + 8 * u + j // 2
                            if not real:
                                nib = 0
                            if j % 2 == 0:
                                out[at_byte] = nib
                            else:
                                out[at_byte] |= nib << 4


def pack(B: np.ndarray, name: str, n_in: int, out: np.ndarray | None = None) -> np.ndarray:
    """The kernel form of a quantized matrix: B its GGUF bytes [..., out, n_in / block · bytes per block]
    (quant.py) -> uint8 [..., ceil(out / PANEL), n_in / block, STRIDES[kind]] (see the module docstring: for the
    K types the shape gives the sizes, the bytes are in vector-major order; zero rows pad the last panel),
    written into `out` when given (an array of that shape).
    pack(quantize(W, "q8_0"), "q8_0", W.shape[-1])"""
    g = GEOMETRY[name]
    O, nb = B.shape[-2], n_in // g.block
    P = -(-O // PANEL)
    form = np.empty((*B.shape[:-2], P, nb, g.stride), np.uint8) if out is None else out
    if B.ndim > 2:
        for b, f in zip(B, form):
            pack(b, name, n_in, f)
        return form
    f = unpack(B, name)                                         # blocks in order: [O·nb, ...]

    def field(a):                                               # [O·nb, k] -> [P·PANEL, nb, k]
        return _per_panel(a.reshape(O, nb, -1), P, nb)
    q = np.ascontiguousarray(f.q).reshape(O, n_in)
    if g.block == QK:                                           # [P, nb, (d, m), 64 outputs] then the groups
        for k, a in enumerate((f.d, f.m) if g.minimum else (f.d,)):
            form[:, :, 2 * PANEL * k:2 * PANEL * (k + 1)] = \
                field(a).view(np.uint8).reshape(P, PANEL, nb, 2).transpose(0, 2, 1, 3).reshape(P, nb, -1)
        place_groups(q, g.bits, 1, nb * g.stride, g.group, g.stride, g.head, 0, form.reshape(-1))
        return form

    def strip(a):                                               # [P·PANEL, nb, k, (2)] -> [P, v, nb, k·16 (·2)]
        a = a.reshape(P, VECS, LANES, nb, a.shape[2], -1).transpose(0, 1, 3, 4, 2, 5)
        return np.ascontiguousarray(a).view(np.uint8).reshape(P, VECS, nb, -1)
    head = [strip(field(f.d))]
    if g.minimum:
        head += [strip(field(f.dmin)), strip(field(f.sc)), strip(field(f.mn).reshape(P * PANEL, nb, 4, 2))]
    else:
        head += [strip(field(f.sc))]
    vec = g.stride // VECS                                      # a vector's strip of one super-block
    form.reshape(P, VECS, nb, vec)[..., :g.head] = np.concatenate(head, axis=3)   # [P, v, nb, strip]
    place_groups(q, g.bits, g.block // QK, nb * g.stride, nb * vec, vec, g.head, g.group, form.reshape(-1))
    return form


# ---- IR pieces ------------------------------------------------------------------------------------------
I1, I8, I16, I32, I64, F32 = ir.IntType(1), ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64), \
    ir.FloatType()
IVEC, FVEC, HVEC = ir.VectorType(I32, LANES), ir.VectorType(F32, LANES), ir.VectorType(I16, LANES)


def ir_at(builder, ptr, off, ty):
    """A pointer to a `ty` at byte (or element) offset `off` of ptr."""
    return builder.bitcast(builder.gep(ptr, [off]), ty.as_pointer())


def ir_off(builder, base, k: int):
    """base + k (i64)."""
    return builder.add(base, ir.Constant(I64, k))


def ir_splat(builder, s, vty):
    """The scalar s in every lane of a vector of type vty."""
    v = builder.insert_element(ir.Constant(vty, ir.Undefined), s, ir.Constant(I32, 0))
    return builder.shuffle_vector(v, ir.Constant(vty, ir.Undefined), ir.Constant(IVEC, [0] * LANES))


def ir_halves(builder, bp, at, count: int = VECS):
    """`count` vectors of 16 float16 at byte `at` of bp, as float32."""
    out = []
    for v in range(count):
        bits = builder.load(ir_at(builder, bp, ir_off(builder, at, 32 * v), HVEC), align=2)
        out.append(builder.fpext(builder.bitcast(bits, ir.VectorType(ir.HalfType(), LANES)), FVEC))
    return out


def ir_bytes(builder, bp, at, signed: bool):
    """16 bytes at byte `at` of bp, widened to <16 x i32> (vpmovzxbd / vpmovsxbd)."""
    b = builder.load(ir_at(builder, bp, at, ir.VectorType(I8, LANES)), align=1)
    return builder.sext(b, IVEC) if signed else builder.zext(b, IVEC)


def ir_close_loop(builder, i, acc, new, entry, n, again, out):
    """End a loop body: the counter phi i runs 0, 1, .. while < n, each accumulator phi of acc starts at zero
    (from the block entry) and carries its value in new; then branch back to `again` or on to `out`."""
    i1 = builder.add(i, ir.Constant(I64, 1))
    i.add_incoming(ir.Constant(I64, 0), entry)
    i.add_incoming(i1, builder.block)
    for a, a1 in zip(acc, new):
        a.add_incoming(ir.Constant(a.type, None), entry)
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


# ---- the integer products of each instruction set ----------------------------------------------------------
# The loops below are written once; what differs between instruction sets is in these few blocks:
#
#   vnni      a group row's dot (ir_row_dot): chains of `vpdpbusd` (per int32 lane += 4 unsigned x 4 signed
#             bytes); the K minimums' pairs (ir_dot2): `vpdpwssd`
#   portable  the same two as plain IR (a CPU with neither set: compiled there, never run by choice)
#   avx2      the dot: `vpmaddubsw` (per int16 lane: 2 unsigned x 2 signed bytes, saturating) summed in int16
#             as long as no sum can overflow, then `vpmaddwd` against ones into int32 (_row_dot_avx2);
#             ir_dot2: `vpmaddwd` and an add. Each on the two 256-bit halves of the loops' 512-bit values.
#             Its int16 pairs limit the unsigned operand: 8-bit weights are held signed (`signed_weights`,
#             the sign moved onto x as llama.cpp does), and one row's 4-bit high nibbles are not held x 16.
ISAS = ("vnni", "avx2", "portable")
I8X64 = ir.VectorType(I8, 4 * LANES)
I16X32 = ir.VectorType(I16, 2 * LANES)


def signed_weights(bits: int, isa: str) -> bool:
    """Whether a group's weights are held as signed q = u - offset (8-bit weights on AVX2: `vpmaddubsw` takes
    |q| <= 128 unsigned, where u <= 255 could saturate a pair) rather than unsigned u (ir_group)."""
    return isa == "avx2" and bits == 8


def dot_offset(g: Geometry, isa: str) -> int:
    """The offset the loops subtract after the dot (as offset·Σx): 0 where the weights are held signed."""
    return 0 if signed_weights(g.bits, isa) else g.offset


def high_nibbles_in_place(rows: int, bits: int, isa: str) -> bool:
    """One row of 4-bit weights: their high nibbles are multiplied in place (16 q, one op less per 64 bytes)
    and the dot shifted back; not on AVX2, where 16 q (up to 240) would saturate `vpmaddubsw`'s pairs."""
    return rows == 1 and bits == 4 and isa != "avx2"


def ir_portable(builder, name: str, body):
    """A call-once helper (acc, a, b) -> <16 x i32> defined in the module (internal, never inlined) by
    body(builder, acc, a, b): where the CPU lacks VNNI its instructions are written out once per module instead
    of at every use (the kernels are compiled there, never run by choice: their code stays small)."""
    fn = builder.module.globals.get(name)
    if fn is None:
        fn = ir.Function(builder.module, ir.FunctionType(IVEC, [IVEC] * 3), name)
        fn.linkage = "internal"
        fn.attributes.add("noinline")
        b = ir.IRBuilder(fn.append_basic_block("entry"))
        b.ret(body(b, *fn.args))
    return fn


def _dot4_portable(builder, acc, u, x):
    for k in range(4):  # byte k of each lane: u's zero-extended, x's sign-extended
        uk = builder.and_(builder.lshr(u, ir.Constant(IVEC, [8 * k] * LANES)), ir.Constant(IVEC, [255] * LANES))
        xk = builder.ashr(builder.shl(x, ir.Constant(IVEC, [24 - 8 * k] * LANES)), ir.Constant(IVEC, [24] * LANES))
        acc = builder.add(acc, builder.mul(uk, xk))
    return acc


def _dot2_portable(builder, acc, a, b):
    sixteen = ir.Constant(IVEC, [16] * LANES)
    lo = [builder.ashr(builder.shl(v, sixteen), sixteen) for v in (a, b)]
    hi = [builder.ashr(v, sixteen) for v in (a, b)]
    return builder.add(acc, builder.add(builder.mul(*lo), builder.mul(*hi)))


def ir_avx2(builder, name: str, a, b, ty, out):
    """The 256-bit AVX2 intrinsic llvm.x86.avx2.`name` (two arguments of vector type `ty`, result `out`) on each
    half of a and b (512-bit values of any vector type), the halves of its results joined: a 512-bit vector."""
    n, wide = ty.count, ir.VectorType(ty.element, 2 * ty.count)
    fn = ir_function(builder, f"llvm.x86.avx2.{name}", out, [ty, ty])
    a, b = builder.bitcast(a, wide), builder.bitcast(b, wide)
    half = [builder.call(fn, [builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(I32, n), list(range(h * n, h * n + n))))
                              for v in (a, b)]) for h in range(2)]
    return builder.shuffle_vector(*half, ir.Constant(ir.VectorType(I32, 2 * out.count), list(range(2 * out.count))))


def ir_pairs_avx2(builder, a, b):
    """Per int16 lane: 2 unsigned bytes of a times 2 signed bytes of b, summed (`vpmaddubsw`, saturating)."""
    return ir_avx2(builder, "pmadd.ub.sw", a, b, ir.VectorType(I8, 2 * LANES), HVEC)


def ir_widen_avx2(builder, acc, a, b):
    """acc + per int32 lane the dot product of 2 int16 of a and 2 of b (`vpmaddwd`; exact but for -32768²·2)."""
    return builder.add(acc, builder.bitcast(ir_avx2(builder, "pmadd.wd", a, b, HVEC, ir.VectorType(I32, LANES // 2)),
                                            IVEC))


def ir_dot4(builder, acc, u, x, isa: str):
    """acc + per lane the dot product of 4 unsigned bytes of u and 4 signed bytes of x (<16 x i32> each):
    one `vpdpbusd`, or where the CPU lacks it the same in portable IR (ir_portable), so that the float kernels,
    which compile this path too, still compile there."""
    if isa == "vnni":
        return builder.call(ir_function(builder, "llvm.x86.avx512.vpdpbusd.512", IVEC, [IVEC] * 3), [acc, u, x])
    return builder.call(ir_portable(builder, "nanoeuler.dot4", _dot4_portable), [acc, u, x])


def ir_dot2(builder, acc, a, b, isa: str):
    """acc + per lane the dot product of 2 signed int16 of a and 2 of b: one `vpdpwssd`, `vpmaddwd` and an add
    (AVX2), or portable IR."""
    if isa == "vnni":
        return builder.call(ir_function(builder, "llvm.x86.avx512.vpdpwssd.512", IVEC, [IVEC] * 3), [acc, a, b])
    if isa == "avx2":
        return ir_widen_avx2(builder, acc, a, b)
    return builder.call(ir_portable(builder, "nanoeuler.dot2", _dot2_portable), [acc, a, b])


def ir_group(builder, bp, at, bits: int, isa: str, hi16: bool = False) -> list:
    """The group at byte `at` of bp as 8 <16 x i32>, [u]: 16 outputs x the 4 unsigned bytes of inputs 4u .. 4u + 3
    (4 bits and more: each 64 nibble bytes split into low and high nibbles, one and / shift + and each; hi16: the
    high nibbles left in place, 16 q, one and; 5, 6 bits: each bit plane's word u OR-ed in by one masked move).
    Signed where `signed_weights`: q = u - 128, the bytes' top bit flipped."""
    if bits == 8:
        wv = [builder.load(ir_at(builder, bp, ir_off(builder, at, 64 * u), IVEC), align=1) for u in range(8)]
        top = ir.Constant(IVEC, [-0x7F7F7F80] * LANES)  # 0x80808080
        return [builder.xor(w, top) for w in wv] if signed_weights(bits, isa) else wv
    lo4, hi4, wv = ir.Constant(IVEC, [0x0F0F0F0F] * LANES), ir.Constant(IVEC, [-0x0F0F0F10] * LANES), []
    for s in range(4):
        raw = builder.load(ir_at(builder, bp, ir_off(builder, at, 64 * s), IVEC), align=1)
        hi = builder.and_(raw, hi4) if hi16 else builder.and_(builder.lshr(raw, ir.Constant(IVEC, [4] * LANES)), lo4)
        wv += [builder.and_(raw, lo4), hi]
    for plane in range(bits - 4):
        one = ir.Constant(I8X64, [16 << plane] * (4 * LANES))
        for u in range(8):
            word = builder.load(ir_at(builder, bp, ir_off(builder, at, 256 + 64 * plane + 8 * u), I64), align=1)
            add = builder.select(builder.bitcast(word, ir.VectorType(I1, 4 * LANES)), one, ir.Constant(I8X64, None))
            wv[u] = builder.or_(wv[u], builder.bitcast(add, IVEC))
    return wv


def _row_dot_avx2(builder, start, wv, x_at, bits: int):
    """start + Σ_u wv[u]·x_at(u) (ir_row_dot) by `vpmaddubsw`, its int16 pair sums added in int16 over `per` u at a
    time, then widened into int32 by `vpmaddwd` against ones. Exact: the activations are -127 .. 127 (never
    -128), so a pair is at most 2·127·top in size, top the largest unsigned operand (2^bits - 1; 8-bit weights,
    held signed: |q| <= 128, their signs moved onto x by `vpsignb`), and per = 32767 // (2·127·top) of them
    (4 bits: 8, 5: 4, 6: 2, 8: 1) cannot leave int16 in any order of the adds."""
    signed = bits == 8
    top = 128 if signed else 2 ** bits - 1
    per = 32767 // (2 * 127 * top)
    ones, acc = ir.Constant(I16X32, [1] * (2 * LANES)), start
    for c in range(0, len(wv), per):
        pairs = []
        for u in range(c, min(c + per, len(wv))):
            w, x = wv[u], x_at(u)
            if signed:  # |q|, and x negated where q < 0 (zeroed where q = 0)
                w, x = builder.bitcast(w, I8X64), builder.bitcast(x, I8X64)
                x = ir_avx2(builder, "psign.b", x, w, ir.VectorType(I8, 2 * LANES), ir.VectorType(I8, 2 * LANES))
                w = builder.call(ir_function(builder, f"llvm.abs.v{4 * LANES}i8", I8X64, [I8X64, I1]),
                                 [w, ir.Constant(I1, 0)])
            pairs.append(ir_pairs_avx2(builder, w, x))
        acc = ir_widen_avx2(builder, acc, functools.reduce(builder.add, pairs), ones)
    return acc


def ir_row_dot(builder, start, wv, xp, at, chains: int, isa: str, bits: int, hi16: bool = False):
    """start + Σ_u wv[u]·(x's 4 bytes at byte at + 4u of xp, broadcast) (wv: ir_group's). VNNI: len(wv)
    `vpdpbusd` in `chains` independent chains (1 row: 2, even and odd u, to hide their latency), the x bytes
    loaded where used (vpdpbusd's memory operand); hi16: the odd u hold 16 q (ir_group), their chain is exactly
    16 times its sum. AVX2: _row_dot_avx2."""
    def x_at(u):
        return ir_splat(builder, builder.load(ir_at(builder, xp, ir_off(builder, at, 4 * u), I32), align=1), IVEC)
    if isa == "avx2":
        return _row_dot_avx2(builder, start, wv, x_at, bits)
    ia = [start] + [ir.Constant(IVEC, [0] * LANES)] * (chains - 1)
    for u, w in enumerate(wv):
        ia[u % chains] = ir_dot4(builder, ia[u % chains], w, x_at(u), isa)
    if hi16:
        ia[1] = builder.ashr(ia[1], ir.Constant(IVEC, [4] * LANES))
    return functools.reduce(builder.add, ia)


def ir_store_rows(builder, t, new, at: int | None = None, v=None):
    """Store accumulators: t[k·LANES ..] for each of new (at None), or row r's vector v at t[r·PANEL + v·LANES]."""
    tp = builder.inttoptr(t, F32.as_pointer())
    for k, a in enumerate(new):
        off = ir.Constant(I64, k * LANES) if v is None else \
            builder.add(ir.Constant(I64, k * PANEL), builder.mul(v, ir.Constant(I64, LANES)))
        builder.store(a, ir_at(builder, tp, off, FVEC), align=4)


# ---- one panel ----------------------------------------------------------------------------------------------
def _block_loop(g: Geometry, isa: str):
    """The loop of a 32-weight kind over a panel's blocks for `rows` rows (see _panel_intrinsic):

        t[r, j] = Σ_b dw[b, j]·xd[r, b]·(Σ_i u[b, j, i]·xq[r, 32b + i] - offset·xs[r, b])  (+ mw·xs: Q8_1)

    Per block and vector of 16 outputs: its integers are loaded once into 8 registers (split into nibbles,
    the fifth bit OR-ed in) and each row makes a chain of 8 `vpdpbusd` against its activation bytes, broadcast
    from memory, starting from -offset·xs (the sum stays an exact integer), then one int -> float conversion and
    multiply-add. Only the k·VECS float accumulators and one vector's weights stay in registers (weights held
    for every vector at once, or x held across vectors, spilled: 84 against 126 GMAC/s at 4 rows)."""
    def loop(builder, rows, w, xq, xd, xs, t, nb, n_in):
        fma = ir_function(builder, f"llvm.fma.v{LANES}f32", FVEC, [FVEC] * 3)
        bp = builder.inttoptr(w, I8.as_pointer())
        xdp, xsp = builder.inttoptr(xd, F32.as_pointer()), builder.inttoptr(xs, F32.as_pointer())
        entry, body_ = builder.block, builder.append_basic_block(f"qpanel{rows}")
        builder.branch(body_)
        builder.position_at_end(body_)
        b = builder.phi(I64)
        acc = [builder.phi(FVEC) for _ in range(rows * VECS)]
        blk = builder.mul(b, ir.Constant(I64, g.stride))
        dw = ir_halves(builder, bp, blk)
        mw = ir_halves(builder, bp, ir_off(builder, blk, 2 * PANEL)) if g.minimum else None
        xat, start, dx, dxs, offset = [], [], [], [], dot_offset(g, isa)
        for r in range(rows):
            xat.append(builder.add(builder.mul(ir.Constant(I64, r), n_in), builder.mul(b, ir.Constant(I64, QK))))
            rb = builder.add(builder.mul(ir.Constant(I64, r), nb), b)
            d, s = builder.load(builder.gep(xdp, [rb])), builder.load(builder.gep(xsp, [rb]))
            dx.append(ir_splat(builder, d, FVEC))
            dxs.append(ir_splat(builder, s, FVEC) if g.minimum else None)  # Q8_1's d·Σq
            start.append(ir_splat(builder, builder.mul(builder.fptosi(s, I32), ir.Constant(I32, -offset)), IVEC))
        new = [None] * (rows * VECS)
        hi16 = high_nibbles_in_place(rows, g.bits, isa)
        for v in range(VECS):
            wv = ir_group(builder, bp, ir_off(builder, blk, g.head + v * g.group), g.bits, isa, hi16)
            xp = builder.inttoptr(ir_opaque(builder, xq, xd, v), I8.as_pointer())
            for r in range(rows):
                ia = ir_row_dot(builder, start[r], wv, xp, xat[r], 2 if rows == 1 else 1, isa, g.bits, hi16)
                a = builder.call(fma, [builder.sitofp(ia, FVEC), builder.fmul(dw[v], dx[r]), acc[r * VECS + v]])
                new[r * VECS + v] = builder.call(fma, [mw[v], dxs[r], a]) if g.minimum else a
        ir_close_loop(builder, b, acc, new, entry, nb, body_, builder.append_basic_block(f"qpanel{rows}.out"))
        ir_store_rows(builder, t, new)
    return loop


def ir_lin(builder, const: int, *terms):
    """const + Σ a·k over the terms (a, k): a an i64 value, k an int (the byte or element offsets of loops)."""
    out = ir.Constant(I64, const)
    for a, k in terms:
        out = builder.add(out, a if k == 1 else builder.mul(a, ir.Constant(I64, k)))
    return out


def _super_block_loop(g: Geometry, isa: str):
    """The loops of a K kind for `rows` rows: per vector v of 16 outputs (its stream, see `pack`), over the
    super-blocks B, for each row

        S = Σ_j sc_j·(Σ_i∈j u_i·xq_i - offset·xs_j)        (int32: 8 groups of `vpdpbusd`, `vpmulld` by sc_j)
        M = Σ_j mn_j·xs_j                                   (Q4_K, Q5_K: 4 `vpdpwssd` on the mn pairs)
        t[r, 16v + lane] = Σ_B xd[r, B]·(dw·S - dmin·M)

    xs_j: the activations' sum over sub-block j, from xs [rows, 16 · super-blocks] (Q8_K's sums per 16);
    xd [rows, super-blocks]."""
    strip = g.head + g.block // QK * g.group

    def loop(builder, rows, w, xq, xd, xs, t, nb, n_in):
        fma = ir_function(builder, f"llvm.fma.v{LANES}f32", FVEC, [FVEC] * 3)
        xdp, xsp = builder.inttoptr(xd, F32.as_pointer()), builder.inttoptr(xs, F32.as_pointer())
        entry = builder.block
        vhead, bbody = builder.append_basic_block(f"kv{rows}"), builder.append_basic_block(f"kb{rows}")
        bdone, out = builder.append_basic_block(f"kb{rows}.out"), builder.append_basic_block(f"kv{rows}.out")
        builder.branch(vhead)
        builder.position_at_end(vhead)
        v = builder.phi(I64)
        sp = builder.inttoptr(ir_lin(builder, 0, (w, 1), (builder.mul(v, nb), strip)), I8.as_pointer())
        builder.branch(bbody)
        builder.position_at_end(bbody)
        b = builder.phi(I64)
        acc = [builder.phi(FVEC) for _ in range(rows)]
        blk = builder.mul(b, ir.Constant(I64, strip))
        per16 = g.block // g.subs // 16

        def sub_sum(r, j):  # row r's activation sum over sub-block j (i64) of this super-block, as int32
            at = ir_lin(builder, 0, (nb, 16 * r), (b, 16), (j, per16))
            parts = [builder.load(builder.gep(xsp, [ir_off(builder, at, i)])) for i in range(per16)]
            return builder.fptosi(functools.reduce(builder.fadd, parts), I32)
        dx = [ir_splat(builder, builder.load(builder.gep(xdp, [ir_lin(builder, 0, (nb, r), (b, 1))])), FVEC)
              for r in range(rows)]
        new = _k_minimums(builder, g, sp, blk, acc, dx, sub_sum, fma, isa) if g.minimum else list(acc)
        S = _k_groups(builder, g, sp, blk, rows, [ir_lin(builder, 0, (n_in, r), (b, QK_K)) for r in range(rows)],
                      builder.inttoptr(xq, I8.as_pointer()), sub_sum, isa)
        dw = ir_halves(builder, sp, blk, 1)[0]
        new = [builder.call(fma, [builder.sitofp(S[r], FVEC), builder.fmul(dw, dx[r]), new[r]]) for r in range(rows)]
        ir_close_loop(builder, b, acc, new, vhead, nb, bbody, bdone)
        ir_store_rows(builder, t, new, v=v)
        v1 = builder.add(v, ir.Constant(I64, 1))
        v.add_incoming(ir.Constant(I64, 0), entry)
        v.add_incoming(v1, bdone)
        builder.cbranch(builder.icmp_signed("<", v1, ir.Constant(I64, VECS)), vhead, out)
        builder.position_at_end(out)
    return loop


def _k_minimums(builder, g: Geometry, sp, blk, acc, dx, sub_sum, fma, isa: str) -> list:
    """acc[r] - dmin·dx[r]·M[r] for each row (see _super_block_loop): M by 4 `vpdpwssd` of the strip's mn pairs
    (zero-extended to int16) against the row's (xs_2k, xs_2k+1) as two int16 in one int32, broadcast."""
    at_mn = 4 * LANES + g.subs * LANES  # after d, dmin and sc
    pairs = [builder.bitcast(builder.zext(builder.load(ir_at(builder, sp, ir_off(builder, blk, at_mn + 32 * k),
                                                             ir.VectorType(I8, 2 * LANES)), align=1),
                                          ir.VectorType(I16, 2 * LANES)), IVEC) for k in range(4)]
    dmin = ir_halves(builder, sp, ir_off(builder, blk, 2 * LANES), 1)[0]
    out = []
    for r, a in enumerate(acc):
        m = ir.Constant(IVEC, None)
        for k in range(4):
            lo, hi = (sub_sum(r, ir.Constant(I64, 2 * k + h)) for h in range(2))
            pair = builder.or_(builder.and_(lo, ir.Constant(I32, 0xFFFF)), builder.shl(hi, ir.Constant(I32, 16)))
            m = ir_dot2(builder, m, pairs[k], ir_splat(builder, pair, IVEC), isa)
        out.append(builder.call(fma, [builder.fneg(builder.sitofp(m, FVEC)), builder.fmul(dmin, dx[r]), a]))
    return out


def _k_groups(builder, g: Geometry, sp, blk, rows: int, xat, xqp, sub_sum, isa: str) -> list:
    """Per row S = Σ_j sc_j·(Σ_i∈j u_i·xq_i - offset·xs_j) over a super-block's 8 groups of 32 inputs (a loop,
    the rows' int32 sums carried): each group's weights loaded once (ir_group), its 1 or 2 sub-blocks' scales
    widened from bytes, per row and sub-block a `vpdpbusd` chain times the scale. xat: each row's first input."""
    per = g.subs * QK // g.block                  # sub-blocks per group: 1, or 2 (Q6_K)
    offset = dot_offset(g, isa)
    at_sc = 2 * LANES * (2 if g.minimum else 1)   # after d, [dmin]
    into, body, done = builder.block, builder.append_basic_block("kg"), builder.append_basic_block("kg.out")
    builder.branch(body)
    builder.position_at_end(body)
    grp = builder.phi(I64)
    S = [builder.phi(IVEC) for _ in range(rows)]
    hi16 = high_nibbles_in_place(rows, g.bits, isa)
    wv = ir_group(builder, sp, ir_lin(builder, g.head, (blk, 1), (grp, g.group)), g.bits, isa, hi16)
    sub = builder.mul(grp, ir.Constant(I64, per))  # the group's first sub-block
    sc = [ir_bytes(builder, sp, ir_lin(builder, at_sc + h * LANES, (blk, 1), (sub, LANES)), g.signed)
          for h in range(per)]
    S1 = []
    for r in range(rows):
        s = S[r]
        for h in range(per):
            start = ir.Constant(IVEC, None) if not offset else \
                ir_splat(builder, builder.mul(sub_sum(r, ir_off(builder, sub, h)), ir.Constant(I32, -offset)), IVEC)
            dot = ir_row_dot(builder, start, wv[h * 8 // per:(h + 1) * 8 // per], xqp,
                             ir_lin(builder, QK // per * h, (xat[r], 1), (grp, QK)), 2 if rows == 1 else 1, isa,
                             g.bits, hi16)
            s = builder.add(s, builder.mul(dot, sc[h]))
        S1.append(s)
    ir_close_loop(builder, grp, S, S1, into, ir.Constant(I64, g.block // QK), body, done)
    return S1


def _panel_intrinsic(kind: int, isa: str = ISA):
    """An intrinsic (k, w, xq, xd, xs, t, nb, n_in) running one panel of `kind` for k <= MAX_R rows, all
    addresses: the panel at w (nb blocks or super-blocks, see `pack`), xq int8 [k, n_in], xd, xs float32 (the
    activations' scales and sums: [k, nb] each, K kinds [k, nb] and [k, 16·nb]), t [k, PANEL] float32.
    One loop per row count (_block_loop, _super_block_loop), chosen by a switch on k."""
    g = GEOMETRY[NAMES[kind]]
    loop = (_block_loop if g.block == QK else _super_block_loop)(g, isa)

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
    typer.__name__ = f"_qpanel{kind}_{isa}"
    return intrinsic(typer)


_q8_0, _q4_0, _q4_1, _q5_0, _q5_1, _q4_k, _q5_k, _q6_k = (_panel_intrinsic(kind) for kind in KINDS.values())


@njit(inline="always", **OPTS)
def _panel(kind, k, w, xq, xd, xs, t, nb, n_in):
    """t[:k] = the panel at w for k <= MAX_R rows (see _panel_intrinsic)."""
    if kind == 3:
        _q8_0(k, w, xq, xd, xs, t, nb, n_in)
    elif kind == 4:
        _q4_0(k, w, xq, xd, xs, t, nb, n_in)
    elif kind == 5:
        _q4_1(k, w, xq, xd, xs, t, nb, n_in)
    elif kind == 6:
        _q5_0(k, w, xq, xd, xs, t, nb, n_in)
    elif kind == 7:
        _q5_1(k, w, xq, xd, xs, t, nb, n_in)
    elif kind == 8:
        _q4_k(k, w, xq, xd, xs, t, nb, n_in)
    elif kind == 9:
        _q5_k(k, w, xq, xd, xs, t, nb, n_in)
    else:
        _q6_k(k, w, xq, xd, xs, t, nb, n_in)


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
def ir_load_floats(builder, addr, count: int) -> list:
    """`count` vectors of 16 float32 at address addr."""
    p = builder.inttoptr(addr, F32.as_pointer())
    return [builder.load(ir_at(builder, p, ir.Constant(I64, LANES * h), FVEC), align=4) for h in range(count)]


def ir_amax(builder, fv: list):
    """max |x| over the vectors fv (exact in any order)."""
    fabs = ir_function(builder, f"llvm.fabs.v{LANES}f32", FVEC, [FVEC])
    top = functools.reduce(lambda a, c: builder.call(ir_function(builder, f"llvm.maxnum.v{LANES}f32", FVEC,
                                                                 [FVEC] * 2), [a, c]),
                           [builder.call(fabs, [v]) for v in fv])
    return builder.call(ir_function(builder, f"llvm.vector.reduce.fmax.v{LANES}f32", F32, [FVEC]), [top])


def ir_store_q(builder, qaddr, h: int, qi):
    """Store <16 x i32> qi as 16 int8 at qaddr + 16h; return their sum."""
    builder.store(builder.trunc(qi, ir.VectorType(I8, LANES)),
                  ir_at(builder, builder.inttoptr(qaddr, I8.as_pointer()), ir.Constant(I64, LANES * h),
                        ir.VectorType(I8, LANES)), align=1)
    return builder.call(ir_function(builder, f"llvm.vector.reduce.add.v{LANES}i32", I32, [IVEC]), [qi])


def ir_rint(builder, v):
    """v rounded to the nearest integer, ties to even (vrndscaleps), as int32."""
    return builder.fptosi(builder.call(ir_function(builder, f"llvm.rint.v{LANES}f32", FVEC, [FVEC]), [v]), IVEC)


def _block_quantizer(q8_1: bool):
    """The intrinsic (x, q, d, s) quantizing one block of 32 activations at address x (float32) -> q (int8 [32]),
    d, s (float32) at their addresses, as quant.quantize_x8 (q8_1: quant.quantize_x8_1) rounds them, in two
    16-lane vectors: max |x| (exact in any order), one scalar 127 / max, a product and a round-to-even per lane,
    the integers' sum (Q8_1: times max / 127, rounded to float16)."""
    @intrinsic
    def quantize(typingctx, x, q, d, s):
        def codegen(context, builder, sig, args):
            xa, qa, da, sa = args
            fv = ir_load_floats(builder, xa, 2)
            amax = ir_amax(builder, fv)
            inv = builder.select(builder.fcmp_ordered(">", amax, ir.Constant(F32, 0.0)),
                                 builder.fdiv(ir.Constant(F32, 127.0), amax), ir.Constant(F32, 0.0))
            total = functools.reduce(builder.add, [ir_store_q(builder, qa, h, ir_rint(builder, builder.fmul(
                fv[h], ir_splat(builder, inv, FVEC)))) for h in range(2)])
            unrounded = builder.fdiv(amax, ir.Constant(F32, 127.0))
            builder.store(ir_half(builder, unrounded), builder.inttoptr(da, F32.as_pointer()))
            total = builder.sitofp(total, F32)
            builder.store(ir_half(builder, builder.fmul(unrounded, total)) if q8_1 else total,
                          builder.inttoptr(sa, F32.as_pointer()))
            return context.get_dummy_value()
        return types.void(types.int64, types.int64, types.int64, types.int64), codegen
    return quantize


def ir_half(builder, v):
    """A float32 value rounded to float16 (to nearest even), as float32."""
    return builder.fpext(builder.fptrunc(v, ir.HalfType()), F32)


_quantize_block, _quantize_block_q8_1 = _block_quantizer(False), _block_quantizer(True)


def ir_first_of_magnitude(builder, fv: list, amax):
    """The first entry x of the vectors fv (in order) with |x| == amax, signed (0 if none): per vector the lanes
    that equal it as a 16-bit mask, the lowest set one (cttz); the first vector with a hit wins."""
    fabs = ir_function(builder, f"llvm.fabs.v{LANES}f32", FVEC, [FVEC])
    cttz = ir_function(builder, "llvm.cttz.i16", I16, [I16, I1])
    top = ir.Constant(F32, 0.0)
    for v in reversed(fv):  # walk back from the last vector: an earlier hit replaces a later one
        hit = builder.bitcast(builder.fcmp_ordered("==", builder.call(fabs, [v]), ir_splat(builder, amax, FVEC)), I16)
        lane = builder.and_(builder.zext(builder.call(cttz, [hit, ir.Constant(I1, 0)]), I32), ir.Constant(I32, 15))
        top = builder.select(builder.icmp_unsigned("!=", hit, ir.Constant(I16, 0)), builder.extract_element(v, lane),
                             top)
    return top


@intrinsic
def _quantize_super_block(typingctx, x, q, d, s):
    """One Q8_K block of 256 activations at address x (float32) -> q (int8 [256]), d (float32) and s (float32
    [16]: Σ q per 16) at their addresses, as quant.quantize_xk rounds them: max |x| over 16 vectors, the first
    entry of that magnitude (its sign) found from the vectors' equality masks (the first vector with a hit, its
    lowest lane: cttz), iscale = -127 / it, per lane min(127, round-to-even(x · iscale)), d = 1 / iscale."""
    def codegen(context, builder, sig, args):
        xa, qa, da, sa = args
        fv = ir_load_floats(builder, xa, 16)
        amax = ir_amax(builder, fv)
        top = ir_first_of_magnitude(builder, fv, amax)
        some = builder.fcmp_ordered(">", amax, ir.Constant(F32, 0.0))
        iscale = builder.select(some, builder.fdiv(ir.Constant(F32, -127.0), top), ir.Constant(F32, 0.0))
        most, sp = ir.Constant(IVEC, [127] * LANES), builder.inttoptr(sa, F32.as_pointer())
        for h in range(16):
            qi = ir_rint(builder, builder.fmul(fv[h], ir_splat(builder, iscale, FVEC)))
            qi = builder.select(builder.icmp_signed(">", qi, most), most, qi)
            builder.store(builder.sitofp(ir_store_q(builder, qa, h, qi), F32), builder.gep(sp, [ir.Constant(I64, h)]))
        builder.store(builder.select(some, builder.fdiv(ir.Constant(F32, 1.0), iscale), ir.Constant(F32, 0.0)),
                      builder.inttoptr(da, F32.as_pointer()))
        return context.get_dummy_value()
    return types.void(types.int64, types.int64, types.int64, types.int64), codegen


@njit(**OPTS)
def quantize_x(X, xq, xd, xs, kind):
    """Rows X float32 [n, k] -> xq int8 [n, k], xd, xs float32, each row contiguous, as the products of `kind`
    read them, a block at a time: Q8_0 (quant.quantize_x8: xd, xs [n, k / 32], _quantize_block), Q8_1 for
    Q4_1 / Q5_1 (quant.quantize_x8_1), or Q8_K for the K kinds (quant.quantize_xk: xd [n, k / 256],
    xs [n, k / 16], _quantize_super_block)."""
    n, k = X.shape
    width, q8_1 = block_inputs(kind), kind in Q8_1
    if X.strides[1] != 4 or xq.strides[1] != 1 or xd.strides[1] != 4 or xs.strides[1] != 4:
        raise ValueError("quantizing activations needs rows of contiguous elements")
    for r in range(n):
        x, q = X.ctypes.data + r * X.strides[0], xq.ctypes.data + r * xq.strides[0]
        d, s = xd.ctypes.data + r * xd.strides[0], xs.ctypes.data + r * xs.strides[0]
        for b in range(k // width):
            if width == QK_K:
                _quantize_super_block(x + b * QK_K * 4, q + b * QK_K, d + b * 4, s + b * 64)
            elif q8_1:
                _quantize_block_q8_1(x + b * QK * 4, q + b * QK, d + b * 4, s + b * 4)
            else:
                _quantize_block(x + b * QK * 4, q + b * QK, d + b * 4, s + b * 4)


@njit(**OPTS)
def quantize_rows(kind, X):
    """X float32 [n, k] quantized as `kind`'s products read it -> (xq int8 [n, k], xd, xs float32): Q8_0-style
    blocks of 32 ([n, k / 32] each), or Q8_K for the K kinds ([n, k / 256], [n, k / 16])."""
    n, k = X.shape
    xq = np.empty((n, k), np.int8)
    if kind >= K_KINDS:
        xd, xs = np.empty((n, k // QK_K), np.float32), np.empty((n, k // 16), np.float32)
    else:
        xd, xs = np.empty((n, k // QK), np.float32), np.empty((n, k // QK), np.float32)
    quantize_x(X, xq, xd, xs, kind)
    return xq, xd, xs


# ---- the product ------------------------------------------------------------------------------------------
@intrinsic
def _f32_at(typingctx, addr):
    def codegen(context, builder, sig, args):
        return builder.inttoptr(args[0], ir.PointerType(ir.FloatType()))
    return types.CPointer(types.float32)(types.int64), codegen


@njit(inline="always", **OPTS)
def kind_of(stride):
    """The kernel kind of a kernel-form matrix by its last axis (bytes of a panel's block), -1 if none.
    kind_of(2176) -> 3 (Q8_0)"""
    for kind in range(3, len(STRIDES)):
        if STRIDES[kind] == stride:
            return kind
    return -1


@njit(inline="always", **OPTS)
def block_inputs(kind):
    """Inputs per block of a kind: 256 for the K kinds, else 32."""
    return QK_K if kind >= K_KINDS else QK


@njit(**OPTS)
def gemv_panel(kind, Wa, xqa, xda, xsa, Ya, n, O, I, add, p, T):
    """Outputs p·PANEL .. (at most O) of Y (+)= X @ Wᵀ for every row, all addresses: panel p of W's kernel
    form at Wa (`pack`), X quantized by `quantize_rows(kind, ..)` (xq int8 [n, I], xd, xs float32), Y [n, O]
    float32; rows MAX_R at a time, each group one pass over the panel. T [MAX_R, PANEL] float32 scratch."""
    nb = I // block_inputs(kind)
    ns = I // 16 if kind >= K_KINDS else nb  # activation sums per row
    w = Wa + p * nb * STRIDES[kind]
    o0 = p * PANEL
    m = min(PANEL, O - o0)
    Y = carray(_f32_at(Ya), (n, O))
    r = 0
    while r < n:
        k = min(MAX_R, n - r)
        _panel(kind, k, w, xqa + r * I, xda + r * nb * 4, xsa + r * ns * 4, T.ctypes.data, nb, I)
        store_rows(Y, T, r, k, o0, m, add)
        r += k


@njit(**OPTS)
def panels(kind, W, xq, xd, xs, Y, add, p0, p1):
    """Panels p0 .. p1 - 1 of Y (+)= X @ Wᵀ (see gemv_panel), arrays C-contiguous."""
    T = np.empty((MAX_R, PANEL), np.float32)
    for p in range(p0, p1):
        gemv_panel(kind, W.ctypes.data, xq.ctypes.data, xd.ctypes.data, xs.ctypes.data, Y.ctypes.data, Y.shape[0],
                   Y.shape[1], xq.shape[1], add, p, T)
