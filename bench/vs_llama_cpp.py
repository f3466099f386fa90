"""Our model against llama.cpp (llama-cpp-python) and transformers on the same weights, in one run.

For each checkpoint given (e.g. a trained `small` and `big`):

parity  - transformers (HF export, float32): logits max relative error on a held-out window, and whether
          64 greedy tokens are identical;
        - llama.cpp on our GGUF at f32, f16 and q8_0: how many of 64 greedy tokens equal ours (and the first
          position that differs), logits max relative error, and bits per byte on held-out works (our model's
          next to it), every window of ctx_len tokens fed as ids.
speed   - greedy decoding of --new-tokens tokens after the same prompt, with --threads threads and with 1:
          our KV-cache decoding (nanoeuler.infer.session.generate, mode "cache") with float32 weights and with float16
          (infer.weights.Float16Model: f16 weights, f32 arithmetic), each on the fused numba step
          (infer/kernels.py, the default) and on the NumPy reference path (kernels.ENABLED = False), against
          llama.cpp on the f32 and f16 GGUF; ours fused and llama.cpp interleaved, --repeat times, then our
          NumPy path (its BLAS threads spin after each call and would slow the next one); tokens/s of the decode phase
          (the prompt's prefill excluded), median. `ours/llama.cpp` = ours fused / llama.cpp at the same
          precision and thread count (>= 1.0: we are at least as fast). llama.cpp's threads wait for each
          other by spinning, which collapses on a machine busier than its cores; on such a machine the
          1-thread ratios are the fair ones, and two more are printed: the best run of each (the least
          disturbed), and at 1 thread tokens per CPU-second of the process (preemption does not count).
          Our threads: infer.pool.set_threads (and threadpoolctl for the NumPy path's BLAS, if installed).

    .venv/bin/python bench/vs_llama_cpp.py runs/small runs/big            # add --json for one JSON object
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.heldout import held_out_windows  # noqa: E402
from nanoeuler.infer.sampling import nll_sum  # noqa: E402


def set_threads(n: int) -> None:
    for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
        os.environ[k] = str(n)


def rel_err(a, b) -> float:
    import numpy as np
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


def parity(run: str, tmp: Path, per_work: int) -> dict:
    import numpy as np
    import torch
    import transformers

    from nanoeuler import Model
    from nanoeuler.checkpoint import load_tokenizer
    from nanoeuler.infer.session import generate
    from nanoeuler.interop.gguf_export import export_gguf
    from nanoeuler.interop.hf import export_hf
    from nanoeuler.interop.llamacpp import LlamaCpp

    m, tok = Model.load(run), load_tokenizer(run)
    T = m.config.ctx_len
    windows = held_out_windows(tok, T, per_work)
    prompt = windows[0][0][:32]
    ours_greedy = generate(m, prompt, max_new_tokens=64, temperature=0, mode="cache").ids
    ours_logits = m.logits(np.array([windows[0][0][:T]]))[0, 0]
    ours_nll = [nll_sum(m.logits(np.array([w[:T]]))[0, 0], np.array(w[1:])) for w, _ in windows]
    n_bytes = sum(b for _, b in windows)
    res = {"run": run, "params": m.n_params(), "ours_bpb": sum(ours_nll) / np.log(2) / n_bytes,
           "heldout_windows": len(windows), "heldout_bytes": n_bytes}

    export_hf(m, tok, tmp / "hf", force=True, progress=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp / "hf")
    with torch.no_grad():
        hl = hf(torch.tensor([windows[0][0][:T]])).logits[0].numpy()
        hg = hf.generate(torch.tensor([prompt]), max_new_tokens=64, min_new_tokens=64, do_sample=False,
                         eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    res["transformers"] = {"logits_rel_err": rel_err(ours_logits, hl), "greedy64_identical": hg == ours_greedy}

    for dtype in ("f32", "f16", "q8_0"):
        path = export_gguf(m, tok, tmp / f"m-{dtype}.gguf", dtype, force=True, progress=False)
        kv_f32 = dtype == "f32"  # f16 / q8_0 run as llama.cpp runs them by default (f16 KV cache)
        g, _ = LlamaCpp(path, n_ctx=T, kv_f32=kv_f32).greedy(prompt, 64)
        same = [a == b for a, b in zip(g, ours_greedy)]
        lc = LlamaCpp(path, n_ctx=T, logits_all=True, kv_f32=kv_f32)
        lc_nll = [nll_sum(lc.logits(w[:T]), np.array(w[1:])) for w, _ in windows]
        res[f"llama.cpp {dtype}"] = {
            "greedy64_same_positions": sum(same), "first_difference": same.index(False) if False in same else None,
            "logits_rel_err": rel_err(lc.logits(windows[0][0][:T]), ours_logits),
            "bpb": sum(lc_nll) / np.log(2) / n_bytes, "file_mb": path.stat().st_size / 2**20}
    return res


def speed(run: str, tmp: Path, new_tokens: int, repeat: int, threads: int) -> dict:
    import numpy as np

    from nanoeuler import Model
    from nanoeuler.checkpoint import load_tokenizer
    from nanoeuler.infer import kernels, pool
    from nanoeuler.infer.weights import Float16Model
    from nanoeuler.infer.session import generate
    from nanoeuler.interop.gguf_export import export_gguf
    from nanoeuler.interop.llamacpp import LlamaCpp
    try:  # our NumPy reference path's BLAS threads (threadpoolctl, when installed)
        from threadpoolctl import threadpool_limits
    except ImportError:
        threadpool_limits = None

    m, tok = Model.load(run), load_tokenizer(run)
    T = m.config.ctx_len
    prompt = tok.encode("HAMLET.\nTo be, or not to be, that is the question:\n")[:32]
    n = min(new_tokens, T - len(prompt))
    files = {dt: export_gguf(m, tok, tmp / f"s-{dt}.gguf", dt, force=True, progress=False) for dt in ("f32", "f16")}
    counts = sorted({threads, 1}, reverse=True)
    models = {"f32": m, "f16": Float16Model(m)}
    # llama.cpp's threads wait for each other by spinning: on a machine with more runnable processes than
    # cores a preempted thread stalls the rest, so 1 thread is measured too; ours share work without waiting
    engines = {(dt, th): LlamaCpp(files[dt], n_ctx=T, threads=th, kv_f32=dt == "f32") for th in counts for dt in models}
    rows: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}  # tokens per second of this process's CPU time (1 thread: load-proof)

    def ours(dt: str, th: int, path: str) -> tuple[float, float]:
        kernels.ENABLED, enabled = path == "fused", kernels.ENABLED
        pool.set_threads(th)
        try:
            if threadpool_limits is not None:
                with threadpool_limits(th):
                    g = generate(models[dt], prompt, max_new_tokens=n, temperature=0, mode="cache")
            else:
                g = generate(models[dt], prompt, max_new_tokens=n, temperature=0, mode="cache")
        finally:
            kernels.ENABLED = enabled
            pool.set_threads(th)  # our helper threads go to sleep now (else they spin on into the next run)
        return len(g.ids) / g.decode_s, len(g.ids) / g.decode_cpu_s

    def theirs(dt: str, th: int) -> tuple[float, float]:
        """LlamaCpp.greedy's loop, timed by both clocks: n - 1 single-token decodes after the first token."""
        e = engines[dt, th]
        e.llm.reset()
        e.llm.eval(list(prompt))
        out = [int(np.argmax(e._last_logits()))]
        c0, t0 = time.process_time(), time.perf_counter()
        while len(out) < n:
            e.llm.eval([out[-1]])
            out.append(int(np.argmax(e._last_logits())))
        t, c = time.perf_counter() - t0, time.process_time() - c0
        return (n - 1) / t, (n - 1) / c

    same = {}
    for th in counts:  # warm-up (numba, caches), and whether the greedy tokens agree
        for dt in models:
            ids = {path: None for path in ("reference", "fused")}
            for path in ids:
                kernels.ENABLED, enabled = path == "fused", kernels.ENABLED
                ids[path] = generate(models[dt], prompt, max_new_tokens=n, temperature=0, mode="cache").ids
                kernels.ENABLED = enabled
            lc, _ = engines[dt, th].greedy(prompt, n)
            same[dt] = {"fused_vs_reference": ids["fused"] == ids["reference"],
                        "fused_vs_llama.cpp": sum(a == b for a, b in zip(ids["fused"], lc))}
    # ours fused and llama.cpp interleaved, so that the machine's load falls on both alike; our NumPy path
    # after them: its BLAS calls wake OpenBLAS's threads, which spin for a while and would take a core
    # from whatever runs next
    for paths in (("fused", "llama.cpp"), ("reference",)):
        for _ in range(repeat):
            for th in counts:
                for dt in models:
                    for path in paths:
                        time.sleep(0.02)  # the threads of the run before (theirs or ours) have gone idle
                        key = f"llama.cpp {dt} {th}t" if path == "llama.cpp" else f"ours {dt} {path} {th}t"
                        wall, cpu_rate = theirs(dt, th) if path == "llama.cpp" else ours(dt, th, path)
                        rows.setdefault(key, []).append(wall)
                        cpu.setdefault(key, []).append(cpu_rate)
    pool.set_threads(threads)
    med = {k: float(np.median(v)) for k, v in rows.items()}
    med_cpu = {k: float(np.median(v)) for k, v in cpu.items()}
    ratio = {f"{dt} {th}t": med[f"ours {dt} fused {th}t"] / med[f"llama.cpp {dt} {th}t"]
             for th in counts for dt in models}
    ratio_cpu = {f"{dt} 1t": med_cpu[f"ours {dt} fused 1t"] / med_cpu[f"llama.cpp {dt} 1t"] for dt in models}
    best = {k: float(np.max(v)) for k, v in rows.items()}  # the least disturbed run of each (a busy machine)
    ratio_best = {f"{dt} {th}t": best[f"ours {dt} fused {th}t"] / best[f"llama.cpp {dt} {th}t"]
                  for th in counts for dt in models}
    fused_vs_ref = {f"{dt} {th}t": med[f"ours {dt} fused {th}t"] / med[f"ours {dt} reference {th}t"]
                    for th in counts for dt in models}
    return {"run": run, "new_tokens": n, "threads": counts, "tokens_per_s": med, "ours_vs_llama.cpp": ratio,
            "tokens_per_cpu_s": med_cpu, "ours_vs_llama.cpp_per_cpu_s_1t": ratio_cpu,
            "best_tokens_per_s": best, "ours_vs_llama.cpp_best": ratio_best,
            "fused_vs_reference": fused_vs_ref, "greedy": same}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="checkpoint directories")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--per-work", type=int, default=4, help="held-out windows per held-out work (bits/byte)")
    ap.add_argument("--skip", choices=["parity", "speed"], default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    set_threads(args.threads)
    out = {"load_average": os.getloadavg(), "parity": [], "speed": []}
    with tempfile.TemporaryDirectory() as tmp:
        for run in args.runs:
            if args.skip != "parity":
                out["parity"].append(parity(run, Path(tmp), args.per_work))
            if args.skip != "speed":
                out["speed"].append(speed(run, Path(tmp), args.new_tokens, args.repeat, args.threads))
    out["load_average_end"] = os.getloadavg()
    if args.json:
        print(json.dumps(out))
        return
    for p in out["parity"]:
        t = p["transformers"]
        print(f"{p['run']} ({p['params']:,} params): transformers logits rel err {t['logits_rel_err']:.2e}, "
              f"greedy 64 identical: {t['greedy64_identical']}; ours {p['ours_bpb']:.4f} bits/byte on "
              f"{p['heldout_windows']} held-out windows")
        for dt in ("f32", "f16", "q8_0"):
            r = p[f"llama.cpp {dt}"]
            print(f"  llama.cpp {dt:5s} greedy 64: {r['greedy64_same_positions']}/64 same (first difference "
                  f"{r['first_difference']}), logits rel err {r['logits_rel_err']:.2e}, {r['bpb']:.4f} bits/byte, "
                  f"{r['file_mb']:.1f} MiB")
    for s in out["speed"]:
        tps = s["tokens_per_s"]
        print(f"{s['run']}: {s['new_tokens']} greedy tokens after a 32-token prompt, decode tokens/s (median of "
              f"{args.repeat}, interleaved)")
        print(f"  {'threads':>7} {'weights':>7} {'ours fused':>10} {'ours NumPy':>10} {'llama.cpp':>9} "
              f"{'ours/llama.cpp':>14} {'fused/NumPy':>11}")
        for th in s["threads"]:
            for dt in ("f32", "f16"):
                key = f"{dt} {th}t"
                print(f"  {th:>7} {dt:>7} {tps[f'ours {dt} fused {th}t']:>10.0f} "
                      f"{tps[f'ours {dt} reference {th}t']:>10.0f} "
                      f"{tps[f'llama.cpp {key}']:>9.0f} {s['ours_vs_llama.cpp'][key]:>13.2f}x "
                      f"{s['fused_vs_reference'][key]:>10.2f}x")
        rb = s["ours_vs_llama.cpp_best"]
        print("  best of each (the least disturbed run): ours/llama.cpp "
              + ", ".join(f"{k} {v:.2f}x" for k, v in rb.items()))
        r = s["ours_vs_llama.cpp_per_cpu_s_1t"]
        print(f"  1 thread, tokens per CPU-second of the process (what the machine's load changes least): "
              f"ours/llama.cpp f32 {r['f32 1t']:.2f}x, f16 {r['f16 1t']:.2f}x")
        for dt, g in s["greedy"].items():
            print(f"  {dt}: fused greedy == NumPy greedy: {g['fused_vs_reference']}; same as llama.cpp's at "
                  f"{g['fused_vs_llama.cpp']}/{s['new_tokens']} positions")
    print(f"load average {out['load_average']} -> {out['load_average_end']}")


if __name__ == "__main__":
    main()
