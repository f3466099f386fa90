"""Continuous batching: many generation requests share each forward pass over one batched KV cache.

The cache holds, per layer, keys and values [max_batch, Hkv, ctx_len, hd]; row r of it belongs to the r-th
active request, which has its own length (the positions it has filled). One engine step:

    1. admit   waiting jobs take the free rows, up to `prefill_tokens` prompt tokens a step; each prompt is
               prefilled through the fused step in its own row of the cache (session.generate's
               prefill; on every core, faster than one batched BLAS forward on one), or, for models the
               fused step does not run (gpt2, float64), together (grouped by length, right-padded;
               step.forward_hidden on a view of their rows of the cache)
    2. sample  every row samples its next token from its head-0 logits (sampling.sample_token, with the
               job's own random generator): </s> or max_tokens ends the job and frees its row
    3. decode  one forward over all rows at once: row r feeds its new token at position length_r;
               attention masks every key past length_r, so rows of different lengths share the step
               (step.decode_rows: the fused step, each row attending to its own cache row, and the head in
               its kernel; models it does not run: the architecture's NumPy forward_rows, on BLAS)

    rows:   a  a  a  a  .  .        a: 4 positions filled, feeds its 5th token
            b  b  .  .  .  .        b: 2 positions filled, feeds its 3rd  -> one [2, 1] forward
            c  c  c  c  c  c        c: full (ctx_len): its window jumps first (below)

A job the engine could not run is refused by submit (check_job), and an exception inside a step ends only
the jobs it touched, with an "error" event (Batcher.step): the other rows and the waiting jobs go on.

Rows are kept compact: when a job ends, the last row moves into its place (its cache rows are copied),
so the batch is always rows 0..n-1 of the cache, a view and never a gather. A cancelled job (client gone)
leaves at the next step.

The context window follows session.py's rule, so a request's output is `generate`'s: when a row would
pass ctx_len positions, its window jumps to its last ctx_len // 2 tokens and its cache is refilled.

Equal output alone or in a batch: every row's computation is the same arithmetic whatever the other
rows hold. In the fused step it is the same bits (a row's products do not depend on the rows sharing
its pass, its attention reads its own cache row); on the BLAS path (masked keys get probability exactly
0) BLAS picks its kernels by the number of rows, so logits differ in the last bits (~1e-6 relative) and
greedy tokens agree unless two logits tie that closely (tests/test_infer_engine.py checks tokens and
logits, alone vs batched vs `generate`).
"""
from __future__ import annotations

import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from . import step
from .cache import new_cache, rows
from .sampling import MIN_TEMPERATURE, log_softmax, sample_token, top_logprobs
from .weights import linear

SEED_LIMIT = 1 << 64  # seeds are integers in [0, 2**64)
MAX_TEMPERATURE = 100.0


class QueueFull(Exception):
    """The waiting queue is at its limit (the HTTP layer answers 429)."""


class Closed(Exception):
    """The engine is shutting down and takes no new jobs."""


class BadJob(ValueError):
    """A job with a field the engine cannot run (submit refuses it; the HTTP layer answers 400)."""


@dataclass
class Job:
    """One generation request as the engine sees it (token ids in, token events out).

    on_event(kind, *args) is called from the engine thread:
      ("prompt", [(id, logprob or None, top), ...])  only with echo and logprobs: the prompt scored
      ("token", id, logprob or None, top)             each new token (</s> included when it ends the job)
      ("done", reason)                                reason: "stop" (a stop id), "length", "cancelled", "shutdown"
      ("error", message)                              the engine failed on this job: it ends here, instead of "done"
    top is a list of (id, logprob) of the `logprobs` most likely tokens, or None. Every job ends with exactly
    one "done" or "error"; on_event must not raise.
    submit() refuses, with BadJob, a job whose fields the engine could not run (check_job).
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


class _Row:
    """An active job: the tokens in its cache row (its window), the logits at its last position, the
    token waiting to be fed, its random generator and how many tokens it has made."""

    def __init__(self, job: Job):
        self.job, self.rng = job, np.random.default_rng(job.seed)
        self.seq: list[int] = []
        self.logits: np.ndarray | None = None  # [V]
        self.pending: int | None = None
        self.n_new = 0


class Batcher:
    """The engine: a batched KV cache, a bounded queue of waiting jobs, and `step` (see the module docstring).

        b = Batcher(model, max_batch=8); b.submit(Job(ids, 16, on_event=print)); while b.step(): pass
    or b.start() to run steps on a background thread until b.close().
    """

    def __init__(self, model, max_batch: int = 32, max_queue: int = 64, prefill_tokens: int = 2048):
        cfg = self.cfg = model.config
        self.max_batch, self.max_queue = int(max_batch), int(max_queue)
        self.prefill_tokens = int(prefill_tokens)  # prompt tokens admitted per step (at least one job)
        self.W = step.fuse_weights(cfg, model.params, batched=True)
        self.cache = new_cache(cfg, self.max_batch, dtype=model.dtype)  # (a float16 model's cache is float32)
        self.rows: list[_Row] = []
        self.pending: deque[Job] = deque()
        self.cond = threading.Condition()
        self.closed = False
        self.thread: threading.Thread | None = None
        self.steps = self.tokens = 0
        self.batch_sizes: list[int] = []  # rows in each decoding step (tests read it; kept short)

    # ---- the queue -------------------------------------------------------------------------------
    def submit(self, job: Job) -> None:
        """Queue a job; raises BadJob for fields the engine cannot run (check_job), QueueFull when max_queue
        jobs already wait, Closed after close()."""
        check_job(job, self.cfg.vocab_size)
        with self.cond:
            if self.closed:
                raise Closed("the server is shutting down")
            if len(self.pending) >= self.max_queue:
                raise QueueFull(f"{len(self.pending)} requests are already waiting (limit {self.max_queue})")
            self.pending.append(job)
            self.cond.notify()

    def stats(self) -> dict:
        return {"active": len(self.rows), "queued": len(self.pending), "max_batch": self.max_batch,
                "max_queue": self.max_queue, "steps": self.steps, "tokens": self.tokens}

    # ---- one engine step -------------------------------------------------------------------------
    def step(self) -> bool:
        """Admit, sample, decode (module docstring). Returns False when there was nothing to do.
        An exception inside the step ends only the jobs it touched, each with an "error" event: a failed
        admission its group's jobs (a group of several is retried one job at a time), a failed sample its
        row, a failed decoding step the rows in it. Waiting jobs and the other rows go on."""
        admit = self._take()
        lengths = [min(len(j.ids), self.cfg.ctx_len) for j in admit]
        one = step.runs_fused(self.W, self.cache)  # the fused step takes one prompt at a time, on every core
        groups = [[i] for i in range(len(admit))] if one else prefill_groups(lengths)
        for group in groups:
            self._admit_or_fail([admit[i] for i in group])
        if not self.rows:
            return bool(admit)
        for r in reversed(range(len(self.rows))):  # sample; reversed so that removing row r moves a done one
            row = self.rows[r]
            try:
                reason = "cancelled" if row.job.cancelled else self._sample(row)
            except Exception as e:
                self._remove(r)
                _fail([row.job], e)
                continue
            if reason:
                self._remove(r)
                row.job.on_event("done", reason)
        if self.rows:
            try:
                self._decode()
            except Exception as e:
                jobs = [row.job for row in self.rows]
                self.rows.clear()
                _fail(jobs, e)
        return True

    def _take(self) -> list[Job]:
        """The waiting jobs admitted at this step: free rows, up to prefill_tokens prompt tokens (at least one
        job); cancelled waiting jobs end here."""
        with self.cond:
            admit, budget = [], self.prefill_tokens
            while self.pending and len(self.rows) + len(admit) < self.max_batch:
                job = self.pending[0]
                if job.cancelled:
                    self.pending.popleft()
                    job.on_event("done", "cancelled")
                    continue
                n = min(len(job.ids), self.cfg.ctx_len)
                if admit and n > budget:  # the rest join at the next steps: running streams are not stalled long
                    break
                budget -= n
                admit.append(self.pending.popleft())
        return admit

    def _admit_or_fail(self, jobs: list[Job]) -> None:
        """_admit, and when it raises: its rows go, and its jobs are retried one by one (a group of several)
        or end with an "error" event (one job)."""
        n0 = len(self.rows)
        try:
            self._admit(jobs)
        except Exception as e:
            del self.rows[n0:]
            if len(jobs) == 1:
                return _fail(jobs, e)
            for job in jobs:
                self._admit_or_fail([job])

    def _admit(self, jobs: list[Job]) -> None:
        """Prefill new jobs together into the next free rows (each prompt keeps its last ctx_len tokens).
        Shorter prompts are padded on the right: causal attention keeps each row's positions blind to the
        padding after them, and the padding's keys/values sit past the row's length, masked and later
        overwritten. Events go out once every row is computed (a failed group sends none)."""
        ctx, n0 = self.cfg.ctx_len, len(self.rows)
        new = [_Row(job) for job in jobs]
        for row in new:
            row.seq = [int(t) for t in row.job.ids[-ctx:]]
        self.rows += new
        T = max(len(row.seq) for row in new)
        tokens = np.zeros((len(new), T), dtype=np.int64)  # [n, T], right-padded with token 0
        for r, row in enumerate(new):
            tokens[r, :len(row.seq)] = row.seq
        view = rows(self.cache, n0, len(new))  # (one prompt: session's fused step)
        scores = [row.job.echo and row.job.logprobs is not None for row in new]
        last_only = len(new) == 1 and not scores[0]
        h = step.forward_hidden(self.cfg, self.W, tokens, view, last_only=last_only)  # [n, T|1, d]
        prompts = []
        for r, (row, score) in enumerate(zip(new, scores)):
            job, n = row.job, len(row.seq)
            hr = h[r, -1:] if last_only else h[r, :n] if score else h[r, n - 1:n]  # [n|1, d]
            logits = linear(hr, self.W["head.0"])  # [n|1, V]
            if score:
                logp = log_softmax(logits[:-1])
                prompts.append((job, [(row.seq[0], None, None)] + [
                    (t, float(logp[i, t]), top_logprobs(logp[i], job.logprobs)) for i, t in enumerate(row.seq[1:])]))
            row.logits = logits[-1]
        for job, scored in prompts:
            job.on_event("prompt", scored)

    def _sample(self, row: _Row) -> str | None:
        """Sample the row's next token and report it; the reason the job ends, or None."""
        job = row.job
        if row.n_new >= job.max_tokens:
            return "length"
        token = sample_token(row.logits, job.temperature, job.top_k, job.top_p, row.rng)
        lp, top = None, None
        if job.logprobs is not None:
            logp = log_softmax(row.logits)
            lp, top = float(logp[token]), top_logprobs(logp, job.logprobs)
        row.logits = None
        self.tokens += 1
        job.on_event("token", token, lp, top)
        if token in job.stop_ids:
            return "stop"
        row.n_new += 1
        if row.n_new >= job.max_tokens:
            return "length"
        row.pending = token
        return None

    def _remove(self, r: int) -> None:
        """Free row r: the last row moves into it (cache rows copied up to its length)."""
        last = len(self.rows) - 1
        if r != last:
            n = len(self.rows[last].seq)
            for kv in self.cache.store[:2]:  # [layers, max_batch, Hkv, ctx_len, hd]
                kv[:, r, :, :n] = kv[:, last, :, :n]
            self.rows[r] = self.rows[last]
        self.rows.pop()

    def _prefill(self, slot: int, tokens: list[int], all_positions: bool = False) -> np.ndarray:
        """Run tokens alone into cache row `slot` from position 0 -> final hidden states [T|1, d]."""
        return step.forward_hidden(self.cfg, self.W, np.asarray(tokens, dtype=np.int64)[None], rows(self.cache, slot, 1),
                                   last_only=not all_positions)[0]

    def _decode(self) -> None:
        """Feed every row's pending token in one forward; rows whose window is full jump first."""
        ctx = self.cfg.ctx_len
        for slot, row in enumerate(self.rows):
            if len(row.seq) + 1 > ctx:  # session.py's rule: keep the last ctx // 2 tokens, new one included
                window = (row.seq + [row.pending])[-(ctx // 2):]
                row.seq = window[:-1]
                if row.seq:
                    self._prefill(slot, row.seq)
        tokens = np.array([row.pending for row in self.rows], dtype=np.int64)  # [n]
        pos = np.array([len(row.seq) for row in self.rows], dtype=np.int64)  # [n]
        logits = step.decode_rows(self.cfg, self.W, self.cache, tokens, pos)  # [n, V], row r in cache row r
        for row, lg in zip(self.rows, logits):
            row.seq.append(row.pending)
            row.pending, row.logits = None, lg
        self.steps += 1
        self.batch_sizes = (self.batch_sizes + [len(self.rows)])[-1000:]

    # ---- the background thread -------------------------------------------------------------------
    def start(self) -> "Batcher":
        self.thread = threading.Thread(target=self._loop, name="nanoeuler-batcher", daemon=True)
        self.thread.start()
        return self

    def _loop(self) -> None:
        """Steps until close(). BLAS runs on one thread here: OpenBLAS's helper threads spin while they wait,
        and would take the core the HTTP event loop needs (measured on 2 shared cores: 16 streams went from
        40 to 600 tokens/s); see fast/parallel.py. On the BLAS path (models without the fused step) only
        decoding steps of step.WIDE_STEP rows or more, whose matrix products are long enough to pay, use every
        core (`big`, quiet machine: 16 streams 1307-1403 -> 1372-1519 tokens/s, 64 streams 1716 ->
        1832-1912). The fused step's helpers claim work only while a step runs (kernels.py)."""
        from ..fast.parallel import single_threaded_blas
        with single_threaded_blas():
            self._run()

    def _run(self) -> None:
        while True:
            with self.cond:
                while not self.closed and not self.pending and not self.rows:
                    self.cond.wait()
                if self.closed:
                    break
            try:
                self.step()
            except Exception as e:  # (step ends the jobs an exception touches; this is the last guard)
                jobs = [row.job for row in self.rows]
                self.rows.clear()
                _fail(jobs, e)
        self._end_all("shutdown")

    def _end_all(self, reason: str) -> None:
        for row in self.rows:
            row.job.on_event("done", reason)
        self.rows.clear()
        with self.cond:
            jobs, self.pending = list(self.pending), deque()
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
    """End jobs the engine failed on: each gets ("error", message)."""
    for job in jobs:
        job.on_event("error", f"engine error: {type(e).__name__}: {e}"[:500])



def prefill_groups(lengths: list[int], waste: float = 1.25) -> list[list[int]]:
    """Indices of new prompts grouped for batched prefill: by length, each group padded to its longest
    costs at most `waste` x its real tokens.  prefill_groups([5, 50, 6, 48]) -> [[0, 2], [3, 1]]"""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    groups: list[list[int]] = []
    for i in order:
        g = groups[-1] if groups else None
        if g is not None and lengths[i] * (len(g) + 1) <= waste * (sum(lengths[j] for j in g) + lengths[i]):
            g.append(i)
        else:
            groups.append([i])
    return groups
