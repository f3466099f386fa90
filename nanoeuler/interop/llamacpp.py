"""Run a GGUF with llama.cpp (through `llama-cpp-python`) on token ids: greedy decoding and logits.

Used by the interop tests and bench/vs_llama_cpp.py to hold llama.cpp's output against ours on the same ids
(feeding ids, not text, keeps tokenizer differences out of the comparison).

    lc = LlamaCpp("m.gguf", n_ctx=128, threads=2)
    lc.greedy([5, 6, 7], 64)            # -> 64 token ids, each the argmax of the last logits
    lc.logits([5, 6, 7])                # -> float32 [3, V], one row per position
"""
from __future__ import annotations

import time

import numpy as np

from ..errors import UserError


class LlamaCpp:
    def __init__(self, path, n_ctx: int, threads: int = 2, logits_all: bool = False, kv_f32: bool = True,
                 lora=None, batch: int | None = None):
        """kv_f32: keep the KV cache in float32 (llama.cpp's default is f16, which alone costs ~1e-3 relative
        error on the logits); the float32 comparisons need it. lora: a GGUF LoRA adapter file applied on top.
        batch: tokens llama.cpp computes in one pass (default n_ctx: a prompt at once; 1: one token at a time,
        through its other kernels)."""
        try:
            import llama_cpp
        except ImportError:
            raise UserError("llama.cpp comparisons need llama-cpp-python: pip install 'nanoeuler[llama]'") from None
        kv = llama_cpp.GGML_TYPE_F32 if kv_f32 else llama_cpp.GGML_TYPE_F16
        self.llm = llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                                   n_batch=batch or n_ctx, n_ubatch=batch or n_ctx, logits_all=logits_all, verbose=False,
                                   seed=0, type_k=kv, type_v=kv, flash_attn=False,
                                   lora_path=None if lora is None else str(lora))
        self.n_vocab = self.llm.n_vocab()

    def _last_logits(self) -> np.ndarray:
        return np.ctypeslib.as_array(self.llm._ctx.get_logits_ith(-1), shape=(self.n_vocab,))

    def greedy(self, prompt: list[int], n: int) -> tuple[list[int], float]:
        """(n greedy tokens after prompt, seconds spent on the n-1 single-token decodes after the first)."""
        self.llm.reset()
        self.llm.eval(list(prompt))
        out = [int(np.argmax(self._last_logits()))]
        t0 = time.perf_counter()
        while len(out) < n:
            self.llm.eval([out[-1]])
            out.append(int(np.argmax(self._last_logits())))
        return out, time.perf_counter() - t0

    def logits(self, ids: list[int]) -> np.ndarray:
        """float32 [len(ids), V]: the logits at every position (needs logits_all=True)."""
        if not self.llm._logits_all:
            raise UserError("LlamaCpp.logits needs logits_all=True")
        self.llm.reset()
        self.llm.eval(list(ids))
        return np.array(self.llm.scores[:len(ids)], dtype=np.float32)
