"""Input side of the copy: read source bytes and gather them into a block of a target tensor.

A block that one box fills and that is contiguous in the source is ``pread`` straight into the
output buffer (or, for a batched small tensor, queued as a read merged with its neighbour); any
other block reads the source rows it needs into a one-block scratch buffer and gathers with
numpy on raw bytes — an element is ``itemsize`` byte columns, so BF16/FP8 need no numpy dtype.
Uncovered bytes are zero padding, written explicitly. The scratch is a one-entry cache, so the
``tp`` targets of an ``S(1)`` split, advancing in lockstep, share one read of the source rows.
"""

from __future__ import annotations

import math
import os
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from shardctl.blocks import flat_index, is_contiguous, scalar_shape
from shardctl.checkpoint.source import SourceShard
from shardctl.errors import EnvironmentFailure
from shardctl.reshard.boxes import Box
from shardctl.reshard.writer import OutFile

# Input files held open at once per executor (least recently used closed first), so that a
# checkpoint of 10 000 shards runs under ``ulimit -n 256`` (RELIABILITY H2).
MAX_INPUT_FDS = 32
# Buffers one ``preadv`` call takes (Linux: 1024).
IOV_MAX = os.sysconf("SC_IOV_MAX") if "SC_IOV_MAX" in os.sysconf_names else 1024


def _rows_view(arr: np.ndarray, nrows: int, trailing: tuple[int, ...], s: int) -> np.ndarray:
    """Raw bytes as ``[rows, *trailing[:-1], trailing[-1]·itemsize]`` (or ``[rows·itemsize]``)."""
    if not trailing:
        return arr[: nrows * s]
    shape = (nrows, *trailing[:-1], trailing[-1] * s)
    return arr[: math.prod(shape)].reshape(shape)


def _index(
    row0: int, nrows: int, lo: tuple[int, ...], sz: tuple[int, ...], s: int
) -> tuple[slice, ...]:
    """Slices of a ``_rows_view`` selecting rows ``[row0, row0+nrows)`` and the box ``lo/sz``."""
    if not lo:
        return (slice(row0 * s, (row0 + nrows) * s),)
    out = [slice(row0, row0 + nrows)]
    out += [slice(a, a + n) for a, n in zip(lo[:-1], sz[:-1], strict=True)]
    out.append(slice(lo[-1] * s, (lo[-1] + sz[-1]) * s))
    return tuple(out)


class Gather:
    """The reading half of :class:`~shardctl.reshard.copy.Executor` (which sets these)."""

    input_paths: list[Path]
    on_read: Callable[[int, int, memoryview], None] | None
    fds: OrderedDict[int, int]
    scratch_buf: bytearray
    scratch: np.ndarray
    scratch_key: tuple[int, int, int] | None

    def _issue(self, out: OutFile) -> None:
        """Read what ``out``'s pending buffer still waits for."""
        if out.pend is not None and out.pend_reads:
            mv = memoryview(out.pend)
            for file, src, at, n in out.pend_reads:
                self._read(file, src, mv[at : at + n])
        out.pend_reads.clear()

    def _fd(self, file: int) -> int:
        fd = self.fds.get(file)
        if fd is not None:
            self.fds.move_to_end(file)
            return fd
        if len(self.fds) >= MAX_INPUT_FDS:
            os.close(self.fds.popitem(last=False)[1])
        fd = self.fds[file] = os.open(self.input_paths[file], os.O_RDONLY | os.O_CLOEXEC)
        return fd

    def _read(self, file: int, offset: int, mv: memoryview) -> None:
        self._read_rest(self._fd(file), file, offset, mv, 0)
        if self.on_read is not None:
            self.on_read(file, offset, mv)

    def _read_rest(self, fd: int, file: int, offset: int, mv: memoryview, done: int) -> None:
        """Read ``mv[done:]`` from ``offset + done``; a file that ends first is exit 5."""
        while done < len(mv):
            n = os.preadv(fd, [mv[done:]], offset + done)
            if n == 0:
                raise EnvironmentFailure(
                    f"input changed during run (short read at byte {offset + done})",
                    where=str(self.input_paths[file]),
                    hint="rerun once the input is stable",
                )
            done += n

    def _readv(self, file: int, offset: int, views: list[memoryview]) -> None:
        """Read SRC ``file`` from ``offset`` into ``views`` back to back: one ``preadv`` for
        up to ``IOV_MAX`` of them. A short read (the file cut under us) finishes view by view
        (:meth:`_read_rest`, as :meth:`_read` does), so it ends in the same "input changed"
        error; the input check is fed every view, in file order."""
        fd = self._fd(file)
        at = offset
        for i in range(0, len(views), IOV_MAX):
            group = views[i : i + IOV_MAX]
            got = os.preadv(fd, group, at)
            for mv in group:
                n = len(mv)
                if got < n:  # this view and the rest of the group: one at a time
                    self._read_rest(fd, file, at, mv, max(got, 0))
                got -= n
                if self.on_read is not None:
                    self.on_read(file, at, mv)
                at += n

    def _fill(
        self,
        mv: memoryview,
        s: int,
        shape: tuple[int, ...],
        lo: tuple[int, ...],
        sz: tuple[int, ...],
        boxes: Sequence[Box],
        batch: OutFile | None,
        at: int,
        subs: list[tuple[Box, tuple[int, ...], tuple[int, ...]]] | None = None,
    ) -> None:
        """Fill ``mv`` with the block ``lo/sz`` of a local tensor of ``shape``. ``batch``: the
        file whose pending buffer ``mv`` is, at ``at`` — a contiguous read is queued there
        (merged with the previous one when they touch) instead of issued now."""
        n = math.prod(sz)
        if subs is None:
            subs = self._subs(lo, sz, boxes)
        covered = sum(math.prod(z) for _, _, z in subs)
        if (
            len(subs) == 1
            and covered == n
            and is_contiguous(subs[0][2], scalar_shape(subs[0][0].src.local_shape))
        ):
            b, a, z = subs[0]
            src_at = tuple(x - y + w for x, y, w in zip(a, b.dst_lo, b.src_lo, strict=True))
            ls = scalar_shape(b.src.local_shape)
            where = b.src.begin + flat_index(src_at, ls) * s
            if batch is None:
                self._read(b.src.file, where, mv)
                return
            reads = batch.pend_reads
            last = reads[-1] if reads else None
            if (
                last
                and last[0] == b.src.file
                and last[1] + last[3] == where
                and last[2] + last[3] == at
            ):
                last[3] += len(mv)
            else:
                reads.append([b.src.file, where, at, len(mv)])
        else:
            if batch is not None:
                self._issue(batch)  # source reads stay in file order (the input checksums)
            arr = np.frombuffer(mv, dtype=np.uint8, count=len(mv))
            if covered != n:
                arr[:] = 0
            dim = self._dim(lo, sz)
            nrows = sz[dim]
            dst_view = _rows_view(arr, nrows, shape[dim + 1 :], s)
            for b, a, z in subs:
                src_at = tuple(x - y + w for x, y, w in zip(a, b.dst_lo, b.src_lo, strict=True))
                ls = scalar_shape(b.src.local_shape)
                src_view = self._rows(b.src, ls, src_at, z[dim], dim, s)
                dst_view[_index(a[dim] - lo[dim], z[dim], a[dim + 1 :], z[dim + 1 :], s)] = (
                    src_view[_index(0, z[dim], src_at[dim + 1 :], z[dim + 1 :], s)]
                )

    @staticmethod
    def _subs(
        lo: tuple[int, ...], sz: tuple[int, ...], boxes: Sequence[Box]
    ) -> list[tuple[Box, tuple[int, ...], tuple[int, ...]]]:
        """The boxes meeting the block ``lo/sz``: (box, first index, sizes) of each overlap."""
        subs: list[tuple[Box, tuple[int, ...], tuple[int, ...]]] = []
        for b in boxes:
            a = tuple(max(x, y) for x, y in zip(lo, b.dst_lo, strict=True))
            z = tuple(
                min(x + p, y + q) - m
                for x, p, y, q, m in zip(lo, sz, b.dst_lo, b.sizes, a, strict=True)
            )
            if all(v > 0 for v in z):
                subs.append((b, a, z))
        return subs

    @staticmethod
    def _dim(lo: tuple[int, ...], sz: tuple[int, ...]) -> int:
        """The block's row dim: dims before it have size 1 and dims after it are full."""
        return next((i for i, n in enumerate(sz) if n != 1), len(sz) - 1)

    def _rows(
        self,
        src: SourceShard,
        ls: tuple[int, ...],
        at: tuple[int, ...],
        nrows: int,
        dim: int,
        s: int,
    ) -> np.ndarray:
        """Source rows ``[at[dim], +nrows)`` (dims before ``dim`` fixed at ``at``), full width."""
        start = (*at[:dim], at[dim]) + (0,) * (len(ls) - dim - 1)
        offset = src.begin + flat_index(start, ls) * s
        length = nrows * math.prod(ls[dim + 1 :]) * s
        key = (src.file, offset, length)
        if key != self.scratch_key:
            self.scratch_key = None
            self._read(src.file, offset, memoryview(self.scratch_buf)[:length])
            self.scratch_key = key
        return _rows_view(self.scratch, nrows, ls[dim + 1 :], s)
