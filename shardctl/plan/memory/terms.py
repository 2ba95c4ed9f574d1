"""KV cache and activations of one rank of a stage: serving (prefill peak, logits) and
training (in-flight micro-batches, recompute working set); see docs/memory-model.md."""

from __future__ import annotations

from typing import TYPE_CHECKING

from shardctl.layout.types import Stage
from shardctl.plan.memory import activations as act
from shardctl.plan.memory import trtllm, vllm
from shardctl.plan.memory.kv import kv_bytes_per_token
from shardctl.plan.memory.kv_layers import (
    layer_bytes_per_token,
    sequence_kv_bytes,
    vllm_sequence_kv_bytes,
)
from shardctl.plan.memory.shapes import vocab_rows_per_rank

if TYPE_CHECKING:
    from shardctl.plan.memory.context import Context


def stage_windows(ctx: Context, st: Stage) -> tuple[int | None, ...]:
    """The attention window of each layer of ``st`` (``None``: full attention)."""
    if st.layers is None:
        return ()
    return ctx.windows[st.layers[0] : st.layers[1] + 1]


def stage_kv_per_token(ctx: Context, st: Stage) -> int:
    """KV bytes one token adds on one rank of ``st`` counting every layer (MLA: the latent)."""
    assert ctx.shape is not None
    d, tp = ctx.shape.dims, ctx.mesh.tp
    if ctx.mla_width is None:
        return kv_bytes_per_token(d, ctx.kv_dtype, layers=st.num_layers, tp=tp)
    per_layer = layer_bytes_per_token(d, ctx.kv_dtype, tp=tp, mla_width=ctx.mla_width)
    return per_layer * st.num_layers


def stage_sequence_kv(ctx: Context, st: Stage, length: int) -> int:
    """KV bytes of one sequence of ``length`` tokens on one rank of ``st``: sliding-window
    layers hold ``min(window, length)`` tokens; vLLM rounds each layer to whole blocks."""
    assert ctx.shape is not None
    per_layer = layer_bytes_per_token(
        ctx.shape.dims, ctx.kv_dtype, tp=ctx.mesh.tp, mla_width=ctx.mla_width
    )
    windows = stage_windows(ctx, st)
    if ctx.vllm:  # V1's per-layer reservation and hybrid groups (kv_layers.py)
        batched, _ = ctx.vllm_batch
        return vllm_sequence_kv_bytes(
            per_layer, windows, length, block_size=ctx.block_size, batched_tokens=batched
        )
    if ctx.sglang or ctx.trtllm:
        # SGLang 0.4's token pool and TensorRT-LLM's cell size count every layer for every
        # token (``profile_max_num_token``, ``_get_cache_size_per_token``): no window savings.
        windows = (None,) * len(windows)
    return sequence_kv_bytes(per_layer, windows, length, block_size=ctx.block_size)


def inference_terms(ctx: Context, st: Stage) -> tuple[int, int, dict[str, int]]:
    assert ctx.shape is not None
    if ctx.vllm:
        return vllm_terms(ctx, st)
    if ctx.sglang:
        return sglang_terms(ctx, st)
    if ctx.trtllm:
        return trtllm_terms(ctx, st)
    d, w, m = ctx.shape.dims, ctx.workload, ctx.mesh
    per_token = stage_kv_per_token(ctx, st)
    kv = stage_sequence_kv(ctx, st, w.sequence_length) * ctx.batch
    tokens = ctx.batch * w.sequence_length
    if w.max_num_batched_tokens is not None:
        tokens = min(tokens, w.max_num_batched_tokens)
    peak = 0
    if st.num_layers and w.sequence_length:
        peak = act.prefill_peak_bytes(
            d,
            tokens=tokens,
            context=w.sequence_length,
            tp=m.tp,
            ep=m.ep,
            flash_attention=w.flash_attention,
            act_bytes=ctx.nb,
        )
    last = st.index == m.pp - 1 and w.sequence_length > 0
    logits = act.logits_buffer_bytes(ctx.batch, d.vocab_size) if last else 0
    detail = {
        "activations.prefill_peak": peak,
        "activations.logits": logits,
        "kv_cache.bytes_per_token": per_token,
    }
    return kv, peak + logits, detail


def vllm_terms(ctx: Context, st: Stage) -> tuple[int, int, dict[str, int]]:
    """KV cache and activations as vLLM's start-up profile counts them (:mod:`.vllm`)."""
    assert ctx.shape is not None
    d, w, m = ctx.shape.dims, ctx.workload, ctx.mesh
    kv = stage_sequence_kv(ctx, st, w.sequence_length) * ctx.batch
    tokens, seqs = ctx.vllm_batch
    peak = 0
    if st.num_layers or st.index == m.pp - 1:
        peak = vllm.profile_activation_bytes(
            d,
            tokens=tokens if st.num_layers else 0,
            tp=m.tp,
            act_bytes=ctx.nb,
            max_num_seqs=seqs,
            last_stage=st.index == m.pp - 1,
            version=w.vllm_version,
        )
    detail = {
        "activations.profile_peak": peak,
        "activations.profile_tokens": tokens,
        "kv_cache.bytes_per_token": stage_kv_per_token(ctx, st),
    }
    if w.vllm_version == "0.2" and m.tp > 1 and st.num_layers:
        # December 2023: the all-reduced outputs were never reused within the profile run
        # (record_stream), so they sit under the forward's and the sampler's peak.
        retained = vllm.retained_allreduce_bytes(
            d, tokens=tokens, num_layers=st.num_layers, first_stage=st.index == 0,
            act_bytes=ctx.nb,
        )  # fmt: skip
        detail["activations.retained_allreduce"] = retained
        peak += retained
    moe = _vllm_moe_workspace(ctx, st, tokens)
    if moe:
        detail["activations.moe_workspace"] = moe
        peak += moe
    image = ctx.image_tokens
    if image and w.vllm_version in vllm.V1_VERSIONS:
        # every stage: vLLM builds the vision tower on every pipeline rank (plan/weights.py
        # ``engine_rules``), and V1's ``profile_run`` profiles the encoder wherever the model
        # takes multimodal input (``supports_mm_inputs``), with no pipeline-rank test
        cached = vllm.encoder_cache_bytes(
            budget_tokens=tokens,
            item_tokens=image,
            hidden=ctx.image_width or d.hidden_size,
            act_bytes=ctx.nb,
        )
        detail["activations.encoder_cache"] = cached
        peak += cached
    return kv, peak, detail


def _vllm_moe_workspace(ctx: Context, st: Stage, tokens: int) -> int:
    """V1's persistent fused-MoE workspace (:func:`.vllm.moe_workspace_bytes`) on a stage with
    MoE layers, for 16-bit experts (the Triton path whose shapes are read; quantized experts run
    other kernels with their own buffers, not modelled)."""
    assert ctx.shape is not None
    d, w, m = ctx.shape.dims, ctx.workload, ctx.mesh
    quantized = (
        ctx.quant.method != "none"
        or bool(ctx.quant.overrides)
        or "quantization_config" in ctx.model.config
        or ctx.dtype != ctx.model.dtype
    )
    if w.vllm_version not in vllm.V1_VERSIONS or not d.num_experts or not st.num_layers:
        return 0
    if quantized:
        return 0
    expert_i = ctx.model.config.get("moe_intermediate_size") or d.intermediate_size
    return vllm.moe_workspace_bytes(
        tokens=tokens, hidden=d.hidden_size, expert_intermediate=int(expert_i),
        topk=d.experts_per_token, tp=m.tp, act_bytes=ctx.nb,
    )  # fmt: skip


def sglang_terms(ctx: Context, st: Stage) -> tuple[int, int, dict[str, int]]:
    """KV cache as SGLang's token pool holds it; activations live in the reserve
    (``overhead.reserve``), not in the static pool (:mod:`.sglang`)."""
    kv = stage_sequence_kv(ctx, st, ctx.workload.sequence_length) * ctx.batch
    return kv, 0, {"kv_cache.bytes_per_token": stage_kv_per_token(ctx, st)}


def trtllm_terms(ctx: Context, st: Stage) -> tuple[int, int, dict[str, int]]:
    """KV cache in TensorRT-LLM's blocks and the dummy run's activation peak (:mod:`.trtllm`)."""
    assert ctx.shape is not None
    d, w, m = ctx.shape.dims, ctx.workload, ctx.mesh
    kv = stage_sequence_kv(ctx, st, w.sequence_length) * ctx.batch
    tokens = w.profile_tokens or trtllm.MAX_NUM_TOKENS
    peak = 0
    if st.num_layers:
        peak = vllm.forward_peak_bytes(d, tokens=tokens, tp=m.tp, act_bytes=ctx.nb)
    detail = {
        "activations.profile_peak": peak,
        "activations.profile_tokens": tokens,
        "kv_cache.bytes_per_token": stage_kv_per_token(ctx, st),
    }
    return kv, peak, detail


def training_terms(ctx: Context, st: Stage) -> tuple[int, int, dict[str, int]]:
    assert ctx.shape is not None and ctx.training is not None
    d, tr, m = ctx.shape.dims, ctx.training, ctx.mesh
    # Context parallelism: a rank keeps the activations of its s/cp tokens (Megatron CP).
    seq, mb, tp, sp = tr.sequence_length // ctx.cp, tr.micro_batch_size, m.tp, tr.sequence_parallel
    kv_seq = tr.sequence_length if ctx.cp > 1 else None

    def layer_bytes(recompute: str) -> int:
        return act.layer_activation_bytes(
            d,
            seq=seq,
            batch=mb,
            tp=tp,
            sequence_parallel=sp,
            recompute=recompute,
            flash_attention=tr.flash_attention,
            dropout=tr.dropout,
            act_bytes=ctx.nb,
            capacity_factor=tr.capacity_factor,
            saved=ctx.engine.saved,
            kv_seq=kv_seq,
        )

    per_layer = layer_bytes(tr.recompute)
    # Partial recompute (``recompute_layers``): N layers keep only their input, the rest all.
    stored_layers = st.num_layers
    full_input = 0
    if tr.recompute == "full" and tr.recompute_layers is not None:
        recomputed = min(tr.recompute_layers, st.num_layers)
        stored_layers = st.num_layers - recomputed
        full_input = per_layer * recomputed  # per_layer is the "full" (input-only) figure
        per_layer = layer_bytes("none")
    layers = per_layer * stored_layers + full_input
    if tr.lora_rank and stored_layers and tr.recompute != "full":
        # PEFT saves each adapter's fp32 ``lora_A`` output [T, r] for ``lora_B``'s backward.
        targets = {"all-linear": 4 + (0 if d.num_experts else 3), "attention": 4, "mlp": 3}
        lora_act = seq * mb * tr.lora_rank * 4 * targets[tr.lora_targets]
        layers += lora_act * stored_layers
    first = (
        act.first_stage_activation_bytes(
            d, seq=seq, batch=mb, tp=tp, sequence_parallel=sp, dropout=tr.dropout
        )
        if st.index == 0
        else 0
    )
    last = (
        act.last_stage_activation_bytes(
            d,
            seq=seq,
            batch=mb,
            tp=tp,
            sequence_parallel=sp,
            act_bytes=ctx.nb,
            vocab_rows=vocab_rows_per_rank(d.vocab_size, m.tp, ctx.shape.vocab_padding),
            saved=ctx.engine.saved,
        )
        if st.index == m.pp - 1
        else 0
    )
    inflight = act.in_flight_microbatches(st.index, m.pp, ctx.microbatches, tr.pipeline_schedule)
    working = 0
    if tr.recompute == "full" and st.num_layers and tr.recompute_layers != 0:
        # Backward replays one layer's forward: its full activations are live once.
        working = layer_bytes("none")
    if tr.pipeline_schedule == "interleaved" and m.pp > 1:
        # Chunks of 1/v of the stage's layers; the embedding sits on chunk 0 (the first pp
        # micro-batches of a group), the head on the last chunk (one in flight on the last
        # stage).
        v = tr.virtual_stages
        chunks = act.interleaved_in_flight_chunks(st.index, m.pp, ctx.microbatches, v)
        stored = chunks * layers // v
        firsts = min(m.pp, ctx.microbatches) * first
        lasts = last
        inflight = -(-chunks // v)
    else:
        stored, firsts, lasts = inflight * layers, inflight * first, inflight * last
    total = stored + firsts + lasts + working
    detail = {
        "activations.per_layer": per_layer,
        "activations.in_flight": inflight,
        "activations.layers": stored,
        "activations.first_stage": firsts,
        "activations.logits_and_loss": lasts,
        "activations.recompute_working_set": working,
    }
    return 0, total, detail


# -- communication and summaries -----------------------------------------------------
