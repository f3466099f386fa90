"""Generation: the KV-cache forward equals full recomputation, cache and speculative decoding give the
same tokens as the slow reference, speculative sampling draws from exactly plain sampling's distribution
(chi-square against the enumerated distribution, and the same test failing on wrong rules), the planner
falls back to plain steps when drafts don't pay, sampling options behave, the stream decoder never splits
a character."""
import math

import numpy as np
import pytest

from nanoeuler import Config, Model, UserError
from nanoeuler.infer import kernels, sampling, session, speculative, weights
from nanoeuler.infer.cache import new_cache
from nanoeuler.infer.sampling import draw_token, sample_token, token_probs
from nanoeuler.infer.session import generate, StreamDecoder, truncate_left
from nanoeuler.infer.step import forward_cached
from nanoeuler.model import forward
from nanoeuler.optim import AdamW
from conftest import rel_err, tiny_config

TINY = tiny_config(vocab_size=24, dim=32, n_heads=4, n_kv_heads=2, n_layers=2, ctx_len=32, ffn_hidden=48, n_mtp=3)


@pytest.fixture
def steady_costs(monkeypatch):
    """Deterministic planner decisions: every round of depth d is timed as 1 + 0.2·d ms whatever the clock
    says (the machine's real timings are noisy; the decisions then depend on acceptance alone)."""
    original = speculative.Planner.timed
    monkeypatch.setattr(speculative.Planner, "timed", lambda self, w, d, seconds: original(self, w, d, (1 + 0.2 * d) * 1e-3))


@pytest.fixture(scope="module")
def trained():
    """A tiny model trained on a periodic sequence, so its MTP heads draft well (acceptance near 1)."""
    model = Model.init(TINY, seed=0)
    period = np.array([3, 1, 4, 15, 9, 2, 6, 5, 13, 5, 8, 7, 20, 11])
    opt = AdamW(model.params, lr=1e-2, weight_decay=0.0)
    rng = np.random.default_rng(0)
    for _ in range(120):
        starts = rng.integers(0, len(period), 8)
        tokens = np.stack([np.resize(np.roll(period, -s), 16 + TINY.n_mtp) for s in starts])
        _, _, grads = model.loss_and_grads(tokens)
        opt.step(model.params, grads)
    return model, period


@pytest.mark.parametrize("dtype,tol", [(np.float64, 1e-10), (np.float32, 1e-5)])
def test_cached_logits_equal_full_recomputation(dtype, tol):
    model = Model.init(TINY, seed=1).astype(dtype)
    ids = np.random.default_rng(0).integers(0, TINY.vocab_size, (2, 20))
    full = forward(TINY, model.params, ids)[0]  # [K, B, T, V]
    cache = new_cache(TINY, batch=2, dtype=dtype)
    pieces = [forward_cached(TINY, model.params, ids[:, :7], cache)]  # prefill 7, then chunks of 1 and 4
    for a, b in [(7, 8), (8, 12), (12, 13), (13, 20)]:
        pieces.append(forward_cached(TINY, model.params, ids[:, a:b], cache))
    got = np.concatenate(pieces, axis=2)
    assert cache.length == 20
    assert rel_err(got, full) <= tol
    last = forward_cached(TINY, model.params, ids[:, :20], new_cache(TINY, 2, dtype=dtype), last_only=True)
    assert rel_err(last[:, :, 0], full[:, :, -1]) <= tol


def test_cache_overflow_is_an_error():
    model = Model.init(TINY, seed=1)
    cache = new_cache(TINY, max_len=4)
    with pytest.raises(UserError, match="overflow"):
        forward_cached(TINY, model.params, np.zeros((1, 5), dtype=np.int64), cache)


@pytest.mark.parametrize("seed", [0, 1])
def test_cache_generation_matches_full_recomputation(seed):
    """Same tokens and the same logits, through a window jump (prompt 10 + 40 new > ctx 32)."""
    model = Model.init(TINY, seed=seed)
    prompt = list(np.random.default_rng(seed).integers(0, TINY.vocab_size, 10))
    runs = {}
    for mode in ("full", "cache"):
        runs[mode] = generate(model, prompt, max_new_tokens=40, temperature=0, mode=mode)
    assert runs["full"].ids == runs["cache"].ids and len(runs["cache"].ids) == 40
    assert runs["cache"].forwards < 45
    # sampling with a seed is reproducible and mode-independent too
    a = generate(model, prompt, 30, temperature=1.0, top_k=10, top_p=0.9, seed=5, mode="full").ids
    b = generate(model, prompt, 30, temperature=1.0, top_k=10, top_p=0.9, seed=5, mode="cache").ids
    assert a == b


def test_greedy_step_logits_equal_model_forward(trained):
    """Each greedy token is the argmax of model.forward over the sequence so far (the independent reference)."""
    model, period = trained
    prompt = [int(t) for t in period[:5]]
    got = generate(model, prompt, max_new_tokens=12, temperature=0, mode="cache").ids
    seq = list(prompt)
    for token in got:
        logits = forward(TINY, model.params, np.array([seq]))[0][0, 0, -1]
        assert int(np.argmax(logits)) == token
        seq.append(token)


@pytest.mark.parametrize("which", ["random", "trained"])
def test_speculative_equals_greedy_token_for_token(which, trained, steady_costs):
    model, period = trained
    if which == "random":
        model = Model.init(TINY, seed=3)
    for n_new, prompt in [(60, [int(t) for t in period[:6]]), (7, [1, 2]), (1, [5]), (45, list(range(24)) + [0] * 6)]:
        greedy = generate(model, prompt, max_new_tokens=n_new, temperature=0, mode="cache")
        spec = generate(model, prompt, max_new_tokens=n_new, temperature=0, mode="speculative")
        assert spec.ids == greedy.ids, (which, n_new)
        assert spec.drafted >= spec.accepted >= 0
    if which == "trained":  # drafts are right most of the time: fewer forwards than tokens
        assert spec.acceptance > 0.8 and spec.forwards < 0.7 * len(spec.ids)


@pytest.mark.parametrize("agree", [0, 1, 2])
def test_round_kernel_checks_and_drafts_where_the_round_goes_on(trained, agree):
    """One compiled call of a round: head 0's argmax at every row as NumPy's, n_ok the agreeing prefix of the
    drafts, and the next drafts (heads 1..K-1, argmax and probability) at row n_ok, as the NumPy heads say."""
    model, period = trained
    win = session._Window(model, [int(t) for t in period[:6]], "speculative")
    assert win.fast()  # the fused path, or this test tests nothing
    t1 = int(np.argmax(win.head(0)))
    n0, block = len(win.seq), [t1]
    for _ in range(2):  # drafts: head 0's own greedy tokens for the first `agree`, then a wrong one
        ref = session._Window(model, win.seq + block, "cache")
        right = int(np.argmax(ref.head(0)))
        block.append(right if len(block) <= agree else (right + 1) % TINY.vocab_size)
    h, logits, best = win.advance(block, draft=TINY.n_mtp - 1)
    assert best == [int(np.argmax(weights.linear(h[r], win.W["head.0"]))) for r in range(3)]
    n_ok = next((j for j in range(2) if best[j] != block[j + 1]), 2)
    assert n_ok == agree
    win.keep(n0 + 1 + n_ok, h[n_ok], logits[n_ok], best[n_ok], n_ok)
    for k in range(1, TINY.n_mtp):
        lk = weights.linear(h[n_ok], win.W[f"head.{k}"])
        t, conf = win.head_drafts[k - 1]
        assert t == int(np.argmax(lk)) and conf == pytest.approx(1 / np.exp(lk - lk[t]).sum(), rel=1e-5)
    other = (n_ok + 1) % 3
    win.keep(n0 + 1 + other, h[other], logits[other], best[other], other)
    assert win.head_drafts is None  # drafts made at another row are not used


def test_stop_token_and_max_new_tokens(trained):
    model, period = trained
    prompt = [int(t) for t in period[:4]]  # greedy continues the period: 9, 2, 6, ...
    for mode in ("full", "cache", "speculative"):
        g = generate(model, prompt, max_new_tokens=50, temperature=0, stop_ids=[6], mode=mode)
        assert g.stopped and g.ids == [9, 2]
        seen = []
        g = generate(model, prompt, max_new_tokens=3, temperature=0, mode=mode, on_token=seen.append)
        assert not g.stopped and g.ids == [9, 2, 6] == seen
        assert generate(model, prompt, max_new_tokens=0, temperature=0, mode=mode).ids == []


def test_bad_generation_arguments_are_user_errors():
    model = Model.init(TINY, seed=0)
    with pytest.raises(UserError, match="spec_depth"):
        generate(model, [1], temperature=0.5, mode="speculative", spec_depth=-1)
    for bad in (float("nan"), float("inf"), -1.0):
        with pytest.raises(UserError, match="temperature"):
            generate(model, [1], temperature=bad, mode="speculative")
    with pytest.raises(UserError, match="empty"):
        generate(model, [])
    with pytest.raises(UserError, match="out of range"):
        generate(model, [TINY.vocab_size])
    with pytest.raises(UserError, match="mode"):
        generate(model, [1], mode="beam")


def test_sample_token_options():
    logits = np.array([1.0, 3.0, 2.0, -1.0])
    rng = np.random.default_rng(0)
    assert sample_token(logits, temperature=0) == 1
    assert {sample_token(logits, top_k=1, rng=rng) for _ in range(20)} == {1}
    assert {sample_token(logits, top_k=2, rng=rng) for _ in range(200)} == {1, 2}
    # nucleus: p = softmax = [.087, .644, .237, .032]; top_p 0.7 keeps tokens 1 and 2 only
    assert {sample_token(logits, top_p=0.7, rng=rng) for _ in range(300)} == {1, 2}
    assert {sample_token(logits, top_p=0.5, rng=rng) for _ in range(50)} == {1}
    counts = np.bincount([sample_token(logits, temperature=1.0, rng=rng) for _ in range(4000)], minlength=4)
    p = np.exp(logits) / np.exp(logits).sum()
    assert np.allclose(counts / 4000, p, atol=0.03)


class ByteTok:
    """Stand-in tokenizer: token i < 256 is byte i, 256 is the two bytes of 'é'."""

    def token_bytes(self, i):
        return "é".encode() if i == 256 else bytes([i])


def test_stream_decoder_never_splits_a_character():
    tok = ByteTok()
    snow = list("a☃".encode())  # 'a' + three bytes
    dec = StreamDecoder(tok)
    pieces = [dec.feed(t) for t in snow + [256]] + [dec.flush()]
    assert pieces[:4] == ["a", "", "", "☃"] and "".join(pieces) == "a☃é"
    assert truncate_left([1, 2, 3], 2) == ([2, 3], 1) and truncate_left([1], 5) == ([1], 0)


def test_token_probs_examples():
    logits = np.log([1.0, 2.0, 1.0])
    assert np.allclose(token_probs(logits), [0.25, 0.5, 0.25])
    assert np.allclose(token_probs(logits, top_k=1), [0, 1, 0])
    assert np.allclose(token_probs(logits, top_p=0.6), [1 / 3, 2 / 3, 0])
    assert np.allclose(token_probs(logits, temperature=0.5), np.array([1, 4, 1]) / 6)
    rng = np.random.default_rng(0)
    assert {draw_token(np.array([0.0, 1.0, 0.0]), rng) for _ in range(50)} == {1}


def test_draw_token_is_the_inverse_cdf_of_numpy_cumsum():
    """The compiled draw picks what np.searchsorted over np.cumsum picks, for every draw (seeded sampling
    replays the texts it made before), zeros, unnormalised p and the extreme draws included."""
    rng = np.random.default_rng(1)
    for t in range(3000):
        V = int(rng.integers(1, 40))
        p = rng.random(V) * (rng.random(V) < 0.5)
        p[0] += p.sum() == 0
        p = p / p.sum() if t % 2 else p
        r = (0.0, 1 - 2.0 ** -53, rng.random())[t % 3]
        cdf = np.cumsum(p)
        want = int(min(np.searchsorted(cdf, r * cdf[-1], side="right"), V - 1))
        assert sampling._inverse_cdf(p, r) == want


# ---- speculative sampling is exact: chi-square against the enumerated plain-sampling distribution ----
def chi2_sf(x: float, df: int) -> float:
    """P(chi-square with df degrees of freedom > x): the regularized upper incomplete gamma Q(df/2, x/2)
    (series below a + 1, Lentz's continued fraction above; matches scipy.stats.chi2.sf to 1e-12)."""
    a, y = df / 2, x / 2
    if y <= 0:
        return 1.0
    log_front = -y + a * math.log(y) - math.lgamma(a)
    if y < a + 1:
        term = total = 1 / a
        n = 0
        while abs(term) > 1e-16 * abs(total):
            n += 1
            term *= y / (a + n)
            total += term
        return max(0.0, 1 - total * math.exp(log_front))
    b, c, d = y + 1 - a, 1e300, 1 / (y + 1 - a)
    f = d
    for i in range(1, 1000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = 1e-300 if abs(d) < 1e-300 else d
        c = b + an / c
        c = 1e-300 if abs(c) < 1e-300 else c
        d = 1 / d
        f *= d * c
        if abs(d * c - 1) < 1e-15:
            break
    return f * math.exp(log_front)


def test_chi2_sf_known_values():
    assert abs(chi2_sf(3.841458820694124, 1) - 0.05) < 1e-9      # the 95 % point of chi2(1)
    assert abs(chi2_sf(2 * 3.0, 2) - math.exp(-3.0)) < 1e-12       # chi2(2) is exponential: sf = exp(-x/2)
    assert abs(chi2_sf(124.3421134, 100) - 0.05) < 1e-6
    assert abs(chi2_sf(20.0, 30) - 0.9165415270653372) < 1e-9  # scipy.stats.chi2.sf(20, 30)


SPEC = Config(vocab_size=6, dim=16, n_heads=2, n_kv_heads=1, n_layers=1, ctx_len=16, ffn_hidden=24, n_mtp=3)
N_TOKENS, N_SAMPLES, PROMPT = 3, 1500, [1, 2]


@pytest.fixture(scope="module")
def spec_model():
    """A random tiny model whose heads are scaled up, so head 0 and the draft heads disagree a lot
    (draft acceptance about 0.7): many accepts and many rejections."""
    model = Model.init(SPEC, seed=0).astype(np.float64)
    for k in range(SPEC.n_mtp):
        model.params[f"heads.{k}.weight"] *= 6.0
    return model


def exact_joint(model, n_tokens: int, **sampling) -> np.ndarray:
    """The exact distribution [V^n] of plain sampling's first n_tokens tokens, by enumerating every prefix
    through model.forward (the independent reference) and token_probs."""
    seqs, probs = [list(PROMPT)], np.ones(1)
    for _ in range(n_tokens):
        logits = forward(SPEC, model.params, np.array(seqs))[0][0, :, -1]  # head 0, last position [B, V]
        probs = (probs[:, None] * np.stack([token_probs(row, **sampling) for row in logits])).reshape(-1)
        seqs = [s + [v] for s in seqs for v in range(SPEC.vocab_size)]
    return probs


def chi_square_p(model, mode: str, **kwargs) -> float:
    """Sample the first N_TOKENS tokens N_SAMPLES times (seeds 0..N-1) and return the chi-square p-value of
    their joint counts against exact_joint (cells expecting < 5 pooled into one)."""
    sampling = {k: kwargs[k] for k in ("temperature", "top_k", "top_p") if k in kwargs}
    p = exact_joint(model, N_TOKENS, **sampling)
    counts = np.zeros_like(p)
    for seed in range(N_SAMPLES):
        ids = generate(model, PROMPT, N_TOKENS, seed=seed, mode=mode, **kwargs).ids
        counts[np.ravel_multi_index(ids, (SPEC.vocab_size,) * N_TOKENS)] += 1
    expected = N_SAMPLES * p
    big = expected >= 5
    assert counts[p == 0].sum() == 0, "sampled a sequence plain sampling never produces"
    obs, exp = np.append(counts[big], counts[~big].sum()), np.append(expected[big], expected[~big].sum())
    if exp[-1] == 0:  # top-k / top-p: every small cell is impossible
        obs, exp = obs[:-1], exp[:-1]
    x = float(((obs - exp) ** 2 / exp).sum())
    return chi2_sf(x, len(obs) - 1)


@pytest.mark.parametrize("mode,kwargs", [
    ("cache", dict(temperature=1.0)),                                            # the harness itself
    ("speculative", dict(temperature=1.0, spec_depth=2)),                        # both drafts every round
    ("speculative", dict(temperature=0.8, top_k=4, top_p=0.9, spec_depth=1)),    # adjusted p and q
])
def test_speculative_sampling_has_plain_sampling_distribution(spec_model, mode, kwargs):
    """Fixed seeds, so the outcome is deterministic; under the null a threshold of 1e-4 fails 1 in 10^4
    seed sets. The wrong rules below give p-values below 1e-10 at this size."""
    assert chi_square_p(spec_model, mode, **kwargs) > 1e-4


def test_adaptive_speculative_sampling_has_plain_sampling_distribution(spec_model, monkeypatch, steady_costs):
    """The planner's own choices (forced into its `on` regime: depth 1 or 2 by the drafts' confidence)
    keep the distribution exact: depth is decided before the drafts are drawn."""
    monkeypatch.setattr(speculative.Planner, "pays", lambda self: True)
    assert chi_square_p(spec_model, "speculative", temperature=1.0) > 1e-4
    g = generate(spec_model, PROMPT, 60, temperature=1.0, seed=0, mode="speculative")
    assert g.draft_rounds > 0.5 * (g.forwards - 1)  # it did speculate


@pytest.mark.parametrize("wrong", ["reject_draws_from_p", "always_accept"])
def test_chi_square_catches_a_wrong_rule(spec_model, monkeypatch, wrong):
    """The test above has power: a classic bug in the rule makes it fail by a wide margin."""
    if wrong == "reject_draws_from_p":  # forgets to subtract q: accepted tokens get counted twice
        monkeypatch.setattr(speculative.Sampled, "residual", staticmethod(lambda p, q: p))
    else:  # never rejects: emits the draft head's distribution q
        check = speculative.Sampled.check
        monkeypatch.setattr(speculative.Sampled, "check", lambda self, logits, x, q: (True,) + check(self, logits, x, q)[1:2] + (None,))
    assert chi_square_p(spec_model, "speculative", temperature=1.0, spec_depth=2) < 1e-4


def test_speculative_sampling_drafts_on_a_trained_model(trained, steady_costs):
    """At temperature 0.8 the adaptive planner drafts on the periodic model and most drafts are accepted."""
    model, period = trained
    g = generate(model, [int(t) for t in period[:6]], 80, temperature=0.8, seed=0, mode="speculative")
    assert len(g.ids) == 80 and g.acceptance > 0.6 and g.forwards < 0.7 * len(g.ids)


# ---- the planner: drafts only where they pay ---------------------------------------------------------
class FakeWindow:
    def head(self, k):
        return np.zeros(3)


class FakeRule:
    """Proposes drafts with fixed confidences."""

    def __init__(self, confs):
        self.confs = confs

    def propose_draft(self, win, j):
        return 0, self.confs.pop(0)


def planner(r1: float, r2: float = 0.3) -> "speculative.Planner":
    """The docstring's example: 1.0 ms a plain step, 1.2 / 1.45 ms for 1 / 2 drafts back to back, 1.6 / 1.9 ms
    for a lone verification among plain steps; acceptance r1, r2 in every confidence bin and on average."""
    plan = speculative.Planner(2)
    plan.cost = [[1.0e-3, 1.6e-3, 1.9e-3], [1.0e-3, 1.2e-3, 1.45e-3]]
    plan.samples[0][0] = [1.0e-3] * 5  # enough plain steps timed to decide
    plan.hits, plan.seen = [[r1] * 4, [r2] * 4], [[1.0] * 4, [1.0] * 4]
    plan.avg = [[r1, 1.0], [r2, 1.0]]
    return plan


@pytest.mark.parametrize("r1,on", [(0.5, True), (0.45, True), (0.3, False), (0.0, False)])
def test_planner_speculates_where_back_to_back_rounds_pay(r1, on):
    """r1 = .45 does not pay for a lone verification (1.45/1.6 < 1) but does round after round (1.45/1.2 =
    1.21 > 1.15); r1 = .3 does not pay enough (1.3/1.2 = 1.08 < 1.15)."""
    plan = planner(r1)
    assert plan.pays() is on
    if on:  # not before 5 plain steps were timed
        plan.samples[0][0] = plan.samples[0][0][:4]
        assert not plan.pays()
        plan.samples[0][0].append(1.0e-3)
    props, d = plan.choose(FakeWindow(), FakeRule([0.5, 0.5]), room=10, probe=False)
    assert (d >= 1) is on and len(props) >= d
    if not on:
        assert props == []  # off: not even looked at


@pytest.mark.parametrize("r1,depth", [(0.5, 1), (0.95, 2)])
def test_planner_picks_the_depth_worth_most(r1, depth):
    """r1, r2 = .5, .3: 1.5/1.2 = 1.25 > 1.65/1.45 = 1.14 -> 1 draft; r1, r2 = .95, .9: 1.95/1.2 = 1.63 <
    2.805/1.45 = 1.93 -> 2 drafts."""
    plan = planner(r1, 0.9 if depth == 2 else 0.3)
    _, d = plan.choose(FakeWindow(), FakeRule([0.5, 0.5]), room=10, probe=False)
    assert d == depth
    _, d = plan.choose(FakeWindow(), FakeRule([0.5, 0.5]), room=1, probe=False)
    assert d == 1  # the window has room for one draft only
    assert plan.choose(FakeWindow(), FakeRule([]), room=0, probe=True) == ([], 0)  # no room at all


def test_planner_probes_in_bursts_while_off():
    plan = planner(0.0)
    assert plan.choose(FakeWindow(), FakeRule([]), room=10, probe=False) == ([], 0)
    for _ in range(speculative.Planner.BURST):  # a probe: this round and the next two verify a draft
        props, d = plan.choose(FakeWindow(), FakeRule([0.5]), room=10, probe=False if _ else True)
        assert d == 1 and len(props) == 1
    assert plan.choose(FakeWindow(), FakeRule([]), room=10, probe=False) == ([], 0)


def test_speculation_falls_back_to_plain_steps_on_a_random_model(steady_costs, monkeypatch):
    """The draft heads of a random model are never right: after a few rounds only the probes verify any.
    (Lookup drafts off: this model's greedy text repeats itself, which they catch, next test.)"""
    monkeypatch.setattr(speculative.Greedy, "NGRAM", 10 ** 6)  # no context ever matches
    model = Model.init(TINY, seed=3)
    g = generate(model, [1, 2, 3], 200, temperature=0, mode="speculative")
    assert g.acceptance < 0.2
    assert g.draft_rounds < 10 + 200 / 16
    # probes back off while drafts keep not paying: rounds 8, 136, 392, 904, 1928 (not every 128: 15 probes)
    g = generate(model, [1, 2, 3], 2000, temperature=0, mode="speculative")
    assert g.acceptance < 0.2 and g.draft_rounds <= 3 * 5


def test_lookup_drafts_catch_repeating_text(steady_costs):
    """The same random model's greedy text falls into a 4-token loop: drafts looked up in the text are
    accepted, speculation switches on, and the output is still plain greedy's token for token."""
    model = Model.init(TINY, seed=3)
    plain = generate(model, [1, 2, 3], 200, temperature=0, mode="cache")
    g = generate(model, [1, 2, 3], 200, temperature=0, mode="speculative")
    assert g.ids == plain.ids and g.ids[100:104] == g.ids[104:108]
    assert g.acceptance > 0.8 and g.forwards < 0.7 * len(g.ids)
    assert g.drafted > (TINY.n_mtp - 1) * g.draft_rounds  # rounds verify more drafts than the K - 1 heads make


def test_lookup_finds_the_last_occurrence():
    """(the last NGRAM-1 tokens, t1) -> the tokens after its last occurrence; none -> []; indexed incrementally."""
    class Win:
        cfg, start = tiny_config(n_mtp=3), 0
    rule, win = speculative.Greedy(), Win()
    assert kernels.ROWS - 1 == 7  # drafts a lookup gives at most: what one verification takes
    win.seq = [7, 3, 9, 4, 5, 7, 3, 9, 6, 1, 2, 4, 4, 4, 4, 4, 7, 3]
    rule.prepare(win, 9)
    assert rule.lookup(win) == [6, 1, 2, 4, 4, 4, 4]  # after the later of the two (7, 3, 9)
    rule.prepare(win, 8)
    assert rule.lookup(win) == []
    win.seq += [8, 0, 2, 7, 3]
    rule.prepare(win, 8)
    assert rule.lookup(win) == [0, 2, 7, 3, 8, 0, 2]  # found among the tokens added since; 5 back: a loop
    #                                                 (of period 5) runs on into this round's own tokens
