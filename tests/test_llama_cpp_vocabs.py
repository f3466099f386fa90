"""llama.cpp's own tokenizer tests on our tokenizers: every vocabulary in llama.cpp's `models/` folder
(`ggml-vocab-*.gguf`), read from its `tokenizer.ggml.*` metadata as `import --from FILE.gguf` reads it.

1. test-tokenizer-0's cases: `ggml-vocab-NAME.gguf.inp` holds texts (separated by a `__ggml_vocab_test__` line),
   `.out` the ids Hugging Face's tokenizer gives each (no bos, special tokens not parsed); ours must equal them
   for every case of every vocabulary (byte-level BPE, SentencePiece BPE, WordPiece, Unigram, Gemma 4's BPE).
2. Random text (mixed scripts, digits, whitespace runs, emoji, control characters, invalid UTF-8) against
   llama.cpp's tokenizer on the same file (llama-cpp-python, `Llama(path, vocab_only=True)`), when installed.

The files come from llama-cpp-python's source distribution (vendor/llama.cpp), found in $LLAMA_CPP_SRC (the
unpacked sdist, or its vendor/llama.cpp), else in .cache/llama-cpp-python (gitignored) where `make llama-src`
(and .ci/run) unpacks it; without them the tests skip, naming that command.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from real_models import llama_cpp_models_dir

SEPARATOR = "\n__ggml_vocab_test__\n"


def vocab_names() -> list[str]:
    folder = llama_cpp_models_dir()
    return sorted(p.name[len("ggml-vocab-"):-len(".gguf")] for p in folder.glob("ggml-vocab-*.gguf")) if folder else []


def need_models() -> Path:
    folder = llama_cpp_models_dir()
    if folder is None:
        pytest.skip("llama.cpp's vocabulary files are not fetched: run `make llama-src` (or set LLAMA_CPP_SRC to an "
                    "unpacked llama-cpp-python source distribution)")
    return folder


def read_cases(path: Path) -> list[tuple[str, list[int]]]:
    """test-tokenizer-0's cases of a vocabulary, read as its read_tests does: the .inp cut at each separator
    (a text may be empty), the .out one line of ids per text."""
    raw = path.with_name(path.name + ".inp").read_bytes().decode("utf-8")
    texts = raw.split(SEPARATOR)
    if raw.endswith(SEPARATOR):
        texts.pop()
    lines = path.with_name(path.name + ".out").read_bytes().decode("utf-8").split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    assert len(texts) == len(lines), path
    return [(t, [int(x) for x in line.split()]) for t, line in zip(texts, lines)]


@pytest.fixture(scope="module", params=vocab_names() or ["(none)"])
def vocab(request):
    """(name, path, our tokenizer of the file)."""
    from nanoeuler.interop.gguf_file import GGUFFile
    from nanoeuler.interop.gguf_import import gguf_tokenizer
    path = need_models() / f"ggml-vocab-{request.param}.gguf"
    meta = GGUFFile(path).meta
    return request.param, path, gguf_tokenizer(meta, len(meta["tokenizer.ggml.tokens"]))


def test_llama_cpp_tokenizer_cases(vocab):
    """Every case of test-tokenizer-0 for each vocabulary."""
    name, path, tok = vocab
    if not path.with_name(path.name + ".inp").is_file():
        pytest.skip(f"llama.cpp has no test cases for {name} (random text covers it)")
    cases = read_cases(path)
    wrong = [(text, tok.encode(text), want) for text, want in cases if tok.encode(text) != want]
    assert not wrong, f"{name}: {len(wrong)} of {len(cases)} cases differ, first {wrong[0]}"


# ------------------------------------------------------------------------------------- random text

FRAGMENTS = [
    "Hello", "world", " the", "THE", "camelCase", "it's", " I'LL", "we'Ve", "don't", "'s", "ſ", "\u212a", "naïve",
    "Straße", "12345", "3.14159", "1,000,000", "٣٤٥", "½", "①", "²", " 7", "x2y33z444",
    " ", "  ", "   ", "\t", "\t\t", "\n", "\n\n", "\r\n", " \n ", "\u00a0", "\u3000", "\u2003", "\u200b", "\u2028",
    "日本語", "中文字符", "ｶﾀｶﾅ", "한국어", "кириллица", "Ελληνικά", "עברית", "العربية", "हिन्दी", "ไทย", "ქართული",
    "😀", "🚀👍🏽", "👩‍💻", "🇫🇷", "❤️", "e\u0301", "\u0915\u094d\u0937",
    "!", "...", "?!", "(a)", "[b]", "{c}", "#@$%", "<=>", "^~|`", "«»", "—", "…", "。", "，", "、", "¿", "\\", "/*",
    "\x00", "\x01", "\x07", "\x1b", "\x1f", "\x7f", "\x85", "\ufeff", "\ufffd", "\ue000",
]
INVALID = [b"\x80", b"\xbf", b"\xc3", b"\xe2", b"\xf0", b"\xff", b"\xfe"]   # each alone: one U+FFFD to llama.cpp


def random_texts(seed: int, n: int) -> list[bytes]:
    """n random byte strings of 1-12 fragments; about one in five holds a byte that is not UTF-8."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        parts = [FRAGMENTS[i].encode() for i in rng.integers(len(FRAGMENTS), size=rng.integers(1, 13))]
        if rng.random() < 0.2:
            parts.insert(int(rng.integers(len(parts) + 1)), INVALID[rng.integers(len(INVALID))])
        out.append(b"".join(parts))
    return out


@pytest.fixture(scope="module")
def llama_cpp_vocab(vocab):
    llama_cpp = pytest.importorskip("llama_cpp")
    name, path, tok = vocab
    return name, tok, llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)


def as_llama_cpp_reads(tok, data: bytes) -> list[int]:
    """Our ids of bytes as llama.cpp reads them. A byte that is not UTF-8 is one U+FFFD to llama.cpp's byte-level
    BPE (unicode_cpts_from_utf8 reads the text as code points), so ours encodes the text decoded that way (our
    encode_bytes keeps the byte instead); the other kinds' encode_bytes treat it as llama.cpp does (SentencePiece
    BPE keeps the byte; WordPiece drops it; Unigram and Gemma 4's BPE read U+FFFD for it)."""
    return tok.encode(data.decode("utf-8", "replace")) if tok.kind == "byte-level" else tok.encode_bytes(data)


def test_random_text_equals_llama_cpp(llama_cpp_vocab):
    """400 random texts per vocabulary: our ids are llama.cpp's (as_llama_cpp_reads)."""
    name, tok, lc = llama_cpp_vocab
    texts = random_texts(seed=sum(map(ord, name)), n=400)
    wrong = []
    for data in texts:
        want = lc.tokenize(data, add_bos=False, special=False)
        got = as_llama_cpp_reads(tok, data)
        if got != want:
            wrong.append((data, got, want))
    assert not wrong, f"{name}: {len(wrong)} of {len(texts)} texts differ, first {wrong[0]}"


def rewrite_with_our_export(path: Path, tok, out: Path) -> None:
    """A vocabulary-only GGUF at out: path's other metadata (llama.cpp reads the hyperparameters even with
    vocab_only) with their value types, and every tokenizer.* field as our GGUF export writes tok
    (gguf_export.add_tokenizer)."""
    import struct

    import gguf

    from nanoeuler.interop.gguf_export import add_tokenizer, pre_of
    from nanoeuler.interop.gguf_file import GGUFFile

    class Typed(GGUFFile):       # keeps each key's value type (and an array's item type)
        def value(self, vtype, key):
            item = struct.unpack_from("<I", self.buf, self.at)[0] if vtype == 9 else None
            self.__dict__.setdefault("types", {})[key] = (vtype, item)
            return super().value(vtype, key)
    f = Typed(path)
    w = gguf.GGUFWriter(str(out), f.meta["general.architecture"])
    for key, value in f.meta.items():
        if not key.startswith("tokenizer.") and key != "general.architecture":
            vtype, item = f.types[key]
            w.add_key_value(key, value, gguf.GGUFValueType(vtype), None if item is None else gguf.GGUFValueType(item))
    add_tokenizer(w, tok, tok.vocab_size, pre_of(tok))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()


def test_our_gguf_export_of_each_vocabulary_reads_back_and_llama_cpp_reads_it_alike(vocab, tmp_path):
    """Each vocabulary written by our GGUF export (gpt2 with its pre-tokenizer name, llama, gemma4 with its merges,
    bert and t5 with their fields): our import of the file gives the same ids on 200 random texts and the same
    bos / eos, and llama.cpp tokenizes our file as it tokenizes its own (when llama-cpp-python is installed)."""
    from nanoeuler.interop.gguf_file import GGUFFile
    from nanoeuler.interop.gguf_import import gguf_tokenizer
    name, path, tok = vocab
    out = tmp_path / "ours.gguf"
    rewrite_with_our_export(path, tok, out)
    meta = GGUFFile(out).meta
    back = gguf_tokenizer(meta, tok.vocab_size)
    assert (type(back), back.bos_id, back.eos_token) == (type(tok), tok.bos_id, tok.eos_token)
    texts = random_texts(seed=7 + sum(map(ord, name)), n=200)
    ids = [as_llama_cpp_reads(tok, data) for data in texts]
    assert [as_llama_cpp_reads(back, data) for data in texts] == ids
    try:
        import llama_cpp
    except ImportError:
        return
    theirs = llama_cpp.Llama(model_path=str(out), vocab_only=True, verbose=False)
    assert [theirs.tokenize(data, add_bos=False, special=False) for data in texts] == ids
    if tok.bos_id is not None:
        assert theirs.tokenize(b"hi", add_bos=True, special=False)[0] == tok.bos_id


def test_every_pre_tokenizer_name_llama_cpp_reads_is_in_our_table():
    """Each tokenizer.ggml.pre name llama_vocab::load accepts (src/llama-vocab.cpp) is a row of PRE_FAMILIES or
    refused with its reason (REFUSED_PRE): none falls through to 'not a pre-tokenizer llama.cpp knows'."""
    import re

    from nanoeuler.interop.pretokenizers import PRE_BY_NAME, REFUSED_PRE
    source = (need_models().parent / "src" / "llama-vocab.cpp").read_text(encoding="utf-8")
    names = set(re.findall(r'tokenizer_pre == "([^"]+)"', source))
    assert len(names) > 60
    assert sorted(names - PRE_BY_NAME.keys() - REFUSED_PRE.keys()) == []
