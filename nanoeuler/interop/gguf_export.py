"""Export a checkpoint as a GGUF file for llama.cpp (its architecture's GGUF name: `llama` for ours), written
with the `gguf` package.

    nanoeuler export --ckpt runs/demo --format gguf --out demo.gguf --dtype float32|float16|q8_0|q4_0|q4_1|q5_0|q5_1

The types are infer/quant.py's rows that a float model can be put in (`from_float`), named as everywhere in
nanoeuler (`sample --dtype`); `f32` and `f16`, llama.cpp's tools' names for the two float types, are accepted
too (`LLAMA_CPP_NAMES`).

Tensor names are llama.cpp's, from the architecture's `gguf` table in arch.py (`token_embd`, `blk.i.attn_q`, ..., `output_norm`, `output`; `output` is left
out when head 0 equals the embedding). Matrices are stored in the requested type, 1-D norm weights always
in f32 (as llama.cpp's converter does). The tokenizer goes in the metadata: a byte-level BPE as `gpt2`
(tokens in the byte-level alphabet, merges as "left right", token types: specials are CONTROL, the
pre-tokenizer name), a SentencePiece-style one as `llama` (tokens, scores, token types, add_space_prefix;
a vocabulary ranked by Hugging Face merges gets scores from the merge ranks, which llama.cpp reads as
"any two pieces whose join is a token merge, the higher score first": the same merges when the list holds
every such pair, as SentencePiece's own lists do), Gemma 4's BPE (newline runs cut apart) as `gemma4` (tokens,
types, its merges as "left right"), WordPiece as `bert` (unknown and separator ids, add_sep, the normalizer's
lowercase / strip_accents) and Unigram as `t5` (scores, the precompiled charsmap, add_space_prefix,
remove_extra_whitespaces, unknown id, add_eos): those two only in llama.cpp's form, as imported from a GGUF (the
Hugging Face form normalizes otherwise and is refused by name); then bos, eos, add_bos_token and the checkpoint's
chat template (ours: the Alpaca one). MTP heads 1..K-1 are not exported (llama.cpp uses head 0).
RoPE scaling: linear as rope.scaling.type / factor, yarn as type / factor / original_context_length (and
attn_factor where the attention factor is not llama.cpp's own), longrope (phi3) as the tensors rope_factors_short /
rope_factors_long and rope.scaling.attn_factor, llama3 (or per-pair factors) as the tensor `rope_freqs`
[head_dim/2] that llama.cpp's converter writes for Llama 3.x, each pair's frequency divisor.

RoPE layout: llama.cpp's `llama` rotates interleaved pairs (2i, 2i+1) of each head, we rotate (i, i+hd/2).
`permute_qk` reorders each head's rows so that llama.cpp's pairs are our pairs: within a head, row
r = 2i + j (j = 0, 1) of the result is our row i + j·hd/2. For hd = 4: rows [0, 1, 2, 3] -> [0, 2, 1, 3].
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from ..errors import UserError

LLAMA_CPP_NAMES = {"f32": "float32", "f16": "float16"}  # llama.cpp's names of the float types -> ours


def permute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """[n_heads·hd, d] rotate-half rows -> interleaved rows (llama.cpp's convert_hf_to_gguf `permute`)."""
    rows, d = w.shape
    hd = rows // n_heads
    return w.reshape(n_heads, 2, hd // 2, d).swapaxes(1, 2).reshape(rows, d)


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """The inverse of permute_qk: unpermute_qk(permute_qk(w, h), h) == w."""
    rows, d = w.shape
    hd = rows // n_heads
    return w.reshape(n_heads, hd // 2, 2, d).swapaxes(1, 2).reshape(rows, d)


def gguf_names(cfg) -> dict[str, str]:
    """Our parameter name -> llama.cpp's tensor holding it (arch.py's `gguf` table; GPT-2's wq, wk, wv share
    attn_qkv). gguf_names(small)["layers.3.attn.wq.weight"] -> 'blk.3.attn_q.weight'"""
    return {n: e.name for e in cfg.spec.gguf.tensors(cfg.n_layers) for n in e.ours}


def layer_tensor(cfg, name: str, rows: np.ndarray) -> tuple[str, np.ndarray]:
    """Our weight name ("layers.3.attn.wq.weight") and an array whose rows are that weight's output rows (the
    weight, or a LoRA B) -> llama.cpp's name ("blk.3.attn_q.weight") and the rows as it orders them (q and k
    of a `llama` file: `permute_qk`; q and k rows of a model turning part of each head: hf.format_rows). A bias too."""
    from .hf import format_rows
    rows = format_rows(cfg, name, rows)
    if cfg.spec.gguf.permute_qk and name.endswith(("attn.wq.weight", "attn.wk.weight")):
        rows = permute_qk(rows, cfg.n_heads if name.endswith("wq.weight") else cfg.n_kv_heads)
    return gguf_names(cfg)[name], rows


def gguf_tensors(model) -> dict[str, np.ndarray]:
    """llama.cpp name -> float32 array (q and k permuted where llama.cpp wants it; several of ours stacked by
    rows into one where it fuses them), in the table's order. `output` is left out when head 0 is the
    embedding (llama.cpp then uses token_embd), or written as its copy where llama.cpp requires it
    (Format.head_required)."""
    from ..config import head_name
    cfg, P = model.config, model.params
    tied = "heads.0.weight" not in P or np.array_equal(P["heads.0.weight"], P["embed.weight"])
    required = cfg.spec.gguf.head_required   # (llama.cpp's olmo2, stablelm: the embedding's copy)
    out = {}
    if cfg.rope_scaling in ("llama3", "factors"):   # llama.cpp divides each pair's frequency by these
        out["rope_freqs.weight"] = cfg.rope_factors().astype(np.float32)
    if cfg.rope_scaling == "longrope":              # llama.cpp's phi3 chooses by its context, as we do
        out["rope_factors_short.weight"] = np.array(cfg.rope_freq_factors, np.float32)
        out["rope_factors_long.weight"] = np.array(cfg.rope_long_factors, np.float32)
    for e in cfg.spec.gguf.tensors(cfg.n_layers):
        if e.ours == ("heads.0.weight",) and tied and not required:
            continue
        parts = [layer_tensor(cfg, n, P[n])[1] if n.startswith("layers.") else P[n if n in P else head_name(P, 0)]
                 for n in e.ours]   # (heads.0 of a tied model: the embedding)
        out[e.name] = np.ascontiguousarray(np.concatenate(parts), dtype=np.float32)
    return out


def gguf_blocks(cfg, blocks: dict) -> dict:
    """llama.cpp name -> (its data as a source file held it, its GGMLQuantizationType), for the tensors whose
    every part is among `blocks` in one type (void records of a block type: rows of bytes; or float16), q and k
    permuted as gguf_tensors does."""
    import gguf

    from ..infer.quant import of_dtype
    out = {}
    for e in cfg.spec.gguf.tensors(cfg.n_layers):
        parts = [blocks.get("embed.weight" if n == "heads.0.weight" and cfg.tie_embeddings else n) for n in e.ours]
        if any(p is None for p in parts) or len({p.dtype for p in parts}) != 1:
            continue
        a = np.ascontiguousarray(np.concatenate([layer_tensor(cfg, n, p)[1] for n, p in zip(e.ours, parts)]))
        t = of_dtype(a.dtype)   # the type by the name its dtype carries
        out[e.name] = (a if t.block == 1 else a.view(np.uint8), gguf.GGMLQuantizationType(t.ggml))
    return out


def add_hparams(w, cfg) -> None:
    """The `{arch}.*` hyperparameters of cfg into a gguf.GGUFWriter (made for cfg's GGUF architecture)."""
    a = cfg.spec
    w.add_context_length(cfg.ctx_len)
    w.add_embedding_length(cfg.dim)
    w.add_block_count(cfg.n_layers)
    w.add_feed_forward_length(cfg.ffn_hidden)
    w.add_head_count(cfg.n_heads)
    w.add_head_count_kv(cfg.n_kv_heads)
    if a.norm == "rms":
        w.add_layer_norm_rms_eps(cfg.norm_eps)
    else:
        w.add_layer_norm_eps(cfg.norm_eps)
    if a.positions == "rope":
        w.add_rope_dimension_count(cfg.rope_dims)
        w.add_rope_freq_base(cfg.rope_theta)
    if cfg.rope_scaling == "linear":   # (llama3, factors: the tensor rope_freqs, gguf_tensors)
        w.add_rope_scaling_type(_gguf().RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(cfg.rope_factor)
    if cfg.rope_scaling == "yarn":
        _add_yarn(w, cfg)
    if cfg.rope_scaling == "longrope":   # (its factors: tensors, gguf_tensors; the original context: phi3's config)
        w.add_rope_scaling_type(_gguf().RopeScalingType.LONGROPE)
        w.add_rope_scaling_attn_factors(cfg.rope_attn_factor)
    if cfg.head_dim * cfg.n_heads != cfg.dim:
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    if cfg.sliding_window:
        w.add_sliding_window(cfg.sliding_window)
        w.add_sliding_window_pattern(cfg.global_every)   # llama.cpp: layer i global iff i % n == n - 1 (0: none)
        w.add_rope_freq_base_swa(cfg.rope_local_theta)
    for ours, (key,) in a.gguf.config.items():   # the Config numbers it reads under `{arch}.` (Granite's multipliers)
        value = getattr(cfg, ours)                # (an integer as llama.cpp reads it: Phi-3's original context)
        add = w.add_bool if type(value) is bool else w.add_uint32 if type(value) is int else w.add_float32
        add(f"{a.gguf.name}.{key}", value)
    w.add_vocab_size(cfg.vocab_size)


def _add_yarn(w, cfg) -> None:
    """yarn as llama.cpp reads it: type, factor, original context, and where the attention factor is not the one
    llama.cpp computes (1 + 0.1·ln(factor) above factor 1), rope.scaling.attn_factor, which multiplies it."""
    w.add_rope_scaling_type(_gguf().RopeScalingType.YARN)
    w.add_rope_scaling_factor(cfg.rope_factor)
    if "rope_original_ctx" not in cfg.spec.gguf.config:   # (phi3 writes it with its numbers)
        w.add_rope_scaling_orig_ctx_len(cfg.rope_original_ctx)
    computed = 1 + 0.1 * math.log(cfg.rope_factor) if cfg.rope_factor > 1 else 1.0
    if cfg.rope_attn_factor != computed:
        w.add_rope_scaling_attn_factors(cfg.rope_attn_factor / computed)


def check_expressible(cfg) -> None:
    """Refuse what llama.cpp's architecture would read differently from our config: a sliding window where it
    has none, per-pair RoPE factors where it reads none, heads of another width than dim / n_heads where it
    makes q and the attention output dim x dim (its Format's heads_fill_dim), an attention scale it computes
    otherwise (attention_scale_mismatch), a soft cap where it reads none or none where it always caps (its gguf Format's
    config names the caps: gemma2), a head of its own where it takes the embedding (no `output` in its table), a
    setting it fixes otherwise (its Format's fixed: smollm3's layer without RoPE every 4th)."""
    from ..arch import by_format
    a = cfg.spec
    if cfg.sliding_window and ("sliding_window" not in by_format("gguf", a.gguf.name).defaults   # (mistral: llama)
                               or not a.gguf.reads_window):
        raise UserError(f"cannot export to GGUF: llama.cpp's {a.gguf.name} has no sliding window")
    if cfg.rope_scaling == "yarn" and (cfg.rope_beta_fast, cfg.rope_beta_slow) != (32.0, 1.0):
        raise UserError(f"cannot export to GGUF: llama.cpp computes yarn with beta_fast 32 and beta_slow 1 whatever "
                        f"the file says (rope_beta_fast {cfg.rope_beta_fast}, rope_beta_slow {cfg.rope_beta_slow})")
    if cfg.rope_scaling == "longrope" and not a.gguf.rope_long_short:
        raise UserError(f"cannot export to GGUF: llama.cpp's {a.gguf.name} reads no LongRoPE factors "
                        f"(rope_factors_short / rope_factors_long; its phi3 does)")
    if cfg.rope_scaling in ("llama3", "factors") and not a.gguf.rope_freqs:
        raise UserError(f"cannot export to GGUF: llama.cpp's {a.gguf.name} reads no per-pair RoPE factors "
                        f"(rope_freqs), which rope_scaling {cfg.rope_scaling} needs")
    if a.gguf.heads_fill_dim and cfg.head_dim * cfg.n_heads != cfg.dim:
        raise UserError(f"cannot export to GGUF: llama.cpp's {a.gguf.name} makes q and the attention output "
                        f"{cfg.dim} x {cfg.dim} (heads of dim / n_heads = {cfg.dim / cfg.n_heads:g}); this model's "
                        f"{cfg.n_heads} heads of {cfg.head_dim} make {cfg.n_heads * cfg.head_dim}")
    why = attention_scale_mismatch(cfg)
    if why:
        raise UserError(f"cannot export to GGUF: {why}")
    for cap in ("attn_softcap", "logit_softcap"):
        if bool(getattr(cfg, cap)) != (cap in a.gguf.config):
            raise UserError(f"cannot export to GGUF: llama.cpp's {a.gguf.name} "
                            f"{'always soft-caps' if cap in a.gguf.config else 'has no soft cap'} ({cap} "
                            f"{getattr(cfg, cap):g})")
    for name, value in a.gguf.fixed.items():
        if getattr(cfg, name) != value:
            raise UserError(f"cannot export to GGUF: llama.cpp's {a.gguf.name} fixes {name} at {value} (this model: "
                            f"{getattr(cfg, name)})")
    if not cfg.tie_embeddings and not any("heads.0.weight" in e.ours for e in a.gguf.globals_):
        raise UserError(f"cannot export to GGUF: llama.cpp's {a.gguf.name} takes the embedding as its output head; "
                        f"this model has a head of its own")


def attention_scale_mismatch(cfg) -> str | None:
    """Why llama.cpp would scale cfg's attention otherwise than we do, or None: at a depth the architecture's
    `width_scaled_at` names (Gemma 3's 62 layers) it divides q·k by √(dim / n_heads), where we divide by
    √head_dim. A Gemma 3 27B (dim 5376, 32 heads, head_dim 128): √168 there, √128 here."""
    width = cfg.dim // cfg.n_heads
    if cfg.n_layers in cfg.spec.gguf.width_scaled_at and width != cfg.head_dim:
        return (f"llama.cpp scales the attention of a {cfg.spec.gguf.name} of {cfg.n_layers} layers by "
                f"1/sqrt({width}) (embedding_length / head_count), this model by 1/sqrt(head size {cfg.head_dim})")
    return None


def token_metadata(tok, vocab_size: int):
    """(tokens, token types, merges) in llama.cpp's GPT-2 BPE form: entry i is the token of id i (the
    tokenizer's ids, which an imported vocabulary keeps), padded to the model's vocab_size."""
    from gguf import TokenType
    tokens, special, merges = tok.byte_level_vocab()
    user = set(tok.user_defined)   # cut out of any text, as llama.cpp cuts USER_DEFINED (CONTROL: only when asked)
    types = [(TokenType.USER_DEFINED if t in user else TokenType.CONTROL) if s else TokenType.NORMAL
             for t, s in zip(tokens, special)]
    for i in range(len(tokens), vocab_size):
        tokens.append(f"[PAD{i}]")
        types.append(TokenType.UNUSED)
    return tokens, types, merges


def spm_metadata(tok, vocab_size: int):
    """(tokens, token types, scores) of a SentencePiece-style tokenizer for llama.cpp's `llama` model, padded to
    the model's vocab_size; refused when llama.cpp cannot prepare text as the tokenizer does."""
    from gguf import TokenType
    if tok.prefix not in ("none", "every") or tok.split or tok.normalizer:
        raise UserError(f"cannot export to GGUF: llama.cpp's SentencePiece tokenizer puts a \"▁\" before every "
                        f"text fragment or none, without a normal form or a split at spaces (this one: prefix "
                        f"{tok.prefix}, split {tok.split}, normalizer {tok.normalizer})")
    scores = tok.scores
    if scores is None:       # Hugging Face merges: the first merge that makes a token ranks it
        scores = np.full(tok.vocab_size, -1e9, np.float32)
        for rank, (a, b) in reversed(list(enumerate(tok.merges))):
            scores[tok.find(tok.tokens[a] + tok.tokens[b])] = -rank
    pad = vocab_size - tok.vocab_size
    return (list(tok.tokens) + [f"[PAD{i}]" for i in range(tok.vocab_size, vocab_size)],
            tok.types.tolist() + [int(TokenType.UNUSED)] * pad, scores.tolist() + [0.0] * pad)


def padded(tok, vocab_size: int) -> tuple[list[str], list[int]]:
    """(tokens, token types) of a vocabulary in id order, padded to the model's vocab_size with UNUSED tokens."""
    from gguf import TokenType
    pad = range(tok.vocab_size, vocab_size)
    return list(tok.tokens) + [f"[PAD{i}]" for i in pad], tok.types.tolist() + [int(TokenType.UNUSED)] * len(pad)


def llama_cpp_form(tok, name: str) -> None:
    """Refuse a WordPiece / Unigram that normalizes text as Hugging Face does: llama.cpp's `name` model normalizes
    it otherwise (unicode.cpp's own NFD and marks, the charsmap by longest match), so its ids would differ."""
    if tok.normalization != "llama.cpp":
        raise UserError(f"cannot export to GGUF: this {tok.kind} tokenizer normalizes text as Hugging Face's does, and "
                        f"llama.cpp's {name} tokenizer normalizes it otherwise (only one imported from a GGUF exports)")


def gemma4_fields(w, tok) -> None:
    """Gemma 4's BPE (llama.cpp's `gemma4`: merges by rank, runs of newlines cut apart, "▁" for spaces and none
    put in front, a bos always added) into a gguf.GGUFWriter; refused where llama.cpp would run it otherwise."""
    from ..tokenizer.sentencepiece import merge_ids
    if tok.given_merges is None or tok.prefix != "none" or tok.split or tok.normalizer or tok.bos_token is None:
        raise UserError("cannot export to GGUF: llama.cpp's gemma4 tokenizer ranks merges, adds no \"▁\" in front, "
                        "splits at no space, has no normal form and always puts a bos first (this one: "
                        f"{'merges' if tok.scores is None else 'scores'}, prefix {tok.prefix}, split {tok.split}, "
                        f"normalizer {tok.normalizer}, bos {tok.bos_token})")
    merges = [f"{tok.tokens[a]} {tok.tokens[b]}" for a, b in tok.given_merges.tolist()]
    try:
        same = np.array_equal(merge_ids(list(tok.tokens), merges), tok.given_merges)
    except UserError:
        same = False
    if not same:    # llama.cpp cuts "left right" at the first space after the first character
        raise UserError("cannot export to GGUF: a merge's left token holds a space, so llama.cpp would read the "
                        "\"left right\" merge as other tokens")
    w.add_tokenizer_model("gemma4")
    w.add_token_merges(merges)
    w.add_add_space_prefix(False)


def wordpiece_fields(w, tok) -> None:
    """WordPiece in llama.cpp's form (`bert`: "▁" before a word's first piece) into a gguf.GGUFWriter: the unknown
    and separator ids, add_sep, the normalizer's lowercase and strip_accents."""
    llama_cpp_form(tok, "bert")
    w.add_tokenizer_model("bert")
    w.add_unk_token_id(tok.ids[tok.unk])
    if tok.eos_token is not None:
        w.add_sep_token_id(tok.eos_id)
    w.add_add_sep_token(tok.add_eos)
    w.add_bool("tokenizer.ggml.normalizer.lowercase", tok.lowercase)
    w.add_bool("tokenizer.ggml.normalizer.strip_accents", tok.strip_accents)


def unigram_fields(w, tok, vocab_size: int) -> None:
    """Unigram in llama.cpp's form (`t5`) into a gguf.GGUFWriter: scores, the precompiled charsmap, add_space_prefix,
    remove_extra_whitespaces, the unknown id, add_eos."""
    llama_cpp_form(tok, "t5")
    w.add_tokenizer_model("t5")
    w.add_token_scores(tok.scores.astype(np.float32).tolist() + [0.0] * (vocab_size - tok.vocab_size))
    if tok.charsmap is not None:
        w.add_precompiled_charsmap(tok.charsmap.blob)
    w.add_add_space_prefix(tok.add_space_prefix)
    w.add_remove_extra_whitespaces(tok.merge_spaces)
    w.add_unk_token_id(tok.ids[tok.unk])
    w.add_add_eos_token(tok.add_eos)


def add_vocabulary(w, tok, vocab_size: int, pre: str | None) -> tuple[list[str], list]:
    """tokenizer.ggml.model and what that model needs besides the tokens (byte-level: merges and the pre-tokenizer
    name pre; SentencePiece: scores and add_space_prefix; Gemma 4's, WordPiece's, Unigram's: *_fields) into a
    gguf.GGUFWriter; -> (tokens, token types), for the caller to add."""
    if tok.kind == "sentencepiece" and tok.newlines:
        gemma4_fields(w, tok)
        tokens, types = padded(tok, vocab_size)
    elif tok.kind == "wordpiece":
        wordpiece_fields(w, tok)
        tokens, types = padded(tok, vocab_size)
    elif tok.kind == "unigram":
        unigram_fields(w, tok, vocab_size)
        tokens, types = padded(tok, vocab_size)
    elif tok.kind == "sentencepiece":
        tokens, types, scores = spm_metadata(tok, vocab_size)
        w.add_tokenizer_model("llama")
        w.add_token_scores(scores)
        w.add_add_space_prefix(tok.prefix == "every")
    else:
        tokens, types, merges = token_metadata(tok, vocab_size)
        w.add_tokenizer_model("gpt2")
        w.add_token_merges(merges)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    return tokens, types


def pre_of(tok) -> str | None:
    """The tokenizer.ggml.pre name of a byte-level BPE's pattern (None for the other kinds, which have none); refused
    when llama.cpp names no pre-tokenizer that splits as it does (it picks its split by this name)."""
    from .pretokenizers import pre_name
    if tok.kind != "byte-level":
        return None
    pre = pre_name(tok.pattern, tok.ignore_merges)
    if pre is None:
        raise UserError(f"cannot export to GGUF: llama.cpp names no pre-tokenizer that splits as this tokenizer's "
                        f"pattern does{' and ignores merges' if tok.ignore_merges else ' and applies every merge'} "
                        f"(interop/pretokenizers.py)")
    return pre


def add_tokenizer(w, tok, vocab_size: int, pre: str | None) -> None:
    """Every tokenizer.* field of tok into a gguf.GGUFWriter, padded to the model's vocab_size: add_vocabulary's,
    the tokens and their types, eos, bos (the eos where there is none), add_bos_token and the chat template."""
    from ..chat_template import template_of
    tokens, types = add_vocabulary(w, tok, vocab_size, pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    if tok.eos_token in tok.special_tokens:
        w.add_eos_token_id(tok.eos_id)
    if tok.bos_id is not None:  # an imported Llama-3's <|begin_of_text|>: llama.cpp puts it first, as HF does
        w.add_bos_token_id(tok.bos_id)
    elif tok.eos_token in tok.special_tokens:
        w.add_bos_token_id(tok.eos_id)
    w.add_add_bos_token(tok.bos_id is not None)
    w.add_chat_template(template_of(tok))


def _gguf():
    try:
        import gguf
    except ImportError:
        raise UserError("GGUF export needs the gguf package: pip install 'nanoeuler[interop]'") from None
    return gguf


def export_gguf(model, tok, out: str | Path, dtype: str = "float32", force: bool = False, progress: bool = True,
                blocks: dict | None = None) -> Path:
    """Write the GGUF file `out` atomically (a temporary name renamed at the end), its matrices of weight type
    dtype (quant.from_float(), or llama.cpp's name of a float type). blocks: an import's matrices as its file held them
    (checkpoint.source_blocks), written back byte for byte where they hold a whole tensor."""
    gguf = _gguf()
    from tqdm import tqdm

    from ..fileio import atomic_path
    from .outputs import check_free

    from ..infer.quant import WTYPES, from_float
    dtype = LLAMA_CPP_NAMES.get(dtype, dtype)
    if dtype not in from_float():
        raise UserError(f"--dtype {dtype} is not one of {', '.join(from_float())} for --format gguf")
    out = check_free(out, force)
    if out.is_dir():
        raise UserError(f"{out} is a folder; the GGUF output is one file")
    cfg = model.config
    check_expressible(cfg)
    if tok.vocab_size > cfg.vocab_size:
        raise UserError(f"the tokenizer has {tok.vocab_size} tokens but the model {cfg.vocab_size} embeddings")
    pre = pre_of(tok)
    wtype = WTYPES[dtype]
    qtype = gguf.GGMLQuantizationType(wtype.ggml)
    ftype = gguf.LlamaFileType.ALL_F32 if dtype == "float32" else gguf.LlamaFileType[f"MOSTLY_{qtype.name}"]
    if wtype.block > 1 and (cfg.dim % 32 or cfg.ffn_hidden % 32 or (cfg.n_heads * cfg.head_dim) % 32):
        raise UserError(f"{dtype} needs every matrix row length (dim, ffn_hidden) to be a multiple of 32")
    tensors = gguf_tensors(model)
    raw = gguf_blocks(cfg, blocks or {})
    if raw:  # the file type: the most common one among the matrices
        from collections import Counter
        common = Counter(q.name for _, q in raw.values()).most_common(1)[0][0]
        ftype = gguf.LlamaFileType.MOSTLY_F16 if common == "F16" else gguf.LlamaFileType[f"MOSTLY_{common}"]
    with atomic_path(out) as tmp:
        w = gguf.GGUFWriter(str(tmp), cfg.spec.gguf.name)
        w.add_name("nanoeuler")
        add_hparams(w, cfg)
        w.add_file_type(int(ftype))
        add_tokenizer(w, tok, cfg.vocab_size, pre)
        for name, a in tqdm(tensors.items(), desc="gguf", disable=not progress):
            if name in raw:
                data, q = raw[name]
                w.add_tensor(name, data, raw_dtype=None if q == gguf.GGMLQuantizationType.F16 else q)
            elif a.ndim == 1 or qtype == gguf.GGMLQuantizationType.F32:
                w.add_tensor(name, a)
            else:
                w.add_tensor(name, gguf.quants.quantize(a, qtype), raw_dtype=qtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    return out


def _lora_b_by_tensor(cfg, bases: list[str], parts: list[np.ndarray]) -> dict[str, np.ndarray]:
    """A module's B rows of each base weight -> llama.cpp's tensor name -> its B [out, r]: the rows of the weights
    one tensor holds stacked as the tensor stacks them (GPT-2's, Phi-3's, GPT-NeoX's attn_qkv; Phi-3's ffn_up of
    gate | up: a module adapts such a tensor whole, arch.py's `lora`), as their A is the module's one A: that
    tensor's update is exactly B·A."""
    out = {}
    for name, rows in zip(bases, parts):
        gname, b = layer_tensor(cfg, name, rows)
        out.setdefault(gname, []).append(b)
    return {gname: np.concatenate(bs) for gname, bs in out.items()}


def export_gguf_lora(run_dir, out: str | Path, force: bool = False) -> Path:
    """Write the adapters of the LoRA run in run_dir as a llama.cpp LoRA adapter (one .gguf file, atomically),
    for the base's `--format gguf` export: general.type "adapter", adapter.type "lora", adapter.lora.alpha,
    and each adapted weight's A [r, in] and B [out, r] as `<its llama.cpp name>.lora_a` / `.lora_b`, as
    llama.cpp's convert_lora_to_gguf.py writes them (B's rows of q and k permuted like the weight's rows).
    llama.cpp applies W + (alpha / r)·B·A: our merged model."""
    from ..adapters import is_adapter_run, load_adapter_run, modules, row_slices
    from ..fileio import atomic_path
    from .outputs import check_free
    gguf = _gguf()
    if not is_adapter_run(run_dir):
        raise UserError(f"--format gguf-lora exports an adapter run (sft/dpo/train --lora); {run_dir} has no lora.json")
    lcfg, _, adapters, cfg, _ = load_adapter_run(run_dir, read_only=True)   # refused if the base changed
    if lcfg.modules_to_save:   # llama-adapter.cpp: only .lora_a/.lora_b pairs; *_norm.weight read and ignored
        raise UserError(f"--format gguf-lora: {run_dir} trains {','.join(lcfg.modules_to_save)} whole, which a "
                        f"llama.cpp LoRA adapter cannot carry (A/B pairs only); export --format peft, or merge "
                        f"(nanoeuler lora merge) and export --format gguf")
    out = check_free(out, force, inputs=[run_dir])
    if out.is_dir():
        raise UserError(f"{out} is a folder; the GGUF adapter is one file")
    with atomic_path(out) as tmp:
        w = gguf.GGUFWriter(str(tmp), cfg.spec.gguf.name)
        w.add_type(gguf.GGUFType.ADAPTER)
        w.add_string(gguf.Keys.Adapter.TYPE, "lora")
        w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(lcfg.alpha))
        w.add_name("nanoeuler LoRA")
        for module, (bases, _) in modules(cfg, lcfg).items():
            A, B = adapters[module + ".lora_A"], adapters[module + ".lora_B"]
            for gname, b in _lora_b_by_tensor(cfg, bases, [B[rows] for rows in row_slices(cfg, bases)]).items():
                w.add_tensor(gname + ".lora_a", np.ascontiguousarray(A, np.float32))   # [r, in]
                w.add_tensor(gname + ".lora_b", np.ascontiguousarray(b, np.float32))   # [out, r]
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    return out
