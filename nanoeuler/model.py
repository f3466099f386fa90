"""The transformer of the SPEC, composed from the forward/backward pairs in `ops/`.

Each of n_layers blocks: x = x + attn(rmsnorm(x)), then x = x + swiglu(rmsnorm(x)); a final RMSNorm,
then K untied output heads (multi-token prediction). The backward pass is the forward read backwards:
every `*_forward` call leaves a cache, and `backward` walks those caches in reverse.

    model = Model.from_preset("small", seed=0)
    head0_loss, objective, grads = model.loss_and_grads(tokens)   # tokens int [B, T+K]

A second architecture, `Config.arch = "gpt2"` (OpenAI's GPT-2, the llm.c path), is composed from the same
kind of pairs (`gpt2_forward` / `gpt2_backward` below):

    x = embed[ids] + pos_embed[0:T]
    per layer: x = x + wo·attn(q, k, v) + bo   with q|k|v = w·layernorm(x) + b
               x = x + proj·gelu_tanh(fc·layernorm(x) + bfc) + bproj
    logits_0 = layernorm(x) @ embed.T          (the head is tied to the token embedding)

Its parameter names (every linear [out, in] like the rest, biases [out]):
    embed.weight [V, d]  pos_embed.weight [ctx, d]
    layers.i.attn_norm.{weight,bias}  layers.i.attn.{wq,wk,wv,wo}.{weight,bias}
    layers.i.ffn_norm.{weight,bias}   layers.i.ffn.fc.{weight,bias} [F, d]  layers.i.ffn.proj.{weight,bias} [d, F]
    norm.{weight,bias}                heads.k.weight for the MTP heads k = 1..K-1 only (head 0 is embed.weight)
embed.weight's gradient is the sum of its two uses (the lookup and the head).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from . import ops as reference_ops
from .config import PRESETS, Config, check_params, head_weight  # noqa: F401  (check_params: re-exported)
from .errors import UserError


class Model:
    """Parameters (SPEC names -> arrays) plus the config; forward, backward, save and load.
    precision: of the fast engine's matrix products, "f32" or "bf16" (`set_precision`; fast/bf16.py)."""

    precision = "f32"

    def __init__(self, config: Config, params: dict[str, np.ndarray]):
        check_params(config, params)
        self.config = config
        self.params = params

    def set_precision(self, precision: str) -> "Model":
        """The precision of the fast engine's matrix products from now on (UserError where it cannot run)."""
        from .fast.engine import check_precision
        self.precision = check_precision(precision, self.dtype)
        if precision != "f32" and not fast_supports(self.config):
            raise UserError(f"--precision {precision} needs the fast engine, which does not run arch {self.config.arch}")
        return self

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def init(cls, config: Config, seed: int = 0, dtype=np.float32) -> "Model":
        """SPEC initialisation: N(0, 0.02); wo and down scaled by 1/sqrt(2·n_layers); norm weights 1.
        arch gpt2 (as GPT-2): the same, ffn.proj scaled like down, every bias 0."""
        rng = np.random.default_rng(seed)
        residual_scale = 1.0 / np.sqrt(2 * config.n_layers)
        params = {}
        for name, shape in config.param_shapes().items():
            if name.endswith("norm.weight"):
                params[name] = np.ones(shape, dtype=dtype)
            elif name.endswith(".bias"):
                params[name] = np.zeros(shape, dtype=dtype)
            else:
                w = rng.normal(0.0, 0.02, size=shape)
                if name.endswith(("attn.wo.weight", "ffn.down.weight", "ffn.proj.weight")):
                    w *= residual_scale
                params[name] = w.astype(dtype)
        return cls(config, params)

    @classmethod
    def from_preset(cls, name: str, seed: int = 0, dtype=np.float32) -> "Model":
        if name not in PRESETS:
            raise UserError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
        return cls.init(PRESETS[name], seed=seed, dtype=dtype)

    @classmethod
    def load(cls, run_dir: str | Path, read_only: bool = False) -> "Model":
        """read_only: change nothing on disk (sample, chat, eval, info, export); see checkpoint.recover."""
        from .adapters import is_adapter_run, load_merged
        from .checkpoint import load_model
        # an adapter run (LoRA) loads as its base with the adapters merged in: a plain model
        config, params = (load_merged if is_adapter_run(run_dir) else load_model)(run_dir, read_only=read_only)
        return cls(config, params)

    def save(self, run_dir: str | Path, tokenizer=None) -> None:
        from .checkpoint import save_model
        save_model(run_dir, self.config, self.params, tokenizer)

    def astype(self, dtype) -> "Model":
        return Model(self.config, {n: p.astype(dtype) for n, p in self.params.items()})

    @property
    def dtype(self):
        return self.params["embed.weight"].dtype

    def n_params(self) -> int:
        return sum(p.size for p in self.params.values())

    # ---- forward / backward -------------------------------------------------------------------
    def logits(self, inputs: np.ndarray) -> np.ndarray:
        """inputs int [B, T] -> logits of every head [K, B, T, V]."""
        check_tokens(self.config, inputs, extra=0)
        return forward(self.config, self.params, inputs)[0]

    def loss_and_grads(self, tokens: np.ndarray, loss_mask: np.ndarray | None = None, *,
                       reference: bool = False, out: dict[str, np.ndarray] | None = None,
                       dropout: reference_ops.Dropout | None = None, counts: list[int] | None = None):
        """tokens int [B, T+K] (loss_mask bool [B, T+K]: True where a target counts)
        -> (head-0 loss, objective = mean of the K heads' losses, grads keyed like params).
        dropout: drop on every residual branch with these masks (training only; see ops/dropout.py).
        counts: targets per head to divide by (a data-parallel rank's share: fast engine only, see fast.heads).

        Runs the fast engine (nanoeuler/fast/); reference=True runs the plain `forward`/`backward` below.
        out: gradient arrays to fill (e.g. the grads of the previous step, or `self.grad_buffers()`),
        else fresh ones are allocated."""
        cfg = self.config
        check_tokens(cfg, tokens, extra=cfg.n_mtp)
        T = tokens.shape[1] - cfg.n_mtp
        self._check_reference(reference)
        if not reference and fast_supports(cfg):
            from . import fast
            return fast.loss_and_grads(cfg, self.params, tokens, loss_mask, self._workspace(tokens.shape[0], T), out,
                                       dropout, counts)
        targets = reference_ops.mtp_targets(tokens, T, cfg.n_mtp, loss_mask)  # [K, B, T]
        logits, caches = forward(cfg, self.params, tokens[:, :T], dropout=dropout)
        objective, head_losses, loss_cache = reference_ops.mtp_loss_forward(logits, targets)
        dlogits = reference_ops.mtp_loss_backward(1.0, loss_cache)
        grads = backward(cfg, self.params, dlogits, caches)
        if out is not None:
            for name, g in grads.items():
                out[name][...] = g
            grads = out
        return head_losses[0], objective, grads

    def loss(self, tokens: np.ndarray, loss_mask: np.ndarray | None = None, *,
             reference: bool = False, dropout: reference_ops.Dropout | None = None) -> tuple[float, float]:
        """Forward only: (head-0 loss, objective); with dropout, the objective loss_and_grads differentiates."""
        cfg = self.config
        check_tokens(cfg, tokens, extra=cfg.n_mtp)
        T = tokens.shape[1] - cfg.n_mtp
        self._check_reference(reference)
        if not reference and fast_supports(cfg):
            from . import fast
            return fast.loss(cfg, self.params, tokens, loss_mask, self._workspace(tokens.shape[0], T), dropout)
        targets = reference_ops.mtp_targets(tokens, T, cfg.n_mtp, loss_mask)
        logits, _ = forward(cfg, self.params, tokens[:, :T], dropout=dropout)
        objective, head_losses, _ = reference_ops.mtp_loss_forward(logits, targets)
        return head_losses[0], objective

    def grad_buffers(self) -> dict[str, np.ndarray]:
        """Gradient arrays laid out as the fast engine writes them best (one flat buffer, SPEC order)."""
        from . import fast
        return fast.grad_buffers(self.config, self.dtype)

    def _check_reference(self, reference: bool) -> None:
        if reference and self.precision != "f32":
            raise ValueError(f"the reference model runs in f32 only, not {self.precision}")

    def _workspace(self, B: int, T: int):
        """The fast engine's buffers for this batch shape and precision, kept between calls (one at a time)."""
        from . import fast
        ws = getattr(self, "_fast_ws", None)
        if ws is None or ws.key != (self.config, B, T, np.dtype(self.dtype), self.precision):
            self._fast_ws = None  # free the old buffers before allocating new ones
            ws = self._fast_ws = fast.Workspace(self.config, B, T, self.dtype, self.precision)
        return ws


def forward(cfg: Config, P: dict, inputs: np.ndarray, ops=reference_ops, dropout=None):
    """inputs int [B, T] -> (logits [K, B, T, V], caches for backward).
    dropout (ops.Dropout, optional): layer i drops on its attention branch with the masks of site 2i and
    on its feed-forward branch with those of site 2i + 1.

    `ops` is the namespace of forward/backward pairs: the NumPy reference, or another backend's kernels
    with the same signatures (the GPU one) — the array-module switch, not a second model.
    """
    if cfg.arch == "gpt2":
        return gpt2_forward(cfg, P, inputs, ops, dropout)
    B, T = inputs.shape
    dtype = P["embed.weight"].dtype
    rope = ops.rope_tables(T, cfg.head_dim, cfg.rope_theta, dtype)
    x, emb_cache = ops.embedding_forward(inputs, P["embed.weight"])  # [B, T, d]
    block_caches = []
    for i in range(cfg.n_layers):
        masks = None if dropout is None else [dropout.mask(site, B * T, cfg.dim, dtype).reshape(B, T, cfg.dim)
                                              for site in (2 * i, 2 * i + 1)]
        x, cache = block_forward(cfg, P, f"layers.{i}.", x, rope, ops, masks)
        block_caches.append(cache)
    h, norm_cache = ops.rmsnorm_forward(x, P["norm.weight"], cfg.norm_eps)  # [B, T, d]
    logits = np.stack([h @ head_weight(P, k).T for k in range(cfg.n_mtp)])  # [K, B, T, V]
    return logits, (emb_cache, block_caches, norm_cache, h)


def backward(cfg: Config, P: dict, dlogits: np.ndarray, caches, ops=reference_ops) -> dict[str, np.ndarray]:
    """dlogits [K, B, T, V] -> gradient of every parameter."""
    if cfg.arch == "gpt2":
        return gpt2_backward(cfg, P, dlogits, caches, ops)
    emb_cache, block_caches, norm_cache, h = caches
    grads = {}
    dh = np.zeros_like(h)
    for k in range(cfg.n_mtp):
        dhk, grads[f"heads.{k}.weight"] = ops.linear_backward(dlogits[k], (h, head_weight(P, k)))
        dh += dhk
    dhead0 = grads.pop("heads.0.weight") if cfg.tie_embeddings else 0.0  # [V, d]: the tied head's share of embed's
    dx, grads["norm.weight"] = ops.rmsnorm_backward(dh, norm_cache)
    for i in reversed(range(cfg.n_layers)):
        dx = block_backward(cfg, f"layers.{i}.", dx, block_caches[i], grads, ops)
    grads["embed.weight"] = ops.embedding_backward(dx, emb_cache) + dhead0
    return {name: grads[name] for name in P}  # SPEC order


def block_forward(cfg: Config, P: dict, prefix: str, x: np.ndarray, rope, ops=reference_ops, masks=None):
    """One transformer block. x [B, T, d] -> x [B, T, d]. masks: dropout factors of the attention and
    feed-forward branches ([B, T, d] each), or None for no dropout."""
    B, T, d = x.shape
    H, Hkv, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    cos, sin = rope
    # attention sub-block
    h, c_norm1 = ops.rmsnorm_forward(x, P[prefix + "attn_norm.weight"], cfg.norm_eps)
    q, c_q = ops.linear_forward(h, P[prefix + "attn.wq.weight"])  # [B, T, H·hd]
    k, c_k = ops.linear_forward(h, P[prefix + "attn.wk.weight"])  # [B, T, Hkv·hd]
    v, c_v = ops.linear_forward(h, P[prefix + "attn.wv.weight"])
    q = q.reshape(B, T, H, hd).transpose(0, 2, 1, 3)  # [B, H, T, hd]
    k = k.reshape(B, T, Hkv, hd).transpose(0, 2, 1, 3)  # [B, Hkv, T, hd]
    v = v.reshape(B, T, Hkv, hd).transpose(0, 2, 1, 3)
    q, c_rq = ops.rope_forward(q, cos, sin)
    k, c_rk = ops.rope_forward(k, cos, sin)
    a, c_att = ops.attention_forward(q, k, v)  # [B, H, T, hd]
    a = a.transpose(0, 2, 1, 3).reshape(B, T, H * hd)
    o, c_o = ops.linear_forward(a, P[prefix + "attn.wo.weight"])  # [B, T, d]
    if masks is not None:
        o, _ = ops.dropout_forward(o, masks[0])
    x = x + o
    # feed-forward sub-block
    h2, c_norm2 = ops.rmsnorm_forward(x, P[prefix + "ffn_norm.weight"], cfg.norm_eps)
    g, c_g = ops.linear_forward(h2, P[prefix + "ffn.gate.weight"])  # [B, T, F]
    u, c_u = ops.linear_forward(h2, P[prefix + "ffn.up.weight"])
    s, c_s = ops.swiglu_forward(g, u)
    f, c_d = ops.linear_forward(s, P[prefix + "ffn.down.weight"])  # [B, T, d]
    if masks is not None:
        f, _ = ops.dropout_forward(f, masks[1])
    x = x + f
    return x, (c_norm1, c_q, c_k, c_v, c_rq, c_rk, c_att, c_o, c_norm2, c_g, c_u, c_s, c_d, masks)


def block_backward(cfg: Config, prefix: str, dx: np.ndarray, cache, grads: dict, ops=reference_ops) -> np.ndarray:
    """dx [B, T, d] (gradient of the block output) -> gradient of the block input; fills grads."""
    c_norm1, c_q, c_k, c_v, c_rq, c_rk, c_att, c_o, c_norm2, c_g, c_u, c_s, c_d, masks = cache
    B, T, d = dx.shape
    H, Hkv, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    # feed-forward sub-block (x = x + f)
    df = dx if masks is None else ops.dropout_backward(dx, masks[1])
    ds, grads[prefix + "ffn.down.weight"] = ops.linear_backward(df, c_d)
    dg, du = ops.swiglu_backward(ds, c_s)
    dh2, grads[prefix + "ffn.gate.weight"] = ops.linear_backward(dg, c_g)
    dh2u, grads[prefix + "ffn.up.weight"] = ops.linear_backward(du, c_u)
    dx_norm, grads[prefix + "ffn_norm.weight"] = ops.rmsnorm_backward(dh2 + dh2u, c_norm2)
    dx = dx + dx_norm
    # attention sub-block (x = x + o)
    do = dx if masks is None else ops.dropout_backward(dx, masks[0])
    da, grads[prefix + "attn.wo.weight"] = ops.linear_backward(do, c_o)
    da = da.reshape(B, T, H, hd).transpose(0, 2, 1, 3)  # [B, H, T, hd]
    dq, dk, dv = ops.attention_backward(da, c_att)
    dq = ops.rope_backward(dq, c_rq)
    dk = ops.rope_backward(dk, c_rk)
    dq = dq.transpose(0, 2, 1, 3).reshape(B, T, H * hd)
    dk = dk.transpose(0, 2, 1, 3).reshape(B, T, Hkv * hd)
    dv = dv.transpose(0, 2, 1, 3).reshape(B, T, Hkv * hd)
    dh, grads[prefix + "attn.wq.weight"] = ops.linear_backward(dq, c_q)
    dhk, grads[prefix + "attn.wk.weight"] = ops.linear_backward(dk, c_k)
    dhv, grads[prefix + "attn.wv.weight"] = ops.linear_backward(dv, c_v)
    dx_norm, grads[prefix + "attn_norm.weight"] = ops.rmsnorm_backward(dh + dhk + dhv, c_norm1)
    return dx + dx_norm


def fast_supports(cfg: Config) -> bool:
    """Whether the fast engine (nanoeuler/fast/) runs this architecture; otherwise the reference runs."""
    return cfg.arch in ("euler", "gpt2")


# ---- arch "gpt2" ------------------------------------------------------------------------------------
def affine_forward(x, P: dict, name: str, ops=reference_ops):
    """x [..., in] -> x @ W.T + b [..., out], with W, b = P[name.weight], P[name.bias]."""
    y, c_lin = ops.linear_forward(x, P[name + ".weight"])
    y, c_bias = ops.bias_forward(y, P[name + ".bias"])
    return y, (c_lin, c_bias)


def affine_backward(dy, cache, grads: dict, name: str, ops=reference_ops):
    """dy [..., out] -> dx [..., in]; fills grads[name.weight], grads[name.bias]."""
    c_lin, c_bias = cache
    dy, grads[name + ".bias"] = ops.bias_backward(dy, c_bias)
    dx, grads[name + ".weight"] = ops.linear_backward(dy, c_lin)
    return dx


GPT2_OPS = ("layernorm_forward", "layernorm_backward", "gelu_forward", "gelu_backward", "bias_forward",
            "bias_backward", "position_forward", "position_backward")


def gpt2_forward(cfg: Config, P: dict, inputs: np.ndarray, ops=reference_ops, dropout=None):
    """arch gpt2: inputs int [B, T] -> (logits [K, B, T, V], caches). Dropout sites as in `forward`."""
    missing = [f for f in GPT2_OPS if not hasattr(ops, f)]
    if missing:  # e.g. the GPU backend, which has no LayerNorm / GELU / bias / position kernels yet
        raise UserError(f"arch gpt2 cannot run on this backend (no {', '.join(missing)}); use --device cpu")
    B, T = inputs.shape
    dtype = P["embed.weight"].dtype
    x, emb_cache = ops.embedding_forward(inputs, P["embed.weight"])  # [B, T, d]
    x, pos_cache = ops.position_forward(x, P["pos_embed.weight"])   # + pos_embed[0:T]
    block_caches = []
    for i in range(cfg.n_layers):
        masks = None if dropout is None else [dropout.mask(site, B * T, cfg.dim, dtype).reshape(B, T, cfg.dim)
                                              for site in (2 * i, 2 * i + 1)]
        x, cache = gpt2_block_forward(cfg, P, f"layers.{i}.", x, ops, masks)
        block_caches.append(cache)
    h, norm_cache = ops.layernorm_forward(x, P["norm.weight"], P["norm.bias"], cfg.norm_eps)  # [B, T, d]
    logits = np.stack([h @ head_weight(P, k).T for k in range(cfg.n_mtp)])  # [K, B, T, V]
    return logits, (emb_cache, pos_cache, block_caches, norm_cache, h)


def gpt2_backward(cfg: Config, P: dict, dlogits: np.ndarray, caches, ops=reference_ops) -> dict[str, np.ndarray]:
    """arch gpt2: dlogits [K, B, T, V] -> gradient of every parameter (embed.weight: lookup + tied head)."""
    emb_cache, pos_cache, block_caches, norm_cache, h = caches
    grads = {}
    dh = np.zeros_like(h)
    for k in range(cfg.n_mtp):
        dhk, grads[f"heads.{k}.weight"] = ops.linear_backward(dlogits[k], (h, head_weight(P, k)))
        dh += dhk
    tied = "heads.0.weight" not in P
    dhead0 = grads.pop("heads.0.weight") if tied else 0.0  # [V, d], the tied head's share of embed's gradient
    dx, grads["norm.weight"], grads["norm.bias"] = ops.layernorm_backward(dh, norm_cache)
    for i in reversed(range(cfg.n_layers)):
        dx = gpt2_block_backward(cfg, f"layers.{i}.", dx, block_caches[i], grads, ops)
    dx, grads["pos_embed.weight"] = ops.position_backward(dx, pos_cache)
    grads["embed.weight"] = ops.embedding_backward(dx, emb_cache) + dhead0
    return {name: grads[name] for name in P}


def gpt2_block_forward(cfg: Config, P: dict, prefix: str, x: np.ndarray, ops=reference_ops, masks=None):
    """One GPT-2 block. x [B, T, d] -> x [B, T, d]."""
    B, T, d = x.shape
    H, Hkv, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    p = prefix
    # attention sub-block
    h, c_norm1 = ops.layernorm_forward(x, P[p + "attn_norm.weight"], P[p + "attn_norm.bias"], cfg.norm_eps)
    q, c_q = affine_forward(h, P, p + "attn.wq", ops)  # [B, T, H·hd]
    k, c_k = affine_forward(h, P, p + "attn.wk", ops)  # [B, T, Hkv·hd]
    v, c_v = affine_forward(h, P, p + "attn.wv", ops)
    q = q.reshape(B, T, H, hd).transpose(0, 2, 1, 3)  # [B, H, T, hd]
    k = k.reshape(B, T, Hkv, hd).transpose(0, 2, 1, 3)  # [B, Hkv, T, hd]
    v = v.reshape(B, T, Hkv, hd).transpose(0, 2, 1, 3)
    a, c_att = ops.attention_forward(q, k, v)  # [B, H, T, hd]
    a = a.transpose(0, 2, 1, 3).reshape(B, T, H * hd)
    o, c_o = affine_forward(a, P, p + "attn.wo", ops)  # [B, T, d]
    if masks is not None:
        o, _ = ops.dropout_forward(o, masks[0])
    x = x + o
    # feed-forward sub-block
    h2, c_norm2 = ops.layernorm_forward(x, P[p + "ffn_norm.weight"], P[p + "ffn_norm.bias"], cfg.norm_eps)
    f, c_fc = affine_forward(h2, P, p + "ffn.fc", ops)  # [B, T, F]
    g, c_gelu = ops.gelu_forward(f)
    y, c_proj = affine_forward(g, P, p + "ffn.proj", ops)  # [B, T, d]
    if masks is not None:
        y, _ = ops.dropout_forward(y, masks[1])
    return x + y, (c_norm1, c_q, c_k, c_v, c_att, c_o, c_norm2, c_fc, c_gelu, c_proj, masks, (B, T))


def gpt2_block_backward(cfg: Config, prefix: str, dx: np.ndarray, cache, grads: dict, ops=reference_ops):
    """dx [B, T, d] (gradient w.r.t. the block output) -> gradient w.r.t. the block input; fills grads."""
    c_norm1, c_q, c_k, c_v, c_att, c_o, c_norm2, c_fc, c_gelu, c_proj, masks, (B, T) = cache
    H, Hkv, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    p = prefix
    # feed-forward sub-block (out = mid + y)
    dy = dx if masks is None else ops.dropout_backward(dx, masks[1])
    dg = affine_backward(dy, c_proj, grads, p + "ffn.proj", ops)
    df = ops.gelu_backward(dg, c_gelu)
    dh2 = affine_backward(df, c_fc, grads, p + "ffn.fc", ops)
    dmid, grads[p + "ffn_norm.weight"], grads[p + "ffn_norm.bias"] = ops.layernorm_backward(dh2, c_norm2)
    dx = dx + dmid
    # attention sub-block (mid = x + o)
    do = dx if masks is None else ops.dropout_backward(dx, masks[0])
    da = affine_backward(do, c_o, grads, p + "attn.wo", ops)
    da = da.reshape(B, T, H, hd).transpose(0, 2, 1, 3)  # [B, H, T, hd]
    dq, dk, dv = ops.attention_backward(da, c_att)
    dq = dq.transpose(0, 2, 1, 3).reshape(B, T, H * hd)
    dk = dk.transpose(0, 2, 1, 3).reshape(B, T, Hkv * hd)
    dv = dv.transpose(0, 2, 1, 3).reshape(B, T, Hkv * hd)
    dh = affine_backward(dq, c_q, grads, p + "attn.wq", ops)
    dh = dh + affine_backward(dk, c_k, grads, p + "attn.wk", ops)
    dh = dh + affine_backward(dv, c_v, grads, p + "attn.wv", ops)
    dx_norm, grads[p + "attn_norm.weight"], grads[p + "attn_norm.bias"] = ops.layernorm_backward(dh, c_norm1)
    return dx + dx_norm


def check_tokens(config: Config, tokens: np.ndarray, extra: int) -> None:
    """tokens int [B, T + extra] with 1 <= T <= ctx_len and every id in [0, vocab_size)."""
    tokens = np.asarray(tokens)
    if tokens.ndim != 2 or not np.issubdtype(tokens.dtype, np.integer):
        raise UserError(f"tokens must be a 2-D integer array [B, T{'+K' if extra else ''}], got {tokens.dtype} {list(tokens.shape)}")
    T = tokens.shape[1] - extra
    if T < 1:
        raise UserError(f"sequence of {tokens.shape[1]} tokens is too short: need at least {extra + 1}")
    if T > config.ctx_len:
        raise UserError(f"sequence of {T} tokens is longer than the context ({config.ctx_len})")
    if tokens.size and (tokens.min() < 0 or tokens.max() >= config.vocab_size):
        raise UserError(f"token id out of range: ids must lie in [0, {config.vocab_size}), got "
                        f"[{tokens.min()}, {tokens.max()}]")
