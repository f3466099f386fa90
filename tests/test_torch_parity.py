"""Parity of our NumPy model with an independent PyTorch implementation of the SPEC (tests/torch_ref.py).

Given the same weights and tokens, logits, head-0 loss, the training objective and every parameter gradient
must agree within 1e-5 relative in float32 and 1e-10 in float64, for `small` (GQA 4/2, K=3), a config with
n_kv_heads == n_heads, and one with K = 1; with and without a partial loss mask.

Relative error of a tensor a against the reference b: max|a - b| / max(max|b|, 1e-30)  (tensor-wise, so a
gradient entry that is ~0 in both does not divide by zero; scalars: |a - b| / max(|b|, 1e-30)).

Run `python tests/test_torch_parity.py` to print the measured errors of every check.
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest

import torch  # a test dependency (the `test` extra): a missing torch must fail, not skip
torch.set_num_threads(1)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from torch_ref import TorchModel, apply_rope, causal_gqa_attention, rope_cos_sin, spec_init  # noqa: E402

from nanoeuler import Config  # noqa: E402
from conftest import rel_err  # noqa: E402

SMALL = Config.preset("small")
CONFIGS = {
    "small": SMALL,                                 # GQA 4 q heads / 2 kv heads, K = 3
    "mha": SMALL.replace(n_kv_heads=SMALL.n_heads),  # n_kv_heads == n_heads
    "k1": SMALL.replace(n_mtp=1),                   # a single head
}
TOL = {np.float32: 1e-5, np.float64: 1e-10}        # the losses
ENTRY_TOL = {np.float32: 5e-4, np.float64: 1e-10}  # every entry of the logits and gradients (conftest.rel_err)
B, T = 2, 32
TINY = 1e-30




def random_params(config, seed: int, dtype) -> dict[str, np.ndarray]:
    """Weights far from init (norm weights != 1, larger matrices, so attention is far from uniform and
    every term of every gradient matters), drawn here independently of nanoeuler's init. Matrices are
    scaled by sqrt(128 / fan_in) so that wider configs are as well-conditioned as `small`."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in config.param_shapes().items():
        if name.endswith("norm.weight"):
            a = 1.0 + 0.3 * rng.standard_normal(shape)
        elif name == "embed.weight":
            a = 0.5 * rng.standard_normal(shape)
        elif ".attn.w" in name and not name.endswith("wo.weight"):
            a = 0.1 * math.sqrt(128 / shape[1]) * rng.standard_normal(shape)
        else:
            a = 0.06 * math.sqrt(128 / shape[1]) * rng.standard_normal(shape)
        out[name] = a.astype(dtype)
    return out


def make_tokens(config, seed: int, b: int = B, t: int = T) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, config.vocab_size, (b, t + config.n_mtp)).astype(np.int64)


def make_mask(config, seed: int, b: int = B, t: int = T) -> np.ndarray:
    """A partial loss mask like SFT's: a prompt prefix off, then ~70% of the remaining targets on."""
    rng = np.random.default_rng(seed)
    mask = rng.random((b, t + config.n_mtp)) < 0.7
    mask[0, :9] = False
    mask[-1, :4] = False
    mask[:, -1] = True          # every head keeps at least one counted target
    return mask


def ours(config, params):
    from nanoeuler import Model
    return Model(config, {k: v.copy() for k, v in params.items()})


def compare(config, params, dtype, tokens, mask) -> dict[str, float]:
    """Every measured relative error (ours vs torch) for one case, keyed by check name."""
    model = ours(config, params)
    tm = TorchModel(config, params)
    errs = {}
    K = config.n_mtp
    b, t = tokens.shape[0], tokens.shape[1] - K
    inputs = tokens[:, :t]
    lg = np.asarray(model.logits(inputs))
    assert lg.shape == (K, b, t, config.vocab_size)
    assert lg.dtype == dtype, f"logits dtype {lg.dtype}, expected {np.dtype(dtype)}"
    errs["logits"] = rel_err(lg, tm.logits(inputs).detach().numpy())

    h0, obj, grads = model.loss_and_grads(tokens, loss_mask=mask)
    th0, tobj, tgrads = tm.loss_and_grads(tokens, loss_mask=mask)
    errs["head0_loss"] = abs(h0 - th0) / max(abs(th0), TINY)
    errs["objective"] = abs(obj - tobj) / max(abs(tobj), TINY)
    assert set(grads) == set(tgrads), f"gradient names differ: {sorted(set(grads) ^ set(tgrads))}"
    for name in tgrads:
        g = grads[name]
        assert g.shape == tgrads[name].shape, f"{name}: grad shape {g.shape} != {tgrads[name].shape}"
        assert g.dtype == dtype, f"{name}: grad dtype {g.dtype}, expected {np.dtype(dtype)}"
        errs["grad " + name] = rel_err(g, tgrads[name])
    return errs


CASES = ["init", "random", "random+mask"]


def case_inputs(name, case, dtype):
    config = CONFIGS[name]
    seed = {"small": 1, "mha": 2, "k1": 3}[name]
    if case == "init":
        from nanoeuler import Model
        params = {k: np.asarray(v) for k, v in Model.init(config, seed=seed, dtype=dtype).params.items()}
    else:
        params = random_params(config, seed, dtype)
    mask = make_mask(config, seed + 100) if case.endswith("+mask") else None
    return config, params, make_tokens(config, seed + 10), mask


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_parity_with_torch(name, case, dtype):
    config, params, tokens, mask = case_inputs(name, case, dtype)
    errs = compare(config, params, dtype, tokens, mask)
    bad = {k: v for k, v in errs.items() if not v <= (TOL if k.endswith("loss") or k == "objective" else ENTRY_TOL)[dtype]}
    assert not bad, f"{name}/{case}/{np.dtype(dtype)}: over {TOL[dtype]:g} / {ENTRY_TOL[dtype]:g}: {bad}"


EXTRA = {
    # 6 q heads on 2 kv heads (group of 3), head_dim 64, V 4096
    "big": (Config.preset("big"), 1, 16),
    # every RoPE position of the context, and a sequence as long as the context
    "small-full-ctx": (SMALL, 1, SMALL.ctx_len),
}


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("name", list(EXTRA))
def test_parity_with_torch_extra(name, dtype):
    config, b, t = EXTRA[name]
    params = random_params(config, 4, dtype)
    errs = compare(config, params, dtype, make_tokens(config, 5, b, t), make_mask(config, 6, b, t))
    bad = {k: v for k, v in errs.items() if not v <= (TOL if k.endswith("loss") or k == "objective" else ENTRY_TOL)[dtype]}
    assert not bad, f"{name}/{np.dtype(dtype)}: over {TOL[dtype]:g} / {ENTRY_TOL[dtype]:g}: {bad}"


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
def test_dropout_parity_with_torch(dtype):
    """Our masks (ops.Dropout) applied to the branches of the PyTorch model: same loss and gradients."""
    from nanoeuler.ops import Dropout
    config, params, tokens, mask = case_inputs("small", "random+mask", dtype)
    drop = Dropout(0.25, seed=5)
    b, t = tokens.shape[0], tokens.shape[1] - config.n_mtp
    masks = [[drop.mask(2 * i + s, b * t, config.dim, dtype).reshape(b, t, config.dim) for s in (0, 1)]
             for i in range(config.n_layers)]
    h0, obj, grads = ours(config, params).loss_and_grads(tokens, mask, dropout=drop)
    th0, tobj, tgrads = TorchModel(config, params).loss_and_grads(tokens, mask, dropout_masks=masks)
    assert abs(obj - tobj) <= TOL[dtype] * abs(tobj) and abs(h0 - th0) <= TOL[dtype] * abs(th0)
    bad = {n: rel_err(grads[n], tgrads[n]) for n in tgrads if not rel_err(grads[n], tgrads[n]) <= ENTRY_TOL[dtype]}
    assert not bad
    assert abs(obj - ours(config, params).loss_and_grads(tokens, mask)[1]) > 1e-3  # the masks matter


def test_full_mask_equals_no_mask():
    config, params, tokens, _ = case_inputs("small", "random", np.float64)
    a = ours(config, params).loss_and_grads(tokens)
    b = ours(config, params).loss_and_grads(tokens, loss_mask=np.ones(tokens.shape, bool))
    assert a[0] == pytest.approx(b[0], rel=1e-14) and a[1] == pytest.approx(b[1], rel=1e-14)
    assert max(rel_err(a[2][n], b[2][n]) for n in a[2]) < 1e-13


# ---------------------------------------------------------------- the comparison can fail


def test_parity_detects_wrong_variants():
    """The oracle tells apart the mistakes a hand-written model is likely to make: interleaved RoPE
    pairing, the wrong q->kv head map, a mask that is ignored. Each shifts something by >> tolerance."""
    config, params, tokens, mask = case_inputs("small", "random+mask", np.float64)
    model = ours(config, params)
    lg = np.asarray(model.logits(tokens[:, :T]))
    for kw in ({"rope_pairing": "interleaved"}, {"gqa_map": "modulo"}):
        wrong = TorchModel(config, params, **kw).logits(tokens[:, :T]).detach().numpy()
        assert rel_err(lg, wrong) > 1e-4, kw
    h0, obj, _ = model.loss_and_grads(tokens, loss_mask=mask)
    nh0, nobj, _ = TorchModel(config, params).loss_and_grads(tokens)      # mask dropped
    assert abs(obj - nobj) > 1e-4 and abs(h0 - nh0) > 1e-4


# ---------------------------------------------------------------- SPEC init and loss at init


def test_init_follows_spec():
    """N(0, 0.02) weights, wo/down scaled by 1/sqrt(2 n_layers), norm weights 1; loss ~ ln V at init."""
    from nanoeuler import Model
    config = SMALL
    model = Model.from_preset("small", seed=0)
    assert {k: tuple(v.shape) for k, v in model.params.items()} == config.param_shapes()
    for name, w in model.params.items():
        w = np.asarray(w, np.float64)
        if name.endswith("norm.weight"):
            assert np.all(w == 1.0), name
            continue
        std = 0.02 / (math.sqrt(2 * config.n_layers) if name.endswith(("wo.weight", "down.weight")) else 1)
        assert abs(w.std() / std - 1) < 0.05, (name, w.std(), std)
        assert abs(w.mean()) < 5 * std / math.sqrt(w.size), (name, w.mean())
    tokens = make_tokens(config, 0)
    h0, obj, _ = model.loss_and_grads(tokens)
    assert abs(h0 - math.log(config.vocab_size)) < 0.1 and abs(obj - math.log(config.vocab_size)) < 0.1


# ---------------------------------------------------------------- self-checks of the oracle itself


def test_oracle_attention_matches_torch_sdpa():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 9, 8, generator=g, dtype=torch.float64) for h in (6, 2, 2))
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert (causal_gqa_attention(q, k, v) - ref).abs().max() < 1e-12


def test_oracle_rope_is_complex_rotation_of_half_pairs():
    """rotate-half RoPE == multiplying x_i + i x_{i+hd/2} by exp(i t theta^(-2i/hd))."""
    T_, hd = 7, 8
    x = torch.randn(1, 1, T_, hd, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    cos, sin = rope_cos_sin(T_, hd, 10000.0, torch.float64)
    z = torch.complex(x[..., : hd // 2], x[..., hd // 2:])
    ang = torch.arange(T_, dtype=torch.float64)[:, None] * 10000.0 ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    z = z * torch.exp(1j * ang)
    assert (apply_rope(x, cos, sin) - torch.cat([z.real, z.imag], -1)).abs().max() < 1e-14


def test_oracle_is_causal_and_near_ln_v_at_init():
    config = SMALL
    tm = TorchModel(config, spec_init(config, seed=0))
    tokens = make_tokens(config, 0)
    a = tm.logits(tokens[:, :T]).detach().numpy()
    t2 = tokens.copy()
    t2[:, 20] = (t2[:, 20] + 1) % config.vocab_size
    b = tm.logits(t2[:, :T]).detach().numpy()
    assert np.array_equal(a[:, :, :20], b[:, :, :20]) and not np.allclose(a[:, :, 20:], b[:, :, 20:])
    h0, obj, _ = tm.loss_and_grads(tokens)
    assert abs(h0 - math.log(config.vocab_size)) < 0.1 and abs(obj - math.log(config.vocab_size)) < 0.1


if __name__ == "__main__":   # print every measured error
    worst = {}
    for dtype in (np.float32, np.float64):
        for name in CONFIGS:
            for case in CASES:
                errs = compare(*case_inputs(name, case, dtype)[:2], dtype, *case_inputs(name, case, dtype)[2:])
                grad_max = max(v for k, v in errs.items() if k.startswith("grad "))
                worst_grad = max((v, k) for k, v in errs.items() if k.startswith("grad "))[1]
                print(f"{np.dtype(dtype).name:8s} {name:6s} {case:12s} logits {errs['logits']:.2e}  "
                      f"head0 {errs['head0_loss']:.2e}  objective {errs['objective']:.2e}  "
                      f"max grad {grad_max:.2e} ({worst_grad[5:]})  tol {TOL[dtype]:g}")
        for name, (config, b, t) in EXTRA.items():
            errs = compare(config, random_params(config, 4, dtype), dtype, make_tokens(config, 5, b, t),
                           make_mask(config, 6, b, t))
            grad_max = max(v for k, v in errs.items() if k.startswith("grad "))
            print(f"{np.dtype(dtype).name:8s} {name:14s} +mask  logits {errs['logits']:.2e}  "
                  f"head0 {errs['head0_loss']:.2e}  objective {errs['objective']:.2e}  max grad {grad_max:.2e}")
