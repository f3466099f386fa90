"""Block-quantized weights (nanoeuler/infer/quant.py) and their integer matrix products
(nanoeuler/infer/qkernels.py): our Q8_0 / Q4_0 / Q4_1 bytes equal gguf.quants' bit for bit (random, extreme,
all-zero, tiny and tied blocks), the kernel form holds the same integers, the VNNI product equals the float64
product of the dequantized weights and the dequantized 8-bit activations to float32 rounding (and is near
the plain float product), any thread count and row grouping give the same bits, and a CPU without VNNI is
refused in one line. Then the quantized step (infer/weights.py QuantizedModel through infer/kernels.py):
equal to the NumPy reference on the dequantized weights with 8-bit activations, the GGUF export's bytes,
greedy decoding the same in every mode, thread count and the batcher, `sample --dtype`, an imported GGUF
decoded in its own type, and llama.cpp's logits and greedy tokens on the same file."""
import numpy as np
import pytest
from conftest import rel_err, tiny_config
from numba import njit

from nanoeuler import Model
from nanoeuler.errors import UserError
from nanoeuler.infer import forward as reference, kernels, quant
from nanoeuler.infer import qkernels as qk
from nanoeuler.infer.cache import new_cache
from nanoeuler.infer.session import generate
from nanoeuler.infer.step import forward_cached, forward_hidden, fuse_weights
from nanoeuler.infer.weights import QuantizedModel, for_dtype

gguf_quants = pytest.importorskip("gguf.quants")
from gguf import GGMLQuantizationType  # noqa: E402

needs_vnni = pytest.mark.skipif(not qk.AVAILABLE, reason="this CPU has no AVX512-VNNI")
TYPES = ("q8_0", "q4_0", "q4_1")


def blocks_to_test(rng):
    """Matrices [rows, 64] of random, extreme, all-zero, tiny (subnormal) and tied values."""
    normal = rng.standard_normal((9, 64)).astype(np.float32)
    extreme = (rng.standard_normal((3, 64)) * 1e4).astype(np.float32).clip(-6e4, 6e4)
    extreme[0, 5], extreme[1, 40] = 6.5e4, -6.5e4    # near float16's top (Q4_1 keeps the minimum in it)
    tiny = (rng.standard_normal((2, 64)) * 1e-41).astype(np.float32)  # float32 subnormals
    ties = np.tile(np.float32([0.5, -0.5, 1.5, -2.5, 127, -127, 8, -8]), (2, 8)) * np.float32(0.25)
    steps = (np.arange(128, dtype=np.float32).reshape(2, 64) - 64) / np.float32(8)  # exact multiples
    return [normal, extreme, np.zeros((2, 64), np.float32), tiny, ties, steps, -normal[:1]]


@pytest.mark.parametrize("name", TYPES)
def test_quantize_equals_gguf_bit_for_bit(name):
    gtype = GGMLQuantizationType[name.upper()]
    for W in blocks_to_test(np.random.default_rng(1)):
        ours, theirs = quant.quantize(W, name), gguf_quants.quantize(W, gtype)
        assert ours.dtype == np.uint8 and ours.shape == theirs.shape
        np.testing.assert_array_equal(ours, theirs)
        np.testing.assert_array_equal(quant.dequantize(ours, name, W.shape[1]), gguf_quants.dequantize(theirs, gtype))


def test_table_bytes_per_weight_and_file_type_numbers():
    got = {n: (t.bytes_per_weight, t.ggml) for n, t in quant.WTYPES.items()}
    assert got == {"float32": (4, 0), "float16": (2, 1), "q8_0": (1.0625, 8), "q4_0": (0.5625, 2),
                   "q4_1": (0.625, 3)}
    for name in TYPES:
        t = quant.WTYPES[name]
        assert t.nbytes == gguf_quants.GGML_QUANT_SIZES[GGMLQuantizationType(t.ggml)][1]


def test_quantize_refuses_what_it_cannot_hold():
    with pytest.raises(UserError, match="multiple of 32"):
        quant.quantize(np.ones((2, 40), np.float32), "q8_0")
    with pytest.raises(UserError, match="not finite"):
        quant.quantize(np.float32([[np.inf] + [0] * 31]), "q4_0")
    with pytest.raises(UserError, match="too large"):
        quant.quantize(np.full((1, 32), 3e38, np.float32), "q8_0")
    with pytest.raises(UserError, match="unknown weight type"):
        quant.wtype("q5_k")


def test_activation_quantization_kernel_equals_numpy():
    X = np.random.default_rng(2).standard_normal((5, 96)).astype(np.float32)
    X[1, :32] = 0                                                   # an all-zero block
    X[2, 32:64] = np.float32(127) * np.arange(32, dtype=np.float32) / 2  # ties at .5: to even
    X[3] *= np.float32(1e4) ** np.arange(-3, 3).repeat(16)               # blocks of scales 1e-12 .. 1e8
    want = quant.quantize_x8(X)
    got = np.empty((5, 96), np.int8), np.empty((5, 3), np.float32), np.empty((5, 3), np.float32)
    qk.quantize_x(X, *got)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    assert want[1][1, 0] == 0 and (want[0][1, :32] == 0).all()


@pytest.mark.parametrize("name", TYPES)
def test_pack_holds_the_integers_and_scales(name):
    """Unpacking the kernel form by its documented layout gives back every weight's integer and scale."""
    O, I = 70, 64
    B = quant.quantize(np.random.default_rng(3).standard_normal((O, I)), name)
    Wk = qk.pack(B, name, I)
    head, body, offset = qk._layout(qk.KINDS[name])
    assert Wk.shape == (2, 2, head + body)
    d = Wk[..., :2 * qk.PANEL].copy().view(np.float16).astype(np.float32)  # [P, nb, 64]
    d = d.transpose(0, 2, 1).reshape(-1, 2)[:O]
    raw = Wk[..., head:].reshape(2, 2, qk.VECS, -1, qk.LANES, 4)         # [P, nb, v, s, j, k]
    if name == "q8_0":
        q = raw.transpose(0, 2, 4, 1, 3, 5).reshape(-1, I)
    else:
        both = np.stack([raw & 15, raw >> 4], axis=4)                     # [P, nb, v, s, h, j, k]
        q = both.transpose(0, 2, 5, 1, 3, 4, 6).reshape(-1, I)
    W = (q[:O].astype(np.float32) - offset).reshape(O, 2, 32) * d[..., None]
    if name == "q4_1":
        m = Wk[..., 2 * qk.PANEL:4 * qk.PANEL].copy().view(np.float16).astype(np.float32)
        W = W + m.transpose(0, 2, 1).reshape(-1, 2)[:O, :, None]
    np.testing.assert_array_equal(W.reshape(O, I), quant.dequantize(B, name, I))
    assert not Wk[1, :, :head].view(np.float16).reshape(2, -1, 64)[:, :, O - 64:].any()  # padding: zero scales


_P8, _P40, _P41 = (qk._panel_intrinsic(kind, vnni=False) for kind in (3, 4, 5))


@njit
def _portable_panel(kind, k, w, xq, xd, xs, t, nb, n_in):
    if kind == 3:
        _P8(k, w, xq, xd, xs, t, nb, n_in)
    elif kind == 4:
        _P40(k, w, xq, xd, xs, t, nb, n_in)
    else:
        _P41(k, w, xq, xd, xs, t, nb, n_in)


@needs_vnni
@pytest.mark.parametrize("name", TYPES)
def test_the_portable_panel_equals_vnni(name):
    """Without AVX512-VNNI the kernels compile `vpdpbusd` as portable IR (every decoding kernel compiles the
    quantized branch, float models too): the same integers, so the same bits."""
    rng = np.random.default_rng(9)
    I = 96
    Wk = qk.pack(quant.quantize(rng.standard_normal((qk.PANEL, I)), name), name, I)
    X = rng.standard_normal((3, I)).astype(np.float32)
    xq, xd, xs = np.empty((3, I), np.int8), np.empty((3, I // 32), np.float32), np.empty((3, I // 32), np.float32)
    qk.quantize_x(X, xq, xd, xs)
    for k in (1, 3):  # (one row: Q4_x's high nibbles are multiplied in place, 16 q, and shifted back)
        T = np.zeros((qk.MAX_R, qk.PANEL), np.float32)
        _portable_panel(qk.KINDS[name], k, Wk.ctypes.data, xq.ctypes.data, xd.ctypes.data, xs.ctypes.data,
                        T.ctypes.data, I // 32, I)
        np.testing.assert_array_equal(T[:k], kernels.matvec(Wk, X[:k], qk.PANEL))


def quantized_reference(B, name, X):
    """float64: the dequantized weights times the dequantized 8-bit activations."""
    n, I = X.shape
    xq, xd, _ = quant.quantize_x8(X)
    Xd = (xq.reshape(n, -1, 32).astype(np.float64) * xd[..., None]).reshape(n, I)
    return Xd @ quant.dequantize(B, name, I).astype(np.float64).T


@needs_vnni
@pytest.mark.parametrize("name", TYPES)
def test_quantized_product_equals_dequantized_float_product(name):
    """At 1..20 rows (the kernels run MAX_R rows per pass over a panel, so every remainder occurs): the
    float64 product of the dequantized weights and activations to float32 rounding, each row the same bits
    whichever rows share its passes; and off the product of the float activations by what rounding them to
    nearest predicts."""
    rng = np.random.default_rng(4)
    O, I = 150, 256
    W = rng.standard_normal((O, I)).astype(np.float32) * np.float32(0.05)
    W[3, :32] += np.float32(1.5)          # a block with an offset (Q4_1's minimum) and a large scale
    X = rng.standard_normal((20, I)).astype(np.float32)
    B = quant.quantize(W, name)
    Wk = qk.pack(B, name, I)
    Y = kernels.matvec(Wk, X, O)
    ref = quantized_reference(B, name, X)
    assert Y.dtype == np.float32 and Y.shape == (20, O)
    assert np.abs(Y - ref).max() <= 2e-6 * np.abs(ref).max()
    for n in range(1, 20):
        np.testing.assert_array_equal(kernels.matvec(Wk, X[20 - n:], O), Y[20 - n:])
    # beside float activations on the same weights, only the activations' 8-bit rounding differs: to nearest,
    # each element is off by an error uniform in ±step/2 (variance step²/12, step = the block's max|x| / 127),
    # and the summed square of Y's errors is what those predict (0.82 of it here; rounding toward zero: 5.8)
    Wd = quant.dequantize(B, name, I).astype(np.float64)
    step = np.abs(X.reshape(20, -1, 32)).max(-1).astype(np.float64) / 127                      # [20, I / 32]
    predicted = (step[:, None, :] ** 2 / 12 * (Wd.reshape(O, -1, 32) ** 2).sum(-1)[None]).sum()
    assert 0.5 <= ((Y - X.astype(np.float64) @ Wd.T) ** 2).sum() / predicted <= 1.25


@needs_vnni
@pytest.mark.parametrize("name", TYPES)
def test_same_bits_for_any_thread_count_and_row_grouping(name):
    rng = np.random.default_rng(5)
    O, I = 64 * 5 + 7, 96
    B = quant.quantize(rng.standard_normal((O, I)), name)
    Wk = qk.pack(B, name, I)
    X = rng.standard_normal((6, I)).astype(np.float32)
    old = kernels.get_threads()
    try:
        kernels.set_threads(1)
        one = kernels.matvec(Wk, X, O)
        for threads in (2, 3):
            kernels.set_threads(threads)
            np.testing.assert_array_equal(kernels.matvec(Wk, X, O), one)
    finally:
        kernels.set_threads(old)
    for r in range(6):  # a row alone = the row among 4 and 2 others
        np.testing.assert_array_equal(kernels.matvec(Wk, X[r:r + 1], O), one[r:r + 1])


@pytest.mark.parametrize("name", ("q8_0", "q4_0"))
def test_requantizing_dequantized_blocks_gives_the_same_bytes(name):
    """An imported GGUF's Q8_0 / Q4_0 tensors are kept as float32 values; quantizing those again at load
    gives back the file's bytes (the block's largest entry is exactly ±127·d, resp. -8·d). (An all-zero
    Q4_0 block's scale can come back as +0 for -0: the same weights.)"""
    W = np.random.default_rng(6).standard_normal((64, 256)).astype(np.float32)
    B = gguf_quants.quantize(W, GGMLQuantizationType[name.upper()])
    np.testing.assert_array_equal(quant.quantize(quant.dequantize(B, name, 256), name), B)


@pytest.mark.parametrize("name", TYPES)
def test_gguf_export_writes_our_quantization(name, tmp_path):
    """`export --format gguf --dtype q8_0|q4_0|q4_1`: every matrix in the file is our quantize of it."""
    import gguf
    from gguf_fixtures import chatml_model, chatml_tokenizer

    from nanoeuler.interop.gguf_export import export_gguf, gguf_tensors
    tok = chatml_tokenizer()
    m = chatml_model(tok)
    reader = gguf.GGUFReader(str(export_gguf(m, tok, tmp_path / "m.gguf", name, progress=False)))
    T = gguf_tensors(m)
    mats = [t for t in reader.tensors if T[t.name].ndim == 2]
    assert mats and all(t.tensor_type.name == name.upper() for t in mats)
    for t in mats:
        np.testing.assert_array_equal(np.asarray(t.data).reshape(-1), quant.quantize(T[t.name], name).reshape(-1))


# ---- the quantized step (infer/weights.py QuantizedModel, infer/kernels.py) ---------------------------------

# widths that are multiples of 32 (block types need them); outputs (qkv 128, vocab 53) that are not of PANEL
QCFG = tiny_config(vocab_size=53, dim=64, n_heads=4, n_kv_heads=2, n_layers=2, ctx_len=24, ffn_hidden=96, n_mtp=2)


def qmodel(seed=0):
    """Random weights a few times the init's size (logits spread, argmaxes far from ties), norm weights
    spread around 1 (with all-ones norms a Q4_0 embedding row, d·(q - 8), reaches the 8-bit activation
    rounding at exact halves, x·127/max = 15.875·(q - 8), where float32 rounding decides the side)."""
    m = Model.init(QCFG, seed=seed)
    rng = np.random.default_rng(seed)
    for name, p in m.params.items():
        if "norm" in name:
            p[...] = rng.uniform(0.5, 1.5, p.shape)
        else:
            p *= 4.0
    return m


def logits(m, ids, fused, monkeypatch):
    monkeypatch.setattr(kernels, "ENABLED", fused)
    W = fuse_weights(QCFG, m.params)
    monkeypatch.setattr(kernels, "ENABLED", True)
    assert ("decode" in W) == fused
    return forward_cached(QCFG, None, ids, new_cache(QCFG), fused=W)  # [K, 1, n, V]


def quantized_activations(linear):
    """forward.py's `linear` with its input rows rounded as the kernels round them (8 bits per block of 32)."""
    def wrapped(x, W):
        rows = x.reshape(-1, x.shape[-1]).astype(np.float32)
        q, d, _ = quant.quantize_x8(rows)
        xq = (q.reshape(len(rows), -1, 32).astype(np.float32) * d[..., None]).reshape(x.shape)
        return linear(xq, W)
    return wrapped


@needs_vnni
@pytest.mark.parametrize("name", TYPES)
def test_quantized_step_equals_dequantized_float_step(name, monkeypatch):
    """The fused step on the quantized weights = the NumPy reference on their dequantized values with the
    activations of every product rounded to 8 bits the same way, to float32 rounding; the plain float
    reference (float activations) is an order of magnitude further."""
    qm = QuantizedModel(qmodel(), name)
    ids = np.random.default_rng(7).integers(0, QCFG.vocab_size, (1, 11))
    got = logits(qm, ids, True, monkeypatch)
    plain = logits(qm, ids, False, monkeypatch)
    monkeypatch.setattr(reference, "linear", quantized_activations(reference.linear))
    want = logits(qm, ids, False, monkeypatch)
    l2 = np.linalg.norm(got - plain) / np.linalg.norm(plain)  # 8-bit activations: ~0.4 % per element
    assert rel_err(got, want) <= 1e-4
    assert rel_err(got, plain) > 10 * rel_err(got, want)
    assert l2 <= 2e-2


def batch_logits(W, cache, tokens, pos):
    """step.decode_rows on a copy of cache (every call sees the same keys and values)."""
    from nanoeuler.infer.step import decode_rows
    c = new_cache(QCFG, batch=cache.store[0].shape[1])
    c.store[0][...], c.store[1][...] = cache.store[0], cache.store[1]
    return decode_rows(QCFG, W, c, tokens, pos)


@needs_vnni
@pytest.mark.parametrize("name", TYPES)
def test_quantized_batch_step_equals_dequantized_float_step_at_any_row_count(name, monkeypatch):
    """serve's batched step (one token per cache row, each at its own position) on quantized weights at
    1..20 rows: the same bits at 1, 2 and 3 threads, each row the same bits as that row stepped alone, and
    the NumPy reference on the dequantized weights with 8-bit activations to float32 rounding (per row,
    relative L2). The two compute the activations to float32 rounding apart, so where one lies on a
    rounding boundary of its 8-bit step the two sides round it apart: a few rows in a hundred, still far
    closer than the plain float reference (float activations) is."""
    from nanoeuler.infer import step
    qm = QuantizedModel(qmodel(seed=5), name)
    rng = np.random.default_rng(11)
    cache = new_cache(QCFG, batch=20)
    for kv in cache.store[:2]:
        kv[...] = rng.standard_normal(kv.shape).astype(np.float32)
    fused = fuse_weights(QCFG, qm.params, batched=True)
    monkeypatch.setattr(kernels, "ENABLED", False)
    ref_w = fuse_weights(QCFG, qm.params, batched=True)
    monkeypatch.setattr(kernels, "ENABLED", True)
    assert "decode" in fused and "decode" not in ref_w
    errs, plain_errs = [], []
    old = kernels.get_threads()
    try:
        for n in range(1, 21):
            tokens, pos = rng.integers(0, QCFG.vocab_size, n), rng.integers(0, QCFG.ctx_len, n)
            kernels.set_threads(1)
            one = batch_logits(fused, cache, tokens, pos)
            for threads in (2, 3):
                kernels.set_threads(threads)
                np.testing.assert_array_equal(batch_logits(fused, cache, tokens, pos), one)
            r = n // 2  # row r alone: its cache row copied to row 0
            alone = new_cache(QCFG, batch=1)
            for a, b in zip(alone.store[:2], cache.store[:2]):
                a[:, 0] = b[:, r]
            np.testing.assert_array_equal(batch_logits(fused, alone, tokens[r:r + 1], pos[r:r + 1]), one[r:r + 1])
            plain = batch_logits(ref_w, cache, tokens, pos)
            with monkeypatch.context() as m:
                m.setattr(reference, "batched_linear", quantized_activations(reference.batched_linear))
                m.setattr(step, "batched_linear", quantized_activations(step.batched_linear))
                want = batch_logits(ref_w, cache, tokens, pos)
            errs += [np.linalg.norm(a - b) / np.linalg.norm(b) for a, b in zip(one, want)]
            plain_errs += [np.linalg.norm(a - b) / np.linalg.norm(b) for a, b in zip(one, plain)]
    finally:
        kernels.set_threads(old)
    errs, plain_errs = np.array(errs), np.array(plain_errs)
    assert len(errs) == 210 and np.sum(errs > 1e-6) <= len(errs) // 20
    assert np.median(plain_errs) > 1000 * np.median(errs) and errs.max() < 2 * plain_errs.max()


@needs_vnni
@pytest.mark.parametrize("name", TYPES)
def test_quantized_model_holds_the_gguf_export_bytes(name, tmp_path):
    """QuantizedModel(m, t)'s matrices are the bytes `export --format gguf --dtype t` writes for m."""
    import gguf

    from nanoeuler.interop.gguf_export import gguf_tensors
    from nanoeuler.interop.gguf_import import load_gguf
    from gguf_fixtures import chatml_model, chatml_tokenizer
    tok = chatml_tokenizer()
    m = chatml_model(tok)
    qm = QuantizedModel(m, name)
    from nanoeuler.interop.gguf_export import export_gguf
    path = export_gguf(m, tok, tmp_path / "m.gguf", name, progress=False)
    cfg, P, _, source = load_gguf(path)  # the file's tensors by our names, dequantized
    assert set(source["tensor_types"].values()) == {name.upper(), "F32"}
    for n, p in qm.params.items():
        if p.ndim == 2:
            np.testing.assert_array_equal(quant.quantize(P[n], name).view(p.dtype), p)  # re-quantized file = ours
    file_bytes = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(str(path)).tensors}
    np.testing.assert_array_equal(file_bytes["token_embd.weight"].reshape(-1),
                                  qm.params["embed.weight"].view(np.uint8).reshape(-1))
    assert set(gguf_tensors(m)) == set(file_bytes)


@needs_vnni
@pytest.mark.parametrize("name", TYPES)
def test_quantized_greedy_cache_speculative_and_threads_agree(name):
    """Greedy decoding of a quantized model: the KV-cache steps and speculative rounds give the same tokens,
    1 or 2 threads the same bits."""
    qm = QuantizedModel(qmodel(seed=3), name)
    prompt = [5, 17, 2, 40, 33]
    old = kernels.get_threads()
    try:
        kernels.set_threads(1)
        one = generate(qm, prompt, 40, temperature=0, mode="cache").ids
        kernels.set_threads(2)
        assert generate(qm, prompt, 40, temperature=0, mode="cache").ids == one
        assert generate(qm, prompt, 40, temperature=0, mode="speculative", spec_depth=1).ids == one
    finally:
        kernels.set_threads(old)
    assert len(set(one)) > 2


def test_quantized_model_refusals(monkeypatch):
    with pytest.raises(UserError, match="multiple of 32"):
        QuantizedModel(Model.init(tiny_config(dim=48), seed=0), "q8_0")
    with pytest.raises(UserError, match="unknown dtype"):
        for_dtype(qmodel(), "q5_k")
    monkeypatch.setattr(qk, "AVAILABLE", False)
    with pytest.raises(UserError, match="AVX512-VNNI"):
        QuantizedModel(qmodel(), "q4_0")


@needs_vnni
def test_sample_dtype_and_an_imported_gguf_decodes_in_its_own_type(tmp_path, capsys):
    """`sample --dtype q4_1` decodes QuantizedModel(m, "q4_1"); a checkpoint imported from a Q8_0 GGUF decodes
    at q8_0 unless --dtype says otherwise."""
    import json

    from gguf_fixtures import chatml_model

    from nanoeuler.cli import main
    from nanoeuler.data.corpus import bundled_works
    from nanoeuler.interop.gguf_export import export_gguf
    from nanoeuler.tokenizer import Tokenizer
    tok = Tokenizer.train([bundled_works()["hamlet"][:20000]], 320, progress=False)  # with </s>, for sample
    m = chatml_model(tok)
    m.save(tmp_path / "run", tokenizer=tok)
    export_gguf(m, tok, tmp_path / "m.gguf", "q8_0", progress=False)
    assert main(["import", "--from", str(tmp_path / "m.gguf"), "--out", str(tmp_path / "imp"), "--no-progress"]) == 0
    capsys.readouterr()
    ids = tok.encode("To be")

    def sample(run, *extra):
        assert main(["sample", "--ckpt", str(tmp_path / run), "--prompt", "To be", "--temperature", "0",
                     "--max-new-tokens", "16", "--no-speculative", "--json", *extra]) == 0
        return json.loads(capsys.readouterr().out)["ids"]

    def ours(model, dtype):
        return generate(for_dtype(model, dtype), ids, 16, temperature=0, mode="cache", stop_ids=[tok.eos_id]).ids
    assert sample("run", "--dtype", "q4_1") == ours(m, "q4_1")
    imported = Model.load(tmp_path / "imp")
    assert sample("imp") == ours(imported, "q8_0")
    assert sample("imp", "--dtype", "float32") == ours(imported, "float32")
    assert ours(imported, "q8_0") != ours(imported, "q4_0")  # the types decode differently: the test can fail


# ---- against llama.cpp on the same file (llama-cpp-python; skipped without it) -------------------------------
@pytest.fixture(scope="module")
def llama_files(tmp_path_factory):
    pytest.importorskip("llama_cpp")
    from gguf_fixtures import chatml_model, chatml_tokenizer, train_briefly, write_gguf
    tok = chatml_tokenizer()
    m = train_briefly(chatml_model(tok), tok, 40, 0.3, 129)
    d = tmp_path_factory.mktemp("lcq")
    return {q: write_gguf(d / f"m-{q}.gguf", m, tok, q.upper()) for q in TYPES}


@needs_vnni
@pytest.mark.parametrize("name", TYPES)
def test_quantized_logits_and_greedy_tokens_agree_with_llama_cpp(llama_files, name):
    """The imported Q8_0 / Q4_x file decoded in its own type: llama.cpp rounds the activations to 8 bits per
    block as we do, so the teacher-forced logits are far closer than those of float activations (~2.2e-3
    relative L2, tests/test_gguf_llama_cpp.py): measured 3.4e-5 (q8_0), 1.7e-5 (q4_0), 7.4e-4 (q4_1: llama.cpp
    keeps Q8_1's block sums d·Σq in float16, ours are exact); and greedy decoding gives llama.cpp's 32 tokens
    (q8_0: from 3 prompts)."""
    from nanoeuler.data.corpus import bundled_works
    from nanoeuler.interop.gguf_import import load_gguf
    from nanoeuler.interop.llamacpp import LlamaCpp
    cfg, P, tok, _ = load_gguf(llama_files[name])
    qm = QuantizedModel(Model(cfg, P), name)
    text = tok.encode(bundled_works()["othello"][5000:20000])
    window = text[:cfg.ctx_len]
    W = fuse_weights(cfg, qm.params)
    hidden = forward_hidden(cfg, W, np.array([window]), new_cache(cfg))[0]  # the fused step, 32 rows a call
    ours = kernels.matvec(W["head.0"][2], hidden, cfg.vocab_size)          # the head in integers too
    theirs = LlamaCpp(llama_files[name], n_ctx=cfg.ctx_len, logits_all=True).logits(window)
    assert np.linalg.norm(ours - theirs) / np.linalg.norm(theirs) <= (2e-3 if name == "q4_1" else 2e-4)
    for at in ((0, 300, 600) if name == "q8_0" else (0,)):
        prompt = text[at:at + 32]
        got = generate(qm, prompt, 32, temperature=0, mode="cache").ids
        want, _ = LlamaCpp(llama_files[name], n_ctx=cfg.ctx_len).greedy(prompt, 32)
        assert got == want


@needs_vnni
@pytest.mark.parametrize("name", TYPES)
def test_the_batcher_decodes_a_quantized_model_as_generate_does(name):
    """serve's continuous batching (infer/engine.py) runs the same quantized step: 10 streams that join at
    different steps, more than the fused rows, each get generate's greedy tokens."""
    from nanoeuler.infer.engine import Batcher, Job
    qm = QuantizedModel(qmodel(seed=4), name)
    rng = np.random.default_rng(8)
    ps = [[int(t) for t in rng.integers(0, QCFG.vocab_size, n)] for n in (1, 3, 7, 12, 5, 9, 2, 4, 6, 8)]
    outs = [[] for _ in ps]

    def tokens_into(out):
        return lambda kind, *a: out.append(a[0]) if kind == "token" else None
    b = Batcher(qm, max_batch=10)
    for i, p in enumerate(ps):
        b.submit(Job(ids=p, max_tokens=30, on_event=tokens_into(outs[i])))
        b.step() if i % 3 == 2 else None
    while b.step():
        pass
    assert "decode" in b.W and max(b.batch_sizes) > kernels.ROWS
    for p, out in zip(ps, outs):
        assert out == generate(qm, p, 30, temperature=0, mode="cache").ids


@needs_vnni
@pytest.mark.parametrize("name", ("float16",) + TYPES)
def test_a_low_precision_model_keeps_no_float32_matrices(name, monkeypatch):
    """A model decoded at float16 or a block type (the batcher's layout, the widest) holds its own weights and
    their kernel form; of float32 only the embedding (the fused step reads its rows) and the norms, not the
    float32 matrices: the NumPy path (here: more rows than the kernels take) dequantizes them per use, to the
    same products as the float32 layout of the same values. A float32 model: one kernel-form copy, no more."""
    from pathlib import Path
    monkeypatch.syspath_prepend(str(Path(__file__).parent.parent / "bench"))
    from decode_memory import float32_held

    from nanoeuler.infer.engine import Batcher
    from nanoeuler.infer.weights import linear
    low = for_dtype(qmodel(), name)
    W = Batcher(low, max_batch=2).W
    c = QCFG
    assert float32_held(W, low.params) <= 4 * c.dim * (c.vocab_size + 4 * c.n_layers + 1)
    f32 = qmodel()  # a float32 model: its parameters and one kernel form of them (padded to whole panels)
    assert float32_held(Batcher(f32, max_batch=2).W, f32.params) <= 1.25 * sum(p.nbytes for p in f32.params.values())
    monkeypatch.setattr(kernels, "ENABLED", False)
    ref = fuse_weights(c, low.params, batched=True)  # no kernels: float32 values
    x = np.random.default_rng(1).standard_normal((kernels.ROWS + 3, c.dim)).astype(np.float32)
    for key in ("heads", "head.0", "layers.1.qkv", "layers.0.gate_up"):
        np.testing.assert_array_equal(linear(x, W[key]), linear(x, ref[key]))


def test_the_cli_dtypes_are_the_engines_weight_types():
    """`--dtype`'s choices (cli/sample.DTYPES, kept beside the CLI so that --help imports no numba) name every
    type the engine decodes, and the engine takes each of them: a type added to one list fails here."""
    from nanoeuler.cli.sample import DTYPES, SOURCE_DTYPES
    from nanoeuler.infer import quant
    from nanoeuler.infer.weights import for_dtype
    assert set(DTYPES) == {"float32", "float16", *quant.BLOCK_TYPES} == set(SOURCE_DTYPES.values())
    m = qmodel()
    for dtype in DTYPES:
        assert for_dtype(m, dtype) is not None


@needs_vnni
def test_eval_dtype_scores_the_decoded_model(tmp_path, capsys):
    """`eval --dtype`: at float32 the decoding step gives the training forward's loss (to rounding); at q8_0
    the quantized weights' loss, a little off it; q4_0 further (4 bits of 32-weight blocks against 8)."""
    import json

    from nanoeuler.cli import main
    from nanoeuler.data.corpus import bundled_works
    from nanoeuler.data.shards import prepare
    from nanoeuler.tokenizer import Tokenizer
    text = bundled_works()["hamlet"][:30000]
    tok = Tokenizer.train([text], 300, progress=False)
    (tmp_path / "play.txt").write_text(text)
    prepare([tmp_path / "play.txt"], tok, tmp_path / "data", processes=1, progress=False)
    cfg = tiny_config(vocab_size=tok.vocab_size, dim=64, n_heads=4, n_kv_heads=2, n_layers=2, ctx_len=32,
                      ffn_hidden=96, n_mtp=2)
    Model.init(cfg, seed=3).save(tmp_path / "run", tokenizer=tok)

    def loss(*flags):
        assert main(["eval", "--ckpt", str(tmp_path / "run"), "--data", str(tmp_path / "data"), "--max-batches",
                     "2", "--batch-size", "4", "--json", *flags]) == 0
        return json.loads(capsys.readouterr().out)["val_loss"]
    base, f32, q8, q4 = loss(), loss("--dtype", "float32"), loss("--dtype", "q8_0"), loss("--dtype", "q4_0")
    assert abs(f32 - base) <= 1e-6 * base
    assert 1e-6 * base < abs(q8 - base) < 5e-3 * base
    assert abs(q4 - base) > abs(q8 - base)
