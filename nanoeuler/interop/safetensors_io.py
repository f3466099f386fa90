"""Read and write safetensors files in float32 / float16 / bfloat16 with NumPy only (no torch).

`safetensors.numpy` cannot hold bfloat16 (NumPy has no such dtype), and Hugging Face checkpoints are
often bf16, so this module speaks the format directly. A file is

    [8 bytes: header length n, little-endian u64][n bytes: JSON header][raw little-endian tensor data]

with header entries {"name": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [begin, end]}} (offsets
into the data block) and an optional "__metadata__" of string -> string.

bfloat16 is the top half of a float32: bf16 -> f32 is a 16-bit shift (exact); f32 -> bf16 rounds to
nearest even.  to_bf16_bits(np.float32([1.0])) -> [0x3f80]
"""
from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

from ..errors import UserError

DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "BF16": np.uint16,
          "I64": np.int64, "I32": np.int32, "U8": np.uint8, "BOOL": np.bool_}
FLOAT_DTYPES = {"F32", "F16", "F64", "BF16"}
MAX_HEADER = 100 << 20


def to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), rounding to nearest even; NaN stays NaN."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    out = rounded.astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        out[nan] = 0x7FC0
    return out


def from_bf16_bits(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) -> float32, exactly.  from_bf16_bits([0x3f80]) -> [1.0]"""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def read_header(path: Path) -> tuple[dict, int]:
    """(header dict, offset of the data block) of a safetensors file; a defect is a UserError."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise UserError(f"{path} is not a safetensors file (too short)")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER or 8 + n > size:
                raise UserError(f"{path} is not a safetensors file (bad header length {n})")
            header = json.loads(f.read(n))
    except FileNotFoundError:
        raise UserError(f"{path} not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise UserError(f"{path} is not a safetensors file (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise UserError(f"{path} is not a safetensors file (its header is not a JSON object)")
    data_size = size - 8 - n
    for name, info in header.items():
        if name == "__metadata__":
            continue
        ok = (isinstance(info, dict) and info.get("dtype") in DTYPES and isinstance(info.get("shape"), list)
              and all(isinstance(s, int) and s >= 0 for s in info["shape"])
              and isinstance(info.get("data_offsets"), list) and len(info["data_offsets"]) == 2)
        if not ok:
            raise UserError(f"{path}: tensor {name} has a malformed header entry (dtype {info.get('dtype') if isinstance(info, dict) else '?'})")
        b, e = info["data_offsets"]
        want = int(np.prod(info["shape"], dtype=np.int64)) * np.dtype(DTYPES[info["dtype"]]).itemsize
        if not (0 <= b <= e <= data_size) or e - b != want:
            raise UserError(f"{path}: tensor {name} is truncated or its offsets disagree with its shape")
    return header, 8 + n


def read_tensors(path: Path, names=None) -> dict[str, tuple[str, np.ndarray]]:
    """name -> (safetensors dtype, array) for the float tensors in path (bf16 as float32, others as
    stored). names: only these (default all). Arrays are copies (the file is not kept open)."""
    header, start = read_header(path)
    out = {}
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    for name, info in header.items():
        if name == "__metadata__" or (names is not None and name not in names):
            continue
        dt = info["dtype"]
        if dt not in FLOAT_DTYPES:
            raise UserError(f"{path}: tensor {name} has dtype {dt}; expected a float type (F32, F16, BF16)")
        b, e = info["data_offsets"]
        raw = np.frombuffer(mm[start + b:start + e], dtype=np.dtype(DTYPES[dt]).newbyteorder("<"))
        arr = from_bf16_bits(raw) if dt == "BF16" else raw.astype(raw.dtype.newbyteorder("="))
        out[name] = (dt, np.array(arr).reshape(info["shape"]))
    del mm
    return out


def write_tensors(path: Path, tensors: dict[str, np.ndarray], dtype: str = "F32",
                  metadata: dict[str, str] | None = None) -> None:
    """Write float tensors to path as dtype ("F32", "F16" or "BF16"), in the given order."""
    if dtype not in ("F32", "F16", "BF16"):
        raise UserError(f"cannot write dtype {dtype}; choose F32, F16 or BF16")
    header, blobs, offset = {}, [], 0
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    for name, a in tensors.items():
        a = np.asarray(a)
        if dtype == "BF16":
            data = to_bf16_bits(a.astype(np.float32)).astype("<u2").tobytes()
        else:
            data = np.ascontiguousarray(a, dtype=np.dtype(DTYPES[dtype]).newbyteorder("<")).tobytes()
        header[name] = {"dtype": dtype, "shape": list(a.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    h = json.dumps(header, separators=(",", ":")).encode("utf-8")
    h += b" " * (-len(h) % 8)  # the data block starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for data in blobs:
            f.write(data)
