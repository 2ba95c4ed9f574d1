"""Pictures of a plan: per-rank stacked memory bars in the terminal (rich) and as an SVG or
HTML file for a pull request or a wiki (``--report FILE``), plus the search table.

The SVG is written by hand (plain text, no plotting dependency). One bar per model-parallel
coordinate ``(pp, ep, tp)``; ``dp`` replicas hold the same and are folded. The load-balance line
is max/mean of the stages' fullest ranks; a stage more than 10 % above the mean is flagged.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardctl.console import console_for_output
from shardctl.errors import UsageError
from shardctl.plan.groups import fold
from shardctl.units import fmt_in, pick_unit

COMPONENTS = ("weights", "kv_cache", "activations", "gradients", "optimizer", "overhead")
COLORS = {  # colour-blind-safe (Okabe–Ito)
    "weights": "#0072B2",
    "kv_cache": "#E69F00",
    "activations": "#009E73",
    "gradients": "#CC79A7",
    "optimizer": "#D55E00",
    "overhead": "#999999",
}
RICH_COLORS = {
    "weights": "blue",
    "kv_cache": "yellow",
    "activations": "green",
    "gradients": "magenta",
    "optimizer": "red",
    "overhead": "grey50",
}
IMBALANCE = 0.10
MAX_BARS = 64


@dataclass(frozen=True)
class Bar:
    label: str  # "rank 8 · pp1 tp0"
    stage: int
    parts: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.parts.values())


def bars(plan: Any, *, all_ranks: bool = False) -> list[Bar]:
    """Bars of a plan: for a ``PlanResult`` one per group of identical neighbouring ranks
    (:mod:`shardctl.plan.groups`; one per rank with ``all_ranks``), for a
    :class:`~shardctl.plan.memory.MemoryPlan` one per ``(pp, ep, tp)``."""
    out = []
    if hasattr(plan, "coords"):
        mesh = plan.mesh
        for (p, e, t), m in sorted(plan.coords.items()):
            rank = mesh.rank(pp=p, ep=e, tp=t)
            out.append(Bar(_label(rank, p, e, t, mesh), p, {k: getattr(m, k) for k in COMPONENTS}))
        return out
    from shardctl.plan.groups import group_ranks

    rows = ((r.rank, r.coord, r.stage, r.memory) for r in plan.ranks)
    for g in group_ranks(rows, all_ranks=all_ranks):
        parts = {k: int(g.memory.get(k, 0)) for k in COMPONENTS}
        out.append(Bar(g.label(plan.mesh), g.stage, parts))
    return out


def _label(rank: int, p: int, e: int, t: int, mesh: Any) -> str:
    coord = " ".join(
        f"{a}{v}" for a, v in (("pp", p), ("ep", e), ("tp", t)) if getattr(mesh, a) > 1
    )
    return f"rank {rank}" + (f" · {coord}" if coord else "")


def stage_balance(items: Sequence[Bar]) -> tuple[float, list[str]]:
    """(max/mean of the stages' fullest ranks, warnings for stages > 10 % above the mean)."""
    peaks: dict[int, int] = {}
    for b in items:
        peaks[b.stage] = max(peaks.get(b.stage, 0), b.total)
    if not peaks:
        return 1.0, []
    mean = sum(peaks.values()) / len(peaks)
    if not mean:
        return 1.0, []
    warnings = [
        f"stage {s} is {100 * (p / mean - 1):.0f}% heavier than the mean stage"
        for s, p in sorted(peaks.items())
        if len(peaks) > 1 and p > (1 + IMBALANCE) * mean
    ]
    return max(peaks.values()) / mean, warnings


def _fold(items: list[Bar], *, all_ranks: bool = False) -> list[Bar | None]:
    return list(items) if all_ranks else fold(items, MAX_BARS)


# -- terminal ----------------------------------------------------------------------------


def render_bars(
    plan: Any,
    *,
    console: Any = None,
    width: int = 48,
    all_ranks: bool = False,
    unit: tuple[str, int] | None = None,
) -> None:
    """Stacked bars in the terminal (one per group of identical ranks, or per rank with
    ``all_ranks``), a legend, the load-balance line and warnings; the ``│`` marks the budget."""
    from rich.markup import escape
    from rich.text import Text

    console = console or console_for_output()
    items = bars(plan, all_ranks=all_ranks)
    limit = getattr(plan, "budget", None)
    scale = max([b.total for b in items] + ([limit] if limit else []) + [1])
    unit = unit or pick_unit(scale)
    label_w = max((len(b.label) for b in items), default=4)
    legend = Text("  ")
    for k in COMPONENTS:
        legend.append("■ ", style=RICH_COLORS[k]).append(k.replace("_", " ") + "  ")
    console.print(legend)
    for b in _fold(items, all_ranks=all_ranks):
        if b is None:
            console.print("  …")
            continue
        line = Text(f"  {b.label:<{label_w}} ")
        used = 0
        for k in COMPONENTS:
            cells = round(b.parts[k] / scale * width)
            cells = min(cells, width - used)
            line.append("█" * cells, style=RICH_COLORS[k])
            used += cells
        mark = width if limit is None else round(limit / scale * width)
        line.append(" " * max(mark - used, 0) + ("│" if limit else ""))
        line.append(f" {fmt_in(b.total, unit)}")
        console.print(line)
    ratio, warnings = stage_balance(items)
    console.print(f"  load balance (max/mean of stage peaks): {ratio:.3f}")
    for w in warnings:
        console.print(f"  [yellow]warning:[/yellow] {escape(w)}")


def render_search_table(result: Any, *, top: int, console: Any = None) -> None:
    """The top ``top`` layouts of a :class:`~shardctl.plan.search.SearchResult` and the
    rejection counts."""
    from rich.table import Table

    console = console or console_for_output()
    unit = pick_unit(max([c.peak for c in result.candidates] + [result.budget or 0, 1]))
    table = Table(show_header=True, header_style="bold", box=None, pad_edge=False)
    cols = ["#", "gpus", "tp", "pp", "dp", "ep"]
    if result.mode == "training":
        cols += ["zero", "recompute"]
    cols += ["peak", "headroom", f"comm/{result.unit}"]
    for c in cols:
        table.add_column(c, justify="left" if c == "recompute" else "right")
    for i, c in enumerate(result.top(top), 1):
        m = c.mesh
        row = [str(i), str(c.world), str(m.tp), str(m.pp), str(m.dp), str(m.ep)]
        if result.mode == "training":
            row += [str(c.zero), str(c.recompute)]
        row += [
            fmt_in(c.peak, unit),
            "—" if c.headroom is None else fmt_in(c.headroom, unit),
            _fmt_time(c.comm_time),
        ]
        table.add_row(*row)
    console.print(table)
    verdict = f"{len(result.candidates)} of {result.priced} priced layouts fit"
    console.print(f"{verdict} (objective: {result.objective}; {result.seconds:.2f} s)")
    if result.rejected:
        reasons = ", ".join(f"{k} {v:,}" for k, v in sorted(result.rejected.items()))
        console.print(f"rejected: {reasons}")
    for note in result.notes:
        console.print(f"note: {note}")


def _fmt_time(s: float) -> str:
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.1f} µs"


# -- files -------------------------------------------------------------------------------


def svg(plan: Any, *, title: str = "shardctl plan: memory per rank") -> str:
    """The stacked-bar picture as a standalone SVG document."""
    items = bars(plan)
    shown = _fold(items)
    limit = getattr(plan, "budget", None)
    scale = max([b.total for b in items] + ([limit] if limit else []) + [1])
    unit = pick_unit(scale)
    row_h, label_w, bar_w, top = 18, 170, 560, 56
    ratio, warnings = stage_balance(items)
    height = top + row_h * len(shown) + 40 + 16 * len(warnings)
    width = label_w + bar_w + 110
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="11">',
        f"<title>{html.escape(title)}</title>",
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<text x="8" y="18" font-size="14" font-weight="bold">{html.escape(title)}</text>',
    ]
    x = 8
    for k in COMPONENTS:
        out.append(f'<rect x="{x}" y="28" width="10" height="10" fill="{COLORS[k]}"/>')
        out.append(f'<text x="{x + 14}" y="37">{k.replace("_", " ")}</text>')
        x += 24 + 7 * len(k)
    for i, b in enumerate(shown):
        y = top + i * row_h
        if b is None:
            out.append(f'<text x="8" y="{y + 12}">…</text>')
            continue
        out.append(f'<text x="8" y="{y + 12}">{html.escape(b.label)}</text>')
        bx = float(label_w)
        for k in COMPONENTS:
            w = b.parts[k] / scale * bar_w
            if w > 0:
                out.append(
                    f'<rect x="{bx:.1f}" y="{y + 2}" width="{w:.1f}" height="{row_h - 4}" '
                    f'fill="{COLORS[k]}"><title>{k}: {fmt_in(b.parts[k], unit)}</title></rect>'
                )
            bx += w
        out.append(f'<text x="{bx + 4:.1f}" y="{y + 12}">{fmt_in(b.total, unit)}</text>')
    bottom = top + row_h * len(shown)
    if limit:
        lx = label_w + limit / scale * bar_w
        out.append(
            f'<line x1="{lx:.1f}" y1="{top - 4}" x2="{lx:.1f}" y2="{bottom}" stroke="black" '
            'stroke-dasharray="4 3"/>'
        )
        out.append(f'<text x="{lx - 40:.1f}" y="{top - 6}">budget {fmt_in(limit, unit)}</text>')
    out.append(
        f'<text x="8" y="{bottom + 20}">load balance (max/mean of stage peaks): {ratio:.3f}</text>'
    )
    for j, w in enumerate(warnings):
        out.append(
            f'<text x="8" y="{bottom + 36 + 16 * j}" fill="#D55E00">warning: '
            f"{html.escape(w)}</text>"
        )
    out.append("</svg>")
    return "\n".join(out) + "\n"


def html_report(plan: Any) -> str:
    """The SVG inside a small HTML page, with the numbers as a table."""
    items = bars(plan)
    head = "".join(f"<th>{k.replace('_', ' ')}</th>" for k in COMPONENTS)
    rows = "".join(
        f"<tr><td>{html.escape(b.label)}</td><td>{b.stage}</td>"
        + "".join(f"<td>{b.parts[k]:,}</td>" for k in COMPONENTS)
        + f"<td><b>{b.total:,}</b></td></tr>"
        for b in items
    )
    return (
        "<!doctype html>\n<html><head><meta charset='utf-8'><title>shardctl plan</title>"
        "<style>body{font-family:sans-serif}td,th{padding:2px 8px;text-align:right}"
        "</style></head><body>\n"
        + svg(plan)
        + f"<table><tr><th>rank</th><th>stage</th>{head}<th>total (bytes)</th></tr>{rows}"
        "</table>\n</body></html>\n"
    )


def write_report(plan: Any, path: Path) -> None:
    """Write ``path`` as SVG (``.svg``) or HTML (``.html``/``.htm``)."""
    suffix = Path(path).suffix.lower()
    if suffix == ".svg":
        text = svg(plan)
    elif suffix in (".html", ".htm"):
        text = html_report(plan)
    else:
        raise UsageError(
            f"--report {path}: unknown picture format {suffix or '(none)'!r}",
            hint="name the file *.svg or *.html",
        )
    Path(path).write_text(text, encoding="utf-8")
