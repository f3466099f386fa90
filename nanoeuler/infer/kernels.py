"""The fused decoding step: the KV-cache forward of a few new tokens (of one sequence, or one per sequence of
serve's batch) in one numba call, for every architecture of arch.py.

forward.py's `forward_hidden` (the readable NumPy reference) makes ~16 matrix products and ~100 small NumPy
calls per token; at one token a step each of them is too short for BLAS or NumPy to pay for its own
overhead (most of a token's time goes to the calls, not to the matrix-vector products). `step` here is
the same mathematics in one compiled call, layer after layer on preallocated rows, with what the model's
record chose read from `Weights` (empty arrays where an architecture has no such part):

    x = embed[tokens] · scale (+ pos[positions])                 [n, d]
    per layer:  h = norm(x);  qkv = h @ Wqkvᵀ (+ b)  (one GEMV)      [n, (H + 2·Hkv)·hd]
                q/k norms per head; RoPE on q and k at the layer's base; k, v written at their positions
                q ·= attention_multiplier·√hd  (Granite's; 1 otherwise)
                a = softmax(q·kᵀ / sqrt(hd)) v over positions 0 .. L0+r (row r; a window: its last W; the
                    scores soft-capped where the model caps them, Gemma 2's)
                x += m·post(a @ Woᵀ + b);  h = norm(x)            m: residual_multiplier (1 but Granite's)
                                          (parallel residual: h = norm(the layer's input), GPT-NeoX's)
                x += m·post(act(h @ W_inᵀ + b) @ W_outᵀ + b)   act: SwiGLU, GeGLU or GELU (tanh, or exact: erf)
    h = norm(x)  (all rows, or the last only)                    [n|1, d]
                (the final norm's weight divided by logits_scaling: forward.final_norm)

and `matvec` is the matrix product of the heads (x [n, in] @ W[out, in]ᵀ) on the same machinery.
step.py's `forward_hidden` and weights.py's `linear` call them for one sequence of up to ROWS rows (plain
decoding, a prompt CHUNK rows at a time); `round_rows` runs a speculative round (the step, head 0 and its
argmax at every row); the batcher (`step.decode_rows`) a row per stream, any number (its prompts one at a
time); batches of sequences of equal positions stay on the NumPy path.

Where a layer's MLP weights are block-quantized (qkernels: llama.cpp's arithmetic, 8-bit activations), its
GELU is llama.cpp's too: a table of the 65,536 float16 values, so x is rounded to float16 and GELU(x) to
float16 (x itself beyond ±10; `_gelu_half`). Exact GELU alone leaves a Gemma 3 file's logits ~2e-2 from
llama.cpp's at its first position.

Its pieces are modules of their own: the matrix products are gemv.py's panels (float32 weights, or float16 bits:
float16.py) and qkernels.py's (the block types), a matrix of the step stacked from segments of any of those types
(`SEG`); the attention is attention_kernels.py's; pool.py's threads share the products' panels and, for many
rows at long positions, the attention's units, so that a step's result does not depend on the number of
threads, bit for bit.

Shapes: n new rows; L0 tokens already cached; d width; H / Hkv heads; hd head width; F SwiGLU width.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
from numba import njit

from ..fast.vmath import vexp
from ..ops.gelu import A as GELU_A
from ..ops.gelu import C as GELU_C
from ..ops.gelu_erf import INV_SQRT2 as GELU_INV_SQRT2
from ..numba_cache import note_first_compile
from . import pool
from .float16 import through_half
from .gemv import OPTS, QUANT

ROWS = 8          # most rows `linear` sends to the kernels (a speculative round: t1 + 7 drafts)
CHUNK = 32        # a prompt's tokens per fused call (step.forward_hidden)
ENABLED = True    # False: every decoding step takes the NumPy reference path (tests, bench; read by weights.Forms)
DECODING = "the decoding kernels"   # what note_first_compile says compiles when a layout is built on a cold cache


# ---- small pieces (inlined into the step) ----------------------------------------------------------
@njit(**OPTS)
def _norm(x, w, b, eps, y):
    """y [n, d] = the norm of x row by row with weight w [d]: RMSNorm x·w / sqrt(mean(x²) + eps) when the bias b
    is empty (ops/rmsnorm.py), else LayerNorm (x − μ)·w / sqrt(var + eps) + b (ops/layernorm.py)."""
    n, d = x.shape
    for r in range(n):
        m = np.float32(0.0)
        if b.shape[0]:
            for j in range(d):
                m += x[r, j]
            m /= d
        ss = np.float32(0.0)
        for j in range(d):
            ss += (x[r, j] - m) * (x[r, j] - m)
        k = np.float32(1.0 / np.sqrt(ss / d + eps))
        if b.shape[0]:
            for j in range(d):
                y[r, j] = ((x[r, j] - m) * k) * w[j] + b[j]
        else:
            for j in range(d):
                y[r, j] = (x[r, j] * k) * w[j]


@njit(**OPTS)
def _pre_norm(x, pre, w, b, eps, y):
    """y [n, d] = a sub-block's input norm of x (_norm), or x itself where the architecture has none (pre false)."""
    if pre:
        _norm(x, w, b, eps, y)
    else:
        y[:] = x


@njit(inline="always", **OPTS)
def _head_norm(x, base, hd, w, eps):
    """x[base : base+hd] := its RMSNorm with weight w [hd] (a q or k head, q/k norms)."""
    ss = np.float32(0.0)
    for i in range(hd):
        ss += x[base + i] * x[base + i]
    k = np.float32(1.0 / np.sqrt(ss / hd + eps))
    for i in range(hd):
        x[base + i] = (x[base + i] * k) * w[i]


@njit(inline="always", **OPTS)
def _gelu(x):
    """GELU, tanh approximation (ops/gelu.py), as x·σ(2u) with u = c·(x + a·x³): no tanh call."""
    u = np.float32(GELU_C) * (x + np.float32(GELU_A) * (x * x * x))
    return x / (np.float32(1.0) + vexp(np.float32(-2.0) * u))


@njit(inline="always", **OPTS)
def _gelu_erf(x):
    """GELU, exact (ops/gelu_erf.py): x·Φ(x) = ½·x·(1 + erf(x/√2))."""
    return np.float32(0.5) * x * (np.float32(1.0) + math.erf(x * np.float32(GELU_INV_SQRT2)))


@njit(inline="always", **OPTS)
def _gelu_half(x):
    """GELU as llama.cpp's CPU computes it (ggml_vec_gelu_f32 / geglu: GGML_GELU_FP16): its table holds GELU of
    every float16, rounded to float16, and x is looked up rounded to float16; 0 at x <= -10, x at x >= 10."""
    if x <= np.float32(-10.0):
        return np.float32(0.0)
    if x >= np.float32(10.0):
        return x
    return through_half(_gelu(through_half(x)))


@njit(inline="always", **OPTS)
def _rope(x, base, hd, cos, sin, t, out):
    """out[:hd] = x[base : base+hd] rotated to position t (rotate-half: i pairs with i + hd/2; ops/rope.py)."""
    h2 = hd // 2
    for i in range(h2):
        a, b = x[base + i], x[base + h2 + i]
        c, s = cos[t, i], sin[t, i]
        out[i] = a * c - b * s
        out[h2 + i] = b * c + a * s


@njit(inline="always", **OPTS)
def _add_bias(y, b):
    """y [n, m] += b [m] on every row (nothing when b is empty: no bias)."""
    if b.shape[0]:
        for r in range(y.shape[0]):
            for j in range(y.shape[1]):
                y[r, j] += b[j]


# A matrix of the fused step, as rows of a table [segments, SEG] int64: its rows stacked in segments, each in
# a weight type of its own (a file's q and k in Q5_0 beside v in Q8_0), by address: the segment's kind, the
# address of its kernel form, its outputs, its panels. The kernel forms live in one buffer, Weights.forms.
SEG = 4


@njit(**OPTS)
def _product(ctl, pooled, M, X, Y, add):
    """Y (+)= X @ Wᵀ for the segmented matrix M [segments, SEG] (see SEG): one segment straight into Y, several
    each into a temporary then into its columns of Y. Callers pass `add` as bool(True) / bool(False): numba
    compiles a kernel once per literal value a call passes it (True and False: two _product, each with its own
    copy of every product kernel below it), once for a bool."""
    if M.shape[0] == 1:
        pool.gemv_at(ctl, pooled, M[0, 0], M[0, 1], M[0, 3], X, Y, add)
        return
    n, o = X.shape[0], 0
    for s in range(M.shape[0]):
        m = M[s, 2]
        T = np.empty((n, m), np.float32)
        pool.gemv_at(ctl, pooled, M[s, 0], M[s, 1], M[s, 3], X, T, bool(False))
        for r in range(n):
            for j in range(m):
                Y[r, o + j] = Y[r, o + j] + T[r, j] if add else T[r, j]
        o += m


@njit(**OPTS)
def _residual(ctl, pooled, W, b, inp, x, o, post, nb, eps, h, m):
    """x += m·post(inp @ Wᵀ + b) (W a segmented matrix, see SEG): a sub-block's output projection added to the
    residual stream x [n, d], with the architecture's post norm (post: its weight; nb its bias) when it has one,
    times the residual multiplier m (o, h [n, d] scratch)."""
    if post.shape[0] == 0 and b.shape[0] == 0 and m == 1:
        _product(ctl, pooled, W, inp, x, bool(True))  # x += inp @ Wᵀ, no temporary
        return
    _product(ctl, pooled, W, inp, o, bool(False))
    _add_bias(o, b)
    if post.shape[0]:
        _norm(o, post, nb, eps, h)
        x += m * h
    else:
        x += m * o


@njit(**OPTS)
def step(ctl, pooled, x0, pos, slot, D, eps, n_heads, kc, vc, cos, sin, last_only):
    """The forward of rows x0 [n, d] (the new tokens' looked-up embeddings, forward.embed), row r at position
    pos[r] of cache row slot[r] -> final normed hidden states [n|1, d], for every architecture (D: `Weights`,
    what the model's record in arch.py chose). One sequence: slot all 0, pos = L0, L0+1, ..; a batch of
    sequences: one row each.

    kc, vc [layers, B, Hkv, max_len, hd]: row r writes its key and value at (slot[r], pos[r]) and attends
    to positions 0 .. pos[r] of its slot (a windowed layer: the last D.window[l] of them; all rows write
    before any attends). cos, sin [kinds, m, hd/2]: the RoPE tables of positions 0 .. m-1, m > every pos[r]
    (cache.Rope.upto: not checked here), layer l's at D.rope[l] (-1: none)."""
    n, d = x0.shape
    n_layers, _, Hkv, _, hd = kc.shape
    H, F = n_heads, D.ffn
    Hhd = n_heads * hd
    for r in range(n):
        if pos[r] < 0 or pos[r] >= kc.shape[3] or slot[r] < 0 or slot[r] >= kc.shape[1]:
            raise IndexError("cache position or row out of range")
    x = x0.copy()
    h = np.empty((n, d), np.float32)
    o = np.empty((n, d), np.float32)                # a sub-block's output before its post norm
    t = np.empty((n, (H + 2 * Hkv) * hd), np.float32)  # q, k, v of the new rows
    a = np.empty((n, Hhd), np.float32)              # attention output
    gu = np.empty((n, D.mlp_in_width), np.float32)  # the MLP's input products (gated: [gate | up])
    s = np.empty((n, F), np.float32)
    p = np.empty(pos.max() + 1, np.float32)         # attention probabilities
    rot = np.empty(hd, np.float32)
    hm = np.empty((n, d), np.float32) if D.parallel else h   # the MLP's normed input (parallel: of the layer's)
    for l in range(n_layers):
        _pre_norm(x, D.pre, D.norms[l, 0], D.norm_biases[l, 0], eps, h)
        if D.parallel:   # the MLP reads the layer's input, normed before the attention adds to it
            _pre_norm(x, D.pre, D.norms[l, 1], D.norm_biases[l, 1], eps, hm)
        _product(ctl, pooled, D.mats[l, 0, :D.segments[l, 0]], h, t, bool(False))
        _add_bias(t, D.qkv_bias[l])
        k_ = D.rope[l]
        for r in range(n):  # q/k norms, RoPE; the new keys and values go into the cache
            if D.qk_norms.shape[2] and D.qk_whole:  # each projection normed whole (OLMo 2)
                _head_norm(t[r], 0, Hhd, D.qk_norms[l, 0], eps)
                _head_norm(t[r], Hhd, Hkv * hd, D.qk_norms[l, 1], eps)
            for hh in range(H + Hkv):
                base = hh * hd
                if D.qk_norms.shape[2] and not D.qk_whole:
                    _head_norm(t[r], base, hd, D.qk_norms[l, 0 if hh < H else 1], eps)
                if k_ >= 0:
                    _rope(t[r], base, hd, cos[k_], sin[k_], pos[r], rot)
                    t[r, base:base + hd] = rot
                if hh < H and D.q_factor != 1:
                    t[r, base:base + hd] *= D.q_factor
            for g in range(Hkv):
                kc[l, slot[r], g, pos[r]] = t[r, Hhd + g * hd:Hhd + (g + 1) * hd]
                vc[l, slot[r], g, pos[r]] = t[r, Hhd + (Hkv + g) * hd:Hhd + (Hkv + g + 1) * hd]
        # Past the last layer's keys and values only the rows returned matter: with last_only, the last
        # row alone goes on (a prompt's or a window refill's other rows skip ~1/layers of their work).
        f = n - 1 if last_only and l == n_layers - 1 else 0
        pool.attention(ctl, pooled, t[f:], a[f:], kc[l], vc[l], pos[f:], slot[f:], H, D.window[l], p,
                       D.attn_softcap)
        _residual(ctl, pooled, D.mats[l, 1, :D.segments[l, 1]], D.wo_bias[l], a[f:], x[f:], o[f:],
                  D.norms[l, 2, :D.post], D.norm_biases[l, 2], eps, h[f:], D.residual)
        if not D.parallel:
            _pre_norm(x[f:], D.pre, D.norms[l, 1], D.norm_biases[l, 1], eps, hm[f:])
        _product(ctl, pooled, D.mats[l, 2, :D.segments[l, 2]], hm[f:], gu[f:], bool(False))
        _add_bias(gu[f:], D.mlp_in_bias[l])
        half = D.gelu_half[l]
        for r in range(f, n):  # the activation: SwiGLU silu(g)·u, GeGLU gelu(g)·u, or GELU
            for j in range(F):
                g_ = gu[r, j]
                if D.mlp == 0:
                    s[r, j] = g_ / (np.float32(1.0) + vexp(-g_)) * gu[r, F + j]
                else:
                    a_ = _gelu_erf(g_) if D.gelu_erf else _gelu_half(g_) if half else _gelu(g_)
                    s[r, j] = a_ * gu[r, F + j] if D.mlp == 1 else a_
        _residual(ctl, pooled, D.mats[l, 3, :D.segments[l, 3]], D.mlp_out_bias[l], s[f:], x[f:], o[f:],
                  D.norms[l, 3, :D.post], D.norm_biases[l, 3], eps, h[f:], D.residual)
    first = n - 1 if last_only else 0
    out = np.empty((n - first, d), np.float32)
    _norm(x[first:], D.norm, D.norm_bias, eps, out)
    return out


@njit(**OPTS)
def _round(ctl, pooled, x0, pos, slot, D, eps, n_heads, kc, vc, cos, sin, head0, V):
    """A speculative round's model work in one compiled call: `step` over tokens [n] (hidden states
    h [n, d], all rows), head 0's logits [n, V] and their argmax [n] (the same kernels as a plain step's
    forward + matvec + argmax, so the same numbers) -> (h, logits, best)."""
    h = step(ctl, pooled, x0, pos, slot, D, eps, n_heads, kc, vc, cos, sin, bool(False))   # (as forward calls it)
    n = h.shape[0]
    logits = np.empty((n, V), np.float32)
    pool.gemv(ctl, pooled, head0, h, logits, bool(False))
    best = np.empty(n, np.int64)
    for r in range(n):
        best[r] = np.argmax(logits[r])
    return h, logits, best


@njit(**OPTS)
def _matvec(ctl, pooled, W, X, out):
    """X [n, in] float32 @ Wᵀ, W [out, in] in kernel form (gemv.pack of float32, or float16 bits as uint16)
    -> [n, out] float32."""
    Y = np.empty((X.shape[0], out), np.float32)
    pool.gemv(ctl, pooled, W, X, Y, bool(False))
    return Y


# ---- the Python side -----------------------------------------------------------------------------
class Weights(NamedTuple):
    """What `step` reads: every layer's four matrices segmented (see SEG; each segment's kernel form is gemv.pack
    of float32, float16 bits (uint16) or a block type's (qkernels.pack), kept alive by the layout), and its vectors
    stacked over the layers. What an architecture lacks is an empty array (a bias [layers, 0], LayerNorm biases
    [layers, 4, 0], q/k norms [layers, 2, 0])."""
    mats: np.ndarray          # [layers, 4, 3, SEG] int64: qkv, wo, mlp_in, mlp_out, each of up to 3 segments
    segments: np.ndarray      # [layers, 4] int64: how many segments each has
    ffn: int                  # F, the activation's width
    qkv_bias: np.ndarray      # [layers, (H + 2·Hkv)·hd] or [layers, 0]
    wo_bias: np.ndarray       # [layers, d] or [layers, 0]
    mlp_in_bias: np.ndarray   # [layers, 2F | F] or [layers, 0]
    mlp_out_bias: np.ndarray  # [layers, d] or [layers, 0]
    norms: np.ndarray         # [layers, 4, d] float32: attn_norm, ffn_norm, attn_post_norm, ffn_post_norm
    norm_biases: np.ndarray   # [layers, 4, d] (LayerNorm) or [layers, 4, 0]
    qk_norms: np.ndarray      # [layers, 2, hd] (whole projections: [layers, 2, H·hd], k's Hkv·hd first) or [layers, 2, 0]
    norm: np.ndarray          # [d] float32
    norm_bias: np.ndarray     # [d] or [0]
    post: int                 # d with post norms, else 0 (norms[:, 2:, :post] is empty)
    mlp: int                  # 0 SwiGLU, 1 GeGLU, 2 GELU
    mlp_in_width: int         # 2F (gated) or F
    gelu_half: np.ndarray     # [layers] bool: GELU through float16 as llama.cpp (the MLP's weights in blocks)
    window: np.ndarray        # [layers] int64: each layer's window (0: none)
    rope: np.ndarray          # [layers] int64: each layer's RoPE table (cache.KVCache.kind; -1: none)
    forms: np.ndarray         # uint8: the buffer the segments point into (held here: alive as long as these are)
    q_factor: np.float32      # q's factor before attention: score_scale·√hd (Config.query_factor; 1)
    residual: np.float32      # residual_multiplier (1 but Granite's)
    attn_softcap: np.float32  # the attention scores' soft cap (0: none; Gemma 2's)
    pre: bool                 # sub-blocks' input norms (not OLMo 2's): norms[:, :2] used
    qk_whole: bool            # q/k norms over each whole projection (OLMo 2's), not per head
    parallel: bool            # the parallel residual: the MLP reads the layer's input (GPT-NeoX's)
    gelu_erf: bool            # GELU exact (erf; GPT-NeoX's), not the tanh form


MLP_KINDS = {"swiglu": 0, "geglu": 1, "gelu": 2}


def segment(kind: int, Wk: np.ndarray, out: int) -> list[int]:
    """The SEG row of a kernel form Wk of `kind` with `out` outputs (Wk must stay alive while it is used)."""
    return [kind, Wk.ctypes.data, out, Wk.shape[0]]


def weights(cfg, W: dict, segments: list, forms: np.ndarray) -> Weights:
    """The fused step's weights from the inference layout W (forward.fuse_weights), per layer the four
    matrices' segments (lists of `segment` rows), and the buffer of their kernel forms."""
    from .cache import new_cache
    note_first_compile(step, DECODING, "a minute or two")   # (decoding's first step compiles it)
    L, d, f32 = cfg.n_layers, cfg.dim, np.float32
    p = [f"layers.{i}." for i in range(L)]
    mats, counts = np.zeros((L, 4, 3, SEG), np.int64), np.zeros((L, 4), np.int64)
    for i, layer in enumerate(segments):
        for m, segs in enumerate(layer):
            counts[i, m] = len(segs)
            mats[i, m, :len(segs)] = segs

    def biases(m):
        return np.array([W[q + m + ".bias"] for q in p], f32) if W[p[0] + m + ".bias"] is not None else np.zeros((L, 0), f32)

    a = cfg.spec
    names = ("attn_norm", "ffn_norm", "attn_post_norm", "ffn_post_norm")
    norms = np.ones((L, 4, d), f32)
    norm_biases = np.zeros((L, 4, d if a.norm == "layer" else 0), f32)
    for i, q in enumerate(p):
        for j, name in enumerate(names):
            if q + name in W:
                norms[i, j], b = W[q + name]
                if b is not None:
                    norm_biases[i, j] = b
    qk = np.zeros((L, 2, W[p[0] + "attn.q_norm"][0].shape[0] if a.qk_norm else 0), f32)
    for i, q in enumerate(p):
        for j, name in enumerate(("attn.q_norm", "attn.k_norm") if a.qk_norm else ()):
            w = W[q + name][0]
            qk[i, j, :w.shape[0]] = w
    nw, nb = W["norm"]
    return Weights(mats, counts, cfg.ffn_hidden, biases("qkv"), biases("wo"), biases("mlp_in"), biases("mlp_out"),
                   norms, norm_biases, qk, nw, nb if nb is not None else np.zeros(0, f32), d if a.post_norms else 0,
                   MLP_KINDS[a.mlp], cfg.ffn_hidden * (2 if a.gated else 1), mats[:, 2, 0, 0] >= QUANT,
                   np.array([cfg.window(i) for i in range(L)], np.int64), new_cache(cfg, 1, 1).kind, forms,
                   np.float32(cfg.query_factor()), np.float32(cfg.residual_multiplier), np.float32(cfg.attn_softcap),
                   a.pre_norms, a.qk_norm_whole, cfg.parallel_residual, a.gelu_erf)


def forward(cfg, D: Weights, x: np.ndarray, k: np.ndarray, v: np.ndarray, L0: int, cos: np.ndarray,
            sin: np.ndarray, last_only: bool, slot: int = 0) -> np.ndarray:
    """Rows x [n, d] (embedded tokens) at positions L0.. of one sequence, cache row `slot` of k, v
    [layers, B, Hkv, max_len, hd] -> final normed hidden states [n|1, d]."""
    n = len(x)
    return forward_rows(cfg, D, x, np.arange(L0, L0 + n), np.full(n, slot, np.int64), k, v, cos, sin, last_only)


def forward_rows(cfg, D: Weights, x: np.ndarray, pos: np.ndarray, slot: np.ndarray, k: np.ndarray,
                 v: np.ndarray, cos: np.ndarray, sin: np.ndarray, last_only: bool = False) -> np.ndarray:
    """Rows x [n, d] (embedded tokens), row r at position pos[r] of cache row slot[r] of k, v
    [layers, B, Hkv, max_len, hd] (one sequence, or one row per sequence as the batcher steps) -> final normed
    hidden states [n|1, d]."""
    return pool.on_pool(step, np.ascontiguousarray(x, dtype=np.float32), np.ascontiguousarray(pos, dtype=np.int64),
                   np.ascontiguousarray(slot, dtype=np.int64), D, np.float32(cfg.norm_eps), cfg.n_heads, k, v,
                   cos, sin, last_only)


def matvec(Wk: np.ndarray, X: np.ndarray, out: int) -> np.ndarray:
    """X [n, in] float32 @ Wᵀ, W [out, in] in kernel form Wk (gemv.pack of float32 or float16 bits, or a block
    type's: qkernels.pack) -> [n, out], on the pool's threads."""
    return pool.on_pool(_matvec, Wk, np.ascontiguousarray(X, dtype=np.float32), out)


def round_rows(cfg, D: Weights, x: np.ndarray, pos: np.ndarray, slot: np.ndarray, k: np.ndarray, v: np.ndarray,
               cos: np.ndarray, sin: np.ndarray, head0: np.ndarray) -> tuple:
    """A speculative round's model work in one compiled call (`_round`): rows x [n, d] (embedded tokens) of one
    sequence -> (h [n, d], head-0 logits [n, V], their argmax [n])."""
    return pool.on_pool(_round, np.ascontiguousarray(x, dtype=np.float32), pos, slot, D, np.float32(cfg.norm_eps),
                   cfg.n_heads, k, v, cos, sin, head0, cfg.vocab_size)
