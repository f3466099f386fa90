"""Block-quantized weights (nanoeuler/infer/quant.py) and their integer matrix products
(nanoeuler/infer/qkernels.py): our Q8_0 / Q4_0 / Q4_1 bytes equal gguf.quants' bit for bit (random, extreme,
all-zero, tiny and tied blocks), the kernel form holds the same integers, the VNNI product equals the float64
product of the dequantized weights and the dequantized 8-bit activations to float32 rounding (and is near
the plain float product), any thread count and row grouping give the same bits, and a CPU without VNNI is
refused in one line."""
import numpy as np
import pytest

from nanoeuler.errors import UserError
from nanoeuler.infer import qkernels as qk
from nanoeuler.infer import quant

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


def quantized_reference(B, name, X):
    """float64: the dequantized weights times the dequantized 8-bit activations."""
    n, I = X.shape
    xq, xd, _ = quant.quantize_x8(X)
    Xd = (xq.reshape(n, -1, 32).astype(np.float64) * xd[..., None]).reshape(n, I)
    return Xd @ quant.dequantize(B, name, I).astype(np.float64).T


@needs_vnni
@pytest.mark.parametrize("name", TYPES)
def test_quantized_product_equals_dequantized_float_product(name):
    rng = np.random.default_rng(4)
    O, I = 150, 256
    W = rng.standard_normal((O, I)).astype(np.float32) * np.float32(0.05)
    W[3, :32] += np.float32(1.5)          # a block with an offset (Q4_1's minimum) and a large scale
    X = rng.standard_normal((7, I)).astype(np.float32)
    B = quant.quantize(W, name)
    Y = qk.matvec(qk.pack(B, name, I), name, X, O)
    ref = quantized_reference(B, name, X)
    assert Y.dtype == np.float32 and Y.shape == (7, O)
    assert np.abs(Y - ref).max() <= 2e-6 * np.abs(ref).max()
    exact = X.astype(np.float64) @ W.T.astype(np.float64)
    bound = {"q8_0": 0.02, "q4_0": 0.15, "q4_1": 0.15}[name]
    assert np.abs(Y - exact).max() <= bound * np.abs(exact).max()


@needs_vnni
@pytest.mark.parametrize("name", TYPES)
def test_same_bits_for_any_thread_count_and_row_grouping(name):
    rng = np.random.default_rng(5)
    O, I = 64 * 5 + 7, 96
    B = quant.quantize(rng.standard_normal((O, I)), name)
    Wk = qk.pack(B, name, I)
    X = rng.standard_normal((6, I)).astype(np.float32)
    one = qk.matvec(Wk, name, X, O, threads=1)
    for threads in (2, 3, 8):
        np.testing.assert_array_equal(qk.matvec(Wk, name, X, O, threads=threads), one)
    for r in range(6):  # a row alone = the row among 4 and 2 others
        np.testing.assert_array_equal(qk.matvec(Wk, name, X[r:r + 1], O), one[r:r + 1])


def test_refused_without_vnni(monkeypatch):
    monkeypatch.setattr(qk, "AVAILABLE", False)
    B = quant.quantize(np.ones((64, 32), np.float32), "q8_0")
    with pytest.raises(UserError, match="AVX512-VNNI"):
        qk.matvec(qk.pack(B, "q8_0", 32), "q8_0", np.ones((1, 32), np.float32), 64)


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
