"""`nanoeuler lora merge` (an adapter run -> a plain checkpoint) and the --lora flags of sft / dpo / train.

    nanoeuler sft --base runs/small --lora 8 --out runs/small-lora      # adapters only: lora.json + adapter.safetensors
    nanoeuler lora merge --ckpt runs/small-lora --out runs/small-merged
"""
from __future__ import annotations

import json

LORA_HELP = ("LoRA: train rank-R adapters W + (alpha/R)·B·A on the targets, the base frozen; the run holds the "
             "adapters and points to the base (path + sha256, refused if the base changed). R=8 is usual on wide "
             "models; on a narrow one the frozen heads cost most: train them too (--lora-modules-to-save) or "
             "raise R (docs/lora.md)")

SAVE_HELP = ("train these modules whole beside the adapters, as PEFT's modules_to_save does (arch euler; AdamW "
             "moments for them too; the run holds them, merge and export --format peft carry them): lm_head (head "
             "0, PEFT's lm_head: vocab·dim parameters; refused when tied to the embedding, where PEFT would train a "
             "copy of the whole embedding), mtp_heads (heads 1..K-1, part of the training loss, not in a PEFT "
             "export; not with dpo, which trains head 0 only), norm (every RMSNorm weight). Not with export "
             "--format gguf-lora (llama.cpp's adapters hold A/B pairs only)")


def register(sub) -> None:
    p = sub.add_parser("lora", help="LoRA adapter runs: merge them into a plain checkpoint",
                       description="Work with adapter runs made by `sft/dpo/train --lora R`. sample, chat, serve, "
                                   "eval, info and export take an adapter run directly (merged at load).")
    lsub = p.add_subparsers(dest="lora_command", metavar="<lora command>")
    m = lsub.add_parser("merge", help="write the base with the adapters merged in (W + s·B·A) as a plain checkpoint",
                        description="Merge an adapter run into its base: a plain checkpoint (config.json, "
                                    "model.safetensors, tokenizer.json) that needs neither the run nor the base.")
    m.add_argument("--ckpt", required=True, help="adapter run directory")
    m.add_argument("--out", required=True, help="directory of the merged checkpoint (new, or --force); never the "
                                                "run itself nor its base")
    m.add_argument("--force", action="store_true", help="replace an existing --out (the whole folder, whole or "
                                                       "not at all)")
    m.add_argument("--json", action="store_true")
    m.set_defaults(run=run_merge)
    p.set_defaults(run=lambda args: p.print_help() or 2)


def add_lora_arguments(p, dropout: bool = True) -> None:
    """--lora R, --lora-alpha, --lora-targets (and --lora-dropout unless dropout=False: a loop without it)."""
    from .args import finite_float, positive_int
    g = p.add_argument_group("LoRA (adapters instead of full fine-tuning)")
    g.add_argument("--lora", type=positive_int, metavar="R", default=None, help=LORA_HELP)
    g.add_argument("--lora-alpha", type=finite_float(0, lo_open=True), metavar="A", default=None,
                   help="adapter scale numerator: s = A / R (default 2·R)")
    g.add_argument("--lora-targets", metavar="T,T", default=None,
                   help="modules to adapt, named as PEFT names them: euler q,k,v,o,gate,up,down (default all); "
                        "gpt2 c_attn,c_proj,c_fc (default all)")
    g.add_argument("--lora-modules-to-save", metavar="M,M", default=None, help=SAVE_HELP)
    if dropout:
        g.add_argument("--lora-dropout", type=finite_float(0, 1, hi_open=True), metavar="P", default=None,
                       help="dropout on the adapters' inputs while training (default 0)")


def lora_config(args):
    """The LoraConfig of the --lora flags (targets () = the arch's defaults), or None without --lora."""
    from ..adapters import LoraConfig
    from ..errors import UserError
    dropout = getattr(args, "lora_dropout", None)
    if args.lora is None:
        if any(v is not None for v in (args.lora_alpha, args.lora_targets, dropout, args.lora_modules_to_save)):
            raise UserError("--lora-alpha, --lora-targets, --lora-dropout and --lora-modules-to-save need --lora R")
        return None
    targets = tuple(t for t in (args.lora_targets or "").split(",") if t)
    saved = tuple(m for m in (args.lora_modules_to_save or "").split(",") if m)
    alpha = 2.0 * args.lora if args.lora_alpha is None else args.lora_alpha
    return LoraConfig(args.lora, alpha, targets, dropout or 0.0, saved)


def wants_lora(args, out) -> bool:
    """Whether this sft/dpo/train run trains adapters: --lora given, or resuming an adapter run.
    --lora-alpha/-targets/-dropout without --lora are refused (they would be ignored)."""
    from ..adapters import is_adapter_run
    return lora_config(args) is not None or bool(args.resume and is_adapter_run(out))


def start_or_resume(args, base_dir, out, seed: int):
    """The LoraModel of an `--lora` run: fresh adapters on base_dir, or (resume) the run in out, whose
    lora.json must agree with the --lora flags if any are given."""
    from ..errors import UserError
    from ..training.lora import LoraModel
    wanted = lora_config(args)
    if not args.resume:
        return LoraModel.new(base_dir, wanted, seed)
    from ..adapters import is_adapter_run
    if not is_adapter_run(out):
        raise UserError(f"{out} is not a LoRA run (no lora.json): resume it without --lora")
    model = LoraModel.load(out)
    if wanted is not None and wanted.check(model.config) != model.lcfg:
        raise UserError(f"cannot resume {out} with different LoRA settings: the run has {model.lcfg.to_dict()}")
    return model


def print_lora(model, rows: int, T: int) -> None:
    """The run's printout of a LoraModel: what it trains, and the memory of a step of `rows` sequences of T
    tokens beside full fine-tuning's."""
    from ..adapters import describe
    from ..training.memory import lora_step_memory, training_memory
    cfg = model.config
    mib = lora_step_memory(cfg, model.lcfg, rows, T)["total"] / 2**20
    full = training_memory(cfg, rows, T)["total"] / 2**20
    print(f"{describe(model.lcfg, cfg)} (the base's {model.n_params():,} frozen); a step of {rows} x {T} "
          f"tokens: ~{mib:,.1f} MiB (full fine-tuning ~{full:,.1f} MiB)")


def run_merge(args) -> int:
    from ..adapters import is_adapter_run, load_merged
    from ..checkpoint import load_tokenizer, save_model
    from ..errors import UserError
    from ..interop.outputs import check_free, output_dir
    out = check_free(args.out, args.force, inputs=[args.ckpt])   # never over the run, nor over the base it reads
    if not is_adapter_run(args.ckpt):
        raise UserError(f"{args.ckpt} is not an adapter run (no lora.json)")
    cfg, params = load_merged(args.ckpt, read_only=True)
    with output_dir(out, args.force, inputs=[args.ckpt]) as tmp:
        save_model(tmp, cfg, params, load_tokenizer(args.ckpt, read_only=True))
    if args.json:
        print(json.dumps({"out": str(out), "params": int(sum(p.size for p in params.values()))}))
    else:
        print(f"merged {args.ckpt} into its base -> {out}")
    return 0
