"""Identical neighbouring ranks folded into one row: the plan of 1,024 GPUs in a few lines.

Ranks are numbered with ``tp`` innermost (DESIGN.md, mesh), so the ranks of one stage that
hold the same bytes are neighbours: a run of them becomes one :class:`RankGroup`
(``ranks 0–7 · tp0–7 ×8``). ``all_ranks`` keeps one group per rank.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from shardctl.layout.types import AXES, Mesh


@dataclass(frozen=True)
class RankGroup:
    """Ranks ``first..last`` (consecutive) of one stage, each holding ``memory``."""

    first: int
    last: int
    stage: int
    coords: tuple[Mapping[str, int], ...]
    memory: Mapping[str, int]

    @property
    def count(self) -> int:
        return self.last - self.first + 1

    @property
    def total(self) -> int:
        return int(self.memory["total"])

    def ranks_text(self) -> str:
        """``"3"`` or ``"0–7"``."""
        return str(self.first) if self.count == 1 else f"{self.first}–{self.last}"

    def coord_text(self, mesh: Mesh) -> str:
        """Each axis of degree > 1 with its value or range: ``"pp1 tp0–7"``; ``"—"`` if none."""
        parts = []
        for a in AXES:
            if getattr(mesh, a) == 1:
                continue
            lo = min(c[a] for c in self.coords)
            hi = max(c[a] for c in self.coords)
            parts.append(f"{a}{lo}" if lo == hi else f"{a}{lo}–{hi}")
        return " ".join(parts) or "—"

    def label(self, mesh: Mesh) -> str:
        """``"rank 3 · tp3"`` or ``"ranks 0–7 · tp0–7 ×8"``."""
        coord = self.coord_text(mesh)
        head = f"rank {self.first}" if self.count == 1 else f"ranks {self.ranks_text()}"
        tail = "" if self.count == 1 else f" ×{self.count}"
        return head + ("" if coord == "—" else f" · {coord}") + tail


def group_ranks(
    ranks: Iterable[tuple[int, Mapping[str, int], int, Mapping[str, int]]],
    *,
    all_ranks: bool = False,
) -> list[RankGroup]:
    """Fold runs of ``(rank, coord, stage, memory)`` with equal stage and memory.

    >>> g = group_ranks([(0, {"tp": 0}, 0, {"total": 5}), (1, {"tp": 1}, 0, {"total": 5})])
    >>> [(x.first, x.last) for x in g]
    [(0, 1)]
    """
    out: list[RankGroup] = []
    run: list[tuple[int, Mapping[str, int], int, Mapping[str, int]]] = []

    def close() -> None:
        if run:
            rank, _c, stage, memory = run[0]
            coords = tuple(c for _r, c, _s, _m in run)
            out.append(RankGroup(rank, run[-1][0], stage, coords, memory))
            run.clear()

    for item in ranks:
        rank, _coord, stage, memory = item
        if run and (
            all_ranks or rank != run[-1][0] + 1 or stage != run[-1][2] or memory != run[-1][3]
        ):
            close()
        run.append(item)
    close()
    return out


T = TypeVar("T")


def fold(items: Sequence[T], limit: int = 64) -> list[T | None]:
    """At most ``limit`` rows: the first and last halves, ``None`` where rows are skipped."""
    if len(items) <= limit:
        return list(items)
    half = limit // 2
    return [*items[:half], None, *items[-half:]]
