"""Read a GGUF file's metadata and tensor table straight from the memory-mapped bytes, in bounded time.

The `gguf` package's `GGUFReader` builds several numpy objects per array element when it opens a file:
a 262,144-token vocabulary (three arrays of that length) takes it many seconds (docs/benchmarks.md).
Here each array is one slice of the file: numbers are `np.frombuffer` views, and a string array is walked
once by a compiled loop (each string is a uint64 length, then its bytes) and decoded in one pass, so a
vocabulary costs a few tens of milliseconds. Layout (little-endian; versions 2 and 3):

    "GGUF" u32 version  u64 n_tensors  u64 n_kv
    n_kv x      (string key, u32 value type, value)       value: scalar, string, or array (u32 type, u64 n, items)
    n_tensors x (string name, u32 n_dims, u64 dims[n_dims], u32 ggml type, u64 offset)
    padding to `general.alignment` (32), then the tensor data (offsets relative to there)

    f = GGUFFile(path)
    f.meta["tokenizer.ggml.tokens"][:3]       # -> ['<pad>', '<eos>', '<bos>'] (str; bytes that are not UTF-8
                                              #    kept through surrogateescape)
    f.tensors[0].name, f.tensors[0].shape     # 'token_embd.weight', array([640, 262144]) (GGUF order: ne0 first)
    f.alignment, f.data_offset                # 32, where the tensor data begins (data_offset: absolute, in bytes)

`tensors` hold what `gguf.GGUFReader.tensors` hold (name, tensor_type, shape, n_elements, n_bytes, data_offset,
data: a read-only view of the file, rows of bytes for block types), so `gguf.quants.dequantize(t.data,
t.tensor_type)` reads them. Every defect (bad magic, a count or length past the end of the file, an unknown
type, a tensor whose data lies outside the file) is a one-line UserError; an array longer than MAX_ARRAY
entries, or a tokenizer array (tokenizer.ggml.*) longer than config.LIMITS["vocab_size"], is refused before
it is read.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from numba import njit

from ..config import LIMITS
from ..errors import UserError
from ..numba_cache import install

install()

MAX_ARRAY = 1 << 24           # entries in one metadata array (a vocabulary is capped lower by its reader)
MAX_STRING = 1 << 26          # bytes in one metadata string (a chat template is a few KB)
# GGUF value types: (struct format, numpy dtype) of the scalars
SCALARS = {0: ("<B", np.uint8), 1: ("<b", np.int8), 2: ("<H", np.uint16), 3: ("<h", np.int16), 4: ("<I", np.uint32),
           5: ("<i", np.int32), 6: ("<f", np.float32), 7: ("<?", np.bool_), 10: ("<Q", np.uint64),
           11: ("<q", np.int64), 12: ("<d", np.float64)}
STRING, ARRAY = 8, 9


@dataclass
class TensorInfo:
    """One entry of the tensor table (the fields of gguf.ReaderTensor that readers use)."""
    name: str
    tensor_type: object        # gguf.GGMLQuantizationType
    shape: np.ndarray          # GGUF order: ne0 (the row length) first
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray


@njit(cache=True)
def string_spans(buf, at, count, limit):
    """Walk `count` GGUF strings starting at byte `at` of buf: -> (starts, lengths, end), or end = -1 when a
    length runs past `limit`.  Two strings b"ab", b"c": [2,0,0,0,0,0,0,0,a,b,1,0,0,0,0,0,0,0,c] -> ([8, 18], [2, 1], 19)"""
    starts = np.empty(count, np.int64)
    lengths = np.empty(count, np.int64)
    for i in range(count):
        if at + 8 > limit:
            return starts, lengths, -1
        n = np.int64(0)
        for j in range(7, -1, -1):
            n = (n << 8) | np.int64(buf[at + j])
        if n < 0 or n > limit - at - 8:
            return starts, lengths, -1
        starts[i] = at + 8
        lengths[i] = n
        at += 8 + n
    return starts, lengths, at


def decode_all(buf, starts: np.ndarray, lengths: np.ndarray) -> list[str]:
    """The strings buf[starts[i] : starts[i] + lengths[i]] as str. Their bytes are joined and decoded at once,
    then cut at character offsets (in UTF-8 a character starts at every byte that is not 10xxxxxx); bytes
    that are not UTF-8 make it decode each string alone, with surrogateescape.
    decode_all(b"..ab..\\xc3\\xa9", [2, 6], [2, 2]) -> ['ab', 'é']"""
    ends = np.cumsum(lengths)
    # [total]: the file offset of each byte of the joined strings
    offsets = np.repeat(starts - (ends - lengths), lengths) + np.arange(int(ends[-1]) if len(ends) else 0)
    joined = np.asarray(buf)[offsets]
    try:
        text = joined.tobytes().decode("utf-8")
    except UnicodeDecodeError:
        blob, stops = joined.tobytes(), ends.tolist()
        return [blob[s:e].decode("utf-8", "surrogateescape") for s, e in zip([0, *stops[:-1]], stops)]
    # [total + 1]: the characters before each byte offset of the joined strings
    chars_before = np.concatenate([[0], np.cumsum((joined & 0xC0) != 0x80)])
    cuts = chars_before[ends].tolist()
    return [text[a:b] for a, b in zip([0, *cuts[:-1]], cuts)]


class GGUFFile:
    """The parsed header of a GGUF file: `meta` (key -> Python value; arrays as lists) and `tensors`."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise UserError(f"{self.path} is not a file")
        try:
            self.buf = np.memmap(self.path, np.uint8, mode="r")
        except (OSError, ValueError) as e:     # an empty file cannot be mapped
            raise UserError(f"{self.path} is not a readable GGUF file ({e})") from None
        self.at = 4
        if bytes(self.buf[:4]) != b"GGUF":
            raise self.bad("it does not start with the GGUF magic")
        version = self.scalar(4)
        if version not in (2, 3):
            raise self.bad(f"GGUF version {version} is not supported (2 or 3)")
        n_tensors, n_kv = self.scalar(10), self.scalar(10)
        if n_kv > len(self.buf) // 13 or n_tensors > len(self.buf) // 24:   # the smallest entries take 13 / 24 bytes
            raise self.bad(f"it claims {n_kv} metadata entries and {n_tensors} tensors, more than its size holds")
        self.meta = {}
        for _ in range(n_kv):
            key = self.string()
            if key in self.meta:
                raise self.bad(f"metadata key {key!r:.60} appears twice")
            self.meta[key] = self.value(self.scalar(4), key)
        self.tensors = self.tensor_table(n_tensors)

    # -- primitives ------------------------------------------------------------------------------------
    def bad(self, why: str) -> UserError:
        return UserError(f"{self.path} is not a readable GGUF file: {why}")

    def take(self, n: int) -> int:
        """Advance past n bytes; their offset."""
        at = self.at
        if n < 0 or at + n > len(self.buf):
            raise self.bad(f"it ends inside a field at byte {at}")
        self.at = at + n
        return at

    def scalar(self, vtype: int):
        fmt, dtype = SCALARS[vtype]
        at = self.take(np.dtype(dtype).itemsize)
        value = struct.unpack_from(fmt, self.buf, at)[0]
        return float(value) if vtype in (6, 12) else value

    def string(self) -> str:
        n = self.scalar(10)
        if n > MAX_STRING:
            raise self.bad(f"a string of {n} bytes at byte {self.at}")
        at = self.take(n)
        return bytes(self.buf[at:at + n]).decode("utf-8", "surrogateescape")

    def value(self, vtype: int, key: str):
        if vtype in SCALARS:
            return self.scalar(vtype)
        if vtype == STRING:
            return self.string()
        if vtype != ARRAY:
            raise self.bad(f"metadata {key!r:.60} has the unknown value type {vtype}")
        etype, n = self.scalar(4), self.scalar(10)
        limit = LIMITS["vocab_size"] if key.startswith("tokenizer.ggml.") else MAX_ARRAY
        if n > limit:
            what = "a vocabulary may have" if limit != MAX_ARRAY else "are read"
            raise UserError(f"{self.path}: metadata {key} has {n:,} entries; at most {limit:,} {what}")
        if etype in SCALARS:
            dtype = np.dtype(SCALARS[etype][1]).newbyteorder("<")
            at = self.take(n * dtype.itemsize)
            return np.frombuffer(self.buf, dtype, n, at).tolist()
        if etype == STRING:
            return self.strings(n, key)
        raise self.bad(f"metadata {key!r:.60} is an array of type {etype} (arrays of arrays are not read)")

    def strings(self, n: int, key: str) -> list[str]:
        """n strings from here (see string_spans), decoded (surrogateescape: any bytes survive)."""
        starts, lengths, end = string_spans(self.buf, self.at, n, len(self.buf))
        if end < 0:
            raise self.bad(f"metadata {key!r:.60}: its strings run past the end of the file")
        self.at = end
        return decode_all(self.buf, starts, lengths)

    # -- tensors --------------------------------------------------------------------------------------
    def tensor_table(self, n: int) -> list[TensorInfo]:
        """The tensor infos, their data as views of the file (each checked to lie inside it)."""
        try:
            from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
        except ImportError:
            raise UserError("GGUF import needs the gguf package: pip install 'nanoeuler[interop]'") from None
        raw = []
        for _ in range(n):
            name = self.string()
            n_dims = self.scalar(4)
            if not 1 <= n_dims <= 4:
                raise self.bad(f"tensor {name!r:.60} has {n_dims} dimensions")
            dims = np.array([self.scalar(10) for _ in range(n_dims)], np.int64)
            raw.append((name, dims, self.scalar(4), self.scalar(10)))
        align = self.meta.get("general.alignment", 32)
        if not isinstance(align, int) or isinstance(align, bool) or align < 1 or align & (align - 1):
            raise self.bad(f"general.alignment {align!r:.40} is not a power of two")
        start = -(-self.at // align) * align
        self.alignment, self.data_offset = align, start   # (as GGUFReader names them)
        tensors, names = [], set()
        for name, dims, code, offset in raw:
            if name in names:
                raise self.bad(f"tensor {name!r:.60} appears twice")
            names.add(name)
            try:
                qtype = GGMLQuantizationType(code)
                block, size = GGML_QUANT_SIZES[qtype]
            except (ValueError, KeyError):
                raise self.bad(f"tensor {name!r:.60} has the unknown type {code}") from None
            if (dims < 1).any() or int(np.prod(dims.astype(float))) > len(self.buf) * block or dims[0] % block:
                raise self.bad(f"tensor {name!r:.60} has the impossible shape {dims.tolist()} for {qtype.name}")
            n_elements = int(np.prod(dims))
            n_bytes = n_elements // block * size
            at = start + offset
            if at + n_bytes > len(self.buf):
                raise self.bad(f"tensor {name!r:.60}'s data lies past the end of the file")
            tensors.append(TensorInfo(name, qtype, dims, n_elements, n_bytes, at, self.tensor_data(qtype, dims, at)))
        return tensors

    def tensor_data(self, qtype, dims: np.ndarray, at: int) -> np.ndarray:
        """A view of the data as GGUFReader gives it: the numbers for F32/F16/F64/I*, else rows of bytes."""
        from gguf import GGML_QUANT_SIZES
        plain = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                 "I32": np.int32, "I64": np.int64}
        shape = tuple(reversed(dims.tolist()))
        if qtype.name in plain:
            dtype = np.dtype(plain[qtype.name]).newbyteorder("<")
            return np.frombuffer(self.buf, dtype, int(np.prod(dims)), at).reshape(shape)
        block, size = GGML_QUANT_SIZES[qtype]
        shape = (*shape[:-1], shape[-1] // block * size)
        return np.frombuffer(self.buf, np.uint8, int(np.prod(shape)), at).reshape(shape)
