"""The HTTP application: OpenAI-compatible routes over the Service, request and reply mapping, and the runner.

    GET  /                      the web chat page (static/index.html)
    GET  /health                {"status": "ok", "active": .., "queued": .., "prefix_cache": {..}, ...}
    GET  /metrics               Prometheus' text format (metrics.py)
    GET  /v1/models             the one model this server holds (named after the checkpoint directory)
    POST /v1/completions        text in, text out; stream, logprobs + echo (what evaluation harnesses use)
    POST /v1/chat/completions   messages rendered with the model's chat template, as the `chat` REPL does
    GET  /tokenizer_info, POST /tokenize, /detokenize   vLLM-style, so lm-eval can tokenize as we do

Every error is an OpenAI error object {"error": {"message", "type", "param", "code"}} with its status:
400 bad request (malformed JSON and wrong types included; a grammar that fails while decoding: in a stream,
an error event), 401 missing/wrong API key, 404 unknown model
or route, 413 body over the cap, 429 queue full, 503 shutting down, 500 never shows a stack trace (an engine
failure on a request: code "engine_error"; in a stream, a `data: {"error": ...}` event, then [DONE]).

Streams are server-sent events, one `data: {chunk}` per piece of text, ending with `data: [DONE]`.
A client that goes away cancels its jobs (their batch rows are free at the next engine step).

The service (the engine, a request's jobs, events to text) is service.py; the transport under the app
(socket, HTTP protocol, body limit, stream writes) is transport.py.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import random
import time
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..chat_template import template_of
from ..errors import UserError
from . import tool_calls
from .protocol import (DONE, APIError, ChatRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest,
                       error_body, render_chat, sse)
from .metrics import RequestMetrics
from .service import PROMPT_CACHE_MIB, Choice, Run, Service
from .transport import BodyLimit, EventStream, error_json, http_protocol

STATIC = Path(__file__).parent / "static"
INLINE_CHARS = 4096  # a request's text up to this long is tokenized on the event loop (see on_loop_if_short)


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



def service(request: Request) -> Service:
    return request.app.state.service


def usage(prompts, choices) -> dict:
    p = sum(len(ids) for ids in prompts)
    c = sum(ch.n_tokens for ch in choices)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


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
    return HTMLResponse(request.app.state.page)


@routes.get("/health")
async def health(request: Request):
    s = service(request)
    return {"status": "ok", "model": s.model_name, **s.batcher.stats()}


@routes.get("/metrics", include_in_schema=False)
async def metrics(request: Request):
    m = service(request).metrics
    return Response(m.text(), media_type=m.content_type)


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
    constraint = await run_in_threadpool(s.constraint, body.response_format) if body.response_format else None
    run = s.run(body, prompts, max_tokens, body.logprobs, body.echo, chat=False, constraint=constraint)
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
    variables = body.template_variables()
    ids, notes = await run_in_threadpool(render_chat, s.model, s.tok, body.messages, max_tokens, s.ctx_len, variables)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    fmt = tool_calls.format_of(template_of(s.tok))
    forced = body.forced_tools()
    constrained = body.response_format is not None or forced is not None
    constraint = await run_in_threadpool(s.constraint, body.response_format, forced, fmt) if constrained else None
    run = s.run(body, [ids], max_tokens, logprobs, False, chat=True, constraint=constraint)
    tools = {t["function"]["name"] for t in variables.get("tools", [])}
    reply = ChatReply(s, run, ids, notes, logprobs, tools, fmt)
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
    whole (`whole`). With tools offered, a choice's text is parsed for calls in the template's format
    (tool_calls.py) when it ends (finish_reason "tool_calls" when it calls); a stream sends its content up to
    where a call might begin, and the rest of its content and its `delta.tool_calls` in one delta before the
    finish."""

    def __init__(self, s: Service, run: Run, ids: list[int], notes: dict, logprobs: int | None,
                 tools: set[str], fmt: tool_calls.Format):
        self.s, self.run, self.ids, self.logprobs, self.tools = s, run, ids, logprobs, tools
        self.id, self.created = "chatcmpl-" + request_id(), int(time.time())
        self.extra = {"nanoeuler": notes} if notes else {}
        self.format = fmt
        self.sent = [0] * len(run.choices)   # with tools: characters of each choice's content streamed so far

    def message(self, c, streamed: bool = False) -> tuple[dict, str]:
        """A finished choice's message and finish_reason, its tool calls parsed out (streamed: its last delta,
        the content not sent yet)."""
        content, calls = tool_calls.parse(self.format, c.text, self.tools) if self.tools else (c.text, [])
        rest = content[self.sent[c.index]:] if streamed else content
        if not calls:
            return {"content": rest}, c.finish_reason
        reason = "tool_calls" if c.finish_reason == "stop" else c.finish_reason
        return {"content": rest if content.strip() else None,
                "tool_calls": tool_calls.openai_calls(calls, streamed)}, reason

    def streamable(self, c, piece: str) -> str:
        """The content of choice c that may stream now: with tools, up to where a call might begin."""
        if not self.tools:
            return piece
        start, self.sent[c.index] = self.sent[c.index], max(self.sent[c.index],
                                                             tool_calls.streamable(self.format, c.text))
        return c.text[start:self.sent[c.index]]

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
                piece = self.streamable(c, piece)
                if piece or lp:
                    events.append(sse(self.chunk([{"index": c.index, "delta": {"content": piece}, "logprobs": lp,
                                                   "finish_reason": None}])))
                if c.finish_reason:
                    ended.add(c.index)
                    delta, reason = self.message(c, streamed=True) if self.tools else ({}, c.finish_reason)
                    if delta.get("content") or delta.get("tool_calls"):
                        events.append(sse(self.chunk([{"index": c.index, "delta": delta, "logprobs": None,
                                                       "finish_reason": None}])))
                    events.append(sse(self.chunk([{"index": c.index, "delta": {}, "logprobs": None,
                                                   "finish_reason": reason}])))
            yield events

    def whole(self) -> JSONResponse:
        return JSONResponse({
            "id": self.id, "object": "chat.completion", "created": self.created, "model": self.s.model_name,
            "system_fingerprint": None,
            "choices": [self.whole_choice(c) for c in self.run.choices],
            "usage": usage([self.ids], self.run.choices), **self.extra})

    def whole_choice(self, c) -> dict:
        message, reason = self.message(c)
        return {"index": c.index, "message": {"role": "assistant", **message},
                "logprobs": c.chat_logprobs() if self.logprobs is not None else None, "finish_reason": reason}


@asynccontextmanager
async def lifespan(app):
    s = app.state.service
    s.loop = asyncio.get_running_loop()
    s.batcher.start()
    yield
    s.batcher.close()


def create_app(model, tok, model_name: str, *, api_key: str | None = None, max_batch: int = 32,
               max_queue: int = 64, max_tokens_cap: int = 1024, max_n: int = 8, body_limit: int = 1 << 20,
               chat_max_tokens: int = 256, ctx_len: int | None = None,
               prompt_cache_mib: int = PROMPT_CACHE_MIB) -> FastAPI:
    """The FastAPI app serving `model` (its Batcher starts with the app and stops with it); ctx_len: the positions
    a request's row holds (default: the model's context); prompt_cache_mib: the prefix cache's budget (0: none)."""
    s = Service(model, tok, model_name, api_key, max_batch, max_queue, max_tokens_cap, max_n, chat_max_tokens,
                ctx_len, prompt_cache_mib)
    app = FastAPI(title="nanoeuler", version="1", lifespan=lifespan, docs_url=None, redoc_url=None,
                  description="An OpenAI-compatible API over a nanoeuler checkpoint.")
    app.state.service = s
    app.state.page = (STATIC / "index.html").read_text(encoding="utf-8")
    app.add_middleware(BodyLimit, limit=body_limit, closing=s.closing)
    app.add_middleware(RequestMetrics, metrics=s.metrics)  # (outermost: a 413 is counted too)
    for kind, handler in ((APIError, api_error), (UserError, user_error), (RequestValidationError, invalid_request),
                          (StarletteHTTPException, http_error), (Exception, internal_error)):
        app.add_exception_handler(kind, handler)
    app.include_router(routes)
    return app



# ---- the runner ----------------------------------------------------------------------------------

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
