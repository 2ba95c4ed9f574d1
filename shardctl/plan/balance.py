"""Load balance of a plan as a gate: max/mean of the stages' peaks (``--max-imbalance R``).

A stage's peak is its fullest rank's total (weights + KV + activations + …), the same figure
the plan's "load balance (max/mean of stage peaks)" line prints (:mod:`shardctl.plan.report`).
With ``pp == 1`` the ratio is 1.0 by definition.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shardctl.plan.api import PlanResult


@dataclass(frozen=True)
class Balance:
    """``ratio`` = ``peaks[stage] / mean``; ``stage`` is the heaviest stage."""

    peaks: tuple[int, ...]  # bytes of the fullest rank of each stage, stage order
    stage: int
    ratio: float

    @property
    def mean(self) -> float:
        return sum(self.peaks) / len(self.peaks)

    def exceeds(self, limit: float) -> bool:
        """The ratio as printed (3 decimals) above ``limit``: a plan that prints 1.000 passes
        ``--max-imbalance 1.0`` even when its stages differ by a few bytes."""
        return round(self.ratio, 3) > limit

    def excess_line(self, limit: float) -> str:
        """One line for a failed gate, e.g. ``stage 1 peak is 1.240× the mean stage peak …``."""
        from shardctl.units import fmt_in, pick_unit

        peak = self.peaks[self.stage]
        unit = pick_unit(peak)
        over = peak - limit * self.mean
        return (
            f"load balance {self.ratio:.3f} exceeds --max-imbalance {limit:g}: stage "
            f"{self.stage} peaks at {fmt_in(peak, unit)}, {self.ratio:.3f}× the mean stage peak "
            f"{fmt_in(self.mean, unit)}, {fmt_in(over, unit)} over the limit; move layers off "
            f"stage {self.stage} (pipeline.layers_per_stage) or change pp"
        )


def stage_balance(result: PlanResult) -> Balance:
    """The stage peaks of ``result`` and max/mean of them."""
    peaks = [0] * result.mesh.pp
    for r in result.ranks:
        peaks[r.stage] = max(peaks[r.stage], r.total)
    mean = sum(peaks) / len(peaks)
    stage = max(range(len(peaks)), key=lambda s: peaks[s])
    ratio = peaks[stage] / mean if mean else 1.0
    return Balance(peaks=tuple(peaks), stage=stage, ratio=ratio)
