"""`nanoeuler <command>`: one program, one module per command group in this package.

Each command module defines `register(subparsers)`, which adds its parser and sets `run=<function>`;
the function takes the parsed `argparse.Namespace` and returns an exit code (or None for 0).
Heavy imports (numpy, numba, ...) happen inside the run functions so that `--help` is instant.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

from ..errors import UserError, say

COMMAND_MODULES = ["check", "info", "tokenizer", "prepare", "train", "sample", "sft", "dpo", "chat", "data",
                   "bench", "demo", "interop", "serve", "lora"]


def build_parser() -> argparse.ArgumentParser:
    from .args import OneLineParser
    parser = OneLineParser(
        prog="nanoeuler",
        description="A GPT-2-class language model and its whole training pipeline, in NumPy with hand-written "
                    "backward passes: tokenizer -> prepare -> train -> sft -> dpo -> chat.",
    )
    sub = parser.add_subparsers(dest="command", metavar="<command>")
    for name in COMMAND_MODULES:
        importlib.import_module(f".{name}", __name__).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    if any("\x00" in str(a) for a in argv):     # no path or value holds one (a caller's, not a shell's, mistake)
        say("error: an argument holds a NUL character")
        return 2
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:         # --help, or a bad flag (one line, see args.OneLineParser): its exit code
        return e.code if isinstance(e.code, int) else 2
    except OSError as e:            # a path a flag's check could not even look at (a name too long, ...)
        say(f"error: {e.strerror or e}{f' ({e.filename})' if getattr(e, 'filename', None) else ''}")
        return 2
    if not getattr(args, "run", None):
        parser.print_help()
        return 2
    try:
        code = args.run(args)
    except UserError as e:
        say(f"error: {e}")
        return e.exit_code
    except KeyboardInterrupt:
        say("\ninterrupted")
        return 130
    except BrokenPipeError:
        return 0
    except MemoryError:
        say("error: out of memory (use a smaller batch, context or model)")
        return 3
    except OSError as e:            # a full disk, a permission, a vanished file: one line, never a traceback
        if os.environ.get("NANOEULER_TRACEBACK"):
            raise
        where = f" ({e.filename})" if getattr(e, "filename", None) else ""
        say(f"error: {e.strerror or e}{where}")
        return 3
    except Exception as e:          # a bug: still one line; NANOEULER_TRACEBACK=1 shows where it happened
        if os.environ.get("NANOEULER_TRACEBACK"):
            raise
        say(f"error: internal error {type(e).__name__}: {str(e)[:300]} (a bug: please report it; "
            f"NANOEULER_TRACEBACK=1 shows the traceback)")
        return 1
    return int(code or 0)


if __name__ == "__main__":
    sys.exit(main())
