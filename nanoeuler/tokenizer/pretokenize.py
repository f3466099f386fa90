r"""Pre-tokenization: the regex (or cascade of regexes) that cuts text into the pieces BPE merges within.

GPT-2's pattern is the default: contractions, letter runs, number runs, punctuation runs, whitespace (one
leading space sticks to the next word). A pattern read from a file (an imported tokenizer.json or GGUF, one of
llama.cpp's named pre-tokenizers) is checked before use: it compiles, gives back every character, and stays
within a time bound on probes of every kind of text; encoding bounds its time too (a regex that backtracks
catastrophically on some text is a one-line error, not a hang). A cascade (llama.cpp's `default`, and most of
its named pre-tokenizers) cuts in stages: each regex splits every piece the ones before it left, into its
matches and the stretches between them:

    pretokenize("Hello  world's")                          -> ['Hello', ' ', ' world', "'s"]
    pretokenize("ab12345", (r"\p{N}+", "[0-9]{3}"))         -> ['ab', '123', '45']
"""
from __future__ import annotations

import time
from collections.abc import Iterable

import regex

from ..errors import UserError

GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


# ---- user-supplied pre-tokenization patterns: validated, and bounded in time ---------------------------
PATTERN_PROBES = (
    "Hello, World! It's 2024: 3.14 + x_1 = y;  tabs\tand\nnew lines\r\n\x0b\x0c",
    "".join(chr(c) for c in range(0, 0x20)) + "\x7f" + "".join(chr(c) for c in range(0x80, 0x100)),
    "\u00a0\u2003\u3000\u200b\u2028\u2029 \ufeff",                     # unusual spaces, BOM
    "Ελληνικά кириллица עברית العربية हिन्दी 中文字符 日本語 한국어 ไทย",      # scripts
    "e\u0301 \u0915\u094d 👩‍💻 🇫🇷 ½ ² ٣ ① ∑ € \ue000 \U0010fffd",            # marks, emoji, digits, symbols, private use
    "\udc80\udcff \ud800",                                             # lone surrogates (bytes that are not UTF-8)
)
PATTERN_STRESS = tuple(c * 48 + tail for c in ("a", " ", "1", "!", "\n", "é") for tail in ("", "\x00", "b"))
PATTERN_CHECK_TIMEOUT = 0.5     # seconds a pattern may spend on one probe
MAX_CASCADE = 16                # patterns in one cascade
ENCODE_TIMEOUT_PER_CHAR = 1e-5  # ... and on a text: 1 s + 10 µs per character


def check_pattern(pattern: str | list | tuple) -> None:
    r"""A pre-tokenization pattern must compile, cover every character (the pieces `findall` returns,
    joined, give back the text: `\p{L}+` alone drops spaces and digits, a capturing group drops the
    rest of its match) and run in bounded time (`(a|aa)+$` backtracks exponentially). UserError if not.
    A cascade (a list of patterns, see `split_cascade`) needs each to compile and run in bounded time;
    it covers every character by construction.

        check_pattern(GPT2_PATTERN)     # passes
        check_pattern(r"\p{L}+")        # UserError: ... drops characters: ' ' ...
        check_pattern([r"\p{L}+", r"\d"])   # passes: the stretches between letter runs are pieces too
    """
    if isinstance(pattern, (list, tuple)):
        if not 1 <= len(pattern) <= MAX_CASCADE:
            raise UserError(f"tokenizer.json: a \"pattern\" cascade must list 1 to {MAX_CASCADE} patterns")
        for p in pattern:
            check_one_pattern(p, whole=False)
        return
    check_one_pattern(pattern, whole=True)


def check_one_pattern(pattern, whole: bool) -> None:
    """check_pattern for one regex; whole: its findall must also give back every character."""
    if not isinstance(pattern, str) or not pattern or len(pattern) > 10_000:
        raise UserError("tokenizer.json: \"pattern\" must be a non-empty string (at most 10000 characters) "
                        "or a list of such strings (a cascade)")
    if pattern == GPT2_PATTERN:
        return
    try:
        compiled = regex.compile(pattern)
    except (regex.error, RecursionError, OverflowError, ValueError) as e:
        raise UserError(f"tokenizer.json: bad pre-tokenization pattern: {e}") from None
    for probe in PATTERN_PROBES + ("".join(PATTERN_PROBES),) + PATTERN_STRESS:
        try:
            pieces = compiled.findall(probe, timeout=PATTERN_CHECK_TIMEOUT)
        except TimeoutError:
            raise UserError(f"tokenizer.json: the pre-tokenization pattern takes more than {PATTERN_CHECK_TIMEOUT} s "
                            f"on {len(probe)} characters ({probe[:12]!r}...): it backtracks catastrophically") from None
        if whole and (not all(isinstance(p, str) for p in pieces) or "".join(pieces) != probe):
            kept = "".join(p if isinstance(p, str) else "" for p in pieces)
            lost = sorted(set(probe) - set(kept)) or ["(characters in context)"]
            raise UserError(f"tokenizer.json: the pre-tokenization pattern drops characters, e.g. "
                            f"{''.join(lost[:8])!r} (every character must fall in some piece; use no capturing "
                            f"groups, (?:...) instead)")


def covers_every_character(pattern: str) -> bool:
    """Whether the matches of one regex give back every character of the probes (findall cuts text as a cascade
    of it alone then).  covers_every_character(GPT2_PATTERN) -> True;  covers_every_character(r"\\p{L}+") -> False"""
    try:
        check_one_pattern(pattern, whole=True)
    except UserError:
        return False
    return True


def findall_bounded(compiled, text: str) -> list[str]:
    """compiled.findall(text) with a time bound that grows with the text; UserError when it runs out."""
    limit = 1.0 + ENCODE_TIMEOUT_PER_CHAR * len(text)
    try:
        return compiled.findall(text, timeout=limit)
    except TimeoutError:
        raise _too_slow(limit, text) from None


def _too_slow(limit: float, text: str) -> UserError:
    """The error of a pattern that ran out of its time on text."""
    return UserError(f"the tokenizer's pre-tokenization pattern took more than {limit:.1f} s on a text of "
                     f"{len(text):,} characters (catastrophic backtracking?)")


def split_cascade(compiled: Iterable, text: str) -> list[str]:
    r"""llama.cpp's `unicode_regex_split`: each regex in turn splits every piece the previous ones made, into
    its matches and the stretches between them (both kept: the pieces always join back to the text). Bounded
    in time like one pattern's findall.

        split_cascade([regex.compile(r"\p{N}+"), regex.compile("[0-9]{3}")], "ab12345") -> ['ab', '123', '45']
    """
    limit = 1.0 + ENCODE_TIMEOUT_PER_CHAR * len(text)
    deadline = time.monotonic() + limit
    pieces = [text]
    for r in compiled:
        out = []
        for piece in pieces:
            at = 0
            try:
                for m in r.finditer(piece, timeout=max(deadline - time.monotonic(), 1e-3)):
                    s, e = m.span()
                    out += [piece[at:s], piece[s:e]]
                    at = e
            except TimeoutError:
                raise _too_slow(limit, text) from None
            out.append(piece[at:])
        pieces = [p for p in out if p]
    return pieces


def pretokenize(text: str, pattern: str | tuple = GPT2_PATTERN) -> list[str]:
    """The pre-tokens of text (pattern: one regex, or a cascade of them, see split_cascade).
    pretokenize("Hello  world's") -> ['Hello', ' ', ' world', "'s"]"""
    if isinstance(pattern, str):
        return regex.findall(pattern, text)
    return split_cascade([regex.compile(p) for p in pattern], text)


def hf_splits(pattern: str | tuple[str, ...]) -> list[dict]:
    """A pattern as Hugging Face `Split` pre-tokenizers: one per regex. A Split isolates its matches and keeps
    the stretches between them, so a Sequence of them cuts text as split_cascade does."""
    return [{"type": "Split", "pattern": {"Regex": p}, "behavior": "Isolated", "invert": False}
            for p in ([pattern] if isinstance(pattern, str) else pattern)]
