"""`nanoeuler check`: the float64 finite-difference gradient check of every op and every parameter."""
from __future__ import annotations

import dataclasses
import json


def register(sub) -> None:
    p = sub.add_parser("check", help="float64 finite-difference check of every gradient",
                       description="Compare every analytic gradient with fourth-order central finite differences "
                                   "in float64: (a) each op on random inputs, (b) every parameter tensor of a small "
                                   "model with MTP and GQA, without and with dropout, (b') the same for arch gpt2, (c) the DPO loss and response log-probabilities down to every parameter, (d) every LoRA adapter tensor of both architectures, without and with adapter dropout, (e) on a CPU with AVX512_BF16: the backward of the bf16 products (--precision bf16) against their float64 twin with the same operand rounding. Prints the max relative error per tensor "
                                   "(|a-n| / max(|a|, |n|, 1e-6)) and fails if any exceeds 1e-6. A tensor of at most --samples + 8 "
                                   "entries is checked whole; a larger one at --samples random entries plus its 4 "
                                   "largest and 4 most negative gradient entries.")
    p.add_argument("--device", choices=["cpu", "gpu"], default="cpu", help="where to run the model (default cpu)")
    p.add_argument("--samples", type=int, default=48, help="random entries checked per larger parameter tensor, besides its 8 extreme ones (default 48)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.set_defaults(run=run)


def bf16_rows(seed: int) -> list:
    """(d) where the CPU runs the bf16 kernels; elsewhere none (a note on stderr says so)."""
    import sys

    from ..training.check import check_bf16
    from ..fast import bf16
    if not bf16.AVAILABLE:
        print("note: no AVX512_BF16 on this CPU: the bf16 product rows are left out", file=sys.stderr)
        return []
    return check_bf16(seed=seed)


def run(args) -> int:
    from ..training.check import ARCH_CHECK_CONFIGS, GPT2_CHECK_CONFIG, TOLERANCE, check_model, check_ops
    from ..errors import UserError
    tolerance = TOLERANCE
    if args.device == "gpu":
        from ..gpu import check_gpu  # raises UserError when CuPy or a GPU is missing
        from ..gpu.check import TOLERANCE as tolerance  # float32 GPU vs float64 CPU: 1e-5 of each tensor's scale
        rows = check_gpu(seed=args.seed)
    else:
        if args.samples < 1:
            raise UserError("--samples must be at least 1")
        from ..training.check import check_dpo, check_lora
        rows = (check_ops(seed=args.seed) + check_model(seed=args.seed, n_samples=args.samples)
                + check_model(seed=args.seed, n_samples=args.samples, dropout=0.25)
                + [dataclasses.replace(r, name=f"{arch}: " + r.name)
                   for arch, config in ARCH_CHECK_CONFIGS.items() if arch != "euler"
                   for r in check_model(seed=args.seed, n_samples=args.samples, config=config)]
                + check_dpo(seed=args.seed, n_samples=args.samples)
                + check_lora(seed=args.seed, n_samples=args.samples)
                + check_lora(seed=args.seed, n_samples=args.samples, config=GPT2_CHECK_CONFIG)
                + check_lora(seed=args.seed, n_samples=args.samples, dropout=0.25)
                + check_lora(seed=args.seed, n_samples=args.samples, modules_to_save=("lm_head", "mtp_heads", "norm"))
                + bf16_rows(args.seed))
    worst = max(r.max_rel_error for r in rows)
    ok = worst < tolerance
    if args.json:
        print(json.dumps({"rows": [{"tensor": r.name, "max_rel_error": r.max_rel_error, "checked": r.n_checked}
                                   for r in rows], "max_rel_error": worst, "tolerance": tolerance, "ok": ok}))
    else:
        width = max(len(r.name) for r in rows)
        print(f"{'tensor':<{width}}  {'entries':>7}  max rel error")
        for r in rows:
            flag = "" if r.max_rel_error < tolerance else "  FAIL"
            print(f"{r.name:<{width}}  {r.n_checked:>7}  {r.max_rel_error:.2e}{flag}")
        print(f"max relative error: {worst:.2e}")
    return 0 if ok else 1
