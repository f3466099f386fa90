"""The GPT-2 ops (LayerNorm, GELU-tanh, bias add, learned positions): float64 finite differences, the
forward against PyTorch's definitions, dtypes kept, a position table that is too short refused."""
import numpy as np
import pytest
import torch

from nanoeuler import ops
from nanoeuler.training.check import TOLERANCE, _check_op
from nanoeuler.errors import UserError


def _r(seed=0, dtype=np.float64):
    rng = np.random.default_rng(seed)
    return lambda *s: rng.standard_normal(s).astype(dtype)


@pytest.mark.parametrize("name", ["layernorm", "gelu", "bias", "position"])
def test_gpt2_op_gradients_match_finite_differences(name):
    rng = np.random.default_rng(7)
    r = lambda *s: rng.standard_normal(s)
    B, T, d = 3, 4, 6
    cases = {
        "layernorm": (lambda x, w, b: ops.layernorm_forward(x, w, b, 1e-5), ops.layernorm_backward,
                      [r(B, T, d), r(d), r(d)]),
        "gelu": (ops.gelu_forward, ops.gelu_backward, [3 * r(B, T, d)]),
        "bias": (ops.bias_forward, ops.bias_backward, [r(B, T, d), r(d)]),
        "position": (lambda x, W: ops.position_forward(x, W, start=2), ops.position_backward, [r(B, T, d), r(9, d)]),
    }
    fwd, bwd, inputs = cases[name]
    rows = _check_op(name, fwd, bwd, inputs, rng, n_samples=40)
    assert len(rows) == len(inputs)
    for row in rows:
        assert row.max_rel_error < TOLERANCE, row


def test_wrong_layernorm_backward_is_caught():
    """Dropping the centring term (the RMSNorm backward) must fail the same check."""
    rng = np.random.default_rng(1)
    x, w, b = rng.standard_normal((2, 3, 8)) + 2.0, rng.standard_normal(8), rng.standard_normal(8)

    def wrong_backward(dy, cache):
        n, r, w_ = cache
        g = dy * w_
        return r * (g - n * np.mean(g * n, axis=-1, keepdims=True)), None, None

    rows = _check_op("wrong", lambda x: ops.layernorm_forward(x, w, b, 1e-5), lambda dy, c: wrong_backward(dy, c)[0],
                     [x], rng)
    assert rows[0].max_rel_error > 1e-3


def test_forwards_match_torch():
    r = _r(2)
    x, w, b = r(2, 5, 16), r(16), r(16)
    y, _ = ops.layernorm_forward(x, w, b, 1e-5)
    ref = torch.nn.functional.layer_norm(torch.tensor(x), (16,), torch.tensor(w), torch.tensor(b), 1e-5).numpy()
    np.testing.assert_allclose(y, ref, rtol=1e-12, atol=1e-12)
    g, _ = ops.gelu_forward(4 * x)
    ref = torch.nn.functional.gelu(torch.tensor(4 * x), approximate="tanh").numpy()
    np.testing.assert_allclose(g, ref, rtol=1e-12, atol=1e-14)
    exact = torch.nn.functional.gelu(torch.tensor(4 * x)).numpy()  # the erf GELU is a different function
    assert np.max(np.abs(g - exact)) > 1e-5
    np.testing.assert_allclose(ops.gelu_forward(np.array([0.0, 1.0]))[0], [0.0, 0.8411919906082768], rtol=1e-12)


def test_worked_examples():
    y, _ = ops.layernorm_forward(np.array([[1.0, 2.0, 3.0]]), np.ones(3), np.zeros(3), 1e-5)
    np.testing.assert_allclose(y, [[-1.2247357, 0.0, 1.2247357]], rtol=1e-6)
    dx, db = ops.bias_backward(np.ones((2, 3, 4)), (4,))
    assert db.tolist() == [6, 6, 6, 6] and dx.shape == (2, 3, 4)
    W = np.array([[0.0, 0.0], [1.0, 1.0], [2.0, 2.0]])
    y, cache = ops.position_forward(np.zeros((1, 2, 2)), W, start=1)
    assert y.tolist() == [[[1, 1], [2, 2]]]
    _, dW = ops.position_backward(np.ones((3, 2, 2)), cache)
    assert dW.tolist() == [[0, 0], [3, 3], [3, 3]]   # row 0 unused; rows 1, 2 summed over the batch of 3


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_gpt2_ops_keep_dtype(dtype):
    r = _r(3, dtype)
    x, w, b = r(2, 3, 8), r(8), r(8)
    outs = []
    y, c = ops.layernorm_forward(x, w, b, 1e-5)
    outs += [y, *ops.layernorm_backward(y, c)]
    y, c = ops.gelu_forward(x)
    outs += [y, ops.gelu_backward(y, c)]
    y, c = ops.bias_forward(x, b)
    outs += [y, *ops.bias_backward(y, c)]
    y, c = ops.position_forward(x, r(5, 8))
    outs += [y, *ops.position_backward(y, c)]
    for o in outs:
        assert o.dtype == dtype


def test_position_table_too_short_is_a_user_error():
    with pytest.raises(UserError, match="position table"):
        ops.position_forward(np.zeros((1, 4, 2)), np.zeros((5, 2)), start=2)


def test_gelu_derivative_matches_torch_autograd_everywhere():
    """Including around x ≈ -0.752 where gelu' = 0 (finite differences cannot resolve it there)."""
    x = np.linspace(-8, 8, 100_001)
    _, cache = ops.gelu_forward(x)
    g = ops.gelu_backward(np.ones_like(x), cache)
    t = torch.tensor(x, requires_grad=True)
    torch.nn.functional.gelu(t, approximate="tanh").sum().backward()
    assert np.max(np.abs(g - t.grad.numpy())) < 1e-13
    assert np.min(np.abs(g)) < 1e-4   # the grid does pass through the zero of gelu'


def test_exact_gelu_and_its_derivative_match_torch_everywhere():
    """GPT-NeoX's GELU (ops/gelu_erf.py) is torch's exact one, value and derivative, in float64 and float32; and
    not the tanh form (which differs by up to ~5e-4 near |x| ≈ 2)."""
    x = np.linspace(-8, 8, 100_001)
    y, cache = ops.gelu_erf_forward(x)
    g = ops.gelu_erf_backward(np.ones_like(x), cache)
    t = torch.tensor(x, requires_grad=True)
    torch.nn.functional.gelu(t).sum().backward()
    assert np.max(np.abs(y - torch.nn.functional.gelu(torch.tensor(x)).numpy())) < 1e-13
    assert np.max(np.abs(g - t.grad.numpy())) < 1e-13
    assert np.max(np.abs(y - ops.gelu_forward(x)[0])) > 1e-4
    x32 = x.astype(np.float32)
    y32 = ops.gelu_erf_forward(x32)[0]
    assert y32.dtype == np.float32 and np.max(np.abs(y32 - torch.nn.functional.gelu(torch.tensor(x32)).numpy())) < 1e-6
