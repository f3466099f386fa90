"""`nanoeuler train` (pretraining) and `nanoeuler eval` (validation loss and bits per byte)."""
from __future__ import annotations

import json
from pathlib import Path


BUNDLED_DATA = Path("data/shakespeare")


def register(sub) -> None:
    p = sub.add_parser(
        "train", help="pretrain a model on token shards",
        description="Pretrain a model (AdamW, linear warm-up then cosine decay to 10%%, gradient clipping at 1.0) on "
                    "token shards from `nanoeuler prepare`. With no arguments: trains `small` on the bundled "
                    "Shakespeare corpus (its tokenizer and shards are made first in data/shakespeare if missing) "
                    "into runs/small. Checkpoints are written every --ckpt-every steps, at the end and on "
                    "Ctrl-C/SIGTERM; --resume continues a run bit-for-bit.",
        epilog="unset hyper-parameters take the preset's defaults: " + "; ".join(
            f"{name}: " + ", ".join(f"{k.replace('_', '-')} {v:g}" for k, v in d.items()
                                    if not k.startswith(("eval", "ckpt")))
            for name, d in PRESET_DEFAULTS.items()) + "; a config.json: nanoeuler.training.train.TrainConfig's")
    p.add_argument("config", nargs="?", default=None,
                   help="preset (small, big, gpt) or a config.json (default: small; on --resume: the run's)")
    p.add_argument("--data", default=None, help="token shard directory (default: the bundled corpus)")
    p.add_argument("--tokenizer", default=None, help="tokenizer.json (default: DATA/tokenizer.json)")
    p.add_argument("--out", default=None, help="run directory (default: runs/<preset>)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint")
    from .args import nonneg_int, positive_int
    p.add_argument("--stop-after", type=positive_int, default=None, metavar="N",
                   help="stop (with a checkpoint) after N steps of this invocation; --steps stays the planned total")
    add_hyperparameters(p)
    p.add_argument("--init-seed", type=nonneg_int, default=0, help="seed of the weight initialisation (default 0)")
    p.add_argument("--init-from", metavar="RUN", default=None,
                   help="fine-tune: start from this checkpoint's weights and config (e.g. GPT-2 from `nanoeuler "
                        "import`) instead of a fresh init; its tokenizer unless --tokenizer; needs --out")
    from .lora import add_lora_arguments
    add_lora_arguments(p)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--device", choices=["cpu", "gpu"], default="cpu",
                   help="where to train (gpu needs CuPy and a CUDA device; the checkpoint is the same either way)")
    add_precision_argument(p)
    p.add_argument("--json", action="store_true", help="print a JSON summary at the end")
    add_dist_arguments(p)
    p.set_defaults(run=data_parallel(run_train, prepare=prepare_before_launch))

    e = sub.add_parser("eval", help="validation loss and bits per byte of a checkpoint",
                       description="Head-0 validation loss (nats) and bits per byte of a checkpoint on the "
                                   "validation split of a token shard directory (all of it by default); with --dtype, "
                                   "of the model decoded at that weight type (its quantization's cost, measured). A "
                                   "model whose tokenizer starts a text with a BOS token (Gemma's <bos>) gets it in "
                                   "place of each window's first token, as llama.cpp's perplexity does.")
    e.add_argument("--ckpt", required=True, help="checkpoint directory")
    e.add_argument("--data", default=None, help="token shard directory (default: the bundled corpus)")
    e.add_argument("--batch-size", type=positive_int, default=16)
    e.add_argument("--max-batches", type=nonneg_int, default=0, help="evaluate only this many batches (0 = all)")
    e.add_argument("--seq-len", type=positive_int, default=None, metavar="T",
                   help="tokens per validation window (default: the model's context)")
    from ..infer.quant import decodable, from_float
    e.add_argument("--dtype", choices=decodable(), default=None,
                   help=f"score the model as decoding holds it at this weight type ({', '.join(from_float())}; "
                        f"`sample --help`): each validation row through the KV-cache decoding step. Default: the "
                        f"training forward (float32)")
    e.add_argument("--json", action="store_true", help="print one JSON object")
    e.set_defaults(run=run_eval)


def add_hyperparameters(p, dropout: bool = True) -> None:
    """The TrainConfig fields as flags; unset flags take the TrainConfig (or preset) default.
    dropout=False leaves out --dropout (for a loop that does not apply it: DPO)."""
    from .args import finite_float, nonneg_int, positive_int   # every value finite and in range (issue 14)
    g = p.add_argument_group("hyper-parameters (defaults: nanoeuler.training.train.TrainConfig)")
    g.add_argument("--steps", type=positive_int, help="planned total number of optimizer steps")
    g.add_argument("--batch-size", type=positive_int, help="sequences per optimizer step")
    g.add_argument("--grad-accum", type=positive_int, help="micro-batches per step (batch-size must divide by it)")
    g.add_argument("--lr", type=finite_float(0, 10, lo_open=True), help="peak learning rate, in (0, 10]")
    g.add_argument("--warmup", type=nonneg_int, help="linear warm-up steps")
    g.add_argument("--weight-decay", type=finite_float(0, 10), help="decoupled weight decay on matrices")
    g.add_argument("--grad-clip", type=finite_float(0, lo_open=True), help="global gradient-norm clip")
    if dropout:
        g.add_argument("--dropout", type=finite_float(0, 1, hi_open=True),
                       help="dropout rate on every residual branch while training (0 = none)")
    g.add_argument("--seed", type=nonneg_int, help="seed of the data order (>= 0)")
    g.add_argument("--eval-every", type=positive_int, help="steps between validation evals")
    g.add_argument("--eval-batches", type=nonneg_int, help="validation batches per periodic eval (0 = all)")
    g.add_argument("--ckpt-every", type=positive_int, help="steps between checkpoints")


def add_precision_argument(p) -> None:
    from ..config import PRECISIONS
    p.add_argument("--precision", choices=PRECISIONS, default=None,
                   help="f32 (default), or bf16 mixed precision: the matrix products (linears, attention) take "
                        "bfloat16 operands and accumulate in float32; master weights, optimizer and checkpoints stay "
                        "float32. On the CPU it needs AVX512_BF16. On --resume: the run's")


def saved_state(out: Path) -> dict:
    """out/trainer.json, read and validated (an old spelling brought up to date: check_trainer_state), or {}."""
    from ..checkpoint import check_trainer_state, read_json
    path = out / "trainer.json"
    return check_trainer_state(read_json(path, "resume state"), path) if path.exists() else {}


def resolve_precision(args, state: dict | None) -> str:
    """--precision, else the resumed run's (trainer.json `precision`), else f32; a resume must keep it
    (a run saved before precision was recorded takes what it is given)."""
    from ..errors import UserError
    recorded = (state or {}).get("precision")
    precision = args.precision or recorded or "f32"
    if recorded is not None and precision != recorded:
        raise UserError(f"the run was trained with --precision {recorded}; resume it with that (bit-for-bit resume)")
    return precision


def add_dist_arguments(p) -> None:
    from ..training.dist import add_arguments
    add_arguments(p)


def data_parallel(fn, prepare=None):
    """fn as a command that also runs under `mpiexec -n N` and with --nproc N (see nanoeuler/training/dist.py).
    prepare(args): what must exist before the ranks start (--nproc only). SIGTERM stops it as Ctrl-C does."""
    def run(args):
        from ..training.dist import check_launch, command
        from ..training.train import sigterm_as_ctrl_c
        with sigterm_as_ctrl_c():
            if getattr(args, "nproc", 0):
                check_launch(args.nproc)  # no MPI: one line, before anything is prepared
                if prepare is not None:
                    prepare(args)
            return command(fn)(args)
    return run


def prepare_before_launch(args) -> None:
    """--nproc: make the bundled corpus's tokenizer and shards once here, not in every rank."""
    from ..config import PRESETS, Config
    if args.data or args.resume:
        return
    preset = args.config if args.config in PRESETS else None
    cfg = PRESETS[preset] if preset else Config.load(args.config) if args.config else PRESETS["small"]
    ensure_bundled_data(cfg.vocab_size, progress=not args.no_progress)


def train_config_from_args(args, defaults: dict | None = None):
    from ..errors import UserError
    from ..training.train import TrainConfig
    values = dict(defaults or {})
    unknown = sorted(set(values) - set(TrainConfig.__dataclass_fields__))
    if unknown:
        raise UserError(f"train_config: unknown setting {unknown[0]!r:.60}")
    for field in TrainConfig.__dataclass_fields__:
        v = getattr(args, field, None)
        if v is not None:
            values[field] = v
    return TrainConfig(**values)


# Preset-specific defaults: what the default `nanoeuler train <preset>` does. small: ~50 min on a quiet
# 2-core machine, 1.896 val bits/byte (without dropout 1.903: the bundled corpus is seen 26 times, and
# dropout 0.1 holds back the memorising); the whole validation set every 1000 steps.
PRESET_DEFAULTS = {
    "small": dict(steps=15000, batch_size=32, lr=5e-3, warmup=200, dropout=0.1, eval_every=1000, eval_batches=0,
                  ckpt_every=500),
    "big": dict(steps=4000, batch_size=16, lr=2e-3, warmup=200, eval_every=250, ckpt_every=250),
    "gpt": dict(steps=20000, batch_size=32, lr=6e-4, warmup=1000, eval_every=500, ckpt_every=1000),
}


def ensure_bundled_data(vocab_size: int, data_dir: Path = BUNDLED_DATA, progress: bool = True) -> Path:
    """Train the bundled corpus's tokenizer and token shards in data_dir unless they exist already."""
    from ..data.corpus import bundled_split, bundled_works
    from ..data.shards import prepare_bundled
    from ..tokenizer import Tokenizer
    tok_path = data_dir / "tokenizer.json"
    if (data_dir / "manifest.json").exists() and tok_path.exists():
        return data_dir
    data_dir.mkdir(parents=True, exist_ok=True)
    if not tok_path.exists():
        works = bundled_works()
        train_names, _ = bundled_split()
        print(f"training a {vocab_size}-token BPE tokenizer on the bundled corpus -> {tok_path}")
        tok = Tokenizer.train((works[n] for n in train_names), vocab_size, progress=progress)
        tok.save(tok_path)
    print(f"preparing token shards of the bundled corpus -> {data_dir}")
    prepare_bundled(Tokenizer.load(tok_path), data_dir, progress=progress, force=True)   # the program's own
    return data_dir


def run_train(args) -> int:
    from ..checkpoint import load_tokenizer
    from ..config import PRESETS, Config
    from ..training.dist import under_mpi
    from ..errors import UserError
    from ..fileio import check_apart, check_real_dir
    from ..model import Model
    from ..tokenizer import Tokenizer
    from ..training.train import PretrainSource, run_training
    from .lora import start_or_resume, wants_lora

    preset = args.config if args.config in PRESETS else None
    out = check_real_dir(args.out if args.out is not None else
                         f"runs/{preset or (Path(args.config).stem if args.config else 'small')}")
    check_apart(out, [args.data or BUNDLED_DATA, args.tokenizer, args.init_from])
    state = None
    lora = wants_lora(args, out)
    if args.resume:
        from ..checkpoint import check_trainer_state, read_json
        if not (out / "trainer.json").is_file():   # validate first, create nothing (no bundled data) before
            raise UserError(f"nothing to resume in {out} (no trainer.json); start without --resume")
        state = check_trainer_state(read_json(out / "trainer.json", "resume state"), out / "trainer.json")
        if state.get("kind", "pretrain") != "pretrain":
            raise UserError(f"{out} is a {state.get('kind')} run, not a pretraining run; resume it with its command")
        if not args.data and not (BUNDLED_DATA / "manifest.json").exists():
            raise UserError(f"give --data DATA (the data {out} was trained on): without it --resume reads the "
                            f"bundled corpus, which is not prepared in {BUNDLED_DATA}")
        model = start_or_resume(args, None, out, 0) if lora else Model.load(out)
        if args.config and model.config != (PRESETS[preset] if preset else Config.load(args.config)):
            raise UserError(f"{out} was trained with a different config than {args.config}")
        cfg = model.config
        tcfg = train_config_from_args(args, state.get("train_config") or {})
    elif args.init_from:  # fine-tuning: the checkpoint's weights and config, a fresh optimizer and schedule
        if args.config or not args.out:
            raise UserError("--init-from takes the config of its checkpoint: give --out, and no config")
        tcfg = train_config_from_args(args, {})
        model = (start_or_resume(args, args.init_from, out, tcfg.seed) if lora
                 else Model.load(args.init_from, read_only=True))
        cfg = model.config
    else:
        if lora:
            raise UserError("--lora trains adapters on a trained model: give --init-from RUN")
        cfg = PRESETS[preset] if preset else Config.load(args.config) if args.config else PRESETS["small"]
        tcfg = train_config_from_args(args, PRESET_DEFAULTS.get(preset or ("small" if not args.config else ""), {}))
        data_tok = Path(args.tokenizer) if args.tokenizer else Path(args.data) / "tokenizer.json" if args.data else None
        if data_tok is not None and data_tok.is_file():
            n_vocab = Tokenizer.load(data_tok).vocab_size
            if n_vocab > cfg.vocab_size:   # the data's tokenizer is larger: take its vocab, keep the other dims
                print(f"vocab_size {n_vocab} from the data's tokenizer ({preset or args.config} has "
                      f"{cfg.vocab_size}; its other dimensions unchanged)")
                cfg = cfg.replace(vocab_size=n_vocab)
        from ..training.memory import check_fits
        check_fits(cfg, max(1, tcfg.batch_size // max(1, tcfg.grad_accum)), cfg.ctx_len)
        model = Model.init(cfg, seed=args.init_seed)
    precision = resolve_precision(args, state)
    if args.device == "gpu":
        if lora:
            raise UserError("--lora trains on the CPU engine (--device cpu)")
        from ..gpu.engine import GpuModel  # UserError when CuPy or a device is missing
        model = GpuModel(model, precision=precision)
    else:
        model.set_precision(precision)      # bf16: UserError on a CPU without AVX512_BF16
    if not args.data and under_mpi() and not (BUNDLED_DATA / "manifest.json").exists():
        raise UserError(f"the bundled corpus is not prepared in {BUNDLED_DATA}: use --nproc N (which prepares it "
                        f"first) or run `nanoeuler prepare` before mpiexec")
    data = Path(args.data) if args.data else ensure_bundled_data(cfg.vocab_size, progress=not args.no_progress)
    if args.resume:
        tok = load_tokenizer(out)
    elif args.init_from and not args.tokenizer:
        tok = load_tokenizer(args.init_from, read_only=True)
    else:
        tok_path = Path(args.tokenizer) if args.tokenizer else data / "tokenizer.json"
        if not tok_path.exists():
            raise UserError(f"no tokenizer: {tok_path} does not exist; pass --tokenizer")
        tok = Tokenizer.load(tok_path)
    if tok.vocab_size > cfg.vocab_size:
        raise UserError(f"the tokenizer has {tok.vocab_size} tokens but the model only {cfg.vocab_size} embeddings")
    source = PretrainSource(data, tcfg.batch_size // tcfg.grad_accum, cfg.ctx_len, cfg.n_mtp, bos=tok.bos_id)
    source.train.check_tokenizer(tok.fingerprint())
    if source.train.vocab_size > cfg.vocab_size:
        raise UserError(f"the shards use {source.train.vocab_size} token ids but the model has {cfg.vocab_size}")
    print(f"{'resuming' if args.resume else 'training'} {cfg.n_params():,} parameters -> {out} "
          f"({tcfg.steps} steps x {tcfg.batch_size} x {cfg.ctx_len} tokens)")
    if lora:
        from .lora import print_lora
        print_lora(model, tcfg.batch_size // tcfg.grad_accum, cfg.ctx_len)
    summary = run_training(model, tok, source, out, tcfg, resume=args.resume, stop_after=args.stop_after,
                           progress=not args.no_progress)
    report(summary, out, args.json)
    return 130 if summary["interrupted"] else 0


def report(summary: dict, out: Path, as_json: bool) -> None:
    if as_json:
        print(json.dumps(summary | {"out": str(out)}))
        return
    state = "finished" if summary["finished"] else "interrupted" if summary["interrupted"] else "stopped"
    line = f"{state} at step {summary['step']}/{summary['steps']}; checkpoint in {out}"
    if "val_bpb" in summary:
        line += f"; val loss {summary['val_loss']:.4f}, {summary['val_bpb']:.4f} bits/byte"
    print(line)
    if not summary["finished"]:
        print(f"continue with: nanoeuler train --out {out} --resume")


def run_eval(args) -> int:
    from ..checkpoint import load_tokenizer
    from ..errors import UserError
    from ..model import Model
    from ..training.train import PretrainSource, evaluate
    model = Model.load(args.ckpt, read_only=True)      # eval changes nothing in the checkpoint
    data = Path(args.data) if args.data else BUNDLED_DATA
    if not (data / "manifest.json").exists():
        raise UserError(f"no token shards in {data}; run `nanoeuler prepare` (or `nanoeuler train` for the bundled corpus)")
    if args.batch_size < 1:
        raise UserError("--batch-size must be >= 1")
    if args.seq_len is not None and args.seq_len > model.config.ctx_len:
        raise UserError(f"--seq-len {args.seq_len} is longer than the model's context ({model.config.ctx_len})")
    tok = load_tokenizer(args.ckpt, read_only=True)
    source = PretrainSource(data, args.batch_size, args.seq_len or model.config.ctx_len, model.config.n_mtp,
                            bos=tok.bos_id)
    source.val.check_tokenizer(tok.fingerprint())
    score = None
    if args.dtype is not None:  # the model as decoding holds it at that type
        from ..infer.session import head0_loss_sum
        from ..infer.weights import for_dtype
        score = head0_loss_sum(for_dtype(model, args.dtype))
    result = evaluate(model, source, args.max_batches, score)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"val loss {result['val_loss']:.4f} nats/token, {result['val_bpb']:.4f} bits/byte")
    return 0
