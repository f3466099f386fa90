"""Every architecture of arch.py against transformers: a random model of each, built by transformers and saved as
a Hugging Face folder, is imported; our logits and loss gradients equal transformers' (torch autograd), and
the export back (HF and GGUF) gives the same tensors and the same logits; the GGUF that llama.cpp's own
converter writes from the folder imports too, and llama.cpp decodes it greedily as we do. No network: every
model is made here.

The cases loop over the registry (ARCHS), each at one small size (`small_config`) with what makes it itself
switched on: its own head width (16, not dim / heads) where it has q/k norms (Gemma 3's and Qwen3's real
models have one; llama.cpp's qwen2 reads none), a window (5, its own RoPE base, the architecture's pattern of
global layers, which llama.cpp fixes: Gemma 3's every 6th) where its GGUF architecture reads one too, and RoPE scalings
(ROPE_SCALINGS: linear, Llama 3.2's llama3 with its tied head, yarn) on the first architecture with RoPE,
LongRoPE's short and long factors where the GGUF reads them (Phi-3's), and linear where global layers sit
between windowed ones (Gemma 3 4B's: the global layers only). The
folder's config.json is the one our export writes for that config (interop.hf.hf_config): transformers, the
oracle, builds its model from it, so a key both sides misread shows as other logits.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import rel_err
from nanoeuler import Config, Model
from nanoeuler.arch import ARCHS, by_format
from nanoeuler.data.corpus import bundled_works

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

# float32: logits within L2_TOL (relative L2, the measure: 2.5e-7 .. 9.4e-7 measured) and every entry
# within LOGITS_TOL (conftest.rel_err; gemma3's 6 layers: 1.3e-4, the others up to 4.6e-5). (transformers cannot
# be the oracle in float64: its norms and RoPE angles are computed in float32 whatever the model's dtype.) A
# norm's weight gradient sums B·T (q/k norms: B·T·heads) terms that partly cancel: up to 5.4e-4 measured,
# against 2.6e-4 for the others (gemma3's 6 layers; the 3-layer ones up to 7.7e-5) - and 4.6e-4 for gemma3+linear's
# layer-4 q_proj with transformers 5.25 / torch 2.13, so GRAD_TOL leaves 2x over that (a wrong term reads as ~1).
L2_TOL, LOGITS_TOL, GRAD_TOL, NORM_GRAD_TOL = 1e-5, 2e-4, 1e-3, 2e-3
T = 24                              # longer than the window (5)
FIRST_ROPE = next(a.name for a in ARCHS.values() if a.positions == "rope")
# RoPE scalings of the first architecture with RoPE; llama3: Llama 3.2's (factor 32, low / high freq factors 1 / 4,
# original context 8192, θ 500,000, tied head): head 8's pairs at wavelengths 6.3, 167, 4,444, 118,000 fall in
# all three regimes (below 2,048 unscaled, between it and 8,192 blended, above divided by 32); yarn: Qwen3's
# factor 4, its ramp over head 8's pairs 0, 0, 1/3, 2/3 at θ 5,000 (ops/rope.py), attention factor 1.14 (llama.cpp
# reads neither beta_fast nor beta_slow from a GGUF: the defaults; other values: test_rope against transformers)
ROPE_SCALINGS = {"linear": dict(rope_scaling="linear", rope_factor=4.0),
                 "llama3": dict(rope_theta=500000.0, rope_scaling="llama3", rope_factor=32.0, tie_embeddings=True),
                 "yarn": dict(rope_scaling="yarn", rope_factor=4.0, rope_original_ctx=4096)}
# LongRoPE where the format reads it (Phi-3's): short and long factors, the long ones where the model runs beyond
# its original context (16 < ctx_len 64: transformers takes them too, for a sequence of T = 24 > 16; attention
# factor √(1 + ln 4 / ln 16) from factor 64 / 16), every pair turning (Phi-3.5-mini's); the short ones up to it
# (original 256, as llama.cpp pads its context to a multiple of 256 and chooses by that: factor 64 / 256, attention
# 1), with half of each head turning and a factor for each turned pair only (Phi-4-mini's 0.75: 48 of 64 pairs)
LONGROPES = {"longrope": dict(rope_scaling="longrope", rope_freq_factors=(1.0, 1.5, 2.0, 3.0),
                              rope_long_factors=(1.0, 2.0, 5.0, 9.0), partial_rotary_factor=1.0,
                              rope_original_ctx=16, rope_factor=4.0),
             "shortrope": dict(rope_scaling="longrope", rope_freq_factors=(1.5, 3.0), rope_long_factors=(2.0, 9.0),
                               partial_rotary_factor=0.5, rope_original_ctx=256, rope_factor=64 / 256)}
# and linear scaling where global layers sit between windowed ones, which keep plain RoPE (Gemma 3 4B's factor 8)
# Granite 3's multipliers (its 2B: 12, 0.22, 1/64, 8), here each far from its default at dim 32
MULTIPLIERS = dict(embedding_multiplier=2.5, residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=3.0)
CASES = list(ARCHS) + [f"{FIRST_ROPE}+{r}" for r in ROPE_SCALINGS] + [
    f"{a.name}+{r}" for a in ARCHS.values() if a.gguf.rope_long_short for r in LONGROPES] + [
    f"{a.name}+linear" for a in ARCHS.values() if a.defaults.get("global_every")] + [
    f"{a.name}+sequential" for a in ARCHS.values() if a.defaults.get("parallel_residual")]   # (GPT-NeoX's other block)


def small_config(case: str, vocab: int) -> Config:
    """The case's config (see the module docstring): what the record says it has, switched on."""
    name, _, rope = case.partition("+")
    a = ARCHS[name]
    fields = dict(vocab_size=vocab, dim=32, n_heads=4, n_kv_heads=2 if "n_kv_heads" in a.hf.config else 4,
                  n_layers=3, ctx_len=64, ffn_hidden=48 if a.gated else 128, n_mtp=1, arch=name)  # (GPT-2's: 4·dim,
                                                                   # as llama.cpp's converter writes it, not n_inner)
    if a.qk_norm and not a.qk_norm_whole:   # (OLMo 2's whole-projection norms: llama.cpp's head width dim / heads)
        fields["head_dim"] = 16
    if a.positions == "rope":
        fields |= dict(rope_theta=5000.0, norm_eps=1e-6)
    if "partial_rotary_factor" in a.defaults:   # two of head 8's four pairs turn
        fields["partial_rotary_factor"] = 0.5
    if gguf_reads_window(a):
        every = a.defaults["global_every"]
        fields |= dict(sliding_window=5, global_every=every, n_layers=max(3, every))
        if "rope_local_theta" in a.hf.config:   # (Gemma 2 has one base)
            fields["rope_local_theta"] = 1000.0
    if a.defaults.get("attn_softcap"):          # caps that bite (Gemma 2's 50 / 30 barely touch a tiny model)
        fields |= dict(attn_softcap=0.5, logit_softcap=2.0)
    if a.multipliers:                           # Granite's, each away from its default
        fields |= MULTIPLIERS
    if a.defaults.get("no_rope_every"):         # deep enough for a layer without RoPE (llama.cpp's smollm3: every 4th)
        fields["n_layers"] = max(fields["n_layers"], a.defaults["no_rope_every"])
    if rope == "sequential":                    # GPT-NeoX's use_parallel_residual false
        fields["parallel_residual"] = False
    return Config(**fields | ROPE_SCALINGS.get(rope, {}) | LONGROPES.get(rope, {}))


def gguf_reads_window(a) -> bool:
    """Whether llama.cpp's architecture of a's GGUF name attends through a window (gemma3's; not llama's, which
    mistral's files are, nor starcoder2's)."""
    return "sliding_window" in by_format("gguf", a.gguf.name).defaults and a.gguf.reads_window


WINDOWED_HF_ONLY = [a.name for a in ARCHS.values() if "sliding_window" in a.defaults and not gguf_reads_window(a)]


def hf_model(cfg: Config, tok, seed: int = 0):
    """transformers' random model of cfg's config.json as our export writes it, its norms away from their init and
    biases nonzero so that their mapping is tested."""
    from nanoeuler.interop.hf import hf_config
    c = hf_config(cfg, tok, cfg.tie_embeddings)
    conf = transformers.AutoConfig.for_model(c.pop("model_type"), **c)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(conf, attn_implementation="eager").float().eval()
    offset = cfg.spec.hf.norm_offset
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "ln_" in name:
                p.copy_(1.0 - offset + 0.3 * torch.randn_like(p))
            else:
                p.normal_(0, 0.1)
    return model


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """case -> (transformers' model, its folder, our config of it)."""
    from test_interop import hf_tokenizer_json

    from nanoeuler.interop.hf_tokenizer import from_hf_json
    text = bundled_works()["hamlet"][:30000]
    tok_json = hf_tokenizer_json(text, "gpt2", vocab=300)
    n_tok = len(json.loads(tok_json)["model"]["vocab"])
    tok = from_hf_json(json.loads(tok_json), n_tok, 0)
    out = {}
    for case in CASES:
        d = tmp_path_factory.mktemp(case.replace("+", "-"))
        cfg = small_config(case, n_tok)
        model = hf_model(cfg, tok)
        model.save_pretrained(d)
        keep_format_keys(d, cfg, tok)
        (d / "tokenizer.json").write_text(tok_json)   # as it is (AutoTokenizer would add a family's specials)
        (d / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "GPT2Tokenizer"}))  # (Phi-3's converter
                                                     # takes the GPT-2 vocabulary path for it, as for Phi-4)
        out[case] = (model, d, cfg)
    return out


def keep_format_keys(d: Path, cfg: Config, tok) -> None:
    """The format's own names for RoPE's base and rotary fraction where they are not transformers 5's
    rope_parameters names (GPT-NeoX's rotary_emb_base, rotary_pct), which save_pretrained folds into
    rope_parameters, put back in d's config.json with our export's values, as a published folder has them
    (llama.cpp's converter reads rotary_pct)."""
    from nanoeuler.interop.hf import hf_config
    c, ours, keys = json.loads((d / "config.json").read_text()), hf_config(cfg, tok, cfg.tie_embeddings), cfg.spec.hf.config
    missing = {k: ours[k] for f in ("rope_theta", "partial_rotary_factor") for k in keys.get(f, ())
               if k != f and k in ours and k not in c}
    if missing:
        (d / "config.json").write_text(json.dumps(c | missing, indent=2))


def torch_logits(model, ids) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(np.atleast_2d(ids))).logits.numpy()


def l2(a, b) -> float:
    """The relative L2 distance of a from b."""
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def assert_logits_equal(ours, theirs) -> None:
    assert l2(ours, theirs) <= L2_TOL and rel_err(ours, theirs) <= LOGITS_TOL


@pytest.mark.parametrize("case", CASES)
def test_import_logits_and_gradients_equal_torch(folders, case):
    from test_interop import torch_loss_backward

    from nanoeuler.interop.hf import load_hf_folder
    hf, d, want = folders[case]
    cfg, params, tok = load_hf_folder(d)
    assert cfg == want
    m = Model(cfg, params)
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, T + 1))
    ours, theirs = m.logits(ids[:, :T])[0], torch_logits(hf, ids[:, :T])
    assert_logits_equal(ours, theirs)
    if cfg.rope_scaling != "none":   # the scaling is seen: plain RoPE computes other logits (llama3: 9e-4)
        plain = cfg.replace(rope_scaling="none", rope_freq_factors=None, rope_long_factors=None)
        assert l2(Model(plain, params).logits(ids[:, :T])[0], theirs) > 10 * L2_TOL
    for cap in ("attn_softcap", "logit_softcap"):   # so are the soft caps
        if getattr(cfg, cap):
            assert l2(Model(cfg.replace(**{cap: 0.0}), params).logits(ids[:, :T])[0], theirs) > 10 * L2_TOL
    for name in MULTIPLIERS if cfg.spec.multipliers else ():   # each multiplier is seen too
        assert l2(Model(cfg.replace(**{name: None}), params).logits(ids[:, :T])[0], theirs) > 10 * L2_TOL, name
    if cfg.no_rope_every:   # and the layers without RoPE (every layer turning computes other logits)
        assert l2(Model(cfg.replace(no_rope_every=0), params).logits(ids[:, :T])[0], theirs) > 10 * L2_TOL
    if cfg.parallel_residual:   # and the parallel residual (the MLP reading x + attn computes other logits)
        assert l2(Model(cfg.replace(parallel_residual=False), params).logits(ids[:, :T])[0], theirs) > 10 * L2_TOL
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


@pytest.mark.parametrize("case", CASES)
def test_hf_round_trip_is_exact(folders, case, tmp_path):
    """HF -> ours -> HF: the same tensors (Gemma's norms: the same 1 + w), and transformers' logits equal."""
    from nanoeuler.interop.hf import export_hf, load_hf_folder
    _, d, _ = folders[case]
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


@pytest.mark.parametrize("case", CASES)
def test_gguf_round_trip_is_exact(folders, case, tmp_path):
    """ours -> GGUF (f32) -> ours: every tensor bit for bit, the same config (the architecture the GGUF name reads
    as: mistral's files are llama's), the same logits."""
    pytest.importorskip("gguf")
    from nanoeuler.interop.gguf_export import export_gguf
    from nanoeuler.interop.gguf_import import load_gguf
    from nanoeuler.interop.hf import load_hf_folder
    _, d, _ = folders[case]
    cfg, params, tok = load_hf_folder(d)
    path = export_gguf(Model(cfg, params), tok, tmp_path / "m.gguf", progress=False)
    cfg2, params2, _, source = load_gguf(path)
    assert cfg2 == cfg.replace(arch=by_format("gguf", cfg.spec.gguf.name).name) and source["format"] == "gguf"
    for n in params:
        assert np.array_equal(params[n], params2[n]), n


@pytest.mark.parametrize("case", CASES)
def test_llama_cpp_runs_our_gguf_export(folders, case, tmp_path):
    """llama.cpp loads our F32 export of each architecture and computes our logits (relative L2; GELU through
    its float16 table: gemma3, gpt2 ~3e-4) and our greedy tokens."""
    pytest.importorskip("llama_cpp")
    from nanoeuler.infer.session import generate
    from nanoeuler.interop.gguf_export import export_gguf
    from nanoeuler.interop.hf import load_hf_folder
    from nanoeuler.interop.llamacpp import LlamaCpp
    _, d, _ = folders[case]
    cfg, params, tok = load_hf_folder(d)
    m = Model(cfg, params)
    path = export_gguf(m, tok, tmp_path / "m.gguf", progress=False)
    lc = LlamaCpp(path, n_ctx=cfg.ctx_len, logits_all=True)
    ids = list(np.random.default_rng(3).integers(0, cfg.vocab_size, T))
    theirs, mine = lc.logits(ids), m.logits(np.array([ids]))[0, 0]
    assert l2(theirs, mine) <= (1e-3 if cfg.spec.mlp != "swiglu" else 1e-5)   # windows included (T 24 > window 5)
    assert lc.greedy(ids[:5], 16)[0] == generate(m, ids[:5], 16, temperature=0, stop_ids=[]).ids


# llama.cpp's convert_hf_to_gguf.py on a folder, with two things of ours said: the folder has no SentencePiece
# tokenizer.model (the converter imports sentencepiece before looking for one; a family whose converter reads
# nothing else, Gemma 2's, takes the GPT-2 vocabulary path as Gemma 3's does without one), and its tokenizer,
# trained here with GPT-2's split, splits text as GPT-2's (the converter knows a pre-tokenizer by the hash of a
# published vocabulary's ids, which a vocabulary trained here does not have); its hparams keep config.json's keys
# that transformers 5's config drops (GPT-NeoX's rotary_pct). The model is named "tiny": llama.cpp
# takes a name with "phi3" in it (the folder's, phi30) for Phi-3's and looks for that vocabulary's <s>, </s>, <unk>
CONVERT = """
import runpy, sys
src, folder, out = sys.argv[1:4]
sys.path[:0] = [src, src + "/gguf-py"]
import conversion.base as base
def no_sentencepiece(self):
    raise FileNotFoundError("no tokenizer.model")
base.TextModel._create_vocab_sentencepiece = no_sentencepiece
base.TextModel._set_vocab_sentencepiece = lambda self, *args, **kwargs: self._set_vocab_gpt2()
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
load = base.ModelBase.load_hparams
def with_raw_keys(dir_model, *args, **kwargs):   # transformers 5's to_dict() drops what it folds into
    import json, pathlib       # rope_parameters (GPT-NeoX's rotary_pct, which the converter reads): config.json's back
    c = load(dir_model, *args, **kwargs)
    raw = json.loads((pathlib.Path(dir_model) / "config.json").read_text())
    return c | {k: v for k, v in raw.items() if k not in c}
base.ModelBase.load_hparams = staticmethod(with_raw_keys)
sys.argv = ["convert_hf_to_gguf.py", folder, "--outfile", out, "--outtype", "f32", "--model-name", "tiny"]
runpy.run_path(src + "/convert_hf_to_gguf.py", run_name="__main__")
"""


def llama_cpp_sources() -> Path:
    """llama.cpp's sources (convert_hf_to_gguf.py, conversion/, gguf-py/) in llama-cpp-python's unpacked source
    distribution: $LLAMA_CPP_SRC, else .cache/llama-cpp-python where `make llama-src` puts it; or skip."""
    src = Path(os.environ.get("LLAMA_CPP_SRC") or Path(__file__).resolve().parent.parent / ".cache" / "llama-cpp-python")
    for folder in (src / "vendor" / "llama.cpp", src):
        if (folder / "convert_hf_to_gguf.py").is_file():
            return folder
    pytest.skip("llama.cpp's converter is not fetched: run `make llama-src` (or set LLAMA_CPP_SRC to an unpacked "
                "llama-cpp-python source distribution)")


@pytest.mark.parametrize("case", CASES)
def test_the_gguf_llama_cpps_converter_writes_imports_and_decodes_as_llama_cpp(folders, case, tmp_path):
    """The GGUF that llama.cpp's own converter writes from the folder (its RoPE scaling as llama.cpp reads it: a
    linear factor, or Llama 3's rope_freqs tensor) imports as the folder's config, computes transformers'
    logits, and decodes greedily the tokens llama.cpp decodes from the same file."""
    pytest.importorskip("llama_cpp")
    from nanoeuler.infer.session import generate
    from nanoeuler.interop.gguf_import import load_gguf, open_gguf
    from nanoeuler.interop.hf import load_hf_folder
    from nanoeuler.interop.llamacpp import LlamaCpp
    hf, d, want = folders[case]
    path = tmp_path / "converted.gguf"
    run = subprocess.run([sys.executable, "-c", CONVERT, str(llama_cpp_sources()), str(d), str(path)],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    cfg, params, _, _ = load_gguf(path)
    if f"{want.spec.gguf.name}.rope.freq_base" not in open_gguf(path).meta:   # a converter that writes no RoPE
        # parameters (Gemma 2's): llama.cpp, and the import, take base 10000 unscaled; transformers' model of that
        want = want.replace(rope_theta=10000.0, rope_scaling="none", rope_factor=1.0)   # RoPE, the same weights
        hf = hf_model(want, load_hf_folder(d)[2])
    assert cfg == want.replace(arch=by_format("gguf", want.spec.gguf.name).name)
    m = Model(cfg, params)
    ids = np.random.default_rng(4).integers(0, cfg.vocab_size, (1, T))
    assert_logits_equal(m.logits(ids)[0], torch_logits(hf, ids))
    lc = LlamaCpp(path, n_ctx=cfg.ctx_len, logits_all=True)
    prompt = list(ids[0, :5])
    assert lc.greedy(prompt, 16)[0] == generate(m, prompt, 16, temperature=0, stop_ids=[]).ids


@pytest.mark.parametrize("name", WINDOWED_HF_ONLY)
def test_a_windowed_model_imports_from_hf_and_is_refused_for_gguf(folders, tmp_path, name):
    """Mistral's and StarCoder2's window (every layer) imports from its config.json, as transformers reads it;
    llama.cpp's converter writes a Mistral as `llama`, and llama.cpp's starcoder2, which read no window: our GGUF
    export refuses it in one line."""
    from nanoeuler.errors import UserError
    from nanoeuler.interop.gguf_export import export_gguf
    from nanoeuler.interop.hf import load_hf_folder
    _, d, _ = folders[name]
    c = json.loads((d / "config.json").read_text())
    (tmp_path / "w").mkdir()
    for f in d.iterdir():
        (tmp_path / "w" / f.name).write_bytes(f.read_bytes())
    (tmp_path / "w" / "config.json").write_text(json.dumps(c | {"sliding_window": 5}))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "w", attn_implementation="eager").float().eval()
    cfg, params, tok = load_hf_folder(tmp_path / "w")
    assert [cfg.window(i) for i in range(cfg.n_layers)] == [5] * cfg.n_layers
    ids = np.random.default_rng(5).integers(0, cfg.vocab_size, (1, T))
    theirs = torch_logits(hf, ids)
    assert_logits_equal(Model(cfg, params).logits(ids)[0], theirs)
    assert l2(Model(cfg.replace(sliding_window=0), params).logits(ids)[0], theirs) > 10 * L2_TOL   # (T 24 > 5)
    refused = f"cannot export to GGUF: llama.cpp's {ARCHS[name].gguf.name} has no sliding window"
    with pytest.raises(UserError, match=refused):
        export_gguf(Model(cfg, params), tok, tmp_path / "m.gguf", progress=False)


@pytest.mark.parametrize("case", [c for c in CASES if c.endswith("rope")
                                  and "sliding_window" in ARCHS[c.split("+")[0]].defaults])
def test_a_window_wider_than_the_context_is_none_beside_longrope(folders, tmp_path, case):
    """Phi-3.5-mini's and Phi-4-mini's config.json: a window of 262,144 on every layer over a 131,072-position
    context, beside LongRoPE. It leaves out no key, so the model imports as one without a window (transformers'
    logits), not refused as RoPE scaling beside windowed layers; a window one narrower than the context is."""
    from nanoeuler.errors import UserError
    from nanoeuler.interop.hf import load_hf_folder
    hf, d, want = folders[case]
    c = json.loads((d / "config.json").read_text())
    (tmp_path / "w").mkdir()
    for f in d.iterdir():
        (tmp_path / "w" / f.name).write_bytes(f.read_bytes())
    (tmp_path / "w" / "config.json").write_text(json.dumps(c | {"sliding_window": 2 * want.ctx_len}))
    cfg, params, _ = load_hf_folder(tmp_path / "w")
    assert cfg == want and cfg.sliding_window == 0
    ids = np.random.default_rng(6).integers(0, cfg.vocab_size, (1, T))
    assert_logits_equal(Model(cfg, params).logits(ids)[0], torch_logits(hf, ids))
    (tmp_path / "w" / "config.json").write_text(json.dumps(c | {"sliding_window": want.ctx_len - 1}))
    with pytest.raises(UserError, match="every layer is windowed"):
        load_hf_folder(tmp_path / "w")


def test_a_no_rope_layers_list_reads_as_transformers_reads_it(folders, tmp_path):
    """transformers' SmolLM3 reads no_rope_layers (1: the layer turns q and k, 0: it does not), its
    no_rope_layer_interval only where the list is missing: a list of another pattern than the interval's imports
    as the list says (every 2nd layer) and computes transformers' logits; a list that is not one layer every n-th
    is refused in one line naming it; and the GGUF export refuses layers without RoPE other than llama.cpp's
    (its smollm3 skips every 4th, whatever a file says)."""
    import shutil

    from nanoeuler.errors import UserError
    from nanoeuler.interop.gguf_export import export_gguf
    from nanoeuler.interop.hf import load_hf_folder
    _, d, want = folders["smollm3"]
    assert want.no_rope_every == 4 and want.n_layers == 4
    shutil.copytree(d, tmp_path / "s")
    c = json.loads((tmp_path / "s" / "config.json").read_text())
    (tmp_path / "s" / "config.json").write_text(json.dumps(c | {"no_rope_layers": [1, 0, 1, 0],
                                                               "no_rope_layer_interval": 4}))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "s", attn_implementation="eager").float().eval()
    cfg, params, tok = load_hf_folder(tmp_path / "s")
    assert cfg == want.replace(no_rope_every=2)
    ids = np.random.default_rng(6).integers(0, cfg.vocab_size, (1, T))
    theirs = torch_logits(hf, ids)
    assert_logits_equal(Model(cfg, params).logits(ids)[0], theirs)
    assert l2(Model(want, params).logits(ids)[0], theirs) > 10 * L2_TOL
    with pytest.raises(UserError, match="cannot export to GGUF: llama.cpp's smollm3 fixes no_rope_every at 4 "
                                        r"\(this model: 2\)"):
        export_gguf(Model(cfg, params), tok, tmp_path / "m.gguf", progress=False)
    (tmp_path / "s" / "config.json").write_text(json.dumps(c | {"no_rope_layers": [1, 0, 0, 1]}))
    with pytest.raises(UserError, match=r"no_rope_layers \[1, 0, 0, 1\] is not a layer without RoPE every n-th") as e:
        load_hf_folder(tmp_path / "s")
    assert "\n" not in str(e.value)


def test_a_window_the_gguf_states_and_llama_cpp_ignores_imports_as_none(folders, tmp_path):
    """llama.cpp's converter writes a Phi-3's window (Phi-3-mini's 2047) into the GGUF, and llama.cpp's phi3
    attends over every position whatever it says (Format.reads_window): the import takes no window, as llama.cpp
    computes, and decodes llama.cpp's greedy tokens (the window, wider than every sequence here, changes nothing
    for transformers either)."""
    import shutil

    from nanoeuler.interop.gguf_import import load_gguf, open_gguf
    name = "phi3"
    hf, d, want = folders[name]
    shutil.copytree(d, tmp_path / "w")
    c = json.loads((tmp_path / "w" / "config.json").read_text())
    (tmp_path / "w" / "config.json").write_text(json.dumps(c | {"sliding_window": 2047, "use_sliding_window": True}))
    path = tmp_path / "converted.gguf"
    run = subprocess.run([sys.executable, "-c", CONVERT, str(llama_cpp_sources()), str(tmp_path / "w"), str(path)],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    assert open_gguf(path).meta.get(f"{name}.attention.sliding_window") == 2047
    cfg, params, _, _ = load_gguf(path)
    assert cfg == want and cfg.sliding_window == 0
    m = Model(cfg, params)
    ids = np.random.default_rng(7).integers(0, cfg.vocab_size, (1, T))
    assert_logits_equal(m.logits(ids)[0], torch_logits(hf, ids))
    pytest.importorskip("llama_cpp")
    from nanoeuler.infer.session import generate
    from nanoeuler.interop.llamacpp import LlamaCpp
    prompt = list(ids[0, :5])
    assert LlamaCpp(path, n_ctx=cfg.ctx_len).greedy(prompt, 16)[0] == generate(m, prompt, 16, temperature=0,
                                                                                stop_ids=[]).ids


@pytest.mark.parametrize("name", [a.name for a in ARCHS.values() if a.gguf.head_required])
def test_a_tied_head_is_written_where_llama_cpp_requires_one(folders, tmp_path, name):
    """llama.cpp's olmo2, stablelm and gptneox load `output` and never fall back to the embedding (it once refused
    our export of a tied OLMo 2): the GGUF export writes the embedding's copy there, which imports back as the
    tied model (the same config and tensors), and llama.cpp loads the file and decodes our greedy tokens."""
    from nanoeuler.interop.gguf_export import export_gguf
    from nanoeuler.interop.gguf_import import load_gguf, open_gguf
    from nanoeuler.interop.hf import load_hf_folder
    cfg, params, tok = load_hf_folder(folders[name][1])
    cfg = cfg.replace(tie_embeddings=True)
    m = Model(cfg, {n: params[n] for n in cfg.param_shapes()})
    path = export_gguf(m, tok, tmp_path / "m.gguf", progress=False)
    assert "output.weight" in [t.name for t in open_gguf(path).tensors]
    cfg2, params2, _, _ = load_gguf(path)
    assert cfg2 == cfg and all(np.array_equal(params2[n], m.params[n]) for n in m.params)
    pytest.importorskip("llama_cpp")
    from nanoeuler.infer.session import generate
    from nanoeuler.interop.llamacpp import LlamaCpp
    prompt = list(np.random.default_rng(8).integers(0, cfg.vocab_size, 5))
    assert LlamaCpp(path, n_ctx=cfg.ctx_len).greedy(prompt, 16)[0] == generate(m, prompt, 16, temperature=0,
                                                                                stop_ids=[]).ids


def test_a_query_pre_attn_scalar_other_than_head_dim_is_refused(folders, tmp_path):
    """transformers' Gemma 3 divides q·k by √query_pre_attn_scalar (Gemma 3 27B: 168, its head_dim 128), ours by
    √head_dim: a config whose two differ attends otherwise, and is refused in one line naming the key."""
    import shutil

    from nanoeuler.errors import UserError
    from nanoeuler.interop.hf import load_hf_folder
    hf, d, _ = folders["gemma3"]
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
