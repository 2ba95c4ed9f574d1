"""Samples of each watched rank's memory joined with the plan's per-rank figure.

The plan figure of a rank is ``ranks[i].memory.total`` of a plan JSON (``shardctl plan --json``,
schema ``shardctl.plan/1``), or of the plan made from a manifest. A rank is *over* when it uses
more than ``plan × (1 + threshold)``; a warning is raised each time a rank crosses that line.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardctl.errors import EnvironmentFailure, InvalidInputError, UsageError
from shardctl.monitor import procs
from shardctl.monitor.nvml import Nvml

WATCH_SCHEMA = "shardctl.watch/1"
SOURCES = ("auto", "gpu", "rss")


def parse_threshold(text: str) -> float:
    """``"10%"`` or ``"0.1"`` → ``0.1``."""
    raw = text.strip()
    try:
        value = float(raw[:-1]) / 100 if raw.endswith("%") else float(raw)
    except ValueError:
        raise UsageError(
            f"--threshold {text!r} is not a number", hint='write a fraction or a percentage: "10%"'
        ) from None
    if value < 0:
        raise UsageError(f"--threshold {text!r} is negative", hint='e.g. "10%"')
    return value


def load_plan_figures(path: Path) -> dict[int, int]:
    """``{rank: planned bytes}`` from a plan JSON, or from a manifest (``.yaml``/``.yml``)."""
    if path.suffix in (".yaml", ".yml"):
        from shardctl.plan.api import make_plan

        result = make_plan(path)
        return {r.rank: r.total for r in result.ranks}
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise InvalidInputError(f"cannot read the plan: {exc.strerror}", where=str(path)) from None
    except ValueError as exc:
        raise InvalidInputError(f"not JSON: {exc}", where=str(path)) from None
    if not isinstance(data, dict) or data.get("schema") != "shardctl.plan/1":
        raise InvalidInputError(
            "not a plan (expected schema shardctl.plan/1)",
            where=str(path),
            hint="write one with: shardctl plan MANIFEST --json > plan.json",
        )
    out = {}
    for i, r in enumerate(data.get("ranks") or []):
        try:
            out[int(r["rank"])] = int(r["memory"]["total"])
        except (KeyError, TypeError, ValueError):
            raise InvalidInputError(
                "has no rank or memory.total", where=f"{path}: ranks[{i}]"
            ) from None
    return out


@dataclass(frozen=True)
class RankSample:
    rank: int
    pid: int
    name: str
    source: str  # "gpu" (NVML) or "rss" (/proc VmRSS)
    used: int
    peak: int  # the most this rank has used while watched (RSS: since it started, VmHWM)
    plan: int | None
    device: int | None  # GPU index with source "gpu"

    @property
    def ratio(self) -> float | None:
        return self.used / self.plan if self.plan else None

    def over(self, threshold: float) -> bool:
        return self.plan is not None and self.used > self.plan * (1 + threshold)

    def to_json(self, *, tick: int, at: float, threshold: float) -> dict[str, Any]:
        return {
            "schema": WATCH_SCHEMA,
            "event": "sample",
            "time": round(at, 3),
            "tick": tick,
            "rank": self.rank,
            "pid": self.pid,
            "source": self.source,
            "device": self.device,
            "used_bytes": self.used,
            "peak_bytes": self.peak,
            "plan_bytes": self.plan,
            "ratio": None if self.ratio is None else round(self.ratio, 4),
            "over": self.over(threshold),
        }


@dataclass
class Tick:
    index: int
    at: float  # unix time
    samples: list[RankSample]
    warnings: list[str] = field(default_factory=list)


@dataclass
class Watcher:
    """Samples the ranks once per :meth:`tick`; remembers peaks for :meth:`summary`.

    With ``torchrun`` the job's workers (children of the launcher, or of the launchers in
    ``pids``) are looked up again at every tick (an elastic restart brings new pids); with
    ``pids`` alone the set is fixed and a process that exits drops out.
    """

    pids: list[int]
    torchrun: bool
    plan: dict[int, int]
    threshold: float
    source: str = "auto"
    _nvml: Nvml | None = None
    _peaks: dict[int, RankSample] = field(default_factory=dict)
    _over: set[int] = field(default_factory=set)
    _fixed: list[procs.Proc] = field(default_factory=list)
    _ticks: int = 0

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise UsageError(f"--source {self.source!r}", hint=f"one of {', '.join(SOURCES)}")
        if not self.torchrun and not self.pids:
            raise UsageError("watch needs --pid PID … or --torchrun", hint="see shardctl watch -h")
        if self.source in ("auto", "gpu"):
            self._nvml = Nvml.open()
            if self._nvml is None and self.source == "gpu":
                raise EnvironmentFailure(
                    "--source gpu: no NVML (no GPU, no driver, or nvidia-ml-py not installed)",
                    hint="pip install nvidia-ml-py, or watch host memory with --source rss",
                )
        if self.pids and not self.torchrun:
            self._fixed = procs.from_pids(self.pids)

    @property
    def kind(self) -> str:
        return "gpu" if self._nvml is not None else "rss"

    def processes(self) -> list[procs.Proc]:
        return procs.torchrun_workers(self.pids) if self.torchrun else self._fixed

    def tick(self) -> Tick:
        at = time.time()
        gpu = self._nvml.per_pid() if self._nvml is not None else {}
        samples = []
        for p in self.processes():
            host = procs.host_memory(p.pid)
            if host is None:
                continue  # exited since it was listed
            if self._nvml is not None:
                g = gpu.get(p.pid)
                used, device, peak = (g.used, g.device, 0) if g else (0, None, 0)
            else:
                used, device, peak = host.rss, None, host.peak
            before = self._peaks.get(p.rank)
            if before is not None and before.pid == p.pid:
                peak = max(peak, before.peak)
            s = RankSample(
                rank=p.rank,
                pid=p.pid,
                name=p.name,
                source=self.kind,
                used=used,
                peak=max(peak, used),
                plan=self.plan.get(p.rank),
                device=device,
            )
            samples.append(s)
            self._peaks[p.rank] = s
        tick = Tick(index=self._ticks, at=at, samples=samples)
        self._ticks += 1
        for s in samples:
            if s.over(self.threshold) and s.rank not in self._over:
                tick.warnings.append(self.warning(s))
                self._over.add(s.rank)
            elif not s.over(self.threshold):
                self._over.discard(s.rank)
        return tick

    def warning(self, s: RankSample) -> str:
        from shardctl.units import fmt_in, pick_unit

        assert s.plan is not None and s.ratio is not None
        unit = pick_unit(max(s.used, s.plan))
        return (
            f"rank {s.rank} (pid {s.pid}) uses {fmt_in(s.used, unit)} of {self.kind} memory, "
            f"{s.ratio:.0%} of its plan {fmt_in(s.plan, unit)}: more than the "
            f"{self.threshold:.0%} threshold above it"
        )

    def summary(self) -> list[RankSample]:
        """The last sample of each rank seen, with its peak; rank order."""
        return [self._peaks[r] for r in sorted(self._peaks)]

    def exceeded(self) -> list[RankSample]:
        """Ranks whose peak went above plan × (1 + threshold)."""
        return [
            s
            for s in self.summary()
            if s.plan is not None and s.peak > s.plan * (1 + self.threshold)
        ]

    def close(self) -> None:
        if self._nvml is not None:
            self._nvml.close()
            self._nvml = None


def summary_json(watcher: Watcher) -> dict[str, Any]:
    return {
        "schema": WATCH_SCHEMA,
        "event": "summary",
        "threshold": watcher.threshold,
        "ranks": [
            {
                "rank": s.rank,
                "pid": s.pid,
                "source": s.source,
                "peak_bytes": s.peak,
                "plan_bytes": s.plan,
                "peak_ratio": None if not s.plan else round(s.peak / s.plan, 4),
                "exceeded": s in watcher.exceeded(),
            }
            for s in watcher.summary()
        ],
    }
