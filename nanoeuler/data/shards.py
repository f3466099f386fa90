"""Token shards: text files -> uint16 (or uint32) `.npy` shards + `manifest.json` (`prepare`), and back
(`TokenShards`).

A DATA directory holds

    manifest.json        {format, tokenizer_fingerprint, vocab_size, eos_id, tokenizer: "tokenizer.json",
                          splits: {train: {shards: [{file, tokens}], tokens, bytes}, val: {...}}, sources: [...]}
    train_000000.npy     token ids, np.save format, read memory-mapped (np.load(mmap_mode="r")): uint16, or
                         uint32 for a vocabulary of more than 65,536 tokens (Gemma 3's 262,144; `token_dtype`)
    train_000001.npy ... val_000000.npy ...
    tokenizer.json       the tokenizer the shards were made with (so `train --data DATA` needs no --tokenizer)

Every document is followed by the `</s>` id. `bytes` counts the UTF-8 bytes of the source text of a split,
so that a loss in nats/token converts to bits per byte: bpb = loss * tokens / (bytes * ln 2).

Validation holds out *whole documents* (a document = a .txt file, a JSONL/JSON record, a parquet row):
document i of a source is held out when i % 10 == 0 (as `corpus.bundled_split` holds out works).
A source with fewer than 10 documents (e.g. one big .txt file) is cut into chunks at paragraph
boundaries (~1 MB, smaller for small sources so that there are >= 50) and every 10th chunk is held out.
`val_sources=` names validation files explicitly instead; then nothing is held out of `sources`.

`prepare` streams: text is read in ~1 MB pieces, encoded in order by a process pool
(`tokenizer.encode_parallel`) and appended to the open shard, so memory does not grow with the corpus.
Several sources can be mixed with weights: a source of weight 2 contributes its training documents twice,
weight 0.5 about half of them (a deterministic low-discrepancy choice); validation is never repeated.
Sources are interleaved document by document in proportion to their planned size, so every part of the
train split sees the mix. The output is a pure function of the inputs: same files, same shards, whatever
the number of processes.

Reading (what the training loop uses):

    data = TokenShards("data/shakespeare", "train")
    x = data.sample_batch(np.random.default_rng(0), batch=32, length=131)   # int64 [32, 131]
    for xb in TokenShards(dir, "val").iter_batches(32, 131): ...             # int64 [<=32, 131]
"""
from __future__ import annotations

import heapq
import json
import math
import os
import re
import struct
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from ..config import LIMITS
from ..errors import UserError
from ..fileio import atomic_write_json, check_real_dir

FORMAT = "nanoeuler-shards-v1"
SPLITS = ("train", "val")
VAL_EVERY = 10
MIN_DOCS_FOR_DOC_HOLDOUT = 10      # fewer documents than this: hold out chunks instead
CHUNK_CHARS = 1 << 20              # ~1 MB pieces: the unit of encoding, and of holdout for few-document sources
MIN_CHUNK_CHARS = 1 << 10
DEFAULT_SHARD_TOKENS = 1 << 25     # 32 Mi tokens = 64 MiB per shard
TEXT_SUFFIXES = (".txt", ".md")
JSON_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet",)
SUPPORTED = TEXT_SUFFIXES + JSON_SUFFIXES + PARQUET_SUFFIXES
TOKENIZER_FILE = "tokenizer.json"   # the tokenizer the shards were made with, carried in the DATA directory
DATA_OWN_FILES = ("manifest.json", TOKENIZER_FILE, "tokenizer.vocab")   # and the shards, SHARD_FILE
SHARD_FILE = re.compile(r"^(train|val)_[0-9]{6}\.npy$")
_GOLDEN = (math.sqrt(5) - 1) / 2


# ----------------------------------------------------------------------------------------------------------
# Reading
# ----------------------------------------------------------------------------------------------------------

class TokenShards:
    """One split ("train" or "val") of a DATA directory, as one long memory-mapped token stream.

    Attributes: n_tokens, n_bytes, vocab_size, eos_id, tokenizer_fingerprint, split, data_dir, manifest.
    Raises UserError for a missing or empty directory, a missing or broken manifest, a missing, truncated
    or corrupt shard, or an empty split.
    """

    def __init__(self, data_dir: str | Path, split: str = "train"):
        self.data_dir = Path(data_dir)
        self.split = split
        self.manifest = read_manifest(self.data_dir)
        m = self.manifest
        if split not in m["splits"]:
            raise UserError(f"{self.data_dir}: no '{split}' split in manifest.json (have: {', '.join(m['splits'])})")
        info = m["splits"][split]
        self.vocab_size = int(m["vocab_size"])
        self.eos_id = int(m["eos_id"])
        self.tokenizer_fingerprint = m["tokenizer_fingerprint"]
        self.n_bytes = int(info["bytes"])
        self._arrays = [_load_shard(self.data_dir, s, token_dtype(self.vocab_size)) for s in info["shards"]]
        lengths = [len(a) for a in self._arrays]
        self.n_tokens = int(sum(lengths))
        if self.n_tokens != int(info["tokens"]):
            raise UserError(f"{self.data_dir}: manifest says {info['tokens']} {split} tokens, shards hold "
                            f"{self.n_tokens}; re-run `nanoeuler prepare`")
        if self.n_tokens == 0:
            raise UserError(f"{self.data_dir}: the '{split}' split is empty; give `nanoeuler prepare` more text")
        self._arrays = [a for a in self._arrays if len(a)]
        self._starts = np.cumsum([0] + [len(a) for a in self._arrays])   # [n_shards + 1]

    def __len__(self) -> int:
        return self.n_tokens

    def __repr__(self) -> str:
        return (f"TokenShards({str(self.data_dir)!r}, {self.split!r}: {self.n_tokens:,} tokens, "
                f"{len(self._arrays)} shards)")

    def check_tokenizer(self, fingerprint: str) -> None:
        """Raise UserError unless these shards were made with the tokenizer of this fingerprint."""
        if fingerprint != self.tokenizer_fingerprint:
            raise UserError(f"{self.data_dir} was prepared with a different tokenizer "
                            f"({self.tokenizer_fingerprint[:12]}) than this one ({fingerprint[:12]}); "
                            "re-run `nanoeuler prepare` with the same tokenizer")

    def window(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start + length) of the split, across shard boundaries if needed -> int64 [length].

            # shards [5, 6, 7] and [8, 9]:  window(1, 3) -> [6, 7, 8]
        """
        if start < 0 or start + length > self.n_tokens:
            raise UserError(f"window [{start}, {start + length}) outside the {self.n_tokens} tokens of '{self.split}'")
        i = int(np.searchsorted(self._starts, start, side="right")) - 1
        out = np.empty(length, dtype=np.int64)
        filled = 0
        while filled < length:
            a, off = self._arrays[i], start + filled - int(self._starts[i])
            take = min(length - filled, len(a) - off)
            out[filled:filled + take] = a[off:off + take]
            filled += take
            i += 1
        return out

    def _check_length(self, length: int) -> None:
        if length < 1:
            raise UserError(f"window length must be >= 1, got {length}")
        if length > self.n_tokens:
            raise UserError(f"a window of {length} tokens does not fit the '{self.split}' split of {self.data_dir} "
                            f"({self.n_tokens} tokens); use a shorter context or more text")

    def sample_batch(self, rng: np.random.Generator, batch: int, length: int) -> np.ndarray:
        """`batch` windows of `length` tokens at uniformly random starts -> int64 [batch, length].

        Deterministic given the generator's state: draws exactly one `rng.integers(..., size=batch)`.
        """
        self._check_length(length)
        if batch < 1:
            raise UserError(f"batch size must be >= 1, got {batch}")
        starts = rng.integers(0, self.n_tokens - length + 1, size=batch)      # [batch]
        if len(self._arrays) == 1:                                             # the common fast path
            idx = starts[:, None] + np.arange(length)                          # [batch, length]
            return self._arrays[0][idx].astype(np.int64)
        return np.stack([self.window(int(s), length) for s in starts])        # [batch, length]

    def n_windows(self, length: int) -> int:
        """How many non-overlapping windows of `length` tokens `iter_batches` yields (the tail is dropped)."""
        self._check_length(length)
        return self.n_tokens // length

    def iter_batches(self, batch: int, length: int) -> Iterator[np.ndarray]:
        """Sequential non-overlapping windows 0..length, length..2*length, ... -> int64 [<=batch, length] each.

        Covers the split in order (the last partial window is dropped; the last batch may be smaller).
        """
        n = self.n_windows(length)
        if batch < 1:
            raise UserError(f"batch size must be >= 1, got {batch}")
        for first in range(0, n, batch):
            count = min(batch, n - first)
            flat = self.window(first * length, count * length)                 # [count * length]
            yield flat.reshape(count, length)


def read_manifest(data_dir: str | Path) -> dict:
    """The parsed manifest.json of a DATA directory, with clear errors for everything that can be wrong."""
    data_dir = Path(data_dir)
    hint = f"create it with `nanoeuler prepare FILES --tokenizer T --out {data_dir}`"
    if not data_dir.exists():
        raise UserError(f"data directory {data_dir} does not exist; {hint}")
    if not data_dir.is_dir():
        raise UserError(f"{data_dir} is not a directory; {hint}")
    path = data_dir / "manifest.json"
    if not path.exists():
        empty = not any(data_dir.iterdir())
        raise UserError(f"data directory {data_dir} is {'empty' if empty else 'missing manifest.json'}; {hint}")
    try:
        m = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:     # ValueError: bad JSON or UTF-8
        raise UserError(f"{path} is not valid JSON ({e}); re-run `nanoeuler prepare`") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise UserError(f"{path}: not a nanoeuler token-shard manifest (format {FORMAT!r} expected)")
    for key in ("tokenizer_fingerprint", "vocab_size", "eos_id", "splits"):
        if key not in m:
            raise UserError(f"{path}: missing field '{key}'; re-run `nanoeuler prepare`")
    check_manifest(m, path)
    return m


def check_manifest(m: dict, path) -> None:
    """Type- and range-check every manifest field a reader uses (UserError naming the field)."""
    def bad(field: str, want: str):
        raise UserError(f"{path}: field {field} must be {want}, got {_short(field, m)}; re-run `nanoeuler prepare`")

    def is_int(x, lo=0, hi=1 << 62):
        return type(x) is int and lo <= x <= hi

    if not isinstance(m["tokenizer_fingerprint"], str):
        bad("tokenizer_fingerprint", "a string")
    if not is_int(m["vocab_size"], 1, MAX_VOCAB):
        bad("vocab_size", f"an integer in [1, {MAX_VOCAB}]")
    if not is_int(m["eos_id"], 0, m["vocab_size"] - 1):
        bad("eos_id", f"an integer in [0, {m['vocab_size'] - 1}]")
    if not isinstance(m["splits"], dict):
        bad("splits", "an object")
    for split, info in m["splits"].items():
        where = f"splits.{split}"
        if not isinstance(info, dict):
            bad(where, "an object")
        for key in ("tokens", "bytes"):
            if not is_int(info.get(key)):
                bad(f"{where}.{key}", "an integer >= 0")
        if "documents" in info and not is_int(info["documents"]):
            bad(f"{where}.documents", "an integer >= 0")
        if not isinstance(info.get("shards"), list):
            bad(f"{where}.shards", "a list")
        for i, s in enumerate(info["shards"]):
            if not (isinstance(s, dict) and isinstance(s.get("file"), str) and is_int(s.get("tokens"))):
                bad(f"{where}.shards[{i}]", "{\"file\": name, \"tokens\": n}")


def _short(field: str, m: dict) -> str:
    value = m
    for part in field.split("."):
        part = part.split("[")[0]
        value = value.get(part) if isinstance(value, dict) else None
    return repr(value)[:60]


MAX_VOCAB = LIMITS["vocab_size"]   # what a model can have (config.LIMITS): uint32 shards hold any of them


def token_dtype(vocab_size: int) -> np.dtype:
    """The dtype of the shards of a vocabulary: uint16 up to 65,536 tokens, else uint32 (little-endian)."""
    return np.dtype("<u2" if vocab_size <= 1 << 16 else "<u4")


def _load_shard(data_dir: Path, entry: dict, dtype: np.dtype) -> np.ndarray:
    """np.load one shard memory-mapped, checking dtype, shape and length against the manifest entry."""
    path = data_dir / entry["file"]
    if Path(entry["file"]).name != entry["file"]:
        raise UserError(f"{data_dir}/manifest.json: bad shard name {entry['file']!r}")
    if not path.exists():
        raise UserError(f"shard {path} is missing; re-run `nanoeuler prepare`")
    try:
        a = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise UserError(f"shard {path} is corrupt ({e}); re-run `nanoeuler prepare`") from None
    if a.dtype != dtype or a.ndim != 1 or len(a) != int(entry["tokens"]):
        raise UserError(f"shard {path} is corrupt (expected {entry['tokens']} {dtype.name} tokens, found "
                        f"{a.dtype} {a.shape}); re-run `nanoeuler prepare`")
    return a


# ----------------------------------------------------------------------------------------------------------
# Writing
# ----------------------------------------------------------------------------------------------------------

def _npy_header(n_tokens: int, dtype: np.dtype) -> bytes:
    """A 128-byte .npy (version 1.0) header for a vector of n_tokens of dtype ('<u2' or '<u4'): always the
    same size, so it can be written first as a placeholder and overwritten once the length is known."""
    d = "{'descr': '%s', 'fortran_order': False, 'shape': (%d,), }" % (dtype.str, n_tokens)
    h = d.ljust(128 - 10 - 1) + "\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(h)) + h.encode("latin1")


class _ShardWriter:
    """Appends token ids to {split}_000000.npy, {split}_000001.npy, ... of at most shard_tokens each.

    Files are written under temporary names (`.name.partial`) and renamed by `commit()`.
    """

    def __init__(self, out_dir: Path, split: str, shard_tokens: int, dtype: np.dtype):
        self.out_dir, self.split, self.shard_tokens, self.dtype = out_dir, split, shard_tokens, dtype
        self.shards: list[dict] = []       # [{file, tokens}]
        self._f = None
        self._n = 0                        # tokens in the open shard
        self.tokens = 0

    def _open(self):
        name = f"{self.split}_{len(self.shards):06d}.npy"
        self.shards.append({"file": name, "tokens": 0})
        partial = self.out_dir / f".{name}.partial"
        partial.unlink(missing_ok=True)
        self._f = open(partial, "xb")      # exclusive: never through a link planted under that name
        self._f.write(_npy_header(0, self.dtype))
        self._n = 0

    def _close(self):
        self._f.seek(0)
        self._f.write(_npy_header(self._n, self.dtype))
        self._f.close()
        self._f = None
        self.shards[-1]["tokens"] = self._n

    def write(self, ids: np.ndarray) -> None:
        ids = np.asarray(ids)
        pos = 0
        while pos < len(ids):
            if self._f is None:
                self._open()
            take = min(len(ids) - pos, self.shard_tokens - self._n)
            self._f.write(ids[pos:pos + take].astype(self.dtype).tobytes())
            self._n += take
            self.tokens += take
            pos += take
            if self._n == self.shard_tokens:
                self._close()

    def finish(self) -> list[dict]:
        if self._f is not None:
            self._close()
        return self.shards

    def commit(self) -> None:
        for s in self.shards:
            os.replace(self.out_dir / f".{s['file']}.partial", self.out_dir / s["file"])

    def abort(self) -> None:
        if self._f is not None:
            try:
                self._f.close()
            except OSError:                # a full disk fails the final flush too
                pass
            self._f = None
        for s in self.shards:
            (self.out_dir / f".{s['file']}.partial").unlink(missing_ok=True)


# ---- sources and documents -------------------------------------------------------------------------------

@dataclass
class Source:
    """A named group of input files (or in-memory documents) mixed in with one weight."""
    name: str
    paths: list[Path] = field(default_factory=list)
    weight: float = 1.0
    texts: list[str] | None = None         # in-memory documents instead of files (the bundled corpus)
    split: str | None = None               # force every document to "train" or "val" (no holdout)
    text_field: str = "text"

    def count_documents(self) -> int:
        if self.texts is not None:
            return len(self.texts)
        return sum(count_documents(p, self.text_field) for p in self.paths)

    def estimated_chars(self) -> int:
        if self.texts is not None:
            return sum(len(t) for t in self.texts)
        return sum(estimate_chars(p, self.text_field) for p in self.paths)

    def documents(self) -> Iterator[Iterator[str]]:
        """Each document as an iterator of text blocks (streamed: a big file is never read whole)."""
        if self.texts is not None:
            for t in self.texts:
                yield iter((t,))
            return
        for p in self.paths:
            yield from iter_documents(p, self.text_field)


def expand_paths(items: Iterable[str | Path]) -> list[Path]:
    """The one input rule of `prepare` and `tokenizer train`: a file named on the command line is read
    whatever its name (.jsonl/.json: the text field of each record; .parquet: the text column; any other
    name, .py or none at all: UTF-8 text); a directory is expanded, recursively and sorted by path, to its
    .txt, .md, .jsonl, .json and .parquet files (hidden files and folders skipped)."""
    out = []
    for item in items:
        p = Path(item)
        if p.is_dir():
            found = sorted(q for q in p.rglob("*") if q.is_file() and q.suffix.lower() in SUPPORTED
                           and not any(part.startswith(".") for part in q.relative_to(p).parts))
            if not found:
                raise UserError(f"directory {p} holds no {'/'.join(SUPPORTED)} files")
            out.extend(found)
        elif p.is_file():
            out.append(p)
        elif p.exists():
            raise UserError(f"input {p} is neither a file nor a directory")
        else:
            raise UserError(f"input file {p} does not exist")
    return out


def is_plain_text(path: Path) -> bool:
    """Whether a file is read as plain text (not a JSON / JSONL / parquet container of texts)."""
    return path.suffix.lower() not in JSON_SUFFIXES + PARQUET_SUFFIXES


def _need_pyarrow():
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError("reading .parquet needs pyarrow: pip install 'nanoeuler[data]'") from None
    return pq


def _open_parquet(path: Path, text_field: str):
    pq = _need_pyarrow()
    try:
        f = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid / OSError for a broken file
        raise UserError(f"{path}: not a readable parquet file ({e})") from None
    if text_field not in f.schema_arrow.names:
        raise UserError(f"{path}: no '{text_field}' column (columns: {', '.join(f.schema_arrow.names)})")
    return f


def _json_text(record, where: str, text_field: str) -> str:
    if isinstance(record, str):
        return record
    if isinstance(record, dict) and isinstance(record.get(text_field), str):
        return record[text_field]
    raise UserError(f"{where}: expected a string or an object with a string '{text_field}' field")


def _load_json_records(path: Path) -> list:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as e:          # bad UTF-8 or JSON, or nested too deep
        raise UserError(f"{path}: not valid JSON ({e})") from None
    if isinstance(data, dict):
        data = [data]
    if not isinstance(data, list):
        raise UserError(f"{path}: expected a JSON list of records")
    return data


def count_documents(path: Path, text_field: str = "text") -> int:
    """Documents in one file: 1 for text, one per non-blank line of JSONL, per record of JSON, per parquet row."""
    suffix = path.suffix.lower()
    if is_plain_text(path):
        return 1 if path.stat().st_size else 0
    if suffix == ".jsonl":
        with open(path, "rb") as f:
            return sum(1 for line in f if line.strip())
    if suffix == ".json":
        return len(_load_json_records(path))
    return _open_parquet(path, text_field).metadata.num_rows


def estimate_chars(path: Path, text_field: str = "text") -> int:
    """Roughly how many characters of text a file holds (file size; parquet: uncompressed text column)."""
    if path.suffix.lower() in PARQUET_SUFFIXES:
        md = _open_parquet(path, text_field).metadata
        col = md.schema.to_arrow_schema().get_field_index(text_field)
        return sum(md.row_group(g).column(col).total_uncompressed_size for g in range(md.num_row_groups))
    return path.stat().st_size


def iter_documents(path: Path, text_field: str = "text") -> Iterator[Iterator[str]]:
    """The documents of one file, each an iterator of text blocks. Line endings are normalised to \\n."""
    suffix = path.suffix.lower()
    if is_plain_text(path):
        if path.stat().st_size:
            yield _read_text_blocks(path)
    elif suffix == ".jsonl":
        with open(path, encoding="utf-8", errors="replace") as f:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    try:
                        record = json.loads(line)
                    except (ValueError, RecursionError) as e:
                        raise UserError(f"{path}:{lineno}: not valid JSON ({e})") from None
                    yield iter((_normalise(_json_text(record, f"{path}:{lineno}", text_field)),))
    elif suffix == ".json":
        for i, record in enumerate(_load_json_records(path)):
            yield iter((_normalise(_json_text(record, f"{path} record {i}", text_field)),))
    else:
        f = _open_parquet(path, text_field)
        for batch in f.iter_batches(batch_size=1024, columns=[text_field]):
            for text in batch.column(0).to_pylist():
                yield iter((_normalise(text or ""),))


def _normalise(text: str) -> str:
    return text.replace("\r\n", "\n").replace("\r", "\n") if "\r" in text else text


def _read_text_blocks(path: Path, block_chars: int = CHUNK_CHARS) -> Iterator[str]:
    with open(path, encoding="utf-8", errors="replace") as f:   # universal newlines: \r\n -> \n
        while block := f.read(block_chars):
            yield block


def cut_at_paragraphs(blocks: Iterable[str], chunk_chars: int = CHUNK_CHARS) -> Iterator[str]:
    """Re-cut a stream of text blocks into pieces of about chunk_chars, at paragraph breaks where possible.

    The cut goes just before the last whitespace character of a blank-line run, so that GPT-2-style
    pre-tokenization of the pieces equals that of the whole text ("a\\n\\nb" -> "a\\n", "\\nb"):

        >>> list(cut_at_paragraphs(["aaaa\\n\\nbbbb\\n\\ncc"], chunk_chars=5))
        ['aaaa\\n', '\\nbbbb\\n', '\\ncc']

    Without a paragraph break it falls back to a line break, then a space, then a hard cut at 2x the size.
    Joining the pieces gives the input back exactly.
    """
    buf = ""
    for block in blocks:
        buf += block
        while len(buf) >= chunk_chars:
            cut = _find_cut(buf, chunk_chars)
            if cut is None:
                break
            yield buf[:cut]
            buf = buf[cut:]
    if buf:
        yield buf


def _find_cut(buf: str, chunk_chars: int) -> int | None:
    limit = 2 * chunk_chars
    lo = max(1, chunk_chars // 2)
    for sep in ("\n\n", "\n", " "):
        j = buf.find(sep, chunk_chars - len(sep))          # first separator at/after the target size
        if j == -1 or j > limit:
            j = buf.rfind(sep, lo, chunk_chars)            # else the last one before it
        if j > 0:
            k = j + len(sep)
            while k < len(buf) and buf[k] in " \t\n":      # extend over the whole whitespace run
                k += 1
            if k == len(buf):                              # the run may continue in the next block
                if len(buf) < limit:
                    return None
                return k
            return k - 1                                   # cut before its last character
    if len(buf) >= limit:
        return chunk_chars
    return None


# ---- the event stream: (split, text, ends_document) in a deterministic order -----------------------------

def _selected(index: int, fraction: float) -> bool:
    """Deterministic low-discrepancy choice of about `fraction` of indices: frac(index * 0.618...) < fraction."""
    return (index * _GOLDEN) % 1.0 < fraction


def _with_last(it: Iterator[str]) -> Iterator[tuple[str, bool]]:
    """(item, is_last) pairs, looking one item ahead."""
    prev = None
    for x in it:
        if prev is not None:
            yield prev, False
        prev = x
    if prev is not None:
        yield prev, True


def _source_documents(src: Source, n_docs: int, chunk_chars: int) -> Iterator[Iterator[tuple[str, str, bool]]]:
    """The documents of one source over all its passes (weight), each an iterator of (split, text, last).

    Holdout unit = the document (i % 10 == 0 -> val), or for a source with few documents the chunk
    (global chunk index within the source). Validation units appear in the first pass only.
    """
    by_chunk = src.split is None and n_docs < MIN_DOCS_FOR_DOC_HOLDOUT
    counter = [0]                                              # chunk index within the source, per pass

    def chunk_events(pieces: Iterator[str], first_pass: bool, fraction: float):
        def kept():
            for text in pieces:
                i = counter[0]
                counter[0] += 1
                if i % VAL_EVERY == 0:
                    if first_pass:
                        yield "val", text
                elif _selected(i, fraction):
                    yield "train", text
        for (split, text), last in _with_last(kept()):
            yield split, text, last

    n_passes = max(1, math.ceil(src.weight))
    for p in range(n_passes):
        fraction = min(1.0, src.weight - p)                    # share of training units taken in this pass
        counter[0] = 0
        for di, blocks in enumerate(src.documents()):
            pieces = cut_at_paragraphs(blocks, chunk_chars)
            if by_chunk:
                yield chunk_events(pieces, p == 0, fraction)
                continue
            split = src.split or ("val" if di % VAL_EVERY == 0 else "train")
            if split == "val" and p > 0 or split == "train" and not _selected(di, fraction):
                continue
            yield ((split, text, last) for text, last in _with_last(pieces))


def _interleave(streams: list[Iterator[Iterator[tuple[str, str, bool]]]], planned: list[float]
                ) -> Iterator[tuple[str, str, bool]]:
    """Merge the sources' documents, always taking the next document from the source that is furthest
    behind its planned share (emitted chars / planned chars; ties -> the earlier source).
    Yields (split, text, last, document key): the key (source, document number) lets the caller count
    the documents a split holds text of (a held-out chunk of one big file counts its document once)."""
    heap = [(0.0, i) for i in range(len(streams))]
    emitted = [0] * len(streams)
    n_doc = [0] * len(streams)
    heapq.heapify(heap)
    while heap:
        _, i = heapq.heappop(heap)
        doc = next(streams[i], None)
        if doc is None:
            continue
        n_doc[i] += 1
        for split, text, last in doc:
            emitted[i] += len(text)
            yield split, text, last, (i, n_doc[i])
        heapq.heappush(heap, (emitted[i] / max(planned[i], 1.0), i))


def _encode_stream(tok, texts: Iterator[str], processes: int | None) -> Iterator[np.ndarray]:
    """Token ids of each text, in order: `tokenizer.encode_parallel` (a process pool; in-process for
    processes=1). Any other object with an `encode` method (a test stand-in) is run in this process."""
    from ..tokenizer import Tokenizer, encode_parallel
    if isinstance(tok, Tokenizer):
        return encode_parallel(tok, texts, processes=processes)
    return (np.asarray(tok.encode(t), dtype=np.int64) for t in texts)


def _load_tokenizer(tokenizer):
    if isinstance(tokenizer, (str, Path)):
        from ..tokenizer import Tokenizer
        path = Path(tokenizer)
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.exists():
            raise UserError(f"tokenizer {path} does not exist; train one with `nanoeuler tokenizer train`")
        return Tokenizer.load(path)
    return tokenizer


def _as_sources(items, split: str | None = None) -> list[Source]:
    """Accept Source objects, paths, or (path-or-list, weight) pairs."""
    out = []
    plain = []
    for item in items or []:
        if isinstance(item, Source):
            out.append(item)
        elif isinstance(item, tuple):
            paths, weight = item
            paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
            out.append(Source(name=", ".join(map(str, paths)), paths=expand_paths(paths), weight=float(weight)))
        else:
            plain.append(item)
    if plain:
        paths = expand_paths(plain)
        out.insert(0, Source(name=", ".join(map(str, plain)), paths=paths))
    for s in out:
        if split is not None:
            s.split = split
        if s.weight < 0 or not math.isfinite(s.weight):
            raise UserError(f"source {s.name}: weight must be a finite number >= 0, got {s.weight}")
    return out


def prepare(sources, tokenizer, out_dir: str | Path, val_sources=None, processes: int | None = None,
            shard_tokens: int = DEFAULT_SHARD_TOKENS, text_field: str = "text", progress: bool = True,
            force: bool = False) -> dict:
    """Encode text into token shards + manifest.json in out_dir; return the manifest.

    sources: file/directory paths (one source), or (paths, weight) pairs / `Source`s for a weighted mix.
    tokenizer: a Tokenizer or the path of a tokenizer.json. val_sources: files that form the validation
    split (then nothing is held out of `sources`). processes: encoding processes (default: all cores).
    force: replace the shards of an earlier prepare in out_dir (see `check_data_out`).

        prepare(["books.txt", ("web/", 3.0)], "tokenizer.json", "data/mix")   # web text weighted 3x
    """
    tok = _load_tokenizer(tokenizer)
    if shard_tokens < 1:
        raise UserError(f"shard_tokens must be >= 1, got {shard_tokens}")
    srcs = _as_sources(sources)
    if val_sources:
        for s in srcs:
            s.split = "train"
        srcs += _as_sources(val_sources, split="val")
    if not srcs:
        raise UserError("no input files given")
    for s in srcs:
        s.text_field = text_field
    return _prepare_sources(srcs, tok, Path(out_dir), processes, shard_tokens, progress, force)


def prepare_bundled(tokenizer, out_dir: str | Path, processes: int | None = None,
                    shard_tokens: int = DEFAULT_SHARD_TOKENS, progress: bool = True, force: bool = False) -> dict:
    """Prepare the bundled Shakespeare corpus: validation = the held-out whole works of `bundled_split()`."""
    from .corpus import bundled_split, bundled_works
    works = bundled_works()
    train, val = bundled_split()
    srcs = [Source(name="bundled:shakespeare (train works)", texts=[works[n] for n in train], split="train"),
            Source(name="bundled:shakespeare (validation works)", texts=[works[n] for n in val], split="val")]
    return _prepare_sources(srcs, _load_tokenizer(tokenizer), Path(out_dir), processes, shard_tokens, progress,
                            force)


def check_data_out(out_dir: Path, tok, force: bool) -> None:
    """What `prepare` may write into: a new or empty directory, one holding only a DATA directory's own
    files (shards, manifest.json, tokenizer.json/.vocab; an earlier finished prepare needs force), never a
    link or a directory holding other files (a checkpoint's tokenizer.json is not ours to replace); a
    tokenizer.json there without force must be the one given (it is rewritten as it is)."""
    check_real_dir(out_dir)
    if not out_dir.is_dir():
        return
    names = {p.name for p in out_dir.iterdir() if not p.name.startswith(".")}
    foreign = sorted(n for n in names if n not in DATA_OWN_FILES and not SHARD_FILE.match(n))
    if foreign:
        raise UserError(f"--out {out_dir} holds files that are not token shards ({', '.join(foreign[:3])}"
                        f"{', ...' if len(foreign) > 3 else ''}); choose a new or empty directory")
    if "manifest.json" in names and not force:
        raise UserError(f"--out {out_dir} already holds token shards (use --force to replace them)")
    if TOKENIZER_FILE in names and not force and _load_tokenizer(out_dir / TOKENIZER_FILE).fingerprint() \
            != tok.fingerprint():
        raise UserError(f"--out {out_dir} holds another tokenizer.json than the one given (use --force to "
                        f"replace it)")


def _prepare_sources(srcs: list[Source], tok, out_dir: Path, processes, shard_tokens, progress,
                     force: bool = False) -> dict:
    from tqdm import tqdm

    n_docs = [s.count_documents() for s in srcs]
    est = [s.estimated_chars() for s in srcs]
    if sum(n_docs) == 0:
        raise UserError("the input holds no documents")
    chunk_chars = []
    for s, n, e in zip(srcs, n_docs, est):   # few documents: chunks small enough to give >= 50 of them
        chunk_chars.append(CHUNK_CHARS if s.split or n >= MIN_DOCS_FOR_DOC_HOLDOUT
                           else max(MIN_CHUNK_CHARS, min(CHUNK_CHARS, e // 50)))
    planned = [e * s.weight for s, e in zip(srcs, est)]
    streams = [_source_documents(s, n, c) for s, n, c in zip(srcs, n_docs, chunk_chars)]
    total = int(sum(planned))

    check_data_out(out_dir, tok, force)
    from ..checkpoint import run_lock
    with run_lock(out_dir, "data"):            # one prepare (or training reading it) per DATA directory
        check_data_out(out_dir, tok, force)    # again, now that no other prepare can be writing it
        try:
            return _write_shards(srcs, tok, out_dir, shard_tokens, streams, planned, total, processes, progress,
                                 n_docs, chunk_chars, tqdm)
        except OSError as e:                   # a full disk, a vanished directory: the old data is intact
            why = "the disk is full" if e.errno in (28, 122) else (e.strerror or str(e))
            raise UserError(f"could not write {out_dir}: {why}; its previous data (if any) is intact") from None


def _write_shards(srcs, tok, out_dir, shard_tokens, streams, planned, total, processes, progress, n_docs,
                  chunk_chars, tqdm) -> dict:
    dtype = token_dtype(tok.vocab_size)
    writers = {split: _ShardWriter(out_dir, split, shard_tokens, dtype) for split in SPLITS}
    n_bytes = dict.fromkeys(SPLITS, 0)
    docs_seen: dict[str, set] = {split: set() for split in SPLITS}
    eos = np.array([tok.eos_id], dtype=np.int64)
    bos_id = getattr(tok, "bos_id", None)  # an imported Llama-3's <|begin_of_text|> opens every document
    bos = None if bos_id is None else np.array([bos_id], dtype=np.int64)
    meta: deque = deque()

    def texts():                       # feeds the encoder; meta remembers, in order, where each text goes
        for split, text, last, key in _interleave(streams, planned):
            meta.append((split, len(text.encode("utf-8", "surrogatepass")), len(text), last, key))
            yield text

    bar = tqdm(total=total, unit="B", unit_scale=True, desc="prepare", disable=not progress, smoothing=0.05)
    encoded = _encode_stream(tok, texts(), processes)
    try:
        for ids in encoded:
            split, nbytes, nchars, last, key = meta.popleft()
            w = writers[split]
            if bos is not None and key not in docs_seen[split]:
                w.write(bos)
            w.write(ids)
            if last:
                w.write(eos)
            docs_seen[split].add(key)
            n_bytes[split] += nbytes
            bar.update(nchars)
            bar.set_postfix_str(f"{w.tokens + writers['train' if split == 'val' else 'val'].tokens:,} tok",
                                refresh=False)
        shards = {split: w.finish() for split, w in writers.items()}
        empty = [split for split in SPLITS if writers[split].tokens == 0]
        if empty:
            raise UserError(f"the {' and '.join(empty)} split{'s are' if len(empty) > 1 else ' is'} empty: the input "
                            f"holds too little text ({sum(n_bytes.values()):,} bytes); give `prepare` more text "
                            f"(a few tens of KB at least){' or --val FILES' if 'val' in empty else ''}")
    except BaseException:
        if hasattr(encoded, "close"):
            encoded.close()            # stop the encoding processes now, not when garbage-collected
        for w in writers.values():
            w.abort()
        raise
    finally:
        bar.close()

    manifest = {
        "format": FORMAT,
        "tokenizer_fingerprint": tok.fingerprint(),
        "vocab_size": int(tok.vocab_size),
        "eos_id": int(tok.eos_id),
        "tokenizer": TOKENIZER_FILE,
        "splits": {split: {"shards": shards[split], "tokens": writers[split].tokens, "bytes": n_bytes[split],
                           "documents": len(docs_seen[split])} for split in SPLITS},
        "sources": [{"name": s.name, "files": [str(p) for p in s.paths], "weight": s.weight,
                     "documents": n, "holdout": s.split or ("documents" if n >= MIN_DOCS_FOR_DOC_HOLDOUT
                                                             else f"chunks of {c} chars")}
                    for s, n, c in zip(srcs, n_docs, chunk_chars)],
    }
    # swap in the new shards: drop the old manifest first, so a crash never pairs it with new shards
    (out_dir / "manifest.json").unlink(missing_ok=True)
    for w in writers.values():
        w.commit()
    keep = {s["file"] for split in SPLITS for s in shards[split]}
    for old in out_dir.glob("*_[0-9][0-9][0-9][0-9][0-9][0-9].npy"):
        if old.name.split("_")[0] in SPLITS and old.name not in keep:
            old.unlink()
    if hasattr(tok, "to_dict"):        # the data carries its tokenizer: train / eval / sft need no --tokenizer
        atomic_write_json(out_dir / TOKENIZER_FILE, tok.to_dict())
    atomic_write_json(out_dir / "manifest.json", manifest)
    return manifest
