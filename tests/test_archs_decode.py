"""Decoding every architecture of arch.py: the KV-cache reference (infer/forward.py) equals the training forward
(model.py) recomputed over the whole prefix, and the fused step (infer/kernels.py) equals the reference, for one
sequence, a prompt in chunks, rows at their own positions (serve's batcher), and greedy generation.

Each architecture at a small size with what makes it itself switched on and nonzero: gemma3 (a head width of
its own, q/k norms, post norms, GeGLU, √d embedding, windowed layers with their own RoPE base, sequences well
past the window), qwen2 (q/k/v biases, tied head), gpt2 (LayerNorm with biases, learned positions, GELU,
every bias), euler (the SPEC's model, MTP heads), qwen3 (q/k norms, a head width of its own, tied head), mistral
(every layer windowed), llama3 (euler with Llama 3's RoPE scaling), yarn (with YaRN's), gemma2 (soft-capped
attention and logits).
"""
import numpy as np
import pytest
from conftest import rel_err, tiny_config
from test_infer_kernels import weights  # the model laid out for the fused step or the NumPy one

from nanoeuler import Model
from nanoeuler.infer import kernels
from nanoeuler.infer.cache import new_cache
from nanoeuler.infer.session import generate
from nanoeuler.infer.step import decode_rows, forward_cached, forward_hidden
from nanoeuler.infer.weights import Float16Model

CONFIGS = {
    "euler": tiny_config(vocab_size=53, dim=32, n_heads=4, n_kv_heads=2, n_layers=2, ctx_len=40, ffn_hidden=40,
                         n_mtp=2),
    "qwen2": tiny_config(vocab_size=53, dim=32, n_heads=4, n_kv_heads=2, n_layers=2, ctx_len=40, ffn_hidden=40,
                         n_mtp=1, arch="qwen2", tie_embeddings=True),
    "gemma3": tiny_config(vocab_size=53, dim=32, n_heads=2, n_kv_heads=1, n_layers=3, ctx_len=40, ffn_hidden=40,
                          n_mtp=2, arch="gemma3", head_dim=16, sliding_window=6, global_every=3,
                          rope_local_theta=500.0),
    # Gemma 2: attention and final-logit soft caps small enough to bite, every other layer windowed
    "gemma2": tiny_config(vocab_size=53, dim=32, n_heads=4, n_kv_heads=2, n_layers=3, ctx_len=40, ffn_hidden=40,
                          n_mtp=2, arch="gemma2", sliding_window=6, attn_softcap=1.0, logit_softcap=4.0),
    "phi3": tiny_config(vocab_size=53, dim=32, n_heads=4, n_kv_heads=2, n_layers=2, ctx_len=40, ffn_hidden=40,
                        n_mtp=1, arch="phi3", sliding_window=6),
    "gpt2": tiny_config(vocab_size=53, dim=32, n_heads=4, n_kv_heads=4, n_layers=2, ctx_len=40, ffn_hidden=40,
                        n_mtp=1, arch="gpt2"),
    "qwen3": tiny_config(vocab_size=53, dim=32, n_heads=2, n_kv_heads=1, n_layers=2, ctx_len=40, ffn_hidden=40,
                         n_mtp=1, arch="qwen3", head_dim=16, tie_embeddings=True),
    "mistral": tiny_config(vocab_size=53, dim=32, n_heads=4, n_kv_heads=2, n_layers=2, ctx_len=40, ffn_hidden=40,
                           n_mtp=1, arch="mistral", sliding_window=6),
    # llama3 RoPE scaling (the fast / slow bounds 16 / 64 put head 8's pairs at θ 100 in all three regimes)
    "llama3": tiny_config(vocab_size=53, dim=32, n_heads=4, n_kv_heads=2, n_layers=2, ctx_len=40, ffn_hidden=40,
                          n_mtp=1, rope_theta=100.0, rope_scaling="llama3", rope_factor=4.0, rope_original_ctx=64),
    # yarn (its ramp puts those pairs at 0, 1/3, 2/3, 1 of the way to the factor; the scores times 1.30)
    "yarn": tiny_config(vocab_size=53, dim=32, n_heads=4, n_kv_heads=2, n_layers=2, ctx_len=40, ffn_hidden=40,
                        n_mtp=1, rope_theta=100.0, rope_scaling="yarn", rope_factor=4.0, rope_original_ctx=64),
    # OLMo 2: post norms only, q/k norms over each whole projection
    "olmo2": tiny_config(vocab_size=53, dim=32, n_heads=4, n_kv_heads=2, n_layers=2, ctx_len=40, ffn_hidden=40,
                         n_mtp=2, arch="olmo2"),
    # SmolLM3: layer 1 without RoPE (no_rope_every 2)
    "smollm3": tiny_config(vocab_size=53, dim=32, n_heads=4, n_kv_heads=2, n_layers=2, ctx_len=40, ffn_hidden=40,
                           n_mtp=2, arch="smollm3", no_rope_every=2),
    # Granite's four multipliers (embedding, residual, attention scale, logits), each away from its default
    "granite": tiny_config(vocab_size=53, dim=32, n_heads=4, n_kv_heads=2, n_layers=2, ctx_len=40, ffn_hidden=40,
                           n_mtp=2, arch="granite", embedding_multiplier=2.5, residual_multiplier=0.5,
                           attention_multiplier=0.2, logits_scaling=3.0),
    # GPT-2's LayerNorm, GELU and biases with RoPE, every layer windowed (untied: its tied head, at these
    # weights, repeats one token)
    "starcoder2": tiny_config(vocab_size=53, dim=32, n_heads=4, n_kv_heads=2, n_layers=2, ctx_len=40, ffn_hidden=40,
                              n_mtp=1, arch="starcoder2", sliding_window=6, tie_embeddings=False),
    # LayerNorm, q/k/v biases, RoPE on half of each head
    "stablelm": tiny_config(vocab_size=53, dim=32, n_heads=4, n_kv_heads=2, n_layers=2, ctx_len=40, ffn_hidden=40,
                            n_mtp=1, arch="stablelm", partial_rotary_factor=0.5),
    # GPT-NeoX: the parallel residual, the exact GELU, LayerNorm and biases, RoPE on half of each head
    "gptneox": tiny_config(vocab_size=53, dim=32, n_heads=4, n_kv_heads=4, n_layers=2, ctx_len=40, ffn_hidden=40,
                           n_mtp=1, arch="gptneox", partial_rotary_factor=0.5),
}


def test_every_architecture_has_a_case():
    """A record added to arch.py without a case here would go untested by every decoding path."""
    from nanoeuler.arch import ARCHS
    assert {c.arch for c in CONFIGS.values()} == set(ARCHS)


def model(arch: str, seed: int = 0, tied_embed: float = 0.5) -> Model:
    """Random weights a few times the init's size, norms and biases away from 1 and 0 (a tied embedding scaled
    by tied_embed: a large tied head repeats the last token, and greedy decoding gets stuck)."""
    m = Model.init(CONFIGS[arch], seed=seed)
    rng = np.random.default_rng(seed)
    for name, p in m.params.items():
        if name.endswith("norm.weight"):
            p[...] = 1 + 0.3 * rng.standard_normal(p.shape)
        elif name.endswith(".bias"):
            p[...] = 0.3 * rng.standard_normal(p.shape)
        elif name == "embed.weight" and "heads.0.weight" not in m.params:
            p *= tied_embed
        else:
            p *= 4.0
    return m


@pytest.mark.parametrize("arch", CONFIGS)
def test_cached_reference_equals_the_training_forward(arch, monkeypatch):
    """The prompt in pieces through the KV cache (9, then 1, then the rest) gives every position the logits of
    one full forward pass: the cache, the window and the positions are right (float64: to round-off)."""
    m = model(arch).astype(np.float64)
    cfg = m.config
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, (1, cfg.ctx_len))
    full = m.logits(ids)  # [K, 1, T, V]
    W, cache = weights(m, False, monkeypatch), new_cache(cfg, dtype=np.float64)
    parts = [forward_cached(cfg, None, ids[:, a:b], cache, fused=W) for a, b in ((0, 9), (9, 10), (10, cfg.ctx_len))]
    assert rel_err(np.concatenate(parts, axis=2), full) <= 1e-10


@pytest.mark.parametrize("half", [False, True], ids=["f32", "f16"])
@pytest.mark.parametrize("arch", CONFIGS)
def test_fused_step_equals_reference(arch, half, monkeypatch):
    """One sequence: a prompt of 3 chunks (kernels.CHUNK rows at most each call), then one token, past the
    window; logits and the cached keys and values equal the reference's."""
    m = model(arch, seed=2)
    if half:
        m = Float16Model(m)
    cfg = m.config
    ids = np.random.default_rng(3).integers(0, cfg.vocab_size, (1, cfg.ctx_len))
    Wf, Wr = weights(m, True, monkeypatch), weights(m, False, monkeypatch)
    cf, cr = new_cache(cfg, dtype=m.dtype), new_cache(cfg, dtype=m.dtype)
    tol = 1e-4   # float32 rounding of both sides: gemma3's fused and NumPy steps each sit 2-5e-5 from float64
    for a, b in ((0, 17), (17, 18), (18, cfg.ctx_len)):
        got = forward_cached(cfg, None, ids[:, a:b], cf, fused=Wf)
        want = forward_cached(cfg, None, ids[:, a:b], cr, fused=Wr)
        assert rel_err(got, want) <= tol, (a, b)
    for x, y in zip(cf.k + cf.v, cr.k + cr.v):  # (the last layers' keys carry every earlier layer's rounding)
        assert rel_err(x, y) <= 2 * tol


@pytest.mark.parametrize("arch", CONFIGS)
def test_rows_at_their_own_positions_equal_the_reference(arch, monkeypatch):
    """serve's batcher: rows of different sequences at their own positions (one past the window, one at 0) in
    one fused step equal the NumPy step."""
    m = model(arch, seed=4)
    cfg = m.config
    rng = np.random.default_rng(5)
    Wf, Wr = weights(m, True, monkeypatch), weights(m, False, monkeypatch)
    cf, cr = new_cache(cfg, 3), new_cache(cfg, 3)
    for x, y in zip(cf.k + cf.v, cr.k + cr.v):
        x[...] = y[...] = rng.standard_normal(x.shape)
    tokens, pos = np.array([7, 0, 52]), np.array([25, 0, cfg.ctx_len - 1])
    got, want = decode_rows(cfg, Wf, cf, tokens, pos), decode_rows(cfg, Wr, cr, tokens, pos)
    assert rel_err(got, want) <= 5e-5
    slots = np.array([2, 0])  # rows out of slot order (the batcher feeding some of its rows)
    got, want = decode_rows(cfg, Wf, cf, tokens[:2], pos[:2] + 1, slots), decode_rows(cfg, Wr, cr, tokens[:2],
                                                                                        pos[:2] + 1, slots)
    assert rel_err(got, want) <= 5e-5


GREEDY = {"euler": (6,), "qwen2": (9,), "gemma3": (6,), "gpt2": (16, 1.0), "llama3": (6,), "qwen3": (0,), "mistral": (6,),
          "smollm3": (4,), "yarn": (6,),
          "gemma2": (0,), "phi3": (6,), "starcoder2": (9,), "stablelm": (7,), "granite": (6,), "olmo2": (6,),
          "gptneox": (8,)}  # seeds whose greedy text varies


@pytest.mark.parametrize("arch", CONFIGS)
def test_greedy_generation_is_the_same_fused_or_not(arch, monkeypatch):
    """64 greedy tokens through window jumps (ctx 40): fused and reference decode the same ids, and a full
    recompute at each step (mode "full") agrees."""
    m = model(arch, *GREEDY[arch])
    prompt = [5, 17, 2, 40, 33]
    got = generate(m, prompt, 64, temperature=0, mode="cache")
    monkeypatch.setattr(kernels, "ENABLED", False)
    want = generate(m, prompt, 64, temperature=0, mode="cache")
    full = generate(m, prompt, 20, temperature=0, mode="full")
    assert got.ids == want.ids and got.ids[:20] == full.ids and len(set(got.ids)) > 4


def test_a_windowed_layer_forgets_what_left_its_window(monkeypatch):
    """gemma3 with every layer windowed: changing a token that left the window of every layer changes nothing,
    in the reference and in the fused step."""
    cfg = CONFIGS["gemma3"].replace(global_every=0, n_layers=1)
    m = Model.init(cfg, seed=7)
    ids = np.random.default_rng(8).integers(0, cfg.vocab_size, (1, 20))
    other = ids.copy()
    other[0, 2] = (ids[0, 2] + 1) % cfg.vocab_size
    for fused in (False, True):
        W = weights(m, fused, monkeypatch)
        a = forward_hidden(cfg, W, ids, new_cache(cfg))[0, -1]
        b = forward_hidden(cfg, W, other, new_cache(cfg))[0, -1]
        assert np.array_equal(a, b)
        c = forward_hidden(cfg, W, ids[:, :8], new_cache(cfg))[0, -1]
        d = forward_hidden(cfg, W, other[:, :8], new_cache(cfg))[0, -1]
        assert not np.array_equal(c, d)  # within the window it matters
