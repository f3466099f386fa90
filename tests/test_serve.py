"""The HTTP API, driven by the official `openai` client against a real server on 127.0.0.1 (ephemeral port):
greedy completions equal `nanoeuler sample`, chat equals the `chat` REPL, streaming equals non-streaming,
stop / max_tokens / seed / n / logprobs + echo / usage, the API key, left truncation reported, a full
queue answers 429, a client that disconnects frees its row, and bad requests get 4xx error objects."""
import json
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from serve_fixtures import CTX, ServerThread, hold_engine_steps, no_job_starting, shared_checkpoint  # noqa: E402

from nanoeuler.infer.session import generate  # noqa: E402
from nanoeuler.infer.sampling import log_softmax  # noqa: E402
from nanoeuler.training.sft import render  # noqa: E402

KEY = "test-key"
PROMPT = "To be, or not to be"  # the fixture model answers it with a few tokens and </s>
LONG = "O, what a rogue"          # ... and this one with 60 tokens without </s>


@pytest.fixture(scope="module")
def ckpt():
    return shared_checkpoint()


@pytest.fixture(scope="module")
def server(ckpt):
    from nanoeuler.serve.app import create_app
    d, model, tok = ckpt
    app = create_app(model, tok, "tiny", api_key=KEY, max_batch=4, max_queue=8, max_tokens_cap=300, max_n=4,
                     body_limit=50_000)
    with ServerThread(app) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def sample_cli(ckpt_dir, prompt, n, *flags):
    """`nanoeuler sample --json` in this process -> its JSON object."""
    import contextlib
    import io

    from nanoeuler.cli import main
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        assert main(["sample", "--ckpt", str(ckpt_dir), "--prompt", prompt, "--max-new-tokens", str(n), "--json",
                     *flags]) == 0
    return json.loads(out.getvalue())


def test_greedy_completion_equals_nanoeuler_sample(ckpt, client):
    d, model, tok = ckpt
    want = sample_cli(d, PROMPT, 40, "--temperature", "0")
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=40, temperature=0)
    assert r.choices[0].text == want["text"]
    assert r.choices[0].finish_reason == ("stop" if want["stopped"] else "length")
    assert r.usage.prompt_tokens == len(tok.encode(PROMPT)) and r.usage.completion_tokens == len(want["ids"])
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=40, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == want["text"]
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_chat_equals_the_repl_single_and_multi_turn(ckpt, client):
    from nanoeuler.cli.chat import Repl
    from nanoeuler.infer.chat import Chat
    d, model, tok = ckpt
    repl = Chat(model, tok, temperature=0, max_new_tokens=30)
    Repl(repl).handle("Who is there?", lambda s: None)
    want = tok.decode(repl.last_reply)
    msgs = [{"role": "user", "content": "Who is there?"}]
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=30, temperature=0)
    assert r.choices[0].message.content == want and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == ("stop" if repl.last_stopped else "length")
    stream = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=30, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    # a second turn: earlier turns rendered as the REPL keeps them (prompt + reply + </s>)
    msgs2 = msgs + [{"role": "assistant", "content": "Nay, answer me."}, {"role": "user", "content": "Long live the king!"}]
    ids = render(tok, "Who is there?")[0] + tok.encode("Nay, answer me.") + [tok.eos_id] + render(tok, "Long live the king!")[0]
    assert CTX - 3 >= len(ids) > CTX - 30  # both turns fit with room for 3 new tokens, not for 30
    ref = generate(model, ids, 3, temperature=0, stop_ids=[tok.eos_id])
    r2 = client.chat.completions.create(model="tiny", messages=msgs2, max_tokens=3, temperature=0)
    assert r2.choices[0].message.content == tok.decode(ref.ids) and r2.usage.prompt_tokens == len(ids)
    assert "nanoeuler" not in r2.model_extra
    # with room for 30 new tokens the REPL drops the oldest turn, and the response says so
    last = render(tok, "Long live the king!")[0]
    ref = generate(model, last, 30, temperature=0, stop_ids=[tok.eos_id])
    r3 = client.chat.completions.create(model="tiny", messages=msgs2, max_tokens=30, temperature=0)
    assert r3.choices[0].message.content == tok.decode(ref.ids) and r3.usage.prompt_tokens == len(last)
    assert r3.model_extra["nanoeuler"] == {"dropped_turns": 1, "prompt_truncated_tokens": len(ids) - len(last)}


def test_stop_strings_and_max_tokens(ckpt, client):
    d, model, tok = ckpt
    full = client.completions.create(model="tiny", prompt=LONG, max_tokens=60, temperature=0).choices[0].text
    stop = full[10:13]
    cut = full.index(stop)
    assert len(full) > 20 and cut > 0
    r = client.completions.create(model="tiny", prompt=LONG, max_tokens=60, temperature=0, stop=[stop, "\x00never"])
    assert r.choices[0].text == full[:cut] and r.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model="tiny", prompt=LONG, max_tokens=60, temperature=0, stop=stop,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == full[:cut] and chunks[-1].choices[0].finish_reason == "stop"
    r = client.completions.create(model="tiny", prompt=LONG, max_tokens=5, temperature=0)
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"
    # ignore_eos (vLLM's extension): PROMPT's greedy reply ends with </s> early; with it, exactly max_tokens
    short = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=20, temperature=0)
    assert short.choices[0].finish_reason == "stop" and short.usage.completion_tokens < 20
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=20, temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 20 and r.choices[0].finish_reason == "length"
    assert r.choices[0].text.startswith(short.choices[0].text + "</s>")


def test_seed_reproducible_and_n_choices(ckpt, client):
    d, model, tok = ckpt
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=30, temperature=1.0, top_p=0.9)
    a = client.completions.create(seed=7, **kw).choices[0].text
    b = client.completions.create(seed=7, **kw).choices[0].text
    ref = generate(model, tok.encode(PROMPT), 30, temperature=1.0, top_p=0.9, seed=7, stop_ids=[tok.eos_id])
    assert a == b == tok.decode(ref.ids)
    r = client.completions.create(seed=7, n=3, **kw)
    texts = [c.text for c in sorted(r.choices, key=lambda c: c.index)]
    assert texts[0] == a and len(set(texts)) > 1  # choice i samples with seed + i
    streamed, finishes = ["", "", ""], [0, 0, 0]
    for chunk in client.completions.create(seed=7, n=3, stream=True, stop=["e"], **kw):
        for c in chunk.choices:
            streamed[c.index] += c.text
            finishes[c.index] += c.finish_reason is not None
    stopped = client.completions.create(seed=7, n=3, stop=["e"], **kw)
    assert streamed == [c.text for c in sorted(stopped.choices, key=lambda c: c.index)] and finishes == [1, 1, 1]
    assert streamed == [t.split("e")[0] for t in texts]
    assert sample_cli(d, PROMPT, 30, "--temperature", "1", "--top-p", "0.9", "--seed", "7")["text"] == a


def test_logprobs_with_echo_score_the_text_as_the_model_does(ckpt, client):
    d, model, tok = ckpt
    ids = tok.encode(PROMPT)
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=1, temperature=0, echo=True, logprobs=1)
    lp = r.choices[0].logprobs
    assert r.choices[0].text.startswith(PROMPT) and len(lp.token_logprobs) == len(ids) + 1
    logp = log_softmax(model.logits(np.array([ids]))[0, 0])  # [T, V]
    np.testing.assert_allclose(lp.token_logprobs[1:len(ids)], [logp[i - 1, ids[i]] for i in range(1, len(ids))],
                               atol=1e-5)
    assert lp.token_logprobs[0] is None and "".join(lp.tokens[:len(ids)]) == PROMPT
    assert lp.token_logprobs[-1] == pytest.approx(logp[-1].max(), abs=1e-5)  # greedy: the top token's logprob
    # token ids are accepted as the prompt too (lm-eval sends them)
    r2 = client.completions.create(model="tiny", prompt=ids, max_tokens=1, temperature=0, echo=True, logprobs=1)
    assert r2.choices[0].logprobs.token_logprobs == lp.token_logprobs
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert "".join(c.token for c in content) == chat.choices[0].message.content
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob == pytest.approx(c.logprob) for c in content)


def test_long_prompt_is_truncated_from_the_left_and_says_so(ckpt, client):
    d, model, tok = ckpt
    prompt = "Words, words, words. " * 80
    n = len(tok.encode(prompt))
    assert n > CTX
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0)
    assert r.model_extra["nanoeuler"]["prompt_truncated_tokens"] == [n - CTX] and r.usage.prompt_tokens == CTX
    assert r.choices[0].text == sample_cli(d, prompt, 10, "--temperature", "0")["text"]
    with pytest.raises(openai.BadRequestError) as e:  # a chat's last turn is not cut: chat_fits_the_window
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}], max_tokens=10)
    assert e.value.code == "context_length_exceeded"


def test_a_chat_longer_than_the_window_drops_its_oldest_turns_says_so_or_is_refused(ckpt):
    """`--ctx` shorter than the model's: the chat is rendered for the server's window, not the model's. Its oldest
    exchanges go, the system message stays, the reply says so (dropped_turns, prompt_truncated_tokens: tokens
    of the whole conversation left out) and is the model's greedy reply to what was kept. A last turn that
    does not fit alone is a 400 naming the limit. (The conversation used to be fitted to the model's context,
    then cut silently to the window's tail: two different questions got the same prompt and answer.)"""
    from nanoeuler import Model
    from nanoeuler.chat_template import prompt_ids
    from nanoeuler.serve.app import create_app
    d, model, tok = ckpt
    system = {"role": "system", "content": "Be brief."}
    conv = [system, {"role": "user", "content": "Who is there?"}, {"role": "assistant", "content": "Nay, answer me."},
            {"role": "user", "content": "Long live the king!"}, {"role": "assistant", "content": "Bernardo?"}]
    window = Model(model.config.replace(ctx_len=160), model.params)
    with ServerThread(create_app(model, tok, "tiny", ctx_len=160)) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
        for question in ("Get thee to bed.", "What, has this thing appeared again tonight?"):
            last = {"role": "user", "content": question}
            kept = prompt_ids(tok, [system, last])
            assert len(prompt_ids(tok, [system] + conv[3:] + [last])) > 160 - 8 >= len(kept)  # only the last fits
            r = client.chat.completions.create(model="tiny", messages=conv + [last], max_tokens=8, temperature=0)
            assert r.usage.prompt_tokens == len(kept)
            assert r.model_extra["nanoeuler"] == {"dropped_turns": 2, "prompt_truncated_tokens":
                                                  len(prompt_ids(tok, conv + [last])) - len(kept)}
            want = generate(window, kept, 8, temperature=0, stop_ids=tok.stop_ids)
            assert r.choices[0].message.content == tok.decode(want.ids)
        long = {"role": "user", "content": "Words, words, words. " * 5}
        assert 160 - 8 < len(prompt_ids(tok, [system, long])) <= model.config.ctx_len - 8
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="tiny", messages=conv + [long], max_tokens=8)
        assert e.value.code == "context_length_exceeded" and "152 of this server's 160" in e.value.message


def test_a_shorter_window_keeps_the_last_ctx_tokens_of_a_prompt_and_says_its_context(ckpt):
    from nanoeuler.serve.app import create_app
    d, model, tok = ckpt
    with ServerThread(create_app(model, tok, "tiny", ctx_len=16)) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
        assert client.models.retrieve("tiny").model_extra["context_length"] == 16
        n = len(tok.encode(PROMPT * 3, add_bos=True))
        r = client.completions.create(model="tiny", prompt=PROMPT * 3, max_tokens=4, temperature=0)
        assert r.usage.prompt_tokens == 16 and r.model_extra["nanoeuler"]["prompt_truncated_tokens"] == [n - 16]


def test_models_health_and_the_api_key(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert client.models.retrieve("tiny").id == "tiny"
    assert httpx.get(server.url + "/health").json()["status"] == "ok"  # no key needed
    for key in ("wrong", ""):
        bad = openai.OpenAI(base_url=server.url + "/v1", api_key=key or "x", max_retries=0,
                            default_headers={} if key else {"Authorization": ""})
        with pytest.raises(openai.AuthenticationError) as e:
            bad.completions.create(model="tiny", prompt="a", max_tokens=1)
        assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"


@pytest.mark.parametrize("body,status,param", [
    (b'{"model": "tiny", "prompt": ', 400, None),                              # malformed JSON
    ({"model": "tiny", "prompt": "a", "max_tokens": "5"}, 400, "max_tokens"),  # wrong type
    ({"model": "tiny", "prompt": "a", "temperature": "hot"}, 400, "temperature"),
    ({"model": "tiny", "prompt": 5}, 400, "prompt"),
    ({"model": "tiny"}, 400, "prompt"),
    ({"model": "nope", "prompt": "a"}, 404, "model"),                          # unknown model
    ({"model": "tiny", "prompt": "a", "n": 5}, 400, "n"),                      # n over the limit (4)
    ({"model": "tiny", "prompt": "a", "max_tokens": 301}, 400, "max_tokens"),  # over the cap (300)
    ({"model": "tiny", "prompt": "a", "max_tokens": -1}, 400, "max_tokens"),
    ({"model": "tiny", "prompt": "a", "top_p": 0}, 400, "top_p"),
    ({"model": "tiny", "prompt": ""}, 400, "prompt"),
    ({"model": "tiny", "prompt": [1, 99999]}, 400, "prompt"),
    ({"model": "tiny", "prompt": "a", "stop": ["a", "b", "c", "d", "e"]}, 400, None),
    ({"model": "tiny", "prompt": "a" * 60_000}, 413, None),                    # body over the cap (50 kB)
])
def test_bad_completion_requests_get_error_objects(server, body, status, param):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(server.url + "/v1/completions", content=data,
                   headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and "Traceback" not in r.text and set(err) == {"message", "type", "param", "code"}
    if param:
        assert err["param"] == param


def test_a_chunked_body_over_the_cap_is_413(server):
    def body():  # no Content-Length: the server counts while reading
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(600):
            yield b"a" * 100
        yield b'"}'
    r = httpx.post(server.url + "/v1/completions", content=body(),
                   headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert r.request.headers["transfer-encoding"] == "chunked"
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"


@pytest.mark.parametrize("messages", [[], [{"role": "assistant", "content": "hi"}],
                                      [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
                                      [{"role": "robot", "content": "a"}], "hello",
                                      [{"role": "user"}], [{"role": "user", "content": None}],
                                      [{"role": "user", "content": []}],
                                      [{"role": "system"}, {"role": "user", "content": "a"}],
                                      [{"role": "user", "content": [{"type": "text"}]}]])
def test_bad_chat_messages(client, messages):
    """Every message's shape is checked as the request is read: a message without content (it rendered as an
    empty turn and was answered 200), an empty list of parts, a part without text are 400s."""
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=messages)
    assert e.value.status_code == 400 and e.value.body["message"]


def test_top_logprobs_without_logprobs_is_400(client):
    """top_logprobs asks for something logprobs: false turns off (OpenAI refuses it too); it was ignored."""
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "a"}], top_logprobs=2)
    assert "top_logprobs" in e.value.body["message"]


def exchange(port: int, parts: list[bytes], pause: float = 0.0, timeout: float = 10.0) -> bytes:
    """Raw bytes to the server on one connection (parts sent `pause` seconds apart) -> all it sent back until it
    closed the connection (b"<timeout>" appended if it had not within `timeout` seconds)."""
    import socket
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.settimeout(timeout)
        for part in parts:
            s.sendall(part)
            time.sleep(pause)
        return read_to_close(s)


def read_to_close(s) -> bytes:
    """What socket s receives until the server closes it (b"<timeout>" appended at its timeout)."""
    import socket
    reply = b""
    try:
        while chunk := s.recv(1 << 16):
            reply += chunk
    except socket.timeout:
        reply += b"<timeout>"
    return reply


def error_reply(reply: bytes) -> tuple[int, dict]:
    """The status and the error object of a whole reply (JSON, connection closed after it)."""
    head, _, body = reply.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    assert headers["content-type"] == "application/json" and headers["connection"] == "close", reply
    assert len(body) == int(headers["content-length"]), reply
    return int(lines[0].split()[1]), json.loads(body)["error"]


POST = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
BODY = b'{"model": "tiny", "prompt": "To be", "max_tokens": 3}'


@pytest.mark.parametrize("raw, reason", [
    (b"GARBAGE\r\n\r\n", "Invalid method"),                                                   # bad request line
    (POST + b"Content-Length: -5\r\n\r\n", "Content-Length"),                                 # negative
    (POST + b"Content-Length: 99999999999999999999\r\n\r\n", "Content-Length overflow"),     # 20 digits
    (POST + b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\nhello", "Transfer-Encoding"),
    (POST + b"Content-Length: 20\r\n\r\n" + BODY, "Content-Length shorter than the body"),   # body past it
])
def test_malformed_http_gets_an_error_object_like_every_other_error(server, raw, reason):
    """What llhttp cannot parse was answered in text by uvicorn (every other error is an OpenAI error object):
    now a 400 error object naming the reason, and the connection closes."""
    status, err = error_reply(exchange(server.port, [raw]))
    assert status == 400 and err["code"] == "malformed_request" and reason in err["message"], err
    assert set(err) == {"message", "type", "param", "code"}


def test_a_request_that_stalls_half_way_is_408_after_the_read_timeout(ckpt):
    """A client that sends half a body, or half its headers, or nothing, and stalls held its connection (and
    the handler reading the body) for ever: it gets 408 after the read timeout, and the connection closes. A
    stream running beside it finishes."""
    from nanoeuler.serve.app import create_app
    d, model, tok = ckpt
    with ServerThread(create_app(model, tok, "tiny"), read_timeout=1.0) as srv:
        for part in (POST + b"Content-Length: %d\r\n\r\n" % len(BODY) + BODY[:10], POST[:20], b""):
            t0 = time.monotonic()
            status, err = error_reply(exchange(srv.port, [part]))
            assert status == 408 and err["code"] == "request_timeout" and 0.9 < time.monotonic() - t0 < 6
        slow = [BODY[:10], BODY[10:]]  # a whole request in time is served, however it is cut
        reply = exchange(srv.port, [POST + b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(BODY)] + slow,
                         pause=0.1)
        assert reply.startswith(b"HTTP/1.1 200") and b'"finish_reason"' in reply


def test_bytes_after_a_streaming_bodys_end_are_answered_after_the_stream(server, monkeypatch):
    """Bytes past a request's Content-Length that begin no request, arriving while its answer streams: the
    stream is sent whole, then the 400 error object (uvicorn wrote its text into the middle of the stream).
    The bytes go once the answer has begun, and the engine is held until the server has them: the answer
    streams meanwhile, however slow or fast the machine."""
    import socket
    body = json.dumps({**LONG_STREAM, "max_tokens": 200}).encode()
    head = POST + b"Authorization: Bearer %s\r\nContent-Length: %d\r\n\r\n" % (KEY.encode(), len(body))
    with hold_engine_steps(monkeypatch) as release, socket.create_connection(("127.0.0.1", server.port)) as s:
        s.settimeout(60)   # (a first step that compiles the engine's kernels takes a while on a busy machine)
        s.sendall(head + body)
        begun = s.recv(1 << 16)   # the answer's head (and first token): it streams, held
        s.sendall(b"junk\r\n")
        time.sleep(0.2)           # (the server's event loop reads them; the engine still waits)
        release.set()
        reply = begun + read_to_close(s)
    stream, _, rest = reply.partition(b"0\r\n\r\n")  # the chunked encoding's end
    assert stream.startswith(b"HTTP/1.1 200") and stream.count(b"data: [DONE]") == 1
    status, err = error_reply(rest)
    assert status == 400 and err["code"] == "malformed_request"


def test_unknown_route_and_method(server):
    r = httpx.get(server.url + "/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["message"]
    r = httpx.get(server.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 405 and r.json()["error"]


def test_full_queue_429_and_disconnect_frees_rows(ckpt, monkeypatch):
    from nanoeuler.serve.app import create_app
    d, model, tok = ckpt
    app = create_app(model, tok, "tiny", max_batch=1, max_queue=1, max_tokens_cap=10 ** 6)
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 5000, "temperature": 1, "stream": True, "ignore_eos": True}
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=30) as http:
        # (the engine is held while the first stream streams: it cannot reach max_tokens and free the row)
        with hold_engine_steps(monkeypatch), http.stream("POST", "/v1/completions", json=body) as first:
            lines = first.iter_lines()
            assert next(lines).startswith("data: ")  # the first row is busy streaming
            with http.stream("POST", "/v1/completions", json=body) as second:  # waits in the queue
                deadline = time.time() + 5
                while http.get("/health").json()["queued"] < 1 and time.time() < deadline:
                    time.sleep(0.01)
                r = http.post("/v1/completions", json=body)
                assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded"
        # both clients hung up mid-stream: their jobs are cancelled and the row is free at once
        deadline = time.time() + 3
        while (h := http.get("/health").json())["active"] + h["queued"] and time.time() < deadline:
            time.sleep(0.01)
        assert h["active"] == 0 and h["queued"] == 0
        assert http.post("/v1/completions", json={**body, "stream": False, "max_tokens": 3}).status_code == 200
        # a non-streaming client that gives up: its job is cancelled too (checked every half second)
        with pytest.raises(httpx.ReadTimeout):  # (10^6 tokens: minutes, whatever the machine)
            http.post("/v1/completions", json={**body, "stream": False, "max_tokens": 10 ** 6}, timeout=0.5)
        deadline = time.time() + 5
        while (h := http.get("/health").json())["active"] and time.time() < deadline:
            time.sleep(0.05)
        assert h["active"] == 0


def test_a_short_request_is_answered_while_a_long_one_holds_every_row(ckpt):
    """One request of 8 endless streams (2 prompts x n=4) on 4 rows: a short greedy request sent meanwhile is
    answered, with the text it has alone, while the long one still streams (served first come, first served,
    it waited for the long request's jobs to end)."""
    from nanoeuler.serve.app import create_app
    d, model, tok = ckpt
    short = {"model": "tiny", "prompt": PROMPT, "max_tokens": 20, "temperature": 0}
    endless = {"model": "tiny", "prompt": [PROMPT, LONG], "n": 4, "max_tokens": 10 ** 6, "temperature": 1,
               "stream": True, "ignore_eos": True}
    app = create_app(model, tok, "tiny", max_batch=4, max_tokens_cap=10 ** 6)
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=30) as http:
        alone = http.post("/v1/completions", json=short).json()["choices"][0]["text"]
        with http.stream("POST", "/v1/completions", json=endless) as long:
            lines = long.iter_lines()
            assert next(lines).startswith("data: ")
            deadline = time.time() + 10
            while http.get("/health").json()["active"] < 4 and time.time() < deadline:  # (its jobs are in)
                time.sleep(0.01)
            assert http.post("/v1/completions", json=short).json()["choices"][0]["text"] == alone
            assert next(lines) is not None  # it streams on, its waiting job taking the row the short one freed
            deadline = time.time() + 10
            while http.get("/health").json()["active"] < 4 and time.time() < deadline:
                time.sleep(0.01)
            assert http.get("/health").json()["active"] == 4


def test_text_stream_never_splits_a_character_and_holds_back_stop_prefixes():
    from nanoeuler.serve.protocol import TextStream

    class ByteTok:  # token i is the single byte i
        def token_bytes(self, i):
            return bytes([i])
    snow = "☃".encode()  # 3 bytes
    ts = TextStream(ByteTok(), [])
    assert [ts.feed(b) for b in snow] == ["", "", "☃"]
    ts = TextStream(ByteTok(), ["ab"])
    assert [ts.feed(b) for b in b"xa"] == ["x", ""] and ts.feed(ord("c")) == "ac"
    assert [ts.feed(b) for b in b"zab"] == ["z", "", ""] and ts.stopped and ts.flush() == ""
    ts = TextStream(ByteTok(), ["ab"])
    assert ts.feed(ord("a")) == "" and ts.flush() == "a"  # at the end, a held prefix is released


@pytest.mark.parametrize("stops, logprobs", [([], None), ([], 2), (["e t"], None)])
def test_a_batch_of_events_gives_what_they_give_one_by_one(ckpt, stops, logprobs):
    """Choice.on_events (a Dispatcher batch at once: the tokens of a run decoded together) leaves a choice
    as on_event of each event does: text, pieces, token count, logprobs, finish reason, for tokens that
    split characters, end-of-turn ids (chat) and stop strings; in batches of every size."""
    from nanoeuler.serve.service import Choice
    d, model, tok = ckpt
    rng = np.random.default_rng(0)
    ids = tok.encode("the end  of é☃ days; the e t") + [int(t) for t in rng.integers(0, tok.vocab_size, 30)]
    events = [("token", (t, None if logprobs is None else -1.0, None)) for t in ids]
    stop_ids = {tok.eos_id}
    events = events[:25] + [("token", (tok.eos_id, None, None))] + [("done", ("stop",))]

    def fresh():
        return Choice(0, tok, [1], stops, stop_ids, chat=True)
    one = fresh()
    pieces = [one.on_event(kind, args) for kind, args in events]
    for size in (1, 2, 7, len(events)):
        batched = fresh()
        got = [batched.on_events(events[i:i + size]) for i in range(0, len(events), size)]
        assert "".join(p for p, _ in got) == "".join(p for p, _ in pieces) == one.text == batched.text
        assert sum(n for _, n in got) == sum(n for _, n in pieces)
        assert (batched.n_tokens, batched.finish_reason, batched.logprobs) == (one.n_tokens, one.finish_reason,
                                                                               one.logprobs)
    assert one.finish_reason == "stop" and one.n_tokens > 0


def test_one_send_per_pass_of_the_event_loop():
    """Writes to a connection within one pass of the event loop leave in one send, at the end of the pass;
    a close sends what is pending first; nothing is sent on a closing transport."""
    import asyncio

    from nanoeuler.serve.transport import OneSendPerPass

    class Transport:
        def __init__(self):
            self.sent, self.closed = [], False

        def write(self, data):
            self.sent.append(data)

        def is_closing(self):
            return self.closed

        def close(self):
            self.closed = True

        def get_extra_info(self, name):
            return "peer" if name == "peername" else None

    async def main():
        t = Transport()
        w = OneSendPerPass(t)
        w.write(b"HTTP/1.1 200 OK\r\n\r\n")
        w.write(memoryview(b"data: 1\n\n"))
        assert t.sent == []  # not before the pass ends
        await asyncio.sleep(0)
        w.write(b"data: 2\n\n")
        await asyncio.sleep(0)
        w.write(b"0\r\n\r\n")
        w.close()
        after_close = list(t.sent)
        w.write(b"late")
        await asyncio.sleep(0)
        return t, after_close, w.get_extra_info("peername")
    t, after_close, peer = asyncio.run(main())
    assert after_close == [b"HTTP/1.1 200 OK\r\n\r\ndata: 1\n\n", b"data: 2\n\n", b"0\r\n\r\n"]
    assert t.sent == after_close and t.closed and peer == "peer"


@pytest.mark.parametrize("first_after, headers_at", [(0.01, "with the first events"), (0.4, "at the wait")])
def test_a_streams_headers_leave_with_its_first_events_or_at_the_wait(first_after, headers_at):
    """EventStream sends the status line and headers together with the first events when these come within
    HEADERS_WAIT (one write instead of two), else at HEADERS_WAIT, before them (a request waiting for a row
    learns it was taken); then the events; the chunk that ends with [DONE] ends the reply (a generator that
    stops without one: an empty last message)."""
    import asyncio

    from nanoeuler.serve.transport import EventStream

    async def main():
        loop, sent = asyncio.get_running_loop(), []

        async def body(done):
            await asyncio.sleep(first_after)
            yield "data: 1\n\n"
            yield "data: 2\n\n" + ("data: [DONE]\n\n" if done else "")
            ended.append(True)  # (after [DONE]: run by the generator's closing)

        async def send(message):
            sent.append((loop.time(), message["type"], message.get("body"), message.get("more_body")))

        async def receive():
            await asyncio.sleep(10)
        t0 = loop.time()
        await EventStream(body(False), media_type="text/event-stream")({"type": "http"}, receive, send)
        plain, sent[:] = list(sent), []
        await EventStream(body(True), media_type="text/event-stream")({"type": "http"}, receive, send)
        return [(round(t - t0, 2), kind, b, more) for t, kind, b, more in plain], [m[1:] for m in sent]
    ended = []
    sent, with_done = asyncio.run(main())
    assert [m[1:] for m in sent] == [("http.response.start", None, None), ("http.response.body", b"data: 1\n\n", True),
                                     ("http.response.body", b"data: 2\n\n", True), ("http.response.body", b"", False)]
    assert with_done == [("http.response.start", None, None), ("http.response.body", b"data: 1\n\n", True),
                         ("http.response.body", b"data: 2\n\ndata: [DONE]\n\n", False)]
    assert ended == [True]  # the first generator ran to its end; the second was closed after its [DONE]
    wait = sent[0][0]
    if headers_at == "with the first events":
        assert wait >= first_after and sent[1][0] == wait
    else:
        assert 0.04 <= wait < 0.3 and sent[1][0] >= first_after


def test_the_servers_connections_send_without_nagles_delay():
    """bind() names the socket's protocol, so that asyncio turns Nagle's algorithm off (TCP_NODELAY) on every
    connection it accepts: without it a stream's chunk waited for the client's delayed acknowledgement of the
    chunk before (a keep-alive client got a reply's end tens of ms late)."""
    import asyncio
    import socket

    from nanoeuler.serve.transport import bind

    async def main():
        sock, seen = bind("127.0.0.1", 0), []

        async def handler(reader, writer):
            seen.append(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()
        server = await asyncio.start_server(handler, sock=sock)
        reader, writer = await asyncio.open_connection(*sock.getsockname()[:2])
        await reader.read()
        writer.close()
        server.close()
        await server.wait_closed()
        return seen
    assert asyncio.run(main()) == [1]


def test_the_warm_up_goes_through_the_whole_app(ckpt):
    """run_server sends WARM_UP through the app in-process (with the API key when there is one) before it
    announces its port: every request is answered 200 and the engine made tokens."""
    import asyncio

    from nanoeuler.serve.app import WARM_UP, create_app, warm_up
    d, model, tok = ckpt
    app = create_app(model, tok, "tiny", api_key=KEY)
    batcher = app.state.service.batcher.start()
    try:
        statuses = asyncio.run(asyncio.wait_for(warm_up(app), 120))
    finally:
        batcher.close()
    assert statuses == [200] * len(WARM_UP) and batcher.stats()["tokens"] >= 8


def test_short_texts_are_tokenized_on_the_event_loop_long_ones_off_it():
    """on_loop_if_short: up to INLINE_CHARS characters on the loop's own thread (no hop to a worker and
    back), more on a worker thread (test_tokenize_runs_off_the_event_loop: the loop keeps serving)."""
    import asyncio
    import threading

    from nanoeuler.serve.app import INLINE_CHARS, on_loop_if_short

    async def main():
        here = threading.get_ident()
        short = await on_loop_if_short(INLINE_CHARS, threading.get_ident)
        long = await on_loop_if_short(INLINE_CHARS + 1, threading.get_ident)
        return here, short, long
    here, short, long = asyncio.run(main())
    assert short == here != long


def test_a_gpt2_arch_model_with_a_gpt2_style_tokenizer():
    """An imported-style checkpoint: arch gpt2 (learned positions, LayerNorm, biases) and <|endoftext|> as
    the end token instead of </s>. Greedy completions and chat equal `generate` on the same ids."""
    from nanoeuler import Config, Model
    from nanoeuler.data.corpus import bundled_works
    from nanoeuler.serve.app import create_app
    from nanoeuler.tokenizer import Tokenizer
    tok = Tokenizer.train([bundled_works()["hamlet"][:8000]], 280, specials=("<|endoftext|>",), progress=False)
    cfg = Config(vocab_size=tok.vocab_size, dim=32, n_heads=4, n_kv_heads=4, n_layers=2, ctx_len=128, ffn_hidden=64,
                 n_mtp=1, arch="gpt2")
    model = Model.init(cfg, seed=3)
    end = tok.special_tokens["<|endoftext|>"]
    with ServerThread(create_app(model, tok, "g")) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        r = client.completions.create(model="g", prompt=PROMPT, max_tokens=20, temperature=0)
        ref = generate(model, tok.encode(PROMPT), 20, temperature=0, stop_ids=[end])
        assert r.choices[0].text == tok.decode(ref.ids)
        msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Ho"}, {"role": "user", "content": "Ha"}]
        c = client.chat.completions.create(model="g", messages=msgs, max_tokens=5, temperature=0)
        ids = render(tok, "Hi")[0] + tok.encode("Ho") + [end] + render(tok, "Ha")[0]
        assert c.choices[0].message.content == tok.decode(generate(model, ids, 5, temperature=0, stop_ids=[end]).ids)
        assert httpx.get(srv.url + "/tokenizer_info").json()["eos_token"] == "<|endoftext|>"


def test_streams_never_split_a_character(ckpt):
    """A random model samples raw byte tokens: multi-byte characters arrive split over several tokens. The
    streamed pieces, joined, equal the one-shot decode of the same ids (a character cut between two chunks
    would show up as extra U+FFFD), in the completions and the chat stream."""
    from nanoeuler import Model
    from nanoeuler.serve.app import create_app
    d, trained, tok = ckpt
    model = Model.init(trained.config, seed=11)
    split_chars = 0
    with ServerThread(create_app(model, tok, "r")) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        for seed in range(12):
            chunks = [c.choices[0].text for c in client.completions.create(
                model="r", prompt="é☃", max_tokens=40, temperature=1, seed=seed, stream=True, extra_body={"ignore_eos": True})]
            ref = generate(model, tok.encode("é☃"), 40, temperature=1, seed=seed)
            full = tok.decode(ref.ids)
            assert "".join(chunks) == full
            split_chars += sum(1 for ch in full if ord(ch) > 127 and ch != "\ufffd"
                               and len(ch.encode()) > 1 and ch.encode() not in {tok.token_bytes(t) for t in ref.ids})
        chat = client.chat.completions.create(model="r", messages=[{"role": "user", "content": "é"}], max_tokens=40,
                                              temperature=1, seed=1, stream=True, extra_body={"ignore_eos": True})
        streamed = "".join(c.choices[0].delta.content or "" for c in chat if c.choices)
        plain = client.chat.completions.create(model="r", messages=[{"role": "user", "content": "é"}], max_tokens=40,
                                               temperature=1, seed=1, extra_body={"ignore_eos": True})
        assert streamed == plain.choices[0].message.content
    assert split_chars > 0  # the test saw characters whose bytes came in different tokens


def sse_events(lines) -> list:
    """The data: payloads of a server-sent event stream's lines, JSON decoded ([DONE] kept as the string)."""
    return [line[6:] if line == "data: [DONE]" else json.loads(line[6:]) for line in lines if line]


LONG_STREAM = {"model": "tiny", "prompt": PROMPT, "max_tokens": 40, "temperature": 0, "stream": True, "ignore_eos": True}


@pytest.mark.parametrize("extra", [{"seed": -1}, {"seed": 2 ** 64}, {"seed": 2 ** 64 - 1, "n": 2}, {"seed": -(2 ** 63)}])
def test_a_bad_seed_is_400_and_running_streams_finish(ckpt, extra, monkeypatch):
    """A negative seed used to raise inside the engine's admission: the running streams of other clients got
    a 500, the bad request no answer at all. Now it is a 400 naming the seed, and the streams finish."""
    from nanoeuler.serve.app import create_app
    d, model, tok = ckpt
    with ServerThread(create_app(model, tok, "tiny", max_batch=4)) as srv, httpx.Client(base_url=srv.url, timeout=30) as http:
        with hold_engine_steps(monkeypatch, no_job_starting) as release, \
                http.stream("POST", "/v1/completions", json=LONG_STREAM) as a, \
                http.stream("POST", "/v1/completions", json=LONG_STREAM) as b:
            lines = [a.iter_lines(), b.iter_lines()]
            firsts = [next(it) for it in lines]
            assert http.get("/health").json()["active"] == 2  # both rows are busy (held: neither can end)
            r = http.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 5, **extra})
            assert r.status_code == 400 and r.json()["error"]["param"] == "seed", r.text
            assert "2**64" in r.json()["error"]["message"] or "greater than or equal to 0" in r.json()["error"]["message"]
            release.set()
            for first, it in zip(firsts, lines):
                events = sse_events([first, *it])
                assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
        assert http.post("/v1/completions", json={**LONG_STREAM, "stream": False, "seed": 1}).status_code == 200


def test_an_engine_failure_ends_only_the_requests_it_touched(ckpt, monkeypatch):
    """An exception inside the engine (injected into sampling at temperature 0.5): a non-streaming request gets
    a 500 error object, a stream gets an error event and [DONE], a stream running beside them finishes
    normally, and the server serves on."""
    from nanoeuler.infer import engine
    from nanoeuler.serve.app import create_app
    real = engine.sample_token

    def failing(logits, temperature, *a, **k):
        if temperature == 0.5:
            raise RuntimeError("injected")
        return real(logits, temperature, *a, **k)
    monkeypatch.setattr(engine, "sample_token", failing)
    d, model, tok = ckpt
    bad = {**LONG_STREAM, "temperature": 0.5}
    with ServerThread(create_app(model, tok, "tiny", max_batch=4)) as srv, httpx.Client(base_url=srv.url, timeout=30) as http:
        # (the engine steps only while a job starts, each failing one: the good stream runs beside them all)
        with hold_engine_steps(monkeypatch, no_job_starting) as release, \
                http.stream("POST", "/v1/completions", json=LONG_STREAM) as good:
            lines = good.iter_lines()
            first = next(lines)
            with http.stream("POST", "/v1/completions", json=bad) as failed:
                events = sse_events(failed.iter_lines())
            assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "engine_error"
            assert "injected" in events[-2]["error"]["message"]
            r = http.post("/v1/completions", json={**bad, "stream": False})
            assert r.status_code == 500 and r.json()["error"]["code"] == "engine_error"
            chat = http.post("/v1/chat/completions", json={"model": "tiny", "temperature": 0.5, "max_tokens": 3,
                                                          "messages": [{"role": "user", "content": "Hi"}]})
            assert chat.status_code == 500 and "Traceback" not in chat.text
            assert http.get("/health").json()["active"] == 1  # the good stream still runs
            release.set()
            events = sse_events([first, *lines])
            assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
        r = http.post("/v1/completions", json={**LONG_STREAM, "stream": False})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 40


def held_until_answered(http, running: threading.Event, done: threading.Event, times: int = 5) -> None:
    """Once the work that `running` announces has begun (it then waits for `done`): /health answers `times`
    times meanwhile, each within 5 s (work on the event loop would block it for as long as the work is held)."""
    assert running.wait(300), "the work never began"
    try:
        for _ in range(times):
            assert http.get("/health", timeout=5).status_code == 200
    finally:
        done.set()


def test_tokenize_runs_off_the_event_loop(ckpt, monkeypatch):
    """A megabyte /tokenize (a text of specials: seconds of work on a slow machine) must not stall the other
    clients: /health keeps answering while it runs (before the fix the loop was blocked for the whole encode).
    The encode is held until /health has answered, so the test does not depend on how long encoding takes."""
    import threading
    from nanoeuler.serve.app import create_app
    d, model, tok = ckpt
    text = "a</s>" * 200_000
    app = create_app(model, tok, "tiny", body_limit=2 << 20)
    running, done, encode = threading.Event(), threading.Event(), app.state.service.tok.encode

    def held_encode(text, *a, **k):
        if len(text) > 100_000:
            running.set()
            done.wait(60)
        return encode(text, *a, **k)
    monkeypatch.setattr(app.state.service.tok, "encode", held_encode)
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=60) as http:
        answer = {}
        worker = threading.Thread(target=lambda: answer.update(
            httpx.post(srv.url + "/tokenize", json={"prompt": text}, timeout=120).json()))
        worker.start()
        held_until_answered(http, running, done)
        worker.join()
    assert answer["count"] == 400_000


def test_a_large_logprobs_reply_is_written_off_the_event_loop(ckpt, monkeypatch):
    """64 prompts scored with echo and 20 top logprobs a token: the reply's JSON (~10 MB) was built on the event
    loop, which answered no one else meanwhile (/health waited 5 s). Now it is built on a worker thread and
    /health keeps answering. The building is held until /health has answered, whatever the machine's speed."""
    import threading
    from nanoeuler.data.corpus import bundled_works
    from nanoeuler.serve import app as serve_app
    d, model, tok = ckpt
    text = bundled_works()["hamlet"]
    body = {"model": "tiny", "prompt": [text[i * 900:i * 900 + 800] for i in range(64)], "max_tokens": 1,
            "logprobs": 20, "echo": True}
    running, done, whole = threading.Event(), threading.Event(), serve_app.CompletionReply.whole

    def held_whole(reply):
        running.set()
        done.wait(60)
        return whole(reply)
    monkeypatch.setattr(serve_app.CompletionReply, "whole", held_whole)
    with ServerThread(serve_app.create_app(model, tok, "tiny", body_limit=1 << 20)) as srv, \
            httpx.Client(base_url=srv.url, timeout=60) as http:
        answer = {}
        worker = threading.Thread(target=lambda: answer.update(
            size=len(httpx.post(srv.url + "/v1/completions", json=body, timeout=600).content)))
        worker.start()
        held_until_answered(http, running, done)
        worker.join()
    assert answer["size"] > 5e6


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_choice_i_of_n_samples_with_seed_plus_i(ckpt, client, route):
    """The documented rule for n choices: choice i is exactly the single request with seed + i (a rule such
    as seed + 2i passed the other tests)."""
    d, model, tok = ckpt
    if route == "completions":
        def ask(**kw):
            r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=20, temperature=1.0, **kw)
            return [c.text for c in sorted(r.choices, key=lambda c: c.index)]
    else:
        def ask(**kw):
            r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPT}],
                                               max_tokens=20, temperature=1.0, **kw)
            return [c.message.content for c in sorted(r.choices, key=lambda c: c.index)]
    texts = ask(seed=11, n=4)
    singles = [ask(seed=11 + i)[0] for i in range(4)]
    assert texts == singles and len(set(texts)) > 2
    if route == "completions":
        ref = generate(model, tok.encode(PROMPT, add_bos=True), 20, temperature=1.0, seed=13, stop_ids=[tok.eos_id])
        assert texts[2] == tok.decode(ref.ids)


def test_dispatcher_hands_a_flowing_stream_over_in_batches():
    """The first event after a quiet spell reaches its queue at once; the events that follow within the
    window arrive together, as one list (one pass over the HTTP path), in order; then it is quiet again."""
    import asyncio
    import threading

    from nanoeuler.serve.service import Dispatcher

    async def main():
        d, q = Dispatcher(asyncio.get_running_loop()), asyncio.Queue()
        d.WINDOW = 0.5
        d.put(q, 0)
        first = await asyncio.wait_for(q.get(), 0.4)  # not held for the window
        engine = threading.Thread(target=lambda: [d.put(q, i) for i in range(1, 51)])
        engine.start()
        engine.join()
        flowing = await asyncio.wait_for(q.get(), 2)
        await asyncio.sleep(d.WINDOW * 1.5)  # the window passes with nothing new: quiet
        d.put(q, 51)
        again = await asyncio.wait_for(q.get(), 0.4)
        return first, flowing, again
    first, flowing, again = asyncio.run(main())
    assert first == [0]
    assert flowing == list(range(1, 51))
    assert again == [51]


def test_dispatcher_hands_a_jobs_first_token_and_last_event_over_at_once():
    """While the window's timer runs (a prompt event opened it, or a stream flows), an event put `now` (a
    job's first token, its last event) does not wait for the window: it and what came before it reach the
    queue at once."""
    import asyncio

    from nanoeuler.serve.service import Dispatcher

    async def main():
        d, q = Dispatcher(asyncio.get_running_loop()), asyncio.Queue()
        d.WINDOW = 5.0
        d.put(q, 0)
        first = await asyncio.wait_for(q.get(), 1)  # the first event: at once; the 5 s window starts
        d.put(q, 1)
        d.put(q, "done", now=True)
        end = await asyncio.wait_for(q.get(), 1)    # not 5 s later
        return first, end
    assert asyncio.run(main()) == ([0], [1, "done"])


def test_a_jobs_first_token_and_end_are_handed_over_at_once(monkeypatch):
    """Run.add marks a job's first token and its done / error events `now`, its prompt event and later tokens
    not (the prompt event, just before the first token, opened a window the first token used to wait out)."""
    from nanoeuler.serve import service
    calls = []

    class Recorder:
        def put(self, queue, item, now=False):
            calls.append((item[1], now))
    run = service.Run(batcher=None, dispatcher=Recorder())
    choice = type("C", (), {})()
    monkeypatch.setattr(service, "Job",
                        lambda on_event, **job: type("J", (), {"on_event": staticmethod(on_event)}))
    run.add(choice)
    for kind, args in [("prompt", ()), ("token", (5, None, None)), ("token", (6, None, None)), ("done", ("length",))]:
        choice.job.on_event(kind, *args)
    assert calls == [("prompt", False), ("token", True), ("token", False), ("done", True)]


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_a_streams_end_is_one_write(ckpt, route):
    """The reply's last piece of text, its usage and [DONE] go out in one body message (one socket write:
    each write wakes the client; they were three), and every message holds whole events."""
    from nanoeuler.serve.app import create_app
    d, model, tok = ckpt
    app, messages = create_app(model, tok, "tiny"), []

    async def recorder(scope, receive, send):
        async def record(message):
            if scope["type"] == "http" and message["type"] == "http.response.body" and message.get("body"):
                messages.append(message["body"].decode())
            await send(message)
        await app(scope, receive, record)
    body = {"model": "tiny", "max_tokens": 12, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, "temperature": 0}
    body.update({"prompt": LONG} if route == "completions" else {"messages": [{"role": "user", "content": LONG}]})
    with ServerThread(recorder) as srv:
        r = httpx.post(f"{srv.url}/v1/{'completions' if route == 'completions' else 'chat/completions'}",
                       json=body, timeout=60)
    assert r.status_code == 200
    assert all(m.startswith("data: ") and m.endswith("\n\n") for m in messages)
    last = messages[-1].split("\n\n")[:-1]
    assert last[-1] == "data: [DONE]"
    assert json.loads(last[-2][6:])["usage"]["completion_tokens"] == 12
    assert json.loads(last[-3][6:])["choices"][0]["finish_reason"] == "length"
    assert "".join(messages) == r.text



def test_the_prompt_cache_changes_no_reply_and_health_reports_its_hits(ckpt):
    """The same requests to a server with the prompt cache (the default) and to one without: a chat and its
    next turn, the next turn sampled with a seed, a completion and its continuation with n = 3 seeded choices,
    and 6 clients at once sharing a long system prompt. Every reply is the same, logprobs to the bit; the cache
    server's /health counts the requests that reused positions, and it computed fewer."""
    from concurrent.futures import ThreadPoolExecutor

    from nanoeuler.serve.app import create_app
    d, model, tok = ckpt
    system = {"role": "system", "content": "You are the ghost of Hamlet's father, and you speak in riddles "
                                           "about the castle, the king, the queen, and the night watch."}

    def session(client):
        out = []

        def chat(messages, **kw):
            r = client.chat.completions.create(model="tiny", messages=messages, logprobs=True, top_logprobs=3, **kw)
            return [(c.message.content, c.logprobs.model_dump()) for c in r.choices]
        turn = [{"role": "user", "content": "Who is there?"}]
        out.append(chat(turn, max_tokens=12, temperature=0))
        turn += [{"role": "assistant", "content": out[-1][0][0]}, {"role": "user", "content": "Long live the king!"}]
        out.append(chat(turn, max_tokens=3, temperature=0))
        out.append(chat(turn, max_tokens=3, temperature=1.0, seed=3))

        def complete(prompt, **kw):
            r = client.completions.create(model="tiny", prompt=prompt, logprobs=2, **kw)
            out.append([(c.text, c.logprobs.model_dump()) for c in sorted(r.choices, key=lambda c: c.index)])
            return r.choices[0].text
        text = complete(LONG, max_tokens=30, temperature=0)
        complete(LONG + text + " And so", max_tokens=10, temperature=0.9, seed=5, n=3)
        questions = ["Who is there?", "Where is the king?", "Is it the night?", "What hour now?",
                     "Mark me.", "Speak, I am bound to hear."]
        with ThreadPoolExecutor(6) as pool:
            out += pool.map(lambda q: chat([system, {"role": "user", "content": q}], max_tokens=8, temperature=0),
                            questions)
        return out

    replies, health = [], []
    for mib in (0, 1024):
        with ServerThread(create_app(model, tok, "tiny", prompt_cache_mib=mib)) as srv:
            client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
            replies.append(session(client))
            health.append(httpx.get(srv.url + "/health").json()["prefix_cache"])
    assert replies[0] == replies[1]
    off, on = health
    assert off["hits"] == off["reused_tokens"] == off["bytes"] == off["budget_bytes"] == 0
    assert on["budget_bytes"] == 1024 << 20 and 0 < on["bytes"] <= on["budget_bytes"]
    assert on["hits"] >= 2 + 2 + 5 and on["reused_tokens"] > 500  # 2 turns, 2 choices, 5 of 6 clients at least
    assert on["prefilled_tokens"] + on["reused_tokens"] == off["prefilled_tokens"]


def test_metrics_are_prometheus_text_that_counts_what_happened(ckpt, monkeypatch):
    """GET /metrics, parsed by prometheus_client's own parser: requests by route and status (a 404 path as
    "other", a 400, a 413), prompt and generated tokens, one time to first token per job and the times
    between its tokens, the rows and KV positions a running stream holds, and the prefix cache's hits as
    /health reports them."""
    from prometheus_client.parser import text_string_to_metric_families

    from nanoeuler.serve.app import create_app
    d, model, tok = ckpt

    def scrape(http) -> dict:
        r = http.get("/metrics")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for f in text_string_to_metric_families(r.text) for s in f.samples}
    app = create_app(model, tok, "tiny", max_tokens_cap=10 ** 6, body_limit=5000)
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=60) as http:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
        r1 = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, n=2,
                                       extra_body={"ignore_eos": True})
        r2 = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPT}],
                                            max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
        r3 = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPT}],
                                            max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
        assert http.get("/v1/nothing").status_code == 404
        assert http.post("/v1/completions", json={"model": "tiny"}).status_code == 400
        assert http.post("/v1/completions", content=b"x" * 6000).status_code == 413
        m = scrape(http)

        def requests(route, status):
            return m.get(("nanoeuler_requests_total", (("route", route), ("status", status))), 0)
        assert requests("/v1/completions", "200") == 1 and requests("/v1/chat/completions", "200") == 2
        assert requests("other", "404") == 1 and requests("/v1/completions", "400") == 1
        assert requests("other", "413") == 1  # (the body limit answers before any route is chosen)
        assert m[("nanoeuler_prompt_tokens_total", ())] == sum(r.usage.prompt_tokens for r in (r1, r2, r3))
        tokens = sum(r.usage.completion_tokens for r in (r1, r2, r3))
        assert tokens == 12 + 5 + 5 and m[("nanoeuler_generation_tokens_total", ())] >= tokens
        assert m[("nanoeuler_time_to_first_token_seconds_count", ())] == 4  # jobs: 2 choices, 2 chats
        assert m[("nanoeuler_time_per_output_token_seconds_count", ())] == tokens - 4
        assert m[("nanoeuler_time_to_first_token_seconds_bucket", (("le", "+Inf"),))] == 4
        assert m[("nanoeuler_rows_in_use", ())] == 0 and m[("nanoeuler_rows", ())] == 32
        assert m[("nanoeuler_kv_cache_positions", ())] == m[("nanoeuler_kv_cache_usage_ratio", ())] == 0
        health = http.get("/health").json()["prefix_cache"]
        assert m[("nanoeuler_prefix_cache_hits_total", ())] == health["hits"] == 1  # the second chat (12 tokens: no block)
        assert m[("nanoeuler_prefix_cache_reused_tokens_total", ())] == health["reused_tokens"] > 0
        assert m[("nanoeuler_prefix_cache_budget_bytes", ())] == 1024 << 20
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 10 ** 6, "stream": True, "ignore_eos": True}
        with hold_engine_steps(monkeypatch) as release, http.stream("POST", "/v1/completions", json=body) as stream:
            next(line for line in stream.iter_lines() if line.startswith("data: {"))   # a token made: in its row
            m = scrape(http)  # (the engine waits: the stream cannot reach the end of its window meanwhile)
            release.set()
            assert m[("nanoeuler_rows_in_use", ())] == 1 and m[("nanoeuler_jobs_waiting", ())] == 0
            assert 0 < m[("nanoeuler_kv_cache_positions", ())] <= CTX
            assert m[("nanoeuler_kv_cache_usage_ratio", ())] == m[("nanoeuler_kv_cache_positions", ())] / (32 * CTX)
