"""LoRA fine-tuning: a frozen base `Model` plus low-rank adapters (adapters.py), trained by the one loop.

`LoraModel` looks to `train.run_training` like a model whose `params` are the adapters only, so AdamW
keeps moments for the adapters alone and data-parallel ranks reduce only their gradients.

Two ways to a step, the same mathematics (tests/test_lora.py compares them):
- reference (`reference=True`, and whenever the adapters use dropout): `model.forward`/`model.backward`
  run with an ops namespace whose linear pair is `ops.lora_forward`/`ops.lora_backward` for an adapted
  weight (the weight arrives wrapped as `Adapted`), so every adapter gets its own dA, dB;
- fast: the fast engine runs on the merged weights W' = W + s·B·A (the adapted map without dropout is
  exactly x·W'ᵀ, and dx = dy·W'), and at every linear hands dy and x to `LoraGrads.weight_grad`, which
  forms dA and dB and never the [out, in] gradient of a frozen weight.
DPO (whose engine call has no such hook) differentiates the merged weights and projects:
      dB = s·G·Aᵀ     dA = s·Bᵀ·G      (G = dL/dW', `adapter_grads`)

    model = LoraModel.new("runs/small", LoraConfig(rank=8, alpha=16, targets=("q", "v")))
    head0, objective, grads = model.loss_and_grads(tokens, mask)   # grads: "layers.0.attn.wq.lora_A", ...
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from . import adapters as ad
from . import ops
from .errors import UserError
from .model import Model, backward, check_tokens, forward


@dataclass
class Adapted:
    """A frozen weight [out, in] with its adapter (A [r, in], B [out, r] rows, scale) and dropout site."""
    weight: np.ndarray
    A: np.ndarray
    B: np.ndarray
    scale: float
    drop: ops.Dropout | None
    site: int

    def mask(self, x):
        if self.drop is None:
            return None
        rows, width = x.size // x.shape[-1], x.shape[-1]
        return self.drop.mask(self.site, rows, width, x.dtype).reshape(x.shape)


def _linear_forward(x, W):
    if not isinstance(W, Adapted):
        return ops.linear_forward(x, W)
    y, cache = ops.lora_forward(x, W.weight, W.A, W.B, W.scale, W.mask(x))
    return y, (W, cache)


def _linear_backward(dy, cache):
    """-> (dx, dW) for a plain weight, (dx, (dA, dB)) for an adapted one."""
    if not isinstance(cache[0], Adapted):
        return ops.linear_backward(dy, cache)
    dx, dA, dB = ops.lora_backward(dy, cache[1])
    return dx, (dA, dB)


LORA_OPS = SimpleNamespace(**({n: getattr(ops, n) for n in ops.__all__}
                              | {"linear_forward": _linear_forward, "linear_backward": _linear_backward}))


class LoraModel:
    """A frozen base model and its adapters; `params` are the adapters (what the optimizer trains)."""

    def __init__(self, base: Model, lcfg: ad.LoraConfig, adapters: dict[str, np.ndarray], base_ref: dict):
        self.base, self.lcfg, self.params, self.base_ref = base, lcfg.check(base.config), adapters, base_ref
        ad.check_adapters(base.config, self.lcfg, adapters, "adapters")
        self.modules = ad.modules(base.config, lcfg)
        self._merged = None

    @classmethod
    def new(cls, base_dir, lcfg: ad.LoraConfig, seed: int = 0) -> "LoraModel":
        """Fresh adapters (B = 0: the base's function) on the checkpoint in base_dir."""
        if ad.is_adapter_run(base_dir):
            raise UserError(f"{base_dir} is an adapter run; merge it first (nanoeuler lora merge) to use it as a base")
        base = Model.load(base_dir, read_only=True)
        ref = {"path": str(Path(base_dir).resolve()), "sha256": ad.base_fingerprint(base_dir)}
        lcfg = lcfg.check(base.config)
        return cls(base, lcfg, ad.init_adapters(base.config, lcfg, seed, base.dtype), ref)

    @classmethod
    def load(cls, run_dir) -> "LoraModel":
        """The adapter run in run_dir on its base (refused if the base changed)."""
        lcfg, ref, adapters = ad.read_adapter_run(run_dir)
        cfg, params = ad.load_base(run_dir, ref)
        return cls(Model(cfg, params), lcfg, adapters, ref)

    precision = "f32"   # adapters train with float32 products (bf16 with --lora is refused: set_precision)

    def set_precision(self, precision: str) -> "LoraModel":
        """Only f32: the fast engine's bf16 packs would hold the base, not the merged weights a step uses."""
        if precision != "f32":
            raise UserError(f"--precision {precision} is not available with --lora (adapters train in f32)")
        return self

    @property
    def config(self):
        return self.base.config

    @property
    def dtype(self):
        return self.base.dtype

    def n_params(self) -> int:
        """The parameters a step computes with (the base's): what MFU counts."""
        return self.base.n_params()

    def n_trainable(self) -> int:
        return sum(a.size for a in self.params.values())

    def checkpoint_writers(self, tokenizer=None) -> dict:
        return ad.adapter_writers(self.lcfg, self.base_ref, self.params, tokenizer)

    def merged_params(self) -> dict[str, np.ndarray]:
        """The base's params with W + s·B·A for every adapted weight (the rest shared, not copied), in the
        weights' dtype, into buffers kept from step to step (`ad.merge_params` rounds once, from float64:
        for merging a run for good)."""
        if self._merged is None:
            self._merged = dict(self.base.params)
            for bases, _ in self.modules.values():
                for name in bases:
                    self._merged[name] = np.empty_like(self.base.params[name])
        s = self.dtype.type(self.lcfg.scale)
        for module, (bases, _) in self.modules.items():
            A, sB = self.params[module + ".lora_A"], s * self.params[module + ".lora_B"]  # s·B: [out, r], small
            for name, rows in zip(bases, ad.row_slices(self.config, bases)):
                out = self._merged[name]
                np.matmul(sB[rows], A, out=out)                             # [out, in]
                out += self.base.params[name]
        return self._merged

    def merged(self) -> Model:
        """A plain model of the base with the adapters merged (its own arrays, rounded once from float64)."""
        return Model(self.config, ad.merge_params(self.config, self.base.params, self.lcfg, self.params))

    def adapter_grads(self, G: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Gradients w.r.t. the merged weights -> the adapters': dB = s·G·Aᵀ, dA = s·Bᵀ·G (G of a stacked
        module: its weights' gradients stacked by rows)."""
        grads = {}
        for module, (bases, _) in self.modules.items():
            A, B = self.params[module + ".lora_A"], self.params[module + ".lora_B"]
            s = A.dtype.type(self.lcfg.scale)
            Gm = np.concatenate([G[b] for b in bases]) if len(bases) > 1 else G[bases[0]]  # [Σ out, in]
            grads[module + ".lora_A"] = s * (B.T @ Gm)                                     # [r, in]
            grads[module + ".lora_B"] = s * (Gm @ A.T)                                     # [Σ out, r]
        return grads

    # ---- forward / backward -------------------------------------------------------------------------
    def loss_and_grads(self, tokens, loss_mask=None, *, reference: bool = False, out=None, dropout=None,
                       counts=None, adapter_dropout: ops.Dropout | None = None):
        """As Model.loss_and_grads, with grads keyed like `params` (the adapters). dropout: on the residual
        branches; adapter_dropout: on the adapters' inputs (runs the reference path, which applies it op by op).
        counts: a data-parallel rank's target counts (see fast.heads); the reference path divides by its own."""
        cfg = self.config
        check_tokens(cfg, tokens, extra=cfg.n_mtp)
        adrop = adapter_dropout
        if reference or adrop is not None:
            head0, objective, grads = self._reference_step(tokens, loss_mask, dropout, adrop, counts)
        else:
            head0, objective, grads = self._fast_step(tokens, loss_mask, dropout, counts)
        if out is not None:
            for name, g in grads.items():
                out[name][...] = g
            grads = out
        return head0, objective, grads

    def loss(self, tokens, loss_mask=None, *, reference: bool = False, dropout=None):
        """Forward only (no adapter dropout: evaluation): (head-0 loss, objective)."""
        if reference:
            return Model(self.config, self.merged_params()).loss(tokens, loss_mask, reference=True, dropout=dropout)
        from . import fast
        check_tokens(self.config, tokens, extra=self.config.n_mtp)
        ws = self._workspace(tokens.shape[0], tokens.shape[1] - self.config.n_mtp)
        return fast.loss(self.config, self.merged_params(), tokens, loss_mask, ws, dropout)

    def reference_objective(self, tokens, loss_mask=None, dropout=None, adapter_dropout=None):
        """The reference forward with adapters applied op by op: (head losses, objective, caches)."""
        cfg, s = self.config, self.lcfg.scale
        T = tokens.shape[1] - cfg.n_mtp
        P = dict(self.base.params)
        for j, (module, (bases, _)) in enumerate(self.modules.items()):
            A, B = self.params[module + ".lora_A"], self.params[module + ".lora_B"]
            for name, rows in zip(bases, ad.row_slices(cfg, bases)):
                P[name] = Adapted(P[name], A, B[rows], s, adapter_dropout, ad.DROPOUT_SITE0 + j)
        logits, caches = forward(cfg, P, tokens[:, :T], ops=LORA_OPS, dropout=dropout)
        targets = ops.mtp_targets(tokens, T, cfg.n_mtp, loss_mask)           # [K, B, T]
        objective, head_losses, loss_cache = ops.mtp_loss_forward(logits, targets)
        return head_losses, objective, (P, caches, loss_cache)

    def _reference_step(self, tokens, loss_mask, dropout, adrop, counts=None):
        head_losses, objective, (P, caches, loss_cache) = self.reference_objective(tokens, loss_mask, dropout, adrop)
        dlogits = ops.mtp_loss_backward(1.0, loss_cache)                    # [K, B, T, V]
        if counts is not None:   # a rank's share: head k's mean over this rank's n_k targets -> its sum / counts[k]
            cfg = self.config
            targets = ops.mtp_targets(tokens, tokens.shape[1] - cfg.n_mtp, cfg.n_mtp, loss_mask)
            share = [np.count_nonzero(targets[k] >= 0) / c if c else 0.0 for k, c in enumerate(counts)]
            head_losses = [h * f for h, f in zip(head_losses, share)]
            objective = sum(head_losses) / cfg.n_mtp
            dlogits *= np.asarray(share, dlogits.dtype)[:, None, None, None]
        g = backward(self.config, P, dlogits, caches, ops=LORA_OPS)
        grads = {}
        for module, (bases, _) in self.modules.items():
            grads[module + ".lora_A"] = sum(g[b][0] for b in bases)
            grads[module + ".lora_B"] = np.concatenate([g[b][1] for b in bases])
        return head_losses[0], objective, grads

    def _fast_step(self, tokens, loss_mask, dropout, counts):
        from . import fast
        from .fast import engine
        ws = self._workspace(tokens.shape[0], tokens.shape[1] - self.config.n_mtp)
        for g in ws.lora:
            g.reset()
        with engine.grad_hook(None):   # what the engine announces are base gradients, not what ranks reduce
            head0, objective, _ = fast.loss_and_grads(self.config, self.merged_params(), tokens, loss_mask, ws,
                                                      ws.lora[0], dropout, counts)
        grads = {n: a.copy() for n, a in ws.lora[0].out.items()}
        for g in ws.lora[1:]:           # the parts' shares, in part order (deterministic)
            for n, a in g.out.items():
                grads[n] += a
        return head0, objective, grads

    def _workspace(self, B: int, T: int):
        """The fast engine's buffers for this batch shape, each part's gradients a LoraGrads (kept)."""
        from . import fast
        ws = getattr(self, "_ws", None)
        if ws is None or ws.key != (self.config, B, T, np.dtype(self.dtype)):
            self._ws = None
            ws = fast.Workspace(self.config, B, T, self.dtype)
            ws.lora = [LoraGrads(self.config, self.lcfg, self.params) for _ in ws.parts]
            for w, g in zip(ws.parts[1:], ws.lora[1:]):
                w.grads = g             # the full gradient set the engine gave the part is dropped
            self._ws = ws
        return ws


class LoraGrads(dict):
    """What the fast engine writes a LoRA step's gradients into: the small ones it writes itself (norms,
    biases, the embeddings' lookup share: kept, unused) as a dict, and for every linear, through
    `engine.weight_grad`, the adapters' dA, dB from that linear's dy [n, out] and x [n, in] (into `out`):

        u = x·Aᵀ [n, r]     dB = s·dyᵀ·u [out, r]     dA = s·(dy·B)ᵀ·x [r, in]     ~2·n·r·(in + out) flops

    in place of dW = dyᵀ·x (n·in·out flops); a frozen weight's gradient is not computed at all."""

    def __init__(self, cfg, lcfg: ad.LoraConfig, adapters: dict[str, np.ndarray]):
        self.shapes = cfg.param_shapes()
        dtype = next(iter(adapters.values())).dtype
        super().__init__({n: np.zeros(s, dtype) for n, s in self.shapes.items()
                          if len(s) == 1 or n in ("embed.weight", "pos_embed.weight")})
        self.adapters, self.scale = adapters, lcfg.scale
        self.out = {n: np.zeros_like(a) for n, a in adapters.items()}
        self.where = {name: (module, rows) for module, (bases, _) in ad.modules(cfg, lcfg).items()
                      for name, rows in zip(bases, ad.row_slices(cfg, bases))}

    def reset(self) -> None:
        for a in self.out.values():
            a[...] = 0

    def weight_grad(self, names, dy, x) -> None:
        s = dy.dtype.type(self.scale)
        for module, cols, rows in self._runs(names):
            A, B = self.adapters[module + ".lora_A"], self.adapters[module + ".lora_B"]
            dym = dy[:, cols]                                               # [n, out] of the module's rows
            self.out[module + ".lora_B"][rows] += s * (dym.T @ (x @ A.T))   # [out, r]
            self.out[module + ".lora_A"] += s * ((dym @ B[rows]).T @ x)     # [r, in]

    def _runs(self, names):
        """The adapted stretches of dy's columns: [(module, dy columns, rows of its B)], neighbours of one
        module joined (GPT-2's q|k|v: one product for c_attn, not three).

            euler [wq, wk, wv] (modules q, k, v) -> 3 runs;  gpt2 [wq, wk, wv] (c_attn) -> 1 run"""
        runs, col = [], 0
        for name in names:
            n_out = self.shapes[name][0]
            c0, col = col, col + n_out
            if name not in self.where:
                if name in self:    # gpt2's tied head: its share of embed.weight's gradient (unused)
                    self[name][...] = 0
                continue
            module, rows = self.where[name]
            if runs and runs[-1][0] == module and runs[-1][1].stop == c0 and runs[-1][2].stop == rows.start:
                runs[-1] = (module, slice(runs[-1][1].start, col), slice(runs[-1][2].start, rows.stop))
            else:
                runs.append((module, slice(c0, col), rows))
        return runs
