"""LoRA fine-tuning speed and memory: ours LoRA vs ours full fine-tuning vs PyTorch + PEFT LoRA, side by side,
in float32 and in bf16 mixed precision.

Each (model, engine) runs in its own worker process (so each peak memory is its own): random weights of the
model's shape, one fixed batch of B×T tokens, `--warmup` untimed steps (numba cache load, first-touch of
buffers), then `--steps` timed SFT steps (forward, backward, AdamW); the median step is reported. 2 threads
for every engine. Engines:

    ours-lora   nanoeuler's fused LoRA step (lora.LoraModel): the frozen weights' products plus the adapters'
                on the fly, adapters' dA, dB from each linear's dy and x, no dW of frozen weights, AdamW
                moments for the adapters only; the base saved to a temporary checkpoint and loaded from it
                as `sft --lora` loads it (mapped: what the workspace packs or stacks leaves memory)
    ours-full   nanoeuler's full fine-tuning step (Model.loss_and_grads + AdamW on every weight)
    peft-lora   transformers' GPT2LMHeadModel / LlamaForCausalLM + peft.get_peft_model, the same targets,
                rank and alpha, torch.optim.AdamW on the adapters
    torch-full  the same transformers model fine-tuned whole: torch.optim.AdamW on every weight (ours-full's peer)
    compile-full  torch-full with the model under torch.compile (compiled in the warm-up steps)
    *-bf16      the same in bf16 mixed precision: ours `--precision bf16` (every product's operands rounded
                to bfloat16, float32 accumulation), PyTorch's forward under torch.autocast("cpu", bfloat16)

Models: gpt2 (124 M, LoRA on c_attn, c_proj, c_fc) and smollm (a SmolLM-135M-shaped llama: d 576, 30 layers,
9 heads / 3 kv heads, F 1536, vocab 49152, LoRA on q,k,v,o,gate,up,down; our head is untied: +28 M), and
tiny (a 2-layer gpt2-shaped model for a quick smoke run), all with random weights; or a checkpoint directory
(a real model imported with `nanoeuler import`: SmolLM2-135M-Instruct, Gemma 3 270M), LoRA on its
architecture's default targets: ours loads it as `sft --lora` does (mapped), PyTorch + PEFT loads its
`nanoeuler export --format hf` (written once into a temporary folder) with AutoModelForCausalLM in float32.

    step s      median seconds per step; the last column: how many times faster ours-lora(-bf16) is than that
                row, and with what share of its memory (beside torch-full and compile-full rows: ours-full(-bf16))
    peak MiB    the worker's peak resident memory over the timed steps (VmHWM, reset after warm-up)
    first MiB   the worker's peak before that reset: loading, warm-up and the first step included
    bound s     the step's matrix FLOPs at the matmul peak measured in the worker (2048³ sgemm, or bf16):
                full = 3 products per weight (y, dx, dW), LoRA = 2 (y, dx) + the adapters', both + attention;
                of bound   bound s / step s: the fraction of the FLOP bound the step reaches

--profile prints, per worker of ours, the CPU seconds (summed over the parts' threads) of each kind of work
in one step, beside its FLOPs and rate: where the time goes beyond the bound.

    python bench/lora.py                                # gpt2 and smollm, B=4 T=256 r=8, 3 timed steps
    python bench/lora.py --models gpt2 --engines ours-lora,ours-full,peft-lora,ours-lora-bf16,peft-lora-bf16
    python bench/lora.py --models gpt2 --engines ours-lora,ours-full --profile --steps 1
    python bench/lora.py --models tiny --steps 2 --warmup 1     # smoke run (seconds)
    nanoeuler import --from gemma-3-270m-q4_k_m.gguf --out /tmp/gemma3     # (make models fetches the file)
    python bench/lora.py --models /tmp/gemma3 --engines ours-lora,peft-lora --steps 2   # real checkpoints
"""
from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from train_speed import reset_peak_rss, rss_mib   # bench/ is this script's folder: the same memory probes

ORDER = ("y = x·Wᵀ", "  adapters' share of y", "dx = dy·W", "  adapters' share of dx", "dW (or dA, dB)", "attention",
         "fused kernels", "AdamW", "rest (Python, copies, threads)", "step (CPU)")   # --profile's rows
ROOT = Path(__file__).resolve().parent.parent
THREADS = 2
ENGINES = ("ours-lora", "ours-full", "peft-lora", "ours-lora-bf16", "ours-full-bf16", "peft-lora-bf16")
TORCH_ENGINES = ("peft-lora", "torch-full", "compile-full", "peft-lora-bf16", "torch-full-bf16",
                 "compile-full-bf16")   # run by torch_step
MODELS = {  # name -> (our Config fields, LoRA targets: ours, PEFT's)
    "gpt2": (dict(vocab_size=50257, dim=768, n_heads=12, n_kv_heads=12, n_layers=12, ctx_len=1024, ffn_hidden=3072,
                  n_mtp=1, arch="gpt2"), ("c_attn", "c_proj", "c_fc"), ["c_attn", "c_proj", "c_fc"]),
    "smollm": (dict(vocab_size=49152, dim=576, n_heads=9, n_kv_heads=3, n_layers=30, ctx_len=2048, ffn_hidden=1536,
                    n_mtp=1, rope_theta=10000.0), ("q", "k", "v", "o", "gate", "up", "down"),
               ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "tiny": (dict(vocab_size=512, dim=64, n_heads=4, n_kv_heads=4, n_layers=2, ctx_len=256, ffn_hidden=256, n_mtp=1,
                  arch="gpt2"), ("c_attn", "c_proj", "c_fc"), ["c_attn", "c_proj", "c_fc"]),
}


# ---------------------------------------------------------------------------------- worker side
def is_checkpoint(model_name: str) -> bool:
    return (Path(model_name) / "config.json").is_file()


def model_config(model_name: str):
    """(our Config, our LoRA targets, PEFT's target module names) of a MODELS entry or a checkpoint."""
    from nanoeuler import adapters as ad
    from nanoeuler.config import Config
    if not is_checkpoint(model_name):
        fields, ours, theirs = MODELS[model_name]
        return Config(**fields), ours, theirs
    from nanoeuler.checkpoint import read_json
    cfg = Config.from_dict(read_json(Path(model_name) / "config.json", "config"))
    lcfg = ad.LoraConfig(8, 16.0).check(cfg)
    return cfg, lcfg.targets, sorted({hf.rsplit(".", 1)[1] for _, hf in ad.modules(cfg, lcfg).values()})


def flops(model_name: str, B: int, T: int, rank: int) -> dict:
    """Matrix FLOPs of one step: per pass over the weights (2·N·Σ in·out, heads included), the adapters'
    products (y: x·Aᵀ, ·Bᵀ; dx: dy·B, ·A; grads: x·Aᵀ, dy·B, dB, dA: 8 of 2·N·r·in or out), attention
    (QKᵀ and PV forward, 4 products backward, the full T×T square)."""
    from nanoeuler import adapters as ad
    cfg, targets, _ = model_config(model_name)
    N = B * T
    shapes = cfg.param_shapes()
    weights = [n for n, s in shapes.items() if len(s) == 2 and n.startswith("layers.")]
    heads = cfg.n_mtp * cfg.vocab_size * cfg.dim
    lcfg = ad.LoraConfig(rank, 2.0 * rank, targets).check(cfg)
    adapter = sum(a * b for a, b in ad.adapter_shapes(cfg, lcfg).values())       # r·(in + Σ out) per module
    return {"pass": 2.0 * N * (sum(shapes[n][0] * shapes[n][1] for n in weights) + heads),
            "adapters": 8 * 2.0 * N * adapter,
            "attention": 6 * 2.0 * B * cfg.n_heads * T * T * cfg.head_dim * cfg.n_layers}


def full_model(model_name: str):
    """The model ours-full trains: the checkpoint, or random weights of a MODELS shape."""
    from nanoeuler.model import Model
    return Model.load(model_name) if is_checkpoint(model_name) else random_base(model_name)


def ours_step(model_name: str, engine: str, B: int, T: int, rank: int):
    import numpy as np

    from nanoeuler.adapters import LoraConfig
    from nanoeuler.training.lora import LoraModel
    from nanoeuler.optim import AdamW
    cfg, targets, _ = model_config(model_name)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (B, T + cfg.n_mtp))
    precision = "bf16" if engine.endswith("-bf16") else "f32"
    if engine.startswith("ours-full"):
        model = full_model(model_name).set_precision(precision)
        grads = model.grad_buffers()
        opt = AdamW(model.params, lr=1e-4, weight_decay=0.0)

        def step():
            model.loss_and_grads(tokens, out=grads)
            opt.step(model.params, grads)
        return step
    base_dir = Path(model_name)
    if not is_checkpoint(model_name):   # as `sft --lora` does: the base from its checkpoint, saved by another
        base_dir = Path(tempfile.mkdtemp(prefix="lora-base-"))   # process (none of it held here)
        atexit.register(shutil.rmtree, base_dir, True)
        subprocess.run([sys.executable, __file__, "--save-base", model_name, str(base_dir)], check=True)
    model = LoraModel.new(base_dir, LoraConfig(rank, 2.0 * rank, targets)).set_precision(precision)
    opt = AdamW(model.params, lr=1e-4, weight_decay=0.0)

    def step():
        _, _, grads = model.loss_and_grads(tokens)
        opt.step(model.params, grads)
    return step


def random_base(model_name: str):
    """The model's shape with random weights (seed 0)."""
    from nanoeuler.config import Config
    from nanoeuler.model import Model
    return Model.init(Config(**MODELS[model_name][0]), seed=0)


def torch_step(model_name: str, engine: str, B: int, T: int, rank: int, hf_dir: str | None):
    import contextlib

    import torch
    import transformers
    from peft import LoraConfig, get_peft_model
    torch.set_num_threads(THREADS)
    cfg, _, targets = model_config(model_name)
    fields = MODELS.get(model_name, (dict(vocab_size=cfg.vocab_size),))[0]
    if hf_dir is not None:
        model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32)
    elif fields.get("arch") == "gpt2":
        hcfg = transformers.GPT2Config(vocab_size=fields["vocab_size"], n_positions=fields["ctx_len"],
                                       n_embd=fields["dim"], n_layer=fields["n_layers"], n_head=fields["n_heads"],
                                       n_inner=fields["ffn_hidden"], attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0)
        model = transformers.GPT2LMHeadModel(hcfg)
    else:
        hcfg = transformers.LlamaConfig(vocab_size=fields["vocab_size"], hidden_size=fields["dim"],
                                        intermediate_size=fields["ffn_hidden"], num_hidden_layers=fields["n_layers"],
                                        num_attention_heads=fields["n_heads"], num_key_value_heads=fields["n_kv_heads"],
                                        max_position_embeddings=fields["ctx_len"], tie_word_embeddings=False)
        model = transformers.LlamaForCausalLM(hcfg)
    if engine.startswith("peft-lora"):
        model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                                                 target_modules=targets, task_type="CAUSAL_LM"))
    model.train()
    if engine.startswith("compile"):
        model = torch.compile(model)
    bf16 = engine.endswith("-bf16")
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, weight_decay=0.0)
    ids = torch.randint(0, cfg.vocab_size, (B, T))

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext():
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
    return step


def worker(model_name: str, engine: str, B: int, T: int, rank: int, warmup: int, steps: int, profile: bool,
           hf_dir: str | None = None) -> dict:
    from train_speed import sgemm_gflops
    if engine in TORCH_ENGINES:
        step = torch_step(model_name, engine, B, T, rank, hf_dir)
    else:
        step = ours_step(model_name, engine, B, T, rank)
    for _ in range(warmup):
        step()
    first = rss_mib("VmHWM")
    reset_peak_rss()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    row = {"model": model_name, "engine": engine, "step_s": statistics.median(times), "peak_mib": rss_mib("VmHWM"),
           "first_mib": first, "peak_gflops": sgemm_gflops("ours-bf16" if engine.endswith("-bf16") else "ours")}
    if profile and engine.startswith("ours"):
        row["profile"] = profile_step(step)
    return row


def profile_step(step) -> dict:
    """CPU seconds of one step by kind of work (the parts' threads summed): the engine's products of frozen or
    trained weights (linear, linear_dx; adapters' share inside them), weight gradients (dW, or the adapters'
    dA, dB), attention, fused numba kernels, AdamW, the rest."""
    import collections

    from numba.core.registry import CPUDispatcher

    from nanoeuler.training import lora
    from nanoeuler.fast import engine as E
    from nanoeuler.optim import AdamW
    stats = collections.defaultdict(float)

    def timed(owner, name, key):
        fn = getattr(owner, name)

        def wrapper(*args, **kwargs):
            c = time.thread_time()
            out = fn(*args, **kwargs)
            stats[key] += time.thread_time() - c   # (two threads' += may rarely lose one: a profile, blurred)
            return out
        setattr(owner, name, wrapper)
    for name, key in [("linear", "y = x·Wᵀ"), ("linear_dx", "dx = dy·W"), ("weight_grad", "dW (or dA, dB)"),
                      ("attention_forward", "attention"), ("attention_backward", "attention")]:
        timed(E, name, key)
    timed(lora.Adapters, "forward", "  adapters' share of y")
    timed(lora.Adapters, "dx", "  adapters' share of dx")
    timed(AdamW, "step", "AdamW")
    for name, fn in list(vars(E.kernels).items()):
        if isinstance(fn, CPUDispatcher) and not name.startswith(("_", "row_", "adamw")):
            timed(E.kernels, name, "fused kernels")
    c = time.process_time()
    step()
    stats["step (CPU)"] = time.process_time() - c
    return dict(stats)


# ---------------------------------------------------------------------------------- parent side
def hf_export(model_name: str, args) -> str | None:
    """A checkpoint's `export --format hf`, written once per run into a temporary folder (for PEFT)."""
    if not is_checkpoint(model_name):
        return None
    if model_name not in args.hf_dirs:
        out = Path(tempfile.mkdtemp(prefix="lora-hf-")) / "hf"
        atexit.register(shutil.rmtree, out.parent, True)
        subprocess.run([sys.executable, "-m", "nanoeuler", "export", "--ckpt", model_name, "--format", "hf", "--out",
                        str(out), "--no-progress"], check=True, capture_output=True,
                       env=dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")))
        args.hf_dirs[model_name] = str(out)
    return args.hf_dirs[model_name]


def run_worker(model_name, engine, args) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(THREADS), OPENBLAS_NUM_THREADS=str(THREADS),
               MKL_NUM_THREADS=str(THREADS), NUMBA_NUM_THREADS=str(THREADS),
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, __file__, "--worker", model_name, engine, "--batch", str(args.batch), "--seq",
           str(args.seq), "--rank", str(args.rank), "--warmup", str(args.warmup), "--steps", str(args.steps)] + \
        (["--profile"] if args.profile else []) + \
        (["--hf-dir", hf_export(model_name, args)] if engine in TORCH_ENGINES and is_checkpoint(model_name) else [])
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"model": model_name, "engine": engine, "error": f"over {args.timeout} s"}
    if p.returncode:
        return {"model": model_name, "engine": engine, "error": (p.stderr.strip().splitlines() or ["?"])[-1][:200]}
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="gpt2,smollm",
                    help="comma-separated: gpt2, smollm, tiny (random weights), or checkpoint directories")
    ap.add_argument("--engines", default=",".join(ENGINES), help=f"comma-separated, of {', '.join(ENGINES)}, "
                    "torch-full, torch-full-bf16, compile-full, compile-full-bf16 (default: ENGINES)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=600, help="seconds per worker (a slower one is reported as such)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--profile", action="store_true", help="also where one step of ours spends its CPU time")
    ap.add_argument("--worker", nargs=2, metavar=("MODEL", "ENGINE"), help=argparse.SUPPRESS)
    ap.add_argument("--save-base", nargs=2, metavar=("MODEL", "DIR"), help=argparse.SUPPRESS)
    ap.add_argument("--hf-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.save_base:
        random_base(args.save_base[0]).save(args.save_base[1])
        return
    if args.worker:
        print(json.dumps(worker(*args.worker, args.batch, args.seq, args.rank, args.warmup, args.steps, args.profile,
                                args.hf_dir)))
        return
    args.hf_dirs = {}
    rows = [run_worker(m, e, args) for m in args.models.split(",") for e in args.engines.split(",")]
    if args.json:
        print(json.dumps({"batch": args.batch, "seq": args.seq, "rank": args.rank, "rows": rows}))
        return
    print(f"B={args.batch} T={args.seq} r={args.rank}, {THREADS} threads, median of {args.steps} steps")
    print(f"{'model':<8} {'engine':<17} {'step s':>8} {'bound s':>8} {'of bound':>8} {'peak MiB':>9} {'first MiB':>9}"
          f"  ours-lora (beside torch-/compile-full: ours-full) of the same precision is")
    for r in rows:
        name = Path(r["model"]).name
        if "error" in r:
            print(f"{name:<8} {r['engine']:<17} error: {r['error']}")
            continue
        f = flops(r["model"], args.batch, args.seq, args.rank)
        work = (2 * f["pass"] + f["adapters"] if "lora" in r["engine"] else 3 * f["pass"]) + f["attention"]
        bound = work / (r["peak_gflops"] * 1e9)
        mine_name = ("ours-full" if r["engine"].startswith(("torch-full", "compile-full")) else "ours-lora") + \
            ("-bf16" if r["engine"].endswith("-bf16") else "")
        mine = next((x for x in rows if x["model"] == r["model"] and x["engine"] == mine_name and "step_s" in x), None)
        ratio = (f"{r['step_s'] / mine['step_s']:.2f}x faster, {mine['peak_mib'] / r['peak_mib']:.2f}x the memory"
                 if mine and r is not mine else "")
        print(f"{name:<8} {r['engine']:<17} {r['step_s']:>8.3f} {bound:>8.3f} {bound / r['step_s']:>8.2f} "
              f"{r['peak_mib']:>9.0f} {r['first_mib']:>9.0f}  {ratio}")
    for r in rows:
        if "profile" in r:
            print(f"\n{Path(r['model']).name} {r['engine']}: CPU seconds of one step (2 threads), and the matrix FLOPs behind them")
            f = flops(r["model"], args.batch, args.seq, args.rank)
            lora = "lora" in r["engine"]
            work = {"y = x·Wᵀ": f["pass"] + (f["adapters"] / 4 if lora else 0),
                    "dx = dy·W": f["pass"] + (f["adapters"] / 4 if lora else 0),
                    "dW (or dA, dB)": f["adapters"] / 2 if lora else f["pass"], "attention": f["attention"]}
            prof = r["profile"]
            top = [k for k in prof if not k.startswith(" ") and k != "step (CPU)"]
            prof["rest (Python, copies, threads)"] = prof["step (CPU)"] - sum(prof[k] for k in top)
            for key in ORDER:
                if key not in prof:
                    continue
                sec = prof[key]
                rate = f"{work[key] / 1e9:8.1f} GFLOP  {work[key] / 1e9 / sec:6.1f} GFLOP/s" if key in work and sec else ""
                print(f"  {key:<32} {sec:8.3f} s  {rate}")

if __name__ == "__main__":
    main()
