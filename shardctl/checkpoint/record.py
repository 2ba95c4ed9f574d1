"""The layout record ``shardctl.layout.json``: what a reshard wrote, and from what.

Written at DST's root (both formats), last before the commit; merging or converting a ``ranks``
output needs only this record, never the rules that made it. Schema ``"shardctl.layout/1"``::

    {
      "schema": "shardctl.layout/1",
      "tool": {"name": "shardctl", "version": "0.1.0"},
      "created": "2025-01-01T00:00:00Z",
      "format": "ranks",                      # or "hf"
      "architecture": "llama",
      "mesh": {"pp": 2, "dp": 1, "ep": 1, "tp": 4},
      "options": {"pipeline": "even", "layers_per_stage": null,
                  "vocab_padding": "tp", "uneven": "error"},
      "stages": [{"index": 0, "layers": [0, 15]}, {"index": 1, "layers": [16, 31]}],
      "source": {"kind": "hf", "path": "/abs/src",
                 "files": [{"name": "model-00001-of-00002.safetensors", "size": 4998…,
                            "mtime_ns": 17…, "sha256": null}],  # sha256 known from an HF-cache
                                                              # blob name, else null
                 "record": null},                # a shardctl source: {"files", "hash"}
      "tensors": [                               # the original checkpoint's tensors, file order
        {"fqn": "model.embed_tokens.weight", "dtype": "BF16",
         "global_shape": [32000, 4096], "padded_shape": [32000, 4096]}, ...],
      "ranks": [                                 # model-parallel ranks (dp 0), (pp, ep, tp) order
        {"rank": 0, "coord": {"pp": 0, "ep": 0, "tp": 0},
         "shards": [
           {"fqn": "model.layers.0.self_attn.q_proj.weight",
            "file": "rank-00000-of-00008.safetensors",
            "placement": "S(0)", "local_shape": [1024, 4096],
            "pieces": [{"offsets": [0, 0], "sizes": [1024, 4096], "local_offsets": [0, 0]}]},
           ...]}],
      "hash": "xxh3-128",                        # algorithm of every "files[].digest"
      "files": [{"name": "rank-00000-of-00008.safetensors", "size": 123, "digest": "ab…"}],
      "carried": ["config.json", "tokenizer.json"]
    }

- A shard's local tensor is stored under its ``fqn`` in ``file``; the data offsets come from
  that file's safetensors header. Local regions no piece covers are zero padding (vocab
  padding); ``padded_shape`` != ``global_shape`` says a tensor was padded.
- ``files[].digest`` hashes the whole file (header included) as written; for ``format: hf``
  ``ranks`` is empty and ``files`` lists the HF files (the index included).
- dp replicas are not written: a rank with ``dp > 0`` loads the file of its ``(pp, ep, tp)``.
- Each rank file's safetensors ``__metadata__`` names its rank under ``"shardctl"`` (JSON:
  ``schema``, ``rank``, ``coord``, ``mesh``, ``record`` — the record's file name — and
  ``tensors``, its count; files written before issue #14 also repeated their ``shards`` rows
  there, nothing reads them), and carries torch DCP's ``DCP_SHARDING_INFO`` (``saved_offsets``)
  when every shard in the file is rectangular; fused or padded shards, which DCP offsets cannot
  express, leave it out (DCP then refuses the directory instead of loading wrong values).

This module reads and validates the record; ``record_write`` builds and writes it.

Schema ``"shardctl.layout/2"`` (written since issue #14; ``record_v2``) has the same keys and
meanings, with ``tensors`` and each rank's ``shards`` stored as integer columns: ~15x smaller,
read into arrays (``record_table``) without a dict or a ``Shard`` per shard. Both are read.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from shardctl.checkpoint import record_check
from shardctl.checkpoint.strict_json import read_json_strict
from shardctl.errors import InvalidInputError
from shardctl.io.checksum import HASHES
from shardctl.io.heap import give_back_heap
from shardctl.layout.types import (
    Layout,
    LayoutOptions,
    Mesh,
    Piece,
    RankLayout,
    Shard,
    Stage,
)
from shardctl.model.types import TensorInfo

if TYPE_CHECKING:  # numpy is imported when a record is read, not by ``import shardctl``
    from shardctl.checkpoint import record_table as rt

SCHEMA = "shardctl.layout/1"  # also the ``schema`` of the rank files' header metadata
SCHEMA_V2 = "shardctl.layout/2"  # what reshard writes (``record_v2``)
SCHEMAS = (SCHEMA, SCHEMA_V2)
RECORD_NAME = "shardctl.layout.json"
MAX_RECORD_BYTES = 256 * 2**20


@dataclass(frozen=True)
class FileDigest:
    name: str
    size: int
    digest: str


@dataclass(frozen=True)
class LayoutRecord:
    """A parsed, validated record. ``files_of[(rank, fqn)]`` names the file holding that shard."""

    format: str
    architecture: str
    layout: Layout | None  # None for format "hf"
    tensors: tuple[TensorInfo, ...]
    padded_shapes: dict[str, tuple[int, ...]]
    shard_files: Mapping[tuple[int, str], str]
    hash: str
    files: tuple[FileDigest, ...]
    carried: tuple[str, ...]
    source: dict[str, Any]
    raw: dict[str, Any]  # the record's JSON; schema 2's without its "tensors" and "ranks"
    table: rt.RecordTable | None = None  # the shards as arrays (format "ranks")


# ---- reading -----------------------------------------------------------------------------


def load_json(path: Path) -> dict[str, Any]:
    """Strict JSON (size cap, no duplicate keys, no NaN/Infinity): the one strict reader."""
    obj = read_json_strict(path, max_bytes=MAX_RECORD_BYTES, what="layout record")
    if not isinstance(obj, dict):
        raise InvalidInputError("expected a JSON object", where=str(path))
    return obj


def _ints(v: Any, what: str, where: str) -> tuple[int, ...]:
    if not isinstance(v, list) or not all(type(x) is int and x >= 0 for x in v):
        raise InvalidInputError(f"{what}: expected a list of non-negative integers", where=where)
    return tuple(v)


def _str(v: Any, what: str, where: str) -> str:
    if not isinstance(v, str):
        raise InvalidInputError(f"{what}: expected a string", where=where)
    return v


def read(root: Path, *, exact_tiling: bool = True) -> LayoutRecord:
    """Parse and validate ``root/shardctl.layout.json`` (exit 3 on anything malformed).

    ``exact_tiling=False`` (verify's DST only): types, bounds and names are still enforced, but
    gaps and overlaps are left for verify's structure level to report as findings (exit 1)."""
    path = root / RECORD_NAME
    where = str(path)
    obj = load_json(path)
    if obj.get("schema") == SCHEMA_V2:
        from shardctl.checkpoint import record_v2

        out = record_v2.read(obj, where, exact_tiling=exact_tiling)
        del obj
        give_back_heap()  # the JSON tree, parsed into columns and dropped
        return out
    if obj.get("schema") != SCHEMA:
        raise InvalidInputError(
            f"unknown record schema {obj.get('schema')!r}, expected {SCHEMA_V2!r} or {SCHEMA!r}",
            where=where,
        )
    record_check.check_schema(obj, where)  # types and bounds first: nothing below trusts it
    try:
        parsed = _parse(obj, where)
    except (KeyError, TypeError, AttributeError) as exc:
        raise InvalidInputError(
            f"malformed record ({type(exc).__name__}: {exc})", where=where
        ) from None
    if parsed.layout is not None and exact_tiling:
        check_tiling(parsed.layout, where, parsed.tensors)
    return _with_table(parsed)


def _with_table(parsed: LayoutRecord) -> LayoutRecord:
    """A schema-1 record with its shards also as arrays (what the readers downstream use)."""
    from shardctl.checkpoint import record_table as rt

    layout = parsed.layout
    if layout is None:
        return parsed
    table = rt.from_shards(
        parsed.tensors,
        [f.name for f in parsed.files],
        [rl.shards for rl in layout.ranks],
        [[parsed.shard_files[(i, s.fqn)] for s in rl.shards] for i, rl in enumerate(layout.ranks)],
    )
    # the Shard objects of the parse go: the layout's ranks become views of the arrays
    ranks = tuple(
        RankLayout(rl.pp, rl.ep, rl.tp, cast(tuple[Shard, ...], rt.ShardSeq(table, i)))
        for i, rl in enumerate(layout.ranks)
    )
    view = Layout(
        layout.architecture,
        layout.mesh,
        layout.options,
        layout.stages,
        ranks,
        layout.padded_shapes,
    )
    return LayoutRecord(
        **{
            **parsed.__dict__,
            "layout": view,
            "shard_files": rt.ShardFiles(table, rt.index_of(table)),
            "table": table,
        }
    )


def make_layout(
    obj: dict[str, Any], table: rt.RecordTable, padded: dict[str, tuple[int, ...]]
) -> Layout:
    """The ``Layout`` of a validated record whose ranks' shards are array-backed sequences."""
    from shardctl.checkpoint import record_table as rt

    m = obj["mesh"]
    mesh = Mesh(**{a: int(m.get(a, 1)) for a in ("pp", "dp", "ep", "tp")})
    ranks = tuple(
        RankLayout(
            int(r["coord"]["pp"]),
            int(r["coord"]["ep"]),
            int(r["coord"]["tp"]),
            cast(tuple[Shard, ...], rt.ShardSeq(table, i)),
        )
        for i, r in enumerate(obj["ranks"])
    )
    return Layout(
        architecture=str(obj.get("architecture", "unknown")),
        mesh=mesh,
        options=_options(obj),
        stages=_stages(obj),
        ranks=ranks,
        padded_shapes=padded,
    )


def _stages(obj: dict[str, Any]) -> tuple[Stage, ...]:
    return tuple(
        Stage(
            int(s["index"]), (int(s["layers"][0]), int(s["layers"][1])) if s.get("layers") else None
        )
        for s in obj.get("stages", [])
    )


def file_digests(obj: dict[str, Any], where: str) -> tuple[FileDigest, ...]:
    return tuple(
        FileDigest(_str(f["name"], "files[].name", where), int(f["size"]), str(f["digest"]))
        for f in obj["files"]
    )


def check_tiling(layout: Layout, where: str, tensors_: tuple[TensorInfo, ...] = ()) -> None:
    """Every tensor's pieces tile it exactly (exit 3 naming the piece); see record_check.

    Also called by the copy before it writes a byte (``shardctl.reshard.copy``)."""
    tensors: dict[str, tuple[int, ...]] = {t.fqn: t.shape for t in tensors_}
    shards: list[Any] = []
    for i, rl in enumerate(layout.ranks):
        for j, s in enumerate(rl.shards):
            tensors[s.fqn] = s.global_shape
            shards.append(
                (
                    f"ranks[{i}].shards[{j}]",
                    s.fqn,
                    s.local_shape,
                    [(p.offsets, p.sizes) for p in s.pieces],
                    [p.local_offsets for p in s.pieces],
                )
            )
    record_check.check_tiling(tensors, shards, where)


def _parse(obj: dict[str, Any], where: str) -> LayoutRecord:
    fmt = _str(obj["format"], "format", where)
    if fmt not in ("ranks", "hf"):
        raise InvalidInputError(f"format: expected 'ranks' or 'hf', got {fmt!r}", where=where)
    tensors, padded = _tensors(obj, where)
    m = obj["mesh"]
    mesh = Mesh(**{a: int(m[a]) for a in ("pp", "dp", "ep", "tp")})
    options = _options(obj)
    stages = _stages(obj)
    files = file_digests(obj, where)
    shard_files: dict[tuple[int, str], str] = {}
    layout: Layout | None = None
    if fmt == "ranks":
        info = {t.fqn: t for t in tensors}
        ranks = _ranks(obj, mesh, info, {f.name for f in files}, shard_files, where)
        layout = Layout(
            architecture=str(obj.get("architecture", "unknown")),
            mesh=mesh,
            options=options,
            stages=stages,
            ranks=ranks,
            padded_shapes=padded,
        )
    return LayoutRecord(
        format=fmt,
        architecture=str(obj.get("architecture", "unknown")),
        layout=layout,
        tensors=tensors,
        padded_shapes=padded,
        shard_files=shard_files,
        hash=hash_name(obj["hash"], where),
        files=files,
        carried=tuple(str(c) for c in obj.get("carried", [])),
        source=dict(obj.get("source") or {}),
        raw=obj,
    )


def _tensors(
    obj: dict[str, Any], where: str
) -> tuple[tuple[TensorInfo, ...], dict[str, tuple[int, ...]]]:
    """The ``tensors`` rows (names unique, not empty) and the padded shapes that differ."""
    tensors: list[TensorInfo] = []
    padded: dict[str, tuple[int, ...]] = {}
    seen: set[str] = set()
    for i, t in enumerate(obj["tensors"]):
        w = f"tensors[{i}]"
        fqn = _str(t["fqn"], f"{w}.fqn", where)
        if not fqn or fqn in seen:
            raise InvalidInputError(f"{w}.fqn: empty or duplicate name {fqn!r}", where=where)
        seen.add(fqn)
        shape = _ints(t["global_shape"], f"{w}.global_shape", where)
        tensors.append(TensorInfo(fqn, shape, _str(t["dtype"], f"{w}.dtype", where)))
        pshape = _ints(t.get("padded_shape", list(shape)), f"{w}.padded_shape", where)
        if pshape != shape:
            padded[fqn] = pshape
    return tuple(tensors), padded


def _options(obj: dict[str, Any]) -> LayoutOptions:
    o = obj.get("options") or {}
    lps = o.get("layers_per_stage")
    return LayoutOptions(
        pipeline=o.get("pipeline", "even"),
        layers_per_stage=tuple(lps) if lps else None,
        vocab_padding=o.get("vocab_padding", "tp"),
        uneven=o.get("uneven", "error"),
    )


def _ranks(
    obj: dict[str, Any],
    mesh: Mesh,
    info: dict[str, TensorInfo],
    names: set[str],
    shard_files: dict[tuple[int, str], str],
    where: str,
) -> tuple[RankLayout, ...]:
    """The ``ranks`` rows, one per model-parallel rank; fills ``shard_files[(rank, fqn)]``."""
    if len(obj["ranks"]) != mesh.model_parallel:
        raise InvalidInputError(
            f"ranks: {len(obj['ranks'])} entries for a mesh of {mesh.model_parallel} "
            "model-parallel ranks",
            where=where,
        )
    ranks: list[RankLayout] = []
    for i, r in enumerate(obj["ranks"]):
        shards: list[Shard] = []
        for j, s in enumerate(r["shards"]):
            w = f"ranks[{i}].shards[{j}]"
            fqn = _str(s["fqn"], f"{w}.fqn", where)
            if fqn not in info:
                raise InvalidInputError(f"{w}: tensor {fqn!r} not in 'tensors'", where=where)
            file = _str(s["file"], f"{w}.file", where)
            if file not in names or "/" in file or file.startswith("."):
                raise InvalidInputError(f"{w}.file: {file!r} is not a recorded file", where=where)
            shard = _shard(s, info[fqn], w, where)
            shards.append(shard)
            shard_files[(i, fqn)] = file
        c = r["coord"]
        ranks.append(RankLayout(int(c["pp"]), int(c["ep"]), int(c["tp"]), tuple(shards)))
    return tuple(ranks)


def hash_name(value: Any, where: str) -> str:
    name = _str(value, "hash", where)
    if name not in HASHES:
        raise InvalidInputError(
            f"layout record: unknown checksum algorithm {name!r}",
            where=where,
            hint=f"expected one of {', '.join(HASHES)}; was it written by a newer shardctl?",
        )
    return name


def _shard(s: dict[str, Any], t: TensorInfo, w: str, where: str) -> Shard:
    local = _ints(s["local_shape"], f"{w}.local_shape", where)
    nd = len(t.shape)
    if len(local) != nd:
        raise InvalidInputError(f"{w}.local_shape: rank {len(local)} != {nd}", where=where)
    pieces: list[Piece] = []
    for k, p in enumerate(s["pieces"]):
        off = _ints(p["offsets"], f"{w}.pieces[{k}].offsets", where)
        siz = _ints(p["sizes"], f"{w}.pieces[{k}].sizes", where)
        loc = _ints(p["local_offsets"], f"{w}.pieces[{k}].local_offsets", where)
        if not (len(off) == len(siz) == len(loc) == nd) or any(
            o + z > g or lo + z > ls
            for o, z, g, lo, ls in zip(off, siz, t.shape, loc, local, strict=True)
        ):
            raise InvalidInputError(
                f"{w}.pieces[{k}]: box outside the global {list(t.shape)} or local "
                f"{list(local)} tensor",
                where=where,
            )
        pieces.append(Piece(off, siz, loc))
    return Shard(
        fqn=t.fqn,
        dtype=t.dtype,
        global_shape=t.shape,
        local_shape=local,
        pieces=tuple(pieces),
        placement=str(s.get("placement", "?")),
    )
