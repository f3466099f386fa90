"""LoRA adapters as arrays: which weights they adapt, their initialisation, merging, and the adapter run.

An adapter *module* adds s·B·A (s = α / r, A [r, in], B [out, r]) to one weight, or to several weights
stacked by rows (GPT-2's `c_attn` is q|k|v in one matrix in HF, so one A is shared by wq, wk, wv and B
is cut by rows between them). Targets are named per architecture as its record says (arch.py `lora`):

    euler, qwen2, gemma3: q k v o gate up down  ->  layers.i.attn.wq ... layers.i.ffn.down
    gpt2:                 c_attn c_proj c_fc    ->  layers.i.attn.wqkv (wq|wk|wv), attn.wo and ffn.proj
                                                    (PEFT's "c_proj" matches both), ffn.fc

Parameters are `<module>.lora_A` [r, in] and `<module>.lora_B` [Σ out, r]; A ~ U(±1/√in) (PEFT's
Kaiming-uniform with a = √5), B = 0, so training starts from the base model exactly.

Whole modules can be trained beside the adapters, as PEFT's `modules_to_save` does: a trainable copy of
each of their tensors, under its own name, replaces the base's (`saved_names`):

    lm_head    heads.0.weight (PEFT's lm_head; refused when tied to the embedding: PEFT would train
               an untied copy of the whole [V, d] embedding, which LoRA exists to avoid)
    mtp_heads  heads.1.. (the multi-token heads, part of the training loss; not in a PEFT export:
               Hugging Face's models have none)
    norm       every norm's weight (and bias) (PEFT's "norm" matches them all: it matches module names by suffix)

An adapter run directory holds `lora.json` (rank, alpha, targets, dropout, and the base: its path and
the sha256 of its config.json + model.safetensors), `adapter.safetensors` and `tokenizer.json`; with a
training run also `optimizer.safetensors` (moments of the adapters only) and `trainer.json`. Loading
refuses a base whose content changed. `load_merged` gives a plain (config, params): sample, chat, serve,
eval and export run an adapter run through it (merged at load: one matmul per weight, once; then every
token costs exactly what the base costs, where applying the adapter on the fly adds two thin matmuls per
weight per token).
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from .config import Config
from .errors import UserError
from .fileio import LORA_FILE
from .ops import lora_merge

ADAPTER_FILE = "adapter.safetensors"
# modules_to_save name -> the base tensors it trains (a regular expression)
SAVABLE = {"lm_head": r"heads\.0\.weight", "mtp_heads": r"heads\.[1-9]\d*\.weight",
           "norm": r"(layers\.\d+\.[\w.]*)?norm\.(weight|bias)"}
DROPOUT_SITE0 = 1 << 20  # adapter dropout of module j draws the masks of site DROPOUT_SITE0 + j (ops/dropout.py)


# lora.json's fields: the flag that sets each, and the JSON value it must hold (in words; its test). A config's
# errors name the flags, or the file and its fields (LoraConfig.check)
FIELDS = {
    "rank": ("--lora", "an integer", lambda v: type(v) is int),
    "alpha": ("--lora-alpha", "a number", lambda v: type(v) in (int, float)),
    "targets": ("--lora-targets", "a list of names", lambda v: type(v) is list and all(type(n) is str for n in v)),
    "dropout": ("--lora-dropout", "a number", lambda v: type(v) in (int, float)),
    "modules_to_save": ("--lora-modules-to-save", "a list of names",
                        lambda v: type(v) is list and all(type(n) is str for n in v)),
}


@dataclass(frozen=True)
class LoraConfig:
    rank: int
    alpha: float
    targets: tuple[str, ...] = ()   # () = the architecture's lora_defaults (filled in by `check`)
    dropout: float = 0.0
    modules_to_save: tuple[str, ...] = ()   # SAVABLE names: trained whole beside the adapters

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def check(self, cfg: Config, source: str | None = None) -> "LoraConfig":
        """This config for a base of config cfg (default targets filled in), or UserError. source: the
        lora.json it was read from, whose file and fields the errors then name instead of the --lora flags.

            LoraConfig(500, 8.0).check(cfg, "runs/a/lora.json")
            # UserError: runs/a/lora.json: rank must be in [1, 128], got 500
        """
        if not self.targets:
            return replace(self, targets=cfg.spec.lora_defaults).check(cfg, source)
        name = (lambda field: f"{source}: {field}") if source else (lambda field: FIELDS[field][0])
        known = cfg.spec.lora
        bad = [t for t in self.targets if t not in known]
        if bad or len(set(self.targets)) != len(self.targets):
            raise UserError(f"{name('targets')}: {', '.join(bad) or 'a target given twice'}: the targets of arch "
                            f"{cfg.arch} are {','.join(known)}")
        if not 1 <= self.rank <= min(cfg.dim, 4096):
            raise UserError(f"{name('rank')} must be in [1, {min(cfg.dim, 4096)}], got {self.rank}")
        if not self.alpha > 0:
            raise UserError(f"{name('alpha')} must be > 0, got {self.alpha}")
        if not 0.0 <= self.dropout < 1.0:
            raise UserError(f"{name('dropout')} must be in [0, 1), got {self.dropout}")
        check_modules_to_save(cfg, self.modules_to_save, name("modules_to_save"))
        return self

    def to_dict(self) -> dict:
        return asdict(self) | {"targets": list(self.targets), "modules_to_save": list(self.modules_to_save)}


def check_modules_to_save(cfg: Config, names: tuple[str, ...], what: str = "--lora-modules-to-save") -> None:
    """UserError unless every name is a SAVABLE module of this base, given once; `what` names the setting."""
    if not names:
        return
    bad = [n for n in names if n not in SAVABLE]
    if bad or len(set(names)) != len(names):
        raise UserError(f"{what}: {', '.join(map(str, bad)) or 'a module given twice'}: choose from "
                        f"{','.join(SAVABLE)}")
    if "lm_head" in names and cfg.tie_embeddings:
        raise UserError(f"{what} lm_head: this model's output head is its embedding (tied); PEFT "
                        "would train an untied copy of the whole [V, d] embedding, which is what LoRA avoids: "
                        "fine-tune fully, or save only norm")
    if "mtp_heads" in names and cfg.n_mtp == 1:
        raise UserError(f"{what} mtp_heads: this model has no multi-token heads (K = 1)")


def saved_names(cfg: Config, lcfg: LoraConfig) -> list[str]:
    """The base tensors trained whole (modules_to_save), in the config's order.

        saved_names(small, modules_to_save=("lm_head",)) -> ["heads.0.weight"]"""
    pattern = "|".join(SAVABLE[m] for m in lcfg.modules_to_save)
    return [n for n in cfg.param_shapes() if pattern and re.fullmatch(pattern, n)]


def modules(cfg: Config, lcfg: LoraConfig) -> dict[str, tuple[tuple[str, ...], str]]:
    """module name -> (the base weight names it adapts, its Hugging Face module name: PEFT's), in layer order.

        modules(gpt2 config, targets=("c_attn",))
          -> {"layers.0.attn.wqkv": (("layers.0.attn.wq.weight", ...wk..., ...wv...), "h.0.attn.c_attn"), ...}
    """
    hf = {n: e.name for e in cfg.spec.hf.tensors(cfg.n_layers) for n in e.ours}
    out = {}
    for i in range(cfg.n_layers):
        for target in lcfg.targets:
            for module, bases in cfg.spec.lora[target]:
                names = tuple(f"layers.{i}.{b}.weight" for b in bases)
                out[f"layers.{i}.{module}"] = (names, hf[names[0]].removesuffix(".weight"))
    return out


def adapter_shapes(cfg: Config, lcfg: LoraConfig) -> dict[str, tuple[int, int]]:
    """<module>.lora_A -> (r, in), <module>.lora_B -> (Σ out, r), for every module."""
    shapes, out = cfg.param_shapes(), {}
    for module, (bases, _) in modules(cfg, lcfg).items():
        out[module + ".lora_A"] = (lcfg.rank, shapes[bases[0]][1])
        out[module + ".lora_B"] = (sum(shapes[b][0] for b in bases), lcfg.rank)
    return out


def init_adapters(cfg: Config, lcfg: LoraConfig, seed: int = 0, dtype=np.float32,
                  base: dict | None = None) -> dict[str, np.ndarray]:
    """A ~ U(±1/√in) [r, in] (PEFT's kaiming_uniform_(a=√5)), B = 0 [Σ out, r], for every module; and a copy of
    each saved module's tensors from the base params `base` (needed when lcfg.modules_to_save is set)."""
    rng = np.random.default_rng(seed)
    params = {}
    for name, shape in adapter_shapes(cfg, lcfg).items():
        if name.endswith("lora_A"):
            bound = 1.0 / np.sqrt(shape[1])
            params[name] = rng.uniform(-bound, bound, shape).astype(dtype)
        else:
            params[name] = np.zeros(shape, dtype=dtype)
    return params | {n: np.array(base[n], dtype) for n in saved_names(cfg, lcfg)}


def row_slices(cfg: Config, bases: tuple[str, ...]) -> list[slice]:
    """The rows of a stacked module's B that belong to each base weight."""
    shapes, out, r0 = cfg.param_shapes(), [], 0
    for b in bases:
        out.append(slice(r0, r0 + shapes[b][0]))
        r0 += shapes[b][0]
    return out


def merge_params(cfg: Config, params: dict, lcfg: LoraConfig, adapters: dict) -> dict[str, np.ndarray]:
    """The base params with every adapted weight replaced by W + s·B·A and every saved module by its trained
    copy (the others shared, not copied)."""
    merged = dict(params) | {n: adapters[n] for n in saved_names(cfg, lcfg)}
    for module, (bases, _) in modules(cfg, lcfg).items():
        A, B = adapters[module + ".lora_A"], adapters[module + ".lora_B"]
        for name, rows in zip(bases, row_slices(cfg, bases)):
            merged[name] = lora_merge(params[name], A, B[rows], lcfg.scale)
    return merged


def trainable_shapes(cfg: Config, lcfg: LoraConfig) -> dict[str, tuple[int, ...]]:
    """What an adapter run trains: the adapters' shapes and those of the saved modules' tensors."""
    shapes = cfg.param_shapes()
    return adapter_shapes(cfg, lcfg) | {n: shapes[n] for n in saved_names(cfg, lcfg)}


def check_adapters(cfg: Config, lcfg: LoraConfig, adapters: dict, where) -> None:
    if {n: a.shape for n, a in adapters.items()} != trainable_shapes(cfg, lcfg):
        raise UserError(f"{where}: the adapters do not match lora.json and the base's shapes")
    if not all(np.isfinite(a).all() for a in adapters.values()):
        raise UserError(f"{where}: the adapters hold non-finite values")


# ---- the adapter run directory --------------------------------------------------------------------
def is_adapter_run(run_dir) -> bool:
    return (Path(run_dir) / LORA_FILE).is_file()


def base_fingerprint(base_dir, read_only: bool = True) -> str:
    """sha256 of the base checkpoint's config.json and model.safetensors (what the adapters were fit to)."""
    from .checkpoint import check_run_dir, member, read_journal
    base_dir = check_run_dir(base_dir, read_only)
    journal = read_journal(base_dir) if read_only else None
    h = hashlib.sha256()
    for name in ("config.json", "model.safetensors"):
        path = member(base_dir, name, journal)
        if not path.is_file():
            raise UserError(f"base checkpoint {base_dir}: {name} not found")
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                h.update(block)
    return h.hexdigest()


def adapter_writers(lcfg: LoraConfig, base: dict, adapters: dict, tokenizer=None) -> dict:
    """Writers (checkpoint.save_files) of an adapter run. base: {"path", "sha256"}."""
    from .checkpoint import json_writer, tensors_writer
    writers = {LORA_FILE: json_writer(lcfg.to_dict() | {"base": base}),
               ADAPTER_FILE: tensors_writer(adapters, what="refusing to save the adapters")}
    if tokenizer is not None:
        writers["tokenizer.json"] = json_writer(tokenizer.to_dict())
    return writers


def read_adapter_run(run_dir, read_only: bool = False) -> tuple[LoraConfig, dict, dict]:
    """-> (LoraConfig, base {"path", "sha256"}, adapters), every lora.json field of its JSON type (a rank "4"
    or 4.5 is refused, not converted). The base itself is not read (see load_adapter_run)."""
    from .checkpoint import check_run_dir, member, read_journal, read_json, read_tensors
    run_dir = check_run_dir(run_dir, read_only)
    journal = read_journal(run_dir) if read_only else None
    where = run_dir / LORA_FILE
    meta = read_json(member(run_dir, LORA_FILE, journal), "adapter config")
    if type(meta) is not dict:
        raise UserError(f"{where} is not an adapter config (not a JSON object)")
    values = {}
    for key, (_, kind, ok) in FIELDS.items():
        values[key] = meta.get(key, [] if key == "modules_to_save" else None)
        if not ok(values[key]):
            raise UserError(f"{where}: {key} must be {kind}, got {values[key]!r:.60}")
    base = meta.get("base")
    if type(base) is not dict or not all(type(base.get(k)) is str and base[k] for k in ("path", "sha256")):
        raise UserError(f"{where}: base must be {{\"path\": ..., \"sha256\": ...}}, got {base!r:.60}")
    lcfg = LoraConfig(values["rank"], float(values["alpha"]), tuple(values["targets"]), float(values["dropout"]),
                      tuple(values["modules_to_save"]))
    adapters = read_tensors(member(run_dir, ADAPTER_FILE, journal), "adapters")
    return lcfg, {"path": base["path"], "sha256": base["sha256"]}, adapters


def load_base(run_dir, base: dict, mapped: bool = False) -> tuple[Config, dict]:
    """The base checkpoint an adapter run points to, refused when its content is not what was fine-tuned.
    mapped: its params are read-only views of its weights file (checkpoint.map_tensors)."""
    from .checkpoint import load_model
    path = Path(base["path"])
    if is_adapter_run(path):
        raise UserError(f"{run_dir}: its base {path} is itself an adapter run")
    if not path.is_dir():
        raise UserError(f"{run_dir}: its base checkpoint {path} is gone (adapters need the base they were trained on)")
    if base_fingerprint(path) != base["sha256"]:
        raise UserError(f"{run_dir}: the base checkpoint {path} changed since the adapters were trained "
                        f"(sha256 differs); the adapters only fit the original weights")
    return load_model(path, read_only=True, mapped=mapped)


def load_adapter_run(run_dir, read_only: bool = False, mapped: bool = False):
    """An adapter run and its base, each checked against the other: (LoraConfig with its targets filled in,
    base {"path", "sha256"}, adapters, the base's Config, the base's params). mapped: see load_base."""
    lcfg, base, adapters = read_adapter_run(run_dir, read_only)
    cfg, params = load_base(run_dir, base, mapped)
    lcfg = lcfg.check(cfg, f"{run_dir}/{LORA_FILE}")
    check_adapters(cfg, lcfg, adapters, run_dir)
    return lcfg, base, adapters, cfg, params


def load_merged(run_dir, read_only: bool = False) -> tuple[Config, dict]:
    """(config, params) of an adapter run with its adapters merged into the base: a plain model."""
    lcfg, _, adapters, cfg, params = load_adapter_run(run_dir, read_only)
    return cfg, merge_params(cfg, params, lcfg, adapters)


def describe(lcfg: LoraConfig, cfg: Config) -> str:
    """'r=8 α=16 on q,v: 73,728 trainable parameters' (a one-line summary for the CLI), with the saved modules
    ('..., lm_head trained whole: 139,264 trainable parameters')."""
    n = sum(int(np.prod(s)) for s in trainable_shapes(cfg, lcfg).values())
    saved = f", {','.join(lcfg.modules_to_save)} trained whole" if lcfg.modules_to_save else ""
    return f"LoRA r={lcfg.rank} alpha={lcfg.alpha:g} on {','.join(lcfg.targets)}{saved}: {n:,} trainable parameters"
