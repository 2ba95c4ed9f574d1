"""The box-copy engine: fill target local tensors from source shards, in bounded memory.

For each target tensor and each of its pieces (a box of the global tensor), intersect with the
source pieces that cover it; every intersection is a *box copy* from source-local to
target-local coordinates. A target tensor is then produced in row-major order, one *block* at a
time (rows ``[r0, r1)`` of some dim ``d``, every dim before ``d`` fixed), each block at most
``block_bytes``:

- a block that one box fills and that is contiguous in the source (``S(0)`` splits, whole
  tensors) is ``pread`` straight into the output buffer: one copy in, one copy out;
- any other block (``S(1)`` splits, fused parts, padding) reads the source rows it needs into a
  scratch buffer and gathers with numpy on raw bytes — an element is ``itemsize`` byte columns,
  so BF16/FP8 need no numpy dtype. Uncovered bytes are zero padding, written explicitly.

The target shards of one fqn advance in lockstep, block by block, so all ``tp`` targets of an
``S(1)`` split share one read of the source rows (a one-entry cache). Writer threads (each
output file belongs to one) hash each buffer and ``pwrite`` it, in file order, so the digest is
of the bytes actually written and every output file is written sequentially. Small tensors
take a short path (``batching``: many to a buffer, as byte runs executed a group at a time out
of source windows, ``runs``). Memory: at most ``(POOL × writers + 1) × block_bytes`` (the
pool's buffers are made as they are asked for) plus ``window.MAX_WINDOWS × window.WINDOW``
(16 MiB).
"""

from __future__ import annotations

import heapq
import itertools
import math
import os
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import cast

import numpy as np

from shardctl.blocks import flat_index, scalar_shape
from shardctl.checkpoint.plan_files import FileTensors, OutputFile
from shardctl.checkpoint.source import SourceShard
from shardctl.dtypes import itemsize
from shardctl.layout.types import LocalTensor
from shardctl.reshard import columnar, columnar_merge
from shardctl.reshard.batching import Batching, Fields
from shardctl.reshard.boxes import Box, plan_boxes
from shardctl.reshard.gather import MAX_INPUT_FDS
from shardctl.reshard.runs import Pending
from shardctl.reshard.writer import OutFile, Writer

# 1 MiB blocks stay in the CPU cache between pread, hash and pwrite: measured on tmpfs, 16 MiB
# blocks cost ~1.5× the time of 1 MiB ones (each buffer pass then goes to memory).
BLOCK_BYTES = 2**20
POOL = 4
WALK_CHUNK = 8192  # targets per slice of the merged walk (``_walk``)


def _output_fd_budget() -> int:
    """Output files open at once: 128, or fewer under a low ``ulimit -n`` (inputs need theirs)."""
    import resource

    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        return 128
    return max(4, min(128, (soft - 2 * MAX_INPUT_FDS - 32) // 4))


class Executor(Batching):
    """Writes ``files`` into ``directory`` from ``sources``; one writer thread, bounded buffers."""

    def __init__(
        self,
        directory: Path,
        input_paths: Sequence[Path],
        sources: Mapping[str, tuple[SourceShard, ...]],
        *,
        hash_name: str,
        block_bytes: int = BLOCK_BYTES,
        progress: Callable[[int], None] | None = None,
        order: dict[str, int] | None = None,
        writers: int = 1,
        on_read: Callable[[int, int, memoryview], None] | None = None,
        on_done: Callable[[str, int, str], None] | None = None,
    ):
        """``order``: the global fqn order every output file's tensors follow; ``writers``:
        threads that hash and write (output files are dealt to them round-robin); ``on_read``:
        called with ``(input file, offset, bytes)`` after every read (the input checksums);
        ``on_done``: called with ``(name, size, digest)`` once a file is fsynced and closed, from
        its writer thread (the resume journal)."""
        self.order = order
        self.on_read = on_read
        self.directory = directory
        self.input_paths = list(input_paths)
        self.sources = sources
        self.hash_name = hash_name
        self.block = block_bytes
        self.progress = progress
        # made as asked for (up to POOL a writer): a run the columnar path writes takes none
        self.pool: queue.Queue[bytearray] = queue.Queue()
        self.pool_left = POOL * max(1, writers)
        self.scratch_buf = bytearray(block_bytes)
        self.scratch = np.frombuffer(self.scratch_buf, dtype=np.uint8)
        self.scratch_key: tuple[int, int, int] | None = None
        self.fds: OrderedDict[int, int] = OrderedDict()  # LRU: inputs may be 10 000 files
        self.windows: OrderedDict[int, tuple[int, int, bytearray]] = OrderedDict()
        self.sizes: dict[int, int] = {}
        self.writers = [Writer(self.pool, i, on_done) for i in range(max(1, writers))]
        self.cancelled = threading.Event()
        self.outs: list[OutFile] = []
        self.kinds = {}
        self.kind_ids = {}
        self.source_kinds = {}
        self.source_kind_values = {}
        self.pending = Pending()

    # ---- public --------------------------------------------------------------------------

    def run(self, files: Sequence[OutputFile], max_open: int | None = None) -> dict[str, str]:
        """Write every file, at most ``max_open`` open at once; returns ``name -> digest``."""
        max_open = max_open or _output_fd_budget()
        for w in self.writers:
            w.start()
        try:
            for i in range(0, len(files), max_open):
                if i:
                    self._closed()  # the last batch's files: at most max_open open at once
                self._batch(files[i : i + max_open])
            self._finish()
        finally:
            self.close()
        return {out.file.name: out.digest for out in self.outs}

    def _closed(self) -> None:
        """Wait until the writers have closed every file handed to them (each batch's files
        are all closed once written: the columnar paths hand them over faster than the
        writers close them, and the next batch's would push past the descriptor budget)."""
        while any(out.fd >= 0 for out in self.outs):
            self._check()
            time.sleep(0.001)

    def cancel(self) -> None:
        self.cancelled.set()

    def close(self) -> None:
        for w in self.writers:
            if w.is_alive():
                w.stop = True
                w.q.put(None)
        for w in self.writers:
            w.join()
        for fd in [*self.fds.values(), *(o.fd for o in self.outs if o.fd >= 0)]:
            try:
                os.close(fd)
            except OSError:
                pass  # cleanup after a failure: the first error is the one reported
        self.fds.clear()
        for out in self.outs:
            out.fd = -1

    # ---- internals -----------------------------------------------------------------------

    def _finish(self) -> None:
        for w in self.writers:
            w.q.put(None)
        for w in self.writers:
            w.join()
        for w in self.writers:
            if w.error is not None:
                raise w.error

    def _check(self) -> None:
        if self.cancelled.is_set():
            raise InterruptedError("cancelled")
        if any(w.error is not None for w in self.writers):
            self._finish()

    def _buffer(self, asking: OutFile | None = None) -> bytearray:
        """A free buffer; when every buffer is some file's pending batch, the fullest other
        batch is flushed (a batch may go out early: it is always its file's next bytes)."""
        while True:
            self._check()
            try:
                return self.pool.get_nowait()
            except queue.Empty:
                pass
            if self.pool_left:
                self.pool_left -= 1
                return bytearray(self.block)
            held = [o for o in self.outs if o.pend is not None and o is not asking]
            if held:
                self._flush(max(held, key=lambda o: o.pend_len))
            try:
                return self.pool.get(timeout=0.2)
            except queue.Empty:
                continue

    def _batch(self, files: Sequence[OutputFile]) -> None:
        outs: list[OutFile] = []
        for f in files:
            w = self.writers[len(self.outs) % len(self.writers)]
            outs.append(OutFile(self.directory / f.name, f, self.hash_name, w))
            self.outs.append(outs[-1])
        for out in outs:
            if not out.file.tensors:
                self._close(out)
        # Every file's tensors follow the global order: merging the files' lists walks each
        # fqn's targets together without a table of all targets (180,000 at 90k tensors).
        rank = self.order or {}
        merged = self._merged(outs, rank)
        if merged is None:
            self._groups(self._walk(outs, rank))
        else:
            planned, key, js, at, lens, order = merged
            del merged  # else it keeps ``key`` alive below
            b = columnar.batch(planned, self.sources)
            mb = None if b is not None else columnar_merge.batch(planned, self.sources)
            if b is None and mb is None:
                self._groups(self._planned(outs, planned, js, at, lens, order))
            else:
                kinds = b.kinds if b is not None else cast(columnar_merge.MergeBatch, mb).kinds
                chunks = columnar.Chunks(self, kinds)
                ends = np.asarray(lens, dtype=np.int32) - 1
                keys = key[order]
                del key
                parts = None if mb is None else mb.parts(keys)
                size = columnar.CHUNK if keys.size <= columnar.MANY else columnar.CHUNK_MANY
                for s0, s1 in columnar.segments(keys, parts):
                    g = order[s0:s1]
                    file, pos = js[g], at[g]
                    cols: columnar.Columns | columnar_merge.MergeColumns | None
                    if b is not None:
                        cols = columnar.plan(b, keys[s0:s1], file, pos, pos == ends[file])
                    else:
                        assert mb is not None
                        cols = columnar_merge.plan(mb, keys[s0:s1], file, pos, pos == ends[file])
                    if cols is None:
                        self._groups(self._planned(outs, planned, js, at, lens, g))
                        continue
                    # stretches of the segment: the columnar path's chunks, or the old way
                    edges = np.flatnonzero(np.diff(cols.ok)) + 1
                    for x, y in itertools.pairwise([0, *edges.tolist(), g.size]):
                        if not cols.ok[x]:
                            self._groups(self._planned(outs, planned, js, at, lens, g[x:y]))
                        elif isinstance(cols, columnar.Columns):
                            for c0, c1 in columnar.chunks(cols, x, y, size):
                                chunks.write(outs, cols, c0, c1)
                        else:
                            for c0, c1 in columnar_merge.chunks(cols, x, y):
                                columnar_merge.write(chunks, outs, cols, c0, c1)
        self._check()

    def _groups(self, walk: Iterator[tuple[OutFile, Fields, bool]]) -> None:
        """Write ``walk``'s targets, an fqn's together (``_group``)."""
        group: list[tuple[OutFile, Fields, bool]] = []
        for out, fields, last in walk:
            if group and fields[0] != group[0][1][0]:
                self._group(group)
                group = []
            group.append((out, fields, last))
        if group:
            self._group(group)

    def _merged(
        self, outs: list[OutFile], rank: dict[str, int]
    ) -> tuple[list[FileTensors], np.ndarray, np.ndarray, np.ndarray, list[int], np.ndarray] | None:
        """Planned files (``FileTensors`` whose ranks strictly increase, the common case) as
        ``(their tensors, key, file, position, lengths, order)``: every target's global rank,
        file and position in it, the files' targets back to back, and the merged walk over them
        (by rank, file, position: one ``np.lexsort``); None for anything else."""
        lists = [o.file.tensors for o in outs]
        if not all(isinstance(x, FileTensors) for x in lists):
            return None
        planned = cast(list[FileTensors], lists)
        # int32: a global position (a tensor count fits), half the bytes at 720,000 targets
        keys = [np.fromiter((rank.get(f, -1) for f in x.fqns()), np.int32, len(x)) for x in planned]
        if not all(bool(np.all(k[1:] > k[:-1])) for k in keys):
            return None
        lens = [len(k) for k in keys]
        key = np.concatenate([np.zeros(0, np.int32), *keys])
        del keys
        js = np.repeat(np.arange(len(outs), dtype=np.int32), lens)
        at = np.concatenate([np.zeros(0, np.int32), *(np.arange(n, dtype=np.int32) for n in lens)])
        order = np.lexsort((at, js, key)).astype(np.int32)
        return planned, key, js, at, lens, order

    def _planned(
        self,
        outs: list[OutFile],
        planned: list[FileTensors],
        js: np.ndarray,
        at: np.ndarray,
        lens: list[int],
        order: np.ndarray | None,
    ) -> Iterator[tuple[OutFile, Fields, bool]]:
        """The targets ``(js, at)[order]`` (all of them when ``order`` is None) as ``(file,
        fields, last in its file)``, read from the planned files (no ``LocalTensor`` made)."""
        n = len(order) if order is not None else len(js)
        # a slice at a time: 360,000 targets as two lists of ints would be ~25 MB
        for c in range(0, n, WALK_CHUNK):
            part = order[c : c + WALK_CHUNK] if order is not None else slice(c, c + WALK_CHUNK)
            for j, i in zip(js[part].tolist(), at[part].tolist(), strict=True):
                yield outs[j], planned[j].fields(i), i == lens[j] - 1

    def _walk(
        self, outs: list[OutFile], rank: dict[str, int]
    ) -> Iterator[tuple[OutFile, Fields, bool]]:
        """Every target of ``outs`` as ``(file, fields, last in its file)``, merged by
        ``(rank of its fqn, file, position)`` through ``heapq.merge`` (files that are not
        planned ``FileTensors``, or whose ranks do not strictly increase; ``_merged`` takes the
        rest, in the same order: each file's keys are sorted)."""

        def keyed(j: int, out: OutFile) -> Iterator[tuple[int, int, int, OutFile, LocalTensor]]:
            for i, t in enumerate(out.file.tensors):
                yield rank.get(t.fqn, -1), j, i, out, t

        for _, _, i, out, t in heapq.merge(*(keyed(j, o) for j, o in enumerate(outs))):
            f = (t.fqn, t.dtype, t.local_shape, t.pieces, t.begin)
            yield out, f, i == len(out.file.tensors) - 1

    def _group(self, targets: list[tuple[OutFile, Fields, bool]]) -> None:
        """Write one fqn's targets (its big ones block by block, in lockstep); close the files
        it ends."""
        big = []
        srcs = self.sources[targets[0][1][0]]  # once per fqn: the short path reads it
        kind = self._source_kind(srcs)
        for out, f, _ in targets:
            if self._fast(out, f, srcs, kind):
                continue
            t = LocalTensor(*f)
            boxes = self._small_boxes(t)
            if boxes is not None:
                self._small(out, t, boxes)
            else:
                self._flush(out)
                big.append((out, t))
        gens = [self._tensor(out, t) for out, t in big]
        while gens:
            gens = [g for g in gens if next(g, StopIteration) is not StopIteration]
        for out, _, last in targets:
            if last:
                self._close(out)

    def _close(self, out: OutFile) -> None:
        self._flush(out)
        self._started(out)
        out.writer.q.put(("close", out))

    def _tensor(self, out: OutFile, t: LocalTensor) -> Iterator[None]:
        """Produce ``t`` block by block (a generator: one block per ``next``)."""
        s = itemsize(t.dtype)
        shape = scalar_shape(t.local_shape)
        if math.prod(shape) == 0:
            return
        boxes = plan_boxes(t.fqn, t.pieces, self.sources[t.fqn])
        boxes = [
            Box(b.src, *(scalar_shape(x) for x in (b.src_lo, b.dst_lo, b.sizes))) for b in boxes
        ]
        nd = len(shape)
        src_shapes = [scalar_shape(b.src.local_shape) for b in boxes]

        def row_bytes(d: int) -> int:
            return s * max(
                [math.prod(shape[d + 1 :])] + [math.prod(ls[d + 1 :]) for ls in src_shapes]
            )

        d = next(i for i in range(nd) if row_bytes(i) <= self.block)
        rows = max(1, self.block // row_bytes(d))
        trailing = shape[d + 1 :]
        for prefix in itertools.product(*(range(n) for n in shape[:d])):
            for r0 in range(0, shape[d], rows):
                r1 = min(r0 + rows, shape[d])
                lo = (*prefix, r0) + (0,) * len(trailing)
                sz = (1,) * d + (r1 - r0, *trailing)
                self._block(out, t, s, shape, lo, sz, boxes)
                yield

    def _block(
        self,
        out: OutFile,
        t: LocalTensor,
        s: int,
        shape: tuple[int, ...],
        lo: tuple[int, ...],
        sz: tuple[int, ...],
        boxes: Sequence[Box],
    ) -> None:
        nbytes = math.prod(sz) * s
        subs = self._subs(lo, sz, boxes)
        buf = self._buffer()
        mv = memoryview(buf)[:nbytes]
        offset = t.begin + flat_index(lo, shape) * s
        self._fill(mv, s, shape, lo, sz, boxes, None, 0, subs)
        self._started(out)
        out.writer.q.put(("data", out, offset, mv, buf))
        if self.progress is not None:
            self.progress(nbytes)
