"""The fast training step: the model of `model.py`, with preallocated buffers, fused kernels and BLAS.

Same mathematics as `model.forward` / `model.backward` (tests/test_fast.py compares every gradient),
organised for speed:

- every activation lives in a `Workspace` allocated once per (config, B, T, dtype) and reused across
  steps; tensors are kept as [N = B·T, width] rows so each matmul is one BLAS call;
- q, k, v come from one matmul against [wq; wk; wv] stacked, gate and up from one against [gate; up];
  their weight gradients come out of one matmul each (straight into the gradient buffer when the
  caller's buffers are laid out as `grad_buffers` makes them);
- attention is one numba kernel per direction: RoPE, the 1/√hd scale, the head split, scores, causal
  softmax and P·v read straight from the q/k/v projection rows, only the causal half is computed,
  and backward writes the q/k/v gradient rows directly; SwiGLU, RMSNorm and cross-entropy are fused
  numba kernels working in place (kernels.py);
- what backward can recompute in one cheap pass is not stored: the normed inputs of the q/k/v and
  gate/up matmuls (from the residual stream and the saved 1/rms) and the SwiGLU output;
- every matmul is split by output rows over the cores, each part on single-threaded BLAS (blas.py);
- the K output heads are done one at a time: logits [N, V] of head k, its loss and dlogits in place,
  then its two backward matmuls; only one [N, V] buffer exists.

    ws = Workspace(cfg, B, T, np.float32)
    head0, objective, grads = loss_and_grads(cfg, params, tokens, loss_mask, ws)
"""
from __future__ import annotations

import functools
import math

import numpy as np

from .. import ops
from ..config import Config
from . import kernels as K
from .blas import matmul, single_threaded_blas

N_CHUNKS = 32  # fixed number of row chunks for the RMSNorm weight-gradient partial sums (determinism)


class Workspace:
    """Every buffer one training step needs, for a fixed (config, B, T, dtype). Reused step after step."""

    def __init__(self, cfg: Config, B: int, T: int, dtype):
        self.key = (cfg, B, T, np.dtype(dtype))
        dt = np.dtype(dtype)
        L, d, H, Hkv, hd, F, V = cfg.n_layers, cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_hidden, cfg.vocab_size
        N = B * T
        self.B, self.T, self.N = B, T, N
        e = lambda *shape: np.empty(shape, dtype=dt)  # noqa: E731
        # saved for backward, per layer
        self.X = e(L + 1, N, d)            # residual stream entering each block (X[L]: before the final norm)
        self.M = e(L, N, d)                # residual stream between attention and feed-forward
        self.r1, self.r2, self.rf = e(L, N), e(L, N), e(N)  # 1/rms of each norm's input
        self.QKV = e(L, N, (H + 2 * Hkv) * hd)  # q, k, v projections (RoPE is redone on the fly)
        self.P = e(L, B, H, T, T)          # attention probabilities (0 above the diagonal)
        self.A = e(L, N, H * hd)           # attention output, input of wo
        self.GU = e(L, N, 2 * F)           # [gate | up] pre-activations; backward turns them into [dg | du]
        self.hf = e(N, d)                  # final normed hidden state, input of the heads
        # scratch, shared by layers
        self.h = e(N, d)                   # a normed input (recomputed in backward)
        self.dqkv = e(N, (H + 2 * Hkv) * hd)
        self.s = e(N, F)                   # SwiGLU output / its gradient
        self.logits = e(N, V)
        self.t = e(N, d)                   # a matmul result about to be added somewhere
        self.dx, self.dh = e(N, d), e(N, d)
        self.dw_part = e(N_CHUNKS, d)
        self.losses = np.empty(N, dtype=np.float64)
        self.wqkv = e(L, (H + 2 * Hkv) * hd, d)   # stacked weights, refreshed from params each step
        self.wgu = e(L, 2 * F, d)
        self.rope = ops.rope_tables(T, hd, cfg.rope_theta, dt)
        self.qscale = dt.type(1.0 / np.sqrt(hd))

    def nbytes(self) -> int:
        return sum(a.nbytes for a in vars(self).values() if isinstance(a, np.ndarray))


def grad_buffers(cfg: Config, dtype) -> dict[str, np.ndarray]:
    """Gradient arrays for every parameter, as views into one flat buffer in SPEC order, so that
    wq, wk, wv (and gate, up) of a layer are adjacent and their stacked gradient is one matmul output."""
    shapes = cfg.param_shapes()
    flat = np.empty(sum(math.prod(s) for s in shapes.values()), dtype=dtype)
    out, off = {}, 0
    for name, shape in shapes.items():
        n = math.prod(shape)
        out[name] = flat[off:off + n].reshape(shape)
        off += n
    return out


def _entry(fn):
    """Run fn holding the kernel lock with OpenBLAS single-threaded (both re-entrant), so the public
    steps below are fast and safe whether called alone or from loss_and_grads."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with K.LOCK, single_threaded_blas():
            return fn(*args, **kwargs)
    return wrapper


def _stacked(arrays):
    """A [Σ rows, cols] view over C-contiguous 2-D arrays that sit back to back in memory, else None."""
    first = arrays[0]
    if not all(a.flags.c_contiguous and a.dtype == first.dtype and a.shape[1:] == first.shape[1:] for a in arrays):
        return None
    addr = first.__array_interface__["data"][0]
    for a in arrays:
        if a.__array_interface__["data"][0] != addr:
            return None
        addr += a.nbytes
    rows = sum(a.shape[0] for a in arrays)
    return np.lib.stride_tricks.as_strided(first, shape=(rows,) + first.shape[1:], strides=first.strides)


def _matmul_into(a, b, outs):
    """a @ b written into the row blocks `outs` (adjacent arrays: directly; otherwise through a temporary)."""
    view = _stacked(outs)
    if view is not None:
        matmul(a, b, out=view)
        return
    tmp = matmul(a, b, out=np.empty((a.shape[0], b.shape[1]), dtype=b.dtype))
    off = 0
    for o in outs:
        o[...] = tmp[off:off + o.shape[0]]
        off += o.shape[0]


@_entry
def forward(cfg: Config, P: dict, inputs: np.ndarray, ws: Workspace) -> None:
    """inputs int [B, T] -> fills ws up to ws.hf (the final normed hidden state)."""
    H, Hkv = cfg.n_heads, cfg.n_kv_heads
    eps = ws.X.dtype.type(cfg.norm_eps)
    cos, sin = ws.rope
    ids = inputs.reshape(-1)
    np.take(P["embed.weight"], ids, axis=0, out=ws.X[0])                     # [N, d]
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        wqkv, wgu = ws.wqkv[i], ws.wgu[i]
        np.concatenate([P[p + "attn.wq.weight"], P[p + "attn.wk.weight"], P[p + "attn.wv.weight"]], out=wqkv)
        np.concatenate([P[p + "ffn.gate.weight"], P[p + "ffn.up.weight"]], out=wgu)
        x, mid = ws.X[i], ws.M[i]
        # attention sub-block
        K.rmsnorm_forward(x, P[p + "attn_norm.weight"], eps, ws.h, ws.r1[i])
        matmul(ws.h, wqkv.T, out=ws.QKV[i])                                 # [N, (H+2Hkv)·hd]
        K.attention_forward(ws.QKV[i], cos, sin, ws.qscale, H, Hkv, ws.P[i], ws.A[i])  # P, A [N, H·hd]
        matmul(ws.A[i], P[p + "attn.wo.weight"].T, out=ws.t)
        np.add(x, ws.t, out=mid)
        # feed-forward sub-block
        K.rmsnorm_forward(mid, P[p + "ffn_norm.weight"], eps, ws.h, ws.r2[i])
        matmul(ws.h, wgu.T, out=ws.GU[i])                                   # [N, 2F]
        K.swiglu_forward(ws.GU[i], ws.s)                                       # [N, F]
        matmul(ws.s, P[p + "ffn.down.weight"].T, out=ws.t)
        np.add(mid, ws.t, out=ws.X[i + 1])
    K.rmsnorm_forward(ws.X[cfg.n_layers], P["norm.weight"], eps, ws.hf, ws.rf)


@_entry
def heads(cfg: Config, P: dict, targets: np.ndarray, ws: Workspace, grads: dict | None):
    """The K heads and their losses, one head at a time. targets int [K, N] (−1 = ignored).
    With grads: also dlogits -> grads['heads.k.weight'] and the gradient of hf into ws.dh.
    Returns (per-head mean losses, objective)."""
    Kh = cfg.n_mtp
    losses = []
    for k in range(Kh):
        W = P[f"heads.{k}.weight"]                                             # [V, d]
        tk = targets[k]
        n = int(np.count_nonzero(tk >= 0))
        scale = ws.logits.dtype.type(1.0 / (n * Kh)) if n else ws.logits.dtype.type(0.0)
        matmul(ws.hf, W.T, out=ws.logits)                                   # [N, V]
        K.cross_entropy(ws.logits, tk, scale, ws.losses, grads is not None)    # logits := dlogits
        losses.append(float(ws.losses.sum() / n) if n else 0.0)
        if grads is not None:
            matmul(ws.logits.T, ws.hf, out=grads[f"heads.{k}.weight"])      # [V, d]
            if k == 0:
                matmul(ws.logits, W, out=ws.dh)                             # [N, d]
            else:
                matmul(ws.logits, W, out=ws.t)
                ws.dh += ws.t
    return losses, sum(losses) / Kh


@_entry
def backward(cfg: Config, P: dict, ids: np.ndarray, ws: Workspace, grads: dict) -> None:
    """From ws.dh (gradient of the final normed state, left by `heads`) to every parameter gradient."""
    Hkv = cfg.n_kv_heads
    eps = ws.X.dtype.type(cfg.norm_eps)
    cos, sin = ws.rope
    dx = ws.dx
    dx[...] = 0
    K.rmsnorm_backward(ws.dh, ws.X[cfg.n_layers], ws.rf, P["norm.weight"], dx, ws.dw_part)
    np.sum(ws.dw_part, axis=0, out=grads["norm.weight"])
    for i in reversed(range(cfg.n_layers)):
        p = f"layers.{i}."
        x, mid, GU = ws.X[i], ws.M[i], ws.GU[i]
        # feed-forward sub-block (x = mid + down(swiglu(norm(mid))))
        K.swiglu_forward(GU, ws.s)                                             # recompute s [N, F]
        matmul(dx.T, ws.s, out=grads[p + "ffn.down.weight"])                # [d, F]
        matmul(dx, P[p + "ffn.down.weight"], out=ws.s)                      # ds [N, F]
        K.swiglu_backward(ws.s, GU)                                            # GU := [dg | du]
        K.rmsnorm_forward(mid, P[p + "ffn_norm.weight"], eps, ws.h, ws.r2[i])  # recompute h2
        _matmul_into(GU.T, ws.h, [grads[p + "ffn.gate.weight"], grads[p + "ffn.up.weight"]])
        matmul(GU, ws.wgu[i], out=ws.dh)                                    # [N, d]
        K.rmsnorm_backward(ws.dh, mid, ws.r2[i], P[p + "ffn_norm.weight"], dx, ws.dw_part)
        np.sum(ws.dw_part, axis=0, out=grads[p + "ffn_norm.weight"])
        # attention sub-block (mid = x + wo(attention(rope(q), rope(k), v)))
        matmul(dx.T, ws.A[i], out=grads[p + "attn.wo.weight"])              # [d, H·hd]
        matmul(dx, P[p + "attn.wo.weight"], out=ws.A[i])                    # dA [N, H·hd] (A is spent)
        K.attention_backward(ws.QKV[i], cos, sin, ws.qscale, Hkv, ws.P[i], ws.A[i], ws.dqkv)  # [N, (H+2Hkv)·hd]
        K.rmsnorm_forward(x, P[p + "attn_norm.weight"], eps, ws.h, ws.r1[i])   # recompute h1
        _matmul_into(ws.dqkv.T, ws.h, [grads[p + "attn.wq.weight"], grads[p + "attn.wk.weight"],
                                      grads[p + "attn.wv.weight"]])
        matmul(ws.dqkv, ws.wqkv[i], out=ws.dh)
        K.rmsnorm_backward(ws.dh, x, ws.r1[i], P[p + "attn_norm.weight"], dx, ws.dw_part)
        np.sum(ws.dw_part, axis=0, out=grads[p + "attn_norm.weight"])
    K.embedding_backward(dx, ids, grads["embed.weight"])


def flat_targets(tokens, T, Kh, loss_mask):
    """tokens int [B, T+K] -> targets int64 [K, B·T] (−1 where the mask says no loss)."""
    return ops.mtp_targets(tokens, T, Kh, loss_mask).reshape(Kh, -1)


def loss_and_grads(cfg: Config, P: dict, tokens: np.ndarray, loss_mask, ws: Workspace, grads: dict | None = None):
    """tokens int [B, T+K] -> (head-0 loss, objective, grads). `grads` (optional) receives the gradients;
    best made by `grad_buffers` (then the stacked weight gradients need no copy)."""
    T = tokens.shape[1] - cfg.n_mtp
    inputs = np.ascontiguousarray(tokens[:, :T], dtype=np.int64)
    targets = flat_targets(tokens, T, cfg.n_mtp, loss_mask)
    if grads is None:
        grads = grad_buffers(cfg, ws.X.dtype)
    with K.LOCK, single_threaded_blas():
        forward(cfg, P, inputs, ws)
        losses, objective = heads(cfg, P, targets, ws, grads)
        backward(cfg, P, inputs.reshape(-1), ws, grads)
    return losses[0], objective, grads


def loss(cfg: Config, P: dict, tokens: np.ndarray, loss_mask, ws: Workspace):
    """Forward only: (head-0 loss, objective)."""
    T = tokens.shape[1] - cfg.n_mtp
    inputs = np.ascontiguousarray(tokens[:, :T], dtype=np.int64)
    with K.LOCK, single_threaded_blas():
        forward(cfg, P, inputs, ws)
        losses, objective = heads(cfg, P, flat_targets(tokens, T, cfg.n_mtp, loss_mask), ws, None)
    return losses[0], objective
