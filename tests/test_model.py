"""The model: presets, initialisation, whole-model gradient check, bad input, save/load."""
import json

import numpy as np
import pytest

from nanoeuler import PRESETS, Config, Model, UserError
from nanoeuler.arch import ARCHS
from nanoeuler.training.check import ARCH_CHECK_CONFIGS, TOLERANCE, check_model
from conftest import tiny_config

SPEC_COUNTS = {"small": 1_049_728, "big": 11_013_504, "gpt": 116_417_280}
TINY = tiny_config(vocab_size=40, dim=16, n_heads=4, n_kv_heads=2, n_layers=2, ctx_len=8, ffn_hidden=24, n_mtp=2)


@pytest.mark.parametrize("name", list(SPEC_COUNTS))
def test_preset_parameter_counts_equal_spec(name):
    assert PRESETS[name].n_params() == SPEC_COUNTS[name]
    assert sum(int(np.prod(s)) for s in PRESETS[name].param_shapes().values()) == SPEC_COUNTS[name]


def test_small_model_params_have_spec_names_and_shapes():
    m = Model.from_preset("small", seed=0)
    assert m.n_params() == SPEC_COUNTS["small"]
    assert m.params["layers.3.attn.wk.weight"].shape == (64, 128)
    assert m.params["heads.2.weight"].shape == (512, 128)
    assert list(m.params)[0] == "embed.weight" and list(m.params)[-1] == "heads.2.weight"


def test_init_follows_spec():
    m = Model.init(PRESETS["big"], seed=0)
    assert np.all(m.params["norm.weight"] == 1) and np.all(m.params["layers.0.ffn_norm.weight"] == 1)
    assert m.params["embed.weight"].std() == pytest.approx(0.02, rel=0.01)
    assert m.params["layers.1.attn.wo.weight"].std() == pytest.approx(0.02 / np.sqrt(8), rel=0.02)
    assert m.params["layers.1.ffn.down.weight"].std() == pytest.approx(0.02 / np.sqrt(8), rel=0.02)
    assert m.params["embed.weight"].dtype == np.float32
    same = Model.init(PRESETS["small"], seed=7).params["embed.weight"]
    assert np.array_equal(same, Model.init(PRESETS["small"], seed=7).params["embed.weight"])
    assert not np.array_equal(same, Model.init(PRESETS["small"], seed=8).params["embed.weight"])


def test_loss_at_init_is_near_log_vocab():
    m = Model.from_preset("small", seed=0)
    tokens = np.random.default_rng(0).integers(0, 512, (2, 64 + 3))
    head0, objective, grads = m.loss_and_grads(tokens)
    assert head0 == pytest.approx(np.log(512), abs=0.05)
    assert objective == pytest.approx(np.log(512), abs=0.05)
    assert set(grads) == set(m.params)
    assert all(grads[n].shape == p.shape and grads[n].dtype == np.float32 for n, p in m.params.items())


@pytest.mark.parametrize("config", [
    TINY,
    TINY.replace(n_kv_heads=4),          # plain multi-head attention
    TINY.replace(n_mtp=1, n_layers=1),   # no MTP
])
def test_whole_model_gradient_check(config):
    rows = check_model(seed=2, n_samples=16, config=config)
    assert len(rows) == len(config.param_shapes())
    for row in rows:
        assert row.max_rel_error < TOLERANCE, row


@pytest.mark.parametrize("arch", ARCHS)
def test_every_architectures_gradient_check(arch):
    """`nanoeuler check`'s model rows of every architecture (training/check.py's ARCH_CHECK_CONFIGS: each one's
    own parts switched on; qwen3's RoPE scaled as Llama 3's) pass in float64."""
    config = ARCH_CHECK_CONFIGS[arch]
    assert config.arch == arch
    for row in check_model(config=config):    # (as `nanoeuler check` runs it)
        assert row.max_rel_error < TOLERANCE, row


def test_whole_model_gradient_check_with_dropout():
    rows = check_model(seed=3, n_samples=16, config=TINY, dropout=0.3)
    assert len(rows) == len(TINY.param_shapes()) and all(r.name.startswith("dropout 0.3: ") for r in rows)
    for row in rows:
        assert row.max_rel_error < TOLERANCE, row


def test_masked_positions_get_no_gradient_signal():
    m = Model.init(TINY, seed=0, dtype=np.float64)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 40, (2, 10))
    mask = np.ones_like(tokens, dtype=bool)
    mask[:, 5:] = False
    _, _, g1 = m.loss_and_grads(tokens, mask)
    tokens2 = tokens.copy()
    tokens2[:, 7:] = (tokens[:, 7:] + 1) % 40  # these only feed, or are, targets at masked positions (>= 5)
    _, _, g2 = m.loss_and_grads(tokens2, mask)
    for n in g1:
        np.testing.assert_array_equal(g1[n], g2[n])


@pytest.mark.parametrize("kwargs, message", [
    (dict(dim=30), "not divisible by n_heads"),
    (dict(n_kv_heads=3), "not divisible by n_kv_heads"),
    (dict(dim=20, n_heads=4, n_kv_heads=2), "must be even"),
    (dict(n_layers=0), "positive integer"),
])
def test_bad_config_is_a_clear_error(kwargs, message):
    with pytest.raises(UserError, match=message):
        TINY.replace(**kwargs)


def test_unknown_config_field_is_a_clear_error(tmp_path):
    d = TINY.to_dict() | {"n_experts": 4}
    with pytest.raises(UserError, match="unknown field.*n_experts"):
        Config.from_dict(d)
    with pytest.raises(UserError, match="missing field.*dim"):
        Config.from_dict({k: v for k, v in TINY.to_dict().items() if k != "dim"})


@pytest.mark.parametrize("tokens, message", [
    (np.full((1, 10), 40), "out of range"),
    (np.full((1, 10), -1), "out of range"),
    (np.zeros((1, 11), dtype=np.int64), "longer than the context"),
    (np.zeros((1, 2), dtype=np.int64), "too short"),
    (np.zeros((1, 10)), "integer"),
    (np.zeros(10, dtype=np.int64), "2-D"),
])
def test_bad_tokens_are_a_clear_error(tokens, message):
    with pytest.raises(UserError, match=message):
        Model.init(TINY).loss_and_grads(tokens)


def test_save_load_round_trip(tmp_path):
    m = Model.init(TINY, seed=3)
    m.save(tmp_path / "run")
    loaded = Model.load(tmp_path / "run")
    assert loaded.config == m.config
    for n, p in m.params.items():
        assert np.array_equal(loaded.params[n], p) and loaded.params[n].flags.writeable
    assert json.loads((tmp_path / "run" / "config.json").read_text()) == TINY.to_dict()


def test_checkpoint_defects_are_clear_errors(tmp_path):
    from safetensors.numpy import load_file, save_file
    run = tmp_path / "run"
    with pytest.raises(UserError, match="not found"):
        Model.load(run)
    Model.init(TINY).save(run)
    tensors = load_file(str(run / "model.safetensors"))
    bad = dict(tensors)
    del bad["layers.1.ffn.up.weight"]
    save_file(bad, str(run / "model.safetensors"))
    with pytest.raises(UserError, match="missing tensor layers.1.ffn.up.weight"):
        Model.load(run)
    bad = dict(tensors) | {"norm.weight": np.ones(5, dtype=np.float32)}
    save_file(bad, str(run / "model.safetensors"))
    with pytest.raises(UserError, match=r"norm.weight has shape \[5\], expected \[16\]"):
        Model.load(run)
    (run / "model.safetensors").write_bytes(b"\x00garbage")
    with pytest.raises(UserError, match="corrupt"):
        Model.load(run)
    (run / "config.json").write_text("{not json")
    with pytest.raises(UserError, match="not valid JSON"):
        Model.load(run)


def test_the_gradient_check_takes_every_small_tensor_whole_and_the_extremes_of_a_large_one():
    from nanoeuler.training.check import EXTREMES, sample_indices
    rng = np.random.default_rng(0)
    assert sample_indices(rng, np.arange(20.0), 12).tolist() == list(range(20))      # 20 <= 12 + 2·4
    g = rng.standard_normal(1000)
    idx = sample_indices(rng, g, 12)
    order = np.argsort(g)
    assert set(order[:EXTREMES]) | set(order[-EXTREMES:]) <= set(idx.tolist()) and 12 < len(idx) <= 12 + 2 * EXTREMES


def test_a_backend_without_the_softcap_pair_refuses_a_capped_model():
    """Gemma 2's soft caps go through the ops' softcap pair (ops/softcap.py) and the attention op's cap, which the
    GPU's kernels do not compute: it refuses such a model in one line (and its attention a cap), rather than
    computing another model."""
    import types

    from nanoeuler import model as M, ops
    from nanoeuler.gpu.ops import GpuOps
    assert not hasattr(GpuOps, "softcap_forward")
    no_cap = types.SimpleNamespace(**{n: getattr(ops, n) for n in ops.__all__ if not n.startswith("softcap")})
    ids = np.zeros((1, 4), dtype=np.int64)
    gemma2 = ARCH_CHECK_CONFIGS["gemma2"]
    for cfg in (gemma2, gemma2.replace(logit_softcap=0.0), gemma2.replace(attn_softcap=0.0)):
        with pytest.raises(UserError, match="arch gemma2 cannot run on this backend .no softcap_forward") as e:
            M.forward(cfg, Model.init(cfg).params, ids, ops=no_cap)
        assert "\n" not in str(e.value)
    with pytest.raises(UserError, match="the GPU's attention has no soft-capping"):
        GpuOps.attention_forward(None, None, None, None, 0, 1.0)


def test_a_backend_without_the_scale_pair_refuses_granite_and_runs_the_others():
    """Granite's multipliers go through the ops' scale pair (ops/scale.py), which the GPU's kernels do not have: a
    backend without it refuses a granite model in one line, rather than computing another model, and runs every
    other architecture (their factors are 1, the pair never called)."""
    import types

    from nanoeuler import model as M, ops
    from nanoeuler.gpu.ops import GpuOps
    assert not hasattr(GpuOps, "scale_forward")
    no_scale = types.SimpleNamespace(**{n: getattr(ops, n) for n in ops.__all__ if not n.startswith("scale")})
    ids = np.zeros((1, 4), dtype=np.int64)
    granite = ARCH_CHECK_CONFIGS["granite"]
    with pytest.raises(UserError, match="arch granite cannot run on this backend .no scale_forward") as e:
        M.forward(granite, Model.init(granite).params, ids, ops=no_scale)
    assert "\n" not in str(e.value)
    euler = ARCH_CHECK_CONFIGS["euler"]
    assert np.array_equal(M.forward(euler, Model.init(euler).params, ids, ops=no_scale)[0],
                          M.forward(euler, Model.init(euler).params, ids)[0])


def test_multipliers_belong_to_the_architectures_that_have_them():
    """A config.json giving Granite's multipliers to another architecture is refused in one line (its formats could
    not carry them); a granite's defaults are 1 and 1/√head_dim, and to_dict writes only those that differ."""
    with pytest.raises(UserError, match="config: logits_scaling 8.0 for arch euler"):
        TINY.replace(logits_scaling=8.0)
    g = TINY.replace(arch="granite")
    assert (g.embedding_multiplier, g.residual_multiplier, g.logits_scaling) == (1.0, 1.0, 1.0)
    assert g.attention_multiplier == 1 / 2.0 and g.query_factor() == 1.0   # head_dim 4
    assert "attention_multiplier" not in g.to_dict()
    g = g.replace(attention_multiplier=0.25, residual_multiplier=0.22)
    assert g.query_factor() == 0.5 and Config.from_dict(g.to_dict()) == g
    with pytest.raises(UserError, match="residual_multiplier must be a finite number > 0"):
        g.replace(residual_multiplier=float("nan"))


def test_layers_without_rope_belong_to_the_architectures_that_have_them():
    """no_rope_every for an architecture whose every layer turns q and k is refused in one line (its formats could
    not carry it); a smollm3's every 4th layer (its default) gets frequency 0, under which RoPE is the identity in
    every engine, and the others the plain frequencies."""
    from nanoeuler import ops
    with pytest.raises(UserError, match="config: no_rope_every 2 for arch euler"):
        TINY.replace(no_rope_every=2)
    s = TINY.replace(arch="smollm3", n_layers=5)
    assert [s.turns(i) for i in range(5)] == [True, True, True, False, True] and "no_rope_every" not in s.to_dict()
    assert s.rope_kinds()[1] == [0, 0, 0, 1, 0] and not s.layer_freqs(3).any()
    assert np.array_equal(s.layer_freqs(3 - 1), s.replace(no_rope_every=0).layer_freqs(3))
    x = np.random.default_rng(0).standard_normal((1, 2, 8, s.head_dim)).astype(np.float32)   # [B, H, T, hd]
    assert np.array_equal(ops.rope_forward(x, *ops.rope_tables(8, s.layer_freqs(3), np.float32))[0], x)
    assert Config.from_dict(s.replace(no_rope_every=2).to_dict()).no_rope_every == 2
    with pytest.raises(UserError, match="no_rope_every must be an integer in"):
        s.replace(no_rope_every=-1)
