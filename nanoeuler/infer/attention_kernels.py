"""Attention of the decoding step over the KV cache: one query head against its cached keys and values.

    out = softmax(K[:Tk] q / sqrt(hd)) V[:Tk]        q, out [hd]; K, V [Tk, hd]       (ops/attention.py, one query)

(the scores soft-capped, cap·tanh(s / cap), where the model caps them: Gemma 2).

`_attend` makes the scores LANES positions at a time (`_scores_intrinsic`: LANES dot products summed lane-wise by
a transposing tree of shuffles, not a horizontal sum each) and the output from a few independent chains of
multiply-adds in registers (`_mix_intrinsic`), where the head width is LANES x 1, 2, 4 or 8; else one by one.
`attend_unit` is the step's unit of attention work: one row's query heads of one key/value group (grouped-query
attention), the unit pool.py shares among its threads when a step has many rows at long positions.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from ..fast.vmath import vexp
from .gemv import LANES, OPTS


@njit(inline="always", **OPTS)
def _dot(w, x, n):
    """Σ w[:n]·x[:n] in float32."""
    s = np.float32(0.0)
    for i in range(n):
        s += w[i] * x[i]
    return s


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
def _attend(q, K, V, Tk, scale, p, out, cap):
    """out [hd] = softmax(K[:Tk] q · scale) V[:Tk] (ops/attention.py for one query), the scores soft-capped
    where cap > 0; p [>= Tk] scratch.
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
    if cap > 0:
        for j in range(Tk):
            p[j] = np.float32(np.tanh(p[j] / cap)) * cap
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


@njit(inline="always", **OPTS)
def attend_unit(t, a, K, V, pos, slot, H, window, u, p, cap):
    """Unit u = r·Hkv + g: row r's query heads of group g (hh // G == g) attend to key/value head g of its
    cache row, positions 0 .. pos[r] (a window W > 0: the last W of them). t [n, (H + 2·Hkv)·hd] the row's
    q (rotated) first; a [n, H·hd] out; K, V [B, Hkv, max_len, hd] one layer's cache; p [>= pos[r] + 1] scratch;
    cap (float32): the scores' soft cap (0: none)."""
    Hkv, hd = K.shape[1], K.shape[3]
    r, g = u // Hkv, u % Hkv
    G = H // Hkv
    j0 = max(0, pos[r] + 1 - window) if window > 0 else 0
    scale = np.float32(1.0 / np.sqrt(hd))
    for hh in range(g * G, (g + 1) * G):
        _attend(t[r, hh * hd:(hh + 1) * hd], K[slot[r], g, j0:], V[slot[r], g, j0:], pos[r] + 1 - j0, scale, p,
                a[r, hh * hd:(hh + 1) * hd], cap)
