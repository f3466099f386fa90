"""The one training loop of pretraining, SFT and DPO: AdamW, schedule, clipping, eval, checkpoints, resume.

One step reads top to bottom: draw a batch, forward + backward (accumulated over `grad_accum`
micro-batches), clip the global gradient norm, AdamW with the scheduled learning rate, log.
Every `eval_every` steps the objective's validation metrics; every `ckpt_every` steps, on Ctrl-C/SIGTERM
and at the end, a checkpoint. A checkpoint holds the model, the AdamW moments, the RNG state and the
step (and what the objective adds, e.g. DPO's reference log-probs), so `--resume` continues bit-for-bit
as if never stopped. Under MPI (`mpiexec -n N`, see dist.py) every rank runs this same loop on its
share of each batch; rank 0 alone logs and writes.

The model is any `trainable.Trainable` (`Model`, `lora.LoraModel`, `gpu.engine.GpuModel`): the loop asks it
for its optimizer, its checkpoint files, its precision, never what kind of model it is.
What is trained is an *objective* (`LMObjective` here for pretraining and SFT, `dpo.DPOObjective`):

    model                           the Trainable it trains
    params                          the arrays AdamW updates (same objects as the model's)
    draw(rng) -> batch              one micro-batch, drawn with the run's rng (every rank draws the same)
    skip(batch) -> bool             nothing to learn from it (counted, no gradient)
    count(batch) -> int             units seen (tokens, pairs) for throughput
    share(batch, rank, n) -> part   this rank's rows, scaled so that the n parts' losses and gradients sum
                                    to the whole batch's
    loss_and_grads(batch) -> (loss, metrics, grads)
    evaluate(max_batches) -> dict   validation metrics, keys starting with val_
    new_state() / resume(state, out_dir) / changed_settings(state)    the run's own fields in trainer.json
    checkpoint_tensors() -> {file name: tensors}                       extra files of a checkpoint
    describe() -> dict              the data, stored in trainer.json; resume checks it

A batch source for `LMObjective` is any object with
    next_batch(rng) -> (tokens int [B, T+K], loss_mask bool [B, T+K] | None)
    eval_batches()  -> iterable of (tokens, loss_mask)        (the validation set, same every call)
    bytes_per_token: float | None                             (validation bytes / tokens, for bits per byte)
    describe() -> dict                                        (stored in trainer.json; resume checks it)
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .. import checkpoint as ckpt
from ..errors import UserError
from ..fileio import atomic_path, atomic_write_text, check_real_dir, open_append, own_file
from ..ops import Dropout
from ..optim import clip_grad_norm, lr_schedule
from .trainable import Trainable


@dataclass(frozen=True)
class TrainConfig:
    """Hyper-parameters of a run; stored in trainer.json, and a resumed run must use the same."""
    steps: int = 2000            # planned total: the cosine schedule depends on it, not on when a run stops
    batch_size: int = 32
    grad_accum: int = 1
    lr: float = 3e-3
    warmup: int = 100
    final_lr_frac: float = 0.1
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    dropout: float = 0.0         # on every residual branch, training only (ops/dropout.py); 0 = none
    seed: int = 0
    eval_every: int = 250
    eval_batches: int = 16       # validation batches per periodic eval (0 = the whole validation set)
    ckpt_every: int = 500

    def __post_init__(self):
        for f in dataclasses.fields(self):     # a trainer.json edited by hand: one line, not a TypeError
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, int if f.type == "int" else (int, float)) \
                    or not math.isfinite(v):
                raise UserError(f"train_config: {f.name} must be a finite {'integer' if f.type == 'int' else 'number'}"
                                f", got {v!r:.60}")
        for name in ("steps", "batch_size", "grad_accum", "eval_every", "ckpt_every"):
            if getattr(self, name) < 1:
                raise UserError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if not self.lr > 0 or self.warmup < 0 or self.eval_batches < 0:
            raise UserError("--lr must be > 0, --warmup and --eval-batches >= 0")
        if not 0.0 <= self.dropout < 1.0:
            raise UserError(f"--dropout must be in [0, 1), got {self.dropout}")


# Settings that do not change the trajectory of a run, so a resumed run may change them.
FREE_ON_RESUME = ("eval_every", "eval_batches", "ckpt_every")


class TrainingDiverged(UserError):
    """A NaN or infinite loss: the run stops and the last good checkpoint stays as it was.
    Collective (see dist.collective): the loss is summed over the ranks, so every rank raises it together."""
    collective = True

    def __init__(self, message: str):
        super().__init__(message, exit_code=3)


@contextlib.contextmanager
def sigterm_as_ctrl_c():
    """SIGTERM (`kill`, a scheduler stopping the job) acts as Ctrl-C for the length of the block. Outside
    the training loop (loading, rendering data, a first evaluation, the last plot) its KeyboardInterrupt
    unwinds every `with`: the run lock is released and no file is left half-written; inside the loop
    `StopRequest` turns either into a stop after the step."""
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class StopRequest:
    """Turns the first SIGINT/SIGTERM into a flag checked between steps (a second one interrupts at once)."""

    def __init__(self):
        self.requested = None
        self._previous = {}

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.requested is not None:
            raise KeyboardInterrupt
        self.requested = signal.Signals(signum).name

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


class PretrainSource:
    """Random windows of the train split; validation = sequential windows of the val split (token shards).

    bos: the token the model's tokenizer starts a text with (Gemma's <bos>; None: none). Such a model is lost
    without it (Gemma 3 270M on the held-out works: 2.17 bits/byte, 1.68 with it), so it replaces the first
    token of every window, training and validation alike, as llama.cpp's perplexity does: the targets stay
    the window's tokens 1.., and the first one is predicted from <bos> alone."""

    def __init__(self, data_dir, batch_size: int, ctx: int, n_mtp: int, eval_batch_size: int | None = None,
                 bos: int | None = None):
        from ..data.shards import TokenShards
        self.train = TokenShards(data_dir, "train")
        self.val = TokenShards(data_dir, "val")
        self.batch_size, self.length = batch_size, ctx + n_mtp
        self.eval_batch_size = eval_batch_size or batch_size
        self.bytes_per_token = self.val.n_bytes / self.val.n_tokens
        self.bos = bos

    def _starting(self, tokens: np.ndarray) -> np.ndarray:
        """tokens [B, T+K] with bos first in every row (a copy), or as they are without a bos."""
        if self.bos is None:
            return tokens
        tokens = tokens.copy()
        tokens[:, 0] = self.bos
        return tokens

    def next_batch(self, rng):
        return self._starting(self.train.sample_batch(rng, self.batch_size, self.length)), None  # [B, T+K]

    def eval_batches(self):
        for tokens in self.val.iter_batches(self.eval_batch_size, self.length):
            yield self._starting(tokens), None

    def describe(self) -> dict:
        return {"tokenizer": self.train.tokenizer_fingerprint, "train_tokens": self.train.n_tokens,
                "val_tokens": self.val.n_tokens, "batch_size": self.batch_size, "length": self.length}


# ---- the objective of pretraining and SFT ------------------------------------------------------
@dataclass(frozen=True)
class RowDropout(Dropout):
    """The dropout of rows [row_offset, ...) of a batch: the masks of those rows in the whole batch, so a
    rank that holds rows 4..7 drops exactly what one process holding rows 0..7 drops there."""
    row_offset: int = 0

    def base(self, site: int, row0: int, width: int) -> int:
        return super().base(site, row0 + self.row_offset, width)


@dataclass
class LMPart:
    """A rank's share of a micro-batch: its rows, and the target counts of the whole micro-batch."""
    tokens: np.ndarray
    mask: np.ndarray | None
    seed: int | None
    row0: int
    counts: list


class LMObjective:
    """Next-token (multi-token-prediction) loss of token rows, masked (SFT) or not (pretraining)."""
    unit = "tokens"
    metric_names = ("loss", "objective")
    loss_label = "loss"

    def __init__(self, model: Trainable, source, tcfg: TrainConfig):
        self.model, self.source, self.dropout = model, source, tcfg.dropout
        self.adapter_dropout = model.adapter_dropout
        self.params = model.params
        if tcfg.dropout and model.device != "cpu":
            raise UserError("--dropout is not implemented on the GPU engine; train there with --dropout 0")

    def describe(self) -> dict:
        return self.source.describe()

    def new_state(self) -> dict:
        return {"tokens_seen": 0, "skipped_batches": 0}

    def resume(self, state: dict, out_dir: Path) -> None:
        pass

    def changed_settings(self, state: dict) -> list[str]:
        return []

    def draw(self, rng):
        """-> (tokens [B, T+K], mask | None, dropout seed | None). With dropout (residual or adapter) the seed
        is drawn from rng after the batch, so the batches are the same with dropout and without."""
        tokens, mask = self.source.next_batch(rng)
        return tokens, mask, (int(rng.integers(1 << 63)) if self.dropout or self.adapter_dropout else None)

    def count(self, batch) -> int:
        tokens = batch[0]
        return tokens.shape[0] * (tokens.shape[1] - self.model.config.n_mtp)

    def skip(self, batch) -> bool:
        mask = batch[1]
        return mask is not None and not mask[:, 1:].any()

    def rows(self, batch) -> int:
        return batch[0].shape[0]

    def share(self, batch, rank: int, n: int) -> LMPart:
        tokens, mask, seed = batch
        B, K = tokens.shape[0], self.model.config.n_mtp
        T = tokens.shape[1] - K
        from ..ops import mtp_targets
        targets = mtp_targets(tokens, T, K, mask)                      # [K, B, T]
        counts = [int(np.count_nonzero(targets[k] >= 0)) for k in range(K)]
        lo, hi = B * rank // n, B * (rank + 1) // n
        return LMPart(tokens[lo:hi], None if mask is None else mask[lo:hi], seed, lo * T, counts)

    def loss_and_grads(self, batch):
        if isinstance(batch, LMPart):
            tokens, mask, seed, row0, kw = batch.tokens, batch.mask, batch.seed, batch.row0, {"counts": batch.counts}
        else:
            (tokens, mask, seed), row0, kw = batch, 0, {}
        if seed is not None and self.adapter_dropout:
            kw["adapter_dropout"] = RowDropout(self.adapter_dropout, seed, row0)
        drop = RowDropout(self.dropout, seed, row0) if seed is not None and self.dropout else None
        head0, objective, grads = self.model.loss_and_grads(tokens, mask, dropout=drop, **kw)
        return head0, {"objective": objective}, grads

    def evaluate(self, max_batches: int) -> dict:
        return evaluate(self.model, self.source, max_batches)

    def rates(self, n: int, dt: float) -> dict:
        """tokens/s and MFU: against the peak of the run's precision (bf16: the bf16 kernels'), counting 6·N
        flops a token, or 4·N for LoRA (its frozen weights get no dW)."""
        from ..perf import mfu
        tok_s = n / dt
        if not hasattr(self, "_peak"):
            if getattr(self.model, "precision", "f32") == "bf16":
                from ..fast.bf16 import peak_flops
            else:
                from ..perf import matmul_peak_flops as peak_flops
            self._peak, self._n_params = peak_flops(), self.model.n_params()
            self._passes = 4 if getattr(self.model, "lcfg", None) is not None else 6
        return {"tokens_per_s": tok_s, "mfu": mfu(self._n_params, tok_s, self._peak, self._passes)}

    def postfix(self, m: dict) -> dict:
        return postfix(m)

    def checkpoint_tensors(self) -> dict:
        return {}

    def summary(self, state: dict) -> dict:
        return {"skipped_batches": state["skipped_batches"]}

    def plot(self, log_path: Path, png_path: Path) -> None:
        plot_curves(log_path, png_path)


# ---- checkpoints -------------------------------------------------------------------------------
def save_training_checkpoint(out_dir: Path, model: Trainable, tokenizer, opt, state: dict, extra: dict | None = None) -> None:
    """model + config + tokenizer + AdamW moments + trainer state (+ extra {file: tensors}), one atomic unit.
    Extra files may hold NaN as a marker (DPO's not-yet-drawn log-probs); weights and moments may not."""
    opt_tensors, opt_scalars = opt.state_dict()
    writers = model.checkpoint_writers(tokenizer)
    writers["optimizer.safetensors"] = ckpt.optimizer_writer(opt_tensors)
    for name, tensors in (extra or {}).items():
        writers[name] = ckpt.tensors_writer(tensors, allow_nonfinite=True)
    writers["trainer.json"] = ckpt.json_writer(state | {"optimizer": opt_scalars})
    ckpt.save_files(out_dir, writers)


def load_training_state(out_dir: Path, model, opt) -> dict:
    """Restore the AdamW moments of a run into opt (for the arrays model.params); return trainer.json."""
    state = ckpt.read_json(out_dir / "trainer.json", "resume state")
    ckpt.check_trainer_state(state, out_dir / "trainer.json")
    tensors = ckpt.read_tensors(out_dir / "optimizer.safetensors", "optimizer state")
    for name, p in model.params.items():
        for kind in ("m", "v"):
            t = tensors.get(f"{kind}.{name}")
            if t is None or t.shape != p.shape or t.dtype != p.dtype:
                raise UserError(f"optimizer state in {out_dir} does not match the model ({kind}.{name})")
    opt.load_state_dict(tensors, state["optimizer"])
    return state


# ---- evaluation --------------------------------------------------------------------------------
def evaluate(model, source, max_batches: int = 0, score=None) -> dict:
    """Mean head-0 loss over the validation batches (all of them if max_batches is 0), bits per byte, and
    the number of targets scored.
    score(tokens [B, T+1], mask or None) -> the summed head-0 loss of the batch's targets (eval --dtype: the
    decoding step's, infer/session.head0_loss_sum); None: the training forward's."""
    total, count = 0.0, 0
    for i, (tokens, mask) in enumerate(source.eval_batches()):
        if max_batches and i >= max_batches:
            break
        T = tokens.shape[1] - model.config.n_mtp
        n = int(mask[:, 1:T + 1].sum()) if mask is not None else tokens.shape[0] * T  # head-0 targets scored
        total += model.loss(tokens, mask)[0] * n if score is None else score(tokens[:, :T + 1], mask)
        count += n
    if count == 0:
        raise UserError("the validation set has no scored tokens")
    loss = total / count
    out = {"val_loss": loss, "val_tokens": count}
    if getattr(source, "bytes_per_token", None):
        out["val_bpb"] = loss / math.log(2) / source.bytes_per_token
    return out


# ---- the loop ----------------------------------------------------------------------------------
def run_training(model: Trainable, tokenizer, source, out_dir, tcfg: TrainConfig, resume: bool = False,
                 stop_after: int | None = None, progress: bool = True, kind: str = "pretrain",
                 objective=None) -> dict:
    """Train model in place on `objective` (default: `LMObjective` on batches from source); checkpoints go
    to out_dir. Returns a summary dict. Under MPI every rank calls this with the same arguments."""
    from . import dist
    comm = dist.world()
    lead = comm.rank == 0
    obj = objective or LMObjective(model, source, tcfg)
    out_dir = Path(out_dir)
    log_path = out_dir / "log.jsonl"
    if tcfg.batch_size % tcfg.grad_accum:
        raise UserError(f"--batch-size {tcfg.batch_size} is not divisible by --grad-accum {tcfg.grad_accum}")
    opt = model.optimizer(obj.params, lr=tcfg.lr, betas=(tcfg.beta1, tcfg.beta2), weight_decay=tcfg.weight_decay)
    rng = np.random.default_rng(tcfg.seed)
    check_real_dir(out_dir)
    if not resume:
        check_fresh_run_dir(out_dir)
    with contextlib.ExitStack() as stack:
        if lead:
            stack.enter_context(ckpt.run_lock(out_dir))
        precision = model.precision
        if resume:
            state = resume_state(out_dir, obj, opt, tcfg, kind)
            if state.setdefault("precision", precision) != precision:   # it would not resume bit for bit
                raise UserError(f"{out_dir} was trained with precision {state['precision']}, not {precision}")
            rng.bit_generator.state = state["rng"]
            state["train_config"] = dataclasses.asdict(tcfg)
            obj.resume(state, out_dir)
        else:
            state = {"kind": kind, "step": 0, "train_config": dataclasses.asdict(tcfg), "data": obj.describe(),
                     "elapsed_s": 0.0, "precision": precision} | obj.new_state()
        trainer = dist.Trainer(comm, obj, opt, tcfg, state, rng)  # one process: plain; MPI: checks the ranks agree
        if lead:
            out_dir.mkdir(parents=True, exist_ok=True)
            truncate_log(log_path, state["step"])     # a fresh run: the lines of one that never saved go
        log = stack.enter_context(open_append(log_path)) if lead else None
        return _loop(model, tokenizer, obj, opt, trainer, out_dir, log, tcfg, state, rng, stop_after,
                     progress and lead, kind)


RUN_OWN_FILES = ("log.jsonl", "curves.png")   # what a run writes besides its checkpoint (dot files aside)


def check_fresh_run_dir(out_dir: Path) -> None:
    """A new run goes into a new or empty directory (or one left by a run that never saved): its files
    would replace whatever model.safetensors, tokenizer.json ... lie there."""
    if (out_dir / "trainer.json").exists():
        raise UserError(f"{out_dir} already holds a training run; use --resume to continue it or choose another --out")
    if not out_dir.is_dir():
        return
    foreign = sorted(p.name for p in out_dir.iterdir() if not p.name.startswith(".") and p.name not in RUN_OWN_FILES)
    if foreign:
        raise UserError(f"--out {out_dir} already holds files that are not a training run's ({', '.join(foreign[:3])}"
                        f"{', ...' if len(foreign) > 3 else ''}); choose a new or empty --out")


def _loop(model, tokenizer, obj, opt, trainer, out_dir, log, tcfg, state, rng, stop_after, progress, kind) -> dict:
    lead = trainer.comm.rank == 0
    log_path = out_dir / "log.jsonl"

    def checkpoint():
        state["rng"] = rng.bit_generator.state
        trainer.save(lambda o: save_training_checkpoint(out_dir, model, tokenizer, o, state,
                                                         obj.checkpoint_tensors()))

    start_step = state["step"]
    end = min(tcfg.steps, start_step + (stop_after or tcfg.steps))
    bar = make_bar(progress, start_step, tcfg.steps, kind)
    metrics: dict = {}
    t_run = time.perf_counter()
    with StopRequest() as stop:
        for step in range(start_step, end):
            t0 = time.perf_counter()
            lr = lr_schedule(step, tcfg.lr, tcfg.warmup, tcfg.steps, tcfg.final_lr_frac)
            m, grads, n_units, skipped = accumulate(obj, rng, tcfg.grad_accum, trainer)
            stopping = trainer.agree_stop(stop.requested)  # any rank's Ctrl-C stops every rank, after this step
            if "skipped_batches" in state:
                state["skipped_batches"] += skipped
            bad = [k for k, v in m.items() if not math.isfinite(v)]
            if bad:
                key = "loss" if "loss" in bad else bad[0]
                label = obj.loss_label if key == "loss" else key
                raise TrainingDiverged(f"{label} became {m[key]} at step {step + 1}; stopped without saving — the last "
                                       f"good checkpoint in {out_dir} is untouched (try a lower --lr)")
            grad_norm = trainer.step(grads, lr)
            dt = time.perf_counter() - t0
            state["step"] = step + 1
            state[f"{obj.unit}_seen"] += n_units
            state["elapsed_s"] += dt
            metrics = {"step": step + 1, **m, "lr": lr, "grad_norm": grad_norm, **obj.rates(n_units, dt),
                       "elapsed_s": state["elapsed_s"]}
            if lead and ((step + 1) % tcfg.eval_every == 0 or step + 1 == tcfg.steps):
                metrics |= obj.evaluate(0 if step + 1 == tcfg.steps else tcfg.eval_batches)
                state["last_eval"] = {k: v for k, v in metrics.items() if k.startswith("val_")}
            if lead:
                log.write(json.dumps(metrics) + "\n")
                log.flush()
            if bar is not None:
                bar.update(1)
                bar.set_postfix(obj.postfix(metrics), refresh=False)
            if (step + 1) % tcfg.ckpt_every == 0 or step + 1 in (end, tcfg.steps) or stopping:
                checkpoint()
            if stopping:
                stop.requested = stop.requested or stopping
                break
        if bar is not None:
            bar.close()
    if state["step"] == start_step and start_step < end:
        checkpoint()
    finished = state["step"] >= tcfg.steps
    if finished and lead:
        obj.plot(log_path, out_dir / "curves.png")
    return {"step": state["step"], "steps": tcfg.steps, "finished": finished, "interrupted": stop.requested,
            "wall_s": time.perf_counter() - t_run, **obj.summary(state), **metrics}


def accumulate(obj, rng, grad_accum: int, trainer=None):
    """Gradients averaged over grad_accum micro-batches; a micro-batch with nothing to learn is skipped.
    -> (metrics averaged over the micro-batches used, grads | None, units seen, micro-batches skipped).
    With a data-parallel trainer each rank computes its share of every micro-batch and the shares are
    summed over the ranks (dist.py) before the average."""
    parts, grads, n_units, skipped = [], None, 0, 0
    for _ in range(grad_accum):
        batch = obj.draw(rng)
        n_units += obj.count(batch)
        if obj.skip(batch):
            skipped += 1
            continue
        hook = None
        if trainer is not None and trainer.size > 1:
            batch = obj.share(batch, trainer.rank, trainer.size)
            if _ == grad_accum - 1:
                hook = trainer.expect(grads)  # buckets go out while backward runs (dist.py)
        with hook or contextlib.nullcontext():
            loss, m, g = obj.loss_and_grads(batch)
        parts.append({"loss": loss, **m})
        if grads is None:
            grads = g
        else:
            for name in grads:
                grads[name] += g[name]
    if trainer is not None and trainer.size > 1:
        grads, parts = trainer.reduce(grads, parts, obj)
    used = len(parts)
    if used > 1:
        for g in grads.values():
            g *= g.dtype.type(1.0 / used)
    if not used:
        return {k: 0.0 for k in obj.metric_names}, None, n_units, skipped
    return {k: float(np.mean([p[k] for p in parts])) for k in parts[0]}, grads, n_units, skipped


def resume_state(out_dir: Path, obj, opt, tcfg: TrainConfig, kind: str) -> dict:
    """Load trainer.json + optimizer and refuse a run that is not the same run."""
    from types import SimpleNamespace
    if not (out_dir / "trainer.json").exists():
        raise UserError(f"nothing to resume in {out_dir} (no trainer.json); start without --resume")
    state = load_training_state(out_dir, SimpleNamespace(params=obj.params), opt)
    if state.get("kind") != kind:
        raise UserError(f"{out_dir} is a {state.get('kind')} run, not {kind}")
    diff = changed_settings(state["train_config"], tcfg) + obj.changed_settings(state)
    if diff:
        raise UserError(f"cannot resume {out_dir} with different settings: " + ", ".join(diff))
    if state["data"] != obj.describe():
        raise UserError(f"cannot resume {out_dir}: the data differs from the run's ({state['data']})")
    return state


def changed_settings(saved: dict, tcfg: TrainConfig) -> list[str]:
    """The settings of tcfg that differ from a run's saved train_config ('lr 0.003 -> 0.005'), leaving out
    those a resumed run may change. A setting the saved run predates had its default value."""
    saved = dataclasses.asdict(TrainConfig()) | saved
    return [f"{k} {saved[k]} -> {v}" for k, v in dataclasses.asdict(tcfg).items()
            if saved[k] != v and k not in FREE_ON_RESUME]


def truncate_log(log_path: Path, step: int) -> None:
    """Drop log lines written after the checkpoint we resume from (they will be written again)."""
    if not own_file(log_path).exists():
        return
    kept, junk = [], 0
    for ln in log_path.read_bytes().decode("utf-8", "replace").splitlines():   # a damaged log is no reason to stop
        try:
            row = json.loads(ln) if ln.strip() else None
        except (ValueError, RecursionError):
            row = None
        if isinstance(row, dict) and isinstance(row.get("step", 0), int) and row.get("step", 0) <= step:
            kept.append(ln)
        elif ln.strip() and not (isinstance(row, dict) and isinstance(row.get("step"), int)):
            junk += 1
    if junk:
        print(f"warning: dropped {junk} unreadable line(s) of {log_path}", file=sys.stderr)
    atomic_write_text(log_path, "".join(ln + "\n" for ln in kept))


def make_bar(progress: bool, start: int, total: int, desc: str):
    if not progress:
        return None
    from tqdm import tqdm
    return tqdm(total=total, initial=start, desc=desc, unit="step", dynamic_ncols=True)


def postfix(m: dict) -> dict:
    out = {"loss": f"{m['loss']:.3f}", "tok/s": f"{m['tokens_per_s']:.0f}", "mfu": f"{m['mfu']:.2f}"}
    if "val_bpb" in m:
        out["val_bpb"] = f"{m['val_bpb']:.3f}"
    elif "val_loss" in m:
        out["val"] = f"{m['val_loss']:.3f}"
    return out


def read_log(log_path: Path) -> list[dict]:
    return [json.loads(ln) for ln in Path(log_path).read_text().splitlines() if ln.strip()]


def plot_curves(log_path: Path, png_path: Path) -> None:
    """Train loss (head 0) and validation loss/bpb against wall-clock seconds, as a PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = read_log(log_path)
    if not rows:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    t = [r["elapsed_s"] for r in rows]
    ax.plot(t, [r["loss"] for r in rows], lw=0.8, alpha=0.7, label="train loss (head 0, nats)")
    val = [r for r in rows if "val_loss" in r]
    if val:
        ax.plot([r["elapsed_s"] for r in val], [r["val_loss"] for r in val], "o-", label="val loss (nats)")
    if any("val_bpb" in r for r in val):
        ax.plot([r["elapsed_s"] for r in val], [r["val_bpb"] for r in val], "s-", label="val bits/byte")
    ax.set_xlabel("training seconds")
    ax.set_title(png_path.parent.name)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    with atomic_path(png_path) as tmp:
        fig.savefig(tmp, format="png", dpi=100)
    plt.close(fig)
