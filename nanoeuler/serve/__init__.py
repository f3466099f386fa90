"""`nanoeuler serve`: an OpenAI-compatible HTTP API over a checkpoint, with continuous batching.

The engine (one batched KV cache, requests join and leave between decoding steps) is infer/engine.py;
this package is the HTTP side only:

    protocol.py   request/response shapes of the OpenAI API, chat rendering, stop strings, SSE chunks
    service.py    the service: a request's fields checked, its choices as engine jobs, events back to text
    transport.py  the HTTP transport: socket, uvicorn's protocol with our rules, body limit, stream writes
    metrics.py    GET /metrics in Prometheus' text format: requests, tokens, queue, rows, caches, latencies
    app.py        the FastAPI application (routes, request/response mapping, errors) and the uvicorn runner
    static/      the single-page web chat served at GET /

Its modules import fastapi / pydantic (the `serve` extra) at the top, so import them only from functions
that need the server.
"""
