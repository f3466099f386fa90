"""`nanoeuler prepare FILES... --tokenizer T --out DATA`: encode text into token shards + manifest.json.

    nanoeuler prepare data/gutenberg.txt data/web/ --mix 2,1 --tokenizer tok.json --out data/mix
    nanoeuler prepare --tokenizer tok.json --out data/shakespeare        # no FILES: the bundled corpus
"""
from __future__ import annotations


def register(subparsers) -> None:
    from .args import existing_path, output_dir, positive_int
    p = subparsers.add_parser(
        "prepare", help="encode text files into token shards (train/val) + manifest",
        description="Encode files (.jsonl/.json: a 'text' field per record, .parquet: a 'text' column, any other "
                    "name: UTF-8 text, as `tokenizer train` reads them), or whole directories of .txt/.md/.jsonl/"
                    ".json/.parquet files, into token shards (uint16; uint32 for a vocabulary of more than 65,536 "
                    "tokens) with a train/val split that holds out whole "
                    "documents (every 10th; a source with fewer than 10 documents is cut into chunks at paragraph "
                    "breaks and every 10th chunk is held out). Streams the input and encodes on all cores. "
                    "Without FILES, prepares the bundled Shakespeare corpus (validation = held-out whole works). "
                    "DATA keeps a copy of the tokenizer (DATA/tokenizer.json), so `train --data DATA` needs no "
                    "--tokenizer. DATA must be new, empty or an earlier prepare's (replacing that needs --force); its "
                    "old contents stay intact until the new shards are complete.")
    p.add_argument("files", nargs="*", metavar="FILES", type=existing_path, help="input files or directories")
    p.add_argument("--tokenizer", required=True, metavar="T", type=existing_path,
                   help="tokenizer.json (or a run directory holding one)")
    p.add_argument("--out", required=True, metavar="DIR", type=output_dir, help="output DATA directory")
    p.add_argument("--val", nargs="+", metavar="FILES", default=None, type=existing_path,
                   help="validation files (then nothing is held out of FILES)")
    p.add_argument("--mix", metavar="W1,W2,...", default=None,
                   help="one weight per FILES argument, each then its own source: weight 2 repeats a source's "
                        "training documents twice, 0.5 takes about half; sources are interleaved by document")
    p.add_argument("--processes", type=positive_int, default=None, metavar="N",
                   help="encoding processes (default: all cores; 1 = encode in this process)")
    p.add_argument("--shard-tokens", type=positive_int, default=None, metavar="N", help="tokens per shard (default 2^25)")
    p.add_argument("--force", action="store_true",
                   help="replace the shards of an earlier prepare in DIR (a directory holding other files is "
                        "always refused)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--text-field", default="text", help="JSON field / parquet column holding the text")
    p.add_argument("--json", action="store_true", help="print one JSON summary object on stdout")
    p.set_defaults(run=run)


def _parse_mix(mix: str, n_files: int) -> list[float]:
    from ..errors import UserError
    try:
        weights = [float(w) for w in mix.split(",")]
    except ValueError:
        raise UserError(f"--mix {mix!r}: expected comma-separated numbers, e.g. --mix 2,1") from None
    import math
    if not all(math.isfinite(w) and w >= 0 for w in weights) or not any(weights):
        raise UserError(f"--mix {mix!r}: weights must be finite numbers >= 0, not all 0")
    if len(weights) != n_files:
        raise UserError(f"--mix gives {len(weights)} weights for {n_files} FILES arguments; give one per argument")
    return weights


def tokenizer_input(tokenizer: str, out: str):
    """What --tokenizer reads, which DIR must stay apart from: the file, or the run directory holding it (and
    so the base an adapter run reads); None when it is DIR's own tokenizer.json (prepare rewrites it as it is)."""
    from pathlib import Path
    path = Path(tokenizer) / "tokenizer.json" if Path(tokenizer).is_dir() else Path(tokenizer)
    if path.resolve() == (Path(out) / "tokenizer.json").resolve():
        return None
    return tokenizer


def run(args) -> int:
    import json
    import sys
    import time

    from ..errors import UserError
    from ..data.shards import DEFAULT_SHARD_TOKENS, prepare, prepare_bundled
    from ..fileio import check_apart

    if args.processes is not None and args.processes < 1:
        raise UserError(f"--processes must be >= 1, got {args.processes}")
    shard_tokens = DEFAULT_SHARD_TOKENS if args.shard_tokens is None else args.shard_tokens
    if shard_tokens < 1:
        raise UserError(f"--shard-tokens must be >= 1, got {shard_tokens}")
    progress = not getattr(args, "no_progress", False)
    check_apart(args.out, [*args.files, *(args.val or []), tokenizer_input(args.tokenizer, args.out)])
    t0 = time.perf_counter()
    if not args.files:
        if args.val or args.mix is not None:
            raise UserError("--val and --mix need FILES")
        print("no FILES given: preparing the bundled Shakespeare corpus", file=sys.stderr)
        m = prepare_bundled(args.tokenizer, args.out, processes=args.processes, shard_tokens=shard_tokens,
                            progress=progress, force=args.force)
    else:
        sources = list(args.files)
        if args.mix is not None:                 # an empty --mix is an error, not "no mix"
            sources = list(zip(args.files, _parse_mix(args.mix, len(args.files))))
        m = prepare(sources, args.tokenizer, args.out, val_sources=args.val, processes=args.processes,
                    shard_tokens=shard_tokens, text_field=args.text_field, progress=progress, force=args.force)
    seconds = time.perf_counter() - t0
    tr, va = m["splits"]["train"], m["splits"]["val"]
    total_bytes = tr["bytes"] + va["bytes"]
    total_tokens = tr["tokens"] + va["tokens"]
    summary = {
        "out": str(args.out),
        "train_tokens": tr["tokens"], "val_tokens": va["tokens"],
        "train_bytes": tr["bytes"], "val_bytes": va["bytes"],
        "train_documents": tr["documents"], "val_documents": va["documents"],
        "shards": len(tr["shards"]) + len(va["shards"]),
        "bytes_per_token": round(total_bytes / max(total_tokens, 1), 4),
        "seconds": round(seconds, 3),
        "mb_per_s": round(total_bytes / 1e6 / max(seconds, 1e-9), 3),
        "tokenizer_fingerprint": m["tokenizer_fingerprint"],
    }
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"{args.out}: train {tr['tokens']:,} tokens ({tr['documents']} documents, {tr['bytes']:,} bytes), "
              f"val {va['tokens']:,} tokens ({va['documents']} documents, {va['bytes']:,} bytes), "
              f"{summary['bytes_per_token']} bytes/token, {summary['mb_per_s']} MB/s")
    return 0
