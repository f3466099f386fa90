"""The checkpoint directory: atomic multi-file save, safe load (no pickle), resume state, run lock.

A checkpoint is a directory holding `model.safetensors`, `config.json`, `tokenizer.json` and, for a
training run, `optimizer.safetensors` + `trainer.json`. A save must never leave a mix of old and new
files, so it is a small journal:

    1. write every new file into RUN/.staging/, then      (a crash here: RUN still holds the old set)
       RUN/.staging/.journal.json: {"magic", "files": {name: size}}
    2. rename RUN/.staging -> RUN/.commit                 (atomic: the new set is now complete on disk)
    3. move each file from RUN/.commit into RUN           (a crash here: rolled forward on the next load)
    4. remove RUN/.commit

`recover(run_dir)` finishes step 3 if a save was interrupted after step 2 and discards a half-written
.staging, so every reader sees either the previous checkpoint or the new one, never a mix. It rolls
forward only a journal it can prove it wrote: `.commit` a real directory (not a link), holding only
regular files named in the journal with the journal's sizes, the files already moved sitting in RUN with
their sizes. Anything else is refused with a one-line error and left untouched. Files only ever move
from RUN/.commit to RUN, so loading never writes outside the checkpoint.

Read-only commands (`sample`, `chat`, `eval`, `info`, `export`) pass `read_only=True`: they modify
nothing at all; a pending journal is reported on stderr and its files are read from where they lie
(`member(run, name)`), which is the new, complete set.

Non-finite weights are never saved (`check_finite` runs before every save of weights and optimizer
state) and never loaded. `run_lock(dir)` holds an exclusive lock on a run or data directory for the
length of a training run or a `prepare`; a second process gets the first one's pid and command.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import shutil
import stat
import sys
import time
import weakref
from pathlib import Path
from typing import Callable

import numpy as np

from .config import PRECISIONS, Config
from .errors import UserError

STAGING, COMMIT, JOURNAL, LOCK = ".staging", ".commit", ".journal.json", ".lock"
JOURNAL_MAGIC = "nanoeuler checkpoint journal v1"
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,127}$")   # a plain file name: no '/', no leading '.'


# ---- finiteness ---------------------------------------------------------------------------------
def check_finite(tensors: dict[str, np.ndarray], what: str, hint: str = "") -> None:
    """Refuse (UserError) if any tensor holds NaN or inf; names the first such tensor and the count.

        check_finite({"a": np.ones(2)}, "weights")            # passes
        check_finite({"a": np.array([1.0, np.nan])}, "weights")
        # UserError: weights: tensor a has 1 non-finite value(s) (NaN/inf) ...
    """
    bad = []
    for name, a in tensors.items():
        a = np.asarray(a)
        if a.dtype.kind in "fc" and not np.isfinite(a).all():
            bad.append((name, int(a.size - np.count_nonzero(np.isfinite(a)))))
    if bad:
        name, n = bad[0]
        more = f" (and {len(bad) - 1} more tensor(s))" if len(bad) > 1 else ""
        raise UserError(f"{what}: tensor {name} has {n} non-finite value(s) (NaN/inf){more}{hint}")


# ---- the journal --------------------------------------------------------------------------------
def _is_plain_dir(path: Path) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except FileNotFoundError:
        return False


def _lexists(path: Path) -> bool:
    return os.path.lexists(path)


def read_journal(run_dir: str | Path) -> dict | None:
    """The verified journal of a save that reached step 2 but not step 4, or None if there is none.

    Raises UserError (touching nothing) when RUN/.commit exists but is not provably ours: a link, a
    non-directory, no or a foreign journal, a file not named in it, a size that differs, a link inside."""
    run_dir = Path(run_dir)
    commit = run_dir / COMMIT
    if not _lexists(commit):
        return None

    def refuse(why: str):
        raise UserError(f"checkpoint {run_dir}: {commit} {why}; it was not written by an interrupted nanoeuler "
                        f"save, so it is left untouched: inspect it and remove it by hand")

    if not _is_plain_dir(commit):
        refuse("is a link or not a directory")
    jpath = commit / JOURNAL
    try:
        st = os.lstat(jpath)
    except FileNotFoundError:
        refuse(f"has no {JOURNAL}")
    if not stat.S_ISREG(st.st_mode) or st.st_size > 1 << 20:
        refuse(f"has a {JOURNAL} that is not a small regular file")
    try:
        journal = json.loads(jpath.read_bytes())
    except (ValueError, UnicodeDecodeError):
        refuse(f"has an unreadable {JOURNAL}")
    files = journal.get("files") if isinstance(journal, dict) else None
    if (journal.get("magic") if isinstance(journal, dict) else None) != JOURNAL_MAGIC or not isinstance(files, dict) \
            or not all(isinstance(n, str) and _NAME.match(n) and n != JOURNAL and type(s) is int and s >= 0
                       for n, s in files.items()):
        refuse(f"has a {JOURNAL} that is not ours")
    for entry in os.scandir(commit):
        if entry.name == JOURNAL:
            continue
        if entry.name not in files:
            refuse(f"holds {entry.name!r}, which its journal does not list")
        st = os.lstat(entry.path)
        if not stat.S_ISREG(st.st_mode):
            refuse(f"holds {entry.name!r}, which is a link or not a regular file")
        if st.st_size != files[entry.name]:
            refuse(f"holds {entry.name!r} of {st.st_size} bytes, but its journal says {files[entry.name]}")
    for name, size in files.items():
        if _lexists(commit / name):
            continue
        try:
            st = os.lstat(run_dir / name)     # already moved by the interrupted roll-forward
        except FileNotFoundError:
            refuse(f"lacks {name!r}, which is in neither it nor the checkpoint")
        if not stat.S_ISREG(st.st_mode) or st.st_size != size:
            refuse(f"lacks {name!r}, and the checkpoint's {name} is not the journal's ({size} bytes)")
    return journal


def recover(run_dir: str | Path, read_only: bool = False) -> dict | None:
    """Complete a save interrupted after step 2 and discard a half-written .staging (module docstring).

    With read_only nothing is modified: a pending journal is reported on stderr and returned, so the
    caller reads its files with `member()`. Returns the pending journal (read_only) or None."""
    run_dir = Path(run_dir)
    journal = read_journal(run_dir)
    if read_only:
        if journal is not None:
            print(f"note: {run_dir} holds a finished save not yet moved into place ({COMMIT}); reading it as it "
                  f"lies, changing nothing (the next training command on this run completes it)", file=sys.stderr)
        return journal
    if journal is not None:
        commit = run_dir / COMMIT
        for name in sorted(journal["files"]):
            if _lexists(commit / name):
                os.replace(commit / name, run_dir / name)   # a rename within run_dir: replaces a link, never follows it
        os.unlink(commit / JOURNAL)
        os.rmdir(commit)
        _fsync_dir(run_dir)
    staging = run_dir / STAGING
    if _is_plain_dir(staging):
        shutil.rmtree(staging)                 # rmtree never follows links inside
    elif _lexists(staging):
        os.unlink(staging)                     # a link or a file: remove the name only
    return None


def member(run_dir: str | Path, name: str, journal: dict | None = None) -> Path:
    """Where to read checkpoint file `name`: inside .commit while a verified journal lists it there."""
    run_dir = Path(run_dir)
    if journal is not None and name in journal["files"] and _lexists(run_dir / COMMIT / name):
        return run_dir / COMMIT / name
    return run_dir / name


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _space_error(e: OSError, run_dir: Path) -> UserError:
    why = "the disk is full" if e.errno in (errno.ENOSPC, errno.EDQUOT) else (e.strerror or str(e))
    return UserError(f"could not save the checkpoint in {run_dir}: {why}; the previous checkpoint is intact")


def save_files(run_dir: str | Path, writers: dict[str, Callable[[Path], None]]) -> None:
    """Write a set of files into run_dir as one atomic unit; writers map file name -> fn(path).

    A failing writer (a full disk, ...) leaves the previous set intact and ends in a one-line UserError."""
    run_dir = Path(run_dir)
    for name in writers:
        if not _NAME.match(name) or name == JOURNAL:
            raise ValueError(f"checkpoint file name {name!r} is not a plain file name")
    run_dir.mkdir(parents=True, exist_ok=True)
    recover(run_dir)
    staging = run_dir / STAGING
    try:
        staging.mkdir()
        sizes = {}
        for name, write in writers.items():
            path = staging / name
            write(path)
            with open(path, "rb") as f:
                os.fsync(f.fileno())
            sizes[name] = os.lstat(path).st_size
        with open(staging / JOURNAL, "w") as f:
            f.write(json.dumps({"magic": JOURNAL_MAGIC, "files": sizes}) + "\n")
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(staging)
    except OSError as e:
        shutil.rmtree(staging, ignore_errors=True)
        raise _space_error(e, run_dir) from None
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    os.replace(staging, run_dir / COMMIT)
    _fsync_dir(run_dir)
    recover(run_dir)


def json_writer(obj) -> Callable[[Path], None]:
    text = json.dumps(obj, indent=2, allow_nan=False) + "\n"   # serialise now: a bad value fails before any write
    return lambda path: path.write_text(text)


def tensors_writer(tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None, *,
                   what: str = "refusing to save", allow_nonfinite: bool = False):
    """A writer for a safetensors file; refuses (now, before anything is written) non-finite tensors
    unless allow_nonfinite (for files where NaN is a marker, such as DPO's not-yet-drawn log-probs)."""
    if not allow_nonfinite:
        check_finite(tensors, what, "; the training diverged: nothing was written, the previous checkpoint is "
                                    "intact (try a lower --lr)")
    def write(path: Path) -> None:
        from safetensors.numpy import save
        data = save({n: np.ascontiguousarray(a) for n, a in tensors.items()}, metadata)
        with open(path, "wb") as f:        # a Python write: a full disk is an OSError (ENOSPC)
            f.write(data)
    return write


def model_writers(config: Config, params: dict[str, np.ndarray], tokenizer=None) -> dict:
    writers = {"model.safetensors": tensors_writer(params, what="refusing to save the weights"),
               "config.json": json_writer(config.to_dict())}
    if tokenizer is not None:
        writers["tokenizer.json"] = json_writer(tokenizer.to_dict())
    return writers


def optimizer_writer(tensors: dict[str, np.ndarray]):
    """The AdamW moments' writer; non-finite moments are refused like non-finite weights."""
    return tensors_writer(tensors, what="refusing to save the optimizer state")


def save_model(run_dir, config: Config, params: dict[str, np.ndarray], tokenizer=None) -> None:
    save_files(run_dir, model_writers(config, params, tokenizer))


# ---- reading ------------------------------------------------------------------------------------
def read_tensors(path: Path, what: str, mapped: bool = False) -> dict[str, np.ndarray]:
    """Load a safetensors file into writable numpy arrays; any defect is a one-line UserError.
    mapped: read-only arrays over a read-only map of the file instead (`map_tensors`)."""
    from safetensors.numpy import load_file
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{what}: {path} not found")
    if mapped:
        return map_tensors(path, what)
    try:
        return {n: np.array(a) for n, a in load_file(str(path)).items()}
    except Exception as e:  # safetensors raises several types for truncated / foreign files
        raise UserError(f"{what}: {path} is corrupt or not a safetensors file ({str(e).splitlines()[0][:120]})") from None


_MAPPED_FILES = weakref.WeakKeyDictionary()   # map_tensors' maps -> their open file (file_rows reads it)


def map_tensors(path: Path, what: str) -> dict[str, np.ndarray]:
    """The tensors of a safetensors file as read-only arrays over one read-only map of it: their bytes are
    the file's, in memory only while (and once) read, and `drop_pages` lets them go again. Files are only
    ever replaced by rename (save_files), never written in place, so the map keeps the bytes it was opened on.

        params = map_tensors(Path("runs/small/model.safetensors"), "weights")   # nothing read yet
    """
    import mmap

    from .interop.safetensors_io import DTYPES, read_header
    try:
        header, start = read_header(path)
    except UserError as e:
        raise UserError(f"{what}: {e}") from None
    f = open(path, "rb")
    m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    _MAPPED_FILES[m] = f   # kept open while the map lives: file_rows reads the same file (by rename, never changed)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):   # mapped by 4 KiB pages: drop_pages of one tensor lets go of its pages
        m.madvise(mmap.MADV_NOHUGEPAGE)    # only (a 2 MiB mapping goes all at once, its neighbours' bytes too)
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] == "BF16":
            raise UserError(f"{what}: {path}: tensor {name} is bfloat16, which a checkpoint never holds")
        dt = np.dtype(DTYPES[info["dtype"]]).newbyteorder("<")
        b, _ = info["data_offsets"]
        n = int(np.prod(info["shape"], dtype=np.int64))
        out[name] = np.frombuffer(m, dt, count=n, offset=start + b).reshape(info["shape"])
    return out


class Reordered:
    """A matrix whose rows are another's in a different order, not copied: row i is base[order[i]]. A GGUF's q
    and k come so (llama.cpp's interleaved RoPE order, gguf_export.permute_qk): decoding packs them from the
    mapped file's rows instead of holding an unpermuted copy beside their kernel form (Llama-3.2-1B: 85 MiB).
    np.asarray(r) makes the copy where one is needed (the NumPy path's values, a checkpoint's writer);
    drop_pages(r) lets the base's pages go.

        r = Reordered(np.arange(6.0).reshape(3, 2), np.array([2, 0, 1])); np.asarray(r)[0] -> [4., 5.]"""
    ndim = 2

    def __init__(self, base: np.ndarray, order: np.ndarray):
        self.base, self.order = base, order
        self.shape, self.dtype = (len(order), *base.shape[1:]), base.dtype
        self.size, self.nbytes = int(np.prod(self.shape)), base.itemsize * int(np.prod(self.shape))

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        a = self.base[self.order]
        return a if dtype is None else a.astype(dtype)


def drop_pages(arrays) -> int:
    """Let this process's memory drop the pages that arrays of `map_tensors` or of a np.memmap view (other
    arrays are left alone; a Reordered's base) hold: each array's whole pages (a page it shares with a
    neighbouring tensor stays); they are read back from the file, the same bytes, when next read.
    -> bytes dropped."""
    import mmap
    dropped = 0
    for a in arrays:
        a = a.base if isinstance(a, Reordered) else a
        m = file_map(a)
        if m is None:
            continue
        start = _offset(a, m)
        lo, hi = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE, (start + a.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
        if hi > lo:
            m.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
            dropped += hi - lo
    return dropped


def release_freed_memory() -> None:
    """Hand the C heap's free pages back to the system (glibc's malloc_trim; elsewhere nothing). Reading a
    tokenizer and a model (JSON, a GGUF header's strings, the compiled kernels' loading) frees tens of MB in
    small pieces that the allocator keeps for reuse, and the large arrays made next never reuse them
    (docs/benchmarks.md)."""
    import ctypes
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return
    trim(0)


def file_rows(a: np.ndarray):
    """For a 2-D array of `map_tensors`: rows(table, ids, out), out [n, d] = a[ids] read from its file
    (os.preadv: through the page cache, not into this process's memory), so that rows looked up in an array
    whose pages `drop_pages` let go bring none of it back (the kernel maps a fault's whole folio, up to 2 MiB
    of neighbouring rows: the lookups of a batch would map most of a large table again). None for any other
    array. Any other table handed to rows (or an out not of a's dtype) is read with np.take.

        rows = file_rows(params["embed.weight"]); rows(params["embed.weight"], ids, out)"""
    m = file_map(a)
    f = _MAPPED_FILES.get(m) if m is not None else None
    if f is None or a.ndim != 2 or not a.flags.c_contiguous:
        return None
    start = _offset(a, m)
    row, fd = a.strides[0], f.fileno()

    def rows(table, ids, out) -> None:
        if table is not a or out.dtype != a.dtype or not out.flags.c_contiguous:
            np.take(table, ids, axis=0, out=out)
            return
        for i, r in enumerate(np.asarray(ids, np.int64).tolist()):
            os.preadv(fd, [out[i]], start + r * row)
    return rows


def read_out(a: np.ndarray) -> np.ndarray:
    """A copy of an array of `map_tensors` read from its file (os.preadv: through the page cache, not into this
    process's memory), any other array as it is. Reading a small tensor through the map would fault in the
    file's neighbouring pages with it (a whole folio, up to 2 MiB): an import's norms of a few KB each would
    hold tens of MB of the float32 matrices around them (docs/benchmarks.md).

        norms = {n: read_out(p) for n, p in params.items() if p.ndim == 1}"""
    m = file_map(a)
    f = _MAPPED_FILES.get(m) if m is not None else None
    if f is None or not a.flags.c_contiguous:
        return a
    out = np.empty(a.shape, a.dtype)
    view, at = memoryview(out.reshape(-1).view(np.uint8)), _offset(a, m)
    while view.nbytes:
        n = os.preadv(f.fileno(), [view], at)
        if n <= 0:
            raise UserError(f"the weights file ended while reading a tensor of {a.nbytes} bytes")
        view, at = view[n:], at + n
    return out


def _offset(a: np.ndarray, m) -> int:
    """Where a's bytes start in the map m (= in its file: maps start at offset 0)."""
    return a.__array_interface__["data"][0] - np.frombuffer(m, np.uint8, 0).__array_interface__["data"][0]


def file_map(a: np.ndarray):
    """The mmap an array of `map_tensors` (or of a np.memmap, as a GGUF file's tensors) views, else None."""
    import mmap
    while isinstance(a, np.ndarray):
        if isinstance(a, np.memmap) and isinstance(getattr(a, "_mmap", None), mmap.mmap):
            return a._mmap
        a = a.base
    return a.obj if isinstance(a, memoryview) and isinstance(a.obj, mmap.mmap) else None


def read_json(path: Path, what: str, max_bytes: int = 256 << 20):
    """Parse a JSON file; missing, too big, not UTF-8 or not JSON is a one-line UserError."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{what}: {path} not found")
    if path.stat().st_size > max_bytes:
        raise UserError(f"{what}: {path} is larger than {max_bytes >> 20} MiB")
    try:
        return json.loads(path.read_bytes().decode("utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise UserError(f"{what}: {path} is not valid JSON ({str(e)[:120]})") from None


def check_run_dir(run_dir, read_only: bool = False) -> Path:
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UserError(f"checkpoint directory {run_dir} not found")
    recover(run_dir, read_only=read_only)
    return run_dir


def load_model(run_dir, read_only: bool = False, mapped: bool = False, finite: bool = True
               ) -> tuple[Config, dict[str, np.ndarray]]:
    """(config, params) from a checkpoint directory, validated against each other and finite.
    mapped: the params are read-only views of the weights file (`map_tensors`), for a base that stays frozen;
    finite=False (with mapped): not read to be checked, for a caller that checks what it reads (decoding an
    import's blocks reads none of the float32 matrices they replace)."""
    from .config import check_params
    run_dir = check_run_dir(run_dir, read_only)
    journal = read_journal(run_dir) if read_only else None
    config = Config.from_dict(read_json(member(run_dir, "config.json", journal), "checkpoint config"))
    params = read_tensors(member(run_dir, "model.safetensors", journal), "checkpoint weights", mapped)
    try:
        check_params(config, params)
        if finite or not mapped:
            check_finite(params, "weights", "; this checkpoint cannot be used (retrain, or resume from an earlier copy)")
    except UserError as e:
        raise UserError(f"checkpoint {run_dir}: {e}") from None
    return config, params


SOURCE_FILE = "source.json"  # of a checkpoint imported from a GGUF file: where from, each tensor's type there


def read_source(run_dir) -> dict | None:
    """A checkpoint's source.json (written by `import` of a GGUF file: each tensor's type there), else None."""
    path = Path(run_dir)
    if not (path.is_dir() and (path / SOURCE_FILE).is_file()):
        return None
    src = read_json(member(path, SOURCE_FILE, read_journal(path)), "checkpoint source")
    if not (isinstance(src, dict) and isinstance(src.get("tensor_types"), dict)):
        raise UserError(f"{path / SOURCE_FILE}: no \"tensor_types\" object")
    return src


SOURCE_BLOCKS = "source.safetensors"  # beside source.json: the file's matrices in their block types (or F16) as it
                                      # held them, our names, the rows of bytes (U8) or float16 values (F16)


def source_blocks(run_dir) -> dict[str, np.ndarray] | None:
    """The matrices of an imported checkpoint as the GGUF file held them — blocks as void records [out,
    in / block] (infer/quant.py), F16 as float16 — mapped read-only; None when the checkpoint has none, or when
    its weights are no longer the ones they were imported with (source.json's `weights` records the
    model.safetensors they belong to: its size and modification time; any save replaces that file)."""
    from .infer.quant import block_types, of_gguf
    src = read_source(run_dir)
    path = Path(run_dir)
    if src is None or not (path / SOURCE_BLOCKS).is_file():
        return None
    st = (path / "model.safetensors").stat()
    if src.get("weights") != [st.st_size, st.st_mtime_ns]:
        return None
    out = {}
    for name, a in map_tensors(path / SOURCE_BLOCKS, "checkpoint source blocks").items():
        kind = str(src["tensor_types"].get(name, ""))
        t = of_gguf(kind)
        if kind == "F16" and a.dtype == np.float16:
            out[name] = a
        elif t is not None and t.name in block_types() and a.dtype == np.uint8 and a.ndim == 2 \
                and a.shape[1] % t.nbytes == 0:
            out[name] = a.view(t.dtype)
        else:
            raise UserError(f"{path / SOURCE_BLOCKS}: tensor {name!r:.60} is not what source.json says ({kind or 'no type'})")
    return out


def load_tokenizer(run_dir, read_only: bool = False):
    from .tokenizer import Tokenizer
    run_dir = check_run_dir(run_dir, read_only)
    journal = read_journal(run_dir) if read_only else None
    return Tokenizer.from_dict(read_json(member(run_dir, "tokenizer.json", journal), "checkpoint tokenizer"))


def check_vocab(config: Config, tok) -> None:
    """Refuse a model and tokenizer whose vocabularies differ (before any text is made: a model id the
    tokenizer lacks would fail mid-reply, a tokenizer id the model lacks at the first prompt)."""
    if tok.vocab_size != config.vocab_size:
        raise UserError(f"the tokenizer has {tok.vocab_size} tokens but the model {config.vocab_size}: "
                        "they do not belong together")


# ---- trainer.json --------------------------------------------------------------------------------
def check_trainer_state(state, path: str | Path = "trainer.json") -> dict:
    """Type- and range-check the fields of a trainer.json every loop reads; returns it unchanged.

        check_trainer_state({"kind": "pretrain", "step": 10, "train_config": {...}, "rng": {...}, ...})
    """
    def bad(why: str):
        raise UserError(f"resume state {path}: {why}")

    if not isinstance(state, dict):
        bad("expected a JSON object")
    ints = {"step": (0, 1 << 40), "tokens_seen": (0, 1 << 62), "skipped_batches": (0, 1 << 40)}
    for key, (lo, hi) in ints.items():
        if key in state and (type(state[key]) is not int or not lo <= state[key] <= hi):
            bad(f"{key} must be an integer in [{lo}, {hi}], got {state[key]!r}"[:200])
    if "step" not in state:
        bad("missing field step")
    if "elapsed_s" in state and (type(state["elapsed_s"]) not in (int, float) or not 0 <= state["elapsed_s"] < 1e12):
        bad(f"elapsed_s must be a non-negative number, got {state['elapsed_s']!r}"[:200])
    for key in ("kind",):
        if key in state and not isinstance(state[key], str):
            bad(f"{key} must be a string")
    state.pop("phase", None)   # written while pretraining ended by distilling draft heads; what is left is the steps
    if state.get("precision") == "fp32":   # written before the spelling became SPEC's f32: the same precision
        state["precision"] = "f32"
    if state.get("precision", "f32") not in PRECISIONS:
        bad(f"precision must be one of {', '.join(PRECISIONS)}, got {state['precision']!r}"[:200])
    for key in ("train_config", "data", "optimizer", "rng", "last_eval"):
        if key in state and not isinstance(state[key], dict):
            bad(f"{key} must be a JSON object")
    if isinstance(state.get("rng"), dict):
        rng = state["rng"]
        if rng.get("bit_generator") != "PCG64" or not isinstance(rng.get("state"), dict) \
                or not all(type(rng["state"].get(k)) is int and rng["state"].get(k) >= 0 for k in ("state", "inc")) \
                or type(rng.get("has_uint32")) is not int or type(rng.get("uinteger")) is not int:
            bad("rng is not a PCG64 generator state")
    if isinstance(state.get("optimizer"), dict):
        t = state["optimizer"].get("t", 0)
        if type(t) is not int or t < 0:
            bad(f"optimizer.t must be a non-negative integer, got {t!r}"[:200])
    return state


# ---- the run lock --------------------------------------------------------------------------------
@contextlib.contextmanager
def run_lock(directory: str | Path, what: str = "run"):
    """Hold an exclusive lock on `directory` (created if needed) for the length of the `with` block.

    The lock is `fcntl.flock` on DIR/.lock, released by the kernel if the process dies; the file holds
    the holder's pid and command line so that a second process can say who has it, and is removed on
    release (a process that opened it just before checks it still is the file at DIR/.lock):

        with run_lock("runs/mine"):      # a second `nanoeuler train --out runs/mine` now fails with
            ...                          # "runs/mine is in use by another process (pid 123: nanoeuler train ...)"
    """
    directory = Path(directory)
    if _lexists(directory) and not directory.is_dir():
        raise UserError(f"{directory} exists and is not a directory")
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / LOCK
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise UserError(f"cannot lock {directory}: {path}: {e.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise UserError(f"{directory} is in use by another process ({holder}); wait for it to finish or "
                            f"choose another {'--out' if what == 'run' else 'directory'}") from None
        try:                                   # the holder before us may have removed the file meanwhile
            same = os.fstat(fd).st_ino == os.lstat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    try:
        info = {"pid": os.getpid(), "command": " ".join(["nanoeuler", *sys.argv[1:]]) if sys.argv else "?",
                "what": what, "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
        try:
            yield path
        finally:
            try:
                os.unlink(path)                # leave no trace; a waiter re-checks the inode (above)
            except OSError:
                pass
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _read_holder(fd: int) -> str:
    """'pid 123: nanoeuler train ...' from a held lock file (best effort; it may be being rewritten)."""
    for _ in range(20):
        try:
            info = json.loads(os.pread(fd, 4096, 0).decode("utf-8", "replace"))
            return f"pid {int(info['pid'])}: {str(info.get('command', '?'))[:200]}"
        except (ValueError, KeyError, TypeError, OSError):
            time.sleep(0.01)
    return "pid unknown"
