"""Every tensor no rule places, reported at once, grouped as fqn patterns.

``model.layers.0.mlp.foo.weight`` … ``model.layers.31.mlp.foo.weight`` become one pattern
``model.layers.*.mlp.foo.weight (×32)``: writing rules for a new architecture takes one run,
not one run per tensor. The error's line lists the patterns (the first :data:`SHOWN`, then a
count); :attr:`UnplacedTensorsError.fqns` carries every name. An architecture with no family
file is told its closest known family (``closest``, from :func:`shardctl.archs.closest_family`).
"""

from __future__ import annotations

import difflib
import re
from collections import Counter
from collections.abc import Sequence

from shardctl.errors import LayoutError

SHOWN = 12
_INDEX = re.compile(r"(?<=\.)\d+(?=\.|$)")


def fqn_pattern(fqn: str) -> str:
    """``model.layers.3.mlp.experts.7.w1.weight`` → ``model.layers.*.mlp.experts.*.w1.weight``."""
    return _INDEX.sub("*", fqn)


class UnplacedTensorsError(LayoutError):
    """Tensors no rule places. ``fqns``: all of them, in inventory order; ``patterns``: each
    pattern with its tensor count, in first-seen order."""

    def __init__(
        self,
        fqns: Sequence[str],
        *,
        rule_patterns: Sequence[str],
        architecture: str,
        preset: bool,
        closest: str | None = None,
        suggested: str | None = None,
    ):
        self.fqns = tuple(fqns)
        self.patterns: dict[str, int] = dict(Counter(fqn_pattern(f) for f in self.fqns))
        listed = [f"{p} (×{n})" if n > 1 else p for p, n in self.patterns.items()]
        shown = ", ".join(listed[:SHOWN])
        if len(listed) > SHOWN:
            shown += f", … and {len(listed) - SHOWN} more patterns"
        first = next(iter(self.patterns))
        close = difflib.get_close_matches(first, list(rule_patterns), n=1, cutoff=0.0)
        hint = f'closest rule pattern to the first is "{close[0]}"; ' if close else ""
        if not preset:
            near = f" (closest known family: {closest!r}, see shardctl/archs/)" if closest else ""
            hint = f"architecture {architecture!r} has no preset{near}; {hint}"
            if suggested:  # unverified: the user copies them into a manifest, then verifies
                hint += f"a manifest with rules: {suggested} places them (check with verify); "
        n, k = len(self.fqns), len(self.patterns)
        super().__init__(
            f"{n} tensor{'s' if n != 1 else ''} placed by no rule "
            f"({k} pattern{'s' if k != 1 else ''}): {shown}",
            where="rules",
            hint=f'{hint}add a manifest rule per pattern, e.g. {{match: "{first}", tp: R}}',
        )
