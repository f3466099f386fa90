"""infer/prefix.py: blocks found by their whole prefix, whole blocks only, least recently used first out,
and never a block whose prefix has gone. (The engine's use of it, exact to the bit: test_infer_engine.py.)"""
import numpy as np

from nanoeuler.infer.prefix import BLOCK, PrefixCache

SHAPE = (2, 1, 1, BLOCK, 1)  # [2, layers, Hkv, BLOCK, hd]
BYTES = int(np.prod(SHAPE)) * 8


def row(tokens):
    """A fake cache row: position i holds (token i, i) as its key and value."""
    t = np.asarray(tokens, np.float64)
    return lambda a, b: (t[a:b].reshape(1, 1, -1, 1), np.arange(a, b, dtype=np.float64).reshape(1, 1, -1, 1))


def reachable(pc: PrefixCache) -> bool:
    """Every block's parent is kept (or is the root)."""
    ids = {block for block, _ in pc.blocks.values()}
    return all(parent == 0 or parent in ids for parent, _ in pc.blocks)


def test_a_prefix_is_found_by_all_its_tokens_in_whole_blocks():
    pc = PrefixCache(budget=100 * BYTES, block_bytes=BYTES)
    a = list(range(50))
    pc.insert(a, 50, row(a))
    assert len(pc) == 3  # positions 48, 49: no whole block
    n, blocks = pc.match(a)
    assert n == 48 and np.array_equal(np.concatenate([b[0] for b in blocks], axis=2).ravel(), a[:48])
    assert np.array_equal(np.concatenate([b[1] for b in blocks], axis=2).ravel(), range(48))
    assert pc.match(a, 47)[0] == 32  # only what lies within the first 47 tokens
    assert pc.match(a[:20] + [99] + a[21:])[0] == 16  # another token at 20: the blocks after it are not its
    assert pc.match([1] + a[1:])[0] == 0
    # the same block of tokens after another prefix is another block
    b = [7] * BLOCK + a[BLOCK:2 * BLOCK]
    pc.insert(b, len(b), row(b))
    n, blocks = pc.match(b)
    assert n == 2 * BLOCK and blocks[1][1].ravel().tolist() == list(range(BLOCK, 2 * BLOCK)) and len(pc) == 5
    pc.insert(a, 50, lambda a, b: 1 / 0)  # kept already: nothing is read again
    assert len(pc) == 5


def test_the_least_recently_used_leaves_go_first_and_no_block_is_stranded():
    pc = PrefixCache(budget=4 * BYTES + BYTES // 2, block_bytes=BYTES)
    a, b, c = list(range(48)), [100 + i for i in range(32)], [200 + i for i in range(32)]
    pc.insert(a, 48, row(a))
    pc.insert(b, 32, row(b))  # 5 blocks: a's last (least recent, a leaf) goes
    assert pc.match(a)[0] == 32 and pc.match(b)[0] == 32 and len(pc) == 4 and reachable(pc)
    pc.match(a)  # a is the most recent now
    pc.insert(c, 32, row(c))  # two blocks in: b's two go, the leaf first, never a's root
    assert pc.match(b)[0] == 0 and pc.match(a)[0] == 32 and pc.match(c)[0] == 32 and reachable(pc)
    long = [300 + i for i in range(160)]  # longer than the whole budget: its first 4 blocks stay
    pc.insert(long, 160, row(long))
    assert pc.match(long)[0] == 4 * BLOCK and len(pc) == 4 and reachable(pc)


def test_a_budget_below_one_block_keeps_nothing():
    pc = PrefixCache(budget=BYTES - 1, block_bytes=BYTES)
    a = list(range(40))
    pc.insert(a, 40, lambda a, b: 1 / 0)
    assert pc.match(a) == (0, []) and len(pc) == 0 and pc.nbytes == 0
