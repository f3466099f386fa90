"""Every architecture of arch.py against transformers: a random model of each, built by transformers and saved as
a Hugging Face folder, is imported; our logits and loss gradients equal transformers' (torch autograd), and
the export back (HF and GGUF) gives the same tensors and the same logits. No network: every model is made here.

    gemma3: head_dim of its own (16, not dim / heads), q/k norms, post norms, GeGLU, √d embedding, windowed
            layers (window 5, every 3rd layer global) with their own RoPE base, sequences longer than the window
    qwen2:  biases on q, k, v;  llama: our own block;  gpt2: LayerNorm, learned positions, GELU, every bias
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import rel_err
from nanoeuler import Model
from nanoeuler.data.corpus import bundled_works

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

# float32, every entry (conftest.rel_err). (transformers cannot be the oracle in float64: its norms and RoPE
# angles are computed in float32 whatever the model's dtype.) A norm's weight gradient sums B·T (q/k norms:
# B·T·heads) terms that partly cancel: up to 5.4e-4 measured, against 7.7e-5 for the others.
LOGITS_TOL, GRAD_TOL, NORM_GRAD_TOL = 1e-4, 2e-4, 2e-3
T = 24                              # longer than gemma3's window (5)


def hf_model(kind: str, vocab: int, seed: int = 0):
    """A random transformers model of architecture `kind`, norms away from their init and biases nonzero so
    that their mapping is tested."""
    common = dict(vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                  num_attention_heads=4, max_position_embeddings=64, eos_token_id=0, bos_token_id=0)
    if kind == "llama":
        cfg = transformers.LlamaConfig(**common, num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=5000.0,
                                       tie_word_embeddings=False)
    elif kind == "qwen2":
        cfg = transformers.Qwen2Config(**common, num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=20000.0,
                                       tie_word_embeddings=True)
    elif kind == "gemma3":
        cfg = transformers.Gemma3TextConfig(**common, num_key_value_heads=1, head_dim=16, rms_norm_eps=1e-6,
                                            query_pre_attn_scalar=16, sliding_window=5, sliding_window_pattern=3,
                                            rope_theta=50000.0, rope_local_base_freq=1000.0,
                                            pad_token_id=None, attn_implementation="eager")  # no padding_idx row
    else:
        cfg = transformers.GPT2Config(vocab_size=vocab, n_embd=32, n_layer=3, n_head=4, n_positions=64,
                                      n_inner=48, eos_token_id=0, bos_token_id=0)
    cls = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM,
           "gemma3": transformers.Gemma3ForCausalLM, "gpt2": transformers.GPT2LMHeadModel}[kind]
    torch.manual_seed(seed)
    model = cls(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "ln_" in name:
                p.copy_((0.0 if kind == "gemma3" else 1.0) + 0.3 * torch.randn_like(p))
            else:
                p.normal_(0, 0.1)
    return model


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from test_interop import hf_tokenizer_json
    text = bundled_works()["hamlet"][:30000]
    tok_json = hf_tokenizer_json(text, "gpt2", vocab=300)
    n_tok = len(json.loads(tok_json)["model"]["vocab"])
    out = {}
    for kind in ("llama", "qwen2", "gemma3", "gpt2"):
        d = tmp_path_factory.mktemp(kind)
        model = hf_model(kind, n_tok)
        model.save_pretrained(d)
        (d / "tokenizer.json").write_text(tok_json)
        out[kind] = (model, d)
    return out


def torch_logits(model, ids) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(np.atleast_2d(ids))).logits.numpy()


KINDS = ["llama", "qwen2", "gemma3", "gpt2"]
OURS = {"llama": "euler", "qwen2": "qwen2", "gemma3": "gemma3", "gpt2": "gpt2"}


@pytest.mark.parametrize("kind", KINDS)
def test_import_logits_and_gradients_equal_torch(folders, kind):
    from test_interop import torch_loss_backward

    from nanoeuler.interop.hf import load_hf_folder
    hf, d = folders[kind]
    cfg, params, tok = load_hf_folder(d)
    assert cfg.arch == OURS[kind]
    if kind == "gemma3":
        assert cfg.head_dim == 16 and cfg.sliding_window == 5 and cfg.global_every == 3
        assert [cfg.window(i) for i in range(3)] == [5, 5, 0] and cfg.rope_local_theta == 1000.0
    m = Model(cfg, params)
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, T + 1))
    ours = m.logits(ids[:, :T])[0]
    assert rel_err(ours, torch_logits(hf, ids[:, :T])) <= LOGITS_TOL
    loss, _, grads = m.loss_and_grads(ids)
    t_loss = torch_loss_backward(hf, ids)
    assert abs(loss - t_loss) <= 1e-5 * abs(t_loss)
    from nanoeuler.interop.hf import to_hf
    theirs = {n.removeprefix("transformer."): p.grad.numpy() for n, p in hf.named_parameters()}
    mine = to_hf(cfg, grads)   # named and laid out as theirs
    offset = cfg.spec.hf.norm_offset
    for name, g in mine.items():
        if name in theirs:
            if offset and "norm" in name:
                g = g + offset  # to_hf shifted the gradient like a weight; a gradient has no offset
            tol = NORM_GRAD_TOL if "norm" in name else GRAD_TOL
            assert rel_err(g, theirs[name]) <= tol, name


@pytest.mark.parametrize("kind", KINDS)
def test_hf_round_trip_is_exact(folders, kind, tmp_path):
    """HF -> ours -> HF: the same tensors (Gemma's norms: the same 1 + w), and transformers' logits equal."""
    from nanoeuler.interop.hf import export_hf, load_hf_folder
    _, d = folders[kind]
    cfg, params, tok = load_hf_folder(d)
    out = export_hf(Model(cfg, params), tok, tmp_path / "out", progress=False)
    load = transformers.AutoModelForCausalLM.from_pretrained
    first, again = (load(f, attn_implementation="eager").float().eval() for f in (d, out))
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, (1, T))
    a, b = torch_logits(first, ids), torch_logits(again, ids)
    assert rel_err(b, a, floor=1e-6) <= 1e-6
    cfg2, params2, _ = load_hf_folder(out)
    assert cfg2 == cfg
    for n in params:
        assert np.array_equal(params[n], params2[n]), n


@pytest.mark.parametrize("kind", KINDS)
def test_gguf_round_trip_is_exact(folders, kind, tmp_path):
    """ours -> GGUF (f32) -> ours: every tensor bit for bit, the same config, the same logits."""
    pytest.importorskip("gguf")
    from nanoeuler.interop.gguf_export import export_gguf
    from nanoeuler.interop.gguf_import import load_gguf
    from nanoeuler.interop.hf import load_hf_folder
    _, d = folders[kind]
    cfg, params, tok = load_hf_folder(d)
    path = export_gguf(Model(cfg, params), tok, tmp_path / "m.gguf", progress=False)
    cfg2, params2, _, source = load_gguf(path)
    assert cfg2 == cfg and source["format"] == "gguf"
    for n in params:
        assert np.array_equal(params[n], params2[n]), n


@pytest.mark.parametrize("kind", KINDS)
def test_llama_cpp_runs_our_gguf_export(folders, kind, tmp_path):
    """llama.cpp loads our F32 export of each architecture and computes our logits (relative L2; GELU through
    its float16 table: gemma3, gpt2 ~3e-4) and our greedy tokens."""
    pytest.importorskip("llama_cpp")
    from nanoeuler.infer.session import generate
    from nanoeuler.interop.gguf_export import export_gguf
    from nanoeuler.interop.hf import load_hf_folder
    from nanoeuler.interop.llamacpp import LlamaCpp
    _, d = folders[kind]
    cfg, params, tok = load_hf_folder(d)
    m = Model(cfg, params)
    path = export_gguf(m, tok, tmp_path / "m.gguf", progress=False)
    lc = LlamaCpp(path, n_ctx=cfg.ctx_len, logits_all=True)
    ids = list(np.random.default_rng(3).integers(0, cfg.vocab_size, T))
    theirs, mine = lc.logits(ids), m.logits(np.array([ids]))[0, 0]
    l2 = np.linalg.norm(theirs - mine) / np.linalg.norm(mine)  # windows included (T 24 > window 5)
    assert l2 <= (1e-3 if cfg.spec.mlp != "swiglu" else 1e-5)
    assert lc.greedy(ids[:5], 16)[0] == generate(m, ids[:5], 16, temperature=0, stop_ids=[]).ids


def test_a_query_pre_attn_scalar_other_than_head_dim_is_refused(folders, tmp_path):
    """transformers' Gemma 3 divides q·k by √query_pre_attn_scalar (Gemma 3 27B: 168, its head_dim 128), ours by
    √head_dim: a config whose two differ attends otherwise, and is refused in one line naming the key."""
    import shutil

    from nanoeuler.errors import UserError
    from nanoeuler.interop.hf import load_hf_folder
    hf, d = folders["gemma3"]
    shutil.copytree(d, tmp_path / "g")
    c = json.loads((tmp_path / "g" / "config.json").read_text())
    (tmp_path / "g" / "config.json").write_text(json.dumps(c | {"query_pre_attn_scalar": 24}))
    ids = np.arange(T) % 50
    other = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "g", attn_implementation="eager").float()
    assert rel_err(torch_logits(other, ids), torch_logits(hf, ids)) > 1e-3
    with pytest.raises(UserError, match="query_pre_attn_scalar=24 differs from head_dim 16") as e:
        load_hf_folder(tmp_path / "g")
    assert "\n" not in str(e.value)


def test_a_gemma3_config_without_a_window_pattern_reads_as_transformers_reads_it(tmp_path):
    """A Gemma 3 config.json with neither layer_types nor sliding_window_pattern: transformers takes every 6th
    layer global, and so does the import."""
    from test_interop import hf_tokenizer_json

    from nanoeuler.interop.hf import load_hf_folder
    model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
        vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=7, num_attention_heads=4,
        num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16, sliding_window=5, pad_token_id=None))
    model.save_pretrained(tmp_path)
    (tmp_path / "tokenizer.json").write_text(hf_tokenizer_json(bundled_works()["hamlet"][:30000], "gpt2", vocab=300))
    c = json.loads((tmp_path / "config.json").read_text())
    c = {k: v for k, v in c.items() if k not in ("layer_types", "sliding_window_pattern")}
    (tmp_path / "config.json").write_text(json.dumps(c))
    theirs = transformers.AutoConfig.from_pretrained(tmp_path).layer_types
    cfg = load_hf_folder(tmp_path)[0]
    assert [cfg.window(i) == 0 for i in range(7)] == [t == "full_attention" for t in theirs]
    assert theirs.count("full_attention") == 1
