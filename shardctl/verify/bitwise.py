"""Level 2, bitwise: every shard of DST equals its region of SRC, bit for bit, streamed.

Each DST file is read once, front to back, in chunks of at most ``CHUNK_BYTES`` local rows;
every byte goes through the record's hash (``blake3`` or ``sha256``: a file that differs from
what reshard wrote is named even where its tensors still compare equal), and every piece of a
chunk is compared with the same box of SRC, read with ``os.pread`` (SRC may itself be sharded:
the box is assembled from its pieces). Integer views only (see ``boxes``). Also checked:

- local regions no piece covers (vocab padding) are zero;
- replicas: each is compared with SRC on its own, so all are identical to it and each other.

Memory stays bounded by two chunks (DST rows and the SRC box), whatever the model size.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from shardctl.layout.types import Piece
from shardctl.reshard.source import Source, SourceShard
from shardctl.verify.boxes import Scratch, equal, pread_into, read_box, uint_of
from shardctl.verify.dst import Destination, DstShard
from shardctl.verify.result import LevelResult

CHUNK_BYTES = 2 * 2**20  # small enough to compare and hash while in cache


class _Fds:
    def __init__(self) -> None:
        self._fds: dict[Path, int] = {}

    def __call__(self, path: Path) -> int:
        fd = self._fds.get(path)
        if fd is None:
            fd = self._fds[path] = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        return fd

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


@contextmanager
def _fds() -> Iterator[_Fds]:
    f = _Fds()
    try:
        yield f
    finally:
        f.close()


def _scalar(p: Piece) -> Piece:
    return p if p.sizes else Piece((0,), (1,), (0,))


class _SourceBoxes:
    """Boxes of SRC's global tensors, from whichever of its pieces hold them."""

    def __init__(self, src: Source, fds: _Fds) -> None:
        self.src = src
        self.fds = fds
        self.bytes_read = 0
        self.scratch = Scratch()  # SRC boxes

    def box(
        self,
        fqn: str,
        offsets: tuple[int, ...],
        sizes: tuple[int, ...],
        kind: type[np.unsignedinteger],
    ) -> np.ndarray:
        """The box of SRC: a view into scratch when one SRC piece holds all of it."""
        shards = self.src.shards[fqn]
        if len(shards) == 1 and len(shards[0].pieces) == 1:
            piece = _scalar(shards[0].pieces[0])
            spans = zip(offsets, sizes, piece.offsets, piece.sizes, strict=True)
            if all(p <= o and o + s <= p + n for o, s, p, n in spans):
                return self._read(shards[0], piece, offsets, sizes, kind, self.scratch)
        out = np.zeros(sizes, dtype=kind)
        need = math.prod(sizes)
        filled = 0
        seen: set[tuple[tuple[int, ...], tuple[int, ...]]] = set()
        for shard in self.src.shards[fqn]:
            for piece in map(_scalar, shard.pieces):
                if (piece.offsets, piece.sizes) in seen:
                    continue  # a replica of a box already read
                lo = [max(a, b) for a, b in zip(offsets, piece.offsets, strict=True)]
                hi = [
                    min(a + s, b + t)
                    for a, s, b, t in zip(offsets, sizes, piece.offsets, piece.sizes, strict=True)
                ]
                if any(h <= low for low, h in zip(lo, hi, strict=True)):
                    continue
                seen.add((piece.offsets, piece.sizes))
                part = self._read(
                    shard,
                    piece,
                    tuple(lo),
                    tuple(h - lw for lw, h in zip(lo, hi, strict=True)),
                    kind,
                )
                at = tuple(slice(lw - o, h - o) for lw, h, o in zip(lo, hi, offsets, strict=True))
                out[at] = part
                filled += part.size
        if filled < need:
            raise ValueError(f"source pieces cover {filled} of {need} elements of the box")
        return out

    def _read(
        self,
        shard: SourceShard,
        piece: Piece,
        lo: tuple[int, ...],
        sizes: tuple[int, ...],
        kind: type[np.unsignedinteger],
        scratch: Scratch | None = None,
    ) -> np.ndarray:
        local = tuple(
            lo_ - o + lo_off
            for lo_, o, lo_off in zip(lo, piece.offsets, piece.local_offsets, strict=True)
        )
        shape = shard.local_shape or (1,)
        path = self.src.files[shard.file].path
        arr = read_box(self.fds(path), shard.begin, shape, kind, local, sizes, scratch)
        self.bytes_read += arr.nbytes
        return arr


class _HashFeed:
    """Hash a file's bytes in order on a second thread while the main thread compares.

    Two DST buffers alternate: a chunk is compared while the previous one is hashed; a buffer
    is reused only once its hash update has finished. ``name`` None: no hashing.
    """

    def __init__(self, name: str | None) -> None:
        from shardctl.reshard.copy import new_hash

        self.hasher = new_hash(name) if name else None
        self.pool = ThreadPoolExecutor(1) if name else None
        self.bufs = (Scratch(), Scratch())
        self.pending: list[Future[None] | None] = [None, None]
        self.turn = 0

    def buffer(self, nbytes: int) -> tuple[memoryview, int]:
        i = self.turn
        self.turn ^= 1
        done = self.pending[i]
        if done is not None:
            done.result()
        return self.bufs[i].get(nbytes), i

    def feed(self, data: bytes | memoryview, turn: int | None = None) -> None:
        if self.pool is None:
            return
        future = self.pool.submit(self.hasher.update, data)  # type: ignore[union-attr]
        if turn is not None:
            self.pending[turn] = future

    def hexdigest(self) -> str | None:
        if self.pool is None:
            return None
        self.pool.shutdown(wait=True)
        return str(self.hasher.hexdigest())  # type: ignore[union-attr]


def check_bitwise(src: Source, dst: Destination, *, hashes: bool = True) -> LevelResult:
    """Compare every DST shard with SRC; ``hashes``: also check each file's recorded hash."""
    level = LevelResult("bitwise")
    t0 = time.perf_counter()
    by_file: dict[Path, list[DstShard]] = {}
    for shards in dst.shards.values():
        for s in shards:
            if s.fqn in src.shards:
                by_file.setdefault(s.path, []).append(s)
    digests = {f.name: f.digest for f in dst.record.files} if dst.record else {}
    hash_name = dst.record.hash if dst.record and hashes else None
    stats: dict[str, int] = {"dst_bytes": 0, "shards": 0, "padded_shards": 0}
    per_tensor: dict[str, dict[str, Any]] = {}
    with _fds() as fds:
        boxes = _SourceBoxes(src, fds)
        for path in sorted(by_file):
            shards = sorted(by_file[path], key=lambda s: s.begin)
            want = digests.get(path.name) if hash_name else None
            got = _stream_file(
                level, path, shards, boxes, fds, stats, per_tensor, hash_name if want else None
            )
            if want and got != want:
                level.fail(
                    f"{hash_name} differs from the record: the file is not what reshard wrote",
                    file=path.name,
                )
    seconds = time.perf_counter() - t0
    total = boxes.bytes_read + stats["dst_bytes"]
    level.figures.update(
        tensors=len(per_tensor),
        shards=stats["shards"],
        padded_shards=stats["padded_shards"],
        src_bytes=boxes.bytes_read,
        dst_bytes=stats["dst_bytes"],
        hash=hash_name,
        seconds=seconds,
        throughput_mb_s=total / seconds / 1e6 if seconds > 0 else None,
    )
    level.rows = [{"fqn": k, **v} for k, v in per_tensor.items()]
    level.seconds = seconds
    return level.close()


def _stream_file(
    level: LevelResult,
    path: Path,
    shards: list[DstShard],
    boxes: _SourceBoxes,
    fds: _Fds,
    stats: dict[str, int],
    per_tensor: dict[str, dict[str, Any]],
    hash_name: str | None,
) -> str | None:
    fd = fds(path)
    hasher = _HashFeed(hash_name)
    pos = 0
    for s in shards:
        if hash_name and s.begin > pos:
            hasher.feed(os.pread(fd, s.begin - pos, pos))
        row = per_tensor.setdefault(s.fqn, {"shards": 0, "bytes": 0, "status": "pass"})
        row["shards"] += 1
        row["bytes"] += s.nbytes
        ok = _compare_shard(level, s, boxes, fd, hasher)
        if not ok:
            row["status"] = "fail"
        stats["shards"] += 1
        stats["dst_bytes"] += s.nbytes
        if sum(p.numel for p in s.pieces) < math.prod(s.local_shape):
            stats["padded_shards"] += 1
        pos = s.begin + s.nbytes
    size = os.fstat(fd).st_size
    while hash_name and pos < size:
        block = os.pread(fd, min(CHUNK_BYTES, size - pos), pos)
        if not block:
            break
        hasher.feed(block)
        pos += len(block)
    return hasher.hexdigest()


def _compare_shard(
    level: LevelResult, s: DstShard, boxes: _SourceBoxes, fd: int, hasher: _HashFeed
) -> bool:
    kind = uint_of(s.dtype)
    where = {"fqn": s.fqn, "rank": s.rank, "file": s.path.name}
    if kind is None:
        return _compare_raw(level, s, boxes, fd, hasher, where)
    shape = s.local_shape or (1,)
    pieces = [_scalar(p) for p in s.pieces]
    item = np.dtype(kind).itemsize
    row_elems = math.prod(shape[1:])
    rows_per = max(1, CHUNK_BYTES // max(1, row_elems * item))
    padded = sum(p.numel for p in pieces) < math.prod(shape)
    ok = True
    for a in range(0, shape[0], rows_per):
        b = min(shape[0], a + rows_per)
        raw, turn = hasher.buffer((b - a) * row_elems * item)
        pread_into(fd, raw, s.begin + a * row_elems * item)
        hasher.feed(raw, turn)
        chunk = np.frombuffer(raw, dtype=kind).reshape((b - a, *shape[1:]))
        mask = np.ones(chunk.shape, dtype=bool) if padded else None
        for p in pieces:
            lo0, n0 = p.local_offsets[0], p.sizes[0]
            r0, r1 = max(a, lo0), min(b, lo0 + n0)
            if r0 >= r1:
                continue
            inner = zip(p.local_offsets[1:], p.sizes[1:], strict=True)
            local = (slice(r0 - a, r1 - a), *(slice(lo, lo + n) for lo, n in inner))
            offsets = (p.offsets[0] + r0 - lo0, *p.offsets[1:])
            sizes = (r1 - r0, *p.sizes[1:])
            if mask is not None:
                mask[local] = False
            if not ok:
                continue  # one finding per shard; keep hashing the rest
            expected = boxes.box(s.fqn, offsets, sizes, kind)
            got = chunk[local]
            if not equal(got, expected):
                ok = False
                _report(level, got, expected, offsets, kind, where)
        if mask is not None and ok and chunk[mask].any():
            ok = False
            level.fail(f"padding not zero ({int(np.count_nonzero(chunk[mask]))} elements)", **where)
    return ok


def _report(
    level: LevelResult,
    got: np.ndarray,
    expected: np.ndarray,
    offsets: tuple[int, ...],
    kind: type[np.unsignedinteger],
    where: dict[str, Any],
) -> None:
    diff = got != expected
    first = tuple(int(i) for i in np.argwhere(diff)[0])
    index = [o + i for o, i in zip(offsets, first, strict=True)]
    width = np.dtype(kind).itemsize * 2
    level.fail(
        f"{int(diff.sum())} of {diff.size} elements differ from the source (first at "
        f"{index}: 0x{int(got[first]):0{width}x}, source 0x{int(expected[first]):0{width}x})",
        **where,
    )


def _compare_raw(
    level: LevelResult,
    s: DstShard,
    boxes: _SourceBoxes,
    fd: int,
    hasher: _HashFeed,
    where: dict[str, Any],
) -> bool:
    """Sub-byte dtypes: only whole, unsharded tensors, compared as bytes."""
    raw = os.pread(fd, s.nbytes, s.begin)
    hasher.feed(raw)
    src = boxes.src.shards[s.fqn]
    whole = len(s.pieces) == 1 and s.pieces[0].sizes == s.local_shape
    if not whole or len(src) != 1 or src[0].local_shape != s.local_shape:
        level.fail(f"{s.dtype} is sub-byte: only whole tensors can be compared", **where)
        return False
    fd_src = boxes.fds(boxes.src.files[src[0].file].path)
    expected = os.pread(fd_src, len(raw), src[0].begin)
    boxes.bytes_read += len(expected)
    if raw != expected:
        level.fail("bytes differ from the source", **where)
        return False
    return True
