"""An independent PyTorch implementation of the SPEC model: the oracle the parity tests compare against.

Written from ../shared/SPEC.md alone (not from nanoeuler/model.py), with torch.autograd for gradients.
PyTorch is a test-only dependency: the library never imports this file or torch.

    >>> from nanoeuler import Config
    >>> cfg = Config.preset("small")
    >>> tm = TorchModel(cfg, spec_init(cfg, seed=0))           # numpy params in, torch leaves inside
    >>> tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 16 + cfg.n_mtp))
    >>> head0, objective, grads = tm.loss_and_grads(tokens)    # ~ ln(512) = 6.24 at init
    >>> sorted(grads) == sorted(cfg.param_shapes())
    True

The model, as the SPEC defines it (no biases anywhere, weights in [out, in] orientation, y = x @ W.T):
    h = embed[inputs]                                         # [B, T, d]
    per layer: h = h + attn(rmsnorm(h)); h = h + swiglu(rmsnorm(h))
    z = rmsnorm(h);  logits_k = z @ heads.k.T                 # [B, T, V] for each of K heads
A sample is T + K tokens; inputs are tokens[:, :T]; head k's targets are tokens[:, 1+k : T+1+k].
Loss = mean over heads of each head's mean cross-entropy over counted targets; head 0's is reported.
"""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

_DTYPES = {np.dtype(np.float32): torch.float32, np.dtype(np.float64): torch.float64}


def to_torch(a: np.ndarray, requires_grad: bool = False) -> torch.Tensor:
    """A numpy float32/float64 array as a torch tensor of the same dtype (a copy)."""
    a = np.asarray(a)
    if a.dtype not in _DTYPES:
        raise TypeError(f"expected float32 or float64, got {a.dtype}")
    return torch.tensor(a.copy(), dtype=_DTYPES[a.dtype], requires_grad=requires_grad)


def spec_init(config, seed: int = 0, dtype=np.float64) -> dict[str, np.ndarray]:
    """SPEC initialisation, done independently here: N(0, 0.02), wo/down scaled by 1/sqrt(2 L), norms 1.

    Not bit-identical to our Model.init (different RNG use); for sanity checks and statistics only.
    """
    rng = np.random.default_rng(seed)
    params = {}
    for name, shape in config.param_shapes().items():
        if name.endswith("norm.weight"):
            params[name] = np.ones(shape, dtype)
        else:
            std = 0.02
            if name.endswith("attn.wo.weight") or name.endswith("ffn.down.weight"):
                std /= math.sqrt(2 * config.n_layers)
            params[name] = (rng.standard_normal(shape) * std).astype(dtype)
    return params


# ---------------------------------------------------------------- the ops (forward only; autograd does the rest)

def rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """y = x / sqrt(mean(x^2) + eps) * w over the last axis.  [.., d] -> [.., d]"""
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * w


def rope_cos_sin(T: int, hd: int, theta: float, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables [T, hd] for rotate-half RoPE: inv_freq_i = theta^(-2i/hd), i < hd/2, repeated twice.

    Angles are computed in float64 and rounded once to `dtype`.
    """
    inv_freq = theta ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)    # [hd/2]
    ang = torch.arange(T, dtype=torch.float64)[:, None] * inv_freq[None, :]      # [T, hd/2]
    ang = torch.cat([ang, ang], dim=-1)                                          # [T, hd]
    return ang.cos().to(dtype), ang.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[x1, x2] -> [-x2, x1] on the last axis (dim i pairs with i + hd/2)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pairing: str = "half") -> torch.Tensor:
    """x [B, nh, T, hd] rotated by position. pairing="interleaved" (2i with 2i+1) is a deliberately
    wrong variant, only used by the tests to show they can tell the two apart."""
    if pairing == "half":
        return x * cos + rotate_half(x) * sin
    if pairing == "interleaved":
        hd = x.shape[-1]
        c, s = cos[:, : hd // 2], sin[:, : hd // 2]                              # [T, hd/2]
        xe, xo = x[..., 0::2], x[..., 1::2]
        out = torch.stack([xe * c - xo * s, xe * s + xo * c], dim=-1)            # [B, nh, T, hd/2, 2]
        return out.flatten(-2)
    raise ValueError(pairing)


def causal_gqa_attention(q, k, v, gqa_map: str = "block"):
    """q [B, H, T, hd], k/v [B, Hkv, T, hd] -> [B, H, T, hd]; q head h reads kv head h // (H / Hkv).

    gqa_map="modulo" (h % Hkv) is a deliberately wrong variant, for the tests' sensitivity check.
    """
    B, H, T, hd = q.shape
    Hkv = k.shape[1]
    group = H // Hkv
    if gqa_map == "block":
        idx = torch.arange(H) // group
    elif gqa_map == "modulo":
        idx = torch.arange(H) % Hkv
    else:
        raise ValueError(gqa_map)
    k, v = k[:, idx], v[:, idx]                                                  # [B, H, T, hd]
    scores = q @ k.transpose(-1, -2) / math.sqrt(hd)                             # [B, H, T, T]
    future = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)
    scores = scores.masked_fill(future, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def swiglu(x, w_gate, w_up, w_down):
    """down(silu(gate(x)) * up(x)).  [.., d] -> [.., d]"""
    return (F.silu(x @ w_gate.T) * (x @ w_up.T)) @ w_down.T


# ---------------------------------------------------------------- the model

class TorchModel:
    """The SPEC transformer in PyTorch. `params` maps SPEC names to numpy arrays (float32 or float64);
    they become leaf tensors of the same dtype with requires_grad, in `self.params`."""

    def __init__(self, config, params: dict[str, np.ndarray], *, rope_pairing: str = "half",
                 gqa_map: str = "block"):
        self.config = config
        expected = config.param_shapes()
        if set(params) != set(expected):
            raise KeyError(f"param names differ from the SPEC: {sorted(set(params) ^ set(expected))}")
        for name, shape in expected.items():
            if tuple(params[name].shape) != tuple(shape):
                raise ValueError(f"{name}: shape {params[name].shape}, SPEC says {shape}")
        self.params = {name: to_torch(params[name], requires_grad=True) for name in expected}
        self.dtype = self.params["embed.weight"].dtype
        self.rope_pairing = rope_pairing
        self.gqa_map = gqa_map

    def numpy_params(self) -> dict[str, np.ndarray]:
        return {n: p.detach().numpy().copy() for n, p in self.params.items()}

    def hidden(self, inputs, dropout_masks=None) -> torch.Tensor:
        """int inputs [B, T] -> final normed hidden state [B, T, d]. dropout_masks: per layer, the factors
        [B, T, d] of its attention and feed-forward branches (numpy arrays), or None."""
        c, P = self.config, self.params
        inputs = torch.as_tensor(np.asarray(inputs), dtype=torch.long)
        B, T = inputs.shape
        H, Hkv, hd = c.n_heads, c.n_kv_heads, c.head_dim
        cos, sin = rope_cos_sin(T, hd, c.rope_theta, self.dtype)
        x = P["embed.weight"][inputs]                                             # [B, T, d]
        for i in range(c.n_layers):
            p = f"layers.{i}."
            h = rmsnorm(x, P[p + "attn_norm.weight"], c.norm_eps)
            q = (h @ P[p + "attn.wq.weight"].T).view(B, T, H, hd).transpose(1, 2)    # [B, H, T, hd]
            k = (h @ P[p + "attn.wk.weight"].T).view(B, T, Hkv, hd).transpose(1, 2)  # [B, Hkv, T, hd]
            v = (h @ P[p + "attn.wv.weight"].T).view(B, T, Hkv, hd).transpose(1, 2)  # [B, Hkv, T, hd]
            q = apply_rope(q, cos, sin, self.rope_pairing)
            k = apply_rope(k, cos, sin, self.rope_pairing)
            a = causal_gqa_attention(q, k, v, self.gqa_map)                          # [B, H, T, hd]
            a = a.transpose(1, 2).reshape(B, T, H * hd)
            o = a @ P[p + "attn.wo.weight"].T
            x = x + (o if dropout_masks is None else o * to_torch(dropout_masks[i][0]))
            h = rmsnorm(x, P[p + "ffn_norm.weight"], c.norm_eps)
            f = swiglu(h, P[p + "ffn.gate.weight"], P[p + "ffn.up.weight"], P[p + "ffn.down.weight"])
            x = x + (f if dropout_masks is None else f * to_torch(dropout_masks[i][1]))
        return rmsnorm(x, P["norm.weight"], c.norm_eps)

    def logits(self, inputs, dropout_masks=None) -> torch.Tensor:
        """int inputs [B, T] -> logits of every head [K, B, T, V]."""
        z = self.hidden(inputs, dropout_masks)
        return torch.stack([z @ self.params[f"heads.{k}.weight"].T for k in range(self.config.n_mtp)])

    def losses(self, tokens, loss_mask=None, dropout_masks=None) -> tuple[torch.Tensor, torch.Tensor]:
        """int tokens [B, T+K] (+ bool loss_mask [B, T+K], True where a target counts)
        -> (per-head mean cross-entropies [K], objective = their mean)."""
        K = self.config.n_mtp
        tokens = torch.as_tensor(np.asarray(tokens), dtype=torch.long)
        T = tokens.shape[1] - K
        logits = self.logits(tokens[:, :T], dropout_masks)                         # [K, B, T, V]
        targets_all = tokens
        if loss_mask is not None:                                                  # False => ignore (-1)
            mask = torch.as_tensor(np.asarray(loss_mask), dtype=torch.bool)
            targets_all = torch.where(mask, tokens, torch.full_like(tokens, -1))
        per_head = []
        for k in range(K):
            targets = targets_all[:, 1 + k: T + 1 + k]                                 # [B, T], -1 = ignored
            per_head.append(F.cross_entropy(logits[k].reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                            ignore_index=-1, reduction="mean"))
        per_head = torch.stack(per_head)
        return per_head, per_head.mean()

    def loss_and_grads(self, tokens, loss_mask=None, dropout_masks=None) -> tuple[float, float, dict[str, np.ndarray]]:
        """Same contract as nanoeuler's Model.loss_and_grads: (head0_loss, objective, grads by SPEC name)."""
        for p in self.params.values():
            p.grad = None
        per_head, objective = self.losses(tokens, loss_mask, dropout_masks)
        objective.backward()
        grads = {n: p.grad.detach().numpy().copy() for n, p in self.params.items()}
        return float(per_head[0].detach()), float(objective.detach()), grads


# ---------------------------------------------------------------- AdamW

def make_adamw(params: dict[str, torch.Tensor], lr: float, betas=(0.9, 0.95), eps: float = 1e-8,
               weight_decay: float = 0.1) -> torch.optim.AdamW:
    """torch.optim.AdamW with two groups: decoupled weight decay on params with ndim >= 2, none on the rest."""
    decay = [p for p in params.values() if p.ndim >= 2]
    no_decay = [p for p in params.values() if p.ndim < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=lr, betas=betas, eps=eps, foreach=False)


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    for group in opt.param_groups:
        group["lr"] = lr
