"""gpu/check.py on the CPU emulator: every section independent (one failure is one error row, the rest
still run and print), and the row kernels with 128-thread blocks (four warps: block_sum / block_max
combine per-warp partials through shared memory, a path 32-thread blocks never take)."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
TOL = 1e-5

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not installed (the CPU emulator)")


def _install(monkeypatch, threads=32):
    from gpu_emu import harness
    try:
        subprocess.run(["g++", "-std=c++20", "-x", "c++", "-fsyntax-only", "-"], input="#include <thread>\n",
                       text=True, check=True, capture_output=True)
    except subprocess.CalledProcessError:
        pytest.skip("g++ without C++20")
    return harness.install(monkeypatch, threads=threads)


def _boom(*a, **k):
    raise RuntimeError("forced failure")


def test_failing_kernel_group_is_one_error_row_and_the_rest_run(monkeypatch, capfd):
    _install(monkeypatch)
    from nanoeuler.gpu import check, ops
    all_rows = check.check_kernels(seed=1)
    assert all(r.max_rel_error <= TOL for r in all_rows)
    monkeypatch.setattr(ops.GpuOps, "rope_forward", _boom)
    capfd.readouterr()
    printed = []
    rows = check.check_kernels(seed=1, on_rows=printed.extend)
    err = capfd.readouterr().err
    assert err.strip().splitlines() == ["error: rope: ERROR RuntimeError: forced failure"]
    failing = [r for r in rows if not r.max_rel_error <= TOL]
    assert [r.name for r in failing] == ["gpu rope: ERROR RuntimeError: forced failure"]
    others = [r for r in all_rows if not r.name.startswith("gpu rope ")]
    assert [r.name for r in rows if r not in failing] == [r.name for r in others]  # every other row, in order
    assert rows == printed  # and each was handed out as its group finished


def test_check_gpu_keeps_the_model_rows_when_a_kernel_group_fails(monkeypatch):
    _install(monkeypatch)
    from nanoeuler.config import Config
    from nanoeuler.gpu import check, ops
    small = Config(vocab_size=48, dim=32, n_heads=4, n_kv_heads=2, n_layers=1, ctx_len=12, ffn_hidden=40, n_mtp=2)
    monkeypatch.setattr(check, "MODEL_CHECK_CONFIG", small)
    monkeypatch.setattr(check.check_model_gpu, "__defaults__", (0, small, 2))
    monkeypatch.setattr(ops, "rmsnorm_bwd", _boom)  # the rmsnorm group AND the model's backward fail
    rows = check.check_gpu(seed=0)
    names = [r.name for r in rows]
    assert "gpu rmsnorm: ERROR RuntimeError: forced failure" in names
    assert "gpu model gradients: ERROR RuntimeError: forced failure" in names
    assert "gpu swiglu forward" in names and "gpu adamw update w" in names  # groups after the failure ran


def _run_main(args, capfd):
    from nanoeuler.gpu import check
    rc = check.main(args)
    out, err = capfd.readouterr()
    return rc, out, err


def test_long_check_prints_every_part_when_tensor_cores_and_round_trip_fail(monkeypatch, capfd, tmp_path):
    """No CUDA headers (the WMMA kernels do not compile) and a crashing round trip: the tensor-core rows
    fail with the reason, the fp32 FlashAttention rows at every T, the memory line and the verdict print."""
    _install(monkeypatch)
    from nanoeuler.gpu import check, runtime
    monkeypatch.setattr(runtime, "cuda_include_dir", lambda: None)
    monkeypatch.setattr(runtime, "find_cuda_include", lambda: (None, "no include folder has crt/mma.h (test)"))
    monkeypatch.setattr(check, "check_train_roundtrip", _boom)
    rc, out, err = _run_main(["--long", "--small", "--no-rows"], capfd)
    assert rc == 1 and out.strip().splitlines()[-1] == "FAILED"
    assert "gpu attention tensor-core GQA ragged T=70 hd=32: kernels unavailable (UserError: no include folder has " \
           "crt/mma.h (test))" in out
    assert "gpu rope bf16 output" in out and "gpu swiglu bf16 output" in out  # the rest of the tensor-core part
    assert "error: GPU training round trip: RuntimeError: forced failure" in err
    for T in (40, 72):
        assert f"flash T={T:>5} B=1 H=4/2 hd=32: fwd" in out
    assert out.count("tensor-core bf16 kernels: ERROR kernels unavailable (UserError") == 2
    assert "memory at T=64" in out
    assert err.count("warning: tensor-core FlashAttention (hd=32) unavailable") == 1


def test_long_check_one_failing_length_leaves_the_others(monkeypatch, capfd):
    _install(monkeypatch)
    from nanoeuler.gpu import check
    real = check.flash_long_one

    def flaky(T, *a, **k):
        if T == 40:
            raise MemoryError("out of memory allocating 12 GiB")
        return real(T, *a, **k)

    monkeypatch.setattr(check, "flash_long_one", flaky)
    monkeypatch.setattr(check, "flash_memory", _boom)
    rc, out, err = _run_main(["--parts", "flash,memory", "--small"], capfd)
    assert rc == 1
    assert "flash T=   40: ERROR MemoryError: out of memory allocating 12 GiB  FAIL" in out
    assert "flash T=   72 B=1 H=4/2 hd=32: fwd" in out and "tensor-core bf16 kernels: fwd" in out
    assert "error: FlashAttention memory comparison: RuntimeError: forced failure" in err
    assert out.strip().splitlines()[-1] == "FAILED"


def test_check_main_rejects_unknown_part(capfd):
    from nanoeuler.gpu import check
    assert check.main(["--parts", "rows,bogus"]) == 2
    assert capfd.readouterr().err.strip() == "error: unknown part 'bogus'; choose from rows, tensor-core, roundtrip, flash, memory"


def test_train_roundtrip_cpu_half_is_the_reference_path(monkeypatch, tmp_path):
    """The CPU loss of the saved checkpoint comes from Model.loss(reference=True): the numba engine (whose
    JIT cache does not travel to a fresh device machine) is never called."""
    _install(monkeypatch)
    from nanoeuler import model as model_mod
    from nanoeuler.config import Config
    from nanoeuler.gpu import check
    calls = []
    real_loss = model_mod.Model.loss

    def spy(self, tokens, loss_mask=None, *, reference=False, **k):
        calls.append(reference)
        return real_loss(self, tokens, loss_mask, reference=reference, **k)

    monkeypatch.setattr(model_mod.Model, "loss", spy)
    import nanoeuler.fast as fast
    for name in [n for n in dir(fast) if n.startswith("loss")]:
        monkeypatch.setattr(fast, name, _boom)  # would fail the round trip if reached
    tiny = Config(vocab_size=32, dim=32, n_heads=2, n_kv_heads=1, n_layers=1, ctx_len=8, ffn_hidden=32, n_mtp=2)
    rt = check.check_train_roundtrip(steps=2, out_dir=tmp_path, min_drop=0.0, config=tiny)
    assert rt["ok"], rt
    assert calls == [True]


# ---- 128 threads per block: the multi-warp reductions ------------------------------------------------------
BROKEN_COMBINE = "for (int w = 0; w < n_warps; ++w) total += scratch[w];"


def _row_kernel_rows(seed=1):
    from nanoeuler.gpu import check
    rows = []
    for name, fn in check.kernel_sections(seed):
        if name in ("rmsnorm", "cross_entropy"):  # the kernels that call block_sum / block_max
            rows += check.run_section(name, fn)
    return rows


def test_emulated_row_kernels_with_four_warps_per_block(monkeypatch):
    _install(monkeypatch, threads=128)
    from nanoeuler.gpu import ops
    assert ops.THREADS == 128
    rows = _row_kernel_rows()
    assert len(rows) == 5
    assert max(r.max_rel_error for r in rows) <= TOL, [(r.name, r.max_rel_error) for r in rows]


@pytest.mark.parametrize("threads,should_fail", [(32, False), (128, True)])
def test_multi_warp_path_is_really_exercised(monkeypatch, threads, should_fail):
    """block_sum with the cross-warp combine broken (only warp 0's partial kept): invisible with one warp
    per block, caught with four — so the 128-thread case is what tests that code."""
    _install(monkeypatch, threads=threads)
    from nanoeuler.gpu import runtime
    real = runtime.kernel_source
    assert BROKEN_COMBINE in (runtime.KERNEL_DIR / "common.cuh").read_text()
    monkeypatch.setattr(runtime, "kernel_source", lambda name: real(name).replace(BROKEN_COMBINE, "total = scratch[0];"))
    worst = max(r.max_rel_error for r in _row_kernel_rows())
    assert (worst > 1e-2) == should_fail, worst


def test_emulated_model_gradients_with_four_warps_per_block(monkeypatch):
    _install(monkeypatch, threads=128)
    from nanoeuler.config import Config
    from nanoeuler.gpu.check import check_model_gpu
    cfg = Config(vocab_size=300, dim=160, n_heads=4, n_kv_heads=2, n_layers=1, ctx_len=10, ffn_hidden=96, n_mtp=2)
    rows = check_model_gpu(seed=0, config=cfg, batch=2)  # dim 160, V 300: rows longer than one 128-thread pass
    assert max(r.max_rel_error for r in rows) <= TOL, [(r.name, r.max_rel_error) for r in rows if r.max_rel_error > TOL]
    assert np.isfinite([r.max_rel_error for r in rows]).all()


def test_emulated_model_with_llama3_scaled_rope(monkeypatch):
    """The GPU engine's RoPE tables come from Config.layer_freqs as every engine's do (cached by the frequencies,
    not by θ): a model with llama3-scaled RoPE has the reference's gradients."""
    _install(monkeypatch)
    from nanoeuler.config import Config
    from nanoeuler.gpu.check import check_model_gpu
    cfg = Config(vocab_size=48, dim=32, n_heads=4, n_kv_heads=2, n_layers=1, ctx_len=12, ffn_hidden=40, n_mtp=1,
                 rope_theta=100.0, rope_scaling="llama3", rope_factor=4.0, rope_original_ctx=64)
    rows = check_model_gpu(seed=0, config=cfg, batch=2)
    assert max(r.max_rel_error for r in rows) <= TOL, [(r.name, r.max_rel_error) for r in rows if r.max_rel_error > TOL]
