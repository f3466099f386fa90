"""bench/serve.py: a level past its timeout ends the run with a line (it used to end with asyncio's
TimeoutError), the minimal client's stream, and --http-cost's pairs."""
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from serve_fixtures import shared_checkpoint  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def test_a_level_past_its_timeout_ends_the_run_with_a_line_not_a_traceback():
    ckpt = shared_checkpoint()[0]
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "serve.py"), "--ckpt", ckpt, "--preset", "",
                        "--clients", "1,16", "--tokens", "256", "--level-timeout", "0.05"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    assert "took longer than --level-timeout 0.05 s; it and the levels after it are not measured" in r.stderr
    assert "clients    tok/s" in r.stdout   # the table of what was measured (16 clients x 256 tokens: > 0.05 s)


def test_one_stream_through_a_minimal_client_is_measured_beside_the_engine():
    """--engine also times one stream through a bare socket (the server's HTTP path without a client
    library's cost): every request completes ([DONE], status 200, every token counted in its usage)."""
    import json
    ckpt = shared_checkpoint()[0]
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "serve.py"), "--ckpt", ckpt, "--preset", "",
                        "--clients", "1", "--tokens", "16", "--engine", "--raw-repeat", "3", "--json"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads(r.stdout)
    (name, rows), = report["models"].items()
    raw = rows[0]["raw"]
    assert raw["ok"] and raw["tok_s"] > 0 and raw["ttft_ms"] > 0
    assert report["engine"][name][0]["tok_s"] > 0


def test_http_cost_times_the_same_job_by_the_engine_alone_and_over_http_in_pairs(capsys, monkeypatch):
    """--http-cost: a server with the bench's engine route; --pairs pairs of the same greedy job (the
    engine alone in the server's process, then over HTTP: the bench exits non-zero if the route ran in
    another process or the HTTP reply's usage differs); the cost is the median of the pairs' ratios."""
    import json
    ckpt = shared_checkpoint()[0]
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "serve.py"), "--ckpt", ckpt, "--preset", "",
                        "--http-cost", "--dtype", "float32", "--pairs", "3", "--tokens", "16", "--json"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    (name, cost), = json.loads(r.stdout)["http_cost"].items()
    assert name.endswith("float32") and cost["tokens"] == 16 and cost["prompt_tokens"] > 1
    pairs = cost["pairs"]
    assert len(pairs) == 3
    for p in pairs:
        assert 0 < p["engine_ttft_s"] < p["engine_s"] and 0 < p["http_ttft_s"] < p["http_s"]
    ratios = sorted(p["http_s"] / p["engine_s"] - 1 for p in pairs)
    assert (cost["cost"], cost["cost_min"], cost["cost_max"]) == pytest.approx((ratios[1], ratios[0], ratios[2]))
    assert cost["cost_quartiles"] == pytest.approx([(ratios[0] + ratios[1]) / 2, (ratios[1] + ratios[2]) / 2])
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import serve
    serve.print_http_cost(name, cost)
    assert f"HTTP cost of one stream: {cost['cost'] * 100:.1f} % (median of 3 pairs" in capsys.readouterr().out


def test_fairness_times_a_short_request_alone_and_beside_a_long_one():
    """--fairness: a short stream alone, then beside a long request that holds more jobs than the server has
    rows (8 prompts, --max-batch 4): every short request is served and ends while the long one still runs."""
    import json
    ckpt = shared_checkpoint()[0]
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "serve.py"), "--ckpt", ckpt, "--preset", "", "--fairness",
                        "--tokens", "8", "--long-prompts", "8", "--long-tokens", "1000", "--max-batch", "4",
                        "--pairs", "2", "--json"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    (name, fair), = json.loads(r.stdout)["fairness"].items()
    assert len(fair["alone"]) == len(fair["beside"]) == 2 and fair["long_running"] == [True, True]
    for run in fair["alone"] + fair["beside"]:
        assert 0 < run["ttft_s"] < run["end_s"]
    assert fair["end_s"]["ratio"] == pytest.approx(fair["end_s"]["beside"] / fair["end_s"]["alone"])


def test_multi_turn_times_each_turn_and_the_shared_system_prompt_with_and_without_the_prompt_cache():
    """--multi-turn: a chat's turns, each prompt longer than the last, its time to first token; then clients
    sharing a system prompt, twice; against our server with the prompt cache (which reuses positions) and
    without (which does not)."""
    import json
    ckpt = shared_checkpoint()[0]
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "serve.py"), "--ckpt", ckpt, "--preset", "",
                        "--multi-turn", "--turns", "2", "--new-tokens", "10", "--reply-tokens", "3",
                        "--system-tokens", "8", "--clients-sharing", "2", "--json"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    servers = json.loads(r.stdout)["multi_turn"]["tiny"]
    assert list(servers) == ["ours", "ours, no prompt cache"]
    for s in servers.values():
        assert len(s["turns"]) == 2 and s["turns"][0]["prompt_tokens"] < s["turns"][1]["prompt_tokens"]
        assert all(t["ttft_ms"] > 0 for t in s["turns"]) and len(s["shared"]) == 2
    assert servers["ours"]["prefix_cache"]["reused_tokens"] > 0
    assert servers["ours, no prompt cache"]["prefix_cache"]["reused_tokens"] == 0
