"""The GPU engine, tested at three depths so that CPU-only machines still catch most mistakes:

1. compile: every kernels/*.cu through nvcc (sm_90 PTX) and, where CuPy and NVRTC are installed,
   through NVRTC exactly as the loader passes it — syntax errors surface without a GPU;
2. emulate: the kernels' logic on the CPU (g++ + tests/gpu_emu/emu.h, a std::thread per CUDA thread)
   driven by the real nanoeuler.gpu Python code through a NumPy stand-in for CuPy: every kernel and the
   whole model's gradients against the NumPy reference;
3. device: the same checks on a real GPU — skipped cleanly when CuPy or a device is missing.
"""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from nanoeuler.training.check import Row
from nanoeuler.config import Config
from nanoeuler.errors import UserError
from nanoeuler.gpu.runtime import KERNEL_DIR, cuda_include_dir, gpu_available, gpu_extra, kernel_source

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
KERNEL_FILES = sorted(p.stem for p in KERNEL_DIR.glob("*.cu"))
TOL = 1e-5
# (file, -D defines): flash_attention is compiled once per head dimension by the loader
# (the head-dim-128 build of flash_attention.cu is left to scripts/gpu_check.sh: slow to compile here)
BUILDS = [(name, ()) for name in KERNEL_FILES if not name.startswith("flash_attention")] + \
         [("flash_attention", (("FA_HD", 64),)), ("flash_attention_wmma", (("FA_HD", 64),)),
          ("flash_attention_wmma", (("FA_HD", 32),))]


def test_every_kernel_file_is_covered():
    assert set(KERNEL_FILES) == {"adamw", "convert", "cross_entropy", "flash_attention", "flash_attention_wmma",
                                 "rmsnorm", "rope", "swiglu"}


# ---- 1. compile ---------------------------------------------------------------------------------------
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
@pytest.mark.parametrize("name,defines", BUILDS, ids=lambda x: str(x))
def test_nvcc_compiles(name, defines, tmp_path):
    cmd = ["nvcc", "-arch=sm_90", "-ptx", "--Werror", "all-warnings", "-std=c++17", f"-I{KERNEL_DIR}",
           *(f"-D{k}={v}" for k, v in defines), "-o", str(tmp_path / f"{name}.ptx"), str(KERNEL_DIR / f"{name}.cu")]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / f"{name}.ptx").stat().st_size > 0


def _nvrtc_program():
    try:
        from cupy.cuda import compiler
        compiler._NVRTCProgram("extern \"C\" __global__ void k() {}", name="probe.cu").compile(("-arch=compute_90",))
        return compiler._NVRTCProgram
    except Exception as e:  # no CuPy, no NVRTC library, or another CuPy internals layout
        pytest.skip(f"NVRTC unavailable here: {type(e).__name__}")


@pytest.mark.parametrize("name,defines", BUILDS, ids=lambda x: str(x))
def test_nvrtc_compiles_loader_source(name, defines):
    program = _nvrtc_program()
    options = ("--std=c++17", "-arch=compute_90") + tuple(f"-D{k}={v}" for k, v in defines)
    if "#include <mma.h>" in kernel_source(name):
        if cuda_include_dir() is None:
            pytest.skip("no CUDA headers (mma.h) here")
        options += (f"-I{cuda_include_dir()}",)
    ptx, _ = program(kernel_source(name), name=f"{name}.cu").compile(options)
    assert not re.search(r'^#include "common.cuh"', kernel_source(name), re.M)  # pasted in by the loader
    assert len(ptx) > 0


# ---- 2. emulate ---------------------------------------------------------------------------------------
needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not installed")


@pytest.fixture
def emu(monkeypatch):
    from gpu_emu import harness
    try:
        subprocess.run(["g++", "-std=c++20", "-x", "c++", "-fsyntax-only", "-"], input="#include <thread>\n",
                       text=True, check=True, capture_output=True)
    except subprocess.CalledProcessError:
        pytest.skip("g++ without C++20")
    return harness.install(monkeypatch)


def _assert_rows(rows: list[Row], tol=TOL):
    bad = [(r.name, r.max_rel_error) for r in rows if not r.max_rel_error <= tol]
    assert not bad, bad


@needs_gxx
def test_emulated_kernels_match_reference(emu):
    from nanoeuler.gpu.check import check_kernels
    rows = check_kernels(seed=1)
    assert len(rows) > 40
    _assert_rows(rows)


@needs_gxx
def test_emulated_tensor_core_attention_matches_reference(emu):
    """The WMMA kernels (wmma emulated as whole 16x16 tiles) within bf16 error of the float64 reference."""
    from nanoeuler.gpu.check import BF16_TOLERANCE, check_tensor_core_attention
    cases = {"GQA ragged T=70 hd=32": (1, 4, 2, 70, 70, 32), "decode Tq=5 Tk=41 hd=16": (2, 2, 1, 5, 41, 16)}
    from nanoeuler.gpu.check import check_bf16_outputs
    rows = check_tensor_core_attention(seed=0, cases=cases) + check_bf16_outputs(seed=0)
    assert len(rows) == 10
    _assert_rows(rows, tol=BF16_TOLERANCE)
    assert max(r.max_rel_error for r in rows) > 1e-5  # bf16 rounding is really there (not the fp32 kernel)


@needs_gxx
def test_emulated_model_gradients_match_cpu(emu):
    from nanoeuler.gpu.check import check_model_gpu
    cfg = Config(vocab_size=48, dim=32, n_heads=4, n_kv_heads=2, n_layers=2, ctx_len=20, ffn_hidden=40, n_mtp=2)
    rows = check_model_gpu(seed=0, config=cfg, batch=2)
    assert len(rows) == 2 + len(cfg.param_shapes())
    _assert_rows(rows)


@needs_gxx
def test_emulated_flash_attention_decode_rows_and_mask(emu):
    """Queries that are the last Tq of Tk positions (KV-cache decode) give the last rows of the full result,
    and the check can fail: attention without the causal mask is far from the kernel's output."""
    from nanoeuler import ops as ref
    from nanoeuler.gpu.check import rel_error
    from nanoeuler.gpu.ops import flash_forward
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 2, 9, 16)).astype(np.float32)
    k = rng.standard_normal((1, 1, 9, 16)).astype(np.float32)
    v = rng.standard_normal((1, 1, 9, 16)).astype(np.float32)
    y, _ = flash_forward(q, k, v)
    assert rel_error(y, ref.attention_forward(q.astype(np.float64), k, v)[0]) < TOL
    y_last, _ = flash_forward(np.ascontiguousarray(q[:, :, -3:]), k, v)
    assert rel_error(y_last, y[:, :, -3:]) < TOL
    S = q.astype(np.float64) @ k.swapaxes(-1, -2) / 4.0  # [1, 2, 9, 9], no mask
    P = np.exp(S - S.max(-1, keepdims=True))
    y_unmasked = (P / P.sum(-1, keepdims=True)) @ v
    assert rel_error(y, y_unmasked) > 1e-2


@needs_gxx
def test_emulated_training_step_and_checkpoint_roundtrip(emu, tmp_path):
    """GPU loss_and_grads + GpuAdamW equal the CPU Model + AdamW step; to_cpu saves a checkpoint the CPU loads."""
    from nanoeuler.gpu import engine
    from nanoeuler.model import Model
    from nanoeuler.optim import AdamW
    cfg = Config(vocab_size=40, dim=32, n_heads=2, n_kv_heads=1, n_layers=1, ctx_len=12, ffn_hidden=48, n_mtp=2)
    cpu = Model.init(cfg, seed=3)
    gm = engine.to_gpu(cpu)
    tokens = np.random.default_rng(0).integers(0, 40, (2, 14))
    l_ref, o_ref, g_ref = cpu.loss_and_grads(tokens, reference=True)
    l, o, g = engine.loss_and_grads(gm, tokens)
    assert abs(l - l_ref) < 1e-5 and abs(o - o_ref) < 1e-5
    AdamW(cpu.params, lr=1e-2).step(cpu.params, g_ref)
    engine.GpuAdamW(gm.params, lr=1e-2).step(gm.params, g)
    back = engine.to_cpu(gm)
    for n in cpu.params:
        np.testing.assert_allclose(back.params[n], cpu.params[n], atol=1e-4, rtol=0)  # 1% of a step
    back.save(tmp_path / "run")
    loaded = Model.load(tmp_path / "run")
    assert loaded.loss(tokens, reference=True)[0] == pytest.approx(back.loss(tokens, reference=True)[0], rel=1e-6)
    assert engine.loss(gm, tokens)[0] == pytest.approx(loaded.loss(tokens, reference=True)[0], abs=1e-5)


# ---- without CuPy ---------------------------------------------------------------------------------------
def test_check_device_gpu_without_cupy_is_one_line_error():
    code = ("import sys; sys.modules['cupy'] = None\n"
            "import nanoeuler.gpu\n"
            "from nanoeuler.cli import main\n"
            "sys.exit(main(['check', '--device', 'gpu']))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"error: GPU unavailable: CuPy is not installed ({gpu_extra()})"]


# ---- 3. device ------------------------------------------------------------------------------------------
needs_gpu = pytest.mark.skipif(not gpu_available(), reason="no CuPy or no CUDA device")


@needs_gpu
def test_gpu_check_passes():
    from nanoeuler.gpu import check_gpu
    _assert_rows(check_gpu(seed=0))


@needs_gpu
def test_gpu_bf16_step_close_to_f32():
    from nanoeuler.gpu import engine
    from nanoeuler.model import Model
    cfg = Config(vocab_size=256, dim=128, n_heads=4, n_kv_heads=2, n_layers=2, ctx_len=64, ffn_hidden=256, n_mtp=2)
    gm = engine.to_gpu(Model.init(cfg, seed=0))
    tokens = np.random.default_rng(0).integers(0, 256, (4, 66))
    l32, _, g32 = engine.loss_and_grads(gm, tokens, precision="f32")
    l16, _, g16 = engine.loss_and_grads(gm, tokens, precision="bf16")
    assert abs(l16 - l32) < 1e-2
    for n in g32:
        a, b = g16[n].get(), g32[n].get()
        assert np.abs(a - b).max() <= 0.05 * np.abs(b).max() + 1e-8, n


@needs_gxx
def test_emulated_bf16_mode_tracks_f32(emu):
    """bf16 mixed precision (bf16 matmul operands, tensor-core attention) stays within bf16 error of fp32."""
    from nanoeuler.gpu import engine
    from nanoeuler.model import Model
    cfg = Config(vocab_size=40, dim=32, n_heads=2, n_kv_heads=1, n_layers=1, ctx_len=12, ffn_hidden=48, n_mtp=2)
    gm = engine.to_gpu(Model.init(cfg, seed=1))
    tokens = np.random.default_rng(1).integers(0, 40, (2, 14))
    l32, _, g32 = engine.loss_and_grads(gm, tokens, precision="f32")
    l16, _, g16 = engine.loss_and_grads(gm, tokens, precision="bf16")
    assert engine.gpu_ops("bf16").flash_kernel(cfg.head_dim) == "wmma"
    assert abs(l16 - l32) < 1e-2 * abs(l32)
    for n in g32:
        assert np.abs(g16[n] - g32[n]).max() <= 0.05 * np.abs(g32[n]).max(), n


@needs_gxx
def test_emulated_train_roundtrip(emu, tmp_path, monkeypatch):
    """GpuModel + its optimizer learn, and the checkpoint they write is one the CPU loads with the same loss."""
    from nanoeuler import config
    from nanoeuler.gpu.check import check_train_roundtrip
    tiny = Config(vocab_size=32, dim=32, n_heads=2, n_kv_heads=1, n_layers=1, ctx_len=8, ffn_hidden=32, n_mtp=2)
    monkeypatch.setitem(config.PRESETS, "small", tiny)
    rt = check_train_roundtrip(steps=2, out_dir=tmp_path, min_drop=0.0)  # (the device run does 30 steps)
    assert rt["ok"], rt
    assert (tmp_path / "gpu_run" / "model.safetensors").exists()


@needs_gxx
def test_emulated_run_training_on_gpu_model_then_resume(emu, tmp_path):
    """The ordinary training loop drives a GpuModel: it learns, checkpoints (host copies), and resumes."""
    from nanoeuler import Model
    from nanoeuler.gpu.engine import GpuAdamW, GpuModel
    from nanoeuler.training.train import TrainConfig, run_training
    from train_fixtures import TINY, SyntheticSource
    tcfg = TrainConfig(steps=2, batch_size=2, lr=1e-2, warmup=1, eval_every=2, eval_batches=0, ckpt_every=1, seed=0)
    gm = GpuModel(Model.init(TINY, seed=0))
    assert isinstance(gm.optimizer(gm.params, lr=1e-3), GpuAdamW)
    summary = run_training(gm, None, SyntheticSource(batch_size=2), tmp_path, tcfg, stop_after=1, progress=False)
    assert summary["step"] == 1
    cpu = Model.load(tmp_path)  # an ordinary checkpoint
    for n, p in gm.host_params().items():
        np.testing.assert_array_equal(cpu.params[n], p)
    summary = run_training(GpuModel(cpu), None, SyntheticSource(batch_size=2), tmp_path, tcfg, resume=True,
                           progress=False)
    assert summary["finished"] and summary["step"] == 2 and np.isfinite(summary["val_loss"])


@needs_gxx
def test_emulated_gpu_model_is_trainable_without_dropout(emu):
    """GpuModel has every member of the training loop's interface; residual dropout is refused up front."""
    from nanoeuler import Model
    from nanoeuler.gpu.engine import GpuModel
    from nanoeuler.training.trainable import Trainable
    from nanoeuler.training.train import LMObjective, TrainConfig
    from train_fixtures import TINY
    gm = GpuModel(Model.init(TINY, seed=0))
    assert isinstance(gm, Trainable) and gm.device == "gpu" and gm.adapter_dropout == 0.0
    LMObjective(gm, None, TrainConfig(dropout=0.0))
    with pytest.raises(UserError, match="--dropout is not implemented on the GPU engine"):
        LMObjective(gm, None, TrainConfig(dropout=0.1))


@needs_gxx
def test_emulated_gpu_model_is_refused_by_data_parallel_training(emu):
    """Data parallelism runs the CPU engine: a GpuModel under MPI is one error, before its device arrays are
    read (GpuAdamW is an AdamW, so the optimizer's type does not tell)."""
    from nanoeuler import Model
    from nanoeuler.gpu.engine import GpuModel
    from nanoeuler.training import dist
    from nanoeuler.training.train import LMObjective, TrainConfig
    from train_fixtures import TINY, SyntheticSource

    class RankOfTwo(dist.Local):   # rank 0 of 2, whose agree() raises what the ranks would all raise
        size = 2

        def agree(self, error, fingerprint=None):
            if error:
                raise UserError(error)

    gm = GpuModel(Model.init(TINY, seed=0))
    tcfg = TrainConfig(steps=1, batch_size=2, seed=0)
    obj = LMObjective(gm, SyntheticSource(batch_size=2), tcfg)
    state = {"step": 0, "kind": "pretrain"}
    with pytest.raises(UserError, match=r"data-parallel training runs the CPU engine \(--device cpu\)"):
        dist.Trainer(RankOfTwo(), obj, gm.optimizer(obj.params), tcfg, state, np.random.default_rng(0))


def test_train_device_gpu_without_cupy_is_one_line_error(tmp_path):
    code = ("import sys; sys.modules['cupy'] = None\n"
            "from nanoeuler.cli import main\n"
            f"sys.exit(main(['train', '--device', 'gpu', '--out', {str(tmp_path / 'run')!r}, '--steps', '1']))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == f"error: GPU unavailable: CuPy is not installed ({gpu_extra()})"
