"""Reshard's columnar path: a Hugging Face source's small tensors cut into rank files with no
Python step per target.

At 90,000 tensors split four ways the short path (``batching``) still spent ~4 µs of Python
per target (its kind, runs, windows, groups): ~1.6 s of a 3.6 s reshard that ``cp -r`` does in
0.8 s. Here every target the short path would take is a row of arrays, worked out a segment
of ``SEGMENT`` targets at a time:

- its output file, position and first byte there, its byte count;
- from the HF header, the SRC file and first byte of its box, and its *kind*
  (``io.mapped.box_kind``: a contiguous run repeated along a few outer dims at fixed byte
  strides, one kind per (item size, tensor strides, box sizes), a few dozen in a 90k MoE).

The copy engine walks targets in the global tensor order (every output file's order), so the
run is cut into *chunks* of about ``CHUNK`` output bytes, at tensor boundaries. A chunk:

1. reads the SRC stretches its boxes span with ``preadv``, stretches less than ``GAP`` apart
   read as one: a target that is one contiguous run of SRC and shares no byte with another
   goes straight to its place in the chunk's buffer (each output file's targets back to back),
   the bytes around it into a scratch buffer, in the same call (every read goes through the
   engine's ``_readv``: the input checksum feed and the short-read error "input changed
   during run" are the same);
2. gathers the other targets of one kind with one numpy indexing of a strided view of the
   scratch (a row per possible first byte, as ``verify``'s columnar path does) and puts them
   into the chunk's buffer with one more;
3. hands each output file its stretch of the buffer (its next bytes: a file's targets tile
   it), to the same writer threads, which hash and ``pwrite`` them in order; the buffer is
   reused once every writer is done with it (:class:`~shardctl.reshard.writer.Lease`).

Reads use ``pread``, not a map: a source cut by another process mid-run is the engine's one
clear error, not a ``SIGBUS``.

A tensor goes the old way (``copy.Executor._group``) when any of its targets is not one box
filling its local tensor, is sub-byte, or spans more than ``SPAN_MAX`` bytes of SRC, or when
its targets add up to more than ``CHUNK`` (large tensors: the block path is a ``pread`` per
block already); its bytes are interleaved in file
order with the chunks'. A merge back to HF files takes the same chunks the other way
(:mod:`shardctl.reshard.columnar_merge`); any other source (ranks to ranks, an engine format's
relabelled shards) goes the old way entirely.

Memory: ``BUFFERS`` chunk buffers of ``2 x CHUNK`` bytes, a scratch of about as much (each
resident only as far as its chunks fill it: chunks are cut at ``CHUNK_MANY`` in a batch of
more than ``MANY`` targets), and ~100 bytes a target of one segment while its columns are
worked out and used. At 90,000
tensors (tmpfs, 2 cores) a ``--tp 2 --ep 2`` split took 2.8 s against 3.3 s the per-target
way (160 / 144 MiB peak), ``--tp 8`` 5.4-6.2 s against 8.0 s (~242 / 222 MiB).
"""

from __future__ import annotations

import math
import queue
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain, pairwise, repeat
from operator import attrgetter, itemgetter
from typing import TYPE_CHECKING, Any

import numpy as np

from shardctl.checkpoint.plan_files import FileTensors
from shardctl.checkpoint.record_table import pad_rows
from shardctl.checkpoint.source import HfShards
from shardctl.dtypes import DTYPE_BITS
from shardctl.io.mapped import Kind, box_kind, box_span, contiguous_kinds, row_kinds, rows_view
from shardctl.layout.types import Shard
from shardctl.reshard.writer import Lease, OutFile

_PIECES, _LOCAL = attrgetter("pieces"), attrgetter("local_shape")
_FQN, _DTYPE = attrgetter("fqn"), attrgetter("dtype")

if TYPE_CHECKING:
    from shardctl.reshard.copy import Executor

ENABLED = True  # off: every target goes the short/block paths (tests compare the two)
# Output bytes a chunk holds (about: it is cut at tensor boundaries). 4 MiB, not 2: half the
# hand-offs and ``pwrite`` calls; a 12,000-tensor 3 GB split took ~2.1-2.2 s in process against
# ~2.3-2.6 s (2 cores, tmpfs), for ~10-14 MiB more at peak (a 90k-tensor tp-8 split: 241 MiB
# -> 250-255).
CHUNK = 4 * 2**20
# ... but 1 MiB where a batch has more than MANY targets (small ones: a tp-8 split of 96,000
# tensors has 770,000 of ~2 KB). There the hand-offs are not what costs, the heap is: a chunk
# buffer and the scratch are resident as far as a chunk fills them (4 MiB chunks: ~256 MiB
# peak; 1 MiB: ~240).
CHUNK_MANY = 2**20
MANY = 2**18
# A target whose box spans more SRC bytes goes the block path (a pread per block).
SPAN_MAX = 2**20
# SRC holes at most this large are read through: one pread instead of two.
GAP = 64 * 2**10
# Chunk buffers: one being filled, the others with the writers.
BUFFERS = 3
# Targets worked out at a time (cut where a tensor starts): working out the columns of all of
# a tp-8 split of 90,000 tensors (720,000 targets) at once took 50 MB for a moment and peaked
# the run at 281 MiB, over the scale issue's 256 MiB.
SEGMENT = 65_536


@dataclass
class Columns:
    """A segment of the engine's merged walk (a few tensors' targets), as arrays."""

    file: np.ndarray  # index into the batch's ``outs``
    last: np.ndarray  # bool: the last target of its file
    begin: np.ndarray  # first byte in its output file
    src_file: np.ndarray  # SRC file index
    src_start: np.ndarray  # SRC byte of its box's first run
    kind: np.ndarray  # index into the run's ``Kinds``
    nbytes: np.ndarray  # per kind (the run's so far): a box's bytes
    spans: np.ndarray  # per kind: bytes from a box's first byte to its last
    ok: np.ndarray  # bool: its tensor goes this way
    fqn_start: np.ndarray  # bool: the first target of its tensor
    pos: int  # SRC file index x this + byte offset: one sortable int64 key per SRC byte


class Kinds:
    """The kinds of box a run has met (a few dozen), numbered once for all its segments."""

    def __init__(self) -> None:
        self.kinds: list[Kind] = []
        self.index: dict[tuple[int, ...], int] = {}
        self.spans: list[int] = []
        self.nbytes: list[int] = []

    def of(self, item: int, strides: list[int], sizes: tuple[int, ...]) -> int:
        geometry = (item, *strides, *sizes)
        k = self.index.get(geometry)
        if k is None:
            k = self.index[geometry] = len(self.kinds)
            kind = box_kind(item, strides, sizes)
            self.kinds.append(kind)
            self.spans.append(box_span(*kind))
            self.nbytes.append(math.prod(kind[0]) * kind[2])
        return k


@dataclass
class Batch:
    """What every segment of a batch reads: its files' targets (no copy of them)."""

    objs: list[Sequence[Any]]  # per file: the layout's Shard objects
    begins: list[np.ndarray]  # per file: each target's first byte (a view)
    sources: HfShards
    kinds: Kinds


def gather(
    objs: Sequence[Sequence[Any]], begins: Sequence[np.ndarray], file: np.ndarray, at: np.ndarray
) -> tuple[list[Any], np.ndarray]:
    """The objects and first bytes of targets ``(file, at)`` of per-file ``objs`` and
    ``begins``, in that order (C-level gathers per file: a batch's targets are never copied
    whole)."""
    out = np.empty(file.size, dtype=object)
    begin = np.empty(file.size, dtype=np.int64)
    for j in np.unique(file).tolist():
        sel = np.flatnonzero(file == j)
        idx = at[sel]
        got = itemgetter(*idx.tolist())(objs[j])
        out[sel] = [got] if sel.size == 1 else got
        begin[sel] = begins[j][idx]
    return out.tolist(), begin


def batch(planned: Sequence[FileTensors], sources: object) -> Batch | None:
    """The batch of output files ``planned`` when its targets may go this way: rank-layout
    files (``Shard`` objects with their own pieces) from an HF source; else None."""
    if not ENABLED or not isinstance(sources, HfShards):
        return None
    if any(p.pieces is not None for p in planned):
        return None  # pieces given apart from the shards (not a rank layout's files)
    objs = [p.objs for p in planned]
    if set(chain.from_iterable(map(type, o) for o in objs)) != {Shard}:
        return None
    begins = [np.frombuffer(p.begins, dtype=np.int64) for p in planned]
    return Batch(objs, begins, sources, Kinds())


def segments(keys: np.ndarray, weight: np.ndarray | None = None) -> list[tuple[int, int]]:
    """The merged walk (each target's tensor position, ``keys``) in segments of about
    ``SEGMENT`` targets (or of ``weight``, per target: a merge's target is its parts), cut
    where a tensor starts (a tensor's targets stay together)."""
    n = keys.size
    total = np.cumsum(weight) if weight is not None else np.arange(1, n + 1)
    if not n or total[-1] <= SEGMENT:
        return [(0, n)] if n else []
    starts = np.flatnonzero(keys[1:] != keys[:-1]) + 1
    band = total[starts - 1] // SEGMENT  # weight before each tensor, in segments
    cuts = starts[np.flatnonzero(np.diff(band, prepend=0))].tolist()
    return list(pairwise([0, *cuts, n]))


def plan(
    b: Batch, key: np.ndarray, file: np.ndarray, at: np.ndarray, last: np.ndarray
) -> Columns | None:
    """One segment as columns, or None when none of its tensors can go this way.

    Its targets in walk order: ``key``, ``file``, ``at``, ``last``: each one's tensor position
    in the global order, output file, position there and whether it ends the file. Working
    memory is ~100 bytes a target: a segment at a time keeps a tp-8 split of 90,000 tensors
    (720,000 targets) under the scale issue's 256 MiB."""
    n = key.size
    if (key < 0).any():
        return None
    objs, begin = gather(b.objs, b.begins, file, at)
    # ---- tensors (per distinct key): dtype, shape, SRC file and begin ----
    _, first, tinv = np.unique(key, return_index=True, return_inverse=True)
    tinv = tinv.reshape(-1)
    got = b.sources.wholes(map(_FQN, map(objs.__getitem__, first.tolist())))
    if got is None:
        return None
    s_files, s_begins, dtypes, shapes = got
    code = {d: i for i, d in enumerate(sorted(set(dtypes)))}
    items = [DTYPE_BITS[d] // 8 if DTYPE_BITS[d] % 8 == 0 else 0 for d in code]
    t_code = np.fromiter(map(code.__getitem__, dtypes), np.int64, len(dtypes))
    nd = np.fromiter(map(len, shapes), np.int64, len(shapes))
    width = max(1, int(nd.max()))
    shape = pad_rows(np.fromiter(chain.from_iterable(shapes), np.int64), nd, width, 1)
    src_file = np.array(s_files, dtype=np.int64)
    src_begin = np.array(s_begins, dtype=np.int64)
    del got, shapes, s_files, s_begins
    # ---- targets: their one piece (by the identity of the shared pieces objects) ----
    _, p_inv = np.unique(np.fromiter(map(id, map(_PIECES, objs)), np.int64, n), return_inverse=True)
    _, l_first, l_inv = np.unique(
        np.fromiter(map(id, map(_LOCAL, objs)), np.int64, n), return_index=True, return_inverse=True
    )
    pair = p_inv.reshape(-1).astype(np.int64) * len(l_first) + l_inv.reshape(-1)
    _, pair_first, pair_inv = np.unique(pair, return_index=True, return_inverse=True)
    del p_inv, l_inv, l_first, pair
    boxes: list[tuple[int, ...] | None] = []  # per pair: offsets then sizes, or None
    for i in pair_first.tolist():
        ps, ls = objs[i].pieces, objs[i].local_shape
        q = ps[0] if len(ps) == 1 else None
        fine = (
            q is not None
            and len(ls) > 0
            and q.sizes == ls
            and len(q.offsets) == len(ls)
            and not any(q.local_offsets)
        )
        boxes.append((*q.offsets, *ls) if fine and q is not None else None)
    # ---- a target's geometry depends only on (its tensor's dtype and shape, its box): one
    # Python step per such combination (a few dozen), arrays of indexes per target ----
    t_class, class_rows = row_kinds(np.concatenate([t_code[:, None], nd[:, None], shape], axis=1))
    combo = t_class[tinv] * len(boxes) + pair_inv.reshape(-1)
    _, c_first, c_inv = np.unique(combo, return_index=True, return_inverse=True)
    c_inv = c_inv.reshape(-1)
    c_ok, c_kind, c_off = [], [], []
    for u in combo[c_first].tolist():
        row = class_rows[u // len(boxes)].tolist()
        box = boxes[u % len(boxes)]
        size, rank, dims = items[row[0]], row[1], row[2 : 2 + row[1]]
        fine = box is not None and size > 0 and len(box) == 2 * rank
        offs, sizes = (box[:rank], box[rank:]) if box is not None and fine else ((), ())
        inside = zip(offs, sizes, dims, strict=True)
        if not (fine and all(0 <= o and o + z <= d for o, z, d in inside)):
            c_ok.append(False)
            c_kind.append(0)
            c_off.append(0)
            continue
        strides = [size] * rank
        for d in range(rank - 2, -1, -1):
            strides[d] = strides[d + 1] * dims[d + 1]
        k = b.kinds.of(size, strides, sizes)
        c_ok.append(0 < b.kinds.nbytes[k] and b.kinds.spans[k] <= SPAN_MAX)
        c_kind.append(k)
        c_off.append(sum(o * t for o, t in zip(offs, strides, strict=True)))
    del combo
    c_kind_arr = np.asarray(c_kind, dtype=np.int32)
    ok = np.asarray(c_ok, dtype=bool)[c_inv]
    # the target's dtype is its tensor's (a dtype cast is not this path's)
    own = np.fromiter(map(code.get, map(_DTYPE, objs), repeat(-1)), np.int64, n)
    ok &= own == t_code[tinv]
    del objs, own
    # ---- a tensor goes this way when all its targets can ----
    fqn_start = np.ones(n, dtype=bool)
    fqn_start[1:] = key[1:] != key[:-1]
    starts = np.flatnonzero(fqn_start)
    # ... and they add up to at most CHUNK (a chunk is then at most 2 x CHUNK: a tensor
    # replicated on 8 ranks would otherwise make one 8 x its size)
    count = np.diff(np.append(starts, n))
    total = np.add.reduceat(np.asarray(b.kinds.nbytes, dtype=np.int64)[c_kind_arr[c_inv]], starts)
    ok = np.repeat(np.logical_and.reduceat(ok, starts) & (total <= CHUNK), count)
    if not ok.any():
        return None
    kind = c_kind_arr[c_inv]
    spans = np.asarray(b.kinds.spans, dtype=np.int64)
    src_start = src_begin[tinv] + np.asarray(c_off, dtype=np.int64)[c_inv]
    # a power of two past every SRC byte read; 10,000 files of up to 256 TiB fit an int64 key
    pos = 1 << int((src_start + spans[kind]).max()).bit_length()
    if (int(src_file.max()) + 1) * pos >= 2**62:
        return None
    return Columns(
        file=file,
        last=last,
        begin=begin,
        src_file=src_file[tinv].astype(np.int32),
        src_start=src_start,
        kind=kind,
        nbytes=np.asarray(b.kinds.nbytes, dtype=np.int64),
        spans=spans,
        ok=ok,
        fqn_start=fqn_start,
        pos=pos,
    )


def chunks(cols: Columns, a: int, b: int, size: int | None = None) -> list[tuple[int, int]]:
    """Targets ``[a, b)`` (all this path's) cut into chunks of about ``size`` output bytes at
    tensor boundaries (a tensor's targets share its SRC reads): at the first tensor past each
    multiple of ``size`` (``CHUNK`` when None; a chunk is then at most ``size + CHUNK``)."""
    size = CHUNK if size is None else size
    weight = np.cumsum(cols.nbytes[cols.kind[a:b]])
    starts = np.flatnonzero(cols.fqn_start[a:b])
    if starts.size < 2:
        return [(a, b)]
    band = weight[starts[1:] - 1] // size  # bytes before each tensor, in chunks
    cuts = starts[1:][np.flatnonzero(np.diff(band, prepend=0))].tolist()
    return [(a + x, a + y) for x, y in pairwise([0, *cuts, b - a])]


class Chunks:
    """Writes chunks of targets for :class:`~shardctl.reshard.copy.Executor`: one scratch,
    ``BUFFERS`` leased chunk buffers."""

    def __init__(self, ex: Executor, kinds: Kinds) -> None:
        self.ex = ex
        self.kinds = kinds
        self.free: queue.Queue[np.ndarray] = queue.Queue()
        self.made = 0
        self.scratch = np.empty(0, dtype=np.uint8)
        self.views: dict[tuple[int, int], np.ndarray] = {}  # (kind, word) -> scratch rows
        # per kind, the widest word (8, 4, 2 or 1 bytes) its run and strides are made of
        self.words: list[int] = []
        self._flat = np.zeros(0, dtype=bool)

    def _buffer(self, need: int) -> tuple[np.ndarray, queue.Queue[np.ndarray] | None]:
        """A free chunk buffer (made up to ``BUFFERS``, then waited for) and where it goes
        back; a chunk over the usual size (a small tensor replicated on many ranks) gets a
        buffer of its own, dropped after its writes."""
        if need > 2 * CHUNK:  # (a tensor's targets are at most CHUNK: never, but kept safe)
            return np.empty(need, dtype=np.uint8), None
        while True:
            self.ex._check()
            try:
                return self.free.get_nowait(), self.free
            except queue.Empty:
                pass
            if self.made < BUFFERS:
                self.made += 1
                return np.empty(2 * CHUNK, dtype=np.uint8), self.free
            try:
                return self.free.get(timeout=0.2), self.free
            except queue.Empty:
                continue

    def _scratch(self, n: int) -> np.ndarray:
        if self.scratch.size < n:
            self.scratch = np.empty(-(-max(n, 2 * CHUNK) // 8) * 8, dtype=np.uint8)
            self.views.clear()
        return self.scratch

    def write(self, outs: list[OutFile], c: Columns, a: int, b: int) -> None:
        """Targets ``[a, b)`` of ``c`` (one chunk) into their files' writers."""
        self.ex._check()
        sl = slice(a, b)
        kind = c.kind[sl]
        nb = c.nbytes[kind]
        fj, begin = c.file[sl], c.begin[sl]
        files, lo, base, per_file, put = self.layout(fj, begin, nb)
        buf, home = self._buffer(int(per_file.sum()))
        scratch, at, placed = self.read(
            c.src_file[sl], c.src_start[sl], c.spans[kind], c.pos, buf, put, self.flat()[kind]
        )
        rest = np.flatnonzero(~placed)
        o = rest[np.argsort(kind[rest], kind="stable")]
        edges = np.flatnonzero(np.diff(kind[o])) + 1
        for members in np.split(o, edges) if o.size else ():
            k = int(kind[members[0]])
            src_at, dst_at = at[members], put[members]
            # moved in the widest words every offset and length allows: numpy copies a fancy
            # index's rows element by element, and bytes one at a time are ~8x slower
            word = self.word(k, src_at | dst_at)
            outer, strides, run = self.kinds.kinds[k]
            size = int(nb[members[0]])
            view = self.views.get((k, word))
            if view is None:
                view = self.views[k, word] = _rows(
                    scratch, word, (*outer, run), strides, int(c.spans[k])
                )
            into = _rows(buf, word, (size,), (), size)
            into[dst_at // word] = view[src_at // word].reshape(members.size, size // word)
        self.hand(outs, buf, home, files, lo, base, per_file, fj[c.last[sl]], int(nb.sum()))

    def flat(self) -> np.ndarray:
        """Per kind: its box is one contiguous run (no outer dims)."""
        n = len(self.kinds.kinds)
        if self._flat.size != n:
            self._flat = contiguous_kinds(self.kinds.kinds)
        return self._flat

    def word(self, k: int, offsets: np.ndarray) -> int:
        """The widest word kind ``k``'s run and strides and every one of ``offsets`` allow."""
        while len(self.words) <= k:
            _, strides, run = self.kinds.kinds[len(self.words)]
            self.words.append(_word(math.gcd(run, *strides)))
        word = self.words[k]
        while word > 1 and (offsets & (word - 1)).any():
            word //= 2
        return word

    def read(
        self,
        sf: np.ndarray,
        ss: np.ndarray,
        span: np.ndarray,
        pos: int,
        into: np.ndarray | None = None,
        dst: np.ndarray | None = None,
        flat: np.ndarray | None = None,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """SRC bytes ``[ss, ss + span)`` of files ``sf`` read in file and byte order, holes
        under ``GAP`` read through, never across two files: the scratch, where each stretch
        starts in it, and which were read straight into place instead.

        With ``into``: a piece that is one contiguous run (``flat``) and shares no SRC byte
        with another piece goes straight to ``into[dst : dst + span]``, in the same
        ``preadv`` as the scratch's bytes around it, so its bytes are copied once (the
        gather from the scratch was a second copy: ~0.2 s of a 90,000-tensor split, 0.4 s
        of a 12,000-tensor 3 GB one). Everything else lands in the scratch as before."""
        key_lo = sf.astype(np.int64) * pos + ss
        key_hi = key_lo + span
        o = np.argsort(key_lo, kind="stable")
        lo_s, hi_s = key_lo[o], key_hi[o]
        reach = np.maximum.accumulate(hi_s)
        brk = np.ones(o.size, dtype=bool)
        brk[1:] = lo_s[1:] > reach[:-1] + GAP
        brk[1:] |= lo_s[1:] // pos != lo_s[:-1] // pos  # never a read across two files
        heads = np.flatnonzero(brk)
        g_lo = lo_s[heads]
        g_hi = np.append(reach[heads[1:] - 1], reach[-1])
        gid = np.cumsum(brk) - 1
        direct = np.zeros(o.size, dtype=bool)
        if into is not None:
            assert dst is not None and flat is not None
            alone = np.ones(o.size, dtype=bool)
            alone[1:] = lo_s[1:] >= reach[:-1]  # no earlier piece reaches into it
            alone[:-1] &= hi_s[:-1] <= lo_s[1:]  # nor does it reach into the next
            direct = alone & flat[o]
        # scratch bytes: the stretches less the pieces read into place
        d_n = np.where(direct, hi_s - lo_s, 0)
        d_before = np.cumsum(d_n) - d_n  # bytes into place before each piece (all stretches)
        g_len = g_hi - g_lo - np.add.reduceat(d_n, heads)
        g_at = np.concatenate([[0], np.cumsum(g_len)[:-1]])
        at_sorted = g_at[gid] + (lo_s - g_lo[gid]) - (d_before - d_before[heads][gid])
        at = np.empty_like(at_sorted)
        at[o] = at_sorted
        placed = np.empty_like(direct)
        placed[o] = direct
        scratch = self._scratch(int(g_len.sum()))
        mv = memoryview(scratch.data)
        if not direct.any():
            for f_lo, n, at0 in zip(g_lo.tolist(), g_len.tolist(), g_at.tolist(), strict=True):
                self.ex._read(f_lo // pos, f_lo % pos, mv[at0 : at0 + n])
            return scratch, at, placed
        assert into is not None and dst is not None
        out = memoryview(into.data)
        d_idx = np.flatnonzero(direct)
        d_lo, d_hi = lo_s[d_idx].tolist(), hi_s[d_idx].tolist()
        d_put = dst[o[d_idx]].tolist()
        d_gid = gid[d_idx].tolist()
        j, nd = 0, len(d_lo)
        for g, (f_lo, f_hi, s_at) in enumerate(
            zip(g_lo.tolist(), g_hi.tolist(), g_at.tolist(), strict=True)
        ):
            views: list[memoryview] = []
            x = f_lo  # SRC byte (key) the views reach so far
            while j < nd and d_gid[j] == g:
                a, b = d_lo[j], d_hi[j]
                if a > x:
                    views.append(mv[s_at : s_at + a - x])
                    s_at += a - x
                views.append(out[d_put[j] : d_put[j] + b - a])
                x = b
                j += 1
            if f_hi > x:
                views.append(mv[s_at : s_at + f_hi - x])
            self.ex._readv(f_lo // pos, f_lo % pos, views)
        return scratch, at, placed

    @staticmethod
    def layout(
        fj: np.ndarray, begin: np.ndarray, nb: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Each output file's targets back to back in a chunk buffer: (files, each one's first
        byte, its start in the buffer, its bytes, each target's start in the buffer)."""
        files, first, inv = np.unique(fj, return_index=True, return_inverse=True)
        inv = inv.reshape(-1)
        per_file = np.bincount(inv, weights=nb, minlength=files.size).astype(np.int64)
        base = np.concatenate([[0], np.cumsum(per_file)[:-1]])
        lo = begin[first]
        put = base[inv] + begin - lo[inv]
        if (put + nb > base[inv] + per_file[inv]).any():
            # a file's targets do not tile it (plan_files writes them back to back): a bug
            raise AssertionError("reshard columnar: a chunk's targets leave a hole in a file")
        return files, lo, base, per_file, put

    def hand(
        self,
        outs: list[OutFile],
        buf: np.ndarray,
        home: queue.Queue[np.ndarray] | None,
        files: np.ndarray,
        lo: np.ndarray,
        base: np.ndarray,
        per_file: np.ndarray,
        ending: np.ndarray,
        nbytes: int,
    ) -> None:
        """Hand each file its stretch of ``buf`` (its next bytes), then close the files whose
        last target was in it (``ending``)."""
        ex = self.ex
        lease = Lease(home, buf, files.size)
        done = memoryview(buf.data)
        for x, j in enumerate(files.tolist()):
            out = outs[j]
            if out.pend is not None:
                ex._flush(out)  # the block path's pending bytes of this file go first
            ex._started(out)
            n0, n = int(base[x]), int(per_file[x])
            out.writer.q.put(("data", out, int(lo[x]), done[n0 : n0 + n], lease))
        if ex.progress is not None:
            ex.progress(nbytes)
        for j in ending.tolist():
            ex._close(outs[j])


def _word(n: int) -> int:
    """The widest of 8, 4, 2, 1 that divides ``n``."""
    return next(w for w in (8, 4, 2, 1) if n % w == 0)


def _rows(
    buf: np.ndarray, word: int, shape: tuple[int, ...], strides: tuple[int, ...], span: int
) -> np.ndarray:
    """:func:`~shardctl.io.mapped.rows_view` of byte array ``buf`` in ``word``-byte words: a
    row per possible first word (shape, strides and span in bytes, multiples of ``word``)."""
    if word == 1:
        return rows_view(buf, shape, strides, span)
    words = buf[: buf.size - buf.size % word].view(f"u{word}")
    return np.lib.stride_tricks.as_strided(
        words,
        shape=(words.size - span // word + 1, *shape[:-1], shape[-1] // word),
        strides=(word, *strides, word),
        writeable=buf.flags.writeable,
    )
