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
from shardctl.model.types import ModelInfo
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
    """Each ``quantization.keep_16bit`` glob must match a tensor of the model, and only what
    the weight model prices in 16-bit under a quantized format: embeddings, the head, norms,
    biases (1-D). A glob that matches nothing, or matches decoder matrices (whose 16-bit bytes
    the plan would not count), is refused rather than silently ignored."""
    if quant is None or quant.method == "none" or quant.keep_16bit == DEFAULT_KEEP_16BIT:
        return
    from fnmatch import fnmatchcase

    if not model.tensors:
        raise InvalidInputError(
            "keep_16bit globs need the model's tensor names; a bare parameter count has none",
            where="quantization.keep_16bit",
            hint="give model.config or model.checkpoint, or drop keep_16bit",
        )
    vocab = model.dims.vocab_size if model.dims else -1
    for glob in quant.keep_16bit:
        hits = [t for t in model.tensors if fnmatchcase(t.fqn, glob)]
        if not hits:
            example = next((t.fqn for t in model.tensors if ".1." in t.fqn), model.tensors[0].fqn)
            raise InvalidInputError(
                f"glob {glob!r} matches no tensor of this {model.architecture} model "
                f"({len(model.tensors):,} tensors, e.g. {example})",
                where="quantization.keep_16bit",
                hint="fix the glob (fnmatch on full tensor names), or drop it",
            )
        beyond = [
            t
            for t in hits
            if len(t.shape) >= 2 and t.shape[0] != vocab and not t.fqn.endswith("wpe.weight")
        ]
        if beyond:
            raise InvalidInputError(
                f"glob {glob!r} keeps {beyond[0].fqn} {list(beyond[0].shape)} (and "
                f"{len(beyond) - 1} more matrices) in 16-bit: the weight model prices only "
                "embeddings, the head, norms and biases in 16-bit under a quantized format",
                where="quantization.keep_16bit",
                hint="plan the mixed-precision checkpoint itself (model.checkpoint), whose "
                "stored bytes are exact, or keep only embeddings/head/norms",
            )
