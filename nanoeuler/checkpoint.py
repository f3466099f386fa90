"""The checkpoint directory: atomic multi-file save, safe load (no pickle), resume state.

A checkpoint is a directory holding `model.safetensors`, `config.json`, `tokenizer.json` and, for a
training run, `optimizer.safetensors` + `trainer.json`. A save must never leave a mix of old and new
files, so it is a small journal:

    1. write every new file into RUN/.staging/          (a crash here: RUN still holds the old set)
    2. rename RUN/.staging -> RUN/.commit               (atomic: the new set is now complete on disk)
    3. move each file from RUN/.commit into RUN          (a crash here: rolled forward on the next load)
    4. remove RUN/.commit

`recover(run_dir)` finishes step 3 if a save was interrupted after step 2 and discards a half-written
.staging, so every reader sees either the previous checkpoint or the new one, never a mix.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Callable

import numpy as np

from .config import Config
from .errors import UserError

STAGING, COMMIT = ".staging", ".commit"


def recover(run_dir: str | Path) -> None:
    """Complete or discard an interrupted save (see the module docstring)."""
    run_dir = Path(run_dir)
    commit = run_dir / COMMIT
    if commit.is_dir():
        for f in sorted(commit.iterdir()):
            os.replace(f, run_dir / f.name)
        commit.rmdir()
    shutil.rmtree(run_dir / STAGING, ignore_errors=True)


def save_files(run_dir: str | Path, writers: dict[str, Callable[[Path], None]]) -> None:
    """Write a set of files into run_dir as one atomic unit; writers map file name -> fn(path)."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    recover(run_dir)
    staging = run_dir / STAGING
    staging.mkdir()
    for name, write in writers.items():
        path = staging / name
        write(path)
        with open(path, "rb") as f:
            os.fsync(f.fileno())
    os.replace(staging, run_dir / COMMIT)
    recover(run_dir)


def json_writer(obj) -> Callable[[Path], None]:
    return lambda path: path.write_text(json.dumps(obj, indent=2) + "\n")


def tensors_writer(tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None):
    from safetensors.numpy import save_file
    return lambda path: save_file({n: np.ascontiguousarray(a) for n, a in tensors.items()}, str(path), metadata)


def model_writers(config: Config, params: dict[str, np.ndarray], tokenizer=None) -> dict:
    writers = {"model.safetensors": tensors_writer(params), "config.json": json_writer(config.to_dict())}
    if tokenizer is not None:
        writers["tokenizer.json"] = json_writer(tokenizer.to_dict())
    return writers


def save_model(run_dir, config: Config, params: dict[str, np.ndarray], tokenizer=None) -> None:
    save_files(run_dir, model_writers(config, params, tokenizer))


def read_tensors(path: Path, what: str) -> dict[str, np.ndarray]:
    """Load a safetensors file into writable numpy arrays; any defect is a one-line UserError."""
    from safetensors.numpy import load_file
    if not path.is_file():
        raise UserError(f"{what}: {path} not found")
    try:
        return {n: np.array(a) for n, a in load_file(str(path)).items()}
    except Exception as e:  # safetensors raises several types for truncated / foreign files
        raise UserError(f"{what}: {path} is corrupt or not a safetensors file ({str(e).splitlines()[0][:120]})") from None


def read_json(path: Path, what: str):
    if not path.is_file():
        raise UserError(f"{what}: {path} not found")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{what}: {path} is not valid JSON ({e})") from None


def check_run_dir(run_dir) -> Path:
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UserError(f"checkpoint directory {run_dir} not found")
    recover(run_dir)
    return run_dir


def load_model(run_dir) -> tuple[Config, dict[str, np.ndarray]]:
    """(config, params) from a checkpoint directory, validated against each other."""
    from .model import check_params
    run_dir = check_run_dir(run_dir)
    config = Config.from_dict(read_json(run_dir / "config.json", "checkpoint config"))
    params = read_tensors(run_dir / "model.safetensors", "checkpoint weights")
    try:
        check_params(config, params)
    except UserError as e:
        raise UserError(f"checkpoint {run_dir}: {e}") from None
    return config, params


def load_tokenizer(run_dir):
    from .tokenizer import Tokenizer
    run_dir = check_run_dir(run_dir)
    return Tokenizer.from_dict(read_json(run_dir / "tokenizer.json", "checkpoint tokenizer"))
