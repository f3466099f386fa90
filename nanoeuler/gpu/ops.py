"""The GPU ops namespace: the same forward/backward pairs as `nanoeuler.ops`, on CuPy arrays.

`GpuOps(precision)` has every function `nanoeuler.model.forward/backward` calls, with the same names
and signatures, so the model code runs on the GPU unchanged:

    from nanoeuler.model import forward, backward
    logits, caches = forward(cfg, P_gpu, ids_gpu, ops=gpu_ops)      # P_gpu: name -> cupy float32 array

What runs where:
    linear          cuBLAS: fp32 (TF32 if switched on), or bf16 x bf16 -> fp32 in the "bf16" precision
    attention       FlashAttention: fp32 -> flash_attention.cu (CUDA cores, fp32 math); bf16 ->
                    flash_attention_wmma.cu (tensor cores) when hd is a multiple of 16 up to 64
    rmsnorm, rope, swiglu, cross-entropy      fused kernels (fp32)
    embedding       CuPy gather / scatter-add

Caches are this module's own (only its backward reads them), except that `linear_backward` also
accepts the reference cache `(x, W)` that `model.backward` builds for the output heads.
Mixed precision ("bf16"): parameters, gradients and most activations stay fp32 (fp32 master weights);
operands are rounded to bf16 where they enter the tensor cores. Two ops hand bf16 straight to the only
op that reads their output, skipping an fp32 round trip: rope_forward -> attention_forward (q, k) and
swiglu_forward -> linear_forward (the down projection); such outputs are uint16 arrays of bf16 bits.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .. import ops as reference_ops
from ..config import PRECISIONS
from ..errors import UserError
from .matmul import gemm_bf16, to_bf16
from .runtime import THREADS, blocks_for, get_kernel, require_cupy


# FlashAttention launch shapes; they mirror FA_BM and FaConst<HD>::BWD_BN in flash_attention.cu.
FA_BM = 64


def fa_bwd_bn(hd: int) -> int:
    return 64 if hd <= 64 else 32


def _f32(x, what: str):
    """x as a C-contiguous float32 cupy array; UserError for another float dtype."""
    cp = require_cupy()
    if x.dtype != cp.float32:
        raise UserError(f"GPU kernels run in float32; {what} is {x.dtype}")
    return cp.ascontiguousarray(x)


# ---- kernel launchers (shapes in, arrays out) ------------------------------------------------------
# FlashAttention variants: "f32" and "bf16" are flash_attention.cu (CUDA cores, fp32 math; q/k/v stored
# fp32 or bf16), "wmma" is flash_attention_wmma.cu (tensor cores, bf16 operands, hd a multiple of 16, <= 64).
FLASH_KERNELS = ("f32", "bf16", "wmma")
WMMA_THREADS, WMMA_ROWS = 128, 64  # 4 warps; query rows (fwd, dq) or key rows (dkdv) per block


def wmma_supported(hd: int) -> bool:
    return hd % 16 == 0 and hd <= 64


_wmma_ok: dict[int, bool] = {}
_wmma_reason: dict[int, str] = {}


def wmma_available(hd: int) -> bool:
    """Whether the tensor-core kernels compile here (NVRTC needs the CUDA headers); if not, say so in one
    line on stderr (once per head dim) and let the bf16 mode fall back to the CUDA-core FlashAttention
    instead of failing the run. `wmma_unavailable_reason(hd)` keeps the reason for reports."""
    if hd not in _wmma_ok:
        try:
            get_kernel("flash_attention_wmma", "flash_wmma_fwd", (("FA_HD", hd),))
            _wmma_ok[hd] = True
        except Exception as e:  # CompileException, missing headers (UserError), ...
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            _wmma_reason[hd] = f"{type(e).__name__}: {first[:400]}"
            _wmma_ok[hd] = False
            import sys
            print(f"warning: tensor-core FlashAttention (hd={hd}) unavailable, using the CUDA-core kernel instead: "
                  f"{_wmma_reason[hd]}", file=sys.stderr, flush=True)
    return _wmma_ok[hd]


def wmma_unavailable_reason(hd: int) -> str | None:
    """Why the tensor-core kernels did not compile at this head dim (None: they did, or were not tried)."""
    return _wmma_reason.get(hd)


def flash_forward(q, k, v, kernel: str = "f32"):
    """q [B, H, Tq, hd], k/v [B, Hkv, Tk, hd] (float32 for "f32", uint16 bf16 bits otherwise)
    -> o [B, H, Tq, hd] f32, lse [B, H, Tq] f32."""
    cp = require_cupy()
    B, H, Tq, hd = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    o = cp.empty((B, H, Tq, hd), dtype=cp.float32)
    lse = cp.empty((B, H, Tq), dtype=cp.float32)
    args = (q, k, v, o, lse, np.int32(H), np.int32(Hkv), np.int32(Tq), np.int32(Tk), np.float32(1.0 / np.sqrt(hd)))
    if kernel == "wmma":
        get_kernel("flash_attention_wmma", "flash_wmma_fwd", (("FA_HD", hd),))(
            ((Tq + WMMA_ROWS - 1) // WMMA_ROWS, H, B), (WMMA_THREADS,), args)
    else:
        get_kernel("flash_attention", f"flash_fwd_{kernel}", (("FA_HD", hd),))(
            ((Tq + FA_BM - 1) // FA_BM, H, B), (FA_BM,), args)
    return o, lse


def flash_backward(dout, q, k, v, o, lse, kernel: str = "f32"):
    """dout [B, H, Tq, hd] f32 (and the forward's inputs and outputs) -> dq, dk, dv (f32)."""
    cp = require_cupy()
    B, H, Tq, hd = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    defines = (("FA_HD", hd),)
    delta = cp.sum(dout * o, axis=-1, dtype=cp.float32)  # [B, H, Tq]: rowsum(dO ⊙ O)
    dq = cp.empty((B, H, Tq, hd), dtype=cp.float32)
    dk = cp.empty((B, Hkv, Tk, hd), dtype=cp.float32)
    dv = cp.empty((B, Hkv, Tk, hd), dtype=cp.float32)
    dims = (np.int32(H), np.int32(Hkv), np.int32(Tq), np.int32(Tk), np.float32(1.0 / np.sqrt(hd)))
    if kernel == "wmma":
        get_kernel("flash_attention_wmma", "flash_wmma_bwd_dq", defines)(
            ((Tq + WMMA_ROWS - 1) // WMMA_ROWS, H, B), (WMMA_THREADS,), (q, k, v, dout, lse, delta, dq) + dims)
        get_kernel("flash_attention_wmma", "flash_wmma_bwd_dkdv", defines)(
            ((Tk + WMMA_ROWS - 1) // WMMA_ROWS, Hkv, B), (WMMA_THREADS,), (q, k, v, dout, lse, delta, dk, dv) + dims)
        return dq, dk, dv
    get_kernel("flash_attention", f"flash_bwd_dq_{kernel}", defines)(
        ((Tq + FA_BM - 1) // FA_BM, H, B), (FA_BM,), (q, k, v, dout, lse, delta, dq) + dims)
    bn = fa_bwd_bn(hd)
    get_kernel("flash_attention", f"flash_bwd_dkdv_{kernel}", defines)(
        ((Tk + bn - 1) // bn, Hkv, B), (bn,), (q, k, v, dout, lse, delta, dk, dv) + dims)
    return dq, dk, dv


def rmsnorm_fwd(x2, w, eps):
    """x2 [N, d], w [d] -> y [N, d], rstd [N]."""
    cp = require_cupy()
    N, d = x2.shape
    y = cp.empty_like(x2)
    rstd = cp.empty((N,), dtype=cp.float32)
    if N:
        get_kernel("rmsnorm", "rmsnorm_forward")((N,), (THREADS,), (x2, w, y, rstd, np.int32(N), np.int32(d), np.float32(eps)))
    return y, rstd


def rmsnorm_bwd(dy2, x2, w, rstd, n_chunks: int = 64):
    """dy2 [N, d] -> dx [N, d], dw [d]."""
    cp = require_cupy()
    N, d = x2.shape
    dx = cp.empty_like(x2)
    if N == 0:
        return dx, cp.zeros((d,), dtype=cp.float32)
    get_kernel("rmsnorm", "rmsnorm_backward_dx")((N,), (THREADS,), (dy2, x2, w, rstd, dx, np.int32(N), np.int32(d)))
    n_chunks = max(1, min(n_chunks, N))
    partial = cp.empty((n_chunks, d), dtype=cp.float32)
    get_kernel("rmsnorm", "rmsnorm_backward_dw_partial")(((d + THREADS - 1) // THREADS, n_chunks), (THREADS,),
                                                         (dy2, x2, rstd, partial, np.int32(N), np.int32(d)))
    return dx, partial.sum(axis=0)


def rope_rotate(x, cos, sin, sign: float, out_bf16: bool = False):
    """x [B, H, T, hd], cos/sin [T, hd/2] -> x rotated by sign·angle (f32, or bf16 bits if out_bf16)."""
    cp = require_cupy()
    T, half = cos.shape
    y = cp.empty(x.shape, dtype=cp.uint16 if out_bf16 else cp.float32)
    n = x.size // 2
    if n:
        get_kernel("rope", "rope_rotate_bf16" if out_bf16 else "rope_rotate")(
            (blocks_for(n),), (THREADS,), (x, cos, sin, y, np.int64(n), np.int32(T), np.int32(half), np.float32(sign)))
    return y


def ce_forward_rows(z2, targets):
    """z2 [N, V] f32, targets int64 [N] (−1 = ignore) -> per-row loss [N] (0 when ignored), lse [N]."""
    cp = require_cupy()
    N, V = z2.shape
    loss = cp.empty((N,), dtype=cp.float32)
    lse = cp.empty((N,), dtype=cp.float32)
    if N:
        get_kernel("cross_entropy", "ce_forward")((N,), (THREADS,), (z2, targets, loss, lse, np.int32(N), np.int32(V)))
    return loss, lse


def ce_backward_rows(z2, lse, targets, scale: float, out=None):
    """dz [N, V] = (softmax(z) − onehot(t)) · scale on valid rows, 0 on ignored ones; out=z2 works in place."""
    cp = require_cupy()
    N, V = z2.shape
    dz = cp.empty_like(z2) if out is None else out
    if N:
        get_kernel("cross_entropy", "ce_backward")((N,), (THREADS,), (z2, lse, targets, dz, np.int32(N), np.int32(V),
                                                                      np.float32(scale)))
    return dz


class Bf16LinearCache(NamedTuple):
    xb: object  # bf16 bits of x, [N, in]
    Wb: object  # bf16 bits of W, [out, in]
    x_shape: tuple


# ---- the namespace -----------------------------------------------------------------------------------
class GpuOps:
    """Forward/backward pairs on CuPy float32 arrays; names and signatures as in `nanoeuler.ops`."""

    def __init__(self, precision: str = "f32", tensor_core_attention: bool = True):
        if precision not in PRECISIONS:
            raise UserError(f"unknown GPU precision {precision!r}; choose one of {', '.join(PRECISIONS)}")
        self.precision = precision
        self.bf16 = precision == "bf16"
        self.tensor_core_attention = tensor_core_attention  # bf16 only: the WMMA FlashAttention
        self._rope_cache = {}
        self._last_cast = (None, None)  # (x, bf16 copy of x): q/k/v and gate/up read the same x in a row

    def _bf16_input(self, x2):
        """bf16 bits of a linear's input, converted once when consecutive linears share it."""
        last_x, last_xb = self._last_cast
        if last_x is x2:
            return last_xb
        xb = to_bf16(x2)
        self._last_cast = (x2, xb)
        return xb

    def flash_kernel(self, hd: int) -> str:
        if not self.bf16:
            return "f32"
        return "wmma" if self.tensor_core_attention and wmma_supported(hd) and wmma_available(hd) else "bf16"

    def __repr__(self):
        return f"GpuOps({self.precision!r})"

    # embedding
    def embedding_forward(self, ids, W):
        cp = require_cupy()
        ids = cp.asarray(ids)
        return W[ids], (ids, W.shape)

    def embedding_backward(self, dx, cache):
        cp = require_cupy()
        ids, shape = cache
        dW = cp.zeros(shape, dtype=dx.dtype)
        cp.add.at(dW, ids.reshape(-1), dx.reshape(-1, shape[1]))  # repeated ids accumulate (atomics)
        return dW

    # linear
    def linear_forward(self, x, W):
        """x [..., in] (bf16 mode: float32, or bf16 bits from swiglu_forward), W [out, in] -> y [..., out] f32."""
        if self.bf16:
            xb = x if x.dtype == np.uint16 else self._bf16_input(x)
            Wb = to_bf16(W)
            xb = xb.reshape(-1, x.shape[-1])
            y = gemm_bf16(xb, Wb, trans_b=True)
            return y.reshape(*x.shape[:-1], W.shape[0]), Bf16LinearCache(xb, Wb, x.shape)
        x2 = x.reshape(-1, x.shape[-1])
        return (x2 @ W.T).reshape(*x.shape[:-1], W.shape[0]), (x, W)

    def linear_backward(self, dy, cache):
        """dy [..., out] -> dx [..., in], dW [out, in]."""
        dy2 = dy.reshape(-1, dy.shape[-1])
        if self.bf16:
            if isinstance(cache, Bf16LinearCache):
                xb, Wb, x_shape = cache
            else:  # the reference cache (x, W) that model.backward builds for the output heads
                x, W = cache
                xb, Wb, x_shape = self._bf16_input(x).reshape(-1, x.shape[-1]), to_bf16(W), x.shape  # h: once for K heads
            dyb = to_bf16(dy2)
            dx = gemm_bf16(dyb, Wb)                # [N, out] @ [out, in]
            dW = gemm_bf16(dyb, xb, trans_a=True)  # [out, N] @ [N, in]
            return dx.reshape(x_shape), dW
        x, W = cache
        x2 = x.reshape(-1, x.shape[-1])
        return (dy2 @ W).reshape(x.shape), dy2.T @ x2

    # rmsnorm
    def rmsnorm_forward(self, x, w, eps):
        x2 = _f32(x, "rmsnorm input").reshape(-1, x.shape[-1])
        y, rstd = rmsnorm_fwd(x2, _f32(w, "rmsnorm weight"), eps)
        return y.reshape(x.shape), (x2, w, rstd, x.shape)

    def rmsnorm_backward(self, dy, cache):
        x2, w, rstd, shape = cache
        dx, dw = rmsnorm_bwd(_f32(dy, "rmsnorm gradient").reshape(x2.shape), x2, w, rstd)
        return dx.reshape(shape), dw

    # rope
    def rope_tables(self, T, freqs, dtype, start=0):
        """cos, sin [T, hd/2] at inverse frequencies freqs [hd/2] on the device (computed in float64 on the host,
        cached by the frequencies: any RoPE scaling is in them, the kernels read only the tables)."""
        cp = require_cupy()
        freqs = np.asarray(freqs, np.float64)
        key = (T, freqs.tobytes(), np.dtype(dtype).str, start)
        if key not in self._rope_cache:
            cos, sin = reference_ops.rope_tables(T, freqs, np.float32, start)
            self._rope_cache[key] = (cp.asarray(cos), cp.asarray(sin))
        return self._rope_cache[key]

    def rope_forward(self, x, cos, sin):
        """bf16 mode with bf16 attention: the rotated q / k come out as bf16 bits, which only
        attention_forward reads (their gradients, like every gradient, stay float32)."""
        out_bf16 = self.flash_kernel(x.shape[-1]) != "f32"
        return rope_rotate(_f32(x, "rope input"), cos, sin, +1.0, out_bf16), (cos, sin)

    def rope_backward(self, dy, cache):
        cos, sin = cache
        return rope_rotate(_f32(dy, "rope gradient"), cos, sin, -1.0)

    # attention
    def attention_forward(self, q, k, v, window=0, softcap=0.0):
        """q [B, H, Tq, hd], k/v [B, Hkv, Tk, hd] -> y [B, H, Tq, hd] (FlashAttention; causal, no window, no
        soft cap)."""
        if window:
            raise UserError("the GPU's attention has no sliding window (Gemma 3's local layers); use --device cpu")
        if softcap:
            raise UserError("the GPU's attention has no soft-capping (Gemma 2's); use --device cpu")
        cp = require_cupy()
        kernel = self.flash_kernel(q.shape[-1])
        if kernel == "f32":
            q, k, v = _f32(q, "q"), _f32(k, "k"), _f32(v, "v")
        else:  # bf16 bits: q and k usually arrive so from rope_forward; v is cast here
            q, k, v = (cp.ascontiguousarray(a) if a.dtype == np.uint16 else to_bf16(a) for a in (q, k, v))
        o, lse = flash_forward(q, k, v, kernel)
        return o, (q, k, v, o, lse, kernel)

    def attention_backward(self, dy, cache):
        q, k, v, o, lse, kernel = cache
        return flash_backward(_f32(dy, "attention gradient"), q, k, v, o, lse, kernel)

    # swiglu
    def swiglu_forward(self, g, u):
        """bf16 mode: h comes out as bf16 bits, which only the down projection (linear_forward) reads."""
        cp = require_cupy()
        g, u = _f32(g, "gate"), _f32(u, "up")
        h = cp.empty(g.shape, dtype=cp.uint16 if self.bf16 else cp.float32)
        n = g.size
        if n:
            get_kernel("swiglu", "swiglu_forward_bf16" if self.bf16 else "swiglu_forward")(
                (blocks_for(n),), (THREADS,), (g, u, h, np.int64(n)))
        return h, (g, u)

    def swiglu_backward(self, dh, cache):
        cp = require_cupy()
        g, u = cache
        dh = _f32(dh, "swiglu gradient")
        dg, du = cp.empty_like(g), cp.empty_like(u)
        n = g.size
        if n:
            get_kernel("swiglu", "swiglu_backward")((blocks_for(n),), (THREADS,), (dh, g, u, dg, du, np.int64(n)))
        return dg, du

    # cross-entropy and the MTP loss
    def cross_entropy_forward(self, logits, targets):
        """logits [N, V], targets int [N] (−1 = ignore) -> (mean loss over valid rows, cache)."""
        cp = require_cupy()
        z = _f32(logits, "logits")
        t = cp.asarray(targets, dtype=cp.int64)
        loss_rows, lse = ce_forward_rows(z, t)
        n = int((t >= 0).sum())
        loss = float(loss_rows.sum()) / n if n else 0.0
        return loss, (z, lse, t, n)

    def cross_entropy_backward(self, dloss, cache):
        cp = require_cupy()
        z, lse, t, n = cache
        if n == 0:
            return cp.zeros_like(z)
        return ce_backward_rows(z, lse, t, float(dloss) / n)

    def mtp_targets(self, tokens, T, K, loss_mask=None):
        cp = require_cupy()
        tokens = cp.asnumpy(tokens) if hasattr(tokens, "get") else tokens
        loss_mask = cp.asnumpy(loss_mask) if hasattr(loss_mask, "get") else loss_mask
        return cp.asarray(reference_ops.mtp_targets(np.asarray(tokens), T, K, loss_mask))

    def mtp_loss_forward(self, logits, targets):
        K, V = logits.shape[0], logits.shape[-1]
        head_losses, caches = [], []
        for k in range(K):
            loss, cache = self.cross_entropy_forward(logits[k].reshape(-1, V), targets[k].reshape(-1))
            head_losses.append(loss)
            caches.append(cache)
        return sum(head_losses) / K, head_losses, (caches, logits.shape)

    def mtp_loss_backward(self, dobjective, cache):
        cp = require_cupy()
        caches, shape = cache
        K = shape[0]
        return cp.stack([self.cross_entropy_backward(dobjective / K, c).reshape(shape[1:]) for c in caches])
