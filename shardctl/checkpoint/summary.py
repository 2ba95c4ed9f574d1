"""``shardctl inspect PATH``: a checkpoint at a glance, from headers and records only.

PATH may be an HF checkpoint directory, a shardctl layout directory (``shardctl.layout.json``),
a single ``*.safetensors`` file, or a ``config.json``. No tensor data is read.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from operator import attrgetter, methodcaller
from pathlib import Path
from typing import Any

from shardctl.errors import InvalidInputError
from shardctl.gcpause import gc_paused
from shardctl.model.types import ModelInfo, TensorInfo

INSPECT_SCHEMA = "shardctl.inspect/1"


@dataclass(frozen=True)
class FileSummary:
    name: str
    size: int
    tensors: int


@dataclass(frozen=True)
class RankSummary:
    rank: int
    coord: dict[str, int]
    shards: int
    bytes: int
    files: tuple[str, ...]


@dataclass(frozen=True)
class InspectResult:
    path: Path
    kind: str  # "hf" | "shardctl" | "safetensors" | "config"
    model: ModelInfo
    files: tuple[FileSummary, ...] = ()
    carried: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    mesh: dict[str, int] | None = None
    layout_format: str | None = None
    stages: tuple[dict[str, Any], ...] = ()
    ranks: tuple[RankSummary, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict)
    # no family file for the architecture: the manifest rules that would place its tensors
    suggested: Any = None  # shardctl.archs.suggest.Suggestion | None

    @property
    def dtypes(self) -> dict[str, int]:
        """Parameters per dtype, largest first."""
        return dict(Counter(self.model.numel_by_dtype).most_common())

    @property
    def quantization(self) -> dict[str, Any] | None:
        """Method and per tensor group schemes (shardctl/quant/groups.py), None if unquantized."""
        from shardctl.quant.config import read_quant
        from shardctl.quant.groups import ANCHOR_ENDS, describe_model

        where = str(self.path)
        if read_quant(self.model.config, where=f"{where}/config.json") is None and not any(
            map(methodcaller("endswith", ANCHOR_ENDS), map(attrgetter("fqn"), self.model.tensors))
        ):
            return None  # no method and no group anchor (describe_model's answer, 90k × faster)
        return describe_model(self.model.tensors, self.model.config, where=where)

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "schema": INSPECT_SCHEMA,
            "path": str(self.path),
            "kind": self.kind,
            "model": {
                "architecture": self.model.architecture,
                "parameters": self.model.parameters,
                "weight_bytes": self.model.weight_bytes,
                "tensors": len(self.model.tensors),
                "dtypes": self.dtypes,
                "dims": None if self.model.dims is None else vars(self.model.dims),
            },
            "files": [vars(f) for f in self.files],
            "carried": list(self.carried),
            "warnings": list(self.warnings),
        }
        quant = self.quantization
        if quant is not None:
            doc["model"]["quantization"] = quant
        if self.suggested is not None:
            from shardctl.archs.suggest import rule_yaml

            doc["suggested_rules"] = {
                "source": self.suggested.source,
                "rules": [rule_yaml(r) for r in self.suggested.rules],
                "applied": False,
            }
        if self.mesh is not None:
            doc["layout"] = {
                "format": self.layout_format,
                "mesh": self.mesh,
                "stages": list(self.stages),
                "ranks": [
                    {
                        "rank": r.rank,
                        "coord": r.coord,
                        "shards": r.shards,
                        "bytes": r.bytes,
                        "files": list(r.files),
                    }
                    for r in self.ranks
                ],
            }
        if "dcp" in self.extra:  # dcp-optim: optimizer state, step, param_groups
            doc["dcp"] = self.extra["dcp"]
        return doc


@gc_paused
def inspect_path(path: Path) -> InspectResult:
    if not path.exists():
        raise InvalidInputError(
            "no such file or directory",
            where=str(path),
            hint="pass a checkpoint directory, a *.safetensors file or a config.json",
        )
    if path.is_dir():
        if (path / ".metadata").is_file():  # dcp-optim: a torch DCP checkpoint
            from shardctl.formats.dcp.inspect import inspect_dcp

            return inspect_dcp(path)
        if (path / "shardctl.layout.json").is_file():
            return _inspect_layout(path)
        return _inspect_hf(path)
    if path.suffix == ".safetensors":
        return _inspect_file(path)
    if path.suffix == ".json":
        from shardctl.model.inventory import from_config_file

        return InspectResult(path=path, kind="config", model=from_config_file(path))
    raise InvalidInputError(
        f"cannot inspect a {path.suffix or 'suffix-less'} file",
        where=str(path),
        hint="pass a checkpoint directory, a *.safetensors file or a config.json",
    )


def _inspect_hf(root: Path) -> InspectResult:
    from shardctl.archs.suggest import suggestion_for
    from shardctl.checkpoint.hf import open_checkpoint
    from shardctl.model.inventory import from_checkpoint

    files = open_checkpoint(root, ignore_layout_record=True)
    # headers parsed once; beside a record (a dangling link, say) from_checkpoint decides
    bare = not os.path.lexists(root / "shardctl.layout.json")
    model = from_checkpoint(root, opened=files if bare else None)
    return InspectResult(
        suggested=suggestion_for(model),
        path=root,
        kind="hf",
        model=model,
        files=tuple(FileSummary(h.path.name, h.file_size, len(h.names)) for h in files.files),
        carried=tuple(str(p) for p in files.extra_files),
        warnings=tuple(files.warnings),
    )


def _inspect_file(path: Path) -> InspectResult:
    from shardctl.io.safetensors_header import read_header

    header = read_header(path)
    tensors = tuple(TensorInfo(e.name, tuple(e.shape), e.dtype) for e in header.tensors)
    dtype = Counter(t.dtype for t in tensors).most_common(1)[0][0] if tensors else "BF16"
    model = ModelInfo(
        architecture="unknown", dims=None, tensors=tensors, dtype=dtype, source="checkpoint"
    )
    return InspectResult(
        path=path,
        kind="safetensors",
        model=model,
        files=(FileSummary(path.name, header.file_size, len(tensors)),),
        extra={"metadata": header.metadata or {}},
    )


def _inspect_layout(root: Path) -> InspectResult:
    from shardctl.checkpoint import record as record_mod
    from shardctl.checkpoint import record_table as rt

    rec = record_mod.read(root)
    tensors = rec.tensors
    dtype = Counter(t.dtype for t in tensors).most_common(1)[0][0] if tensors else "BF16"
    model = ModelInfo(
        architecture=rec.architecture, dims=None, tensors=tensors, dtype=dtype, source="checkpoint"
    )
    table = rec.table
    if table is not None:  # the columns: no (rank, fqn) key or Shard per shard
        counts: Mapping[str, int] = dict(zip(table.files, rt.file_counts(table), strict=True))
    else:
        counts = Counter(name for (_rank, _fqn), name in rec.shard_files.items())
    files = tuple(FileSummary(f.name, f.size, counts.get(f.name, 0)) for f in rec.files)
    ranks: list[RankSummary] = []
    mesh = None
    stages: tuple[dict[str, Any], ...] = ()
    if rec.layout is not None:
        layout = rec.layout
        mesh = layout.mesh.as_dict()
        stages = tuple(
            {"stage": s.index, "layers": list(s.layers) if s.layers else None}
            for s in layout.stages
        )
        for i, r in enumerate(layout.ranks):
            if table is not None:
                names, nbytes = rt.rank_files(table, i), rt.rank_bytes(table, i)
            else:
                names = tuple(sorted({rec.shard_files[(i, s.fqn)] for s in r.shards}))
                nbytes = r.nbytes
            ranks.append(
                RankSummary(
                    rank=i,
                    coord={"pp": r.pp, "ep": r.ep, "tp": r.tp},
                    shards=len(r.shards),
                    bytes=nbytes,
                    files=names,
                )
            )
    return InspectResult(
        path=root,
        kind="shardctl",
        model=model,
        files=files,
        carried=tuple(rec.carried),
        mesh=mesh,
        layout_format=rec.format,
        stages=stages,
        ranks=tuple(ranks),
        extra={"source": rec.source, "hash": rec.hash},
    )
