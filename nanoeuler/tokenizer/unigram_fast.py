"""Compiled (numba) Viterbi behind `unigram.py`: the same cut as its readable `viterbi`, which the tests hold it
equal to, over the UTF-8 bytes of a piece instead of its characters.

From each character start i (stepping by llama.cpp's unicode_len_utf8 of the byte there), the bytes i..e are
hashed as they grow (FNV-1a, spm_fast's text table) and looked up at each e while some usable token starts
with them (the prefix table: the hash of every prefix of every usable token): a token found that the cut may
use competes for best[e]; when none covers the character alone, the unknown does.
The back-trace from the end gives (start, end, token) spans, an unknown run as one span with token -1.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from ..numba_cache import install
from .bpe_fast import FNV_OFFSET, FNV_PRIME
from .spm_fast import _find_hashed, _get, _put, utf8_len

install()


@njit(cache=True)
def prefix_table(blob, starts, ends, usable, p_keys, p_vals):
    """Put the hash of every prefix of every usable token into the prefix table."""
    for t in range(starts.shape[0]):
        if usable[t]:
            h = FNV_OFFSET
            for j in range(starts[t], ends[t]):
                h = (h ^ np.uint64(blob[j])) * FNV_PRIME
                _put(p_keys, p_vals, np.int64(h >> np.uint64(1)), 1)


@njit(cache=True)
def viterbi(buf, t_keys, t_vals, blob, starts, ends, p_keys, p_vals, usable, scores, longest, unk_score, spans):
    """The best cut of buf ([n] uint8): writes (start, end, token or -1) rows into spans [n, 3] and returns
    their count. p_keys, p_vals: the prefix table; usable [V] bool: the tokens the cut may use; scores [V]
    float64; longest: the most bytes a usable token has; unk_score: an unknown character's score."""
    n = buf.shape[0]
    best = np.full(n + 1, -np.inf)
    best[0] = 0.0
    start = np.zeros(n + 1, np.int64)
    token = np.full(n + 1, -1, np.int64)
    i = 0
    while i < n:
        here = best[i]
        width = min(utf8_len(buf[i]), n - i)
        single = False
        h = FNV_OFFSET
        e = i
        while e < n and e - i < longest:
            h = (h ^ np.uint64(buf[e])) * FNV_PRIME
            e += 1
            if _get(p_keys, p_vals, np.int64(h >> np.uint64(1))) < 0:
                break                                 # no usable token starts with buf[i:e]
            t = _find_hashed(t_keys, t_vals, blob, starts, ends, buf, i, e, np.int64(h >> np.uint64(1)))
            if t >= 0 and usable[t]:
                if e - i == width:
                    single = True
                if here + scores[t] > best[e]:
                    best[e] = here + scores[t]
                    start[e] = i
                    token[e] = t
        if not single and here + unk_score > best[i + width]:
            best[i + width] = here + unk_score
            start[i + width] = i
            token[i + width] = -1
        i += width
    k, e = 0, n
    while e > 0:
        a = start[e]
        if token[e] < 0 and k > 0 and spans[k - 1, 2] < 0:
            spans[k - 1, 0] = a                       # an unknown next to an unknown: one span
        else:
            spans[k, 0], spans[k, 1], spans[k, 2] = a, e, token[e]
            k += 1
        e = a
    spans[:k] = spans[:k][::-1].copy()
    return k


@njit(inline="always")
def _charsmap_match(units, data, at):
    """charsmap.Charsmap.longest_match compiled: (length, replacement offset) of the longest source at data[at],
    (0, 0) if none, (-1, 0) if the trie points outside itself."""
    size = units.shape[0]
    if size == 0:
        return 0, 0
    u = units[0]
    node = (u >> 10) << ((u & (1 << 9)) >> 6)
    length, offset = 0, 0
    for p in range(at, data.shape[0]):
        c = np.int64(data[p])
        if c == 0:
            break
        node ^= c
        if node >= size:
            return -1, 0
        u = units[node]
        if u & ((1 << 31) | 0xFF) != c:
            break
        leaf = (u >> 8) & 1
        node ^= (u >> 10) << ((u & (1 << 9)) >> 6)
        if leaf:
            if node >= size:
                return -1, 0
            length, offset = p - at + 1, units[node] & ((1 << 31) - 1)
    return length, offset


@njit(inline="always")
def _utf8_length(data, at):
    """sentencepiece.utf8_length compiled."""
    b = data[at]
    n = 1 if b < 0x80 else 0 if b < 0xC0 else 2 if b < 0xE0 else 3 if b < 0xF0 else 4 if b < 0xF8 else 0
    if n == 0 or at + n > data.shape[0]:
        return 0
    for j in range(at + 1, at + n):
        if data[j] & 0xC0 != 0x80:
            return 0
    return n


@njit(cache=True)
def normalize(data, units, replacements, user_blob, user_starts, user_ends, out):
    """UnigramTokenizer.normalize_llama_cpp's first part compiled (before the whitespace rule): writes the
    normalized bytes of data into out and returns their count, -1 if the charsmap is damaged. units: the
    charsmap's trie (int64); user_*: the user-defined tokens' bytes (blob[starts[i]:ends[i]])."""
    n, k, at = data.shape[0], 0, 0
    while at < n:
        common = 0                                   # the longest prefix of a user-defined token here
        for u in range(user_starts.shape[0]):
            m, s, e = 0, user_starts[u], user_ends[u]
            while s + m < e and at + m < n and user_blob[s + m] == data[at + m]:
                m += 1
            common = max(common, m)
        if common:
            out[k:k + common] = data[at:at + common]
            k += common
            at += common
            continue
        length, offset = _charsmap_match(units, data, at)
        if length < 0:
            return -1
        if length:
            end = offset
            while end < replacements.shape[0] and replacements[end] != 0:
                end += 1
            if offset >= replacements.shape[0] or end == replacements.shape[0]:
                return -1
            out[k:k + end - offset] = replacements[offset:end]
            k += end - offset
            at += length
            continue
        w = _utf8_length(data, at)
        if w:
            out[k:k + w] = data[at:at + w]
            k += w
            at += w
        else:
            out[k], out[k + 1], out[k + 2] = 0xEF, 0xBF, 0xBD
            k += 3
            at += 1
    return k
