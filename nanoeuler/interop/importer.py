"""Import a Hugging Face model folder as a nanoeuler checkpoint (then `sample`, `chat`, `sft`, `dpo`,
`eval` use it unchanged).

    nanoeuler import --from SmolLM-135M --out runs/smol --mtp 2

The folder's config.json names the architecture (`model_type`, else an entry of `architectures` through
ARCH_ALIASES); each supported architecture is one function
`fn(folder, hf_config, n_mtp, progress=False) -> (Config, params, Tokenizer)` registered in ARCHITECTURES
as "module:function" (imported lazily; a new architecture adds one line there and, if its config names
it differently, one in ARCH_ALIASES). The helpers every architecture shares are in hf_folder.py;
`read_tokenizer` here reads the folder's tokenizer.json (byte-level BPE, or SentencePiece-style BPE with byte
fallback) into our tokenizer, keeping the folder's ids.

Anything that would make the imported model compute something else (rope_scaling, biases, sliding
window, head_dim != hidden/heads, another activation, a tokenizer.model without its tokenizer.json) is refused
by name.
"""
from __future__ import annotations

import importlib
from pathlib import Path

import numpy as np

from ..errors import UserError
from .hf_folder import eos_id_of, mtp_heads, read_hf_config, read_json_file, read_weights

# model_type -> "module:function" (relative to this package); e.g. "gpt2": ".gpt2:import_gpt2"
ARCHITECTURES = {
    "llama": ".importer:import_llama",
    "gpt2": ".gpt2:import_gpt2",
}
ARCH_ALIASES = {"LlamaForCausalLM": "llama", "GPT2LMHeadModel": "gpt2"}


# ------------------------------------------------------------------------------ shared helpers

def architecture_of(c: dict) -> str:
    """config.json -> our architecture key ('llama', ...), or a UserError naming what it found.

    An allow-list: model_type, when given, must be one of ARCHITECTURES (a "mistral" or "qwen2" folder
    whose `architectures` says LlamaForCausalLM is refused by name), and every entry of `architectures`
    must name that same architecture."""
    mt, archs = c.get("model_type"), c.get("architectures")
    if mt is not None and not isinstance(mt, str):
        raise UserError(f"config.json: model_type must be a name, got {mt!r:.60}")
    if archs is not None and not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
        raise UserError("config.json: architectures must be a list of names")
    found = {ARCH_ALIASES.get(a, a) for a in archs or []}
    key = mt if mt is not None else next(iter(found), None) if len(found) == 1 else None
    if key not in ARCHITECTURES or (found and found != {key}):
        raise UserError(f"config.json: model_type {mt!r} (architectures {archs}) is not supported; "
                        f"importable: {', '.join(ARCHITECTURES)} ({', '.join(ARCH_ALIASES)})")
    return key


def read_tokenizer(folder: Path, vocab_size: int, eos_id):
    """Our Tokenizer (the folder's token ids kept exactly) from the folder's tokenizer.json."""
    from .hf_tokenizer import from_hf_json
    path = folder / "tokenizer.json"
    if not path.is_file():
        if (folder / "tokenizer.model").is_file():
            raise UserError(f"{folder} has a SentencePiece model file (tokenizer.model) but no tokenizer.json, "
                            "which import reads (transformers writes it: AutoTokenizer.from_pretrained(folder)"
                            ".save_pretrained(folder))")
        raise UserError(f"{folder} has no tokenizer.json")
    return from_hf_json(read_json_file(path, "tokenizer"), vocab_size, eos_id)


def with_chat_extras(folder: Path, c: dict, tok):
    """tok with the folder's chat template (chat_template.jinja, else tokenizer_config.json's chat_template)
    and, as stops, every other eos id config.json / generation_config.json name (Llama-3's <|eot_id|>)."""
    template = None
    if (folder / "chat_template.jinja").is_file():
        try:
            template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise UserError(f"{folder / 'chat_template.jinja'} is not UTF-8 ({e})") from None
    elif (folder / "tokenizer_config.json").is_file():
        t = read_json_file(folder / "tokenizer_config.json", "tokenizer config")
        template = t.get("chat_template") if isinstance(t, dict) else None
        if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
            template = next((x.get("template") for x in template
                             if isinstance(x, dict) and x.get("name") == "default"), None)
        if template is not None and not isinstance(template, str):
            raise UserError(f"{folder / 'tokenizer_config.json'}: chat_template is not a string")
    ends = []
    gen = folder / "generation_config.json"
    for d in (c, read_json_file(gen, "generation config") if gen.is_file() else {}):
        e = d.get("eos_token_id") if isinstance(d, dict) else None
        ends += e if isinstance(e, list) else [e]
    names = {i: s for s, i in tok.special_tokens.items()}
    stops = [names[i] for i in dict.fromkeys(ends) if isinstance(i, int) and i in names and names[i] != tok.eos_token]
    return tok.replace(chat_template=template, stops=stops)


def require(c: dict, field: str, default=None):
    """c[field], or default when it is absent or null (a 0 stays 0, and Config refuses it by name)."""
    v = c.get(field)
    v = default if v is None else v
    if v is None:
        raise UserError(f"config.json: {field} is missing")
    return v


# ------------------------------------------------------------------------------ architectures

def llama_config(c: dict, n_mtp: int):
    """A Llama config.json -> our Config, refusing every field that would change the model."""
    from ..config import Config
    if c.get("rope_scaling") is not None:
        raise UserError("config.json: rope_scaling is not supported (plain RoPE only)")
    rp = c.get("rope_parameters")
    if isinstance(rp, dict) and rp.get("rope_type", "default") != "default":
        raise UserError(f"config.json: rope_parameters.rope_type={rp.get('rope_type')} is not supported")
    for field in ("attention_bias", "mlp_bias"):
        if c.get(field):
            raise UserError(f"config.json: {field}=true is not supported (our model has no biases)")
    for field in ("sliding_window", "quantization_config"):
        if c.get(field) is not None:
            raise UserError(f"config.json: {field} is not supported")
    if c.get("hidden_act", "silu") != "silu":
        raise UserError(f"config.json: hidden_act={c.get('hidden_act')} is not supported (SwiGLU with silu only)")
    dim, heads = require(c, "hidden_size"), require(c, "num_attention_heads")
    if not isinstance(dim, int) or not isinstance(heads, int) or heads < 1 or dim % heads:
        raise UserError(f"config.json: hidden_size {dim} is not divisible by num_attention_heads {heads}")
    if c.get("head_dim") is not None and c["head_dim"] != dim // heads:
        raise UserError(f"config.json: head_dim={c['head_dim']} differs from hidden_size/num_attention_heads "
                        f"({dim // heads}); not supported")
    theta = c.get("rope_theta")
    if theta is None and isinstance(rp, dict):
        theta = rp.get("rope_theta")
    try:
        return Config(vocab_size=require(c, "vocab_size"), dim=dim, n_heads=heads,
                      n_kv_heads=require(c, "num_key_value_heads", heads), n_layers=require(c, "num_hidden_layers"),
                      ctx_len=require(c, "max_position_embeddings", 2048), ffn_hidden=require(c, "intermediate_size"),
                      n_mtp=n_mtp, rope_theta=float(theta if theta is not None else 10000.0),
                      norm_eps=float(require(c, "rms_norm_eps", 1e-6)))
    except (TypeError, ValueError, OverflowError) as e:
        raise UserError(f"config.json: {e}") from None
    except UserError as e:
        raise UserError(f"config.json: {e}") from None


def import_llama(folder: Path, c: dict, n_mtp: int | None, progress: bool = False):
    """A LlamaForCausalLM folder -> (Config, params, Tokenizer); rows stay in the folder's id order.
    tie_word_embeddings: head 0 is the embedding (tie_embeddings), one matrix as in transformers."""
    from ..config import head_weight
    from .hf import hf_names
    cfg = llama_config(c, 1)  # the number of MTP heads is settled by mtp_heads below
    tied = c.get("tie_word_embeddings", False)
    if not isinstance(tied, bool):            # a string "false" would tie
        raise UserError(f"config.json: tie_word_embeddings must be true or false, got {tied!r:.60}")
    W = read_weights(folder, progress)
    names = hf_names(cfg.n_layers)
    if tied:  # transformers ties lm_head to the embedding; a stored lm_head is ignored as it does
        del names["heads.0.weight"]
        W.pop("lm_head.weight", None)
        cfg = cfg.replace(tie_embeddings=True)  # one matrix for the embedding and head 0
    shapes = cfg.param_shapes()
    for ours, theirs in names.items():
        if theirs not in W:
            raise UserError(f"tensor {theirs} is missing from the weights")
        if tuple(W[theirs].shape) != shapes[ours]:
            raise UserError(f"tensor {theirs} has shape {list(W[theirs].shape)}, expected {list(shapes[ours])}")
    known = set(names.values())
    extra = sorted(n for n in W if n not in known and not n.endswith("rotary_emb.inv_freq"))
    if extra:
        what = " (biases are not supported)" if extra[0].endswith(".bias") else ""
        raise UserError(f"unexpected tensor {extra[0]}{what}")
    tok = read_tokenizer(folder, cfg.vocab_size, eos_id_of(folder, c))
    params = {ours: W[theirs] for ours, theirs in names.items()}
    params.update(mtp_heads(folder, n_mtp, head_weight(params, 0)))
    cfg = cfg.replace(n_mtp=1 + sum(1 for n in params if n.startswith("heads.") and n != "heads.0.weight"))
    return cfg, {n: np.ascontiguousarray(params[n]) for n in cfg.param_shapes()}, tok


def load_hf_folder(src: str | Path, n_mtp: int | None = None, progress: bool = False):
    """Any supported Hugging Face folder -> (Config, params, Tokenizer), without writing anything."""
    from ..model import check_params
    folder = Path(src)
    if not folder.is_dir():
        raise UserError(f"{folder} is not a folder")
    if n_mtp is not None and (not isinstance(n_mtp, int) or n_mtp < 1):
        raise UserError(f"--mtp must be a positive integer, got {n_mtp}")
    c = read_hf_config(folder)
    module, fn = ARCHITECTURES[architecture_of(c)].split(":")
    importer = getattr(importlib.import_module(module, __package__), fn)
    cfg, params, tok = importer(folder, c, n_mtp, progress=progress)
    check_params(cfg, params)
    return cfg, params, with_chat_extras(folder, c, tok)


def import_folder(src: str | Path, out: str | Path, n_mtp: int | None = None, force: bool = False,
                  progress: bool = True):
    """Import src into the checkpoint directory out (atomically; refuses an existing out unless force, and
    an out that is, holds or lies inside src)."""
    from ..checkpoint import save_model
    from .outputs import check_free, output_dir
    check_free(out, force, inputs=[src])
    cfg, params, tok = load_hf_folder(src, n_mtp, progress)
    with output_dir(out, force) as tmp:
        save_model(tmp, cfg, params, tok)
    return cfg, params, tok
