"""Weight types for inference: float32, float16 and GGUF's block formats, one row each of `WTYPES` (as llama.cpp's
`type_traits`), in NumPy. The library needs no `gguf` for them; tests check them against `gguf.quants`.

A row says everything about its type: its names (ours, GGUF's), its GGUF number, its block geometry, the dtype
of its arrays, the decoding kernel that multiplies it and what that kernel makes of the activations, and its
quantize / dequantize / unpack. Every list of types is derived from the table (`decodable`, `block_types`,
`quantizable`, `from_float`: `--dtype`'s choices, what export writes, what import keeps, the kernels' dispatch),
so a new type is one row. A type is known by its name, never by its size: a block type's arrays are records
of one block's bytes whose dtype carries the name (np.dtype([("q4_0", "V18")])), and IQ4_NL, 18 bytes a block
too, would be another dtype.

A block format cuts each row of a weight matrix into blocks and keeps per block float16 scales and small
integers q. Every one of them reads back as

    w = d·sc_j·(q - offset) + m          (m: Q4_1 / Q5_1's float16 minimum; K types: -dmin·mn_j)

with sc_j, mn_j the integer scale and minimum of the sub-block j the weight lies in (1, 0 where a type has none):

    type   weights  bytes  scales                               q                    offset  quantize here
    Q8_0   32       34     d                                    int8, kept as q+128  128     yes
    Q4_0   32       18     d                                    4-bit                8       yes
    Q4_1   32       20     d, m                                 4-bit                0       yes
    Q5_0   32       22     d                                    5-bit                16      yes
    Q5_1   32       24     d, m                                 5-bit                0       yes
    Q4_K   256      144    d, dmin; 8 × (6-bit sc, 6-bit mn)    4-bit                0       no: from files
    Q5_K   256      176    d, dmin; 8 × (6-bit sc, 6-bit mn)    5-bit                0       no
    Q6_K   256      210    d; 16 × 8-bit signed sc              6-bit                32      no

`quantize` rounds exactly as `gguf.quants.quantize` (ggml's reference C), so the bytes equal a GGUF file's
bit for bit; `dequantize` reads them back as float32 as gguf does (the same float32 operations in the same
order). gguf (and so this module) cannot quantize the K types: llama.cpp makes them with an iterative search
(`quantize_row_q4_K_ref`), and their blocks come from files. The bytes of a matrix [out, in] are
[out, in / block · bytes per block], row by row, as in the file:

    b = quantize(np.ones((2, 32), np.float32), "q8_0")      # uint8 [2, 34]
    dequantize(b, "q8_0", 32)                                # [2, 32] of 1.0

`unpack` gives a block's numbers (`Fields`), which the decoding kernels rearrange (qkernels.pack). The
activations are quantized to 8 bits per block at run time as llama.cpp does for the weight type they meet:
`quantize_x8` (32-wide blocks, float16 scale: Q8_0, for the 32-weight types), `quantize_x8_1` (Q8_1, for Q4_1
and Q5_1: their block sums in float16 too) and `quantize_xk` (256-wide blocks, float32 scale, sums per 16: Q8_K,
for the K types); the kernels compute in integers.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import numpy as np

from ..errors import UserError

QK = 32     # weights per block of the 32-weight types
QK_K = 256  # weights per super-block of the K types


class WType(NamedTuple):
    """One weight type, one row of WTYPES.  WTYPES["q4_1"].bytes_per_weight -> 0.625"""
    name: str            # ours: --dtype's, the tables'
    gguf: str            # GGUF's (a file's tensor type; source.json's tensor_types)
    ggml: int            # its GGMLQuantizationType number in a GGUF file
    block: int           # weights per block (1: a plain float type)
    nbytes: int          # bytes per block
    dtype: np.dtype      # of its arrays: float32 / float16, or a block type's record of one block's bytes, named
    kind: int | None     # the decoding kernel that reads it (gemv.py 0, 1; qkernels.KINDS from 3); None: none
    activations: str | None  # what that kernel quantizes the activations to: q8_0, q8_1, q8_k (None: float32)
    quantize: Callable | None  # float32 [..., n] -> the stored form ([..., n / block · nbytes] uint8); None: cannot
    dequantize: Callable  # the stored form, n -> float32 [..., n]
    unpack: Callable | None = None  # a block type's blocks [N, nbytes] -> their Fields
    scales: tuple[int, ...] = ()    # byte offsets of a block's float16 scales (d, m, dmin): finite in a sound file

    @property
    def bytes_per_weight(self) -> float:
        return self.nbytes / self.block


class Fields(NamedTuple):
    """The numbers of blocks [n] of one type (see the module docstring): w = d·sc_j·(q - offset) + m, or
    - dmin·mn_j for the K types; sub-block j holds block / subs consecutive weights."""
    q: np.ndarray                    # uint8 [n, block]: each weight's integer, unsigned
    offset: int
    d: np.ndarray                    # float16 [n, 1]
    sc: np.ndarray | None = None     # [n, subs] integer scales (uint8; Q6_K int8), or none
    m: np.ndarray | None = None      # float16 [n, 1]: Q4_1 / Q5_1's minimum
    dmin: np.ndarray | None = None   # float16 [n, 1]: the K types' scale of their minimums
    mn: np.ndarray | None = None     # uint8 [n, subs]: the K types' integer minimums


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
    """q uint8 [n, 32] (low 4 bits used) -> [n, 16] bytes, byte i = q[i] | q[i + 16] << 4 (ggml's order)."""
    q = q & np.uint8(15)
    return q[:, :QK // 2] | (q[:, QK // 2:] << np.uint8(4))


def _unnibble(b: np.ndarray) -> np.ndarray:
    """[..., k] bytes -> [..., 2k]: the k low nibbles, then the k high ones (written in place: a model's
    weights pass here once when packed)."""
    k = b.shape[-1]
    out = np.empty((*b.shape[:-1], 2 * k), np.uint8)
    np.bitwise_and(b, np.uint8(15), out=out[..., :k])
    np.right_shift(b, np.uint8(4), out=out[..., k:])
    return out


def _bits(b: np.ndarray) -> np.ndarray:
    """[..., k] bytes -> [..., 8k] of 0 / 1, bit i of byte j at 8j + i (little-endian, as ggml's qh)."""
    return np.unpackbits(b, axis=-1, bitorder="little")


def _top(x: np.ndarray) -> np.ndarray:
    """Per block [n, k] the entry of largest |x|, signed, the first of ties (ggml's `amax < fabsf(v)`)."""
    return np.take_along_axis(x, np.abs(x).argmax(axis=1)[:, None], axis=1)


def _q8_0(x: np.ndarray) -> np.ndarray:
    """Blocks float32 [n, 32] -> Q8_0 bytes [n, 34]."""
    d = np.abs(x).max(axis=1, keepdims=True) / np.float32(127)
    q = _roundf(x * _inverse(d)).astype(np.int8).view(np.uint8)
    return np.concatenate([_half_bytes(d), q], axis=1)


def _q4_0(x: np.ndarray) -> np.ndarray:
    """Blocks float32 [n, 32] -> Q4_0 bytes [n, 18]."""
    d = _top(x) / np.float32(-8)
    q = np.trunc(x * _inverse(d) + np.float32(8.5)).astype(np.uint8).clip(0, 15)
    return np.concatenate([_half_bytes(d), _nibbles(q)], axis=1)


def _q4_1(x: np.ndarray) -> np.ndarray:
    """Blocks float32 [n, 32] -> Q4_1 bytes [n, 20]."""
    hi, lo = x.max(axis=1, keepdims=True), x.min(axis=1, keepdims=True)
    d = (hi - lo) / np.float32(15)
    q = np.trunc((x - lo) * _inverse(d) + np.float32(0.5)).astype(np.uint8).clip(0, 15)
    return np.concatenate([_half_bytes(d), _half_bytes(lo), _nibbles(q)], axis=1)


def _fifth_bits(q: np.ndarray) -> np.ndarray:
    """q uint8 [n, 32] in 0..31 -> qh [n, 4]: bit j = bit 4 of q[j]."""
    return np.packbits(q >> np.uint8(4), axis=1, bitorder="little")


def _q5_0(x: np.ndarray) -> np.ndarray:
    """Blocks float32 [n, 32] -> Q5_0 bytes [n, 22]: d, qh, 16 nibble bytes."""
    d = _top(x) / np.float32(-16)
    q = np.trunc(x * _inverse(d) + np.float32(16.5)).astype(np.uint8).clip(0, 31)
    return np.concatenate([_half_bytes(d), _fifth_bits(q), _nibbles(q)], axis=1)


def _q5_1(x: np.ndarray) -> np.ndarray:
    """Blocks float32 [n, 32] -> Q5_1 bytes [n, 24]: d, m, qh, 16 nibble bytes."""
    hi, lo = x.max(axis=1, keepdims=True), x.min(axis=1, keepdims=True)
    d = (hi - lo) / np.float32(31)
    q = np.trunc((x - lo) * _inverse(d) + np.float32(0.5)).astype(np.uint8).clip(0, 31)
    return np.concatenate([_half_bytes(d), _half_bytes(lo), _fifth_bits(q), _nibbles(q)], axis=1)


# ---- unpacking: bytes [n, nbytes] -> Fields ------------------------------------------------------------
def _half(b: np.ndarray, at: int) -> np.ndarray:
    """The float16 at bytes at, at + 1 of each block [n, bytes], as [n, 1]."""
    return np.ascontiguousarray(b[:, at:at + 2]).view(np.float16)


def _u8_0(b):
    return Fields(b[:, 2:] ^ np.uint8(128), 128, _half(b, 0))


def _u4_0(b):
    return Fields(_unnibble(b[:, 2:]), 8, _half(b, 0))


def _u4_1(b):
    return Fields(_unnibble(b[:, 4:]), 0, _half(b, 0), m=_half(b, 2))


def _u5_0(b):
    return Fields(_unnibble(b[:, 6:]) | (_bits(b[:, 2:6]) << np.uint8(4)), 16, _half(b, 0))


def _u5_1(b):
    return Fields(_unnibble(b[:, 8:]) | (_bits(b[:, 4:8]) << np.uint8(4)), 0, _half(b, 0), m=_half(b, 2))


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12 scale bytes of a Q4_K / Q5_K block [n, 12] -> (sc, mn) uint8 [n, 8], 6 bits each (ggml's
    get_scale_min_k4): j < 4: sc = s[j] & 63, mn = s[j + 4] & 63; j >= 4: the low 4 bits in s[j + 4]'s
    nibbles, the high 2 in the top bits of s[j - 4] (sc) and s[j] (mn)."""
    lo, mid, top = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = np.concatenate([lo & 63, (top & 15) | ((lo >> 6) << 4)], axis=1)
    mn = np.concatenate([mid & 63, (top >> 4) | ((mid >> 6) << 4)], axis=1)
    return sc, mn


def _k_quants(ql: np.ndarray) -> np.ndarray:
    """The 128 nibble bytes of a Q4_K / Q5_K block [n, 128] -> the low 4 bits of its 256 q: chunk c of 32
    bytes holds sub-block 2c in its low nibbles and 2c + 1 in its high ones."""
    return _unnibble(ql.reshape(len(ql), 4, 32)).reshape(len(ql), QK_K)


def _u4_k(b):
    sc, mn = _k_scales(b[:, 4:16])
    return Fields(_k_quants(b[:, 16:]), 0, _half(b, 0), sc, dmin=_half(b, 2), mn=mn)


def _u5_k(b):
    sc, mn = _k_scales(b[:, 4:16])
    high = _bits(b[:, 16:48]).reshape(len(b), 32, 8).transpose(0, 2, 1).reshape(len(b), QK_K)  # bit j of qh[l]
    return Fields(_k_quants(b[:, 48:]) | (high << np.uint8(4)), 0, _half(b, 0), sc, dmin=_half(b, 2), mn=mn)


def _u6_k(b):
    """Q6_K [n, 210]: ql [128], qh [64], sc int8 [16], d. Half h (128 weights) of ql: its 64 bytes' low nibbles
    are weights 0..63, the high ones 64..127; qh[32h + l] holds weight 32g + l's top 2 bits at bits 2g, 2g + 1."""
    n = len(b)
    low = _unnibble(b[:, :128].reshape(n, 2, 64)).reshape(n, QK_K)
    top = (b[:, 128:192].reshape(n, 2, 1, 32) >> np.uint8([0, 2, 4, 6])[:, None]) & np.uint8(3)  # [n, h, g, l]
    return Fields(low | (top.reshape(n, QK_K) << np.uint8(4)), 32, _half(b, 208), b[:, 192:208].view(np.int8))


def _dequantize_fields(f: Fields) -> np.ndarray:
    """w [n, block] float32 from the fields, in gguf's operations: (d·sc)·(q - offset) (+ m | - dmin·mn)."""
    n, block = f.q.shape
    s = f.d.astype(np.float32) if f.sc is None else f.d.astype(np.float32) * f.sc.astype(np.float32)  # [n, subs]
    q = (f.q.astype(np.int16) - np.int16(f.offset)).astype(np.float32).reshape(n, s.shape[1], -1)
    w = s[..., None] * q
    if f.m is not None:
        w = w + f.m.astype(np.float32)[..., None]
    if f.mn is not None:
        w = w - (f.dmin.astype(np.float32) * f.mn.astype(np.float32))[..., None]
    return w.reshape(n, block)


def _scales_finite(blocks: np.ndarray, scales: tuple[int, ...]) -> np.ndarray:
    """Blocks [n, nbytes] -> bool [n]: whether each one's float16 scales (at the byte offsets `scales`) are finite."""
    ok = np.ones(len(blocks), bool)
    for at in scales:
        ok &= np.isfinite(_half(blocks, at)).reshape(-1)
    return ok


def _blockwise(quantize_blocks: Callable | None, unpack_blocks: Callable, block: int, nbytes: int,
               scales: tuple[int, ...]) -> tuple[Callable | None, Callable]:
    """quantize and dequantize of a block type from its per-block functions; `scales`: the byte offsets of the
    float16 scales a block's quantization makes, which must come out finite."""
    def quantize(W: np.ndarray) -> np.ndarray:
        W = np.asarray(W, np.float32)
        if W.ndim == 0 or W.shape[-1] % block:
            raise UserError(f"a block-quantized matrix needs rows of a multiple of {block} weights, not {W.shape}")
        if not np.isfinite(W).all():
            raise UserError("cannot quantize weights that are not finite (inf or nan)")
        with np.errstate(over="ignore", invalid="ignore"):
            B = quantize_blocks(W.reshape(-1, block))
        if not _scales_finite(B, scales).all():
            raise UserError("weights too large for the float16 scales of a block type; keep float32 or float16")
        return B.reshape(*W.shape[:-1], W.shape[-1] // block * nbytes)

    def dequantize(B: np.ndarray, n: int) -> np.ndarray:
        B = np.ascontiguousarray(B, np.uint8)
        return _dequantize_fields(unpack_blocks(B.reshape(-1, nbytes))).reshape(*B.shape[:-1], n)

    return (quantize if quantize_blocks else None), dequantize


def _float_type(name: str, gguf: str, ggml: int, dtype, kind: int) -> WType:
    dt = np.dtype(dtype)
    return WType(name, gguf, ggml, 1, dt.itemsize, dt, kind, None,
                 lambda W: np.asarray(W, np.float32).astype(dt, copy=False),
                 lambda B, n: np.asarray(B, dt).astype(np.float32, copy=False))


def _block_type(name: str, ggml: int, block: int, nbytes: int, kind: int, activations: str,
                quantize_blocks: Callable | None, unpack_blocks: Callable, scales: tuple[int, ...] = (0,)) -> WType:
    return WType(name, name.upper(), ggml, block, nbytes, np.dtype([(name, f"V{nbytes}")]), kind, activations,
                 *_blockwise(quantize_blocks, unpack_blocks, block, nbytes, scales), unpack_blocks, scales)


WTYPES: dict[str, WType] = {t.name: t for t in (
    #           name       GGUF   ggml  dtype       kind
    _float_type("float32", "F32", 0, np.float32, 0),
    _float_type("float16", "F16", 1, np.float16, 1),
    #           name    ggml  weights bytes  kind  activations  quantize  unpack  float16 scales at
    _block_type("q8_0", 8, QK, 34, 3, "q8_0", _q8_0, _u8_0),
    _block_type("q4_0", 2, QK, 18, 4, "q8_0", _q4_0, _u4_0),
    _block_type("q4_1", 3, QK, 20, 5, "q8_1", _q4_1, _u4_1, (0, 2)),
    _block_type("q5_0", 6, QK, 22, 6, "q8_0", _q5_0, _u5_0),
    _block_type("q5_1", 7, QK, 24, 7, "q8_1", _q5_1, _u5_1, (0, 2)),
    _block_type("q4_k", 12, QK_K, 144, 8, "q8_k", None, _u4_k, (0, 2)),
    _block_type("q5_k", 13, QK_K, 176, 9, "q8_k", None, _u5_k, (0, 2)),
    _block_type("q6_k", 14, QK_K, 210, 10, "q8_k", None, _u6_k, (208,)),
)}


# ---- the lists of types, each derived from the table --------------------------------------------------
def decodable() -> tuple[str, ...]:
    """The types decoding reads, each with its kernel: `--dtype`'s choices."""
    return tuple(n for n, t in WTYPES.items() if t.kind is not None)


def block_types() -> tuple[str, ...]:
    """The block types decoding reads as blocks (a file's matrices kept as they are: import, sample FILE.gguf)."""
    return tuple(n for n, t in WTYPES.items() if t.kind is not None and t.block > 1)


def quantizable() -> tuple[str, ...]:
    """The block types a float model's matrices are quantized to here (QuantizedModel); the K types are not."""
    return tuple(n for n in block_types() if WTYPES[n].quantize is not None)


def from_float() -> tuple[str, ...]:
    """Every type a float model can be put in: export's --dtype, and what an import decodes in by default."""
    return tuple(n for n, t in WTYPES.items() if t.kind is not None and t.quantize is not None)


def of_dtype(dtype: np.dtype) -> WType | None:
    """The type whose arrays have this dtype, or None.  of_dtype(np.dtype([("q4_0", "V18")])).name -> 'q4_0'"""
    return next((t for t in WTYPES.values() if t.dtype == dtype), None)


def of_gguf(name: str) -> WType | None:
    """The type GGUF names `name` ("Q4_0", "F16"), or None."""
    return next((t for t in WTYPES.values() if t.gguf == name), None)


def wtype(name: str) -> WType:
    """The table entry of a weight type by name; UserError for an unknown one."""
    if name not in WTYPES:
        raise UserError(f"unknown weight type {name!r}; one of {', '.join(WTYPES)}")
    return WTYPES[name]


def nonfinite_blocks(B: np.ndarray, name: str) -> int:
    """How many blocks of a block type's stored form B [..., n / block · nbytes] (or its void records) have a
    NaN or Inf float16 scale: their weights would read back NaN or Inf.
    nonfinite_blocks(quantize(np.ones((2, 32)), "q8_0"), "q8_0") -> 0"""
    t = WTYPES[name]
    blocks = np.ascontiguousarray(B).view(np.uint8).reshape(-1, t.nbytes)
    return len(blocks) - int(np.count_nonzero(_scales_finite(blocks, t.scales)))


def quantize(W: np.ndarray, name: str) -> np.ndarray:
    """W float [..., n] in weight type `name` (see the module docstring)."""
    t = wtype(name)
    if t.quantize is None:
        raise UserError(f"cannot quantize to {name}: K-quant blocks are read from GGUF files (llama.cpp makes them "
                        f"with an iterative search this library does not reproduce); one of {', '.join(quantizable())}")
    return t.quantize(W)


def dequantize(B: np.ndarray, name: str, n: int) -> np.ndarray:
    """The stored form B of rows of n weights, as float32 [..., n]."""
    return wtype(name).dequantize(B, n)


def unpack(B: np.ndarray, name: str) -> Fields:
    """The numbers of the blocks of B [..., bytes] of block type `name`, as Fields of its blocks [N, ...] in order.
    unpack(quantize(np.ones((1, 32)), "q4_0"), "q4_0").q -> [[0, 0, ..]] (d = -1/8: w = d·(0 - 8) = 1)"""
    t = WTYPES[name]
    return t.unpack(np.ascontiguousarray(B, np.uint8).reshape(-1, t.nbytes))


# ---- activations, as llama.cpp's x86 quantize_row_q8_0 / q8_1 / q8_K ------------------------------------
def quantize_x8(X: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows X float32 [n, k] (k a multiple of 32) -> (q int8 [n, k], d float32 [n, k/32], s float32 [n, k/32]):
    per block d = max|x| / 127 rounded to float16, q = x · (127 / max|x|) rounded to nearest even, s = Σ q (the
    block sum the minimums and the unsigned weight offsets need). The kernels do the same in numba; this is
    their reference.  x ≈ d·q:  quantize_x8(np.float32([[127] * 32]))[1] -> [[1.0]]"""
    q, unrounded, sums = _x8(X)
    return q, _to_half(unrounded), sums


def _to_half(v: np.ndarray) -> np.ndarray:
    """float32 values rounded to float16 (to nearest even; beyond its range, inf, as llama.cpp's), as float32."""
    return v.astype(np.float16).astype(np.float32)


def _x8(X: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """quantize_x8's q and s, and d before its float16 rounding (max|x| / 127)."""
    n, k = X.shape
    x = np.asarray(X, np.float32).reshape(n, k // QK, QK)
    amax = np.abs(x).max(axis=2)                                   # [n, k/32]
    inv = np.where(amax == 0, np.float32(0), np.float32(127) / np.where(amax == 0, np.float32(1), amax))
    q = np.rint(x * inv[..., None]).astype(np.int8)
    return q.reshape(n, k), amax / np.float32(127), q.sum(axis=2, dtype=np.int32).astype(np.float32)


def quantize_x8_1(X: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows X float32 [n, k] -> Q8_1 (quantize_row_q8_1, for Q4_1 / Q5_1): quantize_x8's q and d, and per block
    s = d·Σq rounded to float16, with d before its own float16 rounding (max|x| / 127): the block sum llama.cpp
    keeps, which the weights' minimums multiply.  quantize_x8_1(np.float32([[127] * 32]))[2] -> [[4064.]]"""
    q, unrounded, sums = _x8(X)
    return q, _to_half(unrounded), _to_half(unrounded * sums)


def quantize_xk(X: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows X float32 [n, k] (k a multiple of 256) -> Q8_K (quantize_row_q8_K_ref): (q int8 [n, k],
    d float32 [n, k/256], bsums float32 [n, k/16]): per block of 256, with `top` its entry of largest |x|
    (signed, the first of ties), iscale = -127 / top and d = 1 / iscale in float32 (not rounded to float16),
    q = min(127, x · iscale rounded to nearest even); bsums: Σ q per 16. An all-zero block: d = 0, q = 0.
        quantize_xk(np.full((1, 256), 2, np.float32))[:2] -> q all -127, d [[-2/127]]"""
    n, k = X.shape
    x = np.asarray(X, np.float32).reshape(n * k // QK_K, QK_K)
    top = _top(x)                                                  # [blocks, 1]
    with np.errstate(divide="ignore"):
        iscale = np.where(top == 0, np.float32(0), np.float32(-127) / top)
        d = np.where(top == 0, np.float32(0), np.float32(1) / iscale)
    q = np.minimum(np.rint(x * iscale), np.float32(127)).astype(np.int8)
    sums = q.reshape(-1, QK_K // 16, 16).sum(axis=2, dtype=np.int32).astype(np.float32)
    return q.reshape(n, k), d.reshape(n, k // QK_K), sums.reshape(n, k // 16)
