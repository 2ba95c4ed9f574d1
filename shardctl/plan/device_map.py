"""An accelerate/transformers ``device_map`` that honours each device's whole budget.

``infer_auto_device_map`` counts weights only; a map made from it OOMs at the first long
prompt. Here every device is charged what the plan charges a pipeline stage: its weights, the
KV cache and activations of its layers, and the per-GPU overhead.

How (no torch): one plan with one decoder layer per stage (``layers_per_stage = (0, 1, …, 1,
0)``: the embeddings alone first, the final norm and head alone last) prices every *unit*
— embeddings, each layer, head — with the plan's own per-stage figures. The units are then
filled, in order, onto GPU 0, 1, …, then ``"cpu"``, then ``"disk"`` (with an offload folder).
A device's charge is::

    tensors = Σ weights + Σ KV + max(layer activations) + activations of embeddings/head
    charge  = tensors + overhead (GPU only: the manifest's ``overhead:`` items of one
              non-distributed process — CUDA context, framework, reserved — plus its
              fragmentation share of ``tensors``)

With GPUs, modules on ``"cpu"``/``"disk"`` run on GPU 0 (accelerate's execution device), so
GPU 0 also holds their KV cache, their activations and the largest one's weights while it
runs; with no GPU the CPU holds all of that. The result is contiguous by construction: a
stage = a block of layers, embeddings with the first, final norm + head with the last.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from shardctl.errors import InvalidInputError, UsageError
from shardctl.layout.types import Mesh
from shardctl.manifest import Manifest

DEVICE_MAP_SCHEMA = "shardctl.device_map/1"
_LAYER_MODULE = re.compile(r"^(.*?(?:^|\.)(?:layers|h)\.\d+)\.")

Device = int | str  # GPU index, "cpu" or "disk"


@dataclass(frozen=True)
class Unit:
    """A piece that moves whole: the embeddings, one decoder layer, or the norm + head."""

    name: str  # "embeddings", "layer 3", "head"
    modules: tuple[str, ...]  # device_map keys: "model.embed_tokens", "model.layers.3", …
    weights: int
    kv_cache: int
    activations: int
    is_layer: bool


@dataclass(frozen=True)
class DeviceLoad:
    """What one device holds and what it is charged (bytes)."""

    device: Device
    units: tuple[Unit, ...]
    weights: int
    kv_cache: int
    activations: int
    overhead: int
    budget: int | None  # None: unlimited (disk)

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.activations + self.overhead

    @property
    def layers(self) -> tuple[int, int] | None:
        idx = [int(u.name.split()[1]) for u in self.units if u.is_layer]
        return (idx[0], idx[-1]) if idx else None


@dataclass(frozen=True)
class DeviceMapPlan:
    """The map, the budgets it assumed (``max_memory``) and each device's load.

    ``fits`` is False when the units do not fit even with CPU (and, given an offload folder,
    disk) offload; ``device_map`` is then partial and must not be written.
    """

    device_map: dict[str, Device]
    max_memory: dict[str, int]  # "0", "1", …, "cpu": the budget each device was planned against
    loads: tuple[DeviceLoad, ...]
    fits: bool
    offload_folder: Path | None
    reason: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": DEVICE_MAP_SCHEMA,
            "fits": self.fits,
            "reason": self.reason,
            "max_memory": self.max_memory,
            "offload_folder": None if self.offload_folder is None else str(self.offload_folder),
            "devices": [
                {
                    "device": ld.device,
                    "layers": None if ld.layers is None else list(ld.layers),
                    "modules": [m for u in ld.units for m in u.modules],
                    "weights": ld.weights,
                    "kv_cache": ld.kv_cache,
                    "activations": ld.activations,
                    "overhead": ld.overhead,
                    "total": ld.total,
                    "budget": ld.budget,
                }
                for ld in self.loads
            ],
        }


@dataclass(frozen=True)
class Overhead:
    """Per-GPU overhead: ``fixed`` bytes plus ``fragmentation`` × the device's tensors."""

    fixed: int = 0
    fragmentation: float = 0.0

    def of(self, tensors: int) -> int:
        return self.fixed + int(tensors * self.fragmentation)


def units_of(manifest: Manifest) -> tuple[list[Unit], Overhead, int | None]:
    """The units of the manifest's model, priced by the plan; plus the per-GPU overhead and
    the GPU budget (``None`` when ``hardware.device_memory`` is not set)."""
    from shardctl.layout.engine import resolve
    from shardctl.plan.api import load_model, plan_manifest
    from shardctl.plan.memory.adapter import overhead_of
    from shardctl.plan.memory.overhead import overhead_bytes

    if manifest.training is not None:
        raise UsageError(
            "--device-map plans inference (from_pretrained); the manifest plans training",
            hint="use an inference manifest (workload.mode: inference)",
        )
    model = load_model(manifest)
    if not model.tensors or model.dims is None:
        raise InvalidInputError(
            "a device map needs the model's tensor names (a checkpoint or config.json)",
            where="model",
            hint="give model.checkpoint or model.config",
        )
    n = model.dims.num_layers
    mesh = Mesh(pp=n + 2)
    layout = replace(manifest.layout, layers_per_stage=(0, *([1] * n), 0))
    # one pp stage per unit is a pricing device, not GPUs: no check against hardware's count
    per_unit = plan_manifest(replace(manifest, mesh=mesh, layout=layout), check_hardware=False)
    modules: list[list[str]] = [[] for _ in range(n + 2)]
    for t in resolve(model, mesh, rules=manifest.rules, options=layout).tensors:
        hit = _LAYER_MODULE.match(t.info.fqn)
        module = hit.group(1) if hit else t.info.fqn.rsplit(".", 1)[0]
        stage = t.stages[0]  # "all"/tied: with the first unit that holds it
        if module not in modules[stage]:
            modules[stage].append(module)
    tied_head = bool(model.config.get("tie_word_embeddings")) and not any(
        "lm_head" in m for m in modules[n + 1]
    )
    if tied_head and "lm_head" not in modules[0]:
        # No lm_head on disk: transformers ties it to the embeddings, on their device.
        modules[0].append("lm_head")
    units = []
    for r in per_unit.ranks:
        s = r.stage
        name = "embeddings" if s == 0 else "head" if s == n + 1 else f"layer {s - 1}"
        units.append(
            Unit(
                name=name,
                modules=tuple(modules[s]),
                weights=r.memory["weights"],
                kv_cache=r.memory["kv_cache"],
                activations=r.memory["activations"],
                is_layer=0 < s <= n,
            )
        )
    spec = overhead_of(manifest)
    items = overhead_bytes(spec, 0, distributed=False)
    return units, Overhead(sum(items.values()), spec.fragmentation), per_unit.budget


def assign(
    units: Sequence[Unit],
    *,
    gpu_budgets: Sequence[int],
    overhead: Overhead,
    cpu_budget: int,
    offload_folder: Path | None,
) -> DeviceMapPlan:
    """Fill ``units`` in order onto GPUs, then CPU, then disk (pure; see the module doc)."""
    reserve = _Reserve()
    for _ in range(len(units) + 1):  # the reserve on the execution device only grows
        placed = _fill(units, gpu_budgets, overhead, cpu_budget, offload_folder, reserve)
        needed = _Reserve.of(placed, has_gpu=bool(gpu_budgets))
        if needed == reserve:
            break
        reserve = needed
    return _result(placed, gpu_budgets, overhead, cpu_budget, offload_folder, reserve)


@dataclass(frozen=True)
class _Reserve:
    """Room the execution device keeps for offloaded units: the largest one's weights (loaded
    while it runs), all their KV cache and their largest activations."""

    weights: int = 0
    kv_cache: int = 0
    activations: int = 0

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.activations

    @classmethod
    def of(cls, placed: list[tuple[Unit, Device | None]], *, has_gpu: bool) -> _Reserve:
        remote = ("cpu", "disk") if has_gpu else ("disk",)
        off = [u for u, d in placed if d in remote or d is None]
        if not off:
            return cls()
        kv = sum(u.kv_cache for u in off)
        acts = max(u.activations for u in off)
        return cls(weights=max(u.weights for u in off), kv_cache=kv, activations=acts)


def _charge(group: Sequence[Unit], *, runs_here: bool) -> tuple[int, int, int]:
    """(weights, KV, activations) of a group on one device; a CPU that only stores
    offloaded weights (GPUs run them) is charged weights alone."""
    weights = sum(u.weights for u in group)
    if not runs_here:
        return weights, 0, 0
    kv = sum(u.kv_cache for u in group)
    layer_acts = max((u.activations for u in group if u.is_layer), default=0)
    acts = layer_acts + sum(u.activations for u in group if not u.is_layer)
    return weights, kv, acts


def _fill(
    units: Sequence[Unit],
    gpu_budgets: Sequence[int],
    overhead: Overhead,
    cpu_budget: int,
    offload_folder: Path | None,
    reserve: _Reserve,
) -> list[tuple[Unit, Device | None]]:
    devices: list[tuple[Device, int | None]] = [(i, b) for i, b in enumerate(gpu_budgets)]
    devices.append(("cpu", cpu_budget))
    if offload_folder is not None:
        devices.append(("disk", None))
    placed: list[tuple[Unit, Device | None]] = []
    d, group = 0, list[Unit]()
    for u in units:
        while d < len(devices):
            device, budget = devices[d]
            if (
                budget is None
                or _cost([*group, u], device, gpu_budgets, overhead, reserve) <= budget
            ):
                break
            d, group = d + 1, []
        if d == len(devices):
            placed.append((u, None))  # fits nowhere
            continue
        group.append(u)
        placed.append((u, devices[d][0]))
    return placed


def _cost(
    group: Sequence[Unit],
    device: Device,
    gpus: Sequence[int],
    overhead: Overhead,
    reserve: _Reserve,
) -> int:
    is_gpu = isinstance(device, int)
    executes = is_gpu or (device == "cpu" and not gpus)
    w, kv, acts = _charge(group, runs_here=executes)
    if (device == 0 and gpus) or (device == "cpu" and not gpus):
        w, kv, acts = w + reserve.weights, kv + reserve.kv_cache, max(acts, reserve.activations)
    tensors = w + kv + acts
    return tensors + (overhead.of(tensors) if is_gpu else 0)


def _result(
    placed: list[tuple[Unit, Device | None]],
    gpu_budgets: Sequence[int],
    overhead: Overhead,
    cpu_budget: int,
    offload_folder: Path | None,
    reserve: _Reserve,
) -> DeviceMapPlan:
    order: list[Device] = [*range(len(gpu_budgets)), "cpu", "disk"]
    loads = []
    for device in order:
        group = [u for u, d in placed if d == device]
        runs = device == 0 or (device == "cpu" and not gpu_budgets)
        if not group and not (runs and reserve.total):
            continue
        is_gpu = isinstance(device, int)
        w, kv, acts = _charge(group, runs_here=is_gpu or (device == "cpu" and not gpu_budgets))
        if runs:
            w, kv, acts = w + reserve.weights, kv + reserve.kv_cache, max(acts, reserve.activations)
        budget = gpu_budgets[device] if isinstance(device, int) else None
        if device == "cpu":
            budget = cpu_budget
        loads.append(
            DeviceLoad(
                device,
                tuple(group),
                w,
                kv,
                acts,
                overhead.of(w + kv + acts) if is_gpu else 0,
                budget,
            )
        )
    missing = [u.name for u, d in placed if d is None]
    over = [ld for ld in loads if ld.budget is not None and ld.total > ld.budget]
    reason = None
    if missing:
        where = "GPUs and CPU" + ("" if offload_folder is None else " and disk")
        reason = (
            f"{len(missing)} of {len(placed)} units fit on no device ({where}), first "
            f"{missing[0]}"
            + ("; add --offload-folder DIR to spill to disk" if offload_folder is None else "")
        )
    elif over:
        reason = (
            f"device {over[0].device} needs {over[0].total:,} B of its {over[0].budget:,} B budget"
        )
    max_memory = {str(i): b for i, b in enumerate(gpu_budgets)}
    max_memory["cpu"] = cpu_budget
    return DeviceMapPlan(
        device_map={m: d for u, d in placed if d is not None for m in u.modules},
        max_memory=max_memory,
        loads=tuple(loads),
        fits=reason is None,
        offload_folder=offload_folder,
        reason=reason,
    )


def host_memory() -> int:
    """This machine's physical memory (the default CPU budget)."""
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def plan_device_map(
    manifest: Manifest,
    *,
    gpus: int | None = None,
    cpu_memory: int | None = None,
    offload_folder: Path | None = None,
) -> DeviceMapPlan:
    """The device map of ``manifest``'s model on ``gpus`` GPUs (default:
    ``hardware.gpus_per_node``), each with the plan's budget, then CPU and disk."""
    units, overhead, budget = units_of(manifest)
    count = manifest.hardware.gpus_per_node if gpus is None else gpus
    if count and budget is None:
        raise InvalidInputError(
            "a device map for GPUs needs their memory",
            where="hardware.device_memory",
            hint="set hardware.device_memory (or hardware.gpu), or plan CPU/disk with --gpus 0",
        )
    return assign(
        units,
        gpu_budgets=[budget or 0] * count,
        overhead=overhead,
        cpu_budget=host_memory() if cpu_memory is None else cpu_memory,
        offload_folder=offload_folder,
    )


def sidecar_path(path: Path) -> Path:
    """``map.json`` → ``map.max_memory.json``: the budgets and loads beside the map."""
    return path.with_name(path.stem + ".max_memory.json")


def write_device_map(result: DeviceMapPlan, path: Path) -> Path:
    """Write the map alone to ``path`` (``json.load`` it straight into ``device_map=``) and
    :func:`sidecar_path` with ``max_memory`` and each device's load; returns the sidecar."""
    from shardctl.io.atomic import write_file

    if not result.fits:
        raise AssertionError("a device map that does not fit is never written")
    side = sidecar_path(path)
    write_file(path, (json.dumps(result.device_map, indent=2) + "\n").encode(), exclusive=False)
    body = {**result.to_json(), "device_map_file": path.name}
    write_file(side, (json.dumps(body, indent=2) + "\n").encode(), exclusive=False)
    return side
