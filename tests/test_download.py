"""Downloads against a local HTTP server in the test process: resume after a dropped connection, retries,
404/500, checksums, offline errors, and the Gutenberg / FineWeb-Edu (parquet) / Alpaca fetchers."""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("requests")

from nanoeuler.cli import main as cli_main  # noqa: E402
from nanoeuler.data.download import HttpRangeFile, download, sha256_file  # noqa: E402
from nanoeuler.errors import UserError  # noqa: E402
from nanoeuler.data.sources import (fetch_alpaca, fetch_gutenberg, fetch_web, parse_size,  # noqa: E402
                               strip_gutenberg, validate_alpaca)

FIXTURES = Path(__file__).parent / "fixtures"
FAST = dict(retries=3, backoff=0.01, progress=False)


class Handler(BaseHTTPRequestHandler):
    files: dict = {}            # path -> bytes
    drop_first: set = set()     # paths whose first full GET is cut off half-way
    fail_times: dict = {}       # path -> remaining 500 answers
    no_range: set = set()       # paths served without Range support
    log: list = []              # (method, path, Range header)

    def log_message(self, *args):
        pass

    def do_HEAD(self):
        self._serve(head=True)

    def do_GET(self):
        self._serve(head=False)

    def _serve(self, head):
        cls = type(self)
        rng = self.headers.get("Range")
        cls.log.append((self.command, self.path, rng))
        if cls.fail_times.get(self.path, 0) > 0:
            cls.fail_times[self.path] -= 1
            self.send_error(500)
            return
        if self.path == "/always500":
            self.send_error(500)
            return
        body = cls.files.get(self.path)
        if body is None:
            self.send_error(404)
            return
        start, end, status = 0, len(body), 200
        if rng and self.path not in cls.no_range:
            a, _, b = rng.removeprefix("bytes=").partition("-")
            start, end = int(a), (int(b) + 1 if b else len(body))
            if start >= len(body):
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{len(body)}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            end = min(end, len(body))
            status = 206
        self.send_response(status)
        self.send_header("Content-Length", str(end - start))
        self.send_header("Accept-Ranges", "bytes")
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(body)}")
        self.end_headers()
        if head:
            return
        if self.path in cls.drop_first and start == 0:
            cls.drop_first.discard(self.path)
            self.wfile.write(body[:len(body) // 2])
            self.wfile.flush()
            self.close_connection = True
            return
        self.wfile.write(body[start:end])


@pytest.fixture()
def server():
    Handler.files, Handler.drop_first, Handler.fail_times, Handler.no_range, Handler.log = {}, set(), {}, set(), []
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def _blob(n=300_000, seed=0):
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def test_dropped_connection_resumes_with_range(server, tmp_path):
    body = _blob()
    Handler.files["/big.bin"] = body
    Handler.drop_first.add("/big.bin")
    info = download(server + "/big.bin", tmp_path / "big.bin", **FAST)
    assert (tmp_path / "big.bin").read_bytes() == body
    assert not (tmp_path / "big.bin.part").exists()
    ranges = [r for m, p, r in Handler.log if p == "/big.bin"]
    assert ranges[0] is None and len(ranges) == 2                              # the second GET resumed ...
    assert 0 < int(ranges[1].removeprefix("bytes=").rstrip("-")) <= len(body) // 2   # ... from what was kept
    assert info["fetched"] and info["sha256"] == sha256_file(tmp_path / "big.bin")
    # a finished file is not fetched again
    n = len(Handler.log)
    assert download(server + "/big.bin", tmp_path / "big.bin", **FAST)["fetched"] is False
    assert len(Handler.log) == n


def test_partial_file_from_an_earlier_run_resumes(server, tmp_path):
    body = _blob(seed=1)
    Handler.files["/f.bin"] = body
    (tmp_path / "f.bin.part").write_bytes(body[:1000])
    download(server + "/f.bin", tmp_path / "f.bin", **FAST)
    assert (tmp_path / "f.bin").read_bytes() == body
    assert Handler.log[0][2] == "bytes=1000-"
    # a server that ignores Range sends everything again: the part is rewritten, not appended to
    Handler.files["/g.bin"] = body
    Handler.no_range.add("/g.bin")
    (tmp_path / "g.bin.part").write_bytes(b"x" * 500)
    download(server + "/g.bin", tmp_path / "g.bin", **FAST)
    assert (tmp_path / "g.bin").read_bytes() == body


def test_retries_then_errors(server, tmp_path):
    Handler.files["/flaky"] = b"hello"
    Handler.fail_times["/flaky"] = 2
    download(server + "/flaky", tmp_path / "flaky", **FAST)
    assert (tmp_path / "flaky").read_bytes() == b"hello"
    with pytest.raises(UserError, match="404"):
        download(server + "/missing", tmp_path / "m", **FAST)
    assert sum(p == "/missing" for _, p, _ in Handler.log) == 1               # no retry on 404
    with pytest.raises(UserError, match="failed after 4 tries.*500"):
        download(server + "/always500", tmp_path / "x", **FAST)
    assert sum(p == "/always500" for _, p, _ in Handler.log) == 4
    assert not (tmp_path / "m").exists() and not (tmp_path / "x").exists()


def test_checksum_mismatch_and_offline(server, tmp_path):
    Handler.files["/c"] = b"content"
    with pytest.raises(UserError, match="checksum mismatch"):
        download(server + "/c", tmp_path / "c", sha256="0" * 64, **FAST)
    assert not (tmp_path / "c").exists() and not (tmp_path / "c.part").exists()
    port = server.rsplit(":", 1)[1]
    with pytest.raises(UserError, match="cannot reach"):                        # connection refused
        download(f"http://127.0.0.1:1/c", tmp_path / "c", retries=1, backoff=0.01, progress=False)
    with pytest.raises(UserError, match="cannot reach.*offline"):               # DNS failure: fails fast
        download(f"http://no-such-host.invalid:{port}/c", tmp_path / "c", **FAST)


def test_http_range_file_reads_like_a_file(server):
    body = _blob(200_000, seed=2)
    Handler.files["/r.bin"] = body
    f = HttpRangeFile(server + "/r.bin", retries=2, backoff=0.01, readahead=1000)
    assert f.size == len(body)
    f.seek(-10, 2)
    assert f.read(10) == body[-10:]
    f.seek(5000)
    assert f.read(3) == body[5000:5003] and f.read(4) == body[5003:5007]        # second read from the buffer
    assert f.read(50_000) == body[5007:55_007] and f.tell() == 55_007


def test_strip_gutenberg_fixture():
    text = strip_gutenberg((FIXTURES / "gutenberg_book.txt").read_text(encoding="utf-8"))
    assert text.startswith("CHAPTER I.\n") and text.endswith("The end came quietly.\n")
    assert "\r" not in text and "Gutenberg" not in text and "LICENSE" not in text
    with pytest.raises(ValueError, match="START"):
        strip_gutenberg("no markers here")


def test_fetch_gutenberg(server, tmp_path):
    Handler.files["/books/99999.txt"] = (FIXTURES / "gutenberg_book.txt").read_bytes()
    Handler.files["/books/5.txt"] = "*** START OF THIS PROJECT GUTENBERG EBOOK FIVE ***\nFünf.\n" \
                                    "*** END OF THIS PROJECT GUTENBERG EBOOK FIVE ***\n".encode()
    books = [{"id": 99999, "author": "A", "title": "Tiny"}, {"id": 5, "author": "B", "title": "Five"},
             {"id": 7, "author": "C", "title": "Missing"}]
    s = fetch_gutenberg(tmp_path / "g", books, url_template=server + "/books/{id}.txt", **FAST)
    assert s["books"] == 2 and [f["id"] for f in s["failed"]] == [7] and "404" in s["failed"][0]["error"]
    txt = (tmp_path / "g" / "gutenberg.txt").read_text(encoding="utf-8")
    assert txt.startswith("CHAPTER I.") and txt.endswith("Fünf.\n") and "START" not in txt
    records = [json.loads(line) for line in (tmp_path / "g" / "gutenberg.jsonl").read_text().splitlines()]
    assert [r["id"] for r in records] == [99999, 5] and records[1]["text"] == "Fünf.\n"
    m = json.loads((tmp_path / "g" / "manifest.json").read_text())
    assert m["files"]["raw/pg99999.txt"]["sha256"] == sha256_file(tmp_path / "g" / "raw" / "pg99999.txt")
    # a second run fetches only what is missing (the failed book) and the mirror override rewrites the host
    n = len(Handler.log)
    fetch_gutenberg(tmp_path / "g", books, url_template="https://www.example.org/books/{id}.txt", mirror=server,
                    **FAST)
    assert [p for _, p, _ in Handler.log[n:]] == ["/books/7.txt"]


def _parquet_bytes(tmp_path, n=2000):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    texts = [f"web document {i}: " + "education " * (i % 50 + 1) for i in range(n)]
    pq.write_table(pa.table({"id": list(range(n)), "text": texts, "score": [1.0] * n}), tmp_path / "src.parquet",
                   row_group_size=50, compression="none")
    return (tmp_path / "src.parquet").read_bytes(), texts


def test_fetch_web_streams_row_groups_until_the_budget(server, tmp_path):
    import pyarrow.parquet as pq
    body, texts = _parquet_bytes(tmp_path)
    Handler.files["/fw/000.parquet"] = body
    Handler.files["/fw/001.parquet"] = body
    urls = [server + "/fw/000.parquet", server + "/fw/001.parquet"]
    target = sum(len(t.encode()) for t in texts[:120])
    s = fetch_web(tmp_path / "web", target, urls=urls, **FAST)
    got = [t for p in s["files"] for t in pq.read_table(p).column("text").to_pylist()]
    assert got == texts[:120] and s["text_bytes"] == target and s["parts"] == 3
    assert s["downloaded_bytes"] < len(body)                        # only some row groups were fetched
    assert not any(p == "/fw/001.parquet" for _, p, _ in Handler.log)
    # asking for more continues where it stopped (mid row group), into the second file
    target2 = sum(len(t.encode()) for t in texts) + 10
    s = fetch_web(tmp_path / "web", target2, urls=urls, **FAST)
    got = [t for p in s["files"] for t in pq.read_table(p).column("text").to_pylist()]
    assert got == texts + texts[:1]
    m = json.loads((tmp_path / "web" / "manifest.json").read_text())
    assert m["text_bytes"] == s["text_bytes"] and len(m["parts"]) == s["parts"]
    # the parts are ready for `prepare`
    from nanoeuler.data.shards import count_documents
    assert sum(count_documents(Path(p)) for p in s["files"]) == len(texts) + 1


def test_fetch_alpaca_reports_bad_records(server, tmp_path):
    Handler.files["/alpaca.json"] = (FIXTURES / "alpaca_bad.json").read_bytes()
    Handler.drop_first.add("/alpaca.json")
    s = fetch_alpaca(tmp_path / "a", url=server + "/alpaca.json", **FAST)
    assert s["records"] == 6 and s["valid"] == 3
    assert [b.split(":")[0] for b in s["bad"]] == ["record 2", "record 3", "record 4"]
    good = json.loads((tmp_path / "a" / "alpaca.json").read_text())
    assert good[2] == {"instruction": "No input field is fine.", "input": "", "output": "Yes."}
    assert validate_alpaca([{"instruction": "x", "input": "", "output": "y"}])[1] == []
    with pytest.raises(UserError, match="JSON list"):
        validate_alpaca({"not": "a list"})


def test_cli_data(server, tmp_path, capsys):
    Handler.files["/alpaca.json"] = (FIXTURES / "alpaca_bad.json").read_bytes()
    code = cli_main(["data", "alpaca", "--url", server + "/alpaca.json", "--out", str(tmp_path / "a"), "--json",
                     "--backoff", "0.01"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["valid"] == 3
    code = cli_main(["data", "alpaca", "--url", server + "/nothing.json", "--out", str(tmp_path / "b"),
                     "--backoff", "0.01"])
    assert code == 3 and "404" in capsys.readouterr().err
    assert cli_main(["data", "web", "--bytes", "lots", "--out", str(tmp_path / "w")]) == 2
    assert parse_size("1G") == 10**9 and parse_size("2GiB") == 2 << 30 and parse_size("500M") == 5 * 10**8
