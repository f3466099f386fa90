"""Shared argparse validators: every bad flag value is one line `error: ...` and exit 2, before any work.

Use them as `type=` (argparse then reports `error: argument --lr: must be a finite number > 0, got 'inf'`):

    p.add_argument("--steps", type=positive_int)                   # 1, 2, ...      ("0" is refused)
    p.add_argument("--seed", type=nonneg_int)                      # 0, 1, ...
    p.add_argument("--lr", type=finite_float(lo=0, lo_open=True))  # 0 < x < inf   ("nan", "inf" refused)
    p.add_argument("--top-p", type=finite_float(0, 1, lo_open=True))
    p.add_argument("--tokenizer", type=existing_path)              # a file or directory that exists
    p.add_argument("--out", type=output_file)                      # a file path that is not a directory
    p.add_argument("--out", type=output_dir)                       # a directory path that is not a file

A `0` never silently means "the default": a flag whose default is computed uses `default=None`, and 0
is either a meaning the help states (`--dropout 0`) or refused.
"""
from __future__ import annotations

import argparse
import math
from pathlib import Path

MAX_INT = 1 << 62


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line: `error: --lr: must be ... (see nanoeuler train --help)`."""

    def error(self, message: str):
        if message.startswith("argument "):
            message = message[len("argument "):]          # "--lr: must be a finite number ..."
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def _int(text: str) -> int:
    try:
        value = int(str(text).strip().replace("_", ""), 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if abs(value) > MAX_INT:
        raise argparse.ArgumentTypeError(f"{text!r} is out of range")
    return value


def positive_int(text: str) -> int:
    """'3' -> 3; '0', '-1', 'abc', '1.5' -> an argparse error."""
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


def nonneg_int(text: str) -> int:
    """'0' -> 0; '-1' -> an argparse error."""
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}")
    return value


def int_range(lo: int, hi: int):
    """A type for integers in [lo, hi]: int_range(1, 65536)('70000') -> an argparse error."""
    def parse(text: str) -> int:
        value = _int(text)
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"must be an integer in [{lo}, {hi}], got {text!r}")
        return value
    parse.__name__ = f"integer in [{lo}, {hi}]"
    return parse


def finite_float(lo: float | None = None, hi: float | None = None, lo_open: bool = False, hi_open: bool = False):
    """A type for finite floats in a range: finite_float(0, 1, lo_open=True) accepts (0, 1]."""
    lo_s = "-inf" if lo is None else f"{lo:g}"
    hi_s = "inf" if hi is None else f"{hi:g}"
    where = f"{'(' if lo_open or lo is None else '['}{lo_s}, {hi_s}{')' if hi_open or hi is None else ']'}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(value) or (lo is not None and (value < lo or lo_open and value == lo)) \
                or (hi is not None and (value > hi or hi_open and value == hi)):
            raise argparse.ArgumentTypeError(f"must be a finite number in {where}, got {text!r}")
        return value
    parse.__name__ = f"number in {where}"
    return parse


def check_float(name: str, value, lo: float | None = None, hi: float | None = None, lo_open: bool = False) -> float:
    """The same rule for values that do not come from argparse (a REPL command, a JSON field):
    check_float("/temp", "nan", 0) -> UserError('/temp: must be a finite number in [0, inf), got 'nan'')."""
    from ..errors import UserError
    try:
        return finite_float(lo, hi, lo_open)(value)
    except argparse.ArgumentTypeError as e:
        raise UserError(f"{name}: {e}") from None


def existing_path(text: str) -> str:
    """A path that exists (file or directory)."""
    if not Path(text).exists():
        raise argparse.ArgumentTypeError(f"{text} not found")
    return text


def output_file(text: str) -> str:
    """A path to write a file to: not an existing directory, and its parent (if it exists) a directory."""
    p = Path(text)
    if not text:
        raise argparse.ArgumentTypeError("empty path")
    if p.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory; give a file name")
    _check_parents(p)
    return text


def output_dir(text: str) -> str:
    """A directory to write into: not an existing file, no file in the way on its path."""
    p = Path(text)
    if not text:
        raise argparse.ArgumentTypeError("empty path")
    if p.exists() and not p.is_dir():
        raise argparse.ArgumentTypeError(f"{text} exists and is a file, not a directory")
    _check_parents(p)
    return text


def _check_parents(p: Path) -> None:
    """The nearest existing folder above p must be a folder, not a file in the way."""
    for parent in p.parents:
        if parent.exists():
            if not parent.is_dir():
                raise argparse.ArgumentTypeError(f"{parent} is a file, not a directory")
            return


def add_template_arg(p) -> None:
    """--chat-template FILE (chat, serve, sft, dpo): a Jinja chat template instead of the checkpoint's."""
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a Jinja chat template file (transformers' format, UTF-8) to use instead of the "
                        "checkpoint's own, or the name of a bundled one: gemma (Gemma's <start_of_turn> turns, for "
                        "a Gemma base model) (default: the checkpoint's, else the SPEC Alpaca template)")


def add_template_var_arg(p) -> None:
    """--template-var KEY=VALUE (chat), repeatable: an extra variable of the chat template."""
    p.add_argument("--template-var", type=template_var, action="append", default=[], metavar="KEY=VALUE",
                   help="a variable for the chat template, as transformers' apply_chat_template(**kwargs) passes it "
                        "(e.g. enable_thinking=false, tools=[...]); VALUE is read as JSON, else taken as a string; "
                        "repeatable")


def template_var(text: str) -> tuple[str, object]:
    """'enable_thinking=false' -> ('enable_thinking', False); 'name=Ada' -> ('name', 'Ada') (not JSON: a string)."""
    import json

    from ..chat_template import RESERVED
    key, eq, value = text.partition("=")
    if not eq or not key.isidentifier():
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE with KEY a name (enable_thinking=false)")
    if key in RESERVED:
        raise argparse.ArgumentTypeError(f"{key!r} is the conversation's own; it cannot be set")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def escape_control(text: str) -> str:
    """Make model output safe for a terminal: control characters (ESC, BEL, NUL, DEL, C1, ...) become
    visible escapes; newline and tab stay. escape_control("a\\x1b[2Jb\\n") -> 'a\\\\x1b[2Jb\\n'."""
    out = []
    for ch in text:
        o = ord(ch)
        if ch in "\n\t" or (o >= 0x20 and o != 0x7F and not 0x80 <= o < 0xA0):
            if 0xD800 <= o < 0xE000:     # a lone surrogate cannot be printed
                out.append(f"\\u{o:04x}")
            else:
                out.append(ch)
        elif ch == "\r":
            out.append("\\r")
        else:
            out.append(f"\\x{o:02x}" if o < 0x100 else f"\\u{o:04x}")
    return "".join(out)
