"""bfloat16 matrix products (nanoeuler/fast/bf16.py) and `--precision bf16` in the fast engine:
round-to-nearest-even on the edge cases (PyTorch's conversion as a second oracle), every product form the
engine uses against a float64 product of the same rounded operands, the engine's bf16 step against a
float64 twin of the model whose products round the same operands, and the refusal without AVX512_BF16."""
import numpy as np
import pytest

from nanoeuler import Model
from nanoeuler.errors import UserError
from nanoeuler.fast import Workspace, bf16
from conftest import rel_err, tiny_config

needs_bf16 = pytest.mark.skipif(not bf16.AVAILABLE, reason="this CPU has no AVX512_BF16")


def f32(bits):
    return np.array(bits, np.uint32).view(np.float32)


# ---- rounding --------------------------------------------------------------------------------------------
EDGES = {  # float32 bits -> bfloat16 bits (round to nearest, ties to even)
    0x3F800000: 0x3F80,   # 1.0 exact
    0x3F808000: 0x3F80,   # 1 + 2⁻⁸: a tie, down to the even 1.0
    0x3F818000: 0x3F82,   # 1 + 3·2⁻⁸: a tie, up to the even 1 + 2⁻⁶
    0x3F808001: 0x3F81,   # just above the tie: up
    0x3F807FFF: 0x3F80,   # just below: down
    0xBF818000: 0xBF82,   # negative tie, to even
    0x80000000: 0x8000,   # -0.0 keeps its sign
    0x7F800000: 0x7F80,   # +inf
    0xFF800000: 0xFF80,   # -inf
    0x7F7FFFFF: 0x7F80,   # the largest float32 rounds up to inf
    0x7F7F7FFF: 0x7F7F,   # ... below the tie it stays finite
    0x00008000: 0x0000,   # subnormal tie: to the even 0
    0x00018000: 0x0002,   # subnormal tie: to the even 2
    0x00010001: 0x0001,   # subnormal below a tie: down
    0x007FFFFF: 0x0080,   # the largest subnormal rounds up to the smallest normal
}
NANS = [0x7FC00000, 0x7F800001, 0xFF800001, 0x7FFFFFFF]  # quiet, and signalling ones whose payload is only in the low bits


def test_round_bf16_edge_cases():
    x = f32(list(EDGES))
    want = np.array(list(EDGES.values()), np.uint16)
    assert (bf16.round_bf16_bits(x) == want).all()
    assert (bf16.pack_a(x[None])[0][0, :len(EDGES)] == want).all()               # the numba kernels' rounding
    nan = f32(NANS)
    for got in (bf16.round_bf16_bits(nan), bf16.pack_a(nan[None])[0][0, :len(NANS)]):
        assert np.isnan((got.astype(np.uint32) << 16).view(np.float32)).all()


def test_round_bf16_matches_torch():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    x = np.concatenate([(rng.standard_normal(5000) * 10.0 ** rng.integers(-40, 38, 5000)).astype(np.float32),
                        f32(rng.integers(0, 2 ** 32, 5000, dtype=np.uint64).astype(np.uint32)), f32(list(EDGES))])
    x = x[~np.isnan(x)]
    want = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert (bf16.round_bf16_bits(x) == want).all()
    assert (bf16.pack_a(x[None])[0][0, :x.size] == want).all()


def packed_b_reference(b):
    """pack_b's layout by NumPy: b [K, N] -> [1, nb, Kp/2, 2·PANEL], element (2p + e, j) of b rounded at
    [0, j // PANEL, p, 2·(j % PANEL) + e], zeros in the padding."""
    K, N = b.shape
    nb, P = -(-N // bf16.PANEL), -(-K // 2)
    R = np.zeros((2 * P, nb * bf16.PANEL), np.uint16)
    R[:K, :N] = bf16.round_bf16_bits(b)
    return R.reshape(P, 2, nb, bf16.PANEL).transpose(2, 0, 3, 1).reshape(1, nb, P, 2 * bf16.PANEL)


@pytest.mark.parametrize("K,N", [(1, 1), (7, 70), (64, 64), (130, 129), (33, 200)])
def test_packing_layouts_bit_for_bit(K, N, monkeypatch):
    """pack_b from both memory orders (x·Wᵀ packs Wᵀ, a view; dY·W packs W) and pack_a's rows, pairs (a
    transposed view) and rows of a transposed view (beyond PAIRS_MAX_BYTES) against their layouts made by
    NumPy, bit for bit: odd K, N off the panel width, the rounding's edge cases and NaNs among the values."""
    rng = np.random.default_rng(K * N)
    b = rng.standard_normal((K, N)).astype(np.float32)
    special = f32(list(EDGES) + NANS)
    b.reshape(-1)[:min(b.size, special.size)] = special[:b.size]
    want = packed_b_reference(b)
    for view in (b, np.ascontiguousarray(b.T).T):
        assert (bf16.pack_b(view) == want).all()
    rows = bf16.round_bf16_bits(b)                                                  # a = b: [M=K, N]
    padded = np.zeros((K, N + N % 2), np.uint16)
    padded[:, :N] = rows
    got, rs, ps = bf16.pack_a(b)
    assert (rs, ps) == ((N + 1) // 2, 1) and (got[0] == padded.reshape(-1)).all()
    got, rs, ps = bf16.pack_a(np.ascontiguousarray(b.T).T)                          # pairs: [Np/2, M, 2]
    assert (rs, ps) == (1, K) and (got[0] == padded.reshape(K, -1, 2).transpose(1, 0, 2).reshape(-1)).all()
    monkeypatch.setattr(bf16, "PAIRS_MAX_BYTES", 0)                                   # a large transposed a
    got, rs, ps = bf16.pack_a(np.ascontiguousarray(b.T).T)
    assert (rs, ps) == ((N + 1) // 2, 1) and (got[0] == padded.reshape(-1)).all()


# ---- the products ---------------------------------------------------------------------------------------------
def reference(a, b):
    """a @ b of the bf16-rounded operands, in float64."""
    return bf16.round_bf16(a).astype(np.float64) @ bf16.round_bf16(b).astype(np.float64)


def close(out, a, b):
    """out equals the float64 product of the rounded operands to float32 accumulation: each output
    within K float32 ulps of its sum of |products|."""
    K = a.shape[-1]
    scale = np.abs(bf16.round_bf16(a)).astype(np.float64) @ np.abs(bf16.round_bf16(b)).astype(np.float64)
    return bool((np.abs(out - reference(a, b)) <= K * 2 ** -24 * scale + 1e-30).all())


@needs_bf16
@pytest.mark.parametrize("M,K,N", [(1, 1, 1), (5, 3, 7), (6, 64, 64), (13, 130, 129), (7, 2 * bf16.KC * 2 + 3, 70)])
def test_matmul_every_form(M, K, N):
    """x·Wᵀ, dY·W, dYᵀ·X: row-major, transposed and strided operands; M, K, N off every block size."""
    rng = np.random.default_rng(M * 1000 + K)
    a, b = rng.standard_normal((M, K)).astype(np.float32), rng.standard_normal((K, N)).astype(np.float32)
    for x, y in [(a, b), (np.asfortranarray(a), b), (a, np.asfortranarray(b)),      # Fortran = a transposed view
                 (np.ascontiguousarray(a.T).T, np.ascontiguousarray(b.T).T)]:
        out = np.full((M, N), np.nan, np.float32)
        bf16.matmul(x, y, out)
        assert close(out, a, b)
    wide = np.full((M, N + 5), np.nan, np.float32)                                # out: a row-strided view
    bf16.matmul(a, b, wide[:, 2:N + 2])
    assert close(wide[:, 2:N + 2], a, b) and np.isnan(wide[:, :2]).all() and np.isnan(wide[:, N + 2:]).all()
    start = rng.standard_normal((M, N)).astype(np.float32)                         # add: out += a @ b
    scale = np.abs(bf16.round_bf16(a)).astype(np.float64) @ np.abs(bf16.round_bf16(b)) + np.abs(start)
    for x in (a, np.asfortranarray(a)):
        out = start.copy()
        bf16.matmul(x, b, out, add=True)                                            # (the sum starts at out)
        assert (np.abs(out - (start + reference(a, b))) <= (K + 1) * 2 ** -24 * scale).all()


@needs_bf16
def test_matmul_batched_attention_forms():
    """q·kᵀ, P·v, dS·k, dSᵀ·q, Pᵀ·dy as the engine calls them: batched [I, ., .] with transposed views."""
    rng = np.random.default_rng(1)
    I, GT, T, hd = 3, 10, 5, 8
    q, k = rng.standard_normal((I, GT, hd)).astype(np.float32), rng.standard_normal((I, T, hd)).astype(np.float32)
    P = rng.standard_normal((I, GT, T)).astype(np.float32)
    for a, b in [(q, k.transpose(0, 2, 1)), (P, k), (P.transpose(0, 2, 1), q)]:
        out = np.empty((I, a.shape[1], b.shape[2]), np.float32)
        bf16.matmul(a, b, out)
        assert all(close(out[i], a[i], b[i]) for i in range(I))


@needs_bf16
def test_matmul_rounds_the_operands():
    """The result is the product of the rounded operands, not of the float32 ones (1 + 2⁻⁸ is a tie to 1)."""
    a = np.full((2, 4), 1 + 2 ** -8, np.float32)
    b = np.full((4, 3), 1 + 3 * 2 ** -8, np.float32)
    out = np.empty((2, 3), np.float32)
    bf16.matmul(a, b, out)
    assert (out == np.float32(4 * (1 + 2 ** -6))).all()


@needs_bf16
def test_rows_do_not_depend_on_their_batch():
    rng = np.random.default_rng(2)
    a, b = rng.standard_normal((20, 300)).astype(np.float32), rng.standard_normal((300, 90)).astype(np.float32)
    whole, one = np.empty((20, 90), np.float32), np.empty((1, 90), np.float32)
    bf16.matmul(a, b, whole)
    for r in (0, 7, 19):
        bf16.matmul(a[r:r + 1], b, one)
        assert (one[0] == whole[r]).all()


# ---- the engine in bf16 ------------------------------------------------------------------------------------
def _grads(model, tokens, mask):
    head0, objective, grads = model.loss_and_grads(tokens, mask)
    return head0, {k: v.copy() for k, v in grads.items()}


def _far_model(arch, seed=4):
    cfg = tiny_config(vocab_size=70, dim=32, n_heads=2, n_kv_heads=1 if arch == "euler" else 2, n_layers=2,
                      ctx_len=16, ffn_hidden=48, n_mtp=2, arch=arch)
    rng = np.random.default_rng(seed)
    m = Model.init(cfg, seed=seed)
    for p in m.params.values():
        p += rng.standard_normal(p.shape).astype(np.float32) * (0.3 if p.ndim == 1 else 0.1)
    tokens = rng.integers(0, cfg.vocab_size, (4, cfg.ctx_len + cfg.n_mtp))
    return m, tokens, rng.random(tokens.shape) > 0.2


@needs_bf16
@pytest.mark.parametrize("arch", ["euler", "gpt2", "gemma2", "gptneox"])
def test_engine_products_are_the_rounded_operands_products(arch, monkeypatch):
    """The bf16 step with its kernels equals the same step with every product replaced by the float64
    product of the same rounded operands (the twin's, cast back to float32): to float32 accumulation, where
    the f32 step is ~1e-2 away. And no product of the bf16 step runs on float32 BLAS."""
    from nanoeuler.fast import engine
    m, tokens, mask = _far_model(arch)
    _, g_f32 = _grads(m, tokens, mask)
    monkeypatch.setattr(engine, "matmul", None)               # engine's float32 BLAS: any use raises TypeError
    _, g = _grads(m.set_precision("bf16"), tokens, mask)
    m._fast_ws = None                                         # a new workspace, on the twin's products
    monkeypatch.setattr(bf16, "KERNELS", bf16.TWIN)
    _, g_twin = _grads(m, tokens, mask)
    for name in g:
        if name.endswith("attn.wk.bias"):  # gpt2: 0 in exact arithmetic (softmax ignores a per-row constant)
            continue
        # against the tensor's largest entry (floor 1): the kernels' and the twin's float32 sums differ in
        # order only, the float32 products by bf16 rounding (per entry, small entries read up to 1e-4)
        assert (rel_err(g[name], g_twin[name], floor=1.0) < 2e-6 < 1e-3 < rel_err(g_f32[name], g_twin[name], floor=1.0)
                and rel_err(g[name], g_twin[name]) < 1e-3), name


@needs_bf16
def test_engine_bf16_is_deterministic_and_not_f32():
    cfg = tiny_config(vocab_size=50, dim=32, n_heads=4, n_kv_heads=2, n_layers=2, ctx_len=12, ffn_hidden=40)
    m = Model.init(cfg, seed=0)
    tokens = np.random.default_rng(0).integers(0, 50, (3, 12 + cfg.n_mtp))
    l0, g0 = _grads(m, tokens, None)
    m.set_precision("bf16")
    l1, g1 = _grads(m, tokens, None)
    l2, g2 = _grads(m, tokens, None)
    assert l1 == l2 and all(np.array_equal(g1[k], g2[k]) for k in g1)       # bit for bit, step after step
    assert l1 != l0 and abs(l1 - l0) < 1e-2                                 # bf16 ran, and stayed close


def test_refused_without_avx512_bf16(monkeypatch, capsys, tmp_path):
    from test_cli_errors import one_line_error
    monkeypatch.setattr(bf16, "AVAILABLE", False)
    cfg = tiny_config()
    with pytest.raises(UserError, match="AVX512_BF16"):
        Workspace(cfg, 2, 4, np.float32, "bf16")
    with pytest.raises(UserError, match="AVX512_BF16"):
        Model.init(cfg).set_precision("bf16")
    Model.init(cfg).astype(np.float64).set_precision("bf16")              # the NumPy twin needs no instruction
    line = one_line_error(["bench", "small", "--steps", "1", "--warmup", "0", "--precision", "bf16"], capsys)
    assert "AVX512_BF16" in line
    line = one_line_error(["train", "small", "--precision", "bf16", "--out", tmp_path / "run"], capsys)
    assert "AVX512_BF16" in line and not (tmp_path / "run").exists()
    line = one_line_error(["demo", "--precision", "bf16", "--out", tmp_path / "demo"], capsys)
    assert "AVX512_BF16" in line and not (tmp_path / "demo").exists()


def _train(out, steps, stop_after=None, resume=False, precision="bf16"):
    """The tiny model trained on synthetic batches into out (or resumed there)."""
    from train_fixtures import TINY, SyntheticSource
    from nanoeuler.training.train import TrainConfig, run_training
    model = (Model.load(out) if resume else Model.init(TINY, seed=0)).set_precision(precision)
    tcfg = TrainConfig(steps=steps, batch_size=4, lr=1e-2, warmup=2, eval_every=4, eval_batches=0, ckpt_every=3)
    return run_training(model, None, SyntheticSource(), out, tcfg, resume=resume, stop_after=stop_after,
                        progress=False)


def _same_run(a, b) -> bool:
    """Two run directories hold the same float32 weights and AdamW moments, bit for bit."""
    from safetensors.numpy import load_file
    for name in ("model.safetensors", "optimizer.safetensors"):
        ta, tb = load_file(str(a / name)), load_file(str(b / name))
        if not all(ta[k].dtype == np.float32 and np.array_equal(ta[k], tb[k]) for k in ta):
            return False
    return True


def _recorded_precision(run):
    import json
    return json.loads((run / "trainer.json").read_text())["precision"]


def test_bf16_training_keeps_float32_master_weights(tmp_path, monkeypatch):
    """Only the products' operands are bfloat16: the weights the optimizer updates (and the checkpoint) stay
    float32, so an update smaller than half a bfloat16 step of its weight is kept, not rounded away. The
    kernels' float64 twin stands in for them, so this runs on any CPU."""
    from safetensors.numpy import load_file
    monkeypatch.setattr(bf16, "AVAILABLE", True)
    monkeypatch.setattr(bf16, "KERNELS", bf16.TWIN)

    def no_kernel(*args):    # the AVX512_BF16 kernels compiled on a CPU without it abort the process
        raise AssertionError("the bf16 kernels ran where the twin stands in for them")
    monkeypatch.setattr(bf16, "_gemm", no_kernel)
    from train_fixtures import TINY, SyntheticSource
    from nanoeuler.training.train import TrainConfig, run_training
    model = Model.init(TINY, seed=0)
    before = {n: p.copy() for n, p in model.params.items()}
    tcfg = TrainConfig(steps=2, batch_size=4, lr=1e-6, warmup=0, eval_every=2, eval_batches=1, ckpt_every=2)
    run_training(model.set_precision("bf16"), None, SyntheticSource(), tmp_path / "run", tcfg, progress=False)
    saved = load_file(str(tmp_path / "run" / "model.safetensors"))
    for name, w0 in before.items():
        w1 = model.params[name]
        assert w1.dtype == np.float32 and np.array_equal(saved[name], w1), name
        half_step = np.ldexp(np.float32(1), np.frexp(w0)[1] - 9)     # half the bfloat16 spacing at each weight
        small = (w1 != w0) & (np.abs(w1 - w0) < half_step)
        assert small.mean() > 0.5, name           # lr 1e-6: updates far below it, and they count
        assert not np.array_equal(bf16.round_bf16(w1), w1), name      # not weights held in bfloat16


@needs_bf16
def test_bf16_run_resumes_bit_for_bit_and_records_its_precision(tmp_path):
    _train(tmp_path / "a", 6)
    _train(tmp_path / "b", 6, stop_after=3)
    with pytest.raises(UserError, match="precision bf16, not f32"):
        _train(tmp_path / "b", 6, resume=True, precision="f32")
    _train(tmp_path / "b", 6, resume=True)
    assert _same_run(tmp_path / "a", tmp_path / "b")
    assert _recorded_precision(tmp_path / "b") == "bf16"


def test_precision_is_spelled_f32_and_a_run_recorded_as_fp32_resumes(tmp_path, capsys):
    """SPEC's spelling `--precision f32|bf16` is the only one; a trainer.json written before the rename
    (precision "fp32") resumes as the f32 run it is, bit for bit, and is saved with the new spelling."""
    from test_cli_errors import one_line_error
    line = one_line_error(["bench", "small", "--steps", "1", "--warmup", "0", "--precision", "fp32"], capsys)
    assert "invalid choice: 'fp32'" in line
    _train(tmp_path / "a", 6, precision="f32")
    _train(tmp_path / "b", 6, stop_after=3, precision="f32")
    trainer_json = tmp_path / "b" / "trainer.json"
    trainer_json.write_text(trainer_json.read_text().replace('"precision": "f32"', '"precision": "fp32"'))
    assert _recorded_precision(tmp_path / "b") == "fp32"
    _train(tmp_path / "b", 6, resume=True, precision="f32")
    assert _same_run(tmp_path / "a", tmp_path / "b")
    assert _recorded_precision(tmp_path / "b") == "f32"



@needs_bf16
def test_check_rows_hold_and_catch_a_backward_without_rounding(monkeypatch):
    from nanoeuler.training.check import TOLERANCE, check_bf16
    rows = check_bf16(seed=1)
    assert len(rows) == 4 and all(r.max_rel_error < TOLERANCE for r in rows)
    monkeypatch.setattr(bf16, "matmul", lambda a, b, out: np.matmul(a, b, out=out))   # float32, unrounded
    assert all(r.max_rel_error > 1e-4 for r in check_bf16(seed=1))


@needs_bf16
def test_dpo_head_products_in_bf16():
    """DPO's own head-0 products (dpo.py, outside the engine's step) are bf16 products too."""
    from nanoeuler.training import dpo
    cfg = tiny_config(vocab_size=50, dim=32, n_heads=4, n_kv_heads=2, n_layers=1, ctx_len=12, ffn_hidden=40)
    P = Model.init(cfg, seed=2).params
    rng = np.random.default_rng(5)
    inputs, targets = rng.integers(0, 50, (2, 12)), rng.integers(0, 50, (2, 12))
    mask = rng.random((2, 12)) > 0.3
    logps, cache = dpo.sequence_logprobs_forward(cfg, P, inputs, targets, mask,
                                                 dpo.Workspaces(cfg, np.float32, "bf16"))
    ws, W0 = cache[4], P["heads.0.weight"]
    hf = ws.hf.copy()
    logits = reference(hf, W0.T).astype(np.float32).reshape(2, 12, -1)
    expected, lp_cache = dpo.response_logprobs_forward(logits, targets, mask)
    assert np.abs(expected - logps).max() < 1e-4
    grads = dpo.sequence_logprobs_backward(np.ones(2), cache)
    dlogits = dpo.response_logprobs_backward(np.ones(2), lp_cache).reshape(ws.N, -1).astype(np.float32)
    assert rel_err(grads["heads.0.weight"], reference(dlogits.T, hf)) < 1e-5


# ---- LoRA in bf16 ------------------------------------------------------------------------------------------
def _far_lora(arch, dropout=0.0):
    from nanoeuler import adapters as ad
    from nanoeuler.training.lora import LoraModel
    m, tokens, mask = _far_model(arch)
    lcfg = ad.LoraConfig(4, 8.0, (), dropout).check(m.config)
    adapters = ad.init_adapters(m.config, lcfg, 1)
    for a in adapters.values():
        a += np.random.default_rng(2).standard_normal(a.shape).astype(np.float32) * 0.2
    return LoraModel(m, lcfg, adapters, {"path": "", "sha256": ""}), tokens, mask


@needs_bf16
@pytest.mark.parametrize("arch", ["euler", "gpt2"])
def test_lora_step_products_are_the_rounded_operands_products(arch, monkeypatch):
    """bf16 + LoRA: the frozen weights' products and the adapters' small ones (on the fly, with adapter
    dropout) take bfloat16 operands, as in the full step: the step equals its twin with float64 products of
    the same rounded operands, where the fp32 step is ~1e-2 away; no product runs on float32 BLAS."""
    from nanoeuler import ops
    from nanoeuler.fast import engine
    m, tokens, mask = _far_lora(arch, dropout=0.2)
    drop = ops.Dropout(0.2, seed=3)
    g_fp32 = m.loss_and_grads(tokens, mask, adapter_dropout=drop)[2]
    with monkeypatch.context() as mp:
        mp.setattr(engine, "matmul", None)                    # engine's float32 BLAS: any use raises TypeError
        mp.setattr(np, "matmul", None)                        # ... and NumPy's (the adapters' products)
        g = m.set_precision("bf16").loss_and_grads(tokens, mask, adapter_dropout=drop)[2]
    m._ws = None                                              # a new workspace, on the twin's products
    monkeypatch.setattr(bf16, "KERNELS", bf16.TWIN)
    g_twin = m.loss_and_grads(tokens, mask, adapter_dropout=drop)[2]
    assert set(g) == set(m.params)
    for name in g:
        assert (rel_err(g[name], g_twin[name], floor=1.0) < 2e-6 < 1e-3 < rel_err(g_fp32[name], g_twin[name], floor=1.0)
                and rel_err(g[name], g_twin[name]) < 1e-3), name


def test_check_leaves_out_the_bf16_rows_without_avx512_bf16(monkeypatch, capsys):
    """`nanoeuler check` on a CPU without the instruction: no bf16 rows (nothing to check), and a note says so."""
    from nanoeuler.cli.check import bf16_rows
    monkeypatch.setattr(bf16, "AVAILABLE", False)
    assert bf16_rows(seed=1) == []
    assert "no AVX512_BF16" in capsys.readouterr().err
