"""llama.cpp (llama-cpp-python) on our exported GGUF: the same greedy tokens and logits as ours.

Skipped when llama_cpp is not installed (it compiles llama.cpp: `pip install 'nanoeuler[llama]'`; it is not
in `make test`'s install). A tiny model is trained for a few steps here; set NANOEULER_INTEROP_RUNS to
colon-separated checkpoint directories (e.g. trained `small` and `big`) to run the same checks on them.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

from conftest import rel_err
from gguf_fixtures import train_briefly
from nanoeuler import Model, Tokenizer
from nanoeuler.checkpoint import load_tokenizer
from nanoeuler.data.corpus import bundled_split, bundled_works
from nanoeuler.infer.session import generate

pytest.importorskip("llama_cpp")
pytest.importorskip("gguf")

from nanoeuler.interop.gguf_export import export_gguf  # noqa: E402
from nanoeuler.interop.llamacpp import LlamaCpp  # noqa: E402


def tiny_trained(tmp_path_factory):
    from nanoeuler.config import Config
    works = bundled_works()
    tok = Tokenizer.train([works["hamlet"]], 400, progress=False)
    cfg = Config(vocab_size=400, dim=64, n_heads=4, n_kv_heads=2, n_layers=2, ctx_len=128, ffn_hidden=128, n_mtp=2)
    m = train_briefly(Model.init(cfg, seed=0), tok, 30, 0.5, 66)
    d = tmp_path_factory.mktemp("tiny") / "run"
    m.save(d, tok)
    return d


RUNS = [p for p in os.environ.get("NANOEULER_INTEROP_RUNS", "").split(":") if p]


@pytest.fixture(scope="module", params=["tiny", *RUNS])
def run(request, tmp_path_factory):
    return tiny_trained(tmp_path_factory) if request.param == "tiny" else request.param


def heldout_ids(tok, n):
    _, val = bundled_split()
    return tok.encode(bundled_works()[val[1]][2000:2000 + 8 * n])[:n]


def test_llama_cpp_f32_greedy_and_logits_equal_ours(run, tmp_path):
    m, tok = Model.load(run), load_tokenizer(run)
    path = export_gguf(m, tok, tmp_path / "m.gguf", "f32", progress=False)
    T = m.config.ctx_len
    prompt = heldout_ids(tok, 32)
    ours = generate(m, prompt, max_new_tokens=64, temperature=0, mode="cache").ids
    theirs, _ = LlamaCpp(path, n_ctx=T).greedy(prompt, 64)
    assert theirs == ours
    window = heldout_ids(tok, T)
    lc = LlamaCpp(path, n_ctx=T, logits_all=True)
    assert rel_err(lc.logits(window), m.logits(np.array([window]))[0, 0]) <= 1e-4


@pytest.mark.parametrize("dtype", ["f16", "q8_0"])
def test_llama_cpp_reduced_precision_stays_close(run, tmp_path, dtype):
    m, tok = Model.load(run), load_tokenizer(run)
    path = export_gguf(m, tok, tmp_path / f"m-{dtype}.gguf", dtype, progress=False)
    assert path.stat().st_size < 0.6 * 4 * m.n_params()
    window = heldout_ids(tok, m.config.ctx_len)
    lc = LlamaCpp(path, n_ctx=m.config.ctx_len, logits_all=True)
    # rounded weights (and llama.cpp's 8-bit activations at q8_0) move every logit by a share of the logits'
    # scale, not of its own size: measured against the largest logit (floor 1)
    assert rel_err(lc.logits(window), m.logits(np.array([window]))[0, 0], floor=1.0) <= 5e-2


def test_llama_cpp_reads_the_tokenizer_metadata(run, tmp_path):
    """llama.cpp's own tokenizer (gpt-2 pre-tokenizer) on our vocabulary gives our ids on ordinary text."""
    m, tok = Model.load(run), load_tokenizer(run)
    path = export_gguf(m, tok, tmp_path / "m.gguf", "f32", progress=False)
    llm = LlamaCpp(path, n_ctx=m.config.ctx_len).llm
    text = bundled_works()["macbeth"][:20000]
    assert llm.tokenize(text.encode(), add_bos=False, special=False) == tok.encode(text)
    assert llm.token_eos() == tok.eos_id


@pytest.mark.parametrize("style", ["gpt2", "smollm", "llama3", "qwen2"])
def test_imported_tokenizers_keep_their_pre_tokenizer_in_llama_cpp(style, tmp_path):
    """An imported Hugging Face tokenizer exported to GGUF names llama.cpp's matching pre-tokenizer
    (gpt-2, smollm, llama-bpe, qwen2): llama.cpp then encodes text as we do."""
    pytest.importorskip("transformers")
    from test_interop import hf_tokenizer_json, make_hf_llama
    from nanoeuler.interop.hf import import_folder
    text = bundled_works()["hamlet"][:60000]
    d = tmp_path / "hf"
    make_hf_llama(d, hf_tokenizer_json(text, style), tied=True, shards=1)
    import_folder(d, tmp_path / "run", progress=False)
    m, tok = Model.load(tmp_path / "run"), load_tokenizer(tmp_path / "run")
    path = export_gguf(m, tok, tmp_path / "m.gguf", "f32", progress=False)
    llm = LlamaCpp(path, n_ctx=m.config.ctx_len).llm
    probe = bundled_works()["tempest"][:20000] + " In 1599, 12345 men  spent $3.50\n\n  in 2 days\t\n 7 "
    assert llm.tokenize(probe.encode(), add_bos=False, special=False) == tok.encode(probe)


def test_a_shuffled_vocabulary_with_bos_keeps_its_ids_in_llama_cpp(tmp_path):
    """A Llama-3-style folder numbered in a random order, with a bos post_processor: imported, exported to
    GGUF, llama.cpp's tokenizer gives our ids (bos first, as AutoTokenizer) and its greedy tokens are ours."""
    pytest.importorskip("transformers")
    from test_interop import hf_tokenizer_json, make_hf_llama, shuffled_tokenizer_json
    from nanoeuler.interop.hf import import_folder
    tok_json = shuffled_tokenizer_json(hf_tokenizer_json(bundled_works()["hamlet"][:60000], "llama3"), seed=7)
    vocab = __import__("json").loads(tok_json)["model"]["vocab"]
    d = tmp_path / "hf"
    make_hf_llama(d, tok_json, tied=False, shards=1, eos=vocab["<|endoftext|>"], bos=vocab["<|begin_of_text|>"])
    import_folder(d, tmp_path / "run", progress=False)
    m, tok = Model.load(tmp_path / "run"), load_tokenizer(tmp_path / "run")
    assert tok.ids[:256].tolist() != list(range(256)) and tok.bos_id == vocab["<|begin_of_text|>"]
    path = export_gguf(m, tok, tmp_path / "m.gguf", "f32", progress=False)
    lc = LlamaCpp(path, n_ctx=m.config.ctx_len)
    probe = bundled_works()["tempest"][:20000] + " In 1599, 12345 men  spent $3.50\n\n  in 2 days\t\n 7 "
    assert lc.llm.tokenize(probe.encode(), add_bos=True, special=False) == tok.encode(probe, add_bos=True)
    assert lc.llm.token_bos() == tok.bos_id and lc.llm.token_eos() == tok.eos_id
    prompt = tok.encode(probe, add_bos=True)[:24]
    theirs, _ = lc.greedy(prompt, 24)
    assert theirs == generate(m, prompt, max_new_tokens=24, temperature=0, mode="cache").ids
