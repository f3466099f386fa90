"""Every bad input is one line `error: ...` on stderr and an exit code != 0 — one test per class of bad
input (issue 14), each with several members of the class. Read-only commands change nothing on disk."""
import errno
import io
import json
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from conftest import snapshot, tiny_config

from nanoeuler import Model
from nanoeuler import checkpoint as ckpt
from nanoeuler.cli import main
from nanoeuler.data.corpus import bundled_works
from nanoeuler.errors import UserError
from nanoeuler.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.train([bundled_works()["hamlet"][:40000]], 300, progress=False)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tok):
    d = tmp_path_factory.mktemp("errors") / "run"
    Model.init(tiny_config(vocab_size=tok.vocab_size, ctx_len=32), seed=0).save(d, tokenizer=tok)
    return d


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("text") / "plays.txt"
    p.write_text(bundled_works()["hamlet"][:60000])
    return p


def one_line_error(argv, capsys, monkeypatch=None, stdin: str = ""):
    """Run `nanoeuler argv` in-process; assert exit != 0 and exactly one `error: ...` line on stderr."""
    if monkeypatch is not None:
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert code != 0, (argv, err)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), (argv, err)
    assert "Traceback" not in err
    return lines[0]


# ---- every numeric flag finite and in range; a 0 never silently means "default" -----------------------
@pytest.mark.parametrize("argv, needle", [
    (["sample", "--ckpt", "{run}", "--prompt", "a", "--temperature", "nan"], "--temperature"),
    (["sample", "--ckpt", "{run}", "--prompt", "a", "--temperature", "inf"], "--temperature"),
    (["sample", "--ckpt", "{run}", "--prompt", "a", "--temperature", "-1"], "--temperature"),
    (["sample", "--ckpt", "{run}", "--prompt", "a", "--temperature", "1e-300"], "--temperature"),
    (["sample", "--ckpt", "{run}", "--prompt", "a", "--top-p", "0"], "--top-p"),
    (["sample", "--ckpt", "{run}", "--prompt", "a", "--top-p", "nan"], "--top-p"),
    (["sample", "--ckpt", "{run}", "--prompt", "a", "--seed", "-1"], "--seed"),
    (["sample", "--ckpt", "{run}", "--prompt", "a", "--max-new-tokens", "0"], "--max-new-tokens"),
    (["sample", "--ckpt", "{run}", "--prompt", "a", "--top-k", "-3"], "--top-k"),
    (["chat", "--ckpt", "{run}", "--temperature", "inf"], "--temperature"),
    (["sample", "--ckpt", "{run}", "--prompt", "a", "--threads", "0"], "--threads"),
    (["sample", "--ckpt", "{run}", "--prompt", "a", "--threads", "100000"], "more than the"),
    (["chat", "--ckpt", "{run}", "--threads", "100000"], "more than the"),
    (["serve", "--ckpt", "{run}", "--threads", "100000"], "more than the"),
    (["info", "small", "--batch", "0"], "--batch"),
    (["info", "small", "--ctx", "abc"], "--ctx"),
    (["bench", "small", "--batch-size", "0"], "--batch-size"),
    (["bench", "small", "--steps", "0"], "--steps"),
    (["demo", "--steps", "0"], "--steps"),
    (["demo", "--seed", "-1"], "--seed"),
    (["prepare", "{text}", "--tokenizer", "{run}", "--out", "{tmp}/d", "--shard-tokens", "0"], "--shard-tokens"),
    (["prepare", "{text}", "--tokenizer", "{run}", "--out", "{tmp}/d", "--processes", "0"], "--processes"),
    (["prepare", "{text}", "--tokenizer", "{run}", "--out", "{tmp}/d", "--mix", "nan"], "--mix"),
    (["tokenizer", "train", "{text}", "--vocab-size", "abc", "--out", "{tmp}/t.json"], "--vocab-size"),
    (["tokenizer", "train", "{text}", "--vocab-size", "70000", "--out", "{tmp}/t.json"], "--vocab-size"),
    (["data", "gutenberg", "--retries", "-1"], "--retries"),
    (["data", "gutenberg", "--limit", "0"], "--limit"),
    (["data", "gutenberg", "--backoff", "inf"], "--backoff"),
])
def test_numeric_flags_finite_and_in_range(argv, needle, run_dir, text_file, tmp_path, capsys):
    argv = [a.format(run=run_dir, text=text_file, tmp=tmp_path) for a in argv]
    line = one_line_error(argv, capsys)
    assert needle in line
    assert not (tmp_path / "d").exists()        # refused before creating anything


def test_threads_decode_with_that_many_threads(run_dir, capsys):
    """sample --threads 1 decodes on one thread (as llama.cpp's -t), the same greedy text as the default."""
    from nanoeuler.infer import pool
    before = pool.get_threads()
    argv = ["sample", "--ckpt", str(run_dir), "--prompt", "a", "--temperature", "0", "--max-new-tokens", "8", "--json"]
    try:
        assert main(argv) == 0
        default = json.loads(capsys.readouterr().out)["text"]
        assert main([*argv, "--threads", "1"]) == 0
        assert pool.get_threads() == 1 and json.loads(capsys.readouterr().out)["text"] == default
    finally:
        pool.set_threads(before)


def test_top_k_zero_means_no_limit_in_both_places(run_dir, monkeypatch, capsys):
    """chat --top-k 0 and REPL /topk 0 mean the same thing: no limit (sampling from all tokens)."""
    from nanoeuler.cli.chat import Repl
    from nanoeuler.infer.chat import Chat
    monkeypatch.setattr(sys, "stdin", io.StringIO("/topk 0\n/topk 3\n"))
    assert main(["chat", "--ckpt", str(run_dir), "--top-k", "0", "--max-new-tokens", "2"]) == 0
    out = capsys.readouterr().out
    assert "(top-k off)" in out and "(top-k 3)" in out
    chat = Chat(Model.load(run_dir), ckpt.load_tokenizer(run_dir), top_k=None)
    Repl(chat).command("/topk 0", lambda s: None)
    assert chat.top_k is None


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "-1", "1e-300", "abc", "101", ""])
def test_repl_temperature_refuses_non_finite(run_dir, value):
    from nanoeuler.cli.chat import Repl
    from nanoeuler.infer.chat import Chat
    chat = Chat(Model.load(run_dir), ckpt.load_tokenizer(run_dir), temperature=0.7)
    said = []
    Repl(chat).command(f"/temp {value}", said.append)
    assert chat.temperature == 0.7 and "usage: /temp" in "".join(said)
    Repl(chat).command("/temp 0.5", said.append)
    assert chat.temperature == 0.5


# ---- paths --------------------------------------------------------------------------------------------
def test_paths(run_dir, text_file, tmp_path, capsys):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    a_dir = tmp_path / "a_dir"
    a_dir.mkdir()
    cases = [
        (["prepare", text_file, "--tokenizer", run_dir, "--out", a_file], "is a file"),
        (["tokenizer", "train", text_file, "--vocab-size", "300", "--out", a_dir], "is a directory"),
        (["tokenizer", "export", "--tokenizer", run_dir, "--out", a_dir], "is a directory"),
        (["tokenizer", "train", text_file, "--vocab-size", "300", "--out", a_file / "t.json"], "is a file"),
        (["demo", "--out", a_file], "is a file"),
        (["prepare", tmp_path / "missing.txt", "--tokenizer", run_dir, "--out", tmp_path / "d"], "not found"),
        (["sample", "--ckpt", tmp_path / "nope", "--prompt", "a"], "not found"),
        (["data", "alpaca", "--url", "file:///etc/passwd", "--out", tmp_path / "al"], "only http"),
        (["data", "alpaca", "--url", "ftp://example.org/a.json", "--out", tmp_path / "al"], "only http"),
        (["data", "gutenberg", "--mirror", "gopher://x", "--out", tmp_path / "g"], "only http"),
        (["data", "web", "--bytes", "1M", "--url", "file:///x.parquet", "--out", tmp_path / "w"], "only http"),
    ]
    for argv, needle in cases:
        assert needle in one_line_error(argv, capsys), argv
    books = tmp_path / "books.tsv"
    books.write_bytes(bytes(range(256)) * 4)
    assert "not a UTF-8 text file" in one_line_error(["data", "gutenberg", "--books", books, "--out", tmp_path / "g"],
                                                     capsys)
    assert "directory" in one_line_error(["data", "gutenberg", "--books", a_dir, "--out", tmp_path / "g"], capsys)
    assert not (tmp_path / "g").exists() and not (tmp_path / "al").exists()


def test_one_file_rule_for_prepare_and_tokenizer_train(tmp_path, capsys):
    """A named file is read whatever its name (.py, none); a directory gives its text files: both commands."""
    text = bundled_works()["hamlet"][:50000]
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "notes.py").write_text(text[:25000])
    (tmp_path / "src" / "README").write_text(text[25000:])
    (tmp_path / "src" / "a.txt").write_text(text)
    tok_path = tmp_path / "tok.json"
    for files in ([tmp_path / "src" / "notes.py", tmp_path / "src" / "README"], [tmp_path / "src"]):
        assert main(["tokenizer", "train", *map(str, files), "--vocab-size", "300", "--out", str(tok_path),
                     "--no-progress", "--force"]) == 0
        assert main(["prepare", *map(str, files), "--tokenizer", str(tok_path), "--out", str(tmp_path / "d"),
                     "--no-progress", "--processes", "1", "--json", "--force"]) == 0
        summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert summary["train_tokens"] > 0 and summary["val_tokens"] > 0


# ---- sizes are checked before anything is allocated ----------------------------------------------------
def test_sizes_checked_before_allocating(tmp_path, capsys):
    import tracemalloc
    cfg = tiny_config().to_dict()
    for field, value in [("ctx_len", 100_000_000), ("vocab_size", 10**9), ("n_layers", 10**6), ("dim", 2**20)]:
        path = tmp_path / f"{field}.json"
        path.write_text(json.dumps(cfg | {field: value}))
        tracemalloc.start()
        line = one_line_error(["bench", path], capsys)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert field in line and peak < 64 << 20
    tracemalloc.start()
    line = one_line_error(["bench", "small", "--batch-size", "100000"], capsys)
    assert tracemalloc.get_traced_memory()[1] < 64 << 20
    tracemalloc.stop()
    assert "GiB" in line and "--batch-size" in line
    from nanoeuler.training.memory import check_fits
    from nanoeuler.config import PRESETS
    assert check_fits(PRESETS["small"], 32, 128) < 1 << 30
    with pytest.raises(UserError, match="more than this machine's 1.0 GiB"):
        check_fits(PRESETS["big"], 64, 256, limit=1 << 30)
    from nanoeuler.training.memory import check_inference_fits
    check_inference_fits(PRESETS["gpt"])
    with pytest.raises(UserError, match="KV cache"):
        check_inference_fits(PRESETS["gpt"].replace(ctx_len=1 << 20), limit=8 << 30)


# ---- every field of every file we read is type- and range-checked -------------------------------------
def test_file_fields_checked(run_dir, tmp_path, tok, capsys):
    import shutil
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    good = json.loads((run / "config.json").read_text())
    for change in [{"rope_theta": "abc"}, {"norm_eps": float("nan")}, {"ctx_len": 1e8}, {"dim": True},
                   {"n_heads": -4}, {"arch": ["x"]}, {"extra": 1}]:
        (run / "config.json").write_text(json.dumps(good | change))
        assert "config" in one_line_error(["sample", "--ckpt", run, "--prompt", "a"], capsys)
        assert "config" in one_line_error(["info", run], capsys)
    (run / "config.json").write_text(json.dumps(good))
    t = tok.to_dict()
    for change in [{"specials": {"</s>": "300"}}, {"merges": [["a", 1]]}, {"pattern": 5}, {"pattern": r"\p{L}+"},
                   {"vocab_size": "abc"}]:
        (run / "tokenizer.json").write_text(json.dumps(t | change))
        assert "tokenizer" in one_line_error(["sample", "--ckpt", run, "--prompt", "a"], capsys)
    for state in [{"step": "abc"}, {"step": -5}, {"step": 1, "rng": {"bit_generator": "MT19937"}},
                  {"step": 1, "elapsed_s": "x"}, [], {"step": 1, "optimizer": {"t": -1}}]:
        with pytest.raises(UserError, match="resume state"):
            ckpt.check_trainer_state(state)
    rng = np.random.default_rng(0).bit_generator.state
    ckpt.check_trainer_state({"step": 3, "rng": rng, "optimizer": {"t": 3}, "elapsed_s": 1.5})


def test_manifest_fields_checked(tmp_path, tok, text_file):
    from nanoeuler.data.shards import TokenShards, prepare
    prepare([text_file], tok, tmp_path / "d", processes=1, progress=False)
    good = json.loads((tmp_path / "d" / "manifest.json").read_text())
    bad = [{"vocab_size": "abc"}, {"vocab_size": 70000}, {"eos_id": -1}, {"eos_id": "0"}, {"splits": []},
           {"tokenizer_fingerprint": 3},
           {"splits": good["splits"] | {"train": good["splits"]["train"] | {"tokens": "12"}}},
           {"splits": good["splits"] | {"train": good["splits"]["train"] | {"shards": [{"file": 1, "tokens": 2}]}}},
           {"splits": good["splits"] | {"val": good["splits"]["val"] | {"shards": [{"file": "../x.npy", "tokens": 1}]}}}]
    for change in bad:
        (tmp_path / "d" / "manifest.json").write_text(json.dumps(good | change))
        with pytest.raises(UserError):
            TokenShards(tmp_path / "d", "train")
            TokenShards(tmp_path / "d", "val")


# ---- user-supplied tokenizer patterns: cover every character, bounded time ----------------------------
@pytest.mark.parametrize("pattern, why", [(r"\p{L}+", "drops characters"), (r"(\w+)|\s+|.", "drops characters"),
                                          (r"(?:a|aa)+$|\s+|(?s:.)", "backtracks"), ("(", "bad pre-tokenization")])
def test_tokenizer_pattern_validated(tok, pattern, why):
    t0 = time.perf_counter()
    with pytest.raises(UserError, match=why):
        Tokenizer.from_dict(tok.to_dict() | {"pattern": pattern})
    assert time.perf_counter() - t0 < 10


def test_tokenizer_encoding_time_is_bounded(tok, monkeypatch):
    import nanoeuler.tokenizer.pretokenize as P
    slow = Tokenizer(tok.merges, ("</s>",), r"(?:a|aa)+$|\s+|(?s:.)")   # built directly: not validated
    monkeypatch.setattr(P, "ENCODE_TIMEOUT_PER_CHAR", 0.0)
    t0 = time.perf_counter()
    with pytest.raises(UserError, match="catastrophic backtracking"):
        slow.encode("a" * 60 + "b")
    assert time.perf_counter() - t0 < 10
    assert Tokenizer(tok.merges, ("</s>",), r"\w+|\s+|(?s:.)").decode(slow.encode("ab c")) == "ab c"


# ---- the model's raw control characters are escaped on the terminal --------------------------------------
def test_control_characters_from_the_model_are_escaped(tok, capsys):
    from nanoeuler.cli.args import escape_control
    from nanoeuler.cli.sample import StdoutStream
    assert escape_control("ok\n\tend\x1b[2J\x07\x00\x7f\x9b\r") == "ok\n\tend\\x1b[2J\\x07\\x00\\x7f\\x9b\\r"
    stream = StdoutStream(tok)
    for i in tok.encode("a\x1b[31mred\x07"):
        stream(i)
    stream.flush()
    out = capsys.readouterr().out
    assert out == "a\\x1b[31mred\\x07" and "\x1b" not in out


# ---- read-only commands modify nothing; non-finite weights are not loaded ---------------------------------
def test_read_only_commands_change_nothing(run_dir, tmp_path, capsys):
    import shutil
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    (run / ckpt.STAGING).mkdir()                 # debris a writing load would clean up
    (run / ckpt.STAGING / "half.bin").write_bytes(b"x")
    before = snapshot(tmp_path)
    assert main(["sample", "--ckpt", str(run), "--prompt", "a", "--max-new-tokens", "3", "--seed", "0"]) == 0
    assert main(["info", str(run)]) == 0
    capsys.readouterr()
    assert snapshot(tmp_path) == before
    out = tmp_path.parent / (tmp_path.name + "-export.gguf")   # export writes only its --out, outside tmp_path
    assert main(["export", "--ckpt", str(run), "--format", "gguf", "--out", str(out), "--no-progress"]) == 0
    assert out.exists() and snapshot(tmp_path) == before
    out.unlink()


def test_non_finite_model_is_refused_by_sample(run_dir, tmp_path, capsys):
    import shutil
    from safetensors.numpy import save_file
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    params = ckpt.read_tensors(run / "model.safetensors", "w")
    params["embed.weight"][:] = np.nan
    save_file(params, str(run / "model.safetensors"))
    assert "non-finite" in one_line_error(["sample", "--ckpt", run, "--prompt", "a"], capsys)


# ---- prepare: one process per DATA, empty input, a failing write ends at once with the old data intact ----
def test_prepare_refuses_while_another_process_holds_the_data(tmp_path, tok, text_file, capsys):
    tok.save(tmp_path / "tok.json")
    data = tmp_path / "d"
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        sys.argv = ["nanoeuler", "prepare", "other.txt"]
        from nanoeuler.checkpoint import run_lock
        with run_lock({str(data)!r}, "data"):
            print("locked", flush=True)
            time.sleep(60)
        """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        line = one_line_error(["prepare", text_file, "--tokenizer", tmp_path / "tok.json", "--out", data,
                               "--no-progress"], capsys)
        assert f"pid {holder.pid}: nanoeuler prepare other.txt" in line
    finally:
        holder.kill()
        holder.wait()


def test_prepare_empty_input_is_an_error(tmp_path, tok, capsys):
    tok.save(tmp_path / "tok.json")
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "tiny.txt").write_text("Just one line.")
    assert "no documents" in one_line_error(["prepare", tmp_path / "empty.txt", "--tokenizer", tmp_path / "tok.json",
                                             "--out", tmp_path / "d", "--no-progress"], capsys)
    assert "too little text" in one_line_error(["prepare", tmp_path / "tiny.txt", "--tokenizer",
                                                tmp_path / "tok.json", "--out", tmp_path / "d", "--no-progress"], capsys)
    assert not list((tmp_path / "d").glob("*")) if (tmp_path / "d").exists() else True


def test_prepare_counts_documents_per_split(tmp_path, tok, text_file):
    """One big document held out by chunks: each split holds text of 1 document (was: val 0 documents)."""
    from nanoeuler.data.shards import prepare
    m = prepare([text_file], tok, tmp_path / "d", processes=1, progress=False)
    assert m["splits"]["train"]["documents"] == 1 and m["splits"]["val"]["documents"] == 1
    assert json.loads((tmp_path / "d" / "tokenizer.json").read_text()) == tok.to_dict()


@pytest.mark.parametrize("processes", [1, 2])
def test_prepare_full_disk_ends_promptly_with_old_data_intact(tmp_path, tok, text_file, capsys, monkeypatch,
                                                              processes):
    from nanoeuler.data import shards
    tok.save(tmp_path / "tok.json")
    data = tmp_path / "d"
    base = ["prepare", str(text_file), "--tokenizer", str(tmp_path / "tok.json"), "--out", str(data),
            "--no-progress", "--processes", str(processes)]
    assert main(base) == 0
    capsys.readouterr()
    before = snapshot(data)
    calls = {"n": 0}
    real_write = shards._ShardWriter.write

    def full_disk(self, ids):
        calls["n"] += 1
        if calls["n"] > 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(self, ids)

    monkeypatch.setattr(shards._ShardWriter, "write", full_disk)
    monkeypatch.setattr(shards, "CHUNK_CHARS", 2000)
    t0 = time.perf_counter()
    line = one_line_error(base + ["--shard-tokens", "1000", "--force"], capsys)
    assert time.perf_counter() - t0 < 60
    assert "disk is full" in line and "intact" in line
    assert snapshot(data) == before


def _die(batch):
    os._exit(9)


def test_dead_encoding_worker_ends_the_command(tok):
    """A worker killed mid-way (out of memory, kill -9) ends the command with one error, no hang."""
    import nanoeuler.tokenizer.tokenizer as T
    texts = ("hello world " * 2000 for _ in range(40))
    real = T._worker_encode
    T._worker_encode = _die
    try:
        t0 = time.perf_counter()
        with pytest.raises(UserError, match="encoding process died"):
            list(T.encode_parallel(tok, texts, processes=2, batch_bytes=1000))
        assert time.perf_counter() - t0 < 60
    finally:
        T._worker_encode = real


def test_no_traceback_ever(monkeypatch, capsys):
    """A bug (any exception) in a command is still one line, exit 1."""
    monkeypatch.setattr("nanoeuler.cli.info.run", lambda args: {}["boom"])
    line = one_line_error(["info", "small"], capsys)
    assert "internal error KeyError" in line


def test_deeply_nested_or_binary_json_is_one_line(run_dir, tmp_path, tok, text_file, capsys):
    """json.loads raises RecursionError on '[[[[...' and UnicodeDecodeError on binary junk: both one line."""
    import shutil
    from nanoeuler.data.shards import TokenShards, prepare
    prepare([text_file], tok, tmp_path / "d", processes=1, progress=False)
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    for junk in (b"[" * 200_000, b"\xff\xfe\x00garbage", b""):
        for path in (run / "config.json", run / "tokenizer.json", tmp_path / "d" / "manifest.json"):
            saved = path.read_bytes()
            path.write_bytes(junk)
            if path.name == "manifest.json":
                with pytest.raises(UserError):
                    TokenShards(tmp_path / "d", "train")
            else:
                one_line_error(["sample", "--ckpt", run, "--prompt", "a"], capsys)
            path.write_bytes(saved)
        (run / "trainer.json").write_bytes(junk)
        with pytest.raises(UserError):
            ckpt.check_trainer_state(ckpt.read_json(run / "trainer.json", "resume state"))


# ---- writes: never through a link, never over a file not named as the output, never over an input -------
def test_writes_never_follow_links_nor_replace_what_was_not_named(run_dir, text_file, tok, tmp_path, capsys):
    """Each writing command: a symlinked output, an existing output without --force, and an output that is,
    holds or lies inside an input are refused with one line, and nothing on disk changes."""
    import shutil
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    tok.save(tmp_path / "tok.json")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "mine.txt").write_text("my notes\n")
    (tmp_path / "linked").symlink_to(elsewhere, target_is_directory=True)
    (tmp_path / "linked.json").symlink_to(elsewhere / "mine.txt")
    existing = tmp_path / "existing.json"
    existing.write_text("keep me\n")
    (tmp_path / "existing.vocab").write_text("keep me too\n")
    (tmp_path / "fresh.vocab").write_text("a vocab file that is not fresh.json's\n")
    for name in ("sft", "dpo"):
        (tmp_path / name).mkdir()
    (tmp_path / "sft" / "offline_train.json").write_text("[]\n")
    (tmp_path / "dpo" / "pairs_heldout.jsonl").write_text("\n")
    prep = ["prepare", text_file, "--tokenizer", tmp_path / "tok.json", "--no-progress", "--out"]
    cases = [
        (prep + [tmp_path / "linked"], "symbolic link"),
        (prep + [run], "not token shards"),                                 # a checkpoint's tokenizer.json
        (prep + [tmp_path], "contains the input"),
        (["prepare", text_file, "--tokenizer", run, "--out", run, "--force"], "not token shards"),
        (["tokenizer", "train", text_file, "--vocab-size", "300", "--out", existing], "already exists"),
        (["tokenizer", "train", text_file, "--vocab-size", "300", "--out", tmp_path / "fresh.json"], "already exists"),
        (["tokenizer", "train", text_file, "--vocab-size", "300", "--out", tmp_path / "linked.json", "--force"],
         "symbolic link"),
        (["tokenizer", "train", text_file, "--vocab-size", "300", "--out", text_file, "--force"], "is the input"),
        (["tokenizer", "export", "--tokenizer", run, "--out", existing], "already exists"),
        (["tokenizer", "export", "--tokenizer", tmp_path / "tok.json", "--out", tmp_path / "tok.json", "--force"],
         "is the input"),
        (["export", "--ckpt", run, "--format", "hf", "--out", run, "--force"], "is the input"),
        (["export", "--ckpt", run, "--format", "hf", "--out", run / "hf", "--force"], "inside the input"),
        (["export", "--ckpt", run, "--format", "gguf", "--out", run / "m.gguf", "--force"], "inside the input"),
        (["export", "--ckpt", run, "--format", "hf", "--out", tmp_path, "--force"], "contains the input"),
        (["export", "--ckpt", run, "--format", "hf", "--out", tmp_path / "linked", "--force"], "symbolic link"),
        (["import", "--from", run, "--out", run / "x", "--force"], "inside the input"),
        (["import", "--from", run, "--out", "/", "--force"], "does not name"),
        (["import", "--from", run, "--out", ".", "--force"], "does not name"),
        (["sft-data", "--out", tmp_path / "sft"], "already exists"),
        (["sft-data", "--out", tmp_path / "linked", "--force"], "symbolic link"),
        (["dpo-data", "--out", tmp_path / "dpo"], "already exists"),
        (["dpo-data", "--out", ""], "empty"),                              # was: written into the current directory
        (["sft-data", "--out", ""], "empty"),
        (["train", "--data", tmp_path / "d", "--out", ""], "empty"),            # was: the default runs/small
        (["sft", "--base", run, "--out", ""], "empty"),                          # was: the current directory
        (["train", "--data", tmp_path / "d", "--out", tmp_path / "d"], "is the input"),
        (["train", "--data", tmp_path / "d", "--out", tmp_path / "linked"], "symbolic link"),
        (["train", "--data", tmp_path / "d", "--out", run], "not a training run"),
        (["sft", "--base", run, "--out", run], "is the input"),
        (["dpo", "--sft", run, "--out", run / "dpo"], "inside the input"),
        (["demo", "--out", tmp_path / "linked"], "symbolic link"),
        (["data", "alpaca", "--out", tmp_path / "linked"], "symbolic link"),
    ]
    assert main([str(a) for a in prep + [tmp_path / "d"]]) == 0       # a DATA directory for train's cases
    capsys.readouterr()
    before = snapshot(tmp_path)
    for argv, needle in cases:
        assert needle in one_line_error(argv, capsys), argv
    assert snapshot(tmp_path) == before


def test_no_command_writes_over_or_into_the_base_an_input_adapter_run_reads(run_dir, text_file, tmp_path, capsys):
    """An adapter run reads its base: every writing command that takes one refuses an output that is, holds or
    lies inside that base (also named through a link, or with the run named through one), even with --force,
    and nothing on disk changes (`lora merge --out BASE --force` replaced the base with exit 0)."""
    import shutil

    from nanoeuler.adapters import LoraConfig
    from nanoeuler.checkpoint import load_tokenizer, save_files
    from nanoeuler.training.lora import LoraModel
    base, run = tmp_path / "base", tmp_path / "run"
    shutil.copytree(run_dir, base)
    save_files(run, LoraModel.new(base, LoraConfig(2, 4.0), seed=0).checkpoint_writers(load_tokenizer(base)))
    (tmp_path / "alias").symlink_to(tmp_path, target_is_directory=True)    # base again, through a linked folder
    (tmp_path / "run-link").symlink_to(run, target_is_directory=True)
    (tmp_path / "books").mkdir()
    (tmp_path / "books" / "list.tsv").write_text("1\tAn Author\tA Title\n")
    via_link = tmp_path / "alias" / "base"
    short = ["--steps", "1", "--batch-size", "1", "--no-progress"]    # a case let through is one quick step
    cases = [
        (["lora", "merge", "--ckpt", run, "--out", base, "--force"], "is the base of the input"),
        (["lora", "merge", "--ckpt", tmp_path / "run-link", "--out", base, "--force"], "is the base of the input"),
        (["lora", "merge", "--ckpt", run, "--out", via_link, "--force"], "is the base of the input"),
        (["lora", "merge", "--ckpt", run, "--out", base / "merged"], "inside the base of the input"),
        (["lora", "merge", "--ckpt", run, "--out", run / "merged"], "inside the input"),
        (["export", "--ckpt", run, "--format", "hf", "--out", via_link, "--force"], "is the base of the input"),
        (["export", "--ckpt", run, "--format", "peft", "--out", base, "--force"], "is the base of the input"),
        (["sft", "--base", run, "--out", base / "sft", *short], "inside the base of the input"),
        (["dpo", "--sft", run, "--out", base / "dpo", *short], "inside the base of the input"),
        (["train", "--init-from", run, "--data", tmp_path / "d", "--out", base / "t", *short],
         "inside the base of the input"),
        (["dpo-data", "--from-model", run, "--out", base, "--force"], "is the base of the input"),
        (["tokenizer", "export", "--tokenizer", run, "--out", base / "tok.json", "--force"],
         "inside the base of the input"),
        (["prepare", text_file, "--tokenizer", run, "--out", base / "data"], "inside the base of the input"),
        (["prepare", text_file, "--tokenizer", run, "--out", run / "data"], "inside the input"),
        (["data", "gutenberg", "--books", tmp_path / "books" / "list.tsv", "--url", "http://127.0.0.1:9/{id}",
          "--retries", "0", "--out", tmp_path / "books"], "contains the input"),
    ]
    assert main([str(a) for a in ["prepare", text_file, "--tokenizer", base, "--no-progress", "--out",
                                  tmp_path / "d"]]) == 0       # a DATA directory for train's case
    capsys.readouterr()
    before = snapshot(tmp_path)
    for argv, needle in cases:
        assert needle in one_line_error(argv, capsys), argv
    assert snapshot(tmp_path) == before


def test_prepare_and_tokenizer_replace_their_own_output_with_force(text_file, tmp_path, capsys):
    """An existing output needs --force; with it the output (and only it) is replaced."""
    tok_path, data = tmp_path / "tok.json", tmp_path / "d"
    train_tok = ["tokenizer", "train", str(text_file), "--vocab-size", "300", "--out", str(tok_path), "--no-progress"]
    prep = ["prepare", str(text_file), "--tokenizer", str(tok_path), "--out", str(data), "--no-progress"]
    assert main(train_tok) == 0 and main(prep) == 0
    capsys.readouterr()
    assert "already exists" in one_line_error(train_tok, capsys)
    assert "already holds token shards" in one_line_error(prep, capsys)
    assert main(train_tok + ["--force"]) == 0 and main(prep + ["--force"]) == 0
    # the tokenizer a DATA directory carries may be the input: it is rewritten as it was
    data2 = tmp_path / "d2"
    data2.mkdir()
    (data2 / "tokenizer.json").write_bytes(tok_path.read_bytes())
    assert main(["prepare", str(text_file), "--tokenizer", str(data2 / "tokenizer.json"), "--out", str(data2),
                 "--no-progress"]) == 0
    other = Tokenizer.train([bundled_works()["hamlet"][:20000]], 280, progress=False)
    (tmp_path / "d3").mkdir()
    other.save(tmp_path / "d3" / "tokenizer.json")
    capsys.readouterr()
    assert "another tokenizer.json" in one_line_error(prep[:-3] + ["--out", str(tmp_path / "d3"), "--no-progress"],
                                                      capsys)


def test_paths_that_cannot_be_looked_at_are_one_line(run_dir, tmp_path, capsys):
    """A name longer than the filesystem allows (checked while parsing the flags) and a NUL character
    (from an in-process caller) are one line, not a traceback or an internal error."""
    long = tmp_path / ("n" * 300)
    for argv in (["tokenizer", "export", "--tokenizer", run_dir, "--out", long],
                 ["prepare", "--tokenizer", run_dir, "--out", long],
                 ["import", "--from", tmp_path, "--out", tmp_path / "a\x00b"],
                 ["sample", "--ckpt", run_dir, "--prompt", "a\x00"]):
        line = one_line_error(argv, capsys)
        assert "internal error" not in line, argv
    assert os.listdir(tmp_path) == []


def test_an_empty_value_is_not_the_default(run_dir, text_file, tmp_path, capsys):
    """export --dtype '' and prepare --mix '' are refused (were: the default dtype, no mix)."""
    for fmt in ("hf", "gguf"):
        assert "--dtype" in one_line_error(["export", "--ckpt", run_dir, "--format", fmt, "--dtype", "",
                                            "--out", tmp_path / f"o.{fmt}"], capsys)
    assert "--mix" in one_line_error(["prepare", text_file, "--tokenizer", run_dir, "--mix", "", "--no-progress",
                                      "--out", tmp_path / "d"], capsys)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("arch", ["euler", "phi3"])   # (phi3: q|k|v and gate|up fused in the folder's tensors)
def test_a_folder_with_non_finite_weights_is_named_not_blamed_on_training(tmp_path, tok, arch, capsys):
    """Every import path checks the file's weights as the GGUF import does: a NaN in a Hugging Face folder's
    tensor was reported by the save as 'the training diverged ... the previous checkpoint'."""
    from safetensors.numpy import load_file, save_file

    from nanoeuler.interop.hf import export_hf
    model = Model.init(tiny_config(arch=arch, vocab_size=tok.vocab_size, ctx_len=32), seed=0)
    folder = export_hf(model, tok, tmp_path / "hf", progress=False)
    tensors = load_file(folder / "model.safetensors")
    name = next(n for n in tensors if n.endswith("proj.weight"))
    tensors[name][0, :2] = [np.nan, np.inf]
    save_file(tensors, folder / "model.safetensors")
    err = one_line_error(["import", "--from", folder, "--out", tmp_path / "out"], capsys)
    assert "non-finite" in err and str(folder) in err and "diverged" not in err and "--lr" not in err
    assert not (tmp_path / "out").exists()
