"""Bitwise level, columnar: a ``ranks`` DST of an HF SRC compared by kind of box, with no
object and no Python step per shard.

At 90,000 tensors split four ways the span path (``spans.py``) still spent ~10 µs of Python
per shard (its parts, reads, batches): ~2 s against ~0.4 s to read both trees. Here the whole
comparison works on the record's arrays (:mod:`shardctl.checkpoint.record_table`):

- every DST shard is a row: its tensor, DST file and first byte, its one piece's box in the
  tensor (offsets, sizes), and from the HF header the SRC file and first byte of its tensor;
- a box of a tensor of shape ``G`` is, in SRC's bytes, a contiguous run of ``r`` bytes
  repeated along a few outer dims at fixed byte strides (``io.mapped.box_kind``: trailing
  whole dims folded into the run): one *kind* per (item size, ``G``'s byte strides, box
  sizes) — a few dozen in a 90,000-tensor MoE;
- each DST file is read front to back once, with ``preadv`` into a reused buffer, in windows
  cut at shard boundaries, each holding about ``WINDOW`` bytes of DST and of SRC (a column
  cut's box spans whole SRC rows); SRC's bytes are read with ``preadv`` too, into a second
  buffer: what each compare below needs, nothing else;
- in a window the shards of one kind from one SRC file are gathered with one numpy indexing of
  a strided view of the SRC stretches they span, read back to back (a row per possible start
  byte, as ``spans._fill_batch`` does), and from the DST buffer the same way (``GATHER``
  bytes a side per call), and compared 8 bytes at a time in one numpy call; a shard of
  ``BY_SHARD`` bytes or more is compared in place, its SRC box (the stretch it spans: a
  column cut's whole rows) against its DST bytes, with no gathered copy; shards that are one
  contiguous run of SRC (whole tensors, cuts of their leading dim) and follow one another in
  DST and in one SRC file are compared as one stretch of each side, when they add up to
  ``BY_SHARD`` bytes (an ep split keeps experts whole and in SRC's order); a shard over
  ``LARGE`` bytes is compared by itself, a slab of its outer rows at a time;
- a tensor of ``BY_TENSOR`` bytes or more cut by columns (o_proj, down_proj, w2 at tp > 1)
  is compared by a job of its own, after the files': its SRC rows read once, a slab at a
  time, against each of its shards' DST bytes; compared shard by shard, each shard's box
  would read all the tensor's rows for its own band (``_column_cuts``);
- every DST byte read feeds the file's checksum as it is read (the record's hash is of the
  whole file); the buffers are reused from window to window and file to file, so memory
  stays flat;
- DST files, then those tensors, are compared on ``THREADS`` threads, one job each (reads,
  numpy's copies and compares and the checksum release the GIL).

At 90,000 tensors (tmpfs, 2 cores) the whole verify took 2.2-2.5 s against 3.4-3.9 s on the
span path (Mixtral-shaped, tp 2 x ep 2), 4.5 s against 6.2 s at tp 8 (720,000 shards), and
3.0-3.4 s against 4.1-4.7 s for DeepSeek-V3's FP8 shape in 176 files (ep 8), and 2.2-2.3 s
once 51,661 of its shards (its expert weights of 32 KiB among them) were compared as 6,446
stretches (these with both files mapped).

Reads, not maps: a page of a map costs a fault to touch and an ``MADV_DONTNEED`` to give
back, so a mapped compare ran at ~5-6 GB/s on one thread where ``preadv`` into a buffer the
caches hold reads ~12 GB/s and the compare in cache runs at ~35 GB/s. Reading DST and SRC's
stretches, the DeepSeek-V3-shaped verify went 2.06 -> 1.66 s (medians of 8, interleaved; the
level itself ~1.45 -> 0.76 s); a Mixtral-shaped tp 2 x ep 2 split of 12,403 tensors (128 KiB
expert halves, a third of them column cuts, compared in place) had spent 1.24 of 2.2
thread-seconds faulting SRC's pages (0.34 after), 1.68 -> 1.48 s whole; reading the gathers'
and the large column cuts' SRC too, the DeepSeek-V3-shaped verify is 1.83 -> 1.46 s against
the last mapped version (medians of 8, CPU 2.43 -> 1.93 s, peak 168 -> 142 MiB).

A file cut short under the run is a short read (``OSError``), which hands the run over as a
difference does; with no map there is no ``SIGBUS`` to fear, whenever the cut lands.

Anything this path does not cover — a non-HF SRC, a shard of several pieces or with padding, a
sub-byte dtype, a tensor SRC lacks or holds differently, a row the structure level found wrong
— returns ``None`` before reading a byte, and the per-span/per-block path decides. So does any
difference or checksum mismatch: that path then names each shard and its first differing
element exactly as before (it reads everything again; a failing verify is the rare case).
"""

from __future__ import annotations

import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cached_property
from itertools import chain
from operator import attrgetter
from pathlib import Path
from typing import Any

import numpy as np

from shardctl.checkpoint.record_table import pad_rows
from shardctl.checkpoint.source import HfShards, Source
from shardctl.dtypes import DTYPE_BITS
from shardctl.io.mapped import (
    Kind,
    box_kind,
    box_span,
    contiguous_kinds,
    row_kinds,
    rows_view,
)
from shardctl.verify.bitwise.pipeline import threads
from shardctl.verify.bitwise.walk import Walk
from shardctl.verify.boxes import FdCache, Scratch, pread_into, uint_of
from shardctl.verify.dst import Destination, RecordDstShards

ENABLED = True  # off: the span / block paths decide every shard (tests compare the two)
# Bytes a window holds, DST and SRC each. With maps, each window cost a few syscalls that gave
# up the GIL (a size check per file, ``MADV_DONTNEED`` of what it mapped: ~30-70 µs each with
# the other thread busy): 2 MiB windows spent ~0.8 s of a 3 GB verify there. With DST read into
# a buffer, 4, 8 and 16 MiB windows are alike at 90,000 tensors (1 and 2 MiB: ~0.3 s slower).
# 8 MiB, with maps: 12,000 tensors / 3 GB 3.6-3.8 s -> 2.5-2.9 s, 90,000 tensors 3.4 -> 2.7 s
# (2 cores, tmpfs), peak 215 -> 130 MiB and 186 -> 195 MiB. Past ``MANY`` shards the record's
# tables alone take ~200 MiB (a tp-8 split of 90,000 tensors: 720,000 shards, 211 MiB of
# heap), and ``WINDOW_MANY`` keeps that run under 256 MiB (240-245 MiB with maps; 8 MiB
# windows: 269).
WINDOW = 8 * 2**20
WINDOW_MANY = 2 * 2**20
MANY = 2**18
# Bytes gathered from each side per numpy call (the copies compared), whatever the window.
GATHER = 2 * 2**20
# A shard of at least BY_SHARD bytes in runs of at least BY_SHARD_RUN is compared by itself,
# in place: gathering both sides and comparing the copies ran at ~1 GB/s whatever the shard
# size, one ``array_equal`` of the two views at ~1.9 GB/s for 8 KiB shards and ~4.7 for 64 KiB
# alone. In a run each such call costs ~10 µs of Python besides: with the cut at 4 KiB a
# 90,000-tensor verify (8 KiB experts) went 2.9 -> 4.3 s, at 32 KiB it is unchanged and a
# 12,000-tensor one (128 KiB) goes 2.9-3.2 -> 2.3-2.45 s.
BY_SHARD = 32 * 2**10
BY_SHARD_RUN = 256
# Threads at most (one DST file each): each holds a window's buffers and copies (~20 MiB); the
# compare is memory-bound, and two kept a 90,000-tensor verify under 256 MiB where four did not.
THREADS = 2
# A shard of more bytes is compared by itself, in slabs of about this many bytes.
LARGE = 4 * 2**20
# SRC stretches of a window's gathered boxes less than this far apart are read as one.
SPAN_GAP = 16 * 2**10
# A tensor of at least this many bytes cut by columns is compared by a job of its own, its SRC
# rows read once for all its shards (a tp-4 down_proj's were read 4 times, once a shard):
# dense Llama 4 GB, tp 4, bitwise level with checksums 0.77-0.80 -> 0.62-0.66 s (cat of both
# trees ~0.5 s), without them 0.72-0.81 -> 0.55-0.59 s.
BY_TENSOR = 2**20


@dataclass(frozen=True)
class Figures:
    """What the level reports of a run that found every shard equal."""

    tensors: int
    shards: int
    src_bytes: int
    dst_bytes: int
    threads: int


def check(
    src: Source, dst: Destination, tour: Walk, hash_name: str | None, digests: dict[str, str]
) -> Figures | None:
    """Compare every DST shard with SRC (and each file named in ``digests`` with its recorded
    ``hash_name`` checksum); the figures when all are equal, else None (nothing reported: the
    caller's path decides, from the start)."""
    if not ENABLED or not isinstance(dst.shards, RecordDstShards):
        return None
    if not isinstance(src.shards, HfShards) or tour.record is None:
        return None
    plan = _plan(src, dst.shards)
    if plan is None:
        return None
    paths = dst.shards.paths
    src_paths = [f.path for f in src.files]
    held = set(np.unique(plan.file).tolist())
    jobs = [
        (f, path, digests.get(path.name) if hash_name else None) for f, path in enumerate(paths)
    ]
    jobs = [(f, path, digest) for f, path, digest in jobs if f in held or digest is not None]
    # the biggest files first, one file a thread (its checksum is fed in order)
    per_file = np.bincount(plan.file, weights=plan.nbytes, minlength=len(paths))
    jobs.sort(key=lambda j: -float(per_file[j[0]]))
    # then the column cuts' tensors, each its SRC rows read once for all its shards
    cuts = _column_cuts(plan, hashed=bool(hash_name and digests))
    stop = threading.Event()
    window = WINDOW if plan.tensor.size <= MANY else WINDOW_MANY

    local = threading.local()  # each thread's buffers and SRC files, kept from file to file
    every: list[_Reads] = []

    def one(job: tuple[int, Path, str | None] | np.ndarray) -> bool:
        reads = getattr(local, "reads", None)
        if reads is None:
            reads = local.reads = _Reads()
            every.append(reads)
        try:
            if isinstance(job, np.ndarray):
                ok = not stop.is_set() and _compare_tensor(plan, job, paths, src_paths, reads)
            else:
                f, path, digest = job
                ok = _compare_file(plan, f, path, src_paths, hash_name, digest, stop, window, reads)
        except (OSError, ValueError):
            ok = False  # a file that changed or vanished: the other path words it
        if not ok:
            stop.set()
        return ok

    todo: list[tuple[int, Path, str | None] | np.ndarray] = [*jobs, *cuts]
    n = max(1, min(threads(), THREADS, len(todo)))
    try:
        if n == 1:
            done = all(one(j) for j in todo)
        else:
            with ThreadPoolExecutor(n, thread_name_prefix="shardctl-columnar") as pool:
                done = all(list(pool.map(one, todo)))
    finally:
        for reads in every:
            reads.close()
    if not done:
        return None
    plan.threads = n
    ordered, _ = tour.record
    tour.fill(plan.tensor, plan.nbytes)
    return Figures(
        tensors=int(ordered.size),
        shards=int(plan.tensor.size),
        src_bytes=int(plan.tensor_bytes[ordered].sum()),
        dst_bytes=int(plan.nbytes.sum()),
        threads=plan.threads,
    )


@dataclass
class _Plan:
    """One entry per DST shard (arrays), and per kind of box its byte geometry."""

    tensor: np.ndarray  # record tensor index
    file: np.ndarray  # DST path index
    begin: np.ndarray  # first byte in the DST file
    nbytes: np.ndarray
    src_file: np.ndarray  # SRC file index
    src_start: np.ndarray  # first byte of the box's first run in the SRC file
    kind: np.ndarray  # index into ``kinds``
    kinds: list[Kind]  # outer sizes, their byte strides, run (io.mapped.box_kind)
    tensor_bytes: np.ndarray  # per record tensor: its bytes (SRC's figure)
    tensor_src: np.ndarray  # per record tensor: its first byte in its SRC file
    threads: int = 1
    # per shard: compared by its tensor's job (:func:`_column_cuts`), not its file's
    by_tensor: np.ndarray | None = None

    @cached_property
    def geometry(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per kind: the bytes of a box, the SRC bytes it spans, its contiguous run."""
        box = np.array([math.prod(o) * r for o, _, r in self.kinds] or [0], dtype=np.int64)
        span = np.array([box_span(*k) for k in self.kinds] or [0], dtype=np.int64)
        run = np.array([k[2] for k in self.kinds] or [0], dtype=np.int64)
        return box, span, run

    @cached_property
    def contiguous(self) -> np.ndarray:
        """Per kind: whether a box of it is one contiguous run of SRC bytes (no outer dims)."""
        return contiguous_kinds(self.kinds)


def _plan(src: Source, shards: RecordDstShards) -> _Plan | None:
    table = shards.table
    ranks = table.ranks
    if not ranks or shards.shard_count() != table.shard_count():
        return None  # a row the structure level found wrong is not compared here
    width = table.width
    tensors = table.tensors
    hf = src.shards
    assert isinstance(hf, HfShards)
    n_t = len(tensors)
    # per record tensor: item size, SRC file and first byte (an HF tensor is one whole shard);
    # C-level maps over the tensors, one Python step per distinct dtype
    fqns = list(map(attrgetter("fqn"), tensors))
    dtypes = list(map(attrgetter("dtype"), tensors))
    shapes = list(map(attrgetter("shape"), tensors))
    got = hf.wholes(fqns)
    if got is None:
        return None
    if got[2] != dtypes or got[3] != shapes:
        return None
    sizes_of: dict[str, int] = {}
    for dtype in set(dtypes):
        if uint_of(dtype) is None:
            return None  # sub-byte: compared as whole-tensor bytes by the other path
        sizes_of[dtype] = DTYPE_BITS[dtype] // 8
    item = np.fromiter(map(sizes_of.__getitem__, dtypes), dtype=np.int64, count=n_t)
    src_file = np.array(got[0], dtype=np.int64)
    src_begin = np.array(got[1], dtype=np.int64)
    del got
    # each tensor's shape padded at the end with 1s, as the record pads its boxes
    flat = np.fromiter(chain.from_iterable(shapes), dtype=np.int64)
    shape = pad_rows(flat, np.fromiter(map(len, shapes), dtype=np.int64, count=n_t), width, 1)
    if (shape <= 0).any():
        return None
    # byte strides of each tensor's dims (row-major)
    stride = np.empty((n_t, width), dtype=np.int64)
    acc = item.copy()
    for d in range(width - 1, -1, -1):
        stride[:, d] = acc
        acc = acc * shape[:, d]
    tensor_bytes = acc  # item × numel

    # Rank by rank, keeping only what the compare reads (~36 B a shard: 720,000 shards at tp 8
    # are ~26 MB); the boxes and their byte geometry live only while their rank is worked out.
    out: dict[str, list[np.ndarray]] = {k: [] for k in ("t", "f", "b", "n", "sf", "ss", "k")}
    global_kind: dict[tuple[int, ...], int] = {}
    kinds: list[Kind] = []
    for i, r in enumerate(ranks):
        if len(r) == 0:
            continue
        starts = np.asarray(r.piece_start)
        if (np.diff(starts) != 1).any():
            return None  # several pieces (fused parts) or none
        p = starts[:-1]
        offsets, sizes = r.offsets[p], r.sizes[p]
        if (r.local_offsets[p] != 0).any() or not np.array_equal(sizes, r.local_shape):
            return None  # padding or a box that does not fill its local tensor
        tensor = np.asarray(r.tensor, dtype=np.int64)
        begin = np.frombuffer(shards.begins(i), dtype=np.int64)
        if (offsets < 0).any() or (sizes <= 0).any() or (offsets + sizes > shape[tensor]).any():
            return None
        if (begin < 0).any():
            return None
        st = stride[tensor]
        its = item[tensor]
        # kinds of box: (item, strides, sizes) rows, each turned once into outer dims and a run
        local, uniq = row_kinds(np.concatenate([its[:, None], st, sizes], axis=1))
        ids = []
        for row in uniq.tolist():
            key = tuple(row)
            k = global_kind.get(key)
            if k is None:
                k = global_kind[key] = len(kinds)
                kinds.append(box_kind(row[0], row[1 : 1 + width], row[1 + width :]))
            ids.append(k)
        out["t"].append(tensor.astype(np.int32))
        out["f"].append(np.asarray(r.file, dtype=np.int32))
        out["b"].append(begin)
        out["n"].append(its * sizes.prod(axis=1))
        out["sf"].append(src_file[tensor].astype(np.int32))
        out["ss"].append(src_begin[tensor] + (offsets * st).sum(axis=1))
        out["k"].append(np.asarray(ids, dtype=np.int32)[local])
        del offsets, sizes, st, its, local
    if not out["t"]:
        return None
    # one column at a time, each rank's parts dropped as it is joined: joined all at once, the
    # parts and the whole were alive together (~26 MB more at 720,000 shards)
    cat = {k: np.concatenate(out.pop(k)) for k in list(out)}
    return _Plan(
        tensor=cat["t"],
        file=cat["f"],
        begin=cat["b"],
        nbytes=cat["n"],
        src_file=cat["sf"],
        src_start=cat["ss"],
        kind=cat["k"],
        kinds=kinds,
        tensor_bytes=tensor_bytes,
        tensor_src=src_begin,
    )


class _Reads:
    """One thread's reads: buffers reused from file to file (a fresh buffer page-faults on
    every page), and SRC's files opened once each."""

    def __init__(self) -> None:
        self.dst = Scratch()
        self.src = Scratch()
        self.spans = Scratch()  # the gathers' stretches of one SRC file, beside ``src``
        self.fds = FdCache()

    def src_bytes(self, path: Path, offset: int, n: int) -> np.ndarray:
        """SRC bytes ``[offset, offset + n)`` of ``path``, valid until the next call (a file
        cut short: ``OSError``)."""
        return self.read(self.src, path, offset, n)

    def read(self, into: Scratch, path: Path, offset: int, n: int) -> np.ndarray:
        """Bytes ``[offset, offset + n)`` of ``path`` in buffer ``into``, valid until its next
        use (a file cut short: ``OSError``)."""
        mv = into.get(n)
        pread_into(self.fds(path), mv, offset, path)
        return np.frombuffer(mv, dtype=np.uint8)

    def src_spans(
        self, path: Path, starts: np.ndarray, span: int | np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """SRC bytes ``[a, a + span)`` of ``path`` for every ``a`` in ``starts`` (``span``:
        one for all, or one each): the stretches they cover (merged where less than
        ``SPAN_GAP`` apart) read back to back into one buffer, and where each ``a`` landed in
        it. Valid until the next call."""
        order = np.argsort(starts, kind="stable")
        first = starts[order]
        reach = np.maximum.accumulate(first + np.broadcast_to(span, starts.shape)[order])
        cut = np.flatnonzero(first[1:] > reach[:-1] + SPAN_GAP) + 1
        lo = first[np.concatenate(([0], cut))]
        hi = reach[np.concatenate((cut - 1, [first.size - 1]))]
        at = np.concatenate(([0], np.cumsum(hi - lo)))
        mv = self.spans.get(int(at[-1]))
        fd = self.fds(path)
        for a, b, o in zip(lo.tolist(), hi.tolist(), at.tolist(), strict=False):
            pread_into(fd, mv[o : o + b - a], a, path)
        stretch = np.zeros(first.size, dtype=np.int64)
        stretch[cut] = 1
        stretch = np.cumsum(stretch)
        where = np.empty(first.size, dtype=np.int64)
        where[order] = first - lo[stretch] + at[stretch]
        return np.frombuffer(mv, dtype=np.uint8), where

    def close(self) -> None:
        self.fds.close()


class _DstFile:
    """A DST file read front to back, each byte once, every byte read fed to its checksum."""

    def __init__(self, fd: int, path: Path, hasher: Any, scratch: Scratch) -> None:
        self.fd, self.path, self.hasher, self.scratch = fd, path, hasher, scratch
        self.pos = 0  # where the next read starts

    def read(self, a: int, n: int) -> np.ndarray:
        """Bytes ``[a, a + n)``, read where the last read ended (``a`` is :attr:`pos`); valid
        until the next read (a file cut short: ``OSError``)."""
        if a != self.pos:
            raise ValueError(f"DST read at byte {a}, expected {self.pos}")
        mv = self.scratch.get(n)
        pread_into(self.fd, mv, a, self.path)
        if self.hasher is not None:
            self.hasher.update(mv)
        self.pos = a + n
        return np.frombuffer(mv, dtype=np.uint8)

    def skip(self, b: int, chunk: int) -> None:
        """On to byte ``b``: the bytes before it read ``chunk`` at a time into the checksum,
        or passed over when there is no checksum to feed."""
        if b < self.pos:
            raise ValueError(f"DST skip back to byte {b} from {self.pos}")
        if self.hasher is None:
            self.pos = b
        while self.pos < b:
            self.read(self.pos, min(chunk, b - self.pos))


def _compare_file(
    plan: _Plan,
    f: int,
    path: Path,
    src_paths: list[Path],
    hash_name: str | None,
    digest: str | None,
    stop: threading.Event,
    window: int,
    reads: _Reads,
) -> bool:
    """Whether every shard in DST file ``f`` equals SRC (and the file its ``digest``), read in
    windows of about ``window`` bytes; False too once ``stop`` is set (another file
    differed)."""
    rows = np.flatnonzero(plan.file == f)
    rows = rows[np.argsort(plan.begin[rows], kind="stable")]
    begin, nbytes = plan.begin[rows], plan.nbytes[rows]
    end = begin + nbytes
    spans = plan.geometry[1]
    if (begin[1:] < end[:-1]).any():
        return False  # overlapping shards: the other path reports them
    hasher = None
    if digest is not None:
        from shardctl.io.checksum import new_hash

        hasher = new_hash(hash_name or "")
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        if rows.size and end[-1] > size:
            return False
        # windows cut at shard starts, about ``window`` bytes each; the first one starts at byte 0
        # and the last ends at the end of the file, so the file is read whole, in order, once
        # (each byte into the checksum as it is read). A shard weighs its bytes in DST and the
        # SRC stretch its box spans (a tp-8 column cut of a row-major tensor uses 1/8 of each
        # row, but reads all of the rows): a window holds about 2 x WINDOW whatever the cut.
        weight = np.cumsum(nbytes + spans[plan.kind[rows]])
        cut = np.searchsorted(
            weight, np.arange(window, int(weight[-1]) if rows.size else 0, window)
        )
        bounds = [0, *[c for c in np.unique(cut).tolist() if 0 < c < rows.size], rows.size]
        dst = _DstFile(fd, path, hasher, reads.dst)
        for w in range(len(bounds) - 1):
            if stop.is_set():
                return False  # another file differed
            lo, hi = bounds[w], bounds[w + 1]
            until = size if hi == rows.size else int(begin[hi])
            if until < dst.pos:
                return False
            if hi > lo and not _compare_window(plan, rows[lo:hi], dst, src_paths, reads):
                return False
            dst.skip(until, window)  # the gap after the window's last shard, if any
        return hasher is None or hasher.hexdigest() == digest
    finally:
        os.close(fd)


def _compare_window(
    plan: _Plan,
    rows: np.ndarray,
    dst: _DstFile,
    src_paths: list[Path],
    reads: _Reads,
) -> bool:
    """The shards ``rows`` (in DST order): each stretch of them under ``LARGE`` bytes read as
    one block of DST, a larger one by itself, slab by slab. So is one whose box spans more
    than ``2 x LARGE`` bytes of SRC (a tp-8 column cut of 4 MiB spans 32 MiB of rows): read
    whole, its rows would take a buffer that size on each thread for the rest of the run."""
    if plan.by_tensor is not None:
        rows = rows[~plan.by_tensor[rows]]  # their tensor's job compares them
        if not rows.size:
            return True
    begin, nbytes = plan.begin[rows], plan.nbytes[rows]
    big = (nbytes > LARGE) | (plan.geometry[1][plan.kind[rows]] > 2 * LARGE)
    # a stretch of small shards is one block, unless more than LARGE bytes lie between two
    # (a large shard left to its tensor's job)
    apart = begin[1:] - (begin[:-1] + nbytes[:-1]) > LARGE
    cuts = np.flatnonzero((big[1:] != big[:-1]) | apart) + 1
    for part in np.split(np.arange(rows.size), cuts):
        if big[part[0]]:
            for i in part.tolist():
                dst.skip(int(begin[i]), LARGE)
                if not _compare_large(plan, int(rows[i]), dst, src_paths, reads):
                    return False
            continue
        a, b = int(begin[part[0]]), int(begin[part[-1]] + nbytes[part[-1]])
        if b - a > 4 * (WINDOW + LARGE):
            return False  # gaps between shards no window accounts for: the other path
        dst.skip(a, LARGE)
        block = dst.read(a, b - a)
        if not _compare_block(plan, rows[part], block, a, src_paths, reads):
            return False
    return True


def _column_cuts(plan: _Plan, *, hashed: bool) -> list[np.ndarray]:
    """The jobs of tensors cut by columns: per tensor of ``BY_TENSOR`` bytes or more, its
    shards (rows of ``plan``) that each take a band of columns from every row of it (one
    outer dim over all its rows: ``G[:, a:b]`` of a 2-D tensor, the SRC stretch whole rows).
    Compared shard by shard, each would read all of the tensor's rows for its own band: a tp-4
    o_proj or down_proj read 4 times over. A tensor's job reads its rows once, a slab at a
    time, against every shard's DST bytes. ``plan.by_tensor`` marks those shards; their files'
    jobs read them (the checksum) but leave the compare to the tensor's job.

    A job saves reading the tensor ``k - 1`` times over for its ``k`` shards, and costs
    reading their DST bytes a second time when their files' jobs read them for a checksum
    (``hashed``): then only tensors of three shards or more get one."""
    runs = plan.geometry[2]
    one_outer = np.array([len(k[0]) == 1 for k in plan.kinds] or [False], dtype=bool)
    outer0 = np.array([k[0][0] if len(k[0]) == 1 else 0 for k in plan.kinds] or [0])
    stride0 = np.array([k[1][0] if len(k[1]) == 1 else 0 for k in plan.kinds] or [0])
    k, t = plan.kind, plan.tensor
    col = plan.src_start - plan.tensor_src[t]
    whole = plan.tensor_bytes[t]
    ok = (
        one_outer[k]
        & (outer0[k] * stride0[k] == whole)  # every row of the tensor
        & (col >= 0)
        & (col + runs[k] <= stride0[k])  # a band of one row
        & (whole >= BY_TENSOR)
    )
    rows = np.flatnonzero(ok)
    if not rows.size:
        return []
    rows = rows[np.argsort(t[rows], kind="stable")]
    edges = np.flatnonzero(np.diff(t[rows])) + 1
    least = 3 if hashed else 2
    # every shard of a job takes its band of the same rows (one stride: a tensor cut on two
    # dims by different shards stays with its files' jobs)
    jobs = [
        g
        for g in np.split(rows, edges)
        if g.size >= least and (stride0[k[g]] == stride0[k[g[0]]]).all()
    ]
    if jobs:
        plan.by_tensor = np.zeros(plan.tensor.size, dtype=bool)
        plan.by_tensor[np.concatenate(jobs)] = True
    return jobs


def _compare_tensor(
    plan: _Plan, rows: np.ndarray, paths: list[Path], src_paths: list[Path], reads: _Reads
) -> bool:
    """One tensor's column cuts ``rows`` (:func:`_column_cuts`) against its SRC rows, read a
    slab of about ``LARGE`` bytes at a time; each shard's DST bytes for the slab's rows read
    beside them (its file's job reads them too, for the checksum)."""
    t = int(plan.tensor[rows[0]])
    k = plan.kind[rows]
    stride = int(plan.kinds[int(k[0])][1][0])
    count = int(plan.kinds[int(k[0])][0][0])
    runs = plan.geometry[2][k].tolist()
    cols = (plan.src_start[rows] - plan.tensor_src[t]).tolist()
    begins = plan.begin[rows].tolist()
    files = [paths[f] for f in plan.file[rows].tolist()]
    src_path, s0 = src_paths[int(plan.src_file[rows[0]])], int(plan.tensor_src[t])
    step = max(1, LARGE // stride)
    for i in range(0, count, step):
        j = min(count, i + step)
        src = reads.src_bytes(src_path, s0 + i * stride, (j - i) * stride).reshape(j - i, stride)
        for run, c, b, path in zip(runs, cols, begins, files, strict=True):
            got = reads.read(reads.dst, path, b + i * run, (j - i) * run).reshape(j - i, run)
            if not _equal_in_place(src[:, c : c + run], got):
                return False
    return True


def _compare_block(
    plan: _Plan,
    rows: np.ndarray,
    dst: np.ndarray,
    base: int,
    src_paths: list[Path],
    reads: _Reads,
) -> bool:
    """The shards ``rows`` against ``dst``, the DST bytes from byte ``base`` on: stretches
    first, then per kind of box and SRC file, gathered or one by one in place."""
    left = _compare_runs(plan, rows, dst, base, src_paths, reads)
    if left is None:
        return False
    rows = rows[left]
    if not rows.size:
        return True
    # groups of one SRC file and kind of box, SRC file by SRC file
    nk = len(plan.kinds)
    group = plan.src_file[rows].astype(np.int64) * nk + plan.kind[rows]
    order = np.argsort(group, kind="stable")
    rows, group = rows[order], group[order]
    edges = np.flatnonzero(np.diff(group)) + 1
    firsts = np.concatenate(([0], edges)).tolist()
    ends = [*edges.tolist(), rows.size]
    box_bytes, spans, runs = plan.geometry
    in_place = (box_bytes >= BY_SHARD) & (runs >= BY_SHARD_RUN)  # per kind
    gathered = ~in_place[plan.kind[rows]]
    where_all = np.zeros(rows.size, dtype=np.int64)
    got = np.empty(0, dtype=np.uint8)
    read_file = -1
    dst_rows: dict[int, np.ndarray] = {}
    for lo, hi in zip(firsts, ends, strict=True):
        members = rows[lo:hi]
        sf, k = divmod(int(group[lo]), nk)
        outer, strides, run = plan.kinds[k]
        n, span = int(box_bytes[k]), int(spans[k])
        at = plan.begin[members] - base
        if in_place[k]:
            # each shard's box against its DST bytes in place: the SRC stretch it spans read
            # into a buffer (a column cut's: whole rows), no gathered copies
            shape, path = (*outer, run), src_paths[sf]
            for a, b in zip(plan.src_start[members].tolist(), at.tolist(), strict=True):
                box = np.lib.stride_tricks.as_strided(
                    reads.src_bytes(path, a, span), shape, (*strides, 1), writeable=False
                )
                if not _equal_in_place(box, dst[b : b + n].reshape(shape)):
                    return False
            continue
        if sf != read_file:
            # the SRC stretches every gathered box of this SRC file spans (whatever its
            # kind), read back to back into one buffer: one read per stretch, not per kind
            upto = int(np.searchsorted(group, (sf + 1) * nk))
            sel = np.flatnonzero(gathered[lo:upto]) + lo
            picked = rows[sel]
            got, where_all[sel] = reads.src_spans(
                src_paths[sf], plan.src_start[picked], spans[plan.kind[picked]]
            )
            read_file = sf
        where = where_all[lo:hi]
        # a view of the stretches with a row per possible first byte
        view = rows_view(got, (*outer, run), strides, span)
        into = dst_rows.get(n)
        if into is None:
            into = dst_rows[n] = rows_view(dst, (n,), (), n)
        # gathered GATHER bytes a side at a time: the copies stay small whatever the window
        step = max(1, GATHER // n)
        for i in range(0, len(members), step):
            part = slice(i, i + step)
            want = view[where[part]].reshape(-1, n)
            if not _equal(want, into[at[part]]):
                return False
    return True


def _compare_runs(
    plan: _Plan,
    rows: np.ndarray,
    dst: np.ndarray,
    base: int,
    src_paths: list[Path],
    reads: _Reads,
) -> np.ndarray | None:
    """Compare the *runs* among ``rows`` (a block's, in DST order; ``dst`` its bytes from byte
    ``base``): shards whose SRC bytes are one contiguous stretch (a whole tensor, or a cut of
    its leading dim) that follow one another in DST and in one SRC file, as one stretch of
    each side (SRC's read into a buffer), when they add up to ``BY_SHARD`` bytes or more.
    Returns which rows are left for the gathers, None on a difference.

    An ep split of an HF checkpoint keeps each expert whole, in SRC's order: DeepSeek-V3's
    46,000 FP8 expert weights of 32 KiB were each one in-place compare (~10 µs of Python a
    shard, on both threads' GIL); there 51,661 shards are 6,446 stretches."""
    whole = plan.contiguous[plan.kind[rows]]
    if not whole.any():
        return np.ones(rows.size, dtype=bool)
    at = np.flatnonzero(whole)
    r = rows[at]
    b, n = plan.begin[r], plan.nbytes[r]
    sf, ss = plan.src_file[r], plan.src_start[r]
    joins = (
        (at[1:] == at[:-1] + 1)
        & (b[1:] == b[:-1] + n[:-1])
        & (sf[1:] == sf[:-1])
        & (ss[1:] == ss[:-1] + n[:-1])
    )
    first = np.flatnonzero(np.concatenate(([True], ~joins)))
    length = np.add.reduceat(n, first)
    count = np.diff(np.append(first, r.size))
    take = (length >= BY_SHARD) & (count > 1)
    if not take.any():
        return np.ones(rows.size, dtype=bool)
    for i, size in zip(first[take].tolist(), length[take].tolist(), strict=True):
        a, d = int(ss[i]), int(b[i]) - base
        if not _equal(reads.src_bytes(src_paths[int(sf[i])], a, size), dst[d : d + size]):
            return None
    left = np.ones(rows.size, dtype=bool)
    left[at[np.repeat(take, count)]] = False
    return left


def _equal_in_place(a: np.ndarray, b: np.ndarray) -> bool:
    """:func:`_equal` of one box of SRC (strided, its last dim contiguous) and its DST bytes
    (``b``, the box's shape), 8 bytes at a time when its run allows, with no copy of either."""
    if a.shape[-1] % 8 == 0:
        a, b = a.view(np.uint64), b.view(np.uint64)
    return bool(np.array_equal(a, b))


def _equal(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two byte arrays of one shape hold the same bytes: compared 8 bytes at a time
    where they are contiguous and their last dim is a multiple of 8 (8x fewer elements)."""
    if a.shape != b.shape:
        return False
    if a.ndim and a.shape[-1] % 8 == 0 and a.flags.c_contiguous and b.flags.c_contiguous:
        a, b = a.view(np.uint64), b.view(np.uint64)
    return bool((a == b).all())


def _compare_large(
    plan: _Plan,
    r: int,
    dst: _DstFile,
    src_paths: list[Path],
    reads: _Reads,
) -> bool:
    """One large shard, a slab of its outermost dim at a time (a run, when it has no outer
    dims, in pieces of ``LARGE`` bytes, both sides read into buffers)."""
    outer, strides, run = plan.kinds[int(plan.kind[r])]
    sf = int(plan.src_file[r])
    s0, d0 = int(plan.src_start[r]), int(plan.begin[r])
    if not outer:
        for a in range(0, run, LARGE):
            b = min(run, a + LARGE)
            got = dst.read(d0 + a, b - a)
            if not _equal(reads.src_bytes(src_paths[sf], s0 + a, b - a), got):
                return False
        return True
    inner = math.prod(outer[1:]) * run  # DST bytes per outermost index
    if inner > 4 * LARGE:
        return False  # one outer row would be a slab of its own, too large: the block path
    span = box_span(outer[1:], strides[1:], run)
    # a slab reads about LARGE bytes of SRC: a column cut reads whole SRC rows
    step = max(1, LARGE // max(inner, strides[0]))
    for i in range(0, outer[0], step):
        j = min(outer[0], i + step)
        a = s0 + i * strides[0]
        want = np.lib.stride_tricks.as_strided(
            reads.src_bytes(src_paths[sf], a, (j - i - 1) * strides[0] + span),
            shape=(j - i, *outer[1:], run),
            strides=(strides[0], *strides[1:], 1),
            writeable=False,
        )
        got = dst.read(d0 + i * inner, (j - i) * inner)
        if not _equal(want.reshape(-1), got):
            return False
    return True
