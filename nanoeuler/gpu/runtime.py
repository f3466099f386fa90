"""CuPy, found lazily: the one place that imports it, checks for a device, and loads the `.cu` kernels.

The library imports without CuPy; only code that asks for the GPU reaches `require_cupy()`, which turns
"no CuPy" and "no usable device" into one-line `UserError`s instead of tracebacks, naming the extra
that matches this machine's CUDA (`gpu-cuda12` or `gpu-cuda13`):

    require_cupy()   # -> the cupy module, or UserError("GPU unavailable: CuPy is not installed (pip install ...)")

Kernels are CUDA C files in `kernels/`, compiled by NVRTC through `cupy.RawModule` on first use
(CuPy caches the binaries on disk, so later runs start at once). `#include "common.cuh"` is pasted
in by `kernel_source`, so NVRTC needs no include path for our own code.

The tensor-core kernels also `#include <mma.h>` and `<cuda_bf16.h>`, CUDA headers that NVRTC reads
from an include folder. `cuda_include_dir()` accepts a folder only when *every* header NVRTC opens for
them is there (`required_headers()`): a pip-wheel folder such as CuPy 14's `site-packages/nvidia/cu13`
has `include/mma.h`, which only includes `crt/mma.h` from another wheel (nvidia-cuda-crt), so
`mma.h` alone proves nothing:

    missing_headers("/usr/local/cuda/include")            # -> []
    missing_headers(".../site-packages/nvidia/cu13/include")  # -> ['crt/mma.h', 'crt/mma.hpp'] without that wheel

When no folder is complete, `load_module` raises a one-line UserError that says which folders lack what;
`ops.wmma_available` turns it into a one-line warning and the CUDA-core FlashAttention.
"""
from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
from pathlib import Path

from ..errors import UserError

KERNEL_DIR = Path(__file__).resolve().parent / "kernels"
THREADS = 256  # threads per block for the elementwise and row kernels
SYSTEM_CUDA_ROOT = Path("/usr/local")  # where toolkits install as cuda, cuda-12.8, cuda-13.0, ...

# Every CUDA header a kernel includes -> the headers NVRTC opens for it. Measured with NVRTC 13.0
# (strace of the real flash_attention_wmma.cu against CUDA 13.0's include folder: mma.h, crt/mma.h,
# crt/mma.hpp, cuda_fp16.h, cuda_bf16.h), plus the .hpp halves that CUDA 12's headers include
# (every toolkit and the nvidia-cuda-runtime wheel ship them beside the .h). A kernel including a header
# not listed here makes `required_headers` require that header alone (tests/test_gpu_runtime.py checks
# that every include is listed).
HEADER_DEPENDENCIES: dict[str, tuple[str, ...]] = {
    "mma.h": ("mma.h", "crt/mma.h", "crt/mma.hpp", "cuda_fp16.h", "cuda_fp16.hpp", "cuda_bf16.h", "cuda_bf16.hpp"),
    "cuda_bf16.h": ("cuda_bf16.h", "cuda_bf16.hpp", "cuda_fp16.h", "cuda_fp16.hpp"),
}
_SYSTEM_INCLUDE = re.compile(r"^\s*#\s*include\s*<([^>]+)>", re.M)


def cuda_major() -> int | None:
    """The CUDA major version this machine runs (the driver's, else nvcc's); None when neither answers.

        cuda_major()   # -> 13 on a CUDA 13 driver (R580+), 12 on R525..R575, None on a CPU-only machine
    """
    try:  # the driver decides which CuPy build can run
        import ctypes
        v = ctypes.c_int(0)
        if ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(v)) == 0 and v.value > 0:
            return v.value // 1000
    except (OSError, AttributeError):
        pass
    nvcc = shutil.which("nvcc")
    if nvcc:
        try:
            out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=20).stdout
            m = re.search(r"release (\d+)\.", out)
            if m:
                return int(m.group(1))
        except (OSError, subprocess.SubprocessError):
            pass
    return None


def gpu_extra(major: int | None = None) -> str:
    """The pip command for this machine's CuPy: `pip install 'nanoeuler[gpu-cudaNN]'`.

        gpu_extra(13) -> "pip install 'nanoeuler[gpu-cuda13]'"
        gpu_extra(12) -> "pip install 'nanoeuler[gpu-cuda12]'"
    (None: CUDA not detected, both are named.)
    """
    if major is None:
        major = cuda_major()
    if major in (12, 13):
        return f"pip install 'nanoeuler[gpu-cuda{major}]'"
    if major is not None and major > 13:
        return "pip install 'nanoeuler[gpu-cuda13]'"
    return "pip install 'nanoeuler[gpu-cuda13]' for CUDA 13, 'nanoeuler[gpu-cuda12]' for CUDA 12"


def _cupy_distributions() -> list[str]:
    """The CuPy wheels installed (more than one share the `cupy` module and break each other)."""
    from importlib import metadata
    names = set()
    for dist in metadata.distributions():
        name = (dist.metadata.get("Name") or "").lower()
        if name == "cupy" or name.startswith("cupy-cuda"):
            names.add(name)
    return sorted(names)


@functools.lru_cache(maxsize=1)
def require_cupy():
    """The cupy module, once a device is known to work; UserError (one line) otherwise."""
    try:
        import cupy
    except ImportError:
        raise UserError(f"GPU unavailable: CuPy is not installed ({gpu_extra()})") from None
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # CUDARuntimeError: no driver, driver too old, no device
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        dists = _cupy_distributions()
        hint = f"; {len(dists)} CuPy wheels are installed ({', '.join(dists)}): keep one" if len(dists) > 1 else ""
        raise UserError(f"GPU unavailable: CUDA reports {reason}{hint}") from None
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


def kernel_system_headers(kernel_dir: Path = KERNEL_DIR) -> list[str]:
    """The `#include <...>` names of every kernel file, e.g. ['cuda_bf16.h', 'mma.h']."""
    names = set()
    for path in sorted(kernel_dir.glob("*.cu")) + sorted(kernel_dir.glob("*.cuh")):
        names.update(_SYSTEM_INCLUDE.findall(path.read_text()))
    return sorted(names)


def required_headers(includes=None) -> list[str]:
    """Every header NVRTC must find for `includes` (default: what the kernels include), sorted.

        required_headers(["cuda_bf16.h"]) -> ['cuda_bf16.h', 'cuda_bf16.hpp', 'cuda_fp16.h', 'cuda_fp16.hpp']
    """
    out = set()
    for name in kernel_system_headers() if includes is None else includes:
        out.update(HEADER_DEPENDENCIES.get(name, (name,)))
    return sorted(out)


def missing_headers(include_dir, includes=None) -> list[str]:
    """The required headers that `include_dir` lacks ([] = complete)."""
    root = Path(include_dir)
    return [h for h in required_headers(includes) if not (root / h).is_file()]


def _nvcc_roots(nvcc: str) -> list[str]:
    """Toolkit roots of this nvcc: the one it reports (`--dryrun` prints TOP=..., also through wrapper
    scripts), then the folder above its bin/."""
    roots = []
    try:
        out = subprocess.run([nvcc, "--dryrun", "-c", "-x", "cu", os.devnull, "-o", os.devnull],
                             capture_output=True, text=True, timeout=30)
        m = re.search(r"^#\$ TOP=(.+)$", out.stdout + out.stderr, re.M)
        if m:
            roots.append(os.path.normpath(m.group(1).strip().strip('"')))
    except (OSError, subprocess.SubprocessError):
        pass
    return roots + [str(Path(nvcc).resolve().parent.parent)]


def include_candidates() -> list[tuple[str, str]]:
    """(where it came from, include folder) in search order, duplicates removed: CUDA_PATH, CUDA_HOME,
    nvcc's toolkit, /usr/local/cuda and /usr/local/cuda-* (newest first), then CuPy's CUDA path
    (last: with CuPy 14 that is the pip folder, often without crt/)."""
    roots: list[tuple[str, str | None]] = [("CUDA_PATH", os.environ.get("CUDA_PATH")),
                                           ("CUDA_HOME", os.environ.get("CUDA_HOME"))]
    nvcc = shutil.which("nvcc")
    if nvcc:
        roots += [("nvcc", root) for root in _nvcc_roots(nvcc)]
    roots.append((str(SYSTEM_CUDA_ROOT / "cuda"), str(SYSTEM_CUDA_ROOT / "cuda")))

    def version_key(p: Path):
        return [int(x) if x.isdigit() else -1 for x in re.split(r"[-.]", p.name)[1:]]

    roots += [(str(p), str(p)) for p in sorted(SYSTEM_CUDA_ROOT.glob("cuda-*"), key=version_key, reverse=True)]
    try:
        import cupy
        roots.append(("cupy.cuda.get_cuda_path()", cupy.cuda.get_cuda_path()))
    except Exception:  # no CuPy, or no CUDA path known to it
        pass
    seen, out = set(), []
    for label, root in roots:
        if not root:
            continue
        include = Path(root) / "include"
        key = str(include.resolve()) if include.exists() else str(include)
        if key not in seen:
            seen.add(key)
            out.append((label, str(include)))
    return out


def find_cuda_include(candidates=None) -> tuple[str | None, str]:
    """(the first complete include folder or None, a one-line account of the search).

        find_cuda_include([("CUDA_PATH", "/opt/cuda/include")]) -> ('/opt/cuda/include', 'CUDA headers: /opt/cuda/include (CUDA_PATH)')
    """
    if candidates is None:
        candidates = include_candidates()
    lacking = []
    for label, include in candidates:
        if not Path(include).is_dir():
            continue
        missing = missing_headers(include)
        if not missing:
            return include, f"CUDA headers: {include} ({label})"
        lacking.append(f"{include} lacks {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}")
    searched = "; ".join(lacking) if lacking else "no CUDA include folder found"
    return None, (f"no include folder has every header the tensor-core kernels need ({', '.join(required_headers())}): "
                  f"{searched}; set CUDA_PATH to a full CUDA toolkit (or pip install the nvidia-cuda-crt wheel of "
                  f"CuPy's CUDA)")


@functools.lru_cache(maxsize=1)
def cuda_include_dir() -> str | None:
    """The include folder holding every header the WMMA kernels need (see `find_cuda_include`), or None."""
    return find_cuda_include()[0]


@functools.lru_cache(maxsize=None)
def load_module(name: str, defines: tuple[tuple[str, int], ...] = ()):
    """cupy.RawModule for kernels/<name>.cu compiled with -D<k>=<v> for each define (cached per process)."""
    cp = require_cupy()
    source = kernel_source(name)
    options = ("--std=c++17",) + tuple(f"-D{k}={v}" for k, v in defines)
    if _SYSTEM_INCLUDE.search(source):
        include = cuda_include_dir()
        if include is None:
            raise UserError(find_cuda_include()[1])
        options += (f"-I{include}",)
    return cp.RawModule(code=source, options=options)


def get_kernel(name: str, function: str, defines: tuple[tuple[str, int], ...] = ()):
    return load_module(name, defines).get_function(function)


def blocks_for(n: int, threads: int = THREADS, cap: int = 65535) -> int:
    """Grid size for a grid-stride loop over n elements: enough blocks to cover n, at most `cap`."""
    return max(1, min(cap, (n + threads - 1) // threads))
