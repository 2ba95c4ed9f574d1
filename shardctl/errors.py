"""One exception family, one exit-code table.

Library code raises a subclass of :class:`ShardctlError`; the CLI renders it as one line on
stderr and exits with its ``exit_code``. Nothing below the CLI prints.

Exit codes (every command; README "Exit codes"):

====  =====================================================================================
0     ok
1     negative result (plan: a rank does not fit; verify: not equivalent) — not an exception
2     usage (bad option or argument)
3     invalid or unsafe input, refused before anything is written
4     output conflict (exists, overlaps the input, locked by another run)
5     environment or I/O failure (disk full, read-only, permission, input changed, backend
      unavailable, could not verify)
70    internal error (a bug; ``SHARDCTL_DEBUG=1`` shows the traceback)
130   interrupted (SIGINT) · 143 terminated (SIGTERM)
====  =====================================================================================
"""

from __future__ import annotations

import errno

EXIT_OK = 0
EXIT_NEGATIVE = 1
EXIT_USAGE = 2
EXIT_INVALID_INPUT = 3
EXIT_OUTPUT_CONFLICT = 4
EXIT_ENVIRONMENT = 5
EXIT_INTERNAL = 70
EXIT_SIGINT = 130
EXIT_SIGTERM = 143


# errno -> what the user reads; every one of these is exit 5 (environment / I/O). The one table
# for both the library (``reshard.safety.os_failure``) and the CLI's last-resort mapping.
OS_ERROR_TEXT: dict[int, str] = {
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.EIO: "I/O error",
    errno.EFBIG: "file too large for this file system or the process's file-size limit",
    errno.EMFILE: "too many open files",
}


def os_error_text(exc: OSError) -> str:
    """``exc`` in the user's words: the table's phrase, else the OS's own ``strerror``."""
    return OS_ERROR_TEXT.get(exc.errno or 0, exc.strerror or str(exc))


class ShardctlError(Exception):
    """Base of every user-facing error.

    The message is one line: what, where, expected vs actual, what to do next.
    ``where`` (a file, a key path, an fqn) is prefixed when given.
    """

    exit_code = EXIT_INTERNAL

    def __init__(self, message: str, *, where: str | None = None, hint: str | None = None):
        self.message = message
        self.where = where
        self.hint = hint
        super().__init__(self.render())

    def render(self) -> str:
        text = f"{self.where}: {self.message}" if self.where else self.message
        if self.hint:
            text = f"{text}; {self.hint}"
        return " ".join(text.split("\n"))


class UsageError(ShardctlError):
    """Bad option or argument combination (exit 2)."""

    exit_code = EXIT_USAGE


class InvalidInputError(ShardctlError):
    """Invalid or unsafe input: manifest, config, checkpoint, index (exit 3)."""

    exit_code = EXIT_INVALID_INPUT


class ManifestError(InvalidInputError):
    """A manifest key is missing, mistyped or inconsistent (exit 3)."""


class LayoutError(InvalidInputError):
    """The requested layout cannot be built: divisibility, unmatched tensor (exit 3)."""


class OutputConflictError(ShardctlError):
    """Output exists, overlaps the input, or is locked by another run (exit 4)."""

    exit_code = EXIT_OUTPUT_CONFLICT


class EnvironmentFailure(ShardctlError):
    """Disk full, read-only, permission, input changed mid-run, backend unavailable (exit 5)."""

    exit_code = EXIT_ENVIRONMENT


class Interrupted(ShardctlError):
    """SIGINT (130) or SIGTERM (143) arrived; cleanup has run."""

    def __init__(self, signum: int):
        self.signum = signum
        self.exit_code = EXIT_SIGTERM if signum == 15 else EXIT_SIGINT
        name = "SIGTERM" if signum == 15 else "SIGINT"
        super().__init__(f"interrupted by {name}; partial output removed")
