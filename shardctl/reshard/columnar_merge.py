"""Reshard's columnar merge: a ``ranks`` layout's small tensors put back whole into Hugging Face
files with no Python step per tensor (the other direction of :mod:`shardctl.reshard.columnar`).

A target here is a whole tensor; its *parts* are the source shards that hold it, read from the
record's arrays (``RecordShards``: the rank tables and the by-tensor index), never built as
objects. A part is one rectangular piece filling its shard's local tensor, so it is contiguous
in its rank file and a *box* of the target: one kind of box per (item size, tensor strides, box
sizes). Replicas (norms on every tp rank) give the target their first holder's bytes, as the
per-target path does (``plan_boxes``).

The parts of a tensor must tile it exactly: in bounds, not overlapping, their volumes adding up
to the tensor's. That is checked once per *pattern* — tensors of one dtype and shape cut into
the same set of boxes, a few dozen in a 90,000-tensor MoE — found by two random-weighted sums
of each tensor's box ids (weights drawn per run, so a crafted record cannot aim at a
collision). Anything else — a fused or padded shard, a sub-byte dtype, a pattern that does not
tile, a tensor over ``columnar.CHUNK`` — goes the per-target way, which reports what is wrong.

Chunks are cut, read, laid out and handed to the writers as in ``columnar``; in a chunk the
parts of one kind are put into their targets with one numpy assignment into a strided view.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain, pairwise
from operator import attrgetter, eq
from typing import TYPE_CHECKING, Any

import numpy as np

from shardctl.checkpoint import record_table as rt
from shardctl.checkpoint.plan_files import FileTensors
from shardctl.checkpoint.source import RecordShards
from shardctl.dtypes import DTYPE_BITS
from shardctl.io.mapped import row_kinds
from shardctl.model.types import TensorInfo
from shardctl.reshard import columnar
from shardctl.reshard.columnar import Kinds, _rows

if TYPE_CHECKING:
    from shardctl.reshard.writer import OutFile

_FQN, _DTYPE, _SHAPE = attrgetter("fqn"), attrgetter("dtype"), attrgetter("shape")


@dataclass
class MergeBatch:
    objs: list[Sequence[Any]]  # per output file: its TensorInfo objects
    begins: list[np.ndarray]  # per output file: each tensor's first byte (a view)
    shards: RecordShards
    kinds: Kinds
    rng: np.random.Generator  # the pattern sums' weights (``_tiles``)

    def parts(self, keys: np.ndarray) -> np.ndarray:
        """Each target's parts (its tensor's shards, replicas included)."""
        start = np.frombuffer(self.shards.groups.start, dtype=np.int64)
        keys = np.clip(keys, 0, start.size - 2)  # (an unknown tensor: refused by plan)
        return start[keys + 1] - start[keys]


@dataclass
class MergeColumns:
    """A segment of the walk: its targets (whole tensors) and their parts, as arrays."""

    file: np.ndarray  # per target: index into the batch's ``outs``
    last: np.ndarray  # per target: the last tensor of its file
    begin: np.ndarray  # per target: first byte in its file
    nbytes: np.ndarray  # per target
    ok: np.ndarray  # per target: it goes this way
    fqn_start: np.ndarray  # per target: always True (one target a tensor)
    part_start: np.ndarray  # per target: its parts are part_start[i]:part_start[i + 1]
    src_file: np.ndarray  # per part
    src_start: np.ndarray  # per part: first byte of its shard (contiguous)
    size: np.ndarray  # per part: bytes
    kind: np.ndarray  # per part: its box in the target (index into the run's Kinds)
    at: np.ndarray  # per part: byte of the box's first run in the target
    pos: int


def batch(planned: Sequence[FileTensors], sources: object) -> MergeBatch | None:
    """The batch when it is Hugging Face files (whole tensors) from a ``ranks`` source."""
    if not columnar.ENABLED or not isinstance(sources, RecordShards):
        return None
    if any(p.pieces is not None for p in planned):
        return None
    objs = [p.objs for p in planned]
    if set(chain.from_iterable(map(type, o) for o in objs)) != {TensorInfo}:
        return None
    begins = [np.frombuffer(p.begins, dtype=np.int64) for p in planned]
    return MergeBatch(objs, begins, sources, Kinds(), np.random.default_rng())


def plan(
    b: MergeBatch, key: np.ndarray, file: np.ndarray, at: np.ndarray, last: np.ndarray
) -> MergeColumns | None:
    """One segment (targets in walk order: tensor index, output file, position, last in its
    file) as columns; None when none of its tensors can go this way."""
    n = key.size
    shards = b.shards
    table, groups = shards.table, shards.groups
    if (key < 0).any() or int(key.max()) >= len(table.tensors):
        return None
    targets, begin = columnar.gather(b.objs, b.begins, file, at)
    infos = list(map(table.tensors.__getitem__, key.tolist()))
    # the target is the record's tensor, whole, in its own dtype
    ok = np.fromiter(map(eq, map(_FQN, targets), map(_FQN, infos)), bool, n)
    ok &= np.fromiter(map(eq, map(_DTYPE, targets), map(_DTYPE, infos)), bool, n)
    ok &= np.fromiter(map(eq, map(_SHAPE, targets), map(_SHAPE, infos)), bool, n)
    del targets
    dtypes = list(map(_DTYPE, infos))
    shapes = list(map(_SHAPE, infos))
    del infos
    code = {d: i for i, d in enumerate(sorted(set(dtypes)))}
    items = np.array([DTYPE_BITS[d] // 8 if DTYPE_BITS[d] % 8 == 0 else 0 for d in code])
    item = items[np.fromiter(map(code.__getitem__, dtypes), np.int64, n)]
    nd = np.fromiter(map(len, shapes), np.int64, n)
    width = table.width
    if int(nd.max()) > width or (nd == 0).any():
        return None
    shape = rt.pad_rows(np.fromiter(chain.from_iterable(shapes), np.int64), nd, width, 1)
    stride = np.empty((n, width), dtype=np.int64)
    acc = item.copy()
    for d in range(width - 1, -1, -1):
        stride[:, d] = acc
        acc = acc * shape[:, d]
    nbytes = acc
    ok &= item > 0
    # ---- parts: the tensors' shards from the by-tensor index (CSR) ----
    start = np.frombuffer(groups.start, dtype=np.int64)
    lo, hi = start[key], start[key + 1]
    count = hi - lo
    owner = np.repeat(np.arange(n), count)  # part -> target
    k = np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count) + lo[owner]
    rank = np.frombuffer(groups.rank, dtype=np.int32)[k]
    row = np.frombuffer(groups.row, dtype=np.int32)[k]
    del k
    m = owner.size
    off = np.zeros((m, width), dtype=np.int64)
    siz = np.ones((m, width), dtype=np.int64)
    fine = np.zeros(m, dtype=bool)
    src_file = np.zeros(m, dtype=np.int64)
    src_start = np.zeros(m, dtype=np.int64)
    for i in np.unique(rank).tolist():
        sel = np.flatnonzero(rank == i)
        rows = row[sel]
        r = table.ranks[i]
        ps = np.asarray(r.piece_start)
        p = ps[rows]
        one = ps[rows + 1] - p == 1
        p = np.where(one, p, 0)
        off[sel], siz[sel] = r.offsets[p], r.sizes[p]
        fine[sel] = (
            one
            & (r.local_offsets[p] == 0).all(axis=1)
            & (r.sizes[p] == r.local_shape[rows]).all(axis=1)
        )
        src_file[sel], src_start[sel] = shards.rows(i, rows)
    del rank, row
    fine &= ((off >= 0) & (off + siz <= shape[owner])).all(axis=1) & (src_file >= 0)
    # replicas: the first holder of each box (ranks ascending within a tensor)
    box_code, box_rows = row_kinds(np.concatenate([off, siz], axis=1))
    first = np.unique(owner.astype(np.int64) * len(box_rows) + box_code, return_index=True)[1]
    keep = np.zeros(m, dtype=bool)
    keep[first] = True
    # a target goes this way when every part is one box and its boxes tile it
    bad = np.bincount(owner, weights=~fine, minlength=n) > 0
    ok &= ~bad
    owner, off, siz, box_code = owner[keep], off[keep], siz[keep], box_code[keep]
    src_file, src_start = src_file[keep], src_start[keep]
    t_class, class_rows = row_kinds(np.concatenate([item[:, None], nd[:, None], shape], axis=1))
    ok &= _tiles(b.rng, owner, box_code, box_rows, t_class, shape, nd, width)
    ok &= nbytes <= columnar.CHUNK
    # ---- part geometry per (tensor class, box): the box's kind and first byte ----
    combo = t_class[owner] * len(box_rows) + box_code
    _, c_first, c_inv = np.unique(combo, return_index=True, return_inverse=True)
    c_kind, c_at = [], []
    for u in combo[c_first].tolist():
        crow = class_rows[u // len(box_rows)].tolist()
        brow = box_rows[u % len(box_rows)].tolist()
        size, rk = crow[0], crow[1]
        dims = crow[2 : 2 + rk]
        offs, sizes = brow[:rk], tuple(brow[width : width + rk])
        strides = [size] * rk
        for d in range(rk - 2, -1, -1):
            strides[d] = strides[d + 1] * dims[d + 1]
        c_kind.append(b.kinds.of(size, strides, sizes) if size > 0 else 0)
        c_at.append(sum(o * t for o, t in zip(offs, strides, strict=True)))
    c_inv = c_inv.reshape(-1)
    kind = np.asarray(c_kind, dtype=np.int32)[c_inv]
    part_at = np.asarray(c_at, dtype=np.int64)[c_inv]
    part_size = item[owner] * siz.prod(axis=1)
    if not ok.any():
        return None
    part_start = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.bincount(owner, minlength=n), out=part_start[1:])
    pos = 1 << int((src_start + part_size).max()).bit_length()
    if (int(src_file.max()) + 1) * pos >= 2**62:
        return None
    return MergeColumns(
        file=file,
        last=last,
        begin=begin,
        nbytes=nbytes,
        ok=ok,
        fqn_start=np.ones(n, dtype=bool),
        part_start=part_start,
        src_file=src_file.astype(np.int32),
        src_start=src_start,
        size=part_size,
        kind=kind,
        at=part_at,
        pos=pos,
    )


def _tiles(
    rng: np.random.Generator,
    owner: np.ndarray,
    box_code: np.ndarray,
    box_rows: np.ndarray,
    t_class: np.ndarray,
    shape: np.ndarray,
    nd: np.ndarray,
    width: int,
) -> np.ndarray:
    """Per target (``owner`` names each box's): whether its distinct boxes tile it exactly (in
    bounds, disjoint, adding up to it), checked once per pattern (tensor class and set of
    boxes; weights for the sums drawn afresh for each segment's box ids)."""
    n = t_class.size
    w1 = rng.integers(0, 2**62, len(box_rows), dtype=np.uint64)
    w2 = rng.integers(0, 2**62, len(box_rows), dtype=np.uint64)
    h1 = np.zeros(n, dtype=np.uint64)
    h2 = np.zeros(n, dtype=np.uint64)
    np.add.at(h1, owner, w1[box_code])
    np.add.at(h2, owner, w2[box_code])
    parts = np.bincount(owner, minlength=n)
    pattern = np.stack([t_class.astype(np.uint64), h1, h2, parts.astype(np.uint64)], axis=1)
    _, p_first, p_inv = np.unique(pattern, axis=0, return_index=True, return_inverse=True)
    first_part = np.concatenate([[0], np.cumsum(parts)])
    verdict = []
    for t in p_first.tolist():
        rk = int(nd[t])
        dims = shape[t, :rk].tolist()
        boxes = [
            (box_rows[c, :rk].tolist(), box_rows[c, width : width + rk].tolist())
            for c in box_code[first_part[t] : first_part[t + 1]].tolist()  # owner is sorted
        ]
        verdict.append(_exact(dims, boxes))
    return np.asarray(verdict, dtype=bool)[p_inv.reshape(-1)]


def _exact(dims: list[int], boxes: list[tuple[list[int], list[int]]]) -> bool:
    """Whether ``boxes`` (offsets, sizes) tile a tensor of ``dims`` exactly."""
    if not boxes or sum(math.prod(z) for _, z in boxes) != math.prod(dims):
        return False
    for o, z in boxes:
        if any(a < 0 or a + s > d for a, s, d in zip(o, z, dims, strict=True)):
            return False
    for (o1, z1), (o2, z2) in ((x, y) for i, x in enumerate(boxes) for y in boxes[i + 1 :]):
        if all(a < c + t and c < a + s for a, s, c, t in zip(o1, z1, o2, z2, strict=True)):
            return False  # overlap (with the volumes equal: a hole elsewhere)
    return True


def write(ch: columnar.Chunks, outs: list[OutFile], c: MergeColumns, a: int, b: int) -> None:
    """Targets ``[a, b)`` of ``c`` (one chunk): their parts read, put into their boxes, and
    each file's stretch handed to its writer."""
    ch.ex._check()
    p0, p1 = int(c.part_start[a]), int(c.part_start[b])
    ps = slice(p0, p1)
    size = c.size[ps]
    sl = slice(a, b)
    nb = c.nbytes[sl]
    files, lo, base, per_file, put = ch.layout(c.file[sl], c.begin[sl], nb)
    buf, home = ch._buffer(int(per_file.sum()))
    owner = np.repeat(np.arange(b - a), np.diff(c.part_start[a : b + 1]))
    dst_at = put[owner] + c.at[ps]
    kind = c.kind[ps]
    # a part whose box in the tensor is one run is read straight there
    scratch, src_at, placed = ch.read(
        c.src_file[ps], c.src_start[ps], size, c.pos, buf, dst_at, ch.flat()[kind]
    )
    rest = np.flatnonzero(~placed)
    o = rest[np.argsort(kind[rest], kind="stable")]
    for members in np.split(o, np.flatnonzero(np.diff(kind[o])) + 1) if o.size else ():
        k = int(kind[members[0]])
        s_at, d_at = src_at[members], dst_at[members]
        word = ch.word(k, s_at | d_at)
        outer, strides, run = ch.kinds.kinds[k]
        n = int(size[members[0]])
        into = _rows(buf, word, (*outer, run), strides, ch.kinds.spans[k])
        src = _rows(scratch, word, (n,), (), n)
        into[d_at // word] = src[s_at // word].reshape(members.size, *outer, run // word)
    ch.hand(outs, buf, home, files, lo, base, per_file, c.file[sl][c.last[sl]], int(nb.sum()))


def chunks(c: MergeColumns, a: int, b: int) -> list[tuple[int, int]]:
    """Targets ``[a, b)`` (all this path's) in chunks of about ``CHUNK`` output bytes."""
    weight = np.cumsum(c.nbytes[a:b])
    if b - a < 2:
        return [(a, b)]
    band = weight[:-1] // columnar.CHUNK
    cuts = (np.flatnonzero(np.diff(band, prepend=0)) + 1).tolist()
    return [(a + x, a + y) for x, y in pairwise([0, *cuts, b - a])]
