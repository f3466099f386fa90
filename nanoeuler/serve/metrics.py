"""GET /metrics: the server's state and history in Prometheus' text format (prometheus-client), one registry
per app.

Counted as requests come and go:
    nanoeuler_requests_total{route, status}          HTTP requests answered (route: a route of the app, else "other")
    nanoeuler_prompt_tokens_total                    prompt tokens of the completion requests (their usage)
    nanoeuler_time_to_first_token_seconds            histogram: a job's submission to its first token
    nanoeuler_time_per_output_token_seconds          histogram: between a job's consecutive tokens
Read from the engine at each scrape (Batcher.stats):
    nanoeuler_generation_tokens_total, nanoeuler_prefilled_tokens_total, nanoeuler_decode_steps_total
    nanoeuler_rows_in_use, nanoeuler_rows, nanoeuler_jobs_waiting, nanoeuler_jobs_parked
    nanoeuler_kv_cache_positions, nanoeuler_kv_cache_usage_ratio      filled positions, of max_batch x ctx
    nanoeuler_prefix_cache_hits_total, nanoeuler_prefix_cache_reused_tokens_total,
    nanoeuler_prefix_cache_bytes, nanoeuler_prefix_cache_budget_bytes
"""
from __future__ import annotations

import time

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)  # seconds
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class Metrics:
    """The app's registry: the counters and histograms the service feeds, and the engine read at each scrape."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, batcher):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("nanoeuler_requests", "HTTP requests answered, by route and status",
                                ["route", "status"], registry=r)
        self.prompt_tokens = Counter("nanoeuler_prompt_tokens", "prompt tokens of the completion requests",
                                     registry=r)
        self.ttft = Histogram("nanoeuler_time_to_first_token_seconds", "a job's submission to its first token",
                              buckets=TTFT_BUCKETS, registry=r)
        self.per_token = Histogram("nanoeuler_time_per_output_token_seconds", "time between a job's tokens",
                                   buckets=TOKEN_BUCKETS, registry=r)
        r.register(EngineCollector(batcher))

    def text(self) -> bytes:
        return generate_latest(self.registry)

    def token_clock(self, submitted: float):
        """on_token() for one job, called at each of its tokens: observes its time to first token (from
        `submitted`, a perf_counter time), then the time between tokens. Thread-safe (the engine calls it)."""
        last = [None]

        def on_token() -> None:
            now = time.perf_counter()
            if last[0] is None:
                self.ttft.observe(now - submitted)
            else:
                self.per_token.observe(now - last[0])
            last[0] = now
        return on_token


class EngineCollector:
    """The engine's counters and state, read from Batcher.stats() when scraped."""

    def __init__(self, batcher):
        self.batcher = batcher

    def collect(self):
        s = self.batcher.stats()
        prefix = s["prefix_cache"]
        for name, doc, value in (
                ("generation_tokens", "tokens sampled by the engine (end tokens included)", s["tokens"]),
                ("prefilled_tokens", "prompt positions computed", prefix["prefilled_tokens"]),
                ("decode_steps", "decoding steps (one forward over the decoding rows)", s["steps"]),
                ("prefix_cache_hits", "jobs that copied positions from the prefix cache", prefix["hits"]),
                ("prefix_cache_reused_tokens", "positions copied from the prefix cache", prefix["reused_tokens"])):
            yield CounterMetricFamily(f"nanoeuler_{name}", doc, value=value)
        for name, doc, value in (
                ("rows_in_use", "KV cache rows held by jobs", s["active"]),
                ("rows", "KV cache rows (--max-batch)", s["max_batch"]),
                ("jobs_waiting", "jobs waiting for a row (the queue)", s["queued"]),
                ("jobs_parked", "waiting jobs whose cache was set aside for a fair share", s["parked"]),
                ("kv_cache_positions", "KV cache positions filled", s["kv_positions"]),
                ("kv_cache_usage_ratio", "filled positions of the rows' max_batch x ctx",
                 s["kv_positions"] / s["kv_capacity"]),
                ("prefix_cache_bytes", "memory the prefix cache holds", prefix["bytes"]),
                ("prefix_cache_budget_bytes", "the prefix cache's budget (--prompt-cache-mib)",
                 prefix["budget_bytes"])):
            yield GaugeMetricFamily(f"nanoeuler_{name}", doc, value=value)


class RequestMetrics:
    """ASGI middleware: counts each answered HTTP request in metrics.requests by its route's path (as the app
    declares it: /v1/models/{name}) and status; a request no route took counts as "other" (a scanner does
    not make a series per path it tries)."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def counted(message):
            if message["type"] == "http.response.start":
                route = getattr(scope.get("route"), "path", "other")  # (the router names the route it chose)
                self.metrics.requests.labels(route, str(message["status"])).inc()
            await send(message)
        await self.app(scope, receive, counted)
