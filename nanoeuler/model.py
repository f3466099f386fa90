"""The transformer of the SPEC and of every architecture in arch.py, composed from the pairs in `ops/`.

Each of n_layers blocks: x = x + attn(norm(x)), then x = x + mlp(norm(x)); a final norm, then K output heads
(multi-token prediction). What each piece is — RMSNorm or LayerNorm, SwiGLU, GeGLU or GELU, RoPE or learned
positions, biases, q/k norms, post norms, a scaled embedding, sliding windows — the architecture's record
says (`cfg.spec`, arch.py); this file is the one readable forward and backward of all of them. The backward
pass is the forward read backwards: every `*_forward` call leaves a cache, and `backward` walks those caches
in reverse.

    model = Model.from_preset("small", seed=0)
    head0_loss, objective, grads = model.loss_and_grads(tokens)   # tokens int [B, T+K]

A tied head 0 is the token embedding itself (no `heads.0.weight`): embed.weight's gradient is the sum of
its two uses (the lookup and the head).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from . import ops as reference_ops
from .config import PRESETS, Config, check_params, head_weight  # noqa: F401  (check_params: re-exported)
from .errors import UserError


class Model:
    """Parameters (SPEC names -> arrays) plus the config; forward, backward, save and load.
    precision: of the fast engine's matrix products, "f32" or "bf16" (`set_precision`; fast/bf16.py).
    What the training loop uses of it is `trainable.Trainable`."""

    precision = "f32"
    device = "cpu"
    adapter_dropout = 0.0
    _fast_ws = None     # the fast engine's buffers of the last batch shape (_workspace)

    def __init__(self, config: Config, params: dict[str, np.ndarray]):
        check_params(config, params)
        self.config = config
        self.params = params

    def set_precision(self, precision: str) -> "Model":
        """The precision of the fast engine's matrix products from now on (UserError where it cannot run)."""
        from .fast.engine import check_precision
        self.precision = check_precision(precision, self.dtype)
        return self

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def init(cls, config: Config, seed: int = 0, dtype=np.float32) -> "Model":
        """SPEC initialisation: N(0, 0.02); wo and down scaled by 1/sqrt(2·n_layers); norm weights 1.
        Every architecture alike: every norm weight 1 (its effective scale), every bias 0, ffn.proj (GPT-2's
        down) scaled like down."""
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

    def checkpoint_writers(self, tokenizer=None) -> dict:
        from .checkpoint import model_writers
        return model_writers(self.config, self.params, tokenizer)

    def optimizer(self, params: dict, **settings):
        from .optim import AdamW
        return AdamW(params, **settings)

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
        if not reference:
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
        if not reference:
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
        ws = self._fast_ws
        if ws is None or ws.key != (self.config, B, T, np.dtype(self.dtype), self.precision, False):
            self._fast_ws = None  # free the old buffers before allocating new ones
            ws = self._fast_ws = fast.Workspace(self.config, B, T, self.dtype, self.precision)
        return ws


def forward(cfg: Config, P: dict, inputs: np.ndarray, ops=reference_ops, dropout=None):
    """inputs int [B, T] -> (logits [K, B, T, V], caches for backward), for every architecture (arch.py).
    dropout (ops.Dropout, optional): layer i drops on its attention branch with the masks of site 2i and
    on its feed-forward branch with those of site 2i + 1.

    `ops` is the namespace of forward/backward pairs: the NumPy reference, or another backend's kernels
    with the same signatures (the GPU one) — the array-module switch, not a second model.
    """
    a = cfg.spec
    require_ops(cfg, ops)
    B, T = inputs.shape
    dtype = P["embed.weight"].dtype
    x, emb_cache = ops.embedding_forward(inputs, P["embed.weight"])  # [B, T, d]
    if embed_scale(cfg, dtype) != 1:
        x = x * embed_scale(cfg, dtype)
    pos_cache = None
    if a.positions == "learned":
        x, pos_cache = ops.position_forward(x, P["pos_embed.weight"])  # + pos_embed[0:T]
    ropes, kinds = rope_tables(cfg, T, dtype, ops), cfg.rope_kinds()[1]
    block_caches = []
    for i in range(cfg.n_layers):
        masks = None if dropout is None else [dropout.mask(site, B * T, cfg.dim, dtype).reshape(B, T, cfg.dim)
                                              for site in (2 * i, 2 * i + 1)]
        x, cache = block_forward(cfg, P, i, x, ropes[kinds[i]] if kinds[i] >= 0 else None, ops, masks)
        block_caches.append(cache)
    h, norm_cache = norm_forward(cfg, P, "norm", x, ops)  # [B, T, d]
    h = scaled(h, 1.0 / cfg.logits_scaling, ops)  # logits / logits_scaling, as (h / logits_scaling)·headᵀ
    logits = np.stack([h @ head_weight(P, k).T for k in range(cfg.n_mtp)])  # [K, B, T, V]
    cap_cache = None
    if cfg.logit_softcap:
        logits, cap_cache = ops.softcap_forward(logits, cfg.logit_softcap)
    return logits, (emb_cache, pos_cache, block_caches, norm_cache, cap_cache, h)


def backward(cfg: Config, P: dict, dlogits: np.ndarray, caches, ops=reference_ops) -> dict[str, np.ndarray]:
    """dlogits [K, B, T, V] -> gradient of every parameter (a tied embedding's: the lookup's + the head's)."""
    emb_cache, pos_cache, block_caches, norm_cache, cap_cache, h = caches
    if cap_cache is not None:
        dlogits = ops.softcap_backward(dlogits, cap_cache)
    grads = {}
    dh = np.zeros_like(h)
    for k in range(cfg.n_mtp):
        dhk, grads[f"heads.{k}.weight"] = ops.linear_backward(dlogits[k], (h, head_weight(P, k)))
        dh += dhk
    dhead0 = grads.pop("heads.0.weight") if "heads.0.weight" not in P else 0.0  # [V, d]: the tied head's share
    dx = norm_backward(cfg, scaled(dh, 1.0 / cfg.logits_scaling, ops, backward=True), norm_cache, grads, "norm", ops)
    for i in reversed(range(cfg.n_layers)):
        dx = block_backward(cfg, i, dx, block_caches[i], grads, ops)
    if pos_cache is not None:
        dx, grads["pos_embed.weight"] = ops.position_backward(dx, pos_cache)
    if embed_scale(cfg, dx.dtype) != 1:
        dx = dx * embed_scale(cfg, dx.dtype)
    grads["embed.weight"] = ops.embedding_backward(dx, emb_cache) + dhead0
    return {name: grads[name] for name in P}  # SPEC order


def block_forward(cfg: Config, P: dict, i: int, x: np.ndarray, rope, ops=reference_ops, masks=None):
    """Layer i. x [B, T, d] -> x [B, T, d]; rope: its (cos, sin) tables [T, hd/2] (None: no RoPE);
    masks: dropout factors of the attention and feed-forward branches ([B, T, d] each), or None."""
    a, p = cfg.spec, f"layers.{i}."
    B, T, d = x.shape
    H, Hkv, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    c = {}
    # attention sub-block: x = x + post(wo · attention(q, k, v)) with q|k|v = w · norm(x) (+ b)
    h, c["norm1"] = pre_norm_forward(cfg, P, p + "attn_norm", x, ops)
    q, c["q"] = affine_forward(h, P, p + "attn.wq", ops)  # [B, T, H·hd]
    k, c["k"] = affine_forward(h, P, p + "attn.wk", ops)  # [B, T, Hkv·hd]
    v, c["v"] = affine_forward(h, P, p + "attn.wv", ops)
    if a.qk_norm and a.qk_norm_whole:  # each row of q (and of k) normed over all its H·hd entries
        q, c["q_norm"] = norm_forward(cfg, P, p + "attn.q_norm", q, ops)
        k, c["k_norm"] = norm_forward(cfg, P, p + "attn.k_norm", k, ops)
    q = q.reshape(B, T, H, hd).transpose(0, 2, 1, 3)  # [B, H, T, hd]
    k = k.reshape(B, T, Hkv, hd).transpose(0, 2, 1, 3)  # [B, Hkv, T, hd]
    v = v.reshape(B, T, Hkv, hd).transpose(0, 2, 1, 3)
    if a.qk_norm and not a.qk_norm_whole:  # each head's vector normed over its hd entries
        q, c["q_norm"] = norm_forward(cfg, P, p + "attn.q_norm", q, ops)
        k, c["k_norm"] = norm_forward(cfg, P, p + "attn.k_norm", k, ops)
    if rope is not None:
        q, c["rope_q"] = ops.rope_forward(q, *rope)
        k, c["rope_k"] = ops.rope_forward(k, *rope)
    q = scaled(q, cfg.query_factor(), ops)  # the attention's q·kᵀ/√hd is then q·kᵀ·score_scale
    att, c["att"] = ops.attention_forward(q, k, v, cfg.window(i), cfg.attn_softcap)  # [B, H, T, hd]
    att = att.transpose(0, 2, 1, 3).reshape(B, T, H * hd)
    o, c["o"] = affine_forward(att, P, p + "attn.wo", ops)  # [B, T, d]
    if a.post_norms:
        o, c["post1"] = norm_forward(cfg, P, p + "attn_post_norm", o, ops)
    o = scaled(o, cfg.residual_multiplier, ops)
    if masks is not None:
        o, _ = ops.dropout_forward(o, masks[0])
    x, layer_input = x + o, x
    mlp_input = layer_input if cfg.parallel_residual else x   # parallel residual: both read the layer's input
    # feed-forward sub-block: x = x + post(mlp(norm(x))) (parallel: mlp(norm(the layer's input)))
    h2, c["norm2"] = pre_norm_forward(cfg, P, p + "ffn_norm", mlp_input, ops)
    f, c["mlp"] = mlp_forward(cfg, P, p, h2, ops)  # [B, T, d]
    if a.post_norms:
        f, c["post2"] = norm_forward(cfg, P, p + "ffn_post_norm", f, ops)
    f = scaled(f, cfg.residual_multiplier, ops)
    if masks is not None:
        f, _ = ops.dropout_forward(f, masks[1])
    c["masks"] = masks
    return x + f, c


def block_backward(cfg: Config, i: int, dx: np.ndarray, c: dict, grads: dict, ops=reference_ops) -> np.ndarray:
    """dx [B, T, d] (gradient of layer i's output) -> gradient of its input; fills grads. block_forward read
    backwards."""
    a, p, masks = cfg.spec, f"layers.{i}.", c["masks"]
    B, T, d = dx.shape
    H, Hkv, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    # feed-forward sub-block
    df = scaled(dx if masks is None else ops.dropout_backward(dx, masks[1]), cfg.residual_multiplier, ops,
                backward=True)
    if a.post_norms:
        df = norm_backward(cfg, df, c["post2"], grads, p + "ffn_post_norm", ops)
    dh2 = mlp_backward(cfg, p, df, c["mlp"], grads, ops)
    dmlp_input = pre_norm_backward(cfg, dh2, c["norm2"], grads, p + "ffn_norm", ops)
    if not cfg.parallel_residual:   # the MLP read x + attn: its input's gradient reaches the attention too
        dx, dmlp_input = dx + dmlp_input, 0.0
    # attention sub-block
    do = scaled(dx if masks is None else ops.dropout_backward(dx, masks[0]), cfg.residual_multiplier, ops,
                backward=True)
    if a.post_norms:
        do = norm_backward(cfg, do, c["post1"], grads, p + "attn_post_norm", ops)
    datt = affine_backward(do, c["o"], grads, p + "attn.wo", ops)
    datt = datt.reshape(B, T, H, hd).transpose(0, 2, 1, 3)  # [B, H, T, hd]
    dq, dk, dv = ops.attention_backward(datt, c["att"])
    dq = scaled(dq, cfg.query_factor(), ops, backward=True)
    if "rope_q" in c:
        dq = ops.rope_backward(dq, c["rope_q"])
        dk = ops.rope_backward(dk, c["rope_k"])
    if a.qk_norm and not a.qk_norm_whole:
        dq = norm_backward(cfg, dq, c["q_norm"], grads, p + "attn.q_norm", ops)
        dk = norm_backward(cfg, dk, c["k_norm"], grads, p + "attn.k_norm", ops)
    dq = dq.transpose(0, 2, 1, 3).reshape(B, T, H * hd)
    dk = dk.transpose(0, 2, 1, 3).reshape(B, T, Hkv * hd)
    if a.qk_norm and a.qk_norm_whole:
        dq = norm_backward(cfg, dq, c["q_norm"], grads, p + "attn.q_norm", ops)
        dk = norm_backward(cfg, dk, c["k_norm"], grads, p + "attn.k_norm", ops)
    dv = dv.transpose(0, 2, 1, 3).reshape(B, T, Hkv * hd)
    dh = affine_backward(dq, c["q"], grads, p + "attn.wq", ops)
    dh = dh + affine_backward(dk, c["k"], grads, p + "attn.wk", ops)
    dh = dh + affine_backward(dv, c["v"], grads, p + "attn.wv", ops)
    return dx + pre_norm_backward(cfg, dh, c["norm1"], grads, p + "attn_norm", ops) + dmlp_input


def mlp_forward(cfg: Config, P: dict, p: str, h: np.ndarray, ops=reference_ops):
    """The MLP of the layer under prefix p: h [..., d] -> [..., d]. Gated (swiglu, geglu):
    down(act(gate·h)·(up·h)); gelu: proj(gelu(fc·h + b)) + b (the exact GELU where the record says gelu_erf)."""
    a = cfg.spec
    if a.gated:
        g, c_g = affine_forward(h, P, p + "ffn.gate", ops)  # [..., F]
        u, c_u = affine_forward(h, P, p + "ffn.up", ops)
        s, c_s = (ops.swiglu_forward if a.mlp == "swiglu" else ops.geglu_forward)(g, u)
        y, c_d = affine_forward(s, P, p + "ffn.down", ops)
        return y, (c_g, c_u, c_s, c_d)
    f, c_fc = affine_forward(h, P, p + "ffn.fc", ops)  # [..., F]
    g, c_gelu = (ops.gelu_erf_forward if a.gelu_erf else ops.gelu_forward)(f)
    y, c_proj = affine_forward(g, P, p + "ffn.proj", ops)
    return y, (c_fc, c_gelu, c_proj)


def mlp_backward(cfg: Config, p: str, dy: np.ndarray, cache, grads: dict, ops=reference_ops) -> np.ndarray:
    """dy [..., d] -> dh [..., d] (gradient of the MLP's input); fills grads."""
    a = cfg.spec
    if a.gated:
        c_g, c_u, c_s, c_d = cache
        ds = affine_backward(dy, c_d, grads, p + "ffn.down", ops)
        dg, du = (ops.swiglu_backward if a.mlp == "swiglu" else ops.geglu_backward)(ds, c_s)
        return affine_backward(dg, c_g, grads, p + "ffn.gate", ops) + affine_backward(du, c_u, grads, p + "ffn.up", ops)
    c_fc, c_gelu, c_proj = cache
    dg = affine_backward(dy, c_proj, grads, p + "ffn.proj", ops)
    gelu_backward = ops.gelu_erf_backward if a.gelu_erf else ops.gelu_backward
    return affine_backward(gelu_backward(dg, c_gelu), c_fc, grads, p + "ffn.fc", ops)


def norm_forward(cfg: Config, P: dict, name: str, x, ops=reference_ops):
    """The architecture's norm with the weights under `name`: x [..., n] -> y [..., n] (RMSNorm, or LayerNorm
    with its bias)."""
    if cfg.spec.norm == "rms":
        return ops.rmsnorm_forward(x, P[name + ".weight"], cfg.norm_eps)
    return ops.layernorm_forward(x, P[name + ".weight"], P[name + ".bias"], cfg.norm_eps)


def norm_backward(cfg: Config, dy, cache, grads: dict, name: str, ops=reference_ops):
    """dy [..., n] -> dx [..., n]; fills grads[name.weight] (and .bias)."""
    if cfg.spec.norm == "rms":
        dx, grads[name + ".weight"] = ops.rmsnorm_backward(dy, cache)
    else:
        dx, grads[name + ".weight"], grads[name + ".bias"] = ops.layernorm_backward(dy, cache)
    return dx


def pre_norm_forward(cfg: Config, P: dict, name: str, x, ops=reference_ops):
    """A sub-block's input norm `name` (norm_forward), or x itself where the architecture has none (OLMo 2)."""
    return norm_forward(cfg, P, name, x, ops) if cfg.spec.pre_norms else (x, None)


def pre_norm_backward(cfg: Config, dy, cache, grads: dict, name: str, ops=reference_ops):
    """The backward of pre_norm_forward: dy [..., n] -> dx [..., n] (dy itself without the norm)."""
    return norm_backward(cfg, dy, cache, grads, name, ops) if cfg.spec.pre_norms else dy


def affine_forward(x, P: dict, name: str, ops=reference_ops):
    """x [..., in] -> x @ W.T (+ b) [..., out], with W = P[name.weight] and b = P[name.bias] where it exists."""
    y, c_lin = ops.linear_forward(x, P[name + ".weight"])
    c_bias = None
    if name + ".bias" in P:
        y, c_bias = ops.bias_forward(y, P[name + ".bias"])
    return y, (c_lin, c_bias)


def affine_backward(dy, cache, grads: dict, name: str, ops=reference_ops):
    """dy [..., out] -> dx [..., in]; fills grads[name.weight] (and grads[name.bias])."""
    c_lin, c_bias = cache
    if c_bias is not None:
        dy, grads[name + ".bias"] = ops.bias_backward(dy, c_bias)
    dx, grads[name + ".weight"] = ops.linear_backward(dy, c_lin)
    return dx


def embed_scale(cfg: Config, dtype) -> np.floating:
    """The factor of the looked-up embeddings: √dim where arch.embed_scale (rounded to the dtype as Gemma does),
    times embedding_multiplier (Granite's)."""
    root = np.dtype(dtype).type(np.sqrt(cfg.dim)) if cfg.spec.embed_scale else 1.0
    return np.dtype(dtype).type(root * cfg.embedding_multiplier)


def scaled(x, factor: float, ops=reference_ops, backward: bool = False):
    """x · factor by the ops' scale pair (a multiplier, Config.MULTIPLIERS: its forward, or with backward its
    backward, the same product); x itself when the factor is 1, so a backend without the pair runs the others."""
    if factor == 1:
        return x
    return ops.scale_backward(x, factor) if backward else ops.scale_forward(x, factor)[0]


def rope_tables(cfg: Config, T: int, dtype, ops=reference_ops) -> list:
    """The (cos, sin) tables [T, hd/2] of each of cfg's RoPE kinds (Config.rope_kinds; [] without RoPE)."""
    return [ops.rope_tables(T, f, dtype) for f in cfg.rope_kinds()[0]]


def required_ops(cfg: Config) -> list[str]:
    """The forward/backward pairs cfg's architecture needs of an ops namespace (beyond linear, attention...)."""
    a = cfg.spec
    need = ["rmsnorm" if a.norm == "rms" else "layernorm", "gelu_erf" if a.gelu_erf else a.mlp]
    need += ["rope"] if a.positions == "rope" else ["position"]
    if a.qkv_bias or a.out_bias:
        need.append("bias")
    if a.multipliers:
        need.append("scale")
    if cfg.attn_softcap or cfg.logit_softcap:
        need.append("softcap")
    return [f"{n}_{way}" for n in need for way in ("forward", "backward")]


def require_ops(cfg: Config, ops) -> None:
    """UserError when the ops namespace (a backend) lacks a pair cfg's architecture needs."""
    missing = [f for f in required_ops(cfg) if not hasattr(ops, f)]
    if missing:  # e.g. the GPU backend, which has no LayerNorm / GELU / bias / position kernels yet
        raise UserError(f"arch {cfg.arch} cannot run on this backend (no {', '.join(missing)}); use --device cpu")


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
