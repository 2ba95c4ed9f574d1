"""Atomic directory output: stage in a sibling, fsync everything, rename into place last.

::

    parent/
      .out.shardctl.lock                       the run's lock (shardctl.io.lock)
      .out.shardctl-staging-<pid>-<rand>/      this run's files, fsynced one by one
      out/                                     appears only complete (rename, then fsync parent)

The staging directory is a sibling of the output, never under ``/tmp``, so the final rename can
not cross a mount (EXDEV). Replacing an existing output (``force``) swaps old and new in one
``renameat2(RENAME_EXCHANGE)``, so at every instant either the old or the complete new output is
at the path (reliability case B8); the old one, now at the staging name, is then removed. Where the
file system lacks ``RENAME_EXCHANGE`` the old output is first renamed aside to
``.out.shardctl-old-*`` (a crash in that window leaves it there, and the next run under the lock
puts it back). Stale staging directories of crashed runs are removed by the next run, under the
lock (E3) — except one an identical run can resume (``shardctl.reshard.resume``).
"""

from __future__ import annotations

import ctypes
import errno
import os
import secrets
import shutil
from pathlib import Path

from shardctl.io import faults

_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def staging_prefix(dst: Path) -> str:
    return f".{dst.name}.shardctl-staging-"


def old_prefix(dst: Path) -> str:
    return f".{dst.name}.shardctl-old-"


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file(path: Path, data: bytes, *, exclusive: bool = True) -> int:
    """Write ``data`` to ``path`` and fsync it; returns its size. ``exclusive``: the file must
    not exist (``O_EXCL``); else it is replaced whole, through a temporary sibling."""
    tmp = path if exclusive else path.with_name(path.name + ".tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | (os.O_EXCL if exclusive else os.O_TRUNC)
    fd = os.open(tmp, flags, 0o666)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    if not exclusive:
        os.replace(tmp, path)
    return len(data)


def siblings(dst: Path, prefix: str) -> list[Path]:
    """Entries of DST's parent whose names start with ``prefix``, sorted.

    A literal prefix match on ``os.listdir``: never ``glob``, because DST's name is user data
    (``m?`` or ``m[0-9]`` would match another output's staging)."""
    try:
        names = os.listdir(dst.parent)
    except OSError:
        return []
    return sorted(dst.parent / n for n in names if n.startswith(prefix))


def recover(dst: Path, keep: Path | None = None) -> None:
    """Under the lock: remove stale staging of crashed runs (but ``keep``, being resumed);
    restore a set-aside old output."""
    olds = siblings(dst, old_prefix(dst))
    if olds and not os.path.lexists(dst):
        os.rename(olds[-1], dst)  # a crash between the two fallback renames
        olds = olds[:-1]
    for stale in [*siblings(dst, staging_prefix(dst)), *olds]:
        if stale != keep:
            _remove(stale)


def make_staging(dst: Path, run_id: str | None = None) -> Path:
    """Create this run's staging directory (mode 0777 & ~umask), unique per run."""
    run_id = run_id or f"{os.getpid()}-{secrets.token_hex(4)}"
    staging = dst.parent / f"{staging_prefix(dst)}{run_id}"
    os.mkdir(staging, 0o777)
    try:
        faults.point("staging_created")
    except BaseException:
        _remove(staging)  # an interrupt here must not leave it behind
        raise
    return staging


def commit(staging: Path, dst: Path, *, replace: bool) -> None:
    """Move the fully written, fsynced ``staging`` to ``dst``; ``replace`` swaps an existing one."""
    fsync_dir(staging)
    faults.point("before_rename")
    if replace and os.path.lexists(dst):
        if _exchange(staging, dst):
            faults.point("after_rename")
            fsync_dir(dst.parent)
            _remove(staging)  # now holds the old output
            return
        aside = dst.parent / f"{old_prefix(dst)}{os.getpid()}-{secrets.token_hex(4)}"
        os.rename(dst, aside)
        os.rename(staging, dst)
        faults.point("after_rename")
        fsync_dir(dst.parent)
        _remove(aside)
        return
    os.rename(staging, dst)  # fails (ENOTEMPTY/EEXIST) rather than replace a racing output
    faults.point("after_rename")
    fsync_dir(dst.parent)


def discard(staging: Path | None) -> None:
    """Remove a staging directory after a failure; never raises."""
    if staging is not None:
        _remove(staging)


def _exchange(a: Path, b: Path) -> bool:
    """``renameat2(a, b, RENAME_EXCHANGE)``; False where unsupported (the caller falls back)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    rc = fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _remove(path: Path) -> None:
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    except OSError:
        pass
