"""Each fused numba kernel of the fast engine against the plain NumPy op it replaces (forward + backward,
shapes of one `big` step: N = 4096 rows), the measurement behind choosing numba for them; attention is
the engine's (kernels around batched BLAS products) against ops/attention.py. Kernels and attention run
on one core on both sides, as the engine runs them (one sub-batch per core, BLAS single-threaded); AdamW
uses every core. Also the exp that the kernels use, since numba's own math.exp is a scalar libm call here.

    python bench/kernels_vs_numpy.py
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
from numba import njit, prange  # noqa: E402

from nanoeuler import ops  # noqa: E402
from nanoeuler.fast import engine  # noqa: E402
from nanoeuler.fast import kernels as K  # noqa: E402
from nanoeuler.fast.parallel import single_threaded_blas  # noqa: E402
from nanoeuler.optim import AdamW  # noqa: E402


@njit(parallel=True, cache=True)
def _libm_exp(x, out):
    for i in prange(x.shape[0]):
        out[i] = np.exp(x[i])


@njit(parallel=True, cache=True)
def _vexp(x, out):
    for i in prange(x.shape[0]):
        out[i] = K.vexp(x[i])


def best_ms(fn, reps=5):
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def main() -> int:
    rng = np.random.default_rng(0)
    f32 = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    N, d, F, V, B, H, Hkv, T, hd = 4096, 384, 1024, 4096, 16, 6, 2, 256, 64
    rows = []

    x = f32(16_000_000)
    out = np.empty_like(x)
    rows.append(("exp, 16 M float32", best_ms(lambda: np.exp(x, out=out)), best_ms(lambda: _vexp(x, out)),
                 f"numba math.exp: {best_ms(lambda: _libm_exp(x, out)):.1f} ms"))

    xr, w, dy = f32(N, d), f32(d), f32(N, d)
    y, r, dx, dw = np.empty_like(xr), np.empty(N, np.float32), np.zeros_like(xr), np.empty(d)

    def rms_np():
        _, c = ops.rmsnorm_forward(xr, w, 1e-5)
        ops.rmsnorm_backward(dy, c)

    def rms_nb():
        K.rmsnorm_forward(xr, w, np.float32(1e-5), y, r)
        K.rmsnorm_backward(dy, xr, r, w, dx, dw)
    rows.append(("rmsnorm fwd+bwd [4096, 384]", best_ms(rms_np), best_ms(rms_nb), ""))

    gu, ds = f32(N, 2 * F), f32(N, F)
    s = np.empty((N, F), np.float32)

    def swi_np():
        _, c = ops.swiglu_forward(gu[:, :F], gu[:, F:])
        ops.swiglu_backward(ds, c)

    def swi_nb():
        g2 = gu.copy()
        K.swiglu_forward(g2, s)
        K.swiglu_backward(ds, g2)
    rows.append(("swiglu fwd+bwd [4096, 1024]", best_ms(swi_np), best_ms(swi_nb), "numba incl. a 32 MB copy"))

    z, tgt = f32(N, V), rng.integers(0, V, N)
    losses = np.empty(N)

    def ce_np():
        _, c = ops.cross_entropy_forward(z, tgt)
        ops.cross_entropy_backward(1.0, c)

    def ce_nb():
        z2 = z.copy()
        K.cross_entropy(z2, tgt, np.full(N, 1 / N, np.float32), losses, True)
    rows.append(("cross-entropy fwd+bwd [4096, 4096]", best_ms(ce_np), best_ms(ce_nb), "numba incl. a 64 MB copy"))

    qkv = f32(N, (H + 2 * Hkv) * hd) * 0.3
    cos, sin = ops.rope_tables(T, ops.inv_freq(hd, 10000.0), np.float32)
    G = H // Hkv
    A, dqkv, dA = np.empty((N, H * hd), np.float32), np.empty_like(qkv), f32(N, H * hd)
    q, y, dy, dq = (np.empty((B * Hkv, G * T, hd), np.float32) for _ in range(4))
    k, v, dk, dv = (np.empty((B * Hkv, T, hd), np.float32) for _ in range(4))
    P, dS = np.empty((B * Hkv, G * T, T), np.float32), np.empty((B * Hkv, G * T, T), np.float32)
    rope, qscale = (cos, sin), np.float32(hd ** -0.5)

    def att_np():
        q = qkv[:, :H * hd].reshape(B, T, H, hd).transpose(0, 2, 1, 3)
        k = qkv[:, H * hd:(H + Hkv) * hd].reshape(B, T, Hkv, hd).transpose(0, 2, 1, 3)
        v = qkv[:, (H + Hkv) * hd:].reshape(B, T, Hkv, hd).transpose(0, 2, 1, 3)
        q, cq = ops.rope_forward(q, cos, sin)
        k, ck = ops.rope_forward(k, cos, sin)
        a, c = ops.attention_forward(q, k, v)
        dq, dk, dv = ops.attention_backward(dA.reshape(B, T, H, hd).transpose(0, 2, 1, 3), c)
        ops.rope_backward(dq, cq), ops.rope_backward(dk, ck)

    def att_nb():
        engine.attention_forward(qkv, rope, qscale, Hkv, q, k, v, P, y, A)
        engine.attention_backward(dA, rope, qscale, Hkv, q, k, v, P, dy, dS, dq, dk, dv, dqkv)
    rows.append(("RoPE + causal GQA attention fwd+bwd", best_ms(att_np, 2), best_ms(att_nb, 2), "B=16 H=6/2 T=256 hd=64"))

    shapes = {"a": (4096, 384), "b": (1024, 384), "c": (384,)}
    params = {n: f32(*sh) for n, sh in shapes.items()}
    grads = {n: f32(*sh) for n, sh in shapes.items()}
    strided = {n: np.stack([g, g], -1)[..., 0] for n, g in grads.items()}  # non-contiguous: the NumPy path
    opt = AdamW(params)
    rows.append(("AdamW step, 2 M params", best_ms(lambda: opt.step(params, strided)),
                 best_ms(lambda: opt.step(params, grads)), ""))

    print(f"{'kernel':38s} {'NumPy ms':>9s} {'fast ms':>9s} {'speed-up':>8s}")
    for name, a, b, note in rows:
        print(f"{name:38s} {a:9.1f} {b:9.1f} {a / b:7.1f}x  {note}")
    return 0


if __name__ == "__main__":
    with single_threaded_blas():
        code = main()
    sys.exit(code)
