"""`nanoeuler serve` as a program: a checkpoint that does not load or a port in use is one `error:` line and
a non-zero exit before anything listens; SIGTERM / SIGINT while a stream is open end that stream cleanly
(final chunk with a finish_reason, then data: [DONE]) and the process exits 0; the exposure warning."""
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from conftest import snapshot  # noqa: E402
from serve_fixtures import shared_checkpoint  # noqa: E402

from nanoeuler.cli import main  # noqa: E402
from nanoeuler.cli.serve import DEFAULT_CTX, check_cache_fits, exposure_warning  # noqa: E402
from nanoeuler.errors import UserError  # noqa: E402


def run_main(args, capsys):
    code = main(args)
    return code, capsys.readouterr()


def test_a_checkpoint_that_does_not_load_is_one_line(tmp_path, capsys):
    code, out = run_main(["serve", "--ckpt", str(tmp_path / "missing")], capsys)
    assert code != 0 and out.err.startswith("error:") and out.err.count("\n") == 1 and out.out == ""
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("{not json")
    (bad / "model.safetensors").write_bytes(b"\x00" * 64)
    code, out = run_main(["serve", "--ckpt", str(bad)], capsys)
    assert code != 0 and out.err.startswith("error:") and out.err.count("\n") == 1 and out.out == ""
    import shutil

    import numpy as np
    from safetensors.numpy import load_file, save_file
    nan = tmp_path / "nan"
    shutil.copytree(shared_checkpoint()[0], nan)
    params = load_file(str(nan / "model.safetensors"))
    params["embed.weight"][:] = np.nan  # a diverged model: refused, not served
    save_file(params, str(nan / "model.safetensors"))
    code, out = run_main(["serve", "--ckpt", str(nan)], capsys)
    assert code != 0 and "non-finite" in out.err and out.err.count("\n") == 1 and out.out == ""


def test_a_port_in_use_is_one_line(capsys):
    d = shared_checkpoint()[0]
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        code, out = run_main(["serve", "--ckpt", d, "--port", str(port)], capsys)
    assert code == 2 and out.err == f"error: cannot listen on 127.0.0.1:{port}: the port is in use\n"


@pytest.mark.parametrize("flags", [["--max-batch", "0"], ["--port", "70000"], ["--api-key", ""],
                                   ["--prompt-cache-mib", "-1"]])
def test_bad_flags(flags, capsys):
    code, out = run_main(["serve", "--ckpt", "x", *flags], capsys)
    assert code == 2 and out.err.startswith("error:")


def test_the_cache_is_sized_by_ctx_and_refused_when_full_rows_would_not_fit_in_ram():
    """Gemma 3's shape (18 layers, 1 KV head of 256, a 32,768 context): its full context in 64 rows is 72 GiB of
    cache, which a 24 GiB machine cannot map; serve's window defaults to DEFAULT_CTX and the rest is refused
    in one line naming the flags."""
    from nanoeuler import Config
    gemma = Config(vocab_size=64, dim=640, n_heads=4, n_kv_heads=1, n_layers=18, ctx_len=32768, ffn_hidden=2048, n_mtp=1,
                   head_dim=256)
    ram = 24 << 30
    assert check_cache_fits(gemma, 64, None, limit=ram) == DEFAULT_CTX < gemma.ctx_len
    assert check_cache_fits(gemma, 8, 32768, limit=ram) == 32768  # 18 GiB: fits
    with pytest.raises(UserError, match=r"--max-batch 64 rows of --ctx 32768 positions are 72\.0 GiB .* lower --ctx"):
        check_cache_fits(gemma, 64, 32768, limit=ram)
    for bad in (0, 32769):
        with pytest.raises(UserError, match=r"--ctx must be in \[1, 32768\]"):
            check_cache_fits(gemma, 1, bad, limit=ram)
    small = gemma.replace(ctx_len=256)
    assert check_cache_fits(small, 64, None, limit=ram) == 256


def test_exposure_warning():
    assert exposure_warning("127.0.0.1", None) is None and exposure_warning("::1", None) is None
    assert exposure_warning("localhost", None) is None
    assert exposure_warning("0.0.0.0", "key") is None
    assert "without --api-key" in exposure_warning("0.0.0.0", None)
    assert "without --api-key" in exposure_warning("192.168.1.10", None)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_ends_open_streams_and_exits_0(sig):
    d = shared_checkpoint()[0]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "nanoeuler", "serve", "--ckpt", d, "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        first = proc.stdout.readline()
        assert "on http://127.0.0.1:" in first, first + proc.stderr.read()
        url = first.split("on ", 1)[1].split("/ ", 1)[0]
        body = {"model": "tiny", "prompt": "To be", "max_tokens": 1000, "stream": True, "ignore_eos": True,
                "logprobs": 0}   # (each event lists its tokens: a window of tokens comes as one event)
        events = []
        with httpx.Client(timeout=30) as http, http.stream("POST", url + "/v1/completions", json=body) as r:
            lines = (line for line in r.iter_lines() if line)
            events.append(next(lines))
            proc.send_signal(sig)
            events += list(lines)  # the server ends the stream: this loop terminates
        assert events[-1] == "data: [DONE]"
        last = json.loads(events[-2][len("data: "):])
        made = sum(len(json.loads(e[len("data: "):])["choices"][0]["logprobs"]["tokens"]) for e in events[:-1])
        assert last["choices"][0]["finish_reason"] == "length" and made < 1000   # ended by the signal, not max_tokens
        assert proc.wait(20) == 0
        err = proc.stderr.read()
        assert "Traceback" not in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()


def test_serve_loads_read_only(tmp_path, capsys):
    """serve only reads its checkpoint: debris of an interrupted save is left where it lies (a writing load
    would remove it), even on the way to an error."""
    import shutil

    from nanoeuler import checkpoint as ckpt
    run = tmp_path / "run"
    shutil.copytree(shared_checkpoint()[0], run)
    (run / ckpt.STAGING).mkdir()
    (run / ckpt.STAGING / "half.bin").write_bytes(b"x")
    before = snapshot(run)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        code, out = run_main(["serve", "--ckpt", str(run), "--port", str(busy.getsockname()[1])], capsys)
    assert code == 2 and "in use" in out.err
    assert snapshot(run) == before


def test_sigterm_with_half_sent_bodies_exits_quietly_and_fast():
    """Clients that sent half a request body: shutdown used to wait for them for 10 s, then print a traceback
    for each cancelled request. Now each gets a 503 at once, stderr stays empty, and the exit code is 0."""
    import time
    d = shared_checkpoint()[0]
    proc = subprocess.Popen([sys.executable, "-m", "nanoeuler", "serve", "--ckpt", d, "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    socks = []
    try:
        first = proc.stdout.readline()
        assert "on http://127.0.0.1:" in first, first + proc.stderr.read()
        port = int(first.split("on http://127.0.0.1:", 1)[1].split("/", 1)[0])
        body = b'{"model": "tiny", "prompt": "To be, or not to be", "max_tokens": 5}'
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
        for _ in range(30):
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall(head % len(body) + body[:len(body) // 2])
            socks.append(s)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:  # every connection is in
            assert http.get("/health").status_code == 200
        time.sleep(0.3)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
        assert time.monotonic() - t0 < 5
        err = proc.stderr.read()
        assert "Traceback" not in err and "ERROR" not in err, err[:2000]
        for s in socks:
            s.settimeout(5)
            assert s.recv(4096).startswith(b"HTTP/1.1 503")
    finally:
        for s in socks:
            s.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()


def test_the_first_request_after_the_address_is_as_fast_as_a_warm_one():
    """The address used to be printed before the app was warm: the first request after it waited for the
    warm-up and loaded what it used cold (27 s in a report, 0.6 s against 0.02 s warm here). Now the address
    comes once a request of each kind has gone through the app: the first of each kind is answered within a
    small bound of the same request warm."""
    import statistics
    import time
    d = shared_checkpoint()[0]
    proc = subprocess.Popen([sys.executable, "-m", "nanoeuler", "serve", "--ckpt", d, "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    kinds = [("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "Who is there?"}],
                                       "max_tokens": 8, "top_p": 0.9, "logprobs": True, "top_logprobs": 3}),
             ("/v1/completions", {"model": "tiny", "prompt": ["To be", "or not"], "max_tokens": 4, "n": 2,
                                  "temperature": 0, "logprobs": 5, "echo": True}),
             ("/v1/completions", {"model": "tiny", "prompt": "To be", "max_tokens": 8, "stream": True})]
    try:
        first = proc.stdout.readline()
        assert "on http://127.0.0.1:" in first, first + proc.stderr.read()
        url = first.split("on ", 1)[1].split("/ ", 1)[0]
        times = {i: [] for i in range(len(kinds))}
        with httpx.Client(timeout=60) as http:
            for _ in range(4):
                for i, (path, body) in enumerate(kinds):
                    t0 = time.perf_counter()
                    assert http.post(url + path, json=body).status_code == 200
                    times[i].append(time.perf_counter() - t0)
        for i, (cold, *warm) in times.items():
            assert cold < 4 * statistics.median(warm) + 0.25, (kinds[i][0], cold, warm)
    finally:
        proc.terminate()
        proc.wait(30)
        proc.stdout.close()
        proc.stderr.close()


@pytest.mark.parametrize("ctx, factors", [(8, "short"), (64, "long")])
def test_longrope_turns_by_the_factors_of_the_context_served(tmp_path, ctx, factors):
    """Phi-3.5's and Phi-4-mini's LongRoPE: short factors at a context up to the original one, long beyond (as
    llama-server chooses by its n_ctx); `serve --ctx` is that context, not the model's 131,072 positions."""
    from nanoeuler import Model, Tokenizer
    from nanoeuler.cli import build_parser
    from nanoeuler.cli.serve import prepare
    from nanoeuler.config import Config
    cfg = Config(vocab_size=257, dim=32, n_heads=4, n_kv_heads=2, n_layers=1, ctx_len=64, ffn_hidden=48, n_mtp=1,
                 arch="phi3", rope_scaling="longrope", rope_freq_factors=(1.0, 2.0), rope_long_factors=(3.0, 5.0),
                 partial_rotary_factor=0.5, rope_original_ctx=16)
    Model.init(cfg, seed=0).save(tmp_path / "m", tokenizer=Tokenizer([]))
    app, sock, banner = prepare(build_parser().parse_args(["serve", "--ckpt", str(tmp_path / "m"), "--port", "0",
                                                           "--ctx", str(ctx)]))
    sock.close()
    served = app.state.service.cfg
    assert served.rope_factors().tolist() == list(getattr(cfg, {"short": "rope_freq_factors",
                                                                "long": "rope_long_factors"}[factors]))
    assert (f"context {ctx} of the model's 64" in banner) == (ctx < 64)


def test_a_one_position_window_serves_and_frees_its_rows():
    """`serve --ctx 1`: a window's jump kept ctx // 2 = 0 tokens, i.e. all of them, so a row past its first
    token refilled for ever: the warm-up never ended (no address, ~65 % CPU) and its rows stayed taken. Now
    the address comes, a completion of 2 tokens is answered, and no row is left taken."""
    import select
    import time
    d, _, tok = shared_checkpoint()
    prompt = "To be, or not to be"
    proc = subprocess.Popen([sys.executable, "-m", "nanoeuler", "serve", "--ckpt", d, "--port", "0", "--ctx", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 120)
        first = proc.stdout.readline() if ready else ""
        assert "on http://127.0.0.1:" in first, "no address within 120 s"
        url = first.split("on ", 1)[1].split("/ ", 1)[0]
        with httpx.Client(timeout=30) as http:
            r = http.post(url + "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 2,
                                                         "ignore_eos": True})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
            assert r.json()["nanoeuler"]["prompt_truncated_tokens"] == [len(tok.encode(prompt, add_bos=True)) - 1]
            deadline = time.time() + 5
            while (h := http.get(url + "/health").json())["active"] and time.time() < deadline:
                time.sleep(0.05)
            assert h["active"] == 0 and h["queued"] == 0
    finally:
        proc.terminate()
        proc.wait(30)
        proc.stdout.close()
        proc.stderr.close()
