"""`nanoeuler tokenizer train|encode|decode|export`: tokenizers from the command line (train: byte-level BPE;
encode, decode, export: any tokenizer.json, an imported SentencePiece-style one included).

    nanoeuler tokenizer train books.txt web.txt --vocab-size 4096 --out tokenizer.json
    nanoeuler tokenizer train --vocab-size 512 --out tok.json         # no FILES: the bundled corpus
    echo "To be, or not to be" | nanoeuler tokenizer encode --tokenizer tok.json     # -> 1203 11 ...
    echo "1203 11" | nanoeuler tokenizer decode --tokenizer tok.json                 # -> To be,
    nanoeuler tokenizer export --tokenizer tok.json --format hf --out hf-tokenizer.json
"""
from __future__ import annotations


def register(subparsers) -> None:
    from .args import existing_path, int_range, output_file
    p = subparsers.add_parser("tokenizer", help="train, use and export tokenizers",
                              description="Train a byte-level BPE tokenizer; encode, decode and export with any "
                                          "tokenizer.json (ours, or an imported model's: byte-level or "
                                          "SentencePiece-style BPE).")
    sub = p.add_subparsers(dest="tokenizer_command", metavar="<action>")

    t = sub.add_parser("train", help="learn a vocabulary from text files",
                       description="Learn vocab-size - 256 - len(specials) merges from text files (UTF-8; "
                                   "other bytes are learned as they are). FILES follow the same rule as `prepare`: "
                                   "a named file is read whatever its name (.jsonl/.json: the 'text' field of each "
                                   "record, .parquet: the 'text' column, anything else: text); a directory gives "
                                   "its .txt/.md/.jsonl/.json/.parquet files. Without FILES, trains on the bundled "
                                   "Shakespeare corpus (training works only). Writes tokenizer.json and a readable "
                                   ".vocab file beside it.")
    t.add_argument("files", nargs="*", metavar="FILES", type=existing_path, help="text files or directories")
    t.add_argument("--vocab-size", type=int_range(1, 1 << 16), required=True, metavar="N",
                   help="total tokens incl. the 256 bytes and the specials, at most 65536 (uint16 shards)")
    t.add_argument("--out", type=output_file, required=True, metavar="PATH", help="where to write tokenizer.json")
    t.add_argument("--text-field", default="text", help="JSON field / parquet column holding the text")
    t.add_argument("--special", action="append", metavar="S", default=None,
                   help="a special token (repeatable; default: </s>)")
    t.add_argument("--force", action="store_true", help="replace an existing --out (and its .vocab file)")
    t.add_argument("--no-progress", action="store_true", help="no progress bars")
    t.add_argument("--json", action="store_true", help="print one JSON summary object on stdout")
    t.set_defaults(run=run_train)

    e = sub.add_parser("encode", help="text on stdin -> space-separated ids on stdout",
                       description="Encode stdin. Valid UTF-8 is encoded as text; other bytes are encoded exactly.")
    e.add_argument("--tokenizer", required=True, metavar="T", help="tokenizer.json (or a checkpoint directory)")
    e.add_argument("--allow-special", action="store_true", help="turn special-token strings (e.g. </s>) into their ids")
    e.add_argument("--json", action="store_true", help='print {"ids": [...], "tokens": n, "bytes": n}')
    e.set_defaults(run=run_encode)

    d = sub.add_parser("decode", help="ids on stdin (spaces, commas or a JSON list) -> text on stdout",
                       description="Decode ids to the exact bytes they stand for.")
    d.add_argument("--tokenizer", required=True, metavar="T", help="tokenizer.json (or a checkpoint directory)")
    d.set_defaults(run=run_decode)

    x = sub.add_parser("export", help="export to another library's format",
                       description="Export to the Hugging Face `tokenizers` JSON format, which encodes identically.")
    x.add_argument("--tokenizer", required=True, metavar="T", help="tokenizer.json (or a checkpoint directory)")
    x.add_argument("--format", choices=["hf"], default="hf", help="hf: Hugging Face tokenizers JSON")
    x.add_argument("--out", type=output_file, required=True, metavar="F", help="output file (not a directory)")
    x.add_argument("--force", action="store_true", help="replace an existing --out")
    x.set_defaults(run=run_export)

    p.set_defaults(run=lambda args: (p.print_help(), 2)[1])


def run_train(args) -> int:
    import json
    import sys
    import time
    from pathlib import Path

    from ..errors import UserError
    from ..fileio import check_output
    from ..tokenizer import Tokenizer

    out, vocab_file = Path(args.out), Path(args.out).with_suffix(".vocab")
    if out == vocab_file:
        raise UserError(f"--out {out}: the readable vocabulary goes to NAME.vocab beside it; name it otherwise")
    for path in (out, vocab_file):
        check_output(path, args.force, inputs=args.files, kind="file")
    specials = tuple(args.special) if args.special else ("</s>",)
    t0 = time.perf_counter()
    if args.files:
        from ..data.shards import expand_paths, is_plain_text, iter_documents
        from ..tokenizer.tokenizer import _read_blocks
        paths = expand_paths(args.files)          # the rule `prepare` applies, so both read the same text
        nbytes = sum(p.stat().st_size for p in paths)

        def blocks():
            for p in paths:
                if is_plain_text(p):
                    yield from _read_blocks([p])
                else:
                    for doc in iter_documents(p, args.text_field):
                        yield "".join(doc).encode("utf-8", "surrogatepass")
        tok = Tokenizer._train_utf8(blocks(), args.vocab_size, specials, not args.no_progress, nbytes)
    else:
        from ..data.corpus import bundled_split, bundled_works

        print("no FILES given: training on the bundled Shakespeare corpus", file=sys.stderr)
        works = bundled_works()
        texts = [works[n] for n in bundled_split()[0]]
        nbytes = sum(len(t.encode("utf-8")) for t in texts)
        tok = Tokenizer.train(texts, args.vocab_size, specials, progress=not args.no_progress)
    seconds = time.perf_counter() - t0
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    tok.save(args.out)
    if tok.vocab_size < args.vocab_size:
        print(f"warning: the text only supports {tok.vocab_size} tokens (asked for {args.vocab_size})", file=sys.stderr)
    summary = {"out": str(args.out), "vocab_file": str(vocab_file),
               "vocab_size": tok.vocab_size, "merges": len(tok.merges), "specials": tok.special_tokens,
               "train_bytes": nbytes, "seconds": round(seconds, 3), "fingerprint": tok.fingerprint()}
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"wrote {args.out} ({tok.vocab_size} tokens, {nbytes / 1e6:.1f} MB of text in {seconds:.1f} s) "
              f"and {summary['vocab_file']}")
    return 0


def run_encode(args) -> int:
    import json
    import sys

    from ..tokenizer import Tokenizer

    tok = Tokenizer.load(args.tokenizer)
    data = sys.stdin.buffer.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        ids = tok.encode_bytes(data)  # not UTF-8: encode the bytes exactly (no special tokens)
    else:
        ids = tok.encode(text, allow_special=args.allow_special)
    if args.json:
        print(json.dumps({"ids": ids, "tokens": len(ids), "bytes": len(data)}))
    else:
        sys.stdout.write(" ".join(map(str, ids)) + "\n")
    return 0


def run_decode(args) -> int:
    import sys

    from ..errors import UserError
    from ..tokenizer import Tokenizer

    tok = Tokenizer.load(args.tokenizer)
    raw = sys.stdin.read()
    fields = raw.replace(",", " ").replace("[", " ").replace("]", " ").split()
    try:
        ids = [int(f) for f in fields]
    except ValueError:
        bad = next(f for f in fields if not f.lstrip("-").isdigit())
        raise UserError(f"decode reads integer ids separated by spaces or commas; got {bad[:40]!r}") from None
    sys.stdout.buffer.write(tok.decode_bytes(ids))
    sys.stdout.buffer.flush()
    return 0


def run_export(args) -> int:
    from pathlib import Path

    from ..fileio import atomic_write_text, check_output
    from ..tokenizer import Tokenizer

    check_output(args.out, args.force, inputs=[args.tokenizer], kind="file")
    tok = Tokenizer.load(args.tokenizer)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out, tok.to_hf_json())
    print(f"wrote {args.out} (Hugging Face tokenizers format, {tok.vocab_size} tokens)")
    return 0
