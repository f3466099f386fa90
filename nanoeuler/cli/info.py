"""`nanoeuler info PRESET|RUN|FILE.gguf [--lora R [--lora-modules-to-save M,M]]`: config, exact parameter count,
memory of one training step; for an imported checkpoint or a GGUF file also its tensor types."""
from __future__ import annotations

import json
import math
from pathlib import Path


def register(sub) -> None:
    p = sub.add_parser("info", help="config, parameter count and training memory of a preset, run or GGUF file",
                       description="Show a preset's (small, big, gpt), a config.json's, a checkpoint's or a GGUF "
                                   "file's config (a GGUF file read as `import` reads it: architecture, sizes), its "
                                   "exact parameter count, the tensor types of a GGUF file or an imported checkpoint "
                                   "and their size there, and the memory one float32 training step needs "
                                   "(weights, gradients, AdamW moments, activations) at the given batch and context.")
    p.add_argument("target", help="preset name, config.json, checkpoint directory, or .gguf file")
    from .args import positive_int
    p.add_argument("--batch", type=positive_int, default=32, help="batch size for the memory estimate (default 32)")
    p.add_argument("--ctx", type=positive_int, default=None,
                   help="context length for the memory estimate (default: the config's)")
    p.add_argument("--lora", type=positive_int, default=None, metavar="R",
                   help="the memory of a LoRA step of rank R on the default targets (an adapter run: its own)")
    p.add_argument("--lora-modules-to-save", metavar="M,M", default=None,
                   help="with --lora: modules trained whole beside the adapters (lm_head, mtp_heads, norm; see sft --help)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)


def resolve(target: str):
    """info's target -> (Config, source: the tensor types of a GGUF file or an imported checkpoint, else None).
    A GGUF file is read as `import` reads it (interop.gguf_import.load_gguf: the same refusals), its matrices
    left in their blocks."""
    from ..checkpoint import read_source
    path = Path(target)
    if path.is_file() and (path.suffix.lower() == ".gguf" or is_gguf(path)):
        from ..interop.gguf_import import load_gguf
        cfg, _, _, source = load_gguf(path, blocks=True)
        return cfg, source
    return resolve_config(target), read_source(target)


def is_gguf(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def resolve_config(target: str):
    """A preset name, a config.json path, or a checkpoint directory -> Config."""
    from ..config import PRESETS, Config
    from ..errors import UserError
    if target in PRESETS:
        return PRESETS[target]
    path = Path(target)
    from ..adapters import is_adapter_run, read_adapter_run
    if is_adapter_run(path):   # an adapter run: its base's config
        return resolve_config(read_adapter_run(path, read_only=True)[1]["path"])
    if path.is_dir():
        from ..checkpoint import check_run_dir, member, read_journal, read_json
        check_run_dir(path, read_only=True)   # info changes nothing; a pending save is read where it lies
        return Config.from_dict(read_json(member(path, "config.json", read_journal(path)), "checkpoint config"))
    accepted = f"a preset ({', '.join(PRESETS)}), a config.json, a checkpoint directory or a GGUF file"
    if path.is_file():
        try:
            return Config.load(path)
        except UserError as e:
            raise UserError(f"{e}; info takes {accepted}") from None
    raise UserError(f"{target!r} is not {accepted}")


def source_lines(src: dict, n_params: int) -> list[str]:
    """{"tensor_types": {name: "Q8_0", ...}, ...} -> 'Q8_0 x14, F32 x5' and the memory lines."""
    from collections import Counter
    counts = Counter(map(str, src["tensor_types"].values()))
    lines = [f"{'source':<12} {src.get('format')} {src.get('file')}: "
             + ", ".join(f"{t} x{n}" for t, n in counts.most_common()) + " tensors"]
    if isinstance(src.get("file_tensor_bytes"), int):
        lines.append(f"{'file':<12} {src['file_tensor_bytes'] / 2**20:10.1f} MiB of tensors in the source file")
    lines.append(f"{'weights':<12} {4 * n_params / 2**20:10.1f} MiB in memory (float32)")
    return lines


def lora_config(args, cfg):
    """The LoRA config of `info --lora R` (default targets), or an adapter run's own, or None."""
    from ..adapters import LORA_FILE, LoraConfig, is_adapter_run, read_adapter_run
    from ..errors import UserError
    if args.lora is not None:
        saved = tuple(m for m in (args.lora_modules_to_save or "").split(",") if m)
        return LoraConfig(args.lora, 2.0 * args.lora, modules_to_save=saved).check(cfg)
    if args.lora_modules_to_save is not None:
        raise UserError("--lora-modules-to-save needs --lora R")
    if is_adapter_run(args.target):
        return read_adapter_run(args.target, read_only=True)[0].check(cfg, f"{args.target}/{LORA_FILE}")
    return None


def run(args) -> int:
    from ..adapters import trainable_shapes
    from ..errors import UserError
    from ..training.memory import lora_step_memory, training_memory
    cfg, src = resolve(args.target)
    T = args.ctx or cfg.ctx_len
    if args.batch < 1 or not 1 <= T <= cfg.ctx_len:
        raise UserError(f"--batch must be >= 1 and --ctx in [1, {cfg.ctx_len}]")
    lcfg = lora_config(args, cfg)
    trained = None if lcfg is None else sum(math.prod(s) for s in trainable_shapes(cfg, lcfg).values())
    mem = training_memory(cfg, args.batch, T) if lcfg is None else lora_step_memory(cfg, lcfg, args.batch, T)
    if args.json:
        extra = {} if lcfg is None else {"lora": lcfg.to_dict(), "trainable_params": trained}
        print(json.dumps({"config": cfg.to_dict(), "n_params": cfg.n_params(), "batch": args.batch, "ctx": T,
                          "memory_bytes": mem, **({"source": src} if src else {})} | extra))
        return 0
    for k, v in cfg.to_dict().items():
        print(f"{k:<12} {v}")
    print(f"{'params':<12} {cfg.n_params():,}")
    for line in source_lines(src, cfg.n_params()) if src else []:
        print(line)
    if lcfg is not None:
        saved = f", {','.join(lcfg.modules_to_save)} trained whole" if lcfg.modules_to_save else ""
        print(f"{'trainable':<12} {trained:,} (LoRA r={lcfg.rank} on {','.join(lcfg.targets)}{saved}; the rest frozen)")
    print(f"training step memory at batch {args.batch} x ctx {T} (float32):")
    for k, v in mem.items():
        print(f"  {k:<12} {v / 2**20:10.1f} MiB")
    return 0
