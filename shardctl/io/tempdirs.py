"""Temporary directories that the next run can reap when their owner was killed.

``verify`` (forward level) keeps worker logs and a merged reference model under
``$TMPDIR/shardctl-verify-*``. A run killed with ``kill -9`` (or the OOM killer) never removes
them. Each such directory therefore holds an owner lock::

    $TMPDIR/shardctl-verify-k2j3x9/
      .shardctl-owner      "<pid>\\n", flock'ed (LOCK_EX) by the owning process for its life

The kernel drops an ``flock`` when its holder dies, so :func:`reap` removes exactly the
directories whose owner is gone: it takes the lock without blocking; success means the owner is
dead (pid reuse cannot fool it, unlike ``kill(pid, 0)``). The owner file is locked before it is
renamed into place, so no reap can find it unlocked while its owner lives. A directory without
the owner file (another tool's, or one in its first microseconds) is left alone, as are symlinks
and directories of other users. Entries are found by ``os.listdir`` and a literal prefix, never
a glob, and only the fixed prefix chosen here is matched.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

OWNER = ".shardctl-owner"


def reap(prefix: str) -> list[Path]:
    """Remove ``$TMPDIR/<prefix>*`` directories whose owning process is dead; returns them."""
    base = tempfile.gettempdir()
    removed: list[Path] = []
    try:
        names = os.listdir(base)
    except OSError:
        return removed
    for name in names:
        if not name.startswith(prefix):
            continue
        path = Path(base) / name
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            continue
        try:
            fd = os.open(path / OWNER, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue  # no owner file: not ours to judge
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # the owner is alive
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
        finally:
            os.close(fd)
    return removed


@contextmanager
def owned_tempdir(prefix: str) -> Iterator[Path]:
    """A private temporary directory, locked by this process; stale ones are reaped first."""
    reap(prefix)
    path = Path(tempfile.mkdtemp(prefix=prefix))
    # The owner file appears already locked: created and flock'ed under another name, then
    # renamed into place. Created as OWNER and locked after, a concurrent run's reap could open
    # it in between, take the free lock, judge the owner dead and remove a live directory.
    staging = path / f"{OWNER}.{os.getpid()}"
    fd = os.open(staging, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, f"{os.getpid()}\n".encode())
        os.rename(staging, path / OWNER)
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
        os.close(fd)


__all__ = ["OWNER", "owned_tempdir", "reap"]
