"""Dropout on a residual branch (training only): y = x · keep / q, with keep ~ Bernoulli(q), q = 1 − p.

The mask is a pure function of (seed, site, element), not a stream of random numbers: element j of
site s (j = row·width + column over the whole batch; sites 2i and 2i+1 are layer i's attention and
feed-forward branches) is kept iff the top 24 bits of

    splitmix64(seed + ((s << 40) + j + 1) · γ)          γ = 0x9E3779B97F4A7C15 (all mod 2⁶⁴)

are ≥ round(p · 2²⁴). So the reference model, the fast engine (any cut of the batch into parts) and
both passes draw the same mask without storing or sending it. q = 1 − round(p · 2²⁴) / 2²⁴ is the exact
keep probability, and kept entries are scaled by 1/q so the expected output is x.

    drop = Dropout(0.1, seed=7)
    y, cache = dropout_forward(x, drop.mask(site=0, rows=N, width=d, dtype=x.dtype))
    dx = dropout_backward(dy, cache)
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

GAMMA = 0x9E3779B97F4A7C15
MIX1 = 0xBF58476D1CE4E5B9
MIX2 = 0x94D049BB133111EB
SITE_SHIFT = 40
THRESHOLD_BITS = 24


@dataclass(frozen=True)
class Dropout:
    """The dropout of one micro-batch: rate p and the seed its masks are drawn from."""
    p: float
    seed: int

    def __post_init__(self):
        if not 0.0 <= self.p < 1.0:
            raise ValueError(f"dropout rate must be in [0, 1), got {self.p}")

    @property
    def threshold(self) -> int:
        """Drop an element iff its 24 hash bits are below this."""
        return round(self.p * (1 << THRESHOLD_BITS))

    @property
    def scale(self) -> float:
        """1 / q, the factor on kept elements."""
        return (1 << THRESHOLD_BITS) / ((1 << THRESHOLD_BITS) - self.threshold)

    def base(self, site: int, row0: int, width: int) -> int:
        """The splitmix64 state of element (row0, 0) of a site; element l after it has base + l·γ."""
        return (self.seed + ((site << SITE_SHIFT) + row0 * width + 1) * GAMMA) % (1 << 64)

    def mask(self, site: int, rows: int, width: int, dtype, row0: int = 0) -> np.ndarray:
        """The 0 or 1/q factors of rows [row0, row0 + rows) of a site -> [rows, width] in dtype."""
        u64 = np.uint64
        z = u64(self.base(site, row0, width)) + np.arange(rows * width, dtype=u64) * u64(GAMMA)  # [rows·width]
        z = (z ^ (z >> u64(30))) * u64(MIX1)
        z = (z ^ (z >> u64(27))) * u64(MIX2)
        z = z ^ (z >> u64(31))
        keep = (z >> u64(64 - THRESHOLD_BITS)) >= u64(self.threshold)
        return np.where(keep, self.scale, 0.0).astype(dtype).reshape(rows, width)


def dropout_forward(x, mask):
    """x [..., w], mask [..., w] (0 or 1/q, from Dropout.mask) -> y = x · mask."""
    return x * mask, mask


def dropout_backward(dy, cache):
    """dy [..., w] -> dx = dy · mask."""
    return dy * cache
