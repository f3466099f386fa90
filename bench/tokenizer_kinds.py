"""Benchmark the WordPiece, Unigram and Gemma 4 tokenizers read from llama.cpp's vocabulary files
(ggml-vocab-bert-bge.gguf, -nomic-bert-moe.gguf, -gemma-4.gguf; `make llama-src`): the time to build each
from its GGUF metadata, and encode MB/s in one thread against Hugging Face `tokenizers` given the same
vocabulary in its own form, with the ids compared:
  - bert-bge (WordPiece, 30,522 pieces): a WordPiece with the pieces as vocab.txt writes them ("##"
    continuations), BertNormalizer and BertPreTokenizer; ours read from the GGUF (llama.cpp's rule) and from
    that tokenizer.json (Hugging Face's rule);
  - nomic-bert-moe (Unigram, 250,048 pieces): a Unigram with the file's precompiled charsmap as XLM-R's
    tokenizer.json lays it out (Precompiled + Replace " {2,}", WhitespaceSplit + Metaspace); ours from the GGUF;
  - gemma-4 (262,144 tokens, 514,906 merges): a BPE with byte_fallback laid out as Gemma 4's tokenizer.json
    (transformers' GemmaTokenizer: normalizer Replace " " -> "▁", pre-tokenizer Split " ", control tokens special
    and user-defined ones plain added tokens); ours read from the GGUF (llama.cpp's newline rule, which gives the
    same ids on this vocabulary) and from that tokenizer.json (load_s: json.loads and the build; tokenizers_load_s:
    `tokenizers.Tokenizer.from_str` of the same text).

    .venv/bin/python bench/tokenizer_kinds.py            # ~1 minute
    .venv/bin/python bench/tokenizer_kinds.py --kb 300 --json

The text is the bundled works' first --kb kilobytes. ours_first_s is the first pass over it (WordPiece and
Hugging Face's Unigram remember the ids of the words they have cut); every other figure is the best of
--repeat runs (the machine is shared: the fastest run is the least disturbed); the ratios are what to read
on a busy machine.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def best(fn, repeat: int):
    """(the fastest of repeat runs of fn in seconds, fn's result)."""
    times, out = [], None
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return min(times), out


def built(folder: Path, name: str, repeat: int):
    """(seconds to build our tokenizer from the file's metadata, the tokenizer, the metadata)."""
    from nanoeuler.interop.gguf_file import GGUFFile
    from nanoeuler.interop.gguf_import import gguf_tokenizer
    meta = GGUFFile(folder / f"ggml-vocab-{name}.gguf").meta
    seconds, tok = best(lambda: gguf_tokenizer(meta, len(meta["tokenizer.ggml.tokens"])), repeat)
    return seconds, tok, meta


def hf_wordpiece(meta):
    """The bert-bge vocabulary as Hugging Face's WordPiece (llama.cpp's converter turned "##x" into "x" and "x"
    into "▁x"; "[...]" pieces it left as they were)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    vocab = {}
    for i, (t, ty) in enumerate(zip(meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"])):
        plain = ty != 1 or t.startswith("[") and t.endswith("]")
        vocab[t if plain else t[1:] if t.startswith("▁") else "##" + t] = i
    hf = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    hf.normalizer = normalizers.BertNormalizer(lowercase=True)
    hf.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    hf.add_special_tokens(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])
    return hf


def hf_unigram(meta):
    """The nomic-bert-moe vocabulary and charsmap as XLM-R's tokenizer.json."""
    import numpy as np
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers
    hf = Tokenizer(models.Unigram(list(zip(meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.scores"])), unk_id=3))
    charsmap = np.array(meta["tokenizer.ggml.precompiled_charsmap"]).astype(np.uint8).tobytes()
    hf.normalizer = normalizers.Sequence([normalizers.Precompiled(charsmap), normalizers.Replace(Regex(" {2,}"), " ")])
    hf.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Metaspace()])
    hf.add_special_tokens(["<s>", "<pad>", "</s>", "<unk>"])
    return hf


def hf_gemma4(meta):
    """The gemma-4 vocabulary as Gemma 4's tokenizer.json (transformers' GemmaTokenizer, as its GGUF conversion
    builds it)."""
    from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    merges = [tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]]
    hf = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, unk_token="<unk>", fuse_unk=True,
                              byte_fallback=True))
    hf.normalizer = normalizers.Replace(" ", "▁")
    hf.pre_tokenizer = pre_tokenizers.Split(" ", "merged_with_previous")
    hf.add_special_tokens([AddedToken(t, normalized=False, special=True) for t, ty in zip(tokens, types) if ty == 3])
    hf.add_tokens([AddedToken(t, normalized=False, special=False) for t, ty in zip(tokens, types) if ty == 4])
    return hf


def main() -> None:
    from real_models import llama_cpp_models_dir

    from nanoeuler.data.corpus import bundled_works
    from nanoeuler.interop.hf_tokenizer import from_hf_json
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kb", type=int, default=300, help="kilobytes of the bundled works to encode")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = ap.parse_args()
    folder = llama_cpp_models_dir()
    if folder is None:
        sys.exit("llama.cpp's vocabulary files are not fetched: run `make llama-src`")
    text = "".join(bundled_works().values())[:args.kb * 1000]
    mb = len(text.encode()) / 1e6
    rows = {}

    def measure(label, ours, theirs=None):
        ours.encode("warm up: é 日本")                 # the compiled kernels and tables, built once
        cold, _ = best(lambda: ours.encode(text), 1)   # the first pass: no word of the text remembered yet
        seconds, ids = best(lambda: ours.encode(text), args.repeat)
        row = {"ours_first_s": round(cold, 3), "ours_s": round(seconds, 3), "ours_mb_s": round(mb / seconds, 2)}
        if theirs is not None:
            t_seconds, t_ids = best(lambda: theirs.encode(text, add_special_tokens=False).ids, args.repeat)
            row |= {"tokenizers_s": round(t_seconds, 3), "tokenizers_mb_s": round(mb / t_seconds, 2),
                    "same_ids": ids == t_ids}
        rows[label] = row

    seconds, wp, meta = built(folder, "bert-bge", args.repeat)
    hf = hf_wordpiece(meta)
    measure("wordpiece bert-bge (gguf)", wp, hf)
    measure("wordpiece bert-bge (tokenizer.json)", from_hf_json(json.loads(hf.to_str())), hf)
    rows["wordpiece bert-bge (gguf)"]["build_s"] = round(seconds, 3)
    seconds, ug, meta = built(folder, "nomic-bert-moe", args.repeat)
    measure("unigram nomic-bert-moe (gguf)", ug, hf_unigram(meta))
    rows["unigram nomic-bert-moe (gguf)"]["build_s"] = round(seconds, 3)
    seconds, g4, meta = built(folder, "gemma-4", args.repeat)
    hf = hf_gemma4(meta)
    measure("gemma4 gemma-4 (gguf)", g4, hf)
    rows["gemma4 gemma-4 (gguf)"]["build_s"] = round(seconds, 3)
    hf_text = hf.to_str()
    load_s, from_json = best(lambda: from_hf_json(json.loads(hf_text)), args.repeat)
    measure("gemma4 gemma-4 (tokenizer.json)", from_json, hf)
    rows["gemma4 gemma-4 (tokenizer.json)"] |= {
        "load_s": round(load_s, 3),
        "tokenizers_load_s": round(best(lambda: hf.from_str(hf_text), args.repeat)[0], 3)}
    out = {"text_mb": round(mb, 3), "load_average": os.getloadavg()[0], "rows": rows}
    if args.json:
        print(json.dumps(out))
        return
    print(f"{mb:.3f} MB of the bundled works; load average {out['load_average']:.1f}")
    for label, row in rows.items():
        print(f"  {label:38s} " + "  ".join(f"{k} {v}" for k, v in row.items()))


if __name__ == "__main__":
    main()
