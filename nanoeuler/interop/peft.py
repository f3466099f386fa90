"""Export an adapter run (LoRA, adapters.py) as a PEFT adapter folder for the base's Hugging Face export.

    nanoeuler export --ckpt runs/base --format hf --out base-hf
    nanoeuler export --ckpt runs/small-lora --format peft --out small-lora-peft
    PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained("base-hf"), "small-lora-peft")

The folder holds adapter_config.json (peft_type LORA, r, lora_alpha, target_modules as PEFT names them)
and adapter_model.safetensors, each module's A [r, in] and B [out, r] under PEFT's names:

    layers.0.attn.wq.lora_A    -> base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight   (Llama)
    layers.0.attn.wqkv.lora_B  -> base_model.model.transformer.h.0.attn.c_attn.lora_B.weight       (GPT-2)

PEFT's A and B have these shapes for GPT-2's Conv1D too (only the base weight is stored transposed), and
c_attn's output rows are q | k | v as our stacked B's, so no tensor is transposed or reordered.

Modules trained whole (`--lora-modules-to-save`) go in as PEFT saves its `modules_to_save`: listed in
adapter_config.json by each module's own Hugging Face name ("lm_head"; "norm" becomes "input_layernorm", "norm",
...: PEFT matches whole dotted names), each tensor under the module's own name (heads.0.weight ->
base_model.model.lm_head.weight). The MTP heads (mtp_heads) stay out: Hugging Face's Llama has none (the base's
hf export keeps them in a file of its own).
"""
from __future__ import annotations

import json
from pathlib import Path

from ..errors import UserError

def peft_names(cfg, lcfg) -> dict[str, str]:
    """Our adapter names -> PEFT's (both A and B of every module), and those of the saved modules' tensors
    that PEFT knows (not mtp_heads): the module's Hugging Face name (hf.hf_names) under PEFT's prefix."""
    from ..adapters import modules, saved_names
    from .hf import hf_names
    hf = hf_names(cfg)
    prefix = "base_model.model." + cfg.spec.hf.prefix
    out = {n: ("base_model.model." if hf[n] == "lm_head.weight" else prefix) + hf[n]
           for n in saved_names(cfg, lcfg) if n in hf}
    for module, (_, hf_module) in modules(cfg, lcfg).items():
        for m in ("lora_A", "lora_B"):
            out[f"{module}.{m}"] = f"{prefix}{hf_module}.{m}.weight"
    return out


def adapter_config(cfg, lcfg, base_path: str) -> dict:
    """adapter_config.json; fan_in_fan_out: the targets' weights are stored [in, out] (GPT-2's Conv1D, the
    `hf` table's transposed entries), as PEFT must know to apply them."""
    from ..adapters import modules, saved_names
    from .hf import hf_names
    targets = sorted({peft.rsplit(".", 1)[1] for _, peft in modules(cfg, lcfg).values()})  # PEFT matches by suffix
    transposed = {e.name: e.transposed for e in cfg.spec.hf.tensors(cfg.n_layers)}
    fan_in_fan_out = {transposed[f"{peft}.weight"] for _, peft in modules(cfg, lcfg).values()}
    if len(fan_in_fan_out) > 1:
        raise UserError("PEFT holds one fan_in_fan_out for all targets; these mix [in, out] and [out, in] weights")
    hf = hf_names(cfg)   # PEFT >= 0.22 matches a saved module by its whole dotted name: list each leaf's own
    saved = sorted({hf[n].rsplit(".", 2)[-2] for n in saved_names(cfg, lcfg) if n in hf})   # input_layernorm, ...
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lcfg.rank, "lora_alpha": lcfg.alpha,
            "lora_dropout": lcfg.dropout, "target_modules": targets, "bias": "none",
            "fan_in_fan_out": fan_in_fan_out == {True},
            "base_model_name_or_path": base_path, "inference_mode": True,
            "init_lora_weights": True, "modules_to_save": saved or None, "use_rslora": False, "use_dora": False}


def peft_rows(cfg, lcfg, name: str, a):
    """An adapter tensor's rows as PEFT's module holds them: a B's rows of each base weight in the format's order
    (hf.format_rows: part of each head turning), interleaved head by head where the module's Hugging Face tensor
    is (External.per_head: GPT-NeoX's query_key_value); an A, or a saved module's tensor, as it is."""
    import numpy as np

    from ..adapters import modules
    from .hf import format_rows, head_interleaved
    module = name.removesuffix(".lora_B")
    if module == name:
        return format_rows(cfg, name, a)
    bases, hf_module = modules(cfg, lcfg)[module]
    shapes = cfg.param_shapes()
    parts = np.split(a, np.cumsum([shapes[b][0] for b in bases])[:-1])
    a = np.concatenate([format_rows(cfg, b, p) for b, p in zip(bases, parts)])
    per_head = {e.name: e.per_head for e in cfg.spec.hf.tensors(cfg.n_layers)}[hf_module + ".weight"]
    return head_interleaved(a, len(bases), cfg.head_dim) if per_head else a


def export_peft(run_dir, out: str | Path, force: bool = False) -> Path:
    """Write the PEFT folder `out` for the adapter run in run_dir (atomically)."""
    from ..adapters import is_adapter_run, load_adapter_run
    from .hf import external_value
    from .outputs import output_dir
    from .safetensors_io import write_tensors
    if not is_adapter_run(run_dir):
        raise UserError(f"--format peft exports an adapter run (sft/dpo/train --lora); {run_dir} has no lora.json")
    lcfg, base, adapters, cfg, _ = load_adapter_run(run_dir, read_only=True)   # refused if the base changed
    names = peft_names(cfg, lcfg)
    with output_dir(out, force, inputs=[run_dir]) as tmp:
        offset = cfg.spec.hf.norm_offset   # a saved norm is stored as Hugging Face stores it (Gemma: w - 1)
        write_tensors(tmp / "adapter_model.safetensors", {names[n]: external_value(offset, n, peft_rows(cfg, lcfg, n, a))
                                                          for n, a in adapters.items() if n in names}, "F32",
                      {"format": "pt"})
        (tmp / "adapter_config.json").write_text(json.dumps(adapter_config(cfg, lcfg, base["path"]), indent=2) + "\n")
    return Path(out)
