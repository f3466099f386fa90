"""The service behind the routes: a request's fields checked, its prompts and choices turned into engine jobs,
and the engine's token events turned back into text, logprobs and finish reasons on the event loop.

    Service     one per app: the model, its tokenizer, the Batcher (infer/engine.py) on its thread, the
                limits, the shutdown signal; `run` submits a request's jobs
    Run         the jobs of one request and the queue their events arrive on
    Choice      one choice: engine events -> text (stop strings, UTF-8 safe), logprobs entries, finish_reason
    Dispatcher  engine events into the event loop, in batches (one pass of the HTTP path per batch)

Nothing here knows HTTP beyond the status an APIError (protocol.py) carries: app.py maps requests and replies.
"""
from __future__ import annotations

import asyncio
import threading
import time

from ..infer.engine import SEED_LIMIT, BadJob, Batcher, Closed, Job, QueueFull
from ..infer.sampling import MIN_TEMPERATURE
from ..infer.session import truncate_left
from .metrics import Metrics
from .protocol import APIError, TextStream, stop_list, token_text

PROMPT_CACHE_MIB = 1024  # the prefix cache's default budget (engine.py): ~23,000 positions of SmolLM2's keys and values


class Choice:
    """One choice of a response: turns the engine's token events into text (stop strings, UTF-8 safe),
    logprobs entries and a finish_reason."""

    def __init__(self, index: int, tok, prompt_ids: list[int], stops: list[str], stop_ids: set, chat: bool):
        self.index, self.tok, self.prompt_ids, self.stop_ids, self.chat = index, tok, prompt_ids, stop_ids, chat
        self.stream = TextStream(tok, stops)
        self.text, self.n_tokens = "", 0
        self.base = 0                 # characters before the completion (the echoed prompt)
        self.logprobs: list = []      # (token, logprob, top, text_offset) of every scored token
        self.finish_reason: str | None = None
        self.job: Job | None = None

    def on_events(self, events: list) -> tuple[str, int]:
        """Apply a batch of engine events [(kind, args)] -> (new text, how many logprobs entries they added).
        A run of tokens without logprobs, in a stream without stop strings, is decoded in one go."""
        text, n_lp, run = "", 0, []
        for kind, args in events:
            if kind == "token" and args[1] is None and not self.stream.stops:
                run.append(args[0])
                continue
            if run:
                text, run = text + self._plain_tokens(run), []
            piece, n = self.on_event(kind, args)
            text, n_lp = text + piece, n_lp + n
        return (text + self._plain_tokens(run) if run else text), n_lp

    def _plain_tokens(self, tokens: list[int]) -> str:
        """on_event of each token, for tokens without logprobs and a stream without stop strings."""
        if self.finish_reason is not None:
            return ""
        tokens = [t for t in tokens if t not in self.stop_ids]
        self.n_tokens += len(tokens)
        piece = self.stream.feed_many(tokens)
        self.text += piece
        return piece

    def on_event(self, kind: str, args) -> tuple[str, int]:
        """Apply one engine event -> (new text, how many logprobs entries it added)."""
        if self.finish_reason is not None:
            return "", 0
        n_lp = len(self.logprobs)
        if kind == "prompt":
            offset = 0
            dec = TextStream(self.tok, [])
            for token, lp, top in args[0]:
                self.logprobs.append((token, lp, top, offset))
                offset += len(dec.feed(token))
            return "", len(self.logprobs) - n_lp
        if kind == "token":
            token, lp, top = args
            offset = self.base + self.stream.length + len(self.stream.held)
            if lp is not None and not (self.chat and token in self.stop_ids):
                self.logprobs.append((token, lp, top, offset))
            if token in self.stop_ids:
                return "", len(self.logprobs) - n_lp
            self.n_tokens += 1
            piece = self.stream.feed(token)
            if self.stream.stopped:
                piece += self._finish("stop")
            self.text += piece
            return piece, len(self.logprobs) - n_lp
        if kind == "done":
            reason = args[0]
            piece = self._finish("stop" if reason in ("stop", "cancelled") else "length")
            self.text += piece
            return piece, len(self.logprobs) - n_lp
        if len(args) > 1 and args[1]:  # "error", the request's fault: its grammar failed while decoding
            raise APIError(400, str(args[0]), code="invalid_value")
        raise APIError(500, str(args[0]), "server_error", code="engine_error")  # "error": the engine failed

    def _finish(self, reason: str) -> str:
        self.finish_reason = reason
        if self.job is not None:
            self.job.cancel()
        return self.stream.flush()

    # ---- logprobs in the two OpenAI layouts ----
    def completion_logprobs(self, start: int = 0, end: int | None = None) -> dict:
        entries = self.logprobs[start:end]
        return {"tokens": [token_text(self.tok, t) for t, _, _, _ in entries],
                "token_logprobs": [lp for _, lp, _, _ in entries],
                "top_logprobs": [None if top is None else {token_text(self.tok, i): p for i, p in top}
                                 for _, _, top, _ in entries],
                "text_offset": [o for _, _, _, o in entries]}

    def chat_logprobs(self, start: int = 0, end: int | None = None) -> dict:
        def item(t, p):
            return {"token": token_text(self.tok, t), "logprob": p, "bytes": list(self.tok.token_bytes(t))}
        return {"content": [{**item(t, lp), "top_logprobs": [item(i, p) for i, p in top or []]}
                            for t, lp, top, _ in self.logprobs[start:end]]}



class Dispatcher:
    """Engine events into the event loop, in batches. The engine thread appends them under a lock (a token
    costs it no system call); the first event after a quiet spell wakes the loop at once (call_soon_threadsafe,
    so a first token is not delayed), and while events keep coming the loop collects them itself every
    WINDOW seconds (a timer of its own): each request's queue gets one list per batch, and the HTTP path
    (detokenizing, one SSE chunk, one socket write) runs once per batch instead of once per token. A job's
    first token and its last event (done, error) wake the loop at once too: neither a reply's start (its
    prompt event opens a window just before the first token) nor its end waits for the window.

    WINDOW is 50 ms: text reaches a reader 20 times a second, and a stream pays one pass of the HTTP path
    per window: event-loop time that, where cores are few, a decoding thread waits out. Shorter windows
    cost a stream more (docs/benchmarks.md, Serving: 10, 30 and 50 ms measured)."""

    WINDOW = 0.05  # seconds: at most this late does a token reach its request while a stream flows

    def __init__(self, loop):
        self.loop, self.lock = loop, threading.Lock()
        self.items: list = []
        self.scheduled = False
        self.timer: asyncio.TimerHandle | None = None  # the next look, while events flow (loop thread only)

    def put(self, queue: asyncio.Queue, item, now: bool = False) -> None:
        """From the engine thread: item for queue; now: hand it over at once (a job's first token, its end)."""
        with self.lock:
            self.items.append((queue, item))
            if self.scheduled and not now:
                return
            self.scheduled = True
        try:
            self.loop.call_soon_threadsafe(self._drain_now)
        except RuntimeError:  # the event loop is gone (shutdown): nobody listens any more
            pass

    def _drain_now(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self._drain()

    def _drain(self) -> None:
        """Hand what arrived to its queues and look again in WINDOW seconds; nothing arrived: go quiet (the
        next event wakes the loop)."""
        self.timer = None
        with self.lock:
            items, self.items = self.items, []
            self.scheduled = bool(items)
        if not items:
            return
        batches: dict = {}
        for queue, item in items:
            batches.setdefault(queue, []).append(item)
        for queue, batch in batches.items():
            queue.put_nowait(batch)
        self.timer = self.loop.call_later(self.WINDOW, self._drain)



class Run:
    """The jobs of one HTTP request; engine events arrive (from the engine thread) on one asyncio queue.
    metrics: the app's Metrics (each job's token times), or None."""

    def __init__(self, batcher: Batcher, dispatcher: Dispatcher, metrics=None):
        self.batcher, self.dispatcher, self.queue = batcher, dispatcher, asyncio.Queue()
        self.metrics = metrics
        self.choices: list[Choice] = []

    def add(self, choice: Choice, **job) -> None:
        started = []  # the job's first token has been handed over
        timed = self.metrics.token_clock(time.perf_counter()) if self.metrics else None

        def on_event(kind, *args, _i=len(self.choices)):
            now = kind in ("done", "error") or (kind == "token" and not started)
            if kind == "token":
                started.append(True)
                if timed:
                    timed()
            self.dispatcher.put(self.queue, (_i, kind, args), now=now)
        choice.job = Job(on_event=on_event, group=self, **job)  # (rows are shared fairly between requests)
        self.choices.append(choice)

    def submit(self) -> None:
        try:
            for c in self.choices:
                self.batcher.submit(c.job)
        except QueueFull as e:
            self.cancel()
            raise APIError(429, f"the server is busy: {e}; retry later", "rate_limit_exceeded",
                           code="rate_limit_exceeded")
        except Closed as e:
            self.cancel()
            raise APIError(503, str(e), "server_error", code="shutting_down")
        except BadJob as e:  # (the routes check every field first: this is the engine's own last word)
            self.cancel()
            raise APIError(400, str(e), code="invalid_value")

    def cancel(self) -> None:
        for c in self.choices:
            c.job.cancel()

    def finished(self) -> bool:
        """Every choice has its finish_reason."""
        return all(c.finish_reason is not None for c in self.choices)

    async def finish(self, request) -> None:
        """A non-streaming request: wait until every choice has finished (or the client has gone: request's
        `await is_disconnected()`); whatever ends the wait, no job is left running."""
        try:
            async for _ in self.updates(request):
                pass
        finally:
            self.cancel()

    async def updates(self, request=None):
        """Batches of what changed: {choice: (new text, new logprobs entries)}, every event that has arrived
        folded into one batch (a client that reads slower than tokens come gets fewer, longer chunks),
        until every choice has finished. request: stop early when that client has gone (non-streaming)."""
        checked = time.monotonic()
        while not self.finished():
            if request is not None and time.monotonic() - checked > 0.5:
                checked = time.monotonic()
                if await request.is_disconnected():
                    self.cancel()
                    return
            if request is None:  # a stream: no timeout (wait_for's task costs each batch a pass of the loop)
                events = await self.queue.get()  # a Dispatcher batch
            else:
                try:
                    events = await asyncio.wait_for(self.queue.get(), 0.5)
                except asyncio.TimeoutError:
                    continue
            while not self.queue.empty():
                events += self.queue.get_nowait()
            by_choice: dict[int, list] = {}
            for i, kind, args in events:
                by_choice.setdefault(i, []).append((kind, args))
            yield {self.choices[i]: self.choices[i].on_events(evs) for i, evs in by_choice.items()}



def end_token(tok) -> str | None:
    """The tokenizer's end-of-text special token: </s> (ours), else <|endoftext|> (an imported GPT-2), else None."""
    specials = getattr(tok, "special_tokens", {})
    return next((s for s in ("</s>", "<|endoftext|>") if s in specials), None)



class Service:
    """What the routes serve, one per app (`app.state.service`): the model, its tokenizer, the Batcher that
    decodes for every request, the limits, and the shutdown signal. The routes (app.py) read it from their
    request; they hold no state of their own."""

    def __init__(self, model, tok, model_name: str, api_key: str | None, max_batch: int, max_queue: int,
                 max_tokens_cap: int, max_n: int, chat_max_tokens: int, ctx_len: int | None = None,
                 prompt_cache_mib: int = PROMPT_CACHE_MIB):
        from ..checkpoint import check_vocab
        check_vocab(model.config, tok)
        self.model, self.tok, self.cfg = model, tok, model.config
        self.model_name, self.api_key = model_name, api_key
        self.batcher = Batcher(model, max_batch, max_queue, ctx_len=ctx_len, prefix_bytes=prompt_cache_mib << 20)
        self.metrics = Metrics(self.batcher)
        self.ctx_len = self.batcher.ctx_len  # a request's window: its prompt keeps its last ctx_len tokens
        self.max_queue, self.max_tokens_cap, self.max_n = max_queue, max_tokens_cap, max_n
        self.chat_max_tokens = chat_max_tokens
        self.eos_name = end_token(tok)
        self.created = int(time.time())
        self.closing = asyncio.Event()  # set when shutdown begins (begin_shutdown)
        self.loop: asyncio.AbstractEventLoop | None = None  # the event loop serving the app, once started
        self.dispatcher: Dispatcher | None = None
        self._grammars = None  # infer/grammar.py's Grammars, built by the first request that needs one
        self._grammars_lock = threading.Lock()

    def begin_shutdown(self) -> None:
        """End the streams now (the lifespan shutdown joins the engine thread) and answer the bodies still
        arriving (BodyLimit); safe to call from a signal handler."""
        with self.batcher.cond:
            self.batcher.closed = True
            self.batcher.cond.notify_all()
        try:
            self.loop.call_soon_threadsafe(self.closing.set)
        except (AttributeError, RuntimeError):  # not started, or its loop is gone: no body is arriving
            pass

    def dispatch(self) -> Dispatcher:
        """The dispatcher of the running event loop (one per loop)."""
        loop = asyncio.get_running_loop()
        if self.dispatcher is None or self.dispatcher.loop is not loop:
            self.dispatcher = Dispatcher(loop)
        return self.dispatcher

    # ---- a request's fields, checked before anything reaches the engine ----
    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server has {self.model_name!r}",
                           param="model", code="model_not_found")

    def check_limits(self, max_tokens: int, n: int, seed: int | None, n_prompts: int = 1) -> None:
        if max_tokens > self.max_tokens_cap:
            raise APIError(400, f"max_tokens {max_tokens} is over this server's limit of {self.max_tokens_cap}",
                           param="max_tokens", code="invalid_value")
        if n > self.max_n:
            raise APIError(400, f"n {n} is over this server's limit of {self.max_n}", param="n", code="invalid_value")
        if n * n_prompts > self.max_queue:
            raise APIError(400, f"{n * n_prompts} choices in one request; the limit is {self.max_queue}",
                           param="prompt", code="invalid_value")
        if seed is not None and seed + n > SEED_LIMIT:  # choice i samples with seed + i
            raise APIError(400, f"seed must be an integer in [0, 2**64 - n] (choice i of n samples with seed + i), "
                                f"got {seed}"[:300], param="seed", code="invalid_value")

    def check_ids(self, ids, param) -> None:
        if ids and (min(ids) < 0 or max(ids) >= self.cfg.vocab_size):
            raise APIError(400, f"token ids must lie in [0, {self.cfg.vocab_size})", param=param, code="invalid_value")

    def prompt_ids(self, raw: list) -> tuple[list[list[int]], list[int]]:
        """The prompts (texts or id lists) as ids kept to the context -> (ids, tokens dropped) per prompt."""
        prompts, truncated = [], []
        for item in raw:
            ids = self.tok.encode(item, add_bos=True) if isinstance(item, str) else list(item)  # bos as vLLM does
            if not ids:
                raise APIError(400, "the prompt is empty", param="prompt", code="invalid_value")
            self.check_ids(ids, "prompt")
            ids, dropped = truncate_left(ids, self.ctx_len)
            prompts.append(ids)
            truncated.append(dropped)
        return prompts, truncated

    # ---- constrained replies (infer/grammar.py) ----
    def grammars(self, param: str):
        """The tokenizer as the grammar library's, built on first use (a second for a 262,144-token vocabulary:
        call it off the event loop); 400 naming the extra when the library is not installed."""
        from ..infer.grammar import GrammarError, Grammars
        with self._grammars_lock:
            if self._grammars is None:
                try:
                    self._grammars = Grammars(self.tok, self.cfg.vocab_size)
                except GrammarError as e:
                    raise APIError(400, f"{param} is not available on this server: {e}", param=param,
                                   code="grammar_unavailable")
        return self._grammars

    def constraint(self, rf, forced: list[dict] | None = None, fmt=None):
        """The grammar a request's replies are kept to, compiled (a grammar.Constraint), or None: a call of one
        of the `forced` tools (ChatRequest.forced_tools) in the tool-call format fmt, or the JSON response_format
        rf asks for. A schema or grammar that does not compile: 400. Call it off the event loop (compiling
        takes milliseconds, the first call builds the vocabulary's tables)."""
        from ..infer.grammar import GrammarError
        from . import tool_calls
        if forced is None and (rf is None or rf.type == "text"):
            return None
        param = "tool_choice" if forced is not None else "response_format"
        g = self.grammars(param)
        try:
            grammar = (tool_calls.call_grammar(fmt or tool_calls.GENERIC, forced, g) if forced is not None
                       else g.json_schema(rf.reply_schema()))
            return g.constraint(grammar, param)
        except GrammarError as e:
            raise APIError(400, f"{param}: {e}", param=param, code="invalid_value")

    def stop_ids(self, body) -> set:
        """The ids that end a reply: eos and every end-of-turn token (tok.stop_ids), unless ignore_eos."""
        return set() if body.ignore_eos else set(self.tok.stop_ids)

    def job_args(self, body, ids, max_tokens, logprobs, echo=False, i=0) -> dict:
        seed = None if body.seed is None else body.seed + i
        # below MIN_TEMPERATURE, logits / T overflow: such a temperature is greedy (`sample` refuses it)
        t = body.temperature if body.temperature >= MIN_TEMPERATURE else 0.0
        return dict(ids=ids, max_tokens=max_tokens, temperature=t,
                    top_p=body.top_p if body.top_p < 1 else None, top_k=body.top_k or None, seed=seed,
                    stop_ids=tuple(self.stop_ids(body)), logprobs=logprobs, echo=echo)

    def run(self, body, prompts: list[list[int]], max_tokens: int, logprobs, echo: bool, chat: bool,
            constraint=None) -> Run:
        """A request's choices (n per prompt), submitted to the batcher (its prompt tokens counted once taken);
        constraint (Service.constraint): each choice keeps to a copy of it."""
        run, stops = Run(self.batcher, self.dispatch(), self.metrics), stop_list(body.stop)
        for ids in prompts:
            for j in range(body.n):
                c = Choice(len(run.choices), self.tok, ids, stops, self.stop_ids(body), chat=chat)
                run.add(c, **self.job_args(body, ids, max_tokens, logprobs, echo, j),
                        constraint=None if constraint is None else constraint.copy())
        run.submit()
        self.metrics.prompt_tokens.inc(sum(map(len, prompts)))
        return run

