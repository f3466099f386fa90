"""Inference: everything that turns a trained model and token ids into new tokens, in one package.

Modules, each importing only the ones above it in this list:

    kernels.py      the fused numba/LLVM-IR decoding step, panel GEMV over f32/f16 weights, the thread pool
    cache.py        the KV cache (rows per sequence, positions per row) and attention over per-row positions
    weights.py      weight forms: how decoding reads each weight type (float32, float16, the GGUF block types:
                    KERNEL_FORMS) and `linear` for a decoding step's few rows
    forward.py      the inference layout of the weights, the readable NumPy forward (any rows, any architecture)
    step.py         the one step every caller runs: fused-or-reference chosen
                    once (in `fuse_weights`); `forward_hidden` for one sequence, `advance` for a speculative
                    round, `decode_rows` for one token per row of a batch
    sampling.py     temperature / top-k / top-p, drawing, log-probabilities
    speculative.py  greedy speculative decoding: prompt-lookup drafts verified by head 0
    session.py      one sequence: `generate` (full / cache / speculative), the context-window rule, text out
    engine.py       continuous batching (`Batcher`): serve, dpo-data and answer scoring share it
    chat.py         a conversation: rendering with the chat template, dropping the oldest turns to fit

Callers: `sample`, `chat`, `demo`, evaluation and SFT/DPO answer checks run `session.generate`; `serve` and
`dpo-data` submit jobs to `engine.Batcher`.
"""
from ..numba_cache import install

install()  # before any kernel is compiled or loaded from the cache (see numba_cache.py)
