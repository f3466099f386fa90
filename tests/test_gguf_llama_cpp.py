"""Our import of a GGUF against llama.cpp (llama-cpp-python) running the same file: tokenization (with the
`gpt-2` and the `default` pre-tokenizers), teacher-forced logits, greedy tokens, and the chat prompt. Skipped
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

from nanoeuler import Model, Tokenizer  # noqa: E402
from nanoeuler.chat_template import render  # noqa: E402
from nanoeuler.data.corpus import bundled_works  # noqa: E402
from nanoeuler.infer.session import generate# noqa: E402
from nanoeuler.interop.gguf_import import load_gguf  # noqa: E402
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
                 "nbsp\u00a0ideographic\u3000space", "e\u0301 👩‍💻 €"]


@pytest.mark.parametrize("pre", ["default", None])
def test_default_pre_tokenizer_equals_llama_cpp(tmp_path, pre):
    """tokenizer.ggml.pre "default" (or none: llama.cpp falls back to it) splits with a cascade of 4 regexes."""
    import llama_cpp
    tok = Tokenizer.train([bundled_works()["hamlet"][:20000] + " it's 2024, 1999 ... $100 += 42; 'tis" * 40], 600,
                          specials=SPECIALS, progress=False)  # merges across the cascade's cuts: "'s", " 2", " ..."
    m = chatml_model(tok)
    path = write_gguf(tmp_path / "d.gguf", m, tok, "F32", pre=pre)
    _, _, ours, _ = load_gguf(path)
    lc = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    for text in CASCADE_TEXTS:
        assert ours.encode(text, allow_special=True) == lc.tokenize(text.encode(), add_bos=False, special=True), text
    _, _, gpt2, _ = load_gguf(write_gguf(tmp_path / "g.gguf", m, tok, "F32"))
    assert sum(ours.encode(t) != gpt2.encode(t) for t in CASCADE_TEXTS) >= 5  # the cascade is not GPT-2's split


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
