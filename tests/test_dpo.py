"""DPO: the loss and its gradient (closed form, finite differences, down to every parameter), log 2 when the
policy is the reference, batching/padding, pair data and the offline pair set, the training loop
(learning, bit-for-bit resume, refusals) and the CLI."""
import json
import math

import numpy as np
import pytest
from safetensors.numpy import load_file

from nanoeuler import Model, UserError
from nanoeuler.training.check import TOLERANCE, check_dpo
from nanoeuler.training.dpo import (dpo_loss_and_grads, dpo_loss_backward, dpo_loss_forward, load_pairs,
                           make_batch, offline_pairs, response_logprobs_forward, run_dpo, sequence_logprobs_forward,
                           split_pairs, tokenize_pairs, tokenize_response, trained_params)
from nanoeuler.training.train import TrainConfig
from conftest import rel_err, tiny_config

TINY = tiny_config(vocab_size=257, dim=32, n_heads=4, n_kv_heads=2, n_layers=2, ctx_len=32, ffn_hidden=48, n_mtp=2)


@pytest.fixture(scope="module")
def tok():
    from nanoeuler.tokenizer import Tokenizer
    return Tokenizer([])  # bytes + </s>: nothing to train


def test_loss_closed_form_and_direction():
    loss, cache = dpo_loss_forward([-2.0, -1.0], [-6.0, -1.0], [-3.0, -1.0], [-5.0, -1.0], 0.1)
    z = np.array([0.2, 0.0])
    assert loss == pytest.approx(np.mean(-np.log(1 / (1 + np.exp(-z)))), rel=1e-15)
    dpc, dpr, drc, drr = dpo_loss_backward(1.0, cache)
    assert np.all(dpc < 0) and np.all(dpr > 0)  # raising log π(chosen) / lowering log π(rejected) lowers the loss
    np.testing.assert_allclose(dpc, -0.1 * (1 / (1 + np.exp(z))) / 2)
    np.testing.assert_array_equal(dpc, -drc)
    np.testing.assert_array_equal(dpr, -drr)
    big, _ = dpo_loss_forward([0.0], [-1e4], [0.0], [0.0], 1.0)  # no overflow either way
    small, _ = dpo_loss_forward([-1e4], [0.0], [0.0], [0.0], 1.0)
    assert big == 0.0 and small == pytest.approx(1e4)


def test_response_logprobs_is_the_masked_sum_of_log_softmax():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((2, 5, 7))
    targets = rng.integers(0, 7, (2, 5))
    mask = np.array([[0, 1, 1, 0, 1], [1, 1, 1, 1, 1]], dtype=bool)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    expected = [sum(logp[b, t, targets[b, t]] for t in range(5) if mask[b, t]) for b in range(2)]
    got, _ = response_logprobs_forward(logits, np.where(mask, targets, -1), mask)
    np.testing.assert_allclose(got, expected, rtol=1e-13)


def test_float64_finite_difference_check_of_every_dpo_gradient():
    rows = check_dpo(seed=0)
    names = [r.name for r in rows]
    assert "op dpo_loss: d0" in names and "op response_logprobs: d0" in names
    assert "dpo: embed.weight" in names and "dpo: heads.0.weight" in names and "dpo: layers.1.ffn.down.weight" in names
    bad = [(r.name, r.max_rel_error) for r in rows if not r.max_rel_error < TOLERANCE]
    assert not bad, bad


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_policy_equal_to_reference_gives_exactly_log_2(dtype):
    model = Model.init(TINY, seed=3).astype(dtype)
    rng = np.random.default_rng(1)
    seqs = [rng.integers(0, 257, n) for n in (9, 14, 7, 20)]
    masks = [np.arange(len(s)) >= 4 for s in seqs]
    batch = make_batch(seqs[:2], masks[:2], seqs[2:], masks[2:])
    ref, _ = sequence_logprobs_forward(TINY, model.params, batch.inputs, batch.targets, batch.mask)
    loss, metrics, grads = dpo_loss_and_grads(TINY, model.params, batch, ref[:2], ref[2:], 0.1)
    assert loss == math.log(2)  # exactly
    assert metrics["reward_margin"] == 0.0 and metrics["reward_accuracy"] == 0.0
    assert max(float(np.abs(g).max()) for g in grads.values()) > 0  # still a gradient: σ(0) = 1/2
    assert set(grads) == set(trained_params(TINY, model.params)) and "heads.1.weight" not in grads


def test_nll_term_adds_the_chosen_per_token_nll():
    from nanoeuler.training.dpo import chosen_nll_backward, chosen_nll_forward
    nll, cache = chosen_nll_forward([-6.0, -2.0], [3, 1])
    assert nll == 2.0 and chosen_nll_backward(1.0, cache).tolist() == [-1 / 6, -1 / 2]
    model = Model.init(TINY, seed=3).astype(np.float64)
    rng = np.random.default_rng(1)
    seqs = [rng.integers(0, 257, n) for n in (9, 14, 7, 20)]
    masks = [np.arange(len(s)) >= 4 for s in seqs]
    batch = make_batch(seqs[:2], masks[:2], seqs[2:], masks[2:])
    ref, _ = sequence_logprobs_forward(TINY, model.params, batch.inputs, batch.targets, batch.mask)
    loss, metrics, _ = dpo_loss_and_grads(TINY, model.params, batch, ref[:2], ref[2:], 0.1, nll_weight=0.5)
    expected_nll = np.mean(-ref[:2] / np.array([5, 10]))  # response tokens: 9-4, 14-4
    assert metrics["dpo_loss"] == math.log(2) and metrics["chosen_nll"] == pytest.approx(expected_nll, rel=1e-14)
    assert loss == pytest.approx(math.log(2) + 0.5 * expected_nll, rel=1e-14)


def test_padding_does_not_change_a_sequence_log_prob():
    model = Model.init(TINY, seed=0).astype(np.float64)
    rng = np.random.default_rng(2)
    short, long = rng.integers(0, 257, 8), rng.integers(0, 257, 25)
    m_short, m_long = np.arange(8) >= 3, np.arange(25) >= 10
    alone = make_batch([short], [m_short], [short], [m_short], pad_id=5)
    padded = make_batch([short], [m_short], [long], [m_long], pad_id=7)
    a, _ = sequence_logprobs_forward(TINY, model.params, alone.inputs, alone.targets, alone.mask)
    b, _ = sequence_logprobs_forward(TINY, model.params, padded.inputs, padded.targets, padded.mask)
    assert a[0] == pytest.approx(b[0], rel=1e-12)


@pytest.mark.parametrize("dtype,tol,entry_tol,rows", [(np.float64, 1e-12, 5e-11, 0), (np.float32, 1e-5, 3e-4, 0),
                                                      (np.float64, 1e-12, 5e-11, 7), (np.float32, 1e-5, 3e-4, 7)])
def test_fast_engine_gives_the_reference_loss_and_gradients(dtype, tol, entry_tol, rows, monkeypatch):
    """rows: the head's logits formed 7 rows at a time (forward, and again in backward), in 2 parts."""
    from nanoeuler.training.dpo import Workspaces
    from nanoeuler.fast import engine, parallel
    if rows:
        monkeypatch.setattr(engine, "LOGITS_BYTES", rows * TINY.vocab_size * np.dtype(dtype).itemsize)
        monkeypatch.setattr(parallel, "PARTS", 2)
    model = Model.init(TINY, seed=3).astype(dtype)
    rng = np.random.default_rng(0)
    for p in model.params.values():
        p += (rng.standard_normal(p.shape) * 0.1).astype(dtype)
    seqs = [rng.integers(0, 257, n) for n in (9, 14, 7, 20, 12, 5)]
    masks = [np.arange(len(s)) >= 3 for s in seqs]
    batch = make_batch(seqs[:3], masks[:3], seqs[3:], masks[3:], length=24)
    rc, rr = rng.normal(-30, 5, 3), rng.normal(-30, 5, 3)
    l1, m1, g1 = dpo_loss_and_grads(TINY, model.params, batch, rc, rr, 0.1)
    workspaces = Workspaces(TINY, dtype)
    l2, m2, g2 = dpo_loss_and_grads(TINY, model.params, batch, rc, rr, 0.1, workspaces)
    assert [ws.logits_rows for ws in workspaces.by_shape.values()] == [rows or 3 * 24]
    assert l2 == pytest.approx(l1, rel=tol) and g1.keys() == g2.keys()
    for name in g1:
        assert rel_err(g2[name], g1[name]) <= entry_tol, name


def test_workspaces_of_fixed_weights_share_one_stack_over_batch_shapes():
    """The reference's (and evaluation's) workspaces: lean, and one set of stacked weights for every batch
    shape; their log-probs are still the reference path's."""
    from nanoeuler.training.dpo import Workspaces
    model = Model.init(TINY, seed=3).astype(np.float64)
    rng = np.random.default_rng(5)
    workspaces = Workspaces(TINY, np.float64, lean=True, fixed=True)
    for n in (9, 23):
        seqs = [rng.integers(0, 257, n) for _ in range(2)]
        masks = [np.arange(n) >= 3 for _ in range(2)]
        b = make_batch(seqs[:1], masks[:1], seqs[1:], masks[1:])
        want, _ = sequence_logprobs_forward(TINY, model.params, b.inputs, b.targets, b.mask)
        got, _ = sequence_logprobs_forward(TINY, model.params, b.inputs, b.targets, b.mask, workspaces)
        np.testing.assert_allclose(got, want, rtol=1e-12)
    first, second = workspaces.by_shape.values()
    assert first.lean and second.stacks is first.stacks and len(first.stacks) == 2 * TINY.n_layers


def test_long_pairs_lose_the_start_of_the_prompt(tok):
    pairs = [{"prompt": "x" * 40, "chosen": "abc", "rejected": "de"}, {"prompt": "p", "chosen": "y" * 40, "rejected": "n"}]
    tp = tokenize_pairs(tok, pairs, ctx_len=32)
    assert len(tp) == 1 and tp.truncated == 1 and tp.dropped == 1
    (c, cm), (r, rm) = tp.chosen[0], tp.rejected[0]
    assert len(c) == 33 and c[-4:].tolist() == [97, 98, 99, 256] and cm.sum() == 4
    assert c[:-4].tolist() == r[:-3].tolist() == [120] * 29  # the same prompt tokens: the last 29 x's


def test_make_batch_layout():
    b = make_batch([[7, 8, 9]], [[0, 1, 1]], [[7, 5]], [[0, 1]])
    assert b.inputs.tolist() == [[7, 8], [7, 0]]
    assert b.targets.tolist() == [[8, 9], [5, -1]]
    assert b.mask.tolist() == [[True, True], [True, False]]


def test_pair_tokens_match_the_sft_rendering():
    """... for a prompt given as text and as messages (rendered by the chat template), with ours and ChatML."""
    from gguf_fixtures import CHATML
    from nanoeuler.training.sft import prompt_text, render, user_message
    from nanoeuler.tokenizer import Tokenizer
    tok = Tokenizer([(32, 116), (104, 101), (256, 257), (72, 97), (259, 109)])  # ' t', 'he', ' the', 'Ha', 'Ham'
    q, line = "Which character speaks this line?", "To be, or not to be, that is the question:"
    ref_ids, ref_mask = render(tok, q, line, "Hamlet")
    for p in ({"prompt": prompt_text(q, line)}, {"prompt": "-", "messages": [user_message(q, line)]}):
        ids, mask = tokenize_response(tok, p, "Hamlet")
        assert ids.tolist() == ref_ids and mask.tolist() == ref_mask
    chatml = Tokenizer.from_dict(Tokenizer([(32, 116)], ["</s>", "<|im_start|>", "<|im_end|>"]).to_dict()
                                 | {"chat_template": CHATML, "stops": ["<|im_end|>"]})
    ids, mask = tokenize_response(chatml, {"prompt": "-", "messages": [user_message(q, line)]}, "Hamlet")
    assert ids.tolist() == render(chatml, q, line, "Hamlet")[0]
    assert chatml.decode(ids[mask].tolist()) == "Hamlet<|im_end|>"


def test_offline_pairs_are_wrong_answers_of_the_same_kind_with_unseen_heldout_prompts():
    from nanoeuler.training.sft import TASKS, WORD_RE, normalize
    train, held = offline_pairs()
    assert len(train) > 5000 and len(held) > 300
    assert not {p["prompt"] for p in train} & {p["prompt"] for p in held}
    assert {p["task"] for p in held} == set(TASKS)
    for p in train[:500] + held:
        assert normalize(p["chosen"]) != normalize(p["rejected"])
        assert p["prompt"].endswith("### Response:\n") and "### Instruction:" in p["prompt"]
        if p["task"] in ("first_word", "last_word"):
            question = p["prompt"].split("### Instruction:\n")[1]
            assert p["rejected"] in WORD_RE.findall(question)
    held_lines = {p["chosen"] for p in held if p["task"] == "continue"}
    assert not held_lines & {p["rejected"] for p in train if p["task"] == "continue"}  # no held-out text in training


def test_offline_pairs_keep_only_questions_that_fit_the_context(tok):
    """dpo/dpo-eval build the offline pairs with `fits_context`: a held-out question the model cannot see
    whole (its start cut off) is unanswerable and only adds noise to the greedy task accuracy."""
    from nanoeuler.training.sft import fits_context
    ctx = 230  # byte tokens: about half of the offline prompts are longer
    train, held = offline_pairs(n_train=50, n_heldout=40, fits=fits_context(tok, ctx))
    assert 40 <= len(train) <= 50 and 30 <= len(held) <= 40  # (a long rejected answer drops its pair)
    tp = tokenize_pairs(tok, held, ctx)
    assert tp.truncated == 0 and tp.dropped == 0 and len(tp) == len(held)
    assert tokenize_pairs(tok, offline_pairs(n_train=50, n_heldout=40)[1], ctx).truncated > 0  # unfiltered: cut


def test_load_pairs_skips_bad_lines_and_refuses_an_empty_file(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "p", "chosen": "a", "rejected": "b"}\nnot json\n{"prompt": "p", "chosen": "a"}\n'
                 '{"prompt": "p", "chosen": "a", "rejected": "a"}\n\n[1]\n')
    good, bad = load_pairs(f)
    assert len(good) == 1 and len(bad) == 4 and bad[0].startswith("line 2")
    f.write_text("{}\n")
    with pytest.raises(UserError, match="no valid"):
        load_pairs(f)
    with pytest.raises(UserError, match="not found"):
        load_pairs(tmp_path / "missing.jsonl")
    train, held = split_pairs([{"prompt": f"q{i}", "chosen": "a", "rejected": "b"} for i in range(500)])
    assert len(held) > 0 and len(train) + len(held) == 500


# ---- the loop on a tiny synthetic task -----------------------------------------------------------
def _pairs(n, offset=0):
    """Prompts 'q12=' ; chosen 'yes' (longer, so an untrained model prefers 'no'), rejected 'no'."""
    return [{"prompt": f"q{i + offset}=", "chosen": "yes", "rejected": "no"} for i in range(n)]


def _run(tok, out, steps, stop_after=None, resume=False, beta=0.5, reference_seed=0, **kw):
    model = Model.load(out) if resume else Model.init(TINY, seed=0)
    reference = Model.init(TINY, seed=reference_seed)
    train, val = tokenize_pairs(tok, _pairs(40), TINY.ctx_len), tokenize_pairs(tok, _pairs(8, 1000), TINY.ctx_len)
    tcfg = TrainConfig(steps=steps, batch_size=4, lr=3e-3, warmup=1, weight_decay=0.0, eval_every=4, ckpt_every=3,
                       **kw)
    summary = run_dpo(model, tok, train, val, reference, out, tcfg, beta=beta, resume=resume, stop_after=stop_after,
                      progress=False, data_id="synthetic")
    return model, summary


def test_dpo_learns_the_preference_and_leaves_the_mtp_heads_alone(tok, tmp_path):
    init = Model.init(TINY, seed=0)
    model, s = _run(tok, tmp_path / "run", steps=12)
    first = s["initial_eval"]
    assert first["val_loss"] == pytest.approx(math.log(2), abs=1e-6) and first["val_policy_accuracy"] == 0.0
    assert s["finished"] and s["val_loss"] < 0.3 and s["val_reward_accuracy"] == 1.0
    assert s["val_policy_accuracy"] == 1.0 and s["val_reward_margin"] > 1.0
    np.testing.assert_array_equal(model.params["heads.1.weight"], init.params["heads.1.weight"])
    assert not np.array_equal(model.params["heads.0.weight"], init.params["heads.0.weight"])
    log = [json.loads(x) for x in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == list(range(1, 13))
    assert {"loss", "reward_margin", "reward_accuracy", "policy_accuracy", "reward_chosen"} <= set(log[0])
    for f in ("model.safetensors", "optimizer.safetensors", "trainer.json", "reference.safetensors", "curves.png"):
        assert (tmp_path / "run" / f).is_file()


def test_stop_and_resume_is_bitwise_identical_and_refuses_other_settings(tok, tmp_path):
    _run(tok, tmp_path / "a", steps=7)
    _, s1 = _run(tok, tmp_path / "b", steps=7, stop_after=4)
    assert s1["step"] == 4 and not s1["finished"]
    with pytest.raises(UserError, match="beta"):
        _run(tok, tmp_path / "b", steps=7, resume=True, beta=0.2)
    with pytest.raises(UserError, match="reference model is not the run's"):
        _run(tok, tmp_path / "b", steps=7, resume=True, reference_seed=1)
    with pytest.raises(UserError, match="already holds"):
        _run(tok, tmp_path / "b", steps=7)
    _, s2 = _run(tok, tmp_path / "b", steps=7, resume=True)
    assert s2["finished"]
    for name in ("model.safetensors", "optimizer.safetensors", "reference.safetensors"):
        ta, tb = load_file(str(tmp_path / "a" / name)), load_file(str(tmp_path / "b" / name))
        assert ta.keys() == tb.keys() and all(np.array_equal(ta[k], tb[k], equal_nan=True) for k in ta), name
    la, lb = ((tmp_path / d / "log.jsonl").read_text().splitlines() for d in "ab")
    strip = lambda lines: [{k: v for k, v in json.loads(x).items() if k not in ("pairs_per_s", "elapsed_s")}
                           for x in lines]
    assert strip(la) == strip(lb)


def test_cli_dpo_on_a_pair_file_and_errors(tok, tmp_path, capsys):
    from nanoeuler.cli import main
    sft = tmp_path / "sft"
    Model.init(TINY, seed=0).save(sft, tok)
    f, v = tmp_path / "pairs.jsonl", tmp_path / "val.jsonl"
    f.write_text("".join(json.dumps(p) + "\n" for p in _pairs(20)))
    v.write_text("".join(json.dumps(p) + "\n" for p in _pairs(6, 500)))
    code = main(["dpo", "--sft", str(sft), "--data", str(f), "--val", str(v), "--out", str(tmp_path / "dpo"),
                 "--steps", "3", "--batch-size", "4", "--eval-every", "3", "--no-progress", "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and out["step"] == 3 and "val_policy_accuracy" in out and out["beta"] == 0.1
    code = main(["dpo-eval", "--ckpt", str(tmp_path / "dpo"), "--ref", str(sft), "--data", str(v), "--json",
                 "--no-progress", "--max-new-tokens", "4"])
    ev = json.loads(capsys.readouterr().out)
    assert code == 0 and ev["pairs"] == 6 and 0 <= ev["task_accuracy"] <= 1 and "reward_accuracy" in ev
    assert main(["dpo", "--data", str(f), "--out", str(tmp_path / "x")]) == 2
    assert "--sft RUN is required" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text("nope\n")
    assert main(["dpo", "--sft", str(sft), "--data", str(bad), "--out", str(tmp_path / "y")]) == 2
    assert "no valid" in capsys.readouterr().err
    assert main(["dpo", "--sft", str(sft), "--data", str(f), "--val", str(v), "--out", str(tmp_path / "z"),
                 "--beta", "0"]) == 2
    assert "beta" in capsys.readouterr().err


def test_model_negatives_replace_rejected_only_with_wrong_finished_answers(tok, monkeypatch):
    import nanoeuler.training.dpo_data as dd
    from nanoeuler.training.dpo import model_negatives
    answers = {"q0=": (b"Hamlet", True), "q1=": (b"Lear", True), "q2=": (b"Lear", False), "q3=": (b"hamlet.", True)}

    def fake_answers(model, prompts, stop_ids, max_new_tokens, progress):
        assert stop_ids == tok.stop_ids
        out = [answers[bytes(ids).decode()] for ids in prompts]
        return [(list(text), stopped) for text, stopped in out]

    monkeypatch.setattr(dd, "model_answers", fake_answers)
    pairs = [{"prompt": f"q{i}=", "chosen": "Hamlet", "rejected": "Othello", "task": "speaker"} for i in range(4)]
    pairs.append({"prompt": "q9=", "chosen": "a line", "rejected": "another", "task": "continue"})
    out, n = model_negatives(Model.init(TINY, seed=0), tok, pairs, progress=False)
    assert n == 1 and out[1]["rejected"] == "Lear" and out[1]["rejected_source"] == "model"
    assert [p["rejected"] for p in out] == ["Othello", "Lear", "Othello", "Othello", "another"]  # right / unfinished kept


def test_model_answers_in_a_batch_equal_generate_one_by_one():
    """The batched answers (continuous batching, 40 prompts > one batch of 32) are each prompt's greedy
    `generate` output, cut at the first of the stop ids (two: eos and an end of turn, as Gemma's template
    ends a reply with <end_of_turn>, where only eos once stopped them), in the prompts' order."""
    from nanoeuler.training.dpo_data import model_answers
    from nanoeuler.infer.session import generate
    model = Model.init(TINY, seed=3)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, TINY.vocab_size, size=int(rng.integers(1, TINY.ctx_len + 8))).tolist() for _ in range(40)]
    counts = np.bincount(np.concatenate([generate(model, p, 6, temperature=0).ids for p in prompts[:8]]))
    stops = [int(t) for t in np.argsort(counts)[-2:]]                  # the two most frequent greedy tokens
    got = model_answers(model, prompts, stops, max_new_tokens=6, progress=False)
    want = [generate(model, p[-TINY.ctx_len:], 6, temperature=0, stop_ids=stops) for p in prompts]
    assert [ids for ids, _ in got] == [[t for t in g.ids if t not in stops] for g in want]
    assert model_answers(model, prompts, stops[:1], max_new_tokens=6, progress=False) != got   # both count
    assert [stopped for _, stopped in got] == [g.stopped for g in want]
    assert any(stopped for _, stopped in got) and not all(stopped for _, stopped in got)


def test_offline_pairs_validate_on_a_val_file_when_given(tmp_path):
    """`dpo --data offline --val FILE` validated on the offline held-out pairs and ignored the file."""
    from nanoeuler.training.dpo_data import offline_pairs, pair_records
    own_train, own_held = offline_pairs()
    val = tmp_path / "val.jsonl"
    val.write_text("".join(json.dumps(p) + "\n" for p in own_train[:3]))
    train, held, data_id, bad = pair_records("offline", str(val), None)
    assert held == load_pairs(val)[0] and len(held) == 3 != len(own_held) and bad == 0
    assert train == own_train and data_id != pair_records("offline", None, None)[2]
