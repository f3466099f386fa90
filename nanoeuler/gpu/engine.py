"""Training on the GPU with the ordinary model code: move a Model there and back, loss and gradients, AdamW.

    from nanoeuler import Model
    from nanoeuler.gpu import engine
    gm = engine.to_gpu(Model.from_preset("gpt"))             # a Model whose params are cupy float32 arrays
    head0, objective, grads = engine.loss_and_grads(gm, tokens, precision="bf16")
    opt = engine.GpuAdamW(gm.params, lr=3e-4)
    opt.step(gm.params, grads)
    engine.to_cpu(gm).save("run")                             # an ordinary checkpoint the CPU loads

`loss_and_grads` is `Model.loss_and_grads` with the GPU ops namespace plugged into `model.forward` /
`model.backward` (the array-module switch), plus a fused loss: the K heads' cross-entropies run as one
kernel over [K·B·T, V] rows, and their gradient overwrites the logits in place (no second [K, B, T, V]).
Mixed precision ("bf16") keeps fp32 master weights: params, grads and AdamW moments are fp32; only the
operands of matrix products and attention are rounded to bf16.
"""
from __future__ import annotations

import math

import numpy as np

from .. import ops as reference_ops
from ..errors import UserError
from ..model import Model, backward, check_tokens, forward
from ..optim import AdamW
from .matmul import set_tf32
from .ops import GpuOps, ce_backward_rows, ce_forward_rows
from .runtime import THREADS, blocks_for, get_kernel, require_cupy

_OPS = {}


def gpu_ops(precision: str = "f32") -> GpuOps:
    """The shared GpuOps namespace for a precision ("f32" or "bf16")."""
    if precision not in _OPS:
        _OPS[precision] = GpuOps(precision)
    return _OPS[precision]


def to_gpu(model: Model) -> Model:
    """The same model with float32 cupy arrays as parameters (float64 CPU models are cast down)."""
    cp = require_cupy()
    return Model(model.config, {n: cp.asarray(p, dtype=cp.float32) for n, p in model.params.items()})


def to_cpu(model: Model) -> Model:
    """The same model with NumPy float32 parameters: saves as an ordinary checkpoint."""
    cp = require_cupy()
    return Model(model.config, {n: cp.asnumpy(p) for n, p in model.params.items()})


def set_precision(precision: str) -> None:
    """bf16 mode also routes any remaining fp32 product (the heads' forward `h @ Wᵀ`) through TF32."""
    set_tf32(precision == "bf16")


def loss_and_grads(model: Model, tokens, loss_mask=None, precision: str = "f32"):
    """tokens int [B, T+K] (NumPy or cupy) -> (head-0 loss, objective, grads as cupy arrays keyed like params)."""
    cp = require_cupy()
    cfg = model.config
    tokens = cp.asnumpy(tokens) if hasattr(tokens, "get") else np.asarray(tokens)
    check_tokens(cfg, tokens, extra=cfg.n_mtp)
    if loss_mask is not None and hasattr(loss_mask, "get"):
        loss_mask = cp.asnumpy(loss_mask)
    K = cfg.n_mtp
    T = tokens.shape[1] - K
    targets = reference_ops.mtp_targets(tokens, T, K, loss_mask)  # [K, B, T] int64, −1 = no loss
    n_valid = (targets >= 0).reshape(K, -1).sum(axis=1)          # [K], on the host: no device sync
    ops = gpu_ops(precision)
    logits, caches = forward(cfg, model.params, cp.asarray(tokens[:, :T]), ops=ops)  # [K, B, T, V]
    V = logits.shape[-1]
    z = logits.reshape(K, -1, V)                                  # a view: [K, N, V]
    t = cp.asarray(targets.reshape(K, -1))                        # [K, N]
    loss_rows, lse = ce_forward_rows(z.reshape(-1, V), t.reshape(-1))
    head_sums = loss_rows.reshape(K, -1).sum(axis=1)
    for k in range(K):  # d objective / d logits of head k = (softmax − onehot) / (K · n_k), in place
        scale = 1.0 / (K * n_valid[k]) if n_valid[k] else 0.0
        ce_backward_rows(z[k], lse.reshape(K, -1)[k], t[k], scale, out=z[k])
    grads = backward(cfg, model.params, logits, caches, ops=ops)
    head_losses = [float(s) / n if n else 0.0 for s, n in zip(cp.asnumpy(head_sums), n_valid)]
    return head_losses[0], sum(head_losses) / K, grads


def loss(model: Model, tokens, loss_mask=None, precision: str = "f32") -> tuple[float, float]:
    """Forward only: (head-0 loss, objective)."""
    cp = require_cupy()
    cfg = model.config
    tokens = cp.asnumpy(tokens) if hasattr(tokens, "get") else np.asarray(tokens)
    check_tokens(cfg, tokens, extra=cfg.n_mtp)
    K = cfg.n_mtp
    T = tokens.shape[1] - K
    targets = reference_ops.mtp_targets(tokens, T, K, loss_mask)
    n_valid = (targets >= 0).reshape(K, -1).sum(axis=1)
    logits, _ = forward(cfg, model.params, cp.asarray(tokens[:, :T]), ops=gpu_ops(precision))
    V = logits.shape[-1]
    loss_rows, _ = ce_forward_rows(logits.reshape(-1, V), cp.asarray(targets.reshape(-1)))
    sums = cp.asnumpy(loss_rows.reshape(K, -1).sum(axis=1))
    head_losses = [float(s) / n if n else 0.0 for s, n in zip(sums, n_valid)]
    return head_losses[0], sum(head_losses) / K


class GpuModel:
    """A Model on the GPU that the CPU training loop drives (`trainable.Trainable`): its optimizer is the
    fused GpuAdamW with the moments on the device, and its checkpoint holds host copies of the weights, so
    a GPU run writes an ordinary checkpoint.

        gm = GpuModel(Model.from_preset("gpt"), precision="bf16")
        head0, objective, grads = gm.loss_and_grads(tokens)     # grads: cupy, keyed like params
    """

    device = "gpu"
    adapter_dropout = 0.0

    def __init__(self, model: Model, precision: str = "f32"):
        gpu_ops(precision)  # validates the precision
        self.config = model.config
        self.precision = precision
        self._model = model if hasattr(next(iter(model.params.values())), "get") else to_gpu(model)  # cupy has .get
        self.params = self._model.params

    def loss_and_grads(self, tokens, loss_mask=None, dropout=None):
        if dropout is not None:  # run_training refuses --dropout on the GPU before it starts
            raise UserError("dropout is not implemented on the GPU engine")
        set_precision(self.precision)
        return loss_and_grads(self._model, tokens, loss_mask, self.precision)

    def loss(self, tokens, loss_mask=None):
        set_precision(self.precision)
        return loss(self._model, tokens, loss_mask, self.precision)

    def n_params(self) -> int:
        return self._model.n_params()

    @property
    def dtype(self):
        return np.dtype(np.float32)

    def optimizer(self, params: dict, **settings) -> "GpuAdamW":
        return GpuAdamW(params, **settings)

    def checkpoint_writers(self, tokenizer=None) -> dict:
        from ..checkpoint import model_writers
        return model_writers(self.config, self.host_params(), tokenizer)

    def host_params(self) -> dict[str, np.ndarray]:
        cp = require_cupy()
        return {n: cp.asnumpy(p) for n, p in self.params.items()}

    def to_cpu(self) -> Model:
        return Model(self.config, self.host_params())

    def save(self, run_dir, tokenizer=None) -> None:
        self.to_cpu().save(run_dir, tokenizer)


class GpuAdamW(AdamW):
    """`optim.AdamW` with cupy moments and the fused adamw_step kernel; state_dict() hands back NumPy arrays."""

    def step(self, params, grads, lr: float | None = None) -> None:
        cp = require_cupy()
        lr = self.lr if lr is None else lr
        b1, b2 = self.betas
        self.t += 1
        bc1 = 1.0 - b1 ** self.t
        bc2_sqrt = math.sqrt(1.0 - b2 ** self.t)
        kernel = get_kernel("adamw", "adamw_step")
        for name, p in params.items():
            g, m, v = cp.ascontiguousarray(grads[name], dtype=cp.float32), self.m[name], self.v[name]
            decay = 1.0 - lr * self.weight_decay if (p.ndim >= 2 and self.weight_decay) else 1.0
            n = p.size
            kernel((blocks_for(n),), (THREADS,),
                   (p, g, m, v, np.int64(n), np.float32(b1), np.float32(1.0 - b1), np.float32(b2),
                    np.float32(1.0 - b2), np.float32(decay), np.float32(lr / bc1), np.float32(bc2_sqrt),
                    np.float32(self.eps)))

    def state_dict(self):
        cp = require_cupy()
        tensors, scalars = super().state_dict()
        return {n: cp.asnumpy(a) for n, a in tensors.items()}, scalars

    def load_state_dict(self, tensors, scalars) -> None:
        cp = require_cupy()
        for n in self.m:
            self.m[n][...] = cp.asarray(tensors[f"m.{n}"])
            self.v[n][...] = cp.asarray(tensors[f"v.{n}"])
        self.t = int(scalars["t"])
