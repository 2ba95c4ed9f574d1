"""Box planning: which source box fills which part of a target local tensor.

A target piece (a box of the global tensor) is intersected with every source piece that covers
it; each intersection is a :class:`Box`, a copy from source-local to target-local coordinates.
The boxes of a piece must tile it exactly, checked before a byte is written.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from shardctl.blocks import scalar_piece
from shardctl.checkpoint.record_check import overlap
from shardctl.checkpoint.source import SourceShard
from shardctl.errors import InvalidInputError
from shardctl.layout.types import Piece


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
    if len(sources) == 1 and len(sources[0].pieces) == 1:
        fast = _inside_one(pieces, sources[0])
        if fast is not None:
            return fast
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


def _inside_one(pieces: Sequence[Piece], src: SourceShard) -> list[Box] | None:
    """The common case (a whole tensor of an HF file, or one source shard): every piece lies
    inside the one source piece, so each is one box and trivially tiles itself. ``None`` when
    a piece reaches outside it (the general path then reports what is uncovered)."""
    q = scalar_piece(src.pieces[0])
    boxes: list[Box] = []
    for p in map(scalar_piece, pieces):
        if 0 in p.sizes:
            continue
        if len(p.offsets) != len(q.offsets):
            return None
        src_lo = local_in(p, q)
        if src_lo is None:
            return None
        boxes.append(Box(src, src_lo, p.local_offsets, p.sizes))
    return boxes


def local_in(p: Piece, q: Piece) -> tuple[int, ...] | None:
    """Where ``p``'s box starts in the local tensor of the piece ``q`` it lies inside (both
    of the same dims), or None when it does not lie wholly inside ``q``."""
    out = []
    for a, n, b, m, c in zip(p.offsets, p.sizes, q.offsets, q.sizes, q.local_offsets, strict=True):
        if a < b or a + n > b + m:
            return None
        out.append(a - b + c)
    return tuple(out)
