"""`nanoeuler bench --decode`: llama-bench's pp/tg figures for our engine, on a checkpoint or a .gguf file."""
import json

import pytest
from conftest import tiny_config
from test_cli_errors import one_line_error

from nanoeuler import Model
from nanoeuler.cli import main
from nanoeuler.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    from nanoeuler.data.corpus import bundled_works
    tok = Tokenizer.train([bundled_works()["hamlet"][:20000]], 300, progress=False)
    d = tmp_path_factory.mktemp("bench") / "run"
    # two MTP heads: head 1 is not read by decoding, so it must not count in the size or the parameters;
    # rows of 32 and 64 weights: the block types (32 a block) can quantize every matrix
    cfg = tiny_config(vocab_size=tok.vocab_size, dim=32, ffn_hidden=64, ctx_len=24, n_mtp=2)
    Model.init(cfg, seed=0).save(d, tokenizer=tok)
    return d


def matrix_bytes(m, dtype: str) -> int:
    """Bytes of the matrices decoding reads (head 1 left out) at dtype, and the float32 norms beside them."""
    per32 = {"float32": 128, "float16": 64, "q8_0": 34, "q4_0": 18, "q4_1": 20}[dtype]
    used = {n: p for n, p in m.params.items() if n != "heads.1.weight"}
    return sum(p.size * per32 // 32 if p.ndim == 2 else 4 * p.size for p in used.values())


def bench_json(argv, capsys) -> dict:
    assert main(["bench", "--decode", "--json", "--repeat", "3", "--warmup", "1", *map(str, argv)]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("dtype", ["float32", "float16", "q8_0", "q4_0", "q4_1"])
def test_decode_bench_fields(run_dir, capsys, dtype):
    if dtype.startswith("q"):
        from nanoeuler.infer import qkernels
        if not qkernels.AVAILABLE:
            pytest.skip("this CPU has neither AVX2 nor AVX512-VNNI")
    r = bench_json(["--ckpt", run_dir, "--dtype", dtype, "--threads", "1"], capsys)
    m = Model.load(run_dir)
    head1 = m.params["heads.1.weight"].size
    assert r["n_params"] == m.n_params() - head1
    # float16 rounds the norms too (Float16Model), the block types keep them float32
    assert r["size_bytes"] == (2 * r["n_params"] if dtype == "float16" else matrix_bytes(m, dtype))
    assert r["dtype"] == dtype and r["threads"] == 1 and r["model"] == "run"
    pp, tg = r["tests"]
    # the context (24) bounds both tests: pp takes it whole, tg leaves room for its first token
    assert (pp["test"], pp["n_prompt"], pp["n_gen"]) == ("pp24", 24, 0)
    assert (tg["test"], tg["n_prompt"], tg["n_gen"]) == ("tg23", 0, 23)
    for t in (pp, tg):
        assert len(t["samples"]) == 3 and all(s > 0 for s in t["samples"])
        assert t["min"] <= t["tokens_per_s"] <= t["max"] and t["tokens_per_s"] in t["samples"]


def test_decode_bench_table_and_gguf(run_dir, tmp_path, capsys):
    pytest.importorskip("gguf")
    from nanoeuler.checkpoint import load_tokenizer
    from nanoeuler.interop.gguf_export import export_gguf
    m = Model.load(run_dir)
    path = export_gguf(m, load_tokenizer(run_dir), tmp_path / "m.gguf", "f32", progress=False)
    r = bench_json(["--ckpt", path, "--n-prompt", "8", "--n-gen", "4"], capsys)
    assert r["model"] == "m.gguf" and r["n_params"] == m.n_params() - m.params["heads.1.weight"].size
    assert r["dtype"] == "float32"
    assert [t["test"] for t in r["tests"]] == ["pp8", "tg4"]
    assert main(["bench", "--decode", "--ckpt", str(path), "--repeat", "1", "--warmup", "0"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "t/s" in out[0] and [ln.split("|")[6].strip() for ln in out[2:4]] == ["pp24", "tg23"]


def test_a_quantized_gguf_decodes_in_its_own_type(run_dir, tmp_path, capsys):
    pytest.importorskip("gguf")
    from nanoeuler.checkpoint import load_tokenizer
    from nanoeuler.infer import qkernels
    from nanoeuler.interop.gguf_export import export_gguf
    if not qkernels.AVAILABLE:
        pytest.skip("this CPU has neither AVX2 nor AVX512-VNNI")
    m = Model.load(run_dir)
    path = export_gguf(m, load_tokenizer(run_dir), tmp_path / "m.gguf", "q4_1", progress=False)
    r = bench_json(["--ckpt", path, "--n-prompt", "8", "--n-gen", "4"], capsys)
    one_head = Model(m.config.replace(n_mtp=1), {n: p for n, p in m.params.items() if n != "heads.1.weight"})
    assert r["dtype"] == "q4_1" and r["size_bytes"] == matrix_bytes(one_head, "q4_1")
    assert bench_json(["--ckpt", path, "--dtype", "float16", "--n-gen", "4"], capsys)["dtype"] == "float16"


@pytest.mark.parametrize("argv, needle", [
    (["--decode", "--ckpt", "{run}", "--dtype", "q3_x"], "--dtype"),
    (["--decode", "--ckpt", "{run}", "--threads", "0"], "--threads"),
    (["--decode", "--ckpt", "{run}", "--threads", "100000"], "more than the"),
    (["--decode", "--ckpt", "{run}", "--n-prompt", "100000"], "--n-prompt 100000 does not fit"),
    (["--decode", "--ckpt", "{run}", "--n-gen", "100000"], "--n-gen 100000 does not fit"),
    (["--decode", "--ckpt", "{run}", "--repeat", "0"], "--repeat"),
    (["--decode", "--ckpt", "{missing}"], "missing"),
    (["--decode"], "--ckpt"),
    (["--decode", "small", "--ckpt", "{run}"], "preset"),
    (["--decode", "--ckpt", "{run}", "--steps", "3"], "--steps"),
    (["small", "--dtype", "float16"], "--dtype"),
    (["small", "--ckpt", "{run}"], "--ckpt"),
])
def test_decode_bench_bad_input(run_dir, tmp_path, capsys, argv, needle):
    argv = [a.format(run=run_dir, missing=tmp_path / "missing") for a in argv]
    assert needle in one_line_error(["bench", *argv], capsys)
