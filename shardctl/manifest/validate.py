"""YAML tree → :class:`Manifest`: every key checked, every problem collected with its key path
and line, then raised as one :class:`ManifestError` (exit 3).

Checks here need only the manifest. Checks that need the model (``tp`` divides the heads,
``pp`` ≤ layers, experts divisible by ``ep``) belong to the layout engine, which has the model.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from pathlib import Path
from types import MappingProxyType

from shardctl.errors import InvalidInputError
from shardctl.layout.types import AXES, LayoutOptions, Mesh
from shardctl.manifest import model as m
from shardctl.manifest.fields import (
    INLINE_POSITIVE_INTS,
    NULLS,
    SECTION_KEYS,
    Problems,
    enum,
    read_axis,
    read_dtype,
    section_map,
    unknown,
)
from shardctl.manifest.limits import MAX_AXIS, MAX_DIM
from shardctl.manifest.model_keys import known_keys, unknown_key_hint
from shardctl.manifest.validate_rules import read_rules
from shardctl.manifest.validate_training import (
    read_overhead,
    read_quantization,
    read_training,
    read_workload,
)
from shardctl.manifest.values import (
    Invalid,
    describe,
    did_you_mean,
    read_bool,
    read_count,
    read_int,
    read_rate,
    read_size,
    read_str,
    to_plain,
)
from shardctl.manifest.yamlstrict import Map, Node, Scalar, Seq
from shardctl.plan.memory.hardware import GpuPreset, HardwareSpec, gpu_names, gpu_preset


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


# ----------------------------------------------------------------------------- sections
def _model(node: Node | None, base_dir: Path, problems: Problems, root_line: int) -> m.ModelSpec:
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
    dtype = problems.get(node, "dtype", "model", read_dtype, None)
    if sources:
        for key in extra:
            problems.add(unknown(key, f"model.{key}", node.key_lines[key], SECTION_KEYS["model"]))
        return m.ModelSpec(
            config=problems.get(node, "config", "model", _path_reader(base_dir, False), None),
            checkpoint=problems.get(
                node, "checkpoint", "model", _path_reader(base_dir, True), None
            ),
            parameters=problems.get(node, "parameters", "model", read_count, None),
            dtype=dtype,
        )
    return m.ModelSpec(inline_config=MappingProxyType(_inline(node, extra, problems)), dtype=dtype)


def _inline(node: Map, keys: list[str], problems: Problems) -> dict[str, object]:
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
    model_type = problems.get(node, "model_type", "model", read_str, "")
    known = known_keys(model_type)
    for key in keys:
        if known is not None and key in known:
            continue  # rope_parameters is a config key, not a typo of 'parameters'
        typo = _near_manifest_key(key)
        if key not in INLINE_POSITIVE_INTS and typo is not None:
            problems.add(Invalid(f"model.{key}", "unknown key", node.key_lines[key], typo))
        elif known is not None and key not in known:
            problems.add(
                Invalid(
                    f"model.{key}",
                    f"unknown {model_type} config key",
                    node.key_lines[key],
                    unknown_key_hint(model_type, key),
                )
            )
    for key in INLINE_POSITIVE_INTS:
        value = node.entries.get(key)
        if not (isinstance(value, Scalar) and value.plain and value.text in NULLS):
            problems.get(node, key, "model", _dim, 0)  # null = HF's "derive it"
    out: dict[str, object] = {}
    for key in keys:
        try:
            out[key] = to_plain(node.entries[key], f"model.{key}")
        except Invalid as problem:
            problems.add(problem)
    return out


def _dim(node: Node, path: str) -> int:
    """A model dimension: real ones stay far below 2**32 (Llama 4's 10M-token context)."""
    return read_int(node, path, minimum=1, maximum=MAX_DIM)


def _near_manifest_key(key: str) -> str | None:
    """A typo of a manifest key (``dtyp``) would otherwise pass as an inline config field."""
    close = difflib.get_close_matches(key, SECTION_KEYS["model"], n=1, cutoff=0.8)
    return f"did you mean {close[0]!r}?" if close and close[0] != key else None


def _mesh(section: Map | None, problems: Problems) -> Mesh:
    if section is None:
        return Mesh()
    problems.keys(section, "mesh")
    return Mesh(**{a: problems.get(section, a, "mesh", read_axis, 1) for a in AXES})


def _context_parallel(section: Map | None, problems: Problems) -> int:
    """``mesh.cp``: context-parallel ranks per model replica (training only)."""
    if section is None:
        return 1
    cp: int = problems.get(section, "cp", "mesh", read_axis, 1)
    return cp


def _expert_placement(section: Map | None, problems: Problems) -> str:
    if section is None:
        return "separate"
    placement: str = problems.get(
        section, "expert_placement", "mesh", enum(m.EXPERT_PLACEMENTS), "separate"
    )
    return placement


def _hardware(section: Map | None, problems: Problems) -> HardwareSpec:
    """The memory model's :class:`HardwareSpec`; a ``gpu`` preset fills what is not given."""
    if section is None:
        return HardwareSpec()
    problems.keys(section, "hardware")
    get = problems.get
    preset = get(section, "gpu", "hardware", _gpu, None)
    memory = get(
        section, "device_memory", "hardware", lambda n, p: read_size(n, p, minimum=2**20), None
    )
    intra: float | None = get(section, "intra_node_bandwidth", "hardware", read_rate, None)
    inter: float | None = get(section, "inter_node_bandwidth", "hardware", read_rate, None)
    default = HardwareSpec()
    if preset is not None:
        memory = preset.memory if memory is None else memory
        intra = preset.intra_node_bandwidth if intra is None else intra
        inter = preset.inter_node_bandwidth if inter is None else inter
    return HardwareSpec(
        device_memory=memory,
        gpus_per_node=get(
            section, "gpus_per_node", "hardware", lambda n, p: read_int(n, p, maximum=1024), 8
        ),
        nodes=get(section, "nodes", "hardware", read_axis, 1),
        gpu=preset.name if preset is not None else None,
        intra_node_bandwidth=default.intra_node_bandwidth if intra is None else intra,
        inter_node_bandwidth=default.inter_node_bandwidth if inter is None else inter,
        allow_tp_across_nodes=get(section, "allow_tp_across_nodes", "hardware", read_bool, False),
    )


def _gpu(node: Node, path: str) -> GpuPreset:
    text = read_str(node, path)
    try:
        return gpu_preset(text)
    except InvalidInputError:
        raise Invalid(
            path,
            f"unknown GPU {text!r}",
            node.line,
            f"{did_you_mean(text.lower(), gpu_names()) or ''} known: "
            f"{', '.join(gpu_names())}; or give hardware.device_memory".strip(),
        ) from None


def _layout(pipeline: Map | None, layout: Map | None, pp: int, problems: Problems) -> LayoutOptions:
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
                pipeline, "convention", "pipeline", enum(m.PIPELINE_CONVENTIONS), "even"
            ),
            layers_per_stage=per_stage,
        )
    if layout is not None:
        problems.keys(layout, "layout")
        options = LayoutOptions(
            pipeline=options.pipeline,
            layers_per_stage=options.layers_per_stage,
            vocab_padding=problems.get(
                layout, "vocab_padding", "layout", enum(m.VOCAB_PADDING), "tp"
            ),
            uneven=problems.get(layout, "uneven", "layout", enum(m.UNEVEN), "error"),
        )
    return options


def _layers_per_stage(node: Node, path: str) -> tuple[int, ...] | None:
    if isinstance(node, Scalar) and node.plain and node.text in NULLS:
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


# ----------------------------------------------------------------------------- entry point
def build_manifest(
    root: Map, *, base_dir: Path, source: str, path: Path | None = None
) -> m.Manifest:
    problems = Problems()
    problems.keys(root, "")
    sections = {
        name: section_map(root, name, problems)
        for name in SECTION_KEYS[""]
        if name not in ("model", "rules")
    }
    model = _model(root.entries.get("model"), base_dir, problems, root.line)
    mesh = _mesh(sections["mesh"], problems)
    training_given = "training" in root.entries
    keys = read_workload(sections["workload"], training_given, problems)
    cp = _context_parallel(sections["mesh"], problems)
    training = (
        read_training(sections["training"], keys, mesh.dp, problems, cp=cp)
        if keys.mode == "training"
        else None
    )
    if cp > 1 and training is None:
        problems.add(
            Invalid(
                "mesh.cp",
                f"context parallelism (cp {cp}) is planned for training; the workload is "
                f"{keys.mode}",
                sections["mesh"].key_lines.get("cp") if sections["mesh"] else None,
                "drop mesh.cp, or plan a training workload",
            )
        )
    manifest = m.Manifest(
        model=model,
        mesh=mesh,
        hardware=_hardware(sections["hardware"], problems),
        layout=_layout(sections["pipeline"], sections["layout"], mesh.pp, problems),
        rules=read_rules(root.entries.get("rules"), problems),
        workload=keys.workload,
        training=training,
        quantization=read_quantization(sections["quantization"], problems),
        overhead=MappingProxyType(read_overhead(sections["overhead"], problems)),
        path=path,
        expert_placement=_expert_placement(sections["mesh"], problems),
    )
    problems.raise_if_any(source)
    return manifest
