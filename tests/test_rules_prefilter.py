"""Rule matching tests a literal prefix and suffix before each regex
(``shardctl/layout/rules.py``): a necessary condition, so it never drops a match."""

from __future__ import annotations

import fnmatch
import re

from hypothesis import given, settings
from hypothesis import strategies as st

from shardctl.layout.rules import _literal_ends, _longest_literal

_PATTERN = st.text(alphabet="ab.*?[]!1", max_size=8)
_NAME = st.text(alphabet="ab.1[]!", max_size=10)


@settings(max_examples=500, deadline=None)
@given(_PATTERN, st.lists(_NAME, max_size=8))
def test_every_name_a_pattern_matches_has_its_literal_ends(pattern: str, names: list[str]) -> None:
    head, tail = _literal_ends(pattern)
    needle = _longest_literal(pattern)
    regex = re.compile(fnmatch.translate(pattern))
    # names built to match: the pattern with each wildcard filled in
    filled = pattern.replace("*", "ab").replace("?", "1")
    for name in [*names, filled, head + tail, pattern]:
        if regex.match(name):
            assert name.startswith(head) and name.endswith(tail), (pattern, name)
            assert needle in name, (pattern, name)


def test_literal_ends_of_typical_rules() -> None:
    assert _literal_ends("model.layers.*.mlp.experts.*.w1.weight") == (
        "model.layers.",
        ".w1.weight",
    )
    assert _literal_ends("lm_head.weight") == ("lm_head.weight", "lm_head.weight")
    assert _literal_ends("*.bias") == ("", ".bias")
    assert _literal_ends("model.[ab]*.w") == ("model.", "")
    assert _longest_literal("model.layers.*.self_attn.q_proj.*") == ".self_attn.q_proj."
    assert _longest_literal("model.layers.*.self_attn.[qk]_norm.*") == "model.layers."
