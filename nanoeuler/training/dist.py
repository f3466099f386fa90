"""Data-parallel training over MPI: one process ("rank") per core or per machine, the same run as one process.

    mpiexec -n 4 nanoeuler train small --out runs/x          # or: nanoeuler train small --nproc 4
    mpiexec -hosts a,b -n 2 nanoeuler sft --base runs/x ...  # two machines, TCP

Every rank runs the one training loop (train.run_training) with the same arguments and draws the same
batches with the same rng; each rank computes the loss and gradients of its rows of every micro-batch
(`objective.share`: rows rank·B/N .. (rank+1)·B/N, divided by the whole micro-batch's target count, so
the N shares sum to the one-process gradient). The global batch and the learning-rate schedule are those
of one process, so a run saved with N ranks resumes with M (equal to float32 rounding) or N (bitwise).

The gradient sum is ours, not MPI's, so its order is fixed: the flat gradient buffer is cut into buckets
(whole tensors, >= `bucket_mb`, from the last layer backwards, the order backward finishes them), every
bucket into N pieces, and rank r owns piece r of each bucket:

    reduce-scatter  Ialltoallv: rank r receives piece r of every rank's bucket; it adds them in rank
                    order 0, 1, ..., N-1 (same bits on every run and every rank)
    clip            each rank's sum of squares of its pieces -> allgather -> the same global norm everywhere
    --zero 0        Iallgatherv of the summed pieces -> every rank holds the whole gradient, runs AdamW
    --zero 1        AdamW on its own pieces only (it keeps only their moments: 1/N of the state), then
                    Iallgatherv of the updated parameter pieces
Both give the same bits (AdamW is elementwise). With overlap (default) a bucket's reduce-scatter starts
as soon as backward has finished its tensors (fast/engine.py calls a hook after each layer) and the
requests are advanced between layers, so communication hides behind the rest of backward.

Rank 0 alone prints, logs, evaluates, plots and writes checkpoints (ZeRO moments are gathered to it:
the checkpoint format is the one of one process). Faults: every collective waits by polling; a rank that
fails (an exception) prints its error, tells the others (a message on FAULT_TAG), and aborts the job;
the others print who failed and exit too. A rank killed outright (SIGKILL) is noticed by mpiexec, which
ends the others within about a second. Before the first step the ranks compare a fingerprint of their
settings, data and weights; an error on any rank before then (a missing file, different arguments, a
batch the ranks cannot split) is reported by every rank, and nothing is written.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import time

import numpy as np

from ..errors import UserError, say
from ..optim import clip_grad_norm

FAULT_TAG = 7001  # (and FAULT_TAG + 1: "I have stopped")
ACK_WAIT_S = 10.0
INSTALL_HINT = "data-parallel training needs MPI: pip install 'nanoeuler[dist]'"


class Local:
    """The communicator of a run without MPI: one rank."""
    rank, size = 0, 1
    zero, overlap, bucket_mb = 0, True, 4.0


_WORLD = Local()


def world():
    """This process's communicator: `World` under mpiexec (once `init` ran), else `Local`."""
    return _WORLD


def under_mpi() -> bool:
    """True when started by mpiexec with more than one rank (MPICH's PMI_SIZE, Open MPI's OMPI_COMM_WORLD_SIZE)."""
    return int(os.environ.get("PMI_SIZE") or os.environ.get("OMPI_COMM_WORLD_SIZE") or 1) > 1


def init(zero: int = 0, overlap: bool = True, bucket_mb: float = 4.0, threads: int = 0):
    """Join the MPI job (idempotent). Ranks other than 0 are silenced (stdout to /dev/null); each rank's
    engine runs on its share of the machine's cores (threads: override)."""
    global _WORLD
    if isinstance(_WORLD, World):
        return _WORLD
    try:
        from mpi4py import MPI
    except ImportError:
        raise UserError(INSTALL_HINT) from None
    _WORLD = World(MPI, zero, overlap, bucket_mb)
    from ..fast import parallel
    local = int(os.environ.get("MPI_LOCALNRANKS") or os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE") or 1)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    parallel.PARTS = max(1, threads or cores // local)
    if _WORLD.rank != 0:
        sys.stdout = open(os.devnull, "w")
    return _WORLD


class World:
    """MPI.COMM_WORLD with what the loop needs: waits that notice a failed rank, agreement, small gathers."""

    def __init__(self, MPI, zero: int = 0, overlap: bool = True, bucket_mb: float = 4.0):
        self.MPI, self.comm = MPI, MPI.COMM_WORLD
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.zero, self.overlap, self.bucket_mb = zero, overlap, bucket_mb
        self.agreed = False
        self.comm_s = 0.0  # seconds spent waiting in collectives (for bench/ddp.py)

    # ---- waiting --------------------------------------------------------------------------------
    def test(self, req) -> bool:
        """Advance MPI and report whether req is done; a fault notice from another rank ends this one."""
        if req.Test():
            return True
        if self.comm.Iprobe(source=self.MPI.ANY_SOURCE, tag=FAULT_TAG):
            self._peer_failed()
        return False

    def wait(self, *reqs) -> None:
        t0 = time.perf_counter()
        spins = 0
        for req in reqs:
            while not self.test(req):
                spins += 1
                if spins > 2000:
                    time.sleep(0.0002)
        self.comm_s += time.perf_counter() - t0

    def _peer_failed(self):
        status = self.MPI.Status()
        buf = bytearray(4096)
        self.comm.Recv([buf, self.MPI.BYTE], source=self.MPI.ANY_SOURCE, tag=FAULT_TAG, status=status)
        msg = bytes(buf[:status.Get_count(self.MPI.BYTE)]).decode("utf-8", "replace")
        say(f"error: rank {self.rank}: stopping because rank {status.Get_source()} failed: {msg}")
        self.comm.Send([b"ok", self.MPI.BYTE], dest=status.Get_source(), tag=FAULT_TAG + 1)
        time.sleep(10)  # the failed rank aborts the job once every rank has said it stopped
        self.comm.Abort(1)

    def fail(self, message: str, code: int = 1) -> None:
        """This rank cannot go on: tell every other rank (they print it and exit) and abort the job."""
        say(f"error: rank {self.rank}: {message}")
        data = message.encode()[:4000]
        reqs = [self.comm.Isend([data, self.MPI.BYTE], dest=r, tag=FAULT_TAG) for r in range(self.size) if r != self.rank]
        # wait (at most ACK_WAIT_S: a rank deep in a long step may not look) until every other rank has printed
        acks = [self.comm.Irecv([bytearray(8), self.MPI.BYTE], source=r, tag=FAULT_TAG + 1)
                for r in range(self.size) if r != self.rank]
        t0 = time.time()
        while time.time() - t0 < ACK_WAIT_S and not all(r.Test() for r in reqs + acks):
            time.sleep(0.01)
        time.sleep(0.2)  # their lines reach mpiexec before the job is torn down
        self.comm.Abort(code)

    # ---- small collectives (no pickle: arrays and JSON bytes) ----------------------------------
    def allgather_array(self, a) -> np.ndarray:
        """a (same shape and dtype on every rank) -> [size, *a.shape]."""
        a = np.ascontiguousarray(a)
        out = np.empty((self.size,) + a.shape, a.dtype)
        self.wait(self.comm.Iallgather(a, out))
        return out

    def allgather_bytes(self, data: bytes) -> list[bytes]:
        lengths = self.allgather_array(np.array([len(data)], np.int64))[:, 0]
        out = np.empty(int(lengths.sum()), np.uint8)
        displs = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        self.wait(self.comm.Iallgatherv(np.frombuffer(data, np.uint8).copy(),
                                        [out, lengths.tolist(), displs.tolist(), self.MPI.BYTE]))
        return [out[d:d + n].tobytes() for d, n in zip(displs, lengths)]

    def allgather_arrays(self, arrays: list) -> list[list[np.ndarray]]:
        """Each rank's list of 1-D float64 arrays (lengths may differ) -> per rank, its list."""
        head = json.dumps([len(a) for a in arrays]).encode()
        body = np.concatenate([np.asarray(a, np.float64) for a in arrays]) if arrays else np.zeros(0)
        heads = self.allgather_bytes(head)
        bodies = self.allgather_bytes(body.tobytes())
        out = []
        for h, b in zip(heads, bodies):
            flat, parts, off = np.frombuffer(b, np.float64), [], 0
            for n in json.loads(h):
                parts.append(flat[off:off + n].copy())
                off += n
            out.append(parts)
        return out

    def sum_in_order(self, x: np.ndarray) -> np.ndarray:
        """Sum of a small float64 array over the ranks, added in rank order (the same bits everywhere)."""
        rows = self.allgather_array(np.asarray(x, np.float64))
        total = rows[0].copy()
        for r in rows[1:]:
            total += r
        return total

    def agree(self, error: str | None, fingerprint: dict | None = None) -> None:
        """Every rank calls this once before the first step. Raises the same UserError on every rank if any
        rank had an error, or if the ranks' fingerprints (settings, data, weights) differ."""
        mine = json.dumps({"error": error, "fingerprint": fingerprint}, sort_keys=True, default=str).encode()
        everyone = [json.loads(b) for b in self.allgather_bytes(mine)]
        self.agreed = True
        errors = [(r, e["error"]) for r, e in enumerate(everyone) if e["error"]]
        if errors:
            r, msg = errors[0]
            more = f" (and {len(errors) - 1} more rank(s))" if len(errors) > 1 else ""
            raise collective(UserError(f"rank {r}: {msg}{more}"))
        first = everyone[0]["fingerprint"]
        for r, e in enumerate(everyone[1:], 1):
            if e["fingerprint"] != first:
                keys = sorted(k for k in set(first) | set(e["fingerprint"]) if first.get(k) != e["fingerprint"].get(k))
                raise collective(UserError(f"the ranks were not started alike: rank {r} differs from rank 0 in "
                                           f"{', '.join(keys)} (every rank needs the same arguments, data and "
                                           f"checkpoint)"))


def collective(e: BaseException) -> BaseException:
    """Mark an error every rank raises at the same point (no rank is left waiting: no abort needed)."""
    e.collective = True
    return e


# ---- the command wrapper ------------------------------------------------------------------------
def command(fn):
    """Wrap a CLI command (train, sft, dpo) so that it runs data-parallel under mpiexec: join MPI, and turn
    a failure on one rank into a clear error on every rank (see the module docstring)."""
    def run(args):
        if getattr(args, "nproc", None):
            return launch(args.nproc)
        if not under_mpi():
            if getattr(args, "zero", 0):
                raise UserError("--zero 1 shards the optimizer over MPI ranks: start with mpiexec or --nproc")
            return fn(args)
        w = init(zero=getattr(args, "zero", 0), overlap=not getattr(args, "no_overlap", False),
                 bucket_mb=getattr(args, "bucket_mb", 4.0) or 4.0)
        try:
            return fn(args)
        except BaseException as e:  # noqa: BLE001 - every failure must reach the other ranks
            if getattr(e, "collective", False):  # every rank raised it (e.g. train.TrainingDiverged)
                raise
            msg = str(e) if isinstance(e, UserError) else f"{type(e).__name__}: {e}"
            if isinstance(e, KeyboardInterrupt):
                msg = "interrupted"
            if not w.agreed:
                w.agree(msg or type(e).__name__)  # raises the same error on every rank
            import traceback
            if not isinstance(e, (UserError, KeyboardInterrupt)):
                traceback.print_exc()
            w.fail(msg, getattr(e, "exit_code", 1))
    run.__doc__ = fn.__doc__
    return run


def add_arguments(p) -> None:
    """--nproc, --zero, --no-overlap, --bucket-mb for train, sft and dpo."""
    g = p.add_argument_group("data-parallel (MPI; see `mpiexec -n N nanoeuler ...`)")
    g.add_argument("--nproc", type=int, default=0, metavar="N",
                   help="run on N local processes via mpiexec (needs pip install 'nanoeuler[dist]')")
    g.add_argument("--zero", type=int, choices=[0, 1], default=0,
                   help="1: each rank keeps and updates only its 1/N of the AdamW moments (ZeRO-1); same result")
    g.add_argument("--no-overlap", action="store_true",
                   help="send gradients after backward instead of bucket by bucket while it runs")
    g.add_argument("--bucket-mb", type=float, default=4.0, help="gradient bucket size in MiB (default 4)")


def mpiexec_path() -> str | None:
    import shutil
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return here if os.access(here, os.X_OK) else shutil.which("mpiexec")


def check_launch(n: int) -> str:
    """--nproc n can run here: n >= 1, mpi4py and mpiexec installed. Returns mpiexec's path.
    Checked before anything is prepared, so a missing MPI creates nothing."""
    if n < 1:
        raise UserError(f"--nproc must be >= 1, got {n}")
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        raise UserError(INSTALL_HINT) from None
    exe = mpiexec_path()
    if exe is None:
        raise UserError(INSTALL_HINT)
    return exe


def launch(n: int) -> int:
    """Re-run this process's command line (sys.argv) under `mpiexec -n n`, without --nproc; return its exit code."""
    import subprocess
    exe = check_launch(n)
    argv, skip = [], False
    for a in sys.argv[1:]:
        if skip:
            skip = False
            continue
        if a == "--nproc":
            skip = True
            continue
        if a.startswith("--nproc="):
            continue
        argv.append(a)
    cmd = [exe, "-n", str(n), sys.executable, "-m", "nanoeuler", *argv]
    print("running: " + " ".join(cmd), file=sys.stderr, flush=True)
    return subprocess.call(cmd)


# ---- the optimizer step ---------------------------------------------------------------------------
class Trainer:
    """The loop's optimizer step. One process: clip, AdamW. MPI: see `DataParallel`."""

    def __new__(cls, comm, *args, **kw):
        if comm.size > 1:
            return super().__new__(DataParallel)
        return super().__new__(cls)

    def __init__(self, comm, obj, opt, tcfg, state, rng):
        self.comm, self.obj, self.opt, self.tcfg = comm, obj, opt, tcfg
        self.rank, self.size = comm.rank, comm.size

    def step(self, grads, lr: float) -> float:
        if not grads:
            return 0.0
        norm = clip_grad_norm(grads, self.tcfg.grad_clip)
        self.opt.step(self.obj.params, grads, lr=lr)
        return norm

    def expect(self, acc):
        """Called before the last micro-batch's backward (data-parallel: starts sending buckets)."""
        return None

    def agree_stop(self, requested):
        return requested

    def save(self, write) -> None:
        write(self.opt)


class DataParallel(Trainer):
    """The optimizer step of one rank of a data-parallel run (module docstring)."""

    def __init__(self, comm, obj, opt, tcfg, state, rng):
        super().__init__(comm, obj, opt, tcfg, state, rng)
        micro = tcfg.batch_size // tcfg.grad_accum
        error = None
        if micro % self.size:
            error = (f"a micro-batch of {micro} (--batch-size {tcfg.batch_size} / --grad-accum {tcfg.grad_accum}) "
                     f"cannot be split evenly over {self.size} ranks; make it a multiple of {self.size}")
        elif obj.model.device != "cpu":
            error = "data-parallel training runs the CPU engine (--device cpu)"
        comm.agree(error, None if error else fingerprint(obj, opt, tcfg, state, rng, comm))
        self.params = obj.params
        # the flat layout in the config's order (a loaded checkpoint's dict is in file order), then LoRA
        # adapters (none of the config's names: a LoRA run's config names are its saved modules) sorted
        shapes = obj.model.config.param_shapes()
        order = [n for n in shapes if n in self.params] + sorted(n for n in self.params if n not in shapes)
        self.red = Reducer(comm, {n: self.params[n] for n in order}, comm.bucket_mb)
        self.zero = comm.zero
        if self.zero:
            self.m = self.red.own(opt.m)  # this rank's pieces of the moments; the full ones are dropped
            self.v = self.red.own(opt.v)
            opt.m = opt.v = None
        self.opt_bytes = (sum(a.nbytes for a in self.m) + sum(a.nbytes for a in self.v)) if self.zero else \
            sum(a.nbytes for a in opt.m.values()) + sum(a.nbytes for a in opt.v.values())

    # gradients -----------------------------------------------------------------------------
    def expect(self, acc):
        """Install the engine hook for the last micro-batch: buckets go out as backward finishes them."""
        if not self.comm.overlap:
            return None
        from ..fast import engine
        self.red.reset(acc)
        return engine.grad_hook(self.red.ready)

    def reduce(self, grads, parts, obj):
        """Sum this step's gradients and metrics over the ranks. -> (grads views, parts)."""
        if grads is not None:
            self.red.finish(grads)
        if not parts:
            return (self.red.views if grads is not None else None), parts
        keys = list(parts[0])
        local = np.array([[p[k] for k in keys] for p in parts], np.float64).reshape(len(parts), len(keys))
        total = self.comm.sum_in_order(local)
        return (self.red.views if grads is not None else None), [dict(zip(keys, row)) for row in total.tolist()]

    def step(self, grads, lr: float) -> float:
        if not grads:
            return 0.0
        red = self.red
        sq = sum(sum_of_squares(piece) for piece in red.my_pieces())
        norm = math.sqrt(float(self.comm.sum_in_order(np.array([sq]))[0]))
        clip = self.tcfg.grad_clip
        if clip > 0 and norm > clip:
            scale = red.G.dtype.type(clip / (norm + 1e-6))
            for piece in red.my_pieces():
                piece *= scale
        if not self.zero:
            red.allgather(red.G)
            self.opt.step(self.params, red.views, lr=lr)
        else:
            self._zero_step(lr)
            red.allgather_params(self.params)
        return norm

    def _zero_step(self, lr: float) -> None:
        """AdamW on this rank's pieces, exactly the arithmetic of AdamW.step (fast kernel, same scalars)."""
        from ..fast import kernels
        opt = self.opt
        b1, b2 = opt.betas
        opt.t += 1
        bc1 = 1.0 - b1 ** opt.t
        bc2_sqrt = math.sqrt(1.0 - b2 ** opt.t)
        for k, (name, lo, hi, glo) in enumerate(self.red.my_segments()):
            p = self.params[name]
            dt = p.dtype.type
            decay = dt(1.0 - lr * opt.weight_decay) if p.ndim >= 2 and opt.weight_decay else dt(1.0)
            scalars = (dt(b1), dt(1.0 - b1), dt(b2), dt(1.0 - b2), decay, dt(bc2_sqrt), dt(opt.eps), dt(lr / bc1))
            mk, vk = self.red.segment_state(k, self.m, self.v)
            kernels.adamw_update(p.reshape(-1)[lo:hi], self.red.G[glo:glo + hi - lo], mk, vk, *scalars)

    # stop and save -------------------------------------------------------------------------
    def agree_stop(self, requested):
        flags = self.comm.allgather_array(np.array([1 if requested else 0], np.int64))[:, 0]
        if not flags.any():
            return None
        return requested or f"stop requested on rank {int(np.argmax(flags))}"

    def save(self, write) -> None:
        if not self.zero:
            if self.rank == 0:
                write(self.opt)
            return
        m, v = self.red.gather_state(self.m), self.red.gather_state(self.v)  # rank 0: full dicts
        if self.rank == 0:
            from ..optim import AdamW
            full = AdamW.__new__(AdamW)
            full.__dict__.update(self.opt.__dict__)
            full.m, full.v = m, v
            write(full)


def sum_of_squares(x: np.ndarray) -> float:
    """Σ x² in float64, in an order fixed by the indices alone: the same bits wherever x sits in memory
    (BLAS dot products and NumPy's SIMD sums group their additions by the address alignment, which
    differs from run to run)."""
    global _sumsq
    if _sumsq is None:
        import numba

        from ..numba_cache import install
        install()

        @numba.njit(cache=True)
        def kernel(x):
            acc = np.zeros(8)           # 8 running sums, element i into sum i % 8
            n8 = x.size - x.size % 8
            for i in range(0, n8, 8):
                for j in range(8):
                    v = np.float64(x[i + j])
                    acc[j] += v * v
            tail = 0.0
            for i in range(n8, x.size):
                v = np.float64(x[i])
                tail += v * v
            return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7])) + tail
        _sumsq = kernel
    return float(_sumsq(x))


_sumsq = None


def fingerprint(obj, opt, tcfg, state, rng, comm) -> dict:
    """What must be the same on every rank: settings, data (and the first batch it gives), weights, state."""
    import copy
    import dataclasses
    h = hashlib.sha1()
    for name, p in obj.params.items():
        h.update(name.encode())
        h.update(np.ascontiguousarray(p).tobytes())
    b = hashlib.sha1()
    probe = copy.deepcopy(rng)
    for a in _arrays(obj.draw(probe)):
        b.update(np.ascontiguousarray(a).tobytes())
    return {"train_config": dataclasses.asdict(tcfg), "data": obj.describe(), "weights": h.hexdigest()[:16],
            "first_batch": b.hexdigest()[:16], "step": state["step"], "rng": state.get("rng") or rng.bit_generator.state,
            "optimizer_t": getattr(opt, "t", None), "kind": state.get("kind"), "zero": comm.zero,
            "ranks": comm.size, "dtype": str(next(iter(obj.params.values())).dtype)}


def _arrays(x):
    if isinstance(x, np.ndarray):
        yield x
    elif isinstance(x, (tuple, list)):
        for y in x:
            yield from _arrays(y)
    elif hasattr(x, "__dict__"):
        for y in vars(x).values():
            yield from _arrays(y)
    elif x is not None:
        yield np.asarray(x)


class Reducer:
    """The flat gradient buffer G (the trained params in order), its buckets, and each rank's pieces."""

    def __init__(self, comm, params: dict, bucket_mb: float = 4.0):
        self.comm, self.MPI = comm, comm.MPI
        self.names = list(params)
        dtype = next(iter(params.values())).dtype
        self.offset, off = {}, 0
        for name, p in params.items():
            self.offset[name] = (off, p.size, p.shape)
            off += p.size
        self.G = np.zeros(off, dtype)
        self.views = {n: self.G[o:o + s].reshape(shape) for n, (o, s, shape) in self.offset.items()}
        # buckets of whole tensors, from the last backwards (backward finishes the heads and the last layer first)
        limit = max(1, int(bucket_mb * (1 << 20) / dtype.itemsize))
        self.buckets, cur = [], []
        for name in reversed(self.names):
            cur.append(name)
            if sum(self.offset[n][1] for n in cur) >= limit:
                self.buckets.append(cur)
                cur = []
        if cur:
            self.buckets.append(cur)
        N, r = comm.size, comm.rank
        self.spans = []  # per bucket: (b0, b1, [(piece start, piece end) per rank], names)
        for names in self.buckets:
            b0 = min(self.offset[n][0] for n in names)
            b1 = max(self.offset[n][0] + self.offset[n][1] for n in names)
            pieces = [(b0 + (b1 - b0) * k // N, b0 + (b1 - b0) * (k + 1) // N) for k in range(N)]
            self.spans.append((b0, b1, pieces, set(names)))
        self.recv = [np.empty(N * (p[r][1] - p[r][0]), dtype) for _, _, p, _ in self.spans]
        self.bucket_of = {n: k for k, names in enumerate(self.buckets) for n in names}
        self._segments = None
        self.hook_s = self.exposed_s = 0.0  # seconds in the backward hook / in communication after backward
        self.reset(None)

    def reset(self, acc) -> None:
        """A new step: nothing sent yet; acc = the gradient summed over the earlier micro-batches (or None)."""
        self.acc = acc
        self.pending = [set(names) for names in self.buckets]
        self.state = ["idle"] * len(self.buckets)  # idle -> scattering -> summed
        self.reqs = [None] * len(self.buckets)

    # the hook: called by the engine with tensors whose gradient is final --------------------------
    def ready(self, names, grads) -> None:
        t0 = time.perf_counter()
        self._ready(names, grads)
        self.hook_s += time.perf_counter() - t0

    def _ready(self, names, grads) -> None:
        for name in names:
            k = self.bucket_of.get(name)
            if k is None or name not in self.pending[k]:
                continue
            view = self.views[name]
            if self.acc is not None:
                np.add(self.acc[name], grads[name], out=view)
            else:
                view[...] = grads[name]
            self.pending[k].discard(name)
            if not self.pending[k]:
                self._start(k)
        self._progress()

    def _start(self, k: int) -> None:
        b0, b1, pieces, _ = self.spans[k]
        counts = [e - s for s, e in pieces]
        displs = [s - b0 for s, _ in pieces]
        mine = counts[self.comm.rank]
        dt = self.MPI._typedict[self.G.dtype.char]
        self.reqs[k] = self.comm.comm.Ialltoallv([self.G[b0:b1], counts, displs, dt],
                                                 [self.recv[k], [mine] * len(counts),
                                                  [mine * j for j in range(len(counts))], dt])
        self.state[k] = "scattering"

    def _progress(self) -> None:
        for k, req in enumerate(self.reqs):
            if self.state[k] == "scattering" and self.comm.test(req):
                self._sum(k)

    def _sum(self, k: int) -> None:
        """Rank order: piece = rank 0's + rank 1's + ... (fixed)."""
        _, _, pieces, _ = self.spans[k]
        s, e = pieces[self.comm.rank]
        n = e - s
        rows = self.recv[k].reshape(len(pieces), n)
        out = self.G[s:e]
        out[...] = rows[0]
        for row in rows[1:]:
            out += row
        self.state[k] = "summed"

    def finish(self, grads) -> None:
        """After accumulation: send what the hook has not sent yet (all of it without overlap), wait, sum."""
        t0 = time.perf_counter()
        for k, names in enumerate(self.buckets):
            if self.state[k] == "idle":
                for name in names:
                    self.views[name][...] = grads[name]
                self._start(k)
        for k in range(len(self.buckets)):
            if self.state[k] == "scattering":
                self.comm.wait(self.reqs[k])
                self._sum(k)
        self.reset(None)
        self.exposed_s += time.perf_counter() - t0

    def my_pieces(self):
        r = self.comm.rank
        return [self.G[p[r][0]:p[r][1]] for _, _, p, _ in self.spans]

    def allgather(self, buf: np.ndarray) -> None:
        """Every rank's pieces of buf -> the whole buf on every rank."""
        t0 = time.perf_counter()
        dt = self.MPI._typedict[buf.dtype.char]
        reqs = []
        for b0, b1, pieces, _ in self.spans:
            s, e = pieces[self.comm.rank]
            counts = [pe - ps for ps, pe in pieces]
            displs = [ps - b0 for ps, _ in pieces]
            reqs.append(self.comm.comm.Iallgatherv([buf[s:e].copy(), dt], [buf[b0:b1], counts, displs, dt]))
        self.comm.wait(*reqs)
        self.exposed_s += time.perf_counter() - t0

    # ZeRO-1 ------------------------------------------------------------------------------------
    def my_segments(self):
        """(tensor name, start, end within the tensor, start in G) of every stretch of this rank's pieces."""
        if self._segments is None:
            segs = []
            for s, e in ((p[self.comm.rank]) for _, _, p, _ in self.spans):
                for name in self.names:
                    o, n, _ = self.offset[name]
                    lo, hi = max(s, o), min(e, o + n)
                    if lo < hi:
                        segs.append((name, lo - o, hi - o, lo))
            self._segments = segs
        return self._segments

    def own(self, full: dict) -> list:
        """This rank's segments of a full per-tensor state (AdamW m or v), as separate arrays."""
        return [full[name].reshape(-1)[lo:hi].copy() for name, lo, hi, _ in self.my_segments()]

    def segment_state(self, k: int, m: list, v: list):
        return m[k], v[k]

    def gather_state(self, mine: list) -> dict | None:
        """Rank 0 receives every rank's segments of a sharded state -> {name: full array} there, None elsewhere."""
        flat = np.empty(self.G.size, self.G.dtype)
        for (name, lo, hi, g0), a in zip(self.my_segments(), mine):
            flat[g0:g0 + hi - lo] = a
        self.allgather(flat)  # simple and bounded: the state is gathered only when a checkpoint is written
        if self.comm.rank != 0:
            return None
        return {n: flat[o:o + s].reshape(shape).copy() for n, (o, s, shape) in self.offset.items()}

    def allgather_params(self, params: dict) -> None:
        """After a ZeRO step: each rank's updated pieces of the parameters -> every rank."""
        flat = np.empty(self.G.size, self.G.dtype)
        for name, lo, hi, g0 in self.my_segments():
            flat[g0:g0 + hi - lo] = params[name].reshape(-1)[lo:hi]
        self.allgather(flat)
        for n, (o, s, shape) in self.offset.items():
            params[n].reshape(-1)[...] = flat[o:o + s]
