"""`nanoeuler bench`: this machine's training throughput for a preset (tokens/s, MFU, memory), or with
`--decode` a checkpoint's decoding speed in llama-bench's two figures (pp256, tg64).

The side-by-side comparisons with PyTorch and llama.cpp live in bench/ (torch is never imported by the
library); this command measures our engine alone, so a user can size a run before starting it, or set
`nanoeuler bench --decode --ckpt m.gguf` beside `llama-bench -m m.gguf` on their own machine.

    nanoeuler bench big --precision bf16
    nanoeuler bench --decode --ckpt runs/demo --dtype float16 --threads 2
"""
from __future__ import annotations

import json
import math


def register(sub) -> None:
    p = sub.add_parser("bench", help="measure training steps/s, tokens/s and MFU of a preset on this machine",
                       description="Time full training steps (forward, backward, AdamW) of a preset on random tokens: "
                                   "median step time after warm-up, tokens/s, MFU (6·N·tokens/s over the matmul "
                                   "peak of the run's precision, float32 or bf16, measured in the same run) and "
                                   "peak resident memory.")
    p.add_argument("preset", nargs="?", default=None, help="preset or config.json (default small)")
    from .args import nonneg_int, positive_int
    from ..infer.quant import decodable
    from .sample import add_threads_arg
    p.add_argument("--batch-size", type=positive_int, default=None, help="default: 32 for small, 16 otherwise")
    p.add_argument("--ctx", type=positive_int, default=None, help="context length (default: the config's)")
    p.add_argument("--steps", type=positive_int, default=None, help="timed steps (default 10)")
    p.add_argument("--warmup", type=nonneg_int, default=2,
                   help="untimed warm-up steps, or with --decode runs of each test (default 2; 0 = none)")
    from ..config import PRECISIONS
    p.add_argument("--precision", choices=PRECISIONS, default=None,
                   help="f32 (default), or bf16 matrix products with float32 accumulation (needs AVX512_BF16)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    d = p.add_argument_group("decoding (--decode)", "llama-bench's figures for our engine: ppN, a prompt of N random "
                             "tokens in one call (prompt tokens/s), and tgN, N greedy tokens one forward each from "
                             "one token (generated tokens/s, plain decoding); median of --repeat runs after "
                             "--warmup, pp and tg interleaved")
    d.add_argument("--decode", action="store_true", help="measure decoding instead of training (needs --ckpt)")
    d.add_argument("--ckpt", default=None, help="checkpoint directory or .gguf file to decode")
    d.add_argument("--dtype", choices=decodable(), default=None,
                   help="the weights while decoding (default: as `sample` decodes the checkpoint: float32, an "
                        "imported or .gguf model in its file's type)")
    add_threads_arg(d)
    d.add_argument("--repeat", type=positive_int, default=None, help="timed runs of each test (default 5)")
    d.add_argument("--n-prompt", type=positive_int, default=None, help="prompt tokens of the pp test, at most the context (default 256, or the context if shorter)")
    d.add_argument("--n-gen", type=positive_int, default=None, help="generated tokens of the tg test, at most the context - 1 (default 64, or that if shorter)")
    p.set_defaults(run=run)


def run(args) -> int:
    from ..errors import UserError
    own = {True: ("ckpt", "dtype", "threads", "repeat", "n_prompt", "n_gen"),
           False: ("preset", "batch_size", "ctx", "steps", "precision")}  # flags of --decode / of training
    wrong = [k for k in own[not args.decode] if getattr(args, k) is not None]
    if wrong:
        flag = "a preset" if wrong[0] == "preset" else "--" + wrong[0].replace("_", "-")
        raise UserError(f"{flag} is not for {'--decode' if args.decode else 'training (add --decode)'}")
    if not args.decode:
        return run_training(args)
    if args.ckpt is None:
        raise UserError("bench --decode measures a checkpoint: give --ckpt RUN|FILE.gguf")
    return run_decode(args)


def run_training(args) -> int:
    import resource
    import statistics
    import time

    import numpy as np

    from ..errors import UserError
    from ..model import Model
    from ..optim import AdamW
    from ..perf import matmul_peak_flops
    from .info import resolve_config
    args.preset, args.steps, args.precision = args.preset or "small", args.steps or 10, args.precision or "f32"
    cfg = resolve_config(args.preset)
    B = args.batch_size if args.batch_size is not None else (32 if cfg.n_params() < 2_000_000 else 16)
    T = args.ctx if args.ctx is not None else cfg.ctx_len
    if B < 1 or not 1 <= T <= cfg.ctx_len or args.steps < 1 or args.warmup < 0:
        raise UserError(f"need --batch-size >= 1, --ctx in [1, {cfg.ctx_len}], --steps >= 1, --warmup >= 0")
    from ..training.memory import check_fits
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


def load_decoding(args):
    """(the model decoding runs, its name) of args.ckpt, a checkpoint directory or a .gguf file, as `sample`
    decodes it (sample.load_for_decoding)."""
    from pathlib import Path

    from collections import Counter

    from ..infer.weights import of_dtype
    from .sample import load_for_decoding
    model = load_for_decoding(args)[0]
    if args.dtype is None:  # what it decodes in: the matrices' types, most common first ("q5_0+q8_0+q4_k+...")
        kinds = Counter(of_dtype(p.dtype).name if of_dtype(p.dtype) else str(p.dtype)
                        for p in model.params.values() if p.ndim == 2)
        args.dtype = "+".join(k for k, _ in kinds.most_common())
    return model, Path(args.ckpt).name


def decoded_weights(model) -> tuple[int, int]:
    """(parameters, bytes) decoding reads, in the model's decoding form (float16, blocks of 32 ...): every
    matrix but the MTP heads 1..K-1 (llama-bench's size and params count the file's tensors: head 0 only)."""
    shapes = model.config.param_shapes()
    used = [n for n in model.params if not (n.startswith("heads.") and n != "heads.0.weight")]
    return sum(math.prod(shapes[n]) for n in used), sum(model.params[n].nbytes for n in used)


def decode_rate(model, fused, ids: list[int], n_gen: int, depth: int = 1) -> float:
    """Tokens/s of one run, fused = fuse_weights(model.config, model.params). n_gen = 0: the prompt `ids` in
    one call (llama-bench's pp); else n_gen greedy tokens after the prompt ids[:depth] (untimed), one forward
    each (tg at depth `depth`); needs depth + n_gen <= ctx_len."""
    from ..infer.session import generate
    if n_gen == 0:
        return len(ids) / generate(model, ids, max_new_tokens=0, temperature=0, fused=fused).prefill_s
    # n_gen + 1 tokens: the first is the prompt's, then n_gen forwards (each followed by its head)
    return n_gen / generate(model, ids[:depth], max_new_tokens=n_gen + 1, temperature=0, mode="cache",
                            fused=fused).decode_s


def run_decode(args) -> int:
    import os

    import numpy as np

    from ..errors import UserError
    from ..infer import pool
    from ..infer.step import fuse_weights
    args.repeat = args.repeat or 5
    model, name = load_decoding(args)
    cfg = model.config
    if cfg.ctx_len < 2:
        raise UserError(f"the model's context ({cfg.ctx_len}) has no room for a tg test")
    for flag, asked, room in (("--n-prompt", args.n_prompt, cfg.ctx_len), ("--n-gen", args.n_gen, cfg.ctx_len - 1)):
        if asked is not None and asked > room:  # a default shrinks to the context; a number asked for is kept
            raise UserError(f"{flag} {asked} does not fit the model's context of {cfg.ctx_len} tokens (at most {room})")
    n_prompt, n_gen = args.n_prompt or min(256, cfg.ctx_len), args.n_gen or min(64, cfg.ctx_len - 1)
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, n_prompt).tolist()  # as llama-bench: random tokens
    fused = fuse_weights(cfg, model.params)
    tests = {f"pp{n_prompt}": 0, f"tg{n_gen}": n_gen}
    samples: dict[str, list[float]] = {t: [] for t in tests}
    for i in range(args.warmup + args.repeat):  # interleaved: the machine's load falls on both alike
        for test, n in tests.items():
            rate = decode_rate(model, fused, ids, n)
            if i >= args.warmup:
                samples[test].append(rate)
    params, size = decoded_weights(model)
    result = {"model": name, "arch": cfg.arch, "size_bytes": size, "n_params": params, "dtype": args.dtype,
              "threads": pool.get_threads(), "load_average": os.getloadavg()[0], "tests": [
                  {"test": t, "n_prompt": 0 if n else n_prompt, "n_gen": n, "tokens_per_s": float(np.median(s)),
                   "min": min(s), "max": max(s), "samples": s} for (t, n), s in zip(tests.items(), samples.values())]}
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"| {'model':>20} | {'size':>10} | {'params':>8} | {'dtype':>8} | {'threads':>7} | {'test':>6} | "
          f"{'t/s (median, min-max)':>30} |")
    print(f"| {'-' * 19}: | {'-' * 9}: | {'-' * 7}: | {'-' * 7}: | {'-' * 6}: | {'-' * 5}: | {'-' * 29}: |")
    for r in result["tests"]:
        spread = f"{r['tokens_per_s']:.2f} ({r['min']:.2f}-{r['max']:.2f})"
        print(f"| {name[:20]:>20} | {size / 2**20:>6.2f} MiB | {params / 1e6:>6.2f} M | {args.dtype:>8} | "
              f"{result['threads']:>7} | {r['test']:>6} | {spread:>30} |")
    print(f"median of {args.repeat} after {args.warmup} warm-up; load average {result['load_average']:.2f}")
    return 0
