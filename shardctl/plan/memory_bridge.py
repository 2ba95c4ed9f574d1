"""Glue between the manifest/layout world and the memory model.

Weights come from the layout engine (exact bytes per model-parallel coordinate); the other
components come from :mod:`shardctl.plan.memory` when the manifest asks for a workload.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shardctl.layout.types import Mesh, Stage
from shardctl.manifest import Manifest
from shardctl.model.types import ModelInfo


def memory_per_rank(
    manifest: Manifest,
    model: ModelInfo,
    mesh: Mesh,
    stages: tuple[Stage, ...],
    weights: Mapping[tuple[int, int, int], int],
) -> tuple[dict[int, dict[str, int]], dict[str, Any]]:
    """Per global rank: ``{weights, kv_cache, activations, gradients, optimizer, overhead,
    total}`` in bytes, plus extra JSON sections."""
    out: dict[int, dict[str, int]] = {}
    for rank in range(mesh.world):
        c = mesh.coord(rank)
        w = weights[(c["pp"], c["ep"], c["tp"])]
        mem = {
            "weights": w,
            "kv_cache": 0,
            "activations": 0,
            "gradients": 0,
            "optimizer": 0,
            "overhead": 0,
        }
        mem["total"] = sum(mem.values())
        out[rank] = mem
    return out, {}


def search_layouts(manifest: Manifest, model: ModelInfo, *, gpus: int | None) -> Any:
    from shardctl.errors import UsageError

    raise UsageError("--search is not available yet")
