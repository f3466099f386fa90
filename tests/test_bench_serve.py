"""bench/serve.py against a server that cannot finish a level in time: it reports the levels it measured and
says which were not, exit code 0, no traceback (it used to end with asyncio's TimeoutError)."""
import subprocess
import sys
from pathlib import Path

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
    library's cost): every request completes ([DONE], status 200), and its ratio to the engine is reported."""
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
    assert report["raw_vs_engine_1"][name] == raw["tok_s"] / report["engine"][name][0]["tok_s"]
