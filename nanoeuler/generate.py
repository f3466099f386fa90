"""Text generation: a KV-cache forward, sampling, and self-speculative decoding with the MTP heads.

Generation runs the model once over the prompt (prefill), keeping every layer's rotated keys and values
in a cache, then feeds one token at a time: each new token attends to the cached keys/values instead of
recomputing the whole prefix. `forward_cached` is that forward (inference only, no backward caches);
its logits equal `model.forward`'s full recomputation (tests/test_generate.py checks ≤ 1e-5).

Self-speculative decoding uses the K multi-token-prediction heads as a free draft model. At the last
processed position, head 0 gives the next token t1 for certain and heads 1..K-1 guess the tokens after
it, d2..dK. One forward over [t1, d2, .., dK] then verifies every guess with head 0:

    fed:       t1    d2    d3          (K = 3)
    head 0:    a2    a3    a4          a2 == d2?  a3 == d3?  accept the longest agreeing prefix
    d2 == a2, d3 != a3  ->  emit t1, d2; next round starts from certain token a3 (no extra forward)

That is greedy (temperature 0): the output is token for token head 0's greedy output, in fewer forwards.
At temperature > 0 the drafts are sampled from the draft heads' distributions q (same temperature /
top-k / top-p) and verified by the standard accept/reject rule against head 0's distribution p there:

    d2 ~ q2:  accept w.p. min(1, p2(d2) / q2(d2))  ->  then d3 the same way against p3 (from the same forward)
              reject -> the token is drawn from norm(max(p2 - q2, 0)) and the round ends
    all accepted -> the next round's t1 is drawn from head 0 after the last draft (the "bonus" token)

so every emitted token has exactly plain sampling's distribution (`_Sampled`; tests/test_generate.py
checks it by chi-square). The cache is rolled back to the accepted tokens (rejected drafts are simply
overwritten later). Whether to speculate at all, and how many drafts a round verifies (1 .. K-1 from
the heads; greedy rounds up to 7 where the text repeats, see `_Greedy`), is decided by `_Planner` from
the measured acceptance and the measured cost of rounds: a verification forward of a few tokens costs
little more than a 1-token step, but drafts that are rarely accepted still do not pay, and then decoding
is plain KV-cache decoding with a short probe every 128 rounds. A round's model work is one compiled call
(`_round_kernel`: the fused step over [t1, drafts], head 0 and its argmax at every row, and for greedy
decoding the next round's head drafts where the round goes on), so the Python around it is bookkeeping
(on `small`, 1 decode thread, 100 cached positions: ~20 µs a round beside a compiled call of 62 µs for
1 row, 74 for 2, 88 for 3, +4 per head draft; the NumPy head products, argmax and draft softmax around
the forward had cost 30-40 µs).

Context window: the sequence seen by the model is at most ctx_len tokens. When it would grow past that,
the window jumps forward to keep the most recent ctx_len // 2 tokens and the cache is refilled from
them. Every mode (full recomputation, KV cache, speculative) applies the same rule, so their outputs agree.
"""
from __future__ import annotations

import codecs
import time
import weakref
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
from numba import njit

from . import ops
from .config import Config, head_weight
from .errors import UserError
from .fast import decode
from .fast.vmath import vexp

MODES = ("full", "cache", "speculative")


# ---- the KV-cache forward ------------------------------------------------------------------------
# Two implementations of the same step: the NumPy one below (the readable reference, any batch, any
# dtype, both archs) and fast/decode.py's fused numba step, which `forward_hidden` and `linear` take for
# one sequence (plain decoding, speculative verification, prompts) of a
# float32 or float16 euler model. tests/test_decode.py checks that they agree; decode.ENABLED = False
# turns the fused one off.
@dataclass
class KVCache:
    """Rotated keys and values of every layer for the first `length` positions of the window."""
    k: list[np.ndarray]  # per layer [B, Hkv, max_len, hd]
    v: list[np.ndarray]
    cos: np.ndarray      # RoPE tables for positions 0 .. max_len-1, [max_len, hd/2]
    sin: np.ndarray
    length: int = 0
    store: tuple | None = None  # (k, v, b0): arrays [layers, batch, Hkv, max_len, hd] whose rows b0.. are
                                #   k[i], v[i] (new_cache: b0 = 0; serve's batcher: a view of its rows)

    @property
    def max_len(self) -> int:
        return self.k[0].shape[2]


def new_cache(cfg: Config, batch: int = 1, max_len: int | None = None, dtype=np.float32) -> KVCache:
    """An empty cache for up to max_len (default ctx_len) positions. A float16 model computes in float32
    (see fuse_weights), so its cache is float32."""
    max_len = max_len or cfg.ctx_len
    dtype = np.float32 if np.dtype(dtype) == np.float16 else dtype
    shape = (cfg.n_layers, batch, cfg.n_kv_heads, max_len, cfg.head_dim)
    cos, sin = ops.rope_tables(max_len, cfg.head_dim, cfg.rope_theta, dtype)
    k, v = np.zeros(shape, dtype), np.zeros(shape, dtype)
    return KVCache(list(k), list(v), cos, sin, store=(k, v, 0))


def fuse_weights(cfg: Config, P: dict, batched: bool = False) -> dict:
    """Inference layout of the weights: q/k/v stacked into one matrix per layer, gate/up into one, and the K
    heads into one [K·V, d], so a decoding step makes 4 matmuls per layer plus 1 for the heads. Each matrix
    is kept as (W [out, in], W.T made contiguous [in, out] or None, W as fast/decode.py reads it (its panels,
    decode.pack) or None), see `linear`; the copy W.T only where there is no kernel form, or `batched`
    (serve's batcher and the drafts' rollouts read it for more rows than the kernels take);
    W["decode"] holds the fused step's weights (euler models in float32 or float16 while
    decode.ENABLED), each kind of matrix stacked over the layers, and W's per-layer matrices are views of them.

    float16 weights (decode.Float16Model(model); `sample --dtype float16`) decode in float32 arithmetic on
    the weights rounded to float16, as llama.cpp runs an f16 GGUF: the fused step reads the float16 bits
    (half the memory traffic of float32), the NumPy path their float32 values."""
    half = P["embed.weight"].dtype == np.float16
    kernels = decode.ENABLED and (half or P["embed.weight"].dtype == np.float32)

    def f32(a):  # the values the NumPy path computes with
        return decode.widen(a) if half else a

    def kernel_form(a, out=None):  # as the fused kernels read it: panels (decode.pack) of float32 or float16 bits
        return None if not kernels else decode.pack(a.view(np.uint16) if half else a, out)

    def pair(W, Wk=None):
        Wk = Wk if Wk is not None or not kernels else decode.pack(W)
        return W, (np.ascontiguousarray(W.T) if W.shape[0] <= NARROW and (batched or Wk is None) else None), Wk
    if cfg.arch == "gpt2":  # LayerNorm, biases, learned positions, tied head: nanoeuler/gpt2_cached.py
        from . import gpt2_cached
        return gpt2_cached.fuse_weights(cfg, {name: f32(p) for name, p in P.items()}, pair)
    K, V = cfg.n_mtp, cfg.vocab_size
    heads = np.concatenate([head_weight(P, k) for k in range(K)])  # [K·V, d] (tied: head 0 is the embedding)
    heads32 = f32(heads)
    F = {"embed": f32(P["embed.weight"]), "norm": f32(P["norm.weight"]), "heads": pair(heads32, kernel_form(heads))}
    each = kernel_form(heads.reshape(K, V, -1))  # [K, panels, d, PANEL]: head k's kernel form is each[k]
    for k in range(K):  # one head at a time, for decoding (head 0, and drafts only when drafting)
        F[f"head.{k}"] = pair(heads32[k * V:(k + 1) * V], None if each is None else each[k])
    if kernels:  # heads 1..K-1 for speculative rounds' drafts
        F["drafting"] = each[1:]
    layers = [f"layers.{i}." for i in range(cfg.n_layers)]
    mats = {"qkv": [[P[p + "attn.wq.weight"], P[p + "attn.wk.weight"], P[p + "attn.wv.weight"]] for p in layers],
            "gate_up": [[P[p + "ffn.gate.weight"], P[p + "ffn.up.weight"]] for p in layers],  # [2F, d]
            "wo": [[P[p + "attn.wo.weight"]] for p in layers], "down": [[P[p + "ffn.down.weight"]] for p in layers]}
    if kernels:  # one array [layers, out, in] per kind, its rows the parts stacked; their kernel forms
        # [layers, panels, in, PANEL] all in one buffer (one allocation of > 4 MB: NumPy asks the kernel for
        # huge pages, fewer TLB misses per token: big f32 1268 -> 1049 µs a token at 1 thread)
        stacked = {}
        for name, parts in mats.items():
            stacked[name] = S = np.empty((len(layers), sum(p.shape[0] for p in parts[0]), parts[0][0].shape[1]),
                                         P["embed.weight"].dtype)
            for i, ps in enumerate(parts):
                np.concatenate(ps, out=S[i])
        shapes = {name: decode.packed_shape(S.shape) for name, S in stacked.items()}
        buf = np.empty(sum(np.prod(sh) for sh in shapes.values()), np.uint16 if half else np.float32)
        forms, off = {}, 0
        for name, sh in shapes.items():
            forms[name] = kernel_form(stacked[name], buf[off:off + np.prod(sh)].reshape(sh))
            off += np.prod(sh)
    for name, parts in mats.items():
        if kernels:
            S32, Sk = f32(stacked[name]), forms[name]
            mats[name] = [(S32[i], Sk[i]) for i in range(len(layers))]
            F.setdefault("stacks", {})[name] = Sk
        else:
            mats[name] = [(f32(np.concatenate(ps)) if len(ps) > 1 else f32(ps[0]), None) for ps in parts]
    for i, p in enumerate(layers):
        for name in mats:
            F[p + name] = pair(*mats[name][i])
        F[p + "attn_norm"], F[p + "ffn_norm"] = f32(P[p + "attn_norm.weight"]), f32(P[p + "ffn_norm.weight"])
    if kernels:
        st = F.pop("stacks")
        F["decode"] = decode.Weights(F["embed"], st["qkv"], st["wo"], st["gate_up"], st["down"],
                                     np.stack([np.stack([F[p + "attn_norm"], F[p + "ffn_norm"]]) for p in layers]),
                                     F["norm"])
    return F


NARROW = 1024  # output width up to which a [in, out] copy of W is kept for few-row products


def linear(x: np.ndarray, W: tuple) -> np.ndarray:
    """x [..., in] @ W[out, in].T (as ops.linear_forward) with W = fuse_weights' (W, W.T contiguous or None,
    kernel form or None), arranged for the 1..4 rows of a decoding or verification step.

    Up to decode.ROWS float32 rows go to fast/decode.py's matrix-vector kernel when W has a kernel form
    (both cores, float32 or float16 weights; on `big`'s [4096, 384] head 3-4x faster than OpenBLAS's one row).
    Otherwise, OpenBLAS (0.3.31, measured here, one thread) is uneven on such shapes: a 2-row x @ W.T can
    cost 3-10x a 1-row one; 2-3 rows against a contiguous [in, out] copy cost 1.0-1.7x one row while
    out <= 1024 (e.g. [768, 128]: 6.4 µs vs 6.3), but 7x for wide outputs ([2048, 384]: 339 µs vs 46), where
    row-by-row matrix-vector products (exactly n x) are kept. One row also goes through the [in, out] copy
    where there is one (x @ Wt is as fast as W @ x): a plain decoding step and a speculative verification
    then read the same matrices, so alternating between them does not pull the other copy of every weight
    back into the CPU cache (that made a verification after plain steps cost 2x a plain step instead of
    1.2x, measured here on `small`)."""
    W, Wt, Wk = W[0], W[1], (W[2] if len(W) > 2 else None)
    rows = x.reshape(-1, x.shape[-1])
    if Wk is not None and len(rows) <= decode.ROWS and rows.dtype == np.float32:
        y = decode.matvec(Wk, rows, W.shape[0])
    elif len(rows) <= 4 and Wt is not None:
        y = rows @ Wt
    elif len(rows) == 1:
        y = (W @ rows[0])[None]
    elif len(rows) <= 4:
        y = np.stack([W @ r for r in rows])
    else:
        y = ops.linear_forward(rows, W)[0]
    return y.reshape(*x.shape[:-1], W.shape[0])


def forward_cached(cfg: Config, P: dict, inputs: np.ndarray, cache: KVCache, last_only: bool = False,
                   fused: dict | None = None) -> np.ndarray:
    """inputs int [B, Tn], the tokens at positions cache.length .. cache.length+Tn-1
    -> logits [K, B, Tn, V] (or [K, B, 1, V] with last_only); the cache grows by Tn.
    fused: fuse_weights(cfg, P), when the caller keeps it across calls."""
    W = fused if fused is not None else fuse_weights(cfg, P)
    h = forward_hidden(cfg, W, inputs, cache, last_only)
    logits = linear(h, W["heads"])  # [B, Tn|1, K·V]
    return logits.reshape(*h.shape[:2], cfg.n_mtp, cfg.vocab_size).transpose(2, 0, 1, 3)  # [K, B, Tn|1, V]


def forward_hidden(cfg: Config, W: dict, inputs: np.ndarray, cache: KVCache, last_only: bool = False) -> np.ndarray:
    """The KV-cache forward up to the final RMSNorm: inputs int [B, Tn] -> h [B, Tn|1, d] (W = fuse_weights).
    One sequence in a new_cache cache runs fast/decode.py's fused step (a prompt in blocks of decode.CHUNK
    tokens; OpenBLAS's threads, once woken by a prompt's matmuls, spin for a while and took a core from
    the decoding steps after it: 1.37 ms a token instead of 0.91 on `big`)."""
    if cfg.arch == "gpt2":
        from . import gpt2_cached
        return gpt2_cached.forward_hidden(cfg, W, inputs, cache, linear, last_only)
    B, Tn = inputs.shape
    L = cache.length
    if L + Tn > cache.max_len:
        raise UserError(f"KV cache overflow: {L} cached + {Tn} new > {cache.max_len} positions")
    if "decode" in W and B == 1 and cache.store is not None and cache.store[0].dtype == np.float32:
        k, v, b0 = cache.store  # a prompt goes in blocks of decode.CHUNK tokens: no BLAS call during decoding
        hs = [decode.forward(cfg, W["decode"], inputs[0, a:a + decode.CHUNK], k, v, L + a, cache.cos, cache.sin,
                             last_only, b0) for a in range(0, Tn, decode.CHUNK)]
        cache.length = L + Tn
        return (hs[-1] if last_only else np.concatenate(hs))[None]  # [1, Tn|1, d]
    H, Hkv, hd, F = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_hidden
    cos, sin = cache.cos[L:L + Tn], cache.sin[L:L + Tn]  # [Tn, hd/2]
    x = W["embed"][inputs]  # [B, Tn, d]
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        h, _ = ops.rmsnorm_forward(x, W[p + "attn_norm"], cfg.norm_eps)
        qkv = linear(h, W[p + "qkv"])  # [B, Tn, (H + 2·Hkv)·hd]
        q = qkv[..., :H * hd].reshape(B, Tn, H, hd).transpose(0, 2, 1, 3)  # [B, H, Tn, hd]
        k = qkv[..., H * hd:(H + Hkv) * hd].reshape(B, Tn, Hkv, hd).transpose(0, 2, 1, 3)  # [B, Hkv, Tn, hd]
        v = qkv[..., (H + Hkv) * hd:].reshape(B, Tn, Hkv, hd).transpose(0, 2, 1, 3)
        q, _ = ops.rope_forward(q, cos, sin)
        k, _ = ops.rope_forward(k, cos, sin)
        cache.k[i][:, :, L:L + Tn] = k
        cache.v[i][:, :, L:L + Tn] = v
        a, _ = ops.attention_forward(q, cache.k[i][:, :, :L + Tn], cache.v[i][:, :, :L + Tn])  # [B, H, Tn, hd]
        x = x + linear(a.transpose(0, 2, 1, 3).reshape(B, Tn, H * hd), W[p + "wo"])
        h2, _ = ops.rmsnorm_forward(x, W[p + "ffn_norm"], cfg.norm_eps)
        gu = linear(h2, W[p + "gate_up"])  # [B, Tn, 2F]
        s, _ = ops.swiglu_forward(gu[..., :F], gu[..., F:])
        x = x + linear(s, W[p + "down"])
    cache.length = L + Tn
    if last_only:
        x = x[:, -1:]
    return ops.rmsnorm_forward(x, W["norm"], cfg.norm_eps)[0]


# ---- sampling ------------------------------------------------------------------------------------
def scaled_logits(logits: np.ndarray, temperature: float, top_k: int | None = None) -> np.ndarray:
    """logits [..., V] / temperature (> 0) in float64, all but each row's top_k largest set to -inf: what
    sampling's softmax is taken of (token_probs; drafts.py on many rows at once).
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
    (V 4096: 5 µs, NumPy's cumsum alone 15)."""
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


# ---- the generation loop -------------------------------------------------------------------------
@dataclass
class Generation:
    """What `generate` returns: the new ids (without the stop token) and how they were made."""
    ids: list[int]
    stopped: bool = False          # ended on a stop token (rather than max_new_tokens)
    forwards: int = 0              # model calls, prefill included
    drafted: int = 0               # speculative: draft tokens proposed by heads 1..K-1 and verified
    accepted: int = 0              # speculative: draft tokens the verification accepted
    draft_rounds: int = 0          # speculative: rounds that verified drafts (the others were plain steps)
    jumps: int = 0                 # times the window jumped forward (and the cache was refilled)
    prefill_s: float = 0.0
    decode_s: float = 0.0          # wall time after the prefill
    decode_cpu_s: float = 0.0      # the process's CPU time over the same span (robust on a loaded machine)

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_s(self) -> float:
        n = len(self.ids) + self.stopped
        return n / self.decode_s if self.decode_s > 0 else float("inf")


class _Window:
    """The tokens the model sees: seq[start:], at most ctx_len; jumps to the last ctx_len // 2 when full.
    Keeps the final hidden state h [d] of the last position; `head(k)` turns it into head k's logits [V]
    on demand (plain decoding only ever needs head 0)."""

    def __init__(self, model, seq: list[int], mode: str, fused: dict | None = None):
        self.cfg, self.P = model.config, model.params
        self.mode, self.seq, self.forwards, self.jumps = mode, seq, 0, 0
        self.start = max(0, len(seq) - self.cfg.ctx_len)
        self.want_draft = 0  # `feed` makes the greedy drafts of heads 1..want_draft too (see `advance`)
        self._head_drafts = None  # (row, drafts) the last `advance` made, for `keep`
        self.cache = new_cache(self.cfg, 1, dtype=model.dtype)
        self.W = fused if fused is not None else fuse_weights(self.cfg, self.P)
        self._refill()

    def _set(self, h: np.ndarray, head0: np.ndarray | None = None, best: int | None = None) -> None:
        self.h, self._heads, self.best = h, {} if head0 is None else {0: head0}, best  # best: head 0's argmax
        self.head_drafts = None  # [(head k's argmax, its probability), k = 1..K-1] at the last position (`advance`)

    def head(self, k: int) -> np.ndarray:
        """Logits [V] of head k at the last position."""
        if k not in self._heads:
            self._heads[k] = linear(self.h, self.W[f"head.{k}"])
        return self._heads[k]

    def _forward(self, tokens, last_only: bool) -> np.ndarray:
        self.forwards += 1
        return forward_hidden(self.cfg, self.W, np.asarray(tokens, dtype=np.int64)[None], self.cache, last_only)[0]

    def _refill(self) -> None:
        """Recompute the cache (and the last position's hidden state) from seq[start:]."""
        self.cache.length = 0
        self._set(self._forward(self.seq[self.start:], True)[0])

    def room(self) -> int:
        """Positions left before the window must jump."""
        return self.cfg.ctx_len - (len(self.seq) - self.start)

    def push(self, token: int) -> None:
        """Append one token and run the model on it."""
        self.seq.append(token)
        if len(self.seq) - self.start > self.cfg.ctx_len:
            self.start = len(self.seq) - self.cfg.ctx_len // 2
            self.jumps += 1
            self._refill()
        elif self.mode == "full":
            self._refill()
        else:
            self._set(self._forward([token], True)[0])

    def fast(self) -> bool:
        """Can rounds take `_round_kernel` (an euler model on the fused step, with a kernel form of head 0)?"""
        if not hasattr(self, "_fast"):
            self._fast = (self.cfg.arch != "gpt2" and "decode" in self.W and self.W["head.0"][2] is not None
                          and self.cfg.n_mtp <= decode.ROWS
                          and self.cache.store is not None and self.cache.store[0].dtype == np.float32)
            self._slot = np.full(decode.ROWS, self.cache.store[2] if self._fast else 0, np.int64)
            self._pos = np.arange(self.cache.max_len, dtype=np.int64)
            self._drafting = self.W["drafting"] if self._fast else None  # heads 1..K-1
        return self._fast

    def advance(self, block: list[int], draft: int = 0) -> tuple[np.ndarray, np.ndarray, list[int]]:
        """Feed tokens block (1 <= len(block) <= min(room(), decode.ROWS)) in one call -> (hidden states
        [n, d], head-0 logits [n, V], head 0's argmax at each row, as ints). A speculative round's work in
        one compiled call (`_round_kernel`) where the model allows, else forward + head 0 + argmax; the
        call also makes the greedy drafts of heads 1..draft where a greedy round goes on (`head_drafts`).
        The caller rolls back with `keep` (a plain step keeps everything: nothing to do)."""
        self.forwards += 1
        n, L = len(block), self.cache.length
        if self.fast():
            k, v, _ = self.cache.store
            D, pool = self.W["decode"], decode._POOL
            pooled = pool.acquire()
            try:
                h, logits, best, row, t, conf = _round_kernel(
                    pool.ctl, pooled, np.array(block, np.int64), self._pos[L:L + n], self._slot[:n], D.embed, D.qkv,
                    D.wo, D.gate_up, D.down, D.norms, D.norm, np.float32(self.cfg.norm_eps), self.cfg.n_heads, k, v,
                    self.cache.cos, self.cache.sin, self.W["head.0"][2], self._drafting, int(draft))
            finally:
                if pooled:
                    pool.release()
            self.cache.length = L + n
            best = best.tolist()
            self._head_drafts = (row, list(zip(t.tolist(), conf.tolist()))) if draft else None
        else:
            h = forward_hidden(self.cfg, self.W, np.asarray(block, dtype=np.int64)[None], self.cache)[0]
            logits = linear(h, self.W["head.0"])
            best = [int(i) for i in np.argmax(logits, axis=-1)]
            self._head_drafts = None
        self.seq.extend(block)
        self.h, self._heads, self.best = h[-1], {0: logits[-1]}, best[-1]
        made = self._head_drafts
        self.head_drafts = made[1] if made is not None and made[0] == n - 1 else None
        return h, logits, best

    def make_head_drafts(self, n: int) -> None:
        """head_drafts of heads 1..n at the last position, in one compiled call (fast path only)."""
        pool = decode._POOL
        pooled = pool.acquire()
        try:
            x = np.ascontiguousarray(self.h[None], dtype=np.float32)
            t, conf = _drafts(pool.ctl, pooled, self._drafting, x, self.cfg.vocab_size, n)
        finally:
            if pooled:
                pool.release()
        self.head_drafts = list(zip(t.tolist(), conf.tolist()))

    def feed(self, token: int) -> None:
        """A plain step of speculative decoding: `advance` by one token, or `push` where the window jumps."""
        if self.room() >= 1:
            self.advance([token], self.want_draft)
        else:
            self.push(token)

    def keep(self, n_total: int, h: np.ndarray, head0: np.ndarray, best: int | None = None, row: int = -1) -> None:
        """Roll back seq and cache to n_total tokens of the window; h [d] and head0 [V] are the outputs there
        (best: head0's argmax, when known; row: which row of the last `advance` they are)."""
        drop = (len(self.seq) - self.start) - n_total
        if drop:
            del self.seq[len(self.seq) - drop:]
        self.cache.length = n_total
        self._set(h, head0, best)
        made = self._head_drafts
        self.head_drafts = made[1] if made is not None and made[0] == row else None


@njit(**decode.OPTS)
def _round_kernel(ctl, pooled, tokens, pos, slot, embed, qkv, wo, gate_up, down, norms, norm, eps, n_heads, kc, vc,
                  cos, sin, head0, heads, draft):
    """A speculative round's model work in one compiled call: decode.step over tokens [n] (hidden states
    h [n, d], all rows), head 0's logits [n, V] and their argmax [n] (the same kernels as a plain step's
    forward_hidden + linear + argmax, so the same numbers); then the greedy drafts for the next round:
    the argmax of each of the first `draft` draft heads (heads: heads 1..K-1, [K-1] kernel forms) and its
    probability at row n_ok, the first row whose argmax differs from the token fed after it (the last row
    when all agree): where a greedy round continues.

        tokens [t1, d2], best [d2, a3]  ->  n_ok = 1: heads 1, 2 at row 1 draft the tokens after a3
    -> (h, logits, best, n_ok, draft tokens [draft], their probabilities [draft])."""
    h = decode.step(ctl, pooled, tokens, pos, slot, embed, qkv, wo, gate_up, down, norms, norm, eps, n_heads, kc, vc,
                    cos, sin, False)
    n, V = h.shape[0], embed.shape[0]
    logits = np.empty((n, V), np.float32)
    decode._gemv(ctl, pooled, head0, h, logits, False)
    best = np.empty(n, np.int64)
    for r in range(n):
        best[r] = np.argmax(logits[r])
    n_ok = 0
    while n_ok < n - 1 and best[n_ok] == tokens[n_ok + 1]:
        n_ok += 1
    tok, conf = _drafts(ctl, pooled, heads, h[n_ok:n_ok + 1], V, min(draft, heads.shape[0]))
    return h, logits, best, n_ok, tok, conf


@njit(**decode.OPTS)
def _drafts(ctl, pooled, heads, x, V, nd):
    """The greedy drafts of heads 1..nd at one hidden state x [1, d] (heads: the kernel forms of heads
    1..K-1, V outputs each) -> (each one's argmax [nd], its softmax probability [nd])."""
    tok, conf = np.empty(nd, np.int64), np.empty(nd, np.float64)
    logits = np.empty((nd, V), np.float32)
    for k in range(nd):
        decode._gemv(ctl, pooled, heads[k], x, logits[k:k + 1], False)
        lk = logits[k]
        t = np.argmax(lk)
        z = np.float32(0.0)
        for i in range(V):  # (vexp: vectorised; a libm exp per logit was ~40 % of this head's cost)
            z += vexp(lk[i] - lk[t])
        tok[k], conf[k] = t, 1.0 / z
    return tok, conf


def generate(model, prompt_ids: Sequence[int], max_new_tokens: int = 128, temperature: float = 1.0,
             top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
             stop_ids: Sequence[int] = (), mode: str = "cache",
             on_token: Callable[[int], None] | None = None, spec_depth: int | None = None,
             fused: dict | None = None) -> Generation:
    """Continue prompt_ids with up to max_new_tokens tokens, stopping after any of stop_ids.

    mode: "cache" (KV cache, one token per forward), "full" (recompute the whole window every token:
    the slow reference) or "speculative" (MTP drafts verified by head 0: at temperature 0 the same tokens
    as greedy "cache"; at temperature > 0 samples from exactly the same distribution as "cache", though
    not the same tokens for a seed). on_token(id) is called for each new token as soon as it is known
    (streaming). spec_depth fixes how many drafts each speculative round verifies (default: adaptive, see
    `_Planner`; for tests and benchmarks). fused: fuse_weights(model.config, model.params), when the caller
    keeps it across calls of an unchanged model (a chat session, an evaluation over many prompts: on `gpt`
    fusing costs ~0.4 s a call).
    """
    if mode not in MODES:
        raise UserError(f"unknown generation mode {mode!r}; choose one of {', '.join(MODES)}")
    if not len(prompt_ids):
        raise UserError("the prompt is empty: give at least one token")
    V = model.config.vocab_size
    if min(prompt_ids) < 0 or max(prompt_ids) >= V:
        raise UserError(f"prompt token id out of range [0, {V})")
    if max_new_tokens < 0:
        raise UserError("max_new_tokens must be >= 0")
    if not (temperature >= 0 and np.isfinite(temperature)) or (top_p is not None and not 0 < top_p <= 1) \
            or (top_k is not None and top_k < 0):
        raise UserError("need a finite temperature >= 0, top_k >= 0 and 0 < top_p <= 1")
    if spec_depth is not None and spec_depth < 0:
        raise UserError("spec_depth must be >= 0")
    rng = np.random.default_rng(seed)
    stop = set(int(s) for s in stop_ids)
    out = Generation([])
    t0 = time.perf_counter()
    win = _Window(model, [int(t) for t in prompt_ids], mode, fused)
    out.prefill_s = time.perf_counter() - t0
    cpu0 = time.process_time()  # (a system call, which on a busy machine may yield: outside the wall time)
    t0 = time.perf_counter()

    def emit(token: int) -> bool:
        """Record a new token; True when generation must end."""
        if token in stop:
            out.stopped = True
            if on_token:
                on_token(token)
            return True
        out.ids.append(token)
        if on_token:
            on_token(token)
        return len(out.ids) >= max_new_tokens

    if max_new_tokens > 0:
        if mode == "speculative" and model.config.n_mtp > 1:
            rule = _Greedy() if temperature == 0 else _Sampled(temperature, top_k, top_p, rng)
            _speculate(win, rule, emit, out, spec_depth, _planner(model, (temperature, top_k, top_p)))
        else:
            while True:
                token = sample_token(win.head(0), temperature, top_k, top_p, rng)
                if emit(token):
                    break
                win.push(token)
    out.decode_s = time.perf_counter() - t0
    out.decode_cpu_s = time.process_time() - cpu0
    out.forwards, out.jumps = win.forwards, win.jumps
    return out


# ---- speculation: verification rules, the planner, the loop --------------------------------------
class _Greedy:
    """Temperature 0: a draft is accepted when it is head 0's argmax; on a miss, head 0's argmax is the next
    token. Drafts come from the text itself where it repeats (prompt lookup), else from the draft heads:
    when the last NGRAM tokens, t1 included, occurred before in the sequence, the tokens that followed them
    there are drafts 1, 2, .. (as many as one verification takes, decode.ROWS - 1: a lookup is not bound
    to the K - 1 draft heads); else drafts 1..K-1 are the draft heads' argmax. Any draft keeps the output
    exact (a draft only ever saves a forward), so the source is chosen for acceptance alone: on the
    default-trained `small` (distilled heads, 1000-token greedy generations) the heads' drafts were accepted
    78.5 %, lookup drafts 90 % where the 3 tokens had occurred (69 % of the rounds), the two together 83 %.

        seq ... 7 3 9 4 5 ... 2 7 3,  t1 = 9:  (7, 3, 9) occurred, followed by 4 5 ..  ->  drafts 4, 5, ..

    Where the occurrence is recent, the text is in a loop: the copy runs on into the round's own tokens
    (t1, then the drafts themselves), so that a loop of period P drafts a whole round, not P - 1 tokens:

        seq ... 5 7 3 8 0 2 7 3,  t1 = 8:  (7, 3, 8) occurred 5 back  ->  drafts 0 2 7 3 8 0 2

    Confidence (the planner's bin): LOOKUP_CONF for a lookup draft, else the draft head's softmax
    probability of its draft."""

    NGRAM = 3
    LOOKUP_CONF = 0.95

    def __init__(self):
        self.index: dict = {}  # NGRAM tokens -> the position after their last occurrence in the sequence
        self.indexed = 0       # positions of the sequence indexed so far
        self.cont: list = []   # this round's lookup drafts

    def prepare(self, win: "_Window", t1: int) -> None:
        """A round begins: t1 is its certain token (not yet in the sequence)."""
        self.t1 = t1

    def lookup(self, win: "_Window") -> list[int]:
        """Index the tokens added since the last lookup, then -> the tokens that followed the last occurrence
        of (the last NGRAM-1 tokens, t1), continued periodically past the end (see the class), at most
        decode.ROWS - 1 of them (or []). Drafts are rolled back before a lookup ever indexes them, so the
        index holds only tokens that stay."""
        seq, n, index, most = win.seq, self.NGRAM, self.index, decode.ROWS - 1
        for p in range(max(self.indexed, win.start + n), len(seq)):
            index[tuple(seq[p - n:p])] = p
        self.indexed = len(seq)
        p = index.get((*seq[len(seq) - n + 1:], self.t1))
        if p is None:
            return []
        if len(seq) - p >= most:
            return seq[p:p + most]
        loop = seq[p:] + [self.t1]  # what followed the occurrence, up to this round: one period
        return [loop[i % len(loop)] for i in range(most)]

    def propose_draft(self, win: "_Window", j: int) -> tuple[int, float] | None:
        """Draft j+1 (j = 0, 1, ..: asked in this order) of this round and its confidence, or None: no lookup
        draft that far and j + 1 >= K (no head drafts it)."""
        if j == 0:
            self.cont = self.lookup(win)
        if j < len(self.cont):
            return self.cont[j], self.LOOKUP_CONF
        if j >= win.cfg.n_mtp - 1:
            return None
        if (win.head_drafts is None or j >= len(win.head_drafts)) and win.fast():
            win.make_head_drafts(j + 1)  # (the last round's compiled call did not: a lookup round, a jump)
        if win.head_drafts is not None and j < len(win.head_drafts):
            return win.head_drafts[j]
        return self.propose(win.head(j + 1))

    def next(self, win: "_Window") -> int:
        """The token after the window: head 0's argmax (known already after `advance`)."""
        return win.best if win.best is not None else int(np.argmax(win.head(0)))

    def accept(self, logits: np.ndarray, best: list[int], drafts: list[int], props: list, plan) -> tuple[int, None]:
        """-> (drafts accepted, None): the next token is then head 0's argmax after them, best[n_ok]."""
        n_ok = 0
        for j, x in enumerate(drafts):
            ok = best[j] == x
            if plan is not None:
                plan.observe(j, props[j][1], 1.0 if ok else 0.0)
            if not ok:
                break
            n_ok += 1
        return n_ok, None

    def propose(self, logits: np.ndarray) -> tuple[int, float]:
        t = int(np.argmax(logits))
        return t, 1.0 / float(np.exp(logits - logits[t]).sum())

    def draft(self, q: int) -> int:
        return q


class _Sampled:
    """Temperature > 0: the standard speculative-sampling rule. p is head 0's distribution at a position
    and q the draft head's (both through token_probs with the same temperature / top-k / top-p); the
    draft x ~ q is accepted with probability min(1, p(x) / q(x)), else the token is drawn from the
    residual norm(max(p - q, 0)). Either way the token is distributed exactly as p:
    P(x) = q(x)·min(1, p/q) + (1 - Σ min(p, q))·max(p - q, 0)(x) / Σ max(p - q, 0) = min(p, q) + max(p - q, 0) = p(x).

        p = [.6, .4], q = [.9, .1]:  x=0 accepted w.p. 2/3, x=1 always; reject -> residual [0, 1]
        P(0) = .9·2/3 = .6,  P(1) = .1 + .9·1/3 = .4
    Confidence: q's largest probability. The acceptance observed for the planner is Σ min(p, q), the
    exact acceptance probability of that draft (less noisy than the coin flip)."""

    def __init__(self, temperature: float, top_k: int | None, top_p: float | None, rng: np.random.Generator):
        self.temperature, self.top_k, self.top_p, self.rng = temperature, top_k, top_p, rng

    def probs(self, logits: np.ndarray) -> np.ndarray:
        return token_probs(logits, self.temperature, self.top_k, self.top_p)

    def prepare(self, win: "_Window", t1: int) -> None:
        pass  # sampled drafts come from the draft heads only

    def propose_draft(self, win: "_Window", j: int) -> tuple[np.ndarray, float]:
        return self.propose(win.head(j + 1))

    def pick(self, logits: np.ndarray) -> int:
        return draw_token(self.probs(logits), self.rng)

    def next(self, win: "_Window") -> int:
        return self.pick(win.head(0))

    def accept(self, logits: np.ndarray, best: list[int], drafts: list[int], props: list,
               plan) -> tuple[int, int | None]:
        """-> (drafts accepted, the token drawn at the first rejection or None)."""
        for j, x in enumerate(drafts):
            ok, p_accept, forced = self.check(logits[j], x, props[j][0])
            if plan is not None:
                plan.observe(j, props[j][1], p_accept)
            if not ok:
                return j, forced
        return len(drafts), None

    def propose(self, logits: np.ndarray) -> tuple[np.ndarray, float]:
        q = self.probs(logits)
        return q, float(q.max())

    def draft(self, q: np.ndarray) -> int:
        return draw_token(q, self.rng)

    def check(self, logits: np.ndarray, x: int, q: np.ndarray) -> tuple[bool, float, int | None]:
        p = self.probs(logits)
        rate = float(np.minimum(p, q).sum())
        if self.rng.random() * q[x] < p[x]:  # accept with probability min(1, p(x) / q(x))
            return True, rate, None
        return False, rate, draw_token(self.residual(p, q), self.rng)

    @staticmethod
    def residual(p: np.ndarray, q: np.ndarray) -> np.ndarray:
        """norm(max(p - q, 0)): where a rejected token comes from.  residual([.6, .4], [.9, .1]) -> [0, 1]"""
        r = np.maximum(p - q, 0.0)
        s = r.sum()
        return r / s if s > 0 else p  # s == 0 only when p == q, where nothing is ever rejected


class _Planner:
    """Decides whether to speculate at all, and how many drafts each round verifies, from measured
    acceptance and measured cost, so that speculation is used only where it pays.

    Cost: cost[w][d] is the CPU time of this thread (time.thread_time) in a round that verifies d drafts
    (drafting, the forward of d+1 tokens, the checks, emitting; d = 0 is a plain step), w = whether the
    round before it verified drafts too, as the median of its last 31 samples. CPU time, not wall time: on
    a machine shared with other processes a round's wall time mostly measures the scheduler (one round in
    five lost the core for ~20 ms; with 2 helpers' jobs on 2 cores, wall-time tables put a verification at
    1.2-2.3x a plain step from one call to the next, thread CPU time at 1.24-1.42x). The median, not a lower
    quartile: CPU time is not inflated by preemption, and a verification's cost varies more than a plain
    step's (a rejected sampled draft adds the residual's draw), so a lower quartile favoured speculation
    (measured on because of it at 0.91x, sampling on the default-trained small). The two tables differ: on `small`
    here a lone verification among plain steps cost 1.6-1.75x a plain step, one after another only 1.2-1.3x
    (the verification's code and data are no longer in the CPU caches). So the planner works in two regimes
    rather than round by round (mixing them paid the lone price for every draft, and lost):

        off: plain steps; at round 8, then `probe_every` rounds later, then twice as far each time up to
             8 x probe_every while the regime stays off (rounds counted over all calls sharing the
             planner), a burst of 3 rounds verifying 1 draft each (draft 1's rate and the back-to-back
             cost stay fresh). A lone verification among plain steps costs 2-4x a plain step (cold
             caches), so a probe every 128 rounds cost ~3 % of plain decoding where drafts never pay;
             backing off makes it < 1 %. Only while draft 1's average acceptance is below BACKOFF: drafts
             that are often right are near paying, and one burst measures costs roughly (the default-
             trained small with distilled heads stayed off for 1000s of rounds after one unlucky burst);
             their bursts are 3x as long (more back-to-back rounds timed, after the first colder ones)
        on:  every round verifies 1..D drafts, the depth with the best worth for this round's drafts;
             every `probe_every`-th round a burst of 3 plain steps (the plain cost stays fresh)

    Worth of a round verifying d drafts: E(d) / cost[1][d] tokens per second, E(d) = 1 + r1 + r1·r2 + ...
    the expected tokens it emits. The regime is `on` while the best worth with the drafts' average
    acceptance beats a plain step (cost[0][0]) by 15 %, decided again every 8 rounds (with 5 % it was on
    at 30 % acceptance on the `make demo` model and measured 0.93-0.99x: costs and rates measured on a
    busy machine err, and plain decoding is the safe side); once on, greedy decoding stays on while that
    worth beats a plain step by 5 % (STAY: with one margin, a model at its edge flapped, paying a lone
    probe's cost at every switch; sampling keeps MARGIN, see `_planner`):

        cost = 1.0 ms plain, 1.2 / 1.45 ms for 1 / 2 drafts back to back
        r1 = .5, r2 = .3:  worth 1.5/1.2 = 1.25, 1.65/1.45 = 1.14  > 1.15/1.0  -> on, mostly 1 draft
        r1 = .3:           worth 1.3/1.2 = 1.08                    < 1.15      -> off

    Within `on`, the depth follows how sure the draft heads are: rate(j, conf) estimates P(draft j+1
    accepted | the drafts before it accepted) for a draft whose head is `conf` sure of it (4 confidence
    bins, priors .15/.45/.72/.92, a memory of ~30 observations per bin; greedy lookups go past the K-1
    heads, to D = decode.ROWS - 1, and drafts past the last head share its row: a deep row of its own,
    once unlucky, was never tried again, and its rate stuck low); drafts are proposed one by one
    while each adds 5 % of worth (a draft that could not add that even if sure to be accepted is not even
    computed: its head's matrix product is ~5 % of a `small` step). An unmeasured cost is taken from the
    other table, else extrapolated (+25 % of a plain step per draft), and never counts as less than
    1 + 0.1·d plain steps. A planner lives as long as its model,
    one per sampling setting (`_planner`), so a chat's short replies do not each start from the priors.
    Which drafts are verified never changes the output (greedy) or its distribution (sampling); at
    temperature > 0 it changes which random numbers are drawn, so a seed reproduces speculative samples
    only with a fixed depth (generate's spec_depth)."""

    PRIOR = (0.15, 0.45, 0.72, 0.92)
    MARGIN = 1.15   # worth needed over a plain step to speculate (costs measured on a busy machine are noisy)
    STAY = 1.05     # .. and to go on speculating once on (one margin only flapped at its edge, paying probes)
    BURST = 3       # rounds of a probe
    BACKOFF = 0.5   # draft 1's average acceptance below which probes come ever later while off

    def __init__(self, max_depth: int, memory: float = 0.97, stay: float | None = None, rows: int | None = None):
        # plain Python floats throughout: this runs every round, where a numpy call on 4 numbers costs more
        # than the arithmetic (it was 5 % of a `small` decoding step)
        self.D, self.memory = max_depth, memory
        self.stay = self.STAY if stay is None else stay  # the margin to stay on (sampling: MARGIN, see _planner)
        R = self.R = min(max_depth, rows or max_depth)  # rate rows: draft j+1 is judged by row min(j, R - 1)
        self.hits = [list(self.PRIOR) for _ in range(R)]    # [R][bins] decayed sums of acceptance
        self.seen = [[1.0] * len(self.PRIOR) for _ in range(R)]  # [R][bins] decayed counts
        self.avg = [[0.3, 1.0] for _ in range(R)]           # [R] (decayed sum, count) over all bins
        self.cost = [[None] * (max_depth + 1) for _ in range(2)]    # [after a plain / a draft round][d] seconds
        self.samples = [[[] for _ in range(max_depth + 1)] for _ in range(2)]  # the last 31 of each
        self.on, self.recheck, self.burst, self.plain = False, 0, 0, 0
        self.next_probe, self.gap = 8, 0  # the round of the next probe, and the last gap between probes
        self.n_timed = 0  # rounds timed
        self.rounds = 0  # rounds decided, over all the calls that share this planner (the probe clock)
        self.looked = 1.0  # decayed average of the drafts proposed a round (choose): the head drafts to make

    def _bin(self, conf: float) -> int:
        return (conf >= 0.3) + (conf >= 0.6) + (conf >= 0.85)

    def rate(self, j: int, conf: float) -> float:
        b, r = self._bin(conf), min(j, self.R - 1)
        return self.hits[r][b] / self.seen[r][b]

    def observe(self, j: int, conf: float, accepted: float) -> None:
        """Draft j+1 (confidence conf) was verified; accepted: 0/1, or its acceptance probability."""
        j = min(j, self.R - 1)
        b, m, hits, seen = self._bin(conf), self.memory, self.hits[j], self.seen[j]
        hits[b] = hits[b] * m + accepted  # only this bin ages: a memory of ~30 of its own observations
        seen[b] = seen[b] * m + 1
        a = self.avg[j]
        a[0], a[1] = a[0] * m + accepted, a[1] * m + 1

    def timed(self, w: int, d: int, seconds: float) -> None:
        """A round of depth d (after a round that drafted: w = 1) took `seconds`."""
        last = self.samples[w][d]
        last.append(seconds)
        if len(last) > 31:
            del last[0]
        self.n_timed += 1
        if len(last) < 16 or self.n_timed % 4 == 0:  # a sort every round was ~2 % of a round
            self._cost[w][d] = sorted(last)[len(last) // 2]
            self._c.clear()

    @property
    def cost(self) -> list:
        """[after a plain round / a draft round][depth d] -> seconds (median), or None while unmeasured."""
        return self._cost

    @cost.setter
    def cost(self, table: list) -> None:
        self._cost, self._c = table, {}

    def c(self, w: int, d: int) -> float:
        """Cost of a round of depth d after a round that drafted (w = 1) or not; at least 1 + 0.1·d plain steps.
        (Remembered until the next median: it is asked several times a round.)"""
        key = (w, d)
        if key not in self._c:
            self._c[key] = self._c_of(w, d)
        return self._c[key]

    def _c_of(self, w: int, d: int) -> float:
        for table in (self.cost[w], self.cost[1 - w]):
            if table[d] is not None:
                return table[d] if d == 0 else max(table[d], self.c(w, 0) * (1 + 0.1 * d))
        return self.c(w, 0) * (1 + 0.25 * d)

    def pays(self) -> bool:
        """Does speculating, round after round, beat plain steps (by MARGIN) at the average acceptance? Not
        before 5 plain steps are timed (a first plain step that lost the CPU for 20 ms once made every
        verification look cheap). Counts the depths the draft heads reach only (the rate rows): deeper
        lookups come now and then, and are a bonus on top."""
        if len(self.samples[0][0]) < 5:
            return False
        expected, chance, best = 1.0, 1.0, 0.0
        for j in range(self.R):
            a = self.avg[j]
            chance *= a[0] / a[1]
            expected += chance
            best = max(best, expected / self.c(1, j + 1))
        return best > (self.stay if self.on else self.MARGIN) / self.c(0, 0)

    def choose(self, win: _Window, rule, room: int, probe: bool) -> tuple[list, int]:
        """-> (proposals [(q, conf)] of drafts 1, 2, .., depth): the drafts to verify this round."""
        D = min(self.D, room)
        if D == 0 or (self.cost[0][0] is None and self.cost[1][0] is None):
            return [], 0  # the first round is a plain step: it measures a plain step's cost
        if self.recheck > 0:
            self.recheck -= 1
        else:
            self.on, self.recheck = self.pays(), 7
        if self.on and (probe or self.plain > 0):
            self.plain = self.BURST - 1 if probe else self.plain - 1
            return [], 0
        if self.burst == 0 and not self.on:
            if not probe:
                return [], 0
            self.burst = self.BURST * (3 if self.avg[0][0] >= self.BACKOFF * self.avg[0][1] else 1)
        if self.burst > 0:
            self.burst -= 1
            self.recheck = 0 if self.burst == 0 else self.recheck  # decide on what the probe found
            return [rule.propose_draft(win, 0)], 1
        props: list = []
        best_worth, depth, expected, chance = 0.0, 1, 1.0, 1.0
        for j in range(D):
            if j and (expected + chance) / self.c(1, j + 1) <= best_worth * 1.05:
                break  # even a sure draft j+1 would not add 5 %: its head is not computed at all
            prop = rule.propose_draft(win, j)
            if prop is None:
                break
            q, conf = prop
            props.append((q, conf))
            chance *= self.rate(j, conf)
            expected += chance
            worth = expected / self.c(1, j + 1)
            if worth > best_worth * (1.05 if j else 1.0):
                best_worth, depth = worth, j + 1
            else:
                break
        self.looked = 0.9 * self.looked + 0.1 * len(props)
        return props, depth

    def heads_wanted(self) -> int:
        """How many draft heads' drafts to make ahead (`_round_kernel`): 1, or all (the R rate rows are the
        K - 1 heads) where rounds often ask for draft 2 (made apart, `make_head_drafts`, it is a second call)."""
        return 1 if self.looked < 1.5 else self.R


_PLANNERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> {sampling setting: _Planner}


def _planner(model, setting: tuple) -> "_Planner":
    """The model's planner for a sampling setting (temperature, top_k, top_p), made on first use; at most 8
    settings are kept per model (the oldest goes). Sampling planners stay on only at MARGIN, as they switch
    on: a sampled round's cost varies more (a rejection adds the residual's draw, none of it compiled), and
    with STAY the distilled small sampled at 0.94x plain under load 4."""
    greedy, K = setting[0] == 0, model.config.n_mtp

    def make():  # greedy: lookup drafts go up to decode.ROWS - 1 deep, judged by the last head's rates
        return _Planner(decode.ROWS - 1 if greedy else K - 1, stay=_Planner.STAY if greedy else _Planner.MARGIN,
                        rows=K - 1)
    try:
        plans = _PLANNERS.setdefault(model, {})
    except TypeError:  # not weakly referenceable: a fresh planner every call
        return make()
    if setting not in plans:
        if len(plans) >= 8:
            del plans[next(iter(plans))]
        plans[setting] = make()
    return plans[setting]


def _speculate(win: _Window, rule, emit, out: Generation, depth: int | None = None, plan: _Planner | None = None,
               probe_every: int = 128) -> None:
    """Speculative decoding (see the module docstring) with verification `rule` (_Greedy or _Sampled) and
    depth chosen by `plan` (or fixed: depth). Ends when emit() says so."""
    K = win.cfg.n_mtp
    plan = plan or _Planner(K - 1)
    clock = time.thread_time  # one reading per round: the work done, whoever else shares the CPU (see _Planner)
    forced = None  # the next token, when a rejection already decided it
    last, w, jumps = clock(), 0, win.jumps  # w: whether the last round drafted
    greedy = isinstance(rule, _Greedy)
    while True:
        t1 = forced if forced is not None else rule.next(win)
        if emit(t1):
            return
        room = max(0, win.room() - 1)  # the window is (nearly) full: do what plain decoding would
        plan.rounds += 1
        rule.prepare(win, t1)
        if depth is None:
            probe = plan.rounds >= plan.next_probe
            if probe:  # while off with drafts mostly rejected, each probe comes twice as late as the last
                backoff = plan.gap and not plan.on and plan.avg[0][0] < plan.BACKOFF * plan.avg[0][1]
                plan.gap = min(2 * plan.gap, 8 * probe_every) if backoff else probe_every
                plan.next_probe = plan.rounds + plan.gap
            props, d = plan.choose(win, rule, room, probe=probe)
        else:
            d = min(depth, K - 1, room)
            props = [rule.propose_draft(win, j) for j in range(d)]
        forced = None
        # greedy: the next round's head drafts come out of this round's compiled call where it will draft
        # (not after a round drafted by lookup: the text repeats, and the next lookup most likely hits too)
        # (as many heads as rounds use: a fixed depth, or 1 unless the planner often looks at draft 2)
        win.want_draft = 0 if not greedy or (d and rule.cont) else (
            min(depth, K - 1) if depth is not None else (plan.on or plan.burst > 0) * plan.heads_wanted())
        if d == 0:
            win.feed(t1)
        else:
            drafts = [rule.draft(q) for q, _ in props[:d]]  # drawn only now: which drafts go never depends on them
            n_before = len(win.seq) - win.start
            h, head0, best = win.advance([t1] + drafts, win.want_draft)  # [1 + d, dim], [1 + d, V], argmax [1 + d]
            out.drafted += d
            out.draft_rounds += 1
            n_ok, forced = rule.accept(head0, best, drafts, props, plan)
            out.accepted += n_ok
            win.keep(n_before + 1 + n_ok, h[n_ok], head0[n_ok], best[n_ok], n_ok)
            for t in drafts[:n_ok]:
                if emit(t):
                    return
        now = clock()
        # a round that refilled the window after a jump is no plain step; 1 in 4 plain steps after plain steps
        # suffice (not the first ones: right after the prefill they are slow, and made verifications look cheap)
        if win.jumps == jumps and (d or w or plan.rounds % 4 == 1):
            plan.timed(w, d, now - last)  # this round: from the end of the last one (its emits included)
        last, w, jumps = now, int(d > 0), win.jumps
        if d == 0 and depth is None and not (plan.on or plan.burst or plan.plain) and plan.recheck > 0:
            # off, with nothing to decide before the planner's next check or probe: plain steps until then,
            # without its round around each (that bookkeeping was ~3 % of a plain step of `small`)
            win.want_draft = 0
            for r in range(plan.rounds + 1, min(plan.next_probe, plan.rounds + plan.recheck + 1)):
                t0 = clock() if r % 4 == 1 else None  # 1 in 4 still timed
                token = rule.next(win)
                if emit(token):
                    return
                win.feed(token)
                plan.rounds, plan.recheck = r, plan.recheck - 1
                if t0 is not None and win.jumps == jumps:
                    plan.timed(0, 0, clock() - t0)
                jumps = win.jumps
            last = clock()


# ---- text in, text out ---------------------------------------------------------------------------
class StreamDecoder:
    """Turn a stream of token ids into text pieces, never splitting a UTF-8 character.

        dec = StreamDecoder(tok); dec.feed(id1) + dec.feed(id2) + dec.flush() == tok.decode([id1, id2])
    """

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token: int) -> str:
        return self.dec.decode(self.tok.token_bytes(token))

    def flush(self) -> str:
        return self.dec.decode(b"", final=True)


def truncate_left(ids: list[int], limit: int) -> tuple[list[int], int]:
    """Keep the last `limit` ids; return (kept, number dropped).  truncate_left([1, 2, 3], 2) -> ([2, 3], 1)"""
    dropped = max(0, len(ids) - limit)
    return ids[dropped:], dropped
