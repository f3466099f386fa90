"""GPT-2 on our engine vs transformers + torch autograd (llm.c's test_gpt2, on nanoeuler).

A GPT2LMHeadModel is made by transformers in the test (random weights, then every bias and norm weight
pushed away from its init so each term matters), saved with save_pretrained beside a vocab.json +
merges.txt trained here on the bundled corpus (the real GPT-2 files cannot be downloaded) and numbered as
GPT-2's are (bytes in byte-to-unicode order at 0..255, merge i at 256 + i, <|endoftext|> last), and
imported with nanoeuler.interop.gpt2. Then:
- logits vs transformers (LOGITS_TOL, float32);
- head-0 loss and every parameter gradient vs torch autograd (LOSS_TOL, GRAD_TOL; float32 and float64);
- 10 AdamW steps of fine-tuning, ours vs torch.optim.AdamW: the 10 losses agree (ADAMW_TOL);
- export -> transformers loads the folder -> identical logits; export -> import gives the same weights;
- the tokenizer: our encode of the corpus == transformers' GPT2Tokenizer (and `tokenizers`' BPE) built from
  the same vocab.json/merges.txt, id for id (the import keeps GPT-2's ids and wte's rows as they are);
- bad folders: one-line UserErrors.

Relative error of a tensor a against the reference b: max|a - b| / max|b| (tensor-wise), as in
tests/test_torch_parity.py. Token ids are the same on both sides: no mapping anywhere in this file.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from nanoeuler import Model
from nanoeuler.errors import UserError
from nanoeuler.interop.gpt2 import read_gpt2_tokenizer
from nanoeuler.interop.hf import export_hf as export_gpt2_folder, load_hf_folder as load_gpt2_folder
from conftest import rel_err

torch.set_num_threads(1)
transformers = pytest.importorskip("transformers")  # the `test` extra installs it; see pyproject

# docs/gpt2.md's figures (measured: `python tests/test_gpt2_torch.py`) with a margin of about 1.5: errors are
# per entry (conftest.rel_err), the losses relative.
LOGITS_TOL = 1.5e-5                                 # float32, measured 9.4e-6
LOGITS_124M_TOL = 1e-4                              # float32, the full 124 M shape: measured 6.5e-5
LOSS_TOL = {np.float32: 1e-7, np.float64: 1e-14}    # measured 3.8e-8, 0
GRAD_TOL = {np.float32: 2e-4, np.float64: 1.2e-11}  # measured 1.3e-4, 7.8e-12
ADAMW_TOL = 2e-7                                    # the 10 losses, measured 1.1e-7
EOT = "<|endoftext|>"




def corpus_text(n_chars: int) -> str:
    from nanoeuler.data.corpus import bundled_works
    works = bundled_works()
    return "".join(works[name] for name in sorted(works))[:n_chars]


# ------------------------------------------------------------------------------ fixtures

def train_gpt2_files(d: Path) -> Path:
    """vocab.json + merges.txt of a small byte-level BPE trained by `tokenizers` on the bundled corpus,
    renumbered as OpenAI's GPT-2 files are: byte tokens in byte-to-unicode order ('!' = 0, 'Ġ' = 220), merge i
    = 256 + i in merges.txt order, <|endoftext|> last (the trainer puts it first). Not our engine's order."""
    from tokenizers import ByteLevelBPETokenizer

    from nanoeuler.interop.gpt2 import gpt2_byte_order
    from nanoeuler.tokenizer import bytes_to_unicode
    t = ByteLevelBPETokenizer(add_prefix_space=False)
    t.train_from_iterator([corpus_text(400_000)], vocab_size=420, min_frequency=2, special_tokens=[EOT],
                          show_progress=False)
    t.save_model(str(d))
    merges = [ln for ln in (d / "merges.txt").read_text(encoding="utf-8").splitlines() if ln and not ln.startswith("#")]
    alpha = bytes_to_unicode()
    vocab = {alpha[b]: i for i, b in enumerate(gpt2_byte_order())}
    for i, m in enumerate(merges):
        vocab[m.replace(" ", "")] = 256 + i
    vocab[EOT] = len(vocab)
    assert set(vocab) == set(vocab_of(d))  # the same tokens, numbered GPT-2's way
    (d / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    return d


@pytest.fixture(scope="module")
def tok_files(tmp_path_factory) -> Path:
    return train_gpt2_files(tmp_path_factory.mktemp("gpt2tok"))


def vocab_of(tok_files: Path) -> dict:
    return json.loads((tok_files / "vocab.json").read_text(encoding="utf-8"))


def make_hf_model(tok_files: Path, seed: int = 0, n_positions: int = 32, n_embd: int = 32, n_layer: int = 2,
                  n_head: int = 4):
    from transformers import GPT2Config, GPT2LMHeadModel
    vocab = vocab_of(tok_files)
    eot = vocab[EOT]
    cfg = GPT2Config(vocab_size=len(vocab), n_positions=n_positions, n_embd=n_embd, n_layer=n_layer, n_head=n_head,
                     activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                     bos_token_id=eot, eos_token_id=eot, attn_implementation="eager")
    torch.manual_seed(seed)
    m = GPT2LMHeadModel(cfg).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if p.ndim == 1:  # biases 0 and LayerNorm weights 1 at init: move them so every term matters
                p.add_(0.1 * torch.randn(p.shape, generator=g))
            elif "wpe" in name:
                p.add_(0.05 * torch.randn(p.shape, generator=g))
    return m


def save_folder(m, tok_files: Path, out: Path) -> Path:
    m.save_pretrained(str(out), safe_serialization=True)
    for f in ("vocab.json", "merges.txt"):
        shutil.copy(tok_files / f, out / f)
    return out


@pytest.fixture(scope="module")
def folder(tok_files, tmp_path_factory) -> Path:
    return save_folder(make_hf_model(tok_files), tok_files, tmp_path_factory.mktemp("gpt2") / "hf")


def hf_tokens(V: int, seed: int, B: int = 3, T: int = 24) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, V, (B, T + 1))


def torch_grads_as_ours(m, cfg) -> dict[str, np.ndarray]:
    """transformers' parameter gradients under our names and orientation (written here, independently of
    interop/gpt2.py: Conv1D weights are [in, out], c_attn is q | k | v along its output axis)."""
    g = {n.removeprefix("transformer."): p.grad.detach().numpy() for n, p in m.named_parameters()}
    d = cfg.dim
    out = {"embed.weight": g["wte.weight"], "pos_embed.weight": g["wpe.weight"],
           "norm.weight": g["ln_f.weight"], "norm.bias": g["ln_f.bias"]}
    for i in range(cfg.n_layers):
        h, o = f"h.{i}.", f"layers.{i}."
        for j, part in enumerate("qkv"):
            out[o + f"attn.w{part}.weight"] = g[h + "attn.c_attn.weight"][:, j * d:(j + 1) * d].T
            out[o + f"attn.w{part}.bias"] = g[h + "attn.c_attn.bias"][j * d:(j + 1) * d]
        out[o + "attn.wo.weight"] = g[h + "attn.c_proj.weight"].T
        out[o + "attn.wo.bias"] = g[h + "attn.c_proj.bias"]
        out[o + "ffn.fc.weight"] = g[h + "mlp.c_fc.weight"].T
        out[o + "ffn.fc.bias"] = g[h + "mlp.c_fc.bias"]
        out[o + "ffn.proj.weight"] = g[h + "mlp.c_proj.weight"].T
        out[o + "ffn.proj.bias"] = g[h + "mlp.c_proj.bias"]
        for ours, theirs in (("attn_norm", "ln_1"), ("ffn_norm", "ln_2")):
            out[o + ours + ".weight"] = g[h + theirs + ".weight"]
            out[o + ours + ".bias"] = g[h + theirs + ".bias"]
    return out


def torch_loss(m, hf_ids: np.ndarray):
    """Mean next-token cross-entropy of tokens [B, T+1] (inputs [:, :T], targets [:, 1:])."""
    ids = torch.as_tensor(hf_ids)
    logits = m(input_ids=ids[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


# ------------------------------------------------------------------------------ the tokenizer

def test_tokenizer_parity_with_hf_gpt2_tokenizer(tok_files):
    """transformers' GPT2Tokenizer (from_pretrained on the folder: vocab.json + merges.txt) and the
    `tokenizers` ByteLevelBPETokenizer built from the same two files."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import GPT2Tokenizer
    vocab = vocab_of(tok_files)
    tok = read_gpt2_tokenizer(tok_files, len(vocab), vocab[EOT])
    assert tok.vocab_size == len(vocab) and tok.eos_token == EOT and tok.eos_id == vocab[EOT] == len(vocab) - 1
    assert vocab["!"] == 0 and vocab["Ġ"] == 220                    # GPT-2's byte ids: not the bytes' values
    assert tok.encode(" ") == [220] and tok.encode("!") == [0] and tok.token_bytes(220) == b" "
    hf = GPT2Tokenizer.from_pretrained(str(tok_files))
    bl = ByteLevelBPETokenizer(str(tok_files / "vocab.json"), str(tok_files / "merges.txt"))
    assert len(hf.get_vocab()) == len(vocab)
    text = corpus_text(2_000_000)                                   # the bundled corpus, 2 MB of it
    ours = tok.encode_array(text)
    theirs = hf(text)["input_ids"]
    assert len(ours) > 100_000 and ours.tolist() == theirs
    assert tok.decode(theirs) == text == hf.decode(ours.tolist())
    from nanoeuler.tokenizer import encode_parallel
    parts = [text[:30_000], text[30_000:60_000]]
    assert [a.tolist() for a in encode_parallel(tok, parts, processes=2, batch_bytes=10_000)] == \
        [hf(t)["input_ids"] for t in parts]                          # worker processes carry the ids too
    tricky = "Hello  world!\n\n  It's 2026 — naïve café, 'tis… 你好 \t\r\n end   "
    small = text[:20_000] + tricky
    assert tok.encode(small) == bl.encode(small).ids == hf.encode(small)
    assert tok.decode(tok.encode(small)) == small
    assert tok.encode_bytes(small.encode()) == tok.encode(small)
    eot = f"a{EOT}b"
    assert tok.encode(eot, allow_special=True) == hf.encode(eot) and vocab[EOT] in hf.encode(eot)


def test_real_gpt2_numbering_keeps_ids():
    """With GPT-2's own numbering (bytes in byte-to-unicode order, merge i = 256 + i) the tokenizer speaks
    GPT-2's ids; only the byte tokens are numbered differently from the engine's order."""
    from nanoeuler.interop.gpt2 import gpt2_byte_order, tokenizer_dict_from_vocab_merges
    from nanoeuler.interop.hf_tokenizer import from_hf_json
    from nanoeuler.tokenizer import bytes_to_unicode
    alpha = bytes_to_unicode()
    order = gpt2_byte_order()
    vocab = {alpha[b]: i for i, b in enumerate(order)}
    assert vocab["!"] == 0 and vocab["Ġ"] == 220 and vocab["ÿ"] == 187 and vocab["Ā"] == 188
    merges = ["Ġ t", "h e", "Ġt he"]
    for i, m in enumerate(merges):
        vocab[m.replace(" ", "")] = 256 + i
    vocab[EOT] = 259
    tok = from_hf_json(tokenizer_dict_from_vocab_merges(vocab, "#version: 0.2\n" + "\n".join(merges) + "\n"),
                       None, 259)
    assert tok.ids[256:].tolist() == [256, 257, 258, 259] and tok.ids[32] == 220 and tok.ids[ord("!")] == 0
    assert tok.encode(" the") == [258] and tok.encode(" x!") == [220, vocab["x"], 0] and tok.eos_id == 259
    assert tok.decode([220, vocab["x"], 0, 258]) == " x! the"


# ------------------------------------------------------------------------------ the model

def test_import_logits_match_transformers(folder):
    cfg, params, tok = load_gpt2_folder(folder)
    assert cfg.arch == "gpt2" and cfg.n_mtp == 1 and cfg.vocab_size == tok.vocab_size
    m = make_hf_model_from(folder)
    assert np.array_equal(params["embed.weight"], m.transformer.wte.weight.detach().numpy())  # rows not permuted
    hf_ids = hf_tokens(cfg.vocab_size, 1, B=2, T=cfg.ctx_len - 1)[:, :cfg.ctx_len]   # the whole position table
    ours = Model(cfg, params).logits(hf_ids)[0]                           # [B, T, V]
    with torch.no_grad():
        theirs = m(input_ids=torch.as_tensor(hf_ids)).logits.numpy()
    err = rel_err(ours, theirs)
    assert err <= LOGITS_TOL, err
    assert rel_err(ours, theirs[..., ::-1]) > 1e-2   # the comparison can fail


def make_hf_model_from(folder: Path, dtype=torch.float32):
    from transformers import GPT2LMHeadModel
    return GPT2LMHeadModel.from_pretrained(str(folder), attn_implementation="eager", dtype=dtype).eval()


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
def test_loss_and_every_gradient_match_torch_autograd(folder, dtype):
    cfg, params, _ = load_gpt2_folder(folder)
    m = make_hf_model_from(folder, torch.float64 if dtype == np.float64 else torch.float32)
    model = Model(cfg, {n: p.astype(dtype) for n, p in params.items()})
    if dtype == np.float64:  # the f64 torch model starts from the same (f32-stored) weights
        assert rel_err(model.params["layers.1.ffn.fc.weight"], m.transformer.h[1].mlp.c_fc.weight.detach().numpy().T) == 0
    hf_ids = hf_tokens(cfg.vocab_size, 2)
    loss, objective, grads = model.loss_and_grads(hf_ids)
    tl = torch_loss(m, hf_ids)
    tl.backward()
    assert abs(loss - tl.item()) <= LOSS_TOL[dtype] * abs(tl.item()) and objective == loss
    tgrads = torch_grads_as_ours(m, cfg)
    assert set(tgrads) == set(grads)
    # attn.wk.bias: adding a bias to every key shifts a whole row of scores by q·b, which softmax ignores,
    # so its true gradient is exactly 0 and both sides hold only round-off: measured against wq.bias's scale
    errs = {n: rel_err(grads[n], tgrads[n]) if not n.endswith("attn.wk.bias") else
            float(np.abs(grads[n] - tgrads[n]).max() / np.abs(tgrads[n.replace("wk", "wq")]).max())
            for n in grads}
    bad = {n: e for n, e in errs.items() if not e <= GRAD_TOL[dtype]}
    assert not bad, bad
    for n in grads:  # every gradient carries signal (wk.bias: exactly zero in both, softmax ignores it)
        assert grads[n].dtype == dtype
        assert np.abs(tgrads[n]).max() > 1e-6 or n.endswith("attn.wk.bias"), n


def test_ten_adamw_steps_match_torch(folder):
    from nanoeuler.optim import AdamW
    cfg, params, _ = load_gpt2_folder(folder)
    m = make_hf_model_from(folder).train()  # dropout is 0: train() changes nothing but the mode
    model = Model(cfg, params)
    lr, wd = 1e-3, 0.1
    opt = AdamW(model.params, lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=wd)
    ps = [p for p in m.parameters()]
    topt = torch.optim.AdamW([{"params": [p for p in ps if p.ndim >= 2], "weight_decay": wd},
                              {"params": [p for p in ps if p.ndim < 2], "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    from transformers import GPT2Tokenizer
    text_ids = GPT2Tokenizer.from_pretrained(str(folder))(corpus_text(5000))["input_ids"]
    hf_ids = np.array(text_ids[:4 * 17]).reshape(4, 17)   # one batch of Shakespeare, B=4, T=16 (as llm.c: the same batch 10 times)
    ours, theirs = [], []
    for step in range(10):
        loss, _, grads = model.loss_and_grads(hf_ids)
        opt.step(model.params, grads)
        topt.zero_grad()
        tl = torch_loss(m, hf_ids)
        tl.backward()
        topt.step()
        ours.append(loss)
        theirs.append(tl.item())
    errs = [abs(a - b) / abs(b) for a, b in zip(ours, theirs)]
    assert max(errs) <= ADAMW_TOL, (ours, theirs, errs)
    assert theirs[-1] < theirs[0] - 0.3   # it is learning (6.05 -> 5.54 measured)


def test_export_then_transformers_and_import_round_trip(folder, tmp_path):
    from transformers import GPT2Tokenizer
    cfg, params, tok = load_gpt2_folder(folder)
    out = export_gpt2_folder(Model(cfg, params), tok, tmp_path / "exported", progress=False)
    m0, m1 = make_hf_model_from(folder), make_hf_model_from(out)
    text = corpus_text(3000)[1000:1400]
    t0, t1 = GPT2Tokenizer.from_pretrained(str(folder)), GPT2Tokenizer.from_pretrained(str(out))
    ids0, ids1 = t0(text)["input_ids"][:cfg.ctx_len], t1(text)["input_ids"][:cfg.ctx_len]
    assert len(ids0) == cfg.ctx_len and ids1 == ids0 == tok.encode(text)[:cfg.ctx_len]  # the same ids
    assert t1.get_vocab() == t0.get_vocab()
    assert json.loads((out / "vocab.json").read_text(encoding="utf-8")) == vocab_of(folder)
    assert (out / "merges.txt").read_text(encoding="utf-8").splitlines()[1:] == \
        (folder / "merges.txt").read_text(encoding="utf-8").splitlines()[1:]
    with torch.no_grad():
        l0 = m0(input_ids=torch.tensor([ids0])).logits.numpy()
        l1 = m1(input_ids=torch.tensor([ids1])).logits.numpy()
    assert rel_err(l1, l0) <= 1e-6
    cfg2, params2, tok2 = load_gpt2_folder(out)
    assert cfg2 == cfg and tok2.fingerprint() == tok.fingerprint() and tok2.eos_token == tok.eos_token
    assert all(np.array_equal(params2[n], params[n]) for n in params)
    # a folder with tokenizer.json only (no vocab.json / merges.txt) imports the same
    (out / "vocab.json").unlink()
    (out / "merges.txt").unlink()
    cfg3, params3, tok3 = load_gpt2_folder(out)
    assert tok3.fingerprint() == tok.fingerprint() and tok3.special_tokens == tok.special_tokens
    assert all(np.array_equal(params3[n], params[n]) for n in params)


# ------------------------------------------------------------------------------ bad folders

def _copy(folder: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "bad"
    shutil.copytree(folder, dst)
    return dst


def test_bad_gpt2_folders_are_one_line_errors(folder, tmp_path):
    from nanoeuler.interop.safetensors_io import read_tensors, write_tensors
    # a missing tensor
    bad = _copy(folder, tmp_path)
    W = {n: a for n, (_, a) in read_tensors(bad / "model.safetensors").items()}
    del W["transformer.h.1.mlp.c_fc.bias"]
    write_tensors(bad / "model.safetensors", W)
    with pytest.raises(UserError, match="h.1.mlp.c_fc.bias is missing"):
        load_gpt2_folder(bad)
    shutil.rmtree(bad)
    # vocab/merges naming fewer tokens than the embedding has rows (one merge dropped)
    bad = _copy(folder, tmp_path)
    lines = (bad / "merges.txt").read_text(encoding="utf-8").splitlines()
    last = lines.pop()
    (bad / "merges.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    vocab = vocab_of(bad)
    del vocab[last.replace(" ", "")]
    (bad / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    with pytest.raises(UserError, match="names 419 tokens but the embedding .wte. has 420 rows"):
        load_gpt2_folder(bad)
    shutil.rmtree(bad)
    # config.json promising more positions than wpe holds
    bad = _copy(folder, tmp_path)
    c = json.loads((bad / "config.json").read_text())
    c["n_positions"] = 64
    (bad / "config.json").write_text(json.dumps(c))
    with pytest.raises(UserError, match="wpe.weight has 32 positions but config.json says n_positions 64"):
        load_gpt2_folder(bad)
    c["n_positions"], c["activation_function"] = 32, "relu"
    (bad / "config.json").write_text(json.dumps(c))
    with pytest.raises(UserError, match="activation_function='relu' is not supported for gpt2"):
        load_gpt2_folder(bad)


def test_full_124m_shape_imports_with_gpt2_numbering(tmp_path):
    """The 124 M shape (V 50257, d 768, 12 layers, 12 heads, ctx 1024), random weights, with a vocabulary
    numbered as GPT-2's: bytes in byte-to-unicode order, 50,000 merges at 256 + i, <|endoftext|> = 50256
    (the merges here are byte pairs, since the real files cannot be downloaded). Logits per entry <= 1e-4."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from nanoeuler.interop.gpt2 import gpt2_byte_order
    from nanoeuler.tokenizer import bytes_to_unicode
    alpha = bytes_to_unicode()
    order = [alpha[b] for b in gpt2_byte_order()]
    vocab = {s: i for i, s in enumerate(order)}
    merges = [f"{a} {b}" for a in order for b in order][:50_000]
    for i, m in enumerate(merges):
        vocab[m.replace(" ", "")] = 256 + i
    vocab[EOT] = 50256
    cfg = GPT2Config(attn_implementation="eager", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # the defaults are GPT-2 124M
    assert (cfg.vocab_size, cfg.n_embd, cfg.n_layer, cfg.n_head, cfg.n_positions) == (50257, 768, 12, 12, 1024)
    torch.manual_seed(0)
    m = GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():
        for p in m.parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn(p.shape))
    m.save_pretrained(str(tmp_path / "gpt2"), safe_serialization=True)
    (tmp_path / "gpt2" / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (tmp_path / "gpt2" / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
    ours_cfg, params, tok = load_gpt2_folder(tmp_path / "gpt2")
    assert ours_cfg.replace(n_mtp=1) == ours_cfg and ours_cfg.n_params() == 124_439_808 == m.num_parameters()
    assert tok.vocab_size == 50257 and tok.eos_id == 50256 and tok.ids[256:].tolist() == list(range(256, 50257))
    assert tok.encode("!!") == [vocab["!!"]] == [256] and tok.encode(" ") == [220]   # GPT-2's ids, exactly
    hf_ids = np.random.default_rng(0).integers(0, 50257, (1, 48))
    with torch.no_grad():
        theirs = m(input_ids=torch.as_tensor(hf_ids)).logits.numpy()
    ours = Model(ours_cfg, params).logits(hf_ids)[0]
    err = rel_err(ours, theirs)
    assert err <= LOGITS_124M_TOL, err


def test_cli_import_sample_export_and_bad_input(folder, tmp_path, capsys):
    """`nanoeuler import --from DIR` takes the GPT-2 folder; sample / info / export --format hf work on it;
    a broken folder or config is one line `error: ...` and exit code != 0."""
    from nanoeuler.cli import main
    run = tmp_path / "run"
    assert main(["import", "--from", str(folder), "--out", str(run), "--no-progress", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["config"]["arch"] == "gpt2" and got["tokenizer"]["eos"] == EOT and got["n_params"] > 0
    assert main(["sample", "--ckpt", str(run), "--prompt", "ROMEO.", "--max-new-tokens", "8", "--temperature", "0"]) == 0
    assert "ROMEO." in capsys.readouterr().out
    assert main(["info", str(run)]) == 0
    assert "gpt2" in capsys.readouterr().out
    assert main(["export", "--ckpt", str(run), "--format", "hf", "--out", str(tmp_path / "hf"), "--no-progress"]) == 0
    capsys.readouterr()
    m0, m1 = make_hf_model_from(folder), make_hf_model_from(tmp_path / "hf")
    assert m1.config.model_type == "gpt2"
    assert torch.equal(m0.transformer.h[1].mlp.c_proj.weight, m1.transformer.h[1].mlp.c_proj.weight)
    capsys.readouterr()  # transformers' loading bars
    # bad input, through the CLI
    bad = _copy(folder, tmp_path)
    c = json.loads((bad / "config.json").read_text())
    c["n_positions"] = 4096
    (bad / "config.json").write_text(json.dumps(c))
    assert main(["import", "--from", str(bad), "--out", str(tmp_path / "x"), "--no-progress"]) != 0
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "n_positions 4096" in err
    cfgfile = tmp_path / "cfg.json"
    d = json.loads((run / "config.json").read_text()) if (run / "config.json").is_file() else None
    if d is not None:
        d["arch"] = "gpt3"
        cfgfile.write_text(json.dumps(d))
        assert main(["info", str(cfgfile)]) != 0
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and "unknown arch 'gpt3'" in err
    assert main(["sample", "--ckpt", str(run), "--prompt", "x" * 200, "--max-new-tokens", "2"]) == 0  # a long prompt: the window keeps the last ctx tokens


def measure(tmp: Path) -> dict:
    """Every number the tests above bound, measured once (python tests/test_gpt2_torch.py prints them)."""
    from transformers import GPT2Tokenizer

    from nanoeuler.optim import AdamW
    tf = tmp / "tok"
    tf.mkdir()
    train_gpt2_files(tf)
    folder = save_folder(make_hf_model(tf), tf, tmp / "hf")
    out = {}
    cfg, params, tok = load_gpt2_folder(folder)
    text = corpus_text(2_000_000)
    ours_ids = tok.encode_array(text)
    out["tokenizer_equal_tokens"] = (ours_ids.tolist() == GPT2Tokenizer.from_pretrained(str(folder))(text)["input_ids"],
                                     len(ours_ids))
    m = make_hf_model_from(folder)
    hf_ids = hf_tokens(cfg.vocab_size, 1, B=2, T=cfg.ctx_len - 1)[:, :cfg.ctx_len]
    with torch.no_grad():
        theirs = m(input_ids=torch.as_tensor(hf_ids)).logits.numpy()
    out["logits_rel_f32"] = rel_err(Model(cfg, params).logits(hf_ids)[0], theirs)
    for dtype, tdt in ((np.float32, torch.float32), (np.float64, torch.float64)):
        m = make_hf_model_from(folder, tdt)
        model = Model(cfg, {n: p.astype(dtype) for n, p in params.items()})
        ids = hf_tokens(cfg.vocab_size, 2)
        loss, _, grads = model.loss_and_grads(ids)
        tl = torch_loss(m, ids)
        tl.backward()
        tg = torch_grads_as_ours(m, cfg)
        errs = {n: rel_err(grads[n], tg[n]) for n in grads if not n.endswith("attn.wk.bias")}
        worst = max(errs, key=errs.get)
        out[f"loss_rel_{np.dtype(dtype).name}"] = abs(loss - tl.item()) / abs(tl.item())
        out[f"max_grad_rel_{np.dtype(dtype).name}"] = (errs[worst], worst)
        out[f"wk_bias_abs_{np.dtype(dtype).name}"] = max(float(np.abs(grads[n]).max()) for n in grads if n.endswith("wk.bias"))
    m = make_hf_model_from(folder).train()
    model = Model(cfg, params)
    opt = AdamW(model.params, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    ps = list(m.parameters())
    topt = torch.optim.AdamW([{"params": [p for p in ps if p.ndim >= 2], "weight_decay": 0.1},
                              {"params": [p for p in ps if p.ndim < 2], "weight_decay": 0.0}],
                             lr=1e-3, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    ids = np.array(GPT2Tokenizer.from_pretrained(str(folder))(corpus_text(5000))["input_ids"][:68]).reshape(4, 17)
    losses = []
    for _ in range(10):
        loss, _, grads = model.loss_and_grads(ids)
        opt.step(model.params, grads)
        topt.zero_grad()
        tl = torch_loss(m, ids)
        tl.backward()
        topt.step()
        losses.append((loss, tl.item()))
    out["adamw_10_losses_ours_torch"] = [(round(a, 6), round(b, 6)) for a, b in losses]
    out["adamw_max_rel"] = max(abs(a - b) / abs(b) for a, b in losses)
    return out


if __name__ == "__main__":
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        for k, v in measure(Path(d)).items():
            print(f"{k:28s} {v}")


def test_cli_fine_tune_an_imported_gpt2_on_shakespeare(folder, tmp_path, capsys):
    """llm.c's quick start: import GPT-2, prepare the corpus with its tokenizer, `train --init-from` it."""
    from nanoeuler.cli import main
    run, data = tmp_path / "gpt2", tmp_path / "data"
    (tmp_path / "corpus.txt").write_text(corpus_text(200_000))
    assert main(["import", "--from", str(folder), "--out", str(run), "--no-progress"]) == 0
    assert main(["prepare", str(tmp_path / "corpus.txt"), "--tokenizer", str(run / "tokenizer.json"), "--out",
                 str(data), "--no-progress"]) == 0
    assert main(["train", "--init-from", str(run), "--out", str(tmp_path / "ft"), "--data", str(data), "--steps", "6",
                 "--batch-size", "4", "--lr", "1e-3", "--warmup", "1", "--eval-every", "6", "--no-progress", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["finished"] and summary["step"] == 6
    log = [json.loads(x) for x in (tmp_path / "ft" / "log.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in log if "loss" in r]
    assert losses[-1] < losses[0]                                    # it fine-tunes
    before, after = Model.load(run), Model.load(tmp_path / "ft")
    assert after.config == before.config and not np.array_equal(after.params["embed.weight"], before.params["embed.weight"])
    assert main(["train", "--init-from", str(run), "gpt2-tiny", "--out", str(tmp_path / "x"), "--data", str(data)]) == 2
    assert "--init-from takes the config of its checkpoint" in capsys.readouterr().err


def test_openai_layout_without_prefix_and_with_mask_buffers_imports(folder, tmp_path):
    """OpenAI's upload on the Hub names tensors without `transformer.` and stores the causal-mask buffers
    h.i.attn.bias [1, 1, ctx, ctx]: the same model must come out."""
    from nanoeuler.interop.safetensors_io import read_tensors, write_tensors
    bad = _copy(folder, tmp_path)
    W = {n.removeprefix("transformer."): a for n, (_, a) in read_tensors(bad / "model.safetensors").items()}
    n_pos = W["wpe.weight"].shape[0]
    for i in range(2):
        W[f"h.{i}.attn.bias"] = np.tril(np.ones((n_pos, n_pos), np.float32))[None, None]
    write_tensors(bad / "model.safetensors", W)
    cfg, params, tok = load_gpt2_folder(bad)
    cfg0, params0, tok0 = load_gpt2_folder(folder)
    assert cfg == cfg0 and all(np.array_equal(params[n], params0[n]) for n in params0)
    W["h.0.mlp.c_fc.extra"] = np.zeros(3, np.float32)
    write_tensors(bad / "model.safetensors", W)
    with pytest.raises(UserError, match="unexpected tensor h.0.mlp.c_fc.extra"):
        load_gpt2_folder(bad)
