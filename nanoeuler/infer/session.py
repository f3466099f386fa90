"""One sequence: `generate` (prefill, then a token or a speculative round at a time), and text out.

Generation runs the model once over the prompt (prefill), keeping every layer's rotated keys and values
in a cache, then feeds one token at a time: each new token attends to the cached keys/values instead of
recomputing the whole prefix. `step.forward_hidden` is that forward (inference only, no backward caches);
its logits equal `model.forward`'s full recomputation (tests/test_generate.py checks ≤ 1e-5).

Context window: the sequence seen by the model is at most ctx_len tokens. When it would grow past that,
the window jumps forward to keep the most recent ctx_len // 2 tokens (at least the newest one:
cache.kept_on_jump) and the cache is refilled from them. Every mode (full recomputation, KV cache, speculative) applies the same rule, so their outputs agree.
"""
from __future__ import annotations

import codecs
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np

from ..errors import UserError
from . import step
from .cache import kept_on_jump, new_cache
from .sampling import nll_sum, sample_token
from .speculative import DEPTH, MOST, speculate

MODES = ("full", "cache", "speculative")


@dataclass
class Generation:
    """What `generate` returns: the new ids (without the stop token) and how they were made."""
    ids: list[int]
    stopped: bool = False          # ended on a stop token (rather than max_new_tokens)
    forwards: int = 0              # model calls, prefill included
    drafted: int = 0               # speculative: draft tokens proposed (prompt lookup) and verified
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
    """The tokens the model sees: seq[start:], at most ctx_len; jumps to the last kept_on_jump(ctx_len) when full.
    Keeps the final hidden state h [d] of the last position; `head0` turns it into head 0's logits [V]
    on demand."""

    def __init__(self, model, seq: list[int], mode: str, fused: dict | None = None):
        self.cfg, self.P = model.config, model.params
        self.mode, self.seq, self.forwards, self.jumps = mode, seq, 0, 0
        self.start = max(0, len(seq) - self.cfg.ctx_len)
        self.cache = new_cache(self.cfg, 1, dtype=model.dtype)
        self.W = fused if fused is not None else step.fuse_weights(self.cfg, self.P)
        self._refill()

    def _set(self, h: np.ndarray, logits: np.ndarray | None = None, best: int | None = None) -> None:
        self.h, self._logits, self.best = h, logits, best  # best: head 0's argmax, when known

    def head0(self) -> np.ndarray:
        """Logits [V] of head 0 at the last position."""
        if self._logits is None:
            self._logits = step.head_logits(self.cfg, self.W, self.h)
        return self._logits

    def argmax(self) -> int:
        """Head 0's argmax at the last position: the greedy next token."""
        return self.best if self.best is not None else int(np.argmax(self.head0()))

    def _forward(self, tokens, last_only: bool) -> np.ndarray:
        self.forwards += 1
        return step.forward_hidden(self.cfg, self.W, np.asarray(tokens, dtype=np.int64)[None], self.cache,
                                   last_only)[0]

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
            self.start = len(self.seq) - kept_on_jump(self.cfg.ctx_len)
            self.jumps += 1
            self._refill()
        elif self.mode == "full":
            self._refill()
        else:
            self._set(self._forward([token], True)[0])

    def advance(self, block: list[int]) -> tuple[np.ndarray, np.ndarray, list[int]]:
        """Feed tokens block (1 <= len(block) <= min(room(), kernels.ROWS)) in one call (step.advance)
        -> (hidden states [n, d], head-0 logits [n, V], head 0's argmax at each row, as ints). The caller
        rolls back with `keep` (a plain step keeps everything)."""
        self.forwards += 1
        h, logits, best = step.advance(self.cfg, self.W, self.cache, block)
        self.seq.extend(block)
        self._set(h[-1], logits[-1], best[-1])
        return h, logits, best

    def feed(self, token: int) -> None:
        """A plain step of speculative decoding: `advance` by one token, or `push` where the window jumps."""
        if self.room() >= 1:
            self.advance([token])
        else:
            self.push(token)

    def keep(self, n_total: int, h: np.ndarray, logits: np.ndarray, best: int) -> None:
        """Roll back seq and cache to n_total tokens of the window; h [d], logits [V] and best (their argmax)
        are head 0's outputs there."""
        drop = (len(self.seq) - self.start) - n_total
        if drop:
            del self.seq[len(self.seq) - drop:]
        self.cache.length = n_total
        self._set(h, logits, best)


def generate(model, prompt_ids: Sequence[int], max_new_tokens: int = 128, temperature: float = 1.0,
             top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
             stop_ids: Sequence[int] = (), mode: str = "cache",
             on_token: Callable[[int], None] | None = None, spec_depth: int | None = None,
             fused: dict | None = None) -> Generation:
    """Continue prompt_ids with up to max_new_tokens tokens, stopping after any of stop_ids.

    mode: "cache" (KV cache, one token per forward), "full" (recompute the whole window every token:
    the slow reference) or "speculative" (at temperature 0, prompt-lookup drafts verified by head 0: the
    same tokens as greedy "cache" in fewer forwards; at temperature > 0 it is "cache"). on_token(id) is
    called for each new token as soon as it is known (streaming). spec_depth: the most drafts a speculative
    round verifies (default speculative.DEPTH, at most speculative.MOST; for tests and benchmarks).
    fused: step.fuse_weights(model.config, model.params), when the caller keeps it across calls of an
    unchanged model (a chat session, an evaluation over many prompts: fusing reads and lays out every weight).
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
    if spec_depth is not None and not 0 <= spec_depth <= MOST:
        raise UserError(f"spec_depth must be in [0, {MOST}]")
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
        if mode == "speculative" and temperature == 0:
            speculate(win, emit, out, DEPTH if spec_depth is None else spec_depth)
        else:
            while True:
                token = sample_token(win.head0(), temperature, top_k, top_p, rng)
                if emit(token):
                    break
                win.push(token)
    out.decode_s = time.perf_counter() - t0
    out.decode_cpu_s = time.process_time() - cpu0
    out.forwards, out.jumps = win.forwards, win.jumps
    return out



def greedy_answers(model, prompts: Iterable[Sequence[int]], max_new_tokens: int,
                   stop_ids: Sequence[int]) -> Iterator[Generation]:
    """Greedy answers to prompts, one after another (speculative: the tokens of plain greedy decoding, in
    fewer forwards), each prompt cut to its last ctx_len tokens; the model's inference layout is made once
    (SFT and DPO answer checks: fusing reads and lays out every weight)."""
    W, ctx = step.fuse_weights(model.config, model.params), model.config.ctx_len
    for ids in prompts:
        yield generate(model, list(ids)[-ctx:], max_new_tokens=max_new_tokens, temperature=0, stop_ids=stop_ids,
                       mode="speculative", fused=W)


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

    def feed_many(self, tokens) -> str:
        """The text of several tokens at once: feed of each, joined."""
        return self.dec.decode(b"".join(map(self.tok.token_bytes, tokens)))

    def flush(self) -> str:
        return self.dec.decode(b"", final=True)


def head0_logits(model, ids: Sequence[int], fused: dict | None = None) -> np.ndarray:
    """Head 0's logits [T, V] at every position of one sequence of T <= ctx_len ids, through the KV-cache
    decoding step on the model as decoding holds it (float16, quantized: weights.for_dtype), from an empty
    cache. fused: step.fuse_weights(model.config, model.params), kept across calls (eval, the quality benches)."""
    cfg = model.config
    W = fused if fused is not None else step.fuse_weights(cfg, model.params)
    h = step.forward_hidden(cfg, W, np.asarray(ids, dtype=np.int64)[None], new_cache(cfg, 1, dtype=model.dtype))
    return step.head_logits(cfg, W, h[0])  # [T, V]


def head0_loss_sum(model) -> Callable:
    """score(tokens [B, T+1], mask [B, T+1] or None) -> the summed head-0 loss (nats) of the targets tokens[:, 1:]
    (where mask[:, 1:]), each row through the decoding step on `model` as decoding holds it (`eval --dtype`:
    weights.for_dtype's model)."""
    fused = step.fuse_weights(model.config, model.params)

    def score(tokens: np.ndarray, mask: np.ndarray | None) -> float:
        keep = np.ones(tokens[:, 1:].shape, bool) if mask is None else mask[:, 1:tokens.shape[1]]
        return sum(nll_sum(head0_logits(model, row[:-1], fused)[k], row[1:][k]) for row, k in zip(tokens, keep))
    return score


def truncate_left(ids: list[int], limit: int) -> tuple[list[int], int]:
    """Keep the last `limit` ids; return (kept, number dropped).  truncate_left([1, 2, 3], 2) -> ([2, 3], 1)"""
    dropped = max(0, len(ids) - limit)
    return ids[dropped:], dropped
