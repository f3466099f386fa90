"""Rotary position embedding, rotate-half pairing (dimension i rotates with i + hd/2, as HF Llama).

For position t and pair i < hd/2 the angle is t · f_i, f the layer's inverse frequencies; the pair
(a, b) = (x[i], x[i + hd/2]) becomes (a·cos − b·sin, b·cos + a·sin). A rotation's transpose is the rotation
by −angle, so the backward is the same formula with sin negated.

The inverse frequencies are θ^(−2i/hd) divided by a factor per pair (`inv_freq`): 1 for plain RoPE, the
factor for `linear` scaling, and for `llama3` (transformers' _compute_llama3_parameters) 1 on the fast pairs
(wavelength 2π/f below original_ctx / high_freq_factor), the factor on the slow ones (above original_ctx /
low_freq_factor), and between them a blend. llama.cpp stores such factors as a tensor (`rope_freqs`):

    wavelengths 2π/f:   6.3 (fast)   4096 (between 2048 and 8192)   62832 (slow)
    llama3_factors(2π / np.array([6.3, 4096, 62832]), factor=8, low_freq_factor=1, high_freq_factor=4,
                   original_ctx=8192) -> [1.0, 2.4, 8.0]     (4096: smooth = (8192/4096 − 1) / 3 = 1/3,
                                                              1 / ((1 − 1/3) / 8 + 1/3) = 2.4)

`yarn` (transformers' _compute_yarn_parameters, llama.cpp's rope_yarn) ramps over the pair index instead: the
pairs that turn more than beta_fast times over original_ctx keep their frequency, those that turn fewer than
beta_slow times are divided by the factor, a straight line between (its ends floored / ceiled to pairs):

    yarn_factors(8, 5000.0, factor=4, original_ctx=4096, beta_fast=32, beta_slow=1) -> [1.0, 1.0, 1.33, 2.0]
                        (ramp over pairs 1 .. 4: 0, 0, 1/3, 2/3;  1 / ((1 − 1/3) + (1/3) / 4) = 1.33)

YaRN and LongRoPE also multiply cos and sin by an attention factor m; as both q and k turn, that multiplies the
scores q·kᵀ by m², which the model folds into q's factor (config.Config.score_scale) rather than into the tables.
"""
import math

import numpy as np


def inv_freq(head_dim, theta, factors=None):
    """The inverse frequencies [hd/2] (float64) of base θ, each divided by its factor (None: plain RoPE).
    inv_freq(4, 100.0) -> [1.0, 0.1]; inv_freq(4, 100.0, [2.0, 2.0]) -> [0.5, 0.05]"""
    f = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)  # [hd/2]
    return f if factors is None else f / np.asarray(factors, np.float64)


def llama3_factors(freqs, factor, low_freq_factor, high_freq_factor, original_ctx):
    """The `llama3` divisor of each inverse frequency freqs [hd/2] (see the module docstring)."""
    wavelen = 2 * np.pi / freqs
    smooth = (original_ctx / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)  # 0 slow .. 1 fast
    blend = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < original_ctx / high_freq_factor, 1.0,
                    np.where(wavelen > original_ctx / low_freq_factor, factor, blend))


def yarn_factors(head_dim, theta, factor, original_ctx, beta_fast, beta_slow):
    """The `yarn` divisor of each pair's frequency [hd/2] (see the module docstring)."""
    def pair_turning(rotations):   # the (fractional) pair whose wavelength fits `rotations` times in original_ctx
        return head_dim * math.log(original_ctx / (rotations * 2 * math.pi)) / (2 * math.log(theta))
    low = max(math.floor(pair_turning(beta_fast)), 0)
    high = min(math.ceil(pair_turning(beta_slow)), head_dim - 1)
    ramp = np.clip((np.arange(head_dim // 2) - low) / max(high - low, 0.001), 0, 1)  # [hd/2] 0 keep .. 1 divide
    return 1 / (ramp / factor + (1 - ramp))


def rope_tables(T, freqs, dtype, start=0):
    """cos, sin tables [T, hd/2] for positions start .. start+T-1 at inverse frequencies freqs [hd/2]
    (computed in float64, then cast)."""
    angles = np.arange(start, start + T, dtype=np.float64)[:, None] * np.asarray(freqs, np.float64)[None, :]
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
