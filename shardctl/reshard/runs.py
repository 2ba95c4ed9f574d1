"""Byte runs: the common small target as a few strided byte copies, executed many at a time.

A target that one piece fills, read from rectangular source shards that tile it along one dim
(a whole tensor, an ``S(0)`` slice, an expert moved whole, an ``S(1)`` column slice, ``tp``
shards merged back) is, per source part, one *run*: ``rows`` copies of ``width`` contiguous
bytes, ``src_stride`` apart in the source and ``dst_stride`` apart in the target (``rows == 1``:
one contiguous copy)::

    S(1) half of a [64, 32] BF16 weight, rank 1:  rows=64, width=32, src_stride=64,
                                                  dst_stride=32, src at byte 32, dst at 0

The geometry of a run depends only on the shapes and pieces of the target and its sources, so it
is worked out once per *kind* of target (a few dozen kinds at 90,000 tensors) and cached; each
target then costs one lookup and one append. Runs wait in :class:`Pending` until their source
window is about to be replaced or their buffer is handed to the writer, and are then executed a
whole group at a time — every run of one shape between one source window and one output buffer
is one numpy gather and one scatter through strided views — so 180,000 small targets cost a few
thousand numpy calls, not 180,000 Python copies.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import as_strided

from shardctl.blocks import strides
from shardctl.checkpoint.source import SourceShard

# A run of at least this many bytes is copied on its own, straight from window to buffer (see
# ``execute``): a memcpy of 32 KiB costs about what one numpy call does.
DIRECT_BYTES = 32 * 2**10

# (rows, width, src_stride, dst_stride), in bytes: one run's shape.
Shape = tuple[int, int, int, int]
# (index of the source shard in the fqn's sources, source byte offset in that local tensor,
#  target byte offset in the target local tensor, shape, its extent).
Run = tuple[int, int, int, Shape, int]
# One source part of a target, as ``batching.Batching._parts`` gives it.
Part = tuple[SourceShard, tuple[int, ...], tuple[int, ...], tuple[int, ...]]


def extent(shape: Shape) -> int:
    """Bytes a run spans in its source, first to last."""
    rows, width, src_stride, _ = shape
    return (rows - 1) * src_stride + width


def runs_of(
    parts: Sequence[Part],
    srcs: Sequence[SourceShard],
    local_shape: tuple[int, ...],
    item: int,
    window: int,
) -> tuple[Run, ...] | None:
    """The runs that copy ``parts`` into a target of ``local_shape``; None when a part is not
    one strided run (a box cut in two dims of more than one index each) or spans more source
    bytes than a window holds."""
    out: list[Run] = []
    dst_strides = tuple(x * item for x in strides(local_shape))
    for sh, src_lo, dst_lo, sizes in parts:
        k = next(i for i, x in enumerate(srcs) if x is sh)
        ls = sh.local_shape
        src_strides = tuple(x * item for x in strides(ls))
        nd = len(sizes)
        # The innermost contiguous stretch: trailing dims whole in source and target, then the
        # first dim that is not (its part of it).
        d = nd - 1
        while d > 0 and sizes[d] == ls[d] == local_shape[d]:
            d -= 1
        width = math.prod(sizes[d:]) * item
        # The dims before it, as (count, src stride, dst stride), inside out; a dim whose rows
        # follow the previous dim's last row on both sides (a whole dim between them, e.g. an
        # ep slice of packed experts [E/ep, H, I/tp]) is one longer dim. One left: one run.
        outer: list[tuple[int, int, int]] = []
        for i in reversed(range(d)):
            if sizes[i] == 1:
                continue
            if outer:
                count, ss, ds = outer[-1]
                if src_strides[i] == ss * count and dst_strides[i] == ds * count:
                    outer[-1] = (count * sizes[i], ss, ds)
                    continue
            outer.append((sizes[i], src_strides[i], dst_strides[i]))
        if len(outer) > 1:
            return None
        if outer:
            count, ss, ds = outer[0]
            shape: Shape = (count, width, ss, ds)
            if ss == width and ds == width:
                shape = (1, count * width, count * width, count * width)
        else:
            shape = (1, width, width, width)
        if extent(shape) > window:
            return None
        src = sum(a * b for a, b in zip(src_lo, src_strides, strict=True))
        dst = sum(a * b for a, b in zip(dst_lo, dst_strides, strict=True))
        out.append((k, src, dst, shape, extent(shape)))
    return tuple(out)


def _view(buf: np.ndarray, shape: Shape, stride_at: int, span: int) -> np.ndarray:
    """Every run of ``shape`` that fits in ``buf``, indexed by its first byte: ``[n, rows,
    width]`` (a strided view, no copy)."""
    rows, width = shape[0], shape[1]
    n = len(buf) - span + 1
    return as_strided(buf, shape=(n, rows, width), strides=(1, shape[stride_at], 1))


def execute(
    src: np.ndarray, dst: np.ndarray, shape: Shape, src_at: list[int], dst_at: list[int], base: int
) -> None:
    """Copy runs of ``shape`` from ``src`` (starting at ``src_at``, less ``base``) to ``dst``
    (starting at ``dst_at``).

    Many small runs: contiguous runs that follow each other in both ``src`` and ``dst`` are
    one copy per stretch (``_coalesced``); else one gather into a temporary and one scatter
    (two copies of each byte, a few numpy calls in all). Runs of ``DIRECT_BYTES`` or more (or
    a lone run) are copied one by one, straight from ``src`` to ``dst``: there the second copy
    would cost more than the Python per run."""
    rows, width, src_stride, dst_stride = shape
    if len(src_at) == 1 or rows * width >= DIRECT_BYTES:
        for a, b in zip(src_at, dst_at, strict=True):
            a -= base
            if rows == 1:
                dst[b : b + width] = src[a : a + width]
                continue
            into = np.ndarray((rows, width), np.uint8, dst, b, (dst_stride, 1))
            into[...] = np.ndarray((rows, width), np.uint8, src, a, (src_stride, 1))
        return
    at = np.asarray(src_at, dtype=np.intp)
    if base:
        at -= base
    if rows == 1 and _coalesced(src, dst, width, at, np.asarray(dst_at, dtype=np.intp)):
        return
    got = _view(src, shape, 2, extent(shape))[at]
    dst_span = (rows - 1) * dst_stride + width
    _view(dst, shape, 3, dst_span)[np.asarray(dst_at, dtype=np.intp)] = got


def _coalesced(
    src: np.ndarray, dst: np.ndarray, width: int, at: np.ndarray, to: np.ndarray
) -> bool:
    """Copy contiguous runs that follow each other on both sides as one copy per stretch (an
    expert moved whole: its tensors, and the next experts', back to back in both files), when
    that makes at most a quarter as many copies; False (nothing done) otherwise."""
    breaks = np.flatnonzero((np.diff(at) != width) | (np.diff(to) != width)) + 1
    if 4 * (len(breaks) + 1) > len(at):
        return False
    firsts = [0, *breaks.tolist()]
    ends = [*breaks.tolist(), len(at)]
    for i, j in zip(firsts, ends, strict=True):
        a, b, n = int(at[i]), int(to[i]), (j - i) * width
        dst[b : b + n] = src[a : a + n]
    return True


class Pending:
    """Runs waiting for execution, grouped by (input file, output buffer, shape): the short
    path appends ``(buffer, [source offsets], [buffer offsets])`` to ``groups`` inline."""

    __slots__ = ("groups",)

    def __init__(self) -> None:
        self.groups: dict[tuple[int, int, Shape], tuple[bytearray, list[int], list[int]]] = {}

    def run(self, windows: dict[int, tuple[int, int, bytearray]]) -> None:
        """Execute every pending run; ``windows``: input file -> (start, length, buffer)."""
        for (file, _, shape), (buf, src_at, dst_at) in self.groups.items():
            start, n, wbuf = windows[file]
            src = np.frombuffer(wbuf, dtype=np.uint8, count=n)
            execute(src, np.frombuffer(buf, dtype=np.uint8), shape, src_at, dst_at, start)
        self.groups.clear()
