"""Shared pieces of validation: the key lists of every section, the problem collector, and
the field readers more than one section uses."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from shardctl.dtypes import normalize_dtype
from shardctl.errors import InvalidInputError, ManifestError
from shardctl.manifest import model as m
from shardctl.manifest.limits import MAX_AXIS
from shardctl.manifest.values import Invalid, describe, did_you_mean, read_enum, read_int, read_str
from shardctl.manifest.yamlstrict import Map, Node, Scalar

T = TypeVar("T")

MAX_REPORTED = 6
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2")

# The keys of every section: the validator's and the JSON Schema's single list.
SECTION_KEYS: dict[str, tuple[str, ...]] = {
    "": (
        "model",
        "mesh",
        "hardware",
        "pipeline",
        "layout",
        "rules",
        "workload",
        "training",
        "quantization",
        "overhead",
    ),
    "model": ("config", "checkpoint", "parameters", "dtype"),
    "mesh": ("pp", "dp", "tp", "ep", "cp", "expert_placement"),
    "hardware": (
        "device_memory",
        "gpus_per_node",
        "nodes",
        "gpu",
        "intra_node_bandwidth",
        "inter_node_bandwidth",
        "allow_tp_across_nodes",
    ),
    "pipeline": ("convention", "layers_per_stage"),
    "layout": ("vocab_padding", "uneven"),
    "rules[]": ("match", "tp", "parts", "heads", "stage", "expert", "groups"),
    "workload": (
        "mode",
        "batch_size",
        "sequence_length",
        "kv_cache_dtype",
        "gpu_memory_utilization",
        "flash_attention",
        "engine",
        "max_num_seqs",
        "max_num_batched_tokens",
        "block_size",
        "non_torch_memory",
        "cuda_graph_memory",
        "mem_fraction_static",
        "sglang_version",
        "vllm_version",
        "free_gpu_memory_fraction",
        "tokens_per_block",
        "mm_encoder_tp_mode",
        "limit_mm_per_prompt",
        "micro_batch_size",
        "gradient_accumulation_steps",
    ),
    "training": (
        "optimizer",
        "zero",
        "offload_optimizer",
        "offload_params",
        "recompute",
        "sequence_parallel",
        "master_weights",
        "grad_dtype",
        "pipeline_schedule",
        "virtual_stages",
        "recompute_layers",
        "num_microbatches",
        "lora_rank",
        "lora_targets",
    ),
    "quantization": (
        "method",
        "group_size",
        "double_quant",
        "fp8_scaling",
        "keep_16bit",
        "overrides",
    ),
    "quantization.overrides[]": ("match", "method", "dtype", "group_size", "fp8_scaling"),
    "overhead": (*m.OVERHEAD_SIZES, *m.OVERHEAD_FRACTIONS),
}

# Inline HF config fields that must be positive integers when present (checked here because
# only here do we still know their line). Everything else is passed through as data.
INLINE_POSITIVE_INTS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "vocab_size",
    "head_dim",
    "max_position_embeddings",
    "num_local_experts",
    "num_experts_per_tok",
    "n_embd",
    "n_layer",
    "n_head",
    "n_positions",
    "n_inner",
)

NULLS = ("", "~", "null", "Null", "NULL")


class Problems:
    """Collects :class:`Invalid` so one run reports every broken key, not just the first."""

    def __init__(self) -> None:
        self.items: list[Invalid] = []

    def add(self, problem: Invalid) -> None:
        self.items.append(problem)

    def get(
        self, section: Map, key: str, path: str, reader: Callable[[Node, str], T], default: T
    ) -> T:
        node = section.entries.get(key)
        if node is None:
            return default
        try:
            return reader(node, join(path, key))
        except Invalid as problem:
            self.add(problem)
            return default

    def keys(self, section: Map, path: str, spec: str | None = None) -> None:
        allowed = SECTION_KEYS[path if spec is None else spec]
        for key in section.entries:
            if key not in allowed:
                self.add(unknown(key, join(path, key), section.key_lines[key], allowed))

    def raise_if_any(self, source: str) -> None:
        if not self.items:
            return
        ordered = sorted(self.items, key=lambda p: p.line if p.line is not None else 1 << 30)
        shown = [p.render() for p in ordered[:MAX_REPORTED]]
        more = len(self.items) - len(shown)
        if more:
            shown.append(f"and {more} more")
        raise ManifestError(" | ".join(shown), where=source)


def join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def unknown(key: str, path: str, line: int, allowed: tuple[str, ...]) -> Invalid:
    hint = did_you_mean(key, allowed)
    homes = [s for s, keys in SECTION_KEYS.items() if key in keys and s not in ("", "rules[]")]
    if homes and not hint:
        hint = f"{key!r} belongs under '{homes[0]}:'"
    valid = f"valid keys: {', '.join(allowed)}"
    return Invalid(path, "unknown key", line, f"{hint}; {valid}" if hint else valid)


def section_map(root: Map, name: str, problems: Problems) -> Map | None:
    """A top-level section as a mapping; an explicit ``null`` is an empty section."""
    node = root.entries.get(name)
    if node is None:
        return None
    if isinstance(node, Scalar) and node.plain and node.text in NULLS:
        return Map({}, {}, node.line)
    if not isinstance(node, Map):
        problems.add(Invalid(name, f"expected a mapping, got {describe(node)}", node.line))
        return None
    return node


def read_dtype(node: Node, path: str) -> str:
    text = read_str(node, path)
    try:
        code = normalize_dtype(text)
    except InvalidInputError:
        raise Invalid(
            path, f"unknown dtype {text!r}", node.line, "use bfloat16, float16, float32 or fp8"
        ) from None
    if code not in FLOAT_DTYPES:
        raise Invalid(
            path,
            f"expected a floating-point dtype, got {text!r} ({code})",
            node.line,
            "use bfloat16, float16, float32 or fp8",
        )
    return code


def read_positive(node: Node, path: str) -> int:
    return read_int(node, path, minimum=1)


def read_axis(node: Node, path: str) -> int:
    return read_int(node, path, minimum=1, maximum=MAX_AXIS)


def enum(choices: tuple[str, ...]) -> Callable[[Node, str], str]:
    return lambda node, path: read_enum(node, path, choices)
