"""Data-parallel training on this machine, and a model on paper of `gpt` on many machines.

    python bench/ddp.py                 # small and big: ~2 min on a quiet 2-core machine
    python bench/ddp.py --quick         # small only, fewer steps
    python bench/ddp.py --json

Measured (random tokens, the training step of train.run_training without checkpoints):
  - tokens/s of `small` and `big` at their preset global batch: 1 process x all cores (the engine's
    threads) vs N ranks x 1 thread (mpiexec -n N, N = cores);
  - per step: the communication alone (reduce-scatter + all-gather of one gradient, nothing to hide
    behind), then in training the seconds spent communicating after backward (what is not hidden), with
    the gradient buckets sent while backward runs (overlap, the default; plus the seconds the hook costs
    inside backward) and after it (--no-overlap), and the step time of each;
  - AdamW state bytes per rank with --zero 0 and --zero 1.
On paper: `gpt` (116 M parameters) on 8 and 64 machines at 10 and 100 Gbit/s (see `paper_model`).

A worker (`--worker`) runs inside each process; the parent starts them and prints the table.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


# ---- the worker: runs in every process -------------------------------------------------------------------
def worker(preset: str, steps: int, warmup: int, zero: int, overlap: bool) -> None:
    import numpy as np

    from nanoeuler.training import dist
    if dist.under_mpi():
        dist.init(zero=zero, overlap=overlap)
    from nanoeuler.cli.train import PRESET_DEFAULTS
    from nanoeuler.config import PRESETS
    from nanoeuler.model import Model
    from nanoeuler.optim import AdamW, lr_schedule
    from nanoeuler.training.train import LMObjective, TrainConfig, accumulate

    cfg = PRESETS[preset]
    d = PRESET_DEFAULTS[preset]
    tcfg = TrainConfig(steps=1000, batch_size=d["batch_size"], lr=d["lr"], warmup=10)

    class Random:
        def next_batch(self, rng):
            return rng.integers(0, cfg.vocab_size, (tcfg.batch_size, cfg.ctx_len + cfg.n_mtp)), None

        def describe(self):
            return {"random": True}

    model = Model.init(cfg, seed=0)
    obj = LMObjective(model, Random(), tcfg)
    opt = AdamW(obj.params, lr=tcfg.lr, betas=(tcfg.beta1, tcfg.beta2), weight_decay=tcfg.weight_decay)
    rng = np.random.default_rng(0)
    comm = dist.world()
    trainer = dist.Trainer(comm, obj, opt, tcfg, {"step": 0, "kind": "bench"}, rng)
    times, comm_s = [], []
    pure = 0.0
    if comm.size > 1:
        # communication alone: one step's gradient reduce-scatter + all-gather, no compute to hide behind
        grads = {n: np.ones_like(p) for n, p in obj.params.items()}
        reps = []
        for _ in range(3):
            comm.comm.Barrier()
            t0 = time.perf_counter()
            trainer.red.finish(grads)
            trainer.red.allgather(trainer.red.G)
            reps.append(time.perf_counter() - t0)
        pure = float(np.median(reps))
    for step in range(warmup + steps):
        if comm.size > 1:
            comm.comm.Barrier()  # start each step together: what is left to wait for is communication, not
            # a rank that fell behind on this shared machine
        red = getattr(trainer, "red", None)
        c0 = (red.exposed_s, red.hook_s) if red else (0.0, 0.0)
        t0 = time.perf_counter()
        m, grads, n, _ = accumulate(obj, rng, 1, trainer)
        trainer.step(grads, lr_schedule(step, tcfg.lr, tcfg.warmup, tcfg.steps))
        if step >= warmup:
            times.append(time.perf_counter() - t0)
            comm_s.append((red.exposed_s - c0[0], red.hook_s - c0[1]) if red else (0.0, 0.0))
    step_s = float(np.median(times))
    if comm.size > 1:  # the slowest rank sets the pace: report rank 0's view of the medians
        comm_med = float(np.median([c[0] for c in comm_s]))
        hook_med = float(np.median([c[1] for c in comm_s]))
        opt_bytes = trainer.opt_bytes
    else:
        comm_med, hook_med, opt_bytes = 0.0, 0.0, sum(a.nbytes for a in opt.m.values()) + sum(a.nbytes for a in opt.v.values())
    if comm.rank == 0:
        tokens = tcfg.batch_size * cfg.ctx_len
        print(json.dumps({"preset": preset, "ranks": comm.size, "threads": __import__("nanoeuler.fast.parallel",
                          fromlist=["PARTS"]).PARTS, "zero": zero, "overlap": overlap, "step_s": step_s,
                          "tokens_per_s": tokens / step_s, "comm_wait_s": comm_med, "hook_s": hook_med, "comm_alone_s": pure, "opt_bytes_per_rank": opt_bytes,
                          "params": cfg.n_params()}), flush=True)


# ---- the parent ------------------------------------------------------------------------------------------
def run(preset: str, ranks: int, steps: int, warmup: int, zero: int = 0, overlap: bool = True) -> dict:
    py = sys.executable
    args = [str(Path(__file__).resolve()), "--worker", preset, "--steps", str(steps), "--warmup", str(warmup),
            "--zero", str(zero)] + ([] if overlap else ["--no-overlap"])
    if ranks == 1:
        cmd = [py, *args]
    else:
        from nanoeuler.training.dist import mpiexec_path
        cmd = [mpiexec_path(), "-n", str(ranks), py, *args]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    if p.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def paper_model(params: float = 116e6, seq_per_step: int = 64, ctx: int = 512, tokens_per_s_per_machine=None,
                alpha_s: float = 50e-6, buckets: int = 30) -> list[dict]:
    """Per step of `gpt` with a global batch of seq_per_step x ctx tokens, data parallel over N machines:

        compute_s  = tokens / N / (tokens/s of one machine)
        comm bytes = 2 (N-1)/N x 4 B x params per machine (reduce-scatter of gradients + all-gather of
                     gradients, or of parameters with ZeRO-1: the same volume)
        comm_s     = comm bytes x 8 / bandwidth + 2 (N-1) x buckets x alpha (per-message latency, TCP)
        exposed_s  = comm_s without overlap; with overlap max(0, comm_s - 2/3 compute_s): buckets leave
                     while backward (about 2/3 of a step) still runs, so up to that much is hidden.
    tokens_per_s_per_machine: measured `big` throughput scaled by parameters (6·P FLOPs per token)."""
    rows = []
    for n in (8, 64):
        for gbit in (10, 100):
            if seq_per_step % n:
                continue
            compute = seq_per_step * ctx / n / tokens_per_s_per_machine
            comm = 2 * (n - 1) / n * 4 * params * 8 / (gbit * 1e9) + 2 * (n - 1) * buckets * alpha_s
            hidden = min(comm, 2 / 3 * compute)
            rows.append({"machines": n, "gbit_s": gbit, "compute_s": compute, "comm_s": comm,
                         "exposed_no_overlap_s": comm, "exposed_overlap_s": comm - hidden,
                         "efficiency_no_overlap": compute / (compute + comm),
                         "efficiency_overlap": compute / (compute + comm - hidden)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--zero", type=int, default=0)
    ap.add_argument("--no-overlap", action="store_true")
    ap.add_argument("--quick", action="store_true", help="small only, fewer steps")
    ap.add_argument("--ranks", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if a.worker:
        worker(a.worker, a.steps, a.warmup, a.zero, not a.no_overlap)
        return
    n = max(2, a.ranks)
    plan = {"small": 6 if a.quick else 8, **({} if a.quick else {"big": 3})}
    load = os.getloadavg()
    results = []
    for preset, steps in plan.items():
        one = run(preset, 1, steps, 2)
        dp = run(preset, n, steps, 2)
        nov = run(preset, n, steps, 2, overlap=False)
        z1 = run(preset, n, 1, 0, zero=1)  # for its memory
        results.append({"preset": preset, "one": one, "dp": dp, "no_overlap": nov, "zero1": z1})
    big = next((r for r in results if r["preset"] == "big"), results[0])
    # one machine's gpt throughput: this machine's best measured tokens/s, scaled by parameters (6·P FLOPs
    # per token); a 32-core server taken as 16 of these; one GPU at 40% of ~400 TFLOP/s (bf16), for scale
    tps = max(big["one"]["tokens_per_s"], big["dp"]["tokens_per_s"]) * big["one"]["params"] / 116e6
    machines = {"this 2-core VM (measured)": tps, "32-core server (16x, assumed)": 16 * tps,
                "1 GPU (40% of 400 TFLOP/s, assumed)": 0.4 * 400e12 / (6 * 116e6)}
    paper = {kind: paper_model(tokens_per_s_per_machine=t) for kind, t in machines.items()}
    out = {"load_avg_before": load, "load_avg_after": os.getloadavg(), "ranks": n, "results": results,
           "paper_gpt": paper, "paper_tokens_per_s_per_machine": machines}
    if a.json:
        print(json.dumps(out))
        return
    print(f"load average before {load[0]:.2f}, after {out['load_avg_after'][0]:.2f} (side-by-side ratios in one run)")
    print(f"{'preset':<6} {'1 proc x threads':>17} {f'{n} ranks x 1':>14} {'ratio':>6} | {'comm alone':>10} "
          f"{'after bwd':>10} {'(hook)':>8} {'no overlap':>11} {'step s':>7} {'no-ovl s':>8} | {'AdamW B/rank':>13} "
          f"{'ZeRO-1':>11}")
    for r in results:
        o, d, v, z = r["one"], r["dp"], r["no_overlap"], r["zero1"]
        print(f"{r['preset']:<6} {o['tokens_per_s']:>11.0f} tok/s {d['tokens_per_s']:>8.0f} tok/s "
              f"{d['tokens_per_s'] / o['tokens_per_s']:>6.2f} | {d['comm_alone_s'] * 1e3:>7.1f} ms "
              f"{d['comm_wait_s'] * 1e3:>7.1f} ms {d['hook_s'] * 1e3:>5.1f} ms {v['comm_wait_s'] * 1e3:>8.1f} ms "
              f"{d['step_s']:>7.3f} "
              f"{v['step_s']:>8.3f} | {d['opt_bytes_per_rank'] / 2**20:>9.1f} MiB "
              f"{z['opt_bytes_per_rank'] / 2**20:>7.1f} MiB")
    print("\n`gpt` (116 M params) on paper, global batch 64 x 512 tokens per step (seconds per step):")
    print(f"{'machine':<36} {'tok/s':>8} {'N':>3} {'Gbit/s':>6} {'compute':>8} {'comm':>7} {'exposed':>8} "
          f"{'w/ overlap':>10} {'efficiency':>10} {'w/ overlap':>10}")
    for kind, rows in paper.items():
        for p in rows:
            print(f"{kind:<36} {machines[kind]:>8.0f} {p['machines']:>3} {p['gbit_s']:>6} {p['compute_s']:>8.3f} "
                  f"{p['comm_s']:>7.3f} {p['exposed_no_overlap_s']:>8.3f} {p['exposed_overlap_s']:>10.3f} "
                  f"{p['efficiency_no_overlap']:>10.0%} {p['efficiency_overlap']:>10.0%}")


if __name__ == "__main__":
    main()
