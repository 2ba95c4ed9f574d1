"""The mesh-independent half of a layout: for every tensor, its rule, resolved placement dim,
fused parts / heads, layer, stage hint and expert index.

A layout search asks for hundreds of meshes of one model; this half depends only on the model
and the rules, so it is computed once per ``(model, rules)`` and cached.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from shardctl.errors import LayoutError
from shardctl.layout.permodel import PerModel
from shardctl.layout.pipeline import layer_index
from shardctl.layout.placement import Resolved, resolve_placement
from shardctl.layout.presets import conv1d as is_conv1d
from shardctl.layout.presets import preset
from shardctl.layout.rules import CompiledRule, Matcher, compile_rules
from shardctl.layout.split import Part
from shardctl.layout.types import RuleSpec
from shardctl.model.types import ModelDims, ModelInfo, TensorInfo
from shardctl.quant.groups import SCHEME_NAMES, QuantGroup, group_kinds

_EXPERT = re.compile(r"(?:^|\.)experts\.(\d+)\.")
_EXPERT_DOT = re.compile(r"\.experts\.(\d+)\.")
# A whole dot-separated number in an fqn (``layers.12.``, ``experts.7.``; not ``w1``).
# (After a dot only: a leading number stays in the pattern, a finer class, still exact.)
_NUMBER = re.compile(r"\.\d+(?=\.|$)")
# A ``[...]`` class of an fnmatch glob (``ln_[12]``, ``[qk]_norm``).
_CLASS = re.compile(r"\[([^\]]*)\]")
# A digit a glob can hold against a whole number: after a wildcard, a dot, or at the start.
_FREE_DIGIT = re.compile(r"(?:^|[.*?\]])\d")


@dataclass(frozen=True)
class TensorRule:
    """One tensor as the rules place it, before any mesh is known."""

    info: TensorInfo
    layer: int | None  # decoder layer, or None (embeddings, final norm, head)
    stage: str | None  # first | last | all | embedding, for non-layer tensors
    dim: int | None  # the tp-sharded dim; None = replicated
    parts: tuple[Part, ...]  # sections along ``dim`` (one whole part, or fused, or heads)
    groups: int  # > 1: ``dim`` repeats ``parts`` once per head group (interleaved)
    vocab: bool  # vocab-parallel: the padding policy applies
    expert: int | None  # expert index e when placed by an expert rule
    label: str  # the rule that placed it, for messages
    # Experts packed in one tensor (Llama-4, gpt-oss: ``experts.gate_up_proj [E, H, 2I]``):
    # dim 0 is the expert index, split contiguously over ep.
    packed: bool = False
    # A quantized member: (factor, align, logical length, what) of its split dim, which follows
    # its logical weight's (shardctl/quant/groups.py); None for a plain tensor.
    quant: tuple[int, int, int, str] | None = None


@dataclass(frozen=True)
class ModelRules:
    tensors: tuple[TensorRule, ...]
    num_layers: int
    num_experts: int
    tied: bool  # no lm_head on disk: the embedding table is also the head


def model_rules(model: ModelInfo, rules: Sequence[RuleSpec]) -> ModelRules:
    """:func:`resolve_rules`, cached per ``(model object, rules)``."""
    return _CACHE(model, rules)


def forget(model: ModelInfo) -> None:
    """Drop :func:`model_rules`' cached results for ``model`` (a rule per tensor: ~20 MB at
    90,000 tensors), for a caller that has built its layout and will not ask again."""
    _CACHE.forget(model)


def resolve_rules(model: ModelInfo, rules: Sequence[RuleSpec]) -> ModelRules:
    if not model.tensors:
        raise LayoutError(
            "the model has no per-tensor inventory (a bare parameter count)",
            where="model",
            hint="give model.config or model.checkpoint for a per-rank layout",
        )
    dims = model.dims
    conv1d = is_conv1d(model.architecture)
    arch = model.architecture
    tensors = model.tensors
    names = [t.fqn for t in tensors]
    # Quantized groups by stem kind (quant.groups.group_kinds): each tensor's group shape key
    # from its stem's kind, and a real group (its own tensors) only for the tensors placed
    # through the rules. At 101,000 FP8 tensors the walk that built every group took ~0.2 s
    # and held ~20 MB.
    kinds = group_kinds(tensors, model.config, where=model.source)
    group_keys, stem_of = kinds.tensor_keys(len(tensors), _shape_key)
    stem_groups: dict[int, dict[str, QuantGroup]] = {}

    def group_at(i: int) -> QuantGroup | None:
        if group_keys[i] is None:
            return None
        s = stem_of[i]
        found = stem_groups.get(s)
        if found is None:
            found = stem_groups[s] = kinds.stem_groups(s, tensors, where=model.source)
        return found.get(tensors[i].fqn)

    matcher = Matcher(compile_rules(tuple(rules), preset(arch), arch), arch, names)
    out: list[TensorRule] = []
    unplaced: list[str] = []
    resolved_by_shape: dict[
        tuple[int, tuple[int, ...]], tuple[Resolved, int, tuple[Part, ...]]
    ] = {}
    # Layers after the decoder stack (MTP) are not decoder layers: pinned to the last stage.
    first_mtp = dims.num_layers if dims is not None and dims.mtp_layers else None

    def place(
        info: TensorInfo, layer: int | None, trailing: bool, group: QuantGroup | None
    ) -> TensorRule | None:
        """One tensor (of quantized group ``group``) through the rules; None when no rule
        places it."""
        # a quantized member is placed as the unquantized weight it encodes would be
        logical = group.logical if group is not None else info
        if trailing:
            layer = None
        match = matcher.find(logical.fqn, need_stage=layer is None)
        if match is None:
            return None
        cr = match.rule
        assert cr.placement is not None
        if layer is not None and cr.rule.stage is not None:
            # a rule that pins a stage places a layer-numbered tensor outside the decoder
            # stack (Llama-4's vision_model.model.layers.{i}: the first stage's encoder)
            layer = None
        # The same rule on the same shape resolves the same (90,000 experts, a few shapes):
        # computed once per (rule, shape); a failure raises on the first tensor that has it.
        key = (id(cr), logical.shape)
        known = resolved_by_shape.get(key)
        if known is None:
            resolved = resolve_placement(
                cr.placement, logical.shape, conv1d=conv1d, fqn=logical.fqn
            )
            dim = resolved.placement.dim
            groups = 1
            if dim is None:
                parts: tuple[Part, ...] = ()
            elif cr.rule.groups:
                groups, parts = _grouped_parts(logical, dim, cr.rule, dims, cr.label)
            else:
                parts = _parts(logical, dim, cr.rule, dims, cr.label)
            known = resolved_by_shape[key] = (resolved, groups, parts)
        resolved, groups, parts = known
        dim = resolved.placement.dim
        if resolved.vocab and (len(parts) > 1 or groups > 1):
            raise LayoutError(
                "a vocab placement cannot have fused parts",
                where=info.fqn,
                hint=f"drop parts from {cr.label}, or use S(0)",
            )
        expert = _expert_index(info.fqn) if cr.rule.expert else None
        stage = "last" if trailing else (match.stage or cr.rule.stage)
        packed = cr.rule.expert and expert is None
        if packed and dim == 0:
            raise LayoutError(
                "a packed expert tensor is split over ep on dim 0; tp cannot split it too",
                where=info.fqn,
                hint=f"shard another dim on tp in {cr.label}, e.g. S(1) or S(2)",
            )
        quant = None
        if group is not None and dim is not None:
            if resolved.vocab:
                raise LayoutError(
                    f"a vocab-parallel placement of a {SCHEME_NAMES[group.scheme]} quantized "
                    "table is not supported",
                    where=info.fqn,
                    hint=f"replicate it (tp: R) with a manifest rule, or drop {cr.label}",
                )
            if groups > 1:
                raise LayoutError(
                    f"{SCHEME_NAMES[group.scheme]} quantization of a tensor fused per group "
                    f"(interleaved, {cr.label}) is not supported",
                    where=info.fqn,
                    hint="reshard such a checkpoint unsplit, or dequantize it first",
                )
            dim, quant = _member_split(group, info, dim)
            if dim is None:
                parts = ()
        return TensorRule(
            info,
            layer,
            stage,
            dim,
            parts,
            groups,
            resolved.vocab,
            expert,
            cr.label,
            packed=packed,
            quant=quant,
        )

    # Rules per name *pattern*, not per tensor: 90,000 expert tensors are a few dozen names
    # that differ only in their layer and expert numbers. The first tensor of a class
    # (pattern, shape, dtype, trailing) goes through the rules; the others copy its result
    # with their own layer and expert numbers. Exact when the rules cannot tell those numbers
    # apart (``_number_blind``). A quantized member's class also holds its group's
    # ``_shape_key`` (scheme, logical shape, every member's role, shape, dtype and axes: all
    # that ``place`` reads of the group besides names, which differ only in those numbers).
    blind = _number_blind(matcher.rules)
    first: dict[tuple[object, ...], TensorRule | None] = {}
    new = object.__new__
    pattern = _NUMBER.sub
    for i, info in enumerate(tensors):
        fqn = info.fqn
        layer = layer_index(fqn)
        trailing = first_mtp is not None and layer is not None and layer >= first_mtp
        if not blind or "#" in fqn:
            placed = place(info, layer, trailing, group_at(i))
        else:
            key: tuple[object, ...] = (pattern(".#", fqn), info.shape, info.dtype, trailing)
            gk = group_keys[i]
            if gk is not None:
                key = (*key, gk)
            if key not in first:
                placed = first[key] = place(info, layer, trailing, group_at(i))
            else:
                like = first[key]
                placed = None
                if like is not None:
                    # a frozen dataclass: fill its __dict__ (the class's fields, this
                    # tensor's own numbers) instead of 11 frozen setattr calls
                    placed = new(TensorRule)
                    fields = placed.__dict__
                    fields.update(like.__dict__)
                    fields["info"] = info
                    if like.layer is not None:
                        fields["layer"] = layer
                    if like.expert is not None:
                        fields["expert"] = _expert_index(fqn)
        if placed is None:
            unplaced.append(fqn)  # all of them in one error, after the loop
        else:
            out.append(placed)
    if unplaced:
        import sys

        from shardctl.archs.suggest import suggest_rules

        done = set(names) - set(unplaced)
        suggestion = suggest_rules(
            arch,
            [(t.fqn, t.shape) for t in model.tensors if t.fqn not in done],
            vocab_size=dims.vocab_size if dims is not None else None,
            # transformers' tp plan only when already loaded: importing it (and torch) costs
            # seconds, and plan never imports torch; `shardctl inspect` reads the plan.
            use_transformers="transformers" in sys.modules,
            dims_known=dims is not None,
        )
        raise matcher.unplaced(unplaced, suggestion.line(limit=24))
    matcher.check_unused(names)
    layers = [t.layer for t in out if t.layer is not None]
    num_layers = dims.num_layers if dims is not None else (max(layers) + 1 if layers else 0)
    if first_mtp is not None and dims is not None:
        for t in out:
            mtp = layer_index(t.info.fqn)
            if t.layer is None and mtp is not None and mtp >= first_mtp + dims.mtp_layers:
                raise LayoutError(
                    f"layer {mtp} is outside the model's num_layers={num_layers} plus its "
                    f"{dims.mtp_layers} multi-token-prediction layer(s)",
                    where=t.info.fqn,
                    hint="check num_hidden_layers / num_nextn_predict_layers in the config",
                )
    for t in out:
        if t.layer is not None and t.layer >= num_layers:
            raise LayoutError(
                f"layer {t.layer} is outside the model's num_layers={num_layers}",
                where=t.info.fqn,
                hint="check num_hidden_layers in the config against the checkpoint",
            )
    num_experts = dims.num_experts if dims is not None else 0
    for t in out:
        if t.packed and num_experts and t.info.shape[0] != num_experts:
            raise LayoutError(
                f"packed experts: dim 0 of {list(t.info.shape)} is not num_experts={num_experts}",
                where=t.info.fqn,
                hint="check num_local_experts in the config against the checkpoint",
            )
        if t.expert is not None and num_experts and t.expert >= num_experts:
            raise LayoutError(
                f"expert {t.expert} is outside num_experts={num_experts}",
                where=t.info.fqn,
                hint="check num_local_experts in the config against the checkpoint",
            )
    tied = "lm_head.weight" not in set(names) and (dims is None or dims.tie_word_embeddings)
    return ModelRules(tuple(out), num_layers, num_experts, tied)


def _number_blind(rules: Sequence[CompiledRule]) -> bool:
    """True when no rule's glob can tell one whole number in an fqn from another, so names
    that differ only in them (``layers.3.`` vs ``layers.12.``) match the same rules.

    Literal digits are fine where a letter precedes them (``w1``, ``ln_[12]``: they match inside
    a name's word, never a whole number); refused: a digit after a dot, wildcard or at the
    start (``layers.0.*``), ``?`` (it counts characters: ``layers.?.`` holds 0–9 only), ``#``
    (the stand-in for a number), and classes that are negated, ranged or hold a dot."""
    for cr in rules:
        glob = cr.rule.match
        if "?" in glob or "#" in glob:
            return False
        for body in _CLASS.findall(glob):
            if not body or body[0] in "!^" or "-" in body or "." in body:
                return False
        # a class stands for one character: a digit if it holds one (then a letter must
        # precede it, as any literal digit), else a letter
        plain = _CLASS.sub(lambda m: "0" if any(c.isdigit() for c in m[1]) else "a", glob)
        if "[" in plain or "]" in plain or _FREE_DIGIT.search(plain):
            return False
    return True


def _shape_key(group: QuantGroup) -> tuple[object, ...]:
    """What :func:`resolve_rules`' ``place`` reads of a member's group, names aside."""
    members = tuple((m.role, m.info.shape, m.info.dtype, m.axes) for m in group.members)
    return (group.scheme, group.logical.shape, group.dim_names, members)


def _member_split(
    group: QuantGroup, info: TensorInfo, logical_dim: int
) -> tuple[int | None, tuple[int, int, int, str] | None]:
    """The stored dim of member ``info`` that runs along the logical weight's split dim, and
    its (factor, align, logical length, what); ``(None, None)``: the member is replicated."""
    member = next(m for m in group.members if m.info.fqn == info.fqn)
    for stored, axis in enumerate(member.axes):
        if axis.dim == logical_dim:
            align, unit = group.constraint(logical_dim)
            name = group.dim_names[logical_dim]
            what = f"{unit or SCHEME_NAMES[group.scheme]} on {name}"
            return stored, (axis.factor, align, group.logical.shape[logical_dim], what)
    return None, None


def _parts(
    info: TensorInfo, dim: int, rule: RuleSpec, dims: ModelDims | None, label: str
) -> tuple[Part, ...]:
    length = info.shape[dim]
    if rule.parts:
        parts = tuple(
            _equal(length, rule.parts, dims, info, dim, label) if p == EQUAL
            else _part(p, dims, info.fqn, label)
            for p in rule.parts
        )  # fmt: skip
        if sum(p.size for p in parts) != length:
            sizes = [p.size for p in parts]
            raise LayoutError(
                f"parts {list(rule.parts)} = {sizes} sum to {sum(sizes)}, but dim {dim} of "
                f"{list(info.shape)} is {length}",
                where=info.fqn,
                hint=f"fix {label}.parts to sum to {length}",
            )
        return parts
    if rule.heads:
        whole = _part(rule.heads, dims, info.fqn, label)
        if whole.heads == 0 or length % whole.heads:
            raise LayoutError(
                f"dim {dim} of {list(info.shape)} ({length}) is not a whole number of "
                f"{whole.heads_name}={whole.heads} heads",
                where=info.fqn,
                hint=f"check head_dim in the config, or drop heads from {label}",
            )
        return (Part(length, whole.heads, whole.heads_name, whole.replicable, whole.q_heads),)
    return (Part(length),)


def _grouped_parts(
    info: TensorInfo, dim: int, rule: RuleSpec, dims: ModelDims | None, label: str
) -> tuple[int, tuple[Part, ...]]:
    """Interleaved parts: ``G`` groups (one per q or kv head) of the rule's parts, each named
    part sized per group: GPT-NeoX ``[q, kv, kv]`` per q head is 3 parts of one head each."""
    assert rule.parts and rule.groups
    if dims is None:
        raise LayoutError(
            f"{label} sets groups, which needs the model's dims (no config for this model)",
            where=info.fqn,
            hint="give a model.config",
        )
    n = dims.num_heads if rule.groups == "q" else dims.num_kv_heads
    name = "num_attention_heads" if rule.groups == "q" else "num_key_value_heads"
    parts: list[Part] = []
    for p in rule.parts:
        whole = _part(p, dims, info.fqn, label)
        if whole.size % n or (whole.heads and whole.heads % n):
            raise LayoutError(
                f"part {p!r} ({whole.size}) does not split into {name}={n} groups",
                where=info.fqn,
                hint=f"drop groups from {label}, or check the head counts in the config",
            )
        heads = whole.heads // n
        q_heads = whole.q_heads // n
        suffix = f" per {name} group" if heads else ""
        parts.append(
            Part(whole.size // n, heads, whole.heads_name + suffix, whole.replicable, q_heads)
        )
    length = info.shape[dim]
    group = sum(p.size for p in parts)
    if group * n != length:
        raise LayoutError(
            f"{n} groups of parts {list(rule.parts)} = {n}×{group} rows, but dim {dim} of "
            f"{list(info.shape)} is {length}",
            where=info.fqn,
            hint=f"fix {label}.parts / groups to match the tensor",
        )
    return n, tuple(parts)


EQUAL = "equal"


def _equal(
    length: int,
    names: tuple[int | str, ...],
    dims: ModelDims | None,
    info: TensorInfo,
    dim: int,
    label: str,
) -> Part:
    """One ``equal`` part: the sized parts' remainder of the dim, shared equally."""
    sized = sum(_part(p, dims, info.fqn, label).size for p in names if p != EQUAL)
    count = sum(p == EQUAL for p in names)
    if length < sized or (length - sized) % count:
        raise LayoutError(
            f"dim {dim} of {list(info.shape)} ({length}) less the sized parts ({sized}) does "
            f"not split into {count} equal parts",
            where=info.fqn,
            hint=f"fix {label}.parts to match the tensor",
        )
    return Part((length - sized) // count)


def _part(name: int | str, dims: ModelDims | None, fqn: str, label: str) -> Part:
    """A part named in a rule: a size, or ``q`` / ``kv`` (whole heads), ``intermediate``."""
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
    if name == EQUAL:  # shares of a whole dim: not a per-group size
        raise LayoutError(
            f"{label} names 'equal' with groups", where=fqn, hint="give the group's part sizes"
        )
    assert name == "hidden", name
    return Part(dims.hidden_size)


def _expert_index(fqn: str) -> int | None:
    """``e`` of a per-expert tensor (``...experts.<e>.w1.weight``); ``None`` for a tensor that
    packs every expert along dim 0 (``...experts.gate_up_proj``)."""
    # the leftmost match: at the start, else after a dot (a literal-led search is ~3× faster)
    m = (_EXPERT if fqn.startswith("experts.") else _EXPERT_DOT).search(fqn)
    return None if m is None else int(m.group(1))


_CACHE: PerModel[ModelRules] = PerModel(resolve_rules)
