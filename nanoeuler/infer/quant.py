"""Weight types for inference: float32, float16 and GGUF's block formats Q8_0, Q4_0 and Q4_1, one table entry
each (`WTYPES`), in NumPy. The library needs no `gguf` for them; tests check them against `gguf.quants`.

A block format cuts each row of a weight matrix into blocks of 32 weights and keeps per block a float16
scale d (Q4_1: and a float16 minimum m) and 32 small integers q:

    Q8_0   34 bytes: d, q int8 [32]                 w = d·q            q = round(w / d),  d = max|w| / 127
    Q4_0   18 bytes: d, q 4-bit [32] (16 bytes)     w = d·(q - 8)      d = w_max / -8 (w_max: largest |w|, signed)
    Q4_1   20 bytes: d, m, q 4-bit [32]             w = d·q + m        d = (max - min) / 15,  m = min

`quantize` rounds exactly as `gguf.quants.quantize` (ggml's reference C), so the bytes equal a GGUF file's
bit for bit; `dequantize` reads them back as float32 as gguf does. The bytes of a matrix [out, in] are
[out, in / 32 · bytes per block], row by row, as in the file:

    b = quantize(np.ones((2, 32), np.float32), "q8_0")      # uint8 [2, 34]
    dequantize(b, "q8_0", 32)                                # [2, 32] of 1.0

The decoding kernels (qkernels.py) read another arrangement of the same integers (`pack` there); activations
are quantized to 8 bits per block at run time (`quantize_x8`, llama.cpp's x86 rounding), and the kernels
compute the dot products in integers.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import numpy as np

from ..errors import UserError

QK = 32  # weights per block


class WType(NamedTuple):
    """One weight type: how a matrix is stored and read back.  WTYPES["q4_1"].bytes_per_weight -> 0.625"""
    name: str
    ggml: int            # its GGMLQuantizationType number in a GGUF file
    block: int           # weights per block (1: a plain float type)
    nbytes: int          # bytes per block
    quantize: Callable   # float32 [..., n] -> the stored form ([..., n / block · nbytes] uint8 for a block type)
    dequantize: Callable  # the stored form, n -> float32 [..., n]

    @property
    def bytes_per_weight(self) -> float:
        return self.nbytes / self.block


# ---- rounding as ggml's reference C (gguf.quants) -----------------------------------------------------
def _roundf(v: np.ndarray) -> np.ndarray:
    """C's roundf (halves away from zero) in float32.  _roundf(np.float32([0.5, -1.5])) -> [1, -2]"""
    a = np.abs(v)
    f = np.floor(a)
    return np.sign(v) * (f + np.floor(np.float32(2) * (a - f)))


def _inverse(d: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.where(d == 0, np.float32(0), np.float32(1) / d)


def _half_bytes(v: np.ndarray) -> np.ndarray:
    """float32 [n, 1] -> its float16 as 2 bytes [n, 2]."""
    return v.astype(np.float16).view(np.uint8)


def _nibbles(q: np.ndarray) -> np.ndarray:
    """q uint8 [n, 32] in 0..15 -> [n, 16] bytes, byte i = q[i] | q[i + 16] << 4 (ggml's order)."""
    return q[:, :QK // 2] | (q[:, QK // 2:] << np.uint8(4))


def _unnibble(b: np.ndarray) -> np.ndarray:
    """The inverse of _nibbles: [n, 16] bytes -> q uint8 [n, 32]."""
    return np.concatenate([b & np.uint8(15), b >> np.uint8(4)], axis=1)


def _q8_0(x: np.ndarray) -> np.ndarray:
    """Blocks float32 [n, 32] -> Q8_0 bytes [n, 34]."""
    d = np.abs(x).max(axis=1, keepdims=True) / np.float32(127)
    q = _roundf(x * _inverse(d)).astype(np.int8).view(np.uint8)
    return np.concatenate([_half_bytes(d), q], axis=1)


def _q4_0(x: np.ndarray) -> np.ndarray:
    """Blocks float32 [n, 32] -> Q4_0 bytes [n, 18]."""
    top = np.take_along_axis(x, np.abs(x).argmax(axis=1)[:, None], axis=1)
    d = top / np.float32(-8)
    q = np.trunc(x * _inverse(d) + np.float32(8.5)).astype(np.uint8).clip(0, 15)
    return np.concatenate([_half_bytes(d), _nibbles(q)], axis=1)


def _q4_1(x: np.ndarray) -> np.ndarray:
    """Blocks float32 [n, 32] -> Q4_1 bytes [n, 20]."""
    hi, lo = x.max(axis=1, keepdims=True), x.min(axis=1, keepdims=True)
    d = (hi - lo) / np.float32(15)
    q = np.trunc((x - lo) * _inverse(d) + np.float32(0.5)).astype(np.uint8).clip(0, 15)
    return np.concatenate([_half_bytes(d), _half_bytes(lo), _nibbles(q)], axis=1)


def _scale(b: np.ndarray, at: int) -> np.ndarray:
    """The float16 at bytes at, at + 1 of each block [n, bytes] as float32 [n, 1]."""
    return np.ascontiguousarray(b[:, at:at + 2]).view(np.float16).astype(np.float32)


def _dq8_0(b: np.ndarray) -> np.ndarray:
    return b[:, 2:].view(np.int8).astype(np.float32) * _scale(b, 0)


def _dq4_0(b: np.ndarray) -> np.ndarray:
    return _scale(b, 0) * (_unnibble(b[:, 2:]).astype(np.int8) - np.int8(8)).astype(np.float32)


def _dq4_1(b: np.ndarray) -> np.ndarray:
    return _scale(b, 0) * _unnibble(b[:, 4:]).astype(np.float32) + _scale(b, 2)


def _blockwise(quantize_blocks: Callable, dequantize_blocks: Callable, nbytes: int,
               scales: int) -> tuple[Callable, Callable]:
    """quantize and dequantize of a block type from its per-block functions; the first `scales` float16 of a
    block are its scale (and minimum), which must come out finite."""
    def quantize(W: np.ndarray) -> np.ndarray:
        W = np.asarray(W, np.float32)
        if W.ndim == 0 or W.shape[-1] % QK:
            raise UserError(f"a block-quantized matrix needs rows of a multiple of {QK} weights, not {W.shape}")
        if not np.isfinite(W).all():
            raise UserError("cannot quantize weights that are not finite (inf or nan)")
        with np.errstate(over="ignore", invalid="ignore"):
            B = quantize_blocks(W.reshape(-1, QK))
        if not np.isfinite(B[:, :2 * scales].copy().view(np.float16)).all():
            raise UserError("weights too large for the float16 scales of a block type; keep float32 or float16")
        return B.reshape(*W.shape[:-1], W.shape[-1] // QK * nbytes)

    def dequantize(B: np.ndarray, n: int) -> np.ndarray:
        B = np.ascontiguousarray(B, np.uint8)
        return dequantize_blocks(B.reshape(-1, nbytes)).reshape(*B.shape[:-1], n)

    return quantize, dequantize


WTYPES: dict[str, WType] = {
    "float32": WType("float32", 0, 1, 4, lambda W: np.asarray(W, np.float32),
                     lambda B, n: np.asarray(B, np.float32)),
    "float16": WType("float16", 1, 1, 2, lambda W: np.asarray(W, np.float32).astype(np.float16),
                     lambda B, n: np.asarray(B, np.float16).astype(np.float32)),
    "q8_0": WType("q8_0", 8, QK, 34, *_blockwise(_q8_0, _dq8_0, 34, 1)),
    "q4_0": WType("q4_0", 2, QK, 18, *_blockwise(_q4_0, _dq4_0, 18, 1)),
    "q4_1": WType("q4_1", 3, QK, 20, *_blockwise(_q4_1, _dq4_1, 20, 2)),
}
BLOCK_TYPES = ("q8_0", "q4_0", "q4_1")


def wtype(name: str) -> WType:
    """The table entry of a weight type by name; UserError for an unknown one."""
    if name not in WTYPES:
        raise UserError(f"unknown weight type {name!r}; one of {', '.join(WTYPES)}")
    return WTYPES[name]


def quantize(W: np.ndarray, name: str) -> np.ndarray:
    """W float [..., n] in weight type `name` (see the module docstring)."""
    return wtype(name).quantize(W)


def dequantize(B: np.ndarray, name: str, n: int) -> np.ndarray:
    """The stored form B of rows of n weights, as float32 [..., n]."""
    return wtype(name).dequantize(B, n)


# ---- activations: 8 bits per block, as llama.cpp's x86 quantize_row_q8_0 / q8_1 ------------------------
def quantize_x8(X: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows X float32 [n, k] (k a multiple of 32) -> (q int8 [n, k], d float32 [n, k/32], s float32 [n, k/32]):
    per block d = max|x| / 127 rounded to float16, q = x · 127 / max|x| rounded to nearest even, s = Σ q (the
    block sum Q4_1's minimum and the unsigned weight offsets need). The kernels do the same in numba; this is
    their reference.  x ≈ d·q:  quantize_x8(np.float32([[127] * 32]))[1] -> [[1.0]]"""
    n, k = X.shape
    x = np.asarray(X, np.float32).reshape(n, k // QK, QK)
    amax = np.abs(x).max(axis=2)                                   # [n, k/32]
    inv = np.where(amax == 0, np.float32(0), np.float32(127) / np.where(amax == 0, np.float32(1), amax))
    q = np.rint(x * inv[..., None]).astype(np.int8)
    d = (amax / np.float32(127)).astype(np.float16).astype(np.float32)
    return q.reshape(n, k), d, q.sum(axis=2, dtype=np.int32).astype(np.float32)
