"""The front ends: `sample` (streaming, --json, prompt truncation) and the chat REPL: commands, a piped session end to end, context keeping and dropping of earlier turns,
replies equal to plain generation on the rendered conversation."""
import io
import sys

import pytest

from nanoeuler import Config, Model
from nanoeuler.chat_template import prompt_ids
from nanoeuler.cli.chat import Repl
from nanoeuler.infer.chat import Chat
from nanoeuler.data.corpus import bundled_works
from nanoeuler.infer.session import generate
from nanoeuler.training.sft import render
from nanoeuler.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    tok = Tokenizer.train([bundled_works()["hamlet"][:60000]], 320, progress=False)
    cfg = Config(vocab_size=tok.vocab_size, dim=32, n_heads=4, n_kv_heads=2, n_layers=2, ctx_len=256,
                 ffn_hidden=48, n_mtp=2)
    d = tmp_path_factory.mktemp("chat") / "run"
    Model.init(cfg, seed=0).save(d, tokenizer=tok)
    return d


def session(run_dir, monkeypatch, capsys, text, *flags):
    from nanoeuler.cli import main
    monkeypatch.setattr(sys, "stdin", io.StringIO(text))
    code = main(["chat", "--ckpt", str(run_dir), "--max-new-tokens", "6", "--seed", "0", *flags])
    return code, capsys.readouterr()


def test_piped_session_with_every_command(run_dir, monkeypatch, capsys):
    code, out = session(run_dir, monkeypatch, capsys,
                        "/help\n/tokens\nWho speaks this line?\n/tokens\n/temp 0\n/topk 5\n\nAnd this one?\n"
                        "/temp -1\n/topk x\n/reset\n/bogus\n")
    assert code == 0 and out.err == ""
    o = out.out
    assert o.startswith("nanoeuler chat:") and "/help for commands" in o
    for expected in ("commands:", "/reset", "/temp X", "/topk N", "/tokens", "Ctrl-D", "(no reply yet)",
                     "6 tokens:", "[stopped at 6 tokens]", "(temperature 0, greedy)", "(top-k 5)",
                     "usage: /temp", "usage: /topk", "(conversation cleared)", "unknown command /bogus"):
        assert expected in o, expected
    assert "> Who speaks this line?\n" in o  # piped lines are echoed like a terminal transcript


def test_ctrl_d_at_once_exits_cleanly(run_dir, monkeypatch, capsys):
    code, out = session(run_dir, monkeypatch, capsys, "")
    assert code == 0 and out.out.endswith("\n")


def test_bad_sampling_flags(run_dir, monkeypatch, capsys):
    code, out = session(run_dir, monkeypatch, capsys, "", "--temperature", "-1")
    assert code == 2 and "error: --temperature" in out.err


def test_replies_continue_the_rendered_conversation(run_dir, monkeypatch):
    """... and the session fuses the model's weights once, not at every reply."""
    from nanoeuler.infer import step
    model = Model.load(run_dir)
    from nanoeuler.checkpoint import load_tokenizer
    tok = load_tokenizer(run_dir)
    chat = Chat(model, tok, temperature=0, max_new_tokens=5)
    written, fused = [], []
    real = step.fuse_weights
    monkeypatch.setattr(step, "fuse_weights", lambda *a, **k: fused.append(1) or real(*a, **k))
    Repl(chat).handle("First question?", written.append)
    Repl(chat).handle("Second question?", written.append)
    assert len(fused) == 1
    p1 = render(tok, "First question?")[0]
    r1 = generate(model, p1, 5, temperature=0).ids
    assert chat.messages[:2] == [{"role": "user", "content": "First question?"},
                                 {"role": "assistant", "content": tok.decode(r1)}]
    p2 = prompt_ids(tok, chat.messages[:3])
    # ours (Alpaca) renders a conversation as its turns back to back: prompt + reply + </s> + next prompt
    assert p2 == p1 + tok.encode(tok.decode(r1)) + [tok.eos_id] + render(tok, "Second question?")[0]
    r2 = generate(model, p2, 5, temperature=0).ids
    assert chat.last_reply == r2
    assert "".join(written).startswith(tok.decode(r1))


def test_context_keeps_recent_turns_and_drops_the_oldest(run_dir):
    model = Model.load(run_dir)
    from nanoeuler.checkpoint import load_tokenizer
    tok = load_tokenizer(run_dir)
    chat = Chat(model, tok, max_new_tokens=16)  # ctx 256, reply room 16: budget 240
    words = bundled_works()["hamlet"].split()
    text = [" ".join(words[i * 30:(i + 1) * 30]) for i in range(6)]  # ~40 tokens each
    system = {"role": "system", "content": "Be brief."}
    conv = [system] + [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(text[:5])]
    messages = list(conv)
    ids = chat.context(messages)
    full = len(prompt_ids(tok, conv))
    assert full > 240  # the whole conversation does not fit ...
    assert messages[0] == system and messages[-1] == conv[-1] and len(messages) < len(conv)  # ... the oldest go
    assert messages == [system] + conv[len(conv) - len(messages) + 1:]
    assert messages[1]["role"] == "user" and ids == prompt_ids(tok, messages) and len(ids) <= 240
    assert len(prompt_ids(tok, [system] + conv[len(conv) - len(messages) - 1:])) > 240  # one more would not fit
    long = [{"role": "user", "content": " ".join(words[:400])}]
    assert chat.context(long) == prompt_ids(tok, long)[-248:] and chat.cut > 0  # too long a prompt keeps its end


def test_a_window_of_a_few_positions_keeps_the_prompts_end(run_dir):
    """A prompt keeps ctx - min(max_new_tokens, 8) tokens when it does not fit: for a context of 8 positions or
    fewer that was none (`generate` then refused the empty prompt of a chat with a 1-position model). However
    small the context, the prompt keeps its end, its last token at least."""
    from nanoeuler.checkpoint import load_tokenizer
    model, tok = Model.load(run_dir), load_tokenizer(run_dir)
    messages = [{"role": "user", "content": "Who is there?"}]
    full = prompt_ids(tok, messages)
    for ctx in (1, 2, 8, 9, 12):
        chat = Chat(Model(model.config.replace(ctx_len=ctx), model.params), tok, max_new_tokens=16)
        ids = chat.context(list(messages))
        assert ids == full[-max(1, ctx - 8):] and chat.cut == len(full) - len(ids), ctx


def test_a_prompt_is_cut_only_when_no_earlier_exchange_is_left(run_dir):
    """With a context under 32 and a long reply asked (ctx 16, max_tokens 100) the turns were kept whole up to
    ctx - ctx // 4 positions, then cut to ctx - 8: a conversation that dropping one exchange would have fitted
    was cut instead, and serve answered 400 'the last message is ... tokens'."""
    from nanoeuler.checkpoint import load_tokenizer
    model = Model.load(run_dir)
    tok = load_tokenizer(run_dir).replace(chat_template="{% for m in messages %}{{ m.content }}\n{% endfor %}")
    conv = [{"role": r, "content": c} for r, c in (("user", "to be"), ("assistant", "or not"),
                                                   ("user", "that"))]
    assert len(prompt_ids(tok, conv)) < 24 and len(prompt_ids(tok, conv[-1:])) < 8   # (what a context < 32 holds)
    for ctx in range(9, 64):
        for max_new in (1, 8, 100):
            chat = Chat(Model(model.config.replace(ctx_len=ctx), model.params), tok, max_new_tokens=max_new)
            kept = list(conv)
            chat.context(kept)
            assert chat.cut == 0 or kept == conv[-1:], (ctx, max_new)


def _context_one_exchange_at_a_time(chat, messages):
    """The rule Chat.context follows, applied literally (one exchange dropped per render): the test's oracle."""
    ctx = chat.ctx_len
    limit = max(1, ctx - min(chat.max_new, 8))
    budget = min(limit, ctx - min(chat.max_new, ctx // 4))
    dropped = 0
    while True:
        ids = prompt_ids(chat.tok, messages)
        turns = [i for i, m in enumerate(messages[:-1]) if m["role"] != "system"]
        if len(ids) <= budget or not turns:
            break
        later = [i for i in turns[1:] if messages[i]["role"] == "user"]
        gone = set(range(turns[0], later[0] if later else len(messages) - 1)) - \
            {i for i, m in enumerate(messages) if m["role"] == "system"}
        messages[:] = [m for i, m in enumerate(messages) if i not in gone]
        dropped += 1
    cut = max(0, len(ids) - limit)
    return ids[cut:], dropped, cut


def test_context_drops_what_one_exchange_at_a_time_would_in_a_few_renders(run_dir, monkeypatch):
    """Conversations of every shape (system messages anywhere, runs of user or assistant messages, long and
    short turns): the same ids, messages kept, dropped turns and cut as dropping one exchange per render. A
    conversation of 3000 messages takes a handful of renders (one render per exchange took minutes: a
    request to /v1/chat/completions could hold the server for as long)."""
    import random

    import nanoeuler.chat_template as ct
    model = Model.load(run_dir)
    from nanoeuler.checkpoint import load_tokenizer
    tok = load_tokenizer(run_dir)
    words = bundled_works()["hamlet"].split()
    rng = random.Random(0)
    for case in range(40):
        conv = []
        for _ in range(rng.randint(1, 30)):
            role = rng.choice(["user", "user", "assistant", "assistant", "system"])
            start = rng.randrange(len(words) - 100)
            conv.append({"role": role, "content": " ".join(words[start:start + rng.choice([1, 5, 20, 60])])})
        conv.append({"role": "user", "content": "and now?"})
        chat = Chat(model, tok, max_new_tokens=rng.choice([4, 16, 200]))
        kept, want_kept = list(conv), list(conv)
        want = _context_one_exchange_at_a_time(chat, want_kept)
        assert (chat.context(kept), chat.dropped_turns, chat.cut) == want and kept == want_kept, case
    renders = []
    real = ct.prompt_ids
    monkeypatch.setattr(ct, "prompt_ids", lambda *a: renders.append(1) or real(*a))
    chat = Chat(model, tok, max_new_tokens=16)
    many = [{"role": "user" if i % 2 == 0 else "assistant", "content": "a"} for i in range(3000)] + [conv[-1]]
    ids = chat.context(many)
    assert len(renders) <= 12 and chat.dropped_turns > 1000 and len(ids) <= 240


def test_sample_streams_and_truncates_long_prompts(run_dir, capsys):
    from nanoeuler.cli import main
    assert main(["sample", "--ckpt", str(run_dir), "--prompt", "To be", "--max-new-tokens", "5", "--seed", "1"]) == 0
    out = capsys.readouterr()
    assert out.out.startswith("To be") and out.err == ""
    args = ["sample", "--ckpt", str(run_dir), "--prompt", "To be", "--max-new-tokens", "5", "--seed", "1", "--json"]
    assert main(args) == 0
    import json
    a = json.loads(capsys.readouterr().out)
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["ids"] == a["ids"] and len(a["ids"]) <= 5  # same seed, same text
    assert out.out == "To be" + a["text"] + "\n"
    assert main(["sample", "--ckpt", str(run_dir), "--prompt", "word " * 400, "--max-new-tokens", "3",
                 "--temperature", "0"]) == 0
    assert "kept the last 256" in capsys.readouterr().err
    assert main(["sample", "--ckpt", str(run_dir), "--prompt", "x", "--top-p", "2"]) == 2
    assert "error: --top-p" in capsys.readouterr().err


def test_greedy_sampling_speculates_and_sampling_is_plain(run_dir, capsys):
    """`sample` speculates at temperature 0 unless --no-speculative; at temperature > 0 it samples a token
    per forward, and a seeded sample replays exactly."""
    import json
    from nanoeuler.cli import main

    def run(*flags):
        assert main(["sample", "--ckpt", str(run_dir), "--prompt", "Who", "--max-new-tokens", "8",
                     "--json", *flags]) == 0
        return json.loads(capsys.readouterr().out)
    assert run("--temperature", "0.8")["mode"] == "cache"
    assert run("--temperature", "0")["mode"] == "speculative"
    assert run("--temperature", "0", "--no-speculative")["mode"] == "cache"
    seeded = [run("--temperature", "0.8", "--seed", "3") for _ in range(2)]
    assert seeded[0]["mode"] == "cache" and seeded[0]["text"] == seeded[1]["text"]


def test_chat_speculates_when_greedy(run_dir, monkeypatch):
    calls = []

    def fake_generate(model, ids, *a, mode="cache", **kw):
        calls.append(mode)
        return generate(model, ids, *a, mode=mode, **kw)
    monkeypatch.setattr("nanoeuler.infer.session.generate", fake_generate)
    model, tok = Model.load(run_dir, read_only=True), Tokenizer.load(run_dir / "tokenizer.json")
    for temperature, speculative, expect in ((0, True, "speculative"), (0.8, True, "cache"), (0, False, "cache")):
        Repl(Chat(model, tok, temperature=temperature, max_new_tokens=4, speculative=speculative)).handle(
            "Who speaks?", lambda s: None)
        assert calls[-1] == expect


@pytest.mark.parametrize("extra", [40, -10])
@pytest.mark.parametrize("command", ["sample", "chat", "serve"])
def test_a_tokenizer_that_does_not_match_the_model_is_one_line_at_load(tmp_path, monkeypatch, capsys, command, extra):
    """A model with 40 embeddings more than its tokenizer has tokens used to print part of a reply, then fail
    on the first id the tokenizer lacks (10 fewer: on the prompt). Every command refuses it at load, with
    the check `serve` has always made (checkpoint.check_vocab), before printing anything."""
    from nanoeuler.cli import main
    tok = Tokenizer.train([bundled_works()["hamlet"][:20000]], 270, progress=False)
    cfg = Config(vocab_size=tok.vocab_size + extra, dim=32, n_heads=4, n_kv_heads=2, n_layers=2, ctx_len=64,
                 ffn_hidden=48, n_mtp=1)
    d = tmp_path / "mismatch"
    Model.init(cfg, seed=0).save(d, tokenizer=tok)
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\n"))
    flags = {"sample": ["--prompt", "hello there", "--max-new-tokens", "60", "--temperature", "1", "--seed", "1"],
             "chat": ["--max-new-tokens", "60", "--temperature", "1", "--seed", "1"], "serve": ["--port", "0"]}
    code = main([command, "--ckpt", str(d), *flags[command]])
    out = capsys.readouterr()
    assert code == 2 and out.out == "" and out.err == (
        f"error: the tokenizer has 270 tokens but the model {270 + extra}: they do not belong together\n")


@pytest.mark.parametrize("command", ["sample", "chat", "serve"])
def test_a_dtype_the_model_cannot_take_is_one_line_before_anything_is_printed(tmp_path, monkeypatch, capsys, command):
    """q8_0 needs widths that are multiples of 32 (and a CPU with AVX2 or AVX512-VNNI): a 48-wide model is refused in
    one line, and nothing is printed before it (`sample` used to echo the prompt first)."""
    from nanoeuler.cli import main
    tok = Tokenizer.train([bundled_works()["hamlet"][:20000]], 270, progress=False)
    cfg = Config(vocab_size=tok.vocab_size, dim=48, n_heads=4, n_kv_heads=2, n_layers=2, ctx_len=64,
                 ffn_hidden=96, n_mtp=1)
    d = tmp_path / "narrow"
    Model.init(cfg, seed=0).save(d, tokenizer=tok)
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\n"))
    flags = {"sample": ["--prompt", "hello there"], "chat": [], "serve": ["--port", "0"]}
    code = main([command, "--ckpt", str(d), "--dtype", "q8_0", *flags[command]])
    out = capsys.readouterr()
    assert code == 2 and out.out == "" and out.err.startswith("error: ") and out.err.count("\n") == 1, out
    assert "q8_0" in out.err
