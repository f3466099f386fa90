"""Atomic file writes: write to a temporary name in the same directory, fsync, then rename.

A crash, a full disk or Ctrl-C in the middle of a write leaves the previous file intact, because
`os.replace` of a file on the same filesystem is atomic: readers see the old file or the new one.
"""
from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path


@contextlib.contextmanager
def atomic_path(path: str | Path):
    """Yield a temporary path beside `path`; on success it is renamed onto `path`, on failure removed.

        with atomic_path("run/model.safetensors") as tmp:
            save_file(tensors, tmp)
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    with atomic_path(path) as tmp:
        Path(tmp).write_bytes(data)


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | Path, obj) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2) + "\n")
