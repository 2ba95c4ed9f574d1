"""Tensors by *class*: the rules' half of a layout without one object per tensor.

90,000 expert tensors are a dozen classes — names that differ only in their whole numbers
(layer, expert), with one shape and dtype. ``resolve_rules`` already places the first tensor
of a class and copies its result to the others; here the copies are never made. The names
are read as columns, with one regular-expression pass over all of them at once:

- each tensor's class (its name pattern ``model.layers.#.mlp.experts.#.w1.weight``, shape,
  dtype, and whether it trails the decoder stack) and its first tensor;
- its layer and expert numbers, taken from the same position (the pattern's slot) that
  :func:`~shardctl.layout.pipeline.layer_index` and the expert rule read in its first tensor.

The first tensors go through ``resolve_rules`` itself (a model of those tensors only), so
their placement is the one the per-tensor path gives; the checks that depend on every
tensor's numbers (layer and expert ranges) run on the columns. Anything the per-tensor path
handles one by one — rules that see numbers, a name holding ``#`` or a newline, quantized
groups that overlap — or any error returns ``None``: the per-tensor path then decides (and
words the error exactly as before). A quantized member's class also holds its group's shapes
and axes, and its first tensor is resolved with the rest of its group.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from itertools import accumulate, compress, repeat
from operator import add, attrgetter

from shardctl.columns import Numbering
from shardctl.errors import LayoutError, ShardctlError
from shardctl.gcpause import gc_paused
from shardctl.layout import resolve
from shardctl.layout.permodel import PerModel
from shardctl.layout.pipeline import _LAYER
from shardctl.layout.resolve import _EXPERT, _NUMBER, TensorRule
from shardctl.layout.rules import compile_rules
from shardctl.layout.types import RuleSpec
from shardctl.model.types import ModelInfo
from shardctl.quant.groups import (
    ANCHOR_ENDS,
    QuantGroup,
    StemKinds,
    group_kinds,
    group_tensors,
)

# ``resolve._NUMBER`` over names joined by newlines: a whole number ends at a dot, a newline
# (the end of its name) or the end of the text; the group makes ``split`` keep the number.
_NUMBER_LINES = re.compile(r"\.(\d+)(?=[.\n]|\Z)")


@dataclass(frozen=True)
class RuleClasses:
    """Every tensor's class and numbers, in ``model.tensors`` order.

    ``rules[c]`` is class ``c``'s first tensor as ``resolve_rules`` places it; a tensor of
    class ``c`` has its own ``layers[i]`` where ``rules[c].layer`` is not None, its own
    ``experts[i]`` where ``rules[c].expert`` is not None, and is otherwise placed alike.
    """

    rules: tuple[TensorRule, ...]
    of: list[int]  # class per tensor
    layers: list[int | None]  # layer_index of each name (None: no layer number)
    experts: list[int | None]  # expert index of each name (None: no expert number)
    num_layers: int
    num_experts: int
    tied: bool


def rule_classes(model: ModelInfo, rules: Sequence[RuleSpec]) -> RuleClasses | None:
    """:func:`classes_of`, cached per ``(model object, rules)`` (the layout search asks for
    hundreds of meshes of one model)."""
    return _CACHE(model, rules)


@gc_paused
def classes_of(model: ModelInfo, rules: Sequence[RuleSpec]) -> RuleClasses | None:
    """The classes of ``model``'s tensors, or None where the per-tensor path must decide."""
    tensors = model.tensors
    n = len(tensors)
    if n == 0:
        return None
    names = list(map(attrgetter("fqn"), tensors))
    joined = "\n".join(names)
    if "#" in joined or joined.count("\n") != n - 1:
        return None  # "#" is the number's stand-in; a newline would split a name
    arch = model.architecture
    from shardctl.layout.presets import preset

    if not resolve._number_blind(compile_rules(tuple(rules), preset(arch), arch)):
        return None
    # one pass: the text between whole numbers, and the numbers (every other piece)
    pieces = _NUMBER_LINES.split(joined)
    numbers = pieces[1::2]
    patterns = ".#".join(pieces[0::2]).split("\n")
    if len(patterns) != n:
        return None
    dims = model.dims
    first_mtp = dims.num_layers if dims is not None and dims.mtp_layers else None

    # Each pattern's number slots: where its layer and expert numbers sit among its numbers.
    first_of_pattern = dict(zip(reversed(patterns), range(n - 1, -1, -1), strict=True))
    count = {p: p.count("#") for p in first_of_pattern}
    starts = list(accumulate(map(count.__getitem__, patterns), initial=0))
    try:
        layer_slot = {p: _slot(_LAYER, names[i]) for p, i in first_of_pattern.items()}
        expert_slot = {p: _slot(_EXPERT, names[i]) for p, i in first_of_pattern.items()}
    except _NoSlot:
        return None
    ints = _ints(numbers)
    layers = _column(ints, starts, patterns, layer_slot)
    experts = _column(ints, starts, patterns, expert_slot)

    if first_mtp is not None:
        trailing = [x is not None and x >= first_mtp for x in layers]
    else:
        trailing = [False] * n
    # A quantized member's class also holds its group's shape key (resolve._shape_key: what
    # placing it reads of the group besides names), as in resolve_rules.
    # Grouped by stem kind (quant.groups.group_kinds): one group_tensors walk per kind, not
    # one group object per weight (45,000 FP8 experts took ~0.5 s).
    kinds: StemKinds | None = None
    # a pattern keeps its name's end (only whole-number parts become "#", and no anchor end
    # is one): the few patterns say whether any name ends like a group's anchor
    if any(p.endswith(ANCHOR_ENDS) for p in first_of_pattern):  # else no group: no walk
        try:
            kinds = group_kinds(tensors, model.config, where=model.source)
        except ShardctlError:
            return None  # the per-tensor path raises it
    gks: list[int | None] = [None] * n
    stem_of: list[int] = []
    if kinds is not None:
        gks, stem_of = kinds.tensor_keys(n, resolve._shape_key)
    keys = list(
        zip(
            patterns,
            map(attrgetter("shape"), tensors),
            map(attrgetter("dtype"), tensors),
            trailing,
            gks,
            strict=True,
        )
    )
    # classes numbered in order of first appearance, in one pass of hashing the keys (the
    # keys hold shape tuples, whose hashes are not cached); then each class's first tensor
    number: Numbering[tuple[object, ...]] = Numbering()
    of = list(map(number.__getitem__, keys))
    firsts = dict(zip(reversed(of), range(n - 1, -1, -1), strict=True))
    order = [firsts[c] for c in range(len(firsts))]
    reps = tuple(tensors[i] for i in order)
    # The first tensors, and with a quantized one the rest of its group (placing a member
    # reads its group, which must be whole in the model resolve_rules sees).
    subset = list(reps)
    groups: dict[str, QuantGroup] = {}
    if kinds is not None:
        # the reps' stems, grouped whole: each group as the walk over every tensor makes it
        try:
            for s in dict.fromkeys(stem_of[i] for i in order if stem_of[i] >= 0):
                groups.update(kinds.stem_groups(s, tensors, where=model.source))
        except ShardctlError:
            return None
    if groups:
        have = {t.fqn for t in reps}
        for t in reps:
            g = groups.get(t.fqn)
            for m in g.members if g is not None else ():
                if m.info.fqn not in have:
                    have.add(m.info.fqn)
                    subset.append(m.info)
        try:
            sub_groups = group_tensors(subset, model.config, where=model.source)
        except ShardctlError:
            return None
        for i in order:
            fqn = tensors[i].fqn
            whole, part = groups.get(fqn), sub_groups.get(fqn)
            if _group_key(whole) != _group_key(part):
                return None  # overlapping groups: the per-tensor path decides
    try:
        placed = resolve.resolve_rules(replace(model, tensors=tuple(subset)), rules)
    except LayoutError:
        return None  # the per-tensor path raises it, naming the tensor it names
    if len(placed.tensors) != len(subset):
        return None
    classes = placed.tensors[: len(reps)]  # resolve_rules keeps its input's order
    if any(r.info is not t for r, t in zip(classes, reps, strict=True)):
        return None

    # The checks resolve_rules makes on every tensor's numbers, on the columns.
    layer_on = {c for c, t in enumerate(classes) if t.layer is not None}
    expert_on = {c for c, t in enumerate(classes) if t.expert is not None}
    seen_layers = set(zip(of, layers, strict=True))
    used = [x for c, x in seen_layers if c in layer_on and x is not None]
    num_layers = dims.num_layers if dims is not None else (max(used) + 1 if used else 0)
    if any(x >= num_layers for x in used):
        return None
    if first_mtp is not None and dims is not None:
        last = first_mtp + dims.mtp_layers
        if any(c not in layer_on and x is not None and x >= last for c, x in seen_layers):
            return None
    num_experts = dims.num_experts if dims is not None else 0
    if num_experts:
        # the expert numbers of the tensors whose class reads one (C-level maps: a set of
        # 90,000 (class, number) pairs was ~4 ms, this ~2)
        seen = set(compress(experts, map(expert_on.__contains__, of)))
        if any(x is None or x >= num_experts for x in seen):
            return None
    return RuleClasses(classes, of, layers, experts, num_layers, num_experts, placed.tied)


def _group_key(group: QuantGroup | None) -> tuple[object, ...] | None:
    return None if group is None else resolve._shape_key(group)


class _NoSlot(Exception):
    """A name whose layer or expert number is not one of its whole numbers."""


def _slot(regex: re.Pattern[str], name: str) -> int | None:
    """Which of ``name``'s whole numbers ``regex`` (group 1) reads, or None when it reads
    none. The names of one pattern differ only in those numbers, so it reads the same slot
    in each."""
    m = regex.search(name)
    if m is None:
        return None
    slot = len(_NUMBER.findall(name, 0, m.start(1)))
    found = _NUMBER.findall(name)
    if slot >= len(found) or found[slot] != "." + m.group(1):
        raise _NoSlot(name)  # not that whole number: the slot would mean nothing
    return slot


def _ints(numbers: list[str]) -> list[int | None]:
    """``numbers`` as ints (each distinct text converted once), followed by ``len(numbers) +
    1`` Nones: an index ``start + len(numbers)`` lands on a None for any ``start`` of
    :func:`_column`'s (``0 <= start <= len(numbers)``)."""
    value = {s: int(s) for s in set(numbers)}
    out: list[int | None] = list(map(value.__getitem__, numbers))
    out.extend(repeat(None, len(numbers) + 1))
    return out


def _column(
    ints: list[int | None],
    starts: list[int],
    patterns: list[str],
    slots: dict[str, int | None],
) -> list[int | None]:
    """Each name's number at its pattern's slot (None where the pattern has no such slot),
    read from ``ints`` (:func:`_ints`) at ``start + slot`` by C-level maps: a pattern without
    the slot reads past the numbers, where the Nones are (~3× faster than a comprehension at
    90,000 names)."""
    past = (len(ints) - 1) // 2  # len(numbers): past every number, onto the Nones
    offset = {p: past if s is None else s for p, s in slots.items()}
    # starts has one more entry than patterns (the end): map stops at the shorter
    return list(map(ints.__getitem__, map(add, starts, map(offset.__getitem__, patterns))))


def forget(model: ModelInfo) -> None:
    """Drop :func:`rule_classes`' cached result for ``model`` (three columns of its tensor
    count and the classes' first tensors), for a caller that has built its layout."""
    _CACHE.forget(model)


__all__ = ["RuleClasses", "classes_of", "forget", "rule_classes"]


_CACHE: PerModel[RuleClasses | None] = PerModel(classes_of)
