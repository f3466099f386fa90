"""GPT-2 folders (Hugging Face `GPT2LMHeadModel`) <-> nanoeuler checkpoints of arch "gpt2" (the llm.c path).

    nanoeuler import --from gpt2 --out runs/gpt2          # e.g. after `huggingface-cli download gpt2 --local-dir gpt2`
    nanoeuler export --ckpt runs/gpt2 --format hf --out gpt2-again

A GPT-2 folder: config.json (`model_type: gpt2`), model.safetensors, and the tokenizer as vocab.json +
merges.txt and/or tokenizer.json. Tensor names may carry the `transformer.` prefix (save_pretrained) or not
(OpenAI's upload on the Hub); the causal-mask buffers `h.i.attn.bias` / `attn.masked_bias` are skipped.

Weights: GPT-2's linears are `Conv1D`, stored [in, out] with y = x @ W + b; ours are [out, in] (y = x @ W.T + b),
so every matrix is transposed, and the fused c_attn [d, 3d] is cut into wq | wk | wv:

    h.i.ln_1.{weight,bias}        -> layers.i.attn_norm.{weight,bias}
    h.i.attn.c_attn.weight [d,3d] -> layers.i.attn.wq.weight = W[:, 0:d].T,  wk = W[:, d:2d].T,  wv = W[:, 2d:3d].T
    h.i.attn.c_attn.bias   [3d]   -> layers.i.attn.{wq,wk,wv}.bias (the three thirds)
    h.i.attn.c_proj.{weight,bias} -> layers.i.attn.wo.{weight (transposed),bias}
    h.i.ln_2.{weight,bias}        -> layers.i.ffn_norm.{weight,bias}
    h.i.mlp.c_fc.{weight,bias}    -> layers.i.ffn.fc   (weight [d, F] -> [F, d])
    h.i.mlp.c_proj.{weight,bias}  -> layers.i.ffn.proj (weight [F, d] -> [d, F])
    ln_f.{weight,bias} -> norm.{weight,bias};  wte.weight -> embed.weight;  wpe.weight -> pos_embed.weight
    lm_head.weight: tied to wte (our head 0 is embed.weight)

Token ids are GPT-2's, exactly: GPT-2 numbers the bytes in the order of its byte-to-unicode table
('!' = 0, ..., 'Ġ' = byte 32 = 220; `gpt2_byte_order`), then its 50,000 merges as 256 + i, then
`<|endoftext|>` = 50256. The imported Tokenizer carries that numbering (`tok.ids`, see
tokenizer/tokenizer.py), so its encode gives the ids GPT2Tokenizer gives, and wte's rows are kept in
order. Export writes the tokenizer's ids back, so import -> export of OpenAI's folder is the same folder
(vocab.json, merges.txt, tensors); a GPT-2-architecture model trained here exports with our numbering.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..errors import UserError
from .hf_folder import HF_DTYPES, MTP_FILE, eos_id_of, mtp_heads, read_hf_config, read_json_file, read_weights

GELU_TANH = ("gelu_new", "gelu_pytorch_tanh")  # transformers' names of 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))
MASK_BUFFERS = (".attn.bias", ".attn.masked_bias")  # causal-mask buffers of old saves, not parameters


def gpt2_byte_order() -> list[int]:
    """GPT-2's id order of the 256 bytes: the printable bytes of its byte-to-unicode table first, then the rest.
    gpt2_byte_order()[0] -> 33 ('!'), gpt2_byte_order().index(32) -> 220 (' ', shown as 'Ġ')"""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    return printable + [b for b in range(256) if b not in printable]


def hf_names(n_layers: int) -> dict[str, tuple[str, str]]:
    """Our name -> (GPT-2 tensor name without the `transformer.` prefix, how to convert it).
    how: "copy", "T" (transpose a Conv1D weight), "q"/"k"/"v" (that third of c_attn; weights transposed)."""
    names = {"embed.weight": ("wte.weight", "copy"), "pos_embed.weight": ("wpe.weight", "copy"),
             "norm.weight": ("ln_f.weight", "copy"), "norm.bias": ("ln_f.bias", "copy")}
    for i in range(n_layers):
        o, h = f"layers.{i}.", f"h.{i}."
        for ours, theirs in (("attn_norm", "ln_1"), ("ffn_norm", "ln_2")):
            for s in ("weight", "bias"):
                names[f"{o}{ours}.{s}"] = (f"{h}{theirs}.{s}", "copy")
        for part in ("q", "k", "v"):
            for s in ("weight", "bias"):
                names[f"{o}attn.w{part}.{s}"] = (f"{h}attn.c_attn.{s}", part)
        for ours, theirs in (("attn.wo", "attn.c_proj"), ("ffn.fc", "mlp.c_fc"), ("ffn.proj", "mlp.c_proj")):
            names[f"{o}{ours}.weight"] = (f"{h}{theirs}.weight", "T")
            names[f"{o}{ours}.bias"] = (f"{h}{theirs}.bias", "copy")
    return names


# ------------------------------------------------------------------------------------------------ import

def gpt2_config(c: dict, vocab_rows: int, n_mtp: int = 1):
    """A GPT-2 config.json -> our Config (arch gpt2), refusing every field that would change the function."""
    from ..config import Config

    def field(*names, default=None):
        for n in names:
            if c.get(n) is not None:
                return c[n]
        if default is None:
            raise UserError(f"config.json: {names[0]} is missing")
        return default

    act = c.get("activation_function", "gelu_new")
    if act not in GELU_TANH:
        raise UserError(f"config.json: activation_function={act} is not supported (GELU, tanh approximation: "
                        f"{' or '.join(GELU_TANH)})")
    for name, want in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                       ("reorder_and_upcast_attn", False), ("add_cross_attention", False)):
        if name in c and bool(c[name]) != want:
            raise UserError(f"config.json: {name}={str(c[name]).lower()} is not supported")
    d, heads = field("n_embd", "hidden_size"), field("n_head", "num_attention_heads")
    vocab = field("vocab_size")
    if vocab != vocab_rows:
        raise UserError(f"config.json: vocab_size {vocab} but wte has {vocab_rows} rows")
    try:
        return Config(vocab_size=vocab, dim=d, n_heads=heads, n_kv_heads=heads,
                      n_layers=field("n_layer", "num_hidden_layers"), ctx_len=field("n_positions", "n_ctx"),
                      ffn_hidden=field("n_inner", default=4 * d if isinstance(d, int) else 0), n_mtp=n_mtp,
                      norm_eps=float(field("layer_norm_epsilon", default=1e-5)), arch="gpt2")
    except (TypeError, ValueError) as e:
        raise UserError(f"config.json: {e}") from None
    except UserError as e:
        raise UserError(f"config.json: {e}") from None


def tokenizer_dict_from_vocab_merges(vocab: dict, merges_text: str) -> dict:
    """vocab.json (token string -> id) + merges.txt ("#version" line, then "left right" per line)
    -> the equivalent tokenizer.json dict (byte-level BPE, GPT-2 pre-tokenizer); every vocab entry that is
    neither a byte nor a merge result (GPT-2: `<|endoftext|>`) becomes an added token."""
    if not isinstance(vocab, dict) or not all(isinstance(k, str) and isinstance(v, int) for k, v in vocab.items()):
        raise UserError("vocab.json: expected an object of token string -> integer id")
    merges = [ln for ln in merges_text.splitlines() if ln and not ln.startswith("#version")]
    from ..tokenizer import bytes_to_unicode
    built = set(bytes_to_unicode())
    for i, m in enumerate(merges):
        if m.count(" ") != 1:
            raise UserError(f"merges.txt: line {i + 1} {m!r} is not 'left right'")
        built.add(m.replace(" ", ""))
    added = [{"id": i, "content": s, "special": True} for s, i in vocab.items() if s not in built]
    return {"model": {"type": "BPE", "vocab": vocab, "merges": merges}, "added_tokens": added,
            "normalizer": None, "decoder": {"type": "ByteLevel"},
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}}


def read_gpt2_tokenizer(folder: Path, vocab_rows: int, eos_id):
    """Our Tokenizer (the folder's ids kept) from vocab.json + merges.txt, else tokenizer.json.
    The tokenizer must name exactly the embedding's rows (GPT-2: 50,257)."""
    from .hf_tokenizer import from_hf_json
    if (folder / "vocab.json").is_file() and (folder / "merges.txt").is_file():
        try:
            merges_text = (folder / "merges.txt").read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise UserError(f"{folder / 'merges.txt'} is not UTF-8 ({e})") from None
        d = tokenizer_dict_from_vocab_merges(read_json_file(folder / "vocab.json", "vocabulary"), merges_text)
        what = "vocab.json + merges.txt"
    elif (folder / "tokenizer.json").is_file():
        d = read_json_file(folder / "tokenizer.json", "tokenizer")
        what = "tokenizer.json"
    else:
        raise UserError(f"{folder} has neither vocab.json + merges.txt nor tokenizer.json")
    tok = from_hf_json(d, None, eos_id)
    named = tok.vocab_size - sum(1 for s in tok.special_tokens if s.startswith("<|reserved_"))
    if named != vocab_rows or tok.vocab_size != vocab_rows:  # an id no token names is a hole, not a token
        raise UserError(f"{what} names {named} tokens but the embedding (wte) has {vocab_rows} rows")
    return tok


def read_gpt2_weights(folder: Path, progress: bool = False) -> dict[str, np.ndarray]:
    """GPT-2 tensor name (the `transformer.` prefix dropped, mask buffers skipped) -> float32 array."""
    out = {}
    for name, a in read_weights(folder, progress).items():
        name = name.removeprefix("transformer.")
        if name.endswith(MASK_BUFFERS):
            continue
        out[name] = a
    return out


def import_gpt2(folder: Path, c: dict, n_mtp: int | None = None, progress: bool = False):
    """A GPT2LMHeadModel folder -> (Config, params, Tokenizer); the importer's entry for model_type gpt2."""
    W = read_gpt2_weights(folder, progress)
    if "wte.weight" not in W:
        raise UserError("tensor wte.weight is missing from the weights")
    cfg = gpt2_config(c, W["wte.weight"].shape[0])
    lm_head = W.pop("lm_head.weight", None)
    if lm_head is not None and not np.array_equal(lm_head, W["wte.weight"]):
        raise UserError("lm_head.weight differs from wte.weight: an untied GPT-2 head is not supported")
    shapes, names = cfg.param_shapes(), hf_names(cfg.n_layers)
    d = cfg.dim
    params = {}
    for ours, (theirs, how) in names.items():
        if theirs not in W:
            raise UserError(f"tensor {theirs} is missing from the weights")
        a = W[theirs]
        if how in ("q", "k", "v"):
            want = (d, 3 * d) if theirs.endswith("weight") else (3 * d,)
            if a.shape != want:
                raise UserError(f"tensor {theirs} has shape {list(a.shape)}, expected {list(want)}")
            j = "qkv".index(how)
            a = a[..., j * d:(j + 1) * d]
        if how != "copy" and a.ndim == 2:
            a = a.T
        if tuple(a.shape) != shapes[ours]:
            if theirs == "wpe.weight" and a.shape[1:] == shapes[ours][1:]:
                raise UserError(f"tensor wpe.weight has {a.shape[0]} positions but config.json says n_positions "
                                f"{cfg.ctx_len}")
            want = shapes[ours][::-1] if how == "T" else shapes[ours]
            raise UserError(f"tensor {theirs} has shape {list(W[theirs].shape)}, expected {list(want)}")
        params[ours] = np.ascontiguousarray(a, dtype=np.float32)
    extra = sorted(set(W) - {theirs for theirs, _ in names.values()})
    if extra:
        raise UserError(f"unexpected tensor {extra[0]} in a GPT-2 folder")
    tok = read_gpt2_tokenizer(folder, cfg.vocab_size, eos_id_of(folder, c))
    params.update(mtp_heads(folder, n_mtp, params["embed.weight"]))
    cfg = cfg.replace(n_mtp=1 + sum(1 for n in params if n.startswith("heads.")))
    return cfg, {n: params[n] for n in cfg.param_shapes()}, tok


def load_gpt2_folder(src: str | Path, n_mtp: int | None = None, progress: bool = False):
    """A GPT-2 folder -> (Config, params, Tokenizer), writing nothing."""
    from ..config import check_params
    folder = Path(src)
    if not folder.is_dir():
        raise UserError(f"{folder} is not a folder")
    cfg, params, tok = import_gpt2(folder, read_hf_config(folder), n_mtp, progress)
    check_params(cfg, params)
    return cfg, params, tok


# ------------------------------------------------------------------------------------------------ export

def hf_config(cfg, eos: int | None, dtype: str = "float32") -> dict:
    """config.json of the GPT2LMHeadModel equal to ours."""
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": cfg.vocab_size, "n_positions": cfg.ctx_len, "n_ctx": cfg.ctx_len, "n_embd": cfg.dim,
        "n_layer": cfg.n_layers, "n_head": cfg.n_heads, "n_inner": cfg.ffn_hidden,
        "activation_function": "gelu_new", "layer_norm_epsilon": cfg.norm_eps,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "initializer_range": 0.02,
        "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
        "tie_word_embeddings": True, "bos_token_id": eos, "eos_token_id": eos, "use_cache": True,
        "torch_dtype": dtype, "nanoeuler_n_mtp": cfg.n_mtp,
    }


def tokenizer_files(tok) -> tuple[dict, list[str], list[dict]]:
    """(vocab: token string -> id, merges ["left right", ...], added tokens), in the tokenizer's ids."""
    strings, special, merges = tok.byte_level_vocab()
    vocab = {s: i for i, s in enumerate(strings) if not special[i]}
    for s in tok.special_tokens:
        if s in vocab:
            raise UserError(f"cannot export: the special token {s!r} is also an ordinary token")
    vocab.update(tok.special_tokens)
    added = [{"id": i, "content": s, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True} for s, i in sorted(tok.special_tokens.items(), key=lambda x: x[1])]
    return vocab, merges, added


def export_gpt2_folder(model, tok, out: str | Path, dtype: str = "float32", force: bool = False,
                       progress: bool = True) -> Path:
    """Write a GPT2LMHeadModel folder `out` (atomically) from an arch-gpt2 model and its tokenizer."""
    from tqdm import tqdm

    from ..tokenizer import GPT2_PATTERN
    from .outputs import output_dir
    from .safetensors_io import write_tensors
    cfg, P = model.config, model.params
    if cfg.arch != "gpt2":
        raise UserError(f"export_gpt2_folder: the model's arch is {cfg.arch}, not gpt2")
    if dtype not in HF_DTYPES:
        raise UserError(f"--dtype {dtype} is not one of {', '.join(HF_DTYPES)} for --format hf")
    if tok.vocab_size != cfg.vocab_size:
        raise UserError(f"the tokenizer has {tok.vocab_size} tokens but the model {cfg.vocab_size} embeddings")
    if tok.kind != "byte-level" or tok.pattern != GPT2_PATTERN:
        raise UserError("a GPT-2 folder needs the GPT-2 pre-tokenizer pattern; this tokenizer has another one")
    tensors, qkv = {}, {}
    for ours, (theirs, how) in tqdm(hf_names(cfg.n_layers).items(), desc="export", disable=not progress):
        a = np.asarray(P[ours], dtype=np.float32)
        if how in ("q", "k", "v"):
            qkv.setdefault(theirs, {})[how] = a.T if a.ndim == 2 else a
            if len(qkv[theirs]) == 3:
                tensors["transformer." + theirs] = np.concatenate([qkv[theirs][p] for p in "qkv"], axis=-1)
            continue
        tensors["transformer." + theirs] = a.T if how == "T" else a
    eos = tok.eos_id if tok.eos_token in tok.special_tokens else None
    vocab, merges, added = tokenizer_files(tok)
    tok_json = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        "post_processor": tok.hf_post_processor(),
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": merges},
    }
    eos_tok = tok.eos_token if eos is not None else None
    tok_config = {"tokenizer_class": "GPT2Tokenizer", "model_max_length": cfg.ctx_len, "add_prefix_space": False,
                  "bos_token": eos_tok, "eos_token": eos_tok, "unk_token": eos_tok, "pad_token": None}
    with output_dir(out, force) as tmp:
        write_tensors(tmp / "model.safetensors", tensors, HF_DTYPES[dtype], {"format": "pt"})
        if cfg.n_mtp > 1:  # MTP heads 1..K-1 (rows in token id order, as wte): only `nanoeuler import` reads them
            write_tensors(tmp / MTP_FILE, {f"heads.{k}.weight": P[f"heads.{k}.weight"] for k in range(1, cfg.n_mtp)},
                          "F32", {"format": "nanoeuler-mtp", "n_mtp": str(cfg.n_mtp)})
        (tmp / "config.json").write_text(json.dumps(hf_config(cfg, eos, dtype), indent=2) + "\n")
        (tmp / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
        (tmp / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
        (tmp / "tokenizer.json").write_text(json.dumps(tok_json, ensure_ascii=False), encoding="utf-8")
        (tmp / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
        gen = {"bos_token_id": eos, "eos_token_id": eos, "max_length": cfg.ctx_len}
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    return Path(out)
