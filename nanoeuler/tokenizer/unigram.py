"""Unigram: SentencePiece's unigram language model (T5, XLM-R, ALBERT, nomic-embed), run as llama.cpp runs it
(`llm_tokenizer_ugm`, GGUF `tokenizer.ggml.model = t5`) or as Hugging Face `tokenizers` runs a Unigram model.

How text becomes ids:

1. Special tokens are cut out of the text first (sentencepiece.split_specials, llama.cpp's order): USER_DEFINED
   tokens always, CONTROL and UNKNOWN ones (`<s>`, `</s>`, `<unk>`) only with allow_special.
2. Each text fragment is normalized, by one of two rules:
   - "llama.cpp" (`normalize_llama_cpp`): from each position, the longest prefix of a user-defined token is kept
     as it is, else the precompiled charsmap's longest match is replaced (charsmap.py: NFKC, "\\t" -> " ", ...),
     else one UTF-8 character is kept (a byte that starts none: U+FFFD); then every space becomes "▁", with
     add_space_prefix a "▁" goes before the first non-space, and with merge_spaces (remove_extra_whitespaces)
     each run of non-spaces gets one "▁" before it and the spaces go:

         merge_spaces: "  Hello   world " -> "▁Hello▁world"

   - "hf" (Hugging Face): the charsmap if any (its Precompiled normalizer: by graphemes, charsmap.py), a Unicode
     normal form if any; with merge_spaces its WhitespaceSplit (each run of whitespace dropped, each word a
     piece); then its Metaspace pre-tokenizer: every space "▁", one in front (`prefix`, as sentencepiece.py's),
     and with `split` a piece begins at each "▁".
3. Each piece, Viterbi (`viterbi`): of all the ways to cut it into vocabulary tokens, the one whose scores (log
   probabilities) add up highest; a character no token covers alone may be the unknown token, scored the
   lowest score less 10, and unknowns next to each other become one. Ties go to the cut found first (the
   earlier start, then the shorter token), in both runtimes:

       scores ▁ -1, ▁a -2, b -3, ▁ab -6, "▁ab" -> [▁a, b] (-5 beats -6 and ▁ a b: -1 + unknown + -3)

   llama.cpp scores user-defined tokens 0 and leaves CONTROL / UNKNOWN tokens out of the cut; Hugging Face
   cuts with its whole vocabulary, and with byte_fallback spells an unknown run in `<0xE4>` byte tokens.
4. encode(..., add_bos=True) puts the bos first (when the vocabulary adds one) and, with add_eos, the eos last
   (T5's and XLM-R's `</s>`), as llama.cpp's add_special and Hugging Face's post-processor do.

Decoding: each piece with "▁" as a space, a byte token as its byte, special tokens as their text; the first
piece's leading space is dropped when a "▁" was put in front.
"""
from __future__ import annotations

import base64
import binascii
import json
import math
import unicodedata
from collections.abc import Iterable

import numpy as np
import regex

from ..errors import UserError
from . import spm_fast as sf
from . import unigram_fast as uf
from .base import BaseTokenizer
from .charsmap import Charsmap
from .sentencepiece import (BYTE, BYTE_PIECES, CONTROL, METASPACE, NORMAL, NORMALIZERS, TYPE_NAMES, UNKNOWN, UNUSED,
                            USER_DEFINED, TypedVocab, check_vocab_size, numbers, split_before_metaspace,
                            split_specials, typed_vocab_fields, utf8_length)

KIND = "unigram"
FORMAT, VERSION = "nanoeuler-unigram", 1
NORMALIZATIONS = ("llama.cpp", "hf")
HF_PREFIXES = ("none", "every-unless-space", "first-unless-space")
UNKNOWN_PENALTY = 10.0
SPACE = METASPACE.encode()
CACHE_PIECES = 1 << 16
# Rust's char::is_whitespace (the White_Space property), what Hugging Face's WhitespaceSplit cuts at
WHITESPACE_RUNS = regex.compile("[\t\n\x0b\x0c\r \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]+")


# ------------------------------------------------------------------------------------ the algorithms

def viterbi(s: str, find, scores: list[float], longest: int, unk_score: float) -> list[tuple[int, int, int]]:
    """The best cut of s into tokens: [(start, end, token id, or -1 for an unknown run)], unknowns next to each
    other fused. find(piece) -> id or -1; scores[id]; longest: the most characters a token has.

        ids = {"▁": 0, "▁a": 1, "b": 2, "▁ab": 3}
        viterbi("▁ab", lambda p: ids.get(p, -1), [-1, -2, -3, -6], 3, -13) -> [(0, 2, 1), (2, 3, 2)]
    """
    n = len(s)
    best, start, token = [0.0] + [-math.inf] * n, [0] * (n + 1), [-1] * (n + 1)   # per end position
    for i in range(n):
        here, single = best[i], False
        for end in range(i + 1, min(n, i + longest) + 1):
            t = find(s[i:end])
            if t >= 0:
                single |= end == i + 1
                if here + scores[t] > best[end]:
                    best[end], start[end], token[end] = here + scores[t], i, t
        if not single and here + unk_score > best[i + 1]:
            best[i + 1], start[i + 1], token[i + 1] = here + unk_score, i, -1
    out: list[tuple[int, int, int]] = []
    end = n
    while end > 0:
        a, t = start[end], token[end]
        if t < 0 and out and out[-1][2] < 0:
            out[-1] = (a, out[-1][1], -1)
        else:
            out.append((a, end, t))
        end = a
    return out[::-1]


def merge_spaces_of(data: bytes, prefix: bool, merge: bool) -> bytes:
    """llama.cpp's UGM whitespace rule on normalized bytes (module docstring, step 2).
    merge_spaces_of(b"  a  b ", False, True) -> '▁a▁b'.encode();  (b" a b", True, False) -> '▁▁a▁b'.encode()"""
    if merge:
        return b"".join(SPACE + w for w in data.split(b" ") if w)
    lead = len(data) - len(data.lstrip(b" "))
    body = data[lead:].replace(b" ", SPACE)
    return SPACE * lead + (SPACE + body if prefix and body else body)


# ------------------------------------------------------------------------------------------ tokenizer

class UnigramTokenizer(TypedVocab, BaseTokenizer):
    """A Unigram vocabulary (see the module docstring); ids are the vocabulary's order."""

    kind = KIND

    def __init__(self, tokens: list[str], types: Iterable[int], scores: Iterable[float], unk: str,
                 normalization: str = "llama.cpp", charsmap: bytes | None = None, add_space_prefix: bool = True,
                 merge_spaces: bool = True, form: str | None = None, prefix: str = "every-unless-space",
                 split: bool = True, byte_fallback: bool = False, bos: str | None = None, eos: str | None = None,
                 add_eos: bool = False, chat_template: str | None = None, stops: Iterable[str] = ()):
        """tokens: the piece of each id; types: its GGUF token type; scores: its log probability; unk: the unknown
        token; normalization: "llama.cpp" (charsmap, add_space_prefix, merge_spaces) or "hf" (charsmap, form: a
        Unicode normal form, merge_spaces, prefix, split, byte_fallback); bos, eos, add_eos: step 4."""
        if normalization not in NORMALIZATIONS:
            raise UserError(f"tokenizer.json: \"normalization\" must be one of {', '.join(NORMALIZATIONS)}, "
                            f"got {normalization!r:.40}")
        if prefix not in HF_PREFIXES or form not in NORMALIZERS:
            raise UserError(f"tokenizer.json: \"prefix\" must be one of {', '.join(HF_PREFIXES)} and \"form\" a "
                            f"Unicode normal form, got {prefix!r:.30}, {form!r:.30}")
        self.tokens, self.types = list(tokens), np.asarray(types, np.int64)
        self.scores = np.asarray(scores, np.float64)
        n = len(self.tokens)
        if self.types.shape != (n,) or self.scores.shape != (n,) or not np.isin(self.types, list(TYPE_NAMES)).all():
            raise UserError(f"tokenizer: {n} tokens need as many token types (1..6) and scores")
        if not np.isfinite(self.scores).all():
            raise UserError("tokenizer: the scores must be finite numbers")
        self.normalization, self.unk = normalization, unk
        self.charsmap = None if charsmap is None else Charsmap(charsmap)
        self.add_space_prefix, self.merge_spaces = bool(add_space_prefix), bool(merge_spaces)
        self.form, self.prefix, self.split, self.byte_fallback = form, prefix, bool(split), bool(byte_fallback)
        self.bos_token, self.eos_token, self.add_eos = bos, eos, bool(add_eos)
        self.chat_template, self.stops = chat_template, tuple(stops)
        self.ids = dict(zip(self.tokens, range(len(self.tokens))))
        if len(self.ids) != len(self.tokens):
            i = next(i for i, t in enumerate(self.tokens) if self.ids[t] != i)
            raise UserError(f"tokenizer: {self.tokens[i]!r:.40} is both token {i} and token {self.ids[self.tokens[i]]}")
        self.special_tokens = {self.tokens[i]: i
                               for i in np.flatnonzero(~np.isin(self.types, (NORMAL, BYTE))).tolist()}
        if unk not in self.ids:
            raise UserError(f"the unknown token {unk!r:.40} is not in the vocabulary")
        for what, t in (("bos", bos), ("eos", eos), *(("stop", s) for s in self.stops)):
            if t is not None and t not in self.special_tokens:
                raise UserError(f"the {what} token {t!r:.40} is not a special token of the vocabulary")
        if add_eos and eos is None:
            raise UserError("add_eos needs an eos token")
        self._build()

    def _build(self) -> None:
        """The tables of the cut: which tokens it may use, their scores, the unknown's score."""
        llama = self.normalization == "llama.cpp"
        self._usable = np.isin(self.types, (NORMAL, USER_DEFINED, UNUSED)) if llama else self.types != UNUSED
        self._scores = np.where(self.types == USER_DEFINED, 0.0, self.scores) if llama else self.scores
        pool = self.scores[self.types == NORMAL] if llama else self.scores
        self._unk_score = float(pool.min(initial=np.inf) if pool.size else 0.0) - UNKNOWN_PENALTY
        raw = [t.encode("utf-8", "surrogatepass") for t in self.tokens]
        lengths = np.fromiter(map(len, raw), np.int64, len(raw))
        self._blob = np.frombuffer(b"".join(raw), np.uint8)
        self._ends = np.cumsum(lengths)
        self._starts = self._ends - lengths
        self._t_keys, self._t_vals = sf.table(len(raw))
        sf.text_table(self._blob, self._starts, self._ends, self._t_keys, self._t_vals)   # ids checked unique
        self._longest = int(lengths[self._usable].max(initial=1))
        self._p_keys, self._p_vals = sf.table(int(lengths[self._usable].sum()))
        uf.prefix_table(self._blob, self._starts, self._ends, self._usable, self._p_keys, self._p_vals)
        user = [self.tokens[i].encode("utf-8", "surrogatepass") for i in np.flatnonzero(self.types == USER_DEFINED)]
        self._user_prefixes = {t[:k] for t in user for k in range(1, len(t) + 1)}
        u_lengths = np.fromiter(map(len, user), np.int64, len(user))
        self._user = (np.frombuffer(b"".join(user) or b"\0", np.uint8), np.cumsum(u_lengths) - u_lengths,
                      np.cumsum(u_lengths))
        if self.charsmap is None:
            self._charsmap_arrays = np.zeros(0, np.int64), np.zeros(1, np.uint8), 4
        else:
            cuts = np.flatnonzero(np.frombuffer(self.charsmap.replacements, np.uint8) == 0)
            self._charsmap_arrays = (np.array(self.charsmap.units, np.int64),
                                     np.frombuffer(self.charsmap.replacements, np.uint8),
                                     max(4, int(np.diff(cuts, prepend=-1).max(initial=0))))
        self._user_longest = max(map(len, user), default=0)
        self._splitters: dict[bool, list[tuple[bytes, int]]] = {}
        self._pieces: dict[bytes, list[int]] = {}

    def __repr__(self) -> str:
        return f"UnigramTokenizer(vocab_size={self.vocab_size}, normalization={self.normalization!r})"

    # -- encoding -----------------------------------------------------------------------------------
    def encode_bytes(self, data: bytes) -> list[int]:
        """Any bytes -> ids (no special tokens): a byte that is not UTF-8 reads as U+FFFD, as in llama.cpp."""
        return self._encode(bytes(data), False)

    def _encode(self, data: bytes, allow_special: bool) -> list[int]:
        out: list[int] = []
        frags = split_specials(data, self._splitter(allow_special))
        for i, f in enumerate(frags):
            if isinstance(f, int):
                out.append(f)
            elif self.normalization == "llama.cpp":
                out += self._cut(self._normalize_fast(f))
            else:
                for piece in self.pieces_hf(f.decode("utf-8", "replace"), first=i == 0):
                    out += self._cut(piece.encode())
        return out

    def normalize_llama_cpp(self, data: bytes) -> bytes:
        """Step 2, llama.cpp's rule: data -> the normalized bytes, spaces as "▁"."""
        out, at, n = [], 0, len(data)
        while at < n:
            k = next((k for k in range(min(self._user_longest, n - at), 0, -1)
                      if data[at:at + k] in self._user_prefixes), 0)
            match = None if k or self.charsmap is None else self.charsmap.longest_match(data, at)
            if k:
                out.append(data[at:at + k])
            elif match:
                k = match[0]
                out.append(match[1])
            else:
                k = utf8_length(data, at)
                out.append(data[at:at + k] if k else "\ufffd".encode())
                k = k or 1
            at += k
        return merge_spaces_of(b"".join(out), self.add_space_prefix, self.merge_spaces)

    def _normalize_fast(self, data: bytes) -> bytes:
        """normalize_llama_cpp, compiled (unigram_fast.normalize) but for the whitespace rule."""
        units, replacements, widest = self._charsmap_arrays
        out = np.empty(len(data) * widest + 4, np.uint8)
        k = uf.normalize(np.frombuffer(data, np.uint8), units, replacements, *self._user, out)
        if k < 0:
            raise UserError("the precompiled charsmap is damaged (its trie or a replacement points outside it)")
        return merge_spaces_of(out[:k].tobytes(), self.add_space_prefix, self.merge_spaces)

    def pieces_hf(self, text: str, first: bool) -> list[str]:
        """Step 2, Hugging Face's rule: Precompiled, the normal form, WhitespaceSplit, then Metaspace."""
        if self.charsmap is not None:
            text = self.charsmap.by_graphemes(text)
        if self.form:
            text = unicodedata.normalize(self.form, text)
        out = []
        for word in (WHITESPACE_RUNS.split(text) if self.merge_spaces else [text]):
            word = word.replace(" ", METASPACE)
            if word and not word.startswith(METASPACE) and (
                    self.prefix == "every-unless-space" or self.prefix == "first-unless-space" and first):
                word = METASPACE + word
            out += split_before_metaspace(word) if self.split else [word] if word else []
        return out

    def _cut(self, piece: bytes) -> list[int]:
        """Step 3 on one piece's bytes, compiled (unigram_fast.viterbi); a short piece is remembered (they recur:
        Hugging Face's words; llama.cpp cuts a whole fragment at once)."""
        ids = self._pieces.get(piece)
        if ids is None:
            buf = np.frombuffer(piece, np.uint8)
            spans = np.empty((len(piece), 3), np.int64)
            k = uf.viterbi(buf, self._t_keys, self._t_vals, self._blob, self._starts, self._ends, self._p_keys,
                           self._p_vals, self._usable, self._scores, self._longest, self._unk_score, spans)
            ids = spans[:k, 2].tolist() if (spans[:k, 2] >= 0).all() else self._spelled(spans[:k].tolist(), piece)
            if len(piece) <= 64:
                if len(self._pieces) >= CACHE_PIECES:
                    self._pieces.clear()
                self._pieces[piece] = ids
        return ids

    def _spelled(self, spans: list[tuple[int, int, int]], piece: bytes) -> list[int]:
        """The ids of a cut: an unknown run as the unknown token, or with byte_fallback as its bytes' tokens
        (all of them in the vocabulary, else the unknown token)."""
        unk, out = self.ids[self.unk], []
        for a, b, t in spans:
            if t >= 0:
                out.append(t)
            elif self.byte_fallback:
                spelled = [self.ids.get(BYTE_PIECES[c]) for c in piece[a:b]]
                out += spelled if None not in spelled else [unk]
            else:
                out.append(unk)
        return out

    def encode_reference(self, text: str, allow_special: bool = False) -> list[int]:
        """encode, by the readable `viterbi` on characters (slow; the tests hold encode equal to it)."""
        find = {t: i for i, t in enumerate(self.tokens) if self._usable[i]}
        scores, longest = self._scores.tolist(), max(map(len, find), default=1)
        out: list[int] = []
        frags = split_specials(text.encode("utf-8", "surrogatepass"), self._splitter(allow_special))
        for i, f in enumerate(frags):
            if isinstance(f, int):
                out.append(f)
                continue
            pieces = ([self.normalize_llama_cpp(f).decode("utf-8", "surrogateescape")]
                      if self.normalization == "llama.cpp" else self.pieces_hf(f.decode("utf-8", "replace"), i == 0))
            for piece in pieces:
                spans = viterbi(piece, lambda p: find.get(p, -1), scores, longest, self._unk_score)
                raw = piece.encode("utf-8", "surrogateescape")
                at = [len(piece[:a].encode("utf-8", "surrogateescape")) for a in range(len(piece) + 1)]
                out += self._spelled([(at[a], at[b], t) for a, b, t in spans], raw)
        return out

    # -- decoding -----------------------------------------------------------------------------------
    def token_bytes(self, i: int) -> bytes:
        """The bytes token i decodes to: its piece with "▁" as a space; a byte token's byte.
        token_bytes(id of '▁the') -> b' the'"""
        if not 0 <= int(i) < self.vocab_size:
            raise UserError(f"token id {i} is out of range (vocabulary size {self.vocab_size})")
        t, ty = self.tokens[int(i)], int(self.types[int(i)])
        if ty == BYTE or self.byte_fallback and t in BYTE_PIECES and ty == NORMAL:
            return bytes([int(t[3:5], 16)])
        if ty in (NORMAL, UNUSED, USER_DEFINED):
            t = t.replace(METASPACE, " ")
        return t.encode("utf-8", "surrogatepass")

    def decode_bytes(self, ids) -> bytes:
        """ids -> bytes: the pieces joined, the first one's leading space dropped when one was put in front."""
        out = b"".join(self.token_bytes(i) for i in self.check_ids(ids).tolist())
        front = self.add_space_prefix or self.merge_spaces if self.normalization == "llama.cpp" else \
            self.prefix != "none"
        return out[1:] if front and out[:1] == b" " else out

    # -- persistence --------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        """Our readable format: {"format", "version", "kind": "unigram", "tokens", "types", "scores", "unk",
        "normalization", ... "charsmap" (base64)}."""
        d = {"format": FORMAT, "version": VERSION, "kind": KIND, "vocab_size": self.vocab_size,
             "tokens": self.tokens, "types": self.types.tolist(), "scores": self.scores.tolist(), "unk": self.unk,
             "normalization": self.normalization, "add_space_prefix": self.add_space_prefix,
             "merge_spaces": self.merge_spaces, "prefix": self.prefix, "split": self.split,
             "byte_fallback": self.byte_fallback, "add_eos": self.add_eos}
        for key, value in (("form", self.form), ("bos", self.bos_token), ("eos", self.eos_token),
                           ("chat_template", self.chat_template),
                           ("charsmap", self.charsmap and base64.b64encode(self.charsmap.blob).decode("ascii"))):
            if value is not None:
                d[key] = value
        if self.stops:
            d["stops"] = list(self.stops)
        return d

    @classmethod
    def from_dict(cls, d) -> UnigramTokenizer:
        """Rebuild from to_dict() output, checking every field (a corrupt file gives a UserError)."""
        tokens, types, stops = typed_vocab_fields(
            d, KIND, "Unigram", (FORMAT, VERSION),
            (("unk", str), ("normalization", str), ("form", str), ("prefix", str), ("bos", str), ("eos", str),
             ("chat_template", str), ("charsmap", str), ("add_space_prefix", bool), ("merge_spaces", bool),
             ("split", bool), ("byte_fallback", bool), ("add_eos", bool)))
        scores = numbers(d.get("scores"), "iuf", "\"scores\" must be a list of finite numbers")
        charsmap = None
        if d.get("charsmap") is not None:
            try:
                charsmap = base64.b64decode(d["charsmap"], validate=True)
            except (binascii.Error, ValueError):
                raise UserError("tokenizer.json: \"charsmap\" must be base64") from None
        tok = cls(tokens, types, scores, d["unk"], d.get("normalization", "llama.cpp"), charsmap,
                  d.get("add_space_prefix", True), d.get("merge_spaces", True), d.get("form"),
                  d.get("prefix", "every-unless-space"), d.get("split", True), d.get("byte_fallback", False),
                  d.get("bos"), d.get("eos"), d.get("add_eos", False), d.get("chat_template"), stops)
        check_vocab_size(d, tok)
        return tok

    def vocab_text(self) -> str:
        """One line per token: id, the piece shown readably, its type, its score."""
        lines = [f"# nanoeuler Unigram: {self.vocab_size} tokens; fingerprint {self.fingerprint()[:16]}"]
        for i, (t, ty, s) in enumerate(zip(self.tokens, self.types.tolist(), self.scores.tolist())):
            lines.append(f"{i}\t'{json.dumps(t, ensure_ascii=False)[1:-1]}'\t{TYPE_NAMES[ty]}\t{s:g}")
        return "\n".join(lines) + "\n"

    def to_hf_json(self) -> str:
        """A Hugging Face `tokenizers` JSON string of a tokenizer read from one ("hf" rule): Unigram, Precompiled
        and / or its normal form, [WhitespaceSplit,] Metaspace, the framing as a TemplateProcessing. llama.cpp's
        rule is refused (Hugging Face's Precompiled normalizer cuts by graphemes, llama.cpp by longest match)."""
        if self.normalization != "hf":
            raise UserError("cannot export a Unigram tokenizer read from GGUF (llama.cpp's normalization) to "
                            "Hugging Face's format")
        added = [{"id": i, "content": self.tokens[i], "single_word": False, "lstrip": False, "rstrip": False,
                  "normalized": False, "special": int(self.types[i]) != USER_DEFINED}
                 for i in np.flatnonzero(np.isin(self.types, (CONTROL, UNKNOWN, USER_DEFINED))).tolist()]
        scheme = {"none": "never", "every-unless-space": "always", "first-unless-space": "first"}[self.prefix]
        metaspace = {"type": "Metaspace", "replacement": METASPACE, "prepend_scheme": scheme, "split": self.split}
        pre = metaspace if not self.merge_spaces else {"type": "Sequence", "pretokenizers": [
            {"type": "WhitespaceSplit"}, metaspace]}
        norms = ([{"type": "Precompiled", "precompiled_charsmap": base64.b64encode(self.charsmap.blob).decode()}]
                 if self.charsmap is not None else []) + ([{"type": self.form}] if self.form else [])
        seq = {"Sequence": {"id": "A", "type_id": 0}}
        single = ([{"SpecialToken": {"id": self.bos_token, "type_id": 0}}] if self.bos_token else []) + [seq] + (
            [{"SpecialToken": {"id": self.eos_token, "type_id": 0}}] if self.add_eos else [])
        frame = [t for t in (self.bos_token, self.eos_token if self.add_eos else None) if t is not None]
        post = None if not frame else {
            "type": "TemplateProcessing", "single": single, "pair": single,
            "special_tokens": {t: {"id": t, "ids": [self.ids[t]], "tokens": [t]} for t in frame}}
        d = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
             "normalizer": None if not norms else norms[0] if len(norms) == 1 else {"type": "Sequence",
                                                                                      "normalizers": norms},
             "pre_tokenizer": pre,
             "post_processor": post, "decoder": metaspace,
             "model": {"type": "Unigram", "unk_id": self.ids[self.unk], "byte_fallback": self.byte_fallback,
                       "vocab": [[t, s] for t, s in zip(self.tokens, self.scores.tolist())]}}
        return json.dumps(d, ensure_ascii=False)
