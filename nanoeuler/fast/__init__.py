"""The fast CPU training engine: the same model as `model.py`, fused and preallocated, for every architecture.

`model.py` and `ops/` stay the readable reference; this package is what `Model.loss_and_grads`,
`Model.loss` and `AdamW.step` run. It is tested against the reference in tests/test_fast.py and
tests/test_gpt2_fast.py, and timed against PyTorch by bench/train_speed.py.

- vmath.py    a float32 exp that numba vectorises (no vector math library is available to numba)
- kernels.py  fused serial numba kernels: the norms, RoPE + head split, windowed causal softmax, q/k norms,
              SwiGLU, GeGLU, GELU, biases, positions, dropout, cross-entropy, AdamW
- engine.py   the training step on preallocated buffers (`Workspace`), BLAS for every matmul; what the
              architecture's record (arch.py) switches on, it runs
- parallel.py one sub-batch per core, each on single-threaded BLAS; the thread pool
- bf16.py     `--precision bf16`: bfloat16 matrix products with float32 accumulation (AVX512_BF16 kernels in
              LLVM IR), and their float64 NumPy twin
"""
from ..numba_cache import install

install()  # before any kernel is compiled or loaded from the cache (see numba_cache.py)

__all__ = ["Workspace", "backward", "engine", "forward", "grad_buffers", "loss", "loss_and_grads"]


def __getattr__(name: str):
    """`fast.engine`, `fast.Workspace`, `fast.loss_and_grads`, ...: engine.py, imported on first use, so that
    decoding, which imports only vmath.py and parallel.py of this package, does not load the training engine."""
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import nanoeuler.fast.engine as engine   # (not `from . import engine`: that asks this function again)
    return engine if name == "engine" else getattr(engine, name)
