"""What ``verify`` returns: one result per level, figures, findings, tolerances, environment.

JSON (``VerifyResult.to_json()``), schema ``shardctl.verify/1``::

    {"schema": "shardctl.verify/1", "ok": false, "src": "...", "dst": "...",
     "level": "forward",                       # the level asked for (levels are cumulative)
     "levels": [{"name": "structure", "status": "pass", "seconds": 0.01,
                 "figures": {"tensors": 21, "shards": 84}, "findings": [], "rows": [...]},
                {"name": "bitwise", "status": "fail", "figures": {...},
                 "findings": [{"message": "...", "fqn": "...", "rank": 1, "file": "..."}]},
                {"name": "forward", "status": "not-run", ...}],
     "tolerances": {"forward": {"multiple": 4.0, "floors": {...}, "bounds": {...}}},
     "environment": {"torch": "2.13.0", "device": "cpu", "backend": "gloo",
                     "world_size": 4, "simulated": false, "launcher": "local"}}

``status`` is ``pass``, ``fail`` or ``not-run`` (an earlier level failed). ``rows`` are the
per-tensor / per-rank lines of the report table.
"""

from __future__ import annotations

from collections.abc import Sequence
from copy import deepcopy
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from typing import Any

SCHEMA = "shardctl.verify/1"
LEVELS: tuple[str, ...] = ("structure", "bitwise", "forward")


@dataclass
class Finding:
    """One reason a level failed, naming what it can: tensor, rank, file."""

    message: str
    fqn: str | None = None
    rank: int | None = None
    file: str | None = None

    def __str__(self) -> str:
        where = ", ".join(
            x
            for x in (self.fqn, f"rank {self.rank}" if self.rank is not None else None, self.file)
            if x
        )
        return f"{where}: {self.message}" if where else self.message


@dataclass
class LevelResult:
    name: str
    status: str = "not-run"
    figures: dict[str, Any] = field(default_factory=dict)
    findings: list[Finding] = field(default_factory=list)
    # a list, or a lazy sequence (the bitwise level's ``TensorRows``: 90,000 tensors)
    rows: Sequence[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status == "pass"

    def fail(self, message: str, **where: Any) -> None:
        self.findings.append(Finding(message, **where))

    def close(self) -> LevelResult:
        self.status = "fail" if self.findings else "pass"
        return self


@dataclass
class VerifyResult:
    src: str
    dst: str
    level: str
    levels: list[LevelResult]
    tolerances: dict[str, Any] = field(default_factory=dict)
    environment: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """Equivalent: every level up to the one asked for passed."""
        wanted = LEVELS[: LEVELS.index(self.level) + 1]
        by_name = {lv.name: lv for lv in self.levels}
        return all(name in by_name and by_name[name].ok for name in wanted)

    @property
    def failed_level(self) -> LevelResult | None:
        return next((lv for lv in self.levels if lv.status == "fail"), None)

    def level_result(self, name: str) -> LevelResult:
        return next(lv for lv in self.levels if lv.name == name)

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "ok": self.ok,
            "src": self.src,
            "dst": self.dst,
            "level": self.level,
            "levels": [_level_json(lv) for lv in self.levels],
            "tolerances": self.tolerances,
            "environment": self.environment,
        }


_ATOMS = (str, int, float, bool, type(None))


def _level_json(lv: LevelResult) -> dict[str, Any]:
    """``asdict(lv)``, with the rows (one per tensor: 90,000 of them) copied by a plain loop
    rather than ``asdict``'s recursive deep copy (8 s at 90,000 tensors)."""
    return {
        f.name: _rows(lv.rows) if f.name == "rows" else _plain(getattr(lv, f.name))
        for f in fields(lv)
    }


def _rows(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v if type(v) in _ATOMS else _plain(v) for k, v in row.items()} for row in rows]


def _plain(v: Any) -> Any:
    """A deep copy of JSON-like data, as ``asdict`` makes it (dataclasses become dicts)."""
    if type(v) in _ATOMS:
        return v
    if isinstance(v, dict):
        return type(v)((_plain(k), _plain(x)) for k, x in v.items())
    if isinstance(v, tuple) and hasattr(v, "_fields"):  # a namedtuple, as asdict keeps it
        return type(v)(*map(_plain, v))
    if isinstance(v, (list, tuple)):
        return type(v)(map(_plain, v))
    if is_dataclass(v) and not isinstance(v, type):
        return asdict(v)
    return deepcopy(v)
