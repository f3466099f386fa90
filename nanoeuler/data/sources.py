"""The real corpora: Project Gutenberg classics, a FineWeb-Edu slice and the Alpaca instruction set.

Each `fetch_*` function downloads (resumably, see `download.py`), cleans, writes its outputs under `out_dir`
and records every file with its URL, size and SHA-256 in `out_dir/manifest.json`. Running it again
fetches only what is missing.

- `fetch_gutenberg`: the curated book list `assets/gutenberg_books.tsv`; keeps only the text between the
  `*** START OF ... ***` and `*** END OF ... ***` markers, normalises line endings; writes
  `gutenberg.txt` (all books) and `gutenberg.jsonl` (one record per book, so that `prepare` holds out
  whole books).
- `fetch_web`: streams FineWeb-Edu parquet files over HTTP, reading only the `text` column of as many
  row groups as the byte budget needs, and writes them as local parquet parts `web_000000.parquet`, ...
  A part is the unit of resumption.
- `fetch_alpaca`: the Alpaca JSON (52k records); every record is validated (instruction / input / output
  strings, non-empty instruction and output); bad ones are reported and left out of `alpaca.json`.

Why pyarrow rather than DuckDB for parquet: pyarrow reads a parquet file through any seekable Python file
object, so `download.HttpRangeFile` lets it fetch the footer and then just the `text` column chunk of one
row group at a time with our own retry/back-off and progress accounting, and stop exactly at the byte
budget; it also writes our parquet parts. DuckDB's httpfs would do the HTTP itself (its own retries, no
per-row-group resumption we control), adds a second large engine, and we need no SQL.
"""
from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

from .download import HttpRangeFile, Unreachable, download, session, sha256_file
from ..errors import UserError
from ..fileio import atomic_path, atomic_write_json, atomic_write_text

BOOKS_TSV = Path(__file__).parent.parent / "assets" / "gutenberg_books.tsv"
GUTENBERG_URL = "https://www.gutenberg.org/cache/epub/{id}/pg{id}.txt"
FINEWEB_EDU_URLS = [f"https://huggingface.co/datasets/HuggingFaceFW/fineweb-edu/resolve/main/sample/10BT/"
                    f"{i:03d}_00000.parquet" for i in range(14)]
ALPACA_URL = "https://raw.githubusercontent.com/tatsu-lab/stanford_alpaca/main/alpaca_data.json"


# ---- manifest of a data directory ------------------------------------------------------------------------

def load_manifest(out_dir: Path) -> dict:
    path = out_dir / "manifest.json"
    if not path.exists():
        return {"files": {}}
    try:
        m = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:
        raise UserError(f"{path} is not valid JSON ({e}); delete it to start over") from None
    m.setdefault("files", {})
    return m


def _record(manifest: dict, out_dir: Path, path: Path, url: str | None, sha256: str | None = None) -> None:
    manifest["files"][path.relative_to(out_dir).as_posix()] = {
        "url": url, "bytes": path.stat().st_size, "sha256": sha256 or sha256_file(path)}


def _with_mirror(url: str, mirror: str | None) -> str:
    """Replace scheme://host of url by the mirror's: ("https://a.org/x/y", "http://m.net") -> "http://m.net/x/y"."""
    if not mirror:
        return url
    path = re.sub(r"^[a-z]+://[^/]+", "", url)
    return mirror.rstrip("/") + path


# ---- Gutenberg -------------------------------------------------------------------------------------------

_START = re.compile(r"^\*{3}\s*START OF (?:THE|THIS) PROJECT GUTENBERG[^*]*\*{3}[^\n]*\n", re.M | re.I)
_END = re.compile(r"^\*{3}\s*END OF (?:THE|THIS) PROJECT GUTENBERG", re.M | re.I)


def strip_gutenberg(text: str) -> str:
    """The book between the `*** START OF ...` and `*** END OF ...` lines, \\n line endings, outer blank lines
    removed. Raises ValueError when a marker is missing.

        >>> strip_gutenberg("licence\\r\\n*** START OF THE PROJECT GUTENBERG EBOOK X ***\\r\\n\\r\\nHello.\\r\\n"
        ...                 "*** END OF THE PROJECT GUTENBERG EBOOK X ***\\r\\nlicence")
        'Hello.\\n'
    """
    text = text.lstrip("\ufeff").replace("\r\n", "\n").replace("\r", "\n")
    start = _START.search(text)
    if not start:
        raise ValueError("no '*** START OF THE PROJECT GUTENBERG EBOOK' line")
    end = _END.search(text, start.end())
    if not end:
        raise ValueError("no '*** END OF THE PROJECT GUTENBERG EBOOK' line")
    return text[start.end():end.start()].strip("\n") + "\n"


def read_book_list(path: str | Path = BOOKS_TSV) -> list[dict]:
    """[{id, author, title}] from a TSV with header `id  author  title` ('#' lines are comments)."""
    books = []
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"book list {path} not found") from None
    except IsADirectoryError:
        raise UserError(f"book list {path} is a directory, not a TSV file") from None
    except UnicodeDecodeError:
        raise UserError(f"book list {path} is not a UTF-8 text file (expected id<TAB>author<TAB>title lines)") from None
    if "\0" in text:
        raise UserError(f"book list {path} is a binary file (expected id<TAB>author<TAB>title lines)")
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.startswith("#") or line.startswith("id\t"):
            continue
        parts = line.split("\t")
        if len(parts) != 3 or not parts[0].strip().isdigit():
            raise UserError(f"{path}:{lineno}: expected 'id<TAB>author<TAB>title'")
        books.append({"id": int(parts[0]), "author": parts[1].strip(), "title": parts[2].strip()})
    if not books:
        raise UserError(f"{path}: no books listed")
    return books


def _decode(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw.decode("cp1252", errors="replace")      # a few old Gutenberg files are Latin-1 / cp1252


def fetch_gutenberg(out_dir: str | Path, books: list[dict] | None = None, url_template: str = GUTENBERG_URL,
                    mirror: str | None = None, retries: int = 5, backoff: float = 1.0, progress: bool = True,
                    sess=None) -> dict:
    """Download the books, strip licence header/footer, write gutenberg.txt + gutenberg.jsonl; return a summary.

    A book that cannot be fetched (HTTP 404, ...) or has no START/END markers is reported and skipped;
    an unreachable host stops everything.
    """
    from tqdm import tqdm

    out_dir = Path(out_dir)
    (out_dir / "raw").mkdir(parents=True, exist_ok=True)
    books = books if books is not None else read_book_list()
    if "{id}" not in url_template:
        raise UserError(f"--url {url_template!r} must contain {{id}}, e.g. {GUTENBERG_URL}")
    manifest = load_manifest(out_dir)
    sess = sess or session()
    failed, kept = [], []
    for book in tqdm(books, desc="gutenberg", unit="book", disable=not progress):
        url = _with_mirror(url_template.format(id=book["id"]), mirror)
        raw = out_dir / "raw" / f"pg{book['id']}.txt"
        try:
            info = download(url, raw, retries=retries, backoff=backoff, progress=False, sess=sess)
        except Unreachable:
            atomic_write_json(out_dir / "manifest.json", manifest)
            raise
        except UserError as e:
            failed.append({**book, "error": str(e)})
            continue
        manifest["files"][raw.relative_to(out_dir).as_posix()] = {k: info[k] for k in ("url", "bytes", "sha256")}
        try:
            text = strip_gutenberg(_decode(raw.read_bytes()))
        except ValueError as e:
            failed.append({**book, "error": f"{raw}: {e}"})
            continue
        kept.append((book, text))
    if not kept:
        atomic_write_json(out_dir / "manifest.json", manifest)
        raise UserError(f"no book could be fetched ({failed[0]['error'] if failed else 'empty list'})")
    with atomic_path(out_dir / "gutenberg.txt") as tmp, open(tmp, "w", encoding="utf-8") as f:
        f.write("\n\n\n".join(text for _, text in kept))
    with atomic_path(out_dir / "gutenberg.jsonl") as tmp, open(tmp, "w", encoding="utf-8") as f:
        for book, text in kept:
            f.write(json.dumps({"id": book["id"], "author": book["author"], "title": book["title"],
                                "text": text}, ensure_ascii=False) + "\n")
    for name in ("gutenberg.txt", "gutenberg.jsonl"):
        _record(manifest, out_dir, out_dir / name, None)
    manifest["books"] = [{"id": b["id"], "title": b["title"], "chars": len(t)} for b, t in kept]
    manifest["failed"] = failed
    atomic_write_json(out_dir / "manifest.json", manifest)
    return {"out": str(out_dir), "books": len(kept), "failed": failed,
            "bytes": (out_dir / "gutenberg.txt").stat().st_size,
            "files": [str(out_dir / "gutenberg.txt"), str(out_dir / "gutenberg.jsonl")]}


# ---- FineWeb-Edu -----------------------------------------------------------------------------------------

def parse_size(text: str) -> int:
    """'1G' -> 10**9, '500M' -> 5 * 10**8, '2GiB' -> 2 * 2**30, '123' -> 123 (bytes)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMgGtT]?)(i?)[bB]?\s*", text)
    if not m:
        raise UserError(f"bad size {text!r}: use e.g. 500M, 1G, 2GiB")
    exp = " KMGT".index(m.group(2).upper() or " ")
    value = float(m.group(1)) * ((1024 if m.group(3) else 1000) ** exp)
    if value < 1:
        raise UserError(f"size {text!r} must be at least 1 byte")
    return int(value)


def _pyarrow():
    try:
        import pyarrow as pa
        import pyarrow.compute as pc
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError("reading parquet needs pyarrow: pip install 'nanoeuler[data]'") from None
    return pa, pc, pq


def fetch_web(out_dir: str | Path, target_bytes: int, urls: list[str] | None = None, mirror: str | None = None,
              retries: int = 5, backoff: float = 1.0, progress: bool = True, sess=None,
              text_field: str = "text") -> dict:
    """Stream the `text` column of FineWeb-Edu parquet files until `target_bytes` of UTF-8 text are stored.

    Output: out_dir/web_000000.parquet, ... (one per remote row group read, a `text` column) and a manifest
    recording, per part, the remote url / row group / rows taken, so that a re-run continues where it stopped.
    """
    from tqdm import tqdm

    pa, pc, pq = _pyarrow()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    urls = [_with_mirror(u, mirror) for u in (urls or FINEWEB_EDU_URLS)]
    manifest = load_manifest(out_dir)
    parts = manifest.setdefault("parts", [])
    taken = {}                                              # (url, row group) -> rows already stored
    for p in parts:
        taken[(p["url"], p["row_group"])] = taken.get((p["url"], p["row_group"]), 0) + p["rows"]
    total = sum(p["text_bytes"] for p in parts)
    sess = sess or session()
    bar = tqdm(total=target_bytes, initial=min(total, target_bytes), unit="B", unit_scale=True, desc="web text",
               disable=not progress)
    fetched = 0
    try:
        for url in urls:
            if total >= target_bytes:
                break
            remote = HttpRangeFile(url, sess=sess, retries=retries, backoff=backoff)
            try:
                pf = pq.ParquetFile(remote)
            except UserError:
                raise
            except Exception as e:
                raise UserError(f"{url}: not a readable parquet file ({e})") from None
            if text_field not in pf.schema_arrow.names:
                raise UserError(f"{url}: no '{text_field}' column (columns: {', '.join(pf.schema_arrow.names)})")
            for g in range(pf.num_row_groups):
                if total >= target_bytes:
                    break
                n_rows = pf.metadata.row_group(g).num_rows
                skip = taken.get((url, g), 0)
                if skip >= n_rows:
                    continue
                col = pf.read_row_group(g, columns=[text_field]).column(0).combine_chunks().slice(skip)
                col = pc.fill_null(col, "")
                sizes = pc.binary_length(col).to_numpy(zero_copy_only=False)      # UTF-8 bytes per row
                cum = sizes.cumsum()
                need = target_bytes - total
                rows = int(min(len(cum), (cum < need).sum() + 1))                  # rows to reach the budget
                col = col.slice(0, rows)
                nbytes = int(cum[rows - 1]) if rows else 0
                path = out_dir / f"web_{len(parts):06d}.parquet"
                with atomic_path(path) as tmp:
                    pq.write_table(pa.table({"text": col}), tmp, compression="zstd")
                digest = sha256_file(path)
                parts.append({"file": path.name, "url": url, "row_group": g, "row_offset": skip, "rows": rows,
                              "text_bytes": nbytes, "bytes": path.stat().st_size, "sha256": digest})
                manifest["files"][path.name] = {"url": url, "bytes": path.stat().st_size, "sha256": digest}
                taken[(url, g)] = skip + rows
                total += nbytes
                bar.update(min(nbytes, max(0, target_bytes - bar.n)))
                atomic_write_json(out_dir / "manifest.json", manifest)
            fetched += remote.bytes_fetched
    finally:
        bar.close()
    manifest["target_bytes"] = target_bytes
    manifest["text_bytes"] = total
    atomic_write_json(out_dir / "manifest.json", manifest)
    if total < target_bytes:
        print(f"warning: all {len(urls)} source files read; {total:,} of {target_bytes:,} bytes of text",
              file=sys.stderr)
    return {"out": str(out_dir), "text_bytes": total, "parts": len(parts), "downloaded_bytes": fetched,
            "files": [str(out_dir / p["file"]) for p in parts]}


# ---- Alpaca ----------------------------------------------------------------------------------------------

def validate_alpaca(records, names: list[str] | None = None) -> tuple[list[dict], list[str]]:
    """(valid records, one problem string per bad record). A record needs string `instruction`, `input`,
    `output` (a missing `input` counts as ""), with non-empty instruction and output. `names` labels the
    records in the problems (e.g. "line 121" for JSON Lines; default "record i").

        >>> validate_alpaca([{"instruction": "Hi", "input": "", "output": "Hello"}, {"instruction": 3}])[1]
        ['record 1: instruction is not a string']
    """
    if not isinstance(records, list):
        raise UserError("the Alpaca file must be a JSON list of records")
    good, bad = [], []
    for i, r in enumerate(records):
        label = names[i] if names is not None else f"record {i}"     # "record 3" or "line 121"
        if not isinstance(r, dict):
            bad.append(f"{label}: not a JSON object")
            continue
        r = {"input": "", **r}
        problem = None
        for key in ("instruction", "input", "output"):
            if key not in r:
                problem = f"{label}: no '{key}' field"
            elif not isinstance(r[key], str):
                problem = f"{label}: {key} is not a string"
            if problem:
                break
        if not problem and not r["instruction"].strip():
            problem = f"{label}: empty instruction"
        if not problem and not r["output"].strip():
            problem = f"{label}: empty output"
        if problem:
            bad.append(problem)
        else:
            good.append({"instruction": r["instruction"], "input": r["input"], "output": r["output"]})
    return good, bad


def fetch_alpaca(out_dir: str | Path, url: str = ALPACA_URL, sha256: str | None = None, retries: int = 5,
                 backoff: float = 1.0, progress: bool = True, sess=None) -> dict:
    """Download the Alpaca JSON, validate every record, write the valid ones to alpaca.json."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    manifest = load_manifest(out_dir)
    raw = out_dir / "alpaca_data.json"
    info = download(url, raw, sha256=sha256, retries=retries, backoff=backoff, progress=progress, sess=sess)
    manifest["files"][raw.name] = {k: info[k] for k in ("url", "bytes", "sha256")}
    try:
        records = json.loads(raw.read_bytes().decode("utf-8"))
    except (ValueError, RecursionError) as e:
        raise UserError(f"{raw} (from {url}) is not valid JSON ({e}); delete it and check --url") from None
    good, bad = validate_alpaca(records)
    if not good:
        raise UserError(f"{raw}: no valid Alpaca record ({bad[0] if bad else 'empty list'})")
    atomic_write_text(out_dir / "alpaca.json", json.dumps(good, ensure_ascii=False, indent=1) + "\n")
    _record(manifest, out_dir, out_dir / "alpaca.json", None)
    manifest["records"] = {"total": len(records), "valid": len(good), "bad": bad}
    manifest["updated"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    atomic_write_json(out_dir / "manifest.json", manifest)
    return {"out": str(out_dir), "records": len(records), "valid": len(good), "bad": bad,
            "files": [str(raw), str(out_dir / "alpaca.json")], "fetched": info["fetched"]}
