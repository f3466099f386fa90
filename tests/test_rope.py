"""RoPE through one entry point (Config.layer_freqs): plain, linear, llama3, yarn and longrope scaling as
transformers computes them (yarn's and longrope's attention factor: Config.score_scale), windowed layers plain at
their own base, the fields in config.json, and bad fields refused in one line.
(The scaled op's finite-difference row: training/check.py's check_ops; every engine on a scaled model:
test_fast.py and test_archs_decode.py, config "llama3"; against transformers: test_archs.py.)"""
import json

import numpy as np
import pytest

from conftest import tiny_config as tiny
from nanoeuler import Config
from nanoeuler.errors import UserError

# head 8 at θ 100: wavelengths 6.3, 20, 63, 199, against an original context of 64 (bounds 16 and 64):
# one pair unscaled, two blended, one divided by the factor
LLAMA3 = dict(rope_theta=100.0, rope_scaling="llama3", rope_factor=4.0, rope_low_freq_factor=1.0,
              rope_high_freq_factor=4.0, rope_original_ctx=64)


def tiny_config(**changes) -> Config:
    """conftest's tiny config with heads of 8 (4 rotated pairs)."""
    return tiny(dim=32, **changes)


def plain(cfg: Config) -> np.ndarray:
    return 100.0 ** (-np.arange(0, cfg.head_dim, 2) / cfg.head_dim)


def test_llama3_and_linear_frequencies_are_transformers():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    cfg = tiny_config(**LLAMA3)
    theirs = transformers.LlamaConfig(hidden_size=cfg.dim, num_attention_heads=cfg.n_heads, rope_parameters={
        "rope_type": "llama3", "rope_theta": 100.0, "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64})
    want = ROPE_INIT_FUNCTIONS["llama3"](theirs)[0].to(torch.float64).numpy()
    got = cfg.layer_freqs(0)
    np.testing.assert_allclose(got, want, rtol=1e-6)           # transformers computes in float32
    # wavelength 20: smooth = (64/20 − 1)/3 = 0.74, 1 / (0.26/4 + 0.74) = 1.24; 63: smooth 0.006, factor 3.93
    np.testing.assert_allclose(plain(cfg) / got, [1.0, 1.2418, 3.9270, 4.0], atol=1e-4)
    np.testing.assert_array_equal(tiny_config(rope_theta=100.0, rope_scaling="linear", rope_factor=2.0)
                                  .layer_freqs(0), plain(cfg) / 2)


# yarn's rope_scaling objects: transformers' defaults (betas 32 / 1, attention factor 1 + 0.1·ln(factor)), betas that
# move the ramp (head 8 at θ 100, original context 64: pairs 0 .. 3 at 0, 1/3, 2/3, 1 with the defaults, 0, 1/2, 1,
# 1 with 16 / 2), a stated attention factor, and DeepSeek's mscale / mscale_all_dim
YARN = [{}, {"beta_fast": 16.0, "beta_slow": 2.0}, {"attention_factor": 0.8}, {"mscale": 1.0, "mscale_all_dim": 0.5}]


@pytest.mark.parametrize("extra", YARN)
def test_yarn_frequencies_and_attention_factor_are_transformers(extra):
    """config.json's yarn object read as interop.hf reads it gives transformers' inverse frequencies and
    attention factor; the scores are multiplied by its square (q's factor), the KV cache's k untouched."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from nanoeuler.arch import ARCHS
    from nanoeuler.interop.hf import scaling_fields
    params = {"rope_type": "yarn", "rope_theta": 100.0, "factor": 4.0, "original_max_position_embeddings": 64} | extra
    cfg = tiny_config(rope_theta=100.0, **scaling_fields(params, "rope_scaling", ARCHS["euler"]))
    theirs = transformers.LlamaConfig(hidden_size=cfg.dim, num_attention_heads=cfg.n_heads,
                                      max_position_embeddings=256, rope_parameters=dict(params))
    freqs, attn = ROPE_INIT_FUNCTIONS["yarn"](theirs)
    np.testing.assert_allclose(cfg.layer_freqs(0), freqs.to(torch.float64).numpy(), rtol=1e-6)
    assert cfg.rope_attn_factor == pytest.approx(attn, rel=1e-12) and attn != 1.0
    assert cfg.query_factor() == pytest.approx(attn ** 2)   # (1/√hd otherwise: q's factor 1)
    if not extra:   # the ramp of the comment above
        np.testing.assert_allclose(plain(cfg) / cfg.layer_freqs(0), [1.0, 1 / (2 / 3 + 1 / 12), 1 / (1 / 3 + 1 / 6),
                                                                     4.0])


@pytest.mark.parametrize("ctx_len", [32, 64, 65])
def test_longrope_takes_the_short_factors_up_to_the_original_context_and_the_long_beyond(ctx_len):
    """Phi-3's longrope: a model run at a context up to original_max_position_embeddings (64) turns by the short
    factors, beyond by the long ones (llama.cpp's choice by its context; transformers', by the sequence's length,
    is the same for a sequence as long as the context); attention factor √(1 + ln(factor) / ln(64))."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    short, long = [1.0, 1.5, 2.0, 3.0], [1.0, 2.0, 5.0, 9.0]
    params = {"rope_type": "longrope", "rope_theta": 100.0, "short_factor": short, "long_factor": long,
              "original_max_position_embeddings": 64}
    cfg = tiny_config(arch="phi3", rope_theta=100.0, ctx_len=ctx_len, rope_scaling="longrope", rope_freq_factors=short,
                      rope_long_factors=long, rope_original_ctx=64, rope_factor=256 / 64)
    theirs = transformers.Phi3Config(hidden_size=cfg.dim, num_attention_heads=cfg.n_heads, max_position_embeddings=256,
                                     original_max_position_embeddings=64, rope_parameters=dict(params))
    freqs, attn = ROPE_INIT_FUNCTIONS["longrope"](theirs, None, seq_len=ctx_len)
    np.testing.assert_allclose(cfg.layer_freqs(0), freqs.to(torch.float64).numpy(), rtol=1e-6)
    np.testing.assert_allclose(plain(cfg) / cfg.layer_freqs(0), short if ctx_len <= 64 else long)
    assert cfg.rope_attn_factor == pytest.approx(attn, rel=1e-12) == pytest.approx((1 + np.log(4) / np.log(64)) ** 0.5)
    assert cfg.query_factor() == pytest.approx(attn ** 2)


def test_windowed_layers_keep_plain_rope_at_their_own_base():
    """Gemma 3 (window, every 2nd layer global) with linear scaling: the global layers scaled, the windowed
    ones plain at rope_local_theta; rope_kinds groups the layers by their frequencies."""
    cfg = tiny_config(arch="gemma3", n_layers=4, sliding_window=4, global_every=2, rope_theta=100.0,
                      rope_local_theta=10.0, rope_scaling="linear", rope_factor=8.0)
    freqs, kinds = cfg.rope_kinds()
    assert kinds == [0, 1, 0, 1]
    np.testing.assert_array_equal(freqs[0], 10.0 ** (-np.arange(0, cfg.head_dim, 2) / cfg.head_dim))
    np.testing.assert_array_equal(freqs[1], plain(cfg) / 8)
    assert tiny_config(arch="gpt2").rope_kinds() == ([], [-1])


def test_scaling_fields_in_config_json_and_old_configs_unchanged(tmp_path):
    old = tiny_config()
    assert not any(k.startswith("rope_") and k != "rope_theta" for k in old.to_dict())
    factors = tiny_config(rope_scaling="factors", rope_freq_factors=[1, 2, 3, 4])
    for cfg in (tiny_config(**LLAMA3), factors):
        cfg.save(tmp_path / "config.json")
        assert Config.load(tmp_path / "config.json") == cfg
    np.testing.assert_array_equal(factors.layer_freqs(0) * [1, 2, 3, 4], tiny_config().layer_freqs(0))
    half = tiny_config(arch="phi3", partial_rotary_factor=0.5)   # Phi-4-mini's: a factor per turned pair only
    short = half.replace(rope_scaling="longrope", rope_freq_factors=[2, 4], rope_long_factors=[3, 5])
    np.testing.assert_array_equal(short.layer_freqs(0), half.layer_freqs(0) / [2, 4, 1, 1])   # (passing pairs: 0)
    assert json.loads((tmp_path / "config.json").read_text())["rope_freq_factors"] == [1.0, 2.0, 3.0, 4.0]


@pytest.mark.parametrize("change, message", [
    (dict(rope_scaling="dynamic"), "rope_scaling must be one of none, linear, llama3, factors, yarn, longrope"),
    (dict(rope_scaling="yarn", rope_factor=4.0, rope_beta_fast=1.0), "rope_beta_slow 1.0 must be below rope_beta_fast"),
    (dict(rope_scaling="yarn", rope_attn_factor=0.0), "rope_attn_factor must be a finite number > 0"),
    (dict(arch="stablelm", partial_rotary_factor=0.5, rope_scaling="yarn"), "rope_scaling yarn with partial_rotary"),
    (dict(arch="stablelm", partial_rotary_factor=0.5, rope_scaling="llama3"), "rope_scaling llama3 with partial_rot"),
    (dict(arch="phi3", partial_rotary_factor=0.5, rope_scaling="longrope", rope_freq_factors=[1.0] * 4,
          rope_long_factors=[1.0] * 4), "rope_freq_factors must be 2 finite numbers > 0 \\(one per turned pair"),
    (dict(rope_scaling="longrope", rope_freq_factors=[1.0] * 4), "rope_long_factors goes with rope_scaling"),
    (dict(rope_scaling="longrope", rope_freq_factors=[1.0] * 4, rope_long_factors=[1.0, -1.0, 1.0, 1.0]),
     "rope_long_factors must be 4 finite numbers"),
    (dict(rope_scaling="yarn", rope_long_factors=[1.0] * 4), "rope_long_factors goes with rope_scaling \"longrope\""),
    (dict(arch="smollm3", no_rope_every=2, rope_scaling="yarn"), "rope_scaling yarn beside layers it does not turn"),
    (dict(arch="gemma3", sliding_window=4, global_every=2, rope_scaling="yarn"), "rope_scaling yarn beside layers"),
    (dict(rope_scaling="linear", rope_factor=0.0), "rope_factor must be a finite number > 0"),
    (dict(rope_scaling="linear", rope_factor=10**400), "rope_factor must be a finite number > 0"),  # no float
    (dict(rope_theta=10**400), "rope_theta must be a finite number > 0"),
    (dict(rope_scaling="llama3", rope_low_freq_factor=4.0), "rope_low_freq_factor 4.0 must be below"),
    (dict(rope_scaling="llama3", rope_original_ctx=1.5), "rope_original_ctx must be a positive integer"),
    (dict(rope_scaling="factors", rope_freq_factors=[1.0, 2.0]), "rope_freq_factors must be 4 finite numbers"),
    (dict(rope_scaling="factors", rope_freq_factors=[1.0, 2.0, 0.0, 1.0]), "rope_freq_factors must be 4 finite"),
    (dict(rope_freq_factors=[1.0, 1.0, 1.0, 1.0]), "rope_freq_factors goes with rope_scaling \"factors\""),
    (dict(rope_scaling="factors"), "rope_freq_factors goes with rope_scaling \"factors\""),
    (dict(rope_scaling="longrope", rope_long_factors=[1.0] * 4), "rope_freq_factors goes with rope_scaling"),
    (dict(arch="gemma3", sliding_window=4, global_every=0, rope_scaling="linear", rope_factor=2.0),
     "every layer is windowed"),
    (dict(arch="gpt2", n_kv_heads=4, rope_scaling="linear", rope_factor=2.0), "linear for arch gpt2, which has no RoPE"),
])
def test_bad_scaling_fields_are_refused_in_one_line(change, message):
    with pytest.raises(UserError, match=message) as e:
        tiny_config(**change)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "gemma3"])
def test_llama3_rope_is_refused_for_a_gguf_whose_llama_cpp_architecture_reads_no_rope_freqs(arch, tmp_path):
    """llama.cpp reads the rope_freqs tensor for its llama architecture only (not qwen2, qwen3, gemma3: it would
    refuse the file or compute plain RoPE), so exporting such a model with llama3 scaling is refused in one line."""
    pytest.importorskip("gguf")
    from nanoeuler import Model, Tokenizer
    from nanoeuler.interop.gguf_export import export_gguf
    cfg = tiny_config(arch=arch, head_dim=8, n_mtp=1, **LLAMA3)
    with pytest.raises(UserError, match=f"llama.cpp's {arch} reads no per-pair RoPE factors") as e:
        export_gguf(Model.init(cfg, seed=0), Tokenizer([]), tmp_path / "m.gguf", progress=False)
    assert "\n" not in str(e.value) and not (tmp_path / "m.gguf").exists()
