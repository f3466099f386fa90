"""The GGUF header reader (interop/gguf_file.py): the same metadata and tensors as the gguf package's
GGUFReader, vocabularies in bounded time, the absurd refused before it is read (fuzzed files: in
test_gguf_import.py)."""
from __future__ import annotations

import struct
import time

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf_fixtures import chatml_model, chatml_tokenizer, write_gguf  # noqa: E402
from real_models import real_model  # noqa: E402

from nanoeuler.errors import UserError  # noqa: E402
from nanoeuler.interop.gguf_file import GGUFFile, decode_all  # noqa: E402


def same_as_gguf_reader(path):
    ours, theirs = GGUFFile(path), gguf.GGUFReader(str(path))
    assert ours.meta == {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert len(ours.tensors) == len(theirs.tensors)
    for a, b in zip(ours.tensors, theirs.tensors):
        assert (a.name, a.tensor_type, a.shape.tolist(), a.n_bytes, a.data_offset) == \
               (b.name, b.tensor_type, b.shape.tolist(), b.n_bytes, b.data_offset)
        assert a.data.dtype == b.data.dtype and np.array_equal(a.data, b.data)


@pytest.mark.parametrize("qtype", ["F32", "F16", "Q8_0", "Q4_1"])
def test_reads_what_gguf_reader_reads(tmp_path, qtype):
    tok = chatml_tokenizer()
    same_as_gguf_reader(write_gguf(tmp_path / "m.gguf", chatml_model(tok), tok, qtype))


@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_reads_the_real_files_as_gguf_reader(name):
    same_as_gguf_reader(real_model(name))


def test_decode_all_cuts_strings_at_their_bytes():
    buf = np.frombuffer(b"..ab..\xc3\xa9\xff", np.uint8)
    assert decode_all(buf, np.array([2, 2, 6]), np.array([2, 0, 2])) == ["ab", "", "é"]
    assert decode_all(buf, np.array([2, 8]), np.array([2, 1])) == ["ab", "\udcff"]   # not UTF-8: kept


def header(kv: list[tuple[str, int, bytes]], n_tensors: int = 0) -> bytes:
    """A GGUF v3 header with these (key, value type, encoded value) entries."""
    out = b"GGUF" + struct.pack("<IQQ", 3, n_tensors, len(kv))
    for key, vtype, value in kv:
        out += struct.pack("<Q", len(key)) + key.encode() + struct.pack("<I", vtype) + value
    return out


def strings(items: list[bytes]) -> bytes:
    """A GGUF string array's value (type 9, element type 8)."""
    lengths = np.array([len(s) for s in items], "<u8")
    parts = np.empty(2 * len(items), object)
    parts[0::2], parts[1::2] = [x.tobytes() for x in lengths], items
    return struct.pack("<IQ", 8, len(items)) + b"".join(parts)


def test_an_absurd_vocabulary_is_refused_before_it_is_read(tmp_path):
    """2,000,000 tokens declared (the file holds none of them): one line at once, naming the count."""
    path = tmp_path / "v.gguf"
    path.write_bytes(header([("tokenizer.ggml.tokens", 9, struct.pack("<IQ", 8, 2_000_000))]))
    with pytest.raises(UserError, match="tokenizer.ggml.tokens has 2,000,000 entries; at most 1,048,576"):
        GGUFFile(path)


def test_a_large_vocabulary_reads_in_bounded_time(tmp_path):
    """500,000 strings (what takes gguf's reader minutes at 2,000,000): a compiled walk and one decode."""
    items = [f"tok{i}\u2581é".encode() for i in range(500_000)]
    path = tmp_path / "big.gguf"
    path.write_bytes(header([("tokenizer.ggml.tokens", 9, strings(items)), ("x", 8, struct.pack("<Q", 1) + b"y")]))
    GGUFFile(path)                                          # compiles / loads the walk
    t0 = time.perf_counter()
    f = GGUFFile(path)
    assert time.perf_counter() - t0 < 20                    # ~0.3 s on a quiet core; a loose bound for busy CI
    assert f.meta["tokenizer.ggml.tokens"][123_456] == "tok123456▁é" and f.meta["x"] == "y"


@pytest.mark.parametrize("value, why", [
    (struct.pack("<IQ", 8, 3) + struct.pack("<Q", 2**40) + b"ab", "run past the end"),
    (struct.pack("<IQ", 8, 3) + struct.pack("<Q", 1) + b"a", "run past the end"),
    (struct.pack("<IQ", 99, 1), "array of type 99"),
])
def test_a_broken_array_is_one_line(tmp_path, value, why):
    path = tmp_path / "b.gguf"
    path.write_bytes(header([("tokenizer.ggml.tokens", 9, value)]))
    with pytest.raises(UserError, match=why) as e:
        GGUFFile(path)
    assert "\n" not in str(e.value)
