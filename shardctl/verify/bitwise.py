"""Level 2, bitwise: every shard of DST equals its region of SRC, bit for bit, streamed.

The work is cut into *blocks* of the global tensors — ``rows`` consecutive indices along one dim
(dim 0 unless one index of it is over ``BLOCK_BYTES``), whole along the dims after it. Each
block is handled once:

1. its SRC image is read once: one ``pread`` per SRC piece straight into the image when the
   piece holds whole rows (an HF source: always), else the piece's local rows and a copy;
2. every DST shard holding part of the block reads its local rows of it (contiguous in its
   file) once, and each of its pieces is compared with its region of the image: ``memcmp``
   when both sides are contiguous, integer numpy views otherwise. Replicas are each compared
   with SRC, so all are identical to it and to each other;
3. where the record gives per-file digests (``hashes``), the DST bytes just read are fed to
   that file's hash in file order — no second read; bytes no block reads (headers,
   alignment, padding) are read into the hash as the gaps go by. A file whose blocks do not
   come in file order (hand-made layouts) is hashed again from the start at the end.

So each SRC byte and each DST byte is read once. Blocks run on up to ``MAX_THREADS`` threads
(reads, ``memcmp``, numpy compares and hashing all release the GIL); the hash updates happen in
block order, by whichever thread finds the hashing free (``_Pipeline``), so a file's hash sees
its bytes in order while the next blocks are already being read. Memory: threads + 2 buffer
sets, each one SRC image (``BLOCK_BYTES``), the DST rows of one block (``DST_CAP_BYTES``) and a
copy buffer — bounded, whatever the model size (about 50 MiB RSS with 2 threads).

Where the time goes (4.2 GB llama, HF -> TP4, page cache warm, 2 cores): reading SRC and DST
costs what ``cat`` costs (~0.9 CPU-s), comparing ~0.3, Python ~0.15, and the record hashes
(XXH3-128, ~27 GB/s a core) ~0.15; a BLAKE3 record (older layouts, ~2.7 GB/s here) ~1.5.

Also checked: local regions no piece covers (vocab padding) are zero. Integer views only (see
``boxes``). A DST shard is reported once: how many of its elements differ, over all its blocks,
and the first (global index, value, source value).
"""

from __future__ import annotations

import heapq
import itertools
import math
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from shardctl import blocks
from shardctl.blocks import scalar_piece, scalar_shape, strides
from shardctl.checkpoint.source import Source
from shardctl.errors import InvalidInputError
from shardctl.layout.types import Piece
from shardctl.verify.boxes import FdCache, Scratch, equal, pread_into, uint_of
from shardctl.verify.dst import Destination, DstShard
from shardctl.verify.result import LevelResult

BLOCK_BYTES = 2 << 20  # SRC image of one block (1, 2, 4 MiB measured: 2 best)
DST_CAP_BYTES = 4 << 20  # DST rows read for one block (replicas each count)
MAX_THREADS = 4
THREADS_ENV = "SHARDCTL_VERIFY_THREADS"


def threads() -> int:
    """Worker threads: ``SHARDCTL_VERIFY_THREADS`` or the usable CPUs, at most ``MAX_THREADS``."""
    env = os.environ.get(THREADS_ENV, "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return max(1, min(MAX_THREADS, cpus))


# -- the plan: parts of tensors, blocks --------------------------------------------------------


@dataclass(frozen=True)
class _Part:
    """One piece of one local tensor (SRC or DST), ready to intersect with blocks."""

    path: Path
    begin: int
    lshape: tuple[int, ...]
    lstrides: tuple[int, ...]
    goff: tuple[int, ...]
    gsize: tuple[int, ...]
    loff: tuple[int, ...]
    ginner: tuple[slice, ...]  # the piece's region of the block image, dims after the block dim
    linner: tuple[slice, ...]  # the same region in the local rows read
    whole_rows: bool  # the inner dims are whole on both sides: local rows = image rows
    owner: int  # index of the local tensor (DST: into _Tensor.dst_shards)


@dataclass
class _Tensor:
    fqn: str
    kind: type[np.unsignedinteger]
    item: int
    shape: tuple[int, ...]
    k: int  # the block dim
    row: int  # elements per index of dim k (product of the dims after it)
    rows_per: int
    src: list[_Part]
    dst: list[_Part]
    dst_shards: list[DstShard]


def _part(
    path: Path,
    begin: int,
    lshape: tuple[int, ...],
    p: Piece,
    k: int,
    gshape: tuple[int, ...],
    owner: int,
) -> _Part:
    lshape = scalar_shape(lshape)
    p = scalar_piece(p)
    inner = range(k + 1, len(gshape))
    ginner = tuple(slice(p.offsets[d], p.offsets[d] + p.sizes[d]) for d in inner)
    linner = tuple(slice(p.local_offsets[d], p.local_offsets[d] + p.sizes[d]) for d in inner)
    whole = all(
        p.offsets[d] == 0 == p.local_offsets[d] and p.sizes[d] == gshape[d] == lshape[d]
        for d in inner
    )
    return _Part(
        path,
        begin,
        lshape,
        strides(lshape),
        p.offsets,
        p.sizes,
        p.local_offsets,
        ginner,
        linner,
        whole,
        owner,
    )


def _hit(p: _Part, k: int, lead: tuple[int, ...], a: int, b: int) -> tuple[int, int, int] | None:
    """(g0, g1, local element offset of the first row) where ``p`` meets the block, or None."""
    at = 0
    for d in range(k):
        i = lead[d] - p.goff[d]
        if not 0 <= i < p.gsize[d]:
            return None
        at += (i + p.loff[d]) * p.lstrides[d]
    g0 = max(a, p.goff[k])
    g1 = min(b, p.goff[k] + p.gsize[k])
    if g0 >= g1:
        return None
    return g0, g1, at + (g0 - p.goff[k] + p.loff[k]) * p.lstrides[k]


def block_dim(shape: tuple[int, ...], item: int) -> int:
    """The dim blocks run along (``blocks.block_dim`` at this level's ``BLOCK_BYTES``)."""
    return blocks.block_dim(shape, item, BLOCK_BYTES)


def src_parts(src: Source, fqn: str, shape: tuple[int, ...], k: int) -> list[_Part]:
    """SRC's pieces of ``fqn``, one per distinct region (replicas are read once)."""
    seen: set[tuple[tuple[int, ...], tuple[int, ...]]] = set()
    parts = []
    for s in src.shards[fqn]:
        for p in map(scalar_piece, s.pieces):
            if (p.offsets, p.sizes) in seen:
                continue
            seen.add((p.offsets, p.sizes))
            parts.append(_part(src.files[s.file].path, s.begin, s.local_shape, p, k, shape, -1))
    return parts


def fill_image(
    parts: list[_Part],
    kind: type[np.unsignedinteger],
    shape: tuple[int, ...],
    k: int,
    block: tuple[tuple[int, ...], int, int],
    raw: memoryview,
    read: Any,
    copy: Scratch,
) -> tuple[np.ndarray, int]:
    """Read the block ``(lead, a, b)`` of a tensor from its ``parts`` into ``raw``: (the image,
    elements filled). A part holding whole rows is read straight into place (one ``pread``);
    any other reads its local rows into ``copy`` and copies its region over."""
    lead, a, b = block
    item = np.dtype(kind).itemsize
    row = math.prod(shape[k + 1 :])
    image = np.frombuffer(raw, dtype=kind).reshape((b - a, *shape[k + 1 :]))
    filled = 0
    for p in parts:
        hit = _hit(p, k, lead, a, b)
        if hit is None:
            continue
        g0, g1, at = hit
        if p.whole_rows:
            read(p.path, raw[(g0 - a) * row * item : (g1 - a) * row * item], p.begin + at * item)
        else:
            buf = copy.get((g1 - g0) * p.lstrides[k] * item)
            read(p.path, buf, p.begin + at * item)
            local = np.frombuffer(buf, dtype=kind).reshape((g1 - g0, *p.lshape[k + 1 :]))
            image[(slice(g0 - a, g1 - a), *p.ginner)] = local[(slice(None), *p.linner)]
        filled += (g1 - g0) * math.prod(p.gsize[k + 1 :])
    return image, filled


def _plan_tensor(
    fqn: str, shape: tuple[int, ...], src: Source, shards: list[DstShard]
) -> _Tensor | None:
    kind = uint_of(shards[0].dtype)
    if kind is None:
        return None
    item = np.dtype(kind).itemsize
    shape = scalar_shape(shape)
    k = block_dim(shape, item)
    row = math.prod(shape[k + 1 :])
    src_parts_ = src_parts(src, fqn, shape, k)
    dst_parts = [
        _part(s.path, s.begin, s.local_shape, p, k, shape, i)
        for i, s in enumerate(shards)
        for p in s.pieces
    ]
    # Rows per block: the image within BLOCK_BYTES, the DST rows it needs within DST_CAP_BYTES.
    events: dict[int, int] = {}
    for key in {(p.owner, p.goff[k], p.gsize[k], p.loff[k]) for p in dst_parts}:
        lrow = math.prod(scalar_shape(shards[key[0]].local_shape)[k + 1 :]) * item
        events[key[1]] = events.get(key[1], 0) + lrow
        events[key[1] + key[2]] = events.get(key[1] + key[2], 0) - lrow
    widest, run = 1, 0
    for at in sorted(events):
        run += events[at]
        widest = max(widest, run)
    rows_per = max(1, min(BLOCK_BYTES // max(1, row * item), DST_CAP_BYTES // widest))
    return _Tensor(fqn, kind, item, shape, k, row, rows_per, src_parts_, dst_parts, shards)


def _blocks(t: _Tensor) -> Iterator[tuple[tuple[int, ...], int, int]]:
    if math.prod(t.shape) == 0:
        return
    for lead in itertools.product(*(range(n) for n in t.shape[: t.k])):
        for a in range(0, t.shape[t.k], t.rows_per):
            yield lead, a, min(t.shape[t.k], a + t.rows_per)


# -- tasks ---------------------------------------------------------------------------------------


@dataclass
class _Out:
    """What one task produced: findings and the DST bytes to hash, in order.

    A finding is ``(shard key, where, kind, count, detail)``: kind ``diff`` (``count`` elements
    differ; ``detail`` the first: index, value, source value, hex width), ``padding``
    (``count`` non-zero elements) or ``message`` (``detail`` the text). The level adds up a
    shard's counts over its blocks and reports each kind once, with the first location.
    """

    findings: list[tuple[tuple[Any, ...], dict[str, Any], str, int, Any]] = field(
        default_factory=list
    )
    hash_reads: list[tuple[Path, int, memoryview]] = field(default_factory=list)


class _Buffers:
    """The buffers one task reads into; reused, and held until its DST bytes are hashed."""

    def __init__(self) -> None:
        self.image = Scratch()  # the block's SRC image
        self.rows = Scratch()  # the DST rows it needs
        self.copy = Scratch()  # SRC local rows that do not map to whole image rows


class _Worker:
    """One thread's files, byte counts and (per task) buffers."""

    def __init__(self) -> None:
        self.fds = FdCache()
        self.gap = Scratch()
        self.src_bytes = 0
        self.dst_bytes = 0
        self.bufs = _Buffers()

    def read(self, path: Path, buf: memoryview, offset: int) -> None:
        pread_into(self.fds(path), buf, offset, path)


def _where(s: DstShard) -> dict[str, Any]:
    return {"fqn": s.fqn, "rank": s.rank, "file": s.path.name}


def _key(s: DstShard) -> tuple[Any, ...]:
    return (s.fqn, s.rank, s.path.name, s.begin)


def _block(
    t: _Tensor, lead: tuple[int, ...], a: int, b: int, w: _Worker, out: _Out, rows_at: int = 0
) -> int:
    """Compare one block; its DST rows go to ``w.bufs.rows`` from byte ``rows_at`` (a batch of
    small tensors keeps each one's rows until they are hashed). Returns the end of its rows."""
    k, item = t.k, t.item
    raw = w.bufs.image.get((b - a) * t.row * item)
    image, filled = fill_image(t.src, t.kind, t.shape, k, (lead, a, b), raw, w.read, w.bufs.copy)
    w.src_bytes += filled * item
    if filled != image.size:
        raise InvalidInputError(
            f"source pieces cover {filled} of {image.size} elements of a block of {t.fqn!r}",
            where=str(t.src[0].path) if t.src else None,
        )
    # DST: per local tensor, the local rows this block needs (ranges merged only where they
    # touch, so each file is read in order), then each piece against its region of the image.
    spans: dict[int, list[list[Any]]] = {}
    for p in t.dst:
        hit = _hit(p, k, lead, a, b)
        if hit is not None:
            g0, g1, at = hit
            spans.setdefault(p.owner, []).append([at, at + (g1 - g0) * p.lstrides[k], p, g0, g1])
    reads: list[tuple[int, int, int, list[list[Any]]]] = []  # owner, start, end, parts
    for owner, hits in spans.items():
        hits.sort(key=lambda h: h[0])
        for h in hits:
            if reads and reads[-1][0] == owner and h[0] <= reads[-1][2]:
                o, s0, e0, parts = reads[-1]
                reads[-1] = (o, s0, max(e0, h[1]), [*parts, h])
            else:
                reads.append((owner, h[0], h[1], [h]))
    total = sum(e - s for _, s, e, _ in reads) * item
    dbuf = w.bufs.rows.get(rows_at + total)[rows_at:]
    pos = 0
    for owner, s0, e0, parts in reads:
        shard = t.dst_shards[owner]
        mv = dbuf[pos : pos + (e0 - s0) * item]
        pos += len(mv)
        w.read(shard.path, mv, shard.begin + s0 * item)
        w.dst_bytes += len(mv)
        out.hash_reads.append((shard.path, shard.begin + s0 * item, mv))
        lrow = parts[0][2].lstrides[k]
        local = np.frombuffer(mv, dtype=t.kind).reshape(
            ((e0 - s0) // lrow, *parts[0][2].lshape[k + 1 :])
        )
        for at, _end, p, g0, g1 in parts:
            r0 = (at - s0) // lrow
            got = local[(slice(r0, r0 + g1 - g0), *p.linner)]
            expected = image[(slice(g0 - a, g1 - a), *p.ginner)]
            if not equal(got, expected):
                origin = (*lead, g0, *(sl.start for sl in p.ginner))
                out.findings.append(_difference(shard, got, expected, origin))
    return rows_at + total


def _difference(
    shard: DstShard, got: np.ndarray, expected: np.ndarray, origin: tuple[int, ...]
) -> tuple[tuple[Any, ...], dict[str, Any], str, int, Any]:
    """A ``diff`` finding: how many elements differ, and the first (global index, values)."""
    diff = got != expected
    first = tuple(int(i) for i in np.argwhere(diff)[0])
    lead = len(origin) - len(first)
    index = [*origin[:lead], *(o + i for o, i in zip(origin[lead:], first, strict=True))]
    detail = (index, int(got[first]), int(expected[first]), got.dtype.itemsize * 2)
    return (_key(shard), _where(shard), "diff", int(diff.sum()), detail)


def _padding(s: DstShard, kind: type[np.unsignedinteger], w: _Worker, out: _Out) -> None:
    """Local elements no piece covers must be zero; read only the rows that hold any."""
    shape = scalar_shape(s.local_shape)
    item = np.dtype(kind).itemsize
    row = math.prod(shape[1:])
    rows_per = max(1, BLOCK_BYTES // max(1, row * item))
    pieces = [scalar_piece(p) for p in s.pieces]
    for a in range(0, shape[0], rows_per):
        b = min(shape[0], a + rows_per)
        mask = np.ones((b - a, *shape[1:]), dtype=bool)
        for p in pieces:
            r0, r1 = max(a, p.local_offsets[0]), min(b, p.local_offsets[0] + p.sizes[0])
            if r0 < r1:
                inner = (
                    slice(lo, lo + n)
                    for lo, n in zip(p.local_offsets[1:], p.sizes[1:], strict=True)
                )
                mask[(slice(r0 - a, r1 - a), *inner)] = False
        if not mask.any():
            continue
        buf = w.bufs.rows.get((b - a) * row * item)
        w.read(s.path, buf, s.begin + a * row * item)
        w.dst_bytes += len(buf)
        chunk = np.frombuffer(buf, dtype=kind).reshape(mask.shape)
        bad = int(np.count_nonzero(chunk[mask]))
        if bad:
            out.findings.append((_key(s), _where(s), "padding", bad, None))


def _raw(s: DstShard, src: Source, w: _Worker, out: _Out) -> None:
    """Sub-byte dtypes: only whole, unsharded tensors, compared as bytes (block by block)."""
    ss = src.shards[s.fqn]
    whole = len(s.pieces) == 1 and s.pieces[0].sizes == s.local_shape
    if not whole or len(ss) != 1 or ss[0].local_shape != s.local_shape:
        message = f"{s.dtype} is sub-byte: only whole tensors can be compared"
        out.findings.append((_key(s), _where(s), "message", 0, message))
        return
    src_path = src.files[ss[0].file].path
    for at in range(0, s.nbytes, BLOCK_BYTES):
        n = min(BLOCK_BYTES, s.nbytes - at)
        got = w.bufs.rows.get(n)
        w.read(s.path, got, s.begin + at)
        out.hash_reads.append((s.path, s.begin + at, got))
        expected = w.bufs.image.get(n)
        w.read(src_path, expected, ss[0].begin + at)
        w.src_bytes += n
        w.dst_bytes += n
        if got != expected:
            out.findings.append((_key(s), _where(s), "message", 0, "bytes differ from the source"))
            return


# -- hashing in file order -----------------------------------------------------------------------


class _Feed:
    """One DST file's hash, fed in file order; gaps between the blocks' reads are read here."""

    def __init__(self, path: Path, name: str) -> None:
        from shardctl.io.checksum import new_hash

        self.path = path
        self.name = name
        self.hasher = new_hash(name)
        self.pos = 0
        self.in_order = True
        self.rehashed = False  # its blocks came out of file order: hashed again from the start

    def feed(self, offset: int, data: memoryview, w: _Worker) -> None:
        if not self.in_order:
            return
        if offset < self.pos:
            self.in_order = False  # hashed again from the start at the end
            return
        if offset > self.pos:
            self._read(w, offset)
        self.hasher.update(data)
        self.pos = offset + len(data)

    def _read(self, w: _Worker, end: int | None) -> None:
        """Hash from ``pos`` to ``end`` (None: to the end of the file)."""
        fd = w.fds(self.path)
        while end is None or self.pos < end:
            want = BLOCK_BYTES if end is None else min(BLOCK_BYTES, end - self.pos)
            buf = w.gap.get(want)
            n = os.preadv(fd, [buf], self.pos)
            if n <= 0:
                if end is None:
                    return
                raise OSError(0, "short read (the file changed during the run)", str(self.path))
            self.hasher.update(buf[:n])
            self.pos += n

    def hexdigest(self, w: _Worker) -> str:
        if not self.in_order:
            from shardctl.io.checksum import new_hash

            self.hasher, self.pos, self.in_order = new_hash(self.name), 0, True
            self.rehashed = True
        self._read(w, None)
        return str(self.hasher.hexdigest())


class _Stopped(Exception):
    """Another thread failed: stop quietly, its error is the one reported."""


class _Pipeline:
    """Buffer sets shared by the threads, and the hashing of their DST bytes in task order.

    A thread takes a free set *before* it takes a task number, reads and compares into it, and
    posts it. Whoever posts then *drains*: if no other thread is hashing, it feeds the posted
    sets' DST bytes to their files' hashes, in task order from the first not yet hashed,
    freeing each set — usually its own task's bytes, still in its cache. A thread never waits
    for its turn: it goes on to the next task, and waits only when every set is posted and
    another thread is hashing them.
    """

    def __init__(self, sets: int, feeds: dict[Path, _Feed]) -> None:
        self.cv = threading.Condition()
        self.hashing = threading.Lock()
        self.feeds = feeds
        self.free = [_Buffers() for _ in range(sets)]
        self.posted: dict[int, tuple[list[tuple[Path, int, memoryview]], _Buffers]] = {}
        self.next = 0
        self.error: BaseException | None = None

    def take(self, w: _Worker) -> _Buffers:
        while True:
            with self.cv:
                if self.error is not None:
                    raise _Stopped
                if self.free:
                    return self.free.pop()
            if not self.drain(w, wait=True):
                with self.cv:
                    if not self.free and self.error is None:
                        self.cv.wait(0.05)

    def give(self, bufs: _Buffers) -> None:
        with self.cv:
            self.free.append(bufs)
            self.cv.notify_all()

    def post(self, i: int, reads: list[tuple[Path, int, memoryview]], bufs: _Buffers) -> None:
        with self.cv:
            self.posted[i] = (reads, bufs)

    def drain(self, w: _Worker, *, wait: bool = False) -> bool:
        """Hash what is posted, in order, unless another thread is at it; True if it hashed."""
        did = False
        while True:
            with self.cv:
                if self.next not in self.posted:
                    return did
            if not self.hashing.acquire(blocking=wait):
                return did
            try:
                while True:
                    with self.cv:
                        if self.error is not None:
                            raise _Stopped
                        item = self.posted.pop(self.next, None)
                    if item is None:
                        break
                    for path, offset, data in item[0]:
                        feed = self.feeds.get(path)
                        if feed is not None:
                            feed.feed(offset, data, w)
                    did = True
                    with self.cv:
                        self.next += 1
                        self.free.append(item[1])
                        self.cv.notify_all()
            finally:
                self.hashing.release()
            wait = False  # loop: a set posted while this thread held the lock is hashed too

    def stop(self, exc: BaseException) -> None:
        with self.cv:
            if self.error is None:
                self.error = exc
            self.cv.notify_all()


# -- the level -----------------------------------------------------------------------------------


def check_bitwise(src: Source, dst: Destination, *, hashes: bool = True) -> LevelResult:
    """Compare every DST shard with SRC; ``hashes``: also check each file's recorded hash."""
    level = LevelResult("bitwise")
    t0 = time.perf_counter()
    ordered = sorted(
        (s for ss in dst.shards.values() for s in ss if s.fqn in src.shards),
        key=lambda s: (str(s.path), s.begin),
    )
    by_fqn: dict[str, list[DstShard]] = {}
    for s in ordered:
        by_fqn.setdefault(s.fqn, []).append(s)
    by_fqn = {fqn: by_fqn[fqn] for fqn in _file_order(ordered)}
    per_tensor: dict[str, dict[str, Any]] = {}
    padded = 0
    for fqn, shards in by_fqn.items():
        per_tensor[fqn] = {
            "shards": len(shards),
            "bytes": sum(s.nbytes for s in shards),
            "status": "pass",
        }
        padded += sum(
            1
            for s in shards
            if sum(scalar_piece(p).numel for p in s.pieces) < math.prod(s.local_shape)
        )
    hash_name = dst.record.hash if dst.record and hashes else None
    feeds: dict[Path, _Feed] = {}
    if hash_name and dst.record is not None:
        digests = {f.name: f.digest for f in dst.record.files if f.digest}
        feeds = {p: _Feed(p, hash_name) for p in dst.files if p.name in digests}

    shapes = {t.fqn: t.shape for t in src.model.tensors}

    def tasks() -> Iterator[tuple[Any, ...]]:
        # Tensors of one block or less are batched, up to a block of SRC bytes, into one task:
        # at 90,000 tensors one task (and one hand-off to the hashing) per tensor cost more
        # than reading them.
        batch: list[tuple[Any, ...]] = []
        size = 0
        for fqn, shards in by_fqn.items():
            t = _plan_tensor(fqn, shapes[fqn], src, shards)
            if t is None:
                if batch:
                    yield ("blocks", batch)
                    batch, size = [], 0
                for s in shards:
                    yield ("raw", s)
                continue
            blocks = list(itertools.islice(_blocks(t), 2))
            padded = [
                s
                for s in shards
                if sum(scalar_piece(p).numel for p in s.pieces)
                < math.prod(scalar_shape(s.local_shape))
            ]
            if len(blocks) == 1 and not padded:
                nbytes = math.prod(t.shape) * t.item
                if batch and size + nbytes > BLOCK_BYTES:
                    yield ("blocks", batch)
                    batch, size = [], 0
                batch.append((t, *blocks[0]))
                size += nbytes
                continue
            if batch:
                yield ("blocks", batch)
                batch, size = [], 0
            for lead, a, b in _blocks(t):
                yield ("block", t, lead, a, b)
            for s in padded:
                yield ("padding", s, t.kind)
        if batch:
            yield ("blocks", batch)

    workers, results = _run(tasks(), src, feeds)
    compared = {_key(s): sum(scalar_piece(p).numel for p in s.pieces) for s in ordered}
    for message, where in _findings(results, compared):
        level.fail(message, **where)
        per_tensor[where["fqn"]]["status"] = "fail"
    if feeds and dst.record is not None:
        digests = {f.name: f.digest for f in dst.record.files}
        for path, feed in feeds.items():
            if feed.hexdigest(workers[0]) != digests[path.name]:
                level.fail(
                    f"{hash_name} differs from the record: the file is not what reshard wrote",
                    file=path.name,
                )
    for w in workers:
        w.fds.close()
    seconds = time.perf_counter() - t0
    src_bytes = sum(w.src_bytes for w in workers)
    dst_bytes = sum(w.dst_bytes for w in workers)
    level.figures.update(
        tensors=len(per_tensor),
        shards=len(ordered),
        padded_shards=padded,
        src_bytes=src_bytes,
        dst_bytes=dst_bytes,
        hash=hash_name,
        rehashed_files=sum(f.rehashed for f in feeds.values()),
        threads=len(workers),
        seconds=seconds,
        throughput_mb_s=(src_bytes + dst_bytes) / seconds / 1e6 if seconds > 0 else None,
    )
    level.rows = [{"fqn": k, **v} for k, v in per_tensor.items()]
    level.seconds = seconds
    return level.close()


def _file_order(ordered: list[DstShard]) -> list[str]:
    """The tensors in an order every DST file agrees with (each file's blocks then come in
    file order, so its hash is fed as it is read): a topological sort of "``a`` comes before
    ``b`` in some file", ties by first appearance. Where files disagree (a cycle), the earliest
    tensor left goes next; those files are hashed again at the end."""
    first: dict[str, int] = {}
    files: dict[Path, list[str]] = {}
    for i, s in enumerate(ordered):  # sorted by (path, begin)
        first.setdefault(s.fqn, i)
        files.setdefault(s.path, []).append(s.fqn)
    after: dict[str, set[str]] = {f: set() for f in first}
    before = dict.fromkeys(first, 0)
    for seq in files.values():
        for a, b in itertools.pairwise(seq):
            if a != b and b not in after[a]:
                after[a].add(b)
                before[b] += 1
    ready = [(first[f], f) for f, n in before.items() if n == 0]
    heapq.heapify(ready)
    out: list[str] = []
    done: set[str] = set()
    while len(out) < len(first):
        if not ready:  # a cycle: take the earliest tensor not placed yet
            f = min((f for f in first if f not in done), key=first.__getitem__)
            before[f] = 0
            heapq.heappush(ready, (first[f], f))
        _, f = heapq.heappop(ready)
        if f in done:
            continue
        done.add(f)
        out.append(f)
        for g in after[f]:
            before[g] -= 1
            if before[g] == 0 and g not in done:
                heapq.heappush(ready, (first[g], g))
    return out


def _findings(
    results: list[tuple[int, tuple[Any, ...], dict[str, Any], str, int, Any]],
    compared: dict[tuple[Any, ...], int],
) -> list[tuple[str, dict[str, Any]]]:
    """One message per shard and kind, in task order: counts added up over the blocks."""
    first: dict[tuple[Any, ...], list[Any]] = {}
    for _, key, where, kind, count, detail in sorted(results, key=lambda r: r[0]):
        entry = first.setdefault((key, kind), [where, 0, detail])
        entry[1] += count
    out = []
    for (key, kind), (where, count, detail) in first.items():
        if kind == "diff":
            index, got, expected, width = detail
            message = (
                f"{count} of {compared[key]} elements differ from the source (first at "
                f"{index}: 0x{got:0{width}x}, source 0x{expected:0{width}x})"
            )
        elif kind == "padding":
            message = f"padding not zero ({count} elements)"
        else:
            message = str(detail)
        out.append((message, where))
    return out


def _run(
    tasks: Iterator[tuple[Any, ...]], src: Source, feeds: dict[Path, _Feed]
) -> tuple[list[_Worker], list[tuple[int, tuple[Any, ...], dict[str, Any], str, int, Any]]]:
    """Run the tasks on ``threads()`` threads (this one included); findings tagged by task
    number. Returns the workers (byte counts)."""
    lock = threading.Lock()
    numbered = enumerate(tasks)
    n = threads()
    pipe = _Pipeline(n + 2, feeds)
    results: list[tuple[int, tuple[Any, ...], dict[str, Any], str, int, Any]] = []
    workers = [_Worker() for _ in range(n)]

    def work(w: _Worker) -> None:
        try:
            while True:
                w.bufs = pipe.take(w)
                with lock:
                    nxt = next(numbered, None) if pipe.error is None else None
                if nxt is None:
                    pipe.give(w.bufs)
                    return
                i, task = nxt
                out = _Out()
                if task[0] == "block":
                    _block(task[1], task[2], task[3], task[4], w, out)
                elif task[0] == "blocks":
                    at = 0
                    for t, lead, a, b in task[1]:
                        at = _block(t, lead, a, b, w, out, at)
                elif task[0] == "padding":
                    _padding(task[1], task[2], w, out)
                else:
                    _raw(task[1], src, w, out)
                if out.findings:
                    with lock:
                        results.extend((i, *f) for f in out.findings)
                if feeds:
                    pipe.post(i, out.hash_reads, w.bufs)
                    pipe.drain(w)
                else:
                    pipe.give(w.bufs)
        except _Stopped:
            return
        except BaseException as exc:
            pipe.stop(exc)
            raise

    errors: list[BaseException] = []

    def thread(w: _Worker) -> None:
        try:
            work(w)
        except BaseException as exc:  # re-raised on the calling thread
            errors.append(exc)

    helpers = [threading.Thread(target=thread, args=(w,), daemon=True) for w in workers[1:]]
    for h in helpers:
        h.start()
    try:
        work(workers[0])
    except BaseException as exc:
        pipe.stop(exc)
        raise
    finally:
        for h in helpers:
            h.join()
    if errors:
        raise errors[0]
    if feeds:
        pipe.drain(workers[0], wait=True)  # whatever the last threads posted
    return workers, results
