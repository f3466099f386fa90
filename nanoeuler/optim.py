"""AdamW with decoupled weight decay (matrices only), the learning-rate schedule, gradient clipping.

AdamW step for a parameter p with gradient g (t counts from 1):
    m ← β1·m + (1−β1)·g;   v ← β2·v + (1−β2)·g²
    p ← p − lr·wd·p                     (decoupled decay, only for 2-D tensors)
    p ← p − lr · (m/(1−β1ᵗ)) / (sqrt(v/(1−β2ᵗ)) + eps)
This is exactly torch.optim.AdamW's update.
"""
from __future__ import annotations

import math

import numpy as np

PARALLEL_ABOVE = 1 << 16  # a tensor this big is updated in one slice per core (smaller: a thread costs more)


class AdamW:
    def __init__(self, params: dict[str, np.ndarray], lr: float = 3e-3, betas=(0.9, 0.95), eps: float = 1e-8,
                 weight_decay: float = 0.1):
        self.lr, self.betas, self.eps, self.weight_decay = lr, tuple(betas), eps, weight_decay
        self.t = 0
        self.m = {n: np.zeros_like(p) for n, p in params.items()}
        self.v = {n: np.zeros_like(p) for n, p in params.items()}

    def step(self, params: dict[str, np.ndarray], grads: dict[str, np.ndarray], lr: float | None = None) -> None:
        """Update params in place."""
        lr = self.lr if lr is None else lr
        b1, b2 = self.betas
        self.t += 1
        bc1 = 1.0 - b1 ** self.t
        bc2_sqrt = math.sqrt(1.0 - b2 ** self.t)
        for name, p in params.items():
            g, m, v = grads[name], self.m[name], self.v[name]
            dt = p.dtype.type
            decay = dt(1.0 - lr * self.weight_decay) if p.ndim >= 2 and self.weight_decay else dt(1.0)
            if all(a.flags.c_contiguous and a.dtype == p.dtype for a in (g, m, v)) and p.flags.c_contiguous:
                # one fused pass (nanoeuler/fast/kernels.py), rounding exactly as the lines below;
                # big tensors in one slice per core
                from .fast import kernels, parallel
                flat = [a.reshape(-1) for a in (p, g, m, v)]
                scalars = (dt(b1), dt(1.0 - b1), dt(b2), dt(1.0 - b2), decay, dt(bc2_sqrt), dt(self.eps), dt(lr / bc1))
                slices = parallel.chunks(p.size, parallel.PARTS if p.size >= PARALLEL_ABOVE else 1)
                parallel.run_parts(lambda k: kernels.adamw_update(*(a[slice(*slices[k])] for a in flat), *scalars),
                                   len(slices))
                continue
            m *= dt(b1)
            m += dt(1.0 - b1) * g
            v *= dt(b2)
            v += dt(1.0 - b2) * (g * g)
            if p.ndim >= 2 and self.weight_decay:
                p *= decay
            denom = np.sqrt(v) / dt(bc2_sqrt) + dt(self.eps)
            p -= dt(lr / bc1) * m / denom

    def state_dict(self) -> tuple[dict[str, np.ndarray], dict]:
        """(tensors, scalars): moments as 'm.<name>' / 'v.<name>', and the step count and hyper-parameters."""
        tensors = {f"m.{n}": a for n, a in self.m.items()} | {f"v.{n}": a for n, a in self.v.items()}
        return tensors, {"t": self.t, "lr": self.lr, "betas": list(self.betas), "eps": self.eps,
                         "weight_decay": self.weight_decay}

    def load_state_dict(self, tensors: dict[str, np.ndarray], scalars: dict) -> None:
        for n in self.m:
            self.m[n][...] = tensors[f"m.{n}"]
            self.v[n][...] = tensors[f"v.{n}"]
        self.t = int(scalars["t"])


def lr_schedule(step: int, max_lr: float, warmup: int, total: int, final_frac: float = 0.1) -> float:
    """Linear warm-up to max_lr over `warmup` steps, then cosine decay to final_frac·max_lr at `total`.

        lr_schedule(0, 1.0, 10, 100) == 0.1;  lr_schedule(9, 1.0, 10, 100) == 1.0;  lr_schedule(100, 1.0, 10, 100) == 0.1
    """
    if step < warmup:
        return max_lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return max_lr * (final_frac + (1 - final_frac) * 0.5 * (1 + math.cos(math.pi * progress)))


def clip_grad_norm(grads: dict[str, np.ndarray], max_norm: float) -> float:
    """Scale all grads in place so their global L2 norm is at most max_norm; return the norm before clipping."""
    total = math.sqrt(sum(float(np.vdot(g, g)) for g in grads.values()))
    if max_norm > 0 and total > max_norm:
        scale = max_norm / (total + 1e-6)
        for g in grads.values():
            g *= g.dtype.type(scale)
    return total
