"""The memory model's entry point: every component for every rank of one layout.

``estimate(model, mesh, stages, ...)`` prices each model-parallel coordinate ``(pp, ep, tp)``
once (``dp`` replicas hold the same sizes; ZeRO shards round up) and returns a
:class:`MemoryPlan` whose ranks fill the plan JSON's ``memory`` objects.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from shardctl.dtypes import DTYPE_BITS
from shardctl.errors import InvalidInputError
from shardctl.layout.types import Mesh, Stage
from shardctl.model.types import ModelInfo
from shardctl.plan.memory import activations as act
from shardctl.plan.memory.budget import fits, memory_budget
from shardctl.plan.memory.comm import CommTally, inference_comm, training_comm
from shardctl.plan.memory.hardware import HardwareSpec
from shardctl.plan.memory.kv import KvCapacity, kv_bytes_per_token, kv_capacity
from shardctl.plan.memory.moe import MoeParams, moe_params
from shardctl.plan.memory.overhead import OverheadSpec, overhead_bytes
from shardctl.plan.memory.quant import quantized_weight_bytes
from shardctl.plan.memory.shapes import (
    Counts,
    ModelShape,
    layer_counts,
    shape_from_model,
    stage_counts,
    vocab_rows_per_rank,
)
from shardctl.plan.memory.spec import QuantSpec, TrainingSpec, Workload
from shardctl.plan.memory.training import model_states, optimizer_bytes_per_param

COMPONENTS = ("weights", "kv_cache", "activations", "gradients", "optimizer", "overhead")
Coord = tuple[int, int, int]  # (pp, ep, tp)


@dataclass(frozen=True)
class RankMemory:
    """One rank's bytes per component; ``detail`` names the parts (``overhead.nccl``, ...)."""

    weights: int = 0
    kv_cache: int = 0
    activations: int = 0
    gradients: int = 0
    optimizer: int = 0
    overhead: int = 0
    detail: Mapping[str, int] = field(default_factory=dict)
    host: int = 0  # offloaded to CPU memory
    nvme: int = 0  # offloaded to NVMe

    @property
    def total(self) -> int:
        return (
            self.weights
            + self.kv_cache
            + self.activations
            + self.gradients
            + self.optimizer
            + self.overhead
        )

    def as_dict(self) -> dict[str, int]:
        """The plan JSON's ``memory`` object (issue 2 item 7)."""
        return {**{k: getattr(self, k) for k in COMPONENTS}, "total": self.total}


@dataclass(frozen=True)
class KvSummary:
    dtype: str
    bytes_per_token: int  # whole model, all layers, all KV heads
    batch_per_replica: int
    sequence_length: int
    per_stage_bytes_per_token: tuple[int, ...]  # one rank of each stage
    capacity: KvCapacity | None  # the tightest rank; None without device memory

    def to_json(self, utilization: float) -> dict[str, Any]:
        c = self.capacity
        return {
            "dtype": self.dtype,
            "bytes_per_token": self.bytes_per_token,
            "bytes_per_token_per_rank": list(self.per_stage_bytes_per_token),
            "batch_per_replica": self.batch_per_replica,
            "sequence_length": self.sequence_length,
            "gpu_memory_utilization": utilization,
            "capacity_tokens_per_rank": None if c is None else c.tokens,
            "max_batch": None if c is None else c.max_batch,
            "max_sequence_length": None if c is None else c.max_sequence_length,
        }


@dataclass(frozen=True)
class MemoryPlan:
    mode: str  # "inference" | "training"
    mesh: Mesh
    stages: tuple[Stage, ...]
    coords: Mapping[Coord, RankMemory]
    budget: int | None  # bytes a rank may use (device memory × utilization for inference)
    device_memory: int | None
    kv: KvSummary | None
    comm: tuple[CommTally, ...]  # per stage (one rank of it)
    hardware: HardwareSpec
    moe: MoeParams | None
    inputs: Mapping[str, Any]

    def for_rank(self, rank: int) -> RankMemory:
        c = self.mesh.coord(rank)
        return self.coords[(c["pp"], c["ep"], c["tp"])]

    def memory_per_rank(self) -> list[dict[str, int]]:
        """``memory`` objects for global ranks ``0 .. world-1``."""
        return [self.for_rank(r).as_dict() for r in range(self.mesh.world)]

    def stage_peaks(self) -> list[int]:
        """The largest rank total of each stage."""
        peaks = [0] * self.mesh.pp
        for (p, _e, _t), m in self.coords.items():
            peaks[p] = max(peaks[p], m.total)
        return peaks

    @property
    def peak(self) -> int:
        return max(m.total for m in self.coords.values())

    @property
    def fits(self) -> bool | None:
        return fits(self.peak, self.budget)

    @property
    def headroom(self) -> int | None:
        return None if self.budget is None else self.budget - self.peak

    def load_balance(self) -> float:
        """max / mean of the stages' peaks (1.0 is perfectly balanced)."""
        peaks = self.stage_peaks()
        mean = sum(peaks) / len(peaks)
        return max(peaks) / mean if mean else 1.0

    def warnings(self) -> list[str]:
        out = []
        peaks = self.stage_peaks()
        mean = sum(peaks) / len(peaks)
        for i, p in enumerate(peaks):
            if len(peaks) > 1 and mean and p > 1.10 * mean:
                out.append(
                    f"stage {i} is {100 * (p / mean - 1):.0f}% heavier than the mean stage "
                    f"({p / 2**30:.2f} GiB vs {mean / 2**30:.2f} GiB); consider "
                    "pipeline.layers_per_stage to move layers off it"
                )
        if self.kv is not None and self.kv.capacity is not None and self.fits is False:
            out.append("KV cache does not fit at this batch and length; see kv_cache.max_batch")
        return out

    def host_bytes_per_node(self) -> dict[str, int]:
        """Offloaded bytes one node must hold in CPU memory and on NVMe."""
        per = self.hardware.gpus_per_node
        ranks = [self.for_rank(r) for r in range(min(per, self.mesh.world))]
        return {"host_memory": sum(r.host for r in ranks), "nvme": sum(r.nvme for r in ranks)}

    def to_json(self) -> dict[str, Any]:
        """Keys added beside the plan JSON's ``ranks`` (issue 3)."""
        stage_peaks = self.stage_peaks()
        out: dict[str, Any] = {
            "memory_model": {
                "mode": self.mode,
                "budget_bytes": self.budget,
                "peak_bytes": self.peak,
                "headroom_bytes": self.headroom,
                "load_balance": round(self.load_balance(), 4),
                "stage_peak_bytes": stage_peaks,
                "warnings": self.warnings(),
                "inputs": dict(self.inputs),
                "detail_per_stage": [
                    dict(self.coords[(p, 0, 0)].detail) for p in range(self.mesh.pp)
                ],
                "offload_per_node": self.host_bytes_per_node(),
            },
            "communication": {
                "per_stage": [c.to_json(self.mesh, self.hardware) for c in self.comm],
            },
        }
        if self.kv is not None:
            util = float(self.inputs.get("gpu_memory_utilization", 1.0))
            out["kv_cache"] = self.kv.to_json(util)
        if self.moe is not None:
            out["moe"] = self.moe.to_json()
        return out


def _dense_bytes(dtype: str) -> int:
    return DTYPE_BITS[dtype] // 8 if DTYPE_BITS[dtype] >= 8 else 2


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

    ``weights_per_coord`` are the layout engine's exact bytes per ``(pp, ep, tp)``; without
    them (or with quantization) weights come from the closed form of
    :mod:`shardctl.plan.memory.shapes`.
    """
    workload = workload or Workload()
    quant = quant or QuantSpec()
    hardware = hardware or HardwareSpec()
    overhead = overhead or OverheadSpec()
    if training is not None and quant.method != "none":
        raise InvalidInputError(
            "training with quantized weights (QLoRA-style adapters) is not modeled",
            where="quantization.method",
            hint="drop quantization for a training plan, or plan inference",
        )
    stages = tuple(stages)
    if len(stages) != mesh.pp:
        raise InvalidInputError(f"{len(stages)} stages for pp={mesh.pp}", where="pipeline")
    shape = shape_from_model(model, vocab_padding=vocab_padding) if model.dims else None
    ctx = _Context(model, mesh, stages, shape, workload, training, quant, hardware, overhead)
    coords: dict[Coord, RankMemory] = {}
    for st in stages:
        for e in range(mesh.ep):
            for t in range(mesh.tp):
                given = None if weights_per_coord is None else weights_per_coord[(st.index, e, t)]
                coords[(st.index, e, t)] = ctx.rank(st, given)
    comm = tuple(ctx.comm(st) for st in stages)
    return MemoryPlan(
        mode="training" if training else "inference",
        mesh=mesh,
        stages=stages,
        coords=coords,
        budget=ctx.budget,
        device_memory=hardware.device_memory,
        kv=ctx.kv_summary(coords),
        comm=comm,
        hardware=hardware,
        moe=moe_params(shape) if shape is not None and shape.dims.num_experts else None,
        inputs=ctx.inputs(),
    )


class _Context:
    """Per-plan constants and the per-rank arithmetic (kept apart from the public API)."""

    def __init__(
        self,
        model: ModelInfo,
        mesh: Mesh,
        stages: tuple[Stage, ...],
        shape: ModelShape | None,
        workload: Workload,
        training: TrainingSpec | None,
        quant: QuantSpec,
        hardware: HardwareSpec,
        overhead: OverheadSpec,
    ):
        self.model, self.mesh, self.stages, self.shape = model, mesh, stages, shape
        self.workload, self.training, self.quant = workload, training, quant
        self.hw, self.ovh = hardware, overhead
        self.dtype = model.dtype if DTYPE_BITS.get(model.dtype, 0) >= 16 else "BF16"
        self.nb = _dense_bytes(self.dtype)
        self.kv_dtype = workload.kv_cache_dtype or self.dtype
        self.batch = -(-workload.batch_size // mesh.dp)  # per dp replica
        self.microbatches = training.grad_accumulation(mesh.dp) if training else 1
        self.budget = memory_budget(
            hardware.device_memory,
            training=training is not None,
            gpu_memory_utilization=workload.gpu_memory_utilization,
        )
        # Per stage index; the search shares them between meshes that agree on what they key.
        self._cache: dict[int, tuple[int, int, dict[str, int]]] = {}
        self._counts: dict[int, Counts] = {}

    # -- weights -------------------------------------------------------------------------
    def counts(self, st: Stage) -> Counts:
        hit = self._counts.get(st.index)
        if hit is not None:
            return hit
        if self.shape is None:
            n = self.model.parameters // (self.mesh.pp * self.mesh.tp * self.mesh.ep)
            c = Counts(linear=n)
        else:
            c = stage_counts(self.shape, st, self.mesh.pp, self.mesh.tp, self.mesh.ep)
        self._counts[st.index] = c
        return c

    def weight_bytes(self, c: Counts, given: int | None) -> int:
        q = self.quant
        if q.method != "none" and self.shape is not None:
            return quantized_weight_bytes(
                c,
                method=q.formula,
                dense_bytes=self.nb,
                group_size=q.group_size or 128,
                double_quant=q.double_quant,
                keep=q.keep,
            )
        if given is not None:
            return given
        return c.total * DTYPE_BITS[self.model.dtype] // 8

    # -- one rank ------------------------------------------------------------------------
    def rank(self, st: Stage, given: int | None) -> RankMemory:
        c = self.counts(st)
        weights = self.weight_bytes(c, given)
        kv, acts, detail = self._stage_terms(st)
        detail = dict(detail)
        grads = opt = host = nvme = 0
        if self.training is not None:
            tr = self.training
            params = c.total if given is None else given * 8 // DTYPE_BITS[self.model.dtype]
            mixed = self.nb == 2 and tr.master_weights
            g_bytes = DTYPE_BITS[tr.grad_dtype or self.dtype] / 8
            o_bytes = optimizer_bytes_per_param(
                tr.optimizer,
                hidden=self.shape.dims.hidden_size if self.shape else 0,
                mixed_precision=mixed,
            )
            dense = params - c.expert
            dense_w = weights * dense // params if params else 0
            parts = [
                model_states(
                    dense,
                    weight_bytes=self.nb,
                    grad_bytes=g_bytes,
                    optimizer_bytes=o_bytes,
                    zero=tr.zero,
                    dp=self.mesh.dp * self.mesh.ep,
                    weights_stored=dense_w,
                    offload_optimizer=tr.offload_optimizer,
                    offload_params=tr.offload_params,
                ),
                model_states(
                    c.expert,
                    weight_bytes=self.nb,
                    grad_bytes=g_bytes,
                    optimizer_bytes=o_bytes,
                    zero=tr.zero,
                    dp=self.mesh.dp,
                    weights_stored=weights - dense_w,
                    offload_optimizer=tr.offload_optimizer,
                    offload_params=tr.offload_params,
                ),
            ]
            weights = sum(p.weights for p in parts)
            grads = sum(p.gradients for p in parts)
            opt = sum(p.optimizer for p in parts)
            host = sum(p.host for p in parts)
            nvme = sum(p.nvme for p in parts)
            if tr.zero == 3 and self.shape is not None and st.num_layers:
                # FSDP/ZeRO-3 gathers a layer before use and prefetches the next: two whole
                # (dp-unsharded) layers live at once (FSDP backward_prefetch=BACKWARD_PRE).
                layer = layer_counts(self.shape, self.mesh.tp, self.mesh.ep).total * self.nb
                detail["weights.zero3_gather"] = 2 * layer
                weights += 2 * layer
        tensors = weights + kv + acts + grads + opt
        frag_base = tensors - kv if self.training is None else tensors
        items = overhead_bytes(
            self.ovh, frag_base, distributed=self.mesh.world > 1, expert_parallel=self.mesh.ep > 1
        )
        detail.update({f"overhead.{k}": v for k, v in items.items()})
        return RankMemory(weights, kv, acts, grads, opt, sum(items.values()), detail, host, nvme)

    def _stage_terms(self, st: Stage) -> tuple[int, int, dict[str, int]]:
        """KV cache and activations of one rank of ``st`` (same for every tp/ep rank)."""
        hit = self._cache.get(st.index)
        if hit is not None:
            return hit
        no_tokens = (
            self.workload.sequence_length == 0
            if self.training is None
            else self.training.sequence_length == 0
        )
        out = (
            (0, 0, {})
            if self.shape is None or no_tokens
            else (self._inference_terms(st) if self.training is None else self._training_terms(st))
        )
        self._cache[st.index] = out
        return out

    def _inference_terms(self, st: Stage) -> tuple[int, int, dict[str, int]]:
        assert self.shape is not None
        d, w, m = self.shape.dims, self.workload, self.mesh
        per_token = kv_bytes_per_token(d, self.kv_dtype, layers=st.num_layers, tp=m.tp)
        kv = per_token * self.batch * w.sequence_length
        tokens = self.batch * w.sequence_length
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
                act_bytes=self.nb,
            )
        last = st.index == m.pp - 1 and w.sequence_length > 0
        logits = act.logits_buffer_bytes(self.batch, d.vocab_size) if last else 0
        detail = {
            "activations.prefill_peak": peak,
            "activations.logits": logits,
            "kv_cache.bytes_per_token": per_token,
        }
        return kv, peak + logits, detail

    def _training_terms(self, st: Stage) -> tuple[int, int, dict[str, int]]:
        assert self.shape is not None and self.training is not None
        d, tr, m = self.shape.dims, self.training, self.mesh
        seq, mb, tp, sp = tr.sequence_length, tr.micro_batch_size, m.tp, tr.sequence_parallel
        per_layer = act.layer_activation_bytes(
            d,
            seq=seq,
            batch=mb,
            tp=tp,
            sequence_parallel=sp,
            recompute=tr.recompute,
            flash_attention=tr.flash_attention,
            dropout=tr.dropout,
            act_bytes=self.nb,
            capacity_factor=tr.capacity_factor,
        )
        layers = per_layer * st.num_layers
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
                act_bytes=self.nb,
                vocab_rows=vocab_rows_per_rank(d.vocab_size, m.tp, self.shape.vocab_padding),
            )
            if st.index == m.pp - 1
            else 0
        )
        inflight = act.in_flight_microbatches(
            st.index, m.pp, self.microbatches, tr.pipeline_schedule
        )
        working = 0
        if tr.recompute == "full" and st.num_layers:
            # Backward replays one layer's forward: its full activations are live once.
            working = act.layer_activation_bytes(
                d,
                seq=seq,
                batch=mb,
                tp=tp,
                sequence_parallel=sp,
                recompute="none",
                flash_attention=tr.flash_attention,
                dropout=tr.dropout,
                act_bytes=self.nb,
                capacity_factor=tr.capacity_factor,
            )
        total = inflight * (layers + first + last) + working
        detail = {
            "activations.per_layer": per_layer,
            "activations.in_flight": inflight,
            "activations.layers": inflight * layers,
            "activations.first_stage": inflight * first,
            "activations.logits_and_loss": inflight * last,
            "activations.recompute_working_set": working,
        }
        return 0, total, detail

    # -- communication and summaries -----------------------------------------------------
    def comm(self, st: Stage) -> CommTally:
        m = self.mesh
        if self.shape is None:
            return CommTally("step" if self.training else "token")
        d = self.shape.dims
        rows = vocab_rows_per_rank(d.vocab_size, m.tp, self.shape.vocab_padding)
        if self.training is None:
            return inference_comm(
                m,
                stage=st.index,
                layers=st.num_layers,
                batch=self.batch,
                hidden=d.hidden_size,
                vocab_rows=rows,
                act_bytes=self.nb,
            )
        tr = self.training
        c = self.counts(st)
        return training_comm(
            m,
            stage=st.index,
            layers=st.num_layers,
            moe_layers=st.num_layers if d.num_experts else 0,
            micro_batch=tr.micro_batch_size,
            seq=tr.sequence_length,
            microbatches=self.microbatches,
            hidden=d.hidden_size,
            top_k=max(d.experts_per_token, 1),
            params_dense=c.total - c.expert,
            params_expert=c.expert,
            grad_bytes=DTYPE_BITS[tr.grad_dtype or self.dtype] / 8,
            weight_bytes=self.nb,
            zero=tr.zero,
            sequence_parallel=tr.sequence_parallel,
            recompute=tr.recompute,
            act_bytes=self.nb,
            capacity_factor=tr.capacity_factor,
        )

    def kv_summary(self, coords: Mapping[Coord, RankMemory]) -> KvSummary | None:
        if self.training is not None or self.shape is None:
            return None
        d, w = self.shape.dims, self.workload
        per_stage = tuple(
            kv_bytes_per_token(d, self.kv_dtype, layers=s.num_layers, tp=self.mesh.tp)
            for s in self.stages
        )
        capacity = None
        if self.hw.device_memory is not None:
            caps = [
                kv_capacity(
                    device_memory=self.hw.device_memory,
                    utilization=w.gpu_memory_utilization,
                    non_kv_bytes=r.total - r.kv_cache,
                    per_token=per_stage[p],
                    batch=self.batch,
                    sequence_length=w.sequence_length,
                )
                for (p, _e, _t), r in coords.items()
                if per_stage[p]
            ]
            capacity = min(caps, key=lambda c: c.tokens) if caps else None
        return KvSummary(
            dtype=self.kv_dtype,
            bytes_per_token=kv_bytes_per_token(d, self.kv_dtype),
            batch_per_replica=self.batch,
            sequence_length=w.sequence_length,
            per_stage_bytes_per_token=per_stage,
            capacity=capacity,
        )

    def inputs(self) -> dict[str, Any]:
        w, tr, q = self.workload, self.training, self.quant
        out: dict[str, Any] = {"dtype": self.model.dtype, "quantization": q.method}
        if tr is None:
            out.update(
                batch_size=w.batch_size,
                sequence_length=w.sequence_length,
                kv_cache_dtype=self.kv_dtype,
                flash_attention=w.flash_attention,
                max_num_batched_tokens=w.max_num_batched_tokens,
                gpu_memory_utilization=w.gpu_memory_utilization,
            )
        else:
            out.update(
                optimizer=tr.optimizer,
                zero=tr.zero,
                recompute=tr.recompute,
                sequence_parallel=tr.sequence_parallel,
                micro_batch_size=tr.micro_batch_size,
                grad_accumulation=self.microbatches,
                sequence_length=tr.sequence_length,
                offload_optimizer=tr.offload_optimizer,
                offload_params=tr.offload_params,
            )
        return out
