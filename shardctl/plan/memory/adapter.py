"""From a validated :class:`~shardctl.manifest.Manifest` to the memory model's own inputs.

The CLI's bridge calls :func:`memory_per_rank` and :func:`search_layouts`; everything else in
this package takes plain arguments.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from fnmatch import fnmatchcase
from typing import TYPE_CHECKING, Any

from shardctl.layout.types import Mesh, Stage
from shardctl.model.types import ModelInfo
from shardctl.plan.memory.estimate import MemoryPlan, estimate
from shardctl.plan.memory.hardware import HardwareSpec, gpu_preset
from shardctl.plan.memory.overhead import OverheadSpec
from shardctl.plan.memory.spec import QuantSpec, TrainingSpec, Workload

if TYPE_CHECKING:
    from shardctl.manifest import Manifest
    from shardctl.plan.search import SearchResult

# Representative fqns per tensor kind, matched against ``quantization.keep_16bit`` globs.
_KIND_NAMES = {
    "embedding": ("model.embed_tokens.weight", "transformer.wte.weight"),
    "head": ("lm_head.weight",),
    "norm": ("model.norm.weight", "model.layers.0.input_layernorm.weight"),
}


def workload_of(manifest: Manifest) -> Workload:
    w = manifest.workload
    return Workload(
        batch_size=w.batch_size,
        sequence_length=w.sequence_length,
        kv_cache_dtype=w.kv_cache_dtype,
        gpu_memory_utilization=w.gpu_memory_utilization,
        flash_attention=w.flash_attention,
    )


def training_of(manifest: Manifest) -> TrainingSpec | None:
    t, w = manifest.training, manifest.workload
    if t is None:
        return None
    return TrainingSpec(
        optimizer=t.optimizer,
        zero=t.zero,
        recompute=t.recompute,
        sequence_parallel=t.sequence_parallel,
        flash_attention=w.flash_attention,
        micro_batch_size=w.micro_batch_size or w.batch_size,
        grad_accumulation_steps=t.num_microbatches or w.gradient_accumulation_steps,
        sequence_length=w.sequence_length,
        grad_dtype=t.grad_dtype,
        offload_optimizer=t.offload_optimizer,
        offload_params=t.offload_params,
        master_weights=t.master_weights,
        pipeline_schedule=t.pipeline_schedule,
    )


def quant_of(manifest: Manifest) -> QuantSpec:
    q = manifest.quantization
    if q is None or q.method == "none":
        return QuantSpec()
    method = q.method
    if method == "fp8" and q.fp8_scaling == "block":
        method = "fp8-block"
    keep = tuple(
        kind
        for kind, names in _KIND_NAMES.items()
        if any(fnmatchcase(n, g) for n in names for g in q.keep_16bit)
    )
    return QuantSpec(
        method=method, group_size=q.group_size or 128, double_quant=q.double_quant, keep=keep
    )


def hardware_of(manifest: Manifest) -> HardwareSpec:
    h = manifest.hardware
    # The manifest has already filled memory and bandwidths from its GPU preset (one table,
    # shardctl.manifest.presets); only the name is carried for the report.
    base = HardwareSpec() if h.gpu is None else replace(HardwareSpec(), gpu=gpu_preset(h.gpu).name)
    return replace(
        base,
        device_memory=h.device_memory,
        gpus_per_node=h.gpus_per_node,
        nodes=h.nodes,
        intra_node_bw=float(h.intra_node_bandwidth or base.intra_node_bw),
        inter_node_bw=float(h.inter_node_bandwidth or base.inter_node_bw),
    )


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
    per_rank = dict(enumerate(plan.memory_per_rank()))
    return per_rank, plan.to_json()


def search_layouts(manifest: Manifest, model: ModelInfo, *, gpus: int | None) -> SearchResult:
    """``shardctl plan --search``: every layout on ``gpus`` (default: all the hardware's).

    Training keeps the manifest's global batch fixed: ``micro_batch × accumulation × mesh.dp``
    sequences, so ``dp`` must divide it (reason ``batch_not_divisible``).
    """
    from shardctl.errors import ManifestError
    from shardctl.manifest.fields import MAX_AXIS
    from shardctl.plan.search import SearchOptions, search

    hw = hardware_of(manifest)
    tr = training_of(manifest)
    if tr is not None:
        per = tr.micro_batch_size * tr.grad_accumulation_steps * manifest.mesh.dp
        tr = replace(tr, global_batch_size=per)
    n = gpus or hw.gpus
    if n > MAX_AXIS:  # the search is linear in the GPU count: bounded by its own cap (issue 13)
        raise ManifestError(
            f"--search over {n} GPUs is above the limit of {MAX_AXIS}",
            where="hardware.nodes × hardware.gpus_per_node" if gpus is None else "--gpus",
            hint="pass --gpus N to search a smaller cluster",
        )
    options = SearchOptions(
        gpus=n,
        allow_tp_across_nodes=manifest.hardware.allow_tp_across_nodes,
        pipeline=manifest.layout.pipeline,
        vocab_padding=manifest.layout.vocab_padding,
    )
    return search(
        model,
        options=options,
        workload=workload_of(manifest),
        training=tr,
        quant=quant_of(manifest),
        hardware=hw,
        overhead=overhead_of(manifest),
    )
