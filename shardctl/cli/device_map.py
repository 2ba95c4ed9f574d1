"""``shardctl plan MANIFEST --device-map FILE``: one library call, a table, the files.

The map is written only when every unit fits (exit 0); otherwise nothing is written, the
reason goes to stderr and the exit code is 1.
"""

from __future__ import annotations

from pathlib import Path

import typer

from shardctl.cli._common import emit_json
from shardctl.errors import EXIT_NEGATIVE


def run_device_map(
    manifest_path: Path,
    out: Path,
    *,
    gpus: int | None,
    cpu_memory: str | None,
    offload_folder: Path | None,
    as_json: bool,
) -> None:
    from shardctl.manifest import load_manifest
    from shardctl.plan.device_map import plan_device_map, write_device_map
    from shardctl.units import parse_size

    cpu = None if cpu_memory is None else parse_size(cpu_memory, option="--cpu-memory")
    result = plan_device_map(
        load_manifest(manifest_path), gpus=gpus, cpu_memory=cpu, offload_folder=offload_folder
    )
    if as_json:
        emit_json(result.to_json())
    else:
        _render(result)
    if not result.fits:
        typer.echo(f"device map not written: {result.reason}", err=True)
        raise typer.Exit(EXIT_NEGATIVE)
    side = write_device_map(result, out)
    if not as_json:
        typer.echo(f"wrote {out} (device_map) and {side} (max_memory and loads)")


def _render(result: object) -> None:
    from rich.markup import escape
    from rich.table import Table

    from shardctl.plan.device_map import DeviceMapPlan
    from shardctl.plan.render import console_for_output
    from shardctl.units import fmt_bytes

    assert isinstance(result, DeviceMapPlan)
    table = Table(header_style="bold", box=None, pad_edge=False)
    for col in ("device", "layers", "modules", "weights", "kv cache", "activations", "overhead"):
        table.add_column(col, justify="left" if col in ("device", "layers") else "right")
    table.add_column("total", justify="right", style="bold")
    table.add_column("budget", justify="right")
    for ld in result.loads:
        layers = "—" if ld.layers is None else f"{ld.layers[0]}–{ld.layers[1]}"
        extra = [u.name for u in ld.units if not u.is_layer]
        if extra:
            layers += " + " + ", ".join(extra)
        table.add_row(
            escape(str(ld.device)),
            layers,
            str(sum(len(u.modules) for u in ld.units)),
            fmt_bytes(ld.weights),
            fmt_bytes(ld.kv_cache),
            fmt_bytes(ld.activations),
            fmt_bytes(ld.overhead),
            fmt_bytes(ld.total),
            "unlimited" if ld.budget is None else fmt_bytes(ld.budget),
        )
    console = console_for_output()
    console.print(table)
    verdict = "[green]fits[/green]" if result.fits else "[red]does not fit[/red]"
    console.print(f"device map: {verdict}")
