"""Would prompt-lookup drafts pay for sampled decoding? An estimate on a trained model, without building it.

Speculative sampling verifies a draft x from a draft distribution q against the model's p with the exact
rule: accept with probability min(1, p(x) / q(x)), else draw from norm(max(p - q, 0)). A lookup draft is
one certain token (q = one-hot(x)), so it is accepted with probability p(x), and draft j of a round only
if drafts 1..j-1 were. This script samples plainly (--temperature, --top-k, seeds 0..--runs-1), and at
each position of each text asks what `speculative.Lookup` would draft after the token actually drawn
(t1), then computes the expected drafts accepted, Σ_j Π_{i<=j} p_i(d_i), from one forward over the window
with the drafts appended. The forwards saved are at most that sum over all positions: compare it with the
cost of the verifications (a step of 1 + d rows costs more than a 1-row step: bench/generate.py's
`step of 1..8 tokens` column).

    .venv/bin/python bench/lookup_sampling.py --ckpt runs/demo
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from generate import PROMPT  # noqa: E402  (bench/generate.py's prompt: the same text)


def expected_accepted(model, W, window: list[int], drafts: list[int], temperature: float, top_k) -> tuple:
    """window ends with t1; -> (P(draft 1 accepted), expected drafts accepted) under the exact rule."""
    from nanoeuler.infer.cache import new_cache
    from nanoeuler.infer.sampling import token_probs
    from nanoeuler.infer.step import forward_cached
    cache = new_cache(model.config, 1, dtype=model.dtype)
    logits = forward_cached(model.config, model.params, np.array([window + drafts]), cache, fused=W)[0, 0]  # [T, V]
    chance, total, first = 1.0, 0.0, None
    for j, d in enumerate(drafts):
        p = token_probs(logits[len(window) - 1 + j], temperature, top_k)[d]
        first = p if first is None else first
        chance *= p
        total += chance
    return first, total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", required=True, help="a trained checkpoint")
    ap.add_argument("--runs", type=int, default=4, help="sampled texts (seeds 0..runs-1)")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top-k", type=int, default=40, help="0 = all")
    ap.add_argument("--depth", type=int, default=3, help="most drafts a round (default 3, greedy's)")
    args = ap.parse_args()
    from nanoeuler.checkpoint import load_tokenizer
    from nanoeuler.infer import speculative
    from nanoeuler.infer.session import generate
    from nanoeuler.infer.step import fuse_weights
    from nanoeuler.model import Model
    model, tok = Model.load(args.ckpt), load_tokenizer(args.ckpt)
    prompt, W, top_k = tok.encode(PROMPT)[-model.config.ctx_len:], fuse_weights(model.config, model.params), \
        args.top_k or None
    positions, firsts, saved = 0, [], 0.0
    for seed in range(args.runs):
        ids = generate(model, prompt, args.new_tokens, args.temperature, top_k=top_k, seed=seed, mode="cache").ids
        seq, look = list(prompt) + ids, speculative.Lookup()
        for t in range(len(prompt), len(seq)):
            positions += 1
            start = max(0, t + 1 + args.depth - model.config.ctx_len)  # the window holds t1 and the drafts
            drafts = look.drafts(seq[:t], start, seq[t], args.depth)
            if drafts:
                first, total = expected_accepted(model, W, seq[start:t + 1], drafts, args.temperature, top_k)
                firsts.append(first)
                saved += total
    print(f"{args.ckpt}: {positions} positions sampled at temperature {args.temperature:g}, top-k "
          f"{top_k or 'all'}; a lookup found at {len(firsts) / positions:.1%} of them, its first draft accepted "
          f"with probability {np.mean(firsts) if firsts else 0:.3f}; forwards saved at most "
          f"{saved / positions:.1%} (before the verifications' cost)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
