"""What the layout search takes and returns: options, one priced layout, the result."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from shardctl.errors import InvalidInputError
from shardctl.layout.types import Mesh
from shardctl.plan.memory.spec import RECOMPUTE

OBJECTIVES = ("gpus,headroom,comm", "gpus,comm,headroom", "comm,gpus,headroom")


@dataclass(frozen=True)
class SearchOptions:
    gpus: int
    allow_tp_across_nodes: bool = False
    pipeline: str = "even"
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    recompute: tuple[str, ...] = RECOMPUTE
    objective: str = OBJECTIVES[0]
    vocab_padding: str = "tp"

    def __post_init__(self) -> None:
        if self.gpus < 1:
            raise InvalidInputError(
                f"expected a positive GPU count, got {self.gpus}", where="--gpus"
            )
        if self.objective not in OBJECTIVES:
            raise InvalidInputError(
                f"unknown objective {self.objective!r}",
                where="search.objective",
                hint=f"use one of: {', '.join(OBJECTIVES)}",
            )


@dataclass(frozen=True)
class Candidate:
    """One priced layout: its fullest rank, headroom and communication time."""

    mesh: Mesh
    zero: int | None
    recompute: str | None
    peak: int
    headroom: int | None
    comm_time: float  # seconds per token (inference) or per step (training), slowest stage
    comm_bytes: int
    stage_peaks: tuple[int, ...]  # the fullest rank of every stage

    @property
    def world(self) -> int:
        return self.mesh.world

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"mesh": self.mesh.as_dict(), "gpus": self.world}
        if self.zero is not None:
            out.update(zero=self.zero, recompute=self.recompute)
        out.update(
            peak_bytes=self.peak,
            headroom_bytes=self.headroom,
            comm_time_s=round(self.comm_time, 9),
            comm_bytes=self.comm_bytes,
        )
        return out


@dataclass(frozen=True)
class SearchResult:
    mode: str
    gpus: int
    budget: int | None
    objective: str
    candidates: tuple[Candidate, ...]  # those that fit, best first
    rejected: dict[str, int]
    priced: int
    seconds: float
    unit: str  # "token" | "step"
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def has_fit(self) -> bool:
        return bool(self.candidates)

    def top(self, n: int) -> tuple[Candidate, ...]:
        return self.candidates[:n]

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": "shardctl.search/1",
            "mode": self.mode,
            "gpus": self.gpus,
            "budget_bytes": self.budget,
            "objective": self.objective,
            "comm_unit": self.unit,
            "priced": self.priced,
            "fitting": len(self.candidates),
            "rejected": dict(sorted(self.rejected.items())),
            "seconds": round(self.seconds, 4),
            "notes": list(self.notes),
            "candidates": [c.to_json() for c in self.candidates],
        }
