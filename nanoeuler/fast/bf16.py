"""bfloat16 matrix products with float32 accumulation, for `--precision bf16` training on the CPU.

A bfloat16 is the top half of a float32 (8 exponent bits, 7 mantissa bits). AVX512_BF16's `vdpbf16ps`
multiplies 32 bfloat16 pairs and adds each pair's two products into one of 16 float32 accumulators:
twice the multiply-adds of a float32 FMA per instruction. Operands are rounded from float32 to nearest,
ties to even (`round_bf16`, and `_rne` inside the packing kernels); a product of two bfloat16 is exact in
float32, so the only roundings are the operands' and the float32 accumulation's:

    C = A · B   ≈   round_bf16(A).astype(float64) @ round_bf16(B).astype(float64)   (to float32 summation)

(the instruction treats bfloat16 subnormals, |x| < 1.2e-38, as zero; a float32 sum of normal-sized
products cannot see them).

Layout (packing, once per operand; a weight once per step): A [M, K] becomes bfloat16 rows [M, Kp]
(Kp = K rounded up to even, zero-padded), so a row's pairs (k, k+1) are one 32-bit word to broadcast;
B [K, N] becomes panels of PANEL = 64 columns [N / 64, Kp / 2, 64, 2]: for each pair of k, the 64
columns' two values side by side, one 512-bit row of 4 vectors. The tile kernel (`_tile_intrinsic`, LLVM
IR) keeps ROWS x 4 accumulator vectors in registers and per pair of k makes ROWS x 4 `vdpbf16ps` from 4
panel loads and ROWS broadcasts; k runs in blocks of KC pairs (a block of a panel stays in L2 while every
row group of A passes over it). Each output sums over k in order, whatever tile it falls in, so results
do not depend on M: a row's result is the same alone or in a batch.

Serial and `nogil`, like the engine's other kernels: the engine runs one sub-batch per core.
`products(dtype)` gives the engine its product functions: these kernels for float32, and for float64 the
NumPy twin `TWIN` (the same operand rounding, float64 products), which tests and checks the engine's
bf16 mode on any CPU.

    Wp = pack_b(W.T)                  # W [out, in]: x · Wᵀ
    matmul_packed(x, Wp, y)           # y [n, out] float32
    matmul(a, b, out)                 # out = a @ b (2-D or batched 3-D float32 views, any strides)
    matmul(a, b, out, add=True)       # out += a @ b
"""
from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from ..errors import UserError

PANEL = 64      # columns of B in one panel: 4 vectors of 16 float32 accumulators
ROWS = 6        # rows of A in one tile: 6 x 4 = 24 accumulator vectors (of 32 registers)
KC = 512        # pairs of k in one block: a panel block is 512 x 256 bytes = 128 KiB (L2 holds it)
# A transposed A (dYᵀ) is packed as pairs (word m + p·M: two rows of the memory read, one written, all streaming)
# up to this size; beyond it transposed into rows: in pairs, a tile's 6 rows lie in K/2 places M·4 bytes apart,
# which for a large A are more pages than the TLB holds, on every tile (GPT-2's head dW in its bf16 step, A =
# dlogitsᵀ of 50,257 x 256 per chunk, is faster in rows: docs/benchmarks.md)
PAIRS_MAX_BYTES = 8 << 20
OPTS = dict(cache=True, nogil=True, error_model="numpy")


def cpu_has_bf16() -> bool:
    """Whether the CPU numba compiles for has AVX512_BF16 (`vdpbf16ps`)."""
    import llvmlite.binding as ll
    return bool(ll.get_host_cpu_features().get("avx512bf16", False))


AVAILABLE = cpu_has_bf16()  # tests set it False to see the refusal


def require() -> None:
    """Refuse bf16 on a CPU without AVX512_BF16 (one line; there is no silent float32 fallback)."""
    if not AVAILABLE:
        raise UserError("--precision bf16 needs a CPU with AVX512_BF16 (vdpbf16ps), which this one lacks; "
                        "use --precision f32")


# ---- rounding ---------------------------------------------------------------------------------------------
def round_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits (uint16), round to nearest even; NaN stays NaN (quiet), ±inf stays ±inf.
    round_bf16_bits(np.float32([1.0, 1.00390625])) -> [0x3f80, 0x3f80] (a tie: to the even 1.0)"""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    r = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    return np.where(nan, (u >> np.uint32(16)) | np.uint32(0x40), r).astype(np.uint16)


def round_bf16(x: np.ndarray) -> np.ndarray:
    """x rounded to bfloat16, as float32 (the value the products see).  round_bf16(np.float32(1/3)) == 0.333984375"""
    return (round_bf16_bits(x).astype(np.uint32) << np.uint32(16)).view(np.float32).reshape(np.shape(x))


@njit(inline="always", **OPTS)
def _rne(u):
    """float32 bits (uint32) -> bfloat16 bits (uint16), as round_bf16_bits."""
    if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
        return np.uint16((u >> np.uint32(16)) | np.uint32(0x40))
    return np.uint16((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))


@njit(inline="always", **OPTS)
def _word(lo, hi):
    """Two float32 bits -> the 32-bit word of their bfloat16 bits, lo in the low half (a pair of k)."""
    return np.uint32(_rne(lo)) | (np.uint32(_rne(hi)) << np.uint32(16))


# ---- packing ------------------------------------------------------------------------------------------------
@njit(**OPTS)
def _pack_rows(A, out):
    """A float32 bits [I, M, K] (k its faster axis) -> bfloat16 bits out [I, M, Kp], the pad column 0."""
    I, M, K = A.shape
    for i in range(I):
        for m in range(M):
            for k in range(K):
                out[i, m, k] = _rne(A[i, m, k])
        out[i, :, K:] = 0


@njit(**OPTS)
def _pack_pairs(A, out):
    """A float32 bits [I, M, K] (m its faster axis: a transposed view, dYᵀ, dSᵀ, Pᵀ) -> bfloat16 bits
    out [I, Kp·M] holding [Kp/2, M, 2]: A[i, m, 2p + e] at 2·(p·M + m) + e, 0 beyond K. Reads two rows of
    the memory at a time, writes one: both stream."""
    I, M, K = A.shape
    for i in range(I):
        for p in range(K // 2):
            for m in range(M):
                out[i, 2 * (p * M + m)] = _rne(A[i, m, 2 * p])
                out[i, 2 * (p * M + m) + 1] = _rne(A[i, m, 2 * p + 1])
        if K % 2:
            p = K // 2
            for m in range(M):
                out[i, 2 * (p * M + m)] = _rne(A[i, m, K - 1])
                out[i, 2 * (p * M + m) + 1] = 0


@njit(**OPTS)
def _pack_columns(A, out):
    """A float32 bits [I, M, K] (m its faster axis: a transposed view) -> words out [I, M, Kp/2], rows as
    _pack_rows lays them out: a transpose, by blocks of PANEL rows (their words stay in cache while the pairs
    of k pass, each pair two stretches of PANEL values of the memory)."""
    I, M, K = A.shape
    P = K // 2
    for i in range(I):
        for m0 in range(0, M, PANEL):
            m1 = min(M, m0 + PANEL)
            for p in range(P):
                for m in range(m0, m1):
                    out[i, m, p] = _word(A[i, m, 2 * p], A[i, m, 2 * p + 1])
            if K % 2:
                for m in range(m0, m1):
                    out[i, m, P] = np.uint32(_rne(A[i, m, K - 1]))


@njit(**OPTS)
def _pack_b(B, out):
    """B float32 bits [I, N, K] (B of C = A·Bᵀ, any strides) -> panels of words out [I, nb, Kp/2, PANEL]:
    out[i, j // PANEL, p, j % PANEL] = the pair (2p, 2p+1) of B[i, j]; zeros beyond N and K. Reads go along
    B's faster axis: a pair of rows at a time when it is n (a panel's row of words from two streams), else
    one row of B at a time, into a column of the panel (whose lines stay in cache while its rows pass)."""
    I, N, K = B.shape
    nb, P2 = out.shape[1], out.shape[2]
    for i in range(I):
        for jb in range(nb):
            n0 = jb * PANEL
            full = min(PANEL, N - n0)  # columns of this panel inside N
            if B.strides[1] < B.strides[2]:
                for p in range(P2):
                    k = 2 * p
                    if k + 1 < K:
                        for j in range(full):
                            out[i, jb, p, j] = _word(B[i, n0 + j, k], B[i, n0 + j, k + 1])
                    else:
                        for j in range(full):
                            out[i, jb, p, j] = np.uint32(_rne(B[i, n0 + j, k]))
                    out[i, jb, p, full:] = 0
                continue
            whole = K // 2  # pairs with both halves inside K
            for j in range(full):
                for p in range(whole):
                    out[i, jb, p, j] = _word(B[i, n0 + j, 2 * p], B[i, n0 + j, 2 * p + 1])
                if K % 2:
                    out[i, jb, whole, j] = np.uint32(_rne(B[i, n0 + j, K - 1]))
            out[i, jb, :, full:] = 0


def _bits3(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x)
    if x.dtype != np.float32:
        raise TypeError(f"bf16 products take float32 operands, not {x.dtype}")
    return (x if x.ndim == 3 else x[None]).view(np.uint32)


def pack_a(a: np.ndarray) -> tuple[np.ndarray, int, int]:
    """a float32 [M, K] or [I, M, K] (any strides) -> (packed uint16 [I, M·Kp], rs, ps): the 32-bit pair
    (k = 2p, 2p+1) of row m is word m·rs + p·ps of item i (rows: rs = Kp/2, ps = 1; pairs: rs = 1, ps = M, for a
    transposed a up to PAIRS_MAX_BYTES)."""
    A = _bits3(a)
    I, M, K = A.shape
    Kp = K + K % 2
    out = np.empty((I, M * Kp), np.uint16)
    if A.strides[1] > A.strides[2]:                                        # k the faster axis: rows as they lie
        _pack_rows(A, out.reshape(I, M, Kp))
    elif M * Kp * 2 <= PAIRS_MAX_BYTES:                                    # transposed: pairs ...
        _pack_pairs(A, out)
        return out, 1, M
    else:                                                                  # ... or, when large, rows
        _pack_columns(A, out.view(np.uint32).reshape(I, M, Kp // 2))
    return out, Kp // 2, 1


def panels_for(K: int, N: int, I: int = 1) -> np.ndarray:
    """An empty array of the panels pack_b makes of a right operand [I, K, N]: uint16 [I, nb, Kp/2, 128]."""
    return np.empty((I, -(-N // PANEL), (K + 1) // 2, 2 * PANEL), np.uint16)


def pack_b(b: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """b float32 [K, N] or [I, K, N] (the right operand, any strides) -> panels uint16 [I, nb, Kp/2, 128].
    out: where to write them (panels_for's shape), else a new array."""
    B = _bits3(b).swapaxes(1, 2)                                           # [I, N, K]
    I, N, K = B.shape
    out = panels_for(K, N, I) if out is None else out
    _pack_b(B, out.view(np.uint32))                                        # [I, nb, Kp/2, PANEL] words
    return out


# ---- the tile kernel (LLVM IR) -----------------------------------------------------------------------------
class _BFloat(ir.types._BaseFloatType):
    """LLVM's `bfloat` (llvmlite has no class for it); only used as a vector element type."""
    intrinsic_name = "bf16"

    def __str__(self):
        return "bfloat"


_BFloat._create_instance()


def _tile_intrinsic(rows: int):
    """An intrinsic (a, rs, ps, b, c, ldc, npairs, zero), all addresses / counts as int64:

        c[r, j] (+)= Σ_p a[r, 2p]·b[p, j, 0] + a[r, 2p+1]·b[p, j, 1]     r < rows, j < PANEL, p < npairs (>= 1)

    a: bfloat16 pairs, that of (r, p) the 32-bit word r·rs + p·ps from a; b: a panel block [npairs, PANEL, 2],
    c: float32 rows (row r at c + 4·r·ldc bytes); zero != 0 starts from 0, else from c's values."""
    f32, i32, i64 = ir.FloatType(), ir.IntType(32), ir.IntType(64)
    vec, ivec, bvec = ir.VectorType(f32, 16), ir.VectorType(i32, 16), ir.VectorType(_BFloat(), 32)
    V = PANEL // 16

    def codegen(context, builder, sig, args):
        a, rs, ps, b, c, ldc, npairs, zero = args
        dp = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vec, [vec, bvec, bvec]),
                                            "llvm.x86.avx512bf16.dpbf16ps.512")
        ap, bp, cp = (builder.inttoptr(a, i32.as_pointer()), builder.inttoptr(b, i32.as_pointer()),
                      builder.inttoptr(c, f32.as_pointer()))
        is_zero = builder.icmp_signed("!=", zero, ir.Constant(i64, 0))
        zeros = ir.Constant(vec, [0.0] * 16)

        def c_ptr(r, v):
            at = builder.add(builder.mul(ir.Constant(i64, r), ldc), ir.Constant(i64, 16 * v))
            return builder.bitcast(builder.gep(cp, [at]), vec.as_pointer())

        init = [builder.select(is_zero, zeros, builder.load(c_ptr(r, v), align=4))
                for r in range(rows) for v in range(V)]
        entry, loop, done = builder.block, builder.append_basic_block("tile"), builder.append_basic_block("tile.end")
        builder.branch(loop)
        builder.position_at_end(loop)
        p = builder.phi(i64)
        acc = [builder.phi(vec) for _ in init]
        for x, x0 in zip(acc, init):
            x.add_incoming(x0, entry)
        base = builder.mul(p, ir.Constant(i64, 2 * PANEL // 2))             # panel row p: PANEL words
        pa = builder.mul(p, ps)
        bs = [builder.bitcast(builder.load(builder.bitcast(builder.gep(bp, [builder.add(base, ir.Constant(i64, 16 * v))]),
                                                           ivec.as_pointer()), align=4), bvec) for v in range(V)]
        new = []
        for r in range(rows):
            word = builder.load(builder.gep(ap, [builder.add(builder.mul(ir.Constant(i64, r), rs), pa)]), align=4)
            splat = builder.shuffle_vector(builder.insert_element(ir.Constant(ivec, ir.Undefined), word, ir.Constant(i32, 0)),
                                           ir.Constant(ivec, ir.Undefined), ir.Constant(ivec, [0] * 16))
            av = builder.bitcast(splat, bvec)
            new += [builder.call(dp, [acc[r * V + v], av, bs[v]]) for v in range(V)]
        p1 = builder.add(p, ir.Constant(i64, 1))
        p.add_incoming(ir.Constant(i64, 0), entry)
        p.add_incoming(p1, builder.block)
        for x, x1 in zip(acc, new):
            x.add_incoming(x1, builder.block)
        builder.cbranch(builder.icmp_signed("<", p1, npairs), loop, done)
        builder.position_at_end(done)
        for k, x in enumerate(new):
            builder.store(x, c_ptr(k // V, k % V), align=4)
        return context.get_dummy_value()

    def typer(typingctx, a, rs, ps, b, c, ldc, npairs, zero):
        return types.void(*(types.int64,) * 8), codegen
    typer.__name__ = f"_tile{rows}_bf16"
    return intrinsic(typer)


_t1, _t2, _t3, _t4, _t5, _t6 = (_tile_intrinsic(r) for r in range(1, ROWS + 1))


@njit(inline="always", **OPTS)
def _tile(r, a, rs, ps, b, c, ldc, npairs, zero):
    if r == 6:
        _t6(a, rs, ps, b, c, ldc, npairs, zero)
    elif r == 5:
        _t5(a, rs, ps, b, c, ldc, npairs, zero)
    elif r == 4:
        _t4(a, rs, ps, b, c, ldc, npairs, zero)
    elif r == 3:
        _t3(a, rs, ps, b, c, ldc, npairs, zero)
    elif r == 2:
        _t2(a, rs, ps, b, c, ldc, npairs, zero)
    else:
        _t1(a, rs, ps, b, c, ldc, npairs, zero)


@njit(**OPTS)
def _gemm(Ap, rs, ps, Bp, C, E, add):
    """C [I, M, N] float32 (columns contiguous) (+)= A · panels Bp [I, nb, Kp/2, 128], A packed by pack_a
    (Ap, rs, ps); add: onto what C holds. E [M, PANEL] float32: scratch for a last panel narrower than PANEL."""
    I, M = C.shape[0], C.shape[1]
    nb, P2 = Bp.shape[1], Bp.shape[2]
    N = C.shape[2]
    ldc = C.strides[1] // 4
    for i in range(I):
        a0 = Ap[i].ctypes.data
        b0 = Bp[i].ctypes.data
        c0 = C[i].ctypes.data
        for jb in range(nb):
            ncol = min(PANEL, N - jb * PANEL)
            for k0 in range(0, P2, KC):
                kc = min(KC, P2 - k0)
                b = b0 + 2 * (jb * P2 + k0) * 2 * PANEL
                for m0 in range(0, M, ROWS):
                    r = min(ROWS, M - m0)
                    a = a0 + 4 * (m0 * rs + k0 * ps)
                    if ncol == PANEL:
                        _tile(r, a, rs, ps, b, c0 + 4 * (m0 * ldc + jb * PANEL), ldc, kc,
                              1 if k0 == 0 and not add else 0)
                    else:
                        _tile(r, a, rs, ps, b, E.ctypes.data + 4 * m0 * PANEL, PANEL, kc, 1 if k0 == 0 else 0)
            if ncol < PANEL:
                for m in range(M):
                    for j in range(ncol):
                        if add:
                            C[i, m, jb * PANEL + j] += E[m, j]
                        else:
                            C[i, m, jb * PANEL + j] = E[m, j]


def matmul_packed(a: np.ndarray, Bp: np.ndarray, out: np.ndarray, add: bool = False) -> np.ndarray:
    """out = a @ B in bf16 (float32 accumulation), B given packed by pack_b; a [M, K] or [I, M, K] float32.
    add: out += a @ B (the sums start from out's values: no temporary)."""
    Ap, rs, ps = pack_a(a)
    C = out if out.ndim == 3 else out[None]
    nb = Bp.shape[1]
    if (C.strides[2] != 4 or Ap.shape[0] != Bp.shape[0] or Ap.shape[1] != C.shape[1] * 2 * Bp.shape[2]
            or not (nb - 1) * PANEL < C.shape[2] <= nb * PANEL):
        raise ValueError(f"bf16 product: operands {a.shape}, packed {Bp.shape}, out {out.shape} do not fit")
    E = np.empty((C.shape[1], PANEL) if C.shape[2] % PANEL else (0, PANEL), np.float32)
    _gemm(Ap, rs, ps, Bp, C, E, add)
    return out


def matmul(a: np.ndarray, b: np.ndarray, out: np.ndarray, add: bool = False) -> np.ndarray:
    """out (+)= a @ b with both operands rounded to bfloat16, float32 accumulation (2-D, or 3-D batched)."""
    return matmul_packed(a, pack_b(b), out, add)


def peak_flops(n: int = 1024, seconds: float = 0.3) -> float:
    """Best observed FLOP/s of an n×n×n bf16 product on every core (the rows of A shared by the parts, B
    packed once), over about `seconds`: the bf16 counterpart of perf.matmul_peak_flops."""
    from .parallel import PARTS, chunks, run_parts
    require()
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    Bp = KERNELS.pack_b(rng.standard_normal((n, n), dtype=np.float32))
    out = np.empty((n, n), np.float32)
    rows = chunks(n, PARTS)

    def product():    # through KERNELS, as the engine's products: a test's twin stands in here too
        run_parts(lambda k: KERNELS.matmul_packed(a[rows[k][0]:rows[k][1]], Bp, out[rows[k][0]:rows[k][1]]),
                  len(rows))
    product()
    best, deadline = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < deadline or best == float("inf"):
        t = time.perf_counter()
        product()
        best = min(best, time.perf_counter() - t)
    return 2 * n ** 3 / best


KERNELS = SimpleNamespace(pack_b=pack_b, panels_for=panels_for, matmul_packed=matmul_packed, matmul=matmul)


def _twin_pack_b(b, out=None):
    """The float64 twin's "packing": b rounded to bfloat16, as float64 (same shape)."""
    r = round_bf16(b).astype(np.float64)
    if out is None:
        return r
    out[...] = r
    return out


def _twin_matmul_packed(a, Bp, out, add=False):
    product = np.matmul(round_bf16(a).astype(np.float64), Bp)
    if add:
        out += product
    else:
        out[...] = product


TWIN = SimpleNamespace(pack_b=_twin_pack_b, panels_for=lambda K, N: np.empty((K, N)),
                       matmul_packed=_twin_matmul_packed,
                       matmul=lambda a, b, out, add=False: _twin_matmul_packed(a, _twin_pack_b(b), out, add))


def products(dtype) -> SimpleNamespace:
    """The bf16 products for arrays of dtype: the kernels (float32; refused without AVX512_BF16) or the
    float64 twin; pack_b(b [, out]), panels_for(K, N) (an empty out for pack_b of a [K, N]),
    matmul_packed(a, packed, out [, add]), matmul(a, b, out [, add])."""
    if np.dtype(dtype) == np.float64:
        return TWIN
    if np.dtype(dtype) != np.float32:
        raise UserError(f"--precision bf16 needs float32 master weights, not {np.dtype(dtype)}")
    require()
    return KERNELS
