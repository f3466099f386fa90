"""Supervised fine-tuning data: the Alpaca template, rendering to (ids, mask), packing, the SFT batch
source, the offline instruction set made from the bundled corpus, and scoring of generated answers.

`render` (`render_all`: many records) is the one way a record becomes (ids, mask), through the chat template
(chat_template.example). The mask is True exactly on the response tokens and the closing `</s>`; the prompt
(and padding) carry no loss. A template that marks the assistant's turn with `{% generation %}` blocks sets
the mask itself: the tokens in its blocks, as transformers' `return_assistant_tokens_mask`
(chat_template.generation_masked).

    render(tok, "Say hi.", "", "Hi")   ->  ids  = [<Below is ... ### Response:\\n>] + [<Hi>] + [</s>]
                                          mask = [False] * n_prompt           + [True] + [True]

Training rows are T + K tokens (inputs are the first T, MTP head k's target for input t is token t+1+k;
see ops.mtp_targets); an example counts toward a target only where its mask is True, so with packing
(several examples back to back in one row) no head is ever trained to predict the next example's prompt.

The offline instruction set turns lines of the bundled Shakespeare into questions a `small` model can
learn (first / last word of a line, which play, which character, continue the speech); the held-out
split uses lines that never appear in the training split.
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from ..chat_template import HEADER
from ..errors import UserError


# ---- the template: the one rendering function ----------------------------------------------------
def prompt_text(instruction: str, input: str = "") -> str:
    """The SPEC template up to and including '### Response:\\n' (the `### Input:` block only with an input)."""
    text = HEADER + "### Instruction:\n" + instruction + "\n\n"
    if input:
        text += "### Input:\n" + input + "\n\n"
    return text + "### Response:\n"


def render(tok, instruction: str, input: str = "", output: str | None = None) -> tuple[list[int], list[bool]]:
    """One example -> (ids, mask), through the tokenizer's chat template (chat_template.py; ours renders
    `prompt_text` + output + </s>). mask is True on the response tokens and its end-of-turn token, False on
    the prompt (or, with a template that has {% generation %} blocks, on the tokens in them). With output=None
    only the prompt is rendered (what chat and evaluation feed the model)."""
    from ..chat_template import example, prompt_ids
    messages = [user_message(instruction, input)]
    if output is None:
        ids = prompt_ids(tok, messages)
        return ids, [False] * len(ids)
    return example(tok, messages, output, generation=True)


def user_message(instruction: str, input: str = "") -> dict:
    """An instruction record as a chat message: the content joins instruction and input by a blank line
    (for any template); ours (Alpaca) reads the two apart, from "instruction" and "input"."""
    return {"role": "user", "content": instruction + ("\n\n" + input if input else ""),
            "instruction": instruction, "input": input}


# ---- loading -------------------------------------------------------------------------------------
def load_examples(path: str | Path) -> tuple[list[dict], list[str]]:
    """An Alpaca-format JSON list (or JSON Lines) of {instruction, input, output} -> (valid records, problems).
    Raises UserError when the file is unreadable or holds no valid record."""
    from ..data.sources import validate_alpaca
    path = Path(path)
    if not path.is_file():
        raise UserError(f"SFT data {path} not found")
    try:
        text = path.read_text(encoding="utf-8")
        names = None
        if path.suffix == ".jsonl":              # errors name the file's line, not the record's index
            records, names = [], []
            for lineno, line in enumerate(text.splitlines(), 1):
                if line.strip():
                    try:
                        records.append(json.loads(line))
                    except (ValueError, RecursionError) as e:
                        raise UserError(f"SFT data {path}, line {lineno}: not valid JSON ({e})") from None
                    names.append(f"line {lineno}")
        else:
            records = json.loads(text)
    except (ValueError, RecursionError) as e:   # not UTF-8, not JSON, nested too deep
        raise UserError(f"SFT data {path} is not valid JSON ({str(e)[:120]})") from None
    good, bad = validate_alpaca(records, names)
    if not good:
        raise UserError(f"SFT data {path} holds no valid record" + (f" ({bad[0]})" if bad else ""))
    return good, bad


def split_heldout(records: list[dict], every: int = 50) -> tuple[list[dict], list[dict]]:
    """(train, held-out): a record is held out when the hash of its instruction+input falls in 1/every.
    Deterministic and stable when records are added or reordered."""
    train, held = [], []
    for r in records:
        h = int(hashlib.sha1((r["instruction"] + "\x00" + r["input"]).encode()).hexdigest()[:8], 16)
        (held if h % every == 0 else train).append(r)
    return train, held


@dataclass
class Rendered:
    """Rendered examples that fit a row of `length` tokens, and what happened to the rest."""
    examples: list[tuple[np.ndarray, np.ndarray]]  # (ids int32 [n], mask bool [n])
    truncated: int = 0   # response cut to fit (its </s> lost)
    dropped: int = 0     # prompt alone does not fit: left out


def render_all(tok, records: list[dict], length: int) -> Rendered:
    """Render every record (as `render` does, many to a trip to the template worker); an example longer than
    `length` keeps its prompt and as much of the response as fits (counted as truncated), or is dropped when
    not even one response token fits."""
    from ..chat_template import examples
    out = Rendered([])
    items = [([user_message(r["instruction"], r["input"])], r["output"]) for r in records]
    for ids, mask in examples(tok, items, generation=True):
        if len(ids) > length:
            n_prompt = mask.index(True)
            if n_prompt >= length:
                out.dropped += 1
                continue
            ids, mask = ids[:length], mask[:length]
            out.truncated += 1
        out.examples.append((np.asarray(ids, dtype=np.int64), np.asarray(mask, dtype=bool)))
    return out


def pack_rows(examples, length: int, pad_id: int, pack: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Lay examples out in rows of `length` tokens: back to back while they fit (pack=True) or one per row;
    the rest of a row is pad_id with mask False. -> tokens int64 [N, length], mask bool [N, length].

        pack_rows([([1, 2], [F, T]), ([3], [T]), ([4, 5], [F, T])], 4, pad_id=0)
          tokens [[1, 2, 3, 0], [4, 5, 0, 0]]     mask [[F, T, T, F], [F, T, F, F]]
    """
    rows_t, rows_m = [], []
    row_t, row_m = [], []
    for ids, mask in examples:
        if row_t and (not pack or len(row_t) + len(ids) > length):
            rows_t.append(row_t)
            rows_m.append(row_m)
            row_t, row_m = [], []
        row_t = row_t + list(ids)
        row_m = row_m + list(mask)
    if row_t:
        rows_t.append(row_t)
        rows_m.append(row_m)
    tokens = np.full((len(rows_t), length), pad_id, dtype=np.int64)
    masks = np.zeros((len(rows_t), length), dtype=bool)
    for i, (t, m) in enumerate(zip(rows_t, rows_m)):
        tokens[i, :len(t)] = t
        masks[i, :len(m)] = m
    return tokens, masks


# ---- the batch source for train.run_training -----------------------------------------------------
class SFTSource:
    """Batches of packed SFT rows for `train.run_training`: next_batch draws examples at random (with the
    trainer's rng, so a resumed run sees the same batches) and packs them into batch_size rows of T+K tokens;
    the validation set is packed once, in order. Loss is on masked positions only."""

    def __init__(self, tok, train_records: list[dict], val_records: list[dict], batch_size: int, ctx: int,
                 n_mtp: int, pack: bool = True, data_id: str = ""):
        self.length = ctx + n_mtp  # a row: T inputs + K more targets
        self.max_example = ctx + 1
        self.batch_size, self.pack, self.pad_id, self.data_id = batch_size, pack, tok.eos_id, data_id
        # an example of up to T+1 tokens has every response token and its </s> as a head-0 target
        self.train = render_all(tok, train_records, self.max_example)
        self.val = render_all(tok, val_records, self.max_example)
        if not self.train.examples:
            raise UserError(f"no SFT example fits the context of {ctx} tokens (prompt alone too long)")
        if not self.val.examples:
            raise UserError("the SFT validation split is empty (too few records to hold 1 in 50 out: pass --val FILE)")
        self.val_rows = pack_rows(self.val.examples, self.length, self.pad_id, pack)
        self.bytes_per_token = None  # SFT reports the masked loss, not bits per byte

    def next_batch(self, rng: np.random.Generator):
        """-> tokens int64 [B, T+K], mask bool [B, T+K]. Examples are drawn until B rows are full (the one
        that overflows the last row is discarded)."""
        drawn, n_rows, used = [], 0, 0
        while True:
            ex = self.train.examples[int(rng.integers(len(self.train.examples)))]
            if used and (not self.pack or used + len(ex[0]) > self.length):
                n_rows += 1
                if n_rows == self.batch_size:
                    break
                used = 0
            drawn.append(ex)
            used += len(ex[0])
        return pack_rows(drawn, self.length, self.pad_id, self.pack)  # the same greedy layout: B rows

    def eval_batches(self):
        tokens, mask = self.val_rows
        for i in range(0, len(tokens), self.batch_size):
            yield tokens[i:i + self.batch_size], mask[i:i + self.batch_size]

    def describe(self) -> dict:
        return {"kind": "sft", "data": self.data_id, "train_examples": len(self.train.examples),
                "val_examples": len(self.val.examples), "truncated": self.train.truncated + self.val.truncated,
                "dropped": self.train.dropped + self.val.dropped, "max_example": self.max_example,
                "batch_size": self.batch_size,
                "length": self.length, "pack": self.pack}


# ---- the offline instruction set (from the bundled corpus) --------------------------------------
TITLES = {"john": "King John", "lear": "King Lear", "tragedy_of_titus_andronicus": "Titus Andronicus",
          "alls_well_that_ends_well": "All's Well That Ends Well", "loves_labours_lost": "Love's Labour's Lost",
          "midsummer_nights_dream": "A Midsummer Night's Dream", "lovers_complaint": "A Lover's Complaint",
          "rape_of_lucrece": "The Rape of Lucrece", "tempest": "The Tempest", "sonnets": "The Sonnets",
          "phoenix_and_the_turtle": "The Phoenix and the Turtle", "passionate_pilgrim": "The Passionate Pilgrim",
          "taming_of_the_shrew": "The Taming of the Shrew", "winters_tale": "The Winter's Tale",
          "merry_wives_of_windsor": "The Merry Wives of Windsor", "comedy_of_errors": "The Comedy of Errors",
          "merchant_of_venice": "The Merchant of Venice", "two_gentlemen_of_verona": "The Two Gentlemen of Verona"}
ROMAN = {"i": "I", "ii": "II", "iii": "III", "iv": "IV", "v": "V", "vi": "VI", "viii": "VIII"}

TASKS = {  # task -> instruction phrasings (the first is the canonical one; chat users can type either)
    "first_word": ["What is the first word of this line?", "Give the first word of the line."],
    "last_word": ["What is the last word of this line?", "Give the last word of the line."],
    "play": ["What play is this line from?", "Which work is this line from?"],
    "speaker": ["Which character speaks this line?", "Who says this line?"],
    "continue": ["Continue this speech:", "What is the next line?"],
}
LINE_WORDS = (3, 8)  # short lines: with a 512-token vocabulary the template alone takes ~100 of small's 128
SCORED = ("first_word", "last_word", "play", "speaker")  # "continue" is open-ended: not scored
SPEAKER_RE = re.compile(r"^([A-Z][A-Za-z' ]{0,24}[A-Za-z])\.$")  # 'Hor.', 'PROSPERO.', 'First Lord.'
WORD_RE = re.compile(r"[A-Za-z][A-Za-z']*[A-Za-z]|[A-Za-z]")


def title_of(work: str) -> str:
    """'henry_iv_part_1' -> 'Henry IV Part 1', 'lear' -> 'King Lear'."""
    if work in TITLES:
        return TITLES[work]
    words = work.split("_")
    return " ".join(ROMAN.get(w, w if i and w in ("and", "of", "the") else w.capitalize()) for i, w in enumerate(words))


def corpus_lines(work: str, text: str) -> list[dict]:
    """Candidate lines of a work: {line, next, speaker} for lines of LINE_WORDS words (speaker '' outside plays).
    A speaker label is a short capitalised line ending in '.', after a blank line (e.g. 'Hor.')."""
    raw = text.splitlines()
    out, speaker = [], ""
    for i, line in enumerate(raw):
        s = line.strip()
        if not s:
            continue
        m = SPEAKER_RE.match(s)
        if m and (i == 0 or not raw[i - 1].strip()) and i + 1 < len(raw) and raw[i + 1].strip():
            speaker = m.group(1).title()
            continue
        if s.startswith("[") or s.isupper():
            continue
        nxt = raw[i + 1].strip() if i + 1 < len(raw) else ""
        if nxt.startswith("[") or SPEAKER_RE.match(nxt):
            nxt = ""
        if LINE_WORDS[0] <= len(s.split()) <= LINE_WORDS[1] and len(WORD_RE.findall(s)) >= 3:
            out.append({"work": work, "line": s, "next": nxt, "speaker": speaker})
    return out


def answer_for(task: str, item: dict) -> str | None:
    words = WORD_RE.findall(item["line"])
    if task == "first_word":
        return words[0]
    if task == "last_word":
        return words[-1]
    if task == "play":
        return title_of(item["work"])
    if task == "speaker":
        return item["speaker"] or None
    if task == "continue":
        return item["next"] if LINE_WORDS[0] <= len(item["next"].split()) <= LINE_WORDS[1] else None
    raise ValueError(task)


MAX_MISSES = 2000   # candidates in a row that `fits` refuses before the offline set is declared out of reach


def offline_instructions(n_train: int = 6000, n_heldout: int = 400, seed: int = 0,
                         fits: Callable[[dict], bool] | None = None, limit: str = "the model's context"
                         ) -> tuple[list[dict], list[dict]]:
    """(train, held-out) Alpaca records made from the bundled corpus. A line is held out when its hash
    falls in 1/10, so no held-out line (and no held-out continuation target) is seen in training.
    Half the records carry the line in `input`, half inline after the question (with an empty input),
    the way one types it into the chat: "What is the first word of this line? To be, or not to be".
    Each record also carries `task` and `line` (not used by the template) for scoring and tests.
    fits(record) -> bool skips candidates (e.g. those longer than a model's context, see `fits_context`);
    MAX_MISSES of them skipped in a row is a UserError (a context too short for the set; `limit` names it).

        {"instruction": "What play is this line from?", "input": "Good night, sweet prince,",
         "output": "Hamlet", "task": "play", "line": "Good night, sweet prince,"}
    """
    from ..data.corpus import bundled_works
    rng = np.random.default_rng(seed)
    pools: dict[bool, list[dict]] = {False: [], True: []}
    for work, text in bundled_works().items():
        for item in corpus_lines(work, text):
            held = int(hashlib.sha1(item["line"].encode()).hexdigest()[:8], 16) % 10 == 0
            pools[held].append(item)
    split = []
    for held, n in ((False, n_train), (True, n_heldout)):
        pool, records, misses = pools[held], [], 0
        tasks = list(TASKS)
        while len(records) < n:
            item = pool[int(rng.integers(len(pool)))]
            task = tasks[len(records) % len(tasks)]
            answer = answer_for(task, item)
            if answer is None:
                continue
            phrasings = TASKS[task]
            question = phrasings[0] if held else phrasings[int(rng.integers(len(phrasings)))]
            inline = (len(records) // len(tasks)) % 2 == 1 if held else bool(rng.integers(2))
            instruction, inp = (question + " " + item["line"], "") if inline else (question, item["line"])
            record = {"instruction": instruction, "input": inp, "output": answer, "task": task, "line": item["line"]}
            if fits is None or fits(record):
                records.append(record)
                misses = 0
            else:
                misses += 1
                if misses == MAX_MISSES:   # none, or next to none, fits: refuse rather than draw forever
                    raise UserError(f"the offline instruction set: {MAX_MISSES} examples in a row are longer than "
                                    f"{limit}, with {len(records)} of {n} found; it needs a longer one (or give "
                                    f"--data with shorter examples)")
        split.append(records)
    return split[0], split[1]


def fits_context(tok, ctx: int) -> Callable[[dict], bool]:
    """A `fits` filter: the rendered example (prompt + response + </s>) is at most ctx + 1 tokens, so every
    response token and the </s> is a head-0 target of a row, and a greedy answer fits the window."""
    return lambda r: len(render(tok, r["instruction"], r["input"], r["output"])[0]) <= ctx + 1


# ---- scoring generated answers -------------------------------------------------------------------
def normalize(answer: str) -> str:
    """'  Hamlet. ' -> 'hamlet' (case, surrounding spaces and punctuation ignored)."""
    return answer.strip().strip(".,;:!?'\"-").strip().lower()


def score_answers(model, tok, records: list[dict], max_new_tokens: int = 32, progress: bool = True) -> dict:
    """Greedy answers (KV cache, speculative) to each record's prompt. An answer is *in format* when it is
    non-empty, ends with </s> within max_new_tokens and does not start a new '###' section; it is *correct*
    when it is in format and (normalized) equals the record's output. *Lenient* ignores the format: the
    first non-empty line of the text equals the output (fairer to a base model that never says </s>).
    Accuracies are over the scored tasks."""
    from ..infer.session import greedy_answers
    rows = []
    it = records
    if progress:
        from tqdm import tqdm
        it = tqdm(records, desc="answers", unit="prompt", dynamic_ncols=True)
    drafted = accepted = 0
    prompts = (render(tok, r["instruction"], r["input"])[0] for r in it)
    for g, r in zip(greedy_answers(model, prompts, max_new_tokens, tok.stop_ids), records):
        drafted, accepted = drafted + g.drafted, accepted + g.accepted
        text = tok.decode(g.ids)
        in_format = g.stopped and bool(text.strip()) and "###" not in text
        task = r.get("task", "")
        first_line = next((ln for ln in text.split("\n") if ln.strip()), "")
        rows.append({"task": task, "answer": text, "expected": r["output"], "in_format": in_format,
                     "correct": in_format and normalize(text) == normalize(r["output"]),
                     "lenient": normalize(first_line) == normalize(r["output"])})
    scored = [x for x in rows if x["task"] in SCORED or not x["task"]]
    per_task = {}
    for task in sorted({x["task"] for x in rows}):
        xs = [x for x in rows if x["task"] == task]
        per_task[task or "all"] = {"n": len(xs), "in_format": sum(x["in_format"] for x in xs) / len(xs),
                                   "accuracy": sum(x["correct"] for x in xs) / len(xs),
                                   "lenient_accuracy": sum(x["lenient"] for x in xs) / len(xs)}
    return {"n": len(rows), "in_format": sum(x["in_format"] for x in rows) / max(1, len(rows)),
            "accuracy": sum(x["correct"] for x in scored) / max(1, len(scored)),
            "lenient_accuracy": sum(x["lenient"] for x in scored) / max(1, len(scored)), "per_task": per_task,
            "draft_acceptance": accepted / drafted if drafted else 0.0, "examples": rows}
