"""Benchmark `nanoeuler serve`: 1, 4, 16, 64 concurrent streaming clients against a real server on 127.0.0.1.

For each model, one server process (`nanoeuler serve --port 0 --max-batch 64`) and, per concurrency level C,
C clients in this process (asyncio + httpx, one event loop: no GIL fight with the server) that each stream
--requests completions of --tokens tokens (ignore_eos: every reply has exactly that many) from different
prompts, all starting together. Reported per level:

    tok/s     aggregate completion tokens per second (all tokens / the level's wall time)
    ttft      time to first token, p50 / p99 (request sent -> first text chunk)
    tpot      per-token latency of a stream, p50 / p99 over streams: (last token - first token) / (tokens - 1)
    itl       gap between successive chunks of one stream, p50 / p99 (a chunk holds every token that arrived
              while the server was busy writing the previous ones, so under load a chunk can carry several)
    errors    failed or incomplete streams (no [DONE], fewer tokens than asked); 429s are counted apart

`x1` is tok/s relative to the single-stream level of the same model, measured in the same run. The
machine's load average is printed: on a shared machine compare ratios, not absolute numbers. --engine
adds the engine alone at each served dtype (no HTTP, jobs stepped in this process), timed also in CPU
time, which a shared machine does not distort as much; and, for every server, one stream through a minimal
client (`raw_stream`: the request in one socket write, the reply read to its [DONE], no HTTP library: the
median of --raw-repeat requests), so the server's own HTTP path is told apart from the client's (httpx's
per-request cost is part of every level's figures, ours and llama-server's alike).
--http-cost measures instead what the HTTP path costs one stream: the server runs with one route more
(engine_server), through which the same greedy job goes straight to the server's own engine (same
process, engine thread, decoding threads); pairs alternate engine alone, then HTTP (raw_stream), and the
median of HTTP wall / engine wall - 1 is "HTTP cost of one stream" (TTFT is inside both walls).
--fairness measures instead how a short request fares beside a long one (the engine shares rows and prompt
work fairly between requests): one short greedy stream at a time, --pairs alone, then --pairs while one
long request runs (--long-prompts prompts x --long-tokens tokens, 20 top logprobs, echo: more jobs than rows,
which served first come, first served would hold every row until its end); TTFT and the time to the
end, alone and beside, and whether the long request was still running when each short one ended.
--multi-turn measures instead the time to first token of a chat as it grows (the prompt cache at work): a
--turns-turn conversation through /v1/chat/completions, each turn ~--new-tokens tokens of new text and a reply
of --reply-tokens greedy tokens (ignore_eos), the reply kept in the conversation as the template renders it;
then --clients-sharing clients at once, each a question after the same ~--system-tokens-token system prompt,
twice (the second round: other questions, the system prompt already computed). Each model is a checkpoint
or a .gguf file (`--ckpt FILE.gguf`); with --llama-server, llama.cpp's server on the same file (.gguf only)
with one slot and cache_prompt for the chat, --clients-sharing slots for the shared prompt, --threads
threads; ours with --threads too, and once more with --prompt-cache-mib 0 (the cache off).
--llama-server PATH (or $LLAMA_SERVER) serves each model once per --gguf type: ours at that type's --dtype
(f32 -> float32, q8_0 -> q8_0), then llama.cpp's own server on our GGUF export at that type (`llama-server
-np 16`, continuous batching, --threads threads, each sequence the model's ctx_len), the same clients and
requests (`ignore_eos`), and `ours / llama-server`: our tok/s ÷ its tok/s at each level.
--response-format measures the cost of constrained decoding: each level runs four times on the same server,
without, with, with and without the response_format (ABBA: a drift of the machine's load weighs on both alike),
and `grammar / plain` is the tok/s with it over the tok/s without (the means of the two runs each; the prompt
cache off, so that no run finds its prompts computed by an earlier one). Its
default, LONG_TEXT, is a JSON schema whose one string must be longer than any reply (so every reply runs its
--tokens, as without); any response_format object may be given as JSON instead.
Bounded: at most --tokens x --requests x 64 tokens per level, and --level-timeout seconds per level.

    .venv/bin/python bench/serve.py --ckpt runs/small --preset big          # trained small + big (random init)
    .venv/bin/python bench/serve.py --ckpt runs/small --clients 1,16 --json
    .venv/bin/python bench/serve.py --clients 1,16 --engine --llama-server path/to/llama-server
    .venv/bin/python bench/serve.py --http-cost [--llama-server path/to/llama-server]   # big, f32 and q8_0
    .venv/bin/python bench/serve.py --fairness --tokens 40       # a short request alone and beside a long one
    .venv/bin/python bench/serve.py --preset '' --ckpt .cache/models/SmolLM2-135M-Instruct.Q4_1.gguf \
        --clients 1,16 --response-format                         # decoding with a grammar against without
    .venv/bin/python bench/serve.py --multi-turn --preset '' --ckpt .cache/models/SmolLM2-135M-Instruct.Q4_1.gguf \
        --llama-server /tmp/llama-build/bin/llama-server           # a 12-turn chat; 16 clients, one system prompt
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from nanoeuler.interop.gguf_export import LLAMA_CPP_NAMES as OURS  # noqa: E402  (our --dtype of f32, f16)

TEXT_START = 2000  # prompts are slices of the bundled Shakespeare from here on
ENGINE_SERVER = "--engine-server"  # argv[1] of this script run as engine_server (by --http-cost)
REST = 0.1  # seconds --http-cost leaves the server idle before each timed run (see http_cost)
LONG_TEXT = {"type": "json_schema", "json_schema": {"name": "bench", "schema": {   # --response-format's default
    "type": "object", "properties": {"text": {"type": "string", "minLength": 100000}}, "required": ["text"]}}}


def preset_checkpoint(name: str, out: Path, tokenizer: str | None) -> Path:
    """A random-init checkpoint of a preset (speed does not depend on the weights). Its tokenizer: the given
    one if its vocabulary matches, else one trained on the bundled Shakespeare to the preset's vocab size."""
    from nanoeuler import Model
    from nanoeuler.config import PRESETS
    from nanoeuler.data.corpus import bundled_works
    from nanoeuler.tokenizer import Tokenizer
    cfg = PRESETS[name]
    tok = Tokenizer.load(tokenizer) if tokenizer else None
    if tok is None or tok.vocab_size != cfg.vocab_size:
        print(f"training a {cfg.vocab_size}-token tokenizer for {name} ...", file=sys.stderr, flush=True)
        tok = Tokenizer.train(list(bundled_works().values()), cfg.vocab_size, progress=False)
    d = out / name
    Model.from_preset(name, seed=0).save(d, tokenizer=tok)
    return d


def start_server(ckpt: Path, max_batch: int, max_queue: int, dtype: str = "float32", engine_route: bool = False,
                 more: tuple = ()):
    """`nanoeuler serve` on 127.0.0.1, any free port -> (process, base url); engine_route: served by
    engine_server (the same server and one route more); more: further flags."""
    serve = [str(ROOT / "bench" / "serve.py"), ENGINE_SERVER] if engine_route else ["-m", "nanoeuler", "serve"]
    cmd = [sys.executable, *serve, "--ckpt", str(ckpt), "--port", "0", "--model-name", "bench",
           "--max-batch", str(max_batch), "--max-queue", str(max_queue), "--max-tokens", "4096", *more]
    cmd += ["--dtype", dtype] if dtype != "float32" else []
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    line = proc.stdout.readline()
    if "on http://" not in line:
        proc.kill()
        raise SystemExit(f"the server did not start: {line}{proc.stderr.read()}")
    return proc, line.split("on ", 1)[1].split("/ ", 1)[0]


def start_llama_server(binary: str, gguf: Path, slots: int, ctx_len: int, threads: int, more: tuple = ()):
    """llama.cpp's `llama-server` on 127.0.0.1 (slots sequences of ctx_len positions, continuous batching),
    ready -> (process, base url); more: further flags."""
    import socket
    import urllib.request
    with socket.socket() as sk:  # a free port (llama-server has no port 0)
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    cmd = [binary, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-np", str(slots), "-cb",
           "-c", str(slots * ctx_len), "-t", str(threads), "-tb", str(threads), "--no-webui", *more]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"llama-server did not start: {proc.stderr.read()[-800:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit("llama-server was not ready within 120 s")


def stop(proc) -> None:
    proc.send_signal(2)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


def completion_request(prompt: str, tokens: int, seed: int, temperature: float = 0.8, extra: dict | None = None) -> dict:
    """The body of every benchmark request: a streamed completion of exactly `tokens` tokens (ignore_eos),
    its usage in the last chunk; llama-server computes every prompt afresh (cache_prompt, which ours ignores:
    else a repeated prompt would come from its cache). extra: more fields (--response-format)."""
    return {"model": "bench", "prompt": prompt, "max_tokens": tokens, "temperature": temperature, "seed": seed,
            "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}, "cache_prompt": False,
            **(extra or {})}


def raw_stream(url: str, prompt: str, tokens: int, seed: int, timeout: float, temperature: float = 0.8) -> dict:
    """One streamed completion through a bare socket: the request in one write (TCP_NODELAY), the reply read
    until its `data: [DONE]` -> {"ok", "wall_s", "ttft", "usage"}: wall_s from the write to [DONE], ttft to
    the first chunk with text; ok: status 200, [DONE], and the usage chunk's completion_tokens == tokens."""
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps(completion_request(prompt, tokens, seed, temperature)).encode()
    request = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
               f"Connection: close\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body
    reply, ttft, wall = b"", None, None
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        t0 = time.perf_counter()
        sock.sendall(request)
        while chunk := sock.recv(1 << 16):
            if ttft is None and b'"text"' in chunk:
                ttft = time.perf_counter() - t0
            reply += chunk
            if b"data: [DONE]" in reply[-len(chunk) - 16:]:
                wall = time.perf_counter() - t0
                break
    usage = next((json.loads(line[6:])["usage"] for line in reply.decode(errors="replace").splitlines()
                  if line.startswith("data: {") and '"usage"' in line and json.loads(line[6:]).get("usage")), {})
    ok = reply.startswith(b"HTTP/1.1 200") and wall is not None and usage.get("completion_tokens") == tokens
    return {"ok": ok, "wall_s": wall, "ttft": ttft, "usage": usage}


def raw_level(url: str, args, prompts: list[str]) -> dict:
    """One stream at a time through raw_stream, --raw-repeat requests: the median's tok/s and TTFT."""
    runs = [raw_stream(url, prompts[i % len(prompts)], args.tokens, i, args.level_timeout)
            for i in range(args.raw_repeat)]
    if not all(r["ok"] for r in runs):
        return {"ok": False}
    wall = float(np.median([r["wall_s"] for r in runs]))
    return {"ok": True, "tok_s": args.tokens / wall, "ttft_ms": float(np.median([r["ttft"] for r in runs])) * 1000}


def serve_levels(proc, url: str, name: str, levels: list[int], args, prompts: list[str]) -> list[dict]:
    """A warm-up request, then each concurrency level against the server at url (and with --engine, one
    stream through a minimal client: rows[0]["raw"]); stops the server after."""
    rows = []
    try:
        asyncio.run(level(url, 1, 1, 4, prompts, args.level_timeout))  # warm-up
        if args.response_format:
            asyncio.run(level(url, 1, 1, 4, prompts, args.level_timeout, args.response_format))
        for c in levels:
            rows.append(asyncio.run(level(url, c, args.requests, args.tokens, prompts, args.level_timeout)))
            if args.response_format:
                rows[-1] = with_grammar(url, rows[-1], c, args, prompts)
            print(f"  {name}: {c} clients done", file=sys.stderr, flush=True)
        if args.engine and rows and rows[0]["clients"] == 1:
            rows[0]["raw"] = raw_level(url, args, prompts)
    except (asyncio.TimeoutError, TimeoutError):  # a stalled server: the levels measured so far, and a line
        print(f"  {name}: a level took longer than --level-timeout {args.level_timeout:g} s; it and the "
              f"levels after it are not measured", file=sys.stderr, flush=True)
    finally:
        stop(proc)
    base = rows[0]["tok_s"] if rows and rows[0]["clients"] == 1 else None
    for r in rows:
        r["x1"] = r["tok_s"] / base if base else None
    return rows


def with_grammar(url: str, plain: dict, clients: int, args, prompts: list[str]) -> dict:
    """The level `plain` measured without --response-format, run again with it twice and without it once more
    (ABBA) -> the plain row (its tok/s the mean of both runs) with "grammar": the row with it (mean tok/s) and
    "grammar_ratio": grammar tok/s / plain tok/s."""
    run = lambda extra=None: asyncio.run(level(url, clients, args.requests, args.tokens, prompts,  # noqa: E731
                                               args.level_timeout, extra))
    grammar = [run(args.response_format), run(args.response_format)]
    second = run()
    plain_tok_s = (plain["tok_s"] + second["tok_s"]) / 2
    row = dict(grammar[0], tok_s=(grammar[0]["tok_s"] + grammar[1]["tok_s"]) / 2,
               errors=grammar[0]["errors"] + grammar[1]["errors"])
    return dict(plain, tok_s=plain_tok_s, errors=plain["errors"] + second["errors"], grammar=row,
                grammar_ratio=row["tok_s"] / plain_tok_s if plain_tok_s else None)


def llama_server_rows(ckpt: Path, label: str, gguf_type: str, levels: list[int], args, prompts: list[str],
                      tmp: Path) -> list[dict]:
    """llama-server on our GGUF export of ckpt at gguf_type: the levels' rows."""
    from nanoeuler import Model
    from nanoeuler.checkpoint import load_tokenizer
    from nanoeuler.interop.gguf_export import export_gguf
    from nanoeuler.checkpoint import source_blocks
    model, tok = Model.load(ckpt, read_only=True), load_tokenizer(ckpt, read_only=True)
    as_file = gguf_type == "file"   # an import's matrices as its GGUF file held them, written back byte for byte
    path = export_gguf(model, tok, tmp / f"{ckpt.name}-{gguf_type}.gguf", "float32" if as_file else gguf_type,
                       force=True, progress=False, blocks=source_blocks(ckpt) if as_file else None)
    try:
        proc, url = start_llama_server(args.llama_server, path, args.np, min(model.config.ctx_len, 2048), args.threads)
        return serve_levels(proc, url, label, levels, args, prompts)
    finally:
        path.unlink()


async def one_stream(http, url: str, prompt: str, tokens: int, seed: int, extra: dict | None = None) -> dict:
    body = completion_request(prompt, tokens, seed, extra=extra)
    t0 = time.perf_counter()
    stamps, n_tokens, done, status = [], 0, False, None
    try:
        async with http.stream("POST", url + "/v1/completions", json=body) as r:
            status = r.status_code
            if status != 200:
                await r.aread()
                return {"status": status, "ok": False}
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if chunk.get("usage"):
                    n_tokens = chunk["usage"]["completion_tokens"]
                for c in chunk["choices"]:
                    if c.get("text"):
                        stamps.append(time.perf_counter())
    except Exception as e:  # noqa: BLE001  (a broken connection is an error of the level, not of the bench)
        return {"status": status, "ok": False, "error": repr(e)}
    ok = done and n_tokens == tokens
    tpot = (stamps[-1] - stamps[0]) / (n_tokens - 1) if len(stamps) > 1 and n_tokens > 1 else None
    return {"status": status, "ok": ok, "tokens": n_tokens, "ttft": stamps[0] - t0 if stamps else None,
            "gaps": list(np.diff(stamps)), "tpot": tpot, "t_end": time.perf_counter()}


async def level(url: str, clients: int, requests: int, tokens: int, prompts: list[str], timeout: float,
                extra: dict | None = None) -> dict:
    import httpx
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as http:
        async def client(i):
            return [await one_stream(http, url, prompts[(i * requests + j) % len(prompts)], tokens, i * 1000 + j,
                                     extra) for j in range(requests)]
        t0 = time.perf_counter()
        results = [r for rs in await asyncio.wait_for(asyncio.gather(*(client(i) for i in range(clients))), timeout)
                   for r in rs]
        wall = time.perf_counter() - t0
    good = [r for r in results if r["ok"]]
    ttft = [r["ttft"] for r in good if r["ttft"] is not None]
    gaps = [g for r in good for g in r["gaps"]]
    tpot = [r["tpot"] for r in good if r["tpot"] is not None]
    pct = (lambda xs, q: float(np.percentile(xs, q)) * 1000 if xs else float("nan"))
    return {"clients": clients, "requests": len(results), "tokens": sum(r.get("tokens", 0) for r in good),
            "wall_s": wall, "tok_s": sum(r.get("tokens", 0) for r in good) / wall,
            "ttft_p50_ms": pct(ttft, 50), "ttft_p99_ms": pct(ttft, 99),
            "itl_p50_ms": pct(gaps, 50), "itl_p99_ms": pct(gaps, 99),
            "tpot_p50_ms": pct(tpot, 50), "tpot_p99_ms": pct(tpot, 99),
            "errors": sum(1 for r in results if not r["ok"] and r.get("status") != 429),
            "rejected_429": sum(1 for r in results if r.get("status") == 429),
            "error_examples": [{k: r.get(k) for k in ("status", "error", "tokens")}
                               for r in results if not r["ok"] and r.get("status") != 429][:3]}


def engine_level(ckpt: Path, clients: int, tokens: int, prompts: list[str], dtype: str = "float32") -> dict:
    """The engine alone (no HTTP) at `dtype`: `clients` jobs submitted together, stepped in this thread until
    done. cpu_tok_s uses this thread's CPU time, so it holds on a machine shared with other jobs."""
    from nanoeuler import Model
    from nanoeuler.checkpoint import load_tokenizer
    from nanoeuler.fast.parallel import single_threaded_blas
    from nanoeuler.infer.engine import Batcher, Job
    from nanoeuler.infer.weights import for_dtype
    model, tok = for_dtype(Model.load(ckpt), dtype), load_tokenizer(ckpt)
    b = Batcher(model, max_batch=max(64, clients), max_queue=max(64, clients))
    # untimed: a process's first step and first sampled draw load their kernels (a greedy warm-up left the
    # draw's in the 1-job level)
    b.submit(Job(ids=tok.encode(prompts[0]), max_tokens=2, temperature=0.8))
    while b.step():
        pass
    for i in range(clients):
        b.submit(Job(ids=tok.encode(prompts[i % len(prompts)])[-model.config.ctx_len:], max_tokens=tokens,
                     temperature=0.8, seed=i))
    with single_threaded_blas():
        t0, c0 = time.perf_counter(), time.thread_time()
        while b.step():
            pass
        wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
    return {"clients": clients, "tok_s": clients * tokens / wall, "cpu_tok_s": clients * tokens / cpu}


def engine_server(argv: list[str]) -> int:
    """`nanoeuler serve ARGV` in this process, with one route more: POST /bench/engine {"ids", "max_tokens"}
    submits one greedy job straight to the server's own Batcher, and times it by the engine thread's events:
    {"wall_s": submit -> the job's end, "ttft_s": submit -> its first token, "pid"}. So the engine alone runs
    where a request's job runs: the same process, engine thread, decoding threads and switch interval; only
    the HTTP path (request, tokenizing, event hand-over, SSE, socket) is left out. The route is the bench's:
    `nanoeuler serve` has none."""
    import asyncio

    from nanoeuler.cli import build_parser
    from nanoeuler.cli.serve import prepare
    from nanoeuler.infer.engine import Job
    from nanoeuler.serve.app import run_server
    args = build_parser().parse_args(["serve", *argv])
    app, sock, banner = prepare(args)

    @app.post("/bench/engine")
    async def engine_alone(body: dict):
        loop, stamps = asyncio.get_running_loop(), {}
        ended = loop.create_future()

        def on_event(kind, *_):
            now = time.perf_counter()
            if kind == "token":
                stamps.setdefault("first", now)
            elif kind in ("done", "error"):
                stamps["end"] = now
                loop.call_soon_threadsafe(ended.set_result, kind)
        t0 = time.perf_counter()
        app.state.service.batcher.submit(Job(ids=body["ids"], max_tokens=body["max_tokens"], on_event=on_event))
        ok = await ended == "done"
        return {"ok": ok, "wall_s": stamps["end"] - t0, "ttft_s": stamps.get("first", stamps["end"]) - t0,
                "pid": os.getpid()}
    run_server(app, sock, args.log_level, on_ready=lambda: print(banner, flush=True))
    return 0


def post_json(url: str, body: dict, timeout: float) -> dict:
    import urllib.request
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def thread_cpu_s(pid: int) -> float:
    """CPU time so far of process pid's main thread (the server's event loop), from its schedstat (ns)."""
    with open(f"/proc/{pid}/task/{pid}/schedstat") as f:
        return int(f.read().split()[0]) / 1e9


def http_cost(ckpt: Path, dtype: str, args, prompt: str) -> dict:
    """One stream's HTTP cost: a server at dtype (engine_server), then --pairs pairs, each the same greedy job
    of --tokens tokens on the same prompt run first by the engine alone in the server's process, then over
    HTTP through raw_stream (wall from the request's write to [DONE], TTFT included on both sides); two
    untimed pairs first; each run starts from rest (REST seconds idle: after a job the decoding helpers
    spin for tens of ms, and would share the cores with the next run's start, which was always the HTTP
    request's). -> the pairs' figures, and cost: the median of HTTP wall / engine wall, minus 1.
    loop_cpu_s: the event loop thread's CPU time over each request (the engine's: its request to the route),
    which a loaded machine distorts less than wall time."""
    from nanoeuler.checkpoint import load_tokenizer
    from nanoeuler.infer.session import truncate_left
    cfg = json.loads((ckpt / "config.json").read_text())
    ids = truncate_left(load_tokenizer(ckpt, read_only=True).encode(prompt, add_bos=True), cfg["ctx_len"])[0]
    proc, url = start_server(ckpt, args.max_batch, 64, dtype, engine_route=True)
    pairs = []
    try:
        for i in range(2 + args.pairs):
            time.sleep(REST)
            c0 = thread_cpu_s(proc.pid)
            e = post_json(url + "/bench/engine", {"ids": ids, "max_tokens": args.tokens}, args.level_timeout)
            c1 = thread_cpu_s(proc.pid)
            time.sleep(REST)
            h = raw_stream(url, prompt, args.tokens, i, args.level_timeout, temperature=0.0)
            c2 = thread_cpu_s(proc.pid)
            if not (e["ok"] and h["ok"] and e["pid"] == proc.pid and h["usage"]["prompt_tokens"] == len(ids)):
                raise SystemExit(f"a pair failed or did not run the same job: engine {e}, HTTP {h}")
            if i >= 2:
                pairs.append({"engine_s": e["wall_s"], "engine_ttft_s": e["ttft_s"], "http_s": h["wall_s"],
                              "http_ttft_s": h["ttft"], "engine_loop_cpu_s": c1 - c0, "http_loop_cpu_s": c2 - c1})
    finally:
        stop(proc)
    costs = [p["http_s"] / p["engine_s"] - 1 for p in pairs]
    med = (lambda k: float(np.median([p[k] for p in pairs])))
    return {"dtype": dtype, "tokens": args.tokens, "prompt_tokens": len(ids), "pairs": pairs,
            "cost": float(np.median(costs)), "cost_min": min(costs), "cost_max": max(costs),
            "cost_quartiles": [float(q) for q in np.percentile(costs, [25, 75])],
            **{k: med(k) for k in ("engine_s", "engine_ttft_s", "http_s", "http_ttft_s", "engine_loop_cpu_s",
                                   "http_loop_cpu_s")}}


def llama_server_stream(ckpt: Path, dtype: str, args, prompt: str, tmp: Path) -> dict:
    """llama-server on our GGUF export of ckpt at dtype's type: --pairs greedy streams through raw_stream
    (two untimed first) -> the medians of their wall and TTFT."""
    from nanoeuler import Model
    from nanoeuler.checkpoint import load_tokenizer
    from nanoeuler.interop.gguf_export import export_gguf
    model, tok = Model.load(ckpt, read_only=True), load_tokenizer(ckpt, read_only=True)
    path = export_gguf(model, tok, tmp / f"{ckpt.name}-{dtype}.gguf", dtype, force=True,
                       progress=False)
    try:
        proc, url = start_llama_server(args.llama_server, path, args.np, model.config.ctx_len, args.threads)
        try:
            runs = [raw_stream(url, prompt, args.tokens, i, args.level_timeout, temperature=0.0)
                    for i in range(2 + args.pairs)][2:]
        finally:
            stop(proc)
    finally:
        path.unlink()
    if not all(r["ok"] for r in runs):
        raise SystemExit(f"a llama-server stream failed: {runs}")
    return {"http_s": float(np.median([r["wall_s"] for r in runs])),
            "http_ttft_s": float(np.median([r["ttft"] for r in runs]))}


def print_http_cost(name: str, r: dict) -> None:
    ms = (lambda s: f"{s * 1000:.1f} ms")
    print(f"\n{name}: one stream, {r['tokens']} greedy tokens after a {r['prompt_tokens']}-token prompt, "
          f"{len(r['pairs'])} pairs (engine alone in the server's process, then over HTTP)")
    print(f"  engine alone: {ms(r['engine_s'])} (TTFT {ms(r['engine_ttft_s'])}); over HTTP: {ms(r['http_s'])} "
          f"(TTFT {ms(r['http_ttft_s'])}); medians")
    print(f"  the event loop thread's CPU time over a request: {ms(r['http_loop_cpu_s'])} over HTTP, "
          f"{ms(r['engine_loop_cpu_s'])} for the engine route's")
    if "llama_server" in r:
        ls = r["llama_server"]
        print(f"  llama-server, the same stream on the same model's GGUF: {ms(ls['http_s'])} (TTFT "
              f"{ms(ls['http_ttft_s'])}); ours over HTTP / it: {r['http_s'] / ls['http_s']:.2f}x the time")
    q1, q3 = r["cost_quartiles"]
    print(f"  HTTP cost of one stream: {r['cost'] * 100:.1f} % (median of {len(r['pairs'])} pairs; quartiles "
          f"{q1 * 100:.1f} .. {q3 * 100:.1f} %, range {r['cost_min'] * 100:.1f} .. {r['cost_max'] * 100:.1f} %)")


def health(url: str) -> dict:
    import urllib.request
    with urllib.request.urlopen(url + "/health", timeout=30) as r:
        return json.loads(r.read())


@contextmanager
def long_request(url: str, prompts: list[str], tokens: int):
    """A long request in flight for the block's duration: `prompts` completed to `tokens` tokens each (ignore_eos),
    20 top logprobs a token and the prompts echoed, sent whole through a socket that is closed at the end
    (the server then cancels its jobs)."""
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"model": "bench", "prompt": prompts, "max_tokens": tokens, "logprobs": 20, "echo": True,
                       "temperature": 0.8, "seed": 0, "ignore_eos": True}).encode()
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall((f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                      f"Content-Length: {len(body)}\r\n\r\n").encode() + body)
        deadline = time.time() + 60
        while health(url)["active"] == 0:  # its jobs have rows
            if time.time() > deadline:
                raise SystemExit("the long request did not start within 60 s")
            time.sleep(0.05)
        yield
    deadline = time.time() + 60
    while (h := health(url))["active"] + h["queued"] and time.time() < deadline:  # cancelled: rows free again
        time.sleep(0.05)


def fairness(ckpt: Path, args, prompts: list[str]) -> dict:
    """A short greedy stream (--tokens tokens through raw_stream) alone, then beside a long request
    (long_request: --long-prompts prompts x --long-tokens tokens, logprobs 20, echo), --pairs times each ->
    the medians of TTFT and of the time to the end, alone and beside, their ratios, and whether the long
    request was still running when each short one ended (an engine that served requests first come, first
    served finished it first)."""
    proc, url = start_server(ckpt, args.max_batch, 64, args.dtype)
    try:
        def short(i: int) -> dict:
            r = raw_stream(url, prompts[1], args.tokens, i, args.level_timeout, temperature=0.0)
            if not r["ok"]:
                raise SystemExit(f"a short request failed: {r}")
            return {"ttft_s": r["ttft"], "end_s": r["wall_s"]}
        short(0)  # untimed
        alone = [short(i) for i in range(args.pairs)]
        beside, running = [], []
        with long_request(url, [prompts[(2 + i) % len(prompts)] for i in range(args.long_prompts)], args.long_tokens):
            for i in range(args.pairs):
                beside.append(short(i))
                running.append(health(url)["active"] > 0)
    finally:
        stop(proc)
    med = (lambda runs, k: float(np.median([r[k] for r in runs])))
    out = {"tokens": args.tokens, "long_prompts": args.long_prompts, "long_tokens": args.long_tokens,
           "alone": alone, "beside": beside, "long_running": running}
    for k in ("ttft_s", "end_s"):
        out[k] = {"alone": med(alone, k), "beside": med(beside, k), "ratio": med(beside, k) / med(alone, k)}
    return out


def print_fairness(name: str, r: dict) -> None:
    ms = (lambda s: f"{s * 1000:.0f} ms")
    t, e = r["ttft_s"], r["end_s"]
    print(f"\n{name}: a short request ({r['tokens']} greedy tokens) alone and beside a long one ({r['long_prompts']} "
          f"prompts x {r['long_tokens']} tokens, 20 top logprobs, echo), medians of {len(r['alone'])}")
    print(f"  time to first token: alone {ms(t['alone'])}, beside {ms(t['beside'])} ({t['ratio']:.1f}x)")
    print(f"  time to the end:     alone {ms(e['alone'])}, beside {ms(e['beside'])} ({e['ratio']:.1f}x)")
    print(f"  the long request still running when the short one ended: {sum(r['long_running'])} of "
          f"{len(r['long_running'])}")


def chat_stream(url: str, messages: list[dict], tokens: int, timeout: float) -> dict:
    """One streamed greedy chat completion of exactly `tokens` tokens (ignore_eos; llama-server: cache_prompt)
    -> {"ttft_s": request sent -> the first chunk with text, "text", "prompt_tokens"}."""
    import httpx
    body = {"model": "bench", "messages": messages, "max_tokens": tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}, "cache_prompt": True}
    t0, ttft, text, usage = time.perf_counter(), None, "", {}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=timeout) as r:
        if r.status_code != 200:
            raise SystemExit(f"a chat request failed: {r.status_code} {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            piece = "".join((c.get("delta") or {}).get("content") or "" for c in chunk.get("choices", []))
            if piece and ttft is None:
                ttft = time.perf_counter() - t0
            text += piece
    return {"ttft_s": ttft, "text": text, "prompt_tokens": usage.get("prompt_tokens")}


def chat_texts(args) -> tuple[list[str], str, list[str]]:
    """The bench's chat: --turns user messages of ~--new-tokens tokens, a system prompt of ~--system-tokens
    tokens, and 2 x --clients-sharing short questions (slices of the bundled Shakespeare, ~3 characters a
    token in SmolLM2's tokenizer: the replies' usage says how many they were)."""
    from nanoeuler.data.corpus import bundled_works
    text = "".join(bundled_works().values())
    turns = [text[TEXT_START + 4000 * i:][:3 * args.new_tokens] for i in range(args.turns)]
    system = "Answer as the play's prompter would.\n" + text[TEXT_START + 100000:][:3 * args.system_tokens]
    questions = [text[300000 + 211 * i:][:60] for i in range(2 * args.clients_sharing)]
    return turns, system, questions


def multi_turn(url: str, args) -> dict:
    """The --turns-turn chat, then the shared system prompt (module docstring) against the server at url."""
    from concurrent.futures import ThreadPoolExecutor
    turns, system, questions = chat_texts(args)
    chat_stream(url, [{"role": "user", "content": "Hello"}], 2, args.level_timeout)  # untimed
    messages, rows = [], []
    for user in turns:
        messages.append({"role": "user", "content": user})
        r = chat_stream(url, messages, args.reply_tokens, args.level_timeout)
        messages.append({"role": "assistant", "content": r["text"]})
        rows.append({"prompt_tokens": r["prompt_tokens"], "ttft_ms": r["ttft_s"] * 1000})
    shared = []
    n = args.clients_sharing
    for round in range(2):
        asks = [[{"role": "system", "content": system}, {"role": "user", "content": q}]
                for q in questions[round * n:(round + 1) * n]]
        t0 = time.perf_counter()
        with ThreadPoolExecutor(n) as pool:
            got = list(pool.map(lambda m: chat_stream(url, m, args.reply_tokens, args.level_timeout), asks))
        ttft = [g["ttft_s"] * 1000 for g in got]
        shared.append({"prompt_tokens": got[0]["prompt_tokens"], "ttft_p50_ms": float(np.median(ttft)),
                       "ttft_max_ms": max(ttft), "wall_ms": (time.perf_counter() - t0) * 1000})
    return {"turns": rows, "shared": shared, "prefix_cache": health(url).get("prefix_cache")}  # (ours only)


def multi_turn_servers(ckpt: Path, args) -> dict:
    """multi_turn against ours (the prompt cache on, then off) and, for a .gguf with --llama-server, llama.cpp's
    server on the same file -> {server: multi_turn's result}."""
    out = {}
    threads = ("--threads", str(args.threads))
    for label, more in (("ours", threads), ("ours, no prompt cache", threads + ("--prompt-cache-mib", "0"))):
        proc, url = start_server(ckpt, args.max_batch, 64, args.dtype, more=more)
        try:
            out[label] = multi_turn(url, args)
        finally:
            stop(proc)
        print(f"  {label} done", file=sys.stderr, flush=True)
    if args.llama_server and ckpt.suffix == ".gguf":
        ctx = 4096
        proc, url = start_llama_server(args.llama_server, ckpt, 1, ctx, args.threads)
        try:
            out["llama-server"] = {"turns": multi_turn(url, args)["turns"]}
        finally:
            stop(proc)
        proc, url = start_llama_server(args.llama_server, ckpt, args.clients_sharing, 3 * args.system_tokens,
                                       args.threads)
        try:
            out["llama-server"]["shared"] = multi_turn(url, args)["shared"]
        finally:
            stop(proc)
        print("  llama-server done", file=sys.stderr, flush=True)
    return out


def print_multi_turn(name: str, r: dict, args) -> None:
    servers = list(r)
    print(f"\n{name}: a {args.turns}-turn chat, ~{args.new_tokens} new tokens a turn, {args.reply_tokens}-token "
          f"greedy replies; time to first token (ms) per turn")
    print(f"{'turn':>5} {'prompt':>7} " + " ".join(f"{s:>22}" for s in servers))
    for i in range(args.turns):
        print(f"{i + 1:>5} {r[servers[0]]['turns'][i]['prompt_tokens'] or 0:>7} "
              + " ".join(f"{r[s]['turns'][i]['ttft_ms']:>22.0f}" for s in servers))
    print(f"{args.clients_sharing} clients at once, one system prompt: time to first token p50 / max (ms), wall (ms)")
    for s in servers:
        for round, x in enumerate(r[s]["shared"]):
            print(f"  {s:>22} round {round + 1} ({x['prompt_tokens']} prompt tokens): {x['ttft_p50_ms']:.0f} / "
                  f"{x['ttft_max_ms']:.0f}, {x['wall_ms']:.0f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", action="append", default=[], help="a checkpoint to serve (repeatable)")
    ap.add_argument("--preset", action="append", default=None, help="a preset with random weights (default: big)")
    ap.add_argument("--tokenizer", default=None, help="tokenizer.json for --preset models (trained if absent)")
    ap.add_argument("--clients", default="1,4,16,64", help="concurrency levels (default 1,4,16,64)")
    ap.add_argument("--tokens", type=int, default=128, help="completion tokens per request (default 128)")
    ap.add_argument("--requests", type=int, default=1, help="requests per client per level (default 1)")
    ap.add_argument("--max-batch", type=int, default=64, help="the server's --max-batch (default 64)")
    ap.add_argument("--level-timeout", type=float, default=120, help="seconds a level may take (default 120)")
    ap.add_argument("--engine", action="store_true",
                    help="also time the engine alone (no HTTP), in wall and in this thread's CPU time")
    ap.add_argument("--raw-repeat", type=int, default=5,
                    help="with --engine: requests of one stream through a minimal client, per server (default 5)")
    ap.add_argument("--dtype", default=None,
                    help="our server's --dtype (default float32; with --llama-server: each --gguf type's; with "
                         "--http-cost: a comma list, default float32,q8_0)")
    ap.add_argument("--http-cost", action="store_true",
                    help="instead of the levels: one stream's HTTP cost, the same greedy job by the engine alone in "
                         "the server's process and over HTTP, --pairs interleaved pairs at each --dtype (with "
                         "--llama-server: its time for the same stream too)")
    ap.add_argument("--pairs", type=int, default=None,
                    help="with --http-cost: timed pairs per dtype (default 25: on a shared machine a pair's ratio "
                         "swings by tens of percent); with --fairness: short requests alone, and beside (default 5)")
    ap.add_argument("--fairness", action="store_true",
                    help="instead of the levels: a short greedy stream of --tokens tokens alone, then beside a long "
                         "request (--long-prompts x --long-tokens, 20 top logprobs, echo): time to first token and "
                         "to the end, alone vs beside")
    ap.add_argument("--long-prompts", type=int, default=64, help="with --fairness: the long request's prompts (64)")
    ap.add_argument("--long-tokens", type=int, default=1024, help="with --fairness: its tokens a prompt (1024)")
    ap.add_argument("--multi-turn", action="store_true",
                    help="a growing chat's time to first token, and clients sharing a system prompt (see above)")
    ap.add_argument("--turns", type=int, default=12, help="with --multi-turn: turns (default 12)")
    ap.add_argument("--new-tokens", type=int, default=150, help="with --multi-turn: new tokens a turn (~; 150)")
    ap.add_argument("--reply-tokens", type=int, default=24, help="with --multi-turn: tokens a reply (default 24)")
    ap.add_argument("--system-tokens", type=int, default=1000, help="with --multi-turn: the system prompt (~; 1000)")
    ap.add_argument("--clients-sharing", type=int, default=16,
                    help="with --multi-turn: clients sharing the system prompt (default 16)")
    ap.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER"),
                    help="llama.cpp's llama-server binary: serve the same model with it too (default $LLAMA_SERVER)")
    ap.add_argument("--gguf", default="f32,q8_0", help="llama-server's GGUF types (default f32,q8_0; 'file': a "
                    "checkpoint imported from a GGUF served as its file holds it, by both)")
    ap.add_argument("--threads", type=int, default=2, help="llama-server's threads (default 2)")
    ap.add_argument("--np", type=int, default=16, help="llama-server's parallel sequences, -np (default 16)")
    ap.add_argument("--response-format", nargs="?", const=json.dumps(LONG_TEXT), default=None, type=json.loads,
                    metavar="JSON", help="also each level with this response_format (default LONG_TEXT, a JSON "
                                         "schema no reply finishes), side by side: the cost of a grammar")
    ap.add_argument("--quick", action="store_true", help="a smoke run: big only, 1 and 16 clients")
    ap.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = ap.parse_args()
    if args.quick:
        args.ckpt, args.preset, args.clients = [], None, "1,16"
    args.pairs = args.pairs or (5 if args.fairness else 25)
    if args.pairs < 1:
        raise SystemExit("--pairs must be >= 1")
    if not args.http_cost:
        args.dtype = args.dtype or "float32"
    presets = ["big"] if args.preset is None else [p for p in args.preset if p]
    levels = [int(c) for c in args.clients.split(",")]
    from nanoeuler.data.corpus import bundled_works
    text = "".join(bundled_works().values())
    prompts = [text[TEXT_START + 997 * i: TEXT_START + 997 * i + 200] for i in range(64)]
    report = {"load_before": os.getloadavg(), "tokens": args.tokens, "requests": args.requests, "models": {}}
    with tempfile.TemporaryDirectory() as tmp:
        models = [(Path(c).name, Path(c)) for c in args.ckpt]
        models += [(p + " (random init)", preset_checkpoint(p, Path(tmp), args.tokenizer)) for p in presets]
        for name, ckpt in models:
            if args.multi_turn:
                report.setdefault("multi_turn", {})[name] = multi_turn_servers(ckpt, args)
                continue
            if args.fairness:
                report.setdefault("fairness", {})[name] = fairness(ckpt, args, prompts)
                continue
            if args.http_cost:
                for dtype in (args.dtype or "float32,q8_0").split(","):
                    r = http_cost(ckpt, dtype, args, prompts[0])
                    if args.llama_server:
                        r["llama_server"] = llama_server_stream(ckpt, dtype, args, prompts[0], Path(tmp))
                    report.setdefault("http_cost", {})[f"{name} {dtype}"] = r
                continue
            # with llama-server: ours at each --gguf type's dtype, each followed by llama-server on that file
            # "file": an imported GGUF served as its file holds it, by us (no --dtype) and by llama-server
            pairs = [(({"file": "float32"} | OURS).get(t, t), t) for t in args.gguf.split(",")] if args.llama_server \
                else [(args.dtype, None)]
            for dtype, gguf_type in pairs:
                ours = name if dtype == "float32" else f"{name} {dtype}"
                # --response-format: the prompt cache off, so that no run's prompts come from an earlier one's
                more = ("--prompt-cache-mib", "0") if args.response_format else ()
                proc, url = start_server(ckpt, args.max_batch, max(64, max(levels)), dtype, more=more)
                report["models"][ours] = serve_levels(proc, url, ours, levels, args, prompts)
                if gguf_type:
                    theirs = f"{name} llama-server {gguf_type}"
                    rows = llama_server_rows(ckpt, theirs, gguf_type, levels, args, prompts, Path(tmp))
                    report["models"][theirs] = rows
                    report.setdefault("vs_llama_server", {})[theirs] = [
                        a["tok_s"] / b["tok_s"] if b["tok_s"] else None for a, b in zip(report["models"][ours], rows)]
                if args.engine:
                    eng = [engine_level(ckpt, c, args.tokens, prompts, dtype) for c in levels]
                    for r in eng:
                        r["x1_cpu"] = r["cpu_tok_s"] / eng[0]["cpu_tok_s"] if eng[0]["clients"] == 1 else None
                    report.setdefault("engine", {})[ours] = eng
    report["load_after"] = os.getloadavg()
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"load average before {report['load_before'][0]:.1f}, after {report['load_after'][0]:.1f}"
          + ("" if args.http_cost or args.fairness or args.multi_turn
             else f"; {args.tokens} tokens x {args.requests} request(s) per client"))
    for name, r in report.get("http_cost", {}).items():
        print_http_cost(name, r)
    for name, r in report.get("fairness", {}).items():
        print_fairness(name, r)
    for name, r in report.get("multi_turn", {}).items():
        print_multi_turn(name, r, args)
    for name, rows in report["models"].items():
        print(f"\n{name}")
        print(f"{'clients':>8} {'tok/s':>8} {'x1':>6} {'ttft p50':>9} {'p99':>8} {'tpot p50':>9} {'p99':>8} "
              f"{'itl p50':>8} {'p99':>8} {'errors':>7} {'429':>5}")
        for r in rows:
            print(f"{r['clients']:>8} {r['tok_s']:>8.1f} {r['x1'] or 0:>6.2f} {r['ttft_p50_ms']:>7.0f}ms "
                  f"{r['ttft_p99_ms']:>6.0f}ms {r['tpot_p50_ms']:>7.1f}ms {r['tpot_p99_ms']:>6.1f}ms "
                  f"{r['itl_p50_ms']:>6.1f}ms {r['itl_p99_ms']:>6.1f}ms {r['errors']:>7} {r['rejected_429']:>5}")
            for e in r["error_examples"]:
                print(f"{'':>8} error: {e}")
            if r.get("grammar"):
                g = r["grammar"]
                print(f"{'grammar':>8} {g['tok_s']:>8.1f} {r['grammar_ratio']:>6.3f} {g['ttft_p50_ms']:>7.0f}ms "
                      f"{g['ttft_p99_ms']:>6.0f}ms {g['tpot_p50_ms']:>7.1f}ms {g['tpot_p99_ms']:>6.1f}ms "
                      f"{g['itl_p50_ms']:>6.1f}ms {g['itl_p99_ms']:>6.1f}ms {g['errors']:>7} {g['rejected_429']:>5}"
                      f"   (x1 column: tok/s with the grammar / without)")
        for r in report.get("engine", {}).get(name, []):
            print(f"{'engine':>8} {r['clients']:>3} jobs: {r['tok_s']:>8.1f} tok/s wall, {r['cpu_tok_s']:>8.1f} tok/s "
                  f"of CPU time (x{r['x1_cpu'] or 0:.2f})")
        raw = rows[0].get("raw") if rows else None
        if raw:
            print(f"{'':>8} one stream, a minimal client: " + (
                f"{raw['tok_s']:.1f} tok/s, ttft {raw['ttft_ms']:.0f}ms" if raw["ok"] else "failed"))
        if name in report.get("vs_llama_server", {}):
            print(f"{'':>8} ours / llama-server (the row above it): " + ", ".join(
                f"{c} clients {v:.2f}x" for c, v in zip(levels, report["vs_llama_server"][name]) if v))
    return 0


if __name__ == "__main__":
    sys.exit(engine_server(sys.argv[2:]) if sys.argv[1:2] == [ENGINE_SERVER] else main())
