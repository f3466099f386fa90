"""A linear map with a low-rank adapter (LoRA), the base weight frozen: y = x·Wᵀ + s·(x̃·Aᵀ)·Bᵀ.

W [out, in] is frozen, A [r, in] and B [out, r] are trained, s = α / r, and x̃ = x ⊙ mask is the
adapter's input after dropout (mask = 1 without dropout; 0 or 1/q with it, see ops/dropout.py).
Only the adapter sees the dropout, as in PEFT's `lora_dropout`.

Backward, with u = x̃·Aᵀ [N, r] kept from forward and the rows flattened to N = B·T:
    y = x·Wᵀ + s·u·Bᵀ      ->  dB = s · dyᵀ·u                  [out, r]
                               du = s · dy·B                   [N, r]
    u = x̃·Aᵀ               ->  dA = duᵀ·x̃                      [r, in]
                               dx̃ = du·A                       [N, in]
    x̃ = x ⊙ mask           ->  dx = dy·W + dx̃ ⊙ mask           [N, in]
No dW: W is frozen, and its [out, in] product (the largest of the step) is never formed.
With B = 0 (PEFT's initialisation) the map is the base's, dA = 0 and dB = s·dyᵀ·(x̃·Aᵀ) ≠ 0.

    y, cache = lora_forward(x, W, A, B, scale=2.0)      # x [2, 5, 8], W [6, 8], A [4, 8], B [6, 4]
    dx, dA, dB = lora_backward(dy, cache)

`lora_merge` folds an adapter into its weight, W + s·B·A, which gives the same y without dropout.
"""
import numpy as np


def lora_forward(x, W, A, B, scale: float, mask=None):
    """x [..., in], W [out, in], A [r, in], B [out, r], mask [..., in] or None -> y [..., out]."""
    xd = x if mask is None else x * mask
    u = xd @ A.T                                           # [..., r]
    y = x @ W.T + x.dtype.type(scale) * (u @ B.T)          # [..., out]
    return y, (x, W, A, B, scale, mask, xd, u)


def lora_backward(dy, cache):
    """dy [..., out] -> dx [..., in], dA [r, in], dB [out, r]."""
    x, W, A, B, scale, mask, xd, u = cache
    s = dy.dtype.type(scale)
    dy2 = dy.reshape(-1, dy.shape[-1])                      # [N, out]
    dB = s * (dy2.T @ u.reshape(-1, u.shape[-1]))           # [out, r]
    du = s * (dy @ B)                                       # [..., r]
    dA = du.reshape(-1, du.shape[-1]).T @ xd.reshape(-1, xd.shape[-1])  # [r, in]
    dxd = du @ A                                            # [..., in]
    dx = dy @ W + (dxd if mask is None else dxd * mask)
    return dx, dA, dB


def lora_merge(W, A, B, scale: float):
    """W [out, in] + s·B·A -> the merged weight [out, in], in W's dtype (computed in float64)."""
    return (W.astype(np.float64) + scale * (B.astype(np.float64) @ A.astype(np.float64))).astype(W.dtype)
