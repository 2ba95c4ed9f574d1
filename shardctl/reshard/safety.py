"""Checks made before any write: output location, overlap with the input, free space.

Reliability cases B7–B9 and E4 (preflight): DST equal to SRC, inside it, containing it, a symlink to
it, or a hard link to an input file → exit 4; DST existing without ``force`` → exit 4; DST's
parent missing → exit 5; not enough free space → exit 5 ``need X GiB, Y available``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from shardctl.errors import EnvironmentFailure, OutputConflictError, os_error_text

_GIB = 2**30


def _inside(child: str, parent: str) -> bool:
    return child == parent or child.startswith(parent.rstrip(os.sep) + os.sep)


def check_output(src: Path, dst: Path, *, force: bool, input_files: Iterable[Path] = ()) -> Path:
    """Validate DST against SRC; returns DST as an absolute path (its parent resolved)."""
    parent = Path(os.path.abspath(dst)).parent
    if not parent.is_dir():
        raise EnvironmentFailure(
            "output's parent directory does not exist", where=str(parent), hint="create it first"
        )
    dst_abs = Path(os.path.realpath(parent)) / Path(os.path.abspath(dst)).name
    src_real = os.path.realpath(src)
    candidates = {str(dst_abs), os.path.realpath(dst_abs)}
    for c in candidates:
        if _inside(c, src_real) or _inside(src_real, c):
            what = "is the input" if c == src_real else "overlaps the input"
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
            for f in input_files:
                fs = os.stat(f)
                if (fs.st_dev, fs.st_ino) == (st.st_dev, st.st_ino):
                    raise OutputConflictError(
                        "output is a hard link to an input file", where=str(dst)
                    )
        if not force:
            raise OutputConflictError(
                "output exists", where=str(dst), hint="pass --force to replace it"
            )
    return dst_abs


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
