"""Shared test helpers: one tiny-config factory and one relative error, so tests stop copying them.

    cfg = tiny_config(n_layers=1)                    # a valid Config small enough for float64 FD checks
    assert rel_err(ours, reference) < 1e-6           # the worst entry's |a - b| / |b|

Both are also fixtures (`tiny_config`, `rel_err`) for tests that prefer injection; importing them
directly (`from conftest import tiny_config, rel_err`) works too, since pytest puts tests/ on sys.path.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

from nanoeuler.config import Config

TINY_DEFAULTS = dict(vocab_size=40, dim=16, n_heads=4, n_kv_heads=2, n_layers=1, ctx_len=8, ffn_hidden=24, n_mtp=2)


def tiny_config(**changes) -> Config:
    """A valid tiny Config (GQA, MTP): vocab 40, dim 16, 4 heads / 2 kv heads, 1 layer, ctx 8, ffn 24, K 2;
    any field can be changed: tiny_config(vocab_size=257, n_layers=2)."""
    return Config(**(TINY_DEFAULTS | changes))


def rel_err(a, b, floor: float | None = None) -> float:
    """The largest relative error of any entry, in float64 (llm.c's one check_tensor):
    max over entries of |a − b| / max(|a|, |b|, floor · max |b|).

    Each entry is compared with itself, so a wrong small entry is not hidden by a large one elsewhere.
    Entries below the floor (a share of the tensor's largest entry) are compared with the floor instead:
    near zero even a correct result differs by a rounding of the larger terms it was summed from. Default
    floor: 1e-2 when either side is float32 or coarser (its rounding, ~1e-7 of the terms, reads as 1e-5 at
    an entry 1e-2 of the largest), 1e-4 when both are float64 (~1e-16 of the terms reads as 1e-12 there).
    rel_err([1.0, 2.0], [1.0, 2.002]) -> 0.000999...; rel_err([1.0, 0.1], [1.0, -0.1]) -> 2.0
    (divided by the largest entry instead: 0.2)."""
    a, b = np.asarray(a), np.asarray(b)
    if floor is None:
        floor = 1e-4 if a.dtype == np.float64 and b.dtype == np.float64 else 1e-2
    a, b = a.astype(np.float64), b.astype(np.float64)
    if a.size == 0:
        return 0.0
    scale = max(floor * float(np.max(np.abs(b))), 1e-300)
    return float(np.max(np.abs(a - b) / np.maximum(np.maximum(np.abs(a), np.abs(b)), scale)))


def snapshot(root) -> dict:
    """Every path under root (links not followed) -> (kind, mode, bytes or link target, mtime): equal before
    and after a command iff it changed nothing there."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            if os.path.islink(p):
                out[p] = ("link", st.st_mode, os.readlink(p), st.st_mtime_ns)
            elif os.path.isdir(p):
                out[p] = ("dir", st.st_mode, None, st.st_mtime_ns)
            else:
                out[p] = ("file", st.st_mode, open(p, "rb").read(), st.st_mtime_ns)
    return out


@pytest.fixture(name="tiny_config")
def _tiny_config_fixture():
    return tiny_config


@pytest.fixture(name="rel_err")
def _rel_err_fixture():
    return rel_err


@pytest.fixture(autouse=True)
def _kernels_count_as_compiled(monkeypatch):
    """numba_cache.note_first_compile's line is for a user's first run. On a cold cache (a fresh clone) it would
    be said in whichever test builds a decoding layout first in its process, among that test's stderr; so tests
    see every kernel as compiled before (a test of the line itself calls monkeypatch.undo() first)."""
    from nanoeuler import numba_cache
    monkeypatch.setattr(numba_cache, "compiled_before", lambda dispatcher: True)


# ---- what `make test` did not check, and how to check it ----------------------------------------------------
# test file -> (what it checks, what it needs: the command that enables it). `make test` installs every other
# dependency (pyproject's `test` extra); these need root, a compiler run of minutes, or a GPU.
OPTIONAL_CHECKS = {
    "test_web.py": ("the web chat page in a real browser",
                    "Debian's chromium: sudo apt-get install chromium (.ci/run installs it)"),
    "test_interop_llama_cpp.py": ("exported GGUF files give our tokens and logits in llama.cpp",
                                  "llama-cpp-python, which compiles llama.cpp (minutes): .venv/bin/pip install "
                                  "'nanoeuler[llama]'"),
    "test_gpu.py": ("the CUDA kernels and the GPU engine on a device",
                    "an NVIDIA GPU and CuPy: .venv/bin/pip install 'nanoeuler[gpu-cuda13]' (or [gpu-cuda12])"),
}


def skipped_by_file(reports) -> dict:
    """Skip reports -> {test file name: (count, first reason)}."""
    out = {}
    for r in reports:
        path = str(r.location[0] if getattr(r, "location", None) else r.nodeid.split("::")[0])
        name = os.path.basename(path)
        reason = r.longrepr[2] if isinstance(r.longrepr, tuple) else str(r.longrepr)
        count, first = out.get(name, (0, reason.removeprefix("Skipped: ")))
        out[name] = (count + 1, first)
    return out


def pytest_terminal_summary(terminalreporter):
    """After the run: each file with skipped tests, what it would have checked and what enables it."""
    skipped = skipped_by_file(terminalreporter.stats.get("skipped", []))
    if not skipped:
        return
    terminalreporter.section("optional checks that did not run")
    for name, (count, reason) in sorted(skipped.items()):
        what, needs = OPTIONAL_CHECKS.get(name, (None, None))
        terminalreporter.write_line(f"{name} ({count} skipped): {reason}")
        if what:
            terminalreporter.write_line(f"    checks {what}; needs {needs}")
