"""Inference with an adapter run: merged at load (what sample, chat and serve do) against applied on the fly.

An adapter run (lora.json + adapter.safetensors, pointing to its base) can be run two ways:

    merged      load the base, merge W + s·B·A into every adapted weight once (adapters.load_merged), then
                decode with the plain model: every token costs exactly what the base's costs
    on the fly  keep the base's weights and add s·(x·Aᵀ)·Bᵀ after each product of an adapted weight, every
                step: two thin products per adapted weight per token, and the fused decoding kernels
                (infer/kernels.py) cannot run the layers as one call

This measures, on random weights of the model's shape with random adapters (B ≠ 0):
    load s      best of 3: Model.load of the base, and of the adapter run (base + sha256 check + merge), and
                those two parts alone (on the fly would still check the sha256, not merge)
    step ms     best of --reps: a KV-cache forward of `rows` tokens of the merged model after 64 cached
                positions (1 row: sample/chat; 16: a serve batch), head 0 included
    adapters ms best of --reps: the adapters' products alone for the same rows (every adapted weight's
                x·Aᵀ, ·Bᵀ and the add): the least applying them on the fly adds to a step
    tokens/s    rows / step, merged; rows / (step + adapters) on the fly, an upper bound (the fused step is
                not counted as lost)

    python bench/lora_infer.py --models gpt2                  # GPT-2 124 M, r=8 on c_attn, c_proj, c_fc
    python bench/lora_infer.py --models smollm --rank 16
    python bench/lora_infer.py --models tiny --reps 5          # smoke run (seconds)
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from lora import MODELS  # noqa: E402  (bench/: the model shapes and LoRA targets of the training bench)


def best_of(fn, reps: int) -> float:
    """Fastest of reps calls of fn(), in seconds."""
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def make_runs(model_name: str, rank: int, where: Path) -> tuple[Path, Path]:
    """A random base of the model's shape and an adapter run on it (random A, B: not the base's function)."""
    from nanoeuler import adapters as ad
    from nanoeuler.checkpoint import save_files
    from nanoeuler.config import Config
    from nanoeuler.model import Model
    fields, targets, _ = MODELS[model_name]
    cfg = Config(**fields)
    base_dir, run_dir = where / "base", where / "lora"
    Model.init(cfg, seed=0).save(base_dir)
    lcfg = ad.LoraConfig(rank, 2.0 * rank, targets).check(cfg)
    rng = np.random.default_rng(1)
    adapters = {n: rng.standard_normal(s).astype(np.float32) * 0.02 for n, s in ad.adapter_shapes(cfg, lcfg).items()}
    ref = {"path": str(base_dir.resolve()), "sha256": ad.base_fingerprint(base_dir)}
    save_files(run_dir, ad.adapter_writers(lcfg, ref, adapters))
    return base_dir, run_dir


def step_time(model, rows: int, reps: int) -> float:
    """Best seconds of a KV-cache forward of `rows` sequences × 1 token after 64 cached positions + head 0."""
    from nanoeuler.infer.cache import new_cache
    from nanoeuler.infer.step import forward_hidden, fuse_weights
    from nanoeuler.infer.weights import linear
    cfg = model.config
    W = fuse_weights(cfg, model.params, batched=rows > 1)
    cache = new_cache(cfg, batch=rows, max_len=128, dtype=model.dtype)
    forward_hidden(cfg, W, np.zeros((rows, 64), dtype=np.int64), cache)
    tokens = np.zeros((rows, 1), dtype=np.int64)

    def one():
        cache.length = 64
        h = forward_hidden(cfg, W, tokens, cache)
        linear(h.reshape(rows, -1), W["head.0"])
    one()
    return best_of(one, reps)


def adapters_time(run_dir: Path, rows: int, reps: int) -> float:
    """Best seconds of every adapted weight's on-the-fly share for `rows` rows: y += s·(x·Aᵀ)·Bᵀ."""
    from nanoeuler import adapters as ad
    lcfg, base, adapters = ad.read_adapter_run(run_dir, read_only=True)
    cfg, _ = ad.load_base(run_dir, base)
    shapes = cfg.param_shapes()
    work = []
    for module, (bases, _) in ad.modules(cfg, lcfg).items():
        A, B = adapters[module + ".lora_A"], adapters[module + ".lora_B"]
        x = np.ones((rows, A.shape[1]), np.float32)
        work.append((x, A, B, np.zeros((rows, sum(shapes[b][0] for b in bases)), np.float32)))
    s = np.float32(lcfg.scale)

    def one():
        for x, A, B, y in work:
            y += (s * (x @ A.T)) @ B.T                                        # [rows, out]
    one()
    return best_of(one, reps)


def measure(model_name: str, rank: int, reps: int, rows_list: list[int]) -> dict:
    from nanoeuler import adapters as ad
    from nanoeuler.adapters import load_merged
    from nanoeuler.model import Model
    with tempfile.TemporaryDirectory() as tmp:
        base_dir, run_dir = make_runs(model_name, rank, Path(tmp))
        load_base = best_of(lambda: Model.load(base_dir, read_only=True), 3)
        load_run = best_of(lambda: Model.load(run_dir, read_only=True), 3)
        sha = best_of(lambda: ad.base_fingerprint(base_dir), 3)
        lcfg, ref, adapters = ad.read_adapter_run(run_dir, read_only=True)
        cfg, params = ad.load_base(run_dir, ref)
        merge = best_of(lambda: ad.merge_params(cfg, params, lcfg, adapters), 3)
        model = Model(*load_merged(run_dir, read_only=True))
        out = {"model": model_name, "rank": rank, "load_base_s": load_base, "load_merged_s": load_run,
               "sha256_s": sha, "merge_s": merge, "rows": {}}
        for rows in rows_list:
            step, extra = step_time(model, rows, reps), adapters_time(run_dir, rows, reps)
            out["rows"][rows] = {"step_ms": step * 1e3, "adapters_ms": extra * 1e3,
                                 "merged_tok_s": rows / step, "on_the_fly_tok_s": rows / (step + extra)}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="gpt2", help=f"comma list of {', '.join(MODELS)}")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--rows", default="1,16", help="rows a step decodes: 1 (sample, chat), 16 (a serve batch)")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    rows_list = [int(r) for r in args.rows.split(",")]
    results = [measure(m, args.rank, args.reps, rows_list) for m in args.models.split(",")]
    if args.json:
        print(json.dumps(results))
        return
    for r in results:
        print(f"{r['model']}: load {r['load_base_s']:.3f} s (base) / {r['load_merged_s']:.3f} s (adapter run, merged), "
              f"of which the base's sha256 {r['sha256_s']:.3f} s and the merge {r['merge_s']:.3f} s")
    print(f"{'model':<8} {'load base s':>11} {'load merged s':>13} {'rows':>5} {'step ms':>8} {'adapters ms':>11} "
          f"{'merged tok/s':>12} {'on the fly tok/s':>16}  merged ÷ on the fly")
    for r in results:
        for rows, x in r["rows"].items():
            print(f"{r['model']:<8} {r['load_base_s']:>11.3f} {r['load_merged_s']:>13.3f} {rows:>5} {x['step_ms']:>8.2f} "
                  f"{x['adapters_ms']:>11.2f} {x['merged_tok_s']:>12.1f} {x['on_the_fly_tok_s']:>16.1f}  "
                  f"{x['merged_tok_s'] / x['on_the_fly_tok_s']:.2f}x")


if __name__ == "__main__":
    main()
