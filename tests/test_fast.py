"""The fast engine (nanoeuler/fast/) against the reference model and ops, and its promises:
same losses and gradients (float32 tight, float64 to round-off) for GQA, MHA and K = 1 configs, with and
without a loss mask, any B and T ≤ ctx; bit-identical results run to run, any number of parts;
a fused AdamW bit-identical to the NumPy expressions; the float32 `vexp` within a few ulp."""
import numpy as np
import pytest

from nanoeuler import Config, Model, ops
from nanoeuler.fast import Workspace, engine, kernels, loss_and_grads, parallel
from nanoeuler.optim import AdamW
from conftest import rel_err

BASE = Config(vocab_size=50, dim=32, n_heads=4, n_kv_heads=2, n_layers=2, ctx_len=12, ffn_hidden=40, n_mtp=3)
CONFIGS = {"gqa": BASE, "mha": BASE.replace(n_kv_heads=4), "k1": BASE.replace(n_mtp=1, n_heads=2, n_kv_heads=1),
           # every architecture's own parts: q/k/v biases and a tied head; GeGLU, q/k and post norms, √d
           # embedding, a head width of its own and windowed layers (window 5 < T) with their own RoPE base
           "qwen2": BASE.replace(arch="qwen2", tie_embeddings=True),
           "gemma3": BASE.replace(arch="gemma3", head_dim=12, sliding_window=5, global_every=2, rope_local_theta=100.0),
           "gpt2": BASE.replace(arch="gpt2"),
           "qwen3": BASE.replace(arch="qwen3", head_dim=12, tie_embeddings=True),   # q/k norms, no post norms
           "mistral": BASE.replace(arch="mistral", sliding_window=5),               # every layer windowed
           # llama3 RoPE scaling: head 8 at θ 100 has wavelengths 6.3, 20, 63, 199 against an original context of
           # 64 (16 / 64 the fast / slow bounds): one pair unscaled, two blended, one divided by the factor
           "llama3": BASE.replace(rope_theta=100.0, rope_scaling="llama3", rope_factor=4.0, rope_original_ctx=64),
           # yarn: its ramp over those pairs 0, 1/3, 2/3, 1 (original context 64) and the scores times its
           # attention factor squared (1 + 0.1·ln 4)² = 1.30, which the fast engine's q scale carries
           "yarn": BASE.replace(rope_theta=100.0, rope_scaling="yarn", rope_factor=4.0, rope_original_ctx=64),
           "olmo2": BASE.replace(arch="olmo2"),   # post norms only, q/k norms over each whole projection
           "smollm3": BASE.replace(arch="smollm3", no_rope_every=2),   # layer 1 without RoPE
           "granite": BASE.replace(arch="granite", embedding_multiplier=2.5, residual_multiplier=0.5,   # its four
                                   attention_multiplier=0.2, logits_scaling=3.0),                   # multipliers
           "stablelm": BASE.replace(arch="stablelm", partial_rotary_factor=0.5),   # RoPE on half of each head
           "starcoder2": BASE.replace(arch="starcoder2", sliding_window=5),   # GPT-2's block with RoPE, windowed
           # soft caps that bend (the scores of far_from_init's weights reach a few units, the logits more)
           "gemma2": BASE.replace(arch="gemma2", sliding_window=5, attn_softcap=1.0, logit_softcap=2.0),
           "phi3": BASE.replace(arch="phi3", sliding_window=5),   # (its fused q|k|v, gate|up: the formats' only)
           # the parallel residual, the exact GELU, LayerNorm and biases, RoPE on half of each head
           "gptneox": BASE.replace(arch="gptneox", partial_rotary_factor=0.5)}
TOL = {np.float32: 2e-5, np.float64: 1e-12}        # losses
ENTRY_TOL = {np.float32: 3e-4, np.float64: 5e-11}  # every entry of every gradient (conftest.rel_err)




def test_every_architecture_has_a_case():
    """A record added to arch.py without a case here would go untested by the training engine."""
    from nanoeuler.arch import ARCHS
    assert {c.arch for c in CONFIGS.values()} == set(ARCHS)


def far_from_init(cfg, dtype, seed=0):
    """A model with weights well away from init, so attention is peaked and every gradient term matters."""
    rng = np.random.default_rng(seed)
    m = Model.init(cfg, seed=seed, dtype=dtype)
    for p in m.params.values():
        p += rng.standard_normal(p.shape).astype(dtype) * (0.5 if p.ndim == 1 else 0.15)
    return m


def batch(cfg, B, T, seed=1, mask=True):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, cfg.vocab_size, (B, T + cfg.n_mtp))
    return tokens, (rng.random(tokens.shape) > 0.3 if mask else None)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_fast_equals_reference(name, dtype):
    cfg = CONFIGS[name]
    m = far_from_init(cfg, dtype)
    for B, T, use_mask in [(3, cfg.ctx_len, True), (2, 5, False), (1, 1, True)]:
        tokens, mask = batch(cfg, B, T, mask=use_mask)
        l0, obj, grads = m.loss_and_grads(tokens, mask)
        r0, robj, rgrads = m.loss_and_grads(tokens, mask, reference=True)
        assert abs(l0 - r0) <= TOL[dtype] * abs(r0) and abs(obj - robj) <= TOL[dtype] * abs(robj)
        assert list(grads) == list(rgrads)
        for n in rgrads:
            assert grads[n].dtype == dtype and grads[n].shape == rgrads[n].shape
            if n.endswith("attn.wk.bias") and cfg.spec.positions != "rope":  # exactly 0 without RoPE (a key bias
                # shifts a whole row of scores alike): round-off only
                assert max(np.abs(grads[n]).max(), np.abs(rgrads[n]).max()) <= 1e3 * np.finfo(dtype).eps
                continue
            assert rel_err(grads[n], rgrads[n]) <= ENTRY_TOL[dtype], (name, B, T, n, rel_err(grads[n], rgrads[n]))
        assert m.loss(tokens, mask) == pytest.approx((l0, obj), rel=TOL[dtype])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", ["gqa", "qwen2", "gemma3", "gpt2"])
def test_heads_a_chunk_of_rows_at_a_time_equal_the_reference(name, dtype, monkeypatch):
    """With a logits buffer of 5 rows per part (LOGITS_BYTES), each head's rows go in chunks of at most 5: the
    losses and every gradient are still the reference's (the head weights' summed over the chunks, a tied
    head's into the embedding's), bit-identical run to run, and equal to rounding to one chunk per part."""
    cfg = CONFIGS[name]
    m = far_from_init(cfg, dtype)
    tokens, mask = batch(cfg, 3, cfg.ctx_len)
    monkeypatch.setattr(parallel, "PARTS", 2)
    whole = m.loss_and_grads(tokens, mask, out=m.grad_buffers())
    monkeypatch.setattr(engine, "LOGITS_BYTES", 5 * cfg.vocab_size * np.dtype(dtype).itemsize)
    ws = Workspace(cfg, 3, cfg.ctx_len, dtype)
    assert ws.logits_rows == 5 and ws.logits.shape == (2, 5, cfg.vocab_size)
    l0, obj, grads = loss_and_grads(cfg, m.params, tokens, mask, ws)
    again = loss_and_grads(cfg, m.params, tokens, mask, ws)
    assert again[:2] == (l0, obj) and all(np.array_equal(again[2][n], grads[n]) for n in grads)
    r0, robj, rgrads = m.loss_and_grads(tokens, mask, reference=True)
    assert abs(l0 - r0) <= TOL[dtype] * abs(r0) and abs(obj - robj) <= TOL[dtype] * abs(robj)
    for n in rgrads:
        if n.endswith("attn.wk.bias") and cfg.spec.positions != "rope":   # exactly 0: see above
            continue
        assert rel_err(grads[n], rgrads[n]) <= ENTRY_TOL[dtype], (n, rel_err(grads[n], rgrads[n]))
        assert rel_err(grads[n], whole[2][n]) <= ENTRY_TOL[dtype], n


@pytest.mark.parametrize("name", list(CONFIGS))
def test_lean_workspace_gives_the_same_bits(name, monkeypatch):
    """A lean workspace (LoRA's: the MLP's pre-activations, the attention probabilities and output formed again in
    backward, not kept per layer) holds one layer's of them instead of L, and its losses and gradients are bit
    for bit the full workspace's."""
    cfg = CONFIGS[name]
    m = far_from_init(cfg, np.float32)
    tokens, mask = batch(cfg, 3, cfg.ctx_len)
    monkeypatch.setattr(parallel, "PARTS", 2)
    full, lean = (Workspace(cfg, 3, cfg.ctx_len, np.float32, lean=x) for x in (False, True))
    assert lean.GU.shape[0] == lean.P.shape[0] == lean.A.shape[0] == 1 and full.GU.shape[0] == cfg.n_layers
    want, got = (loss_and_grads(cfg, m.params, tokens, mask, ws) for ws in (full, lean))
    assert got[:2] == want[:2] and all(np.array_equal(got[2][n], want[2][n]) for n in want[2])


def test_matmul_add_accumulates_in_place_for_any_layout():
    """blas.matmul_add(a, b, out): out += a @ b, for transposed and row-view operands (one gemm with β = 1),
    and through a temporary for what gemm cannot read (a strided operand, mixed dtypes)."""
    from nanoeuler.fast.blas import matmul_add
    rng = np.random.default_rng(0)
    for dtype in (np.float32, np.float64):
        z, h = rng.standard_normal((7, 11)).astype(dtype), rng.standard_normal((9, 5)).astype(dtype)
        cases = [(z.T, h[2:9]), (z[1:4].T, h[::3]), (z[:, :5], h[:5].T.copy()), (z[:, 1:6], h[4:9]),
                 (z[:, ::2][:, :5], h[:5])]
        for a, b in cases:
            out = rng.standard_normal((a.shape[0], b.shape[1])).astype(dtype)
            expected = out.astype(np.float64) + a.astype(np.float64) @ b.astype(np.float64)
            matmul_add(a, b, out)
            assert out.dtype == dtype and rel_err(out, expected) < (1e-5 if dtype == np.float32 else 1e-13)
    with pytest.raises(ValueError, match="matmul_add"):
        matmul_add(z.T, h, np.zeros((11, 5)))


def test_fully_masked_head_has_zero_loss_and_gradient():
    cfg = CONFIGS["gqa"]
    m = far_from_init(cfg, np.float64)
    tokens, _ = batch(cfg, 2, 6)
    mask = np.ones_like(tokens, dtype=bool)
    mask[:, 1:] = False          # no target counts for any head
    l0, obj, grads = m.loss_and_grads(tokens, mask)
    assert l0 == 0.0 and obj == 0.0
    assert all(not np.any(g) for g in grads.values())
    ref = m.loss_and_grads(tokens, mask, reference=True)
    assert ref[0] == 0.0


def test_deterministic_and_any_number_of_parts(monkeypatch):
    """Bit-identical run to run; cutting the batch into 1, 2 or 4 parts (one per core) changes only how
    the weight gradients are grouped in their sums: equal to rounding, and each equal to the reference."""
    cfg = CONFIGS["gqa"]
    m = far_from_init(cfg, np.float32)
    tokens, mask = batch(cfg, 4, cfg.ctx_len)
    first = m.loss_and_grads(tokens, mask)
    again = m.loss_and_grads(tokens, mask, out=m.grad_buffers())
    assert again[:2] == first[:2] and all(np.array_equal(again[2][n], first[2][n]) for n in first[2])
    ref = m.loss_and_grads(tokens, mask, reference=True)
    for parts in (1, 2, 4):
        monkeypatch.setattr(parallel, "PARTS", parts)
        ws = Workspace(cfg, 4, cfg.ctx_len, np.float32)
        assert len(ws.parts) == parts
        got = loss_and_grads(cfg, m.params, tokens, mask, ws)
        assert got[0] == pytest.approx(ref[0], rel=TOL[np.float32])
        for name in ref[2]:
            assert rel_err(got[2][name], ref[2][name]) <= ENTRY_TOL[np.float32], (parts, name)
    one_grad_set = cfg.n_params() * 4
    monkeypatch.setattr(engine, "EXTRA_GRADS_BYTES", 2 * one_grad_set)  # room for two extra gradient sets
    assert len(Workspace(cfg, 4, cfg.ctx_len, np.float32).parts) == 3


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_dropout_same_masks_as_reference_any_number_of_parts(dtype, monkeypatch):
    """The fast engine draws the reference model's masks (a pure function of seed, site and element),
    however the batch is cut into parts; dropout changes the loss and a new seed changes it again."""
    cfg = CONFIGS["gqa"]
    m = far_from_init(cfg, dtype)
    tokens, mask = batch(cfg, 4, cfg.ctx_len)
    drop = ops.Dropout(0.3, seed=11)
    ref = m.loss_and_grads(tokens, mask, reference=True, dropout=drop)
    assert ref[1] != m.loss_and_grads(tokens, mask, reference=True)[1]
    assert ref[1] != m.loss_and_grads(tokens, mask, reference=True, dropout=ops.Dropout(0.3, seed=12))[1]
    for reference in (True, False):                  # forward only: the objective the gradients belong to
        assert m.loss(tokens, mask, reference=reference, dropout=drop) == pytest.approx(ref[:2], rel=TOL[dtype])
    for parts in (1, 2, 4):
        monkeypatch.setattr(parallel, "PARTS", parts)
        got = loss_and_grads(cfg, m.params, tokens, mask, Workspace(cfg, 4, cfg.ctx_len, dtype), dropout=drop)
        assert got[1] == pytest.approx(ref[1], rel=TOL[dtype])
        for name in ref[2]:
            assert rel_err(got[2][name], ref[2][name]) <= ENTRY_TOL[dtype], (parts, name)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_dropout_kernels_equal_the_reference_masks(dtype):
    rng = np.random.default_rng(0)
    x, t = rng.standard_normal((2, 37, 24)).astype(dtype)
    drop = ops.Dropout(0.25, seed=2**62 + 5)
    m = drop.mask(site=7, rows=37, width=24, dtype=dtype, row0=100)
    args = (np.uint64(drop.base(7, 100, 24)), np.uint64(drop.threshold), dtype(drop.scale))
    out = np.empty_like(x)
    kernels.dropout_add(x, t, *args, out)
    assert np.array_equal(out, x + t * m)
    kernels.dropout_scale(t, *args, out)
    assert np.array_equal(out, t * m)


def test_out_buffers_any_layout_and_workspace_reshaped():
    cfg = CONFIGS["gqa"]
    m = far_from_init(cfg, np.float32)
    tokens, mask = batch(cfg, 2, 7)
    _, _, fresh = m.loss_and_grads(tokens, mask)
    separate = {n: np.full_like(g, np.nan) for n, g in fresh.items()}   # not adjacent: the copying path
    _, _, got = m.loss_and_grads(tokens, mask, out=separate)
    assert got is separate and all(np.array_equal(separate[n], fresh[n]) for n in fresh)
    other, _ = batch(cfg, 5, 3, seed=7)                                   # another shape, then back
    m.loss_and_grads(other)
    _, _, back = m.loss_and_grads(tokens, mask)
    assert all(np.array_equal(back[n], fresh[n]) for n in fresh)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_fused_adamw_bit_identical_to_numpy_expressions(dtype):
    rng = np.random.default_rng(0)
    shapes = {"w": (7, 5), "b": (9,)}
    fused = {n: rng.standard_normal(s).astype(dtype) for n, s in shapes.items()}
    plain = {n: p.copy() for n, p in fused.items()}
    opt_f, opt_p = AdamW(fused, weight_decay=0.1), AdamW(plain, weight_decay=0.1)
    for t in range(4):
        grads = {n: rng.standard_normal(s).astype(dtype) for n, s in shapes.items()}
        opt_f.step(fused, grads, lr=1e-2 * (t + 1))
        strided = {n: np.stack([g, g], axis=-1)[..., 0] for n, g in grads.items()}  # not contiguous:
        opt_p.step(plain, strided, lr=1e-2 * (t + 1))                                  # the NumPy path
    for n in shapes:
        assert np.array_equal(fused[n], plain[n]) and np.array_equal(opt_f.m[n], opt_p.m[n])
        assert np.array_equal(opt_f.v[n], opt_p.v[n])


def test_vexp_float32_within_a_few_ulp():
    x = np.concatenate([np.linspace(-87, 88, 200001, dtype=np.float32), np.float32([0, -1e-8, 1e-8])])
    swiglu_in = np.stack([-x, np.ones_like(x)], axis=1)          # silu(-x)·1 = -x·σ(-x) = -x / (1 + exp(x))
    out = np.empty((x.size, 1), np.float32)
    kernels.swiglu_forward(swiglu_in.reshape(x.size, 2), out)
    ref = -x.astype(np.float64) / (1 + np.exp(x.astype(np.float64)))
    big = np.abs(ref) > 1e-30
    assert np.max(np.abs(out[:, 0] - ref)[big] / np.abs(ref[big])) < 1e-6
