"""The manifest as frozen, typed data. Validation lives in :mod:`shardctl.manifest.validate`.

The section types are the memory model's (:class:`HardwareSpec`, :class:`Workload`,
:class:`TrainingSpec`, :class:`QuantSpec`): the manifest builds them directly.

Every field is already checked and normalized: dtypes are safetensors codes (``"BF16"``), sizes
are bytes, bandwidths bytes/s, paths absolute. ``None`` means "not given; derive it" and each
docstring says from what.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from shardctl.layout.engine import UNEVEN, VOCAB_PADDING
from shardctl.layout.pipeline import CONVENTIONS
from shardctl.layout.placement import SUGAR
from shardctl.layout.rules import HEADS, NAMED_PARTS, STAGES
from shardctl.layout.types import LayoutOptions, Mesh, RuleSpec
from shardctl.manifest.values import thaw
from shardctl.plan.memory.engines import ENGINES as _ENGINES
from shardctl.plan.memory.hardware import HardwareSpec
from shardctl.plan.memory.overhead import FRACTIONS as _OVERHEAD_FRACTIONS
from shardctl.plan.memory.overhead import SIZES as _OVERHEAD_SIZES
from shardctl.plan.memory.spec import (
    DEFAULT_GROUP_SIZE,
    DEFAULT_KEEP_16BIT,
    FP8_BLOCK,
    FP8_SCALING,
    FSDP_NAMES,
    LORA_TARGETS,
    OFFLOAD,
    PIPELINE_SCHEDULES,
    QUANT_METHODS,
    RECOMPUTE,
    QuantOverride,
    QuantSpec,
    TrainingSpec,
    Workload,
)
from shardctl.plan.memory.training import OPTIMIZERS as _OPTIMIZER_TABLE

# Choices, shared by the validator and the JSON Schema. Each is defined once, where the code
# that gives it meaning lives; the manifest only names them.
PIPELINE_CONVENTIONS = CONVENTIONS
MODES = ("inference", "training", "weights-only")
# separate: ep is a mesh axis of its own (world = pp·dp·ep·tp); shared: experts spread over the
# tp×dp ranks that run attention (ep = tp·dp, world = pp·dp·tp), as vLLM's
# --enable-expert-parallel and Megatron's expert-parallel groups over data-parallel ranks.
EXPERT_PLACEMENTS = ("separate", "shared")
ENGINES = _ENGINES  # the memory profiles (shardctl.plan.memory.engines)
OPTIMIZERS = tuple(_OPTIMIZER_TABLE)
ZERO_FSDP_NAMES: dict[str, int] = {name.upper(): stage for name, stage in FSDP_NAMES.items()}
RULE_HEADS = HEADS
RULE_STAGES = STAGES
RULE_PART_NAMES = NAMED_PARTS
RULE_TP_WORDS = ("R", *SUGAR)

OVERHEAD_SIZES = _OVERHEAD_SIZES
OVERHEAD_FRACTIONS = _OVERHEAD_FRACTIONS


def _empty() -> Mapping[str, Any]:
    return MappingProxyType({})


@dataclass(frozen=True)
class ModelSpec:
    """Exactly one source of tensors: ``config``, ``checkpoint``, ``parameters`` or inline fields.

    ``dtype`` (safetensors code) overrides the config's ``torch_dtype``; None = the config's.
    ``inline_config`` is a read-only mapping (nested mappings read-only, lists as tuples); use
    :meth:`config_dict` for a plain mutable ``dict`` as ``json.load`` would give.
    """

    config: Path | None = None
    checkpoint: Path | None = None
    parameters: int | None = None
    inline_config: Mapping[str, Any] = field(default_factory=_empty)
    dtype: str | None = None

    @property
    def source(self) -> str:
        if self.config is not None:
            return "config"
        if self.checkpoint is not None:
            return "checkpoint"
        if self.parameters is not None:
            return "parameters"
        return "inline"

    def config_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = thaw(self.inline_config)
        return out


@dataclass(frozen=True)
class Manifest:
    """A validated manifest, built of the memory model's own types (one type per concept).

    ``training`` is None exactly when ``workload.mode`` is inference (:attr:`mode`); it then
    carries the ``workload:`` keys that only training has (micro-batch, accumulation).
    ``quantization`` is None when absent or ``method: none``; ``path`` is the file it came
    from."""

    model: ModelSpec
    mesh: Mesh = field(default_factory=Mesh)
    hardware: HardwareSpec = field(default_factory=HardwareSpec)
    layout: LayoutOptions = field(default_factory=LayoutOptions)
    rules: tuple[RuleSpec, ...] = ()
    workload: Workload = field(default_factory=Workload)
    training: TrainingSpec | None = None
    quantization: QuantSpec | None = None
    overhead: Mapping[str, int | float] = field(default_factory=_empty)
    path: Path | None = None
    expert_placement: str = "separate"  # mesh.expert_placement (EXPERT_PLACEMENTS)

    @property
    def mode(self) -> str:
        """``training`` when a training step is planned, else ``inference``."""
        return "inference" if self.training is None else "training"

    @property
    def pipeline(self) -> LayoutOptions:
        """Alias of :attr:`layout` (the ``pipeline:`` and ``layout:`` sections both feed it)."""
        return self.layout


__all__ = [
    "DEFAULT_GROUP_SIZE",
    "DEFAULT_KEEP_16BIT",
    "FP8_BLOCK",
    "FP8_SCALING",
    "LORA_TARGETS",
    "OFFLOAD",
    "PIPELINE_SCHEDULES",
    "QUANT_METHODS",
    "RECOMPUTE",
    "UNEVEN",
    "VOCAB_PADDING",
    "HardwareSpec",
    "Manifest",
    "ModelSpec",
    "QuantOverride",
    "QuantSpec",
    "TrainingSpec",
    "Workload",
]
