"""What every tokenizer kind offers its callers (chat templates, SFT masks, serve, prepare, the CLI), whatever
algorithm is behind it: byte-level BPE (`tokenizer.py`, ours and GPT-2 / Llama-3 / SmolLM / Qwen2 style),
SentencePiece-style BPE (`sentencepiece.py`, Llama-2 / Gemma style), WordPiece (`wordpiece.py`, BERT) or Unigram
(`unigram.py`, T5 / XLM-R style).

A kind implements `vocab_size`, `token_bytes(i)`, `encode_array(text, allow_special, add_bos)`,
`encode_bytes(data)`, `decode_bytes(ids)`, `to_dict()`, `from_dict(d)`, `vocab_text()`, `to_hf_json()`, and
sets `special_tokens` (string -> id), `eos_token`, `bos_token`, `stops` and `chat_template`; this class gives
the rest the same way for all: encode, decode, eos_id, bos_id, stop_ids, save, load, fingerprint.

`tokenizer.json` names its kind (`"kind": "sentencepiece"`); a file without the field is byte-level BPE, and
a byte-level tokenizer's file and fingerprint carry no kind. `Tokenizer.load` and
`Tokenizer.from_dict` (tokenizer.py) return the kind the file names.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from ..errors import UserError

KEEP = object()   # replace(): leave this field as it is


class BaseTokenizer:
    """The interface shared by the tokenizer kinds (see the module docstring)."""

    kind: str                       # "byte-level", "sentencepiece", "wordpiece" or "unigram"
    special_tokens: dict[str, int]
    eos_token: str | None
    bos_token: str | None
    stops: tuple[str, ...]
    chat_template: str | None

    # -- facts -----------------------------------------------------------------------------------------
    @property
    def eos_id(self) -> int:
        if self.eos_token not in self.special_tokens:
            raise UserError(f"this tokenizer has no {self.eos_token or 'end-of-text'} special token")
        return self.special_tokens[self.eos_token]

    @property
    def bos_id(self) -> int | None:
        """The id encode(..., add_bos=True) puts first; None when the tokenizer has no bos."""
        return None if self.bos_token is None else self.special_tokens[self.bos_token]

    @property
    def stop_ids(self) -> list[int]:
        """Every id that ends a reply: eos (when the vocabulary has it) and the stops."""
        ends = ([self.eos_token] if self.eos_token in self.special_tokens else []) + list(self.stops)
        return list(dict.fromkeys(self.special_tokens[t] for t in ends))

    def replace(self, chat_template=KEEP, stops=KEEP) -> BaseTokenizer:
        """This tokenizer with another chat template and / or stop tokens; the vocabulary and its tables are
        shared, nothing is rebuilt (a 262,144-token vocabulary takes a second to build)."""
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        if chat_template is not KEEP:
            if chat_template is not None and not isinstance(chat_template, str):
                raise UserError("a chat template must be a string (a Jinja template)")
            new.chat_template = chat_template
        if stops is not KEEP:
            new.stops = tuple(stops)
            for t in new.stops:
                if t not in self.special_tokens:
                    raise UserError(f"the stop token {t!r:.40} is not one of the special tokens")
        return new

    # -- text <-> ids ----------------------------------------------------------------------------------
    def encode(self, text: str, allow_special: bool = False, add_bos: bool = False) -> list[int]:
        """text -> ids. Special-token strings in text are ordinary text unless allow_special=True;
        add_bos=True puts the bos token first (if the tokenizer has one)."""
        return self.encode_array(text, allow_special, add_bos).tolist()

    def decode(self, ids) -> str:
        """ids -> text. Bytes that do not form UTF-8 (say ids that split a character) become U+FFFD."""
        return self.decode_bytes(ids).decode("utf-8", "replace")

    def check_ids(self, ids) -> np.ndarray:
        """ids as a flat integer array, each in range; else UserError."""
        ids = np.asarray(ids)
        if ids.size == 0:
            return ids.astype(np.int64).ravel()
        if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
            raise UserError("decode takes a flat sequence of integer token ids")
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= self.vocab_size:
            raise UserError(f"token id {lo if lo < 0 else hi} is out of range (vocabulary size {self.vocab_size})")
        return ids

    def hf_post_processor(self) -> dict | None:
        """The bos as Hugging Face writes it (Llama-3): a TemplateProcessing that puts it before each text."""
        if self.bos_token is None:
            return None
        b = self.bos_token
        tok = {"SpecialToken": {"id": b, "type_id": 0}}
        return {"type": "TemplateProcessing",
                "single": [tok, {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [tok, {"Sequence": {"id": "A", "type_id": 0}}, {"SpecialToken": {"id": b, "type_id": 1}},
                         {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {b: {"id": b, "ids": [self.bos_id], "tokens": [b]}}}

    # -- files -----------------------------------------------------------------------------------------
    def save(self, path: str | Path) -> None:
        """Write tokenizer.json (atomically) and a readable tokenizer.vocab beside it."""
        from ..fileio import atomic_write_json, atomic_write_text

        path = Path(path)
        atomic_write_json(path, self.to_dict())
        atomic_write_text(path.with_suffix(".vocab"), self.vocab_text())

    @classmethod
    def load(cls, path: str | Path) -> BaseTokenizer:
        """A tokenizer.json (or a folder holding one): cls.from_dict of its content."""
        path = Path(path)
        if path.is_dir():
            path = path / "tokenizer.json"
        try:
            d = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise UserError(f"tokenizer file not found: {path}") from None
        except (ValueError, RecursionError) as e:   # bad UTF-8 or JSON, or nested too deep
            raise UserError(f"{path} is not valid JSON ({e}); is it a tokenizer.json?") from None
        try:
            return cls.from_dict(d)
        except UserError as e:
            raise UserError(f"{path}: {e}") from None

    def fingerprint(self) -> str:
        """sha256 (hex) of the canonical content (the vocabulary and how text is cut and merged): equal
        tokenizers, equal prints; the chat template and stop tokens do not count."""
        content = {k: v for k, v in self.to_dict().items()
                   if k not in ("format", "version", "vocab_size", "chat_template", "stops")}
        canon = json.dumps(content, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
        return hashlib.sha256(canon.encode("ascii")).hexdigest()

    def __reduce__(self):  # copy / multiprocessing: rebuild from the readable content, not the caches
        return (type(self).from_dict, (self.to_dict(),))
