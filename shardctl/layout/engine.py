"""The layout engine: which bytes of which tensor every model-parallel rank holds.

``build_layout`` is the one function ``plan``, ``reshard`` and ``verify`` ask; it reads shapes
only (never tensor data, never torch). ``rank_weight_bytes`` is its fast path for ``plan`` and
the layout search: the same resolution, but only byte counts, no ``Shard`` objects.

Per tensor: rules → placement on tp (with parts, heads, vocab padding), its stages (decoder
layer → ``assign_layers``; others by the rule's ``stage``), and its ep rank (experts
contiguous: expert ``e`` on ep rank ``e // (E / ep)``; everything else replicated over ep).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from shardctl.dtypes import nbytes
from shardctl.errors import LayoutError
from shardctl.layout.pipeline import assign_layers, layer_index, stage_of_layers
from shardctl.layout.placement import resolve_placement
from shardctl.layout.presets import CONV1D_ARCHS, preset
from shardctl.layout.rules import Match, Matcher, compile_rules
from shardctl.layout.split import Part, SplitError, SplitSpec, local_numels, split
from shardctl.layout.types import (
    Layout,
    LayoutOptions,
    Mesh,
    RankLayout,
    RuleSpec,
    Shard,
    Stage,
)
from shardctl.model.types import ModelDims, ModelInfo, TensorInfo

VOCAB_PADDING: tuple[str, ...] = ("none", "tp", "megatron")
UNEVEN: tuple[str, ...] = ("error", "chunk")
MEGATRON_VOCAB_MULTIPLE = 128  # Megatron's --make-vocab-size-divisible-by default

_EXPERT = re.compile(r"(?:^|\.)experts\.(\d+)\.")


@dataclass(frozen=True)
class TensorPlan:
    """One tensor, resolved: its tp split, the stages and the ep rank that hold it."""

    info: TensorInfo
    split: SplitSpec
    placement: str  # printable, resolved: "S(0)", "R", "S(0)·parts[…]", "E1/4·S(1)"
    stages: tuple[int, ...]
    ep_rank: int | None  # None: on every ep rank


@dataclass(frozen=True)
class Resolution:
    stages: tuple[Stage, ...]
    tensors: tuple[TensorPlan, ...]
    padded_shapes: dict[str, tuple[int, ...]]


def build_layout(
    model: ModelInfo,
    mesh: Mesh,
    *,
    rules: Sequence[RuleSpec] = (),
    options: LayoutOptions = LayoutOptions(),  # noqa: B008 - frozen, safe as a default
) -> Layout:
    """Every model-parallel rank's shards, ordered by ``(pp, ep, tp)``.

    >>> layout = build_layout(model, Mesh(tp=8, pp=2))          # doctest: +SKIP
    >>> layout.rank_layout(pp=1, ep=0, tp=3).nbytes             # doctest: +SKIP
    """
    res = resolve(model, mesh, rules=rules, options=options)
    tp, ep = mesh.tp, mesh.ep
    per_rank: list[list[Shard]] = [[] for _ in range(mesh.model_parallel)]
    for t in res.tensors:
        info = t.info
        shards = [
            Shard(info.fqn, info.dtype, info.shape, local_shape, pieces, t.placement)
            for pieces, local_shape in split(t.split, tp)
        ]
        eps = range(ep) if t.ep_rank is None else (t.ep_rank,)
        for p in t.stages:
            for e in eps:
                base = (p * ep + e) * tp
                for r in range(tp):
                    per_rank[base + r].append(shards[r])
    ranks = tuple(
        RankLayout(pp=p, ep=e, tp=r, shards=tuple(per_rank[(p * ep + e) * tp + r]))
        for p in range(mesh.pp)
        for e in range(ep)
        for r in range(tp)
    )
    return Layout(
        architecture=model.architecture,
        mesh=mesh,
        options=options,
        stages=res.stages,
        ranks=ranks,
        padded_shapes=res.padded_shapes,
    )


def rank_weight_bytes(
    model: ModelInfo,
    mesh: Mesh,
    *,
    rules: Sequence[RuleSpec] = (),
    options: LayoutOptions = LayoutOptions(),  # noqa: B008 - frozen, safe as a default
) -> dict[tuple[int, int, int], int]:
    """Weight bytes per model-parallel coordinate ``(pp, ep, tp)``, padding included.

    Equals ``{(r.pp, r.ep, r.tp): r.nbytes for r in build_layout(...).ranks}`` without making
    a single ``Shard``.
    """
    res = resolve(model, mesh, rules=rules, options=options)
    tp, ep = mesh.tp, mesh.ep
    totals = [0] * mesh.model_parallel
    for t in res.tensors:
        sizes = [nbytes(t.info.dtype, n) for n in local_numels(t.split, tp)]
        eps = range(ep) if t.ep_rank is None else (t.ep_rank,)
        for p in t.stages:
            for e in eps:
                base = (p * ep + e) * tp
                for r in range(tp):
                    totals[base + r] += sizes[r]
    return {
        (p, e, r): totals[(p * ep + e) * tp + r]
        for p in range(mesh.pp)
        for e in range(ep)
        for r in range(tp)
    }


def resolve(
    model: ModelInfo,
    mesh: Mesh,
    *,
    rules: Sequence[RuleSpec] = (),
    options: LayoutOptions = LayoutOptions(),  # noqa: B008 - frozen, safe as a default
) -> Resolution:
    """Rules, stages and ep ranks for every tensor (the shared half of both entry points)."""
    _check_options(mesh, options)
    if not model.tensors:
        raise LayoutError(
            "the model has no per-tensor inventory (a bare parameter count)",
            where="model",
            hint="give model.config or model.checkpoint for a per-rank layout",
        )
    dims = model.dims
    num_layers = dims.num_layers if dims is not None else _count_layers(model.tensors)
    stages = assign_layers(num_layers, mesh.pp, options.pipeline, options.layers_per_stage)
    layer_stage = stage_of_layers(stages, num_layers)
    num_experts = dims.num_experts if dims is not None else 0
    if mesh.ep > 1:
        _check_ep(mesh.ep, num_experts)
    names = {t.fqn for t in model.tensors}
    tied = "lm_head.weight" not in names and (dims is None or dims.tie_word_embeddings)
    conv1d = model.architecture in CONV1D_ARCHS
    matcher = Matcher(compile_rules(tuple(rules), preset(model.architecture), model.architecture))

    plans: list[TensorPlan] = []
    padded: dict[str, tuple[int, ...]] = {}
    for info in model.tensors:
        layer = layer_index(info.fqn)
        match = matcher.match(info.fqn, need_stage=layer is None and mesh.pp > 1)
        if layer is not None:
            if layer >= num_layers:
                raise LayoutError(
                    f"layer {layer} is outside the model's num_layers={num_layers}",
                    where=info.fqn,
                    hint="check num_hidden_layers in the config against the checkpoint",
                )
            on: tuple[int, ...] = (layer_stage[layer],)
        else:
            on = _non_layer_stages(info.fqn, match.stage, mesh.pp, tied)
        spec, placement = _split_spec(info, match, dims, mesh.tp, options, conv1d)
        if spec.padded is not None and spec.dim is not None:
            if spec.padded != info.shape[spec.dim]:
                padded[info.fqn] = tuple(
                    spec.padded if i == spec.dim else s for i, s in enumerate(info.shape)
                )
        ep_rank = None
        if match.rule.rule.expert:
            ep_rank = _ep_rank(info.fqn, num_experts, mesh.ep)
            placement = f"E{ep_rank}/{mesh.ep}·{placement}"
        plans.append(TensorPlan(info, spec, placement, on, ep_rank))
    matcher.check_unused(names)
    return Resolution(stages, tuple(plans), padded)


def _split_spec(
    info: TensorInfo,
    match: Match,
    dims: ModelDims | None,
    tp: int,
    options: LayoutOptions,
    conv1d: bool,
) -> tuple[SplitSpec, str]:
    cr = match.rule
    assert cr.placement is not None
    resolved = resolve_placement(cr.placement, info.shape, conv1d=conv1d, fqn=info.fqn)
    dim = resolved.placement.dim
    if dim is None:
        return SplitSpec(info.shape, None), "R"
    rule = cr.rule
    length = info.shape[dim]
    parts: tuple[Part, ...] = ()
    if rule.parts:
        parts = tuple(_part(p, dims, info.fqn, cr.label) for p in rule.parts)
        if sum(p.size for p in parts) != length:
            sizes = [p.size for p in parts]
            raise LayoutError(
                f"parts {list(rule.parts)} = {sizes} sum to {sum(sizes)}, but dim {dim} of "
                f"{list(info.shape)} is {length}",
                where=info.fqn,
                hint=f"fix {cr.label}.parts to sum to {length}",
            )
    elif rule.heads:
        whole = _part(rule.heads, dims, info.fqn, cr.label)
        if length % whole.heads:
            raise LayoutError(
                f"dim {dim} of {list(info.shape)} ({length}) is not a whole number of "
                f"{whole.heads_name}={whole.heads} heads",
                where=info.fqn,
                hint=f"check head_dim in the config, or drop heads from {cr.label}",
            )
        parts = (Part(length, whole.heads, whole.heads_name, whole.replicable, whole.q_heads),)
    padded_len = None
    if resolved.vocab and options.vocab_padding != "none":
        if len(parts) > 1:
            raise LayoutError(
                "vocab placement cannot have fused parts", where=info.fqn, hint="use S(0)"
            )
        padded_len = _padded_vocab(length, tp, options.vocab_padding)
        parts = ()
    spec = SplitSpec(info.shape, dim, parts, padded_len, options.uneven == "chunk")
    try:
        split(spec, tp)
    except SplitError as err:
        raise LayoutError(
            f"{err.message} (dim {dim} of {list(info.shape)}, placement from {cr.label})",
            where=info.fqn,
            hint=err.hint,
        ) from None
    return spec, _describe(spec, tp)


def _describe(spec: SplitSpec, tp: int) -> str:
    text = f"S({spec.dim})"
    if len(spec.parts) > 1:
        text += "·parts[" + ",".join(str(p.size) for p in spec.parts) + "]"
    replicas = max((tp // p.heads for p in spec.parts if p.heads and tp > p.heads), default=0)
    if replicas:
        text += f"·rep[{replicas}]"
    if spec.padded is not None and spec.dim is not None and spec.padded != spec.shape[spec.dim]:
        text += f"·pad[{spec.padded}]"
    uneven = any(p.size % tp for p in spec.parts if not p.heads) or (
        not spec.parts
        and spec.dim is not None
        and spec.padded is None
        and spec.shape[spec.dim] % tp
    )
    if spec.chunk and uneven:
        text += "·chunk"
    return text


def _part(name: int | str, dims: ModelDims | None, fqn: str, label: str) -> Part:
    if isinstance(name, int):
        return Part(name)
    if dims is None:
        raise LayoutError(
            f"{label} names {name!r}, which needs the model's dims (no config for this model)",
            where=fqn,
            hint="give the parts as sizes in elements, or a model.config",
        )
    if name == "q":
        return Part(dims.num_heads * dims.head_dim, dims.num_heads, "num_attention_heads")
    if name == "kv":
        return Part(
            dims.num_kv_heads * dims.head_dim,
            dims.num_kv_heads,
            "num_key_value_heads",
            replicable=True,
            q_heads=dims.num_heads,
        )
    if name == "intermediate":
        return Part(dims.intermediate_size)
    assert name == "hidden", name
    return Part(dims.hidden_size)


def _padded_vocab(length: int, tp: int, policy: str) -> int:
    """``tp``: next multiple of tp; ``megatron``: next multiple of 128·tp (no-op if divisible)."""
    multiple = tp * (MEGATRON_VOCAB_MULTIPLE if policy == "megatron" else 1)
    return -(-length // multiple) * multiple


def _non_layer_stages(fqn: str, stage: str | None, pp: int, tied: bool) -> tuple[int, ...]:
    last = pp - 1
    if pp == 1:
        return (0,)
    if stage == "first":
        return (0,)
    if stage == "last":
        return (last,)
    if stage == "all":
        return tuple(range(pp))
    if stage == "embedding":
        # A tied head has no lm_head on disk: the last stage computes logits with this table.
        return (0, last) if tied else (0,)
    raise LayoutError(
        f"not in a decoder layer and no rule gives its stage (pp={pp})",
        where=fqn,
        hint=f'add a rule {{match: "{fqn}", stage: first|last|all}}',
    )


def _check_ep(ep: int, num_experts: int) -> None:
    if num_experts == 0:
        raise LayoutError(
            f"ep={ep} but the model has no experts (num_experts=0)",
            where="mesh.ep",
            hint="use ep=1 for a dense model",
        )
    if num_experts % ep:
        ok = [d for d in range(1, num_experts + 1) if num_experts % d == 0]
        raise LayoutError(
            f"ep={ep} does not divide num_experts={num_experts}",
            where="mesh.ep",
            hint="use ep in {" + ", ".join(map(str, ok)) + "}",
        )


def _ep_rank(fqn: str, num_experts: int, ep: int) -> int:
    m = _EXPERT.search(fqn)
    if m is None:
        raise LayoutError(
            "an expert rule matched, but the name has no 'experts.<e>.' index",
            where=fqn,
            hint="drop expert: true from that rule, or match only per-expert tensors",
        )
    e = int(m.group(1))
    if num_experts and e >= num_experts:
        raise LayoutError(
            f"expert {e} is outside num_experts={num_experts}",
            where=fqn,
            hint="check num_local_experts in the config against the checkpoint",
        )
    if ep == 1:
        return 0
    return e // (num_experts // ep)


def _count_layers(tensors: Sequence[TensorInfo]) -> int:
    indices = [i for i in (layer_index(t.fqn) for t in tensors) if i is not None]
    return max(indices) + 1 if indices else 0


def _check_options(mesh: Mesh, options: LayoutOptions) -> None:
    for axis, degree in mesh.as_dict().items():
        if degree < 1:
            raise LayoutError(f"{axis}={degree} must be >= 1", where=f"mesh.{axis}")
    if options.vocab_padding not in VOCAB_PADDING:
        raise LayoutError(
            f"unknown vocab_padding {options.vocab_padding!r}",
            where="layout.vocab_padding",
            hint=f"use one of {', '.join(VOCAB_PADDING)}",
        )
    if options.uneven not in UNEVEN:
        raise LayoutError(
            f"unknown uneven policy {options.uneven!r}",
            where="layout.uneven",
            hint=f"use one of {', '.join(UNEVEN)}",
        )


def total_bytes(layout: Layout) -> int:
    """Bytes over all model-parallel ranks (one dp replica), padding and replicas included."""
    return sum(r.nbytes for r in layout.ranks)


__all__ = ["build_layout", "rank_weight_bytes", "resolve", "total_bytes"]
