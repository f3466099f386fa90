"""`import --from FILE.gguf`: weights equal gguf's own dequantization, import(export(ckpt)) == ckpt at f32,
the tokenizer equals the Hugging Face import of the same vocabulary, what a file leaves out reads as llama.cpp
reads it, bad files are one line and write nothing."""
from __future__ import annotations

import json
import random
import re
import struct
import tracemalloc
import warnings

import numpy as np
import pytest

pytest.importorskip("gguf")
import gguf  # noqa: E402
from conftest import rel_err, tiny_config  # noqa: E402
from gguf_fixtures import (CHATML, chatml_model, chatml_tokenizer, edit_gguf, patch_tensor_info,  # noqa: E402
                           write_gguf)

from nanoeuler import Model  # noqa: E402
from nanoeuler.checkpoint import load_tokenizer  # noqa: E402
from nanoeuler.errors import UserError  # noqa: E402
from nanoeuler.infer.quant import block_types  # noqa: E402
from nanoeuler.interop.gguf_export import export_gguf, unpermute_qk  # noqa: E402
from nanoeuler.interop.gguf_import import import_gguf, load_gguf  # noqa: E402
from nanoeuler.interop.pretokenizers import PRE_BY_NAME, PRE_FAMILIES, pre_name  # noqa: E402

TEXTS = ["Hello, world!", "  two  spaces\n\nand lines\t", "numbers 1234567 and 3.14", "ümlaut café 日本",
         "<|im_start|>user\nhi<|im_end|>\n", "don't I'll WE'RE", ""]


@pytest.fixture(scope="module")
def tok():
    return chatml_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    return chatml_model(tok)


@pytest.mark.parametrize("qtype", ["F16", "Q8_0", "Q4_0", "Q4_1", "Q6_K"])
def test_weights_equal_gguf_dequantize_and_types_are_recorded(tmp_path, model, tok, qtype):
    path = write_gguf(tmp_path / "m.gguf", model, tok, qtype)
    cfg, P, _, source = load_gguf(path)
    want = {t.name: gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))
            for t in gguf.GGUFReader(path).tensors}
    for i in range(cfg.n_layers):
        want[f"blk.{i}.attn_q.weight"] = unpermute_qk(want[f"blk.{i}.attn_q.weight"], cfg.n_heads)
        want[f"blk.{i}.attn_k.weight"] = unpermute_qk(want[f"blk.{i}.attn_k.weight"], cfg.n_kv_heads)
    ours = {"token_embd.weight": "embed.weight", "output.weight": "heads.0.weight", "output_norm.weight": "norm.weight",
            "blk.1.attn_q.weight": "layers.1.attn.wq.weight", "blk.0.attn_k.weight": "layers.0.attn.wk.weight",
            "blk.1.attn_v.weight": "layers.1.attn.wv.weight", "blk.0.ffn_down.weight": "layers.0.ffn.down.weight",
            "blk.1.ffn_norm.weight": "layers.1.ffn_norm.weight"}
    for g, n in ours.items():
        assert np.array_equal(P[n], want[g]), g
    assert source["tensor_types"]["embed.weight"] == qtype
    assert source["tensor_types"]["norm.weight"] == "F32"
    assert source["tensor_types"]["layers.0.attn.wq.weight"] == qtype
    if qtype != "Q6_K":  # the gguf package quantized our weights: the result is near them, not equal
        err = np.abs(P["layers.1.attn.wq.weight"] - model.params["layers.1.attn.wq.weight"]).max()
        assert 0 < err < 0.05


def test_q_and_k_to_decode_are_the_files_rows_reordered_not_a_copy(tmp_path, model, tok, monkeypatch):
    """load_gguf(blocks=True) keeps each matrix a view of the mapped file, q and k too, whose rows llama.cpp
    orders otherwise: a checkpoint.Reordered over the file's rows (no copy held beside their kernel form), whose
    values are the float import's; the layout keeps them so (its NumPy path copies them per use only), and both
    decoding paths give the float import's logits."""
    import nanoeuler.checkpoint as checkpoint
    from nanoeuler.infer import forward, kernels, step
    from nanoeuler.infer.cache import new_cache
    from nanoeuler.infer.weights import QuantizedModel, of_dtype
    path = write_gguf(tmp_path / "m.gguf", model, tok, "Q8_0")
    cfg, P, _, _ = load_gguf(path, blocks=True)
    _, F, _, _ = load_gguf(path)
    t = QuantizedModel.from_blocks(cfg, P).params
    for i in range(cfg.n_layers):
        q, k, v = (P[f"layers.{i}.attn.{w}.weight"] for w in ("wq", "wk", "wv"))
        assert isinstance(q, checkpoint.Reordered) and isinstance(k, checkpoint.Reordered)
        assert checkpoint.file_map(q.base) is not None and checkpoint.file_map(v) is not None
        for w, a in (("wq", q), ("wk", k)):
            name = f"layers.{i}.attn.{w}.weight"
            assert np.array_equal(of_dtype(a.dtype).values(np.asarray(a)), F[name]), name
    dropped = []
    monkeypatch.setattr(forward, "drop_pages", lambda arrays: dropped.extend(arrays) or 0)
    W = step.fuse_weights(cfg, t)
    assert W["layers.0.qkv"][0][0] is P["layers.0.attn.wq.weight"]   # the raw part itself, no copy
    assert any(a is P["layers.0.attn.wq.weight"] for a in dropped)   # its file pages let go once packed
    tokens = np.arange(1, 3 * kernels.ROWS, 2)[None] % cfg.vocab_size   # more rows than the kernels' products take
    WF = step.fuse_weights(cfg, F)
    cache = lambda: new_cache(cfg, 1, tokens.shape[1])   # noqa: E731
    want = step.head_logits(cfg, WF, forward.forward_hidden(cfg, WF, tokens, cache()))
    ref = step.head_logits(cfg, W, forward.forward_hidden(cfg, W, tokens, cache()))   # the NumPy path
    assert rel_err(ref, want) < 1e-5
    if kernels.ENABLED:
        fused = step.head_logits(cfg, W, step.forward_hidden(cfg, W, tokens, cache()))
        l2 = np.linalg.norm(fused - want) / np.linalg.norm(want)
        assert l2 < 5e-2   # activations rounded to 8 bits per block, as llama.cpp does (q, k misordered: ~1)


@pytest.mark.parametrize("tied", [False, True])
def test_import_of_export_is_the_checkpoint_bitwise_at_f32(tmp_path, model, tok, tied):
    m = model if not tied else chatml_model(tok, tied=True)
    run = tmp_path / "run"
    m.save(run, tok)
    path = export_gguf(Model.load(run), load_tokenizer(run), tmp_path / "m.gguf", "f32", progress=False)
    cfg, params, tok2 = import_gguf(path, tmp_path / "back", progress=False)
    assert cfg == m.config
    for n, a in m.params.items():
        assert np.array_equal(params[n], a), n
    back = Model.load(tmp_path / "back")
    assert all(np.array_equal(back.params[n], a) for n, a in m.params.items())
    assert [tok2.encode(t, allow_special=True) for t in TEXTS] == [tok.encode(t, allow_special=True) for t in TEXTS]
    types = json.loads((tmp_path / "back" / "source.json").read_text())["tensor_types"]
    assert set(types.values()) == {"F32"} and set(types) == set(m.params)


def test_tokenizer_equals_the_hf_import_of_the_same_vocabulary(tmp_path, model, tok):
    from nanoeuler.interop.hf import export_hf
    from nanoeuler.interop.hf import load_hf_folder
    export_hf(model, tok, tmp_path / "hf", progress=False)
    _, _, hf_tok = load_hf_folder(tmp_path / "hf")
    _, _, g_tok, _ = load_gguf(write_gguf(tmp_path / "m.gguf", model, tok))
    text = " ".join(TEXTS) + " " + model.__class__.__name__
    for t in [*TEXTS, text]:
        assert g_tok.encode(t, allow_special=True) == hf_tok.encode(t, allow_special=True)
        assert g_tok.encode(t) == hf_tok.encode(t)
    assert g_tok.special_tokens == hf_tok.special_tokens
    # a reply ends at eos and, as llama.cpp ends generation there by its text, at <|endoftext|>
    assert g_tok.chat_template == CHATML and g_tok.stop_ids == [tok.special_tokens[t] for t in ("<|im_end|>", "<|endoftext|>")]


def test_the_files_ids_are_kept(tmp_path, model, tok):
    """A vocabulary in another order (specials first, as SmolLM's): ids and embedding rows stay the file's."""
    from nanoeuler.interop.gguf_export import token_metadata
    toks, _, _ = token_metadata(tok, tok.vocab_size)
    _, P, g_tok, _ = load_gguf(write_gguf(tmp_path / "m.gguf", model, tok))
    assert [g_tok.decode([i]) for i in range(256, 270)] == [bytes(gguf_bytes(s)).decode("utf-8", "replace")
                                                            for s in toks[256:270]]
    assert np.array_equal(P["embed.weight"], model.params["embed.weight"])


def gguf_bytes(s: str) -> list[int]:
    from nanoeuler.tokenizer import bytes_to_unicode
    inv = {c: b for b, c in enumerate(bytes_to_unicode())}
    return [inv[c] for c in s]


def test_cli_import_gguf_and_info(tmp_path, model, tok, capsys):
    from nanoeuler.cli import main
    path = write_gguf(tmp_path / "m.gguf", model, tok, "Q8_0")
    assert main(["import", "--from", str(path), "--out", str(tmp_path / "run"), "--no-progress"]) == 0
    assert "imported" in capsys.readouterr().out
    assert main(["sample", "--ckpt", str(tmp_path / "run"), "--prompt", "Hi", "--max-new-tokens", "4",
                 "--temperature", "0"]) == 0
    capsys.readouterr()
    assert main(["info", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "source       gguf m.gguf: Q8_0 x16, F32 x5 tensors" in out  # embedding, 7 x 2 layers, output
    assert "MiB of tensors in the source file" in out and "MiB in memory (float32)" in out
    # the file itself, without importing it: what the imported checkpoint says (config, tensor types, memory)
    assert main(["info", str(path)]) == 0 and capsys.readouterr().out == out
    assert main(["info", str(path), "--json"]) == 0 and main(["info", str(tmp_path / "run"), "--json"]) == 0
    of_file, of_run = map(json.loads, capsys.readouterr().out.splitlines())
    del of_run["source"]["weights"]   # (the checkpoint's record of which weights its blocks belong to)
    assert of_file == of_run and of_file["config"]["n_layers"] == 2 and of_file["source"]["tensor_types"]


@pytest.mark.parametrize("content, said", [
    (b"\x97 not text", "config: {path} is not valid JSON"),                         # neither JSON nor GGUF:
    (b"GGUF\x03\x00", "{path} is not a readable GGUF file: it ends inside a field"),   # a GGUF cut short
])
def test_info_of_a_file_it_cannot_read_is_one_line(tmp_path, content, said, capsys):
    """`info FILE` read any file as a config.json ("is not valid JSON" for a GGUF file): now a GGUF file is
    described, and any other file is one line saying what info takes."""
    from nanoeuler.cli import main
    path = tmp_path / "model.bin"
    path.write_bytes(content)
    assert main(["info", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: " + said.format(path=path)) and err.count("\n") == 1
    from nanoeuler.config import PRESETS
    assert err.rstrip().endswith(f"info takes a preset ({', '.join(PRESETS)}), a config.json, a checkpoint directory "
                                 "or a GGUF file") or content.startswith(b"GGUF")


@pytest.mark.parametrize("pre", ["default", None])
def test_default_pre_tokenizer_is_llama_cpps_cascade(tmp_path, model, tok, pre, capsys):
    """`default`, or no pre-tokenizer named (llama.cpp falls back to `default`, and so do we, with a warning line),
    is the cascade; export writes it back as `default`, so export -> import keeps it."""
    from nanoeuler.interop.hf_tokenizer import DEFAULT_CASCADE
    path = write_gguf(tmp_path / "m.gguf", model, tok, pre=pre)
    import_gguf(path, tmp_path / "run", progress=False)
    err = capsys.readouterr().err
    assert ("warning: the GGUF file names no tokenizer.ggml.pre" in err) == (pre is None)
    g_tok = load_tokenizer(tmp_path / "run")
    assert g_tok.pattern == DEFAULT_CASCADE
    assert g_tok.pre_tokens("It's 1234567!") == ["It", "'", "s", " ", "123", "456", "7", "!"]
    again = export_gguf(Model.load(tmp_path / "run"), g_tok, tmp_path / "again.gguf", "f32", progress=False)
    assert gguf.GGUFReader(str(again)).fields["tokenizer.ggml.pre"].contents() == "default"
    _, _, back, _ = load_gguf(again)
    assert back.pattern == DEFAULT_CASCADE and back.fingerprint() == g_tok.fingerprint()


@pytest.mark.parametrize("pattern", [[r"\p{L}+", r"\p{N}"], r"\p{L}+|\P{L}+"])
def test_export_refuses_a_pattern_llama_cpp_cannot_name(tmp_path, model, tok, pattern):
    """llama.cpp splits by the name it reads: writing `default` for another pattern would import as another split."""
    from nanoeuler.tokenizer import Tokenizer
    other = Tokenizer.from_dict(tok.to_dict() | {"pattern": pattern})
    with pytest.raises(UserError, match="llama.cpp names no pre-tokenizer that splits as this tokenizer's pattern"):
        export_gguf(model, other, tmp_path / "m.gguf", "f32", progress=False)
    assert not (tmp_path / "m.gguf").exists()


@pytest.mark.parametrize("name", ["afmoe", "tiny_aya", "superbpe"])
def test_digits_by_threes_split_a_long_run_in_linear_time(name):
    """llama.cpp's digit grouping as a regex looks ahead over the whole run once, at its start: a lookahead at every
    group (superbpe's: at every digit) made 300,000 digits quadratic, past the pre-tokenizer's time bound (a
    UserError instead of the pieces)."""
    from nanoeuler.tokenizer.pretokenize import pretokenize
    pieces = pretokenize("x" + "1" * 300_001 + "y", PRE_BY_NAME[name].pattern)
    assert pieces[:3] == ["x", "1", "111"] and pieces[-2:] == ["111", "y"] and len(pieces) == 100_003  # 1 + 3·100,000


def test_superbpe_cuts_as_its_lookahead_does():
    """superbpe's cascade as llama.cpp names it (a zero-width cut before every three digits counted from a run's end)
    and ours (a match from one cut to the next, linear in a run's length) cut every text alike: random mixes of
    ASCII and other digits, letters and whitespace, where runs end at every length modulo 3."""
    from nanoeuler.tokenizer.pretokenize import pretokenize
    rng = random.Random(0)
    alphabet = list("0123456789" * 3) + ["٣", "½", "Ⅻ", "a", "x", " ", "\n"]
    texts = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30))) for _ in range(3000)]
    zero_width = (r"\p{N}+", r"(?=([0-9]{3})+(?![0-9]))")
    assert PRE_BY_NAME["superbpe"].pattern != zero_width
    for text in texts + ["٣1234", "1234٣", "123٣456٣7", "12345٣67", "1234567 89"]:
        assert pretokenize(text, PRE_BY_NAME["superbpe"].pattern) == pretokenize(text, zero_width), text


@pytest.mark.parametrize("family", sorted(PRE_FAMILIES))
def test_every_pre_tokenizer_family_exports_back_to_itself(tmp_path, model, tok, family):
    """A file of each pre-tokenizer llama.cpp knows, imported then exported, names a pre-tokenizer that splits and
    merges as the import does (export knew 5 patterns: an imported deepseek or command-r vocabulary was refused;
    and it took a pattern's name without asking whether the tokenizer ignores merges as that name does)."""
    name = PRE_FAMILIES[family].names[0]
    run = tmp_path / "run"
    import_gguf(write_gguf(tmp_path / "m.gguf", model, tok, pre=name), run, progress=False)
    g_tok = load_tokenizer(run)
    again = export_gguf(Model.load(run), g_tok, tmp_path / "again.gguf", "f32", progress=False)
    pre = gguf.GGUFReader(str(again)).fields["tokenizer.ggml.pre"].contents()
    assert PRE_FAMILIES[family].pattern == PRE_BY_NAME[pre].pattern
    assert load_gguf(again)[2].fingerprint() == g_tok.fingerprint()
    flipped = type(g_tok).from_dict(g_tok.to_dict() | {"ignore_merges": not g_tok.ignore_merges})
    if pre_name(flipped.pattern, flipped.ignore_merges) is None:   # no family splits so and merges otherwise
        with pytest.raises(UserError, match="names no pre-tokenizer"):
            export_gguf(Model.load(run), flipped, tmp_path / "flipped.gguf", "f32", progress=False)


def test_user_defined_tokens_export_as_user_defined(tmp_path, model, tok):
    """USER_DEFINED tokens (cut out of any text, by llama.cpp and by us) were exported as CONTROL, which llama.cpp
    cuts out only when asked to parse specials: an import -> export -> llama.cpp round trip encoded otherwise."""
    path = write_gguf(tmp_path / "m.gguf", model, tok)
    types = gguf.GGUFReader(str(path)).fields["tokenizer.ggml.token_type"].contents()
    special = tok.special_tokens["<|im_start|>"]
    types[special] = int(gguf.TokenType.USER_DEFINED)
    import_gguf(edit_gguf(path, tmp_path / "u.gguf", change={"tokenizer.ggml.token_type": types}), tmp_path / "run",
                progress=False)
    g_tok = load_tokenizer(tmp_path / "run")
    assert "<|im_start|>" in g_tok.user_defined
    again = export_gguf(Model.load(tmp_path / "run"), g_tok, tmp_path / "again.gguf", "f32", progress=False)
    back = gguf.GGUFReader(str(again)).fields["tokenizer.ggml.token_type"].contents()
    assert back[special] == gguf.TokenType.USER_DEFINED and back == types[:len(back)]
    assert load_gguf(again)[2].fingerprint() == g_tok.fingerprint()


# --------------------------------------------------------------------------------------------- bad input

def refused(tmp_path, path, match):
    out = tmp_path / "out"
    with pytest.raises(UserError, match=match):
        import_gguf(path, out, progress=False)
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


def test_truncated_file_is_refused(tmp_path, model, tok):
    data = write_gguf(tmp_path / "m.gguf", model, tok).read_bytes()
    for cut in (3, 20, 200, len(data) // 2, len(data) - 1):
        (tmp_path / "t.gguf").write_bytes(data[:cut])
        refused(tmp_path, tmp_path / "t.gguf", "not a readable GGUF file|missing|cannot be read")


@pytest.mark.parametrize("offset, what", [(8, "tensor count"), (16, "kv count")])
def test_absurd_counts_are_refused(tmp_path, model, tok, offset, what):
    data = bytearray(write_gguf(tmp_path / "m.gguf", model, tok).read_bytes())
    struct.pack_into("<Q", data, offset, 2**62)
    (tmp_path / "t.gguf").write_bytes(bytes(data))
    refused(tmp_path, tmp_path / "t.gguf", "not a readable GGUF file")


def test_tensor_data_past_the_end_is_refused(tmp_path, model, tok):
    r = gguf.GGUFReader(write_gguf(tmp_path / "m.gguf", model, tok))
    end = min(t.data_offset for t in r.tensors if t.name == "output.weight")
    data = (tmp_path / "m.gguf").read_bytes()
    (tmp_path / "t.gguf").write_bytes(data[:end + 10])
    refused(tmp_path, tmp_path / "t.gguf", "not a readable GGUF file")


def test_a_shape_that_disagrees_with_the_metadata_is_refused(tmp_path, model, tok):
    bad = np.zeros((256, 128), np.float32)
    path = write_gguf(tmp_path / "m.gguf", model, tok, shapes={"blk.1.ffn_up.weight": bad})
    refused(tmp_path, path, r"blk.1.ffn_up.weight has shape \[256, 128\], expected \[256, 256\]")


def test_a_vocabulary_that_disagrees_with_the_embedding_is_refused(tmp_path, model, tok):
    from nanoeuler.interop.gguf_export import token_metadata
    toks, _, _ = token_metadata(tok, tok.vocab_size)
    path = write_gguf(tmp_path / "m.gguf", model, tok, tokens=toks + ["<|extra|>"])
    refused(tmp_path, path, f"{tok.vocab_size + 1:,} tokens, more than the model's {tok.vocab_size:,} embedding rows")


@pytest.mark.parametrize("meta, match", [
    ({"general.architecture": "mamba"}, "architecture 'mamba' is not supported"),   # (a state-space model)
    ({"tokenizer.ggml.model": "plamo2"}, r"'plamo2' \(PLaMo-2's\) is not supported"),
    ({"tokenizer.ggml.model": "rwkv"}, r"'rwkv' \(RWKV's trie\) is not supported"),
    ({"tokenizer.ggml.model": "mystery"}, r"'mystery' is not supported; supported: gpt2 \(byte-level BPE\), llama"),
    ({"tokenizer.ggml.pre": "roberta-bpe"}, "tokenizer.ggml.pre 'roberta-bpe' is not supported: it appends a sep"),
    ({"tokenizer.ggml.pre": "no-such-pre"}, "tokenizer.ggml.pre 'no-such-pre' is not a pre-tokenizer llama.cpp knows"),
    ({"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0, "llama.rope.scaling.yarn_beta_fast": 16.0},
     "llama.rope.scaling.yarn_beta_fast = 16.0 is not supported"),   # (llama.cpp reads no beta: it computes 32)
    ({"llama.attention.sliding_window": 64}, "sliding_window = 64 is not supported"),
])
def test_unsupported_fields_are_refused_by_name(tmp_path, model, tok, meta, match):
    path = write_gguf(tmp_path / "m.gguf", model, tok)
    patched = rewrite_meta(path, tmp_path / "p.gguf", meta)
    refused(tmp_path, patched, match)


@pytest.mark.parametrize("key, value", [
    ("rope.scaling.type", "dynamic"), ("rope.scaling.attn_factor", 0.5),
    ("rope.scaling.original_context_length", 4096), ("rope.scaling.yarn_ext_factor", 1.0),
    ("rope.scaling.yarn_log_multiplier", 0.1), ("rope.scaling.alpha", 1000.0),
])
def test_rope_scaling_is_refused_by_name(tmp_path, model, tok, key, value):
    """Every RoPE-scaling key llama.cpp applies beyond a linear factor, at a value that scales: refused by name
    (scale_linear = 4 was ignored, and the import computed another model than llama.cpp does: now linear scaling,
    test_a_linear_factor_imports_in_each_spelling)."""
    path = rewrite_meta(write_gguf(tmp_path / "m.gguf", model, tok), tmp_path / "p.gguf", {f"llama.{key}": value})
    refused(tmp_path, path, f"llama.{key} = {value!r} is not supported .RoPE scaling")


@pytest.mark.parametrize("meta", [{"rope.scaling.factor": 4.0}, {"rope.scale_linear": 4.0},
                                  {"rope.scaling.type": "linear", "rope.scaling.factor": 4.0},
                                  {"rope.scaling.factor": 4.0, "rope.scale_linear": 2.0, "rope.freq_scale": 0.5}])
def test_a_linear_factor_imports_in_each_spelling(tmp_path, model, tok, meta):
    """llama.cpp's linear RoPE scaling, however the file spells it, is the config's linear scaling by 4."""
    path = rewrite_meta(write_gguf(tmp_path / "m.gguf", model, tok), tmp_path / "p.gguf",
                        {f"llama.{k}": v for k, v in meta.items()})
    cfg = load_gguf(path)[0]
    assert cfg == model.config.replace(rope_scaling="linear", rope_factor=4.0)
    read = "rope.scaling.factor" if "rope.scaling.factor" in meta else "rope.scale_linear"
    refused(tmp_path, rewrite_meta(path, tmp_path / "s.gguf", {f"llama.{read}": "4"}),
            f"llama.{read} = '4' is not a number")


@pytest.mark.parametrize("meta", [{"rope.scaling.factor": 1.0, "rope.scale_linear": 4.0},
                                  {"rope.scaling.factor": 0.0, "rope.scale_linear": 4.0}, {"rope.freq_scale": 0.25}])
def test_the_linear_factor_is_the_key_llama_cpp_reads(tmp_path, model, tok, meta):
    """llama.cpp reads rope.scale_linear only where rope.scaling.factor is absent (its value 0 or 1: no scaling),
    and no rope.freq_scale at all: these files were imported with a factor of 4, llama.cpp computes plain RoPE."""
    path = rewrite_meta(write_gguf(tmp_path / "m.gguf", model, tok), tmp_path / "p.gguf",
                        {f"llama.{k}": v for k, v in meta.items()})
    assert load_gguf(path)[0] == model.config


def test_neutral_rope_scaling_values_import(tmp_path, model, tok):
    """The values that leave RoPE unscaled (llama.cpp's defaults, or what computes the same) import."""
    neutral = {"llama.rope.scale_linear": 1.0, "llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 0.0,
               "llama.rope.scaling.attn_factor": 1.0, "llama.rope.freq_scale": 1.0,
               "llama.rope.scaling.original_context_length": model.config.ctx_len}
    path = rewrite_meta(write_gguf(tmp_path / "m.gguf", model, tok), tmp_path / "p.gguf", neutral)
    cfg, params, _, _ = load_gguf(path)
    assert cfg == model.config and all(np.array_equal(params[n], model.params[n]) for n in params)


def test_rope_freqs_import_as_llama3_where_they_are_its_else_as_per_pair_factors(tmp_path, model, tok):
    """llama.cpp's rope_freqs tensor (each pair's frequency divisor; its converter writes Llama 3.x's): llama3
    scaling where it is Llama 3.1's of its largest factor, else the factors as they are, which a Hugging Face
    export refuses in one line (transformers has no such scaling); a tensor of the wrong size is refused."""
    from nanoeuler.interop.hf import export_hf
    path = write_gguf(tmp_path / "m.gguf", model, tok)
    llama3 = model.config.replace(rope_scaling="llama3", rope_factor=8.0)
    other = np.linspace(1.0, 3.0, model.config.head_dim // 2).astype(np.float32)   # kept as the file holds them
    for factors, want in ((llama3.rope_factors(), llama3),
                          (other, model.config.replace(rope_scaling="factors", rope_freq_factors=other.tolist()))):
        patched = rewrite_meta(path, tmp_path / "p.gguf", {}, extra_tensor=("rope_freqs.weight",
                                                                             factors.astype(np.float32)))
        cfg, params, _, _ = load_gguf(patched)
        assert cfg == want and len(set(factors.round(3))) > 3
    with pytest.raises(UserError, match="transformers has no RoPE scaling of per-pair factors"):
        export_hf(Model(cfg, params), tok, tmp_path / "hf", progress=False)
    assert not (tmp_path / "hf").exists()
    wrong = rewrite_meta(path, tmp_path / "w.gguf", {}, extra_tensor=("rope_freqs.weight", np.ones(3, np.float32)))
    refused(tmp_path, wrong, r"tensor rope_freqs.weight: 3 factors \(64 turned dimensions want 32")


def test_vocab_size_must_be_the_embeddings_rows_as_an_integer(tmp_path, model, tok):
    n = model.config.vocab_size
    path = write_gguf(tmp_path / "m.gguf", model, tok)
    refused(tmp_path, rewrite_meta(path, tmp_path / "s.gguf", {"llama.vocab_size": str(n)}),
            f"llama.vocab_size = '{n}' is not a non-negative integer")
    refused(tmp_path, rewrite_meta(path, tmp_path / "w.gguf", {"llama.vocab_size": n + 1}),
            f"llama.vocab_size = {n + 1} disagrees with the {n} rows of token_embd.weight")
    assert load_gguf(rewrite_meta(path, tmp_path / "ok.gguf", {"llama.vocab_size": n}))[0] == model.config


def offset_of(path, name: str) -> int:
    """Tensor `name`'s data offset as the file stores it (from the start of the data section)."""
    r = gguf.GGUFReader(str(path))
    return next(int(t.data_offset) for t in r.tensors if t.name == name) - r.data_offset


def test_overlapping_tensor_data_is_refused(tmp_path, model, tok):
    """v's offset pointing at k's bytes imported with exit 0 and wv == wk; llama.cpp refuses such a file."""
    path = write_gguf(tmp_path / "m.gguf", model, tok, "Q8_0")
    patch_tensor_info(path, "blk.0.attn_v.weight", offset=offset_of(path, "blk.0.attn_k.weight"))
    refused(tmp_path, path, "the data of tensors blk.0.attn_k.weight and blk.0.attn_v.weight overlap")


def test_misaligned_tensor_data_is_refused(tmp_path, model, tok):
    path = write_gguf(tmp_path / "m.gguf", model, tok)
    patch_tensor_info(path, "blk.1.ffn_up.weight", offset=offset_of(path, "blk.1.ffn_up.weight") + 4)
    refused(tmp_path, path, "tensor blk.1.ffn_up.weight's data starts at byte .*, off the file's 32-byte alignment")


def test_a_relabelled_tensor_type_is_named(tmp_path, model, tok):
    """A Q8_0 tensor relabelled F32: its F32 size runs into the next tensor, and the bytes it is given are Q8_0's."""
    path = write_gguf(tmp_path / "m.gguf", model, tok, "Q8_0")
    patch_tensor_info(path, "blk.0.attn_q.weight", qtype="F32")
    refused(tmp_path, path, r"tensor blk.0.attn_q.weight is labelled F32 \[256, 256\] .* the size of Q8_0 data")


def test_non_finite_weights_are_named_not_blamed_on_training(tmp_path, model, tok, capsys):
    """A NaN in a file's weights was reported as 'the training diverged ... (try a lower --lr)' by the save."""
    from nanoeuler.cli import main
    m = Model(model.config, {n: a.copy() for n, a in model.params.items()})
    m.params["layers.1.attn.wv.weight"][3, 5] = np.nan
    m.params["layers.1.attn.wv.weight"][4, 5] = np.inf
    path = write_gguf(tmp_path / "m.gguf", m, tok)
    refused(tmp_path, path, r"tensor blk.1.attn_v.weight \(F32\) holds 2 NaN/Inf value\(s\)")
    assert main(["import", "--from", str(path), "--out", str(tmp_path / "out")]) != 0
    err = capsys.readouterr().err
    assert "blk.1.attn_v.weight" in err and "--lr" not in err and "diverged" not in err


def test_a_bias_tensor_is_refused(tmp_path, model, tok):
    m = chatml_model(tok)
    path = write_gguf(tmp_path / "m.gguf", m, tok)
    patched = rewrite_meta(path, tmp_path / "p.gguf", {}, extra_tensor=("blk.0.attn_q.bias", np.zeros(256, np.float32)))
    refused(tmp_path, patched, "unexpected tensor blk.0.attn_q.bias")


def rewrite_meta(src, dst, meta: dict, extra_tensor=None):
    """A copy of the GGUF src with metadata keys replaced/added (and optionally one more tensor)."""
    r = gguf.GGUFReader(str(src))
    arch = meta.get("general.architecture", "llama")
    w = gguf.GGUFWriter(str(dst), arch)
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture" or name in meta:
            continue
        if f.types[0] == gguf.GGUFValueType.ARRAY:
            w.add_key_value(name, f.contents(), gguf.GGUFValueType.ARRAY, sub_type=f.types[-1])
        else:
            w.add_key_value(name, f.contents(), f.types[0])
    for k, v in meta.items():
        if k != "general.architecture":
            w.add_key_value(k, v, *gguf_kind(v))
    for t in r.tensors:
        w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    if extra_tensor:
        w.add_tensor(*extra_tensor)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def gguf_kind(v) -> tuple:
    """The GGUF value type (and array element type) rewrite_meta writes v as."""
    if isinstance(v, list):
        return gguf.GGUFValueType.ARRAY, gguf_kind(v[0])[0]
    return (gguf.GGUFValueType.STRING if isinstance(v, str) else gguf.GGUFValueType.BOOL if isinstance(v, bool)
            else gguf.GGUFValueType.FLOAT32 if isinstance(v, float) else gguf.GGUFValueType.UINT32),


@pytest.mark.parametrize("key", ["tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.bos_token_id",
                                 "tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                 "tokenizer.ggml.fim_pad_token_id", "tokenizer.ggml.add_bos_token",
                                 "tokenizer.ggml.token_type", "tokenizer.chat_template"])
def test_a_tokenizer_key_of_another_kind_is_refused_by_name(tmp_path, model, tok, key):
    """An array where one value belongs (tokenizer.ggml.pre = ["gpt-2"], an id as [3]), a number for a name or a
    list, a name for an id: an 'internal error TypeError: unhashable type' or 'has no len()'; now one line."""
    path = write_gguf(tmp_path / "m.gguf", model, tok)
    scalar = key != "tokenizer.ggml.token_type"
    for value in ([["gpt2"], [3]] if scalar else []) + [7 if key.endswith(("model", "pre", "template")) else "x"]:
        refused(tmp_path, rewrite_meta(path, tmp_path / "p.gguf", {key: value}), f"GGUF metadata {key} = .* is not ")


# ------------------------------------------------------------------------------------------------- fuzz

def small_gguf(tmp_path_factory):
    from nanoeuler.config import Config
    from nanoeuler.tokenizer import Tokenizer
    tok = Tokenizer.train(["ab ba abc cab " * 20], 262, specials=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
                          progress=False)
    m = Model.init(Config(vocab_size=tok.vocab_size, dim=32, n_heads=2, n_kv_heads=1, n_layers=1, ctx_len=16,
                          ffn_hidden=32, n_mtp=1), seed=0)
    return write_gguf(tmp_path_factory.mktemp("fuzz") / "s.gguf", m, tok, "Q8_0").read_bytes()


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return small_gguf(tmp_path_factory)


def test_fuzzed_gguf_loads_or_is_one_userror(tmp_path, small):
    header = small.index(b"blk.0.attn_norm") + 400  # the metadata and tensor infos: where a change matters most
    fuzz_gguf(small, 0, header, tmp_path, lambda path: load_gguf(path))


def small_spm():
    """A SentencePiece vocabulary: <unk> <s> </s> at ids 0, 1, 2 (llama.cpp's default bos and eos ids), the 256
    byte tokens, pieces ranked by score, a user-defined "\\n" and a control <start_of_turn>."""
    from nanoeuler.tokenizer.sentencepiece import BYTE_PIECES, SentencePieceTokenizer
    pieces = ["▁", "a", "b", "▁a", "ab", "▁ab", "ba", "\n", "<start_of_turn>"]
    return SentencePieceTokenizer(["<unk>", "<s>", "</s>", *BYTE_PIECES, *pieces],
                                  [2, 3, 3] + [6] * 256 + [1] * 7 + [4, 3],
                                  [0.0] * 259 + [-float(i) for i in range(len(pieces))], prefix="every", eos="</s>",
                                  bos="<s>")


@pytest.fixture(scope="module")
def spm_file(tmp_path_factory):
    """A small GGUF with a SentencePiece vocabulary (tokens, scores, types): the arrays the fuzz test edits."""
    tok = small_spm()
    return write_gguf(tmp_path_factory.mktemp("spm") / "s.gguf", chatml_model(tok), tok, "Q8_0", pre=None,
                      add_bos=True, eos="</s>", bos="<s>").read_bytes()


def test_fuzzed_vocabulary_loads_or_is_one_userror(tmp_path, spm_file):
    """Bytes of the tokenizer arrays (lengths, counts, types, scores) changed or the file cut: a model and a
    tokenizer that encodes, or one UserError line; never another exception, never a big allocation."""
    def use(path):
        tracemalloc.start()
        try:
            load_gguf(path)[2].encode("ab ba\n<start_of_turn>", allow_special=True)
        finally:
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            assert peak < 256 << 20
    fuzz_gguf(spm_file, spm_file.index(b"tokenizer.ggml.tokens"), spm_file.index(b"blk.0.attn_norm"), tmp_path, use)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_non_finite_token_score_is_refused_by_every_reader(tmp_path, spm_file, capsys, bad):
    """A NaN score: `import` ended in 'internal error ValueError: Out of range float values are not JSON
    compliant' and `sample --ckpt FILE.gguf` used it silently; both now refuse it in one line."""
    from nanoeuler.cli import main
    (tmp_path / "s.gguf").write_bytes(spm_file)
    scores = gguf.GGUFReader(str(tmp_path / "s.gguf")).fields["tokenizer.ggml.scores"].contents()
    scores[261] = bad
    path = edit_gguf(tmp_path / "s.gguf", tmp_path / "bad.gguf", change={"tokenizer.ggml.scores": scores})
    message = r"GGUF metadata tokenizer.ggml.scores holds 1 NaN/Inf value\(s\) \(token 261 first\)"
    refused(tmp_path, path, message)
    for argv in (["import", "--from", str(path), "--out", str(tmp_path / "run")],
                 ["sample", "--ckpt", str(path), "--prompt", "ab", "--max-new-tokens", "1"]):
        assert main(argv) == 2
        err = [e for e in capsys.readouterr().err.strip().splitlines() if not e.startswith("dequantize:")]
        assert len(err) == 1 and re.search(message, err[0])   # (import's progress bar aside)


def fuzz_gguf(good: bytes, start: int, end: int, tmp_path, use) -> None:
    """use(path) on copies of the file `good` with 1-6 bytes in [start, end] changed, maybe cut short: it
    returns or raises a one-line UserError, nothing else."""
    from hypothesis import given
    from hypothesis import strategies as st
    from test_fuzz_loaders import FUZZ

    @FUZZ
    @given(edits=st.lists(st.tuples(st.integers(start, end), st.integers(0, 255)), min_size=1, max_size=6),
           cut=st.one_of(st.none(), st.integers(start, len(good))))
    def check(edits, cut):
        data = bytearray(good)
        for at, b in edits:
            data[at] = b
        path = tmp_path / "f.gguf"
        path.write_bytes(bytes(data[:cut]))
        try:
            use(path)
        except UserError as e:
            assert "\n" not in str(e)

    check()


def test_gpt2_architecture_file_imports_to_the_same_parameters(tmp_path, tok):
    from nanoeuler.config import Config
    from nanoeuler.interop.gguf_export import token_metadata
    cfg = Config(vocab_size=tok.vocab_size, dim=64, n_heads=4, n_kv_heads=4, n_layers=2, ctx_len=32, ffn_hidden=256,
                 n_mtp=1, arch="gpt2")
    P = {n: np.random.default_rng(1).standard_normal(a.shape).astype(np.float32)
         for n, a in Model.init(cfg, seed=0).params.items()}
    w = gguf.GGUFWriter(str(tmp_path / "g.gguf"), "gpt2")
    w.add_context_length(32)
    w.add_embedding_length(64)
    w.add_block_count(2)
    w.add_feed_forward_length(256)
    w.add_head_count(4)
    w.add_layer_norm_eps(1e-5)
    toks, types, merges = token_metadata(tok, tok.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(toks)
    w.add_token_types(types)
    w.add_token_merges(merges)
    t = {"token_embd.weight": P["embed.weight"], "position_embd.weight": P["pos_embed.weight"],
         "output_norm.weight": P["norm.weight"], "output_norm.bias": P["norm.bias"]}
    for i in range(2):
        o, g = f"layers.{i}.", f"blk.{i}."
        for s in ("weight", "bias"):
            t[f"{g}attn_norm.{s}"], t[f"{g}ffn_norm.{s}"] = P[f"{o}attn_norm.{s}"], P[f"{o}ffn_norm.{s}"]
            t[f"{g}attn_qkv.{s}"] = np.concatenate([P[f"{o}attn.w{x}.{s}"] for x in "qkv"])
            t[f"{g}attn_output.{s}"], t[f"{g}ffn_up.{s}"] = P[f"{o}attn.wo.{s}"], P[f"{o}ffn.fc.{s}"]
            t[f"{g}ffn_down.{s}"] = P[f"{o}ffn.proj.{s}"]
    for n, a in t.items():
        w.add_tensor(n, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    cfg2, P2, _, _ = load_gguf(tmp_path / "g.gguf")
    assert cfg2 == cfg
    assert set(P2) == set(P) and all(np.array_equal(P2[n], P[n]) for n in P)


# ---------------------------------------------------------------------- tokenizer.ggml.pre and add_bos

def hf_pre_tokenizer(family: str):
    """The Hugging Face pre-tokenizer each llama.cpp family stands for, as those models' tokenizer.json files
    write it (the regexes copied from Llama-3's and Qwen2's)."""
    from tokenizers import Regex, pre_tokenizers as pt
    llama3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
              r"|\s+(?!\S)|\s+")
    qwen2 = llama3.replace(r"\p{N}{1,3}", r"\p{N}")
    return {"gpt-2": pt.ByteLevel(add_prefix_space=False),
            "smollm": pt.Sequence([pt.Digits(individual_digits=True), pt.ByteLevel(add_prefix_space=False)]),
            "llama-bpe": pt.Sequence([pt.Split(Regex(llama3), "isolated"), pt.ByteLevel(add_prefix_space=False, use_regex=False)]),
            "qwen2": pt.Sequence([pt.Split(Regex(qwen2), "isolated"), pt.ByteLevel(add_prefix_space=False, use_regex=False)]),
            }[family]


@pytest.mark.parametrize("family", ["gpt-2", "smollm", "llama-bpe", "qwen2"])
def test_each_pre_family_splits_as_its_hf_pre_tokenizer(family):
    """tokenizer.ggml.pre names a split: every name of a family cuts text as that family's Hugging Face
    pre-tokenizer does (smollm: each digit alone; llama-bpe: digits by threes; gpt-2: digit runs whole)."""
    pytest.importorskip("tokenizers")
    from nanoeuler.interop.pretokenizers import PRE_FAMILIES, pre_pattern
    from nanoeuler.tokenizer.pretokenize import pretokenize
    oracle = hf_pre_tokenizer(family)
    text = ("In 1599, 12345 men  spent $3.50 (or 1,000,000!) in   2 days\t\n 7 it's WE'LL don't\r\n\r\n"
            "ÀÉ 日本語 😀 x1y22z333 ...!? \u00a0nbsp")
    want = [text[a:b] for _, (a, b) in oracle.pre_tokenize_str(text)]
    names = next(names for names, _, _ in PRE_FAMILIES.values() if family in names)
    for name in names:
        assert pretokenize(text, pre_pattern(name)[0]) == want, name


@pytest.mark.parametrize("pre, default", [("gpt-2", False), ("smollm", False), ("qwen2", False), ("default", False),
                                          ("llama-bpe", True), ("sentencepiece", True)])
@pytest.mark.parametrize("add_bos", [True, False, None])
def test_add_bos_token_or_the_familys_default(tmp_path, tok, pre, default, add_bos):
    """tokenizer.ggml.add_bos_token decides whether encode(add_bos=True) puts the bos first; absent, llama.cpp's
    default for the family does (llama_vocab::load: llama-bpe and SentencePiece files yes, the others no)."""
    from nanoeuler.tokenizer.sentencepiece import BYTE_PIECES, SentencePieceTokenizer
    if pre == "sentencepiece":
        tokens = ["<unk>", "<s>", "</s>", *BYTE_PIECES, "▁", "a", "▁a"]
        tok = SentencePieceTokenizer(tokens, [2, 3, 3] + [6] * 256 + [1] * 3, [0.0] * 259 + [-1.0, -2.0, -3.0])
    m = chatml_model(tok)
    spm = pre == "sentencepiece"
    path = write_gguf(tmp_path / "b.gguf", m, tok, pre=None if spm else pre, add_bos=add_bos,
                      eos="</s>" if spm else "<|im_end|>", bos="<s>" if spm else "<|endoftext|>")
    _, _, g_tok, _ = load_gguf(path)
    expect = default if add_bos is None else add_bos
    assert (g_tok.encode("a", add_bos=True) == [g_tok.special_tokens["<s>" if spm else "<|endoftext|>"],
                                                *g_tok.encode("a")]) == expect


def test_export_of_a_sentencepiece_tokenizer_imports_back(tmp_path):
    """export --format gguf of a checkpoint with a SentencePiece vocabulary writes tokenizer.ggml.model llama
    (tokens, scores, types, add_space_prefix, bos / eos): importing it gives the same tokenizer."""
    tok = small_spm()
    m = chatml_model(tok)
    path = export_gguf(m, tok.replace(chat_template=CHATML), tmp_path / "s.gguf", "f32", progress=False)
    meta = {k: f.contents() for k, f in gguf.GGUFReader(str(path)).fields.items()}
    assert meta["tokenizer.ggml.model"] == "llama" and meta["tokenizer.ggml.add_space_prefix"] is True
    _, _, back, _ = load_gguf(path)
    assert back.kind == "sentencepiece" and back.fingerprint() == tok.fingerprint()
    assert back.encode("ab ba\nab", add_bos=True) == tok.encode("ab ba\nab", add_bos=True)


# ------------------------------------------------------------ what a file leaves out or names, as llama.cpp reads it

@pytest.mark.parametrize("key", ["tokenizer.ggml.add_space_prefix", "tokenizer.ggml.bos_token_id",
                                 "tokenizer.ggml.eos_token_id"])
def test_a_sentencepiece_file_without_a_key_reads_as_llama_cpps_default(tmp_path, key):
    """llama_vocab::load takes add_space_prefix true, bos id 1 and eos id 2 where the file says nothing. This
    vocabulary has those values, so the file without the key encodes (bos first) and ends as the file with it."""
    tok = small_spm()
    path = write_gguf(tmp_path / "s.gguf", chatml_model(tok), tok, pre=None, add_bos=True, eos="</s>", bos="<s>")
    back = load_gguf(edit_gguf(path, tmp_path / "t.gguf", remove=[key]))[2]
    assert back.encode("ab ba\nab", add_bos=True) == tok.encode("ab ba\nab", add_bos=True)
    assert back.eos_id == tok.eos_id


@pytest.mark.parametrize("key", ["tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"])
@pytest.mark.parametrize("kind", ["byte-level", "sentencepiece"])
def test_an_end_of_turn_id_is_a_stop_whatever_its_text(tmp_path, tok, key, kind):
    """llama.cpp stops at the eot / eom id a file names, not only at the end-of-turn texts it knows: a control
    token whose text is none of them is a stop when the key names it, and only then."""
    vocab, special, ends = ((tok, "<|im_start|>", {}) if kind == "byte-level"
                            else (small_spm(), "<start_of_turn>", dict(pre=None, eos="</s>", bos="<s>")))
    i = vocab.special_tokens[special]
    m = chatml_model(vocab)
    plain = load_gguf(write_gguf(tmp_path / "a.gguf", m, vocab, **ends))[2]
    named = load_gguf(write_gguf(tmp_path / "b.gguf", m, vocab, meta={key: i}, **ends))[2]
    assert i not in plain.stop_ids and i in named.stop_ids


def test_unknown_typed_tokens_are_special_in_a_byte_level_file(tmp_path, model, tok):
    """llama.cpp cuts an UNKNOWN-typed token out of text as it cuts a CONTROL one (when specials are parsed):
    the file that types <|im_start|> UNKNOWN encodes as the one that types it CONTROL."""
    path = write_gguf(tmp_path / "c.gguf", model, tok)
    types = gguf.GGUFReader(str(path)).fields["tokenizer.ggml.token_type"].contents()
    i = tok.special_tokens["<|im_start|>"]
    assert types[i] == gguf.TokenType.CONTROL
    types[i] = gguf.TokenType.UNKNOWN
    control = load_gguf(path)[2]
    unknown = load_gguf(edit_gguf(path, tmp_path / "u.gguf", change={"tokenizer.ggml.token_type": types}))[2]
    text = "<|im_start|>user\nhi<|im_end|>"
    assert unknown.encode(text, allow_special=True)[0] == i
    for allow in (True, False):
        assert unknown.encode(text, allow_special=allow) == control.encode(text, allow_special=allow)


def gemma3_model(tok, n_layers: int, head_dim: int = 16, **changes) -> Model:
    return Model.init(tiny_config(vocab_size=tok.vocab_size, dim=32, n_heads=4, n_kv_heads=1, n_layers=n_layers,
                                  ctx_len=16, ffn_hidden=32, n_mtp=1, arch="gemma3", head_dim=head_dim,
                                  sliding_window=4, **changes), seed=0)


def test_a_gemma3_file_without_a_window_pattern_has_every_sixth_layer_global(tmp_path, tok):
    """llama.cpp's Gemma 3 reads attention.sliding_window_pattern where the file has it and takes 6 where it
    has none (its converter writes none): layer i is global iff i % 6 == 5, as in transformers' Gemma 3."""
    transformers = pytest.importorskip("transformers")
    m = gemma3_model(tok, 7, global_every=6)
    path = export_gguf(m, tok, tmp_path / "g.gguf", progress=False)
    cfg = load_gguf(edit_gguf(path, tmp_path / "h.gguf", remove=["gemma3.attention.sliding_window_pattern"]))[0]
    assert cfg == m.config
    hf = transformers.Gemma3TextConfig(num_hidden_layers=7, sliding_window=4)
    assert [cfg.window(i) == 0 for i in range(7)] == [t == "full_attention" for t in hf.layer_types]


@pytest.mark.parametrize("n_layers, head_dim, scaled_otherwise", [(62, 16, True), (62, 8, False), (61, 16, False)])
def test_a_gemma3_file_llama_cpp_scales_otherwise_is_refused(tmp_path, tok, n_layers, head_dim, scaled_otherwise):
    """llama.cpp scales the attention of a 62-layer Gemma 3 (its 27B) by 1/sqrt(embedding_length / head_count),
    not 1/sqrt(head size): such a file whose two differ is refused by import and not written by export (llama.cpp
    would attend differently from our model); where they agree, or at another depth, both go through."""
    m = gemma3_model(tok, n_layers, head_dim, global_every=6)
    path = write_gguf(tmp_path / "g.gguf", m, tok)
    if scaled_otherwise:
        for act in (lambda: load_gguf(path), lambda: export_gguf(m, tok, tmp_path / "e.gguf", progress=False)):
            with pytest.raises(UserError, match="62 layers.*1/sqrt\\(8\\).*head size 16"):
                act()
        assert not (tmp_path / "e.gguf").exists()
    else:
        assert load_gguf(path)[0] == m.config
        export_gguf(m, tok, tmp_path / "e.gguf", progress=False)


@pytest.mark.parametrize("name", block_types())
def test_every_reader_of_blocks_refuses_a_nan_or_inf_scale(tmp_path, model, tok, capsys, name):
    """A block with a NaN or Inf float16 scale (its weights read back NaN/Inf): `import` refused it, but `sample`
    (chat, serve: the same loader) on the .gguf itself printed eight <|endoftext|> and serve answered 200. Now
    every reader refuses in one line naming the tensor: import, the .gguf read directly, and an imported
    checkpoint whose kept blocks were damaged afterwards."""
    from safetensors.numpy import load_file, save_file

    from nanoeuler.cli import main
    from nanoeuler.infer import qkernels
    from nanoeuler.infer.quant import WTYPES
    if not qkernels.AVAILABLE:
        pytest.skip("this CPU decodes no block types")
    t = WTYPES[name]
    good = write_gguf(tmp_path / "good.gguf", model, tok, name.upper())
    bad_value = np.float16(np.nan if t.scales[-1] else np.inf)      # NaN in a later scale, Inf in the first
    r = gguf.GGUFReader(str(good))
    B = next(np.array(x.data).reshape(int(x.shape[1]), -1) for x in r.tensors if x.name == "blk.1.ffn_down.weight")
    B[2, t.scales[-1]:t.scales[-1] + 2] = np.frombuffer(bad_value.tobytes(), np.uint8)
    bad = write_gguf(tmp_path / "bad.gguf", model, tok, name.upper(), blocks={"blk.1.ffn_down.weight": B})
    with warnings.catch_warnings():   # (inf · 0 in the dequantization printed NumPy's RuntimeWarning first)
        warnings.simplefilter("error")
        refused(tmp_path, bad, rf"tensor blk.1.ffn_down.weight \({name.upper()}\) holds \d+ NaN/Inf value")
    argv = ["sample", "--prompt", "hi", "--max-new-tokens", "2", "--temperature", "0"]
    assert main([*argv, "--ckpt", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.search(r"tensor layers.1.ffn.down.weight holds 1 block\(s\) with a NaN/Inf scale", err[0])
    run = tmp_path / "run"
    assert main(["import", "--from", str(good), "--out", str(run)]) == 0
    assert main([*argv, "--ckpt", str(run)]) == 0
    capsys.readouterr()
    kept = load_file(str(run / "source.safetensors"))
    raw = kept["layers.1.ffn.down.weight"]
    raw[2, t.scales[-1]:t.scales[-1] + 2] = np.frombuffer(bad_value.tobytes(), np.uint8)
    save_file(kept, str(run / "source.safetensors"))
    assert main([*argv, "--ckpt", str(run)]) == 2
    assert "tensor layers.1.ffn.down.weight holds 1 block(s) with a NaN/Inf scale" in capsys.readouterr().err


def test_decoding_an_import_reads_none_of_the_float32_its_blocks_replace(tmp_path, model, tok, capsys):
    """`sample` on an imported checkpoint peaked at 2.8x llama.cpp's memory (864 MiB for SmolLM2): the load
    checked every float32 matrix for NaN, reading all 538 MB of them, though decoding uses the file's blocks.
    Those matrices made NaN (the file's size and time kept, so the blocks still count as theirs): the same
    reply, where the old load refused the checkpoint."""
    import os

    from safetensors.numpy import load_file, save_file

    from nanoeuler.cli import main
    from nanoeuler.infer import qkernels
    if not qkernels.AVAILABLE:
        pytest.skip("this CPU decodes no block types")
    run = tmp_path / "run"
    assert main(["import", "--from", str(write_gguf(tmp_path / "m.gguf", model, tok, "Q8_0")), "--out", str(run)]) == 0
    argv = ["sample", "--ckpt", str(run), "--prompt", "hi", "--max-new-tokens", "8", "--temperature", "0"]
    capsys.readouterr()
    assert main(argv) == 0
    want = capsys.readouterr().out
    weights = run / "model.safetensors"
    st = weights.stat()
    kept = load_file(str(run / "source.safetensors"))
    params = load_file(str(weights))
    save_file({n: np.full_like(a, np.nan) if n in kept else a for n, a in params.items()}, str(weights))
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert weights.stat().st_size == st.st_size and len(kept) > 0
    assert main(argv) == 0
    assert capsys.readouterr().out == want


def test_fuzzed_tokenizer_and_rope_metadata_load_or_are_one_userror(tmp_path, model, tok):
    """Any GGUF value (a string, a number, a bool, an array of one kind) in a tokenizer.* key or a RoPE key: the
    tokenizer and config read, or one UserError line; never another exception (an array where an id belongs was
    'unhashable type')."""
    from hypothesis import event, given
    from hypothesis import strategies as st
    from test_fuzz_loaders import FUZZ
    from nanoeuler.arch import ARCHS
    from nanoeuler.interop.gguf_file import GGUFFile
    from nanoeuler.interop.gguf_import import gguf_config, gguf_tokenizer
    path = write_gguf(tmp_path / "m.gguf", model, tok)
    f = GGUFFile(path)
    meta, tensors = dict(f.meta), {"token_embd.weight": np.zeros((model.config.vocab_size, 1))}
    keys = sorted(k for k in meta if k.startswith("tokenizer.")) + [
        "tokenizer.ggml.eot_token_id", "tokenizer.ggml.fim_pad_token_id", "tokenizer.ggml.add_space_prefix",
        "llama.rope.freq_base", "llama.rope.scaling.factor", "llama.rope.scale_linear", "llama.rope.scaling.type",
        "llama.rope.dimension_count", "llama.attention.key_length"]
    scalar = st.one_of(st.text(max_size=12), st.integers(-2**63, 2**64 - 1), st.floats(width=32), st.booleans(),
                       st.sampled_from(["gpt2", "llama", "gpt-2", "qwen2", "linear", "<|im_end|>"]))
    values = st.one_of(scalar, st.lists(st.integers(-2, 400), max_size=5), st.lists(st.text(max_size=4), max_size=5))

    @FUZZ
    @given(changes=st.dictionaries(st.sampled_from(keys), values, min_size=1, max_size=3))
    def check(changes):
        try:
            gguf_tokenizer(meta | changes, model.config.vocab_size).encode("ab <|im_end|>", allow_special=True)
            gguf_config(meta | changes, ARCHS["euler"], tensors)
            event("ok")
        except UserError as e:
            assert "\n" not in str(e)
            event("UserError")
    check()


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "gemma3"])
def test_a_file_without_a_rope_base_is_llama_cpps_10000(tmp_path, tok, arch):
    """llama.cpp reads rope.freq_base with 10000 where the file has none, for every architecture (convert_hf_to_gguf
    writes none where config.json has no rope_theta); the import took the architecture's own default (1e6 for
    Qwen2, Qwen3 and Gemma 3): another model than llama.cpp's."""
    cfg = chatml_model(tok).config.replace(arch=arch, rope_theta=500000.0, head_dim=64, rope_local_theta=None,
                                          tie_embeddings=True)
    path = write_gguf(tmp_path / "m.gguf", Model.init(cfg, seed=0), tok)
    edited = edit_gguf(path, tmp_path / "e.gguf", remove=(f"{cfg.spec.gguf.name}.rope.freq_base",))
    assert load_gguf(path)[0].rope_theta == 500000.0 and load_gguf(edited)[0].rope_theta == 10000.0


def test_a_rope_freqs_tensor_of_another_shape_is_refused(tmp_path, model, tok):
    """rope_freqs holds head_dim/2 factors in one row, as llama.cpp creates it: a [2, 16] tensor of the 32 factors
    was read as if it were one row (llama.cpp refuses its shape)."""
    path = write_gguf(tmp_path / "m.gguf", model, tok)
    wrong = rewrite_meta(path, tmp_path / "w.gguf", {}, extra_tensor=("rope_freqs.weight", np.ones((2, 16), np.float32)))
    refused(tmp_path, wrong, r"tensor rope_freqs.weight: shape \[2, 16\] \(64 turned dimensions want \[32\]")


def test_the_gguf_export_refuses_soft_caps_and_heads_llama_cpp_reads_otherwise():
    """llama.cpp's gemma2 always soft-caps (50 / 30 where the file says none) and takes the embedding as its output
    head; its other architectures cap nothing: a model they would run otherwise is refused in one line."""
    from nanoeuler.interop.gguf_export import check_expressible
    g = tiny_config(arch="gemma2", n_mtp=1, sliding_window=4, attn_softcap=20.0)
    check_expressible(g)
    for cfg, message in [(g.replace(attn_softcap=0.0), "llama.cpp's gemma2 always soft-caps .attn_softcap 0"),
                         (g.replace(tie_embeddings=False), "llama.cpp's gemma2 takes the embedding as its output head"),
                         (tiny_config(n_mtp=1, logit_softcap=30.0), "llama.cpp's llama has no soft cap .logit_softcap 30")]:
        with pytest.raises(UserError, match=message) as e:
            check_expressible(cfg)
        assert "\n" not in str(e.value)
