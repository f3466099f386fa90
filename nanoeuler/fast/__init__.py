"""The fast CPU training engine: the same model as `model.py`, fused and preallocated.

`model.py` and `ops/` stay the readable reference; this package is what `Model.loss_and_grads`,
`Model.loss` and `AdamW.step` run. It is tested against the reference in tests/test_fast.py and timed
against PyTorch by bench/train_speed.py.

- vmath.py    a float32 exp that numba vectorises (no vector math library is available to numba)
- kernels.py  fused serial numba kernels: RMSNorm, RoPE + head split, causal softmax, SwiGLU, dropout, cross-entropy, AdamW
- engine.py   the training step on preallocated buffers (`Workspace`), BLAS for every matmul
- gpt2.py     the same step for arch gpt2, on engine.py's machinery
- parallel.py one sub-batch per core, each on single-threaded BLAS; the thread pool
- bf16.py     `--precision bf16`: bfloat16 matrix products with float32 accumulation (AVX512_BF16 kernels in
              LLVM IR), and their float64 NumPy twin
"""
from ..numba_cache import install

install()  # before any kernel is compiled or loaded from the cache (see numba_cache.py)

from . import engine, gpt2  # noqa: E402
from .engine import grad_buffers  # noqa: E402

__all__ = ["Workspace", "arch", "backward", "forward", "grad_buffers", "loss", "loss_and_grads"]


def arch(cfg):
    """The engine of cfg's architecture, the one place that switches on it: gpt2.py for arch gpt2, else
    engine.py. Both have Workspace, forward, heads, backward, loss_and_grads and loss, alike in signature."""
    return gpt2 if cfg.arch == "gpt2" else engine


# the training step of cfg's architecture: each as in engine.py
def Workspace(cfg, *args, **kwargs):  # noqa: N802 - builds the Workspace of cfg's architecture
    return arch(cfg).Workspace(cfg, *args, **kwargs)


def forward(cfg, *args, **kwargs):
    return arch(cfg).forward(cfg, *args, **kwargs)


def backward(cfg, *args, **kwargs):
    return arch(cfg).backward(cfg, *args, **kwargs)


def loss_and_grads(cfg, *args, **kwargs):
    return arch(cfg).loss_and_grads(cfg, *args, **kwargs)


def loss(cfg, *args, **kwargs):
    return arch(cfg).loss(cfg, *args, **kwargs)
