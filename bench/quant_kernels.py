"""The matrix products of one decoded token, and of a prompt, per weight type: float32 and float16 panels
(infer/gemv.py) against every block type in integers (infer/qkernels.py, AVX512-VNNI: Q8_0, Q4_0, Q4_1,
Q5_0, Q5_1, and the K types Q4_K, Q5_K, Q6_K), on the shapes of SmolLM-135M (30 layers, d 576, 9/3 heads
of 64, ffn 1536, vocab 49152: past any L3 at every type), of `llama512` (the same with d 512, 8/4 heads:
every width a multiple of 256, which the K types need) and of the `big` preset (4 layers, d 384, 6/2 heads,
ffn 1024, vocab 4096: in L3). A type whose blocks do not divide a shape's widths is left out of it. The
weights are random (speed does not depend on them; the K types' blocks are random bytes).

`decode` runs a token's products (per layer qkv, wo, gate_up, down; then the vocabulary head) for one row,
the panels of each product split evenly over --threads threads (each thread takes its share of every
product, without a barrier between products, so the figure is the kernels' and the memory's, not the
thread pool's), best of --repeat; GB/s = the kernel form's bytes read per token / time (B/w: the type's
bytes per weight in a file), x f32 = float32's time / this type's, both measured in the same run. `float-x` is the other
way to multiply quantized weights: activations kept float32 and the weights widened to float32 in
registers (byte -> int -> float, then float multiply-adds, `_float_panel` below): the same bytes, ~4x the
instructions of one `vpdpbusd` per 64 byte products. `pp` runs a --prompt-row prompt through every
layer's products once (rows MAX_R at a time over each panel) and reports prompt rows/s.

    python bench/quant_kernels.py                      # every shape, 1 and 2 threads
    python bench/quant_kernels.py --shapes big --threads 1 --repeat 3
"""
from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
from llvmlite import ir  # noqa: E402
from numba import njit, types  # noqa: E402
from numba.extending import intrinsic  # noqa: E402

from nanoeuler.infer import float16, gemv  # noqa: E402
from nanoeuler.infer import qkernels as qk  # noqa: E402
from nanoeuler.infer import quant  # noqa: E402

SHAPES = {  # layers, d, qkv outputs, ffn, vocab
    "smollm135m": (30, 576, (9 + 2 * 3) * 64, 1536, 49152),
    "llama512": (30, 512, (8 + 2 * 4) * 64, 1536, 49152),
    "big": (4, 384, (6 + 2 * 2) * 64, 1024, 4096),
}
TYPES = quant.decodable()
FLOAT_X = ("q8_0", "q4_0", "q4_1")  # the types _float_panel_intrinsic reads


# ---- the alternative measured: float activations, quantized weights widened in registers ---------------------
def _float_panel_intrinsic(name: str):
    """(w, x, sx, t, nb): one row, t[j] = Σ_b dw[b, j]·(Σ_i u[b, j, i]·x[32b + i] - offset·sx[b]) (+ mw·sx:
    Q4_1), x float32 [nb·32], sx[b] = Σ of x's block b; the panel as qkernels.pack lays it out."""
    g = qk.GEOMETRY[name]
    head, offset = g.head, g.offset
    L, I64, F32, IVEC, FVEC = qk.LANES, qk.I64, qk.F32, qk.IVEC, qk.FVEC

    def codegen(context, builder, sig, args):
        w, x, sxa, t, nb = args
        fma = qk.ir_function(builder, f"llvm.fma.v{L}f32", FVEC, [FVEC] * 3)
        bp, xp = builder.inttoptr(w, qk.I8.as_pointer()), builder.inttoptr(x, F32.as_pointer())
        sp = builder.inttoptr(sxa, F32.as_pointer())
        entry, loop, done = builder.block, builder.append_basic_block("f"), builder.append_basic_block("f.end")
        builder.branch(loop)
        builder.position_at_end(loop)
        b = builder.phi(I64)
        acc = [builder.phi(FVEC) for _ in range(qk.VECS)]
        blk = builder.mul(b, ir.Constant(I64, g.stride))
        dw = qk.ir_halves(builder, bp, blk)
        mw = qk.ir_halves(builder, bp, qk.ir_off(builder, blk, 2 * qk.PANEL)) if g.minimum else None
        x32 = builder.mul(b, ir.Constant(I64, 32))
        xs = [qk.ir_splat(builder, builder.load(builder.gep(xp, [builder.add(x32, ir.Constant(I64, i))])), FVEC)
              for i in range(32)]
        sx = qk.ir_splat(builder, builder.load(builder.gep(sp, [b])), FVEC)
        low4, mask = ir.Constant(IVEC, [0x0F0F0F0F] * L), ir.Constant(IVEC, [0xFF] * L)
        per = 8 if g.bits == 8 else 4
        new = []
        for v in range(qk.VECS):
            words = []
            for s in range(per):
                raw = builder.load(qk.ir_at(builder, bp, builder.add(blk, ir.Constant(I64, head + (v * per + s) * 64)),
                                            IVEC), align=1)
                words += [raw] if g.bits == 8 else [builder.and_(raw, low4),
                                                  builder.and_(builder.lshr(raw, ir.Constant(IVEC, [4] * L)), low4)]
            part = ir.Constant(FVEC, [0.0] * L)
            for u, word in enumerate(words):
                for k in range(4):
                    byte = builder.and_(builder.lshr(word, ir.Constant(IVEC, [8 * k] * L)), mask)
                    part = builder.call(fma, [builder.sitofp(byte, FVEC), xs[4 * u + k], part])
            if offset:
                part = builder.fsub(part, builder.fmul(sx, ir.Constant(FVEC, [float(offset)] * L)))
            a = builder.call(fma, [part, dw[v], acc[v]])
            new.append(builder.call(fma, [mw[v], sx, a]) if g.minimum else a)
        qk.ir_close_loop(builder, b, acc, new, entry, nb, loop, done)
        tp = builder.inttoptr(t, F32.as_pointer())
        for k, a in enumerate(new):
            builder.store(a, builder.bitcast(builder.gep(tp, [ir.Constant(I64, k * L)]), FVEC.as_pointer()), align=4)
        return context.get_dummy_value()

    def typer(typingctx, w, x, sx, t, nb):
        return types.void(*[types.int64] * 5), codegen
    typer.__name__ = f"_fpanel_{name}"
    return intrinsic(typer)


_f8, _f40, _f41 = (_float_panel_intrinsic(name) for name in FLOAT_X)


@njit(cache=True, nogil=True)
def _float_panels(kind, W, x, Y, f0, f1):
    """One row: Y[panels f0 .. f1 of it] = W @ x, activations float32 (see _float_panel_intrinsic)."""
    nb = W.shape[1]
    sx = np.empty(nb, np.float32)
    for b in range(nb):
        sx[b] = x[b * 32:(b + 1) * 32].sum()
    T = np.empty(qk.PANEL, np.float32)
    for p in range(f0, f1):
        if kind == 3:
            _f8(W[p].ctypes.data, x.ctypes.data, sx.ctypes.data, T.ctypes.data, nb)
        elif kind == 4:
            _f40(W[p].ctypes.data, x.ctypes.data, sx.ctypes.data, T.ctypes.data, nb)
        else:
            _f41(W[p].ctypes.data, x.ctypes.data, sx.ctypes.data, T.ctypes.data, nb)
        m = min(qk.PANEL, Y.shape[0] - p * qk.PANEL)
        Y[p * qk.PANEL:p * qk.PANEL + m] = T[:m]


# ---- one share of a token's products -------------------------------------------------------------------------
@njit(cache=True, nogil=True)
def _float_share(half, mats, outs, X, share, shares):
    """Panels share::shares... of every matrix in turn, float32 / float16 panels (infer/gemv.py)."""
    T = np.empty((gemv.MAX_R, gemv.PANEL), np.float32)
    for W, Y in zip(mats, outs):
        P = W.shape[0]
        for b in range(P * share // shares, P * (share + 1) // shares):
            gemv.gemv_panel(half, W.ctypes.data, X.ctypes.data, Y.ctypes.data, X.shape[0], Y.shape[1],
                               W.shape[1], False, b, T)


@njit(cache=True, nogil=True)
def _quant_share(kind, mats, outs, X, share, shares):
    """The same for quantized panels (activations quantized per product, as the decode step does)."""
    for W, Y in zip(mats, outs):
        xq, xd, xs = qk.quantize_rows(kind, np.ascontiguousarray(X[:, :W.shape[1] * qk.block_inputs(kind)]))
        P = W.shape[0]
        qk.panels(kind, W, xq, xd, xs, Y, False, P * share // shares, P * (share + 1) // shares)


@njit(cache=True, nogil=True)
def _floatx_share(kind, mats, outs, X, share, shares):
    for W, Y in zip(mats, outs):
        P = W.shape[0]
        _float_panels(kind, W, X[0, :W.shape[1] * 32], Y[0], P * share // shares, P * (share + 1) // shares)


def dims_of(shape) -> list:
    """The (out, in) of a token's matrices: per layer qkv, wo, gate_up, down; then the head."""
    layers, d, qkv, ffn, vocab = SHAPES[shape]
    return [(qkv, d), (d, d), (2 * ffn, d), (d, ffn)] * layers + [(vocab, d)]


def blocks(wtype: str, O: int, I: int, rng) -> np.ndarray:
    """Random weights [O, I] in a block type: quantized, or (K types: no quantizer) random bytes with small
    float16 super-block scales."""
    t = quant.WTYPES[wtype]
    if t.quantize:
        return quant.quantize(rng.standard_normal((O, I), np.float32) * np.float32(0.05), wtype)
    B = rng.integers(0, 256, (O * I // t.block, t.nbytes), dtype=np.uint8)
    for at in ((208,) if wtype == "q6_k" else (0, 2)):
        B[:, at:at + 2] = np.array([1e-3], np.float16).view(np.uint8)
    return B.reshape(O, -1)


def model(shape, wtype: str, rng):
    """The matrices of a token, in kernel form: (list of packed arrays, the bytes a token reads of them)."""
    mats = []
    for O, I in dims_of(shape):
        if wtype in ("float32", "float16"):
            W = rng.standard_normal((O, I), np.float32) * np.float32(0.05)
            mats.append(gemv.pack(W if wtype == "float32" else float16.half_bits(W)))
        else:
            mats.append(qk.pack(blocks(wtype, O, I, rng), wtype, I))
    return mats, sum(W.nbytes for W in mats)


def timed(fn, args_per_thread, repeat: int) -> float:
    """Best wall time of running fn(*args) on one thread per args tuple, together."""
    best = np.inf
    for _ in range(repeat):
        ths = [threading.Thread(target=fn, args=a) for a in args_per_thread[1:]]
        t0 = time.perf_counter()
        for th in ths:
            th.start()
        fn(*args_per_thread[0])
        for th in ths:
            th.join()
        best = min(best, time.perf_counter() - t0)
    return best


def run(shape: str, threads: list[int], repeat: int, prompt: int) -> None:
    rng = np.random.default_rng(0)
    dims = dims_of(shape)
    d_max = max(I for _, I in dims)
    base = {}  # (label, threads) -> float32's time, for the ratio
    for wtype in TYPES:
        t_ = quant.WTYPES[wtype]
        if any(I % t_.block for _, I in dims):
            print(f"{shape:>10} {wtype:>7}: skipped (its {t_.block}-weight blocks do not divide every width)")
            continue
        mats, nbytes = model(shape, wtype, rng)
        for rows, label in ((1, "decode"), (prompt, f"pp{prompt}")):
            X = rng.standard_normal((rows, d_max), np.float32)
            outs = [np.empty((rows, O), np.float32) for O, _ in dims]
            use = mats if rows == 1 else mats[:-1]  # a prompt's rows skip the head (only the last row needs it)
            M, Y = tuple(use), tuple(outs[:len(use)])
            Xs = [np.ascontiguousarray(X[:, :I]) for _, I in dims[:len(use)]]
            kinds = [("ints", _quant_share, qk.KINDS[wtype])] if wtype in qk.KINDS else \
                [("float", _float_share, int(wtype == "float16"))]
            if wtype in FLOAT_X and rows == 1:
                kinds.append(("float-x", _floatx_share, qk.KINDS[wtype]))
            for how, fn, kind in kinds:
                for th in threads:
                    if fn is _float_share:  # per matrix its own X width: run matrix by matrix
                        def one(share, shares, fn=fn, kind=kind):
                            for W, Yo, Xi in zip(M, Y, Xs):
                                fn(kind, (W,), (Yo,), Xi, share, shares)
                    else:
                        def one(share, shares, fn=fn, kind=kind):
                            fn(kind, M, Y, X, share, shares)
                    one(0, 1)  # compile / warm
                    t = timed(one, [(s, th) for s in range(th)], repeat if rows == 1 else 1)
                    base.setdefault((label, th), t)
                    head = f"{shape:>10} {wtype:>7} {t_.bytes_per_weight:6.4f} B/w {how:>7} {label:>7} {th} thr:"
                    if rows == 1:
                        print(f"{head} {t * 1e3:8.2f} ms/token {nbytes / t / 1e9:6.1f} GB/s "
                              f"{base[label, th] / t:5.2f} x f32  ({nbytes / 1e6:.0f} MB/token)", flush=True)
                    else:
                        print(f"{head} {t * 1e3:8.1f} ms {rows / t:8.1f} prompt rows/s "
                              f"{base[label, th] / t:5.2f} x f32 (layers' products)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="smollm135m,llama512,big")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--prompt", type=int, default=256)
    args = ap.parse_args()
    qk.require()
    for shape in args.shapes.split(","):
        run(shape, [int(t) for t in args.threads.split(",")], args.repeat, args.prompt)


if __name__ == "__main__":
    main()
