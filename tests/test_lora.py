"""LoRA: the op, the model with adapters (reference vs fast vs finite differences), and adapter runs."""
import json

import numpy as np
import pytest

from conftest import rel_err, tiny_config
from nanoeuler import adapters as ad
from nanoeuler import ops
from nanoeuler.fast import bf16
from nanoeuler.training.check import GPT2_CHECK_CONFIG, TOLERANCE, check_lora
from nanoeuler.errors import UserError
from nanoeuler.training.lora import LoraModel
from nanoeuler.model import Model


SAVE_ALL = ("lm_head", "mtp_heads", "norm")


def lora_model(arch="euler", dtype=np.float64, seed=0, rank=4, targets=None, trained=True, dropout=0.0, save=()):
    cfg = tiny_config(arch=arch)
    base = Model.init(cfg, seed=seed, dtype=dtype)
    lcfg = ad.LoraConfig(rank, 2.0 * rank, targets or cfg.spec.lora_defaults, dropout, save)
    adapters = ad.init_adapters(cfg, lcfg, seed, dtype, base.params)
    if trained:
        rng = np.random.default_rng(seed + 1)
        for a in adapters.values():
            a += (rng.standard_normal(a.shape) * 0.1).astype(dtype)
    return LoraModel(base, lcfg, adapters, {"path": "", "sha256": ""})


def batch(cfg, B=3, seed=2):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, cfg.vocab_size, (B, cfg.ctx_len + cfg.n_mtp))
    return tokens, rng.random(tokens.shape) > 0.2


def test_lora_op_equals_merged_linear_and_its_check_rows_pass():
    rng = np.random.default_rng(0)
    x, W, A, B = rng.standard_normal((2, 5, 8)), rng.standard_normal((6, 8)), rng.standard_normal((3, 8)), \
        rng.standard_normal((6, 3))
    y, _ = ops.lora_forward(x, W, A, B, 1.5)
    assert rel_err(y, x @ ops.lora_merge(W, A, B, 1.5).T) < 1e-13
    from nanoeuler.training.check import check_ops
    rows = [r for r in check_ops(seed=3) if r.name.startswith("op lora")]
    assert len(rows) == 6 and max(r.max_rel_error for r in rows) < TOLERANCE


@pytest.mark.parametrize("config,dropout,save", [(None, 0.0, ()), (GPT2_CHECK_CONFIG, 0.0, ()), (None, 0.25, ()),
                                                 (None, 0.25, SAVE_ALL)])
def test_adapter_gradients_match_finite_differences(config, dropout, save):
    """Every adapter, and (save) every tensor trained whole beside them: the 3 heads and the 5 norms."""
    kw = {"config": config} if config is not None else {}
    rows = check_lora(seed=1, n_samples=8, dropout=dropout, modules_to_save=save, **kw)
    assert len(rows) == 2 * 2 * (4 if config is not None else 7) + (3 + 5 if save else 0)
    assert {r.name.split(": ")[1] for r in rows} >= ({"heads.2.weight", "norm.weight"} if save else set())
    assert max(r.max_rel_error for r in rows) < TOLERANCE, max(rows, key=lambda r: r.max_rel_error)


@pytest.mark.parametrize("arch,parts,p,save,rows", [
    ("euler", 1, 0.0, (), 0), ("euler", 3, 0.0, (), 0), ("gpt2", 1, 0.0, (), 0), ("gpt2", 3, 0.0, (), 0),
    ("euler", 3, 0.3, (), 0), ("gpt2", 2, 0.3, (), 0), ("euler", 1, 0.0, SAVE_ALL, 0), ("euler", 3, 0.3, SAVE_ALL, 0),
    ("euler", 2, 0.3, SAVE_ALL, 3), ("gpt2", 2, 0.0, (), 5)])
def test_fast_step_equals_reference_step(arch, parts, p, save, rows, monkeypatch):
    """The fused step (adapters applied on the fly, their gradients from each linear's dy and x, no dW) in
    1..3 parts = the reference, adapter dropout included (the same masks by batch row in every part), and
    the gradients of the modules trained whole (save: heads and norms, summed over the parts). rows: the
    heads' logits formed that many rows at a time (the saved heads' gradients summed over the chunks)."""
    from nanoeuler.fast import engine, parallel
    monkeypatch.setattr(parallel, "PARTS", parts)
    m = lora_model(arch, dropout=p, save=save)
    if rows:
        monkeypatch.setattr(engine, "LOGITS_BYTES", rows * m.config.vocab_size * 8)
    tokens, mask = batch(m.config)
    adrop = ops.Dropout(p, seed=11) if p else None
    h1, o1, g1 = m.loss_and_grads(tokens, mask, reference=True, adapter_dropout=adrop)
    h2, o2, g2 = m.loss_and_grads(tokens, mask, adapter_dropout=adrop)
    assert len(m._ws.parts) == parts and m._ws.logits_rows == (rows or m.config.ctx_len * -(-3 // parts))
    assert abs(o1 - o2) < 1e-12 and abs(h1 - h2) < 1e-12
    assert set(g1) == set(g2) == set(m.params)
    for name in g1:
        assert rel_err(g2[name], g1[name]) < 1e-10, name
    if p:   # the masks matter: without them the step differs
        assert abs(m.loss_and_grads(tokens, mask)[1] - o2) > 1e-6


@pytest.mark.parametrize("arch", ["euler", "gpt2"])
def test_adapter_dropout_ends_with_its_step(arch):
    """Adapter dropout is set for one step only: loss() after a step with it is the loss() before (the step
    changes no parameter) and the merged model's, with no dropout mask."""
    m = lora_model(arch, dropout=0.3)
    tokens, mask = batch(m.config)
    before = m.loss(tokens, mask)
    m.loss_and_grads(tokens, mask, adapter_dropout=ops.Dropout(0.3, seed=11))
    assert m.loss(tokens, mask) == before
    assert before[1] == pytest.approx(m.merged().loss(tokens, mask)[1], abs=1e-12)


@pytest.mark.parametrize("arch", ["euler", "gpt2"])
def test_fast_step_keeps_its_workspace_and_no_weight_sized_buffers(arch, monkeypatch):
    """One workspace from step to step (it held the precision in its key, and every step rebuilt it), the
    frozen weights stacked once (not every step), no merged weight copies, no gradient buffer of the frozen
    embedding in any part."""
    from nanoeuler.fast import engine
    stack = engine._stack_weights
    calls = []
    monkeypatch.setattr(engine, "_stack_weights", lambda *a: calls.append(stack(*a)))
    m = lora_model(arch)
    tokens, mask = batch(m.config)
    m.loss_and_grads(tokens, mask)
    ws = m._ws
    m.loss_and_grads(tokens, mask)
    m.loss(tokens, mask)
    assert m._ws is ws
    assert len(calls) == 1
    assert all("embed.weight" not in g for g in ws.lora)
    assert all(w.grads is None or w.grads is g for w, g in zip(ws.parts, ws.lora))


@pytest.mark.parametrize("arch,parts,p", [("euler", 1, 0.0), ("gpt2", 2, 0.0), ("euler", 2, 0.3)])
def test_fast_step_forms_six_adapter_products_per_module(arch, parts, p, monkeypatch):
    """u = s·x̃·Aᵀ (forward) is reused by the adapter gradients and du = s·dy·B (gradients) by dx: a step
    makes 6 products per module and part (it made 8), plus the 2 of the forward again for the modules of the
    MLP's input product, which backward forms again (a lean workspace); its gradients are still the reference's."""
    import sys
    from nanoeuler.fast import parallel
    monkeypatch.setattr(parallel, "PARTS", parts)
    m = lora_model(arch, dropout=p)
    tokens, mask = batch(m.config)
    adrop = ops.Dropout(p, seed=11) if p else None
    m.loss_and_grads(tokens, mask)                                      # builds the workspace
    ws, calls = m._ws, []
    mm = ws.mm

    def counted(a, b, out):
        calls.append(sys._getframe(1).f_globals["__name__"] == "nanoeuler.training.lora")
        return mm(a, b, out)
    ws.mm = counted
    _, o, g = m.loss_and_grads(tokens, mask, adapter_dropout=adrop)
    mlp_in = [mod for mod, (bases, _) in m.modules.items() if any(".ffn.gate" in b or ".ffn.up" in b or ".ffn.fc" in b
                                                                for b in bases)]
    assert ws.lean and sum(calls) == (6 * len(m.modules) + 2 * len(mlp_in)) * parts
    _, o_ref, g_ref = m.loss_and_grads(tokens, mask, reference=True, adapter_dropout=adrop)
    assert abs(o - o_ref) < 1e-12
    assert all(rel_err(g[n], g_ref[n]) < 1e-10 for n in g_ref)


@pytest.mark.parametrize("arch", ["euler", "gpt2"])
def test_bf16_workspace_keeps_no_stacked_weight_copy(arch):
    """bf16 products read the packed weights: the workspace holds no stacked copy of q|k|v (nor gate|up),
    formed only while packed (GPT-2 124 M: 81 MiB less); the step's loss is still the float32 one, to bf16
    rounding."""
    m = lora_model(arch).set_precision("bf16")
    tokens, mask = batch(m.config)
    _, o_bf16, g_bf16 = m.loss_and_grads(tokens, mask)
    ws = m._ws
    cfg = m.config
    stacked = {(cfg.n_layers, (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim, cfg.dim),
               (cfg.n_layers, 2 * cfg.ffn_hidden, cfg.dim)}
    assert not [n for n, a in vars(ws).items() if isinstance(a, np.ndarray) and a.shape in stacked]
    assert not ws.stacks and {ws.products[0]["qkv"], ws.products[-1]["qkv"]} <= set(ws.packs)
    _, o_f32, _ = lora_model(arch).loss_and_grads(tokens, mask)
    assert abs(o_bf16 - o_f32) < 0.05 * abs(o_f32)                     # bf16 rounding, not a different model


def test_bf16_step_repacks_the_heads_it_trains():
    """The frozen weights are packed once for the run, but a head trained whole changes every step: the
    next step must read its new values (a fresh workspace gives the same loss and gradients)."""
    m = lora_model(save=("lm_head", "mtp_heads")).set_precision("bf16")
    tokens, mask = batch(m.config)
    m.loss_and_grads(tokens, mask)
    for k in range(m.config.n_mtp):
        m.params[f"heads.{k}.weight"] += 0.5                             # in place, as AdamW updates
    _, o, g = m.loss_and_grads(tokens, mask)
    fresh = LoraModel(m.base, m.lcfg, m.params, m.base_ref).set_precision("bf16")
    _, o_fresh, g_fresh = fresh.loss_and_grads(tokens, mask)
    assert o == o_fresh and all(np.array_equal(g[n], g_fresh[n]) for n in g)


def test_modules_to_save_are_copies_and_merge_equals_the_step():
    """A saved module trains a copy (the base, DPO's reference, is untouched); the merged model computes
    what the step computes; the weights neither adapted nor saved are shared, not copied."""
    m = lora_model(save=SAVE_ALL)
    tokens, mask = batch(m.config)
    saved = ad.saved_names(m.config, m.lcfg)
    cfg = m.config
    assert len(saved) == 2 * cfg.n_layers + 1 + cfg.n_mtp and all(m.params[n] is not m.base.params[n] for n in saved)
    assert all(m.policy.params[n] is m.params[n] for n in saved)
    merged = m.merged()
    assert merged.loss(tokens, mask)[1] == pytest.approx(m.reference_objective(tokens, mask)[1], abs=1e-12)
    assert merged.loss(tokens, mask)[1] == pytest.approx(m.loss(tokens, mask)[1], abs=1e-12)
    assert all(np.array_equal(merged.params[n], m.params[n]) for n in saved)
    assert merged.params["embed.weight"] is m.base.params["embed.weight"]
    assert abs(m.base.loss(tokens, mask)[1] - m.loss(tokens, mask)[1]) > 1e-3   # the copies matter


def test_fresh_adapters_are_the_base_and_only_b_moves_first():
    m = lora_model(trained=False)
    tokens, mask = batch(m.config)
    head0, objective, grads = m.loss_and_grads(tokens, mask)
    assert objective == pytest.approx(m.base.loss(tokens, mask)[1], abs=1e-12)
    assert all(not g.any() for n, g in grads.items() if n.endswith("lora_A"))   # B = 0: dA = s·Bᵀ·G = 0
    assert all(g.any() for n, g in grads.items() if n.endswith("lora_B"))


def test_merged_model_computes_what_the_adapters_compute():
    m = lora_model("gpt2")
    tokens, mask = batch(m.config)
    assert m.merged().loss(tokens, mask)[1] == pytest.approx(m.reference_objective(tokens, mask)[1], abs=1e-12)
    frozen = {n for n in m.base.params if not any(n in b for b, _ in m.modules.values())}
    merged = m.merged().params
    assert all(merged[n] is m.base.params[n] for n in frozen)          # unadapted weights shared, not copied


@pytest.mark.parametrize("arch,save,rows", [("euler", (), 0), ("gpt2", (), 0), ("euler", ("lm_head", "norm"), 0),
                                            ("euler", ("lm_head", "norm"), 3)])
def test_dpo_lora_step_forms_the_adapter_gradients_of_the_merged_model(arch, save, rows, monkeypatch):
    """DPO's LoRA step (adapters on the fly, no weight gradient formed) gives what the merged model's weight
    gradients G give through W' = W + s·B·A: dB = s·G·Aᵀ, dA = s·Bᵀ·G (a stacked module: G stacked), and
    a saved module's tensors their G (rows: the head's logits 3 rows at a time, its gradient summed)."""
    from nanoeuler.training.dpo import Workspaces, dpo_loss_and_grads
    from nanoeuler.training.dpo_data import PairBatch
    from nanoeuler.fast import engine
    m = lora_model(arch, save=save)
    if rows:
        monkeypatch.setattr(engine, "LOGITS_BYTES", rows * m.config.vocab_size * 8)
    cfg, s = m.config, m.lcfg.scale
    rng = np.random.default_rng(4)
    inputs = rng.integers(0, cfg.vocab_size, (4, cfg.ctx_len))
    pairs = PairBatch(inputs, np.roll(inputs, -1, axis=1), rng.random(inputs.shape) > 0.3, 2)
    ref_c, ref_r = np.array([-20.0, -15.0]), np.array([-18.0, -21.0])
    loss1, _, g = dpo_loss_and_grads(cfg, m.policy.params, pairs, ref_c, ref_r, 0.1,
                                     Workspaces(cfg, np.float64, lora=m))
    loss2, _, G = dpo_loss_and_grads(cfg, m.merged().params, pairs, ref_c, ref_r, 0.1, Workspaces(cfg, np.float64))
    assert loss1 == pytest.approx(loss2, abs=1e-12) and set(g) == set(m.params)
    for module, (bases, _) in m.modules.items():
        A, B = m.params[module + ".lora_A"], m.params[module + ".lora_B"]
        Gm = np.concatenate([G[b] for b in bases])                         # [Σ out, in]
        assert rel_err(g[module + ".lora_B"], s * Gm @ A.T) < 1e-10, module
        assert rel_err(g[module + ".lora_A"], s * B.T @ Gm) < 1e-10, module
    assert all(rel_err(g[n], G[n]) < 1e-10 for n in m.whole) and len(m.whole) == (2 * cfg.n_layers + 2 if save else 0)


@pytest.mark.parametrize("adapter_dropout", [None, 0.2])
def test_rank_shares_sum_to_the_whole_batch(adapter_dropout):
    """Data parallel: each rank's rows with the whole batch's target counts give losses and gradients that
    sum to the whole batch's (the fast path, and the reference path that adapter dropout runs)."""
    from nanoeuler.training.train import LMObjective, TrainConfig
    m = lora_model(dropout=adapter_dropout or 0.0)
    obj = LMObjective(m, None, TrainConfig(dropout=0.0))
    tokens, mask = batch(m.config, B=4)
    seed = 7 if adapter_dropout else None
    whole_loss, _, whole = obj.loss_and_grads((tokens, mask, seed))
    parts = [obj.loss_and_grads(obj.share((tokens, mask, seed), r, 2)) for r in range(2)]
    assert sum(p[0] for p in parts) == pytest.approx(whole_loss, abs=1e-12)
    for name in whole:
        assert rel_err(parts[0][2][name] + parts[1][2][name], whole[name]) < 1e-10, name


@pytest.fixture(scope="module")
def tok():
    from nanoeuler.data.corpus import bundled_works
    from nanoeuler.tokenizer import Tokenizer
    return Tokenizer.train([bundled_works()["hamlet"][:30000]], 300, progress=False)


def sft_setup(tmp_path, tok, arch="euler"):
    import json

    from nanoeuler.training.sft import offline_instructions
    cfg = tiny_config(vocab_size=tok.vocab_size, ctx_len=160, arch=arch)
    Model.init(cfg, seed=0).save(tmp_path / "base", tokenizer=tok)
    train, held = offline_instructions(n_train=40, n_heldout=8)
    (tmp_path / "sft.json").write_text(json.dumps(train))
    (tmp_path / "val.json").write_text(json.dumps(held))
    return ["sft", "--base", str(tmp_path / "base"), "--data", str(tmp_path / "sft.json"), "--val",
            str(tmp_path / "val.json"), "--steps", "4", "--batch-size", "2", "--lr", "0.01", "--eval-every", "2",
            "--no-progress", "--json"]


@pytest.mark.parametrize("arch,extra", [
    ("euler", []), ("gpt2", ["--lora-dropout", "0.1", "--lora-targets", "c_attn"]),
    ("euler", ["--lora-modules-to-save", "lm_head,mtp_heads,norm", "--lora-targets", "q,v"]),
    pytest.param("euler", ["--precision", "bf16", "--lora-dropout", "0.1"],
                 marks=pytest.mark.skipif(not bf16.AVAILABLE, reason="this CPU has no AVX512_BF16"))])
def test_sft_lora_trains_adapters_only_and_resumes_bit_for_bit(tmp_path, tok, capsys, arch, extra):
    import json

    from nanoeuler.checkpoint import read_tensors
    from nanoeuler.cli import main
    common = sft_setup(tmp_path, tok, arch)
    assert main(common + ["--lora", "4", "--out", str(tmp_path / "a")] + extra) == 0
    assert main(common + ["--lora", "4", "--out", str(tmp_path / "b"), "--stop-after", "2"] + extra) == 0
    assert main(common + ["--out", str(tmp_path / "b"), "--resume"]) == 0          # an adapter run: found, not told
    capsys.readouterr()
    a, b = tmp_path / "a", tmp_path / "b"
    assert not (a / "model.safetensors").exists() and (a / "lora.json").exists()
    ta, tb = read_tensors(a / "adapter.safetensors", "a"), read_tensors(b / "adapter.safetensors", "b")
    assert all(np.array_equal(ta[n], tb[n]) for n in ta) and any(ta[n].any() for n in ta if "lora_B" in n)
    opt = read_tensors(a / "optimizer.safetensors", "opt")
    assert set(opt) == {f"{k}.{n}" for k in ("m", "v") for n in ta}               # moments of the adapters only
    assert json.loads((b / "trainer.json").read_text())["precision"] == ("bf16" if "bf16" in extra else "f32")
    # the adapter run loads as the merged model, and `lora merge` writes exactly that
    base = Model.load(tmp_path / "base")
    merged = Model.load(a, read_only=True)
    assert main(["lora", "merge", "--ckpt", str(a), "--out", str(tmp_path / "m")]) == 0
    written = Model.load(tmp_path / "m")
    assert all(np.array_equal(written.params[n], merged.params[n]) for n in merged.params)
    changed = {n for n in base.params if not np.array_equal(base.params[n], merged.params[n])}
    saved = {n for n in ta if not n.endswith(("lora_A", "lora_B"))}     # modules_to_save: whole copies
    assert {n for n in changed if not (".attn." in n or ".ffn." in n)} == saved
    assert saved == (set() if "--lora-modules-to-save" not in extra else
                     {"heads.0.weight", "heads.1.weight", "norm.weight", "layers.0.attn_norm.weight",
                      "layers.0.ffn_norm.weight"})
    assert main(["sample", "--ckpt", str(a), "--prompt", "To be", "--max-new-tokens", "3"]) == 0
    capsys.readouterr()
    assert main(["info", str(a), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["trainable_params"] == sum(t.size for t in ta.values())


def test_adapter_run_refuses_a_changed_base_and_mismatched_resume(tmp_path, tok, capsys):
    from nanoeuler.cli import main
    common = sft_setup(tmp_path, tok)
    assert main(common + ["--lora", "4", "--out", str(tmp_path / "a"), "--stop-after", "1"]) == 0
    assert main(common + ["--out", str(tmp_path / "a"), "--resume", "--lora", "8"]) == 2
    assert "different LoRA settings" in capsys.readouterr().err
    assert main(common + ["--out", str(tmp_path / "a"), "--resume", "--lora", "4", "--stop-after", "1"]) == 0
    base = Model.load(tmp_path / "base")
    base.params["embed.weight"][0, 0] += 1.0
    base.save(tmp_path / "base", tokenizer=tok)
    capsys.readouterr()
    assert main(["sample", "--ckpt", str(tmp_path / "a"), "--prompt", "To be", "--max-new-tokens", "2"]) == 2
    assert "changed since the adapters were trained" in capsys.readouterr().err
    assert main(["sft", "--base", str(tmp_path / "a"), "--lora", "4", "--out", str(tmp_path / "c")]) == 2
    assert "is an adapter run" in capsys.readouterr().err
    assert main(["export", "--ckpt", str(tmp_path / "base"), "--format", "peft", "--out", str(tmp_path / "p")]) == 2
    assert "has no lora.json" in capsys.readouterr().err
    assert main(["lora", "merge", "--ckpt", str(tmp_path / "a"), "--out", str(tmp_path / "base")]) == 2
    assert "--force" in capsys.readouterr().err      # an existing checkpoint is not replaced unasked
    assert main(["sft", "--base", str(tmp_path / "base"), "--lora-alpha", "3", "--out", str(tmp_path / "d")]) == 2
    assert "need --lora R" in capsys.readouterr().err
    assert main(["sft", "--base", str(tmp_path / "base"), "--lora", "2", "--lora-targets", "c_attn",
                 "--out", str(tmp_path / "e")]) == 2
    assert "the targets of arch euler are q,k,v,o,gate,up,down" in capsys.readouterr().err


def test_lora_modules_to_save_refusals(tmp_path, tok, capsys):
    """What cannot be saved is refused in one line: a head tied to the embedding, an unknown module, MTP heads
    on a K = 1 model or in dpo, the flag without --lora; gguf-lora cannot carry them."""
    import dataclasses

    from nanoeuler.cli import main
    cfg = tiny_config(vocab_size=tok.vocab_size, ctx_len=160)
    for name, c in (("tied", dataclasses.replace(cfg, tie_embeddings=True)), ("k1", dataclasses.replace(cfg, n_mtp=1))):
        Model.init(c, seed=0).save(tmp_path / name, tokenizer=tok)
    common = sft_setup(tmp_path, tok)
    for base, saved, needle in (("tied", "lm_head", "output head is its embedding (tied)"),
                                ("tied", "norm,norm", "a module given twice"),
                                ("k1", "mtp_heads", "no multi-token heads"),
                                ("base", "head", "head: choose from lm_head,mtp_heads,norm")):
        args = common + ["--base", str(tmp_path / base), "--lora", "2", "--lora-modules-to-save", saved]
        assert main(args + ["--out", str(tmp_path / "x")]) == 2, saved
        err = capsys.readouterr().err
        assert needle in err and err.count("\n") == 1, err
    assert main(common + ["--lora-modules-to-save", "lm_head", "--out", str(tmp_path / "y")]) == 2
    assert "need --lora R" in capsys.readouterr().err
    assert main(common + ["--lora", "2", "--lora-modules-to-save", "lm_head,norm", "--stop-after", "1",
                          "--out", str(tmp_path / "a")]) == 0
    capsys.readouterr()
    assert main(["export", "--ckpt", str(tmp_path / "a"), "--format", "gguf-lora", "--out", str(tmp_path / "a.gguf")]) == 2
    assert "cannot carry (A/B pairs only)" in capsys.readouterr().err and not (tmp_path / "a.gguf").exists()
    meta = json.loads((tmp_path / "a" / "lora.json").read_text())
    for bad in ([1], "lm_head", {"x": 1}):    # a hand-edited lora.json: one line, no traceback
        (tmp_path / "a" / "lora.json").write_text(json.dumps(meta | {"modules_to_save": bad}))
        assert main(["sample", "--ckpt", str(tmp_path / "a"), "--prompt", "To be", "--max-new-tokens", "1"]) == 2, bad
        err = capsys.readouterr().err
        assert err.startswith("error:") and "lora.json: modules_to_save" in err and err.count("\n") == 1, err


@pytest.mark.parametrize("field, value, needle", [
    ("rank", 500, "rank must be in [1, 16], got 500"),          # was: "--lora must be in [1, 16] ..."
    ("rank", "4", "rank must be an integer, got '4'"),          # was: accepted as 4
    ("rank", 4.5, "rank must be an integer, got 4.5"),          # was: accepted as 4
    ("rank", True, "rank must be an integer, got True"),
    ("alpha", "8", "alpha must be a number, got '8'"),
    ("alpha", -1.0, "alpha must be > 0, got -1.0"),
    ("dropout", 1.5, "dropout must be in [0, 1), got 1.5"),
    ("targets", ["q", "x"], "targets: x: the targets of arch euler are"),
    ("targets", "q,v", "targets must be a list of names, got 'q,v'"),
    ("base", {"path": 3, "sha256": "0"}, "base must be"),
])
def test_a_bad_lora_json_names_the_file_and_field_not_a_flag(tmp_path, tok, capsys, field, value, needle):
    """A hand-edited lora.json is refused in one line naming the file and the field (it named --lora flags
    the run was never given) and keeps each field's JSON type (a string rank "4" was taken as 4)."""
    from nanoeuler.checkpoint import save_files
    from nanoeuler.cli import main
    Model.init(tiny_config(vocab_size=tok.vocab_size), seed=0).save(tmp_path / "base", tokenizer=tok)
    save_files(tmp_path / "a", LoraModel.new(tmp_path / "base", ad.LoraConfig(2, 4.0), seed=0).checkpoint_writers(tok))
    meta = json.loads((tmp_path / "a" / "lora.json").read_text())
    (tmp_path / "a" / "lora.json").write_text(json.dumps(meta | {field: value}))
    for argv in (["sample", "--ckpt", str(tmp_path / "a"), "--prompt", "To be", "--max-new-tokens", "1"],
                 ["info", str(tmp_path / "a")]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"{tmp_path / 'a' / 'lora.json'}: {needle}" in err, err
        assert "--lora" not in err
    with pytest.raises(UserError, match="lora.json"):
        LoraModel.load(tmp_path / "a")


def test_sft_lora_two_ranks_equal_one_process(tmp_path, tok):
    """MPI data parallel unchanged: only the adapters' gradients are reduced (and those of the modules saved
    whole beside them); 2 ranks = 1 process."""
    pytest.importorskip("mpi4py")
    from safetensors.numpy import load_file
    from test_dist import MPIEXEC, mpirun, ok, one
    if MPIEXEC is None:
        pytest.skip("no mpiexec")
    common = sft_setup(tmp_path, tok) + ["--lora", "4", "--batch-size", "4", "--lora-modules-to-save", "lm_head,norm"]
    ok(one(common + ["--out", "one"], tmp_path))
    ok(mpirun(2, common + ["--out", "two"], tmp_path))
    a, b = (load_file(str(tmp_path / run / "adapter.safetensors")) for run in ("one", "two"))
    base = Model.load(tmp_path / "base").params
    assert a.keys() == b.keys() and {"heads.0.weight", "norm.weight"} <= a.keys()
    assert max(rel_err(b[n] - base.get(n, 0), a[n] - base.get(n, 0), floor=0.01) for n in a if not n.endswith("lora_A")) < 1e-4
    assert any(a[n].any() for n in a if n.endswith("lora_B"))
    assert not np.array_equal(a["heads.0.weight"], base["heads.0.weight"])


def test_dpo_lora_reference_is_the_base_and_resumes_bit_for_bit(tmp_path, capsys):
    """dpo --lora: the policy starts as the base (DPO loss log 2), only adapters train, resume is bitwise."""
    import json

    from nanoeuler.checkpoint import read_tensors
    from nanoeuler.cli import main
    from nanoeuler.tokenizer import Tokenizer
    from test_dpo import TINY, _pairs
    sft = tmp_path / "sft"
    Model.init(TINY, seed=0).save(sft, Tokenizer([]))
    f, v = tmp_path / "pairs.jsonl", tmp_path / "val.jsonl"
    f.write_text("".join(json.dumps(p) + "\n" for p in _pairs(20)))
    v.write_text("".join(json.dumps(p) + "\n" for p in _pairs(6, 500)))
    common = ["dpo", "--sft", str(sft), "--data", str(f), "--val", str(v), "--steps", "4", "--batch-size", "4",
              "--lr", "0.01", "--eval-every", "2", "--no-progress", "--json", "--lora", "4", "--lora-targets", "q,v"]
    assert main(common + ["--out", str(tmp_path / "a")]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["initial_eval"]["val_loss"] == pytest.approx(np.log(2)) and out["step"] == 4
    assert main(common + ["--out", str(tmp_path / "b"), "--stop-after", "2"]) == 0
    assert main(common + ["--out", str(tmp_path / "b"), "--resume"]) == 0
    for name in ("adapter.safetensors", "optimizer.safetensors", "reference.safetensors"):
        ta, tb = read_tensors(tmp_path / "a" / name, "a"), read_tensors(tmp_path / "b" / name, "b")
        assert ta.keys() == tb.keys() and all(np.array_equal(ta[k], tb[k], equal_nan=True) for k in ta), name
    adapters = read_tensors(tmp_path / "a" / "adapter.safetensors", "a")
    assert sorted(adapters) == sorted(f"layers.{i}.attn.{w}.lora_{m}" for i in range(2) for w in ("wq", "wv")
                                      for m in "AB")
    assert any(adapters[n].any() for n in adapters if n.endswith("lora_B"))


def test_train_init_from_lora_resumes_bit_for_bit(tmp_path, capsys):
    from nanoeuler.checkpoint import read_tensors
    from nanoeuler.cli import main
    from nanoeuler.data.corpus import bundled_works
    from nanoeuler.data.shards import prepare
    from nanoeuler.tokenizer import Tokenizer
    tok = Tokenizer([])
    (tmp_path / "book.txt").write_text(bundled_works()["hamlet"][:40000])
    prepare([tmp_path / "book.txt"], tok, tmp_path / "data", processes=1, progress=False)
    Model.init(tiny_config(vocab_size=257, ctx_len=16), seed=0).save(tmp_path / "base", tokenizer=tok)
    common = ["train", "--init-from", str(tmp_path / "base"), "--data", str(tmp_path / "data"), "--steps", "4",
              "--batch-size", "2", "--eval-every", "2", "--eval-batches", "1", "--no-progress", "--json",
              "--lora", "2", "--lora-dropout", "0.1"]
    assert main(common + ["--out", str(tmp_path / "a")]) == 0
    assert main(common + ["--out", str(tmp_path / "b"), "--stop-after", "3"]) == 0
    assert main(["train", "--data", str(tmp_path / "data"), "--out", str(tmp_path / "b"), "--resume",
                 "--no-progress", "--json"]) == 0
    for name in ("adapter.safetensors", "optimizer.safetensors"):
        ta, tb = read_tensors(tmp_path / "a" / name, "a"), read_tensors(tmp_path / "b" / name, "b")
        assert ta.keys() == tb.keys() and all(np.array_equal(ta[k], tb[k]) for k in ta), name
    capsys.readouterr()
    assert main(["train", "--data", str(tmp_path / "data"), "--out", str(tmp_path / "c"), "--lora", "2"]) == 2
    assert "--init-from" in capsys.readouterr().err


def test_info_lora_counts_trainable_parameters_and_step_memory(capsys):
    import json

    from nanoeuler.cli import main
    assert main(["info", "gpt2", "--batch", "4", "--ctx", "256", "--lora", "8", "--json"]) == 0
    lora = json.loads(capsys.readouterr().out)
    assert main(["info", "gpt2", "--batch", "4", "--ctx", "256", "--json"]) == 0
    full = json.loads(capsys.readouterr().out)
    # PEFT's count for GPT-2 r=8 on c_attn, c_proj, c_fc: 12 · 8 · (3072 + 1536 + 3840 + 3840)
    assert lora["trainable_params"] == 1_179_648
    assert lora["memory_bytes"]["optimizer"] == 8 * 1_179_648 and lora["memory_bytes"]["weights"] == \
        full["memory_bytes"]["weights"]
    assert lora["memory_bytes"]["total"] < 0.55 * full["memory_bytes"]["total"]


@pytest.mark.parametrize("precision", ["f32", "bf16"])
@pytest.mark.parametrize("lora", [False, True])
def test_mfu_counts_the_step_flops_against_the_peak_of_its_precision(precision, lora, monkeypatch):
    """The MFU a run reports: 6·N flops a token (4·N for LoRA: no dW of frozen weights) over the matmul peak of
    its precision (bf16: the bf16 kernels'), where it once counted 6·N against the float32 peak (3.5 "MFU"
    on a bf16 LoRA run of Gemma 3)."""
    from nanoeuler import perf
    from nanoeuler.training.train import LMObjective, TrainConfig
    monkeypatch.setattr(perf, "matmul_peak_flops", lambda: 1e11)
    monkeypatch.setattr(bf16, "peak_flops", lambda: 4e11)
    model = Model.init(tiny_config(), seed=0)
    if lora:
        model = LoraModel(model, ad.LoraConfig(2, 4.0).check(model.config),
                          ad.init_adapters(model.config, ad.LoraConfig(2, 4.0).check(model.config)),
                          {"path": "", "sha256": ""})
    model.precision = precision   # (the rate only reads it: no bf16 kernel runs)
    rates = LMObjective(model, None, TrainConfig(dropout=0.0)).rates(1000, 2.0)
    flops = (4 if lora else 6) * model.n_params() * 500
    assert rates["mfu"] == pytest.approx(flops / (4e11 if precision == "bf16" else 1e11))
