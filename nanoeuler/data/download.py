"""Resumable HTTP downloads with retries, back-off, checksums and a progress bar, on `requests`.

Why `requests`: it is the most widely used, best-kept Python HTTP client; streaming bodies
(`iter_content`), `Range` headers and connection pooling come for free, and its exceptions tell a dropped
connection (`ChunkedEncodingError`) from an unreachable host (`ConnectionError`). Retries are done here,
not by urllib3's `Retry`, because a retry must *resume* from the bytes already on disk.

A download goes to `dest.part`; only a complete body is renamed to `dest`, so an existing `dest` is a
finished file and is never fetched again. An interrupted download (Ctrl-C, a dropped connection, a crash)
leaves `dest.part`, and the next attempt asks for the rest with `Range: bytes=<size>-`; a server that
ignores ranges (200 instead of 206) is read from the start again.

    info = download("https://example.org/big.json", "data/big.json")   # {"path", "bytes", "sha256", "url"}

`requests` is an optional dependency (the `data` extra): importing this module does not need it.
"""
from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path
from urllib.parse import urlparse

from ..errors import UserError

CHUNK = 1 << 16
RETRY_STATUS = {408, 425, 429, 500, 502, 503, 504}
USER_AGENT = "nanoeuler-data/0.1 (+https://github.com/; educational LM pipeline)"


def _requests():
    try:
        import requests
    except ImportError:
        raise UserError("downloading needs `requests`: pip install 'nanoeuler[data]'") from None
    return requests


def session():
    """A requests.Session with our User-Agent (one per command: connections are reused)."""
    s = _requests().Session()
    s.headers["User-Agent"] = USER_AGENT
    return s


def sha256_file(path: str | Path) -> str:
    """Hex SHA-256 of a file, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


class Retry(Exception):
    """A transient failure: try again (resuming) after a back-off."""


class Unreachable(UserError):
    """The host cannot be reached at all (offline, DNS failure, connection refused after all retries)."""


def _unreachable(url: str, err: Exception) -> UserError:
    host = urlparse(url).netloc
    return Unreachable(f"cannot reach {host} ({type(err).__name__}): are you offline? "
                     "Retry later, or point --url/--mirror at a reachable copy", exit_code=3)


def _is_dns_failure(err: Exception) -> bool:
    text = repr(err)
    return any(s in text for s in ("NameResolutionError", "Name or service not known", "nodename nor servname",
                                   "Temporary failure in name resolution", "getaddrinfo failed"))


def with_retries(fn, url: str, retries: int = 5, backoff: float = 1.0, what: str = "download"):
    """Call fn() until it succeeds; on a transient error (dropped connection, timeout, 5xx, 429) wait
    backoff * 2**attempt seconds (capped at 60) and call it again. Unreachable hosts fail fast."""
    requests = _requests()
    last = None
    for attempt in range(retries + 1):
        try:
            return fn()
        except Retry as e:
            last = e
        except requests.exceptions.ConnectionError as e:
            if _is_dns_failure(e):
                raise _unreachable(url, e) from None
            last = e
        except (requests.exceptions.ChunkedEncodingError, requests.exceptions.Timeout,
                requests.exceptions.ContentDecodingError) as e:
            last = e
        if attempt < retries:
            wait = min(60.0, backoff * 2 ** attempt)
            time.sleep(wait)
    if isinstance(last, requests.exceptions.ConnectionError):
        raise _unreachable(url, last)
    raise UserError(f"{what} of {url} failed after {retries + 1} tries: {last}", exit_code=3)


def check_url(url: str, what: str = "URL") -> str:
    """Only http(s)://host/... URLs are fetched: check_url("ftp://x/y") -> UserError; file:// likewise."""
    from urllib.parse import urlsplit
    if not isinstance(url, str) or any(c in url for c in "\r\n\t "):
        raise UserError(f"{what} {url!r:.80}: not a URL")
    try:
        parts = urlsplit(url)
    except ValueError as e:
        raise UserError(f"{what} {url!r:.80}: not a URL ({e})") from None
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise UserError(f"{what} {url!r:.80}: only http:// and https:// URLs can be downloaded "
                        f"(for a local file, give its path to `nanoeuler prepare` instead)")
    return url


def _check_status(r, url: str) -> None:
    if r.status_code in RETRY_STATUS:
        raise Retry(f"HTTP {r.status_code} {r.reason}")
    if r.status_code >= 400:
        raise UserError(f"{url}: HTTP {r.status_code} {r.reason}", exit_code=3)


def download(url: str, dest: str | Path, *, sha256: str | None = None, retries: int = 5, backoff: float = 1.0,
             timeout: float = 60.0, progress: bool = True, sess=None, desc: str | None = None) -> dict:
    """Fetch url to dest, resuming a partial `dest.part`; return {"url", "path", "bytes", "sha256"}.

    An existing dest is kept (not fetched again) unless `sha256` is given and does not match, in which case
    it is fetched again. A body whose SHA-256 differs from `sha256` raises UserError (and is removed).
    """
    from tqdm import tqdm

    check_url(url)
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    if dest.exists():
        digest = sha256_file(dest)
        if sha256 is None or digest == sha256:
            return {"url": url, "path": str(dest), "bytes": dest.stat().st_size, "sha256": digest, "fetched": False}
        dest.unlink()
    part = dest.with_name(dest.name + ".part")
    sess = sess or session()
    bar = tqdm(unit="B", unit_scale=True, desc=desc or dest.name, disable=not progress, leave=False)

    def attempt():
        have = part.stat().st_size if part.exists() else 0
        headers = {"Range": f"bytes={have}-"} if have else {}
        with sess.get(url, headers=headers, stream=True, timeout=timeout) as r:
            if r.status_code == 416 and have:               # asked past the end: the part is complete?
                total = r.headers.get("Content-Range", "").rpartition("/")[2]
                if total.isdigit() and int(total) == have:
                    return
                part.unlink()
                raise Retry("HTTP 416 for a partial download; starting again")
            _check_status(r, url)
            if have and r.status_code == 206:
                start = int(r.headers.get("Content-Range", "bytes 0-").split()[1].split("-")[0])
                if start != have:
                    part.unlink()
                    raise Retry(f"server resumed at byte {start}, not {have}; starting again")
                mode = "ab"
            else:                                           # 200: the whole body (range ignored or fresh)
                have, mode = 0, "wb"
            length = r.headers.get("Content-Length")
            expected = have + int(length) if length and length.isdigit() else None
            bar.reset(total=expected)
            bar.update(have)
            with open(part, mode) as f:
                for block in r.iter_content(CHUNK):
                    f.write(block)
                    bar.update(len(block))
            size = part.stat().st_size
            if expected is not None and size != expected:
                raise Retry(f"connection closed after {size} of {expected} bytes")

    try:
        with_retries(attempt, url, retries=retries, backoff=backoff)
    finally:
        bar.close()
    digest = sha256_file(part)
    if sha256 is not None and digest != sha256:
        part.unlink()
        raise UserError(f"{url}: checksum mismatch (sha256 {digest[:16]}..., expected {sha256[:16]}...); "
                        "the file was removed — check --url or the mirror", exit_code=3)
    os.replace(part, dest)
    return {"url": url, "path": str(dest), "bytes": dest.stat().st_size, "sha256": digest, "fetched": True}


class HttpRangeFile:
    """A read-only, seekable file over HTTP Range requests, for pyarrow to read parts of a remote parquet file.

    Each read is one GET with `Range: bytes=a-b` (with retries); a small read-ahead serves pyarrow's many
    tiny footer reads from one request.

        f = HttpRangeFile(url); pq.ParquetFile(f).read_row_group(3, columns=["text"])
    """

    def __init__(self, url: str, sess=None, retries: int = 5, backoff: float = 1.0, timeout: float = 60.0,
                 readahead: int = 1 << 16):
        self.url, self.retries, self.backoff, self.timeout = check_url(url), retries, backoff, timeout
        self.sess = sess or session()
        self.readahead = readahead
        self.closed = False
        self.pos = 0
        self._buf_start, self._buf = 0, b""
        self.bytes_fetched = 0

        def head():
            r = self.sess.head(url, allow_redirects=True, timeout=timeout)
            _check_status(r, url)
            n = r.headers.get("Content-Length")
            if not (n and n.isdigit()):
                raise UserError(f"{url}: the server does not report the file size (needed to read parquet)")
            return int(n)

        self.size = with_retries(head, url, retries, backoff, what="HEAD")

    # the io.RawIOBase subset pyarrow uses
    def readable(self):
        return True

    def seekable(self):
        return True

    def writable(self):
        return False

    def tell(self):
        return self.pos

    def seek(self, offset, whence=0):
        self.pos = {0: offset, 1: self.pos + offset, 2: self.size + offset}[whence]
        return self.pos

    def close(self):
        self.closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _get(self, start: int, end: int) -> bytes:
        """Bytes [start, end) of the remote file."""
        def fetch():
            r = self.sess.get(self.url, headers={"Range": f"bytes={start}-{end - 1}"}, timeout=self.timeout)
            _check_status(r, self.url)
            data = r.content
            if r.status_code == 200:                       # range ignored: cut it out of the whole body
                data = data[start:end]
            if len(data) != end - start:
                raise Retry(f"short read: {len(data)} of {end - start} bytes")
            return data
        data = with_retries(fetch, self.url, self.retries, self.backoff, what="range read")
        self.bytes_fetched += len(data)
        return data

    def read(self, n: int = -1) -> bytes:
        if n is None or n < 0:
            n = self.size - self.pos
        n = max(0, min(n, self.size - self.pos))
        if n == 0:
            return b""
        lo, hi = self.pos, self.pos + n
        if not (self._buf_start <= lo and hi <= self._buf_start + len(self._buf)):
            if n < self.readahead:
                end = min(self.size, lo + self.readahead)
                self._buf_start, self._buf = lo, self._get(lo, end)
            else:
                self.pos = hi
                return self._get(lo, hi)
        data = self._buf[lo - self._buf_start:hi - self._buf_start]
        self.pos = hi
        return data
