"""Runs `nanoeuler ARGS...` as one rank of an MPI job, with an optional injected fault (tests/test_dist.py).

    mpiexec -n 2 python tests/dist_driver.py train ... --out runs/x
    NANOEULER_TEST_FAULT=1:5:raise     rank 1 raises an exception in step 5
    NANOEULER_TEST_FAULT=1:5:sleep     rank 1 sleeps 0.3 s in every step from step 5 on (time to signal it)
    NANOEULER_TEST_FAULT=*:0:slow      every rank sleeps 0.05 s per step
    NANOEULER_TEST_FAULT=*:7:nan       every rank's loss is NaN from step 7 on (as a diverged run's would be)
    NANOEULER_TEST_PIDS=DIR            each rank writes its pid to DIR/rank<r>.pid
"""
import os
import sys
import time


def install_fault(spec: str) -> None:
    import nanoeuler.training.train as t
    rank_s, step_s, kind = spec.split(":")
    me = int(os.environ.get("PMI_RANK", "0"))
    if rank_s != "*" and int(rank_s) != me:
        return
    real, calls = t.accumulate, {"n": 0}

    def faulty(*a, **k):
        calls["n"] += 1
        if calls["n"] >= int(step_s):
            if kind == "raise":
                raise RuntimeError(f"injected fault in step {calls['n']}")
            if kind == "sleep":
                time.sleep(0.3)
        if kind == "slow":
            time.sleep(0.05)
        out = real(*a, **k)
        if kind == "nan" and calls["n"] >= int(step_s):
            out[0]["loss"] = float("nan")
        return out

    t.accumulate = faulty


if __name__ == "__main__":
    if os.environ.get("NANOEULER_TEST_PIDS"):  # a directory: write rank<r>.pid so a test can signal one rank
        with open(os.path.join(os.environ["NANOEULER_TEST_PIDS"], f"rank{os.environ.get('PMI_RANK', '0')}.pid"), "w") as f:
            f.write(str(os.getpid()))
    if os.environ.get("NANOEULER_TEST_FAULT"):
        install_fault(os.environ["NANOEULER_TEST_FAULT"])
    from nanoeuler.cli import main
    sys.exit(main(sys.argv[1:]))
