"""Data-parallel training under `mpiexec -n 2` (nanoeuler/training/dist.py), run from pytest in subprocesses:
2 ranks vs 1 process at the same global batch (equal to float32 rounding), 2-rank runs bitwise repeatable
(also with --zero 1 and without overlap), the same for SFT and DPO, resume 2 -> 1 and 1 -> 2, a rank
interrupted (SIGINT) or killed (SIGKILL) or failing, and bad input reported by every rank."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

pytest.importorskip("mpi4py")
from nanoeuler import Config, Model  # noqa: E402
from conftest import rel_err, tiny_config  # noqa: E402
from nanoeuler.training.dist import mpiexec_path  # noqa: E402

MPIEXEC = mpiexec_path()
pytestmark = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec (pip install 'nanoeuler[dist]')")
DRIVER = str(Path(__file__).parent / "dist_driver.py")
TINY = tiny_config(vocab_size=257, dim=32, n_heads=4, n_kv_heads=2, n_layers=2, ctx_len=32, ffn_hidden=64, n_mtp=2)
ROUNDING = 2e-4  # per entry (conftest.rel_err) after 20 steps: float32 rounding (measured up to 7.5e-5), not a different run
# DPO: each rank pads its own pairs and its reference log-probs come from its own batch shape; the sigmoid of
# the log-ratio margin amplifies that float32 rounding over 20 steps (measured 2.6e-4), still not a different run
DPO_ROUNDING = 5e-4


def mpirun(n: int, args: list[str], cwd: Path, env: dict | None = None, timeout: float = 120,
           sections: list[list[str]] | None = None) -> subprocess.CompletedProcess:
    """`mpiexec -n n python dist_driver.py ARGS` (or MPMD: one section of args per rank)."""
    cmd = [MPIEXEC]
    for i, a in enumerate(sections or [args]):
        cmd += ([":"] if i else []) + ["-n", str(1 if sections else n), sys.executable, DRIVER, *a]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, **(env or {})))


def one(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, DRIVER, *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def weights(run: Path) -> dict:
    return load_file(str(run / "model.safetensors"))


def max_rel(a: Path, b: Path) -> float:
    """The largest per-entry relative difference (conftest.rel_err) of any weight tensor of two runs."""
    wa, wb = weights(a), weights(b)
    return max(rel_err(wb[k], wa[k]) for k in wa)


def bitwise(a: Path, b: Path, files=("model.safetensors", "optimizer.safetensors")) -> bool:
    for f in files:
        ta, tb = load_file(str(a / f)), load_file(str(b / f))
        if ta.keys() != tb.keys() or not all(np.array_equal(ta[k], tb[k], equal_nan=True) for k in ta):
            return False
    return True


def ok(p: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    return p


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """A byte-level tokenizer, token shards of a few Shakespeare scenes, a tiny config."""
    from nanoeuler.data.corpus import bundled_works
    from nanoeuler.data.shards import prepare
    from nanoeuler.tokenizer import Tokenizer
    d = tmp_path_factory.mktemp("dist")
    tok = Tokenizer([])
    tok.save(d / "tok.json")
    text = "\n\n".join(next(iter(bundled_works().values())).split("\n\n")[:300])
    (d / "book.txt").write_text(text)
    prepare([d / "book.txt"], tok, d / "data", processes=1, progress=False)
    (d / "tiny.json").write_text(json.dumps(TINY.to_dict()))
    return d


TRAIN = ["train", "tiny.json", "--data", "data", "--steps", "20", "--batch-size", "8", "--lr", "3e-3", "--warmup", "2",
         "--eval-every", "100", "--ckpt-every", "4", "--no-progress", "--json"]


class Runs:
    """Training runs made once per module and shared by the tests that compare them."""

    def __init__(self, d: Path):
        self.d, self.done = d, {}

    def get(self, name: str, n: int, extra=()) -> Path:
        if name not in self.done:
            args = TRAIN + ["--out", name, *extra]
            ok(one(args, self.d) if n == 1 else mpirun(n, args, self.d))
            self.done[name] = self.d / name
        return self.done[name]


@pytest.fixture(scope="module")
def runs(work):
    return Runs(work)


# ---- equal to one process, bitwise repeatable ------------------------------------------------------------
def test_two_ranks_equal_one_process_and_repeat_bitwise(runs, capsys):
    p1, r2a, r2b = runs.get("p1", 1), runs.get("r2a", 2), runs.get("r2b", 2)
    rel = max_rel(p1, r2a)
    with capsys.disabled():
        print(f"\n[dist] pretraining, 20 steps, 2 ranks vs 1 process: max relative weight difference {rel:.2e}")
    assert rel < ROUNDING                # the sums are grouped differently: rounding only
    assert bitwise(r2a, r2b)
    log = [json.loads(x) for x in (r2a / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == list(range(1, 21)) and "val_loss" in log[-1]  # rank 0 alone wrote it
    state1, state2 = (json.loads((r / "trainer.json").read_text()) for r in (p1, r2a))
    assert state1["rng"] == state2["rng"] and state1["tokens_seen"] == state2["tokens_seen"]  # same global batches


def test_zero1_and_no_overlap_give_the_same_bits(runs):
    r2a = runs.get("r2a", 2)
    assert bitwise(r2a, runs.get("r2z", 2, ["--zero", "1"]))
    assert bitwise(r2a, runs.get("r2n", 2, ["--no-overlap"]))  # same buckets, sent after backward


def test_grad_accum_and_dropout_split_over_ranks(runs):
    extra = ["--grad-accum", "2", "--dropout", "0.1"]
    assert max_rel(runs.get("p1d", 1, extra), runs.get("r2d", 2, extra)) < ROUNDING


# ---- resume across rank counts ---------------------------------------------------------------------------
def test_resume_two_to_one_and_one_to_two(runs, work):
    p1, r2a = runs.get("p1", 1), runs.get("r2a", 2)
    ok(mpirun(2, TRAIN + ["--out", "s21", "--stop-after", "9"], work))
    shutil.copytree(work / "s21", work / "s22")
    ok(one(TRAIN + ["--out", "s21", "--resume"], work))                       # saved by 2 ranks, resumed by 1
    ok(mpirun(2, TRAIN + ["--out", "s22", "--resume"], work))                 # ... and by 2 again
    ok(one(TRAIN + ["--out", "s12", "--stop-after", "9"], work))
    ok(mpirun(2, TRAIN + ["--out", "s12", "--resume"], work))                 # saved by 1, resumed by 2
    assert max_rel(p1, work / "s21") < ROUNDING and max_rel(p1, work / "s12") < ROUNDING
    assert bitwise(r2a, work / "s22")                                         # same N: bitwise
    assert json.loads((work / "s12" / "trainer.json").read_text())["step"] == 20


def test_zero1_checkpoint_is_the_one_process_format_and_resumes(runs, work):
    ok(mpirun(2, TRAIN + ["--out", "z9", "--stop-after", "9", "--zero", "1"], work))
    opt = load_file(str(work / "z9" / "optimizer.safetensors"))
    model = Model.load(work / "z9")
    assert set(opt) == {f"{k}.{n}" for k in "mv" for n in model.params}      # gathered: full moments
    ok(mpirun(2, TRAIN + ["--out", "z9", "--resume"], work))                  # resumed without ZeRO
    assert bitwise(runs.get("r2a", 2), work / "z9")


# ---- SFT and DPO ----------------------------------------------------------------------------------------
def test_sft_two_ranks(work, capsys):
    from nanoeuler.training.sft import offline_instructions
    from nanoeuler.tokenizer import Tokenizer
    tok = Tokenizer.load(work / "tok.json")
    cfg = Config(vocab_size=257, dim=16, n_heads=2, n_kv_heads=1, n_layers=1, ctx_len=256, ffn_hidden=32, n_mtp=2)
    Model.init(cfg, seed=0).save(work / "base", tokenizer=tok)
    train, held = offline_instructions(n_train=60, n_heldout=10)
    (work / "sft.json").write_text(json.dumps(train))
    (work / "sftval.json").write_text(json.dumps(held))
    args = ["sft", "--base", "base", "--data", "sft.json", "--val", "sftval.json", "--steps", "20", "--batch-size",
            "4", "--eval-every", "100", "--no-progress", "--json"]
    ok(one(args + ["--out", "sft1"], work))
    ok(mpirun(2, args + ["--out", "sft2a"], work))
    ok(mpirun(2, args + ["--out", "sft2b"], work))
    rel = max_rel(work / "sft1", work / "sft2a")
    with capsys.disabled():
        print(f"\n[dist] SFT (masked loss, packed rows), 20 steps, 2 ranks vs 1 process: max relative difference {rel:.2e}")
    assert rel < ROUNDING and bitwise(work / "sft2a", work / "sft2b")


def test_dpo_two_ranks(work, capsys):
    from nanoeuler.tokenizer import Tokenizer
    tok = Tokenizer.load(work / "tok.json")
    Model.init(TINY, seed=0).save(work / "sftrun", tokenizer=tok)
    pairs = lambda n, off: "".join(json.dumps({"prompt": f"q{i + off}=", "chosen": "yes", "rejected": "no"}) + "\n"
                                   for i in range(n))
    (work / "pairs.jsonl").write_text(pairs(40, 0))
    (work / "pval.jsonl").write_text(pairs(8, 1000))
    args = ["dpo", "--sft", "sftrun", "--data", "pairs.jsonl", "--val", "pval.jsonl", "--steps", "20", "--batch-size",
            "4", "--lr", "3e-3", "--eval-every", "100", "--ckpt-every", "5", "--no-progress", "--json"]
    ok(one(args + ["--out", "dpo1"], work))
    ok(mpirun(2, args + ["--out", "dpo2a"], work))
    ok(mpirun(2, args + ["--out", "dpo2b", "--zero", "1"], work))
    rel = max_rel(work / "dpo1", work / "dpo2a")
    with capsys.disabled():
        print(f"\n[dist] DPO, 20 steps, 2 ranks vs 1 process: max relative difference {rel:.2e}")
    assert rel < DPO_ROUNDING
    assert bitwise(work / "dpo2a", work / "dpo2b", ("model.safetensors", "optimizer.safetensors", "reference.safetensors"))
    r1, r2 = (load_file(str(work / d / "reference.safetensors")) for d in ("dpo1", "dpo2a"))
    assert np.array_equal(np.isnan(r1["train.chosen"]), np.isnan(r2["train.chosen"]))  # same pairs drawn


# ---- faults ---------------------------------------------------------------------------------------------
def _start(work: Path, out: str, extra=(), fault="*:1:slow"):
    pids = work / f"pids-{out}"
    pids.mkdir()
    cmd = [MPIEXEC, "-n", "2", sys.executable, DRIVER, *TRAIN, "--out", out, *extra]
    proc = subprocess.Popen(cmd, cwd=work, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, NANOEULER_TEST_PIDS=str(pids), NANOEULER_TEST_FAULT=fault))
    deadline = time.time() + 60
    log = work / out / "log.jsonl"
    while not (log.exists() and len(log.read_text().splitlines()) >= 5):   # a few steps in (and a checkpoint)
        assert time.time() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    return proc, int((pids / "rank1.pid").read_text())


def test_sigint_of_one_rank_stops_all_with_a_checkpoint_then_resume_is_bitwise(runs, work):
    proc, pid = _start(work, "int")
    os.kill(pid, signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    state = json.loads((work / "int" / "trainer.json").read_text())
    assert 5 <= state["step"] < 20 and '"interrupted": "stop requested on rank 1"' in out
    ok(mpirun(2, TRAIN + ["--out", "int", "--resume"], work))
    assert bitwise(runs.get("r2a", 2), work / "int")


def test_sigkill_of_one_rank_ends_the_job_fast_and_the_checkpoint_resumes(runs, work):
    proc, pid = _start(work, "kill")
    os.kill(pid, signal.SIGKILL)
    t0 = time.time()
    out, err = proc.communicate(timeout=30)
    assert proc.returncode != 0 and time.time() - t0 < 10
    assert "Killed" in out + err                                               # mpiexec says which and how
    Model.load(work / "kill")                                                  # the last checkpoint is whole
    ok(mpirun(2, TRAIN + ["--out", "kill", "--resume"], work))
    assert bitwise(runs.get("r2a", 2), work / "kill")


def test_an_exception_on_one_rank_stops_every_rank_with_a_message(work):
    t0 = time.time()
    p = mpirun(2, TRAIN + ["--out", "exc"], work, env={"NANOEULER_TEST_FAULT": "1:6:raise"})
    assert p.returncode != 0 and time.time() - t0 < 60
    assert "error: rank 1: RuntimeError: injected fault in step 6" in p.stderr
    assert "error: rank 0: stopping because rank 1 failed" in p.stderr
    Model.load(work / "exc")


def test_a_diverged_loss_stops_every_rank_at_once_and_keeps_the_last_checkpoint(work):
    t0 = time.time()
    p = mpirun(2, TRAIN + ["--out", "nan"], work, env={"NANOEULER_TEST_FAULT": "*:7:nan"})
    assert p.returncode == 3 and time.time() - t0 < 60, p.stderr               # TrainingDiverged, no abort
    assert p.stderr.count("error: loss became nan at step 7") == 2
    assert json.loads((work / "nan" / "trainer.json").read_text())["step"] == 4  # the last good checkpoint


# ---- bad input: a clear error on every rank, nothing written --------------------------------------------
def _errors(p) -> list[str]:
    return [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]


def test_batch_not_divisible_by_the_ranks(work):
    p = mpirun(2, TRAIN + ["--out", "odd", "--batch-size", "6", "--grad-accum", "2"], work)
    errs = _errors(p)
    assert p.returncode != 0 and len(errs) == 2 and all("cannot be split evenly over 2 ranks" in e for e in errs)
    assert not (work / "odd" / "trainer.json").exists()


def test_ranks_with_different_arguments(work):
    p = mpirun(2, [], work, sections=[TRAIN + ["--out", "diff"], TRAIN + ["--out", "diff", "--lr", "4e-3"]])
    errs = _errors(p)
    assert p.returncode != 0 and len(errs) == 2 and all("rank 1 differs from rank 0 in train_config" in e for e in errs)
    assert not (work / "diff" / "trainer.json").exists()


def test_ranks_with_different_data(work):
    from nanoeuler.data.shards import prepare
    from nanoeuler.tokenizer import Tokenizer
    other = work / "book2.txt"
    other.write_text((work / "book.txt").read_text()[::-1])       # same tokenizer, same size, other text
    prepare([other], Tokenizer.load(work / "tok.json"), work / "data2", processes=1, progress=False)
    p = mpirun(2, [], work, sections=[TRAIN + ["--out", "ddata"], TRAIN + ["--out", "ddata", "--data", "data2"]])
    errs = _errors(p)
    assert p.returncode != 0 and len(errs) == 2 and all("rank 1 differs from rank 0 in" in e and "first_batch" in e
                                                        for e in errs), p.stderr
    assert not (work / "ddata" / "trainer.json").exists()


def test_data_one_rank_cannot_read(work):
    p = mpirun(2, [], work, sections=[TRAIN + ["--out", "nodata"], TRAIN + ["--out", "nodata", "--data", "missing"]])
    errs = _errors(p)
    assert p.returncode != 0 and len(errs) == 2 and all("rank 1:" in e and "missing" in e for e in errs), p.stderr


def test_checkpoint_only_rank_0_sees(work):
    ok(mpirun(2, TRAIN + ["--out", "seen", "--stop-after", "4"], work))
    before = (work / "seen" / "model.safetensors").read_bytes()
    elsewhere = work / "elsewhere"
    for name in ("data", "tiny.json"):
        (elsewhere / name).parent.mkdir(exist_ok=True)
        shutil.copytree(work / name, elsewhere / name) if (work / name).is_dir() else shutil.copy(work / name, elsewhere)
    cmd = [MPIEXEC, "-n", "1", "-wdir", str(work), sys.executable, DRIVER, *TRAIN, "--out", "seen", "--resume", ":",
           "-n", "1", "-wdir", str(elsewhere), sys.executable, DRIVER, *TRAIN, "--out", "seen", "--resume"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    errs = _errors(p)
    assert p.returncode != 0 and len(errs) == 2 and all("rank 1:" in e and "seen" in e for e in errs), p.stderr
    assert (work / "seen" / "model.safetensors").read_bytes() == before


def test_nproc_launches_mpiexec(work):
    p = one(TRAIN + ["--out", "np", "--nproc", "2", "--steps", "3"], work)
    assert p.returncode == 0, p.stderr
    assert "mpiexec -n 2" in p.stderr and json.loads(p.stdout.strip().splitlines()[-1])["step"] == 3


def test_nproc_without_mpi_is_one_line_and_creates_nothing(tmp_path, monkeypatch, capsys):
    """--nproc checks for MPI before preparing the bundled corpus (it used to build data/ first)."""
    from nanoeuler.cli import main
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # import mpi4py -> ImportError
    assert main(["train", "small", "--nproc", "2", "--out", "runs/x", "--steps", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "nanoeuler[dist]" in err and err.count("\n") == 1
    assert list(tmp_path.iterdir()) == []
