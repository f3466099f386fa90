"""What the token id map costs: encode/decode speed of one tokenizer without a map, with the identity (our
own tokenizers: no map at all) and with a shuffled map (an imported vocabulary, e.g. GPT-2's), side by side,
and, with --before REV, the tokenizer code of that git revision (one without id maps: df31053~1).

Same text as bench/tokenizer.py (the bundled Shakespeare works, shuffled passes, --mb of it), vocab 4096.
Every variant encodes with a fresh tokenizer (cold cache, as a new process), runs are interleaved
(A B C, then B C A, ...: each variant takes each place) and the best of --repeat is kept, so a busy
machine disturbs all variants alike; Python's garbage collector is paused while a run is timed (the
kept results of earlier runs would otherwise make later runs pay for collections).

    .venv/bin/python bench/tokenizer_ids.py --before df31053~1      # ~1 minute
    .venv/bin/python bench/tokenizer_ids.py --mb 2 --lines     # one call per line: the per-call overhead
    .venv/bin/python bench/tokenizer_ids.py --mb 5 --json
"""
from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def load_bench_tokenizer():
    spec = importlib.util.spec_from_file_location("bench_tokenizer", ROOT / "bench" / "tokenizer.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tokenizer_class_at(rev: str):
    """The Tokenizer class of nanoeuler/tokenizer/tokenizer.py at git revision rev (same package, same kernels)."""
    src = subprocess.run(["git", "show", f"{rev}:nanoeuler/tokenizer/tokenizer.py"], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout
    name = "nanoeuler.tokenizer._tokenizer_before"
    spec = importlib.util.spec_from_loader(name, loader=None)
    module = importlib.util.module_from_spec(spec)
    module.__package__ = "nanoeuler.tokenizer"
    sys.modules[name] = module
    exec(compile(src, f"{rev}:tokenizer.py", "exec"), module.__dict__)
    return module.Tokenizer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, default=10.0, help="MB of English text (default 10)")
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--before", help="a git revision whose tokenizer code is timed too (e.g. df31053~1)")
    ap.add_argument("--lines", action="store_true",
                    help="encode line by line (~40 bytes a call: the per-call overhead, as chat/serve see it)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    from nanoeuler.tokenizer import Tokenizer
    docs = load_bench_tokenizer().english_docs(args.mb)
    tok = Tokenizer.train(docs, args.vocab_size, progress=False)
    if args.lines:
        docs = [ln for d in docs for ln in d.splitlines(keepends=True)]
    nbytes = sum(len(d.encode("utf-8")) for d in docs)
    plain = tok.to_dict()
    shuffled = dict(plain, ids=np.random.default_rng(0).permutation(tok.vocab_size).tolist())
    variants = {"no map": lambda: Tokenizer.from_dict(plain), "shuffled map": lambda: Tokenizer.from_dict(shuffled)}
    if args.before:
        Before = tokenizer_class_at(args.before)
        variants = {f"before ({args.before})": lambda: Before.from_dict(plain), **variants}

    def timed(fn):
        gc.collect()
        gc.disable()
        try:
            w, c = time.perf_counter(), time.process_time()
            out = fn()
            return time.perf_counter() - w, time.process_time() - c, out
        finally:
            gc.enable()

    def run(make, method):
        t = make()
        f = getattr(t, method)
        return timed(lambda: [f(d) for d in docs])

    for make in variants.values():  # compile / warm the kernels once
        make().encode("warm up")
    best: dict = {}
    outs: dict = {}
    names = list(variants)
    for r in range(args.repeat):
        for name in names[r % len(names):] + names[:r % len(names)]:
            make = variants[name]
            for method in ("encode", "encode_array"):
                w, c, out = run(make, method)
                b = best.setdefault((name, method), [w, c])
                b[0], b[1] = min(b[0], w), min(b[1], c)
                outs[(name, method)] = out
            t = make()
            ids = outs[(name, "encode")]
            w, c, _ = timed(lambda: [t.decode(x) for x in ids])
            b = best.setdefault((name, "decode"), [w, c])
            b[0], b[1] = min(b[0], w), min(b[1], c)

    ref = outs[("no map", "encode")]
    m = Tokenizer.from_dict(shuffled)
    ids_map = np.asarray(m.ids)
    checks = {"shuffled == map[no map]": all(o == ids_map[r].tolist() for o, r in zip(outs[("shuffled map", "encode")], ref)),
              "shuffled decodes back": all(m.decode(o) == d for o, d in zip(outs[("shuffled map", "encode")][:50], docs))}
    if args.before:
        checks["before == no map"] = outs[(f"before ({args.before})", "encode")] == ref
    n_tokens = sum(len(x) for x in ref)

    def mbs(key):
        w, c = best[key]
        return round(nbytes / 1e6 / w, 2), round(nbytes / 1e6 / c, 2)
    res = {"text_mb": round(nbytes / 1e6, 2), "tokens": n_tokens, "vocab_size": tok.vocab_size, "repeat": args.repeat,
           "load_average": os.getloadavg()[0],
           "mb_s_wall_cpu": {name: {method: mbs((name, method)) for method in ("encode", "encode_array", "decode")}
                             for name in variants},
           "cpu_time_ratio_over_no_map": {name: {method: round(best[(name, method)][1] / best[("no map", method)][1], 3)
                                                 for method in ("encode", "encode_array", "decode")}
                                          for name in variants},
           "checks": checks}
    if args.json:
        print(json.dumps(res))
        return
    print(f"{res['text_mb']} MB in {len(docs):,} calls, {n_tokens:,} tokens, vocab {tok.vocab_size}, best of {args.repeat}, "
          f"load average {res['load_average']:.1f}")
    print(f"{'':24s} {'encode MB/s wall/CPU':>22s} {'encode_array':>16s} {'decode':>16s}   CPU time / no map")
    for name in variants:
        r = res["mb_s_wall_cpu"][name]
        ratio = res["cpu_time_ratio_over_no_map"][name]
        print(f"{name:24s} {r['encode'][0]:>10.2f}/{r['encode'][1]:<10.2f} {r['encode_array'][0]:>7.2f}/"
              f"{r['encode_array'][1]:<8.2f} {r['decode'][0]:>7.2f}/{r['decode'][1]:<8.2f}   "
              f"{ratio['encode']:.3f} {ratio['encode_array']:.3f} {ratio['decode']:.3f}")
    print("checks:", checks)


if __name__ == "__main__":
    main()
