"""Published GGUF files (`make models` fetches SmolLM2-135M-Instruct Q4_1 and Gemma 3 270M Q4_K_M) run by ours
and by llama.cpp: what a process costs, and how well each predicts. Speed: bench/llama_types.py --files.

load     process start to the first generated token (when its text reaches the pipe the process writes to,
         after the prompt's echo: both sides flush each token), the whole process (its exit too), and its peak
         RSS: `nanoeuler sample --ckpt FILE --max-new-tokens N` against llama.cpp's `llama-completion -m FILE
         -n N` (N = --tokens, default 1; its own binary, built from llama-cpp-python's source distribution), a
         fresh process each, alternating, --repeat times (median), after one warm-up run of each (the page
         cache, numba's and Python's on-disk caches); beside them the file's tensor bytes. Each side's peak includes its runtime
         and its KV cache (llama.cpp clears a float16 cache of the model's whole context, or of --ctx
         positions; ours is float32 and takes pages as it fills).
quality  bits per byte of the bundled held-out works (bench/heldout.py: windows of --window tokens, the
         model's BOS first where its tokenizer adds one) from ours decoding the file in its own types and from
         llama.cpp's logits on the same ids (llama-cpp-python, float32 KV cache), and their relative difference;
         over the same positions, the share whose top-1 token is llama.cpp's and the logits' relative L2 error
         against llama.cpp's, for ours and for llama.cpp itself computing one token at a time (its other
         kernels: where rounding alone leaves two runs of one engine on one file), and ours against that
         one-at-a-time run (the kernels llama.cpp decodes with); the same by position in the window (position
         0: its first input, the BOS where the model has one; no attention mixes positions there yet).

    .venv/bin/python bench/real_files.py --llama-completion /tmp/llbuild/bin/llama-completion
    .venv/bin/python bench/real_files.py --files .cache/models/SmolLM2-135M-Instruct.Q4_1.gguf --skip-load --json
    .venv/bin/python bench/real_files.py --llama-completion /tmp/llbuild/bin/llama-completion --skip-quality
    .venv/bin/python bench/real_files.py --llama-completion C --files .cache/llama3-1b/llama3-1b-Q8_0.gguf \
        --skip-quality --tokens 16 --ctx 256       # a 131,072-position model: llama.cpp's cache for 256 only
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.heldout import held_out_windows  # noqa: E402

MODELS = ROOT / ".cache" / "models"
DEFAULT_FILES = [MODELS / "SmolLM2-135M-Instruct.Q4_1.gguf", MODELS / "gemma-3-270m-q4_k_m.gguf"]
PROMPT = "The capital of France is"


def run_measured(argv: list[str]) -> tuple[float, float, float]:
    """(seconds to the first generated token, seconds to the process's end, peak RSS in MiB) of one child
    process run to its end; the first token is the first text after PROMPT's echo on its stdout. A failure,
    or no text after the prompt, stops the bench. Python may cache bytecode (PYTHONDONTWRITEBYTECODE unset),
    as an installed package has it."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    with tempfile.TemporaryFile() as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, env=env)
        out, first = b"", None
        while chunk := os.read(proc.stdout.fileno(), 1 << 16):
            out += chunk
            at = out.find(PROMPT.encode())
            if first is None and at >= 0 and out[at + len(PROMPT):].strip():
                first = time.perf_counter() - t0
        _, status, usage = os.wait4(proc.pid, 0)
        seconds = time.perf_counter() - t0
        proc.stdout.close()
        err.seek(0)
        if os.waitstatus_to_exitcode(status) != 0:
            raise SystemExit(f"{argv[0]} failed: {err.read().decode(errors='replace').strip()[-400:]}")
    if first is None:
        raise SystemExit(f"{argv[0]} wrote no token after the prompt: {out[-200:]!r}")
    return first, seconds, usage.ru_maxrss / 1024


def tensor_mib(path: Path) -> float:
    import gguf
    return sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors) / 2**20


def load_rows(path: Path, binary: str, repeat: int, tokens: int = 1, ctx: int | None = None) -> dict:
    """Fresh processes of each side, `tokens` greedy tokens after PROMPT; llama.cpp's context `ctx` (its -c:
    the KV cache it allocates whole; default the file's), ours takes cache pages as positions fill."""
    ours = [sys.executable, "-m", "nanoeuler", "sample", "--ckpt", str(path), "--prompt", PROMPT,
            "--max-new-tokens", str(tokens), "--temperature", "0"]
    theirs = [binary, "-m", str(path), "-p", PROMPT, "-n", str(tokens), "--temp", "0", "-no-cnv",
              "-t", str(os.cpu_count()), *(["-c", str(ctx)] if ctx else [])]
    samples = {"ours": [], "llama.cpp": []}
    run_measured(ours), run_measured(theirs)  # warm-up: the page cache, numba's on-disk cache
    for _ in range(repeat):
        samples["ours"].append(run_measured(ours))
        samples["llama.cpp"].append(run_measured(theirs))
    row = {"tensor_mib": tensor_mib(path)}
    for who, s in samples.items():
        row[f"{who} first_token_s"] = statistics.median(f for f, _, _ in s)
        row[f"{who} process_s"] = statistics.median(t for _, t, _ in s)
        row[f"{who} peak_mib"] = statistics.median(m for _, _, m in s)
    row["peak ours/llama.cpp"] = row["ours peak_mib"] / row["llama.cpp peak_mib"]
    row["peak ours/tensors"] = row["ours peak_mib"] / row["tensor_mib"]
    row["first token ours-llama.cpp"] = row["ours first_token_s"] - row["llama.cpp first_token_s"]
    row["process ours-llama.cpp"] = row["ours process_s"] - row["llama.cpp process_s"]
    return row


def quality_row(path: Path, window: int, per_work: int) -> dict:
    import numpy as np

    from nanoeuler.cli.sample import load_for_decoding
    from nanoeuler.infer.cache import new_cache
    from nanoeuler.infer.sampling import nll_sum
    from nanoeuler.infer.step import forward_cached, fuse_weights
    from nanoeuler.interop.llamacpp import LlamaCpp
    from types import SimpleNamespace
    model, tok = load_for_decoding(SimpleNamespace(ckpt=str(path), dtype=None))
    cfg, fused = model.config, fuse_weights(model.config, model.params)
    bos = [tok.bos_id] if tok.bos_id is not None else []
    lm = LlamaCpp(path, n_ctx=window + 1 + len(bos), logits_all=True)
    lm1 = LlamaCpp(path, n_ctx=window + 1 + len(bos), logits_all=True, batch=1)
    nll = {"ours": 0.0, "llama.cpp": 0.0}
    # against llama.cpp's logits of the whole window at once: ours, and llama.cpp's own one token at a time;
    # and ours against that one-at-a-time run (llama.cpp's decoding kernels)
    pairs = ("ours", "llama.cpp 1 by 1", "ours vs llama.cpp 1 by 1")
    # per position in the window: top-1 agreements, squared error and squared norm of the reference, windows
    stats = {who: np.zeros((3, window + len(bos))) for who in pairs}
    seen = np.zeros(window + len(bos))
    n_bytes = 0
    for ids, b in held_out_windows(tok, window, per_work):
        ids = bos + list(ids)
        targets = np.array(ids[len(bos) + 1:])
        skip = len(bos)  # the logits before the window's first token predict it, not a scored target
        mine = forward_cached(cfg, None, np.array([ids[:-1]]), new_cache(cfg, 1, len(ids)), fused=fused)[0, 0]
        theirs = lm.logits(ids[:-1])
        nll["ours"] += nll_sum(mine[skip:], targets)
        nll["llama.cpp"] += nll_sum(theirs[skip:], targets)
        one = lm1.logits(ids[:-1])
        for who, other, ref in zip(pairs, (mine, one, mine), (theirs, theirs, one)):
            n = len(ref)
            stats[who][0, :n] += other.argmax(-1) == ref.argmax(-1)
            stats[who][1, :n] += np.sum((other.astype(np.float64) - ref) ** 2, axis=-1)
            stats[who][2, :n] += np.sum(ref.astype(np.float64) ** 2, axis=-1)
        seen[:len(theirs)] += 1
        n_bytes += b
    row = {f"{who} bits/byte": v / math.log(2) / n_bytes for who, v in nll.items()}
    row["relative difference"] = row["ours bits/byte"] / row["llama.cpp bits/byte"] - 1
    row["bytes scored"] = n_bytes

    def agreement(who, lo=0, hi=None):  # (top-1 agreement, relative L2) over positions lo..hi-1
        a, e2, r2 = stats[who][:, lo:hi].sum(-1)
        return a / seen[lo:hi].sum(), math.sqrt(e2 / r2)
    for who in pairs:
        row[f"top-1 {who}"], row[f"relative L2 {who}"] = agreement(who)
    row["positions"] = int(seen.sum())
    # where in a window the two sides part: llama.cpp's own two runs agree bit for bit up to some position
    row["by position (top-1, relative L2)"] = {
        f"{lo}-{hi - 1 if hi else len(seen) - 1}": {who: [round(v, 6) for v in agreement(who, lo, hi)] for who in pairs}
        for lo, hi in ((0, 1), (1, 4), (4, 16), (16, 64), (64, None))}
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", default=",".join(map(str, DEFAULT_FILES)), help="comma-separated GGUF files")
    ap.add_argument("--llama-completion", default=os.environ.get("LLAMA_COMPLETION") or shutil.which("llama-completion"),
                    help="llama.cpp's llama-completion binary (default $LLAMA_COMPLETION, else on PATH)")
    ap.add_argument("--repeat", type=int, default=3, help="fresh processes of each side (default 3)")
    ap.add_argument("--window", type=int, default=256, help="tokens per scored window (default 256)")
    ap.add_argument("--per-work", type=int, default=4, help="windows from each held-out work (default 4)")
    ap.add_argument("--tokens", type=int, default=1, help="greedy tokens each load process samples (default 1)")
    ap.add_argument("--ctx", type=int, default=None,
                    help="llama.cpp's context (-c) in the load processes (default: the file's)")
    ap.add_argument("--skip-load", action="store_true", help="quality only")
    ap.add_argument("--skip-quality", action="store_true", help="load only")
    ap.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = ap.parse_args()
    if not args.skip_load and not args.llama_completion:
        raise SystemExit("no llama-completion binary: --llama-completion PATH (or --skip-load)")
    report = {"load_before": os.getloadavg(), "rows": []}
    for f in filter(None, args.files.split(",")):
        path = Path(f)
        if not path.is_file():
            raise SystemExit(f"{path} not found; run `make models`")
        row = {"file": path.name}
        if not args.skip_load:
            row |= load_rows(path, args.llama_completion, args.repeat, args.tokens, args.ctx)
        if not args.skip_quality:
            row |= quality_row(path, args.window, args.per_work)
        report["rows"].append(row)
        print(f"  {path.name} done", file=sys.stderr, flush=True)
    report["load_after"] = os.getloadavg()
    if args.json:
        print(json.dumps(report))
        return
    for r in report["rows"]:
        print(r["file"])
        for k, v in r.items():
            if isinstance(v, dict):
                print(f"  {k}:")
                for span, by in v.items():
                    print(f"    {span:>8}: " + ", ".join(f"{who} {a:.3f} / {e:.2e}" for who, (a, e) in by.items()))
            elif k != "file":
                print(f"  {k:>24}: {v:.6g}" if isinstance(v, float) else f"  {k:>24}: {v}")


if __name__ == "__main__":
    main()
