"""The training loop shared by pretraining and SFT: AdamW, schedule, clipping, eval, checkpoints, resume.

One step reads top to bottom: draw a batch, forward + backward (accumulated over `grad_accum`
micro-batches), clip the global gradient norm, AdamW with the scheduled learning rate, log.
Every `eval_every` steps the head-0 validation loss (and bits per byte, when the data knows its bytes);
every `ckpt_every` steps, on Ctrl-C/SIGTERM and at the end, a checkpoint. A checkpoint holds the model,
the AdamW moments, the RNG state and the step, so `--resume` continues bit-for-bit as if never stopped.

A batch source is any object with
    next_batch(rng) -> (tokens int [B, T+K], loss_mask bool [B, T+K] | None)
    eval_batches()  -> iterable of (tokens, loss_mask)        (the validation set, same every call)
    bytes_per_token: float | None                             (validation bytes / tokens, for bits per byte)
    describe() -> dict                                        (stored in trainer.json; resume checks it)
"""
from __future__ import annotations

import dataclasses
import json
import math
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import checkpoint as ckpt
from .errors import UserError
from .ops import Dropout
from .optim import AdamW, clip_grad_norm, lr_schedule


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
    """A NaN or infinite loss: the run stops and the last good checkpoint stays as it was."""

    def __init__(self, message: str):
        super().__init__(message, exit_code=3)


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
    """Random windows of the train split; validation = sequential windows of the val split (token shards)."""

    def __init__(self, data_dir, batch_size: int, ctx: int, n_mtp: int, eval_batch_size: int | None = None):
        from .shards import TokenShards
        self.train = TokenShards(data_dir, "train")
        self.val = TokenShards(data_dir, "val")
        self.batch_size, self.length = batch_size, ctx + n_mtp
        self.eval_batch_size = eval_batch_size or batch_size
        self.bytes_per_token = self.val.n_bytes / self.val.n_tokens

    def next_batch(self, rng):
        return self.train.sample_batch(rng, self.batch_size, self.length), None  # [B, T+K]

    def eval_batches(self):
        for tokens in self.val.iter_batches(self.eval_batch_size, self.length):
            yield tokens, None

    def describe(self) -> dict:
        return {"tokenizer": self.train.tokenizer_fingerprint, "train_tokens": self.train.n_tokens,
                "val_tokens": self.val.n_tokens, "batch_size": self.batch_size, "length": self.length}


# ---- checkpoints -------------------------------------------------------------------------------
def save_training_checkpoint(out_dir: Path, model, tokenizer, opt: AdamW, state: dict) -> None:
    """model + config + tokenizer + AdamW moments + trainer state, as one atomic unit."""
    opt_tensors, opt_scalars = opt.state_dict()
    params = model.host_params() if hasattr(model, "host_params") else model.params  # device models: host copies
    writers = ckpt.model_writers(model.config, params, tokenizer)
    writers["optimizer.safetensors"] = ckpt.tensors_writer(opt_tensors)
    writers["trainer.json"] = ckpt.json_writer(state | {"optimizer": opt_scalars})
    ckpt.save_files(out_dir, writers)


def load_training_state(out_dir: Path, model, opt: AdamW) -> dict:
    """Restore the AdamW moments of a run into opt; return trainer.json."""
    state = ckpt.read_json(out_dir / "trainer.json", "resume state")
    tensors = ckpt.read_tensors(out_dir / "optimizer.safetensors", "optimizer state")
    for name, p in model.params.items():
        for kind in ("m", "v"):
            t = tensors.get(f"{kind}.{name}")
            if t is None or t.shape != p.shape or t.dtype != p.dtype:
                raise UserError(f"optimizer state in {out_dir} does not match the model ({kind}.{name})")
    opt.load_state_dict(tensors, state["optimizer"])
    return state


# ---- evaluation --------------------------------------------------------------------------------
def evaluate(model, source, max_batches: int = 0) -> dict:
    """Mean head-0 loss over the validation batches (all of them if max_batches is 0), and bits per byte."""
    total, count = 0.0, 0
    for i, (tokens, mask) in enumerate(source.eval_batches()):
        if max_batches and i >= max_batches:
            break
        head0, _ = model.loss(tokens, mask)
        T = tokens.shape[1] - model.config.n_mtp
        n = int(mask[:, 1:T + 1].sum()) if mask is not None else tokens.shape[0] * T  # head-0 targets scored
        total += head0 * n
        count += n
    if count == 0:
        raise UserError("the validation set has no scored tokens")
    loss = total / count
    out = {"val_loss": loss}
    if getattr(source, "bytes_per_token", None):
        out["val_bpb"] = loss / math.log(2) / source.bytes_per_token
    return out


# ---- the loop ----------------------------------------------------------------------------------
def run_training(model, tokenizer, source, out_dir, tcfg: TrainConfig, resume: bool = False,
                 stop_after: int | None = None, progress: bool = True, kind: str = "pretrain") -> dict:
    """Train model in place on batches from source; checkpoints go to out_dir. Returns a summary dict."""
    out_dir = Path(out_dir)
    log_path = out_dir / "log.jsonl"
    # a device model (nanoeuler.gpu.engine.GpuModel) brings its own AdamW, with the moments on the device
    make_opt = getattr(model, "optimizer", None) or (lambda **kw: AdamW(model.params, **kw))
    opt = make_opt(lr=tcfg.lr, betas=(tcfg.beta1, tcfg.beta2), weight_decay=tcfg.weight_decay)
    rng = np.random.default_rng(tcfg.seed)
    state = {"kind": kind, "step": 0, "train_config": dataclasses.asdict(tcfg), "data": source.describe(),
             "tokens_seen": 0, "elapsed_s": 0.0, "skipped_batches": 0}
    if resume:
        state = resume_state(out_dir, model, opt, tcfg, source, kind)
        rng.bit_generator.state = state["rng"]
        state["train_config"] = dataclasses.asdict(tcfg)
        truncate_log(log_path, state["step"])
    elif (out_dir / "trainer.json").exists():
        raise UserError(f"{out_dir} already holds a training run; use --resume to continue it or choose another --out")
    out_dir.mkdir(parents=True, exist_ok=True)
    if tcfg.batch_size % tcfg.grad_accum:
        raise UserError(f"--batch-size {tcfg.batch_size} is not divisible by --grad-accum {tcfg.grad_accum}")
    if tcfg.dropout and hasattr(model, "host_params"):
        raise UserError("--dropout is not implemented on the GPU engine; train there with --dropout 0")

    def checkpoint():
        state["rng"] = rng.bit_generator.state
        save_training_checkpoint(out_dir, model, tokenizer, opt, state)

    from .perf import matmul_peak_flops, mfu
    peak = matmul_peak_flops()
    n_params = model.n_params()
    start_step, last = state["step"], state["step"] + (stop_after or tcfg.steps)
    end = min(tcfg.steps, last)
    bar = make_bar(progress, start_step, tcfg.steps, kind)
    metrics: dict = {}
    with StopRequest() as stop, open(log_path, "a") as log:
        t_run = time.perf_counter()
        for step in range(start_step, end):
            t0 = time.perf_counter()
            lr = lr_schedule(step, tcfg.lr, tcfg.warmup, tcfg.steps, tcfg.final_lr_frac)
            loss, objective, grads, n_tokens, skipped = accumulate(model, source, rng, tcfg.grad_accum, tcfg.dropout)
            state["skipped_batches"] += skipped
            if not (math.isfinite(loss) and math.isfinite(objective)):
                raise TrainingDiverged(f"loss became {loss} at step {step + 1}; stopped without saving — the last "
                                       f"good checkpoint in {out_dir} is untouched (try a lower --lr)")
            grad_norm = clip_grad_norm(grads, tcfg.grad_clip) if grads else 0.0
            if grads:
                opt.step(model.params, grads, lr=lr)
            dt = time.perf_counter() - t0
            state["step"] = step + 1
            state["tokens_seen"] += n_tokens
            state["elapsed_s"] += dt
            tok_s = n_tokens / dt
            metrics = {"step": step + 1, "loss": loss, "objective": objective, "lr": lr, "grad_norm": grad_norm,
                       "tokens_per_s": tok_s, "mfu": mfu(n_params, tok_s, peak), "elapsed_s": state["elapsed_s"]}
            if (step + 1) % tcfg.eval_every == 0 or step + 1 == tcfg.steps:
                metrics |= evaluate(model, source, 0 if step + 1 == tcfg.steps else tcfg.eval_batches)
                state["last_eval"] = {k: v for k, v in metrics.items() if k.startswith("val_")}
            log.write(json.dumps(metrics) + "\n")
            log.flush()
            if bar is not None:
                bar.update(1)
                bar.set_postfix(postfix(metrics), refresh=False)
            if (step + 1) % tcfg.ckpt_every == 0 or step + 1 in (end, tcfg.steps) or stop.requested:
                checkpoint()
            if stop.requested:
                break
        if bar is not None:
            bar.close()
    if state["step"] == start_step and start_step < end:
        checkpoint()
    interrupted = stop.requested
    finished = state["step"] >= tcfg.steps
    if finished:
        plot_curves(log_path, out_dir / "curves.png")
    return {"step": state["step"], "steps": tcfg.steps, "finished": finished, "interrupted": interrupted,
            "wall_s": time.perf_counter() - t_run, "skipped_batches": state["skipped_batches"], **metrics}


def accumulate(model, source, rng, grad_accum: int, dropout: float = 0.0):
    """Gradients averaged over grad_accum micro-batches; a micro-batch with no trainable position is skipped.
    With dropout, each micro-batch's masks come from a seed drawn from rng after its batch (so a run
    without dropout draws exactly what it did before dropout existed)."""
    losses, objectives, grads, n_tokens, used, skipped = [], [], None, 0, 0, 0
    for _ in range(grad_accum):
        tokens, mask = source.next_batch(rng)
        drop = Dropout(dropout, int(rng.integers(1 << 63))) if dropout else None
        n_tokens += tokens.shape[0] * (tokens.shape[1] - model.config.n_mtp)
        if mask is not None and not mask[:, 1:].any():
            skipped += 1
            continue
        head0, objective, g = model.loss_and_grads(tokens, mask, dropout=drop)
        losses.append(head0)
        objectives.append(objective)
        used += 1
        if grads is None:
            grads = g
        else:
            for name in grads:
                grads[name] += g[name]
    if used > 1:
        for g in grads.values():
            g *= g.dtype.type(1.0 / used)
    if not used:
        return 0.0, 0.0, None, n_tokens, skipped
    return float(np.mean(losses)), float(np.mean(objectives)), grads, n_tokens, skipped


def resume_state(out_dir: Path, model, opt, tcfg: TrainConfig, source, kind: str) -> dict:
    """Load trainer.json + optimizer and refuse a run that is not the same run."""
    if not (out_dir / "trainer.json").exists():
        raise UserError(f"nothing to resume in {out_dir} (no trainer.json); start without --resume")
    state = load_training_state(out_dir, model, opt)
    if state.get("kind") != kind:
        raise UserError(f"{out_dir} is a {state.get('kind')} run, not {kind}")
    diff = changed_settings(state["train_config"], tcfg)
    if diff:
        raise UserError(f"cannot resume {out_dir} with different settings: " + ", ".join(diff))
    if state["data"] != source.describe():
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
    if not log_path.exists():
        return
    lines = [ln for ln in log_path.read_text().splitlines() if ln.strip()]
    kept = [ln for ln in lines if json.loads(ln).get("step", 0) <= step]
    log_path.write_text("".join(ln + "\n" for ln in kept))


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
    from .fileio import atomic_path
    with atomic_path(png_path) as tmp:
        fig.savefig(tmp, format="png", dpi=100)
    plt.close(fig)
