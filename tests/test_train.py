"""The training loop: exact resume (stop-after and SIGINT), NaN guard, incompatible resume, logs."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from nanoeuler import UserError
from nanoeuler.optim import AdamW, clip_grad_norm, lr_schedule
from nanoeuler.training.train import TrainingDiverged

from train_fixtures import run

TESTS = Path(__file__).parent


def _assert_identical_runs(a: Path, b: Path):
    for name in ("model.safetensors", "optimizer.safetensors"):
        ta, tb = load_file(str(a / name)), load_file(str(b / name))
        assert ta.keys() == tb.keys()
        for k in ta:
            assert np.array_equal(ta[k], tb[k]), (name, k)  # bitwise
    sa, sb = (json.loads((p / "trainer.json").read_text()) for p in (a, b))
    assert sa["step"] == sb["step"] and sa["rng"] == sb["rng"] and sa["optimizer"] == sb["optimizer"]


def test_schedule_warmup_then_cosine_to_ten_percent():
    assert lr_schedule(0, 1.0, 10, 100) == pytest.approx(0.1)
    assert lr_schedule(9, 1.0, 10, 100) == pytest.approx(1.0)
    assert lr_schedule(55, 1.0, 10, 100) == pytest.approx(0.55)
    assert lr_schedule(100, 1.0, 10, 100) == pytest.approx(0.1)


def test_training_reduces_loss_and_writes_a_checkpoint(tmp_path):
    model, summary = run(tmp_path / "run", steps=12)
    assert summary["finished"] and summary["step"] == 12
    log = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == list(range(1, 13))
    assert log[-1]["loss"] < log[0]["loss"] - 0.3
    assert "val_bpb" in log[-1] and (tmp_path / "run" / "curves.png").stat().st_size > 1000
    for f in ("model.safetensors", "config.json", "optimizer.safetensors", "trainer.json"):
        assert (tmp_path / "run" / f).is_file()


def test_stop_after_then_resume_is_bitwise_identical(tmp_path):
    run(tmp_path / "straight", steps=10)
    _, s1 = run(tmp_path / "split", steps=10, stop_after=4)
    assert s1["step"] == 4 and not s1["finished"]
    _, s2 = run(tmp_path / "split", steps=10, resume=True, stop_after=3)
    assert s2["step"] == 7
    _, s3 = run(tmp_path / "split", steps=10, resume=True)
    assert s3["finished"]
    _assert_identical_runs(tmp_path / "straight", tmp_path / "split")
    steps = [json.loads(line)["step"] for line in (tmp_path / "split" / "log.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 11))


def test_grad_accum_and_masks_resume_exactly(tmp_path):
    """With a loss mask (30 % of the targets off) and 2 micro-batches: weights, AdamW moments and trainer state
    of a run stopped and resumed are the bits of the straight run; the mask is really in effect."""
    run(tmp_path / "a", steps=6, grad_accum=2, mask_fraction=0.3)
    run(tmp_path / "b", steps=6, grad_accum=2, mask_fraction=0.3, stop_after=3)
    run(tmp_path / "b", steps=6, grad_accum=2, mask_fraction=0.3, resume=True)
    _assert_identical_runs(tmp_path / "a", tmp_path / "b")
    run(tmp_path / "unmasked", steps=6, grad_accum=2, mask_fraction=1e-12)  # the same draws, every target kept
    ma, mu = (load_file(str(tmp_path / r / "optimizer.safetensors")) for r in ("a", "unmasked"))
    assert not np.array_equal(ma["m.embed.weight"], mu["m.embed.weight"])


def test_clip_grad_norm_scales_to_the_limit_and_returns_the_norm_before():
    g = {"a": np.array([3.0, 0.0]), "b": np.array([[4.0]])}                 # global norm 5
    assert clip_grad_norm(g, 1.0) == 5.0
    assert np.sqrt(sum(float(np.vdot(x, x)) for x in g.values())) == pytest.approx(1.0, rel=1e-5)
    assert np.allclose(g["a"], [0.6, 0.0], rtol=1e-5) and np.allclose(g["b"], [[0.8]], rtol=1e-5)
    small = {"a": np.array([0.3, 0.4])}
    assert clip_grad_norm(small, 1.0) == pytest.approx(0.5) and np.array_equal(small["a"], [0.3, 0.4])
    big = {"a": np.array([30.0, 40.0])}
    assert clip_grad_norm(big, 0.0) == 50.0 and np.array_equal(big["a"], [30.0, 40.0])  # 0: no clipping


def test_the_training_loop_clips_the_gradient_before_adamw(tmp_path, monkeypatch):
    """One process: every gradient AdamW receives has global norm <= --grad-clip, and the clip was needed
    (the log's grad_norm, taken before clipping, is above it)."""
    seen = []
    real = AdamW.step

    def recording(self, params, grads, lr=None):
        seen.append(float(np.sqrt(sum(float(np.vdot(g, g)) for g in grads.values()))))
        return real(self, params, grads, lr=lr)

    monkeypatch.setattr(AdamW, "step", recording)
    run(tmp_path / "run", steps=4, grad_clip=0.05)
    logged = [json.loads(line)["grad_norm"] for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert len(seen) == 4 and min(logged) > 0.05
    assert max(seen) <= 0.05 * (1 + 1e-5), seen


def test_dropout_run_resumes_exactly_and_differs_from_no_dropout(tmp_path):
    run(tmp_path / "a", steps=6, dropout=0.2)
    run(tmp_path / "b", steps=6, dropout=0.2, stop_after=3)
    run(tmp_path / "b", steps=6, dropout=0.2, resume=True)
    _assert_identical_runs(tmp_path / "a", tmp_path / "b")
    run(tmp_path / "none", steps=6)
    wa, wn = (load_file(str(tmp_path / r / "model.safetensors")) for r in ("a", "none"))
    assert not np.array_equal(wa["layers.0.attn.wo.weight"], wn["layers.0.attn.wo.weight"])
    with pytest.raises(UserError, match="--dropout must be in"):
        run(tmp_path / "bad", steps=6, dropout=1.0)


def test_resume_of_a_run_saved_before_a_setting_existed(tmp_path):
    """trainer.json written before `dropout` was a setting: the run had none, so resuming it is allowed."""
    run(tmp_path / "a", steps=6)
    run(tmp_path / "b", steps=6, stop_after=3)
    state_file = tmp_path / "b" / "trainer.json"
    state = json.loads(state_file.read_text())
    del state["train_config"]["dropout"]
    state_file.write_text(json.dumps(state))
    run(tmp_path / "b", steps=6, resume=True)
    _assert_identical_runs(tmp_path / "a", tmp_path / "b")


def test_a_run_saved_with_a_phase_resumes_without_it(tmp_path):
    """trainer.json written while pretraining ended by distilling draft heads records what was left, a
    `phase` ("train", "drafts", "done"): such a run resumes bit for bit and is saved without it; a finished
    one (phase "drafts": its distillation never ran) resumes as finished."""
    run(tmp_path / "a", steps=6)
    run(tmp_path / "b", steps=6, stop_after=3)
    state_file = tmp_path / "b" / "trainer.json"
    for phase in ("train", "drafts"):
        state_file.write_text(json.dumps(json.loads(state_file.read_text()) | {"phase": phase}))
        _, summary = run(tmp_path / "b", steps=6, resume=True)
        assert summary["finished"] and summary["step"] == 6, phase
        _assert_identical_runs(tmp_path / "a", tmp_path / "b")
        if phase == "train":
            assert "phase" not in json.loads(state_file.read_text())


def test_changed_settings_names_what_differs_and_fills_missing_with_defaults():
    from nanoeuler.training.train import TrainConfig, changed_settings
    import dataclasses
    old = dataclasses.asdict(TrainConfig(lr=3e-3))
    del old["dropout"]                                  # saved before dropout existed: it had none
    assert changed_settings(old, TrainConfig(lr=3e-3, eval_every=7)) == []   # eval_every may change
    assert changed_settings(old, TrainConfig(lr=5e-3, dropout=0.1)) == ["lr 0.003 -> 0.005", "dropout 0.0 -> 0.1"]


SIGINT_SCRIPT = """
import sys, time
sys.path.insert(0, {tests!r})
import train_fixtures, nanoeuler.training.train as t
real = t.accumulate
def slow(*a, **k):
    time.sleep(0.05)
    return real(*a, **k)
t.accumulate = slow
train_fixtures.run({out!r}, steps=60, resume={resume}, ckpt_every=1000)
"""


def test_sigint_at_any_moment_then_resume_is_bitwise_identical(tmp_path):
    run(tmp_path / "straight", steps=60, ckpt_every=1000)
    out = tmp_path / "interrupted"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.Popen([sys.executable, "-c", SIGINT_SCRIPT.format(tests=str(TESTS), out=str(out), resume=False)],
                            env=env, stderr=subprocess.PIPE)
    deadline = time.time() + 60
    while not (out / "log.jsonl").exists() or len((out / "log.jsonl").read_text().splitlines()) < 5:
        assert time.time() < deadline and proc.poll() is None
        time.sleep(0.02)
    time.sleep(0.013)  # somewhere inside a step
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 0, proc.stderr.read().decode()
    state = json.loads((out / "trainer.json").read_text())
    assert 5 <= state["step"] < 60
    run(out, steps=60, resume=True, ckpt_every=1000)
    _assert_identical_runs(tmp_path / "straight", out)


def test_nan_loss_stops_and_keeps_last_checkpoint(tmp_path, monkeypatch):
    out = tmp_path / "run"
    run(out, steps=10, stop_after=3)
    before = {f: (out / f).read_bytes() for f in ("model.safetensors", "optimizer.safetensors", "trainer.json")}
    import nanoeuler.model as m
    real = m.Model.loss_and_grads
    calls = {"n": 0}

    def poisoned(self, tokens, loss_mask=None, **kw):
        calls["n"] += 1
        h0, obj, g = real(self, tokens, loss_mask, **kw)
        return (float("nan"), obj, g) if calls["n"] == 2 else (h0, obj, g)

    monkeypatch.setattr(m.Model, "loss_and_grads", poisoned)
    with pytest.raises(TrainingDiverged, match="loss became nan at step 5"):
        run(out, steps=10, resume=True, ckpt_every=1)
    # step 4 was checkpointed (ckpt_every=1) before the NaN at step 5; that checkpoint is intact and loadable
    state = json.loads((out / "trainer.json").read_text())
    assert state["step"] == 4
    assert before["trainer.json"] != (out / "trainer.json").read_bytes()
    monkeypatch.setattr(m.Model, "loss_and_grads", real)
    _, summary = run(out, steps=10, resume=True, ckpt_every=1)
    assert summary["finished"]


def test_resume_refuses_a_different_run(tmp_path):
    run(tmp_path / "run", steps=10, stop_after=2)
    with pytest.raises(UserError, match="different settings: lr"):
        _resume_with_lr(tmp_path / "run")
    with pytest.raises(UserError, match="already holds a training run"):
        run(tmp_path / "run", steps=10)
    with pytest.raises(UserError, match="nothing to resume"):
        (tmp_path / "empty").mkdir()
        from nanoeuler import Model
        Model.init(__import__("train_fixtures").TINY).save(tmp_path / "empty")
        run(tmp_path / "empty", steps=10, resume=True)


def _resume_with_lr(out):
    from nanoeuler import Model
    from nanoeuler.training.train import TrainConfig, run_training
    from train_fixtures import SyntheticSource
    tcfg = TrainConfig(steps=10, batch_size=4, lr=5e-3, warmup=2, eval_every=4, eval_batches=0, ckpt_every=3)
    run_training(Model.load(out), None, SyntheticSource(), out, tcfg, resume=True, progress=False)


def test_the_log_is_never_written_through_a_link(tmp_path):
    """A log.jsonl in --out that links to a file elsewhere: training (fresh or resumed) refuses with one line
    and the file elsewhere keeps its bytes (it was appended to, then read back as JSON: a crash)."""
    from conftest import snapshot
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "notes.txt").write_text("my own notes, not JSON\n")
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    (fresh / "log.jsonl").symlink_to(outside / "notes.txt")
    before = snapshot(outside)
    with pytest.raises(UserError, match="link"):
        run(fresh, steps=4)
    run(tmp_path / "resumed", steps=4, stop_after=2)
    (tmp_path / "resumed" / "log.jsonl").unlink()
    (tmp_path / "resumed" / "log.jsonl").symlink_to(outside / "notes.txt")
    with pytest.raises(UserError, match="link"):
        run(tmp_path / "resumed", steps=4, resume=True)
    assert snapshot(outside) == before


def test_a_new_run_never_replaces_files_it_did_not_write(tmp_path):
    """--out holding a checkpoint without a run (an import, say): a new run refuses instead of replacing
    its model.safetensors; a directory left by a run that never saved (its log only) is taken, log reset."""
    from conftest import snapshot
    from nanoeuler import Model
    from train_fixtures import TINY
    imported = tmp_path / "imported"
    Model.init(TINY, seed=1).save(imported)
    before = snapshot(imported)
    with pytest.raises(UserError, match="not a training run"):
        run(imported, steps=2)
    assert snapshot(imported) == before
    crashed = tmp_path / "crashed"
    crashed.mkdir()
    (crashed / "log.jsonl").write_text('{"step": 1, "loss": 9.0}\n')
    run(crashed, steps=2)
    assert [r["step"] for r in map(json.loads, (crashed / "log.jsonl").read_text().splitlines())] == [1, 2]


def test_a_hand_edited_train_config_is_one_line():
    """trainer.json's train_config feeds --resume's settings: a wrong type or an unknown key is a UserError
    naming it (was: an internal TypeError comparing a string with a number)."""
    from argparse import Namespace
    from nanoeuler.cli.train import train_config_from_args
    for bad in ({"lr": "x"}, {"steps": 2.5}, {"seed": True}, {"lr": float("nan")}, {"bogus": 1}):
        with pytest.raises(UserError, match="train_config"):
            train_config_from_args(Namespace(), bad)
    assert train_config_from_args(Namespace(lr=None), {"lr": 1e-3, "steps": 7}).steps == 7
