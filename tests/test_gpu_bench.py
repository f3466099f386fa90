"""bench/gpu_speed.py on the CPU emulator: our engine is named by the attention kernel that really ran,
so a run whose tensor-core kernels did not compile is never reported under the tensor-core name."""
from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not installed (the CPU emulator)")


def _bench(monkeypatch):
    from gpu_emu import harness
    from nanoeuler import config
    from nanoeuler.config import Config
    harness.install(monkeypatch)
    tiny = Config(vocab_size=32, dim=32, n_heads=2, n_kv_heads=1, n_layers=1, ctx_len=8, ffn_hidden=32, n_mtp=2)
    monkeypatch.setitem(config.PRESETS, "small", tiny)  # hd = 16: the tensor-core kernels support it
    spec = importlib.util.spec_from_file_location("gpu_speed", ROOT / "bench" / "gpu_speed.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


ARGS = ["--preset", "small", "--batch", "1", "--steps", "1", "--warmup", "1", "--json"]


def test_bench_names_tensor_core_run_when_the_kernels_compile(monkeypatch, capfd):
    bench = _bench(monkeypatch)
    assert bench.main(ARGS + ["--contenders", "ours,cuda-core"]) == 0
    res = json.loads(capfd.readouterr().out)["results"]
    assert set(res) == {"nanoeuler, tensor-core attention", "nanoeuler, CUDA-core attention"}
    assert res["nanoeuler, tensor-core attention"]["attention_kernel"] == "wmma"
    assert res["nanoeuler, CUDA-core attention"]["attention_kernel"] == "bf16"


def test_bench_labels_the_fallback_honestly(monkeypatch, capfd):
    bench = _bench(monkeypatch)
    from nanoeuler.gpu import runtime
    monkeypatch.setattr(runtime, "cuda_include_dir", lambda: None)
    monkeypatch.setattr(runtime, "find_cuda_include", lambda: (None, "no include folder has crt/mma.h (test)"))
    assert bench.main(ARGS + ["--contenders", "ours,cuda-core"]) == 0
    out, err = capfd.readouterr()
    res = json.loads(out)["results"]
    assert set(res) == {"nanoeuler, CUDA-core attention (tensor-core kernels unavailable)"}  # timed once
    r = res["nanoeuler, CUDA-core attention (tensor-core kernels unavailable)"]
    assert r["attention_kernel"] == "bf16" and "crt/mma.h" in r["tensor_cores_unavailable"]
    assert "note: tensor-core kernels unavailable (UserError: no include folder has crt/mma.h (test))" in err


def test_bench_rejects_unknown_contender(monkeypatch, capfd):
    bench = _bench(monkeypatch)
    assert bench.main(ARGS + ["--contenders", "ours,jax"]) == 2
    assert capfd.readouterr().err.strip() == "error: unknown contender 'jax'; choose from ours, eager, cuda-core, compile"
