"""LoRA: the op, the model with adapters (reference vs fast vs finite differences), and adapter runs."""
import numpy as np
import pytest

from conftest import rel_err, tiny_config
from nanoeuler import adapters as ad
from nanoeuler import ops
from nanoeuler.check import GPT2_CHECK_CONFIG, TOLERANCE, check_lora
from nanoeuler.lora import LoraModel
from nanoeuler.model import Model


def lora_model(arch="euler", dtype=np.float64, seed=0, rank=4, targets=None, trained=True, dropout=0.0):
    cfg = tiny_config(arch=arch)
    base = Model.init(cfg, seed=seed, dtype=dtype)
    lcfg = ad.LoraConfig(rank, 2.0 * rank, targets or ad.DEFAULT_TARGETS[arch], dropout)
    adapters = ad.init_adapters(cfg, lcfg, seed, dtype)
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
    from nanoeuler.check import check_ops
    rows = [r for r in check_ops(seed=3) if r.name.startswith("op lora")]
    assert len(rows) == 6 and max(r.max_rel_error for r in rows) < TOLERANCE


@pytest.mark.parametrize("config,dropout", [(None, 0.0), (GPT2_CHECK_CONFIG, 0.0), (None, 0.25)])
def test_adapter_gradients_match_finite_differences(config, dropout):
    kw = {"config": config} if config is not None else {}
    rows = check_lora(seed=1, n_samples=8, dropout=dropout, **kw)
    assert len(rows) == 2 * 2 * (4 if config is not None else 7)  # A and B, 2 layers, every module
    assert max(r.max_rel_error for r in rows) < TOLERANCE, max(rows, key=lambda r: r.max_rel_error)


@pytest.mark.parametrize("arch", ["euler", "gpt2"])
def test_fast_step_equals_reference_step(arch):
    m = lora_model(arch)
    tokens, mask = batch(m.config)
    h1, o1, g1 = m.loss_and_grads(tokens, mask, reference=True)
    h2, o2, g2 = m.loss_and_grads(tokens, mask)
    assert abs(o1 - o2) < 1e-12 and abs(h1 - h2) < 1e-12
    assert set(g1) == set(g2) == set(m.params)
    for name in g1:
        assert rel_err(g2[name], g1[name]) < 1e-10, name


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
