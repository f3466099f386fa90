"""WordPiece (tokenizer/wordpiece.py): Hugging Face `tokenizers`' ids from a tokenizer.json, llama.cpp's from a GGUF
(test_llama_cpp_vocabs.py runs llama.cpp's own cases and random text on bert-bge), our file format, the refusals."""
from __future__ import annotations

import json

import pytest
from test_llama_cpp_vocabs import random_texts

from nanoeuler.data.corpus import bundled_works
from nanoeuler.errors import UserError
from nanoeuler.interop.hf_tokenizer import from_hf_json
from nanoeuler.tokenizer import Tokenizer
from nanoeuler.tokenizer.wordpiece import WordPieceTokenizer, bert_words, llama_cpp_words, wordpiece

tokenizers = pytest.importorskip("tokenizers")
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


@pytest.fixture(scope="module")
def corpus() -> str:
    return bundled_works()["hamlet"][:60000]


@pytest.fixture(scope="module")
def hf(corpus):
    """A WordPiece trained by `tokenizers` on Hamlet: BertNormalizer, BertPreTokenizer, [CLS] $A [SEP]."""
    from tokenizers import models, normalizers, pre_tokenizers, processors, trainers
    t = tokenizers.Tokenizer(models.WordPiece(unk_token="[UNK]"))
    t.normalizer = normalizers.BertNormalizer(lowercase=True)
    t.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    t.train_from_iterator([corpus], trainers.WordPieceTrainer(vocab_size=800, special_tokens=SPECIALS))
    t.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", t.token_to_id("[CLS]")), ("[SEP]", t.token_to_id("[SEP]"))])
    return t


def texts(corpus: str) -> list[str]:
    lines = [line for line in corpus.splitlines() if line.strip()][:300]
    return lines + [t.decode("utf-8", "replace") for t in random_texts(seed=5, n=300)] + [
        "İstanbul ΑΣ ǅemal", "naïve café Ⓐ x\u20ddy a\u0903b", "[CLS] [sep] [SEP]x", "ab" * 60, "a\x85b\x0bc\x1cd"]


def test_encodes_like_hf_tokenizers(hf, corpus):
    ours = from_hf_json(json.loads(hf.to_str()))
    wrong = [(t, ours.encode(t, allow_special=True), hf.encode(t, add_special_tokens=False).ids)
             for t in texts(corpus)]
    wrong = [w for w in wrong if w[1] != w[2]]
    assert not wrong, f"{len(wrong)} texts differ, first {wrong[0]}"
    text = "To be, or not to be [MASK]"
    assert ours.encode(text, allow_special=True, add_bos=True) == hf.encode(text).ids


def test_bert_processing_frames_like_the_template(hf):
    d = json.loads(hf.to_str())
    cls, sep = hf.token_to_id("[CLS]"), hf.token_to_id("[SEP]")
    d["post_processor"] = {"type": "BertProcessing", "cls": ["[CLS]", cls], "sep": ["[SEP]", sep]}
    ours = from_hf_json(d)
    assert ours.encode("to be", add_bos=True) == [cls, *ours.encode("to be"), sep]
    assert (ours.bos_token, ours.eos_token) == ("[CLS]", "[SEP]")


def test_file_round_trip_and_export(hf, corpus, tmp_path):
    ours = from_hf_json(json.loads(hf.to_str()))
    ours.save(tmp_path / "tokenizer.json")
    back = Tokenizer.load(tmp_path)
    assert isinstance(back, WordPieceTokenizer) and back.fingerprint() == ours.fingerprint()
    again = tokenizers.Tokenizer.from_str(ours.to_hf_json())
    for t in texts(corpus)[::7]:
        assert back.encode(t, allow_special=True) == again.encode(t, add_special_tokens=False).ids
    assert again.encode("to be").ids == ours.encode("to be", add_bos=True)


def test_decode_joins_the_pieces(hf):
    ours = from_hf_json(json.loads(hf.to_str()))
    assert ours.decode(ours.encode("To be, or NOT to be")) == "to be , or not to be"


def test_worked_examples():
    ids = {"▁un": 1, "aff": 2, "able": 3, "a": 4}
    assert wordpiece("unaffable", lambda s: ids.get(s, -1), "▁", "", 8) == [1, 2, 3]
    assert wordpiece("unaffablex", lambda s: ids.get(s, -1), "▁", "", 8) is None
    hf_ids = {"un": 1, "##aff": 2, "##able": 3}
    assert wordpiece("unaffable", lambda s: hf_ids.get(s, -1), "", "##", 8) == [1, 2, 3]
    assert llama_cpp_words("Héllo, 世界!", True, True) == bert_words("Héllo, 世界!", True, True) == \
        ["hello", ",", "世", "界", "!"]
    # where the two rules part: llama.cpp lowercases one to one and drops every mark; Hugging Face only Mn
    assert llama_cpp_words("İ a\u0903b", True, False) == ["i", "a\u0903b"]
    assert bert_words("İ a\u0903b", True, False) == ["i\u0307", "a\u0903b"]
    assert llama_cpp_words("a\u0903b 가", True, True) == ["ab", "ᄀ"]
    assert bert_words("a\u0903b 가", True, True) == ["a\u0903b", "\u1100\u1161"]


def test_a_word_longer_than_the_bound_is_unknown(hf):
    d = json.loads(hf.to_str())
    d["model"]["max_input_chars_per_word"] = 5
    ours = from_hf_json(d)
    assert ours.encode("to bethere") == ours.encode("to") + [hf.token_to_id("[UNK]")]


@pytest.mark.parametrize("change, message", [
    (lambda d: d.update(normalizer=None), "BertNormalizer only"),
    (lambda d: d.update(pre_tokenizer={"type": "Whitespace"}), "BertPreTokenizer only"),
    (lambda d: d["model"].update(unk_token="<unk>"), "unk_token"),
    (lambda d: d["model"].update(max_input_chars_per_word=0), "max_input_chars_per_word"),
    (lambda d: d["normalizer"].update(lowercase="false"), "true or false"),
    (lambda d: d["added_tokens"][0].update(lstrip=True), "lstrip"),
    (lambda d: d.update(post_processor={"type": "ByteLevel"}), "not supported for WordPiece"),
])
def test_unsupported_hf_files_are_one_line(hf, change, message):
    d = json.loads(hf.to_str())
    change(d)
    with pytest.raises(UserError, match=message) as e:
        from_hf_json(d)
    assert "\n" not in str(e.value)


def test_the_llama_cpp_form_is_not_exported(hf):
    ours = from_hf_json(json.loads(hf.to_str()))
    gguf_like = WordPieceTokenizer(["[UNK]", "▁to", "be"], [2, 1, 1], "[UNK]")
    assert gguf_like.encode("tobe to") == [1, 2, 1]
    with pytest.raises(UserError, match="cannot export"):
        gguf_like.to_hf_json()
    assert json.loads(ours.to_hf_json())["model"]["type"] == "WordPiece"


def test_the_hf_form_is_not_exported_to_gguf(hf):
    """llama.cpp's bert normalizes otherwise than BertNormalizer: a GGUF export of the Hugging Face form is refused in
    one line (the llama.cpp form's export: test_llama_cpp_vocabs.py, read back by llama.cpp)."""
    gguf = pytest.importorskip("gguf")
    from nanoeuler.interop.gguf_export import add_vocabulary
    ours = from_hf_json(json.loads(hf.to_str()))
    with pytest.raises(UserError, match="cannot export to GGUF: this wordpiece tokenizer normalizes text as Hugging"):
        add_vocabulary(gguf.GGUFWriter(None, "llama"), ours, ours.vocab_size, None)
