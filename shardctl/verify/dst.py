"""The checkpoint under test (DST), opened tolerantly: disagreements become findings, not errors.

``reshard``'s own reader refuses a layout whose files disagree with its record (exit 3: it must
not copy from it). ``verify`` is asked exactly whether they agree, so it reads the record (a
malformed record is still exit 3), then every file header, and lists what differs:
a recorded shard missing from its file, another dtype or shape, tensors no record mentions,
files no record mentions, a file whose header metadata says it belongs to another rank.
"""

from __future__ import annotations

import array
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from shardctl.checkpoint import record as rec
from shardctl.checkpoint import record_table as rt
from shardctl.checkpoint.rank_header import begins_if_exact
from shardctl.checkpoint.source import claimed_rank, open_source
from shardctl.checkpoint.strict_json import read_json_strict
from shardctl.errors import InvalidInputError
from shardctl.io import safetensors_header as sh
from shardctl.io.header_raw import read_raw
from shardctl.io.safetensors_header import NO_ENTRIES, SafetensorsHeader, parse_header
from shardctl.layout.types import Layout, LocalTensor
from shardctl.model.types import TensorInfo
from shardctl.verify.kinds import shard_kinds
from shardctl.verify.result import Finding


@dataclass(frozen=True, slots=True)
class DstShard(LocalTensor):
    """One local tensor of DST, in file ``path``, held by ``rank`` (None for an HF checkpoint)."""

    path: Path
    rank: int | None


@dataclass
class Destination:
    root: Path
    kind: str  # "ranks" | "hf"
    tensors: dict[str, TensorInfo]  # the global tensors DST claims to hold
    shards: Mapping[str, list[DstShard]]  # a dict, or built per access (RecordDstShards)
    files: list[Path]
    config: dict[str, Any]
    record: rec.LayoutRecord | None = None
    problems: list[Finding] = field(default_factory=list)

    @property
    def layout(self) -> Layout | None:
        return self.record.layout if self.record is not None else None

    def rank_files(self) -> dict[int, tuple[Path, ...]]:
        out: dict[int, set[Path]] = {}
        for shards in self.shards.values():
            for s in shards:
                out.setdefault(s.rank or 0, set()).add(s.path)
        return {r: tuple(sorted(p)) for r, p in sorted(out.items())}


def _config(root: Path) -> dict[str, Any]:
    path = root / "config.json"
    if not path.is_file():
        return {}
    # the one strict reader: size cap, depth (RecursionError -> exit 3), no duplicate keys
    data = read_json_strict(path, max_bytes=16 * 2**20, what="config.json")
    return data if isinstance(data, dict) else {}


def open_destination(root: Path) -> Destination:
    root = Path(root)
    # ---- engine format: vLLM sharded_state (branch vllm) ----
    from shardctl.formats.vllm.read import is_vllm_dir

    if is_vllm_dir(root):
        from shardctl.formats.vllm.destination import vllm_destination

        return vllm_destination(root)
    # ---- end vllm ----
    record_path = root / rec.RECORD_NAME
    # gaps/overlaps in DST's record are structure findings (exit 1), not refusals
    record = rec.read(root, exact_tiling=False) if record_path.is_file() else None
    if record is None or record.layout is None:
        return _hf(root, record)
    return _ranks(root, record)


def _hf(root: Path, record: rec.LayoutRecord | None) -> Destination:
    src = open_source(root)
    shards: dict[str, list[DstShard]] = {}
    for fqn, ss in src.shards.items():
        shards[fqn] = [
            DstShard(
                fqn,
                s.dtype,
                s.local_shape,
                s.pieces,
                s.begin,
                path=src.files[s.file].path,
                rank=None,
            )
            for s in ss
        ]
    tensors = {t.fqn: t for t in src.model.tensors}
    return Destination(
        root, "hf", tensors, shards, [f.path for f in src.files], _config(root), record
    )


def _ranks(root: Path, record: rec.LayoutRecord) -> Destination:
    table = record.table
    assert record.layout is not None and table is not None
    dest = Destination(
        root, "ranks", {t.fqn: t for t in record.tensors}, {}, [], _config(root), record
    )
    tensors = table.tensors
    keep = [np.zeros(len(r), dtype=bool) for r in table.ranks]
    begins = [np.zeros(len(r), dtype=np.int64) for r in table.ranks]
    rows_of = rt.rows_by_file(table)
    # one file at a time: its header (~100 B per tensor) is dropped before the next is read
    for k, f in enumerate(record.files):
        path = root / f.name
        if not f.name.endswith(".safetensors"):
            continue
        if path.is_symlink() or not path.is_file():
            dest.problems.append(Finding("recorded file missing", file=f.name))
            continue
        dest.files.append(path)
        size = os.stat(path).st_size
        if size != f.size:
            dest.problems.append(Finding(f"size {size} B, the record says {f.size} B", file=f.name))
        held = rows_of.get(k, [])
        try:
            raw, file_size = read_raw(path, sh._limit[0])  # read_header's own cap
            exact = (
                begins_if_exact(raw, file_size, table, held[0][0], held[0][1])
                if len(held) == 1
                else None
            )
            if exact is not None:  # the header is the record's, byte for byte
                at, meta = exact
                i, rows = held[0]
                keep[i][rows] = True
                begins[i][rows] = at
                _check_owner(dest, _meta_header(path, raw, file_size, meta), f.name, {i})
                continue
            header = parse_header(raw, path=path, file_size=file_size)
        except InvalidInputError as exc:
            dest.problems.append(Finding(f"unreadable header: {exc.message}", file=f.name))
            continue
        _check_owner(dest, header, f.name, {i for i, _ in held})
        base = header.data_offset
        entries = {e.name: e for e in header.tensors}
        recorded: set[str] = set()
        for i, rows in held:
            lists = table.ranks[i].lists()
            rank = table.ranks[i]
            ok, begin = keep[i], begins[i]
            for j in rows.tolist():
                t = lists.tensor[j]
                info = tensors[t]
                recorded.add(info.fqn)
                entry = entries.get(info.fqn)
                if entry is None:
                    dest.problems.append(
                        Finding("missing from its file", fqn=info.fqn, rank=i, file=f.name)
                    )
                    continue
                shape = list(rt.local_and_pieces(table, rank, j)[0])
                if entry.dtype != info.dtype or list(entry.shape) != shape:
                    dest.problems.append(
                        Finding(
                            f"file holds {list(entry.shape)} {entry.dtype}, the record says "
                            f"{shape} {info.dtype}",
                            fqn=info.fqn,
                            rank=i,
                            file=f.name,
                        )
                    )
                    continue
                ok[j] = True
                begin[j] = base + entry.begin
        for e in header.tensors:
            if e.name not in recorded:
                dest.problems.append(
                    Finding("tensor in the file but not in the record", fqn=e.name, file=f.name)
                )
        del header, entries, recorded
    names = {f.name for f in record.files}
    for name in sorted(os.listdir(root)):
        if name.endswith(".safetensors") and name not in names:
            dest.problems.append(Finding("file not in the layout record", file=name))
    paths = [root / n for n in table.files]  # one Path per file, not per shard
    dest.shards = RecordDstShards(table, rt.by_tensor(table, keep), begins, paths)
    return dest


class RecordDstShards(rt.PerAccess[list[DstShard]]):
    """``fqn -> [DstShard, ...]`` of a ``ranks`` DST (the shards whose file agrees with the
    record), built per access from the record's arrays; tensors with none are absent."""

    def __init__(
        self,
        table: rt.RecordTable,
        groups: rt.ByTensor,
        begins: list[np.ndarray],
        paths: list[Path],
    ) -> None:
        super().__init__()
        self._t, self._g, self._paths = table, groups, paths
        self._begins = [array.array("q", b.astype(np.int64).tobytes()) for b in begins]
        self._index = rt.index_of(table)
        self._held = np.flatnonzero(np.diff(np.asarray(groups.start)) > 0)
        self._per_rank: list[Any] = [None] * len(table.ranks)

    def _build(self, fqn: str) -> list[DstShard]:
        return self.build(self._index[fqn], fqn)

    def build(self, t: int, fqn: str) -> list[DstShard]:
        """Tensor ``t``'s shards, in rank order (not kept: ``[]`` caches the last few). At
        180,000 shards a frozen dataclass's ``__init__`` alone was ~0.4 s: the slots are set
        directly, as ``safetensors_header._entries`` does."""
        g = self._g
        a, b = g.start[t], g.start[t + 1]
        if a == b:
            raise KeyError(fqn)
        table = self._t
        info = table.tensors[t]
        out = []
        for k in range(a, b):
            i, j = g.rank[k], g.row[k]
            per = self._per_rank[i]
            if per is None:
                per = self._per_rank[i] = self._rank_parts(i)
            kinds, files, begins = per
            if kinds is not None:
                local, pieces = kinds[1][kinds[0][j]]
            else:
                r = table.ranks[i]
                local, pieces = rt.local_shape_at(table, r, j), rt.pieces_at(table, r, j)
            out.append(_shard(info.fqn, info.dtype, local, pieces, begins[j], files[j], i))
        return out

    def _rank_parts(self, i: int) -> tuple[Any, list[Path], array.array[int]]:
        table = self._t
        r = table.ranks[i]
        paths = self._paths
        return shard_kinds(table, r), [paths[f] for f in r.lists().file], self._begins[i]

    def __iter__(self) -> Iterator[str]:
        tensors = self._t.tensors
        return (tensors[t].fqn for t in self._held.tolist())

    def __len__(self) -> int:
        return int(self._held.size)

    def shard_count(self) -> int:
        """Every shard of every tensor (``sum(map(len, values()))`` without building them)."""
        return len(self._g.rank)

    def columns(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(tensor index, path index, begin)`` of every shard held, grouped by tensor in
        rank order, as arrays (no shard built); paths index ``self.paths``."""
        g, table = self._g, self._t
        rank = np.frombuffer(g.rank, dtype=np.int32)
        row = np.frombuffer(g.row, dtype=np.int32)
        # indexes in int32 (a record holds at most record_check.MAX_ENTRIES of each);
        # 800,000 shards at 100,000 tensors x 8 ranks
        tensor = np.repeat(
            np.arange(len(table.tensors), dtype=np.int32), np.diff(np.asarray(g.start))
        )
        file = np.empty(rank.size, dtype=np.int32)
        begin = np.empty(rank.size, dtype=np.int64)
        for i, r in enumerate(table.ranks):
            at = np.flatnonzero(rank == i)
            file[at] = r.file[row[at]]
            begin[at] = np.frombuffer(self._begins[i], dtype=np.int64)[row[at]]
        return tensor, file, begin

    def begins(self, rank: int) -> array.array[int]:
        """Rank ``rank``'s shards' first bytes in their DST files, by row (int64)."""
        return self._begins[rank]

    @property
    def paths(self) -> list[Path]:
        return self._paths

    @property
    def table(self) -> rt.RecordTable:
        return self._t

    def __contains__(self, fqn: object) -> bool:
        t = self._index.get(fqn) if isinstance(fqn, str) else None
        return t is not None and self._g.count(t) > 0


_NEW = object.__new__
_SET = [
    getattr(DstShard, f).__set__
    for f in ("fqn", "dtype", "local_shape", "pieces", "begin", "path", "rank")
]


def _shard(
    fqn: str,
    dtype: str,
    local: tuple[int, ...],
    pieces: tuple[Any, ...],
    begin: int,
    path: Path,
    rank: int,
) -> DstShard:
    """``DstShard(fqn, dtype, local, pieces, begin, path=path, rank=rank)``, its slots set
    directly (a frozen dataclass's ``__init__`` goes through ``object.__setattr__``)."""
    s: DstShard = _NEW(DstShard)
    s_fqn, s_dtype, s_local, s_pieces, s_begin, s_path, s_rank = _SET
    s_fqn(s, fqn)
    s_dtype(s, dtype)
    s_local(s, local)
    s_pieces(s, pieces)
    s_begin(s, begin)
    s_path(s, path)
    s_rank(s, rank)
    return s


def _meta_header(
    path: Path, raw: bytes, file_size: int, meta: dict[str, str] | None
) -> SafetensorsHeader:
    """A header of its metadata only (what ``_check_owner`` reads)."""
    return SafetensorsHeader(path, len(raw), 8 + len(raw), file_size, meta, NO_ENTRIES)


def _check_owner(dest: Destination, header: SafetensorsHeader, name: str, ranks: set[int]) -> None:
    """A rank file repeats its part of the record: a renamed/swapped file names another rank,
    and so does a record that places one rank's shards in another rank's file."""
    claimed = claimed_rank(header)
    if claimed == "unreadable":
        dest.problems.append(Finding("unreadable shardctl metadata in its header", file=name))
        return
    if isinstance(claimed, int) and ranks and ranks != {claimed}:
        dest.problems.append(
            Finding(
                f"file holds rank {claimed}'s shards (its header says so) but the record assigns "
                f"it to rank {min(ranks - {claimed})}: rank files renamed or swapped",
                file=name,
            )
        )
