"""The verify report as rich renderables: one table per level, then per tensor / rank / figure.

Nothing here prints; the CLI passes :func:`render` to its console.
"""

from __future__ import annotations

from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from shardctl.verify.result import LevelResult, VerifyResult

MAX_ROWS = 40
_STYLE = {"pass": "green", "fail": "bold red", "not-run": "dim"}


def _status(s: str) -> Text:
    return Text(s.upper() if s != "not-run" else "not run", style=_STYLE.get(s, ""))


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v)


def summary(result: VerifyResult) -> Table:
    t = Table(title=f"verify {result.src} → {result.dst}", title_justify="left")
    t.add_column("level")
    t.add_column("status")
    t.add_column("seconds", justify="right")
    t.add_column("figures")
    for lv in result.levels:
        figs = {k: v for k, v in lv.figures.items() if not isinstance(v, dict)}
        t.add_row(
            lv.name,
            _status(lv.status),
            f"{lv.seconds:.2f}",
            ", ".join(f"{k}={_fmt(v)}" for k, v in list(figs.items())[:6]),
        )
    return t


def findings(lv: LevelResult) -> Table:
    t = Table(title=f"{lv.name}: {len(lv.findings)} finding(s)", title_justify="left")
    for col in ("tensor", "rank", "file", "what"):
        t.add_column(col, overflow="fold")
    for f in lv.findings[:MAX_ROWS]:
        t.add_row(f.fqn or "", "" if f.rank is None else str(f.rank), f.file or "", f.message)
    if len(lv.findings) > MAX_ROWS:
        t.add_row("…", "", "", f"{len(lv.findings) - MAX_ROWS} more (see --json)")
    return t


def tensors(lv: LevelResult) -> Table:
    t = Table(title="bitwise, per tensor", title_justify="left")
    for col in ("tensor", "shards", "bytes", "status"):
        t.add_column(col, justify="right" if col in ("shards", "bytes") else "left")
    rows = sorted(lv.rows, key=lambda r: r.get("status") != "fail")
    for r in rows[:MAX_ROWS]:
        t.add_row(r["fqn"], str(r["shards"]), str(r["bytes"]), _status(r["status"]))
    if len(rows) > MAX_ROWS:
        t.add_row(
            f"… {len(rows) - MAX_ROWS} more, all pass"
            if rows[MAX_ROWS - 1]["status"] == "pass"
            else "…",
            "",
            "",
            "",
        )
    return t


def forward(lv: LevelResult, result: VerifyResult) -> Table:
    env = result.environment
    where = f"{env.get('backend')} on {env.get('device')}, world {env.get('world_size')}" + (
        " (simulated in one process)" if env.get("simulated") else ""
    )
    t = Table(title=f"forward logits vs float64 reference — {where}", title_justify="left")
    for col in ("figure", "sharded", "unsharded", "bound", "status"):
        t.add_column(col, justify="left" if col in ("figure", "status") else "right")
    for r in lv.rows:
        t.add_row(
            r["figure"],
            _fmt(r["sharded"]),
            _fmt(r["unsharded"]),
            _fmt(r["bound"]),
            _status(r["status"]),
        )
    return t


def render(result: VerifyResult) -> RenderableType:
    parts: list[RenderableType] = [summary(result)]
    for lv in result.levels:
        if lv.name == "bitwise" and lv.rows:
            parts.append(tensors(lv))
        if lv.name == "forward" and lv.rows:
            parts.append(forward(lv, result))
        if lv.findings:
            parts.append(findings(lv))
    verdict = "EQUIVALENT" if result.ok else "NOT EQUIVALENT"
    parts.append(Text(verdict, style="bold green" if result.ok else "bold red"))
    return Group(*parts)
