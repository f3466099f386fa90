"""A model whose matrices come in several weight types, as real GGUF files mix them (Gemma 3's Q4_K_M: q and k in
Q5_0, v in Q8_0 in half the layers, Q4_K / Q6_K elsewhere, a Q8_0 embedding that is also the tied head): the fused
step multiplies each in its own type (segmented products, kernels._product) and equals the NumPy reference on
the dequantized values with the activations rounded as the kernels round them; a stacked product of several
types equals its segments' products side by side, bit for bit.

Without AVX512-VNNI the kernels' portable form runs (slow, never chosen for decoding: qkernels.AVAILABLE is set
here for the test only)."""
import numpy as np
import pytest
from conftest import rel_err, tiny_config

from nanoeuler import Model
from nanoeuler.infer import forward as reference
from nanoeuler.infer import kernels, pool, qkernels, quant
from nanoeuler.infer.cache import new_cache
from nanoeuler.infer.step import forward_cached, fuse_weights
from nanoeuler.infer.weights import QuantizedModel, of_dtype

# q5_0, q8_0 and q4_0 share the activations' rounding (8 bits per block of 32): one reference rounds for all
TYPES = {"attn.wq": "q5_0", "attn.wk": "q5_0", "attn.wv": "q8_0", "attn.wo": "q4_0", "ffn.gate": "q8_0",
         "ffn.up": "q5_0", "ffn.down": "q4_0", "embed": "q8_0"}
CFG = tiny_config(vocab_size=53, dim=64, n_heads=4, n_kv_heads=2, n_layers=2, ctx_len=24, ffn_hidden=96, n_mtp=1,
                  tie_embeddings=True)


@pytest.fixture
def portable(monkeypatch):
    monkeypatch.setattr(qkernels, "AVAILABLE", True)


def mixed_model(seed=0) -> QuantizedModel:
    m = Model.init(CFG, seed=seed)
    rng = np.random.default_rng(seed)
    P = {}
    for n, p in m.params.items():
        if p.ndim == 1:
            P[n] = rng.uniform(0.5, 1.5, p.shape).astype(np.float32)
            continue
        name = next(t for key, t in TYPES.items() if key in n)
        t = quant.WTYPES[name]
        P[n] = t.quantize(p * 4.0).view(t.dtype)
    return QuantizedModel.from_blocks(CFG, P)


def test_a_product_of_several_types_equals_its_segments_side_by_side(portable):
    rng = np.random.default_rng(1)
    parts = [quant.quantize(rng.standard_normal((rows, 64)).astype(np.float32), name).view(quant.WTYPES[name].dtype)
             for rows, name in ((128, "q5_0"), (64, "q8_0"), (64, "q4_0"))]
    forms = [of_dtype(p.dtype).pack(p) for p in parts]
    M = np.array([kernels.segment(of_dtype(p.dtype).kind, Wk, p.shape[0]) for p, Wk in zip(parts, forms)], np.int64)
    X = rng.standard_normal((3, 64)).astype(np.float32)
    Y = np.empty((3, 256), np.float32)
    pool.on_pool(lambda ctl, pooled: kernels._product(ctl, pooled, M, X, Y, False))
    want = np.concatenate([kernels.matvec(Wk, X, p.shape[0]) for p, Wk in zip(parts, forms)], axis=1)
    np.testing.assert_array_equal(Y, want)


def test_mixed_types_decode_as_the_reference_with_rounded_activations(portable, monkeypatch):
    qm = mixed_model()
    assert {quant.of_dtype(p.dtype).name for p in qm.params.values() if p.ndim == 2} == {"q5_0", "q8_0", "q4_0"}
    ids = np.random.default_rng(7).integers(0, CFG.vocab_size, (1, 11))

    def logits(fused):
        monkeypatch.setattr(kernels, "ENABLED", fused)
        W = fuse_weights(CFG, qm.params)
        monkeypatch.setattr(kernels, "ENABLED", True)
        assert ("decode" in W) == fused
        return W, forward_cached(CFG, None, ids, new_cache(CFG), fused=W)

    W, got = logits(True)
    assert W["decode"].segments[0].tolist() == [2, 1, 2, 1]  # q|k one Q5_0 segment, v Q8_0; gate Q8_0, up Q5_0
    _, plain = logits(False)

    def rounded(linear):
        def wrapped(x, Wm):
            rows = x.reshape(-1, x.shape[-1]).astype(np.float32)
            xq, xd, _ = quant.quantize_x8(rows)
            r = (xq.reshape(len(rows), -1, 32).astype(np.float64) * xd[..., None]).reshape(rows.shape)
            return linear(r.astype(np.float32).reshape(x.shape), Wm)
        return wrapped
    monkeypatch.setattr(reference, "linear", rounded(reference.linear))
    _, want = logits(False)
    assert rel_err(got, want) <= 1e-4
    assert rel_err(got, plain) > 10 * rel_err(got, want)
