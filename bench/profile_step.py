"""Where the time of one training step goes: per kernel / matmul shape for the fast engine, per op for
the reference path. The fast engine runs one sub-batch per core at once, so each call is timed in CPU
seconds of its own thread (time.thread_time) and the rows sum over the threads; the step's wall and total
CPU time are given too. Timers wrap the engine's calls, so the total is a little above an untimed step.

    python bench/profile_step.py big                 # fast engine, B=16 T=256
    python bench/profile_step.py big --reference     # the plain ops/ + model.forward/backward path
    python bench/profile_step.py gpt --precision bf16  # B=2 T=512; bf16 products: packing and tiles apart
"""
from __future__ import annotations

import argparse
import collections
import cProfile
import pstats
import sys
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from nanoeuler.config import PRESETS  # noqa: E402
from nanoeuler.model import Model  # noqa: E402
from nanoeuler.optim import AdamW  # noqa: E402

SHAPES = {"small": (32, 128), "big": (16, 256), "gpt": (2, 512), "gpt2": (4, 256)}


def timed(fn, name, stats):
    def wrapper(*args, **kwargs):
        c = time.thread_time()
        out = fn(*args, **kwargs)
        key = name(args) if callable(name) else name
        s = stats[key]  # (+= of floats from two threads: a rare lost update only blurs a profile)
        s[0] += time.thread_time() - c
        s[1] += 1
        return out
    return wrapper


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("preset", choices=list(SHAPES))
    ap.add_argument("--reference", action="store_true", help="profile the reference path instead")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--precision", choices=("f32", "bf16"), default="f32", help="the fast engine's products")
    args = ap.parse_args(argv)
    cfg = PRESETS[args.preset]
    B, T = SHAPES[args.preset]
    model = Model.from_preset(args.preset, seed=0).set_precision(args.precision)
    opt = AdamW(model.params)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (B, T + cfg.n_mtp))
    stats = collections.defaultdict(lambda: [0.0, 0])
    if not args.reference:
        from numba.core.registry import CPUDispatcher

        from nanoeuler.fast import engine as E
        E.matmul = timed(E.matmul, lambda a: f"matmul {list(a[0].shape)} @ {list(a[1].shape)}", stats)
        # the engine sees a namespace of timed kernels; the kernels module itself stays as it is (numba code
        # that calls a kernel, compiled on first use, must find the kernel, not a Python wrapper)
        E.kernels = types.SimpleNamespace(**{
            name: timed(fn, name, stats) if isinstance(fn, CPUDispatcher) and not name.startswith(("_", "row_", "adamw"))
            else fn for name, fn in vars(E.kernels).items()})
        if args.precision == "bf16":  # the bf16 products' packing and tile loops, each apart
            from nanoeuler.fast import bf16
            for name in ("_pack_rows", "_pack_pairs", "_pack_columns", "_pack_b"):
                label = (lambda a, n=name: f"bf16 {n[1:]} {list(a[0].shape)}")
                setattr(bf16, name, timed(getattr(bf16, name), label, stats))
            bf16._gemm = timed(bf16._gemm, lambda a: f"bf16 gemm {list(a[4].shape)}", stats)
        grads = model.grad_buffers()
    opt.step = timed(opt.step, "AdamW.step", stats)

    def step():
        if args.reference:
            _, _, g = model.loss_and_grads(tokens, reference=True)
        else:
            _, _, g = model.loss_and_grads(tokens, out=grads)
        opt.step(model.params, g)

    step()  # warm-up (numba cache load, buffers)
    stats.clear()
    prof = cProfile.Profile() if args.reference else None
    w, c = time.perf_counter(), time.process_time()
    for _ in range(args.steps):
        if prof:
            prof.enable()
        step()
        if prof:
            prof.disable()
    wall, cpu = (time.perf_counter() - w) / args.steps, (time.process_time() - c) / args.steps
    print(f"{args.preset} B={B} T={T} {'reference' if args.reference else 'fast'}: step {wall:.3f} s wall, "
          f"{cpu:.3f} s CPU, {B * T / wall:.0f} tokens/s")
    if prof:
        st = pstats.Stats(prof)
        rows = [(tt / args.steps, nc // args.steps, f"{Path(fn).name}:{ln}({func})")
                for (fn, ln, func), (cc, nc, tt, ct, _) in st.stats.items()]
        for tt, nc, name in sorted(rows, reverse=True)[:15]:
            print(f"{tt * 1e3:9.1f} ms self  x{nc:4d}  {name}")
        return 0
    groups = collections.defaultdict(float)
    for key, (kc, n) in sorted(stats.items(), key=lambda kv: -kv[1][0]):
        print(f"{kc / args.steps * 1e3:9.1f} ms CPU  x{n // args.steps:3d}  {key}")
        groups["matmuls" if key.startswith(("matmul", "bf16 gemm")) else "bf16 packing" if key.startswith("bf16")
               else "AdamW" if key.startswith("AdamW") else "fused kernels"] += kc / args.steps
    for g, kc in groups.items():
        print(f"  {g:14s} {kc * 1e3:9.1f} ms CPU ({kc / cpu:5.1%})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
