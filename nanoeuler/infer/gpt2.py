"""Arch "gpt2" (model.py's `gpt2_forward`) for inference: its weight layout and the NumPy forward.

The decoding loop (session.py, speculative decoding, the batcher) needs four things of an architecture
(step.py's registry): an inference layout of the weights (`fuse_weights`), a cached forward to the final
norm for one sequence (`forward_hidden`) and for one token per row (`forward_rows`), and head matrices
`W["head.0"]` / `W["heads"]` (all K stacked) in that layout. These are the GPT-2 ones:
LayerNorm with bias, q/k/v stacked into one biased matmul, no RoPE (the learned position rows of the new
tokens' positions are added to their embeddings instead), GELU-tanh MLP, head 0 tied to the embedding.
Their logits equal the full recomputation's (tests/test_gpt2_downstream.py).
"""
from __future__ import annotations

import numpy as np

from .. import ops
from ..config import Config, head_weight
from .cache import KVCache, attend_rows
from .weights import Forms, batched_linear, linear


def fuse_weights(cfg: Config, P: dict, forms: Forms) -> dict:
    """arch gpt2 -> the inference layout: per layer qkv [(H+2·Hkv)·hd, d] with its stacked bias, and the
    K heads stacked (head 0 = embed.weight); each matrix a forms.pair triple of the float32 values."""
    P = {name: forms.values(p) for name, p in P.items()}
    pair = forms.pair
    heads = [head_weight(P, k) for k in range(cfg.n_mtp)]
    F = {"embed": P["embed.weight"], "pos": P["pos_embed.weight"], "norm": (P["norm.weight"], P["norm.bias"]),
         "heads": pair(np.concatenate(heads) if cfg.n_mtp > 1 else heads[0])}  # [K·V, d]
    F["head.0"] = pair(heads[0])  # decoding reads head 0 only
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        F[p + "qkv"] = pair(np.concatenate([P[p + f"attn.w{x}.weight"] for x in "qkv"]))
        F[p + "qkv.bias"] = np.concatenate([P[p + f"attn.w{x}.bias"] for x in "qkv"])
        for name in ("attn.wo", "ffn.fc", "ffn.proj"):
            F[p + name] = pair(P[p + name + ".weight"])
            F[p + name + ".bias"] = P[p + name + ".bias"]
        for name in ("attn_norm", "ffn_norm"):
            F[p + name] = (P[p + name + ".weight"], P[p + name + ".bias"])
    return F


def forward_hidden(cfg: Config, W: dict, inputs: np.ndarray, cache: KVCache, last_only: bool = False) -> np.ndarray:
    """inputs int [B, Tn] at positions cache.length .. cache.length+Tn-1 -> h [B, Tn|1, d] after the final
    LayerNorm; the cache grows by Tn."""
    B, Tn = inputs.shape
    L = cache.length
    H, Hkv, hd, eps = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.norm_eps
    x, _ = ops.position_forward(W["embed"][inputs], W["pos"], start=L)  # [B, Tn, d]
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        h, _ = ops.layernorm_forward(x, *W[p + "attn_norm"], eps)
        qkv = linear(h, W[p + "qkv"]) + W[p + "qkv.bias"]  # [B, Tn, (H + 2·Hkv)·hd]
        q = qkv[..., :H * hd].reshape(B, Tn, H, hd).transpose(0, 2, 1, 3)  # [B, H, Tn, hd]
        cache.k[i][:, :, L:L + Tn] = qkv[..., H * hd:(H + Hkv) * hd].reshape(B, Tn, Hkv, hd).transpose(0, 2, 1, 3)
        cache.v[i][:, :, L:L + Tn] = qkv[..., (H + Hkv) * hd:].reshape(B, Tn, Hkv, hd).transpose(0, 2, 1, 3)
        a, _ = ops.attention_forward(q, cache.k[i][:, :, :L + Tn], cache.v[i][:, :, :L + Tn])  # [B, H, Tn, hd]
        x = x + linear(a.transpose(0, 2, 1, 3).reshape(B, Tn, H * hd), W[p + "attn.wo"]) + W[p + "attn.wo.bias"]
        h2, _ = ops.layernorm_forward(x, *W[p + "ffn_norm"], eps)
        g, _ = ops.gelu_forward(linear(h2, W[p + "ffn.fc"]) + W[p + "ffn.fc.bias"])  # [B, Tn, F]
        x = x + linear(g, W[p + "ffn.proj"]) + W[p + "ffn.proj.bias"]
    cache.length = L + Tn
    if last_only:
        x = x[:, -1:]
    return ops.layernorm_forward(x, *W["norm"], eps)[0]


def forward_rows(cfg: Config, W: dict, cache: KVCache, tokens: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """One token for each of n rows: tokens int [n] at positions pos [n] (cache row r holds positions
    0..pos[r]-1) -> final normed hidden states [n, d]; writes each row's new key/value at pos[r]."""
    n = len(tokens)
    H, Hkv, hd, eps = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.norm_eps
    x = W["embed"][tokens] + W["pos"][pos]  # [n, d]
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        h, _ = ops.layernorm_forward(x, *W[p + "attn_norm"], eps)
        qkv = batched_linear(h, W[p + "qkv"]) + W[p + "qkv.bias"]  # [n, (H + 2·Hkv)·hd]
        a = attend_rows(cache, i, qkv[:, :H * hd].reshape(n, H, hd), qkv[:, H * hd:(H + Hkv) * hd].reshape(n, Hkv, hd),
                        qkv[:, (H + Hkv) * hd:].reshape(n, Hkv, hd), pos)  # [n, H·hd]
        x = x + batched_linear(a, W[p + "attn.wo"]) + W[p + "attn.wo.bias"]
        h2, _ = ops.layernorm_forward(x, *W[p + "ffn_norm"], eps)
        g, _ = ops.gelu_forward(batched_linear(h2, W[p + "ffn.fc"]) + W[p + "ffn.fc.bias"])  # [n, F]
        x = x + batched_linear(g, W[p + "ffn.proj"]) + W[p + "ffn.proj.bias"]
    return ops.layernorm_forward(x, *W["norm"], eps)[0]
