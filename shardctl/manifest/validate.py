"""YAML tree → :class:`Manifest`: every key checked, every problem collected with its key path
and line, then raised as one :class:`ManifestError` (exit 3).

Checks here need only the manifest. Checks that need the model (``tp`` divides the heads,
``pp`` ≤ layers, experts divisible by ``ep``) belong to the layout engine, which has the model.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable
from pathlib import Path
from types import MappingProxyType
from typing import TypeVar

from shardctl.dtypes import normalize_dtype
from shardctl.errors import InvalidInputError, ManifestError
from shardctl.layout.types import AXES, LayoutOptions, Mesh, RuleSpec
from shardctl.manifest import model as m
from shardctl.manifest.presets import gpu_names, gpu_preset
from shardctl.manifest.values import (
    Invalid,
    describe,
    did_you_mean,
    read_bool,
    read_count,
    read_enum,
    read_float,
    read_int,
    read_rate,
    read_size,
    read_str,
    to_plain,
)
from shardctl.manifest.yamlstrict import Map, Node, Scalar, Seq

T = TypeVar("T")

MAX_REPORTED = 6
MAX_AXIS = 2**20
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
    "mesh": ("pp", "dp", "tp", "ep"),
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
    "rules[]": ("match", "tp", "parts", "heads", "stage", "expert"),
    "workload": (
        "mode",
        "batch_size",
        "sequence_length",
        "kv_cache_dtype",
        "gpu_memory_utilization",
        "flash_attention",
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
        "num_microbatches",
    ),
    "quantization": ("method", "group_size", "double_quant", "fp8_scaling", "keep_16bit"),
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

_NULLS = ("", "~", "null", "Null", "NULL")
_SHARD = re.compile(r"(?:S|Shard)\(\s*([0-9]+)\s*\)")


class _Problems:
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
            return reader(node, _join(path, key))
        except Invalid as problem:
            self.add(problem)
            return default

    def keys(self, section: Map, path: str, spec: str | None = None) -> None:
        allowed = SECTION_KEYS[path if spec is None else spec]
        for key in section.entries:
            if key not in allowed:
                self.add(_unknown(key, _join(path, key), section.key_lines[key], allowed))

    def raise_if_any(self, source: str) -> None:
        if not self.items:
            return
        ordered = sorted(self.items, key=lambda p: p.line if p.line is not None else 1 << 30)
        shown = [p.render() for p in ordered[:MAX_REPORTED]]
        more = len(self.items) - len(shown)
        if more:
            shown.append(f"and {more} more")
        raise ManifestError(" | ".join(shown), where=source)


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _unknown(key: str, path: str, line: int, allowed: tuple[str, ...]) -> Invalid:
    hint = did_you_mean(key, allowed)
    homes = [s for s, keys in SECTION_KEYS.items() if key in keys and s not in ("", "rules[]")]
    if homes and not hint:
        hint = f"{key!r} belongs under '{homes[0]}:'"
    valid = f"valid keys: {', '.join(allowed)}"
    return Invalid(path, "unknown key", line, f"{hint}; {valid}" if hint else valid)


def _section(root: Map, name: str, problems: _Problems) -> Map | None:
    """A top-level section as a mapping; an explicit ``null`` is an empty section."""
    node = root.entries.get(name)
    if node is None:
        return None
    if isinstance(node, Scalar) and node.plain and node.text in _NULLS:
        return Map({}, {}, node.line)
    if not isinstance(node, Map):
        problems.add(Invalid(name, f"expected a mapping, got {describe(node)}", node.line))
        return None
    return node


# ----------------------------------------------------------------------------- readers
def _dtype(node: Node, path: str) -> str:
    text = read_str(node, path)
    try:
        code = normalize_dtype(text)
    except InvalidInputError as exc:
        del exc
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


def _positive(node: Node, path: str) -> int:
    return read_int(node, path, minimum=1)


def _axis(node: Node, path: str) -> int:
    return read_int(node, path, minimum=1, maximum=MAX_AXIS)


def _path_reader(base_dir: Path, want_dir: bool) -> Callable[[Node, str], Path]:
    def read(node: Node, path: str) -> Path:
        text = read_str(node, path)
        resolved = (base_dir / Path(text).expanduser()).resolve()
        kind = "directory" if want_dir else "file"
        if not resolved.exists():
            raise Invalid(
                path,
                f"no such {kind}: {str(resolved)!r}",
                node.line,
                "relative paths are resolved against the manifest's folder",
            )
        if want_dir != resolved.is_dir():
            raise Invalid(path, f"expected a {kind}, got {str(resolved)!r}", node.line)
        return resolved

    return read


def _enum(choices: tuple[str, ...]) -> Callable[[Node, str], str]:
    return lambda node, path: read_enum(node, path, choices)


# ----------------------------------------------------------------------------- sections
def _model(node: Node | None, base_dir: Path, problems: _Problems, root_line: int) -> m.ModelSpec:
    if node is None:
        problems.add(
            Invalid(
                "model",
                "missing required section",
                root_line,
                "give model.config, model.checkpoint, model.parameters or inline "
                "config fields (model_type: llama, hidden_size: ...)",
            )
        )
        return m.ModelSpec()
    if not isinstance(node, Map):
        problems.add(Invalid("model", f"expected a mapping, got {describe(node)}", node.line))
        return m.ModelSpec()
    sources = [k for k in ("config", "checkpoint", "parameters") if k in node.entries]
    extra = [k for k in node.entries if k not in SECTION_KEYS["model"]]
    if len(sources) > 1:
        problems.add(
            Invalid(
                "model",
                f"give exactly one of config, checkpoint, parameters; got {' and '.join(sources)}",
                node.line,
            )
        )
    dtype = problems.get(node, "dtype", "model", _dtype, None)
    if sources:
        for key in extra:
            problems.add(_unknown(key, f"model.{key}", node.key_lines[key], SECTION_KEYS["model"]))
        return m.ModelSpec(
            config=problems.get(node, "config", "model", _path_reader(base_dir, False), None),
            checkpoint=problems.get(
                node, "checkpoint", "model", _path_reader(base_dir, True), None
            ),
            parameters=problems.get(node, "parameters", "model", read_count, None),
            dtype=dtype,
        )
    return m.ModelSpec(inline_config=MappingProxyType(_inline(node, extra, problems)), dtype=dtype)


def _inline(node: Map, keys: list[str], problems: _Problems) -> dict[str, object]:
    """Inline HF config fields: ``model_type`` required, dims positive, the rest as data."""
    if "model_type" not in node.entries:
        near = [k for k in keys if did_you_mean(k, SECTION_KEYS["model"])]
        hint = (
            f"{near[0]!r}: {did_you_mean(near[0], SECTION_KEYS['model'])}"
            if near
            else "give model.config, model.checkpoint, model.parameters, or inline config fields "
            "with model_type"
        )
        problems.add(
            Invalid(
                "model",
                "no model source: missing model_type for inline config fields",
                node.line,
                hint,
            )
        )
        return {}
    problems.get(node, "model_type", "model", read_str, "")
    for key in keys:
        typo = _near_manifest_key(key)
        if key not in INLINE_POSITIVE_INTS and typo is not None:
            problems.add(Invalid(f"model.{key}", "unknown key", node.key_lines[key], typo))
    for key in INLINE_POSITIVE_INTS:
        value = node.entries.get(key)
        if not (isinstance(value, Scalar) and value.plain and value.text in _NULLS):
            problems.get(node, key, "model", _positive, 0)  # null = HF's "derive it"
    out: dict[str, object] = {}
    for key in keys:
        try:
            out[key] = to_plain(node.entries[key], f"model.{key}")
        except Invalid as problem:
            problems.add(problem)
    return out


def _near_manifest_key(key: str) -> str | None:
    """A typo of a manifest key (``dtyp``) would otherwise pass as an inline config field."""
    close = difflib.get_close_matches(key, SECTION_KEYS["model"], n=1, cutoff=0.8)
    return f"did you mean {close[0]!r}?" if close and close[0] != key else None


def _mesh(section: Map | None, problems: _Problems) -> Mesh:
    if section is None:
        return Mesh()
    problems.keys(section, "mesh")
    return Mesh(**{a: problems.get(section, a, "mesh", _axis, 1) for a in AXES})


def _hardware(section: Map | None, problems: _Problems) -> m.HardwareSpec:
    if section is None:
        return m.HardwareSpec()
    problems.keys(section, "hardware")
    get = problems.get
    gpu = get(section, "gpu", "hardware", _gpu, None)
    preset = gpu_preset(gpu) if gpu is not None else None
    memory = get(
        section, "device_memory", "hardware", lambda n, p: read_size(n, p, minimum=2**20), None
    )
    intra = get(section, "intra_node_bandwidth", "hardware", read_rate, None)
    inter = get(section, "inter_node_bandwidth", "hardware", read_rate, None)
    return m.HardwareSpec(
        device_memory=memory if memory is not None or preset is None else preset.device_memory,
        gpus_per_node=get(
            section, "gpus_per_node", "hardware", lambda n, p: read_int(n, p, maximum=1024), 8
        ),
        nodes=get(section, "nodes", "hardware", _axis, 1),
        gpu=preset.name if preset is not None else None,
        intra_node_bandwidth=intra
        if intra is not None or preset is None
        else preset.intra_node_bandwidth,
        inter_node_bandwidth=inter
        if inter is not None or preset is None
        else preset.inter_node_bandwidth,
        allow_tp_across_nodes=get(section, "allow_tp_across_nodes", "hardware", read_bool, False),
    )


def _gpu(node: Node, path: str) -> str:
    text = read_str(node, path)
    if gpu_preset(text) is None:
        raise Invalid(
            path,
            f"unknown GPU {text!r}",
            node.line,
            f"{did_you_mean(text.lower(), gpu_names()) or ''} known: "
            f"{', '.join(gpu_names())}; or give hardware.device_memory".strip(),
        )
    return text


def _layout(
    pipeline: Map | None, layout: Map | None, pp: int, problems: _Problems
) -> LayoutOptions:
    options = LayoutOptions()
    if pipeline is not None:
        problems.keys(pipeline, "pipeline")
        per_stage = problems.get(pipeline, "layers_per_stage", "pipeline", _layers_per_stage, None)
        if per_stage is not None and len(per_stage) != pp:
            problems.add(
                Invalid(
                    "pipeline.layers_per_stage",
                    f"lists {len(per_stage)} stages but mesh.pp is {pp}",
                    pipeline.entries["layers_per_stage"].line,
                    "give one layer count per stage",
                )
            )
        options = LayoutOptions(
            pipeline=problems.get(
                pipeline, "convention", "pipeline", _enum(m.PIPELINE_CONVENTIONS), "even"
            ),
            layers_per_stage=per_stage,
        )
    if layout is not None:
        problems.keys(layout, "layout")
        options = LayoutOptions(
            pipeline=options.pipeline,
            layers_per_stage=options.layers_per_stage,
            vocab_padding=problems.get(
                layout, "vocab_padding", "layout", _enum(m.VOCAB_PADDING), "tp"
            ),
            uneven=problems.get(layout, "uneven", "layout", _enum(m.UNEVEN), "error"),
        )
    return options


def _layers_per_stage(node: Node, path: str) -> tuple[int, ...] | None:
    if isinstance(node, Scalar) and node.plain and node.text in _NULLS:
        return None
    if not isinstance(node, Seq) or not node.items:
        raise Invalid(path, f"expected a list of layer counts, got {describe(node)}", node.line)
    counts = tuple(
        read_int(item, f"{path}[{i}]", minimum=0, maximum=MAX_AXIS)
        for i, item in enumerate(node.items)
    )
    if sum(counts) == 0:
        raise Invalid(path, "no layers in any stage", node.line)
    return counts


def _rules(node: Node | None, problems: _Problems) -> tuple[RuleSpec, ...]:
    if node is None or (isinstance(node, Scalar) and node.plain and node.text in _NULLS):
        return ()
    if not isinstance(node, Seq):
        problems.add(Invalid("rules", f"expected a list of rules, got {describe(node)}", node.line))
        return ()
    rules = []
    for i, item in enumerate(node.items):
        try:
            rules.append(_rule(item, f"rules[{i}]", problems))
        except Invalid as problem:
            problems.add(problem)
    return tuple(rules)


def _rule(node: Node, path: str, problems: _Problems) -> RuleSpec:
    if not isinstance(node, Map):
        raise Invalid(
            path,
            f"expected a mapping like {{match: ..., tp: S(0)}}, got {describe(node)}",
            node.line,
        )
    problems.keys(node, path, "rules[]")
    if "match" not in node.entries:
        raise Invalid(path, "missing required key 'match' (an fqn glob)", node.line)
    effects = [k for k in SECTION_KEYS["rules[]"] if k != "match" and k in node.entries]
    if not effects:
        raise Invalid(
            path, "a rule needs at least one of tp, parts, heads, stage, expert", node.line
        )
    tp = problems.get(node, "tp", path, _placement, None)
    parts = problems.get(node, "parts", path, _parts, None)
    if parts is not None and tp == "R":
        problems.add(
            Invalid(
                f"{path}.parts",
                "fused parts need a sharded tp placement, got R",
                node.entries["parts"].line,
            )
        )
    return RuleSpec(
        match=read_str(node.entries["match"], f"{path}.match"),
        tp=tp,
        parts=parts,
        heads=problems.get(node, "heads", path, _enum(m.RULE_HEADS), None),
        stage=problems.get(node, "stage", path, _enum(m.RULE_STAGES), None),
        expert=problems.get(node, "expert", path, read_bool, False),
    )


def _placement(node: Node, path: str) -> str:
    """``S(0)``/``Shard(0)`` → ``S(0)``; ``R``/``Replicate()`` → ``R``; sugar kept as written."""
    text = read_str(node, path).strip()
    shard = _SHARD.fullmatch(text)
    if shard is not None:
        return f"S({int(shard.group(1))})"
    if text in ("R", "Replicate()", "Replicate"):
        return "R"
    if text in m.RULE_TP_WORDS:
        return text
    raise Invalid(
        path,
        f"expected S(<dim>), R, colwise, rowwise or vocab; got {describe(node)}",
        node.line,
        did_you_mean(text, m.RULE_TP_WORDS),
    )


def _parts(node: Node, path: str) -> tuple[int | str, ...]:
    if not isinstance(node, Seq) or len(node.items) < 2:
        raise Invalid(
            path,
            f"expected a list of at least two part sizes, got {describe(node)}",
            node.line,
            "e.g. [q, kv, kv] or [4096, 1024, 1024]",
        )
    parts: list[int | str] = []
    for i, item in enumerate(node.items):
        where = f"{path}[{i}]"
        if isinstance(item, Scalar) and item.text in m.RULE_PART_NAMES:
            parts.append(item.text)
        else:
            try:
                parts.append(read_int(item, where))
            except Invalid:
                raise Invalid(
                    where,
                    f"expected a positive size or one of "
                    f"{', '.join(m.RULE_PART_NAMES)}; got {describe(item)}",
                    item.line,
                ) from None
    return tuple(parts)


def _workload(section: Map | None, training: bool, problems: _Problems) -> m.WorkloadSpec:
    if section is None:
        return m.WorkloadSpec(mode="training" if training else "inference")
    problems.keys(section, "workload")
    get, path = problems.get, "workload"
    mode = get(section, "mode", path, _enum(m.MODES), "training" if training else "inference")
    if training and mode == "inference":
        problems.add(
            Invalid(
                "workload.mode",
                "is inference but a training: section is given",
                section.entries["mode"].line,
                "set mode: training, or remove the training section",
            )
        )
    batch = get(section, "batch_size", path, _positive, 1)
    return m.WorkloadSpec(
        mode=mode,
        batch_size=batch,
        sequence_length=get(
            section,
            "sequence_length",
            path,
            lambda n, p: read_int(n, p, minimum=0, maximum=2**31),
            0,
        ),
        kv_cache_dtype=get(section, "kv_cache_dtype", path, _kv_dtype, None),
        gpu_memory_utilization=get(
            section,
            "gpu_memory_utilization",
            path,
            lambda n, p: read_float(n, p, minimum=0.0, maximum=1.0, exclusive_minimum=True),
            0.9,
        ),
        flash_attention=get(section, "flash_attention", path, read_bool, True),
        micro_batch_size=get(section, "micro_batch_size", path, _positive, None),
        gradient_accumulation_steps=get(section, "gradient_accumulation_steps", path, _positive, 1),
    )


def _kv_dtype(node: Node, path: str) -> str | None:
    if isinstance(node, Scalar) and node.text == "auto":
        return None  # vLLM's spelling for "same as the model"
    return _dtype(node, path)


def _training(section: Map | None, problems: _Problems) -> m.TrainingSpec:
    if section is None:
        return m.TrainingSpec()
    problems.keys(section, "training")
    get, path = problems.get, "training"
    spec = m.TrainingSpec(
        optimizer=get(section, "optimizer", path, _enum(m.OPTIMIZERS), "adamw"),
        zero=get(section, "zero", path, _zero, 0),
        offload_optimizer=get(section, "offload_optimizer", path, _enum(m.OFFLOAD), "none"),
        offload_params=get(section, "offload_params", path, _enum(m.OFFLOAD), "none"),
        recompute=get(section, "recompute", path, _enum(m.RECOMPUTE), "none"),
        sequence_parallel=get(section, "sequence_parallel", path, read_bool, False),
        master_weights=get(section, "master_weights", path, read_bool, True),
        grad_dtype=get(section, "grad_dtype", path, _dtype, None),
        pipeline_schedule=get(
            section, "pipeline_schedule", path, _enum(m.PIPELINE_SCHEDULES), "1f1b"
        ),
        num_microbatches=get(section, "num_microbatches", path, _positive, None),
    )
    # DeepSpeed: parameter offload and NVMe offload exist only in ZeRO-3 (ZeRO-Infinity);
    # optimizer offload (ZeRO-Offload) needs ZeRO ≥ 1.
    lines = section.key_lines
    if spec.offload_params != "none" and spec.zero != 3:
        problems.add(
            Invalid(
                "training.offload_params",
                f"{spec.offload_params} offload needs zero: 3, got zero: {spec.zero}",
                lines["offload_params"],
                "set zero: 3 (FULL_SHARD) or offload_params: none",
            )
        )
    if spec.offload_optimizer == "nvme" and spec.zero != 3:
        problems.add(
            Invalid(
                "training.offload_optimizer",
                f"nvme offload needs zero: 3, got zero: {spec.zero}",
                lines["offload_optimizer"],
            )
        )
    elif spec.offload_optimizer == "cpu" and spec.zero == 0:
        problems.add(
            Invalid(
                "training.offload_optimizer",
                "cpu offload needs zero: 1, 2 or 3, got zero: 0",
                lines["offload_optimizer"],
            )
        )
    return spec


def _zero(node: Node, path: str) -> int:
    """``0``–``3``, or an FSDP sharding strategy name."""
    if isinstance(node, Scalar) and node.text in m.ZERO_FSDP_NAMES:
        return m.ZERO_FSDP_NAMES[node.text]
    try:
        return read_int(node, path, minimum=0, maximum=3)
    except Invalid:
        names = ", ".join(m.ZERO_FSDP_NAMES)
        raise Invalid(
            path,
            f"expected a ZeRO stage 0-3 or an FSDP strategy ({names}); got {describe(node)}",
            node.line,
        ) from None


def _quantization(section: Map | None, problems: _Problems) -> m.QuantSpec | None:
    if section is None:
        return None
    problems.keys(section, "quantization")
    get, path = problems.get, "quantization"
    if "method" not in section.entries:
        problems.add(
            Invalid(
                path,
                "missing required key 'method'",
                section.line,
                f"one of {', '.join(m.QUANT_METHODS)}",
            )
        )
        return None
    method = get(section, "method", path, _enum(m.QUANT_METHODS), "none")
    if method == "none":
        for key in section.entries:
            if key != "method":
                problems.add(
                    Invalid(
                        f"{path}.{key}", "has no effect with method: none", section.key_lines[key]
                    )
                )
        return None
    default_group = m.DEFAULT_GROUP_SIZE[method]
    group = get(
        section,
        "group_size",
        path,
        lambda n, p: read_int(n, p, minimum=0, maximum=2**20),
        default_group,
    )
    lines = section.key_lines
    if method in ("mxfp4", "nvfp4") and group != default_group:
        problems.add(
            Invalid(
                f"{path}.group_size",
                f"{method} blocks are {default_group} elements by definition, got {group}",
                lines["group_size"],
            )
        )
    double = get(section, "double_quant", path, read_bool, False)
    if double and method != "nf4":
        problems.add(
            Invalid(
                f"{path}.double_quant", f"applies to nf4 only, not {method}", lines["double_quant"]
            )
        )
    scaling = get(section, "fp8_scaling", path, _enum(m.FP8_SCALING), "tensor")
    if "fp8_scaling" in section.entries and method != "fp8":
        problems.add(
            Invalid(
                f"{path}.fp8_scaling", f"applies to fp8 only, not {method}", lines["fp8_scaling"]
            )
        )
    if method == "fp8" and scaling == "block" and "group_size" not in section.entries:
        group = m.FP8_BLOCK
    keep = get(section, "keep_16bit", path, _globs, m.DEFAULT_KEEP_16BIT)
    return m.QuantSpec(
        method=method, group_size=group, double_quant=double, fp8_scaling=scaling, keep_16bit=keep
    )


def _globs(node: Node, path: str) -> tuple[str, ...]:
    if not isinstance(node, Seq):
        raise Invalid(path, f"expected a list of fqn globs, got {describe(node)}", node.line)
    return tuple(read_str(item, f"{path}[{i}]") for i, item in enumerate(node.items))


def _overhead(section: Map | None, problems: _Problems) -> dict[str, int | float]:
    if section is None:
        return {}
    problems.keys(section, "overhead")
    out: dict[str, int | float] = {}
    for key in section.entries:
        if key in m.OVERHEAD_SIZES:
            out[key] = problems.get(section, key, "overhead", read_size, 0)
        elif key in m.OVERHEAD_FRACTIONS:
            out[key] = problems.get(
                section,
                key,
                "overhead",
                lambda n, p: read_float(n, p, minimum=0.0, maximum=0.99),
                0.0,
            )
    return out


# ----------------------------------------------------------------------------- entry point
def build_manifest(
    root: Map, *, base_dir: Path, source: str, path: Path | None = None
) -> m.Manifest:
    problems = _Problems()
    problems.keys(root, "")
    sections = {
        name: _section(root, name, problems)
        for name in SECTION_KEYS[""]
        if name not in ("model", "rules")
    }
    model = _model(root.entries.get("model"), base_dir, problems, root.line)
    mesh = _mesh(sections["mesh"], problems)
    training_given = "training" in root.entries
    workload = _workload(sections["workload"], training_given, problems)
    training = _training(sections["training"], problems) if workload.mode == "training" else None
    manifest = m.Manifest(
        model=model,
        mesh=mesh,
        hardware=_hardware(sections["hardware"], problems),
        layout=_layout(sections["pipeline"], sections["layout"], mesh.pp, problems),
        rules=_rules(root.entries.get("rules"), problems),
        workload=workload,
        training=training,
        quantization=_quantization(sections["quantization"], problems),
        overhead=MappingProxyType(_overhead(sections["overhead"], problems)),
        path=path,
    )
    problems.raise_if_any(source)
    return manifest
