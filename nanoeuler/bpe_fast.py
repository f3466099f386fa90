"""Compiled (numba) kernels behind `nanoeuler.tokenizer`: GPT-2 pre-tokenization, piece counting,
incremental BPE training and cached encoding, all working on UTF-8 bytes without a Python loop per byte.

`tokenizer.py` holds the readable reference algorithms (regex pre-tokenization, `get_stats`, `merge`);
the kernels here compute exactly the same thing and the tests compare the two on random text.

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

OTHER, LETTER, NUMBER, SPACE = 0, 1, 2, 3
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

@njit(inline="always")
def _char(buf, p, n, table):
    """Decode the code point at byte p -> (class, ascii value or 0, next byte offset).
    Anything that is not strict UTF-8 (overlong, surrogate, truncated) is one OTHER byte."""
    b = np.int64(buf[p])
    if b < 0x80:
        return table[b], b, p + 1
    if 0xC2 <= b <= 0xDF:
        if p + 1 < n and 0x80 <= buf[p + 1] <= 0xBF:
            cp = ((b & 0x1F) << 6) | (np.int64(buf[p + 1]) & 0x3F)
            return table[cp], 0, p + 2
        return OTHER, 0, p + 1
    if 0xE0 <= b <= 0xEF:
        if p + 2 < n:
            b1 = np.int64(buf[p + 1])
            b2 = np.int64(buf[p + 2])
            lo = 0xA0 if b == 0xE0 else 0x80
            hi = 0x9F if b == 0xED else 0xBF
            if lo <= b1 <= hi and 0x80 <= b2 <= 0xBF:
                cp = ((b & 0x0F) << 12) | ((b1 & 0x3F) << 6) | (b2 & 0x3F)
                return table[cp], 0, p + 3
        return OTHER, 0, p + 1
    if 0xF0 <= b <= 0xF4:
        if p + 3 < n:
            b1 = np.int64(buf[p + 1])
            b2 = np.int64(buf[p + 2])
            b3 = np.int64(buf[p + 3])
            lo = 0x90 if b == 0xF0 else 0x80
            hi = 0x8F if b == 0xF4 else 0xBF
            if lo <= b1 <= hi and 0x80 <= b2 <= 0xBF and 0x80 <= b3 <= 0xBF:
                cp = ((b & 0x07) << 18) | ((b1 & 0x3F) << 12) | ((b2 & 0x3F) << 6) | (b3 & 0x3F)
                return table[cp], 0, p + 4
        return OTHER, 0, p + 1
    return OTHER, 0, p + 1


@njit(inline="always")
def _run_end(buf, p, n, table, cls):
    """First byte offset >= p whose code point is not of class cls."""
    while p < n:
        c, a, q = _char(buf, p, n, table)
        if c != cls:
            return p
        p = q
    return n


@njit(inline="always")
def _piece_end(buf, p, n, table):
    """End (exclusive byte offset) of the GPT-2 pre-token that starts at byte p."""
    c0, a0, p1 = _char(buf, p, n, table)
    if a0 == 39 and p1 < n:  # 's 't 're 've 'm 'll 'd
        c1, a1, p2 = _char(buf, p1, n, table)
        if a1 == 115 or a1 == 116 or a1 == 109 or a1 == 100:
            return p2
        if p2 < n:
            c2, a2, p3 = _char(buf, p2, n, table)
            if (a2 == 101 and (a1 == 114 or a1 == 118)) or (a1 == 108 and a2 == 108):
                return p3
    if a0 == 32 and p1 < n:  # ' ?' before a letter, number or other run
        c1, a1, p2 = _char(buf, p1, n, table)
        if c1 != SPACE:
            return _run_end(buf, p2, n, table, c1)
    if c0 != SPACE:
        return _run_end(buf, p1, n, table, c0)
    # \s+(?!\S) | \s+ : a whitespace run, less its last character when a non-space follows
    last = p
    q = p1
    while q < n:
        c, a, q2 = _char(buf, q, n, table)
        if c != SPACE:
            if last > p:
                return last
            return p1
        last = q
        q = q2
    return n


@njit(cache=True)
def piece_ends(buf, table):
    """int64 [n_pieces]: the end offset of each pre-token of the UTF-8 bytes `buf`."""
    n = buf.shape[0]
    out = np.empty(n, np.int64)
    k = 0
    p = 0
    while p < n:
        p = _piece_end(buf, p, n, table)
        out[k] = p
        k += 1
    return out[:k].copy()


# ----------------------------------------------------------------------------- hashing helpers

@njit(inline="always")
def _hash_bytes(buf, s, e):
    h = FNV_OFFSET
    for i in range(s, e):
        h = (h ^ np.uint64(buf[i])) * FNV_PRIME
    if h == EMPTY:
        h = np.uint64(1)
    return h


@njit(inline="always")
def _same(pool, off, buf, s, e):
    for i in range(e - s):
        if pool[off + i] != buf[s + i]:
            return False
    return True


@njit(inline="always")
def _mix(key):
    return (np.uint64(key) * np.uint64(0x9E3779B97F4A7C15)) ^ (np.uint64(key) >> np.uint64(29))


# ------------------------------------------------------------------------------- piece counting

@njit(cache=True)
def count_pieces(buf, table, h_hash, h_off, h_len, h_cnt, pool, state):
    """Add every pre-token of `buf` to an open-addressing table of unique pieces with their counts.

    Tables: h_hash (0 = empty slot), h_off/h_len (the piece's bytes in `pool`), h_cnt (its count);
    state = [n_unique, pool_used, resume_offset]. Returns 0 when done, 1 when the table or pool is full
    (the caller grows them and calls again; state[2] says where to resume).
    """
    n = buf.shape[0]
    mask = h_hash.shape[0] - 1
    p = state[2]
    while p < n:
        if state[0] * 2 >= h_hash.shape[0]:
            state[2] = p
            return 1
        e = _piece_end(buf, p, n, table)
        if state[1] + (e - p) > pool.shape[0]:
            state[2] = p
            return 1
        h = _hash_bytes(buf, p, e)
        i = np.int64(h & np.uint64(mask))
        while True:
            hh = h_hash[i]
            if hh == EMPTY:
                h_hash[i] = h
                h_off[i] = state[1]
                h_len[i] = e - p
                h_cnt[i] = 1
                pool[state[1]:state[1] + e - p] = buf[p:e]
                state[1] += e - p
                state[0] += 1
                break
            if hh == h and h_len[i] == e - p and _same(pool, h_off[i], buf, p, e):
                h_cnt[i] += 1
                break
            i = (i + 1) & mask
        p = e
    state[2] = n
    return 0


@njit(cache=True)
def rehash(h_hash, h_off, h_len, h_cnt, new_cap):
    """The same table in `new_cap` (a power of two) slots."""
    nh = np.zeros(new_cap, np.uint64)
    no = np.zeros(new_cap, np.int64)
    nl = np.zeros(new_cap, np.int64)
    nc = np.zeros(new_cap, np.int64)
    mask = new_cap - 1
    for j in range(h_hash.shape[0]):
        h = h_hash[j]
        if h != EMPTY:
            i = np.int64(h & np.uint64(mask))
            while nh[i] != EMPTY:
                i = (i + 1) & mask
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
    sp = 0
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
    cap = 1024
    pcount = np.zeros(cap, np.int64)
    pkey = np.zeros(cap, np.int64)
    phead = np.full(cap, -1, np.int64)
    e_pos = np.empty(max(total, 16), np.int64)
    e_next = np.empty(max(total, 16), np.int64)
    n_pairs = 0
    n_entries = 0
    for p in range(total):
        q = nxt[p]
        if q < 0:
            continue
        key = (np.int64(sym[p]) << 32) | np.int64(sym[q])
        pid = pair_index[key] if key in pair_index else -1
        if pid < 0:
            pid = n_pairs
            pair_index[key] = pid
            n_pairs += 1
            if n_pairs > pcount.shape[0]:
                pcount = _grow(pcount, n_pairs)
                pkey = _grow(pkey, n_pairs)
                old = phead.shape[0]
                phead = _grow(phead, n_pairs)
                phead[old:] = -1
                pcount[old:] = 0
            pkey[pid] = key
        pcount[pid] += wcount[p]
        e_pos[n_entries] = p
        e_next[n_entries] = phead[pid]
        phead[pid] = n_entries
        n_entries += 1
    return sym, nxt, prv, wcount, pair_index, pcount, pkey, phead, e_pos, e_next, n_pairs, n_entries


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
    B = np.uint64(0x100000001B3)
    touched = np.empty(64, np.int64)
    scratch = np.empty(64, np.int64)
    buf_a = np.empty(16, np.int64)
    buf_b = np.empty(16, np.int64)
    while n_done < n_stop and h_size > 0:
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
        if cnt <= 0:
            continue
        key = pkey[pid]
        a = key >> 32
        b = key & 0xFFFFFFFF
        c = 256 + n_done
        th = tok_hash[a] * tok_pow[b] + tok_hash[b]
        tl = tok_len[a] + tok_len[b]
        hk = np.int64(th)
        other = tok_index[hk] if hk in tok_index else -1
        if other >= 0 and tok_len[other] == tl:
            buf_a = _grow(buf_a, tl)
            buf_b = _grow(buf_b, tl)
            k1 = _token_bytes(left, right, a, buf_a)
            _token_bytes(left, right, b, buf_a[k1:])
            _token_bytes(left, right, other, buf_b)
            same = True
            for i in range(tl):
                if buf_a[i] != buf_b[i]:
                    same = False
                    break
            if same:
                if banned.shape[0] <= pid:
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
        # the positions of this pair, left to right
        m = 0
        e = phead[pid]
        while e >= 0:
            scratch = _grow(scratch, m + 1)
            scratch[m] = e_pos[e]
            m += 1
            e = e_next[e]
        positions = np.sort(scratch[:m])
        n_touched = 0
        for t in range(m):
            p = positions[t]
            if sym[p] != a:
                continue
            r = nxt[p]
            if r < 0 or sym[r] != b:
                continue
            w = wcount[p]
            q = prv[p]
            s = nxt[r]
            if q >= 0:
                x = np.int64(sym[q])
                pcount[pair_index[(x << 32) | a]] -= w
                k2 = (x << 32) | c
                pid2 = pair_index[k2] if k2 in pair_index else -1
                if pid2 < 0:
                    pid2 = n_pairs
                    pair_index[k2] = pid2
                    n_pairs += 1
                    if n_pairs > pcount.shape[0]:
                        pcount = _grow(pcount, n_pairs)
                        pkey = _grow(pkey, n_pairs)
                        old = phead.shape[0]
                        phead = _grow(phead, n_pairs)
                        phead[old:] = -1
                        pcount[old:] = 0
                    pkey[pid2] = k2
                pcount[pid2] += w
                e_pos = _grow(e_pos, n_entries + 1)
                e_next = _grow(e_next, n_entries + 1)
                e_pos[n_entries] = q
                e_next[n_entries] = phead[pid2]
                phead[pid2] = n_entries
                n_entries += 1
                touched = _grow(touched, n_touched + 1)
                touched[n_touched] = pid2
                n_touched += 1
            if s >= 0:
                y = np.int64(sym[s])
                pcount[pair_index[(b << 32) | y]] -= w
                k2 = (np.int64(c) << 32) | y
                pid2 = pair_index[k2] if k2 in pair_index else -1
                if pid2 < 0:
                    pid2 = n_pairs
                    pair_index[k2] = pid2
                    n_pairs += 1
                    if n_pairs > pcount.shape[0]:
                        pcount = _grow(pcount, n_pairs)
                        pkey = _grow(pkey, n_pairs)
                        old = phead.shape[0]
                        phead = _grow(phead, n_pairs)
                        phead[old:] = -1
                        pcount[old:] = 0
                    pkey[pid2] = k2
                pcount[pid2] += w
                e_pos = _grow(e_pos, n_entries + 1)
                e_next = _grow(e_next, n_entries + 1)
                e_pos[n_entries] = p
                e_next[n_entries] = phead[pid2]
                phead[pid2] = n_entries
                n_entries += 1
                touched = _grow(touched, n_touched + 1)
                touched[n_touched] = pid2
                n_touched += 1
            sym[p] = c
            nxt[p] = s
            if s >= 0:
                prv[s] = p
            sym[r] = -1
        pcount[pid] = 0
        phead[pid] = -1
        # push the pairs that grew, once each
        for t in range(n_touched):
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
def pair_table(merges):
    """Open-addressing map (left << 32 | right) -> merged id for merges[i] = (left, right) -> 256 + i."""
    n = merges.shape[0]
    cap = 16
    while cap < 4 * max(n, 1):
        cap *= 2
    keys = np.full(cap, -1, np.int64)
    vals = np.zeros(cap, np.int32)
    mask = cap - 1
    for i in range(n):
        key = (np.int64(merges[i, 0]) << 32) | np.int64(merges[i, 1])
        j = np.int64(_mix(key) & np.uint64(mask))
        while keys[j] != -1 and keys[j] != key:
            j = (j + 1) & mask
        keys[j] = key
        vals[j] = 256 + i
    return keys, vals


@njit(inline="always")
def _rank(keys, vals, a, b):
    key = (np.int64(a) << 32) | np.int64(b)
    mask = keys.shape[0] - 1
    j = np.int64(_mix(key) & np.uint64(mask))
    while True:
        k = keys[j]
        if k == key:
            return vals[j]
        if k == -1:
            return 2147483647
        j = (j + 1) & mask


@njit
def _bpe(buf, s, e, keys, vals, work):
    """BPE of the bytes buf[s:e] into work[:k]; return k. Repeatedly finds the lowest-ranked pair
    and merges all its occurrences, left to right (the same as `tokenizer.merge`)."""
    k = e - s
    for i in range(k):
        work[i] = buf[s + i]
    while k >= 2:
        best = 2147483647
        for i in range(k - 1):
            r = _rank(keys, vals, work[i], work[i + 1])
            if r < best:
                best = r
        if best == 2147483647:
            break
        j = 0
        i = 0
        while i < k:
            if i + 1 < k and _rank(keys, vals, work[i], work[i + 1]) == best:
                work[j] = best
                i += 2
            else:
                work[j] = work[i]
                i += 1
            j += 1
        k = j
    return k


@njit(cache=True)
def encode_buf(buf, table, keys, vals, c_hash, c_koff, c_klen, c_voff, c_vlen, k_pool, v_pool, c_state,
               out, max_cached):
    """Encode the UTF-8 bytes buf into out (int32, at least len(buf) long); return the id count.

    Pieces of up to max_cached bytes go through a cache (piece bytes -> ids) in the c_* tables;
    c_state = [n_items, k_pool_used, v_pool_used]. When the cache is full it is emptied in place.
    """
    n = buf.shape[0]
    mask = c_hash.shape[0] - 1
    work = np.empty(max(n, 1), np.int32)
    k = 0
    p = 0
    while p < n:
        e = _piece_end(buf, p, n, table)
        L = e - p
        if L == 1:
            out[k] = buf[p]
            k += 1
            p = e
            continue
        if L > max_cached:
            m = _bpe(buf, p, e, keys, vals, work)
            out[k:k + m] = work[:m]
            k += m
            p = e
            continue
        h = _hash_bytes(buf, p, e)
        i = np.int64(h & np.uint64(mask))
        while True:
            hh = c_hash[i]
            if hh == h and c_klen[i] == L and _same(k_pool, c_koff[i], buf, p, e):
                off = c_voff[i]
                for j in range(c_vlen[i]):
                    out[k + j] = v_pool[off + j]
                k += c_vlen[i]
                break
            if hh == EMPTY:
                m = _bpe(buf, p, e, keys, vals, work)
                out[k:k + m] = work[:m]
                k += m
                if (c_state[0] + 1) * 2 > c_hash.shape[0] or c_state[1] + L > k_pool.shape[0] \
                        or c_state[2] + m > v_pool.shape[0]:
                    c_hash[:] = EMPTY  # full: start afresh
                    c_state[:] = 0
                    break
                c_hash[i] = h
                c_koff[i] = c_state[1]
                c_klen[i] = L
                c_voff[i] = c_state[2]
                c_vlen[i] = m
                k_pool[c_state[1]:c_state[1] + L] = buf[p:e]
                v_pool[c_state[2]:c_state[2] + m] = work[:m]
                c_state[0] += 1
                c_state[1] += L
                c_state[2] += m
                break
            i = (i + 1) & mask
        p = e
    return k
