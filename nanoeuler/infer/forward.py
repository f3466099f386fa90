"""The inference layout of any architecture's weights, and the readable NumPy forward over a KV cache.

`fuse_weights` lays a model's parameters out for decoding: q|k|v stacked into one matrix per layer (and
their biases), the MLP's input matrices into one ([gate; up], or GPT-2's fc), the K heads into one [K·V, d];
so a decoding step makes 4 matmuls per layer plus 1 for the heads. Where the fused kernels run the model
(weights.Forms.kernels) it also builds their stacked weights, W["decode"] (kernels.Weights), every kind of
matrix stacked over the layers in one buffer, W's per-layer matrices being views of it.

`forward_hidden` (one sequence, or a batch at equal positions) and `forward_rows` (one token per row, each at
its own position) are the reference: any dtype, any number of rows, every architecture (arch.py): the same
block as model.py's, reading the cache (cache.py) instead of recomputing the prefix. step.py chooses between
them and the fused kernels (kernels.py), which compute the same to float32 rounding.

float16 weights (weights.Float16Model; `sample --dtype float16`) decode in float32 arithmetic on the weights
rounded to float16, as llama.cpp runs an f16 GGUF: the fused step reads the float16 bits (half the memory
traffic of float32), the NumPy path their float32 values. With kernels, the NumPy path's matrices are the
parameters themselves (raw parts: weights.values widens / dequantizes them per use), so the layout holds P
and one kernel form of it; a float16 or quantized model's one float32 matrix is the embedding (the fused
step reads its rows).
"""
from __future__ import annotations

import numpy as np

from .. import ops
from ..config import Config, head_weight
from . import kernels
from .cache import KVCache, attend_rows
from .weights import Forms, batched_linear, linear

MATRICES = ("qkv", "wo", "mlp_in", "mlp_out")  # the per-layer matrices of the layout, in a step's order


def fuse_weights(cfg: Config, P: dict, forms: Forms) -> dict:
    """The inference layout of P: each matrix a forms.pair triple (see weights.py), biases stacked like their
    matrices (None where the architecture has none), norms as (weight, bias or None) of the NumPy path's values.
    With kernels, W["decode"] holds the fused step's weights (kernels.Weights)."""
    f32, kernel_form, pair = forms.values, forms.kernel_form, forms.pair
    K, V = cfg.n_mtp, cfg.vocab_size
    a = cfg.spec
    parts = [head_weight(P, k) for k in range(K)]
    heads32 = None if forms.kernels else f32(np.concatenate(parts))  # [K·V, d] (tied: head 0 is the embedding)
    head0 = kernel_form(parts[0])  # [panels, d, PANEL]: decoding reads head 0 only
    W = {"embed": f32(P["embed.weight"]), "pos": f32(P["pos_embed.weight"]) if a.positions == "learned" else None,
         "embed_scale": float(np.sqrt(cfg.dim)) if a.embed_scale else None, "norm": norm_pair(P, "norm", f32),
         "heads": pair(tuple(parts) if forms.kernels else heads32, head0 if K == 1 else kernel_form(np.concatenate(parts))),
         "head.0": pair((parts[0],) if forms.kernels else heads32[:V], head0)}
    layers = [f"layers.{i}." for i in range(cfg.n_layers)]
    names = [a.layer_products(i) for i in range(cfg.n_layers)]
    mats = {m: [[P[n] for n in names[i][m]] for i in range(cfg.n_layers)] for m in MATRICES}
    if forms.kernels:
        packed = _stack(mats, forms)
        mats = {m: [(tuple(mats[m][i]), packed[m][i]) for i in range(cfg.n_layers)] for m in MATRICES}
    else:
        mats = {m: [(f32(np.concatenate(ps)) if len(ps) > 1 else f32(ps[0]), None) for ps in mats[m]] for m in MATRICES}
    for i, p in enumerate(layers):
        for m in MATRICES:
            W[p + m] = pair(*mats[m][i])
            biases = [n.removesuffix("weight") + "bias" for n in names[i][m]]
            W[p + m + ".bias"] = f32(np.concatenate([P[b] for b in biases])) if biases[0] in P else None
        for norm in a.layer_norms:
            W[p + norm] = norm_pair(P, p + norm, f32)
    if forms.kernels:
        W["decode"] = kernels.weights(cfg, W, packed)
    return W


def norm_pair(P: dict, name: str, f32) -> tuple:
    """(weight, bias or None) of the norm `name` (an RMSNorm has no bias)."""
    return f32(P[name + ".weight"]), f32(P[name + ".bias"]) if name + ".bias" in P else None


def _stack(mats: dict, forms: Forms) -> dict:
    """mats {kind: per layer [parts [out_j, in]]} -> {kind: the kernel form of its [layers, Σ out_j, in] stack
    [layers, panels, in, PANEL]}, every kernel form in one buffer (one allocation of > 4 MB: NumPy asks the
    kernel for huge pages, fewer TLB misses per token)."""
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


# ---- the pieces of a block -------------------------------------------------------------------------------
def norm(cfg: Config, wb: tuple, x: np.ndarray) -> np.ndarray:
    """The architecture's norm of x [..., n] with (weight, bias) wb."""
    w, b = wb
    if b is None:
        return ops.rmsnorm_forward(x, w, cfg.norm_eps)[0]
    return ops.layernorm_forward(x, w, b, cfg.norm_eps)[0]


def affine(x: np.ndarray, W: dict, name: str, product=None) -> np.ndarray:
    """x @ W[name]ᵀ (+ W[name.bias]); product: the matrix product (default `linear`, a step's few rows)."""
    y = (product or linear)(x, W[name])
    return y if W[name + ".bias"] is None else y + W[name + ".bias"]


def embed(cfg: Config, W: dict, tokens: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """Token ids (any shape) at positions pos (same shape) -> x [..., d]: the looked-up rows, scaled (Gemma)
    and with their learned position rows added (GPT-2)."""
    x = W["embed"][tokens]
    if W["embed_scale"] is not None:
        x = x * x.dtype.type(W["embed_scale"])
    if W["pos"] is not None:
        x = x + W["pos"][pos]
    return x


def heads_qkv(cfg: Config, W: dict, p: str, h: np.ndarray, cos, sin, product=None):
    """Layer p's q [..., H, hd], k, v [..., Hkv, hd] of normed rows h [..., d]: projected, q/k-normed per head
    where the architecture says so, rotated with the tables cos, sin (broadcast to [..., 1, hd/2]; None: no
    RoPE)."""
    H, Hkv, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    qkv = affine(h, W, p + "qkv", product)  # [..., (H + 2·Hkv)·hd]
    lead = qkv.shape[:-1]
    q = qkv[..., :H * hd].reshape(*lead, H, hd)
    k = qkv[..., H * hd:(H + Hkv) * hd].reshape(*lead, Hkv, hd)
    v = qkv[..., (H + Hkv) * hd:].reshape(*lead, Hkv, hd)
    if cfg.spec.qk_norm:
        q, k = norm(cfg, W[p + "attn.q_norm"], q), norm(cfg, W[p + "attn.k_norm"], k)
    if cos is not None:
        q, k = ops.rope_forward(q, cos, sin)[0], ops.rope_forward(k, cos, sin)[0]
    return q, k, v


def residual_attention(cfg: Config, W: dict, p: str, x: np.ndarray, a: np.ndarray, product=None) -> np.ndarray:
    """x + post(a·Woᵀ + b): the attention's output a [..., H·hd] added to the residual stream."""
    o = affine(a, W, p + "wo", product)
    if cfg.spec.post_norms:
        o = norm(cfg, W[p + "attn_post_norm"], o)
    return x + o


def residual_mlp(cfg: Config, W: dict, p: str, x: np.ndarray, product=None) -> np.ndarray:
    """x + post(mlp(norm(x))): the feed-forward sub-block."""
    h = norm(cfg, W[p + "ffn_norm"], x)
    u = affine(h, W, p + "mlp_in", product)  # gated: [..., 2F] = [gate | up]; gelu: [..., F]
    mlp = cfg.spec.mlp
    if mlp == "gelu":
        s = ops.gelu_forward(u)[0]
    else:
        F = cfg.ffn_hidden
        s = (ops.swiglu_forward if mlp == "swiglu" else ops.geglu_forward)(u[..., :F], u[..., F:])[0]
    f = affine(s, W, p + "mlp_out", product)
    if cfg.spec.post_norms:
        f = norm(cfg, W[p + "ffn_post_norm"], f)
    return x + f


# ---- the forwards -----------------------------------------------------------------------------------------
def forward_hidden(cfg: Config, W: dict, inputs: np.ndarray, cache: KVCache, last_only: bool = False) -> np.ndarray:
    """The NumPy KV-cache forward up to the final norm: inputs int [B, Tn] at positions cache.length ..
    cache.length+Tn-1 -> h [B, Tn|1, d]; the cache grows by Tn."""
    B, Tn = inputs.shape
    L = cache.length
    H, hd = cfg.n_heads, cfg.head_dim
    positions = np.arange(L, L + Tn)
    x = embed(cfg, W, inputs, np.broadcast_to(positions, inputs.shape))  # [B, Tn, d]
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        cos, sin = cache.tables(i, positions[:, None])  # [Tn, 1, hd/2] or None
        q, k, v = heads_qkv(cfg, W, p, norm(cfg, W[p + "attn_norm"], x), cos, sin)  # [B, Tn, H|Hkv, hd]
        cache.k[i][:, :, L:L + Tn] = k.transpose(0, 2, 1, 3)
        cache.v[i][:, :, L:L + Tn] = v.transpose(0, 2, 1, 3)
        a, _ = ops.attention_forward(q.transpose(0, 2, 1, 3), cache.k[i][:, :, :L + Tn], cache.v[i][:, :, :L + Tn],
                                     cfg.window(i))  # [B, H, Tn, hd]
        x = residual_attention(cfg, W, p, x, a.transpose(0, 2, 1, 3).reshape(B, Tn, H * hd))
        x = residual_mlp(cfg, W, p, x)
    cache.length = L + Tn
    if last_only:
        x = x[:, -1:]
    return norm(cfg, W["norm"], x)


def forward_rows(cfg: Config, W: dict, cache: KVCache, tokens: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """One token for each of n rows: tokens int [n] at positions pos [n] (cache row r holds positions
    0..pos[r]-1) -> final normed hidden states [n, d]; writes each row's new key/value at pos[r]."""
    x = embed(cfg, W, tokens, pos)  # [n, d]
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        cos, sin = cache.tables(i, pos[:, None])  # [n, 1, hd/2] or None
        q, k, v = heads_qkv(cfg, W, p, norm(cfg, W[p + "attn_norm"], x), cos, sin, batched_linear)
        a = attend_rows(cache, i, q, k, v, pos, cfg.window(i))  # [n, H·hd]
        x = residual_attention(cfg, W, p, x, a, batched_linear)
        x = residual_mlp(cfg, W, p, x, batched_linear)
    return norm(cfg, W["norm"], x)
