"""Safe file writes: atomic writes, and the rules every command's output follows.

Atomic: write to a temporary name in the same directory, fsync, then rename. A crash, a full disk or
Ctrl-C in the middle of a write leaves the previous file intact, because `os.replace` of a file on the
same filesystem is atomic: readers see the old file or the new one.

The rules of an output (`check_output`, called by every command that writes, before it writes):
a link is never followed out of the directory the user named (the output itself may not be a link, and
files inside a run directory are opened without following links: `open_append`, `own_file`); a file the
user did not name as the output is never replaced; an existing output needs --force; an output that is,
contains or is inside an input, or the base checkpoint an input adapter run reads, is refused (links
resolved).

    check_output("tok.json", force=False, inputs=["books.txt"])   # UserError if tok.json exists
    check_output("runs/x", force=True, inputs=["runs/x"])         # UserError: --out runs/x is the input
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
from pathlib import Path

from .errors import UserError

LORA_FILE = "lora.json"   # an adapter run's config (adapters.py); its base.path names the checkpoint it reads


def check_output(path: str | Path, force: bool = False, inputs=(), kind: str | None = None,
                 flag: str = "--out") -> Path:
    """Path(path) after checking the rules above: it names something (not '/', '.' or '..'), is not a
    symbolic link, does not exist unless force (and then is a `kind`: "file" or "dir", if given), and
    neither is, contains nor is inside any of `inputs` (paths of what the command reads)."""
    path = Path(path)
    if not str(path) or path.name in ("", ".", ".."):
        raise UserError(f"{flag} {str(path)!r} does not name a {'file' if kind == 'file' else 'folder'} to write")
    if path.is_symlink():
        raise UserError(f"{flag} {path} is a symbolic link; name the real path (a link is never followed)")
    if path.exists():
        if not force:
            raise UserError(f"{flag} {path} already exists (use --force to replace it)")
        if kind == "dir" and not path.is_dir():
            raise UserError(f"{flag} {path} exists and is not a directory")
        if kind == "file" and path.is_dir():
            raise UserError(f"{flag} {path} is a directory; give a file name")
    check_apart(path, inputs, flag)
    return path


def check_apart(path: str | Path, inputs=(), flag: str = "--out") -> None:
    """Refuse (UserError) an output path that is, contains or is inside one of `inputs`, or the base an input
    adapter run reads (links resolved).

        check_apart("runs/a/export", ["runs/a"])    # UserError: --out runs/a/export is inside the input runs/a
        check_apart("runs/small", ["runs/lora"])    # UserError: --out runs/small is the base of the input runs/lora
    """
    out = Path(os.path.realpath(path))
    for item in inputs:
        if item is None:
            continue
        for src, what in ((item, f"the input {item}"), (adapter_base(item), f"the base of the input {item}")):
            if src is None:
                continue
            src = Path(os.path.realpath(src))
            if out == src:
                raise UserError(f"{flag} {path} is {what}; write somewhere else")
            if src in out.parents:
                raise UserError(f"{flag} {path} is inside {what}; write somewhere else")
            if out in src.parents:
                raise UserError(f"{flag} {path} contains {what}; write somewhere else")


def adapter_base(path: str | Path) -> str | None:
    """The base checkpoint an adapter run reads (its lora.json's base.path), or None when path is not one
    (or its lora.json cannot be read: loading it refuses that later)."""
    try:
        with open(Path(path) / LORA_FILE, "rb") as f:
            base = json.loads(f.read(1 << 20))["base"]["path"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return base if isinstance(base, str) and base else None


def check_real_dir(path: str | Path, flag: str = "--out") -> Path:
    """A directory the command writes into (it may exist): named (not ''), not a symbolic link, not a file."""
    if not str(path):
        raise UserError(f"{flag} is empty; name a directory")
    path = Path(path)
    if path.is_symlink():
        raise UserError(f"{flag} {path} is a symbolic link; name the real directory (a link is never followed)")
    if path.exists() and not path.is_dir():
        raise UserError(f"{flag} {path} exists and is not a directory")
    return path


def check_output_files(directory: str | Path, names, force: bool = False, inputs=()) -> Path:
    """A directory (new or existing, not a link) the command writes the files `names` into: each is an
    output (check_output), so an existing one needs force. -> Path(directory)"""
    directory = check_real_dir(directory)
    check_apart(directory, inputs)
    for name in names:
        check_output(directory / name, force, kind="file", flag="output")
    return directory


def own_file(path: str | Path) -> Path:
    """A file of a directory the command owns (a run's log.jsonl ...): refused if it is a link (or not a file)."""
    path = Path(path)
    if path.is_symlink() or (path.exists() and not path.is_file()):
        raise UserError(f"{path} is a link or not a regular file; a run directory's own files must be plain files "
                        f"(move it away)")
    return path


def open_append(path: str | Path):
    """Open own_file(path) for appending text, never through a link (O_NOFOLLOW): the file object."""
    path = own_file(path)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:
            own_file(path)             # it became a link in between: the same one-line refusal
        raise
    return os.fdopen(fd, "a", encoding="utf-8")


@contextlib.contextmanager
def atomic_path(path: str | Path):
    """Yield a temporary path beside `path`; on success it is renamed onto `path`, on failure removed.

        with atomic_path("run/model.safetensors") as tmp:
            save_file(tensors, tmp)
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    with atomic_path(path) as tmp:
        Path(tmp).write_bytes(data)


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | Path, obj) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2) + "\n")
