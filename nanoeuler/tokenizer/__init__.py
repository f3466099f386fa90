"""Tokenizers: byte-level BPE (`tokenizer.py`: train, encode, decode, save, load, export; its compiled kernels
in `bpe_fast.py`; `pretokenize.py` the regexes that cut text before it merges, checked and bounded in time), and
for imported models SentencePiece-style BPE (`sentencepiece.py`, kernels in `spm_fast.py`; Gemma 4's too),
WordPiece (`wordpiece.py`, BERT) and Unigram (`unigram.py`, its charsmap in `charsmap.py`), behind one interface
(`base.py`). `Tokenizer.load` returns the kind a tokenizer.json names. SPEC.md fixes the format."""
from .pretokenize import GPT2_PATTERN
from .tokenizer import Tokenizer, bytes_to_unicode, encode_parallel

__all__ = ["GPT2_PATTERN", "Tokenizer", "bytes_to_unicode", "encode_parallel"]
