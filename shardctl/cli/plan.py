"""``shardctl plan``: manifest and overrides → one plan (or search) call → table or JSON."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from shardctl.cli._common import emit_json
from shardctl.errors import EXIT_NEGATIVE, UsageError


def plan(
    manifest: Annotated[
        Path, typer.Argument(help="YAML manifest: model, mesh, hardware, workload.")
    ],
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the plan as JSON (schema shardctl.plan/1).")
    ] = False,
    tp: Annotated[int | None, typer.Option(help="Override mesh.tp.", min=1)] = None,
    pp: Annotated[int | None, typer.Option(help="Override mesh.pp.", min=1)] = None,
    dp: Annotated[int | None, typer.Option(help="Override mesh.dp.", min=1)] = None,
    ep: Annotated[int | None, typer.Option(help="Override mesh.ep.", min=1)] = None,
    search: Annotated[
        bool, typer.Option("--search", help="Search every layout that fits the hardware.")
    ] = False,
    gpus: Annotated[
        int | None,
        typer.Option(
            help="With --search: GPUs available (default: hardware nodes × gpus_per_node).", min=1
        ),
    ] = None,
    top: Annotated[int, typer.Option(help="With --search: rows to print.", min=1)] = 10,
    report: Annotated[
        Path | None, typer.Option(help="Write the memory picture as SVG or HTML (by extension).")
    ] = None,
    weights_only: Annotated[
        bool,
        typer.Option(
            "--weights-only",
            help="Plan weights and overhead alone, on purpose (no KV cache, no activations).",
        ),
    ] = False,
    all_ranks: Annotated[
        bool,
        typer.Option("--all-ranks", help="One row and bar per rank (default: identical folded)."),
    ] = False,
) -> None:
    """Estimate per-device memory of a layout; exit 1 if a rank does not fit its budget
    (device memory × gpu_memory_utilization when serving, device memory when training).

    Example: [bold]shardctl plan manifests/llama-3-70b-tp8.yaml --json[/bold]
    """
    from shardctl.plan.api import make_plan, run_search

    overrides = {k: v for k, v in {"tp": tp, "pp": pp, "dp": dp, "ep": ep}.items() if v}
    if search:
        result = run_search(
            manifest, gpus=gpus, mesh_overrides=overrides, weights_only=weights_only
        )
        if as_json:
            emit_json(result.to_json())
        else:
            from shardctl.plan.render import render_search

            render_search(result, top=top)
        if not result.has_fit:
            raise typer.Exit(EXIT_NEGATIVE)
        return
    if gpus is not None:
        raise UsageError("--gpus is used only with --search", hint="add --search or drop --gpus")
    result_plan = make_plan(manifest, mesh_overrides=overrides, weights_only=weights_only)
    if report is not None:
        result_plan.write_report(report)
    if as_json:
        emit_json(result_plan.to_json())
    else:
        from shardctl.plan.render import render_plan

        render_plan(result_plan, all_ranks=all_ranks)
    if result_plan.fits is False:
        raise typer.Exit(EXIT_NEGATIVE)
