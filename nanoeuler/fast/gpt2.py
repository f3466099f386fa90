"""The fast engine for arch "gpt2": numba kernels for LayerNorm, GELU-tanh and bias/position gradients,
and the training step of model.py's `gpt2_forward` / `gpt2_backward` on the engine's machinery.

Everything engine.py does for the euler block carries over (one sub-batch per core on single-threaded
BLAS, preallocated `Workspace` rows, stacked q|k|v matmul, attention as batched BLAS around fused
split / softmax kernels, dropout fused into the residual adds, normed inputs recomputed in backward);
what differs:

- LayerNorm keeps the mean μ as well as r = 1/σ per row (ws.mu1, mu2, muf beside r1, r2, rf);
- biases: q|k|v's stacked bias is added after its matmul, the others too; bias gradients are column sums
  of the output gradients (`col_sum`, float64, fixed order);
- no RoPE: the attention kernels run with identity tables (cos 1, sin 0: x·1 − y·0 = x exactly), so
  only their 1/√hd scale remains; learned positions are added after the token lookup, and their
  gradient is the sum over the part's sequences (`position_backward`);
- the MLP keeps its pre-activation f = fc(h) + b in ws.FC and gelu(f) in ws.S (the input of proj);
  `gelu_backward` turns dgelu into df in place;
- head 0 is the token embedding: its weight gradient is written straight into grads["embed.weight"]
  (the parts' shares summed by `heads`), and `backward` adds the lookup's gradient to it
  (`kernels.embedding_backward_add`; DPO writes the head's share itself, then calls `backward`); heads 1..K-1
  as in engine.py.

GELU-tanh through the sigmoid: ½·x·(1 + tanh(u)) = x·σ(2u), and 1 − tanh²(u) = 4·σ(2u)·(1 − σ(2u)), so

    gelu(x) = x·s,   gelu'(x) = s + 2·x·s·(1 − s)·c·(1 + 3a·x²),   s = σ(2·c·(x + a·x³))

with vexp (vmath.py) for the exponential: no cancellation near 0 and no scalar tanh call.
Tested against the reference ops and model in tests/test_gpt2_fast.py.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit

from ..config import Config, head_name, head_weight
from ..ops.gelu import A as GELU_A
from ..ops.gelu import C as GELU_C
from . import engine
from . import kernels as K
from .kernels import OPTS, row_dot, row_sum
from .vmath import vexp


# ---- kernels -----------------------------------------------------------------------------------------------
@njit(**OPTS)
def layernorm_forward(x, w, b, eps, y, mu, r):
    """ops/layernorm.py. x [N, d], w, b [d] -> y [N, d] = (x − μ)·r·w + b; μ [N], r [N] = 1/sqrt(var + eps)."""
    N, d = x.shape
    for i in range(N):
        m = x.dtype.type(row_sum(x[i], d) / d)
        acc = 0.0
        for j in range(d):  # Σ (x − μ)², in float64
            c = x[i, j] - m
            acc += c * c
        ri = x.dtype.type(1.0 / math.sqrt(acc / d + eps))
        mu[i] = m
        r[i] = ri
        for j in range(d):
            y[i, j] = ((x[i, j] - m) * ri) * w[j] + b[j]


@njit(**OPTS)
def layernorm_backward(dy, x, mu, r, w, dx, dw, db):
    """dy, x [N, d], μ, r [N], w [d] -> dx [N, d] += r·(g − mean(g) − n·mean(g·n)) with g = dy·w,
    n = (x − μ)·r; dw, db [d] (float64) = Σ over rows of dy·n and dy, accumulated in row order."""
    N, d = x.shape
    dw[:] = 0
    db[:] = 0
    for i in range(N):
        m, ri = mu[i], r[i]
        sg = 0.0
        sgn = 0.0
        for j in range(d):
            g = dy[i, j] * w[j]
            sg += g
            sgn += g * ((x[i, j] - m) * ri)
        mg = x.dtype.type(sg / d)
        mgn = x.dtype.type(sgn / d)
        for j in range(d):
            n = (x[i, j] - m) * ri
            dx[i, j] += ri * ((dy[i, j] * w[j] - mg) - n * mgn)
            dw[j] += dy[i, j] * n
            db[j] += dy[i, j]


@njit(**OPTS)
def bias_gelu_forward(f, b, s):
    """ops/bias.py + ops/gelu.py. f [N, F] := f + b (the pre-activation, kept for backward); s [N, F] = gelu(f)."""
    N, F = f.shape
    one, two = s.dtype.type(1.0), s.dtype.type(2.0)
    c, a = s.dtype.type(GELU_C), s.dtype.type(GELU_A)
    for n in range(N):
        for j in range(F):
            x = f[n, j] + b[j]
            f[n, j] = x
            sg = one / (one + vexp(-two * (c * (x + a * (x * x * x)))))
            s[n, j] = x * sg


@njit(**OPTS)
def gelu_backward(ds, f):
    """ds, f [N, F] -> in place ds := ds · gelu'(f)."""
    N, F = f.shape
    one, two, three = f.dtype.type(1.0), f.dtype.type(2.0), f.dtype.type(3.0)
    c, a = f.dtype.type(GELU_C), f.dtype.type(GELU_A)
    for n in range(N):
        for j in range(F):
            x = f[n, j]
            sg = one / (one + vexp(-two * (c * (x + a * (x * x * x)))))
            ds[n, j] = ds[n, j] * (sg + ((two * x) * (sg * (one - sg))) * (c * (one + three * a * (x * x))))


@njit(**OPTS)
def col_sum(a, out):
    """a [N, n] -> out [n] (float64) = Σ over rows, in row order: a bias gradient."""
    N, n = a.shape
    out[:] = 0
    for i in range(N):
        for j in range(n):
            out[j] += a[i, j]


@njit(**OPTS)
def add_positions(x, pos, T):
    """x [b·T, d] += pos[t] on row s·T + t (every sequence of the part starts at position 0)."""
    N, d = x.shape
    for i in range(N):
        t = i % T
        for j in range(d):
            x[i, j] += pos[t, j]


@njit(**OPTS)
def position_backward(dx, T, dW):
    """dx [b·T, d] -> dW [ctx, d]: rows 0..T-1 = Σ over the sequences of dx at that position; the rest 0."""
    N, d = dx.shape
    dW[:] = 0
    for i in range(N):
        t = i % T
        for j in range(d):
            dW[t, j] += dx[i, j]


# ---- the workspace ---------------------------------------------------------------------------------------------
class Workspace(engine.Workspace):
    """engine.Workspace (same arguments) with what arch gpt2 needs besides (`extend_workspace`)."""

    def __init__(self, cfg: Config, *args, **kwargs):
        super().__init__(cfg, *args, **kwargs)
        extend_workspace(self, cfg)


def extend_workspace(ws, cfg: Config) -> None:
    """Add what arch gpt2 needs to an engine.Workspace: LayerNorm means, the MLP pre-activations, stacked
    biases, identity RoPE tables."""
    dt = ws.X.dtype
    L, d, H, Hkv, hd, F = cfg.n_layers, cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_hidden
    N, T = ws.N, ws.T
    ws.FC = np.empty((L, N, F), dt)                      # fc(h) + b, the GELU's input
    ws.mu1, ws.mu2, ws.muf = np.empty((L, N), dt), np.empty((L, N), dt), np.empty(N, dt)  # LayerNorm means
    ws.bqkv = np.empty((L, (H + 2 * Hkv) * hd), dt)      # stacked q|k|v biases, refreshed each step
    ws.GU = ws.wgu = np.empty((0, 0, 0), dt)             # the SwiGLU buffers are not used
    ws.rope = (np.ones((T, (hd + 1) // 2), dt), np.zeros((T, (hd + 1) // 2), dt))  # identity: no RoPE
    for w in ws.parts:
        w.FC, w.mu1, w.mu2, w.muf = ws.FC[:, w.n0:w.n1], ws.mu1[:, w.n0:w.n1], ws.mu2[:, w.n0:w.n1], ws.muf[w.n0:w.n1]
        w.GU = None
        w.db = np.empty(d, np.float64)
        w.dbf = np.empty(F, np.float64)
        w.dbqkv = np.empty((H + 2 * Hkv) * hd, np.float64)


# ---- one part's work ---------------------------------------------------------------------------------------------
def _forward_part(cfg: Config, P: dict, ws, w, _grads, inputs, drop) -> None:
    Hkv = cfg.n_kv_heads
    eps = ws.X.dtype.type(cfg.norm_eps)
    np.take(P["embed.weight"], inputs[w.b0:w.b1].reshape(-1), axis=0, out=w.X[0])  # [n, d]
    add_positions(w.X[0], P["pos_embed.weight"], ws.T)
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        x, mid = w.X[i], w.M[i]
        # attention sub-block
        layernorm_forward(x, P[p + "attn_norm.weight"], P[p + "attn_norm.bias"], eps, w.h, w.mu1[i], w.r1[i])
        engine.linear(ws, w.h, ws.wqkv[i], f"wqkv.{i}", w.qkv)             # [n, (H+2Hkv)·hd]
        w.qkv += ws.bqkv[i]
        engine.attention_forward(w.qkv, ws.rope, ws.qscale, Hkv, w.q[i], w.k[i], w.v[i], w.P[i], w.dq, w.A[i],
                                 ws.mm)
        engine.linear(ws, w.A[i], P[p + "attn.wo.weight"], p + "attn.wo.weight", w.t)
        w.t += P[p + "attn.wo.bias"]
        engine._residual_add(x, w.t, drop, 2 * i, w.n0, out=mid)
        # feed-forward sub-block
        layernorm_forward(mid, P[p + "ffn_norm.weight"], P[p + "ffn_norm.bias"], eps, w.h, w.mu2[i], w.r2[i])
        engine.linear(ws, w.h, P[p + "ffn.fc.weight"], p + "ffn.fc.weight", w.FC[i])  # [n, F]
        bias_gelu_forward(w.FC[i], P[p + "ffn.fc.bias"], w.S[i])
        engine.linear(ws, w.S[i], P[p + "ffn.proj.weight"], p + "ffn.proj.weight", w.t)
        w.t += P[p + "ffn.proj.bias"]
        engine._residual_add(mid, w.t, drop, 2 * i + 1, w.n0, out=w.X[i + 1])
    layernorm_forward(w.X[cfg.n_layers], P["norm.weight"], P["norm.bias"], eps, w.hf, w.muf, w.rf)


def _heads_part(cfg: Config, P: dict, ws, w, grads, targets, scales, sums) -> None:
    for k in range(cfg.n_mtp):
        W, name = head_weight(P, k), head_name(P, k)                        # [V, d]
        engine.linear(ws, w.hf, W, name, w.logits)                          # [n, V]
        K.cross_entropy(w.logits, targets[k, w.n0:w.n1], scales[k], w.losses, grads is not None)
        sums[k, w.index] = w.losses.sum()
        if grads is not None:
            engine.weight_grad(grads, [name], w.logits, w.hf, ws.mm)        # [V, d]; head 0: embed's first share
            engine.linear_dx(ws, w.logits, W, name, w.dh if k == 0 else w.t)  # [n, d]
            if k:
                w.dh += w.t


def _set(grads, name, acc) -> None:
    grads[name][...] = acc


def _backward_part(cfg: Config, P: dict, ws, w, grads, ids, drop) -> None:
    Hkv, H, hd = cfg.n_kv_heads, cfg.n_heads, cfg.head_dim
    eps = ws.X.dtype.type(cfg.norm_eps)
    dx = w.dx
    dx[...] = 0
    layernorm_backward(w.dh, w.X[cfg.n_layers], w.muf, w.rf, P["norm.weight"], dx, w.dw, w.db)
    _set(grads, "norm.weight", w.dw)
    _set(grads, "norm.bias", w.db)
    engine._announce_part(w, ["norm.weight", "norm.bias"], grads)
    for i in reversed(range(cfg.n_layers)):
        p = f"layers.{i}."
        x, mid = w.X[i], w.M[i]
        # feed-forward sub-block (out = mid + proj(gelu(fc(layernorm(mid)))))
        df = engine._dropped(dx, drop, 2 * i + 1, w.n0, out=w.t)           # [n, d]
        engine.weight_grad(grads, [p + "ffn.proj.weight"], df, w.S[i], ws.mm)  # [d, F]
        col_sum(df, w.db)
        _set(grads, p + "ffn.proj.bias", w.db)
        engine.linear_dx(ws, df, P[p + "ffn.proj.weight"], p + "ffn.proj.weight", w.ds)  # [n, F]
        gelu_backward(w.ds, w.FC[i])                                        # ds := d(fc output)
        layernorm_forward(mid, P[p + "ffn_norm.weight"], P[p + "ffn_norm.bias"], eps, w.h, w.mu2[i], w.r2[i])  # h2
        engine.weight_grad(grads, [p + "ffn.fc.weight"], w.ds, w.h, ws.mm)  # [F, d]
        col_sum(w.ds, w.dbf)
        _set(grads, p + "ffn.fc.bias", w.dbf)
        engine.linear_dx(ws, w.ds, P[p + "ffn.fc.weight"], p + "ffn.fc.weight", w.dh)  # [n, d]
        layernorm_backward(w.dh, mid, w.mu2[i], w.r2[i], P[p + "ffn_norm.weight"], dx, w.dw, w.db)
        _set(grads, p + "ffn_norm.weight", w.dw)
        _set(grads, p + "ffn_norm.bias", w.db)
        # attention sub-block (mid = x + wo(attention(q, k, v)) + bo)
        do = engine._dropped(dx, drop, 2 * i, w.n0, out=w.t)               # [n, d]
        engine.weight_grad(grads, [p + "attn.wo.weight"], do, w.A[i], ws.mm)  # [d, H·hd]
        col_sum(do, w.db)
        _set(grads, p + "attn.wo.bias", w.db)
        engine.linear_dx(ws, do, P[p + "attn.wo.weight"], p + "attn.wo.weight", w.A[i])  # dA [n, H·hd] (A is spent)
        engine.attention_backward(w.A[i], ws.rope, ws.qscale, Hkv, w.q[i], w.k[i], w.v[i], w.P[i],
                                  w.dy, w.dS, w.dq, w.dk, w.dv, w.dqkv, ws.mm)  # [n, (H+2Hkv)·hd]
        layernorm_forward(x, P[p + "attn_norm.weight"], P[p + "attn_norm.bias"], eps, w.h, w.mu1[i], w.r1[i])  # h1
        engine.weight_grad(grads, [p + f"attn.w{x}.weight" for x in "qkv"], w.dqkv, w.h, ws.mm)
        col_sum(w.dqkv, w.dbqkv)
        q, kv = H * hd, Hkv * hd
        _set(grads, p + "attn.wq.bias", w.dbqkv[:q])
        _set(grads, p + "attn.wk.bias", w.dbqkv[q:q + kv])
        _set(grads, p + "attn.wv.bias", w.dbqkv[q + kv:])
        engine.linear_dx(ws, w.dqkv, ws.wqkv[i], f"wqkv.{i}", w.dh)
        layernorm_backward(w.dh, x, w.mu1[i], w.r1[i], P[p + "attn_norm.weight"], dx, w.dw, w.db)
        _set(grads, p + "attn_norm.weight", w.dw)
        _set(grads, p + "attn_norm.bias", w.db)
        engine._announce_part(w, [n for n in grads if n.startswith(p)], grads)
    position_backward(dx, ws.T, grads["pos_embed.weight"])
    if "embed.weight" not in grads:  # frozen (a LoRA step): no [V, d] gradient
        pass
    elif w.index == 0:  # the caller's buffer already holds the tied head's gradient (of the whole batch)
        K.embedding_backward_add(dx, ids[w.n0:w.n1], grads["embed.weight"])
    else:             # another part's own buffer: its lookup share only, summed into the caller's by `backward`
        K.embedding_backward(dx, ids[w.n0:w.n1], grads["embed.weight"])
    engine._announce_part(w, ["pos_embed.weight", "embed.weight"], grads)


# ---- the public steps ---------------------------------------------------------------------------------------------
def forward(cfg: Config, P: dict, inputs: np.ndarray, ws, dropout=None) -> None:
    """inputs int [B, T] -> fills ws up to ws.hf (the final LayerNorm's output)."""
    if engine.restack(ws):
        _stack_weights(cfg, P, ws)
    engine._in_parts(_forward_part, cfg, P, ws, None, inputs, dropout)


def _stack_weights(cfg: Config, P: dict, ws) -> None:
    """q|k|v biases of every layer into ws.bqkv; float32: the weights into ws.wqkv; bf16: every product's
    weight packed (q|k|v stacked only while packed, see engine.pack_weights)."""
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        np.concatenate([P[p + f"attn.w{x}.bias"] for x in "qkv"], out=ws.bqkv[i])
        if not ws.bf16:
            np.concatenate([P[p + f"attn.w{x}.weight"] for x in "qkv"], out=ws.wqkv[i])
    engine.pack_weights(ws, {k: W for i in range(cfg.n_layers) for k, W in [
        (f"wqkv.{i}", [P[n] for n in engine.product_weights(f"wqkv.{i}")])] + [
        (n, P[n]) for n in (f"layers.{i}.attn.wo.weight", f"layers.{i}.ffn.fc.weight", f"layers.{i}.ffn.proj.weight")]}
        | {head_name(P, k): head_weight(P, k) for k in range(cfg.n_mtp)})


def heads(cfg: Config, P: dict, targets: np.ndarray, ws, grads: dict | None, counts=None):
    """As engine.heads, with head 0 = embed.weight (its gradient share written into grads['embed.weight'],
    summed over the parts by `backward`)."""
    Kh = cfg.n_mtp
    if counts is None:
        counts = [int(np.count_nonzero(targets[k] >= 0)) for k in range(Kh)]
    scales = [ws.logits.dtype.type(1.0 / (n * Kh) if n else 0.0) for n in counts]
    sums = np.zeros((Kh, len(ws.parts)))
    engine._in_parts(_heads_part, cfg, P, ws, grads, targets, scales, sums)
    if grads is not None:  # embed.weight: the tied head's share, whole batch, before `backward` adds the lookup's
        engine._sum_part_grads(ws, grads, ["embed.weight"] + [f"heads.{k}.weight" for k in range(1, Kh)])
        engine.announce([f"heads.{k}.weight" for k in range(1, Kh)], grads)
    losses = [float(sums[k].sum() / n) if n else 0.0 for k, n in enumerate(counts)]
    return losses, sum(losses) / Kh


def backward(cfg: Config, P: dict, ids: np.ndarray, ws, grads: dict, dropout=None) -> None:
    """As engine.backward; the tied head's share must already be in grads["embed.weight"] (the lookup's is added)."""
    engine._in_parts(_backward_part, cfg, P, ws, grads, ids, dropout)
    names = [n for n in grads if not n.startswith("heads.")]
    engine._sum_part_grads(ws, grads, names)
    if len(ws.parts) > 1:
        engine.announce(names, grads)


def loss_and_grads(cfg: Config, P: dict, tokens: np.ndarray, loss_mask, ws, grads: dict | None = None,
                   dropout=None, counts=None):
    """As engine.loss_and_grads, for arch gpt2."""
    T = tokens.shape[1] - cfg.n_mtp
    inputs = np.ascontiguousarray(tokens[:, :T], dtype=np.int64)
    targets = engine.flat_targets(tokens, T, cfg.n_mtp, loss_mask)
    if grads is None:
        grads = engine.grad_buffers(cfg, ws.X.dtype)
    forward(cfg, P, inputs, ws, dropout)
    losses, objective = heads(cfg, P, targets, ws, grads, counts)
    backward(cfg, P, inputs.reshape(-1), ws, grads, dropout)
    return losses[0], objective, grads


def loss(cfg: Config, P: dict, tokens: np.ndarray, loss_mask, ws, dropout=None):
    """Forward only: (head-0 loss, objective)."""
    T = tokens.shape[1] - cfg.n_mtp
    inputs = np.ascontiguousarray(tokens[:, :T], dtype=np.int64)
    forward(cfg, P, inputs, ws, dropout)
    losses, objective = heads(cfg, P, engine.flat_targets(tokens, T, cfg.n_mtp, loss_mask), ws, None)
    return losses[0], objective
