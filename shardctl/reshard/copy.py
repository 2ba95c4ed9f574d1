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
of the bytes actually written and every output file is written sequentially. Memory:
``(POOL × writers + 1) × block_bytes``.
"""

from __future__ import annotations

import itertools
import math
import os
import queue
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from shardctl.blocks import flat_index, is_contiguous, scalar_piece, scalar_shape
from shardctl.checkpoint.plan_files import OutputFile
from shardctl.checkpoint.record_check import overlap
from shardctl.checkpoint.source import SourceShard
from shardctl.dtypes import itemsize
from shardctl.errors import EnvironmentFailure, InvalidInputError
from shardctl.io import faults, writeback
from shardctl.io.checksum import new_hash
from shardctl.io.writeback import start_writeback
from shardctl.layout.types import LocalTensor, Piece

# 1 MiB blocks stay in the CPU cache between pread, hash and pwrite: measured on tmpfs, 16 MiB
# blocks cost ~1.5× the time of 1 MiB ones (each buffer pass then goes to memory).
BLOCK_BYTES = 2**20
POOL = 4
# Input files held open at once per executor (least recently used closed first), so that a
# checkpoint of 10 000 shards runs under ``ulimit -n 256`` (RELIABILITY H2).
MAX_INPUT_FDS = 32


@dataclass(frozen=True)
class Box:
    """Copy ``sizes`` elements from ``src`` at ``src_lo`` to the target at ``dst_lo`` (local)."""

    src: SourceShard
    src_lo: tuple[int, ...]
    dst_lo: tuple[int, ...]
    sizes: tuple[int, ...]


def plan_boxes(fqn: str, pieces: Sequence[Piece], sources: Sequence[SourceShard]) -> list[Box]:
    """Box copies that fill ``pieces`` from ``sources`` (replicas: the first holder wins).

    Raises InvalidInputError when the sources leave part of a piece uncovered or overlap: the
    boxes of each piece must tile it exactly (count *and* disjointness), before a byte is written.
    """
    held: dict[tuple[tuple[int, ...], tuple[int, ...]], tuple[SourceShard, Piece]] = {}
    for s in sources:
        for q in map(scalar_piece, s.pieces):
            held.setdefault((q.offsets, q.sizes), (s, q))
    boxes: list[Box] = []
    for p in map(scalar_piece, pieces):
        need = math.prod(p.sizes)
        if need == 0:
            continue
        got = 0
        first = len(boxes)
        for s, q in held.values():
            lo = tuple(max(a, b) for a, b in zip(p.offsets, q.offsets, strict=True))
            hi = tuple(
                min(a + n, b + m)
                for a, n, b, m in zip(p.offsets, p.sizes, q.offsets, q.sizes, strict=True)
            )
            sizes = tuple(h - lo_ for lo_, h in zip(lo, hi, strict=True))
            if any(n <= 0 for n in sizes):
                continue
            src_lo = tuple(
                a - b + c for a, b, c in zip(lo, q.offsets, q.local_offsets, strict=True)
            )
            dst_lo = tuple(
                a - b + c for a, b, c in zip(lo, p.offsets, p.local_offsets, strict=True)
            )
            boxes.append(Box(s, src_lo, dst_lo, sizes))
            got += math.prod(sizes)
        mine = [((b.dst_lo, b.sizes), str(i)) for i, b in enumerate(boxes[first:])]
        if got != need or overlap(mine):  # same count can still hide an overlap and a gap
            raise InvalidInputError(
                f"source shards cover {got} of the {need} elements of box "
                f"offsets={list(p.offsets)} sizes={list(p.sizes)}"
                + (" (overlapping source pieces)" if got >= need else ""),
                where=fqn,
                hint="the source layout record is inconsistent; re-create the sharded checkpoint",
            )
    return boxes


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


def _output_fd_budget() -> int:
    """Output files open at once: 128, or fewer under a low ``ulimit -n`` (inputs need theirs)."""
    import resource

    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        return 128
    return max(4, min(128, (soft - 2 * MAX_INPUT_FDS - 32) // 4))


class _Out:
    def __init__(self, path: Path, f: OutputFile, hash_name: str, writer: _Writer):
        self.path = path
        self.writer = writer
        self.file = f
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
        self.hasher = new_hash(hash_name)
        self.pos = 0
        self.flushed = 0  # bytes handed to writeback so far
        self.digest = ""
        # Small tensors batched into one buffer (see Executor._small): the buffer, the file
        # offset of its first byte, bytes filled, and the source reads still to issue into it.
        self.pend: bytearray | None = None
        self.pend_at = 0
        self.pend_len = 0
        self.pend_reads: list[list[int]] = []  # [file, src offset, buffer offset, length]


class _Writer(threading.Thread):
    """Hashes and writes buffers in queue order; fsyncs and closes finished files.

    Every output file belongs to one writer, so its bytes are hashed and written in file order;
    several writers let the kernel's page-cache copies (the cost that ``cp`` pays too) of
    different files run on different cores.
    """

    def __init__(
        self,
        pool: queue.Queue[bytearray],
        i: int,
        on_done: Callable[[str, int, str], None] | None = None,
    ):
        super().__init__(name=f"shardctl-writer-{i}", daemon=True)
        self.on_done = on_done
        self.q: queue.Queue[tuple[Any, ...] | None] = queue.Queue()
        self.pool = pool
        self.error: BaseException | None = None
        self.stop = False

    def run(self) -> None:
        while True:
            item = self.q.get()
            if item is None:
                return
            try:
                if self.error is None and not self.stop:
                    self._do(item)
            except BaseException as exc:
                self.error = exc
            finally:
                if item[0] == "data" and item[4] is not None:
                    self.pool.put(item[4])

    def _do(self, item: tuple[Any, ...]) -> None:
        if item[0] == "data":
            _, out, offset, mv, _buf = item
            assert offset == out.pos, (out.path, offset, out.pos)
            out.hasher.update(mv)  # the very bytes handed to pwrite, in file order
            done = 0
            while done < len(mv):
                done += os.pwrite(out.fd, mv[done:], offset + done)
            out.pos += len(mv)
            if start_writeback is not None and out.pos - out.flushed >= writeback.EVERY:
                start_writeback(out.fd, out.flushed, out.pos - out.flushed)
                out.flushed = out.pos
            if offset == 0:
                faults.point("shard_started")
        else:
            out = item[1]
            if out.pos != out.file.size:
                raise AssertionError(f"{out.path}: wrote {out.pos} of {out.file.size} bytes")
            out.digest = out.hasher.hexdigest()
            faults.point("shard_written")
            os.fsync(out.fd)
            faults.point("shard_fsynced")
            fd, out.fd = out.fd, -1
            os.close(fd)  # may report a deferred write error (NFS, quotas): still fatal
            if self.on_done is not None:
                self.on_done(out.file.name, out.file.size, out.digest)


class Executor:
    """Writes ``files`` into ``directory`` from ``sources``; one writer thread, bounded buffers."""

    def __init__(
        self,
        directory: Path,
        input_paths: Sequence[Path],
        sources: dict[str, tuple[SourceShard, ...]],
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
        self.pool: queue.Queue[bytearray] = queue.Queue()
        for _ in range(POOL * max(1, writers)):
            self.pool.put(bytearray(block_bytes))
        self.scratch_buf = bytearray(block_bytes)
        self.scratch = np.frombuffer(self.scratch_buf, dtype=np.uint8)
        self.scratch_key: tuple[int, int, int] | None = None
        self.fds: OrderedDict[int, int] = OrderedDict()  # LRU: inputs may be 10 000 files
        self.writers = [_Writer(self.pool, i, on_done) for i in range(max(1, writers))]
        self.cancelled = threading.Event()
        self.outs: list[_Out] = []

    # ---- public --------------------------------------------------------------------------

    def run(self, files: Sequence[OutputFile], max_open: int | None = None) -> dict[str, str]:
        """Write every file, at most ``max_open`` open at once; returns ``name -> digest``."""
        max_open = max_open or _output_fd_budget()
        for w in self.writers:
            w.start()
        try:
            for i in range(0, len(files), max_open):
                self._batch(files[i : i + max_open])
            self._finish()
        finally:
            self.close()
        return {out.file.name: out.digest for out in self.outs}

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

    def _buffer(self, asking: _Out | None = None) -> bytearray:
        """A free buffer; when every buffer is some file's pending batch, the fullest other
        batch is flushed (a batch may go out early: it is always its file's next bytes)."""
        while True:
            self._check()
            try:
                return self.pool.get_nowait()
            except queue.Empty:
                pass
            held = [o for o in self.outs if o.pend is not None and o is not asking]
            if held:
                self._flush(max(held, key=lambda o: o.pend_len))
            try:
                return self.pool.get(timeout=0.2)
            except queue.Empty:
                continue

    def _batch(self, files: Sequence[OutputFile]) -> None:
        outs: list[_Out] = []
        for f in files:
            w = self.writers[len(self.outs) % len(self.writers)]
            outs.append(_Out(self.directory / f.name, f, self.hash_name, w))
            self.outs.append(outs[-1])
        order: dict[str, list[tuple[_Out, LocalTensor]]] = {}
        last: dict[int, str] = {}
        for out in outs:
            out.writer.q.put(("data", out, 0, memoryview(out.file.header), None))
            for t in out.file.tensors:
                order.setdefault(t.fqn, []).append((out, t))
            if out.file.tensors:
                last[id(out)] = out.file.tensors[-1].fqn
        closing: dict[str, list[_Out]] = {}
        for out in outs:
            if id(out) in last:
                closing.setdefault(last[id(out)], []).append(out)
            else:
                self._close(out)
        rank = self.order or {}
        for fqn, targets in sorted(order.items(), key=lambda kv: rank.get(kv[0], -1)):
            big = []
            for out, t in targets:
                boxes = self._small_boxes(t)
                if boxes is not None:
                    self._small(out, t, boxes)
                else:
                    self._flush(out)
                    big.append((out, t))
            gens = [self._tensor(out, t) for out, t in big]
            while gens:
                gens = [g for g in gens if next(g, StopIteration) is not StopIteration]
            for out in closing.get(fqn, []):
                self._close(out)
        self._check()

    def _close(self, out: _Out) -> None:
        self._flush(out)
        out.writer.q.put(("close", out))

    # ---- small tensors: many to a buffer -------------------------------------------------

    def _small_boxes(self, t: LocalTensor) -> list[Box] | None:
        """``t``'s boxes when it can be batched: it fits a block, and so does every source
        local tensor it reads (a gather reads whole source rows into the one-block scratch)."""
        if not 0 < t.nbytes <= self.block:
            return None
        s = itemsize(t.dtype)
        boxes = plan_boxes(t.fqn, t.pieces, self.sources[t.fqn])
        if any(math.prod(b.src.local_shape) * s > self.block for b in boxes):
            return None
        return [
            Box(b.src, *(scalar_shape(x) for x in (b.src_lo, b.dst_lo, b.sizes))) for b in boxes
        ]

    def _small(self, out: _Out, t: LocalTensor, boxes: list[Box]) -> None:
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

    def _issue(self, out: _Out) -> None:
        """Read what ``out``'s pending buffer still waits for."""
        if out.pend is not None and out.pend_reads:
            mv = memoryview(out.pend)
            for file, src, at, n in out.pend_reads:
                self._read(file, src, mv[at : at + n])
        out.pend_reads.clear()

    def _flush(self, out: _Out) -> None:
        """Issue ``out``'s merged reads and hand its pending buffer to the writer."""
        if out.pend is None:
            return
        self._issue(out)
        buf, out.pend = out.pend, None
        mv = memoryview(buf)
        out.writer.q.put(("data", out, out.pend_at, mv[: out.pend_len], buf))
        if self.progress is not None:
            self.progress(out.pend_len)

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
        fd = self._fd(file)
        done = 0
        while done < len(mv):
            n = os.preadv(fd, [mv[done:]], offset + done)
            if n == 0:
                raise EnvironmentFailure(
                    f"input changed during run (short read at byte {offset + done})",
                    where=str(self.input_paths[file]),
                    hint="rerun once the input is stable",
                )
            done += n
        if self.on_read is not None:
            self.on_read(file, offset, mv)

    def _tensor(self, out: _Out, t: LocalTensor) -> Iterator[None]:
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
        out: _Out,
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
        out.writer.q.put(("data", out, offset, mv, buf))
        if self.progress is not None:
            self.progress(nbytes)

    def _fill(
        self,
        mv: memoryview,
        s: int,
        shape: tuple[int, ...],
        lo: tuple[int, ...],
        sz: tuple[int, ...],
        boxes: Sequence[Box],
        batch: _Out | None,
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
