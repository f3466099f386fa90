"""Peak memory of decoding at each --dtype: one fresh process per type, SmolLM-135M's shape (random init, as
bench/llama_types.py makes it) or a preset, at float32 in memory as a checkpoint load leaves it, then converted
(weights.for_dtype, what `sample --dtype` runs), laid out for the batcher (serve's engine, the widest
layout), and a few greedy tokens decoded. Reported per type: the process's peak RSS, its RSS after decoding
(the float32 model let go; freed memory the allocator keeps counts), the model's parameters, all the bytes
the engine's weights hold (parameters included: the model as decoding holds it), and of those the float32
bytes beyond the parameters.

    .venv/bin/python bench/decode_memory.py                      # smol135: float32, float16, q8_0, q4_0
    .venv/bin/python bench/decode_memory.py --model big --types float32,q8_0 --json
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def status_mib(field: str) -> float:
    """A field of /proc/self/status (VmHWM: peak RSS, VmRSS: now) in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise SystemExit(f"no {field} in /proc/self/status (Linux only)")


def held(W: dict, P: dict) -> list:
    """The arrays that own the memory of the engine's weights W, apart from the parameters P (views counted
    once, as their base)."""
    import numpy as np

    def root(a):
        while isinstance(a.base, np.ndarray):
            a = a.base
        return a

    def arrays(x):
        if isinstance(x, np.ndarray):
            yield x
        elif isinstance(x, (tuple, list, dict)):
            for y in (x.values() if isinstance(x, dict) else x):
                yield from arrays(y)
    own = {id(root(p)) for p in P.values()}
    return list({id(r): r for r in map(root, arrays(W)) if id(r) not in own}.values())


def float32_held(W: dict, P: dict) -> int:
    """Bytes of float32 arrays in the engine's weights W that are not the parameters P."""
    import numpy as np
    return sum(r.nbytes for r in held(W, P) if r.dtype == np.float32)


def child(model_name: str, dtype: str) -> dict:
    """In this process: make the model, convert it, build the batcher, decode 8 tokens -> the figures."""
    from llama_types import make_model

    from nanoeuler.infer.engine import Batcher, Job
    from nanoeuler.infer.weights import for_dtype
    model = for_dtype(make_model(model_name), dtype)  # (the float32 model goes once converted)
    b = Batcher(model, max_batch=1, max_queue=1)
    b.submit(Job(ids=[1, 2, 3], max_tokens=8))
    while b.step():
        pass
    return {"dtype": dtype, "peak_mib": status_mib("VmHWM"), "rss_mib": status_mib("VmRSS"),
            "float32_held_mib": float32_held(b.W, model.params) / 2**20,
            "params_mib": sum(p.nbytes for p in model.params.values()) / 2**20,
            "weights_mib": sum(p.nbytes for p in model.params.values()) / 2**20
            + sum(r.nbytes for r in held(b.W, model.params)) / 2**20}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smol135", help="smol135 (default) or a preset")
    ap.add_argument("--types", default="float32,float16,q8_0,q4_0", help="the --dtype values, comma-separated")
    ap.add_argument("--json", action="store_true", help="one JSON object on stdout")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "bench"))
    if args.child:
        print(json.dumps(child(args.model, args.child)))
        return 0
    rows = []
    for t in args.types.split(","):
        out = subprocess.run([sys.executable, __file__, "--model", args.model, "--child", t], capture_output=True,
                             text=True, cwd=ROOT)
        if out.returncode:
            raise SystemExit(f"{t}: {out.stderr.strip().splitlines()[-1] if out.stderr.strip() else 'failed'}")
        rows.append(json.loads(out.stdout.splitlines()[-1]))
    if args.json:
        print(json.dumps({"model": args.model, "rows": rows}))
        return 0
    print(f"{args.model}: {'dtype':>8} {'peak RSS':>9} {'RSS after':>10} {'params':>8} {'weights':>8} "
          f"{'float32 held':>13}  (MiB)")
    for r in rows:
        print(f"{'':>{len(args.model) + 1}} {r['dtype']:>8} {r['peak_mib']:>9.0f} {r['rss_mib']:>10.0f} "
              f"{r['params_mib']:>8.0f} {r['weights_mib']:>8.0f} {r['float32_held_mib']:>13.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
