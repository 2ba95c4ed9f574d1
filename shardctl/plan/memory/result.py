"""What the memory model returns: bytes per component per rank, the KV summary, and the
:class:`MemoryPlan` of one layout with its one verdict (:mod:`.budget`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from shardctl.layout.types import Mesh, Stage
from shardctl.plan.memory.budget import fits
from shardctl.plan.memory.comm import CommTally
from shardctl.plan.memory.hardware import HardwareSpec
from shardctl.plan.memory.kv import KvCapacity
from shardctl.plan.memory.moe import MoeParams

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
        """The plan JSON's ``memory`` object."""
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
            # vLLM's units, per rank: "Available KV cache memory", "# GPU blocks", "GPU KV
            # cache size: N tokens", "Maximum concurrency for L tokens per request".
            "kv_cache_bytes_per_rank": None if c is None else c.kv_bytes,
            "block_size": None if c is None else c.block_size,
            "blocks_per_rank": None if c is None else c.blocks,
            "max_concurrency": None if c is None else round(c.max_concurrency, 2),
            # the same capacity in the engine's own log units (workload.engine)
            "engine_units": None if c is None else c.engine_units(),
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
    # why the workload's serving engine refuses to start at all (context_length.refusal):
    # the verdict is then "does not fit" whatever the memory
    refused: str | None = None

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
        if self.refused is not None:
            return False
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
        if self.refused is not None:
            out.insert(0, self.refused)
        if self.inputs.get("approximate"):
            out.append(str(self.inputs["approximate"]))
        if self.kv is not None and self.kv.capacity is not None and self.fits is False:
            out.append("KV cache does not fit at this batch and length; see kv_cache.max_batch")
        return out

    def host_bytes_per_node(self) -> dict[str, int]:
        """Offloaded bytes one node must hold in CPU memory and on NVMe."""
        per = self.hardware.gpus_per_node
        ranks = [self.for_rank(r) for r in range(min(per, self.mesh.world))]
        return {"host_memory": sum(r.host for r in ranks), "nvme": sum(r.nvme for r in ranks)}

    def to_json(self) -> dict[str, Any]:
        """Keys added beside the plan JSON's ``ranks``."""
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
                "engine_refusal": self.refused,
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
