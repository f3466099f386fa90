"""`nanoeuler data gutenberg|web|alpaca`: download the real corpora (resumable, checksummed) into data/.

    nanoeuler data gutenberg                 # ~100 classics -> data/gutenberg/gutenberg.{txt,jsonl}
    nanoeuler data web --bytes 1G            # FineWeb-Edu text -> data/web/web_*.parquet
    nanoeuler data alpaca                    # data/alpaca/alpaca.json (validated records)
    nanoeuler prepare data/gutenberg/gutenberg.jsonl data/web --mix 1,1 --tokenizer tok.json --out data/mix
"""
from __future__ import annotations


def register(subparsers) -> None:
    p = subparsers.add_parser("data", help="download Gutenberg books, FineWeb-Edu web text, Alpaca",
                              description="Download and clean the real corpora. Every download resumes where it "
                                          "stopped, finished files are not fetched again, transient errors are "
                                          "retried with back-off, and every file is recorded with its SHA-256 "
                                          "in OUT/manifest.json.")
    sub = p.add_subparsers(dest="dataset", metavar="<dataset>", required=True)

    from .args import finite_float, nonneg_int, output_dir, positive_int

    def common(q, name):
        q.add_argument("--out", type=output_dir, default=f"data/{name}",
                       help=f"output directory (default data/{name})")
        q.add_argument("--mirror", default=None, metavar="BASE",
                       help="replace scheme://host of the default URLs, e.g. https://hf-mirror.com")
        q.add_argument("--retries", type=nonneg_int, default=5, help="retries per request (default 5; 0 = none)")
        q.add_argument("--backoff", type=finite_float(0, 3600), default=1.0,
                       help="first back-off in seconds, doubled per retry (default 1)")
        q.add_argument("--json", action="store_true", help="print one JSON summary object on stdout")
        q.set_defaults(run=run)

    g = sub.add_parser("gutenberg", help="curated Project Gutenberg classics, licence header/footer stripped")
    g.add_argument("--books", default=None, metavar="TSV",
                   help="book list (id<TAB>author<TAB>title; default: the bundled curated list)")
    g.add_argument("--limit", type=positive_int, default=None, metavar="N", help="only the first N books")
    g.add_argument("--url", default=None, metavar="TEMPLATE",
                   help="URL template with {id} (default https://www.gutenberg.org/cache/epub/{id}/pg{id}.txt)")
    common(g, "gutenberg")

    w = sub.add_parser("web", help="FineWeb-Edu text streamed from its parquet files, up to --bytes")
    w.add_argument("--bytes", required=True, metavar="SIZE", help="how much text to keep, e.g. 100M, 1G")
    w.add_argument("--url", action="append", default=None, metavar="URL",
                   help="parquet file URL (repeatable; default: FineWeb-Edu sample/10BT)")
    common(w, "web")

    a = sub.add_parser("alpaca", help="the Stanford Alpaca instruction set (JSON), every record validated")
    a.add_argument("--url", default=None, metavar="URL", help="alpaca_data.json URL")
    a.add_argument("--sha256", default=None, help="expected SHA-256 of the download")
    common(a, "alpaca")


def run(args) -> int:
    import json
    import sys

    from ..data import sources
    from ..errors import UserError

    from ..data.download import check_url
    from ..fileio import check_apart, check_real_dir
    check_real_dir(args.out)             # downloads resume into an existing --out, never through a link
    if args.retries < 0:
        raise UserError(f"--retries must be >= 0, got {args.retries}")
    if args.mirror:
        check_url(args.mirror, "--mirror")
    for url in ([args.url] if isinstance(args.url, str) else args.url or []):
        check_url(url.replace("{id}", "1"), "--url")
    kw = dict(retries=args.retries, backoff=args.backoff, progress=True)
    if args.dataset == "gutenberg":
        check_apart(args.out, [args.books])
        books = sources.read_book_list(args.books) if args.books else sources.read_book_list()
        if args.limit is not None:
            books = books[:args.limit]
        s = sources.fetch_gutenberg(args.out, books, url_template=args.url or sources.GUTENBERG_URL,
                                    mirror=args.mirror, **kw)
        line = (f"{s['books']} books, {s['bytes']:,} bytes -> {', '.join(s['files'])}\n"
                f"next: nanoeuler prepare {s['files'][1]} --tokenizer T --out DATA   (the .jsonl holds out whole books)")
        for f in s["failed"]:
            print(f"warning: book {f['id']} ({f['title']}) skipped: {f['error']}", file=sys.stderr)
        code = 1 if s["failed"] else 0
    elif args.dataset == "web":
        s = sources.fetch_web(args.out, sources.parse_size(args.bytes), urls=args.url, mirror=args.mirror, **kw)
        line = f"{s['text_bytes']:,} bytes of text in {s['parts']} parquet parts under {s['out']}"
        code = 0
    else:
        url = sources._with_mirror(args.url or sources.ALPACA_URL, args.mirror if not args.url else None)
        s = sources.fetch_alpaca(args.out, url=url, sha256=args.sha256, **kw)
        for problem in s["bad"][:10]:
            print(f"warning: skipped {problem}", file=sys.stderr)
        if len(s["bad"]) > 10:
            print(f"warning: ... and {len(s['bad']) - 10} more bad records", file=sys.stderr)
        line = f"{s['valid']} of {s['records']} records valid -> {s['files'][1]}"
        code = 0
    if args.json:
        print(json.dumps(s))
    else:
        print(line)
    return code
