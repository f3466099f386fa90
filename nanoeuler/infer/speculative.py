"""Self-speculative decoding: drafts from the MTP heads and from the text itself, verified exactly.

Self-speculative decoding uses the K multi-token-prediction heads as a free draft model. At the last
processed position, head 0 gives the next token t1 for certain and heads 1..K-1 guess the tokens after
it, d2..dK. One forward over [t1, d2, .., dK] then verifies every guess with head 0:

    fed:       t1    d2    d3          (K = 3)
    head 0:    a2    a3    a4          a2 == d2?  a3 == d3?  accept the longest agreeing prefix
    d2 == a2, d3 != a3  ->  emit t1, d2; next round starts from certain token a3 (no extra forward)

That is greedy (temperature 0): the output is token for token head 0's greedy output, in fewer forwards.
At temperature > 0 the drafts are sampled from the draft heads' distributions q (same temperature /
top-k / top-p) and verified by the standard accept/reject rule against head 0's distribution p there:

    d2 ~ q2:  accept w.p. min(1, p2(d2) / q2(d2))  ->  then d3 the same way against p3 (from the same forward)
              reject -> the token is drawn from norm(max(p2 - q2, 0)) and the round ends
    all accepted -> the next round's t1 is drawn from head 0 after the last draft (the "bonus" token)

so every emitted token has exactly plain sampling's distribution (`Sampled`; tests/test_generate.py
checks it by chi-square). The cache is rolled back to the accepted tokens (rejected drafts are simply
overwritten later). Whether to speculate at all, and how many drafts a round verifies (1 .. K-1 from
the heads; greedy rounds up to 7 where the text repeats, see `Greedy`), is decided by `Planner` from
the measured acceptance and the measured cost of rounds: a verification forward of a few tokens costs
little more than a 1-token step, but drafts that are rarely accepted still do not pay, and then decoding
is plain KV-cache decoding with a short probe every 128 rounds. A round's model work is one compiled call
(kernels.round_rows: the fused step over [t1, drafts], head 0 and its argmax at every row, and for greedy
decoding the next round's head drafts where the round goes on), so the Python around it is bookkeeping
(on `small`, 1 decode thread, 100 cached positions: ~20 µs a round beside a compiled call of 62 µs for
1 row, 74 for 2, 88 for 3, +4 per head draft; the NumPy head products, argmax and draft softmax around
the forward had cost 30-40 µs).

The rounds run on session.py's window (`_Window`: advance, keep, head, head_drafts).

What each part gains (`bench/generate.py --ckpt RUN --presets '' --parts --repeat 7 --decode-threads 1`,
256 tokens, spec ÷ plain, wall (CPU time), back-to-back pairs; make demo's model, quiet machine (load 0.9),
three runs:

    variant                          greedy                        sampled T 0.8
    all parts (adaptive planner)     1.38-1.39x (1.12-1.14x)       0.99-1.00x (0.99-1.00x)
    no prompt lookup (heads only)    1.01-1.03x (1.02x)                 -
    no head drafts (lookup only)     1.40-1.42x (1.38-1.39x)            -
    head drafts made apart           1.38-1.40x (1.30-1.32x)            -
    fixed depth 1                    1.29-1.31x (1.28-1.31x)       0.88-0.90x
    fixed depth 2                    1.42-1.44x (1.42-1.44x)       0.75-0.76x

  - the planner: where drafts do not pay (sampled decoding) it keeps speculation off, 1.00x against
    0.75-0.90x for a fixed depth (+11-33 %); a fixed depth has no off switch.
  - prompt lookup: the whole greedy gain on this model (1.02x without it, 1.39x with it).
  - head drafts: on this model they add nothing to lookup's gain (1.39x with, 1.41x without) and cost CPU
    time (1.13x against 1.38x); on the default-trained small the two together measured 1.19-1.22x
    (docs/benchmarks.md). Sampled decoding drafts with the heads only, and the planner keeps that off.
  - the next round's head drafts made in the round's compiled call (`Planner.heads_wanted`): within the noise.
"""
from __future__ import annotations

import time
import weakref

import numpy as np

from . import kernels
from .sampling import draw_token, token_probs


class Greedy:
    """Temperature 0: a draft is accepted when it is head 0's argmax; on a miss, head 0's argmax is the next
    token. Drafts come from the text itself where it repeats (prompt lookup), else from the draft heads:
    when the last NGRAM tokens, t1 included, occurred before in the sequence, the tokens that followed them
    there are drafts 1, 2, .. (as many as one verification takes, kernels.ROWS - 1: a lookup is not bound
    to the K - 1 draft heads); else drafts 1..K-1 are the draft heads' argmax. Any draft keeps the output
    exact (a draft only ever saves a forward), so the source is chosen for acceptance alone: on the
    default-trained `small` (distilled heads, 1000-token greedy generations) the heads' drafts were accepted
    78.5 %, lookup drafts 90 % where the 3 tokens had occurred (69 % of the rounds), the two together 83 %.

        seq ... 7 3 9 4 5 ... 2 7 3,  t1 = 9:  (7, 3, 9) occurred, followed by 4 5 ..  ->  drafts 4, 5, ..

    Where the occurrence is recent, the text is in a loop: the copy runs on into the round's own tokens
    (t1, then the drafts themselves), so that a loop of period P drafts a whole round, not P - 1 tokens:

        seq ... 5 7 3 8 0 2 7 3,  t1 = 8:  (7, 3, 8) occurred 5 back  ->  drafts 0 2 7 3 8 0 2

    Confidence (the planner's bin): LOOKUP_CONF for a lookup draft, else the draft head's softmax
    probability of its draft."""

    NGRAM = 3
    LOOKUP_CONF = 0.95

    def __init__(self):
        self.index: dict = {}  # NGRAM tokens -> the position after their last occurrence in the sequence
        self.indexed = 0       # positions of the sequence indexed so far
        self.cont: list = []   # this round's lookup drafts

    def prepare(self, win: "_Window", t1: int) -> None:
        """A round begins: t1 is its certain token (not yet in the sequence)."""
        self.t1 = t1

    def lookup(self, win: "_Window") -> list[int]:
        """Index the tokens added since the last lookup, then -> the tokens that followed the last occurrence
        of (the last NGRAM-1 tokens, t1), continued periodically past the end (see the class), at most
        kernels.ROWS - 1 of them (or []). Drafts are rolled back before a lookup ever indexes them, so the
        index holds only tokens that stay."""
        seq, n, index, most = win.seq, self.NGRAM, self.index, kernels.ROWS - 1
        for p in range(max(self.indexed, win.start + n), len(seq)):
            index[tuple(seq[p - n:p])] = p
        self.indexed = len(seq)
        p = index.get((*seq[len(seq) - n + 1:], self.t1))
        if p is None:
            return []
        if len(seq) - p >= most:
            return seq[p:p + most]
        loop = seq[p:] + [self.t1]  # what followed the occurrence, up to this round: one period
        return [loop[i % len(loop)] for i in range(most)]

    def propose_draft(self, win: "_Window", j: int) -> tuple[int, float] | None:
        """Draft j+1 (j = 0, 1, ..: asked in this order) of this round and its confidence, or None: no lookup
        draft that far and j + 1 >= K (no head drafts it)."""
        if j == 0:
            self.cont = self.lookup(win)
        if j < len(self.cont):
            return self.cont[j], self.LOOKUP_CONF
        if j >= win.cfg.n_mtp - 1:
            return None
        if (win.head_drafts is None or j >= len(win.head_drafts)) and win.fast():
            win.make_head_drafts(j + 1)  # (the last round's compiled call did not: a lookup round, a jump)
        if win.head_drafts is not None and j < len(win.head_drafts):
            return win.head_drafts[j]
        return self.propose(win.head(j + 1))

    def next(self, win: "_Window") -> int:
        """The token after the window: head 0's argmax (known already after `advance`)."""
        return win.best if win.best is not None else int(np.argmax(win.head(0)))

    def accept(self, logits: np.ndarray, best: list[int], drafts: list[int], props: list, plan) -> tuple[int, None]:
        """-> (drafts accepted, None): the next token is then head 0's argmax after them, best[n_ok]."""
        n_ok = 0
        for j, x in enumerate(drafts):
            ok = best[j] == x
            if plan is not None:
                plan.observe(j, props[j][1], 1.0 if ok else 0.0)
            if not ok:
                break
            n_ok += 1
        return n_ok, None

    def propose(self, logits: np.ndarray) -> tuple[int, float]:
        t = int(np.argmax(logits))
        return t, 1.0 / float(np.exp(logits - logits[t]).sum())

    def draft(self, q: int) -> int:
        return q


class Sampled:
    """Temperature > 0: the standard speculative-sampling rule. p is head 0's distribution at a position
    and q the draft head's (both through token_probs with the same temperature / top-k / top-p); the
    draft x ~ q is accepted with probability min(1, p(x) / q(x)), else the token is drawn from the
    residual norm(max(p - q, 0)). Either way the token is distributed exactly as p:
    P(x) = q(x)·min(1, p/q) + (1 - Σ min(p, q))·max(p - q, 0)(x) / Σ max(p - q, 0) = min(p, q) + max(p - q, 0) = p(x).

        p = [.6, .4], q = [.9, .1]:  x=0 accepted w.p. 2/3, x=1 always; reject -> residual [0, 1]
        P(0) = .9·2/3 = .6,  P(1) = .1 + .9·1/3 = .4
    Confidence: q's largest probability. The acceptance observed for the planner is Σ min(p, q), the
    exact acceptance probability of that draft (less noisy than the coin flip)."""

    def __init__(self, temperature: float, top_k: int | None, top_p: float | None, rng: np.random.Generator):
        self.temperature, self.top_k, self.top_p, self.rng = temperature, top_k, top_p, rng

    def probs(self, logits: np.ndarray) -> np.ndarray:
        return token_probs(logits, self.temperature, self.top_k, self.top_p)

    def prepare(self, win: "_Window", t1: int) -> None:
        pass  # sampled drafts come from the draft heads only

    def propose_draft(self, win: "_Window", j: int) -> tuple[np.ndarray, float]:
        return self.propose(win.head(j + 1))

    def pick(self, logits: np.ndarray) -> int:
        return draw_token(self.probs(logits), self.rng)

    def next(self, win: "_Window") -> int:
        return self.pick(win.head(0))

    def accept(self, logits: np.ndarray, best: list[int], drafts: list[int], props: list,
               plan) -> tuple[int, int | None]:
        """-> (drafts accepted, the token drawn at the first rejection or None)."""
        for j, x in enumerate(drafts):
            ok, p_accept, forced = self.check(logits[j], x, props[j][0])
            if plan is not None:
                plan.observe(j, props[j][1], p_accept)
            if not ok:
                return j, forced
        return len(drafts), None

    def propose(self, logits: np.ndarray) -> tuple[np.ndarray, float]:
        q = self.probs(logits)
        return q, float(q.max())

    def draft(self, q: np.ndarray) -> int:
        return draw_token(q, self.rng)

    def check(self, logits: np.ndarray, x: int, q: np.ndarray) -> tuple[bool, float, int | None]:
        p = self.probs(logits)
        rate = float(np.minimum(p, q).sum())
        if self.rng.random() * q[x] < p[x]:  # accept with probability min(1, p(x) / q(x))
            return True, rate, None
        return False, rate, draw_token(self.residual(p, q), self.rng)

    @staticmethod
    def residual(p: np.ndarray, q: np.ndarray) -> np.ndarray:
        """norm(max(p - q, 0)): where a rejected token comes from.  residual([.6, .4], [.9, .1]) -> [0, 1]"""
        r = np.maximum(p - q, 0.0)
        s = r.sum()
        return r / s if s > 0 else p  # s == 0 only when p == q, where nothing is ever rejected


class Planner:
    """Decides whether to speculate at all, and how many drafts each round verifies, from measured
    acceptance and measured cost, so that speculation is used only where it pays.

    Cost: cost[w][d] is the CPU time of this thread (time.thread_time) in a round that verifies d drafts
    (drafting, the forward of d+1 tokens, the checks, emitting; d = 0 is a plain step), w = whether the
    round before it verified drafts too, as the median of its last 31 samples. CPU time, not wall time: on
    a machine shared with other processes a round's wall time mostly measures the scheduler (one round in
    five lost the core for ~20 ms; with 2 helpers' jobs on 2 cores, wall-time tables put a verification at
    1.2-2.3x a plain step from one call to the next, thread CPU time at 1.24-1.42x). The median, not a lower
    quartile: CPU time is not inflated by preemption, and a verification's cost varies more than a plain
    step's (a rejected sampled draft adds the residual's draw), so a lower quartile favoured speculation
    (measured on because of it at 0.91x, sampling on the default-trained small). The two tables differ: on `small`
    here a lone verification among plain steps cost 1.6-1.75x a plain step, one after another only 1.2-1.3x
    (the verification's code and data are no longer in the CPU caches). So the planner works in two regimes
    rather than round by round (mixing them paid the lone price for every draft, and lost):

        off: plain steps; at round 8, then `probe_every` rounds later, then twice as far each time up to
             8 x probe_every while the regime stays off (rounds counted over all calls sharing the
             planner), a burst of 3 rounds verifying 1 draft each (draft 1's rate and the back-to-back
             cost stay fresh). A lone verification among plain steps costs 2-4x a plain step (cold
             caches), so a probe every 128 rounds cost ~3 % of plain decoding where drafts never pay;
             backing off makes it < 1 %. Only while draft 1's average acceptance is below BACKOFF: drafts
             that are often right are near paying, and one burst measures costs roughly (the default-
             trained small with distilled heads stayed off for 1000s of rounds after one unlucky burst);
             their bursts are 3x as long (more back-to-back rounds timed, after the first colder ones)
        on:  every round verifies 1..D drafts, the depth with the best worth for this round's drafts;
             every `probe_every`-th round a burst of 3 plain steps (the plain cost stays fresh)

    Worth of a round verifying d drafts: E(d) / cost[1][d] tokens per second, E(d) = 1 + r1 + r1·r2 + ...
    the expected tokens it emits. The regime is `on` while the best worth with the drafts' average
    acceptance beats a plain step (cost[0][0]) by 15 %, decided again every 8 rounds (with 5 % it was on
    at 30 % acceptance on the `make demo` model and measured 0.93-0.99x: costs and rates measured on a
    busy machine err, and plain decoding is the safe side); once on, greedy decoding stays on while that
    worth beats a plain step by 5 % (STAY: with one margin, a model at its edge flapped, paying a lone
    probe's cost at every switch; sampling keeps MARGIN, see `planner`):

        cost = 1.0 ms plain, 1.2 / 1.45 ms for 1 / 2 drafts back to back
        r1 = .5, r2 = .3:  worth 1.5/1.2 = 1.25, 1.65/1.45 = 1.14  > 1.15/1.0  -> on, mostly 1 draft
        r1 = .3:           worth 1.3/1.2 = 1.08                    < 1.15      -> off

    Within `on`, the depth follows how sure the draft heads are: rate(j, conf) estimates P(draft j+1
    accepted | the drafts before it accepted) for a draft whose head is `conf` sure of it (4 confidence
    bins, priors .15/.45/.72/.92, a memory of ~30 observations per bin; greedy lookups go past the K-1
    heads, to D = kernels.ROWS - 1, and drafts past the last head share its row: a deep row of its own,
    once unlucky, was never tried again, and its rate stuck low); drafts are proposed one by one
    while each adds 5 % of worth (a draft that could not add that even if sure to be accepted is not even
    computed: its head's matrix product is ~5 % of a `small` step). An unmeasured cost is taken from the
    other table, else extrapolated (+25 % of a plain step per draft), and never counts as less than
    1 + 0.1·d plain steps. A planner lives as long as its model,
    one per sampling setting (`planner`), so a chat's short replies do not each start from the priors.
    Which drafts are verified never changes the output (greedy) or its distribution (sampling); at
    temperature > 0 it changes which random numbers are drawn, so a seed reproduces speculative samples
    only with a fixed depth (generate's spec_depth)."""

    PRIOR = (0.15, 0.45, 0.72, 0.92)
    MARGIN = 1.15   # worth needed over a plain step to speculate (costs measured on a busy machine are noisy)
    STAY = 1.05     # .. and to go on speculating once on (one margin only flapped at its edge, paying probes)
    BURST = 3       # rounds of a probe
    BACKOFF = 0.5   # draft 1's average acceptance below which probes come ever later while off

    def __init__(self, max_depth: int, memory: float = 0.97, stay: float | None = None, rows: int | None = None):
        # plain Python floats throughout: this runs every round, where a numpy call on 4 numbers costs more
        # than the arithmetic (it was 5 % of a `small` decoding step)
        self.D, self.memory = max_depth, memory
        self.stay = self.STAY if stay is None else stay  # the margin to stay on (sampling: MARGIN, see _planner)
        R = self.R = min(max_depth, rows or max_depth)  # rate rows: draft j+1 is judged by row min(j, R - 1)
        self.hits = [list(self.PRIOR) for _ in range(R)]    # [R][bins] decayed sums of acceptance
        self.seen = [[1.0] * len(self.PRIOR) for _ in range(R)]  # [R][bins] decayed counts
        self.avg = [[0.3, 1.0] for _ in range(R)]           # [R] (decayed sum, count) over all bins
        self.cost = [[None] * (max_depth + 1) for _ in range(2)]    # [after a plain / a draft round][d] seconds
        self.samples = [[[] for _ in range(max_depth + 1)] for _ in range(2)]  # the last 31 of each
        self.on, self.recheck, self.burst, self.plain = False, 0, 0, 0
        self.next_probe, self.gap = 8, 0  # the round of the next probe, and the last gap between probes
        self.n_timed = 0  # rounds timed
        self.rounds = 0  # rounds decided, over all the calls that share this planner (the probe clock)
        self.looked = 1.0  # decayed average of the drafts proposed a round (choose): the head drafts to make

    def _bin(self, conf: float) -> int:
        return (conf >= 0.3) + (conf >= 0.6) + (conf >= 0.85)

    def rate(self, j: int, conf: float) -> float:
        b, r = self._bin(conf), min(j, self.R - 1)
        return self.hits[r][b] / self.seen[r][b]

    def observe(self, j: int, conf: float, accepted: float) -> None:
        """Draft j+1 (confidence conf) was verified; accepted: 0/1, or its acceptance probability."""
        j = min(j, self.R - 1)
        b, m, hits, seen = self._bin(conf), self.memory, self.hits[j], self.seen[j]
        hits[b] = hits[b] * m + accepted  # only this bin ages: a memory of ~30 of its own observations
        seen[b] = seen[b] * m + 1
        a = self.avg[j]
        a[0], a[1] = a[0] * m + accepted, a[1] * m + 1

    def timed(self, w: int, d: int, seconds: float) -> None:
        """A round of depth d (after a round that drafted: w = 1) took `seconds`."""
        last = self.samples[w][d]
        last.append(seconds)
        if len(last) > 31:
            del last[0]
        self.n_timed += 1
        if len(last) < 16 or self.n_timed % 4 == 0:  # a sort every round was ~2 % of a round
            self._cost[w][d] = sorted(last)[len(last) // 2]
            self._c.clear()

    @property
    def cost(self) -> list:
        """[after a plain round / a draft round][depth d] -> seconds (median), or None while unmeasured."""
        return self._cost

    @cost.setter
    def cost(self, table: list) -> None:
        self._cost, self._c = table, {}

    def c(self, w: int, d: int) -> float:
        """Cost of a round of depth d after a round that drafted (w = 1) or not; at least 1 + 0.1·d plain steps.
        (Remembered until the next median: it is asked several times a round.)"""
        key = (w, d)
        if key not in self._c:
            self._c[key] = self._c_of(w, d)
        return self._c[key]

    def _c_of(self, w: int, d: int) -> float:
        for table in (self.cost[w], self.cost[1 - w]):
            if table[d] is not None:
                return table[d] if d == 0 else max(table[d], self.c(w, 0) * (1 + 0.1 * d))
        return self.c(w, 0) * (1 + 0.25 * d)

    def pays(self) -> bool:
        """Does speculating, round after round, beat plain steps (by MARGIN) at the average acceptance? Not
        before 5 plain steps are timed (a first plain step that lost the CPU for 20 ms once made every
        verification look cheap). Counts the depths the draft heads reach only (the rate rows): deeper
        lookups come now and then, and are a bonus on top."""
        if len(self.samples[0][0]) < 5:
            return False
        expected, chance, best = 1.0, 1.0, 0.0
        for j in range(self.R):
            a = self.avg[j]
            chance *= a[0] / a[1]
            expected += chance
            best = max(best, expected / self.c(1, j + 1))
        return best > (self.stay if self.on else self.MARGIN) / self.c(0, 0)

    def choose(self, win: _Window, rule, room: int, probe: bool) -> tuple[list, int]:
        """-> (proposals [(q, conf)] of drafts 1, 2, .., depth): the drafts to verify this round."""
        D = min(self.D, room)
        if D == 0 or (self.cost[0][0] is None and self.cost[1][0] is None):
            return [], 0  # the first round is a plain step: it measures a plain step's cost
        if self.recheck > 0:
            self.recheck -= 1
        else:
            self.on, self.recheck = self.pays(), 7
        if self.on and (probe or self.plain > 0):
            self.plain = self.BURST - 1 if probe else self.plain - 1
            return [], 0
        if self.burst == 0 and not self.on:
            if not probe:
                return [], 0
            self.burst = self.BURST * (3 if self.avg[0][0] >= self.BACKOFF * self.avg[0][1] else 1)
        if self.burst > 0:
            self.burst -= 1
            self.recheck = 0 if self.burst == 0 else self.recheck  # decide on what the probe found
            return [rule.propose_draft(win, 0)], 1
        props: list = []
        best_worth, depth, expected, chance = 0.0, 1, 1.0, 1.0
        for j in range(D):
            if j and (expected + chance) / self.c(1, j + 1) <= best_worth * 1.05:
                break  # even a sure draft j+1 would not add 5 %: its head is not computed at all
            prop = rule.propose_draft(win, j)
            if prop is None:
                break
            q, conf = prop
            props.append((q, conf))
            chance *= self.rate(j, conf)
            expected += chance
            worth = expected / self.c(1, j + 1)
            if worth > best_worth * (1.05 if j else 1.0):
                best_worth, depth = worth, j + 1
            else:
                break
        self.looked = 0.9 * self.looked + 0.1 * len(props)
        return props, depth

    def heads_wanted(self) -> int:
        """How many draft heads' drafts to make ahead (kernels.round_rows): 1, or all (the R rate rows are the
        K - 1 heads) where rounds often ask for draft 2 (made apart, `make_head_drafts`, it is a second call)."""
        return 1 if self.looked < 1.5 else self.R


_PLANNERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> {sampling setting: Planner}


def planner(model, setting: tuple) -> "Planner":
    """The model's planner for a sampling setting (temperature, top_k, top_p), made on first use; at most 8
    settings are kept per model (the oldest goes). Sampling planners stay on only at MARGIN, as they switch
    on: a sampled round's cost varies more (a rejection adds the residual's draw, none of it compiled), and
    with STAY the distilled small sampled at 0.94x plain under load 4."""
    greedy, K = setting[0] == 0, model.config.n_mtp

    def make():  # greedy: lookup drafts go up to kernels.ROWS - 1 deep, judged by the last head's rates
        return Planner(kernels.ROWS - 1 if greedy else K - 1, stay=Planner.STAY if greedy else Planner.MARGIN,
                        rows=K - 1)
    try:
        plans = _PLANNERS.setdefault(model, {})
    except TypeError:  # not weakly referenceable: a fresh planner every call
        return make()
    if setting not in plans:
        if len(plans) >= 8:
            del plans[next(iter(plans))]
        plans[setting] = make()
    return plans[setting]


def speculate(win: _Window, rule, emit, out: Generation, depth: int | None = None, plan: Planner | None = None,
               probe_every: int = 128) -> None:
    """Speculative decoding (see the module docstring) with verification `rule` (Greedy or Sampled) and
    depth chosen by `plan` (or fixed: depth). Ends when emit() says so."""
    K = win.cfg.n_mtp
    plan = plan or Planner(K - 1)
    clock = time.thread_time  # one reading per round: the work done, whoever else shares the CPU (see Planner)
    forced = None  # the next token, when a rejection already decided it
    last, w, jumps = clock(), 0, win.jumps  # w: whether the last round drafted
    greedy = isinstance(rule, Greedy)
    while True:
        t1 = forced if forced is not None else rule.next(win)
        if emit(t1):
            return
        room = max(0, win.room() - 1)  # the window is (nearly) full: do what plain decoding would
        plan.rounds += 1
        rule.prepare(win, t1)
        if depth is None:
            probe = plan.rounds >= plan.next_probe
            if probe:  # while off with drafts mostly rejected, each probe comes twice as late as the last
                backoff = plan.gap and not plan.on and plan.avg[0][0] < plan.BACKOFF * plan.avg[0][1]
                plan.gap = min(2 * plan.gap, 8 * probe_every) if backoff else probe_every
                plan.next_probe = plan.rounds + plan.gap
            props, d = plan.choose(win, rule, room, probe=probe)
        else:
            d = min(depth, K - 1, room)
            props = [rule.propose_draft(win, j) for j in range(d)]
        forced = None
        # greedy: the next round's head drafts come out of this round's compiled call where it will draft
        # (not after a round drafted by lookup: the text repeats, and the next lookup most likely hits too)
        # (as many heads as rounds use: a fixed depth, or 1 unless the planner often looks at draft 2)
        win.want_draft = 0 if not greedy or (d and rule.cont) else (
            min(depth, K - 1) if depth is not None else (plan.on or plan.burst > 0) * plan.heads_wanted())
        if d == 0:
            win.feed(t1)
        else:
            drafts = [rule.draft(q) for q, _ in props[:d]]  # drawn only now: which drafts go never depends on them
            n_before = len(win.seq) - win.start
            h, head0, best = win.advance([t1] + drafts, win.want_draft)  # [1 + d, dim], [1 + d, V], argmax [1 + d]
            out.drafted += d
            out.draft_rounds += 1
            n_ok, forced = rule.accept(head0, best, drafts, props, plan)
            out.accepted += n_ok
            win.keep(n_before + 1 + n_ok, h[n_ok], head0[n_ok], best[n_ok], n_ok)
            for t in drafts[:n_ok]:
                if emit(t):
                    return
        now = clock()
        # a round that refilled the window after a jump is no plain step; 1 in 4 plain steps after plain steps
        # suffice (not the first ones: right after the prefill they are slow, and made verifications look cheap)
        if win.jumps == jumps and (d or w or plan.rounds % 4 == 1):
            plan.timed(w, d, now - last)  # this round: from the end of the last one (its emits included)
        last, w, jumps = now, int(d > 0), win.jumps
        if d == 0 and depth is None and not (plan.on or plan.burst or plan.plain) and plan.recheck > 0:
            # off, with nothing to decide before the planner's next check or probe: plain steps until then,
            # without its round around each (that bookkeeping was ~3 % of a plain step of `small`)
            win.want_draft = 0
            for r in range(plan.rounds + 1, min(plan.next_probe, plan.rounds + plan.recheck + 1)):
                t0 = clock() if r % 4 == 1 else None  # 1 in 4 still timed
                token = rule.next(win)
                if emit(token):
                    return
                win.feed(token)
                plan.rounds, plan.recheck = r, plan.recheck - 1
                if t0 is not None and win.jumps == jumps:
                    plan.timed(0, 0, clock() - t0)
                jumps = win.jumps
            last = clock()
