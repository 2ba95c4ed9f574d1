"""``shardctl watch``: live per-rank memory against the plan, as a table or JSON lines.

Exit 0 when every watched rank stayed within plan × (1 + threshold), 1 when one went above
(the summary names it); 130/143 when interrupted, after the summary.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from shardctl.errors import EXIT_NEGATIVE, Interrupted

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

    from shardctl.monitor.sampler import RankSample, Tick, Watcher

BAR_WIDTH = 30


def watch(
    plan: Annotated[
        Path | None,
        typer.Option(
            help="The plan to compare with: `shardctl plan … --json` output, or a manifest."
        ),
    ] = None,
    pid: Annotated[
        list[int] | None,
        typer.Option(help="A process to watch (repeat); rank from its RANK variable, else order."),
    ] = None,
    torchrun: Annotated[
        bool,
        typer.Option(
            "--torchrun",
            help="Watch the workers of the torchrun job on this host (with --pid: of that "
            "launcher).",
        ),
    ] = False,
    threshold: Annotated[
        str, typer.Option(help='Warn when a rank uses more than plan × (1 + this): "10%", 0.1.')
    ] = "10%",
    interval: Annotated[float, typer.Option(help="Seconds between samples.", min=0.0)] = 1.0,
    count: Annotated[
        int | None, typer.Option(help="Stop after N samples (default: until the job ends).", min=1)
    ] = None,
    once: Annotated[bool, typer.Option("--once", help="One sample, then the summary.")] = False,
    as_json: Annotated[
        bool, typer.Option("--json", help="JSON lines (schema shardctl.watch/1) on stdout.")
    ] = False,
    source: Annotated[
        str, typer.Option(help="auto (GPU through NVML when there is one), gpu, or rss.")
    ] = "auto",
) -> None:
    """Per-rank memory of a running job against the plan's per-rank figures.

    Example: [bold]shardctl watch --plan plan.json --torchrun[/bold]
    """
    from shardctl.monitor.sampler import Watcher, load_plan_figures, parse_threshold

    figures = load_plan_figures(plan) if plan is not None else {}
    watcher = Watcher(
        pids=list(pid or []),
        torchrun=torchrun,
        plan=figures,
        threshold=parse_threshold(threshold),
        source=source,
    )
    limit = 1 if once else count
    try:
        _loop(watcher, limit=limit, interval=interval, as_json=as_json)
    except (KeyboardInterrupt, Interrupted):
        _summary(watcher, as_json=as_json)
        raise
    finally:
        watcher.close()
    _summary(watcher, as_json=as_json)
    if watcher.exceeded():
        raise typer.Exit(EXIT_NEGATIVE)


def _loop(watcher: Watcher, *, limit: int | None, interval: float, as_json: bool) -> None:
    from rich.live import Live

    from shardctl.plan.render import console_for_output

    console = console_for_output()
    live = (
        Live(console=console, auto_refresh=False) if console.is_terminal and not as_json else None
    )
    seen_any = False
    n = 0
    if live is not None:
        live.start()
    try:
        while limit is None or n < limit:
            if n:
                time.sleep(interval)
            tick = watcher.tick()
            n += 1
            if seen_any and not tick.samples:
                break  # the job ended
            seen_any = seen_any or bool(tick.samples)
            if as_json:
                _json_tick(watcher, tick)
            elif live is not None:
                live.update(_table(watcher, tick), refresh=True)
            else:
                console.print(_table(watcher, tick))
            for w in tick.warnings:
                typer.echo(f"warning: {w}", err=True)
    finally:
        if live is not None:
            live.stop()


def _json_tick(watcher: Watcher, tick: Tick) -> None:
    for s in tick.samples:
        line = s.to_json(tick=tick.index, at=tick.at, threshold=watcher.threshold)
        sys.stdout.write(json.dumps(line) + "\n")
    sys.stdout.flush()


def _table(watcher: Watcher, tick: Tick) -> Table:
    from rich.markup import escape
    from rich.table import Table

    from shardctl.units import fmt_bytes

    # Each size in its own unit: a job's RSS (MiB) beside a plan's GPU figure (GiB).
    table = Table(
        title=f"tick {tick.index} · {watcher.kind} memory · threshold {watcher.threshold:.0%}",
        header_style="bold",
        box=None,
    )
    for col in ("rank", "pid", "process", "used", "peak", "plan", "", "of plan"):
        table.add_column(col, justify="left" if col in ("process", "") else "right")
    if not tick.samples:
        table.add_row("—", "—", "no process yet", "", "", "", "", "")
    for s in tick.samples:
        over = s.over(watcher.threshold)
        ratio = "—" if s.ratio is None else f"{s.ratio:.0%}"
        table.add_row(
            str(s.rank),
            str(s.pid),
            escape(s.name) + ("" if s.device is None else f" · gpu{s.device}"),
            fmt_bytes(s.used),
            fmt_bytes(s.peak),
            fmt_bytes(s.plan),
            _bar(s, watcher.threshold),
            f"[red]{ratio}[/red]" if over else ratio,
        )
    return table


def _bar(s: RankSample, threshold: float) -> str:
    """``███████░░░░│`` — used against plan (the ``│``), red past plan × (1 + threshold)."""
    if s.plan is None:
        return ""
    scale = max(s.plan * (1 + threshold), s.used, 1)
    used = min(round(s.used / scale * BAR_WIDTH), BAR_WIDTH)
    mark = min(round(s.plan / scale * BAR_WIDTH), BAR_WIDTH)
    colour = "red" if s.over(threshold) else "green"
    cells = "".join(
        "│" if i == mark and i >= used else ("█" if i < used else "░") for i in range(BAR_WIDTH + 1)
    )
    return f"[{colour}]{cells[:used]}[/{colour}]{cells[used:]}"


def _summary(watcher: Watcher, *, as_json: bool) -> None:
    from shardctl.monitor.sampler import summary_json

    if as_json:
        sys.stdout.write(json.dumps(summary_json(watcher)) + "\n")
        sys.stdout.flush()
        return
    from shardctl.plan.render import console_for_output

    _print_summary(watcher, console_for_output())


def _print_summary(watcher: Watcher, console: Console) -> None:
    from shardctl.units import fmt_bytes

    ranks = watcher.summary()
    if not ranks:
        console.print("summary: no rank was seen")
        return
    console.print("summary (peak per rank vs plan):")
    exceeded = {s.rank for s in watcher.exceeded()}
    for s in ranks:
        plan = "no plan figure" if s.plan is None else f"plan {fmt_bytes(s.plan)}"
        share = "" if not s.plan else f" ({s.peak / s.plan:.0%})"
        flag = "  [red]over the threshold[/red]" if s.rank in exceeded else ""
        console.print(f"  rank {s.rank}: peak {fmt_bytes(s.peak)}{share}, {plan}{flag}")
