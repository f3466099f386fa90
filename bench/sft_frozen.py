"""Full SFT with some tensors frozen (their gradients zeroed every step): what LoRA's frozen tensors cost.

LoRA trains adapters on the layers' matrices and freezes everything else: the embedding, the output heads
and the norms. A LoRA run at full rank (r = dim) can reach any update of the adapted matrices, so it should
do as well as full SFT with those same tensors frozen, and the gap from there to full SFT is what freezing
them costs. This runs `nanoeuler sft`'s loop (the same defaults, data and batches) on the full model with
the tensors whose names match --freeze held fixed (zero gradient: AdamW's moments stay 0, so they never move;
SFT's weight decay is 0).

    python bench/sft_frozen.py --base runs/demo --out runs/frz --steps 400 --freeze '^(embed|heads|norm|layers\\.\\d+\\.\\w+_norm)'
    python bench/sft_frozen.py --base runs/demo --out runs/frz-e --steps 400 --freeze '^embed'
    nanoeuler sft --base runs/demo --out runs/full --steps 400    # the run with nothing frozen, to compare
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    from nanoeuler.checkpoint import load_tokenizer
    from nanoeuler.cli.sft import SFT_DEFAULTS, sft_records
    from nanoeuler.model import Model
    from nanoeuler.training.sft import SFTSource
    from nanoeuler.training.train import TrainConfig, run_training
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base", required=True, help="pretrained checkpoint")
    p.add_argument("--out", required=True, help="new run directory")
    p.add_argument("--freeze", required=True, help="regular expression: the tensors whose names match are frozen")
    p.add_argument("--steps", type=int, default=SFT_DEFAULTS["steps"])
    p.add_argument("--lr", type=float, default=SFT_DEFAULTS["lr"])
    args = p.parse_args()
    model, tok = Model.load(args.base, read_only=True), load_tokenizer(args.base, read_only=True)
    frozen = [n for n in model.params if re.search(args.freeze, n)]
    print(f"frozen: {', '.join(frozen) or 'nothing'}")
    step = model.loss_and_grads

    def frozen_step(*a, **k):
        head0, objective, grads = step(*a, **k)
        for n in frozen:
            grads[n][...] = 0
        return head0, objective, grads
    model.loss_and_grads = frozen_step
    tcfg = TrainConfig(**(SFT_DEFAULTS | dict(steps=args.steps, lr=args.lr, eval_every=args.steps,
                                              ckpt_every=args.steps)))
    train, held, data_id, _ = sft_records("offline", None, tok, model.config.ctx_len)
    source = SFTSource(tok, train, held, tcfg.batch_size, model.config.ctx_len, model.config.n_mtp, data_id=data_id)
    summary = run_training(model, tok, source, args.out, tcfg, progress=False, kind="sft")
    print(f"step {summary['step']}: validation loss on responses {summary.get('val_loss', float('nan')):.4f}")


if __name__ == "__main__":
    main()
