"""Generation: the KV-cache forward equals full recomputation, cache and speculative decoding give the
same tokens as the slow reference, prompt-lookup drafts are found and verified in one call, sampling
options behave, the stream decoder never splits a character."""
import numpy as np
import pytest

from nanoeuler import Config, Model, UserError, ops
from nanoeuler.infer import kernels, sampling, session, speculative, step, weights
from nanoeuler.infer.cache import new_cache
from nanoeuler.infer.sampling import draw_token, sample_token, token_probs
from nanoeuler.infer.session import generate, StreamDecoder, truncate_left
from nanoeuler.infer.step import forward_cached
from nanoeuler.model import forward
from nanoeuler.optim import AdamW
from conftest import rel_err, tiny_config

TINY = tiny_config(vocab_size=24, dim=32, n_heads=4, n_kv_heads=2, n_layers=2, ctx_len=32, ffn_hidden=48, n_mtp=3)


@pytest.fixture(scope="module")
def trained():
    """A tiny model trained on a periodic sequence: its greedy text repeats, so lookup drafts are accepted."""
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


def rss_kib() -> int:
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS:")).split()[1])


def test_a_new_cache_takes_memory_as_positions_are_written():
    """A cache for a long context costs what its written positions hold: decoding a 3-token prompt into a cache
    of 8,192 positions (32 MiB of keys and values here) makes a few of its pages resident, not all (np.zeros'
    huge pages made all of SmolLM2's 360 MiB resident at the first token)."""
    cfg = Config(vocab_size=64, dim=64, n_heads=2, n_kv_heads=2, n_layers=8, ctx_len=8192, ffn_hidden=128, n_mtp=1)
    model = Model.init(cfg, seed=0)
    W = step.fuse_weights(cfg, model.params)
    for _ in range(2):  # the kernels loaded and their threads started
        step.forward_hidden(cfg, W, np.array([[1, 2, 3]]), new_cache(cfg, 1))
    grew = []
    for _ in range(2):  # the smaller of two growths: a page the allocator takes meanwhile is not the cache's
        cache = new_cache(cfg, 1)
        store = sum(a.nbytes for a in cache.store[:2]) // 1024
        before = rss_kib()
        step.forward_hidden(cfg, W, np.array([[1, 2, 3]]), cache)
        grew.append(rss_kib() - before)
    assert cache.length == 3 and min(grew) < store // 8, (grew, store)


@pytest.mark.parametrize("fused", [True, False], ids=["kernels", "numpy"])
def test_rope_tables_grow_as_positions_are_reached(fused, monkeypatch):
    """A cache makes its RoPE tables for the positions reached, doubling as the sequence grows (Gemma 3's
    32,768 positions held 64 MiB of tables for any reply): a prompt of 200 then 100 more tokens in a cache
    of 1,024 positions makes tables of 256, then 512 positions, and the logits equal full recomputation,
    the positions past the first table included."""
    cfg = tiny_config(vocab_size=24, dim=32, n_heads=4, n_kv_heads=2, n_layers=2, ctx_len=1024, ffn_hidden=48)
    model = Model.init(cfg, seed=2)
    monkeypatch.setattr(kernels, "ENABLED", fused)
    W = step.fuse_weights(cfg, model.params)
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, (1, 300))
    cache = new_cache(cfg)
    assert cache.rope.tables[0].shape[1] == 0
    got = [forward_cached(cfg, model.params, ids[:, :200], cache, fused=W)]
    assert cache.rope.tables[0].shape[1:] == (256, cfg.head_dim // 2)
    got.append(forward_cached(cfg, model.params, ids[:, 200:], cache, fused=W))
    assert cache.rope.tables[0].shape[1] == 512
    cos, sin = ops.rope_tables(512, cfg.layer_freqs(0), np.float32)
    assert np.array_equal(cache.rope.tables[0][0], cos) and np.array_equal(cache.rope.tables[1][0], sin)
    assert rel_err(np.concatenate(got, axis=2), forward(cfg, model.params, ids)[0]) <= 1e-5
    assert new_cache(cfg, max_len=100).rope.upto(90)[0].shape[1] == 100  # never past the cache's positions


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
def test_speculative_equals_greedy_token_for_token(which, trained):
    model, period = trained
    if which == "random":
        model = Model.init(TINY, seed=3)
    for n_new, prompt in [(60, [int(t) for t in period[:6]]), (7, [1, 2]), (1, [5]), (45, list(range(24)) + [0] * 6)]:
        greedy = generate(model, prompt, max_new_tokens=n_new, temperature=0, mode="cache")
        for depth in (None, 1, 7):
            spec = generate(model, prompt, max_new_tokens=n_new, temperature=0, mode="speculative",
                            spec_depth=depth)
            assert spec.ids == greedy.ids, (which, n_new, depth)
            assert spec.drafted >= spec.accepted >= 0
            assert spec.drafted <= (depth or speculative.DEPTH) * spec.draft_rounds
    spec = generate(model, [int(t) for t in period[:6]], max_new_tokens=60, temperature=0, mode="speculative")
    if which == "trained":  # the text repeats, the drafts are right: fewer forwards than tokens
        assert spec.acceptance > 0.8 and spec.forwards < 0.5 * len(spec.ids)


@pytest.mark.parametrize("agree", [0, 1, 2])
def test_round_kernel_checks_every_row(trained, agree):
    """One compiled call of a round: head 0's logits at every row as a plain step gives them after the same
    tokens, their argmax as NumPy's; `keep` rolls back to the agreeing prefix, and the next step there is
    what plain decoding computes."""
    model, period = trained
    win = session._Window(model, [int(t) for t in period[:6]], "speculative")
    assert step.runs_fused(win.W, win.cache)  # the fused path, or this test tests nothing
    seq0, block, refs = list(win.seq), [win.argmax()], []
    for _ in range(2):  # drafts: head 0's own greedy tokens for the first `agree`, then a wrong one
        refs.append(session._Window(model, win.seq + block, "cache"))
        right = refs[-1].argmax()
        block.append(right if len(block) <= agree else (right + 1) % TINY.vocab_size)
    h, logits, best = win.advance(block)
    assert best == [int(np.argmax(weights.linear(h[r], win.W["head.0"]))) for r in range(3)]
    for r in range(2):
        assert rel_err(logits[r], refs[r].head0()) < 1e-5
    n_ok = next((j for j in range(2) if best[j] != block[j + 1]), 2)
    assert n_ok == agree
    win.keep(len(seq0) + 1 + n_ok, h[n_ok], logits[n_ok], best[n_ok])
    assert win.seq == seq0 + block[:n_ok + 1] and win.cache.length == len(win.seq)
    win.feed(best[n_ok])
    ref = session._Window(model, win.seq, "cache")
    assert win.argmax() == ref.argmax() and rel_err(win.head0(), ref.head0()) < 1e-5


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
    for bad in (-1, speculative.MOST + 1):
        with pytest.raises(UserError, match="spec_depth"):
            generate(model, [1], temperature=0, mode="speculative", spec_depth=bad)
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


def test_speculative_sampling_is_plain_sampling(trained):
    """At temperature > 0 "speculative" samples plainly: a seed gives the tokens of "cache", on text where
    greedy decoding finds lookup drafts."""
    model, period = trained
    for seed in range(3):
        kw = dict(temperature=0.8, top_k=8, seed=seed)
        spec = generate(model, [int(t) for t in period[:6]], 40, mode="speculative", **kw)
        assert spec.ids == generate(model, [int(t) for t in period[:6]], 40, mode="cache", **kw).ids
        assert spec.drafted == 0


def test_rounds_without_a_lookup_are_plain_steps(monkeypatch):
    """Where the last NGRAM tokens never occurred, nothing is drafted: one forward a token, as plain decoding."""
    monkeypatch.setattr(speculative, "NGRAM", 10 ** 6)  # no context ever matches
    model = Model.init(TINY, seed=3)
    g = generate(model, [1, 2, 3], 50, temperature=0, mode="speculative")
    assert g.ids == generate(model, [1, 2, 3], 50, temperature=0, mode="cache").ids
    assert g.drafted == g.draft_rounds == 0 and g.forwards == 50  # the prefill, then a step per token but the last


def test_lookup_drafts_catch_repeating_text():
    """A random model's greedy text falls into a 4-token loop: drafts looked up in the text are accepted,
    a loop drafts whole rounds, and the output is still plain greedy's token for token."""
    model = Model.init(TINY, seed=3)
    plain = generate(model, [1, 2, 3], 200, temperature=0, mode="cache")
    g = generate(model, [1, 2, 3], 200, temperature=0, mode="speculative")
    assert g.ids == plain.ids and g.ids[100:104] == g.ids[104:108]
    assert g.acceptance > 0.8 and g.forwards < 0.4 * len(g.ids)
    g = generate(model, [1, 2, 3], 200, temperature=0, mode="speculative", spec_depth=speculative.MOST)
    assert g.ids == plain.ids and g.drafted > 4 * g.draft_rounds  # a loop of period 4 runs on past one period


def test_lookup_finds_the_last_occurrence():
    """(the last NGRAM-1 tokens, t1) -> the tokens after its last occurrence; none -> []; indexed incrementally."""
    look, seq = speculative.Lookup(), [7, 3, 9, 4, 5, 7, 3, 9, 6, 1, 2, 4, 4, 4, 4, 4, 7, 3]
    assert speculative.MOST == kernels.ROWS - 1 == 7  # drafts a round verifies at most: one call's rows
    assert look.drafts(seq, 0, 9, 7) == [6, 1, 2, 4, 4, 4, 4]  # after the later of the two (7, 3, 9)
    assert look.drafts(seq, 0, 9, 2) == [6, 1]
    assert look.drafts(seq, 0, 8, 7) == []
    seq += [8, 0, 2, 7, 3]
    assert look.drafts(seq, 0, 8, 7) == [0, 2, 7, 3, 8, 0, 2]  # found among the tokens added since; 5 back: a
    #                                                          loop (of period 5) runs on into this round's tokens
    assert speculative.Lookup().drafts(seq, 9, 9, 7) == []  # (7, 3, 9) occurred before the window only
