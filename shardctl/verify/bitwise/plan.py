"""Bitwise level, the plan: each tensor's SRC and DST pieces (``Part``) and the blocks the
work is cut into; also the reassembly of a block of SRC (``fill_image``), which the forward
level's reference reuses."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from shardctl import blocks
from shardctl.blocks import scalar_piece, scalar_shape, strides
from shardctl.checkpoint.source import Source
from shardctl.layout.types import Piece
from shardctl.verify.boxes import Scratch, uint_of
from shardctl.verify.dst import DstShard

BLOCK_BYTES = 2 << 20  # SRC image of one block (1, 2, 4 MiB measured: 2 best)
DST_CAP_BYTES = 4 << 20  # DST rows read for one block (replicas each count)


@dataclass(frozen=True)
class Part:
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
    owner: int  # index of the local tensor (DST: into Tensor.dst_shards)


@dataclass
class Tensor:
    fqn: str
    kind: type[np.unsignedinteger]
    item: int
    shape: tuple[int, ...]
    k: int  # the block dim
    row: int  # elements per index of dim k (product of the dims after it)
    rows_per: int
    src: list[Part]
    dst: list[Part]
    dst_shards: list[DstShard]


def _part(
    path: Path,
    begin: int,
    lshape: tuple[int, ...],
    p: Piece,
    k: int,
    gshape: tuple[int, ...],
    owner: int,
) -> Part:
    lshape = scalar_shape(lshape)
    p = scalar_piece(p)
    inner = range(k + 1, len(gshape))
    ginner = tuple(slice(p.offsets[d], p.offsets[d] + p.sizes[d]) for d in inner)
    linner = tuple(slice(p.local_offsets[d], p.local_offsets[d] + p.sizes[d]) for d in inner)
    whole = all(
        p.offsets[d] == 0 == p.local_offsets[d] and p.sizes[d] == gshape[d] == lshape[d]
        for d in inner
    )
    return Part(
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


def block_hit(
    p: Part, k: int, lead: tuple[int, ...], a: int, b: int
) -> tuple[int, int, int] | None:
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


def src_parts(src: Source, fqn: str, shape: tuple[int, ...], k: int) -> list[Part]:
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
    parts: list[Part],
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
        hit = block_hit(p, k, lead, a, b)
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


def plan_tensor(
    fqn: str, shape: tuple[int, ...], src: Source, shards: list[DstShard]
) -> Tensor | None:
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
    return Tensor(fqn, kind, item, shape, k, row, rows_per, src_parts_, dst_parts, shards)


def tensor_blocks(t: Tensor) -> Iterator[tuple[tuple[int, ...], int, int]]:
    if math.prod(t.shape) == 0:
        return
    for lead in itertools.product(*(range(n) for n in t.shape[: t.k])):
        for a in range(0, t.shape[t.k], t.rows_per):
            yield lead, a, min(t.shape[t.k], a + t.rows_per)
