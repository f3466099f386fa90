"""llama.cpp's byte-level pre-tokenizers, one row each (`PRE_FAMILIES`): the `tokenizer.ggml.pre` names that
select a row, the regexes it cuts text by before BPE, and what llama.cpp sets for it (ignore_merges, a bos by
default). A GGUF import reads a file's name here (`pre_pattern`), an export writes the name of the row that splits
and merges as its tokenizer does (`pre_name`); names llama.cpp handles otherwise are refused by name
(`REFUSED_PRE`).

    pre_pattern("smollm")[0] == SMOLLM_PATTERN;  pre_name(GPT2_PATTERN, False) -> "gpt-2"
"""
from __future__ import annotations

import sys
from typing import NamedTuple

from ..errors import UserError
from ..tokenizer import GPT2_PATTERN
from .hf_tokenizer import DEFAULT_CASCADE, LLAMA3_PATTERN, QWEN2_PATTERN, SMOLLM_PATTERN


class PreFamily(NamedTuple):
    """One of llama.cpp's byte-level pre-tokenizers (src/llama-vocab.cpp, LLAMA_VOCAB_PRE_TYPE_*): the
    tokenizer.ggml.pre names that select it, how it cuts text before BPE (one regex whose matches are the
    pieces, or a cascade: a tuple of regexes, each splitting what the ones before left into its matches and the
    stretches between, `split_cascade`), and what llama_vocab::load sets for it ("ignore_merges": a piece that
    is a token is that token; "add_bos": put the bos first unless the file says otherwise)."""
    names: tuple[str, ...]
    pattern: str | tuple[str, ...]
    flags: frozenset[str] = frozenset()


GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"   # llama.cpp's GPT-2 regex
CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
CJK = r"[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"
WORD_CASED = (r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+",      # llama.cpp's form of
              r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*")      # [\p{Lu}...]*[\p{Ll}...]+
BLOOM = r" ?[^(\s|.,!?\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c)]+"
DEEPSEEK_LETTERS = (r"\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af"
                    r"\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5"
                    r"\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba"
                    r"\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45"
                    r"\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-"
                    r"\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107"
                    r"\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f"
                    r"\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d"
                    r"\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17"
                    r"\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb"
                    r"\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943]+")
DEEPSEEK_V3 = (r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
               r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# llama.cpp runs a regex with \p{..} classes on a "collapsed" text (src/unicode.cpp unicode_regex_split: each
# character above ASCII replaced by one of its category, so \p{Lu}, \p{Ll}, \p{Lt}, \p{Lm}, \p{Lo} are all \p{L}
# and \d is [0-9]), and one without them on the text with every whitespace above ASCII replaced by U+000B (so
# a literal range never holds U+3000, U+2003, ...). The rows below are written as Python's `regex` computes what
# llama.cpp computes: YOUTU's and TINY_AYA's cased words are any run of letters and marks, DeepSeek's ranges
# lose their spaces.
WORD_ANY_CASE = r"[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+" + CONTRACTIONS + "?"  # [\p{Lu}..]*[\p{Ll}..]+|[\p{Lu}..]+[\p{Ll}..]*
DEEPSEEK_CJK = r"(?:(?!\s)[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff])+"
# llama.cpp's own splitters for two regexes it names (src/unicode.cpp), each written as the regex that cuts the same:
# digits grouped by threes from the right (afmoe's "\p{AFMoE_digits}", and tiny_aya's "\d{1,3}(?=(?:\d{3})*\b)",
# which llama.cpp runs through the same code; it cuts after each group, not before a run, so the text before a run
# stays with its first digits), and Kimi-K2's pattern, whose words are runs of any letters but Han
# (llama.cpp's unicode_cpt_is_han ranges) with no case classes and no marks, as its code cuts them.
# Pieces end after a group. A run's first group is sized once, at its start (no digit before it): one or two digits
# where the rest is whole threes (looked at possessively: no backtracking into them), else three; then threes.
# (\p{N}{1,3}(?=(?:\p{N}{3})*(?!\p{N})) at every group cuts the same, in time quadratic in a run's length.)
DIGITS_BY_THREES = r"\P{N}*(?<!\p{N})(?:\p{N}{1,2}(?=(?:\p{N}{3})*+(?!\p{N}))|\p{N}{3})|\p{N}{3}|\P{N}+"
# superbpe's "(?=(\d{3})+(?!\d))" (\d: [0-9] to std::regex) cuts a run of ASCII digits before each three counted
# from its end, and nowhere else: the last three stay with what follows the run, up to the next cut. As a regex, that
# lookahead at every position of a run is quadratic in its length; this one matches from a cut to the next instead,
# looking ahead over a run once, at its start. After three digits that end mid-run the next three begin a cut (no
# lookahead); after a run's last three, or from a text's start, it takes everything that is not a cut: other
# characters, runs of one or two digits, and a long run's head of one or two digits before whole threes.
_UP_TO_A_CUT = r"(?:[^0-9]++|[0-9]{1,2}+(?![0-9]))*+(?:[0-9]{1,2}(?=(?:[0-9]{3})++(?![0-9])))?"
ASCII_DIGITS_CUT_BY_THREES = (r"(?:(?<![0-9])[0-9]{3}(?=(?:[0-9]{3})*+(?![0-9]))|(?<=[0-9])[0-9]{3})(?:(?![0-9])"
                              + _UP_TO_A_CUT + ")?|" + _UP_TO_A_CUT)
HAN = r"\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\U00020000-\U0002a6df\U0002a700-\U0002ebef\U0002f800-\U0002fa1f"
KIMI_K2 = (rf"[{HAN}]+|[^\r\n\p{{L}}\p{{N}}]?[^\P{{L}}{HAN}]+{CONTRACTIONS}?|\p{{N}}{{1,3}}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
AFMOE_SCRIPTS = (r"[\u4e00-\u9fff\u3400-\u4dbf\u8c48-\ufaff\u3040-\u309f\u30a0-\u30ff\uff65-\uff9f\u2f00-\u2fdf"
                 r"\u0e40-\u0e7f\u0e80-\u0eff\u1780-\u17ff\u1000-\u109f\uaa60-\uaa7f\ua9e0-\ua9ff\uac00-\ud7af"
                 r"\u1100-\u11ff]+")   # llama.cpp's ranges as its source has them (豈 is U+8C48, เ U+0E40)
IGNORE_MERGES, ADD_BOS = "ignore_merges", "add_bos"

# Every byte-level pre-tokenizer llama.cpp knows, its regexes as llama.cpp computes them (above; GPT-2's, Llama-3's,
# Qwen2's, SmolLM's and `default` in their Hugging Face form, which cuts the same). Left out, refused by name: those
# whose BPE is not byte-level (gemma4, sarvam-moe, whitespace) and those that append a separator (roberta-bpe, ...).
PRE_FAMILIES: dict[str, PreFamily] = {
    "DEFAULT": PreFamily(("default",), DEFAULT_CASCADE),
    "LLAMA3": PreFamily(("llama-bpe", "llama3", "llama-v3", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                         "jina-v5-nano"), LLAMA3_PATTERN, frozenset({IGNORE_MERGES, ADD_BOS})),
    "DBRX": PreFamily(("dbrx", "smaug-bpe", "chatglm-bpe"), LLAMA3_PATTERN),
    "CHATGLM4": PreFamily(("glm4", "glm5"), LLAMA3_PATTERN, frozenset({IGNORE_MERGES})),
    "JAIS2": PreFamily(("jais-2",), (CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                                     r"|\s*[\r\n]+|\s{512}(?!\S)|\s{256}(?!\S)|\s{128}(?!\S)|\s{64}(?!\S)|\s{32}(?!\S)"
                                     r"|\s{16}(?!\S)|\s{8}(?!\S)|\s{4}(?!\S)|\s{1,2}(?!\S)|\s{1}",)),
    "DEEPSEEK_LLM": PreFamily(("deepseek-llm",), (r"[\r\n]", DEEPSEEK_LETTERS,
                                                  r"\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3001-\u3002]+",
                                                  r"\s+$", DEEPSEEK_CJK, r"\p{N}+")),
    "DEEPSEEK_CODER": PreFamily(("deepseek-coder",), (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", DEEPSEEK_CJK, r"\p{N}")),
    "DEEPSEEK3_LLM": PreFamily(("deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4"), (r"\p{N}{1,3}", CJK, DEEPSEEK_V3)),
    "SPARK2_5": PreFamily(("spark2_5",), (r"\p{N}{1,3}", CJK, DEEPSEEK_V3.replace(r"[\r\n]*|\s*[\r\n]+", r"|[\r\n]"),
                                          r"\p{N}")),
    "YOUTU": PreFamily(("youtu",), (r"[\uac00-\ud7a3\u3131-\u318e]+|[\uff01\u2026\u201c\u201d\u2018\u2019\u2014\uff1a\uff1b\uff0c\u3001-\u303f\ufe30-\ufe4f]+|[\u3105-\u312f]+|" + CJK,
                                    WORD_ANY_CASE + r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
                      frozenset({IGNORE_MERGES})),
    "FALCON": PreFamily(("falcon",), (r"[\p{P}\$\+<=>\^~\|`]+", GPT2_SPLIT, r"[0-9][0-9][0-9]")),
    "STARCODER": PreFamily(("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b",
                            "mellum2"), SMOLLM_PATTERN),
    "GPT2": PreFamily(("gpt-2", "mpt", "olmo", "jais", "trillion", "granite-docling", "phi-2", "jina-es", "jina-de",
                       "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0", "mellum", "modern-bert", "exaone4"),
                      GPT2_PATTERN),
    "QWEN2": PreFamily(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan",
                        "solar-open", "grok-2"), QWEN2_PATTERN),
    "QWEN35": PreFamily(("qwen35",), (CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
                                      r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",)),
    "BLOOM": PreFamily(("bloom", "poro-chat", "gpt3-finnish"), (BLOOM,)),
    "VIKING": PreFamily(("viking",), (BLOOM, r"\p{N}")),
    "TEKKEN": PreFamily(("tekken",), ("|".join(WORD_CASED) + r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)"
                                      r"|\s+",), frozenset({IGNORE_MERGES, ADD_BOS})),
    "CHAMELEON": PreFamily(("chameleon",), (r"<sentinel:[0-9]+>", r"(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z",
                                            r"([\t\n]|    |  )", r"\p{N}", r"[\p{P}!-/:-@\[-`{-~]", GPT2_SPLIT),
                           frozenset({ADD_BOS})),
    "GPT4O": PreFamily(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"),
                       ("|".join(w + CONTRACTIONS + "?" for w in WORD_CASED) + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*"
                        r"|\s*[\r\n]+|\s+(?!\S)|\s+",)),
    "GRANITE_EMB_MULTI": PreFamily(("granite-embed-multi-97m",), (
        "|".join(w.replace(r"[\p{L}]", r"[\p{L}\p{M}]") + CONTRACTIONS + "?" for w in WORD_CASED)
        + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",), frozenset({IGNORE_MERGES})),
    "TINY_AYA": PreFamily(("tiny_aya", "cohere2moe"), (
        DIGITS_BY_THREES, WORD_ANY_CASE + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")),
    "SUPERBPE": PreFamily(("superbpe",), (r"\p{N}+", ASCII_DIGITS_CUT_BY_THREES)),
    "BAILINGMOE": PreFamily(("bailingmoe", "bailingmoe2", "llada-moe"), (
        r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
        r"|\s*[\r\n]|\s+(?!\S)|\s+",)),
    "SEED_CODER": PreFamily(("seed-coder",), (CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}"
                                              r"| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+",)),
    "UFAKZEKA": PreFamily(("ufakzeka",), (r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
                                          r"|\s+(?!\S)|\s+",)),
    "KIMI_K2": PreFamily(("kimi-k2",), KIMI_K2),
    "AFMOE": PreFamily(("afmoe",), (DIGITS_BY_THREES, AFMOE_SCRIPTS, DEEPSEEK_V3)),
    "LAGUNA": PreFamily(("laguna",), (r"[^\n]+|[\n]+", QWEN2_PATTERN)),
    "EXAONE_MOE": PreFamily(("exaone-moe",), (CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+"
                                              r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+",)),
    "MINICPM5": PreFamily(("minicpm5",), (r"\p{N}{1,3}", CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+"
                                          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"), frozenset({IGNORE_MERGES})),
}
REFUSED_PRE = {**dict.fromkeys(("gemma4", "granite-embed-multi-311m", "sarvam-moe", "whitespace"),
                               "its BPE works on raw UTF-8, not on bytes"),
               **dict.fromkeys(("roberta-bpe", "jina-v1-en", "jina-v2-code"),
                               "it appends a separator token to every text")}
PRE_BY_NAME = {n: f for f in PRE_FAMILIES.values() for n in f.names}


def pre_name(pattern: str | tuple[str, ...], ignore_merges: bool) -> str | None:
    """The tokenizer.ggml.pre that makes llama.cpp cut text by `pattern` and apply ignore_merges as a tokenizer
    does (export writes it), or None when no row of PRE_FAMILIES does both.
    pre_name(GPT2_PATTERN, False) -> "gpt-2"; pre_name(LLAMA3_PATTERN, False) -> None (llama-bpe ignores merges)"""
    def regexes(p):  # a cascade of one regex reads as that regex where it covers every character (Tokenizer's form)
        return (p,) if isinstance(p, str) else tuple(p)
    return next((f.names[0] for f in PRE_FAMILIES.values()
                 if regexes(f.pattern) == regexes(pattern) and (IGNORE_MERGES in f.flags) == ignore_merges), None)


def pre_pattern(pre: str | None) -> tuple[str | tuple[str, ...], bool, bool]:
    """tokenizer.ggml.pre -> (regex or cascade, ignore_merges, add_bos default).
    pre_pattern("smollm")[0] == SMOLLM_PATTERN; pre_pattern("default")[0] == DEFAULT_CASCADE (a tuple)"""
    if pre in (None, ""):  # as llama.cpp does (and warns)
        print("warning: the GGUF file names no tokenizer.ggml.pre; using llama.cpp's 'default' pre-tokenizer, as "
              "llama.cpp does (the model may have been trained with another)", file=sys.stderr)
        pre = "default"
    if pre in REFUSED_PRE:
        raise UserError(f"tokenizer.ggml.pre {pre!r} is not supported: {REFUSED_PRE[pre]}")
    if pre not in PRE_BY_NAME:
        raise UserError(f"tokenizer.ggml.pre {pre!r:.40} is not a pre-tokenizer llama.cpp knows (known: "
                        f"{', '.join(sorted(PRE_BY_NAME))})")
    f = PRE_BY_NAME[pre]
    return f.pattern, IGNORE_MERGES in f.flags, ADD_BOS in f.flags
