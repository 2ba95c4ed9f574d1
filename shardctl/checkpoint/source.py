"""The input side of a reshard: every tensor's *source shards* and where their bytes lie.

An HF checkpoint is one whole-tensor shard per fqn at its file offset; a shardctl ``ranks``
layout is its record's shards (replicas included: the copy engine picks one per box). Only
headers, the index and the record are read here — never tensor data.
"""

from __future__ import annotations

import array
import json
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from itertools import chain, count, repeat
from operator import add
from pathlib import Path
from typing import Any, cast

import numpy as np

from shardctl.checkpoint import record as rec
from shardctl.checkpoint import record_table as rt
from shardctl.checkpoint.hf import CheckpointFiles, open_checkpoint
from shardctl.checkpoint.input_check import Expected
from shardctl.checkpoint.rank_header import begins_if_exact
from shardctl.errors import EnvironmentFailure, InvalidInputError
from shardctl.io import safetensors_header as sh
from shardctl.io.header_raw import read_raw
from shardctl.io.safetensors_header import NO_ENTRIES, SafetensorsHeader, parse_header
from shardctl.layout.types import LocalTensor, Piece
from shardctl.model.inventory import from_tensors, tensor_infos
from shardctl.model.types import ModelInfo


@dataclass(frozen=True, slots=True)
class SourceShard(LocalTensor):
    """A local tensor in an input file (``file``: its index in ``Source.files``)."""

    file: int


@dataclass(frozen=True)
class InputFile:
    path: Path
    size: int
    mtime_ns: int
    sha256: str | None = None  # known for free from an HF-cache blob name
    recorded: tuple[str, str] | None = None  # (hash name, digest) from a shardctl layout record


@dataclass(frozen=True)
class Source:
    root: Path
    kind: str  # "hf" | "shardctl" | "vllm"
    model: ModelInfo  # the original checkpoint's tensors (global, unpadded), in file order
    shards: Mapping[str, tuple[SourceShard, ...]]
    files: tuple[InputFile, ...]
    carried: tuple[Path, ...]  # relative to root
    record: rec.LayoutRecord | None = None

    def identity(self) -> dict[str, Any]:
        """The record's ``source`` entry: names, sizes, mtimes (and sha256 where known)."""
        ident: dict[str, Any] = {
            "kind": self.kind,
            "path": str(self.root),
            "files": [
                {
                    "name": f.path.name,
                    "size": f.size,
                    "mtime_ns": f.mtime_ns,
                    "sha256": f.sha256,
                }
                for f in self.files
            ],
            "record": None,
        }
        if self.record is not None:
            ident["record"] = {"files": self.record.raw.get("files"), "hash": self.record.hash}
        return ident

    def expected_digests(self) -> list[Expected]:
        """Every input file whose content digest is known (record first, then HF-cache name)."""
        out: list[Expected] = []
        for f in self.files:
            if f.recorded is not None:
                out.append(Expected(f.path, f.size, *f.recorded, "the layout record"))
            elif f.sha256 is not None:
                out.append(Expected(f.path, f.size, "sha256", f.sha256, "the HF-cache blob name"))
        return out

    def check_unchanged(self) -> None:
        """Exit 5 ``input changed during run`` if any input file's size or mtime moved."""
        for f in self.files:
            try:
                st = os.stat(f.path)
            except OSError:
                raise EnvironmentFailure(
                    "input changed during run (file vanished)", where=str(f.path)
                ) from None
            if (st.st_size, st.st_mtime_ns) != (f.size, f.mtime_ns):
                raise EnvironmentFailure(
                    f"input changed during run (size {f.size} -> {st.st_size})",
                    where=str(f.path),
                    hint="rerun once the input is stable",
                )


def open_source(root: Path, *, follow_external_symlinks: bool = False) -> Source:
    """Validate ``root`` and locate every source shard (exit 3 on anything malformed)."""
    # ---- engine format: vLLM sharded_state (branch vllm) ----
    from shardctl.formats.vllm.read import is_vllm_dir, open_vllm_source

    if is_vllm_dir(Path(root)):
        return open_vllm_source(Path(root))
    # ---- end vllm ----
    ck = open_checkpoint(root, follow_external_symlinks=follow_external_symlinks)
    if ck.kind == "shardctl":
        return _from_record(Path(root))
    return _from_hf(Path(root), ck)


def _input_file(path: Path, record: rec.LayoutRecord | None = None) -> InputFile:
    st = os.stat(path)
    recorded = None
    if record is not None:
        digest = next((f.digest for f in record.files if f.name == path.name), None)
        recorded = None if digest is None else (record.hash, digest)
    sha = None
    real = Path(os.path.realpath(path))
    if real.parent.name == "blobs" and len(real.name) == 64:
        sha = real.name  # HF cache: LFS blobs are named by their sha256
    return InputFile(path, st.st_size, st.st_mtime_ns, sha, recorded)


def _from_hf(root: Path, ck: CheckpointFiles, record: rec.LayoutRecord | None = None) -> Source:
    if root.is_file():
        raise InvalidInputError("expected a checkpoint directory", where=str(root))
    files = tuple(_input_file(h.path, record) for h in ck.files)
    model = from_tensors(root, tensor_infos(ck))  # C-level maps: ~20 ms less at 100,000
    return Source(root, "hf", model, HfShards(ck), files, tuple(ck.extra_files))


class HfShards(rt.PerAccess[tuple[SourceShard, ...]]):
    """``fqn -> (its one whole-tensor SourceShard,)`` of an HF checkpoint, built per access
    from the headers' columns: a position per name and, per position, its file, first byte,
    dtype and shape. No header entry or location object is made: at 90,000 tensors those
    (one ``HeaderEntry`` and one ``TensorLocation`` each, and a dict of them) took ~40 ms with
    the collector paused, as reshard and verify run (~105 with it on), and ~14 MB at peak;
    these columns take ~20 ms."""

    def __init__(self, ck: CheckpointFiles) -> None:
        super().__init__()
        hs = ck.files
        self._at: dict[str, int] = dict(zip(chain.from_iterable(h.names for h in hs), count()))
        self._files = array.array(
            "i", chain.from_iterable(repeat(i, len(h.names)) for i, h in enumerate(hs))
        )
        self._begins = array.array(
            "q", chain.from_iterable(map(add, repeat(h.data_offset), h.begins) for h in hs)
        )
        self._dtypes: list[str] = list(chain.from_iterable(h.dtypes for h in hs))
        self._shapes: list[tuple[int, ...]] = list(chain.from_iterable(h.shapes for h in hs))
        # one ``(whole piece,)`` per distinct shape, shared: reshard's short path then knows a
        # kind of source by the identity of its objects instead of hashing pieces by value
        self._whole: dict[tuple[int, ...], tuple[Piece, ...]] = {}

    def _build(self, fqn: str) -> tuple[SourceShard, ...]:
        i = self._at[fqn]
        shape = self._shapes[i]
        pieces = self._whole.get(shape)
        if pieces is None:
            zeros = (0,) * len(shape)
            pieces = self._whole[shape] = (Piece(zeros, shape, zeros),)
        return (
            SourceShard(
                fqn,
                self._dtypes[i],
                pieces[0].sizes,
                pieces,
                begin=self._begins[i],
                file=self._files[i],
            ),
        )

    def __iter__(self) -> Iterator[str]:
        return iter(self._at)

    def __len__(self) -> int:
        return len(self._at)

    def __contains__(self, fqn: object) -> bool:
        return fqn in self._at

    def wholes(
        self, fqns: Iterable[str]
    ) -> tuple[list[int], list[int], list[str], list[tuple[int, ...]]] | None:
        """What :meth:`whole` gives, for many tensors at once as four lists (file indexes,
        begins, dtypes, shapes) by C-level maps (the columnar paths ask for 90,000: ~1.5 µs a
        tensor one by one); None when any is absent."""
        got = list(map(self._at.get, fqns))
        if None in got:
            return None
        at = cast(list[int], got)
        return (
            list(map(self._files.__getitem__, at)),
            list(map(self._begins.__getitem__, at)),
            list(map(self._dtypes.__getitem__, at)),
            list(map(self._shapes.__getitem__, at)),
        )

    def whole(self, fqn: str) -> tuple[int, int, str, tuple[int, ...]] | None:
        """``(file index, begin, dtype, shape)`` of ``fqn``'s one whole shard without building
        it (verify's bitwise walk asks for 90,000 of them); None when absent."""
        i = self._at.get(fqn)
        if i is None:
            return None
        return self._files[i], self._begins[i], self._dtypes[i], self._shapes[i]


def _from_record(root: Path) -> Source:
    record = rec.read(root)
    layout, table = record.layout, record.table
    if layout is None or table is None:  # a shardctl hf output: an HF checkpoint with a record
        ck = open_checkpoint_ignoring_record(root)
        return _from_hf(root, ck, record)
    used = sorted({int(k) for r in table.ranks for k in np.unique(r.file).tolist()})
    names = sorted(table.files[k] for k in used)
    for name in names:
        path = root / name
        if path.is_symlink() or not path.is_file():
            raise InvalidInputError("recorded file missing or not a regular file", where=str(path))
    rows_of = rt.rows_by_file(table)
    begins = [np.zeros(len(r), dtype=np.int64) for r in table.ranks]
    files: list[InputFile] = []
    index = {n: k for k, n in enumerate(table.files)}
    # one file at a time: its header (~100 B per tensor) is dropped before the next is read
    for name in names:
        path = root / name
        files.append(_input_file(path, record))
        held = rows_of.get(index[name], [])
        # A header that is, byte for byte, the one the record implies (reshard writes it from
        # the record's rows) needs no parsing: at 90,000 tensors on 8 ranks that is 720,000
        # entries not built as objects (~3 s and ~100 MB).
        raw, file_size = read_raw(path, sh._limit[0])  # read_header's own cap
        exact = (
            begins_if_exact(raw, file_size, table, held[0][0], held[0][1])
            if len(held) == 1
            else None
        )
        if exact is not None:
            header = SafetensorsHeader(
                path, len(raw), 8 + len(raw), file_size, exact[1], NO_ENTRIES
            )
        else:
            header = parse_header(raw, path=path, file_size=file_size)
        del raw
        claimed = claimed_rank(header)
        other = sorted(i for i, _ in held if isinstance(claimed, int) and i != claimed)
        if other:
            raise InvalidInputError(
                f"the record places rank {other[0]}'s shards in this file, whose header says it "
                f"holds rank {claimed}'s: rank files renamed or swapped, or the record edited",
                where=str(path),
            )
        if exact is not None:
            i, rows = held[0]
            begins[i][rows] = exact[0]
            continue
        base = header.data_offset
        entries = {e.name: (base + e.begin, e.shape, e.dtype) for e in header.tensors}
        del header
        for i, rows in held:
            _begins(path, table, i, rows, entries, begins[i])
        del entries
    findex = {table.files[k]: names.index(table.files[k]) for k in used}
    file_of = [
        np.array([findex.get(n, -1) for n in table.files], dtype=np.int32)[r.file]
        for r in table.ranks
    ]
    groups = rt.by_tensor(table)
    missing = [
        table.tensors[t].fqn
        for t in np.flatnonzero(np.diff(np.asarray(groups.start)) == 0)[:5].tolist()
    ]
    if missing:
        raise InvalidInputError(f"record lists tensors no rank holds: {missing}", where=str(root))
    carried = tuple(
        Path(n)
        for n in sorted(os.listdir(root))
        if not n.startswith(".")
        and not n.endswith(".safetensors")
        and n != rec.RECORD_NAME
        and (root / n).is_file()
        and not (root / n).is_symlink()
    )
    model = from_tensors(root, record.tensors, architecture=record.architecture)
    return Source(
        root,
        "shardctl",
        model,
        RecordShards(table, groups, begins, file_of),
        tuple(files),
        carried,
        record,
    )


def claimed_rank(header: SafetensorsHeader) -> int | str | None:
    """The rank a shardctl rank file's header names (``__metadata__["shardctl"]["rank"]``);
    None when it names none (not a shardctl rank file, or an old one); ``"unreadable"``."""
    meta = (header.metadata or {}).get("shardctl")
    if meta is None:
        return None
    try:
        claimed = json.loads(meta).get("rank")
    except (ValueError, AttributeError, RecursionError):
        return "unreadable"
    return claimed if type(claimed) is int else None


def _begins(
    path: Path,
    table: rt.RecordTable,
    i: int,
    rows: np.ndarray,
    entries: dict[str, tuple[int, tuple[int, ...], str]],
    out: np.ndarray,
) -> None:
    """Fill ``out[rows]``, rank ``i``'s shards in file ``path``, with their absolute byte
    offsets, each shard checked against the file's header."""
    r = table.ranks[i]
    tensors, ndim = table.tensors, table.ndims
    shapes = r.local_shape[rows].tolist()
    for j, t, shape in zip(rows.tolist(), r.tensor[rows].tolist(), shapes, strict=True):
        info = tensors[t]
        got = entries.get(info.fqn)
        local = tuple(shape[: ndim[t]])
        if got is None or got[1] != local or got[2] != info.dtype:
            raise InvalidInputError(
                f"shard {info.fqn!r} of rank {i}: file header disagrees with the record "
                f"(record {list(local)} {info.dtype}, file "
                f"{[*got[1], got[2]] if got else 'missing'})",
                where=str(path),
            )
        out[j] = got[0]


class _Same:
    """A column of one value: ``column[j]`` is that value for every ``j``."""

    __slots__ = ("value",)

    def __init__(self, value: int) -> None:
        self.value = value

    def __getitem__(self, j: int) -> int:
        return self.value


class RecordShards(rt.PerAccess[tuple[SourceShard, ...]]):
    """``fqn -> (SourceShard, ...)`` of a ``ranks`` source, built per access from the record's
    arrays: 180,000 shards are never all objects at once unless a caller keeps them."""

    def __init__(
        self,
        table: rt.RecordTable,
        groups: rt.ByTensor,
        begins: list[np.ndarray],
        file_of: list[np.ndarray],
    ) -> None:
        super().__init__()
        self._t, self._g = table, groups
        self._begins = [array.array("q", b.astype(np.int64).tobytes()) for b in begins]
        # a rank in one file (the usual case) keeps its file as one value, not one per shard
        self._file: list[Any] = [
            _Same(int(f[0]))
            if f.size and (f == f[0]).all()
            else array.array("i", f.astype(np.int32).tobytes())
            for f in file_of
        ]
        self._index = rt.index_of(table)

    @property
    def table(self) -> rt.RecordTable:
        return self._t

    @property
    def groups(self) -> rt.ByTensor:
        return self._g

    def rows(self, i: int, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Rank ``i``'s shards ``rows`` as arrays: their input file indexes and first bytes
        (the columnar merge reads 180,000 of them without a ``SourceShard`` each)."""
        begin = np.frombuffer(self._begins[i], dtype=np.int64)[rows]
        f = self._file[i]
        if isinstance(f, _Same):
            return np.full(rows.size, f.value, dtype=np.int64), begin
        return np.frombuffer(f, dtype=np.int32)[rows].astype(np.int64), begin

    def _build(self, fqn: str) -> tuple[SourceShard, ...]:
        t = self._index[fqn]  # KeyError as a dict
        table = self._t
        info = table.tensors[t]
        out = []
        for i, j in self._g.of(t):
            r = table.ranks[i]
            local, pieces = rt.local_and_pieces(table, r, j)
            out.append(
                SourceShard(
                    info.fqn,
                    info.dtype,
                    local,
                    pieces,
                    begin=self._begins[i][j],
                    file=self._file[i][j],
                )
            )
        return tuple(out)

    def __iter__(self) -> Iterator[str]:
        return (t.fqn for t in self._t.tensors)

    def __len__(self) -> int:
        return len(self._t.tensors)

    def __contains__(self, fqn: object) -> bool:
        return fqn in self._index


def open_checkpoint_ignoring_record(root: Path) -> CheckpointFiles:
    """An ``hf`` output of shardctl: read it as a plain HF directory (the record is metadata)."""
    return open_checkpoint(root, ignore_layout_record=True)
