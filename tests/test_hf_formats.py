"""What a Hugging Face format implies (arch.py's `hf` Format: config.json keys, what export writes beside them,
the weights' prefix, the tokenizer files, PEFT's fan_in_fan_out, the window pattern's key and default) is read
from the record, never from a comparison of names: each class here, per architecture."""
from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import tiny_config
from hypothesis import given
from hypothesis import strategies as st
from test_fuzz_loaders import FUZZ, json_values

from nanoeuler import Model, Tokenizer
from nanoeuler.adapters import LoraConfig
from nanoeuler.arch import ARCHS, GEMMA3
from nanoeuler.errors import UserError
from nanoeuler.interop.hf import config_from_hf, export_hf, hf_config
from nanoeuler.interop.peft import adapter_config

SHAPES = {"euler": {}, "qwen2": {}, "gpt2": dict(n_kv_heads=4), "qwen3": dict(head_dim=8),
          "mistral": dict(sliding_window=4),
          "olmo2": {}, "smollm3": dict(no_rope_every=2),
          "granite": dict(embedding_multiplier=2.5, residual_multiplier=0.5, attention_multiplier=0.2,
                          logits_scaling=3.0), "starcoder2": dict(sliding_window=4),
          "stablelm": dict(partial_rotary_factor=0.5),
          "euler+llama3": dict(rope_scaling="llama3", rope_factor=32.0, rope_original_ctx=16),
          "gemma3": dict(head_dim=8, sliding_window=4, global_every=3, rope_local_theta=10000.0),
          "gemma2": dict(sliding_window=4, attn_softcap=20.0), "gemma2+uncapped": dict(logit_softcap=0.0),
          "phi3": dict(sliding_window=4), "gptneox": dict(n_heads=2, n_kv_heads=2, partial_rotary_factor=0.5),
          "gptneox+sequential": dict(n_heads=2, n_kv_heads=2, parallel_residual=False)}


def test_every_architecture_has_a_shape():
    """A record added to arch.py without a shape here would go untested by the format checks."""
    assert {c.partition("+")[0] for c in SHAPES} == set(ARCHS)


def config_of(case: str):
    return tiny_config(arch=case.partition("+")[0], n_mtp=1, n_layers=3, **SHAPES[case])


@pytest.mark.parametrize("arch", sorted(SHAPES))
def test_each_format_reads_back_the_config_it_writes(arch):
    """config.json as export writes it imports as the same Config, every key of a field written (GPT-2's
    n_ctx beside n_positions, query_pre_attn_scalar beside head_dim) and agreeing."""
    cfg = config_of(arch)
    c = json.loads(json.dumps(hf_config(cfg, Tokenizer([]), tied=False)))
    assert config_from_hf(c, cfg.spec).replace(n_mtp=1) == cfg.replace(tie_embeddings=False)
    fmt = cfg.spec.hf
    for field, keys in fmt.config.items():
        assert len({json.dumps(c[k]) for k in keys if k in c}) <= 1, field
    if arch == "gpt2":
        assert c["n_ctx"] == c["n_positions"] == cfg.ctx_len and c["activation_function"] == "gelu_new"
        assert "num_key_value_heads" not in c and "hidden_act" not in c and c["attn_pdrop"] == 0.0
    else:
        assert all(c[k] == cfg.head_dim for k in fmt.config.get("head_dim", ()))   # (StableLM's: dim / heads)
        assert c["rope_scaling"] == (None if cfg.rope_scaling == "none" else {
            "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16})
        assert len({c[k] for k in fmt.activation_keys}) == 1 and "n_ctx" not in c


def gpt2_config(**keys) -> dict:
    return {"model_type": "gpt2", "vocab_size": 40, "n_embd": 16, "n_layer": 1, "n_head": 4} | keys


def test_a_gpt2_config_gives_its_context_as_n_positions_or_n_ctx():
    """GPT-2's context is n_positions, else the older n_ctx; the two given must agree."""
    assert config_from_hf(gpt2_config(n_positions=64), ARCHS["gpt2"]).ctx_len == 64
    assert config_from_hf(gpt2_config(n_ctx=32), ARCHS["gpt2"]).ctx_len == 32
    assert config_from_hf(gpt2_config(n_positions=64, n_ctx=64), ARCHS["gpt2"]).ctx_len == 64
    with pytest.raises(UserError, match="n_ctx=32 differs from n_positions 64"):
        config_from_hf(gpt2_config(n_positions=64, n_ctx=32), ARCHS["gpt2"])
    with pytest.raises(UserError, match="n_embd is missing"):
        config_from_hf({k: v for k, v in gpt2_config(n_positions=64).items() if k != "n_embd"}, ARCHS["gpt2"])


def llama_config(model_type: str, **keys) -> dict:
    return {"model_type": model_type, "vocab_size": 40, "hidden_size": 16, "num_hidden_layers": 7,
            "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 24} | keys


def test_a_window_is_read_only_where_the_architecture_has_one():
    """sliding_window in a Llama config is refused (Llama attends globally); in a Qwen2 one that says it does
    not use it, ignored: neither becomes windowed, every 6th layer global or otherwise."""
    with pytest.raises(UserError, match="sliding_window=4 is not supported for llama"):
        config_from_hf(llama_config("llama", sliding_window=4), ARCHS["euler"])
    cfg = config_from_hf(llama_config("qwen2", sliding_window=4, use_sliding_window=False), ARCHS["qwen2"])
    assert not cfg.sliding_window and all(cfg.window(i) == 0 for i in range(7))


def test_the_window_pattern_is_the_formats_key_else_the_architectures_default(monkeypatch):
    """Gemma 3: sliding_window_pattern says which layers are global; absent, the architecture's default
    (global_every, 6 for Gemma 3), not a number of the importer's own."""
    c = llama_config("gemma3_text", head_dim=4, sliding_window=4)
    assert config_from_hf(c | {"sliding_window_pattern": 3}, GEMMA3).global_every == 3
    assert config_from_hf(c, GEMMA3).global_every == GEMMA3.defaults["global_every"] == 6
    monkeypatch.setitem(GEMMA3.defaults, "global_every", 2)
    cfg = config_from_hf(c, GEMMA3)
    assert [cfg.window(i) for i in range(4)] == [4, 0, 4, 0]


def test_soft_caps_read_as_transformers_reads_them():
    """Gemma 2's caps: absent, transformers' 50 / 30 (the architecture's defaults); null, none (written back as
    null); a Llama config.json with a cap is refused in one line (Llama computes none)."""
    gemma2 = ARCHS["gemma2"]
    c = llama_config("gemma2", head_dim=4)
    cfg = config_from_hf(c, gemma2)
    assert (cfg.attn_softcap, cfg.logit_softcap) == (50.0, 30.0)
    cfg = config_from_hf(c | {"attn_logit_softcapping": None, "final_logit_softcapping": 10}, gemma2)
    assert (cfg.attn_softcap, cfg.logit_softcap) == (0.0, 10.0)
    out = hf_config(cfg, Tokenizer([]), tied=True)
    assert out["attn_logit_softcapping"] is None and out["final_logit_softcapping"] == 10.0
    with pytest.raises(UserError, match="attn_logit_softcapping=50.0 is not supported") as e:
        config_from_hf(llama_config("llama", attn_logit_softcapping=50.0), ARCHS["euler"])
    assert "\n" not in str(e.value)


def test_phi3s_longrope_reads_in_either_spelling_with_transformers_defaults():
    """Phi-3's LongRoPE (short / long per-pair factors, an attention factor on cos / sin) in transformers 4's
    rope_scaling or 5's rope_parameters: the factors, the original context from config.json's own key, and where
    the object names none, the factor max_position_embeddings / original and the attention factor from it, as
    transformers takes them (its values: test_rope.py; the model against transformers: test_archs.py)."""
    longrope = {"rope_type": "longrope", "short_factor": [1.0, 1.5], "long_factor": [2.0, 4.0]}
    for key in ("rope_scaling", "rope_parameters"):
        c = llama_config("phi3", head_dim=4, original_max_position_embeddings=8, max_position_embeddings=32,
                         **{key: longrope | {"rope_theta": 1e4}})
        cfg = config_from_hf(c, ARCHS["phi3"])
        assert (cfg.rope_scaling, cfg.rope_freq_factors, cfg.rope_long_factors) == ("longrope", (1.0, 1.5), (2.0, 4.0))
        assert (cfg.rope_original_ctx, cfg.rope_factor) == (8, 4.0)
        assert cfg.rope_attn_factor == pytest.approx((1 + np.log(4) / np.log(8)) ** 0.5)
        np.testing.assert_allclose(cfg.layer_freqs(0), 1e4 ** -np.array([0.0, 0.5]) / [2.0, 4.0])   # ctx 32 > 8


def test_gpt2s_tensors_carry_its_prefix_and_its_tokenizer_its_files(tmp_path):
    from nanoeuler.interop.safetensors_io import read_header
    cfg = tiny_config(arch="gpt2", n_mtp=1, n_kv_heads=4, vocab_size=300)
    tok = Tokenizer.train(["some text to train on, some more text"] * 20, 300, progress=False)
    export_hf(Model.init(cfg, seed=0), tok, tmp_path / "gpt2", progress=False)
    names = [n for n in read_header(tmp_path / "gpt2" / "model.safetensors")[0] if n != "__metadata__"]
    assert names and all(n.startswith("transformer.") for n in names if n != "lm_head.weight")
    assert (tmp_path / "gpt2" / "vocab.json").is_file() and (tmp_path / "gpt2" / "merges.txt").is_file()
    export_hf(Model.init(tiny_config(n_mtp=1, vocab_size=300), seed=0), tok, tmp_path / "llama", progress=False)
    assert not any(n.startswith("transformer.") for n in read_header(tmp_path / "llama" / "model.safetensors")[0])
    assert not (tmp_path / "llama" / "vocab.json").exists()


def test_a_format_without_a_key_for_kv_heads_refuses_gqa(tmp_path):
    cfg = tiny_config(arch="gpt2", n_mtp=1, vocab_size=257)   # 4 heads, 2 kv heads
    with pytest.raises(UserError, match="gpt2 folder has as many key/value heads as query heads"):
        export_hf(Model.init(cfg, seed=0), Tokenizer([]), tmp_path / "x", progress=False)
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("arch, transposed", [("gpt2", True), ("euler", False), ("gemma3", False)])
def test_peft_fan_in_fan_out_is_whether_the_targets_are_stored_transposed(arch, transposed):
    """PEFT must know that GPT-2's Conv1D weights are [in, out]: the `hf` table's transposed entries say so."""
    cfg = config_of("gpt2" if arch == "gpt2" else arch)
    lcfg = LoraConfig(2, 4.0).check(cfg)
    assert adapter_config(cfg, lcfg, "base")["fan_in_fan_out"] is transposed


@pytest.mark.parametrize("keys, message", [
    (dict(rope_scaling={"rope_type": ["linear"], "factor": 2.0}), "rope_scaling .* is not supported"),
    (dict(rope_parameters={"rope_type": {"linear": 1}, "rope_theta": 1e4}), "rope_parameters .* is not supported"),
    (dict(rope_scaling={"rope_type": "linear", "factor": 2.0}, rope_parameters={"rope_type": "linear", "factor": 4.0}),
     "rope_parameters' factor 4.0 differs from rope_scaling's 2.0"),
    (dict(rope_theta=1e4, rope_parameters={"rope_type": "default", "rope_theta": 5e5}),
     "rope_parameters' rope_theta 500000.0 differs from rope_theta's 10000.0"),
    (dict(sliding_window=4, layer_types=["sliding_attention", "full_attention"]),
     "layer_types lists 2 layers, num_hidden_layers 7"),
])
def test_rope_and_layer_keys_that_make_no_sense_are_refused_in_one_line(keys, message):
    """A rope_type that is no name (a list: was a TypeError), a rope_parameters that says other than rope_scaling
    or rope_theta (which one transformers reads depends on its version), layer_types of another length than the
    layers (its pattern was read as if it were theirs)."""
    with pytest.raises(UserError, match=message) as e:
        config_from_hf(llama_config("mistral", **keys), ARCHS["mistral"])
    assert "\n" not in str(e.value)


def test_rope_keys_given_twice_that_agree_import():
    same = dict(rope_theta=5e5, rope_scaling={"rope_type": "linear", "factor": 2.0},
                rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5})
    cfg = config_from_hf(llama_config("llama", **same), ARCHS["euler"])
    assert (cfg.rope_theta, cfg.rope_scaling, cfg.rope_factor) == (5e5, "linear", 2.0)


ROPE_KEYS = ("rope_scaling", "rope_parameters", "rope_theta", "head_dim", "sliding_window", "layer_types",
             "sliding_window_pattern", "rope_local_base_freq")


@FUZZ
@given(data=st.data())
def test_fuzzed_rope_and_window_keys_import_or_are_one_userror(data):
    """Any JSON value (nested too) in the RoPE and window keys of a Llama / Qwen3 / Mistral / Gemma 3 config.json,
    or inside a rope_scaling object of each type: a Config whose every layer's frequencies are finite, or one
    UserError line; never another exception."""
    from hypothesis import event
    model_type = data.draw(st.sampled_from(["llama", "qwen3", "mistral", "gemma3_text"]))
    c = llama_config(model_type, head_dim=4, sliding_window=4, rope_theta=1e4) | (
        {"hidden_activation": "gelu_pytorch_tanh"} if model_type == "gemma3_text" else {})
    if model_type in ("llama", "qwen3"):
        del c["sliding_window"]
    key = data.draw(st.sampled_from(ROPE_KEYS))
    kind = data.draw(st.sampled_from(["linear", "llama3", "yarn", "dynamic", "default"]))
    inner = {"rope_type": kind, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
             "original_max_position_embeddings": 8192}
    inner[data.draw(st.sampled_from(sorted(inner)))] = data.draw(json_values)
    c[key] = data.draw(st.one_of(json_values, st.just(inner), st.just({"full_attention": inner})))
    try:
        cfg = config_from_hf(c, ARCHS[{"llama": "euler", "gemma3_text": "gemma3"}.get(model_type, model_type)])
    except UserError as e:
        assert "\n" not in str(e)
        event("UserError")
        return
    event("ok")
    assert all(np.isfinite(cfg.layer_freqs(i)).all() for i in range(cfg.n_layers))


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3", "mistral", "gemma3_text"])
def test_a_key_config_json_leaves_out_is_what_transformers_assumes(model_type):
    """A config.json without rope_theta / rms_norm_eps / head_dim / sliding_window means transformers' config class
    defaults (Qwen2's and Qwen3's rope_theta 10000, Mistral's and Gemma 3's window 4096, Qwen3's head_dim 128):
    each was our architecture's own default (1e6; no window, 512; hidden / heads), another model."""
    transformers = pytest.importorskip("transformers")
    c = llama_config(model_type, hidden_size=64, num_hidden_layers=2,   # (a context wider than the default window,
                     max_position_embeddings=8192) | (                    # which would otherwise leave out no key)
        {"hidden_activation": "gelu_pytorch_tanh"} if model_type == "gemma3_text" else {})
    theirs = transformers.AutoConfig.for_model(**c)
    rope = theirs.rope_parameters
    cfg = config_from_hf(c, ARCHS[{"llama": "euler", "gemma3_text": "gemma3"}.get(model_type, model_type)])
    assert cfg.rope_theta == rope.get("full_attention", rope)["rope_theta"]
    assert (cfg.norm_eps, cfg.head_dim) == (theirs.rms_norm_eps, getattr(theirs, "head_dim", None) or 64 // 4)
    assert cfg.sliding_window == (getattr(theirs, "sliding_window", None) or 0) * (model_type != "qwen2")
