"""Training speed: our NumPy engine vs the same model in PyTorch (eager and torch.compile), side by side,
in float32 and in bf16 mixed precision (ours `--precision bf16`; PyTorch `torch.autocast("cpu", bfloat16)`).

For each preset, one worker process per engine (ours, torch eager, torch.compile; each also as -bf16)
builds the same model
from the same weights and the same batch, then the parent runs them *alternately*, one full training
step at a time (forward, backward, AdamW), so load from anything else on the machine hits all engines
alike. Between two steps the parent waits --pause seconds (default 0.3): PyTorch's OpenMP threads keep
spinning for a while after a step, and without the pause they would steal the cores from whichever
engine runs next. Warm-up steps
(numba cache load, torch.compile compilation) are excluded. Each step is timed twice inside the worker:
forward+backward (up to the gradients) and the full step (AdamW too). All engines use 2 threads. An engine
that fails (torch.compile may not build on this machine) is reported with its reason; the others go on.

    ms            the median step time over the timed rounds, [min-max] the spread
    tokens/s      B·T / median step time
    ours/x        our tokens/s over engine x's, in the same precision (ours over eager, ours-bf16 over
                  eager-bf16 ...): the median over the rounds of the two engines' step times in the same round,
                  [min-max] over the rounds; bf16/f32 the same for our bf16 over our float32
    MFU           6·N·tokens/s over the matmul peak of the engine's precision measured in this run: float32,
                  the best of NumPy's and torch's 2048³ sgemm; bf16, the best of our bf16 kernels' and torch's
                  bfloat16 2048³ matmul (both on THREADS threads, measured between rounds; the max over the run)
    peak MiB      the process's peak resident memory during the timed steps (VmHWM, reset after warm-up)
    train MiB     that peak minus the resident memory with libraries imported and weights built: what the
                  training step itself holds (optimizer state, gradients, activations, workspace)

    python bench/train_speed.py                         # small B=32 T=128 and big B=16 T=256, 10 steps
    python bench/train_speed.py --presets big --steps 20 --json
    python bench/train_speed.py --presets gpt2 --steps 3 --warmup 1   # GPT-2 124M (arch gpt2), B=4 T=256
    python bench/train_speed.py --presets big gpt gpt2 --engines ours eager ours-bf16 eager-bf16 compile-bf16 \
        --steps 5 --warmup 1                            # docs/training.md's table (~15 min on a quiet 2-core machine)
    python bench/train_speed.py --quick                 # smoke run: small, 2 timed steps, every engine
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHAPES = {"small": (32, 128), "big": (16, 256), "gpt": (2, 512), "gpt2": (4, 256)}  # gpt2: GPT-2 124 M fine-tuning
DEFAULT_PRESETS = ["small", "big"]
ENGINES = ("ours", "eager", "compile", "ours-bf16", "eager-bf16", "compile-bf16")
THREADS = 2


# ---------------------------------------------------------------------------------- worker side
def rss_mib(field: str = "VmRSS") -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def reset_peak_rss() -> None:
    """Reset VmHWM to the current RSS (Linux: writing 5 to clear_refs), so the peak covers what follows."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def sgemm_gflops(engine: str, n: int = 2048, reps: int = 5) -> float:
    """Best-of-reps n×n×n matmul rate in GFLOP/s with the library and precision of this worker."""
    import numpy as np
    if engine == "ours-bf16":
        from nanoeuler.fast.bf16 import peak_flops
        return peak_flops(n, seconds=0.5) / 1e9
    if engine == "ours":
        a, b = np.ones((n, n), np.float32), np.ones((n, n), np.float32)
        f = lambda: a @ b  # noqa: E731
    else:
        import torch
        dtype = torch.bfloat16 if engine.endswith("-bf16") else torch.float32
        a, b = torch.ones(n, n, dtype=dtype), torch.ones(n, n, dtype=dtype)
        f = lambda: a @ b  # noqa: E731
    f()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - t)
    return 2 * n ** 3 / best / 1e9


def make_ours(cfg, params, tokens, precision: str = "f32"):
    import numpy as np
    from nanoeuler.model import Model
    from nanoeuler.optim import AdamW
    model = Model(cfg, params).set_precision(precision)
    opt = AdamW(model.params, lr=3e-4)
    grads = model.grad_buffers()

    def step():
        t0 = time.perf_counter()
        loss, _, _ = model.loss_and_grads(tokens, out=grads)
        t1 = time.perf_counter()
        opt.step(model.params, grads)
        return time.perf_counter() - t0, t1 - t0, loss
    assert np  # numpy imported for the worker's memory baseline
    return step


def torch_model(cfg, params):
    """The SPEC model written the way a PyTorch user would: fused SDPA with GQA, F.rms_norm, F.silu."""
    import torch
    import torch.nn.functional as F
    if cfg.arch == "gpt2":
        return torch_gpt2_model(cfg, params)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            d, hd, H, Hkv, Fh = cfg.dim, cfg.head_dim, cfg.n_heads, cfg.n_kv_heads, cfg.ffn_hidden
            self.attn_norm = torch.nn.Parameter(torch.ones(d))
            self.wq = torch.nn.Linear(d, H * hd, bias=False)
            self.wk = torch.nn.Linear(d, Hkv * hd, bias=False)
            self.wv = torch.nn.Linear(d, Hkv * hd, bias=False)
            self.wo = torch.nn.Linear(H * hd, d, bias=False)
            self.ffn_norm = torch.nn.Parameter(torch.ones(d))
            self.gate = torch.nn.Linear(d, Fh, bias=False)
            self.up = torch.nn.Linear(d, Fh, bias=False)
            self.down = torch.nn.Linear(Fh, d, bias=False)

        def forward(self, x, cos, sin):
            B, T, d = x.shape
            H, Hkv, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
            h = F.rms_norm(x, (d,), self.attn_norm, cfg.norm_eps)
            q = self.wq(h).view(B, T, H, hd).transpose(1, 2)
            k = self.wk(h).view(B, T, Hkv, hd).transpose(1, 2)
            v = self.wv(h).view(B, T, Hkv, hd).transpose(1, 2)
            q, k = rope(q, cos, sin), rope(k, cos, sin)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            x = x + self.wo(a.transpose(1, 2).reshape(B, T, H * hd))
            h = F.rms_norm(x, (d,), self.ffn_norm, cfg.norm_eps)
            return x + self.down(F.silu(self.gate(h)) * self.up(h))

    def rope(x, cos, sin):
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat([-x2, x1], dim=-1) * sin

    class GPT(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(cfg.vocab_size, cfg.dim)
            self.layers = torch.nn.ModuleList([Block() for _ in range(cfg.n_layers)])
            self.norm = torch.nn.Parameter(torch.ones(cfg.dim))
            self.heads = torch.nn.ModuleList([torch.nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
                                              for _ in range(cfg.n_mtp)])
            inv = cfg.rope_theta ** (-torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim)
            ang = torch.arange(cfg.ctx_len, dtype=torch.float64)[:, None] * inv[None, :]
            ang = torch.cat([ang, ang], dim=-1)
            self.register_buffer("cos", ang.cos().float(), persistent=False)
            self.register_buffer("sin", ang.sin().float(), persistent=False)

        def forward(self, tokens):
            K = cfg.n_mtp
            T = tokens.shape[1] - K
            x = self.embed(tokens[:, :T])
            cos, sin = self.cos[:T], self.sin[:T]
            for layer in self.layers:
                x = layer(x, cos, sin)
            h = F.rms_norm(x, (cfg.dim,), self.norm, cfg.norm_eps)
            losses = [F.cross_entropy(head(h).flatten(0, 1), tokens[:, 1 + k:T + 1 + k].flatten())
                      for k, head in enumerate(self.heads)]
            return losses[0], sum(losses) / K

    model = GPT()
    names = {"embed.weight": model.embed.weight, "norm.weight": model.norm}
    for i, blk in enumerate(model.layers):
        p = f"layers.{i}."
        names |= {p + "attn_norm.weight": blk.attn_norm, p + "attn.wq.weight": blk.wq.weight,
                  p + "attn.wk.weight": blk.wk.weight, p + "attn.wv.weight": blk.wv.weight,
                  p + "attn.wo.weight": blk.wo.weight, p + "ffn_norm.weight": blk.ffn_norm,
                  p + "ffn.gate.weight": blk.gate.weight, p + "ffn.up.weight": blk.up.weight,
                  p + "ffn.down.weight": blk.down.weight}
    for k, head in enumerate(model.heads):
        names[f"heads.{k}.weight"] = head.weight
    with torch.no_grad():
        for name, t in names.items():
            t.copy_(torch.from_numpy(params[name]))
    return model


def torch_gpt2_model(cfg, params):
    """GPT-2 (arch gpt2) as nanoGPT writes it: nn.Linear with biases, F.layer_norm, fused causal SDPA,
    F.gelu(approximate="tanh"), learned positions, the head tied to the token embedding."""
    import torch
    import torch.nn.functional as F

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            d, F_ = cfg.dim, cfg.ffn_hidden
            self.ln_1, self.ln_2 = torch.nn.LayerNorm(d, eps=cfg.norm_eps), torch.nn.LayerNorm(d, eps=cfg.norm_eps)
            self.c_attn = torch.nn.Linear(d, 3 * d)
            self.c_proj = torch.nn.Linear(d, d)
            self.c_fc = torch.nn.Linear(d, F_)
            self.mlp_proj = torch.nn.Linear(F_, d)

        def forward(self, x):
            B, T, d = x.shape
            H, hd = cfg.n_heads, cfg.head_dim
            q, k, v = self.c_attn(self.ln_1(x)).split(d, dim=2)
            q, k, v = (t.view(B, T, H, hd).transpose(1, 2) for t in (q, k, v))
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.c_proj(a.transpose(1, 2).reshape(B, T, d))
            return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))

    class GPT2(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = torch.nn.Embedding(cfg.vocab_size, cfg.dim)
            self.wpe = torch.nn.Embedding(cfg.ctx_len, cfg.dim)
            self.h = torch.nn.ModuleList([Block() for _ in range(cfg.n_layers)])
            self.ln_f = torch.nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)

        def forward(self, tokens):
            T = tokens.shape[1] - 1
            x = self.wte(tokens[:, :T]) + self.wpe(torch.arange(T))
            for blk in self.h:
                x = blk(x)
            logits = self.ln_f(x) @ self.wte.weight.T                          # tied head
            loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
            return loss, loss

    assert cfg.n_mtp == 1 and cfg.n_kv_heads == cfg.n_heads
    model = GPT2()
    names = {"embed.weight": model.wte.weight, "pos_embed.weight": model.wpe.weight,
             "norm.weight": model.ln_f.weight, "norm.bias": model.ln_f.bias}
    with torch.no_grad():
        for i, blk in enumerate(model.h):
            p = f"layers.{i}."
            blk.c_attn.weight.copy_(torch.from_numpy(
                __import__("numpy").concatenate([params[p + f"attn.w{x}.weight"] for x in "qkv"])))
            blk.c_attn.bias.copy_(torch.from_numpy(
                __import__("numpy").concatenate([params[p + f"attn.w{x}.bias"] for x in "qkv"])))
            names |= {p + "attn_norm.weight": blk.ln_1.weight, p + "attn_norm.bias": blk.ln_1.bias,
                      p + "ffn_norm.weight": blk.ln_2.weight, p + "ffn_norm.bias": blk.ln_2.bias,
                      p + "attn.wo.weight": blk.c_proj.weight, p + "attn.wo.bias": blk.c_proj.bias,
                      p + "ffn.fc.weight": blk.c_fc.weight, p + "ffn.fc.bias": blk.c_fc.bias,
                      p + "ffn.proj.weight": blk.mlp_proj.weight, p + "ffn.proj.bias": blk.mlp_proj.bias}
        for name, t in names.items():
            t.copy_(torch.from_numpy(params[name]))
    return model


def make_torch(cfg, params, tokens, compiled: bool, bf16: bool = False):
    """A PyTorch training step; bf16: the forward under torch.autocast("cpu", bfloat16), as a user writes it."""
    import contextlib

    import torch
    model = torch_model(cfg, params)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=3e-4, betas=(0.9, 0.95), eps=1e-8, fused=True)
    loss_fn = torch.compile(model) if compiled else model
    tok = torch.from_numpy(tokens).long()

    def step():
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext():
            loss, objective = loss_fn(tok)
        objective.backward()
        t1 = time.perf_counter()
        opt.step()
        return time.perf_counter() - t0, t1 - t0, float(loss.detach())
    return step


def worker(engine: str, preset: str, B: int, T: int) -> None:
    """Line protocol on stdin/stdout: 'ready <idle MiB>' first; 'step' -> 'time <full s> <fwd+bwd s> <loss>';
    'reset' (peak RSS); 'peak' -> sgemm GFLOP/s; 'quit' -> 'done <peak MiB>'. Any failure: 'fail <reason>'."""
    try:
        serve(engine, preset, B, T)
    except Exception as e:  # noqa: BLE001  (the parent reports the engine as not run, with this reason)
        reason = f"{type(e).__name__}: {e}".replace("\n", " ")[:300]
        print(f"fail {reason}", flush=True)


def serve(engine: str, preset: str, B: int, T: int) -> None:
    import numpy as np
    if engine.startswith("ours"):
        import nanoeuler.fast  # noqa: F401  (numba and the kernels: library memory, like torch's import)
    else:
        import torch
        torch.set_num_threads(THREADS)
    from nanoeuler.config import PRESETS
    from nanoeuler.model import Model
    cfg = PRESETS[preset]
    params = Model.init(cfg, seed=0).params
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (B, T + cfg.n_mtp))
    idle = rss_mib()
    kind, bf16 = engine.split("-")[0], engine.endswith("-bf16")
    step = (make_ours(cfg, params, tokens, "bf16" if bf16 else "f32") if kind == "ours"
            else make_torch(cfg, params, tokens, kind == "compile", bf16))
    print(f"ready {idle:.1f}", flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "step":
            full, fb, loss = step()
            print(f"time {full:.6f} {fb:.6f} {loss:.6f}", flush=True)
        elif cmd == "reset":
            reset_peak_rss()
            print("ok", flush=True)
        elif cmd == "peak":
            print(f"gflops {sgemm_gflops(engine):.3f}", flush=True)
        elif cmd == "quit":
            print(f"done {rss_mib('VmHWM'):.1f}", flush=True)
            return


# ---------------------------------------------------------------------------------- parent side
class EngineFailed(Exception):
    """An engine's worker that failed or died; the message is the reason."""


class Worker:
    def __init__(self, engine: str, preset: str, B: int, T: int):
        env = dict(os.environ, NUMBA_NUM_THREADS=str(THREADS), OMP_NUM_THREADS=str(THREADS),
                   OPENBLAS_NUM_THREADS=str(THREADS), PYTHONPATH=str(ROOT))
        self.engine = engine
        self.err = tempfile.TemporaryFile("w+")   # torch.compile's warnings; the last line explains a crash
        self.proc = subprocess.Popen([sys.executable, __file__, "--worker", engine, preset, str(B), str(T)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err, text=True,
                                     env=env, cwd=ROOT)
        self.idle = float(self.expect("ready")[0])

    def expect(self, word: str) -> list[str]:
        line = self.proc.stdout.readline()
        if line.startswith(word):
            return line.split()[1:]
        if line.startswith("fail "):
            raise EngineFailed(line[5:].strip())
        self.proc.kill()
        self.err.seek(0)
        last = [ln for ln in self.err.read().splitlines() if ln.strip()][-1:]
        raise EngineFailed(f"the worker exited ({self.proc.wait()}) {' '.join(last)}"[:300])

    def ask(self, cmd: str, word: str) -> list[str]:
        try:
            self.proc.stdin.write(cmd + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass  # expect() reports why the worker is gone
        return self.expect(word)


def spread(times: list[float]) -> dict:
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times)}


def paired(ours: list[float], other: list[float]) -> dict:
    """ours tokens/s over other's, round by round (the other's step time over ours in the same round):
    the median and the range over the rounds."""
    r = [o / u for u, o in zip(ours, other)]
    return {"median": statistics.median(r), "min": min(r), "max": max(r)}


def run_preset(preset: str, engines, steps: int, warmup: int, log, pause: float = 0.3) -> dict:
    from nanoeuler.config import PRESETS
    cfg = PRESETS[preset]
    B, T = SHAPES[preset]
    log(f"{preset}: B={B} T={T}, {cfg.n_params():,} params; starting workers {', '.join(engines)}")
    workers, failed = [], {}

    def attempt(w, cmd, word):
        """w's answer to cmd, or None: w failed, is dropped and its reason kept."""
        try:
            return w.ask(cmd, word)
        except EngineFailed as e:
            failed[w.engine] = str(e)
            workers.remove(w)
            log(f"  {w.engine} did not run: {e}")
            return None
    for e in engines:
        try:
            workers.append(Worker(e, preset, B, T))
        except EngineFailed as err:
            failed[e] = str(err)
            log(f"  {e} did not run: {err}")
    times = {w.engine: ([], []) for w in workers}   # per round: full step, forward+backward
    losses = {}
    peaks = {"f32": [], "bf16": []}

    def measure_peaks():
        for w in list(workers):
            if (answer := attempt(w, "peak", "gflops")) is not None:
                peaks[_precision(w.engine)].append(float(answer[0]))
    for r in range(warmup):
        for w in list(workers):
            t0 = time.perf_counter()
            if (answer := attempt(w, "step", "time")) is not None:
                losses.setdefault(w.engine, float(answer[2]))
                log(f"  warm-up {r + 1}/{warmup} {w.engine}: {time.perf_counter() - t0:.2f} s")
    for w in list(workers):
        attempt(w, "reset", "ok")
    for r in range(steps):
        if not workers:
            break
        order = workers[r % len(workers):] + workers[:r % len(workers)]  # rotate who goes first
        for w in order:
            time.sleep(pause)  # let the previous engine's threads go idle
            if (answer := attempt(w, "step", "time")) is not None:
                times[w.engine][0].append(float(answer[0]))
                times[w.engine][1].append(float(answer[1]))
                losses.setdefault(w.engine, float(answer[2]))
        log(f"  step {r + 1}/{steps}: " + ", ".join(f"{w.engine} {times[w.engine][0][-1]:.2f} s" for w in workers))
        if r % 3 == 0:
            measure_peaks()
    measure_peaks()
    peak_gflops = {k: max(v) for k, v in peaks.items() if v}
    rows = {}
    for w in list(workers):
        if (answer := attempt(w, "quit", "done")) is None:
            continue
        w.proc.wait()
        full, fb = times[w.engine]
        peak = peak_gflops[_precision(w.engine)] * 1e9
        rows[w.engine] = {"full": spread(full), "fb": spread(fb), "tokens_per_s": B * T / statistics.median(full),
                          "fb_tokens_per_s": B * T / statistics.median(fb),
                          "mfu": cfg.flops_per_token() * B * T / statistics.median(full) / peak,
                          "fb_mfu": cfg.flops_per_token() * B * T / statistics.median(fb) / peak,
                          "peak_mib": float(answer[0]), "train_mib": float(answer[0]) - w.idle,
                          "first_loss": losses[w.engine], "times": full, "fb_times": fb}
    for e, row in rows.items():
        ours = "ours-bf16" if _precision(e) == "bf16" else "ours"
        row["ours_over_this"] = {k: paired(times[ours][i], times[e][i]) for i, k in enumerate(("full", "fb"))} \
            if ours in rows and ours != e else None
    if "ours" in rows and "ours-bf16" in rows:
        rows["ours-bf16"]["bf16_over_f32"] = {k: paired(times["ours-bf16"][i], times["ours"][i])
                                              for i, k in enumerate(("full", "fb"))}
    return {"preset": preset, "B": B, "T": T, "n_params": cfg.n_params(), "peak_gflops": peak_gflops,
            "engines": rows, "failed": failed}


def _precision(engine: str) -> str:
    return "bf16" if engine.endswith("-bf16") else "f32"


def _ms(s: dict) -> str:
    return f"{s['median_s'] * 1e3:.0f} [{s['min_s'] * 1e3:.0f}-{s['max_s'] * 1e3:.0f}]"


def _ratio(r: dict | None) -> str:
    return f"{r['median']:.2f} [{r['min']:.2f}-{r['max']:.2f}]" if r else "-"


def print_table(results) -> None:
    print(f"{'preset':7} {'engine':12} {'full step ms':>17} {'fwd+bwd ms':>17} {'tok/s':>6} {'f+b tok/s':>9} "
          f"{'ours/x full':>17} {'ours/x f+b':>17} {'MFU':>5} {'f+b MFU':>7} {'peak MiB':>8} {'train MiB':>9}  first loss")
    for res in results:
        for e, row in res["engines"].items():
            ratios = row["ours_over_this"] or {}
            print(f"{res['preset']:7} {e:12} {_ms(row['full']):>17} {_ms(row['fb']):>17} {row['tokens_per_s']:6.0f} "
                  f"{row['fb_tokens_per_s']:9.0f} {_ratio(ratios.get('full')):>17} {_ratio(ratios.get('fb')):>17} "
                  f"{row['mfu']:5.2f} {row['fb_mfu']:7.2f} {row['peak_mib']:8.0f} {row['train_mib']:9.0f}  "
                  f"{row['first_loss']:.5f}")
            if "bf16_over_f32" in row:
                b = row["bf16_over_f32"]
                print(f"{res['preset']:7} {'':12} ours bf16 / ours f32: full {_ratio(b['full'])}, "
                      f"fwd+bwd {_ratio(b['fb'])}")
        for e, why in res["failed"].items():
            print(f"{res['preset']:7} {e:12} did not run: {why}")
        peaks = ", ".join(f"{k} {v:.0f}" for k, v in res["peak_gflops"].items())
        rounds = len(next(iter(res["engines"].values()))["times"]) if res["engines"] else 0
        print(f"{res['preset']:7} (B={res['B']} T={res['T']}, N={res['n_params']:,}, matmul peaks GFLOP/s: "
              f"{peaks}; median of {rounds} interleaved rounds)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", nargs="+", default=None, choices=list(SHAPES),
                    help=f"default: {' '.join(DEFAULT_PRESETS)} (--quick: small)")
    ap.add_argument("--engines", nargs="+", default=None, choices=list(ENGINES),
                    help="default: all of them (the -bf16 ones only on a CPU with AVX512_BF16)")
    ap.add_argument("--steps", type=int, default=None, help="timed rounds (median reported; default 10, --quick 2)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps per engine first (default 3, --quick 1)")
    ap.add_argument("--pause", type=float, default=0.3,
                    help="seconds between two engines' steps, so spinning threads go idle (default 0.3)")
    ap.add_argument("--quick", action="store_true", help="smoke run: small, 2 timed rounds after 1 warm-up step")
    ap.add_argument("--json", action="store_true", help="one JSON object on stdout")
    ap.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        engine, preset, B, T = args.worker
        worker(engine, preset, int(B), int(T))
        return 0
    sys.path.insert(0, str(ROOT))
    log = (lambda msg: print(msg, file=sys.stderr, flush=True))
    from nanoeuler.fast.bf16 import AVAILABLE
    engines = args.engines or [e for e in ENGINES if AVAILABLE or _precision(e) == "f32"]
    presets = args.presets or (["small"] if args.quick else DEFAULT_PRESETS)
    steps = args.steps or (2 if args.quick else 10)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    results = [run_preset(p, engines, steps, warmup, log, args.pause) for p in presets]
    if args.json:
        print(json.dumps({"threads": THREADS, "results": results}))
    else:
        print_table(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
