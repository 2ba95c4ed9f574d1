"""The rule preset of an architecture: its family file's rules (:mod:`shardctl.archs`).

Rules are ordered ``fqn`` globs → placement (first match wins). ``stage`` for tensors outside
the decoder layers: ``first``, ``last``, ``all``, or ``embedding`` = first, and also last when
the head is tied (no ``lm_head.weight`` on disk and ``pp > 1``: the last stage needs the table
for its logits).
"""

from __future__ import annotations

from shardctl.archs import find
from shardctl.layout.types import RuleSpec


def preset(architecture: str) -> tuple[RuleSpec, ...]:
    """The preset rules of an architecture; ``()`` for an unknown one (the manifest's rules)."""
    family = find(architecture)
    return family.rules if family is not None else ()


def conv1d(architecture: str) -> bool:
    """Whether the architecture's linear weights are stored ``[in, out]`` (GPT-2 ``Conv1D``)."""
    family = find(architecture)
    return family is not None and family.conv1d
