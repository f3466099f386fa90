"""The prefix cache: keys and values of token prefixes that earlier requests computed, kept for later ones.

A request whose tokens begin as an earlier one's did (a chat's next turn resends the conversation; clients
share a system prompt; the n choices of one request share their prompt) copies those positions' cache
into its row instead of computing them again. The cache holds blocks of BLOCK positions: a block's keys
and values belong to its tokens *and every token before them* (attention reads the whole prefix), so a
block is found by its place in a tree, the prefix's earlier blocks its ancestors:

    (0, (1 2 3 4))  ->  block 7 (positions 0..3)    (BLOCK 4 here; 0: the root)
    (7, (5 6 7 8))  ->  block 9 (positions 4..7)    a prompt 1 2 3 4 5 6 7 8 9 copies blocks 7, 9, computes 9
    (7, (5 6 0 0))  ->  block 12                    a prompt 1 2 3 4 5 6 0 0 5 copies blocks 7, 12, computes 5
                                                    a prompt 1 2 3 4 5 6 7 0 copies block 7, computes 5 6 7 0

A key is (parent block's id, the block's tokens) as a tuple: dictionary lookups compare the tokens
themselves, so two prefixes never share a block by a hash collision, and a hit is exact: the positions
copied hold the bits the request would have computed (the fused step computes a position the same way
in a prompt or in decoding, alone or beside other rows; engine.py). Only whole blocks are kept: a request
recomputes at most BLOCK - 1 positions of a prefix it shares, and always its last token (its logits).

Memory: at most budget bytes of blocks; past it the least recently used go. A lookup or an insertion
touches its path leaf first, root last, so a block is always more recent than its descendants, and the
least recent block is a leaf: eviction never strands a block whose prefix is gone.
"""
from __future__ import annotations

import itertools
from collections import OrderedDict

import numpy as np

BLOCK = 16  # positions a block holds


class PrefixCache:
    """Blocks of cached keys and values [2, layers, Hkv, BLOCK, hd], found by token prefix.

        pc = PrefixCache(budget=1 << 30, block_bytes=...)
        n, blocks = pc.match(tokens)       # the longest cached prefix: n positions (a multiple of BLOCK)
        pc.insert(tokens, n, read)         # read(a, b) -> the row's [2, layers, Hkv, b - a, hd] at a .. b-1
    """

    def __init__(self, budget: int, block_bytes: int):
        self.budget, self.block_bytes = budget, block_bytes
        self.capacity = budget // block_bytes if block_bytes else 0  # blocks
        self.blocks: OrderedDict[tuple, tuple[int, np.ndarray]] = OrderedDict()  # key -> (id, kv), oldest first
        self.ids = itertools.count(1)  # block ids (0: the root)

    def __len__(self) -> int:
        return len(self.blocks)

    @property
    def nbytes(self) -> int:
        return len(self.blocks) * self.block_bytes

    def _path(self, tokens, n: int) -> list[tuple]:
        """Keys of the cached blocks that begin tokens[:n], root first, as far as they go."""
        keys, parent = [], 0
        for a in range(0, n - n % BLOCK, BLOCK):
            key = (parent, tuple(tokens[a:a + BLOCK]))
            hit = self.blocks.get(key)
            if hit is None:
                break
            keys.append(key)
            parent = hit[0]
        return keys

    def _touch(self, keys: list[tuple]) -> None:
        for key in reversed(keys):  # leaf first, root last: a block stays more recent than its descendants
            self.blocks.move_to_end(key)

    def match(self, tokens, n: int | None = None) -> tuple[int, list[np.ndarray]]:
        """The longest cached prefix of tokens[:n] (default all) -> (positions, their blocks' kv in order)."""
        if not self.capacity:
            return 0, []
        keys = self._path(tokens, len(tokens) if n is None else n)
        self._touch(keys)
        return len(keys) * BLOCK, [self.blocks[k][1] for k in keys]

    def insert(self, tokens, n: int, read) -> None:
        """Keep the whole blocks of tokens[:n] (positions whose keys and values a cache row holds): read(a, b)
        -> that row's kv [2, layers, Hkv, b - a, hd] at positions a .. b-1 (copied here). Blocks already
        kept are not read again. Then the least recently used blocks go while over the budget."""
        if not self.capacity:
            return
        keys = self._path(tokens, n)
        parent = self.blocks[keys[-1]][0] if keys else 0
        for a in range(len(keys) * BLOCK, n - n % BLOCK, BLOCK):
            key, block = (parent, tuple(tokens[a:a + BLOCK])), next(self.ids)
            self.blocks[key] = (block, np.array(read(a, a + BLOCK)))
            keys.append(key)
            parent = block
        self._touch(keys)
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)
