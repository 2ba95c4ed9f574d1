"""One writer per output: an ``flock`` on a sibling lock file ``.<name>.shardctl.lock``.

The kernel drops an ``flock`` when its holder dies (even by ``kill -9``), so a stale lock never
blocks the next run (reliability case F2). A second run fails at once with exit 4
``output locked by pid N`` (F1). The lock file is removed on release; a racing opener that
locked an already-unlinked inode notices (its fd's inode differs from the path's) and retries.
"""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path
from types import TracebackType

from shardctl.errors import EnvironmentFailure, OutputConflictError


def lock_path(dst: Path) -> Path:
    return dst.parent / f".{dst.name}.shardctl.lock"


class OutputLock:
    """``with OutputLock(dst): ...`` holds the exclusive lock for ``dst``."""

    def __init__(self, dst: Path):
        self.path = lock_path(dst)
        self.fd: int | None = None

    def acquire(self) -> None:
        for _ in range(100):
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            except OSError as exc:
                raise EnvironmentFailure(
                    f"cannot create lock file: {exc.strerror}", where=str(self.path)
                ) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                holder = _read_pid(fd)
                os.close(fd)
                if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                    who = f"pid {holder}" if holder else "another run"
                    raise OutputConflictError(
                        f"output locked by {who}",
                        where=str(self.path.parent / self.path.name[1 : -len(".shardctl.lock")]),
                        hint="wait for it to finish, or pick another output",
                    ) from None
                raise EnvironmentFailure(
                    f"cannot lock: {exc.strerror}", where=str(self.path)
                ) from None
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if not same:  # the previous holder unlinked it between our open and our flock
                os.close(fd)
                continue
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            self.fd = fd
            return
        raise EnvironmentFailure("could not acquire the output lock", where=str(self.path))

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            os.unlink(self.path)
        except OSError:
            pass
        os.close(self.fd)  # closing drops the flock
        self.fd = None

    def __enter__(self) -> OutputLock:
        self.acquire()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None
