"""Named fault points for tests: ``SHARDCTL_FAULT=<point>[:<n>]:<action>``.

Writers call :func:`point` at named steps; with no ``SHARDCTL_FAULT`` set it costs one dict
lookup. The *n*-th time (default 1) the configured point is reached, the action runs:

- ``raise:EIO`` / ``raise:ENOSPC`` / ``raise:<ERRNO>``: raise ``OSError(errno, ...)``
- ``kill``: ``SIGKILL`` ourselves (a crash: no cleanup, no ``finally``)
- ``sleep:S``: sleep S seconds (lets a test start a second run, or send a signal)
- ``hook``: call the in-process hooks registered with :func:`add_hook`, then run the shell
  command in ``SHARDCTL_FAULT_HOOK`` if set (for subprocess tests, e.g. truncate the input)

Several specs may be given, comma-separated. ``SHARDCTL_FAULT_LOG=<path>`` appends each reached
configured point (``point:n``) to that file *before* acting, so a test can assert its point was
reached even after ``kill``. ``SHARDCTL_FAULT_RANK=<r>`` arms the specs only in the process
whose ``RANK`` (torchrun's global rank) is ``r``, so a scale-out test can kill one worker.
Points (reshard): ``staging_created``, ``shard_started``, ``shard_written``, ``shard_fsynced``,
``index_written``, ``record_written``, ``before_rename``, ``after_rename``. Example::

    SHARDCTL_FAULT=shard_written:2:kill shardctl reshard SRC DST --tp 2
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from shardctl.errors import InvalidInputError

POINTS: tuple[str, ...] = (
    "staging_created",
    "shard_started",
    "shard_written",
    "shard_fsynced",
    "index_written",
    "record_written",
    "before_rename",
    "after_rename",
)


@dataclass(frozen=True)
class FaultSpec:
    point: str
    nth: int
    action: str  # "raise", "kill", "sleep", "hook"
    arg: str = ""


class FaultSpecError(InvalidInputError, ValueError):
    """A malformed ``SHARDCTL_FAULT``: input the tool cannot accept (exit 3), not a bug."""


def parse(text: str) -> list[FaultSpec]:
    """``"shard_written:2:raise:EIO,before_rename:kill"`` -> specs (FaultSpecError, a ValueError
    and an exit-3 InvalidInputError, if malformed)."""
    specs: list[FaultSpec] = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        parts = item.split(":")
        point = parts.pop(0)
        if point not in POINTS:
            raise FaultSpecError(
                f"SHARDCTL_FAULT: unknown point {point!r}; known: {', '.join(POINTS)}"
            )
        nth = 1
        if parts and parts[0].isascii() and parts[0].isdigit():
            nth = int(parts.pop(0))
        if not parts or parts[0] not in ("raise", "kill", "sleep", "hook"):
            raise FaultSpecError(f"SHARDCTL_FAULT: bad action in {item!r}")
        action = parts.pop(0)
        arg = ":".join(parts)
        if action == "raise" and arg not in errno.errorcode.values():
            raise FaultSpecError(f"SHARDCTL_FAULT: unknown errno {arg!r} in {item!r}")
        if action == "sleep":
            try:
                seconds = float(arg)
            except ValueError:
                seconds = -1.0
            if not 0 <= seconds <= 3600:
                raise FaultSpecError(f"SHARDCTL_FAULT: sleep needs 0..3600 seconds in {item!r}")
        specs.append(FaultSpec(point, nth, action, arg))
    return specs


_lock = threading.Lock()
_counts: dict[str, int] = {}
_hooks: list[Callable[[str, int], None]] = []
_cache: tuple[str, list[FaultSpec]] = ("", [])
reached: list[str] = []  # "point:n" of configured points reached in this process


def add_hook(fn: Callable[[str, int], None]) -> None:
    """Register an in-process callable for the ``hook`` action (tests)."""
    _hooks.append(fn)


def reset() -> None:
    """Forget counts, hooks and reached points (tests)."""
    with _lock:
        _counts.clear()
        _hooks.clear()
        reached.clear()


def _specs() -> list[FaultSpec]:
    global _cache
    text = os.environ.get("SHARDCTL_FAULT", "")
    only = os.environ.get("SHARDCTL_FAULT_RANK")
    if only is not None and only.strip() != os.environ.get("RANK", "0").strip():
        text = ""  # armed on another worker only
    if text != _cache[0]:
        _cache = (text, parse(text))
    return _cache[1]


def point(name: str) -> None:
    """Mark that the writer reached ``name``; run the configured action if this is the n-th time."""
    assert name in POINTS, name
    specs = _specs()
    if not specs:
        return
    with _lock:
        n = _counts[name] = _counts.get(name, 0) + 1
    for spec in specs:
        if spec.point == name and spec.nth == n:
            _fire(spec, n)


def _fire(spec: FaultSpec, n: int) -> None:
    tag = f"{spec.point}:{n}"
    reached.append(tag)
    log = os.environ.get("SHARDCTL_FAULT_LOG")
    if log:
        with open(log, "a", encoding="utf-8") as f:
            f.write(tag + "\n")
    if spec.action == "raise":
        code = getattr(errno, spec.arg)
        raise OSError(code, f"{os.strerror(code)} (injected at {tag})")
    if spec.action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if spec.action == "sleep":
        time.sleep(float(spec.arg))
    if spec.action == "hook":
        for fn in list(_hooks):
            fn(spec.point, n)
        cmd = os.environ.get("SHARDCTL_FAULT_HOOK")
        if cmd:
            subprocess.run(["/bin/sh", "-c", cmd], check=False)
