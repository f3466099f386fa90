"""arch gpt2 downstream: KV-cache generation (logits equal to the full recomputation, every mode the same
greedy tokens), and the CLI pipeline (train with resume, sft, sample, eval, info, import/export)."""
import numpy as np

from nanoeuler import Model
from nanoeuler.infer.cache import new_cache
from nanoeuler.infer.session import generate
from nanoeuler.infer.step import forward_cached
from conftest import rel_err, tiny_config

TINY = tiny_config(vocab_size=300, dim=32, n_heads=4, n_kv_heads=4, n_layers=2, ctx_len=24, ffn_hidden=64, n_mtp=2,
                   arch="gpt2")


def random_model(cfg, seed=0, dtype=np.float64):
    rng = np.random.default_rng(seed)
    m = Model.init(cfg, seed=seed, dtype=dtype)
    for n, p in m.params.items():   # far from init: biases and norms matter
        p += (0.3 if p.ndim > 1 else 0.2) * rng.standard_normal(p.shape).astype(dtype)
    return m


def test_cached_forward_equals_full_recomputation():
    m = random_model(TINY)
    ids = np.random.default_rng(1).integers(0, TINY.vocab_size, (2, 20))
    full = m.logits(ids)                                           # [K, B, T, V]
    cache = new_cache(TINY, batch=2, dtype=np.float64)
    parts = [forward_cached(TINY, m.params, ids[:, :7], cache), forward_cached(TINY, m.params, ids[:, 7:8], cache),
             forward_cached(TINY, m.params, ids[:, 8:], cache)]
    got = np.concatenate(parts, axis=2)
    assert rel_err(got, full) <= 1e-10
    # positions matter: the same tokens one position later give other logits
    cache2 = new_cache(TINY, batch=2, dtype=np.float64)
    forward_cached(TINY, m.params, ids[:, :1], cache2)
    shifted = forward_cached(TINY, m.params, ids[:, :7], cache2)
    assert np.max(np.abs(shifted[:, :, -1] - parts[0][:, :, -1])) > 1e-3


def test_every_generation_mode_gives_the_same_greedy_tokens():
    m = random_model(TINY, seed=2, dtype=np.float32)
    prompt = [5, 17, 250, 3]
    outs = {mode: generate(m, prompt, max_new_tokens=40, temperature=0, mode=mode).ids      # 44 > ctx 24: window jumps
            for mode in ("full", "cache", "speculative")}
    assert len(outs["full"]) == 40
    assert outs["full"] == outs["cache"] == outs["speculative"]


def test_cli_pipeline_on_gpt2(tmp_path, monkeypatch, capsys):
    """prepare -> train (stop + resume == straight) -> eval -> sft (resume) -> dpo -> sample -> chat -> info,
    every command on an arch-gpt2 config.json, unchanged."""
    import io
    import json
    import sys

    from nanoeuler import Tokenizer
    from nanoeuler.cli import main
    from nanoeuler.data.corpus import bundled_works
    from nanoeuler.sft import offline_instructions
    works = bundled_works()
    text = "".join(works[n] for n in sorted(works)[:3])[:300_000]
    (tmp_path / "corpus.txt").write_text(text)
    tok = Tokenizer.train([text], vocab_size=300, progress=False)
    tok.save(tmp_path / "tok.json")
    cfg = TINY.replace(vocab_size=tok.vocab_size, ctx_len=160, n_mtp=2)
    cfg.save(tmp_path / "gpt2.json")
    ok = lambda argv: main(argv) == 0  # noqa: E731
    assert ok(["prepare", str(tmp_path / "corpus.txt"), "--tokenizer", str(tmp_path / "tok.json"),
               "--out", str(tmp_path / "data"), "--no-progress"])
    common = ["train", str(tmp_path / "gpt2.json"), "--data", str(tmp_path / "data"), "--steps", "4",
              "--batch-size", "2", "--eval-every", "2", "--eval-batches", "1", "--no-progress", "--json"]
    assert ok(common + ["--out", str(tmp_path / "a")])
    assert ok(common + ["--out", str(tmp_path / "b"), "--stop-after", "2"])
    assert ok(["train", "--out", str(tmp_path / "b"), "--resume", "--data", str(tmp_path / "data"), "--no-progress"])
    capsys.readouterr()
    a, b = Model.load(tmp_path / "a"), Model.load(tmp_path / "b")
    assert a.config.arch == "gpt2" and all(np.array_equal(a.params[n], b.params[n]) for n in a.params)
    assert ok(["eval", "--ckpt", str(tmp_path / "a"), "--data", str(tmp_path / "data"), "--max-batches", "2", "--json"])
    ev = json.loads(capsys.readouterr().out)
    assert np.isfinite(ev["loss"]) if "loss" in ev else all(np.isfinite(v) for v in ev.values() if isinstance(v, float))
    train, held = offline_instructions(n_train=30, n_heldout=6)
    (tmp_path / "sft.json").write_text(json.dumps(train))
    (tmp_path / "val.json").write_text(json.dumps(held))
    sft = ["sft", "--base", str(tmp_path / "a"), "--data", str(tmp_path / "sft.json"), "--val",
           str(tmp_path / "val.json"), "--steps", "3", "--batch-size", "2", "--eval-every", "3", "--no-progress"]
    assert ok(sft + ["--out", str(tmp_path / "s1")])
    assert ok(sft + ["--out", str(tmp_path / "s2"), "--stop-after", "1"])
    assert ok(sft + ["--out", str(tmp_path / "s2"), "--resume"])
    s1, s2 = Model.load(tmp_path / "s1"), Model.load(tmp_path / "s2")
    assert all(np.array_equal(s1.params[n], s2.params[n]) for n in s1.params)
    pairs = [{"prompt": f"q{i}=", "chosen": "yes", "rejected": "no"} for i in range(12)]
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    assert ok(["dpo", "--sft", str(tmp_path / "s1"), "--data", str(tmp_path / "pairs.jsonl"), "--val",
               str(tmp_path / "pairs.jsonl"), "--out", str(tmp_path / "d"), "--steps", "2", "--batch-size", "4",
               "--eval-every", "2", "--no-progress"])
    capsys.readouterr()
    assert ok(["sample", "--ckpt", str(tmp_path / "d"), "--prompt", "ROMEO.", "--max-new-tokens", "12",
               "--temperature", "0"])
    assert capsys.readouterr().out.startswith("ROMEO.")
    monkeypatch.setattr(sys, "stdin", io.StringIO("Who speaks?\n"))
    assert ok(["chat", "--ckpt", str(tmp_path / "s1"), "--max-new-tokens", "6", "--seed", "0"])
    assert "> Who speaks?" in capsys.readouterr().out
    assert ok(["info", str(tmp_path / "a"), "--batch", "2"])
    assert "arch" in capsys.readouterr().out
