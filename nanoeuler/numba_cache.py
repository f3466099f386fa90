"""numba's on-disk cache, invalidated by any change to any of our kernel sources, not only the function's own.

numba (`cache=True`) keys a cached function on the content of the file that defines it. A kernel compiled
with code from another file keeps that code frozen in: `infer/kernels.py` inlines `fast/vmath.vexp`,
`fast/engine.py` calls `fast/kernels.py`, kernels read constants of `ops/`. Edit vmath.py alone and the next
run would load kernels with the old exp in them (a stale kernel runs superseded code; after a change of
weight layout it would read the weights wrongly, without an error). So every function defined in this
package is stamped with its own file's hash and a digest of all the package's sources that numba compiles
from (`kernel_sources`); change any of them and every cached kernel of the package is compiled afresh once.

`install()` patches numba's source-file locators (private API, stable since numba 0.4x); if numba changes
them, it does nothing and caching works as numba's own. `note_first_compile` says on stderr, before a long
compile that a cold cache makes (the decoding step: a minute or two), what the wait is and that it happens once.
"""
from __future__ import annotations

import hashlib
import sys
from functools import lru_cache
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent


def kernel_sources(root: Path = PACKAGE) -> list[Path]:
    """The package's files that numba compiles from: those importing numba, and ops/ (constants)."""
    files = sorted(root.rglob("*.py"))
    return [f for f in files if "numba" in f.read_text(encoding="utf-8", errors="replace")
            or f.parent.name == "ops"]


def digest(paths: list[Path]) -> str:
    """sha256 over the paths' names and contents (in order)."""
    h = hashlib.sha256()
    for p in paths:
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


@lru_cache(maxsize=1)
def sources_digest() -> str:
    return digest(kernel_sources())


def install() -> None:
    """Stamp this package's cached numba functions with sources_digest() too (once per process)."""
    try:
        from numba.core import caching
        mixin = caching._SourceFileBackedLocatorMixin
    except (ImportError, AttributeError):
        return
    if getattr(mixin, "_nanoeuler", False):
        return
    own_stamp = mixin.get_source_stamp

    def get_source_stamp(self):
        stamp = own_stamp(self)
        try:
            ours = Path(self._py_file).resolve().is_relative_to(PACKAGE)
        except (AttributeError, OSError):
            return stamp
        return (stamp, sources_digest()) if ours else stamp

    mixin.get_source_stamp = get_source_stamp
    mixin._nanoeuler = True


def compiled_before(dispatcher) -> bool:
    """Whether numba's cache holds a version of `dispatcher` (an njit function with cache=True) compiled for
    this CPU from the current sources, so that its first call loads it rather than compiling. True when numba's
    private cache API is not as expected (nothing is said then)."""
    try:
        magic = dispatcher.targetctx.codegen().magic_tuple()
        return any(key[1] == magic for key in dispatcher._cache._cache_file._load_index())
    except Exception:   # noqa: BLE001 (numba's internals changed)
        return True


noted: set[str] = set()   # what note_first_compile has looked at in this process


def note_first_compile(dispatcher, what: str, how_long: str) -> None:
    """Once per process and `what`: a stderr line before `dispatcher` compiles on a cold cache (compiled_before
    false), saying what compiles, about how long it takes, and that later runs load it."""
    if what in noted:
        return
    noted.add(what)
    if not compiled_before(dispatcher):
        print(f"note: compiling {what} for this CPU, once (about {how_long} on 2 cores; numba keeps them in its "
              f"cache for later runs)", file=sys.stderr)
