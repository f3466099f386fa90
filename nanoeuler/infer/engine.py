"""Continuous batching: many generation requests share each forward pass over one batched KV cache, fairly.

The cache holds, per layer, keys and values [max_batch, Hkv, ctx_len, hd] (ctx_len: the model's context, or
fewer positions where the server says so: `Batcher(ctx_len=)`). A running job has a row of it
with its own length (the positions it has filled). Jobs belong to requests (Job.group: the prompts and
choices of one HTTP request), and rows and prompt work are shared between requests, not jobs, so that no
request waits for another's many jobs. One engine step:

    1. schedule  free rows go to waiting jobs, the request that holds the fewest rows first (ties: the
                 earliest). When every row is taken and a waiting request holds two rows fewer than the
                 largest holder, that holder's row with the least cache is parked (its cache positions
                 copied aside, bit for bit; at most max_batch parked at once) and the row handed over. A
                 parked job resumes where it stopped, before its request's jobs not yet started.
    2. prefill   rows filling their cache (a new prompt; a window that jumped, below) advance: each request
                 by up to prefill_tokens tokens a step (the largest request, below: its share), its jobs in
                 order. A long prompt goes in over several steps and no step stalls the running streams for
                 long on one request's prompts, while many requests arriving together all go in at once. A
                 row first copies what the prefix cache holds of its tokens (below) and computes the rest.
                 A row whose cache is full joins the decoding rows.
    3. sample    every decoding row samples its next token from its head-0 logits (sampling.sample_token,
                 with the job's own random generator; a job with a grammar (Job.constraint) from its logits
                 with the tokens the grammar refuses at -inf): a stop id, a grammar complete or max_tokens
                 ends the job, frees its row
    4. decode    one forward over the decoding rows at once: row r feeds its new token at position length_r;
                 attention masks every key past length_r, so rows of different lengths share the step
                 (step.decode_rows: the fused step, each row attending to its own cache row, and the head in
                 its kernel; models it does not run: the architecture's NumPy forward_rows, on BLAS)

    The largest request: while other requests hold rows too, the request that holds the most rows does at
    most max(ROWS_BESIDE, the next holder's rows) rows of work a step: that many of its decoding rows are fed
    (those fed longest ago first, the others keep their token for a later step), and as many prompt tokens
    prefilled. A step's cost is what every request pays per token, so a short request beside one of 64 jobs
    pays for a step of a few rows, not of max_batch; alone, a request feeds all its rows.

    slots:  0 .. n-1             decoding rows (a view of the cache's first n rows; the fused step reads a
                                 largest request's share of them in place, by slot)
            n .. max_batch-1     rows filling their cache, and free slots

    rows:   a  a  a  a  .  .        a: 4 positions filled, feeds its 5th token
            b  b  .  .  .  .        b: 2 positions filled, feeds its 3rd  -> one [2, 1] forward
            c  c  c  .  .  .        c: filling: 3 of its 5 prompt tokens in, 2 more at the next step

A row moves by copying its cache positions: when a decoding job ends the last decoding row takes its place,
and a row whose cache is full swaps into slot n.

The prefix cache (prefix.py; `Batcher(prefix_bytes=)`, 0: none): the whole blocks of every prompt chunk a
row prefills, and of a row's window when its job ends, are kept; a filling row starts from the longest
prefix of its tokens the cache holds (not the last token: its logits are computed), so a chat's next turn
computes only what is new, clients sharing a system prompt compute it once, and so do the n choices of a
request (their jobs prefill in order: the second finds the first's blocks). A job that scores its prompt
(echo with logprobs) computes every position. A hit is exact on the fused step (below); on the BLAS path,
to float32 rounding, as batching is.

A job the engine could not run is refused by submit (check_job), and an exception inside a step ends only
the jobs it touched, with an "error" event (Batcher.step): the other rows and the waiting jobs go on. A
cancelled job (client gone) leaves at the next step.

The context window follows session.py's rule, so a request's output is `generate`'s: when a row would
pass ctx_len positions, its window jumps to its last ctx_len // 2 tokens (at least the newest one:
cache.kept_on_jump) and its cache is refilled (as a filling row: step 2).

Equal output alone or beside others: every row's computation is the same arithmetic whatever the other
rows hold and however it was scheduled (parking copies a row's cache exactly; a prompt prefilled in chunks
computes each position as in one piece). In the fused step it is the same bits (a row's products do not
depend on the rows sharing its pass, its attention reads its own cache row); on the BLAS path (masked keys
get probability exactly 0) BLAS picks its kernels by the number of rows, so logits differ in the last bits
(~1e-6 relative) and greedy tokens agree unless two logits tie that closely (tests/test_infer_engine.py
checks tokens and logits, alone vs batched vs `generate`).
"""
from __future__ import annotations

import itertools
import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ..errors import UserError
from . import step
from .cache import kept_on_jump, new_cache, rows
from .prefix import BLOCK, PrefixCache
from .sampling import MIN_TEMPERATURE, log_softmax, sample_token, top_logprobs

SEED_LIMIT = 1 << 64  # seeds are integers in [0, 2**64)
ROWS_BESIDE = 4  # rows of work a step does for the largest request while others hold rows (Batcher._largest)
MAX_TEMPERATURE = 100.0


class QueueFull(Exception):
    """The waiting queue is at its limit (the HTTP layer answers 429)."""


class Closed(Exception):
    """The engine is shutting down and takes no new jobs."""


class BadJob(ValueError):
    """A job with a field the engine cannot run (submit refuses it; the HTTP layer answers 400)."""


@dataclass(eq=False)
class Job:
    """One generation request as the engine sees it (token ids in, token events out).

    on_event(kind, *args) is called from the engine thread:
      ("prompt", [(id, logprob or None, top), ...])  only with echo and logprobs: the prompt scored
      ("token", id, logprob or None, top)             each new token (</s> included when it ends the job)
      ("done", reason)                                reason: "stop" (a stop id), "length", "cancelled", "shutdown"
      ("error", message, request_fault)               the job failed: it ends here, instead of "done"; request_fault:
                                                      its own input's fault (its grammar), not the engine's
    top is a list of (id, logprob) of the `logprobs` most likely tokens, or None. Every job ends with exactly
    one "done" or "error"; on_event must not raise.
    constraint (grammar.py's Constraint, or any object with mask / advance / finished): each token is sampled,
    and its logprobs taken, from `constraint.mask(logits)` (tokens the grammar refuses at -inf), then
    `constraint.advance(token)`; the job ends ("stop") once `constraint.finished` (nothing but an end may follow).
    submit() refuses, with BadJob, a job whose fields the engine could not run (check_job). Jobs with the same
    `group` are one request: rows are shared fairly between requests (module docstring).
    """
    ids: list[int]
    max_tokens: int
    temperature: float = 0.0
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop_ids: tuple = ()
    logprobs: int | None = None
    echo: bool = False
    on_event: Callable = lambda *a: None
    group: object = None  # the request the job belongs to (any object; None: a request of its own)
    constraint: object = None  # a grammar.Constraint: the tokens it may sample (None: any)
    cancelled: bool = False
    submitted: float = field(default_factory=time.perf_counter)

    def cancel(self) -> None:
        """Ask the engine to drop this job (it leaves at the next step; its row is freed)."""
        self.cancelled = True


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _is_real(x) -> bool:
    return _is_int(x) or (isinstance(x, (float, np.floating)) and math.isfinite(x))


def check_job(job: Job, vocab_size: int) -> None:
    """Raise BadJob, naming the field, for a job the engine could not run; every other job is served.

        check_job(Job([1, 2], 4, seed=-1), 40)  -> BadJob: seed must be an integer in [0, 2**64), got -1
        check_job(Job([1, 2], 4, seed=7), 40)   -> None
    """
    def bad(field: str, rule: str):
        raise BadJob(f"{field} must be {rule}, got {getattr(job, field)!r}"[:300])
    ids = job.ids
    if not isinstance(ids, (list, tuple)) or not ids or not all(_is_int(t) and 0 <= t < vocab_size for t in ids):
        bad("ids", f"a non-empty list of token ids in [0, {vocab_size})")
    if not _is_int(job.max_tokens) or job.max_tokens < 0:
        bad("max_tokens", "an integer >= 0")
    t = job.temperature
    if not _is_real(t) or not (t == 0 or MIN_TEMPERATURE <= t <= MAX_TEMPERATURE):
        bad("temperature", f"0 (greedy) or a number in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}]")
    if job.top_k is not None and (not _is_int(job.top_k) or job.top_k < 0):
        bad("top_k", "None or an integer >= 0")
    if job.top_p is not None and (not _is_real(job.top_p) or not 0 < job.top_p <= 1):
        bad("top_p", "None or a number in (0, 1]")
    if job.seed is not None and (not _is_int(job.seed) or not 0 <= job.seed < SEED_LIMIT):
        bad("seed", "None or an integer in [0, 2**64)")
    if not isinstance(job.stop_ids, (tuple, list, set, frozenset)) or not all(_is_int(t) for t in job.stop_ids):
        bad("stop_ids", "a tuple of token ids")
    if job.logprobs is not None and (not _is_int(job.logprobs) or not 0 <= job.logprobs <= vocab_size):
        bad("logprobs", f"None or an integer in [0, {vocab_size}]")
    if not isinstance(job.echo, bool):
        bad("echo", "True or False")
    if not callable(job.on_event):
        bad("on_event", "callable")
    if job.constraint is not None and not all(callable(getattr(job.constraint, f, None)) for f in ("mask", "advance")):
        bad("constraint", "None or an object with mask(logits) and advance(token)")


class _Seq:
    """A job as the engine runs it: the tokens its cache row holds or is filling (its window), how many of them
    are in the cache, the token waiting to be fed, the logits at its last position, its random generator,
    how many tokens it has made, its slot (None while waiting) and, parked, its cache positions."""

    def __init__(self, job: Job, ctx_len: int, order: int):
        self.job, self.order = job, order
        self.group: _Group | None = None
        self.rng = np.random.default_rng(job.seed)
        self.seq = [int(t) for t in job.ids[-ctx_len:]]
        self.filled = 0
        self.pending: int | None = None
        self.logits: np.ndarray | None = None  # [V]
        self.n_new = 0
        self.reused = 0  # positions copied from the prefix cache
        self.slot: int | None = None
        self.decoded_at = -1  # the engine step that last fed it a token
        self.saved: tuple | None = None  # parked: (k, v) [layers, Hkv, filled, hd]
        scored = job.echo and job.logprobs is not None  # the prompt's own scores, filled chunk by chunk
        self.scored: list | None = [(self.seq[0], None, None)] if scored else None

    def ready(self) -> bool:
        """Its cache is full and it has a token to sample or feed: it decodes."""
        return self.filled == len(self.seq) and (self.logits is not None or self.pending is not None)


class _Group:
    """The jobs of one request: those waiting for a row (parked ones first), and how many rows it holds."""

    def __init__(self, order: int):
        self.order, self.held = order, 0
        self.waiting: deque[_Seq] = deque()


class Batcher:
    """The engine: a batched KV cache, a bounded queue of waiting requests, and `step` (module docstring).

        b = Batcher(model, max_batch=8); b.submit(Job(ids, 16, on_event=print)); while b.step(): pass
    or b.start() to run steps on a background thread until b.close().
    """

    def __init__(self, model, max_batch: int = 32, max_queue: int = 64, prefill_tokens: int = 64,
                 ctx_len: int | None = None, prefix_bytes: int = 0):
        cfg = self.cfg = model.config
        self.ctx_len = int(ctx_len or cfg.ctx_len)  # positions a row holds: its window (module docstring)
        if not 1 <= self.ctx_len <= cfg.ctx_len:
            raise ValueError(f"ctx_len must be in [1, {cfg.ctx_len}], got {self.ctx_len}")
        self.max_batch, self.max_queue = int(max_batch), int(max_queue)  # max_queue: requests waiting
        self.prefill_tokens = int(prefill_tokens)  # prompt tokens a request prefills a step (module docstring)
        self.W = step.fuse_weights(cfg, model.params, batched=True)
        self.cache = new_cache(cfg, self.max_batch, self.ctx_len, dtype=model.dtype)  # (float16 model: float32)
        k = self.cache.store[0]  # [layers, max_batch, Hkv, ctx_len, hd]
        self.prefixes = PrefixCache(prefix_bytes, 2 * k[:, 0, :, :BLOCK].nbytes)  # (module docstring)
        self.prefilled = self.reused = self.hits = 0  # positions computed, copied; jobs that copied some
        self.slots: list[_Seq | None] = [None] * self.max_batch
        self.n_dec = 0  # slots 0 .. n_dec-1 decode
        self.groups: dict[object, _Group] = {}  # requests with a waiting job or a row, in arrival order
        self.parked = 0  # waiting jobs that hold a copy of their cache
        self.counter = itertools.count()
        self.cond = threading.Condition()
        self.closed = False
        self.thread: threading.Thread | None = None
        self.steps = self.tokens = 0
        self.largest: tuple = (None, 0)  # this step's (request held to a share, its rows of work): _largest
        self.batch_sizes: list[int] = []  # rows in each decoding step (tests read it; kept short)

    # ---- the queue -------------------------------------------------------------------------------
    def submit(self, job: Job) -> None:
        """Queue a job; raises BadJob for fields the engine cannot run (check_job), QueueFull when it would make
        more than max_queue requests wait (jobs of a request that already waits always join it), Closed after
        close()."""
        check_job(job, self.cfg.vocab_size)
        s = _Seq(job, self.ctx_len, next(self.counter))
        key = job if job.group is None else job.group
        with self.cond:
            if self.closed:
                raise Closed("the server is shutting down")
            g = self.groups.get(key)
            if (g is None or not g.waiting) and len(self.groups) >= self.max_queue:
                waiting = sum(1 for h in self.groups.values() if h.waiting)
                if waiting >= self.max_queue:
                    raise QueueFull(f"{waiting} requests are already waiting (limit {self.max_queue})")
            if g is None:
                g = self.groups[key] = _Group(s.order)
            s.group = g
            g.waiting.append(s)
            self.cond.notify()

    def stats(self) -> dict:
        """The engine's state (rows in use, jobs queued and parked, KV positions filled of max_batch x ctx_len) and
        counters (decoding steps, tokens sampled, the prefix cache's); safe to call from any thread."""
        with self.cond:
            queued = sum(len(g.waiting) for g in self.groups.values())
        live = [s for s in self.slots if s is not None]
        return {"active": len(live), "queued": queued, "parked": self.parked,
                "max_batch": self.max_batch, "max_queue": self.max_queue, "steps": self.steps, "tokens": self.tokens,
                "kv_positions": sum(s.filled for s in live), "kv_capacity": self.max_batch * self.ctx_len,
                "prefix_cache": {"hits": self.hits, "reused_tokens": self.reused, "prefilled_tokens": self.prefilled,
                                 "bytes": self.prefixes.nbytes,
                                 "budget_bytes": self.prefixes.budget}}

    # ---- one engine step -------------------------------------------------------------------------
    def step(self) -> bool:
        """Schedule, prefill, sample, decode (module docstring). Returns False when there was nothing to do.
        An exception inside the step ends only the jobs it touched, each with an "error" event: a failed
        prefill its row, a failed sample its row, a failed decoding step the rows in it. Waiting jobs and the
        other rows go on."""
        with self.cond:
            self._schedule()
            self.largest = self._largest()
        if not any(self.slots):
            return False
        self._prefill()
        self._sample()
        if self.n_dec:
            self._decode()
        return True

    def _schedule(self) -> None:
        """Cancelled jobs that do not decode end here; free rows go to waiting jobs, parking rows of the largest
        holder while a waiting request holds two fewer (module docstring). Called with the lock held."""
        for g in self.groups.values():
            if any(s.job.cancelled for s in g.waiting):
                for s in [s for s in g.waiting if s.job.cancelled]:
                    g.waiting.remove(s)
                    self.parked -= s.saved is not None
                    s.job.on_event("done", "cancelled")
        for s in self.slots[self.n_dec:]:
            if s is not None and s.job.cancelled:
                self._keep(s)
                self._free(s)
                s.job.on_event("done", "cancelled")
        while (g := min((g for g in self.groups.values() if g.waiting), default=None,
                        key=lambda g: (g.held, g.order))) is not None:
            slot = next((i for i in range(self.n_dec, self.max_batch) if self.slots[i] is None), None)
            if slot is None:
                holder = max(self.groups.values(), key=lambda h: (h.held, h.order))
                if holder.held <= g.held + 1 or self.parked >= self.max_batch:
                    break
                slot = self._park(min((s for s in self.slots if s is not None and s.group is holder),
                                      key=lambda s: (s.filled, -s.order)))
            self._start(g.waiting.popleft(), slot)
        for key in [k for k, g in self.groups.items() if not g.held and not g.waiting]:
            del self.groups[key]

    def _largest(self) -> tuple:
        """(the request holding more rows than any other while others hold rows too, the rows of work it gets
        a step: max(ROWS_BESIDE, the next holder's rows)), or (None, 0). Called with the lock held."""
        holders = sorted((g for g in self.groups.values() if g.held), key=lambda g: g.held)
        if len(holders) < 2 or holders[-1].held == holders[-2].held:
            return None, 0
        return holders[-1], max(ROWS_BESIDE, holders[-2].held)

    def _start(self, s: _Seq, slot: int) -> None:
        """Give a waiting job a free slot (>= n_dec); a parked one gets its cache back."""
        self.slots[slot], s.slot = s, slot
        s.group.held += 1
        if s.saved is not None:
            for kv, part in zip(self.cache.store[:2], s.saved):  # [layers, max_batch, Hkv, ctx_len, hd]
                kv[:, slot, :, :s.filled] = part
            s.saved = None
            self.parked -= 1
        if s.ready():
            self._promote(s)

    def _park(self, s: _Seq) -> int:
        """Take a job's row away: its cache positions are copied aside and it waits first in its request's
        queue -> the slot freed."""
        if s.filled:
            k, v, _ = self.cache.store
            s.saved = (k[:, s.slot, :, :s.filled].copy(), v[:, s.slot, :, :s.filled].copy())
            self.parked += 1
        group = s.group
        slot = self._free(s)
        group.waiting.appendleft(s)
        return slot

    def _free(self, s: _Seq) -> int:
        """Take s out of its slot -> the slot that is free now: a decoding row's place is taken by the last
        decoding row (its cache positions copied), so the decoding rows stay 0 .. n_dec-1."""
        r, s.slot = s.slot, None
        s.group.held -= 1
        if r >= self.n_dec:
            self.slots[r] = None
            return r
        last = self.n_dec - 1
        if r != last:
            moved = self.slots[last]
            self._copy(last, r, moved.filled)
            self.slots[r], moved.slot = moved, r
        self.slots[last] = None
        self.n_dec -= 1
        return last

    def _promote(self, s: _Seq) -> None:
        """A row whose cache is full joins the decoding rows: it swaps into slot n_dec."""
        a, b = s.slot, self.n_dec
        if a != b:
            other = self.slots[b]
            k, v, _ = self.cache.store
            held = (k[:, b, :, :other.filled].copy(), v[:, b, :, :other.filled].copy()) if other else None
            self._copy(a, b, s.filled)
            if other is not None:
                k[:, a, :, :other.filled], v[:, a, :, :other.filled] = held
                other.slot = a
            self.slots[a], self.slots[b], s.slot = other, s, b
        self.n_dec += 1

    def _copy(self, src: int, dst: int, n: int) -> None:
        """Cache positions 0..n-1 of slot src into slot dst."""
        for kv in self.cache.store[:2]:  # [layers, max_batch, Hkv, ctx_len, hd]
            kv[:, dst, :, :n] = kv[:, src, :, :n]

    def _prefill(self) -> None:
        """Advance the filling rows: each request by up to prefill_tokens computed tokens, its jobs in order,
        each first copying what the prefix cache holds of its tokens (_reuse; copies are not counted)."""
        by_group: dict[_Group, list[_Seq]] = {}
        for s in sorted((s for s in self.slots[self.n_dec:] if s is not None), key=lambda s: s.order):
            by_group.setdefault(s.group, []).append(s)
        big, cap = self.largest
        for group, seqs in by_group.items():
            share = min(self.prefill_tokens, cap) if group is big else self.prefill_tokens
            for s in seqs:
                if share <= 0:
                    break
                try:
                    self._reuse(s)
                    n = min(share, len(s.seq) - s.filled)
                    share -= n
                    self._fill(s, n)
                except Exception as e:
                    self._free(s)
                    _fail([s.job], e)

    def _fill(self, s: _Seq, n: int) -> None:
        """The next n tokens of s into its cache row; the prompt's scores of those positions (echo with
        logprobs); its logits at the last one (a new prompt). Full: it joins the decoding rows."""
        a, b = s.filled, s.filled + n
        view = rows(self.cache, s.slot, 1)
        view.length = a
        tokens = np.asarray(s.seq[a:b], dtype=np.int64)[None]  # [1, n]
        h = step.forward_hidden(self.cfg, self.W, tokens, view, last_only=s.scored is None)[0]  # [n|1, d]
        done = b == len(s.seq)
        if s.scored is not None:
            logits = step.head_logits(self.cfg, self.W, h)  # [n, V]: row i predicts token a+i+1
            m = min(b, len(s.seq) - 1) - a
            logp = log_softmax(logits[:m])
            s.scored += [(t, float(logp[i, t]), top_logprobs(logp[i], s.job.logprobs))
                         for i, t in enumerate(s.seq[a + 1:a + 1 + m])]
            if done:
                s.logits = logits[-1]
                s.job.on_event("prompt", s.scored)
                s.scored = None
        elif done and s.pending is None:
            s.logits = step.head_logits(self.cfg, self.W, h[-1:])[-1]
        s.filled = b
        self.prefilled += n
        self._keep(s)
        if done:
            self._promote(s)

    def _reuse(self, s: _Seq) -> None:
        """Copy into s's row the positions past s.filled that the prefix cache holds of its tokens (all but the
        last token, whose logits the prefill computes); a job that scores its prompt computes every position."""
        if s.scored is not None:
            return
        n, blocks = self.prefixes.match(s.seq, len(s.seq) - 1)
        if n <= s.filled:
            return
        k, v, _ = self.cache.store  # [layers, max_batch, Hkv, ctx_len, hd]
        for i in range(s.filled // BLOCK, n // BLOCK):
            a = i * BLOCK
            k[:, s.slot, :, a:a + BLOCK], v[:, s.slot, :, a:a + BLOCK] = blocks[i]
        self.hits += s.reused == 0
        self.reused += n - s.filled
        s.reused += n - s.filled
        s.filled = n

    def _keep(self, s: _Seq) -> None:
        """The whole blocks of s's filled positions into the prefix cache (those it holds already are not copied)."""
        k, v, _ = self.cache.store
        self.prefixes.insert(s.seq, s.filled, lambda a, b: (k[:, s.slot, :, a:b], v[:, s.slot, :, a:b]))

    def _sample(self) -> None:
        """Every decoding row without a token to feed samples one; ended jobs free their rows (reversed, so
        that the row moved into a freed slot has been seen already)."""
        for r in reversed(range(self.n_dec)):
            s = self.slots[r]
            try:
                reason = "cancelled" if s.job.cancelled else None if s.pending is not None else self._sample_one(s)
            except Exception as e:
                self._free(s)
                _fail([s.job], e)
                continue
            if reason:
                self._keep(s)
                self._free(s)
                s.job.on_event("done", reason)

    def _sample_one(self, s: _Seq) -> str | None:
        """Sample the row's next token and report it; the reason the job ends, or None."""
        job = s.job
        if s.n_new >= job.max_tokens:
            return "length"
        logits = s.logits if job.constraint is None else job.constraint.mask(s.logits)  # [V]
        token = sample_token(logits, job.temperature, job.top_k, job.top_p, s.rng)
        lp, top = None, None
        if job.logprobs is not None:
            logp = log_softmax(logits)
            lp, top = float(logp[token]), top_logprobs(logp, job.logprobs)
        s.logits = None
        if job.constraint is not None:
            job.constraint.advance(token)
        self.tokens += 1
        job.on_event("token", token, lp, top)
        if token in job.stop_ids:
            return "stop"
        s.n_new += 1
        if job.constraint is not None and job.constraint.finished:
            return "stop"
        if s.n_new >= job.max_tokens:
            return "length"
        s.pending = token
        return None

    def _decode(self) -> None:
        """Feed every decoding row's token in one forward. A row whose window is full jumps first (session.py's
        rule: it keeps its last kept_on_jump(ctx) tokens, the new one included) and refills its cache as a
        filling row."""
        ctx = self.ctx_len
        for r in reversed(range(self.n_dec)):
            s = self.slots[r]
            if len(s.seq) + 1 > ctx:
                window = (s.seq + [s.pending])[-kept_on_jump(ctx):]
                s.seq, s.pending, s.filled = window[:-1], window[-1], 0
                group, slot = s.group, self._free(s)
                self.slots[slot], s.slot = s, slot
                group.held += 1
                if s.ready():  # (an empty window: nothing to refill)
                    self._promote(s)
        dec = self.slots[:self.n_dec]
        if not dec:
            return
        run = self._turn(dec)
        tokens = np.array([s.pending for s in run], dtype=np.int64)  # [n]
        pos = np.array([len(s.seq) for s in run], dtype=np.int64)  # [n]
        slots = None if len(run) == len(dec) else np.array([s.slot for s in run], dtype=np.int64)
        try:
            logits = step.decode_rows(self.cfg, self.W, self.cache, tokens, pos, slots)  # [n, V]
        except Exception as e:
            for s in sorted(run, key=lambda s: -s.slot):
                self._free(s)
            return _fail([s.job for s in run], e)
        for s, lg in zip(run, logits):
            s.seq.append(s.pending)
            s.filled += 1
            s.pending, s.logits = None, lg
            s.decoded_at = self.steps
        self.steps += 1
        self.batch_sizes = (self.batch_sizes + [len(run)])[-1000:]

    def _turn(self, dec: list[_Seq]) -> list[_Seq]:
        """The decoding rows this step feeds, in slot order: all of them but the largest request's beyond its
        share (self.largest), those fed longest ago first."""
        big, cap = self.largest
        mine = [s for s in dec if s.group is big]
        if len(mine) <= cap:
            return dec
        fed = set(sorted(mine, key=lambda s: (s.decoded_at, s.order))[:cap])
        return [s for s in dec if s.group is not big or s in fed]

    # ---- the background thread -------------------------------------------------------------------
    def start(self) -> "Batcher":
        self.thread = threading.Thread(target=self._loop, name="nanoeuler-batcher", daemon=True)
        self.thread.start()
        return self

    def _loop(self) -> None:
        """Steps until close(). BLAS runs on one thread here: OpenBLAS's helper threads spin while they wait,
        and would take the core the HTTP event loop needs; see fast/parallel.py. On the BLAS path (models
        without the fused step) only decoding steps of step.WIDE_STEP rows or more, whose matrix products are
        long enough to pay, use every core. The fused step's helpers claim work only while a step runs
        (pool.py)."""
        from ..fast.parallel import single_threaded_blas
        with single_threaded_blas():
            self._run()

    def _run(self) -> None:
        while True:
            with self.cond:
                while not self.closed and not any(self.slots) and not any(g.waiting for g in self.groups.values()):
                    self.cond.wait()
                if self.closed:
                    break
            try:
                self.step()
            except Exception as e:  # (step ends the jobs an exception touches; this is the last guard)
                live = [s for s in self.slots if s is not None]
                for s in live:
                    s.group.held -= 1
                self.slots, self.n_dec = [None] * self.max_batch, 0
                _fail([s.job for s in live], e)
        self._end_all("shutdown")

    def _end_all(self, reason: str) -> None:
        jobs = [s.job for s in self.slots if s is not None]
        self.slots, self.n_dec = [None] * self.max_batch, 0
        with self.cond:
            jobs += [s.job for g in self.groups.values() for s in g.waiting]
            self.groups, self.parked = {}, 0
        for job in jobs:
            job.on_event("done", reason)

    def close(self, timeout: float = 10.0) -> None:
        """Stop taking jobs, end every active and waiting one with reason "shutdown", stop the thread."""
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        if self.thread is not None:
            self.thread.join(timeout)
        else:
            self._end_all("shutdown")


def _fail(jobs: list[Job], e: Exception) -> None:
    """End jobs the engine failed on: each gets ("error", message, the request's fault). A UserError is the
    request's own (its grammar failing while decoding: grammar.GrammarError), told by its message alone; any
    other exception is the engine's."""
    request_fault = isinstance(e, UserError)
    message = str(e) if request_fault else f"engine error: {type(e).__name__}: {e}"
    for job in jobs:
        job.on_event("error", message[:500], request_fault)
