"""`nanoeuler serve --ckpt RUN`: an OpenAI-compatible HTTP API (and a web chat page) over a checkpoint.

    nanoeuler serve --ckpt runs/sft                      # http://127.0.0.1:8000/ (loopback only)
    nanoeuler serve --ckpt runs/sft --port 0             # any free port; the first line says which
    nanoeuler serve --ckpt runs/sft --host 0.0.0.0 --api-key SECRET

    from openai import OpenAI
    client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="SECRET")
    client.chat.completions.create(model="sft", messages=[{"role": "user", "content": "Hi"}])

Needs the `serve` extra (pip install 'nanoeuler[serve]'). See nanoeuler/serve/ for the engine and routes.
"""
from __future__ import annotations

import os
import sys

from .sample import add_threads_arg, load_for_decoding

DEFAULT_CTX = 8192  # serve's default window: Gemma 3's 32,768 positions x 32 rows would be 36 GiB of cache


def register(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP API + web chat (continuous batching)",
                       description="Serve a checkpoint over HTTP: GET / (web chat), /health, /v1/models, POST "
                                   "/v1/completions and /v1/chat/completions (stream or not; tools parsed into tool_calls in the "
                                   "format of the model's chat template, chat_template_kwargs), as the OpenAI API. "
                                   "Concurrent requests share forward passes (continuous batching). Listens on "
                                   "127.0.0.1 unless --host says otherwise. SIGINT/SIGTERM end open streams and exit 0.")
    p.add_argument("--ckpt", required=True, help="checkpoint directory or .gguf file (decoded as the file holds it, each matrix in its type; read only): any model")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 = any free port)")
    p.add_argument("--api-key", default=os.environ.get("NANOEULER_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $NANOEULER_API_KEY, else none)")
    p.add_argument("--model-name", default=None, help="the model id clients send (default: the checkpoint's directory name)")
    from ..infer.quant import decodable, from_float
    p.add_argument("--dtype", choices=decodable(), default=None,
                   help=f"the weights while decoding: {', '.join(from_float())} (default float32; an imported GGUF: "
                        f"its own type; see `sample --help`)")
    add_threads_arg(p)
    p.add_argument("--max-batch", type=int, default=32, help="rows of the KV cache decoded together, shared fairly between requests (default 32)")
    p.add_argument("--ctx", type=int, default=None,
                   help=f"positions of KV cache a request's row holds: a prompt keeps its last CTX tokens and a reply "
                        f"past them slides its window, as `sample` does at the model's context (default: the model's "
                        f"context, at most {DEFAULT_CTX}; the cache takes memory as rows fill, up to --max-batch x "
                        f"CTX positions, which must fit in RAM; a LongRoPE model, Phi-3.5 / Phi-4-mini, turns by its "
                        f"short factors up to its original context, as llama-server at that n_ctx)")
    p.add_argument("--prompt-cache-mib", type=int, default=None, metavar="MIB",
                   help="MiB of keys and values of earlier requests kept (least recently used first out), so a "
                        "request that begins as an earlier one did (a chat's next turn, a shared system prompt, "
                        "n choices) computes only the rest, with the same tokens and logprobs; 0: off "
                        "(default 1024)")
    p.add_argument("--max-queue", type=int, default=64, help="requests that may wait for a row; more get 429 (default 64)")
    p.add_argument("--max-tokens", type=int, default=1024, help="largest max_tokens a request may ask for (default 1024)")
    p.add_argument("--max-n", type=int, default=8, help="largest n (choices per request; default 8)")
    p.add_argument("--max-body", type=int, default=1 << 20, help="request body cap in bytes (default 1 MiB)")
    p.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level (info also logs every request; default warning)")
    from .args import add_template_arg
    add_template_arg(p)
    p.set_defaults(run=run)


def run(args) -> int:
    from ..serve.app import run_server
    app, sock, banner = prepare(args)
    run_server(app, sock, args.log_level, on_ready=lambda: print(banner, flush=True))
    print("nanoeuler serve: stopped", flush=True)
    return 0


def prepare(args):
    """The checks, the model loaded, the app built and its socket listening -> (app, socket, banner): what `run`
    serves, printing the banner once the app is warm (bench/serve.py's --http-cost serves it too, with one
    route of its own added)."""
    from ..errors import UserError
    try:
        import fastapi  # noqa: F401
        import httptools  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise UserError("serving needs FastAPI, uvicorn, httptools and prometheus-client: "
                        "pip install 'nanoeuler[serve]'")
    for name in ("max_batch", "max_queue", "max_tokens", "max_n", "max_body"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be >= 1")
    from ..serve.service import PROMPT_CACHE_MIB
    cache_mib = PROMPT_CACHE_MIB if args.prompt_cache_mib is None else args.prompt_cache_mib
    if cache_mib < 0:
        raise UserError("--prompt-cache-mib must be >= 0 (0: no prompt cache)")
    if not 0 <= args.port <= 65535:
        raise UserError("--port must be in 0..65535")
    if args.api_key is not None and not args.api_key:
        raise UserError("--api-key must not be empty")
    from pathlib import Path

    from ..chat_template import with_template_file
    from ..serve.app import create_app
    from ..serve.transport import bind
    model, tok = load_for_decoding(args)
    tok = with_template_file(tok, args.chat_template)
    name = args.model_name or Path(args.ckpt).resolve().name
    ctx, full = check_cache_fits(model.config, args.max_batch, args.ctx), model.config.ctx_len
    if model.config.rope_scaling == "longrope" and ctx < full:   # its short / long factors chosen by the context
        model.config = model.config.replace(ctx_len=ctx)         # served, as llama-server chooses by its n_ctx
    app = create_app(model, tok, name, api_key=args.api_key, max_batch=args.max_batch, max_queue=args.max_queue,
                     max_tokens_cap=args.max_tokens, max_n=args.max_n, body_limit=args.max_body, ctx_len=ctx,
                     prompt_cache_mib=cache_mib)
    sock = bind(args.host, args.port)
    host, port = sock.getsockname()[:2]
    warning = exposure_warning(args.host, args.api_key)
    if warning:
        print(warning, file=sys.stderr)
    shown = f"[{host}]" if ":" in host else host
    cache_mb = sum(a.nbytes for a in app.state.service.batcher.cache.store[:2]) / 2**20
    of_model = f" of the model's {full}" if ctx < full else ""
    banner = (f"nanoeuler serve: model {name!r} ({model.n_params():,} parameters, context {ctx}{of_model}) "
              f"on http://{shown}:{port}/  (OpenAI base_url http://{shown}:{port}/v1; Ctrl-C stops)\n"
              f"  {args.max_batch} rows decoded together (shared fairly between requests), KV cache up to "
              f"{cache_mb:,.0f} MiB, prompt cache {f'{cache_mib:,} MiB' if cache_mib else 'off'}; up to "
              f"{args.max_queue} requests wait, more get 429"
              f"{'; API key required' if args.api_key else ''}")
    return app, sock, banner


def check_cache_fits(cfg, max_batch: int, ctx: int | None, limit: int | None = None) -> int:
    """The positions each row holds (--ctx, default the model's context up to DEFAULT_CTX), refused in one line
    when out of range or when max_batch full rows would not fit in `limit` bytes (default: RAM)."""
    from ..errors import UserError
    from ..training.memory import kv_cache_bytes, physical_memory
    ctx = min(cfg.ctx_len, DEFAULT_CTX) if ctx is None else ctx
    if not 1 <= ctx <= cfg.ctx_len:
        raise UserError(f"--ctx must be in [1, {cfg.ctx_len}] (the model's context), got {ctx}")
    need, limit = kv_cache_bytes(cfg, max_batch, ctx), physical_memory() if limit is None else limit
    if limit and need > limit:
        raise UserError(f"--max-batch {max_batch} rows of --ctx {ctx} positions are {need / 2**30:.1f} GiB of KV "
                        f"cache when full, more than this machine's {limit / 2**30:.1f} GiB: "
                        "lower --ctx or --max-batch")
    return ctx


def exposure_warning(host: str, api_key: str | None) -> str | None:
    """The warning printed when the server is reachable from other machines without an API key."""
    from ..serve.transport import is_loopback
    if is_loopback(host) or api_key:
        return None
    return (f"warning: listening on {host} (reachable from other machines) without --api-key: "
            "anyone who can reach this port can use the model")
