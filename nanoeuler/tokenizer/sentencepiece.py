"""SentencePiece-style BPE: pieces with `▁` for spaces, ranked merges, and byte fallback (`<0xE4>`): the tokenizer
of Llama-2, Gemma and their families, run as llama.cpp (`llm_tokenizer_spm`, GGUF `tokenizer.ggml.model =
llama`) and Hugging Face `tokenizers` (BPE with `byte_fallback`, a Metaspace / Replace normalizer) run it.

How text becomes ids:

1. Special tokens are cut out of the text first (`split_specials`, llama.cpp's `tokenizer_st_partition`: the
   longest special first, each at its leftmost occurrences). USER_DEFINED tokens are always cut out (Gemma's
   "\\n", "  ", "<table>"...), CONTROL and UNKNOWN ones only with allow_special (`<bos>`, `<start_of_turn>`).
2. Each text fragment: a Unicode normal form if the tokenizer has one; a "▁" first (`prefix`: "every"
   fragment, as llama.cpp's add_space_prefix and HF's Prepend normalizer do; "every-unless-space" or
   "first-unless-space", HF's Metaspace prepend_scheme always / first, which adds none before a space);
   every space becomes "▁"; with `split` (HF Metaspace split=true) it is cut before each "▁". With `newlines`
   (Gemma 4: llama.cpp's tokenizer model gemma4, its pre-tokenizer `[^\n]+|[\n]+`) it is cut into runs of
   newlines and runs of other characters, and a run of newlines that is a token is that token, not merged;
   a byte that is not UTF-8 is then U+FFFD, as llama.cpp reads the text as code points there.
3. BPE (`merge_symbols`): the characters are the symbols; the adjacent pair that ranks first (the leftmost
   among equals) becomes one symbol, until no pair merges. Two ways of ranking, each with its runtime's
   handling of a character that is not a token:
   - scores (llama.cpp, GGUF): two symbols merge when their texts joined are a token; a higher score ranks
     first. A character outside the vocabulary stays a symbol and becomes its bytes' tokens at the end.
   - merges (Hugging Face tokenizer.json): the pair must be a listed merge; its place in the list ranks it.
     A character outside the vocabulary becomes its bytes' tokens at once (they may merge further).

       pieces ▁ h e l o ▁h ▁he ll ▁hell ▁hello (scores rising to the right), text "hello":
       ▁ h e l l o -> ▁h e l l o -> ▁he l l o -> ▁he ll o -> ▁hell o -> ▁hello

Decoding: each token's piece, "▁" as a space, `<0xE4>` as that byte (the bytes of one character join back
into UTF-8), special tokens as their text; when the tokenizer adds a "▁" in front, the first piece's leading
space is removed, as llama.cpp's detokenize and HF's decoders do.

The compiled kernels are in spm_fast.py; `encode_reference` runs the readable definitions here, and the tests
hold the two equal.
"""
from __future__ import annotations

import json
import operator
import unicodedata
from collections.abc import Iterable, Sequence

import numpy as np
import regex

from ..errors import UserError
from . import spm_fast as sf
from .base import BaseTokenizer

KIND = "sentencepiece"
FORMAT, VERSION = "nanoeuler-bpe", 1
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6     # GGUF token types
TYPE_NAMES = {NORMAL: "normal", UNKNOWN: "unknown", CONTROL: "control", USER_DEFINED: "user-defined",
              UNUSED: "unused", BYTE: "byte"}
PREFIXES = ("none", "every", "every-unless-space", "first-unless-space")
NORMALIZERS = (None, "NFC", "NFD", "NFKC", "NFKD")
METASPACE = "\u2581"
BYTE_PIECES = [f"<0x{b:02X}>" for b in range(256)]
NEWLINE_RUNS = regex.compile(rb"\n+|[^\n]+")
MAX_VIRTUAL = 1 << 16   # characters inside tokens that are not tokens themselves (Gemma 3 has none)


# ------------------------------------------------------------------ reference algorithms (readable)

def split_specials(data: bytes, specials: list[tuple[bytes, int]]) -> list[bytes | int]:
    """Cut special tokens out of data as llama.cpp does: for each special (longest first), every text fragment
    left is split at its leftmost non-overlapping occurrences. Fragments: bytes (text) or int (a token id).

        split_specials(b"a<b>c<b>", [(b"<b>", 7)]) -> [b'a', 7, b'c', 7]
    """
    frags: list[bytes | int] = [data] if data else []
    for text, token in specials:
        out: list[bytes | int] = []
        for f in frags:
            if isinstance(f, int) or text not in f:
                out.append(f)
                continue
            for i, part in enumerate(f.split(text)):
                if i:
                    out.append(token)
                if part:
                    out.append(part)
        frags = out
    return frags


def merge_symbols(symbols: list, rank) -> list:
    """BPE: merge the adjacent pair that ranks first (the leftmost among equal ranks) until no pair merges.
    rank(a, b) -> (rank, merged) or None.

        ranks = {("a", "b"): (1, "ab"), ("b", "c"): (0, "bc")}
        merge_symbols(list("abc"), lambda a, b: ranks.get((a, b))) -> ['a', 'bc']
    """
    symbols = list(symbols)
    while True:
        best = None
        for i in range(len(symbols) - 1):
            r = rank(symbols[i], symbols[i + 1])
            if r is not None and (best is None or r[0] < best[0]):
                best = (r[0], i, r[1])
        if best is None:
            return symbols
        _, i, merged = best
        symbols[i:i + 2] = [merged]


def utf8_chars(data: bytes) -> list[bytes]:
    """data cut into characters by the high bits of their first byte alone, as llama.cpp's unicode_len_utf8 does
    (a stray continuation byte is one byte; 0xF8..0xFF, no UTF-8 lead byte, takes four like 0xF0..0xF7).
    utf8_chars("aé".encode()) -> [b'a', b'\\xc3\\xa9'];  utf8_chars(b"\\xffabc") -> [b'\\xffabc']"""
    out, p = [], 0
    while p < len(data):
        b = data[p]
        n = 1 if b < 0xC0 else 2 if b < 0xE0 else 3 if b < 0xF0 else 4
        out.append(data[p:p + n])
        p += n
    return out


# ------------------------------------------------------------------------------------ tokenizer

class Pieces(Sequence):
    """The tokens' texts, a read-only sequence of str held as one UTF-8 blob and two offset arrays (token i is
    blob[starts[i] : ends[i]], bytes that are not UTF-8 kept through surrogateescape), each str made when read:
    a large vocabulary held as one str object per token costs several times its bytes (docs/benchmarks.md).

        p = Pieces.of(["a", "▁b"]); len(p), p[1], list(p) -> (2, '▁b', ['a', '▁b']); p.ends -> array([1, 5])"""

    def __init__(self, blob: np.ndarray, starts: np.ndarray, ends: np.ndarray):
        self.blob, self.starts, self.ends = blob, starts, ends   # uint8 [bytes], int64 [n], int64 [n]

    @classmethod
    def of(cls, texts: Iterable[str]) -> "Pieces":
        if isinstance(texts, Pieces):
            return texts
        raw = [t.encode("utf-8", "surrogateescape") for t in texts]
        ends = np.cumsum(np.fromiter(map(len, raw), np.int64, len(raw)))
        return cls(np.frombuffer(b"".join(raw), np.uint8), ends - np.diff(ends, prepend=0), ends)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        i = operator.index(i)
        if not -len(self) <= i < len(self):
            raise IndexError("token index out of range")
        return self.blob[self.starts[i]:self.ends[i]].tobytes().decode("utf-8", "surrogateescape")

    def __iter__(self):
        data = self.blob.tobytes()
        return (data[a:b].decode("utf-8", "surrogateescape") for a, b in zip(self.starts.tolist(), self.ends.tolist()))


class SentencePieceTokenizer(BaseTokenizer):
    """A SentencePiece-style BPE vocabulary (see the module docstring); ids are the vocabulary's order."""

    kind = KIND

    def __init__(self, tokens: Iterable[str], types: Iterable[int], scores: Iterable[float] | None = None,
                 merges: Iterable[tuple[int, int]] | None = None, prefix: str = "none", split: bool = False,
                 normalizer: str | None = None, eos: str | None = None, bos: str | None = None,
                 chat_template: str | None = None, stops: Iterable[str] = (), newlines: bool = False):
        """tokens: the piece of each id; types: its GGUF token type (NORMAL, CONTROL, ...); exactly one of
        scores (llama.cpp's ranking) and merges ((left id, right id) pairs in rank order, Hugging Face's);
        prefix, split, normalizer, newlines: how a text fragment is prepared (module docstring, step 2); eos, bos,
        stops: special token strings (the end of a text, the token add_bos puts first, more reply ends)."""
        if (scores is None) == (merges is None):
            raise UserError("a SentencePiece tokenizer ranks its merges by scores or by a merge list (one of them)")
        if prefix not in PREFIXES:
            raise UserError(f"tokenizer.json: \"prefix\" must be one of {', '.join(PREFIXES)}, got {prefix!r:.40}")
        if normalizer not in NORMALIZERS:
            raise UserError(f"unknown normalizer {normalizer!r:.40}; choose one of NFC, NFD, NFKC, NFKD or none")
        self.tokens = Pieces.of(tokens)
        self.types = np.asarray(types, np.int64)
        self.scores = None if scores is None else np.asarray(scores, np.float32)
        self.given_merges = None if merges is None else np.asarray(merges, np.int64).reshape(-1, 2)
        self.prefix, self.split, self.normalizer, self.newlines = prefix, bool(split), normalizer, bool(newlines)
        self.eos_token, self.bos_token, self.chat_template = eos, bos, chat_template
        self.stops = tuple(stops)
        self._build()
        specials = np.flatnonzero(~np.isin(self.types, (NORMAL, BYTE))).tolist()   # control, user-defined, ...
        self.special_tokens = {self.tokens[i]: i for i in specials}
        for what, t in (("bos", bos), ("eos", eos), *(("stop", s) for s in self.stops)):
            if t is not None and t not in self.special_tokens:
                raise UserError(f"the {what} token {t!r:.40} is not a special token of the vocabulary")
        self._splitters: dict[bool, tuple] = {}
        self._joined: tuple[bytes, np.ndarray] | None = None   # (_joined_pieces)

    def _build(self) -> None:
        """The lookup tables (spm_fast): texts, characters, pairs, byte tokens."""
        n = len(self.tokens)
        if n == 0 or len(self.types) != n or (self.scores is not None and len(self.scores) != n):
            raise UserError(f"tokenizer: {n} tokens but {len(self.types)} types"
                            + ("" if self.scores is None else f" and {len(self.scores)} scores"))
        if not np.isin(self.types, list(TYPE_NAMES)).all():
            bad = self.types[~np.isin(self.types, list(TYPE_NAMES))][0]
            raise UserError(f"tokenizer: token type {bad} is not one of {sorted(TYPE_NAMES)}")
        self._blob, self._starts, self._ends = self.tokens.blob, self.tokens.starts, self.tokens.ends
        lengths = self._ends - self._starts
        if not lengths.all():
            raise UserError(f"tokenizer: token {int(np.argmin(lengths))} is empty")
        self._t_keys, self._t_vals = sf.table(n)
        dup = sf.text_table(self._blob, self._starts, self._ends, self._t_keys, self._t_vals)
        if dup >= 0:
            raise UserError(f"tokenizer: token {dup} {self.tokens[dup]!r:.40} repeats an earlier token's text")
        self._byte_token = np.array([self.find(p) for p in BYTE_PIECES], np.int64)
        if (self._byte_token < 0).any():
            missing = BYTE_PIECES[int(np.argmax(self._byte_token < 0))]
            raise UserError(f"tokenizer: the byte token {missing} is missing: byte fallback needs all 256 "
                            "(<0x00> ... <0xFF>)")
        is_byte = np.zeros(n, np.bool_)
        is_byte[self._byte_token] = True
        if not np.array_equal(is_byte, self.types == BYTE):        # decoding reads a BYTE token as its byte
            i = int(np.argmax(is_byte != (self.types == BYTE)))
            raise UserError(f"tokenizer: token {i} {self.tokens[i]!r:.20} has type {TYPE_NAMES.get(int(self.types[i]))}"
                            f"; the 256 tokens <0x00> ... <0xFF>, and only they, are BYTE tokens")
        self._c_keys, self._c_vals = self._char_table(0)
        self._pairs = None          # with scores: (pair table, characters inside tokens that are not tokens)
        if self.scores is not None:
            # rank: 0 for the highest score; equal scores share a rank (llama.cpp then takes the leftmost)
            self._rank = np.unique(-self.scores.astype(np.float64), return_inverse=True)[1].astype(np.int64)
            self._p_keys, self._p_vals = sf.table(0)    # pairs are looked up by their text (spm_fast)
        else:
            self._rank = np.zeros(0, np.int64)
            m = self.given_merges
            if m.size and (m.min() < 0 or m.max() >= n):
                raise UserError(f"tokenizer: a merge names a token id outside [0, {n})")
            self._p_keys, self._p_vals = sf.table(len(m))
            bad = sf.merge_pairs(self._blob, self._starts, self._ends, m, self._t_keys, self._t_vals,
                                 self._p_keys, self._p_vals, np.empty(2 * int(lengths.max()), np.uint8))
            if bad >= 0:
                a, b = m[bad]
                raise UserError(f"tokenizer: merge {bad} ({self.tokens[a]!r:.30}, {self.tokens[b]!r:.30}) does "
                                "not make a token of the vocabulary, or repeats an earlier merge")
        self._newline_bound = self._merges_stop_at_newlines()

    def _merges_stop_at_newlines(self) -> bool:
        """Whether no merge joins a symbol holding a newline to one of other characters: then every symbol is
        all newlines or holds none, no pair merges across a newline run's edge, and cutting a fragment at those
        edges gives the same ids faster (the BPE's heap stays one line long). Only for a merge list and no
        prefix (cutting adds no "▁"). Gemma 4's tokenizer.json: True."""
        m = self.given_merges
        if m is None or self.prefix != "none" or not m.size:
            return False
        at = np.flatnonzero(np.frombuffer(self._blob, np.uint8) == 0x0A)      # the newline bytes' offsets
        owner = np.searchsorted(self._starts, at, side="right") - 1             # the token holding each
        count = np.bincount(owner, minlength=len(self._starts))                # newlines per token
        has, only = count > 0, count == self._ends - self._starts
        mixed = (has[m[:, 0]] | has[m[:, 1]]) & ~(only[m[:, 0]] & only[m[:, 1]])
        return not mixed.any()

    def _char_table(self, room: int) -> tuple[np.ndarray, np.ndarray]:
        """The char table of the tokens that are one character, with room for `room` more."""
        chars = sf.count_chars(self._blob, self._starts, self._ends)
        keys, vals = sf.table(chars + room)
        sf.char_table(self._blob, self._starts, self._ends, keys, vals)
        return keys, vals

    def _score_pairs(self) -> tuple[np.ndarray, np.ndarray, int]:
        """With scores: (the pair table of every cut of every token whose two sides are tokens or characters
        inside tokens, the count of those characters that are not tokens), built on first use (merges,
        to_hf_json): encoding looks pairs up by their text instead."""
        if self._pairs is None:
            c_keys, c_vals = self._char_table(MAX_VIRTUAL)
            state = np.array([0, self.vocab_size, MAX_VIRTUAL], np.int64)
            pairs = np.empty((int(self._ends[-1]), 3), np.int32)        # a row per cut, at most
            n_pairs = sf.score_pairs(self._blob, self._starts, self._ends, self._t_keys, self._t_vals,
                                     c_keys, c_vals, state, pairs)
            if n_pairs < 0:
                raise UserError(f"tokenizer: more than {MAX_VIRTUAL} characters inside tokens are not tokens "
                                "themselves")
            p_keys, p_vals = sf.table(n_pairs)
            sf.fill_pairs(pairs[:n_pairs], self._rank, p_keys, p_vals)
            self._pairs = p_keys, p_vals, int(state[0])
        return self._pairs

    def find(self, piece: str) -> int:
        """The id of the token whose text is piece, -1 if none."""
        q = np.frombuffer(piece.encode("utf-8", "surrogateescape"), np.uint8)
        return int(sf.find_text(self._t_keys, self._t_vals, self._blob, self._starts, self._ends, q))

    # -- basic facts ---------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    @property
    def merges(self) -> list[tuple[int, int]]:
        """The merges as (left id, right id), first-ranked first (with scores: every pair whose join is a
        token, derived from the vocabulary)."""
        if self.given_merges is not None:
            return [tuple(m) for m in self.given_merges.tolist()]
        rows = sf.pair_list(*self._score_pairs()[:2])
        return [(a, b) for a, b in rows[:, 2:].tolist()]

    def token_bytes(self, i: int) -> bytes:
        """The bytes token i decodes to: its piece with "▁" as a space; a byte token's byte.
        token_bytes(id of '▁the') -> b' the'"""
        if not 0 <= int(i) < self.vocab_size:
            raise UserError(f"token id {i} is out of range (vocabulary size {self.vocab_size})")
        data, cuts = self._joined_pieces()
        return data[cuts[int(i)]:cuts[int(i) + 1]]

    def pieces(self) -> list[bytes]:
        """token_bytes of every id."""
        data, cuts = self._joined_pieces()
        return [data[a:b] for a, b in zip(cuts[:-1].tolist(), cuts[1:].tolist())]

    def _joined_pieces(self) -> tuple[bytes, np.ndarray]:
        """(every token's token_bytes joined, cuts [vocab + 1]: token i's are data[cuts[i] : cuts[i+1]]), built
        on first use from all the tokens' bytes at once: a NORMAL or UNUSED token's text with each "▁" as a space,
        a BYTE token's byte ("<0xE4>" -> b"\xe4"), any other its text. (Two arrays, not a list of 262,144 bytes
        objects: Gemma 3's would hold 14 MB.)"""
        if self._joined is None:
            blob, lengths = self._blob, self._ends - self._starts
            owner = np.repeat(np.arange(self.vocab_size), lengths)       # [bytes]: the token each byte is of
            at = np.flatnonzero((blob[:-2] == 0xE2) & (blob[1:-1] == 0x96) & (blob[2:] == 0x81))  # "▁" starts
            at = at[(owner[at] == owner[at + 2]) & np.isin(self.types[owner[at]], (NORMAL, UNUSED))]
            text, keep = blob.copy(), np.ones(len(blob), np.bool_)
            text[at], keep[at + 1], keep[at + 2] = sf.SPACE, False, False  # "▁" -> " "
            first = self._starts[self._byte_token]                       # "<0xHH>" (6 bytes) -> byte HH
            text[first] = np.arange(256)                                 #   (_build checked they are the BYTE tokens)
            keep[(first[:, None] + np.arange(1, 6)).ravel()] = False
            cuts = np.concatenate([[0], np.cumsum(keep)])[np.concatenate([[0], self._ends])]
            self._joined = text[keep].tobytes(), cuts
        return self._joined

    def __repr__(self) -> str:
        return (f"SentencePieceTokenizer(vocab_size={self.vocab_size}, ranked by "
                f"{'scores' if self.scores is not None else 'merges'}, prefix={self.prefix!r})")

    # -- encoding -----------------------------------------------------------------------------------
    def encode_array(self, text: str, allow_special: bool = False, add_bos: bool = False) -> np.ndarray:
        """Like encode, as an int32 array."""
        if not isinstance(text, str):
            raise UserError(f"encode takes str, got {type(text).__name__} (use encode_bytes for bytes)")
        ids = self._encode(text.encode("utf-8", "surrogatepass"), allow_special)
        if add_bos and self.bos_token is not None:
            ids = np.concatenate([np.array([self.bos_id], np.int32), ids])
        return ids

    def encode_bytes(self, data: bytes) -> list[int]:
        """Any bytes -> ids (no special tokens; no normal form, which needs text)."""
        data = bytes(data)
        return self._encode(llama_cpp_utf8(data) if self.newlines else data, False, normalize=False).tolist()

    def _encode(self, data: bytes, allow_special: bool, normalize: bool = True) -> np.ndarray:
        f_start, f_end, f_token = self._fragments(data, allow_special)
        if normalize and self.normalizer:
            data, f_start, f_end = self._normalized(data, f_start, f_end, f_token)
        if self.newlines or self._newline_bound:
            f_start, f_end, f_token = self._newline_runs(data, f_start, f_end, f_token)
        text = f_token < 0
        first = text & (f_start == 0)
        padded = np.frombuffer(data + b"\0\0", np.uint8)
        at = f_start[text]
        starts_space = np.zeros(len(f_start), np.bool_)   # a space or "▁": Metaspace adds no "▁" before it
        starts_space[text] = (padded[at] == sf.SPACE) | (
            (padded[at] == 0xE2) & (padded[at + 1] == 0x96) & (padded[at + 2] == 0x81))
        prefix = {"none": np.zeros_like(text), "every": text, "every-unless-space": text & ~starts_space,
                  "first-unless-space": first & ~starts_space}[self.prefix]
        buf = np.frombuffer(data, np.uint8)
        escaped = np.empty(3 * len(buf) + 3 * len(f_start) + 1, np.uint8)
        used = sf.escape(buf, f_start, f_end, f_token, prefix, escaped)
        out = np.empty(used + len(f_start), np.int64)    # at most one id per byte (plus the specials)
        k = sf.encode_pieces(escaped[:used], f_start, f_end, f_token, self.split, self.given_merges is not None,
                             self.vocab_size, self._c_keys, self._c_vals,
                             (self._rank, self._t_keys, self._t_vals, self._blob, self._starts, self._ends),
                             self._p_keys, self._p_vals,
                             self._byte_token, out)
        return out[:k].astype(np.int32)

    def _newline_runs(self, data: bytes, f_start, f_end, f_token):
        """The text fragments cut into runs of newlines and runs of other bytes; with `newlines`, a run of
        newlines that is a token becomes that token's fragment (step 2); without, the cut only saves time
        (_merges_stop_at_newlines)."""
        spans = []
        for s, e, t in zip(f_start.tolist(), f_end.tolist(), f_token.tolist()):
            if t >= 0:
                spans.append((s, e, t))
                continue
            for run in NEWLINE_RUNS.finditer(data, s, e):
                a, b = run.span()
                spans.append((a, b, self.find(run.group().decode()) if self.newlines and data[a] == 0x0A else -1))
        arr = np.array(spans, np.int64).reshape(-1, 3)
        return arr[:, 0].copy(), arr[:, 1].copy(), arr[:, 2].copy()

    def _fragments(self, data: bytes, allow_special: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(start, end, token) of each fragment of data: a special token's id, or -1 for text (step 1)."""
        ordered, trie = self._splitter(allow_special)
        n = len(data)
        if trie is None:            # the leftmost-longest scan could differ from llama.cpp's order here
            spans, at = [], 0
            for f in split_specials(data, ordered):
                size = len(f) if isinstance(f, bytes) else len(self.tokens[f].encode("utf-8", "surrogateescape"))
                spans.append((at, at + size, -1 if isinstance(f, bytes) else f))
                at += size
            arr = np.array(spans, np.int64).reshape(-1, 3)
            return arr[:, 0].copy(), arr[:, 1].copy(), arr[:, 2].copy()
        f_start, f_end, f_token = (np.empty(2 * n + 1, np.int64) for _ in range(3))
        k = sf.find_specials(np.frombuffer(data, np.uint8), *trie, f_start, f_end, f_token)
        return f_start[:k], f_end[:k], f_token[:k]

    def _splitter(self, allow_special: bool):
        """(the specials cut out of text, longest first, as (bytes, id); their trie for the compiled scan,
        or None when leftmost-longest could cut differently from llama.cpp's order)."""
        if allow_special not in self._splitters:
            kinds = (USER_DEFINED, CONTROL, UNKNOWN) if allow_special else (USER_DEFINED,)
            ids = np.flatnonzero(np.isin(self.types, kinds)).tolist()
            ordered = sorted(((self.tokens[i].encode("utf-8", "surrogateescape"), i) for i in ids),
                             key=lambda x: (-len(x[0]), x[1]))
            trie = None
            if leftmost_longest_is_exact([t for t, _ in ordered]):
                size = sum(len(t) for t, _ in ordered) + 1
                keys, vals = sf.table(size)
                term = np.full(size, -1, np.int64)
                sf.special_trie(self._blob, self._starts, self._ends, np.array(ids, np.int64), keys, vals, term)
                trie = (keys, vals, term)
            self._splitters[allow_special] = (ordered, trie)
        return self._splitters[allow_special]

    def _normalized(self, data: bytes, f_start, f_end, f_token):
        """data with each text fragment in the Unicode normal form (fragment offsets moved to match)."""
        parts, starts, ends, at = [], [], [], 0
        for s, e, t in zip(f_start.tolist(), f_end.tolist(), f_token.tolist()):
            piece = data[s:e]
            if t < 0:
                piece = unicodedata.normalize(self.normalizer, piece.decode("utf-8", "surrogatepass")).encode(
                    "utf-8", "surrogatepass")
            parts.append(piece)
            starts.append(at)
            at += len(piece)
            ends.append(at)
        return b"".join(parts), np.array(starts, np.int64), np.array(ends, np.int64)

    def encode_reference(self, text: str, allow_special: bool = False) -> list[int]:
        """encode, by the readable definitions above (slow; the tests hold encode equal to it)."""
        data = text.encode("utf-8", "surrogatepass")
        ordered = self._splitter(allow_special)[0]
        frags = split_specials(data, ordered)
        out: list[int] = []
        for i, f in enumerate(frags):
            if isinstance(f, int):
                out.append(f)
                continue
            s = f.decode("utf-8", "surrogatepass")
            if self.normalizer:
                s = unicodedata.normalize(self.normalizer, s)
            first = i == 0
            spaced = s.startswith((" ", METASPACE))
            if self.prefix == "every" or (self.prefix == "every-unless-space" and not spaced) or (
                    self.prefix == "first-unless-space" and first and not spaced):
                s = " " + s
            s = s.replace(" ", METASPACE)
            pieces = [s] if not self.split else split_before_metaspace(s)
            if self.newlines:
                pieces = [run for p in pieces for run in regex.findall(r"\n+|[^\n]+", p)]
            for piece in pieces:
                whole = self.find(piece) if self.newlines and set(piece) == {"\n"} else -1
                out += [whole] if whole >= 0 else self._merge_reference(piece.encode("utf-8", "surrogatepass"))
        return out

    def _merge_reference(self, data: bytes) -> list[int]:
        """BPE of one piece's bytes with merge_symbols (symbols are byte strings), then byte fallback."""
        find = self._find_bytes
        chars = utf8_chars(data)
        if self.given_merges is not None:      # Hugging Face: characters outside the vocabulary -> bytes first
            ranks = {(a, b): i for i, (a, b) in enumerate(self.given_merges.tolist())}
            symbols = []
            for c in chars:
                symbols += [c] if find(c) >= 0 else [self.tokens[self._byte_token[b]].encode() for b in c]

            def rank(a, b):
                r = ranks.get((find(a), find(b)))
                return None if r is None else (r, a + b)
        else:                                  # llama.cpp: any two symbols whose join is a token
            symbols = chars

            def rank(a, b):
                t = find(a + b)
                return None if t < 0 else (int(self._rank[t]), a + b)
        out = []
        for s in merge_symbols(symbols, rank):
            t = find(s)
            out += [t] if t >= 0 else [int(self._byte_token[b]) for b in s]
        return out

    def _find_bytes(self, b: bytes) -> int:
        return self.find(b.decode("utf-8", "surrogateescape"))

    # -- decoding -----------------------------------------------------------------------------------
    def decode_bytes(self, ids) -> bytes:
        """ids -> the exact bytes: pieces joined, the first one's leading space dropped when encode adds one."""
        data, cuts = self._joined_pieces()
        ids = self.check_ids(ids)
        starts, ends = cuts[ids].tolist(), cuts[ids + 1].tolist()
        out = b"".join([data[a:b] for a, b in zip(starts, ends)])
        if self.prefix != "none" and out[:1] == b" " and data[starts[0]:starts[0] + 1] == b" ":
            out = out[1:]
        return out

    # -- persistence --------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        """Our readable format: {"format", "version", "kind": "sentencepiece", "tokens", "types", "scores" or
        "merges" ([left id, right id] in rank order), "prefix", "split", ...}."""
        d = {"format": FORMAT, "version": VERSION, "kind": KIND, "vocab_size": self.vocab_size,
             "prefix": self.prefix, "split": self.split, "tokens": list(self.tokens), "types": self.types.tolist()}
        if self.scores is not None:
            d["scores"] = self.scores.tolist()
        else:
            d["merges"] = self.given_merges.tolist()
        for key, value in (("normalizer", self.normalizer), ("eos", self.eos_token), ("bos", self.bos_token),
                           ("chat_template", self.chat_template)):
            if value is not None:
                d[key] = value
        if self.stops:
            d["stops"] = list(self.stops)
        if self.newlines:
            d["newlines"] = True
        return d

    @classmethod
    def from_dict(cls, d) -> SentencePieceTokenizer:
        """Rebuild from to_dict() output, checking every field (a corrupt file gives a UserError)."""
        if not isinstance(d, dict) or d.get("kind") != KIND:
            raise UserError(f"not a nanoeuler SentencePiece tokenizer (\"kind\": \"{KIND}\")")
        if d.get("format") != FORMAT or d.get("version") != VERSION:
            raise UserError(f"not a nanoeuler tokenizer (expected \"format\": \"{FORMAT}\", \"version\": {VERSION})")
        tokens = d.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, str) and t for t in tokens):
            raise UserError("tokenizer.json: \"tokens\" must be a list of non-empty strings")
        types = numbers(d.get("types"), "iu", "\"types\" must be a list of integer token types")
        scores, merges = d.get("scores"), d.get("merges")
        if scores is not None:
            scores = numbers(scores, "iuf", "\"scores\" must be a list of finite numbers")
            if not np.isfinite(scores).all() or np.abs(scores).max(initial=0) > 3.4e38:
                raise UserError("tokenizer.json: \"scores\" must be a list of finite numbers")
        if merges is not None:
            merges = numbers(merges, "iu", "\"merges\" must be a list of [left id, right id] pairs")
            if merges.size and (merges.ndim != 2 or merges.shape[1] != 2):
                raise UserError("tokenizer.json: \"merges\" must be a list of [left id, right id] pairs")
        for key, kind in (("prefix", str), ("split", bool), ("normalizer", str), ("eos", str), ("bos", str),
                          ("chat_template", str), ("newlines", bool)):
            if d.get(key) is not None and not isinstance(d[key], kind):
                raise UserError(f"tokenizer.json: \"{key}\" must be a {kind.__name__}")
        stops = d.get("stops", [])
        if not isinstance(stops, list) or not all(isinstance(t, str) for t in stops):
            raise UserError("tokenizer.json: \"stops\" must be a list of special token strings")
        tok = cls(tokens, types, scores, merges, d.get("prefix", "none"),
                  d.get("split", False), d.get("normalizer"), d.get("eos"), d.get("bos"), d.get("chat_template"),
                  stops, d.get("newlines", False))
        if "vocab_size" in d and d["vocab_size"] != tok.vocab_size:
            raise UserError(f"tokenizer.json: vocab_size {d['vocab_size']!r:.20} disagrees with its {tok.vocab_size} tokens")
        return tok

    def vocab_text(self) -> str:
        """One line per token: id, the piece shown readably, its type, and its score (scores only)."""
        lines = [f"# nanoeuler SentencePiece BPE: {self.vocab_size} tokens; fingerprint {self.fingerprint()[:16]}"]
        scores = self.scores.tolist() if self.scores is not None else None
        for i, (t, ty) in enumerate(zip(self.tokens, self.types.tolist())):
            shown = json.dumps(t, ensure_ascii=False)[1:-1]
            lines.append(f"{i}\t'{shown}'\t{TYPE_NAMES[ty]}" + (f"\t{scores[i]:g}" if scores else ""))
        return "\n".join(lines) + "\n"

    # -- export -------------------------------------------------------------------------------------
    def to_hf_json(self) -> str:
        """A Hugging Face `tokenizers` JSON string: BPE with byte_fallback, the merges (with scores: every pair
        whose join is a token, in rank order), CONTROL / UNKNOWN / USER_DEFINED tokens as added tokens (special
        or not), spaces as "▁" by the normalizer (prefix "every": Prepend, as Llama-2's) or a Metaspace
        pre-tokenizer, decoders back to text."""
        if self.newlines:
            raise UserError("cannot export Gemma 4's newline rule (a run of newlines that is a token stays whole) "
                            "to Hugging Face's format")
        if self.scores is not None and self._score_pairs()[2]:
            raise UserError("cannot export: some tokens hold characters that are not tokens themselves, which the "
                            "Hugging Face BPE cannot merge as llama.cpp does")
        vocab = {t: i for i, t in enumerate(self.tokens)}
        merges = [[self.tokens[a], self.tokens[b]] for a, b in self.merges]
        added = [{"id": i, "content": self.tokens[i], "single_word": False, "lstrip": False, "rstrip": False,
                  "normalized": False, "special": int(self.types[i]) != USER_DEFINED}
                 for i in np.flatnonzero(np.isin(self.types, (CONTROL, UNKNOWN, USER_DEFINED))).tolist()]
        replace = {"type": "Replace", "pattern": {"String": " "}, "content": METASPACE}
        normalizers = [{"type": self.normalizer}] if self.normalizer else []
        pre = None
        if self.prefix == "every":
            normalizers += [{"type": "Prepend", "prepend": METASPACE}, replace]
        elif self.prefix == "none" and not self.split:
            normalizers.append(replace)
        else:
            pre = {"type": "Metaspace", "replacement": METASPACE, "split": self.split,
                   "prepend_scheme": {"none": "never", "every-unless-space": "always",
                                      "first-unless-space": "first"}[self.prefix]}
        if self.prefix == "every" and self.split:
            pre = {"type": "Metaspace", "replacement": METASPACE, "split": True, "prepend_scheme": "never"}
        decoders = [{"type": "Replace", "pattern": {"String": METASPACE}, "content": " "},
                    {"type": "ByteFallback"}, {"type": "Fuse"}]
        if self.prefix != "none":
            decoders.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
        d = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
             "normalizer": (None if not normalizers else normalizers[0] if len(normalizers) == 1
                            else {"type": "Sequence", "normalizers": normalizers}),
             "pre_tokenizer": pre, "post_processor": self.hf_post_processor(),
             "decoder": {"type": "Sequence", "decoders": decoders},
             "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                       "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": True,
                       "ignore_merges": False, "vocab": vocab, "merges": merges}}
        return json.dumps(d, ensure_ascii=False)


def numbers(values, kinds: str, what: str) -> np.ndarray:
    """values (a JSON list) as a numpy array whose dtype kind is one of kinds ("iu": integers), else
    UserError(what).  numbers([1, 2], "iu", ...) -> array([1, 2]);  numbers([1, "a"], "iu", ...) -> UserError"""
    try:
        arr = np.array(values) if isinstance(values, list) else None
    except (ValueError, OverflowError, TypeError):
        arr = None
    if arr is None or arr.size and arr.dtype.kind not in kinds:
        raise UserError(f"tokenizer.json: {what}")
    return arr


class TypedVocab:
    """What WordPiece and Unigram share: a vocabulary of `tokens` typed by `types` (the constants above), whose
    user-defined tokens are cut out of text (and its control and unknown ones too when allow_special); encode
    puts bos first and, with add_eos, eos last. The class defines _encode(data, allow_special) -> ids."""

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    def encode_array(self, text: str, allow_special: bool = False, add_bos: bool = False) -> np.ndarray:
        """Like encode, as an int32 array."""
        if not isinstance(text, str):
            raise UserError(f"encode takes str, got {type(text).__name__} (use encode_bytes for bytes)")
        ids = self._encode(text.encode("utf-8", "surrogatepass"), allow_special)
        if add_bos and self.bos_token is not None:
            ids = [self.special_tokens[self.bos_token], *ids]
        if add_bos and self.add_eos:
            ids = [*ids, self.special_tokens[self.eos_token]]
        return np.array(ids, np.int32)

    def _splitter(self, allow_special: bool) -> list[tuple[bytes, int]]:
        """The specials cut out of text, longest first, as (bytes, id)."""
        if allow_special not in self._splitters:
            kinds = (USER_DEFINED, CONTROL, UNKNOWN) if allow_special else (USER_DEFINED,)
            ids = np.flatnonzero(np.isin(self.types, kinds)).tolist()
            self._splitters[allow_special] = sorted(((self.tokens[i].encode("utf-8", "surrogatepass"), i)
                                                     for i in ids), key=lambda x: (-len(x[0]), x[1]))
        return self._splitters[allow_special]


def typed_vocab_fields(d, kind: str, name: str, fmt: tuple[str, int], optional: tuple) -> tuple[list, np.ndarray, list]:
    """The checks a TypedVocab's to_dict() output passes before its own fields are read: its kind (name: how
    errors call it) and fmt (format, version), tokens (non-empty strings), integer types, an "unk" string, stops,
    and each optional (key, type) absent, None or of its type -> (tokens, types, stops); else UserError."""
    if not isinstance(d, dict) or d.get("kind") != kind:
        raise UserError(f"not a nanoeuler {name} tokenizer (\"kind\": \"{kind}\")")
    if d.get("format") != fmt[0] or d.get("version") != fmt[1]:
        raise UserError(f"not a nanoeuler tokenizer (expected \"format\": \"{fmt[0]}\", \"version\": {fmt[1]})")
    tokens = d.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, str) and t for t in tokens):
        raise UserError("tokenizer.json: \"tokens\" must be a list of non-empty strings")
    types = numbers(d.get("types"), "iu", "\"types\" must be a list of integer token types")
    for key, typ in optional:
        if d.get(key) is not None and (not isinstance(d[key], typ) or typ is int and isinstance(d[key], bool)):
            raise UserError(f"tokenizer.json: \"{key}\" must be a {typ.__name__}")
    if not isinstance(d.get("unk"), str):
        raise UserError("tokenizer.json: \"unk\" (the unknown token) is missing")
    stops = d.get("stops", [])
    if not isinstance(stops, list) or not all(isinstance(t, str) for t in stops):
        raise UserError("tokenizer.json: \"stops\" must be a list of special token strings")
    return tokens, types, stops


def check_vocab_size(d: dict, tok) -> None:
    """A to_dict() output's vocab_size, when given, is its tokenizer's."""
    if "vocab_size" in d and d["vocab_size"] != tok.vocab_size:
        raise UserError(f"tokenizer.json: vocab_size {d['vocab_size']!r:.20} disagrees with its {tok.vocab_size} tokens")


def merge_ids(tokens: Sequence[str], merges: list[str]) -> np.ndarray:
    """GGUF's merges ("a b": the first space after the first character cuts it, as llama.cpp reads them) as
    [merges, 2] ids of tokens (a list, or Pieces: their blob is used as it is); a merge whose sides are not two
    tokens: UserError.  merge_ids(["a", "b", "ab"], ["a b"]) -> [[0, 1]]"""
    def joined(texts):
        raw = [t.encode("utf-8", "surrogateescape") for t in texts]
        ends = np.cumsum(np.fromiter(map(len, raw), np.int64, len(raw)))
        return np.frombuffer(b"".join(raw) or b"\0", np.uint8), ends - np.diff(ends, prepend=0), ends
    blob, starts, ends = (tokens.blob, tokens.starts, tokens.ends) if isinstance(tokens, Pieces) else joined(tokens)
    t_keys, t_vals = sf.table(len(tokens))
    sf.text_table(blob, starts, ends, t_keys, t_vals)
    out = np.empty((len(merges), 2), np.int64)
    bad = sf.merge_texts(*joined(merges), t_keys, t_vals, blob, starts, ends, out)
    if bad >= 0:
        raise UserError(f"merge {bad} {merges[bad]!r:.60} is not two tokens")
    return out


def llama_cpp_utf8(data: bytes) -> bytes:
    """data with each byte that starts no UTF-8 character (read by its lead byte's high bits and continuation
    bytes, as llama.cpp's unicode_cpts_from_utf8 reads them) replaced by U+FFFD, one per byte.
    llama_cpp_utf8(b"a\\xe2\\x82b") -> b'a\\xef\\xbf\\xbd\\xef\\xbf\\xbdb'"""
    try:
        data.decode("utf-8")
        return data
    except UnicodeDecodeError:
        pass
    out, at = [], 0
    while at < len(data):
        n = utf8_length(data, at)
        out.append(data[at:at + n] if n else b"\xef\xbf\xbd")
        at += n or 1
    return b"".join(out)


def utf8_length(data: bytes, at: int) -> int:
    """The length of the UTF-8 character at data[at] as llama.cpp's unicode_cpt_from_utf8 reads it (the lead
    byte's high bits and continuation bytes only: no check of overlong forms or surrogates), 0 if it reads none.
    utf8_length(b"\\xc3\\xa9", 0) -> 2;  utf8_length(b"\\xc3a", 0) -> 0;  utf8_length(b"\\xed\\xa0\\x80", 0) -> 3"""
    b = data[at]
    n = 1 if b < 0x80 else 0 if b < 0xC0 else 2 if b < 0xE0 else 3 if b < 0xF0 else 4 if b < 0xF8 else 0
    if n == 0 or at + n > len(data) or any(c & 0xC0 != 0x80 for c in data[at + 1:at + n]):
        return 0
    return n


def split_before_metaspace(s: str) -> list[str]:
    """Hugging Face Metaspace's split: a piece starts at each "▁".  split_before_metaspace("a▁b▁▁c") ->
    ['a', '▁b', '▁', '▁c']"""
    out, at = [], 0
    for i in range(1, len(s) + 1):
        if i == len(s) or s[i] == METASPACE:
            out.append(s[at:i])
            at = i
    return [p for p in out if p]


def leftmost_longest_is_exact(specials: list[bytes]) -> bool:
    """Whether cutting specials out leftmost-longest (one scan, spm_fast.find_specials) gives what llama.cpp's
    longest-first order (split_specials) gives. They can differ only where two specials overlap, s then t
    (a suffix of s is a prefix of t): llama.cpp takes the longer first, the scan the one that starts first.
    That is harmless when t is not shorter than s and also starts where s starts (runs such as "\\n\\n" and
    "\\n\\n\\n": the scan then takes t or longer at that start anyway); any other overlap gives False.

        leftmost_longest_is_exact([b"ab", b"bcd"]) -> False ("abcd": llama.cpp cuts a|bcd, the scan ab|cd)
    """
    by_prefix: dict[bytes, list[bytes]] = {}
    for t in specials:
        for k in range(1, len(t)):
            by_prefix.setdefault(t[:k], []).append(t)
    for s in specials:
        for k in range(1, len(s)):
            for t in by_prefix.get(s[-k:], ()):
                if t != s and len(t) >= len(s) and (s + t[k:])[:len(t)] != t:
                    return False
    return True

