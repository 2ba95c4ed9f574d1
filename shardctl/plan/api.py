"""``shardctl plan``: manifest → model inventory → layout → per-rank memory.

The weight bytes printed for a rank are the bytes ``reshard`` writes for it: both come from
:mod:`shardctl.layout.engine` (:mod:`shardctl.plan.weights`). No torch, no numpy on this path.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shardctl.errors import InvalidInputError
from shardctl.layout.types import Mesh, Stage
from shardctl.manifest import Manifest, load_manifest
from shardctl.model.types import ModelInfo
from shardctl.plan.memory.budget import fits
from shardctl.plan.memory.estimate import MemoryPlan

if TYPE_CHECKING:
    from shardctl.plan.search import SearchResult

PLAN_SCHEMA = "shardctl.plan/1"


def load_model(manifest: Manifest) -> ModelInfo:
    """The inventory the manifest's ``model`` section names (config, checkpoint, count, inline)."""
    from shardctl.model import inventory

    spec = manifest.model
    if spec.checkpoint is not None:
        info = inventory.from_checkpoint(spec.checkpoint)
        # A checkpoint is counted as stored: its headers are the truth, whatever model.dtype says.
        return _not_requantized(manifest, info)
    if spec.config is not None:
        info = inventory.from_config_file(spec.config, dtype=spec.dtype)
        return _not_requantized(manifest, info)
    if spec.parameters is not None:
        return inventory.from_parameters(spec.parameters, spec.dtype or "BF16")
    info = inventory.from_config(dict(spec.inline_config), dtype=spec.dtype, source="inline")
    return _not_requantized(manifest, info)  # an inline quantization_config too


def _not_requantized(manifest: Manifest, info: ModelInfo) -> ModelInfo:
    """A quantized checkpoint (its ``quantization_config``) is counted by its stored tensors;
    a manifest ``quantization:`` on top would price it twice."""
    from shardctl.errors import InvalidInputError
    from shardctl.quant.config import read_quant

    stored = read_quant(info.config, where=info.source)
    if stored is not None and manifest.quantization is not None:
        raise InvalidInputError(
            f"the model is already quantized ({stored.describe()}): its stored tensors are "
            "counted as they are, so quantization: / --quantization would count it twice",
            where="quantization",
            hint="drop quantization: (or --quantization) for a quantized checkpoint or config",
        )
    return info


def apply_mesh_overrides(mesh: Mesh, overrides: Mapping[str, int]) -> Mesh:
    return replace(mesh, **dict(overrides)) if overrides else mesh


@dataclass(frozen=True)
class RankPlan:
    rank: int
    coord: dict[str, int]
    stage: int
    memory: dict[str, int]

    @property
    def total(self) -> int:
        return self.memory["total"]


@dataclass(frozen=True)
class PlanResult:
    """One layout's plan: per-rank memory and the one verdict.

    ``fits``, ``budget`` and ``headroom`` are the memory model's (:class:`MemoryPlan`, one
    budget: :func:`~shardctl.plan.memory.budget.memory_budget`); the exit code, the text and
    the JSON all read them from here.
    """

    manifest: Manifest
    model: ModelInfo
    mesh: Mesh
    stages: tuple[Stage, ...]
    ranks: tuple[RankPlan, ...]
    memory: MemoryPlan
    warnings: tuple[str, ...] = ()
    shared_ep: int = 0  # > 0: experts over the tp×dp ranks, ep = shared_ep (``mesh`` has ep 1)

    @property
    def weights_only(self) -> bool:
        """No KV cache and no activations counted (asked for, or no tokens in the workload)."""
        from shardctl.plan.checks import weights_only

        return weights_only(self.model, self.manifest.workload, self.manifest.training)

    def quantized_weight_bytes(self) -> int:
        """One model replica's weight bytes as priced (quantized when quantization is set)."""
        return sum(self.stage_weight_bytes())

    @property
    def device_memory(self) -> int | None:
        return self.memory.device_memory

    @property
    def budget(self) -> int | None:
        """Bytes one rank may use (device memory × utilization when serving)."""
        return self.memory.budget

    @property
    def fits(self) -> bool | None:
        """Every rank within :attr:`budget`; ``None`` when device memory is unknown."""
        return self.memory.fits

    @property
    def headroom(self) -> int | None:
        return self.memory.headroom

    def rank_fits(self, rank: RankPlan) -> bool | None:
        return fits(rank.total, self.budget)

    def engine_command(self) -> dict[str, Any] | None:
        """Engine formats (issue 16): the ``shardctl reshard`` command that writes this layout
        in ``workload.engine``'s format (each engine's module prints its own)."""
        engine = self.manifest.workload.engine
        if engine == "megatron":
            from shardctl.formats.megatron.command import reshard_command

            return reshard_command(self.manifest, self.mesh)
        if engine == "vllm":
            from shardctl.formats.vllm.command import reshard_command as vllm_command

            return vllm_command(self.manifest, self.mesh, self.model)
        if engine == "hf":
            return _hf_command(self.manifest, self.mesh)
        return None

    def stage_weight_bytes(self) -> list[int]:
        """Weight bytes of one model replica per stage (sum over its tp × ep ranks)."""
        out = [0] * self.mesh.pp
        for r in self.ranks:
            if r.coord["dp"] == 0:
                out[r.stage] += r.memory["weights"]
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": PLAN_SCHEMA,
            "model": {
                "architecture": self.model.architecture,
                "parameters": self.model.parameters,
                "weight_bytes": self.model.weight_bytes,
                "dtype": self.model.dtype,
                "source": self.model.source,
                **self._quantization_json(),
            },
            "expert_parallel": self._expert_parallel_json(),
            "weights_only": self.weights_only,
            "warnings": list(self.warnings),
            **({"reshard": c} if (c := self.engine_command()) is not None else {}),
            "mesh": self.mesh.as_dict(),
            "fits": self.fits,
            "device_memory_bytes": self.device_memory,
            "budget_bytes": self.budget,
            "headroom_bytes": self.headroom,
            "stages": [
                {
                    "stage": s.index,
                    "layers": list(s.layers) if s.layers is not None else None,
                    "weight_bytes": w,
                }
                for s, w in zip(self.stages, self.stage_weight_bytes(), strict=True)
            ],
            "ranks": [
                {"rank": r.rank, "coord": r.coord, "stage": r.stage, "memory": r.memory}
                for r in self.ranks
            ],
            **self.memory.to_json(),
        }

    def _expert_parallel_json(self) -> dict[str, Any] | None:
        """How experts are placed: ``separate`` (the ep axis) or ``shared`` (over tp×dp)."""
        d = self.model.dims
        if d is None or not d.num_experts:
            return None
        ep = self.shared_ep or self.mesh.ep
        return {
            "placement": "shared" if self.shared_ep else "separate",
            "ep": ep,
            "experts_per_rank": d.num_experts // ep,
        }

    def _quantization_json(self) -> dict[str, Any]:
        q = self.manifest.quantization
        if q is None:
            return {}
        stored = self.quantized_weight_bytes()
        return {
            "quantization": {
                "method": q.method,
                **({"fp8_scaling": q.fp8_scaling} if q.method == "fp8" else {}),
                **({"overrides": [_override_json(o) for o in q.overrides]} if q.overrides else {}),
                "weight_bytes": stored,
                "bytes_per_parameter": stored / self.model.parameters,
            }
        }

    def write_report(self, path: Path) -> None:
        from shardctl.plan.report import write_report

        write_report(self, path)


def make_plan(
    manifest_path: Path,
    *,
    mesh_overrides: Mapping[str, int] | None = None,
    only_weights: bool = False,
) -> PlanResult:
    manifest = load_manifest(manifest_path)
    return plan_manifest(manifest, mesh_overrides=mesh_overrides, only_weights=only_weights)


def _hf_command(manifest: Manifest, mesh: Mesh) -> dict[str, Any]:
    """``engine: hf``: transformers loads the HF checkpoint itself — whole tensors that
    ``tp_plan="auto"`` shards at load under ``torchrun`` — so no conversion is needed (the plan's
    ``model`` is an HF checkpoint or config); it has no pipeline stages or expert-parallel
    axis, so such a layout is refused."""
    del manifest
    if mesh.pp > 1 or mesh.ep > 1:
        axis = "pp" if mesh.pp > 1 else "ep"
        why = (
            f"transformers loads tensor-parallel ranks only ({axis} {getattr(mesh, axis)}); "
            "plan with pp 1 and ep 1, or use --device-map for layers over GPUs"
        )
        return {"engine": "hf", "command": None, "refused": why, "load_flags": None}
    load = (
        f"torchrun --nproc-per-node {mesh.tp} …: "
        'AutoModelForCausalLM.from_pretrained(CHECKPOINT, tp_plan="auto")'
        if mesh.tp > 1
        else "AutoModelForCausalLM.from_pretrained(CHECKPOINT)"
    )
    return {
        "engine": "hf",
        "command": None,
        "refused": None,
        "note": "no conversion: transformers loads the Hugging Face checkpoint as it is",
        "load_flags": load,
    }


def with_weights_only(manifest: Manifest, only_weights: bool) -> Manifest:
    """``manifest`` with ``workload.mode: weights-only`` when ``only_weights`` (the flag)."""
    if not only_weights or manifest.workload.only_weights:
        return manifest
    return replace(manifest, workload=replace(manifest.workload, only_weights=True))


def _override_json(o: Any) -> dict[str, Any]:
    """One ``quantization.overrides`` entry as given (first match wins)."""
    out: dict[str, Any] = {"match": o.match}
    if o.dtype is not None:
        out["dtype"] = o.dtype
    else:
        out["method"] = o.method
        if o.group_size is not None:
            out["group_size"] = o.group_size
        if o.method == "fp8":
            out["fp8_scaling"] = o.fp8_scaling
    return out


def _cp(manifest: Manifest) -> int:
    """Context-parallel ranks per replica (``mesh.cp``; 1 for inference)."""
    return manifest.training.context_parallel if manifest.training is not None else 1


def plan_manifest(
    manifest: Manifest,
    *,
    mesh_overrides: Mapping[str, int] | None = None,
    only_weights: bool = False,
    check_hardware: bool = True,
) -> PlanResult:
    """The plan of ``manifest``'s layout. ``check_hardware=False`` prices a mesh that is not a
    cluster layout (the device map's one stage per layer) without the GPU-count check."""
    from shardctl.plan.checks import check_keep_16bit, check_mesh, check_workload
    from shardctl.plan.memory.adapter import plan_memory
    from shardctl.plan.weights import (
        engine_rules,
        served_model,
        served_rules,
        weights_per_coord,
    )

    manifest = with_weights_only(manifest, only_weights)
    model = load_model(manifest)
    check_workload(model, manifest.workload, manifest.training)
    check_keep_16bit(model, manifest.quantization)
    mesh = apply_mesh_overrides(manifest.mesh, mesh_overrides or {})
    served = served_model(model, manifest.workload)  # the tensors the engine loads
    own = served_rules(model, served, manifest.rules)
    rules = engine_rules(served, own, manifest.workload)
    shared_ep = 0
    if manifest.expert_placement == "shared":
        from shardctl.plan import shared_ep as sh

        sh.check_modeled(manifest.training is not None, manifest.quantization is not None)
        full, mesh = mesh, sh.attention_mesh(mesh)
        warnings = check_mesh(mesh, manifest.hardware, _cp(manifest)) if check_hardware else ()
        stages, by_dp = sh.shared_ep_weights(served, full, rules=rules, options=manifest.layout)
        weights: Mapping[tuple[int, int, int], int] | None = sh.memory_coords(by_dp, mesh)
        shared_ep = full.ep
    else:
        warnings = check_mesh(mesh, manifest.hardware, _cp(manifest)) if check_hardware else ()
        stages, weights = weights_per_coord(
            served,
            mesh,
            rules=rules,
            options=manifest.layout,
            quant=manifest.quantization,
        )
    memory = plan_memory(manifest, served, mesh, stages, weights)
    ranks = tuple(
        RankPlan(
            rank=r,
            coord=mesh.coord(r),
            stage=mesh.coord(r)["pp"],
            memory=memory.for_rank(r).as_dict(),
        )
        for r in range(mesh.world)
    )
    return PlanResult(
        manifest=manifest,
        model=model,
        mesh=mesh,
        stages=stages,
        ranks=ranks,
        memory=memory,
        warnings=warnings,
        shared_ep=shared_ep,
    )


def run_search(
    manifest_path: Path,
    *,
    gpus: int | None,
    mesh_overrides: Mapping[str, int] | None = None,
    only_weights: bool = False,
) -> SearchResult:
    manifest = load_manifest(manifest_path)
    return search_manifest(
        manifest, gpus=gpus, mesh_overrides=mesh_overrides, only_weights=only_weights
    )


def search_manifest(
    manifest: Manifest,
    *,
    gpus: int | None,
    mesh_overrides: Mapping[str, int] | None = None,
    only_weights: bool = False,
) -> SearchResult:
    """:func:`run_search` of a loaded manifest (``mesh_overrides`` are not searched over)."""
    from shardctl.plan.checks import check_keep_16bit, check_workload
    from shardctl.plan.memory.adapter import search_layouts

    if manifest.expert_placement == "shared":
        raise InvalidInputError(
            "--search covers layouts with ep as its own axis, not expert_placement: shared",
            where="mesh.expert_placement",
            hint="plan the shared layout without --search, or search with separate placement",
        )
    if _cp(manifest) > 1:
        raise InvalidInputError(
            f"--search covers pp × dp × ep × tp; the manifest has mesh.cp {_cp(manifest)}",
            where="mesh.cp",
            hint="plan the context-parallel layout without --search, or search without mesh.cp",
        )
    manifest = with_weights_only(manifest, only_weights)
    model = load_model(manifest)
    check_workload(model, manifest.workload, manifest.training)
    check_keep_16bit(model, manifest.quantization)
    return search_layouts(manifest, model, gpus=gpus)
