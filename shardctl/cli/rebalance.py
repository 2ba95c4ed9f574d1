"""``shardctl plan MANIFEST --from LAYOUT_DIR --gpus N``: the rebalance table or JSON."""

from __future__ import annotations

import shlex
from pathlib import Path

from shardctl.cli._common import emit_json

MAX_ROWS = 64


def run_rebalance(
    manifest: Path, layout_dir: Path, *, gpus: int | None, as_json: bool, all_ranks: bool
) -> None:
    from shardctl.errors import UsageError
    from shardctl.plan.rebalance import plan_rebalance

    if gpus is None:
        raise UsageError("--from needs --gpus N (the new GPU count)")
    result = plan_rebalance(manifest, layout_dir, gpus=gpus)
    if as_json:
        emit_json(result.to_json())
        return
    from rich.markup import escape
    from rich.table import Table

    from shardctl.plan.render import console_for_output
    from shardctl.units import fmt_bytes

    console = console_for_output()
    old = "HF checkpoint" if result.source_mesh is None else f"mesh {result.source_mesh}"
    console.print(
        f"from {escape(str(result.source))} ({old}, {fmt_bytes(result.source_bytes)}) to "
        f"{result.gpus} GPUs: best mesh [bold]{result.mesh}[/bold] "
        f"(peak {fmt_bytes(result.candidate.peak)} per GPU)"
    )
    if result.note:
        console.print(f"  note: {escape(result.note)}")
    table = Table(header_style="bold", box=None, pad_edge=False)
    for col in ("new rank", "coord", "old file", "reads"):
        table.add_column(col, justify="left" if col in ("coord", "old file") else "right")
    rows = [(r, f) for r in result.ranks for f in r.files]
    for n, (r, f) in enumerate(rows):
        if not all_ranks and n == MAX_ROWS:
            table.add_row("…", "…", f"{len(rows) - MAX_ROWS} more rows (--all-ranks)", "")
            break
        coord = " ".join(f"{k}{v}" for k, v in r.coord.items())
        table.add_row(str(r.rank), coord, escape(f.file), fmt_bytes(f.nbytes))
    console.print(table)
    ratio = result.move_bytes / result.full_reload_bytes if result.full_reload_bytes else 0.0
    console.print(
        f"movement: the new ranks read {fmt_bytes(result.move_bytes)} of the old files; a full "
        f"reload (every new rank reads the whole old checkpoint) reads "
        f"{fmt_bytes(result.full_reload_bytes)}: {ratio:.1%} of it"
    )
    console.print("run:", escape(shlex.join(result.command)), soft_wrap=True)
