"""Fine-tuning the published models (`make models`: SmolLM2-135M-Instruct, Gemma 3 270M) as our own models are
fine-tuned: each imported, a LoRA SFT (SmolLM2 in its own ChatML, the Gemma 3 base in Gemma's turns) stopped
and resumed equals the run that never stopped, bit for bit (in float32 and, on a CPU with AVX512_BF16, in
bf16), and two MPI ranks equal one process to float32 rounding (short runs: rows of 64 tokens, 4 steps; the
quality of long runs: docs/benchmarks.md)."""
import json
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import load_file

from conftest import rel_err
from nanoeuler.fast import bf16
from real_models import real_model

TEMPLATE = {"smollm2": [], "gemma3": ["--chat-template", "gemma"]}
SFT = ["sft", "--base", "base", "--data", "sft.json", "--val", "val.json", "--lora", "8", "--seq-len", "64",
       "--batch-size", "2", "--steps", "4", "--warmup", "1", "--lr", "1e-3", "--eval-every", "100",
       "--ckpt-every", "1", "--no-progress", "--json"]
# the ranks' sums grouped differently: after the first step the adapters are equal bit for bit; after four, AdamW's
# per-entry normalisation has turned rounding-sized differences of near-cancelled gradient entries into ones of
# up to 8e-5 of the tensor's largest entry (median 6e-6; 1.3e-3 of an entry at 1 % of it: SmolLM2, AVX-512), so
# measured against each tensor's largest entry (conftest.rel_err's floor 1.0), where a lost rank's gradient is ~1
ROUNDING = 1e-3


def cli(args: list[str], cwd) -> dict:
    """`nanoeuler ARGS` in cwd; its --json summary."""
    p = subprocess.run([sys.executable, "-m", "nanoeuler", *args], cwd=cwd, capture_output=True, text=True,
                       timeout=900)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1]) if "--json" in args else {}


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def imported(request, tmp_path_factory):
    """(name, a directory holding `base`: the file imported as a checkpoint, and a few of the offline
    instructions to train on and to validate on)."""
    from nanoeuler.training.sft import offline_instructions
    path = real_model(request.param)
    d = tmp_path_factory.mktemp(request.param)
    train, held = offline_instructions(n_train=40, n_heldout=4)
    (d / "sft.json").write_text(json.dumps(train))
    (d / "val.json").write_text(json.dumps(held))
    cli(["import", "--from", str(path), "--out", "base", "--no-progress"], d)
    return request.param, d


def tensors(run, name: str) -> dict:
    return load_file(str(run / name))


@pytest.mark.parametrize("precision", ["f32", pytest.param("bf16", marks=pytest.mark.skipif(
    not bf16.AVAILABLE, reason="this CPU has no AVX512_BF16"))])
def test_a_lora_sft_stopped_and_resumed_is_the_run_that_never_stopped(imported, precision):
    name, d = imported
    args = SFT + TEMPLATE[name] + ["--precision", precision]
    whole, halves = f"whole-{precision}", f"halves-{precision}"
    summary = cli(args + ["--out", whole], d)
    cli(args + ["--out", halves, "--stop-after", "2"], d)
    cli(args + ["--out", halves, "--resume"], d)
    assert summary["finished"] and np.isfinite(summary["val_loss"])
    for f in ("adapter.safetensors", "optimizer.safetensors"):
        a, b = tensors(d / whole, f), tensors(d / halves, f)
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a), f
    B = [v for k, v in tensors(d / whole, "adapter.safetensors").items() if k.endswith(".lora_B")]
    assert B and all(np.abs(b).max() > 0 for b in B)   # (B starts at zero: every adapter was trained)


def test_two_ranks_equal_one_process(imported):
    pytest.importorskip("mpi4py")
    from nanoeuler.training.dist import mpiexec_path
    if mpiexec_path() is None:
        pytest.skip("no mpiexec (pip install 'nanoeuler[dist]')")
    name, d = imported
    args = SFT + TEMPLATE[name]
    if not (d / "whole-f32").exists():
        cli(args + ["--out", "whole-f32"], d)
    cli(args + ["--out", "ranks", "--nproc", "2"], d)
    one, two = tensors(d / "whole-f32", "adapter.safetensors"), tensors(d / "ranks", "adapter.safetensors")
    assert one.keys() == two.keys()
    assert max(rel_err(two[k], one[k], floor=1.0) for k in one) < ROUNDING
