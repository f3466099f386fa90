"""The float64 gradient check: every analytic gradient against central finite differences.

For a scalar function L(θ) the check compares, entry by entry, the analytic ∂L/∂θᵢ with the
fourth-order central difference

    D(h) = (−L(θ + 2h·eᵢ) + 8·L(θ + h·eᵢ) − 8·L(θ − h·eᵢ) + L(θ − 2h·eᵢ)) / (12·h)

Richardson-extrapolated to (16·D(h) − D(2h)) / 15 (truncation error O(h⁶)), and reports per tensor the maximum relative error

    rel = |analytic − numeric| / max(|analytic|, |numeric|, FLOOR)

The floor keeps near-zero gradients (where both sides are round-off) from dividing by zero.
(a) each op on random inputs, with L = Σ out ⊙ R for a fixed random R;
(b) every parameter tensor of a whole small model of each architecture (arch.py) with MTP (K=3) and GQA
    (H=4, Hkv=2), L = objective:
    every entry of a tensor of at most n_samples + 8 entries (norms, biases), else n_samples entries at
    random plus the 4 largest and the 4 most negative gradient entries; once more with dropout on the residual
    branches (fixed masks);
(c) DPO: its loss and response log-probs as ops, then every trained parameter through log-probs + DPO loss;
(d) LoRA: every adapter tensor of a whole small model (both architectures, every target), the base frozen;
    once more with dropout on the adapters' inputs.
(e) `--precision bf16`: the bf16 products' backward (the float32 kernels of fast/bf16.py) against finite
    differences of their float64 twin with the same operand rounding (`check_bf16`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .. import ops
from ..config import Config

H_STEP = 1e-3
# the finite differences' round-off is ~1e-12 absolute (1e-16·|L| over h = 1e-3, times the stencil's weights):
# against a floor of 1e-6 that read as up to 1.6e-6, above the tolerance, on an entry near the floor (qwen2's
# tied embedding, on an AVX-512 CPU whose float64 sums round otherwise); against 1e-5 it reads as ~1e-7
FLOOR = 1e-5
TOLERANCE = 1e-6


@dataclass
class Row:
    name: str
    max_rel_error: float
    n_checked: int


def relative_error(analytic: np.ndarray, numeric: np.ndarray) -> float:
    denom = np.maximum(np.maximum(np.abs(analytic), np.abs(numeric)), FLOOR)
    return float(np.max(np.abs(analytic - numeric) / denom))


def numeric_grad(f, x: np.ndarray, indices) -> np.ndarray:
    """Finite differences of scalar f() w.r.t. x at the given flat indices (x is perturbed in place).

    The fourth-order stencil D(h) is Richardson-extrapolated with D(2h): (16·D(h) − D(2h)) / 15 cancels
    the h⁴ term, leaving O(h⁶) truncation, so h can stay large enough (1e-3) for round-off to be tiny.
    """
    flat = x.reshape(-1)
    out = np.empty(len(indices))
    for j, i in enumerate(indices):
        orig = flat[i]
        values = {}
        for step in (4, 2, 1, -1, -2, -4):
            flat[i] = orig + step * H_STEP
            values[step] = f()
        flat[i] = orig
        # differences first: an input f does not depend on gives exactly 0
        d_h = (8 * (values[1] - values[-1]) - (values[2] - values[-2])) / (12 * H_STEP)
        d_2h = (8 * (values[2] - values[-2]) - (values[4] - values[-4])) / (24 * H_STEP)
        out[j] = (16 * d_h - d_2h) / 15
    return out


EXTREMES = 4  # the largest and the most negative analytic entries checked besides the random ones


def sample_indices(rng, analytic: np.ndarray, n: int) -> np.ndarray:
    """Flat indices of the entries to check: all of them when the tensor has at most n + 2·EXTREMES, else n
    at random plus the EXTREMES largest and most negative analytic entries (where contributions add up, so
    where a lost or overwritten one shows most). sample_indices(rng, np.array([3.0, -1.0, 2.0]), 4) -> [0, 1, 2]"""
    g = analytic.reshape(-1)
    if g.size <= n + 2 * EXTREMES:
        return np.arange(g.size)
    order = np.argsort(g, kind="stable")
    return np.unique(np.concatenate([rng.choice(g.size, n, replace=False), order[:EXTREMES], order[-EXTREMES:]]))


def check_tensor(name, f, x, analytic, rng, n_samples) -> Row:
    idx = sample_indices(rng, analytic, n_samples)
    num = numeric_grad(f, x, idx)
    return Row(name, relative_error(analytic.reshape(-1)[idx], num), len(idx))


# ---- (a) ops -----------------------------------------------------------------------------------
def _check_op(name, forward, backward, inputs: list[np.ndarray], rng, n_samples=30) -> list[Row]:
    """forward(*inputs) -> (out, cache); backward(dout, cache) -> grads per input (tuple or array)."""
    out, cache = forward(*inputs)
    R = rng.standard_normal(np.shape(out))
    grads = backward(R, cache)
    grads = grads if isinstance(grads, tuple) else (grads,)

    def f():
        return math.fsum((np.asarray(forward(*inputs)[0]) * R).ravel())  # exactly rounded: no alignment-dependent round-off

    return [check_tensor(f"op {name}: d{i}", f, x, g, rng, n_samples) for i, (x, g) in enumerate(zip(inputs, grads))]


def check_ops(seed: int = 0) -> list[Row]:
    rng = np.random.default_rng(seed)
    r = lambda *shape: rng.standard_normal(shape)
    B, T, d, V = 2, 5, 8, 11
    cos, sin = ops.rope_tables(T, ops.inv_freq(d, 10000.0), np.float64)
    # llama3-scaled frequencies: factor 8, low / high 1 / 4, an original context of 100 positions, which puts
    # the 4 wavelengths (6.3, 63, 628, 6283) in all three regimes (unscaled, blended, divided by 8)
    plain = ops.inv_freq(d, 10000.0)
    scaled = ops.rope_tables(T, plain / ops.llama3_factors(plain, 8.0, 1.0, 4.0, 100), np.float64)
    rows = []
    rows += _check_op("linear", ops.linear_forward, ops.linear_backward, [r(B, T, d), r(6, d)], rng)
    W, drop_in = r(6, d), ops.Dropout(0.3, seed).mask(site=2, rows=B * T, width=d, dtype=np.float64).reshape(B, T, d)
    rows += _check_op("lora (W frozen)", lambda x, A, B_: ops.lora_forward(x, W, A, B_, 1.5), ops.lora_backward,
                      [r(B, T, d), r(3, d), r(6, 3)], rng)
    rows += _check_op("lora (adapter dropout)", lambda x, A, B_: ops.lora_forward(x, W, A, B_, 1.5, drop_in),
                      ops.lora_backward, [r(B, T, d), r(3, d), r(6, 3)], rng)
    rows += _check_op("rmsnorm", lambda x, w: ops.rmsnorm_forward(x, w, 1e-5), ops.rmsnorm_backward,
                      [r(B, T, d), r(d)], rng)
    rows += _check_op("rope", lambda x: ops.rope_forward(x, cos, sin), ops.rope_backward, [r(B, 2, T, d)], rng)
    rows += _check_op("rope (llama3 scaling)", lambda x: ops.rope_forward(x, *scaled), ops.rope_backward,
                      [r(B, 2, T, d)], rng)
    rows += _check_op("swiglu", ops.swiglu_forward, ops.swiglu_backward, [r(B, T, d), r(B, T, d)], rng)
    drop_mask = ops.Dropout(0.3, seed).mask(site=1, rows=B * T, width=d, dtype=np.float64).reshape(B, T, d)
    rows += _check_op("dropout", lambda x: ops.dropout_forward(x, drop_mask), ops.dropout_backward, [r(B, T, d)], rng)
    rows += _check_op("attention (GQA)", ops.attention_forward, ops.attention_backward,
                      [r(B, 4, T, d), r(B, 2, T, d), r(B, 2, T, d)], rng)
    rows += _check_op("attention (MHA)", ops.attention_forward, ops.attention_backward,
                      [r(B, 2, T, d), r(B, 2, T, d), r(B, 2, T, d)], rng)
    rows += _check_op("attention (window 2)", lambda q, k, v: ops.attention_forward(q, k, v, 2), ops.attention_backward,
                      [r(B, 4, T, d), r(B, 2, T, d), r(B, 2, T, d)], rng)
    # soft-capping (Gemma 2): inputs of a few caps' size, where tanh bends
    rows += _check_op("softcap (cap 2)", lambda x: ops.softcap_forward(x, 2.0), ops.softcap_backward,
                      [3.0 * r(B, T, d)], rng)
    rows += _check_op("attention (soft cap 0.5)", lambda q, k, v: ops.attention_forward(q, k, v, 0, 0.5),
                      ops.attention_backward, [r(B, 4, T, d), r(B, 2, T, d), r(B, 2, T, d)], rng)
    ids = rng.integers(0, V, (B, T))
    emb_fwd = lambda W: ops.embedding_forward(ids, W)
    rows += _check_op("embedding", emb_fwd, ops.embedding_backward, [r(V, d)], rng)
    targets = rng.integers(0, V, B * T)
    targets[::3] = -1  # ignored rows: no loss, no gradient
    rows += _check_op("cross_entropy (ignore -1)", lambda z: ops.cross_entropy_forward(z, targets),
                      ops.cross_entropy_backward, [r(B * T, V)], rng)
    mtp_t = rng.integers(0, V, (3, B, T))
    mtp_t[1, 0, :2] = -1

    def mtp_fwd(z):
        objective, _, cache = ops.mtp_loss_forward(z, mtp_t)
        return objective, cache

    rows += _check_op("mtp_loss", mtp_fwd, ops.mtp_loss_backward, [r(3, B, T, V)], rng)
    # LayerNorm, GELU, bias, learned positions (arch gpt2); GeGLU (gemma3)
    rows += _check_op("layernorm", lambda x, w, b: ops.layernorm_forward(x, w, b, 1e-5), ops.layernorm_backward,
                      [r(B, T, d), r(d), r(d)], rng)
    # gelu' vanishes at x ≈ −0.752: there the gradient is below what finite differences of an O(10) sum
    # resolve (~1e-12 absolute against the floor), so inputs near it are moved out of that window
    # (tests/test_gpt2_ops.py checks gelu' there against torch autograd instead)
    gx = 1.5 * r(B, T, d)
    gx[np.abs(gx + 0.752) < 0.25] += 1.0
    rows += _check_op("gelu (tanh)", ops.gelu_forward, ops.gelu_backward, [gx], rng)
    rows += _check_op("gelu (erf; gptneox)", ops.gelu_erf_forward, ops.gelu_erf_backward, [gx], rng)
    rows += _check_op("geglu", ops.geglu_forward, ops.geglu_backward, [gx, r(B, T, d)], rng)
    rows += _check_op("bias", ops.bias_forward, ops.bias_backward, [r(B, T, d), r(d)], rng)
    rows += _check_op("scale (×0.3; granite)", lambda x: ops.scale_forward(x, 0.3), ops.scale_backward, [r(B, T, d)],
                      rng)
    rows += _check_op("position (start 3)", lambda x, W: ops.position_forward(x, W, start=3), ops.position_backward,
                      [r(B, T, d), r(T + 4, d)], rng)
    return rows


# ---- (b) the whole model -----------------------------------------------------------------------
CHECK_CONFIG = Config(vocab_size=64, dim=32, n_heads=4, n_kv_heads=2, n_layers=2, ctx_len=16, ffn_hidden=48, n_mtp=3)
# every architecture of arch.py at the same small size, MTP and GQA, each with what makes it itself:
# gpt2 (LayerNorm, learned positions, biases, GELU, tied head 0). attn.wk.bias has an exactly-zero gradient
# (a key bias shifts a whole row of scores, which softmax ignores): its row measures finite-difference
# round-off against the floor (~6e-8), not a wrong backward. qwen2 (q/k/v biases, tied head). gemma3 (GeGLU,
# q/k norms, post norms, √d embedding, a head width of its own, windowed layers with their own RoPE base).
GPT2_CHECK_CONFIG = CHECK_CONFIG.replace(arch="gpt2")
ARCH_CHECK_CONFIGS = {
    "euler": CHECK_CONFIG, "gpt2": GPT2_CHECK_CONFIG,
    "qwen2": CHECK_CONFIG.replace(arch="qwen2", tie_embeddings=True),
    "gemma3": CHECK_CONFIG.replace(arch="gemma3", head_dim=12, sliding_window=5, global_every=2),
    # qwen3 (q/k norms without post norms, its RoPE here scaled as Llama 3's: the scaled tables in a whole
    # model), mistral (every layer windowed)
    "qwen3": CHECK_CONFIG.replace(arch="qwen3", head_dim=12, rope_scaling="llama3", rope_factor=8.0,
                                  rope_original_ctx=100),
    "mistral": CHECK_CONFIG.replace(arch="mistral", sliding_window=5),
    # olmo2 (no input norms, post norms, q/k norms over each whole projection)
    "olmo2": CHECK_CONFIG.replace(arch="olmo2"),
    # smollm3 (layer 1 without RoPE: its q and k turned by angle 0)
    "smollm3": CHECK_CONFIG.replace(arch="smollm3", no_rope_every=2),
    # granite (every scalar multiplier away from 1 and 1/√hd)
    "granite": CHECK_CONFIG.replace(arch="granite", embedding_multiplier=2.5, residual_multiplier=0.5,
                                    attention_multiplier=0.2, logits_scaling=3.0),
    # gemma2 (soft caps on the attention scores and the logits, small enough to bend: 1 and 2; its windowed and
    # global layers alternate)
    "gemma2": CHECK_CONFIG.replace(arch="gemma2", sliding_window=5, attn_softcap=1.0, logit_softcap=2.0),
    "phi3": CHECK_CONFIG.replace(arch="phi3", sliding_window=5),   # (q|k|v and gate|up fused in its formats only)
    "starcoder2": CHECK_CONFIG.replace(arch="starcoder2", sliding_window=5),   # LayerNorm, GELU and biases with RoPE
    "stablelm": CHECK_CONFIG.replace(arch="stablelm", partial_rotary_factor=0.5),   # RoPE on half of each head
    # gptneox (the parallel residual, the exact GELU, LayerNorm and biases, RoPE on half of each head)
    "gptneox": CHECK_CONFIG.replace(arch="gptneox", partial_rotary_factor=0.5),
}


def check_model(seed: int = 0, n_samples: int = 12, config: Config = CHECK_CONFIG, batch: int = 2,
                dropout: float = 0.0) -> list[Row]:
    """Every parameter tensor of a float64 model: analytic grads vs finite differences of the objective
    (with dropout > 0: of the objective under one fixed set of dropout masks)."""
    from ..model import Model
    rng = np.random.default_rng(seed)
    model = Model.init(config, seed=seed, dtype=np.float64)
    # larger-than-init weights so every path carries a gradient well above round-off
    for name, p in model.params.items():
        p += rng.standard_normal(p.shape) * (0.3 if p.ndim > 1 else 0.5)
    tokens = rng.integers(0, config.vocab_size, (batch, config.ctx_len + config.n_mtp))
    mask = rng.random(tokens.shape) > 0.2
    drop = ops.Dropout(dropout, seed) if dropout else None
    _, _, grads = model.loss_and_grads(tokens, mask, dropout=drop)

    def f():
        return model.loss(tokens, mask, dropout=drop)[1]

    prefix = f"dropout {dropout:g}: " if drop else ""
    return [check_tensor(prefix + name, f, model.params[name], grads[name], rng, n_samples) for name in model.params]


# ---- (c) DPO ----------------------------------------------------------------------------------------
def check_dpo(seed: int = 0, n_samples: int = 12) -> list:
    """Rows for `nanoeuler check`: (a) the dpo_loss and response_logprobs pairs on random inputs,
    (b) every trained parameter of a float64 model (MTP K=3, GQA) through log-probs + DPO loss,
    with the reference a different model, and the frozen MTP heads getting exactly no gradient."""
    from .dpo import (chosen_nll_backward, chosen_nll_forward, dpo_loss_and_grads, dpo_loss_backward,
                      dpo_loss_forward, make_batch, response_logprobs_backward, response_logprobs_forward,
                      sequence_logprobs_forward)
    from ..model import Model
    rng = np.random.default_rng(seed)
    rows = []
    N, beta = 5, 0.1
    logps = [rng.standard_normal(N) * 3 for _ in range(4)]

    def loss_fwd(pc, pr, rc, rr):
        return dpo_loss_forward(pc, pr, rc, rr, beta)

    rows += _check_op("dpo_loss", loss_fwd, dpo_loss_backward, logps, rng)
    counts = rng.integers(1, 9, N)
    rows += _check_op("chosen_nll", lambda pc: chosen_nll_forward(pc, counts), chosen_nll_backward, [logps[0]], rng)
    B, T, V = 3, 6, 11
    targets = rng.integers(0, V, (B, T))
    mask = rng.random((B, T)) > 0.3
    targets[~mask] = -1  # padding ids outside the mask must not matter
    logits = rng.standard_normal((B, T, V))
    # confident targets keep the summed log-probs near 0, so the round-off of the finite differences
    # (≈ 1e-16·|L| / h) stays far below the floor at masked positions, where the true gradient is 0
    np.put_along_axis(logits, np.where(mask, targets, 0)[..., None], 6.0, axis=-1)
    rows += _check_op("response_logprobs", lambda z: response_logprobs_forward(z, targets, mask),
                      response_logprobs_backward, [logits], rng)

    cfg = CHECK_CONFIG
    policy = Model.init(cfg, seed=seed, dtype=np.float64)
    for p in policy.params.values():
        p += rng.standard_normal(p.shape) * (0.3 if p.ndim > 1 else 0.5)
    reference = Model(cfg, {n: p + rng.standard_normal(p.shape) * 0.05 for n, p in policy.params.items()})
    n_pairs = 2
    seqs = [rng.integers(0, cfg.vocab_size, rng.integers(6, cfg.ctx_len + 2)) for _ in range(2 * n_pairs)]
    masks = []
    for s in seqs:
        m = np.zeros(len(s), dtype=bool)
        m[rng.integers(2, len(s) - 1):] = True  # the response: a suffix
        masks.append(m)
    batch = make_batch(seqs[:n_pairs], masks[:n_pairs], seqs[n_pairs:], masks[n_pairs:])
    ref_logps, _ = sequence_logprobs_forward(cfg, reference.params, batch.inputs, batch.targets, batch.mask)
    rc, rr = ref_logps[:n_pairs], ref_logps[n_pairs:]
    _, _, grads = dpo_loss_and_grads(cfg, policy.params, batch, rc, rr, beta)

    def f():
        lp, _ = sequence_logprobs_forward(cfg, policy.params, batch.inputs, batch.targets, batch.mask)
        return dpo_loss_forward(lp[:n_pairs], lp[n_pairs:], rc, rr, beta)[0]

    for name, p in policy.params.items():
        if name in grads:
            rows.append(check_tensor(f"dpo: {name}", f, p, grads[name], rng, n_samples))
        else:  # a frozen MTP head: the DPO loss must not depend on it at all
            idx = rng.choice(p.size, min(n_samples, p.size), replace=False)
            num = numeric_grad(f, p, idx)
            rows.append(Row(f"dpo: {name} (frozen, |numeric| max)", float(np.max(np.abs(num))), len(idx)))
    # DPO + NLL of the chosen responses (--nll-weight): a few tensors through the combined loss
    nll_w = 0.5
    _, _, grads = dpo_loss_and_grads(cfg, policy.params, batch, rc, rr, beta, nll_weight=nll_w)

    def f_nll():
        lp, _ = sequence_logprobs_forward(cfg, policy.params, batch.inputs, batch.targets, batch.mask)
        n_tok = batch.mask[:n_pairs].sum(axis=1)
        return dpo_loss_forward(lp[:n_pairs], lp[n_pairs:], rc, rr, beta)[0] + nll_w * chosen_nll_forward(lp[:n_pairs], n_tok)[0]

    for name in ("embed.weight", "layers.0.attn.wq.weight", "layers.1.ffn.down.weight", "heads.0.weight"):
        rows.append(check_tensor(f"dpo+nll: {name}", f_nll, policy.params[name], grads[name], rng, n_samples))
    return rows


# ---- (d) LoRA ---------------------------------------------------------------------------------------
def check_lora(seed: int = 0, n_samples: int = 12, config: Config = CHECK_CONFIG, dropout: float = 0.0,
               modules_to_save: tuple[str, ...] = ()) -> list[Row]:
    """Every adapter tensor (rank 3, every target of the arch) of a float64 model, and every tensor of the
    modules trained whole beside them (modules_to_save): the analytic gradients (base frozen) vs finite
    differences of the objective (with dropout > 0: under fixed masks)."""
    from ..adapters import LoraConfig, init_adapters
    from .lora import LoraModel
    from ..model import Model
    rng = np.random.default_rng(seed)
    base = Model.init(config, seed=seed, dtype=np.float64)
    for p in base.params.values():
        p += rng.standard_normal(p.shape) * (0.3 if p.ndim > 1 else 0.5)
    lcfg = LoraConfig(3, 3.0, config.spec.lora_defaults, dropout, modules_to_save)
    adapters = init_adapters(config, lcfg, seed, np.float64, base.params)
    for a in adapters.values():
        a += rng.standard_normal(a.shape) * 0.2  # B = 0 would leave dA = 0: check a trained state
    model = LoraModel(base, lcfg, adapters, {"path": "", "sha256": ""})
    tokens = rng.integers(0, config.vocab_size, (2, config.ctx_len + config.n_mtp))
    mask = rng.random(tokens.shape) > 0.2
    drop = ops.Dropout(dropout, seed) if dropout else None
    _, _, grads = model.loss_and_grads(tokens, mask, reference=True, adapter_dropout=drop)

    def f():
        return model.reference_objective(tokens, mask, adapter_dropout=drop)[1]

    prefix = (f"lora {config.arch}" + (f" dropout {dropout:g}" if dropout else "")
              + (f" saving {','.join(modules_to_save)}" if modules_to_save else "") + ": ")
    return [check_tensor(prefix + name, f, a, grads[name], rng, n_samples) for name, a in adapters.items()]


# ---- (d) bf16 products --------------------------------------------------------------------------------------
def _bf16_values(rng, shape) -> np.ndarray:
    """float32-valued float64 in ±[1/8, 2): bfloat16-rounding changes them (24-bit significands), and every
    float32 sum of the kernels below is exact (products of 8-bit significands and integers ≤ 3, few terms)."""
    x = rng.uniform(0.125, 2.0, shape) * rng.choice([-1.0, 1.0], shape)
    return x.astype(np.float32).astype(np.float64)


def check_bf16(seed: int = 0, n_samples: int = 30) -> list[Row]:
    """`--precision bf16` (needs AVX512_BF16): for out = a·b with bf16 operands (forms x·Wᵀ and P·v), the
    kernels' backward da = R·ρ(b)ᵀ, db = ρ(a)ᵀ·R is the exact gradient of the forward ρ(a)·ρ(b). The float64
    twin holds the operands' rounding errors of the base point fixed (a + e_a, e_a = ρ(a₀) − a₀): equal to the
    bf16 forward there, and smooth, so finite differences see its gradient. R (the loss Σ out ⊙ R) is drawn
    from small integers: bf16 values, so the backward's own rounding of its incoming gradient is exact, as
    are the kernels' float32 sums: a backward that multiplied by b instead of ρ(b) would be 2⁻⁹ off."""
    from ..fast import bf16
    rng = np.random.default_rng(seed)
    M, K, N = 5, 7, 6
    f32 = lambda x: x.astype(np.float32)  # noqa: E731  (exact: the values are float32)
    rows = []
    for name, a, b, transposed in [("x·Wᵀ", _bf16_values(rng, (M, K)), _bf16_values(rng, (N, K)), True),
                                   ("P·v", _bf16_values(rng, (M, K)), _bf16_values(rng, (K, N)), False)]:
        ea, eb = bf16.round_bf16(a) - a, bf16.round_bf16(b) - b
        R = rng.integers(-3, 4, (M, N)).astype(np.float64)

        def f(a=a, b=b, ea=ea, eb=eb, R=R, transposed=transposed):
            B = (b + eb).T if transposed else b + eb
            return math.fsum((((a + ea) @ B) * R).ravel())

        da, db = np.empty(a.shape, np.float32), np.empty(b.shape, np.float32)
        if transposed:                                                     # x·Wᵀ: dx = R·ρ(W), dW = Rᵀ·ρ(x)
            bf16.matmul(f32(R), f32(b), da)
            bf16.matmul(f32(R).T, f32(a), db)
        else:                                                              # P·v: dP = R·ρ(v)ᵀ, dv = ρ(P)ᵀ·R
            bf16.matmul(f32(R), f32(b).T, da)
            bf16.matmul(f32(a).T, f32(R), db)
        rows += [check_tensor(f"bf16 product {name}: d{i}", f, x, g, rng, n_samples)
                 for i, (x, g) in enumerate([(a, da), (b, db)])]
    return rows
