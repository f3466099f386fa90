"""The KV cache: every layer's rotated keys and values, a row per sequence, the RoPE tables, and attention over it.

A cache of `batch` rows holds, per layer, keys and values [batch, Hkv, max_len, hd]. One sequence
(`session.generate`) uses row 0 and its `length`; the batcher (`engine.py`) gives each request a row with
its own length and reads rows 0..n-1 as views (`rows`). Rolling back (a rejected speculative draft) is
setting `length` back: positions past it are overwritten by the next step. A new cache takes memory as
positions are written, not for its whole max_len at once (`zeros_as_written`).
"""
from __future__ import annotations

import mmap
from dataclasses import dataclass

import numpy as np

from .. import ops
from ..config import Config


class Rope:
    """The RoPE tables of each kind of layer (Config.rope_kinds: its inverse frequencies [hd/2]), made as
    positions are reached: `upto(n)` -> (cos, sin) [kinds, m, hd/2] for positions 0 .. m-1, m >= n, the
    tables doubling up to max_len as a sequence grows (a 32,768-position context does not make 64 MiB of
    tables for a short reply). No RoPE: 0 kinds."""

    def __init__(self, freqs: list[np.ndarray], head_dim: int, max_len: int, dtype):
        self.freqs, self.max_len, self.dtype = freqs, max_len, dtype
        empty = np.zeros((len(freqs), 0, head_dim // 2), dtype)
        self.tables = empty, empty  # (cos, sin), replaced together: a reader never sees one grown alone

    def upto(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        cos, sin = self.tables
        if n > cos.shape[1] and self.freqs:
            m = min(self.max_len, max(n, 2 * cos.shape[1], 256))
            made = [ops.rope_tables(m, f, self.dtype) for f in self.freqs]
            cos = np.array([c for c, _ in made], self.dtype).reshape(len(self.freqs), m, -1)
            sin = np.array([s for _, s in made], self.dtype).reshape(cos.shape)
            self.tables = cos, sin
        return cos, sin


@dataclass
class KVCache:
    """Rotated keys and values of every layer for the first `length` positions of the window."""
    k: list[np.ndarray]  # per layer [B, Hkv, max_len, hd]
    v: list[np.ndarray]
    rope: Rope           # the RoPE tables (shared by the caches of `rows`)
    kind: np.ndarray     # [layers] int64: layer i's table in rope's cos / sin (-1: no RoPE)
    length: int = 0
    store: tuple | None = None  # (k, v, b0): arrays [layers, batch, Hkv, max_len, hd] whose rows b0.. are
                                #   k[i], v[i] (new_cache: b0 = 0; serve's batcher: a view of its rows)

    @property
    def max_len(self) -> int:
        return self.k[0].shape[2]

    def tables(self, i: int, pos: np.ndarray) -> tuple:
        """Layer i's RoPE (cos, sin) at positions pos (any shape: the tables' rows pos), or (None, None)."""
        j = self.kind[i]
        if j < 0:
            return None, None
        cos, sin = self.rope.upto(int(pos.max()) + 1 if pos.size else 0)
        return cos[j][pos], sin[j][pos]


def kept_on_jump(ctx_len: int) -> int:
    """Positions a full window keeps when it jumps forward: its last half, and at least the newest token
    (ctx_len // 2 alone would keep nothing of a 1-position window, and no step could run on it).

        kept_on_jump(8) -> 4    kept_on_jump(3) -> 1    kept_on_jump(1) -> 1
    """
    return max(1, ctx_len // 2)


def new_cache(cfg: Config, batch: int = 1, max_len: int | None = None, dtype=np.float32) -> KVCache:
    """An empty cache for up to max_len (default ctx_len) positions. A float16 model computes in float32
    (see fuse_weights), so its cache is float32."""
    max_len = max_len or cfg.ctx_len
    dtype = np.float32 if np.dtype(dtype) == np.float16 else dtype
    shape = (cfg.n_layers, batch, cfg.n_kv_heads, max_len, cfg.head_dim)
    freqs, kind = cfg.rope_kinds()
    k, v = zeros_as_written(shape, dtype), zeros_as_written(shape, dtype)
    return KVCache(list(k), list(v), Rope(freqs, cfg.head_dim, max_len, dtype), np.array(kind, np.int64),
                   store=(k, v, 0))


def zeros_as_written(shape: tuple, dtype) -> np.ndarray:
    """Zeros whose memory pages are taken only where written: an anonymous map in small pages. (np.zeros asks
    the kernel for 2 MiB pages for a large array, and a cache's first position, written in every layer and
    head's [max_len, hd] block, would make the whole cache resident: SmolLM2's 8,192 positions, 360 MiB.)"""
    nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    if nbytes == 0:
        return np.zeros(shape, dtype)
    m = mmap.mmap(-1, nbytes)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        m.madvise(mmap.MADV_NOHUGEPAGE)
    return np.frombuffer(m, dtype).reshape(shape)


def rows(cache: KVCache, b0: int, n: int) -> KVCache:
    """A view of rows b0 .. b0+n-1 of a new_cache cache, as a cache of n rows (length 0): writes go to the
    cache's own arrays.  rows(new_cache(cfg, 4), 2, 1).k[0].shape[0] == 1"""
    k, v, _ = cache.store
    return KVCache([x[b0:b0 + n] for x in cache.k], [x[b0:b0 + n] for x in cache.v], cache.rope, cache.kind,
                   store=(k, v, b0))


def attend_rows(cache: KVCache, i: int, q: np.ndarray, k: np.ndarray, v: np.ndarray, pos: np.ndarray,
                window: int = 0, slots: np.ndarray | None = None, softcap: float = 0.0) -> np.ndarray:
    """Layer i's attention for n rows, one new token each: q [n, H, hd], k and v [n, Hkv, hd] of row r at
    position pos[r] (written into cache row slots[r], default r) -> [n, H·hd]. Row r reads keys 0..pos[r] (a
    window W > 0: pos[r] − W + 1 .. pos[r]); the rest of the [0, max(pos)] block gets -inf scores
    (probability exactly 0); softcap: the scores' soft cap (0: none; ops/softcap.py):

        pos = [3, 1]:  scores row 0: s s s s     row 1: s s -inf -inf       (window 2: row 0: -inf -inf s s)
    """
    n, H, hd = q.shape
    Hkv, kc, vc = k.shape[1], cache.k[i], cache.v[i]
    Lk = int(pos.max()) + 1
    j = np.arange(Lk)[None, :]
    masked = (j > pos[:, None]) | ((j <= pos[:, None] - window) if window else False)  # [n, Lk]
    bias = np.where(masked, -np.inf, 0.0).astype(kc.dtype)[:, None, None, :]  # [n, 1, 1, Lk]
    at = np.arange(n) if slots is None else slots
    kc[at, :, pos] = k
    vc[at, :, pos] = v
    if slots is None:
        K, V = kc[:n, :, :Lk], vc[:n, :, :Lk]  # [n, Hkv, Lk, hd] (views)
    else:
        K, V = kc[slots, :, :Lk], vc[slots, :, :Lk]  # (copies of the rows)
    S = (q.reshape(n, Hkv, H // Hkv, hd) @ K.swapaxes(-1, -2)) * kc.dtype.type(1.0 / np.sqrt(hd))
    S = ops.softcap_forward(S, softcap)[0] + bias
    S -= S.max(axis=-1, keepdims=True)  # [n, Hkv, G, Lk]
    P = np.exp(S)
    P /= P.sum(axis=-1, keepdims=True)
    return (P @ V).reshape(n, H * hd)  # [n, Hkv, G, hd] -> [n, H·hd]
