"""`nanoeuler sft` (instruction tuning), `nanoeuler sft-eval` (answer format and task accuracy) and
`nanoeuler sft-data` (write the offline instruction set as Alpaca JSON).

    nanoeuler sft --base runs/small --out runs/small-sft              # offline set from the bundled corpus
    nanoeuler sft --base runs/big --data data/alpaca/alpaca.json --out runs/big-sft
    nanoeuler sft --base runs/small --lora 8 --out runs/small-lora        # LoRA adapters only, the base frozen
    nanoeuler sft-eval --ckpt runs/small-sft                           # held-out offline prompts
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from .train import (add_dist_arguments, add_hyperparameters, add_precision_argument, data_parallel, report,
                    resolve_precision, saved_state, train_config_from_args)

DEFAULT_SEQ_LEN = 1024   # rows of a real model's whole context (8,192, 32,768) are more than a CPU step holds
# The recipe of the SFT figures in docs/benchmarks.md (Instruction and preference tuning).
SFT_DEFAULTS = dict(steps=1500, batch_size=16, lr=2e-3, warmup=50, weight_decay=0.0, eval_every=250, eval_batches=0,
                    ckpt_every=250)


def register(sub) -> None:
    p = sub.add_parser(
        "sft", help="supervised fine-tuning on instructions (loss on the response only)",
        description="Fine-tune a pretrained checkpoint on Alpaca-format instructions rendered through the "
                    "checkpoint's chat template (its own, e.g. ChatML for an imported model, else the SPEC Alpaca "
                    "template; --chat-template FILE overrides it and the fine-tuned model keeps it); the loss "
                    "covers exactly the response and its end-of-turn token, or, when the template marks the "
                    "assistant's turn with {% generation %} blocks, exactly the tokens in them (transformers' "
                    "assistant mask). Examples are packed back to back "
                    "into rows of the context (--no-pack: one per row); longer ones are truncated or dropped and "
                    "counted. A batch with no trainable position is skipped and counted. Checkpoints and "
                    "--resume work as in `nanoeuler train`.")
    p.add_argument("--base", help="pretrained checkpoint directory (not needed with --resume)")
    p.add_argument("--data", default="offline",
                   help="Alpaca JSON / JSON Lines file, or 'offline' (default): the instruction set generated "
                        "from the bundled corpus; examples longer than the context are left out")
    p.add_argument("--val", default=None,
                   help="validation file (default: 1 in 50 records of --data, chosen by hash; offline: its held-out split)")
    p.add_argument("--out", required=True, help="run directory of the fine-tuned model")
    p.add_argument("--resume", action="store_true", help="continue the SFT run in --out")
    from .args import positive_int
    p.add_argument("--stop-after", type=positive_int, default=None, metavar="N",
                   help="stop (with a checkpoint) after N steps")
    p.add_argument("--no-pack", action="store_true", help="one example per row instead of packing")
    p.add_argument("--seq-len", type=positive_int, default=None, metavar="T",
                   help=f"tokens per training row (default: the model's context, at most {DEFAULT_SEQ_LEN}; a "
                        "resumed run keeps its own): an example longer than T+1 tokens is truncated or dropped")
    from .args import add_template_arg
    add_template_arg(p)
    add_hyperparameters(p)
    from .lora import add_lora_arguments
    add_lora_arguments(p)
    add_precision_argument(p)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print a JSON summary at the end")
    add_dist_arguments(p)
    p.set_defaults(run=data_parallel(run_sft))

    e = sub.add_parser("sft-eval", help="answer format (stops with </s>) and task accuracy on held-out prompts",
                       description="Greedy answers of a checkpoint to held-out instructions: the share that is "
                                   "in format (non-empty, ends with </s>) and the task accuracy (exact match, "
                                   "case and surrounding punctuation ignored). Works on base models too.")
    e.add_argument("--ckpt", required=True, help="checkpoint directory")
    e.add_argument("--data", default="offline", help="Alpaca JSON file of held-out records, or 'offline' (default)")
    e.add_argument("--limit", type=int, default=0, help="score only the first N records (0 = all)")
    e.add_argument("--max-new-tokens", type=int, default=32)
    e.add_argument("--show", type=int, default=0, metavar="N", help="print the first N answers")
    from .args import add_template_arg
    add_template_arg(e)
    e.add_argument("--no-progress", action="store_true")
    e.add_argument("--json", action="store_true", help="print one JSON object")
    e.set_defaults(run=run_eval)

    d = sub.add_parser("sft-data", help="write the offline instruction set (train + held-out) as Alpaca JSON",
                       description="Generate the offline instruction set from the bundled Shakespeare (first/last "
                                   "word of a line, which play, which character, continue the speech) and write "
                                   "OUT/offline_train.json and OUT/offline_heldout.json.")
    d.add_argument("--out", default="data/sft", help="output directory (default data/sft)")
    d.add_argument("--n-train", type=int, default=6000)
    d.add_argument("--n-heldout", type=int, default=400)
    d.add_argument("--force", action="store_true", help="replace existing output files")
    d.add_argument("--json", action="store_true")
    d.set_defaults(run=run_data)


def offline_records(tok, ctx: int, limit: str = "the model's context"):
    """The offline instruction set, keeping only examples that fit ctx tokens (`limit` names what sets it)."""
    from ..training.sft import fits_context, offline_instructions
    return offline_instructions(fits=fits_context(tok, ctx), limit=limit)


def sft_records(data: str, val: str | None, tok, ctx: int, limit: str = "the model's context"):
    """(train records, validation records, data id, number of bad records skipped); the offline set's examples
    fit ctx tokens, which `limit` names in the error when too few do."""
    from ..training.sft import load_examples, split_heldout
    if data == "offline":
        train, held = offline_records(tok, ctx, limit)
        bad = 0
        data_id = f"offline-v2-ctx{ctx}-tok{tok.fingerprint()[:12]}"
    else:
        records, problems = load_examples(data)
        bad = len(problems)
        if problems:
            print(f"warning: skipped {len(problems)} invalid record(s) in {data}, e.g. {problems[0]}")
        data_id = hashlib.sha1(Path(data).read_bytes()).hexdigest()[:16]
        train, held = (records, None) if val else split_heldout(records)
    if val:
        held = load_examples(val)[0]
        data_id += "+" + hashlib.sha1(Path(val).read_bytes()).hexdigest()[:16]
    return train, held, data_id, bad


def run_sft(args) -> int:
    from ..checkpoint import load_tokenizer
    from ..errors import UserError
    from ..fileio import check_apart, check_real_dir
    from ..model import Model
    from ..training.sft import SFTSource
    from ..training.train import run_training
    from .lora import start_or_resume, wants_lora

    out = check_real_dir(args.out)
    check_apart(out, [args.base, None if args.data == "offline" else args.data, args.val])
    lora = wants_lora(args, out)
    if not (args.resume or args.base):
        raise UserError("--base RUN is required (the pretrained checkpoint to fine-tune)")
    from ..chat_template import check_training_template, with_template_file
    tok = load_tokenizer(out) if args.resume else load_tokenizer(args.base, read_only=True)
    tok = with_template_file(tok, args.chat_template)
    check_training_template(tok, generation=True)   # before the model and the data are read
    if args.resume:
        model = start_or_resume(args, None, out, 0) if lora else Model.load(out)
        state = saved_state(out)
        tcfg = train_config_from_args(args, state.get("train_config", {}))
    else:
        tcfg = train_config_from_args(args, SFT_DEFAULTS)
        model = start_or_resume(args, args.base, out, tcfg.seed) if lora else Model.load(args.base, read_only=True)
    model.set_precision(resolve_precision(args, state if args.resume else None))
    cfg = model.config
    T = sequence_length(args, cfg, state if args.resume else {})
    limit = (f"--seq-len {T}" if args.seq_len is not None else
             f"the model's context ({T})" if T == cfg.ctx_len else f"the rows' default length ({T}; --seq-len)")
    train, held, data_id, _ = sft_records(args.data, args.val, tok, T, limit)
    source = SFTSource(tok, train, held, tcfg.batch_size // tcfg.grad_accum, T, cfg.n_mtp,
                       pack=not args.no_pack, data_id=data_id)
    d = source.describe()
    print(f"{'resuming' if args.resume else 'fine-tuning'} {args.base or out} -> {out}: {d['train_examples']} train / "
          f"{d['val_examples']} validation examples, {d['truncated']} truncated, {d['dropped']} dropped "
          f"(longer than {d['max_example']} tokens)")
    if lora:
        from .lora import print_lora
        print_lora(model, tcfg.batch_size // tcfg.grad_accum, T)
    summary = run_training(model, tok, source, out, tcfg, resume=args.resume, stop_after=args.stop_after,
                           progress=not args.no_progress, kind="sft")
    summary |= {"truncated": d["truncated"], "dropped": d["dropped"]}
    if args.json:
        print(json.dumps(summary | {"out": str(out)}))
    else:
        report(summary, out, False)
        if "val_loss" in summary:
            print(f"validation loss on responses: {summary['val_loss']:.4f} nats/token; "
                  f"{summary['skipped_batches']} batch(es) without a trainable position skipped")
    return 130 if summary["interrupted"] else 0


def sequence_length(args, cfg, state: dict) -> int:
    """Inputs per row: --seq-len (at most the model's context), else a resumed run's, else the model's
    context up to DEFAULT_SEQ_LEN."""
    from ..errors import UserError
    if args.seq_len is not None:
        if args.seq_len > cfg.ctx_len:
            raise UserError(f"--seq-len {args.seq_len} is longer than the model's context ({cfg.ctx_len})")
        return args.seq_len
    if "length" in state.get("data", {}):
        return state["data"]["length"] - cfg.n_mtp
    return min(cfg.ctx_len, DEFAULT_SEQ_LEN)


def run_eval(args) -> int:
    from ..checkpoint import load_tokenizer
    from ..errors import UserError
    from ..model import Model
    from ..chat_template import with_template_file
    from ..training.sft import load_examples, score_answers
    model, tok = Model.load(args.ckpt, read_only=True), load_tokenizer(args.ckpt, read_only=True)
    tok = with_template_file(tok, args.chat_template)
    if args.limit < 0 or args.max_new_tokens < 1:
        raise UserError("--limit must be >= 0 and --max-new-tokens >= 1")
    records = offline_records(tok, model.config.ctx_len)[1] if args.data == "offline" else load_examples(args.data)[0]
    if args.limit:
        records = records[:args.limit]
    result = score_answers(model, tok, records, args.max_new_tokens, progress=not args.no_progress)
    if args.json:
        print(json.dumps({k: v for k, v in result.items() if k != "examples"} | {"ckpt": args.ckpt}))
        return 0
    for row in result["examples"][:args.show]:
        mark = "ok " if row["correct"] else "   "
        print(f"{mark}[{row['task']}] expected {row['expected']!r}, got {row['answer']!r}"
              f"{'' if row['in_format'] else '  (not in format)'}")
    print(f"{args.ckpt}: {result['n']} prompts, in format (ends with </s>) {result['in_format']:.1%}, "
          f"task accuracy {result['accuracy']:.1%}, lenient (first line, format ignored) "
          f"{result['lenient_accuracy']:.1%}; speculative drafts accepted {result['draft_acceptance']:.1%}")
    for task, r in result["per_task"].items():
        print(f"  {task:<11} n={r['n']:<4} in format {r['in_format']:6.1%}  accuracy {r['accuracy']:6.1%}  "
              f"lenient {r['lenient_accuracy']:6.1%}")
    return 0


def run_data(args) -> int:
    from ..fileio import atomic_write_text, check_output_files
    from ..training.sft import offline_instructions
    files = ("offline_train.json", "offline_heldout.json")
    out = check_output_files(args.out, files, args.force)
    train, held = offline_instructions(args.n_train, args.n_heldout)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, recs in zip(files, (train, held)):
        atomic_write_text(out / name, json.dumps(recs, ensure_ascii=False, indent=1) + "\n")
        paths[name] = str(out / name)
    if args.json:
        print(json.dumps({"train": len(train), "heldout": len(held), "files": list(paths.values())}))
    else:
        print(f"wrote {len(train)} train and {len(held)} held-out instructions to {out}")
    return 0
