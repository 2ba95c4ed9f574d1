"""Read-only maps of checkpoint files and boxes of bytes in them, for the columnar paths of
verify (``verify/bitwise/columnar.py``) and reshard (``reshard/columnar.py``).

A box of a row-major tensor (offsets and sizes per dim) is, in the file's bytes, a contiguous
*run* repeated along a few *outer* dims at fixed byte strides: :func:`box_kind` folds the
trailing dims the box spans whole into the run. Every box of one kind is then one strided view
away from its first byte, and :func:`rows_view` has a row per possible first byte, so indexing
it with many first bytes gathers many boxes in one numpy call.

A mapped file that another process truncates raises ``SIGBUS`` where a page past its new end
is touched, which no Python code can catch; callers check :func:`intact` before each step
(a truncation between steps then hands the run to their ``pread`` paths, which report it) —
one that lands inside a step's few milliseconds is not caught.

Mapped pages count in a process's resident memory until given back: :class:`SrcMaps` records
the stretch of each file a step touched and gives it back (``MADV_DONTNEED``; the pages stay in
the page cache) when the step is done, so memory stays flat whatever the file sizes.
"""

from __future__ import annotations

import math
import mmap
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

PAGE = mmap.PAGESIZE
Kind = tuple[tuple[int, ...], tuple[int, ...], int]  # outer sizes, their byte strides, run


def box_kind(item: int, strides: Sequence[int], sizes: Sequence[int]) -> Kind:
    """A box of ``sizes`` in a tensor of byte ``strides`` (row-major, ``item`` bytes an
    element) as (outer sizes, their byte strides, contiguous run bytes): the trailing dims it
    spans whole fold into the run, then its innermost partial dim; outer dims of size 1 drop.
    A dim ``d > 0`` spans ``strides[d - 1] / strides[d]`` indexes of the tensor."""
    width = len(sizes)
    run = item
    d = width - 1
    while d > 0 and sizes[d] == strides[d - 1] // strides[d]:
        run = strides[d - 1]
        d -= 1
    if d >= 0:
        run = sizes[d] * strides[d]
        d -= 1
    outer = [(sizes[k], strides[k]) for k in range(d + 1) if sizes[k] > 1]
    return tuple(x for x, _ in outer), tuple(s for _, s in outer), run


def contiguous_kinds(kinds: Sequence[Kind]) -> np.ndarray:
    """Per kind: whether a box of it is one contiguous run of SRC bytes (no outer dims); one
    ``False`` when there are no kinds (an array to index by a kind column)."""
    return np.array([not k[0] for k in kinds] or [False], dtype=bool)


def box_span(outer: Sequence[int], strides: Sequence[int], run: int) -> int:
    """Bytes from a box's first byte to its last."""
    return sum((z - 1) * s for z, s in zip(outer, strides, strict=True)) + run


def rows_view(
    buf: np.ndarray, shape: tuple[int, ...], strides: tuple[int, ...], span: int
) -> np.ndarray:
    """A view of byte array ``buf`` with a row per possible first byte, each row the box
    ``shape`` (its last dim bytes at stride 1, the others at ``strides``). No copy; writeable
    when ``buf`` is."""
    return np.lib.stride_tricks.as_strided(
        buf,
        shape=(buf.size - span + 1, *shape),
        strides=(1, *strides, 1),
        writeable=buf.flags.writeable,
    )


def row_kinds(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each row's kind (equal rows, equal kinds) and one row per kind. Column by column: each
    column's values as their rank among its distinct values, the ranks combined in mixed radix
    into one integer (``unique`` over whole rows sorts them as bytes: ~0.25 s at 180,000)."""
    n, width = rows.shape
    if n and width:
        # columns of small ranges (shapes, dims, codes): each value's offset from its column's
        # minimum is already a rank in mixed radix, without a sort per column
        low, high = rows.min(axis=0).tolist(), rows.max(axis=0).tolist()
        spans = [h - lo + 1 for lo, h in zip(low, high, strict=True)]
        if math.prod(spans) < 2**62:
            code = np.zeros(n, dtype=np.int64)
            for c, (lo, span) in enumerate(zip(low, spans, strict=True)):
                code *= span
                code += rows[:, c] - lo
            _, first, kind = np.unique(code, return_index=True, return_inverse=True)
            return kind.reshape(-1).astype(np.int64), rows[first]
    code = np.zeros(n, dtype=np.int64)
    radix = 1
    for c in range(width):
        values, rank = np.unique(rows[:, c], return_inverse=True)
        radix *= len(values)
        if radix >= 2**62:
            _, first, kind = np.unique(rows, axis=0, return_index=True, return_inverse=True)
            return kind.reshape(-1), rows[first]
        code = code * len(values) + rank.reshape(-1)
    _, first, kind = np.unique(code, return_index=True, return_inverse=True)
    return kind.reshape(-1).astype(np.int64), rows[first]


def map_file(path: Path) -> tuple[mmap.mmap, np.ndarray]:
    """A read-only map of ``path`` and a byte array over it."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
    finally:
        os.close(fd)
    return mm, np.frombuffer(mm, dtype=np.uint8)


def intact(mm: mmap.mmap, path: Path) -> bool:
    """Whether ``path`` is still at least as long as its map ``mm``."""
    try:
        return os.stat(path).st_size >= len(mm)
    except OSError:
        return False


def close_map(mm: mmap.mmap) -> None:
    """Close a map; one still exported (an exception's traceback holds a view of it) is left
    to the garbage collector rather than masking that exception."""
    try:
        mm.close()
    except BufferError:
        pass


def dontneed(mm: mmap.mmap, a: int, b: int) -> None:
    """Give back the mapped pages of ``[a, b)`` (they stay in the page cache)."""
    a -= a % PAGE
    if b > a:
        mm.madvise(mmap.MADV_DONTNEED, a, min(b, len(mm)) - a)


class SrcMaps:
    """Read-only maps of source files, opened once each; the stretches a step touched are given
    back by :meth:`drop`. Views of kinds of box are cached per (file, kind)."""

    def __init__(self) -> None:
        self.src: dict[int, tuple[mmap.mmap, np.ndarray]] = {}
        self.views: dict[tuple[int, int], np.ndarray] = {}
        self.touched: dict[int, list[int]] = {}  # file -> [first byte, end]

    def get(self, k: int, path: Path) -> tuple[mmap.mmap, np.ndarray]:
        got = self.src.get(k)
        if got is None:
            got = self.src[k] = map_file(path)
        return got

    def view(
        self,
        k: int,
        kind: int,
        src: np.ndarray,
        shape: tuple[int, ...],
        strides: tuple[int, ...],
        span: int,
    ) -> np.ndarray:
        """File ``k``'s :func:`rows_view` for boxes of kind ``kind``, made once."""
        got = self.views.get((k, kind))
        if got is None:
            got = self.views[k, kind] = rows_view(src, shape, strides, span)
        return got

    def touch(self, k: int, a: int, b: int) -> None:
        got = self.touched.get(k)
        if got is None:
            self.touched[k] = [a, b]
        else:
            got[0], got[1] = min(got[0], a), max(got[1], b)

    def drop(self) -> None:
        for k, (a, b) in self.touched.items():
            dontneed(self.src[k][0], a, b)
        self.touched.clear()

    def close(self) -> None:
        self.views.clear()
        while self.src:
            _, (mm, arr) = self.src.popitem()
            del arr  # the array exports the map's buffer: gone before the map closes
            close_map(mm)
