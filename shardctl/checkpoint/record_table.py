"""The layout record's shard tables as arrays, and the lazy views consumers read them through.

A 90k-tensor MoE split four ways has 180,000 shards. As Python objects (a ``Shard``, its
``Piece`` and five tuples each, plus a ``(rank, fqn)`` key per shard) that is ~1.5 KB a shard;
as the arrays below it is ~60 B. Every shard of a rank is one row of :class:`RankTable`;
its pieces are rows ``piece_start[j] : piece_start[j + 1]`` of the piece arrays. Dims are padded
to the record's widest tensor ``D`` (offsets pad with 0, sizes and shapes with 1: neutral for
boxes and element counts)::

    RankTable(tensor=[0, 5, ...],          # index into the record's tensors
              file=[0, 0, 1, ...],         # index into the record's files
              placement=[0, 2, ...],       # index into ``placements``
              local_shape=[[4, 8], ...],   # (n, D)
              piece_start=[0, 1, 3, ...],  # (n + 1,)
              offsets / sizes / local_offsets=[[4, 0], ...])  # (pieces, D)

:class:`ShardSeq` is a rank's ``shards`` as a sequence of :class:`~shardctl.layout.types.Shard`
built on access (the same API as the tuple it stands in for); :class:`ShardFiles` is the
record's ``shard_files`` mapping ``(rank, fqn) -> file name`` without a key object per shard.
"""

from __future__ import annotations

import array
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import Any, TypeVar, overload

import numpy as np

from shardctl.columns import Numbering
from shardctl.layout.types import Piece, Shard
from shardctl.model.types import TensorInfo

V = TypeVar("V")
INDEX = np.int64  # one integer type in memory; the file picks the narrowest that fits


@dataclass(frozen=True)
class RankTable:
    """One rank's shards, columnar (see the module docstring)."""

    tensor: np.ndarray  # (n,) int64
    file: np.ndarray  # (n,) int64
    placement: np.ndarray  # (n,) int64
    placements: tuple[str, ...]
    local_shape: np.ndarray  # (n, D) int64
    piece_start: np.ndarray  # (n + 1,) int64 (int32 as read from a record)
    offsets: np.ndarray  # (P, D) int64
    sizes: np.ndarray  # (P, D) int64
    local_offsets: np.ndarray  # (P, D) int64

    def __len__(self) -> int:
        return int(self.tensor.shape[0])

    def lists(self) -> _Lists:
        """The index columns as Python lists, made on first use and kept: building a ``Shard``
        from them costs ~1 µs, from numpy scalars ~10 µs (verify walks 180,000 shards 3x)."""
        got: _Lists | None = self.__dict__.get("_lists")
        if got is None:
            got = _Lists(*(_ints(c) for c in (self.tensor, self.file, self.placement)))
            object.__setattr__(self, "_lists", got)
        return got

    def box_lists(self) -> _BoxLists:
        """The shape and box columns as flat Python lists (only where :func:`boxes_of` found
        too many distinct boxes to share), made on first use and kept."""
        got: _BoxLists | None = self.__dict__.get("_box_lists")
        if got is None:
            got = _BoxLists(
                self.local_shape.ravel().tolist(),
                self.piece_start.tolist(),
                self.offsets.ravel().tolist(),
                self.sizes.ravel().tolist(),
                self.local_offsets.ravel().tolist(),
            )
            object.__setattr__(self, "_box_lists", got)
        return got


def _ints(column: np.ndarray) -> array.array[int]:
    """A column as ``array.array``: 4 B a value (a list costs 8 B plus an int object above
    256), and indexing it yields plain ints as fast as a list does."""
    return array.array("i", column.astype(np.int32).tobytes())


@dataclass(frozen=True, slots=True)
class _Lists:
    tensor: array.array[int]
    file: array.array[int]
    placement: array.array[int]


@dataclass(frozen=True, slots=True)
class _BoxLists:
    local_shape: list[int]  # flat, D per shard
    piece_start: list[int]
    offsets: list[int]  # flat, D per piece
    sizes: list[int]
    local_offsets: list[int]


@dataclass(frozen=True)
class RecordTable:
    """Every rank's :class:`RankTable` plus the tables they index."""

    tensors: tuple[TensorInfo, ...]
    ndim: np.ndarray  # (N,) dims of each tensor
    files: tuple[str, ...]  # the record's file names, in ``files`` order
    ranks: tuple[RankTable, ...]
    width: int  # D

    def shard_count(self) -> int:
        return sum(len(r) for r in self.ranks)

    @property
    def ndims(self) -> list[int]:
        """``ndim`` as a list (kept after first use)."""
        got: list[int] | None = self.__dict__.get("_ndims")
        if got is None:
            got = self.ndim.tolist()
            object.__setattr__(self, "_ndims", got)
        return got


def pad_rows(flat: np.ndarray, ndims: np.ndarray, width: int, fill: int) -> np.ndarray:
    """Rows of ``ndims[i]`` values each, back to back in ``flat``, as an ``(n, width)`` array."""
    out = np.full((ndims.shape[0], width), fill, dtype=INDEX)
    if width:
        mask = np.arange(width)[None, :] < ndims[:, None]
        out[mask] = flat
    return out


def unpad_rows(rows: np.ndarray, ndims: np.ndarray) -> np.ndarray:
    """The inverse of :func:`pad_rows`: the first ``ndims[i]`` values of each row, flat."""
    if rows.shape[1] == 0:
        return np.zeros(0, dtype=INDEX)
    mask = np.arange(rows.shape[1])[None, :] < ndims[:, None]
    return np.ascontiguousarray(rows[mask])


def from_shards(
    tensors: Sequence[TensorInfo],
    files: Sequence[str],
    ranks: Sequence[Sequence[Shard]],
    file_of: Sequence[Sequence[str]],
    tindex: Mapping[str, int] | None = None,
    ndim: np.ndarray | None = None,
    tensor_ids: Sequence[np.ndarray] | None = None,
) -> RecordTable:
    """Build the table from Shard objects (the planner's layout, or a parsed v1 record).

    ``file_of[i][j]`` names the file of shard ``j`` of rank ``i``; ``tindex``: each tensor's
    position in ``tensors`` by name, when the caller has it (a record's ranks are tabled one
    at a time: the map of 90,000 names once, not once a rank); ``ndim``: each tensor's dims,
    and ``tensor_ids[i]``: rank ``i``'s shards' tensors as positions, when it has those."""
    if tindex is None:
        tindex = {t.fqn: i for i, t in enumerate(tensors)}
    findex = {n: i for i, n in enumerate(files)}
    if ndim is None:
        ndim = np.array([len(t.shape) for t in tensors], dtype=INDEX)
    width = int(ndim.max()) if ndim.size else 0
    tables: list[RankTable] = []
    pad0 = [(0,) * (width - k) for k in range(width + 1)]
    pad1 = [(1,) * (width - k) for k in range(width + 1)]
    for r, (seq, names) in enumerate(zip(ranks, file_of, strict=True)):
        # held whole for the ids below (a lazy sequence would make and free each Shard)
        shards = seq if isinstance(seq, tuple | list) else list(seq)
        n = len(shards)
        # column by column, in C-level maps (45,000 shards a rank at 90,000 tensors)
        if tensor_ids is not None:
            tensor = np.asarray(tensor_ids[r], dtype=INDEX)
            assert tensor.shape == (n,)
        else:
            tensor = np.fromiter(map(tindex.__getitem__, map(_FQN, shards)), INDEX, n)
        file = np.fromiter(map(findex.__getitem__, names), INDEX, n)
        places: Numbering[str] = Numbering()
        placement = np.fromiter(map(places.__getitem__, map(_PLACEMENT, shards)), INDEX, n)
        # distinct (dims, local shape, pieces): padded once each, then gathered with numpy.
        # By identity first: a layout shares its shape and pieces objects among a class's
        # shards, and hashing pieces by value per shard was most of the old loop's cost (the
        # objects are alive in ``shards``, so an id stays theirs).
        keys = list(
            zip(
                map(len, map(_GLOBAL, shards)),
                map(id, map(_LOCAL, shards)),
                map(id, map(_PIECES, shards)),
                strict=True,
            )
        )
        combos: dict[Any, int] = {}
        c_local: list[tuple[int, ...]] = []
        c_start: list[int] = []
        c_count: list[int] = []
        offs: list[tuple[int, ...]] = []
        sizs: list[tuple[int, ...]] = []
        locs: list[tuple[int, ...]] = []
        cid_of: dict[tuple[int, int, int], int] = {}
        for ik, j in dict(zip(keys, range(n), strict=True)).items():  # one shard per id key
            sh = shards[j]
            key = (ik[0], sh.local_shape, sh.pieces)
            cid = combos.get(key)
            if cid is None:
                cid = combos[key] = len(c_local)
                nd = key[0]
                c_local.append(sh.local_shape + pad1[nd])
                c_start.append(len(offs))
                c_count.append(len(sh.pieces))
                for p in sh.pieces:
                    offs.append(p.offsets + pad0[nd])
                    sizs.append(p.sizes + pad1[nd])
                    locs.append(p.local_offsets + pad0[nd])
            cid_of[ik] = cid
        ids = list(map(cid_of.__getitem__, keys))
        idx = np.array(ids, dtype=INDEX)
        counts = np.array(c_count, dtype=INDEX)[idx]
        start = np.zeros(n + 1, dtype=INDEX)
        np.cumsum(counts, out=start[1:])
        total = int(start[-1])
        rep = np.repeat(np.array(c_start, dtype=INDEX)[idx], counts) + (
            np.arange(total, dtype=INDEX) - np.repeat(start[:-1], counts)
        )
        tables.append(
            RankTable(
                tensor,
                file,
                placement,
                tuple(places),
                _rows(c_local, width)[idx] if n else np.ones((0, width), dtype=INDEX),
                start,
                _rows(offs, width)[rep],
                _rows(sizs, width)[rep],
                _rows(locs, width)[rep],
            )
        )
    return RecordTable(tuple(tensors), ndim, tuple(files), tuple(tables), width)


_FQN, _PLACEMENT = attrgetter("fqn"), attrgetter("placement")
_GLOBAL, _LOCAL, _PIECES = (
    attrgetter("global_shape"),
    attrgetter("local_shape"),
    attrgetter("pieces"),
)


def _rows(rows: list[tuple[int, ...]], width: int) -> np.ndarray:
    if not rows:
        return np.zeros((0, width), dtype=INDEX)
    return np.array(rows, dtype=INDEX).reshape(len(rows), width)


class ShardSeq(Sequence[Shard]):
    """A rank's shards as a sequence of ``Shard`` built on access (nothing cached)."""

    def __init__(self, table: RecordTable, rank: int) -> None:
        self._t = table
        self._r = table.ranks[rank]

    def __len__(self) -> int:
        return len(self._r)

    @overload
    def __getitem__(self, j: int) -> Shard: ...

    @overload
    def __getitem__(self, j: slice) -> Sequence[Shard]: ...

    def __getitem__(self, j: int | slice) -> Shard | Sequence[Shard]:
        if isinstance(j, slice):
            return [self[k] for k in range(*j.indices(len(self)))]
        n = len(self._r)
        if j < 0:
            j += n
        if not 0 <= j < n:
            raise IndexError(j)
        return shard_at(self._t, self._r, j)

    def __iter__(self) -> Iterator[Shard]:
        t, r = self._t, self._r
        for j in range(len(r)):
            yield shard_at(t, r, j)


CACHE_LIMIT = 2**16  # distinct boxes shared per table; past it, new ones are not kept


def _shared(table: RecordTable) -> dict[Any, Any]:
    got: dict[Any, Any] | None = table.__dict__.get("_shared")
    if got is None:
        got = {}
        object.__setattr__(table, "_shared", got)
    return got


def dense(key: np.ndarray | Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """``(ids, first)`` of the rows of the 2-d integer array ``key`` (or of its columns, given
    as a sequence of 1-d arrays, which need not be stacked): ``ids[j]`` numbers row ``j``'s
    distinct value (in the order of the rows' codes), ``first[i]`` a row holding value ``i``.
    Columns are folded into one int64 code (``code * span + value``), the code renumbered
    densely only when the next column would overflow it; one sort at the end
    (``np.unique(axis=0)`` sorts rows as raw bytes: ~0.2 s for 45,000 rows of ~10 integers,
    this ~6 ms)."""
    if isinstance(key, np.ndarray):
        n, columns = key.shape[0], list(key.T)
    else:
        columns = list(key)
        n = len(columns[0]) if columns else 0
    code = np.zeros(n, dtype=np.int64)
    hi = 1  # every code is below hi
    for col in columns:
        if n == 0:
            break
        lo = int(col.min())
        span = int(col.max()) - lo + 1
        if hi * span >= 2**62:
            code = np.unique(code, return_inverse=True)[1].ravel()
            hi = int(code.max()) + 1
            if hi * span >= 2**62:  # a column of huge values: its ranks instead
                col = np.unique(col, return_inverse=True)[1].ravel()
                lo, span = 0, int(col.max()) + 1
        code = code * span + (col - lo)
        hi *= span
    _, first, ids = np.unique(code, return_index=True, return_inverse=True)
    return ids.ravel(), first


def boxes_of(table: RecordTable, r: RankTable) -> tuple[Sequence[int], list[Any]]:
    """Every shard's ``(local_shape, pieces)`` as an id into a list of distinct ones, worked
    out once per rank with :func:`dense` (an MoE rank of 45,000 shards has a few dozen).
    ``([], [])`` where a rank has more than ``CACHE_LIMIT`` distinct ones (then built per
    access)."""
    got: tuple[Sequence[int], list[Any]] | None = r.__dict__.get("_boxes")
    if got is not None:
        return got
    n, width = len(r), table.width
    ids = np.empty(n, dtype=np.int64)
    combos: list[Any] = []
    counts = np.diff(r.piece_start)
    nd = table.ndim[r.tensor]
    for c in np.unique(counts).tolist():
        if c == 1 and n == r.offsets.shape[0] and (counts == 1).all():
            # one piece a shard, pieces in shard order (the usual case): the columns as they
            # are, not copied and stacked (a tp-8 rank of 100,000 tensors: ~20 MB less)
            rows: slice | np.ndarray = slice(None)
            blocks = [r.local_shape, r.offsets, r.sizes, r.local_offsets]
        else:
            rows = np.flatnonzero(counts == c)
            first = r.piece_start[rows]
            k = (first[:, None] + np.arange(c)[None, :]).ravel()
            size = first.size
            blocks = [
                r.local_shape[rows],
                r.offsets[k].reshape(size, c * width),
                r.sizes[k].reshape(size, c * width),
                r.local_offsets[k].reshape(size, c * width),
            ]
        columns = [nd[rows], *(col for b in blocks for col in b.T)]
        local_ids, firsts = dense(columns)
        if len(combos) + len(firsts) > CACHE_LIMIT:
            combos = []
            break
        ids[rows] = local_ids + len(combos)
        for row in np.column_stack([col[firsts] for col in columns]).tolist():
            d = row[0]
            local = tuple(row[1 : 1 + d])
            base = 1 + width
            pieces = []
            for q in range(c):
                o = base + q * width
                z = o + c * width
                lo = z + c * width
                pieces.append(
                    Piece(tuple(row[o : o + d]), tuple(row[z : z + d]), tuple(row[lo : lo + d]))
                )
            combos.append((local, tuple(pieces)))
    got = (_ints(ids), combos) if combos or n == 0 else ([], [])
    object.__setattr__(r, "_boxes", got)
    return got


def pieces_at(table: RecordTable, r: RankTable, j: int) -> tuple[Piece, ...]:
    """Shard ``j``'s pieces. Equal piece tuples are one object: an MoE split has 180,000
    shards but a few dozen distinct boxes (~300 B saved per shard a consumer keeps)."""
    lists = r.box_lists()
    nd = table.ndims[r.lists().tensor[j]]
    width = table.width
    p0, p1 = lists.piece_start[j], lists.piece_start[j + 1]
    a0, b0 = p0 * width, p1 * width
    off, siz, loc = lists.offsets, lists.sizes, lists.local_offsets
    key = (nd, p1 - p0, tuple(off[a0:b0]), tuple(siz[a0:b0]), tuple(loc[a0:b0]))
    shared = _shared(table)
    got: tuple[Piece, ...] | None = shared.get(key)
    if got is not None:
        return got
    out = []
    for k in range(p0, p1):
        a = k * width
        b = a + nd
        out.append(Piece(tuple(off[a:b]), tuple(siz[a:b]), tuple(loc[a:b])))
    got = tuple(out)
    if len(shared) < CACHE_LIMIT:
        shared[key] = got
    return got


def local_shape_at(table: RecordTable, r: RankTable, j: int) -> tuple[int, ...]:
    a = j * table.width
    shape = tuple(r.box_lists().local_shape[a : a + table.ndims[r.lists().tensor[j]]])
    shared = _shared(table)
    got: tuple[int, ...] | None = shared.get(shape)
    if got is None:
        got = shape
        if len(shared) < CACHE_LIMIT:
            shared[shape] = shape
    return got


def local_and_pieces(
    table: RecordTable, r: RankTable, j: int
) -> tuple[tuple[int, ...], tuple[Piece, ...]]:
    """Shard ``j``'s local shape and pieces (shared objects where :func:`boxes_of` has them)."""
    ids, combos = boxes_of(table, r)
    if combos:
        got: tuple[tuple[int, ...], tuple[Piece, ...]] = combos[ids[j]]
        return got
    return local_shape_at(table, r, j), pieces_at(table, r, j)


def shard_at(table: RecordTable, r: RankTable, j: int) -> Shard:
    lists = r.lists()
    t = table.tensors[lists.tensor[j]]
    local, pieces = local_and_pieces(table, r, j)
    return Shard(
        fqn=t.fqn,
        dtype=t.dtype,
        global_shape=t.shape,
        local_shape=local,
        pieces=pieces,
        placement=r.placements[lists.placement[j]],
    )


class ShardFiles(Mapping[tuple[int, str], str]):
    """``(rank, fqn) -> file name`` over the arrays (no key object per shard)."""

    def __init__(self, table: RecordTable, tindex: Mapping[str, int]) -> None:
        self._t = table
        self._tindex = tindex
        # per rank: tensor index -> shard row, or -1; made on first use (verify never asks:
        # 24 ranks x 100,000 tensors would be 10 MB), in int32 (at most MAX_ENTRIES rows)
        self._rows: list[np.ndarray] | None = None

    def _row(self) -> list[np.ndarray]:
        if self._rows is None:
            rows = []
            for r in self._t.ranks:
                row = np.full(len(self._t.tensors), -1, dtype=np.int32)
                row[r.tensor] = np.arange(len(r), dtype=np.int32)
                rows.append(row)
            self._rows = rows
        return self._rows

    def row(self, rank: int, fqn: str) -> int:
        """The shard row of ``fqn`` in ``rank``, or -1."""
        t = self._tindex.get(fqn)
        if t is None or not 0 <= rank < len(self._t.ranks):
            return -1
        return int(self._row()[rank][t])

    def __getitem__(self, key: tuple[int, str]) -> str:
        rank, fqn = key
        j = self.row(rank, fqn)
        if j < 0:
            raise KeyError(key)
        return self._t.files[int(self._t.ranks[rank].file[j])]

    def __iter__(self) -> Iterator[tuple[int, str]]:
        tensors = self._t.tensors
        for i, r in enumerate(self._t.ranks):
            for t in r.tensor.tolist():
                yield i, tensors[t].fqn

    def __len__(self) -> int:
        return self._t.shard_count()

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, tuple) or len(key) != 2:
            return False
        rank, fqn = key
        return isinstance(rank, int) and isinstance(fqn, str) and self.row(rank, fqn) >= 0


def tensor_index(tensors: Sequence[TensorInfo]) -> dict[str, int]:
    return {t.fqn: i for i, t in enumerate(tensors)}


def index_of(table: RecordTable) -> dict[str, int]:
    """``fqn -> tensor index`` of ``table``, made once and shared by every view of it."""
    got: dict[str, int] | None = table.__dict__.get("_index")
    if got is None:
        got = tensor_index(table.tensors)
        object.__setattr__(table, "_index", got)
    return got


__all__: list[Any] = [
    "RankTable",
    "RecordTable",
    "ShardFiles",
    "ShardSeq",
    "from_shards",
    "local_shape_at",
    "pad_rows",
    "pieces_at",
    "shard_at",
    "unpad_rows",
]


@dataclass(frozen=True)
class ByTensor:
    """Every shard of every rank grouped by tensor (CSR): the shards of tensor ``t`` are
    ``(rank[k], row[k])`` for ``k`` in ``start[t] : start[t + 1]``, in rank order."""

    rank: array.array[int]  # 4 B a shard, not ~36 as a list; slices cheaply into ints
    row: array.array[int]
    start: array.array[int]  # 8 B a tensor, not ~36 as a list of ints

    def of(self, t: int) -> Iterator[tuple[int, int]]:
        a, b = self.start[t], self.start[t + 1]
        return zip(self.rank[a:b], self.row[a:b], strict=True)

    def count(self, t: int) -> int:
        return self.start[t + 1] - self.start[t]


def by_tensor(table: RecordTable, keep: Sequence[np.ndarray] | None = None) -> ByTensor:
    """Group the shards by tensor; ``keep[i]`` (bool per row of rank ``i``) drops rows."""
    ranks: list[np.ndarray] = []
    rows: list[np.ndarray] = []
    tensors: list[np.ndarray] = []
    # int32 while grouping (they end as int32 arrays): 720,000 shards at 90,000 tensors x 8
    for i, r in enumerate(table.ranks):
        row = np.arange(len(r), dtype=np.int32)
        if keep is not None:
            row = row[keep[i]]
        rows.append(row)
        ranks.append(np.full(row.shape[0], i, dtype=np.int32))
        tensors.append(r.tensor[row].astype(np.int32))
    tensor = np.concatenate(tensors) if tensors else np.zeros(0, dtype=np.int32)
    del tensors
    order = np.argsort(tensor, kind="stable")  # ranks ascending within a tensor, as before
    start = np.zeros(len(table.tensors) + 1, dtype=INDEX)
    np.cumsum(np.bincount(tensor, minlength=len(table.tensors)), out=start[1:])
    rank = np.concatenate(ranks)[order] if ranks else tensor
    row = np.concatenate(rows)[order] if rows else tensor
    return ByTensor(
        array.array("i", rank.astype(np.int32).tobytes()),
        array.array("i", row.astype(np.int32).tobytes()),
        array.array("q", start.astype(np.int64).tobytes()),
    )


def rows_by_file(table: RecordTable) -> dict[int, list[tuple[int, np.ndarray]]]:
    """File index -> ``(rank, rows of that rank in the file)`` (usually one rank a file)."""
    out: dict[int, list[tuple[int, np.ndarray]]] = {}
    for i, r in enumerate(table.ranks):
        order = np.argsort(r.file, kind="stable")
        cuts = np.flatnonzero(np.diff(r.file[order])) + 1
        for rows in np.split(order, cuts):
            if rows.size:
                out.setdefault(int(r.file[rows[0]]), []).append((i, rows))
    return out


class Recent:
    """The last ``size`` values a lazy mapping built, by key: a key looked up again soon gets
    the same objects, as from a dict (a tensor's targets look its sources up one after
    another); memory stays bounded."""

    def __init__(self, size: int = 256) -> None:
        self.size = size
        self.items: dict[Any, Any] = {}

    def get(self, key: Any) -> Any:
        return self.items.get(key)

    def put(self, key: Any, value: Any) -> Any:
        items = self.items
        if len(items) >= self.size:
            del items[next(iter(items))]  # the oldest (dicts keep insertion order)
        items[key] = value
        return value


class PerAccess(Mapping[str, V]):
    """``fqn -> value`` built on access by ``_build`` (the last few kept, :class:`Recent`):
    the lazy shard mappings of a source and a destination."""

    def __init__(self) -> None:
        self._recent = Recent()

    def __getitem__(self, fqn: str) -> V:
        got: V | None = self._recent.get(fqn)
        if got is not None:
            return got
        value: V = self._recent.put(fqn, self._build(fqn))
        return value

    def _build(self, fqn: str) -> V:
        raise NotImplementedError


# ---- summaries over the columns (inspect: no Shard built) ---------------------------------


def file_counts(table: RecordTable) -> list[int]:
    """Shards per file, in ``table.files`` order, over every rank."""
    total = np.zeros(len(table.files), dtype=np.int64)
    for r in table.ranks:
        total += np.bincount(r.file, minlength=len(table.files))[: len(table.files)]
    return [int(x) for x in total]


def rank_bytes(table: RecordTable, rank: int) -> int:
    """The bytes rank ``rank`` holds: each shard's elements at its tensor's dtype, sub-byte
    dtypes rounded up per shard (as ``Shard.nbytes``)."""
    from shardctl.dtypes import DTYPE_BITS

    r = table.ranks[rank]
    bits = _tensor_bits(table, DTYPE_BITS)[r.tensor]
    numel = np.prod(r.local_shape, axis=1, dtype=np.int64)  # padded dims are 1
    return int(((bits * numel + 7) // 8).sum())


def rank_files(table: RecordTable, rank: int) -> tuple[str, ...]:
    """The names of the files rank ``rank``'s shards are in, sorted."""
    used = np.unique(table.ranks[rank].file).tolist()
    return tuple(sorted(table.files[i] for i in used))


def _tensor_bits(table: RecordTable, bits: Mapping[str, int]) -> np.ndarray:
    got: np.ndarray | None = table.__dict__.get("_bits")
    if got is None:
        got = np.array([bits[t.dtype] for t in table.tensors], dtype=np.int64)
        object.__setattr__(table, "_bits", got)
    return got


def rank_fqns(table: RecordTable, rank: int) -> list[str]:
    """The tensor names rank ``rank``'s shards are of, in row order."""
    tensors = table.tensors
    return [tensors[t].fqn for t in table.ranks[rank].lists().tensor]


# ---- planned rank files: (rank, fqn) -> file name without a key per shard ------------------


class PlannedFiles(Mapping[tuple[int, str], str]):
    """``(rank, fqn) -> file name`` of planned rank files, from each rank's tensors as
    positions in the global order and where its files begin: a dict of ``(rank, fqn)`` keys
    costs ~110 B a shard, 40 MB at 360,000 shards; this costs 4 B a shard::

        PlannedFiles({"a": 0, "b": 1, "c": 2}, [([0, 1, 2], [0, 2], ["r0.p1", "r0.p2"])])
        # (0, "a") -> "r0.p1", (0, "c") -> "r0.p2"

    ``ranks[i]`` is ``(keys, starts, names)``: rank ``i``'s tensors as increasing positions in
    ``order``, and its files (``names[k]`` holds ``keys[starts[k] : starts[k + 1]]``)."""

    def __init__(
        self,
        order: Mapping[str, int],
        ranks: Sequence[tuple[Sequence[int], Sequence[int], Sequence[str]]],
    ) -> None:
        self._order = order
        self._keys = [np.asarray(k, dtype=np.int64) for k, _, _ in ranks]
        self._starts = [np.asarray(s, dtype=np.int64) for _, s, _ in ranks]
        self._names = [tuple(n) for _, _, n in ranks]

    @property
    def order(self) -> Mapping[str, int]:
        """The global order the ranks' positions are in (``fqn -> position``)."""
        return self._order

    def names(self, rank: int, fqns: Sequence[str]) -> list[str]:
        """The file of each of rank ``rank``'s ``fqns`` (KeyError for one it does not hold):
        one numpy search for all of them, not a lookup each."""
        want = np.fromiter(map(self._order.__getitem__, fqns), dtype=np.int64, count=len(fqns))
        return self.names_at(rank, want, fqns)

    def names_at(self, rank: int, want: np.ndarray, fqns: Sequence[str]) -> list[str]:
        """:meth:`names` of ``fqns`` given as their positions in :attr:`order` (``want``)."""
        keys = self._keys[rank]
        pos = np.searchsorted(keys, want)
        held = pos < len(keys)
        held[held] = keys[pos[held]] == want[held]
        if not held.all():
            raise KeyError((rank, fqns[int(np.flatnonzero(~held)[0])]))
        part = np.searchsorted(self._starts[rank], pos, side="right") - 1
        names = self._names[rank]
        return [names[k] for k in part.tolist()]

    def __getitem__(self, key: tuple[int, str]) -> str:
        rank, fqn = key
        if not (isinstance(rank, int) and 0 <= rank < len(self._keys)) or fqn not in self._order:
            raise KeyError(key)
        return self.names(rank, [fqn])[0]

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, tuple) or len(key) != 2:
            return False
        try:
            self[key]
        except KeyError:
            return False
        return True

    def __iter__(self) -> Iterator[tuple[int, str]]:
        fqn_at = {k: fqn for fqn, k in self._order.items()}
        for i, keys in enumerate(self._keys):
            for k in keys.tolist():
                yield i, fqn_at[k]

    def __len__(self) -> int:
        return sum(len(k) for k in self._keys)


def planned_names(
    files: Mapping[tuple[int, str], str], rank: int, shards: Sequence[Shard]
) -> list[str]:
    """The file of each of rank ``rank``'s ``shards`` per ``files`` (any such mapping)."""
    if isinstance(files, PlannedFiles):
        return files.names(rank, [s.fqn for s in shards])
    return [files[(rank, s.fqn)] for s in shards]
