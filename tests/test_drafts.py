"""Draft-head distillation (nanoeuler/drafts.py, `nanoeuler drafts`, the end of `nanoeuler train`).

The test model is trained on a Markov chain over 16 letters where its greedy path and the corpus disagree
two steps ahead: from letter a the next is a+1 (p .6) or a+3 (p .4), so greedy decoding walks a, a+1, a+2,
a+3, .. while the corpus's most likely letter two steps ahead is a+4 (p .48 against .36 for a+2), and three
ahead a+5 (.43 against .22 for a+3). Pretrained draft heads learn the corpus and so guess wrong for
speculative greedy decoding; distilled ones learn the model. The acceptance is measured both ways by
generate(mode="speculative") itself, and the test asserts it rose."""
import errno
import json

import numpy as np
import pytest

from nanoeuler import Model, UserError
from nanoeuler import drafts
from nanoeuler.cli import main
from nanoeuler.infer.session import generate
from nanoeuler.optim import AdamW
from conftest import snapshot, tiny_config

FIRST, N_LETTERS = ord("a"), 16  # the chain's tokens are the byte tokens of the letters a..p
CFG = tiny_config(vocab_size=257, dim=32, n_heads=4, n_kv_heads=2, n_layers=1, ctx_len=32, ffn_hidden=48, n_mtp=3)


def chain(rng: np.random.Generator, n: int) -> np.ndarray:
    """n letters of the chain as token ids: each step +1 (p .6) or +3 (p .4), modulo 16."""
    steps = np.where(rng.random(n) < 0.6, 1, 3)
    return FIRST + (rng.integers(N_LETTERS) + np.cumsum(steps)) % N_LETTERS


@pytest.fixture(scope="module")
def chain_model():
    """A tiny model pretrained on the chain, and a byte-level tokenizer (257 tokens: bytes + </s>)."""
    from nanoeuler.tokenizer import Tokenizer
    model = Model.init(CFG, seed=0)
    opt = AdamW(model.params, lr=1e-2, weight_decay=0.0)
    rng = np.random.default_rng(0)
    for _ in range(150):
        tokens = np.stack([chain(rng, 16 + CFG.n_mtp) for _ in range(16)])
        _, _, grads = model.loss_and_grads(tokens)
        opt.step(model.params, grads)
    tok = Tokenizer.train(["abcdefghijklmnop"], 257, progress=False)
    return model, tok


def speculative_acceptance(model, seed: int = 1) -> float:
    """Accepted / verified drafts of greedy speculative decoding at full depth from chain prompts."""
    rng = np.random.default_rng(seed)
    accepted = drafted = 0
    for _ in range(6):
        g = generate(model, list(chain(rng, 6)), 40, temperature=0, mode="speculative", spec_depth=CFG.n_mtp - 1)
        accepted, drafted = accepted + g.accepted, drafted + g.drafted
    return accepted / drafted


def text_prompts(rng) -> drafts.TextPrompts:
    return drafts.TextPrompts(chain(rng, 5000))


def test_distillation_raises_speculative_acceptance_and_touches_only_the_draft_heads(chain_model):
    model, _ = chain_model
    before = {n: p.copy() for n, p in model.params.items()}
    rng = np.random.default_rng(0)
    result = drafts.distill(model, text_prompts(rng), text_prompts(rng), n_rollouts=64, progress=False)
    assert all(np.array_equal(model.params[n], before[n]) for n in before)  # `distill` returns, never modifies
    assert result.kept and sorted(result.heads) == ["heads.1.weight", "heads.2.weight"]
    distilled = Model(model.config, model.params | result.heads)
    acc_before, acc_after = speculative_acceptance(model), speculative_acceptance(distilled)
    assert acc_after > acc_before + 0.1, (acc_before, acc_after)  # measured by speculative decoding itself
    assert result.greedy_after[0] > result.greedy_before[0]       # and by distill's own held-out rollouts
    # greedy speculative output is still plain greedy output, token for token
    prompt = list(chain(np.random.default_rng(5), 6))
    plain = generate(distilled, prompt, 40, temperature=0, mode="cache").ids
    assert generate(distilled, prompt, 40, temperature=0, mode="speculative", spec_depth=2).ids == plain


def test_fit_head_solves_the_softmax_regression():
    """On separable data the fitted head reproduces the target head's argmax (the convex fit converges)."""
    rng = np.random.default_rng(0)
    X = rng.normal(size=(2000, 8)).astype(np.float32)
    W_target = rng.normal(size=(5, 8)).astype(np.float32)
    tau = np.full((len(X), 1), 0.1, np.float32)
    start = rng.normal(size=(5, 8)).astype(np.float32)
    W = drafts.fit_head(start, X, X, W_target, tau, rng, steps=400, batch=256, lr=2e-2)

    def agree(W):
        return ((X @ W.T).argmax(-1) == (X @ W_target.T).argmax(-1)).mean()
    assert agree(start) < 0.5 and agree(W) > 0.95


def test_greedy_acceptance_counts_chains_of_right_drafts():
    """Draft 2 counts only where draft 1 was right: hidden = one-hot positions, heads read them off."""
    tokens = np.array([[0, 1, 2, 3, 4, 5]])
    hidden = np.eye(6, dtype=np.float32)[None]          # h_t = e_t
    right1 = np.eye(6)[[2, 3, 4, 5, 0, 0]].T * 1.0     # head 1 at t says token t+2 ...
    right1[:, 1] = np.eye(6)[0]                         # ... except at t = 1 (wrong)
    right2 = np.eye(6)[[3, 4, 5, 0, 0, 0]].T * 1.0     # head 2 always right
    heads = [np.eye(6), right1, right2]
    # positions t = 0, 1, 2 (start 1, L 6, K 3): draft 1 right at t = 0, 2; draft 2 right at all of them
    assert drafts.greedy_acceptance(heads, tokens, hidden, start=1) == [2 / 3, 1.0]


@pytest.fixture
def ckpt(chain_model, tmp_path):
    model, tok = chain_model
    model.save(tmp_path / "run", tok)
    text = tmp_path / "chain.txt"
    text.write_text("".join(map(chr, chain(np.random.default_rng(3), 20000))))
    return tmp_path / "run", text


def test_drafts_command_rewrites_only_the_draft_heads(ckpt, capsys):
    run, text = ckpt
    before = Model.load(run)
    files = {p.name: p.read_bytes() for p in run.iterdir()}
    assert main(["drafts", "--ckpt", str(run), "--text", str(text), "--rollouts", "64", "--no-progress", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["kept"] and out["written"]
    assert out["greedy_acceptance_after"][0] > out["greedy_acceptance_before"][0]
    after = Model.load(run)
    for name, p in before.params.items():
        same = np.array_equal(p, after.params[name])
        assert same == (name not in ("heads.1.weight", "heads.2.weight")), name  # trunk + head 0 bit-identical
    assert sorted(p.name for p in run.iterdir()) == sorted(files)            # no staging, lock or journal left
    assert all((run / n).read_bytes() == b for n, b in files.items() if n != "model.safetensors")
    tokens = np.stack([chain(np.random.default_rng(s), 16 + CFG.n_mtp) for s in range(4)])
    assert after.loss(tokens)[0] == before.loss(tokens)[0]                  # the reported (head-0) loss
    assert speculative_acceptance(after) > speculative_acceptance(before)


def test_drafts_dry_run_changes_nothing(ckpt, capsys):
    run, text = ckpt
    snap = snapshot(run)
    assert main(["drafts", "--ckpt", str(run), "--text", str(text), "--rollouts", "16", "--no-progress",
                 "--dry-run"]) == 0
    assert "nothing written" in capsys.readouterr().out
    assert snapshot(run) == snap


def test_a_failed_save_leaves_the_checkpoint_intact(ckpt, monkeypatch, capsys):
    """A full disk while writing the new weights: one-line error, the old checkpoint byte for byte."""
    from nanoeuler import checkpoint
    run, text = ckpt
    snap = snapshot(run)
    real = checkpoint.tensors_writer

    def full_disk(*a, **kw):
        write = real(*a, **kw)

        def half(path):
            write(path)
            raise OSError(errno.ENOSPC, "No space left on device")
        return half
    monkeypatch.setattr(checkpoint, "tensors_writer", full_disk)
    assert main(["drafts", "--ckpt", str(run), "--text", str(text), "--rollouts", "16", "--no-progress"]) != 0
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "disk is full" in err and len(err.splitlines()) == 1
    assert snapshot(run) == snap


def test_bad_inputs_are_one_line_errors(chain_model, ckpt, tmp_path, capsys):
    run, text = ckpt
    one_head = tmp_path / "k1"
    Model.init(tiny_config(vocab_size=257, n_mtp=1), seed=0).save(one_head, chain_model[1])
    short = tmp_path / "short.txt"
    short.write_text("abc")
    cases = [
        (["--ckpt", str(tmp_path / "missing")], "not found"),
        (["--ckpt", str(text)], "not found"),                                   # a file, not a directory
        (["--ckpt", str(one_head)], "single output head"),
        (["--ckpt", str(run), "--text", str(short)], "too short"),
        (["--ckpt", str(run), "--text", str(tmp_path / "nope.txt")], "not found"),
        (["--ckpt", str(run), "--rollouts", "0"], "--rollouts"),
        (["--ckpt", str(run), "--data", str(tmp_path)], "manifest"),
        (["--ckpt", str(run), "--data", str(tmp_path), "--text", str(text)], "not allowed"),
    ]
    for args, message in cases:
        code = main(["drafts", *args, "--no-progress"])
        err = capsys.readouterr().err.strip()
        assert code != 0 and err.startswith("error:") and len(err.splitlines()) == 1, (args, err)
        assert message in err, (args, err)
    with pytest.raises(UserError, match="at least 8"):
        drafts.distill(Model.load(run), text_prompts(np.random.default_rng(0)), text_prompts(np.random.default_rng(1)),
                       n_rollouts=2, progress=False)


def test_pretraining_ends_with_the_distillation_unless_skipped(chain_model, tmp_path, capsys):
    """`nanoeuler train` (K > 1) distills the draft heads after its last step; --no-drafts leaves them as trained."""
    _, tok = chain_model
    tok.save(tmp_path / "tok.json")
    (tmp_path / "chain.txt").write_text("".join(map(chr, chain(np.random.default_rng(4), 30000))))
    (tmp_path / "config.json").write_text(json.dumps(CFG.to_dict()))
    assert main(["prepare", str(tmp_path / "chain.txt"), "--tokenizer", str(tmp_path / "tok.json"),
                 "--out", str(tmp_path / "data"), "--no-progress"]) == 0
    runs = {}
    for name, extra in (("with", []), ("without", ["--no-drafts"])):
        capsys.readouterr()
        assert main(["train", str(tmp_path / "config.json"), "--data", str(tmp_path / "data"), "--out",
                     str(tmp_path / name), "--steps", "40", "--batch-size", "8", "--lr", "1e-2", "--no-progress",
                     "--json", *extra]) == 0
        summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        runs[name] = Model.load(tmp_path / name), summary
    (with_, s_with), (without, s_without) = runs["with"], runs["without"]
    assert "drafts" not in s_without and s_with["drafts"]["kept"]
    assert s_with["val_loss"] == s_without["val_loss"]           # the same training; the reported loss is head 0's
    for name, p in without.params.items():
        assert np.array_equal(p, with_.params[name]) == (name not in ("heads.1.weight", "heads.2.weight")), name
    assert speculative_acceptance(with_) > speculative_acceptance(without)


@pytest.fixture
def chain_data(chain_model, tmp_path_factory):
    """A token shard directory of chain text and a config.json for `nanoeuler train`."""
    _, tok = chain_model
    root = tmp_path_factory.mktemp("chain_data")
    tok.save(root / "tok.json")
    (root / "chain.txt").write_text("".join(map(chr, chain(np.random.default_rng(4), 30000))))
    (root / "config.json").write_text(json.dumps(CFG.to_dict()))
    assert main(["prepare", str(root / "chain.txt"), "--tokenizer", str(root / "tok.json"),
                 "--out", str(root / "data"), "--no-progress"]) == 0
    return root


def _train(root, out, *extra) -> int:
    return main(["train", str(root / "config.json"), "--data", str(root / "data"), "--out", str(out), "--steps", "6",
                 "--batch-size", "4", "--lr", "1e-2", "--warmup", "2", "--ckpt-every", "2", "--no-progress", *extra])


def _run_files(out) -> dict:
    """Every tensor of the checkpoint and its trainer.json but the wall-clock time."""
    from nanoeuler.checkpoint import read_tensors
    files = {name: read_tensors(out / name, name) for name in ("model.safetensors", "optimizer.safetensors")}
    trainer = json.loads((out / "trainer.json").read_text())
    trainer.pop("elapsed_s")
    return files | {"trainer.json": trainer}


def _assert_same_run(a: dict, b: dict) -> None:
    assert a["trainer.json"] == b["trainer.json"]
    for name in ("model.safetensors", "optimizer.safetensors"):
        assert a[name].keys() == b[name].keys()
        for key in a[name]:
            assert np.array_equal(a[name][key], b[name][key]), (name, key)


def test_resume_at_every_phase_is_the_straight_run(chain_data, tmp_path, monkeypatch):
    """Stopped during the steps, at the last step (Ctrl-C), during the draft distillation (Ctrl-C) or after
    it, `train --resume` ends with the straight run's checkpoint bit for bit, distilled draft heads included."""
    import os
    import signal
    from nanoeuler import train
    monkeypatch.setattr(drafts, "default_rollouts", lambda cfg: 16)   # a short distillation
    monkeypatch.setattr(drafts, "MIN_STEPS", 20)
    assert _train(chain_data, tmp_path / "straight") == 0
    straight = _run_files(tmp_path / "straight")
    assert straight["trainer.json"]["phase"] == "done"

    # 1. during the steps
    assert _train(chain_data, tmp_path / "steps", "--stop-after", "3") == 0
    assert json.loads((tmp_path / "steps" / "trainer.json").read_text())["phase"] == "train"
    # 2. Ctrl-C in the last step: the checkpoint holds every step, the distillation has not run
    real_accumulate, calls = train.accumulate, []

    def ctrl_c_in_last_step(*a, **kw):
        calls.append(1)
        if len(calls) == 6:
            os.kill(os.getpid(), signal.SIGINT)
        return real_accumulate(*a, **kw)
    monkeypatch.setattr(train, "accumulate", ctrl_c_in_last_step)
    assert _train(chain_data, tmp_path / "boundary") == 130
    monkeypatch.setattr(train, "accumulate", real_accumulate)
    assert json.loads((tmp_path / "boundary" / "trainer.json").read_text())["phase"] == "drafts"
    # 3. Ctrl-C during the distillation: the trained checkpoint stays, its phase still "drafts"
    real_fit = drafts.fit_head

    def ctrl_c_in_fit(*a, **kw):
        raise KeyboardInterrupt
    monkeypatch.setattr(drafts, "fit_head", ctrl_c_in_fit)
    assert _train(chain_data, tmp_path / "distilling") == 130
    monkeypatch.setattr(drafts, "fit_head", real_fit)
    interrupted = _run_files(tmp_path / "distilling")
    assert interrupted["trainer.json"]["phase"] == "drafts"
    heads = [k for k in straight["model.safetensors"] if k.startswith("heads.") and not k.startswith("heads.0.")]
    assert heads and not all(np.array_equal(interrupted["model.safetensors"][k], straight["model.safetensors"][k])
                             for k in heads)       # the straight run's draft heads are distilled ones
    # 4. after it: nothing left to do
    import shutil
    shutil.copytree(tmp_path / "straight", tmp_path / "after")

    for name in ("steps", "boundary", "distilling", "after"):
        assert _train(chain_data, tmp_path / name, "--resume") == 0, name
        _assert_same_run(_run_files(tmp_path / name), straight)
