"""Token shards: prepare (splits, EOS, bytes, mixing, streaming cuts, determinism) and the TokenShards reader."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from nanoeuler.errors import UserError
from nanoeuler.data.shards import TokenShards, cut_at_paragraphs, prepare, prepare_bundled, read_manifest

FIXTURES = Path(__file__).parent / "fixtures"


class ByteTok:
    """Stand-in tokenizer: one token per UTF-8 byte, `</s>` = 256 (the shard code must not care)."""
    vocab_size = 257
    eos_id = 256

    def encode(self, text):
        return list(text.encode("utf-8"))

    def decode(self, ids):
        return bytes(i for i in ids if i < 256).decode("utf-8")

    def fingerprint(self):
        return "bytes-v1"


def _all_ids(data_dir, split):
    d = TokenShards(data_dir, split)
    return d.window(0, d.n_tokens)


def _docs(ids, eos=256):
    """Split a token stream at EOS into decoded documents."""
    out, cur = [], []
    for i in ids:
        if i == eos:
            out.append(bytes(cur).decode("utf-8"))
            cur = []
        else:
            cur.append(int(i))
    assert not cur, "stream must end with </s>"
    return out


def _jsonl(path, texts):
    path.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts)), encoding="utf-8")
    return path


def test_jsonl_documents_every_10th_held_out(tmp_path):
    texts = [f"document number {i} é\n" * (i % 3 + 1) for i in range(25)]
    m = prepare([_jsonl(tmp_path / "a.jsonl", texts)], ByteTok(), tmp_path / "data", processes=1, progress=False)
    assert _docs(_all_ids(tmp_path / "data", "val")) == [texts[0], texts[10], texts[20]]
    train = [t for i, t in enumerate(texts) if i % 10]
    assert _docs(_all_ids(tmp_path / "data", "train")) == train
    assert m["splits"]["train"]["bytes"] == sum(len(t.encode()) for t in train)
    assert m["splits"]["val"]["documents"] == 3
    assert m["vocab_size"] == 257 and m["eos_id"] == 256 and m["tokenizer_fingerprint"] == "bytes-v1"
    assert read_manifest(tmp_path / "data") == m


class WideTok(ByteTok):
    """A vocabulary of Gemma 3's size: every id above uint16's range."""
    vocab_size = 262144
    eos_id = 262143

    def encode(self, text):
        return [200_000 + b for b in text.encode("utf-8")]

    def decode(self, ids):
        return bytes(i - 200_000 for i in ids if i < self.eos_id).decode("utf-8")


def test_a_vocabulary_over_65536_tokens_gets_uint32_shards(tmp_path):
    """Ids above 65,535 are written as uint32 and read back whole (once cut to their low 16 bits by the
    bundled corpus' prepare, which a 262,144-token vocabulary reached)."""
    texts = ["first document", "second, ünïcode", "third"] * 4
    prepare([_jsonl(tmp_path / "a.jsonl", texts)], WideTok(), tmp_path / "d", processes=1, progress=False)
    a = np.load(tmp_path / "d" / "train_000000.npy", allow_pickle=False)
    assert a.dtype == np.uint32 and a.max() == WideTok.eos_id
    ids = np.concatenate([_all_ids(tmp_path / "d", split) for split in ("train", "val")])
    docs = [WideTok().decode(d) for d in np.split(ids, np.flatnonzero(ids == WideTok.eos_id) + 1)[:-1]]
    assert sorted(docs) == sorted(texts)


def test_small_shards_and_windows_cross_boundaries(tmp_path):
    texts = [f"{i:03d} " + "xyz " * i for i in range(40)]
    prepare([_jsonl(tmp_path / "a.jsonl", texts)], ByteTok(), tmp_path / "d", processes=1, shard_tokens=100,
            progress=False)
    files = sorted(p.name for p in (tmp_path / "d").glob("train_*.npy"))
    assert len(files) > 5 and files[0] == "train_000000.npy"
    a = np.load(tmp_path / "d" / files[0], mmap_mode="r", allow_pickle=False)
    assert a.dtype == np.uint16 and a.shape == (100,)
    d = TokenShards(tmp_path / "d", "train")
    flat = np.concatenate([np.load(tmp_path / "d" / f, allow_pickle=False) for f in files]).astype(np.int64)
    assert d.n_tokens == len(flat)
    np.testing.assert_array_equal(d.window(95, 10), flat[95:105])
    # sample_batch: deterministic given the rng, windows are real slices
    x1 = d.sample_batch(np.random.default_rng(3), 8, 37)
    x2 = d.sample_batch(np.random.default_rng(3), 8, 37)
    assert x1.dtype == np.int64 and x1.shape == (8, 37)
    np.testing.assert_array_equal(x1, x2)
    starts = np.random.default_rng(3).integers(0, d.n_tokens - 37 + 1, size=8)
    for row, s in zip(x1, starts):
        np.testing.assert_array_equal(row, flat[s:s + 37])
    # iter_batches: non-overlapping, in order, covering the split up to the dropped tail
    batches = list(d.iter_batches(4, 30))
    got = np.concatenate([b.reshape(-1) for b in batches])
    np.testing.assert_array_equal(got, flat[:len(flat) // 30 * 30])
    assert all(b.shape[1] == 30 and b.shape[0] <= 4 for b in batches)


def test_single_text_file_is_cut_into_chunks(tmp_path):
    paras = [f"Paragraph {i}. " + "word " * (i % 7 + 3) for i in range(400)]
    text = "\r\n\r\n".join(paras) + "\r\n"
    (tmp_path / "book.txt").write_bytes(text.encode())
    m = prepare([tmp_path / "book.txt"], ByteTok(), tmp_path / "d", processes=1, progress=False)
    train, val = _all_ids(tmp_path / "d", "train"), _all_ids(tmp_path / "d", "val")
    normal = text.replace("\r\n", "\n")
    assert m["splits"]["train"]["bytes"] + m["splits"]["val"]["bytes"] == len(normal.encode())
    assert 0.05 < len(val) / (len(train) + len(val)) < 0.2
    assert (train == 256).sum() + (val == 256).sum() == 1          # one document, one </s>
    # every held-out chunk is a run of whole paragraphs of the book, absent from train
    val_text = bytes(int(i) for i in val if i != 256).decode()
    train_text = bytes(int(i) for i in train if i != 256).decode()
    pieces = [p.strip() for p in val_text.split("\n\n") if p.strip()]
    assert pieces and all(p in {q.strip() for q in paras} for p in pieces)
    assert not set(pieces) & {p.strip() for p in train_text.split("\n\n")}


def test_cut_at_paragraphs_round_trips():
    rng = np.random.default_rng(0)
    words = ["a", "bb", " ", "\n", "\n\n", "é", "\t", "ccc "]
    for _ in range(50):
        text = "".join(rng.choice(words, size=int(rng.integers(0, 400))))
        blocks = [text[i:i + 37] for i in range(0, len(text), 37)]
        pieces = list(cut_at_paragraphs(blocks, chunk_chars=int(rng.integers(1, 60))))
        assert "".join(pieces) == text
        assert all(pieces)
    assert list(cut_at_paragraphs(["aaaa\n\nbbbb\n\ncc"], chunk_chars=5)) == ["aaaa\n", "\nbbbb\n", "\ncc"]


def test_val_files_explicit_and_mixing_weights(tmp_path):
    a = _jsonl(tmp_path / "a.jsonl", [f"A{i}" for i in range(20)])
    b = _jsonl(tmp_path / "b.jsonl", [f"B{i}" for i in range(10)])
    v = _jsonl(tmp_path / "v.jsonl", ["V0", "V1"])
    prepare([(a, 1.0), (b, 2.0)], ByteTok(), tmp_path / "d", val_sources=[v], processes=1, progress=False)
    train = _docs(_all_ids(tmp_path / "d", "train"))
    assert _docs(_all_ids(tmp_path / "d", "val")) == ["V0", "V1"]
    assert sorted(train) == sorted([f"A{i}" for i in range(20)] + [f"B{i}" for i in range(10)] * 2)
    # interleaved, not concatenated: B documents appear within the first half already
    assert any(t.startswith("B") for t in train[:15])
    # fractional weight: about half of the training documents, validation untouched
    prepare([(a, 0.5)], ByteTok(), tmp_path / "h", processes=1, progress=False)
    half = _docs(_all_ids(tmp_path / "h", "train"))
    assert 7 <= len(half) <= 11 and set(half) < {f"A{i}" for i in range(20) if i % 10}
    assert _docs(_all_ids(tmp_path / "h", "val")) == ["A0", "A10"]


def test_json_and_parquet_inputs(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    texts = [f"row {i}\n" for i in range(12)]
    pq.write_table(pa.table({"text": texts, "n": list(range(12))}), tmp_path / "w.parquet", row_group_size=5)
    (tmp_path / "r.json").write_text(json.dumps([{"text": "json one"}, "json two"]))
    prepare([tmp_path / "w.parquet", tmp_path / "r.json"], ByteTok(), tmp_path / "d", processes=1, progress=False)
    docs = _docs(_all_ids(tmp_path / "d", "train")) + _docs(_all_ids(tmp_path / "d", "val"))
    assert sorted(docs) == sorted(texts + ["json one", "json two"])


def test_rerun_replaces_old_shards(tmp_path):
    a = _jsonl(tmp_path / "a.jsonl", ["x" * 50] * 20)
    prepare([a], ByteTok(), tmp_path / "d", processes=1, shard_tokens=64, progress=False)
    n_old = len(list((tmp_path / "d").glob("train_*.npy")))
    with pytest.raises(UserError, match="already holds token shards"):   # an existing output needs force
        prepare([a], ByteTok(), tmp_path / "d", processes=1, shard_tokens=10_000, progress=False)
    prepare([a], ByteTok(), tmp_path / "d", processes=1, shard_tokens=10_000, progress=False, force=True)
    assert n_old > 1 and len(list((tmp_path / "d").glob("train_*.npy"))) == 1
    assert not list((tmp_path / "d").glob(".*partial"))
    TokenShards(tmp_path / "d", "train")


def test_bad_inputs(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        prepare([tmp_path / "nope.txt"], ByteTok(), tmp_path / "d", processes=1, progress=False)
    (tmp_path / "x.csv").write_text("a,b")       # read as text (any named file is), but far too little of it
    with pytest.raises(UserError, match="train split is empty.*too little text"):
        prepare([tmp_path / "x.csv"], ByteTok(), tmp_path / "d", processes=1, progress=False)
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(UserError, match="no documents"):
        prepare([tmp_path / "empty.txt"], ByteTok(), tmp_path / "d", processes=1, progress=False)
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"title": "no text"}\n')
    with pytest.raises(UserError, match="bad.jsonl:2"):
        prepare([tmp_path / "bad.jsonl"], ByteTok(), tmp_path / "d", processes=1, progress=False)
    assert not list((tmp_path / "d").glob("*.npy*")) and not list((tmp_path / "d").glob(".*"))


def test_reader_errors(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        TokenShards(tmp_path / "missing", "train")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="empty"):
        TokenShards(tmp_path / "empty", "train")
    prepare([_jsonl(tmp_path / "a.jsonl", ["hello world"] * 30)], ByteTok(), tmp_path / "d", processes=1,
            progress=False)
    d = TokenShards(tmp_path / "d", "val")
    with pytest.raises(UserError, match="does not fit"):
        d.sample_batch(np.random.default_rng(0), 2, d.n_tokens + 1)
    with pytest.raises(UserError, match="does not fit"):
        list(d.iter_batches(2, d.n_tokens + 1))
    d.check_tokenizer("bytes-v1")
    with pytest.raises(UserError, match="different tokenizer"):
        d.check_tokenizer("other")
    shard = tmp_path / "d" / "train_000000.npy"
    shard.write_bytes(shard.read_bytes()[:200])                     # truncated
    with pytest.raises(UserError, match="corrupt"):
        TokenShards(tmp_path / "d", "train")
    shard.write_bytes(b"garbage")
    with pytest.raises(UserError, match="corrupt"):
        TokenShards(tmp_path / "d", "train")
    (tmp_path / "d" / "manifest.json").write_text("{not json")
    with pytest.raises(UserError, match="not valid JSON"):
        TokenShards(tmp_path / "d", "train")
    (tmp_path / "d" / "manifest.json").unlink()
    with pytest.raises(UserError, match="missing manifest"):
        TokenShards(tmp_path / "d", "train")


def test_prepare_bundled_holds_out_whole_works(tmp_path):
    from nanoeuler.data.corpus import bundled_split, bundled_works
    m = prepare_bundled(ByteTok(), tmp_path / "d", processes=1, progress=False)
    works = bundled_works()
    train, val = bundled_split()
    assert _docs(_all_ids(tmp_path / "d", "val")) == [works[n] for n in val]
    assert m["splits"]["train"]["documents"] == len(train)
    assert m["splits"]["train"]["bytes"] == sum(len(works[n].encode()) for n in train)


def _real_tokenizer(vocab_size=300):
    from nanoeuler.data.corpus import bundled_works
    from nanoeuler.tokenizer import Tokenizer
    works = bundled_works()
    return Tokenizer.train([works[n][:50_000] for n in list(works)[:4]], vocab_size, progress=False)


def test_real_tokenizer_same_shards_for_any_process_count(tmp_path):
    tok = _real_tokenizer()
    texts = [f"Scene {i}. Enter HAMLET.\n\nHAMLET. To be, or not to be — é {i}\n" * (i % 4 + 1) for i in range(30)]
    src = _jsonl(tmp_path / "a.jsonl", texts)
    m1 = prepare([src], tok, tmp_path / "p1", processes=1, shard_tokens=500, progress=False)
    m2 = prepare([src], tok, tmp_path / "p2", processes=2, shard_tokens=500, progress=False)
    assert m1["splits"] == m2["splits"] and m1["tokenizer_fingerprint"] == tok.fingerprint()
    for s in m1["splits"]["train"]["shards"] + m1["splits"]["val"]["shards"]:
        assert (tmp_path / "p1" / s["file"]).read_bytes() == (tmp_path / "p2" / s["file"]).read_bytes()
    ids = _all_ids(tmp_path / "p1", "train")
    docs = [tok.decode(d.tolist()) for d in np.split(ids, np.flatnonzero(ids == tok.eos_id) + 1)[:-1]]
    assert [d.removesuffix("</s>") for d in docs] == [t for i, t in enumerate(texts) if i % 10]
    assert int((ids == tok.eos_id).sum()) == 27


def test_cli_prepare_json(tmp_path, capsys):
    from nanoeuler.cli import main
    tok = _real_tokenizer()
    tok.save(tmp_path / "tok.json")
    a = _jsonl(tmp_path / "a.jsonl", [f"doc {i} " * 20 for i in range(20)])
    b = tmp_path / "b.txt"
    b.write_text("A single book.\n\n" * 500)
    code = main(["prepare", str(a), str(b), "--mix", "1,2", "--tokenizer", str(tmp_path / "tok.json"),
                 "--out", str(tmp_path / "d"), "--processes", "1", "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and out["train_tokens"] > 0 and out["val_tokens"] > 0 and out["shards"] == 2
    m = read_manifest(tmp_path / "d")
    assert [s["weight"] for s in m["sources"]] == [1.0, 2.0]
    assert main(["prepare", str(a), "--mix", "1,2", "--tokenizer", str(tmp_path / "tok.json"),
                 "--out", str(tmp_path / "e")]) == 2
    assert "one per argument" in capsys.readouterr().err
    assert main(["prepare", str(a), "--tokenizer", str(tmp_path / "nope.json"), "--out", str(tmp_path / "e")]) == 2
    assert "nope.json not found" in capsys.readouterr().err
