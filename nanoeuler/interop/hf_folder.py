"""Reading a Hugging Face model folder, whatever its architecture: config.json, the weights (one
model.safetensors or the shards listed in model.safetensors.index.json, every shard checked), the end-of-text
id, and the MTP heads 1..K-1 our export keeps in a side file. hf.py (every architecture) and gpt2.py (GPT-2's
tokenizer files) build on it; it imports neither.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..errors import UserError

MTP_FILE = "nanoeuler_mtp.safetensors"  # heads 1..K-1 beside an exported folder (float32; only `import` reads it)
HF_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


def read_json_file(path: Path, what: str):
    if not path.is_file():
        raise UserError(f"{what}: {path} not found")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError) as e:   # RecursionError: [[[[... nested too deep
        raise UserError(f"{path} is not valid JSON ({str(e)[:120]})") from None


def read_hf_config(folder: Path) -> dict:
    c = read_json_file(folder / "config.json", "not a Hugging Face model folder")
    if not isinstance(c, dict):
        raise UserError(f"{folder / 'config.json'} is not a JSON object")
    return c


def read_weights(folder: Path, progress: bool = False) -> dict[str, np.ndarray]:
    """HF tensor name -> float32 array, from model.safetensors or the shards of model.safetensors.index.json."""
    from tqdm import tqdm

    from .safetensors_io import read_tensors
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        idx = read_json_file(index, "shard index")
        wmap = idx.get("weight_map") if isinstance(idx, dict) else None
        if not isinstance(wmap, dict) or not wmap or not all(isinstance(v, str) for v in wmap.values()):
            raise UserError(f"{index}: no \"weight_map\" of tensor name -> shard file")
        files = sorted(set(wmap.values()))
        out = {}
        for f in tqdm(files, desc="read shards", disable=not progress):
            path = folder / f
            if Path(f).name != f or not path.is_file():
                raise UserError(f"{index}: shard {f} is missing")
            want = {n for n, v in wmap.items() if v == f}
            got = read_tensors(path, want)
            lost = sorted(want - set(got))
            if lost:
                raise UserError(f"shard {f} does not hold {lost[0]}, which {index.name} puts there")
            out.update(got)
        return {n: a.astype(np.float32) for n, (_, a) in out.items()}
    single = folder / "model.safetensors"
    if single.is_file():
        return {n: a.astype(np.float32) for n, (_, a) in read_tensors(single).items()}
    if any(folder.glob("*.bin")) or any(folder.glob("*.pt")):
        raise UserError(f"{folder} holds only PyTorch pickle weights; nanoeuler reads safetensors only "
                        "(save the model with safe_serialization=True)")
    raise UserError(f"{folder} has no model.safetensors or model.safetensors.index.json")


def eos_id_of(folder: Path, c: dict):
    """The end-of-text id: config.json's eos_token_id (first of a list), else generation_config.json's."""
    eos = c.get("eos_token_id")
    if eos is None and (folder / "generation_config.json").is_file():
        g = read_json_file(folder / "generation_config.json", "generation config")
        eos = g.get("eos_token_id") if isinstance(g, dict) else None
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    if eos is not None and (not isinstance(eos, int) or eos < 0):
        raise UserError(f"config.json: eos_token_id {eos!r} is not a token id")
    return eos


def mtp_heads(folder: Path, n_mtp: int | None, head0: np.ndarray) -> dict[str, np.ndarray]:
    """MTP heads 1..K-1: from nanoeuler_mtp.safetensors (written by our export) where present, the rest
    initialised as copies of head 0. n_mtp None: as many as the side file holds (1 without one)."""
    from .safetensors_io import read_tensors
    saved = {}
    if (folder / MTP_FILE).is_file():
        saved = {n: a.astype(np.float32) for n, (_, a) in read_tensors(folder / MTP_FILE).items()}
        for n, a in saved.items():
            if a.shape != head0.shape:
                raise UserError(f"{MTP_FILE}: {n} has shape {list(a.shape)}, expected {list(head0.shape)}")
    K = n_mtp if n_mtp is not None else 1 + len(saved)
    return {f"heads.{k}.weight": saved.get(f"heads.{k}.weight", head0).copy() for k in range(1, K)}
