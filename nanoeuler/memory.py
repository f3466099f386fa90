"""What one float32 training step holds in memory: weights, gradients, AdamW moments, activations.

Activations are the arrays the reference forward pass keeps for the backward (its caches), counted
exactly (tests/test_memory.py checks the count against the caches; the fast engine's workspace is of
the same order):
    per layer   rmsnorm n, h and 1/rms (2·B·T·d + B·T), rotated q (B·T·d), k and v (2·B·T·Hkv·hd),
                attention probabilities (B·H·T·T), attention output (B·T·d), second rmsnorm (2·B·T·d + B·T),
                gate, up, σ(gate) and silu·up (4·B·T·F)
    once        final norm n, h and 1/rms (2·B·T·d + B·T), logits of the K heads (K·B·T·V)
"""
from __future__ import annotations

from .config import Config


def activation_floats(cfg: Config, B: int, T: int) -> int:
    d, F, hd, N = cfg.dim, cfg.ffn_hidden, cfg.head_dim, B * T
    norm = 2 * N * d + N
    per_layer = norm + N * d + 2 * N * cfg.n_kv_heads * hd + B * cfg.n_heads * T * T + N * d + norm + 4 * N * F
    return cfg.n_layers * per_layer + norm + cfg.n_mtp * N * cfg.vocab_size


def training_memory(cfg: Config, B: int, T: int, bytes_per_float: int = 4) -> dict[str, int]:
    n = cfg.n_params()
    mem = {"weights": n, "gradients": n, "optimizer": 2 * n, "activations": activation_floats(cfg, B, T)}
    mem = {k: v * bytes_per_float for k, v in mem.items()}
    mem["total"] = sum(mem.values())
    return mem
