"""The SentencePiece-style BPE kind: equal to Hugging Face `tokenizers` on vocabularies it trains (each normalizer
/ pre-tokenizer shape real files use), the compiled kernels equal to the readable definitions, special tokens
cut out in llama.cpp's order, files and exports round-trip, bad input is one line."""
from __future__ import annotations

import json
import random

import numpy as np
import pytest

tokenizers = pytest.importorskip("tokenizers")
from spm_fixtures import (PROBE_TAIL, STYLES, corpus, hf_spm_json, probes, scored, tokens_and_types,  # noqa: E402
                          with_inner_characters)

from nanoeuler.errors import UserError  # noqa: E402
from nanoeuler.interop.hf_tokenizer import from_hf_json  # noqa: E402
from nanoeuler.tokenizer import Tokenizer  # noqa: E402
from nanoeuler.tokenizer.sentencepiece import (SentencePieceTokenizer, leftmost_longest_is_exact,  # noqa: E402
                                               merge_symbols, split_specials)


@pytest.fixture(scope="module")
def texts():
    return corpus()


@pytest.fixture(scope="module")
def vocabularies(texts):
    """style -> (the tokenizer.json dict, the `tokenizers` Tokenizer, ours)."""
    out = {}
    for style in STYLES:
        d = hf_spm_json(style, texts)
        out[style] = d, tokenizers.Tokenizer.from_str(json.dumps(d)), from_hf_json(d)
    return out


@pytest.fixture(scope="module")
def scored_vocab(vocabularies):
    """Gemma-style pieces ranked by random scores with many ties, plus tokens holding characters that are not
    tokens (llama.cpp's ranking, as a GGUF file carries it)."""
    d = vocabularies["gemma"][0]
    tokens, types = tokens_and_types(d)
    tokens, types, scores = with_inner_characters(tokens, types, scored(tokens, seed=3))
    return SentencePieceTokenizer(tokens, types, scores, prefix="every", eos="</s>", bos="<s>")


@pytest.mark.parametrize("style", STYLES)
def test_encodes_like_hf_tokenizers(vocabularies, style):
    d, hf, ours = vocabularies[style]
    for text in probes(25):
        assert ours.encode(text, allow_special=True) == hf.encode(text, add_special_tokens=False).ids, text
    assert ours.kind == "sentencepiece" and ours.prefix == {
        "llama2": "every", "gemma": "none", "gemma4": "none", "metaspace-always-split": "every-unless-space", "metaspace-always":
        "every-unless-space", "metaspace-first": "first-unless-space", "metaspace-never-split": "none"}[style]


@pytest.mark.parametrize("style", ["llama2", "gemma", "gemma4"])
def test_decodes_like_hf_tokenizers(vocabularies, style):
    """Byte-fallback pieces join into UTF-8, "▁" is a space, Llama-2's added first space is dropped."""
    _, hf, ours = vocabularies[style]
    for text in probes(10):
        ids = hf.encode(text, add_special_tokens=False).ids
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=False)
        if style != "llama2":     # Llama-2's prefix also puts a space after each "\n" (a user-defined token);
            text = text.replace("▁", "")       # a "▁" in the text is a space to SentencePiece
            assert ours.decode(ours.encode(text)) == text


@pytest.mark.parametrize("style", STYLES)
def test_round_trip_and_export(vocabularies, style):
    """decode(encode(text)) == text for text without special or user-defined tokens, not starting with a space
    (each prefix scheme adds a "▁" that decode drops); the Hugging Face export of the import encodes as the
    original; our file reloads identically."""
    _, hf, ours = vocabularies[style]
    for text in probes(8, seed=300, size=200):
        plain = " ".join(text.split("<start_of_turn>")[0].replace("▁", "").split())    # no "\n", no "  "
        assert ours.decode(ours.encode(plain)) == plain
    back = tokenizers.Tokenizer.from_str(ours.to_hf_json())
    for text in probes(8, seed=400):
        assert back.encode(text, add_special_tokens=False).ids == hf.encode(text, add_special_tokens=False).ids
    again = Tokenizer.from_dict(json.loads(json.dumps(ours.to_dict())))
    assert type(again) is SentencePieceTokenizer and again.fingerprint() == ours.fingerprint()
    assert [again.encode(t, allow_special=True) for t in probes(3)] == [ours.encode(t, allow_special=True)
                                                                       for t in probes(3)]


@pytest.mark.parametrize("style", STYLES)
def test_fast_encode_equals_the_readable_definition(vocabularies, style):
    ours = vocabularies[style][2]
    for text in probes(15, seed=500):
        for special in (False, True):
            assert ours.encode(text, allow_special=special) == ours.encode_reference(text, allow_special=special)


def test_scores_fast_equals_readable_with_ties_and_inner_characters(scored_vocab):
    """llama.cpp's ranking: any two symbols whose join is a token merge, higher score first, the leftmost
    among equal scores; a character outside the vocabulary stays a symbol (it may still merge into 'xѯy')
    and becomes byte tokens at the end."""
    tok = scored_vocab
    for text in probes(25, seed=700) + ["xѯy ѯѯѯ xѯ", "▁xѯ", "aaaaaaa bbbbbbbb"]:
        for special in (False, True):
            assert tok.encode(text, allow_special=special) == tok.encode_reference(text, allow_special=special)
    assert [tok.tokens[i] for i in tok.encode("xѯ")] == ["▁xѯ"]         # prefix "every": "▁" first, then
    assert tok.decode(tok.encode("xѯ")) == "xѯ" and tok.decode(tok.encode("ѯ")) == "ѯ"   # dropped on decode
    assert all(tok.types[i] == 6 for i in tok.encode("ѯ")[1:])           # BYTE tokens
    assert tok.decode(tok.encode("a b")) == "a b" and tok.decode(tok.encode("a  b")) == "a   b"  # "  " is user-defined


def test_a_byte_that_leads_no_utf8_takes_four_bytes_as_llama_cpp(scored_vocab):
    """llama.cpp's unicode_len_utf8 sizes a character by its first byte's high four bits alone: 0xF8..0xFF are four
    bytes, so b"\\xffab" + "c" is one character no token holds and becomes four byte tokens, 'a' and 'b' merging
    with nothing (llama-spm's random texts caught it: 17 of 400 differed)."""
    from nanoeuler.tokenizer.sentencepiece import utf8_chars
    assert utf8_chars(b"\xffabcd") == [b"\xffabc", b"d"] and utf8_chars(b"\xf8a") == [b"\xf8a"]
    tok = scored_vocab
    for data in (b"\xffabc abc", b"ab\xfeab ab", b"\xf9", b"x\xfa\xc3\xa9y"):
        assert tok.decode_bytes(tok.encode_bytes(data)).endswith(data.split(b" ")[-1])
    ids = tok.encode_bytes(b"\xffabc")
    assert [tok.types[i] for i in ids[-4:]] == [6, 6, 6, 6] and tok.decode_bytes(ids[-4:]) == b"\xffabc"  # BYTE tokens


def test_scores_merge_by_text_and_list_their_merges_only_when_asked(scored_vocab):
    """With scores, encoding looks a pair up by its joined text (as llama.cpp does): the table of every
    token's cuts is made only when the merges are listed; an export, which needs them as a merge list,
    refuses characters inside tokens that are not tokens (Hugging Face's BPE cannot merge those)."""
    tok = SentencePieceTokenizer(scored_vocab.tokens, scored_vocab.types, scored_vocab.scores, prefix="every")
    assert tok.encode("xѯy ѯѯ ab") == scored_vocab.encode("xѯy ѯѯ ab") and tok._pairs is None
    pairs = tok.merges
    assert tok._pairs is not None and pairs and all(tok.find(tok.tokens[a] + tok.tokens[b]) >= 0
                                                    for a, b in pairs if max(a, b) < tok.vocab_size)
    with pytest.raises(UserError, match="cannot export: some tokens hold characters that are not tokens"):
        tok.to_hf_json()


def test_merge_symbols_picks_the_lowest_rank_then_the_leftmost():
    ranks = {("a", "b"): (1, "ab"), ("b", "c"): (0, "bc"), ("a", "a"): (2, "aa")}
    def rank(a, b):
        return ranks.get((a, b))
    assert merge_symbols(list("abc"), rank) == ["a", "bc"]
    assert merge_symbols(list("aaa"), rank) == ["aa", "a"]
    assert merge_symbols(list("aab"), rank) == ["a", "ab"]


def llama_cpp_partition(data: bytes, specials: list[bytes]) -> list:
    """llama.cpp's tokenizer_st_partition written again, as its C++ loop reads (find from an offset)."""
    frags = [(data, 0, len(data))] if data else []
    for tid, text in sorted(enumerate(specials), key=lambda x: (-len(x[1]), x[0])):
        out = []
        for f in frags:
            if isinstance(f, int):
                out.append(f)
                continue
            raw, off, length = f
            while True:
                match = raw.find(text, off, off + length)
                if match < 0:
                    out.append((raw, off, length))
                    break
                if match > off:
                    out.append((raw, off, match - off))
                out.append(tid)
                end = match + len(text)
                length -= end - off
                off = end
                if length == 0:
                    break
        frags = out
    return [f if isinstance(f, int) else f[0][f[1]:f[1] + f[2]] for f in frags]


def test_special_tokens_are_cut_out_in_llama_cpps_order():
    """Random special sets over a small alphabet (overlaps, runs, containment), random texts: the compiled
    scan (leftmost-longest, used when leftmost_longest_is_exact says it may be) and the reference both equal
    llama.cpp's partition."""
    rnd = random.Random(0)
    alphabet = "ab\n<>"
    for trial in range(300):
        specials = list(dict.fromkeys("".join(rnd.choice(alphabet) for _ in range(rnd.randint(1, 4)))
                                      for _ in range(rnd.randint(1, 5))))
        if trial % 3 == 0:
            specials += ["\n" * k for k in range(1, 5) if "\n" * k not in specials]
        tokens = specials + [f"<0x{b:02X}>" for b in range(256) if f"<0x{b:02X}>" not in specials]
        types = [4] * len(specials) + [6] * (len(tokens) - len(specials))
        tok = SentencePieceTokenizer(tokens, types, [0.0] * len(tokens))
        raw = [s.encode() for s in specials]
        for _ in range(5):
            text = "".join(rnd.choice(alphabet) for _ in range(rnd.randint(0, 30))).encode()
            want = llama_cpp_partition(text, raw)
            assert split_specials(text, sorted(((t, i) for i, t in enumerate(raw)), key=lambda x: (-len(x[0]), x[1]))) == want
            f_start, f_end, f_token = tok._fragments(text, allow_special=False)
            got = [t if t >= 0 else text[s:e] for s, e, t in zip(f_start.tolist(), f_end.tolist(), f_token.tolist())]
            assert got == want, (specials, text)
    assert not leftmost_longest_is_exact([b"ab", b"bcd"])
    assert leftmost_longest_is_exact([b"\n" * k for k in range(1, 32)] + [b"<b>", b"</b>", b"<start_of_turn>"])


def test_user_defined_always_cut_control_only_with_allow_special(vocabularies):
    _, _, ours = vocabularies["gemma"]
    turn, newline = ours.special_tokens["<start_of_turn>"], ours.special_tokens["\n"]
    assert turn not in ours.encode("a<start_of_turn>b") and newline in ours.encode("a\nb")
    assert turn in ours.encode("a<start_of_turn>b", allow_special=True)
    assert ours.encode("hi", add_bos=True) == ours.encode("hi")            # no post_processor: no bos


def test_hf_folder_import_and_autotokenizer_of_the_export(vocabularies, tmp_path):
    """A transformers Llama folder with such a tokenizer.json imports (ids and bos as AutoTokenizer gives
    them); `export --format hf` of it loads in AutoTokenizer and encodes identically."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("torch")
    from test_interop import make_hf_llama

    from nanoeuler import Model
    from nanoeuler.cli import main
    from nanoeuler.interop.hf import import_folder
    d = vocabularies["llama2"][0]
    d["post_processor"] = {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                                                                    {"Sequence": {"id": "A", "type_id": 0}}],
                           "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                           "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}}
    make_hf_llama(tmp_path / "hf", json.dumps(d), tied=True, shards=1, eos=2, bos=1)
    import_folder(tmp_path / "hf", tmp_path / "run", progress=False)
    tok = Tokenizer.load(tmp_path / "run")
    at = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert tok.kind == "sentencepiece" and tok.bos_token == "<s>" and tok.eos_token == "</s>"
    for text in probes(6, seed=900):
        assert tok.encode(text, allow_special=True, add_bos=True) == at(text)["input_ids"]
    assert main(["export", "--ckpt", str(tmp_path / "run"), "--format", "hf", "--out", str(tmp_path / "out"),
                 "--no-progress"]) == 0
    back = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    for text in probes(6, seed=950):
        ids = back(text)["input_ids"]
        assert ids == at(text)["input_ids"] and back.decode(ids) == tok.decode(ids)
    assert Model.load(tmp_path / "run").config.vocab_size == tok.vocab_size


@pytest.mark.parametrize("change, message", [
    (lambda d: d["model"]["vocab"].pop("<0x41>"), "byte token <0x41> is missing"),
    (lambda d: d.update(normalizer={"type": "Lowercase"}), "normalizer Lowercase is not supported"),
    (lambda d: d.update(normalizer=None), "leave spaces as they are"),
    (lambda d: d.update(pre_tokenizer={"type": "Whitespace"}), "pre_tokenizer Whitespace is not supported"),
    (lambda d: d.update(normalizer=None, pre_tokenizer={"type": "Split", "pattern": {"String": " "},
                                                        "behavior": "MergedWithPrevious", "invert": False}),
     "pre_tokenizer Split is not supported"),      # a Split at " " cuts where no normalizer made spaces "▁"
    (lambda d: d["model"]["merges"].insert(0, ["<0x41>", "<0x42>"]), "does not make a token"),
    (lambda d: d["model"].update(ignore_merges=True), "ignore_merges"),
    (lambda d: d["model"]["vocab"].update(zz=1 << 70), "ids are non-negative integers"),
    (lambda d: d["model"]["vocab"].update(zz=0), "share id 0"),
    (lambda d: d["model"]["merges"].append(["<0x41>"]), "is not a pair of vocab tokens"),
    (lambda d: d["added_tokens"][0].update(lstrip=True), "lstrip"),
])
def test_unsupported_hf_files_are_one_line(vocabularies, change, message):
    d = json.loads(json.dumps(vocabularies["gemma"][0]))
    change(d)
    with pytest.raises(UserError, match=message) as e:
        from_hf_json(d)
    assert "\n" not in str(e.value)


def test_file_keeps_byte_level_files_as_they_were(vocabularies):
    """A byte-level tokenizer.json has no "kind" (its fingerprint is what it was); ours names its kind and an
    unknown kind is refused."""
    bl = Tokenizer.train(["hello world"] * 3, 270, progress=False)
    assert "kind" not in bl.to_dict() and Tokenizer.from_dict(bl.to_dict()).fingerprint() == bl.fingerprint()
    d = vocabularies["gemma"][2].to_dict()
    assert d["kind"] == "sentencepiece" and "merges" in d and "scores" not in d
    with pytest.raises(UserError, match="unknown \"kind\""):
        Tokenizer.from_dict(d | {"kind": "rwkv"})


def test_replace_shares_the_vocabulary(vocabularies):
    ours = vocabularies["gemma"][2]
    other = ours.replace(chat_template="{{ messages }}", stops=["<start_of_turn>"])
    assert other.chat_template == "{{ messages }}" and other.stop_ids == [ours.special_tokens["<start_of_turn>"]]
    assert ours.chat_template is None and other.encode(PROBE_TAIL) == ours.encode(PROBE_TAIL)
    with pytest.raises(UserError, match="not one of the special tokens"):
        ours.replace(stops=["hello"])


def test_pieces_and_token_bytes(scored_vocab):
    tok = scored_vocab
    space = tok.find("▁")
    assert tok.token_bytes(space) == b" " and tok.token_bytes(tok.find("<0xE4>")) == b"\xe4"
    assert tok.token_bytes(tok.special_tokens["<start_of_turn>"]) == b"<start_of_turn>"
    assert np.array_equal(tok.encode_array("a b", add_bos=True), [tok.bos_id] + tok.encode("a b"))
    with pytest.raises(UserError, match="out of range"):
        tok.decode([tok.vocab_size])


def test_pieces_equal_their_definition_token_by_token():
    """pieces() (every token's bytes at once) is token_bytes defined one token at a time: "▁" a space in NORMAL
    and UNUSED tokens only, a BYTE token its byte, a "▁" whose bytes two tokens share left as it is."""
    from nanoeuler.tokenizer.sentencepiece import BYTE, BYTE_PIECES, CONTROL, NORMAL, UNUSED, USER_DEFINED
    extra = {"▁": NORMAL, "▁a▁b": NORMAL, "<c▁>": CONTROL, "▁▁": USER_DEFINED, "r▁": UNUSED, "é": NORMAL,
             "x\udce2": NORMAL, "\udc96\udc81y": NORMAL}      # b"x\xe2", b"\x96\x81y": a "▁" split between them
    tokens, types = BYTE_PIECES + list(extra), [BYTE] * 256 + list(extra.values())

    def one(t, kind):
        if kind == BYTE:
            return bytes([int(t[3:5], 16)])
        return (t.replace("▁", " ") if kind in (NORMAL, UNUSED) else t).encode("utf-8", "surrogateescape")
    tok = SentencePieceTokenizer(tokens, types, [0.0] * len(tokens))
    assert tok.pieces() == [one(t, kind) for t, kind in zip(tokens, types)]


def test_callers_take_either_kind(vocabularies, tmp_path, monkeypatch, capsys):
    """A checkpoint whose tokenizer is SentencePiece-style: `tokenizer encode/decode`, `sample`, chat-template
    rendering with its SFT mask, streamed decoding and the parallel encoder work as with a byte-level one."""
    import io
    import sys

    from conftest import tiny_config

    from nanoeuler import Model
    from nanoeuler.chat_template import example
    from nanoeuler.cli import main
    from nanoeuler.infer.session import StreamDecoder
    from nanoeuler.tokenizer import encode_parallel
    template = ("{% for m in messages %}<start_of_turn>{{ m.role }}\n{{ m.content }}<end_of_turn>\n{% endfor %}"
                "{% if add_generation_prompt %}<start_of_turn>assistant\n{% endif %}")
    d = vocabularies["gemma"][0]
    d["added_tokens"].append({"id": len(d["model"]["vocab"]) + len(d["added_tokens"]), "content": "<end_of_turn>",
                              "special": True})
    tok = from_hf_json(json.loads(json.dumps(d)), eos_id=2).replace(chat_template=template, stops=["<end_of_turn>"])
    Model.init(tiny_config(vocab_size=tok.vocab_size), seed=0).save(tmp_path / "run", tokenizer=tok)
    text = "Ünïcode 日本 😀 and\n\nnew  lines <start_of_turn>"
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(text.encode())))
    assert main(["tokenizer", "encode", "--tokenizer", str(tmp_path / "run"), "--allow-special"]) == 0
    ids = [int(x) for x in capsys.readouterr().out.split()]
    assert ids == tok.encode(text, allow_special=True)
    monkeypatch.setattr(sys, "stdin", io.StringIO(" ".join(map(str, ids))))
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(io.BytesIO(), encoding="utf-8"))
    assert main(["tokenizer", "decode", "--tokenizer", str(tmp_path / "run")]) == 0
    sys.stdout.flush()
    assert sys.stdout.buffer.getvalue().decode() == text
    monkeypatch.undo()
    assert main(["sample", "--ckpt", str(tmp_path / "run"), "--prompt", "hello", "--max-new-tokens", "3",
                 "--temperature", "0"]) == 0
    ids, mask = example(tok, [{"role": "user", "content": "hi"}], "Paris")
    reply = [i for i, m in zip(ids, mask) if m]
    assert tok.decode(reply) == "Paris<end_of_turn>" and reply[-1] == tok.special_tokens["<end_of_turn>"]
    dec = StreamDecoder(tok)
    assert "".join(dec.feed(i) for i in ids) + dec.flush() == tok.decode(ids)
    texts = [p for p in probes(6, seed=1200)]
    assert [a.tolist() for a in encode_parallel(tok, texts, processes=2, batch_bytes=500)] == [tok.encode(t) for t in texts]


def tiny_spm(pieces: list[str], scores: list[float], **kw) -> SentencePieceTokenizer:
    """<unk> (UNKNOWN), <s> and </s> (CONTROL), the 256 byte tokens, then pieces (NORMAL) with their scores."""
    from nanoeuler.tokenizer.sentencepiece import BYTE_PIECES
    return SentencePieceTokenizer(["<unk>", "<s>", "</s>", *BYTE_PIECES, *pieces], [2, 3, 3] + [6] * 256
                                  + [1] * len(pieces), [0.0] * 259 + scores, **kw)


def test_equal_scores_merge_the_leftmost_pair_first_whatever_their_ids():
    """llama.cpp (llm_tokenizer_spm) makes the best-scored merge first and, among equal scores, the leftmost:
    "abc" with "ab" and "bc" scored alike is ab|c, whichever of the two has the lower id."""
    for order in (["ab", "bc"], ["bc", "ab"]):
        tok = tiny_spm(["a", "b", "c", *order], [-1.0, -1.0, -1.0, -2.0, -2.0])
        for text, want in (("abc", ["ab", "c"]), ("bcabc", ["bc", "ab", "c"])):
            for encode in (tok.encode, tok.encode_reference):
                assert [tok.tokens[i] for i in encode(text)] == want, (order, text)


@pytest.mark.parametrize("style", ["metaspace-always", "metaspace-always-split", "metaspace-first"])
def test_a_text_that_starts_with_a_metaspace_gets_no_other(vocabularies, style):
    """Hugging Face's Metaspace (prepend_scheme always / first) puts no "▁" before a text that starts with one,
    as before one that starts with a space; nor do the *-unless-space prefixes (the fast and the readable
    encoder), at the start and after a special token."""
    _, hf, ours = vocabularies[style]
    for text in ("▁the", "▁▁the x", "▁ q", "the<start_of_turn>▁the", "<start_of_turn>▁▁x ▁y", "▁"):
        want = hf.encode(text, add_special_tokens=False).ids
        assert ours.encode(text, allow_special=True) == want, text
        assert ours.encode_reference(text, allow_special=True) == want, text


def test_an_exported_unknown_token_stays_special(vocabularies):
    """An UNKNOWN token (<unk>) is special as a CONTROL one is (llama.cpp cuts it out of text only when specials
    are parsed): the Hugging Face export marks it special, so `tokenizers` leaves it out of a decode that skips
    specials and the export read back encodes text holding "<unk>" as the original does."""
    from nanoeuler.tokenizer.sentencepiece import UNKNOWN
    ours = vocabularies["llama2"][2]
    unk = ours.special_tokens["<unk>"]
    types = ours.types.copy()
    types[unk] = UNKNOWN
    tok = SentencePieceTokenizer(ours.tokens, types, merges=ours.merges, prefix=ours.prefix)
    exported = tok.to_hf_json()
    hf, back = tokenizers.Tokenizer.from_str(exported), from_hf_json(json.loads(exported))
    text = "the<unk> and <s>x"
    ids = tok.encode(text, allow_special=True)
    assert unk in ids
    assert hf.decode(ids, skip_special_tokens=True) == hf.decode([i for i in ids if i != unk], skip_special_tokens=True)
    for special in (False, True):
        assert back.encode(text, allow_special=special) == tok.encode(text, allow_special=special)


def test_bytes_that_are_not_utf8_then_a_space_come_back_with_a_metaspace():
    """encode_bytes of bytes that are not UTF-8 (docs/tokenizers.md): a byte takes as many bytes as llama.cpp's
    unicode_len_utf8 reads in its high 4 bits (C0-DF 2, E0-EF 3, F0-FF 4, others 1). So after a lone E4 or FF
    the space, already "▁" (E2 96 81) when the bytes are cut, is split into byte tokens and comes back as "▁";
    any other byte that follows comes back as it was."""
    tok = tiny_spm(["▁", "a", "b", "▁b", "ab"], [-1.0, -1.0, -1.0, -2.0, -3.0])
    for lead in (b"\xe4", b"\xff"):
        ids = tok.encode_bytes(lead + b" b")
        assert [tok.tokens[i] for i in ids] == [f"<0x{lead[0]:02X}>", "<0xE2>", "<0x96>", "<0x81>", "b"]
        assert tok.decode_bytes(ids) == lead + "▁".encode() + b"b"
    assert tok.decode_bytes(tok.encode_bytes(b"\xf0\x9f b")) == b"\xf0\x9f" + "▁".encode() + b"b"
    for data in (b"a\xe4bab", b"\xe4\xb8\x80 b", b"\x80 b", b"b\xc3", b"\xffabab"):    # no space taken
        assert tok.decode_bytes(tok.encode_bytes(data)) == data, data


def test_gemma4_newline_runs_are_cut_apart_and_kept_whole():
    """Gemma 4 (`newlines`): text is cut into runs of newlines and of other characters before BPE, and a run of
    newlines that is a token stays that token even where no merge builds it; a byte that is not UTF-8 is U+FFFD."""
    from nanoeuler.tokenizer.sentencepiece import BYTE_PIECES, llama_cpp_utf8
    pieces = ["▁", "a", "b", "ab", "\n", "\n\n", "▁a", "a\n", "\ufffd"]
    tokens = ["<pad>", "<eos>", "<bos>", *BYTE_PIECES, *pieces]
    ids = {t: i for i, t in enumerate(tokens)}
    merges = [(ids[x], ids[y]) for x, y in (("a", "b"), ("▁", "a"), ("a", "\n"))]
    types = [3, 3, 3] + [6] * 256 + [1] * len(pieces)
    tok = SentencePieceTokenizer(tokens, types, merges=merges, eos="<eos>", bos="<bos>", newlines=True)
    plain = SentencePieceTokenizer(tokens, types, merges=merges, eos="<eos>", bos="<bos>")
    assert plain.encode("a\n\n") == [ids["a\n"], ids["\n"]]
    assert tok.encode("a\n\n") == [ids["a"], ids["\n\n"]]
    assert tok.encode("ab a\n\n\nb") == [ids["ab"], ids["▁a"], ids["\n"], ids["\n"], ids["\n"], ids["b"]]  # no \n \n merge
    assert tok.encode_bytes(b"a\xe2\x82b") == tok.encode("a\ufffd\ufffdb") == [ids["a"], ids["\ufffd"], ids["\ufffd"],
                                                                              ids["b"]]
    assert llama_cpp_utf8(b"a\xe2\x82b") == "a\ufffd\ufffdb".encode() and llama_cpp_utf8(b"ok") == b"ok"
    rng = random.Random(0)
    for _ in range(200):
        text = "".join(rng.choice(["a", "b", " ", "\n", "\n\n", "é", "<bos>"]) for _ in range(rng.randint(0, 12)))
        assert tok.encode(text) == tok.encode_reference(text), repr(text)
    back = Tokenizer.from_dict(json.loads(json.dumps(tok.to_dict())))
    assert back.newlines and back.encode("ab\n\n\n") == tok.encode("ab\n\n\n")
    assert "newlines" not in plain.to_dict()
    with pytest.raises(UserError, match="newline"):
        tok.to_hf_json()
    from nanoeuler.tokenizer.sentencepiece import merge_ids      # GGUF's "a b" merge strings, cut as llama.cpp cuts
    assert merge_ids(tokens, ["a b", "▁ a", "a \n"]).tolist() == [list(m) for m in merges]
    with pytest.raises(UserError, match="merge 1 'ab' is not two tokens"):
        merge_ids(tokens, ["a b", "ab"])


def test_gemma4_gguf_export_refuses_what_llama_cpp_would_run_otherwise():
    """GGUF export writes Gemma 4's kind as llama.cpp's gemma4 (its merges as "left right"; read back by llama.cpp in
    test_llama_cpp_vocabs.py), and refuses in one line a vocabulary llama.cpp would run otherwise: no bos (llama.cpp
    always puts one first), or a merge whose left token holds a space (llama.cpp cuts "left right" at the first
    space after the first character)."""
    gguf = pytest.importorskip("gguf")
    from nanoeuler.interop.gguf_export import add_vocabulary
    from nanoeuler.tokenizer.sentencepiece import BYTE_PIECES
    tokens = ["<pad>", "<eos>", "<bos>", *BYTE_PIECES, "a", "b", "ab", "a b", "a bb"]
    types = [3, 3, 3] + [6] * 256 + [1] * 5
    ids = {t: i for i, t in enumerate(tokens)}
    writer = lambda: gguf.GGUFWriter(None, "gemma4")  # noqa: E731
    tok = SentencePieceTokenizer(tokens, types, merges=[(ids["a"], ids["b"])], eos="<eos>", bos="<bos>", newlines=True)
    w = writer()
    assert add_vocabulary(w, tok, tok.vocab_size + 2, None)[0][-2:] == ["[PAD264]", "[PAD265]"]
    assert w.kv_data[0]["tokenizer.ggml.model"].value == "gemma4"
    assert w.kv_data[0]["tokenizer.ggml.merges"].value == ["a b"]
    no_bos = SentencePieceTokenizer(tokens, types, merges=[(ids["a"], ids["b"])], eos="<eos>", newlines=True)
    spaced = SentencePieceTokenizer(tokens, types, merges=[(ids["a"], ids["b"]), (ids["a b"], ids["b"])],
                                    eos="<eos>", bos="<bos>", newlines=True)
    for bad, message in ((no_bos, "always puts a bos first"), (spaced, "left token holds a space")):
        with pytest.raises(UserError, match=message) as e:
            add_vocabulary(writer(), bad, bad.vocab_size, None)
        assert "\n" not in str(e.value)



def gemma4_hf_json(meta: dict) -> str:
    """Gemma 4's tokenizer.json as transformers makes it from the GGUF's vocabulary (its GGUF tokenizer conversion,
    fed our reading of the metadata: transformers' own reader takes ~20 s): GemmaTokenizer's BPE with byte_fallback
    over the file's tokens and merges, normalizer Replace " " -> "▁", pre_tokenizer Split " ", CONTROL tokens as
    special added tokens and USER_DEFINED ones as plain added tokens, the shape of the published tokenizer.json."""
    mapping = pytest.importorskip("transformers.integrations.gguf.gguf_tokenizer_mapping")
    renames = mapping.GGUF_TOKENIZER_MAPPING["tokenizer"]
    fields = {name: meta[f"tokenizer.{key}"] for key, name in renames.items() if f"tokenizer.{key}" in meta}
    return mapping.convert_gguf_tokenizer("gemma4", fields)[0].to_str()


def test_gemma4_from_tokenizer_json_encodes_like_hf_tokenizers_and_llama_cpp():
    """Gemma 4's 262,144 tokens and 514,906 merges from a Hugging Face tokenizer.json (gemma4_hf_json): our ids
    equal tokenizers' on random text (mixed scripts, digits, whitespace and newline runs, emoji, control
    characters), and equal llama.cpp's on the same vocabulary (its `gemma4` model: our GGUF reading of the file,
    and llama.cpp itself when llama-cpp-python is installed). Hugging Face runs BPE over the whole text and
    llama.cpp over runs of newlines and of other characters: no merge of this vocabulary joins a newline to
    anything else, and every run of up to 31 newlines is a token both reach, so the two agree."""
    from real_models import llama_cpp_models_dir

    from nanoeuler.interop.gguf_file import GGUFFile
    from nanoeuler.interop.gguf_import import gguf_tokenizer
    from test_llama_cpp_vocabs import FRAGMENTS, random_texts
    folder = llama_cpp_models_dir()
    if folder is None:
        pytest.skip("llama.cpp's vocabulary files are not fetched: run `make llama-src`")
    path = folder / "ggml-vocab-gemma-4.gguf"
    meta = GGUFFile(path).meta
    text = gemma4_hf_json(meta)
    d = json.loads(text)
    assert d["pre_tokenizer"]["type"] == "Split" and d["normalizer"]["type"] == "Replace"
    theirs, ours = tokenizers.Tokenizer.from_str(text), from_hf_json(d)
    assert ours.kind == "sentencepiece" and not ours.newlines and ours.vocab_size == 262_144
    cases = ([t.decode("utf-8", "replace") for t in random_texts(seed=48, n=300)] + FRAGMENTS
             + ["\n" * n for n in range(1, 40)] + ["a\n\n\nb  \n \n\t\n", "<bos>x<|channel>y<turn|>\n<|\"|>"])
    wrong = [(t, ours.encode(t, allow_special=True), theirs.encode(t, add_special_tokens=False).ids) for t in cases]
    wrong = [w for w in wrong if w[1] != w[2]]
    assert not wrong, f"{len(wrong)} of {len(cases)} texts differ from tokenizers', first {wrong[0]}"
    ids = [ours.encode(t) for t in cases]
    assert ours.decode(ids[0]) == theirs.decode(ids[0], skip_special_tokens=False)
    from_gguf = gguf_tokenizer(meta, 262_144)
    assert from_gguf.newlines and [from_gguf.encode(t) for t in cases] == ids
    try:
        import llama_cpp
    except ImportError:
        return
    lc = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    assert [lc.tokenize(t.encode(), add_bos=False, special=False) for t in cases] == ids

def test_tokens_read_as_the_list_they_were_made_from():
    """A SentencePiece vocabulary keeps its texts as one blob and offsets (Pieces), each str made when read: it
    reads as the list it was built from (items from either end, slices, iteration, bytes that are not UTF-8
    through surrogateescape), writes that list to tokenizer.json, and loads back the same."""
    pieces = ["▁a", "é", "\udce4x", "▁ab"]         # "\udce4": the byte 0xE4, not UTF-8, kept by surrogateescape
    tok = tiny_spm(pieces, [-1.0, -2.0, -3.0, -4.0])
    want = ["<unk>", "<s>", "</s>", *[f"<0x{b:02X}>" for b in range(256)], *pieces]
    assert len(tok.tokens) == len(want) == tok.vocab_size and list(tok.tokens) == want
    assert [tok.tokens[i] for i in (0, 259, 261, -1, -4)] == ["<unk>", "▁a", "\udce4x", "▁ab", "▁a"]
    assert tok.tokens[-2:] == want[-2:] and tok.tokens[::100] == want[::100] and "é" in tok.tokens
    for i in (len(want), -len(want) - 1):
        with pytest.raises(IndexError):
            tok.tokens[i]
    d = tok.to_dict()
    assert d["tokens"] == want and json.loads(json.dumps(d))["tokens"] == want
    again = Tokenizer.from_dict(json.loads(json.dumps(d)))
    assert list(again.tokens) == want and again.fingerprint() == tok.fingerprint()


@pytest.mark.parametrize("joined", [True, False])
def test_a_merge_across_a_newline_keeps_the_text_whole(joined):
    """Fragments are cut at newline runs' edges only where no merge joins a newline to other characters (the cut
    is then a saving, the ids the same): a vocabulary merging "a" with "\\n" must still make "a\\n" and "\\na"."""
    from nanoeuler.tokenizer.sentencepiece import BYTE_PIECES
    pieces = ["a", "b", "\n", "ab", "\n\n"] + (["a\n", "\na"] if joined else [])
    tokens = ["<unk>", "<s>", *BYTE_PIECES, *pieces]
    at = {t: i for i, t in enumerate(tokens)}
    merges = [("a", "b"), ("\n", "\n")] + ([("a", "\n"), ("\n", "a")] if joined else [])
    tok = SentencePieceTokenizer(tokens, [2, 3] + [6] * 256 + [1] * len(pieces),
                                 merges=[(at[x], at[y]) for x, y in merges], prefix="none")
    for text in ("ab\na\n\nab", "a\nb", "b\n\na\n"):   # each makes "a\n" or "\na" when joined
        ids = tok.encode(text)
        assert ids == tok.encode_reference(text), text
        assert any("\n" in tok.tokens[i] and "a" in tok.tokens[i] for i in ids) == joined, text
