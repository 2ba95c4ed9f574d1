"""Small tensors, many to a buffer: a file's tensors of at most one block each are appended to
one pending buffer that is hashed and written with one ``pwrite``.

The common small tensor (one target piece filling its local tensor, read from rectangular
source shards: an HF tensor split ``S(d)``, or ``tp`` shards merged back) takes a short path
(:meth:`Batching._fast`): its kind (shapes and pieces of it and its sources) maps to byte runs
worked out once (:mod:`shardctl.reshard.runs`), and the runs are executed later, a group at a
time, out of source windows (:mod:`shardctl.reshard.window`) — no ``Box`` object, no ``pread``,
no block planning and no copy call per tensor. Anything else (fused parts, padding, scalars,
replicas cut differently) goes the general way through
:func:`~shardctl.reshard.boxes.plan_boxes`, which also reports inconsistent sources."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from shardctl.blocks import scalar_shape
from shardctl.checkpoint.source import SourceShard
from shardctl.dtypes import itemsize
from shardctl.layout.types import LocalTensor, Piece
from shardctl.reshard.boxes import Box, local_in, plan_boxes
from shardctl.reshard.gather import Gather
from shardctl.reshard.runs import Pending, Run, runs_of
from shardctl.reshard.window import Windows
from shardctl.reshard.writer import OutFile

# A target's (fqn, dtype, local_shape, pieces, begin): a LocalTensor's fields, unboxed.
Fields = tuple[str, str, tuple[int, ...], tuple[Piece, ...], int]
# A target's sources as ``(local_shape, pieces)`` each: with the target's own, its kind.
SourceKind = tuple[tuple[tuple[int, ...], tuple[Piece, ...]], ...]
# Entries of the identity caches (``kind_ids``, ``source_kinds``) before they are cleared.
KIND_IDS = 4096
# One copy of the short path: (source shard, source-local start, target-local start, sizes).
_Part = tuple[SourceShard, tuple[int, ...], tuple[int, ...], tuple[int, ...]]


class Batching(Gather, Windows):
    """The small-tensor half of :class:`~shardctl.reshard.copy.Executor` (which sets these)."""

    block: int
    sources: Mapping[str, tuple[SourceShard, ...]]
    held_key: object = None  # the source tuple ``held`` was made from (identity)
    held: list[tuple[SourceShard, tuple[int, ...], tuple[int, ...]]] | None = None
    kinds: dict[object, tuple[int, tuple[Run, ...] | None]]  # a target kind -> bytes, runs
    # the same by identity (``_fast``): (dtype, ids of shape, pieces, source kind) -> (bytes,
    # runs, the objects named)
    kind_ids: dict[tuple[str, int, int, int], tuple[Any, ...]]
    # a source kind by the ids of its shapes and pieces -> (the shared tuple, the objects)
    source_kinds: dict[tuple[int, ...], tuple[SourceKind, SourceKind]]
    source_kind_values: dict[SourceKind, SourceKind]
    pending: Pending
    progress: Callable[[int], None] | None

    def _buffer(self, asking: OutFile | None = None) -> bytearray:
        raise NotImplementedError  # the executor's buffer pool

    def _fast(
        self,
        out: OutFile,
        f: Fields,
        srcs: tuple[SourceShard, ...],
        kind: SourceKind,
    ) -> bool:
        """Append target ``f`` to ``out``'s pending buffer as byte runs
        (:mod:`~shardctl.reshard.runs`), executed later with their like; False (nothing done)
        when it is not a case the short path handles. ``srcs``: its sources as looked up
        (``self.sources[fqn]``); ``kind``: their ``(local_shape, pieces)``, once per fqn."""
        # By identity first: a split shares its shape and pieces objects among every target of
        # a class, and hashing the pieces by value (dataclasses) was ~20% of this path. The
        # entry holds the objects its ids name, so no id is reused while it is cached.
        ik = (f[1], id(f[2]), id(f[3]), id(kind))
        hit = self.kind_ids.get(ik)
        if hit is not None:
            n, runs = hit[0], hit[1]
        else:
            key = (f[1], f[2], f[3], kind)
            try:
                n, runs = self.kinds[key]
            except KeyError:
                t = LocalTensor(*f)
                n, runs = self.kinds[key] = (t.nbytes, self._runs(t, srcs))
            if len(self.kind_ids) >= KIND_IDS:
                self.kind_ids.clear()
            self.kind_ids[ik] = (n, runs, f[2], f[3], kind)
        if runs is None:
            return False
        buf = self._room(out, f[4], n)
        if out.pend_reads:
            self._issue(out)  # reads queued by the general path go first (input checksums)
        at = out.pend_len
        windows = self.windows
        groups = self.pending.groups
        for k, src, dst, shape, span in runs:
            sh = srcs[k]
            file = sh.file
            where = sh.begin + src
            win = windows.get(file)
            if win is None or where < win[0] or where + span > win[0] + win[1]:
                # The pending runs read the windows: execute them before one is replaced.
                self.pending.run(windows)
                self._window(file, where, span)
            else:
                windows.move_to_end(file)
            g = groups.get((file, id(buf), shape))
            if g is None:
                g = groups[(file, id(buf), shape)] = (buf, [], [])
            g[1].append(where)
            g[2].append(at + dst)
        out.pend_len += n
        return True

    def _source_kind(self, srcs: tuple[SourceShard, ...]) -> SourceKind:
        """``srcs``' ``(local_shape, pieces)``, as one shared tuple per distinct value (what
        ``_fast`` keys by identity): looked up by the ids of the objects (a record source
        shares them among every shard of a class), by value when they are new."""
        ids = tuple([id(x.pieces) for x in srcs] + [id(x.local_shape) for x in srcs])
        hit = self.source_kinds.get(ids)
        if hit is not None:
            return hit[0]
        value = tuple([(x.local_shape, x.pieces) for x in srcs])
        got = self.source_kind_values.setdefault(value, value)
        if len(self.source_kinds) >= KIND_IDS:
            self.source_kinds.clear()
            self.source_kind_values = {got: got}
        self.source_kinds[ids] = (got, value)  # ``value`` holds the objects ``ids`` name
        return got

    def _runs(self, t: LocalTensor, srcs: tuple[SourceShard, ...]) -> tuple[Run, ...] | None:
        """``t``'s runs, when it fits a block and is a case the short path handles."""
        if not 0 < t.nbytes <= self.block:
            return None
        parts = self._parts(t, srcs)
        if parts is None:
            return None
        return runs_of(parts, srcs, t.local_shape, itemsize(t.dtype), self.window_size())

    def _parts(self, t: LocalTensor, srcs: tuple[SourceShard, ...]) -> list[_Part] | None:
        """The copies that fill ``t`` when it is one piece filling its local tensor and its
        sources are single-piece rectangular shards that tile that piece along one dim (the
        first holder of a replicated piece wins, as in ``plan_boxes``); None otherwise.
        ``srcs`` is ``t``'s source tuple as the caller looked it up: the parts name its members
        (a lazy ``Source.shards`` may build new objects on every lookup)."""
        if len(t.pieces) != 1:
            return None
        p = t.pieces[0]
        shape = t.local_shape
        nd = len(shape)
        if nd == 0 or p.sizes != shape or any(p.local_offsets):
            return None
        if len(srcs) == 1 and len(srcs[0].pieces) == 1:
            sh = srcs[0]
            q = sh.pieces[0]
            if len(q.sizes) != nd or len(sh.local_shape) != nd:
                return None
            inside = local_in(p, q)
            if inside is None:
                return None
            return [(sh, inside, (0,) * nd, shape)]
        held = self._held(srcs, nd)
        if held is None:
            return None
        parts: list[_Part] = []
        cut = -1  # the one dim the sources split
        po, ps = p.offsets, p.sizes
        for sh, qo, qs in held:
            lo, sizes, src_lo = [], [], []
            short = -1  # the dim this part does not span
            for d in range(nd):
                a, b = po[d], qo[d]
                x = a if a > b else b
                m = min(a + ps[d], b + qs[d]) - x
                if m <= 0:
                    break
                if m != ps[d]:
                    if short != -1:
                        return None
                    short = d
                lo.append(x - a)
                sizes.append(m)
                src_lo.append(x - b)
            else:
                if short != -1:
                    if cut not in (-1, short):
                        return None
                    cut = short
                parts.append((sh, tuple(src_lo), tuple(lo), tuple(sizes)))
        # Every part spans all of the piece but along ``cut``: they tile it when their runs
        # along ``cut`` follow each other from 0 to its end (else the general path reports).
        d = max(cut, 0)
        parts.sort(key=lambda x: x[2][d])
        at = 0
        for part in parts:
            if part[2][d] != at:
                return None
            at += part[3][d]
        if at != p.sizes[d] or (cut == -1 and len(parts) != 1):
            return None
        return parts

    def _held(
        self, srcs: tuple[SourceShard, ...], nd: int
    ) -> list[tuple[SourceShard, tuple[int, ...], tuple[int, ...]]] | None:
        """The distinct source pieces of ``srcs`` (one tensor's sources) as ``(shard, offsets,
        sizes)`` (replicas: the first holder), when every source is one rectangular piece of
        ``nd`` dims; else None. One entry cached, by the tuple's identity: a tensor's targets
        are written one after another, and the cached shards must be members of ``srcs``."""
        if self.held_key is srcs:
            return self.held
        held: list[tuple[SourceShard, tuple[int, ...], tuple[int, ...]]] = []
        seen: set[tuple[tuple[int, ...], tuple[int, ...]]] = set()
        ok = True
        for sh in srcs:
            q = sh.pieces[0] if len(sh.pieces) == 1 else None
            if q is None or len(q.sizes) != nd or q.sizes != sh.local_shape or any(q.local_offsets):
                ok = False
                break
            if (q.offsets, q.sizes) not in seen:
                seen.add((q.offsets, q.sizes))
                held.append((sh, q.offsets, q.sizes))
        self.held_key, self.held = srcs, (held if ok else None)
        return self.held

    def _small_boxes(self, t: LocalTensor) -> list[Box] | None:
        """``t``'s boxes when it can be batched: it fits a block, and so does every source
        local tensor it reads (a gather reads whole source rows into the one-block scratch)."""
        if not 0 < t.nbytes <= self.block:
            return None
        s = itemsize(t.dtype)
        boxes = plan_boxes(t.fqn, t.pieces, self.sources[t.fqn])
        if any(math.prod(b.src.local_shape) * s > self.block for b in boxes):
            return None
        return boxes  # plan_boxes gives a scalar its one-element box (scalar_piece)

    def _small(self, out: OutFile, t: LocalTensor, boxes: list[Box]) -> None:
        """Append ``t`` (at most one block) to ``out``'s pending buffer.

        Tensors of a file lie back to back, so a file's small tensors fill one buffer that is
        hashed and written with one ``pwrite``; reads contiguous in a source file and in the
        buffer (a file's experts that stay adjacent) are merged into one ``pread`` at flush.
        At 90,000 tensors this turns 180,000 thread hand-offs into ~1,500.
        """
        n = t.nbytes
        buf = self._room(out, t.begin, n)
        s = itemsize(t.dtype)
        shape = scalar_shape(t.local_shape)
        mv = memoryview(buf)[out.pend_len : out.pend_len + n]
        self._fill(mv, s, shape, (0,) * len(shape), shape, boxes, out, out.pend_len)
        out.pend_len += n

    def _started(self, out: OutFile) -> None:
        """Have ``out``'s writer write its header before its first bytes. The writer inflates
        it when it gets there, so at most one header per writer is alive: inflated here, every
        started file's sat in the queues at once (a tp-8 split of 90,000 tensors: ~10 MB)."""
        if not out.started:
            out.started = True
            out.writer.q.put(("header", out))

    def _room(self, out: OutFile, begin: int, n: int) -> bytearray:
        """``out``'s pending buffer, made the place for ``n`` bytes at file offset ``begin``:
        flushed first when they would not fit or would not follow its bytes."""
        if out.pend is not None and (
            out.pend_len + n > self.block or begin != out.pend_at + out.pend_len
        ):
            self._flush(out)
        if out.pend is None:
            out.pend = self._buffer(out)
            out.pend_at, out.pend_len = begin, 0
        return out.pend

    def _flush(self, out: OutFile) -> None:
        """Issue ``out``'s merged reads, execute the pending runs and hand its pending buffer to
        the writer."""
        if out.pend is None:
            return
        self.pending.run(self.windows)
        self._issue(out)
        buf, out.pend = out.pend, None
        mv = memoryview(buf)
        self._started(out)
        out.writer.q.put(("data", out, out.pend_at, mv[: out.pend_len], buf))
        if self.progress is not None:
            self.progress(out.pend_len)
