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

What it gains (`OPENBLAS_NUM_THREADS=1 bench/generate.py --ckpt RUN --presets '' --parts --repeat 7
--decode-threads 1`: 256 greedy tokens, speculative ÷ plain back to back, wall (CPU time); make demo's
model, three runs on a machine shared with other jobs, load 7.3-7.5):

    up to 3 drafts a round (DEPTH)    1.51-1.66x (1.52-1.60x)   82 % of drafts accepted, 2.35 tokens a forward
    up to 7                           1.41-1.49x (1.39-1.51x)   67 %, 2.98: more tokens a forward, but a step
                                                                 of 8 rows costs ~3.3 of 1 row (4 rows ~1.8)
    up to 1                           1.24-1.35x (1.32-1.41x)   90 %, 1.62

A cost-and-acceptance planner (speculate or not, and how deep, from timed rounds) was measured on the same
model in the same window at 1.18-1.45x (1.20-1.38x) with these lookup drafts: a fixed depth is as fast or
faster, and where no lookup is found a round is a plain step already (the planner's off switch and depth
choice paid nothing measurable on top). Drafts
from the MTP heads 1..K-1 added nothing to the lookup's gain (quiet: 1.39x with them, 1.41x without) and
cost CPU time, so generation reads head 0 only.

Sampling (temperature > 0) does not speculate: under the exact rule of speculative sampling a lookup draft
x (one certain token) is accepted with probability p(x); at T 0.8 on make demo's model a lookup is found at
4.5 % of the positions and its first draft accepted with probability 0.18, so at most 0.9 % of the forwards
would be saved, less than the verifications cost (bench/lookup_sampling.py). Drafts from the MTP heads
measured 0.75-0.90x of plain sampling.
"""
from __future__ import annotations

from . import kernels

DEPTH = 3                 # drafts a round verifies at most, by default: t1 + 3 drafts are 4 rows, one pass
#                           of kernels.py's 4-row panels over the weights (measured: see the module docstring)
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
