"""`nanoeuler sample --ckpt RUN --prompt TEXT`: continue a prompt, streaming the text as it is generated.

    nanoeuler sample --ckpt runs/small --prompt "ROMEO." --temperature 0.8 --top-k 40 --seed 1
    nanoeuler sample --ckpt runs/small --prompt "To be" --temperature 0        # greedy, speculative
    nanoeuler sample --ckpt runs/big --prompt "To be" --dtype float16         # float16 weights: faster
    nanoeuler sample --ckpt runs/big --prompt "To be" --dtype q8_0            # 8-bit blocks, as llama.cpp's Q8_0
"""
from __future__ import annotations

import json
import sys

from .args import escape_control


def add_threads_arg(p) -> None:
    """--threads N (sample, chat, serve, bench --decode): applied by load_for_decoding."""
    from .args import positive_int
    p.add_argument("--threads", type=positive_int, default=None,
                   help="decoding threads, at most the cores this process may use (default: those cores, at most 8)")


def use_threads(n: int) -> None:
    """Decode with n threads, refused in one line beyond the cores this process may use."""
    import os

    from ..errors import UserError
    from ..infer import pool
    cores = len(os.sched_getaffinity(0))
    if n > cores:
        raise UserError(f"--threads {n} is more than the {cores} cores this process may use")
    pool.set_threads(n)


def add_sampling_args(p, temperature: float, max_new: int) -> None:
    from .args import finite_float, nonneg_int, positive_int
    add_threads_arg(p)
    p.add_argument("--temperature", type=finite_float(0, 100), default=temperature,
                   help=f"softmax temperature in [0, 100]; 0 = greedy (default {temperature})")
    p.add_argument("--top-k", type=nonneg_int, default=None,
                   help="sample only from the k most likely tokens; 0 = no limit (the default), as /topk 0")
    p.add_argument("--top-p", type=finite_float(0, 1, lo_open=True), default=None,
                   help="nucleus sampling: smallest set with probability >= p, p in (0, 1]")
    p.add_argument("--seed", type=nonneg_int, default=None, help="random seed >= 0 (same seed, same text)")
    p.add_argument("--max-new-tokens", type=positive_int, default=max_new, help=f"default {max_new}")
    p.add_argument("--no-speculative", action="store_true",
                   help="one token per forward. By default greedy decoding (--temperature 0) drafts the tokens "
                        "that followed the last occurrence of the last 3 and verifies them with head 0 in one "
                        "forward: the same text in fewer forwards. Sampling is always one token per forward")
    from ..infer.quant import WTYPES, block_types, decodable, quantizable
    made = quantizable()
    p.add_argument("--dtype", choices=decodable(), default=None,
                   help=f"the weights while decoding (default float32; a checkpoint imported from a GGUF file: the "
                        f"type most of its matrices had there). float16 rounds them to half precision and computes "
                        f"in float32, as llama.cpp runs an f16 GGUF: half the bytes read per token. "
                        f"{', '.join(made)}: GGUF's blocks of 32 weights (8, 4 or 5 bits + a float16 scale), "
                        f"quantized at load as gguf rounds them and multiplied in integers with 8-bit activations, "
                        f"as llama.cpp runs such a file (needs AVX2 or AVX512-VNNI): "
                        f"{' / '.join(f'{WTYPES[n].bytes_per_weight:.2f}' for n in made)} bytes per weight. "
                        f"{', '.join(n for n in block_types() if n not in made)} (256-weight super-blocks) are "
                        f"decoded only as read from a file: a float model is refused (we do not reproduce "
                        f"llama.cpp's search that makes them). Logits move (float16 ~1e-3 relative, q8_0 ~1e-2), "
                        f"so a text can differ")


def source_dtype(ckpt) -> str:
    """The --dtype a checkpoint decodes in by default: float32, or for one imported from a GGUF file the type
    most of its matrices had there (source.json, see dtype_of_source)."""
    from ..checkpoint import read_source
    return dtype_of_source(read_source(ckpt) if ckpt else None)


def dtype_of_source(src: dict | None) -> str:
    """The --dtype of a GGUF import's source record (source.json's dict; None: not imported): the type most of
    its matrices had in the file (Q8_0 -> q8_0, ...; a type a float32 model cannot be put in again, the K
    types included (see --dtype) -> float32)."""
    from collections import Counter

    from ..infer.quant import from_float, of_gguf
    if src is None:
        return "float32"
    kinds = Counter(str(t) for name, t in src["tensor_types"].items() if "norm" not in name)
    t = of_gguf(kinds.most_common(1)[0][0]) if kinds else None
    return t.name if t is not None and t.name in from_float() else "float32"


def decoding_model(model, args):
    """The model generation runs, in --dtype (default: source_dtype of --ckpt; infer/weights.py). A default
    block type this CPU cannot decode in integers falls back to float32, with a note; an asked one is refused."""
    from ..infer import qkernels
    from ..infer.weights import for_dtype
    dtype = getattr(args, "dtype", None)
    if dtype is None:
        dtype = source_dtype(getattr(args, "ckpt", None))
        if dtype not in ("float32", "float16") and not qkernels.AVAILABLE:
            print(f"note: this CPU cannot decode {dtype} in integers (`sample --help`); decoding in float32",
                  file=sys.stderr)
            dtype = "float32"
    return for_dtype(model, dtype)


def load_for_decoding(args):
    """(the model generation runs, the tokenizer) of --ckpt: a checkpoint directory, decoded in --dtype (see
    decoding_model), or a .gguf file, read in memory (nothing written). A .gguf file, and by default a checkpoint
    imported from one (its checkpoint.source_blocks), decode as the file holds them, each matrix in its own
    type, the blocks going from the mapped file to the kernels without a float32 copy
    (weights.QuantizedModel.from_blocks); with --dtype, dequantized and decoded in that type."""
    from pathlib import Path

    from ..checkpoint import check_vocab, drop_pages, load_model, load_tokenizer, read_out, source_blocks
    from ..infer import qkernels
    from ..infer.weights import QuantizedModel, for_dtype
    from ..training.memory import check_inference_fits
    from ..model import Model
    if getattr(args, "threads", None) is not None:
        use_threads(args.threads)
    if Path(args.ckpt).suffix.lower() == ".gguf":
        from ..interop.gguf_import import load_gguf
        dtype = getattr(args, "dtype", None)
        as_file = dtype is None and qkernels.AVAILABLE
        if dtype is None and not as_file:
            print("note: this CPU cannot decode the file's block types in integers (`sample --help`); decoding in "
                  "float32", file=sys.stderr)
        cfg, params, tok, _ = load_gguf(args.ckpt, blocks=as_file)
        check_inference_fits(cfg)
        if as_file:   # (each tensor's pages let go once checked: read back when packed)
            return QuantizedModel.from_blocks(cfg, params, drop_pages), tok
        return for_dtype(Model(cfg, params), dtype or "float32"), tok
    tok = load_tokenizer(args.ckpt, read_only=True)
    blocks = source_blocks(args.ckpt) if getattr(args, "dtype", None) is None else None
    if blocks and qkernels.AVAILABLE:  # an import, as its file held it: its blocks, the rest of its weights mapped
        cfg, params = load_model(args.ckpt, read_only=True, mapped=True, finite=False)  # from_blocks checks
        check_vocab(cfg, tok)
        check_inference_fits(cfg)
        rest = {n: read_out(p) for n, p in params.items() if n not in blocks}  # the norms (none of the matrices)
        return QuantizedModel.from_blocks(cfg, rest | blocks, drop_pages), tok
    model = Model.load(args.ckpt, read_only=True)
    check_vocab(model.config, tok)
    check_inference_fits(model.config)
    return decoding_model(model, args), tok


def check_temperature(name: str, value) -> float:
    """0 (greedy) or a finite number in [0.01, 100]; 'nan', 'inf', '-1', '1e-300' -> UserError."""
    from ..errors import UserError
    from ..infer.sampling import MIN_TEMPERATURE
    from .args import check_float
    t = check_float(name, value, 0, 100)
    if 0 < t < MIN_TEMPERATURE:
        raise UserError(f"{name}: must be 0 (greedy) or at least {MIN_TEMPERATURE:g}, got {value!r}")
    return t


def check_sampling_args(args) -> None:
    """The same rules for a Namespace not built by argparse (a test, a script); top_k 0 -> None (no limit)."""
    from ..errors import UserError
    from .args import check_float
    args.temperature = check_temperature("--temperature", args.temperature)
    if args.top_k is not None and (type(args.top_k) is not int or args.top_k < 0):
        raise UserError("--top-k must be an integer >= 0 (0 = no limit)")
    args.top_k = args.top_k or None
    if args.top_p is not None:
        args.top_p = check_float("--top-p", args.top_p, 0, 1, lo_open=True)
    if type(args.max_new_tokens) is not int or args.max_new_tokens < 1:
        raise UserError("--max-new-tokens must be an integer >= 1")
    if args.seed is not None and (type(args.seed) is not int or args.seed < 0):
        raise UserError("--seed must be an integer >= 0")
    from ..infer.quant import decodable
    if getattr(args, "dtype", None) not in (None, *decodable()):
        raise UserError(f"--dtype must be one of {', '.join(decodable())}")


class StdoutStream:
    """An on_token callback that prints each new token's text as soon as its UTF-8 is complete (not </s>);
    flush() prints what is left of a character cut off at the end."""

    def __init__(self, tok):
        from ..infer.session import StreamDecoder
        self.tok, self.dec = tok, StreamDecoder(tok)

    def __call__(self, token: int) -> None:
        if token != self.tok.eos_id:
            sys.stdout.write(escape_control(self.dec.feed(token)))
            sys.stdout.flush()

    def flush(self) -> None:
        sys.stdout.write(escape_control(self.dec.flush()))


def mode_of(args) -> str:
    """Speculative for greedy decoding unless asked not to; sampling is plain KV-cache decoding."""
    return "speculative" if args.temperature == 0 and not args.no_speculative else "cache"


def register(sub) -> None:
    p = sub.add_parser("sample", help="generate text from a checkpoint (streams)",
                       description="Continue --prompt with a checkpoint's model, printing tokens as they come. "
                                   "Generation uses a KV cache and stops at </s> or --max-new-tokens. A prompt "
                                   "longer than the context keeps its last ctx_len tokens (with a notice). Control "
                                   "characters the model writes are shown escaped (\\x1b); --json gives the exact text.")
    p.add_argument("--ckpt", required=True, help="checkpoint directory or .gguf file (decoded as the file holds it, each matrix in its type; read only)")
    p.add_argument("--prompt", required=True, help="the text to continue ('-' reads it from stdin)")
    add_sampling_args(p, temperature=0.8, max_new=200)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    p.set_defaults(run=run)


def run(args) -> int:
    from ..checkpoint import check_vocab, load_tokenizer
    from ..errors import UserError
    from ..infer.session import generate, truncate_left
    from ..infer.step import fuse_weights
    from ..model import Model
    check_sampling_args(args)
    decoder, tok = load_for_decoding(args)  # (refuses a --dtype the model cannot take: before anything is printed)
    model = decoder
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    text_ids = tok.encode(prompt)
    if not text_ids:
        raise UserError("the prompt is empty")
    bos = [] if tok.bos_id is None else [tok.bos_id]  # an imported Llama-3's bos first, as its own tokenizer does
    ids, dropped = truncate_left(bos + text_ids, model.config.ctx_len)
    shown = ids if dropped else ids[len(bos):]  # the prompt as typed, as kept (a cut prompt lost its bos first)
    if dropped:
        print(f"note: the prompt has {len(ids) + dropped} tokens, more than the context of {model.config.ctx_len}; "
              f"kept the last {len(ids)}", file=sys.stderr)
    fused = fuse_weights(decoder.config, decoder.params)   # (before the prompt is shown: a first compile's note)
    stream = None
    if not args.json:
        sys.stdout.write(escape_control(tok.decode(shown)))
        stream = StdoutStream(tok)
    g = generate(decoder, ids, args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed,
                 stop_ids=[tok.eos_id], mode=mode_of(args), on_token=stream, fused=fused)
    if args.json:
        print(json.dumps({"prompt": tok.decode(shown), "text": tok.decode(g.ids), "ids": g.ids, "stopped": g.stopped,
                          "prompt_truncated": dropped, "tokens_per_s": g.tokens_per_s, "mode": mode_of(args)}))
    else:
        stream.flush()
        sys.stdout.write("\n")
    return 0
