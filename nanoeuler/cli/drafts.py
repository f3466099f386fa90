"""`nanoeuler drafts`: distill a checkpoint's MTP draft heads toward its head 0 (nanoeuler/drafts.py)."""
from __future__ import annotations

import json


def register(sub) -> None:
    from .args import existing_file, int_range, nonneg_int
    p = sub.add_parser(
        "drafts", help="train a checkpoint's draft heads to predict the model itself (faster speculative decoding)",
        description="Self-distillation of the MTP draft heads 1..K-1: the model writes continuations of corpus "
                    "prompts, and each draft head (a linear map on the final hidden state) is refitted to predict "
                    "what head 0 produces k steps later, with the trunk and head 0 frozen. Speculative decoding "
                    "then accepts more drafts. `nanoeuler train` does this at the end of pretraining; this "
                    "command does it for any checkpoint with K > 1 (an SFT or DPO run, an import with --mtp K). "
                    "Only model.safetensors' heads 1..K-1 change (one atomic replace); head 0, the trunk and so "
                    "the validation loss stay bit-identical. The new heads are kept only if the draft acceptance "
                    "on held-out continuations rose.",
        epilog="prompts: --data shards, else --text files, else the bundled corpus, through the checkpoint's tokenizer")
    p.add_argument("--ckpt", required=True, help="checkpoint directory (changed in place)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--data", default=None, help="token shard directory made with this checkpoint's tokenizer")
    src.add_argument("--text", nargs="+", type=existing_file, default=None, metavar="FILE",
                     help="text files to take prompts from (e.g. your chat prompts; last 10%% held out)")
    p.add_argument("--rollouts", type=int_range(8, 1 << 16), default=None,
                   help="continuations the model writes to learn from (default: 1024 for small, ~25 s on 2 cores; "
                        "fewer for bigger models)")
    p.add_argument("--seed", type=nonneg_int, default=0, help="seed of the prompts and fitting (default 0)")
    p.add_argument("--dry-run", action="store_true", help="measure the acceptance before/after; write nothing")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run_drafts)


def run_drafts(args) -> int:
    from ..drafts import distill_checkpoint
    result = distill_checkpoint(args.ckpt, args.data, args.text, args.rollouts, args.seed,
                                progress=not args.no_progress, dry_run=args.dry_run)
    if args.json:
        print(json.dumps(report(result) | {"ckpt": str(args.ckpt), "written": result.kept and not args.dry_run}))
    else:
        print(result.summary() + ("" if result.kept and not args.dry_run else "; nothing written"))
    return 0


def report(result) -> dict:
    """The JSON form of a drafts.Distilled (also `nanoeuler train --json`'s "drafts")."""
    return {"kept": result.kept, "rollouts": result.rollouts, "pairs": result.pairs,
            "seconds": round(result.seconds, 2), "greedy_acceptance_before": result.greedy_before,
            "greedy_acceptance_after": result.greedy_after, "sampled_acceptance_before": result.sampled_before,
            "sampled_acceptance_after": result.sampled_after}
