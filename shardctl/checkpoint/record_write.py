"""Building and writing the layout record ``shardctl.layout.json`` (schema and fields:
``shardctl.checkpoint.record``, which reads it). Written as schema ``"shardctl.layout/2"``
(columns, ``record_v2``); ``build(schema=SCHEMA)`` still writes schema 1 (rows)."""

from __future__ import annotations

import itertools
import json
import os
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from operator import attrgetter
from pathlib import Path
from typing import Any

import numpy as np

from shardctl import __version__
from shardctl.checkpoint import record_table, record_v2
from shardctl.checkpoint.record import RECORD_NAME, SCHEMA, SCHEMA_V2, FileDigest
from shardctl.layout.types import Layout, LayoutOptions, Mesh, Shard
from shardctl.model.types import TensorInfo

_FQN = attrgetter("fqn")


def shard_json(shard: Shard, file: str) -> dict[str, Any]:
    return {
        "fqn": shard.fqn,
        "file": file,
        "placement": shard.placement,
        "local_shape": list(shard.local_shape),
        "pieces": [
            {
                "offsets": list(p.offsets),
                "sizes": list(p.sizes),
                "local_offsets": list(p.local_offsets),
            }
            for p in shard.pieces
        ],
    }


class RankRows:
    """A rank's ``shards`` rows, made when iterated: ``write`` encodes a few thousand at a time,
    so the rows of 180,000 shards (~1 KB each as dicts) never all exist at once."""

    def __init__(
        self, shards: tuple[Shard, ...], rank: int, shard_files: Mapping[tuple[int, str], str]
    ) -> None:
        self.shards, self.rank, self.shard_files = shards, rank, shard_files

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for s in self.shards:
            yield shard_json(s, self.shard_files[(self.rank, s.fqn)])

    def __len__(self) -> int:
        return len(self.shards)


class TensorRows:
    """The record's ``tensors`` rows, made when iterated (as :class:`RankRows`)."""

    def __init__(
        self, tensors: tuple[TensorInfo, ...], padded_shapes: dict[str, tuple[int, ...]]
    ) -> None:
        self.tensors, self.padded_shapes = tensors, padded_shapes

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for t in self.tensors:
            yield {
                "fqn": t.fqn,
                "dtype": t.dtype,
                "global_shape": list(t.shape),
                "padded_shape": list(self.padded_shapes.get(t.fqn, t.shape)),
            }

    def __len__(self) -> int:
        return len(self.tensors)


class RankColumns:
    """Rank ``rank``'s schema-2 ``shards`` object, encoded when :func:`write` reaches it."""

    def __init__(
        self,
        tensors: tuple[TensorInfo, ...],
        names: list[str],
        shards: Sequence[Shard],
        shard_files: Mapping[tuple[int, str], str],
        rank: int,
        tindex: Mapping[str, int] | None = None,
        ndim: np.ndarray | None = None,
    ) -> None:
        self.tensors, self.names, self.shards = tensors, names, shards
        self.shard_files, self.rank, self.tindex, self.ndim = shard_files, rank, tindex, ndim

    def encode(self) -> dict[str, Any]:
        planned, ids = self.shard_files, None
        if (
            self.tindex is not None
            and isinstance(planned, record_table.PlannedFiles)
            and planned.order is self.tindex
        ):
            # the planner's order is the tensors' own: one lookup a shard gives both its
            # tensor column and its file
            fqns = list(map(_FQN, self.shards))
            ids = np.fromiter(map(self.tindex.__getitem__, fqns), np.int64, len(fqns))
            file_of = planned.names_at(self.rank, ids, fqns)
        else:
            file_of = record_table.planned_names(planned, self.rank, self.shards)
        table = record_table.from_shards(
            self.tensors,
            self.names,
            [self.shards],
            [file_of],
            self.tindex,
            self.ndim,
            None if ids is None else [ids],
        )
        return record_v2.encode_rank(table, table.ranks[0])


def build(
    *,
    fmt: str,
    architecture: str,
    layout: Layout | None,
    tensors: tuple[TensorInfo, ...],
    padded_shapes: dict[str, tuple[int, ...]],
    shard_files: Mapping[tuple[int, str], str],
    source: dict[str, Any],
    hash_name: str,
    files: list[FileDigest],
    carried: list[str],
    schema: str = SCHEMA_V2,
    tindex: Mapping[str, int] | None = None,
) -> dict[str, Any]:
    """The record as a dict for ``write``. Schema 2: ``tensors`` and each rank's ``shards`` are
    column objects (``record_v2.encode``). Schema 1: ``tensors`` a ``TensorRows``, each rank's
    ``shards`` a ``RankRows`` (rows made as they are written). ``tindex``: each of ``tensors``'
    position by name, when the caller has that map (the planner's order)."""
    assert schema in (SCHEMA, SCHEMA_V2)
    ranks: list[dict[str, Any]] = []
    tensor_obj: Any = TensorRows(tensors, padded_shapes)
    columns: list[Any] = []
    if schema == SCHEMA_V2:
        # One rank's table at a time, encoded as it is written (RankColumns): all of them at
        # once are ~130 B a shard (46 MB at 360,000 shards), their base64 ~25 B a shard, and a
        # rank's columns depend on that rank alone.
        names = [f.name for f in files]
        whole = record_table.from_shards(tensors, names, [], [], {})  # no ranks: no map
        tensor_obj = record_v2.encode_tensors(whole, padded_shapes)
        if layout is not None and tindex is None:
            tindex = {t.fqn: i for i, t in enumerate(tensors)}
        columns = [
            RankColumns(tensors, names, rl.shards, shard_files, i, tindex, whole.ndim)
            for i, rl in enumerate(layout.ranks if layout is not None else ())
        ]
    if layout is not None:
        for i, rl in enumerate(layout.ranks):
            ranks.append(
                {
                    "rank": i,
                    "coord": {"pp": rl.pp, "ep": rl.ep, "tp": rl.tp},
                    "shards": columns[i] if columns else RankRows(rl.shards, i, shard_files),
                }
            )
    opts = layout.options if layout is not None else LayoutOptions()
    return {
        "schema": schema,
        "tool": {"name": "shardctl", "version": __version__},
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "format": fmt,
        "architecture": architecture,
        "mesh": (layout.mesh if layout is not None else Mesh()).as_dict(),
        "options": {
            "pipeline": opts.pipeline,
            "layers_per_stage": list(opts.layers_per_stage) if opts.layers_per_stage else None,
            "vocab_padding": opts.vocab_padding,
            "uneven": opts.uneven,
        },
        "stages": [
            {"index": s.index, "layers": list(s.layers) if s.layers else None}
            for s in (layout.stages if layout is not None else ())
        ],
        "source": source,
        "tensors": tensor_obj,
        "ranks": ranks,
        "hash": hash_name,
        "files": [{"name": f.name, "size": f.size, "digest": f.digest} for f in files],
        "carried": carried,
    }


def write(directory: Path, record: dict[str, Any]) -> Path:
    """Write and fsync ``shardctl.layout.json`` in ``directory``, streamed: memory stays a few
    MB whatever the tensor count (the text of a 90k-tensor split is ~60 MB)."""
    path = directory / RECORD_NAME
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
    try:
        pending: list[str] = []
        size = 0
        for text in _text(record):
            pending.append(text)
            size += len(text)
            if size >= FLUSH_CHARS:
                _write_all(fd, "".join(pending).encode("utf-8"))
                pending, size = [], 0
        _write_all(fd, "".join(pending).encode("utf-8"))
        os.fsync(fd)
    finally:
        os.close(fd)
    return path


FLUSH_CHARS = 2**20
ROWS_PER_CALL = 2048  # rows per C-encoder call: one call per row costs ~2x, one per list ~60 MB


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _dumps(record: dict[str, Any]) -> bytes:
    """The whole record text at once (what :func:`write` streams)."""
    return "".join(_text(record)).encode("utf-8")


def _text(record: dict[str, Any]) -> Iterator[str]:
    """The record as JSON, one top-level key, tensor or shard per line, in pieces.

    ``json.dumps(indent=...)`` runs the pure-Python encoder: 5 s for a 12k-tensor MoE split
    four ways. Rows here go through the C encoder ``ROWS_PER_CALL`` at a time, so the text
    stays diffable and ``grep``-able at a fraction of the cost.
    """

    def one(v: Any) -> str:
        return json.dumps(v, separators=(", ", ": "))

    def rows(items: Iterable[Any], indent: str) -> Iterator[str]:
        # One encoder call per chunk of rows, then a line break between its objects: the
        # text '}, {"fqn"' cannot occur inside a JSON string (its quote would be escaped).
        sep = "},\n" + indent + '{"fqn"'
        it = iter(items)
        first = True
        while chunk := list(itertools.islice(it, ROWS_PER_CALL)):
            body = one(chunk)[1:-1].replace('}, {"fqn"', sep)
            yield ("[\n" + indent if first else ",\n" + indent) + body
            first = False
        yield "[]" if first else "\n" + indent[:-1] + "]"

    yield "{\n"
    for n, (key, value) in enumerate(record.items()):
        yield (",\n " if n else " ") + json.dumps(key) + ": "
        if key == "tensors" and not isinstance(value, dict | str):
            yield from rows(value, "  ")
        elif key == "ranks" and isinstance(value, list):
            if not value:
                yield "[]"
                continue
            yield "[\n"
            for i, r in enumerate(value):
                head = {k: v for k, v in r.items() if k != "shards"}
                yield (",\n  " if i else "  ") + one(head)[:-1] + ', "shards": '
                shards = r.get("shards", [])
                if isinstance(shards, RankColumns):  # schema 2, encoded now
                    yield one(shards.encode())
                elif isinstance(shards, dict):  # schema 2: one object of columns
                    yield one(shards)
                else:
                    yield from rows(shards, "   ")
                yield "}"
            yield "\n ]"
        else:
            yield one(value)
    yield "\n}\n"
