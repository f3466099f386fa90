"""Compiled (numba) kernels behind `sentencepiece.py`: the vocabulary's lookup tables and the merge loop.

The readable definitions are in `sentencepiece.py` (`merge_symbols`, `split_specials`); the tests hold these
kernels equal to them on random vocabularies and texts.

Units: each symbol of the merge loop is a token id (0 <= u < V), or NO_UNIT for a character that is not a
token (with scores it may still merge with a neighbour into a token). Listing the scores' merges gives such a
character a "virtual" id V + k when some token contains it, so that a pair can name it.
Tables (open addressing, a power of two of slots, keys mixed by MIX, -1 = empty):
  text table   FNV-1a hash of a token's bytes -> token id (the bytes compared on a hit)
  char table   a character's bytes packed into an int64 (with its length) -> unit
  pair table   left << 32 | right -> rank << 32 | result   (rank: lower merges first)

Encoding looks a pair up where its ranking lives: with scores (llama.cpp), the two symbols' joined text in the
text table (a symbol is a span of the text, so two neighbours' join is one span), its rank that of the token;
with a merge list (Hugging Face), the pair table. The scores' pair table (`score_pairs`: every cut of every
token) is built only to list the merges (export).
"""
from __future__ import annotations

import numpy as np
from numba import njit

from ..numba_cache import install
from .bpe_fast import FNV_OFFSET, FNV_PRIME, MIX

install()

NO_UNIT = -1          # a character no token holds: it becomes byte tokens
DEAD = -2             # a symbol merged into its left neighbour
SPACE = 0x20
METASPACE = np.array([0xE2, 0x96, 0x81], np.uint8)   # "▁" (U+2581), the space of SentencePiece pieces


@njit(inline="always")
def utf8_len(b):
    """The bytes of the UTF-8 character whose first byte is b, as llama.cpp's unicode_len_utf8 counts them by the
    high four bits alone (a stray continuation byte is one byte; 0xF8..0xFF, no lead byte, four like 0xF0)."""
    if b < 0xC0:
        return 1
    if b < 0xE0:
        return 2
    if b < 0xF0:
        return 3
    return 4


@njit(inline="always")
def _slot(key, mask):
    return np.int64((np.uint64(key) * MIX) >> np.uint64(20) & mask)


@njit(inline="always")
def _char_key(buf, p, n):
    """A character of n <= 4 bytes as one int64 key (bytes little-endian, the length above them)."""
    key = np.int64(n) << 32
    for j in range(n):
        key |= np.int64(buf[p + j]) << (8 * j)
    return key


@njit(inline="always")
def _get(keys, vals, key):
    """vals at key in an open-addressing table, -1 if absent."""
    mask = np.uint64(keys.shape[0] - 1)
    i = _slot(key, mask)
    while keys[i] != -1:
        if keys[i] == key:
            return vals[i]
        i = (i + 1) & (keys.shape[0] - 1)
    return -1


@njit(inline="always")
def _put(keys, vals, key, value):
    """Set key -> value; return the value that was there (-1 if none)."""
    mask = np.uint64(keys.shape[0] - 1)
    i = _slot(key, mask)
    while keys[i] != -1:
        if keys[i] == key:
            old = vals[i]
            vals[i] = value
            return old
        i = (i + 1) & (keys.shape[0] - 1)
    keys[i] = key
    vals[i] = value
    return -1


def table(n: int) -> tuple[np.ndarray, np.ndarray]:
    """An empty table with room for n keys (at most half full)."""
    cap = 16
    while cap < 2 * max(n, 1):
        cap *= 2
    return np.full(cap, -1, np.int64), np.full(cap, -1, np.int64)


# ------------------------------------------------------------------------------------- building

@njit(inline="always")
def _hash(blob, s, e):
    h = FNV_OFFSET
    for j in range(s, e):
        h = (h ^ np.uint64(blob[j])) * FNV_PRIME
    return np.int64(h >> np.uint64(1))          # non-negative: -1 stays free for "empty"


@njit(inline="always")
def _find_text(t_keys, t_vals, blob, starts, ends, q, s, e):
    """The id of the token whose bytes are q[s:e] (blob[starts[i]:ends[i]] is token i), or -1."""
    return _find_hashed(t_keys, t_vals, blob, starts, ends, q, s, e, _hash(q, s, e))


@njit(inline="always")
def _find_hashed(t_keys, t_vals, blob, starts, ends, q, s, e, h):
    """_find_text for a caller that has q[s:e]'s hash h (_hash) already."""
    i = _slot(h, np.uint64(t_keys.shape[0] - 1))
    while t_keys[i] != -1:
        if t_keys[i] == h:
            t = t_vals[i]
            if ends[t] - starts[t] == e - s:
                same = True
                for j in range(e - s):
                    if blob[starts[t] + j] != q[s + j]:
                        same = False
                        break
                if same:
                    return t
        i = (i + 1) & (t_keys.shape[0] - 1)
    return -1


@njit(cache=True)
def find_text(t_keys, t_vals, blob, starts, ends, q):
    """The id of the token whose bytes are q, or -1 (the text table's lookup, compiled once for Python callers)."""
    return _find_text(t_keys, t_vals, blob, starts, ends, q, 0, q.shape[0])


@njit(cache=True)
def text_table(blob, starts, ends, t_keys, t_vals):
    """Fill the text table with every token; return the first id whose text an earlier token has, or -1."""
    for t in range(starts.shape[0]):
        if _find_text(t_keys, t_vals, blob, starts, ends, blob, starts[t], ends[t]) >= 0:
            return t
        h = _hash(blob, starts[t], ends[t])
        i = _slot(h, np.uint64(t_keys.shape[0] - 1))
        while t_keys[i] != -1:
            i = (i + 1) & (t_keys.shape[0] - 1)
        t_keys[i] = h
        t_vals[i] = t
    return -1


@njit(cache=True)
def merge_texts(mblob, mstarts, mends, t_keys, t_vals, blob, starts, ends, out):
    """Each merge "a b" (mblob[mstarts[i]:mends[i]], cut at its first space after its first byte, as llama.cpp
    cuts it) as the ids of a and b, into out [merges, 2]; returns the first merge whose two sides are not both
    tokens, or -1."""
    for i in range(mstarts.shape[0]):
        s, e, cut = mstarts[i], mends[i], -1
        for j in range(s + 1, e):
            if mblob[j] == SPACE:
                cut = j
                break
        if cut < 0:
            return i
        out[i, 0] = _find_text(t_keys, t_vals, blob, starts, ends, mblob, s, cut)
        out[i, 1] = _find_text(t_keys, t_vals, blob, starts, ends, mblob, cut + 1, e)
        if out[i, 0] < 0 or out[i, 1] < 0:
            return i
    return -1


@njit(inline="always")
def _one_char(blob, s, e):
    return e > s and min(utf8_len(blob[s]), e - s) == e - s


@njit(cache=True)
def count_chars(blob, starts, ends):
    """How many tokens are one character."""
    n = 0
    for t in range(starts.shape[0]):
        n += _one_char(blob, starts[t], ends[t])
    return n


@njit(cache=True)
def char_table(blob, starts, ends, c_keys, c_vals):
    """Put every token that is one character in the char table (key -> its id)."""
    for t in range(starts.shape[0]):
        if _one_char(blob, starts[t], ends[t]):
            _put(c_keys, c_vals, _char_key(blob, starts[t], ends[t] - starts[t]), t)


@njit(inline="always")
def _unit(blob, s, e, t_keys, t_vals, starts, ends, c_keys, c_vals, state):
    """The unit of the text blob[s:e] as a symbol: a token id, or, if it is one character that is not a token,
    a virtual id (made on first sight: state = [virtual ids made, V, the most allowed]); -1 if neither (a
    space too: text reaches the merges with its spaces as "▁"), -2 when the char table is out of room."""
    t = _find_text(t_keys, t_vals, blob, starts, ends, blob, s, e)
    if t >= 0:
        return t
    if not _one_char(blob, s, e) or blob[s] == SPACE:
        return -1
    key = _char_key(blob, s, e - s)
    u = _get(c_keys, c_vals, key)
    if u < 0:
        if state[0] >= state[2]:
            return -2
        u = state[1] + state[0]
        state[0] += 1
        _put(c_keys, c_vals, key, u)
    return u


@njit(cache=True)
def score_pairs(blob, starts, ends, t_keys, t_vals, c_keys, c_vals, state, pairs):
    """llama.cpp's pairs: (a, b) merges into token c when text(a) + text(b) == text(c), cut between two
    characters of c. Writes the rows (a, b, c) into pairs (room for every cut); gives the characters inside
    tokens that are not tokens their virtual ids. Returns the number of rows, -1 if there are more such
    characters than state[2].

        tokens 'a', 'b', 'ab', 'abc' ('c' not a token): ('a', 'b') -> 'ab'; ('ab', c*) -> 'abc' with c* = V + 0
    """
    n = 0
    for c in range(starts.shape[0]):
        s, e = starts[c], ends[c]
        cut = s + min(utf8_len(blob[s]), e - s)
        while cut < e:
            a = _unit(blob, s, cut, t_keys, t_vals, starts, ends, c_keys, c_vals, state)
            b = _unit(blob, cut, e, t_keys, t_vals, starts, ends, c_keys, c_vals, state) if a >= 0 else -1
            if a == -2 or b == -2:
                return -1
            if a >= 0 and b >= 0:
                pairs[n, 0], pairs[n, 1], pairs[n, 2] = a, b, c
                n += 1
            cut += min(utf8_len(blob[cut]), e - cut)
    return n


@njit(cache=True)
def fill_pairs(pairs, rank, p_keys, p_vals):
    """The pair table of rows (a, b, c): a << 32 | b -> rank[c] << 32 | c."""
    for i in range(pairs.shape[0]):
        a, b, c = pairs[i, 0], pairs[i, 1], pairs[i, 2]
        _put(p_keys, p_vals, (np.int64(a) << 32) | b, (np.int64(rank[c]) << 32) | c)


@njit(cache=True)
def merge_pairs(blob, starts, ends, merges, t_keys, t_vals, p_keys, p_vals, scratch):
    """Hugging Face's pairs: merges[i] = (a, b) merges into the token text(a) + text(b) with rank i. Returns
    -1, or the index of the first merge whose result is not a token (or repeats an earlier merge)."""
    for i in range(merges.shape[0]):
        a, b = merges[i, 0], merges[i, 1]
        la, lb = ends[a] - starts[a], ends[b] - starts[b]
        scratch[:la] = blob[starts[a]:ends[a]]
        scratch[la:la + lb] = blob[starts[b]:ends[b]]
        c = _find_text(t_keys, t_vals, blob, starts, ends, scratch, 0, la + lb)
        if c < 0 or _put(p_keys, p_vals, (np.int64(a) << 32) | b, (np.int64(i) << 32) | c) >= 0:
            return i
    return -1


@njit(cache=True)
def pair_list(p_keys, p_vals):
    """[n, 4] int64 rows (rank, result, left, right) of the pair table, sorted by rank then result."""
    n = 0
    for i in range(p_keys.shape[0]):
        if p_keys[i] != -1:
            n += 1
    rows = np.empty((n, 4), np.int64)
    k = 0
    for i in range(p_keys.shape[0]):
        if p_keys[i] != -1:
            rows[k, 0] = p_vals[i] >> 32
            rows[k, 1] = p_vals[i] & 0xFFFFFFFF
            rows[k, 2] = p_keys[i] >> 32
            rows[k, 3] = p_keys[i] & 0xFFFFFFFF
            k += 1
    order = np.argsort(rows[:, 0] * (np.int64(1) << 31) + rows[:, 1], kind="mergesort")
    return rows[order]


# ------------------------------------------------------------------------------------- encoding

@njit(cache=True)
def escape(buf, f_start, f_end, f_token, prefix, out):
    """Copy the text fragments of buf into out, a "▁" first where prefix[i] and every space as "▁"; f_start /
    f_end are rewritten to out's offsets. f_token[i] >= 0 marks a special token's fragment (left as it is).
    Returns the bytes written."""
    k = 0
    for i in range(f_start.shape[0]):
        s, e = f_start[i], f_end[i]
        f_start[i] = k
        if f_token[i] >= 0:
            f_end[i] = k
            continue
        if prefix[i]:
            out[k:k + 3] = METASPACE
            k += 3
        for p in range(s, e):
            if buf[p] == SPACE:
                out[k:k + 3] = METASPACE
                k += 3
            else:
                out[k] = buf[p]
                k += 1
        f_end[i] = k
    return k


@njit(inline="always")
def _swap(heap, i, j):
    for c in range(5):
        heap[i, c], heap[j, c] = heap[j, c], heap[i, c]


@njit(inline="always")
def _heap_push(heap, size, key, right, lu, ru, result):
    """Add the entry (key = rank << 31 | left, right, left unit, right unit, merged unit); return the new size."""
    i = size
    heap[i, 0], heap[i, 1], heap[i, 2], heap[i, 3], heap[i, 4] = key, right, lu, ru, result
    while i > 0 and heap[i, 0] < heap[(i - 1) >> 1, 0]:
        _swap(heap, i, (i - 1) >> 1)
        i = (i - 1) >> 1
    return size + 1


@njit(inline="always")
def _heap_pop(heap, size):
    """Remove the top (the caller read it at row 0); return the new size."""
    last = size - 1
    _swap(heap, 0, last)
    i = 0
    while True:
        child = 2 * i + 1
        if child >= last:
            break
        if child + 1 < last and heap[child + 1, 0] < heap[child, 0]:
            child += 1
        if heap[i, 0] <= heap[child, 0]:
            break
        _swap(heap, i, child)
        i = child
    return last


@njit(inline="always")
def _try_pair(T, p_keys, p_vals, buf, sym_s, sym_e, unit, heap, size, left, right):
    """Queue the pair (left, right) of symbols if it merges; return the heap size. T = (rank, text table, token
    spans): with scores (rank not empty) when their joined text is a token, else when the pair table lists them."""
    if left < 0 or right < 0:
        return size
    rank, t_keys, t_vals, blob, starts, ends = T
    if rank.shape[0]:
        c = _find_text(t_keys, t_vals, blob, starts, ends, buf, sym_s[left], sym_e[right])
        if c < 0:
            return size
        return _heap_push(heap, size, (rank[c] << 31) | left, right, unit[left], unit[right], c)
    if unit[left] < 0 or unit[right] < 0:
        return size
    v = _get(p_keys, p_vals, (np.int64(unit[left]) << 32) | unit[right])
    if v < 0:
        return size
    return _heap_push(heap, size, ((v >> 32) << 31) | left, right, unit[left], unit[right], v & 0xFFFFFFFF)


@njit(cache=True)
def encode_pieces(buf, f_start, f_end, f_token, split, bytes_first, n_tokens, c_keys, c_vals, T, p_keys, p_vals,
                  byte_token, out):
    """Encode the escaped fragments of buf (see `escape`) into out; return the id count.

    A text fragment (cut before each "▁" when split) is cut into characters, each a unit (a character that
    is not a token: its byte tokens at once when bytes_first, as Hugging Face does, else NO_UNIT, which may
    still merge with a neighbour (scores) and otherwise becomes byte tokens at the end, as llama.cpp does);
    then the adjacent pair of lowest rank (leftmost among equals) merges, until no pair does (`_try_pair`;
    a heap of candidate pairs, stale entries skipped on pop). `merge_symbols` in sentencepiece.py is the
    readable version.
    """
    longest = 1
    for i in range(f_start.shape[0]):
        longest = max(longest, f_end[i] - f_start[i])
    unit = np.empty(longest, np.int64)
    sym_s = np.empty(longest, np.int64)
    sym_e = np.empty(longest, np.int64)
    nxt = np.empty(longest, np.int64)
    prv = np.empty(longest, np.int64)
    heap = np.empty((3 * longest + 4, 5), np.int64)     # [entries, (key, right, left unit, right unit, result)]
    k = 0
    for f in range(f_start.shape[0]):
        if f_token[f] >= 0:
            out[k] = f_token[f]
            k += 1
            continue
        p, end = f_start[f], f_end[f]
        while p < end:
            q = end
            if split:                            # a piece: its first character, then up to the next "▁"
                q = p + min(utf8_len(buf[p]), end - p)
                while q < end and not (buf[q] == 0xE2 and q + 2 < end and buf[q + 1] == 0x96 and buf[q + 2] == 0x81):
                    q += min(utf8_len(buf[q]), end - q)
            k = _merge_piece(buf, p, q, bytes_first, n_tokens, c_keys, c_vals, T, p_keys, p_vals, byte_token, out,
                             k, unit, sym_s, sym_e, nxt, prv, heap)
            p = q
    return k


@njit(inline="always")
def _merge_piece(buf, p, end, bytes_first, n_tokens, c_keys, c_vals, T, p_keys, p_vals, byte_token, out, k,
                 unit, sym_s, sym_e, nxt, prv, heap):
    """BPE of the bytes buf[p:end] appended to out[k:]; returns the new k."""
    n = 0
    while p < end:                                       # characters -> units
        L = min(utf8_len(buf[p]), end - p)
        u = _get(c_keys, c_vals, _char_key(buf, p, L))
        if (u < 0 or u >= n_tokens) and bytes_first:
            for j in range(L):
                unit[n], sym_s[n], sym_e[n] = byte_token[buf[p + j]], p + j, p + j + 1
                n += 1
        else:
            unit[n], sym_s[n], sym_e[n] = u, p, p + L
            n += 1
        p += L
    for i in range(n):
        prv[i] = i - 1
        nxt[i] = i + 1 if i + 1 < n else -1
    size = 0
    for i in range(n - 1):
        size = _try_pair(T, p_keys, p_vals, buf, sym_s, sym_e, unit, heap, size, i, i + 1)
    while size > 0:
        left = heap[0, 0] & 0x7FFFFFFF
        right, lu, ru, merged = heap[0, 1], heap[0, 2], heap[0, 3], heap[0, 4]
        size = _heap_pop(heap, size)
        if unit[left] != lu or unit[right] != ru or nxt[left] != right:
            continue                                     # stale: a side has merged since it was queued
        unit[left] = merged
        sym_e[left] = sym_e[right]
        unit[right] = DEAD
        nxt[left] = nxt[right]
        if nxt[right] >= 0:
            prv[nxt[right]] = left
        size = _try_pair(T, p_keys, p_vals, buf, sym_s, sym_e, unit, heap, size, prv[left], left)
        size = _try_pair(T, p_keys, p_vals, buf, sym_s, sym_e, unit, heap, size, left, nxt[left])
    i = 0 if n else -1
    while i >= 0:                                        # symbols -> ids (byte tokens for what is no token)
        u = unit[i]
        if 0 <= u < n_tokens:
            out[k] = u
            k += 1
        else:
            for j in range(sym_s[i], sym_e[i]):
                out[k] = byte_token[buf[j]]
                k += 1
        i = nxt[i]
    return k


@njit(cache=True)
def special_trie(blob, starts, ends, ids, trie_keys, trie_vals, term):
    """A byte trie of the special tokens ids (node 0 the root): (node << 8 | byte) -> child in the table,
    term[node] = the token ending there (-1 none). Returns the number of nodes."""
    nodes = 1
    for t in ids:
        node = 0
        for j in range(starts[t], ends[t]):
            key = (np.int64(node) << 8) | blob[j]
            child = _get(trie_keys, trie_vals, key)
            if child < 0:
                child = nodes
                term[child] = -1
                nodes += 1
                _put(trie_keys, trie_vals, key, child)
            node = child
        term[node] = t
    return nodes


@njit(cache=True)
def find_specials(buf, trie_keys, trie_vals, term, f_start, f_end, f_token):
    """Cut buf into fragments at the special tokens of the trie, the longest at the leftmost position first:
    fills f_start, f_end, f_token (the token, or -1 for text); returns the fragment count."""
    n = buf.shape[0]
    k = 0
    text_from = 0
    p = 0
    while p < n:
        node = 0
        best, best_end = -1, -1
        q = p
        while q < n:
            node = _get(trie_keys, trie_vals, (np.int64(node) << 8) | buf[q])
            if node < 0:
                break
            q += 1
            if term[node] >= 0:
                best, best_end = term[node], q
        if best < 0:
            p += 1
            continue
        if p > text_from:
            f_start[k], f_end[k], f_token[k] = text_from, p, -1
            k += 1
        f_start[k], f_end[k], f_token[k] = p, best_end, best
        k += 1
        p = text_from = best_end
    if n > text_from:
        f_start[k], f_end[k], f_token[k] = text_from, n, -1
        k += 1
    return k
