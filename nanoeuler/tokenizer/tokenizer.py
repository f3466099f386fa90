"""Byte-level BPE tokenizer: train, encode, decode, save, load, export (the tokenizer of SPEC.md).

Ids 0..255 are the raw bytes, id 256 + i is merge i, and the special tokens (at least `</s>`) come last:

    tok = Tokenizer.train(["low lower lowest"], vocab_size=260, progress=False)
    tok.merges                   # -> [(108, 111), (256, 119), (32, 257)]: 'lo', 'low', ' low'
    tok.encode(" lowest")        # -> [258, 101, 115, 116]: ' low', 'e', 's', 't'
    tok.decode(tok.encode(s)) == s        # for every string s; decode_bytes(encode_bytes(b)) == b too

Text is first cut into pre-tokens with the GPT-2 pattern (contractions, letter runs, number runs, punctuation
runs, whitespace; one leading space sticks to the next word), then each pre-token's bytes are merged by BPE.
An imported tokenizer may carry another pattern, or a cascade of them (llama.cpp's `default`: each regex cuts
the pieces the previous ones left; pretokenize.py checks patterns and cuts text). Training counts unique
pre-tokens once and updates pair counts incrementally per merge; encoding caches the ids of every pre-token it
has seen. The hot loops are compiled with numba (`nanoeuler.tokenizer.bpe_fast`); the plain-Python reference
versions below (`get_stats`, `merge`, `bpe`) define what they compute, and the tests hold the two equal.

`tokenizer.json` is our own readable format (pattern — a regex, or a list of them for a cascade —, merges
as id pairs, specials; an imported vocabulary's "tokens" where merge i does not make token 256 + i); `save` also writes a `tokenizer.vocab` beside it, one token per line, for people.
`to_hf_json()` exports to the Hugging Face `tokenizers` format, which then encodes identically.

Imported vocabularies keep their own ids. A Hugging Face vocabulary numbers the same tokens its own way
(GPT-2: '!' = 0, ..., byte 32 'Ġ' = 220; SmolLM: specials first), and a model's embedding rows follow it.
Such a Tokenizer carries `ids`, the id of each token in the order above (bytes, merges, specials), and
applies it only at its boundary: the BPE engine works in its own numbering, while encode* return, and
decode*, token_bytes, special_tokens, eos_id take or give, the model's ids. Without `ids` (every
tokenizer trained here) the two numberings are one and nothing is mapped:

    tok = Tokenizer([(104, 105)], ["</s>"], ids=[*range(1, 257), 0, 257])   # 'hi' -> id 0, '</s>' -> 257
    tok.encode("hi!")            # -> [0, 34]: 'hi', '!' (byte 33 has id 34)
    tok.decode([0, 34])          # -> 'hi!'

Imported vocabularies need not be built merge by merge. Merges apply by rank, as Hugging Face and llama.cpp
apply them: the adjacent pair of lowest rank merges (the leftmost of equals), one at a time, each making the
token of its two sides' joined bytes. Llama-3's merge 1 ('Ġ', 'ĠĠĠ') uses a token a later merge makes, and
its 280,147 merges make 128,000 tokens (several make one): such a Tokenizer carries `tokens`, the bytes of
every ordinary token after the 256 bytes, and its merges name any of them. With `ignore_merges` (Llama-3) a
pre-token that is a token as a whole is that token, merged or not:

    tok = Tokenizer([(256, 97), (97, 98)], [], tokens=[b"ab", b"aba"])   # 'ab'+'a' ranks before 'a'+'b'
    tok.encode("abab")           # -> [257, 98]: 'ab' is made, joins the 'a' beside it, then 'b' is left

A vocabulary may also lack some bytes (SmolLM2's has no token for 21 of them: bytes 4, 6, 0xC0, 0xF5, ...):
their entry in `ids` is -1. BPE still sees such a byte, so it sits between its neighbours and no merge
crosses it, and then it is left out of the ids, as llama.cpp does (`llm_tokenizer_bpe_session` emits
nothing for a symbol the vocabulary lacks). Hugging Face `tokenizers` leaves the character out *before*
merging instead, so its neighbours may merge across the gap: "a\x04b" can give 'ab' there and 'a', 'b' here.
We follow llama.cpp, the runtime these vocabularies ship for.

`bos` names a special token that `encode(..., add_bos=True)` puts first (an imported Llama-3's
`<|begin_of_text|>`, from its tokenizer.json post_processor), so that
`encode(text, allow_special=True, add_bos=True)` gives what `AutoTokenizer(text)` gives.
"""
from __future__ import annotations

import functools
import json
import os
import re
import threading
import unicodedata
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import regex

from ..errors import UserError
from .base import BaseTokenizer
from .pretokenize import GPT2_PATTERN, check_pattern, findall_bounded, hf_splits, pretokenize, split_cascade

FORMAT = "nanoeuler-bpe"
VERSION = 1
NORMALIZERS = (None, "NFC", "NFD", "NFKC", "NFKD")
MAX_CACHED_PIECE = 64  # pre-tokens longer than this (bytes) are not cached when encoding
MAX_CACHED_PIECES = 1 << 20  # the regex path's cache of pre-tokens starts afresh past this many
CHUNK_BYTES = 1 << 22  # long texts are scanned in pieces of about this size (bounded scratch memory)
_SAFE_CUT = re.compile(rb"[\x21-\x7e](?=[ \n])")


# ------------------------------------------------------------------- reference algorithms (readable)

def get_stats(ids: list[int], counts: dict | None = None, weight: int = 1) -> dict:
    """Count adjacent pairs.  get_stats([1, 2, 3, 1, 2]) -> {(1, 2): 2, (2, 3): 1, (3, 1): 1}"""
    counts = {} if counts is None else counts
    for pair in zip(ids, ids[1:]):
        counts[pair] = counts.get(pair, 0) + weight
    return counts


def merge(ids: list[int], pair: tuple[int, int], idx: int) -> list[int]:
    """Replace every occurrence of pair, left to right.  merge([1, 2, 3, 1, 2], (1, 2), 4) -> [4, 3, 4]"""
    out, i = [], 0
    while i < len(ids):
        if i + 1 < len(ids) and ids[i] == pair[0] and ids[i + 1] == pair[1]:
            out.append(idx)
            i += 2
        else:
            out.append(ids[i])
            i += 1
    return out


def bpe(piece: bytes, ranks: dict[tuple[int, int], tuple[int, int]]) -> list[int]:
    """Encode one pre-token: merge the adjacent pair of lowest rank (the leftmost of equals), one at a time,
    until no pair merges. ranks: pair -> (rank, the id it makes), as Hugging Face and llama.cpp rank merges.

        bpe(b"aaab", {(97, 97): (0, 256), (256, 97): (1, 257)})  ->  [256, 97, 98] -> [257, 98]

    One pair at a time, not every occurrence at once: when a merge may use a token that a later merge makes
    (Llama-3's), the token just made can merge with its neighbour before the next occurrence does.
    """
    ids = list(piece)
    while len(ids) >= 2:
        found = [(ranks[p][0], i) for i, p in enumerate(zip(ids, ids[1:])) if p in ranks]
        if not found:
            break
        _, i = min(found)
        ids[i:i + 2] = [ranks[ids[i], ids[i + 1]][1]]
    return ids


def train_reference(texts: Iterable[str], vocab_size: int, specials=("</s>",)) -> list[tuple[int, int]]:
    """Slow, obvious BPE training (recount everything per merge): the definition the fast trainer meets.
    Same tie-break: the most frequent pair, then the smallest (left, right); merges never repeat bytes."""
    words: dict[bytes, int] = {}
    for text in texts:
        for piece in pretokenize(text):
            b = piece.encode("utf-8", "surrogatepass")
            words[b] = words.get(b, 0) + 1
    seqs = {w: list(w) for w in words}
    vocab = {i: bytes([i]) for i in range(256)}
    seen = set(vocab.values())
    merges, banned = [], set()
    while 256 + len(merges) + len(specials) < vocab_size:
        stats: dict = {}
        for w, ids in seqs.items():
            get_stats(ids, stats, words[w])
        stats = {p: c for p, c in stats.items() if p not in banned}
        if not stats:
            break
        pair = min(stats, key=lambda p: (-stats[p], p))
        new = vocab[pair[0]] + vocab[pair[1]]
        if new in seen:
            banned.add(pair)
            continue
        idx = 256 + len(merges)
        vocab[idx] = new
        seen.add(new)
        merges.append(pair)
        seqs = {w: merge(ids, pair, idx) for w, ids in seqs.items()}
    return merges


# ------------------------------------------------------------------------------------ tokenizer

class Tokenizer(BaseTokenizer):
    """A trained byte-level BPE tokenizer (immutable once built).

    The ids it takes and gives are the model's (`special_tokens`, `eos_id`, `bos_id`, encode*, decode*,
    token_bytes); `merges` and the saved "specials" are in the engine's numbering (bytes, merges, specials),
    which `ids` (None: the same numbering) maps to the model's.
    """

    kind = "byte-level"

    def __init__(self, merges: list[tuple[int, int]], specials: Iterable[str] = ("</s>",),
                 pattern: str | Iterable[str] = GPT2_PATTERN, eos: str | None = "</s>", normalizer: str | None = None,
                 ids: Iterable[int] | None = None, bos: str | None = None, chat_template: str | None = None,
                 stops: Iterable[str] = (), tokens: Iterable[bytes] | None = None, ignore_merges: bool = False,
                 user_defined: Iterable[str] = ()):
        """merges: (left, right) pairs in the engine's numbering, by rank; tokens: the bytes of the ordinary
        tokens after the 256 bytes (None: merge i makes token 256 + i, as this library trains them; see
        "Imported vocabularies" in the module docstring); ids: the id of each token, bytes then ordinary tokens
        then specials (None: that order); bos: a special put first by encode(..., add_bos=True); chat_template:
        the model's Jinja chat template (None: ours, see chat_template.py); stops: specials besides eos that
        end a reply (ChatML's <|im_end|>, Llama-3's <|eot_id|>); ignore_merges: a pre-token that is an
        ordinary token as a whole is that token, before any merge (Llama-3); user_defined: specials cut out
        of text even when encode is not asked to (llama.cpp's USER_DEFINED tokens, Hugging Face's added
        tokens that are not special)."""
        if normalizer not in NORMALIZERS:
            raise UserError(f"unknown normalizer {normalizer!r}; choose one of NFC, NFD, NFKC, NFKD or none")
        self.normalizer = normalizer  # Unicode normal form applied to text before encoding (Qwen2: NFC)
        # one regex (its matches are the pre-tokens), or a tuple of them: a cascade (see split_cascade)
        self.pattern = pattern if isinstance(pattern, str) else tuple(pattern)
        self.eos_token = eos  # the special that ends a text / response ("</s>" here; "<|endoftext|>" for GPT-2)
        self._merge_sides = np.asarray(merges, np.int64).reshape(-1, 2)   # [merges, 2]: (left, right)
        self.ignore_merges = bool(ignore_merges)
        self._vocab, self._results = vocabulary(self._merge_sides, tokens)
        # the classic vocabulary (merge i makes token 256 + i) needs no token list: same file, same fingerprint
        self.tokens = None if tokens is None or is_classic(self._results, len(self._vocab)) else self._vocab[256:]
        self._token_id = None   # bytes -> engine id of the ordinary tokens (ignore_merges), built on first use
        n = self._n_ordinary = len(self._vocab)
        self._specials = {s: n + i for i, s in enumerate(specials)}  # in the engine's numbering
        for s in self._specials:
            try:
                self._vocab.append(s.encode("utf-8"))
            except UnicodeEncodeError:  # a file's string that was not UTF-8 (read with surrogateescape)
                raise UserError(f"the special token {s!r} is not valid UTF-8") from None
        # the id map (None: the identity), its inverse, and the vocabulary in the model's id order
        self.ids = None if ids is None else check_ids(ids, len(self._vocab))
        if self.ids is not None and np.array_equal(self.ids, np.arange(len(self._vocab))):
            self.ids = None  # the identity is no map: same file, same fingerprint as without one
        # the bytes the vocabulary lacks (id -1): encode drops them (see the module docstring)
        self._absent = None if self.ids is None or self.ids.min() >= 0 else self.ids < 0
        if self.ids is None:
            self._ids32, self._vocab_ext = None, self._vocab
        else:
            self._ids32 = self.ids.astype(np.int32)
            self._vocab_ext = [b""] * int(self.ids.max() + 1)
            for i, e in enumerate(self.ids.tolist()):
                if e >= 0:
                    self._vocab_ext[e] = self._vocab[i]
        self.special_tokens = {s: self._external(i) for s, i in self._specials.items()}
        if bos is not None and bos not in self._specials:
            raise UserError(f"the bos token {bos!r} is not one of the special tokens {list(self._specials)}")
        self.bos_token = bos
        self.chat_template = chat_template
        self.stops = tuple(stops)
        for t in self.stops:
            if t not in self._specials:
                raise UserError(f"the stop token {t!r} is not one of the special tokens")
        self.user_defined = tuple(user_defined)
        for t in self.user_defined:
            if t not in self._specials:
                raise UserError(f"the user-defined token {t!r:.40} is not one of the special tokens")
        self._regex = (regex.compile(self.pattern) if isinstance(self.pattern, str)
                       else tuple(regex.compile(p) for p in self.pattern))
        self._special_regex: dict[bool, object] = {}   # allow_special -> cut_regex of what it cuts, built on first use
        self._fast = None   # numba tables, built on first encode
        self._pairs = None  # the merge table the kernels read, built on first encode
        self._lock = threading.Lock()  # the cache and scratch arrays are shared: one encode at a time
        # the Python int of each token's id, indexed in the engine's numbering (the map costs nothing here)
        self._int_objects = (np.arange(len(self._vocab)) if self.ids is None else self.ids).astype(object)
        self._cache: dict[str, list[int]] = {}  # pre-token -> ids, for the regex path (non-GPT-2 patterns)

    @functools.cached_property
    def merges(self) -> list[tuple[int, int]]:
        """The merges, by rank, as (left, right) pairs in the engine's numbering (a list made on first use)."""
        return list(zip(self._merge_sides[:, 0].tolist(), self._merge_sides[:, 1].tolist()))

    @property
    def _ranks(self) -> dict[tuple[int, int], tuple[int, int]]:
        """pair -> (rank, the id it makes), in the engine's numbering: what the reference `bpe` takes."""
        return {pair: (r, int(self._results[r])) for r, pair in reversed(list(enumerate(self.merges)))}

    # -- basic facts -------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return len(self._vocab_ext)

    def token_bytes(self, i: int) -> bytes:
        """The bytes of token i.  token_bytes(104) -> b'h'"""
        if not 0 <= int(i) < self.vocab_size:
            raise UserError(f"token id {i} is out of range (vocabulary size {self.vocab_size})")
        return self._vocab_ext[int(i)]

    def _external(self, i: int) -> int:
        """The id of the token the engine numbers i."""
        return i if self.ids is None else int(self.ids[i])

    def byte_level_vocab(self) -> tuple[list[str], list[bool], list[str]]:
        """What the Hugging Face / GGUF byte-level BPE formats store: (the string of each id, bytes in
        GPT-2's printable alphabet and specials as they are; whether each id is special; the merges as
        "left right" strings, in merge order).  Trained on 'hi': (['!', ..., 'Ġ', 'hi', '</s>'], [..., True], ['h i'])"""
        alphabet = bytes_to_unicode()
        n = self._n_ordinary
        strings = ["".join(alphabet[b] for b in self._vocab[i]) for i in range(n)] + list(self._specials)
        merges = [f"{strings[a]} {strings[b]}" for a, b in self.merges]
        special = [i >= n for i in range(len(strings))]
        order = self._engine_order()
        if order is not None:
            strings, special = [strings[i] for i in order], [special[i] for i in order]
        return strings, special, merges

    def _engine_order(self) -> list[int] | None:
        """The engine's number of each id, in id order (None: the identity).  ids [1, 0, 2] -> [1, 0, 2];
        with absent bytes, [-1, 1, 0] -> [2, 1]"""
        if self.ids is None:
            return None
        order = np.argsort(self.ids)
        return order[int((self.ids < 0).sum()):].tolist()

    def __repr__(self) -> str:
        return (f"Tokenizer(vocab_size={self.vocab_size}, merges={len(self._merge_sides)}, "
                f"specials={list(self.special_tokens)})")

    # -- training -----------------------------------------------------------------------------------
    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int, specials=("</s>",), progress: bool = True) -> Tokenizer:
        """Learn vocab_size - 256 - len(specials) merges from texts (any iterable of str, streamed).

        Unique pre-tokens are counted once (compiled scanner + hash table), then every merge updates only
        the pair counts around the positions it touches. Ties: the smallest (left id, right id) wins.
        """
        def utf8():
            for text in texts:
                if not isinstance(text, str):
                    raise UserError(f"training texts must be str, got {type(text).__name__}")
                yield text.encode("utf-8", "surrogatepass")
        return cls._train_utf8(utf8(), vocab_size, specials, progress)

    @classmethod
    def train_files(cls, paths: Iterable[str | Path], vocab_size: int, specials=("</s>",),
                    progress: bool = True) -> Tokenizer:
        """Train on text files, read as bytes in ~4 MB blocks cut where no pre-token changes (any size;
        bytes that are not UTF-8 are learned as they are)."""
        paths = [Path(p) for p in paths]
        for p in paths:
            if not p.is_file():
                raise UserError(f"training file not found: {p}")
        total = sum(p.stat().st_size for p in paths)
        return cls._train_utf8(_read_blocks(paths), vocab_size, specials, progress, total)

    @classmethod
    def _train_utf8(cls, blocks: Iterable[bytes], vocab_size: int, specials, progress: bool,
                    total: int | None = None) -> Tokenizer:
        from tqdm import tqdm

        from . import bpe_fast as bf

        specials = tuple(specials)
        if len(set(specials)) != len(specials) or any(not isinstance(s, str) or not s for s in specials):
            raise UserError(f"special tokens must be distinct non-empty strings, got {list(specials)}")
        n_merges = int(vocab_size) - 256 - len(specials)
        if n_merges < 0:
            raise UserError(f"vocab size {vocab_size} is too small: it must be at least 256 byte tokens + "
                            f"{len(specials)} special token(s) = {256 + len(specials)}")
        # 1. count unique pre-tokens: an open-addressing table of (hash, offset, length, count), bytes in pool
        table = bf.char_classes()
        cap = 1 << 16
        h_hash, h_off = np.zeros(cap, np.uint64), np.zeros(cap, np.int64)
        h_len, h_cnt = np.zeros(cap, np.int64), np.zeros(cap, np.int64)
        pool = np.empty(1 << 20, np.uint8)
        state = np.zeros(3, np.int64)
        content = False
        bar = tqdm(total=total, desc="count pre-tokens", unit="B", unit_scale=True, disable=not progress)
        for data in blocks:
            if not content and data and not data.isspace():
                content = True
            cuts = cut_points(data) if len(data) > CHUNK_BYTES else [0, len(data)]
            for s, e in zip(cuts, cuts[1:]):
                buf = np.frombuffer(data, np.uint8, e - s, s)
                state[2] = 0
                while bf.count_pieces(buf, table, h_hash, h_off, h_len, h_cnt, pool, state):
                    if state[0] * 2 >= len(h_hash):
                        h_hash, h_off, h_len, h_cnt = bf.rehash(h_hash, h_off, h_len, h_cnt, 2 * len(h_hash))
                    else:
                        pool = np.concatenate([pool, np.empty(len(pool) + len(buf), np.uint8)])
            bar.update(len(data))
        bar.close()
        if not content:
            raise UserError("the training text is empty or only whitespace: nothing to learn a vocabulary from")
        used = h_hash != 0
        w_off, w_len, w_cnt = h_off[used], h_len[used], h_cnt[used]
        if int(w_len[w_len >= 2].sum()) >= (1 << 29):  # positions and pair entries are int32
            raise UserError(f"too much distinct text to train on ({state[0]} unique pre-tokens, "
                            f"{int(w_len.sum())} bytes); train the tokenizer on a sample of the corpus")

        # 2. merges, in chunks of 256 so that the progress bar moves (the state is passed through)
        st = list(bf.train_init(pool, w_off, w_len, w_cnt))
        h_c, h_p, h_size = bf.heap_build(st[5], st[6], st[10])
        toks = list(bf.token_tables(256 + n_merges))
        banned = np.zeros(0, np.bool_)
        done = 0
        bar = tqdm(total=n_merges, desc="learn merges", unit="merge", disable=not progress)
        while done < n_merges:
            stop = min(n_merges, done + 256)
            out = bf.train_merges(*st, h_c, h_p, h_size, *toks, banned, done, stop)
            st, (h_c, h_p, h_size), toks, banned = list(out[:12]), out[12:15], list(out[15:21]), out[21]
            bar.update(out[22] - done)
            done = out[22]
            if done < stop:  # no pair left: the text is too small for this vocabulary
                break
        bar.close()
        left, right = toks[0], toks[1]
        merges = list(zip(left[256:256 + done].tolist(), right[256:256 + done].tolist()))
        return cls(merges, specials)

    # -- encoding -----------------------------------------------------------------------------------
    def encode(self, text: str, allow_special: bool = False, add_bos: bool = False) -> list[int]:
        """text -> ids. Special-token strings in text are ordinary text unless allow_special=True;
        add_bos=True puts the bos token first (if the tokenizer has one)."""
        out = self._engine_ids(text, allow_special, add_bos)
        # one shared Python int per id, the map folded in (the list is built from them: faster than
        # array.tolist(), and the map costs nothing here)
        return self._int_objects.take(out).tolist()

    def encode_array(self, text: str, allow_special: bool = False, add_bos: bool = False) -> np.ndarray:
        """Like encode, as an int32 array (no Python list: the fast path for bulk work)."""
        out = self._engine_ids(text, allow_special, add_bos)
        return out if self._ids32 is None else self._ids32.take(out)

    def _engine_ids(self, text: str, allow_special: bool, add_bos: bool) -> np.ndarray:
        """encode's ids in the engine's numbering (the map not applied yet), the bos first if asked and any."""
        out = self._present(self._encode_text(text, allow_special))
        if add_bos and self.bos_token is not None:
            out = np.concatenate([np.array([self._specials[self.bos_token]], np.int32), out])
        return out

    def _encode_text(self, text: str, allow_special: bool) -> np.ndarray:
        """text -> ids in the engine's numbering (the id map not applied)."""
        if not isinstance(text, str):
            raise UserError(f"encode takes str, got {type(text).__name__} (use encode_bytes for bytes)")
        if self.normalizer:
            text = unicodedata.normalize(self.normalizer, text)
        return self._encode_str(text, allow_special, "surrogatepass")

    def encode_bytes(self, data: bytes) -> list[int]:
        """Any bytes -> ids (invalid UTF-8 included); decode_bytes(encode_bytes(b)) == b exactly."""
        text = bytes(data).decode("utf-8", "surrogateescape")   # a byte that is not UTF-8 -> a lone surrogate
        return self._int_objects.take(self._present(self._encode_str(text, False, "surrogateescape"))).tolist()

    def _present(self, out: np.ndarray) -> np.ndarray:
        """out without the bytes the vocabulary lacks (in the engine's numbering)."""
        return out if self._absent is None else out[~self._absent[out]]

    def _encode_str(self, text: str, allow_special: bool, errors: str) -> np.ndarray:
        """The special tokens cut out of text (the user-defined ones always, the others when allow_special),
        BPE on what lies between them; errors: how a lone surrogate in text becomes bytes."""
        if allow_special not in self._special_regex:
            self._special_regex[allow_special] = cut_regex(self._specials if allow_special else self.user_defined)
        cut = self._special_regex[allow_special]
        parts = [text] if cut is None else cut.split(text)
        out = [np.array([self._specials[part]], np.int32) if i % 2 else self._encode_utf8(part, errors)
               for i, part in enumerate(parts) if part]
        return out[0] if len(out) == 1 else np.concatenate(out) if out else np.zeros(0, np.int32)

    def _encode_utf8(self, text: str, errors: str) -> np.ndarray:
        """The BPE ids of text with no special token in it: the compiled scanner for the GPT-2 pattern, else the
        regex's pre-tokens, each encoded once (`_bpe`) and cached."""
        if self.pattern == GPT2_PATTERN and not self.ignore_merges:
            return self._encode_fast(text.encode("utf-8", errors))
        out: list[int] = []
        cache = self._cache
        if len(cache) > MAX_CACHED_PIECES:
            cache.clear()
        for piece in self.pre_tokens(text):
            data = piece.encode("utf-8", errors)
            ids = cache.get(data)
            if ids is None:
                ids = cache[data] = self._bpe(data)
            out.extend(ids)
        return np.array(out, np.int32)

    def _bpe(self, piece: bytes) -> list[int]:
        """One pre-token's ids (the engine's numbering): with ignore_merges the token it is as a whole, if it is
        one; else BPE (the compiled twin of `bpe`)."""
        from . import bpe_fast as bf
        if self.ignore_merges:
            if self._token_id is None:
                self._token_id = {t: i for i, t in enumerate(self._vocab[:self._n_ordinary])}
            whole = self._token_id.get(piece)
            if whole is not None:
                return [whole]
        keys, vals = self._pair_table()
        return bf.bpe_bytes(np.frombuffer(piece, np.uint8), keys, vals).tolist()

    def _pair_table(self) -> tuple[np.ndarray, np.ndarray]:
        """The compiled kernels' merge table (bpe_fast.pair_table), built on first use."""
        from . import bpe_fast as bf
        if self._pairs is None:
            self._pairs = bf.pair_table(self._merge_sides, self._results)
        return self._pairs

    def pre_tokens(self, text: str) -> list[str]:
        """The pieces BPE encodes one by one.  GPT-2 pattern: pre_tokens("it's 42") -> ['it', "'s", ' 42']"""
        if isinstance(self.pattern, str):
            return findall_bounded(self._regex, text)
        return split_cascade(self._regex, text)

    def _encode_fast(self, data: bytes) -> np.ndarray:
        with self._lock:
            return self._encode_fast_locked(data)

    def _encode_fast_locked(self, data: bytes) -> np.ndarray:
        from . import bpe_fast as bf

        f = self._fast
        if f is None:
            keys, vals = self._pair_table()
            f = self._fast = dict(table=bf.char_classes(), keys=keys, vals=vals)
            self._new_cache(1 << 15)
            self._scratch(1 << 16)
        cuts = cut_points(data) if len(data) > CHUNK_BYTES else [0, len(data)]
        parts = []
        for s, e in zip(cuts, cuts[1:]):
            buf = np.frombuffer(data, np.uint8, e - s, s)
            if len(buf) > len(f["out"]):
                self._scratch(len(buf))
            k = bf.encode_buf(buf, f["table"], f["keys"], f["vals"], f["c_tab"], f["k_pool"], f["v_pool"],
                              f["c_state"], f["cls"], f["ends"], f["out"], MAX_CACHED_PIECE)
            parts.append(f["out"][:k].copy())
            if f["c_state"][0] * 3 > len(f["c_tab"]) and len(f["c_tab"]) < (1 << 21):
                self._new_cache(2 * len(f["c_tab"]))  # busy cache: grow it (it restarts empty)
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def _new_cache(self, slots: int) -> None:
        """An empty encode cache of `slots` slots (a power of two) with room for ~slots/2 pre-tokens."""
        self._fast.update(c_tab=np.zeros((slots, 4), np.int64), k_pool=np.empty(slots * 8, np.uint8),
                          v_pool=np.empty(slots * 4, np.int32), c_state=np.zeros(3, np.int64))

    def _scratch(self, n: int) -> None:
        self._fast.update(cls=np.empty(n, np.uint8), ends=np.empty(n, np.int64), out=np.empty(n, np.int32))

    # -- decoding -----------------------------------------------------------------------------------
    def decode_bytes(self, ids) -> bytes:
        """ids -> the exact bytes (no replacement characters).  decode_bytes([104, 105]) -> b'hi'"""
        vocab = self._vocab_ext
        return b"".join([vocab[i] for i in self.check_ids(ids).tolist()])

    # -- persistence --------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        """Our readable format: {"format", "version", "pattern", "merges": [[left, right], ...], "specials"}
        in the engine's numbering, plus, for an imported vocabulary, "ids" (the id of each token in that
        order: bytes, ordinary tokens, specials), "bos", and where they are not the defaults "tokens" (each
        ordinary token after the bytes, in GPT-2's byte alphabet: "Ġthe"), "ignore_merges", "user_defined"."""
        d = {"format": FORMAT, "version": VERSION,
             "pattern": self.pattern if isinstance(self.pattern, str) else list(self.pattern),
             "vocab_size": self.vocab_size, "specials": dict(self._specials),
             "merges": self._merge_sides.tolist()}
        if self.eos_token != "</s>":  # e.g. an imported GPT-2 tokenizer: "eos": "<|endoftext|>"
            d["eos"] = self.eos_token
        if self.normalizer:
            d["normalizer"] = self.normalizer
        if self.bos_token is not None:
            d["bos"] = self.bos_token
        if self.ids is not None:
            d["ids"] = self.ids.tolist()
        if self.chat_template is not None:
            d["chat_template"] = self.chat_template
        if self.stops:
            d["stops"] = list(self.stops)
        if self.tokens is not None:
            d["tokens"] = [level_string(t) for t in self.tokens]
        if self.ignore_merges:
            d["ignore_merges"] = True
        if self.user_defined:
            d["user_defined"] = list(self.user_defined)
        return d

    @classmethod
    def from_dict(cls, d) -> BaseTokenizer:
        """Rebuild from to_dict() output, checking every field (a corrupt file gives a UserError); a file of
        another kind (see base.py) gives that kind."""
        if not isinstance(d, dict):
            raise UserError("tokenizer data must be a JSON object")
        kind = d.get("kind")
        if kind == "sentencepiece":
            from .sentencepiece import SentencePieceTokenizer
            return SentencePieceTokenizer.from_dict(d)
        if kind == "wordpiece":
            from .wordpiece import WordPieceTokenizer
            return WordPieceTokenizer.from_dict(d)
        if kind == "unigram":
            from .unigram import UnigramTokenizer
            return UnigramTokenizer.from_dict(d)
        if kind is not None:
            raise UserError(f"tokenizer.json: unknown \"kind\" {kind!r:.40} (sentencepiece, wordpiece, unigram, or "
                            "none for byte-level BPE)")
        if d.get("format") != FORMAT:
            if "model" in d and "pre_tokenizer" in d:
                raise UserError("this is a Hugging Face tokenizers file, not a nanoeuler tokenizer.json "
                                "(make one with `nanoeuler tokenizer train`)")
            raise UserError(f"not a nanoeuler tokenizer (expected \"format\": \"{FORMAT}\")")
        if d.get("version") != VERSION:
            raise UserError(f"unsupported tokenizer version {d.get('version')!r} (this nanoeuler reads {VERSION})")
        pattern, merges, specials = d.get("pattern"), d.get("merges"), d.get("specials")
        check_pattern(pattern)
        if not isinstance(merges, list):
            raise UserError("tokenizer.json: \"merges\" must be a list of [left, right] id pairs")
        tokens = d.get("tokens")
        if tokens is not None:
            if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
                raise UserError("tokenizer.json: \"tokens\" must be a list of strings (GPT-2's byte alphabet)")
            tokens = [level_bytes(t) for t in tokens]
        for i, m in enumerate(merges):
            if not (isinstance(m, list) and len(m) == 2 and all(type(x) is int for x in m)):
                raise UserError(f"tokenizer.json: merge {i} is {m!r:.40}; each merge must be [left, right] token ids")
        n_ordinary = 256 + (len(merges) if tokens is None else len(tokens))
        if not isinstance(specials, dict) or not all(isinstance(k, str) and k and type(v) is int
                                                     for k, v in specials.items()):
            raise UserError("tokenizer.json: \"specials\" must map non-empty token strings to integer ids")
        order = sorted(specials, key=lambda s: specials[s])
        if [specials[s] for s in order] != list(range(n_ordinary, n_ordinary + len(order))):
            raise UserError("tokenizer.json: special token ids must follow the ordinary tokens consecutively")
        eos = d.get("eos", "</s>")
        if eos is not None and not isinstance(eos, str):
            raise UserError("tokenizer.json: \"eos\" must be the string of a special token (or null)")
        bos = d.get("bos")
        if bos is not None and not isinstance(bos, str):
            raise UserError("tokenizer.json: \"bos\" must be the string of a special token (or null)")
        ids = d.get("ids")
        if ids is not None:
            check_ids(ids, n_ordinary + len(order))
        template, stops = d.get("chat_template"), d.get("stops", [])
        if template is not None and not isinstance(template, str):
            raise UserError("tokenizer.json: \"chat_template\" must be a string (a Jinja template)")
        if not isinstance(stops, list) or not all(isinstance(t, str) for t in stops):
            raise UserError("tokenizer.json: \"stops\" must be a list of special token strings")
        user_defined, ignore = d.get("user_defined", []), d.get("ignore_merges", False)
        if not isinstance(user_defined, list) or not all(isinstance(t, str) for t in user_defined):
            raise UserError("tokenizer.json: \"user_defined\" must be a list of special token strings")
        if not isinstance(ignore, bool):
            raise UserError("tokenizer.json: \"ignore_merges\" must be true or false")
        tok = cls(merges, order, pattern, eos, d.get("normalizer"), ids, bos, template, stops, tokens, ignore,
                  user_defined)
        if "vocab_size" in d and d["vocab_size"] != tok.vocab_size:
            raise UserError(f"tokenizer.json: vocab_size {d['vocab_size']} disagrees with its merges and "
                            f"specials ({tok.vocab_size})")
        return tok

    def vocab_text(self) -> str:
        """One line per token, in id order: id, the token shown readably, and for a token a merge makes the two
        parts of the first (lowest-ranked) merge that makes it.

            256  ' t'  = ' ' + 't'
        """
        lines = [f"# nanoeuler byte-level BPE: {self.vocab_size} tokens; fingerprint {self.fingerprint()[:16]}"]
        made_by = {int(t): m for m, t in reversed(list(zip(self.merges, self._results)))}
        order = self._engine_order() or range(self.vocab_size)
        for e, i in enumerate(order):  # e: the id, i: the engine's number of that token
            line = f"{e}\t{_show(self._vocab[i])}"
            if i in made_by:
                a, b = made_by[i]
                line += f"\t= {_show(self._vocab[a])} + {_show(self._vocab[b])}"
            elif i >= self._n_ordinary:
                line += "\t(special)"
            lines.append(line)
        return "\n".join(lines) + "\n"

    # -- export -------------------------------------------------------------------------------------
    def to_hf_json(self) -> str:
        """A Hugging Face `tokenizers` JSON string (Tokenizer.from_str loads it; it encodes identically).

        Bytes become the GPT-2 printable alphabet (byte 32 ' ' -> 'Ġ'), merges become "left right" strings.
        """
        strings, special, merge_strings = self.byte_level_vocab()
        vocab = {s: i for i, s in enumerate(strings) if not special[i]}
        for s in self.special_tokens:
            if s in vocab:
                raise UserError(f"cannot export: the special token {s!r} is also an ordinary token "
                                f"(id {vocab[s]}), which the Hugging Face format cannot tell apart")
        # the specials are in the model's vocab too (as Hugging Face's trainer and GPT-2's vocab.json have
        # them): transformers renumbers an added token that the vocab lacks to the end of the vocabulary
        vocab.update(self.special_tokens)
        merges = [m.split(" ") for m in merge_strings]
        if self.pattern == GPT2_PATTERN:
            pre = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
        else:
            pre = {"type": "Sequence", "pretokenizers": [
                *hf_splits(self.pattern),
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}
        d = {
            "version": "1.0", "truncation": None, "padding": None,
            "added_tokens": [{"id": i, "content": s, "single_word": False, "lstrip": False, "rstrip": False,
                              "normalized": False, "special": s not in self.user_defined}
                             for s, i in self.special_tokens.items()],
            "normalizer": {"type": self.normalizer} if self.normalizer else None,
            "pre_tokenizer": pre, "post_processor": self.hf_post_processor(),
            "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
            "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                      "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                      "ignore_merges": self.ignore_merges, "vocab": vocab, "merges": merges},
        }
        return json.dumps(d, ensure_ascii=False)


def vocabulary(sides: np.ndarray, tokens: Iterable[bytes] | None) -> tuple[list[bytes], np.ndarray]:
    """(the bytes of the 256 byte tokens and the ordinary tokens, in the engine's numbering; the id each merge
    makes: the token of its two sides' joined bytes). sides: [merges, 2] (left, right) in rank order. Without
    tokens, merge i makes token 256 + i and may use only earlier ones. UserError for a merge that names no
    token, or makes bytes that are no token.

        vocabulary(np.array([[104, 105]]), None)[1]                         -> array([256])      ('hi')
        vocabulary(np.array([[104, 257], [104, 105]]), [b"hi", b"hhi"])[1]  -> array([257, 256]) ('hhi' first)
    """
    vocab = [bytes([i]) for i in range(256)]
    if tokens is None:
        for i, (a, b) in enumerate(zip(sides[:, 0].tolist(), sides[:, 1].tolist())):
            if not (0 <= a < 256 + i and 0 <= b < 256 + i):
                raise UserError(f"tokenizer: merge {i} is ({a}, {b}); each side must be a byte or an earlier merge "
                                f"(an id below {256 + i})")
            vocab.append(vocab[a] + vocab[b])
        return vocab, np.arange(256, 256 + len(sides), dtype=np.int32)
    vocab += [bytes(t) for t in tokens]
    index = {t: i for i, t in enumerate(vocab)}
    if len(index) != len(vocab) or b"" in index:
        twice = next((t for i, t in enumerate(vocab) if index.get(t) != i), b"")
        raise UserError(f"tokenizer: the token {_show(twice)} is listed twice (or is empty)")
    bad = np.flatnonzero(((sides < 0) | (sides >= len(vocab))).any(axis=1))
    if len(bad):
        raise UserError(f"tokenizer: merge {bad[0]} is {tuple(sides[bad[0]].tolist())}; there are {len(vocab)} "
                        f"ordinary tokens")
    made = list(map(bytes.__add__, map(vocab.__getitem__, sides[:, 0].tolist()),
                    map(vocab.__getitem__, sides[:, 1].tolist())))
    results = list(map(index.get, made))
    if None in results:
        i = results.index(None)
        raise UserError(f"tokenizer: merge {i} makes {_show(made[i])}, which is not a token")
    return vocab, np.array(results, np.int32)


def is_classic(results: np.ndarray, n_tokens: int) -> bool:
    """Whether merge i makes token 256 + i and there is no other token (the vocabulary this library trains)."""
    return n_tokens == 256 + len(results) and bool(np.array_equal(results, np.arange(256, n_tokens)))


def cut_regex(specials: Iterable[str]):
    """The regex that cuts these special tokens out of text (the longest first where two start at one place);
    None when there are none."""
    ordered = sorted(specials, key=len, reverse=True)
    return regex.compile("(" + "|".join(regex.escape(s) for s in ordered) + ")") if ordered else None


def check_ids(ids, n: int) -> np.ndarray:
    """A token id map gives each of the n tokens (256 bytes + merges + specials) its own id in [0, m), m the
    number of tokens with an id: a byte may have none (-1, a byte the vocabulary lacks). As an int64 array,
    else UserError.  check_ids([1, 0, 2], 3) -> array([1, 0, 2]);  check_ids([0, 0, 2], 3) -> UserError"""
    if isinstance(ids, np.ndarray):
        if not np.issubdtype(ids.dtype, np.integer):
            raise UserError("tokenizer: \"ids\" must be integers")
        arr = ids.astype(np.int64).ravel()
    else:
        if not isinstance(ids, (list, tuple)) or not all(type(x) is int or isinstance(x, np.integer) for x in ids):
            raise UserError("tokenizer.json: \"ids\" must be a list of integer token ids")
        if any(not -(1 << 62) < int(x) < (1 << 62) for x in ids):
            raise UserError("tokenizer.json: \"ids\" holds an id out of range")
        arr = np.array([int(x) for x in ids], np.int64)
    if len(arr) != n:
        raise UserError(f"tokenizer.json: \"ids\" has {len(arr)} entries but the tokenizer has {n} tokens "
                        f"(256 bytes + merges + specials)")
    absent = int((arr[:256] == -1).sum())
    m = n - absent
    if absent == 256 or n and (arr[256:].min(initial=0) < 0 or arr.max() >= m or len(np.unique(arr)) != m + (absent > 0)):
        bad = next((int(x) for i, x in enumerate(arr) if not (0 <= x < m or x == -1 and i < 256)), None)
        why = (f"id {bad} is out of range" if bad is not None else "no byte has an id" if absent == 256
               else "two tokens share an id")
        raise UserError(f"tokenizer.json: \"ids\" must give each of the {n} tokens its own id in [0, {m}) "
                        f"(or -1: a byte the vocabulary lacks): {why}")
    return arr


def bytes_to_unicode() -> list[str]:
    """GPT-2's byte -> printable character table: printable Latin-1 bytes map to themselves, the rest to
    chr(256 + k).  bytes_to_unicode()[ord('a')] -> 'a', bytes_to_unicode()[32] -> 'Ġ'"""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, k = [""] * 256, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + k)
            k += 1
    return table


def level_string(token: bytes) -> str:
    """A token's bytes in GPT-2's byte alphabet (the strings of Hugging Face and GGUF byte-level vocabularies).
    level_string(b" the") -> 'Ġthe'"""
    alphabet = _alphabet()[0]
    return "".join(alphabet[b] for b in token)


def level_bytes(s: str) -> bytes:
    """The inverse of level_string; UserError for a character outside the alphabet.  level_bytes('Ġthe') -> b' the'"""
    try:
        return s.translate(_alphabet()[1]).encode("latin-1")
    except UnicodeEncodeError:
        bad = next(c for c in s if c not in _alphabet()[0])
        raise UserError(f"tokenizer: the token {s!r:.40} holds {bad!r}, which is none of the 256 characters that "
                        f"stand for bytes (GPT-2's byte alphabet)") from None


@functools.cache
def _alphabet() -> tuple[list[str], dict[int, str]]:
    """(byte -> its character, the str.translate table from each character back to chr(byte); every other
    character of Latin-1 to a lone surrogate, which no Latin-1 encoding accepts)."""
    table = bytes_to_unicode()
    back = {c: "\udfff" for c in range(256)} | {ord(c): chr(b) for b, c in enumerate(table)}
    return table, back


def cut_points(data: bytes, size: int = CHUNK_BYTES) -> list[int]:
    """Offsets [0, ..., len(data)] that cut data into pieces of about `size` bytes without changing its
    pre-tokens: each cut sits on an ASCII space or newline that follows a printable ASCII character.

    Why that is safe: the pre-token holding that character is a contraction or a run of one class, and
    it ends there (a space has another class); the next pre-token starts at the space and looks only
    forward.  cut_points(b"ab cd ef", 2) -> [0, 2, 5, 8]
    """
    cuts, n = [0], len(data)
    while n - cuts[-1] > size:
        m = _SAFE_CUT.search(data, cuts[-1] + size - 1)
        if m is None:
            break
        cuts.append(m.end())
    cuts.append(n)
    return cuts


def _show(b: bytes) -> str:
    """A token for humans: valid UTF-8 shown as text (control characters escaped), other bytes as \\xNN."""
    s = b.decode("utf-8", "backslashreplace")
    return repr(s)[1:-1] if not s.isprintable() or "'" in s else f"'{s}'"


def _last_cut(block: bytes) -> int:
    """The last offset of block where cut_points could cut (0 if none).  _last_cut(b"ab cd") -> 2"""
    i = len(block)
    while True:
        j = max(block.rfind(b" ", 0, i), block.rfind(b"\n", 0, i))
        if j <= 0:
            return 0
        if 0x21 <= block[j - 1] <= 0x7E:
            return j
        i = j


def _read_blocks(paths: list[Path], size: int | None = None) -> Iterator[bytes]:
    """The files' bytes in ~size blocks, each cut where the pre-tokens do not change (see cut_points)."""
    size = size or CHUNK_BYTES
    for path in paths:
        with open(path, "rb") as f:
            rest = b""
            while True:
                block = f.read(size)
                if not block:
                    break
                block = rest + block
                cut = _last_cut(block)
                if cut == 0:
                    rest = block
                    continue
                rest = block[cut:]
                yield block[:cut]
            if rest:
                yield rest


# ------------------------------------------------------------------------------ parallel encoding

_worker_tok: Tokenizer | None = None


def _worker_init(d: dict) -> None:
    global _worker_tok
    _worker_tok = Tokenizer.from_dict(d)


def _worker_encode(texts: list[str]) -> list[np.ndarray]:
    return [_worker_tok.encode_array(t) for t in texts]


def encode_parallel(tokenizer: Tokenizer, texts: Iterable[str], processes: int | None = None,
                    batch_bytes: int = 1 << 20) -> Iterator[np.ndarray]:
    """Encode texts across processes; yield one int32 id array per text, in input order, streaming.

    Texts are grouped into batches of about batch_bytes and at most 2 * processes batches are in flight,
    so memory stays bounded whatever the corpus size. processes=1 encodes in this process.

        for ids in encode_parallel(tok, ["a b", "c"], processes=2): ...   # array([...]), array([...])
    """
    processes = processes or os.cpu_count() or 1

    def batches():
        batch, size = [], 0
        for t in texts:
            if not isinstance(t, str):
                raise UserError(f"encode_parallel takes str texts, got {type(t).__name__}")
            batch.append(t)
            size += len(t)
            if size >= batch_bytes:
                yield batch
                batch, size = [], 0
        if batch:
            yield batch

    if processes <= 1:
        for batch in batches():
            for t in batch:
                yield tokenizer.encode_array(t)
        return

    import multiprocessing as mp
    from collections import deque
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    from . import bpe_fast

    bpe_fast.char_classes()  # build once here; forked workers inherit it
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    # a ProcessPoolExecutor, not multiprocessing.Pool: a worker that dies (killed, out of memory) ends the
    # whole command at once (BrokenProcessPool) instead of waiting forever; so does an error in the caller,
    # which closes this generator (the `finally` below cancels what is queued)
    pool = ProcessPoolExecutor(processes, mp_context=mp.get_context(method), initializer=_worker_init,
                               initargs=(tokenizer.to_dict(),))
    pending: deque = deque()
    try:
        for batch in batches():
            pending.append(pool.submit(_worker_encode, batch))
            while len(pending) >= 2 * processes:
                yield from pending.popleft().result()
        while pending:
            yield from pending.popleft().result()
    except BrokenProcessPool:
        raise UserError("an encoding process died (killed, or out of memory?); try --processes 1") from None
    finally:
        for f in pending:
            f.cancel()
        pool.shutdown(wait=True, cancel_futures=True)
