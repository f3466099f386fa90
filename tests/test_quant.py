"""Block-quantized weights (nanoeuler/infer/quant.py) and their integer matrix products
(nanoeuler/infer/qkernels.py): our Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 bytes equal gguf.quants' bit for bit
(random, extreme, all-zero, tiny and tied blocks), every type's dequantization (the K types' too, on random
blocks and a real file's) equals gguf's, the activations round as llama.cpp's Q8_0 / Q8_K (ties checked
against Python's own rounding), the kernel form holds the same integers, the product equals the float64
product of the dequantized weights and the dequantized 8-bit activations to float32 rounding (and is near
the plain float product), any thread count and row grouping give the same bits, and a CPU without VNNI is
refused in one line. (The kernel-level tests run on every CPU: without VNNI the same integers come from
portable IR, tested equal to `vpdpbusd` where it exists.) Then the quantized step (infer/weights.py
QuantizedModel through infer/kernels.py):
equal to the NumPy reference on the dequantized weights with 8-bit activations, the GGUF export's bytes,
greedy decoding the same in every mode, thread count and the batcher, `sample --dtype`, an imported GGUF
decoded in its own type, and llama.cpp's logits and greedy tokens on the same file."""
import numpy as np
import pytest
from conftest import rel_err, tiny_config
from numba import njit

from nanoeuler import Model
from nanoeuler.errors import UserError
from nanoeuler.infer import forward as reference, kernels, pool, quant
from nanoeuler.infer import qkernels as qk
from nanoeuler.infer.cache import new_cache
from nanoeuler.infer.session import generate
from nanoeuler.infer.step import forward_cached, forward_hidden, fuse_weights
from nanoeuler.infer.weights import QuantizedModel, for_dtype, values

gguf_quants = pytest.importorskip("gguf.quants")
from gguf import GGMLQuantizationType  # noqa: E402

needs_qkernels = pytest.mark.skipif(not qk.AVAILABLE, reason="this CPU has neither AVX2 nor AVX512-VNNI")
RUNNABLE = qk.ISAS[qk.ISAS.index(qk.ISA):]  # the kernels' instruction sets this CPU runs: its own and those below
TYPES = quant.quantizable()          # q8_0, q4_0, q4_1, q5_0, q5_1: quantized here as gguf does
K_TYPES = ("q4_k", "q5_k", "q6_k")   # read from files only
ALL = quant.block_types()


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
                   "q4_1": (0.625, 3), "q5_0": (0.6875, 6), "q5_1": (0.75, 7), "q4_k": (0.5625, 12),
                   "q5_k": (0.6875, 13), "q6_k": (0.8203125, 14)}
    for name in ALL:
        t = quant.WTYPES[name]
        assert GGMLQuantizationType(t.ggml).name == name.upper()
        assert (t.block, t.nbytes) == gguf_quants.GGML_QUANT_SIZES[GGMLQuantizationType(t.ggml)]


SCALES_AT = {"q4_1": (0, 2), "q5_1": (0, 2), "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,)}  # else (0,): d
EXTREMES = (0x00, 0xFF, 0x80, 0x7F)  # bytes of extreme integers: nibbles 0 / 15 / 8 / 7, Q8_0's q 0, -1, -128, 127


def raw_blocks(name, rng, rows, n, byte_values=None):
    """Blocks [rows, n / block · bytes] of a type as a file could hold them: random bytes (every integer, scale and
    minimum possible; or drawn from byte_values), the float16 scales (d; m, dmin) set to small finite values of
    either sign (byte offsets: SCALES_AT)."""
    t = quant.WTYPES[name]
    shape = (rows * n // t.block, t.nbytes)
    B = rng.integers(0, 256, shape, dtype=np.uint8) if byte_values is None else \
        rng.choice(np.uint8(byte_values), shape)
    for at in SCALES_AT.get(name, (0,)):
        B[:, at:at + 2] = rng.uniform(-0.02, 0.02, (len(B), 1)).astype(np.float16).view(np.uint8)
    return B.reshape(rows, -1)


def blocks_of(name, rng, rows, n):
    """A matrix [rows, n] in block type `name`: random weights quantized, or random K blocks."""
    if name in K_TYPES:
        return raw_blocks(name, rng, rows, n)
    return quant.quantize(rng.standard_normal((rows, n)).astype(np.float32) * np.float32(0.05), name)


@pytest.mark.parametrize("name", K_TYPES)
def test_k_dequantize_equals_gguf_and_quantize_is_refused(name):
    B = raw_blocks(name, np.random.default_rng(12), 6, 512)
    gtype = GGMLQuantizationType[name.upper()]
    np.testing.assert_array_equal(quant.dequantize(B, name, 512), gguf_quants.dequantize(B, gtype))
    with pytest.raises(UserError, match=f"cannot quantize to {name}: K-quant blocks are read from GGUF files"):
        quant.quantize(np.ones((1, 256), np.float32), name)


def test_a_real_files_blocks_dequantize_as_gguf():
    """Gemma 3 270M's Q4_K_M file: its Q5_0, Q4_K, Q6_K and Q8_0 matrices of two layers."""
    import gguf
    from real_models import real_model
    reader = gguf.GGUFReader(str(real_model("gemma3")))
    seen = set()
    for t in reader.tensors:
        name = t.tensor_type.name.lower()
        if name in ALL and t.name.startswith(("blk.0.", "blk.7.")):
            B = np.asarray(t.data)
            np.testing.assert_array_equal(quant.dequantize(B, name, int(t.shape[0])),
                                          gguf_quants.dequantize(B, t.tensor_type))
            seen.add(name)
    assert seen == {"q5_0", "q4_k", "q6_k", "q8_0"}


def test_quantize_refuses_what_it_cannot_hold():
    with pytest.raises(UserError, match="multiple of 32"):
        quant.quantize(np.ones((2, 40), np.float32), "q8_0")
    with pytest.raises(UserError, match="not finite"):
        quant.quantize(np.float32([[np.inf] + [0] * 31]), "q4_0")
    with pytest.raises(UserError, match="too large"):
        quant.quantize(np.full((1, 32), 3e38, np.float32), "q8_0")
    with pytest.raises(UserError, match="unknown weight type"):
        quant.wtype("q3_k")


def activations_to_test(rng, k):
    """Rows [5, k]: random, an all-zero block, exact halves, blocks of scales 1e-12 .. 1e8."""
    X = rng.standard_normal((5, k)).astype(np.float32)
    X[1, :k // 2] = 0
    X[2, 32:64] = np.float32(127) * np.arange(32, dtype=np.float32) / 2  # ties at .5: to even
    X[3] *= np.float32(1e4) ** np.arange(-3, 3).repeat(-(-k // 6))[:k]
    return X


@pytest.mark.parametrize("name", ["q8_0", "q4_1", "q4_k"])
def test_activation_quantization_kernel_equals_numpy(name):
    """The kernels' activation rounding (Q8_0's blocks of 32; Q8_1's, whose sums are d·Σq in float16; Q8_K's of
    256) = its NumPy reference, bit for bit: integers, scales and block sums."""
    X = activations_to_test(np.random.default_rng(2), 768)
    want = numpy_activations(name)(X)
    got = kernel_form(name, X)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    width = quant.WTYPES[name].block
    assert (want[0][1, :256] == 0).all() and (want[1][1, :256 // width] == 0).all()
    assert want[2].shape == (5, 768 // (32 if width == 32 else 16))
    if name == "q4_1":  # d·Σq, with d unrounded: not the float16 d times the sum
        assert (want[2] != numpy_activations("q8_0")(X)[2] * want[1]).any()


def rounded(values, scale):
    """Python's own rounding of each value · scale (exact here): to the nearest integer, ties to even."""
    return [round(float(v) * scale) for v in values]


def test_activation_rounding_ties_against_python_round():
    """Halves whose scaled value is exact, so that only the rounding decides: Q8_0-style blocks of largest |x|
    127 or 63.5 (scale 127 / max = 1 or 2), Q8_K blocks whose first entry of largest |x| is -127 or +127
    (iscale = -127 / it = +1 or -1). NumPy's and the kernels' integers are Python's round-half-to-even of
    x · scale, and Q8_K's d takes the sign of that first entry (d = 1 / iscale)."""
    inner = np.arange(-253, 254, dtype=np.float32) / np.float32(2)            # -126.5 .. 126.5 by halves
    blocks = []
    for i, top in enumerate([127, -127, 63.5, -63.5] * 4):
        fill = inner[31 * i:31 * i + 31] * np.float32(0.5 if abs(top) == 63.5 else 1)
        blocks.append(np.insert(fill, i % 31, top))
    x8 = np.concatenate(blocks)[None]                                        # 16 blocks of 32
    xk = np.concatenate([inner[:256], inner[251:]])[None]                     # 2 Q8_K blocks
    xk[0, 3], xk[0, 10] = -127, 127                                           # block 0: -127 first: d = +1
    xk[0, 256 + 5], xk[0, 256 + 9] = 127, -127                                # block 1: +127 first: d = -1
    for q, d, _ in (quant.quantize_x8(x8), kernel_form("q8_0", x8)):
        for b, block in enumerate(blocks):
            scale = 127 / float(np.abs(block).max())
            assert scale in (1.0, 2.0) and d[0, b] == 1 / scale
            assert q[0, 32 * b:32 * b + 32].tolist() == rounded(block, scale)
    for q, d, _ in (quant.quantize_xk(xk), kernel_form("q4_k", xk)):
        assert d[0].tolist() == [1.0, -1.0]
        for b, scale in ((0, 1), (1, -1)):
            assert q[0, 256 * b:256 * b + 256].tolist() == rounded(xk[0, 256 * b:256 * b + 256], scale)


def numpy_activations(name):
    """The NumPy rounding of the activations that weight type `name` meets: Q8_0, Q8_1 or Q8_K."""
    if quant.WTYPES[name].block == quant.QK_K:
        return quant.quantize_xk
    return quant.quantize_x8_1 if name in ("q4_1", "q5_1") else quant.quantize_x8


def kernel_form(name, X):
    """(q, d, s) of X by qkernels.quantize_x for weight type `name`, in arrays of its NumPy twin's shapes."""
    out = tuple(np.empty_like(a) for a in numpy_activations(name)(X))
    qk.quantize_x(X, *out, qk.KINDS[name])
    return out


def group_integers(g, bits):
    """One group of the kernel form [..., group bytes] -> its integers [..., 16 outputs, 32 inputs], read as
    qkernels' docstring lays them out (the readable twin of qkernels._groups)."""
    lead = g.shape[:-1]
    if bits == 8:
        return g.reshape(*lead, 8, 16, 4).swapaxes(-3, -2).reshape(*lead, 16, 32)   # byte [u, j, k]
    nib = g[..., :256].reshape(*lead, 4, 16, 4)                                       # byte [s, j, k]
    q = np.stack([nib & 15, nib >> 4], axis=-3)                                       # [s, h, j, k]: input 8s+4h+k
    q = np.moveaxis(q, -2, -4).reshape(*lead, 16, 32)
    for plane in range(bits - 4):                                                     # bit 4j + k of word u
        words = g[..., 256 + 64 * plane:320 + 64 * plane].reshape(*lead, 8, 8)
        bit = np.unpackbits(words, axis=-1, bitorder="little").reshape(*lead, 8, 16, 4)
        q = q | (bit.swapaxes(-3, -2).reshape(*lead, 16, 32) << np.uint8(4 + plane))
    return q


def unpack_kernel_form(Wk, name, O, I):
    """Wk = qk.pack(B, name, I) read back by its documented layout as quant.Fields of the [O, I] matrix's blocks."""
    geo, P = qk.GEOMETRY[name], Wk.shape[0]
    nb, G = I // geo.block, I // 32

    def halves(a):  # float16 bytes [..., 2·16·c] -> [..., 16·c]
        return np.ascontiguousarray(a).view(np.float16)
    if geo.block == 32:                                     # [P, nb, (d, m) 64 outputs, v groups]
        d = halves(Wk[..., :128])                           # [P, nb, 64]
        m = halves(Wk[..., 128:256]) if geo.minimum else None
        q = group_integers(Wk[..., geo.head:].reshape(P, nb, 4, geo.group), geo.bits)   # [P, nb, v, j, i]
        q = q.transpose(0, 2, 3, 1, 4)                      # [P, v, j, nb, i]
        per_block = [(a.transpose(0, 2, 1).reshape(-1, nb)[:O].reshape(-1, 1) if a is not None else None)
                     for a in (d, m)]
        return quant.Fields(q.reshape(-1, I)[:O].reshape(-1, 32), geo.offset, per_block[0], m=per_block[1])
    strip = Wk.reshape(P, 4, nb, -1)                        # [P, v, nb, strip bytes]: vector-major
    at = 32 * (2 if geo.minimum else 1)

    def per_output(a, width):  # [P, v, nb, width, 16] -> [O·nb, width]
        return a.transpose(0, 1, 4, 2, 3).reshape(-1, nb, width)[:O].reshape(-1, width)
    d = per_output(halves(strip[..., :32]).reshape(P, 4, nb, 1, 16), 1)
    sc = strip[..., at:at + 16 * geo.subs].reshape(P, 4, nb, geo.subs, 16)
    sc = per_output(sc.view(np.int8) if geo.signed else sc, geo.subs)
    q = group_integers(strip[..., geo.head:].reshape(P, 4, nb, 8, geo.group), geo.bits)  # [P, v, nb, g, j, i]
    q = q.transpose(0, 1, 4, 2, 3, 5).reshape(-1, nb * 256)[:O].reshape(-1, 256)
    if not geo.minimum:
        return quant.Fields(q, geo.offset, d, sc)
    dmin = per_output(halves(strip[..., 32:64]).reshape(P, 4, nb, 1, 16), 1)
    mn = strip[..., at + 128:at + 256].reshape(P, 4, nb, 4, 16, 2).transpose(0, 1, 2, 3, 5, 4)   # [t, e, j]
    return quant.Fields(q, geo.offset, d, sc, dmin=dmin, mn=per_output(mn.reshape(P, 4, nb, 8, 16), 8))


@pytest.mark.parametrize("name", ALL)
def test_pack_holds_the_integers_and_scales(name):
    """Reading the kernel form back by its documented layout gives every block's numbers (quant.unpack's),
    for a partial last panel too, whose padding outputs have zero scales."""
    O, I = 70, 512
    B = blocks_of(name, np.random.default_rng(3), O, I)
    Wk = qk.pack(B, name, I)
    assert Wk.shape == (2, I // quant.WTYPES[name].block, qk.STRIDES[qk.KINDS[name]])
    got, want = unpack_kernel_form(Wk, name, 2 * qk.PANEL, I), quant.unpack(B, name)
    for field, a in want._asdict().items():
        b = getattr(got, field)
        if field == "offset" or a is None:
            assert a == b
            continue
        np.testing.assert_array_equal(b[:len(a)], a, err_msg=field)
        if field in ("d", "dmin", "q"):
            assert not b[len(a):].astype(np.float32).any()


@pytest.mark.parametrize("name", ALL)
def test_pack_writes_every_byte_of_its_out_array(name):
    """pack into a given array (a slice of the model's one buffer) writes all of it, padding included: the same
    bytes as a fresh kernel form whatever the array held, for stacked (per-layer) matrices too."""
    O, I = 70, 512
    rng = np.random.default_rng(4)
    B = np.stack([blocks_of(name, rng, O, I) for _ in range(2)])          # [layers, O, bytes]
    Wk = qk.pack(B, name, I)
    assert Wk.shape == (2, 2, I // quant.WTYPES[name].block, qk.STRIDES[qk.KINDS[name]])
    np.testing.assert_array_equal(Wk[1], qk.pack(B[1], name, I))
    for fill in (0, 255):
        out = np.full(Wk.shape, fill, np.uint8)
        assert qk.pack(B, name, I, out) is out
        np.testing.assert_array_equal(out, Wk)


def panel_for(kind, isa):
    """One panel of `kind` compiled for instruction set `isa`: (k, Wk, xq, xd, xs) -> t [k, PANEL] (k <= MAX_R rows)."""
    panel = qk._panel_intrinsic(kind, isa)

    @njit
    def run(k, w, xq, xd, xs, t, nb, n_in):
        panel(k, w, xq, xd, xs, t, nb, n_in)

    def product(k, Wk, xq, xd, xs):
        T = np.zeros((qk.MAX_R, qk.PANEL), np.float32)
        run(k, Wk.ctypes.data, xq.ctypes.data, xd.ctypes.data, xs.ctypes.data, T.ctypes.data, Wk.shape[1],
            xq.shape[1])
        return T[:k]
    return product


def extreme_activations(rng, n, k):
    """Rows [n, k] of ±1: every activation rounds to ±127 (the largest pair sums against extreme weights)."""
    return rng.choice(np.float32([-1, 1]), (n, k))


@pytest.mark.parametrize("name", ALL)
def test_every_instruction_set_gives_the_same_bits(name):
    """The panel compiled for each instruction set this CPU runs (qkernels.ISAS from its own down: AVX512-VNNI,
    AVX2, and the portable IR that a CPU with neither compiles, as every decoding kernel compiles the quantized
    branch) multiplies the same integers, so gives the engine's bits at 1..4 rows, on random blocks and on
    extreme ones against ±127 activations; the portable IR, which every CPU runs, ties the sets together."""
    rng = np.random.default_rng(9)
    kind, I = qk.KINDS[name], 512
    cases = [(blocks_of(name, rng, qk.PANEL, I), rng.standard_normal((qk.MAX_R, I)).astype(np.float32)),
             (raw_blocks(name, rng, qk.PANEL, I, EXTREMES), extreme_activations(rng, qk.MAX_R, I))]
    for isa in RUNNABLE:
        product = panel_for(kind, isa)
        for B, X in cases:
            Wk = qk.pack(B, name, I)
            xq, xd, xs = qk.quantize_rows(kind, X)
            for k in range(1, qk.MAX_R + 1):  # (one row: 4-bit high nibbles multiplied in place where the set can)
                np.testing.assert_array_equal(product(k, Wk, xq, xd, xs), kernels.matvec(Wk, X[:k], qk.PANEL),
                                              err_msg=f"{isa}, {k} rows")


def activation_rounding(name, X):
    """X [n, in] as the kernels round it for weight type `name` (Q8_0-style or Q8_K), dequantized, float64."""
    n, I = X.shape
    width = quant.WTYPES[name].block
    xq, xd, _ = numpy_activations(name)(X)
    return (xq.reshape(n, -1, width).astype(np.float64) * xd[..., None]).reshape(n, I)


def quantized_reference(B, name, X):
    """float64: the dequantized weights times the dequantized 8-bit activations; Q4_1 / Q5_1's minimums
    m times Q8_1's float16 block sums s (as llama.cpp: m·s, not m·d·Σq)."""
    if name not in ("q4_1", "q5_1"):
        return activation_rounding(name, X) @ quant.dequantize(B, name, X.shape[1]).astype(np.float64).T
    f = quant.unpack(B, name)
    scaled = (f.d.astype(np.float64) * f.q).reshape(B.shape[0], -1)              # d·q [out, in]
    m = f.m.astype(np.float64).reshape(B.shape[0], -1)                           # [out, in / 32]
    return activation_rounding(name, X) @ scaled.T + quant.quantize_x8_1(X)[2].astype(np.float64) @ m.T


@pytest.mark.parametrize("name", ALL)
def test_quantized_product_equals_dequantized_float_product(name):
    """At 1..20 rows (the kernels run MAX_R rows per pass over a panel, so every remainder occurs), 150 outputs
    (a partial last panel): the float64 product of the dequantized weights and activations to float32 rounding,
    entry by entry, each row the same bits whichever rows share its passes; and off the product of the float
    activations by what rounding them to nearest predicts."""
    rng = np.random.default_rng(4)
    O, I = 150, 512
    if name in K_TYPES:
        B = raw_blocks(name, rng, O, I)
        W = quant.dequantize(B, name, I)
    else:
        W = rng.standard_normal((O, I)).astype(np.float32) * np.float32(0.05)
        W[3, :32] += np.float32(1.5)      # a block with an offset (the minimum of Q4_1, Q5_1) and a large scale
        B = quant.quantize(W, name)
    X = rng.standard_normal((20, I)).astype(np.float32)
    Wk = qk.pack(B, name, I)
    Y = kernels.matvec(Wk, X, O)
    ref = quantized_reference(B, name, X)
    assert Y.dtype == np.float32 and Y.shape == (20, O)
    assert np.abs(Y - ref).max() <= 1e-6 * np.abs(ref).max() and rel_err(Y, ref) <= 2e-5
    for n in range(1, 20):
        np.testing.assert_array_equal(kernels.matvec(Wk, X[20 - n:], O), Y[20 - n:])
    # beside float activations on the same weights, only the activations' 8-bit rounding differs: to nearest,
    # each element is off by an error uniform in ±step/2 (variance step²/12, step = the block's max|x| / 127;
    # blocks of 32, of 256 for the K types' Q8_K), and the summed square of Y's errors is what those predict
    # (0.82 of it for q8_0; rounding toward zero: 5.8)
    Wd = quant.dequantize(B, name, I).astype(np.float64)
    width = 256 if name in K_TYPES else 32
    step = np.abs(X.reshape(20, -1, width)).max(-1).astype(np.float64) / 127                   # [20, I / width]
    predicted = (step[:, None, :] ** 2 / 12 * (Wd.reshape(O, -1, width) ** 2).sum(-1)[None]).sum()
    assert 0.5 <= ((Y - X.astype(np.float64) @ Wd.T) ** 2).sum() / predicted <= 1.25


@pytest.mark.parametrize("name", ALL)
def test_extreme_integers_multiply_exactly(name):
    """Blocks of extreme integers (bytes 0x00, 0xFF, 0x80, 0x7F: nibbles 0 and 15, Q8_0's q -128 and 127,
    6-bit scales 63) against activations that all round to ±127: the largest sums of pairs, which AVX2's
    `vpmaddubsw` (int16, saturating) would clip were its operands not kept in range; at 1..5 rows (one row
    takes other code), the float64 product of the dequantized values to float32 rounding."""
    rng = np.random.default_rng(14)
    O, I = 70, 512
    B = raw_blocks(name, rng, O, I, EXTREMES)
    X = extreme_activations(rng, 5, I)
    Wk = qk.pack(B, name, I)
    for n in (1, 5):
        Y, ref = kernels.matvec(Wk, X[:n], O), quantized_reference(B, name, X[:n])
        assert np.abs(Y - ref).max() <= 1e-6 * np.abs(ref).max()


@pytest.mark.parametrize("name", ALL)
def test_same_bits_for_any_thread_count_and_row_grouping(name):
    rng = np.random.default_rng(5)
    O, I = 64 * 5 + 7, 512
    B = blocks_of(name, rng, O, I)
    Wk = qk.pack(B, name, I)
    X = rng.standard_normal((6, I)).astype(np.float32)
    old = pool.get_threads()
    try:
        pool.set_threads(1)
        one = kernels.matvec(Wk, X, O)
        for threads in (2, 3):
            pool.set_threads(threads)
            np.testing.assert_array_equal(kernels.matvec(Wk, X, O), one)
    finally:
        pool.set_threads(old)
    for r in range(6):  # a row alone = the row among 4 and 2 others
        np.testing.assert_array_equal(kernels.matvec(Wk, X[r:r + 1], O), one[r:r + 1])


def test_a_real_files_matrices_multiply_as_their_dequantized_values():
    """Gemma 3 270M's Q4_K_M file: a Q5_0 (attn_q), Q4_K (attn_output) and Q6_K (ffn_down) matrix of layer 0,
    packed from the file's bytes, times 5 rows: the float64 product of their dequantized values and the
    activations rounded as llama.cpp rounds them for each type (Q8_0, Q8_K), to float32 rounding."""
    import gguf
    from real_models import real_model
    reader = gguf.GGUFReader(str(real_model("gemma3")))
    mats = {t.name: t for t in reader.tensors}
    rng = np.random.default_rng(13)
    for tname, name in (("blk.0.attn_q.weight", "q5_0"), ("blk.0.attn_output.weight", "q4_k"),
                        ("blk.0.ffn_down.weight", "q6_k")):
        t = mats[tname]
        assert t.tensor_type.name.lower() == name
        B, I = np.asarray(t.data), int(t.shape[0])
        X = rng.standard_normal((5, I)).astype(np.float32)
        Y = kernels.matvec(qk.pack(B, name, I), X, B.shape[0])
        ref = quantized_reference(B, name, X)
        assert np.abs(Y - ref).max() <= 1e-6 * np.abs(ref).max() and rel_err(Y, ref) <= 2e-5


@pytest.mark.parametrize("name", ("q8_0", "q4_0", "q5_0"))
def test_requantizing_dequantized_blocks_gives_the_same_bytes(name):
    """An imported GGUF's Q8_0 / Q4_0 / Q5_0 tensors are kept as float32 values; quantizing those again at load
    gives back the file's bytes (the block's largest entry is exactly ±127·d, resp. -8·d, -16·d). (An all-zero
    Q4_0 block's scale can come back as +0 for -0: the same weights.)"""
    W = np.random.default_rng(6).standard_normal((64, 256)).astype(np.float32)
    B = gguf_quants.quantize(W, GGMLQuantizationType[name.upper()])
    np.testing.assert_array_equal(quant.quantize(quant.dequantize(B, name, 256), name), B)


@pytest.mark.parametrize("name", TYPES)
def test_gguf_export_writes_our_quantization(name, tmp_path):
    """`export --format gguf --dtype q8_0|q4_0|q4_1|q5_0|q5_1`: every matrix in the file is our quantize of it."""
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


# the K types' widths: multiples of 256
KCFG = tiny_config(vocab_size=53, dim=256, n_heads=4, n_kv_heads=2, n_layers=2, ctx_len=24, ffn_hidden=512, n_mtp=2)


def k_model(name, seed=0):
    """A model of KCFG whose matrices are random K blocks (raw_blocks) with their super-block scales set so that the
    weights' spread is 0.1, and norm weights spread around 1 (QuantizedModel.from_blocks)."""
    rng = np.random.default_rng(seed)
    t = quant.WTYPES[name]
    P = {}
    for n, p in Model.init(KCFG, seed=seed).params.items():
        if p.ndim == 1:
            P[n] = rng.uniform(0.5, 1.5, p.shape).astype(np.float32)
            continue
        B = raw_blocks(name, rng, *p.shape)
        f = np.float32(0.1) / quant.dequantize(B, name, p.shape[1]).std()
        blocks = B.reshape(-1, t.nbytes)
        for at in ((208,) if name == "q6_k" else (0, 2)):
            blocks[:, at:at + 2] = (blocks[:, at:at + 2].copy().view(np.float16) * f).astype(np.float16).view(np.uint8)
        P[n] = B.view(t.dtype)
    return QuantizedModel.from_blocks(KCFG, P)


def model_of(name, seed=0):
    """A quantized model of each block type: qmodel quantized (QCFG), or random K blocks (KCFG)."""
    return k_model(name, seed) if name in K_TYPES else QuantizedModel(qmodel(seed), name)


def logits(m, ids, fused, monkeypatch):
    cfg = m.config
    monkeypatch.setattr(kernels, "ENABLED", fused)
    W = fuse_weights(cfg, m.params)
    monkeypatch.setattr(kernels, "ENABLED", True)
    assert ("decode" in W) == fused
    return forward_cached(cfg, None, ids, new_cache(cfg), fused=W)  # [K, 1, n, V]


def distance_to_ties(name, rows):
    """How near each row of rows [n, in] comes to a rounding tie of its 8-bit activations for weight type `name`:
    the least |frac(x·127/max|x|) − ½| over the row's entries (blocks of 32, or Q8_K's 256) -> [n]. Float32
    order moves an activation by a few ulps (a ulp of x·127/max is at most 7.6e-6), so an entry nearer a tie
    than ~1e-4 may round to either side."""
    width = quant.WTYPES[name].block
    b = np.abs(rows.astype(np.float64)).reshape(len(rows), -1, width)
    amax = b.max(-1, keepdims=True)
    v = b * np.divide(127.0, amax, out=np.zeros_like(amax), where=amax > 0)
    return np.abs(v - np.floor(v) - 0.5).min((1, 2))


def quantized_activations(linear, name, ties=None):
    """forward.py's `linear` with its input rows rounded as the kernels round them for weight type `name`;
    Q4_1 / Q5_1: each block's minimum m times Q8_1's float16 sum s in place of m·d·Σq (m is the block's least
    dequantized weight: a block quantized from floats has a q = 0). ties: a list that gets each call's
    distance_to_ties."""
    def wrapped(x, W):
        rows = x.reshape(-1, x.shape[-1]).astype(np.float32)
        if ties is not None:
            ties.append(distance_to_ties(name, rows))
        y = linear(activation_rounding(name, rows).astype(np.float32).reshape(x.shape), W)
        if name not in ("q4_1", "q5_1"):
            return y
        q, d, s = quant.quantize_x8_1(rows)
        exact = d.astype(np.float64) * q.reshape(len(rows), -1, quant.QK).sum(-1)       # [n, in / 32]
        Wv = values(W[0])
        m = Wv.reshape(Wv.shape[0], -1, quant.QK).min(-1).astype(np.float64)             # [out, in / 32]
        return y + ((s - exact) @ m.T).astype(np.float32).reshape(y.shape)
    return wrapped


@needs_qkernels
@pytest.mark.parametrize("name", ALL)
def test_quantized_step_equals_dequantized_float_step(name, monkeypatch):
    """The fused step on the quantized weights = the NumPy reference on their dequantized values with the
    activations of every product rounded to 8 bits the same way, to float32 rounding; the plain float
    reference (float activations) is an order of magnitude further. A K type's model: random blocks. The two
    compute the activations to float32 rounding apart (NumPy's order on this CPU, the kernels' order), so an
    activation within 1e-4 of a step from a rounding tie may be rounded apart (seen on a Zen 5 CPU: x·127/max
    = 14.5 exactly), and its position and every later one part: the positions before the first such one are
    compared, on the prompt of 20 that keeps the most of its 11 (at least 4)."""
    qm = model_of(name)
    plain_linear = reference.linear
    best = (-1, None, None)
    for seed in range(7, 27):
        ids = np.random.default_rng(seed).integers(0, QCFG.vocab_size, (1, 11))
        ties = []
        monkeypatch.setattr(reference, "linear", quantized_activations(plain_linear, name, ties))
        want = logits(qm, ids, False, monkeypatch)
        near = np.flatnonzero(np.min(ties, axis=0) < 1e-4)
        best = max(best, (near[0] if len(near) else 11, ids, want), key=lambda b: b[0])
        if best[0] == 11:
            break
    clear, ids, want = best
    assert clear >= 4
    monkeypatch.setattr(reference, "linear", plain_linear)
    got, plain = logits(qm, ids, True, monkeypatch), logits(qm, ids, False, monkeypatch)
    got, plain, want = got[:, :, :clear], plain[:, :, :clear], want[:, :, :clear]
    l2 = np.linalg.norm(got - plain) / np.linalg.norm(plain)  # 8-bit activations: ~0.4 % per element
    assert rel_err(got, want) <= 1e-4
    assert rel_err(got, plain) > 10 * rel_err(got, want)
    assert l2 <= (6e-2 if name in K_TYPES else 2e-2)  # (Q8_K: one scale per 256 activations, not 32)


def batch_logits(cfg, W, cache, tokens, pos):
    """step.decode_rows on a copy of cache (every call sees the same keys and values)."""
    from nanoeuler.infer.step import decode_rows
    c = new_cache(cfg, batch=cache.store[0].shape[1])
    c.store[0][...], c.store[1][...] = cache.store[0], cache.store[1]
    return decode_rows(cfg, W, c, tokens, pos)


@needs_qkernels
@pytest.mark.parametrize("name", ALL)
def test_quantized_batch_step_equals_dequantized_float_step_at_any_row_count(name, monkeypatch):
    """serve's batched step (one token per cache row, each at its own position) on quantized weights at
    1..20 rows: the same bits at 1, 2 and 3 threads, each row the same bits as that row stepped alone, and
    the NumPy reference on the dequantized weights with 8-bit activations to float32 rounding (per row,
    relative L2). The two compute the activations to float32 rounding apart, so where one lies on a
    rounding boundary of its 8-bit step the two sides round it apart: a few rows in a hundred, still far
    closer than the plain float reference (float activations) is."""
    from nanoeuler.infer import step
    qm = model_of(name, seed=5)
    cfg = qm.config
    rng = np.random.default_rng(11)
    cache = new_cache(cfg, batch=20)
    for kv in cache.store[:2]:
        kv[...] = rng.standard_normal(kv.shape).astype(np.float32)
    fused = fuse_weights(cfg, qm.params, batched=True)
    monkeypatch.setattr(kernels, "ENABLED", False)
    ref_w = fuse_weights(cfg, qm.params, batched=True)
    monkeypatch.setattr(kernels, "ENABLED", True)
    assert "decode" in fused and "decode" not in ref_w
    errs, plain_errs = [], []
    old = pool.get_threads()
    try:
        for n in range(1, 21):
            tokens, pos = rng.integers(0, cfg.vocab_size, n), rng.integers(0, cfg.ctx_len, n)
            pool.set_threads(1)
            one = batch_logits(cfg, fused, cache, tokens, pos)
            for threads in (2, 3):
                pool.set_threads(threads)
                np.testing.assert_array_equal(batch_logits(cfg, fused, cache, tokens, pos), one)
            r = n // 2  # row r alone: its cache row copied to row 0
            alone = new_cache(cfg, batch=1)
            for a, b in zip(alone.store[:2], cache.store[:2]):
                a[:, 0] = b[:, r]
            np.testing.assert_array_equal(batch_logits(cfg, fused, alone, tokens[r:r + 1], pos[r:r + 1]), one[r:r + 1])
            plain = batch_logits(cfg, ref_w, cache, tokens, pos)
            with monkeypatch.context() as m:
                m.setattr(reference, "batched_linear", quantized_activations(reference.batched_linear, name))
                m.setattr(step, "batched_linear", quantized_activations(step.batched_linear, name))
                want = batch_logits(cfg, ref_w, cache, tokens, pos)
            errs += [np.linalg.norm(a - b) / np.linalg.norm(b) for a, b in zip(one, want)]
            plain_errs += [np.linalg.norm(a - b) / np.linalg.norm(b) for a, b in zip(one, plain)]
    finally:
        pool.set_threads(old)
    errs, plain_errs = np.array(errs), np.array(plain_errs)
    assert len(errs) == 210 and np.sum(errs > 1e-6) <= len(errs) // 20
    assert np.median(plain_errs) > 1000 * np.median(errs) and errs.max() < 2 * plain_errs.max()


@needs_qkernels
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


@needs_qkernels
@pytest.mark.parametrize("name", ALL)
def test_quantized_greedy_cache_speculative_and_threads_agree(name):
    """Greedy decoding of a quantized model: the KV-cache steps and speculative rounds give the same tokens,
    1 or 2 threads the same bits."""
    qm = model_of(name, seed=3)
    prompt = [5, 17, 2, 40, 33]
    old = pool.get_threads()
    try:
        pool.set_threads(1)
        one = generate(qm, prompt, 40, temperature=0, mode="cache").ids
        pool.set_threads(2)
        assert generate(qm, prompt, 40, temperature=0, mode="cache").ids == one
        assert generate(qm, prompt, 40, temperature=0, mode="speculative", spec_depth=1).ids == one
    finally:
        pool.set_threads(old)
    assert len(set(one)) > 2


def test_quantized_model_refusals(monkeypatch):
    with pytest.raises(UserError, match="multiple of 32"):
        QuantizedModel(Model.init(tiny_config(dim=48), seed=0), "q8_0")
    with pytest.raises(UserError, match="unknown dtype"):
        for_dtype(qmodel(), "q3_k")
    for name in K_TYPES:  # no quantizer: one line saying why
        with pytest.raises(UserError, match=f"^cannot quantize a float model to {name}: K-quant blocks are read "):
            for_dtype(qmodel(), name)
    monkeypatch.setattr(qk, "AVAILABLE", False)
    with pytest.raises(UserError, match="needs a CPU with AVX2 or AVX512-VNNI"):
        QuantizedModel(qmodel(), "q4_0")


@needs_qkernels
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


@needs_qkernels
@pytest.mark.parametrize("name", TYPES)
def test_quantized_logits_and_greedy_tokens_agree_with_llama_cpp(llama_files, name):
    """The imported Q8_0 / Q4_x / Q5_x file decoded in its own type: llama.cpp rounds the activations to 8 bits
    per block as we do, so the teacher-forced logits are far closer than those of float activations (~2.2e-3
    relative L2, tests/test_gguf_llama_cpp.py): measured 3.4e-5 (q8_0), 1.7e-5 (q4_0), 3.6e-4 (q4_1: 7.4e-4
    while ours kept Q8_1's block sums d·Σq exact, where llama.cpp rounds them to float16); and greedy decoding
    gives llama.cpp's 32 tokens (q8_0: from 3 prompts)."""
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
    print(name, np.linalg.norm(ours - theirs) / np.linalg.norm(theirs))
    assert np.linalg.norm(ours - theirs) / np.linalg.norm(theirs) <= (1e-3 if name in ("q4_1", "q5_1") else 2e-4)
    for at in ((0, 300, 600) if name == "q8_0" else (0,)):
        prompt = text[at:at + 32]
        got = generate(qm, prompt, 32, temperature=0, mode="cache").ids
        want, _ = LlamaCpp(llama_files[name], n_ctx=cfg.ctx_len).greedy(prompt, 32)
        assert got == want


def k_type_file(name, path):
    """A llama-arch GGUF (gguf_fixtures' 256-wide model) whose matrices are random K blocks of type `name`
    (k_model's scaling), and the model of those blocks: (path, QuantizedModel.from_blocks of them)."""
    from gguf_fixtures import chatml_model, chatml_tokenizer, write_gguf

    from nanoeuler.interop.gguf_export import layer_tensor
    tok = chatml_tokenizer()
    m = chatml_model(tok)
    cfg, t = m.config, quant.WTYPES[name]
    rng = np.random.default_rng(21)
    P, file_blocks = {}, {}
    for n, p in m.params.items():
        if p.ndim == 1:
            P[n] = p
            continue
        B = raw_blocks(name, rng, *p.shape)
        blocks = B.reshape(-1, t.nbytes)
        f = np.float32(0.05) / quant.dequantize(B, name, p.shape[1]).std()
        for at in ((208,) if name == "q6_k" else (0, 2)):
            blocks[:, at:at + 2] = (blocks[:, at:at + 2].copy().view(np.float16) * f).astype(np.float16).view(np.uint8)
        P[n] = B.view(t.dtype)
        m.params[n] = quant.dequantize(B, name, p.shape[1])
        gname = {"embed.weight": "token_embd.weight", "heads.0.weight": "output.weight"}.get(n)
        gname, rows = (gname, B) if gname else layer_tensor(cfg, n, B)
        file_blocks[gname] = rows
    return write_gguf(path, m, tok, name.upper(), blocks=file_blocks), QuantizedModel.from_blocks(cfg, P)


@needs_qkernels
@pytest.mark.parametrize("name", K_TYPES)
def test_k_type_logits_and_greedy_tokens_agree_with_llama_cpp(name, tmp_path):
    """A file of random K blocks (k_type_file): our decoding of its blocks, activations rounded to Q8_K as
    llama.cpp does, gives llama.cpp's teacher-forced logits to float32 rounding at almost every position
    (measured: median 6e-8 relative L2 per row; a few rows, where an activation lies on an 8-bit rounding
    boundary and float32 noise upstream sends it to the other side, differ by up to ~1e-2: Q4_K 5 rows of
    128, Q5_K 1, Q6_K none), where float activations are 2-3e-2 off; and its greedy tokens."""
    pytest.importorskip("llama_cpp")
    from nanoeuler.data.corpus import bundled_works
    from nanoeuler.interop.gguf_import import load_gguf
    from nanoeuler.interop.llamacpp import LlamaCpp
    path, qm = k_type_file(name, tmp_path / f"{name}.gguf")
    cfg, P, tok, source = load_gguf(path)
    assert set(source["tensor_types"].values()) == {name.upper(), "F32"}
    for n, p in qm.params.items():  # the file holds our blocks
        np.testing.assert_array_equal(P[n], p if p.ndim == 1 else quant.dequantize(p.view(np.uint8), name,
                                                                                  P[n].shape[1]))
    window = tok.encode(bundled_works()["othello"][5000:20000])[:cfg.ctx_len]
    W = fuse_weights(cfg, qm.params)
    hidden = forward_hidden(cfg, W, np.array([window]), new_cache(cfg))[0]
    ours = kernels.matvec(W["head.0"][2], hidden, cfg.vocab_size)
    theirs = LlamaCpp(path, n_ctx=cfg.ctx_len, logits_all=True).logits(window)
    rows = np.linalg.norm(ours - theirs, axis=1) / np.linalg.norm(theirs, axis=1)
    assert np.median(rows) <= 1e-6 and np.sum(rows > 1e-5) <= len(rows) // 16 and rows.max() <= 3e-2
    got = generate(qm, window[:32], 32, temperature=0, mode="cache").ids
    assert got == LlamaCpp(path, n_ctx=cfg.ctx_len).greedy(window[:32], 32)[0]


@needs_qkernels
@pytest.mark.parametrize("arch", ["gemma3", "gpt2"])
def test_gelu_goes_through_float16_as_in_llama_cpp(arch, tmp_path):
    """llama.cpp's GELU (GPT-2's MLP, Gemma's GeGLU) is a table of float16 values (kernels.py's docstring), and
    so is ours where the MLP's weights are blocks. A one-layer model at Q8_0 (no later layer to amplify a
    rounding): our logits are llama.cpp's to float32 rounding at almost every position (measured median 6e-8
    relative L2 per row), where exact GELU leaves them ~3e-3 off (measured 2.1e-3 gemma3, 3.2e-3 gpt2)."""
    pytest.importorskip("llama_cpp")
    from gguf_fixtures import chatml_tokenizer

    from nanoeuler import Config
    from nanoeuler.data.corpus import bundled_works
    from nanoeuler.interop.gguf_export import export_gguf
    from nanoeuler.interop.gguf_import import load_gguf
    from nanoeuler.interop.llamacpp import LlamaCpp
    tok = chatml_tokenizer()
    shape = dict(n_kv_heads=1, head_dim=32, sliding_window=8, global_every=2) if arch == "gemma3" else \
        dict(n_kv_heads=2)
    cfg = Config(arch=arch, vocab_size=tok.vocab_size, dim=64, n_heads=2, n_layers=1, ctx_len=64, ffn_hidden=128,
                 n_mtp=1, **shape)
    m = Model.init(cfg, seed=0)
    rng = np.random.default_rng(0)
    for n, a in m.params.items():  # GELU's inputs spread over [-10, 10] (each block's range)
        m.params[n] = (a + (0.3 if a.ndim == 2 else 0.1) * rng.standard_normal(a.shape)).astype(np.float32)
    path = export_gguf(m, tok, tmp_path / "m.gguf", "q8_0", progress=False)
    cfg, P, tok, _ = load_gguf(path, blocks=True)
    W = fuse_weights(cfg, QuantizedModel.from_blocks(cfg, P).params)
    window = tok.encode(bundled_works()["othello"][5000:9000])[:cfg.ctx_len]
    theirs = LlamaCpp(path, n_ctx=cfg.ctx_len, logits_all=True).logits(window)

    def row_errors(D):
        hidden = forward_hidden(cfg, W | {"decode": D}, np.array([window]), new_cache(cfg))[0]
        ours = kernels.matvec(W["head.0"][2], hidden, cfg.vocab_size)
        return np.linalg.norm(ours - theirs, axis=1) / np.linalg.norm(theirs, axis=1)
    D = W["decode"]
    assert D.gelu_half.all()
    half, exact = row_errors(D), row_errors(D._replace(gelu_half=~D.gelu_half))
    print(f"{arch}: median row error {np.median(half):.1e} (exact GELU {np.median(exact):.1e})")
    assert np.median(half) <= 1e-6
    assert np.median(exact) >= 2e-5


@needs_qkernels
@pytest.mark.parametrize("name", ALL)
def test_the_batcher_decodes_a_quantized_model_as_generate_does(name):
    """serve's continuous batching (infer/engine.py) runs the same quantized step: 10 streams that join at
    different steps, more than the fused rows, each get generate's greedy tokens."""
    from nanoeuler.infer.engine import Batcher, Job
    qm = model_of(name, seed=4)
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


@needs_qkernels
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
    for key in ("heads", "head.0", "layers.1.qkv", "layers.0.mlp_in"):
        np.testing.assert_array_equal(linear(x, W[key]), linear(x, ref[key]))


def test_the_engine_takes_every_dtype_the_cli_offers(monkeypatch):
    """Every `--dtype` choice (quant.decodable()) is a type the engine decodes: each it can quantize is made,
    the K types are refused in one line (we cannot make their blocks)."""
    from nanoeuler.infer.weights import for_dtype
    monkeypatch.setattr(qk, "AVAILABLE", True)  # (nothing is multiplied here)
    m = qmodel()
    for dtype in quant.decodable():
        if dtype in K_TYPES:
            with pytest.raises(UserError, match="cannot quantize"):
                for_dtype(m, dtype)
        else:
            assert for_dtype(m, dtype) is not None


@needs_qkernels
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
