"""Speculative decoding: greedy drafts from the text itself (prompt lookup), verified exactly by head 0.

Greedy decoding emits head 0's argmax one forward at a time. Where the text repeats (a name, a line of
the prompt, a refrain), the tokens that follow are often the ones that followed the same few tokens
before. So a round guesses them and lets one forward check them all:

    seq ... 7 3 9 4 5 ... 2 7 3,  t1 = 9 (head 0's argmax, certain)
    (7, 3, 9) occurred before, followed by 4 5 ..          ->  drafts 4, 5, ..
    fed:      9    4    5            one forward over [t1, drafts] (kernels.round_rows: a few rows cost
    head 0:   4    5    8            little more than one), head 0's argmax at every row
    4 == 4, 5 == 5: both accepted; emit 9, 4, 5, and the next round starts from the certain token 8

A draft is accepted only when it is head 0's argmax after the tokens before it, so the output is token for
token plain greedy decoding (tests/test_generate.py), in fewer forwards; rejected drafts are rolled back
(the cache's length is cut, they are overwritten later). Where the last NGRAM tokens never occurred, or
the window is full, a round is a plain step. Where the occurrence is recent the text is in a loop, and the
copy runs on into the round's own tokens, so that a loop of period P drafts a whole round:

    seq ... 5 7 3 8 0 2 7 3,  t1 = 8:  (7, 3, 8) occurred 5 back  ->  drafts 0 2 7 3 8 0 2

Up to 3 drafts a round (DEPTH): more tokens a forward with 7, but a step of 8 rows costs much more than one
of 4, and with 1 fewer drafts are made. A fixed depth is as fast as a planner that chose whether and how
deep to speculate from timed rounds (where no lookup is found a round is a plain step already), and drafts
from the MTP heads 1..K-1 add nothing to the lookup's gain, so generation reads head 0 only. The speed-ups
of each depth, and the measurements behind these choices: docs/benchmarks.md (Generation;
`bench/generate.py --parts`).

Sampling (temperature > 0) does not speculate: under the exact rule of speculative sampling a lookup draft
x (one certain token) is accepted with probability p(x), on a trained model too rarely to pay for its
verification (bench/lookup_sampling.py).
"""
from __future__ import annotations

from . import kernels

DEPTH = 3                 # drafts a round verifies at most, by default: t1 + 3 drafts are 4 rows, one pass
#                           of gemv.py's 4-row panels over the weights (see its docstring)
MOST = kernels.ROWS - 1   # .. and at all (spec_depth): t1 + 7 drafts fill one call's rows
NGRAM = 3                 # tokens (t1 included) whose earlier occurrence gives the drafts


class Lookup:
    """The drafts of one sequence: an index of where each NGRAM tokens last occurred, grown as the sequence
    grows (drafts are rolled back before a lookup ever indexes them, so it holds only tokens that stay)."""

    def __init__(self):
        self.index: dict = {}  # NGRAM tokens -> the position after their last occurrence in the sequence
        self.indexed = 0       # positions of the sequence indexed so far

    def drafts(self, seq: list[int], start: int, t1: int, most: int) -> list[int]:
        """The tokens that followed the last occurrence of (seq's last NGRAM-1 tokens, t1), continued
        periodically past the end (see the module docstring), at most `most` of them (or []); start: the
        first position of the model's window (n-grams are indexed inside it).

            Lookup().drafts([5, 7, 3, 8, 0, 2, 7, 3], 0, 8, 4) -> [0, 2, 7, 3]"""
        for p in range(max(self.indexed, start + NGRAM), len(seq)):
            self.index[tuple(seq[p - NGRAM:p])] = p
        self.indexed = len(seq)
        p = self.index.get((*seq[len(seq) - NGRAM + 1:], t1))
        if p is None or most <= 0:
            return []
        if len(seq) - p >= most:
            return seq[p:p + most]
        loop = seq[p:] + [t1]  # what followed the occurrence, up to this round: one period
        return [loop[i % len(loop)] for i in range(most)]


def speculate(win, emit, out, depth: int = DEPTH) -> None:
    """Greedy speculative decoding on session.py's window `win` (see the module docstring), at most `depth`
    drafts a round; emit(token) -> True ends it; out (a session.Generation) counts the drafts."""
    look = Lookup()
    while True:
        t1 = win.argmax()
        if emit(t1):
            return
        drafts = look.drafts(win.seq, win.start, t1, min(depth, win.room() - 1))
        if not drafts:
            win.feed(t1)
            continue
        n_before = len(win.seq) - win.start
        h, head0, best = win.advance([t1] + drafts)  # [1 + d, dim], [1 + d, V], argmax [1 + d]
        n_ok = 0
        while n_ok < len(drafts) and best[n_ok] == drafts[n_ok]:
            n_ok += 1
        out.drafted += len(drafts)
        out.draft_rounds += 1
        out.accepted += n_ok
        win.keep(n_before + 1 + n_ok, h[n_ok], head0[n_ok], best[n_ok])
        for t in drafts[:n_ok]:
            if emit(t):
                return
