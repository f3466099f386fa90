"""Inference: everything that turns a trained model and token ids into new tokens, in one package.

Modules, each importing only the ones above it in this list:

    quant.py        GGUF's block types: one row each (geometry, quantize, dequantize)
    qkernels.py     their matrix products in integers, as llama.cpp computes them
    cache.py        the KV cache (rows per sequence, positions per row) and attention over per-row positions
    float16.py      float16 <-> float32 inside the kernels (a float16 weight kept as its IEEE bits)
    gemv.py         matrix products over float32 / float16 weights, a panel of 64 outputs at a time
    attention_kernels.py  the decoding step's attention: one query head over the KV cache, in vector registers
    pool.py         the kernels' helper threads and the work they share: a product's panels, a step's attention
    kernels.py      the fused numba decoding step (every architecture, one compiled call) and its `Weights`
    weights.py      weight forms: how decoding reads each weight type (float32, float16, the GGUF block types:
                    made from quant.py's rows) and `linear` for a decoding step's few rows
    forward.py      the inference layout of the weights, the readable NumPy forward (any rows, any architecture)
    step.py         the one step every caller runs: fused-or-reference chosen
                    once (in `fuse_weights`); `forward_hidden` for one sequence, `advance` for a speculative
                    round, `decode_rows` for one token per row of a batch
    sampling.py     temperature / top-k / top-p, drawing, log-probabilities
    speculative.py  greedy speculative decoding: prompt-lookup drafts verified by head 0
    session.py      one sequence: `generate` (full / cache / speculative), the context-window rule, text out
    prefix.py       the prefix cache: blocks of keys and values of earlier requests, found by token prefix
    engine.py       continuous batching (`Batcher`): serve, dpo-data and answer scoring share it
    chat.py         a conversation: rendering with the chat template, dropping the oldest turns to fit

Callers: `sample`, `chat`, `demo`, evaluation and SFT/DPO answer checks run `session.generate`; `serve` and
`dpo-data` submit jobs to `engine.Batcher`.
"""
from ..numba_cache import install

install()  # before any kernel is compiled or loaded from the cache (see numba_cache.py)
