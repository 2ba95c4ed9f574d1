"""The one place that turns exceptions into one stderr line and an exit code.

``run_cli(fn)`` is what the console script calls. Library code raises
:class:`shardctl.errors.ShardctlError`; OS errors that escape the library are mapped by errno;
anything else is a bug (exit 70). ``SHARDCTL_DEBUG=1`` adds the traceback.
"""

from __future__ import annotations

import os
import signal
import sys
import traceback
from collections.abc import Callable
from types import FrameType
from typing import Any

import typer

from shardctl.errors import (
    EXIT_ENVIRONMENT,
    EXIT_INTERNAL,
    EXIT_INVALID_INPUT,
    EXIT_SIGINT,
    EXIT_SIGTERM,
    EXIT_USAGE,
    Interrupted,
    ShardctlError,
    os_error_text,
)


def debug_enabled() -> bool:
    return os.environ.get("SHARDCTL_DEBUG", "") not in ("", "0")


def _say(line: str) -> None:
    sys.stderr.write(f"shardctl: error: {line}\n")
    sys.stderr.flush()


def _raise_interrupted(signum: int, _frame: FrameType | None) -> None:
    # Raised at the next bytecode boundary; `finally` blocks below (staging cleanup, lock
    # release) run before the CLI maps it to 130/143.
    raise Interrupted(signum)


def exit_code_for(exc: BaseException) -> tuple[int, str]:
    """Map an exception to (exit code, one-line message)."""
    if isinstance(exc, ShardctlError):
        return exc.exit_code, exc.render()
    if isinstance(exc, KeyboardInterrupt):
        return EXIT_SIGINT, "interrupted"
    if isinstance(exc, OSError):
        where = f"{exc.filename}: " if exc.filename else ""
        what = os_error_text(exc)
        detail = f" ({exc.strerror})" if exc.strerror and exc.strerror != what else ""
        return EXIT_ENVIRONMENT, f"{where}{what}{detail}"
    if isinstance(exc, MemoryError):
        return (
            EXIT_INVALID_INPUT,
            "out of memory while reading the input; is it hostile or corrupt?",
        )
    return (
        EXIT_INTERNAL,
        f"internal error: {type(exc).__name__}: {exc}; this is a bug in shardctl — "
        "rerun with SHARDCTL_DEBUG=1 for the traceback and report it",
    )


def usage_line(exc: typer.TyperException) -> tuple[int, str]:
    """typer's usage exception (raised with ``standalone_mode=False``) as one line.

    typer would print a multi-line box; the README promises one line on stderr, e.g.
    ``reshard: No such option: --tpp (Possible options: --ep, --pp, --tp); see 'shardctl
    reshard --help'``. Only typer's public surface: ``TyperException`` and its attributes."""
    if isinstance(exc, typer.Abort):
        return EXIT_SIGINT, "aborted"
    code = getattr(exc, "exit_code", EXIT_USAGE)
    code = code if isinstance(code, int) else EXIT_USAGE
    try:
        message = exc.format_message()
    except Exception:
        message = str(exc)
    ctx = getattr(exc, "ctx", None)
    path = getattr(ctx, "command_path", None) or "shardctl"
    where = path.split(" ", 1)[1] + ": " if " " in path else ""
    text = " ".join(f"{where}{message}".split()).rstrip(".")
    return code, f"{text}; see '{path} --help'" if message else ""


def safe_streams() -> None:
    """Never crash on output encoding (``PYTHONIOENCODING=ascii`` and a non-ASCII name):
    unencodable characters are replaced instead (``?``)."""
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            try:
                reconfigure(errors="replace")
            except (ValueError, OSError):
                pass


_freezing: list[bool] = []


def _freeze_at_exit() -> None:
    """At interpreter exit, before its last cyclic collection, move every object still alive
    out of the collector's sight (``gc.freeze``): shutdown then does not walk a 90k-tensor
    inventory once more (~0.1 s of CPU on ``plan``); reference counting still frees them.
    ``atexit`` runs before that collection, and only when the process really ends."""
    if not _freezing:
        import atexit
        import gc

        atexit.register(gc.freeze)
        _freezing.append(True)


def run_cli(fn: Callable[[], object]) -> None:
    """Run ``fn`` (the typer app, called with ``standalone_mode=False``) and exit with the
    documented code; never a bare traceback, never a multi-line usage box."""
    safe_streams()
    _freeze_at_exit()
    signal.signal(signal.SIGINT, _raise_interrupted)
    signal.signal(signal.SIGTERM, _raise_interrupted)
    try:
        rc = fn()
    except SystemExit:
        raise
    except typer.TyperException as exc:  # usage errors: bad option, missing argument, ...
        code, line = usage_line(exc)
        if line:
            _say(line)
        sys.exit(code)
    except BaseException as exc:
        code, line = exit_code_for(exc)
        if debug_enabled():
            traceback.print_exc()
        _say(line)
        sys.exit(code)
    sys.exit(rc if isinstance(rc, int) and not isinstance(rc, bool) else 0)


__all__ = [
    "EXIT_SIGINT",
    "EXIT_SIGTERM",
    "exit_code_for",
    "reader_gone",
    "run_cli",
    "safe_streams",
    "usage_line",
]


def reader_gone(stream: Any = None) -> None:
    """The reader of ``stream`` (stdout) left (``shardctl plan M | head``): send the rest of the
    output to /dev/null and keep the command's own exit code. Exiting 1 on the broken pipe, as
    rich does by default, is ``plan``'s "does not fit" and ``verify``'s "not equivalent" to a CI
    gate reading ``PIPESTATUS``."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, (stream or sys.stdout).fileno())
    os.close(devnull)


def console_for_output(*, stderr: bool = False) -> Any:
    """A rich console that wraps at the terminal's width, and never off a terminal: CI logs
    get whole lines (``mesh PP1×…``, not ``mesh \\nPP1×…``). Every renderer prints through one."""
    from rich.console import Console

    class _Console(Console):
        def on_broken_pipe(self) -> None:
            """rich's default exits 1: see :func:`reader_gone`."""
            self.quiet = True
            reader_gone(sys.stderr if self.stderr else sys.stdout)

    console = _Console(stderr=stderr)
    if console.is_terminal:
        return console
    return _Console(stderr=stderr, width=10_000, soft_wrap=True)
