"""Weight bytes per model-parallel coordinate: the one weight model of ``plan`` and the search.

Both ask the layout engine (:func:`shardctl.layout.engine.staged_weight_bytes`), so manifest
``rules:``, vocab padding and fused parts count the same way in both, and equal the bytes
``reshard`` writes per rank.

Under ``quantization:`` (a method, ``keep_16bit``, ``overrides``) each tensor's local piece on
each rank (its shape from the same resolution) is priced in that tensor's own format
(:mod:`shardctl.plan.memory.precision`, :func:`shardctl.plan.memory.quant.tensor_bytes`): a
mixed-precision checkpoint is priced tensor by tensor, rank by rank.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

from shardctl.layout.pipeline import assign_layers
from shardctl.layout.split import SplitSpec
from shardctl.layout.types import LayoutOptions, Mesh, RuleSpec, Stage
from shardctl.model.types import ModelInfo
from shardctl.plan.memory.precision import Format
from shardctl.plan.memory.spec import QuantSpec, Workload

Coord = tuple[int, int, int]  # (pp, ep, tp)


def options_for(options: LayoutOptions, pp: int) -> LayoutOptions:
    """``layers_per_stage`` names one pipeline degree; another ``pp`` uses the convention."""
    lps = options.layers_per_stage
    if lps is not None and len(lps) != pp:
        return replace(options, layers_per_stage=None)
    return options


def engine_rules(
    model: ModelInfo, rules: Sequence[RuleSpec], workload: Workload
) -> tuple[RuleSpec, ...]:
    """``rules`` as the serving engine places the weights.

    vLLM builds a multimodal model's vision tower and projector on every pipeline stage: its
    ``*ForConditionalGeneration`` classes make ``self.visual`` / ``self.vision_tower`` and the
    projector in ``__init__`` with no pipeline-rank test (vLLM ``qwen2_5_vl.py``,
    ``qwen3_vl.py``, ``gemma3_mm.py``; only the language model's layers are split). So for
    ``engine: vllm`` the family's tower rules (those matching ``Family.towers``) come again,
    after the manifest's own, at ``stage: all``; ``reshard`` keeps them on the first stage,
    where the image embeddings are used. With ``mm_encoder_tp_mode: data`` (vLLM
    ``--mm-encoder-tp-mode data``: the tower's linears built with ``disable_tp``, the images
    sharded over the ranks instead) they are replicated (``tp: R``); vLLM falls back to
    ``weights`` for a class without ``supports_encoder_tp_data``, where the plan then counts
    the tower ``tp`` times over (the safe side). Other engines: ``rules`` as given."""
    if workload.engine != "vllm":
        return tuple(rules)
    from shardctl.archs import find
    from shardctl.plan.memory.precision import first_match

    family = find(model.architecture)
    if family is None or not family.towers or workload.text_only(family.modalities):
        return tuple(rules)  # no tower, or none built (served_model leaves its tensors out)
    tower = first_match(family.towers)
    data = workload.mm_encoder_tp_mode == "data"

    def served(r: RuleSpec) -> RuleSpec:
        if data and r.tp is not None:
            return replace(r, stage="all", tp="R", parts=None, heads=None, groups=None)
        return replace(r, stage="all")

    every = tuple(
        served(r) for r in family.rules if r.stage == "first" and tower(r.match) is not None
    )
    return (*rules, *every)


def served_model(model: ModelInfo, workload: Workload) -> ModelInfo:
    """``model`` as the serving engine loads it; ``model`` itself where that is the checkpoint.

    - vLLM serving a multimodal model text only (``limit_mm_per_prompt`` 0 for every modality
      its tower serves, ``Family.modalities``) builds no tower (``get_limit_per_prompt`` /
      ``_mark_tower_model``): its tensors are left out of the weights.
    - vLLM builds some parameters in float32 whatever the checkpoint holds
      (``Family.vllm_float32``: MiniMax-M2's router and its correction bias): they count at
      4 bytes an element."""
    if workload.engine != "vllm":
        return model
    from shardctl.archs import find
    from shardctl.plan.memory.precision import first_match

    family = find(model.architecture)
    if family is None:
        return model
    served = model
    if workload.limit_mm_per_prompt and workload.text_only(family.modalities):
        tower = first_match(family.towers)
        served = replace(served, tensors=tuple(t for t in served.tensors if tower(t.fqn) is None))
    if family.vllm_float32:
        wide = first_match(family.vllm_float32)
        tensors = tuple(
            replace(t, dtype="F32") if t.dtype != "F32" and wide(t.fqn) is not None else t
            for t in served.tensors
        )
        if any(a is not b for a, b in zip(tensors, served.tensors, strict=True)):
            served = replace(served, tensors=tensors)
    return served


def served_rules(
    model: ModelInfo, served: ModelInfo, rules: Sequence[RuleSpec]
) -> tuple[RuleSpec, ...]:
    """The manifest's ``rules`` for the model the engine loads (:func:`served_model`): a rule
    that places only tensors the engine does not build (a tower served text only) is dropped;
    one that matches nothing in ``model`` either stays, and is refused as before."""
    if served is model or not rules:
        return tuple(rules)
    from shardctl.plan.memory.precision import first_match

    kept: list[RuleSpec] = []
    for r in rules:
        match = first_match((r.match,))
        in_served = any(match(t.fqn) is not None for t in served.tensors)
        if in_served or not any(match(t.fqn) is not None for t in model.tensors):
            kept.append(r)
    return tuple(kept)


def weights_per_coord(
    model: ModelInfo,
    mesh: Mesh,
    *,
    rules: Sequence[RuleSpec],
    options: LayoutOptions,
    quant: QuantSpec | None,
) -> tuple[tuple[Stage, ...], dict[Coord, int] | None]:
    """The stages and the exact weight bytes per ``(pp, ep, tp)`` (``options`` as given:
    the search passes :func:`options_for` its ``pp``), each tensor in its ``quant`` format.

    Weights are ``None`` for a model known only by its dimensions (no tensor inventory): the
    memory model's closed form prices those. A bare parameter count splits evenly over the
    model-parallel ranks (ZeRO-paper style).
    """
    from shardctl.layout.engine import staged_weight_bytes
    from shardctl.plan.memory.precision import priced_per_tensor

    o = options
    if model.tensors and quant is not None and priced_per_tensor(quant):
        return priced_weight_bytes(model, mesh, rules=rules, options=o, quant=quant)
    if model.tensors:
        return staged_weight_bytes(model, mesh, rules=rules, options=o)
    if model.dims is not None:
        stages = assign_layers(model.dims.num_layers, mesh.pp, o.pipeline, o.layers_per_stage)
        return stages, None
    per = model.weight_bytes // (mesh.pp * mesh.tp * mesh.ep)
    stages = assign_layers(mesh.pp, mesh.pp, "even", None)
    coords = range(mesh.pp), range(mesh.ep), range(mesh.tp)
    return stages, {(p, e, t): per for p in coords[0] for e in coords[1] for t in coords[2]}


def priced_weight_bytes(
    model: ModelInfo,
    mesh: Mesh,
    *,
    rules: Sequence[RuleSpec],
    options: LayoutOptions,
    quant: QuantSpec,
) -> tuple[tuple[Stage, ...], dict[Coord, int]]:
    """:func:`~shardctl.layout.engine.staged_weight_bytes`, each local piece priced in its
    tensor's format: the layout engine's placement (tp split with parts, heads and vocab
    padding, stages, ep ranks) and the format's bytes of each rank's local shape.

    Layers repeat a handful of (split, format) pairs: each is priced once per mesh.
    """
    from shardctl.dtypes import nbytes
    from shardctl.layout.engine import TensorPlan, rank_totals, resolve
    from shardctl.layout.split import split
    from shardctl.plan.memory.precision import tensor_formats
    from shardctl.plan.memory.quant import tensor_bytes

    formats = tensor_formats(model, quant)
    res = resolve(model, mesh, rules=rules, options=options)
    tp, ep = mesh.tp, mesh.ep
    priced: dict[tuple[object, ...], list[int]] = {}

    def sizes_of(t: TensorPlan) -> list[int]:
        fmt = formats[t.info.fqn]
        key = (t.split, t.packed, t.info.dtype, fmt)
        sizes = priced.get(key)
        if sizes is None:
            if fmt.formula is not None and tp > 1:
                _check_groups(t.info.fqn, t.split, fmt, tp)
            sizes = []
            for _pieces, local in split(t.split, tp):
                if t.packed:  # packed experts: each ep rank holds E/ep of dim 0
                    local = (local[0] // ep, *local[1:])
                if fmt.formula is None:
                    sizes.append(nbytes(fmt.dtype or t.info.dtype, math.prod(local)))
                else:
                    sizes.append(
                        tensor_bytes(
                            fmt.formula,
                            local,
                            group_size=fmt.group_size,
                            double_quant=fmt.double_quant,
                            transposed=fmt.transposed,
                        )
                    )
            priced[key] = sizes
        return sizes

    return res.stages, rank_totals(res, mesh, sizes_of)


# Formats whose scales cover groups of in-features (and, for fp8 blocks, of out-features): a
# tp split must keep whole groups, as reshard does for a stored checkpoint
# (shardctl/quant/groups.py) and vLLM does when it loads one.
_IN_GROUPS = ("gptq", "int4", "awq", "mxfp4", "nvfp4", "fp8-block")


def _check_groups(fqn: str, spec: SplitSpec, fmt: Format, tp: int) -> None:
    """Refuse a tp split that would cut the format's groups of a matrix ``[out, in]``
    (``[in, out]`` for a ``Conv1D``) or packed experts ``[E, out, in]`` (MXFP4's
    ``[E, in, out]``, as gpt-oss stores them): each rank's local length along the split dim
    must be whole groups (exit 3)."""
    from shardctl.errors import LayoutError
    from shardctl.layout.split import split

    g, nd, dim = fmt.group_size, len(spec.shape), spec.dim
    if fmt.formula not in _IN_GROUPS or nd < 2 or g <= 1 or dim is None:
        return
    if nd == 2:
        in_dim, out_dim = (0, 1) if fmt.transposed else (1, 0)
    elif fmt.formula == "mxfp4":
        in_dim, out_dim = nd - 2, nd - 1
    else:
        in_dim, out_dim = nd - 1, nd - 2
    # fp8 blocks are 2-D tiles: out-features too; the other formats group in-features only
    if dim != in_dim and not (fmt.formula == "fp8-block" and dim == out_dim):
        return
    locals_ = [local[dim] for _pieces, local in split(spec, tp)]
    bad = next((n for n in locals_ if n % g), None)
    if bad is None:
        return
    side = "in-features" if dim == in_dim else "out-features"
    raise LayoutError(
        f"{fmt.formula} group_size {g} along {side} {spec.shape[dim]} with tp {tp}: "
        f"{bad} per rank cuts a group",
        where=fqn,
        hint="pick a tp that keeps whole groups, a smaller group_size, or keep this tensor "
        "in 16-bit (quantization.overrides / keep_16bit)",
    )
