"""WordPiece: BERT's tokenizer, run as llama.cpp runs it (`llm_tokenizer_wpm`, GGUF `tokenizer.ggml.model =
bert`) or as Hugging Face `tokenizers` runs a BertNormalizer + BertPreTokenizer + WordPiece model.

How text becomes ids:

1. Special tokens are cut out of the text first (sentencepiece.split_specials, llama.cpp's order): USER_DEFINED
   tokens always, CONTROL and UNKNOWN ones (`[CLS]`, `[SEP]`, `[UNK]`) only with allow_special.
2. Each text fragment is normalized and cut into words, by one of two rules that agree on ordinary text:
   - "llama.cpp" (`llama_cpp_words`, llm_tokenizer_wpm_session::preprocess): with strip_accents each character
     becomes the first character of its NFD (é -> e, 가 -> ᄀ) and marks (\\p{M}) are dropped; control
     characters (Cc Cf Co Cs), NUL and U+FFFD are dropped; letters lowercased one to one (İ -> i);
   - "bert" (`bert_words`, Hugging Face's BertNormalizer): controls dropped except \\t \\n \\r, then with
     strip_accents the full NFD without its nonspacing marks (\\p{Mn}), then each character lowercased (İ ->
     i̇, no final sigma).
   Then whitespace ends a word, and each punctuation character (\\p{P}, or an ASCII symbol such as $ + < =),
   and each CJK ideograph, is a word by itself.
3. Each word, greedy longest match first (`wordpiece`): the longest token that starts the word, then the
   longest continuation token at the rest, ...; a word that cannot be cut all the way is the unknown token.
   The two vocabularies mark pieces differently: llama.cpp's GGUF puts "▁" before a word's first piece
   (`word_prefix`), Hugging Face's vocab.txt puts "##" before every other piece (`continuation`):

       llama.cpp: ▁un ##aff able -> "▁un" "aff" "able"      Hugging Face: "un" "##aff" "##able"
       word "unaffable" -> [▁un, aff, able] / [un, ##aff, ##able]

   Hugging Face also makes a word longer than `max_word_chars` (100) the unknown token; llama.cpp has no bound.
4. encode(..., add_bos=True) frames the ids with the bos (`[CLS]`) and, with add_eos, the eos (`[SEP]`), as
   llama.cpp's add_special and Hugging Face's BertProcessing do.

Decoding is lossy (cased letters and accents are gone): each piece without its mark, a word's first piece
after a space, special tokens as their text, the leading space dropped.
"""
from __future__ import annotations

import functools
import json
import sys
import unicodedata
from collections.abc import Iterable

import numpy as np
import regex

from ..errors import UserError
from .base import BaseTokenizer
from .sentencepiece import (CONTROL, NORMAL, TYPE_NAMES, UNKNOWN, UNUSED, USER_DEFINED, TypedVocab, check_vocab_size,
                            split_specials, typed_vocab_fields)

KIND = "wordpiece"
FORMAT, VERSION = "nanoeuler-wordpiece", 1
NORMALIZATIONS = ("llama.cpp", "bert")
CACHE_WORDS = 1 << 16       # words whose ids encode remembers (cleared when full)

# llama.cpp's whitespace (unicode.cpp's table: PropList's White_Space); Rust's char::is_whitespace is the same set
WHITESPACE = "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
CJK = ("\u4e00-\u9fff\u3400-\u4dbf\U00020000-\U0002a6df\U0002a700-\U0002b73f\U0002b740-\U0002b81f"
       "\U0002b920-\U0002ceaf\uf900-\ufaff\U0002f800-\U0002fa1f")   # 0x2B920, not 0x2B820: as both runtimes have it
ALONE = rf"[\p{{P}}$+<=>^`|~{CJK}]"      # a word by itself: punctuation, an ASCII symbol, a CJK ideograph
WORD = regex.compile(rf"{ALONE}|[^{WHITESPACE}\p{{P}}$+<=>^`|~{CJK}]+")
DROP_LLAMA = regex.compile(rf"(?:(?![{WHITESPACE}])[\x00\ufffd\p{{Cc}}\p{{Cf}}\p{{Co}}\p{{Cs}}])+")
DROP_LLAMA_MARKS = regex.compile(rf"(?:(?![{WHITESPACE}])[\x00\ufffd\p{{Cc}}\p{{Cf}}\p{{Co}}\p{{Cs}}\p{{M}}])+")
DROP_BERT = regex.compile(r"(?:(?![\t\n\r])[\x00\ufffd\p{Cc}\p{Cf}\p{Co}\p{Cs}])+")
NONSPACING = regex.compile(r"\p{Mn}+")


# ------------------------------------------------------------------------------------- normalization

@functools.cache
def first_of_nfd() -> dict[int, int]:
    """llama.cpp's NFD (unicode_cpts_normalize_nfd): each code point -> the first code point of its NFD, one for
    one.  first_of_nfd()[ord("é")] -> ord("e")"""
    out = {}
    for c in range(sys.maxunicode + 1):
        if unicodedata.decomposition(chr(c)) or 0xAC00 <= c <= 0xD7A3:   # Hangul decomposes by rule
            first = unicodedata.normalize("NFD", chr(c))[0]
            if first != chr(c):
                out[c] = ord(first)
    return out


@functools.cache
def lowercase_table(simple: bool) -> dict[int, str]:
    """Each character -> its lowercase alone (no final sigma): simple=True as llama.cpp's unicode_tolower (one
    code point: İ -> i), else as Rust's char::to_lowercase (İ -> i̇)."""
    out = {}
    for c in range(sys.maxunicode + 1):
        low = chr(c).lower()
        if low != chr(c):
            out[c] = low[0] if simple else low
    return out


def llama_cpp_words(text: str, lowercase: bool, strip_accents: bool) -> list[str]:
    """llama.cpp's WPM preprocess (module docstring, step 2).  llama_cpp_words("Héllo, 世界!", True, True) ->
    ['hello', ',', '世', '界', '!']"""
    if strip_accents:
        text = DROP_LLAMA_MARKS.sub("", text.translate(first_of_nfd()))
    else:
        text = DROP_LLAMA.sub("", text)
    if lowercase:
        text = text.translate(lowercase_table(True))
    return WORD.findall(text)


def bert_words(text: str, lowercase: bool, strip_accents: bool) -> list[str]:
    """Hugging Face's BertNormalizer (clean_text, handle_chinese_chars) then BertPreTokenizer.
    bert_words("Héllo, 世界!", True, True) -> ['hello', ',', '世', '界', '!']"""
    text = DROP_BERT.sub("", text)
    if strip_accents:
        text = NONSPACING.sub("", unicodedata.normalize("NFD", text))
    if lowercase:
        text = text.translate(lowercase_table(False))
    return WORD.findall(text)


def wordpiece(word: str, find, word_prefix: str, continuation: str, longest: int) -> list[int] | None:
    """Greedy longest-match-first cut of word into token ids (None: it cannot be cut). find(piece) -> id or -1;
    the first piece is looked up with word_prefix before it, the others with continuation; longest: the most
    characters a token has.

        ids = {"▁un": 1, "aff": 2, "able": 3, "a": 4}
        wordpiece("unaffable", lambda s: ids.get(s, -1), "▁", "", 8) -> [1, 2, 3]
    """
    s, out, at = word_prefix + word, [], 0
    while at < len(s):
        mark = continuation if at else ""
        for end in range(min(len(s), at + longest), at, -1):
            t = find(mark + s[at:end])
            if t >= 0:
                out.append(t)
                at = end
                break
        else:
            return None
    return out


# ------------------------------------------------------------------------------------------ tokenizer

class WordPieceTokenizer(TypedVocab, BaseTokenizer):
    """A WordPiece vocabulary (see the module docstring); ids are the vocabulary's order."""

    kind = KIND

    def __init__(self, tokens: list[str], types: Iterable[int], unk: str, normalization: str = "llama.cpp",
                 word_prefix: str = "▁", continuation: str = "", lowercase: bool = True, strip_accents: bool = True,
                 max_word_chars: int | None = None, bos: str | None = None, eos: str | None = None,
                 add_eos: bool = False, chat_template: str | None = None, stops: Iterable[str] = ()):
        """tokens: the piece of each id; types: its GGUF token type; unk: the token of a word that cannot be cut;
        normalization, lowercase, strip_accents: step 2; word_prefix, continuation, max_word_chars: step 3;
        bos, eos, add_eos: step 4 (eos is also the end of a text)."""
        if normalization not in NORMALIZATIONS:
            raise UserError(f"tokenizer.json: \"normalization\" must be one of {', '.join(NORMALIZATIONS)}, "
                            f"got {normalization!r:.40}")
        if bool(word_prefix) == bool(continuation):
            raise UserError("a WordPiece vocabulary marks either a word's first piece (\"▁\") or the pieces after "
                            "it (\"##\"): one of word_prefix and continuation, not both")
        if max_word_chars is not None and (type(max_word_chars) is not int or max_word_chars < 1):
            raise UserError(f"tokenizer.json: \"max_word_chars\" must be a positive integer, got {max_word_chars!r:.20}")
        self.tokens, self.types = list(tokens), np.asarray(types, np.int64)
        if self.types.shape != (len(self.tokens),) or not np.isin(self.types, list(TYPE_NAMES)).all():
            raise UserError(f"tokenizer: {len(self.tokens)} tokens need as many token types (1..5)")
        self.normalization, self.lowercase, self.strip_accents = normalization, bool(lowercase), bool(strip_accents)
        self.word_prefix, self.continuation, self.max_word_chars = word_prefix, continuation, max_word_chars
        self.bos_token, self.eos_token, self.add_eos = bos, eos, bool(add_eos)
        self.chat_template, self.stops, self.unk = chat_template, tuple(stops), unk
        self.ids = dict(zip(self.tokens, range(len(self.tokens))))
        if len(self.ids) != len(self.tokens):
            i = next(i for i, t in enumerate(self.tokens) if self.ids[t] != i)
            raise UserError(f"tokenizer: {self.tokens[i]!r:.40} is both token {i} and token {self.ids[self.tokens[i]]}")
        self.special_tokens = {self.tokens[i]: i for i in np.flatnonzero(self.types != NORMAL).tolist()}
        if unk not in self.ids:
            raise UserError(f"the unknown token {unk!r:.40} is not in the vocabulary")
        for what, t in (("bos", bos), ("eos", eos), *(("stop", s) for s in self.stops)):
            if t is not None and t not in self.special_tokens:
                raise UserError(f"the {what} token {t!r:.40} is not a special token of the vocabulary")
        if add_eos and eos is None:
            raise UserError("add_eos needs an eos token")
        self._longest = max((len(t) for t in self.tokens), default=1)
        self._splitters: dict[bool, list[tuple[bytes, int]]] = {}
        self._words: dict[str, list[int]] = {}

    def __repr__(self) -> str:
        return f"WordPieceTokenizer(vocab_size={self.vocab_size}, normalization={self.normalization!r})"

    # -- encoding -----------------------------------------------------------------------------------
    def encode_bytes(self, data: bytes) -> list[int]:
        """Any bytes -> ids (no special tokens): a byte that is not UTF-8 is dropped, as llama.cpp drops the U+FFFD
        it reads it as."""
        return self._encode(bytes(data), False)

    def _encode(self, data: bytes, allow_special: bool) -> list[int]:
        out: list[int] = []
        for f in split_specials(data, self._splitter(allow_special)):
            if isinstance(f, int):
                out.append(f)
            else:
                out += self._encode_text(f.decode("utf-8", "replace"))
        return out

    def _encode_text(self, text: str) -> list[int]:
        """Steps 2 and 3 on one text fragment."""
        cut = llama_cpp_words if self.normalization == "llama.cpp" else bert_words
        out, cache = [], self._words
        for word in cut(text, self.lowercase, self.strip_accents):
            ids = cache.get(word)
            if ids is None:
                if len(cache) >= CACHE_WORDS:
                    cache.clear()
                ids = cache[word] = self._word_ids(word)
            out += ids
        return out

    def _word_ids(self, word: str) -> list[int]:
        if self.max_word_chars is not None and len(word) > self.max_word_chars:
            return [self.ids[self.unk]]
        ids = wordpiece(word, lambda s: self.ids.get(s, -1), self.word_prefix, self.continuation, self._longest)
        return [self.ids[self.unk]] if ids is None else ids

    # -- decoding -----------------------------------------------------------------------------------
    def token_bytes(self, i: int) -> bytes:
        """The bytes token i decodes to: a word's first piece after a space, a continuation as it is, a special
        token as its text.  token_bytes(id of '▁the') -> b' the';  token_bytes(id of '##s') -> b's'"""
        if not 0 <= int(i) < self.vocab_size:
            raise UserError(f"token id {i} is out of range (vocabulary size {self.vocab_size})")
        t = self.tokens[int(i)]
        if self.types[int(i)] in (NORMAL, UNUSED):
            if self.word_prefix:
                t = " " + t[len(self.word_prefix):] if t.startswith(self.word_prefix) else t
            else:
                t = t[len(self.continuation):] if t.startswith(self.continuation) else " " + t
        return t.encode("utf-8", "surrogatepass")

    def decode_bytes(self, ids) -> bytes:
        """ids -> bytes: the pieces joined, the first one's leading space dropped."""
        out = b"".join(self.token_bytes(i) for i in self.check_ids(ids).tolist())
        return out[1:] if out[:1] == b" " else out

    # -- persistence --------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        """Our readable format: {"format", "version", "kind": "wordpiece", "tokens", "types", "unk", ...}."""
        d = {"format": FORMAT, "version": VERSION, "kind": KIND, "vocab_size": self.vocab_size,
             "tokens": self.tokens, "types": self.types.tolist(), "unk": self.unk,
             "normalization": self.normalization, "lowercase": self.lowercase, "strip_accents": self.strip_accents,
             "word_prefix": self.word_prefix, "continuation": self.continuation, "add_eos": self.add_eos}
        for key, value in (("max_word_chars", self.max_word_chars), ("bos", self.bos_token),
                           ("eos", self.eos_token), ("chat_template", self.chat_template)):
            if value is not None:
                d[key] = value
        if self.stops:
            d["stops"] = list(self.stops)
        return d

    @classmethod
    def from_dict(cls, d) -> WordPieceTokenizer:
        """Rebuild from to_dict() output, checking every field (a corrupt file gives a UserError)."""
        tokens, types, stops = typed_vocab_fields(
            d, KIND, "WordPiece", (FORMAT, VERSION),
            (("unk", str), ("normalization", str), ("word_prefix", str), ("continuation", str), ("lowercase", bool),
             ("strip_accents", bool), ("add_eos", bool), ("bos", str), ("eos", str), ("chat_template", str),
             ("max_word_chars", int)))
        tok = cls(tokens, types, d["unk"], d.get("normalization", "llama.cpp"), d.get("word_prefix", ""),
                  d.get("continuation", ""), d.get("lowercase", True), d.get("strip_accents", True),
                  d.get("max_word_chars"), d.get("bos"), d.get("eos"), d.get("add_eos", False),
                  d.get("chat_template"), stops)
        check_vocab_size(d, tok)
        return tok

    def vocab_text(self) -> str:
        """One line per token: id, the piece shown readably, its type."""
        lines = [f"# nanoeuler WordPiece: {self.vocab_size} tokens; fingerprint {self.fingerprint()[:16]}"]
        for i, (t, ty) in enumerate(zip(self.tokens, self.types.tolist())):
            lines.append(f"{i}\t'{json.dumps(t, ensure_ascii=False)[1:-1]}'\t{TYPE_NAMES[ty]}")
        return "\n".join(lines) + "\n"

    def to_hf_json(self) -> str:
        """A Hugging Face `tokenizers` JSON string (BertNormalizer, BertPreTokenizer, WordPiece, the framing as a
        TemplateProcessing) of a vocabulary with "##" continuations and the "bert" normalization; the llama.cpp
        form is refused (its rule differs from BertNormalizer's on marks and on İ)."""
        if self.normalization != "bert" or not self.continuation:
            raise UserError("cannot export a WordPiece tokenizer read from GGUF (llama.cpp's normalization and "
                            "\"▁\" pieces) to Hugging Face's format")
        added = [{"id": i, "content": self.tokens[i], "single_word": False, "lstrip": False, "rstrip": False,
                  "normalized": False, "special": int(self.types[i]) != USER_DEFINED}
                 for i in np.flatnonzero(np.isin(self.types, (CONTROL, UNKNOWN, USER_DEFINED))).tolist()]
        d = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
             "normalizer": {"type": "BertNormalizer", "clean_text": True, "handle_chinese_chars": True,
                            "strip_accents": self.strip_accents, "lowercase": self.lowercase},
             "pre_tokenizer": {"type": "BertPreTokenizer"}, "post_processor": self.hf_post_processor(),
             "decoder": {"type": "WordPiece", "prefix": self.continuation, "cleanup": True},
             "model": {"type": "WordPiece", "unk_token": self.unk, "continuing_subword_prefix": self.continuation,
                       "max_input_chars_per_word": self.max_word_chars or 1 << 30,
                       "vocab": {t: i for i, t in enumerate(self.tokens)}}}
        return json.dumps(d, ensure_ascii=False)

    def hf_post_processor(self) -> dict | None:
        """[CLS] $A [SEP] (the bos, the text, the eos when add_eos) as a TemplateProcessing."""
        if self.bos_token is None and not self.add_eos:
            return None
        frame = [t for t in (self.bos_token, self.eos_token if self.add_eos else None) if t is not None]
        seq = {"Sequence": {"id": "A", "type_id": 0}}
        single = ([{"SpecialToken": {"id": self.bos_token, "type_id": 0}}] if self.bos_token else []) + [seq] + (
            [{"SpecialToken": {"id": self.eos_token, "type_id": 0}}] if self.add_eos else [])
        return {"type": "TemplateProcessing", "single": single, "pair": single,
                "special_tokens": {t: {"id": t, "ids": [self.ids[t]], "tokens": [t]} for t in frame}}
