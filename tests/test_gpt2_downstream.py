"""arch gpt2 downstream: KV-cache generation (logits equal to the full recomputation, every mode the same
greedy tokens). (The CLI pipeline of every architecture: tests/test_archs_cli.py.)"""
import numpy as np

from nanoeuler import Model
from nanoeuler.infer.cache import new_cache
from nanoeuler.infer.session import generate
from nanoeuler.infer.step import forward_cached
from conftest import rel_err, tiny_config

TINY = tiny_config(vocab_size=300, dim=32, n_heads=4, n_kv_heads=4, n_layers=2, ctx_len=24, ffn_hidden=64, n_mtp=2,
                   arch="gpt2")


def random_model(cfg, seed=0, dtype=np.float64):
    rng = np.random.default_rng(seed)
    m = Model.init(cfg, seed=seed, dtype=dtype)
    for n, p in m.params.items():   # far from init: biases and norms matter
        p += (0.3 if p.ndim > 1 else 0.2) * rng.standard_normal(p.shape).astype(dtype)
    return m


def test_cached_forward_equals_full_recomputation():
    m = random_model(TINY)
    ids = np.random.default_rng(1).integers(0, TINY.vocab_size, (2, 20))
    full = m.logits(ids)                                           # [K, B, T, V]
    cache = new_cache(TINY, batch=2, dtype=np.float64)
    parts = [forward_cached(TINY, m.params, ids[:, :7], cache), forward_cached(TINY, m.params, ids[:, 7:8], cache),
             forward_cached(TINY, m.params, ids[:, 8:], cache)]
    got = np.concatenate(parts, axis=2)
    assert rel_err(got, full) <= 1e-10
    # positions matter: the same tokens one position later give other logits
    cache2 = new_cache(TINY, batch=2, dtype=np.float64)
    forward_cached(TINY, m.params, ids[:, :1], cache2)
    shifted = forward_cached(TINY, m.params, ids[:, :7], cache2)
    assert np.max(np.abs(shifted[:, :, -1] - parts[0][:, :, -1])) > 1e-3


def test_every_generation_mode_gives_the_same_greedy_tokens():
    m = random_model(TINY, seed=2, dtype=np.float32)
    prompt = [5, 17, 250, 3]
    outs = {mode: generate(m, prompt, max_new_tokens=40, temperature=0, mode=mode).ids      # 44 > ctx 24: window jumps
            for mode in ("full", "cache", "speculative")}
    assert len(outs["full"]) == 40
    assert outs["full"] == outs["cache"] == outs["speculative"]
