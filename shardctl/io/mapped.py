"""Boxes of bytes in checkpoint files, for the columnar paths of verify
(``verify/bitwise/columnar.py``) and reshard (``reshard/columnar.py``).

A box of a row-major tensor (offsets and sizes per dim) is, in the file's bytes, a contiguous
*run* repeated along a few *outer* dims at fixed byte strides: :func:`box_kind` folds the
trailing dims the box spans whole into the run. Every box of one kind is then one strided view
away from its first byte, and :func:`rows_view` has a row per possible first byte, so indexing
it with many first bytes gathers many boxes in one numpy call.

The views are of buffers the files were read into (``preadv``), not of maps of the files: a
mapped file that another process truncates raises ``SIGBUS`` where a page past its new end is
touched, which no Python code can catch, and a page of a map costs a fault to touch and an
``madvise`` to give back (verify's compare ran ~1.6x faster reading; see its module).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

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
