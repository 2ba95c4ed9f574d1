"""``shardctl plan``: manifest → model inventory → layout → per-rank memory.

The weight bytes printed for a rank are the bytes ``reshard`` writes for it: both come from
:func:`shardctl.layout.engine.build_layout`. No torch, no numpy on this path.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from shardctl.layout.types import Layout, Mesh, Stage
from shardctl.manifest import Manifest, load_manifest
from shardctl.model.types import ModelInfo

PLAN_SCHEMA = "shardctl.plan/1"
MEMORY_KEYS = ("weights", "kv_cache", "activations", "gradients", "optimizer", "overhead")


def load_model(manifest: Manifest) -> ModelInfo:
    """The inventory the manifest's ``model`` section names (config, checkpoint, count, inline)."""
    from shardctl.model import inventory

    spec = manifest.model
    if spec.checkpoint is not None:
        info = inventory.from_checkpoint(spec.checkpoint)
        if spec.dtype is not None and spec.dtype != info.dtype:
            # A checkpoint is counted as stored: its headers are the truth.
            pass
        return info
    if spec.config is not None:
        info = inventory.from_config_file(spec.config, dtype=spec.dtype)
        return info
    if spec.parameters is not None:
        return inventory.from_parameters(spec.parameters, spec.dtype or "BF16")
    return inventory.from_config(dict(spec.inline_config), dtype=spec.dtype, source="inline")


def apply_mesh_overrides(mesh: Mesh, overrides: Mapping[str, int]) -> Mesh:
    return replace(mesh, **dict(overrides)) if overrides else mesh


@dataclass(frozen=True)
class RankPlan:
    rank: int
    coord: dict[str, int]
    stage: int
    memory: dict[str, int]

    @property
    def total(self) -> int:
        return self.memory["total"]


@dataclass(frozen=True)
class PlanResult:
    manifest: Manifest
    model: ModelInfo
    mesh: Mesh
    layout: Layout | None
    stages: tuple[Stage, ...]
    ranks: tuple[RankPlan, ...]
    device_memory: int | None
    extra: Mapping[str, Any]  # memory-model sections (kv_cache, communication, ...) for JSON

    @property
    def fits(self) -> bool | None:
        if self.device_memory is None:
            return None
        return all(r.total <= self.device_memory for r in self.ranks)

    def stage_weight_bytes(self) -> list[int]:
        """Weight bytes of one model replica per stage (sum over its tp × ep ranks)."""
        out = [0] * self.mesh.pp
        for r in self.ranks:
            if r.coord["dp"] == 0:
                out[r.stage] += r.memory["weights"]
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": PLAN_SCHEMA,
            "model": {
                "architecture": self.model.architecture,
                "parameters": self.model.parameters,
                "weight_bytes": self.model.weight_bytes,
                "dtype": self.model.dtype,
                "source": self.model.source,
            },
            "mesh": self.mesh.as_dict(),
            "fits": self.fits,
            "device_memory_bytes": self.device_memory,
            "stages": [
                {
                    "stage": s.index,
                    "layers": list(s.layers) if s.layers is not None else None,
                    "weight_bytes": w,
                }
                for s, w in zip(self.stages, self.stage_weight_bytes(), strict=True)
            ],
            "ranks": [
                {"rank": r.rank, "coord": r.coord, "stage": r.stage, "memory": r.memory}
                for r in self.ranks
            ],
            **dict(self.extra),
        }

    def write_report(self, path: Path) -> None:
        from shardctl.plan.report import write_report

        write_report(self, path)


def _weights_per_coord(
    model: ModelInfo, manifest: Manifest, mesh: Mesh
) -> tuple[Layout | None, tuple[Stage, ...], dict[tuple[int, int, int], int]]:
    """Weight bytes per model-parallel coordinate ``(pp, ep, tp)``, from the layout engine."""
    from shardctl.layout.engine import build_layout
    from shardctl.layout.pipeline import assign_layers

    if not model.tensors:
        # Bare parameter count: no per-tensor layout; split evenly (ZeRO-paper style).
        per = model.weight_bytes // (mesh.pp * mesh.tp * mesh.ep)
        stages = (
            assign_layers(mesh.pp, mesh.pp, "even", None)
            if model.dims is None
            else assign_layers(
                model.dims.num_layers,
                mesh.pp,
                manifest.layout.pipeline,
                manifest.layout.layers_per_stage,
            )
        )
        coords = {
            (p, e, t): per for p in range(mesh.pp) for e in range(mesh.ep) for t in range(mesh.tp)
        }
        return None, stages, coords
    layout = build_layout(model, mesh, rules=manifest.rules, options=manifest.layout)
    coords = {(r.pp, r.ep, r.tp): r.nbytes for r in layout.ranks}
    return layout, layout.stages, coords


def make_plan(
    manifest_path: Path, *, mesh_overrides: Mapping[str, int] | None = None
) -> PlanResult:
    manifest = load_manifest(manifest_path)
    return plan_manifest(manifest, mesh_overrides=mesh_overrides)


def plan_manifest(
    manifest: Manifest, *, mesh_overrides: Mapping[str, int] | None = None
) -> PlanResult:
    model = load_model(manifest)
    mesh = apply_mesh_overrides(manifest.mesh, mesh_overrides or {})
    layout, stages, weights = _weights_per_coord(model, manifest, mesh)
    from shardctl.plan.memory_bridge import memory_per_rank

    per_rank, extra = memory_per_rank(manifest, model, mesh, stages, weights)
    ranks = tuple(
        RankPlan(rank=r, coord=mesh.coord(r), stage=mesh.coord(r)["pp"], memory=per_rank[r])
        for r in range(mesh.world)
    )
    return PlanResult(
        manifest=manifest,
        model=model,
        mesh=mesh,
        layout=layout,
        stages=stages,
        ranks=ranks,
        device_memory=manifest.hardware.device_memory,
        extra=extra,
    )


def run_search(
    manifest_path: Path, *, gpus: int | None, mesh_overrides: Mapping[str, int] | None = None
) -> Any:
    from shardctl.plan.memory_bridge import search_layouts

    manifest = load_manifest(manifest_path)
    model = load_model(manifest)
    return search_layouts(manifest, model, gpus=gpus)
