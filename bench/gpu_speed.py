"""GPU training throughput: nanoeuler's CuPy engine vs PyTorch eager (scaled_dot_product_attention) vs
torch.compile, on the same model (the `gpt` preset by default), batch, context and precision (bf16
mixed precision, fp32 master weights), one full training step each (forward, backward, AdamW).

Reports tokens/s, MFU and peak GPU memory per contender, in one run:

    python bench/gpu_speed.py                      # gpt preset, batch 16 x 512 tokens
    python bench/gpu_speed.py --batch 8 --steps 5 --no-compile --json
    python bench/gpu_speed.py --contenders compile # torch.compile alone (scripts/gpu_check.sh: its own step)

Our engine is named by the attention kernel that really ran: "nanoeuler, tensor-core attention" only when
the WMMA kernels compiled; when they did not (no complete CUDA include folder), the same run is reported as
"nanoeuler, CUDA-core attention (tensor-core kernels unavailable)", with the reason, never under the
tensor-core name.

MFU = achieved FLOP/s / peak, with FLOPs per token = 6·N (the matrices: forward 2·N, backward 4·N)
+ 6·L·T·d (causal attention scores and mixes: 12·L·T·d halved by the mask), and peak = 989 TFLOP/s
dense bf16 (the H100/H200 SXM datasheet; --peak-tflops to change). Peak memory is each framework's
own allocator high-water mark during the timed steps (CuPy's pool; torch.cuda.max_memory_allocated).
PyTorch is a benchmark-only dependency (the library never imports it).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nanoeuler.config import PRESETS  # noqa: E402
from nanoeuler.model import Model  # noqa: E402


def flops_per_token(cfg) -> float:
    return 6 * cfg.n_params() + 6 * cfg.n_layers * cfg.ctx_len * cfg.dim


def batches(cfg, batch: int, n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, cfg.vocab_size, (batch, cfg.ctx_len + cfg.n_mtp)) for _ in range(n)]


# ---- ours ----------------------------------------------------------------------------------------------
def run_ours(cfg, params, data, warmup: int, precision: str = "bf16", tensor_cores: bool = True) -> dict:
    import cupy as cp
    from nanoeuler.gpu import engine
    from nanoeuler.gpu.matmul import set_tf32
    from nanoeuler.gpu.ops import wmma_unavailable_reason
    engine.set_precision(precision)
    ops = engine.gpu_ops(precision)
    ops.tensor_core_attention = tensor_cores
    gm = engine.to_gpu(Model(cfg, params))
    opt = engine.GpuAdamW(gm.params, lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
    kernel = ops.flash_kernel(cfg.head_dim)  # what will run: "wmma" only when the tensor-core kernels compiled

    def step(tokens):
        loss, _, grads = engine.loss_and_grads(gm, tokens, precision=precision)
        opt.step(gm.params, grads)
        return loss

    for tokens in data[:warmup]:  # compiles the kernels (NVRTC, cached on disk) and warms cuBLAS
        step(tokens)
    pool = cp.get_default_memory_pool()
    cp.cuda.Device().synchronize()
    peak = [pool.total_bytes()]
    malloc = pool.malloc

    def tracking_malloc(size):
        mem = malloc(size)
        peak[0] = max(peak[0], pool.used_bytes())
        return mem

    cp.cuda.set_allocator(tracking_malloc)
    peak[0] = pool.used_bytes()
    t0 = time.perf_counter()
    losses = [step(tokens) for tokens in data[warmup:]]
    cp.cuda.Device().synchronize()
    dt = time.perf_counter() - t0
    cp.cuda.set_allocator(malloc)
    set_tf32(False)
    ops.tensor_core_attention = True
    del gm, opt
    pool.free_all_blocks()
    out = {"seconds": dt, "steps": len(data) - warmup, "peak_bytes": peak[0], "last_loss": losses[-1],
           "attention_kernel": kernel}
    if tensor_cores and kernel != "wmma":
        out["tensor_cores_unavailable"] = wmma_unavailable_reason(cfg.head_dim) or f"hd={cfg.head_dim} not supported"
    return out


def ours_name(r: dict) -> str:
    """The contender's name from the attention kernel that ran (never the tensor-core name for the fallback)."""
    if r.get("attention_kernel") == "wmma":
        return "nanoeuler, tensor-core attention"
    if "tensor_cores_unavailable" in r:
        return "nanoeuler, CUDA-core attention (tensor-core kernels unavailable)"
    return "nanoeuler, CUDA-core attention"


# ---- PyTorch -------------------------------------------------------------------------------------------
def torch_step_fn(cfg, params, device):
    """A plain PyTorch version of the SPEC model + fused AdamW; returns (step(tokens) -> loss, params)."""
    import torch
    import torch.nn.functional as F
    P = {n: torch.tensor(a, dtype=torch.float32, device=device, requires_grad=True) for n, a in params.items()}
    H, Hkv, hd, T = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ctx_len
    inv_freq = cfg.rope_theta ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    ang = torch.arange(T, dtype=torch.float64)[:, None] * inv_freq[None, :]
    cos = torch.cat([ang.cos(), ang.cos()], -1).float().to(device)  # [T, hd]
    sin = torch.cat([ang.sin(), ang.sin()], -1).float().to(device)

    def rms(x, w):
        return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + cfg.norm_eps).to(x.dtype) * w

    def rope(x):  # in the activations' dtype (bf16 under autocast), so SDPA gets bf16 q, k, v
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos.to(x.dtype) + torch.cat([-x2, x1], -1) * sin.to(x.dtype)

    def loss_fn(tokens):
        B = tokens.shape[0]
        x = P["embed.weight"][tokens[:, :T]]
        for i in range(cfg.n_layers):
            p = f"layers.{i}."
            h = rms(x, P[p + "attn_norm.weight"])
            q = rope((h @ P[p + "attn.wq.weight"].T).view(B, T, H, hd).transpose(1, 2))
            k = rope((h @ P[p + "attn.wk.weight"].T).view(B, T, Hkv, hd).transpose(1, 2))
            v = (h @ P[p + "attn.wv.weight"].T).view(B, T, Hkv, hd).transpose(1, 2)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            x = x + a.transpose(1, 2).reshape(B, T, H * hd) @ P[p + "attn.wo.weight"].T
            h = rms(x, P[p + "ffn_norm.weight"])
            x = x + (F.silu(h @ P[p + "ffn.gate.weight"].T) * (h @ P[p + "ffn.up.weight"].T)) @ P[p + "ffn.down.weight"].T
        z = rms(x, P["norm.weight"])
        losses = [F.cross_entropy((z @ P[f"heads.{k}.weight"].T).float().reshape(-1, cfg.vocab_size),
                                  tokens[:, 1 + k:T + 1 + k].reshape(-1)) for k in range(cfg.n_mtp)]
        return losses[0], sum(losses) / cfg.n_mtp

    opt = torch.optim.AdamW(list(P.values()), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    return loss_fn, opt


def run_torch(cfg, params, data, warmup: int, compile_: bool) -> dict:
    import torch
    device = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    loss_fn, opt = torch_step_fn(cfg, params, device)
    if compile_:
        loss_fn = torch.compile(loss_fn)
    tokens_dev = [torch.as_tensor(t, device=device) for t in data]

    def step(tokens):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            head0, objective = loss_fn(tokens)
        objective.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(head0.detach())  # one sync per step, as ours

    t_compile = time.perf_counter()
    for tokens in tokens_dev[:warmup]:
        step(tokens)
    torch.cuda.synchronize()
    warmup_s = time.perf_counter() - t_compile
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    losses = [step(tokens) for tokens in tokens_dev[warmup:]]
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    out = {"seconds": dt, "steps": len(data) - warmup, "peak_bytes": torch.cuda.max_memory_allocated(),
           "last_loss": losses[-1], "warmup_seconds": warmup_s}
    del loss_fn, opt
    torch.cuda.empty_cache()
    return out


CONTENDERS = ("ours", "eager", "cuda-core", "compile")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="gpt", choices=list(PRESETS))
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=10, help="timed steps per contender")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--contenders", default=None,
                    help=f"comma-separated, of {', '.join(CONTENDERS)} (default ours,eager,compile; the flags below "
                         "edit the default)")
    ap.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    ap.add_argument("--no-torch", action="store_true", help="only our engine")
    ap.add_argument("--cuda-core-attention-too", action="store_true",
                    help="also time our engine with the fp32-math (CUDA-core) FlashAttention")
    ap.add_argument("--peak-tflops", type=float, default=989.0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.contenders:
        wanted = [c.strip() for c in args.contenders.split(",") if c.strip()]
        bad = [c for c in wanted if c not in CONTENDERS]
        if bad:
            print(f"error: unknown contender {bad[0]!r}; choose from {', '.join(CONTENDERS)}", file=sys.stderr)
            return 2
    else:
        wanted = ["ours"] + ([] if args.no_torch else ["eager"]) + (["cuda-core"] if args.cuda_core_attention_too else []) \
            + ([] if args.no_torch or args.no_compile else ["compile"])

    cfg = PRESETS[args.preset]
    params = Model.init(cfg, seed=0).params
    data = batches(cfg, args.batch, args.warmup + args.steps)
    tokens_per_step = args.batch * cfg.ctx_len
    results = {}
    # ours and eager first (the comparison that matters), torch.compile last (its compilation is slow)
    runners = {"ours": lambda: run_ours(cfg, params, data, args.warmup),
               "eager": lambda: run_torch(cfg, params, data, args.warmup, False),
               "cuda-core": lambda: run_ours(cfg, params, data, args.warmup, tensor_cores=False),
               "compile": lambda: run_torch(cfg, params, data, args.warmup, True)}
    default_names = {"ours": "nanoeuler, tensor-core attention", "eager": "PyTorch eager + SDPA",
                     "cuda-core": "nanoeuler, CUDA-core attention", "compile": "torch.compile"}
    for key in [c for c in CONTENDERS if c in wanted]:
        name = default_names[key]
        if key == "cuda-core" and any(r.get("attention_kernel") not in (None, "wmma") for r in results.values()):
            continue  # "ours" already ran the CUDA-core kernel (tensor cores unavailable): timed once, named so
        try:
            r = runners[key]()
        except Exception as e:  # report and go on: one failing contender must not hide the others
            results[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
            print(f"{name}: FAILED {results[name]['error']}", file=sys.stderr, flush=True)
            continue
        if key in ("ours", "cuda-core"):
            name = ours_name(r)
            if "tensor_cores_unavailable" in r:
                print(f"note: tensor-core kernels unavailable ({r['tensor_cores_unavailable']}); timed as {name!r}",
                      file=sys.stderr, flush=True)
        r["tokens_per_s"] = tokens_per_step * r["steps"] / r["seconds"]
        r["ms_per_step"] = 1e3 * r["seconds"] / r["steps"]
        r["mfu"] = r["tokens_per_s"] * flops_per_token(cfg) / (args.peak_tflops * 1e12)
        results[name] = r
        if not args.json:
            print(f"{name:<62} {r['tokens_per_s']:>10,.0f} tok/s  {r['ms_per_step']:8.1f} ms/step  "
                  f"MFU {100 * r['mfu']:5.1f}%  peak {r['peak_bytes'] / 2**30:6.2f} GiB  loss {r['last_loss']:.4f}",
                  flush=True)
    ours = next((r for n, r in results.items() if n.startswith("nanoeuler") and "tokens_per_s" in r), {})
    eager = results.get("PyTorch eager + SDPA", {})
    if "tokens_per_s" in ours and "tokens_per_s" in eager and not args.json:
        print(f"ours ({ours_name(ours)}) / PyTorch eager = {ours['tokens_per_s'] / eager['tokens_per_s']:.2f}x", flush=True)
    summary = {"preset": args.preset, "batch": args.batch, "ctx": cfg.ctx_len, "precision": "bf16 (fp32 master)",
               "params": cfg.n_params(), "flops_per_token": flops_per_token(cfg), "peak_tflops": args.peak_tflops,
               "results": results}
    if "tokens_per_s" in ours and "tokens_per_s" in eager:
        summary["ours_vs_eager"] = ours["tokens_per_s"] / eager["tokens_per_s"]
    if args.json:
        print(json.dumps(summary))
    ran_ours = any(k in wanted for k in ("ours", "cuda-core"))
    return 0 if (not ran_ours or "tokens_per_s" in ours) and all("error" not in r for r in results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
