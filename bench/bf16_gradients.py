"""How far a `--precision bf16` gradient is from the float32 one, per parameter tensor, on a trained model
and its own training data, beside what training already lives with: the difference between two batches'
float32 gradients. For n batches i: e_i = g_bf16(i) − g_f32(i).

    bf16 err      median over the batches of |e_i| / |g_f32(i)|
    cos           median cosine between g_bf16(i) and g_f32(i)
    batch noise   median of |g_f32(i+1) − g_f32(i)| / |g_f32(i)|
    bias          |mean e_i| / rms |e_i|: about 1/√n when the batches' errors are independent, 1 when the
                  rounding pushes every batch the same way

    python bench/bf16_gradients.py runs/demo                  # the `make demo` model, 8 batches of its recipe
    python bench/bf16_gradients.py runs/demo --batches 16 --json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from nanoeuler.cli.demo import DEMO_SETTINGS  # noqa: E402
from nanoeuler.cli.train import BUNDLED_DATA  # noqa: E402
from nanoeuler.model import Model  # noqa: E402
from nanoeuler.training.train import PretrainSource  # noqa: E402


def gradients(model: Model, tokens, precision: str) -> dict[str, np.ndarray]:
    model.set_precision(precision)
    _, _, grads = model.loss_and_grads(tokens)
    return {k: g.astype(np.float64) for k, g in grads.items()}


def compare(model: Model, batches) -> dict[str, dict]:
    """Per tensor: bf16 err, cos, batch noise and bias (see the module docstring) over the batches."""
    f32 = [gradients(model, t, "f32") for t in batches]
    bf16 = [gradients(model, t, "bf16") for t in batches]
    norm = np.linalg.norm
    rows = {}
    for name in f32[0]:
        err = [b[name] - f[name] for f, b in zip(f32, bf16)]
        rms = np.sqrt(np.mean([norm(e) ** 2 for e in err]))
        rows[name] = {
            "bf16_err": statistics.median(norm(e) / norm(f[name]) for e, f in zip(err, f32)),
            "cos": statistics.median(float((f[name] * b[name]).sum() / norm(f[name]) / norm(b[name]))
                                     for f, b in zip(f32, bf16)),
            "batch_noise": statistics.median(norm(f32[i + 1][name] - f32[i][name]) / norm(f32[i][name])
                                             for i in range(len(f32) - 1)),
            "bias": float(norm(np.mean(err, axis=0)) / rms)}
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("ckpt", help="a run trained on the bundled corpus (e.g. runs/demo)")
    ap.add_argument("--batches", type=int, default=8, help="batches of the demo recipe (default 8, at least 2)")
    ap.add_argument("--seed", type=int, default=1, help="which batches (default 1)")
    ap.add_argument("--json", action="store_true", help="one JSON object")
    args = ap.parse_args(argv)
    model = Model.load(Path(args.ckpt))
    cfg = model.config
    source = PretrainSource(BUNDLED_DATA, DEMO_SETTINGS["batch_size"], cfg.ctx_len, cfg.n_mtp)
    rng = np.random.default_rng(args.seed)
    rows = compare(model, [source.next_batch(rng)[0] for _ in range(max(2, args.batches))])
    if args.json:
        print(json.dumps({"ckpt": args.ckpt, "batches": args.batches, "tensors": rows}))
        return 0
    print(f"{'tensor':28} {'bf16 err':>9} {'cos':>9} {'batch noise':>11} {'bias':>5}   (bias of independent "
          f"errors ~ {1 / np.sqrt(max(2, args.batches)):.2f})")
    for name, r in rows.items():
        print(f"{name:28} {r['bf16_err']:9.2e} {r['cos']:9.6f} {r['batch_noise']:11.2f} {r['bias']:5.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
