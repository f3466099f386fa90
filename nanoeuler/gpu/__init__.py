"""The GPU engine: the same model on CuPy arrays, with cuBLAS matmuls and hand-written CUDA kernels.

CuPy is optional (`pip install 'nanoeuler[gpu-cuda13]'`, or `[gpu-cuda12]` on CUDA 12): this package
imports without it, and everything that needs it goes through `runtime.require_cupy()`, which raises a
one-line UserError when CuPy or a device is missing (naming the extra for this machine's CUDA). Layout:

    kernels/*.cu   CUDA C: FlashAttention fwd/bwd (causal, GQA, no T×T; fp32 math on CUDA cores, and a
                   bf16 tensor-core (WMMA) variant), RMSNorm, RoPE, SwiGLU, softmax cross-entropy, AdamW,
                   fp32<->bf16 conversion
    runtime.py     finding CuPy and a device; compiling kernels with cupy.RawModule
    matmul.py      cuBLAS products: fp32 / TF32 switch, bf16 x bf16 -> fp32 (cublasGemmEx)
    ops.py         GpuOps: the `nanoeuler.ops` names and signatures on CuPy arrays
    engine.py      to_gpu / to_cpu, loss_and_grads (the model code with GPU ops), GpuAdamW, GpuModel
                   (what `nanoeuler train --device gpu` hands to the ordinary training loop)
    check.py       check_gpu: every kernel vs the NumPy reference, then model gradients GPU vs CPU;
                   `python -m nanoeuler.gpu.check --long`: long contexts, memory, GPU->CPU checkpoint
    (tests/gpu_emu runs these kernels on the CPU for the tests; scripts/gpu_check.sh is the device run)

    from nanoeuler.gpu import check_gpu, gpu_available
    rows = check_gpu(seed=0)      # list[nanoeuler.training.check.Row]
"""
from .runtime import gpu_available, require_cupy

__all__ = ["check_gpu", "gpu_available", "require_cupy", "gpu_ops", "to_gpu", "to_cpu", "loss_and_grads",
           "GpuAdamW", "GpuModel", "set_tf32"]


def __getattr__(name):  # lazy: importing nanoeuler.gpu never imports CuPy
    if name == "check_gpu":
        from .check import check_gpu
        return check_gpu
    if name in ("gpu_ops", "to_gpu", "to_cpu", "loss_and_grads", "GpuAdamW", "GpuModel"):
        from . import engine
        return getattr(engine, name)
    if name == "set_tf32":
        from .matmul import set_tf32
        return set_tf32
    raise AttributeError(f"module 'nanoeuler.gpu' has no attribute {name!r}")
