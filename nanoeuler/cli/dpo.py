"""`nanoeuler dpo` (preference tuning), `nanoeuler dpo-eval` (preference and task accuracy on held-out
pairs) and `nanoeuler dpo-data` (write the offline pair set as JSONL).

    nanoeuler dpo --sft runs/small-sft --out runs/small-dpo            # offline pairs from the bundled corpus
    nanoeuler dpo --sft runs/small-sft --data pairs.jsonl --val heldout.jsonl --out runs/x --beta 0.1
    nanoeuler dpo-eval --ckpt runs/small-dpo --ref runs/small-sft       # held-out offline pairs
    nanoeuler dpo --sft runs/small-sft --lora 8 --out runs/small-dpo-lora   # adapters; reference = the frozen base

    # the measured recipe: the SFT model's own wrong answers as rejected responses (on-policy)
    nanoeuler dpo-data --from-model runs/small-sft --out data/dpo
    nanoeuler dpo --sft runs/small-sft --data data/dpo/pairs_train.jsonl --val data/dpo/pairs_heldout.jsonl \
        --out runs/small-dpo
"""
from __future__ import annotations

import json
from pathlib import Path

from .train import (add_dist_arguments, add_hyperparameters, add_precision_argument, data_parallel, resolve_precision,
                    saved_state, train_config_from_args)

# The recipe of the DPO figures in docs/benchmarks.md (on-policy negatives, DPO + 0.5·NLL); plain DPO and
# a higher learning rate did worse on the offline set.
DPO_DEFAULTS = dict(steps=300, batch_size=16, lr=3e-4, warmup=10, weight_decay=0.0, eval_every=50,
                    eval_batches=0, ckpt_every=100)
NLL_WEIGHT = 0.5


def register(sub) -> None:
    p = sub.add_parser(
        "dpo", help="preference tuning (DPO) of an SFT checkpoint on {prompt, chosen, rejected} pairs",
        description="Direct preference optimisation: the policy starts from the SFT checkpoint, which also serves "
                    "as the frozen reference; the loss is -log sigmoid(beta * ((logp_c - ref_c) - (logp_r - ref_r))) "
                    "over the summed head-0 log-probs of the response tokens and </s>. Pair data is JSONL "
                    "{prompt, chosen, rejected}, where prompt is the SPEC template rendered up to and including "
                    "'### Response:\\n' and chosen/rejected are bare responses (</s> is appended). Logs the loss, "
                    "reward margin and preference accuracy; checkpoints and --resume work as in `nanoeuler train`.")
    p.add_argument("--sft", help="the SFT checkpoint: reference and initial policy (not needed with --resume)")
    p.add_argument("--data", default="offline",
                   help="JSONL pair file, or 'offline' (default): pairs built from the offline instruction set, "
                        "only questions that fit the model's context whole")
    p.add_argument("--val", default=None,
                   help="held-out JSONL pair file (default: 1 in 50 prompts of --data by hash; offline: its held-out split)")
    p.add_argument("--out", required=True, help="run directory of the tuned policy")
    p.add_argument("--beta", type=float, default=None, help="DPO temperature beta (default 0.1; on --resume: the run's)")
    p.add_argument("--nll-weight", type=float, default=None,
                   help=f"add this times the per-token NLL of the chosen responses to the loss (DPO + NLL; "
                        f"default {NLL_WEIGHT}; 0 = plain DPO; on --resume: the run's)")
    p.add_argument("--resume", action="store_true", help="continue the DPO run in --out")
    from .args import positive_int
    p.add_argument("--stop-after", type=positive_int, default=None, metavar="N",
                   help="stop (with a checkpoint) after N steps")
    add_hyperparameters(p, dropout=False)
    from .lora import add_lora_arguments
    add_lora_arguments(p, dropout=False)
    add_precision_argument(p)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print a JSON summary at the end")
    from .args import add_template_arg
    add_template_arg(p)
    add_dist_arguments(p)
    p.set_defaults(run=data_parallel(run_dpo))

    e = sub.add_parser("dpo-eval", help="preference accuracy and greedy task accuracy on held-out pairs",
                       description="On held-out pairs: preference accuracy (share of pairs where the model gives the "
                                   "chosen response a higher summed log-prob than the rejected one) and task accuracy "
                                   "of greedy answers (exact match with chosen, case and surrounding punctuation "
                                   "ignored). With --ref also the DPO loss, reward margin and reward accuracy.")
    e.add_argument("--ckpt", required=True, help="checkpoint directory")
    e.add_argument("--ref", default=None, help="reference checkpoint (the SFT run) for loss and rewards")
    e.add_argument("--data", default="offline", help="JSONL pair file to evaluate (all of it), or 'offline' "
                                                     "(default): the held-out offline pairs that fit the context")
    e.add_argument("--beta", type=float, default=0.1)
    e.add_argument("--limit", type=int, default=0, help="only the first N pairs (0 = all)")
    e.add_argument("--no-greedy", action="store_true", help="skip the greedy answers (preference metrics only)")
    e.add_argument("--max-new-tokens", type=int, default=32)
    e.add_argument("--show", type=int, default=0, metavar="N", help="print the first N greedy answers")
    e.add_argument("--no-progress", action="store_true")
    e.add_argument("--json", action="store_true", help="print one JSON object")
    e.set_defaults(run=run_eval)

    d = sub.add_parser("dpo-data", help="write the offline pair set (train + held-out) as JSONL",
                       description="Build {prompt, chosen, rejected, task} pairs from the offline instruction set "
                                   "(chosen = the correct answer, rejected = a wrong one of the same kind) and write "
                                   "OUT/pairs_train.jsonl and OUT/pairs_heldout.jsonl.")
    d.add_argument("--out", default="data/dpo", help="output directory (default data/dpo)")
    d.add_argument("--from-model", default=None, metavar="RUN",
                   help="on-policy negatives: where this checkpoint's greedy answer to a training prompt is wrong, "
                        "it becomes the rejected response (held-out pairs stay as built); only questions that fit "
                        "this model's context whole are kept")
    d.add_argument("--n-train", type=int, default=0, help="keep only the first N training pairs (0 = all)")
    d.add_argument("--force", action="store_true", help="replace existing output files")
    d.add_argument("--no-progress", action="store_true")
    d.add_argument("--json", action="store_true")
    d.set_defaults(run=run_data)


def run_dpo(args) -> int:
    from ..checkpoint import load_tokenizer
    from ..training.dpo import run_dpo as train_dpo
    from ..training.dpo_data import pair_records, tokenize_pairs
    from ..errors import UserError
    from ..fileio import check_apart, check_real_dir
    from ..model import Model
    from ..training.sft import fits_context
    from .lora import start_or_resume, wants_lora

    out = check_real_dir(args.out)
    sft = args.sft
    check_apart(out, [sft, *(p for p in (args.data, args.val) if p not in (None, "offline"))])

    lora = wants_lora(args, out)
    if not (args.resume or sft):
        raise UserError("--sft RUN is required (the SFT checkpoint: reference and initial policy)")
    from ..chat_template import check_training_template, with_template_file
    tok = load_tokenizer(out) if args.resume else load_tokenizer(sft, read_only=True)
    tok = with_template_file(tok, args.chat_template)
    check_training_template(tok)   # before the models and the data are read
    if args.resume:
        model = start_or_resume(args, None, out, 0) if lora else Model.load(out)
        state = saved_state(out)
        tcfg = train_config_from_args(args, state.get("train_config", {}))
        beta = args.beta if args.beta is not None else state.get("beta", 0.1)
        nll_weight = args.nll_weight if args.nll_weight is not None else state.get("nll_weight", 0.0)
        sft = sft or state.get("sft")
        if not sft:
            raise UserError("--sft RUN is required: the run does not record its reference checkpoint")
        # the SFT run is only read; with LoRA the reference is the frozen base itself (no second copy)
        reference = model.base if lora else Model.load(sft, read_only=True)
    else:
        tcfg = train_config_from_args(args, DPO_DEFAULTS)
        if lora:   # the policy is base + adapters, the reference the frozen base: one copy of the weights
            model = start_or_resume(args, sft, out, tcfg.seed)
            reference = model.base
        else:
            model = Model.load(sft, read_only=True)
            reference = Model.load(sft, read_only=True)  # a separate copy: the policy is trained in place
        beta = args.beta if args.beta is not None else 0.1
        nll_weight = args.nll_weight if args.nll_weight is not None else NLL_WEIGHT
    model.set_precision(resolve_precision(args, state if args.resume else None))
    ctx = model.config.ctx_len
    train, held, data_id, _ = pair_records(args.data, args.val, fits=fits_context(tok, ctx))
    train_t, held_t = tokenize_pairs(tok, train, ctx), tokenize_pairs(tok, held, ctx)
    print(f"{'resuming' if args.resume else 'preference-tuning'} {sft} -> {out}: {len(train_t)} train / "
          f"{len(held_t)} held-out pairs; {train_t.truncated + held_t.truncated} longer than {ctx + 1} tokens "
          f"(prompt start cut), {train_t.dropped + held_t.dropped} dropped (responses alone too long); "
          f"beta {beta}")
    if lora:
        from .lora import print_lora
        longest = max((len(ids) - 1 for ids, _ in train_t.chosen + train_t.rejected), default=1)
        print_lora(model, 2 * tcfg.batch_size // tcfg.grad_accum, min(ctx, longest))   # a pair: two sequences
    summary = train_dpo(model, tok, train_t, held_t, reference, out, tcfg, beta=beta, resume=args.resume,
                        stop_after=args.stop_after, progress=not args.no_progress, data_id=data_id, sft=sft,
                        nll_weight=nll_weight)
    if args.json:
        print(json.dumps(summary | {"out": str(out), "beta": beta, "nll_weight": nll_weight}))
    else:
        state = "finished" if summary["finished"] else "interrupted" if summary["interrupted"] else "stopped"
        print(f"{state} at step {summary['step']}/{summary['steps']}; checkpoint in {out}")
        first = summary.get("initial_eval") or {}
        if "val_loss" in summary:
            before = (f" (before: loss {first['val_loss']:.4f}, policy accuracy {first['val_policy_accuracy']:.1%})"
                      if first else "")
            print(f"held-out pairs: DPO loss {summary['val_loss']:.4f}, reward margin {summary['val_reward_margin']:.3f}, "
                  f"reward accuracy {summary['val_reward_accuracy']:.1%}, policy accuracy "
                  f"{summary['val_policy_accuracy']:.1%}{before}")
        if not summary["finished"]:
            print(f"continue with: nanoeuler dpo --out {out} --resume")
    return 130 if summary["interrupted"] else 0


def run_eval(args) -> int:
    import numpy as np

    from ..checkpoint import load_tokenizer
    from ..training.dpo import pair_logprobs, preference_metrics, score_greedy
    from ..training.dpo_data import load_pairs, offline_pairs, tokenize_pairs
    from ..errors import UserError
    from ..model import Model
    from ..training.sft import fits_context
    if args.limit < 0 or args.max_new_tokens < 1 or not args.beta > 0:
        raise UserError("--limit must be >= 0, --max-new-tokens >= 1 and --beta > 0")
    model, tok = Model.load(args.ckpt, read_only=True), load_tokenizer(args.ckpt, read_only=True)
    if args.ref:   # the reference must be the same model shape with the same tokenizer, or its loss means nothing
        ref = Model.load(args.ref, read_only=True)
        if ref.config != model.config:
            raise UserError(f"--ref {args.ref} has a different config than {args.ckpt}; give the SFT run it was "
                            f"tuned from")
        if load_tokenizer(args.ref, read_only=True).fingerprint() != tok.fingerprint():
            raise UserError(f"--ref {args.ref} has a different tokenizer than {args.ckpt}; give the SFT run it was "
                            f"tuned from")
    fits = fits_context(tok, model.config.ctx_len)
    pairs = offline_pairs(fits=fits)[1] if args.data == "offline" else load_pairs(args.data)[0]
    if args.limit:
        pairs = pairs[:args.limit]
    tp = tokenize_pairs(tok, pairs, model.config.ctx_len)
    if not len(tp):
        raise UserError(f"no pair fits the context of {model.config.ctx_len} tokens")
    pc, pr = pair_logprobs(model.config, model.params, tp, pad_id=tok.eos_id, progress=not args.no_progress)
    result = {"ckpt": args.ckpt, "pairs": len(tp), "truncated": tp.truncated, "dropped": tp.dropped,
              "policy_accuracy": float(np.mean(pc > pr))}
    if args.ref:
        rc, rr = pair_logprobs(ref.config, ref.params, tp, pad_id=tok.eos_id, progress=not args.no_progress)
        result |= {k: v for k, v in preference_metrics(pc, pr, rc, rr, args.beta).items() if k != "policy_accuracy"}
        result["ref"] = args.ref
    if not args.no_greedy:
        g = score_greedy(model, tok, tp.records, args.max_new_tokens, progress=not args.no_progress)
        result |= {"task_accuracy": g["accuracy"], "scored": g["n_scored"], "per_task": g["per_task"]}
    if args.json:
        print(json.dumps(result))
        return 0
    if not args.no_greedy:
        for row in g["examples"][:args.show]:
            mark = "ok " if row["correct"] else "   "
            print(f"{mark}[{row['task']}] expected {row['expected']!r}, got {row['answer']!r}")
    print(f"{args.ckpt}: {len(tp)} pairs ({tp.truncated} with the prompt start cut, {tp.dropped} dropped), preference accuracy {result['policy_accuracy']:.1%}")
    if args.ref:
        print(f"  vs reference {args.ref}: DPO loss {result['loss']:.4f}, reward margin {result['reward_margin']:.3f}, "
              f"reward accuracy {result['reward_accuracy']:.1%}")
    if not args.no_greedy:
        print(f"  greedy task accuracy {result['task_accuracy']:.1%} over {result['scored']} scored prompts")
        for task, r in result["per_task"].items():
            print(f"  {task:<11} n={r['n']:<4} accuracy {r['accuracy']:.1%}  answered the rejected response "
                  f"{r['said_rejected']:.1%}")
    return 0


def run_data(args) -> int:
    from ..training.dpo_data import model_negatives, offline_pairs
    from ..errors import UserError
    from ..fileio import atomic_write_text, check_output_files
    if args.n_train < 0:
        raise UserError("--n-train must be >= 0")
    names = ("pairs_train.jsonl", "pairs_heldout.jsonl")
    out = check_output_files(args.out, names, args.force, inputs=[args.from_model])
    replaced = 0
    if args.from_model:
        from ..checkpoint import load_tokenizer
        from ..model import Model
        from ..training.sft import fits_context
        model, tok = Model.load(args.from_model, read_only=True), load_tokenizer(args.from_model, read_only=True)
        train, held = offline_pairs(fits=fits_context(tok, model.config.ctx_len))
        if args.n_train:
            train = train[:args.n_train]
        train, replaced = model_negatives(model, tok, train, progress=not args.no_progress)
    else:
        train, held = offline_pairs()
        if args.n_train:
            train = train[:args.n_train]
    out.mkdir(parents=True, exist_ok=True)
    files = []
    for name, pairs in zip(names, (train, held)):
        atomic_write_text(out / name, "".join(json.dumps(p, ensure_ascii=False) + "\n" for p in pairs))
        files.append(str(out / name))
    if args.json:
        print(json.dumps({"train": len(train), "heldout": len(held), "model_negatives": replaced, "files": files}))
    else:
        print(f"wrote {len(train)} train and {len(held)} held-out pairs to {out}" +
              (f" ({replaced} training pairs with the model's own wrong answer as rejected)" if args.from_model else ""))
    return 0
