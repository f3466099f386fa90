"""The one step every inference caller runs, and the one place that picks what runs it.

    W = fuse_weights(cfg, P)                       the layout (forward.py); the fused kernels or not
    h = forward_hidden(cfg, W, tokens, cache)      one sequence (or B of equal positions): tokens [B, Tn] -> [B, Tn|1, d]
    logits = head_logits(cfg, W, h)                head 0's logits of hidden states (soft-capped where the model caps)
    h, logits, best = advance(cfg, W, cache, block)   a speculative round: head 0 and its argmax too
    logits = decode_rows(cfg, W, cache, tok, pos)  one token per cache row, each at its own position -> [n, V]

Every architecture runs the same two paths (forward.py's NumPy reference, kernels.py's fused step), each
reading the model's record (arch.py); whether the fused kernels run a model is decided once, when its weights
are laid out (weights.Forms: kernels.ENABLED and a weight type they read), and recorded as W["decode"]. A step on the fused path and on the reference path gives the same logits to float32 rounding
(tests/test_infer_kernels.py).
"""
from __future__ import annotations

import numpy as np

from .. import ops
from ..checkpoint import release_freed_memory
from ..config import Config
from ..errors import UserError
from ..fast.parallel import PARTS, blas_threads
from . import forward, kernels
from .cache import KVCache
from .weights import Forms, batched_linear, linear


def fuse_weights(cfg: Config, P: dict, batched: bool = False) -> dict:
    """The inference layout of a model's parameters P (see forward.fuse_weights): batched keeps [in, out]
    copies for steps of many rows (the batcher). The C heap's freed pages go back to the system first
    (checkpoint.release_freed_memory): the layout is the largest thing a decoding process makes."""
    release_freed_memory()
    return forward.fuse_weights(cfg, P, Forms(P, batched))


def runs_fused(W: dict, cache: KVCache) -> bool:
    """Does the fused step run W on this cache (a new_cache store in float32, see cache.py)?"""
    return "decode" in W and cache.store is not None and cache.store[0].dtype == np.float32


def forward_hidden(cfg: Config, W: dict, inputs: np.ndarray, cache: KVCache, last_only: bool = False) -> np.ndarray:
    """The KV-cache forward up to the final norm: inputs int [B, Tn] at positions cache.length .. +Tn-1
    -> h [B, Tn|1, d]; the cache grows by Tn. One sequence on the fused path goes in blocks of kernels.CHUNK
    tokens (OpenBLAS's threads, once woken by a prompt's matmuls, spin for a while and would take a core from
    the decoding steps after it)."""
    B, Tn = inputs.shape
    L = cache.length
    if L + Tn > cache.max_len:
        raise UserError(f"KV cache overflow: {L} cached + {Tn} new > {cache.max_len} positions")
    if B > 1 or not runs_fused(W, cache):
        return forward.forward_hidden(cfg, W, inputs, cache, last_only)
    k, v, b0 = cache.store
    x = forward.embed(cfg, W, inputs[0], np.arange(L, L + Tn))  # [Tn, d]
    cos, sin = cache.rope.upto(L + Tn)
    hs = [kernels.forward(cfg, W["decode"], x[a:a + kernels.CHUNK], k, v, L + a, cos, sin, last_only, b0)
          for a in range(0, Tn, kernels.CHUNK)]
    cache.length = L + Tn
    return (hs[-1] if last_only else np.concatenate(hs))[None]  # [1, Tn|1, d]


def forward_cached(cfg: Config, P: dict, inputs: np.ndarray, cache: KVCache, last_only: bool = False,
                   fused: dict | None = None) -> np.ndarray:
    """inputs int [B, Tn], the tokens at positions cache.length .. cache.length+Tn-1
    -> logits of every head [K, B, Tn, V] (or [K, B, 1, V] with last_only); the cache grows by Tn.
    fused: fuse_weights(cfg, P), when the caller keeps it across calls."""
    W = fused if fused is not None else fuse_weights(cfg, P)
    h = forward_hidden(cfg, W, inputs, cache, last_only)
    logits = head_logits(cfg, W, h, "heads")  # [B, Tn|1, K·V]
    return logits.reshape(*h.shape[:2], cfg.n_mtp, cfg.vocab_size).transpose(2, 0, 1, 3)  # [K, B, Tn|1, V]


def advance(cfg: Config, W: dict, cache: KVCache, block: list[int]) -> tuple:
    """Feed one sequence's tokens block (1..kernels.ROWS of them) at cache.length.. -> (hidden states [n, d],
    head 0's logits [n, V], their argmax per row as ints): a plain step or a speculative round's verification.
    On the fused path one compiled call (kernels.round_rows); else forward + head 0 + argmax."""
    n, L = len(block), cache.length
    if not runs_fused(W, cache):
        h = forward_hidden(cfg, W, np.asarray(block, dtype=np.int64)[None], cache)[0]  # [n, d]
        logits = head_logits(cfg, W, h)  # [n, V]
        return h, logits, [int(i) for i in np.argmax(logits, axis=-1)]
    k, v, b0 = cache.store
    x = forward.embed(cfg, W, np.array(block, np.int64), np.arange(L, L + n))  # [n, d]
    h, logits, best = kernels.round_rows(cfg, W["decode"], x, np.arange(L, L + n), np.full(n, b0, np.int64), k, v,
                                         *cache.rope.upto(L + n), W["head.0"][2])
    cache.length = L + n
    if cfg.logit_softcap:   # (the cap keeps the order, but float32 may round two logits to one: its argmax)
        logits = capped_logits(cfg, logits)
        best = np.argmax(logits, axis=-1)
    return h, logits, best.tolist()


def decode_rows(cfg: Config, W: dict, cache: KVCache, tokens: np.ndarray, pos: np.ndarray,
                slots: np.ndarray | None = None) -> np.ndarray:
    """One token for each of n cache rows, slots [n] (default rows 0..n-1): tokens int [n] at positions pos [n]
    (row slots[r] holds positions 0..pos[r]-1) -> head 0's logits [n, V]; writes each row's key/value at pos[r].
    Fused: every row attends to its own cache row in one compiled call (no BLAS); else the NumPy
    `forward.forward_rows` on BLAS, every core's threads from WIDE_STEP rows up (fewer rows: one thread, their
    products too short to pay).
    (The fused step does not pay for switching OpenBLAS's thread count, a few µs each way.)"""
    if runs_fused(W, cache):
        k, v, b0 = cache.store
        slots = np.arange(len(tokens)) if slots is None else slots
        h = kernels.forward_rows(cfg, W["decode"], forward.embed(cfg, W, tokens, pos), pos, b0 + slots,
                                 k, v, *cache.rope.upto(int(pos.max()) + 1 if len(pos) else 0))  # [n, d]
        return capped_logits(cfg, kernels.matvec(W["head.0"][2], h, cfg.vocab_size))
    with blas_threads(PARTS if len(tokens) >= WIDE_STEP else 1):
        return capped_logits(cfg, batched_linear(forward.forward_rows(cfg, W, cache, tokens, pos, slots), W["head.0"]))


def head_logits(cfg: Config, W: dict, h: np.ndarray, name: str = "head.0") -> np.ndarray:
    """Hidden states h [..., d] -> head 0's logits [..., V] (name "heads": every head's, [..., K·V]), as the
    model gives them (`capped_logits`)."""
    return capped_logits(cfg, linear(h, W[name]))


def capped_logits(cfg: Config, logits: np.ndarray) -> np.ndarray:
    """The head's logits soft-capped where the model caps them (Gemma 2's logit_softcap; ops/softcap.py)."""
    return ops.softcap_forward(logits, cfg.logit_softcap)[0] if cfg.logit_softcap else logits


WIDE_STEP = 8  # BLAS decoding steps of at least this many rows use every core (see engine.Batcher._loop)
