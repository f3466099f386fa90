"""`nanoeuler serve`: an OpenAI-compatible HTTP API over a checkpoint, with continuous batching.

    batcher.py   the engine: one batched KV cache, requests join and leave between decoding steps
    protocol.py  request/response shapes of the OpenAI API, chat rendering, stop strings, SSE chunks
    app.py       the FastAPI application (routes, limits, errors) and the uvicorn runner
    static/      the single-page web chat served at GET /

Only `batcher` is importable without the `serve` extra (fastapi, uvicorn); the other modules import
them at the top, so import them only from functions that need the server.
"""
