"""Rotary position embedding, rotate-half pairing (dimension i rotates with i + hd/2, as HF Llama).

For position t and pair i < hd/2 the angle is t · θ^(−2i/hd); the pair (a, b) = (x[i], x[i + hd/2])
becomes (a·cos − b·sin, b·cos + a·sin). A rotation's transpose is the rotation by −angle, so the
backward is the same formula with sin negated.
"""
import numpy as np


def rope_tables(T, head_dim, theta, dtype, start=0):
    """cos, sin tables [T, head_dim/2] for positions start .. start+T-1 (computed in float64, then cast)."""
    inv_freq = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)  # [hd/2]
    angles = np.arange(start, start + T, dtype=np.float64)[:, None] * inv_freq[None, :]  # [T, hd/2]
    return np.cos(angles).astype(dtype), np.sin(angles).astype(dtype)


def _rotate(x, cos, sin):
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


def rope_forward(x, cos, sin):
    """x [B, H, T, hd], cos/sin [T, hd/2] -> rotated x [B, H, T, hd]."""
    return _rotate(x, cos, sin), (cos, sin)


def rope_backward(dy, cache):
    """dy [B, H, T, hd] -> dx [B, H, T, hd] (rotation by the opposite angle)."""
    cos, sin = cache
    return _rotate(dy, cos, -sin)
