"""Hugging Face `tokenizer.json` (byte-level BPE) -> our Tokenizer plus the id renumbering; the Alpaca
chat template in Jinja for `tokenizer_config.json`.

Our Tokenizer numbers tokens as bytes 0..255, then merge i as 256 + i, then specials. A Hugging Face
vocabulary numbers them as it likes, so `from_hf_json` returns `perm` with perm[our id] = HF id:

    GPT-2 vocabulary:   '!' -> 0, ..., 'Ġ' -> 220, ..., 'Ġt' -> 256 (merge 0), ..., '<|endoftext|>' -> 50256
    ours:               byte 33 '!' -> 33 (perm[33] = 0), byte 32 ' ' -> 32 (perm[32] = 220), ...

so that `embed_ours = embed_hf[perm]`. Ids a Hugging Face model has but its tokenizer never names (padded
vocabularies, e.g. Qwen2's) become reserved specials `<|reserved_ID|>` so that no row is dropped.

Pre-tokenizers understood (any other is a one-line error naming it):
- `ByteLevel(use_regex=true)`                       -> the GPT-2 pattern (GPT-2, our own export)
- `Sequence[Split(Regex P, Isolated), ByteLevel(use_regex=false)]` -> P (Llama-3, Qwen2, our export)
A Unicode normal form as the normalizer (Qwen2's NFC) is carried by the Tokenizer and applied before encoding.
- `Sequence[Digits(individual_digits=true), ByteLevel(use_regex=true)]` -> SMOLLM_PATTERN (SmolLM)
"""
from __future__ import annotations

import json

from ..errors import UserError
from ..tokenizer import GPT2_PATTERN, Tokenizer, bytes_to_unicode

# GPT-2's pattern run on the pieces left after splitting off every digit (`Digits(individual_digits)`)
# is this one pattern: a digit alone, and whitespace may also end just before a digit (the piece's end).
SMOLLM_PATTERN = (r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+|\s+(?![^\s\p{N}])|\s+""")
LLAMA3_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                  r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
QWEN2_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                 r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
# llama.cpp picks its pre-tokenizer by name (tokenizer.ggml.pre), not by regex
GGUF_PRE_NAMES = {GPT2_PATTERN: "gpt-2", LLAMA3_PATTERN: "llama-bpe", SMOLLM_PATTERN: "smollm", QWEN2_PATTERN: "qwen2"}


def _bad(msg: str):
    raise UserError(f"tokenizer.json: {msg}")


def pattern_of(pre) -> str:
    """The one regex equal to a Hugging Face byte-level pre-tokenizer (see the module docstring)."""
    def byte_level(p, use_regex):
        if p.get("add_prefix_space"):
            _bad("pre_tokenizer ByteLevel.add_prefix_space=true is not supported")
        if bool(p.get("use_regex", True)) != use_regex:
            _bad(f"pre_tokenizer ByteLevel.use_regex={str(not use_regex).lower()} is not supported here")

    if not isinstance(pre, dict):
        _bad("pre_tokenizer is missing (only byte-level BPE tokenizers are supported)")
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
        if kinds == ["Split", "ByteLevel"]:
            split = parts[0]
            pat = split.get("pattern")
            if not (isinstance(pat, dict) and isinstance(pat.get("Regex"), str)):
                _bad("pre_tokenizer Split.pattern must be a Regex")
            if split.get("behavior") != "Isolated" or split.get("invert"):
                _bad(f"pre_tokenizer Split.behavior={split.get('behavior')} invert={split.get('invert')} "
                     "is not supported (only Isolated, not inverted)")
            byte_level(parts[1], False)
            return pat["Regex"]
        if kinds == ["Digits", "ByteLevel"]:
            if not parts[0].get("individual_digits"):
                _bad("pre_tokenizer Digits.individual_digits=false is not supported")
            byte_level(parts[1], True)
            return SMOLLM_PATTERN
        _bad(f"pre_tokenizer Sequence[{', '.join(map(str, kinds))}] is not supported")
    _bad(f"pre_tokenizer {kind} is not supported (only byte-level BPE: ByteLevel, Split+ByteLevel, Digits+ByteLevel)")


def from_hf_json(d: dict, vocab_size: int | None = None, eos_id: int | None = None) -> tuple[Tokenizer, list[int]]:
    """A parsed Hugging Face tokenizer.json -> (our Tokenizer, perm with perm[our id] = HF id).

    vocab_size: the model's embedding rows (>= the tokenizer's ids; extra rows become reserved specials).
    eos_id: the HF id of the end-of-text token (from config.json), which becomes our Tokenizer's eos.
    """
    if not isinstance(d, dict) or not isinstance(d.get("model"), dict):
        _bad("not a Hugging Face tokenizers file (no \"model\")")
    m = d["model"]
    if m.get("type") != "BPE":
        _bad(f"model.type {m.get('type')} is not supported (only byte-level BPE; SentencePiece/Unigram/WordPiece are not)")
    if m.get("byte_fallback"):
        _bad("model.byte_fallback=true (a SentencePiece-style BPE) is not supported; only byte-level BPE")
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
    vocab, merges = m.get("vocab"), m.get("merges")
    if not isinstance(vocab, dict) or not isinstance(merges, list):
        _bad("model.vocab must be an object and model.merges a list")
    added = {}
    for t in d.get("added_tokens") or []:
        if not (isinstance(t, dict) and isinstance(t.get("id"), int) and isinstance(t.get("content"), str) and t["content"]):
            _bad(f"malformed added token {t!r}")
        added[t["id"]] = t["content"]

    alphabet = bytes_to_unicode()
    ours: dict[str, int] = {}     # HF token string -> our id
    perm: list[int] = []          # our id -> HF id
    for b in range(256):
        s = alphabet[b]
        if s not in vocab:
            _bad(f"the byte token {s!r} (byte {b}) is missing from model.vocab: not a byte-level BPE")
        ours[s] = b
        perm.append(vocab[s])
    pairs = []
    for i, mg in enumerate(merges):
        if isinstance(mg, str) and mg.count(" ") == 1:
            a, b = mg.split(" ")
        elif isinstance(mg, list) and len(mg) == 2 and all(isinstance(x, str) for x in mg):
            a, b = mg
        else:
            _bad(f"merge {i} {mg!r} is not a pair of tokens")
        if a not in ours or b not in ours:
            _bad(f"merge {i} ({a!r}, {b!r}) uses a token that no earlier merge builds")
        s = a + b
        if s not in vocab:
            _bad(f"merge {i} makes {s!r}, which is not in model.vocab")
        if s in ours:
            _bad(f"merge {i} makes {s!r} a second time (duplicate merge results are not supported)")
        ours[s] = 256 + i
        perm.append(vocab[s])
        pairs.append((ours[a], ours[b]))
    built = set(perm)
    for s, i in vocab.items():
        if i not in built and i not in added:
            _bad(f"vocab token {s!r} (id {i}) is neither a byte, a merge result nor an added token")
    specials = [added[i] for i in sorted(added) if i not in built]
    special_ids = [i for i in sorted(added) if i not in built]
    n_ids = max([*perm, *special_ids]) + 1
    vocab_size = n_ids if vocab_size is None else vocab_size
    if n_ids > vocab_size:
        _bad(f"token id {n_ids - 1} does not fit the model's vocab_size {vocab_size}")
    used = set(perm) | set(special_ids)
    if len(used) != len(perm) + len(special_ids):
        _bad("two tokens share one id")
    for i in range(vocab_size):
        if i not in used:  # an embedding row no token names: keep it, as a reserved special
            name = f"<|reserved_{i}|>"
            if name in specials:
                _bad(f"cannot name the unused id {i}: {name!r} is taken")
            specials.append(name)
            special_ids.append(i)
    eos = None
    if eos_id is not None:
        hf_to_ours = {h: o for o, h in enumerate(perm)}
        if eos_id in hf_to_ours:
            _bad(f"the eos token id {eos_id} is an ordinary token, not a special one")
        if eos_id not in special_ids:
            _bad(f"the eos token id {eos_id} is not in the tokenizer")
        eos = specials[special_ids.index(eos_id)]
    tok = Tokenizer(pairs, specials, pattern, eos=eos, normalizer=norm["type"] if norm else None)
    if m.get("ignore_merges"):
        check_ignore_merges(tok)
    return tok, perm + special_ids


def check_ignore_merges(tok: Tokenizer) -> None:
    """`ignore_merges` (Llama-3) emits a whole pre-token as one token when the vocabulary has it, before any
    BPE. That changes nothing when BPE builds every such token from its own bytes, which is checked here
    for every token that could be a pre-token; otherwise the tokenizer is refused (never a silently
    different encoding)."""
    from ..tokenizer.tokenizer import bpe
    ranks = {pair: 256 + i for i, pair in enumerate(tok.merges)}
    for i in range(256, 256 + len(tok.merges)):
        b = tok.token_bytes(i)
        if bpe(b, ranks) == [i]:
            continue
        s = b.decode("utf-8", "surrogateescape")
        if tok._regex.findall(s) == [s]:
            _bad(f"model.ignore_merges=true is not supported for this vocabulary: BPE does not rebuild "
                 f"token {s!r} from its bytes")


# ------------------------------------------------------------------------------- chat template

def alpaca_chat_template() -> str:
    """A Jinja chat template rendering the SPEC Alpaca template exactly as `sft.render` does:
    each user turn (its optional "input" key becomes the `### Input:` block) ends with '### Response:\\n',
    each assistant turn is its content + eos_token. add_generation_prompt adds nothing (the user turn
    already ends with the response header)."""
    from ..sft import HEADER

    def lit(s: str) -> str:
        return json.dumps(s)  # a JSON string is a valid Jinja string literal

    return ("{% for message in messages %}"
            "{% if message['role'] == 'user' %}"
            "{{ " + lit(HEADER + "### Instruction:\n") + " + message['content'] + " + lit("\n\n") + " }}"
            "{% if message['input'] is defined and message['input'] %}"
            "{{ " + lit("### Input:\n") + " + message['input'] + " + lit("\n\n") + " }}"
            "{% endif %}"
            "{{ " + lit("### Response:\n") + " }}"
            "{% elif message['role'] == 'assistant' %}"
            "{{ message['content'] + eos_token }}"
            "{% else %}"
            "{{ raise_exception('the Alpaca template has only user and assistant turns') }}"
            "{% endif %}"
            "{% endfor %}")
