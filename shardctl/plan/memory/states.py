"""Training states of one rank: weights, gradients and optimizer state under ZeRO and offload,
dense and expert parameters sharded over their own data-parallel groups."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from shardctl.dtypes import DTYPE_BITS
from shardctl.layout.types import Stage
from shardctl.plan.memory.layout_counts import largest_layer, uses_layout_counts
from shardctl.plan.memory.shapes import Counts, layer_counts, lora_layer_params
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
    g_bytes = DTYPE_BITS[tr.grad_dtype or ctx.engine.grad_dtype or ctx.dtype] / 8
    o_bytes = optimizer_bytes_per_param(
        tr.optimizer,
        hidden=ctx.shape.dims.hidden_size if ctx.shape else 0,
        mixed_precision=mixed,
    )
    dense = params - c.expert
    dense_w = weights * dense // params if params else 0
    if tr.lora_rank:
        return _lora_states(ctx, st, dense_w, weights - dense_w)
    # (parameters, the group that shards their states, their stored bytes)
    # ZeRO / the distributed optimizer shard over the data-parallel ranks, context-parallel
    # ones included (Megatron's dp×cp group; the cp ranks of a replica hold the same weights).
    groups = (
        (dense, ctx.mesh.dp * ctx.mesh.ep * ctx.cp, dense_w),
        (c.expert, ctx.mesh.dp * ctx.cp, weights - dense_w),
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
    host = int(sum(p.host for p in parts) * ctx.engine.host_buffer)
    if tr.zero == 3 and ctx.shape is not None and st.num_layers:
        # FSDP/ZeRO-3 gathers a layer before use and prefetches the next: two whole
        # (dp-unsharded) layers live at once (FSDP backward_prefetch=BACKWARD_PRE).
        layer = _gathered_layer(ctx)
        detail["weights.zero3_gather"] = 2 * layer
        weights += 2 * layer
    return States(
        weights=weights,
        gradients=sum(p.gradients for p in parts),
        optimizer=sum(p.optimizer for p in parts),
        host=host,
        nvme=sum(p.nvme for p in parts),
        detail=detail,
    )


def _lora_states(ctx: Context, st: Stage, dense_w: int, expert_w: int) -> States:
    """LoRA / QLoRA (Hu et al. 2021; Dettmers et al. 2023): the base weights (dense and expert
    bytes, in their stored or quantized format) are frozen — no gradients, no optimizer states — and
    shard over dp only under ZeRO-3 / FSDP ``FULL_SHARD``. The adapters train in fp32 (PEFT's
    default ``autocast_adapter_dtype=True``): 4-byte weights and gradients and the optimizer's
    moments without a master copy, sharded by the ZeRO stage over ``dp × ep``."""
    tr = ctx.training
    assert tr is not None and ctx.shape is not None
    adapters = lora_layer_params(ctx.shape.dims, tr.lora_rank, tr.lora_targets, ctx.mesh.tp)
    n = adapters * st.num_layers
    o_bytes = optimizer_bytes_per_param(
        tr.optimizer, hidden=ctx.shape.dims.hidden_size, mixed_precision=False
    )
    dp = ctx.mesh.dp * ctx.mesh.ep * ctx.cp
    base = [
        model_states(0, zero=tr.zero, dp=g, weights_stored=w, offload_params=tr.offload_params)
        for w, g in ((dense_w, dp), (expert_w, ctx.mesh.dp * ctx.cp))
    ]
    lora = model_states(
        n,
        weight_bytes=4,
        grad_bytes=4,
        optimizer_bytes=o_bytes,
        zero=tr.zero,
        dp=dp,
        offload_optimizer=tr.offload_optimizer,
        offload_params=tr.offload_params,
    )
    detail = {"lora.trainable_params": n, "weights.lora_adapters": lora.weights}
    extra = 0
    if tr.zero == 3 and st.num_layers:
        layer = _gathered_layer(ctx)
        detail["weights.zero3_gather"] = 2 * layer
        extra = 2 * layer
    return States(
        weights=sum(b.weights for b in base) + lora.weights + extra,
        gradients=lora.gradients,
        optimizer=lora.optimizer,
        host=sum(b.host for b in base) + lora.host,
        nvme=sum(b.nvme for b in base) + lora.nvme,
        detail=detail,
    )


def _gathered_layer(ctx: Context) -> int:
    """Bytes of one whole (dp-unsharded) decoder layer on a rank, as ZeRO-3 gathers it: the
    closed form, or the engine's largest layer for a family that opts out (DeepSeek)."""
    assert ctx.shape is not None
    if uses_layout_counts(ctx.model):
        return largest_layer(ctx.model, ctx.mesh, ctx.shape.vocab_padding) * ctx.nb
    return layer_counts(ctx.shape, ctx.mesh.tp, ctx.mesh.ep).total * ctx.nb
