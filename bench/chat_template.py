"""What rendering a chat template in a worker process costs: the same ChatML render of a 4-message
conversation in this process (`template_worker.render_here`, the sandbox without the process around it)
and through a warm worker (`chat_template.render`, what chat and serve do for every request), then the
prompt ids of a chat request (render + encode) and an SFT example (three renders in one trip + encodes),
each the median of --repeat timed batches of --n calls, in one run. A busy machine inflates the worker's
figures most (each trip waits for the worker to be scheduled): compare on a quiet one.

    .venv/bin/python bench/chat_template.py [--n 500] [--repeat 5] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from gguf_fixtures import CHATML, chatml_tokenizer  # noqa: E402

from nanoeuler import template_worker  # noqa: E402
from nanoeuler.chat_template import example, prompt_ids, render  # noqa: E402
from nanoeuler.tokenizer import Tokenizer  # noqa: E402

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"}]


def per_call_us(fn, n: int, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        times.append((time.perf_counter() - t0) / n)
    return statistics.median(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=500)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    tok = Tokenizer.from_dict(chatml_tokenizer().to_dict() | {"chat_template": CHATML})
    here = per_call_us(lambda: template_worker.render_here(CHATML, [(MESSAGES, True)], "", ""), args.n, args.repeat)
    worker = per_call_us(lambda: render(CHATML, MESSAGES, tok, True), args.n, args.repeat)
    ids = per_call_us(lambda: prompt_ids(tok, MESSAGES), args.n, args.repeat)
    sft = per_call_us(lambda: example(tok, MESSAGES[:2], "4"), args.n, args.repeat)
    out = {"render_in_process_us": here, "render_in_worker_us": worker, "worker_over_in_process": worker / here,
           "chat_prompt_ids_us": ids, "sft_example_us": sft, "load_average": os.getloadavg()[0]}
    if args.json:
        print(json.dumps(out))
        return
    print(f"ChatML, 4 messages (load average {out['load_average']:.1f}):")
    print(f"  render in this process     {here:8.1f} us")
    print(f"  render in a warm worker    {worker:8.1f} us   ({worker / here:.1f}x, +{worker - here:.0f} us)")
    print(f"  chat prompt ids            {ids:8.1f} us   (render in the worker + encode)")
    print(f"  one SFT example            {sft:8.1f} us   (3 renders in one trip + encodes)")


if __name__ == "__main__":
    main()
