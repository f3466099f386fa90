"""Tokenizers: byte-level BPE (`tokenizer.py`: train, encode, decode, save, load, export; its compiled kernels
in `bpe_fast.py`) and SentencePiece-style BPE for imported models (`sentencepiece.py`, kernels in
`spm_fast.py`), behind one interface (`base.py`). `Tokenizer.load` returns the kind a tokenizer.json names.
SPEC.md fixes the format."""
from .tokenizer import GPT2_PATTERN, Tokenizer, bytes_to_unicode, encode_parallel

__all__ = ["GPT2_PATTERN", "Tokenizer", "bytes_to_unicode", "encode_parallel"]
