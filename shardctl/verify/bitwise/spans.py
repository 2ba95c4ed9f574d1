"""Bitwise level, spans: many small tensors checked with a few large reads and compares.

At 90,000 tensors (MoE experts of a few KiB each) the per-block path cost ~0.3 ms per tensor
in Python: plan, image, one ``pread`` per shard. Most such tensors are *plain*: one whole
source tensor, and DST shards that are each one box of it with no padding. A *span* is a run
of plain tensors adjacent in one SRC file (at most ``plan.BLOCK_BYTES``), taken in the order
every DST file agrees with. Its task reads the SRC bytes once, reads each DST file's shards of those
tensors in as few ``pread``s as they are adjacent, and compares shards of one geometry (same
global shape, box and dtype: expert ``w1`` halves, say) placed at a constant stride on both
sides as *one* strided numpy view — a few compares per span instead of one per shard.

A box need not be contiguous in SRC (a rowwise ``S(1)`` half is strided): the view slices it.
A batch that differs is checked again shard by shard, to name each shard and its first
differing element, exactly as the per-block path would.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from shardctl.blocks import strides
from shardctl.verify.bitwise import plan
from shardctl.verify.bitwise.compare import Out, Worker, _difference
from shardctl.verify.boxes import equal, uint_of
from shardctl.verify.dst import DstShard

ENABLED = True  # off: every tensor takes the per-block path (tests compare the two)
# A batch of boxes this size or more is copied box by box (see ``_fill_batch``).
DIRECT_BYTES = 32 * 2**10


def span_caps() -> tuple[int, int]:
    """(SRC bytes, DST bytes) of one span task, replicas each counting on the DST side; (0, 0)
    when spans are off. Read at run time: tests shrink ``plan.BLOCK_BYTES``."""
    return (plan.BLOCK_BYTES, 4 * plan.BLOCK_BYTES) if ENABLED else (0, 0)


@dataclass
class Span:
    """Plain tensors adjacent in SRC file ``path`` from byte ``begin`` to ``end``, and the DST
    shards that hold them: ``(shard, byte offset of its tensor in the span)``."""

    path: Path
    begin: int
    end: int
    shards: list[tuple[DstShard, int, tuple[int, ...]]]  # shard, offset in span, global shape
    dst_bytes: int = 0


def compare_span(span: Span, w: Worker, out: Out) -> None:
    """Read the span's SRC bytes and its DST shards; compare them batch by batch."""
    n = span.end - span.begin
    src = w.bufs.image.get(n)
    w.read(span.path, src, span.begin)
    w.src_bytes += n
    # DST: per file, shards sorted by offset; adjacent shards read in one pread. Files are told
    # apart by their Path object's id: hashing a Path per shard costs more than the compare.
    by_file: dict[int, list[tuple[DstShard, int, tuple[int, ...]]]] = {}
    for item in span.shards:
        k = id(item[0].path)
        items = by_file.get(k)
        if items is None:
            items = by_file[k] = []
        items.append(item)
    runs: list[list[Any]] = []  # [path, begin, end, items]
    for items in by_file.values():
        items.sort(key=_begin)
        run: list[Any] = []
        for it in items:
            s = it[0]
            if run and run[2] == s.begin:
                run[3].append(it)
                run[2] = s.begin + s.nbytes
            else:
                run = [s.path, s.begin, s.begin + s.nbytes, [it]]
                runs.append(run)
    total = sum(e - b for _, b, e, _ in runs)
    dst = w.bufs.rows.get(total)
    # batches: shards of one geometry; key -> [(src offset, dst offset in dst buffer, shard)]
    batches: dict[tuple[Any, ...], list[tuple[int, int, DstShard]]] = {}
    pos = 0
    for path, b, e, items in runs:
        mv = dst[pos : pos + e - b]
        w.read(path, mv, b)
        w.dst_bytes += e - b
        out.hash_reads.append((path, b, mv))
        base = pos - b
        for s, at, shape in items:
            p = s.pieces[0]
            key = (s.dtype, shape, p.offsets, p.sizes)
            members = batches.get(key)
            if members is None:
                members = batches[key] = []
            members.append((at, base + s.begin, s))
        pos += e - b
    src_u8 = np.frombuffer(src, dtype=np.uint8)
    dst_u8 = np.frombuffer(dst, dtype=np.uint8)
    # What DST should hold, built from SRC with one strided gather per batch (every DST byte
    # read belongs to exactly one shard), then one memcmp; only a span that differs is
    # compared batch by batch to name the shards.
    expected = np.frombuffer(w.bufs.copy.get(total), dtype=np.uint8)
    for (dtype, shape, offsets, sizes), members in batches.items():
        kind = uint_of(dtype)
        assert kind is not None  # level._plain checked it
        _fill_batch(src_u8, expected, kind, shape, offsets, sizes, members)
    if equal(dst_u8, expected):
        return
    for (dtype, shape, offsets, sizes), members in batches.items():
        _compare_batch(src_u8, dst_u8, uint_of(dtype), shape, offsets, sizes, members, out)


def _begin(item: tuple[DstShard, int, tuple[int, ...]]) -> int:
    return item[0].begin


def _fill_batch(
    src: np.ndarray,
    expected: np.ndarray,
    kind: Any,
    shape: tuple[int, ...],
    offsets: tuple[int, ...],
    sizes: tuple[int, ...],
    members: list[tuple[int, int, DstShard]],
) -> None:
    """Copy each member's box of SRC to where DST holds it, in ``expected``:

    - members at constant strides on both sides: one strided copy of them all;
    - else small boxes: one gather of every member's box through a strided view of SRC (a view
      with a row per possible start byte, indexed by the members' starts), one scatter into
      ``expected`` — two numpy calls, however many members;
    - else (boxes of ``DIRECT_BYTES`` or more, or one member): box by box, one copy each.

    The gather works on bytes: the last dim is ``sizes[-1] · item`` byte columns, so the view
    takes any start byte whatever the dtype."""
    n = len(members)
    step = _regular(members)
    if step is not None:
        s_step, d_step = step
        whole = tuple(slice(o, o + z) for o, z in zip(offsets, sizes, strict=True))
        regular = _view(expected, members[0][1], n, d_step, kind, sizes)
        regular[...] = _view(src, members[0][0], n, s_step, kind, shape)[(slice(None), *whole)]
        return
    item = np.dtype(kind).itemsize
    tensor_strides = [x * item for x in strides(shape)]
    origin = sum(o * x for o, x in zip(offsets, tensor_strides, strict=True))
    box = (*sizes[:-1], sizes[-1] * item)
    span = sum((z - 1) * x for z, x in zip(sizes[:-1], tensor_strides[:-1], strict=True))
    span += sizes[-1] * item
    local = math.prod(box)
    if n == 1 or local >= DIRECT_BYTES:
        # one copy per member, straight from SRC: large boxes gain nothing from a gather
        # (it would copy them twice, through a temporary)
        for s_at, d_at, _ in members:
            one = _strided(src, s_at + origin, box, tensor_strides)
            expected[d_at : d_at + local].reshape(box)[...] = one
        return
    rows = _strided(src, 0, (len(src) - span + 1, *box), [1, *tensor_strides])
    got = rows[np.fromiter((m[0] for m in members), np.intp, n) + origin]
    into = _strided(expected, 0, (len(expected) - local + 1, local), [1, 1])
    into[np.fromiter((m[1] for m in members), np.intp, n)] = got.reshape(n, local)


def _strided(buf: np.ndarray, offset: int, shape: tuple[int, ...], steps: list[int]) -> np.ndarray:
    """A byte view of ``buf`` from ``offset``: ``shape``, the last dim's step 1 byte, the others
    ``steps`` (a trailing step for the last dim is ignored). No copy."""
    return np.ndarray(
        shape=shape,
        dtype=np.uint8,
        buffer=buf,
        offset=offset,
        strides=(*steps[: len(shape) - 1], 1),
    )


def _regular(members: list[tuple[int, int, DstShard]]) -> tuple[int, int] | None:
    """(SRC step, DST step) when the members sit at constant strides on both sides."""
    n = len(members)
    if n < 2:
        return None
    s_step = members[1][0] - members[0][0]
    d_step = members[1][1] - members[0][1]
    if s_step <= 0 or d_step <= 0:
        return None
    for i in range(2, n):
        if (
            members[i][0] - members[i - 1][0] != s_step
            or members[i][1] - members[i - 1][1] != d_step
        ):
            return None
    return s_step, d_step


def _compare_batch(
    src: np.ndarray,
    dst: np.ndarray,
    kind: Any,
    shape: tuple[int, ...],
    offsets: tuple[int, ...],
    sizes: tuple[int, ...],
    members: list[tuple[int, int, DstShard]],
    out: Out,
) -> None:
    item = np.dtype(kind).itemsize
    gbytes = math.prod(shape) * item
    lbytes = math.prod(sizes) * item
    box = tuple(slice(o, o + z) for o, z in zip(offsets, sizes, strict=True))
    step = _regular(members)
    if step is not None:
        n = len(members)
        got = _view(dst, members[0][1], n, step[1], kind, sizes)
        whole = _view(src, members[0][0], n, step[0], kind, shape)
        if equal(got, whole[(slice(None), *box)]):
            return
    for s_at, d_at, shard in members:  # one at a time: alone, irregular, or to name a diff
        got1 = dst[d_at : d_at + lbytes].view(kind).reshape(sizes)
        expected = src[s_at : s_at + gbytes].view(kind).reshape(shape)[box]
        if not equal(got1, expected):
            out.findings.append(_difference(shard, got1, expected, offsets))


def _view(
    buf: np.ndarray, first: int, n: int, step: int, kind: Any, shape: tuple[int, ...]
) -> np.ndarray:
    """``n`` arrays of ``shape`` starting every ``step`` bytes from byte ``first`` of ``buf``,
    as one ``(n, *shape)`` array (no copy)."""
    item = np.dtype(kind).itemsize
    strides = [item]
    for d in reversed(shape[1:]):
        strides.insert(0, strides[0] * d)
    return np.ndarray(
        shape=(n, *shape), dtype=kind, buffer=buf, offset=first, strides=(step, *strides)
    )
