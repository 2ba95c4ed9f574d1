"""Small tensors, many to a buffer: a file's tensors of at most one block each are appended to
one pending buffer that is hashed and written with one ``pwrite``."""

from __future__ import annotations

import math
from collections.abc import Callable

from shardctl.blocks import scalar_shape
from shardctl.checkpoint.source import SourceShard
from shardctl.dtypes import itemsize
from shardctl.layout.types import LocalTensor
from shardctl.reshard.boxes import Box, plan_boxes
from shardctl.reshard.gather import Gather
from shardctl.reshard.writer import OutFile


class Batching(Gather):
    """The small-tensor half of :class:`~shardctl.reshard.copy.Executor` (which sets these)."""

    block: int
    sources: dict[str, tuple[SourceShard, ...]]
    progress: Callable[[int], None] | None

    def _buffer(self, asking: OutFile | None = None) -> bytearray:
        raise NotImplementedError  # the executor's buffer pool

    def _small_boxes(self, t: LocalTensor) -> list[Box] | None:
        """``t``'s boxes when it can be batched: it fits a block, and so does every source
        local tensor it reads (a gather reads whole source rows into the one-block scratch)."""
        if not 0 < t.nbytes <= self.block:
            return None
        s = itemsize(t.dtype)
        boxes = plan_boxes(t.fqn, t.pieces, self.sources[t.fqn])
        if any(math.prod(b.src.local_shape) * s > self.block for b in boxes):
            return None
        return boxes  # plan_boxes gives a scalar its one-element box (scalar_piece)

    def _small(self, out: OutFile, t: LocalTensor, boxes: list[Box]) -> None:
        """Append ``t`` (at most one block) to ``out``'s pending buffer.

        Tensors of a file lie back to back, so a file's small tensors fill one buffer that is
        hashed and written with one ``pwrite``; reads contiguous in a source file and in the
        buffer (a file's experts that stay adjacent) are merged into one ``pread`` at flush.
        At 90,000 tensors this turns 180,000 thread hand-offs into ~1,500.
        """
        n = t.nbytes
        if out.pend is not None and (
            out.pend_len + n > self.block or t.begin != out.pend_at + out.pend_len
        ):
            self._flush(out)
        if out.pend is None:
            out.pend = self._buffer(out)
            out.pend_at, out.pend_len = t.begin, 0
        s = itemsize(t.dtype)
        shape = scalar_shape(t.local_shape)
        mv = memoryview(out.pend)[out.pend_len : out.pend_len + n]
        self._fill(mv, s, shape, (0,) * len(shape), shape, boxes, out, out.pend_len)
        out.pend_len += n

    def _flush(self, out: OutFile) -> None:
        """Issue ``out``'s merged reads and hand its pending buffer to the writer."""
        if out.pend is None:
            return
        self._issue(out)
        buf, out.pend = out.pend, None
        mv = memoryview(buf)
        out.writer.q.put(("data", out, out.pend_at, mv[: out.pend_len], buf))
        if self.progress is not None:
            self.progress(out.pend_len)
