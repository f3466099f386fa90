"""Hugging Face `tokenizer.json` -> our tokenizer, keeping its token ids exactly: a byte-level BPE as our
Tokenizer, a BPE with byte_fallback (Llama-2, Gemma, Gemma 4) as our SentencePieceTokenizer (`spm_from_hf_json`, at
the end of this file).

Our BPE engine numbers tokens as bytes 0..255, then the ordinary tokens (those the merges make, in the order
of the first merge that makes each: merge i makes 256 + i for a vocabulary built merge by merge; then any no
merge makes), then specials. A Hugging Face vocabulary numbers them as it likes, so `from_hf_json` gives the
Tokenizer the HF id of every token in the engine's order (`Tokenizer(..., ids=...)`), and its encode/decode
speak the HF ids:

    GPT-2 vocabulary:   '!' -> 0, ..., 'Ġ' -> 220, ..., 'Ġt' -> 256 (merge 0), ..., '<|endoftext|>' -> 50256
    tok.ids:            [220 at byte 32, 0 at byte 33, ..., 256 for merge 0, ..., 50256 for the special]
    tok.encode(" t")    -> [256], as GPT-2's tokenizer; the model's rows stay in the folder's order.

Ids a Hugging Face model has but its tokenizer never names (padded vocabularies, e.g. Qwen2's) become
reserved specials `<|reserved_ID|>` at those ids so that no row is dropped.

Post-processors: none, `ByteLevel` (offsets only: ids unchanged), and `TemplateProcessing` that puts one
special token before the text (Llama-3's `<|begin_of_text|>`): it becomes the Tokenizer's `bos`, so that
`tok.encode(text, allow_special=True, add_bos=True) == AutoTokenizer(text)["input_ids"]`; anything
else (a token after the text, Bert/Roberta processors) is refused by name.

Pre-tokenizers understood (any other is a one-line error naming it):
- `ByteLevel(use_regex=true)`                       -> the GPT-2 pattern (GPT-2, our own export)
- `Sequence[Split(Regex P, Isolated), ByteLevel(use_regex=false)]` -> P (Llama-3, Qwen2, our export), or the
  cascade (P,) when P leaves characters between its matches (BLOOM's), which the Split keeps as pieces
- `Sequence[Split(P1), Split(P2), ..., ByteLevel(use_regex=false)]` -> the cascade (P1, P2, ...): each Split
  cuts the pieces the previous ones left (llama.cpp's `default`, our export of a cascade)
- `Sequence[Digits(individual_digits=true), ByteLevel(use_regex=true)]` -> SMOLLM_PATTERN (SmolLM)
A Unicode normal form as the normalizer (Qwen2's NFC) is carried by the Tokenizer and applied before encoding.
`model.ignore_merges` (Llama-3) is the Tokenizer's; added tokens that are not special are cut out of text
always (`user_defined`). A vocabulary token not written in the 256 byte characters (Command-R's raw emoji),
which no byte-level text reaches, keeps its id as a reserved special.
A vocabulary may lack some of the 256 byte tokens (SmolLM2's lacks 21: their id is -1 in `tok.ids`), not more
than half of them.
"""
from __future__ import annotations

import itertools

import numpy as np

from ..errors import UserError
from ..tokenizer import GPT2_PATTERN, Tokenizer, bytes_to_unicode
from ..tokenizer.pretokenize import check_pattern, covers_every_character
from ..tokenizer.tokenizer import level_bytes

MIN_BYTES = 128  # byte tokens a byte-level vocabulary must have (SmolLM2's lacks 21 bytes that text rarely holds)

# GPT-2's pattern run on the pieces left after splitting off every digit (`Digits(individual_digits)`)
# is this one pattern: a digit alone, and whitespace may also end just before a digit (the piece's end).
SMOLLM_PATTERN = (r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+|\s+(?![^\s\p{N}])|\s+""")
LLAMA3_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                  r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
QWEN2_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                 r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
# llama.cpp's `default` pre-tokenizer (src/llama-vocab.cpp, LLAMA_VOCAB_PRE_TYPE_DEFAULT), its regexes verbatim: a
# cascade (runs of punctuation and $+<=>^~|; then GPT-2's pattern inside what is left; number runs; groups of 3 digits)
DEFAULT_CASCADE = (r"[\p{P}\$\+<=>\^~\|]+", r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
                   r"\p{N}+", r"[0-9][0-9][0-9]")


def _bad(msg: str):
    raise UserError(f"tokenizer.json: {msg}")


def _flag(obj: dict, key: str, default: bool, where: str) -> bool:
    """obj[key] as tokenizers reads it: true or false (default where absent or null); a string "false": UserError."""
    v = obj.get(key)
    if v is not None and not isinstance(v, bool):
        _bad(f"{where}.{key} must be true or false, got {v!r:.40}")
    return default if v is None else v


def split_regex(split) -> str:
    """The regex of a Split pre-tokenizer that isolates its matches (the only kind supported)."""
    pat = split.get("pattern")
    if not (isinstance(pat, dict) and isinstance(pat.get("Regex"), str)):
        _bad("pre_tokenizer Split.pattern must be a Regex")
    if split.get("behavior") != "Isolated" or split.get("invert"):
        _bad(f"pre_tokenizer Split.behavior={split.get('behavior')} invert={split.get('invert')} "
             "is not supported (only Isolated, not inverted)")
    return pat["Regex"]


def pattern_of(pre) -> str | tuple[str, ...]:
    """The one regex (or cascade of regexes) equal to a Hugging Face byte-level pre-tokenizer (see the module
    docstring)."""
    def byte_level(p, use_regex):
        if _flag(p, "add_prefix_space", False, "pre_tokenizer ByteLevel"):
            _bad("pre_tokenizer ByteLevel.add_prefix_space=true is not supported")
        if _flag(p, "use_regex", True, "pre_tokenizer ByteLevel") != use_regex:
            _bad(f"pre_tokenizer ByteLevel.use_regex={str(not use_regex).lower()} is not supported here")

    if not isinstance(pre, dict):
        _bad("pre_tokenizer is missing (a byte-level BPE needs one; a SentencePiece-style BPE needs "
             "model.byte_fallback=true)")
    kind = pre.get("type")
    if kind == "ByteLevel":
        byte_level(pre, True)
        return GPT2_PATTERN
    if kind == "Sequence" and isinstance(pre.get("pretokenizers"), list):
        parts = pre["pretokenizers"]
        kinds = [p.get("type") if isinstance(p, dict) else None for p in parts]
        if kinds == ["ByteLevel"]:
            byte_level(parts[0], True)
            return GPT2_PATTERN
        if len(kinds) >= 2 and kinds[-1] == "ByteLevel" and set(kinds[:-1]) == {"Split"}:
            byte_level(parts[-1], False)
            regexes = tuple(split_regex(p) for p in parts[:-1])   # one that leaves nothing between its matches
            return regexes[0] if len(regexes) == 1 and covers_every_character(regexes[0]) else regexes  # is a pattern
        if kinds == ["Digits", "ByteLevel"]:
            if not parts[0].get("individual_digits"):
                _bad("pre_tokenizer Digits.individual_digits=false is not supported")
            byte_level(parts[1], True)
            return SMOLLM_PATTERN
        _bad(f"pre_tokenizer Sequence[{', '.join(map(str, kinds))}] is not supported")
    _bad(f"pre_tokenizer {kind} is not supported for a byte-level BPE (ByteLevel, Split+ByteLevel, Digits+ByteLevel)")


def bos_of(post, added: dict[int, str]) -> int | None:
    """The HF id of the one special token a post_processor puts before the text (None if it adds none).
    added: HF id -> content of the added tokens. Anything that adds tokens elsewhere is refused."""
    if post is None:
        return None
    if not isinstance(post, dict):
        _bad(f"post_processor {post!r} is not supported")
    kind = post.get("type")
    if kind == "ByteLevel":
        return None  # trims offsets only; ids unchanged
    if kind == "Sequence" and isinstance(post.get("processors"), list):
        found = [b for b in (bos_of(p, added) for p in post["processors"]) if b is not None]
        if len(found) > 1:
            _bad("post_processor adds more than one token before the text; not supported")
        return found[0] if found else None
    if kind != "TemplateProcessing":
        _bad(f"post_processor {kind} is not supported (none, ByteLevel, or a TemplateProcessing adding a bos)")
    single, table = post.get("single"), post.get("special_tokens") or {}
    if not isinstance(single, list) or not isinstance(table, dict):
        _bad("post_processor TemplateProcessing: \"single\" must be a list")
    kinds = [next(iter(x)) if isinstance(x, dict) and len(x) == 1 else None for x in single]
    if kinds.count("Sequence") != 1 or any(k not in ("Sequence", "SpecialToken") for k in kinds):
        _bad(f"post_processor TemplateProcessing single={single!r} is not supported")
    at = kinds.index("Sequence")
    if at != len(kinds) - 1:
        _bad("post_processor TemplateProcessing adds tokens after the text; not supported (only a bos before it)")
    if at == 0:
        return None
    if at > 1:
        _bad("post_processor TemplateProcessing adds more than one token before the text; not supported")
    name = single[0]["SpecialToken"].get("id") if isinstance(single[0]["SpecialToken"], dict) else None
    entry = table.get(name)
    ids = entry.get("ids") if isinstance(entry, dict) else None
    if not (isinstance(ids, list) and len(ids) == 1 and isinstance(ids[0], int)):
        _bad(f"post_processor TemplateProcessing: special token {name!r} needs one id in \"special_tokens\"")
    if ids[0] not in added:
        _bad(f"post_processor TemplateProcessing: the bos id {ids[0]} is not an added special token")
    return ids[0]


def from_hf_json(d: dict, vocab_size: int | None = None, eos_id: int | None = None):
    """A parsed Hugging Face tokenizer.json -> our Tokenizer with the same token ids (`tok.ids`); a BPE with
    byte_fallback (Llama-2, Gemma) -> a SentencePieceTokenizer (spm_from_hf_json).

    vocab_size: the model's embedding rows (>= the tokenizer's ids; extra rows become reserved specials).
    eos_id: the HF id of the end-of-text token (from config.json), which becomes our Tokenizer's eos.
    """
    if not isinstance(d, dict) or not isinstance(d.get("model"), dict):
        _bad("not a Hugging Face tokenizers file (no \"model\")")
    m = d["model"]
    if m.get("type") == "WordPiece":
        return wordpiece_from_hf_json(d, vocab_size, eos_id)
    if m.get("type") == "Unigram":
        return unigram_from_hf_json(d, vocab_size, eos_id)
    if m.get("type") != "BPE":
        _bad(f"model.type {m.get('type')!r:.40} is not supported (BPE: byte-level, or SentencePiece-style with "
             "byte_fallback; WordPiece; Unigram)")
    if _flag(m, "byte_fallback", False, "model"):
        return spm_from_hf_json(d, vocab_size, eos_id)
    for field in ("continuing_subword_prefix", "end_of_word_suffix", "dropout"):
        if m.get(field) not in (None, ""):
            _bad(f"model.{field}={m.get(field)!r} is not supported")
    norm = d.get("normalizer")
    if norm is not None and not (isinstance(norm, dict) and norm.get("type") in ("NFC", "NFD", "NFKC", "NFKD")):
        _bad(f"normalizer {norm.get('type') if isinstance(norm, dict) else norm} is not supported "
             "(none, or one Unicode normal form: NFC, NFD, NFKC, NFKD)")
    dec = d.get("decoder")
    if dec is not None and not (isinstance(dec, dict) and dec.get("type") == "ByteLevel"):
        _bad(f"decoder {dec.get('type') if isinstance(dec, dict) else dec} is not supported (ByteLevel only)")
    pattern = pattern_of(d.get("pre_tokenizer"))
    check_pattern(pattern)          # the loader's own check: what import accepts, every later load accepts
    vocab, merges = m.get("vocab"), m.get("merges")
    if not isinstance(vocab, dict) or not isinstance(merges, list):
        _bad("model.vocab must be an object and model.merges a list")
    for s, i in vocab.items():
        if type(i) is not int or i < 0:
            _bad(f"vocab token {s!r} has id {i!r}; ids are non-negative integers")
    added = {}
    for t in d.get("added_tokens") or []:
        if not (isinstance(t, dict) and type(t.get("id")) is int and t["id"] >= 0 and isinstance(t.get("content"), str)
                and t["content"]):
            _bad(f"malformed added token {t!r}")
        _flag(t, "special", True, f"added token {t['content']!r:.40}")
        added[t["id"]] = t["content"]

    alphabet = bytes_to_unicode()
    byte_chars = set(alphabet)
    ours: dict[str, int] = {}     # HF token string -> our id
    hf_ids: list[int] = []        # the engine's number -> HF id (-1: a byte the vocabulary lacks)
    for b in range(256):
        s = alphabet[b]
        if s in vocab:
            ours[s] = b
        hf_ids.append(vocab.get(s, -1))
    if len(ours) < MIN_BYTES:
        _bad(f"model.vocab has only {len(ours)} of the 256 byte tokens ('Ā' for byte 0, 'Ġ' for a space, ...): "
             "not a byte-level BPE")
    # each merge's two sides, "a b" or ["a", "b"] (two lists of str: no object per merge kept for the collector)
    lefts = [mg.partition(" ")[0] if isinstance(mg, str) else mg[0] if isinstance(mg, list) else "" for mg in merges]
    rights = [mg.partition(" ")[2] if isinstance(mg, str) else mg[-1] if isinstance(mg, list) else "" for mg in merges]
    for i in (i for i, (a, b) in enumerate(zip(lefts, rights)) if not (type(a) is str and type(b) is str and a and b)
              or isinstance(merges[i], str) and " " in b or isinstance(merges[i], list) and len(merges[i]) != 2):
        _bad(f"merge {i} {merges[i]!r:.60} is not a pair of tokens")
    made = list(map(str.__add__, lefts, rights))
    # the ordinary tokens after the bytes: those the merges make, in the order of the first merge that makes
    # each (so that a vocabulary built merge by merge keeps the classic numbering), then any no merge makes
    made_once = dict.fromkeys(made)
    ordinary = made_once | dict.fromkeys(sorted(vocab, key=vocab.get))
    if ordinary.keys() - vocab.keys():
        i = next(i for i, m in enumerate(made) if m not in vocab)
        _bad(f"merge {i} ({lefts[i]!r:.30}, {rights[i]!r:.30}) makes {made[i]!r:.40}, which is not in model.vocab")
    for t in [*ours, *(t for i, t in added.items() if vocab.get(t) == i)]:
        ordinary.pop(t, None)     # the bytes have their place; added tokens are specials
    # a token of other characters (Command-R's 1,403 raw emoji and symbols) is one no byte-level text reaches:
    # its id is kept as a reserved special below
    for t in ordinary.keys() - made_once.keys():
        if not set(t) <= byte_chars:
            del ordinary[t]
    ours.update(zip(ordinary, range(len(hf_ids), len(hf_ids) + len(ordinary))))
    hf_ids += map(vocab.__getitem__, ordinary)
    try:
        pairs = np.array([list(map(ours.__getitem__, lefts)), list(map(ours.__getitem__, rights))],
                         np.int64).T.reshape(-1, 2)   # [merges, 2]
    except KeyError as e:
        i = next(i for i, ab in enumerate(zip(lefts, rights)) if e.args[0] in ab)
        _bad(f"merge {i} ({lefts[i]!r:.30}, {rights[i]!r:.30}) uses {e.args[0]!r:.40}, which is not an ordinary "
             "token of model.vocab")
    built = set(hf_ids) - {-1}
    specials = [added[i] for i in sorted(added) if i not in built]
    special_ids = [i for i in sorted(added) if i not in built]
    n_ids = max([*hf_ids, *special_ids]) + 1
    vocab_size = n_ids if vocab_size is None else vocab_size
    if n_ids > vocab_size:
        _bad(f"token id {n_ids - 1} does not fit the model's vocab_size {vocab_size}")
    used = built | set(special_ids)
    if len(used) != len(built) + len(special_ids) or len(built) != len(hf_ids) - hf_ids.count(-1):
        _bad("two tokens share one id")
    for i in range(vocab_size):
        if i not in used:  # an embedding row no token names: keep it, as a reserved special
            name = f"<|reserved_{i}|>"
            if name in specials:
                _bad(f"cannot name the unused id {i}: {name!r} is taken")
            specials.append(name)
            special_ids.append(i)
    if len(set(specials)) != len(specials):
        twice = next(t for t in specials if specials.count(t) > 1)
        _bad(f"two added tokens are both {twice!r}")
    eos = None
    if eos_id is not None:
        if eos_id in built:
            _bad(f"the eos token id {eos_id} is an ordinary token, not a special one")
        if eos_id not in special_ids:
            _bad(f"the eos token id {eos_id} is not in the tokenizer")
        eos = specials[special_ids.index(eos_id)]
    bos_id = bos_of(d.get("post_processor"), {i: added[i] for i in added if i not in built})
    bos = None if bos_id is None else specials[special_ids.index(bos_id)]
    user_defined = [t["content"] for t in d.get("added_tokens") or [] if not t.get("special", True)
                    and t["id"] not in built]
    classic = len(hf_ids) == 256 + len(pairs) and bool((pairs.max(1, initial=0) < np.arange(256, len(hf_ids))).all())
    tokens = None if classic else [level_bytes(t) for t, i in ours.items() if i >= 256]   # None: merge i makes 256 + i
    return Tokenizer(pairs, specials, pattern, eos=eos, normalizer=norm["type"] if norm else None,
                     ids=hf_ids + special_ids, bos=bos, tokens=tokens,
                     ignore_merges=_flag(m, "ignore_merges", False, "model"), user_defined=user_defined)


# ------------------------------------------------------------------------- SentencePiece-style BPE

def is_space_split(pre) -> bool:
    """Whether a pre-tokenizer is a Split at the string " " (any behavior, not inverted): transformers' GemmaTokenizer
    writes one (Gemma 4's tokenizer.json), which cuts nothing after a normalizer has made every space "▁"."""
    return (isinstance(pre, dict) and pre.get("type") == "Split" and pre.get("pattern") == {"String": " "}
            and not pre.get("invert"))


def spm_prefix(d: dict) -> tuple[str, bool, str | None]:
    """(prefix, split, Unicode normal form) of a SentencePiece-style tokenizer.json: its normalizer, one or a
    Sequence of [NFC|NFD|NFKC|NFKD] [Prepend "▁"] [Replace " " -> "▁"] in that order, and its pre-tokenizer,
    none, Metaspace ("▁", prepend_scheme always / first / never, split), or after the Replace a Split at " "
    (Gemma 4's, where no space is left to cut at). Spaces must become "▁" somewhere."""
    from ..tokenizer.sentencepiece import METASPACE
    norm, pre = d.get("normalizer"), d.get("pre_tokenizer")
    steps = (norm.get("normalizers") if isinstance(norm, dict) and norm.get("type") == "Sequence"
             else [norm] if norm is not None else [])
    if not isinstance(steps, list) or not all(isinstance(x, dict) for x in steps):
        _bad("normalizer: a Sequence needs a list of normalizers")
    kinds, i = [x.get("type") for x in steps], 0
    form = kinds[i] if i < len(kinds) and kinds[i] in ("NFC", "NFD", "NFKC", "NFKD") else None
    i += form is not None
    prepend = i < len(kinds) and kinds[i] == "Prepend"
    if prepend and steps[i].get("prepend") != METASPACE:
        _bad("normalizer Prepend of something other than \"▁\" is not supported")
    i += prepend
    escaped = i < len(kinds) and kinds[i] == "Replace"
    if escaped and (steps[i].get("pattern") != {"String": " "} or steps[i].get("content") != METASPACE):
        _bad(f"normalizer Replace {steps[i].get('pattern')} -> {steps[i].get('content')!r:.20} is not supported "
             "(only \" \" -> \"▁\")")
    i += escaped
    if i < len(kinds):
        _bad(f"normalizer {'+'.join(map(str, kinds))} is not supported for a SentencePiece-style BPE "
             "(a normal form, Prepend \"▁\", Replace \" \" -> \"▁\", in that order)")
    prefix, split = "every" if prepend else "none", False
    if escaped and is_space_split(pre):
        pre = None      # Gemma 4's Split(" "): the normalizer has left no space for it to cut at
    if pre is not None:
        if not isinstance(pre, dict) or pre.get("type") != "Metaspace" or pre.get("replacement", METASPACE) != METASPACE:
            _bad(f"pre_tokenizer {pre.get('type') if isinstance(pre, dict) else pre} is not supported for a "
                 "SentencePiece-style BPE (model.byte_fallback=true; its pre_tokenizer: none, or Metaspace with \"▁\")")
        scheme = pre.get("prepend_scheme",
                         "always" if _flag(pre, "add_prefix_space", True, "pre_tokenizer Metaspace") else "never")
        if scheme not in ("always", "first", "never"):
            _bad(f"pre_tokenizer Metaspace prepend_scheme {scheme!r:.20} is not supported")
        if not prepend and scheme != "never":
            prefix = "every-unless-space" if scheme == "always" else "first-unless-space"
        split, escaped = _flag(pre, "split", True, "pre_tokenizer Metaspace"), True
    if not escaped:
        _bad("the normalizer and pre_tokenizer leave spaces as they are; a SentencePiece-style BPE needs them as "
             "\"▁\" (a Replace normalizer or a Metaspace pre-tokenizer)")
    return prefix, split, form


def vocab_names(vocab: dict) -> dict[int, str]:
    """model.vocab (token -> id) as id -> token, its ids checked (non-negative integers below 2**31, each once)
    with no Python work per token.  vocab_names({"a": 0, "b": 1}) -> {0: 'a', 1: 'b'}"""
    if set(map(type, vocab.values())) - {int}:
        s, i = next((s, i) for s, i in vocab.items() if type(i) is not int)
        _bad(f"vocab token {s!r:.40} has id {i!r:.20}; ids are non-negative integers")
    try:
        ids = np.fromiter(vocab.values(), np.int64, len(vocab))
    except OverflowError:       # beyond int64: out of range too
        ids = np.fromiter((min(max(i, -1), 1 << 31) for i in vocab.values()), np.int64, len(vocab))
    if ids.size and (ids.min() < 0 or ids.max() >= 1 << 31):
        s = list(vocab)[int(np.argmax((ids < 0) | (ids >= 1 << 31)))]
        _bad(f"vocab token {s!r:.40} has id {vocab[s]!r:.20}; ids are non-negative integers")
    names = dict(zip(vocab.values(), vocab))
    if len(names) != len(vocab):
        seen: dict[int, str] = {}
        s = next(s for s, i in vocab.items() if seen.setdefault(i, s) != s)
        _bad(f"vocab tokens {seen[vocab[s]]!r:.30} and {s!r:.30} share id {vocab[s]}")
    return names


def merge_pairs(merges: list, vocab: dict) -> np.ndarray:
    """model.merges ("a b" strings or ["a", "b"] pairs) as [merges, 2] ids of vocab; a merge that is not two vocab
    tokens: UserError.  merge_pairs(["a b"], {"a": 0, "b": 1, "ab": 2}) -> [[0, 1]]"""
    sides = [mg.split(" ") if type(mg) is str else mg for mg in merges]
    if set(map(type, sides)) <= {list}:
        flat = list(itertools.chain.from_iterable(sides))
        if len(flat) == 2 * len(sides):
            try:        # one C loop over the sides (a Python loop per merge takes twice as long)
                return np.fromiter(map(vocab.__getitem__, flat), np.int64, len(flat)).reshape(-1, 2)
            except (KeyError, TypeError):
                pass
    i = next(i for i, ab in enumerate(sides) if not (type(ab) is list and len(ab) == 2 and
                                                     all(type(x) is str and x in vocab for x in ab)))
    _bad(f"merge {i} {merges[i]!r:.60} is not a pair of vocab tokens")


def spm_from_hf_json(d: dict, vocab_size: int | None, eos_id: int | None):
    """A Hugging Face BPE with byte_fallback -> our SentencePieceTokenizer with the same ids: model.vocab
    tokens are NORMAL (BYTE for <0x00>..<0xFF>), added tokens CONTROL when "special", else USER_DEFINED (both
    cut out of text before BPE, as Hugging Face does); the merges keep their order; ids no token names
    become UNUSED reserved tokens."""
    from ..tokenizer.sentencepiece import BYTE, BYTE_PIECES, CONTROL, NORMAL, UNUSED, USER_DEFINED, SentencePieceTokenizer
    m = d["model"]
    for field in ("continuing_subword_prefix", "end_of_word_suffix", "dropout"):
        if m.get(field) not in (None, ""):
            _bad(f"model.{field}={m.get(field)!r:.40} is not supported")
    if _flag(m, "ignore_merges", False, "model"):
        _bad("model.ignore_merges=true is not supported for a byte_fallback BPE")
    prefix, split, form = spm_prefix(d)
    dec = d.get("decoder")
    parts = dec.get("decoders") if isinstance(dec, dict) and dec.get("type") == "Sequence" else [dec]
    kinds = {p.get("type") if isinstance(p, dict) else p for p in parts or []}
    if dec is not None and not kinds <= {"Metaspace", "Replace", "ByteFallback", "Fuse", "Strip"}:
        _bad(f"decoder {sorted(map(str, kinds))} is not supported (Metaspace, or Replace/ByteFallback/Fuse/Strip)")
    vocab, merges = m.get("vocab"), m.get("merges")
    if not isinstance(vocab, dict) or not isinstance(merges, list):
        _bad("model.vocab must be an object and model.merges a list")
    names = vocab_names(vocab)
    types = dict.fromkeys(names, NORMAL) | {vocab[p]: BYTE for p in BYTE_PIECES if p in vocab}
    for t in d.get("added_tokens") or []:
        if not (isinstance(t, dict) and type(t.get("id")) is int and 0 <= t["id"] < (1 << 31)
                and isinstance(t.get("content"), str) and t["content"]):
            _bad(f"malformed added token {t!r:.80}")
        if any(t.get(k) for k in ("single_word", "lstrip", "rstrip")):
            _bad(f"added token {t['content']!r:.40} with single_word / lstrip / rstrip is not supported")
        i = t["id"]
        if names.get(i, t["content"]) != t["content"]:
            _bad(f"added token {t['content']!r:.40} has the id {i} of vocab token {names[i]!r:.40}")
        special = _flag(t, "special", False, f"added token {t['content']!r:.40}")
        names[i], types[i] = t["content"], CONTROL if special else USER_DEFINED
    n_ids = max(names, default=-1) + 1
    vocab_size = n_ids if vocab_size is None else vocab_size
    if n_ids > vocab_size:
        _bad(f"token id {n_ids - 1} does not fit the model's vocab_size {vocab_size}")
    tokens = [names.get(i, f"<|reserved_{i}|>") for i in range(vocab_size)]
    type_list = [types.get(i, UNUSED) for i in range(vocab_size)]
    pairs = merge_pairs(merges, vocab)
    special_ids = {i for i, ty in types.items() if ty == CONTROL}
    eos = None
    if eos_id is not None:
        if eos_id not in special_ids:
            _bad(f"the eos token id {eos_id} is not a special (added) token")
        eos = names[eos_id]
    bos_id = bos_of(d.get("post_processor"), {i: names[i] for i in special_ids})
    return SentencePieceTokenizer(tokens, type_list, merges=pairs, prefix=prefix, split=split, normalizer=form,
                                  eos=eos, bos=None if bos_id is None else names[bos_id])


# ------------------------------------------------------------------------------------------ WordPiece

def frame_of(post, added: dict[int, str]) -> tuple[int | None, int | None]:
    """(the HF id of the special token a post_processor puts before the text, the one it puts after it), None
    where it puts none: BertProcessing / RobertaProcessing ([CLS] text [SEP]), or a TemplateProcessing with at
    most one special on each side. added: HF id -> content of the added special tokens."""
    if post is None:
        return None, None
    if not isinstance(post, dict):
        _bad(f"post_processor {post!r:.60} is not supported")
    if post.get("type") in ("BertProcessing", "RobertaProcessing"):
        ends = [post.get("cls"), post.get("sep")]
        if not all(isinstance(e, list) and len(e) == 2 and isinstance(e[0], str) and type(e[1]) is int
                   and added.get(e[1]) == e[0] for e in ends):
            _bad(f"post_processor {post['type']}: cls and sep must be [token, id] of added special tokens")
        return ends[0][1], ends[1][1]
    if post.get("type") != "TemplateProcessing":
        _bad(f"post_processor {post.get('type')!r:.40} is not supported for WordPiece (BertProcessing, "
             "RobertaProcessing, TemplateProcessing)")
    single, table = post.get("single"), post.get("special_tokens")
    if not isinstance(single, list) or not isinstance(table, dict):
        _bad("post_processor TemplateProcessing: \"single\" must be a list and \"special_tokens\" an object")
    kinds = [next(iter(x)) if isinstance(x, dict) and len(x) == 1 else None for x in single]
    if kinds.count("Sequence") != 1 or any(k not in ("Sequence", "SpecialToken") for k in kinds) or \
            kinds.index("Sequence") > 1 or len(kinds) - kinds.index("Sequence") > 2:
        _bad(f"post_processor TemplateProcessing single={single!r:.80} is not supported (at most one special "
             "token before the text and one after it)")

    def special_id(x) -> int:
        name = x["SpecialToken"].get("id") if isinstance(x["SpecialToken"], dict) else None
        entry = table.get(name) if isinstance(name, str) else None
        ids = entry.get("ids") if isinstance(entry, dict) else None
        if not (isinstance(ids, list) and len(ids) == 1 and type(ids[0]) is int and ids[0] in added):
            _bad(f"post_processor TemplateProcessing: special token {name!r:.40} needs the id of one added special "
                 "token in \"special_tokens\"")
        return ids[0]
    at = kinds.index("Sequence")
    return (special_id(single[0]) if at else None), (special_id(single[-1]) if at < len(kinds) - 1 else None)


def wordpiece_from_hf_json(d: dict, vocab_size: int | None, eos_id: int | None):
    """A Hugging Face WordPiece (BertNormalizer, BertPreTokenizer) -> our WordPieceTokenizer with the same ids:
    model.vocab tokens NORMAL, added tokens CONTROL when "special", else USER_DEFINED (both cut out of the text
    before normalizing, as Hugging Face does); ids no token names become UNUSED reserved tokens; the
    post_processor's tokens before and after the text become the bos and the eos (add_eos)."""
    from ..tokenizer.sentencepiece import CONTROL, NORMAL, UNUSED
    from ..tokenizer.wordpiece import WordPieceTokenizer
    m, norm, pre = d["model"], d.get("normalizer"), d.get("pre_tokenizer")
    if not (isinstance(norm, dict) and norm.get("type") == "BertNormalizer"):
        _bad(f"normalizer {norm.get('type') if isinstance(norm, dict) else norm!r:.40} is not supported for "
             "WordPiece (BertNormalizer only)")
    for key in ("clean_text", "handle_chinese_chars"):
        if not _flag(norm, key, True, "normalizer"):
            _bad(f"normalizer BertNormalizer {key}=false is not supported")
    lowercase = _flag(norm, "lowercase", True, "normalizer")
    strip_accents = _flag(norm, "strip_accents", lowercase, "normalizer")
    if not (isinstance(pre, dict) and pre.get("type") == "BertPreTokenizer"):
        _bad(f"pre_tokenizer {pre.get('type') if isinstance(pre, dict) else pre!r:.40} is not supported for "
             "WordPiece (BertPreTokenizer only)")
    vocab, unk, prefix = m.get("vocab"), m.get("unk_token", "[UNK]"), m.get("continuing_subword_prefix", "##")
    longest = m.get("max_input_chars_per_word", 100)
    if not isinstance(vocab, dict) or not isinstance(unk, str) or not isinstance(prefix, str) or not prefix:
        _bad("model.vocab must be an object, model.unk_token and model.continuing_subword_prefix strings")
    if type(longest) is not int or longest < 1:
        _bad(f"model.max_input_chars_per_word must be a positive integer, got {longest!r:.20}")
    names: dict[int, str] = {}
    types: dict[int, int] = {}
    for s, i in vocab.items():
        if type(i) is not int or not 0 <= i < (1 << 31) or not s:
            _bad(f"vocab token {s!r:.40} has id {i!r:.20}; ids are non-negative integers, tokens non-empty")
        if i in names:
            _bad(f"vocab tokens {names[i]!r:.30} and {s!r:.30} share id {i}")
        names[i], types[i] = s, NORMAL
    added_types(d, names, types)
    if unk not in vocab:
        _bad(f"model.unk_token {unk!r:.40} is not in model.vocab")
    n_ids = max(names, default=-1) + 1
    vocab_size = n_ids if vocab_size is None else vocab_size
    if n_ids > vocab_size:
        _bad(f"token id {n_ids - 1} does not fit the model's vocab_size {vocab_size}")
    tokens = [names.get(i, f"<|reserved_{i}|>") for i in range(vocab_size)]
    specials = {i: names[i] for i, ty in types.items() if ty == CONTROL}
    bos_id, sep_id = frame_of(d.get("post_processor"), specials)
    if eos_id is not None and eos_id not in specials:
        _bad(f"the eos token id {eos_id} is not a special (added) token")
    eos = sep_id if sep_id is not None else eos_id
    return WordPieceTokenizer(tokens, [types.get(i, UNUSED) for i in range(vocab_size)], unk, "bert",
                              word_prefix="", continuation=prefix, lowercase=lowercase, strip_accents=strip_accents,
                              max_word_chars=longest, bos=None if bos_id is None else names[bos_id],
                              eos=None if eos is None else names[eos], add_eos=sep_id is not None)


# -------------------------------------------------------------------------------------------- Unigram

def added_types(d: dict, names: dict[int, str], types: dict[int, int]) -> None:
    """Add d's added tokens to names / types (HF id -> content / GGUF type): CONTROL when "special", else
    USER_DEFINED; an added token with single_word / lstrip / rstrip / normalized, or on another token's id, is
    refused."""
    from ..tokenizer.sentencepiece import CONTROL, USER_DEFINED
    for t in d.get("added_tokens") or []:
        if not (isinstance(t, dict) and type(t.get("id")) is int and 0 <= t["id"] < (1 << 31)
                and isinstance(t.get("content"), str) and t["content"]):
            _bad(f"malformed added token {t!r:.80}")
        if any(_flag(t, k, False, f"added token {t['content']!r:.40}") for k in
               ("single_word", "lstrip", "rstrip", "normalized")):
            _bad(f"added token {t['content']!r:.40} with single_word / lstrip / rstrip / normalized is not supported")
        i = t["id"]
        if names.get(i, t["content"]) != t["content"]:
            _bad(f"added token {t['content']!r:.40} has the id {i} of vocab token {names[i]!r:.40}")
        names[i] = t["content"]
        types[i] = CONTROL if _flag(t, "special", False, f"added token {t['content']!r:.40}") else USER_DEFINED


def unigram_normalizer(norm, whitespace_split: bool) -> tuple[bytes | None, str | None]:
    """(the precompiled charsmap, the Unicode normal form) of a Unigram tokenizer.json's normalizer: none, or a
    Sequence of Precompiled, a normal form, and (with a WhitespaceSplit after, where it changes nothing) T5's
    Replace of " {2,}" by " ", in that order."""
    import base64
    import binascii
    steps = (norm.get("normalizers") if isinstance(norm, dict) and norm.get("type") == "Sequence"
             else [norm] if norm is not None else [])
    if not isinstance(steps, list) or not all(isinstance(x, dict) for x in steps):
        _bad("normalizer: a Sequence needs a list of normalizers")
    charsmap, form, kinds = None, None, [x.get("type") for x in steps]
    if kinds[:1] == ["Precompiled"]:
        try:
            charsmap = base64.b64decode(steps.pop(0).get("precompiled_charsmap") or "", validate=True)
        except (binascii.Error, ValueError, TypeError):
            _bad("normalizer Precompiled: precompiled_charsmap must be base64")
        kinds.pop(0)
    if kinds[:1] and kinds[0] in ("NFC", "NFD", "NFKC", "NFKD"):
        form = kinds.pop(0)
        steps.pop(0)
    if kinds == ["Replace"] and whitespace_split and steps[0].get("pattern") == {"Regex": " {2,}"} and \
            steps[0].get("content") == " ":
        kinds = []
    if kinds:
        _bad(f"normalizer {'+'.join(map(str, kinds))} is not supported for Unigram (Precompiled, a normal form, and "
             "before a WhitespaceSplit the Replace of \" {2,}\" by \" \")")
    return charsmap or None, form


def unigram_from_hf_json(d: dict, vocab_size: int | None, eos_id: int | None):
    """A Hugging Face Unigram (normalizer: unigram_normalizer; pre-tokenizer: Metaspace, or WhitespaceSplit then
    Metaspace) -> our UnigramTokenizer with the same ids: model.vocab [piece, score] pairs NORMAL (BYTE for
    <0x00>..<0xFF> with byte_fallback), added tokens CONTROL when "special", else USER_DEFINED; ids no token
    names UNUSED; the post_processor's tokens before and after the text the bos and the eos (add_eos)."""
    from ..tokenizer.sentencepiece import BYTE, BYTE_PIECES, CONTROL, METASPACE, NORMAL, UNUSED
    from ..tokenizer.unigram import UnigramTokenizer
    m, pre = d["model"], d.get("pre_tokenizer")
    steps = pre.get("pretokenizers") if isinstance(pre, dict) and pre.get("type") == "Sequence" else [pre]
    whitespace_split = isinstance(steps, list) and len(steps) == 2 and steps[0] == {"type": "WhitespaceSplit"}
    pre = steps[-1] if whitespace_split or isinstance(steps, list) and len(steps) == 1 else None
    if not (isinstance(pre, dict) and pre.get("type") == "Metaspace" and pre.get("replacement", METASPACE) == METASPACE):
        _bad(f"pre_tokenizer {d.get('pre_tokenizer')!r:.60} is not supported for Unigram (Metaspace with \"▁\", "
             "or WhitespaceSplit then Metaspace)")
    charsmap, form = unigram_normalizer(d.get("normalizer"), whitespace_split)
    scheme = pre.get("prepend_scheme",
                     "always" if _flag(pre, "add_prefix_space", True, "pre_tokenizer Metaspace") else "never")
    prefix = {"always": "every-unless-space", "first": "first-unless-space", "never": "none"}.get(scheme)
    if prefix is None or whitespace_split and prefix == "first-unless-space":
        _bad(f"pre_tokenizer Metaspace prepend_scheme {scheme!r:.20} is not supported"
             + (" after a WhitespaceSplit" if prefix else ""))
    vocab, unk_id = m.get("vocab"), m.get("unk_id")
    byte_fallback = _flag(m, "byte_fallback", False, "model")
    if not isinstance(vocab, list) or not all(isinstance(v, list) and len(v) == 2 and isinstance(v[0], str) and v[0]
                                              and type(v[1]) in (int, float) for v in vocab):
        _bad("model.vocab must be a list of [piece, score] pairs")
    if type(unk_id) is not int or not 0 <= unk_id < len(vocab):
        _bad(f"model.unk_id {unk_id!r:.20} is not the id of a vocab piece")
    names = {i: p for i, (p, _) in enumerate(vocab)}
    types = {i: BYTE if byte_fallback and p in BYTE_PIECES else NORMAL for i, (p, _) in enumerate(vocab)}
    added_types(d, names, types)
    n_ids = max(names, default=-1) + 1
    vocab_size = n_ids if vocab_size is None else vocab_size
    if n_ids > vocab_size:
        _bad(f"token id {n_ids - 1} does not fit the model's vocab_size {vocab_size}")
    tokens = [names.get(i, f"<|reserved_{i}|>") for i in range(vocab_size)]
    scores = [vocab[i][1] if i < len(vocab) else 0.0 for i in range(vocab_size)]
    specials = {i: names[i] for i, ty in types.items() if ty == CONTROL}
    bos_id, end_id = frame_of(d.get("post_processor"), specials)
    if eos_id is not None and eos_id not in specials:
        _bad(f"the eos token id {eos_id} is not a special (added) token")
    eos = end_id if end_id is not None else eos_id
    return UnigramTokenizer(tokens, [types.get(i, UNUSED) for i in range(vocab_size)], scores, names[unk_id], "hf",
                            charsmap, merge_spaces=whitespace_split, form=form, prefix=prefix,
                            split=_flag(pre, "split", True, "pre_tokenizer Metaspace"), byte_fallback=byte_fallback,
                            bos=None if bos_id is None else names[bos_id], eos=None if eos is None else names[eos],
                            add_eos=end_id is not None)
