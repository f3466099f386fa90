"""SentencePiece's precompiled charsmap: the normalization rules a Unigram model carries (NFKC and its own
additions: full-width to ASCII, "\\t" and "\\n" to a space, ...), as bytes in GGUF's
`tokenizer.ggml.precompiled_charsmap` and Hugging Face's `Precompiled` normalizer.

Layout (llama.cpp's llm_tokenizer_ugm reads it so): a little-endian uint32 n, then n bytes of a double-array
trie (XOR-compressed, 32-bit units) over the source byte strings, then the replacement strings, each ended by
a NUL. A unit packs BASE in bits 10-30 (shifted left by 8 when bit 9 is set), LEAF in bit 8, LCHECK (the byte
that leads to the unit) in bits 0-7 and 31; a leaf's BASE points to the unit holding the offset of its
replacement.

`longest_match(data, at)` walks the trie from data[at] byte by byte (a NUL ends the walk) and returns the
longest source that matches there, as (its length, its replacement), or None:

    longest_match("ｈi".encode(), 0) -> (3, b"h")         # FULLWIDTH LATIN SMALL LETTER H

That is how llama.cpp applies the map. Hugging Face's `Precompiled` normalizer applies it otherwise
(`by_graphemes`): grapheme by grapheme, a grapheme of under 6 bytes that some source starts becomes the
replacement of the *shortest* such source, whole (its other characters dropped); else each character alone:

    by_graphemes("Ａ\u0301") -> "A"      (llama.cpp: "A\u0301")
"""
from __future__ import annotations

import numpy as np
import regex

from ..errors import UserError

GRAPHEME = regex.compile(r"\X")


class Charsmap:
    """A precompiled charsmap, checked to have its parts; a walk that leaves the trie is a damaged map."""

    def __init__(self, blob: bytes):
        blob = bytes(blob)
        if len(blob) < 4:
            raise UserError("the precompiled charsmap is too short for its header")
        n = int.from_bytes(blob[:4], "little")
        if n + 4 >= len(blob) or n % 4:
            raise UserError(f"the precompiled charsmap's trie ({n} bytes) does not fit its {len(blob)} bytes")
        self.blob = blob
        self.units = np.frombuffer(blob, "<u4", n // 4, 4).tolist()   # Python ints: the walk reads them one by one
        self.replacements = blob[4 + n:]

    def _unit(self, i: int) -> int:
        if not 0 <= i < len(self.units):
            raise UserError("the precompiled charsmap is damaged (its trie points outside itself)")
        return self.units[i]

    def _base(self, i: int) -> int:
        u = self._unit(i)
        return (u >> 10) << ((u & (1 << 9)) >> 6)

    def longest_match(self, data: bytes, at: int) -> tuple[int, bytes] | None:
        """(length, replacement) of the longest source in the trie that data[at:] starts with; None if none."""
        if not self.units:
            return None
        node, found = self._base(0), None
        for p in range(at, len(data)):
            c = data[p]
            if c == 0:
                break
            node ^= c
            unit = self._unit(node)
            if unit & ((1 << 31) | 0xFF) != c:
                break
            leaf = (unit >> 8) & 1
            node ^= self._base(node)
            if leaf:
                found = (p - at + 1, self._unit(node) & ((1 << 31) - 1))
        if found is None:
            return None
        return found[0], self._replacement(found[1])

    def shortest_match(self, data: bytes) -> bytes | None:
        """The replacement of the shortest source that data starts with (Hugging Face's transform), or None."""
        if not self.units:
            return None
        node = self._base(0)
        for p, c in enumerate(data):
            if c == 0:
                break
            node ^= c
            unit = self._unit(node)
            if unit & ((1 << 31) | 0xFF) != c:
                break
            leaf = (unit >> 8) & 1
            node ^= self._base(node)
            if leaf:
                return self._replacement(self._unit(node) & ((1 << 31) - 1))
        return None

    def _replacement(self, offset: int) -> bytes:
        end = self.replacements.find(b"\0", offset)
        if offset >= len(self.replacements) or end < 0:
            raise UserError("the precompiled charsmap is damaged (a replacement past its end or not ended)")
        return self.replacements[offset:end]

    def by_graphemes(self, text: str) -> str:
        """Hugging Face's Precompiled normalizer (module docstring)."""
        out = []
        for g in GRAPHEME.findall(text):
            raw = g.encode("utf-8", "surrogatepass")
            whole = self.shortest_match(raw) if len(raw) < 6 else None
            if whole is not None:
                out.append(whole)
                continue
            for ch in g:
                one = ch.encode("utf-8", "surrogatepass")
                replaced = self.shortest_match(one)
                out.append(one if replaced is None else replaced)
        return b"".join(out).decode("utf-8", "surrogatepass")
