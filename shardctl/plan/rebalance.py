"""Rebalance: from an existing layout and a new GPU count, the best new mesh and what each
new rank must read, from which old files, to get there.

A new rank's bytes from an old file are the overlap of its pieces with that file's shards,
a replicated old piece counted once, from its first holder in record order — the boxes
``shardctl reshard``'s copy engine plans (``shardctl.reshard.boxes.plan_boxes``), computed
here from the layout record (or the HF headers) and the new layout, without reading tensor
data. The copy reads whole source rows and keeps the last rows it read, so its disk reads can
differ from these figures when a new rank keeps only some columns of an old shard.

``full_reload_bytes`` is the reference: every new model-parallel rank reading the whole old
checkpoint and keeping its slice (a loader without a shard map).
"""

from __future__ import annotations

import math
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shardctl.errors import EXIT_NEGATIVE, ShardctlError, UsageError
from shardctl.layout.types import Layout, Mesh, Piece

if TYPE_CHECKING:
    from shardctl.checkpoint.source import Source, SourceShard
    from shardctl.manifest import Manifest
    from shardctl.plan.search_types import Candidate

REBALANCE_SCHEMA = "shardctl.rebalance/1"


class NoLayoutFits(ShardctlError):
    """No layout of the model fits the new GPU count: a negative result (exit 1)."""

    exit_code = EXIT_NEGATIVE


@dataclass(frozen=True)
class FileReads:
    file: str  # relative to the old layout's root
    nbytes: int


@dataclass(frozen=True)
class RankReads:
    rank: int
    coord: dict[str, int]
    files: tuple[FileReads, ...]

    @property
    def nbytes(self) -> int:
        return sum(f.nbytes for f in self.files)


@dataclass(frozen=True)
class Rebalance:
    source: Path
    source_kind: str  # "hf" | "shardctl"
    source_mesh: Mesh | None  # None for an HF checkpoint
    source_bytes: int  # all old tensor files
    gpus: int
    candidate: Candidate
    ranks: tuple[RankReads, ...]  # the new model-parallel ranks (dp 0)
    command: tuple[str, ...]
    note: str | None = None

    @property
    def mesh(self) -> Mesh:
        return self.candidate.mesh

    @property
    def move_bytes(self) -> int:
        """Bytes all new ranks read from the old files together."""
        return sum(r.nbytes for r in self.ranks)

    @property
    def full_reload_bytes(self) -> int:
        return len(self.ranks) * self.source_bytes

    def per_file(self) -> dict[str, int]:
        """Bytes read from each old file, all new ranks together."""
        out: dict[str, int] = {}
        for r in self.ranks:
            for f in r.files:
                out[f.file] = out.get(f.file, 0) + f.nbytes
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": REBALANCE_SCHEMA,
            "source": {
                "path": str(self.source),
                "kind": self.source_kind,
                "mesh": None if self.source_mesh is None else self.source_mesh.as_dict(),
                "bytes": self.source_bytes,
            },
            "gpus": self.gpus,
            "mesh": self.mesh.as_dict(),
            "candidate": self.candidate.to_json(),
            "note": self.note,
            "move_bytes": self.move_bytes,
            "full_reload_bytes": self.full_reload_bytes,
            "ranks": [
                {
                    "rank": r.rank,
                    "coord": r.coord,
                    "bytes": r.nbytes,
                    "files": [{"file": f.file, "bytes": f.nbytes} for f in r.files],
                }
                for r in self.ranks
            ],
            "command": list(self.command),
            "command_line": shlex.join(self.command),
        }


def _piece(p: Piece) -> Piece:
    # A scalar is one element at offset 0 (as the copy engine treats it).
    return p if p.sizes else Piece((0,), (1,), (0,))


def _holders(sources: Sequence[SourceShard]) -> list[tuple[SourceShard, Piece]]:
    """One holder per distinct source piece, the first in record order (the copy engine's
    choice among replicas)."""
    held: dict[tuple[tuple[int, ...], tuple[int, ...]], tuple[SourceShard, Piece]] = {}
    for s in sources:
        for q in map(_piece, s.pieces):
            held.setdefault((q.offsets, q.sizes), (s, q))
    return list(held.values())


def rank_reads(source: Source, layout: Layout) -> list[RankReads]:
    """The bytes every new rank reads, per old file."""
    from shardctl.dtypes import nbytes

    names = [str(f.path.relative_to(source.root)) for f in source.files]
    holders = {fqn: _holders(shards) for fqn, shards in source.shards.items()}
    out = []
    for i, rl in enumerate(layout.ranks):
        needs: dict[int, int] = {}
        for shard in rl.shards:
            for p in map(_piece, shard.pieces):
                for s, q in holders[shard.fqn]:
                    sizes = [
                        min(a + n, b + m) - max(a, b)
                        for a, n, b, m in zip(p.offsets, p.sizes, q.offsets, q.sizes, strict=True)
                    ]
                    if any(n <= 0 for n in sizes):
                        continue
                    needs[s.file] = needs.get(s.file, 0) + nbytes(s.dtype, math.prod(sizes))
        files = tuple(FileReads(names[f], needs[f]) for f in sorted(needs))
        out.append(RankReads(i, {"pp": rl.pp, "ep": rl.ep, "tp": rl.tp}, files))
    return out


def choose_mesh(manifest: Manifest, source: Source, gpus: int) -> tuple[Candidate, str | None]:
    """The search's best layout using all ``gpus``; else its best on fewer (with a note)."""
    from shardctl.plan.memory.adapter import search_layouts

    result = search_layouts(manifest, source.model, gpus=gpus)
    if not result.candidates:
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(result.rejected.items()))
        raise NoLayoutFits(
            f"no layout of this model fits on {gpus} GPUs (rejected: {reasons})",
            hint="raise --gpus or change hardware/workload in the manifest",
        )
    full = [c for c in result.candidates if c.world == gpus]
    if full:
        return full[0], None
    best = result.candidates[0]
    return best, f"no fitting layout uses all {gpus} GPUs; the best uses {best.world}"


def reshard_command(src: Path, dst: Path, mesh: Mesh, manifest: Path | None) -> tuple[str, ...]:
    cmd = ["shardctl", "reshard", str(src), str(dst)]
    cmd += ["--tp", str(mesh.tp), "--pp", str(mesh.pp), "--ep", str(mesh.ep)]
    if manifest is not None:
        cmd += ["--manifest", str(manifest)]  # its rules and layout options; flags set the mesh
    return tuple(cmd)


def plan_rebalance(
    manifest_path: Path, layout_dir: Path, *, gpus: int, dst: Path | None = None
) -> Rebalance:
    """Best new mesh on ``gpus`` GPUs for the checkpoint at ``layout_dir`` (a shardctl layout
    or an HF directory), the reads it costs, and the ``shardctl reshard`` command."""
    from shardctl.checkpoint.source import open_source
    from shardctl.layout.engine import build_layout
    from shardctl.manifest import load_manifest

    if gpus < 1:
        raise UsageError("--from needs --gpus N with N ≥ 1")
    manifest = load_manifest(manifest_path)
    source = open_source(layout_dir)
    candidate, note = choose_mesh(manifest, source, gpus)
    mesh = Mesh(pp=candidate.mesh.pp, ep=candidate.mesh.ep, tp=candidate.mesh.tp)
    options = manifest.layout
    if options.layers_per_stage is not None and len(options.layers_per_stage) != mesh.pp:
        from dataclasses import replace

        options = replace(options, layers_per_stage=None)
    layout = build_layout(source.model, mesh, rules=manifest.rules, options=options)
    old = None if source.record is None else source.record.layout
    if dst is None:
        tag = f"tp{mesh.tp}-pp{mesh.pp}" + (f"-ep{mesh.ep}" if mesh.ep > 1 else "")
        dst = layout_dir.with_name(f"{layout_dir.name}-{tag}")
    return Rebalance(
        source=layout_dir,
        source_kind=source.kind,
        source_mesh=None if old is None else old.mesh,
        source_bytes=sum(f.size for f in source.files),
        gpus=gpus,
        candidate=candidate,
        ranks=tuple(rank_reads(source, layout)),
        command=reshard_command(layout_dir, dst, mesh, manifest_path),
        note=note,
    )
