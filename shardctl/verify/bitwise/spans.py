"""Bitwise level, spans: many small tensors checked with a few large reads and compares.

At 90,000 tensors (MoE experts of a few KiB each) the per-block path cost ~0.3 ms per tensor
in Python: plan, image, one ``pread`` per shard. Most such tensors are *plain*: SRC holds each
as rectangular shards (one whole tensor in an HF checkpoint, or ``tp``/``ep`` slices of a
sharded layout), each one box filling its local tensor, and so does DST. Every DST shard is
then filled by a few *parts*, each one box of one SRC shard (:func:`geometry`, worked out once
per kind of tensor: its shape and both sides' boxes).

A *span* is a run of plain tensors, taken in the order every DST file agrees with, whose SRC
shards lie back to back in each SRC file they use (at most ``plan.BLOCK_BYTES`` in all). Its
task reads each SRC file's stretch once, reads each DST file's shards of those tensors in as
few ``pread``s as they are adjacent, builds what DST should hold from SRC — parts of one
geometry (same SRC shape and box, same DST shape and box, one dtype: expert ``w1`` halves,
say) placed at a constant stride on both sides are *one* strided numpy copy — and compares the
two with one ``memcmp``.

A box need not be contiguous in SRC (a rowwise ``S(1)`` half is strided): the views slice it.
A span that differs is checked again shard by shard, to name each shard and its first
differing element, exactly as the per-block path would.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from shardctl.blocks import strides
from shardctl.verify.bitwise import plan
from shardctl.verify.bitwise.compare import Out, Worker, _difference
from shardctl.verify.bitwise.walk import Sizes
from shardctl.verify.boxes import equal, uint_of
from shardctl.verify.dst import DstShard

ENABLED = True  # off: every tensor takes the per-block path (tests compare the two)
# A batch of boxes this size or more is copied box by box (see ``_fill_batch``).
DIRECT_BYTES = 32 * 2**10
# DST parts in one span, at most (plus one tensor's): 2 MiB of FP8 block scales split tp 8 are
# 130,000 shards of 16 B, ~30 MB of objects per span and three spans in flight (each thread's
# and one hashing): a verify of 100,000 tensors peaked at 330 MiB.
SPAN_PARTS = 8192
# Kinds of tensor (``geometry``) remembered before the cache is cleared.
KINDS = 4096

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (global offsets, sizes)
# One part of a DST shard: (index of the SRC shard, offsets in its local tensor, offsets in
# the DST local tensor, sizes).
PartGeometry = tuple[int, tuple[int, ...], tuple[int, ...], tuple[int, ...]]
# One SRC shard a span reads: (file index, path, first byte, bytes, local shape).
Read = tuple[int, Path, int, int, tuple[int, ...]]


def span_caps() -> tuple[int, int]:
    """(SRC bytes, DST bytes) of one span task, replicas each counting on the DST side; (0, 0)
    when spans are off. Read at run time: tests shrink ``plan.BLOCK_BYTES``."""
    return (plan.BLOCK_BYTES, 2 * plan.BLOCK_BYTES) if ENABLED else (0, 0)


def geometry(
    shape: tuple[int, ...], src: tuple[Box, ...], dst: tuple[Box, ...]
) -> tuple[tuple[PartGeometry, ...], ...] | None:
    """Each DST box's parts, when the SRC boxes tile ``shape`` exactly (replicas: the first
    holder of a box serves it) and every DST box lies inside ``shape``; None otherwise (the
    per-block path then reports what is wrong)."""
    nd = len(shape)
    first: dict[Box, int] = {}
    for i, (o, z) in enumerate(src):
        if len(o) != nd or len(z) != nd:
            return None
        if any(a < 0 or n <= 0 or a + n > m for a, n, m in zip(o, z, shape, strict=True)):
            return None
        first.setdefault((o, z), i)
    boxes = list(first.items())
    if sum(math.prod(z) for (_, z), _ in boxes) != math.prod(shape):
        return None
    for x in range(len(boxes)):
        (o1, z1), _ = boxes[x]
        for y in range(x):
            (o2, z2), _ = boxes[y]
            if all(
                max(a, b) < min(a + n, b + m) for a, n, b, m in zip(o1, z1, o2, z2, strict=True)
            ):
                return None  # two SRC boxes overlap (and with the volume right, one is missing)
    out = []
    for o, z in dst:
        if len(o) != nd or len(z) != nd:
            return None
        if any(a < 0 or n <= 0 or a + n > m for a, n, m in zip(o, z, shape, strict=True)):
            return None
        parts = []
        for (qo, qz), i in boxes:
            lo = tuple(max(a, b) for a, b in zip(o, qo, strict=True))
            hi = tuple(min(a + n, b + m) for a, n, b, m in zip(o, z, qo, qz, strict=True))
            if all(h > lo_ for lo_, h in zip(lo, hi, strict=True)):
                sizes = tuple(h - lo_ for lo_, h in zip(lo, hi, strict=True))
                src_off = tuple(a - b for a, b in zip(lo, qo, strict=True))
                dst_off = tuple(a - b for a, b in zip(lo, o, strict=True))
                parts.append((i, src_off, dst_off, sizes))
        out.append(tuple(parts))
    return tuple(out)


class Geometries:
    """:func:`geometry`, a bounded cache: a few hundred kinds at 100,000 tensors. Looked up by
    the identity of the shards' shape and pieces objects first (a record's shards of one kind
    share them), then by value."""

    def __init__(self) -> None:
        self.known: dict[Any, tuple[tuple[PartGeometry, ...], ...] | None] = {}
        # identity key -> (geometry, every DST shard one part, their bytes, the objects the
        # ids name)
        self.ids: dict[tuple[Any, ...], tuple[Any, bool, tuple[int, ...], Any]] = {}

    def __call__(
        self, shape: tuple[int, ...], src: tuple[Box, ...], dst: tuple[Box, ...]
    ) -> tuple[tuple[PartGeometry, ...], ...] | None:
        key = (shape, src, dst)
        try:
            return self.known[key]
        except KeyError:
            pass
        if len(self.known) >= KINDS:
            self.known.clear()
        got = self.known[key] = geometry(shape, src, dst)
        return got

    def remember(
        self, key: tuple[Any, ...], geo: Any, dst_bytes: tuple[int, ...], held: Any
    ) -> tuple[Any, bool, tuple[int, ...], Any]:
        """Keep ``geo`` (and each DST shard's bytes) under identity ``key`` (``held``: the
        objects its ids name, kept alive so no id is reused while cached); returns the entry:
        ``(geo, whether every DST shard is one part, dst_bytes, held)``."""
        if len(self.ids) >= KINDS:
            self.ids.clear()
        single = geo is not None and all(len(p) == 1 for p in geo)
        got = self.ids[key] = (geo, single, dst_bytes, held)
        return got


@dataclass
class Span:
    """Plain tensors whose SRC shards lie back to back in each SRC file they use, and the
    parts that fill their DST shards."""

    # SRC file -> [path, first byte, end]
    ranges: dict[int, list[Any]] = field(default_factory=dict)
    # DST shard, SRC file, SRC shard's first byte in that file, SRC local shape, part geometry,
    # the DST shard's bytes
    parts: list[tuple[DstShard, int, int, tuple[int, ...], PartGeometry, int]] = field(
        default_factory=list
    )
    src_bytes: int = 0  # SRC bytes read
    multi: bool = False  # a DST shard of several parts among them
    tensor_bytes: int = 0  # the tensors' bytes, each element once (the level's figure)
    dst_bytes: int = 0

    def fits(self, src: list[Read], cap: int) -> bool:
        """Whether SRC shards ``(file, path, begin, nbytes, local shape)`` can join: each
        follows its file's stretch so far (a tensor's shards in one file: one after another),
        and the span stays within ``cap``."""
        ends: dict[int, int] = {}
        n = 0
        for file, _, begin, nbytes, _ in sorted(src, key=_file_begin) if len(src) > 1 else src:
            end = ends.get(file)
            if end is None:
                got = self.ranges.get(file)
                end = None if got is None else got[2]
            if end is not None and end != begin:
                return False
            ends[file] = begin + nbytes
            n += nbytes
        return self.src_bytes + n <= cap

    def add(self, src: list[Read]) -> None:
        """Take SRC shards in (``fits`` said they can join)."""
        for file, path, begin, nbytes, _ in sorted(src, key=_file_begin) if len(src) > 1 else src:
            got = self.ranges.get(file)
            if got is None:
                self.ranges[file] = [path, begin, begin + nbytes]
            else:
                got[2] = begin + nbytes
            self.src_bytes += nbytes


def compare_span(span: Span, w: Worker, out: Out) -> None:
    """Read the span's SRC stretches and its DST shards; build what DST should hold from SRC
    and compare the two, shard by shard only when they differ."""
    src = w.bufs.image.get(span.src_bytes)
    base: dict[int, int] = {}  # SRC file -> where its byte 0 would be in ``src``
    pos = 0
    for file, (path, b, e) in span.ranges.items():
        w.read(path, src[pos : pos + e - b], b)
        base[file] = pos - b
        pos += e - b
    w.src_bytes += span.tensor_bytes
    # DST: per file, shards sorted by offset; adjacent shards read in one pread. Files are told
    # apart by their Path object's id: hashing a Path per shard costs more than the compare.
    # Entries are told apart by index: ``owner[k]``, the entry whose shard entry ``k`` fills
    # (itself, but where a shard of several parts is read once: ``span.multi``).
    parts = span.parts
    owner: list[int] | range = range(len(parts))
    by_file: dict[int, list[tuple[int, int, int]]] = {}  # path id -> [(begin, bytes, entry)]
    if span.multi:
        first: dict[int, int] = {}
        owner = [first.setdefault(id(e[0]), k) for k, e in enumerate(parts)]
        for k, e in enumerate(parts):
            if owner[k] == k:
                s = e[0]
                by_file.setdefault(id(s.path), []).append((s.begin, e[5], k))
    else:
        for k, e in enumerate(parts):
            s = e[0]
            items = by_file.get(id(s.path))
            if items is None:
                items = by_file[id(s.path)] = []
            items.append((s.begin, e[5], k))
    runs: list[list[Any]] = []  # [path, begin, end, [(begin, bytes, entry), ...]]
    for items in by_file.values():
        run: list[Any] = []
        items.sort()  # in order already, mostly (the walk's order): ~linear
        for one in items:
            begin = one[0]
            if run and run[2] == begin:
                run[3].append(one)
                run[2] = begin + one[1]
            else:
                run = [parts[one[2]][0].path, begin, begin + one[1], [one]]
                runs.append(run)
    total = sum(e - b for _, b, e, _ in runs)
    dst = w.bufs.rows.get(total)
    at = [0] * len(parts)  # entry -> its shard's first byte in ``dst``
    pos = 0
    for path, b, e, items in runs:
        mv = dst[pos : pos + e - b]
        w.read(path, mv, b)
        w.dst_bytes += e - b
        out.hash_reads.append((path, b, mv))
        for begin, _, k in items:
            at[k] = pos + begin - b
        pos += e - b
    # batches: parts of one geometry. Keyed by the part's identity: a kind's parts are one
    # cached tuple (``Geometries``), and ``span.parts`` holds every one it names, so no id is
    # reused while the span lives. Parts of equal value from two kinds are two batches.
    batches: dict[tuple[str, int], list[Any]] = {}
    for k, (s, file, begin, src_shape, geo, _) in enumerate(parts):
        key = (s.dtype, id(geo))
        got = batches.get(key)
        if got is None:
            got = batches[key] = [s.dtype, src_shape, s.local_shape, geo, []]
        got[4].append((base[file] + begin, at[owner[k]]))
    src_u8 = np.frombuffer(src, dtype=np.uint8)
    dst_u8 = np.frombuffer(dst, dtype=np.uint8)
    # What DST should hold, built from SRC (every DST byte read belongs to exactly one part),
    # then one memcmp; only a span that differs is compared shard by shard to name them.
    expected = np.frombuffer(w.bufs.copy.get(total), dtype=np.uint8)
    for dtype, src_shape, dst_shape, (_, src_off, dst_off, sizes), members in batches.values():
        kind = uint_of(dtype)
        assert kind is not None  # level._plain checked it
        item = np.dtype(kind).itemsize
        _fill_batch(
            src_u8, expected, item, (src_shape, src_off), (dst_shape, dst_off), sizes, members
        )
    if not equal(dst_u8, expected):
        done = [(parts[k][0], at[k]) for *_, items in runs for _, _, k in items]
        _compare_shards(done, dst_u8, expected, out)


def _compare_shards(
    shards: list[tuple[DstShard, int]], dst: np.ndarray, expected: np.ndarray, out: Out
) -> None:
    """A finding for each of ``shards`` (with its first byte in both buffers) whose bytes
    differ from what it should hold: how many elements, and the first (as the block path)."""
    for s, a in shards:
        kind = uint_of(s.dtype)
        assert kind is not None
        n = _NBYTES(s.dtype, s.local_shape)
        got = dst[a : a + n].view(kind).reshape(s.local_shape)
        want = expected[a : a + n].view(kind).reshape(s.local_shape)
        if not equal(got, want):
            out.findings.append(_difference(s, got, want, s.pieces[0].offsets))


_NBYTES = Sizes()  # a DST shard's bytes by (dtype, local shape): a few dozen kinds


def _file_begin(r: Read) -> tuple[int, int]:
    return r[0], r[2]


def _fill_batch(
    src: np.ndarray,
    expected: np.ndarray,
    item: int,
    src_box: tuple[tuple[int, ...], tuple[int, ...]],
    dst_box: tuple[tuple[int, ...], tuple[int, ...]],
    sizes: tuple[int, ...],
    members: list[tuple[int, int]],
) -> None:
    """Copy each member's box of SRC to where DST holds it, in ``expected``. ``src_box`` and
    ``dst_box``: (local shape, offsets of the box in it) on each side; members: (first byte of
    the SRC local tensor in ``src``, of the DST one in ``expected``).

    - members at constant strides on both sides: one strided copy of them all;
    - else small boxes: one gather of every member's box through a strided view of SRC (a view
      with a row per possible start byte, indexed by the members' starts), one scatter the
      same way into ``expected`` — two numpy calls, however many members;
    - else (boxes of ``DIRECT_BYTES`` or more, or one member): box by box, one copy each.

    The views work on bytes: the last dim is ``sizes[-1] · item`` byte columns, so they take any
    start byte whatever the dtype."""
    n = len(members)
    (src_shape, src_off), (dst_shape, dst_off) = src_box, dst_box
    src_strides = [x * item for x in strides(src_shape)]
    dst_strides = [x * item for x in strides(dst_shape)]
    src_origin = sum(o * x for o, x in zip(src_off, src_strides, strict=True))
    dst_origin = sum(o * x for o, x in zip(dst_off, dst_strides, strict=True))
    box = (*sizes[:-1], sizes[-1] * item)
    step = _regular(members)
    if step is not None:
        s_step, d_step = step
        into = _strided(expected, members[0][1] + dst_origin, (n, *box), [d_step, *dst_strides])
        into[...] = _strided(src, members[0][0] + src_origin, (n, *box), [s_step, *src_strides])
        return
    if n == 1 or math.prod(box) >= DIRECT_BYTES:
        # one copy per member, straight from SRC: large boxes gain nothing from a gather
        # (it would copy them twice, through a temporary)
        for s_at, d_at in members:
            one = _strided(src, s_at + src_origin, box, src_strides)
            _strided(expected, d_at + dst_origin, box, dst_strides)[...] = one
        return
    # a box that is its whole local tensor is contiguous: gathered or scattered as flat rows
    local = math.prod(box)
    if sizes == src_shape:
        rows = _strided(src, 0, (len(src) - local + 1, local), [1])
    else:
        s_span = _extent(sizes, src_strides, item)
        rows = _strided(src, 0, (len(src) - s_span + 1, *box), [1, *src_strides])
    got = rows[np.fromiter((m[0] for m in members), np.intp, n) + src_origin]
    at = np.fromiter((m[1] for m in members), np.intp, n) + dst_origin
    if sizes == dst_shape:
        _strided(expected, 0, (len(expected) - local + 1, local), [1])[at] = got.reshape(n, local)
    else:
        d_span = _extent(sizes, dst_strides, item)
        into = _strided(expected, 0, (len(expected) - d_span + 1, *box), [1, *dst_strides])
        into[at] = got.reshape(n, *box)


def _extent(sizes: tuple[int, ...], steps: list[int], item: int) -> int:
    """Bytes a box of ``sizes`` spans, first to last, in a local tensor of byte ``steps``."""
    return sum((z - 1) * x for z, x in zip(sizes[:-1], steps[:-1], strict=True)) + sizes[-1] * item


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


def _regular(members: list[tuple[int, int]]) -> tuple[int, int] | None:
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
