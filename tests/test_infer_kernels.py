"""The fused decoding step (nanoeuler/infer/kernels.py) against the NumPy reference path (infer/forward.py).

float32 weights: logits within 1e-5 relative of the reference; float16 weights (Float16Model): within 1e-4
of the reference run on the same float16-rounded weights. For 1 row and several, at cache lengths 0, mid
and the context limit; greedy generation token for token the same; threads change nothing (every output
is computed whole by one thread, so the bits are equal).
"""
import threading

import numpy as np
import pytest
from conftest import rel_err, tiny_config

from nanoeuler import Model
from nanoeuler.infer import float16, forward as reference, gemv, kernels, pool
from nanoeuler.infer.cache import KVCache, new_cache
from nanoeuler.infer.session import generate
from nanoeuler.infer.step import forward_cached, forward_hidden, fuse_weights
from nanoeuler.infer.weights import Float16Model, linear, values

# hd 8, output widths (gate_up 80, vocab 53) that are no multiple of gemv.PANEL
CFG = tiny_config(vocab_size=53, dim=32, n_heads=4, n_kv_heads=2, n_layers=2, ctx_len=24, ffn_hidden=40, n_mtp=3)


def model(cfg=CFG, seed=0, scale=4.0):
    """Random weights a few times the init's size, so that logits are spread and argmaxes far from ties."""
    m = Model.init(cfg, seed=seed)
    for name, p in m.params.items():
        if "norm" not in name:
            p *= scale
    return m


def weights(m, fused: bool, monkeypatch) -> dict:
    monkeypatch.setattr(kernels, "ENABLED", fused)
    W = fuse_weights(m.config, m.params)
    monkeypatch.setattr(kernels, "ENABLED", True)
    assert ("decode" in W) == fused
    return W


@pytest.fixture
def calls(monkeypatch):
    """How many times the fused step ran."""
    n = [0]
    real = kernels.forward

    def counted(*a, **k):
        n[0] += 1
        return real(*a, **k)
    monkeypatch.setattr(kernels, "forward", counted)
    return n


@pytest.mark.parametrize("half", [False, True], ids=["f32", "f16"])
@pytest.mark.parametrize("n", [1, 3, kernels.ROWS])
@pytest.mark.parametrize("where", ["empty", "mid", "limit"])
def test_fused_step_equals_reference(half, n, where, monkeypatch, calls):
    m = model()
    if half:
        m = Float16Model(m)
    T = CFG.ctx_len
    L0 = {"empty": 0, "mid": 9, "limit": T - n}[where]
    ids = np.random.default_rng(1).integers(0, CFG.vocab_size, (1, T))
    Wf, Wr = weights(m, True, monkeypatch), weights(m, False, monkeypatch)
    cf, cr = new_cache(CFG, dtype=m.dtype), new_cache(CFG, dtype=m.dtype)
    if L0:  # the same prefix in both caches (computed by the reference path)
        forward_hidden(CFG, Wr, ids[:, :L0], cr)
        for a, b in zip(cf.k + cf.v, cr.k + cr.v):
            a[...] = b
        cf.length = L0
    before = calls[0]
    got = forward_cached(CFG, None, ids[:, L0:L0 + n], cf, fused=Wf)  # [K, 1, n, V]
    want = forward_cached(CFG, None, ids[:, L0:L0 + n], cr, fused=Wr)
    assert calls[0] == before + 1  # the fused step ran, once, for the fused weights only
    assert got.dtype == want.dtype == np.float32 and got.shape == want.shape == (CFG.n_mtp, 1, n, CFG.vocab_size)
    tol = 1e-4 if half else 5e-5
    assert rel_err(got, want) <= tol
    assert cf.length == cr.length == L0 + n
    for a, b in zip(cf.k + cf.v, cr.k + cr.v):  # the new keys and values, rotated, where the reference put them
        assert rel_err(a[:, :, :L0 + n], b[:, :, :L0 + n]) <= tol
    c_last = _copy(cf, L0)  # last_only: the last layer carries on with the last row only, yet every row's
    last = forward_cached(CFG, None, ids[:, L0:L0 + n], c_last, last_only=True, fused=Wf)  # keys and values land
    assert np.array_equal(last[:, :, 0], got[:, :, -1])  # the same bits as the full step's last row
    for a, b in zip(c_last.k + c_last.v, cf.k + cf.v):
        assert np.array_equal(a[:, :, :L0 + n], b[:, :, :L0 + n])


def _copy(cache, length):
    c = new_cache(CFG)
    for a, b in zip(c.k + c.v, cache.k + cache.v):
        a[...] = b
    c.length = length
    return c


def test_float16_weights_differ_from_float32_by_rounding_only(monkeypatch):
    """A Float16Model decodes the float16-rounded weights: near the float32 model, not equal to it."""
    m = model()
    ids = np.array([[3, 1, 4, 1, 5]])
    a = forward_cached(CFG, None, ids, new_cache(CFG), fused=weights(m, True, monkeypatch))
    m16 = Float16Model(m)
    b = forward_cached(CFG, None, ids, new_cache(CFG, dtype=m16.dtype), fused=weights(m16, True, monkeypatch))
    assert 1e-5 < rel_err(b, a) < 5e-2
    assert new_cache(CFG, dtype=np.float16).k[0].dtype == np.float32  # a float16 model computes in float32


@pytest.mark.parametrize("half", [False, True], ids=["f32", "f16"])
@pytest.mark.parametrize("mode", ["cache", "speculative"])
def test_greedy_generate_identical(half, mode, monkeypatch, calls):
    """64 greedy tokens, through two window jumps (ctx 24): fused and reference decode the same text."""
    m = model(seed=3)
    if half:
        m = Float16Model(m)
    prompt = [5, 17, 2, 40, 33]
    got = generate(m, prompt, 64, temperature=0, mode=mode, spec_depth=2 if mode == "speculative" else None)
    assert calls[0] > 0
    monkeypatch.setattr(kernels, "ENABLED", False)
    n = calls[0]
    want = generate(m, prompt, 64, temperature=0, mode=mode, spec_depth=2 if mode == "speculative" else None)
    assert calls[0] == n  # the reference ran without the fused step
    assert len(got.ids) == 64 and got.ids == want.ids
    assert len(set(got.ids)) > 2  # not one token repeated


@pytest.mark.parametrize("half", [False, True], ids=["f32", "f16"])
def test_matvec_matches_numpy(half):
    rng = np.random.default_rng(0)
    W = rng.standard_normal((77, 45)).astype(np.float32)  # 2 panels, the second 13 outputs wide
    Wk = gemv.pack(float16.half_bits(W) if half else W)
    ref = W.astype(np.float16).astype(np.float32) if half else W
    for n in (1, 2, 3, 4, 5, kernels.ROWS):
        X = rng.standard_normal((n, 45)).astype(np.float32)
        assert rel_err(kernels.matvec(Wk, X, 77), X @ ref.T) <= 3e-5
    assert float16.to_f32(np.uint16(0x3C00)) == 1.0 and list(float16.half_bits(np.ones(1))) == [0x3C00]


def test_pack_lays_out_panels_input_by_input():
    W = np.arange(70 * 3, dtype=np.float32).reshape(70, 3)
    Wp = gemv.pack(W)
    assert Wp.shape == (2, 3, gemv.PANEL) and Wp.flags.c_contiguous
    assert Wp[1, 2, 5] == W[gemv.PANEL + 5, 2] and not Wp[1, :, 70 - gemv.PANEL:].any()  # zero padding
    assert np.array_equal(gemv.pack(np.stack([W, 2 * W]))[1], 2 * Wp)  # leading (layer) axes kept


@pytest.mark.parametrize("rows", [(128, 64, 70), (70, 64)])
@pytest.mark.parametrize("kind", ["float32", "q8_0"])
def test_parts_packed_into_their_panels_equal_their_stack_packed(rows, kind):
    """The layout packs q, k, v (gate, up) each into its own panels where every part but the last fills whole
    panels, else their stacked copy (70 rows first): either way the kernel form of the stacked matrix."""
    from nanoeuler.infer import qkernels, quant
    from nanoeuler.infer.forward import _pack_parts
    from nanoeuler.infer.weights import Forms, of_dtype
    if kind != "float32" and not qkernels.AVAILABLE:
        pytest.skip("no integer kernels on this CPU")
    rng = np.random.default_rng(0)
    parts = [rng.standard_normal((r, 64)).astype(np.float32) for r in rows]
    if kind != "float32":
        t = quant.WTYPES[kind]
        parts = [t.quantize(p).view(t.dtype) for p in parts]
    form = of_dtype(parts[0].dtype)
    want = form.pack(np.concatenate(parts))
    out = np.full_like(want, 7)
    _pack_parts(Forms({"w": parts[0]}), parts, out)
    assert np.array_equal(out, want)


def test_a_row_gets_the_same_bits_whichever_rows_share_its_pass():
    """Rows go 4 at a time through a panel, each summed in the same order: a row of a 7-row product equals the
    same row alone, bit for bit (a speculative verification computes exactly what plain steps compute)."""
    rng = np.random.default_rng(1)
    Wk = gemv.pack(rng.standard_normal((150, 40)).astype(np.float32))
    X = rng.standard_normal((7, 40)).astype(np.float32)
    Y = kernels.matvec(Wk, X, 150)
    assert all(np.array_equal(Y[r], kernels.matvec(Wk, X[r:r + 1], 150)[0]) for r in range(7))


def test_linear_takes_the_kernel_for_few_rows(monkeypatch):
    m = model()
    W = weights(m, True, monkeypatch)["head.0"]
    assert len(W) == 3 and W[2] is not None
    x = np.random.default_rng(2).standard_normal((2, 5, CFG.dim)).astype(np.float32)
    Wv = values(W[0])  # (the parameters themselves: head 0 is the embedding)
    assert rel_err(linear(x[:1, :3], W), x[:1, :3] @ Wv.T) <= 1e-5  # 3 rows: the kernel
    assert rel_err(linear(x, W), x @ Wv.T) <= 1e-5                   # 10 rows: BLAS


def test_threads_change_no_bit():
    """1 thread, 2 threads, and two decoding threads at once (one takes the pool, the other runs alone)."""
    m = model(seed=5)
    rng = np.random.default_rng(4)
    W = gemv.pack(rng.standard_normal((1000, 64)).astype(np.float32))
    X = rng.standard_normal((3, 64)).astype(np.float32)
    old = pool.get_threads()
    try:
        pool.set_threads(1)
        one = kernels.matvec(W, X, 1000)
        gen1 = generate(m, [1, 2, 3], 20, temperature=0, mode="cache").ids
        pool.set_threads(2)
        assert np.array_equal(kernels.matvec(W, X, 1000), one)
        assert generate(m, [1, 2, 3], 20, temperature=0, mode="cache").ids == gen1
        results = []

        def worker():
            results.append([np.array_equal(kernels.matvec(W, X, 1000), one) for _ in range(50)])
        threads = [threading.Thread(target=worker) for _ in range(3)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert results == [[True] * 50] * 3
    finally:
        pool.set_threads(old)


@pytest.mark.parametrize("half", [False, True], ids=["f32", "f16"])
def test_a_prompt_goes_in_chunks(half, monkeypatch, calls):
    """A prompt longer than kernels.CHUNK: several fused calls, the same logits as the reference at every position."""
    m = model(seed=11)
    if half:
        m = Float16Model(m)
    monkeypatch.setattr(kernels, "CHUNK", 5)
    ids = np.random.default_rng(6).integers(0, CFG.vocab_size, (1, 23))
    Wf, Wr = weights(m, True, monkeypatch), weights(m, False, monkeypatch)
    got = forward_cached(CFG, None, ids, new_cache(CFG, dtype=m.dtype), fused=Wf)
    assert calls[0] == 5  # 5 + 5 + 5 + 5 + 3
    want = forward_cached(CFG, None, ids, new_cache(CFG, dtype=m.dtype), fused=Wr)
    assert rel_err(got, want) <= (1e-4 if half else 5e-5)
    last = forward_cached(CFG, None, ids, new_cache(CFG, dtype=m.dtype), last_only=True, fused=Wf)
    assert rel_err(last[:, :, 0], want[:, :, -1]) <= (1e-4 if half else 5e-5)


def test_fallbacks_keep_the_reference(monkeypatch, calls):
    """float64 models and batches of several sequences take the NumPy path."""
    m = model()
    W = weights(m, True, monkeypatch)
    forward_hidden(CFG, W, np.zeros((2, 3), np.int64), new_cache(CFG, batch=2))
    m64 = m.astype(np.float64)
    assert "decode" not in fuse_weights(CFG, m64.params)
    generate(m64, [1, 2], 3, temperature=0)
    assert calls[0] == 0


def test_bad_token_id_raises(monkeypatch):
    W = weights(model(), True, monkeypatch)
    for bad in (CFG.vocab_size, -1):
        with pytest.raises(IndexError):
            forward_hidden(CFG, W, np.array([[1, bad]]), new_cache(CFG))


def test_positions_and_rows_outside_the_cache_raise_before_anything_is_written(monkeypatch):
    W = weights(model(), True, monkeypatch)["decode"]
    c = new_cache(CFG)
    k, v = c.store[0], c.store[1]
    for pos, slot in (([0, CFG.ctx_len], [0, 0]), ([0, -1], [0, 0]), ([0, 1], [0, 1]), ([0, 1], [0, -1])):
        with pytest.raises(IndexError):
            kernels.forward_rows(CFG, W, np.ones((2, CFG.dim), np.float32), np.array(pos), np.array(slot), k, v,
                                 *c.rope.upto(CFG.ctx_len))
    assert not k.any() and not v.any()


def test_sample_dtype_float16(tmp_path, capsys, monkeypatch, calls):
    """`sample --dtype float16` decodes the Float16Model: its greedy text, not necessarily the float32 one."""
    import json

    from nanoeuler.cli import main
    from nanoeuler.tokenizer import Tokenizer
    tok = Tokenizer.train(["to be or not to be, that is the question " * 20], 300, progress=False)
    cfg = tiny_config(vocab_size=tok.vocab_size, dim=32, ctx_len=64)
    m = model(cfg, seed=7)
    m.save(tmp_path / "run", tokenizer=tok)
    ids = tok.encode("to be")
    for dtype, dec in (("float16", Float16Model(m)), ("float32", m)):
        assert main(["sample", "--ckpt", str(tmp_path / "run"), "--prompt", "to be", "--temperature", "0",
                     "--max-new-tokens", "12", "--no-speculative", "--dtype", dtype, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["ids"] == generate(dec, ids, 12, temperature=0, mode="cache",
                                                                             stop_ids=[tok.eos_id]).ids
    assert calls[0] > 0
    assert main(["sample", "--ckpt", str(tmp_path / "run"), "--prompt", "x", "--dtype", "float8"]) == 2
    assert "--dtype" in capsys.readouterr().err


def test_rows_of_several_sequences_equal_the_batched_reference(monkeypatch):
    """serve's batcher: one row per sequence, each at its own position of its own cache row, in one fused step,
    equals the NumPy step (reference.forward_rows)."""
    m = model(seed=9)
    rng = np.random.default_rng(5)
    W = weights(m, True, monkeypatch)
    shape = (CFG.n_layers, 3, CFG.n_kv_heads, CFG.ctx_len, CFG.head_dim)
    k, v = rng.standard_normal(shape).astype(np.float32), rng.standard_normal(shape).astype(np.float32)
    k2, v2 = k.copy(), v.copy()
    cache = new_cache(CFG)
    tokens, pos = np.array([7, 0, 52]), np.array([5, 0, CFG.ctx_len - 1])
    got = kernels.forward_rows(CFG, W["decode"], reference.embed(CFG, W, tokens, pos), pos, np.arange(3), k, v,
                               *cache.rope.upto(CFG.ctx_len))
    want = reference.forward_rows(CFG, W, KVCache(list(k2), list(v2), cache.rope, cache.kind), tokens, pos)
    assert rel_err(got, want) <= 5e-5
    assert rel_err(k, k2) <= 5e-5 and rel_err(v, v2) <= 5e-5  # the new keys and values where the reference put them


@pytest.mark.parametrize("softcap", [0.0, 2.0])
def test_a_wide_batch_shares_its_attention_between_threads_and_keeps_every_bit(monkeypatch, softcap):
    """Many rows at long positions (serve's batcher under load): the attention units go to the pool's threads
    (one pooled job more per layer than a short step), the result equals the NumPy reference, and with one
    thread it is the same bit for bit; soft-capped scores too (the cap travels in the job's descriptor)."""
    cfg = tiny_config(vocab_size=53, dim=64, n_heads=4, n_kv_heads=2, n_layers=2, ctx_len=256, ffn_hidden=40,
                      attn_softcap=softcap)
    m = model(cfg, seed=3)
    rng = np.random.default_rng(8)
    W = weights(m, True, monkeypatch)
    n = 24
    tokens, pos = rng.integers(0, cfg.vocab_size, n), rng.integers(100, cfg.ctx_len, n)
    assert (pos + 1).sum() * cfg.n_heads * cfg.head_dim >= pool.POOLED_ATTENTION
    shape = (cfg.n_layers, n, cfg.n_kv_heads, cfg.ctx_len, cfg.head_dim)
    k, v = rng.standard_normal(shape).astype(np.float32), rng.standard_normal(shape).astype(np.float32)
    ref = new_cache(cfg)
    cos, sin = ref.rope.upto(cfg.ctx_len)
    ctl = pool._POOL.ctl

    def run(threads, rows):
        pool.set_threads(threads)
        kk, vv = k.copy(), v.copy()
        g0 = ctl[pool.GEN]
        h = kernels.forward_rows(cfg, W["decode"], reference.embed(cfg, W, tokens[rows], pos[rows]), pos[rows],
                                 np.arange(n)[rows], kk, vv, cos, sin)
        return h, kk, vv, ctl[pool.GEN] - g0
    old = pool.get_threads()
    try:
        one, k1, v1, _ = run(1, slice(None))
        two, k2, v2, jobs = run(2, slice(None))
        _, _, _, jobs_short = run(2, slice(0, 1))  # one row: its attention stays on the calling thread
    finally:
        pool.set_threads(old)
    assert jobs - jobs_short == cfg.n_layers
    assert np.array_equal(one, two) and np.array_equal(k1, k2) and np.array_equal(v1, v2)
    want = reference.forward_rows(cfg, W, KVCache(list(k.copy()), list(v.copy()), ref.rope, ref.kind), tokens, pos)
    assert rel_err(two, want) <= 5e-5


def test_more_attention_units_than_the_claim_word_counts_run_on_the_caller():
    """70,000 rows x 1 key/value head: more units than the claim word's 16 bits hold, so the step's attention
    stays on the calling thread (pooled, the count overflowed and the step never ended). In a child process
    with a deadline, since a hang would not return to pytest."""
    import subprocess
    import sys
    code = """
import numpy as np
from conftest import tiny_config
from nanoeuler import Model, ops
from nanoeuler.infer import kernels, pool
from nanoeuler.infer.step import fuse_weights
cfg = tiny_config(vocab_size=11, dim=8, n_heads=1, n_kv_heads=1, n_layers=1, ctx_len=8, ffn_hidden=8)
W = fuse_weights(cfg, Model.init(cfg, seed=0).params)["decode"]
n = 70000
assert n * cfg.n_kv_heads > 0xFFFF and n * cfg.n_heads * cfg.head_dim >= pool.POOLED_ATTENTION
cos, sin = (t[None] for t in ops.rope_tables(cfg.ctx_len, cfg.layer_freqs(0), np.float32))
x = np.random.default_rng(0).standard_normal((n, cfg.dim)).astype(np.float32)
out = []
for threads in (2, 1):
    pool.set_threads(threads)
    k = np.zeros((1, n, 1, cfg.ctx_len, cfg.head_dim), np.float32)
    out.append(kernels.forward_rows(cfg, W, x, np.zeros(n, np.int64), np.arange(n), k, k.copy(), cos, sin))
assert np.array_equal(out[0], out[1])
print("ok")
"""
    tests = str(__import__("pathlib").Path(__file__).parent)
    r = subprocess.run([sys.executable, "-c", code], cwd=tests, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


def test_a_head_packed_by_rows_equals_the_head_packed_whole(monkeypatch):
    """fuse_weights packs head 0 (a tied head: the embedding, Gemma 3's 262,144 rows) a slice of rows at a
    time, letting go of each slice's file pages: the same kernel form as packing it whole, float32 and q8_0
    blocks (2·PANEL + 53 rows in slices of PANEL: the last slice 53 rows, its panel part-filled)."""
    from nanoeuler.config import head_weight
    from nanoeuler.infer import forward as fwd, qkernels
    from nanoeuler.infer.weights import Forms, QuantizedModel
    cfg = tiny_config(vocab_size=2 * gemv.PANEL + 53, dim=32, n_heads=4, n_kv_heads=2, n_layers=1, ctx_len=24,
                      ffn_hidden=64)
    m = model(cfg)
    monkeypatch.setattr(fwd, "HEAD_ROWS", gemv.PANEL)
    models = [m] + ([QuantizedModel(m, "q8_0")] if qkernels.AVAILABLE else [])
    for mm in models:
        forms = Forms(mm.params)
        E = head_weight(mm.params, 0)
        assert np.array_equal(fwd._packed_by_rows(forms, E), forms.kernel_form(E))
        assert np.array_equal(fuse_weights(cfg, mm.params)["head.0"][2], forms.kernel_form(E))
