"""The layout engine: which bytes of which tensor every model-parallel rank holds.

``build_layout`` is the one function ``plan``, ``reshard`` and ``verify`` ask; it reads shapes
only (never tensor data, never torch). ``rank_weight_bytes`` is its fast path for ``plan`` and
the layout search: the same resolution, but only byte counts, no ``Shard`` objects — and, where
:mod:`shardctl.layout.classes` applies (names that differ only in layer/expert numbers), no
per-tensor object at all.

Per tensor: rules → placement on tp (with parts, heads, vocab padding), its stages (decoder
layer → ``assign_layers``; others by the rule's ``stage``), and its ep rank (experts
contiguous: expert ``e`` on ep rank ``e // (E / ep)``; everything else replicated over ep).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import TYPE_CHECKING, Any

from shardctl.columns import from_columns
from shardctl.dtypes import nbytes
from shardctl.errors import LayoutError
from shardctl.gcpause import gc_paused
from shardctl.layout.pipeline import assign_layers, stage_of_layers
from shardctl.layout.resolve import TensorRule, model_rules
from shardctl.layout.split import SplitError, SplitSpec, local_numels, split
from shardctl.layout.types import (
    Layout,
    LayoutOptions,
    Mesh,
    Piece,
    RankLayout,
    RuleSpec,
    Shard,
    Stage,
)
from shardctl.model.types import ModelInfo, TensorInfo

if TYPE_CHECKING:
    from shardctl.layout.classes import RuleClasses

_SPLIT, _INFO, _PLACEMENT = attrgetter("split"), attrgetter("info"), attrgetter("placement")
_STAGES, _EP_RANK = attrgetter("stages"), attrgetter("ep_rank")
_FQN, _DTYPE, _SHAPE = attrgetter("fqn"), attrgetter("dtype"), attrgetter("shape")

VOCAB_PADDING: tuple[str, ...] = ("none", "tp", "megatron")
UNEVEN: tuple[str, ...] = ("error", "chunk")
MEGATRON_VOCAB_MULTIPLE = 128  # Megatron's --make-vocab-size-divisible-by default


@dataclass(frozen=True, slots=True)
class TensorPlan:
    """One tensor, resolved: its tp split, the stages and the ep rank that hold it."""

    info: TensorInfo
    split: SplitSpec
    placement: str  # printable, resolved: "S(0)", "R", "S(0)·parts[…]", "E1/4·S(1)"
    stages: tuple[int, ...]
    ep_rank: int | None  # None: on every ep rank
    packed: bool = False  # experts packed along dim 0: each ep rank holds its E/ep rows


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
    plans = res.tensors
    by_tp, held = _tp_shards(plans, tp), _held(plans, mesh)
    packed = [i for i, t in enumerate(plans) if t.packed] if ep > 1 else []
    ranks: list[RankLayout] = []
    for p in range(mesh.pp):
        for e in range(ep):
            for r in range(tp):
                column = by_tp[r]
                if packed:  # each ep rank holds its E/ep rows of a packed expert tensor
                    column = list(column)
                    for i in packed:
                        column[i] = _expert_rows(column[i], e, ep)
                shards = tuple(map(column.__getitem__, held[p * ep + e]))
                ranks.append(RankLayout(pp=p, ep=e, tp=r, shards=shards))
    return Layout(
        architecture=model.architecture,
        mesh=mesh,
        options=options,
        stages=res.stages,
        ranks=tuple(ranks),
        padded_shapes=res.padded_shapes,
    )


def _tp_shards(plans: Sequence[TensorPlan], tp: int) -> list[list[Shard]]:
    """Each tensor's shard on each tp rank (``[r][i]``), shared by every stage and ep rank
    that holds it. Built column by column (:mod:`shardctl.columns`): at 90,000 tensors the
    loop with the frozen ``__init__`` was ~0.5 s of a split's planning. Tensors of one class
    share one SplitSpec object (resolve): it is split once, not per tensor (hashing a spec for
    split's cache cost more than the Shards themselves at 90,000)."""
    specs = list(map(_SPLIT, plans))
    cut_of = {id(spec): split(spec, tp) for spec in {id(spec): spec for spec in specs}.values()}
    cuts = list(map(cut_of.__getitem__, map(id, specs)))
    infos = list(map(_INFO, plans))
    fqns, dtypes = list(map(_FQN, infos)), list(map(_DTYPE, infos))
    shapes, labels = list(map(_SHAPE, infos)), list(map(_PLACEMENT, plans))
    return [
        from_columns(
            Shard,
            len(plans),
            fqn=fqns,
            dtype=dtypes,
            global_shape=shapes,
            local_shape=[cut[r][1] for cut in cuts],
            pieces=[cut[r][0] for cut in cuts],
            placement=labels,
        )
        for r in range(tp)
    ]


def _held(plans: Sequence[TensorPlan], mesh: Mesh) -> list[list[int]]:
    """The tensors (indexes into ``plans``, in model order) held by each ``(stage, ep rank)``,
    at ``stage · ep + ep rank``; each distinct (stages, ep rank) worked out once."""
    ep = mesh.ep
    held: list[list[int]] = [[] for _ in range(mesh.pp * ep)]
    adders: dict[tuple[tuple[int, ...], int | None], list[Callable[[int], None]]] = {}
    for i, key in enumerate(zip(map(_STAGES, plans), map(_EP_RANK, plans), strict=True)):
        add = adders.get(key)
        if add is None:
            eps = range(ep) if key[1] is None else (key[1],)
            add = adders[key] = [held[p * ep + e].append for p in key[0] for e in eps]
        for a in add:
            a(i)
    return held


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
    return staged_weight_bytes(model, mesh, rules=rules, options=options)[1]


def staged_weight_bytes(
    model: ModelInfo,
    mesh: Mesh,
    *,
    rules: Sequence[RuleSpec] = (),
    options: LayoutOptions = LayoutOptions(),  # noqa: B008 - frozen, safe as a default
) -> tuple[tuple[Stage, ...], dict[tuple[int, int, int], int]]:
    """The stages and :func:`rank_weight_bytes` of one resolution (``plan`` needs both)."""
    by_class = _staged_by_class(model, mesh, rules, options)
    if by_class is not None:
        return by_class
    res = resolve(model, mesh, rules=rules, options=options)
    tp, ep = mesh.tp, mesh.ep
    # A tensor's bytes per rank depend only on its (shared) split spec, dtype and packing, and
    # where they go on its stages and ep rank: count the tensors of each such class (90,000
    # experts are a few hundred classes), then add each class's bytes times its count.
    classes: dict[tuple[int, str, bool, tuple[int, ...], int | None], list[Any]] = {}
    for t in res.tensors:
        key = (id(t.split), t.info.dtype, t.packed, t.stages, t.ep_rank)
        seen = classes.get(key)
        if seen is None:
            classes[key] = [t, 1]
        else:
            seen[1] += 1
    totals = [0] * mesh.model_parallel
    for t, count in classes.values():
        share = ep if t.packed else 1  # packed experts: each ep rank holds E/ep of dim 0
        sizes = [nbytes(t.info.dtype, n // share) * count for n in local_numels(t.split, tp)]
        _add(totals, t, sizes, tp, ep)
    return res.stages, _by_coord(totals, mesh)


@dataclass(frozen=True)
class ClassCount:
    """``count`` tensors of one class that sit alike: on ``stages``, on ``ep_rank`` (None:
    every ep rank, as :class:`TensorPlan`), split by ``spec``; ``rule``: the class's first."""

    rule: TensorRule
    spec: SplitSpec
    stages: tuple[int, ...]
    ep_rank: int | None
    count: int


def class_counts(
    model: ModelInfo, mesh: Mesh, rules: Sequence[RuleSpec], options: LayoutOptions
) -> tuple[tuple[Stage, ...], list[ClassCount]] | None:
    """What :func:`resolve` says of every tensor, from the tensor classes
    (:mod:`shardctl.layout.classes`), with no per-tensor object: each tensor's stage and ep
    rank come from its layer and expert numbers through two small maps, and the tensors are
    counted per (class, stage, ep rank) in one C-level pass. None (the per-tensor path
    decides, and raises its own error) for any model that path handles itself; a refused
    mesh raises as :func:`class_layout` says."""
    _check_options(mesh, options)
    got = class_layout(model, mesh, rules, options)
    if got is None:
        return None
    rc, stages, per_class = got
    layer_stage = stage_of_layers(stages, rc.num_layers)
    stage_of: dict[int | None, int] = {
        x: layer_stage[x] for x in set(rc.layers) if x is not None and x < rc.num_layers
    }
    ep_of = expert_ranks(rc, mesh.ep)
    layers, experts = map(stage_of.get, rc.layers), map(ep_of.get, rc.experts)
    out: list[ClassCount] = []
    for (c, stage, ep_rank), count in Counter(zip(rc.of, layers, experts, strict=True)).items():
        t = rc.rules[c]
        if t.layer is not None:
            if stage is None:
                return None  # not a layer of the stack (rule_classes checked: never)
            on: tuple[int, ...] = (stage,)
        else:
            on = per_class[c][2]
        # as resolve: an expert rule's tensor sits on its ep rank, a packed one on every rank
        placed_on = None if t.packed or t.expert is None else ep_rank
        out.append(ClassCount(t, per_class[c][0], on, placed_on, count))
    return stages, out


def class_layout(
    model: ModelInfo, mesh: Mesh, rules: Sequence[RuleSpec], options: LayoutOptions
) -> tuple[RuleClasses, tuple[Stage, ...], list[tuple[SplitSpec, str, tuple[int, ...]]]] | None:
    """``model``'s tensor classes (:func:`~shardctl.layout.classes.rule_classes`), the stages
    and each class's split, printable placement and fixed stages (:func:`_class_specs`) on
    ``mesh``; None where the per-tensor path must decide.

    A mesh the classes refuse raises here the error :func:`resolve` raises tensor by tensor:
    the stages and the ep check read the same layer and expert counts (``rule_classes``
    checked them on every tensor), and the per-tensor loop raises at the first tensor whose
    split or stages fail. Every tensor of a class splits and stages as its first does, and
    the classes run in the order of their first tensors, so the first class refused is that
    tensor's: the same message, and the same hint (the tp degrees over the same distinct
    splits). At 90,000 tensors handing over took the per-tensor path ~1.5 s to say it."""
    from shardctl.layout.classes import rule_classes

    rc = rule_classes(model, rules)
    if rc is None:
        return None
    stages, specs = _class_specs(rc, mesh, options)
    return rc, stages, specs


def expert_ranks(rc: RuleClasses, ep: int) -> dict[int | None, int]:
    """Each expert number of ``rc``'s tensors -> its ep rank: experts are contiguous per ep rank,
    ``e // (E / ep)``, as Megatron and TensorRT-LLM place them."""
    per_rank = rc.num_experts // ep if rc.num_experts else 1
    return {x: x // per_rank if ep > 1 else 0 for x in set(rc.experts) if x is not None}


def _class_specs(
    rc: RuleClasses, mesh: Mesh, options: LayoutOptions
) -> tuple[tuple[Stage, ...], list[tuple[SplitSpec, str, tuple[int, ...]]]]:
    """The stages, and per class its split, printable placement and the stages of a class
    without layer numbers (``()`` for one with them), as :func:`resolve` gives its first
    tensor; raises what that would."""
    stages = assign_layers(rc.num_layers, mesh.pp, options.pipeline, options.layers_per_stage)
    if mesh.ep > 1:
        _check_ep(mesh.ep, rc.num_experts)
    specs: dict[tuple[object, ...], tuple[SplitSpec, str]] = {}
    out: list[tuple[SplitSpec, str, tuple[int, ...]]] = []
    for t in rc.rules:
        key = _spec_key(t)
        hit = specs.get(key)
        if hit is None:
            try:
                hit = specs[key] = _split_spec(t, mesh.tp, options)
            except LayoutError as err:
                raise _all_constraints_hint(err, rc.rules, mesh.tp, options) from None
        fixed = (
            () if t.layer is not None else _non_layer_stages(t.info.fqn, t.stage, mesh.pp, rc.tied)
        )
        out.append((*hit, fixed))
    return stages, out


def _spec_key(t: TensorRule) -> tuple[object, ...]:
    """What a tensor's split depends on. ``parts`` by identity: resolve_rules shares one tuple
    per (rule, shape), and hashing the Part dataclasses was 180,000 Python __hash__ calls at
    90,000 tensors."""
    return (t.info.shape, t.dim, id(t.parts), t.groups, t.vocab, t.quant)


def _packed_label(ep: int, placement: str) -> str:
    """A packed expert tensor's placement: dim 0 (the experts) split over ``ep``."""
    return f"E·S(0)/{ep}·{placement}"


def _expert_label(labels: dict[tuple[int, str], str], ep_rank: int, ep: int, placement: str) -> str:
    """An expert's placement on ``ep_rank``: one string per (ep rank, placement) in ``labels``."""
    label = labels.get((ep_rank, placement))
    if label is None:
        label = labels[ep_rank, placement] = f"E{ep_rank}/{ep}·{placement}"
    return label


def _padded_shape(spec: SplitSpec, shape: tuple[int, ...]) -> tuple[int, ...] | None:
    """``shape`` with its split dim padded (vocab padding), or None when nothing is padded."""
    if spec.padded is None or spec.dim is None or spec.padded == shape[spec.dim]:
        return None
    return tuple(spec.padded if i == spec.dim else n for i, n in enumerate(shape))


def _staged_by_class(
    model: ModelInfo, mesh: Mesh, rules: Sequence[RuleSpec], options: LayoutOptions
) -> tuple[tuple[Stage, ...], dict[tuple[int, int, int], int]] | None:
    """:func:`staged_weight_bytes` from :func:`class_counts`: each count priced once."""
    by_class = class_counts(model, mesh, rules, options)
    if by_class is None:
        return None
    stages, counts = by_class
    tp, ep = mesh.tp, mesh.ep
    numels: dict[int, Sequence[int]] = {}  # id(spec) -> its local numels; counts hold them
    totals = [0] * mesh.model_parallel
    for cc in counts:
        n_local = numels.get(id(cc.spec))
        if n_local is None:
            n_local = numels[id(cc.spec)] = local_numels(cc.spec, tp)
        share = ep if cc.rule.packed else 1  # packed experts: each ep rank holds E/ep of dim 0
        sizes = [nbytes(cc.rule.info.dtype, n // share) * cc.count for n in n_local]
        _add_at(totals, cc.stages, cc.ep_rank, sizes, tp, ep)
    return stages, _by_coord(totals, mesh)


def rank_totals(
    res: Resolution, mesh: Mesh, sizes_of: Callable[[TensorPlan], Sequence[int]]
) -> dict[tuple[int, int, int], int]:
    """Bytes per model-parallel coordinate ``(pp, ep, tp)``: each tensor's ``sizes_of(t)[r]``
    (its bytes on tp rank ``r``) added on every stage and ep rank that holds it (``_add``, the
    one placement walk, also behind :func:`staged_weight_bytes`): the plan's per-format
    pricing, whose sizes may depend on each tensor's name."""
    tp, ep = mesh.tp, mesh.ep
    totals = [0] * mesh.model_parallel
    for t in res.tensors:
        _add(totals, t, sizes_of(t), tp, ep)
    return _by_coord(totals, mesh)


def _add(totals: list[int], t: TensorPlan, sizes: Sequence[int], tp: int, ep: int) -> None:
    """``sizes[r]`` onto tp rank ``r`` of every stage and ep rank holding ``t``."""
    _add_at(totals, t.stages, t.ep_rank, sizes, tp, ep)


def _add_at(
    totals: list[int],
    stages: Sequence[int],
    ep_rank: int | None,
    sizes: Sequence[int],
    tp: int,
    ep: int,
) -> None:
    """``sizes[r]`` onto tp rank ``r`` of ``stages`` on ``ep_rank`` (None: every ep rank)."""
    eps = range(ep) if ep_rank is None else (ep_rank,)
    for p in stages:
        for e in eps:
            base = (p * ep + e) * tp
            for r in range(tp):
                totals[base + r] += sizes[r]


def _by_coord(totals: list[int], mesh: Mesh) -> dict[tuple[int, int, int], int]:
    tp, ep = mesh.tp, mesh.ep
    return {
        (p, e, r): totals[(p * ep + e) * tp + r]
        for p in range(mesh.pp)
        for e in range(ep)
        for r in range(tp)
    }


@gc_paused
def resolve(
    model: ModelInfo,
    mesh: Mesh,
    *,
    rules: Sequence[RuleSpec] = (),
    options: LayoutOptions = LayoutOptions(),  # noqa: B008 - frozen, safe as a default
) -> Resolution:
    """Rules, stages and ep ranks for every tensor (the shared half of both entry points)."""
    _check_options(mesh, options)
    by_class = _resolve_by_class(model, mesh, rules, options)
    if by_class is not None:
        return by_class
    static = model_rules(model, rules)
    stages = assign_layers(static.num_layers, mesh.pp, options.pipeline, options.layers_per_stage)
    layer_stage = stage_of_layers(stages, static.num_layers)
    if mesh.ep > 1:
        _check_ep(mesh.ep, static.num_experts)
    experts_per_rank = static.num_experts // mesh.ep if static.num_experts else 1
    # Layers repeat the same few shapes: resolve each (shape, dim, parts, vocab) once per mesh.
    specs: dict[tuple[object, ...], tuple[SplitSpec, str]] = {}
    plans: list[TensorPlan] = []
    padded: dict[str, tuple[int, ...]] = {}
    labels: dict[tuple[int, str], str] = {}  # one string per (ep rank, placement), shared
    for t in static.tensors:
        key = _spec_key(t)
        hit = specs.get(key)
        if hit is None:
            try:
                hit = specs[key] = _split_spec(t, mesh.tp, options)
            except LayoutError as err:
                raise _all_constraints_hint(err, static.tensors, mesh.tp, options) from None
        spec, placement = hit
        if t.layer is not None:
            on: tuple[int, ...] = (layer_stage[t.layer],)
        else:
            on = _non_layer_stages(t.info.fqn, t.stage, mesh.pp, static.tied)
        grown = _padded_shape(spec, t.info.shape)
        if grown is not None:
            padded[t.info.fqn] = grown
        ep_rank = None
        if t.packed:
            placement = _packed_label(mesh.ep, placement)
        elif t.expert is not None:
            # Experts are contiguous per ep rank: e // (E / ep), as Megatron and TRT-LLM do.
            ep_rank = t.expert // experts_per_rank if mesh.ep > 1 else 0
            placement = _expert_label(labels, ep_rank, mesh.ep, placement)
        plans.append(TensorPlan(t.info, spec, placement, on, ep_rank, t.packed))
    return Resolution(stages, tuple(plans), padded)


def _resolve_by_class(
    model: ModelInfo, mesh: Mesh, rules: Sequence[RuleSpec], options: LayoutOptions
) -> Resolution | None:
    """:func:`resolve` from the tensor classes (:mod:`shardctl.layout.classes`): each class's
    split, placement and fixed stages worked out once from its first tensor, each tensor's
    stage and ep rank from its own layer and expert numbers. The rule per tensor that
    ``resolve_rules`` makes (~20 MB and ~0.3 s at 100,000 tensors) is never built. None (the
    per-tensor path decides, and raises its own error) where :func:`class_counts` hands over;
    a refused mesh raises as :func:`class_layout` says."""
    got = class_layout(model, mesh, rules, options)
    if got is None:
        return None
    rc, stages, specs = got
    ep = mesh.ep
    # per class: its spec, placement (a packed one's with its ep share), stages when it has
    # no layer number, padded shape
    per_class = [
        (spec, _packed_label(ep, placement) if t.packed else placement, fixed,
         _padded_shape(spec, t.info.shape))
        for t, (spec, placement, fixed) in zip(rc.rules, specs, strict=True)
    ]  # fmt: skip
    layer_stage = stage_of_layers(stages, rc.num_layers)
    on_layer = {x: (layer_stage[x],) for x in range(rc.num_layers)}  # one tuple per layer
    ep_of = expert_ranks(rc, ep)
    has_layer = [t.layer is not None for t in rc.rules]
    has_expert = [t.expert is not None and not t.packed for t in rc.rules]
    of, tensors = rc.of, model.tensors
    # Column by column, each a C-level map or a one-line comprehension (the per-tensor loop
    # with the frozen TensorPlan __init__ was ~0.3 s at 90,000 tensors).
    on = [
        on_layer.get(x) if has_layer[c] else per_class[c][2]  # type: ignore[arg-type]
        for c, x in zip(of, rc.layers, strict=True)
    ]
    if None in on:
        return None  # not a layer of the stack (rule_classes checked: never)
    ep_ranks = [ep_of[x] if has_expert[c] else None for c, x in zip(of, rc.experts, strict=True)]
    labels: dict[tuple[int, str], str] = {}  # one string per (ep rank, placement), shared
    label_of = {
        (c, e): _expert_label(labels, e, ep, per_class[c][1]) if e is not None else per_class[c][1]
        for c, e in dict.fromkeys(zip(of, ep_ranks, strict=True))
    }
    padded = {c: pc[3] for c, pc in enumerate(per_class) if pc[3] is not None}
    padded_shapes = {
        info.fqn: padded[c] for info, c in zip(tensors, of, strict=True) if c in padded
    }
    plans = from_columns(
        TensorPlan,
        len(tensors),
        info=tensors,
        split=map([pc[0] for pc in per_class].__getitem__, of),
        placement=map(label_of.__getitem__, zip(of, ep_ranks, strict=True)),
        stages=on,
        ep_rank=ep_ranks,
        packed=map([t.packed for t in rc.rules].__getitem__, of),
    )
    return Resolution(stages, tuple(plans), padded_shapes)


def _expert_rows(shard: Shard, e: int, ep: int) -> Shard:
    """ep rank ``e``'s rows ``[e·E/ep, (e+1)·E/ep)`` of a packed expert tensor's tp shard.

    The tp split never cuts dim 0 (resolve refuses it), so every piece spans all ``E`` rows.
    """
    if ep == 1:
        return shard
    per = shard.global_shape[0] // ep
    pieces = tuple(
        Piece((e * per, *p.offsets[1:]), (per, *p.sizes[1:]), p.local_offsets) for p in shard.pieces
    )
    local = (per, *shard.local_shape[1:])
    return Shard(shard.fqn, shard.dtype, shard.global_shape, local, pieces, shard.placement)


def _split_spec(t: TensorRule, tp: int, options: LayoutOptions) -> tuple[SplitSpec, str]:
    shape = t.info.shape
    if t.dim is None:
        return SplitSpec(shape, None), "R"
    chunk = options.uneven == "chunk"
    if t.quant is not None:
        factor, align, logical, what = t.quant
        spec = SplitSpec(
            shape,
            t.dim,
            t.parts,
            None,
            chunk,
            factor=factor,
            align=align,
            logical=logical,
            what=what,
        )
    elif t.vocab and options.vocab_padding != "none":
        padded_len = _padded_vocab(shape[t.dim], tp, options.vocab_padding)
        spec = SplitSpec(shape, t.dim, (), padded_len, chunk)
    else:
        spec = SplitSpec(shape, t.dim, t.parts, None, chunk, t.groups)
    try:
        split(spec, tp)
    except SplitError as err:
        raise LayoutError(
            f"{err.message} (dim {t.dim} of {list(shape)}, placement from {t.label})",
            where=t.info.fqn,
            hint=err.hint,
        ) from None
    return spec, _describe(spec, tp)


def _all_constraints_hint(
    err: LayoutError, tensors: Iterable[TensorRule], tp: int, options: LayoutOptions
) -> LayoutError:
    """``err`` whose remedy lists the tp degrees every tensor allows, not this one's."""
    from shardctl.layout.degrees import with_valid_degrees

    return with_valid_degrees(err, tensors, tp, options, _split_spec)


def _describe(spec: SplitSpec, tp: int) -> str:
    """The printable resolved placement: ``S(0)``, ``S(0)·parts[…]·rep[2]``, ``S(0)·pad[P]``."""
    assert spec.dim is not None
    text = f"S({spec.dim})"
    if len(spec.parts) > 1:
        text += "·parts[" + ",".join(str(p.size) for p in spec.parts) + "]"
    share = tp
    if spec.groups > 1:  # interleaved: ``groups`` repeats of the parts, tp/groups ranks each
        text += f"·groups[{spec.groups}]"
        share = tp // spec.groups
    replicas = max((share // p.heads for p in spec.parts if p.heads and share > p.heads), default=0)
    if replicas:
        text += f"·rep[{replicas}]"
    if spec.padded is not None and spec.padded != spec.shape[spec.dim]:
        text += f"·pad[{spec.padded}]"
    if spec.chunk and any(p.size % tp for p in spec.parts if not p.heads):
        text += "·chunk"
    return text


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


__all__ = ["build_layout", "rank_weight_bytes", "resolve", "staged_weight_bytes"]
