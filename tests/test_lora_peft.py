"""LoRA against PyTorch + PEFT (test-only oracle): the same LoRA config on the same base gives the same loss
and adapter gradients, 10 AdamW steps the same adapters, and `export --format peft` loads with
PeftModel.from_pretrained on our HF export and gives our merged model's logits."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from conftest import rel_err, tiny_config  # noqa: E402
from nanoeuler import adapters as ad  # noqa: E402
from nanoeuler.interop.peft import adapter_config, peft_names  # noqa: E402
from nanoeuler.training.lora import LoraModel  # noqa: E402
from nanoeuler.model import Model  # noqa: E402
from nanoeuler.optim import AdamW  # noqa: E402
from nanoeuler.tokenizer import Tokenizer  # noqa: E402

TARGETS = {"euler": ("q", "k", "v", "o", "gate", "up", "down"), "gpt2": ("c_attn", "c_proj", "c_fc")}
TARGETS["gemma3"] = TARGETS["euler"]


def setup(arch, tmp_path, save=()):
    """Our LoraModel (adapters with B ≠ 0; `save`: modules trained whole, their copies moved off the base) on a
    saved base, and PEFT's model on that base's HF export with the same values copied in."""
    from nanoeuler.interop.hf import export_hf, external_value
    cfg = tiny_config(vocab_size=257, dim=32, n_layers=2, ctx_len=16, ffn_hidden=40, n_mtp=1, arch=arch,
                      n_kv_heads=4 if arch == "gpt2" else 2)          # HF GPT-2 has no GQA
    base = Model.init(cfg, seed=0)
    rng = np.random.default_rng(1)
    for p in base.params.values():   # not the init's zero biases and unit norms: every path carries a gradient
        p += (rng.standard_normal(p.shape) * 0.05).astype(np.float32)
    tok = Tokenizer([])
    base.save(tmp_path / "base", tokenizer=tok)
    lcfg = ad.LoraConfig(4, 8.0, TARGETS[arch], modules_to_save=save)
    m = LoraModel.new(tmp_path / "base", lcfg, seed=0)
    for n, a in m.params.items():
        if not n.endswith("lora_A"):
            a += (rng.standard_normal(a.shape) * 0.05).astype(np.float32)
    export_hf(m.base, tok, tmp_path / "hf", progress=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", torch_dtype=torch.float32)
    pcfg = peft.LoraConfig(r=4, lora_alpha=8.0, lora_dropout=0.0, task_type="CAUSAL_LM",
                           target_modules=sorted({p.rsplit(".", 1)[1] for _, p in m.modules.values()}),
                           modules_to_save=adapter_config(cfg, m.lcfg, "")["modules_to_save"])  # as export writes
    pm = peft.get_peft_model(hf, pcfg)
    theirs = dict(pm.named_parameters())
    names = peft_names(cfg, m.lcfg)
    trained = [n for n, p in theirs.items() if p.requires_grad]
    assert sorted(trained) == sorted(live(t) for t in names.values())
    with torch.no_grad():   # in Hugging Face's convention (Gemma's norms: w - 1)
        for ours, t in names.items():
            theirs[live(t)].copy_(torch.from_numpy(external_value(cfg.spec.hf.norm_offset, ours, m.params[ours])))
    return m, pm, names


def live(t: str) -> str:
    """A saved PEFT key -> the parameter's name in the live PeftModel (adapter "default")."""
    return t.replace(".weight", ".default.weight" if ".lora_" in t else ".modules_to_save.default.weight")


def peft_loss(pm, tokens):
    logits = pm(input_ids=torch.from_numpy(tokens[:, :-1])).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             torch.from_numpy(tokens[:, 1:]).reshape(-1))


def close(ours, theirs) -> bool:
    """float32 agreement: 1e-5 of the tensor's largest entry (the issue's figure), and 1e-3 entry by entry
    above 1 % of it (conftest.rel_err: float32 sums in another order move small entries most)."""
    return rel_err(ours, theirs, floor=1.0) <= 1e-5 and rel_err(ours, theirs) <= 1e-3


CASES = [("euler", ()), ("gpt2", ()), ("euler", ("lm_head", "norm"))]
# Gemma's norms multiply by 1 + w and Hugging Face stores w - 1: saved norms are exported so
EXPORTS = CASES + [("gemma3", ("norm",))]


@pytest.mark.parametrize("arch,save", CASES)
def test_same_loss_gradients_and_ten_adamw_steps_as_peft(arch, save, tmp_path):
    """The adapters, and with `save` the head and every norm trained whole (PEFT's modules_to_save)."""
    m, pm, names = setup(arch, tmp_path, save)
    theirs = dict(pm.named_parameters())
    rng = np.random.default_rng(2)
    batches = [rng.integers(0, 257, (3, 17)) for _ in range(10)]
    _, loss, grads = m.loss_and_grads(batches[0])
    tl = peft_loss(pm, batches[0])
    tl.backward()
    assert abs(loss - tl.item()) <= 1e-5 * abs(loss)
    for ours, t in names.items():
        g = theirs[live(t)].grad.numpy()
        assert close(grads[ours], g), ours
    # 10 AdamW steps on different batches: the same adapters (ours decays matrices only: so the norms there)
    opt = AdamW(m.params, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    trained = [p for p in pm.parameters() if p.requires_grad]
    topt = torch.optim.AdamW([{"params": [p for p in trained if p.ndim >= 2]},
                              {"params": [p for p in trained if p.ndim < 2], "weight_decay": 0.0}],
                             lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for tokens in batches:
        _, _, grads = m.loss_and_grads(tokens)
        opt.step(m.params, grads)
        topt.zero_grad()
        peft_loss(pm, tokens).backward()
        topt.step()
    for ours, t in names.items():
        assert close(m.params[ours], theirs[live(t)].detach().numpy()), ours
    assert any(not np.array_equal(m.params[n], 0) for n in m.params if n.endswith("lora_B"))


@pytest.mark.parametrize("arch,save", EXPORTS)
def test_export_peft_loads_with_peft_and_gives_our_merged_logits(arch, save, tmp_path):
    from nanoeuler.cli import main
    from nanoeuler.training.train import TrainConfig, run_training
    m, _, _ = setup(arch, tmp_path, save)

    class Source:   # two fixed batches: enough to save an adapter run through the training loop
        bytes_per_token = None

        def next_batch(self, rng):
            return rng.integers(0, 257, (2, 17)), None

        def eval_batches(self):
            yield np.arange(34).reshape(2, 17) % 257, None

        def describe(self):
            return {}

    run_training(m, Tokenizer([]), Source(), tmp_path / "run", TrainConfig(steps=2, batch_size=2, warmup=0, lr=0.05),
                 progress=False)
    assert main(["export", "--ckpt", str(tmp_path / "run"), "--format", "peft", "--out", str(tmp_path / "peft")]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", torch_dtype=torch.float32)
    conv1d = any(isinstance(mod, transformers.pytorch_utils.Conv1D) for mod in hf.modules())   # GPT-2's [in, out]
    assert peft.LoraConfig.from_pretrained(tmp_path / "peft").fan_in_fan_out == conv1d  # as PEFT needs it for them
    pm = peft.PeftModel.from_pretrained(hf, tmp_path / "peft")
    ids = np.random.default_rng(3).integers(0, 257, (1, 16))
    with torch.no_grad():
        theirs = pm(input_ids=torch.from_numpy(ids)).logits.numpy()
    merged = Model.load(tmp_path / "run", read_only=True)
    ours = merged.logits(ids)[0]
    base = m.base.logits(ids)[0]
    assert close(ours, theirs)
    assert rel_err(base, theirs) > 1e-3      # the adapters matter: not the base's logits
