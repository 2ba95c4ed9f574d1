"""Weight bytes per model-parallel coordinate: the one weight model of ``plan`` and the search.

Both ask the layout engine (:func:`shardctl.layout.engine.staged_weight_bytes`), so manifest
``rules:``, vocab padding and fused parts count the same way in both, and equal the bytes
``reshard`` writes per rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from shardctl.layout.pipeline import assign_layers
from shardctl.layout.types import LayoutOptions, Mesh, RuleSpec, Stage
from shardctl.model.types import ModelInfo

Coord = tuple[int, int, int]  # (pp, ep, tp)


def options_for(options: LayoutOptions, pp: int) -> LayoutOptions:
    """``layers_per_stage`` names one pipeline degree; another ``pp`` uses the convention."""
    lps = options.layers_per_stage
    if lps is not None and len(lps) != pp:
        return replace(options, layers_per_stage=None)
    return options


def weights_per_coord(
    model: ModelInfo, mesh: Mesh, *, rules: Sequence[RuleSpec], options: LayoutOptions
) -> tuple[tuple[Stage, ...], dict[Coord, int] | None]:
    """The stages and the exact weight bytes per ``(pp, ep, tp)`` (``options`` as given:
    the search passes :func:`options_for` its ``pp``).

    Weights are ``None`` for a model known only by its dimensions (no tensor inventory): the
    memory model's closed form prices those. A bare parameter count splits evenly over the
    model-parallel ranks (ZeRO-paper style).
    """
    from shardctl.layout.engine import staged_weight_bytes

    o = options
    if model.tensors:
        return staged_weight_bytes(model, mesh, rules=rules, options=o)
    if model.dims is not None:
        stages = assign_layers(model.dims.num_layers, mesh.pp, o.pipeline, o.layers_per_stage)
        return stages, None
    per = model.weight_bytes // (mesh.pp * mesh.tp * mesh.ep)
    stages = assign_layers(mesh.pp, mesh.pp, "even", None)
    coords = range(mesh.pp), range(mesh.ep), range(mesh.tp)
    return stages, {(p, e, t): per for p in coords[0] for e in coords[1] for t in coords[2]}
