"""`nanoeuler info`'s activation count equals what the reference forward pass really keeps."""
import numpy as np
import pytest

from nanoeuler import Config, Model
from nanoeuler.training.memory import activation_floats, training_memory
from nanoeuler.model import forward


def _kept_floats(caches, params) -> int:
    """Sum the sizes of the distinct float arrays (views counted once, weights excluded) in the caches."""
    weights = {id(p) for p in params.values()}
    bases = {}

    def walk(o):
        if isinstance(o, np.ndarray):
            base = o if o.base is None else o.base
            if o.dtype.kind == "f" and id(o) not in weights and id(base) not in weights:
                bases[id(base)] = base.size
        elif isinstance(o, (tuple, list)):
            for x in o:
                walk(x)
        elif isinstance(o, dict):
            for x in o.values():
                walk(x)

    walk(caches)
    return sum(bases.values())


@pytest.mark.parametrize("cfg", [
    Config(vocab_size=40, dim=16, n_heads=4, n_kv_heads=2, n_layers=2, ctx_len=8, ffn_hidden=24, n_mtp=2),
    Config(vocab_size=33, dim=24, n_heads=3, n_kv_heads=3, n_layers=1, ctx_len=12, ffn_hidden=40, n_mtp=1),
    Config(vocab_size=40, dim=16, n_heads=2, n_kv_heads=1, n_layers=3, ctx_len=8, ffn_hidden=24, n_mtp=2,
           arch="gemma3", head_dim=12, sliding_window=4, global_every=3),
    Config(vocab_size=40, dim=16, n_heads=4, n_kv_heads=2, n_layers=2, ctx_len=8, ffn_hidden=24, n_mtp=1,
           arch="qwen2"),
    Config(vocab_size=40, dim=16, n_heads=4, n_kv_heads=2, n_layers=2, ctx_len=8, ffn_hidden=24, n_mtp=2,
           arch="gemma2", sliding_window=4),
    Config(vocab_size=40, dim=16, n_heads=4, n_kv_heads=2, n_layers=2, ctx_len=8, ffn_hidden=24, n_mtp=2,
           arch="olmo2"),
    Config(vocab_size=40, dim=16, n_heads=4, n_kv_heads=2, n_layers=2, ctx_len=8, ffn_hidden=24, n_mtp=2,
           arch="granite", embedding_multiplier=2.5, residual_multiplier=0.5, attention_multiplier=0.2,
           logits_scaling=3.0),
    Config(vocab_size=40, dim=16, n_heads=2, n_kv_heads=2, n_layers=2, ctx_len=8, ffn_hidden=24, n_mtp=2,
           arch="gptneox"),
], ids=["euler", "euler-mha", "gemma3", "qwen2", "gemma2", "olmo2", "granite", "gptneox"])
def test_activation_count_matches_the_caches(cfg):
    from nanoeuler.model import rope_tables as tables
    model = Model.init(cfg)
    B, T = 3, cfg.ctx_len
    logits, caches = forward(cfg, model.params, np.zeros((B, T), dtype=np.int64))
    rope_tables = len(tables(cfg, T, np.float32)) * 2 * T * cfg.head_dim // 2  # cos and sin of each RoPE base,
    # shared by the layers (not activations)
    assert _kept_floats(caches, model.params) - rope_tables + logits.size == activation_floats(cfg, B, T)


def test_training_memory_adds_up():
    mem = training_memory(Config.preset("big"), 16, 256)
    assert mem["weights"] == mem["gradients"] == 4 * 11_013_504 and mem["optimizer"] == 2 * mem["weights"]
    assert mem["total"] == sum(v for k, v in mem.items() if k != "total")
