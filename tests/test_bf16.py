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
    assert (bf16.pack_a(x[None])[0, 0, :len(EDGES)] == want).all()               # the numba kernels' rounding
    nan = f32(NANS)
    for got in (bf16.round_bf16_bits(nan), bf16.pack_a(nan[None])[0, 0, :len(NANS)]):
        assert np.isnan((got.astype(np.uint32) << 16).view(np.float32)).all()


def test_round_bf16_matches_torch():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    x = np.concatenate([(rng.standard_normal(5000) * 10.0 ** rng.integers(-40, 38, 5000)).astype(np.float32),
                        f32(rng.integers(0, 2 ** 32, 5000, dtype=np.uint64).astype(np.uint32)), f32(list(EDGES))])
    x = x[~np.isnan(x)]
    want = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert (bf16.round_bf16_bits(x) == want).all()
    assert (bf16.pack_a(x[None])[0, 0, :x.size] == want).all()


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
