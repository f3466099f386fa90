"""Held-out text for the benches that score a model (bench/vs_llama_cpp.py, bench/quant_quality.py): windows of
the bundled corpus's validation works as token ids (their loss: nanoeuler.infer.sampling.nll_sum).

    windows = held_out_windows(tok, 128, per_work=4)     # [(ids [129], bytes of the 128 targets), ...]
    bits_per_byte = sum(nll_sum(logits_of(w[:-1]), w[1:]) for w, _ in windows) / ln 2 / sum(b for _, b in windows)
"""
from __future__ import annotations


def held_out_windows(tok, T: int, per_work: int):
    """Up to per_work windows of T + 1 ids from each held-out work (ids, and the bytes of the T targets)."""
    from nanoeuler.data.corpus import bundled_split, bundled_works
    _, val = bundled_split()
    works = bundled_works()
    out = []
    for name in val:
        ids = tok.encode(works[name])
        step = max(T + 1, (len(ids) - T - 1) // per_work)
        for s in range(0, len(ids) - T - 1, step)[:per_work]:
            w = ids[s:s + T + 1]
            out.append((w, len(tok.decode_bytes(w[1:]))))
    return out
