"""``shardctl plan MANIFEST --search --quant FORMATS``: the joint table or JSON."""

from __future__ import annotations

from pathlib import Path

import typer

from shardctl.cli._common import emit_json
from shardctl.errors import EXIT_NEGATIVE


def run_quant_search(
    manifest: Path, quant: str, *, gpus: int | None, top: int, as_json: bool
) -> None:
    from shardctl.plan.quant_search import QUALITY, parse_formats, search_formats

    result = search_formats(manifest, parse_formats(quant), gpus=gpus, top=top)
    if as_json:
        emit_json(result.to_json())
    else:
        from rich.table import Table

        from shardctl.plan.render import console_for_output
        from shardctl.units import fmt_bytes

        console = console_for_output()
        table = Table(header_style="bold", box=None, pad_edge=False)
        for col in ("#", "format", "gpus", "mesh", "weights/rank", "peak/rank", "headroom"):
            table.add_column(col, justify="left" if col in ("format", "mesh") else "right")
        table.add_column("quality (source)")
        for i, row in enumerate(result.rows, 1):
            c = row.candidate
            note, source = QUALITY[row.format]
            table.add_row(
                str(i),
                row.format,
                str(c.world),
                str(c.mesh),
                fmt_bytes(row.weights_per_rank),
                fmt_bytes(c.peak),
                fmt_bytes(c.headroom),
                f"{note} ({source})",
            )
        console.print(
            f"layouts × weight formats on {result.gpus} GPUs, budget "
            f"{fmt_bytes(result.budget)} per GPU: by GPUs needed, then headroom"
        )
        console.print(table)
        for fmt, best in result.best.items():
            if best is None:
                console.print(f"  {fmt}: no layout fits")
        for line in result.fewer_gpus():
            console.print(f"  [green]{line}[/green]")
    if not result.has_fit:
        raise typer.Exit(EXIT_NEGATIVE)
