"""The manifest as frozen, typed data. Validation lives in :mod:`shardctl.manifest.validate`.

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

from shardctl.layout.types import LayoutOptions, Mesh, RuleSpec
from shardctl.manifest.values import thaw
from shardctl.plan.memory.hardware import HardwareSpec

# Choices, shared by the validator and the JSON Schema (one source of truth).
PIPELINE_CONVENTIONS = ("even", "vllm", "tensorrt-llm", "megatron")
VOCAB_PADDING = ("none", "tp", "megatron")
UNEVEN = ("error", "chunk")
MODES = ("inference", "training")
OPTIMIZERS = ("adamw", "adam", "sgd", "adafactor", "lion", "adamw-8bit")
ZERO_FSDP_NAMES: dict[str, int] = {
    "NO_SHARD": 0,
    "SHARD_GRAD_OP": 2,
    "FULL_SHARD": 3,
    "HYBRID_SHARD": 3,
}
OFFLOAD = ("none", "cpu", "nvme")
RECOMPUTE = ("none", "selective", "full")
PIPELINE_SCHEDULES = ("1f1b", "gpipe")
QUANT_METHODS = ("none", "int8", "int4", "nf4", "fp8", "mxfp4", "nvfp4")
FP8_SCALING = ("tensor", "block")
RULE_HEADS = ("q", "kv")
RULE_STAGES = ("first", "last", "all")
RULE_PART_NAMES = ("q", "kv", "intermediate")
RULE_TP_WORDS = ("R", "colwise", "rowwise", "vocab")

# Group/block size per quantization method when the manifest gives none; 0 = no groups (one
# scale per output channel or per tensor). MXFP4 (OCP MX spec) and NVFP4 fix theirs by
# definition; int4 = GPTQ/AWQ's usual 128; nf4 = bitsandbytes' 64-element blocks; int8 =
# LLM.int8()'s per-channel scales; fp8 = one scale per tensor, or DeepSeek-V3's 128x128 tiles
# with `fp8_scaling: block`.
DEFAULT_GROUP_SIZE: dict[str, int] = {
    "int8": 0,
    "int4": 128,
    "nf4": 64,
    "fp8": 0,
    "mxfp4": 32,
    "nvfp4": 16,
}
FP8_BLOCK = 128
FIXED_GROUP_SIZE = {"mxfp4": 32, "nvfp4": 16}

# Tensors kept in 16-bit when quantizing, unless `keep_16bit` says otherwise: embeddings
# (llama-style `embed_tokens`, GPT-2 `wte`/`wpe`), the LM head, and every norm (`*norm*` covers
# `input_layernorm`, `model.norm`; `*.ln_*` covers GPT-2's `ln_1`, `ln_f`). This is what
# GPTQ/AWQ/bitsandbytes do: they quantize the decoder's Linear weights only.
DEFAULT_KEEP_16BIT: tuple[str, ...] = (
    "*embed_tokens.*",
    "*.wte.*",
    "*.wpe.*",
    "lm_head.*",
    "*norm*",
    "*.ln_*",
)

# `overhead:` names the memory model knows, and whether each is bytes or a fraction.
OVERHEAD_SIZES = ("cuda_context", "nccl_buffers", "framework", "dispatch_buffers", "reserved")
OVERHEAD_FRACTIONS = ("fragmentation",)


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
class WorkloadSpec:
    """What runs: serving (``inference``) or ``training``.

    ``sequence_length`` 0 = no KV cache and no activations (weights only). ``kv_cache_dtype``
    None = the model's dtype. ``micro_batch_size`` None = ``batch_size``.
    ``gpu_memory_utilization`` is vLLM's: the fraction of device memory the engine may use.
    """

    mode: str = "inference"
    batch_size: int = 1
    sequence_length: int = 0
    kv_cache_dtype: str | None = None
    gpu_memory_utilization: float = 0.9
    flash_attention: bool = True
    micro_batch_size: int | None = None
    gradient_accumulation_steps: int = 1


@dataclass(frozen=True)
class TrainingSpec:
    """Training states. ``zero`` 0–3 over ``dp`` (FSDP names accepted in the manifest).

    ``grad_dtype`` None = the model's dtype (``F32`` for fp32 gradients). ``num_microbatches``
    None = ``gradient_accumulation_steps`` (one pipeline flush per optimizer step).
    """

    optimizer: str = "adamw"
    zero: int = 0
    offload_optimizer: str = "none"
    offload_params: str = "none"
    recompute: str = "none"
    sequence_parallel: bool = False
    master_weights: bool = True
    grad_dtype: str | None = None
    pipeline_schedule: str = "1f1b"
    num_microbatches: int | None = None


@dataclass(frozen=True)
class QuantSpec:
    """Quantized weights. ``group_size`` is resolved per method (:data:`DEFAULT_GROUP_SIZE`);
    ``fp8_scaling`` matters for ``fp8`` only; ``keep_16bit`` are fqn globs left unquantized."""

    method: str
    group_size: int
    double_quant: bool = False
    fp8_scaling: str = "tensor"
    keep_16bit: tuple[str, ...] = DEFAULT_KEEP_16BIT


@dataclass(frozen=True)
class Manifest:
    """A validated manifest. ``training`` is None exactly when ``workload.mode`` is inference;
    ``quantization`` is None when absent or ``method: none``; ``path`` is the file it came from."""

    model: ModelSpec
    mesh: Mesh = field(default_factory=Mesh)
    hardware: HardwareSpec = field(default_factory=HardwareSpec)
    layout: LayoutOptions = field(default_factory=LayoutOptions)
    rules: tuple[RuleSpec, ...] = ()
    workload: WorkloadSpec = field(default_factory=WorkloadSpec)
    training: TrainingSpec | None = None
    quantization: QuantSpec | None = None
    overhead: Mapping[str, int | float] = field(default_factory=_empty)
    path: Path | None = None

    @property
    def pipeline(self) -> LayoutOptions:
        """Alias of :attr:`layout` (the ``pipeline:`` and ``layout:`` sections both feed it)."""
        return self.layout
