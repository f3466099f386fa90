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
from ..checkpoint import drop_pages
from ..config import Config, head_weight
from . import gemv, kernels, pool
from .cache import KVCache, attend_rows
from .weights import Forms, batched_linear, linear, of_dtype

MATRICES = ("qkv", "wo", "mlp_in", "mlp_out")  # the per-layer matrices of the layout, in a step's order


def fuse_weights(cfg: Config, P: dict, forms: Forms) -> dict:
    """The inference layout of P: each matrix a forms.pair triple (see weights.py), biases stacked like their
    matrices (None where the architecture has none), norms as (weight, bias or None) of the NumPy path's values,
    the embedding as it is (its rows are widened or dequantized when looked up: `embed`). With kernels,
    W["decode"] holds the fused step's weights (kernels.Weights) and W["kernel forms"] the arrays they point to."""
    f32, kernel_form, pair = forms.values, forms.kernel_form, forms.pair
    K, V = cfg.n_mtp, cfg.vocab_size
    a = cfg.spec
    parts = [head_weight(P, k) for k in range(K)]
    heads32 = None if forms.kernels else f32(np.concatenate(parts))  # [K·V, d] (tied: head 0 is the embedding)
    head0 = _packed_by_rows(forms, parts[0])  # decoding reads head 0 only (a tied head: the embedding's blocks)
    if forms.kernels:
        pool.start_helpers()  # their compiled loop loads while the layers are packed
    drop_pages(parts[1:])
    W = {"embed": P["embed.weight"], "pos": f32(P["pos_embed.weight"]) if a.positions == "learned" else None,
         "embed_scale": _embed_scale(cfg), "norm": final_norm(cfg, P, f32),
         "heads": pair(tuple(parts) if forms.kernels else heads32, head0 if K == 1 else kernel_form(np.concatenate(parts))),
         "head.0": pair((parts[0],) if forms.kernels else heads32[:V], head0)}
    layers = [f"layers.{i}." for i in range(cfg.n_layers)]
    names = [a.layer_products(i) for i in range(cfg.n_layers)]
    segments, buf = _segments(cfg, P, names, forms) if forms.kernels else (None, None)
    for i, p in enumerate(layers):
        for j, m in enumerate(MATRICES):
            ps = [P[n] for n in names[i][m]]
            if forms.kernels:  # the parameters themselves, and the kernel form where it is one array
                W[p + m] = pair(tuple(ps), segments[i][j][0][1] if len(segments[i][j]) == 1 else None)
            else:
                W[p + m] = pair(np.concatenate([f32(x) for x in ps]) if len(ps) > 1 else f32(ps[0]))
            biases = [n.removesuffix("weight") + "bias" for n in names[i][m]]
            W[p + m + ".bias"] = f32(np.concatenate([P[b] for b in biases])) if biases[0] in P else None
        for norm in a.layer_norms:
            W[p + norm] = norm_pair(P, p + norm, f32)
    if forms.kernels:
        W["decode"] = kernels.weights(cfg, W, [[[kernels.segment(kind, Wk, out) for kind, Wk, out in segs]
                                                for segs in layer] for layer in segments], buf)
    return W


HEAD_ROWS = 64 * gemv.PANEL  # rows of a head packed at a time


def _packed_by_rows(forms: Forms, A: np.ndarray) -> np.ndarray | None:
    """forms.kernel_form(A) made HEAD_ROWS rows at a time, each slice's pages of a mapped file let go of once
    packed (a lookup reads back the rows it needs): a large vocabulary's head (Gemma 3's 262,144 rows, 170 MB
    of blocks) is never unpacked whole nor resident twice. Panels hold consecutive rows, so a slice of
    HEAD_ROWS rows is a slice of the packed panels."""
    if not forms.kernels:
        return None
    shape, dtype = of_dtype(A.dtype).packed(A.shape)
    out = np.empty(shape, dtype)
    for r in range(0, A.shape[0], HEAD_ROWS):
        p, rows = r // gemv.PANEL, A[r:r + HEAD_ROWS]
        forms.kernel_form(rows, out[p:p + -(-rows.shape[0] // gemv.PANEL)])
        drop_pages([rows])
    return out


def _embed_scale(cfg: Config) -> float | None:
    """The factor of the looked-up rows (model.embed_scale): √dim where arch.embed_scale, times embedding_multiplier;
    None: 1."""
    scale = (float(np.sqrt(cfg.dim)) if cfg.spec.embed_scale else 1.0) * cfg.embedding_multiplier
    return scale if scale != 1 else None


def final_norm(cfg: Config, P: dict, f32) -> tuple:
    """The final norm's (weight, bias or None), both divided by logits_scaling (Granite's): its output is the heads'
    input, so every head's logits come out divided by it."""
    w, b = norm_pair(P, "norm", f32)
    if cfg.logits_scaling == 1:
        return w, b
    s = np.float32(cfg.logits_scaling)
    return w / w.dtype.type(s), None if b is None else b / b.dtype.type(s)


def norm_pair(P: dict, name: str, f32) -> tuple:
    """(weight, bias or None) of the norm `name` (an RMSNorm has no bias)."""
    return f32(P[name + ".weight"]), f32(P[name + ".bias"]) if name + ".bias" in P else None


def _segments(cfg: Config, P: dict, names: list, forms: Forms) -> tuple[list, np.ndarray]:
    """(per layer, per matrix of MATRICES: its segments [(kind, kernel form, outputs)], the buffer they are views
    of): consecutive parameters of one weight type stacked into one segment (a file's Q5_0 q and k beside a Q8_0
    v: two); one buffer for every kernel form (one allocation of > 4 MB: NumPy asks the kernel for huge pages,
    fewer TLB misses per token)."""
    plan = []   # per layer, per matrix: [(weight type, its consecutive parameters of that type)]
    for i in range(cfg.n_layers):
        layer = []
        for m in MATRICES:
            groups = []
            for n in names[i][m]:
                t = of_dtype(P[n].dtype)
                if groups and groups[-1][0] is t:
                    groups[-1][1].append(P[n])
                else:
                    groups.append((t, [P[n]]))
            layer.append(groups)
        plan.append(layer)
    shapes = [t.packed((sum(p.shape[0] for p in ps), ps[0].shape[1])) for layer in plan for segs in layer
              for t, ps in segs]
    sizes = [-(-int(np.prod(sh)) * dt.itemsize // 64) * 64 for sh, dt in shapes]
    buf = np.empty(sum(sizes) + 64, np.uint8)
    off = -buf.ctypes.data % 64   # every kernel form 64-byte aligned
    out, k = [], 0
    for layer in plan:
        out.append([])
        for segs in layer:
            out[-1].append([])
            for t, parts in segs:
                (sh, dt), size = shapes[k], sizes[k]
                Wk = buf[off:off + int(np.prod(sh)) * dt.itemsize].view(dt).reshape(sh)
                _pack_parts(forms, parts, Wk)
                out[-1][-1].append((t.kind, Wk, sum(p.shape[0] for p in parts)))
                off, k = off + size, k + 1
    return out, buf


def _pack_parts(forms: Forms, parts: list, out: np.ndarray) -> None:
    """The kernel form of parts (matrices of one type) stacked along the outputs, written into out: part by part
    into its own panels where every part but the last fills whole panels (q, k, v of 2048, 512, 512 rows: no
    stacked copy made), else stacked first. Each part's pages of a mapped file (a GGUF's blocks) are let go of
    once it is packed, so at most one part of the file is resident at a time; parts whose rows a file holds in
    another order (checkpoint.Reordered: a GGUF's q and k) are copied in our order only while packed."""
    if any(p.shape[0] % gemv.PANEL for p in parts[:-1]):
        forms.kernel_form(np.concatenate(parts), out)
        drop_pages(parts)
        return
    at = 0
    for p in parts:
        panels = -(-p.shape[0] // gemv.PANEL)
        forms.kernel_form(np.asarray(p), out[at:at + panels])   # (a checkpoint.Reordered's rows: a passing copy)
        drop_pages([p])
        at += panels


# ---- the pieces of a block -------------------------------------------------------------------------------
def norm(cfg: Config, wb: tuple, x: np.ndarray) -> np.ndarray:
    """The architecture's norm of x [..., n] with (weight, bias) wb."""
    w, b = wb
    if b is None:
        return ops.rmsnorm_forward(x, w, cfg.norm_eps)[0]
    return ops.layernorm_forward(x, w, b, cfg.norm_eps)[0]


def pre_norm(cfg: Config, W: dict, name: str, x: np.ndarray) -> np.ndarray:
    """A sub-block's input norm `name` of x, or x itself where the architecture has none (OLMo 2)."""
    return norm(cfg, W[name], x) if cfg.spec.pre_norms else x


def affine(x: np.ndarray, W: dict, name: str, product=None) -> np.ndarray:
    """x @ W[name]ᵀ (+ W[name.bias]); product: the matrix product (default `linear`, a step's few rows)."""
    y = (product or linear)(x, W[name])
    return y if W[name + ".bias"] is None else y + W[name + ".bias"]


def embed(cfg: Config, W: dict, tokens: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """Token ids (any shape) at positions pos (same shape) -> x [..., d]: the looked-up rows, scaled (Gemma)
    and with their learned position rows added (GPT-2)."""
    if tokens.size and (tokens.min() < 0 or tokens.max() >= W["embed"].shape[0]):
        raise IndexError("token id out of range")
    t = of_dtype(W["embed"].dtype)
    x = W["embed"][tokens] if t is None else t.values(W["embed"][tokens])  # float16 widened, blocks dequantized
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
    q, k = qkv[..., :H * hd], qkv[..., H * hd:(H + Hkv) * hd]
    if cfg.spec.qk_norm and cfg.spec.qk_norm_whole:   # each projection normed whole (OLMo 2)
        q, k = norm(cfg, W[p + "attn.q_norm"], q), norm(cfg, W[p + "attn.k_norm"], k)
    q, k = q.reshape(*lead, H, hd), k.reshape(*lead, Hkv, hd)
    v = qkv[..., (H + Hkv) * hd:].reshape(*lead, Hkv, hd)
    if cfg.spec.qk_norm and not cfg.spec.qk_norm_whole:
        q, k = norm(cfg, W[p + "attn.q_norm"], q), norm(cfg, W[p + "attn.k_norm"], k)
    if cos is not None:
        q, k = ops.rope_forward(q, cos, sin)[0], ops.rope_forward(k, cos, sin)[0]
    if cfg.query_factor() != 1:   # the attention's q·kᵀ/√hd is then q·kᵀ·score_scale
        q = ops.scale_forward(q, cfg.query_factor())[0]
    return q, k, v


def residual_attention(cfg: Config, W: dict, p: str, x: np.ndarray, a: np.ndarray, product=None) -> np.ndarray:
    """x + post(a·Woᵀ + b): the attention's output a [..., H·hd] added to the residual stream."""
    o = affine(a, W, p + "wo", product)
    if cfg.spec.post_norms:
        o = norm(cfg, W[p + "attn_post_norm"], o)
    return x + residual(cfg, o)


def residual_mlp(cfg: Config, W: dict, p: str, x: np.ndarray, layer_input: np.ndarray, product=None) -> np.ndarray:
    """x + post(mlp(norm(x))): the feed-forward sub-block; with the parallel residual (GPT-NeoX) the MLP reads
    the layer's input instead, x + post(mlp(norm(layer_input)))."""
    h = pre_norm(cfg, W, p + "ffn_norm", layer_input if cfg.parallel_residual else x)
    u = affine(h, W, p + "mlp_in", product)  # gated: [..., 2F] = [gate | up]; gelu: [..., F]
    mlp = cfg.spec.mlp
    if mlp == "gelu":
        s = (ops.gelu_erf_forward if cfg.spec.gelu_erf else ops.gelu_forward)(u)[0]
    else:
        F = cfg.ffn_hidden
        s = (ops.swiglu_forward if mlp == "swiglu" else ops.geglu_forward)(u[..., :F], u[..., F:])[0]
    f = affine(s, W, p + "mlp_out", product)
    if cfg.spec.post_norms:
        f = norm(cfg, W[p + "ffn_post_norm"], f)
    return x + residual(cfg, f)


def residual(cfg: Config, y: np.ndarray) -> np.ndarray:
    """A sub-block's output y as added to the residual stream: times residual_multiplier (Granite's)."""
    return y if cfg.residual_multiplier == 1 else ops.scale_forward(y, cfg.residual_multiplier)[0]


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
        q, k, v = heads_qkv(cfg, W, p, pre_norm(cfg, W, p + "attn_norm", x), cos, sin)  # [B, Tn, H|Hkv, hd]
        cache.k[i][:, :, L:L + Tn] = k.transpose(0, 2, 1, 3)
        cache.v[i][:, :, L:L + Tn] = v.transpose(0, 2, 1, 3)
        a, _ = ops.attention_forward(q.transpose(0, 2, 1, 3), cache.k[i][:, :, :L + Tn], cache.v[i][:, :, :L + Tn],
                                     cfg.window(i), cfg.attn_softcap)  # [B, H, Tn, hd]
        mid = residual_attention(cfg, W, p, x, a.transpose(0, 2, 1, 3).reshape(B, Tn, H * hd))
        x = residual_mlp(cfg, W, p, mid, x)
    cache.length = L + Tn
    if last_only:
        x = x[:, -1:]
    return norm(cfg, W["norm"], x)


def forward_rows(cfg: Config, W: dict, cache: KVCache, tokens: np.ndarray, pos: np.ndarray,
                 slots: np.ndarray | None = None) -> np.ndarray:
    """One token for each of n rows: tokens int [n] at positions pos [n] (cache row slots[r], default r, holds
    positions 0..pos[r]-1) -> final normed hidden states [n, d]; writes each row's new key/value at pos[r]."""
    x = embed(cfg, W, tokens, pos)  # [n, d]
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        cos, sin = cache.tables(i, pos[:, None])  # [n, 1, hd/2] or None
        q, k, v = heads_qkv(cfg, W, p, pre_norm(cfg, W, p + "attn_norm", x), cos, sin, batched_linear)
        a = attend_rows(cache, i, q, k, v, pos, cfg.window(i), slots, cfg.attn_softcap)  # [n, H·hd]
        mid = residual_attention(cfg, W, p, x, a, batched_linear)
        x = residual_mlp(cfg, W, p, mid, x, batched_linear)
    return norm(cfg, W["norm"], x)
