"""Compiled (numba) kernels behind `nanoeuler.tokenizer`: GPT-2 pre-tokenization, piece counting,
incremental BPE training and cached encoding, all working on UTF-8 bytes without a Python loop per byte.

`tokenizer.py` holds the readable reference algorithms (regex pre-tokenization, `get_stats`, `merge`, `bpe`);
the kernels here compute exactly the same thing and the tests compare the two on random text. Encoding merges
one pair at a time by rank with a heap of candidate merges (`bpe_piece`), so that any vocabulary's merge list
applies as Hugging Face and llama.cpp apply it.

Pre-tokenization is the GPT-2 pattern

    's|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+

run as a hand-written scanner over UTF-8: each code point gets one of four classes from a table built
once with the `regex` package (OTHER, LETTER, NUMBER, SPACE), and invalid UTF-8 bytes count as OTHER,
the same as Python's `surrogateescape` would make them. Example: b"Hello  world's" splits into
b"Hello", b" ", b" world", b"'s" (the last space of a run sticks to the word after it).
"""
from __future__ import annotations

from functools import cache

import numpy as np
from numba import njit, types
from numba.typed import Dict

from ..numba_cache import install

install()  # before any kernel is compiled or loaded from the cache (see numba_cache.py)

OTHER, LETTER, NUMBER, SPACE, CONT = 0, 1, 2, 3, 4
MIX = np.uint64(0x9E3779B97F4A7C15)
FNV_OFFSET = np.uint64(0xCBF29CE484222325)
FNV_PRIME = np.uint64(0x100000001B3)
EMPTY = np.uint64(0)


@cache
def char_classes() -> np.ndarray:
    """uint8 [0x110000]: the class of every code point, computed with the same `regex` classes the
    reference pattern uses, so the scanner and the regex agree by construction."""
    import regex

    every = "".join(map(chr, range(0x110000)))
    table = np.zeros(0x110000, np.uint8)
    for cls, pattern in ((LETTER, r"\p{L}+"), (NUMBER, r"\p{N}+"), (SPACE, r"\s+")):
        for m in regex.finditer(pattern, every):
            table[m.start():m.end()] = cls
    return table


# ---------------------------------------------------------------------------------------- scanner
# Performance note: numba does not inline helpers that take arrays without reference-count traffic, so
# the hot loops below are written out in one function each rather than calling small helpers per byte.

def classify(buf, table):
    """uint8 [n]: the class of the code point starting at each byte, CONT on its continuation bytes.

    Strict UTF-8: an overlong form, a surrogate or a truncated sequence is one OTHER byte, then the
    next byte is looked at afresh.  classify(b"a\xc3\xa9 1\xff") -> [LETTER, LETTER, CONT, SPACE, NUMBER, OTHER]
    """
    cls = np.empty(buf.shape[0], np.uint8)
    classify_into(buf, table, cls)
    return cls


@njit(cache=True)
def classify_into(buf, table, cls):
    """classify, writing into cls (at least len(buf) long)."""
    n = buf.shape[0]
    p = 0
    while p < n:
        b = np.int64(buf[p])
        if b < 0x80:
            cls[p] = table[b]
            p += 1
            continue
        L = 0
        cp = 0
        if 0xC2 <= b <= 0xDF:
            if p + 1 < n:
                b1 = np.int64(buf[p + 1])
                if 0x80 <= b1 <= 0xBF:
                    L = 2
                    cp = ((b & 0x1F) << 6) | (b1 & 0x3F)
        elif 0xE0 <= b <= 0xEF:
            if p + 2 < n:
                b1 = np.int64(buf[p + 1])
                b2 = np.int64(buf[p + 2])
                lo = 0xA0 if b == 0xE0 else 0x80
                hi = 0x9F if b == 0xED else 0xBF
                if lo <= b1 <= hi and 0x80 <= b2 <= 0xBF:
                    L = 3
                    cp = ((b & 0x0F) << 12) | ((b1 & 0x3F) << 6) | (b2 & 0x3F)
        elif 0xF0 <= b <= 0xF4:
            if p + 3 < n:
                b1 = np.int64(buf[p + 1])
                b2 = np.int64(buf[p + 2])
                b3 = np.int64(buf[p + 3])
                lo = 0x90 if b == 0xF0 else 0x80
                hi = 0x8F if b == 0xF4 else 0xBF
                if lo <= b1 <= hi and 0x80 <= b2 <= 0xBF and 0x80 <= b3 <= 0xBF:
                    L = 4
                    cp = ((b & 0x07) << 18) | ((b1 & 0x3F) << 12) | ((b2 & 0x3F) << 6) | (b3 & 0x3F)
        if L == 0:
            cls[p] = OTHER
            p += 1
        else:
            cls[p] = table[cp]
            for j in range(1, L):
                cls[p + j] = CONT
            p += L
    return cls


@njit(cache=True)
def scan(buf, cls, ends):
    """Write the end offset of each GPT-2 pre-token of buf into ends; return how many there are.

    The pattern's alternatives, tried in order at each start p (the regex engine's leftmost choice):
    a contraction; ' ?' + a run of one class (letters, numbers or other); whitespace: the whole run at
    the end of the text, else the run less its last character, else (a run of one) that character.
    """
    n = buf.shape[0]
    k = 0
    p = 0
    while p < n:
        c0 = cls[p]
        a0 = buf[p]
        p1 = p + 1
        while p1 < n and cls[p1] == CONT:
            p1 += 1
        e = -1
        if a0 == 39 and p1 < n:  # 's 't 're 've 'm 'll 'd
            a1 = buf[p1]
            if a1 == 115 or a1 == 116 or a1 == 109 or a1 == 100:
                e = p1 + 1
            elif p1 + 1 < n:
                a2 = buf[p1 + 1]
                if (a2 == 101 and (a1 == 114 or a1 == 118)) or (a1 == 108 and a2 == 108):
                    e = p1 + 2
        if e < 0 and a0 == 32 and p1 < n and cls[p1] != SPACE:  # ' ?' + a run of the next char's class
            c1 = cls[p1]
            q = p1 + 1
            while q < n and (cls[q] == c1 or cls[q] == CONT):
                q += 1
            e = q
        if e < 0 and c0 != SPACE:  # a run of one class
            q = p1
            while q < n and (cls[q] == c0 or cls[q] == CONT):
                q += 1
            e = q
        if e < 0:  # \s+(?!\S) | \s+
            last = p
            q = p1
            while q < n and cls[q] == SPACE:
                last = q
                q += 1
                while q < n and cls[q] == CONT:
                    q += 1
            if q >= n:
                e = n
            elif last > p:
                e = last
            else:
                e = p1
        ends[k] = e
        k += 1
        p = e
    return k


@njit(cache=True)
def piece_ends(buf, table):
    """int64 [n_pieces]: the end offset of each pre-token of the UTF-8 bytes buf."""
    cls = np.empty(buf.shape[0], np.uint8)
    classify_into(buf, table, cls)
    ends = np.empty(buf.shape[0], np.int64)
    k = scan(buf, cls, ends)
    return ends[:k].copy()


# ------------------------------------------------------------------------------- piece counting

@njit(cache=True)
def count_pieces(buf, table, h_hash, h_off, h_len, h_cnt, pool, state):
    """Add every pre-token of buf to an open-addressing table of unique pieces with their counts.

    Tables: h_hash (0 = empty slot; FNV-1a of the bytes), h_off/h_len (the piece's bytes in pool), h_cnt
    (its count); state = [n_unique, pool_used, resume_piece]. Returns 0 when done, 1 when the table is
    half full or the pool is full (the caller grows them and calls again; it resumes at state[2]).
    """
    n = buf.shape[0]
    cls = np.empty(n, np.uint8)
    classify_into(buf, table, cls)
    ends = np.empty(n, np.int64)
    m = scan(buf, cls, ends)
    mask = np.uint64(h_hash.shape[0] - 1)
    imask = h_hash.shape[0] - 1
    t = state[2]
    while t < m:
        p = ends[t - 1] if t > 0 else 0
        e = ends[t]
        L = e - p
        if state[0] * 2 >= h_hash.shape[0] or state[1] + L > pool.shape[0]:
            state[2] = t
            return 1
        h = FNV_OFFSET
        for j in range(p, e):
            h = (h ^ np.uint64(buf[j])) * FNV_PRIME
        if h == EMPTY:
            h = np.uint64(1)
        i = np.int64(h & mask)
        while True:
            hh = h_hash[i]
            if hh == EMPTY:
                h_hash[i] = h
                o = state[1]
                h_off[i] = o
                h_len[i] = L
                h_cnt[i] = 1
                for j in range(L):
                    pool[o + j] = buf[p + j]
                state[1] += L
                state[0] += 1
                break
            if hh == h and h_len[i] == L:
                o = h_off[i]
                same = True
                for j in range(L):
                    if pool[o + j] != buf[p + j]:
                        same = False
                        break
                if same:
                    h_cnt[i] += 1
                    break
            i = (i + 1) & imask
        t += 1
    state[2] = m
    return 0


@njit(cache=True)
def rehash(h_hash, h_off, h_len, h_cnt, new_cap):
    """The same table in new_cap (a power of two) slots."""
    nh = np.zeros(new_cap, np.uint64)
    no = np.zeros(new_cap, np.int64)
    nl = np.zeros(new_cap, np.int64)
    nc = np.zeros(new_cap, np.int64)
    mask = np.uint64(new_cap - 1)
    for j in range(h_hash.shape[0]):
        h = h_hash[j]
        if h != EMPTY:
            i = np.int64(h & mask)
            while nh[i] != EMPTY:
                i = (i + 1) & (new_cap - 1)
            nh[i] = h
            no[i] = h_off[j]
            nl[i] = h_len[j]
            nc[i] = h_cnt[j]
    return nh, no, nl, nc


# ------------------------------------------------------------------------------------ training

@njit(inline="always")
def _better(c1, k1, c2, k2):
    return c1 > c2 or (c1 == c2 and k1 < k2)


@njit(inline="always")
def _grow(a, need):
    if need <= a.shape[0]:
        return a
    b = np.empty(max(need, 2 * a.shape[0]), a.dtype)
    b[:a.shape[0]] = a
    return b


@njit
def _heap_push(h_cnt, h_pid, size, cnt, pid, pkey):
    i = size
    h_cnt[i] = cnt
    h_pid[i] = pid
    while i > 0:
        parent = (i - 1) >> 1
        if _better(h_cnt[i], pkey[h_pid[i]], h_cnt[parent], pkey[h_pid[parent]]):
            h_cnt[i], h_cnt[parent] = h_cnt[parent], h_cnt[i]
            h_pid[i], h_pid[parent] = h_pid[parent], h_pid[i]
            i = parent
        else:
            break


@njit
def _heap_pop(h_cnt, h_pid, size, pkey):
    """Remove the top (size is the size before the pop); the caller read it from index 0."""
    last = size - 1
    h_cnt[0] = h_cnt[last]
    h_pid[0] = h_pid[last]
    i = 0
    while True:
        l = 2 * i + 1
        if l >= last:
            break
        best = l
        r = l + 1
        if r < last and _better(h_cnt[r], pkey[h_pid[r]], h_cnt[l], pkey[h_pid[l]]):
            best = r
        if _better(h_cnt[best], pkey[h_pid[best]], h_cnt[i], pkey[h_pid[i]]):
            h_cnt[i], h_cnt[best] = h_cnt[best], h_cnt[i]
            h_pid[i], h_pid[best] = h_pid[best], h_pid[i]
            i = best
        else:
            break


@njit
def _token_bytes(left, right, t, out):
    """Write the bytes of token t into out; return their number."""
    stack = np.empty(64, np.int64)
    stack[0] = t
    sp = 1
    k = 0
    while sp > 0:
        sp -= 1
        x = stack[sp]
        if x < 256:
            out[k] = x
            k += 1
        else:
            if sp + 2 > stack.shape[0]:
                stack = _grow(stack, sp + 2)
            stack[sp] = right[x]
            stack[sp + 1] = left[x]
            sp += 2
    return k


@njit(inline="always")
def _append(a, n, value):
    """a[n] = value, growing a first if it is full -> a (maybe a new array)."""
    a = _grow(a, n + 1)
    a[n] = value
    return a


@njit(inline="always")
def _add_pair(pair_index, pcount, pkey, phead, n_pairs, e_pos, e_next, n_entries, key, p, w):
    """Count w more of pair `key` (its id created if new) and file position p under it.

    Returns (pid, pcount, pkey, phead, n_pairs, e_pos, e_next, n_entries): the arrays may have grown.
    """
    if key in pair_index:
        pid = pair_index[key]
    else:
        pid = n_pairs
        pair_index[key] = pid
        n_pairs += 1
        if n_pairs > pcount.shape[0]:
            old = pcount.shape[0]
            pcount = _grow(pcount, n_pairs)
            pkey = _grow(pkey, n_pairs)
            phead = _grow(phead, n_pairs)
            pcount[old:] = 0
            phead[old:] = -1
        pkey[pid] = key
    pcount[pid] += w
    e_pos = _append(e_pos, n_entries, p)
    e_next = _append(e_next, n_entries, phead[pid])
    phead[pid] = n_entries
    return pid, pcount, pkey, phead, n_pairs, e_pos, e_next, n_entries + 1


@njit(cache=True)
def train_init(pool, w_off, w_len, w_cnt):
    """Lay the unique words out as linked symbol lists and count every adjacent pair once.

    Returns (sym, nxt, prv, wcount, pair_index, pcount, pkey, phead, e_pos, e_next, n_pairs, n_entries).
    Every position p that starts a pair is filed under that pair (an entry e: e_pos[e] = p, chained
    through e_next from phead[pair]) so that a merge visits only the words that contain its pair.
    Example: words {b"aab": 2} -> pairs (a, a): 2 at p=0, (a, b): 2 at p=1.
    """
    n_words = w_off.shape[0]
    total = 0
    for w in range(n_words):
        if w_len[w] >= 2:
            total += w_len[w]
    sym = np.empty(total, np.int32)
    nxt = np.empty(total, np.int32)
    prv = np.empty(total, np.int32)
    wcount = np.empty(total, np.int64)
    k = 0
    for w in range(n_words):
        L = w_len[w]
        if L < 2:
            continue
        for j in range(L):
            sym[k + j] = pool[w_off[w] + j]
            nxt[k + j] = k + j + 1 if j + 1 < L else -1
            prv[k + j] = k + j - 1 if j > 0 else -1
            wcount[k + j] = w_cnt[w]
        k += L
    pair_index = Dict.empty(key_type=types.int64, value_type=types.int64)
    pcount = np.zeros(1024, np.int64)
    pkey = np.zeros(1024, np.int64)
    phead = np.full(1024, -1, np.int32)
    e_pos = np.empty(max(total, 16), np.int32)
    e_next = np.empty(max(total, 16), np.int32)
    n_pairs = 0
    n_entries = 0
    for p in range(total):
        q = nxt[p]
        if q >= 0:
            key = (np.int64(sym[p]) << 32) | np.int64(sym[q])
            _, pcount, pkey, phead, n_pairs, e_pos, e_next, n_entries = _add_pair(
                pair_index, pcount, pkey, phead, n_pairs, e_pos, e_next, n_entries, key, p, wcount[p])
    return sym, nxt, prv, wcount, pair_index, pcount, pkey, phead, e_pos, e_next, n_pairs, n_entries


@njit(inline="always")
def _pop_best(h_cnt, h_pid, h_size, pcount, pkey, banned):
    """Pop the lazy heap until its top is a pair with an up-to-date positive count that is not banned.

    Returns (pid or -1 if the heap ran out, h_size). A stale entry whose pair still counts is pushed back
    with its current count.
    """
    while h_size > 0:
        cnt = h_cnt[0]
        pid = h_pid[0]
        _heap_pop(h_cnt, h_pid, h_size, pkey)
        h_size -= 1
        if banned.shape[0] > pid and banned[pid]:
            continue
        if cnt != pcount[pid]:
            if pcount[pid] > 0:
                _heap_push(h_cnt, h_pid, h_size, pcount[pid], pid, pkey)
                h_size += 1
            continue
        if cnt > 0:
            return pid, h_size
    return -1, h_size


@njit(inline="always")
def _same_bytes(left, right, a, b, other, length, buf_a, buf_b):
    """Whether token a's bytes followed by b's equal token other's (all `length` bytes long)."""
    k = _token_bytes(left, right, a, buf_a)
    _token_bytes(left, right, b, buf_a[k:])
    _token_bytes(left, right, other, buf_b)
    for i in range(length):
        if buf_a[i] != buf_b[i]:
            return False
    return True


@njit(inline="always")
def _positions(phead, e_pos, e_next, pid, scratch):
    """The positions filed under pair pid, sorted (left to right) -> (positions, scratch)."""
    m = 0
    e = phead[pid]
    while e >= 0:
        scratch = _append(scratch, m, e_pos[e])
        m += 1
        e = e_next[e]
    return np.sort(scratch[:m]), scratch


@njit(cache=True)
def train_merges(sym, nxt, prv, wcount, pair_index, pcount, pkey, phead, e_pos, e_next, n_pairs, n_entries,
                 h_cnt, h_pid, h_size, left, right, tok_hash, tok_pow, tok_len, tok_index, banned,
                 n_done, n_stop):
    """Learn merges n_done .. n_stop-1 (fewer if no pair is left); return the updated state.

    Each step takes the most frequent pair (ties: the smallest (left id, right id)), merges it in the
    words that contain it, left to right, and updates the counts of the neighbouring pairs only:

        merging (a, b) -> c inside x a b y (count w):  (x, a) -= w, (b, y) -= w, (x, c) += w, (c, y) += w

    The heap is lazy: counts that drop are corrected when popped, counts that grow are pushed again.
    A pair whose bytes equal an existing token's is banned (never a merge): token bytes stay unique.
    """
    touched = np.empty(64, np.int64)
    scratch = np.empty(64, np.int64)
    buf_a = np.empty(16, np.int64)
    buf_b = np.empty(16, np.int64)
    while n_done < n_stop:
        pid, h_size = _pop_best(h_cnt, h_pid, h_size, pcount, pkey, banned)
        if pid < 0:
            break
        key = pkey[pid]
        a = key >> 32
        b = key & 0xFFFFFFFF
        c = 256 + n_done
        th = tok_hash[a] * tok_pow[b] + tok_hash[b]
        tl = tok_len[a] + tok_len[b]
        other = tok_index[np.int64(th)] if np.int64(th) in tok_index else -1
        if other >= 0 and tok_len[other] == tl:
            buf_a = _grow(buf_a, tl)
            buf_b = _grow(buf_b, tl)
            if _same_bytes(left, right, a, b, other, tl, buf_a, buf_b):
                old = banned.shape[0]
                banned = _grow(banned, pid + 1)
                banned[old:] = False
                banned[pid] = True
                continue
        left[c] = a
        right[c] = b
        tok_hash[c] = th
        tok_pow[c] = tok_pow[a] * tok_pow[b]
        tok_len[c] = tl
        tok_index[np.int64(th)] = c
        positions, scratch = _positions(phead, e_pos, e_next, pid, scratch)
        n_touched = 0
        for p in positions:
            r = nxt[p]
            if sym[p] != a or r < 0 or sym[r] != b:
                continue  # an earlier merge in this word took one of the two symbols
            w = wcount[p]
            q = prv[p]
            s = nxt[r]
            if q >= 0:  # x a b -> x c
                x = np.int64(sym[q])
                pcount[pair_index[(x << 32) | a]] -= w
                pid2, pcount, pkey, phead, n_pairs, e_pos, e_next, n_entries = _add_pair(
                    pair_index, pcount, pkey, phead, n_pairs, e_pos, e_next, n_entries, (x << 32) | c, q, w)
                touched = _append(touched, n_touched, pid2)
                n_touched += 1
            if s >= 0:  # a b y -> c y
                y = np.int64(sym[s])
                pcount[pair_index[(b << 32) | y]] -= w
                pid2, pcount, pkey, phead, n_pairs, e_pos, e_next, n_entries = _add_pair(
                    pair_index, pcount, pkey, phead, n_pairs, e_pos, e_next, n_entries, (np.int64(c) << 32) | y,
                    p, w)
                touched = _append(touched, n_touched, pid2)
                n_touched += 1
            sym[p] = c
            nxt[p] = s
            if s >= 0:
                prv[s] = p
            sym[r] = -1
        pcount[pid] = 0
        phead[pid] = -1
        for t in range(n_touched):  # push the pairs that grew (one touched twice goes in twice: the stale copy is dropped on pop)
            pid2 = touched[t]
            if pcount[pid2] > 0:
                h_cnt = _grow(h_cnt, h_size + 1)
                h_pid = _grow(h_pid, h_size + 1)
                _heap_push(h_cnt, h_pid, h_size, pcount[pid2], pid2, pkey)
                h_size += 1
        n_done += 1
    return (sym, nxt, prv, wcount, pair_index, pcount, pkey, phead, e_pos, e_next, n_pairs, n_entries,
            h_cnt, h_pid, h_size, left, right, tok_hash, tok_pow, tok_len, tok_index, banned, n_done)


@njit(cache=True)
def heap_build(pcount, pkey, n_pairs):
    """A heap holding every pair with a positive count."""
    h_cnt = np.empty(max(n_pairs, 16), np.int64)
    h_pid = np.empty(max(n_pairs, 16), np.int64)
    size = 0
    for pid in range(n_pairs):
        if pcount[pid] > 0:
            _heap_push(h_cnt, h_pid, size, pcount[pid], pid, pkey)
            size += 1
    return h_cnt, h_pid, size


@njit(cache=True)
def token_tables(n_tokens):
    """Byte tokens 0..255 as leaves: (left, right, hash, pow, len, index by hash)."""
    left = np.full(n_tokens, -1, np.int64)
    right = np.full(n_tokens, -1, np.int64)
    tok_hash = np.zeros(n_tokens, np.uint64)
    tok_pow = np.ones(n_tokens, np.uint64)
    tok_len = np.zeros(n_tokens, np.int64)
    tok_index = Dict.empty(key_type=types.int64, value_type=types.int64)
    B = np.uint64(0x100000001B3)
    for i in range(256):
        tok_hash[i] = np.uint64(i + 1)
        tok_pow[i] = B
        tok_len[i] = 1
        tok_index[np.int64(tok_hash[i])] = i
    return left, right, tok_hash, tok_pow, tok_len, tok_index


# ------------------------------------------------------------------------------------ encoding

@njit(cache=True)
def pair_table(merges, results):
    """Open-addressing map (left << 32 | right) -> (rank << 32 | the id it makes), for merges[rank] = (left,
    right) making results[rank]. A pair listed twice keeps its first rank (as llama.cpp)."""
    n = merges.shape[0]
    cap = 16
    while cap < 4 * max(n, 1):
        cap *= 2
    keys = np.full(cap, -1, np.int64)
    vals = np.zeros(cap, np.int64)
    mask = np.uint64(cap - 1)
    for i in range(n):
        key = (np.int64(merges[i, 0]) << 32) | np.int64(merges[i, 1])
        j = np.int64((np.uint64(key) * MIX) >> np.uint64(20) & mask)
        while keys[j] != -1 and keys[j] != key:
            j = (j + 1) & (cap - 1)
        if keys[j] == -1:
            keys[j] = key
            vals[j] = (np.int64(i) << 32) | np.int64(results[i])
    return keys, vals


@njit(inline="always")
def _lookup(keys, vals, a, b):
    """(rank << 32 | made id) of the pair (a, b), or -1 when no merge joins them."""
    key = (np.int64(a) << 32) | np.int64(b)
    imask = keys.shape[0] - 1
    j = np.int64((np.uint64(key) * MIX) >> np.uint64(20) & np.uint64(imask))
    while keys[j] != -1:
        if keys[j] == key:
            return vals[j]
        j = (j + 1) & imask
    return np.int64(-1)


@njit(inline="always")
def _push(heap, size, key):
    """Add key (rank << 32 | left position) to the min-heap heap[:size]; return the new size."""
    i = size
    while i > 0 and key < heap[(i - 1) >> 1]:
        heap[i] = heap[(i - 1) >> 1]
        i = (i - 1) >> 1
    heap[i] = key
    return size + 1


@njit(inline="always")
def _pop(heap, size):
    """Remove the smallest key (the caller read heap[0]); return the new size."""
    last = size - 1
    key = heap[last]
    i = 0
    while True:
        child = 2 * i + 1
        if child >= last:
            break
        if child + 1 < last and heap[child + 1] < heap[child]:
            child += 1
        if key <= heap[child]:
            break
        heap[i] = heap[child]
        i = child
    heap[i] = key
    return last


@njit(inline="always")
def _candidate(keys, vals, work, heap, size, left, right):
    """Queue the merge of the symbols at positions left and right, if one joins them; return the heap size."""
    if left < 0 or right < 0:
        return size
    v = _lookup(keys, vals, work[left], work[right])
    if v < 0:
        return size
    return _push(heap, size, ((v >> 32) << 32) | left)


@njit(cache=True)
def bpe_piece(buf, s, e, keys, vals, work, nxt, prv, heap):
    """BPE of the bytes buf[s:e] into work[:k]; return k. Scratch: nxt, prv (int32) and heap (int64), each at
    least 3 (e - s) + 1 long.

    The adjacent pair of lowest rank merges, the leftmost of equal ranks, one at a time (as `tokenizer.bpe`
    does, and Hugging Face and llama.cpp): a heap of candidates (rank << 32 | left position); a popped one
    whose pair is no longer there (a side merged since) is skipped: a rank names one pair, so the pair at
    its position still has that rank only if it is still the same pair. Each merge queues the pairs the new
    symbol makes with its neighbours.
    """
    n = e - s
    for i in range(n):
        work[i] = buf[s + i]
        nxt[i] = i + 1 if i + 1 < n else -1
        prv[i] = i - 1
    size = 0
    for i in range(n - 1):
        size = _candidate(keys, vals, work, heap, size, i, i + 1)
    while size > 0:
        top = heap[0]
        size = _pop(heap, size)
        left = top & 0xFFFFFFFF
        right = nxt[left]
        if work[left] < 0 or right < 0:
            continue                                     # merged into its left neighbour, or last
        v = _lookup(keys, vals, work[left], work[right])
        if v < 0 or (v >> 32) != (top >> 32):
            continue                                     # stale: a side has merged since it was queued
        work[left] = v & 0xFFFFFFFF
        work[right] = -1
        nxt[left] = nxt[right]
        if nxt[right] >= 0:
            prv[nxt[right]] = left
        size = _candidate(keys, vals, work, heap, size, prv[left], left)
        size = _candidate(keys, vals, work, heap, size, left, nxt[left])
    k = 0
    i = 0 if n else -1
    while i >= 0:                                        # the symbols left, in order, to the front
        work[k] = work[i]
        k += 1
        i = nxt[i]
    return k


@njit(cache=True)
def bpe_bytes(buf, keys, vals):
    """BPE of all of buf (one pre-token) -> int32 ids."""
    n = buf.shape[0]
    work = np.empty(n, np.int32)
    nxt = np.empty(n, np.int32)
    prv = np.empty(n, np.int32)
    heap = np.empty(3 * n + 1, np.int64)
    k = bpe_piece(buf, np.int64(0), n, keys, vals, work, nxt, prv, heap)   # (a literal 0 compiles another bpe_piece)
    return work[:k].copy()


@njit(cache=True)
def encode_buf(buf, table, keys, vals, c_tab, k_pool, v_pool, c_state, cls, ends, out, max_cached):
    """Encode the UTF-8 bytes buf into out; return the id count. cls, ends, out: scratch arrays at least
    len(buf) long (kept by the caller between calls, so that nothing big is allocated per call).

    Pieces of 2..max_cached bytes go through a cache (piece bytes -> ids), one int64 row per slot so that
    a hit usually reads one cache line:  c_tab[slot] = (hash (0 = empty), key, length | count << 8, ids)
    where key is the bytes themselves packed little-endian if length <= 8 (else their offset in k_pool)
    and ids are the ids themselves if count <= 2 (else their offset in v_pool).
    c_state = [n_items, k_pool_used, v_pool_used]. When the cache is full it is emptied in place.
    """
    n = buf.shape[0]
    classify_into(buf, table, cls)
    m = scan(buf, cls, ends)
    longest = 1
    p = 0
    for t in range(m):
        if ends[t] - p > longest:
            longest = ends[t] - p
        p = ends[t]
    work = np.empty(longest, np.int32)
    nxt = np.empty(longest, np.int32)
    prv = np.empty(longest, np.int32)
    heap = np.empty(3 * longest + 1, np.int64)
    cap = c_tab.shape[0]
    k = 0
    p = 0
    for t in range(m):
        e = ends[t]
        L = e - p
        if L == 1:
            out[k] = buf[p]
            k += 1
            p = e
            continue
        if L > max_cached:
            cnt = bpe_piece(buf, p, e, keys, vals, work, nxt, prv, heap)
            out[k:k + cnt] = work[:cnt]
            k += cnt
            p = e
            continue
        key = np.int64(0)
        if L <= 8:
            for j in range(L):
                key |= np.int64(buf[p + j]) << (8 * j)
            h = (np.uint64(key) + np.uint64(L)) * MIX
        else:
            h = FNV_OFFSET
            for j in range(p, e):
                h = (h ^ np.uint64(buf[j])) * FNV_PRIME
            h = h * MIX
        hv = np.int64(h >> np.uint64(1)) | 1  # nonzero
        i = np.int64(h >> np.uint64(40)) & (cap - 1)
        while True:
            hh = c_tab[i, 0]
            if hh == hv and (c_tab[i, 2] & 0xFF) == L:
                if L <= 8:
                    same = c_tab[i, 1] == key
                else:
                    o = c_tab[i, 1]
                    same = True
                    for j in range(L):
                        if k_pool[o + j] != buf[p + j]:
                            same = False
                            break
                if same:
                    c = c_tab[i, 2] >> 8
                    v = c_tab[i, 3]
                    if c <= 2:
                        out[k] = v & 0xFFFFFFFF
                        if c == 2:
                            out[k + 1] = v >> 32
                    else:
                        for j in range(c):
                            out[k + j] = v_pool[v + j]
                    k += c
                    break
            if hh == 0:
                cnt = bpe_piece(buf, p, e, keys, vals, work, nxt, prv, heap)
                out[k:k + cnt] = work[:cnt]
                k += cnt
                if (c_state[0] + 1) * 2 > cap or c_state[1] + L > k_pool.shape[0] \
                        or c_state[2] + cnt > v_pool.shape[0]:
                    c_tab[:, 0] = 0  # full: start afresh
                    c_state[:] = 0
                    break
                c_tab[i, 0] = hv
                if L <= 8:
                    c_tab[i, 1] = key
                else:
                    c_tab[i, 1] = c_state[1]
                    k_pool[c_state[1]:c_state[1] + L] = buf[p:e]
                    c_state[1] += L
                c_tab[i, 2] = L | (cnt << 8)
                if cnt <= 2:
                    c_tab[i, 3] = np.int64(work[0]) | ((np.int64(work[1]) << 32) if cnt == 2 else 0)
                else:
                    c_tab[i, 3] = c_state[2]
                    v_pool[c_state[2]:c_state[2] + cnt] = work[:cnt]
                    c_state[2] += cnt
                c_state[0] += 1
                break
            i = (i + 1) & (cap - 1)
        p = e
    return k
