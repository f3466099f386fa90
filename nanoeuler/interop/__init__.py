"""Interop: our checkpoints <-> Hugging Face `transformers` folders and GGUF files (llama.cpp).

Our block *is* the Llama block (pre-norm RMSNorm, rotate-half RoPE, GQA, SwiGLU, no biases), so both
directions are exact; only the names differ (SPEC "Interop names"), plus three details:

- MTP heads: head 0 is Llama's `lm_head`; heads 1..K-1 travel in a side file (`nanoeuler_mtp.safetensors`)
  that `import` reads back, so export -> import restores the full model.
- token ids: a Hugging Face vocabulary may order its tokens any way (GPT-2 puts the bytes in its
  byte-to-unicode order, SmolLM its specials first). `import` keeps them: the Tokenizer carries the
  folder's ids (`tok.ids`) and the embedding and head rows stay in the folder's order, so the imported
  model takes and gives the very ids transformers / llama.cpp use; `export` writes them back.
- GGUF: llama.cpp applies RoPE to interleaved pairs (2i, 2i+1), we and HF to (i, i + hd/2); the q and k
  rows are permuted as llama.cpp's `convert_hf_to_gguf.py` does (`gguf_export.permute_qk`).

Modules: `safetensors_io` (read/write f32/f16/bf16 without torch), `hf_tokenizer` (HF tokenizer.json ->
our Tokenizer with the same ids), `hf` (export), `importer` (import of HF folders, one function per
architecture), `gguf_export`, `gguf_import` (GGUF files, quantized included), `gguf_file` (a GGUF header and its vocabulary read
straight from the mapped file),
`outputs` (refuse-or-replace output paths atomically). Chat templates travel with the tokenizer
(nanoeuler/chat_template.py).
"""
