"""Interop: export to transformers / GGUF and import of transformers Llama folders, checked against the
real libraries (transformers, tokenizers, torch autograd, gguf.GGUFReader) on tiny models built here.
No network: every model and tokenizer is made inside the tests."""
from __future__ import annotations

import io
import json
import os
import shutil
import sys

import numpy as np
import pytest

from conftest import rel_err
from nanoeuler import Model, Tokenizer
from nanoeuler.cli import main
from nanoeuler.config import Config
from nanoeuler.data.corpus import bundled_works
from nanoeuler.infer.session import generate
from nanoeuler.training.sft import prompt_text, render

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

# float32, every entry (conftest.rel_err); measured 4.0e-5 and 7.7e-5 at worst
LOGITS_TOL, GRAD_TOL = 1e-4, 2e-4


# ---- fixtures ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def corpus():
    works = bundled_works()
    return works


@pytest.fixture(scope="module")
def tok(corpus):
    text = corpus[sorted(corpus)[1]]
    return Tokenizer.train([text], 420, progress=False)


def our_model(tok, seed=0, steps=0, n_mtp=2, ctx=160):
    """A tiny model of ours; steps > 0: a few SGD steps on the corpus so that it is not just random."""
    cfg = Config(vocab_size=tok.vocab_size, dim=32, n_heads=4, n_kv_heads=2, n_layers=2, ctx_len=ctx,
                 ffn_hidden=64, n_mtp=n_mtp)
    m = Model.init(cfg, seed=seed)
    rng = np.random.default_rng(seed)
    for name, p in m.params.items():  # norms away from 1 so that their mapping is tested too
        if name.endswith("norm.weight"):
            p[...] = 1 + 0.3 * rng.standard_normal(p.shape).astype(np.float32)
    if steps:
        ids = np.array(tok.encode(bundled_works()["hamlet"][:20000]))
        for s in range(steps):
            starts = rng.integers(0, len(ids) - 40 - n_mtp, 4)
            batch = np.stack([ids[i:i + 40 + n_mtp] for i in starts])
            _, _, grads = m.loss_and_grads(batch)
            for n in m.params:
                m.params[n] -= 0.5 * grads[n]
    return m


def hf_logits(hf_model, ids):
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].numpy()


def torch_loss_backward(hf_model, batch) -> float:
    """transformers' mean next-token loss of batch int [B, T+1], its gradients left in the parameters' .grad."""
    hf_model.zero_grad()
    t_in = torch.tensor(batch)
    logits = hf_model(t_in[:, :-1]).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), t_in[:, 1:].reshape(-1))
    loss.backward()
    return loss.item()


@pytest.fixture(scope="module")
def exported(tok, tmp_path_factory):
    """(our model, folder) for a random and a briefly trained model, exported as hf float32."""
    from nanoeuler.interop.hf import export_hf
    out = {}
    for kind, steps in (("random", 0), ("trained", 8)):
        m = our_model(tok, seed=3, steps=steps)
        d = tmp_path_factory.mktemp("hf") / kind
        export_hf(m, tok, d, progress=False)
        out[kind] = (m, d)
    return out


# ---- export to transformers ----------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["random", "trained"])
def test_hf_export_logits_and_greedy_match_transformers(exported, tok, kind):
    m, d = exported[kind]
    hf = transformers.AutoModelForCausalLM.from_pretrained(d)
    assert type(hf).__name__ == "LlamaForCausalLM"
    ids = tok.encode(bundled_works()["macbeth"][5000:6000])[:96]
    ours = m.logits(np.array([ids]))[0, 0]
    theirs = hf_logits(hf, ids)
    assert rel_err(ours, theirs) <= LOGITS_TOL
    prompt = ids[:20]
    g = generate(m, prompt, max_new_tokens=64, temperature=0, mode="cache")
    with torch.no_grad():
        h = hf.generate(torch.tensor([prompt]), max_new_tokens=64, min_new_tokens=64, do_sample=False,
                        eos_token_id=None, pad_token_id=0)
    assert len(g.ids) == 64
    assert h[0, len(prompt):].tolist() == g.ids


def test_hf_export_tokenizer_ids_identical_on_the_bundled_corpus(exported, tok, corpus):
    _, d = exported["random"]
    ht = transformers.AutoTokenizer.from_pretrained(d)
    n = 0
    for name, text in corpus.items():
        assert ht(text, add_special_tokens=False)["input_ids"] == tok.encode(text), name
        n += len(text)
    assert n > 4_000_000
    assert ht.eos_token == "</s>" and ht.eos_token_id == tok.eos_id


def test_hf_chat_template_equals_sft_rendering(exported, tok):
    from nanoeuler.training.sft import offline_instructions
    _, d = exported["random"]
    ht = transformers.AutoTokenizer.from_pretrained(d)
    train, held = offline_instructions(200, 20)
    records = train[:30] + [{"instruction": "Rewrite this.", "input": "To be, or not to be", "output": "Be."}]
    for r in records:
        msgs = [{"role": "user", "content": r["instruction"]}, {"role": "assistant", "content": r["output"]}]
        if r["input"]:
            msgs[0]["input"] = r["input"]
        text = ht.apply_chat_template(msgs, tokenize=False)
        assert text == prompt_text(r["instruction"], r["input"]) + r["output"] + "</s>"
        ids = ht.apply_chat_template(msgs, tokenize=True)
        ids = ids["input_ids"] if not isinstance(ids, list) else ids
        assert list(ids) == render(tok, r["instruction"], r["input"], r["output"])[0]
        gen = ht.apply_chat_template(msgs[:1], tokenize=False, add_generation_prompt=True)
        assert gen == prompt_text(r["instruction"], r["input"])
    # two turns: exactly what the chat REPL feeds the model (turn 1 + reply + </s>, then turn 2)
    two = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    assert ht.apply_chat_template(two, tokenize=False) == prompt_text("a") + "b</s>" + prompt_text("c")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_hf_export_half_precision_loads_and_rounds(exported, tok, tmp_path, dtype):
    from nanoeuler.interop.hf import export_hf
    m, _ = exported["trained"]
    export_hf(m, tok, tmp_path / dtype, dtype=dtype, progress=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / dtype, dtype=getattr(torch, dtype))
    w = hf.model.layers[0].mlp.up_proj.weight.detach().float().numpy()
    ref = torch.tensor(m.params["layers.0.ffn.up.weight"]).to(getattr(torch, dtype)).float().numpy()
    assert np.array_equal(w, ref)  # our rounding is torch's (nearest even)


# ---- GGUF ----------------------------------------------------------------------------------------
def test_gguf_reads_back_every_tensor_bit_exact(exported, tok, tmp_path):
    gguf = pytest.importorskip("gguf")
    from nanoeuler.interop.gguf_export import export_gguf, unpermute_qk
    m, _ = exported["trained"]
    path = export_gguf(m, tok, tmp_path / "m.gguf", "f32", progress=False)
    r = gguf.GGUFReader(str(path))
    got = {t.name: np.array(t.data) for t in r.tensors}
    cfg, P = m.config, m.params
    assert len(got) == len(P) - (cfg.n_mtp - 1) + 0  # MTP heads 1.. stay out; output is head 0
    assert np.array_equal(got["token_embd.weight"], P["embed.weight"])
    assert np.array_equal(got["output.weight"], P["heads.0.weight"])
    assert np.array_equal(got["output_norm.weight"], P["norm.weight"])
    for i in range(cfg.n_layers):
        o, g = f"layers.{i}.", f"blk.{i}."
        assert not np.array_equal(got[g + "attn_q.weight"], P[o + "attn.wq.weight"])  # permuted ...
        assert np.array_equal(unpermute_qk(got[g + "attn_q.weight"], cfg.n_heads), P[o + "attn.wq.weight"])
        assert np.array_equal(unpermute_qk(got[g + "attn_k.weight"], cfg.n_kv_heads), P[o + "attn.wk.weight"])
        for a, b in (("attn_v", "attn.wv"), ("attn_output", "attn.wo"), ("ffn_gate", "ffn.gate"),
                     ("ffn_up", "ffn.up"), ("ffn_down", "ffn.down"), ("attn_norm", "attn_norm"),
                     ("ffn_norm", "ffn_norm")):
            assert got[g + a + ".weight"].dtype == np.float32
            assert np.array_equal(got[g + a + ".weight"], P[o + b + ".weight"]), a
    f = r.fields
    assert bytes(f["general.architecture"].parts[-1]).decode() == "llama"
    assert int(f["llama.block_count"].parts[-1][0]) == cfg.n_layers
    assert len(f["tokenizer.ggml.tokens"].data) == cfg.vocab_size
    assert len(f["tokenizer.ggml.merges"].data) == len(tok.merges)
    assert int(f["tokenizer.ggml.eos_token_id"].parts[-1][0]) == tok.eos_id


@pytest.mark.parametrize("ours, llama_cpp, ggml, ftype", [("float32", "f32", "F32", "ALL_F32"),
                                                        ("float16", "f16", "F16", "MOSTLY_F16")])
def test_gguf_dtype_takes_our_name_and_llama_cpp_s(exported, tok, tmp_path, ours, llama_cpp, ggml, ftype):
    """`export --format gguf --dtype` names a type as every other --dtype does (float16), and llama.cpp's
    name of it (f16) writes the same file."""
    gguf = pytest.importorskip("gguf")
    from nanoeuler.interop.gguf_export import export_gguf
    m, _ = exported["trained"]
    files = [export_gguf(m, tok, tmp_path / f"{name}.gguf", name, progress=False) for name in (ours, llama_cpp)]
    assert files[0].read_bytes() == files[1].read_bytes()
    r = gguf.GGUFReader(str(files[0]))
    assert int(r.fields["general.file_type"].parts[-1][0]) == int(gguf.LlamaFileType[ftype])
    assert r.get_tensor(0).tensor_type == gguf.GGMLQuantizationType[ggml] or r.get_tensor(0).data.ndim == 1


@pytest.mark.parametrize("arch, refused", [("qwen2", True), ("qwen3", False)])
def test_heads_other_than_dim_over_heads_are_refused_where_llama_cpp_fixes_them(tok, tmp_path, arch, refused,
                                                                              monkeypatch):
    """llama.cpp's qwen2 makes q and the attention output dim x dim, whatever attention.key_length says: a qwen2
    whose 4 heads of 8 make 32 of dim 16 was written anyway, and llama.cpp refused the file. Export now refuses
    it in one line, and import refuses such a file; its qwen3 sizes heads by key_length and loads the export."""
    pytest.importorskip("gguf")
    from conftest import tiny_config
    from nanoeuler.errors import UserError
    from nanoeuler.interop import gguf_export
    from nanoeuler.interop.gguf_import import load_gguf
    m = Model.init(tiny_config(arch=arch, head_dim=8, vocab_size=tok.vocab_size), seed=0)
    if not refused:
        assert load_gguf(gguf_export.export_gguf(m, tok, tmp_path / "m.gguf", progress=False))[0].head_dim == 8
        return
    with pytest.raises(UserError, match=r"^cannot export to GGUF: llama.cpp's qwen2 makes q and the attention output "
                                        r"16 x 16 \(heads of dim / n_heads = 4\); this model's 4 heads of 8 make 32$"):
        gguf_export.export_gguf(m, tok, tmp_path / "m.gguf", progress=False)
    with monkeypatch.context() as unchecked:   # the file as it was written before: llama.cpp and import refuse it
        unchecked.setattr(gguf_export, "check_expressible", lambda cfg: None)
        path = gguf_export.export_gguf(m, tok, tmp_path / "m.gguf", progress=False)
    with pytest.raises(UserError, match="qwen2.attention.key_length = 8: llama.cpp's qwen2 makes heads dim / "
                                        "head_count = 16/4 wide; it cannot load this file"):
        load_gguf(path)
    try:
        from nanoeuler.interop.llamacpp import LlamaCpp
        LlamaCpp(path, n_ctx=8)
    except UserError:   # (no llama-cpp-python here)
        return
    except ValueError as e:
        assert "Failed to load model" in str(e)
    else:
        raise AssertionError("llama.cpp loaded a qwen2 whose heads are not dim / n_heads wide")


def test_permute_qk_matches_llama_cpp_convention():
    """Head of 4 rows (hd = 4): rotate-half pairs (0, 2), (1, 3) become adjacent rows."""
    from nanoeuler.interop.gguf_export import permute_qk, unpermute_qk
    w = np.arange(8, dtype=np.float32).reshape(8, 1)  # 2 heads of hd 4
    assert permute_qk(w, 2)[:, 0].tolist() == [0, 2, 1, 3, 4, 6, 5, 7]
    x = np.random.default_rng(0).standard_normal((24, 5)).astype(np.float32)
    assert np.array_equal(unpermute_qk(permute_qk(x, 3), 3), x)


# ---- import of a transformers-made Llama ---------------------------------------------------------
def hf_tokenizer_json(text: str, style: str, vocab: int = 330) -> str:
    """A byte-level BPE trained by the `tokenizers` library (specials first, as SmolLM orders them)."""
    from tokenizers import Regex, decoders, models, pre_tokenizers, trainers
    from nanoeuler.interop.hf_tokenizer import LLAMA3_PATTERN, QWEN2_PATTERN
    t = tokenizers.Tokenizer(models.BPE())
    if style == "gpt2":
        t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    elif style == "smollm":
        t.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                   pre_tokenizers.ByteLevel(add_prefix_space=False)])
    else:
        if style == "qwen2":
            from tokenizers import normalizers
            t.normalizer = normalizers.NFC()
        t.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN2_PATTERN if style == "qwen2" else LLAMA3_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    t.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>", "<|im_start|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    t.train_from_iterator([text], trainer)
    return t.to_str()


def make_hf_llama(folder, tok_json: str, tied: bool, seed: int = 0, shards: int = 2, pad_rows: int = 3,
                  eos: int = 0, bos: int | None = None):
    """A random LlamaForCausalLM saved by transformers (GQA, `shards` safetensors files), plus tokenizer."""
    n_tok = json.loads(tok_json)["model"]["vocab"].__len__()
    cfg = transformers.LlamaConfig(vocab_size=n_tok + pad_rows, hidden_size=32, intermediate_size=48,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=5000.0,
                                   tie_word_embeddings=tied, bos_token_id=eos if bos is None else bos,
                                   eos_token_id=eos)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
            else:
                p.normal_(0, 0.1)
    total = sum(p.numel() * 4 for p in model.parameters())
    model.save_pretrained(folder, max_shard_size=int(total * 0.55) if shards > 1 else "1GB")
    (folder / "tokenizer.json").write_text(tok_json)
    return model


BOS = "<|begin_of_text|>"


def shuffled_tokenizer_json(tok_json: str, seed: int) -> str:
    """The same tokenizer with every id shuffled (bytes out of order, specials anywhere) and, as Llama-3's,
    a <|begin_of_text|> that the post_processor puts before every text."""
    d = json.loads(tok_json)
    vocab = d["model"]["vocab"]
    vocab[BOS] = len(vocab)
    d["added_tokens"].append({"id": vocab[BOS], "content": BOS, "single_word": False, "lstrip": False,
                              "rstrip": False, "normalized": False, "special": True})
    new = np.random.default_rng(seed).permutation(len(vocab)).tolist()
    d["model"]["vocab"] = {s: new[i] for s, i in vocab.items()}
    for t in d["added_tokens"]:
        t["id"] = new[t["id"]]
    b = d["model"]["vocab"][BOS]
    template = {"type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": BOS, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [{"SpecialToken": {"id": BOS, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                         {"SpecialToken": {"id": BOS, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {BOS: {"id": BOS, "ids": [b], "tokens": [BOS]}}}
    d["post_processor"] = {"type": "Sequence", "processors": [
        {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True}, template]}
    return json.dumps(d)


@pytest.fixture(scope="module")
def shuffled(corpus, tmp_path_factory):
    """A Llama-3-style folder (Split regex pre-tokenizer, bos post_processor) whose vocabulary is numbered
    in a random order, with 3 padded rows that no token names."""
    tok_json = shuffled_tokenizer_json(hf_tokenizer_json(corpus["hamlet"][:60000], "llama3"), seed=5)
    vocab = json.loads(tok_json)["model"]["vocab"]
    d = tmp_path_factory.mktemp("shuffled") / "llama3"
    model = make_hf_llama(d, tok_json, tied=False, seed=4, shards=1, eos=vocab["<|endoftext|>"], bos=vocab[BOS])
    return model, d, vocab


@pytest.fixture(scope="module")
def hf_folders(corpus, tmp_path_factory):
    text = corpus["hamlet"][:60000]
    out = {}
    for tied in (False, True):
        d = tmp_path_factory.mktemp("llama") / ("tied" if tied else "untied")
        model = make_hf_llama(d, hf_tokenizer_json(text, "gpt2"), tied, seed=int(tied))
        out[tied] = (model, d)
    return out


def test_the_fixture_is_sharded_gqa_and_tied_as_asked(hf_folders):
    for tied, (model, d) in hf_folders.items():
        idx = json.loads((d / "model.safetensors.index.json").read_text())
        assert len(set(idx["weight_map"].values())) == 2
        assert ("lm_head.weight" in idx["weight_map"]) == (not tied)
        assert model.config.num_key_value_heads < model.config.num_attention_heads


@pytest.mark.parametrize("tied", [False, True])
def test_import_logits_and_loss_gradients_equal_torch_autograd(hf_folders, tied, tmp_path):
    from nanoeuler.interop.hf import import_folder
    hf, d = hf_folders[tied]
    cfg, params, tok = import_folder(d, tmp_path / "run", progress=False)
    m = Model.load(tmp_path / "run")
    assert m.config == cfg and m.config.rope_theta == 5000.0 and m.config.n_mtp == 1
    ht = tokenizers.Tokenizer.from_file(str(d / "tokenizer.json"))
    text = bundled_works()["othello"][3000:3400]
    ours_ids = tok.encode(text)
    assert ours_ids == ht.encode(text).ids  # same text, same ids (the HF trainer's numbering, not ours)
    assert tok.ids is not None and tok.ids[:256].tolist() != list(range(256))
    assert tok.eos_token == "<|endoftext|>" and tok.eos_id == 0
    assert np.array_equal(m.params["embed.weight"], hf.model.embed_tokens.weight.detach().numpy())  # rows as they were
    ids = ours_ids[:65]
    # logits
    ours = m.logits(np.array([ids[:64]]))[0, 0]
    theirs = hf_logits(hf, ids[:64])
    assert rel_err(ours, theirs) <= LOGITS_TOL
    # loss gradients: ours by hand vs torch autograd
    batch = np.array([ids, ours_ids[70:135]])
    loss, _, grads = m.loss_and_grads(batch)
    t_loss = torch_loss_backward(hf, batch)
    assert abs(loss - t_loss) <= 1e-5 * abs(t_loss)
    g = {n: p.grad.numpy() for n, p in hf.named_parameters()}
    from nanoeuler.interop.hf import hf_names
    for ours_name, theirs_name in hf_names(cfg).items():
        if ours_name == "embed.weight":
            assert rel_err(grads["embed.weight"], g[theirs_name]) <= GRAD_TOL  # tied: both uses, one matrix
        elif ours_name == "heads.0.weight":
            assert (ours_name in grads) == (not tied)
            if not tied:
                assert rel_err(grads[ours_name], g[theirs_name]) <= GRAD_TOL
        else:
            assert rel_err(grads[ours_name], g[theirs_name]) <= GRAD_TOL, ours_name


@pytest.mark.parametrize("style", ["gpt2", "smollm", "llama3", "qwen2"])
def test_imported_tokenizer_encodes_like_hf(corpus, style):
    from nanoeuler.interop.hf_tokenizer import from_hf_json
    text = corpus["hamlet"][:60000]
    d = json.loads(hf_tokenizer_json(text, style))
    tok = from_hf_json(d)
    ht = tokenizers.Tokenizer.from_str(json.dumps(d))
    probes = [corpus["tempest"][:50000], "In 1599, 12345 men  spent\n\n  $3.50 (or 1,000,000!) in   2 days\t\n 7 ",
              "ÀÉ 日本語 😀 don't I'M  ok\r\n\r\n99 bottles", "cafe\u0301 Ame\u0301lie \u212b"]
    for s in probes:
        assert tok.encode(s) == ht.encode(s).ids
        assert tok.decode(ht.encode(s).ids) == ht.decode(ht.encode(s).ids)
        if style != "qwen2":  # NFC changes the text (e + U+0301 -> é), as Hugging Face's does
            assert tok.decode(tok.encode(s)) == s
    assert tok.normalizer == ("NFC" if style == "qwen2" else None)
    # the export of the imported tokenizer encodes like the original
    ht2 = tokenizers.Tokenizer.from_str(tok.to_hf_json())
    assert ht2.encode(probes[2]).ids == tok.encode(probes[2])
    assert Tokenizer.from_dict(json.loads(json.dumps(tok.to_dict()))).fingerprint() == tok.fingerprint()


def test_shuffled_vocabulary_keeps_its_ids_through_import_and_export(shuffled, corpus, tmp_path):
    """Ids in no order of ours: the imported tokenizer gives AutoTokenizer's ids (bos included), the model
    keeps the folder's rows and gives transformers' logits for the same ids; export -> hf gives the same
    ids and logits again, export -> gguf lists token i at index i; import -> export -> import is the identity."""
    from nanoeuler.interop.hf import import_folder
    from nanoeuler.tokenizer import bytes_to_unicode
    hf, d, vocab = shuffled
    import_folder(d, tmp_path / "run", progress=False)
    m, tok = Model.load(tmp_path / "run"), Tokenizer.load(tmp_path / "run")  # through the saved files
    alpha = bytes_to_unicode()
    assert [vocab[alpha[b]] for b in range(256)] == tok.ids[:256].tolist() != list(range(256))
    assert min(tok.special_tokens[s] for s in ("<|endoftext|>", "<|im_start|>", BOS)) < 256 + len(tok.merges)
    assert tok.bos_token == BOS and tok.bos_id == vocab[BOS] and tok.eos_id == vocab["<|endoftext|>"]
    assert tok.vocab_size == m.config.vocab_size == len(vocab) + 3  # the padded rows: reserved ids
    assert np.array_equal(m.params["embed.weight"], hf.model.embed_tokens.weight.detach().numpy())
    assert np.array_equal(m.params["heads.0.weight"], hf.lm_head.weight.detach().numpy())
    at = transformers.AutoTokenizer.from_pretrained(d)
    texts = [corpus["tempest"][:60000], "In 1599, 12345 men  spent\n\n  $3.50 in 2 days\t\n 7 ",
             f"ÀÉ 日本語 😀 don't<|im_start|>I'M  ok\r\n\r\n99 {BOS}bottles<|endoftext|>"]
    for text in texts:
        with_bos = at(text)["input_ids"]
        assert with_bos[0] == tok.bos_id and with_bos == tok.encode(text, allow_special=True, add_bos=True)
        assert at(text, add_special_tokens=False)["input_ids"] == tok.encode(text, allow_special=True)
        assert tok.decode(with_bos[1:]) == at.decode(with_bos[1:]) == text
        assert tok.encode_array(text, allow_special=True, add_bos=True).tolist() == with_bos
    assert tok.encode("a b") == at("a b", add_special_tokens=False)["input_ids"] != tok.encode("a b", add_bos=True)
    ids = at(texts[0])["input_ids"][:64]
    assert rel_err(m.logits(np.array([ids]))[0, 0], hf_logits(hf, ids)) <= LOGITS_TOL
    # export -> transformers: the same ids, the same logits
    assert main(["export", "--ckpt", str(tmp_path / "run"), "--format", "hf", "--out", str(tmp_path / "hf"),
                 "--no-progress"]) == 0
    at2 = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    hf2 = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    for text in texts:
        assert at2(text)["input_ids"] == at(text)["input_ids"]
    assert at2.bos_token_id == tok.bos_id and at2.eos_token_id == tok.eos_id
    assert rel_err(hf_logits(hf2, ids), hf_logits(hf, ids)) <= 1e-6
    # export -> gguf: token i of llama.cpp's list is our token i, the embedding rows are ours
    gguf = pytest.importorskip("gguf")
    from nanoeuler.interop.gguf_export import export_gguf
    r = gguf.GGUFReader(str(export_gguf(m, tok, tmp_path / "m.gguf", "f32", progress=False)))
    f = r.fields
    listed = [bytes(f["tokenizer.ggml.tokens"].parts[i]).decode("utf-8") for i in f["tokenizer.ggml.tokens"].data]
    inv = {i: s for s, i in vocab.items()}
    assert listed[:len(vocab)] == [inv[i] for i in range(len(vocab))]   # the folder's own numbering
    assert all(listed[i] == "".join(alpha[c] for c in tok.token_bytes(i)) or i in tok.special_tokens.values()
               for i in range(tok.vocab_size))
    types = [int(f["tokenizer.ggml.token_type"].parts[i][0]) for i in f["tokenizer.ggml.token_type"].data]
    assert {i for i, t in enumerate(types) if t == int(gguf.TokenType.CONTROL)} == set(tok.special_tokens.values())
    assert int(f["tokenizer.ggml.bos_token_id"].parts[-1][0]) == tok.bos_id
    assert int(f["tokenizer.ggml.eos_token_id"].parts[-1][0]) == tok.eos_id
    assert bool(f["tokenizer.ggml.add_bos_token"].parts[-1][0])
    emb = next(np.array(t.data) for t in r.tensors if t.name == "token_embd.weight")
    assert np.array_equal(emb, m.params["embed.weight"])
    # import -> export -> import: the same tokenizer and tensors
    assert main(["import", "--from", str(tmp_path / "hf"), "--out", str(tmp_path / "again"), "--no-progress"]) == 0
    again = Model.load(tmp_path / "again")
    assert Tokenizer.load(tmp_path / "again").fingerprint() == tok.fingerprint()
    assert all(np.array_equal(again.params[n], m.params[n]) for n in m.params)


def test_every_sequence_an_imported_llama3_reads_opens_with_its_bos(shuffled, corpus, tmp_path, monkeypatch, capsys):
    """prepare (each document), sft/chat (render), sample (the prompt) and dpo's prompts put the bos first, as
    the model's own tokenizer does; our own tokenizers have no bos and are unchanged."""
    from nanoeuler.infer import session
    from nanoeuler.data.shards import TokenShards, prepare
    from nanoeuler.interop.hf import import_folder
    _, d, vocab = shuffled
    import_folder(d, tmp_path / "run", progress=False)
    tok, bos = Tokenizer.load(tmp_path / "run"), vocab[BOS]
    assert render(tok, "Who speaks?")[0] == [bos] + tok.encode(prompt_text("Who speaks?"))
    docs = [tmp_path / f"doc{i}.txt" for i in range(12)]
    for i, f in enumerate(docs):
        f.write_text(corpus["hamlet"][i * 3000:(i + 1) * 3000])
    prepare([str(f) for f in docs], tmp_path / "run", tmp_path / "data", progress=False)
    for split in ("train", "val"):
        shards = TokenShards(tmp_path / "data", split)
        ids = shards.window(0, len(shards))
        assert ids[0] == bos and (ids == bos).sum() == (ids == tok.eos_id).sum()  # one bos per document
        starts = np.flatnonzero(ids == tok.eos_id)[:-1] + 1
        assert (ids[starts] == bos).all()
    seen = []
    monkeypatch.setattr(session, "generate", lambda model, ids, *a, **kw: seen.append(list(ids)) or session.Generation([]))
    assert main(["sample", "--ckpt", str(tmp_path / "run"), "--prompt", "HAMLET.", "--max-new-tokens", "2",
                 "--temperature", "0"]) == 0
    assert seen[0] == [bos] + tok.encode("HAMLET.")
    assert capsys.readouterr().out.startswith("HAMLET.")  # the echo is the prompt as typed
    long = corpus["hamlet"][:20000]  # longer than the context: cut from the left, the bos first to go
    ctx = Model.load(tmp_path / "run").config.ctx_len
    assert main(["sample", "--ckpt", str(tmp_path / "run"), "--prompt", long, "--max-new-tokens", "2",
                 "--temperature", "0", "--json"]) == 0
    assert seen[1] == tok.encode(long)[-ctx:]
    assert json.loads(capsys.readouterr().out)["prompt"] == tok.decode(seen[1])
    plain = Tokenizer.train([corpus["hamlet"][:20000]], vocab_size=300, progress=False)
    assert plain.bos_id is None and render(plain, "Who?")[0] == plain.encode(prompt_text("Who?"))


def test_post_processors_we_cannot_carry_are_refused(shuffled):
    from nanoeuler.errors import UserError
    from nanoeuler.interop.hf_tokenizer import from_hf_json
    _, d, vocab = shuffled
    base = json.loads((d / "tokenizer.json").read_text())
    eos = vocab["<|endoftext|>"]
    after = json.loads(json.dumps(base))   # an eos after the text
    t = after["post_processor"]["processors"][1]
    t["single"] = [{"Sequence": {"id": "A", "type_id": 0}}, {"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}}]
    t["special_tokens"] = {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [eos], "tokens": ["<|endoftext|>"]}}
    with pytest.raises(UserError, match="after the text"):
        from_hf_json(after)
    roberta = dict(base, post_processor={"type": "RobertaProcessing", "sep": ["</s>", 2], "cls": ["<s>", 0]})
    with pytest.raises(UserError, match="post_processor RobertaProcessing is not supported"):
        from_hf_json(roberta)
    plain = dict(base, post_processor={"type": "ByteLevel", "trim_offsets": True})
    assert from_hf_json(plain).bos_token is None and from_hf_json(base).bos_token == BOS


def test_import_export_import_is_the_identity(hf_folders, tmp_path):
    from nanoeuler.interop.hf import export_hf
    _, d = hf_folders[False]
    assert main(["import", "--from", str(d), "--out", str(tmp_path / "a"), "--mtp", "3", "--no-progress"]) == 0
    a = Model.load(tmp_path / "a")
    assert a.config.n_mtp == 3 and np.array_equal(a.params["heads.2.weight"], a.params["heads.0.weight"])
    a.params["heads.2.weight"] += 0.01  # as if SFT had taught it: it must survive the round trip
    a.save(tmp_path / "a")
    assert main(["export", "--ckpt", str(tmp_path / "a"), "--format", "hf", "--out", str(tmp_path / "hf"),
                 "--no-progress"]) == 0
    # an output in folders not made yet gets them (`--out runs/x` on a fresh checkout); a file in the way is one line
    assert main(["import", "--from", str(tmp_path / "hf"), "--out", str(tmp_path / "runs/new/b"), "--no-progress"]) == 0
    (tmp_path / "file").write_text("x")
    assert main(["import", "--from", str(tmp_path / "hf"), "--out", str(tmp_path / "file/b"), "--no-progress"]) == 2
    os.replace(tmp_path / "runs/new/b", tmp_path / "b")
    a, b = Model.load(tmp_path / "a"), Model.load(tmp_path / "b")
    assert a.config == b.config
    for n in a.params:
        assert np.array_equal(a.params[n], b.params[n]), n
    ta, tb = Tokenizer.load(tmp_path / "a"), Tokenizer.load(tmp_path / "b")
    assert ta.fingerprint() == tb.fingerprint() and tb.eos_token == "<|endoftext|>"
    del export_hf


def test_imported_model_runs_sft_and_chat(hf_folders, tmp_path, monkeypatch, capsys):
    _, d = hf_folders[True]
    run = tmp_path / "imp"
    assert main(["import", "--from", str(d), "--out", str(run), "--mtp", "2", "--no-progress"]) == 0
    before = Model.load(run)
    assert main(["sft", "--base", str(run), "--data", "offline", "--out", str(tmp_path / "sft"), "--steps", "3",
                 "--batch-size", "2", "--no-progress", "--eval-every", "1000"]) == 0
    after = Model.load(tmp_path / "sft")
    assert not np.array_equal(before.params["heads.1.weight"], after.params["heads.1.weight"])
    capsys.readouterr()
    monkeypatch.setattr(sys, "stdin", io.StringIO("Which play is this line from?\n"))
    assert main(["chat", "--ckpt", str(tmp_path / "sft"), "--max-new-tokens", "6", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.strip()


def test_a_large_imported_shape_trains_samples_and_checkpoints(tmp_path):
    """Not a preset: 9/3 heads of 64 (SmolLM's head layout), 3 layers, vocab 1000."""
    cfg = Config(vocab_size=1000, dim=576, n_heads=9, n_kv_heads=3, n_layers=3, ctx_len=64, ffn_hidden=256, n_mtp=1)
    m = Model.init(cfg, seed=0)
    tokens = np.random.default_rng(0).integers(0, 1000, (2, 17))
    loss0, _, grads = m.loss_and_grads(tokens)
    for n in m.params:
        m.params[n] -= 0.1 * grads[n]
    assert m.loss(tokens)[0] < loss0
    m.save(tmp_path / "run")
    m2 = Model.load(tmp_path / "run")
    assert generate(m2, [1, 2, 3], max_new_tokens=5, temperature=0).ids == \
        generate(m, [1, 2, 3], max_new_tokens=5, temperature=0).ids
    out = io.StringIO()
    monkeypatch_out = sys.stdout
    try:
        sys.stdout = out
        assert main(["info", str(tmp_path / "run"), "--json", "--batch", "1"]) == 0
    finally:
        sys.stdout = monkeypatch_out
    info = json.loads(out.getvalue())
    assert info["n_params"] == cfg.n_params() and info["memory_bytes"]["total"] > 16 * cfg.n_params()


# ---- bad input -----------------------------------------------------------------------------------
def edit_config(d, **changes):
    c = json.loads((d / "config.json").read_text())
    c.update(changes)
    (d / "config.json").write_text(json.dumps(c))


@pytest.mark.parametrize("change, needle", [
    (dict(rope_scaling={"rope_type": "yarn", "factor": 2.0}), "rope_scaling"),   # linear, llama3: test_archs.py
    (dict(rope_scaling={"type": "dynamic", "factor": 4}), "rope_scaling"),
    (dict(rope_scaling={"rope_type": "linear", "factor": True}, rope_parameters=None), "rope_factor"),  # (the
    (dict(rope_scaling={"rope_type": "linear", "factor": 2.0}), "differs from rope_scaling's"),  # fixture's is plain)
    (dict(rope_parameters={"rope_type": "longrope", "factor": 2.0, "rope_theta": 1e4}), "rope_parameters"),
    (dict(rope_parameters={"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e4}), "has no low_freq_factor"),
    (dict(vocab_size="64"), "vocab_size '64' is not an integer"),  # was: "vocab_size 64 but the embedding has 64 rows"
    (dict(attention_bias=True), "attention_bias"),
    (dict(mlp_bias=True), "mlp_bias"),
    (dict(sliding_window=128), "sliding_window"),
    (dict(head_dim=16), "q_proj.weight has shape [32, 32], expected [64, 32]"),  # a head width of its own is
                                                      # read, and the weights must have it
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(model_type="bert", architectures=["BertModel"]), "model_type"),
    (dict(intermediate_size=50), "shape"),
    (dict(max_position_embeddings=0), "ctx_len"),                   # was: a 2048 context
    (dict(num_key_value_heads=0), "n_kv_heads"),                    # was: as many as the query heads
    (dict(rms_norm_eps=0), "norm_eps"),
    (dict(num_hidden_layers=-1), "n_layers"),
    (dict(vocab_size=0), "vocab_size"),
    (dict(max_position_embeddings=1e400), "ctx_len"),
    (dict(model_type="mistral"), "model_type 'mistral'"),          # architectures still says LlamaForCausalLM
    (dict(model_type=None, architectures=["MambaForCausalLM"]), "MambaForCausalLM"),   # (no such record)
    (dict(architectures=["LlamaForCausalLM", "BertModel"]), "BertModel"),
    (dict(architectures="LlamaForCausalLM"), "architectures"),
    (dict(model_type=["llama"]), "model_type"),                       # was: an internal error (unhashable)
    (dict(tie_word_embeddings="false"), "tie_word_embeddings"),       # was: tied, as "false" is truthy
])
def test_unsupported_config_fields_are_one_line_errors(hf_folders, tmp_path, capsys, change, needle):
    d = tmp_path / "m"
    shutil.copytree(hf_folders[False][1], d)
    edit_config(d, **change)
    assert main(["import", "--from", str(d), "--out", str(tmp_path / "out"), "--no-progress"]) != 0
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "\n" not in err and needle in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("neutral", [
    dict(rope_scaling={"rope_type": "default"}), dict(rope_scaling={"rope_type": "linear", "factor": 1.0}),
    dict(rope_scaling={"type": "dynamic", "factor": 1}), dict(rope_parameters={"rope_type": "default"}),
    dict(rope_parameters={"rope_type": "linear", "factor": 1.0})])
def test_rope_scaling_that_changes_nothing_imports(hf_folders, tmp_path, neutral):
    """A rope_scaling / rope_parameters that leaves RoPE as it is was refused, where the GGUF import accepts its
    neutral values: now the same checkpoint as without it."""
    d = tmp_path / "m"
    shutil.copytree(hf_folders[False][1], d)
    assert main(["import", "--from", str(d), "--out", str(tmp_path / "plain"), "--no-progress"]) == 0
    c = json.loads((d / "config.json").read_text())
    edit_config(d, **{k: c.get(k, {}) | v for k, v in neutral.items()})   # (rope_parameters keeps its rope_theta)
    assert main(["import", "--from", str(d), "--out", str(tmp_path / "out"), "--no-progress"]) == 0
    for f in ("config.json", "model.safetensors"):
        assert (tmp_path / "out" / f).read_bytes() == (tmp_path / "plain" / f).read_bytes()


def break_folder(d, how):
    idx_path = d / "model.safetensors.index.json"
    idx = json.loads(idx_path.read_text())
    shard = sorted(set(idx["weight_map"].values()))[1]
    if how == "missing shard":
        (d / shard).unlink()
    elif how == "mismatched shard":
        name = next(n for n, f in idx["weight_map"].items() if f != shard)
        idx["weight_map"][name] = shard
        idx_path.write_text(json.dumps(idx))
    elif how == "truncated shard":
        data = (d / shard).read_bytes()
        (d / shard).write_bytes(data[:len(data) - 100])
    elif how == "wrong dtype":
        from nanoeuler.interop.safetensors_io import read_header
        header, start = read_header(d / shard)
        name = next(n for n in header if n != "__metadata__")
        header[name]["dtype"] = "I32"
        h = json.dumps(header).encode()
        h += b" " * (-len(h) % 8)
        import struct
        (d / shard).write_bytes(struct.pack("<Q", len(h)) + h + (d / shard).read_bytes()[start:])
    elif how == "sentencepiece":
        (d / "tokenizer.json").unlink()
        (d / "tokenizer.model").write_bytes(b"\x00sp")
    elif how in ("byte_fallback", "normalizer", "pre_tokenizer"):
        t = json.loads((d / "tokenizer.json").read_text())
        if how == "byte_fallback":
            t["model"]["byte_fallback"] = True
        elif how == "normalizer":
            t["normalizer"] = {"type": "Lowercase"}
        else:
            t["pre_tokenizer"] = {"type": "Whitespace"}
        (d / "tokenizer.json").write_text(json.dumps(t))
    elif how.startswith("flag "):    # model.ignore_merges / byte_fallback given as the string "false"
        t = json.loads((d / "tokenizer.json").read_text())
        t["model"][how[5:]] = "false"
        (d / "tokenizer.json").write_text(json.dumps(t))
    elif how.startswith("split "):   # a Split + ByteLevel pre-tokenizer with this regex
        t = json.loads((d / "tokenizer.json").read_text())
        t["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": how[6:]}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}
        (d / "tokenizer.json").write_text(json.dumps(t))
    elif how == "pickle weights":
        for f in d.glob("model*.safetensors*"):
            f.unlink()
        (d / "pytorch_model.bin").write_bytes(b"PK")
    elif how == "not a model":
        (d / "config.json").unlink()
    elif how == "deep config":
        (d / "config.json").write_text("[" * 100000)


@pytest.mark.parametrize("how, needle", [
    ("missing shard", "missing"), ("mismatched shard", "does not hold"), ("truncated shard", "truncated"),
    ("wrong dtype", "dtype I32"), ("sentencepiece", "SentencePiece"), ("byte_fallback", "byte_fallback"),
    ("normalizer", "normalizer"), ("pre_tokenizer", "pre_tokenizer Whitespace"), ("pickle weights", "safetensors"),
    ("not a model", "config.json"),
    ("split (", "bad pre-tokenization pattern"),                   # was: a traceback from `regex`
    (r"split (?:a|aa)+$|\s+|(?s:.)", "backtracks"),
    ("deep config", "not valid JSON"),                               # was: an internal RecursionError
    ("flag ignore_merges", "model.ignore_merges must be true or false"),  # was: "false" read as true
    ("flag byte_fallback", "model.byte_fallback must be true or false"),   # was: a SentencePiece import
])
def test_broken_folders_are_one_line_errors(hf_folders, tmp_path, capsys, how, needle):
    d = tmp_path / "m"
    shutil.copytree(hf_folders[False][1], d)
    break_folder(d, how)
    assert main(["import", "--from", str(d), "--out", str(tmp_path / "out"), "--no-progress"]) != 0
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "\n" not in err and needle in err, err
    assert not (tmp_path / "out").exists()
    assert not list(tmp_path.glob(".out*"))  # no temporary left behind


def test_existing_outputs_are_refused_unless_force(exported, hf_folders, tmp_path, capsys):
    m, _ = exported["random"]
    run = tmp_path / "run"
    assert main(["import", "--from", str(hf_folders[False][1]), "--out", str(run), "--no-progress"]) == 0
    stamp = (run / "model.safetensors").read_bytes()
    for argv in (["import", "--from", str(hf_folders[True][1]), "--out", str(run)],
                 ["export", "--ckpt", str(run), "--format", "hf", "--out", str(run)],
                 ["export", "--ckpt", str(run), "--format", "gguf", "--out", str(run / "config.json")]):
        capsys.readouterr()
        assert main(argv) != 0
        err = capsys.readouterr().err.strip()
        assert "already exists" in err and "--force" in err and "\n" not in err
    assert (run / "model.safetensors").read_bytes() == stamp
    assert main(["import", "--from", str(hf_folders[True][1]), "--out", str(run), "--force", "--no-progress"]) == 0
    assert (run / "model.safetensors").read_bytes() != stamp
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    del m


def test_ignore_merges_and_merges_in_any_order_encode_as_tokenizers(corpus):
    """Llama-3's vocabulary: ignore_merges (a pre-token that is a token is that token), merges that use a token
    a later merge makes, and several merges that make one token. Our ids equal `tokenizers`' with and without
    ignore_merges, on real text and on a vocabulary built so that each of the three matters."""
    from nanoeuler.interop.hf_tokenizer import from_hf_json
    from nanoeuler.tokenizer import bytes_to_unicode
    d = json.loads(hf_tokenizer_json(corpus["hamlet"][:60000], "llama3"))
    d["model"]["ignore_merges"] = True  # as Llama-3's tokenizer.json has it
    s = corpus["tempest"][:20000]
    assert from_hf_json(d).encode(s) == tokenizers.Tokenizer.from_str(json.dumps(d)).encode(s).ids
    vocab = {c: i for i, c in enumerate(bytes_to_unicode())}
    for extra in ("bc", "ab", "abc", "abab", "ba", "bab", "ĠĠ", "ĠĠĠ", "ĠĠĠĠ"):
        vocab[extra] = len(vocab)
    # 'abc' is a token no merge sequence reaches from 'a b c' (b c first, then nothing joins a + bc); 'ab ab'
    # uses 'ab' before 'a b' makes it, 'abab' is made twice; 'Ġ ĠĠĠ' uses 'ĠĠĠ' before it is made (Llama-3)
    merges = ["Ġ ĠĠĠ", "b c", "ab ab", "b a", "a bab", "a b", "ĠĠ Ġ", "Ġ Ġ", "ĠĠ ĠĠ", "ba b", "ab c"]
    d["model"]["vocab"], d["model"]["merges"], d["added_tokens"] = vocab, merges, []
    texts = ["abc", "abab", "ababab", "babab", "x abc abcabc", "    ", "     a", "        ", "abcab ba bab"]
    for ignore in (True, False):
        d["model"]["ignore_merges"] = ignore
        ours, theirs = from_hf_json(d), tokenizers.Tokenizer.from_str(json.dumps(d))
        for text in texts:
            assert ours.encode(text) == theirs.encode(text).ids, (ignore, text)
        assert (ours.encode("abc") == [vocab["abc"]]) == ignore
        assert Tokenizer.from_dict(ours.to_dict()).encode(" ".join(texts)) == ours.encode(" ".join(texts))


def test_a_split_that_leaves_characters_between_its_matches_keeps_them_as_pieces(corpus):
    """A Split (Isolated) keeps the stretches between its matches as pieces: BLOOM's regex, or a bare \\p{L}+, cuts
    as `tokenizers` cuts (it was refused: as one pattern, its matches alone drop characters)."""
    from nanoeuler.interop.hf_tokenizer import from_hf_json
    d = json.loads(hf_tokenizer_json(corpus["hamlet"][:30000], "llama3"))
    text = corpus["tempest"][:5000] + " 12,5 !? ¿qué? 日本語…。"
    for regex in (r"\p{L}+", r" ?[^(\s|.,!?…。，、।۔،)]+"):
        d["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = regex
        tok = from_hf_json(d)
        assert tok.pattern == (regex,)
        assert tok.encode(text) == tokenizers.Tokenizer.from_str(json.dumps(d)).encode(text).ids
        assert Tokenizer.from_dict(tok.to_dict()).encode(text) == tok.encode(text)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_import_of_half_precision_weights_is_exact(corpus, tmp_path, dtype):
    d = tmp_path / "hf"
    model = make_hf_llama(d, hf_tokenizer_json(corpus["hamlet"][:30000], "gpt2"), tied=False, shards=1)
    for f in d.glob("model*.safetensors*"):
        f.unlink()
    model.to(getattr(torch, dtype)).save_pretrained(d)
    assert main(["import", "--from", str(d), "--out", str(tmp_path / "run"), "--no-progress"]) == 0
    m = Model.load(tmp_path / "run")
    w = model.model.layers[1].self_attn.k_proj.weight.detach().float().numpy()
    assert m.dtype == np.float32 and np.array_equal(m.params["layers.1.attn.wk.weight"], w)


def test_serving_an_imported_model_speaks_its_ids(shuffled, tmp_path):
    """serve over a shuffled-vocabulary import: /tokenize is AutoTokenizer (bos with add_special_tokens),
    logprobs name the tokens of the ids the model scores, and greedy text is `generate` on the same ids
    (a completion's prompt opens with the bos, as vLLM does)."""
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    from serve_fixtures import ServerThread
    from nanoeuler.interop.hf import import_folder
    from nanoeuler.serve.app import create_app
    _, d, vocab = shuffled
    import_folder(d, tmp_path / "run", progress=False)
    m, tok = Model.load(tmp_path / "run"), Tokenizer.load(tmp_path / "run")
    at = transformers.AutoTokenizer.from_pretrained(d)
    prompt = "Where is the king? \u00e9"
    with ServerThread(create_app(m, tok, "imp")) as srv:
        got = httpx.post(srv.url + "/tokenize", json={"prompt": prompt, "add_special_tokens": True}).json()
        assert got["tokens"] == at(prompt)["input_ids"] and got["tokens"][0] == tok.bos_id
        got = httpx.post(srv.url + "/tokenize", json={"prompt": prompt}).json()
        assert got["tokens"] == at(prompt, add_special_tokens=False)["input_ids"]
        info = httpx.get(srv.url + "/tokenizer_info").json()
        assert info["bos_token"] == BOS and info["eos_token"] == "<|endoftext|>"
        r = httpx.post(srv.url + "/v1/completions", json={"model": "imp", "prompt": prompt, "max_tokens": 6,
                                                         "temperature": 0, "logprobs": 2, "ignore_eos": True}).json()
        ref = generate(m, tok.encode(prompt, add_bos=True), 6, temperature=0)  # the server puts the bos first
        choice = r["choices"][0]
        assert choice["text"] == tok.decode(ref.ids)
        from nanoeuler.serve.protocol import token_text
        assert choice["logprobs"]["tokens"] == [token_text(tok, i) for i in ref.ids]
        r = httpx.post(srv.url + "/v1/chat/completions", json={"model": "imp", "max_tokens": 4, "temperature": 0,
                       "messages": [{"role": "user", "content": "Hi"}], "logprobs": True, "top_logprobs": 1,
                       "ignore_eos": True}).json()
        ref = generate(m, render(tok, "Hi")[0], 4, temperature=0)
        content = r["choices"][0]["logprobs"]["content"]
        # the bytes of each scored id, read from the Hugging Face tokenizer's own token strings
        from nanoeuler.tokenizer import bytes_to_unicode
        byte_of = {c: b for b, c in enumerate(bytes_to_unicode())}
        assert [bytes(c["bytes"]) for c in content] == \
            [bytes(byte_of[ch] for ch in at.convert_ids_to_tokens(i)) for i in ref.ids]


def test_a_boolean_of_tokenizer_json_given_as_a_string_is_refused_or_changes_nothing(hf_folders):
    """Each true/false of tokenizer.json (model, pre_tokenizer, added tokens, ...) written as the string "false"
    or "true": a one-line error, or a tokenizer that encodes as the boolean would (a key not read); `bool("false")`
    turned ignore_merges on, and an added token's "special": "false" made it special."""
    from nanoeuler.errors import UserError
    from nanoeuler.interop.hf_tokenizer import from_hf_json
    d = json.loads((hf_folders[False][1] / "tokenizer.json").read_text())
    d["model"]["ignore_merges"] = False
    d["added_tokens"].append({"id": max(d["model"]["vocab"].values()) + 1, "content": "ing the", "special": False})
    text = "Nothing the king's ing the <|endoftext|> ing   ok"

    def encodings(tok):     # a special is cut out of text only where allowed; a user-defined token always
        return tok.encode(text, allow_special=True), tok.encode(text, allow_special=False)

    def paths(x, at=()):
        if isinstance(x, bool):
            yield at
        for k, v in x.items() if isinstance(x, dict) else enumerate(x) if isinstance(x, list) else ():
            yield from paths(v, (*at, k))

    def with_value(at, v):
        e = json.loads(json.dumps(d))
        parent = e
        for k in at[:-1]:
            parent = parent[k]
        parent[at[-1]] = v
        return e

    found = list(paths(d))
    assert len(found) >= 5
    for at in found:
        for value in (False, True):
            try:
                want = encodings(from_hf_json(with_value(at, value)))
            except UserError:
                continue
            try:
                got = encodings(from_hf_json(with_value(at, str(value).lower())))
            except UserError as e:
                assert "\n" not in str(e)
                continue
            assert got == want, at
