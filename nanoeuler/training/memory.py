"""What one float32 training step holds in memory: weights, gradients, AdamW moments, activations.

Activations are the arrays the reference forward pass keeps for the backward (its caches), counted
exactly for every architecture (tests/test_memory.py checks the count against the caches; the fast
engine's workspace is of the same order). With N = B·T:
    per layer   each norm's n, h and 1/rms (or 1/σ) (2·N·d + N), rotated q (N·H·hd), k and v (2·N·Hkv·hd),
                attention probabilities (B·H·T·T), attention output (N·H·hd); q/k norms: the normed heads
                and their 1/rms (N·(H + Hkv)·(hd + 1)); post norms: n and 1/rms (N·d + N each);
                the MLP: SwiGLU's gate, up, σ(gate) and silu·up (4·N·F), GeGLU's gate, up, gelu, its tanh
                and the product (5·N·F), GPT-2's fc output, its tanh and gelu (3·N·F); soft-capped scores:
                their tanh (B·H·T·T)
    once        final norm n, h and 1/rms (2·N·d + N), logits of the K heads (K·N·V), soft-capped: their tanh
                too (K·N·V)
"""
from __future__ import annotations

import numpy as np

from ..adapters import LoraConfig, saved_names, trainable_shapes
from ..config import Config


MLP_FLOATS = {"swiglu": 4, "geglu": 5, "gelu": 3}  # the MLP's kept [N, F] arrays (see above)


def activation_floats(cfg: Config, B: int, T: int) -> int:
    a, d, F, hd, N = cfg.spec, cfg.dim, cfg.ffn_hidden, cfg.head_dim, B * T
    H, Hkv = cfg.n_heads, cfg.n_kv_heads
    norm = 2 * N * d + N
    attention = 2 * N * H * hd + 2 * N * Hkv * hd + B * H * T * T
    if a.qk_norm:   # normed q|k and 1/rms per head (qk_norm_whole: per projection)
        attention += N * (H + Hkv) * hd + N * (2 if a.qk_norm_whole else H + Hkv)
    if cfg.attn_softcap:
        attention += B * H * T * T
    post = 2 * (N * d + N) if a.post_norms else 0
    pre = norm if a.pre_norms else N * d   # without input norms: a sub-block's input itself, kept for its products
    per_layer = pre + attention + pre + MLP_FLOATS[a.mlp] * N * F + post
    return cfg.n_layers * per_layer + norm + (2 if cfg.logit_softcap else 1) * cfg.n_mtp * N * cfg.vocab_size


def training_memory(cfg: Config, B: int, T: int, bytes_per_float: int = 4, trained: int | None = None,
                    copied: int = 0) -> dict[str, int]:
    """Bytes of one training step. trained: the parameters that get gradients and AdamW moments (default all;
    LoRA: the adapters', whose own activations x·Aᵀ, B·T·r per adapted linear, are left out as negligible,
    and the saved modules'); copied: parameters held twice (LoRA's saved modules: the base's and the copy)."""
    n = cfg.n_params()
    t = n if trained is None else trained
    mem = {"weights": n + copied, "gradients": t, "optimizer": 2 * t, "activations": activation_floats(cfg, B, T)}
    mem = {k: v * bytes_per_float for k, v in mem.items()}
    mem["total"] = sum(mem.values())
    return mem


def lora_step_memory(cfg: Config, lcfg: LoraConfig, B: int, T: int) -> dict[str, int]:
    """training_memory of a LoRA step: gradients and moments of what it trains, the saved modules' tensors
    held twice (the base's, the trained copy)."""
    shapes = trainable_shapes(cfg, lcfg)
    copied = sum(int(np.prod(shapes[n])) for n in saved_names(cfg, lcfg))
    return training_memory(cfg, B, T, trained=sum(int(np.prod(s)) for s in shapes.values()), copied=copied)


def physical_memory() -> int:
    """Bytes of RAM on this machine (0 if unknown)."""
    import os
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def check_fits(cfg: Config, B: int, T: int, what: str = "a training step", limit: int | None = None) -> int:
    """Refuse (UserError) before allocating when one float32 training step of batch B x context T would
    need more than `limit` bytes (default: the machine's physical memory). Returns the estimate.

        check_fits(PRESETS["small"], 100000, 128)
        # UserError: a training step of batch 100000 x ctx 128 needs about 640.1 GiB ... (this machine: 7.8 GiB)
    """
    from ..errors import UserError
    need = training_memory(cfg, B, T)["total"]
    limit = physical_memory() if limit is None else limit
    if limit and need > limit:
        raise UserError(f"{what} of batch {B:,} x ctx {T:,} needs about {need / 2**30:.1f} GiB, more than this "
                        f"machine's {limit / 2**30:.1f} GiB; use a smaller --batch-size (or --grad-accum) or context")
    return need


def kv_cache_bytes(cfg: Config, batch: int = 1, positions: int | None = None, bytes_per_float: int = 4) -> int:
    """Bytes of a KV cache of `batch` rows x `positions` (default ctx_len): keys and values of every layer."""
    return 2 * cfg.n_layers * batch * cfg.n_kv_heads * (positions or cfg.ctx_len) * cfg.head_dim * bytes_per_float


def inference_memory(cfg: Config, batch: int = 1, bytes_per_float: int = 4) -> int:
    """Bytes generation holds: the weights and a KV cache of ctx_len positions (keys and values per layer)."""
    return cfg.n_params() * bytes_per_float + kv_cache_bytes(cfg, batch, bytes_per_float=bytes_per_float)


def check_inference_fits(cfg: Config, batch: int = 1, limit: int | None = None) -> int:
    """Refuse (UserError) a model whose weights + full-context KV cache exceed `limit` (default: RAM)."""
    from ..errors import UserError
    need = inference_memory(cfg, batch)
    limit = physical_memory() if limit is None else limit
    if limit and need > limit:
        raise UserError(f"generating with this model (ctx_len {cfg.ctx_len:,}) needs about {need / 2**30:.1f} GiB "
                        f"for its weights and KV cache, more than this machine's {limit / 2**30:.1f} GiB")
    return need
