"""What one float32 training step holds in memory: weights, gradients, AdamW moments, activations.

Activations are the arrays the forward pass keeps for the backward (the caches of the reference
implementation), counted exactly per layer (tests/test_memory.py checks the count against the caches):
    per layer   rmsnorm n + h (2·B·T·d), q (B·T·d), k and v (2·B·T·Hkv·hd), attention probabilities
                (B·H·T·T), attention output (B·T·d), second rmsnorm n + h (2·B·T·d), gate, up, silu·up (3·B·T·F)
    once        embeddings (B·T·d), final norm n + h (2·B·T·d), logits of K heads (K·B·T·V)
"""
from __future__ import annotations

from .config import Config


def activation_floats(cfg: Config, B: int, T: int) -> int:
    d, F, hd = cfg.dim, cfg.ffn_hidden, cfg.head_dim
    per_layer = 2 * B * T * d + B * T * d + 2 * B * T * cfg.n_kv_heads * hd + B * cfg.n_heads * T * T \
        + B * T * d + 2 * B * T * d + 3 * B * T * F
    return cfg.n_layers * per_layer + B * T * d + 2 * B * T * d + cfg.n_mtp * B * T * cfg.vocab_size


def training_memory(cfg: Config, B: int, T: int, bytes_per_float: int = 4) -> dict[str, int]:
    n = cfg.n_params()
    mem = {"weights": n, "gradients": n, "optimizer": 2 * n, "activations": activation_floats(cfg, B, T)}
    mem = {k: v * bytes_per_float for k, v in mem.items()}
    mem["total"] = sum(mem.values())
    return mem
