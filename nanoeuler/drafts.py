"""Self-distillation of the draft heads: MTP heads 1..K-1 retrained to predict what head 0 will produce.

Speculative decoding (infer/speculative.py) drafts the tokens after the next one with heads 1..K-1 and keeps a draft
only where head 0 agrees. Pretraining teaches head k the *corpus* token k+1 positions ahead, but what a
draft is judged against is the token head 0 *generates* there, and the two differ: on the default-trained
`small` model head 1's greedy draft matched head 0's greedy choice 49-52 % of the time over 256-token
generations. With the trunk and head 0 frozen (never touched here), each draft head is a linear map on a
fixed feature, the final normed hidden state h_t, so matching the model itself is a cheap convex problem
(softmax regression, hidden states computed once), as Medusa's self-distillation:

    1. rollouts   from corpus prompts the model writes continuations by batched KV-cache decoding, greedily
                  (temperature 0) and by sampling (temperature 1); every position's h_t [d] is kept
    2. targets    head k at position t should say what head 0 says at t+k (which predicts token t+k+1):
                      target_t = softmax(W0 · h_{t+k} / tau)          [V]
                  tau = GREEDY_TAU on greedy rollouts (sharpened: a greedy draft is judged by its argmax,
                  and along a greedy rollout argmax(W0 h_{t+k}) is exactly the token at t+k+1), tau = 1 on
                  sampled ones (their average over the sampled tokens between t and t+k is the model's
                  own distribution of token t+k+1 given the prefix: what a sampled draft is judged against)
    3. fit        W_k <- argmin mean_t CE(softmax(W_k h_t), target_t): minibatch Adam from the pretrained W_k
    4. keep       draft acceptance measured on held-out rollouts before and after (greedy: argmax agrees;
                  temperature 0.8, top-k 40: sum min(p, q), the accept probability of speculative sampling);
                  the new heads are kept only when the expected tokens per round, greedy + sampled, rose

A worked picture (K = 3, a greedy rollout from prompt "To be", hidden states h_t):

    position t:     ...  "be"    ","     " or"   " not"
    head 0 (argmax):     ","     " or"   " not"  " to"          <- the rollout itself
    head 1 target at "be":  head 0 at ","  -> " or"      head 2 target at "be": head 0 at " or" -> " not"

The variants compared on the default-trained `small` (1024 rollouts; acceptance of draft 1 measured by
speculative decoding itself, 6 prompts x 500 tokens, greedy with infer/speculative.py's lookup drafts / sampled at
T 0.8, top-k 40):

    pretrained heads                                   greedy 0.707   sampled 0.453
    greedy rollouts, hard targets (tau -> 0)           greedy 0.818   sampled 0.325   over-confident heads
    greedy rollouts, tau 0.5                           greedy 0.812   sampled 0.396
    half greedy (tau 0.5), half sampled (tau 1)        greedy 0.783   sampled 0.472   <- the default

Greedy-only targets win greedy acceptance but cost sampled acceptance; the mixture is the one variant that
beats the pretrained heads on both, so it is the default (SAMPLED_SHARE, GREEDY_TAU). Twice the rollouts
added ~1.5 points. Without lookup drafts the heads alone go 0.49 -> 0.69 (mixture) / 0.77 (greedy only).

Nothing but heads 1..K-1 changes: the trunk, head 0 and so the reported (head-0) validation loss are
bit-identical, and `distill_checkpoint` replaces model.safetensors atomically (checkpoint.save_files), under the
run lock. `nanoeuler train` runs this at the end of pretraining for K > 1 (--no-drafts skips it);
`nanoeuler drafts --ckpt RUN` runs it on any checkpoint (SFT, DPO, an import with --mtp K).
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .errors import UserError

GREEDY_TAU = 0.5        # target temperature on greedy rollouts
SAMPLED_SHARE = 0.5     # share of the rollouts that sample (temperature 1, tau 1); the rest are greedy
PROMPT_LENGTHS = (8, 16, 32, 64)  # prompt lengths cycled over rollout batches (cut to the context)
MAX_ROLLOUT = 128       # tokens per rollout, prompt included (or the context, if shorter)
EVAL_TEMPERATURE, EVAL_TOP_K = 0.8, 40  # the sampled acceptance reported (chat's and the bench's setting)
HIDDEN_BYTES = 256 << 20  # at most this much memory for the kept hidden states (fewer rollouts on big models)
EPOCHS, BATCH, MIN_STEPS = 3, 512, 300  # the fit: passes over the pairs, minibatch, and at least this many steps
ROLLOUTS = 1024         # default number of training rollouts, for `small` ...
WORK = 1.5e11           # ... and at most this many parameter x token products of rollouts (~12 for `gpt`'s 116M)


def default_rollouts(cfg) -> int:
    """How many rollouts `nanoeuler train` and `nanoeuler drafts` make by default: ROLLOUTS, fewer for big
    models so that the work stays bounded (CPU decoding).  small -> 1024, big -> 106, gpt -> 10"""
    L = min(cfg.ctx_len, MAX_ROLLOUT)
    return max(8, min(ROLLOUTS, int(WORK / (L * cfg.n_params()))))


def head_matrix(P: dict, k: int) -> np.ndarray:
    """Head k's matrix [V, d] (arch gpt2's head 0 is the tied embedding)."""
    from .model import head_weight
    return head_weight(P, k)


def softmax(z: np.ndarray) -> np.ndarray:
    """Row-wise softmax of z [..., V], in place when z is a float array.  softmax(np.log([[1., 3.]])) -> [[.25, .75]]"""
    z = z if np.issubdtype(z.dtype, np.floating) else z.astype(np.float64)
    z -= z.max(-1, keepdims=True)
    np.exp(z, out=z)
    z /= z.sum(-1, keepdims=True)
    return z


# ---- 1. rollouts ---------------------------------------------------------------------------------
def rollouts(model, prompts: np.ndarray, n_new: int, temperature: float, rng: np.random.Generator,
             batch: int = 64, top_k: int | None = None, tick=None) -> tuple[np.ndarray, np.ndarray]:
    """Continue each prompt (int [N, Lp]) by n_new tokens, greedily (temperature 0) or by sampling
    -> (tokens int [N, Lp + n_new], hidden [N, Lp + n_new, d]): hidden[:, t] is the final normed hidden
    state after token t, from which head k predicts token t+k+1. Batched KV-cache decoding (infer/step.py's
    forward_hidden), `batch` sequences at a time; tick(n) is called after each batch of n rollouts."""
    from .infer.cache import new_cache
    from .infer.sampling import scaled_logits
    from .infer.step import forward_hidden, fuse_weights
    cfg = model.config
    N, Lp = prompts.shape
    L = Lp + n_new
    if L > cfg.ctx_len:
        raise UserError(f"a rollout of {L} tokens does not fit the context of {cfg.ctx_len}")
    P = {n: p.astype(np.float32) for n, p in model.params.items()}  # float16 models: as decoding computes
    W = fuse_weights(cfg, P, batched=True)
    W0 = head_matrix(P, 0)
    tokens = np.zeros((N, L), dtype=np.int64)
    tokens[:, :Lp] = prompts
    hidden = np.zeros((N, L, cfg.dim), dtype=np.float32)
    for b0 in range(0, N, batch):
        rows = slice(b0, min(N, b0 + batch))
        cache = new_cache(cfg, rows.stop - rows.start, L)
        hidden[rows, :Lp] = forward_hidden(cfg, W, tokens[rows, :Lp], cache)  # [B, Lp, d]
        for t in range(Lp, L):
            z = hidden[rows, t - 1] @ W0.T  # head 0's logits [B, V]
            if temperature == 0:
                nxt = z.argmax(-1)
            else:  # Gumbel-max: argmax(z + Gumbel noise) is a draw from softmax(z), for every row at once
                z = scaled_logits(z, temperature, top_k)
                nxt = (z + rng.gumbel(size=z.shape)).argmax(-1)
            tokens[rows, t] = nxt
            hidden[rows, t] = forward_hidden(cfg, W, nxt[:, None], cache)[:, 0]
        if tick is not None:
            tick(rows.stop - rows.start)
    return tokens, hidden


# ---- 2 + 3. targets and the fit ------------------------------------------------------------------
def pairs(hidden: np.ndarray, start: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Training pairs of head k from rollouts whose generated tokens begin at `start` (the prompt length):
    (features h_t, target source h_{t+k}) for t = start-1 .. L-1-k, each [n, d]. Position start-1, the
    prompt's last, is where the first draft of a generation is made."""
    N, L, d = hidden.shape
    t = np.arange(start - 1, L - k)
    return hidden[:, t].reshape(-1, d), hidden[:, t + k].reshape(-1, d)


def fit_head(Wk: np.ndarray, X: np.ndarray, S: np.ndarray, W0: np.ndarray, tau: np.ndarray,
             rng: np.random.Generator, steps: int, batch: int = 512, lr: float = 2e-3, tick=None) -> np.ndarray:
    """Softmax regression from the start Wk [V, d]: minimise mean CE(softmax(X Wk^T), softmax(S W0^T / tau))
    over rows (X, S [n, d], tau [n, 1]) by `steps` minibatch Adam steps (reshuffled epochs) -> the new Wk.
    The gradient of the mean cross-entropy with respect to Wk is (softmax(X Wk^T) - target)^T X / n.
    tick() after each step."""
    W = Wk.astype(np.float32)  # a copy
    m, v = np.zeros_like(W), np.zeros_like(W)
    b1, b2 = 0.9, 0.999
    order, i = rng.permutation(len(X)), 0
    for step in range(1, steps + 1):
        if i >= len(X):
            order, i = rng.permutation(len(X)), 0
        idx = order[i:i + batch]
        i += batch
        x = X[idx]                                           # [b, d]
        target = S[idx] @ W0.T                               # [b, V]
        target *= 1 / tau[idx]
        p = softmax(x @ W.T)                                 # [b, V]
        p -= softmax(target)
        g = p.T @ x / len(idx)                               # [V, d]
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        W -= lr * (m / (1 - b1 ** step)) / (np.sqrt(v / (1 - b2 ** step)) + 1e-8)
        if tick is not None:
            tick()
    return W


# ---- 4. acceptance -------------------------------------------------------------------------------
def greedy_acceptance(heads: list[np.ndarray], tokens: np.ndarray, hidden: np.ndarray, start: int) -> list[float]:
    """Along greedy rollouts: for each draft j = 1..K-1, P(head j's argmax at t is the token at t+j+1 |
    drafts 1..j-1 at t were right), the acceptance a greedy verification of drafts 1..j observes."""
    N, L, d = hidden.shape
    K = len(heads)
    t = np.arange(start - 1, L - K)
    alive = np.ones((N, len(t)), dtype=bool)
    out = []
    for j in range(1, K):
        right = (hidden[:, t] @ heads[j].T).argmax(-1) == tokens[:, t + j + 1]  # [N, len(t)]
        out.append(float((right & alive).sum() / max(1, alive.sum())))
        alive &= right
    return out


def sampled_acceptance(heads: list[np.ndarray], hidden: np.ndarray, start: int, temperature: float = EVAL_TEMPERATURE,
                       top_k: int | None = EVAL_TOP_K) -> list[float]:
    """Along sampled rollouts: for each draft j, the mean of sum min(p, q), the probability speculative
    sampling accepts draft j (q: head j at t, p: head 0 at t+j, both as sampling.token_probs makes them)."""
    N, L, d = hidden.shape
    K = len(heads)
    t = np.arange(start - 1, L - K)
    out = []
    for j in range(1, K):
        q = _probs(hidden[:, t] @ heads[j].T, temperature, top_k)
        p = _probs(hidden[:, t + j] @ heads[0].T, temperature, top_k)
        out.append(float(np.minimum(p, q).sum(-1).mean()))
    return out


def _probs(z: np.ndarray, temperature: float, top_k: int | None) -> np.ndarray:
    """sampling.token_probs (without top_p) on every row of z [..., V] at once."""
    from .infer.sampling import scaled_logits
    return softmax(scaled_logits(z, temperature, top_k))


# ---- the whole procedure -------------------------------------------------------------------------
@dataclass
class Distilled:
    """What `distill` returns: the draft heads (name -> [V, d]) and the held-out acceptance around it."""
    heads: dict
    greedy_before: list
    greedy_after: list
    sampled_before: list
    sampled_after: list
    kept: bool              # the new heads are better (greedy + sampled) and were returned; else the old ones
    rollouts: int
    pairs: int
    seconds: float
    detail: dict = field(default_factory=dict)

    def summary(self) -> str:
        """One line for a log.  e.g. 'draft heads distilled in 41 s (1024 rollouts): greedy acceptance
        0.57/0.62 -> 0.77/0.76, sampled (T 0.8) 0.48/0.33 -> 0.46/0.31'"""
        f = lambda xs: "/".join(f"{x:.2f}" for x in xs)  # noqa: E731
        verdict = "distilled" if self.kept else "kept as they were (distillation did not raise acceptance)"
        return (f"draft heads {verdict} in {self.seconds:.0f} s ({self.rollouts} rollouts, held-out acceptance "
                f"of drafts 1..{len(self.greedy_before)}): greedy {f(self.greedy_before)} -> {f(self.greedy_after)}, "
                f"sampled (T {EVAL_TEMPERATURE:g}) {f(self.sampled_before)} -> {f(self.sampled_after)}")


def distill(model, train_prompts, held_prompts, n_rollouts: int = ROLLOUTS, seed: int = 0, epochs: int = EPOCHS,
            progress: bool = True, greedy_tau: float = GREEDY_TAU, sampled_share: float = SAMPLED_SHARE) -> Distilled:
    """Distill heads 1..K-1 of `model` (not modified) toward its head 0.

    train_prompts / held_prompts: fn(rng, n, length) -> int [n, length] corpus windows (TokenShards.sample_batch
    or `TextPrompts`), for the training rollouts and for the held-out ones that measure acceptance.
    n_rollouts: training rollouts (cut so that their hidden states fit HIDDEN_BYTES); held-out: 1/4 as many."""
    cfg = model.config
    K = cfg.n_mtp
    if K < 2:
        raise UserError("this model has a single output head (n_mtp 1): no draft heads to distill")
    if type(n_rollouts) is not int or n_rollouts < 8:
        raise UserError("need at least 8 rollouts")
    t0 = time.perf_counter()
    L = min(cfg.ctx_len, MAX_ROLLOUT)
    lengths = sorted({max(1, min(p, L // 2)) for p in PROMPT_LENGTHS})
    n_rollouts = max(8, min(n_rollouts, HIDDEN_BYTES // (L * cfg.dim * 4)))
    n_held = max(8, n_rollouts // 4)
    P = model.params
    heads = [head_matrix(P, k).astype(np.float32) for k in range(K)]
    W0 = heads[0]
    rng = np.random.default_rng(seed)

    # the plan: (temperature, prompt length, count) per group of rollouts; held-out groups at the eval settings
    n_sampled = int(round(n_rollouts * sampled_share))
    plan = [(0.0, None, n_rollouts - n_sampled), (1.0, None, n_sampled)]
    groups = [(T, Lp, n // len(lengths) + (i < n % len(lengths))) for T, _, n in plan for i, Lp in enumerate(lengths)]
    groups = [g for g in groups if g[2] > 0]
    Lh = lengths[len(lengths) // 2]
    bar = _progress(progress, n_rollouts + 2 * n_held)  # the fit's minibatches are added once known

    def tick(n=1):
        if bar is not None:
            bar.update(n)

    if bar is not None:
        bar.set_description("drafts: rollouts")
    held_g = rollouts(model, held_prompts(rng, n_held, Lh), L - Lh, 0.0, rng, tick=tick)
    held_s = rollouts(model, held_prompts(rng, n_held, Lh), L - Lh, EVAL_TEMPERATURE, rng, top_k=EVAL_TOP_K, tick=tick)
    data = [(T, Lp) + rollouts(model, train_prompts(rng, n, Lp), L - Lp, T, rng, tick=tick) for T, Lp, n in groups]

    new, n_pairs, fits = [W0], 0, []
    for k in range(1, K):
        X, S, tau = [], [], []
        for T, Lp, _, hidden in data:
            x, s = pairs(hidden, Lp, k)
            X.append(x)
            S.append(s)
            tau.append(np.full((len(x), 1), greedy_tau if T == 0 else 1.0, np.float32))
        fits.append((np.concatenate(X), np.concatenate(S), np.concatenate(tau)))
    steps = [max(MIN_STEPS, epochs * -(-len(X) // BATCH)) for X, _, _ in fits]
    if bar is not None:
        bar.set_description("drafts: fit")
        bar.total += sum(steps)
        bar.refresh()
    for k, ((X, S, tau), n_steps) in enumerate(zip(fits, steps), start=1):
        n_pairs += len(X)
        new.append(fit_head(heads[k], X, S, W0, tau, rng, n_steps, BATCH, tick=tick))
    if bar is not None:
        bar.close()

    g0, g1 = greedy_acceptance(heads, *held_g, Lh), greedy_acceptance(new, *held_g, Lh)
    s0, s1 = sampled_acceptance(heads, held_s[1], Lh), sampled_acceptance(new, held_s[1], Lh)
    kept = _tokens_per_round(g1) + _tokens_per_round(s1) > _tokens_per_round(g0) + _tokens_per_round(s0)
    out = {f"heads.{k}.weight": (new if kept else heads)[k].astype(P[f"heads.{k}.weight"].dtype) for k in range(1, K)}
    return Distilled(out, g0, g1, s0, s1, kept, n_rollouts, n_pairs, time.perf_counter() - t0)


def _tokens_per_round(rates: list[float]) -> float:
    """Expected tokens of a round verifying every draft: 1 + r1 + r1·r2 + ...  [.5, .5] -> 1.75"""
    total, chance = 1.0, 1.0
    for r in rates:
        chance *= r
        total += chance
    return total


def _progress(on: bool, total: int):
    if not on:
        return None
    from tqdm import tqdm
    return tqdm(total=total, unit="step", leave=False, dynamic_ncols=True)


# ---- prompts -------------------------------------------------------------------------------------
class TextPrompts:
    """Corpus windows from an encoded text: prompts(rng, n, length) -> int [n, length] at random starts
    (the interface of TokenShards.sample_batch, for a checkpoint without its token shards)."""

    def __init__(self, ids: np.ndarray):
        self.ids = np.asarray(ids, dtype=np.int64)

    def __call__(self, rng: np.random.Generator, n: int, length: int) -> np.ndarray:
        if len(self.ids) < length + 1:
            raise UserError(f"the prompt text is too short: {len(self.ids)} tokens, need more than {length}")
        starts = rng.integers(0, len(self.ids) - length + 1, size=n)
        return self.ids[starts[:, None] + np.arange(length)]


def text_prompts(text: str, tokenizer, held_share: float = 0.1) -> tuple[TextPrompts, TextPrompts]:
    """(train, held-out) prompts from a text: its first 90 % and its last 10 %, encoded."""
    cut = int(len(text) * (1 - held_share))
    return TextPrompts(tokenizer.encode(text[:cut])), TextPrompts(tokenizer.encode(text[cut:]))


def prompt_sources(tokenizer, data=None, text_files=None, n_chars: int = 400_000) -> tuple:
    """(train, held-out) prompt sources, fn(rng, n, length) -> int [n, length]: token shards `data` made with
    this tokenizer (train split; held out: val), else text files (the first n_chars, encoded), else the
    bundled corpus (train works; held out: the validation works) through the tokenizer, so any checkpoint
    (an import's, an SFT run's) gets prompts."""
    if data is not None:
        from .data.shards import TokenShards
        train = TokenShards(data, "train")
        train.check_tokenizer(tokenizer.fingerprint())
        try:
            held = TokenShards(data, "val")
        except UserError:  # no validation split: other windows of the train split
            held = train
        return train.sample_batch, held.sample_batch
    if text_files:
        return text_prompts("\n\n".join(_read_text(f, n_chars) for f in text_files)[:n_chars], tokenizer)
    from .data.corpus import bundled_split, bundled_works
    works = bundled_works()
    train_names, val_names = bundled_split()
    return (TextPrompts(tokenizer.encode("\n\n".join(works[n] for n in train_names)[:n_chars])),
            TextPrompts(tokenizer.encode("\n\n".join(works[n] for n in val_names)[:n_chars // 4])))


def _read_text(path, n_chars: int) -> str:
    """The first n_chars characters of a UTF-8 text file (undecodable bytes replaced); one-line errors."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"prompt text {path}: {'is a directory' if path.is_dir() else 'not found'}")
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read(n_chars)


# ---- a checkpoint --------------------------------------------------------------------------------
def distill_checkpoint(run_dir, data=None, text_files=None, n_rollouts: int | None = None, seed: int = 0,
                       progress: bool = True, dry_run: bool = False, finish_run: bool = False) -> Distilled:
    """Distill the draft heads of the checkpoint in run_dir and replace its model.safetensors (atomically,
    under the run lock; nothing else in the directory changes). Prompts: see `prompt_sources`.
    n_rollouts: default_rollouts(config) if None. dry_run: measure only; nothing on disk changes.
    finish_run: the end of pretraining; trainer.json's phase "drafts" becomes "done" in the same atomic save."""
    from .checkpoint import (check_trainer_state, json_writer, load_model, load_tokenizer, read_json, run_lock,
                             save_files, tensors_writer)
    from .fileio import check_real_dir
    from .model import Model
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UserError(f"checkpoint directory {run_dir} not found")
    if not dry_run:
        check_real_dir(run_dir, "--ckpt")     # changed in place: never through a link
    with run_lock(run_dir) if not dry_run else contextlib.nullcontext():
        config, params = load_model(run_dir, read_only=dry_run)
        tok = load_tokenizer(run_dir, read_only=dry_run)
        model = Model(config, params)
        if config.n_mtp < 2:
            raise UserError(f"{run_dir} has a single output head (n_mtp 1): nothing to distill "
                            f"(`nanoeuler import --mtp K` adds draft heads to an import)")
        train, held = prompt_sources(tok, data, text_files)
        result = distill(model, train, held, n_rollouts or default_rollouts(config), seed, progress=progress)
        writers = {}
        if result.kept and not dry_run:
            writers["model.safetensors"] = tensors_writer(dict(params) | result.heads,
                                                          what="refusing to save the weights")
        if finish_run:
            state = check_trainer_state(read_json(run_dir / "trainer.json", "resume state"), run_dir / "trainer.json")
            writers["trainer.json"] = json_writer(state | {"phase": "done"})
        if writers:
            save_files(run_dir, writers)
    return result
