"""The HTTP application: OpenAI-compatible routes over a Batcher, the limits, and the uvicorn runner.

    GET  /                      the web chat page (static/index.html)
    GET  /health                {"status": "ok", "active": .., "queued": .., ...}
    GET  /v1/models             the one model this server holds (named after the checkpoint directory)
    POST /v1/completions        text in, text out; stream, logprobs + echo (what evaluation harnesses use)
    POST /v1/chat/completions   messages rendered with the model's chat template, as the `chat` REPL does
    GET  /tokenizer_info, POST /tokenize, /detokenize   vLLM-style, so lm-eval can tokenize as we do

Every error is an OpenAI error object {"error": {"message", "type", "param", "code"}} with its status:
400 bad request (malformed JSON and wrong types included), 401 missing/wrong API key, 404 unknown model
or route, 413 body over the cap, 429 queue full, 503 shutting down, 500 never shows a stack trace (an engine
failure on a request: code "engine_error"; in a stream, a `data: {"error": ...}` event, then [DONE]).

Streams are server-sent events, one `data: {chunk}` per piece of text, ending with `data: [DONE]`.
A client that goes away cancels its jobs (their batch rows are free at the next engine step).
"""
from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import random
import threading
import time
from contextlib import asynccontextmanager
from http import HTTPStatus
from pathlib import Path

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import UserError
from ..infer.engine import SEED_LIMIT, BadJob, Batcher, Closed, Job, QueueFull
from ..infer.sampling import MIN_TEMPERATURE
from ..infer.session import truncate_left
from .protocol import (ChatRequest, CompletionRequest, DetokenizeRequest, TextStream, TokenizeRequest,
                       render_chat, stop_list, token_text)

STATIC = Path(__file__).parent / "static"
INLINE_CHARS = 4096  # a request's text up to this long is tokenized on the event loop (see on_loop_if_short)
READ_TIMEOUT = 30.0  # seconds a request may take to arrive whole (http_protocol)
DONE = "data: [DONE]\n\n"  # a stream's last event


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param=None, code=None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code


def error_body(message: str, type: str = "invalid_request_error", param=None, code=None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_json(status: int, message: str, type: str = "invalid_request_error", param=None, code=None) -> JSONResponse:
    return JSONResponse(error_body(message, type, param, code), status)


class BodyLimit:
    """ASGI middleware: 413 for a request body over `limit` bytes, by Content-Length or (chunked uploads) by
    reading it: the body is read here, at most limit + 1 bytes, then handed to the app. A body still arriving
    when the server begins to shut down (`closing` is set) is answered 503 at once: shutdown does not wait
    for bytes that may never come."""

    def __init__(self, app, limit: int, closing: asyncio.Event):
        self.app, self.limit, self.closing = app, limit, closing

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None:
            if not length.isdigit():
                return await error_json(400, "bad Content-Length header")(scope, receive, send)
            if int(length) > self.limit:
                return await self._too_large(scope, receive, send)
        body, more = [], True
        size = 0
        while more:
            message = await self._receive(receive)
            if message is None:
                return await error_json(503, "the server is shutting down", "server_error",
                                        code="shutting_down")(scope, receive, send)
            if message["type"] != "http.request":  # the client left while sending
                return
            body.append(message.get("body", b""))
            size += len(body[-1])
            more = message.get("more_body", False)
            if size > self.limit:
                return await self._too_large(scope, receive, send)
        replay = [{"type": "http.request", "body": b"".join(body), "more_body": False}]

        async def replay_receive():
            return replay.pop() if replay else await receive()
        await self.app(scope, replay_receive, send)

    async def _receive(self, receive):
        """The next message of the request, or None once the server is shutting down."""
        if self.closing.is_set():
            return None
        get, stop = asyncio.ensure_future(receive()), asyncio.ensure_future(self.closing.wait())
        try:
            await asyncio.wait((get, stop), return_when=asyncio.FIRST_COMPLETED)
        finally:
            get.cancel(), stop.cancel()
        return get.result() if get.done() and not get.cancelled() else None

    async def _too_large(self, scope, receive, send):
        await error_json(413, f"request body larger than {self.limit} bytes", code="body_too_large")(scope, receive, send)


class EventStream(StreamingResponse):
    """A server-sent-events reply whose status line and headers leave with its first events when these come
    within HEADERS_WAIT seconds (a stream's first token, after its prompt): one socket write and one wake
    of the client, not two during the prompt's forward pass. A request that waits longer (for a free row,
    or a long prompt) gets its headers at HEADERS_WAIT, so its client knows it was taken. The chunk that
    ends with [DONE] ends the reply too (one message less through the middleware)."""

    HEADERS_WAIT = 0.05

    async def stream_response(self, send) -> None:
        chunks = aiter(self.body_iterator)
        first = asyncio.ensure_future(anext(chunks, None))
        try:
            await asyncio.wait({first}, timeout=self.HEADERS_WAIT)
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            chunk = await first
        finally:
            first.cancel()  # (the client went away before the first events: stop waiting for them)
        while chunk is not None and not chunk.endswith(DONE):
            await send({"type": "http.response.body", "body": chunk.encode(), "more_body": True})
            chunk = await anext(chunks, None)
        await send({"type": "http.response.body", "body": (chunk or "").encode(), "more_body": False})
        await chunks.aclose()


class OneSendPerPass:
    """A transport that sends, in one system call, everything written to it during one pass of the event
    loop (the first write schedules the send for the end of the pass): a stream's headers and first events,
    its last events and the chunked encoding's end, go out together. Each send is a system call and wakes
    the client, time taken from the decoding threads where cores are few. Everything else is the wrapped
    transport's."""

    def __init__(self, transport):
        self._transport, self._pending = transport, []

    def write(self, data) -> None:
        if not self._pending:
            asyncio.get_running_loop().call_soon(self._send)
        self._pending.append(bytes(data))

    def _send(self) -> None:
        data, self._pending = b"".join(self._pending), []
        if data and not self._transport.is_closing():
            self._transport.write(data)

    def close(self) -> None:
        self._send()
        self._transport.close()

    def __getattr__(self, name):
        return getattr(self._transport, name)


def http_protocol(read_timeout: float = READ_TIMEOUT):
    """uvicorn's HTTP/1.1 protocol over OneSendPerPass transports: httptools' (llhttp, C), which parses and
    frames a stream in less time than h11's pure Python (docs/benchmarks.md, Serving). Two rules of its own:

    - a request llhttp cannot parse (a bad request line, a negative or 20-digit Content-Length, Content-Length
      with Transfer-Encoding, bytes after a body that begin no request) is answered 400 with an OpenAI error
      object naming llhttp's reason, as every other error (uvicorn answers in text), and the connection closes;
      bytes that follow a body whose answer is already streaming get it after that answer, not inside it;
    - a request must arrive whole within read_timeout seconds of its connection or of its first byte, else
      408 (an error object) and the connection closes: a client that stalls half-way no longer holds its
      connection, and the handler reading its body, for ever."""
    import httptools
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class Protocol(HttpToolsProtocol):
        read_timer: asyncio.TimerHandle | None = None  # runs while a request is arriving
        refusal: tuple | None = None  # (status, message, code) to answer once the answer on its way is sent

        def connection_made(self, transport) -> None:
            super().connection_made(OneSendPerPass(transport))
            self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._arm()

        def on_message_complete(self) -> None:
            self._disarm()
            super().on_message_complete()

        def data_received(self, data: bytes) -> None:
            self._unset_keepalive_if_required()
            try:
                self.parser.feed_data(data)
            except httptools.HttpParserUpgrade:
                self._unsupported_upgrade_warning()  # (ws="none": an upgrade is served as a plain request)
            except httptools.HttpParserError as e:
                self._malformed(str(e))

        def _malformed(self, reason: str) -> None:
            if self.cycle is not None and not self.cycle.response_complete:
                reason += " (after a request's body: is its Content-Length shorter than the body?)"
            self._refuse(400, f"malformed HTTP request: {reason}", "malformed_request")

        def _arm(self) -> None:
            if self.read_timer is None:
                self.read_timer = self.loop.call_later(read_timeout, self._timed_out)

        def _disarm(self) -> None:
            if self.read_timer is not None:
                self.read_timer.cancel()
                self.read_timer = None

        def _timed_out(self) -> None:
            self.read_timer = None
            self._refuse(408, f"the request did not arrive within {read_timeout:g} s", "request_timeout")

        def _refuse(self, status: int, message: str, code: str) -> None:
            """Answer with an error object and close the connection (an ASGI cycle still reading its body gets a
            disconnect); while an answer is being sent, after it (reading stops meanwhile)."""
            self._disarm()
            cycle = self.cycle
            if cycle is not None and cycle.response_started and not cycle.response_complete:
                self.refusal = (status, message, code)
                self.flow.pause_reading()
                return
            if self.transport.is_closing():
                return
            body = json.dumps(error_body(message, code=code)).encode()
            head = [f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\n".encode()]
            head += [name + b": " + value + b"\r\n" for name, value in self.server_state.default_headers]
            head += [b"content-type: application/json\r\n", b"content-length: %d\r\n" % len(body),
                     b"connection: close\r\n\r\n"]
            self.transport.write(b"".join(head) + body)
            self.transport.close()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self.refusal is not None and not self.pipeline:
                refusal, self.refusal = self.refusal, None
                self._refuse(*refusal)
    return Protocol


# ---- one request's jobs --------------------------------------------------------------------------
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
    """The jobs of one HTTP request; engine events arrive (from the engine thread) on one asyncio queue."""

    def __init__(self, batcher: Batcher, dispatcher: Dispatcher):
        self.batcher, self.dispatcher, self.queue = batcher, dispatcher, asyncio.Queue()
        self.choices: list[Choice] = []

    def add(self, choice: Choice, **job) -> None:
        started = []  # the job's first token has been handed over

        def on_event(kind, *args, _i=len(self.choices)):
            now = kind in ("done", "error") or (kind == "token" and not started)
            if kind == "token":
                started.append(True)
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

    async def finish(self, request: Request) -> None:
        """A non-streaming request: wait until every choice has finished (or the client has gone); whatever
        ends the wait, no job is left running."""
        try:
            async for _ in self.updates(request):
                pass
        finally:
            self.cancel()

    async def updates(self, request: Request | None = None):
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


async def on_loop_if_short(size: int, fn, *args):
    """fn(*args), which reads `size` characters, token ids or logprob values of a request: on the event loop
    when they are at most INLINE_CHARS (such work takes about what the hop to a worker thread and back would
    add to the request), else on a worker thread (a megabyte of text, or the JSON of many choices' top
    logprobs, takes the loop seconds, and it must go on serving every other client meanwhile)."""
    return fn(*args) if size <= INLINE_CHARS else await run_in_threadpool(fn, *args)


def logprob_values(choices, top: int | None) -> int:
    """The logprob values a reply writes for its choices' logprobs entries, each with `top` more."""
    return sum(len(c.logprobs) for c in choices) * (1 + (top or 0))


WARM_UP = [  # (method, path, body): what run_server sends through the app before it announces its port
    ("POST", "/v1/completions", {"prompt": "Hello", "max_tokens": 2, "stream": True}),  # sampling, a stream
    ("POST", "/v1/completions", {"prompt": ["Hello"] * 8, "max_tokens": 2, "temperature": 0, "logprobs": 2,
                                 "echo": True}),  # greedy, prompts scored, a wide decoding step, one reply
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2,
                                      "top_p": 0.9, "top_k": 40, "logprobs": True, "top_logprobs": 2}),
    ("POST", "/tokenize", {"prompt": "Hello"}), ("POST", "/detokenize", {"tokens": [0]}),
    ("GET", "/", None), ("GET", "/v1/models", None), ("GET", "/health", None)]


async def warm_up(app) -> list[int]:
    """The WARM_UP requests through the whole app, in this process -> their statuses. What a first request of
    each kind builds (FastAPI's and pydantic's validators, the tokenizer's, the chat template's and the
    engine's compiled parts loaded from their cache, ...) is built before the server announces its port and
    freezes its objects (run_server)."""
    return [await asgi_request(app, method, path, body) for method, path, body in WARM_UP]


async def asgi_request(app, method: str, path: str, body: dict | None = None) -> int:
    """One request through the ASGI app in this process (a JSON body gets the app's model name, and the API
    key when there is one), its reply read to the end -> its status."""
    s = app.state.service
    data = b"" if body is None else json.dumps({"model": s.model_name, **body}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    if s.api_key:
        headers.append((b"authorization", f"Bearer {s.api_key}".encode()))
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": method, "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "headers": headers, "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0)}
    request, answered, status = [{"type": "http.request", "body": data, "more_body": False}], asyncio.Event(), []

    async def receive():
        if request:
            return request.pop()
        await answered.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        if message["type"] == "http.response.start":
            status.append(message["status"])
        elif message["type"] == "http.response.body" and not message.get("more_body"):
            answered.set()
    await app(scope, receive, send)
    return status[0]


def request_id() -> str:
    """24 random hex digits naming a response. Not a secret: Python's generator, not os.urandom, whose system
    call gives the GIL up on the request's path (the engine thread takes it; the loop then waits for it)."""
    return f"{random.getrandbits(96):024x}"


def end_token(tok) -> str | None:
    """The tokenizer's end-of-text special token: </s> (ours), else <|endoftext|> (an imported GPT-2), else None."""
    specials = getattr(tok, "special_tokens", {})
    return next((s for s in ("</s>", "<|endoftext|>") if s in specials), None)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# ---- the application -----------------------------------------------------------------------------
class Service:
    """What the routes serve, one per app (`app.state.service`): the model, its tokenizer, the Batcher that
    decodes for every request, the limits, and the shutdown signal. The routes below read it from their
    request; they hold no state of their own."""

    def __init__(self, model, tok, model_name: str, api_key: str | None, max_batch: int, max_queue: int,
                 max_tokens_cap: int, max_n: int, chat_max_tokens: int, ctx_len: int | None = None):
        from ..checkpoint import check_vocab
        check_vocab(model.config, tok)
        self.model, self.tok, self.cfg = model, tok, model.config
        self.model_name, self.api_key = model_name, api_key
        self.batcher = Batcher(model, max_batch, max_queue, ctx_len=ctx_len)
        self.ctx_len = self.batcher.ctx_len  # a request's window: its prompt keeps its last ctx_len tokens
        self.max_queue, self.max_tokens_cap, self.max_n = max_queue, max_tokens_cap, max_n
        self.chat_max_tokens = chat_max_tokens
        self.eos_name = end_token(tok)
        self.created = int(time.time())
        self.page = (STATIC / "index.html").read_text(encoding="utf-8")
        self.closing = asyncio.Event()  # set when shutdown begins (begin_shutdown)
        self.loop: asyncio.AbstractEventLoop | None = None  # the event loop serving the app, once started
        self.dispatcher: Dispatcher | None = None

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

    def run(self, body, prompts: list[list[int]], max_tokens: int, logprobs, echo: bool, chat: bool) -> Run:
        """A request's choices (n per prompt), submitted to the batcher."""
        run, stops = Run(self.batcher, self.dispatch()), stop_list(body.stop)
        for ids in prompts:
            for j in range(body.n):
                c = Choice(len(run.choices), self.tok, ids, stops, self.stop_ids(body), chat=chat)
                run.add(c, **self.job_args(body, ids, max_tokens, logprobs, echo, j))
        run.submit()
        return run


def service(request: Request) -> Service:
    return request.app.state.service


def usage(prompts, choices) -> dict:
    p = sum(len(ids) for ids in prompts)
    c = sum(ch.n_tokens for ch in choices)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def sse(obj) -> str:
    return "data: " + json.dumps(obj, ensure_ascii=False) + "\n\n"


def stream_response(gen, run: Run, usage_chunk=None) -> EventStream:
    """The SSE reply: gen yields one list of events per batch of engine events, written at once; the list
    that ends the run takes usage_chunk() (the usage, when asked) and [DONE] with it: the reply's end is
    one socket write (each write wakes the client, a process on the same cores)."""
    async def body():
        try:
            ended = False
            try:
                async for events in gen:
                    if run.finished():
                        events += ([usage_chunk()] if usage_chunk else []) + [DONE]
                        ended = True
                    if events:
                        yield "".join(events)
            except APIError as e:  # the engine failed on a choice: the stream says so and ends
                yield sse(error_body(e.message, e.type, e.param, e.code)) + DONE
                ended = True
            if not ended:
                yield DONE
        finally:
            run.cancel()  # the client went away or we are done: free the rows now
    return EventStream(body(), media_type="text/event-stream",
                       headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


# ---- errors: every one an OpenAI error object ----
async def api_error(request, e: APIError):
    return error_json(e.status, e.message, e.type, e.param, e.code)


async def user_error(request, e: UserError):
    return error_json(400, str(e))


async def invalid_request(request, e: RequestValidationError):
    errs = e.errors()
    first = errs[0] if errs else {"loc": (), "msg": "invalid request"}
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    if first.get("type") == "json_invalid":
        return error_json(400, "the request body is not valid JSON: " + str(first.get("msg")), code="invalid_json")
    where = ".".join(loc)
    return error_json(400, f"{where + ': ' if where else ''}{first.get('msg')}"
                           + (f" (and {len(errs) - 1} more problem(s))" if len(errs) > 1 else ""),
                      param=loc[0] if loc else None, code="invalid_value")


async def http_error(request, e: StarletteHTTPException):
    return error_json(e.status_code, str(e.detail), "invalid_request_error" if e.status_code < 500 else "server_error")


async def internal_error(request, e: Exception):
    return error_json(500, f"internal error ({type(e).__name__})", "server_error")


async def auth(request: Request) -> None:
    api_key = service(request).api_key
    if api_key is None:
        return
    header = request.headers.get("authorization", "")
    given = header[7:] if header[:7].lower() == "bearer " else ""
    if not hmac.compare_digest(given.encode(), api_key.encode()):
        raise APIError(401, "missing or wrong API key (send 'Authorization: Bearer KEY')", code="invalid_api_key")


# ---- routes ----
routes = APIRouter()
KEYED = [Depends(auth)]  # routes that need the API key, when the server has one


@routes.get("/", response_class=HTMLResponse, include_in_schema=False)
async def index(request: Request):
    return HTMLResponse(service(request).page)


@routes.get("/health")
async def health(request: Request):
    s = service(request)
    return {"status": "ok", "model": s.model_name, **s.batcher.stats()}


def model_card(s: Service) -> dict:
    return {"id": s.model_name, "object": "model", "created": s.created, "owned_by": "nanoeuler",
            "context_length": s.ctx_len}


@routes.get("/v1/models", dependencies=KEYED)
async def models(request: Request):
    return {"object": "list", "data": [model_card(service(request))]}


@routes.get("/v1/models/{name}", dependencies=KEYED)
async def one_model(name: str, request: Request):
    s = service(request)
    s.check_model(name)
    return model_card(s)


@routes.get("/tokenizer_info", dependencies=KEYED)
async def tokenizer_info(request: Request):
    s = service(request)
    return {"eos_token": s.eos_name, "bos_token": s.tok.bos_token, "pad_token": s.eos_name,
            "model_max_length": s.ctx_len, "vocab_size": s.tok.vocab_size}


@routes.post("/tokenize", dependencies=KEYED)
async def tokenize(body: TokenizeRequest, request: Request):
    s = service(request)

    # add_special_tokens: the bos an imported Llama-3 tokenizer carries, as Hugging Face adds it.
    # A long text goes off the event loop, as the routes' prompts do (on_loop_if_short).
    def answer():  # (the JSON of a million ids too)
        ids = s.tok.encode(body.prompt, allow_special=True, add_bos=body.add_special_tokens)
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": s.ctx_len})
    return await on_loop_if_short(len(body.prompt), answer)


@routes.post("/detokenize", dependencies=KEYED)
async def detokenize(body: DetokenizeRequest, request: Request):
    s = service(request)

    def answer():
        s.check_ids(body.tokens, "tokens")
        return {"prompt": s.tok.decode(body.tokens)}
    return await on_loop_if_short(len(body.tokens), answer)


@routes.post("/v1/completions", dependencies=KEYED)
async def completions(body: CompletionRequest, request: Request):
    s = service(request)
    s.check_model(body.model)
    max_tokens = min(16, s.max_tokens_cap) if body.max_tokens is None else body.max_tokens
    p = body.prompt
    raw = [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p)
    if not raw:
        raise APIError(400, "the prompt is empty", param="prompt", code="invalid_value")
    s.check_limits(max_tokens, body.n, body.seed, len(raw))
    size = sum(len(item) for item in raw)  # characters or ids
    prompts, truncated = await on_loop_if_short(size, s.prompt_ids, raw)
    run = s.run(body, prompts, max_tokens, body.logprobs, body.echo, chat=False)
    reply = CompletionReply(s, body, run, prompts, truncated)
    if body.stream:
        with_usage = body.stream_options and body.stream_options.include_usage
        return stream_response(reply.events(), run, reply.usage_event if with_usage else None)
    await run.finish(request)
    return await on_loop_if_short(logprob_values(run.choices, body.logprobs), reply.whole)


@routes.post("/v1/chat/completions", dependencies=KEYED)
async def chat_completions(body: ChatRequest, request: Request):
    s = service(request)
    s.check_model(body.model)
    max_tokens = next((m for m in (body.max_completion_tokens, body.max_tokens) if m is not None),
                      min(s.chat_max_tokens, s.max_tokens_cap))
    s.check_limits(max_tokens, body.n, body.seed)
    # a chat template renders in a worker process that may take its whole time limit (chat_template.py):
    # never on the event loop, where it would stall every other client
    ids, notes = await run_in_threadpool(render_chat, s.model, s.tok, body.messages, max_tokens)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    run = s.run(body, [ids], max_tokens, logprobs, False, chat=True)
    reply = ChatReply(s, run, ids, notes, logprobs)
    if body.stream:
        with_usage = body.stream_options and body.stream_options.include_usage
        return stream_response(reply.events(), run, reply.usage_event if with_usage else None)
    await run.finish(request)
    return await on_loop_if_short(logprob_values(run.choices, logprobs), reply.whole)


class CompletionReply:
    """The reply to /v1/completions, streamed (`events`) or whole (`whole`); with echo, each choice's text
    begins with its prompt."""

    def __init__(self, s: Service, body: CompletionRequest, run: Run, prompts: list, truncated: list[int]):
        self.s, self.body, self.run, self.prompts = s, body, run, prompts
        self.id, self.created = "cmpl-" + request_id(), int(time.time())
        self.notes = {"nanoeuler": {"prompt_truncated_tokens": truncated}} if any(truncated) else {}
        for c in run.choices:
            c.base = len(self.echo_text(c))

    def chunk(self, choices, **extra) -> dict:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.s.model_name,
                "choices": choices, **extra}

    def echo_text(self, c: Choice) -> str:
        return self.s.tok.decode(c.prompt_ids) if self.body.echo else ""

    def usage_event(self) -> str:
        return sse(self.chunk([], usage=usage(self.prompts, self.run.choices)))

    async def events(self):
        first, ended = set(), set()
        async for batch in self.run.updates():
            events = []
            for c, (text, n_lp) in batch.items():
                if c.index in ended:
                    continue
                if c.finish_reason:
                    ended.add(c.index)
                if c.index not in first and (text or n_lp or c.finish_reason):
                    first.add(c.index)
                    text = self.echo_text(c) + text
                if not (text or n_lp or c.finish_reason):
                    continue
                lp = c.completion_logprobs(len(c.logprobs) - n_lp) if self.body.logprobs is not None else None
                events.append(sse(self.chunk([{"index": c.index, "text": text, "logprobs": lp,
                                               "finish_reason": c.finish_reason}], **self.notes)))
            yield events

    def whole(self) -> JSONResponse:
        choices = [{"index": c.index, "text": self.echo_text(c) + c.text,
                    "logprobs": c.completion_logprobs() if self.body.logprobs is not None else None,
                    "finish_reason": c.finish_reason} for c in self.run.choices]
        return JSONResponse(self.chunk(choices, usage=usage(self.prompts, self.run.choices), **self.notes))


class ChatReply:
    """The reply to /v1/chat/completions, streamed (`events`: a role delta first, a finish delta last) or
    whole (`whole`)."""

    def __init__(self, s: Service, run: Run, ids: list[int], notes: dict, logprobs: int | None):
        self.s, self.run, self.ids, self.logprobs = s, run, ids, logprobs
        self.id, self.created = "chatcmpl-" + request_id(), int(time.time())
        self.extra = {"nanoeuler": notes} if notes else {}

    def chunk(self, choices, **more) -> dict:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.s.model_name, "system_fingerprint": None, "choices": choices, **self.extra, **more}

    def usage_event(self) -> str:
        return sse(self.chunk([], usage=usage([self.ids], self.run.choices)))

    async def events(self):
        yield [sse(self.chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                "logprobs": None, "finish_reason": None}])) for c in self.run.choices]
        ended = set()
        async for batch in self.run.updates():
            events = []
            for c, (piece, n_lp) in batch.items():
                if c.index in ended:
                    continue
                lp = c.chat_logprobs(len(c.logprobs) - n_lp) if self.logprobs is not None and n_lp else None
                if piece or lp:
                    events.append(sse(self.chunk([{"index": c.index, "delta": {"content": piece}, "logprobs": lp,
                                                   "finish_reason": None}])))
                if c.finish_reason:
                    ended.add(c.index)
                    events.append(sse(self.chunk([{"index": c.index, "delta": {}, "logprobs": None,
                                                   "finish_reason": c.finish_reason}])))
            yield events

    def whole(self) -> JSONResponse:
        return JSONResponse({
            "id": self.id, "object": "chat.completion", "created": self.created, "model": self.s.model_name,
            "system_fingerprint": None,
            "choices": [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                         "logprobs": c.chat_logprobs() if self.logprobs is not None else None,
                         "finish_reason": c.finish_reason} for c in self.run.choices],
            "usage": usage([self.ids], self.run.choices), **self.extra})


@asynccontextmanager
async def lifespan(app):
    s = app.state.service
    s.loop = asyncio.get_running_loop()
    s.batcher.start()
    yield
    s.batcher.close()


def create_app(model, tok, model_name: str, *, api_key: str | None = None, max_batch: int = 32,
               max_queue: int = 64, max_tokens_cap: int = 1024, max_n: int = 8, body_limit: int = 1 << 20,
               chat_max_tokens: int = 256, ctx_len: int | None = None) -> FastAPI:
    """The FastAPI app serving `model` (its Batcher starts with the app and stops with it); ctx_len: the positions
    a request's row holds (default: the model's context)."""
    s = Service(model, tok, model_name, api_key, max_batch, max_queue, max_tokens_cap, max_n, chat_max_tokens,
                ctx_len)
    app = FastAPI(title="nanoeuler", version="1", lifespan=lifespan, docs_url=None, redoc_url=None,
                  description="An OpenAI-compatible API over a nanoeuler checkpoint.")
    app.state.service = s
    app.add_middleware(BodyLimit, limit=body_limit, closing=s.closing)
    for kind, handler in ((APIError, api_error), (UserError, user_error), (RequestValidationError, invalid_request),
                          (StarletteHTTPException, http_error), (Exception, internal_error)):
        app.add_exception_handler(kind, handler)
    app.include_router(routes)
    return app


# ---- the runner ----------------------------------------------------------------------------------
def bind(host: str, port: int):
    """A listening socket on host:port (port 0: any free one); a port in use is a UserError. Its protocol
    is named (IPPROTO_TCP): asyncio turns Nagle's algorithm off (TCP_NODELAY) only on connections of such
    sockets, and with it on, a stream's later chunk waits for the client's delayed acknowledgement of the
    one before (a keep-alive client gets a reply's end tens of ms late)."""
    import socket
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as e:
        sock.close()
        why = "the port is in use" if e.errno == 98 else e.strerror or str(e)
        raise UserError(f"cannot listen on {host}:{port}: {why}")
    sock.set_inheritable(True)
    return sock


def run_server(app: FastAPI, sock, log_level: str = "warning", on_ready=None) -> None:
    """Serve until SIGINT/SIGTERM; on_ready() once the app is warm (WARM_UP) and ready for its first request
    (the CLI prints the address then). On a signal the engine ends every open stream (finish_reason "length",
    then `data: [DONE]`), connections close, and this returns normally (the CLI then exits 0)."""
    import gc
    import signal
    import sys

    import uvicorn

    # The engine thread gives the GIL up in every compiled step and large NumPy call, and takes it back
    # only when the event loop's thread yields it: by default after 5 ms of Python. With many streams the
    # loop always has Python to run, so each step could lose ms waiting; 0.5 ms bounds that wait
    # (docs/benchmarks.md, Serving).
    sys.setswitchinterval(0.0005)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            app.state.service.begin_shutdown()
            super().handle_exit(sig, frame)

        async def startup(self, sockets=None):
            await super().startup(sockets=sockets)
            if self.should_exit:
                return
            await warm_up(app)
            # What the server holds now lives as long as it does: out of the garbage collector's generations,
            # whose oldest one a collection walks whole, holding the GIL and stalling every stream.
            gc.collect()
            gc.freeze()
            if on_ready is not None:
                on_ready()

    config = uvicorn.Config(app, log_level=log_level, http=http_protocol(), ws="none", lifespan="on",
                            timeout_graceful_shutdown=10, access_log=log_level in ("info", "debug"))
    # uvicorn re-raises the signal it caught once it has shut down; with these handlers that is a no-op,
    # so a signal ends the process with status 0 instead of 130 / -15.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *a: None)
    Server(config).run(sockets=[sock])
