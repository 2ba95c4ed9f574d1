"""Per-plan summaries beside the ranks: communication per stage, KV capacity, the inputs."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from shardctl.dtypes import DTYPE_BITS
from shardctl.layout.types import Stage
from shardctl.plan.memory.comm import CommTally, inference_comm, training_comm
from shardctl.plan.memory.kv import kv_bytes_per_token, kv_capacity
from shardctl.plan.memory.kv_layers import layer_bytes_per_token
from shardctl.plan.memory.result import Coord, KvSummary, RankMemory
from shardctl.plan.memory.shapes import vocab_rows_per_rank

if TYPE_CHECKING:
    from shardctl.plan.memory.context import Context


def stage_comm(ctx: Context, st: Stage) -> CommTally:
    m = ctx.mesh
    if ctx.shape is None:
        return CommTally("step" if ctx.training else "token")
    d = ctx.shape.dims
    rows = vocab_rows_per_rank(d.vocab_size, m.tp, ctx.shape.vocab_padding)
    if ctx.training is None:
        return inference_comm(
            m,
            stage=st.index,
            layers=st.num_layers,
            batch=ctx.batch,
            hidden=d.hidden_size,
            vocab_rows=rows,
            act_bytes=ctx.nb,
        )
    tr = ctx.training
    c = ctx.counts(st)
    return training_comm(
        m,
        stage=st.index,
        layers=st.num_layers,
        moe_layers=st.num_layers if d.num_experts else 0,
        micro_batch=tr.micro_batch_size,
        seq=tr.sequence_length,
        microbatches=ctx.microbatches,
        hidden=d.hidden_size,
        top_k=max(d.experts_per_token, 1),
        params_dense=c.total - c.expert,
        params_expert=c.expert,
        grad_bytes=DTYPE_BITS[tr.grad_dtype or ctx.dtype] / 8,
        weight_bytes=ctx.nb,
        zero=tr.zero,
        sequence_parallel=tr.sequence_parallel,
        recompute=tr.recompute,
        act_bytes=ctx.nb,
        capacity_factor=tr.capacity_factor,
    )


def kv_summary(ctx: Context, coords: Mapping[Coord, RankMemory]) -> KvSummary | None:
    if ctx.training is not None or ctx.shape is None:
        return None
    d, w = ctx.shape.dims, ctx.workload
    from shardctl.plan.memory.terms import stage_kv_per_token, stage_sequence_kv

    per_stage = tuple(stage_kv_per_token(ctx, s) for s in ctx.stages)
    per_sequence = tuple(stage_sequence_kv(ctx, s, w.sequence_length) for s in ctx.stages)
    # vLLM V1 with several attention kinds in a stage: blocks hold one group of layers
    slot, groups = list(per_stage), [1] * len(ctx.stages)
    if ctx.vllm:
        from shardctl.plan.memory.kv_layers import hybrid_groups
        from shardctl.plan.memory.terms import stage_windows

        for i, s in enumerate(ctx.stages):
            windows = stage_windows(ctx, s)
            if len(set(windows)) > 1:
                size, kinds = hybrid_groups(windows)
                slot[i] = per_stage[i] // s.num_layers * size
                groups[i] = sum(n for _w, n in kinds) // size
    capacity = None
    if ctx.hw.device_memory is not None:
        caps = [
            kv_capacity(
                device_memory=ctx.hw.device_memory,
                utilization=ctx.utilization,
                non_kv_bytes=r.total - r.kv_cache,
                per_token=slot[p],
                groups=groups[p],
                batch=ctx.batch,
                sequence_length=w.sequence_length,
                block_size=ctx.block_size if ctx.sglang or ctx.trtllm else w.block_size,
                sequence_bytes=per_sequence[p],
                engine=w.engine,
                round_up=ctx.trtllm,
            )
            for (p, _e, _t), r in coords.items()
            if per_stage[p]
        ]
        capacity = min(caps, key=lambda c: c.tokens) if caps else None
    return KvSummary(
        dtype=ctx.kv_dtype,
        bytes_per_token=(
            kv_bytes_per_token(d, ctx.kv_dtype)
            if ctx.mla_width is None
            else layer_bytes_per_token(d, ctx.kv_dtype, tp=1, mla_width=ctx.mla_width)
            * d.num_layers
        ),
        batch_per_replica=ctx.batch,
        sequence_length=w.sequence_length,
        per_stage_bytes_per_token=per_stage,
        capacity=capacity,
    )


def plan_inputs(ctx: Context) -> dict[str, Any]:
    w, tr, q = ctx.workload, ctx.training, ctx.quant
    out: dict[str, Any] = {"dtype": ctx.model.dtype, "quantization": q.method}
    if tr is None:
        out.update(
            batch_size=w.batch_size,
            sequence_length=w.sequence_length,
            kv_cache_dtype=ctx.kv_dtype,
            flash_attention=w.flash_attention,
            max_num_batched_tokens=w.max_num_batched_tokens,
            gpu_memory_utilization=ctx.utilization,
            engine=w.engine,
        )
        if ctx.sglang:
            out.update(mem_fraction_static=ctx.mem_fraction_static, page_size=1)
        if ctx.trtllm:
            from shardctl.plan.memory.trtllm import MAX_NUM_TOKENS

            out.update(
                free_gpu_memory_fraction=w.free_gpu_memory_fraction,
                tokens_per_block=w.tokens_per_block,
                max_num_tokens=w.profile_tokens or MAX_NUM_TOKENS,
            )
        if ctx.vllm:
            tokens, seqs = ctx.vllm_batch
            out.update(
                vllm_version=w.vllm_version,
                max_num_seqs=seqs,
                block_size=w.block_size,
                max_num_batched_tokens=tokens,
                device_memory_cuda=ctx.hw.device_memory,
            )
            if w.mm_encoder_tp_mode != "weights":
                out.update(mm_encoder_tp_mode=w.mm_encoder_tp_mode)
            if w.limit_mm_per_prompt:
                out.update(limit_mm_per_prompt=dict(w.limit_mm_per_prompt))
    else:
        out.update(
            optimizer=tr.optimizer,
            zero=tr.zero,
            recompute=tr.recompute,
            sequence_parallel=tr.sequence_parallel,
            micro_batch_size=tr.micro_batch_size,
            grad_accumulation=ctx.microbatches,
            sequence_length=tr.sequence_length,
            offload_optimizer=tr.offload_optimizer,
            offload_params=tr.offload_params,
        )
        if tr.pipeline_schedule != "1f1b":
            out.update(pipeline_schedule=tr.pipeline_schedule, virtual_stages=tr.virtual_stages)
        if tr.recompute_layers is not None:
            out.update(recompute_layers=tr.recompute_layers)
        if tr.lora_rank:
            out.update(lora_rank=tr.lora_rank, lora_targets=tr.lora_targets)
        if tr.context_parallel > 1:
            out.update(context_parallel=tr.context_parallel)
    return out
