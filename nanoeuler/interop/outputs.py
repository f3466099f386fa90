"""Output paths for export / import: refuse an existing path unless --force, and never leave half a result.

A folder is built under a temporary sibling name and renamed into place at the end (with --force, the old
folder is first renamed aside and removed only after the new one is in place):

    with output_dir("exported", force=False) as tmp:     # tmp = exported.tmp-<pid>/
        write_files(tmp)                                  # an exception here: tmp removed, nothing else touched
"""
from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

from ..errors import UserError


def check_free(path: str | Path, force: bool, inputs=()) -> Path:
    """path, after the rules of every output (fileio.check_output: no link, an existing one only with
    force, apart from the inputs and the base an input adapter run reads); its missing parent folders are
    made (`--out runs/smol` with no runs/ yet), as training's run directories are."""
    from ..fileio import check_output
    path = check_output(path, force, inputs)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise UserError(f"cannot make the folder {path.parent}: a file is in the way") from None
    except PermissionError:
        raise UserError(f"cannot make the folder {path.parent}: permission denied") from None
    return path


@contextlib.contextmanager
def output_dir(path: str | Path, force: bool = False, inputs=()):
    """Yield a fresh temporary folder beside path; on success it becomes path (atomically replaced).
    inputs: what the command reads, which path must stay apart from (check_free)."""
    path = check_free(path, force, inputs)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        for f in tmp.iterdir():
            if f.is_file():
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
        if path.exists() or path.is_symlink():
            if path.is_dir() and not path.is_symlink():
                old = path.with_name(f".{path.name}.old-{os.getpid()}")
                os.replace(path, old)
                os.replace(tmp, path)
                shutil.rmtree(old, ignore_errors=True)
            else:
                path.unlink()
                os.replace(tmp, path)
        else:
            os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
