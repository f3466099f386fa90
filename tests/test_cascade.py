"""A cascade of pre-tokenization patterns (llama.cpp's `default` pre-tokenizer): our split equals a reference
written here from llama.cpp's src/unicode.cpp `unicode_regex_split` — its hand-written GPT-2 scanner
(`unicode_regex_split_custom_gpt2`) for the second regex, and for the others a plain regex run over the
"collapsed" text (each non-ASCII character replaced by one byte naming its Unicode category) as llama.cpp
runs std::regex — on varied text; a cascade tokenizer survives save/load, HF export and HF import."""
from __future__ import annotations

import json
import re
import unicodedata

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoeuler.data.corpus import bundled_works
from nanoeuler.errors import UserError
from nanoeuler.interop.hf_tokenizer import DEFAULT_CASCADE, from_hf_json
from nanoeuler.tokenizer import Tokenizer
from nanoeuler.tokenizer.pretokenize import PATTERN_PROBES
from nanoeuler.tokenizer.tokenizer import bpe

# llama.cpp's unicode_set_whitespace (the Unicode White_Space property)
WHITESPACE = {*range(0x09, 0x0E), 0x20, 0x85, 0xA0, 0x1680, *range(0x2000, 0x200B), 0x2028, 0x2029, 0x202F, 0x205F,
              0x3000}
COLLAPSED = {"N": "\xd1", "L": "\xd2", "P": "\xd3", "M": "\xd4", "S": "\xd5"}  # k_ucat_cpt; anything else 0xD0
ASCII_PUNCT = "!\"#%&'()*,-./:;?@[\\]_{}"                                       # k_ucat_map for \p{P}


def kind(c: str) -> str:
    """W(hitespace), L(etter), N(umber) or O(ther), as llama.cpp's codepoint flags say."""
    if ord(c) in WHITESPACE:
        return "W"
    cat = unicodedata.category(c)[0]
    return cat if cat in "LN" else "O"


def collapse(text: str) -> str:
    return "".join(c if ord(c) < 128 else "\x0b" if ord(c) in WHITESPACE
                   else COLLAPSED.get(unicodedata.category(c)[0], "\xd0") for c in text)


def regex_split(coded: str, pattern: str, offsets: list[int]) -> list[int]:
    """unicode_regex_split_stl: in each piece, the matches and the stretches between them, as lengths."""
    out, start = [], 0
    for n in offsets:
        at = 0
        for m in re.finditer(pattern, coded[start:start + n]):
            if m.start() > at:
                out.append(m.start() - at)
            out.append(m.end() - m.start())
            at = m.end()
        if at < n:
            out.append(n - at)
        start += n
    return out


def gpt2_split(text: str, offsets: list[int]) -> list[int]:
    """unicode_regex_split_custom_gpt2, line by line: 's|'t|'re|'ve|'m|'ll|'d| ?L+| ?N+| ?[^\\sLN]+|\\s+(?!\\S)|\\s+"""
    out, start = [], 0
    for n in offsets:
        lo, hi = start, start + n
        start = hi

        def flag(p):
            return kind(text[p]) if lo <= p < hi else None

        pos = lo
        while pos < hi:
            c, end = text[pos], None
            if c == "'" and pos + 1 < hi:
                if text[pos + 1] in "stmd":
                    end = pos + 2
                elif pos + 2 < hi and text[pos + 1:pos + 3] in ("re", "ve", "ll"):
                    end = pos + 3
            if end is None:
                f = flag(pos + 1) if c == " " else flag(pos)
                if f in ("L", "N", "O"):
                    end = pos + (c == " ")
                    while flag(end) == f:
                        end += 1
                else:
                    spaces = 0
                    while flag(pos + spaces) == "W":
                        spaces += 1
                    end = pos + (spaces - 1 if spaces > 1 and pos + spaces < hi else max(spaces, 1))
            out.append(end - pos)
            pos = end
    return out


def reference_split(text: str) -> list[str]:
    """llama.cpp's split of text by the `default` pre-tokenizer's four regexes."""
    coded = collapse(text)
    offsets = [len(text)]
    offsets = regex_split(coded, "[\xd3" + re.escape(ASCII_PUNCT + "$+<=>^~|") + "]+", offsets)
    offsets = gpt2_split(text, offsets)
    offsets = regex_split(coded, "[\xd10-9]+", offsets)
    offsets = regex_split(text, "[0-9][0-9][0-9]", offsets)
    pieces, at = [], 0
    for n in offsets:
        pieces.append(text[at:at + n])
        at += n
    return pieces


TEXTS = ["Hello, world!", "it's JOHN'S 'quoted' we're they'll I'd", "don't  stop\t\tnow", "x = 1234567 + 89",
         "$100+=200 ^~| `tick` a<=>b", "...!!?? (a) [b] {c} \"d\" #e @f %g &h *i _j -k /l \\m", "3.14159, 2,718",
         "  two  spaces\n\nand lines\r\n end  ", "ümlaut café naïve Ελληνικά кириллица 日本語 한국어 ไทย",
         "½ ٣٤٥ ① ²³ Ⅻ 12٣4", "«guillemets» — dash… „quotes“ ¿qué? ¡sí!", "nbsp\u00a0ideographic\u3000space",
         "e\u0301 a\u0308 \u0915\u094d", "emoji 🙂👩‍💻 🇫🇷 € £ ©", "'s's 's 'S' 'll'", "0", "", " ", "'", "\n",
         *PATTERN_PROBES[:5]]
ALPHABET = list("abAB sStTlLdmrve'0123456789.,!?;:$+<=>^~|`-_()\n\t\r") + \
    ["é", "日", "٣", "½", "…", "«", "\u00a0", "\u3000", "🙂", "\u0301", "€", "Ω", "\u2028"]


@pytest.fixture(scope="module")
def tok():
    base = Tokenizer.train([bundled_works()["hamlet"][:20000]], 400, progress=False)
    return Tokenizer.from_dict(base.to_dict() | {"pattern": list(DEFAULT_CASCADE)})


def test_reference_is_llama_cpps_split_on_known_cases():
    """Hand-checked llama.cpp behaviour: punctuation is cut off first (so a contraction loses its apostrophe's
    word), numbers come in groups of three from the left."""
    assert reference_split("It's 1234567!") == ["It", "'", "s", " ", "123", "456", "7", "!"]
    assert reference_split("a+=b") == ["a", "+=", "b"]


@pytest.mark.parametrize("text", TEXTS)
def test_cascade_splits_as_llama_cpp(tok, text):
    assert tok.pre_tokens(text) == reference_split(text)


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet=ALPHABET, max_size=40))
def test_cascade_splits_as_llama_cpp_on_random_text(tok, text):
    assert tok.pre_tokens(text) == reference_split(text)


def test_encode_is_bpe_of_each_piece(tok):
    text = " ".join(TEXTS)
    want = [i for piece in reference_split(text) for i in bpe(piece.encode("utf-8"), tok._ranks)]
    assert tok.encode(text) == want
    assert tok.decode(want) == text


def test_save_load_keeps_the_cascade(tok, tmp_path):
    tok.save(tmp_path / "tokenizer.json")
    assert json.loads((tmp_path / "tokenizer.json").read_text())["pattern"] == list(DEFAULT_CASCADE)
    back = Tokenizer.load(tmp_path / "tokenizer.json")
    assert back.pattern == DEFAULT_CASCADE and back.fingerprint() == tok.fingerprint()
    text = " ".join(TEXTS)
    assert back.encode(text) == tok.encode(text)
    single = Tokenizer.from_dict(tok.to_dict() | {"pattern": DEFAULT_CASCADE[1] + r"|\s+"})
    assert single.fingerprint() != tok.fingerprint() and isinstance(single.to_dict()["pattern"], str)


@pytest.mark.parametrize("pattern, match", [
    ([], "1 to 16 patterns"),
    ([r"\p{L}+"] * 17, "1 to 16 patterns"),
    ([r"\p{L}+", "("], "bad pre-tokenization pattern"),
    ([r"\p{L}+", 3], "non-empty string"),
    ([r"\p{L}+", "(a|aa)+$"], "backtracks catastrophically"),
])
def test_a_bad_cascade_is_refused(tok, pattern, match):
    with pytest.raises(UserError, match=match):
        Tokenizer.from_dict(tok.to_dict() | {"pattern": pattern})


def test_hf_export_encodes_identically_and_imports_back(tok):
    tokenizers = pytest.importorskip("tokenizers")
    hf = tokenizers.Tokenizer.from_str(tok.to_hf_json())
    for text in [*TEXTS, " ".join(TEXTS)]:
        assert hf.encode(text, add_special_tokens=False).ids == tok.encode(text), text
    back = from_hf_json(json.loads(tok.to_hf_json()))
    assert back.pattern == DEFAULT_CASCADE and back.encode(" ".join(TEXTS)) == tok.encode(" ".join(TEXTS))
