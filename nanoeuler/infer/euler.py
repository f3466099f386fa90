"""Arch "euler" (RMSNorm, RoPE, SwiGLU, no biases, K heads) for inference: its weight layout and the readable
NumPy forward.

`fuse_weights` stacks q/k/v into one matrix per layer, gate/up into one, and the K heads into one [K·V, d],
so a decoding step makes 4 matmuls per layer plus 1 for the heads; where the fused kernels run the model
(weights.Forms.kernels) it also builds their stacked weights, W["decode"]. `forward_hidden` (one sequence
or a batch of equal positions) and `forward_rows` (one token per row, each at its own position) are the
reference: any dtype, any number of rows; step.py chooses between them and the fused kernels.
"""
from __future__ import annotations

import numpy as np

from .. import ops
from ..config import Config, head_weight
from . import kernels
from .cache import KVCache, attend_rows
from .weights import Forms, batched_linear, linear


def fuse_weights(cfg: Config, P: dict, forms: Forms) -> dict:
    """The inference layout of P: each matrix a forms.pair triple (see weights.py), the norms as the NumPy
    path's values. With kernels, W["decode"] holds the fused step's weights, each kind of matrix stacked over
    the layers in one buffer, and W's per-layer matrices are views of them (one allocation of > 4 MB: NumPy
    asks the kernel for huge pages, fewer TLB misses per token: big f32 1268 -> 1049 µs a token at 1 thread).

    float16 weights (weights.Float16Model; `sample --dtype float16`) decode in float32 arithmetic on the
    weights rounded to float16, as llama.cpp runs an f16 GGUF: the fused step reads the float16 bits (half
    the memory traffic of float32), the NumPy path their float32 values. With kernels, the NumPy path's
    matrices are the parameters themselves (raw parts: weights.values widens / dequantizes them per use), so
    the layout holds P and one kernel form of it; a float16 or quantized model's one float32 matrix is the
    embedding (the fused step reads its rows)."""
    f32, kernel_form, pair = forms.values, forms.kernel_form, forms.pair
    K, V = cfg.n_mtp, cfg.vocab_size
    parts = [head_weight(P, k) for k in range(K)]
    heads = np.concatenate(parts)  # [K·V, d] (tied: head 0 is the embedding)
    heads32 = None if forms.kernels else f32(heads)
    head0 = kernel_form(parts[0])  # [panels, d, PANEL]: decoding reads head 0 only
    F = {"embed": f32(P["embed.weight"]), "norm": f32(P["norm.weight"]),
         "heads": pair(tuple(parts) if forms.kernels else heads32, head0 if K == 1 else kernel_form(heads)),
         "head.0": pair((parts[0],) if forms.kernels else heads32[:V], head0)}
    layers = [f"layers.{i}." for i in range(cfg.n_layers)]
    mats = {"qkv": [[P[p + "attn.wq.weight"], P[p + "attn.wk.weight"], P[p + "attn.wv.weight"]] for p in layers],
            "gate_up": [[P[p + "ffn.gate.weight"], P[p + "ffn.up.weight"]] for p in layers],  # [2F, d]
            "wo": [[P[p + "attn.wo.weight"]] for p in layers], "down": [[P[p + "ffn.down.weight"]] for p in layers]}
    if forms.kernels:
        packed = _stack(mats, forms)
        for name in mats:  # (the NumPy path's W: the parameters themselves)
            mats[name] = [(tuple(mats[name][i]), packed[name][i]) for i in range(len(layers))]
    else:
        mats = {name: [(f32(np.concatenate(ps)) if len(ps) > 1 else f32(ps[0]), None) for ps in parts]
                for name, parts in mats.items()}
    for i, p in enumerate(layers):
        for name in mats:
            F[p + name] = pair(*mats[name][i])
        F[p + "attn_norm"], F[p + "ffn_norm"] = f32(P[p + "attn_norm.weight"]), f32(P[p + "ffn_norm.weight"])
    if forms.kernels:
        norms = np.stack([np.stack([F[p + "attn_norm"], F[p + "ffn_norm"]]) for p in layers])  # [layers, 2, d]
        F["decode"] = kernels.Weights(F["embed"], packed["qkv"], packed["wo"], packed["gate_up"], packed["down"],
                                      norms, F["norm"])
    return F


def _stack(mats: dict, forms: Forms) -> dict:
    """mats {kind: per layer [parts [out_j, in]]} -> {kind: the kernel form of its [layers, Σ out_j, in] stack
    [layers, panels, in, PANEL]}, every kernel form in one buffer."""
    stacked = {}
    for name, parts in mats.items():
        stacked[name] = S = np.empty((len(parts), sum(p.shape[0] for p in parts[0]), parts[0][0].shape[1]),
                                     parts[0][0].dtype)
        for i, ps in enumerate(parts):
            np.concatenate(ps, out=S[i])
    shapes = {name: forms.wt.packed(S.shape)[0] for name, S in stacked.items()}
    buf = np.empty(sum(np.prod(sh) for sh in shapes.values()), forms.wt.packed(stacked["qkv"].shape)[1])
    packed, off = {}, 0
    for name, sh in shapes.items():
        packed[name] = forms.kernel_form(stacked[name], buf[off:off + np.prod(sh)].reshape(sh))
        off += np.prod(sh)
    return packed


def forward_hidden(cfg: Config, W: dict, inputs: np.ndarray, cache: KVCache, last_only: bool = False) -> np.ndarray:
    """The NumPy KV-cache forward up to the final RMSNorm: inputs int [B, Tn] at positions cache.length ..
    cache.length+Tn-1 -> h [B, Tn|1, d]; the cache grows by Tn."""
    B, Tn = inputs.shape
    L = cache.length
    H, Hkv, hd, F = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_hidden
    cos, sin = cache.cos[L:L + Tn], cache.sin[L:L + Tn]  # [Tn, hd/2]
    x = W["embed"][inputs]  # [B, Tn, d]
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        h, _ = ops.rmsnorm_forward(x, W[p + "attn_norm"], cfg.norm_eps)
        qkv = linear(h, W[p + "qkv"])  # [B, Tn, (H + 2·Hkv)·hd]
        q = qkv[..., :H * hd].reshape(B, Tn, H, hd).transpose(0, 2, 1, 3)  # [B, H, Tn, hd]
        k = qkv[..., H * hd:(H + Hkv) * hd].reshape(B, Tn, Hkv, hd).transpose(0, 2, 1, 3)  # [B, Hkv, Tn, hd]
        v = qkv[..., (H + Hkv) * hd:].reshape(B, Tn, Hkv, hd).transpose(0, 2, 1, 3)
        q, _ = ops.rope_forward(q, cos, sin)
        k, _ = ops.rope_forward(k, cos, sin)
        cache.k[i][:, :, L:L + Tn] = k
        cache.v[i][:, :, L:L + Tn] = v
        a, _ = ops.attention_forward(q, cache.k[i][:, :, :L + Tn], cache.v[i][:, :, :L + Tn])  # [B, H, Tn, hd]
        x = x + linear(a.transpose(0, 2, 1, 3).reshape(B, Tn, H * hd), W[p + "wo"])
        h2, _ = ops.rmsnorm_forward(x, W[p + "ffn_norm"], cfg.norm_eps)
        gu = linear(h2, W[p + "gate_up"])  # [B, Tn, 2F]
        s, _ = ops.swiglu_forward(gu[..., :F], gu[..., F:])
        x = x + linear(s, W[p + "down"])
    cache.length = L + Tn
    if last_only:
        x = x[:, -1:]
    return ops.rmsnorm_forward(x, W["norm"], cfg.norm_eps)[0]


def forward_rows(cfg: Config, W: dict, cache: KVCache, tokens: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """One token for each of n rows: tokens int [n] at positions pos [n] (cache row r holds positions
    0..pos[r]-1) -> final normed hidden states [n, d]; writes each row's new key/value at pos[r]."""
    n = len(tokens)
    H, Hkv, hd, F = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_hidden
    cos, sin = cache.cos[pos][:, None], cache.sin[pos][:, None]  # [n, 1, hd/2]
    x = W["embed"][tokens]  # [n, d]
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        h, _ = ops.rmsnorm_forward(x, W[p + "attn_norm"], cfg.norm_eps)
        qkv = batched_linear(h, W[p + "qkv"])  # [n, (H + 2·Hkv)·hd]
        q = ops.rope_forward(qkv[:, :H * hd].reshape(n, H, hd), cos, sin)[0]
        k = ops.rope_forward(qkv[:, H * hd:(H + Hkv) * hd].reshape(n, Hkv, hd), cos, sin)[0]
        a = attend_rows(cache, i, q, k, qkv[:, (H + Hkv) * hd:].reshape(n, Hkv, hd), pos)  # [n, H·hd]
        x = x + batched_linear(a, W[p + "wo"])
        h2, _ = ops.rmsnorm_forward(x, W[p + "ffn_norm"], cfg.norm_eps)
        gu = batched_linear(h2, W[p + "gate_up"])  # [n, 2F]
        sw, _ = ops.swiglu_forward(gu[:, :F], gu[:, F:])
        x = x + batched_linear(sw, W[p + "down"])
    return ops.rmsnorm_forward(x, W["norm"], cfg.norm_eps)[0]
