"""The fast engine on arch gpt2 (nanoeuler/fast/, its LayerNorm, GELU, bias and position kernels) against the reference ops and model: kernels one
by one, then loss and every gradient, with several parts, MTP heads, a loss mask and dropout."""
import numpy as np
import pytest

from nanoeuler import Config, Model, ops
from nanoeuler.fast import kernels as G
from conftest import rel_err

CFG = Config(vocab_size=96, dim=32, n_heads=4, n_kv_heads=2, n_layers=2, ctx_len=16, ffn_hidden=80, n_mtp=2,
             arch="gpt2")




@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_kernels_match_reference_ops(dtype):
    tol = 1e-5 if dtype == np.float32 else 1e-12
    rng = np.random.default_rng(0)
    r = lambda *s: rng.standard_normal(s).astype(dtype)  # noqa: E731
    N, d, F = 37, 24, 40
    x, w, b = r(N, d) + dtype(1.5), r(d), r(d)
    y, mu, rs = np.empty_like(x), np.empty(N, dtype), np.empty(N, dtype)
    G.layernorm_forward(x, w, b, dtype(1e-5), y, mu, rs)
    ref, cache = ops.layernorm_forward(x.astype(np.float64), w.astype(np.float64), b.astype(np.float64), 1e-5)
    assert rel_err(y, ref) < tol
    dy = r(N, d)
    dx, dw, db = np.zeros_like(x), np.empty(d), np.empty(d)
    G.layernorm_backward(dy, x, mu, rs, w, dx, dw, db)
    for got, want in zip((dx, dw, db), ops.layernorm_backward(dy.astype(np.float64), cache)):
        assert rel_err(got, want) < tol * 10
    f, bf = 3 * r(N, F), r(F)
    f0 = f.copy()
    s = np.empty_like(f)
    G.bias_gelu_forward(f, bf, s)
    want, gcache = ops.gelu_forward((f0 + bf).astype(np.float64))
    assert rel_err(f, f0.astype(np.float64) + bf) < tol and rel_err(s, want) < tol * 10
    ds = r(N, F)
    want_dx = ops.gelu_backward(ds.astype(np.float64), gcache)
    G.gelu_backward(ds, f)
    assert rel_err(ds, want_dx) < tol * 10
    out = np.empty(F)
    G.col_sum(s, out)
    assert rel_err(out, ops.bias_backward(s.astype(np.float64), (F,))[1]) < tol
    pos, T = r(16, d), 5
    xx = r(2 * T, d)
    x2 = xx.copy()
    G.add_positions(x2, pos, T)
    assert rel_err(x2, ops.position_forward(xx.reshape(2, T, d).astype(np.float64), pos.astype(np.float64))[0].reshape(2 * T, d)) < tol
    dW = np.empty_like(pos)
    G.position_backward(xx, T, dW)
    assert rel_err(dW, ops.position_backward(xx.reshape(2, T, d).astype(np.float64), (0, pos.shape))[1]) < tol


def _model(dtype, seed=0):
    rng = np.random.default_rng(seed)
    m = Model.init(CFG, seed=seed, dtype=dtype)
    for p in m.params.values():
        p += ((0.3 if p.ndim > 1 else 0.2) * rng.standard_normal(p.shape)).astype(dtype)
    return m


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_fast_loss_and_every_gradient_match_reference(dtype, dropout, monkeypatch):
    from nanoeuler.fast import parallel
    monkeypatch.setattr(parallel, "PARTS", 3)   # B = 5 sequences in 3 parts: the part sums are exercised
    tol = 2e-5 if dtype == np.float32 else 1e-11              # the losses
    entry_tol = 3e-4 if dtype == np.float32 else 5e-11        # every entry of every gradient (conftest.rel_err)
    m = _model(dtype)
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, CFG.vocab_size, (5, 12 + CFG.n_mtp))
    mask = rng.random(tokens.shape) > 0.3
    drop = ops.Dropout(dropout, seed=4) if dropout else None
    h0, obj, grads = m.loss_and_grads(tokens, mask, dropout=drop)
    assert len(m._fast_ws.parts) == 3
    rh0, robj, rgrads = m.loss_and_grads(tokens, mask, reference=True, dropout=drop)
    assert abs(h0 - rh0) <= tol * abs(rh0) and abs(obj - robj) <= tol * abs(robj)
    bad = {n: rel_err(grads[n], rgrads[n]) for n in rgrads
           if not (rel_err(grads[n], rgrads[n]) <= entry_tol or n.endswith("attn.wk.bias"))}
    assert not bad, bad
    assert m.loss(tokens, mask, dropout=drop)[1] == pytest.approx(robj, rel=tol)
    # a second step on the same workspace gives the same result (no state left behind)
    h0b, _, grads_b = m.loss_and_grads(tokens, mask, dropout=drop)
    assert h0b == h0 and all(np.array_equal(grads_b[n], grads[n]) for n in grads)


def test_dpo_sequence_logprobs_fast_equals_reference_on_gpt2():
    """DPO's head-0 log-probs and their gradient run on the fast engine for arch gpt2 too (tied head)."""
    from nanoeuler.training import dpo
    m = _model(np.float64, seed=3)
    rng = np.random.default_rng(5)
    inputs = rng.integers(0, CFG.vocab_size, (3, 10))
    targets = rng.integers(0, CFG.vocab_size, (3, 10))
    mask = rng.random((3, 10)) > 0.4
    dl = rng.standard_normal(3)
    ref, rc = dpo.sequence_logprobs_forward(CFG, m.params, inputs, targets, mask)
    fast, fc = dpo.sequence_logprobs_forward(CFG, m.params, inputs, targets, mask, dpo.Workspaces(CFG, np.float64))
    assert rel_err(fast, ref) < 1e-12
    gr, gf = dpo.sequence_logprobs_backward(dl, rc), dpo.sequence_logprobs_backward(dl, fc)
    assert set(gr) == set(gf) == set(dpo.trained_params(CFG, m.params)) and "heads.1.weight" not in gf
    bad = {n: rel_err(gf[n], gr[n]) for n in gr if not (rel_err(gf[n], gr[n]) < 1e-11 or n.endswith("attn.wk.bias"))}
    assert not bad, bad
