"""Bad input to the training commands (train, eval, sft, dpo, dpo-eval): one line, exit != 0, nothing created
before the input is validated; the vocab size comes from the data; read-only evaluation changes nothing."""
import json
import os
import shutil
import tracemalloc

import pytest
from conftest import snapshot, tiny_config
from test_cli_errors import one_line_error

from nanoeuler import Model
from nanoeuler import checkpoint as ckpt
from nanoeuler.cli import main
from nanoeuler.data.corpus import bundled_works
from nanoeuler.data.shards import prepare
from nanoeuler.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """DATA prepared with a 600-token tokenizer (more than small's 512 embeddings) and its tokenizer."""
    root = tmp_path_factory.mktemp("train_errors")
    tok = Tokenizer.train([bundled_works()["hamlet"][:80000]], 600, progress=False)
    src = root / "plays.txt"
    src.write_text(bundled_works()["hamlet"][:80000])
    prepare([src], tok, root / "data", processes=1, progress=False)
    return root / "data"


@pytest.mark.parametrize("argv, needle", [
    (["train", "small", "--lr", "inf"], "--lr"),
    (["train", "small", "--lr", "nan"], "--lr"),
    (["train", "small", "--lr", "0"], "--lr"),
    (["train", "small", "--seed", "-1"], "--seed"),
    (["train", "small", "--stop-after", "0"], "--stop-after"),
    (["train", "small", "--steps", "0"], "--steps"),
    (["train", "small", "--batch-size", "0"], "--batch-size"),
    (["train", "small", "--dropout", "1"], "--dropout"),
    (["train", "small", "--grad-clip", "-1"], "--grad-clip"),
    (["train", "small", "--init-seed", "-2"], "--init-seed"),
    (["eval", "--ckpt", "x", "--batch-size", "0"], "--batch-size"),
    (["sft", "--base", "x", "--out", "y", "--stop-after", "0"], "--stop-after"),
    (["sft", "--base", "x", "--out", "y", "--lr", "inf"], "--lr"),
    (["dpo", "--sft", "x", "--out", "y", "--stop-after", "0"], "--stop-after"),
    (["dpo", "--sft", "x", "--out", "y", "--seed", "-1"], "--seed"),
])
def test_training_flags_finite_and_in_range(argv, needle, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert needle in one_line_error(argv + ["--out", "runs/x"] if argv[0] == "train" else argv, capsys)
    assert os.listdir(tmp_path) == []


def test_batch_too_large_is_refused_before_allocating(data, tmp_path, capsys):
    tracemalloc.start()
    line = one_line_error(["train", "small", "--data", data, "--out", tmp_path / "run", "--batch-size", "100000"],
                          capsys)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert "GiB" in line and peak < 256 << 20
    assert not (tmp_path / "run").exists()


def test_resume_validates_before_creating_anything(data, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert "nothing to resume" in one_line_error(["train", "--resume", "--out", "runs/none"], capsys)
    other = tmp_path / "other"
    Model.init(tiny_config(), seed=0).save(other)               # a checkpoint, but not a training run
    assert "nothing to resume" in one_line_error(["train", "--resume", "--out", other], capsys)
    run = tmp_path / "run"
    assert main(["train", "small", "--data", str(data), "--out", str(run), "--steps", "2", "--stop-after", "1",
                 "--batch-size", "2", "--no-progress"]) == 0
    capsys.readouterr()
    before = set(os.listdir(tmp_path))
    assert "--data" in one_line_error(["train", "--resume", "--out", run], capsys)   # no bundled data built
    assert set(os.listdir(tmp_path)) == before and not (tmp_path / "data").exists()
    state = json.loads((run / "trainer.json").read_text())
    (run / "trainer.json").write_text(json.dumps(state | {"kind": "sft"}))
    assert "not a pretraining run" in one_line_error(["train", "--resume", "--out", run, "--data", data], capsys)
    (run / "trainer.json").write_text(json.dumps(state | {"step": -5}))
    assert "step" in one_line_error(["train", "--resume", "--out", run, "--data", data], capsys)
    (run / "trainer.json").write_text(json.dumps(state))
    with open(run / "log.jsonl", "ab") as f:                      # binary junk in the log: dropped, with a warning
        f.write(b"\xff\xfe\x00junk\n[[[[\n")
    assert main(["train", "--resume", "--out", str(run), "--data", str(data), "--no-progress"]) == 0
    assert "dropped 2 unreadable line(s)" in capsys.readouterr().err
    rows = [json.loads(ln) for ln in (run / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]


def test_vocab_size_comes_from_the_data(data, tmp_path, capsys):
    """The data's tokenizer has 600 tokens, small 512 embeddings: train takes 600 and says so."""
    run = tmp_path / "run"
    assert main(["train", "small", "--data", str(data), "--out", str(run), "--steps", "1", "--batch-size", "2",
                 "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "vocab_size 600 from the data's tokenizer" in out
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["vocab_size"] == 600 and cfg["dim"] == 128 and cfg["n_layers"] == 4


def test_eval_changes_nothing(data, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "small", "--data", str(data), "--out", str(run), "--steps", "1", "--batch-size", "2",
                 "--no-progress"]) == 0
    (run / ckpt.STAGING).mkdir()
    before = snapshot(tmp_path)
    assert main(["eval", "--ckpt", str(run), "--data", str(data), "--max-batches", "1"]) == 0
    capsys.readouterr()
    assert snapshot(tmp_path) == before


def test_eval_seq_len_scores_windows_of_that_length(data, tmp_path, capsys):
    """eval --seq-len T: validation windows of T tokens (a real model's whole context is too long a window for
    a CPU); --max-batches 1 then scores B·T targets; a T longer than the context is one line."""
    run = tmp_path / "run"
    assert main(["train", "small", "--data", str(data), "--out", str(run), "--steps", "1", "--batch-size", "2",
                 "--no-progress"]) == 0
    capsys.readouterr()
    for T in (128, 32):
        assert main(["eval", "--ckpt", str(run), "--data", str(data), "--max-batches", "1", "--batch-size", "2",
                     "--seq-len", str(T), "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["val_tokens"] == 2 * T
    assert main(["eval", "--ckpt", str(run), "--data", str(data), "--seq-len", "129"]) == 2
    assert "--seq-len 129 is longer than the model's context (128)" in capsys.readouterr().err


def test_a_bos_model_sees_its_bos_first_in_every_window(data, tmp_path, capsys):
    """A tokenizer that starts a text with a BOS token (Gemma's <bos>): every training and validation window
    has it in place of its first token (llama.cpp's perplexity does so), the rest unchanged; `eval` scores
    those windows, and they score differently from the plain ones (the test can fail)."""
    import numpy as np

    from nanoeuler.training.train import PretrainSource, evaluate
    tok = Tokenizer.from_dict(Tokenizer.load(data / "tokenizer.json").to_dict() | {"bos": "</s>"})
    bos_data = tmp_path / "bos-data"
    shutil.copytree(data, bos_data)
    tok.save(bos_data / "tokenizer.json")
    manifest = json.loads((bos_data / "manifest.json").read_text())
    (bos_data / "manifest.json").write_text(json.dumps(manifest | {"tokenizer_fingerprint": tok.fingerprint()}))
    plain, started = PretrainSource(bos_data, 2, 32, 1), PretrainSource(bos_data, 2, 32, 1, bos=tok.bos_id)
    rng_a, rng_b = np.random.default_rng(0), np.random.default_rng(0)
    windows = [(plain.next_batch(rng_a)[0], started.next_batch(rng_b)[0])]
    windows += [(a, b) for (a, _), (b, _) in zip(plain.eval_batches(), started.eval_batches())]
    for a, b in windows:
        assert (b[:, 0] == tok.bos_id).all() and (b[:, 1:] == a[:, 1:]).all() and (a[:, 0] != tok.bos_id).any()
    run = tmp_path / "run"
    assert main(["train", "small", "--data", str(bos_data), "--out", str(run), "--steps", "1", "--batch-size", "2",
                 "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["eval", "--ckpt", str(run), "--data", str(bos_data), "--max-batches", "1", "--batch-size", "2",
                 "--seq-len", "32", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)["val_loss"]
    model = Model.load(run)
    K = model.config.n_mtp
    with_bos, without = (PretrainSource(bos_data, 2, 32, K, bos=b) for b in (tok.bos_id, None))
    assert got == pytest.approx(evaluate(model, with_bos, 1)["val_loss"])
    assert got != pytest.approx(evaluate(model, without, 1)["val_loss"])


def test_dpo_eval_refuses_a_mismatched_reference(tmp_path, capsys):
    tok = Tokenizer.train([bundled_works()["hamlet"][:30000]], 300, progress=False)
    cfg = tiny_config(vocab_size=tok.vocab_size, ctx_len=128)
    Model.init(cfg, seed=0).save(tmp_path / "policy", tok)
    Model.init(cfg.replace(ffn_hidden=32), seed=0).save(tmp_path / "ref_cfg", tok)
    other_tok = Tokenizer.train([bundled_works()["hamlet"][:20000]], 290, progress=False)
    Model.init(tiny_config(vocab_size=tok.vocab_size, ctx_len=128), seed=1).save(tmp_path / "ref_tok", other_tok)
    for ref, why in (("ref_cfg", "different config"), ("ref_tok", "different tokenizer")):
        line = one_line_error(["dpo-eval", "--ckpt", tmp_path / "policy", "--ref", tmp_path / ref, "--limit", "2",
                               "--no-greedy", "--no-progress"], capsys)
        assert why in line


def test_sft_jsonl_errors_name_the_line(tmp_path):
    from nanoeuler.errors import UserError
    from nanoeuler.training.sft import load_examples
    rows = [json.dumps({"instruction": f"q{i}", "input": "", "output": "a"}) for i in range(130)]
    rows[120] = json.dumps({"instruction": "q", "input": "", "output": ""})      # line 121: empty output
    path = tmp_path / "sft.jsonl"
    path.write_text("\n".join(rows) + "\n")
    good, bad = load_examples(path)
    assert len(good) == 129 and bad == ["line 121: empty output"]
    rows[125] = "{not json"                                                        # line 126: not JSON
    path.write_text("\n".join(rows) + "\n")
    with pytest.raises(UserError, match="line 126"):
        load_examples(path)
    shutil.rmtree(tmp_path, ignore_errors=True)
