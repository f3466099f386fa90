"""DPO's data: pair files ({prompt, chosen, rejected} JSONL), the held-out split, tokenizing pairs into
padded chosen/rejected batches, the offline pair set built from the offline instruction set, and
on-policy negatives (the SFT model's own wrong answers as rejected responses).

Pair data is JSONL, one object per line: {"prompt": ..., "chosen": ..., "rejected": ...}, optionally
with "messages" (the conversation before the reply, [{"role", "content"}, ...]). With messages, each
sequence is rendered with the model's chat template (chat_template.example: the loss mask covers the
reply and its end-of-turn token), and `prompt` is only a readable copy; without, `prompt` is text already
rendered up to the reply (the SPEC Alpaca template up to and including "### Response:\\n") and `chosen`
and `rejected` are followed by </s>. `dpo-data` writes both. Optional extra fields (`task`, ...) are
carried along and used to break results down.

    train, held, data_id, n_bad = pair_records("pairs.jsonl", None)        # 1 in 50 prompts held out
    tp = tokenize_pairs(tok, train, ctx_len=128)
    batch = tp.batch([0, 1], pad_id=tok.eos_id, ctx_len=128)               # rows: 2 chosen, then 2 rejected
"""
from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import UserError


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
    m = rec.get("messages", [])
    if not (isinstance(m, list) and all(isinstance(x, dict) and isinstance(x.get("role"), str)
                                        and isinstance(x.get("content"), str) for x in m)):
        return "\"messages\" must be a list of {\"role\": str, \"content\": str}"
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


def tokenize_response(tok, p: dict, response: str) -> tuple[np.ndarray, np.ndarray]:
    """A pair's prompt + response -> (ids, mask): through the chat template when the pair has messages
    (the same ids and mask as `sft.render`), else prompt text + response + </s>."""
    if "messages" in p:
        from ..chat_template import example
        ids, mask = example(tok, p["messages"], response)
        return np.asarray(ids, dtype=np.int64), np.asarray(mask, dtype=bool)
    prompt = pair_prompt_ids(tok, p)
    ids = np.asarray(prompt + tok.encode(response) + [tok.eos_id], dtype=np.int64)
    mask = np.zeros(len(ids), dtype=bool)
    mask[len(prompt):] = True
    return ids, mask


def pair_prompt_ids(tok, p: dict) -> list[int]:
    """What the model answers for pair p: its messages through the chat template, else its prompt text."""
    if "messages" in p:
        from ..chat_template import prompt_ids
        return prompt_ids(tok, p["messages"])
    return tok.encode(p["prompt"], add_bos=True)


def tokenize_pairs(tok, pairs: list[dict], ctx_len: int) -> TokenizedPairs:
    """Tokenize every pair into sequences of at most ctx_len + 1 tokens (ctx_len inputs, ctx_len targets).
    A pair that is longer loses the start of its prompt — the same left truncation generation applies to
    a long prompt, so the log-probs are those of the context the model answers in — and is counted as
    truncated; both responses keep the same prompt tokens. A pair whose responses alone do not fit is
    dropped (counted)."""
    out = TokenizedPairs([], [], [])
    for p in pairs:
        c, r = tokenize_response(tok, p, p["chosen"]), tokenize_response(tok, p, p["rejected"])
        cut = max(len(c[0]), len(r[0])) - (ctx_len + 1)
        if cut >= min(int(np.argmax(c[1])), int(np.argmax(r[1]))):  # the cut would reach a response
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
    from .sft import WORD_RE, normalize, offline_instructions, prompt_text, user_message
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
            pairs.append({"prompt": prompt_text(r["instruction"], r["input"]),
                          "messages": [user_message(r["instruction"], r["input"])], "chosen": r["output"],
                          "rejected": wrong, "task": r["task"]})
        out.append(pairs)
    return out[0], out[1]


def model_answers(model, prompts: list[list[int]], stop_ids: list[int], max_new_tokens: int = 16,
                  progress: bool = True) -> list[tuple[list[int], bool]]:
    """Greedy answers to many prompts at once, each ending at any of stop_ids -> [(new ids without the stop
    id, stopped?)], in order.

    The prompts share forward passes through the serving engine's continuous batching (infer/engine.py:
    a request's greedy tokens there equal `generate`'s) instead of one prompt after another. Each prompt keeps its last ctx_len tokens."""
    from tqdm import tqdm

    from ..infer.engine import Batcher, Job
    answers: list = [None] * len(prompts)
    stops = tuple(stop_ids)
    engine = Batcher(model, max_batch=32, max_queue=max(1, len(prompts)))
    bar = tqdm(total=len(prompts), desc="model answers", unit="prompt", dynamic_ncols=True, disable=not progress)

    def collect(i):
        made = []

        def on_event(kind, *args):
            if kind == "token" and args[0] not in stops:
                made.append(int(args[0]))
            elif kind == "done":
                answers[i] = (made, args[0] == "stop")
                bar.update(1)
            elif kind == "error":  # the engine failed on this prompt (a bug): said after the loop
                failed.append(args[0])
        return on_event

    failed: list[str] = []
    for i, ids in enumerate(prompts):
        engine.submit(Job(list(ids), max_new_tokens, temperature=0.0, stop_ids=stops, on_event=collect(i)))
    while engine.step():
        pass
    bar.close()
    if failed:
        raise RuntimeError(failed[0])
    return answers


def model_negatives(model, tok, pairs: list[dict], max_new_tokens: int = 16, progress: bool = True) -> tuple[list[dict], int]:
    """On-policy wrong answers: for each pair of a scored task, the model's own greedy answer replaces
    `rejected` when it is wrong (non-empty, ends with </s> or its template's end of turn: `tok.stop_ids`,
    differs from chosen after `sft.normalize`) —
    the mistakes this model actually makes, which rule-made negatives rarely are. Other pairs are kept.
    -> (new pairs, number replaced). Each replaced pair gets "rejected_source": "model"."""
    from .sft import SCORED, normalize
    asked = [i for i, p in enumerate(pairs) if p.get("task", "") in SCORED or not p.get("task")]
    if progress:
        print(f"answering {len(asked):,} training questions with the model (greedy, up to {max_new_tokens} tokens "
              f"each; --n-train N asks only the first N pairs)", file=sys.stderr)
    answers = model_answers(model, [pair_prompt_ids(tok, pairs[i]) for i in asked], tok.stop_ids, max_new_tokens,
                            progress)
    out, replaced = list(pairs), 0
    for i, (ids, stopped) in zip(asked, answers):
        answer = tok.decode(ids).strip()
        if stopped and answer and "###" not in answer and normalize(answer) != normalize(pairs[i]["chosen"]):
            out[i] = pairs[i] | {"rejected": answer, "rejected_source": "model"}
            replaced += 1
    return out, replaced


def pair_records(data: str, val: str | None, fits=None) -> tuple[list[dict], list[dict], str, int]:
    """(train pairs, held-out pairs, data id, invalid lines skipped) for --data/--val:
    'offline' = `offline_pairs(fits=fits)` (held-out: --val, else its own); a JSONL file = its pairs (held-out:
    --val, else 1 in 50 by prompt hash)."""
    if data == "offline":
        train, held = offline_pairs(fits=fits)
        data_id, bad = "offline-pairs-v2" if fits else "offline-pairs-v1", []
    else:
        train, bad = load_pairs(data)
        data_id = hashlib.sha1(Path(data).read_bytes()).hexdigest()[:16]
        if bad:
            print(f"warning: skipped {len(bad)} invalid pair(s) in {data}, e.g. {bad[0]}")
    if val:
        held, bad_val = load_pairs(val)
        bad += bad_val
        data_id += "+" + hashlib.sha1(Path(val).read_bytes()).hexdigest()[:16]
    elif data != "offline":
        train, held = split_pairs(train)
        if not held:
            raise UserError(f"no held-out pair: {data} is too small to hold 1 in 50 out; pass --val FILE")
    return train, held, data_id, len(bad)
