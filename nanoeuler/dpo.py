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

and then `model.backward` carries the head-0 logit gradient down to every parameter. `check_dpo` is the
float64 finite-difference check of all of it.

Only head 0 and the trunk are trained: the MTP heads 1..K-1 get no DPO signal and stay frozen (not even
weight decay touches them). The reference log-probs never change, so they are computed once at the start
and stored with every checkpoint (`reference.safetensors`); a resumed run does not need the SFT run again.

Pair data is JSONL, one object per line: {"prompt": ..., "chosen": ..., "rejected": ...}.
`prompt` is the SPEC Alpaca template already rendered up to and including "### Response:\\n" (so any
pair file is self-describing and is exactly what the model sees); `chosen` and `rejected` are the bare
response texts, without </s> (it is appended when tokenizing). Optional extra fields (`task`, ...) are
carried along and used to break results down.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import UserError


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
    """The fast engine's buffers (`fast.Workspace`), one set per batch shape (B, T), kept between steps."""

    def __init__(self, cfg, dtype=np.float32):
        self.cfg, self.dtype, self.by_shape = cfg, np.dtype(dtype), {}

    def get(self, B: int, T: int):
        from .fast import Workspace
        if (B, T) not in self.by_shape:
            self.by_shape[(B, T)] = Workspace(self.cfg, B, T, self.dtype)
        return self.by_shape[(B, T)]


def sequence_logprobs_forward(cfg, P: dict, inputs, targets, mask, workspaces: Workspaces | None = None):
    """inputs int [B, T] -> (summed head-0 log-probs of the masked targets [B], cache).

    Without workspaces: the reference `model.forward`, run with only head 0 (a K=1 view of the same
    weights, so no work goes to heads 1..K-1). With workspaces: the fast engine's trunk (`fast.forward`,
    same mathematics, fused and preallocated), then head 0 and `response_logprobs_forward` as above."""
    if workspaces is None:
        from .model import forward
        cfg1 = dataclasses.replace(cfg, n_mtp=1)
        P1 = trained_params(cfg, P)
        logits, model_cache = forward(cfg1, P1, inputs)  # [1, B, T, V]
        logps, lp_cache = response_logprobs_forward(logits[0], targets, mask)
        return logps, ("reference", cfg1, P1, model_cache, lp_cache)
    from . import fast
    B, T = inputs.shape
    inputs = np.ascontiguousarray(inputs, dtype=np.int64)
    ws = workspaces.get(B, T)
    fast.engine.forward(cfg, P, inputs, ws)                              # ws.hf: final normed state [B·T, d]
    logits = (ws.hf @ P["heads.0.weight"].T).reshape(B, T, -1)           # [B, T, V]
    logps, lp_cache = response_logprobs_forward(logits, targets, mask)
    return logps, ("fast", cfg, P, inputs, ws, lp_cache)


def sequence_logprobs_backward(dlogps, cache) -> dict:
    """dlogps [B] -> gradient of every trained parameter (see `trained_params`)."""
    if cache[0] == "reference":
        from .model import backward
        _, cfg1, P1, model_cache, lp_cache = cache
        dlogits = response_logprobs_backward(dlogps, lp_cache)  # [B, T, V]
        return backward(cfg1, P1, dlogits[None], model_cache)
    from . import fast
    _, cfg, P, inputs, ws, lp_cache = cache
    dlogits = response_logprobs_backward(dlogps, lp_cache).reshape(ws.N, -1).astype(ws.hf.dtype)  # [B·T, V]
    grads = fast.grad_buffers(cfg, ws.hf.dtype)
    W0 = P["heads.0.weight"]
    np.matmul(dlogits.T, ws.hf, out=grads["heads.0.weight"])  # [V, d]
    np.matmul(dlogits, W0, out=ws.dh)                         # gradient of the final normed state [B·T, d]
    fast.engine.backward(cfg, P, inputs.reshape(-1), ws, grads)
    return {n: grads[n] for n in trained_params(cfg, P)}


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
                       workspaces: Workspaces | None = None, nll_weight: float = 0.0):
    """One forward/backward of a pair batch: (loss, metrics, grads of the trained params).
    Chosen and rejected sequences run as one batch [2N, T]: rows 0..N-1 chosen, N..2N-1 rejected.
    The loss is the DPO loss, plus nll_weight · `chosen_nll` when nll_weight > 0.
    workspaces: run the fast engine (see `sequence_logprobs_forward`); None: the reference ops."""
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
    grads = sequence_logprobs_backward(np.concatenate([dpc, dpr]), cache)
    return loss, metrics, grads


# ---- the float64 finite-difference check ---------------------------------------------------------
def check_dpo(seed: int = 0, n_samples: int = 12) -> list:
    """Rows for `nanoeuler check`: (a) the dpo_loss and response_logprobs pairs on random inputs,
    (b) every trained parameter of a float64 model (MTP K=3, GQA) through log-probs + DPO loss,
    with the reference a different model, and the frozen MTP heads getting exactly no gradient."""
    from .check import CHECK_CONFIG, Row, _check_op, check_tensor
    from .model import Model
    rng = np.random.default_rng(seed)
    rows = []
    N, beta = 5, 0.1
    logps = [rng.standard_normal(N) * 3 for _ in range(4)]

    def loss_fwd(pc, pr, rc, rr):
        return dpo_loss_forward(pc, pr, rc, rr, beta)

    rows += _check_op("dpo_loss", loss_fwd, dpo_loss_backward, logps, rng)
    counts = rng.integers(1, 9, N)
    rows += _check_op("chosen_nll", lambda pc: chosen_nll_forward(pc, counts), chosen_nll_backward, [logps[0]], rng)
    B, T, V = 3, 6, 11
    targets = rng.integers(0, V, (B, T))
    mask = rng.random((B, T)) > 0.3
    targets[~mask] = -1  # padding ids outside the mask must not matter
    logits = rng.standard_normal((B, T, V))
    # confident targets keep the summed log-probs near 0, so the round-off of the finite differences
    # (≈ 1e-16·|L| / h) stays far below the 1e-6 floor at masked positions, where the true gradient is 0
    np.put_along_axis(logits, np.where(mask, targets, 0)[..., None], 6.0, axis=-1)
    rows += _check_op("response_logprobs", lambda z: response_logprobs_forward(z, targets, mask),
                      response_logprobs_backward, [logits], rng)

    cfg = CHECK_CONFIG
    policy = Model.init(cfg, seed=seed, dtype=np.float64)
    for p in policy.params.values():
        p += rng.standard_normal(p.shape) * (0.3 if p.ndim > 1 else 0.5)
    reference = Model(cfg, {n: p + rng.standard_normal(p.shape) * 0.05 for n, p in policy.params.items()})
    n_pairs = 2
    seqs = [rng.integers(0, cfg.vocab_size, rng.integers(6, cfg.ctx_len + 2)) for _ in range(2 * n_pairs)]
    masks = []
    for s in seqs:
        m = np.zeros(len(s), dtype=bool)
        m[rng.integers(2, len(s) - 1):] = True  # the response: a suffix
        masks.append(m)
    batch = make_batch(seqs[:n_pairs], masks[:n_pairs], seqs[n_pairs:], masks[n_pairs:])
    ref_logps, _ = sequence_logprobs_forward(cfg, reference.params, batch.inputs, batch.targets, batch.mask)
    rc, rr = ref_logps[:n_pairs], ref_logps[n_pairs:]
    _, _, grads = dpo_loss_and_grads(cfg, policy.params, batch, rc, rr, beta)

    def f():
        lp, _ = sequence_logprobs_forward(cfg, policy.params, batch.inputs, batch.targets, batch.mask)
        return dpo_loss_forward(lp[:n_pairs], lp[n_pairs:], rc, rr, beta)[0]

    for name, p in policy.params.items():
        if name in grads:
            rows.append(check_tensor(f"dpo: {name}", f, p, grads[name], rng, n_samples))
        else:  # a frozen MTP head: the DPO loss must not depend on it at all
            idx = rng.choice(p.size, min(n_samples, p.size), replace=False)
            from .check import numeric_grad
            num = numeric_grad(f, p, idx)
            rows.append(Row(f"dpo: {name} (frozen, |numeric| max)", float(np.max(np.abs(num))), len(idx)))
    # DPO + NLL of the chosen responses (--nll-weight): a few tensors through the combined loss
    nll_w = 0.5
    _, _, grads = dpo_loss_and_grads(cfg, policy.params, batch, rc, rr, beta, nll_weight=nll_w)

    def f_nll():
        lp, _ = sequence_logprobs_forward(cfg, policy.params, batch.inputs, batch.targets, batch.mask)
        n_tok = batch.mask[:n_pairs].sum(axis=1)
        return dpo_loss_forward(lp[:n_pairs], lp[n_pairs:], rc, rr, beta)[0] + nll_w * chosen_nll_forward(lp[:n_pairs], n_tok)[0]

    for name in ("embed.weight", "layers.0.attn.wq.weight", "layers.1.ffn.down.weight", "heads.0.weight"):
        rows.append(check_tensor(f"dpo+nll: {name}", f_nll, policy.params[name], grads[name], rng, n_samples))
    return rows


# ---- batches of pairs ----------------------------------------------------------------------------
@dataclass
class PairBatch:
    """N pairs as 2N right-padded sequences: rows 0..N-1 chosen, N..2N-1 rejected."""
    inputs: np.ndarray   # int [2N, T]
    targets: np.ndarray  # int [2N, T]  (next tokens; −1 on padding)
    mask: np.ndarray     # bool [2N, T] (True where the target is a response token or </s>)
    n_pairs: int


def make_batch(chosen_ids, chosen_masks, rejected_ids, rejected_masks, pad_id: int = 0,
               length: int | None = None) -> PairBatch:
    """Lists of token-id arrays (each the whole sequence prompt+response+</s>) and their masks
    (True on response tokens and </s>) -> a PairBatch. Sequence s of length L gives inputs s[:-1],
    targets s[1:], mask m[1:] (the mask of a target position). Rows are padded to the longest sequence
    (or to `length` inputs, when given: fixed shapes let the fast engine reuse its buffers).

        make_batch([[7, 8, 9]], [[0, 1, 1]], [[7, 5]], [[0, 1]])
        -> inputs [[7, 8], [7, 0]], targets [[8, 9], [5, -1]], mask [[1, 1], [1, 0]]
    """
    seqs = [np.asarray(s) for s in list(chosen_ids) + list(rejected_ids)]
    masks = [np.asarray(m, dtype=bool) for m in list(chosen_masks) + list(rejected_masks)]
    T = max(len(s) for s in seqs) - 1
    if length is not None:
        T = max(T, length)
    n = len(seqs)
    inputs = np.full((n, T), pad_id, dtype=np.int64)
    targets = np.full((n, T), -1, dtype=np.int64)
    mask = np.zeros((n, T), dtype=bool)
    for i, (s, m) in enumerate(zip(seqs, masks)):
        L = len(s) - 1
        inputs[i, :L], targets[i, :L], mask[i, :L] = s[:-1], s[1:], m[1:]
    return PairBatch(inputs, targets, mask, len(chosen_ids))


# ---- pair data -----------------------------------------------------------------------------------
def load_pairs(path: str | Path) -> tuple[list[dict], list[str]]:
    """A JSONL file of {prompt, chosen, rejected} -> (valid pairs, problems). A pair is valid when all three
    are non-empty strings and chosen != rejected; invalid lines are skipped and described in `problems`.
    Raises UserError when the file is unreadable or holds no valid pair."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"pair data {path} not found")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise UserError(f"pair data {path} is not UTF-8 text ({e})") from None
    good, bad = [], []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            bad.append(f"line {i}: not JSON ({e.msg})")
            continue
        problem = pair_problem(rec)
        if problem:
            bad.append(f"line {i}: {problem}")
        else:
            good.append(rec)
    if not good:
        raise UserError(f"pair data {path} holds no valid {{prompt, chosen, rejected}} pair" +
                        (f" ({bad[0]})" if bad else ""))
    return good, bad


def pair_problem(rec) -> str | None:
    """Why rec is not a valid pair, or None.  pair_problem({"prompt": "p", "chosen": "a", "rejected": "a"})
    -> 'chosen and rejected are the same'"""
    if not isinstance(rec, dict):
        return "not a JSON object"
    for key in ("prompt", "chosen", "rejected"):
        if not isinstance(rec.get(key), str) or not rec[key].strip():
            return f"missing or empty string field {key!r}"
    if rec["chosen"] == rec["rejected"]:
        return "chosen and rejected are the same"
    return None


def split_pairs(pairs: list[dict], every: int = 50) -> tuple[list[dict], list[dict]]:
    """(train, held-out): a pair is held out when the hash of its prompt falls in 1/every, so all pairs
    of one prompt land on the same side."""
    train, held = [], []
    for p in pairs:
        h = int(hashlib.sha1(p["prompt"].encode()).hexdigest()[:8], 16)
        (held if h % every == 0 else train).append(p)
    return train, held


@dataclass
class TokenizedPairs:
    """Pairs as token ids: each sequence is prompt + response + </s>, mask True on response and </s>."""
    chosen: list[tuple[np.ndarray, np.ndarray]]    # (ids int64 [L], mask bool [L])
    rejected: list[tuple[np.ndarray, np.ndarray]]
    records: list[dict]                            # the pairs kept, in the same order
    truncated: int = 0                             # prompt cut on the left to fit the context
    dropped: int = 0                               # not even the responses fit: left out

    def __len__(self) -> int:
        return len(self.chosen)

    def batch(self, idx, pad_id: int, ctx_len: int | None = None, multiple: int = 16) -> PairBatch:
        """Pairs idx as a PairBatch; with ctx_len, padded up to a multiple of `multiple` inputs (at most
        ctx_len), so that few distinct shapes occur."""
        c = [self.chosen[i] for i in idx]
        r = [self.rejected[i] for i in idx]
        length = None
        if ctx_len:
            longest = max(len(x[0]) for x in c + r) - 1
            length = min(ctx_len, -(-longest // multiple) * multiple)
        return make_batch([x[0] for x in c], [x[1] for x in c], [x[0] for x in r], [x[1] for x in r], pad_id, length)


def tokenize_response(tok, prompt_ids: list[int], response: str) -> tuple[np.ndarray, np.ndarray]:
    """prompt ids + response -> (ids, mask): the same ids and mask as `sft.render` gives for the same text."""
    resp = tok.encode(response) + [tok.eos_id]
    ids = np.asarray(prompt_ids + resp, dtype=np.int64)
    mask = np.zeros(len(ids), dtype=bool)
    mask[len(prompt_ids):] = True
    return ids, mask


def tokenize_pairs(tok, pairs: list[dict], ctx_len: int) -> TokenizedPairs:
    """Tokenize every pair into sequences of at most ctx_len + 1 tokens (ctx_len inputs, ctx_len targets).
    A pair that is longer loses the start of its prompt — the same left truncation generation applies to
    a long prompt, so the log-probs are those of the context the model answers in — and is counted as
    truncated; both responses keep the same prompt tokens. A pair whose responses alone do not fit is
    dropped (counted)."""
    out = TokenizedPairs([], [], [])
    for p in pairs:
        prompt_ids = tok.encode(p["prompt"])
        c = tokenize_response(tok, prompt_ids, p["chosen"])
        r = tokenize_response(tok, prompt_ids, p["rejected"])
        cut = max(len(c[0]), len(r[0])) - (ctx_len + 1)
        if cut >= len(prompt_ids):
            out.dropped += 1
            continue
        if cut > 0:
            c, r = (c[0][cut:], c[1][cut:]), (r[0][cut:], r[1][cut:])
            out.truncated += 1
        out.chosen.append(c)
        out.rejected.append(r)
        out.records.append(p)
    return out


# ---- the offline pair set (from the offline instruction set) ------------------------------------
def offline_pairs(n_train: int = 6000, n_heldout: int = 400, seed: int = 0,
                  fits=None) -> tuple[list[dict], list[dict]]:
    """(train, held-out) pairs from `sft.offline_instructions` (same records, same held-out lines):
    chosen = the correct answer, rejected = a plausible wrong one of the same kind:

        first_word / last_word   another word of the same line        ('To be, or not' -> 'be' vs 'To')
        play                     another work's title
        speaker                  another character (drawn by how often characters answer: common names
                                 are the likeliest wrong guesses)
        continue                 the next line of a different passage

    Wrong answers are drawn within the split, so no held-out text reaches training, not even as a
    rejected response. Every pair keeps its `task`. The prompt is the rendered template (`sft.prompt_text`).
    fits: as in `offline_instructions` (e.g. `sft.fits_context(tok, ctx)`: only questions the model sees
    whole), applied to the prompt with either response."""
    from .sft import WORD_RE, normalize, offline_instructions, prompt_text
    train, held = offline_instructions(n_train, n_heldout, seed, fits)
    rng = np.random.default_rng(seed + 1)
    out = []
    for records in (train, held):
        pools: dict[str, list[str]] = {}  # wrong answers come from the same split: no held-out text in training
        for r in records:
            pools.setdefault(r["task"], []).append(r["output"])
        pairs = []
        for r in records:
            if r["task"] in ("first_word", "last_word"):
                candidates = WORD_RE.findall(r.get("line") or r["input"])
            else:
                candidates = pools.get(r["task"], [])
            candidates = [c for c in candidates if normalize(c) != normalize(r["output"])]
            if not candidates:
                continue  # e.g. a line whose words are all the answer word
            wrong = candidates[int(rng.integers(len(candidates)))]
            if fits is not None and not fits(r | {"output": wrong}):
                continue  # the rejected response would not fit
            pairs.append({"prompt": prompt_text(r["instruction"], r["input"]), "chosen": r["output"],
                          "rejected": wrong, "task": r["task"]})
        out.append(pairs)
    return out[0], out[1]


def model_negatives(model, tok, pairs: list[dict], max_new_tokens: int = 16, progress: bool = True) -> tuple[list[dict], int]:
    """On-policy wrong answers: for each pair of a scored task, the model's own greedy answer replaces
    `rejected` when it is wrong (non-empty, ends with </s>, differs from chosen after `sft.normalize`) —
    the mistakes this model actually makes, which rule-made negatives rarely are. Other pairs are kept.
    -> (new pairs, number replaced). Each replaced pair gets "rejected_source": "model"."""
    from .generate import generate
    from .sft import SCORED, normalize
    out, replaced = [], 0
    it = pairs
    if progress:
        from tqdm import tqdm
        it = tqdm(pairs, desc="model answers", unit="prompt", dynamic_ncols=True)
    ctx = model.config.ctx_len
    for p in it:
        if p.get("task", "") in SCORED or not p.get("task"):
            ids = tok.encode(p["prompt"])[-ctx:]
            g = generate(model, ids, max_new_tokens=max_new_tokens, temperature=0, stop_ids=[tok.eos_id],
                         mode="speculative")
            answer = tok.decode(g.ids).strip()
            if g.stopped and answer and "###" not in answer and normalize(answer) != normalize(p["chosen"]):
                p = p | {"rejected": answer, "rejected_source": "model"}
                replaced += 1
        out.append(p)
    return out, replaced


def pair_records(data: str, val: str | None, fits=None) -> tuple[list[dict], list[dict], str, int]:
    """(train pairs, held-out pairs, data id, invalid lines skipped) for --data/--val:
    'offline' = `offline_pairs(fits=fits)`; a JSONL file = its pairs (held-out: --val, else 1 in 50 by
    prompt hash)."""
    if data == "offline":
        train, held = offline_pairs(fits=fits)
        return train, held, "offline-pairs-v2" if fits else "offline-pairs-v1", 0
    train, bad = load_pairs(data)
    data_id = hashlib.sha1(Path(data).read_bytes()).hexdigest()[:16]
    if bad:
        print(f"warning: skipped {len(bad)} invalid pair(s) in {data}, e.g. {bad[0]}")
    if val:
        held, bad_val = load_pairs(val)
        bad += bad_val
        data_id += "+" + hashlib.sha1(Path(val).read_bytes()).hexdigest()[:16]
    else:
        train, held = split_pairs(train)
        if not held:
            raise UserError(f"no held-out pair: {data} is too small to hold 1 in 50 out; pass --val FILE")
    return train, held, data_id, len(bad)


# ---- evaluation ----------------------------------------------------------------------------------
def pair_logprobs(cfg, P: dict, pairs: TokenizedPairs, batch_size: int = 16, pad_id: int = 0,
                  progress: bool = False, desc: str = "log-probs",
                  workspaces: Workspaces | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Summed head-0 response log-probs of every pair -> (chosen [N], rejected [N]) (forward only, fast engine)."""
    from .train import make_bar
    workspaces = workspaces or Workspaces(cfg, P["embed.weight"].dtype)
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
    from .generate import generate
    from .sft import SCORED, normalize
    rows = []
    it = [p for p in pairs if p.get("task", "") in SCORED or not p.get("task")]
    if progress:
        from tqdm import tqdm
        it = tqdm(it, desc="greedy answers", unit="prompt", dynamic_ncols=True)
    ctx = model.config.ctx_len
    for p in it:
        ids = tok.encode(p["prompt"])[-ctx:]
        g = generate(model, ids, max_new_tokens=max_new_tokens, temperature=0, stop_ids=[tok.eos_id],
                     mode="speculative")
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


# ---- the training loop ---------------------------------------------------------------------------
REFERENCE_FILE = "reference.safetensors"


def save_dpo_checkpoint(out_dir: Path, model, tokenizer, opt, state: dict, reference: dict) -> None:
    """model + config + tokenizer + AdamW moments + trainer state + reference log-probs, one atomic unit."""
    from . import checkpoint as ckpt
    opt_tensors, opt_scalars = opt.state_dict()
    writers = ckpt.model_writers(model.config, model.params, tokenizer)
    writers["optimizer.safetensors"] = ckpt.tensors_writer(opt_tensors)
    writers[REFERENCE_FILE] = ckpt.tensors_writer(reference)
    writers["trainer.json"] = ckpt.json_writer(state | {"optimizer": opt_scalars})
    ckpt.save_files(out_dir, writers)


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


def run_dpo(model, tokenizer, train: TokenizedPairs, val: TokenizedPairs, reference_model, out_dir, tcfg,
            beta: float = 0.1, resume: bool = False, stop_after: int | None = None, progress: bool = True,
            data_id: str = "", sft: str | None = None, nll_weight: float = 0.0) -> dict:
    """Train `model` (the policy, initialised from the SFT checkpoint) in place with DPO on `train` pairs,
    against the frozen `reference_model` (the SFT checkpoint, a separate copy).

    One step: draw batch_size pairs (with the run's rng), forward chosen + rejected as one batch, DPO loss,
    backward, clip, AdamW on the trained params (the MTP heads 1..K-1 stay frozen). The reference
    log-probs of a pair are computed the first time it is drawn (forward only) and kept: they never
    change, and are saved with every checkpoint (`reference.safetensors`, NaN = not drawn yet); those of
    the held-out pairs are computed at the start. Logged per step: loss, reward margin, reward / policy
    accuracy; every eval_every steps the same on the held-out pairs. Checkpoints and resume work as in
    `train.run_training` (bit-for-bit; the reference must be the same weights). Returns a summary dict."""
    from types import SimpleNamespace

    from . import checkpoint as ckpt
    from .optim import AdamW, clip_grad_norm, lr_schedule
    from .train import (StopRequest, TrainingDiverged, changed_settings, load_training_state, make_bar,
                        truncate_log)
    out_dir = Path(out_dir)
    log_path = out_dir / "log.jsonl"
    if not beta > 0 or not nll_weight >= 0:
        raise UserError(f"--beta must be > 0 and --nll-weight >= 0, got {beta} and {nll_weight}")
    if len(train) == 0 or len(val) == 0:
        raise UserError(f"need training and held-out pairs that fit the context, got {len(train)} and {len(val)}")
    if tcfg.batch_size % tcfg.grad_accum:
        raise UserError(f"--batch-size {tcfg.batch_size} is not divisible by --grad-accum {tcfg.grad_accum}")
    micro = tcfg.batch_size // tcfg.grad_accum
    if micro > len(train):
        raise UserError(f"a micro-batch of {micro} pairs is more than the {len(train)} training pairs")
    cfg = model.config
    P1 = trained_params(cfg, model.params)
    opt = AdamW(P1, lr=tcfg.lr, betas=(tcfg.beta1, tcfg.beta2), weight_decay=tcfg.weight_decay)
    rng = np.random.default_rng(tcfg.seed)
    pad_id = tokenizer.eos_id
    workspaces = Workspaces(cfg, model.dtype)  # the fast engine's buffers, reused step after step
    ref_ws = Workspaces(cfg, reference_model.dtype)
    ref_id = fingerprint(reference_model.params)
    describe = {"data": data_id, "train_pairs": len(train), "val_pairs": len(val),
                "truncated": train.truncated + val.truncated, "dropped": train.dropped + val.dropped}
    if resume:
        if not (out_dir / "trainer.json").exists():
            raise UserError(f"nothing to resume in {out_dir} (no trainer.json); start without --resume")
        state = load_training_state(out_dir, SimpleNamespace(params=P1), opt)
        if state.get("kind") != "dpo":
            raise UserError(f"{out_dir} is a {state.get('kind')} run, not dpo")
        diff = changed_settings(state["train_config"], tcfg)
        if state.get("beta") != beta:
            diff.append("beta")
        if state.get("nll_weight", 0.0) != nll_weight:
            diff.append("nll_weight")
        if diff:
            raise UserError(f"cannot resume {out_dir} with different settings: {', '.join(diff)}")
        if state["data"] != describe:
            raise UserError(f"cannot resume {out_dir}: the pair data differs from the run's ({state['data']})")
        if state.get("reference") != ref_id:
            raise UserError(f"cannot resume {out_dir}: the reference model is not the run's (weights differ from "
                            f"those of {state.get('sft')})")
        reference = ckpt.read_tensors(out_dir / REFERENCE_FILE, "reference log-probs")
        rng.bit_generator.state = state["rng"]
        state["train_config"] = dataclasses.asdict(tcfg)
        truncate_log(log_path, state["step"])
    else:
        if (out_dir / "trainer.json").exists():
            raise UserError(f"{out_dir} already holds a training run; use --resume to continue it or choose another --out")
        if reference_model.config != cfg:
            raise UserError("the reference and the policy must have the same config")
        vc, vr = pair_logprobs(cfg, reference_model.params, val, 16, pad_id, progress,
                               "reference log-probs (held-out)", ref_ws)
        reference = {"train.chosen": np.full(len(train), np.nan), "train.rejected": np.full(len(train), np.nan),
                     "val.chosen": vc, "val.rejected": vr}
        state = {"kind": "dpo", "step": 0, "beta": beta, "nll_weight": nll_weight, "sft": str(sft) if sft else None, "reference": ref_id,
                 "train_config": dataclasses.asdict(tcfg), "data": describe, "pairs_seen": 0, "elapsed_s": 0.0,
                 # policy == reference: DPO loss log 2, reward accuracy 0, policy accuracy = the reference's
                 "initial_eval": {f"val_{k}": v for k, v in preference_metrics(vc, vr, vc, vr, beta).items()}}
    for key, n in (("train.chosen", len(train)), ("train.rejected", len(train)), ("val.chosen", len(val)),
                   ("val.rejected", len(val))):
        if key not in reference or reference[key].shape != (n,):
            raise UserError(f"reference log-probs do not match the pairs ({key})")
    out_dir.mkdir(parents=True, exist_ok=True)
    ref_c, ref_r = reference["train.chosen"], reference["train.rejected"]

    def checkpoint():
        state["rng"] = rng.bit_generator.state
        save_dpo_checkpoint(out_dir, model, tokenizer, opt, state, reference)

    def held_out() -> dict:
        m = evaluate_dpo(model, val, reference["val.chosen"], reference["val.rejected"], beta, pad_id,
                         workspaces=workspaces)
        return {f"val_{k}": v for k, v in m.items()}

    start_step = state["step"]
    end = min(tcfg.steps, start_step + (stop_after or tcfg.steps))
    bar = make_bar(progress, start_step, tcfg.steps, "dpo")
    metrics: dict = {}
    t_run = time.perf_counter()
    with StopRequest() as stop, open(log_path, "a") as log:
        for step in range(start_step, end):
            t0 = time.perf_counter()
            lr = lr_schedule(step, tcfg.lr, tcfg.warmup, tcfg.steps, tcfg.final_lr_frac)
            grads, parts = None, []
            for _ in range(tcfg.grad_accum):
                idx = rng.choice(len(train), micro, replace=False)
                batch = train.batch(idx, pad_id, cfg.ctx_len)
                todo = np.isnan(ref_c[idx])
                if todo.any():  # first time these pairs are drawn: the reference's log-probs, once
                    lp, _ = sequence_logprobs_forward(cfg, reference_model.params, batch.inputs, batch.targets,
                                                      batch.mask, ref_ws)
                    ref_c[idx[todo]], ref_r[idx[todo]] = lp[:micro][todo], lp[micro:][todo]
                loss, m, g = dpo_loss_and_grads(cfg, model.params, batch, ref_c[idx], ref_r[idx], beta, workspaces,
                                                nll_weight)
                parts.append(m | {"loss": loss})
                if grads is None:
                    grads = g
                else:
                    for name in grads:
                        grads[name] += g[name]
            if tcfg.grad_accum > 1:
                for g in grads.values():
                    g *= g.dtype.type(1.0 / tcfg.grad_accum)
            m = {k: float(np.mean([p[k] for p in parts])) for k in parts[0]}
            if not math.isfinite(m["loss"]):
                raise TrainingDiverged(f"DPO loss became {m['loss']} at step {step + 1}; stopped without saving — "
                                       f"the last good checkpoint in {out_dir} is untouched (try a lower --lr)")
            grad_norm = clip_grad_norm(grads, tcfg.grad_clip)
            opt.step(P1, grads, lr=lr)
            dt = time.perf_counter() - t0
            state["step"] = step + 1
            state["pairs_seen"] += tcfg.batch_size
            state["elapsed_s"] += dt
            metrics = {"step": step + 1, **m, "lr": lr, "grad_norm": grad_norm,
                       "pairs_per_s": tcfg.batch_size / dt, "elapsed_s": state["elapsed_s"]}
            if (step + 1) % tcfg.eval_every == 0 or step + 1 == tcfg.steps:
                metrics |= held_out()
                state["last_eval"] = {k: v for k, v in metrics.items() if k.startswith("val_")}
            log.write(json.dumps(metrics) + "\n")
            log.flush()
            if bar is not None:
                bar.update(1)
                bar.set_postfix({"loss": f"{m['loss']:.3f}", "margin": f"{m['reward_margin']:.2f}",
                                 "acc": f"{m['reward_accuracy']:.2f}"}, refresh=False)
            if (step + 1) % tcfg.ckpt_every == 0 or step + 1 in (end, tcfg.steps) or stop.requested:
                checkpoint()
            if stop.requested:
                break
        if bar is not None:
            bar.close()
    if state["step"] == start_step and start_step < end or not (out_dir / "trainer.json").exists():
        checkpoint()
    finished = state["step"] >= tcfg.steps
    if finished:
        plot_dpo_curves(log_path, out_dir / "curves.png")
    return {"step": state["step"], "steps": tcfg.steps, "finished": finished, "interrupted": stop.requested,
            "wall_s": time.perf_counter() - t_run, "initial_eval": state.get("initial_eval", {}), **metrics}


def plot_dpo_curves(log_path: Path, png_path: Path) -> None:
    """Training loss, reward margin and held-out accuracies against steps, as a PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .fileio import atomic_path
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
