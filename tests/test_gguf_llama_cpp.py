"""Our import of a GGUF against llama.cpp (llama-cpp-python) running the same file: tokenization (every
pre-tokenizer name, add_bos_token set or not, a SentencePiece vocabulary), teacher-forced logits, greedy
tokens, and the chat prompt. Skipped
without llama_cpp (it compiles llama.cpp: `pip install 'nanoeuler[llama]'`; not in `make test`'s install).

The files are written here (tests/gguf_fixtures.py): a llama-arch model (d 256, 2 layers, a 320-token
byte-level BPE with ChatML specials) trained 40 SGD steps on Hamlet so that its predictions have margins,
then quantized by the gguf package. Both sides read the same quantized weights (ours dequantized to
float32), so what differs is arithmetic: llama.cpp's CPU matrix products round the activations to the
weights' "dot type" first — f16 for an F16 file, 8-bit blocks (Q8_0/Q8_1) for Q8_0/Q4_0/Q4_1 — while ours
stay float32. Hence the tolerances on the relative L2 error of the logits: F32 1e-5 (only summation order),
F16 1e-3 (f16 activations: ~5e-4 per element), Q8_0/Q4_x 2e-2 (8-bit activations: ~0.4% per element);
measured: 3e-7, 1e-4, 2.7e-3.
"""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("llama_cpp")
pytest.importorskip("gguf")

from gguf_fixtures import CHATML, SPECIALS, chatml_model, chatml_tokenizer, train_briefly, write_gguf  # noqa: E402
from test_llama_cpp_vocabs import random_texts  # noqa: E402

from nanoeuler import Model, Tokenizer  # noqa: E402
from nanoeuler.chat_template import render  # noqa: E402
from nanoeuler.data.corpus import bundled_works  # noqa: E402
from nanoeuler.infer.session import generate# noqa: E402
from nanoeuler.interop.gguf_import import load_gguf  # noqa: E402
from nanoeuler.interop.pretokenizers import PRE_FAMILIES  # noqa: E402
from nanoeuler.interop.llamacpp import LlamaCpp  # noqa: E402

TOLERANCE = {"F32": 1e-5, "F16": 1e-3, "Q8_0": 2e-2, "Q4_0": 2e-2, "Q4_1": 2e-2}
TEXTS = ["Hello, world!", "  two  spaces\n\nand lines\t end  ", "numbers 1234567 and 3.14", "ümlaut café 日本 🙂",
         "<|im_start|>user\nhi<|im_end|>\n", "don't I'll WE'RE", "What's\r\nthis?!", bundled_works()["lear"][:3000]]


@pytest.fixture(scope="module")
def trained():
    tok = chatml_tokenizer()
    return train_briefly(chatml_model(tok), tok, 40, 0.3, 129), tok


@pytest.fixture(scope="module")
def files(trained, tmp_path_factory):
    m, tok = trained
    d = tmp_path_factory.mktemp("lc")
    return {q: write_gguf(d / f"m-{q}.gguf", m, tok, q) for q in TOLERANCE}


def heldout(tok, n, at=0):
    return tok.encode(bundled_works()["othello"][5000:20000])[at:at + n]


# digits, punctuation runs, contractions, symbols, scripts, unusual spaces: where llama.cpp's `default` cascade
# cuts differently from GPT-2's pattern
CASCADE_TEXTS = [*TEXTS, "it's JOHN'S 'quoted' we're they'll", "x = 1234567 + 89, 3.14159", "$100+=200 ^~| `a` b<=>c",
                 "...!!?? (a) [b] {c} #e @f", "½ ٣٤٥ ① ²³ Ⅻ 12٣4", "«guillemets» — dash… ¿qué?",
                 "nbsp\u00a0ideographic\u3000space", "e\u0301 👩‍💻 €", "中文字符abc 日本語と한국어 camelCaseWord x12345y",
                 "ﾃｽﾄ ไทย ញ 4567890123 it'S"]


@pytest.fixture(scope="module")
def cascade_model():
    """A byte-level vocabulary whose merges cross the cuts pre-tokenizers make: merges that build every stretch
    of up to 8 bytes of each CASCADE_TEXTS entry, left to right and ranked first (a piece of those texts becomes
    as few tokens as the stretches allow, so a cut in another place gives other ids: a letter after Han
    characters, digits after letters, case changes), then those trained on Hamlet ("'s", " 2", " ...")."""
    trained = Tokenizer.train([bundled_works()["hamlet"][:20000] + " it's 2024, 1999 ... $100 += 42; 'tis" * 40], 600,
                              specials=SPECIALS, progress=False)
    tok = with_probe_merges(trained, [t for t in CASCADE_TEXTS if len(t) < 200], longest=8)
    return chatml_model(tok), tok


def with_probe_merges(tok: Tokenizer, texts: list[str], longest: int) -> Tokenizer:
    """tok with merges ranked before its own that build each stretch text[i:j] (bytes, j - i <= longest) of
    texts from text[i:j-1] and its last byte."""
    import json

    from nanoeuler.interop.hf_tokenizer import from_hf_json
    from nanoeuler.tokenizer.tokenizer import bytes_to_unicode
    chars = bytes_to_unicode()
    d = json.loads(tok.to_hf_json())
    vocab, own = d["model"]["vocab"], d["model"]["merges"]
    probes, seen = [], set()
    for text in texts:
        b = "".join(chars[x] for x in text.encode())
        for i in range(len(b)):
            for j in range(i + 2, min(i + longest, len(b)) + 1):
                vocab.setdefault(b[i:j], len(vocab))
                if (b[i:j - 1], b[j - 1]) not in seen:
                    seen.add((b[i:j - 1], b[j - 1]))
                    probes.append([b[i:j - 1], b[j - 1]])
    d["model"]["merges"] = probes + [m for m in own if tuple(m) not in seen]
    return from_hf_json(d)


# every tokenizer.ggml.pre name we read ("gpt2" is no llama.cpp name: it refuses such a file), and none
PRE_NAMES = [n for names, _, _ in PRE_FAMILIES.values() for n in names if n != "gpt2"] + [None]


@pytest.mark.parametrize("pre", PRE_NAMES)
def test_every_pre_tokenizer_name_equals_llama_cpp(tmp_path, cascade_model, pre):
    """Each name splits text as llama.cpp splits it for that name (smollm: each digit alone; llama-bpe: digits
    by threes; default, or no name, as llama.cpp falls back to it: a cascade of 4 regexes; kimi-k2 and afmoe, which
    llama.cpp cuts with its own code), on CASCADE_TEXTS and 100 random mixed-script texts."""
    import llama_cpp
    m, tok = cascade_model
    path = write_gguf(tmp_path / "d.gguf", m, tok, "F32", pre=pre)
    _, _, ours, _ = load_gguf(path)
    lc = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    for text in CASCADE_TEXTS + [t.decode("utf-8", "replace") for t in random_texts(seed=len(str(pre)), n=100)]:
        assert ours.encode(text, allow_special=True) == lc.tokenize(text.encode(), add_bos=False, special=True), text
    if pre in ("default", None):
        _, _, gpt2, _ = load_gguf(write_gguf(tmp_path / "g.gguf", m, tok, "F32"))
        assert sum(ours.encode(t) != gpt2.encode(t) for t in CASCADE_TEXTS) >= 5  # the cascade is not GPT-2's


@pytest.mark.parametrize("pre", ["gpt-2", "smollm", "llama-bpe", "qwen2", "default", "sentencepiece"])
@pytest.mark.parametrize("add_bos", [True, False, None])
def test_add_bos_token_true_false_or_absent_as_llama_cpp(tmp_path, cascade_model, spm_model, pre, add_bos):
    """encode(add_bos=True) puts the bos first exactly when llama.cpp does: tokenizer.ggml.add_bos_token when
    the file has it, else the family's default (llama-bpe and SentencePiece files: yes; the others: no)."""
    import llama_cpp
    m, tok = spm_model if pre == "sentencepiece" else cascade_model
    bos = "<s>" if pre == "sentencepiece" else "<|endoftext|>"
    path = write_gguf(tmp_path / "b.gguf", m, tok, "F32", pre=None if pre == "sentencepiece" else pre,
                      add_bos=add_bos, eos="</s>" if pre == "sentencepiece" else "<|im_end|>", bos=bos)
    _, _, ours, _ = load_gguf(path)
    lc = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    for text in ["Hello there", "x", ""]:
        assert ours.encode(text, add_bos=True) == lc.tokenize(text.encode(), add_bos=True, special=False), text


@pytest.fixture(scope="module")
def spm_model():
    """A small SentencePiece-style vocabulary with llama.cpp scores (random, ties included) and a model for it."""
    from spm_fixtures import corpus, hf_spm_json, scored, tokens_and_types, with_inner_characters
    from nanoeuler.tokenizer.sentencepiece import SentencePieceTokenizer
    tokens, types = tokens_and_types(hf_spm_json("llama2", corpus()))
    tokens, types, scores = with_inner_characters(tokens, types, scored(tokens, seed=5))
    tok = SentencePieceTokenizer(tokens, types, scores, prefix="every", eos="</s>", bos="<s>")
    return chatml_model(tok), tok


@pytest.mark.parametrize("prefix", ["every", "none"])
def test_sentencepiece_scores_equal_llama_cpp(tmp_path, spm_model, prefix):
    """llama.cpp's SPM tokenizer on a vocabulary ranked by random scores with many ties, with tokens that hold
    characters which are not tokens, USER_DEFINED runs and CONTROL tokens: the same ids, the same text back."""
    import llama_cpp
    from spm_fixtures import probes
    m, tok = spm_model
    tok = type(tok).from_dict(tok.to_dict() | {"prefix": prefix})
    path = write_gguf(tmp_path / "s.gguf", m, tok, "F32", pre=None, add_bos=True, eos="</s>", bos="<s>")
    _, _, ours, _ = load_gguf(path)
    assert ours.kind == "sentencepiece" and ours.prefix == prefix
    lc = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    for text in probes(20, seed=11) + ["xѯy xѯ ѯ", "<start_of_turn>", "  lead", "a\n\n\nb", " "]:
        for special in (False, True):
            want = lc.tokenize(text.encode(), add_bos=False, special=special)
            assert ours.encode(text, allow_special=special) == want, text
            assert ours.decode_bytes(want) == detokenize(lc, want)


@pytest.mark.parametrize("prefix", ["every", "none"])
def test_bytes_that_are_not_utf8_tokenize_and_come_back_as_in_llama_cpp(tmp_path, spm_model, prefix):
    """Bytes that are not UTF-8 (docs/tokenizers.md): llama.cpp too takes the bytes after a lone lead byte as
    its character, so that a space there comes back as "▁": the same ids, the same bytes back."""
    import llama_cpp
    m, tok = spm_model
    tok = type(tok).from_dict(tok.to_dict() | {"prefix": prefix})
    path = write_gguf(tmp_path / "s.gguf", m, tok, "F32", pre=None, add_bos=True, eos="</s>", bos="<s>")
    ours = load_gguf(path)[2]
    lc = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    for data in (b"\xe4 b", b"the \xe4\xb8 cat", b"\xf0\x9f  x", b"\xc3", b"a\xe4bc", b"\xff the"):
        want = lc.tokenize(data, add_bos=False, special=False)
        assert ours.encode_bytes(data) == want, data
        assert ours.decode_bytes(want) == detokenize(lc, want), data
    assert detokenize(lc, lc.tokenize(b"\xe4 b", add_bos=False, special=False)) == b"\xe4" + "▁".encode() + b"b"


def detokenize(lc, ids: list[int]) -> bytes:
    """llama.cpp's own llama_detokenize (special tokens as their text; with add_space_prefix the first
    piece's leading space dropped), which Llama.detokenize, joining pieces, does not do."""
    import ctypes

    import llama_cpp
    arr = (llama_cpp.llama_token * max(len(ids), 1))(*ids)
    buf = ctypes.create_string_buffer(64 * len(ids) + 64)
    n = llama_cpp.llama_detokenize(lc._model.vocab, arr, len(ids), buf, len(buf), False, True)
    return buf.raw[:n]


def test_tokenization_equals_llama_cpp(files):
    _, _, tok, _ = load_gguf(files["Q8_0"])
    lc = LlamaCpp(files["Q8_0"], n_ctx=128)
    for text in TEXTS:
        assert tok.encode(text, allow_special=True) == lc.llm.tokenize(text.encode(), add_bos=False, special=True), text
        assert tok.decode(tok.encode(text)) == text


@pytest.mark.parametrize("qtype", list(TOLERANCE))
def test_teacher_forced_logits_agree(files, qtype):
    cfg, P, tok, _ = load_gguf(files[qtype])
    window = heldout(tok, cfg.ctx_len)
    ours = Model(cfg, P).logits(np.array([window]))[0, 0]
    theirs = LlamaCpp(files[qtype], n_ctx=cfg.ctx_len, logits_all=True).logits(window)
    rel = np.linalg.norm(ours - theirs) / np.linalg.norm(theirs)
    top1 = float((ours.argmax(-1) == theirs.argmax(-1)).mean())
    print(f"{qtype}: logits relative L2 error {rel:.2e}, top-1 agreement {top1:.3f} over {len(window)} positions")
    assert rel <= TOLERANCE[qtype]
    assert top1 >= (1.0 if qtype in ("F32", "F16", "Q8_0") else 0.95)


@pytest.mark.parametrize("qtype", ["F16", "Q8_0"])
def test_greedy_tokens_equal_for_32_tokens(files, qtype):
    cfg, P, tok, _ = load_gguf(files[qtype])
    for at in (0, 300, 600):
        prompt = heldout(tok, 32, at)
        ours = generate(Model(cfg, P), prompt, 32, temperature=0, mode="cache").ids
        theirs, _ = LlamaCpp(files[qtype], n_ctx=cfg.ctx_len).greedy(prompt, 32)
        assert ours == theirs


def llama_cpp_chat(lc, messages, add_assistant=True) -> str:
    """llama.cpp's own rendering (llama_chat_apply_template) with the template of the file's metadata."""
    import ctypes

    import llama_cpp
    tmpl = lc.llm.metadata["tokenizer.chat_template"].encode()
    arr = (llama_cpp.llama_chat_message * len(messages))(
        *[llama_cpp.llama_chat_message(m["role"].encode(), m["content"].encode()) for m in messages])
    buf = ctypes.create_string_buffer(1 << 16)
    n = llama_cpp.llama_chat_apply_template(tmpl, arr, len(messages), add_assistant, buf, len(buf))
    assert 0 < n < len(buf)
    return buf.raw[:n].decode()


def test_chat_prompt_equals_llama_cpps_rendering(files):
    _, _, tok, _ = load_gguf(files["Q8_0"])
    lc = LlamaCpp(files["Q8_0"], n_ctx=128)
    assert tok.chat_template == CHATML
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Who is Hamlet?"},
                {"role": "assistant", "content": "A prince."}, {"role": "user", "content": "Of where?"}]
    for gen in (True, False):
        assert render(tok.chat_template, messages, tok, gen) == llama_cpp_chat(lc, messages, gen)
