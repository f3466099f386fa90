"""Weight types are rows of one table (infer/quant.py WTYPES): a type is known by its name, never by its
size, and every list of types (--dtype's choices, export's types, an import's default, the kernels'
dispatch) follows the table, so that a new type is one row."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("gguf")
import gguf  # noqa: E402
from gguf_fixtures import chatml_model, chatml_tokenizer, write_gguf  # noqa: E402

from nanoeuler.cli import build_parser, main  # noqa: E402
from nanoeuler.cli.sample import dtype_of_source  # noqa: E402
from nanoeuler.infer import qkernels as qk, quant, weights  # noqa: E402
from nanoeuler.interop.gguf_export import gguf_tensors  # noqa: E402
from nanoeuler.interop.gguf_import import load_gguf  # noqa: E402

# IQ4_NL (llama.cpp's ggml type 20): blocks of 32 weights in 18 bytes like Q4_0 (a float16 d, 16 bytes of
# nibbles), read through a table of 16 non-uniform values: w = d · KVALUES[q]
KVALUES = np.float32([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113])


def iq4_nl_dequantize(B: np.ndarray, n: int) -> np.ndarray:
    b = np.ascontiguousarray(B, np.uint8).reshape(-1, 18)
    d = b[:, :2].copy().view(np.float16).astype(np.float32)             # [blocks, 1]
    q = np.concatenate([b[:, 2:] & 15, b[:, 2:] >> 4], axis=1)           # [blocks, 32]: low nibbles first
    return (d * KVALUES[q]).reshape(*B.shape[:-1], n)


# a row for it with no kernel (decoding would dequantize it) and no quantize
IQ4_NL = quant.WType("iq4_nl", "IQ4_NL", 20, 32, 18, np.dtype([("iq4_nl", "V18")]), None, "q8_0", None,
                     iq4_nl_dequantize, scales=(0,))


def iq4_nl_blocks(rows: int, n: int, seed: int = 0) -> np.ndarray:
    """Random IQ4_NL bytes [rows, n / 32 · 18] with small finite scales."""
    B = np.random.default_rng(seed).integers(0, 256, (rows * n // 32, 18), dtype=np.uint8)
    B[:, :2] = np.random.default_rng(seed + 1).uniform(-1e-3, 1e-3, (len(B), 1)).astype(np.float16).view(np.uint8)
    return B.reshape(rows, -1)


@pytest.fixture(scope="module")
def tok():
    return chatml_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    return chatml_model(tok)


def test_the_iq4_nl_row_of_these_tests_reads_as_gguf_does():
    B = iq4_nl_blocks(4, 64)
    np.testing.assert_array_equal(iq4_nl_dequantize(B, 64),
                                  gguf.quants.dequantize(B, gguf.GGMLQuantizationType.IQ4_NL).reshape(4, 64))


def test_a_type_is_known_by_its_name_not_its_block_size(monkeypatch):
    """Two types of 18-byte blocks are two dtypes: each array names its own type."""
    monkeypatch.setitem(quant.WTYPES, "iq4_nl", IQ4_NL)
    q4_0 = quant.quantize(np.ones((2, 64), np.float32), "q4_0").view(quant.WTYPES["q4_0"].dtype)
    assert quant.of_dtype(q4_0.dtype).name == "q4_0" and weights.of_dtype(q4_0.dtype).name == "q4_0"
    assert quant.of_dtype(IQ4_NL.dtype) is IQ4_NL and weights.of_dtype(IQ4_NL.dtype) is None   # (no kernel)
    assert quant.of_gguf("IQ4_NL") is IQ4_NL and quant.of_gguf("Q4_0").name == "q4_0"
    assert quant.of_dtype(np.dtype("V18")) is None                    # bytes alone name no type


@pytest.mark.parametrize("added", [False, True])
def test_a_file_of_q4_0s_block_size_decodes_in_its_own_type(tmp_path, model, tok, monkeypatch, added):
    """A GGUF whose matrices are IQ4_NL (18-byte blocks, as Q4_0's) decodes as IQ4_NL, with the table as it is
    or with a row for it: equal to gguf's dequantization, never read as Q4_0 blocks."""
    if added:
        monkeypatch.setitem(quant.WTYPES, "iq4_nl", IQ4_NL)
    blocks = {n: iq4_nl_blocks(*a.shape, seed=i) for i, (n, a) in enumerate(gguf_tensors(model).items()) if a.ndim == 2}
    path = write_gguf(tmp_path / "iq4.gguf", model, tok, qtype="IQ4_NL", blocks=blocks)
    cfg, P, _, source = load_gguf(path, blocks=True)
    assert source["tensor_types"]["embed.weight"] == "IQ4_NL"
    assert all(p.dtype == np.float32 for p in P.values())             # dequantized: no kernel reads IQ4_NL
    np.testing.assert_array_equal(P["embed.weight"], iq4_nl_dequantize(blocks["token_embd.weight"],
                                                                        cfg.dim))


def test_an_import_of_q4_0_blocks_exports_them_as_q4_0_beside_a_type_of_their_size(tmp_path, model, tok,
                                                                                   monkeypatch):
    """export writes an import's blocks back under the type their dtype names: a row of another 18-byte type
    in the table does not relabel Q4_0's (a lookup by bytes a block found IQ4_NL for them)."""
    monkeypatch.setitem(quant.WTYPES, "iq4_nl", IQ4_NL)
    path = write_gguf(tmp_path / "q4.gguf", model, tok, qtype="Q4_0")
    assert main(["import", "--from", str(path), "--out", str(tmp_path / "run"), "--no-progress"]) == 0
    assert main(["export", "--ckpt", str(tmp_path / "run"), "--format", "gguf", "--out", str(tmp_path / "back.gguf"),
                 "--no-progress"]) == 0
    theirs = {t.name: (t.tensor_type.name, bytes(t.data)) for t in gguf.GGUFReader(str(path)).tensors}
    ours = {t.name: (t.tensor_type.name, bytes(t.data)) for t in gguf.GGUFReader(str(tmp_path / "back.gguf")).tensors}
    assert {t for t, _ in ours.values()} == {"Q4_0", "F32"}
    assert ours == theirs


def parses(argv: list[str]) -> bool:
    try:
        build_parser().parse_args(argv)
    except SystemExit:   # (an unknown choice: one line on stderr)
        return False
    return True


COMMANDS = (["sample", "--ckpt", "r", "--prompt", "p"], ["chat", "--ckpt", "r"], ["serve", "--ckpt", "r"], ["eval", "--ckpt", "r"],
            ["bench", "--decode", "--ckpt", "r"])


def test_the_lists_of_types_follow_the_table(monkeypatch, capsys):
    """A row is the only edit a new type needs: with one more row (a twin of Q8_0 under another name), every
    command's --dtype takes it, export's help names it, an import of its GGUF name decodes in it by default,
    and decoding's form of its dtype carries its kernel kind; a row without a kernel is offered nowhere."""
    twin = quant.WTYPES["q8_0"]._replace(name="q8_0b", gguf="Q8_0B", dtype=np.dtype([("q8_0b", "V34")]))
    for argv in COMMANDS:
        assert parses(argv + ["--dtype", "q8_0"]) and not parses(argv + ["--dtype", "q8_0b"]), argv
    monkeypatch.setitem(quant.WTYPES, "q8_0b", twin)
    monkeypatch.setitem(quant.WTYPES, "iq4_nl", IQ4_NL)
    for argv in COMMANDS:
        assert parses(argv + ["--dtype", "q8_0b"]) and not parses(argv + ["--dtype", "iq4_nl"]), argv
    assert main(["export", "--help"]) == 0
    assert "q8_0b" in capsys.readouterr().out.replace("\n", " ")
    assert "q8_0b" in quant.from_float() and "iq4_nl" not in quant.from_float()
    assert dtype_of_source({"tensor_types": {"layers.0.attn.wq.weight": "Q8_0B"}}) == "q8_0b"
    assert dtype_of_source({"tensor_types": {"layers.0.attn.wq.weight": "IQ4_NL"}}) == "float32"
    form = weights.of_dtype(twin.dtype)
    assert (form.name, form.kind) == ("q8_0b", qk.KINDS["q8_0"])
    assert weights.of_dtype(quant.WTYPES["q8_0"].dtype).name == "q8_0"


def test_the_kernels_dispatch_comes_from_the_rows():
    """qkernels' kinds are the rows' (a kind per block type), super-block kinds (from K_KINDS) are the rows that
    meet Q8_K activations, and Q8_1's kinds the rows that meet Q8_1: the activations each kernel quantizes to."""
    assert qk.KINDS == {n: quant.WTYPES[n].kind for n in quant.block_types()}
    for name, kind in qk.KINDS.items():
        t = quant.WTYPES[name]
        assert (kind >= qk.K_KINDS) == (t.activations == "q8_k") == (t.block == quant.QK_K)
        assert (kind in qk.Q8_1) == (t.activations == "q8_1")
        assert weights.of_dtype(t.dtype).kind == kind
    assert len(set(qk.STRIDES[min(qk.KINDS.values()):])) == len(qk.KINDS)
