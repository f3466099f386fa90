"""LoRA fine-tuning: a frozen base `Model` plus low-rank adapters (../adapters.py), trained by the one loop.

`LoraModel` looks to `train.run_training` like a model whose `params` are the adapters only, so AdamW
keeps moments for the adapters alone and data-parallel ranks reduce only their gradients.

Two ways to a step, the same mathematics (tests/test_lora.py compares them):
- reference (`reference=True`): `model.forward`/`model.backward`
  run with an ops namespace whose linear pair is `ops.lora_forward`/`ops.lora_backward` for an adapted
  weight (the weight arrives wrapped as `Adapted`), so every adapter gets its own dA, dB;
- fast: the fast engine runs on the frozen base weights and adds the adapters' low-rank share after each
  product of an adapted weight (`Adapters`: no merged copy of any weight; adapter dropout fused), and at every linear hands dy and x to `LoraGrads.weight_grad`, which forms dA and
  dB and never the [out, in] gradient of a frozen weight (nor the embedding's). DPO's policy runs the
  same way (its workspaces `attach` the adapters).

The base of `new` / `load` is a read-only map of its checkpoint (checkpoint.map_tensors): once the first step
has packed (bf16) or stacked (float32 q|k|v, gate|up) the frozen matrices, their float32 pages leave memory
(`_workspace`) and only merge or the reference path read them back from the file; what the steps read in
place (the embedding, norms, float32 wo, down and tied head) stays mapped, never copied. A bf16 tied head's
float32 pages go too: the lookup reads a step's rows from the file (checkpoint.file_rows).

    model = LoraModel.new("runs/small", LoraConfig(rank=8, alpha=16, targets=("q", "v")))
    head0, objective, grads = model.loss_and_grads(tokens, mask)   # grads: "layers.0.attn.wq.lora_A", ...
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from .. import adapters as ad
from .. import ops
from ..errors import UserError
from ..model import Model, backward, check_tokens, forward
from ..optim import AdamW


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
    """A frozen base model and its adapters; `params` are the adapters (what the optimizer trains).
    What the training loop uses of it is `trainable.Trainable`."""

    precision = "f32"
    device = "cpu"

    def __init__(self, base: Model, lcfg: ad.LoraConfig, adapters: dict[str, np.ndarray], base_ref: dict):
        self.base, self.lcfg, self.params, self.base_ref = base, lcfg.check(base.config), adapters, base_ref
        ad.check_adapters(base.config, self.lcfg, adapters, "adapters")
        self.modules = ad.modules(base.config, lcfg)
        self.whole = ad.saved_names(base.config, self.lcfg)   # modules_to_save: trained whole, in self.params
        # what a step runs on (adapters aside): the base, each saved module's tensors replaced by the trained
        # copy in self.params (the same arrays); DPO's reference is `base` itself
        self.policy = Model(base.config, base.params | {n: adapters[n] for n in self.whole})
        self.engine_adapters = Adapters(base.config, self.lcfg, adapters)   # how the fast engine applies them
        self._ws = None

    @classmethod
    def new(cls, base_dir, lcfg: ad.LoraConfig, seed: int = 0) -> "LoraModel":
        """Fresh adapters (B = 0: the base's function) on the checkpoint in base_dir."""
        from ..checkpoint import load_model
        if ad.is_adapter_run(base_dir):
            raise UserError(f"{base_dir} is an adapter run; merge it first (nanoeuler lora merge) to use it as a base")
        base = Model(*load_model(base_dir, read_only=True, mapped=True))
        ref = {"path": str(Path(base_dir).resolve()), "sha256": ad.base_fingerprint(base_dir)}
        lcfg = lcfg.check(base.config)
        return cls(base, lcfg, ad.init_adapters(base.config, lcfg, seed, base.dtype, base.params), ref)

    @classmethod
    def load(cls, run_dir) -> "LoraModel":
        """The adapter run in run_dir on its base (refused if the base changed)."""
        lcfg, ref, adapters, cfg, params = ad.load_adapter_run(run_dir, mapped=True)
        return cls(Model(cfg, params), lcfg, adapters, ref)

    def set_precision(self, precision: str) -> "LoraModel":
        """The precision of the fast engine's products from now on: the frozen weights' and the adapters'."""
        self.base.set_precision(precision)
        self.precision = precision
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

    @property
    def adapter_dropout(self) -> float:
        return self.lcfg.dropout

    def optimizer(self, params: dict, **settings):
        return AdamW(params, **settings)

    def checkpoint_writers(self, tokenizer=None) -> dict:
        return ad.adapter_writers(self.lcfg, self.base_ref, self.params, tokenizer)

    def merged(self) -> Model:
        """A plain model of the base with the adapters merged (its own arrays, rounded once from float64)."""
        return Model(self.config, ad.merge_params(self.config, self.base.params, self.lcfg, self.params))

    # ---- forward / backward -------------------------------------------------------------------------
    def loss_and_grads(self, tokens, loss_mask=None, *, reference: bool = False, out=None, dropout=None,
                       counts=None, adapter_dropout: ops.Dropout | None = None):
        """As Model.loss_and_grads, with grads keyed like `params` (the adapters). dropout: on the residual
        branches; adapter_dropout: on the adapters' inputs (the same masks on both paths).
        counts: a data-parallel rank's target counts (see fast.heads); the reference path divides by its own."""
        cfg = self.config
        check_tokens(cfg, tokens, extra=cfg.n_mtp)
        if reference:
            head0, objective, grads = self._reference_step(tokens, loss_mask, dropout, adapter_dropout, counts)
        else:
            head0, objective, grads = self._fast_step(tokens, loss_mask, dropout, adapter_dropout, counts)
        if out is not None:
            for name, g in grads.items():
                out[name][...] = g
            grads = out
        return head0, objective, grads

    def loss(self, tokens, loss_mask=None, *, reference: bool = False, dropout=None):
        """Forward only (no adapter dropout: evaluation): (head-0 loss, objective)."""
        if reference:
            return self.merged().loss(tokens, loss_mask, reference=True, dropout=dropout)
        from .. import fast
        check_tokens(self.config, tokens, extra=self.config.n_mtp)
        ws = self._workspace(tokens.shape[0], tokens.shape[1] - self.config.n_mtp)
        return fast.loss(self.config, self.policy.params, tokens, loss_mask, ws, dropout)

    def reference_objective(self, tokens, loss_mask=None, dropout=None, adapter_dropout=None):
        """The reference forward with adapters applied op by op: (head losses, objective, caches)."""
        cfg, s = self.config, self.lcfg.scale
        T = tokens.shape[1] - cfg.n_mtp
        P = dict(self.policy.params)
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
        return head_losses[0], objective, grads | {n: g[n] for n in self.whole}

    def _fast_step(self, tokens, loss_mask, dropout, adapter_dropout, counts):
        from .. import fast
        from ..fast import engine
        ws = self._workspace(tokens.shape[0], tokens.shape[1] - self.config.n_mtp)
        self.engine_adapters.drop = adapter_dropout
        try:
            with engine.grad_hook(None):   # what the engine announces are base gradients, not what ranks reduce
                head0, objective, _ = fast.loss_and_grads(self.config, self.policy.params, tokens, loss_mask, ws,
                                                          self.engine_adapters.new_step(ws), dropout, counts)
        finally:
            self.engine_adapters.drop = None
        return head0, objective, self.engine_adapters.step_grads(ws)

    def _workspace(self, B: int, T: int):
        """The fast engine's buffers for this batch shape and precision, kept from step to step (`new_workspace`)."""
        ws = self._ws
        if ws is None or ws.key != (self.config, B, T, np.dtype(self.dtype), self.precision, True):
            self._ws = None
            self._ws = self.new_workspace(B, T)
        return self._ws

    def new_workspace(self, B: int, T: int, like=None):
        """A lean fast.Workspace (see there) that applies the adapters on the fly (`Adapters.attach`). It packs
        (bf16) or stacks (float32: q|k|v, gate|up) the frozen weights at once, or shares those of `like` (a
        workspace of this model for another batch shape: DPO's), and a base mapped from its checkpoint (`new`,
        `load`) lets the pages of those weights go before the first step (the rest of the map, which the steps
        read, stays as it is: no copy of it is made; a packed tied head's pages go as well, the lookup reading
        a step's rows from the file). Their float32 is read back from the checkpoint file only by what reads it
        later (merge, the reference path, a workspace of another precision). What it saves: docs/benchmarks.md
        (LoRA: memory)."""
        from .. import fast
        from ..checkpoint import drop_pages, file_rows
        ws = self.engine_adapters.attach(fast.Workspace(self.config, B, T, self.dtype, self.precision, lean=True))
        if like is not None:
            fast.engine.share_fixed(ws, like)
            return ws
        # each weight's float32 pages go as soon as it is copied: never all of them and their copies at once
        fast.engine.stack_fixed(self.config, self.policy.params, ws, done=drop_pages)
        rows = file_rows(self.base.params["embed.weight"]) if "embed.weight" in ws.packs else None
        if rows is not None:        # a tied head packed (bf16): only the lookup reads its float32 now, a step's
            ws.embed_rows = rows    # rows, from the file (the head's float32 stays out of memory)
        return ws


class Adapters:
    """The adapters as the fast engine applies them on the fly (`Workspace.adapters`): after each product of
    a frozen weight W they adapt (engine.linear, linear_dx), their low-rank share is added,

        y += s·(x̃·Aᵀ)·Bᵀ      dx += (s·(dy·B)·A) ⊙ mask          x̃ = x ⊙ mask (adapter dropout, else x)

    ~2·n·r·(in + out) flops each, W never copied, through the workspace's products `mm` (bf16: operands
    rounded like every other product). `drop` (ops.Dropout, set for one step by LoraModel) draws module j's
    masks at site DROPOUT_SITE0 + j by batch row, as the reference path does (`batch_row`).
    The thin products are formed once a step: u = s·x̃·Aᵀ of the forward is kept for the gradients
    (LoraGrads.weight_grad), and du = s·dy·B of the gradients for dx, by (module, first batch row): 6 products
    of an adapter a step instead of 8, the two saved both [n, r] (in bf16 padded to 64 output columns)."""

    def __init__(self, cfg, lcfg: ad.LoraConfig, adapters: dict[str, np.ndarray]):
        self.shapes, self.adapters, self.scale = cfg.param_shapes(), adapters, lcfg.scale
        mods = ad.modules(cfg, lcfg)
        self.whole = ad.saved_names(cfg, lcfg)   # modules_to_save: trained whole (their tensors in `adapters`)
        self.where = {name: (module, rows) for module, (bases, _) in mods.items()
                      for name, rows in zip(bases, ad.row_slices(cfg, bases))}
        self.site = {module: ad.DROPOUT_SITE0 + j for j, module in enumerate(mods)}
        self.drop = None
        self._runs = {}
        self.saved = {}   # ("u" | "du", module, first batch row) -> [n, r], from forward to grads, grads to dx

    def attach(self, ws):
        """Make the fast engine's workspace ws apply these adapters, with a LoraGrads per part (ws.lora),
        which form the saved modules' gradients too."""
        ws.adapters = self
        ws.fixed_weights = True         # the frozen base: stacked and packed once ...
        ws.trained_weights = [n for n in self.whole if len(self.shapes[n]) == 2]   # ... these packed every step
        ws.lora = [LoraGrads(self.shapes, self) for _ in ws.parts]
        for w, g in zip(ws.parts[1:], ws.lora[1:]):
            w.grads = g                 # the full gradient set the engine gave the part is dropped
        return ws

    def new_step(self, ws) -> "LoraGrads":
        """Zero the parts' adapter gradients; the gradients to hand the engine (part 0's)."""
        for g in ws.lora:
            for a in g.out.values():
                a[...] = 0
        return ws.lora[0]

    def step_grads(self, ws) -> dict[str, np.ndarray]:
        """The adapters' gradients of the step, the parts' shares summed in part order (deterministic), and
        the saved modules' (the engine sums those into part 0's)."""
        grads = {n: a.copy() for n, a in ws.lora[0].out.items()}
        for g in ws.lora[1:]:
            for n, a in g.out.items():
                grads[n] += a
        return grads | {n: ws.lora[0][n].copy() for n in self.whole}

    def forward(self, key, x, out, mm) -> None:
        """out [n, Σ out] += s·(x̃·Aᵀ)·Bᵀ for every adapted stretch of the product `key` (x [n, in])."""
        runs = self._product_runs(key)
        row0 = batch_row(x) if runs else 0
        for module, cols, rows in runs:
            A, B = self.adapters[module + ".lora_A"], self.adapters[module + ".lora_B"][rows]
            u = np.empty((x.shape[0], A.shape[0]), x.dtype)
            mm(self.dropped(module, x, row0), A.T, u)                       # [n, r]
            u *= x.dtype.type(self.scale)
            self.saved["u", module, row0] = u
            t = np.empty((x.shape[0], B.shape[0]), x.dtype)
            mm(u, B.T, t)                                                   # [n, out]
            out[:, cols] += t

    def dx(self, key, dy, out, mm) -> None:
        """out [n, in] += (s·(dy·B)·A) ⊙ mask for every adapted stretch of `key` (dy [n, Σ out])."""
        runs = self._product_runs(key)
        row0 = batch_row(out) if runs else 0
        for module, cols, rows in runs:
            A, B = self.adapters[module + ".lora_A"], self.adapters[module + ".lora_B"][rows]
            du = self.saved.pop(("du", module, row0), None)                 # the gradients' (formed first)
            if du is None:
                du = np.empty((dy.shape[0], A.shape[0]), dy.dtype)
                mm(dy[:, cols], B, du)                                      # [n, r]
                du *= dy.dtype.type(self.scale)
            t = np.empty_like(out)
            mm(du, A, t)                                                    # [n, in]
            out += self.dropped(module, t, row0)

    def dropped(self, module: str, x, row0: int | None = None):
        """x ⊙ the module's dropout mask (a new array), or x itself without dropout. row0: x's first batch
        row (default: batch_row(x))."""
        if self.drop is None:
            return x
        from ..fast.kernels import dropout_scale
        d = self.drop
        row0 = batch_row(x) if row0 is None else row0
        out = np.empty_like(x)
        dropout_scale(x, np.uint64(d.base(self.site[module], row0, x.shape[1])), np.uint64(d.threshold),
                      x.dtype.type(d.scale), out)
        return out

    def _product_runs(self, key: str):
        """runs() of the weights behind the engine's product `key` (a weight, or weights stacked: fast.engine.product_key)."""
        if key not in self._runs:
            from ..fast.engine import product_weights
            self._runs[key] = self.runs(tuple(product_weights(key)))
        return self._runs[key]

    def runs(self, names: tuple[str, ...]):
        """The adapted stretches of the output columns of a product of weights stacked by rows:
        [(module, columns, rows of its B)], neighbours of one module joined (GPT-2's q|k|v: one product for
        c_attn, not three).

            euler (wq, wk, wv) (modules q, k, v) -> 3 runs;  gpt2 (wq, wk, wv) (c_attn) -> 1 run;  a head -> []"""
        if names not in self._runs:
            runs, col = [], 0
            for name in names:
                c0, col = col, col + self.shapes[name][0]
                if name not in self.where:
                    continue
                module, rows = self.where[name]
                if runs and runs[-1][0] == module and runs[-1][1].stop == c0 and runs[-1][2].stop == rows.start:
                    runs[-1] = (module, slice(runs[-1][1].start, col), slice(runs[-1][2].start, rows.stop))
                else:
                    runs.append((module, slice(c0, col), rows))
            self._runs[names] = runs
        return self._runs[names]


def batch_row(a) -> int:
    """The batch row of a's first row. The fast engine hands its hooks a part's rows as row views of its
    workspace's [..., N, width] activation arrays, so the offset into the owning array, in rows, mod N is
    the row (sequence b, position t: row b·T + t, as in the reference path's [B, T, width])."""
    base = a if a.base is None else a.base
    if a.ndim != 2 or base.shape[-1] != a.shape[1] or base.strides[-2] != a.strides[0]:
        raise AssertionError(f"adapter dropout needs a row view of a workspace array, got {a.shape} of {base.shape}")
    offset = a.__array_interface__["data"][0] - base.__array_interface__["data"][0]
    return offset // a.strides[0] % base.shape[-2]


class LoraGrads(dict):
    """What the fast engine writes a LoRA step's gradients into: the small ones it writes itself (norms,
    biases, positions: kept, unused unless saved) as a dict, and for every linear, through `engine.weight_grad`,
    the adapters' dA, dB from that linear's dy [n, out] and x [n, in] (into `out`):

        u = x̃·Aᵀ [n, r]     dB = s·dyᵀ·u [out, r]     dA = s·(dy·B)ᵀ·x̃ [r, in]     ~2·n·r·(in + out) flops

    in place of dW = dyᵀ·x (n·in·out flops); a frozen weight's gradient is not computed at all, nor the
    embedding's (no "embed.weight" here: the engine skips it). A saved weight (modules_to_save: an output
    head) gets its whole dW, as in full fine-tuning."""

    def __init__(self, shapes: dict, adapters: Adapters):
        dtype = next(iter(adapters.adapters.values())).dtype
        self.adapters, self.whole = adapters, adapters.whole
        super().__init__({n: np.zeros(s, dtype) for n, s in shapes.items()
                          if len(s) == 1 or n == "pos_embed.weight" or n in self.whole})
        self.out = {n: np.zeros_like(a) for n, a in adapters.adapters.items() if n not in self.whole}

    def weight_grad(self, names, dy, x, mm, accumulate: bool = False) -> None:
        if names[0] in self.whole:                                          # a saved head: dyᵀ·x [V, d]
            from ..fast.engine import add_product
            if accumulate:                                                  # (its rows' later chunks)
                add_product(dy.T, x, self[names[0]], mm)
            else:
                mm(dy.T, x, self[names[0]])
            return
        ad, s, n = self.adapters, dy.dtype.type(self.adapters.scale), dy.shape[0]
        runs = ad.runs(tuple(names))
        row0 = batch_row(x) if runs else 0
        for module, cols, rows in runs:
            A, B = ad.adapters[module + ".lora_A"], ad.adapters[module + ".lora_B"][rows]
            dym, xd = dy[:, cols], ad.dropped(module, x, row0)             # [n, out] of the module's rows, x̃
            u = ad.saved.pop(("u", module, row0), None)                     # the forward's
            if u is None:
                u = np.empty((n, A.shape[0]), dy.dtype)
                mm(xd, A.T, u)                                              # [n, r]
                u *= s
            du = np.empty((n, A.shape[0]), dy.dtype)
            mm(dym, B, du)                                                  # [n, r]
            du *= s
            ad.saved["du", module, row0] = du                               # for linear_dx's adapter share
            dB, dA = np.empty(B.shape, dy.dtype), np.empty(A.shape, dy.dtype)
            mm(dym.T, u, dB)                                                # [out, r]
            mm(du.T, xd, dA)                                                # [r, in]
            self.out[module + ".lora_B"][rows] += dB
            self.out[module + ".lora_A"] += dA
