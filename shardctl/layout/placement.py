"""Placement text → resolved :class:`Placement` against a tensor's storage.

Users and presets write ``S(0)``, ``S(-1)``, ``R`` or the sugar ``colwise``, ``rowwise``,
``vocab``; layouts only ever carry and print the resolved form (``S(1)``, ``R``).

Why the sugar needs the storage: Megatron's column/row parallelism is defined on ``Y = XA``.
``nn.Linear`` stores ``A`` transposed, as ``[out, in]``; GPT-2's ``Conv1D`` stores it as is,
``[in, out]``. So the same "colwise" is a different tensor dim in the two:

=================  ==========================  ==========================
sugar              nn.Linear ``[out, in]``     Conv1D ``[in, out]``
=================  ==========================  ==========================
colwise weight     ``S(0)``                    ``S(1)``
colwise bias       ``S(0)``                    ``S(0)``
rowwise weight     ``S(1)``                    ``S(0)``
rowwise bias       ``R`` (added after reduce)  ``R``
vocab ``[V, H]``   ``S(0)``, vocab-padded      ``S(0)``, vocab-padded
=================  ==========================  ==========================

A bias is told apart from a weight by its rank (1-D), not by its name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from shardctl.errors import LayoutError
from shardctl.layout.types import REPLICATE, Placement

SUGAR: tuple[str, ...] = ("colwise", "rowwise", "vocab")
REPLICATE_WORDS: tuple[str, ...] = ("R", "Replicate()", "Replicate", "replicate")
# ``S(0)``, ``S(-1)`` and DTensor's spelling ``Shard(0)``; spaces inside the parentheses allowed.
_SHARD = re.compile(r"^\s*(?:S|Shard)\(\s*(-?\d+)\s*\)\s*$")


@dataclass(frozen=True)
class PlacementSpec:
    """Parsed placement text, not yet resolved: ``kind`` is ``shard``, ``R`` or a sugar word."""

    kind: str
    dim: int | None = None  # for kind == "shard"; may be negative until resolved

    def __str__(self) -> str:
        return f"S({self.dim})" if self.kind == "shard" else self.kind


PLACEMENT_HINT = "use S(<dim>) (e.g. S(0), S(-1), Shard(1)), R, colwise, rowwise or vocab"


def parse_placement(text: str, *, where: str | None = None) -> PlacementSpec:
    """The one placement parser (manifest rules, presets, the engine).

    ``"S(-1)"``/``"Shard(-1)"`` → ``PlacementSpec("shard", -1)``; ``"R"``/``"Replicate()"`` →
    ``PlacementSpec("R")``; ``"colwise"`` (any case) → ``PlacementSpec("colwise")``.
    ``str()`` of the result is the canonical text (``S(-1)``, ``R``, ``colwise``).
    """
    m = _SHARD.match(text)
    if m:
        return PlacementSpec("shard", int(m.group(1)))
    word = text.strip()
    if word in REPLICATE_WORDS:
        return PlacementSpec("R")
    if word.lower() in SUGAR:
        return PlacementSpec(word.lower())
    raise LayoutError(f"unknown placement {text!r}", where=where, hint=PLACEMENT_HINT)


@dataclass(frozen=True)
class Resolved:
    """A placement resolved for one tensor: the TP placement, and whether vocab padding applies."""

    placement: Placement
    vocab: bool = False


def resolve_placement(
    spec: PlacementSpec, shape: tuple[int, ...], *, conv1d: bool = False, fqn: str = ""
) -> Resolved:
    """Resolve sugar and negative dims against ``shape`` (see the module table)."""
    ndim = len(shape)
    if spec.kind == "R":
        return Resolved(REPLICATE)
    if spec.kind == "shard":
        assert spec.dim is not None
        return Resolved(Placement(_normalize_dim(spec.dim, shape, fqn)))
    if ndim == 0:
        # A scalar has nothing to split; sugar on it means "the same on every rank".
        return Resolved(REPLICATE)
    if spec.kind == "vocab":
        return Resolved(Placement(0), vocab=True)
    if ndim == 1:  # bias: colwise follows the output features, rowwise is added after reduce
        return Resolved(Placement(0) if spec.kind == "colwise" else REPLICATE)
    if ndim != 2:
        raise LayoutError(
            f"{spec.kind} needs a 2-D weight or 1-D bias, got shape {list(shape)}",
            where=fqn or None,
            hint="write the dim explicitly, e.g. S(0)",
        )
    out_dim, in_dim = (1, 0) if conv1d else (0, 1)
    return Resolved(Placement(out_dim if spec.kind == "colwise" else in_dim))


def _normalize_dim(dim: int, shape: tuple[int, ...], fqn: str) -> int:
    ndim = len(shape)
    if not -ndim <= dim < ndim:
        raise LayoutError(
            f"S({dim}) is out of range for shape {list(shape)} ({ndim} dims)",
            where=fqn or None,
            hint=f"use a dim in [{-ndim}, {ndim - 1}] or R" if ndim else "use R for a scalar",
        )
    return dim % ndim
