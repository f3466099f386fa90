"""`export --format gguf-lora`: an adapter run as a llama.cpp LoRA adapter. Its metadata and tensors as
llama.cpp's convert_lora_to_gguf.py writes them, and llama.cpp (llama-cpp-python, skipped when absent)
applying it on our GGUF export of the base giving our merged model's logits."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import rel_err
from nanoeuler import Model, Tokenizer
from nanoeuler import adapters as ad
from nanoeuler.arch import ARCHS
from nanoeuler.cli import main
from nanoeuler.data.corpus import bundled_works
from nanoeuler.training.lora import LoraModel

gguf = pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A base (GGUF-exportable tokenizer), an adapter run on it with B ≠ 0, and both exported."""
    from nanoeuler.checkpoint import save_files
    from nanoeuler.config import Config
    d = tmp_path_factory.mktemp("gguf_lora")
    tok = Tokenizer.train([bundled_works()["hamlet"][:40000]], 300, progress=False)
    cfg = Config(vocab_size=300, dim=64, n_heads=4, n_kv_heads=2, n_layers=2, ctx_len=32, ffn_hidden=96, n_mtp=1)
    base = Model.init(cfg, seed=0)
    rng = np.random.default_rng(1)
    for p in base.params.values():
        p += (rng.standard_normal(p.shape) * 0.05).astype(np.float32)
    base.save(d / "base", tokenizer=tok)
    m = LoraModel.new(d / "base", ad.LoraConfig(4, 12.0, ("q", "k", "v", "o", "gate", "up", "down")), seed=0)
    for n, a in m.params.items():
        if n.endswith("lora_B"):
            a += (rng.standard_normal(a.shape) * 0.1).astype(np.float32)
    save_files(d / "run", m.checkpoint_writers(tok))
    assert main(["export", "--ckpt", str(d / "base"), "--format", "gguf", "--out", str(d / "base.gguf"),
                 "--no-progress"]) == 0
    assert main(["export", "--ckpt", str(d / "run"), "--format", "gguf-lora", "--out", str(d / "lora.gguf")]) == 0
    return d, m


def test_gguf_lora_metadata_and_tensors_are_llama_cpps(run):
    d, m = run
    r = gguf.GGUFReader(str(d / "lora.gguf"))
    field = lambda k: r.fields[k].contents()   # noqa: E731
    assert (field("general.architecture"), field("general.type"), field("adapter.type")) == ("llama", "adapter", "lora")
    assert field("adapter.lora.alpha") == 12.0
    t = {x.name: np.array(x.data) for x in r.tensors}
    assert len(t) == 2 * 7 * m.config.n_layers
    base = {x.name: np.array(x.data) for x in gguf.GGUFReader(str(d / "base.gguf")).tensors}
    merged = Model.load(d / "run", read_only=True)    # W + s·B·A, rounded once
    from nanoeuler.interop.gguf_export import gguf_tensors
    want = gguf_tensors(merged)
    s = m.lcfg.scale
    for name in ("blk.1.attn_q.weight", "blk.0.attn_k.weight", "blk.0.ffn_down.weight"):
        a, b = t[name + ".lora_a"], t[name + ".lora_b"]                # [r, in], [out, r]
        assert a.shape == (4, base[name].shape[1]) and b.shape == (base[name].shape[0], 4)
        # llama.cpp's W + s·B·A on its (permuted) base rows is our merged weight, permuted alike
        assert rel_err(base[name] + s * b @ a, want[name]) < 1e-5, name     # float32 sums (a wrong row order: ~1)


def test_gguf_lora_refuses_what_is_not_an_adapter_run(run, capsys, tmp_path):
    d, _ = run
    assert main(["export", "--ckpt", str(d / "base"), "--format", "gguf-lora", "--out", str(tmp_path / "x.gguf")]) != 0
    assert "lora.json" in capsys.readouterr().err and not (tmp_path / "x.gguf").exists()


@pytest.mark.parametrize("fmt, extra, needle", [
    ("gguf-lora", ["--dtype", "q8_0"], "--dtype is not for --format gguf-lora"),
    ("peft", ["--dtype", "float16"], "--dtype is not for --format peft"),
    ("gguf-lora", [], "inside the base of the input"),   # the base the adapters were trained on
    ("gguf", [], "inside the base of the input"),        # the merged export reads the base too
])
def test_adapter_exports_refuse_a_dtype_and_writing_into_the_base(run, capsys, tmp_path, fmt, extra, needle):
    d, _ = run
    out = tmp_path / "x.gguf" if extra else d / "base" / "x.gguf"
    before = sorted(p.name for p in (d / "base").iterdir())
    assert main(["export", "--ckpt", str(d / "run"), "--format", fmt, "--out", str(out), *extra]) != 0
    assert needle in capsys.readouterr().err and not out.exists()
    assert sorted(p.name for p in (d / "base").iterdir()) == before


def test_llama_cpp_applies_it_and_gives_our_merged_logits(run):
    pytest.importorskip("llama_cpp")
    from nanoeuler.interop.llamacpp import LlamaCpp
    d, m = run
    ids = list(np.random.default_rng(3).integers(0, 300, 32))
    T = m.config.ctx_len
    theirs = LlamaCpp(d / "base.gguf", n_ctx=T, logits_all=True, lora=d / "lora.gguf").logits(ids)
    ours = Model.load(d / "run", read_only=True).logits(np.array([ids]))[0, 0]
    plain = LlamaCpp(d / "base.gguf", n_ctx=T, logits_all=True).logits(ids)
    assert rel_err(theirs, ours) <= 1e-4
    assert rel_err(plain, ours) > 1e-2          # the adapter matters: not the base's logits


@pytest.mark.parametrize("arch", list(ARCHS))
def test_every_architectures_adapter_is_its_merged_model_in_llama_cpp(arch, tmp_path):
    """Each architecture of the registry: an adapter on every target of its LoRA defaults, exported as gguf-lora,
    has one A / B pair per llama.cpp tensor it changes, whole where llama.cpp fuses our weights (GPT-2's and
    GPT-NeoX's attn_qkv, Phi-3's attn_qkv and ffn_up holding gate | up: B's rows stacked as the tensor's, one A);
    llama.cpp applying it to our GGUF export of the base gives our merged model's logits."""
    from test_archs_cli import ARCHS as SHAPES

    from nanoeuler.checkpoint import save_files
    from nanoeuler.config import Config
    tok = Tokenizer.train([bundled_works()["hamlet"][:20000]], 300, progress=False)
    cfg = Config(**dict(vocab_size=300, dim=32, n_heads=4, n_kv_heads=2, n_layers=2, ctx_len=32, ffn_hidden=64,
                        n_mtp=1, arch=arch) | SHAPES.get(arch, {}))
    base = Model.init(cfg, seed=0)
    rng = np.random.default_rng(1)
    for p in base.params.values():
        p += (rng.standard_normal(p.shape) * 0.05).astype(np.float32)
    base.save(tmp_path / "base", tokenizer=tok)
    m = LoraModel.new(tmp_path / "base", ad.LoraConfig(4, 12.0, cfg.spec.lora_defaults), seed=0)
    for n, a in m.params.items():
        if n.endswith("lora_B"):
            a += (rng.standard_normal(a.shape) * 0.1).astype(np.float32)
    save_files(tmp_path / "run", m.checkpoint_writers(tok))
    for ckpt, fmt in (("base", "gguf"), ("run", "gguf-lora")):
        out = str(tmp_path / f"{ckpt}.gguf")
        assert main(["export", "--ckpt", str(tmp_path / ckpt), "--format", fmt, "--out", out, "--no-progress"]) == 0
    names = [x.name for x in gguf.GGUFReader(str(tmp_path / "run.gguf")).tensors]
    assert len(names) == len(set(names))                      # one pair per tensor, none written twice
    pytest.importorskip("llama_cpp")
    from nanoeuler.interop.llamacpp import LlamaCpp
    ids = list(np.random.default_rng(3).integers(0, 300, cfg.ctx_len))
    lc = LlamaCpp(tmp_path / "base.gguf", n_ctx=cfg.ctx_len, logits_all=True, lora=tmp_path / "run.gguf")
    theirs = lc.logits(ids)
    ours = Model.load(tmp_path / "run", read_only=True).logits(np.array([ids]))[0, 0]
    plain = Model.load(tmp_path / "base", read_only=True).logits(np.array([ids]))[0, 0]
    l2 = lambda a, b: np.linalg.norm(a - b) / np.linalg.norm(b)   # noqa: E731  (llama.cpp's GELU: float16 tables)
    assert l2(theirs, ours) <= 1e-3 and l2(plain, ours) > 1e-2
