"""tie_embeddings (arch euler): head 0 IS the token embedding — one matrix in memory, in the checkpoint and in
training, its gradient the sum of both uses (as arch gpt2 ties); tied imports (GGUF without `output`, HF
tie_word_embeddings) stay tied and export tied."""
from __future__ import annotations

import numpy as np
import pytest
from conftest import rel_err

from nanoeuler import Model
from nanoeuler.config import Config

CFG = Config(vocab_size=61, dim=16, n_heads=4, n_kv_heads=2, n_layers=2, ctx_len=12, ffn_hidden=24, n_mtp=2,
             tie_embeddings=True)


def tied_and_untied(dtype=np.float64):
    m = Model.init(CFG, seed=0)
    rng = np.random.default_rng(0)
    P = {n: (a + 0.1 * rng.standard_normal(a.shape)).astype(dtype) for n, a in m.params.items()}
    U = dict(P, **{"heads.0.weight": P["embed.weight"].copy()})
    return P, U


def test_config_has_no_head0_and_fewer_parameters():
    untied = CFG.replace(tie_embeddings=False)
    assert "heads.0.weight" not in CFG.param_shapes() and "heads.1.weight" in CFG.param_shapes()
    assert untied.n_params() - CFG.n_params() == 61 * 16
    assert Config.from_dict(CFG.to_dict()) == CFG and "tie_embeddings" not in untied.to_dict()
    from nanoeuler.errors import UserError
    with pytest.raises(UserError, match="tie_embeddings"):
        Config.from_dict(CFG.to_dict() | {"tie_embeddings": "yes"})


def test_reference_gradient_is_the_sum_of_both_uses_and_matches_finite_differences():
    from nanoeuler import model as M
    P, U = tied_and_untied()
    untied = CFG.replace(tie_embeddings=False)
    inputs = np.random.default_rng(1).integers(0, 61, (2, CFG.ctx_len))
    lt, ct = M.forward(CFG, P, inputs)
    lu, cu = M.forward(untied, U, inputs)
    assert np.array_equal(lt, lu)  # the same function
    dlogits = np.random.default_rng(2).standard_normal(lt.shape)
    gt, gu = M.backward(CFG, P, dlogits, ct), M.backward(untied, U, dlogits, cu)
    assert list(gt) == list(P)
    assert np.allclose(gt["embed.weight"], gu["embed.weight"] + gu["heads.0.weight"], rtol=1e-12, atol=1e-12)

    def f(Q):  # <dlogits, logits>: its gradient is what backward computes
        return float((M.forward(CFG, Q, inputs)[0] * dlogits).sum())
    for r, c in ((inputs[0, 0], 3), (5, 0), (60, 15)):  # a looked-up row, a row only the head uses, the last
        e = 1e-6
        Pp, Pm = ({**P, "embed.weight": P["embed.weight"].copy()} for _ in range(2))
        Pp["embed.weight"][r, c] += e
        Pm["embed.weight"][r, c] -= e
        assert abs((f(Pp) - f(Pm)) / (2 * e) - gt["embed.weight"][r, c]) < 1e-6


def test_fast_engine_equals_the_reference_on_a_tied_model():
    P, _ = tied_and_untied(np.float32)
    m = Model(CFG, P)
    tokens = np.random.default_rng(3).integers(0, 61, (4, CFG.ctx_len + CFG.n_mtp))
    loss_ref, obj_ref, g_ref = Model(CFG, {n: a.astype(np.float64) for n, a in P.items()}).loss_and_grads(
        tokens, reference=True)
    loss, obj, g = m.loss_and_grads(tokens)
    assert list(g) == list(P) and abs(loss - loss_ref) < 1e-5 and abs(obj - obj_ref) < 1e-5
    for n in P:
        assert rel_err(g[n], g_ref[n]) < 1e-4, n


def test_checkpoint_holds_one_matrix_and_decoding_matches_the_reference(tmp_path):
    from safetensors.numpy import load_file

    from nanoeuler.infer.session import generate
    P, _ = tied_and_untied(np.float32)
    Model(CFG, P).save(tmp_path / "run")
    assert "heads.0.weight" not in load_file(str(tmp_path / "run" / "model.safetensors"))
    back = Model.load(tmp_path / "run")
    assert back.config.tie_embeddings and set(back.params) == set(P)
    ids = generate(back, [1, 2, 3], 6, temperature=0, mode="cache").ids
    ref = [1, 2, 3]
    for _ in range(6):  # greedy on the reference forward, one token at a time
        ref.append(int(back.logits(np.array([ref]))[0, 0, -1].argmax()))
    assert ids == ref[3:]


def test_tied_gguf_and_hf_imports_stay_tied_and_export_tied(tmp_path):
    pytest.importorskip("gguf")
    from gguf_fixtures import chatml_model, chatml_tokenizer, write_gguf

    from nanoeuler.interop.gguf_export import gguf_tensors
    from nanoeuler.interop.gguf_import import load_gguf
    from nanoeuler.interop.hf import export_hf
    from nanoeuler.interop.hf import load_hf_folder
    tok = chatml_tokenizer()
    m = chatml_model(tok, tied=True)
    cfg, P, _, _ = load_gguf(write_gguf(tmp_path / "t.gguf", m, tok))
    assert cfg == m.config and cfg.tie_embeddings and "heads.0.weight" not in P
    assert cfg.n_params() == cfg.replace(tie_embeddings=False).n_params() - cfg.vocab_size * cfg.dim
    tied = Model(cfg, P)
    assert "output.weight" not in gguf_tensors(tied)
    export_hf(tied, tok, tmp_path / "hf", progress=False)
    import json
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["tie_word_embeddings"] is True
    cfg2, P2, _ = load_hf_folder(tmp_path / "hf")
    assert cfg2 == cfg and set(P2) == set(P) and all(np.array_equal(P2[n], P[n]) for n in P)


def test_dpo_fast_engine_gives_the_reference_gradients_on_a_tied_model():
    from nanoeuler.training.dpo import Workspaces, dpo_loss_and_grads, make_batch
    P, _ = tied_and_untied(np.float64)
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, 61, n) for n in (9, 12, 7, 11)]
    masks = [np.arange(len(s)) >= 3 for s in seqs]
    batch = make_batch(seqs[:2], masks[:2], seqs[2:], masks[2:], length=CFG.ctx_len)
    rc, rr = rng.normal(-30, 5, 2), rng.normal(-30, 5, 2)
    l1, _, g1 = dpo_loss_and_grads(CFG, P, batch, rc, rr, 0.1)
    l2, _, g2 = dpo_loss_and_grads(CFG, P, batch, rc, rr, 0.1, Workspaces(CFG, np.float64))
    assert l2 == pytest.approx(l1, rel=1e-12) and "embed.weight" in g1 and g1.keys() == g2.keys()
    for name in g1:
        assert np.max(np.abs(g1[name] - g2[name])) <= 1e-12 * np.max(np.abs(g1[name])), name
