"""Every op: float64 finite differences (via nanoeuler.training.check), float32 agreeing with float64, dtypes kept."""
import numpy as np
import pytest

from nanoeuler import ops
from nanoeuler.training.check import FLOOR, TOLERANCE, check_ops, numeric_grad, relative_error


def test_every_op_gradient_matches_finite_differences():
    rows = check_ops(seed=1)
    assert len(rows) >= 15
    for row in rows:
        assert row.max_rel_error < TOLERANCE, row


def test_relative_error_floor_and_detection():
    # a 1% error on a normal-sized gradient is caught; round-off on a zero gradient is not an error
    assert relative_error(np.array([1.0]), np.array([1.01])) > 1e-3
    assert relative_error(np.array([0.0]), np.array([FLOOR * 1e-7])) < TOLERANCE
    # the finite differences' own round-off (~1e-16·|L|/h, up to 2e-12 measured on the check's models) on an
    # entry below the floor stays under the tolerance (with a floor of 1e-6 it read as 1.6e-6 and failed check)
    assert relative_error(np.array([1e-6]), np.array([1e-6 + 2e-12])) < TOLERANCE / 4


def test_check_catches_a_wrong_backward():
    # the same machinery must fail when a backward is wrong (here: rmsnorm without the projection term)
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((3, 8)), rng.standard_normal(8)
    y, (n, r, _) = ops.rmsnorm_forward(x, w, 1e-5)
    R = rng.standard_normal(y.shape)
    wrong_dx = r * (R * w)
    num = numeric_grad(lambda: float(np.sum(ops.rmsnorm_forward(x, w, 1e-5)[0] * R)), x, np.arange(x.size))
    assert relative_error(wrong_dx.reshape(-1), num) > 1e-2


def _random_inputs(dtype, seed=0):
    rng = np.random.default_rng(seed)
    return lambda *s: rng.standard_normal(s).astype(dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_ops_keep_dtype(dtype):
    r = _random_inputs(dtype)
    B, T, d = 2, 6, 8
    cos, sin = ops.rope_tables(T, ops.inv_freq(d, 10000.0), dtype)
    outs = [
        ops.linear_forward(r(B, T, d), r(4, d))[0],
        ops.rmsnorm_forward(r(B, T, d), r(d), 1e-5)[0],
        ops.rope_forward(r(B, 2, T, d), cos, sin)[0],
        ops.swiglu_forward(r(B, T, d), r(B, T, d))[0],
        ops.attention_forward(r(B, 4, T, d), r(B, 2, T, d), r(B, 2, T, d))[0],
    ]
    y, cache = ops.attention_forward(r(B, 4, T, d), r(B, 2, T, d), r(B, 2, T, d))
    outs += list(ops.attention_backward(y, cache))
    z = r(B * T, 11)
    _, ce_cache = ops.cross_entropy_forward(z, np.zeros(B * T, dtype=np.int64))
    outs.append(ops.cross_entropy_backward(1.0, ce_cache))
    for out in outs:
        assert out.dtype == dtype


def test_float32_agrees_with_float64():
    r = _random_inputs(np.float64, seed=3)
    q, k, v = r(2, 4, 7, 8), r(2, 2, 7, 8), r(2, 2, 7, 8)
    y64, c64 = ops.attention_forward(q, k, v)
    y32, c32 = ops.attention_forward(q.astype(np.float32), k.astype(np.float32), v.astype(np.float32))
    np.testing.assert_allclose(y32, y64, rtol=1e-4, atol=1e-5)
    for g32, g64 in zip(ops.attention_backward(y32, c32), ops.attention_backward(y64, c64)):
        np.testing.assert_allclose(g32, g64, rtol=1e-3, atol=1e-4)


def test_attention_is_causal_and_grouped():
    r = _random_inputs(np.float64, seed=4)
    q, k, v = r(1, 4, 6, 8), r(1, 2, 6, 8), r(1, 2, 6, 8)
    y, _ = ops.attention_forward(q, k, v)
    k2, v2 = k.copy(), v.copy()
    k2[:, :, 4:] += 10.0  # changing the future must not change earlier outputs
    v2[:, :, 4:] += 10.0
    y2, _ = ops.attention_forward(q, k2, v2)
    np.testing.assert_allclose(y[:, :, :4], y2[:, :, :4], rtol=0, atol=1e-12)
    assert not np.allclose(y[:, :, 4:], y2[:, :, 4:])
    # q heads 0,1 read kv head 0; heads 2,3 read kv head 1 (same as plain attention per head)
    for h in range(4):
        kv = h // 2
        s = q[0, h] @ k[0, kv].T / np.sqrt(8) + np.triu(np.full((6, 6), -np.inf), 1)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        np.testing.assert_allclose(y[0, h], p @ v[0, kv], rtol=1e-12, atol=1e-12)


def test_rope_rotate_half_pairs_i_with_i_plus_half():
    hd = 8
    cos, sin = ops.rope_tables(3, ops.inv_freq(hd, 10000.0), np.float64)
    x = np.zeros((1, 1, 3, hd))
    x[..., 1] = 1.0  # pair (1, 5)
    y, _ = ops.rope_forward(x, cos, sin)
    angle = 2 * 10000.0 ** (-2 / hd)  # position 2, frequency index 1
    np.testing.assert_allclose(y[0, 0, 2, [1, 5]], [np.cos(angle), np.sin(angle)], atol=1e-12)
    assert np.count_nonzero(np.abs(y[0, 0, 2]) > 1e-12) == 2


def test_cross_entropy_ignores_minus_one():
    z = np.log(np.array([[0.5, 0.25, 0.25], [0.1, 0.1, 0.8]]))
    loss, cache = ops.cross_entropy_forward(z, np.array([0, -1]))
    assert loss == pytest.approx(np.log(2))
    dz = ops.cross_entropy_backward(1.0, cache)
    assert np.all(dz[1] == 0)
    np.testing.assert_allclose(dz[0], [-0.5, 0.25, 0.25])
    loss, cache = ops.cross_entropy_forward(z, np.array([-1, -1]))
    assert loss == 0.0 and np.all(ops.cross_entropy_backward(1.0, cache) == 0)


def test_mtp_targets_shift_by_head():
    t = ops.mtp_targets(np.array([[5, 6, 7, 8]]), T=2, K=2)
    assert t.tolist() == [[[6, 7]], [[7, 8]]]
    mask = np.array([[True, True, False, True]])
    assert ops.mtp_targets(np.array([[5, 6, 7, 8]]), 2, 2, mask).tolist() == [[[6, -1]], [[-1, 8]]]


def test_dropout_masks_rate_scale_and_independence():
    drop = ops.Dropout(0.2, seed=3)
    m = drop.mask(site=0, rows=512, width=128, dtype=np.float64)                  # [512, 128]
    dropped = np.mean(m == 0)
    assert abs(dropped - 0.2) < 4 * np.sqrt(0.2 * 0.8 / m.size)                   # Bernoulli(p), 4 sigma
    assert set(np.unique(m)) == {0.0, drop.scale} and drop.scale == pytest.approx(1 / (1 - 0.2), rel=1e-6)
    assert abs(m.mean() - 1) < 0.01                                               # E[mask] = 1
    assert np.array_equal(drop.mask(0, 16, 128, np.float64, row0=100), m[100:116])  # a part's rows
    others = [drop.mask(1, 512, 128, np.float64), ops.Dropout(0.2, seed=4).mask(0, 512, 128, np.float64)]
    for o in others:                                                              # another site, seed
        both = np.mean((m == 0) & (o == 0))
        assert abs(both - 0.04) < 0.01                                            # independent: p²
    assert np.all(ops.Dropout(0.0, seed=3).mask(0, 4, 8, np.float32) == 1)
    with pytest.raises(ValueError):
        ops.Dropout(1.0, seed=0)
