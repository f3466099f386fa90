"""A Llama-3.2-1B-shaped model at its real size, made as a user's files are made: the GGUF files the 1B
speed and memory comparisons against llama.cpp run on (docs/benchmarks.md, "Llama 3.2 1B's shape").

    random weights   transformers' LlamaForCausalLM of Llama-3.2-1B's config (16 layers, width 2048, 32 / 8
                     heads of 64, ffn 8192, vocab 128,256, RoPE θ 500000 with `llama3` scaling: factor 32, low 1,
                     high 4, original context 8192; tied embeddings), its own init (N(0, 0.02), norms 1), bfloat16
    HF folder        save_pretrained (safetensors) + Llama 3's tokenizer.json, built from the vocabulary llama.cpp
                     ships (models/ggml-vocab-llama-bpe.gguf: tokens, merges, control tokens) with Meta's
                     pre-tokenizer, so that the converter recognises it as `llama-bpe` by its hash
    f16 GGUF         llama.cpp's own convert_hf_to_gguf.py (rope_freqs written from the scaling, as for the real one)
    Q8_0, Q4_K_M     llama.cpp's own llama-quantize of the f16 file (Q4_K_M: Q4_K with Q6_K for some tensors)

Into --out (default .cache/llama3-1b, ignored by git): hf/, llama3-1b-f16.gguf, llama3-1b-Q8_0.gguf,
llama3-1b-Q4_K_M.gguf. A step whose output exists is skipped. About 5 minutes on 2 cores; peak ~5 GiB (the
converter).

    .venv/bin/python bench/llama3_1b.py --llama-quantize PATH/llama-quantize
then (the commands docs/benchmarks.md gives): bench/greedy_vs_llama_cpp.py, bench/llama_types.py --files,
bench/real_files.py --files --skip-quality on the two quantized files.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LLAMA_CPP = ROOT / ".cache" / "llama-cpp-python" / "vendor" / "llama.cpp"
VOCAB = LLAMA_CPP / "models" / "ggml-vocab-llama-bpe.gguf"
# Meta-Llama-3's pre-tokenizer split (its tokenizer.json, as transformers' GGUF reader also writes it)
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
CONTROL = 3  # gguf token_type of a control token (<|begin_of_text|>, <|reserved_special_token_N|>, ...)
QUANTS = ("Q8_0", "Q4_K_M")


def llama_1b_config() -> dict:
    """Llama-3.2-1B's config.json fields (its published config)."""
    return dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
                rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True, initializer_range=0.02,
                bos_token_id=128000, eos_token_id=128001, hidden_act="silu",
                rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})


def llama3_tokenizer_json(vocab: Path) -> dict:
    """Llama 3's tokenizer.json from llama.cpp's vocabulary file: the BPE of its normal tokens and merges
    (ignore_merges, as Meta's), its control tokens as added specials, BOS put before the text."""
    import gguf
    fields = gguf.GGUFReader(vocab).fields
    tokens, types = fields["tokenizer.ggml.tokens"].contents(), fields["tokenizer.ggml.token_type"].contents()
    bos = fields["tokenizer.ggml.bos_token_id"].contents()
    bpe = {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
           "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": True,
           "vocab": {t: i for i, (t, k) in enumerate(zip(tokens, types)) if k != CONTROL},
           "merges": fields["tokenizer.ggml.merges"].contents()}
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
              "special": True} for i, (t, k) in enumerate(zip(tokens, types)) if k == CONTROL]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}
    bos_first = {"type": "TemplateProcessing",
                 "single": [{"SpecialToken": {"id": tokens[bos], "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                 "pair": [{"SpecialToken": {"id": tokens[bos], "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                          {"SpecialToken": {"id": tokens[bos], "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
                 "special_tokens": {tokens[bos]: {"id": tokens[bos], "ids": [bos], "tokens": [tokens[bos]]}}}
    return {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
            "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": LLAMA3_SPLIT}, "behavior": "Isolated", "invert": False},
                byte_level]},
            "post_processor": {"type": "Sequence", "processors": [byte_level | {"trim_offsets": False}, bos_first]},
            "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
            "model": bpe}


def write_hf_folder(folder: Path) -> None:
    """The random model saved by transformers (bfloat16 safetensors) with Llama 3's tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # made and initialised in bfloat16: 2.5 GB, not float32's 5
    try:
        model = LlamaForCausalLM(LlamaConfig(**llama_1b_config()))
    finally:
        torch.set_default_dtype(default)
    model.save_pretrained(folder)
    (folder / "tokenizer.json").write_text(json.dumps(llama3_tokenizer_json(VOCAB), ensure_ascii=False))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
         "eos_token": "<|end_of_text|>", "model_max_length": 131072, "clean_up_tokenization_spaces": True}))


# llama.cpp's converter as a user runs it; only its import of sentencepiece (not installed here; the folder
# has no tokenizer.model, which it looks for first) is answered as the missing file it then falls back from
CONVERT = """
import runpy, sys
src, folder, out = sys.argv[1:4]
sys.path[:0] = [src, src + "/gguf-py"]
import conversion.base as base
def no_sentencepiece(self):
    raise FileNotFoundError("no tokenizer.model")
base.TextModel._create_vocab_sentencepiece = no_sentencepiece
sys.argv = ["convert_hf_to_gguf.py", folder, "--outfile", out, "--outtype", "f16"]
runpy.run_path(src + "/convert_hf_to_gguf.py", run_name="__main__")
"""


def run(argv: list[str], what: str) -> None:
    print(f"{what} ...", file=sys.stderr, flush=True)
    out = subprocess.run(argv, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{what} failed: {out.stderr.strip()[-1500:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / ".cache" / "llama3-1b"), help="folder (default .cache/llama3-1b)")
    ap.add_argument("--llama-quantize", default=os.environ.get("LLAMA_QUANTIZE") or shutil.which("llama-quantize"),
                    help="llama.cpp's llama-quantize binary (default $LLAMA_QUANTIZE, else on PATH)")
    args = ap.parse_args()
    if not (LLAMA_CPP / "convert_hf_to_gguf.py").is_file():
        raise SystemExit(f"no llama.cpp converter under {LLAMA_CPP}: run `make llama-src`")
    out = Path(args.out)
    hf, f16 = out / "hf", out / "llama3-1b-f16.gguf"
    if not (hf / "tokenizer_config.json").is_file():
        print("random Llama-3.2-1B-shaped model -> HF folder ...", file=sys.stderr, flush=True)
        write_hf_folder(hf)
    if not f16.is_file():
        run([sys.executable, "-c", CONVERT, str(LLAMA_CPP), str(hf), str(f16) + ".tmp"], "convert_hf_to_gguf.py")
        os.replace(str(f16) + ".tmp", f16)
    for q in QUANTS:
        path = out / f"llama3-1b-{q}.gguf"
        if not path.is_file():
            if not args.llama_quantize:
                raise SystemExit("no llama-quantize binary: --llama-quantize PATH")
            run([args.llama_quantize, str(f16), str(path) + ".tmp", q, "2"], f"llama-quantize {q}")
            os.replace(str(path) + ".tmp", path)
        print(path)


if __name__ == "__main__":
    main()
