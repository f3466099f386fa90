"""SFT: the template and its mask (a template that does not write the reply once, in one piece, refused),
masked positions carry no gradient, packing/truncation, the Alpaca loader, the offline instruction set, the
batch source, `nanoeuler sft` end to end (with resume), and sft / dpo stopped by SIGTERM leave no lock."""
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from nanoeuler import Config, Model, UserError, ops
from nanoeuler.data.corpus import bundled_works
from nanoeuler.training.sft import (HEADER, SFTSource, load_examples, offline_instructions, pack_rows, prompt_text, render,
                           render_all, split_heldout)
from nanoeuler.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.train([bundled_works()["hamlet"][:60000]], 320, progress=False)


@pytest.mark.parametrize("with_input", [True, False])
def test_mask_covers_exactly_the_response_and_eos(tok, with_input):
    inp = "To be, or not to be" if with_input else ""
    ids, mask = render(tok, "What is the first word of this line?", inp, "To")
    ids, mask = np.array(ids), np.array(mask)
    assert len(ids) == len(mask)
    n_prompt = int(np.argmax(mask))
    assert not mask[:n_prompt].any() and mask[n_prompt:].all()  # one contiguous block at the end
    assert ids[-1] == tok.eos_id and mask[-1]
    assert tok.decode(ids[mask]) == "To</s>"
    prompt = tok.decode(ids[~mask])
    assert prompt == prompt_text("What is the first word of this line?", inp)
    assert prompt.startswith(HEADER + "### Instruction:\nWhat is the first word of this line?\n\n")
    assert prompt.endswith("### Response:\n")
    assert ("### Input:\nTo be, or not to be\n\n" in prompt) == with_input
    # output=None renders the prompt alone, identical to the prompt part above
    p_ids, p_mask = render(tok, "What is the first word of this line?", inp)
    assert p_ids == list(ids[:n_prompt]) and not any(p_mask)


def with_template(tok, template):
    return Tokenizer.from_dict(tok.to_dict() | {"chat_template": template})


def one_turn(assistant: str) -> str:
    """A template writing each user message and a newline, and each assistant message as `assistant` says."""
    return ("{% for m in messages %}{% if m['role'] == 'user' %}{{ m['content'] }}\n{% else %}" + assistant
            + "{% endif %}{% endfor %}")


@pytest.mark.parametrize("template", [
    one_turn("{{ m['content'] + eos_token }}{{ m['content'] + eos_token }}"),   # twice: 'Red.</s>Red.</s>'
    one_turn("{{ eos_token }}"),                                                 # never
    one_turn("{{ m['content'][:2] }}|{{ m['content'][2:] + eos_token }}"),       # in two pieces
    one_turn("{% if m['content'] == 'Red.' %}{{ eos_token }}{% else %}{{ m['content'] + eos_token }}{% endif %}"),
    "",                                                                          # nothing at all
], ids=["twice", "never", "apart", "not-this-one", "nothing"])
def test_a_template_that_does_not_write_the_reply_once_in_one_piece_is_refused(tok, template):
    with pytest.raises(UserError, match="chat template error: the template writes") as e:
        render(with_template(tok, template), "Name a colour.", "", "Red.")
    assert "\n" not in str(e.value)


def test_the_mask_ends_at_the_first_end_of_turn_after_the_reply(tok):
    t = with_template(tok, one_turn("{{ m['content'] + eos_token }}Bye{{ eos_token }}"))
    ids, mask = render(t, "Name a colour.", "", "Red.")
    first = mask.index(True)
    assert tok.decode(ids[:first]) == "Name a colour.\n"
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == "Red.</s>" and mask[-1] is False
    assert tok.decode(ids[first + sum(mask):]) == "Bye</s>"


def tiny_base(tok, path):
    cfg = Config(vocab_size=tok.vocab_size, dim=16, n_heads=2, n_kv_heads=1, n_layers=1, ctx_len=160,
                 ffn_hidden=32, n_mtp=1)
    Model.init(cfg, seed=0).save(path, tokenizer=tok)
    return path


def test_sft_refuses_a_template_it_cannot_mask_before_reading_anything(tmp_path, tok, capsys):
    """A template writing the reply twice would train past the end of turn; one that writes nothing hung sft
    (growing without bound, SIGTERM ignored, its lock left): both are one line, nothing created."""
    from nanoeuler.cli import main
    base = tiny_base(tok, tmp_path / "base")
    (tmp_path / "twice.jinja").write_text(one_turn("{{ m['content'] + eos_token }}{{ m['content'] + eos_token }}"))
    assert main(["sft", "--base", str(base), "--out", str(tmp_path / "a"), "--chat-template",
                 str(tmp_path / "twice.jinja")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: chat template error: the template writes an assistant reply 2 times")
    assert err.count("\n") == 1 and not (tmp_path / "a").exists()
    (tmp_path / "empty.jinja").write_text("")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    p = subprocess.run([sys.executable, "-m", "nanoeuler", "sft", "--base", str(base), "--out", str(tmp_path / "b"),
                        "--chat-template", str(tmp_path / "empty.jinja"), "--steps", "2", "--no-progress"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 2 and p.stderr.startswith("error: chat template error: the template writes an "
                                                     "assistant reply 0 times") and p.stderr.count("\n") == 1
    assert not (tmp_path / "b").exists()


SIGTERM_SCRIPT = """
import os, signal, sys
import nanoeuler.training.train as t
real = t.truncate_log
def terminated(*a):   # the run holds its lock and its loop has not begun: SIGTERM arrives now
    os.kill(os.getpid(), signal.SIGTERM)
    return real(*a)
t.truncate_log = terminated
from nanoeuler.cli import main
sys.exit(main({argv!r}))
"""


@pytest.mark.parametrize("command", ["sft", "dpo"])
def test_sigterm_outside_the_training_loop_ends_the_run_cleanly(tmp_path, tok, command):
    """SIGTERM while the run holds its lock but is not inside a step: it stops as Ctrl-C does (exit 130,
    "interrupted"), the lock released and nothing half-written (it killed the process, leaving the lock)."""
    base = tiny_base(tok, tmp_path / "base")
    if command == "sft":
        data = tmp_path / "d.json"
        data.write_text(json.dumps([{"instruction": f"Say {i}.", "input": "", "output": str(i)} for i in range(8)]))
        argv = ["sft", "--base", str(base), "--val", str(data)]
    else:
        data = tmp_path / "d.jsonl"
        data.write_text("".join(json.dumps({"prompt": f"q{i}=", "chosen": "yes", "rejected": "no"}) + "\n"
                                for i in range(8)))
        argv = ["dpo", "--sft", str(base), "--val", str(data)]
    out = tmp_path / "out"
    argv += ["--data", str(data), "--out", str(out), "--steps", "2", "--batch-size", "2", "--no-progress"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    p = subprocess.run([sys.executable, "-c", SIGTERM_SCRIPT.format(argv=argv)], capture_output=True, text=True,
                       env=env, timeout=300)
    assert p.returncode == 130 and p.stderr.strip().endswith("interrupted"), p.stderr
    assert sorted(f.name for f in out.iterdir()) == []   # no lock, no staging, no checkpoint begun


def test_exact_template_text():
    assert prompt_text("Say hi.", "") == ("Below is an instruction that describes a task. Write a response that "
                                          "appropriately completes the request.\n\n### Instruction:\nSay hi.\n\n"
                                          "### Response:\n")
    assert prompt_text("Add.", "2 3").endswith("### Instruction:\nAdd.\n\n### Input:\n2 3\n\n### Response:\n")


def test_masked_positions_get_zero_gradient():
    cfg = Config(vocab_size=30, dim=16, n_heads=2, n_kv_heads=1, n_layers=1, ctx_len=12, ffn_hidden=24, n_mtp=2)
    model = Model.init(cfg, seed=0).astype(np.float64)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 30, (2, 14))
    mask = np.zeros((2, 14), dtype=bool)
    mask[0, 5:9] = True   # a response + </s> inside row 0
    mask[1, 10:] = True
    T, K = 12, 2
    targets = ops.mtp_targets(tokens, T, K, mask)  # [K, B, T]
    from nanoeuler.model import forward
    out, _ = forward(cfg, model.params, tokens[:, :T])
    _, _, cache = ops.mtp_loss_forward(out, targets)
    dlogits = ops.mtp_loss_backward(1.0, cache)  # [K, B, T, V]
    for k in range(K):
        counted = mask[:, 1 + k:T + 1 + k]  # target of input t for head k is token t+1+k
        assert np.all(dlogits[k][~counted] == 0)
        assert np.all(np.abs(dlogits[k][counted]).sum(-1) > 0)
    # end to end: changing tokens that are neither inputs before a counted target nor counted targets
    # (here: a prompt-only extra row) leaves the gradient unchanged
    _, _, g1 = model.loss_and_grads(tokens, mask)
    extra = rng.integers(0, 30, (1, 14))
    _, _, g2 = model.loss_and_grads(np.concatenate([tokens, extra]), np.concatenate([mask, np.zeros((1, 14), bool)]))
    for name in g1:
        np.testing.assert_allclose(g1[name], g2[name], rtol=1e-10, atol=1e-14)
    # and the masked loss equals the mean cross-entropy over the counted head-0 targets only
    head0, _, _ = model.loss_and_grads(tokens, mask)
    z = out[0] - out[0].max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    counted = mask[:, 1:T + 1]
    picked = np.take_along_axis(logp, tokens[:, 1:T + 1, None], -1)[..., 0]
    assert head0 == pytest.approx(-picked[counted].mean(), rel=1e-10)


def test_batch_without_trainable_position_is_skipped_not_nan():
    from nanoeuler.training.train import LMObjective, TrainConfig, accumulate
    cfg = Config(vocab_size=30, dim=16, n_heads=2, n_kv_heads=1, n_layers=1, ctx_len=8, ffn_hidden=24, n_mtp=2)
    model = Model.init(cfg, seed=0)

    class Empty:
        def next_batch(self, rng):
            return np.ones((2, 10), dtype=np.int64), np.zeros((2, 10), dtype=bool)
    obj = LMObjective(model, Empty(), TrainConfig())
    metrics, grads, n_tokens, skipped = accumulate(obj, np.random.default_rng(0), 2)
    assert grads is None and skipped == 2 and n_tokens == 2 * 2 * 8
    assert np.isfinite(metrics["loss"]) and np.isfinite(metrics["objective"])


def test_pack_rows_and_truncation(tok):
    F, T_ = False, True
    tokens, mask = pack_rows([([1, 2], [F, T_]), ([3], [T_]), ([4, 5], [F, T_])], 4, pad_id=0)
    assert tokens.tolist() == [[1, 2, 3, 0], [4, 5, 0, 0]]
    assert mask.tolist() == [[F, T_, T_, F], [F, T_, F, F]]
    tokens, mask = pack_rows([([1, 2], [F, T_]), ([3], [T_])], 4, pad_id=9, pack=False)
    assert tokens.tolist() == [[1, 2, 9, 9], [3, 9, 9, 9]]
    recs = [{"instruction": "Say a word.", "input": "", "output": "word"},
            {"instruction": "Say many words.", "input": "", "output": " ".join(["word"] * 200)},
            {"instruction": "Long prompt " * 100, "input": "", "output": "x"}]
    n_prompt = len(render(tok, "Say many words.")[0])
    r = render_all(tok, recs, n_prompt + 10)
    assert (len(r.examples), r.truncated, r.dropped) == (2, 1, 1)
    ids, mask = r.examples[1]
    assert len(ids) == n_prompt + 10 and mask[n_prompt:].all() and not mask[:n_prompt].any()


def test_load_examples_validates(tmp_path):
    good = {"instruction": "Hi", "input": "", "output": "Hello"}
    p = tmp_path / "a.json"
    p.write_text(json.dumps([good, {"instruction": 3, "output": "x"}, {"instruction": "x"}, {"instruction": "A", "output": "B"}]))
    recs, bad = load_examples(p)
    assert len(recs) == 2 and len(bad) == 2 and recs[1]["input"] == ""
    (tmp_path / "b.jsonl").write_text(json.dumps(good) + "\n\n" + json.dumps(good) + "\n")
    assert len(load_examples(tmp_path / "b.jsonl")[0]) == 2
    (tmp_path / "c.json").write_text("[{")
    with pytest.raises(UserError, match="not valid JSON"):
        load_examples(tmp_path / "c.json")
    (tmp_path / "d.json").write_text(json.dumps([{"instruction": ""}]))
    with pytest.raises(UserError, match="no valid record"):
        load_examples(tmp_path / "d.json")
    with pytest.raises(UserError, match="not found"):
        load_examples(tmp_path / "missing.json")
    train, held = split_heldout([{"instruction": f"q{i}", "input": "", "output": "a"} for i in range(500)], every=10)
    assert 20 < len(held) < 90 and len(train) + len(held) == 500


def test_offline_instruction_set_has_a_clean_heldout_split():
    train, held = offline_instructions(n_train=600, n_heldout=100)
    assert (len(train), len(held)) == (600, 100)
    assert {r["task"] for r in held} == {"first_word", "last_word", "play", "speaker", "continue"}
    train_lines = {r["line"] for r in train} | {r["output"] for r in train if r["task"] == "continue"}
    assert not any(r["line"] in train_lines for r in held)
    assert offline_instructions(n_train=600, n_heldout=100) == (train, held)  # deterministic
    for r in train + held:  # the line is either the input or follows the question inline
        assert r["input"] == r["line"] or (r["input"] == "" and r["instruction"].endswith(" " + r["line"]))
    assert 0.3 < sum(r["input"] == "" for r in train) / len(train) < 0.7
    assert 0.3 < sum(r["input"] == "" for r in held) / len(held) < 0.7
    r = next(r for r in held if r["task"] == "first_word")
    assert r["line"].startswith(r["output"])
    r = next(r for r in held if r["task"] == "last_word")
    assert r["output"] in r["line"]


def test_sft_source_batches(tok):
    train, held = offline_instructions(n_train=200, n_heldout=20)
    src = SFTSource(tok, train, held, batch_size=4, ctx=400, n_mtp=2)
    t1, m1 = src.next_batch(np.random.default_rng(3))
    t2, m2 = src.next_batch(np.random.default_rng(3))
    assert t1.shape == (4, 402) and m1.dtype == bool and np.array_equal(t1, t2) and np.array_equal(m1, m2)
    assert m1[:, 1:].any(axis=1).all()  # every row has trainable targets
    assert np.all(t1[~m1 & (np.cumsum(m1[:, ::-1], 1)[:, ::-1] == 0)] == tok.eos_id)  # tail padding is </s>
    # packed rows hold several examples: more than one </s> counted per row on average
    assert (m1 & (t1 == tok.eos_id)).sum() > 4
    rows = sum(len(t) for t, _ in src.eval_batches())
    assert rows <= len(src.val.examples)
    d = src.describe()
    assert d["train_examples"] == 200 and d["length"] == 402


def test_sft_cli_trains_and_resumes(tmp_path, tok, capsys):
    from nanoeuler.cli import main
    cfg = Config(vocab_size=tok.vocab_size, dim=16, n_heads=2, n_kv_heads=1, n_layers=1, ctx_len=160,
                 ffn_hidden=32, n_mtp=2)
    Model.init(cfg, seed=0).save(tmp_path / "base", tokenizer=tok)
    train, held = offline_instructions(n_train=60, n_heldout=10)
    data = tmp_path / "sft.json"
    data.write_text(json.dumps(train))
    (tmp_path / "val.json").write_text(json.dumps(held))
    common = ["sft", "--base", str(tmp_path / "base"), "--data", str(data), "--val", str(tmp_path / "val.json"), "--steps", "4", "--batch-size", "2",
              "--eval-every", "2", "--no-progress", "--json"]
    assert main(common + ["--out", str(tmp_path / "a")]) == 0
    full = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert full["finished"] and np.isfinite(full["loss"]) and full["step"] == 4
    assert main(common + ["--out", str(tmp_path / "b"), "--stop-after", "2"]) == 0
    capsys.readouterr()
    assert main(common + ["--out", str(tmp_path / "b"), "--resume"]) == 0
    resumed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    a, b = Model.load(tmp_path / "a"), Model.load(tmp_path / "b")
    assert all(np.array_equal(a.params[n], b.params[n]) for n in a.params)  # bit-for-bit
    assert resumed["loss"] == full["loss"]
    # scoring answers (a random tiny model: nothing is in format, every rate is a valid fraction)
    assert main(["sft-eval", "--ckpt", str(tmp_path / "a"), "--data", str(tmp_path / "val.json"), "--limit", "3",
                 "--max-new-tokens", "4", "--no-progress", "--json"]) == 0
    scored = json.loads(capsys.readouterr().out)
    assert scored["n"] == 3 and 0 <= scored["in_format"] <= 1 and 0 <= scored["accuracy"] <= scored["lenient_accuracy"] <= 1
    assert main(["sft-data", "--out", str(tmp_path / "offline"), "--n-train", "20", "--n-heldout", "5"]) == 0
    assert len(load_examples(tmp_path / "offline" / "offline_heldout.json")[0]) == 5
    capsys.readouterr()
    assert main(["sft", "--base", str(tmp_path / "missing"), "--data", str(data), "--out", str(tmp_path / "c")]) == 2
    assert "error:" in capsys.readouterr().err


def test_sft_seq_len_sets_the_rows_and_a_resume_keeps_it(tmp_path, tok, capsys):
    """--seq-len T: rows of T + K tokens (a model's whole context is too long a row for a CPU step: the
    default is at most 1024); a resumed run keeps the run's T without being told, bit for bit; a T longer than
    the context is one line."""
    from nanoeuler.cli import main
    cfg = Config(vocab_size=tok.vocab_size, dim=16, n_heads=2, n_kv_heads=1, n_layers=1, ctx_len=160,
                 ffn_hidden=32, n_mtp=2)
    Model.init(cfg, seed=0).save(tmp_path / "base", tokenizer=tok)
    train, held = offline_instructions(n_train=40, n_heldout=10)
    (tmp_path / "sft.json").write_text(json.dumps(train))
    (tmp_path / "val.json").write_text(json.dumps(held))
    common = ["sft", "--base", str(tmp_path / "base"), "--data", str(tmp_path / "sft.json"), "--val",
              str(tmp_path / "val.json"), "--steps", "3", "--batch-size", "2", "--no-progress", "--json"]
    assert main(common + ["--seq-len", "140", "--out", str(tmp_path / "a")]) == 0
    assert main(common + ["--seq-len", "140", "--out", str(tmp_path / "b"), "--stop-after", "1"]) == 0
    assert main(common + ["--out", str(tmp_path / "b"), "--resume"]) == 0
    capsys.readouterr()
    for run in ("a", "b"):
        assert json.loads((tmp_path / run / "trainer.json").read_text())["data"]["length"] == 140 + 2
    a, b = Model.load(tmp_path / "a"), Model.load(tmp_path / "b")
    assert all(np.array_equal(a.params[n], b.params[n]) for n in a.params)
    assert main(common + ["--seq-len", "161", "--out", str(tmp_path / "c")]) == 2
    assert "--seq-len 161 is longer than the model's context (160)" in capsys.readouterr().err
    # a LoRA run's printout sizes the step it runs: rows of T tokens, not of the whole context
    assert main(common[:-1] + ["--seq-len", "140", "--lora", "2", "--stop-after", "1", "--out", str(tmp_path / "d")]) == 0
    assert "a step of 2 x 140 tokens" in capsys.readouterr().out


def test_offline_data_validates_on_a_val_file_when_given(tmp_path, tok):
    """`sft --data offline --val FILE` validated on the offline held-out split and ignored the file."""
    from nanoeuler.cli.sft import sft_records
    val = tmp_path / "val.json"
    val.write_text(json.dumps(offline_instructions(n_train=1, n_heldout=3)[1]))
    train, held, data_id, _ = sft_records("offline", str(val), tok, 160)
    own_train, own_held, own_id, _ = sft_records("offline", None, tok, 160)
    assert held == load_examples(val)[0] and len(held) == 3 and len(own_held) > 3
    assert train == own_train and data_id != own_id      # a resume with another --val is another data set


@pytest.mark.parametrize("command", [["sft", "--base"], ["dpo", "--sft"]])
def test_a_context_no_offline_example_fits_is_one_line_not_a_hang(tmp_path, tok, command):
    """`sft --base` a 48-wide model with a 64-token context sat at step 0 forever: the offline set drew
    examples until 6000 fitted, and none does. A subprocess, so that the hang it was fails instead of hanging."""
    import os
    import subprocess
    import sys
    cfg = Config(vocab_size=tok.vocab_size, dim=48, n_heads=4, n_kv_heads=2, n_layers=1, ctx_len=64, ffn_hidden=96,
                 n_mtp=1)
    Model.init(cfg, seed=0).save(tmp_path / "base", tokenizer=tok)
    argv = [*command, str(tmp_path / "base"), "--out", str(tmp_path / "out"), "--steps", "1", "--no-progress"]
    r = subprocess.run([sys.executable, "-m", "nanoeuler", *argv], capture_output=True, text=True, timeout=300,
                       env=os.environ | {"PYTHONPATH": os.pathsep.join(sys.path)})
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert re.search(r"longer than the model's context( \(64\))?, with 0 of 6000 found", r.stderr)
    assert not (tmp_path / "out" / "trainer.json").exists()


def test_a_seq_len_no_offline_example_fits_is_named(tmp_path, tok, capsys):
    """`sft --seq-len 32` on SmolLM2 blamed "the model's context" (8192): the rows' length is what is short."""
    from nanoeuler.cli import main
    cfg = Config(vocab_size=tok.vocab_size, dim=48, n_heads=4, n_kv_heads=2, n_layers=1, ctx_len=512, ffn_hidden=96,
                 n_mtp=1)
    Model.init(cfg, seed=0).save(tmp_path / "base", tokenizer=tok)
    argv = ["sft", "--base", str(tmp_path / "base"), "--out", str(tmp_path / "out"), "--steps", "1", "--no-progress"]
    assert main([*argv, "--seq-len", "32"]) == 2
    err = capsys.readouterr().err
    assert "longer than --seq-len 32, with 0 of 6000 found" in err and "model's context" not in err


def test_offline_set_keeps_a_filter_that_passes_rarely():
    """The bound on misses refuses only a context next to nothing fits: one in MAX_MISSES / 2 is enough."""
    from nanoeuler.training.sft import MAX_MISSES
    seen = []
    rare = lambda r: seen.append(r) or len(seen) % (MAX_MISSES // 2) == 0     # noqa: E731
    assert len(offline_instructions(n_train=3, n_heldout=1, fits=rare)[0]) == 3


def test_score_answers_counts_format_accuracy_and_lenient_accuracy(tok, monkeypatch):
    """Canned greedy answers with known verdicts: correct (in format and equal), right but never stopped (lenient
    only), right first line then more (lenient only), wrong, a new ### section, and an unscored task."""
    from types import SimpleNamespace

    from nanoeuler.infer import session, step
    from nanoeuler.training.sft import score_answers
    answers = iter([(" Hamlet.", True), ("Hamlet", False), ("hamlet\nand more", False), ("Macbeth", True),
                    ("Hamlet\n### Instruction:", True), ("Hamlet", True)])

    def canned(model, ids, **kw):
        text, stopped = next(answers)
        return SimpleNamespace(ids=tok.encode(text), stopped=stopped, drafted=4, accepted=1)

    monkeypatch.setattr(session, "generate", canned)
    monkeypatch.setattr(step, "fuse_weights", lambda cfg, params: None)
    records = [{"instruction": "Which play?", "input": "", "output": "Hamlet", "task": "play"}] * 5 + \
              [{"instruction": "Go on.", "input": "", "output": "Hamlet", "task": "continue"}]
    model = Model.init(Config(vocab_size=tok.vocab_size, dim=16, n_heads=2, n_kv_heads=1, n_layers=1, ctx_len=160,
                              ffn_hidden=32, n_mtp=1), seed=0)
    got = score_answers(model, tok, records, progress=False)
    assert [(x["in_format"], x["correct"], x["lenient"]) for x in got["examples"]] == [
        (True, True, True), (False, False, True), (False, False, True), (True, False, False),
        (False, False, True), (True, True, True)]
    assert got["n"] == 6 and got["in_format"] == pytest.approx(3 / 6)
    assert got["accuracy"] == pytest.approx(1 / 5) and got["lenient_accuracy"] == pytest.approx(4 / 5)  # "continue" unscored
    assert got["per_task"]["continue"]["accuracy"] == 1.0 and got["draft_acceptance"] == pytest.approx(0.25)


def test_normalize_answers():
    from nanoeuler.training.sft import normalize
    assert normalize("  Hamlet. ") == normalize("hamlet") == "hamlet"
    assert normalize("King Lear") != normalize("Lear")
