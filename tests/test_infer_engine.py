"""The continuous-batching engine (nanoeuler/infer/engine.py): a request's greedy tokens are the same alone,
in a batch with others that join and leave at different steps, and as `generate` makes them (window jumps
included); seeded sampling equals `generate` with that seed; logits agree to float32 rounding; cancelled
jobs free their rows; the queue is bounded."""
import numpy as np
import pytest

from nanoeuler import Config, Model
from nanoeuler.infer import engine, step
from nanoeuler.infer.cache import new_cache
from nanoeuler.infer.cache import rows
from nanoeuler.infer.engine import BadJob, Batcher, Closed, Job, QueueFull
from nanoeuler.infer.forward import forward_rows
from nanoeuler.infer.sampling import log_softmax, top_logprobs
from nanoeuler.infer.session import generate
from nanoeuler.infer.step import forward_cached
from nanoeuler.optim import AdamW

CFG = Config(vocab_size=40, dim=32, n_heads=4, n_kv_heads=2, n_layers=2, ctx_len=24, ffn_hidden=48, n_mtp=2)


@pytest.fixture(scope="module")
def trained():
    """Trained on a periodic sequence with noise-free structure: clear argmax margins."""
    model = Model.init(CFG, seed=0)
    period = np.array([3, 1, 4, 15, 9, 2, 6, 5, 35, 5, 8, 7, 20, 11, 30, 22, 17])
    opt = AdamW(model.params, lr=1e-2, weight_decay=0.0)
    rng = np.random.default_rng(0)
    for _ in range(80):
        starts = rng.integers(0, len(period), 8)
        _, _, grads = model.loss_and_grads(np.stack([np.resize(np.roll(period, -s), 20 + CFG.n_mtp) for s in starts]))
        opt.step(model.params, grads)
    return model


class Collect:
    """on_event for a job: records tokens, the end reason or engine error, and how many times the job ended."""

    def __init__(self):
        self.tokens, self.reason, self.prompt, self.error, self.ends = [], None, None, None, 0

    def __call__(self, kind, *args):
        if kind == "token":
            self.tokens.append(args[0])
        elif kind == "done":
            self.reason = args[0]
        elif kind == "prompt":
            self.prompt = args[0]
        elif kind == "error":
            self.error = args[0]
        self.ends += kind in ("done", "error")


class Scored(Collect):
    """Collect, and every token's (id, logprob, top) as the engine reported it."""

    def __init__(self):
        super().__init__()
        self.scores = []

    def __call__(self, kind, *args):
        super().__call__(kind, *args)
        if kind == "token":
            self.scores.append(args)


def alone(model, spec) -> Scored:
    """The events of one job run by itself in a one-row engine."""
    out, b = Scored(), Batcher(model, max_batch=1)
    b.submit(Job(on_event=out, **spec))
    while b.step():
        pass
    return out


def run_jobs(model, specs, max_batch=8, join_at=None, **engine):
    """specs: list of Job kwargs; join_at[i]: the engine step before which job i is submitted; engine: more
    Batcher arguments."""
    b = Batcher(model, max_batch=max_batch, max_queue=64, **engine)
    outs = [Collect() for _ in specs]
    join_at = join_at or [0] * len(specs)
    step = 0
    while True:
        for i, spec in enumerate(specs):
            if join_at[i] == step:
                b.submit(Job(on_event=outs[i], **spec))
        busy = b.step()
        step += 1
        if not busy and step > max(join_at):
            break
    return outs, b


def prompts(n, seed=0, lengths=(1, 3, 7, 12, 24, 30)):
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(0, CFG.vocab_size, lengths[i % len(lengths)])] for i in range(n)]


GPT2 = Config(vocab_size=40, dim=32, n_heads=4, n_kv_heads=4, n_layers=2, ctx_len=24, ffn_hidden=64, n_mtp=1,
              arch="gpt2")


@pytest.mark.parametrize("which", ["trained", "random", "gpt2"])
def test_greedy_alone_equals_batched_equals_generate(trained, which):
    model = {"trained": trained, "random": Model.init(CFG, seed=5), "gpt2": Model.init(GPT2, seed=5)}[which]
    ps = prompts(6)
    specs = [dict(ids=p, max_tokens=40) for p in ps]  # 40 > ctx 24: every row's window jumps at least once
    batched, b = run_jobs(model, specs, max_batch=4, join_at=[0, 0, 3, 5, 9, 9])
    assert max(b.batch_sizes) == 4 and min(b.batch_sizes) < 4  # rows really were shared, and came and went
    for p, out in zip(ps, batched):
        alone, _ = run_jobs(model, [dict(ids=p, max_tokens=40)], max_batch=1)
        ref = generate(model, p, 40, temperature=0, mode="cache")
        assert out.tokens == alone[0].tokens == ref.ids
        assert out.reason == "length"


def test_a_window_shorter_than_the_models_context_is_generate_at_that_context(trained):
    """Batcher(ctx_len=12) on a ctx-24 model: its rows hold 12 positions, prompts keep their last 12 tokens and
    replies slide their window as `generate` does for a model whose context is 12."""
    short = Model(CFG.replace(ctx_len=12), trained.params)
    ps = prompts(4)
    outs, b = run_jobs(trained, [dict(ids=p, max_tokens=30) for p in ps], max_batch=2, ctx_len=12)
    assert b.cache.max_len == 12
    for p, out in zip(ps, outs):
        assert out.tokens == generate(short, p, 30, temperature=0, mode="cache").ids
    with pytest.raises(ValueError, match="ctx_len"):
        Batcher(trained, ctx_len=CFG.ctx_len + 1)


@pytest.mark.parametrize("ctx", [1, 2, 3])
def test_a_window_of_a_few_positions_slides_and_the_job_ends(trained, ctx):
    """A full window's jump keeps at least its newest token (ctx // 2 kept nothing at ctx 1: the row refilled
    its whole sequence at every step and never decoded, `serve --ctx 1` spun without answering, and
    `generate` at a context of 1 ran the model on no tokens). The job ends within a bounded number of steps
    with the tokens `generate` makes at that context, in every mode."""
    short, p = Model(CFG.replace(ctx_len=ctx), trained.params), [3, 1, 4, 15, 9]
    b, out = Batcher(trained, max_batch=2, ctx_len=ctx), Collect()
    b.submit(Job(ids=p, max_tokens=8, on_event=out))
    for _ in range(200):
        if not b.step():
            break
    assert out.reason == "length" and len(out.tokens) == 8
    for mode in ("cache", "full", "speculative"):
        assert generate(short, p, 8, temperature=0, mode=mode).ids == out.tokens, mode


def test_the_prefix_cache_changes_no_token_or_logprob_and_computes_less(trained):
    """Requests one after another, as clients send them: a prompt, its next turn (the prompt, the reply, more),
    the first again sampled with a seed, a request of 4 seeded choices (its prompt computed once), a prompt
    that leaves the cached one mid-block, a reply whose window jumps, and an echo that scores its prompt.
    With a prefix cache every event is the same bits as without, and far fewer positions are computed."""
    model = Model(CFG.replace(ctx_len=128), trained.params)
    rng = np.random.default_rng(11)
    p, q, p2 = ([int(t) for t in rng.integers(0, CFG.vocab_size, n)] for n in (40, 10, 50))

    def serve(prefix_bytes):
        b, outs = Batcher(model, max_batch=4, prefill_tokens=24, prefix_bytes=prefix_bytes), []

        def send(*specs):
            group = object()
            outs.append([Scored() for _ in specs])
            for spec, out in zip(specs, outs[-1]):
                b.submit(Job(on_event=out, group=group, **spec))
            while b.step():
                pass
            return outs[-1]
        first = send(dict(ids=p, max_tokens=20, logprobs=3))[0]
        send(dict(ids=p + first.tokens + q, max_tokens=20, logprobs=3))
        send(dict(ids=p, max_tokens=20, temperature=1.0, seed=5, logprobs=2))
        before = b.prefilled
        send(*[dict(ids=p2, max_tokens=12, temperature=0.8, seed=i, logprobs=1) for i in range(4)])
        n_choices = b.prefilled - before
        send(dict(ids=p + first.tokens[:7], max_tokens=10, logprobs=1))
        send(dict(ids=p + first.tokens + q, max_tokens=150, logprobs=1))  # past 128 positions: a jump
        send(dict(ids=p, max_tokens=2, logprobs=2, echo=True))
        return [[(o.tokens, o.scores, o.prompt, o.reason) for o in group] for group in outs], b, n_choices
    cold, b0, _ = serve(0)
    warm, b1, n_choices = serve(1 << 20)
    assert warm == cold
    assert b0.hits == 0 and b1.hits == 7 and b1.prefilled + b1.reused == b0.prefilled  # (all but 3 jobs hit)
    assert b1.prefilled < b0.prefilled / 2
    assert n_choices <= len(p2) + 3 * (len(p2) % 16 or 16)  # the 4 choices' prompt: once, and each its tail
    assert b1.stats()["prefix_cache"]["bytes"] == len(b1.prefixes) * b1.prefixes.block_bytes > 0


def test_wider_batches_than_the_fused_rows_keep_every_bit(trained):
    """More streams than kernels.ROWS still decode in the fused step, one prompt at a time prefilled through it:
    a request's logprobs are the same bits alone as among 12 others that join at different steps."""
    from nanoeuler.infer import kernels
    ps = prompts(12, seed=3)
    specs = [dict(ids=p, max_tokens=30, logprobs=1) for p in ps]
    outs = [Scored() for _ in specs]
    b = Batcher(trained, max_batch=12)
    for i, (spec, out) in enumerate(zip(specs, outs)):
        b.submit(Job(on_event=out, **spec))
        b.step() if i % 4 == 3 else None
    while b.step():
        pass
    assert max(b.batch_sizes) > kernels.ROWS and "decode" in b.W
    for spec, out in zip(specs, outs):
        assert out.scores == alone(trained, spec).scores


def test_a_float16_model_decodes_in_the_batcher(trained):
    """Float16 weights (weights.Float16Model) with a float32 cache, as generate keeps it: a batch wider than the
    fused rows gives each request generate's greedy tokens."""
    from nanoeuler.infer.weights import Float16Model
    m16 = Float16Model(trained)
    ps = prompts(10, seed=4)
    outs, b = run_jobs(m16, [dict(ids=p, max_tokens=12) for p in ps], max_batch=10)
    assert max(b.batch_sizes) == 10 and b.cache.store[0].dtype == np.float32
    for p, out in zip(ps, outs):
        assert out.tokens == generate(m16, p, 12, temperature=0, mode="cache").ids and out.reason == "length"


def test_seeded_sampling_equals_generate():
    model = Model.init(CFG, seed=5)  # untrained: sampling has real choices to make
    ps = prompts(4, seed=1)
    specs = [dict(ids=p, max_tokens=30, temperature=0.9, top_p=0.95, top_k=20, seed=10 + i) for i, p in enumerate(ps)]
    outs, _ = run_jobs(model, specs)
    for spec, out in zip(specs, outs):
        ref = generate(model, spec["ids"], 30, temperature=0.9, top_k=20, top_p=0.95, seed=spec["seed"])
        assert out.tokens == ref.ids
    assert len({tuple(o.tokens) for o in outs}) > 1


def test_decode_step_logits_match_the_single_row_cache(trained):
    """Rows at different lengths in one step: each row's logits equal forward_cached run on it alone."""
    W_model = trained
    b = Batcher(W_model, max_batch=3)
    seqs = [[1, 2, 3, 4, 5], [7], [9, 8, 7, 6, 5, 4, 3, 2, 1]]
    for r, s in enumerate(seqs):
        step.forward_hidden(CFG, b.W, np.array([s[:-1]]), rows(b.cache, r, 1)) if len(s) > 1 else None
    tokens = np.array([s[-1] for s in seqs])
    pos = np.array([len(s) - 1 for s in seqs])
    h = forward_rows(CFG, b.W, b.cache, tokens, pos)
    got = h @ W_model.params["heads.0.weight"].T  # [3, V]
    for r, s in enumerate(seqs):
        ref = forward_cached(CFG, W_model.params, np.array([s]), new_cache(CFG))[0, 0, -1]
        np.testing.assert_allclose(got[r], ref, rtol=1e-4, atol=1e-5)


def test_stop_ids_max_tokens_and_zero_tokens(trained):
    p = prompts(1)[0]
    ref = generate(trained, p, 12, temperature=0).ids
    stop = ref[4]
    outs, _ = run_jobs(trained, [dict(ids=p, max_tokens=12, stop_ids=(stop,)), dict(ids=p, max_tokens=3),
                                 dict(ids=p, max_tokens=0)])
    first = ref.index(stop)
    assert outs[0].tokens == ref[:first + 1] and outs[0].reason == "stop"  # the stop token is reported, then done
    assert outs[1].tokens == ref[:3] and outs[1].reason == "length"
    assert outs[2].tokens == [] and outs[2].reason == "length"


@pytest.mark.parametrize("together, chunk", [(1, 64), (3, 64), (3, 2)])
def test_echo_logprobs_score_the_prompt(trained, together, chunk):
    """Alone, beside prompts of other lengths, and prefilled a few tokens a step (chunk: prefill_tokens)."""
    ps = [[3, 1, 4, 15, 9, 2, 6], [5, 8], [7, 20, 11, 30, 22, 17]][:together]
    outs, _ = run_jobs(trained, [dict(ids=p, max_tokens=1, logprobs=2, echo=True) for p in ps], prefill_tokens=chunk)
    for p, out in zip(ps, outs):
        scored = out.prompt
        logits = forward_cached(CFG, trained.params, np.array([p]), new_cache(CFG))[0, 0]  # [T, V]
        logp = log_softmax(logits)
        assert [t for t, _, _ in scored] == p and scored[0][1] is None
        for i in range(1, len(p)):
            assert scored[i][1] == pytest.approx(logp[i - 1, p[i]], abs=1e-5)
            assert [t for t, _ in scored[i][2]] == list(np.argsort(-logp[i - 1])[:2])
        assert out.tokens == [int(np.argmax(logits[-1]))]


def test_prefill_is_chunked_and_shared_between_requests(trained):
    """Each request prefills up to prefill_tokens prompt tokens a step: a long prompt goes in over several
    steps, and a short one that arrives meanwhile is in, and has its first token, at the next step. Both
    outputs are the ones they have alone."""
    long_ids, short_ids = prompts(2, seed=7, lengths=(20, 2))
    b = Batcher(trained, max_batch=4, prefill_tokens=8)
    long, short = Collect(), Collect()
    b.submit(Job(ids=long_ids, max_tokens=5, on_event=long))
    b.step()
    assert b.slots[b.n_dec].filled == 8 and not long.tokens  # 8 of its 20 tokens
    b.submit(Job(ids=short_ids, max_tokens=5, on_event=short))
    b.step()
    assert len(short.tokens) == 1 and b.slots[b.n_dec].filled == 16  # the short prompt's 2 tokens, the long one's 8
    while b.step():
        pass
    for ids, out in ((long_ids, long), (short_ids, short)):
        assert out.tokens == generate(trained, ids, 5, temperature=0, mode="cache").ids and out.reason == "length"


def held(b) -> dict:
    """Rows each request (job.group) holds."""
    from collections import Counter
    return dict(Counter(s.job.group for s in b.slots if s is not None))


def test_a_short_request_beside_a_big_one_starts_at_once_and_ends_first(trained):
    """One request of 8 long jobs holds every row; a short request that arrives gets a row at the next step
    (one of the big request's rows is parked) and finishes while every big job is still running. Each job's
    tokens and logprobs are the bits it makes alone: a parked row resumes exactly where it stopped."""
    ps = prompts(9, seed=5)
    specs = [dict(ids=p, max_tokens=30, logprobs=2, group="big") for p in ps[:8]]
    b = Batcher(trained, max_batch=4)
    big = [Scored() for _ in specs]
    for spec, out in zip(specs, big):
        b.submit(Job(on_event=out, **spec))
    for _ in range(3):
        b.step()
    assert held(b) == {"big": 4} and b.n_dec == 4
    short_spec, short = dict(ids=ps[8], max_tokens=5, logprobs=2, group="short"), Scored()
    b.submit(Job(on_event=short, **short_spec))
    b.step()
    assert len(short.tokens) == 1 and held(b) == {"big": 3, "short": 1} and b.stats()["parked"] == 1
    while short.reason is None:
        b.step()
    assert short.reason == "length" and all(o.reason is None for o in big)
    while b.step():
        pass
    assert b.stats()["parked"] == 0 and "decode" in b.W
    for spec, out in zip(specs + [short_spec], big + [short]):
        assert out.scores == alone(trained, spec).scores and out.reason == "length"


def test_the_largest_request_feeds_its_share_of_rows_a_step_while_another_holds_one(trained):
    """A request of 11 jobs holds 11 of 12 rows; while a short request holds the 12th, each step feeds at most
    engine.ROWS_BESIDE of the big request's rows (the short one's every step), round robin: every big row is fed
    within ceil(11 / ROWS_BESIDE) steps. Alone again, the big request feeds every row. Every job's greedy
    tokens equal generate's (rows fed out of slot order write and read their own cache rows)."""
    ps = prompts(12, seed=7)
    b = Batcher(trained, max_batch=12)
    outs = [Collect() for _ in ps]
    for p, out in zip(ps[:11], outs):
        b.submit(Job(ids=p, max_tokens=60, group="big", on_event=out))
    while b.n_dec < 11:
        b.step()
    b.submit(Job(ids=ps[11], max_tokens=20, group="short", on_event=outs[11]))
    share = engine.ROWS_BESIDE
    while outs[11].reason is None:
        b.step()
        if outs[11].tokens:
            assert b.batch_sizes[-1] <= share + 1
            for s in b.slots[:b.n_dec]:
                assert b.steps - 1 - s.decoded_at < -(-11 // share)  # fed within the last ceil(11/share) steps
    assert outs[11].tokens and all(o.reason is None for o in outs[:11])
    b.step()
    b.step()
    assert b.batch_sizes[-1] == 11
    while b.step():
        pass
    for p, out in zip(ps, outs):
        assert out.tokens == generate(trained, p, 60 if out is not outs[11] else 20, temperature=0, mode="cache").ids


def test_rows_are_shared_max_min_between_requests(trained):
    """Requests hold rows within one of each other (a request that needs fewer leaves the rest to the others);
    parked rows never exceed max_batch; a parked job that is cancelled ends at the next step. Every job's
    greedy tokens equal generate's."""
    ps = prompts(21, seed=6)
    b = Batcher(trained, max_batch=5)
    outs = [Collect() for _ in ps]
    jobs = [Job(ids=p, max_tokens=40, group="abc"[min(i // 10, 2)], on_event=out)
            for i, (p, out) in enumerate(zip(ps, outs))]
    for job in jobs[:10]:
        b.submit(job)
    b.step()
    assert held(b) == {"a": 5}
    for job in jobs[10:20]:
        b.submit(job)
    b.step()
    assert held(b) == {"a": 3, "b": 2}
    b.submit(jobs[20])
    b.step()
    assert held(b) == {"a": 2, "b": 2, "c": 1}
    parked = [s.job for g in b.groups.values() for s in g.waiting if s.saved is not None]
    assert parked and b.stats()["parked"] == len(parked)
    parked[0].cancel()
    b.step()
    assert outs[jobs.index(parked[0])].reason == "cancelled"
    while b.step():
        assert b.stats()["parked"] <= b.max_batch
    for p, job, out in zip(ps, jobs, outs):
        if job is not parked[0]:
            assert out.tokens == generate(trained, p, 40, temperature=0, mode="cache").ids and out.ends == 1


def test_the_queue_counts_requests_not_jobs(trained):
    """max_queue bounds the requests waiting, so one request of many jobs does not fill the queue for every
    other client: its jobs all join it."""
    b = Batcher(trained, max_batch=1, max_queue=2)
    for group in ("a", "b"):
        for _ in range(5):
            b.submit(Job(ids=[1, 2], max_tokens=1, group=group))
    with pytest.raises(QueueFull, match="2 requests are already waiting"):
        b.submit(Job(ids=[3], max_tokens=1))
    b.submit(Job(ids=[4], max_tokens=1, group="a"))  # a request that already waits takes more jobs
    assert b.stats()["queued"] == 11


def test_cancel_frees_the_row_at_the_next_step(trained):
    b = Batcher(trained, max_batch=2)
    a, c = Collect(), Collect()
    ja = Job(ids=[1, 2], max_tokens=1000, on_event=a)
    b.submit(ja)
    b.submit(Job(ids=[3], max_tokens=1000, on_event=c))
    b.step()
    b.step()
    assert b.stats()["active"] == 2
    ja.cancel()
    b.step()
    assert b.stats()["active"] == 1 and a.reason == "cancelled" and c.reason is None


def test_queue_is_bounded_and_close_ends_everything(trained):
    b = Batcher(trained, max_batch=1, max_queue=2)
    outs = [Collect() for _ in range(3)]
    b.submit(Job(ids=[1], max_tokens=10 ** 9, on_event=outs[0]))  # (never done before close, however fast)
    b.submit(Job(ids=[2], max_tokens=10 ** 9, on_event=outs[1]))
    with pytest.raises(QueueFull):
        b.submit(Job(ids=[3], max_tokens=100, on_event=outs[2]))
    b.step()  # job 0 takes the one row; job 1 waits
    assert b.stats()["active"] == 1 and b.stats()["queued"] == 1
    b.start()
    b.close()
    assert outs[0].reason == outs[1].reason == "shutdown"
    with pytest.raises(Closed):
        b.submit(Job(ids=[1], max_tokens=1))


def test_top_logprobs_order():
    logp = np.log(np.array([0.1, 0.4, 0.1, 0.4]))
    assert [i for i, _ in top_logprobs(logp, 3)] == [1, 3, 0]
    assert top_logprobs(logp, 0) == []


# ---- bad input and engine failures end only the jobs they touch --------------------------------------
@pytest.mark.parametrize("field,value", [
    ("seed", -1), ("seed", 2 ** 64), ("seed", 1.5), ("seed", True), ("temperature", -0.5),
    ("temperature", float("nan")), ("temperature", float("inf")), ("temperature", 1e-300), ("temperature", "1"),
    ("top_p", 0.0), ("top_p", 1.5), ("top_p", float("nan")), ("top_k", -1), ("top_k", 2.0), ("max_tokens", -1),
    ("max_tokens", None), ("ids", []), ("ids", [1, 40]), ("ids", [-1]), ("ids", "abc"), ("ids", [1.0]),
    ("logprobs", -1), ("logprobs", 41), ("stop_ids", (1.5,)), ("stop_ids", None), ("echo", 1), ("on_event", None)])
def test_a_job_the_engine_cannot_run_is_refused_at_submit(trained, field, value):
    """Each of these raised inside admission (a negative seed in np.random.default_rng, ...) or made NaN
    probabilities; now submit refuses them, naming the field, and nothing reaches the queue."""
    b = Batcher(trained, max_batch=2)
    spec = dict(ids=[1, 2], max_tokens=3, on_event=Collect())
    spec[field] = value
    with pytest.raises(BadJob, match=field):
        b.submit(Job(**spec))
    assert b.stats()["queued"] == 0


def test_edge_values_are_served(trained):
    """The ends of every range are accepted and run: seed 0 and 2**64 - 1, temperature 0 / 0.01 / 100, top_p 1,
    top_k 0 and far over the vocabulary, logprobs up to the vocabulary, numpy integers."""
    specs = [dict(seed=0, temperature=0.01), dict(seed=2 ** 64 - 1, temperature=100.0, top_p=1.0),
             dict(top_k=0, temperature=1), dict(top_k=10 ** 30, temperature=1, seed=np.uint64(3)),
             dict(logprobs=CFG.vocab_size, echo=True), dict(ids=(np.int64(5), 6), stop_ids=frozenset({1}))]
    outs, _ = run_jobs(trained, [{"ids": [1, 2], "max_tokens": 3, **s} for s in specs])
    assert all(o.reason in ("length", "stop") and o.tokens for o in outs)


def _raising_when(monkeypatch, module, name, bad):
    """Make module.<name> raise RuntimeError("injected") when bad(*args) holds (else run as before)."""
    real = getattr(module, name)

    def fake(*args, **kw):
        if bad(*args, **kw):
            raise RuntimeError("injected")
        return real(*args, **kw)
    monkeypatch.setattr(module, name, fake)


POISON = 39  # a prompt holding this id makes the patched admission fail


@pytest.mark.parametrize("which", ["trained", "gpt2"])
def test_an_exception_in_admission_ends_only_its_job(trained, monkeypatch, which):
    """Each prompt is prefilled on its own (the fused path and BLAS, gpt2): the one that fails ends with an
    error, the good prompts admitted in the same step as the bad one are served as usual, and the rows
    already running go on."""
    model = trained if which == "trained" else Model.init(GPT2, seed=5)
    ps = [[1, 2, 3], [4, 5, 6], [7, 8, POISON], [9, 10, 11]]  # equal lengths: one prefill group on BLAS
    want = [run_jobs(model, [dict(ids=p, max_tokens=6)], max_batch=1)[0][0].tokens for p in ps]
    _raising_when(monkeypatch, step, "forward_hidden", lambda cfg, W, tokens, *a, **k: bool((tokens == POISON).any()))
    b = Batcher(model, max_batch=8)
    outs = [Collect() for _ in ps]
    b.submit(Job(ids=ps[0], max_tokens=6, on_event=outs[0]))
    b.step()  # a running row
    for p, out in zip(ps[1:], outs[1:]):
        b.submit(Job(ids=p, max_tokens=6, on_event=out))
    while b.step():
        pass
    assert "injected" in outs[2].error and outs[2].reason is None and outs[2].tokens == []
    for i in (0, 1, 3):
        assert outs[i].error is None and outs[i].reason == "length" and outs[i].tokens == want[i]
    assert all(o.ends == 1 for o in outs)


def test_an_exception_in_sampling_ends_only_its_row(trained, monkeypatch):
    _raising_when(monkeypatch, engine, "sample_token", lambda logits, t, *a, **k: t == 0.5)
    outs, b = run_jobs(trained, [dict(ids=[1, 2], max_tokens=5), dict(ids=[3], max_tokens=5, temperature=0.5, seed=1),
                                 dict(ids=[4, 5, 6], max_tokens=5)])
    assert "injected" in outs[1].error and outs[1].reason is None
    assert [o.reason for o in (outs[0], outs[2])] == ["length", "length"] and all(o.ends == 1 for o in outs)
    again = Collect()
    b.submit(Job(ids=[1, 2], max_tokens=5, on_event=again))
    while b.step():
        pass
    assert again.tokens == outs[0].tokens  # the engine serves on, and its cache rows are intact


def test_an_exception_in_decoding_ends_that_steps_rows_and_the_engine_serves_on(trained, monkeypatch):
    from nanoeuler.infer import kernels
    real, calls = kernels.forward_rows, []

    def once(cfg, W, tokens, pos, rows, *rest):  # the first decoding step of two rows fails
        if list(rows) == [0, 1] and not calls:
            calls.append(1)
            raise RuntimeError("injected")
        return real(cfg, W, tokens, pos, rows, *rest)
    monkeypatch.setattr(kernels, "forward_rows", once)
    outs, b = run_jobs(trained, [dict(ids=[1, 2], max_tokens=5), dict(ids=[3], max_tokens=5)])
    assert calls and all("injected" in o.error and o.ends == 1 and len(o.tokens) == 1 for o in outs)
    ref, _ = run_jobs(trained, [dict(ids=[1, 2], max_tokens=5)])
    again = Collect()
    b.submit(Job(ids=[1, 2], max_tokens=5, on_event=again))
    while b.step():
        pass
    assert again.reason == "length" and again.tokens == ref[0].tokens


def test_the_engine_thread_answers_every_job_when_admission_fails(trained, monkeypatch):
    """On the background thread (as serve runs it): every job ends once, close() is quick."""
    import time
    _raising_when(monkeypatch, step, "forward_hidden", lambda cfg, W, tokens, *a, **k: bool((tokens == POISON).any()))
    b = Batcher(trained, max_batch=4).start()
    outs = [Collect() for _ in range(6)]
    for i, out in enumerate(outs):
        b.submit(Job(ids=[1, POISON] if i % 2 else [1, 2], max_tokens=4, on_event=out))
    deadline = time.time() + 30
    while any(o.ends == 0 for o in outs) and time.time() < deadline:
        time.sleep(0.01)
    t0 = time.time()
    b.close()
    assert time.time() - t0 < 2
    assert [o.error is not None for o in outs] == [False, True] * 3 and all(o.ends == 1 for o in outs)


def test_fuzz_every_job_is_refused_up_front_or_served(trained):
    """Hypothesis draws every field that reaches the engine (ids, max_tokens, temperature, top_p, top_k, seed,
    stop_ids, logprobs, echo): good values, with up to two fields replaced by anything (negative, huge, NaN,
    wrong types). Each job is either refused by submit (BadJob) or served: it runs a few steps beside a plain
    job and ends with one "done", never an "error"; the plain job's tokens are never disturbed."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    plain_ref = run_jobs(trained, [dict(ids=[1, 2, 3], max_tokens=6)])[0][0].tokens
    b = Batcher(trained, max_batch=4)
    seen = {"refused": 0, "served": 0}
    good = dict(
        ids=st.lists(st.integers(0, CFG.vocab_size - 1), min_size=1, max_size=40), max_tokens=st.integers(0, 8),
        temperature=st.one_of(st.just(0.0), st.floats(0.01, 100)), top_p=st.floats(0.001, 1.0),
        top_k=st.integers(0, 50), seed=st.integers(0, 2 ** 64 - 1), stop_ids=st.tuples(st.integers(0, 39)),
        logprobs=st.integers(0, CFG.vocab_size), echo=st.booleans())
    anything = st.one_of(st.none(), st.booleans(), st.integers(-2 ** 70, 2 ** 70), st.floats(allow_nan=True),
                         st.text(max_size=3), st.lists(st.integers(-3, 45), max_size=4), st.tuples(st.floats()))
    bad = st.dictionaries(st.sampled_from(sorted(good)), anything, max_size=2)

    @given(spec=st.fixed_dictionaries({"ids": good["ids"], "max_tokens": good["max_tokens"]},
                                      optional={k: v for k, v in good.items() if k not in ("ids", "max_tokens")}),
           overlay=bad)
    @settings(max_examples=300, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    def run(spec, overlay):
        spec.update(overlay)
        out, plain = Collect(), Collect()
        b.submit(Job(ids=[1, 2, 3], max_tokens=6, on_event=plain))
        try:
            job = Job(on_event=out, **spec)
            b.submit(job)
        except BadJob:
            seen["refused"] += 1
        else:
            seen["served"] += 1
            for _ in range(4):
                b.step()
            job.cancel()  # (a served job with a huge max_tokens is cut here)
        while b.step():
            pass
        assert out.error is None and plain.error is None, (spec, out.error, plain.error)
        assert plain.tokens == plain_ref and plain.reason == "length"
        if seen["served"] and out.ends:
            assert out.ends == 1 and out.reason in ("length", "stop", "cancelled")
    run()
    assert seen["refused"] > 50 and seen["served"] > 50, seen


def test_dpo_data_model_answers_says_when_the_engine_failed(trained, monkeypatch):
    """model_answers (dpo-data's batch of greedy answers) turns an engine error into an exception naming it,
    rather than an answer missing from its list."""
    from nanoeuler.training.dpo_data import model_answers
    _raising_when(monkeypatch, step, "forward_hidden", lambda cfg, W, tokens, *a, **k: bool((tokens == POISON).any()))
    assert len(model_answers(trained, [[1, 2], [3, 4]], stop_ids=[0], max_new_tokens=3, progress=False)) == 2
    with pytest.raises(RuntimeError, match="injected"):
        model_answers(trained, [[1, 2], [3, POISON]], stop_ids=[0], max_new_tokens=3, progress=False)
