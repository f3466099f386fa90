"""Ours against llama.cpp at each weight type, on the same GGUF file: decode and prompt tokens/s.

For each model, random-init (speed does not depend on the weights) — `big`, and `smol135`, a llama of
SmolLM-135M's shape (30 layers, d 576, 9 heads / 3 kv heads, ffn 1536, vocab 49152, tied head: 134.5 M
parameters, larger than the L3 cache) — and each type (f32, f16, q8_0, q4_0, q4_1), the file is our
`export --format gguf --dtype T` of the same float32 weights; at 1 and 2 threads:

    tg   decode tokens/s: 64 greedy tokens after a 32-token prompt (the prompt untimed), one forward each
    pp   prompt tokens/s: a 256-token prompt of random ids in one call

Ours: the checkpoint decoded at the matching `--dtype` (float32, float16, ...; its matrices equal the file's),
timed as `nanoeuler bench --decode` times it. llama.cpp: `llama-bench -p 256 -n 0` and `-p 0 -n 64 -d 32` on
the file when --llama-bench PATH (or $LLAMA_BENCH, or llama-bench on PATH) names the binary, else
llama-cpp-python on the same file (its greedy loop: each token a separate eval call, a little slower than
llama-bench); llama.cpp's defaults otherwise (f16 KV cache). Ours and llama.cpp alternate, --repeat
times per type, so the machine's load falls on both alike; each figure is the median (min–max), and
ours ÷ llama.cpp the ratio of medians. `bytes/token` is what one decoded token reads from the file's
tensors (every matrix once; the embedding table only as the tied head), `GB/s` that times tokens/s.
A type our engine cannot decode is measured on llama.cpp's side alone (ours: "-").

    .venv/bin/python bench/llama_types.py --llama-bench path/to/llama-bench         # ~10 min
    .venv/bin/python bench/llama_types.py --quick                                           # big, 1 repeat: ~2 min
    .venv/bin/python bench/llama_types.py --llama-bench B --files .cache/models/SmolLM2-135M-Instruct.Q4_1.gguf

With --files, each published file is measured as it is, its matrices in their own types (type "file").
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from nanoeuler.interop.gguf_export import LLAMA_CPP_NAMES as OURS  # noqa: E402  (our --dtype of f32, f16)

GGUF_TYPES = ("f32", "f16", "q8_0", "q4_0", "q4_1")
PROMPT, DEPTH, GEN = 256, 32, 64


def smol135():
    """SmolLM-135M's shape (ctx 512: room for the tests, not its 2048)."""
    from nanoeuler.config import Config
    return Config(vocab_size=49152, dim=576, n_heads=9, n_kv_heads=3, n_layers=30, ctx_len=512, ffn_hidden=1536,
                  n_mtp=1, rope_theta=10000.0, norm_eps=1e-5, tie_embeddings=True)


def make_model(name: str):
    from nanoeuler import Model
    return Model.from_preset(name, seed=0) if name != "smol135" else Model.init(smol135(), seed=0)


def tokenizer():
    """Any tokenizer llama.cpp can name: the model's vocabulary beyond it is exported as unused tokens."""
    from nanoeuler.data.corpus import bundled_works
    from nanoeuler.tokenizer import Tokenizer
    return Tokenizer.train([bundled_works()["hamlet"][:20000]], 300, progress=False)


def bytes_per_token(path: Path) -> int:
    """Bytes of the file's tensors one decoded token reads: all but the embedding table (one row of it),
    which is read whole when it is also the head (no `output` tensor)."""
    import gguf
    tensors = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(path).tensors}
    return sum(tensors.values()) - (tensors["token_embd.weight"] if "output.weight" in tensors else 0)


def ours_types() -> set[str]:
    from nanoeuler.infer.quant import decodable
    return {t for t in GGUF_TYPES if OURS.get(t, t) in decodable()}


class Ours:
    """Our engine on one decoding model (infer/weights.py): decode_rate as `nanoeuler bench --decode` times it."""

    def __init__(self, model):
        from nanoeuler.infer.step import fuse_weights
        self.model = model
        self.fused = fuse_weights(model.config, model.params)

    @classmethod
    def at_type(cls, model, gguf_type: str):
        """A float model decoded at a GGUF type (`--dtype`)."""
        from nanoeuler.cli.sample import decoding_model
        return cls(decoding_model(model, SimpleNamespace(dtype=OURS.get(gguf_type, gguf_type))))

    @classmethod
    def of_file(cls, path: Path):
        """A GGUF file decoded as `nanoeuler sample --ckpt FILE` decodes it: each matrix in the file's own type."""
        from nanoeuler.cli.sample import load_for_decoding
        return cls(load_for_decoding(SimpleNamespace(ckpt=str(path), dtype=None))[0])

    def rate(self, test: str, ids: list[int], threads: int) -> float:
        from nanoeuler.cli.bench import decode_rate
        from nanoeuler.infer import pool
        pool.set_threads(threads)
        try:
            if test == "pp":
                return decode_rate(self.model, self.fused, ids[:PROMPT], 0)
            return decode_rate(self.model, self.fused, ids, GEN, depth=DEPTH)
        finally:
            pool.set_threads(threads)  # our helper threads go to sleep (else they spin into llama.cpp's run)


class LlamaBench:
    """llama.cpp's own llama-bench binary on the file: one repetition per call (after its warm-up run)."""

    def __init__(self, binary: str, path: Path):
        self.binary, self.path = binary, path

    def rate(self, test: str, ids: list[int], threads: int) -> float:
        shape = ["-p", str(PROMPT), "-n", "0"] if test == "pp" else ["-p", "0", "-n", str(GEN), "-d", str(DEPTH)]
        out = subprocess.run([self.binary, "-m", str(self.path), "-t", str(threads), "-r", "1", "-o", "json", *shape],
                             capture_output=True, text=True, timeout=600)
        if out.returncode != 0:
            raise SystemExit(f"llama-bench failed on {self.path.name}: {out.stderr.strip()[-400:]}")
        return float(json.loads(out.stdout)[0]["avg_ts"])


class LlamaCppPython:
    """llama-cpp-python on the file (when no llama-bench binary is given): the same two tests by eval calls."""

    def __init__(self, path: Path):
        self.path, self.engines = path, {}

    def rate(self, test: str, ids: list[int], threads: int) -> float:
        from nanoeuler.interop.llamacpp import LlamaCpp
        if threads not in self.engines:
            self.engines[threads] = LlamaCpp(self.path, n_ctx=PROMPT + GEN, threads=threads, kv_f32=False)
        lc = self.engines[threads]
        if test == "tg":
            return GEN / lc.greedy(ids[:DEPTH], GEN + 1)[1]  # the GEN single-token evals after the prompt's
        lc.llm.reset()
        t0 = time.perf_counter()
        lc.llm.eval(ids[:PROMPT])
        return PROMPT / (time.perf_counter() - t0)


def measure(name: str, model, tok, tmp: Path, args, binary: str | None) -> list[dict]:
    import numpy as np

    from nanoeuler.interop.gguf_export import export_gguf
    ids = np.random.default_rng(0).integers(0, model.config.vocab_size, PROMPT).tolist()
    runnable, rows = ours_types(), []
    for t in args.types:
        path = export_gguf(model, tok, tmp / f"{name}-{t}.gguf", t, force=True, progress=False)
        theirs = LlamaBench(binary, path) if binary else LlamaCppPython(path)
        ours = Ours.at_type(model, t) if t in runnable else None
        rows += compare(name, t, path, ours, theirs, ids, args)
        del ours
        path.unlink()
    return rows


def measure_file(path: Path, args, binary: str | None) -> list[dict]:
    """A published GGUF as it is (a mix of block types): ours decoding it as `sample` does, against llama.cpp."""
    import numpy as np
    ours = Ours.of_file(path)
    ids = np.random.default_rng(0).integers(0, ours.model.config.vocab_size, PROMPT).tolist()
    theirs = LlamaBench(binary, path) if binary else LlamaCppPython(path)
    return compare(path.stem, "file", path, ours, theirs, ids, args)


def compare(name: str, t: str, path: Path, ours, theirs, ids: list[int], args) -> list[dict]:
    """Both sides on one file, interleaved --repeat times at each thread count -> one row per thread count."""
    sides = {"ours": ours, "llama.cpp": theirs} if ours else {"llama.cpp": theirs}
    for side in sides.values():  # warm-up: numba's kernels, the page cache, llama.cpp's first load
        side.rate("tg", ids, args.threads[0])
    samples = {}
    for _ in range(args.repeat):
        for th in args.threads:
            for test in ("tg", "pp"):
                for who, side in sides.items():
                    samples.setdefault((th, test, who), []).append(side.rate(test, ids, th))
    nbytes, rows = bytes_per_token(path), []
    for th in args.threads:
        row = {"model": name, "type": t, "threads": th, "file_mb": path.stat().st_size / 2**20,
               "bytes_per_token": nbytes}
        for (th2, test, who), s in samples.items():
            if th2 == th:
                row[f"{who} {test}"] = {"median": statistics.median(s), "min": min(s), "max": max(s)}
        for test in ("tg", "pp"):
            if ours:
                row[f"ours/llama.cpp {test}"] = row[f"ours {test}"]["median"] / row[f"llama.cpp {test}"]["median"]
        row["ours tg GB/s"] = nbytes * row["ours tg"]["median"] / 1e9 if ours else None
        row["llama.cpp tg GB/s"] = nbytes * row["llama.cpp tg"]["median"] / 1e9
        rows.append(row)
    print(f"  {name} {t} done", file=sys.stderr, flush=True)
    return rows


def cell(r: dict, key: str) -> str:
    v = r.get(key)
    return "-" if v is None else f"{v['median']:.0f} ({v['min']:.0f}-{v['max']:.0f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="big,smol135", help="comma-separated: presets and/or smol135")
    ap.add_argument("--types", default=",".join(GGUF_TYPES), help="comma-separated GGUF types")
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts (default 1,2)")
    ap.add_argument("--repeat", type=int, default=3, help="interleaved repeats (default 3)")
    ap.add_argument("--llama-bench", default=os.environ.get("LLAMA_BENCH") or shutil.which("llama-bench"),
                    help="llama.cpp's llama-bench binary (default $LLAMA_BENCH, else on PATH, else llama-cpp-python)")
    ap.add_argument("--files", default="", help="comma-separated GGUF files measured as they are, instead of "
                    "--models (e.g. the published ones `make models` fetches into .cache/models/)")
    ap.add_argument("--quick", action="store_true", help="a smoke run: big only, 1 repeat")
    ap.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = ap.parse_args()
    args.types, args.threads = args.types.split(","), [int(t) for t in args.threads.split(",")]
    models = ["big"] if args.quick else args.models.split(",")
    args.repeat = 1 if args.quick else args.repeat
    if bad := [t for t in args.types if t not in GGUF_TYPES]:
        raise SystemExit(f"unknown type {bad[0]}; choose from {', '.join(GGUF_TYPES)}")
    report = {"load_before": os.getloadavg(), "llama.cpp": args.llama_bench or "llama-cpp-python",
              "repeat": args.repeat, "rows": []}
    tok = tokenizer()
    for path in filter(None, args.files.split(",")):
        report["rows"] += measure_file(Path(path), args, args.llama_bench)
    models = [] if args.files else models
    with tempfile.TemporaryDirectory() as tmp:
        for name in models:
            report["rows"] += measure(name, make_model(name), tok, Path(tmp), args, args.llama_bench)
    report["load_after"] = os.getloadavg()
    if args.json:
        print(json.dumps(report))
        return
    print(f"llama.cpp: {report['llama.cpp']}; tg{GEN} after a {DEPTH}-token prompt, pp{PROMPT}; tokens/s, median "
          f"(min-max) of {args.repeat} interleaved; load {report['load_before'][0]:.1f} -> {report['load_after'][0]:.1f}")
    print(f"{'model':>8} {'type':>5} {'thr':>3} {'MiB/token':>9} {'ours tg':>16} {'llama.cpp tg':>16} {'ratio':>6} "
          f"{'GB/s ours/lc':>13} {'ours pp':>16} {'llama.cpp pp':>16} {'ratio':>6}")
    for r in report["rows"]:
        ratio = {k: (f"{r[f'ours/llama.cpp {k}']:.2f}x" if f"ours/llama.cpp {k}" in r else "-") for k in ("tg", "pp")}
        ours_gbs = "-" if r["ours tg GB/s"] is None else f"{r['ours tg GB/s']:.1f}"
        gbs = f"{ours_gbs}/{r['llama.cpp tg GB/s']:.1f}"
        print(f"{r['model']:>8} {r['type']:>5} {r['threads']:>3} {r['bytes_per_token'] / 2**20:>9.1f} "
              f"{cell(r, 'ours tg'):>16} {cell(r, 'llama.cpp tg'):>16} {ratio['tg']:>6} {gbs:>13} "
              f"{cell(r, 'ours pp'):>16} {cell(r, 'llama.cpp pp'):>16} {ratio['pp']:>6}")


if __name__ == "__main__":
    main()
