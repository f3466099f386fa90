"""`nanoeuler bench`: this machine's training throughput for a preset (tokens/s, MFU, memory).

The side-by-side comparisons with PyTorch live in bench/ (torch is never imported by the library);
this command measures our engine alone, so a user can size a run before starting it.
"""
from __future__ import annotations

import json


def register(sub) -> None:
    p = sub.add_parser("bench", help="measure training steps/s, tokens/s and MFU of a preset on this machine",
                       description="Time full training steps (forward, backward, AdamW) of a preset on random tokens: "
                                   "median step time after warm-up, tokens/s, MFU (6·N·tokens/s over the matmul "
                                   "peak of the run's precision, float32 or bf16, measured in the same run) and "
                                   "peak resident memory.")
    p.add_argument("preset", nargs="?", default="small", help="preset or config.json (default small)")
    from .args import nonneg_int, positive_int
    p.add_argument("--batch-size", type=positive_int, default=None, help="default: 32 for small, 16 otherwise")
    p.add_argument("--ctx", type=positive_int, default=None, help="context length (default: the config's)")
    p.add_argument("--steps", type=positive_int, default=10, help="timed steps (default 10)")
    p.add_argument("--warmup", type=nonneg_int, default=2, help="untimed warm-up steps (default 2; 0 = none)")
    from ..config import PRECISIONS
    p.add_argument("--precision", choices=PRECISIONS, default="f32",
                   help="f32 (default), or bf16 matrix products with float32 accumulation (needs AVX512_BF16)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)


def run(args) -> int:
    import resource
    import statistics
    import time

    import numpy as np

    from ..errors import UserError
    from ..model import Model
    from ..optim import AdamW
    from ..perf import matmul_peak_flops
    from .info import resolve_config
    cfg = resolve_config(args.preset)
    B = args.batch_size if args.batch_size is not None else (32 if cfg.n_params() < 2_000_000 else 16)
    T = args.ctx if args.ctx is not None else cfg.ctx_len
    if B < 1 or not 1 <= T <= cfg.ctx_len or args.steps < 1 or args.warmup < 0:
        raise UserError(f"need --batch-size >= 1, --ctx in [1, {cfg.ctx_len}], --steps >= 1, --warmup >= 0")
    from ..memory import check_fits
    check_fits(cfg, B, T)            # before allocating: --batch-size 100000 is refused here, in one line
    model = Model.init(cfg, seed=0).set_precision(args.precision)   # bf16 on a CPU without it: refused here
    opt = AdamW(model.params, lr=1e-4)
    rng = np.random.default_rng(0)
    times = []
    for i in range(args.warmup + args.steps):
        tokens = rng.integers(0, cfg.vocab_size, (B, T + cfg.n_mtp))
        t0 = time.perf_counter()
        _, _, grads = model.loss_and_grads(tokens)
        opt.step(model.params, grads)
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    tok_s = B * T / step_s
    if args.precision == "bf16":
        from ..fast.bf16 import peak_flops
        peak = peak_flops()
    else:
        peak = matmul_peak_flops()
    result = {"preset": args.preset, "precision": args.precision, "n_params": cfg.n_params(), "batch_size": B,
              "ctx": T, "step_s": step_s,
              "tokens_per_s": tok_s, "matmul_peak_gflops": peak / 1e9, "mfu": 6 * cfg.n_params() * tok_s / peak,
              "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{args.preset}: {cfg.n_params():,} params, batch {B} x ctx {T}, precision {args.precision}")
        print(f"  step {step_s * 1e3:.1f} ms (median of {args.steps}), {tok_s:,.0f} tokens/s")
        kind = "bf16 (float32-accumulating)" if args.precision == "bf16" else "float32"
        print(f"  MFU {result['mfu']:.2f} of a measured {peak / 1e9:.0f} GFLOP/s {kind} matmul peak")
        print(f"  peak resident memory {result['peak_rss_mib']:.0f} MiB")
    return 0
