"""Benchmark generation: greedy speculative decoding (prompt-lookup drafts verified by head 0) against plain
KV-cache decoding, side by side for each model in one run, with the draft acceptance rate.

For each model, greedy (temperature 0) decoding of --new-tokens tokens (no stop token) from the same
prompt, plain ("cache") and "speculative" back to back, --repeat times. Speed is decode tokens/s (new
tokens / time after the prompt's prefill); `spec/plain` is the median over repeats of the ratio of the two
back-to-back runs, and `cpu` the same comparison in the process's CPU time summed over the repeats: on a
machine shared with others, where wall time mostly measures the scheduler, run with OPENBLAS_NUM_THREADS=1
--decode-threads 1 and read `cpu` (the work done; with two decode threads the process's CPU time also
counts a helper thread waiting for work). Speculative output is checked to equal plain greedy token for
token (`same`). `drafts` is the share of rounds that verified drafts (the rest were plain steps: no
lookup); `accept` the share of verified drafts accepted. A random-init model's text rarely repeats:
pass a trained one with --ckpt (its preset is read from the checkpoint). --full adds the slow
full-recomputation reference. `jumps` counts the window refills of one run: a generation longer than the
context recomputes the last ctx/2 tokens every ctx/2 tokens (small: 64 tokens, the time of many plain
steps), the same in both modes, so they dilute the speed-up; `--new-tokens 58` keeps the default
prompt (70 tokens on small) inside the window.

    .venv/bin/python bench/generate.py --ckpt runs/demo                     # trained + random small and big
    .venv/bin/python bench/generate.py --ckpt runs/demo --presets '' --json
    .venv/bin/python bench/generate.py --ckpt runs/demo --presets '' --spec-depth 1   # acceptance of draft 1
    .venv/bin/python bench/generate.py --ckpt runs/demo --presets '' --parts        # gain of each depth

--parts measures, on each --ckpt model, speculative decoding at the most drafts a round may verify (PARTS:
3, the default, 7 and 1), each as spec/plain against plain decoding back to back in the same run.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PROMPT = ("HAMLET.\nTo be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n"
          "The slings and arrows of outrageous fortune,\n")


def step_costs(model, max_tokens: int, n: int = 200) -> list[float]:
    """Best-of-n milliseconds of one KV-cache forward of 1..max_tokens tokens with head 0 after 64 cached
    positions (a decoding step, and speculative verification blocks): robust to a machine shared with others."""
    import time
    from nanoeuler.infer.cache import new_cache
    from nanoeuler.infer.step import advance, forward_hidden, fuse_weights
    cfg = model.config
    W = fuse_weights(cfg, model.params)
    cache = new_cache(cfg, dtype=model.dtype)
    forward_hidden(cfg, W, np.zeros((1, 64), dtype=np.int64), cache)
    out = []
    for tn in range(1, max_tokens + 1):
        best = float("inf")
        for _ in range(n):
            cache.length = 64
            t0 = time.perf_counter()
            advance(cfg, W, cache, [0] * tn)
            best = min(best, time.perf_counter() - t0)
        out.append(best * 1e3)
    return out


def compare(model, prompt_ids, n_new, repeat, depth=None) -> dict:
    """Plain vs speculative greedy decoding, back to back -> tokens/s, ratio, acceptance."""
    from nanoeuler.infer.session import generate
    runs: dict = {"cache": [], "speculative": []}
    for mode in runs:  # untimed: the first call of a process loads (or compiles) the numba kernels
        generate(model, prompt_ids, 8, 0.0, mode=mode, spec_depth=depth)
    for _ in range(repeat):
        for mode in runs:
            runs[mode].append(generate(model, prompt_ids, n_new, 0.0, mode=mode, spec_depth=depth))
    tok_s = {m: [len(g.ids) / g.decode_s for g in gs] for m, gs in runs.items()}
    cpu_s = {m: sum(g.decode_cpu_s for g in gs) for m, gs in runs.items()}
    spec = runs["speculative"]
    drafted, accepted = sum(g.drafted for g in spec), sum(g.accepted for g in spec)
    rounds = sum(g.forwards - 1 for g in spec)  # decode forwards: plain steps + verification rounds
    return {"plain_tok_s": float(np.median(tok_s["cache"])), "spec_tok_s": float(np.median(tok_s["speculative"])),
            "spec_vs_plain": float(np.median(np.array(tok_s["speculative"]) / np.array(tok_s["cache"]))),
            "spec_vs_plain_cpu": cpu_s["cache"] / cpu_s["speculative"],
            "acceptance": accepted / drafted if drafted else 0.0, "drafted": drafted, "accepted": accepted,
            "draft_round_share": sum(g.draft_rounds for g in spec) / max(1, rounds),
            "jumps": spec[0].jumps,
            "tokens_per_forward": sum(len(g.ids) for g in spec) / max(1, rounds),
            "same": all(a.ids == b.ids for a, b in zip(runs["cache"], spec))}


PARTS = {"up to 3 drafts a round (default)": 3, "up to 7 drafts a round": 7, "up to 1 draft a round": 1}


def parts(model, prompt_ids, args) -> dict:
    """PARTS on one model: each depth's spec/plain (wall and CPU), acceptance and equality."""
    return {name: compare(model, prompt_ids, args.new_tokens, args.repeat, depth) for name, depth in PARTS.items()}


def bench_model(name, model, prompt_ids, args) -> dict:
    from nanoeuler.infer import kernels
    from nanoeuler.infer.session import generate
    row = {"model": name, "params": model.n_params(), "ctx": model.config.ctx_len, "K": model.config.n_mtp,
           "prompt_tokens": len(prompt_ids), "new_tokens": args.new_tokens,
           "greedy": compare(model, prompt_ids, args.new_tokens, args.repeat, args.spec_depth),
           "step_ms": step_costs(model, kernels.ROWS)}  # a step of 1..ROWS tokens
    if args.full:
        full = generate(model, prompt_ids, args.new_tokens, temperature=0, mode="full")
        cache = generate(model, prompt_ids, args.new_tokens, temperature=0, mode="cache")
        row["full_tok_s"] = len(full.ids) / full.decode_s
        row["full_equals_cache"] = full.ids == cache.ids
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", default="small,big", help="random-init presets to run (comma-separated; '' = none)")
    ap.add_argument("--ckpt", action="append", default=[], help="a trained checkpoint to run too (repeatable)")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--prompt-tokens", type=int, default=32, help="prompt length for random-init models")
    ap.add_argument("--prompt", default=PROMPT, help="prompt text for trained models (default: the opening of Hamlet's soliloquy)")
    ap.add_argument("--repeat", type=int, default=5, help="back-to-back pairs per model")
    ap.add_argument("--full", action="store_true", help="also time full recomputation (slow) once per model")
    ap.add_argument("--spec-depth", type=int, default=None, metavar="D",
                    help="verify at most D lookup drafts a round (default 3; 7 fill one call's rows)")
    ap.add_argument("--decode-threads", type=int, default=None, metavar="N",
                    help="threads of the fused decoding step (default: the cores, at most 8). At 1, `cpu` is the "
                         "work done: with 2, the process's CPU time also counts a helper thread that waits for work")
    ap.add_argument("--parts", action="store_true",
                    help="for each --ckpt model: what each depth of speculative decoding gains (see the docstring)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()
    if args.new_tokens < 1 or args.repeat < 1 or (args.spec_depth is not None and not 1 <= args.spec_depth <= 7):
        ap.error("need --new-tokens >= 1, --repeat >= 1, 1 <= --spec-depth <= 7")
    if args.decode_threads is not None:
        from nanoeuler.infer import pool
        pool.set_threads(max(1, args.decode_threads))
    from nanoeuler.checkpoint import load_tokenizer
    from nanoeuler.model import Model
    rows = []
    for path in args.ckpt:
        model, tok = Model.load(path), load_tokenizer(path)
        ids = tok.encode(args.prompt)[-model.config.ctx_len:]
        if args.parts:
            print_parts(path, parts(model, ids, args), args)
            continue
        rows.append(bench_model(f"{path} (trained)", model, ids, args))
    if args.parts:
        return 0
    for preset in [p for p in args.presets.split(",") if p]:
        model = Model.from_preset(preset, seed=0)
        ids = list(np.random.default_rng(0).integers(0, model.config.vocab_size, args.prompt_tokens))
        rows.append(bench_model(f"{preset} (random init)", model, ids, args))
    import numba
    from nanoeuler.infer import pool
    info = {"threads": os.environ.get("OMP_NUM_THREADS", "default"), "numba_threads": numba.get_num_threads(),
            "decode_threads": pool.get_threads(),
            "openblas_threads": os.environ.get("OPENBLAS_NUM_THREADS", "default"), "cpus": os.cpu_count(),
            "load_avg": os.getloadavg()[0], "numpy": np.__version__, "rows": rows}
    if args.json:
        print(json.dumps(info))
        return 0
    print(f"{args.new_tokens} new tokens, greedy; decode tokens/s, median of {args.repeat} back-to-back pairs; "
          f"OPENBLAS_NUM_THREADS={info['openblas_threads']}, numba threads {info['numba_threads']}, decode threads "
          f"{info['decode_threads']}, load average {info['load_avg']:.2f}; most drafts a round: {args.spec_depth or 3}")
    head = (f"{'model':<30} {'plain':>7} {'spec':>7} {'spec/plain':>10} {'cpu':>6} {'accept':>7} {'drafts':>7} "
            f"{'tok/fwd':>7} {'jumps':>5} {'same':>5}")
    print(head + "  step of 1..8 tokens (ms, best of 200)")
    print("-" * len(head))
    for r in rows:
        c = r["greedy"]
        print(f"{r['model']:<30} {c['plain_tok_s']:7.1f} {c['spec_tok_s']:7.1f} {c['spec_vs_plain']:9.2f}x "
              f"{c['spec_vs_plain_cpu']:5.2f}x {c['acceptance']:7.1%} {c['draft_round_share']:7.1%} "
              f"{c['tokens_per_forward']:7.2f} {c['jumps']:5d} {'yes' if c['same'] else 'NO':>5}  "
              + " / ".join(f"{t:.2f}" for t in r["step_ms"]))
        if "full_tok_s" in r:
            print(f"{'':<30} full recomputation: {r['full_tok_s']:.1f} tok/s, equals cache: {r['full_equals_cache']}")
    return 0


def print_parts(path, table: dict, args) -> None:
    load = os.getloadavg()[0]
    if args.json:
        return print(json.dumps({"ckpt": path, "load_avg": load, "parts": table}))
    print(f"{path}: {args.new_tokens} new tokens, {args.repeat} back-to-back pairs each, load average {load:.2f}")
    print(f"{'variant':<32} {'spec/plain':>10} {'cpu':>6} {'accept':>7} {'drafts':>7} {'tok/fwd':>7} {'same':>5}")
    for name, c in table.items():
        print(f"{name:<32} {c['spec_vs_plain']:9.2f}x {c['spec_vs_plain_cpu']:5.2f}x {c['acceptance']:7.1%} "
              f"{c['draft_round_share']:7.1%} {c['tokens_per_forward']:7.2f} {'yes' if c['same'] else 'NO':>5}")


if __name__ == "__main__":
    sys.exit(main())
