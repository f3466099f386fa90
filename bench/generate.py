"""Benchmark generation: tokens/s of full recomputation vs KV cache vs self-speculative decoding (MTP drafts
verified by head 0), side by side for each model, plus the draft acceptance rate.

Each model generates --new-tokens greedy tokens (no stop token) from the same prompt in the three modes;
the speculative output is checked to equal the KV-cache output token for token. Speed is decode tokens/s
(new tokens / time after the prompt's prefill), best of --repeat interleaved runs. Random-init weights are fine for
the full-vs-cache comparison; the acceptance rate (and so the speculative speed-up) only means something
for a trained model: pass one with --ckpt (its preset is read from the checkpoint).

    .venv/bin/python bench/generate.py                                   # small and big, random weights
    .venv/bin/python bench/generate.py --ckpt runs/small --presets big   # trained small + random big
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
    """Best-of-n milliseconds of one KV-cache forward of 1..max_tokens tokens after 64 cached positions
    (a decoding step, and speculative verification blocks): robust to a machine shared with others."""
    import time
    from nanoeuler.generate import forward_hidden, fuse_weights, linear, new_cache
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
            h = forward_hidden(cfg, W, np.zeros((1, tn), dtype=np.int64), cache)
            linear(h, W["head.0"])
            best = min(best, time.perf_counter() - t0)
        out.append(best * 1e3)
    return out


def bench_model(name, model, prompt_ids, n_new, repeat, modes=("full", "cache", "speculative")) -> dict:
    from nanoeuler.generate import generate
    row = {"model": name, "params": model.n_params(), "ctx": model.config.ctx_len, "K": model.config.n_mtp,
           "prompt_tokens": len(prompt_ids), "new_tokens": n_new}
    outs: dict = {}
    for r in range(repeat):  # modes interleaved, best of `repeat` each: robust to a machine shared with others
        for mode in modes:
            if mode == "full" and r:
                continue  # the slow reference runs once
            g = generate(model, prompt_ids, n_new, temperature=0, mode=mode)
            if mode not in outs or g.decode_s < outs[mode].decode_s:
                outs[mode] = g
    for mode, best in outs.items():
        row[f"{mode}_tok_s"] = len(best.ids) / best.decode_s
        row[f"{mode}_forwards"] = best.forwards
    if "speculative" in outs:
        spec = outs["speculative"]
        row["acceptance"] = spec.acceptance
        row["drafted"], row["accepted"] = spec.drafted, spec.accepted
        row["tokens_per_forward"] = len(spec.ids) / max(1, spec.forwards - 1)  # decode forwards (prefill excluded)
        row["speculative_equals_greedy"] = spec.ids == outs["cache"].ids
        row["speculative_vs_cache"] = row["speculative_tok_s"] / row["cache_tok_s"]
        row["step_ms"] = step_costs(model, model.config.n_mtp)  # forward of 1..K tokens
    if "full" in outs:
        row["cache_vs_full"] = row["cache_tok_s"] / row["full_tok_s"]
        row["full_equals_cache"] = outs["full"].ids == outs["cache"].ids
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", default="small,big", help="random-init presets to run (comma-separated; '' = none)")
    ap.add_argument("--ckpt", action="append", default=[], help="a trained checkpoint to run too (repeatable)")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--prompt-tokens", type=int, default=32, help="prompt length for random-init models")
    ap.add_argument("--repeat", type=int, default=5, help="runs per mode, interleaved (best is kept; full runs once)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()
    from nanoeuler.checkpoint import load_tokenizer
    from nanoeuler.model import Model
    rows = []
    for path in args.ckpt:
        model, tok = Model.load(path), load_tokenizer(path)
        ids = tok.encode(PROMPT)[-model.config.ctx_len:]
        rows.append(bench_model(f"{path} (trained)", model, ids, args.new_tokens, args.repeat))
    for preset in [p for p in args.presets.split(",") if p]:
        model = Model.from_preset(preset, seed=0)
        ids = list(np.random.default_rng(0).integers(0, model.config.vocab_size, args.prompt_tokens))
        rows.append(bench_model(f"{preset} (random init)", model, ids, args.new_tokens, args.repeat))
    info = {"threads": os.environ.get("OMP_NUM_THREADS", "default"), "cpus": os.cpu_count(),
            "numpy": np.__version__, "rows": rows}
    if args.json:
        print(json.dumps(info))
        return 0
    print(f"greedy decoding of {args.new_tokens} new tokens; decode tokens/s (best of {args.repeat}); "
          f"OMP_NUM_THREADS={info['threads']}")
    head = f"{'model':<34} {'full':>8} {'cache':>8} {'spec':>8} {'cache/full':>10} {'spec/cache':>10} {'accept':>7} {'tok/fwd':>7} {'same':>5}"
    print(head + "  forward of 1..K tokens (ms, best of 200)")
    print("-" * len(head))
    for r in rows:
        same = r["speculative_equals_greedy"] and r["full_equals_cache"]
        print(f"{r['model']:<34} {r['full_tok_s']:8.1f} {r['cache_tok_s']:8.1f} {r['speculative_tok_s']:8.1f} "
              f"{r['cache_vs_full']:9.2f}x {r['speculative_vs_cache']:9.2f}x {r['acceptance']:7.1%} "
              f"{r['tokens_per_forward']:7.2f} {'yes' if same else 'NO':>5}  "
              + " / ".join(f"{t:.2f}" for t in r["step_ms"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
