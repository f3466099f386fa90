"""The fast training step: the model of `model.py`, with preallocated buffers, fused kernels and BLAS.

Same mathematics as `model.forward` / `model.backward` (tests/test_fast.py compares every gradient),
organised for speed:

- the batch is cut into one part per core (parallel.py); each part's forward, heads and backward run in
  their own thread on single-threaded BLAS and serial numba kernels, and the parts' weight gradients are
  summed at the end (part 0 writes into the caller's buffers, the others into the workspace's);
- every activation lives in a `Workspace` allocated once per (config, B, T, dtype) and reused across
  steps; tensors are kept as [N = B·T, width] rows so each matmul is one BLAS call, and a part is a view
  of its own rows;
- q, k, v come from one matmul against [wq; wk; wv] stacked, gate and up from one against [gate; up];
  their weight gradients come out of one matmul each (straight into the gradient buffer when the
  caller's buffers are laid out as `grad_buffers` makes them);
- attention: one kernel applies RoPE and the 1/√hd scale while splitting q/k/v into heads, the four
  products are batched BLAS matmuls over the full T×T square (the G query heads of a kv head stacked, so
  GQA needs no copies of k and v), and one kernel each does the causal softmax and its backward (a soft cap
  on the scores, Gemma 2's, inside the softmax; its backward forms the scores again: one more product);
- what backward can recompute in one cheap pass is not stored: the normed inputs of the q/k/v and
  gate/up matmuls (from the residual stream and the saved 1/rms), the MLP activation's output (from the
  kept pre-activations); a `lean` workspace (LoRA's) keeps not even those, nor the attention probabilities
  and output: backward forms them again (the MLP's input product, scores, softmax and P·v of each layer),
  which keeps [1, ...] of them instead of [L, ...] (what it saves: docs/benchmarks.md);
- dropout (training only) is fused into the residual adds, its mask recomputed in backward from
  (seed, site, element) instead of stored (ops/dropout.py);
- the K output heads are done one at a time, and each a chunk of rows at a time (`head_rows`): the chunk's
  logits [rows, V], its losses and dlogits in place, then its two backward matmuls, the head weight's
  gradient summed over the chunks (blas.matmul_add). A part's logits buffer holds one chunk, at most
  LOGITS_BYTES: Gemma 3's 262,144-token head never holds a batch's B·T·V logits (1 GiB at B=4, T=256);
- precision "bf16": every matrix product (`linear`, `linear_dx`, `ws.mm`) takes bfloat16 operands with
  float32 accumulation (fast/bf16.py); the weights are rounded and packed once per step by `pack_weights`
  (the parts a share each). Everything else is unchanged float32;
- LoRA (lora.py) hooks in without a copy of any weight: `ws.adapters` adds the adapters' low-rank share
  to each product of a weight they adapt (`linear`, `linear_dx`), a gradient mapping with its own
  `weight_grad` forms the adapters' gradients instead of dW, one without "embed.weight" skips the
  embedding's, and `ws.fixed_weights` stacks and packs the frozen weights once for the whole run.

    ws = Workspace(cfg, B, T, np.float32)              # or Workspace(..., precision="bf16")
    head0, objective, grads = loss_and_grads(cfg, params, tokens, loss_mask, ws)
"""
from __future__ import annotations

import contextlib
import math
from types import SimpleNamespace

import numpy as np
from numpy import matmul

from .. import ops
from ..config import PRECISIONS, Config, head_name, head_weight
from ..errors import UserError
from . import bf16, kernels
from . import parallel
from .blas import matmul_add
from .parallel import run_parts, single_threaded_blas

# Activation arrays of a Workspace, by how a part's rows are cut out of them.
PER_LAYER_ROWS = ("X", "M", "r1", "r2", "A", "GU", "mu1", "mu2", "QK", "rqk", "O1", "O2", "rp1", "rp2")
                                                                   # [L, N, ...]: a[:, n0:n1]
ROWS = ("rf", "muf", "hf", "h", "S", "qkv", "dqkv", "ds", "t", "o", "dx", "dh", "dp", "losses")  # [N, ...]: a[n0:n1]
PER_LAYER_HEADS = ("q", "k", "v", "P")                             # [L, B·Hkv, ...]: a[:, b0·Hkv:b1·Hkv]
HEAD_ITEMS = ("dy", "dq", "dk", "dv", "dS", "C")                   # [B·Hkv, ...]: a[b0·Hkv:b1·Hkv]
LOGITS_BYTES = 64 << 20      # a part's logits buffer: the rows of one chunk of a head's rows (see head_rows)
EXTRA_GRADS_BYTES = 2 << 30  # every part after the first holds a whole gradient set: at most this much in all
                             # (gpt on 16 cores would otherwise hold 15 × 466 MB)


class Workspace:
    """Every buffer one training step needs, for a fixed (config, B, T, dtype). Reused step after step."""

    def __init__(self, cfg: Config, B: int, T: int, dtype, precision: str = "f32", lean: bool = False):
        self.key = (cfg, B, T, np.dtype(dtype), precision, lean)
        dt = np.dtype(dtype)
        self.precision = check_precision(precision, dt)
        self.bf16 = bf16.products(dt) if precision == "bf16" else None  # kernels (float32) or the float64 twin
        self.mm = self.bf16.matmul if self.bf16 else _blas_mm     # mm(a, b, out): out = a @ b
        self.packs = {}                    # bf16: weight key -> (packed for x·Wᵀ, for dy·W), see pack_weights
        self.adapters = None               # LoRA (lora.Adapters): added to each product of a weight it adapts
        self.fixed_weights = False         # True: the same unchanging weights every step (LoRA's frozen base):
        self.stacked = False               # stacked (ws.stacks) and packed (bf16) by the first forward only,
        self.trained_weights = []          # except these (LoRA's modules_to_save), repacked every forward (bf16)
        self.embed_rows = take_rows        # the lookup: rows(table, ids, out) (LoRA: from a file, see lora.py)
        a = cfg.spec
        L, d, H, Hkv, hd, F, V = cfg.n_layers, cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_hidden, cfg.vocab_size
        G = H // Hkv
        N = B * T
        F_in = 2 * F if a.gated else F     # the MLP's input product: [gate | up], or GPT-2's fc
        self.B, self.T, self.N = B, T, N
        e = lambda *shape: np.empty(shape, dtype=dt)  # noqa: E731
        layer = a.norm == "layer"
        # saved for backward, per layer (empty where the architecture has no use for them)
        self.X = e(L + 1, N, d)            # residual stream entering each block (X[L]: before the final norm)
        self.M = e(L, N, d)                # residual stream between attention and feed-forward
        self.r1, self.r2, self.rf = e(L, N), e(L, N), e(N)  # 1/rms (or 1/σ) of each norm's input
        self.mu1, self.mu2, self.muf = (e(L, N), e(L, N), e(N)) if layer else (e(L, 0), e(L, 0), e(0))  # LayerNorm means
        self.q = e(L, B * Hkv, G * T, hd)  # RoPE(q)/√hd per kv head: its G query heads stacked
        self.k, self.v = e(L, B * Hkv, T, hd), e(L, B * Hkv, T, hd)  # RoPE(k), v per kv head
        self.lean = lean                   # kept for one layer only (formed again in backward): GU, P, A
        Lk = 1 if lean else L
        self.P = e(Lk, B * Hkv, G * T, T)  # attention probabilities per kv head (0 where a query sees no key)
        self.QK = e(L, N, (H + Hkv) * hd) if a.qk_norm else e(L, 0, 0)  # q|k before their norms
        self.rqk = e(L, N, H + Hkv) if a.qk_norm else e(L, 0, 0)      # 1/rms of each q and k head
        self.A = e(Lk, N, H * hd)          # attention output, input of wo
        self.O1, self.O2 = (e(L, N, d), e(L, N, d)) if a.post_norms else (e(L, 0, 0), e(L, 0, 0))  # post norms' inputs
        self.rp1, self.rp2 = (e(L, N), e(L, N)) if a.post_norms else (e(L, 0), e(L, 0))
        self.GU = e(Lk, N, F_in)           # the MLP's pre-activations ([gate | up] or fc + b); backward: their gradients
        self.hf = e(N, d)                  # final normed hidden state, input of the heads
        # scratch, shared by layers
        self.h = e(N, d)                   # a normed input (recomputed in backward)
        self.S = e(N, F)                   # the activation's output, input of the MLP's output matrix (recomputed)
        self.qkv, self.dqkv = e(N, (H + 2 * Hkv) * hd), e(N, (H + 2 * Hkv) * hd)  # q, k, v projections
        self.ds = e(N, F)                  # gradient of the activation's output
        self.t, self.o = e(N, d), e(N, d)  # matmul results about to be added somewhere
        self.dx, self.dh = e(N, d), e(N, d)
        self.dp = e(N, d) if cfg.parallel_residual else e(0, 0)   # the MLP input's gradient, added to the layer input's
        self.losses = np.empty(N, dtype=np.float64)
        self.dq, self.dy = e(B * Hkv, G * T, hd), e(B * Hkv, G * T, hd)  # per kv head, like q
        self.dk, self.dv = e(B * Hkv, T, hd), e(B * Hkv, T, hd)
        self.dS = e(B * Hkv, G * T, T)     # score gradients
        self.C = e(B * Hkv, *((G * T, T) if cfg.attn_softcap else (0, 0)))  # scores before their soft cap (backward)
        # shared by the parts, refreshed from params each step: the stacked weights (float32 products only;
        # bf16 products read the packs, each stack formed only while it is packed: see _stack_weights), the
        # stacked q|k|v biases, a layer's products (arch.Arch.layer_products) and their keys
        self.products = [{m: product_key(names) for m, names in a.layer_products(i).items()} for i in range(L)]
        self.stacks = {}
        if self.bf16 is None:
            self.stacks = {key: e(sum(cfg.param_shapes()[n][0] for n in product_weights(key)), d)
                           for pr in self.products for key in pr.values() if "+" in key}
        self.bqkv = e(L, (H + 2 * Hkv) * hd) if a.qkv_bias else None
        hd2 = hd // 2
        self.ropes = []
        for i in range(L):                 # each layer's RoPE tables (no RoPE: the identity, cos 1, sin 0)
            if a.positions == "rope":
                self.ropes.append(ops.rope_tables(T, cfg.layer_freqs(i), dt))
            else:
                self.ropes.append((np.ones((T, hd2), dt), np.zeros((T, hd2), dt)))
        self.windows = [cfg.window(i) for i in range(L)]
        scale = (dt.type(np.sqrt(d)) if a.embed_scale else 1.0) * cfg.embedding_multiplier   # (model.embed_scale)
        self.embed_scale = dt.type(scale) if scale != 1 else None
        self.qscale = dt.type(cfg.score_scale())   # 1/√hd, or Granite's multiplier (· yarn's attention factor²)
        n_parts = min(parallel.PARTS, B, 1 + EXTRA_GRADS_BYTES // (cfg.n_params() * dt.itemsize))
        cuts = parallel.chunks(B, n_parts)
        self.logits_rows = max(1, min(max(b1 - b0 for b0, b1 in cuts) * T, LOGITS_BYTES // (V * dt.itemsize)))
        self.logits = e(n_parts, self.logits_rows, V)   # each part's: one chunk of its rows' logits
        self.parts = [self._part(cfg, b0, b1, k) for k, (b0, b1) in enumerate(cuts)]
        self.parts[0].single = len(self.parts) == 1

    def _part(self, cfg: Config, b0: int, b1: int, k: int) -> SimpleNamespace:
        """The rows of sequences b0 .. b1-1: views into every activation array, its own RMSNorm
        weight-gradient accumulator, and (part k > 0) its own gradient buffers."""
        n0, n1, Hkv = b0 * self.T, b1 * self.T, cfg.n_kv_heads
        w = SimpleNamespace(index=k, b0=b0, b1=b1, n0=n0, n1=n1)
        for name in PER_LAYER_ROWS:
            setattr(w, name, getattr(self, name)[:, n0:n1])
        for name in ROWS:
            setattr(w, name, getattr(self, name)[n0:n1])
        for name in PER_LAYER_HEADS:
            setattr(w, name, getattr(self, name)[:, b0 * Hkv:b1 * Hkv])
        for name in HEAD_ITEMS:
            setattr(w, name, getattr(self, name)[b0 * Hkv:b1 * Hkv])
        w.logits = self.logits[k]                                      # [logits_rows, V]
        w.dw, w.db = np.empty(cfg.dim, np.float64), np.empty(cfg.dim, np.float64)  # a norm's or d-wide bias's
        w.dbqkv = np.empty(self.qkv.shape[1], np.float64)              # q|k|v biases' gradients
        w.dbin = np.empty(self.GU.shape[2], np.float64)                # the MLP input's biases'
        whole = cfg.spec.qk_norm_whole     # q/k norms' (per head, or over each whole projection)
        w.dwq = np.empty(cfg.head_dim * (cfg.n_heads if whole else 1), np.float64)
        w.dwk = np.empty(cfg.head_dim * (cfg.n_kv_heads if whole else 1), np.float64)
        w.grads = grad_buffers(cfg, self.X.dtype) if k else None
        w.single = False  # set below: the only part (its gradients are final as it writes them)
        return w

    def nbytes(self) -> int:
        arrays = [a for a in vars(self).values() if isinstance(a, np.ndarray)]
        arrays += [g for w in self.parts if w.grads for g in w.grads.values()]
        arrays += [p for pair in self.packs.values() for p in pair]
        return sum(a.nbytes for a in arrays)


def check_precision(precision: str, dtype) -> str:
    """precision "f32" (any dtype), or "bf16" (float32: a CPU with AVX512_BF16; float64: the NumPy twin),
    else UserError."""
    if precision not in PRECISIONS:
        raise UserError(f"unknown precision {precision!r}: {' or '.join(PRECISIONS)}")
    if precision == "bf16":
        bf16.products(dtype)
    return precision


def grad_buffers(cfg: Config, dtype) -> dict[str, np.ndarray]:
    """Gradient arrays for every parameter, as views into one flat buffer in SPEC order, so that
    wq, wk, wv (and gate, up) of a layer are adjacent and their stacked gradient is one matmul output."""
    shapes = cfg.param_shapes()
    flat = np.empty(sum(math.prod(s) for s in shapes.values()), dtype=dtype)
    out, off = {}, 0
    for name, shape in shapes.items():
        n = math.prod(shape)
        out[name] = flat[off:off + n].reshape(shape)
        off += n
    return out


def _stacked(arrays):
    """A [Σ rows, cols] view over C-contiguous 2-D arrays that sit back to back in memory, else None."""
    first = arrays[0]
    if not all(a.flags.c_contiguous and a.dtype == first.dtype and a.shape[1:] == first.shape[1:] for a in arrays):
        return None
    addr = first.__array_interface__["data"][0]
    for a in arrays:
        if a.__array_interface__["data"][0] != addr:
            return None
        addr += a.nbytes
    rows = sum(a.shape[0] for a in arrays)
    return np.lib.stride_tricks.as_strided(first, shape=(rows,) + first.shape[1:], strides=first.strides)


def take_rows(table, ids, out) -> None:
    """out [n, d] = table [V, d] rows ids [n]: the embedding lookup."""
    np.take(table, ids, axis=0, out=out)


def _blas_mm(a, b, out):
    """out = a @ b (BLAS)."""
    matmul(a, b, out=out)


def linear(ws: Workspace, x, W, key: str, out) -> None:
    """out [n, out] = x [n, in] · Wᵀ (W [out, in]); bf16: W's panels packed this step under `key`.
    With ws.adapters (LoRA), W's low-rank adapters' share is added: out += s·(x·Aᵀ)·Bᵀ."""
    if ws.bf16:
        ws.bf16.matmul_packed(x, ws.packs[key][0], out)
    else:
        matmul(x, W.T, out=out)
    if ws.adapters is not None:
        ws.adapters.forward(key, x, out, ws.mm)


def linear_dx(ws: Workspace, dy, W, key: str, out) -> None:
    """out [n, in] = dy [n, out] · W (the input gradient of `linear`; with ws.adapters: + s·(dy·B)·A)."""
    if ws.bf16:
        ws.bf16.matmul_packed(dy, ws.packs[key][1], out)
    else:
        matmul(dy, W, out=out)
    if ws.adapters is not None:
        ws.adapters.dx(key, dy, out, ws.mm)


def product_key(names: list[str]) -> str:
    """The key of the product of weights stacked by rows (one weight: its name). Keys name the packs (bf16),
    the float32 stacks and the products LoRA adapts."""
    return "+".join(names)


def product_weights(key: str) -> list[str]:
    """The weights (stacked by rows) behind a product key of `linear`.
    product_weights("layers.3.ffn.gate.weight+layers.3.ffn.up.weight") -> ["layers.3.ffn.gate.weight", ...up...]"""
    return key.split("+")


def pack_weights(ws: Workspace, weights: dict, done=None) -> None:
    """bf16 only (else nothing): every weight W [out, in] of `weights` (key -> W, or a list of weights
    stacked by rows: the stack exists only while it is packed) rounded to bfloat16 and packed both ways,
    into buffers kept in ws.packs from step to step; the parts take a share each. done(arrays): called with
    each weight's arrays (the list stacked, or [W]) once they are packed (stack_fixed's, to let them go)."""
    if not ws.bf16:
        return
    items = list(weights.items())
    for key, W in items:
        if key not in ws.packs:  # [out, in]: its panels both ways, filled below
            out, n_in = sum(w.shape[0] for w in _parts(W)), _parts(W)[0].shape[1]
            ws.packs[key] = (ws.bf16.panels_for(n_in, out), ws.bf16.panels_for(out, n_in))

    def share(k):
        for key, W in items[k::len(ws.parts)]:
            S = _stack(W)
            ws.bf16.pack_b(S.T, out=ws.packs[key][0])
            ws.bf16.pack_b(S, out=ws.packs[key][1])
            if done is not None:
                done(_parts(W))
    run_parts(share, len(ws.parts))


def copied_weights(ws: Workspace) -> list[str]:
    """The params a workspace with ws.fixed_weights holds in a form of its own after its first forward (bf16:
    every product's weight packed; float32: q|k|v and gate|up stacked) and never reads from params again: a
    frozen base may let their float32 go (checkpoint.drop_pages). The embedding, read by the lookup, never is.

        bf16 euler -> [layers.0.attn.wq.weight, ..., layers.0.ffn.down.weight, ..., heads.0.weight]"""
    if not (ws.fixed_weights and ws.stacked):
        return []
    keys = list(ws.packs) if ws.bf16 else list(ws.stacks)
    return [n for k in keys for n in product_weights(k) if n != "embed.weight"]


def _parts(W) -> list:
    """The arrays of W: a list of weights stacked by rows as it is, a weight as [W]."""
    return W if isinstance(W, list) else [W]


def _stack(W):
    """W, or a list of weights stacked by rows (a new array): [wq [128, 64], wk [32, 64]] -> [160, 64]."""
    return np.concatenate(W) if isinstance(W, list) else W


def add_product(a, b, out, mm=_blas_mm) -> None:
    """out += a @ b, the product by mm (the workspace's: BLAS, with β = 1; bf16's, summing onto out)."""
    if mm is _blas_mm:
        matmul_add(a, b, out)
    else:
        mm(a, b, out, add=True)


def _matmul_into(a, b, outs, mm=_blas_mm, accumulate: bool = False):
    """a @ b written into the row blocks `outs` (adjacent arrays: directly; otherwise through a temporary);
    accumulate: added to them instead."""
    view = _stacked(outs)
    if view is not None:
        (add_product if accumulate else mm)(a, b, view, *((mm,) if accumulate else ()))
        return
    tmp = np.empty((a.shape[0], b.shape[1]), outs[0].dtype)
    mm(a, b, tmp)
    off = 0
    for o in outs:
        if accumulate:
            o += tmp[off:off + o.shape[0]]
        else:
            o[...] = tmp[off:off + o.shape[0]]
        off += o.shape[0]


def weight_grad(grads, names, dy, x, mm=_blas_mm, accumulate: bool = False) -> None:
    """The weight gradient of y = x·Wᵀ, dyᵀ·x [out, in], into grads[names] (weights stacked by rows,
    dy [n, Σ out], x [n, in]); accumulate: added to what they hold (a head's chunks of rows). A gradient
    mapping with a `weight_grad` method (lora.LoraGrads) takes the same dy and x instead: adapter gradients,
    and nothing at all for a frozen weight (no [out, in] product)."""
    own = getattr(grads, "weight_grad", None)
    if own is not None:
        own(names, dy, x, mm, accumulate)
    else:
        _matmul_into(dy.T, x, [grads[n] for n in names], mm, accumulate)


def _in_parts(fn, cfg: Config, params: dict, ws: Workspace, grads: dict | None, *args) -> None:
    """fn(cfg, params, ws, w, grads of w, *args) for every part w of ws, one thread each, BLAS single-threaded.
    Part 0 writes gradients into `grads`, the others into their own buffers."""
    def one(k):
        w = ws.parts[k]
        fn(cfg, params, ws, w, w.grads if k and grads is not None else grads, *args)
    with single_threaded_blas():
        run_parts(one, len(ws.parts))


def _sum_part_grads(ws: Workspace, grads: dict, names) -> None:
    """grads[name] += every other part's gradient of name, in part order (fixed: deterministic)."""
    for w in ws.parts[1:]:
        for name in names:
            if name in grads:  # a LoRA step keeps no gradient of its frozen matrices (lora.LoraGrads)
                grads[name] += w.grads[name]


# ---- attention of one part: RoPE + head split, BLAS products, causal softmax ------------------------------
def attention_forward(qkv, rope, qscale, n_kv_heads, q, k, v, P, y, A, mm=_blas_mm, window=0, cap=0.0) -> None:
    """qkv rows [n, (H + 2·Hkv)·hd] -> A [n, H·hd] (the input of wo). Fills q [b·Hkv, G·T, hd], k, v
    [b·Hkv, T, hd] and P [b·Hkv, G·T, T] (kept for backward); y (like q) is scratch. mm: the products.
    window: each query sees its last `window` keys (0: all earlier ones); cap: the scores' soft cap (0: none)."""
    cos, sin = rope
    kernels.attention_split(qkv, cos, sin, qscale, n_kv_heads, q, k, v)
    attention_probs(q, k, v, P, y, A, n_kv_heads, mm, window, cap)


def attention_probs(q, k, v, P, y, A, n_kv_heads, mm=_blas_mm, window=0, cap=0.0) -> None:
    """From the heads q [b·Hkv, G·T, hd], k, v [b·Hkv, T, hd]: P (the attention probabilities) and A [n, H·hd]
    (the attention output, in rows); y (like q) is scratch."""
    mm(q, k.transpose(0, 2, 1), P)                                          # scores
    kernels.causal_softmax(P, k.shape[1], window, cap)

    mm(P, v, y)                                                             # [b·Hkv, G·T, hd]
    kernels.heads_to_rows(y, n_kv_heads, A)


def attention_backward(dA, rope, qscale, n_kv_heads, q, k, v, P, dy, dS, dq, dk, dv, dqkv, mm=_blas_mm,
                       window=0, cap=0.0, C=None) -> None:
    """dA [n, H·hd] -> dqkv [n, (H + 2·Hkv)·hd], from what attention_forward kept (q, k, v, P);
    dy, dq (like q), dk, dv (like k) and dS (like P) are scratch. mm: the products. cap > 0: the scores were
    soft-capped; they are formed again in C (like P, scratch) for the cap's gradient."""
    cos, sin = rope
    kernels.rows_to_heads(dA, n_kv_heads, dy)                               # [b·Hkv, G·T, hd]
    mm(dy, v.transpose(0, 2, 1), dS)                                        # dP
    kernels.causal_softmax_backward(P, dS, k.shape[1], window)              # dS
    if cap:
        mm(q, k.transpose(0, 2, 1), C)                                      # the scores before the cap
        kernels.softcap_backward(dS, C, k.shape[1], window, cap)
    mm(dS, k, dq)                                                           # [b·Hkv, G·T, hd]
    mm(dS.transpose(0, 2, 1), q, dk)                                        # [b·Hkv, T, hd] (sums the G heads)
    mm(P.transpose(0, 2, 1), dy, dv)
    kernels.attention_join(dq, dk, dv, cos, sin, qscale, n_kv_heads, dqkv)


# ---- one part's work (runs in that part's thread) ---------------------------------------------------------
def _residual_add(x, t, drop, site: int, row0: int, out) -> None:
    """out = x + t, with t dropped out (sites as in model.forward) when drop is given."""
    if drop is None:
        np.add(x, t, out=out)
    else:
        kernels.dropout_add(x, t, *_dropout_args(drop, site, row0, t), out)


def _dropped(g, drop, site: int, row0: int, out):
    """The gradient reaching a dropped-out branch: g · mask (into out), or g itself without dropout."""
    if drop is None:
        return g
    kernels.dropout_scale(g, *_dropout_args(drop, site, row0, g), out)
    return out


def _scale(a, factor: float) -> None:
    """a ·= factor in place (nothing when it is 1): a scalar multiplier (Config.MULTIPLIERS, ops/scale.py)."""
    if factor != 1:
        a *= a.dtype.type(factor)


def _scaled(g, factor: float, out):
    """g · factor into out (g itself when the factor is 1): the gradient reaching a multiplied branch."""
    if factor == 1:
        return g
    np.multiply(g, g.dtype.type(factor), out=out)
    return out


def _dropout_args(drop, site: int, row0: int, a):
    return np.uint64(drop.base(site, row0, a.shape[1])), np.uint64(drop.threshold), a.dtype.type(drop.scale)


def _norm_forward(cfg: Config, params: dict, name: str, x, eps, y, r, mu) -> None:
    """y = the architecture's norm of x [n, d] with the weights under `name`; r (and mu: LayerNorm) kept."""
    if cfg.spec.norm == "rms":
        kernels.rmsnorm_forward(x, params[name + ".weight"], eps, y, r)
    else:
        kernels.layernorm_forward(x, params[name + ".weight"], params[name + ".bias"], eps, y, mu, r)


def _norm_backward(cfg: Config, params: dict, name: str, dy, x, r, mu, dx, w, grads) -> None:
    """dx += the gradient of the norm `name` (input x [n, d]) for dy; its weight's (and bias's) into grads."""
    if cfg.spec.norm == "rms":
        kernels.rmsnorm_backward(dy, x, r, params[name + ".weight"], dx, w.dw)
    else:
        kernels.layernorm_backward(dy, x, mu, r, params[name + ".weight"], dx, w.dw, w.db)
        grads[name + ".bias"][...] = w.db
    grads[name + ".weight"][...] = w.dw


def _pre_norm(cfg: Config, params: dict, name: str, x, eps, h, r, mu):
    """A sub-block's input norm `name` of x [n, d] into h (r, mu kept: _norm_forward) -> h; x itself where the
    architecture has no input norms (OLMo 2)."""
    if not cfg.spec.pre_norms:
        return x
    _norm_forward(cfg, params, name, x, eps, h, r, mu)
    return h


def _pre_norm_backward(cfg: Config, params: dict, name: str, dy, x, r, mu, dx, w, grads) -> None:
    """dx += the gradient of _pre_norm's input for dy (dy itself without the norm)."""
    if cfg.spec.pre_norms:
        _norm_backward(cfg, params, name, dy, x, r, mu, dx, w, grads)
    else:
        dx += dy


def _qk_norms_forward(cfg: Config, params: dict, p: str, w, i: int, eps) -> None:
    """q and k (the first (H + Hkv)·hd columns of w.qkv) := their RMSNorms, per head or each projection whole
    (qk_norm_whole: its 1/rms in rqk[i][:, 0] and [:, 1]); their input kept in w.QK[i]."""
    H, Hkv, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    wq, wk = params[p + "attn.q_norm.weight"], params[p + "attn.k_norm.weight"]
    if not cfg.spec.qk_norm_whole:
        kernels.qk_norm_forward(w.qkv, H + Hkv, hd, wq, wk, H, eps, w.QK[i], w.rqk[i])
        return
    kernels.span_norm_forward(w.qkv, 0, H * hd, wq, eps, w.QK[i], w.rqk[i][:, 0])
    kernels.span_norm_forward(w.qkv, H * hd, (H + Hkv) * hd, wk, eps, w.QK[i], w.rqk[i][:, 1])


def _qk_norms_backward(cfg: Config, params: dict, p: str, w, i: int) -> None:
    """The backward of _qk_norms_forward on w.dqkv (in place); the weights' gradients into w.dwq, w.dwk."""
    H, Hkv, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    wq, wk = params[p + "attn.q_norm.weight"], params[p + "attn.k_norm.weight"]
    if not cfg.spec.qk_norm_whole:
        kernels.qk_norm_backward(w.dqkv, H + Hkv, hd, wq, wk, H, w.QK[i], w.rqk[i], w.dwq, w.dwk)
        return
    kernels.span_norm_backward(w.dqkv, 0, H * hd, wq, w.QK[i], w.rqk[i][:, 0], w.dwq)
    kernels.span_norm_backward(w.dqkv, H * hd, (H + Hkv) * hd, wk, w.QK[i], w.rqk[i][:, 1], w.dwk)


def _bias(params: dict, key: str):
    """The bias of a product (its weights' biases stacked like them), or None where the architecture has none."""
    biases = [n.removesuffix("weight") + "bias" for n in product_weights(key)]
    if biases[0] not in params:
        return None
    return np.concatenate([params[b] for b in biases]) if len(biases) > 1 else params[biases[0]]


def _add_bias(params: dict, key: str, y) -> None:
    """y [n, out] += the bias of the product `key` where the architecture has one."""
    b = _bias(params, key)
    if b is not None:
        y += b


def _bias_grads(grads: dict, names: list[str], dy, acc) -> None:
    """The biases of the weights `names` (stacked by rows), if they have any: their gradient Σ_rows dy."""
    biases = [n.removesuffix("weight") + "bias" for n in names]
    if biases[0] not in grads:
        return
    kernels.col_sum(dy, acc)
    off = 0
    for b in biases:
        n = grads[b].shape[0]
        grads[b][...] = acc[off:off + n]
        off += n


def _product(ws: Workspace, params: dict, key: str):
    """The weight behind a product key as `linear` reads it: the stack, or the param itself."""
    return ws.stacks[key] if key in ws.stacks else params[key] if "+" not in key else None


def _forward_part(cfg: Config, params: dict, ws: Workspace, w, _grads, inputs, drop) -> None:
    a, Hkv, H, hd = cfg.spec, cfg.n_kv_heads, cfg.n_heads, cfg.head_dim
    eps = ws.X.dtype.type(cfg.norm_eps)
    ws.embed_rows(params["embed.weight"], inputs[w.b0:w.b1].reshape(-1), w.X[0])        # [n, d]
    if ws.embed_scale is not None:
        w.X[0] *= ws.embed_scale
    if a.positions == "learned":
        kernels.add_positions(w.X[0], params["pos_embed.weight"], ws.T)
    for i in range(cfg.n_layers):
        p, pr = f"layers.{i}.", ws.products[i]
        x, mid = w.X[i], w.M[i]
        # attention sub-block: mid = x + post(wo · attention(q, k, v) + b)
        h = _pre_norm(cfg, params, p + "attn_norm", x, eps, w.h, w.r1[i], w.mu1[i])
        linear(ws, h, _product(ws, params, pr["qkv"]), pr["qkv"], w.qkv)     # [n, (H+2Hkv)·hd]
        if ws.bqkv is not None:
            w.qkv += ws.bqkv[i]
        if a.qk_norm:
            _qk_norms_forward(cfg, params, p, w, i, eps)
        j = 0 if ws.lean else i                                             # where GU, P, A of layer i are kept
        attention_forward(w.qkv, ws.ropes[i], ws.qscale, Hkv, w.q[i], w.k[i], w.v[i], w.P[j], w.dq, w.A[j], ws.mm,
                          ws.windows[i], cfg.attn_softcap)
        _output(cfg, ws, params, pr["wo"], w.A[j], p + "attn_post_norm", w.O1, w.rp1, i, w, eps)
        _scale(w.t, cfg.residual_multiplier)
        _residual_add(x, w.t, drop, 2 * i, w.n0, out=mid)
        # feed-forward sub-block: X[i+1] = mid + post(mlp(norm(mid))) (parallel residual: norm(x))
        h = _pre_norm(cfg, params, p + "ffn_norm", x if cfg.parallel_residual else mid, eps, w.h, w.r2[i], w.mu2[i])
        GU = w.GU[j]
        linear(ws, h, _product(ws, params, pr["mlp_in"]), pr["mlp_in"], GU)  # [n, 2F | F]
        _activation(cfg, params, pr["mlp_in"], GU, w.S, first=True)          # [n, F]
        _output(cfg, ws, params, pr["mlp_out"], w.S, p + "ffn_post_norm", w.O2, w.rp2, i, w, eps)
        _scale(w.t, cfg.residual_multiplier)
        _residual_add(mid, w.t, drop, 2 * i + 1, w.n0, out=w.X[i + 1])
    _norm_forward(cfg, params, "norm", w.X[cfg.n_layers], eps, w.hf, w.rf, w.muf)
    _scale(w.hf, 1.0 / cfg.logits_scaling)   # logits / logits_scaling, as (hf / logits_scaling)·headᵀ


def _activation(cfg: Config, params: dict, key: str, GU, S, first: bool) -> None:
    """S [n, F] = the MLP's activation of its pre-activations GU [n, 2F] ([gate | up]) or [n, F] (GPT-2's fc).
    first (forward): the biases of the product `key` are added to GU first, and kept there: backward calls
    this again on the same GU to recompute S (not kept per layer)."""
    a = cfg.spec
    if a.mlp == "gelu":
        b = _bias(params, key) if first else None
        kernels.bias_gelu_forward(GU, np.zeros(GU.shape[1], GU.dtype) if b is None else b, S, a.gelu_erf)  # GU += b
        return
    if first:
        _add_bias(params, key, GU)
    (kernels.swiglu_forward if a.mlp == "swiglu" else kernels.geglu_forward)(GU, S)


def _output(cfg: Config, ws: Workspace, params: dict, key: str, inp, post: str, O, rp, i: int, w, eps) -> None:
    """w.t = post(inp · Wᵀ + b): a sub-block's output before the residual add (post norms: its input kept in
    O[i], its 1/rms in rp[i])."""
    if not cfg.spec.post_norms:
        linear(ws, inp, params[key], key, w.t)
        _add_bias(params, key, w.t)
        return
    linear(ws, inp, params[key], key, O[i])
    _add_bias(params, key, O[i])
    kernels.rmsnorm_forward(O[i], params[post + ".weight"], eps, w.t, rp[i])


def _heads_part(cfg: Config, params: dict, ws: Workspace, w, grads, targets, scales, sums) -> None:
    for k in range(cfg.n_mtp):
        _head_part(cfg, params, ws, w, grads, k, targets[k], np.full(ws.N, scales[k]))
        sums[k, w.index] = w.losses.sum()
        if grads is not None and k:
            w.dh += w.t


def _head_part(cfg: Config, params: dict, ws: Workspace, w, grads, k: int, targets, scales) -> None:
    """Head k over part w's rows, a chunk of at most ws.logits_rows rows at a time (see head_rows): w.losses,
    and with grads the head's gradient and hf's (into w.dh for head 0, w.t for the others)."""
    name = head_name(params, k)   # tied head 0: embed's first share of the gradient (the lookup's is added)
    W = head_weight(params, k)                                              # [V, d]
    dh = w.dh if k == 0 else w.t
    n = w.n1 - w.n0
    for c, (r0, r1) in enumerate(parallel.chunks(n, -(-n // ws.logits_rows))):
        z, h = w.logits[:r1 - r0], w.hf[r0:r1]
        linear(ws, h, W, name, z)                                           # [rows, V]
        kernels.cross_entropy(z, targets[w.n0 + r0:w.n0 + r1], scales[w.n0 + r0:w.n0 + r1].astype(z.dtype),
                              w.losses[r0:r1], grads is not None, cfg.logit_softcap)   # z := dlogits
        if grads is not None:
            weight_grad(grads, [name], z, h, ws.mm, accumulate=c > 0)     # [V, d]
            linear_dx(ws, z, W, name, dh[r0:r1])                            # [rows, d]


def _output_backward(cfg: Config, ws: Workspace, params: dict, key: str, g, inp, post: str, O, rp, i: int, w,
                     grads, out) -> None:
    """The backward of _output: g [n, d] (the gradient of its result) -> out [n, in] (of its input inp); the
    weight's, bias's and post norm's gradients into grads."""
    if cfg.spec.post_norms:
        w.o[...] = 0
        kernels.rmsnorm_backward(g, O[i], rp[i], params[post + ".weight"], w.o, w.dw)
        grads[post + ".weight"][...] = w.dw
        g = w.o
    weight_grad(grads, [key], g, inp, ws.mm)                                # [out, in]
    _bias_grads(grads, [key], g, w.db)
    linear_dx(ws, g, params[key], key, out)


def _backward_part(cfg: Config, params: dict, ws: Workspace, w, grads, ids, drop) -> None:
    a, Hkv, H, hd = cfg.spec, cfg.n_kv_heads, cfg.n_heads, cfg.head_dim
    eps = ws.X.dtype.type(cfg.norm_eps)
    dx = w.dx
    dx[...] = 0
    _scale(w.dh, 1.0 / cfg.logits_scaling)
    _norm_backward(cfg, params, "norm", w.dh, w.X[cfg.n_layers], w.rf, w.muf, dx, w, grads)
    _announce_part(w, [n for n in grads if n.startswith("norm.")], grads)
    for i in reversed(range(cfg.n_layers)):
        p, pr = f"layers.{i}.", ws.products[i]
        j = 0 if ws.lean else i                                             # where GU, P, A of layer i are kept
        x, mid, GU, P, A = w.X[i], w.M[i], w.GU[j], w.P[j], w.A[j]
        # feed-forward sub-block (X[i+1] = mid + post(mlp_out(act(mlp_in(norm(mid)))))); its input's gradient
        # goes to mid's (dx), or with the parallel residual (the MLP reads x) to dp, added to x's at the end
        mlp_input, dmlp = (x, w.dp) if cfg.parallel_residual else (mid, dx)
        df = _scaled(_dropped(dx, drop, 2 * i + 1, w.n0, out=w.t), cfg.residual_multiplier, w.t)  # [n, d]
        h = _pre_norm(cfg, params, p + "ffn_norm", mlp_input, eps, w.h, w.r2[i], w.mu2[i])  # recompute the normed input
        if ws.lean:                                                         # and the pre-activations (lean)
            linear(ws, h, _product(ws, params, pr["mlp_in"]), pr["mlp_in"], GU)
        _activation(cfg, params, pr["mlp_in"], GU, w.S, first=ws.lean)     # and the activation's output
        _output_backward(cfg, ws, params, pr["mlp_out"], df, w.S, p + "ffn_post_norm", w.O2, w.rp2, i, w,
                         grads, w.ds)                                       # ds [n, F]
        if a.mlp == "gelu":
            kernels.gelu_backward(w.ds, GU, a.gelu_erf)                     # ds := d(fc output)
            dU = w.ds
        else:
            (kernels.swiglu_backward if a.mlp == "swiglu" else kernels.geglu_backward)(w.ds, GU)  # GU := [dg | du]
            dU = GU
        weight_grad(grads, product_weights(pr["mlp_in"]), dU, h, ws.mm)
        _bias_grads(grads, product_weights(pr["mlp_in"]), dU, w.dbin)
        linear_dx(ws, dU, _product(ws, params, pr["mlp_in"]), pr["mlp_in"], w.dh)  # [n, d]
        if cfg.parallel_residual:
            dmlp[...] = 0
        _pre_norm_backward(cfg, params, p + "ffn_norm", w.dh, mlp_input, w.r2[i], w.mu2[i], dmlp, w, grads)
        # attention sub-block (mid = x + post(wo(attention(q, k, v)) + b))
        do = _scaled(_dropped(dx, drop, 2 * i, w.n0, out=w.t), cfg.residual_multiplier, w.t)      # [n, d]
        if ws.lean:                                                         # P and A formed again from q, k, v
            attention_probs(w.q[i], w.k[i], w.v[i], P, w.dy, A, Hkv, ws.mm, ws.windows[i], cfg.attn_softcap)
        _output_backward(cfg, ws, params, pr["wo"], do, A, p + "attn_post_norm", w.O1, w.rp1, i, w, grads,
                         A)                                                 # dA [n, H·hd] (A is spent)
        attention_backward(A, ws.ropes[i], ws.qscale, Hkv, w.q[i], w.k[i], w.v[i], P,
                           w.dy, w.dS, w.dq, w.dk, w.dv, w.dqkv, ws.mm, ws.windows[i], cfg.attn_softcap,
                           w.C)                                             # [n, (H+2Hkv)·hd]
        if a.qk_norm:
            _qk_norms_backward(cfg, params, p, w, i)
            grads[p + "attn.q_norm.weight"][...] = w.dwq
            grads[p + "attn.k_norm.weight"][...] = w.dwk
        h = _pre_norm(cfg, params, p + "attn_norm", x, eps, w.h, w.r1[i], w.mu1[i])  # recompute the normed input
        weight_grad(grads, product_weights(pr["qkv"]), w.dqkv, h, ws.mm)
        _bias_grads(grads, product_weights(pr["qkv"]), w.dqkv, w.dbqkv)
        linear_dx(ws, w.dqkv, _product(ws, params, pr["qkv"]), pr["qkv"], w.dh)
        _pre_norm_backward(cfg, params, p + "attn_norm", w.dh, x, w.r1[i], w.mu1[i], dx, w, grads)
        if cfg.parallel_residual:
            dx += w.dp
        _announce_part(w, [n for n in grads if n.startswith(p)], grads)
    if a.positions == "learned" and "pos_embed.weight" in grads:
        kernels.position_backward(dx, ws.T, grads["pos_embed.weight"])
    if ws.embed_scale is not None:
        dx *= ws.embed_scale
    if "embed.weight" not in grads:          # frozen (a LoRA step): no [V, d] gradient
        pass
    elif cfg.tie_embeddings and w.index == 0:  # the caller's buffer already holds the tied head's whole share
        kernels.embedding_backward_add(dx, ids[w.n0:w.n1], grads["embed.weight"])
    else:
        kernels.embedding_backward(dx, ids[w.n0:w.n1], grads["embed.weight"])
    _announce_part(w, ["pos_embed.weight", "embed.weight"], grads)


# ---- the gradient hook (data-parallel overlap, see nanoeuler/training/dist.py) ----------------------------------------
_GRAD_HOOK = None


@contextlib.contextmanager
def grad_hook(fn):
    """Within the block, fn(names, grads) is called as soon as the gradients of those tensors are final:
    the heads after `heads`, then norm, each layer from the last down, embed during `backward` (with
    several parts, whose gradients are summed at the end, everything at the end). Runs in the caller's
    thread."""
    global _GRAD_HOOK
    previous, _GRAD_HOOK = _GRAD_HOOK, fn
    try:
        yield
    finally:
        _GRAD_HOOK = previous


def announce(names, grads) -> None:
    """Tell the hook (if any) that these gradients are final."""
    if _GRAD_HOOK is not None:
        _GRAD_HOOK(names, grads)


def _announce_part(w, names, grads) -> None:
    if _GRAD_HOOK is not None and w.single:
        _GRAD_HOOK(names, grads)


# ---- the public steps: every part at once ----------------------------------------------------------------
def forward(cfg: Config, params: dict, inputs: np.ndarray, ws: Workspace, dropout=None) -> None:
    """inputs int [B, T] -> fills ws up to ws.hf (the final normed hidden state).
    dropout (ops.Dropout, optional): on the residual branches, the masks of `model.forward`."""
    if restack(ws):
        _stack_weights(cfg, params, ws)
    elif ws.trained_weights:
        pack_weights(ws, {n: params[n] for n in ws.trained_weights})
    _in_parts(_forward_part, cfg, params, ws, None, inputs, dropout)


def stack_fixed(cfg: Config, params: dict, ws: Workspace, done=None) -> None:
    """A workspace with fixed_weights: stack (float32) or pack (bf16) the unchanging weights now rather than in
    the first forward, so that what they were copied from can go before the step's buffers fill
    (lora.LoraModel._workspace, `copied_weights`); done(arrays): called with each weight's arrays (the list
    stacked, or [W]) once they are copied, so that their pages can go before the next are read."""
    if restack(ws):
        _stack_weights(cfg, params, ws, done)


def share_fixed(ws: Workspace, other: Workspace) -> None:
    """ws (fixed_weights) reads the stacked (float32) or packed (bf16) unchanging weights of other, a workspace
    of the same model and precision for another batch shape: one copy of them, whatever the shapes."""
    ws.stacks, ws.packs, ws.bqkv, ws.stacked = other.stacks, other.packs, other.bqkv, True
    ws.embed_rows = other.embed_rows


def restack(ws) -> bool:
    """Whether this forward stacks (and, bf16, packs) the weights: every step, or only the first with
    ws.fixed_weights."""
    again = not (ws.fixed_weights and ws.stacked)
    ws.stacked = True
    return again


def _stack_weights(cfg: Config, params: dict, ws: Workspace, done=None) -> None:
    """The q|k|v biases of every layer into ws.bqkv; float32: every stacked product's weights into ws.stacks;
    bf16: every product's weight packed (the stacks formed one at a time as they are packed, none kept)."""
    if ws.bqkv is not None:
        for i in range(cfg.n_layers):
            np.concatenate([params[n.removesuffix("weight") + "bias"] for n in product_weights(ws.products[i]["qkv"])],
                           out=ws.bqkv[i])
    if not ws.bf16:
        for key, S in ws.stacks.items():
            W = [params[n] for n in product_weights(key)]
            np.concatenate(W, out=S)
            if done is not None:
                done(W)
        return
    products = {key: [params[n] for n in product_weights(key)] if "+" in key else params[key]
                for pr in ws.products for key in pr.values()}
    pack_weights(ws, products | {head_name(params, k): head_weight(params, k) for k in range(cfg.n_mtp)}, done)


def heads(cfg: Config, params: dict, targets: np.ndarray, ws: Workspace, grads: dict | None, counts=None):
    """The K heads and their losses, one head at a time. targets int [K, N] (−1 = ignored).
    With grads: also dlogits -> grads['heads.k.weight'] and the gradient of hf into ws.dh.
    Returns (per-head mean losses, objective). counts: the number of targets of each head to divide by
    (default: those in targets; a data-parallel rank passes the whole batch's, so that its losses and
    gradients are its share of the batch's and sum over the ranks to them)."""
    Kh = cfg.n_mtp
    if counts is None:
        counts = [int(np.count_nonzero(targets[k] >= 0)) for k in range(Kh)]
    scales = [ws.logits.dtype.type(1.0 / (n * Kh) if n else 0.0) for n in counts]
    sums = np.zeros((Kh, len(ws.parts)))                                   # per head, per part: Σ losses
    _in_parts(_heads_part, cfg, params, ws, grads, targets, scales, sums)
    if grads is not None:  # tied: embed.weight holds head 0's share of the whole batch, before `backward`
        names = [head_name(params, k) for k in range(Kh)]
        _sum_part_grads(ws, grads, names)
        announce([n for n in names if n.startswith("heads.")], grads)
    losses = [float(sums[k].sum() / n) if n else 0.0 for k, n in enumerate(counts)]
    return losses, sum(losses) / Kh


def head_rows(cfg: Config, params: dict, ws: Workspace, targets: np.ndarray, scales=None, grads: dict | None = None,
              k: int = 0) -> np.ndarray:
    """Head k on every row of ws.hf (after `forward`), a chunk of rows at a time in each part: the logits of
    a chunk [≤ ws.logits_rows, V], their cross-entropy against targets int [N] (−1: none) and, with grads,
    dlogits = scales[n]·(softmax − onehot(target)) in place of them (scales float [N]), then the head weight's
    gradient (added up over the chunks, into grads) and the gradient of hf (into ws.dh). -> the rows' losses
    float64 [N] (0 where no target): −log p(target).

        losses = head_rows(cfg, P, ws, targets)                  # forward only: DPO's log-probs are −losses
        head_rows(cfg, P, ws, targets, -dlogp_of_row, grads)     # then `backward` from ws.dh"""
    scales = np.zeros(ws.N) if scales is None else np.asarray(scales, np.float64)
    _in_parts(_head_part, cfg, params, ws, grads, k, targets, scales)
    if grads is not None:
        _sum_part_grads(ws, grads, [head_name(params, k)])
    return ws.losses.copy()


def backward(cfg: Config, params: dict, ids: np.ndarray, ws: Workspace, grads: dict, dropout=None) -> None:
    """From ws.dh (gradient of the final normed state, left by `heads`) to every parameter gradient
    except the heads'. ids int [B·T]; dropout: the one `forward` ran with.
    tie_embeddings: the tied head's share must already be in grads["embed.weight"] (the lookup's is added)."""
    _in_parts(_backward_part, cfg, params, ws, grads, ids, dropout)
    _sum_part_grads(ws, grads, [n for n in grads if not n.startswith("heads.")])
    if len(ws.parts) > 1:
        announce([n for n in grads if not n.startswith("heads.")], grads)


def flat_targets(tokens, T, Kh, loss_mask):
    """tokens int [B, T+K] -> targets int64 [K, B·T] (−1 where the mask says no loss)."""
    return ops.mtp_targets(tokens, T, Kh, loss_mask).reshape(Kh, -1)


def loss_and_grads(cfg: Config, params: dict, tokens: np.ndarray, loss_mask, ws: Workspace, grads: dict | None = None,
                   dropout=None, counts=None):
    """tokens int [B, T+K] -> (head-0 loss, objective, grads). `grads` (optional) receives the gradients;
    best made by `grad_buffers` (then the stacked weight gradients need no copy). dropout: ops.Dropout.
    counts: targets per head to divide by (see `heads`)."""
    T = tokens.shape[1] - cfg.n_mtp
    inputs = np.ascontiguousarray(tokens[:, :T], dtype=np.int64)
    targets = flat_targets(tokens, T, cfg.n_mtp, loss_mask)
    if grads is None:
        grads = grad_buffers(cfg, ws.X.dtype)
    forward(cfg, params, inputs, ws, dropout)
    losses, objective = heads(cfg, params, targets, ws, grads, counts)
    backward(cfg, params, inputs.reshape(-1), ws, grads, dropout)
    return losses[0], objective, grads


def loss(cfg: Config, params: dict, tokens: np.ndarray, loss_mask, ws: Workspace, dropout=None):
    """Forward only: (head-0 loss, objective)."""
    T = tokens.shape[1] - cfg.n_mtp
    inputs = np.ascontiguousarray(tokens[:, :T], dtype=np.int64)
    forward(cfg, params, inputs, ws, dropout)
    losses, objective = heads(cfg, params, flat_targets(tokens, T, cfg.n_mtp, loss_mask), ws, None)
    return losses[0], objective
