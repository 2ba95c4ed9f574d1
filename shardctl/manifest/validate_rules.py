"""The ``rules:`` section: ordered fqn-glob overrides → :class:`RuleSpec`."""

from __future__ import annotations

from shardctl.errors import LayoutError
from shardctl.layout.placement import parse_placement
from shardctl.layout.types import RuleSpec
from shardctl.manifest import model as m
from shardctl.manifest.fields import NULLS, SECTION_KEYS, Problems, enum
from shardctl.manifest.values import Invalid, describe, did_you_mean, read_bool, read_int, read_str
from shardctl.manifest.yamlstrict import Map, Node, Scalar, Seq


def read_rules(node: Node | None, problems: Problems) -> tuple[RuleSpec, ...]:
    if node is None or (isinstance(node, Scalar) and node.plain and node.text in NULLS):
        return ()
    if not isinstance(node, Seq):
        problems.add(Invalid("rules", f"expected a list of rules, got {describe(node)}", node.line))
        return ()
    rules = []
    for i, item in enumerate(node.items):
        try:
            rules.append(_rule(item, f"rules[{i}]", problems))
        except Invalid as problem:
            problems.add(problem)
    return tuple(rules)


def _rule(node: Node, path: str, problems: Problems) -> RuleSpec:
    if not isinstance(node, Map):
        raise Invalid(
            path,
            f"expected a mapping like {{match: ..., tp: S(0)}}, got {describe(node)}",
            node.line,
        )
    problems.keys(node, path, "rules[]")
    if "match" not in node.entries:
        raise Invalid(path, "missing required key 'match' (an fqn glob)", node.line)
    effects = [k for k in SECTION_KEYS["rules[]"] if k != "match" and k in node.entries]
    if not effects:
        raise Invalid(
            path, "a rule needs at least one of tp, parts, heads, stage, expert, groups", node.line
        )
    tp = problems.get(node, "tp", path, _placement, None)
    parts = problems.get(node, "parts", path, _parts, None)
    if parts is not None and tp == "R":
        problems.add(
            Invalid(
                f"{path}.parts",
                "fused parts need a sharded tp placement, got R",
                node.entries["parts"].line,
            )
        )
    return RuleSpec(
        match=read_str(node.entries["match"], f"{path}.match"),
        tp=tp,
        parts=parts,
        heads=problems.get(node, "heads", path, enum(m.RULE_HEADS), None),
        stage=problems.get(node, "stage", path, enum(m.RULE_STAGES), None),
        expert=problems.get(node, "expert", path, read_bool, False),
        groups=problems.get(node, "groups", path, enum(m.RULE_HEADS), None),
    )


def _placement(node: Node, path: str) -> str:
    """The engine's own parser (:func:`parse_placement`), canonical text out: ``Shard(0)`` →
    ``S(0)``, ``Replicate()`` → ``R``, ``ColWise`` → ``colwise``; ``S(-1)`` stays (resolved
    against the tensor's shape by the engine)."""
    text = read_str(node, path)
    try:
        return str(parse_placement(text, where=path))
    except LayoutError:
        raise Invalid(
            path,
            f"expected S(<dim>), R, colwise, rowwise or vocab; got {describe(node)}",
            node.line,
            did_you_mean(text.strip(), m.RULE_TP_WORDS),
        ) from None


def _parts(node: Node, path: str) -> tuple[int | str, ...]:
    if not isinstance(node, Seq) or len(node.items) < 2:
        raise Invalid(
            path,
            f"expected a list of at least two part sizes, got {describe(node)}",
            node.line,
            "e.g. [q, kv, kv] or [4096, 1024, 1024]",
        )
    parts: list[int | str] = []
    for i, item in enumerate(node.items):
        where = f"{path}[{i}]"
        if isinstance(item, Scalar) and item.text in m.RULE_PART_NAMES:
            parts.append(item.text)
        else:
            try:
                parts.append(read_int(item, where))
            except Invalid:
                raise Invalid(
                    where,
                    f"expected a positive size or one of "
                    f"{', '.join(m.RULE_PART_NAMES)}; got {describe(item)}",
                    item.line,
                ) from None
    return tuple(parts)
