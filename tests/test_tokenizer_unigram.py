"""Unigram (tokenizer/unigram.py, charsmap.py): Hugging Face `tokenizers`' ids from a tokenizer.json, llama.cpp's
normalization and cut on its GGUF vocabulary (test_llama_cpp_vocabs.py compares nomic-bert-moe with llama.cpp
itself), our file format, the refusals."""
from __future__ import annotations

import json

import numpy as np
import pytest
from test_llama_cpp_vocabs import random_texts

from nanoeuler.data.corpus import bundled_works
from nanoeuler.errors import UserError
from nanoeuler.interop.hf_tokenizer import from_hf_json
from nanoeuler.tokenizer import Tokenizer
from nanoeuler.tokenizer.charsmap import Charsmap
from nanoeuler.tokenizer.sentencepiece import BYTE_PIECES, utf8_length
from nanoeuler.tokenizer.unigram import UnigramTokenizer, merge_spaces_of, viterbi

tokenizers = pytest.importorskip("tokenizers")
SPECIALS = ["<pad>", "</s>", "<unk>"]


@pytest.fixture(scope="module")
def corpus() -> str:
    return bundled_works()["hamlet"][:60000]


@pytest.fixture(scope="module")
def hf(corpus):
    """A Unigram trained by `tokenizers` on Hamlet: NFKC, Metaspace, $A </s>."""
    from tokenizers import models, normalizers, pre_tokenizers, processors, trainers
    t = tokenizers.Tokenizer(models.Unigram())
    t.normalizer = normalizers.NFKC()
    t.pre_tokenizer = pre_tokenizers.Metaspace()
    t.train_from_iterator([corpus], trainers.UnigramTrainer(vocab_size=600, special_tokens=SPECIALS,
                                                             unk_token="<unk>"))
    t.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", t.token_to_id("</s>"))])
    return t


def texts(corpus: str) -> list[str]:
    lines = [line for line in corpus.splitlines() if line.strip()][:300]
    return lines + [t.decode("utf-8", "replace") for t in random_texts(seed=7, n=300)] + [
        "  to   be  ", "ｔｏ ｂｅ ①", "</s>x<unk>", "qqqzzz xq", "ab" * 60, ""]


@pytest.mark.parametrize("split", [True, False])
def test_encodes_like_hf_tokenizers(hf, corpus, split):
    d = json.loads(hf.to_str())
    d["pre_tokenizer"]["split"] = split
    theirs = tokenizers.Tokenizer.from_str(json.dumps(d))
    ours = from_hf_json(d)
    wrong = [(t, ours.encode(t, allow_special=True), theirs.encode(t, add_special_tokens=False).ids)
             for t in texts(corpus)]
    wrong = [w for w in wrong if w[1] != w[2]]
    assert not wrong, f"{len(wrong)} texts differ, first {wrong[0]}"
    assert ours.encode("To be", add_bos=True) == theirs.encode("To be").ids


def test_byte_fallback_spells_unknowns_in_bytes_like_hf(hf, corpus):
    d = json.loads(hf.to_str())
    d["model"]["vocab"] += [[b, -20.0] for b in BYTE_PIECES]
    d["model"]["byte_fallback"] = True
    theirs = tokenizers.Tokenizer.from_str(json.dumps(d))
    ours = from_hf_json(d)
    for t in texts(corpus)[300:]:
        assert ours.encode(t, allow_special=True) == theirs.encode(t, add_special_tokens=False).ids, t
    ids = ours.encode("to be 日本")
    assert ours.decode(ids) == "to be 日本" and "<0xE6>" in [ours.tokens[i] for i in ids]


def test_file_round_trip_and_export(hf, corpus, tmp_path):
    ours = from_hf_json(json.loads(hf.to_str()))
    ours.save(tmp_path / "tokenizer.json")
    back = Tokenizer.load(tmp_path)
    assert isinstance(back, UnigramTokenizer) and back.fingerprint() == ours.fingerprint()
    again = tokenizers.Tokenizer.from_str(ours.to_hf_json())
    for t in texts(corpus)[::5]:
        assert back.encode(t, allow_special=True) == again.encode(t, add_special_tokens=False).ids, t
        assert back.decode(back.encode(t)) == again.decode(again.encode(t, add_special_tokens=False).ids,
                                                           skip_special_tokens=False)


def test_worked_examples():
    ids = {"▁": 0, "▁a": 1, "b": 2, "▁ab": 3}
    find = lambda p: ids.get(p, -1)                                       # noqa: E731
    assert viterbi("▁ab", find, [-1, -2, -3, -6], 3, -13) == [(0, 2, 1), (2, 3, 2)]
    assert viterbi("▁ab", find, [-1, -2, -3, -4], 3, -13) == [(0, 3, 3)]
    assert viterbi("▁xyb", find, [-1, -2, -3, -4], 3, -13) == [(0, 1, 0), (1, 3, -1), (3, 4, 2)]   # x y fused
    assert viterbi("ab", lambda p: {"a": 0, "b": 1, "ab": 2}.get(p, -1), [-1, -1, -2], 2, -9) == [(0, 2, 2)]  # a tie
    assert merge_spaces_of(b"  a  b ", False, True) == "▁a▁b".encode()
    assert merge_spaces_of(b" a b", True, False) == "▁▁a▁b".encode()
    assert merge_spaces_of(b" a b", False, False) == "▁a▁b".encode()
    assert (utf8_length(b"\xc3\xa9", 0), utf8_length(b"\xc3a", 0), utf8_length(b"\xed\xa0\x80", 0)) == (2, 0, 3)


def tiny_charsmap(rules: dict[bytes, bytes]) -> bytes:
    """A precompiled charsmap of rules, laid out as SentencePiece's (charsmap.py): a node at index i with offset
    o stores BASE = i ^ o; its child by byte c is at o ^ c, labelled c; a node that ends a source has LEAF set
    and its replacement's offset at o (bit 31 set, so that it never reads as a child)."""
    units, replacements, offsets, used = {0: 0}, b"", {}, set()
    for src, dst in rules.items():
        offsets[src] = len(replacements)
        replacements += dst + b"\0"
    children: dict[bytes, set[int]] = {}
    for src in rules:
        for k in range(len(src)):
            children.setdefault(src[:k], set()).add(src[k])

    def place(prefix: bytes, at: int) -> None:
        kids, leaf = sorted(children.get(prefix, ())), prefix in rules
        o = next(o for o in range(1, 1 << 12) if o not in used and all(o ^ c not in units for c in kids)
                 and not (leaf and o in units))
        used.add(o)                      # each node its own offset, else one node's children are another's
        units[at] |= ((at ^ o) << 10) | (1 << 8 if leaf else 0)
        if leaf:
            units[o] = (1 << 31) | offsets[prefix]
        for c in kids:
            units[o ^ c] = c
        for c in kids:
            place(prefix + bytes([c]), o ^ c)
    place(b"", 0)
    arr = np.zeros(1 << 12, "<u4")           # room for any child index, as SentencePiece pads its blocks of 256
    for i, u in units.items():
        arr[i] = u
    return len(arr.tobytes()).to_bytes(4, "little") + arr.tobytes() + replacements


def test_charsmap_longest_match_and_damage():
    cm = Charsmap(tiny_charsmap({b"A": b"a", b"AB": b"x", b"\t": b" "}))
    assert cm.longest_match(b"ABC", 0) == (2, b"x")
    assert cm.longest_match(b"AC", 0) == (1, b"a")
    assert cm.longest_match(b"C", 0) is None and cm.longest_match(b"B", 0) is None
    assert cm.by_graphemes("ABC\t") == "aBC "         # Hugging Face: grapheme by grapheme, so AB is never seen
    assert Charsmap(tiny_charsmap({b"e": b"E"})).by_graphemes("e\u0301x") == "Ex"   # a grapheme replaced whole
    for bad in (b"\1\0", b"\x10\0\0\0" + b"\0" * 8, b"\x04\0\0\0\xff\xff\xff\xff"):
        with pytest.raises(UserError):
            Charsmap(bad).longest_match(b"A", 0)


def test_llama_cpp_normalization_with_a_charsmap():
    pieces = ["<unk>", "<s>", "</s>", "▁", "▁a", "x", "▁x", "b", "<b>"]
    tok = UnigramTokenizer(pieces, [2, 3, 3, 1, 1, 1, 1, 1, 4], [0, 0, 0, -1, -2, -3, -2, -3, 0], "<unk>",
                           charsmap=tiny_charsmap({b"A": b"a", b"AB": b"x", b"\t": b" "}), bos="<s>", eos="</s>",
                           add_eos=True)
    assert tok.normalize_llama_cpp(b"  A\tAB  \xff") == "▁a▁x▁\ufffd".encode()
    assert tok.encode("A\tAB z", add_bos=True) == [1, 4, 6, 3, 0, 2]
    assert tok.encode("<b>ab") == [8, 4, 7] and tok.encode("</s>", allow_special=True) == [2]
    assert tok.decode(tok.encode("A AB b")) == "a x b"


@pytest.mark.parametrize("change, message", [
    (lambda d: d.update(normalizer={"type": "Lowercase"}), "Lowercase is not supported for Unigram"),
    (lambda d: d.update(normalizer={"type": "Precompiled", "precompiled_charsmap": "%%"}), "base64"),
    (lambda d: d.update(normalizer={"type": "Sequence", "normalizers": [
        {"type": "Replace", "pattern": {"Regex": " {2,}"}, "content": " "}]}), "before a WhitespaceSplit"),
    (lambda d: d.update(pre_tokenizer={"type": "Sequence", "pretokenizers": [
        {"type": "WhitespaceSplit"}, {"type": "Metaspace", "prepend_scheme": "first"}]}), "after a WhitespaceSplit"),
    (lambda d: d.update(pre_tokenizer={"type": "Whitespace"}), "Metaspace"),
    (lambda d: d["model"].update(unk_id=10 ** 6), "unk_id"),
    (lambda d: d["model"].update(vocab=[["a", "x"]]), "pairs"),
    (lambda d: d["model"].update(byte_fallback="true"), "true or false"),
    (lambda d: d["pre_tokenizer"].update(prepend_scheme="sometimes"), "prepend_scheme"),
])
def test_unsupported_hf_files_are_one_line(hf, change, message):
    d = json.loads(hf.to_str())
    change(d)
    with pytest.raises(UserError, match=message) as e:
        from_hf_json(d)
    assert "\n" not in str(e.value)


def test_the_llama_cpp_form_is_not_exported():
    tok = UnigramTokenizer(["<unk>", "▁a"], [2, 1], [0, -1], "<unk>")
    assert tok.encode(" a  a") == [1, 1]
    with pytest.raises(UserError, match="cannot export"):
        tok.to_hf_json()


def test_the_hf_form_is_not_exported_to_gguf(hf):
    """llama.cpp's t5 normalizes otherwise (its charsmap by longest match, its own whitespace rules): a GGUF export of
    the Hugging Face form is refused in one line (the llama.cpp form's: test_llama_cpp_vocabs.py)."""
    gguf = pytest.importorskip("gguf")
    from nanoeuler.interop.gguf_export import add_vocabulary
    ours = from_hf_json(json.loads(hf.to_str()))
    with pytest.raises(UserError, match="cannot export to GGUF: this unigram tokenizer normalizes text as Hugging"):
        add_vocabulary(gguf.GGUFWriter(None, "llama"), ours, ours.vocab_size, None)


def test_compiled_cut_equals_the_readable_viterbi(hf, corpus):
    """encode (unigram_fast's byte Viterbi) == encode_reference (the readable one on characters), both rules, on
    a vocabulary with tied scores (the first cut found must win in both)."""
    rng = np.random.default_rng(0)
    d = json.loads(hf.to_str())
    d["model"]["vocab"] = [[p, float(np.round(s)) if rng.random() < 0.5 else s] for p, s in d["model"]["vocab"]]
    ours = from_hf_json(d)
    gguf_like = UnigramTokenizer(ours.tokens, np.where(ours.types == 3, 3, 1), ours.scores, ours.unk,
                                 charsmap=tiny_charsmap({b"A": b"a", b"\t": b" ", b"\xef\xbd\x94": b"t"}))
    for tok in (ours, gguf_like):
        for t in texts(corpus)[::3]:
            assert tok.encode(t) == tok.encode_reference(t), (tok.normalization, t)


def test_a_real_vocabulary_with_its_charsmap_encodes_like_hf_tokenizers():
    """nomic-embed's (XLM-R's) 250,048 pieces and precompiled charsmap, laid out as XLM-R's tokenizer.json
    (Precompiled + Replace " {2,}", WhitespaceSplit + Metaspace): ids equal tokenizers' on random text, where
    Hugging Face's grapheme-wise charsmap differs from llama.cpp's longest match."""
    from real_models import llama_cpp_models_dir

    from nanoeuler.interop.gguf_file import GGUFFile
    from test_llama_cpp_vocabs import FRAGMENTS
    folder = llama_cpp_models_dir()
    if folder is None:
        pytest.skip("llama.cpp's vocabulary files are not fetched: run `make llama-src`")
    from tokenizers import Regex, models, normalizers, pre_tokenizers
    meta = GGUFFile(folder / "ggml-vocab-nomic-bert-moe.gguf").meta
    pieces = list(zip(meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.scores"]))
    theirs = tokenizers.Tokenizer(models.Unigram(pieces, unk_id=3))
    charsmap = np.array(meta["tokenizer.ggml.precompiled_charsmap"]).astype(np.uint8).tobytes()
    theirs.normalizer = normalizers.Sequence([normalizers.Precompiled(charsmap),
                                              normalizers.Replace(Regex(" {2,}"), " ")])
    theirs.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Metaspace()])
    theirs.add_special_tokens(["<s>", "<pad>", "</s>", "<unk>"])
    ours = from_hf_json(json.loads(theirs.to_str()))
    cases = [t.decode("utf-8", "replace") for t in random_texts(seed=9, n=300)] + FRAGMENTS + [
        "Ａ\u0301 ﬁ\u0301 e\u0301  x\t\ty", "①②③ ＨＥＬＬＯ"]
    wrong = [(t, ours.encode(t, allow_special=True), theirs.encode(t, add_special_tokens=False).ids) for t in cases]
    wrong = [w for w in wrong if w[1] != w[2]]
    assert not wrong, f"{len(wrong)} texts differ, first {wrong[0]}"
