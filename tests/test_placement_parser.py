"""One placement parser: everything a manifest rule accepts, the layout engine accepts, and the
reverse, with the same canonical text (issue 11: ``S(-1)``, ``Shard(0)``, ``parts: [hidden]``
were accepted by one and refused by the other)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardctl.errors import LayoutError, ManifestError
from shardctl.layout.placement import parse_placement
from shardctl.layout.rules import NAMED_PARTS, compile_rules
from shardctl.layout.types import RuleSpec
from shardctl.manifest import parse_manifest

ROOT = Path(__file__).resolve().parent.parent
M = "model: {parameters: 1000}\n"

_dim = st.integers(-9, 9).map(str)
_space = st.sampled_from(["", " ", "  "])
placements = st.one_of(
    st.builds(
        lambda h, a, d, b: f"{h}({a}{d}{b})",
        st.sampled_from(["S", "Shard", "s", "Sh"]),
        _space,
        _dim,
        _space,
    ),
    st.sampled_from(["R", "Replicate()", "Replicate", "replicate", "r", "REPLICATE", "Rep"]),
    st.sampled_from(["colwise", "rowwise", "vocab"]).flatmap(
        lambda w: st.sampled_from([w, w.upper(), w.capitalize(), w + "x", w[:-1]])
    ),
    st.text(alphabet="SRrcol()-0123 ", max_size=8),
)


def _manifest_tp(text: str) -> str | None:
    """The manifest's canonical tp text, or None if it refuses ``text``."""
    quoted = "'" + text.replace("'", "''") + "'"
    try:
        m = parse_manifest(M + f"rules: [{{match: x, tp: {quoted}}}]\n", base_dir=ROOT)
    except ManifestError:
        return None
    return m.rules[0].tp


def _engine_tp(text: str) -> str | None:
    try:
        return str(parse_placement(text))
    except LayoutError:
        return None


@settings(max_examples=300, deadline=None)
@given(placements)
def test_manifest_and_engine_accept_the_same_placements(text: str) -> None:
    manifest = _manifest_tp(text)
    engine = _engine_tp(text)
    assert manifest == engine, (text, manifest, engine)
    if engine is not None:
        # What the manifest stores, the engine parses back to itself.
        assert str(parse_placement(engine)) == engine
        compile_rules([RuleSpec("x", engine)], [], "llama")


@pytest.mark.parametrize(
    ("text", "canonical"), [("S(-1)", "S(-1)"), ("Shard(0)", "S(0)"), ("Replicate()", "R")]
)
def test_issue_examples(text: str, canonical: str) -> None:
    assert _manifest_tp(text) == _engine_tp(text) == canonical


@pytest.mark.parametrize("name", NAMED_PARTS)
def test_every_named_part_passes_both(name: str) -> None:
    m = parse_manifest(M + f"rules: [{{match: x, tp: S(0), parts: [{name}, q]}}]\n", base_dir=ROOT)
    compile_rules(m.rules, [], "llama")  # the engine's own checks
    assert m.rules[0].parts == (name, "q")
