"""From a validated :class:`~shardctl.manifest.Manifest` to the memory model's calls.

The manifest already holds the memory model's own types (one type per concept); the
``*_of`` accessors only name the defaults of absent sections.

``plan`` calls :func:`plan_memory`, ``plan --search`` :func:`search_layouts`; everything else
in this package takes plain arguments.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from shardctl.layout.types import Mesh, Stage
from shardctl.model.types import ModelInfo
from shardctl.plan.memory.estimate import MemoryPlan, estimate
from shardctl.plan.memory.hardware import HardwareSpec
from shardctl.plan.memory.overhead import OverheadSpec
from shardctl.plan.memory.spec import QuantSpec, TrainingSpec, Workload

if TYPE_CHECKING:
    from shardctl.manifest import Manifest
    from shardctl.plan.search import SearchOptions, SearchResult


def workload_of(manifest: Manifest) -> Workload:
    return manifest.workload


def training_of(manifest: Manifest) -> TrainingSpec | None:
    """The training step, its global batch pinned to the manifest's own ``mesh.dp``
    (``micro_batch × accumulation × mesh.dp``): another ``dp`` — a ``--dp`` override or a
    searched layout — keeps the batch and changes the accumulation, which ``dp`` must divide."""
    return manifest.training


def quant_of(manifest: Manifest) -> QuantSpec:
    return manifest.quantization or QuantSpec()


def hardware_of(manifest: Manifest) -> HardwareSpec:
    return manifest.hardware


def overhead_of(manifest: Manifest) -> OverheadSpec:
    given: dict[str, Any] = dict(manifest.overhead)
    return OverheadSpec(**given)


def plan_memory(
    manifest: Manifest,
    model: ModelInfo,
    mesh: Mesh,
    stages: tuple[Stage, ...],
    weights: Mapping[tuple[int, int, int], int] | None,
) -> MemoryPlan:
    """The :class:`MemoryPlan` of the manifest's layout; ``weights`` from the layout engine."""
    return estimate(
        model,
        mesh,
        stages,
        weights_per_coord=weights,
        workload=workload_of(manifest),
        training=training_of(manifest),
        quant=quant_of(manifest),
        hardware=hardware_of(manifest),
        overhead=overhead_of(manifest),
        vocab_padding=manifest.layout.vocab_padding,
    )


def memory_per_rank(
    manifest: Manifest,
    model: ModelInfo,
    mesh: Mesh,
    stages: tuple[Stage, ...],
    weights: Mapping[tuple[int, int, int], int],
) -> tuple[dict[int, dict[str, int]], dict[str, Any]]:
    """Per global rank the plan JSON's ``memory`` object, plus the sections added beside
    ``ranks`` (``kv_cache``, ``communication``, ``memory_model``, ``moe``)."""
    plan = plan_memory(manifest, model, mesh, stages, weights)
    return dict(enumerate(plan.memory_per_rank())), plan.to_json()


def search_options(
    manifest: Manifest, *, gpus: int | None, fixed_states: bool = False
) -> SearchOptions:
    """The search's options from the manifest: all the hardware's GPUs unless ``gpus``; ZeRO
    stage and recompute searched too, unless ``fixed_states`` keeps the manifest's."""
    from shardctl.plan.search import SearchOptions

    tr = manifest.training
    states: dict[str, Any] = {}
    if fixed_states and tr is not None:
        states = {"zero_stages": (tr.zero,), "recompute": (tr.recompute,)}
    return SearchOptions(
        gpus=gpus or manifest.hardware.gpus,
        allow_tp_across_nodes=manifest.hardware.allow_tp_across_nodes,
        pipeline=manifest.layout.pipeline,
        vocab_padding=manifest.layout.vocab_padding,
        **states,
    )


def search_layouts(
    manifest: Manifest, model: ModelInfo, *, gpus: int | None, fixed_states: bool = False
) -> SearchResult:
    """``shardctl plan --search``: every layout on ``gpus`` (default: all the hardware's).

    Training keeps the manifest's global batch fixed: ``micro_batch × accumulation × mesh.dp``
    sequences, so ``dp`` must divide it (reason ``batch_not_divisible``).
    """
    from shardctl.errors import ManifestError
    from shardctl.manifest.limits import MAX_AXIS
    from shardctl.plan.search import search

    n = gpus or manifest.hardware.gpus
    if n > MAX_AXIS:  # the search is linear in the GPU count: bounded by its own cap (issue 13)
        raise ManifestError(
            f"--search over {n} GPUs is above the limit of {MAX_AXIS}",
            where="hardware.nodes × hardware.gpus_per_node" if gpus is None else "--gpus",
            hint="pass --gpus N to search a smaller cluster",
        )
    return search(
        model,
        options=search_options(manifest, gpus=gpus, fixed_states=fixed_states),
        workload=workload_of(manifest),
        training=training_of(manifest),
        quant=quant_of(manifest),
        hardware=hardware_of(manifest),
        overhead=overhead_of(manifest),
        rules=manifest.rules,
        layout=manifest.layout,
    )


def search_reason(manifest: Manifest, model: ModelInfo, mesh: Mesh) -> str | None:
    """Why ``plan --search`` would not price ``mesh`` (its rejection reason), or ``None``: then
    its verdict on ``mesh`` is ``plan``'s."""
    from shardctl.plan.search import invalid_reason

    return invalid_reason(
        model,
        mesh,
        options=search_options(manifest, gpus=mesh.world),
        hardware=hardware_of(manifest),
        workload=workload_of(manifest),
        training=training_of(manifest),
        rules=manifest.rules,
        layout=manifest.layout,
    )
