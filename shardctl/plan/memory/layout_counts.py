"""Parameter counts per rank by kind, from the layout engine, for families the closed form
(:mod:`shardctl.plan.memory.shapes`) does not describe.

The closed form assumes every layer is Llama attention plus one MLP or ``E`` experts of
``intermediate_size``. DeepSeek is not: MLA's low-rank projections, dense first layers,
experts of ``moe_intermediate_size`` and shared experts, an MTP layer on the last stage. For a
family that says so (``Family.closed_form = False``) the counts come from the same resolution
``reshard`` uses, tallied for the ``tp = 0, ep = 0`` rank of each stage (every rank of a stage
holds the same amounts up to padding)::

    expert     tensors an ``expert`` rule places (their ep rank 0's share)
    embedding  vocab-placed tensors other than a head;  head: vocab-placed ``*head*`` tensors
    norm       1-D tensors (norms, biases) and routers (replicated ``[E, H]``)
    linear     every other matrix; ``matrices`` / ``rows`` / ``cols`` over linear + expert
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields

from shardctl.archs import find
from shardctl.layout.engine import TensorPlan, class_counts, resolve
from shardctl.layout.pipeline import layer_index
from shardctl.layout.resolve import model_rules
from shardctl.layout.split import SplitSpec, split
from shardctl.layout.types import LayoutOptions, Mesh, Stage
from shardctl.model.types import ModelInfo
from shardctl.plan.memory.shapes import Counts


def uses_layout_counts(model: ModelInfo) -> bool:
    """True for a per-tensor inventory of a family whose file opts out of the closed form."""
    family = find(model.architecture)
    return bool(model.tensors) and family is not None and not family.closed_form


def closed_form_caveat(model: ModelInfo) -> str | None:
    """Why the closed form is approximate for ``model``, or None when it is exact.

    The closed form describes uniform Llama / Mixtral layers only. A family whose file opts out
    (DeepSeek's MLA, MoE with shared experts or dense layers, gpt-oss' biases and sinks,
    Llama-4's vision tower) is counted from its tensors by the layout engine, exactly; given by
    its dims alone (no tensors: a library caller's ``ModelInfo``) the closed form is all there
    is, and the plan says it is approximate (``MemoryPlan.warnings``)."""
    family = find(model.architecture)
    if family is None or family.closed_form or model.tensors:
        return None
    return (
        f"{model.architecture}: weights, gradients and optimizer states are the closed form's "
        "uniform-layer counts, approximate for this family (non-uniform layers); give its "
        "config or checkpoint for exact counts"
    )


def layout_counts(
    model: ModelInfo, mesh: Mesh, stages: tuple[Stage, ...], vocab_padding: str
) -> dict[int, Counts]:
    """``stage index -> Counts`` of its ``tp = 0, ep = 0`` rank."""
    per_stage = tuple(st.num_layers for st in stages)
    options = LayoutOptions(layers_per_stage=per_stage, vocab_padding=vocab_padding)
    experts = model.dims.num_experts if model.dims is not None else 0
    mesh = Mesh(pp=mesh.pp, ep=mesh.ep, tp=mesh.tp)
    by_class = _by_class(model, mesh, options, experts)
    if by_class is not None:
        return by_class
    res = resolve(model, mesh, options=options)
    out = {st.index: Counts() for st in stages}
    # A tensor's counts depend on its split spec (shared by a class of tensors: resolve makes
    # one per shape and rule), whether an expert rule placed it, and for a vocab tensor its
    # name: tally the tensors per such class and stages, then count each class once.
    Key = tuple[int, bool, bool, tuple[int, ...]]
    first: dict[Key, TensorPlan] = {}
    count: dict[Key, int] = {}
    for t in res.tensors:
        if t.ep_rank not in (None, 0):
            continue
        head = t.split.padded is not None and "head" in t.info.fqn.rsplit(".", 2)[-2]
        key = (id(t.split), t.ep_rank is not None, head, t.stages)  # res holds every split
        if key in count:
            count[key] += 1
        else:
            first[key], count[key] = t, 1
    for key, t in first.items():
        _, expert, head, on = key
        c = _one(t.split, t.info.shape, expert, head, mesh.tp, experts)
        _add(out, on, c, count[key])
    return out


def _by_class(
    model: ModelInfo, mesh: Mesh, options: LayoutOptions, experts: int
) -> dict[int, Counts] | None:
    """:func:`layout_counts` from :func:`~shardctl.layout.engine.class_counts` (the tensor
    classes, as ``plan`` prices weights): each class counted once per stage on ep rank 0.
    None where the classes do not apply: the per-tensor path decides."""
    by_class = class_counts(model, mesh, (), options)
    if by_class is None:
        return None
    stages, counts = by_class
    out = {st.index: Counts() for st in stages}
    for cc in counts:
        if cc.ep_rank not in (None, 0):
            continue
        info, spec = cc.rule.info, cc.spec
        head = spec.padded is not None and "head" in info.fqn.rsplit(".", 2)[-2]
        one = _one(spec, info.shape, cc.ep_rank is not None, head, mesh.tp, experts)
        _add(out, cc.stages, one, cc.count)
    return out


def _add(out: dict[int, Counts], stages: Sequence[int], one: Counts, count: int) -> None:
    """``count`` tensors of ``one``'s counts onto each of ``stages``."""
    many = Counts(*(getattr(one, f.name) * count for f in fields(Counts)))
    for p in stages:
        out[p] = out[p] + many


def _one(
    spec: SplitSpec, shape: tuple[int, ...], expert: bool, head: bool, tp: int, experts: int
) -> Counts:
    """One tensor's counts on the ``tp = 0`` rank."""
    local = split(spec, tp)[0][1]
    numel = 1
    for n in local:
        numel *= n
    if expert:
        return Counts(expert=numel, matrices=1, rows=local[0], cols=local[-1])
    if spec.padded is not None:
        return Counts(head=numel) if head else Counts(embedding=numel)
    if len(shape) < 2 or (experts and len(shape) == 2 and shape[0] == experts):
        return Counts(norm=numel)
    return Counts(linear=numel, matrices=1, rows=local[0], cols=local[-1])


def largest_layer(model: ModelInfo, mesh: Mesh, vocab_padding: str) -> int:
    """Elements of the largest decoder layer on a ``tp = 0, ep = 0`` rank (what ZeRO-3 /
    FSDP gathers at once); MTP layers included, they are layers too."""
    options = LayoutOptions(vocab_padding=vocab_padding)
    res = resolve(model, Mesh(ep=mesh.ep, tp=mesh.tp), options=options)
    # the resolution's own decoder-layer numbers (cached), plus the MTP layers it pins to the
    # last stage: a multimodal encoder's layers (vision_model.model.layers.{i}) are not layers
    decoder = {t.info.fqn: t.layer for t in model_rules(model, ()).tensors}
    dims = model.dims
    first_mtp = dims.num_layers if dims is not None and dims.mtp_layers else None
    per_layer: dict[int, int] = {}
    for t in res.tensors:
        layer = decoder.get(t.info.fqn)
        if layer is None and first_mtp is not None:
            index = layer_index(t.info.fqn)
            layer = index if index is not None and index >= first_mtp else None
        if layer is None or t.ep_rank not in (None, 0):
            continue
        local = split(t.split, mesh.tp)[0][1]
        numel = 1
        for n in local:
            numel *= n
        per_layer[layer] = per_layer.get(layer, 0) + numel
    return max(per_layer.values(), default=0)
