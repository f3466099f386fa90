"""GGUF files written here with the gguf package's GGUFWriter, as a llama.cpp converter would: llama
architecture, small dims (256 wide so that every block type fits, Q6_K's 256-blocks included), a byte-level
BPE vocabulary with ChatML specials, tensors quantized with gguf.quants.quantize."""
from __future__ import annotations

import numpy as np

from nanoeuler import Model, Tokenizer
from nanoeuler.config import Config
from nanoeuler.data.corpus import bundled_works

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def chatml_tokenizer(vocab: int = 320) -> Tokenizer:
    return Tokenizer.train([bundled_works()["hamlet"][:20000]], vocab, specials=SPECIALS, progress=False)


def chatml_model(tok: Tokenizer, seed: int = 0, tied: bool = False) -> Model:
    cfg = Config(vocab_size=tok.vocab_size, dim=256, n_heads=4, n_kv_heads=2, n_layers=2, ctx_len=128,
                 ffn_hidden=256, n_mtp=1, rope_theta=10000.0, norm_eps=1e-5, tie_embeddings=tied)
    m = Model.init(cfg, seed=seed)
    rng = np.random.default_rng(seed)
    for n, a in m.params.items():  # random, not the init's ones/zeros: every row and element matters
        m.params[n] = (a + 0.05 * rng.standard_normal(a.shape)).astype(np.float32)
    return m


def train_briefly(m: Model, tok: Tokenizer, steps: int, lr: float, length: int) -> Model:
    """A few SGD steps on Hamlet (batches of 8 rows of `length` tokens): predictions with margins."""
    ids = np.array(tok.encode(bundled_works()["hamlet"][:40000]))
    rng = np.random.default_rng(0)
    for _ in range(steps):
        starts = rng.integers(0, len(ids) - length - 4, 8)
        _, _, grads = m.loss_and_grads(np.stack([ids[i:i + length] for i in starts]))
        for n in m.params:
            m.params[n] -= lr * grads[n]
    return m


def write_gguf(path, m: Model, tok, qtype: str = "F32", template: str | None = CHATML,
               tokens=None, meta: dict | None = None, drop=(), shapes: dict | None = None, pre: str | None = "gpt-2",
               add_bos: bool | None = False, eos: str = "<|im_end|>", bos: str = "<|endoftext|>",
               blocks: dict | None = None):
    """Write m as a llama.cpp GGUF of its architecture with matrices in qtype (norms stay F32, as the converter
    does), without export's checks (to write files export refuses).
    tok: a byte-level tokenizer (tokenizer.ggml.model gpt2), or a SentencePiece one (llama: tokens, scores,
    types, add_space_prefix as its prefix says); pre: tokenizer.ggml.pre (None: no such key); tokens: replace
    the token list; meta: extra/overriding key -> value; drop: tensor names left out; shapes: tensor name ->
    a different array (to write a wrong shape); add_bos: tokenizer.ggml.add_bos_token (None: no such key);
    blocks: tensor name -> its bytes in qtype [rows, bytes], written as they are (instead of quantizing m's)."""
    import gguf
    from nanoeuler.interop.gguf_export import add_hparams, add_vocabulary, gguf_tensors
    q = getattr(gguf.GGMLQuantizationType, qtype)
    cfg = m.config
    w = gguf.GGUFWriter(str(path), cfg.spec.gguf.name)
    add_hparams(w, cfg)
    toks, types = add_vocabulary(w, tok, cfg.vocab_size, pre)
    if tokens is not None:  # extra tokens are control tokens
        toks, types = tokens, types[:len(tokens)] + [gguf.TokenType.CONTROL] * (len(tokens) - len(types))
    w.add_token_list(toks)
    w.add_token_types(types)
    w.add_eos_token_id(tok.special_tokens[eos])
    w.add_bos_token_id(tok.special_tokens[bos])
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    if template is not None:
        w.add_chat_template(template)
    for k, v in (meta or {}).items():
        w.add_key_value(k, v, gguf.GGUFValueType.STRING if isinstance(v, str) else gguf.GGUFValueType.UINT32)
    for name, a in gguf_tensors(m).items():
        if name in drop:
            continue
        a = (shapes or {}).get(name, a)
        if name in (blocks or {}):
            w.add_tensor(name, blocks[name], raw_dtype=q)
        elif a.ndim == 1 or q == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, a)
        else:
            w.add_tensor(name, quantize(a, q), raw_dtype=q)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def quantize(a: np.ndarray, q) -> np.ndarray:
    """gguf.quants.quantize; for a type it cannot quantize (the K types) random blocks of that type whose f16
    scales (d, dmin: quant.WTYPES' `scales`) are small: valid data, unrelated to `a`."""
    import gguf
    from nanoeuler.infer.quant import WTYPES
    try:
        return gguf.quants.quantize(a, q)
    except NotImplementedError:
        block, size = gguf.GGML_QUANT_SIZES[q]
        rng = np.random.default_rng(a.size)
        raw = rng.integers(0, 256, (a.shape[0], a.shape[1] // block, size), dtype=np.uint8)
        for at in WTYPES[q.name.lower()].scales:
            raw[..., at:at + 2] = np.frombuffer(np.float16(1e-3).tobytes(), np.uint8)
        return raw.reshape(a.shape[0], -1)


def patch_tensor_info(path, name: str, offset: int | None = None, qtype: str | None = None):
    """Rewrite tensor `name`'s info in the GGUF file in place: its data offset (from the start of the data,
    as the file stores it) and/or its type (the bytes stay the same)."""
    import gguf
    r = gguf.GGUFReader(str(path), "r+")
    parts = next(t.field.parts for t in r.tensors if t.name == name)
    if offset is not None:
        parts[-1][0] = offset
    if qtype is not None:
        parts[-2][0] = getattr(gguf.GGMLQuantizationType, qtype)
    r.data.flush()
    return path


def edit_gguf(src, dst, remove=(), change: dict | None = None):
    """A copy of the GGUF file src at dst without the metadata keys in `remove` and with those in `change`
    given new values (each of the type it had), as gguf's own gguf_new_metadata script copies a file."""
    import gguf
    r = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(dst), r.fields["general.architecture"].contents())
    for name, f in r.fields.items():
        if name == "general.architecture" or name.startswith("GGUF.") or name in remove:
            continue
        kind = f.types[0]
        sub = f.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(name, (change or {}).get(name, f.contents()), kind, sub_type=sub)
    for t in r.tensors:
        w.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for t in r.tensors:
        w.write_tensor_data(t.data)
    w.close()
    return dst
