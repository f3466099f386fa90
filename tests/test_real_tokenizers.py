"""The tokenizers of the real files against llama.cpp reading the same file: SmolLM2-135M-Instruct (byte-level
BPE, `smollm` split, a vocabulary without 21 of the 256 byte tokens) and Gemma 3 270M (SentencePiece-style
BPE, 262,144 tokens with scores, byte fallback, user-defined whitespace runs and HTML tags). Skipped without
the files (`make models`) or llama_cpp."""
from __future__ import annotations

import pytest

pytest.importorskip("llama_cpp")
pytest.importorskip("gguf")
from real_models import real_model  # noqa: E402
from test_gguf_llama_cpp import detokenize  # noqa: E402

from nanoeuler.interop.gguf_file import GGUFFile  # noqa: E402
from nanoeuler.interop.gguf_import import gguf_tokenizer  # noqa: E402

TEXTS = [
    "Hello, world!", "The year 1999 had 365 days; π ≈ 3.14159 and 1,000,000 > 999,999.",
    "def f(x):\n    return x ** 2  # square\n\n\nclass A:\n\tpass\n", "for (int i = 0; i < n; ++i) { a[i] += b[i]; }",
    "日本語のテキストと中文文本，还有한국어。", "Ελληνικά кириллица עברית العربية हिन्दी ไทย",
    "emoji 🚀👍🏽 👩‍💻 🇫🇷 and ❤️", "control \x00\x01\x04\x06\x13\x14\x16\x1d\x7f characters",
    "whitespace   runs\t\t\ttabs\n\n\n\nnewlines \r\n\r\n CRLF", "   leading and trailing   ",
    "\u00a0no-break\u2003em\u3000ideographic\u200bzero-width", "don't I'll WE'RE they'd it's",
    "<|im_start|>user\nName three colors.<|im_end|>\n<|im_start|>assistant\n",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n", "<bos><eos><pad><unk> <mask>",
    "<table><tr><td>cell</td></tr></table> <b>bold</b>", "\ufffd replacement \ufeff BOM",
    "x\u2581y ▁ a literal SentencePiece space", "<0x41> is not a byte here", "a" * 300, "",
    "ÿþýüû and bytes SmolLM2 lacks: \x04\x06", "Mixed: 123abc456DEF789 ghi_jkl-mno.pqr",
]


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def pair(request):
    """(name, llama.cpp's vocabulary of the file, ours from its metadata)."""
    import llama_cpp
    path = real_model(request.param)
    lc = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    return request.param, lc, gguf_tokenizer(GGUFFile(path).meta, lc.n_vocab())


@pytest.mark.parametrize("special", [False, True])
@pytest.mark.parametrize("add_bos", [False, True])
def test_tokenization_equals_llama_cpp(pair, special, add_bos):
    name, lc, tok = pair
    assert len(TEXTS) >= 20
    for text in TEXTS:
        want = lc.tokenize(text.encode(), add_bos=add_bos, special=special)
        assert tok.encode(text, allow_special=special, add_bos=add_bos) == want, (name, text)


def test_decoding_equals_llama_cpp_and_round_trips(pair):
    name, lc, tok = pair
    for text in TEXTS:
        ids = tok.encode(text, allow_special=True)
        assert tok.decode_bytes(ids) == detokenize(lc, ids), (name, text)
        if name == "gemma3":       # every character comes back; a "▁" in the text is a space to SentencePiece
            assert tok.decode(ids) == text.replace("\u2581", " "), text


def test_smollm2_drops_the_bytes_its_vocabulary_lacks(pair):
    """Byte 4 has no token: it is left out, and the letters around it do not merge across it (llama.cpp's
    behaviour; Hugging Face's would merge them)."""
    name, lc, tok = pair
    if name != "smollm2":
        pytest.skip("byte-level vocabulary only")
    assert tok.vocab_size == 49152 and int((tok.ids[:256] < 0).sum()) == 21
    assert tok.decode(tok.encode("ab\x04cd")) == "abcd"
    assert tok.encode("ab\x04cd") == tok.encode("ab") + tok.encode("cd")


def test_stops_are_llama_cpps_end_of_generation_tokens(pair):
    import llama_cpp
    name, lc, tok = pair
    vocab = lc._model.vocab
    eog = [i for i in range(lc.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab, i)]
    assert sorted(tok.stop_ids) == eog, name
    assert tok.bos_id == (lc.token_bos() if name == "gemma3" else None)   # add_bos_token: Gemma yes, SmolLM2 no


def test_the_hf_export_of_gemma_encodes_as_llama_cpp(pair):
    """Our Hugging Face export of Gemma 3's vocabulary (the merges derived from its scores, the user-defined
    and control tokens as added tokens) in `tokenizers`: llama.cpp's ids (allow_special: HF always cuts added
    tokens out)."""
    tokenizers = pytest.importorskip("tokenizers")
    name, lc, tok = pair
    if name != "gemma3":
        pytest.skip("the SentencePiece vocabulary")
    hf = tokenizers.Tokenizer.from_str(tok.to_hf_json())
    for text in TEXTS:
        assert hf.encode(text, add_special_tokens=False).ids == lc.tokenize(text.encode(), add_bos=False,
                                                                             special=True), text
