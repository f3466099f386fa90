"""Generation: the KV-cache forward equals full recomputation, cache and speculative decoding give the
same tokens as the slow reference, sampling options behave, the stream decoder never splits a character."""
import numpy as np
import pytest

from nanoeuler import Config, Model, UserError
from nanoeuler.generate import StreamDecoder, forward_cached, generate, new_cache, sample_token, truncate_left
from nanoeuler.model import forward
from nanoeuler.optim import AdamW

TINY = Config(vocab_size=24, dim=32, n_heads=4, n_kv_heads=2, n_layers=2, ctx_len=32, ffn_hidden=48, n_mtp=3)


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
    assert np.max(np.abs(got - full)) <= tol
    last = forward_cached(TINY, model.params, ids[:, :20], new_cache(TINY, 2, dtype=dtype), last_only=True)
    assert np.max(np.abs(last[:, :, 0] - full[:, :, -1])) <= tol


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
def test_speculative_equals_greedy_token_for_token(which, trained):
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
    with pytest.raises(UserError, match="greedy"):
        generate(model, [1], temperature=0.5, mode="speculative")
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
