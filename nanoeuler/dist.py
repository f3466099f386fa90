"""Data-parallel training over MPI: one process ("rank") per core or machine, the same run as one process.

(single-process part; the MPI part follows)
"""
from __future__ import annotations

from .optim import clip_grad_norm


class Local:
    """The communicator of a run without MPI: one rank."""
    rank, size = 0, 1


_WORLD = Local()


def world():
    """The communicator of this process: MPI's COMM_WORLD wrapper once `init` ran under mpiexec, else Local."""
    return _WORLD


class Trainer:
    """The optimizer step of the loop: clip, AdamW (one process)."""

    def __init__(self, comm, obj, opt, tcfg, state, rng):
        self.comm, self.obj, self.opt, self.tcfg = comm, obj, opt, tcfg
        self.rank, self.size = comm.rank, comm.size

    def step(self, grads, lr: float) -> float:
        if not grads:
            return 0.0
        norm = clip_grad_norm(grads, self.tcfg.grad_clip)
        self.opt.step(self.obj.params, grads, lr=lr)
        return norm

    def agree_stop(self, requested):
        return requested

    def save(self, write) -> None:
        write(self.opt)
