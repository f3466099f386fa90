"""Tokenizers: byte-level BPE (`tokenizer.py`: train, encode, decode, save, load, export; its compiled kernels
in `bpe_fast.py`), and for imported models SentencePiece-style BPE (`sentencepiece.py`, kernels in
`spm_fast.py`; Gemma 4's too), WordPiece (`wordpiece.py`, BERT) and Unigram (`unigram.py`, its charsmap in
`charsmap.py`), behind one interface (`base.py`). `Tokenizer.load` returns the kind a tokenizer.json names.
SPEC.md fixes the format."""
from .tokenizer import GPT2_PATTERN, Tokenizer, bytes_to_unicode, encode_parallel

__all__ = ["GPT2_PATTERN", "Tokenizer", "bytes_to_unicode", "encode_parallel"]
