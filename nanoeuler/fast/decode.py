"""The fused decoding step: the KV-cache forward of 1..ROWS new tokens of one sequence in one numba call.

`generate.forward_hidden` (the readable NumPy reference) makes ~16 matrix products and ~100 small NumPy
calls per token; at one token a step each of them is too short for BLAS or NumPy to pay for its own
overhead (big preset: 2.2 ms a token, of which the matrix-vector products are < 1 ms). `forward` here is
the same mathematics in one compiled call, layer after layer on preallocated rows:

    x = embed[tokens]                                           [n, d]
    per layer:  h = rmsnorm(x)·w;  qkv = h @ Wqkvᵀ  (one GEMV)      [n, (H + 2·Hkv)·hd]
                RoPE on q and k; k, v written at positions L0 .. L0+n-1 of the cache
                a = softmax(q·kᵀ / sqrt(hd)) v over positions 0 .. L0+r (row r)      [n, H·hd]
                x += a @ Woᵀ;  h = rmsnorm(x)·w;  x += (silu(g)·u) @ Wdownᵀ with [g u] = h @ Wgate_upᵀ
    h = rmsnorm(x)·w  (all rows, or the last only)              [n|1, d]

and `matvec` is the matrix product of the heads (x [n, in] @ W[out, in]ᵀ) on the same machinery.
generate.py's `forward_hidden` and `linear` call them for one sequence of up to ROWS rows (plain decoding,
speculative verification, short prompts); longer blocks and batches stay on the NumPy path.

Matrix-vector products: each output is one dot product of a weight row with x. The dot products
accumulate in float32 with `fastmath` reassociation (LLVM vectorises them into 16-wide FMAs; the order of
the sum is not NumPy's, so results equal the reference to rounding: tests/test_decode.py checks ≤ 1e-5
relative on the logits). At one row they are bound by memory traffic: 31 MB of float32 weights per token
on `big` (the ~100 µs of attention, norms and SwiGLU are small beside it).

float16 weights halve that traffic. They are kept as their IEEE half bits (uint16 arrays: numba has no
float16 type on the CPU) and widened inside the dot product by `to_f32`, an LLVM `fpext half -> float`
that x86 executes as one vcvtph2ps per 16 values (F16C), so the loop still vectorises; the arithmetic stays
float32. A float16 model therefore decodes as the float32 model whose weights were rounded to float16.

    W16 = half_bits(W)            # W.astype(np.float16).view(np.uint16)
    matvec(W16, x[None]) == x @ W.astype(np.float16).astype(np.float32).T   (to float32 rounding)

Several rows (a speculative verification of 2..K tokens) share each pass over a weight row: 4, 3 and 2 rows at
a time, each weight read and widened once for them (2 rows cost ~1.1-1.3x one on `big`).

Threads: the products are cut into blocks of BLOCK output rows, and the calling thread and `threads - 1`
helper threads (`set_threads`; default the cores, at most 8) claim blocks from a shared counter (a
compare-and-swap, so each block runs once; see `_gemv`). The caller never waits for a helper to *arrive*:
on a machine busier than its cores a descheduled helper simply does fewer blocks, where a fork-join pool
(OpenMP, numba's `prange`) stalls at every product until its last thread is scheduled again (measured
here: 7 tokens/s instead of 420 on `big` at load 4.6 on 2 cores). Every output is computed whole by one
thread with the same code, so the result does not depend on the number of threads, bit for bit.

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

from .vmath import vexp

BLOCK = 16        # output rows per unit of work a thread claims
ROWS = 8          # most rows `linear` and serve's batcher send to the kernels (more: BLAS is as fast)
CHUNK = 32        # a prompt's tokens per fused call (generate.forward_hidden)
ENABLED = True    # False: every decoding step takes generate.py's NumPy reference path (tests, bench)
FAST = {"reassoc", "contract"}  # reorder sums, fuse multiply-adds; no assumptions on inf/nan
OPTS = dict(cache=True, nogil=True, error_model="numpy", fastmath=FAST)


# ---- float16 bits -> float32 ---------------------------------------------------------------------
@intrinsic
def _half_to_f32(typingctx, bits):
    """The float16 whose IEEE bits are `bits` (uint16), as float32: bitcast to half, fpext to float."""
    sig = types.float32(types.uint16)

    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return sig, codegen


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
def _u16_at(typingctx, addr):
    def codegen(context, builder, sig, args):
        return builder.inttoptr(args[0], ir.PointerType(ir.IntType(16)))
    return types.CPointer(types.uint16)(types.int64), codegen


# ---- small pieces (inlined into the kernels) -------------------------------------------------------
@njit(inline="always", **OPTS)
def _dot(w, x, n):
    """Σ w[:n]·x[:n] in float32 (w float32 or float16 bits)."""
    s = np.float32(0.0)
    for i in range(n):
        s += to_f32(w[i]) * x[i]
    return s


@njit(inline="always", **OPTS)
def _dot4(w, X, r, n):
    """Σ w[:n]·X[r+j, :n] for j = 0..3 in one pass over w (each weight widened once, read for 4 rows)."""
    x0, x1, x2, x3 = X[r], X[r + 1], X[r + 2], X[r + 3]
    s0 = s1 = s2 = s3 = np.float32(0.0)
    for i in range(n):
        wi = to_f32(w[i])
        s0 += wi * x0[i]
        s1 += wi * x1[i]
        s2 += wi * x2[i]
        s3 += wi * x3[i]
    return s0, s1, s2, s3


@njit(inline="always", **OPTS)
def _dot3(w, X, r, n):
    """Σ w[:n]·X[r+j, :n] for j = 0..2 in one pass over w (a verification of 2 drafts: 3 rows for ~1 row's reads)."""
    x0, x1, x2 = X[r], X[r + 1], X[r + 2]
    s0 = s1 = s2 = np.float32(0.0)
    for i in range(n):
        wi = to_f32(w[i])
        s0 += wi * x0[i]
        s1 += wi * x1[i]
        s2 += wi * x2[i]
    return s0, s1, s2


@njit(inline="always", **OPTS)
def _dot2(w, X, r, n):
    """Σ w[:n]·X[r+j, :n] for j = 0, 1 in one pass over w."""
    x0, x1 = X[r], X[r + 1]
    s0 = s1 = np.float32(0.0)
    for i in range(n):
        wi = to_f32(w[i])
        s0 += wi * x0[i]
        s1 += wi * x1[i]
    return s0, s1


@njit(inline="always", **OPTS)
def _put(Y, r, o, s, add):
    Y[r, o] = Y[r, o] + s if add else s


@njit(**OPTS)
def _gemv_block(W, X, Y, add, b):
    """Output rows b·BLOCK .. of Y (+)= X @ Wᵀ: W [out, in], X [n, in], Y [n, out]. The rows of X go 4 at a
    time, the rest 3, 2 or 1 at once, so that a weight row is read (and widened) about n/4 times, not n."""
    O, I = W.shape
    n = X.shape[0]
    for o in range(b * BLOCK, min(O, (b + 1) * BLOCK)):
        w = W[o]
        r = 0
        while r + 4 <= n:
            s0, s1, s2, s3 = _dot4(w, X, r, I)
            _put(Y, r, o, s0, add)
            _put(Y, r + 1, o, s1, add)
            _put(Y, r + 2, o, s2, add)
            _put(Y, r + 3, o, s3, add)
            r += 4
        if r + 3 == n:
            s0, s1, s2 = _dot3(w, X, r, I)
            _put(Y, r, o, s0, add)
            _put(Y, r + 1, o, s1, add)
            _put(Y, r + 2, o, s2, add)
            r += 3
        if r + 2 <= n:
            s0, s1 = _dot2(w, X, r, I)
            _put(Y, r, o, s0, add)
            _put(Y, r + 1, o, s1, add)
            r += 2
        if r < n:
            _put(Y, r, o, _dot(w, X[r], I), add)


def _kind(W):
    return 0


@overload(_kind, inline="always")
def _kind_impl(W):
    half = isinstance(W.dtype, types.Integer)
    return (lambda W: 1) if half else (lambda W: 0)


# The control block shared by the threads (int64): the claim word and the done count sit on their own
# cache lines; the descriptor says what the current job is.
CLAIM, DONE, STOP, GEN, DESC = 0, 8, 16, 24, 32   # DESC: kind, W, out, in, X, n, Y, add
SPIN = 8192  # polls (with `pause`: ~0.2-1 ms) a waiting thread spins before it yields its core to others


@njit(**OPTS)
def _run_claimed(ctl, w):
    """Claim blocks of the job in the descriptor, if the claim word is still w (its next block on): a
    quarter of those left (at least one), so that a job of many blocks takes few claims ("guided"
    scheduling: each claim is a cache line passed between cores). Whether the claim succeeded."""
    kind, Wa, O, I = ctl[DESC], ctl[DESC + 1], ctl[DESC + 2], ctl[DESC + 3]
    Xa, n, Ya, add = ctl[DESC + 4], ctl[DESC + 5], ctl[DESC + 6], ctl[DESC + 7] != 0
    b, nb = w & 0xFFFF, (w >> 16) & 0xFFFF
    k = max(1, (nb - b) >> 2)
    if not _cas(ctl, CLAIM, w, w + k):
        return False
    X, Y = carray(_f32_at(Xa), (n, I)), carray(_f32_at(Ya), (n, O))
    for j in range(b, b + k):
        if kind == 0:
            _gemv_block(carray(_f32_at(Wa), (O, I)), X, Y, add, j)
        else:
            _gemv_block(carray(_u16_at(Wa), (O, I)), X, Y, add, j)
    _add(ctl, DONE, k)
    return True


@njit(**OPTS)
def _gemv(ctl, pooled, W, X, Y, add):
    """Y (+)= X @ Wᵀ (X, Y C-contiguous), by the calling thread and whichever helpers are awake.

    The job is cut into blocks of BLOCK output rows. The caller publishes it (descriptor, done = 0, then the
    claim word g << 32 | blocks << 16 | next block, g a new job number), then claims blocks itself like any
    helper; a claim is a compare-and-swap of the claim word, so a block is run once, and a helper that
    read a stale descriptor fails its swap. The caller returns when `done` counts every block. It never
    waits for a helper to arrive: a helper that is descheduled (a busy machine) leaves its share to the
    caller, where a fork-join pool (OpenMP) would stall every job until the helper runs again."""
    O, I = W.shape
    nb = (O + BLOCK - 1) // BLOCK
    if not pooled or nb < 2 or nb > 0xFFFF:  # (the claim word counts blocks in 16 bits)
        for b in range(nb):
            _gemv_block(W, X, Y, add, b)
        return
    ctl[DESC], ctl[DESC + 1], ctl[DESC + 2], ctl[DESC + 3] = _kind(W), W.ctypes.data, O, I
    ctl[DESC + 4], ctl[DESC + 5], ctl[DESC + 6], ctl[DESC + 7] = X.ctypes.data, X.shape[0], Y.ctypes.data, add
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
def _rmsnorm(x, w, eps, y):
    """y [n, d] = x·w / sqrt(mean(x²) + eps) row by row (ops/rmsnorm.py)."""
    n, d = x.shape
    for r in range(n):
        ss = np.float32(0.0)
        for j in range(d):
            ss += x[r, j] * x[r, j]
        k = np.float32(1.0 / np.sqrt(ss / d + eps))
        for j in range(d):
            y[r, j] = (x[r, j] * k) * w[j]


@njit(inline="always", **OPTS)
def _rope(x, base, hd, cos, sin, t, out):
    """out[:hd] = x[base : base+hd] rotated to position t (rotate-half: i pairs with i + hd/2; ops/rope.py)."""
    h2 = hd // 2
    for i in range(h2):
        a, b = x[base + i], x[base + h2 + i]
        c, s = cos[t, i], sin[t, i]
        out[i] = a * c - b * s
        out[h2 + i] = b * c + a * s


@njit(**OPTS)
def _attend(q, K, V, Tk, scale, p, out):
    """out [hd] = softmax(K[:Tk] q · scale) V[:Tk] (ops/attention.py for one query); p [>= Tk] scratch."""
    hd = q.shape[0]
    m = np.float32(-np.inf)
    for j in range(Tk):
        p[j] = _dot(K[j], q, hd) * scale
        m = max(m, p[j])
    total = np.float32(0.0)
    for j in range(Tk):
        p[j] = vexp(p[j] - m)
        total += p[j]
    out[:] = 0
    for j in range(Tk):
        vj, pj = V[j], p[j]
        for i in range(hd):
            out[i] += pj * vj[i]
    inv = np.float32(1.0) / total
    for i in range(hd):
        out[i] *= inv


# ---- the kernels ---------------------------------------------------------------------------------
@njit(**OPTS)
def gemv(ctl, pooled, W, X):
    """X [n, in] float32 @ W[out, in]ᵀ (W float32, or float16 bits as uint16) -> [n, out] float32."""
    Y = np.empty((X.shape[0], W.shape[0]), np.float32)
    _gemv(ctl, pooled, W, X, Y, False)
    return Y


@njit(**OPTS)
def step(ctl, pooled, tokens, pos, slot, embed, qkv, wo, gate_up, down, norms, norm, eps, n_heads, kc, vc, cos,
         sin, last_only):
    """The forward of tokens int [n], row r at position pos[r] of cache row slot[r] -> final normed hidden
    states [n|1, d]. One sequence: slot all 0, pos = L0, L0+1, ..; a batch of sequences: one row each.

    embed [V, d]; per layer l: qkv[l] [(H + 2·Hkv)·hd, d], wo[l] [d, H·hd], gate_up[l] [2F, d],
    down[l] [d, F] (float32 or float16 bits), norms[l] = (attn_norm, ffn_norm) [2, d]; norm [d].
    kc, vc [layers, B, Hkv, max_len, hd]: row r writes its key and value at (slot[r], pos[r]) and attends
    to positions 0 .. pos[r] of its slot (all rows write before any attends)."""
    n, d = tokens.shape[0], embed.shape[1]
    n_layers, _, Hkv, _, hd = kc.shape
    H, F = n_heads, down.shape[2]
    G, Hhd = n_heads // Hkv, n_heads * hd
    scale = np.float32(1.0 / np.sqrt(hd))
    x = np.empty((n, d), np.float32)
    for r in range(n):
        if tokens[r] < 0 or tokens[r] >= embed.shape[0]:
            raise IndexError("token id out of range")
        x[r] = embed[tokens[r]]
    h = np.empty((n, d), np.float32)
    t = np.empty((n, qkv.shape[1]), np.float32)     # q, k, v of the new rows
    a = np.empty((n, Hhd), np.float32)              # attention output
    gu = np.empty((n, 2 * F), np.float32)
    s = np.empty((n, F), np.float32)
    p = np.empty(pos.max() + 1, np.float32)         # attention probabilities
    rot = np.empty(hd, np.float32)
    for l in range(n_layers):
        _rmsnorm(x, norms[l, 0], eps, h)
        _gemv(ctl, pooled, qkv[l], h, t, False)
        for r in range(n):  # RoPE; the new keys and values go into the cache
            for hh in range(H):
                _rope(t[r], hh * hd, hd, cos, sin, pos[r], rot)
                t[r, hh * hd:(hh + 1) * hd] = rot
            for g in range(Hkv):
                _rope(t[r], Hhd + g * hd, hd, cos, sin, pos[r], kc[l, slot[r], g, pos[r]])
                vc[l, slot[r], g, pos[r]] = t[r, Hhd + (Hkv + g) * hd:Hhd + (Hkv + g + 1) * hd]
        for r in range(n):  # row r, head hh reads kv head hh // G at positions 0 .. pos[r]
            for hh in range(H):
                _attend(t[r, hh * hd:(hh + 1) * hd], kc[l, slot[r], hh // G], vc[l, slot[r], hh // G], pos[r] + 1,
                        scale, p, a[r, hh * hd:(hh + 1) * hd])
        _gemv(ctl, pooled, wo[l], a, x, True)  # x += a @ Woᵀ
        _rmsnorm(x, norms[l, 1], eps, h)
        _gemv(ctl, pooled, gate_up[l], h, gu, False)
        for r in range(n):  # SwiGLU: silu(g)·u
            for j in range(F):
                g_ = gu[r, j]
                s[r, j] = g_ / (np.float32(1.0) + vexp(-g_)) * gu[r, F + j]
        _gemv(ctl, pooled, down[l], s, x, True)  # x += s @ Wdownᵀ
    first = n - 1 if last_only else 0
    out = np.empty((n - first, d), np.float32)
    _rmsnorm(x[first:], norm, eps, out)
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


def set_threads(n: int) -> None:
    """Decode with n threads (default: the cores this process may use, at most 8)."""
    _POOL.set_threads(n)


def get_threads() -> int:
    return _POOL.threads


# ---- the Python side -----------------------------------------------------------------------------
class Weights(NamedTuple):
    """What `step` reads, stacked over layers (see `step`); matrices float32 or float16 bits (uint16)."""
    embed: np.ndarray    # [V, d] float32
    qkv: np.ndarray      # [layers, (H + 2·Hkv)·hd, d]
    wo: np.ndarray       # [layers, d, H·hd]
    gate_up: np.ndarray  # [layers, 2F, d]
    down: np.ndarray     # [layers, d, F]
    norms: np.ndarray    # [layers, 2, d] float32: attn_norm, ffn_norm
    norm: np.ndarray     # [d] float32


class Float16Model:
    """A model's weights rounded to float16, for decoding: `generate(Float16Model(model), ids, ...)` decodes
    as llama.cpp runs an f16 GGUF (float16 weights, float32 arithmetic), reading half the bytes per token
    of the float32 model. It has what generation needs of a model (config, params, dtype); train, score
    and save the float32 model itself. `sample` / `chat --dtype float16` use it.

        m16 = Float16Model(model); m16.params["embed.weight"].dtype == np.float16
    """

    def __init__(self, model):
        self.config = model.config
        self.params = {name: p.astype(np.float16) for name, p in model.params.items()}
        self.dtype = np.dtype(np.float16)

    def n_params(self) -> int:
        return sum(p.size for p in self.params.values())


def forward(cfg, D: Weights, tokens: np.ndarray, k: np.ndarray, v: np.ndarray, L0: int, cos: np.ndarray,
            sin: np.ndarray, last_only: bool, slot: int = 0) -> np.ndarray:
    """tokens int [n] at positions L0.. of one sequence, cache row `slot` of k, v [layers, B, Hkv, max_len, hd]
    -> final normed hidden states [n|1, d]."""
    n = len(tokens)
    return forward_rows(cfg, D, tokens, np.arange(L0, L0 + n), np.full(n, slot, np.int64), k, v, cos, sin,
                        last_only)


def forward_rows(cfg, D: Weights, tokens: np.ndarray, pos: np.ndarray, slot: np.ndarray, k: np.ndarray,
                 v: np.ndarray, cos: np.ndarray, sin: np.ndarray, last_only: bool = False) -> np.ndarray:
    """tokens int [n], row r at position pos[r] of cache row slot[r] of k, v [layers, B, Hkv, max_len, hd]
    (one sequence, or one row per sequence as serve's batcher steps) -> final normed hidden states [n|1, d]."""
    pool = _POOL
    pooled = pool.acquire()
    try:
        return step(pool.ctl, pooled, np.ascontiguousarray(tokens, dtype=np.int64),
                    np.ascontiguousarray(pos, dtype=np.int64), np.ascontiguousarray(slot, dtype=np.int64), D.embed,
                    D.qkv, D.wo, D.gate_up, D.down, D.norms, D.norm, np.float32(cfg.norm_eps), cfg.n_heads, k, v,
                    cos, sin, last_only)
    finally:
        if pooled:
            pool.release()


def matvec(Wk: np.ndarray, X: np.ndarray) -> np.ndarray:
    """X [n, in] float32 @ Wk[out, in]ᵀ (float32 or float16 bits) -> [n, out], on the pool's threads."""
    pool = _POOL
    pooled = pool.acquire()
    try:
        return gemv(pool.ctl, pooled, Wk, np.ascontiguousarray(X, dtype=np.float32))
    finally:
        if pooled:
            pool.release()
