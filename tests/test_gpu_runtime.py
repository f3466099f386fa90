"""Finding the CUDA headers for the tensor-core kernels, and falling back visibly when they are incomplete.

The failure this guards against: CuPy 14's `get_cuda_path()` is the pip folder `site-packages/nvidia/cu13`,
whose `include/mma.h` (wheel nvidia-cuda-runtime) only `#include`s `crt/mma.h` (wheel nvidia-cuda-crt,
often absent), so NVRTC fails with `cannot open source file "crt/mma.h"`. Reproduced here twice:
with fake folder layouts (no CUDA needed), and with NVRTC itself from the pip wheel through ctypes,
compiling the real kernel source (skipped only when nvidia-cuda-nvrtc is not installed).
"""
from __future__ import annotations

import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

from nanoeuler.errors import UserError
from nanoeuler.gpu import runtime
from nanoeuler.gpu.runtime import (HEADER_DEPENDENCIES, find_cuda_include, gpu_extra, kernel_source,
                                   kernel_system_headers, missing_headers, required_headers)

sys.path.insert(0, str(Path(__file__).resolve().parent))
ROOT = Path(__file__).resolve().parent.parent
CRT = ("crt/mma.h", "crt/mma.hpp")


def make_include(folder: Path, headers, source: Path | None = None) -> Path:
    """An include folder holding `headers`: copies from `source` when given, else one-line stand-ins."""
    for h in headers:
        dst = folder / h
        dst.parent.mkdir(parents=True, exist_ok=True)
        if source is not None:
            shutil.copyfile(source / h, dst)
        else:
            dst.write_text('#include "crt/mma.h"\n' if h == "mma.h" else f"// {h}\n")
    return folder


def pip_layout(tmp: Path, with_crt: bool, source: Path | None = None) -> Path:
    """site-packages/nvidia/cu13/include as the pip wheels leave it: nvidia-cuda-runtime's headers (mma.h,
    cuda_bf16.h, cuda_fp16.h, ...), and crt/ only when nvidia-cuda-crt is installed too."""
    headers = [h for h in required_headers() if with_crt or h not in CRT]
    return make_include(tmp / "site-packages" / "nvidia" / "cu13" / "include", headers, source)


# ---- which headers ---------------------------------------------------------------------------------------
def test_every_cuda_header_the_kernels_include_is_listed():
    """A new `#include <x.h>` in a kernel must come with the headers NVRTC opens for it."""
    assert set(kernel_system_headers()) == {"mma.h", "cuda_bf16.h"}
    assert set(kernel_system_headers()) <= set(HEADER_DEPENDENCIES)
    assert {"mma.h", "crt/mma.h", "cuda_bf16.h"} <= set(required_headers())


def test_kernel_system_headers_reads_the_kernel_files(tmp_path):
    (tmp_path / "a.cu").write_text('#include "common.cuh"\n#include <mma.h>\n')
    (tmp_path / "b.cuh").write_text("  #  include <cuda_fp8.h>\n")
    assert kernel_system_headers(tmp_path) == ["cuda_fp8.h", "mma.h"]
    assert required_headers(["cuda_fp8.h"]) == ["cuda_fp8.h"]  # unknown header: required as itself


# ---- fake folder layouts -----------------------------------------------------------------------------------
def test_pip_folder_without_crt_is_rejected_with_one_line(tmp_path):
    inc = pip_layout(tmp_path, with_crt=False)
    assert (inc / "mma.h").exists()  # the old test (mma.h exists) would have accepted it
    assert missing_headers(inc) == list(CRT)
    found, message = find_cuda_include([("cupy.cuda.get_cuda_path()", str(inc))])
    assert found is None
    assert "\n" not in message
    assert f"{inc} lacks crt/mma.h, crt/mma.hpp" in message and "CUDA_PATH" in message


def test_pip_folder_with_crt_is_accepted(tmp_path):
    inc = pip_layout(tmp_path, with_crt=True)
    assert find_cuda_include([("cupy.cuda.get_cuda_path()", str(inc))]) == (
        str(inc), f"CUDA headers: {inc} (cupy.cuda.get_cuda_path())")


def _fake_machine(monkeypatch, tmp_path, *, cuda_path=None, nvcc_root=None, system=None, cupy_root=None,
                  cupy_module=None):
    """Environment, PATH, /usr/local and CuPy as a test wants them (each None: absent); `cupy_module`:
    keep that (emulated) CuPy, with `cupy_root` as its get_cuda_path()."""
    monkeypatch.delenv("CUDA_HOME", raising=False)
    if cuda_path:
        monkeypatch.setenv("CUDA_PATH", str(cuda_path))
    else:
        monkeypatch.delenv("CUDA_PATH", raising=False)
    bindir = tmp_path / "no_nvcc_bin"
    bindir.mkdir(exist_ok=True)
    if nvcc_root:
        (nvcc_root / "bin").mkdir(parents=True, exist_ok=True)
        nvcc = nvcc_root / "bin" / "nvcc"  # prints what `nvcc --dryrun` prints: the toolkit root
        nvcc.write_text(f'#!/bin/sh\necho "#$ TOP={nvcc_root}/bin/.."\n')
        nvcc.chmod(0o755)
        bindir = nvcc_root / "bin"
    monkeypatch.setenv("PATH", f"{bindir}:/usr/bin:/bin")
    monkeypatch.setattr(runtime, "SYSTEM_CUDA_ROOT", system or tmp_path / "empty_usr_local")
    if cupy_module is not None:
        monkeypatch.setattr(cupy_module.cuda, "get_cuda_path", lambda: str(cupy_root), raising=False)
    elif cupy_root:
        fake = types.ModuleType("cupy")
        fake.cuda = types.SimpleNamespace(get_cuda_path=lambda: str(cupy_root))
        monkeypatch.setitem(sys.modules, "cupy", fake)
    else:
        monkeypatch.setitem(sys.modules, "cupy", None)
    runtime.cuda_include_dir.cache_clear()


def test_search_prefers_a_complete_toolkit_over_cupys_pip_folder(monkeypatch, tmp_path):
    """CUDA_PATH incomplete, CuPy's pip folder incomplete (the CuPy 14 case), nvcc's toolkit complete:
    the toolkit is chosen, though CuPy's folder has mma.h."""
    pip_inc = pip_layout(tmp_path, with_crt=False)
    half = make_include(tmp_path / "half" / "include", ["mma.h", "cuda_bf16.h"])
    toolkit = tmp_path / "opt" / "cuda-13.0"
    make_include(toolkit / "include", required_headers())
    _fake_machine(monkeypatch, tmp_path, cuda_path=half.parent, nvcc_root=toolkit, cupy_root=pip_inc.parent)
    labels = [label for label, _ in runtime.include_candidates()]
    assert labels[0] == "CUDA_PATH" and labels[-1] == "cupy.cuda.get_cuda_path()" and "nvcc" in labels
    assert runtime.cuda_include_dir() == str(toolkit / "include")
    runtime.cuda_include_dir.cache_clear()


def test_search_takes_newest_usr_local_cuda_then_cupy(monkeypatch, tmp_path):
    system = tmp_path / "usr_local"
    make_include(system / "cuda-12.4" / "include", required_headers())
    make_include(system / "cuda-12.10" / "include", required_headers())  # 12.10 > 12.4 (not string order)
    make_include(system / "cuda-13.0" / "include", ["mma.h"])          # newest, incomplete: skipped
    pip_inc = pip_layout(tmp_path, with_crt=True)
    _fake_machine(monkeypatch, tmp_path, system=system, cupy_root=pip_inc.parent)
    assert runtime.cuda_include_dir() == str(system / "cuda-12.10" / "include")
    shutil.rmtree(system)
    runtime.cuda_include_dir.cache_clear()
    assert runtime.cuda_include_dir() == str(pip_inc)  # CuPy's folder, now complete, is the last resort
    runtime.cuda_include_dir.cache_clear()


def test_no_complete_folder_falls_back_to_cuda_core_attention_visibly(monkeypatch, tmp_path, capfd):
    """Only CuPy's pip folder without crt/: the WMMA kernels are not compiled; the bf16 mode runs the
    CUDA-core FlashAttention; one stderr line says why; the tensor-core check rows fail (never timing or
    judging the fallback under the tensor-core name)."""
    if shutil.which("g++") is None:
        pytest.skip("g++ not installed (the CPU emulator)")
    from gpu_emu import harness
    real_search = runtime.cuda_include_dir
    cp = harness.install(monkeypatch)
    monkeypatch.setattr(runtime, "cuda_include_dir", real_search)  # the real search, not the emulator's folder
    from nanoeuler.gpu import ops
    from nanoeuler.gpu.check import check_tensor_core_attention
    pip_inc = pip_layout(tmp_path, with_crt=False)
    _fake_machine(monkeypatch, tmp_path, cupy_root=pip_inc.parent, cupy_module=cp)
    assert [c for c in runtime.include_candidates() if Path(c[1]).exists()] == [("cupy.cuda.get_cuda_path()", str(pip_inc))]
    with pytest.raises(UserError, match=r"lacks crt/mma.h"):
        runtime.load_module("flash_attention_wmma", (("FA_HD", 32),))
    capfd.readouterr()
    g16 = ops.GpuOps("bf16", tensor_core_attention=True)
    assert g16.flash_kernel(32) == "bf16" and g16.flash_kernel(32) == "bf16"  # asked twice, warned once
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("warning: tensor-core FlashAttention (hd=32) unavailable, using the CUDA-core kernel")
    assert "crt/mma.h" in err[0]
    rows = check_tensor_core_attention(cases={"tiny": (1, 2, 1, 5, 5, 32)})
    assert len(rows) == 1 and rows[0].max_rel_error == float("inf") and "kernels unavailable" in rows[0].name
    assert "crt/mma.h" in rows[0].name


# ---- NVRTC 13 from the pip wheel, through ctypes: the real compiler on the real kernel source -------------
def _nvrtc():
    from gpu_emu.nvrtc import load_nvrtc
    lib = load_nvrtc()
    if lib is None:
        pytest.skip("nvidia-cuda-nvrtc wheel not installed")
    return lib


def _real_headers() -> Path:
    """A complete set of real CUDA headers here: the chosen toolkit, or the pip wheels' folder."""
    runtime.cuda_include_dir.cache_clear()
    found = runtime.cuda_include_dir()
    if found is None:
        try:
            import nvidia
            for base in nvidia.__path__:
                if not missing_headers(Path(base) / "cu13" / "include"):
                    return Path(base) / "cu13" / "include"
        except ImportError:
            pass
        pytest.skip("no complete set of real CUDA headers (toolkit, or nvidia-cuda-runtime + nvidia-cuda-crt wheels)")
    return Path(found)


def test_nvrtc_reproduces_the_crt_failure_and_the_search_avoids_it(tmp_path):
    """With only the headers `required_headers()` lists, copied from a real CUDA: the real WMMA kernel
    compiles (the list is sufficient); without crt/ NVRTC fails on crt/mma.h exactly as on the device,
    and the search rejects that folder."""
    from gpu_emu.nvrtc import compile_ptx
    lib, real = _nvrtc(), _real_headers()
    src = kernel_source("flash_attention_wmma")
    opts = ["--std=c++17", "-arch=compute_90", "-DFA_HD=64"]
    broken = pip_layout(tmp_path / "broken", with_crt=False, source=real)
    ok, log = compile_ptx(lib, src, opts + [f"-I{broken}"], "flash_attention_wmma.cu")
    assert not ok and 'cannot open source file "crt/mma.h"' in log, log[:500]
    assert find_cuda_include([("pip", str(broken))])[0] is None
    complete = pip_layout(tmp_path / "complete", with_crt=True, source=real)
    assert find_cuda_include([("pip", str(broken)), ("pip+crt", str(complete))])[0] == str(complete)
    ok, log = compile_ptx(lib, src, opts + [f"-I{complete}"], "flash_attention_wmma.cu")
    assert ok, log[:2000]


BUILDS = [("adamw", ()), ("convert", ()), ("cross_entropy", ()), ("rmsnorm", ()), ("rope", ()), ("swiglu", ()),
          ("flash_attention", (("FA_HD", 64),)), ("flash_attention", (("FA_HD", 128),)),
          ("flash_attention_wmma", (("FA_HD", 64),)), ("flash_attention_wmma", (("FA_HD", 32),))]


@pytest.mark.parametrize("name,defines", BUILDS, ids=lambda x: str(x))
def test_nvrtc_wheel_compiles_loader_source(name, defines):
    """Every kernel exactly as `load_module` hands it to NVRTC (options and chosen include folder)."""
    from gpu_emu.nvrtc import compile_ptx
    lib = _nvrtc()
    options = ["--std=c++17", "-arch=compute_90"] + [f"-D{k}={v}" for k, v in defines]
    source = kernel_source(name)
    if "#include <" in source:
        options.append(f"-I{_real_headers()}")
    ok, log = compile_ptx(lib, source, options, f"{name}.cu")
    assert ok, log[:2000]


# ---- the extra to install -----------------------------------------------------------------------------------
@pytest.mark.parametrize("major,expected", [(12, "pip install 'nanoeuler[gpu-cuda12]'"),
                                            (13, "pip install 'nanoeuler[gpu-cuda13]'"),
                                            (14, "pip install 'nanoeuler[gpu-cuda13]'")])
def test_gpu_extra_names_the_matching_cupy(major, expected):
    assert gpu_extra(major) == expected


def test_gpu_extra_without_cuda_names_both(monkeypatch):
    monkeypatch.setattr(runtime, "cuda_major", lambda: None)
    hint = gpu_extra()
    assert "nanoeuler[gpu-cuda13]" in hint and "nanoeuler[gpu-cuda12]" in hint
    assert "nanoeuler[gpu]" not in hint


def test_extras_named_in_hints_exist_in_pyproject():
    import tomllib
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["gpu-cuda12"] == ["cupy-cuda12x>=13"] and extras["gpu-cuda13"] == ["cupy-cuda13x>=14"]
    assert "gpu" not in extras
    for path in [ROOT / "README.md", *sorted((ROOT / "nanoeuler").rglob("*.py")), ROOT / "scripts" / "gpu_check.sh"]:
        assert "nanoeuler[gpu]" not in path.read_text(), path  # the old extra is gone


def test_cuda_major_reads_nvcc_without_a_driver(monkeypatch, tmp_path):
    nvcc = tmp_path / "nvcc"
    nvcc.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 12.8, V12.8.93'\n")
    nvcc.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    import ctypes
    real_cdll = ctypes.CDLL

    def no_driver(name, *a, **k):
        if "libcuda" in str(name):
            raise OSError("no driver")
        return real_cdll(name, *a, **k)

    monkeypatch.setattr(ctypes, "CDLL", no_driver)
    assert runtime.cuda_major() == 12
    monkeypatch.setenv("PATH", f"{tmp_path / 'none'}:/usr/bin:/bin")
    if shutil.which("nvcc") is None:
        assert runtime.cuda_major() is None


def test_missing_cupy_error_names_the_detected_extra():
    code = ("import sys; sys.modules['cupy'] = None\n"
            "from nanoeuler.gpu.runtime import gpu_extra\n"
            "from nanoeuler.cli import main\n"
            "print(gpu_extra())\n"
            "sys.exit(main(['check', '--device', 'gpu']))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2
    hint = proc.stdout.strip()
    assert proc.stderr.strip().splitlines() == [f"error: GPU unavailable: CuPy is not installed ({hint})"]
