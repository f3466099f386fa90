"""Every command on every architecture (arch.py) besides our own: prepare -> train (stop + resume == straight)
-> eval -> sft (resume) and sft --lora -> lora merge -> dpo -> sample -> chat -> info -> export hf / gguf /
peft, each on a tiny config.json of that architecture; the exports loaded by what reads them (transformers and
PEFT with the same logits; our GGUF import with the same tensors)."""
import io
import json
import sys

import numpy as np
import pytest
from conftest import rel_err, tiny_config

from nanoeuler import Model, Tokenizer
from nanoeuler.arch import ARCHS as REGISTRY, by_format
from nanoeuler.cli import main
from nanoeuler.data.corpus import bundled_works

# what makes each architecture itself switched on, beyond the registry's defaults (GPT-2 and GPT-NeoX as their
# formats hold them: no grouped kv heads); every other architecture of the registry runs as its defaults give it
SWITCHED_ON = {
    "gpt2": dict(n_kv_heads=4),
    "qwen2": dict(tie_embeddings=True),
    "gemma3": dict(n_kv_heads=1, head_dim=16, sliding_window=24, global_every=2),
    "granite": dict(embedding_multiplier=2.5, residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=3.0),
    "smollm3": dict(n_layers=4),   # (layer 3 without RoPE: every 4th, as llama.cpp's)
    "stablelm": dict(partial_rotary_factor=0.5),
    "gemma2": dict(sliding_window=24, attn_softcap=2.0, logit_softcap=5.0),
    "gptneox": dict(n_kv_heads=4, partial_rotary_factor=0.5),
}
ARCHS = {name: dict(n_kv_heads=2, arch=name) | SWITCHED_ON.get(name, {}) for name in REGISTRY if name != "euler"}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    works = bundled_works()
    text = "".join(works[n] for n in sorted(works)[:3])[:300_000]
    (d / "corpus.txt").write_text(text)
    tok = Tokenizer.train([text], vocab_size=300, progress=False)
    tok.save(d / "tok.json")
    assert main(["prepare", str(d / "corpus.txt"), "--tokenizer", str(d / "tok.json"), "--out", str(d / "data"),
                 "--no-progress"]) == 0
    from nanoeuler.training.sft import offline_instructions
    train, held = offline_instructions(n_train=30, n_heldout=6)
    (d / "sft.json").write_text(json.dumps(train))
    (d / "val.json").write_text(json.dumps(held))
    pairs = [{"prompt": f"q{i}=", "chosen": "yes", "rejected": "no"} for i in range(12)]
    (d / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    return d, tok


@pytest.mark.parametrize("arch", ARCHS)
def test_every_command_on_the_architecture(arch, corpus, tmp_path, monkeypatch, capsys):
    d, tok = corpus
    cfg = tiny_config(**dict(vocab_size=tok.vocab_size, dim=32, n_heads=4, n_layers=2, ctx_len=160, ffn_hidden=64,
                             n_mtp=2) | ARCHS[arch])
    cfg.save(tmp_path / "cfg.json")
    ok = lambda argv: main(argv) == 0  # noqa: E731
    common = ["train", str(tmp_path / "cfg.json"), "--data", str(d / "data"), "--steps", "4", "--batch-size", "2",
              "--eval-every", "2", "--eval-batches", "1", "--no-progress", "--json"]
    assert ok(common + ["--out", str(tmp_path / "a")])
    assert ok(common + ["--out", str(tmp_path / "b"), "--stop-after", "2"])
    assert ok(["train", "--out", str(tmp_path / "b"), "--resume", "--data", str(d / "data"), "--no-progress"])
    capsys.readouterr()
    a, b = Model.load(tmp_path / "a"), Model.load(tmp_path / "b")
    assert a.config == cfg and all(np.array_equal(a.params[n], b.params[n]) for n in a.params)
    assert ok(["eval", "--ckpt", str(tmp_path / "a"), "--data", str(d / "data"), "--max-batches", "2", "--json"])
    assert all(np.isfinite(v) for v in json.loads(capsys.readouterr().out).values() if isinstance(v, float))
    sft = ["sft", "--base", str(tmp_path / "a"), "--data", str(d / "sft.json"), "--val", str(d / "val.json"),
           "--steps", "3", "--batch-size", "2", "--eval-every", "3", "--no-progress"]
    assert ok(sft + ["--out", str(tmp_path / "s1")])
    assert ok(sft + ["--out", str(tmp_path / "s2"), "--stop-after", "1"])
    assert ok(sft + ["--out", str(tmp_path / "s2"), "--resume"])
    s1, s2 = Model.load(tmp_path / "s1"), Model.load(tmp_path / "s2")
    assert all(np.array_equal(s1.params[n], s2.params[n]) for n in s1.params)
    assert ok(sft + ["--out", str(tmp_path / "l"), "--lora", "4"])
    assert ok(["lora", "merge", "--ckpt", str(tmp_path / "l"), "--out", str(tmp_path / "lm")])
    assert ok(["dpo", "--sft", str(tmp_path / "s1"), "--data", str(d / "pairs.jsonl"), "--val",
               str(d / "pairs.jsonl"), "--out", str(tmp_path / "d"), "--steps", "2", "--batch-size", "4",
               "--eval-every", "2", "--no-progress"])
    capsys.readouterr()
    assert ok(["sample", "--ckpt", str(tmp_path / "d"), "--prompt", "ROMEO.", "--max-new-tokens", "12",
               "--temperature", "0"])
    assert capsys.readouterr().out.startswith("ROMEO.")
    monkeypatch.setattr(sys, "stdin", io.StringIO("Who speaks?\n"))
    assert ok(["chat", "--ckpt", str(tmp_path / "s1"), "--max-new-tokens", "6", "--seed", "0"])
    assert "> Who speaks?" in capsys.readouterr().out
    assert ok(["info", str(tmp_path / "a"), "--batch", "2", "--lora", "4"])
    assert arch in capsys.readouterr().out
    check_exports(tmp_path)


def check_exports(tmp_path):
    """export --format gguf reads back bit for bit; --format hf loads in transformers with our logits; --format
    peft's adapters on transformers' load of the base's hf export give the merged model's logits."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from nanoeuler.interop.gguf_import import load_gguf
    ok = lambda argv: main(argv) == 0  # noqa: E731
    s1 = Model.load(tmp_path / "s1")
    assert ok(["export", "--ckpt", str(tmp_path / "s1"), "--format", "gguf", "--out", str(tmp_path / "s1.gguf"),
               "--no-progress"])
    cfg, params, _, _ = load_gguf(tmp_path / "s1.gguf")
    as_gguf = by_format("gguf", s1.config.spec.gguf.name).name   # (a Mistral's GGUF is llama's: it reads back so)
    assert cfg == s1.config.replace(n_mtp=1, arch=as_gguf)
    assert all(np.array_equal(params[n], s1.params[n]) for n in params)
    ids = np.random.default_rng(0).integers(0, s1.config.vocab_size, (1, 30))
    for ckpt, model in (("s1", s1), ("a", Model.load(tmp_path / "a"))):
        assert ok(["export", "--ckpt", str(tmp_path / ckpt), "--format", "hf", "--out", str(tmp_path / f"{ckpt}-hf"),
                   "--no-progress"])
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "s1-hf", attn_implementation="eager")
    with torch.no_grad():
        assert rel_err(hf(torch.tensor(ids)).logits.numpy(), s1.logits(ids)[0]) <= 1e-4
    assert ok(["export", "--ckpt", str(tmp_path / "l"), "--format", "peft", "--out", str(tmp_path / "l-peft")])
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "a-hf", attn_implementation="eager")
    tuned = peft.PeftModel.from_pretrained(base, tmp_path / "l-peft")
    with torch.no_grad():
        assert rel_err(tuned(torch.tensor(ids)).logits.numpy(), Model.load(tmp_path / "lm").logits(ids)[0]) <= 1e-4


@pytest.mark.parametrize("command", ["import", "export"])
def test_import_and_export_help_name_every_architecture(command, capsys):
    """--help lists the architectures the registry holds, under each format's own names (it once named only
    llama and gpt2, and refused biases and sliding windows that qwen2 and gemma3 have)."""
    from nanoeuler.arch import ARCHS
    assert main([command, "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert ", ".join(a.hf.aliases[0] for a in ARCHS.values()) in text      # LlamaForCausalLM, Qwen2ForCausalLM, ...
    assert ", ".join(dict.fromkeys(a.gguf.name for a in ARCHS.values())) in text   # llama, qwen2, qwen3, ... (mistral's: llama)
