"""Benchmark the tokenizers of the real files: load time of the vocabulary, encode speed against Hugging Face
`tokenizers` (the Rust library) on the same text, and that both give the same ids.

For Gemma 3 270M (SentencePiece-style BPE, 262,144 tokens) and SmolLM2-135M-Instruct (byte-level BPE, 49,152
tokens), from the GGUF files `make models` fetches, and with --llama-cpp-vocab NAME for llama.cpp's vocabulary
file ggml-vocab-NAME.gguf (`make llama-src`; command-r: 256,000 tokens, llama-bpe: Llama-3's 128,256):
  - load: the file's header and vocabulary read (interop/gguf_file.py) and the tokenizer built from it, and
    the same tokenizer loaded from our tokenizer.json (what `chat` / `serve` do with an imported checkpoint);
    with --gguf-reader also the gguf package's GGUFReader on the same file, for comparison;
  - encode MB/s in one process: ours vs a `tokenizers.Tokenizer` made from our Hugging Face export
    (to_hf_json), on English (the bundled works) and synthetic varied text (scripts, digits, emoji,
    odd whitespace), ids compared (allow_special=True: Hugging Face always cuts its added tokens out).

    .venv/bin/python bench/tokenizer_real.py              # ~1-2 minutes
    .venv/bin/python bench/tokenizer_real.py --mb 5 --json --gguf-reader
    .venv/bin/python bench/tokenizer_real.py --llama-cpp-vocab command-r --llama-cpp-vocab llama-bpe

Each figure is the best of --repeat runs (the machine is shared: the fastest run is the least disturbed);
the ratios are what to read on a busy machine.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from tokenizer import best_of, english_docs, varied_text  # noqa: E402  (bench/tokenizer.py)


def load_times(path: Path, repeat: int, gguf_reader: bool) -> tuple[dict, object]:
    """({"gguf_s", "json_s", "gguf_reader_s"}, the tokenizer) for the GGUF file at path."""
    from nanoeuler.interop.gguf_file import GGUFFile
    from nanoeuler.interop.gguf_import import gguf_tokenizer
    from nanoeuler.tokenizer import Tokenizer

    def from_gguf():
        f = GGUFFile(path)
        rows = next((int(t.shape[1]) for t in f.tensors if t.name == "token_embd.weight"),
                    len(f.meta["tokenizer.ggml.tokens"]))   # a vocabulary file has no tensors
        return gguf_tokenizer(f.meta, rows)
    from_gguf()                                  # compiles / loads the kernels once
    gguf_s, _, tok = best_of(repeat, from_gguf)
    with tempfile.TemporaryDirectory(prefix="tok-bench-") as d:
        tok.save(Path(d) / "tokenizer.json")
        json_s, _, _ = best_of(repeat, lambda: Tokenizer.load(Path(d) / "tokenizer.json"))
    out = {"gguf_s": round(gguf_s, 3), "json_s": round(json_s, 3)}
    if gguf_reader:
        import gguf
        out["gguf_reader_s"] = round(best_of(1, lambda: gguf.GGUFReader(str(path)))[0], 3)
    return out, tok


def encode_speed(tok, docs: list[str], repeat: int) -> dict:
    """Ours vs Hugging Face on docs: MB/s (wall, CPU) each, the speed ratio, whether the ids are equal."""
    import tokenizers
    hf = tokenizers.Tokenizer.from_str(tok.to_hf_json())
    nbytes = sum(len(d.encode("utf-8")) for d in docs)
    tok.encode(docs[0][:1000], allow_special=True)
    ours = best_of(repeat, lambda: [tok.encode(d, allow_special=True) for d in docs])
    theirs = best_of(repeat, lambda: [hf.encode(d, add_special_tokens=False).ids for d in docs])

    def mbs(r):
        return [round(nbytes / 1e6 / r[0], 2), round(nbytes / 1e6 / r[1], 2)]
    return {"mb": round(nbytes / 1e6, 2), "ours_mb_s": mbs(ours), "hf_mb_s": mbs(theirs),
            "ratio_ours_over_hf": [round(theirs[0] / ours[0], 2), round(theirs[1] / ours[1], 2)],
            "identical_ids": ours[2] == theirs[2]}


def main() -> None:
    from real_models import FILES, models_dir
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, default=2.0, help="MB of English text (default 2)")
    ap.add_argument("--varied-mb", type=float, default=0.5, help="MB of synthetic varied text (default 0.5)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--gguf-reader", action="store_true", help="also time gguf.GGUFReader (slow: ~10-25 s)")
    ap.add_argument("--llama-cpp-vocab", action="append", default=[], metavar="NAME",
                    help="also llama.cpp's models/ggml-vocab-NAME.gguf (make llama-src), e.g. command-r, llama-bpe")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    cut = lambda texts: [t[i:i + 100_000] for t in texts for i in range(0, len(t), 100_000)]  # noqa: E731
    english = cut(english_docs(args.mb))
    varied = cut([varied_text(int(args.varied_mb * 1e6), seed=1)])
    from real_models import llama_cpp_models_dir as llama_cpp_models
    files = {name: (models_dir() / FILES[name], "make models") for name in ("gemma3", "smollm2")}
    files |= {name: ((llama_cpp_models() or Path("-")) / f"ggml-vocab-{name}.gguf", "make llama-src")
              for name in args.llama_cpp_vocab}
    res = {}
    for name, (path, fetch) in files.items():
        if not path.is_file():
            res[name] = {"skipped": f"{path.name} is not fetched: run `{fetch}`"}
            continue
        load, tok = load_times(path, args.repeat, args.gguf_reader)
        res[name] = {"vocab_size": tok.vocab_size, "kind": tok.kind, "load": load,
                     "english": encode_speed(tok, english, args.repeat),
                     "varied": encode_speed(tok, varied, args.repeat)}
    if args.json:
        print(json.dumps(res))
        return
    for name, r in res.items():
        if "skipped" in r:
            print(f"{name}: skipped ({r['skipped']})")
            continue
        ld = r["load"]
        print(f"{name}: {r['kind']} BPE, {r['vocab_size']:,} tokens; best of {args.repeat}")
        print(f"  load: from the GGUF file {ld['gguf_s']:.2f} s, from our tokenizer.json {ld['json_s']:.2f} s"
              + (f"; gguf.GGUFReader alone {ld['gguf_reader_s']:.2f} s" if "gguf_reader_s" in ld else ""))
        for what in ("english", "varied"):
            e = r[what]
            print(f"  encode {what} ({e['mb']} MB): ours {e['ours_mb_s'][0]} MB/s wall / {e['ours_mb_s'][1]} CPU, "
                  f"HF tokenizers {e['hf_mb_s'][0]} / {e['hf_mb_s'][1]} -> ours / HF "
                  f"{e['ratio_ours_over_hf'][0]}x wall, {e['ratio_ours_over_hf'][1]}x CPU; "
                  f"identical ids: {e['identical_ids']}")


if __name__ == "__main__":
    main()
