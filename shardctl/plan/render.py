"""Terminal rendering of a plan (rich). The only module of ``shardctl.plan`` that prints."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

if TYPE_CHECKING:
    from shardctl.plan.api import PlanResult

MEMORY_COLUMNS = ("weights", "kv_cache", "activations", "gradients", "optimizer", "overhead")


def fmt_bytes(n: int | float | None) -> str:
    """``16060522496`` -> ``"14.96 GiB"`` (binary units, as GPU memory is sold in GiB)."""
    if n is None:
        return "—"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(value) < 1024 or unit == "PiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _rank_rows(result: PlanResult) -> list[tuple[str, str, Any]]:
    """One row per model-parallel coordinate; dp replicas hold the same and are folded."""
    rows = []
    dp = result.mesh.dp
    for r in result.ranks:
        c = r.coord
        if c["dp"] != 0:
            continue
        label = str(r.rank) if dp == 1 else f"{r.rank} (+{dp - 1} dp)"
        coord = " ".join(f"{a}{c[a]}" for a in ("pp", "ep", "tp") if getattr(result.mesh, a) > 1)
        rows.append((label, coord or "—", r))
    return rows


def render_plan(result: PlanResult, console: Console | None = None) -> None:
    console = console or Console()
    model = result.model
    m = result.mesh
    console.print(
        f"[bold]{escape(model.architecture)}[/bold]  {model.parameters:,} parameters  "
        f"{fmt_bytes(model.weight_bytes)} ({model.weight_bytes:,} B, {model.dtype})  "
        f"mesh {m} = {m.world} GPUs"
    )
    stage_bytes = result.stage_weight_bytes()
    for s, w in zip(result.stages, stage_bytes, strict=True):
        layers = "no layers" if s.layers is None else f"layers {s.layers[0]}–{s.layers[1]}"
        console.print(f"  stage {s.index}: {layers} ({s.num_layers}), weights {fmt_bytes(w)}")
    if len(stage_bytes) > 1 and sum(stage_bytes) > 0:
        mean = sum(stage_bytes) / len(stage_bytes)
        console.print(f"  load balance (max/mean weights per stage): {max(stage_bytes) / mean:.3f}")

    table = Table(show_header=True, header_style="bold", box=None, pad_edge=False)
    table.add_column("rank", justify="right")
    table.add_column("coord")
    table.add_column("stage", justify="right")
    active = [k for k in MEMORY_COLUMNS if any(r.memory[k] for r in result.ranks)] or ["weights"]
    for k in active:
        table.add_column(k.replace("_", " "), justify="right")
    table.add_column("total", justify="right", style="bold")
    if result.device_memory is not None:
        table.add_column("fits", justify="center")
    rows = _rank_rows(result)
    if len(rows) > 64:
        rows = [*rows[:32], ("…", "…", None), *rows[-31:]]
    for label, coord, r in rows:
        if r is None:
            table.add_row(label, coord, "…", *["…"] * (len(active) + 1))
            continue
        cells = [
            label,
            coord,
            str(r.stage),
            *(fmt_bytes(r.memory[k]) for k in active),
            fmt_bytes(r.total),
        ]
        if result.device_memory is not None:
            cells.append(
                "[green]yes[/green]" if r.total <= result.device_memory else "[red]no[/red]"
            )
        table.add_row(*cells)
    console.print(table)
    from shardctl.plan.report import render_bars

    render_bars(result, console=console)
    if result.device_memory is not None:
        worst = max(result.ranks, key=lambda r: r.total)
        verdict = "[green]fits[/green]" if result.fits else "[red]does not fit[/red]"
        console.print(
            f"{verdict}: largest rank {worst.rank} needs {fmt_bytes(worst.total)} of "
            f"{fmt_bytes(result.device_memory)} "
            f"({worst.total / result.device_memory:.1%})"
        )


def render_search(result: Any, *, top: int, console: Console | None = None) -> None:
    from shardctl.plan.search import render_search_table

    render_search_table(result, top=top, console=console or Console())
