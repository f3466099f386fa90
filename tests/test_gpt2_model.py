"""arch "gpt2": the config (presets, names, validation) and the model (float64 finite differences of every
parameter, the tied head, init). Parity with transformers' GPT2LMHeadModel is in tests/test_gpt2_torch.py."""
import numpy as np
import pytest

from nanoeuler import Config, Model, UserError
from nanoeuler.training.check import GPT2_CHECK_CONFIG, TOLERANCE, check_model


def test_gpt2_preset_is_the_124m_shape():
    cfg = Config.preset("gpt2")
    assert (cfg.vocab_size, cfg.dim, cfg.n_heads, cfg.n_layers, cfg.ctx_len, cfg.ffn_hidden) == (50257, 768, 12, 12, 1024, 3072)
    assert cfg.n_params() == 124_439_808      # transformers' GPT2LMHeadModel("gpt2").num_parameters()
    shapes = cfg.param_shapes()
    assert "heads.0.weight" not in shapes      # tied to embed.weight
    assert shapes["pos_embed.weight"] == (1024, 768) and shapes["layers.11.ffn.fc.weight"] == (3072, 768)
    assert Config.preset("gpt2-tiny").arch == "gpt2" and Config.preset("small").arch == "euler"


def test_unknown_arch_is_a_user_error():
    d = Config.preset("gpt2-tiny").to_dict() | {"arch": "llama9"}
    with pytest.raises(UserError, match="unknown arch 'llama9'"):
        Config.from_dict(d)
    old = Config.preset("small").to_dict()
    del old["arch"]
    assert Config.from_dict(old).arch == "euler"   # configs saved before `arch` existed still load


@pytest.mark.parametrize("dropout", [0.0, 0.25])
def test_gpt2_every_gradient_matches_finite_differences(dropout):
    rows = check_model(seed=3, n_samples=16, config=GPT2_CHECK_CONFIG, dropout=dropout)
    assert len(rows) == len(GPT2_CHECK_CONFIG.param_shapes())
    for row in rows:
        assert row.max_rel_error < TOLERANCE, row


def test_tied_head_gradient_is_the_sum_of_both_uses():
    cfg = GPT2_CHECK_CONFIG.replace(n_mtp=1)
    m = Model.init(cfg, seed=1, dtype=np.float64)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 9))
    _, _, grads = m.loss_and_grads(tokens)
    # untie by hand: the lookup sees one copy, the head another; their gradients must sum to ours
    from nanoeuler import model as M, ops
    P = dict(m.params)
    P["heads.0.weight"] = P["embed.weight"].copy()
    logits, caches = M.forward(cfg, P, tokens[:, :8])
    targets = ops.mtp_targets(tokens, 8, 1)
    _, _, lc = ops.mtp_loss_forward(logits, targets)
    dlogits = ops.mtp_loss_backward(1.0, lc)
    lookup_only = M.backward(cfg, P, dlogits, caches)  # heads.0 untied: embed gets only the lookup part
    head_only = np.einsum("btv,btd->vd", dlogits[0], caches[-1])
    np.testing.assert_allclose(grads["embed.weight"], lookup_only["embed.weight"] + head_only, rtol=1e-12, atol=1e-15)
    assert np.abs(head_only).max() > 1e-3 and np.abs(lookup_only["embed.weight"]).max() > 1e-3


def test_gpt2_init_and_context_limit():
    cfg = Config.preset("gpt2-tiny")
    m = Model.init(cfg, seed=0)
    assert all(np.all(p == 0) for n, p in m.params.items() if n.endswith(".bias"))
    assert all(np.all(p == 1) for n, p in m.params.items() if n.endswith("norm.weight"))
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 33))
    h0, obj, _ = m.loss_and_grads(tokens)
    assert abs(h0 - np.log(cfg.vocab_size)) < 0.1
    with pytest.raises(UserError, match="longer than the context"):
        m.logits(np.zeros((1, cfg.ctx_len + 1), dtype=np.int64))


def test_info_activation_count_matches_the_gpt2_caches():
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from test_memory import _kept_floats

    from nanoeuler.training.memory import activation_floats, training_memory
    from nanoeuler.model import forward
    cfg = GPT2_CHECK_CONFIG
    model = Model.init(cfg)
    B, T = 3, cfg.ctx_len
    logits, caches = forward(cfg, model.params, np.zeros((B, T), dtype=np.int64))
    assert _kept_floats(caches, model.params) + logits.size == activation_floats(cfg, B, T)
    mem = training_memory(Config.preset("gpt2"), 4, 256)     # the 124M fine-tuning step of the benchmark
    assert mem["weights"] == 4 * 124_439_808 and mem["total"] < 4 * 2**30


def test_backend_without_gpt2_kernels_is_a_user_error():
    import types

    from nanoeuler import model as M, ops
    cfg = GPT2_CHECK_CONFIG
    m = Model.init(cfg)
    no_layernorm = types.SimpleNamespace(**{n: getattr(ops, n) for n in ops.__all__ if not n.startswith("layernorm")})
    with pytest.raises(UserError, match="arch gpt2 cannot run on this backend .no layernorm_forward"):
        M.forward(cfg, m.params, np.zeros((1, 4), dtype=np.int64), ops=no_layernorm)
