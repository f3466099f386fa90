"""The fast CPU training engine: the same model as `model.py`, fused and preallocated.

`model.py` and `ops/` stay the readable reference; this package is what `Model.loss_and_grads`,
`Model.loss` and `AdamW.step` run. It is tested against the reference in tests/test_fast.py and timed
against PyTorch by bench/train_speed.py.

- vmath.py    a float32 exp that numba vectorises (no vector math library is available to numba)
- kernels.py  fused serial numba kernels: RMSNorm, RoPE + head split, causal softmax, SwiGLU, dropout, cross-entropy, AdamW
- engine.py   the training step on preallocated buffers (`Workspace`), BLAS for every matmul
- parallel.py one sub-batch per core, each on single-threaded BLAS; the thread pool
- bf16.py     `--precision bf16`: bfloat16 matrix products with float32 accumulation (AVX512_BF16 kernels in
              LLVM IR), and their float64 NumPy twin
- decode.py   inference: the fused KV-cache decoding step (generate.py's forward for 1..8 new tokens),
              float32 or float16 weights, matrix-vector products shared by work-stealing threads
"""
from ..numba_cache import install

install()  # before any kernel is compiled or loaded from the cache (see numba_cache.py)

from .engine import Workspace, grad_buffers, loss, loss_and_grads  # noqa: E402

__all__ = ["Workspace", "grad_buffers", "loss", "loss_and_grads"]
