"""Training states of one rank: weights, gradients and optimizer state under ZeRO and offload,
dense and expert parameters sharded over their own data-parallel groups."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from shardctl.dtypes import DTYPE_BITS
from shardctl.layout.types import Stage
from shardctl.plan.memory.shapes import Counts, layer_counts
from shardctl.plan.memory.training import model_states, optimizer_bytes_per_param

if TYPE_CHECKING:
    from shardctl.plan.memory.context import Context


@dataclass(frozen=True)
class States:
    weights: int
    gradients: int
    optimizer: int
    host: int  # offloaded to CPU memory
    nvme: int  # offloaded to NVMe
    detail: dict[str, int]


def training_states(ctx: Context, st: Stage, c: Counts, weights: int, given: int | None) -> States:
    """``weights`` (stored bytes) become the model states of ZeRO stage ``training.zero``;
    dense parameters shard over ``dp × ep``, experts over ``dp`` (their ep group holds them)."""
    tr = ctx.training
    assert tr is not None
    detail: dict[str, int] = {}
    params = c.total if given is None else given * 8 // DTYPE_BITS[ctx.model.dtype]
    mixed = ctx.nb == 2 and tr.master_weights
    g_bytes = DTYPE_BITS[tr.grad_dtype or ctx.dtype] / 8
    o_bytes = optimizer_bytes_per_param(
        tr.optimizer,
        hidden=ctx.shape.dims.hidden_size if ctx.shape else 0,
        mixed_precision=mixed,
    )
    dense = params - c.expert
    dense_w = weights * dense // params if params else 0
    # (parameters, the group that shards their states, their stored bytes)
    groups = (
        (dense, ctx.mesh.dp * ctx.mesh.ep, dense_w),
        (c.expert, ctx.mesh.dp, weights - dense_w),
    )
    parts = [
        model_states(
            n,
            weight_bytes=ctx.nb,
            grad_bytes=g_bytes,
            optimizer_bytes=o_bytes,
            zero=tr.zero,
            dp=dp,
            weights_stored=stored,
            offload_optimizer=tr.offload_optimizer,
            offload_params=tr.offload_params,
        )
        for n, dp, stored in groups
    ]
    weights = sum(p.weights for p in parts)
    if tr.zero == 3 and ctx.shape is not None and st.num_layers:
        # FSDP/ZeRO-3 gathers a layer before use and prefetches the next: two whole
        # (dp-unsharded) layers live at once (FSDP backward_prefetch=BACKWARD_PRE).
        layer = layer_counts(ctx.shape, ctx.mesh.tp, ctx.mesh.ep).total * ctx.nb
        detail["weights.zero3_gather"] = 2 * layer
        weights += 2 * layer
    return States(
        weights=weights,
        gradients=sum(p.gradients for p in parts),
        optimizer=sum(p.optimizer for p in parts),
        host=sum(p.host for p in parts),
        nvme=sum(p.nvme for p in parts),
        detail=detail,
    )
