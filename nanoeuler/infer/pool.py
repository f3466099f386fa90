"""The decoding kernels' helper threads, and the two kinds of job they share: a matrix product's panels
(gemv.py, qkernels.py) and a step's attention units (attention_kernels.py).

    on_pool(kernel, *args)          runs kernel(ctl, pooled, *args): the control block, whether this call has helpers
    gemv(ctl, pooled, W, X, Y, add)                       Y (+)= X @ Wᵀ, W in kernel form: its panels shared
    attention(ctl, pooled, t, a, K, V, pos, slot, H, window, p)   a step's attention: its units shared

The calling thread and `threads - 1` helper threads (`set_threads`; default the cores, at most 8) claim units of
the job from a shared counter (a compare-and-swap, so each unit runs once; see `gemv_at`). The caller never
waits for a helper to *arrive*: on a machine busier than its cores a descheduled helper simply does fewer
units, where a fork-join pool (OpenMP, numba's `prange`) stalls at every product until its last thread is
scheduled again (on a loaded machine, a collapse of the decoding speed). Every output is computed whole by
one thread with the same code, so the result does not depend on the number of threads, bit for bit. A step of
many rows at long positions (serve's streams) shares its attention the same way, a row and a key/value head
per unit (POOLED_ATTENTION: enough work to pay for it).
"""
from __future__ import annotations

import atexit
import os
import platform
import threading

import numpy as np
from llvmlite import ir
from numba import carray, njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from . import qkernels
from .attention_kernels import attend_unit
from .gemv import MAX_R, OPTS, PANEL, QUANT, f32_at, form_kind, gemv_panel


# ---- atomics, and arrays from addresses ------------------------------------------------------------
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
    """The spin-wait hint (x86 `pause`: a short wait, without memory-order speculation while polling)."""
    def codegen(context, builder, sig, args):
        if _X86:
            fnty = ir.FunctionType(ir.VoidType(), [])
            fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.x86.sse2.pause")
            builder.call(fn, [])
        return context.get_dummy_value()
    return types.void(), codegen


@intrinsic
def _i64_at(typingctx, addr):
    def codegen(context, builder, sig, args):
        return builder.inttoptr(args[0], ir.PointerType(ir.IntType(64)))
    return types.CPointer(types.int64)(types.int64), codegen


# The control block shared by the threads (int64): the claim word and the done count sit on their own
# cache lines; the descriptor says what the current job is: a matrix product (its kernel kind, gemv.form_kind:
# 0 float32 weights, 1 float16 bits, from QUANT a block type; then W, out, in, X, n, Y, add, and for a block
# type the address of X's 8-bit rows as X, their scales and sums at + 8, + 9) or a step's attention (kind
# ATTEND; see attention).
CLAIM, DONE, STOP, GEN, DESC = 0, 8, 16, 24, 32
ATTEND = 2
SPIN = 8192  # polls (with `pause`) a waiting thread spins before it yields its core to others: the jobs of a
#              step follow each other closer than that, calls do not


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
                gemv_panel(kind, Wa, Xa, Ya, n, O, I, add, j, T)
    _add(ctl, DONE, k)
    return True


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


# ---- the jobs: a matrix product, a step's attention ----------------------------------------------
@njit(**OPTS)
def gemv(ctl, pooled, W, X, Y, add):
    """Y (+)= X @ Wᵀ: W in kernel form (`pack`: [panels, in, PANEL], or a block type's: qkernels.pack), X [n, in],
    Y [n, out] float32 C-contiguous, out <= panels·PANEL; by the calling thread and whichever helpers are awake
    (`gemv_at`)."""
    gemv_at(ctl, pooled, np.int64(form_kind(W)), np.int64(W.ctypes.data), W.shape[0], X, Y, bool(add))   # no literals


@njit(**OPTS)
def gemv_at(ctl, pooled, kind, Wa, nb, X, Y, add):
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
            gemv_panel(kind, Wa, np.int64(X.ctypes.data), Ya, n, O, I, flag, b, T)
        return
    ctl[DESC], ctl[DESC + 1], ctl[DESC + 2], ctl[DESC + 3] = kind, Wa, O, I
    ctl[DESC + 4], ctl[DESC + 5], ctl[DESC + 6], ctl[DESC + 7] = X.ctypes.data, n, Y.ctypes.data, add
    _run_pooled(ctl, nb)


POOLED_ATTENTION = 1 << 17  # multiply-adds (positions x heads x hd, all rows) from which helpers share it


@njit(**OPTS)
def _attend_units(ctl, u0, u1):
    """Units u0 .. u1 - 1 of the attention job in the descriptor (a helper's claim; see attention)."""
    ta, tw, aa, ka, va = ctl[DESC + 1], ctl[DESC + 2], ctl[DESC + 3], ctl[DESC + 4], ctl[DESC + 5]
    pa, sa, H, Hkv = ctl[DESC + 6], ctl[DESC + 7], ctl[DESC + 8], ctl[DESC + 9]
    hd, L, B, n = ctl[DESC + 10], ctl[DESC + 11], ctl[DESC + 12], ctl[DESC + 13]
    window, cap = ctl[DESC + 14], ctl[DESC + 15:DESC + 16].view(np.float32)[0]
    t, a = carray(f32_at(ta), (n, tw)), carray(f32_at(aa), (n, H * hd))
    K, V = carray(f32_at(ka), (B, Hkv, L, hd)), carray(f32_at(va), (B, Hkv, L, hd))
    pos, slot = carray(_i64_at(pa), n), carray(_i64_at(sa), n)
    p = np.empty(L, np.float32)
    for u in range(u0, u1):
        attend_unit(t, a, K, V, pos, slot, H, window, u, p, cap)


@njit(**OPTS)
def attention(ctl, pooled, t, a, K, V, pos, slot, H, window, p, cap):
    """Every row's attention of one layer (attention_kernels.attend_unit; cap float32: the scores' soft cap, 0
    none), units shared with the helpers (as the panels of a matrix product) when there is enough of it: a batch
    of serve's streams, not one sequence's step. (The claim word counts units in 16 bits: more than 0xFFFF run
    on the calling thread; the cap travels as the bits of the descriptor's last word's first half.)"""
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
        ctl[DESC + 15:DESC + 16].view(np.float32)[0] = cap
        _run_pooled(ctl, units)
        return
    for u in range(units):
        attend_unit(t, a, K, V, pos, slot, H, window, u, p, cap)


# ---- the threads ---------------------------------------------------------------------------------
class _Pool:
    """Helper threads for the kernels' matrix products (`gemv`, and `attention`): `threads - 1` Python threads, each
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
    from numba's disk cache: docs/benchmarks.md) while the caller goes on (packing a model's weights), then
    sleeps."""
    if _POOL.acquire():
        _POOL.release()


def set_threads(n: int) -> None:
    """Decode with n threads (default: the cores this process may use, at most 8)."""
    _POOL.set_threads(n)


def get_threads() -> int:
    return _POOL.threads


def on_pool(kernel, *args):
    """kernel(ctl, pooled, *args) on the pool: its helper threads share the work where no other call holds it.
    (A plain function: a contextlib context manager would add a generator to every call.)"""
    pool = _POOL
    held = pool.acquire()
    try:
        return kernel(pool.ctl, held, *args)
    finally:
        if held:
            pool.release()
