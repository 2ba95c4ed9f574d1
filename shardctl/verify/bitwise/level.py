"""Bitwise level, the level itself: the tasks in an order every DST file agrees with, their
findings added up per shard, the record hashes checked, the figures."""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from shardctl.blocks import scalar_piece, scalar_shape
from shardctl.checkpoint.source import Source
from shardctl.dtypes import nbytes
from shardctl.verify.bitwise import plan
from shardctl.verify.bitwise.compare import shard_key
from shardctl.verify.bitwise.pipeline import Feed, run_tasks
from shardctl.verify.bitwise.plan import plan_tensor, tensor_blocks
from shardctl.verify.bitwise.spans import Span, span_caps
from shardctl.verify.boxes import uint_of
from shardctl.verify.dst import Destination, DstShard
from shardctl.verify.result import LevelResult


def check_bitwise(src: Source, dst: Destination, *, hashes: bool = True) -> LevelResult:
    """Compare every DST shard with SRC; ``hashes``: also check each file's recorded hash."""
    level = LevelResult("bitwise")
    t0 = time.perf_counter()
    ordered, by_fqn = _shards(src, dst)
    per_tensor, padded = _tensor_rows(by_fqn)
    hash_name = dst.record.hash if dst.record and hashes else None
    feeds: dict[Path, Feed] = {}
    if hash_name and dst.record is not None:
        digests = {f.name: f.digest for f in dst.record.files if f.digest}
        feeds = {p: Feed(p, hash_name) for p in dst.files if p.name in digests}

    shapes = {t.fqn: t.shape for t in src.model.tensors}
    workers, results = run_tasks(_tasks(src, by_fqn, shapes), src, feeds)
    # only a shard that differs needs its element count (the message's "n of m elements")
    keys = {r[1] for r in results}
    compared = (
        {
            shard_key(s): sum(scalar_piece(p).numel for p in s.pieces)
            for s in ordered
            if shard_key(s) in keys
        }
        if keys
        else {}
    )
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


def _shards(src: Source, dst: Destination) -> tuple[list[DstShard], dict[str, list[DstShard]]]:
    """DST's shards of the tensors SRC has, sorted by (file, begin), and grouped by tensor in
    an order every DST file agrees with (``_file_order``)."""
    by_path: dict[Path, list[DstShard]] = {}
    src_shards = src.shards
    for fqn, ss in dst.shards.items():
        if fqn not in src_shards:
            continue
        for s in ss:
            at = by_path.get(s.path)
            if at is None:
                at = by_path[s.path] = []
            at.append(s)
    ordered: list[DstShard] = []
    for path in sorted(by_path, key=str):
        ordered.extend(sorted(by_path[path], key=_begin))
    by_fqn: dict[str, list[DstShard]] = {}
    for s in ordered:
        at = by_fqn.get(s.fqn)
        if at is None:
            at = by_fqn[s.fqn] = []
        at.append(s)
    return ordered, {fqn: by_fqn[fqn] for fqn in _file_order(ordered)}


def _tensor_rows(
    by_fqn: dict[str, list[DstShard]],
) -> tuple[dict[str, dict[str, Any]], int]:
    """The level's row per tensor (shards, bytes, status ``pass``) and the padded shards."""
    per_tensor: dict[str, dict[str, Any]] = {}
    padded = 0
    size = _Sizes()
    for fqn, shards in by_fqn.items():
        total = 0
        for s in shards:
            total += size(s.dtype, s.local_shape)
            pieces = s.pieces
            if not (len(pieces) == 1 and pieces[0].sizes == s.local_shape) and sum(
                scalar_piece(p).numel for p in pieces
            ) < math.prod(s.local_shape):
                padded += 1
        per_tensor[fqn] = {"shards": len(shards), "bytes": total, "status": "pass"}
    return per_tensor, padded


class _Sizes(dict[tuple[str, tuple[int, ...]], int]):
    """``(dtype, shape) -> bytes``, remembered: 90,000 tensors have a few dozen of them."""

    def __call__(self, dtype: str, shape: tuple[int, ...]) -> int:
        key = (dtype, shape)
        n = self.get(key)
        if n is None:
            n = self[key] = nbytes(dtype, math.prod(shape))
        return n


def _begin(s: DstShard) -> int:
    return s.begin


def _tasks(
    src: Source, by_fqn: dict[str, list[DstShard]], shapes: dict[str, tuple[int, ...]]
) -> Iterator[tuple[Any, ...]]:
    """The tasks, in order: ``("span", Span)`` (plain small tensors, ``spans.py``),
    ``("block", tensor, lead, a, b)``, ``("blocks", [(tensor, lead, a, b), ...])``,
    ``("padding", shard, kind)`` and ``("raw", shard)``."""
    # Tensors of one block or less are batched, up to a block of SRC bytes, into one task:
    # at 90,000 tensors one task (and one hand-off to the hashing) per tensor cost more
    # than reading them.
    batch: list[tuple[Any, ...]] = []
    size = 0
    span: Span | None = None
    span_src, span_dst = span_caps()
    sizes = _Sizes()
    span_file = -1
    for fqn, shards in by_fqn.items():
        shape = shapes[fqn]
        plain = _plain(src, fqn, shape, shards, span_src, sizes)
        if plain is not None:  # a span of plain tensors (spans.py): no per-tensor plan
            file, begin, nbytes = plain
            if batch:
                yield ("blocks", batch)
                batch, size = [], 0
            dst_bytes = 0
            for s in shards:
                dst_bytes += sizes(s.dtype, s.local_shape)
            if span is not None and (
                span_file != file
                or span.end != begin
                or span.end + nbytes - span.begin > span_src
                or span.dst_bytes + dst_bytes > span_dst
            ):
                yield ("span", span)
                span = None
            if span is None:
                span = Span(src.files[file].path, begin, begin, [])
                span_file = file
            at = begin - span.begin
            span.shards.extend([(s, at, shape) for s in shards])
            span.end = begin + nbytes
            span.dst_bytes += dst_bytes
            continue
        if span is not None:
            yield ("span", span)
            span = None
        t = plan_tensor(fqn, shapes[fqn], src, shards)
        if t is None:
            if batch:
                yield ("blocks", batch)
                batch, size = [], 0
            for s in shards:
                yield ("raw", s)
            continue
        blocks = list(itertools.islice(tensor_blocks(t), 2))
        padded = [
            s
            for s in shards
            if sum(scalar_piece(p).numel for p in s.pieces) < math.prod(scalar_shape(s.local_shape))
        ]
        if len(blocks) == 1 and not padded:
            nbytes = math.prod(t.shape) * t.item
            if batch and size + nbytes > plan.BLOCK_BYTES:
                yield ("blocks", batch)
                batch, size = [], 0
            batch.append((t, *blocks[0]))
            size += nbytes
            continue
        if batch:
            yield ("blocks", batch)
            batch, size = [], 0
        for lead, a, b in tensor_blocks(t):
            yield ("block", t, lead, a, b)
        for s in padded:
            yield ("padding", s, t.kind)
    if batch:
        yield ("blocks", batch)
    if span is not None:
        yield ("span", span)


def _plain(
    src: Source,
    fqn: str,
    shape: tuple[int, ...],
    shards: list[DstShard],
    cap: int,
    sizes: _Sizes,
) -> tuple[int, int, int] | None:
    """``(SRC file index, begin, nbytes)`` of a tensor a span can hold, else None: SRC holds it
    as one whole tensor and every DST shard is one box of it filling its local tensor (no
    padding, no parts), of the same byte-sized dtype."""
    if cap <= 0 or not shape or 0 in shape:
        return None
    ss = src.shards.get(fqn)
    if not ss or len(ss) != 1:
        return None
    s0 = ss[0]
    if s0.local_shape != shape or len(s0.pieces) != 1:
        return None
    p = s0.pieces[0]
    if p.sizes != shape or any(p.offsets) or any(p.local_offsets):
        return None
    dtype = s0.dtype
    if uint_of(dtype) is None:
        return None
    nd = len(shape)
    for s in shards:
        if s.dtype != dtype or len(s.pieces) != 1:
            return None
        q = s.pieces[0]
        if q.sizes != s.local_shape or len(q.sizes) != nd or any(q.local_offsets):
            return None
    n = sizes(dtype, shape)
    if n > cap:
        return None
    return s0.file, s0.begin, n


def _file_order(ordered: list[DstShard]) -> list[str]:
    """The tensors in an order every DST file agrees with (each file's blocks then come in
    file order, so its hash is fed as it is read): a topological sort of "``a`` comes before
    ``b`` in some file", ties by first appearance. Where files disagree (a cycle), the earliest
    tensor left goes next; those files are hashed again at the end."""
    # Tensors as ints numbered by first appearance, so the heap's priority is the id itself
    # (at 90,000 tensors the string-keyed sets and heap entries were seconds).
    ids: dict[str, int] = {}
    files: dict[Path, list[int]] = {}
    for s in ordered:  # sorted by (path, begin)
        i = ids.get(s.fqn)
        if i is None:
            i = ids[s.fqn] = len(ids)
        files.setdefault(s.path, []).append(i)
    names = list(ids)
    n = len(names)
    if all(seq == sorted(seq) for seq in files.values()):
        return names  # every file already agrees with first appearance: that is the sort
    after: list[set[int]] = [set() for _ in range(n)]
    before = [0] * n
    for seq in files.values():
        for a, b in itertools.pairwise(seq):
            if a != b and b not in after[a]:
                after[a].add(b)
                before[b] += 1
    ready = [f for f in range(n) if before[f] == 0]
    heapq.heapify(ready)
    out: list[int] = []
    done = [False] * n
    earliest = 0  # every id below it is done
    while len(out) < n:
        if not ready:  # a cycle: take the earliest tensor not placed yet
            while done[earliest]:
                earliest += 1
            before[earliest] = 0
            heapq.heappush(ready, earliest)
        f = heapq.heappop(ready)
        if done[f]:
            continue
        done[f] = True
        out.append(f)
        for g in after[f]:
            before[g] -= 1
            if before[g] == 0 and not done[g]:
                heapq.heappush(ready, g)
    return [names[f] for f in out]


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
