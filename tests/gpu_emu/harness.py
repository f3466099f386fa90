"""Run nanoeuler's CUDA kernels on the CPU: g++ + emu.h, and a NumPy-backed stand-in for CuPy.

`EmuModule(code, options)` compiles a kernel file (as `kernel_source` returns it, common.cuh pasted in)
as C++20 with emu.h in front, adds an `extern "C" launch_<name>(gx, gy, gz, bx, void** args)` wrapper
per kernel — the same void** convention as cuLaunchKernel — and loads it with ctypes.
`fake_cupy()` returns a module that is NumPy plus what nanoeuler.gpu uses of CuPy, whose RawModule is
EmuModule, so the whole GPU code path (ops, engine, model) runs, slowly, on the CPU.
Only for tests: nothing here is part of the library.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import re
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
BUILD_DIR = Path(os.environ.get("NANOEULER_EMU_BUILD", Path(tempfile.gettempdir()) / "nanoeuler_gpu_emu"))

_F, _CF = "float*", "const float*"
_FA = lambda T: {  # FlashAttention entry points for storage type T
    "flash_fwd": [f"const {T}*"] * 3 + [_F, _F, "int", "int", "int", "int", "float"],
    "flash_bwd_dq": [f"const {T}*"] * 3 + [_CF, _CF, _CF, _F, "int", "int", "int", "int", "float"],
    "flash_bwd_dkdv": [f"const {T}*"] * 3 + [_CF, _CF, _CF, _F, _F, "int", "int", "int", "int", "float"],
}
_WM = ["const bf16_t*"] * 3
SIGNATURES = {
    "flash_wmma_fwd": _WM + [_F, _F, "int", "int", "int", "int", "float"],
    "flash_wmma_bwd_dq": _WM + [_CF, _CF, _CF, _F, "int", "int", "int", "int", "float"],
    "flash_wmma_bwd_dkdv": _WM + [_CF, _CF, _CF, _F, _F, "int", "int", "int", "int", "float"],
    **{f"{k}_f32": v for k, v in _FA("float").items()},
    **{f"{k}_bf16": v for k, v in _FA("bf16_t").items()},
    "rmsnorm_forward": [_CF, _CF, _F, _F, "int", "int", "float"],
    "rmsnorm_backward_dx": [_CF, _CF, _CF, _CF, _F, "int", "int"],
    "rmsnorm_backward_dw_partial": [_CF, _CF, _CF, _F, "int", "int"],
    "rope_rotate": [_CF, _CF, _CF, _F, "long long", "int", "int", "float"],
    "rope_rotate_bf16": [_CF, _CF, _CF, "bf16_t*", "long long", "int", "int", "float"],
    "swiglu_forward": [_CF, _CF, _F, "long long"],
    "swiglu_forward_bf16": [_CF, _CF, "bf16_t*", "long long"],
    "swiglu_backward": [_CF, _CF, _CF, _F, _F, "long long"],
    "ce_forward": [_CF, "const long long*", _F, _F, "int", "int"],
    "ce_backward": [_CF, _CF, "const long long*", _F, "int", "int", "float"],
    "adamw_step": [_F, _CF, _F, _F, "long long"] + ["float"] * 8,
    "f32_to_bf16": [_CF, "bf16_t*", "long long"],
    "bf16_to_f32": ["const bf16_t*", _F, "long long"],
}


def _wrapper(name: str, types_: list[str]) -> str:
    args = ", ".join(f"({t})(*(void**)a[{i}])" if t.endswith("*") else f"*({t}*)a[{i}]" for i, t in enumerate(types_))
    return (f'extern "C" void launch_{name}(unsigned gx, unsigned gy, unsigned gz, unsigned bx, void** a) '
            f"{{ emu_launch(gx, gy, gz, bx, [a] {{ {name}({args}); }}); }}\n")


class EmuModule:
    """cupy.RawModule look-alike: compiles `code` for the CPU emulator; get_function(name) -> launcher."""

    def __init__(self, code: str, options=()):
        defines = [o for o in options if o.startswith("-D")]
        names = [n for n in SIGNATURES if re.search(rf"\b{n}\b", code) or
                 re.search(rf"\b{n.rsplit('_', 1)[0]}_##SUFFIX\b", code)]
        src = '#include "emu.h"\n' + code + "\n" + "".join(_wrapper(n, SIGNATURES[n]) for n in names)
        key = hashlib.sha256((src + " ".join(defines) + (HERE / "emu.h").read_text()).encode()).hexdigest()[:16]
        BUILD_DIR.mkdir(parents=True, exist_ok=True)
        so = BUILD_DIR / f"k_{key}.so"
        if not so.exists():
            cpp = BUILD_DIR / f"k_{key}.cpp"
            cpp.write_text(src)
            tmp = so.with_suffix(f".{os.getpid()}.tmp")
            subprocess.run(["g++", "-std=c++20", "-O1", "-shared", "-fPIC", "-w", f"-I{HERE}", f"-I{HERE / 'include'}",
                            *defines, "-o", str(tmp), str(cpp)], check=True)
            os.replace(tmp, so)
        self.lib = ctypes.CDLL(str(so))
        self.names = names

    def get_function(self, name: str):
        fn = getattr(self.lib, f"launch_{name}")
        fn.restype = None
        types_ = SIGNATURES[name]

        def launch(grid, block, args):
            grid = tuple(grid) + (1,) * (3 - len(grid))
            assert len(args) == len(types_), (name, len(args), len(types_))
            holders = []
            for a, t in zip(args, types_):
                if t.endswith("*"):
                    assert isinstance(a, np.ndarray) and a.flags.c_contiguous, (name, t)
                    holders.append(ctypes.c_void_p(a.ctypes.data))
                else:
                    c = {"int": ctypes.c_int32, "long long": ctypes.c_int64, "float": ctypes.c_float}[t]
                    holders.append(c(a.item() if hasattr(a, "item") else a))
            argv = (ctypes.c_void_p * len(holders))(*[ctypes.addressof(h) for h in holders])
            fn(ctypes.c_uint(grid[0]), ctypes.c_uint(grid[1]), ctypes.c_uint(grid[2]), ctypes.c_uint(block[0]), argv)

        return launch


class _Event:
    def record(self): pass
    def synchronize(self): pass


class _Pool:
    def malloc(self, size): raise NotImplementedError
    def free_all_blocks(self): pass
    def total_bytes(self): return 0
    def used_bytes(self): return 0


def fake_cupy() -> types.ModuleType:
    """NumPy dressed as CuPy (for the parts nanoeuler.gpu uses), kernels run by the CPU emulator."""
    cp = types.ModuleType("cupy")
    cp.__getattr__ = lambda name: getattr(np, name)
    cp.asnumpy = np.asarray
    cp.asarray = lambda a, dtype=None: np.array(a, dtype=dtype)  # host -> "device" is a copy, as in CuPy
    cp.RawModule = lambda code, options=(): EmuModule(code, options)
    cp.get_default_memory_pool = _Pool
    cuda = types.SimpleNamespace(
        runtime=types.SimpleNamespace(getDeviceCount=lambda: 1),
        Event=_Event, get_elapsed_time=lambda a, b: 0.0,
        Device=lambda *a: types.SimpleNamespace(synchronize=lambda: None),
        get_current_stream=lambda: types.SimpleNamespace(ptr=0), set_allocator=lambda f: None)
    cp.cuda = cuda
    core = types.ModuleType("cupy._core")
    linalg = types.ModuleType("cupy._core._routines_linalg")
    linalg.COMPUTE_TYPE_TF32, linalg.COMPUTE_TYPE_DEFAULT = 7, 1
    linalg.set_compute_type = lambda dtype, t: None
    core._routines_linalg = linalg
    cp._core = core
    return cp, {"cupy": cp, "cupy._core": core, "cupy._core._routines_linalg": linalg}


def fake_gemm_bf16(a, b, trans_a=False, trans_b=False):
    """gemm_bf16 on the host: bf16 bits -> float32, fp64 product, float32 result."""
    f = lambda x: (x.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    A, B = f(a), f(b)
    return ((A.T if trans_a else A) @ (B.T if trans_b else B)).astype(np.float32)


class _Patcher:
    """The two pytest-monkeypatch methods install() uses, applied for good (for tests/gpu_emu/run.py)."""

    def setitem(self, mapping, key, value):
        mapping[key] = value

    def setattr(self, target, name, value):
        setattr(target, name, value)


def install(monkeypatch=None, threads: int = 32):
    """Put the fake CuPy in sys.modules and point nanoeuler.gpu at it (for the test's duration when
    `monkeypatch` is pytest's; for the rest of the process when None).

    `threads` is the block size of the elementwise and row kernels (THREADS): 32 is one warp (fast), 128
    is four warps, so block_sum / block_max combine per-warp partials through shared memory as on a GPU.
    The tensor-core kernels read tests/gpu_emu/include (stand-ins for mma.h, cuda_bf16.h)."""
    monkeypatch = monkeypatch or _Patcher()
    cp, modules = fake_cupy()
    for name, mod in modules.items():
        monkeypatch.setitem(sys.modules, name, mod)
    from nanoeuler.gpu import engine, matmul, ops, runtime
    runtime.require_cupy.cache_clear()
    runtime.load_module.cache_clear()
    monkeypatch.setattr(runtime, "cuda_include_dir", lambda: str(HERE / "include"))
    monkeypatch.setattr(ops, "_wmma_ok", {})
    monkeypatch.setattr(ops, "_wmma_reason", {})
    monkeypatch.setattr(ops, "gemm_bf16", fake_gemm_bf16)
    small_grid = lambda n, threads=threads, cap=4: max(1, min(cap, (n + threads - 1) // threads))
    for mod in (ops, matmul, engine):  # small blocks and grids: one fiber per CUDA thread
        monkeypatch.setattr(mod, "THREADS", threads)
        monkeypatch.setattr(mod, "blocks_for", small_grid)
    monkeypatch.setattr(engine, "_OPS", {})
    return cp
