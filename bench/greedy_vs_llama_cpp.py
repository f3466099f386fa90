"""Greedy decoding of GGUF files (e.g. `export --format gguf --dtype q8_0|q4_0|q4_1` of a tuned model) by ours
and by llama.cpp: how many greedy tokens agree, and why they part where they do.

For each file and prompt: N greedy tokens from ours (the file decoded in its own block types, as `nanoeuler
sample --ckpt FILE.gguf` decodes it) and from llama.cpp (llama-cpp-python, float32 KV cache), the length of
their equal prefix, and at the first token where they part, each side's logit gap between the two candidates
(ours − llama.cpp's pick; a gap small against the logits' spread is a near tie), plus the teacher-forced relative
L2 of the two sides' logits over the prompt and our tokens (llama.cpp's from one batched evaluation, which can
rank a near tie unlike its own token-by-token decoding).

    .venv/bin/python bench/greedy_vs_llama_cpp.py tuned-q8_0.gguf tuned-q4_0.gguf tuned-q4_1.gguf
    .venv/bin/python bench/greedy_vs_llama_cpp.py FILE.gguf --tokens 64 --json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from nanoeuler.infer import kernels  # noqa: E402
from nanoeuler.infer.cache import new_cache  # noqa: E402
from nanoeuler.infer.session import generate  # noqa: E402
from nanoeuler.infer.step import forward_hidden, fuse_weights  # noqa: E402
from nanoeuler.infer.weights import QuantizedModel  # noqa: E402
from nanoeuler.interop.gguf_import import load_gguf  # noqa: E402
from nanoeuler.interop.llamacpp import LlamaCpp  # noqa: E402

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]


def compare_file(path: str, n: int) -> list[dict]:
    """One row per prompt: equal prefix, and where they part the candidates and both sides' logit gaps."""
    cfg, params, tok, _ = load_gguf(path, blocks=True)
    model = QuantizedModel.from_blocks(cfg, params)
    fused = fuse_weights(cfg, model.params)
    ctx = 2 * n + 64

    def our_logits(ids: list[int]) -> np.ndarray:                           # [T, V]
        hidden = forward_hidden(cfg, fused, np.array([ids]), new_cache(cfg, 1, ctx))[0]
        return kernels.matvec(fused["head.0"][2], hidden, cfg.vocab_size)

    teacher = LlamaCpp(path, n_ctx=ctx, logits_all=True)
    decoder = LlamaCpp(path, n_ctx=ctx)
    rows = []
    for prompt in PROMPTS:
        ids = tok.encode(prompt, add_bos=tok.bos_id is not None)
        ours = generate(model, ids, n, temperature=0, stop_ids=[]).ids
        theirs, _ = decoder.greedy(ids, n)
        part = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
        seen = ids + ours
        a, b = our_logits(seen), teacher.logits(seen)
        row = {"file": path, "prompt": prompt, "equal": n if part is None else part, "of": n,
               "rel_l2": float(np.linalg.norm(a - b) / np.linalg.norm(b))}
        if part is not None:
            pos, x, y = len(ids) + part - 1, ours[part], theirs[part]
            row |= {"ours_pick": tok.decode([x]), "llama_pick": tok.decode([y]),
                    "gap_ours": float(a[pos, x] - a[pos, y]), "gap_llama": float(b[pos, x] - b[pos, y]),
                    "logit_std": float(b[pos].std())}
        rows.append(row)
    return rows


def describe(r: dict) -> str:
    head = f"{Path(r['file']).name} {r['prompt']!r}: {r['equal']} of {r['of']} equal"
    if r["equal"] == r["of"]:
        return f"{head}; teacher-forced rel L2 {r['rel_l2']:.1e}"
    return (f"{head}, then ours {r['ours_pick']!r} / llama.cpp {r['llama_pick']!r}: gap ours {r['gap_ours']:+.3f}, "
            f"llama.cpp {r['gap_llama']:+.3f} (logit std {r['logit_std']:.2f}); teacher-forced rel L2 {r['rel_l2']:.1e}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", help="GGUF files")
    p.add_argument("--tokens", type=int, default=32, help="greedy tokens per prompt")
    p.add_argument("--json", action="store_true", help="one JSON object per prompt")
    args = p.parse_args()
    for path in args.files:
        rows = compare_file(path, args.tokens)
        for r in rows:
            print(json.dumps(r) if args.json else describe(r), flush=True)
        if not args.json:
            print(f"{Path(path).name}: {sum(r['equal'] for r in rows)} of {len(rows) * args.tokens} greedy tokens "
                  f"equal", flush=True)


if __name__ == "__main__":
    main()
