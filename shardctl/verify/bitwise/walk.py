"""Bitwise level, the walk: DST's shards of the tensors SRC has, tensor by tensor, in an order
every DST file agrees with, handed out as they are needed rather than held.

At 90,213 tensors split four ways (180,852 shards) holding every shard (a ``DstShard`` each,
sorted by file and offset, grouped by tensor) and a dict row per tensor cost ~45 MiB and ~0.9 s
before the first byte was compared. For a ``ranks`` DST (``RecordDstShards``) the order is
worked out on the record's columns (tensor, file, offset: three integer arrays) and each
tensor's shards are built when the tasks reach it; the report's rows are kept as columns
(:class:`TensorRows`) and become dicts only when read. Other DSTs (an HF checkpoint, where
there is one shard per tensor) keep the materialized walk.
"""

from __future__ import annotations

import array
import math
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, overload

import numpy as np

from shardctl.blocks import scalar_piece
from shardctl.checkpoint.source import Source
from shardctl.dtypes import nbytes
from shardctl.verify.dst import Destination, DstShard, RecordDstShards


class Sizes(dict[tuple[str, tuple[int, ...]], int]):
    """``(dtype, shape) -> bytes``, remembered: 90,000 tensors have a few dozen of them."""

    def __call__(self, dtype: str, shape: tuple[int, ...]) -> int:
        key = (dtype, shape)
        n = self.get(key)
        if n is None:
            n = self[key] = nbytes(dtype, math.prod(shape))
        return n


class TensorRows(Sequence[dict[str, Any]]):
    """The level's row per tensor, ``{"fqn", "shards", "bytes", "status"}``, kept as columns
    (~20 B a tensor instead of a ~350 B dict) and built on access; ``status`` is ``pass``
    unless :meth:`fail` named the tensor."""

    def __init__(self) -> None:
        self._fqn: list[str] = []
        self._shards = np.zeros(0, dtype=np.int64)
        self._bytes = np.zeros(0, dtype=np.int64)
        self._n = 0
        self._failed: set[str] = set()

    @classmethod
    def from_columns(cls, fqns: list[str], shards: np.ndarray, sizes: np.ndarray) -> TensorRows:
        """The rows of ``fqns`` in that order, with their shard counts and bytes (arrays)."""
        rows = cls()
        rows._fqn = fqns
        rows._shards = shards.astype(np.int64)
        rows._bytes = sizes.astype(np.int64)
        rows._n = len(fqns)
        return rows

    def add(self, fqn: str, shards: int, size: int) -> None:
        if self._n == self._shards.size:  # grow by doubling: amortized O(1)
            self._shards = np.resize(self._shards, max(1024, 2 * self._n))
            self._bytes = np.resize(self._bytes, max(1024, 2 * self._n))
        self._fqn.append(fqn)
        self._shards[self._n] = shards
        self._bytes[self._n] = size
        self._n += 1

    def fail(self, fqn: str) -> None:
        self._failed.add(fqn)

    def tally(self) -> tuple[int, int, int]:
        """``(tensors passed, their shards, tensors failed)`` from the columns, without a row
        built (rendering 90,000 rows three times to count them took ~0.15 s)."""
        n = self._n
        total = int(self._shards[:n].sum())
        if not self._failed:
            return n, total, 0
        failed = self._failed
        at = [i for i, fqn in enumerate(self._fqn) if fqn in failed]
        return n - len(at), total - int(self._shards[at].sum()), len(at)

    def __len__(self) -> int:
        return self._n

    @overload
    def __getitem__(self, i: int) -> dict[str, Any]: ...

    @overload
    def __getitem__(self, i: slice) -> Sequence[dict[str, Any]]: ...

    def __getitem__(self, i: int | slice) -> dict[str, Any] | Sequence[dict[str, Any]]:
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(self._n))]
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise IndexError(i)
        fqn = self._fqn[i]
        return {
            "fqn": fqn,
            "shards": int(self._shards[i]),
            "bytes": int(self._bytes[i]),
            "status": "fail" if fqn in self._failed else "pass",
        }

    def __iter__(self) -> Iterator[dict[str, Any]]:
        shards = self._shards[: self._n].tolist()
        sizes = self._bytes[: self._n].tolist()
        failed = self._failed
        for fqn, n, b in zip(self._fqn, shards, sizes, strict=True):
            yield {
                "fqn": fqn,
                "shards": n,
                "bytes": b,
                "status": "fail" if fqn in failed else "pass",
            }

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence):
            return NotImplemented
        return len(self) == len(other) and list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]


def _bytes_and_padded(s: DstShard) -> tuple[int, bool]:
    """A shard's bytes, and whether its pieces leave local elements uncovered (padding)."""
    pieces = s.pieces
    padded = not (len(pieces) == 1 and pieces[0].sizes == s.local_shape) and sum(
        scalar_piece(p).numel for p in pieces
    ) < math.prod(s.local_shape)
    return nbytes(s.dtype, math.prod(s.local_shape)), padded


class Walk:
    """The tensors in order, each with its DST shards (sorted by file path, then offset);
    counts and rows are recorded as :meth:`pairs` hands them out."""

    def __init__(
        self,
        items: Iterable[tuple[str, list[DstShard]]],
        lookup: Any,
        record: tuple[np.ndarray, list[str]] | None = None,
    ) -> None:
        self._items = items
        self._lookup = lookup  # fqn -> its shards (only for shards that differ)
        # a ``ranks`` DST: the record tensors' ids in walk order, and every record tensor's fqn
        self.record = record
        self.rows = TensorRows()
        self.shards = 0
        self.padded = 0

    def fill(self, tensor: np.ndarray, nbytes: np.ndarray) -> None:
        """The counts and rows :meth:`triples` would record, from every shard's record tensor
        id and bytes (arrays), for a caller that compared them without walking."""
        assert self.record is not None
        ordered, fqns = self.record
        counts = np.bincount(tensor, minlength=len(fqns))
        sizes = np.zeros(len(fqns), dtype=np.int64)
        np.add.at(sizes, tensor, nbytes)
        names = list(map(fqns.__getitem__, ordered.tolist()))
        self.rows = TensorRows.from_columns(names, counts[ordered], sizes[ordered])
        self.shards = int(counts[ordered].sum())
        self.padded = 0

    def pairs(self) -> Iterator[tuple[str, list[DstShard]]]:
        for fqn, shards, _ in self.triples():
            yield fqn, shards

    def triples(self) -> Iterator[tuple[str, list[DstShard], int]]:
        """``(fqn, shards, their bytes)``; each shard's bytes and padding are worked out once
        per kind (its dtype, local shape and pieces object), not once per shard."""
        rows = self.rows
        seen: dict[tuple[str, tuple[int, ...], int], tuple[int, bool, Any]] = {}
        for fqn, shards in self._items:
            total = 0
            for s in shards:
                pieces = s.pieces
                key = (s.dtype, s.local_shape, id(pieces))
                got = seen.get(key)
                if got is None:
                    if len(seen) >= 4096:
                        seen.clear()
                    # the pieces object rides along, so its id is not reused while cached
                    got = seen[key] = (*_bytes_and_padded(s), pieces)
                total += got[0]
                if got[1]:
                    self.padded += 1
            rows.add(fqn, len(shards), total)
            self.shards += len(shards)
            yield fqn, shards, total

    def numel(self, keys: set[tuple[Any, ...]]) -> dict[tuple[Any, ...], int]:
        """The elements each shard ``shard_key`` names holds (a message's "n of m")."""
        from shardctl.verify.bitwise.compare import shard_key

        out = {}
        for fqn in sorted({k[0] for k in keys}):
            for s in self._lookup(fqn):
                key = shard_key(s)
                if key in keys:
                    out[key] = sum(scalar_piece(p).numel for p in s.pieces)
        return out


def walk(src: Source, dst: Destination) -> Walk:
    if isinstance(dst.shards, RecordDstShards):
        return _record_walk(src, dst.shards)
    by_fqn = _materialized(src, dst)
    return Walk(by_fqn.items(), by_fqn.__getitem__)


def _record_walk(src: Source, shards: RecordDstShards) -> Walk:
    """The walk of a ``ranks`` DST from the record's columns (the order :func:`file_order`
    gives, worked out on arrays)."""
    tensor, file, begin = shards.columns()
    table = shards.table
    fqns = [t.fqn for t in table.tensors]
    src_shards = src.shards
    has = np.fromiter((f in src_shards for f in fqns), dtype=bool, count=len(fqns))
    keep = has[tensor]
    tensor, file, begin = tensor[keep], file[keep], begin[keep]
    paths = shards.paths
    by_name = sorted(range(len(paths)), key=lambda i: str(paths[i]))
    path_key = np.empty(len(paths), dtype=np.int64)
    path_key[np.array(by_name, dtype=np.int64)] = np.arange(len(paths))
    fk = path_key[file]
    order = np.lexsort((begin, fk))  # stable: ties keep tensor, then rank order
    seq = tensor[order]
    uniq, first = np.unique(seq, return_index=True)
    ordered = uniq[np.argsort(first, kind="stable")]  # tensors by first appearance
    ids = np.empty(len(fqns), dtype=np.int64)
    ids[ordered] = np.arange(ordered.size)
    in_seq = ids[seq]
    same_file = np.diff(fk[order]) == 0
    if ((np.diff(in_seq) < 0) & same_file).any():  # files disagree with first appearance
        ordered = ordered[kahn(ordered.size, in_seq, same_file)]
    del tensor, file, begin, order, seq, in_seq, fk, same_file
    key_of = {id(p): int(k) for p, k in zip(paths, path_key.tolist(), strict=True)}

    def sort_key(s: DstShard) -> tuple[int, int]:
        return key_of[id(s.path)], s.begin

    def in_order(ss: list[DstShard]) -> list[DstShard]:
        if len(ss) == 2:  # the common case (tp 2), without a sort
            a, b = ss
            return ss if sort_key(a) <= sort_key(b) else [b, a]
        return ss if len(ss) < 2 else sorted(ss, key=sort_key)

    def lookup(fqn: str) -> list[DstShard]:
        return in_order(shards[fqn])

    def items() -> Iterator[tuple[str, list[DstShard]]]:
        build = shards.build
        for t in ordered.tolist():
            fqn = fqns[t]
            yield fqn, in_order(build(t, fqn))

    return Walk(items(), lookup, (ordered, fqns))


def kahn(n: int, seq: np.ndarray, same_file: np.ndarray) -> np.ndarray:
    """:func:`file_order`'s topological sort on arrays: ``seq`` the tensor ids (numbered by
    first appearance) of every file back to back, ``same_file[k]`` whether ``seq[k]`` and
    ``seq[k + 1]`` are in one file. Returns the ids in order. Same result as ``file_order``
    (a min-heap of ready ids; a cycle gives way at the earliest id left), with the edges as
    one sorted array instead of a set per tensor."""
    import heapq

    a, b = seq[:-1][same_file], seq[1:][same_file]
    pairs = np.unique(a[a != b] * n + b[a != b])  # distinct edges a -> b, sorted by a
    del a, b
    src, dst = pairs // n, pairs % n
    # array.array, not lists: an int object per edge and per tensor was ~15 MiB at 90,000
    before = array.array("q", np.bincount(dst, minlength=n).astype(np.int64).tobytes())
    start = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.bincount(src, minlength=n), out=start[1:])
    after = array.array("q", dst.astype(np.int64).tobytes())
    starts = array.array("q", start.tobytes())
    del pairs, src, dst, start
    ready = [f for f in range(n) if before[f] == 0]
    heapq.heapify(ready)
    out = array.array("q")
    done = bytearray(n)
    earliest = 0  # every id below it is done
    pop, push = heapq.heappop, heapq.heappush
    while len(out) < n:
        if not ready:  # a cycle: take the earliest tensor not placed yet
            while done[earliest]:
                earliest += 1
            before[earliest] = 0
            push(ready, earliest)
        f = pop(ready)
        if done[f]:
            continue
        done[f] = 1
        out.append(f)
        for g in after[starts[f] : starts[f + 1]]:
            before[g] -= 1
            if before[g] == 0 and not done[g]:
                push(ready, g)
    return np.frombuffer(out, dtype=np.int64)


def _materialized(src: Source, dst: Destination) -> dict[str, list[DstShard]]:
    """DST's shards of the tensors SRC has, sorted by (file, begin), and grouped by tensor in
    an order every DST file agrees with (``_file_order``)."""
    by_path: dict[Any, list[DstShard]] = {}
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
    return {fqn: by_fqn[fqn] for fqn in file_order(ordered)}


def _begin(s: DstShard) -> int:
    return s.begin


def file_order(ordered: list[DstShard]) -> list[str]:
    """The tensors in an order every DST file agrees with (each file's blocks then come in
    file order, so its hash is fed as it is read): a topological sort of "``a`` comes before
    ``b`` in some file", ties by first appearance. Where files disagree (a cycle), the earliest
    tensor left goes next; those files are hashed again at the end."""
    import heapq
    import itertools

    # Tensors as ints numbered by first appearance, so the heap's priority is the id itself
    # (at 90,000 tensors the string-keyed sets and heap entries were seconds).
    ids: dict[str, int] = {}
    files: dict[Any, list[int]] = {}
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
