"""SentencePiece-style BPE vocabularies made here, no network: trained by the `tokenizers` library in the shapes
real files have (Llama-2's Prepend + Replace normalizer, Gemma's Replace, Metaspace pre-tokenizers), and the
same vocabularies with llama.cpp-style scores."""
from __future__ import annotations

import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from tokenizer import varied_text  # noqa: E402

from nanoeuler.tokenizer.sentencepiece import BYTE_PIECES  # noqa: E402

STYLES = ("llama2", "gemma", "gemma4", "metaspace-always-split", "metaspace-first", "metaspace-never-split",
          "metaspace-always")
SPECIALS = ["<unk>", "<s>", "</s>"]
EXTRA = (("<start_of_turn>", True), ("\n", False), ("  ", False))   # added tokens (special or not) besides them
PROBE_TAIL = " <start_of_turn> x\n\ny  z ▁q 𝄞 \x04 <s>tail xѯy ѯѯѯ"   # added tokens, runs, a pre-escaped ▁,
                                                                     # characters outside the vocabulary


def corpus(n: int = 20, size: int = 3000) -> list[str]:
    return [varied_text(size, seed=s) for s in range(n)]


def hf_spm_json(style: str, texts: list[str], vocab: int = 600) -> dict:
    """A BPE with byte_fallback trained by `tokenizers` on texts: the specials, then the 256 byte tokens
    <0x00>..<0xFF>, then the learned tokens (Llama-2's order); added tokens EXTRA after them (or at their
    vocabulary id); normalizer / pre-tokenizer / decoder as the style's family writes them."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    tk = Tokenizer(models.BPE(byte_fallback=True))
    if style == "gemma4":      # transformers' GemmaTokenizer: one Replace, then a Split at " " that finds none
        tk.normalizer = normalizers.Replace(" ", "▁")
        tk.pre_tokenizer = pre_tokenizers.Split(" ", "merged_with_previous")
        tk.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    elif style in ("llama2", "gemma"):
        steps = ([normalizers.Prepend("▁")] if style == "llama2" else []) + [normalizers.Replace(" ", "▁")]
        tk.normalizer = normalizers.Sequence(steps)
        tk.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
                                       + ([decoders.Strip(" ", 1, 0)] if style == "llama2" else []))
    else:
        scheme = style.split("-")[1]
        tk.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme=scheme, split=style.endswith("split"))
        tk.decoder = decoders.Metaspace(prepend_scheme=scheme, split=style.endswith("split"))
    tk.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIALS, show_progress=False))
    d = json.loads(tk.to_str())
    old = d["model"]["vocab"]
    order = SPECIALS + BYTE_PIECES + [t for t in sorted(old, key=old.get) if t not in SPECIALS and t not in BYTE_PIECES]
    vocab_ids = d["model"]["vocab"] = {t: i for i, t in enumerate(order)}
    added = d["added_tokens"] = [dict(a, id=vocab_ids[a["content"]]) for a in d["added_tokens"]]
    n = len(order)
    for content, special in EXTRA:
        i = vocab_ids.get(content)
        if i is None:
            i, n = n, n + 1
        added.append({"id": i, "content": content, "single_word": False, "lstrip": False, "rstrip": False,
                      "normalized": False, "special": special})
    return d


def probes(n: int, seed: int = 100, size: int = 300) -> list[str]:
    """Texts the vocabulary was not trained on, each ending in PROBE_TAIL."""
    return [varied_text(size, seed=seed + s) + PROBE_TAIL for s in range(n)]


def scored(tokens: list[str], seed: int, ties: bool = True) -> list[float]:
    """Random llama.cpp-style scores: the byte and special tokens 0, the others random (with many ties)."""
    rnd = random.Random(seed)
    top = 20 if ties else 10 ** 9
    return [0.0 if t in BYTE_PIECES or t in SPECIALS else float(-rnd.randint(1, top)) for t in tokens]


def tokens_and_types(d: dict) -> tuple[list[str], list[int]]:
    """The pieces of a hf_spm_json vocabulary in id order, and their GGUF token types."""
    from nanoeuler.tokenizer.sentencepiece import BYTE, CONTROL, NORMAL, USER_DEFINED
    names = {i: t for t, i in d["model"]["vocab"].items()}
    kinds = {i: BYTE if t in BYTE_PIECES else NORMAL for i, t in names.items()}
    for a in d["added_tokens"]:
        names[a["id"]], kinds[a["id"]] = a["content"], CONTROL if a["special"] else USER_DEFINED
    return [names[i] for i in range(len(names))], [kinds[i] for i in range(len(names))]


def with_inner_characters(tokens: list[str], types: list[int], scores: list[float]):
    """Add tokens holding a character that is no token itself ('ѯ' in 'xѯy'): llama.cpp still merges into
    them (its symbols are texts), Hugging Face cannot."""
    from nanoeuler.tokenizer.sentencepiece import NORMAL
    extra = ["xѯ", "xѯy", "▁xѯ", "ѯѯ"]
    return tokens + extra, types + [NORMAL] * len(extra), scores + [-1.5] * len(extra)
