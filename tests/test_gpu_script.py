"""scripts/gpu_check.sh: `quick` fits 3 minutes, quick + full fit a 15-minute device slot with room for the
machine's start, and a rehearsal on the CPU emulator writes every step's output to its own file under $OUT."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def step_limits(function: str) -> dict[str, int]:
    """{step name: limit in seconds} of the `step NAME LIMIT ...` lines inside the shell function."""
    body = re.search(rf"^{function}\(\) \{{\n(.*?)^\}}", SCRIPT.read_text(), re.M | re.S).group(1)
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"\bstep (\S+) (\d+) ", body)}


def test_quick_fits_three_minutes_and_both_fit_the_slot():
    quick, full = step_limits("quick"), step_limits("full")
    assert list(quick) == ["env", "nvcc", "kernels", "tensor-core"]
    assert list(full) == ["env", "roundtrip", "flash", "memory", "pytest", "bench", "compile"]
    assert sum(quick.values()) <= 180
    full_total = sum(v for k, v in full.items() if k != "env")  # env runs again only in a fresh $OUT
    assert sum(quick.values()) + full_total + full["env"] <= 900 - 240  # 4 minutes left for the machine's start
    text = SCRIPT.read_text()
    assert f"step limits add up to {sum(quick.values())} s" in text
    assert f"add up to {full_total + full['env']} s" in text  # the header states the sums it really has


def test_unknown_mode_is_refused():
    proc = subprocess.run(["bash", str(SCRIPT), "fast"], capture_output=True, text=True)
    assert proc.returncode == 2 and "usage:" in proc.stderr


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not installed (the CPU emulator)")
def test_emulated_quick_run_writes_each_step_to_its_own_file(tmp_path):
    bindir = tmp_path / "bin"  # PATH without nvcc: the nvcc step is skipped (the slow part here)
    bindir.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    env.update(PATH=f"{bindir}:/usr/bin:/bin", GPU_CHECK_EMULATE="1", PYTHON=sys.executable, OUT=str(tmp_path / "out"))
    if shutil.which("nvcc", path=env["PATH"]):
        pytest.skip("nvcc lives in /usr/bin here")
    proc = subprocess.run(["bash", str(SCRIPT), "quick"], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=900)
    out = tmp_path / "out"
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    for name in ("env", "nvcc", "kernels", "tensor-core", "summary"):
        assert (out / f"{name}.log").stat().st_size > 0, name
    assert "python " in (out / "env.log").read_text() and "include candidates" in (out / "env.log").read_text()
    assert "gpu model heads.0.weight" in (out / "kernels.log").read_text()
    assert "gpu attention tensor-core" in (out / "tensor-core.log").read_text()
    rows = [line.split("\t") for line in (out / "steps.tsv").read_text().splitlines()[1:]]
    assert [r[0] for r in rows] == ["env", "nvcc", "kernels", "tensor-core"]
    assert rows[1][3] == "skipped" and all(r[3] == "0" for r in rows if r[0] != "nvcc")
    assert "=== ALL STEPS PASSED" in (out / "summary.log").read_text()
