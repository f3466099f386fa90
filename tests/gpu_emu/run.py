"""Run a nanoeuler GPU command on the CPU emulator: the fake CuPy of harness.py, then the module or script.

    python tests/gpu_emu/run.py -m nanoeuler.gpu.check --small          # like `python -m nanoeuler.gpu.check --small`
    python tests/gpu_emu/run.py bench/gpu_speed.py --preset tiny --no-torch

scripts/gpu_check.sh uses it when GPU_CHECK_EMULATE=1, to rehearse (and time) every step without a GPU.
NANOEULER_EMU_THREADS sets the row kernels' block size (default 32; 128 runs the multi-warp reductions);
NANOEULER_EMU_TINY_SMALL=1 makes the `small` preset a tiny model (for the benchmark's rehearsal).
Only for tests: nothing here is part of the library.
"""
from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))          # tests/ (for `gpu_emu`)
sys.path.insert(0, str(HERE.parent.parent))   # the repository root (for `nanoeuler`, `bench`)


def main(argv: list[str]) -> None:
    if not argv:
        raise SystemExit("usage: run.py -m MODULE [ARGS...] | run.py SCRIPT.py [ARGS...]")
    from gpu_emu import harness
    harness.install(threads=int(os.environ.get("NANOEULER_EMU_THREADS", "32")))
    if os.environ.get("NANOEULER_EMU_TINY_SMALL") == "1":
        from nanoeuler.config import PRESETS, Config
        PRESETS["small"] = Config(vocab_size=64, dim=32, n_heads=2, n_kv_heads=1, n_layers=1, ctx_len=16,
                                  ffn_hidden=32, n_mtp=2)
    if argv[0] == "-m":
        sys.argv = [argv[1]] + argv[2:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
