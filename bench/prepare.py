"""Benchmark `nanoeuler prepare` at scale: throughput (MB/s of UTF-8 text) and peak memory, for two corpus
sizes, to show that memory does not grow with the corpus (it streams).

The corpus is generated locally under --dir and deleted afterwards: the 42 bundled Shakespeare works as
.txt files (weight 2 in the mix) plus synthetic "web" documents in JSONL files (sentences sampled from a
pool built out of Shakespeare's words, paragraphs, documents of 1-40 KB), filled up to the requested size.
A 4096-token tokenizer is trained on the bundled corpus first (cached in --dir).

Memory is sampled every 0.2 s over the whole process tree (the prepare process and its encoding
workers): peak summed PSS (proportional set size: shared pages split between processes, so fork's
copy-on-write sharing is not counted twice), and each process's own peak RSS (VmHWM): the prepare
process, and the largest encoding worker.

    .venv/bin/python bench/prepare.py --sizes 100M,1G --processes 2

The prepare process (reading, batching, writing shards) holds fixed costs (interpreter, NumPy, the kernels,
tqdm) plus at most 2 x processes 1 MB batches in flight, whatever the corpus's size. A worker grows with
the tokenizer's encode cache of distinct pre-tokens, which doubles as new words appear and is capped
(2^21 entries), so it depends on the vocabulary of the text, not on its size. Figures: docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def parse_size(text: str) -> int:
    from nanoeuler.data.sources import parse_size as ps
    return ps(text)


def make_tokenizer(path: Path, vocab_size: int = 4096) -> float:
    from nanoeuler.data.corpus import bundled_works
    from nanoeuler.tokenizer import Tokenizer
    if path.exists():
        return 0.0
    t0 = time.perf_counter()
    tok = Tokenizer.train(bundled_works().values(), vocab_size, progress=False)
    tok.save(path)
    return time.perf_counter() - t0


def make_corpus(root: Path, size: int, seed: int = 0) -> dict:
    """Write books/*.txt (the bundled works) and web/*.jsonl (synthetic) so that books + web >= size bytes."""
    from nanoeuler.data.corpus import bundled_works
    rng = np.random.default_rng(seed)
    works = bundled_works()
    (root / "books").mkdir(parents=True, exist_ok=True)
    (root / "web").mkdir(parents=True, exist_ok=True)
    book_bytes = 0
    for name, text in works.items():
        (root / "books" / f"{name}.txt").write_text(text, encoding="utf-8")
        book_bytes += len(text.encode())
    words, counts = np.unique(re.findall(r"[A-Za-z']+", " ".join(works.values())), return_counts=True)
    p = counts / counts.sum()
    lengths = rng.integers(4, 25, size=100_000)                  # a pool of 100k sentences of 4-24 words
    drawn = words[rng.choice(len(words), size=int(lengths.sum()), p=p)]
    ends = rng.choice([".", ".", ".", "?", "!", ";"], size=len(lengths))
    pool, pos = [], 0
    for n, end in zip(lengths, ends):
        pool.append(" ".join(drawn[pos:pos + n]).capitalize() + end)
        pos += n
    target = size - 2 * book_bytes                               # books enter the mix with weight 2
    if target <= 0:
        raise SystemExit(f"error: a size must be more than twice the books ({2 * book_bytes / 1e6:.1f} MB): got {size:,}")
    written, n_docs, file_index = 0, 0, 0
    f = None
    while written < target:
        if f is None or f.tell() > 100_000_000:
            if f:
                f.close()
            f = open(root / "web" / f"web_{file_index:04d}.jsonl", "w", encoding="utf-8")
            file_index += 1
        doc_bytes = int(rng.integers(1_000, 40_000))
        paras, length = [], 0
        while length < doc_bytes:
            idx = rng.integers(0, len(pool), size=int(rng.integers(2, 9)))
            para = " ".join(pool[i] for i in idx)
            paras.append(para)
            length += len(para) + 2
        text = "\n\n".join(paras)
        line = json.dumps({"id": n_docs, "text": text}) + "\n"
        f.write(line)
        written += len(text.encode())
        n_docs += 1
    f.close()
    return {"book_bytes": book_bytes, "web_bytes": written, "web_docs": n_docs, "web_files": file_index}


def _tree(pid: int) -> list[int]:
    """pid and all its descendants (scanning /proc)."""
    parents = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    parents[int(d)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    out, frontier = [pid], [pid]
    while frontier:
        frontier = [c for c, pp in parents.items() if pp in frontier]
        out += frontier
    return out


def _mem_kb(pid: int, field: str, file: str = "smaps_rollup") -> int:
    try:
        with open(f"/proc/{pid}/{file}") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def run_prepare(cmd: list[str]) -> dict:
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    peak_pss = 0
    hwm = {}                                                     # pid -> peak RSS (VmHWM) seen
    while proc.poll() is None:
        pids = _tree(proc.pid)
        peak_pss = max(peak_pss, sum(_mem_kb(p, "Pss") for p in pids))
        for p in pids:
            hwm[p] = max(hwm.get(p, 0), _mem_kb(p, "VmHWM", "status"))
        time.sleep(0.1)
    workers = [v for p, v in hwm.items() if p != proc.pid]
    seconds = time.perf_counter() - t0
    out = proc.stdout.read()
    if proc.returncode != 0:
        raise SystemExit(f"prepare failed ({proc.returncode}): {out}")
    summary = json.loads(out.strip().splitlines()[-1])
    return {**summary, "wall_seconds": round(seconds, 2), "peak_tree_pss_mb": round(peak_pss / 1024, 1),
            "peak_main_rss_mb": round(hwm.get(proc.pid, 0) / 1024, 1),
            "peak_worker_rss_mb": round(max(workers, default=0) / 1024, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="100M,1G", help="corpus sizes to run, comma-separated")
    ap.add_argument("--processes", type=int, default=os.cpu_count())
    ap.add_argument("--dir", default="/tmp/nanoeuler-prepare-bench")
    ap.add_argument("--keep", action="store_true", help="keep the generated corpus and shards")
    args = ap.parse_args()
    base = Path(args.dir)
    base.mkdir(parents=True, exist_ok=True)
    tok = base / "tok4096.json"
    train_s = make_tokenizer(tok)
    results = []
    try:
        for size_text in args.sizes.split(","):
            size = parse_size(size_text)
            root = base / f"corpus_{size_text}"
            t0 = time.perf_counter()
            info = make_corpus(root, size)
            gen_s = time.perf_counter() - t0
            out = base / f"data_{size_text}"
            cmd = [sys.executable, "-m", "nanoeuler", "prepare", str(root / "books"), str(root / "web"),
                   "--mix", "2,1", "--tokenizer", str(tok), "--out", str(out), "--processes", str(args.processes),
                   "--json"]
            r = run_prepare(cmd)
            r.update(size=size_text, generated_seconds=round(gen_s, 1), **info,
                     shard_bytes=sum(p.stat().st_size for p in out.glob("*.npy")))
            results.append(r)
            print(json.dumps(r), flush=True)
            if not args.keep:
                shutil.rmtree(root)
                shutil.rmtree(out)
    finally:
        if not args.keep:
            for p in base.glob("corpus_*"):
                shutil.rmtree(p)
    print(f"\ntokenizer: 4096 vocab, trained in {train_s:.1f} s; processes={args.processes}")
    print(f"{'size':>6} {'text MB':>9} {'tokens':>13} {'seconds':>8} {'MB/s':>6} {'tree PSS MB':>12} "
          f"{'main RSS MB':>12} {'worker RSS MB':>14}")
    for r in results:
        mb = (r["train_bytes"] + r["val_bytes"]) / 1e6
        print(f"{r['size']:>6} {mb:>9.1f} {r['train_tokens'] + r['val_tokens']:>13,} {r['seconds']:>8.1f} "
              f"{r['mb_per_s']:>6.2f} {r['peak_tree_pss_mb']:>12.1f} {r['peak_main_rss_mb']:>12.1f} "
              f"{r['peak_worker_rss_mb']:>14.1f}")


if __name__ == "__main__":
    main()
