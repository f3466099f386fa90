"""GPT-2's tokenizer files: vocab.json + merges.txt, as OpenAI's GPT-2 folders and GPT2Tokenizer have them.

A GPT-2 folder's weights and config.json are read and written by hf.py like every architecture's (arch.py's
gpt2 entry); what is GPT-2's own is its tokenizer's form. Token ids are GPT-2's, exactly: GPT-2 numbers the
bytes in the order of its byte-to-unicode table ('!' = 0, ..., 'Ġ' = byte 32 = 220; `gpt2_byte_order`),
then its 50,000 merges as 256 + i, then `<|endoftext|>` = 50256. The imported Tokenizer carries that
numbering (`tok.ids`, see tokenizer/tokenizer.py), so its encode gives the ids GPT2Tokenizer gives, and
wte's rows are kept in order. Export writes the tokenizer's ids back, so import -> export of OpenAI's folder
is the same folder (vocab.json, merges.txt, tensors); a GPT-2-architecture model trained here exports with
our numbering.
"""
from __future__ import annotations

import json
from pathlib import Path

from ..errors import UserError
from .hf_folder import read_json_file


def gpt2_byte_order() -> list[int]:
    """GPT-2's id order of the 256 bytes: the printable bytes of its byte-to-unicode table first, then the rest.
    gpt2_byte_order()[0] -> 33 ('!'), gpt2_byte_order().index(32) -> 220 (' ', shown as 'Ġ')"""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    return printable + [b for b in range(256) if b not in printable]


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


def write_gpt2_tokenizer(folder: Path, tok, ctx_len: int) -> None:
    """vocab.json, merges.txt, tokenizer.json and tokenizer_config.json of a GPT2Tokenizer (GPT-2's
    pre-tokenizer: the tokenizer must have its pattern)."""
    from ..tokenizer import GPT2_PATTERN
    if tok.kind != "byte-level" or tok.pattern != GPT2_PATTERN:
        raise UserError("a GPT-2 folder needs the GPT-2 pre-tokenizer pattern; this tokenizer has another one")
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
    tok_config = {"tokenizer_class": "GPT2Tokenizer", "model_max_length": ctx_len, "add_prefix_space": False,
                  "bos_token": eos_tok, "eos_token": eos_tok, "unk_token": eos_tok, "pad_token": None}
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
    (folder / "tokenizer.json").write_text(json.dumps(tok_json, ensure_ascii=False), encoding="utf-8")
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
