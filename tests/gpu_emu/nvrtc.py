"""NVRTC from the pip wheel (nvidia-cuda-nvrtc), driven through ctypes: compile CUDA C to PTX without CuPy
and without a GPU (NVRTC never touches the driver). Only for tests.

    lib = load_nvrtc()                       # None when the wheel is not installed
    ok, log = compile_ptx(lib, source, ["--std=c++17", "-arch=compute_90", "-I/usr/local/cuda/include"])
"""
from __future__ import annotations

import ctypes
from pathlib import Path


def nvrtc_lib_dirs() -> list[Path]:
    """The lib/ folders of the installed nvidia-cuda-nvrtc wheels (CUDA 13 layout nvidia/cu13, CUDA 12 nvidia/cuda_nvrtc)."""
    try:
        import nvidia
    except ImportError:
        return []
    dirs = []
    for base in getattr(nvidia, "__path__", []):
        for sub in ("cu13/lib", "cuda_nvrtc/lib", "cu12/lib"):
            d = Path(base) / sub
            if any(d.glob("libnvrtc.so*")):
                dirs.append(d)
    return dirs


def load_nvrtc():
    """The NVRTC library (ctypes.CDLL) from the pip wheel, or None. Loads libnvrtc-builtins first, by
    path and globally, since libnvrtc finds it through the loader's search path otherwise."""
    for d in nvrtc_lib_dirs():
        try:
            for builtins in sorted(d.glob("libnvrtc-builtins.so.*")):
                if ".alt." not in builtins.name:
                    ctypes.CDLL(str(builtins), mode=ctypes.RTLD_GLOBAL)
            main = [p for p in sorted(d.glob("libnvrtc.so*")) if ".alt." not in p.name]
            return ctypes.CDLL(str(main[0]))
        except (OSError, IndexError):
            continue
    return None


def compile_ptx(lib, source: str, options: list[str], name: str = "kernel.cu") -> tuple[bool, str]:
    """(compiled, NVRTC's log) for `source` with `options`."""
    prog = ctypes.c_void_p()
    rc = lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(), 0, None, None)
    assert rc == 0, f"nvrtcCreateProgram returned {rc}"
    try:
        opts = [o.encode() for o in options]
        rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(max(size.value, 1))
        lib.nvrtcGetProgramLog(prog, log)
        if rc == 0:
            lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
            assert size.value > 100, "empty PTX"
        return rc == 0, log.value.decode(errors="replace")
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
