"""Bitwise level, the level itself: the tasks in an order every DST file agrees with, their
findings added up per shard, the record hashes checked, the figures."""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Iterable, Iterator
from typing import Any

from shardctl.blocks import scalar_piece, scalar_shape
from shardctl.checkpoint.source import HfShards, Source
from shardctl.io.heap import give_back_heap
from shardctl.verify.bitwise import columnar, plan
from shardctl.verify.bitwise.pipeline import Feed, run_tasks
from shardctl.verify.bitwise.plan import plan_tensor, tensor_blocks
from shardctl.verify.bitwise.spans import SPAN_PARTS, Box, Geometries, PartGeometry, Span, span_caps
from shardctl.verify.bitwise.walk import Sizes, walk
from shardctl.verify.boxes import uint_of
from shardctl.verify.dst import Destination, DstShard
from shardctl.verify.result import LevelResult


def check_bitwise(src: Source, dst: Destination, *, hashes: bool = True) -> LevelResult:
    """Compare every DST shard with SRC; ``hashes``: also check each file's recorded hash."""
    level = LevelResult("bitwise")
    t0 = time.perf_counter()
    tour = walk(src, dst)  # the shards, tensor by tensor, built as the tasks reach them
    give_back_heap()  # the walk's sort, done
    hash_name = dst.record.hash if dst.record and hashes else None
    digests: dict[str, str] = {}
    if hash_name and dst.record is not None:
        digests = {f.name: f.digest for f in dst.record.files if f.digest}
    # the columnar path first (columnar.py): a clean HF-to-ranks layout ends here
    fast = columnar.check(src, dst, tour, hash_name, digests)
    if fast is not None:  # every shard equal, every checksum too: nothing else to read
        seconds = time.perf_counter() - t0
        moved = fast.src_bytes + fast.dst_bytes
        level.figures.update(
            tensors=fast.tensors,
            shards=fast.shards,
            padded_shards=0,
            src_bytes=fast.src_bytes,
            dst_bytes=fast.dst_bytes,
            hash=hash_name,
            rehashed_files=0,
            threads=fast.threads,
            seconds=seconds,
            throughput_mb_s=moved / seconds / 1e6 if seconds > 0 else None,
        )
        level.rows = tour.rows
        level.seconds = seconds
        return level.close()
    feeds = {p: Feed(p, hash_name) for p in dst.files if p.name in digests} if hash_name else {}
    shapes = {t.fqn: t.shape for t in src.model.tensors}
    workers, results = run_tasks(_tasks(src, tour.triples(), shapes), src, feeds)
    for w in workers:
        w.release()  # the buffers (~30 MiB with 2 threads) before the findings are worded
    give_back_heap()
    # only a shard that differs needs its element count (the message's "n of m elements")
    keys = {r[1] for r in results}
    compared = tour.numel(keys) if keys else {}
    for message, where in _findings(results, compared):
        level.fail(message, **where)
        tour.rows.fail(where["fqn"])
    if feeds:
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
        tensors=len(tour.rows),
        shards=tour.shards,
        padded_shards=tour.padded,
        src_bytes=src_bytes,
        dst_bytes=dst_bytes,
        hash=hash_name,
        rehashed_files=sum(f.rehashed for f in feeds.values()),
        threads=len(workers),
        seconds=seconds,
        throughput_mb_s=(src_bytes + dst_bytes) / seconds / 1e6 if seconds > 0 else None,
    )
    level.rows = tour.rows
    level.seconds = seconds
    return level.close()


def _tasks(
    src: Source,
    by_fqn: Iterable[tuple[str, list[DstShard], int]],  # with the shards' bytes
    shapes: dict[str, tuple[int, ...]],
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
    sizes = Sizes()
    kinds = Geometries()
    for fqn, shards, dst_bytes in by_fqn:
        shape = shapes[fqn]
        plain = _plain(src, fqn, shape, shards, span_src, sizes, kinds)
        if plain is not None:  # a span of plain tensors (spans.py): no per-tensor plan
            reads, geo, single, nbytes, dst_n = plain
            if batch:
                yield ("blocks", batch)
                batch, size = [], 0
            if span is not None and (
                not span.fits(reads, span_src)
                or span.dst_bytes + dst_bytes > span_dst
                or len(span.parts) >= SPAN_PARTS
            ):
                yield ("span", span)
                span = None
            if span is None:
                span = Span()
            span.add(reads)
            if single and len(reads) == 1:  # an HF SRC, say: one list of one tuple a shard
                f, _, b, _, local = reads[0]
                span.parts += [
                    (s, f, b, local, p[0], n) for s, p, n in zip(shards, geo, dst_n, strict=True)
                ]
            else:
                add = span.parts.append
                for s, parts, n in zip(shards, geo, dst_n, strict=True):
                    for part in parts:
                        r = reads[part[0]]
                        add((s, r[0], r[2], r[4], part, n))
                span.multi = span.multi or not single
            span.tensor_bytes += nbytes
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
    sizes: Sizes,
    kinds: Geometries,
) -> tuple[list[Any], tuple[tuple[PartGeometry, ...], ...], bool, int, tuple[int, ...]] | None:
    """A tensor a span can hold: ``(SRC reads, each DST shard's parts, whether each is one
    part, the tensor's bytes, each DST shard's bytes)``, else None.

    SRC holds it as rectangular shards (one whole tensor in an HF checkpoint), each one box
    filling its local tensor, of one byte-sized dtype, at most ``cap`` bytes in all; every DST
    shard is one box filling its local tensor (no padding, no parts), of that dtype; the SRC
    boxes tile the tensor (:func:`~shardctl.verify.bitwise.spans.geometry`). A SRC read is
    ``(file, path, begin, nbytes, local shape)``, one per SRC shard in its order; a part's
    first field indexes them.

    What depends only on the shards' shapes and pieces (the checks, the geometry, the bytes)
    is decided once per kind, looked up by the identity of those objects (``Geometries.ids``).
    """
    if cap <= 0 or not shape or 0 in shape:
        return None
    reads: list[Any]
    ss: Any = None
    if isinstance(src.shards, HfShards):  # one whole shard per tensor: no object built
        got = src.shards.whole(fqn)
        if got is None or got[3] != shape:
            return None
        file, begin, dtype, _ = got
        reads = [(file, src.files[file].path, begin, sizes(dtype, shape), shape)]
        src_ids: Any = ()
    else:
        ss = src.shards.get(fqn)
        if not ss:
            return None
        dtype = ss[0].dtype
        if any(q.dtype != dtype for q in ss):
            return None
        reads = [
            (q.file, src.files[q.file].path, q.begin, sizes(dtype, q.local_shape), q.local_shape)
            for q in ss
        ]
        src_ids = tuple([id(q.pieces) for q in ss] + [id(q.local_shape) for q in ss])
        if len(reads) > 1 and not Span().fits(reads, cap):
            return None  # two of its shards apart in one SRC file (or over the cap)
    if sum(r[3] for r in reads) > cap or any(s.dtype != dtype for s in shards):
        return None
    key = (
        dtype,
        shape,
        src_ids,
        tuple([id(s.pieces) for s in shards] + [id(s.local_shape) for s in shards]),
    )
    hit = kinds.ids.get(key)
    if hit is None:
        held = (
            ss and [(q.pieces, q.local_shape) for q in ss],
            [(s.pieces, s.local_shape) for s in shards],
        )
        dst_n = tuple([sizes(dtype, s.local_shape) for s in shards])
        hit = kinds.remember(key, _geometry(dtype, shape, ss, shards, kinds), dst_n, held)
    geo, single, dst_n = hit[0], hit[1], hit[2]
    if geo is None:
        return None
    return reads, geo, single, sizes(dtype, shape), dst_n


def _geometry(
    dtype: str,
    shape: tuple[int, ...],
    ss: Any,
    shards: list[DstShard],
    kinds: Geometries,
) -> tuple[tuple[PartGeometry, ...], ...] | None:
    """``_plain``'s checks of a new kind of tensor, then its geometry (None: not plain).
    ``ss``: the SRC shards, None for an HF SRC (one whole shard)."""
    if uint_of(dtype) is None or not all(s.is_rectangular for s in (*(ss or ()), *shards)):
        return None
    if ss is None:
        boxes: tuple[Box, ...] = (((0,) * len(shape), shape),)
    else:
        boxes = tuple((q.pieces[0].offsets, q.pieces[0].sizes) for q in ss)
    return kinds(shape, boxes, tuple((s.pieces[0].offsets, s.pieces[0].sizes) for s in shards))


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
