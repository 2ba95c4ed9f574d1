"""The memory model's entry point: every component for every rank of one layout.

``estimate(model, mesh, stages, ...)`` prices each model-parallel coordinate ``(pp, ep, tp)``
once (``dp`` replicas hold the same sizes; ZeRO shards round up) and returns a
:class:`MemoryPlan` whose ranks fill the plan JSON's ``memory`` objects.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from shardctl.errors import InvalidInputError
from shardctl.layout.types import Mesh, Stage
from shardctl.model.types import ModelInfo
from shardctl.plan.memory.context import Context
from shardctl.plan.memory.context_length import refusal
from shardctl.plan.memory.hardware import HardwareSpec
from shardctl.plan.memory.moe import moe_params
from shardctl.plan.memory.overhead import OverheadSpec
from shardctl.plan.memory.result import COMPONENTS, Coord, KvSummary, MemoryPlan, RankMemory
from shardctl.plan.memory.shapes import shape_from_model
from shardctl.plan.memory.spec import QuantSpec, TrainingSpec, Workload
from shardctl.plan.memory.summaries import kv_summary, plan_inputs, stage_comm
from shardctl.plan.memory.vllm import engine_hardware

__all__ = ["COMPONENTS", "Coord", "KvSummary", "MemoryPlan", "RankMemory", "estimate"]


def estimate(
    model: ModelInfo,
    mesh: Mesh,
    stages: Sequence[Stage],
    *,
    weights_per_coord: Mapping[Coord, int] | None = None,
    workload: Workload | None = None,
    training: TrainingSpec | None = None,
    quant: QuantSpec | None = None,
    hardware: HardwareSpec | None = None,
    overhead: OverheadSpec | None = None,
    vocab_padding: str = "tp",
) -> MemoryPlan:
    """Every memory component of every rank of ``mesh`` (inference, or training if given).

    ``weights_per_coord`` are the layout engine's exact bytes per ``(pp, ep, tp)`` (with
    ``quant``: each tensor in its own format, :func:`shardctl.plan.weights.weights_per_coord`);
    without them weights come from the closed form of :mod:`shardctl.plan.memory.shapes`
    (``quant.overrides`` need the per-tensor path).
    """
    workload = workload or Workload()
    quant = quant or QuantSpec()
    hardware = hardware or HardwareSpec()
    overhead = overhead or OverheadSpec()
    # vLLM's budget is utilization × the size CUDA reports, not the data sheet's.
    hardware = engine_hardware(hardware, workload.engine, training=training is not None)
    if training is not None and quant.quantizes and not training.lora_rank:
        what = quant.method if quant.method != "none" else "quantized (overrides)"
        raise InvalidInputError(
            f"training with {what} weights needs frozen weights: a quantized base "
            "trains only through adapters (QLoRA)",
            where="quantization.method",
            hint="set training.lora_rank (e.g. 16) for QLoRA, or drop quantization",
        )
    if quant.overrides and weights_per_coord is None:
        # The closed form prices kinds, not tensors: overrides would be silently ignored.
        raise InvalidInputError(
            "quantization.overrides are priced per tensor by the layout engine; this estimate "
            "has no per-rank weights",
            where="quantization.overrides",
            hint="plan with a config or checkpoint (shardctl.plan), or pass weights_per_coord "
            "from shardctl.plan.weights.weights_per_coord(..., quant=...)",
        )
    if training is not None and quant.overrides and not training.lora_rank:
        # Model states (gradients, optimizer, master weights) are priced per parameter in the
        # training dtype; a per-tensor dtype would be counted in the weights alone.
        raise InvalidInputError(
            "quantization.overrides apply to a frozen base (LoRA/QLoRA); full training prices "
            "every parameter's states in the training dtype",
            where="quantization.overrides",
            hint="set training.lora_rank (e.g. 16), or drop the overrides",
        )
    if training is not None and training.lora_rank and not model.dims:
        raise InvalidInputError(
            "LoRA needs the model's shapes to size its adapters; a bare parameter count has none",
            where="training.lora_rank",
            hint="give model.config or model.checkpoint",
        )
    stages = tuple(stages)
    if len(stages) != mesh.pp:
        raise InvalidInputError(f"{len(stages)} stages for pp={mesh.pp}", where="pipeline")
    shape = shape_from_model(model, vocab_padding=vocab_padding) if model.dims else None
    ctx = Context(model, mesh, stages, shape, workload, training, quant, hardware, overhead)
    coords: dict[Coord, RankMemory] = {}
    for st in stages:
        for e in range(mesh.ep):
            for t in range(mesh.tp):
                given = None if weights_per_coord is None else weights_per_coord[(st.index, e, t)]
                coords[(st.index, e, t)] = ctx.rank(st, given)
    comm = tuple(stage_comm(ctx, st) for st in stages)
    return MemoryPlan(
        mode="training" if training else "inference",
        mesh=mesh,
        stages=stages,
        coords=coords,
        budget=ctx.budget,
        device_memory=hardware.device_memory,
        kv=kv_summary(ctx, coords),
        comm=comm,
        hardware=hardware,
        moe=moe_params(shape, model.tensors)
        if shape is not None and shape.dims.num_experts
        else None,
        inputs=_inputs(ctx, model),
        refused=None if training else refusal(model, workload.engine, workload.sequence_length),
    )


def _inputs(ctx: Context, model: ModelInfo) -> dict[str, Any]:
    """:func:`plan_inputs`, plus ``approximate`` when the closed form priced a family it does
    not describe (a model given without tensors; ``MemoryPlan.warnings`` says so)."""
    from shardctl.plan.memory.layout_counts import closed_form_caveat

    out = dict(plan_inputs(ctx))
    caveat = closed_form_caveat(model)
    if caveat is not None:
        out["approximate"] = caveat
    return out
