"""Import a GGUF file (llama.cpp's format; quantized or not) as a nanoeuler checkpoint.

    nanoeuler import --from SmolLM2-135M-Instruct-Q8_0.gguf --out runs/smol

`general.architecture` names one of arch.py's entries by its GGUF name (`llama`: Llama, SmolLM2, Mistral
without a window; `qwen2`; `gemma3`; `gpt2`), whose `gguf` table names every tensor. The header is parsed from
the mapped file (gguf_file.py); every tensor is made float32 by
`gguf.quants.dequantize` (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_x, Q2_K..Q6_K, ...); the type each tensor
had in the file is kept in the checkpoint's `source.json`:

    {"format": "gguf", "file": "smol.gguf", "file_tensor_bytes": 144000000,
     "tensor_types": {"embed.weight": "Q8_0", "norm.weight": "F32", ...}}

and `sample`, `chat`, `serve` decode in the type most of the matrices had (Q8_0, Q4_0, Q4_1: quantized
again at load, which gives back the file's Q8_0 / Q4_0 bytes; F16; else float32) unless --dtype says otherwise.

llama: the q and k rows come back from llama.cpp's interleaved RoPE order (`gguf_export.unpermute_qk`, the
inverse of our export's permutation), so import(export(ckpt)) == ckpt bit for bit at f32. gpt2: the fused
`attn_qkv` [3d, d] is cut into wq | wk | wv (GGUF stores GPT-2's matrices [out, in] already). gemma3: the
norms are stored as their effective scale, as ours (llama.cpp's converter adds Gemma's 1).

The tokenizer comes from `tokenizer.ggml.*`, read as llama.cpp's llama_vocab::load reads it. Model `gpt2`
(byte-level BPE): tokens, merges (by rank, in any order), token types (CONTROL / USER_DEFINED / UNKNOWN become
specials, USER_DEFINED ones cut out of text always; UNUSED ids reserved rows), and `tokenizer.ggml.pre`: a
row of pretokenizers.PRE_FAMILIES, one per pre-tokenizer llama.cpp knows (its regexes, `ignore_merges`, bos by default;
`default`, or no name as in llama.cpp, the cascade hf_tokenizer.DEFAULT_CASCADE); the ids stay the file's (the
Tokenizer's id map), bytes the vocabulary lacks are left out. Model `llama` (SentencePiece-style BPE):
tokens, scores, token types and add_space_prefix as they are (tokenizer/sentencepiece.py); `gemma4` (Gemma 4's
BPE): the same kind ranked by its merges, with runs of newlines cut apart; `bert` (WordPiece,
tokenizer/wordpiece.py) and `t5` (Unigram with its precompiled charsmap, tokenizer/unigram.py) with llama.cpp's
normalization. All: bos
(`add_bos_token`, else the family's default), eos, and as stops every end-of-generation token llama.cpp
knows (eot / eom / fill-in-the-middle ids, EOG_TEXTS); `tokenizer.chat_template` travels with the tokenizer.
RoPE scaling: a linear factor, or llama.cpp's per-pair `rope_freqs` (llama3's where it is, `gguf_rope_fields`),
yarn (type, factor, original context; llama.cpp's own attention factor), or phi3's LongRoPE tensors
`rope_factors_short` / `rope_factors_long` with rope.scaling.attn_factor (`gguf_longrope_fields`).
Everything the model could not compute the same (other RoPE scalings, a window where the architecture has none,
soft-capping, experts, an attention scale llama.cpp derives otherwise, another architecture, another
tokenizer model) is refused by name, and so is any defect of the file
(truncated, absurd counts, data past the end, shapes that disagree with the metadata, a vocabulary larger
than the embedding): one line, nothing written.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from ..errors import UserError
from ..ops.rope import inv_freq, llama3_factors
from .pretokenizers import pre_pattern

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED = 1, 2, 3, 4, 5  # gguf.TokenType values
TOKENIZER_MODELS = {"gpt2": "byte-level BPE", "llama": "SentencePiece BPE",     # tokenizer.ggml.model
                    "bert": "WordPiece", "t5": "Unigram", "gemma4": "Gemma 4's BPE"}
OTHER_MODELS = {"rwkv": "RWKV's trie", "plamo2": "PLaMo-2's", "no_vocab": "no vocabulary", "none": "no vocabulary"}
# llama.cpp's end-of-generation tokens (llama_vocab::load): the eos / eot / eom ids, the fill-in-the-middle pad,
# repository and file-separator tokens (their id in the metadata, else found by text), and these by their text
FIM_EOG = {"tokenizer.ggml.fim_pad_token_id": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
           "tokenizer.ggml.fim_rep_token_id": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
           "tokenizer.ggml.fim_sep_token_id": ("<|file_sep|>",)}
# the kind of value each tokenizer key holds (as llama.cpp's get_key checks it: another is a damaged file); every
# tokenizer.ggml.*_token_id holds an id
TOKENIZER_KINDS = {"tokenizer.ggml.model": (str, "a name"), "tokenizer.ggml.pre": (str, "a name"),
                   "tokenizer.chat_template": (str, "a string"), "tokenizer.ggml.tokens": (list, "an array"),
                   "tokenizer.ggml.merges": (list, "an array"), "tokenizer.ggml.token_type": (list, "an array"),
                   "tokenizer.ggml.scores": (list, "an array"), "tokenizer.ggml.add_bos_token": (bool, "true or false"),
                   "tokenizer.ggml.add_eos_token": (bool, "true or false"),
                   "tokenizer.ggml.add_space_prefix": (bool, "true or false"),
                   "tokenizer.ggml.add_sep_token": (bool, "true or false"),
                   "tokenizer.ggml.remove_extra_whitespaces": (bool, "true or false"),
                   "tokenizer.ggml.precompiled_charsmap": (list, "an array"),
                   "tokenizer.ggml.normalizer.lowercase": (bool, "true or false"),
                   "tokenizer.ggml.normalizer.strip_accents": (bool, "true or false")}
EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
             "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
             "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
             "<｜end▁of▁sentence｜>", "[e~[")

# ------------------------------------------------------------------------------------------- reading

def open_gguf(path: Path):
    """The parsed header of path (gguf_file.GGUFFile: metadata, tensor table); any defect is a one-line
    UserError."""
    from .gguf_file import GGUFFile
    return GGUFFile(path)


def metadata(reader, path: Path) -> dict:
    """Key -> value of every metadata field (token arrays included)."""
    return dict(reader.meta)


def field(meta: dict, key: str, kind=int, default=None):
    """meta[key] checked to be `kind` (int: a non-negative integer; float: a number; bool); default when absent
    (None: required)."""
    v = meta.get(key, default)
    if v is None:
        raise UserError(f"GGUF metadata {key} is missing")
    if kind is int and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
        raise UserError(f"GGUF metadata {key} = {v!r:.60} is not a non-negative integer")
    if kind is bool and not isinstance(v, bool):
        raise UserError(f"GGUF metadata {key} = {v!r:.60} is not true or false")
    if kind is float:  # GGUF stores float32: its shortest decimal (1e-05, not 9.99999974e-06) is the value meant
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise UserError(f"GGUF metadata {key} = {v!r:.60} is not a number")
        return float(str(np.float32(v)))
    return v


def check_tensor_layout(reader, path: Path) -> None:
    """Refuse (UserError, naming the tensors) data that llama.cpp's gguf_init refuses: each tensor's data must
    start where the previous one's ends, padded to the file's alignment, in the order of the tensor infos. So
    no two tensors share bytes (v's offset pointing at k's data), no data starts off the alignment, and each
    tensor's type and shape account for exactly the bytes it is given (a Q8_0 tensor relabelled F32 does not).

        three F32 [1024] tensors at data offsets 0, 4096, 8192 (alignment 32)    # passes
        the same at 0, 0, 8192                                                   # UserError: ... overlap
    """
    align, expected, previous = reader.alignment, reader.data_offset, None
    for t in reader.tensors:
        offset = int(t.data_offset)
        if offset != expected:
            if (offset - reader.data_offset) % align:
                why = f"tensor {t.name}'s data starts at byte {offset}, off the file's {align}-byte alignment"
            elif previous is None:
                why = f"tensor {t.name}'s data starts at byte {offset}, not where the data begins ({expected})"
            else:
                why = layout_mismatch(previous, t, offset - int(previous.data_offset), align)
            raise UserError(f"{path}: {why}; the file is damaged")
        expected = offset + -(-int(t.n_bytes) // align) * align
        previous = t


def layout_mismatch(prev, t, given: int, align: int) -> str:
    """Why tensor t does not start where tensor prev's data (given bytes of the file, padding included) ends:
    prev's type does not match those bytes (when they are the size of another type's data of its shape), or
    the two tensors' data overlap, or leave a gap."""
    import gguf
    shape = list(reversed([int(n) for n in prev.shape]))
    fits = [q.name for q, (block, size) in gguf.GGML_QUANT_SIZES.items()
            if prev.n_elements % block == 0 and given - align < prev.n_elements // block * size <= given]
    if fits:
        return (f"tensor {prev.name} is labelled {prev.tensor_type.name} {shape} ({int(prev.n_bytes)} bytes) but "
                f"is given {given} bytes, the size of {' or '.join(fits)} data of that shape: its type does not "
                f"match its bytes")
    if given < int(prev.n_bytes):
        return f"the data of tensors {prev.name} and {t.name} overlap ({t.name} starts {given} bytes into {prev.name})"
    return f"{given - int(prev.n_bytes)} bytes lie between the data of tensors {prev.name} and {t.name}"


def tensors_of(reader, path: Path, progress: bool = False, blocks: bool = False
               ) -> tuple[dict[str, np.ndarray], dict[str, str], int]:
    """(GGUF name -> array in numpy order ([out, in] for matrices), GGUF name -> source type, the bytes all
    tensors take in the file). Every tensor float32 (dequantized); with `blocks`, a matrix of a block type
    decoding reads (infer/quant.py: Q8_0 ... Q6_K) stays its blocks, void records [out, in / block] viewing
    the mapped file, and an F16 one float16 (a model to decode as the file is, never expanded). A NaN or Inf
    weight is refused where it is dequantized, naming its tensor."""
    import gguf
    from tqdm import tqdm

    from ..infer.quant import block_types, of_gguf
    out, types = {}, {}
    for t in tqdm(reader.tensors, desc="dequantize", disable=not progress):
        shape = tuple(reversed([int(n) for n in t.shape]))
        w = of_gguf(t.tensor_type.name)   # the weight type of this name (never of this size), or None
        types[t.name] = t.tensor_type.name
        if blocks and len(shape) == 2 and w is not None and w.name in block_types():
            out[t.name] = t.data.reshape(shape[0], -1).view(w.dtype)  # [out, in / block] (mapped)
            continue
        if blocks and len(shape) == 2 and t.tensor_type.name == "F16":
            out[t.name] = np.asarray(t.data, np.float16).reshape(shape)
            continue
        try:
            with np.errstate(all="ignore"):  # a damaged scale (inf · 0): refused below, by name, not warned of
                a = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape)
        except (NotImplementedError, ValueError) as e:
            raise UserError(f"{path}: tensor {t.name} ({t.tensor_type.name}) cannot be read ({str(e)[:100]})") from None
        out[t.name] = np.ascontiguousarray(a, dtype=np.float32)
        bad = out[t.name].size - np.count_nonzero(np.isfinite(out[t.name]))
        if bad:
            raise UserError(f"{path}: tensor {t.name} ({t.tensor_type.name}) holds {bad} NaN/Inf value(s); the "
                            f"file's weights are damaged")
    return out, types, sum(int(t.n_bytes) for t in reader.tensors)


def logical_shape(a: np.ndarray) -> tuple[int, ...]:
    """The shape of the weights an array holds: a matrix of blocks (records of its type) holds block weights a
    record.  logical_shape(np.zeros((3, 2), WTYPES["q8_0"].dtype)) -> (3, 64)"""
    if a.dtype.kind != "V":
        return a.shape
    from ..infer.quant import of_dtype
    return (*a.shape[:-1], a.shape[-1] * of_dtype(a.dtype).block)


# ----------------------------------------------------------------------------------------- tokenizer

def hf_dict(meta: dict) -> tuple[dict, int | None]:
    """The tokenizer.ggml.* fields of a byte-level BPE (model gpt2) -> (the equivalent Hugging Face
    tokenizer.json dict, eos id), so that one code path (hf_tokenizer.from_hf_json) builds both importers'
    Tokenizers."""
    tokens, merges = meta.get("tokenizer.ggml.tokens"), meta.get("tokenizer.ggml.merges")
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens or [])
    if not isinstance(tokens, list) or not isinstance(merges, list) or not all(isinstance(s, str) for s in tokens):
        raise UserError("GGUF metadata tokenizer.ggml.tokens / tokenizer.ggml.merges are missing or not string lists")
    if len(types) != len(tokens):
        raise UserError(f"tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
    from ..tokenizer.pretokenize import hf_splits
    pattern, ignore_merges, bos_default = pre_pattern(meta.get("tokenizer.ggml.pre"))
    vocab, added = {}, []
    # the bos / eos the metadata names are specials even where the file types them NORMAL (Aquila's eos), unless
    # a merge makes them
    named = {meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "eot", "eom")}
    named = {i for i in named if type(i) is int and 0 <= i < len(tokens) and types[i] == NORMAL}
    if named:
        made = {m.replace(" ", "", 1) for m in merges if isinstance(m, str)}
        named = {i for i in named if tokens[i] not in made}
    for i, (s, ty) in enumerate(zip(tokens, types)):
        if ty in (CONTROL, USER_DEFINED, UNKNOWN) or i in named:
            added.append({"id": i, "content": s, "special": ty != USER_DEFINED})
        elif ty != UNUSED:
            if s in vocab:
                raise UserError(f"tokenizer.ggml.tokens: {s!r} is both token {vocab[s]} and token {i}")
            vocab[s] = i
    bos = meta.get("tokenizer.ggml.bos_token_id")
    post = None
    if bool(meta.get("tokenizer.ggml.add_bos_token", bos_default)) and bos is not None:
        b = {"SpecialToken": {"id": "bos", "type_id": 0}}
        post = {"type": "TemplateProcessing", "single": [b, {"Sequence": {"id": "A", "type_id": 0}}],
                "special_tokens": {"bos": {"id": "bos", "ids": [bos], "tokens": ["bos"]}}}
    d = {"model": {"type": "BPE", "vocab": vocab, "merges": merges, "ignore_merges": ignore_merges},
         "added_tokens": added, "decoder": {"type": "ByteLevel"}, "post_processor": post,
         "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
             *hf_splits(pattern),
             {"type": "ByteLevel", "add_prefix_space": False, "use_regex": False}]}}
    return d, meta.get("tokenizer.ggml.eos_token_id")


def spm_tokenizer(meta: dict, vocab_size: int):
    """The tokenizer.ggml.* fields of a SentencePiece BPE (model llama) -> our SentencePieceTokenizer, read as
    llama.cpp's llama_vocab::load reads them (scores 0 and NORMAL types when absent, add_space_prefix and
    add_bos_token true unless the file says false, bos 1 and eos 2 unless it names others)."""
    from ..tokenizer.sentencepiece import NORMAL, UNUSED, SentencePieceTokenizer
    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not all(isinstance(s, str) for s in tokens):
        raise UserError("GGUF metadata tokenizer.ggml.tokens is missing or not a list of strings")
    n = len(tokens)
    scores = per_token(meta, "tokenizer.ggml.scores", n, "iuf", 0.0)
    types = per_token(meta, "tokenizer.ggml.token_type", n, "iu", NORMAL)
    tokens = [t or f"[EMPTY_{i}]" for i, t in enumerate(tokens)]   # as llama.cpp names an empty token
    # embedding rows no token names: reserved tokens (UNUSED: never cut out of text; no merge makes them)
    tokens += [f"<|reserved_{i}|>" for i in range(n, vocab_size)]
    scores = np.concatenate([scores, np.zeros(vocab_size - n)])
    types = np.concatenate([types, np.full(vocab_size - n, UNUSED)])
    ids = {}
    for key, default in (("bos", 1), ("eos", 2)):
        i = meta.get(f"tokenizer.ggml.{key}_token_id", default)
        ids[key] = i if isinstance(i, int) and 0 <= i < n else None
    add_bos = meta.get("tokenizer.ggml.add_bos_token", True)
    prefix = "every" if meta.get("tokenizer.ggml.add_space_prefix", True) else "none"
    names = {k: tokens[i] if i is not None else None for k, i in ids.items()}
    return SentencePieceTokenizer(tokens, types, scores, prefix=prefix, eos=names["eos"],
                                  bos=names["bos"] if add_bos else None)


def gemma4_tokenizer(meta: dict, vocab_size: int):
    """The tokenizer.ggml.* fields of Gemma 4's BPE (model gemma4) -> our SentencePieceTokenizer, as llama.cpp
    runs it: merges by rank ("a b" strings, each of two tokens making a token), spaces as "▁" with none put in
    front, runs of newlines cut apart (`newlines`), bos always added (llama.cpp overrides add_bos_token)."""
    from ..tokenizer.sentencepiece import NORMAL, UNUSED, Pieces, SentencePieceTokenizer, merge_ids
    tokens, merges = meta.get("tokenizer.ggml.tokens"), meta.get("tokenizer.ggml.merges")
    if not isinstance(tokens, list) or not set(map(type, tokens)) <= {str}:     # (no Python work per token)
        raise UserError("GGUF metadata tokenizer.ggml.tokens is missing or not a list of strings")
    if not isinstance(merges, list) or not set(map(type, merges)) <= {str}:
        raise UserError("GGUF metadata tokenizer.ggml.merges is missing or not a list of strings")
    n = len(tokens)
    types = per_token(meta, "tokenizer.ggml.token_type", n, "iu", NORMAL)
    if not all(tokens):
        tokens = [t or f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
    tokens = Pieces.of(tokens + [f"<|reserved_{i}|>" for i in range(n, vocab_size)])   # encoded once, shared below
    types = np.concatenate([types, np.full(vocab_size - n, UNUSED)])
    try:
        pairs = merge_ids(tokens, merges)
    except UserError as e:
        raise UserError(f"GGUF metadata tokenizer.ggml.merges: {e}") from None
    name = {}
    for key in ("bos", "eos"):
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        name[key] = tokens[i] if i is not None and 0 <= i < n else None
    return SentencePieceTokenizer(tokens, types, merges=pairs, prefix="none", eos=name["eos"], bos=name["bos"],
                                  newlines=True)


def wpm_tokenizer(meta: dict, vocab_size: int):
    """The tokenizer.ggml.* fields of a WordPiece vocabulary (model bert) -> our WordPieceTokenizer, read as
    llama.cpp reads them: "▁" before a word's first piece, unknown 100, bos ([CLS]) 101 and sep ([SEP]) 102
    unless the file names others, add_bos_token and add_sep_token true, lowercase true and strip_accents as
    lowercase unless the file says otherwise."""
    from ..tokenizer.sentencepiece import NORMAL, UNUSED
    from ..tokenizer.wordpiece import WordPieceTokenizer
    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not all(isinstance(s, str) for s in tokens):
        raise UserError("GGUF metadata tokenizer.ggml.tokens is missing or not a list of strings")
    n = len(tokens)
    types = per_token(meta, "tokenizer.ggml.token_type", n, "iu", NORMAL)
    tokens = [t or f"[EMPTY_{i}]" for i, t in enumerate(tokens)] + [f"<|reserved_{i}|>" for i in range(n, vocab_size)]
    types = np.concatenate([types, np.full(vocab_size - n, UNUSED)])
    name = {}
    for key, default in (("unknown", 100), ("bos", 101), ("seperator", 102)):
        i = meta.get(f"tokenizer.ggml.{key}_token_id", default)
        name[key] = tokens[i] if 0 <= i < n else None
    if name["unknown"] is None:
        raise UserError("GGUF tokenizer: a WordPiece vocabulary needs an unknown token (tokenizer.ggml.unknown_token_id)")
    lowercase = meta.get("tokenizer.ggml.normalizer.lowercase", True)
    add_bos = meta.get("tokenizer.ggml.add_bos_token", True)
    add_sep = meta.get("tokenizer.ggml.add_sep_token", True) and name["seperator"] is not None
    return WordPieceTokenizer(tokens, types, name["unknown"], "llama.cpp", word_prefix="▁", continuation="",
                              lowercase=lowercase,
                              strip_accents=meta.get("tokenizer.ggml.normalizer.strip_accents", lowercase),
                              bos=name["bos"] if add_bos else None, eos=name["seperator"], add_eos=add_sep)


def ugm_tokenizer(meta: dict, vocab_size: int):
    """The tokenizer.ggml.* fields of a Unigram vocabulary (model t5) -> our UnigramTokenizer, read as llama.cpp
    reads them: scores, types, the precompiled charsmap (bytes), unknown 2 and eos 1 unless the file names
    others, add_bos_token false and add_eos_token true, add_space_prefix and remove_extra_whitespaces false,
    unless the file says otherwise."""
    from ..tokenizer.sentencepiece import NORMAL, UNUSED
    from ..tokenizer.unigram import UnigramTokenizer
    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not all(isinstance(s, str) for s in tokens):
        raise UserError("GGUF metadata tokenizer.ggml.tokens is missing or not a list of strings")
    n = len(tokens)
    scores = per_token(meta, "tokenizer.ggml.scores", n, "iuf", 0.0)
    types = per_token(meta, "tokenizer.ggml.token_type", n, "iu", NORMAL)
    tokens = [t or f"[EMPTY_{i}]" for i, t in enumerate(tokens)] + [f"<|reserved_{i}|>" for i in range(n, vocab_size)]
    scores = np.concatenate([scores.astype(np.float32), np.zeros(vocab_size - n, np.float32)])
    types = np.concatenate([types, np.full(vocab_size - n, UNUSED)])
    charsmap = meta.get("tokenizer.ggml.precompiled_charsmap")
    if charsmap is not None:
        arr = np.array(charsmap) if charsmap else np.zeros(0, np.int64)
        if arr.ndim != 1 or arr.dtype.kind not in "iu" or arr.size and (arr.min() < -128 or arr.max() > 255):
            raise UserError("GGUF metadata tokenizer.ggml.precompiled_charsmap must be an array of bytes")
        charsmap = arr.astype(np.uint8).tobytes() if arr.size else None
    name = {}
    for key, default in (("unknown", 2), ("bos", None), ("eos", 1)):
        i = meta.get(f"tokenizer.ggml.{key}_token_id", default)
        name[key] = tokens[i] if i is not None and 0 <= i < n else None
    if name["unknown"] is None:
        raise UserError("GGUF tokenizer: a Unigram vocabulary needs an unknown token (tokenizer.ggml.unknown_token_id)")
    add_bos = meta.get("tokenizer.ggml.add_bos_token", False) and name["bos"] is not None
    add_eos = meta.get("tokenizer.ggml.add_eos_token", True) and name["eos"] is not None
    return UnigramTokenizer(tokens, types, scores, name["unknown"], "llama.cpp", charsmap,
                            add_space_prefix=meta.get("tokenizer.ggml.add_space_prefix", False),
                            merge_spaces=meta.get("tokenizer.ggml.remove_extra_whitespaces", False),
                            bos=name["bos"] if add_bos else None, eos=name["eos"], add_eos=add_eos)


def per_token(meta: dict, key: str, n: int, kinds: str, default) -> np.ndarray:
    """meta[key] as an array of n numbers of a dtype kind in kinds (default everywhere when absent)."""
    values = meta.get(key)
    if values is None:
        return np.full(n, default)
    arr = np.array(values) if isinstance(values, list) else np.zeros(0)
    if arr.shape != (n,) or n and arr.dtype.kind not in kinds:
        raise UserError(f"GGUF metadata {key} must be {n} numbers, one per token")
    if arr.dtype.kind == "f" and not np.isfinite(arr).all():
        raise UserError(f"GGUF metadata {key} holds {arr.size - np.count_nonzero(np.isfinite(arr))} NaN/Inf "
                        f"value(s) (token {int(np.flatnonzero(~np.isfinite(arr))[0])} first); the file is damaged")
    return arr


def check_vocabulary(meta: dict, tensors) -> None:
    """Refuse, before any tensor is read, a vocabulary with more tokens than the embedding has rows."""
    n = len(meta.get("tokenizer.ggml.tokens") or [])
    rows = next((int(t.shape[1]) for t in tensors if t.name == "token_embd.weight" and len(t.shape) == 2), None)
    if rows is not None and n > rows:
        raise UserError(f"GGUF tokenizer: {n:,} tokens, more than the model's {rows:,} embedding rows")


def check_tokenizer_kinds(meta: dict) -> None:
    """Each tokenizer key holds a value of its kind (TOKENIZER_KINDS; an id: a non-negative integer), or UserError.
    check_tokenizer_kinds({"tokenizer.ggml.pre": ["gpt-2"]}) -> UserError (an array where a name belongs)"""
    for key, value in meta.items():
        if key.startswith("tokenizer.ggml.") and key.endswith("_token_id"):
            field(meta, key)
            continue
        kind, what = TOKENIZER_KINDS.get(key, (object, ""))
        if not isinstance(value, kind):
            raise UserError(f"GGUF metadata {key} = {value!r:.40} is not {what}")


def gguf_tokenizer(meta: dict, vocab_size: int):
    """Our Tokenizer with the file's ids, chat template and every end-of-generation id llama.cpp would stop at
    (eos, eot, eom, FIM_EOG, EOG_TEXTS; where llama.cpp keeps one of several FIM texts, all are kept)."""
    from .hf_tokenizer import from_hf_json
    from ..config import LIMITS
    check_tokenizer_kinds(meta)
    model, tokens = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.tokens")
    if model not in TOKENIZER_MODELS:
        what = f" ({OTHER_MODELS[model]})" if model in OTHER_MODELS else ""
        raise UserError(f"GGUF tokenizer.ggml.model {model!r:.40}{what} is not supported; supported: "
                        f"{', '.join(f'{k} ({v})' for k, v in TOKENIZER_MODELS.items())}")
    n = len(tokens) if isinstance(tokens, list) else 0
    if n > min(vocab_size, LIMITS["vocab_size"]):
        raise UserError(f"GGUF tokenizer: {n:,} tokens, more than the model's {vocab_size:,} embedding rows"
                        if n > vocab_size else f"GGUF tokenizer: {n:,} tokens, more than the "
                        f"{LIMITS['vocab_size']:,} a vocabulary may have")
    try:
        if model == "llama":
            tok = spm_tokenizer(meta, vocab_size)
        elif model == "bert":
            tok = wpm_tokenizer(meta, vocab_size)
        elif model == "t5":
            tok = ugm_tokenizer(meta, vocab_size)
        elif model == "gemma4":
            tok = gemma4_tokenizer(meta, vocab_size)
        else:
            d, eos = hf_dict(meta)
            tok = from_hf_json(d, vocab_size, eos)
    except UserError as e:
        raise UserError(f"GGUF tokenizer: {str(e).removeprefix('tokenizer.json: ').removeprefix('tokenizer: ')}") from None
    inverse = {i: s for s, i in tok.special_tokens.items()}
    stops = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        i = meta.get(key)
        if i is not None:
            if i not in inverse:
                raise UserError(f"GGUF metadata {key} = {i!r:.40} is not a special token of the vocabulary")
            stops.append(inverse[i])
    for key, texts in FIM_EOG.items():
        i = meta.get(key)
        stops += [inverse[i]] if i in inverse else [t for t in texts if t in tok.special_tokens]
    stops += [t for t in EOG_TEXTS if t in tok.special_tokens]
    template = meta.get("tokenizer.chat_template")
    stops = [s for s in dict.fromkeys(stops) if s != tok.eos_token]
    return tok.replace(chat_template=template, stops=stops)


# -------------------------------------------------------------------------------------- architectures

# Every other RoPE-scaling key llama.cpp reads (src/llama-arch.cpp LLM_KV_ROPE_*, read in llama-model.cpp and
# applied in llama-context.cpp), each with the values that leave RoPE as a linear factor scales it (what
# llama.cpp assumes when the key is absent, or what computes the same): any other value is refused by name.
# (The linear factor itself, rope.scaling.factor / rope.scale_linear, and yarn's: gguf_rope_fields, which reads
# the keys of YARN_KEYS where the type is yarn.) None: the model's own context_length (llama.cpp's default for
# the original context). The yarn_* keys are written by llama.cpp's converter but not read by llama.cpp (its
# defaults: ext factor 1 for yarn, beta_fast 32, beta_slow 1, its own attention factor): other values are refused
# (yarn_attn_factor: one other than the factor llama.cpp computes, gguf_rope_fields).
ROPE_SCALING = {
    "rope.scaling.type": ("none", "linear", "yarn", "longrope"),   # linear: llama.cpp's default type
    "rope.scaling.attn_factor": (1,),
    "rope.scaling.alpha": (0,),
    "rope.scaling.original_context_length": None,
    "rope.scaling.yarn_log_multiplier": (0,),
    "rope.scaling.yarn_ext_factor": (-1, 0),     # -1 = unset
    "rope.scaling.yarn_attn_factor": (1,),
    "rope.scaling.yarn_beta_fast": (32,),
    "rope.scaling.yarn_beta_slow": (1,),
}
YARN_KEYS = ("rope.scaling.attn_factor", "rope.scaling.original_context_length", "rope.scaling.yarn_attn_factor")
LONGROPE_TENSORS = ("rope_factors_short.weight", "rope_factors_long.weight")   # (Format.rope_long_short)
# what else an architecture's file may say that our model does not compute, with its values that change nothing
# (a window: gguf_config, by architecture)
UNSUPPORTED = {"expert_count": (0, 1), "attention.clamp_kqv": (0,), "logit_scale": (1,),
               "final_logit_softcapping": (0,), "attn_logit_softcapping": (0,)}


def refuse_unsupported(meta: dict, arch: str, read=()) -> None:
    """UserError naming the first key of ROPE_SCALING or UNSUPPORTED the file sets to a value that is not neutral
    (but those of `read`, which the architecture's Config reads: Granite's logit_scale).

        refuse_unsupported({"llama.rope.scale_linear": 4.0}, "llama")
        # UserError: GGUF metadata llama.rope.scale_linear = 4.0 is not supported (RoPE scaling; ...)
    """
    for table, what in ((ROPE_SCALING, " (RoPE scaling: linear, llama3, yarn, phi3's longrope only)"),
                        (UNSUPPORTED, "")):
        for key, neutral in table.items():
            if key in read:
                continue
            value = meta.get(f"{arch}.{key}")
            if neutral is None:
                neutral = (meta.get(f"{arch}.context_length"),)
            if value is not None and (isinstance(value, bool) or value not in neutral):
                shown = float(str(np.float32(value))) if isinstance(value, float) else value   # as written
                raise UserError(f"GGUF metadata {arch}.{key} = {shown!r:.40} is not supported{what}")


def gguf_rope_fields(meta: dict, a: str, rope_freqs, rope_dims: int, theta: float) -> dict:
    """The RoPE scaling llama.cpp applies to the file's global layers -> the Config's fields ({} for none): a linear
    factor (rope.scaling.factor, or where it is absent the older rope.scale_linear, as llama.cpp reads them), or
    the divisors of each turned pair's frequency in a `rope_freqs` tensor [rope_dims/2] (what llama.cpp's
    converter writes for Llama 3.x):
    llama3 scaling where they are llama3's of Llama 3.1's parameters (low / high freq factors 1 / 4, original
    context 8192; the factor: the largest divisor), else the divisors as they are ("factors"); or yarn (type yarn:
    the factor, rope.scaling.original_context_length, default context_length, and the attention factor llama.cpp
    computes, 1 + 0.1·ln(factor) times rope.scaling.attn_factor)."""
    key = f"{a}.rope.scaling.factor" if f"{a}.rope.scaling.factor" in meta else f"{a}.rope.scale_linear"
    factor = field(meta, key, float, 0.0)   # 0: unset
    if meta.get(f"{a}.rope.scaling.type") == "yarn":
        if rope_freqs is not None:
            raise UserError("GGUF: tensor rope_freqs.weight beside yarn RoPE scaling is not supported")
        if factor in (0.0, 1.0):   # (llama.cpp: a ramp between equal frequencies, attention factor 1)
            return {}
        ctx = field(meta, f"{a}.rope.scaling.original_context_length", int, field(meta, f"{a}.context_length"))
        m = (1 + 0.1 * math.log(factor)) * field(meta, f"{a}.rope.scaling.attn_factor", float, 1.0)
        stated = field(meta, f"{a}.rope.scaling.yarn_attn_factor", float, m)   # (transformers' attention_factor)
        if not math.isclose(stated, m, rel_tol=1e-6):
            raise UserError(f"GGUF metadata {a}.rope.scaling.yarn_attn_factor = {stated} is not supported: "
                            f"llama.cpp computes {float(np.float32(m)):.7g} whatever the file says")
        return {"rope_scaling": "yarn", "rope_factor": factor, "rope_original_ctx": ctx, "rope_attn_factor": m}
    linear = {"rope_scaling": "linear", "rope_factor": factor} if factor not in (0.0, 1.0) else {}
    if rope_freqs is None:
        return linear
    if np.ndim(rope_freqs) != 1:   # one row, as llama.cpp creates it
        raise UserError(f"tensor rope_freqs.weight: shape {list(np.shape(rope_freqs))} ({rope_dims} turned dimensions "
                        f"want [{rope_dims // 2}]); not supported")
    f = np.asarray(rope_freqs, np.float64)
    if linear or f.size != rope_dims // 2 or not np.all(np.isfinite(f) & (f > 0)):
        raise UserError(f"tensor rope_freqs.weight: {f.size} factors ({rope_dims} turned dimensions want "
                        f"{rope_dims // 2} finite ones > 0){', beside a linear factor' if linear else ''}; not supported")
    if np.all(f == 1.0):
        return {}
    llama3 = {"rope_scaling": "llama3", "rope_factor": float(str(np.float32(f.max())))}   # as written (8.0)
    if np.allclose(llama3_factors(inv_freq(rope_dims, theta), llama3["rope_factor"], 1.0, 4.0, 8192), f, rtol=1e-6):
        return llama3
    return {"rope_scaling": "factors", "rope_freq_factors": tuple(f.tolist())}


def gguf_longrope_fields(meta: dict, a: str, tensors: dict, rope_dims: int, fields: dict) -> dict:
    """LongRoPE as llama.cpp's phi3 reads it -> the Config's fields ({} without its tensors): the short and long
    factors [rope_dims/2: one per turned pair] (chosen by the context the model runs at, Config.rope_factors), the
    attention factor rope.scaling.attn_factor (default 1) and the factor context_length / original context (what
    transformers takes where config.json names none, and what llama.cpp's converter derives the attention factor
    from)."""
    short, long = (tensors.get(name) for name in LONGROPE_TENSORS)
    if short is None and long is None:
        if meta.get(f"{a}.rope.scaling.attn_factor", 1) != 1:
            raise UserError(f"GGUF metadata {a}.rope.scaling.attn_factor without LongRoPE's factor tensors is "
                            f"not supported")
        return {}
    for name, f in zip(LONGROPE_TENSORS, (short, long)):
        if f is None or np.shape(f) != (rope_dims // 2,):
            raise UserError(f"tensor {name}: shape {list(np.shape(f)) if f is not None else 'missing'} ({rope_dims} "
                            f"turned dimensions want [{rope_dims // 2}]); not supported")
    ctx = fields["ctx_len"]
    orig = fields.setdefault("rope_original_ctx", ctx)   # (absent: llama.cpp's original context is context_length)
    out = {"rope_scaling": "longrope", "rope_freq_factors": tuple(np.asarray(short, np.float64).tolist()),
           "rope_long_factors": tuple(np.asarray(long, np.float64).tolist()), "rope_factor": ctx / orig}
    attn = field(meta, f"{a}.rope.scaling.attn_factor", float, 1.0)
    derived = math.sqrt(1 + math.log(ctx / orig) / math.log(orig)) if ctx > orig else 1.0
    if np.float32(attn) != np.float32(derived):   # (the converter's, in float32: the Config derives it exactly)
        out["rope_attn_factor"] = attn
    return out


def gguf_config(meta: dict, arch, tensors: dict):
    """The `{arch}.*` hyperparameters -> our Config (one head). What llama.cpp fixes per architecture rather than
    reads (Gemma 3's window pattern and local RoPE base) are the architecture's defaults (arch.py); a depth at
    which it scales attention otherwise than we would is refused (gguf_export.attention_scale_mismatch)."""
    from ..config import DEFAULTS, Config
    from .gguf_export import attention_scale_mismatch
    a = arch.gguf.name
    read = {key: ours for ours, (key,) in arch.gguf.config.items()}   # Config numbers under `{a}.` (Granite's)
    yarn = YARN_KEYS if meta.get(f"{a}.rope.scaling.type") == "yarn" else ()   # (read by gguf_rope_fields)
    longrope = ("rope.scaling.attn_factor",) if arch.gguf.rope_long_short else ()   # (gguf_longrope_fields)
    refuse_unsupported(meta, a, {*read, *yarn, *longrope})
    window = field(meta, f"{a}.attention.sliding_window", default=0)
    if not arch.gguf.reads_window:   # llama.cpp's phi3 / starcoder2 attend over every position whatever the file
        window = 0                   # says (its converter writes Phi-3-mini's 2047): so does the import
    if window and arch.defaults.get("sliding_window") is None:   # (llama.cpp's llama / qwen2: no window at all)
        raise UserError(f"GGUF metadata {a}.attention.sliding_window = {window} is not supported for {a}")
    heads = field(meta, f"{a}.attention.head_count")
    dim = field(meta, f"{a}.embedding_length")
    hd = field(meta, f"{a}.attention.key_length", default=dim // heads if heads else 0)
    if arch.gguf.heads_fill_dim and heads and hd * heads != dim:   # (llama.cpp: its q, output tensors' shapes)
        raise UserError(f"GGUF metadata {a}.attention.key_length = {hd}: llama.cpp's {a} makes heads dim / "
                        f"head_count = {dim}/{heads} wide; it cannot load this file")
    turned = field(meta, f"{a}.rope.dimension_count", default=hd) if arch.positions == "rope" else hd
    for key, value in ((f"{a}.attention.value_length", field(meta, f"{a}.attention.value_length", default=hd)),
                       (f"{a}.rope.dimension_count", turned)):   # (part of each head turns where the family's does)
        if value != hd and not (key.endswith("dimension_count") and "partial_rotary_factor" in arch.defaults):
            raise UserError(f"GGUF metadata {key} = {meta[key]} differs from the head size {hd}; not supported")
    eps_key = "layer_norm_rms_epsilon" if arch.norm == "rms" else "layer_norm_epsilon"
    fields = dict(vocab_size=tensors["token_embd.weight"].shape[0], dim=dim, n_heads=heads,
                  n_kv_heads=field(meta, f"{a}.attention.head_count_kv", default=heads),
                  n_layers=field(meta, f"{a}.block_count"), ctx_len=field(meta, f"{a}.context_length"),
                  ffn_hidden=field(meta, f"{a}.feed_forward_length"), n_mtp=1, arch=arch.name,
                  norm_eps=field(meta, f"{a}.attention.{eps_key}", float), head_dim=hd,
                  tie_embeddings="output.weight" not in tensors   # (gemma2's table has no output: llama.cpp's
                  or not any(e.ours == ("heads.0.weight",) for e in arch.gguf.globals_)   # head is the embedding)
                  or arch.gguf.head_required and same_tensor(tensors["output.weight"], tensors["token_embd.weight"]))
    fields |= arch.gguf.fixed   # what llama.cpp fixes rather than reads (smollm3's layer without RoPE every 4th)
    for key, ours in read.items():   # (an integer where the Config's is: Phi-3's original context)
        if type(DEFAULTS.get(ours)) is bool:   # a flag llama.cpp requires (gptneox's use_parallel_residual)
            fields[ours] = field(meta, f"{a}.{key}", bool)
            continue
        kind = int if type(DEFAULTS.get(ours)) is int else float
        value = field(meta, f"{a}.{key}", kind, 0)   # 0 or absent: llama.cpp's default (1; attention: 1/√hd)
        if value:
            fields[ours] = value
    if arch.positions == "rope":
        fields["partial_rotary_factor"] = turned / hd if hd else 1.0
        fields["rope_theta"] = field(meta, f"{a}.rope.freq_base", float, 10000.0)   # llama.cpp's, every architecture
        freqs = tensors.get("rope_freqs.weight") if arch.gguf.rope_freqs else None   # (elsewhere: unexpected)
        fields |= gguf_rope_fields(meta, a, freqs, turned, fields["rope_theta"])
        if arch.gguf.rope_long_short:
            fields |= gguf_longrope_fields(meta, a, tensors, turned, fields)
    if window:  # the pattern and the windowed layers' RoPE base: the architecture's (llama.cpp's) unless stated
        fields["sliding_window"] = window
        fields["global_every"] = field(meta, f"{a}.attention.sliding_window_pattern", default=arch.defaults["global_every"])
        fields["rope_local_theta"] = field(meta, f"{a}.rope.freq_base_swa", float,   # (gemma2's default: the base)
                                           arch.defaults.get("rope_local_theta", fields["rope_theta"]))
    try:
        cfg = Config(**fields)
    except UserError as e:
        raise UserError(f"GGUF metadata: {e}") from None
    why = attention_scale_mismatch(cfg)
    if why:
        raise UserError(f"GGUF metadata: {why}; not supported")
    return cfg


def same_tensor(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two of the file's tensors hold the same values in the same type (an `output` that is the embedding's
    copy, written where llama.cpp requires one: Format.head_required); the first rows decide most cases unread."""
    return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a[:1], b[:1]) and np.array_equal(a, b)


def check_vocab_size(meta: dict, arch: str, rows: int) -> None:
    """{arch}.vocab_size, where the file states it (llama.cpp sizes the vocabulary by it): an integer, the
    embedding's number of rows. check_vocab_size({"llama.vocab_size": "320"}, "llama", 320) -> UserError"""
    n = field(meta, f"{arch}.vocab_size", default=rows)
    if n != rows:
        raise UserError(f"GGUF metadata {arch}.vocab_size = {n} disagrees with the {rows} rows of token_embd.weight")


def gguf_params(cfg, T: dict, reordered: bool = False) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """llama.cpp's tensors -> (our params, our name -> GGUF name), by the architecture's `gguf` table: several of
    ours cut out of one of theirs by rows (GPT-2's attn_qkv), q/k rows back from llama.cpp's interleaved RoPE
    order where it permutes them (`gguf_export.unpermute_qk`) and in ours where part of each head turns
    (hf.format_rows): a copy, or with `reordered` a matrix's rows taken where they lie (checkpoint.Reordered:
    decoding packs them from the file; Llama-3.2-1B's q and k, 85 MiB, are not held twice). A mapped file's
    blocks copied have their pages let go, as nothing reads them again. What it reads leaves T; a tensor of the
    wrong shape is a UserError naming it."""
    from ..checkpoint import Reordered, drop_pages
    from .gguf_export import unpermute_qk
    from .hf import format_rows
    fmt, shapes = cfg.spec.gguf, cfg.param_shapes()
    P, src = {}, {}
    for e in fmt.tensors(cfg.n_layers):
        ours = [n for n in e.ours if n in shapes]
        if not ours:   # output.weight of a tied model (where llama.cpp requires it: the embedding's copy)
            T.pop(e.name, None)
            continue
        if e.name not in T:
            raise UserError(f"tensor {e.name} is missing from the GGUF file")
        a = T.pop(e.name)
        want = (sum(shapes[n][0] for n in ours), *shapes[ours[0]][1:])
        if logical_shape(a) != want:
            raise UserError(f"tensor {e.name} has shape {list(logical_shape(a))}, expected {list(want)} from the "
                            "metadata")
        for n, part in zip(ours, np.split(a, np.cumsum([shapes[n][0] for n in ours])[:-1])):
            rows = np.arange(part.shape[0])[:, None]   # ours[i] = theirs[rows[i]]
            if fmt.permute_qk and n.endswith(("attn.wq.weight", "attn.wk.weight")):
                rows = unpermute_qk(rows, cfg.n_heads if "wq" in n else cfg.n_kv_heads)
            rows = format_rows(cfg, n, rows, inverse=True)[:, 0]   # (part of each head turning)
            if np.any(rows != np.arange(len(rows))):
                part = Reordered(part, rows) if reordered and part.ndim == 2 else part[rows]
            P[n], src[n] = part, e.name
        if any(isinstance(P[n], Reordered) or not np.may_share_memory(P[n], a) for n in ours):
            drop_pages([a])   # a mapped file's blocks read into a copy (q, k reordered): their pages let go
    return P, src


# ---------------------------------------------------------------------------------------------- import

def load_gguf(src: str | Path, n_mtp: int | None = None, progress: bool = False, blocks: bool = False):
    """A GGUF file -> (Config, params, Tokenizer, source) without writing anything; source is source.json's
    dict. MTP heads 1..K-1 (n_mtp = K) start as copies of head 0. params are float32 (a model to train, save,
    export), or with `blocks` each matrix as the file holds it where decoding reads its type (tensors_of: a
    model to decode, weights.QuantizedModel.from_blocks; q and k as a checkpoint.Reordered of the file's rows)."""
    from ..arch import ARCHS, by_format
    from ..checkpoint import Reordered
    from ..config import check_params, head_weight
    if n_mtp is not None and (not isinstance(n_mtp, int) or n_mtp < 1):
        raise UserError(f"--mtp must be a positive integer, got {n_mtp}")
    path = Path(src)
    reader = open_gguf(path)
    check_tensor_layout(reader, path)
    meta = metadata(reader, path)
    name = meta.get("general.architecture")
    arch = by_format("gguf", name) if isinstance(name, str) else None
    if arch is None:
        raise UserError(f"GGUF general.architecture {name!r:.60} is not supported; importable: "
                        f"{', '.join(dict.fromkeys(a.gguf.name for a in ARCHS.values()))}")
    check_vocabulary(meta, reader.tensors)
    T, types, nbytes = tensors_of(reader, path, progress, blocks)
    if "token_embd.weight" not in T:
        raise UserError("tensor token_embd.weight is missing from the GGUF file")
    check_vocab_size(meta, arch.gguf.name, T["token_embd.weight"].shape[0])
    cfg = gguf_config(meta, arch, T)
    if arch.gguf.rope_freqs:
        T.pop("rope_freqs.weight", None)    # read into cfg (gguf_rope_fields)
    if arch.gguf.rope_long_short:
        for name in LONGROPE_TENSORS:       # (gguf_longrope_fields)
            T.pop(name, None)
    params, src_names = gguf_params(cfg, T, reordered=blocks)
    if T:
        raise UserError(f"unexpected tensor {sorted(T)[0]} in the GGUF file (not part of a {name} model)")
    for k in range(1, n_mtp or 1):
        params[f"heads.{k}.weight"] = head_weight(params, 0).copy()
    cfg = cfg.replace(n_mtp=n_mtp or 1)
    tok = gguf_tokenizer(meta, cfg.vocab_size)
    params = {n: params[n] if isinstance(params[n], Reordered) else np.ascontiguousarray(params[n])
              for n in cfg.param_shapes()}
    if not blocks:
        check_params(cfg, params)
    source = {"format": "gguf", "file": path.name, "file_tensor_bytes": nbytes,
              "tensor_types": {n: types[g] for n, g in src_names.items() if n in params}}
    return cfg, params, tok, source


def import_gguf(src: str | Path, out: str | Path, n_mtp: int | None = None, force: bool = False,
                progress: bool = True):
    """Import the GGUF file src into the checkpoint directory out (whole or not at all): the weights in float32
    (to train, export, ...), and beside them the file's matrices as it held them (checkpoint.SOURCE_BLOCKS:
    decoding reads them without a float32 copy, `export --format gguf` writes them back byte for byte)."""
    from ..checkpoint import SOURCE_BLOCKS, SOURCE_FILE, json_writer, model_writers, save_files, tensors_writer
    from .outputs import check_free, output_dir
    check_free(out, force, inputs=[src])
    cfg, params, tok, source = load_gguf(src, n_mtp, progress)
    blocks = {n: np.asarray(a).view(np.uint8) if a.dtype.kind == "V" else np.asarray(a)   # (q, k: our row order)
              for n, a in load_gguf(src, n_mtp, blocks=True)[1].items()
              if n in source["tensor_types"] and (a.dtype.kind == "V" or a.dtype == np.float16)}
    with output_dir(out, force, inputs=[src]) as tmp:
        save_files(tmp, model_writers(cfg, params, tok) | ({SOURCE_BLOCKS: tensors_writer(blocks)} if blocks else {}))
        st = (tmp / "model.safetensors").stat()   # the weights the blocks belong to (checkpoint.source_blocks)
        save_files(tmp, {SOURCE_FILE: json_writer(source | {"weights": [st.st_size, st.st_mtime_ns]})})
    return cfg, params, tok
