"""The one exception type a user sees: a clear, one-line message instead of a traceback.

Library code raises `UserError("what went wrong, and what to do")` for bad input (a corrupt checkpoint,
a config whose dims do not divide, an empty corpus, ...); `nanoeuler.cli.main` prints it as
`error: <message>` and exits with `exit_code` (2 unless the raiser says otherwise).
"""
import sys


class UserError(Exception):
    """Bad input or an impossible request, explained in one line."""

    def __init__(self, message: str, exit_code: int = 2):
        super().__init__(message)
        self.exit_code = exit_code


def say(line: str) -> None:
    """One line on stderr in one write: processes sharing a terminal (MPI ranks) never mix their lines."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
