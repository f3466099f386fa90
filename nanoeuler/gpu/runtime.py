"""CuPy, found lazily: the one place that imports it, checks for a device, and loads the `.cu` kernels.

The library imports without CuPy; only code that asks for the GPU reaches `require_cupy()`, which turns
"no CuPy" and "no usable device" into one-line `UserError`s instead of tracebacks:

    require_cupy()   # -> the cupy module, or UserError("GPU unavailable: CuPy is not installed ...")

Kernels are CUDA C files in `kernels/`, compiled by NVRTC through `cupy.RawModule` on first use
(CuPy caches the binaries on disk, so later runs start at once). `#include "common.cuh"` is pasted
in by `kernel_source`, so NVRTC needs no include path.
"""
from __future__ import annotations

import functools
import os
import shutil
from pathlib import Path

from ..errors import UserError

KERNEL_DIR = Path(__file__).resolve().parent / "kernels"
THREADS = 256  # threads per block for the elementwise and row kernels


@functools.lru_cache(maxsize=1)
def require_cupy():
    """The cupy module, once a device is known to work; UserError (one line) otherwise."""
    try:
        import cupy
    except ImportError:
        raise UserError("GPU unavailable: CuPy is not installed (pip install 'nanoeuler[gpu]')") from None
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # CUDARuntimeError: no driver, driver too old, no device
        raise UserError(f"GPU unavailable: CUDA reports {str(e).splitlines()[0] or type(e).__name__}") from None
    if n < 1:
        raise UserError("GPU unavailable: CUDA reports no device")
    return cupy


def gpu_available() -> bool:
    """True when CuPy imports and a CUDA device answers (never raises)."""
    try:
        require_cupy()
        return True
    except UserError:
        return False


def kernel_source(name: str) -> str:
    """The text of kernels/<name>.cu with `#include "common.cuh"` replaced by that file's text."""
    common = (KERNEL_DIR / "common.cuh").read_text()
    src = (KERNEL_DIR / f"{name}.cu").read_text()
    return src.replace('#include "common.cuh"', common)


@functools.lru_cache(maxsize=1)
def cuda_include_dir() -> str | None:
    """The CUDA toolkit's include directory (holding mma.h), which NVRTC needs for the WMMA kernels."""
    candidates = []
    try:
        import cupy
        candidates.append(cupy.cuda.get_cuda_path())
    except Exception:
        pass
    candidates += [os.environ.get("CUDA_PATH"), os.environ.get("CUDA_HOME"), "/usr/local/cuda"]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(str(Path(nvcc).resolve().parent.parent))
    candidates += sorted(str(p) for p in Path("/usr/local").glob("cuda-*"))[::-1]
    for root in candidates:
        if root and (Path(root) / "include" / "mma.h").exists():
            return str(Path(root) / "include")
    return None


@functools.lru_cache(maxsize=None)
def load_module(name: str, defines: tuple[tuple[str, int], ...] = ()):
    """cupy.RawModule for kernels/<name>.cu compiled with -D<k>=<v> for each define (cached per process)."""
    cp = require_cupy()
    source = kernel_source(name)
    options = ("--std=c++17",) + tuple(f"-D{k}={v}" for k, v in defines)
    if "#include <mma.h>" in source:
        include = cuda_include_dir()
        if include is None:
            raise UserError("the tensor-core kernels need the CUDA headers (mma.h): set CUDA_PATH")
        options += (f"-I{include}",)
    return cp.RawModule(code=source, options=options)


def get_kernel(name: str, function: str, defines: tuple[tuple[str, int], ...] = ()):
    return load_module(name, defines).get_function(function)


def blocks_for(n: int, threads: int = THREADS, cap: int = 65535) -> int:
    """Grid size for a grid-stride loop over n elements: enough blocks to cover n, at most `cap`."""
    return max(1, min(cap, (n + threads - 1) // threads))
