"""Fuzz the loaders of every file we read (config.json, trainer.json, manifest.json, tokenizer.json):
a valid file, mutated by hypothesis (a field replaced by any JSON value, deleted, added; nested too),
must load or raise UserError — never another exception, never an allocation over a bound."""
import functools
import json
import os
import shutil
import tracemalloc

import numpy as np
import pytest
from conftest import tiny_config
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context

from nanoeuler import Model
from nanoeuler import checkpoint as ckpt
from nanoeuler.config import Config
from nanoeuler.data.corpus import bundled_works
from nanoeuler.errors import UserError
from nanoeuler.data.shards import TokenShards, prepare
from nanoeuler.tokenizer import Tokenizer

ALLOC_BOUND = 256 << 20        # bytes: no mutated file may make a loader allocate more than this
# NANOEULER_FUZZ_EXAMPLES=2000 for a longer run (and NANOEULER_FUZZ_RANDOM=1 for fresh examples each time)
FUZZ = settings(max_examples=int(os.environ.get("NANOEULER_FUZZ_EXAMPLES", "120")), deadline=None,
                derandomize=os.environ.get("NANOEULER_FUZZ_RANDOM") != "1",
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

scalars = st.one_of(
    st.none(), st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, 1, -1, 2**31, 2**63, 10**8, 10**12]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20), st.sampled_from(["abc", "", "1e8", "(", r"\p{L}+", "(?:a|aa)+$", "\x00"]))
json_values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                            st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                           max_leaves=12)


@st.composite
def mutated(draw, base):
    """base (a JSON object) with 1-3 mutations, each at a random depth: replace / delete / add a field."""
    obj = json.loads(json.dumps(base))
    for _ in range(draw(st.integers(1, 3))):
        target = obj
        while True:                                   # walk down a random path of objects and lists
            keys = list(target) if isinstance(target, dict) else list(range(len(target)))
            if not keys:
                break
            key = draw(st.sampled_from(keys))
            child = target[key]
            if isinstance(child, (dict, list)) and child and draw(st.booleans()):
                target = child
                continue
            action = draw(st.sampled_from(["replace", "delete", "add"]))
            if action == "replace" or isinstance(target, list) and action == "add":
                target[key] = draw(json_values)
            elif action == "delete":
                del target[key]
            else:
                target[draw(st.text(max_size=8))] = draw(json_values)
            break
    return obj


def _bounded(fn):
    """Run fn; return 'ok' or 'UserError'; any other exception fails; so does a peak allocation over the bound."""
    tracemalloc.start()
    try:
        fn()
        result = "ok"
    except UserError:
        result = "UserError"
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert peak < ALLOC_BOUND, f"a loader allocated {peak / 2**20:.0f} MiB"
    if currently_in_test_context():
        event(result)                  # `pytest --hypothesis-show-statistics` shows both outcomes occur
    return result


def _dump(obj) -> str:
    return json.dumps(obj, allow_nan=True)


# ---- fixtures: one valid file of each kind ----------------------------------------------------------------
@pytest.fixture(scope="module")
def tok():
    return Tokenizer.train([bundled_works()["hamlet"][:30000]], 280, progress=False)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tok):
    d = tmp_path_factory.mktemp("fuzz") / "run"
    Model.init(tiny_config(vocab_size=tok.vocab_size), seed=0).save(d, tokenizer=tok)
    return d


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory, tok):
    d = tmp_path_factory.mktemp("fuzzdata") / "data"
    src = d.parent / "plays.txt"
    src.write_text(bundled_works()["hamlet"][:30000])
    prepare([src], tok, d, processes=1, progress=False)
    return d


# ---- the fuzz tests --------------------------------------------------------------------------------------
@FUZZ
@given(data=st.data())
def test_fuzz_config_json(run_dir, tmp_path_factory, data):
    good = json.loads((run_dir / "config.json").read_text())
    run = tmp_path_factory.mktemp("c") / "run"
    shutil.copytree(run_dir, run)
    (run / "config.json").write_text(_dump(data.draw(mutated(good))))
    _bounded(lambda: Model.load(run, read_only=True))
    _bounded(lambda: Config.load(run / "config.json"))


@FUZZ
@given(data=st.data())
def test_fuzz_trainer_json(tmp_path_factory, data):
    good = {"kind": "pretrain", "step": 12, "train_config": {"lr": 0.005, "steps": 100}, "tokens_seen": 4096,
            "elapsed_s": 3.5, "skipped_batches": 0, "data": {"tokenizer": "ab", "train_tokens": 10},
            "rng": np.random.default_rng(0).bit_generator.state, "optimizer": {"t": 12}}
    state = data.draw(mutated(good))
    path = tmp_path_factory.mktemp("t") / "trainer.json"
    path.write_text(_dump(state))

    def load():
        ckpt.check_trainer_state(ckpt.read_json(path, "resume state"), path)
        rng = np.random.default_rng()
        if "rng" in state:                     # a state that passed the check can be restored
            rng.bit_generator.state = state["rng"]
    _bounded(load)


@FUZZ
@given(data=st.data())
def test_fuzz_manifest_json(data_dir, tmp_path_factory, data):
    good = json.loads((data_dir / "manifest.json").read_text())
    d = tmp_path_factory.mktemp("m") / "data"
    shutil.copytree(data_dir, d)
    (d / "manifest.json").write_text(_dump(data.draw(mutated(good))))

    def load():
        for split in ("train", "val"):
            s = TokenShards(d, split)
            s.sample_batch(np.random.default_rng(0), 2, min(8, s.n_tokens))
    _bounded(load)


@FUZZ
@given(data=st.data())
def test_fuzz_tokenizer_json(tok, tmp_path_factory, data):
    fuzz_tokenizer(tok.to_dict(), tmp_path_factory, data)


@FUZZ
@given(data=st.data())
def test_fuzz_tokenizer_json_with_a_cascade(tok, tmp_path_factory, data):
    """A "pattern" cascade (llama.cpp's `default`: a list of regexes); the list and its regexes are mutated too."""
    from nanoeuler.interop.hf_tokenizer import DEFAULT_CASCADE
    fuzz_tokenizer(tok.to_dict() | {"pattern": list(DEFAULT_CASCADE)}, tmp_path_factory, data)


@FUZZ
@given(data=st.data(), ranking=st.sampled_from(["scores", "merges", "merges with newlines"]))
def test_fuzz_sentencepiece_tokenizer_json(tmp_path_factory, data, ranking):
    """The SentencePiece kind's file: tokens, types, scores or merges, prefix, split, newlines (Gemma 4's), specials."""
    fuzz_tokenizer(sentencepiece_file(ranking), tmp_path_factory, data)


@FUZZ
@given(data=st.data())
def test_fuzz_wordpiece_tokenizer_json(tmp_path_factory, data):
    """The WordPiece kind's file: tokens, types, unk, normalization, marks, framing (lossy: lowercased)."""
    fuzz_tokenizer(wordpiece_file(), tmp_path_factory, data, exact=False)


@FUZZ
@given(data=st.data(), normalization=st.sampled_from(["llama.cpp", "hf"]))
def test_fuzz_unigram_tokenizer_json(tmp_path_factory, data, normalization):
    """The Unigram kind's file: tokens, types, scores, unk, normalization, charsmap (base64), framing."""
    fuzz_tokenizer(unigram_file(normalization), tmp_path_factory, data, exact=False)


# the valid files the three tests above mutate: built once per kind (mutated() copies before changing), not once
# per example
@functools.cache
def sentencepiece_file(ranking: str) -> dict:
    from nanoeuler.tokenizer.sentencepiece import BYTE_PIECES, SentencePieceTokenizer
    pieces = ["▁", "T", "o", "b", "e", "▁b", "▁be", "To", "▁o", "r", "▁or", "\n", "<start_of_turn>"]
    tokens = ["<unk>", "<s>", "</s>", *BYTE_PIECES, *pieces]
    types = [2, 3, 3] + [6] * 256 + [1] * 11 + [4, 3]
    if ranking == "scores":
        tok = SentencePieceTokenizer(tokens, types, [0.0] * 259 + [-float(i) for i in range(13)], prefix="every",
                                     eos="</s>", bos="<s>")
    else:
        ids = {t: i for i, t in enumerate(tokens)}
        merges = [(ids[a], ids[b]) for a, b in (("▁", "b"), ("▁b", "e"), ("T", "o"), ("▁", "o"), ("▁o", "r"))]
        tok = SentencePieceTokenizer(tokens, types, merges=merges, prefix="first-unless-space", split=True, eos="</s>",
                                     newlines=ranking.endswith("newlines"))
    return tok.to_dict()


@functools.cache
def wordpiece_file() -> dict:
    from nanoeuler.tokenizer.wordpiece import WordPieceTokenizer
    tokens = ["[UNK]", "[CLS]", "[SEP]", "to", "##be", ",", "or", "##r", "n", "##ot", ":", "4", "##2", "e"]
    tok = WordPieceTokenizer(tokens, [2, 3, 3] + [1] * 11, "[UNK]", "bert", word_prefix="", continuation="##",
                             max_word_chars=100, bos="[CLS]", eos="[SEP]", add_eos=True)
    return tok.to_dict()


@functools.cache
def unigram_file(normalization: str) -> dict:
    from nanoeuler.tokenizer.unigram import UnigramTokenizer
    tokens = ["<unk>", "<s>", "</s>", "▁", "▁To", "▁be", ",", "▁or", "▁not", "▁to", ":", "4", "2", "é", "\n"]
    charsmap = (12).to_bytes(4, "little") + (1 << 10).to_bytes(4, "little") + bytes(8) + b"x\0"
    tok = UnigramTokenizer(tokens, [2, 3, 3] + [1] * 12, [0, 0, 0] + [-float(i) for i in range(12)], "<unk>",
                           normalization, charsmap if normalization == "llama.cpp" else None, bos="<s>", eos="</s>",
                           add_eos=True)
    return tok.to_dict()


def fuzz_tokenizer(base: dict, tmp_path_factory, data, exact: bool = True):
    """A mutation of base (a tokenizer.json) loads and encodes/decodes (exactly, unless the kind is lossy), or
    raises UserError."""
    path = tmp_path_factory.mktemp("k") / "tokenizer.json"
    path.write_text(_dump(data.draw(mutated(base))))

    def load():
        t = Tokenizer.load(path)
        ids = t.encode("To be, or not to be: 42 \u00e9\U0001f600\n", add_bos=True)
        text = t.decode(ids[1:] if t.bos_token is not None else ids)
        assert text == "To be, or not to be: 42 \u00e9\U0001f600\n" or not exact
    _bounded(load)


@FUZZ
@given(data=st.data(), which=st.sampled_from(["config.json", "tokenizer.json", "manifest.json"]))
def test_fuzz_file_bytes(run_dir, data_dir, tmp_path_factory, data, which):
    """Byte-level damage (truncation, flipped bytes, junk, invalid UTF-8) of each file: UserError or success."""
    src = data_dir if which == "manifest.json" else run_dir
    d = tmp_path_factory.mktemp("b") / "d"
    shutil.copytree(src, d)
    raw = (d / which).read_bytes()
    cut = data.draw(st.integers(0, len(raw)))
    junk = data.draw(st.binary(max_size=16))
    at = data.draw(st.integers(0, max(0, len(raw) - 1)))
    mode = data.draw(st.sampled_from(["truncate", "flip", "insert"]))
    if mode == "truncate":
        raw = raw[:cut]
    elif mode == "flip":
        raw = raw[:at] + bytes([raw[at] ^ 0xFF]) + raw[at + 1:] if raw else raw
    else:
        raw = raw[:at] + junk + raw[at:]
    (d / which).write_bytes(raw)
    if which == "manifest.json":
        _bounded(lambda: (TokenShards(d, "train"), TokenShards(d, "val")))
    elif which == "tokenizer.json":
        _bounded(lambda: Tokenizer.load(d / which).encode("To be, or not"))
    else:
        _bounded(lambda: Model.load(d, read_only=True))


def test_fuzz_mutations_reach_both_outcomes(tok, tmp_path):
    """The strategy is not vacuous: an untouched file loads, a type-broken one raises UserError."""
    path = tmp_path / "tokenizer.json"
    path.write_text(_dump(tok.to_dict()))
    assert _bounded(lambda: Tokenizer.load(path)) == "ok"
    path.write_text(_dump(tok.to_dict() | {"specials": {"</s>": "x"}}))
    assert _bounded(lambda: Tokenizer.load(path)) == "UserError"
