"""Checks made before any write: output location, overlap with the input, free space.

Reliability cases B7–B9 and E4 (preflight): DST equal to SRC, inside it, containing it, a symlink to
it, or a hard link to an input file → exit 4, compared by (st_dev, st_ino) so bind mounts do not
hide an overlap; DST existing without ``force`` → exit 4; with ``force``, DST must be empty or a
previous shardctl output (its layout record) → else exit 4; DST's
parent missing → exit 5; not enough free space → exit 5 ``need X GiB, Y available``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from shardctl.errors import EnvironmentFailure, OutputConflictError, os_error_text

_GIB = 2**30


def _ident(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _chain(path: str) -> list[tuple[int, int]]:
    """(st_dev, st_ino) of ``path`` and of every existing ancestor, innermost first.

    Identity by device and inode, not by path string: a bind mount of SRC elsewhere has the
    same (dev, ino) as SRC itself, so DST under the mount is still found inside SRC."""
    out: list[tuple[int, int]] = []
    cur = os.path.realpath(path)
    while True:
        ident = _ident(cur)
        if ident is not None:
            out.append(ident)
        up = os.path.dirname(cur)
        if up == cur:
            return out
        cur = up


def _overlap(src: str, dst: str) -> str | None:
    """'is the input' / 'is inside the input' / 'contains the input', or None."""
    src_id, dst_id = _ident(src), _ident(dst)
    if src_id is not None and dst_id == src_id:
        return "is the input"
    if src_id is not None and src_id in _chain(dst):
        return "is inside the input"
    if dst_id is not None and dst_id in _chain(src):
        return "contains the input"
    return None


def _files_in(src: str) -> list[str]:
    """SRC itself (a file input) or its top-level regular files."""
    if os.path.isfile(src):
        return [src]
    try:
        with os.scandir(src) as it:
            return [e.path for e in it if e.is_file(follow_symlinks=False)]
    except OSError:
        return []


def check_output(src: Path, dst: Path, *, force: bool, input_files: Iterable[Path] = ()) -> Path:
    """Validate DST against SRC; returns DST as an absolute path (its parent resolved)."""
    parent = Path(os.path.abspath(dst)).parent
    if not parent.is_dir():
        raise EnvironmentFailure(
            "output's parent directory does not exist", where=str(parent), hint="create it first"
        )
    dst_abs = Path(os.path.realpath(parent)) / Path(os.path.abspath(dst)).name
    src_real = os.path.realpath(src)
    for c in (str(dst_abs), os.path.realpath(dst_abs)):
        what = _overlap(src_real, c)
        if what is not None:
            raise OutputConflictError(
                f"output {what} ({src_real})",
                where=str(dst),
                hint="choose an output outside the input",
            )
    if os.path.lexists(dst_abs):
        if os.path.islink(dst_abs):
            raise OutputConflictError(
                "output is a symlink; refusing to write through it", where=str(dst)
            )
        if dst_abs.is_file():
            st = os.stat(dst_abs)
            for f in [*map(str, input_files), *_files_in(src_real)]:
                fs = os.stat(f)
                if (fs.st_dev, fs.st_ino) == (st.st_dev, st.st_ino):
                    raise OutputConflictError(
                        "output is a hard link to an input file", where=str(dst)
                    )
        if not force:
            raise OutputConflictError(
                "output exists", where=str(dst), hint="pass --force to replace it"
            )
        check_replaceable(dst_abs, shown=str(dst))
    return dst_abs


def check_replaceable(dst: Path, *, shown: str | None = None) -> None:
    """``--force`` replaces only an empty directory or a previous shardctl output.

    A shardctl output is recognized by its layout record (every output, ``ranks`` and ``hf``,
    has one at its root, written last before the commit). Anything else — a file, ``.``, a
    home directory — is exit 4 and stays untouched (RELIABILITY B8, issue 13 item 4)."""
    from shardctl.checkpoint.record import RECORD_NAME, SCHEMAS

    where = shown or str(dst)
    if not dst.is_dir() or dst.is_symlink():
        raise OutputConflictError(
            "--force replaces only a directory written by shardctl; this is not a directory",
            where=where,
            hint="remove it yourself or pick another output",
        )
    try:
        with os.scandir(dst) as it:
            empty = next(it, None) is None
    except OSError as exc:
        raise os_failure(exc, dst) from None
    if empty:
        return
    rec = dst / RECORD_NAME
    ok = False
    if rec.is_file() and not rec.is_symlink():
        try:
            with open(rec, "rb") as f:
                head = f.read(4096)
            ok = b'"schema"' in head and any(s.encode() in head for s in SCHEMAS)
        except OSError:
            ok = False
    if not ok:
        raise OutputConflictError(
            f"--force replaces only an empty directory or a previous shardctl output (one with "
            f"{RECORD_NAME}); this directory has other contents",
            where=where,
            hint="remove it yourself or pick another output",
        )


def preflight_space(parent: Path, need: int) -> None:
    """Exit 5 with the numbers when the output's file system lacks ``need`` bytes."""
    st = os.statvfs(parent)
    avail = st.f_bavail * st.f_frsize
    if need > avail:
        raise EnvironmentFailure(
            f"not enough space: need {_size(need)}, {_size(avail)} available",
            where=str(parent),
            hint="free space or write elsewhere",
        )


def _size(n: int) -> str:
    return f"{n / _GIB:.2f} GiB" if n >= _GIB else f"{n / 2**20:.1f} MiB"


def os_failure(exc: OSError, where: Path | str | None = None) -> EnvironmentFailure:
    """An OSError as one line (exit 5)."""
    return EnvironmentFailure(os_error_text(exc), where=str(exc.filename or where or "") or None)
