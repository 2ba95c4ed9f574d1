"""Bitwise level, the compare: one task's reads and checks — a block of one tensor against
its SRC image, the padding of a DST shard, a sub-byte tensor as bytes."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from shardctl.blocks import scalar_piece, scalar_shape
from shardctl.checkpoint.source import Source
from shardctl.errors import InvalidInputError
from shardctl.verify.bitwise import plan
from shardctl.verify.bitwise.plan import Tensor, block_hit, fill_image
from shardctl.verify.boxes import FdCache, Scratch, equal, pread_into
from shardctl.verify.dst import DstShard


@dataclass
class Out:
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


class Buffers:
    """The buffers one task reads into; reused, and held until its DST bytes are hashed."""

    def __init__(self) -> None:
        self.image = Scratch()  # the block's SRC image
        self.rows = Scratch()  # the DST rows it needs
        self.copy = Scratch()  # SRC local rows that do not map to whole image rows


class Worker:
    """One thread's files, byte counts and (per task) buffers."""

    def __init__(self) -> None:
        self.fds = FdCache()
        self.gap = Scratch()
        self.src_bytes = 0
        self.dst_bytes = 0
        self.bufs = Buffers()

    def release(self) -> None:
        """Drop the task buffers (the run is over; a hash's tail reads into ``gap``)."""
        self.bufs = Buffers()

    def read(self, path: Path, buf: memoryview, offset: int) -> None:
        pread_into(self.fds(path), buf, offset, path)


def _where(s: DstShard) -> dict[str, Any]:
    return {"fqn": s.fqn, "rank": s.rank, "file": s.path.name}


def shard_key(s: DstShard) -> tuple[Any, ...]:
    return (s.fqn, s.rank, s.path.name, s.begin)


def compare_block(
    t: Tensor, lead: tuple[int, ...], a: int, b: int, w: Worker, out: Out, rows_at: int = 0
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
        hit = block_hit(p, k, lead, a, b)
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
    return (shard_key(shard), _where(shard), "diff", int(diff.sum()), detail)


def check_padding(s: DstShard, kind: type[np.unsignedinteger], w: Worker, out: Out) -> None:
    """Local elements no piece covers must be zero; read only the rows that hold any."""
    shape = scalar_shape(s.local_shape)
    item = np.dtype(kind).itemsize
    row = math.prod(shape[1:])
    rows_per = max(1, plan.BLOCK_BYTES // max(1, row * item))
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
            out.findings.append((shard_key(s), _where(s), "padding", bad, None))


def compare_raw(s: DstShard, src: Source, w: Worker, out: Out) -> None:
    """Sub-byte dtypes: only whole, unsharded tensors, compared as bytes (block by block)."""
    ss = src.shards[s.fqn]
    whole = len(s.pieces) == 1 and s.pieces[0].sizes == s.local_shape
    if not whole or len(ss) != 1 or ss[0].local_shape != s.local_shape:
        message = f"{s.dtype} is sub-byte: only whole tensors can be compared"
        out.findings.append((shard_key(s), _where(s), "message", 0, message))
        return
    src_path = src.files[ss[0].file].path
    for at in range(0, s.nbytes, plan.BLOCK_BYTES):
        n = min(plan.BLOCK_BYTES, s.nbytes - at)
        got = w.bufs.rows.get(n)
        w.read(s.path, got, s.begin + at)
        out.hash_reads.append((s.path, s.begin + at, got))
        expected = w.bufs.image.get(n)
        w.read(src_path, expected, ss[0].begin + at)
        w.src_bytes += n
        w.dst_bytes += n
        if got != expected:
            out.findings.append(
                (shard_key(s), _where(s), "message", 0, "bytes differ from the source")
            )
            return
