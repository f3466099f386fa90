"""`nanoeuler demo` (what `make demo` runs): train `small` on the bundled Shakespeare for about five
minutes of a 2-core machine, report validation bits per byte, and sample from the model.

Re-running it continues an unfinished demo run (--resume) or, when it is finished, only evaluates and
samples again; nothing is deleted.
"""
from __future__ import annotations

import sys
from pathlib import Path

DEMO_PROMPTS = ["ROMEO.\n", "KING.\nMy lords,", "To be, or not"]


def register(sub) -> None:
    p = sub.add_parser("demo", help="train `small` on the bundled corpus for ~5 minutes, then sample",
                       description="The quick start: tokenizer + shards of the bundled Shakespeare (data/shakespeare), "
                                   "pretraining of the `small` preset into runs/demo, validation bits per byte on the "
                                   "held-out plays, and a few samples. Ctrl-C stops with a checkpoint; running it "
                                   "again continues.")
    from .args import nonneg_int, output_dir, positive_int
    p.add_argument("--out", type=output_dir, default="runs/demo", help="run directory (default runs/demo)")
    p.add_argument("--steps", type=positive_int, default=DEMO_STEPS, help=f"training steps (default {DEMO_STEPS})")
    p.add_argument("--seed", type=nonneg_int, default=1, help="sampling seed (default 1)")
    from .train import add_precision_argument
    add_precision_argument(p)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(run=run)


# About 5 minutes of training on a 2-core machine (1500 steps: 2.013 val bits/byte in 5.5 min). lr 5e-3 beat
# 3e-3 (2.042 vs 2.054 after 1200 steps) and batch 16 x 2400 steps (2.125 vs 2.083 at 1000 B=32-equivalent steps).
DEMO_STEPS = 1500
DEMO_SETTINGS = dict(batch_size=32, lr=5e-3, warmup=60, eval_every=200, eval_batches=16, ckpt_every=200)


def run(args) -> int:
    from ..checkpoint import load_tokenizer
    from ..config import PRESETS
    from ..errors import UserError
    from ..infer.session import generate
    from ..model import Model
    from ..tokenizer import Tokenizer
    from ..training.train import PretrainSource, TrainConfig, evaluate, run_training
    from .sample import StdoutStream
    from ..fileio import check_apart, check_real_dir
    from .train import BUNDLED_DATA, ensure_bundled_data, resolve_precision

    out = check_real_dir(args.out)
    check_apart(out, [BUNDLED_DATA])
    steps = args.steps
    if type(steps) is not int or steps < 1:    # argparse refuses 0 already; this guards direct callers
        raise UserError("--steps must be an integer >= 1")
    cfg = PRESETS["small"]
    if args.precision:   # refused (no AVX512_BF16) before the bundled data is prepared
        from ..fast.engine import check_precision
        check_precision(args.precision, "float32")
    data = ensure_bundled_data(cfg.vocab_size, progress=not args.no_progress)
    tcfg = TrainConfig(steps=steps, **DEMO_SETTINGS)
    source = PretrainSource(data, tcfg.batch_size, cfg.ctx_len, cfg.n_mtp)
    trainer_json = out / "trainer.json"
    resume = trainer_json.exists()
    if resume:
        from ..checkpoint import check_trainer_state, read_json
        state = check_trainer_state(read_json(trainer_json, "resume state"), trainer_json)
        done = state["step"] >= steps
        model, tok = Model.load(out), load_tokenizer(out)
    else:
        state, done = None, False
        model, tok = Model.init(cfg, seed=0), Tokenizer.load(data / "tokenizer.json")
    model.set_precision(resolve_precision(args, state))
    if not done:
        print(f"training `small` ({cfg.n_params():,} parameters) for {steps} steps of {tcfg.batch_size} x "
              f"{cfg.ctx_len} tokens -> {out}" + (" (resuming)" if resume else ""))
        summary = run_training(model, tok, source, out, tcfg, resume=resume, progress=not args.no_progress)
        if summary["interrupted"]:
            print(f"stopped at step {summary['step']}; run `make demo` again to continue")
            return 130
        print(f"trained in {summary['wall_s'] / 60:.1f} min")
        result = summary  # the last step evaluated on the whole validation split
    else:
        result = evaluate(model, source)
    print(f"\nvalidation (5 held-out works): {result['val_loss']:.4f} nats/token, {result['val_bpb']:.4f} bits/byte\n")
    for i, prompt in enumerate(DEMO_PROMPTS):
        print(f"--- sample {i + 1} (temperature 0.8, top-k 40) ---")
        sys.stdout.write(prompt)
        generate(model, tok.encode(prompt), 160, temperature=0.8, top_k=40, seed=args.seed + i,
                 stop_ids=[tok.eos_id], on_token=(stream := StdoutStream(tok)))
        stream.flush()
        print("\n")
    print(f"more: nanoeuler sample --ckpt {out} --prompt \"HAMLET.\"   |   curves: {out}/curves.png")
    return 0
