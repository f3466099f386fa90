"""Causal grouped-query attention: q head h reads kv head h // G, with G = H / Hkv queries per kv head.

Forward, per (batch, kv head, group member): S = q·kᵀ/√hd with the future masked to −∞ (and, with a
sliding window W, the keys more than W − 1 positions back too: query i sees keys i − W + 1 .. i), soft-capped
where a cap is given (Gemma 2: S := cap·tanh(S/cap), softcap.py), P = softmax(S), y = P·v.
Backward: dv = Pᵀ·dy, dP = dy·vᵀ, dS = P ⊙ (dP − rowsum(dP ⊙ P)) (times the cap's 1 − tanh²),
dq = dS·k/√hd, dk = dSᵀ·q/√hd; dk and dv sum over the G query heads that share a kv head.
Grouping is done by reshaping q to [B, Hkv, G, T, hd] so k and v are broadcast, never copied.
"""
from functools import lru_cache

import numpy as np

from .softcap import softcap_backward, softcap_forward


@lru_cache(maxsize=256)
def _causal_mask(Tq, Tk, window=0):
    """True where query i may NOT look at key j: j in the future, or (window W > 0) j <= i − W. Queries are
    the last Tq positions. Memoized (a decoding step asks for the same few shapes again and again), hence
    read-only.  _causal_mask(3, 3, 2) -> [[F, T, T], [F, F, T], [T, F, F]]"""
    mask = np.triu(np.ones((Tq, Tk), dtype=bool), k=Tk - Tq + 1)
    if window:
        mask |= np.tril(np.ones((Tq, Tk), dtype=bool), k=Tk - Tq - window)
    mask.setflags(write=False)
    return mask


def attention_forward(q, k, v, window=0, softcap=0.0):
    """q [B, H, Tq, hd], k/v [B, Hkv, Tk, hd] (Tq <= Tk; queries are the last Tq positions) -> y [B, H, Tq, hd].
    window: each query sees only its last `window` keys (itself included); 0: all earlier keys.
    softcap: the scores' soft cap (0: none)."""
    B, H, Tq, hd = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    G = H // Hkv
    qg = q.reshape(B, Hkv, G, Tq, hd)
    scale = q.dtype.type(1.0 / np.sqrt(hd))
    S = (qg @ k[:, :, None].swapaxes(-1, -2)) * scale  # [B, Hkv, G, Tq, Tk]
    S, cap = softcap_forward(S, softcap)
    S[..., _causal_mask(Tq, Tk, window)] = -np.inf
    S -= S.max(axis=-1, keepdims=True)
    P = np.exp(S)
    P /= P.sum(axis=-1, keepdims=True)
    y = P @ v[:, :, None]  # [B, Hkv, G, Tq, hd]
    return y.reshape(B, H, Tq, hd), (qg, k, v, P, scale, cap)


def attention_backward(dy, cache):
    """dy [B, H, Tq, hd] -> dq [B, H, Tq, hd], dk [B, Hkv, Tk, hd], dv [B, Hkv, Tk, hd]."""
    qg, k, v, P, scale, cap = cache
    B, Hkv, G, Tq, hd = qg.shape
    dyg = dy.reshape(B, Hkv, G, Tq, hd)
    dv = np.sum(P.swapaxes(-1, -2) @ dyg, axis=2)  # [B, Hkv, Tk, hd]
    dP = dyg @ v[:, :, None].swapaxes(-1, -2)  # [B, Hkv, G, Tq, Tk]
    dS = softcap_backward(P * (dP - np.sum(dP * P, axis=-1, keepdims=True)), cap) * scale
    dq = (dS @ k[:, :, None]).reshape(B, Hkv * G, Tq, hd)
    dk = np.sum(dS.swapaxes(-1, -2) @ qg, axis=2)  # [B, Hkv, Tk, hd]
    return dq, dk, dv
