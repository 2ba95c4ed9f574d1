"""The memory model of ``shardctl plan``: KV cache, activations, training states,
quantization, MoE, runtime overhead and communication, per rank. Sources: docs/memory-model.md.

No torch here: everything is closed-form arithmetic on the model's dimensions.
"""

from shardctl.plan.memory.estimate import COMPONENTS, MemoryPlan, RankMemory, estimate
from shardctl.plan.memory.hardware import GPUS, LINKS, HardwareSpec
from shardctl.plan.memory.overhead import OverheadSpec
from shardctl.plan.memory.spec import (
    QuantOverride,
    QuantSpec,
    TrainingSpec,
    Workload,
    zero_stage,
)

__all__ = [
    "COMPONENTS",
    "GPUS",
    "LINKS",
    "HardwareSpec",
    "MemoryPlan",
    "OverheadSpec",
    "QuantOverride",
    "QuantSpec",
    "RankMemory",
    "TrainingSpec",
    "Workload",
    "estimate",
    "zero_stage",
]
