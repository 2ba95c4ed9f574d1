"""Rule matching: manifest rules first, then the architecture's preset; first match wins.

A rule that sets ``tp`` decides the placement (with its ``parts``, ``heads`` and ``expert``,
which only make sense together). ``stage`` comes from the first matching rule that sets one, so
a manifest rule may re-place ``lm_head.weight`` without having to repeat that it lives on the
last stage. Tensors no rule places are one error listing them all as fqn patterns
(:mod:`shardctl.layout.unplaced`), with the closest rule pattern; so is a
manifest rule that matches no tensor (a typo would otherwise silently do nothing).
"""

from __future__ import annotations

import difflib
import fnmatch
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from shardctl.archs import closest_family
from shardctl.errors import LayoutError
from shardctl.layout.placement import PlacementSpec, parse_placement
from shardctl.layout.types import RuleSpec

STAGES: tuple[str, ...] = ("first", "last", "all", "embedding")
HEADS: tuple[str, ...] = ("q", "kv")
# "equal": an equal share of what the sized parts leave of the dim (a ViT's fused qkv
# [3·H, H]: parts [equal, equal, equal], whatever H the tower's config gives)
NAMED_PARTS: tuple[str, ...] = ("q", "kv", "intermediate", "hidden", "equal")

_LAYER_INDEX = re.compile(r"\.\d+\.")


@dataclass(frozen=True)
class CompiledRule:
    rule: RuleSpec
    label: str  # "rules[2]" (manifest) or "preset llama[5]", for messages
    regex: re.Pattern[str]
    placement: PlacementSpec | None
    manifest: bool
    # literal text every match starts / ends with: a C-speed test before the regex (at 90,000
    # tensors the regexes were most of plan's layout time)
    head: str = ""
    tail: str = ""
    needle: str = ""  # the longest literal piece between wildcards: in every match


@dataclass(frozen=True)
class Match:
    """What the rules say about one tensor."""

    rule: CompiledRule  # the rule that places it
    stage: str | None  # from the first matching rule that sets a stage


def compile_rules(
    manifest_rules: Sequence[RuleSpec], preset_rules: Sequence[RuleSpec], architecture: str
) -> tuple[CompiledRule, ...]:
    """Validate every rule's values and compile its glob; manifest rules come first."""
    out: list[CompiledRule] = []
    for i, r in enumerate(manifest_rules):
        out.append(_compile(r, f"rules[{i}]", manifest=True))
    for i, r in enumerate(preset_rules):
        out.append(_compile(r, f"preset {architecture}[{i}]", manifest=False))
    return tuple(out)


def _compile(rule: RuleSpec, label: str, *, manifest: bool) -> CompiledRule:
    if not rule.match:
        raise LayoutError("empty match pattern", where=f"{label}.match", hint="give an fqn glob")
    if rule.tp is None and rule.stage is None:
        raise LayoutError(
            f"rule for {rule.match!r} sets neither tp nor stage",
            where=label,
            hint="add tp: S(0)|S(1)|R|colwise|rowwise|vocab, or stage: first|last|all",
        )
    if rule.stage is not None and rule.stage not in STAGES:
        raise LayoutError(
            f"unknown stage {rule.stage!r}", where=f"{label}.stage", hint=f"use one of {STAGES}"
        )
    if rule.heads is not None and rule.heads not in HEADS:
        raise LayoutError(
            f"unknown heads {rule.heads!r}", where=f"{label}.heads", hint=f"use one of {HEADS}"
        )
    if rule.groups is not None:
        if rule.groups not in HEADS:
            raise LayoutError(
                f"unknown groups {rule.groups!r}",
                where=f"{label}.groups",
                hint=f"use one of {HEADS}",
            )
        if not rule.parts:
            raise LayoutError(
                "groups without parts",
                where=f"{label}.groups",
                hint="give the parts of one group, e.g. parts: [q, kv, kv]",
            )
    for p in rule.parts or ():
        if isinstance(p, str) and p not in NAMED_PARTS:
            raise LayoutError(
                f"unknown part {p!r}",
                where=f"{label}.parts",
                hint=f"use sizes in elements or names {NAMED_PARTS}",
            )
        if isinstance(p, int) and p < 0:
            raise LayoutError(f"part size {p} is negative", where=f"{label}.parts")
    placement = None if rule.tp is None else parse_placement(rule.tp, where=f"{label}.tp")
    regex = re.compile(fnmatch.translate(rule.match))
    head, tail = _literal_ends(rule.match)
    return CompiledRule(
        rule, label, regex, placement, manifest, head, tail, _longest_literal(rule.match)
    )


def _longest_literal(pattern: str) -> str:
    """The longest run of literal text in an fnmatch ``pattern`` (before any ``[...]`` class):
    every name it matches contains it (``"model.layers.*.self_attn.q_proj.*"`` →
    ``".self_attn.q_proj."``)."""
    plain = pattern.split("[", 1)[0]
    return max(re.split(r"[*?]", plain), key=len)


def _literal_ends(pattern: str) -> tuple[str, str]:
    """The literal prefix and suffix of an fnmatch ``pattern``: what any name it matches must
    start and end with (``"model.layers.*.w1.weight"`` → ``("model.layers.", ".w1.weight")``).
    A ``[...]`` class ends the prefix and leaves no suffix (its ``]`` may be literal)."""
    special = [i for i, c in enumerate(pattern) if c in "*?["]
    if not special:
        return pattern, pattern
    head = pattern[: special[0]]
    if "[" in pattern:
        return head, ""
    return head, pattern[special[-1] + 1 :]


class Matcher:
    """Matches fqns against compiled rules; remembers which manifest rules ever matched."""

    def __init__(
        self, rules: tuple[CompiledRule, ...], architecture: str = "", fqns: Sequence[str] = ()
    ):
        self.rules = rules
        self.architecture = architecture
        self.fqns = fqns  # the model's names: an unknown architecture's closest family
        self._used: set[int] = set()

    def match(self, fqn: str, *, need_stage: bool) -> Match:
        found = self.find(fqn, need_stage=need_stage)
        if found is None:
            raise self.unplaced([fqn])
        return found

    def find(self, fqn: str, *, need_stage: bool) -> Match | None:
        """:meth:`match`, or None when no rule places ``fqn`` (the caller collects them all)."""
        placed: CompiledRule | None = None
        stage: str | None = None
        for i, cr in enumerate(self.rules):
            if (
                cr.needle not in fqn
                or not (fqn.startswith(cr.head) and fqn.endswith(cr.tail))
                or not cr.regex.match(fqn)
            ):
                continue
            if cr.manifest:
                self._used.add(i)
            if stage is None and cr.rule.stage is not None:
                stage = cr.rule.stage
            if placed is None and cr.placement is not None:
                placed = cr
            if placed is not None and (stage is not None or not need_stage):
                break
        return None if placed is None else Match(placed, stage)

    def unplaced(self, fqns: Sequence[str], suggested: str | None = None) -> LayoutError:
        """One error listing every tensor no rule places, grouped as fqn patterns;
        ``suggested``: the rules that would place them (an architecture with no preset)."""
        from shardctl.layout.unplaced import UnplacedTensorsError

        preset = any(not cr.manifest for cr in self.rules)
        return UnplacedTensorsError(
            fqns,
            rule_patterns=[cr.rule.match for cr in self.rules if cr.placement is not None],
            architecture=self.architecture,
            preset=preset,
            closest=None if preset else closest_family(self.architecture, self.fqns or fqns),
            suggested=None if preset else suggested,
        )

    def check_unused(self, fqns: Iterable[str]) -> None:
        """Raise for the first manifest rule that matched no tensor at all."""
        names: list[str] | None = None
        for i, cr in enumerate(self.rules):
            if not cr.manifest or i in self._used:
                continue
            names = names if names is not None else list(fqns)
            if any(cr.regex.match(n) for n in names):
                continue  # matches, but earlier rules always won: harmless
            templates = sorted({_LAYER_INDEX.sub(".*.", n) for n in names})
            close = difflib.get_close_matches(cr.rule.match, templates, n=1, cutoff=0.0)
            raise LayoutError(
                f'no tensor matches "{cr.rule.match}"',
                where=f"{cr.label}.match",
                hint=f'did you mean "{close[0]}"?' if close else "the model has no tensors",
            )
