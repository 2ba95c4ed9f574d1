"""Manifest ``rules:`` for an architecture with no family file — a starting point, never applied.

Per tensor name pattern (layer and expert indices as ``*``), first that applies:

1. transformers' ``base_model_tp_plan`` of the config class (when transformers is installed and
   the class has one): ``colwise`` / ``rowwise`` (and their ``_rep`` / ``local_`` / ``packed_``
   variants) map to shardctl's ``colwise`` / ``rowwise``; ``replicated*`` to ``R``;
2. the closest known family's preset rule whose pattern matches the name;
3. by shape: a non-layer ``[vocab, H]`` table is vocab-parallel (``embedding`` stage, or the
   ``last`` stage for a head), any other non-layer tensor ``R`` on the ``last`` stage, a layer
   tensor ``R``.

``shardctl inspect`` prints them, and an unknown architecture's refusal names them; the user
copies them into a manifest and checks the result with ``shardctl verify`` (the forward level
does not run an architecture it has no family file for, so bitwise is what it can confirm).
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from shardctl.layout.types import RuleSpec

_INDEX = re.compile(r"(?<=\.)\d+(?=\.|$)")
_LAYER = re.compile(r"(?:^|\.)(?:layers|h|blocks)\.\*\.")
# transformers' TP styles -> shardctl's placement (None: no shardctl equivalent, left to rule 2/3)
_STYLES = {
    "colwise": "colwise",
    "colwise_rep": "colwise",
    "local_colwise": "colwise",
    "packed_colwise": "colwise",
    "rowwise": "rowwise",
    "rowwise_rep": "rowwise",
    "local_rowwise": "rowwise",
    "packed_rowwise": "rowwise",
    "replicated_with_grad_allreduce": "R",
    "local": "R",
}


@dataclass(frozen=True)
class Suggestion:
    rules: tuple[RuleSpec, ...]
    source: str  # where the tp placements came from, for the reader

    def line(self, limit: int = 0) -> str:
        """``[{match: "...", tp: colwise}, ...]``, YAML flow style (``limit``: first n rules)."""
        shown = self.rules[:limit] if limit else self.rules
        items = ", ".join(rule_yaml(r) for r in shown)
        more = f", … {len(self.rules) - len(shown)} more" if len(shown) < len(self.rules) else ""
        return f"[{items}{more}]"


def rule_yaml(rule: RuleSpec) -> str:
    out = f'{{match: "{rule.match}", tp: {rule.tp}'
    if rule.parts:
        out += ", parts: [" + ", ".join(str(p) for p in rule.parts) + "]"
    if rule.groups:
        out += f", groups: {rule.groups}"
    if rule.heads:
        out += f", heads: {rule.heads}"
    if rule.stage:
        out += f", stage: {rule.stage}"
    return out + "}"


def tp_plan(model_type: str) -> tuple[dict[str, str], str] | None:
    """transformers' ``base_model_tp_plan`` for ``model_type`` and its config class name."""
    try:
        from transformers import AutoConfig
    except ImportError:
        return None
    try:
        config = AutoConfig.for_model(model_type)
    except (ValueError, KeyError, TypeError, ImportError):
        return None
    plan = getattr(config, "base_model_tp_plan", None)
    if not isinstance(plan, Mapping) or not plan:
        return None
    return {str(k): str(v) for k, v in plan.items()}, type(config).__name__


def suggest_rules(
    model_type: str,
    tensors: Sequence[tuple[str, tuple[int, ...]]],
    *,
    vocab_size: int | None = None,
    use_transformers: bool = True,
    dims_known: bool = False,
) -> Suggestion:
    """Rules placing every tensor of ``tensors`` (``(fqn, shape)``), one per name pattern.

    ``dims_known``: the model has head counts (a config shardctl reads); without them a rule
    cannot say ``heads`` / ``groups`` / named ``parts``, so a family rule needing them becomes
    plain (``heads`` dropped) or, for fused parts, ``R`` — a plain chunk of a fused tensor
    would be the plausible-but-wrong split of DESIGN.md's traps."""
    from shardctl.archs import FAMILIES, closest_family

    patterns: dict[str, tuple[int, ...]] = {}
    for fqn, shape in tensors:
        patterns.setdefault(_INDEX.sub("*", fqn), shape)
    found = tp_plan(model_type) if use_transformers else None
    plan, plan_class = found if found is not None else ({}, "")
    near = closest_family(model_type, [f for f, _ in tensors])
    preset = [r for r in FAMILIES[near].rules if r.tp is not None]
    used_plan = used_preset = False
    rules: list[RuleSpec] = []
    for pattern, shape in patterns.items():
        in_layer = _LAYER.search(pattern) is not None
        rule: RuleSpec | None = None
        if plan:
            for key, style in plan.items():
                tp = _STYLES.get(style)
                if tp and fnmatch.fnmatchcase(pattern, f"*{key}.*"):
                    rule, used_plan = RuleSpec(pattern, tp=tp), True
                    break
        if rule is None:
            for r in preset:
                if fnmatch.fnmatchcase(pattern, r.match):
                    stage = None if in_layer else r.stage
                    if dims_known:
                        rule = RuleSpec(pattern, r.tp, r.parts, r.heads, stage, groups=r.groups)
                    elif r.parts:
                        rule = RuleSpec(pattern, "R", stage=stage)
                    else:
                        rule = RuleSpec(pattern, r.tp, stage=stage)
                    used_preset = True
                    break
        if rule is None:
            rule = _by_shape(pattern, shape, in_layer, vocab_size)
        rules.append(rule)
    sources = []
    if used_plan:
        sources.append(f"transformers {plan_class}.base_model_tp_plan")
    if used_preset:
        sources.append(f"the closest family {near!r}")
    sources.append("shapes (vocab tables, norms)")
    return Suggestion(tuple(rules), ", ".join(sources))


def _by_shape(
    pattern: str, shape: tuple[int, ...], in_layer: bool, vocab_size: int | None
) -> RuleSpec:
    if in_layer:
        return RuleSpec(pattern, tp="R")
    if vocab_size and len(shape) == 2 and shape[0] == vocab_size:
        head = "head" in pattern or "embed_out" in pattern
        return RuleSpec(pattern, tp="vocab", stage="last" if head else "embedding")
    first = "embed" in pattern or "wpe" in pattern  # an embedding's norm / positions
    return RuleSpec(pattern, tp="R", stage="first" if first else "last")


def suggestion_for(model: Any) -> Suggestion | None:
    """For an inventory (``ModelInfo``) whose architecture has no family file; else None."""
    from shardctl.archs import find

    arch = str(model.architecture)
    if find(arch) is not None or not model.tensors:
        return None
    vocab = model.dims.vocab_size if model.dims is not None else None
    if vocab is None and isinstance(model.config.get("vocab_size"), int):
        vocab = model.config["vocab_size"]
    return suggest_rules(
        arch,
        [(t.fqn, t.shape) for t in model.tensors],
        vocab_size=vocab,
        dims_known=model.dims is not None,
    )
