"""`nanoeuler export` (to Hugging Face transformers or GGUF for llama.cpp) and `nanoeuler import`
(a Hugging Face folder or a GGUF file -> a checkpoint). See nanoeuler/interop/."""
from __future__ import annotations

import json


def architectures(kind: str) -> str:
    """The names format `kind` gives the architectures of arch.py, for --help: "hf": the config's architectures
    entry (LlamaForCausalLM, ...), "gguf": general.architecture (llama, ...)."""
    from ..arch import ARCHS
    return ", ".join(dict.fromkeys(a.hf.aliases[0] if kind == "hf" else a.gguf.name for a in ARCHS.values()))


def register(sub) -> None:
    e = sub.add_parser(
        "export", help="export a checkpoint to Hugging Face transformers (--format hf) or GGUF (--format gguf)",
        description="Export a checkpoint. --format hf writes a folder that transformers' AutoModelForCausalLM and "
                    f"AutoTokenizer load with no code of ours ({architectures('hf')}; MTP heads "
                    "1..K-1 in a side file that `nanoeuler import` reads back; the chat template in "
                    "tokenizer_config.json). --format gguf writes one .gguf file for llama.cpp (general.architecture "
                    f"{architectures('gguf')}; q/k rows permuted for its RoPE layout where it needs that, the "
                    "tokenizer and chat template in the metadata). --format peft writes "
                    "an adapter run's LoRA adapters as a PEFT folder that PeftModel.from_pretrained loads on the "
                    "base's --format hf export, and --format gguf-lora as one .gguf LoRA adapter that llama.cpp applies "
                    "(--lora) on the base's --format gguf export (hf and gguf of an adapter run export it merged). "
                    "An existing output "
                    "is refused unless --force; the output appears whole or not at all.")
    e.add_argument("--ckpt", required=True, help="checkpoint directory (from train, sft, dpo or import)")
    e.add_argument("--format", required=True, choices=["hf", "gguf", "peft", "gguf-lora"],
                   help="hf: transformers folder; gguf: llama.cpp file; peft: an adapter run's LoRA adapters as a "
                        "PEFT folder (adapter_config.json + adapter_model.safetensors) for the base's hf export; "
                        "gguf-lora: an adapter run's LoRA adapters as a llama.cpp adapter file (float32) for the "
                        "base's gguf export")
    e.add_argument("--out", required=True, help="output folder (hf, peft) or .gguf file (gguf, gguf-lora)")
    from ..infer.quant import from_float
    e.add_argument("--dtype", default=None,
                   help=f"hf: float32 (default), bfloat16, float16; gguf: {', '.join(from_float())} (f32 and f16, "
                        f"llama.cpp's names, too; default: float32, or for a checkpoint imported from a GGUF file its "
                        f"matrices as that file held them, byte for byte); peft and gguf-lora write float32 adapters "
                        f"and take none")
    e.add_argument("--force", action="store_true", help="replace an existing output")
    e.add_argument("--no-progress", action="store_true", help="no progress bar")
    e.add_argument("--json", action="store_true", help="print one JSON object describing the result")
    e.set_defaults(run=run_export)

    i = sub.add_parser(
        "import", help="import a Hugging Face folder or a GGUF file (quantized included) as a checkpoint",
        description="Import a Hugging Face model folder (config.json of an architecture of ours: "
                    f"{architectures('hf')}; model.safetensors or shards with model.safetensors.index.json, a "
                    "tokenizer.json: byte-level BPE, or SentencePiece-style BPE with byte fallback) "
                    f"or a GGUF file (general.architecture {architectures('gguf')}; any tensor type the gguf "
                    "package dequantizes: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_x, Q2_K..Q6_K; the type of each "
                    "tensor is kept in the checkpoint's source.json) as a nanoeuler checkpoint that sample, chat, "
                    "serve, sft, dpo and eval use unchanged (sample, chat and serve decode the file's blocks as "
                    "they are: `sample --ckpt FILE.gguf` needs no import). The model's token ids and chat template "
                    "are kept. What none of them has (RoPE scaling other than linear and llama3, another architecture, a "
                    "WordPiece / Unigram / RWKV vocabulary) is refused by name. An existing --out is refused unless --force.")
    i.add_argument("--from", dest="src", required=True, help="Hugging Face model folder or .gguf file")
    i.add_argument("--out", required=True, help="checkpoint directory to create")
    i.add_argument("--mtp", type=int, default=None,
                   help="number K of MTP heads; heads 1..K-1 start as copies of head 0 unless the folder has them "
                        "(default: as many as the folder has, 1 for a plain Llama)")
    i.add_argument("--force", action="store_true", help="replace an existing --out")
    i.add_argument("--no-progress", action="store_true", help="no progress bar")
    i.add_argument("--json", action="store_true", help="print one JSON object describing the result")
    i.set_defaults(run=run_import)


def run_export(args) -> int:
    from ..checkpoint import load_tokenizer
    from ..errors import UserError
    from ..interop.outputs import check_free
    from ..model import Model
    check_free(args.out, args.force, inputs=[args.ckpt])  # before anything is read: never over it nor its base
    if args.dtype is not None and args.format in ("peft", "gguf-lora"):
        raise UserError(f"--dtype is not for --format {args.format}: the adapters are written in float32")
    if args.format == "peft":
        from ..interop.peft import export_peft
        out = export_peft(args.ckpt, args.out, args.force)
        print(json.dumps({"ckpt": args.ckpt, "format": "peft", "out": str(out)}) if args.json
              else f"exported the adapters of {args.ckpt} as a PEFT folder -> {out}")
        return 0
    if args.format == "gguf-lora":
        from ..interop.gguf_export import export_gguf_lora
        out = export_gguf_lora(args.ckpt, args.out, args.force)
        print(json.dumps({"ckpt": args.ckpt, "format": "gguf-lora", "out": str(out)}) if args.json
              else f"exported the adapters of {args.ckpt} as a llama.cpp LoRA adapter -> {out}")
        return 0
    model = Model.load(args.ckpt, read_only=True)  # export only reads RUN: a pending save is not applied
    tok = load_tokenizer(args.ckpt, read_only=True)
    if args.format == "hf":
        from ..interop.hf import export_hf
        dtype = "float32" if args.dtype is None else args.dtype
        out = export_hf(model, tok, args.out, dtype, args.force, progress=not args.no_progress)
    else:
        from ..checkpoint import source_blocks
        from ..interop.gguf_export import LLAMA_CPP_NAMES, export_gguf
        blocks = source_blocks(args.ckpt) if args.dtype is None else None   # an import: its file's blocks again
        dtype = "float32" if args.dtype is None else LLAMA_CPP_NAMES.get(args.dtype, args.dtype)
        out = export_gguf(model, tok, args.out, dtype, args.force, progress=not args.no_progress, blocks=blocks)
        if blocks:
            dtype = "as imported"
    if args.json:
        print(json.dumps({"ckpt": args.ckpt, "format": args.format, "dtype": dtype, "out": str(out),
                          "n_params": model.n_params(), "n_mtp": model.config.n_mtp}))
    else:
        print(f"exported {args.ckpt} ({model.n_params():,} parameters) as {args.format} {dtype} -> {out}")
    return 0


def run_import(args) -> int:
    from pathlib import Path
    from ..interop.outputs import check_free
    check_free(args.out, args.force, inputs=[args.src])
    if Path(args.src).is_file():
        from ..interop.gguf_import import import_gguf as import_model
    else:
        from ..interop.hf import import_folder as import_model
    cfg, params, tok = import_model(args.src, args.out, args.mtp, args.force, progress=not args.no_progress)
    disk = {f.name: f.stat().st_size for f in Path(args.out).iterdir() if f.is_file()}
    if args.json:
        print(json.dumps({"from": args.src, "out": args.out, "config": cfg.to_dict(), "n_params": cfg.n_params(),
                          "tokenizer": {"kind": tok.kind, "vocab_size": tok.vocab_size, "merges": len(tok.merges),
                                        "eos": tok.eos_token}, "disk_bytes": disk}))
    else:
        print(f"imported {args.src} -> {args.out}: {cfg.n_layers} layers, dim {cfg.dim}, heads {cfg.n_heads}/"
              f"{cfg.n_kv_heads}, vocab {cfg.vocab_size}, ctx {cfg.ctx_len}, {cfg.n_mtp} head(s), "
              f"{cfg.n_params():,} parameters; eos {tok.eos_token!r}")
        print(f"on disk: {sum(disk.values()) / 1e6:,.0f} MB: float32 weights {disk['model.safetensors'] / 1e6:,.0f} MB "
              f"(training, export)" + (f", the file's own blocks {disk['source.safetensors'] / 1e6:,.0f} MB (what "
                                      f"sample, chat and serve decode)" if "source.safetensors" in disk else ""))
    return 0
