"""Export a checkpoint as a Hugging Face `transformers` Llama folder (no code of ours needed to load it).

    nanoeuler export --ckpt runs/demo --format hf --out demo-hf
    AutoModelForCausalLM.from_pretrained("demo-hf"); AutoTokenizer.from_pretrained("demo-hf")

The folder: config.json (LlamaForCausalLM), model.safetensors (Llama names, head 0 = lm_head, left out when
it equals the embedding: tie_word_embeddings), tokenizer.json, tokenizer_config.json (the Alpaca chat
template), generation_config.json, and nanoeuler_mtp.safetensors with MTP heads 1..K-1 (K > 1 only).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..errors import UserError
from .gpt2 import export_gpt2_folder
from .hf_folder import HF_DTYPES, MTP_FILE


def hf_names(n_layers: int) -> dict[str, str]:
    """Our SPEC name -> Hugging Face Llama name (heads.0 -> lm_head.weight).
    hf_names(1)["layers.0.attn.wq.weight"] -> 'model.layers.0.self_attn.q_proj.weight'"""
    names = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
             "heads.0.weight": "lm_head.weight"}
    for i in range(n_layers):
        o, h = f"layers.{i}.", f"model.layers.{i}."
        names[o + "attn_norm.weight"] = h + "input_layernorm.weight"
        names[o + "ffn_norm.weight"] = h + "post_attention_layernorm.weight"
        for a, b in (("wq", "q"), ("wk", "k"), ("wv", "v"), ("wo", "o")):
            names[o + f"attn.{a}.weight"] = h + f"self_attn.{b}_proj.weight"
        for a in ("gate", "up", "down"):
            names[o + f"ffn.{a}.weight"] = h + f"mlp.{a}_proj.weight"
    return names


def require_llama(cfg) -> None:
    """Only our own (Llama) block exports as Llama; another arch would load as a different model."""
    arch = cfg.arch
    if arch != "euler":
        raise UserError(f"config: arch {arch!r} cannot be exported as a Llama model")


def hf_config(cfg, tok, tied: bool, dtype: str = "float32") -> dict:
    """config.json of the Llama model equal to ours (every field that changes the function)."""
    eos = tok.eos_id if tok.eos_token in tok.special_tokens else None
    bos = tok.bos_id if tok.bos_id is not None else eos
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.dim, "intermediate_size": cfg.ffn_hidden,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.ctx_len, "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
        "rope_scaling": None, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
        "attention_dropout": 0.0, "pretraining_tp": 1, "initializer_range": 0.02, "use_cache": True,
        "tie_word_embeddings": tied, "bos_token_id": bos, "eos_token_id": eos, "pad_token_id": None,
        "torch_dtype": dtype, "nanoeuler_n_mtp": cfg.n_mtp,
    }


def tokenizer_config(tok, ctx_len: int) -> dict:
    from ..chat_template import template_of
    eos = tok.eos_token if tok.eos_token in tok.special_tokens else None
    return {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": ctx_len,
            "eos_token": eos, "bos_token": tok.bos_token, "pad_token": None, "unk_token": None,
            "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False,
            "chat_template": template_of(tok)}


def export_hf(model, tok, out: str | Path, dtype: str = "float32", force: bool = False, progress: bool = True) -> Path:
    """Write the Hugging Face folder `out` (atomically: a temporary folder renamed at the end)."""
    from .outputs import check_free, output_dir
    from .safetensors_io import write_tensors

    if model.config.arch == "gpt2":  # a GPT2LMHeadModel folder instead (interop/gpt2.py)
        return export_gpt2_folder(model, tok, out, dtype, force, progress)
    if dtype not in HF_DTYPES:
        raise UserError(f"--dtype {dtype} is not one of {', '.join(HF_DTYPES)} for --format hf")
    check_free(out, force)
    cfg, P = model.config, model.params
    require_llama(cfg)
    if tok.vocab_size > cfg.vocab_size:
        raise UserError(f"the tokenizer has {tok.vocab_size} tokens but the model {cfg.vocab_size} embeddings")
    names = hf_names(cfg.n_layers)
    tied = "heads.0.weight" not in P or bool(np.array_equal(P["embed.weight"], P["heads.0.weight"]))
    tensors = {names[n]: P[n] for n in P if n in names and not (tied and n == "heads.0.weight")}
    with output_dir(out, force) as tmp:
        write_tensors(tmp / "model.safetensors", tensors, HF_DTYPES[dtype], {"format": "pt"})
        if cfg.n_mtp > 1:  # MTP heads 1..K-1 stay float32: only `nanoeuler import` reads them
            write_tensors(tmp / MTP_FILE, {f"heads.{k}.weight": P[f"heads.{k}.weight"] for k in range(1, cfg.n_mtp)},
                          "F32", {"format": "nanoeuler-mtp", "n_mtp": str(cfg.n_mtp)})
        config = hf_config(cfg, tok, tied, dtype)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (tmp / "tokenizer.json").write_text(tok.to_hf_json(), encoding="utf-8")
        (tmp / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(tok, cfg.ctx_len), indent=2) + "\n")
        ends = tok.stop_ids
        gen = {"bos_token_id": config["bos_token_id"], "do_sample": False,
               "eos_token_id": ends if len(ends) > 1 else config["eos_token_id"],
               "max_length": cfg.ctx_len}
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    return Path(out)
