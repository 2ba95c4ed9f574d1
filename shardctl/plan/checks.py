"""What ``plan`` refuses or warns about before pricing a layout (exit 3: refused).

- a workload the model cannot price: a bare ``parameters:`` count, or an architecture shardctl
  has no shapes for, has no KV cache or activation formula; unless the user asked for
  ``workload.mode: weights-only`` (``--weights-only``) the plan is refused, never silently
  reduced to weights;
- a mesh larger than the declared hardware (``pp × dp × ep × tp`` GPUs on ``nodes ×
  gpus_per_node``);
- a tp group spanning nodes is a warning, not a refusal: vLLM (Ray, multi-node) and
  Megatron-LM both run it; their docs advise tp within a node and pp across nodes, because tp's
  all-reduces per layer then run over the inter-node link. ``hardware.allow_tp_across_nodes:
  true`` says it is meant and silences the warning (``plan --search`` skips such layouts unless
  it is set).
"""

from __future__ import annotations

from shardctl.errors import InvalidInputError
from shardctl.layout.types import Mesh
from shardctl.model.archs import SUPPORTED
from shardctl.model.types import ModelInfo, TensorInfo
from shardctl.plan.memory.hardware import HardwareSpec
from shardctl.plan.memory.spec import DEFAULT_KEEP_16BIT, QuantSpec, TrainingSpec, Workload


def tokens_asked(workload: Workload, training: TrainingSpec | None) -> bool:
    """Whether the workload asks for KV cache or activations (tokens to hold)."""
    if workload.only_weights:
        return False
    if training is not None:
        return training.sequence_length > 0
    return workload.sequence_length > 0


def weights_only(model: ModelInfo, workload: Workload, training: TrainingSpec | None) -> bool:
    """The plan counts no KV cache and no activations (asked for, or no tokens given)."""
    return model.dims is None or not tokens_asked(workload, training)


def check_workload(model: ModelInfo, workload: Workload, training: TrainingSpec | None) -> None:
    """Refuse a workload that cannot be priced for ``model`` (see the module docstring)."""
    if model.dims is not None or not tokens_asked(workload, training):
        return
    what = "KV cache and activations" if training is None else "activations"
    if model.source == "parameters":
        why = "model.parameters is a bare count: no layers, heads or hidden size to size them"
    else:
        why = (
            f"architecture {model.architecture!r} has no shape formulas "
            f"(supported: {', '.join(SUPPORTED)})"
        )
    raise InvalidInputError(
        f"cannot estimate the {what} the workload asks for: {why}",
        where="workload",
        hint="give model.config or model.checkpoint of a supported family, or plan the weights "
        "alone on purpose with workload.mode: weights-only (or --weights-only)",
    )


def check_mesh(mesh: Mesh, hardware: HardwareSpec, cp: int = 1) -> tuple[str, ...]:
    """Refuse a mesh with more ranks than the hardware has GPUs; the warnings it deserves.
    ``cp``: context-parallel ranks per model replica (``mesh.cp``, training)."""
    gpus = mesh.world * cp
    if gpus > hardware.gpus:
        axes = f"{mesh.pp}×{mesh.dp}×{mesh.ep}×{mesh.tp}" + (f"×{cp}" if cp > 1 else "")
        raise InvalidInputError(
            f"mesh {mesh}{f' CP{cp}' if cp > 1 else ''} needs {gpus} GPUs "
            f"(pp×dp×ep×tp{'×cp' if cp > 1 else ''} = {axes}) but hardware declares "
            f"{hardware.nodes} node(s) × {hardware.gpus_per_node} GPUs = {hardware.gpus}",
            where="mesh",
            hint=f"lower the degrees to fit {hardware.gpus} GPUs, or set hardware.nodes "
            f"to {-(-gpus // hardware.gpus_per_node)}",
        )
    warnings: list[str] = []
    if mesh.tp > hardware.gpus_per_node and not hardware.allow_tp_across_nodes:
        warnings.append(
            f"tp {mesh.tp} spans nodes of {hardware.gpus_per_node} GPUs: every layer's "
            "all-reduce crosses the inter-node link (vLLM and Megatron run it, slowly); "
            "prefer tp within a node and pp across nodes, or set "
            "hardware.allow_tp_across_nodes: true"
        )
    return tuple(warnings)


def check_keep_16bit(model: ModelInfo, quant: QuantSpec | None) -> None:
    """``quantization.keep_16bit`` globs and ``overrides`` apply to any tensor (fnmatch on full
    tensor names; :mod:`shardctl.plan.memory.precision`), and each must change something:
    a glob that matches no tensor, an override every tensor of which an earlier one already
    takes (first match wins), or a quantizing override that matches only tensors no format
    quantizes (norms, biases, routers) is refused (exit 3), never silently ignored."""
    if quant is None:
        return
    keeps = () if quant.keep_16bit == DEFAULT_KEEP_16BIT else quant.keep_16bit
    if not keeps and not quant.overrides:
        return
    from fnmatch import fnmatchcase

    from shardctl.plan.memory.precision import first_match, is_matrix

    where = "quantization.overrides" if quant.overrides else "quantization.keep_16bit"
    if not model.tensors:
        raise InvalidInputError(
            "keep_16bit and overrides globs need the model's tensor names; a bare parameter "
            "count has none",
            where=where,
            hint="give model.config or model.checkpoint, or drop them",
        )
    names = [t.fqn for t in model.tensors]
    example = next((n for n in names if ".1." in n), names[0])
    for glob in keeps:
        if not any(fnmatchcase(n, glob) for n in names):
            raise _unmatched(glob, model, example, "quantization.keep_16bit")
    experts = model.dims.num_experts if model.dims is not None else 0
    first = first_match(tuple(o.match for o in quant.overrides))
    won: dict[int, list[TensorInfo]] = {}  # override index -> the tensors it is first for
    for t in model.tensors:
        i = first(t.fqn)
        if i is not None:
            won.setdefault(i, []).append(t)
    taken = {t.fqn for ts in won.values() for t in ts}
    for i, o in enumerate(quant.overrides):
        at = f"quantization.overrides[{i}]"
        fresh = won.get(i, [])
        if not fresh:
            hits = [t for t in model.tensors if fnmatchcase(t.fqn, o.match)]
            if not hits:
                raise _unmatched(o.match, model, example, f"{at}.match")
            raise InvalidInputError(
                f"{o.match!r} never applies: all {len(hits)} tensors it matches (e.g. "
                f"{hits[0].fqn}) are taken by an earlier override (first match wins)",
                where=f"{at}.match",
                hint="move it before the broader override, or drop it",
            )
        if o.quantizes and not any(is_matrix(t, experts) for t in fresh):
            raise InvalidInputError(
                f"{o.match!r} matches only norms, biases or routers (e.g. {fresh[0].fqn} "
                f"{list(fresh[0].shape)}), which {o.method} does not quantize",
                where=f"{at}.method",
                hint="match weight matrices (e.g. '*.mlp.*'), or drop the override",
            )
    for glob in keeps:
        if taken and all(n in taken for n in names if fnmatchcase(n, glob)):
            raise InvalidInputError(
                f"keep_16bit glob {glob!r} never applies: every tensor it matches is taken by "
                "an override (overrides come first)",
                where="quantization.keep_16bit",
                hint="drop the glob, or move its tensors into an override",
            )


def _unmatched(glob: str, model: ModelInfo, example: str, where: str) -> InvalidInputError:
    return InvalidInputError(
        f"glob {glob!r} matches no tensor of this {model.architecture} model "
        f"({len(model.tensors):,} tensors, e.g. {example})",
        where=where,
        hint="fix the glob (fnmatch on full tensor names), or drop it",
    )
