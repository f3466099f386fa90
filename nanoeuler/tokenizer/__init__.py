"""The tokenizer: byte-level BPE (`tokenizer.py`: train, encode, decode, save, load, export) and its
compiled numba kernels (`bpe_fast.py`: pre-tokenization, pair counting, merging). SPEC.md fixes the format."""
from .tokenizer import GPT2_PATTERN, Tokenizer, bytes_to_unicode, encode_parallel

__all__ = ["GPT2_PATTERN", "Tokenizer", "bytes_to_unicode", "encode_parallel"]
