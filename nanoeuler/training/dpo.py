"""Direct preference optimisation (DPO): the loss, its hand-written gradient, the pair data and the loop.

Given a prompt x with a preferred response y_c ("chosen") and a dispreferred one y_r ("rejected"), DPO
trains a policy π, initialised from the SFT model, against the frozen SFT model as reference:

    z    = β · ((log π(y_c|x) − log ref(y_c|x)) − (log π(y_r|x) − log ref(y_r|x)))
    loss = −log σ(z)  (mean over pairs)

log π(y|x) is the summed log-probability of the response tokens (and </s>) under head 0 — the same
positions the SFT loss covers. β·(log π − log ref) is the "implicit reward" of a response; the reward
margin is chosen reward − rejected reward = z, and preference accuracy during training is the fraction
of pairs with z > 0. With the policy equal to the reference, z = 0 and the loss is exactly log 2.

The gradient flows in two hand-written steps, each an ops-style forward/backward pair:

    dpo_loss:          dL/dz = −σ(−z)/N;  d/dπ_c = β·dL/dz,  d/dπ_r = −β·dL/dz        (per pair)
    response_logprobs: d/dlogits[b, t] = dlogp[b] · mask[b, t] · (onehot(target) − softmax(logits[b, t]))

and then `model.backward` carries the head-0 logit gradient down to every parameter. `check.check_dpo`
is the float64 finite-difference check of all of it.

Only head 0 and the trunk are trained: the MTP heads 1..K-1 get no DPO signal and stay frozen (not even
weight decay touches them). The reference log-probs never change, so they are computed once at the start
and stored with every checkpoint (`reference.safetensors`); a resumed run does not need the SFT run again.

The pair data (files, tokenizing, batches, the offline set, on-policy negatives) is in dpo_data.py;
training runs in the one loop of train.py, with `DPOObjective` as its objective.
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .dpo_data import (PairBatch, TokenizedPairs, load_pairs, make_batch, model_negatives,  # noqa: F401
                       offline_pairs, pair_problem, pair_records, split_pairs, tokenize_pairs, tokenize_response)
from ..errors import UserError
from .lora import LoraModel


# ---- the loss: an ops-style forward/backward pair ------------------------------------------------
def dpo_loss_forward(policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps, beta):
    """Four arrays [N] of summed response log-probs, beta > 0 -> (mean DPO loss, cache).

        dpo_loss_forward([-3.0], [-5.0], [-3.0], [-5.0], 0.1)[0] == log 2      (policy == reference)
        dpo_loss_forward([-2.0], [-6.0], [-3.0], [-5.0], 0.1)[0] == −log σ(0.2) ≈ 0.598
    """
    pc, pr, rc, rr = (np.asarray(a, dtype=np.float64) for a in
                      (policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps))
    z = beta * ((pc - rc) - (pr - rr))  # [N] reward margins
    losses = np.logaddexp(0.0, -z)      # −log σ(z) = log(1 + e^−z), stable for any z
    return float(losses.mean()), (z, beta)


def dpo_loss_backward(dloss, cache):
    """dloss scalar -> (d policy_chosen, d policy_rejected, d ref_chosen, d ref_rejected), each [N]."""
    z, beta = cache
    dz = -dloss * np.exp(-np.logaddexp(0.0, z)) / z.size  # dL/dz = −σ(−z)/N, σ(−z) = e^{−log(1+e^z)}
    return beta * dz, -beta * dz, -beta * dz, beta * dz


def dpo_metrics(z: np.ndarray, policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta) -> dict:
    """Rewards β·(π − ref), their margin (= z), and the fraction of pairs with chosen reward > rejected."""
    chosen_r = beta * (np.asarray(policy_chosen) - ref_chosen)
    rejected_r = beta * (np.asarray(policy_rejected) - ref_rejected)
    return {"reward_chosen": float(chosen_r.mean()), "reward_rejected": float(rejected_r.mean()),
            "reward_margin": float(z.mean()), "reward_accuracy": float((z > 0).mean())}


# ---- summed log-probs of the response: an ops-style pair ----------------------------------------
def response_logprobs_forward(logits_head0, targets, mask):
    """logits [B, T, V], targets int [B, T], mask [B, T] (1 = a response token or </s>)
    -> (summed log-probs per sequence [B], cache). Targets at masked-out positions are ignored.

        logits of one position [0, log 3] (probs 1/4, 3/4), target 1, mask 1  ->  log(3/4)
    """
    z = logits_head0 - logits_head0.max(axis=-1, keepdims=True)  # [B, T, V]
    logsumexp = np.log(np.exp(z).sum(axis=-1))                     # [B, T]
    m = np.asarray(mask, dtype=bool)
    safe_t = np.where(m, targets, 0)
    picked = np.take_along_axis(z, safe_t[..., None], axis=-1)[..., 0]  # [B, T]
    logps = np.where(m, picked - logsumexp, 0.0).sum(axis=-1)            # [B]
    return logps, (z, logsumexp, safe_t, m)


def response_logprobs_backward(dlogps, cache):
    """dlogps [B] -> dlogits [B, T, V] = dlogp · mask · (onehot(target) − softmax)."""
    z, logsumexp, safe_t, m = cache
    dz = -np.exp(z - logsumexp[..., None])  # −softmax, [B, T, V]
    np.put_along_axis(dz, safe_t[..., None], np.take_along_axis(dz, safe_t[..., None], axis=-1) + 1.0, axis=-1)
    scale = np.where(m, np.asarray(dlogps, dtype=z.dtype)[:, None], 0.0).astype(z.dtype)  # [B, T]
    return dz * scale[..., None]


# ---- the model: head-0 log-probs of whole sequences, and their parameter gradient ---------------
def trained_params(cfg, P: dict) -> dict:
    """The parameters DPO trains: everything except the MTP heads 1..K-1 (same arrays, not copies)."""
    return {n: p for n, p in P.items() if not n.startswith("heads.") or n == "heads.0.weight"}


class Workspaces:
    """The fast engine's buffers (`fast.Workspace`), one set per batch shape (B, T), kept between steps.
    precision: of the matrix products ("f32" or "bf16", see fast/bf16.py). lora: a LoRA policy (lora.LoraModel),
    whose workspaces apply its adapters on the fly and form only their gradients. lean: keep less for backward
    (fast.Workspace; a LoRA policy's always are): free for the reference's and evaluation's, which run forward
    only. fixed: the weights never change (the reference's): stacked or packed once for every shape."""

    def __init__(self, cfg, dtype=np.float32, precision: str = "f32", lora=None, lean: bool = False,
                 fixed: bool = False):
        self.cfg, self.dtype, self.precision, self.by_shape = cfg, np.dtype(dtype), precision, {}
        self.lora, self.lean, self.fixed = lora, lean, fixed

    def get(self, B: int, T: int):
        from ..fast import Workspace, engine
        if (B, T) not in self.by_shape:
            like = next(iter(self.by_shape.values()), None)
            if self.lora is not None:
                ws = self.lora.new_workspace(B, T, like)
            else:
                ws = Workspace(self.cfg, B, T, self.dtype, self.precision, lean=self.lean)
                ws.fixed_weights = self.fixed
                if self.fixed and like is not None:
                    engine.share_fixed(ws, like)
            self.by_shape[(B, T)] = ws
        return self.by_shape[(B, T)]


def sequence_logprobs_forward(cfg, P: dict, inputs, targets, mask, workspaces: Workspaces | None = None):
    """inputs int [B, T] -> (summed head-0 log-probs of the masked targets [B], cache).

    Without workspaces: the reference `model.forward`, run with only head 0 (a K=1 view of the same
    weights, so no work goes to heads 1..K-1). With workspaces: the fast engine's trunk (`fast.forward`,
    same mathematics, fused and preallocated), then head 0 a chunk of rows at a time (`fast.engine.head_rows`:
    a row's log-prob is minus its cross-entropy; the B·T·V logits are never held at once)."""
    if workspaces is None:
        from ..model import forward
        cfg1 = dataclasses.replace(cfg, n_mtp=1)
        P1 = trained_params(cfg, P)
        logits, model_cache = forward(cfg1, P1, inputs)  # [1, B, T, V]
        logps, lp_cache = response_logprobs_forward(logits[0], targets, mask)
        return logps, ("reference", cfg1, P1, model_cache, lp_cache)
    from .. import fast
    B, T = inputs.shape
    inputs = np.ascontiguousarray(inputs, dtype=np.int64)
    ws = workspaces.get(B, T)
    fast.forward(cfg, P, inputs, ws)                                     # ws.hf: final normed state [B·T, d]
    flat = np.where(np.asarray(mask, dtype=bool), targets, -1).reshape(-1).astype(np.int64)  # [B·T], −1: no loss
    logps = -fast.engine.head_rows(cfg, P, ws, flat).reshape(B, T).sum(axis=1)   # [B]
    return logps, ("fast", cfg, P, inputs, ws, flat)


def sequence_logprobs_backward(dlogps, cache) -> dict:
    """dlogps [B] -> gradient of every trained parameter (see `trained_params`)."""
    if cache[0] == "reference":
        from ..model import backward
        _, cfg1, P1, model_cache, lp_cache = cache
        dlogits = response_logprobs_backward(dlogps, lp_cache)  # [B, T, V]
        return backward(cfg1, P1, dlogits[None], model_cache)
    from .. import fast
    from ..config import head_name
    _, cfg, P, inputs, ws, flat = cache
    lora = ws.adapters is not None   # a LoRA policy: the adapters' gradients only (lora.LoraGrads)
    grads = ws.adapters.new_step(ws) if lora else fast.grad_buffers(cfg, ws.hf.dtype)
    # dlogits = dlogp · (onehot − softmax) = −dlogp · (softmax − onehot): the head's logits formed again,
    # a chunk at a time, then its gradient into grads and hf's into ws.dh
    fast.engine.head_rows(cfg, P, ws, flat, np.repeat(-np.asarray(dlogps, np.float64), inputs.shape[1]), grads)
    if head_name(P, 0) == "heads.0.weight":
        fast.engine.announce(["heads.0.weight"], grads)       # final: a data-parallel run may send it now
    fast.backward(cfg, P, inputs.reshape(-1), ws, grads)
    return ws.adapters.step_grads(ws) if lora else {n: grads[n] for n in trained_params(cfg, P)}


def chosen_nll_forward(policy_chosen_logps, n_tokens):
    """Mean per-token negative log-likelihood of the chosen responses -> (nll, cache).
    The optional extra term of `--nll-weight` (DPO + NLL, as in RPO): it keeps the chosen response's own
    likelihood rising, where plain DPO may lower both responses and only widen their gap.

        chosen_nll_forward([-6.0, -2.0], [3, 1])[0] == (6/3 + 2/1) / 2 == 2.0
    """
    pc, n = np.asarray(policy_chosen_logps, dtype=np.float64), np.asarray(n_tokens, dtype=np.float64)
    return float(np.mean(-pc / n)), n


def chosen_nll_backward(dnll, cache):
    """dnll scalar -> d policy_chosen [N] = −dnll / (N · n_tokens)."""
    n = cache
    return -dnll / (n.size * n)


def dpo_loss_and_grads(cfg, P: dict, batch: "PairBatch", ref_chosen, ref_rejected, beta: float,
                       workspaces: Workspaces | None = None, nll_weight: float = 0.0, scale: float = 1.0):
    """One forward/backward of a pair batch: (loss, metrics, grads of the trained params).
    Chosen and rejected sequences run as one batch [2N, T]: rows 0..N-1 chosen, N..2N-1 rejected.
    The loss is the DPO loss, plus nll_weight · `chosen_nll` when nll_weight > 0.
    workspaces: run the fast engine (see `sequence_logprobs_forward`); None: the reference ops.
    scale: multiplies loss, metrics and gradients (a data-parallel rank's share of a batch: its pairs / all)."""
    logps, cache = sequence_logprobs_forward(cfg, P, batch.inputs, batch.targets, batch.mask, workspaces)
    n = batch.n_pairs
    pc, pr = logps[:n], logps[n:]
    loss, loss_cache = dpo_loss_forward(pc, pr, ref_chosen, ref_rejected, beta)
    dpc, dpr, _, _ = dpo_loss_backward(1.0, loss_cache)
    nll, nll_cache = chosen_nll_forward(pc, batch.mask[:n].sum(axis=1))
    metrics = dpo_metrics(loss_cache[0], pc, pr, ref_chosen, ref_rejected, beta)
    metrics |= {"policy_accuracy": float((pc > pr).mean()), "dpo_loss": loss, "chosen_nll": nll}
    if nll_weight:
        loss = loss + nll_weight * nll
        dpc = dpc + chosen_nll_backward(nll_weight, nll_cache)
    if scale != 1.0:
        loss, metrics = loss * scale, {k: v * scale for k, v in metrics.items()}
        dpc, dpr = dpc * scale, dpr * scale
    grads = sequence_logprobs_backward(np.concatenate([dpc, dpr]), cache)
    return loss, metrics, grads


# ---- evaluation ----------------------------------------------------------------------------------
def pair_logprobs(cfg, P: dict, pairs: TokenizedPairs, batch_size: int = 16, pad_id: int = 0,
                  progress: bool = False, desc: str = "log-probs",
                  workspaces: Workspaces | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Summed head-0 response log-probs of every pair -> (chosen [N], rejected [N]) (forward only, fast engine)."""
    from .train import make_bar
    workspaces = workspaces or Workspaces(cfg, P["embed.weight"].dtype, lean=True, fixed=True)
    chosen, rejected = np.zeros(len(pairs)), np.zeros(len(pairs))
    bar = make_bar(progress and len(pairs) > batch_size, 0, len(pairs), desc)
    for start in range(0, len(pairs), batch_size):
        idx = np.arange(start, min(start + batch_size, len(pairs)))
        b = pairs.batch(idx, pad_id, cfg.ctx_len)
        logps, _ = sequence_logprobs_forward(cfg, P, b.inputs, b.targets, b.mask, workspaces)
        chosen[idx], rejected[idx] = logps[:len(idx)], logps[len(idx):]
        if bar is not None:
            bar.update(len(idx))
    if bar is not None:
        bar.close()
    return chosen, rejected


def preference_metrics(policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta: float) -> dict:
    """DPO loss, rewards and the two accuracies over a set of pairs:
    policy_accuracy = share with log π(chosen) > log π(rejected) (the policy ranks chosen first);
    reward_accuracy = share with β·(Δπ − Δref) > 0 (DPO's implicit reward ranks chosen first)."""
    loss, (z, _) = dpo_loss_forward(policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta)
    return {"loss": loss, "policy_accuracy": float(np.mean(np.asarray(policy_chosen) > policy_rejected)),
            **dpo_metrics(z, policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta)}


def score_greedy(model, tok, pairs: list[dict], max_new_tokens: int = 32, progress: bool = True) -> dict:
    """Greedy answers to each pair's prompt; correct when it ends with </s> and (normalized) equals `chosen`.
    Only pairs whose task is scored in `sft.SCORED` (or that have no task) are answered — open-ended tasks
    are skipped. Also per task, and how often the answer is the pair's `rejected` response."""
    from .dpo_data import pair_prompt_ids
    from ..infer.session import greedy_answers
    from .sft import SCORED, normalize
    rows = []
    todo = it = [p for p in pairs if p.get("task", "") in SCORED or not p.get("task")]
    if progress:
        from tqdm import tqdm
        it = tqdm(todo, desc="greedy answers", unit="prompt", dynamic_ncols=True)
    prompts = (pair_prompt_ids(tok, p) for p in it)
    for g, p in zip(greedy_answers(model, prompts, max_new_tokens, tok.stop_ids), todo):
        text = tok.decode(g.ids)
        ok = g.stopped and normalize(text) == normalize(p["chosen"])
        rows.append({"task": p.get("task", ""), "answer": text, "expected": p["chosen"], "correct": ok,
                     "said_rejected": normalize(text) == normalize(p["rejected"])})
    scored = rows
    per_task = {}
    for task in sorted({r["task"] for r in rows}):
        xs = [r for r in rows if r["task"] == task]
        per_task[task or "all"] = {"n": len(xs), "accuracy": sum(r["correct"] for r in xs) / len(xs),
                                   "said_rejected": sum(r["said_rejected"] for r in xs) / len(xs)}
    return {"n": len(rows), "n_scored": len(scored),
            "accuracy": sum(r["correct"] for r in scored) / max(1, len(scored)), "per_task": per_task,
            "examples": rows}


# ---- the objective of the training loop ------------------------------------------------------------
REFERENCE_FILE = "reference.safetensors"


def fingerprint(params: dict) -> str:
    """A short hash of a model's weights (names, shapes, bytes): identifies the reference of a run."""
    h = hashlib.sha1()
    for name, p in params.items():
        h.update(f"{name}{p.shape}{p.dtype}".encode())
        h.update(np.ascontiguousarray(p).tobytes())
    return h.hexdigest()[:16]


def evaluate_dpo(model, pairs: TokenizedPairs, ref_chosen, ref_rejected, beta: float, pad_id: int,
                 batch_size: int = 16, workspaces: Workspaces | None = None) -> dict:
    """Held-out DPO loss, reward margin and both preference accuracies (see `preference_metrics`)."""
    pc, pr = pair_logprobs(model.config, model.params, pairs, batch_size, pad_id, workspaces=workspaces)
    return preference_metrics(pc, pr, ref_chosen, ref_rejected, beta)


@dataclass
class PairPart:
    """A rank's share of a micro-batch of pairs: which pairs, their rows, and its share of the batch."""
    idx: np.ndarray
    batch: PairBatch
    scale: float  # its pairs / the micro-batch's pairs


class DPOObjective:
    """DPO as an objective of `train.run_training`: a micro-batch is `batch_size / grad_accum` pairs drawn
    with the run's rng; chosen + rejected run forward as one batch, then the DPO loss (+ nll_weight · the
    chosen responses' NLL) and backward; AdamW touches the trained params only (the MTP heads 1..K-1 stay
    frozen). The reference log-probs of a pair are computed the first time it is drawn (forward only) and
    kept: they never change, and are saved with every checkpoint (`reference.safetensors`, NaN = not
    drawn yet); those of the held-out pairs are computed at the start. Logged per step: loss, reward margin,
    reward / policy accuracy; at each eval the same on the held-out pairs."""
    unit = "pairs"
    metric_names = ("loss",)
    loss_label = "DPO loss"

    def __init__(self, model, tokenizer, train: TokenizedPairs, val: TokenizedPairs, reference_model, tcfg,
                 beta: float = 0.1, nll_weight: float = 0.0, data_id: str = "", sft: str | None = None,
                 progress: bool = True):
        if not beta > 0 or not nll_weight >= 0:
            raise UserError(f"--beta must be > 0 and --nll-weight >= 0, got {beta} and {nll_weight}")
        if len(train) == 0 or len(val) == 0:
            raise UserError(f"need training and held-out pairs that fit the context, got {len(train)} and {len(val)}")
        if tcfg.batch_size % tcfg.grad_accum:
            raise UserError(f"--batch-size {tcfg.batch_size} is not divisible by --grad-accum {tcfg.grad_accum}")
        self.micro = tcfg.batch_size // tcfg.grad_accum
        if self.micro > len(train):
            raise UserError(f"a micro-batch of {self.micro} pairs is more than the {len(train)} training pairs")
        self.model, self.cfg, self.reference_model = model, model.config, reference_model
        self.lora = isinstance(model, LoraModel)  # the adapters are trained, applied on the fly
        if self.lora and "mtp_heads" in model.lcfg.modules_to_save:
            raise UserError("--lora-modules-to-save mtp_heads: dpo trains head 0 only (the MTP heads stay as they are)")
        self.params = model.params if self.lora else trained_params(self.cfg, model.params)
        self.train, self.val, self.beta, self.nll_weight = train, val, beta, nll_weight
        self.sft, self.progress, self.pad_id = sft, progress, tokenizer.eos_id
        self.workspaces = Workspaces(self.cfg, model.dtype, model.precision,   # the fast engine's buffers, reused
                                     model if self.lora else None)
        # the reference's log-probs in the run's precision too
        self.ref_ws = Workspaces(self.cfg, reference_model.dtype, model.precision, lean=True, fixed=True)
        self.ref_id = fingerprint(reference_model.params)
        self._describe = {"data": data_id, "train_pairs": len(train), "val_pairs": len(val),
                          "truncated": train.truncated + val.truncated, "dropped": train.dropped + val.dropped}
        self.reference: dict | None = None

    def describe(self) -> dict:
        return self._describe

    def new_state(self) -> dict:
        if self.reference_model.config != self.cfg:
            raise UserError("the reference and the policy must have the same config")
        from .dist import world
        if world().rank == 0:  # only rank 0 evaluates
            vc, vr = pair_logprobs(self.cfg, self.reference_model.params, self.val, 16, self.pad_id, self.progress,
                                   "reference log-probs (held-out)", self.ref_ws)
        else:
            vc, vr = np.zeros(len(self.val)), np.zeros(len(self.val))
        n = len(self.train)
        self._set_reference({"train.chosen": np.full(n, np.nan), "train.rejected": np.full(n, np.nan),
                             "val.chosen": vc, "val.rejected": vr})
        # policy == reference: DPO loss log 2, reward accuracy 0, policy accuracy = the reference's
        first = preference_metrics(vc, vr, vc, vr, self.beta)
        return {"beta": self.beta, "nll_weight": self.nll_weight, "sft": str(self.sft) if self.sft else None,
                "reference": self.ref_id, "pairs_seen": 0, "initial_eval": {f"val_{k}": v for k, v in first.items()}}

    def changed_settings(self, state: dict) -> list[str]:
        diff = []
        if state.get("beta") != self.beta:
            diff.append("beta")
        if state.get("nll_weight", 0.0) != self.nll_weight:
            diff.append("nll_weight")
        return diff

    def resume(self, state: dict, out_dir: Path) -> None:
        from .. import checkpoint as ckpt
        if state.get("reference") != self.ref_id:
            raise UserError(f"cannot resume {out_dir}: the reference model is not the run's (weights differ from "
                            f"those of {state.get('sft')})")
        self._set_reference(ckpt.read_tensors(out_dir / REFERENCE_FILE, "reference log-probs"))

    def _set_reference(self, reference: dict) -> None:
        for key, n in (("train.chosen", len(self.train)), ("train.rejected", len(self.train)),
                       ("val.chosen", len(self.val)), ("val.rejected", len(self.val))):
            if key not in reference or reference[key].shape != (n,):
                raise UserError(f"reference log-probs do not match the pairs ({key})")
        self.reference = reference

    def checkpoint_tensors(self) -> dict:
        return {REFERENCE_FILE: self.reference}

    def draw(self, rng):
        idx = rng.choice(len(self.train), self.micro, replace=False)
        return idx, self.train.batch(idx, self.pad_id, self.cfg.ctx_len)

    def count(self, batch) -> int:
        return len(batch[0])

    def skip(self, batch) -> bool:
        return False

    def rows(self, batch) -> int:
        return len(batch[0])

    def share(self, batch, rank: int, n: int) -> PairPart:
        idx, b = batch
        N = len(idx)
        lo, hi = N * rank // n, N * (rank + 1) // n
        rows = np.r_[lo:hi, N + lo:N + hi]
        part = PairBatch(b.inputs[rows], b.targets[rows], b.mask[rows], hi - lo)
        return PairPart(idx[lo:hi], part, (hi - lo) / N)

    def loss_and_grads(self, batch):
        if isinstance(batch, PairPart):
            idx, b, scale = batch.idx, batch.batch, batch.scale
        else:
            (idx, b), scale = batch, 1.0
        self._reference_logprobs(idx, b, isinstance(batch, PairPart))
        ref_c, ref_r = self.reference["train.chosen"], self.reference["train.rejected"]
        policy = self.model.policy.params if self.lora else self.model.params   # LoRA: adapters on the fly
        return dpo_loss_and_grads(self.cfg, policy, b, ref_c[idx], ref_r[idx], self.beta, self.workspaces,
                                  self.nll_weight, scale)

    def _reference_logprobs(self, idx, b: PairBatch, shared: bool) -> None:
        """The reference's log-probs of the pairs drawn for the first time (forward only, once per pair).
        Data-parallel: each rank computes those of its share and every rank receives all of them."""
        ref_c, ref_r = self.reference["train.chosen"], self.reference["train.rejected"]
        todo = np.isnan(ref_c[idx])
        n = len(idx)
        if todo.any():
            lp, _ = sequence_logprobs_forward(self.cfg, self.reference_model.params, b.inputs, b.targets, b.mask,
                                              self.ref_ws)
            ref_c[idx[todo]], ref_r[idx[todo]] = lp[:n][todo], lp[n:][todo]
        if shared:
            from .dist import world
            for i, c, r in world().allgather_arrays([idx[todo], ref_c[idx[todo]], ref_r[idx[todo]]]):
                i = i.astype(np.int64)
                ref_c[i], ref_r[i] = c, r

    def evaluate(self, max_batches: int) -> dict:
        policy = self.model.policy if self.lora else self.model   # LoRA: the workspaces apply the adapters
        m = evaluate_dpo(policy, self.val, self.reference["val.chosen"], self.reference["val.rejected"],
                         self.beta, self.pad_id, workspaces=self.workspaces)
        return {f"val_{k}": v for k, v in m.items()}

    def rates(self, n: int, dt: float) -> dict:
        return {"pairs_per_s": n / dt}

    def postfix(self, m: dict) -> dict:
        return {"loss": f"{m['loss']:.3f}", "margin": f"{m['reward_margin']:.2f}", "acc": f"{m['reward_accuracy']:.2f}"}

    def summary(self, state: dict) -> dict:
        return {"initial_eval": state.get("initial_eval", {})}

    def plot(self, log_path: Path, png_path: Path) -> None:
        plot_dpo_curves(log_path, png_path)


def run_dpo(model, tokenizer, train: TokenizedPairs, val: TokenizedPairs, reference_model, out_dir, tcfg,
            beta: float = 0.1, resume: bool = False, stop_after: int | None = None, progress: bool = True,
            data_id: str = "", sft: str | None = None, nll_weight: float = 0.0) -> dict:
    """Train `model` (the policy, initialised from the SFT checkpoint) in place with DPO on `train` pairs,
    against the frozen `reference_model` (the SFT checkpoint, a separate copy), in `train.run_training`
    (see `DPOObjective`). Checkpoints and resume as in pretraining (bit-for-bit; the reference must be the
    same weights). Returns a summary dict."""
    from .train import run_training
    obj = DPOObjective(model, tokenizer, train, val, reference_model, tcfg, beta, nll_weight, data_id, sft, progress)
    return run_training(model, tokenizer, None, out_dir, tcfg, resume=resume, stop_after=stop_after,
                        progress=progress, kind="dpo", objective=obj)


def plot_dpo_curves(log_path: Path, png_path: Path) -> None:
    """Training loss, reward margin and held-out accuracies against steps, as a PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..fileio import atomic_path
    from .train import read_log
    rows = read_log(log_path)
    if not rows:
        return
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    steps = [r["step"] for r in rows]
    a1.plot(steps, [r["loss"] for r in rows], lw=0.8, label="train DPO loss")
    a1.plot(steps, [r["reward_margin"] for r in rows], lw=0.8, label="train reward margin")
    a1.axhline(math.log(2), color="gray", ls=":", lw=0.8)
    val = [r for r in rows if "val_loss" in r]
    if val:
        a1.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="held-out DPO loss")
        a2.plot([r["step"] for r in val], [r["val_reward_accuracy"] for r in val], "o-", label="held-out reward accuracy")
        a2.plot([r["step"] for r in val], [r["val_policy_accuracy"] for r in val], "s-", label="held-out policy accuracy")
    for ax in (a1, a2):
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(png_path.parent.name)
    fig.tight_layout()
    with atomic_path(png_path) as tmp:
        fig.savefig(tmp, format="png", dpi=100)
    plt.close(fig)
