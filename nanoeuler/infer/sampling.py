"""Sampling: logits -> a token (temperature, top-k, top-p, greedy), and log-probabilities.

Every decoding path draws through these functions: `session.generate` and the batcher (`engine.py`), so
a seed gives the same tokens whichever of them runs the sampling.
"""
from __future__ import annotations

import numpy as np
from numba import njit


def scaled_logits(logits: np.ndarray, temperature: float, top_k: int | None = None) -> np.ndarray:
    """logits [..., V] / temperature (> 0) in float64, all but each row's top_k largest set to -inf: what
    sampling's softmax is taken of (token_probs).
    scaled_logits(np.array([1., 3., 2.]), 0.5, 2) -> [-inf, 6., 4.]"""
    z = logits.astype(np.float64) / temperature
    if top_k is not None and 0 < top_k < z.shape[-1]:
        kth = np.partition(z, -top_k, axis=-1)[..., [-top_k]]  # each row's top_k-th largest [..., 1]
        z = np.where(z >= kth, z, -np.inf)
    return z


def token_probs(logits: np.ndarray, temperature: float = 1.0, top_k: int | None = None,
                top_p: float | None = None) -> np.ndarray:
    """logits [V] -> the distribution [V] (float64, sums to 1) that sampling draws from: softmax of
    logits / temperature (> 0), cut to the top_k most likely tokens, then to the smallest set whose
    probability reaches top_p (nucleus), renormalised.

        token_probs(np.log([1., 2., 1.]))            -> [.25, .5, .25]
        token_probs(np.log([1., 2., 1.]), top_k=1)   -> [0., 1., 0.]
        token_probs(np.log([1., 2., 1.]), top_p=.6)  -> [.333, .667, 0.]   (.5 < .6, so the next one joins)
    """
    z = scaled_logits(logits, temperature, top_k)
    p = np.exp(z - z.max())
    p /= p.sum()
    if top_p is not None and top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        cum = np.cumsum(p[order])
        n_keep = int(np.searchsorted(cum, top_p)) + 1  # the first n_keep tokens reach top_p
        keep = np.zeros_like(p, dtype=bool)
        keep[order[:n_keep]] = True
        p = np.where(keep, p, 0.0)
        p /= p.sum()
    return p


def draw_token(p: np.ndarray, rng: np.random.Generator) -> int:
    """One token from the distribution p [V] (inverse CDF, one uniform draw; summed in float64, the dtype
    token_probs gives).  draw_token([0, 1, 0], rng) -> 1"""
    return int(_inverse_cdf(np.asarray(p, dtype=np.float64), rng.random()))


@njit(cache=True)
def _inverse_cdf(p, r):
    """The first i with cdf[i] > r·cdf[-1], cdf = np.cumsum(p) (the same sums, in the same order: the same
    bits), at most len(p) - 1; as np.searchsorted(cdf, r * cdf[-1], side="right") but without the cdf array
    (faster than NumPy's cumsum alone)."""
    total = 0.0
    for i in range(p.shape[0]):
        total += p[i]
    u = r * total
    c = 0.0
    for i in range(p.shape[0]):
        c += p[i]
        if c > u:
            return i
    return p.shape[0] - 1


MIN_TEMPERATURE = 0.01  # the least temperature > 0 sampling takes: below it logits / T overflow float32 (use 0, greedy)


def sample_token(logits: np.ndarray, temperature: float = 1.0, top_k: int | None = None,
                 top_p: float | None = None, rng: np.random.Generator | None = None) -> int:
    """logits [V] -> one token id. temperature 0 is greedy (argmax); top_k keeps the k most likely
    tokens, top_p the smallest set whose probability reaches p (nucleus), both before sampling.

        sample_token(np.array([1.0, 3.0, 2.0]), temperature=0)  -> 1
        sample_token(np.array([1.0, 3.0, 2.0]), top_k=1, rng=np.random.default_rng(0))  -> 1
    """
    if temperature <= 0:
        return int(np.argmax(logits))
    return draw_token(token_probs(logits, temperature, top_k, top_p),
                      rng if rng is not None else np.random.default_rng())



def log_softmax(logits: np.ndarray) -> np.ndarray:
    """[..., V] -> log-probabilities in float64.  log_softmax(np.zeros(2)) -> [-0.693, -0.693]"""
    z = logits.astype(np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def top_logprobs(logp: np.ndarray, k: int) -> list[tuple[int, float]]:
    """The k most likely (id, logprob) of logp [V], most likely first (ties: lower id first); tokens of
    probability 0 (logprob -inf: those a grammar refuses) are left out."""
    if k <= 0:
        return []
    k = min(k, logp.size)
    idx = np.argpartition(-logp, k - 1)[:k]
    idx = idx[np.lexsort((idx, -logp[idx]))]
    return [(int(i), float(logp[i])) for i in idx if logp[i] > -np.inf]


def nll_sum(logits: np.ndarray, targets: np.ndarray) -> float:
    """Summed natural-log loss of targets [T] under logits [T, V], in float64.

        nll_sum(np.zeros((2, 4)), np.array([0, 3])) -> 2·ln 4 = 2.7726"""
    z = logits.astype(np.float64)
    z = z - z.max(-1, keepdims=True)
    lse = np.log(np.exp(z).sum(-1))
    return float((lse - z[np.arange(len(targets)), targets]).sum())
