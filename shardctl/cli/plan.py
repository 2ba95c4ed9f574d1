"""``shardctl plan``: a manifest (or a config / checkpoint plus flags) → one
:func:`shardctl.api.plan` (or ``search``) call → table or JSON."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from shardctl.cli._common import emit_json
from shardctl.errors import EXIT_NEGATIVE, UsageError

if TYPE_CHECKING:
    from shardctl.manifest import Manifest


def plan(
    source: Annotated[
        Path,
        typer.Argument(
            help="YAML manifest; or a config.json or checkpoint directory, described by flags."
        ),
    ],
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the plan as JSON (schema shardctl.plan/1).")
    ] = False,
    tp: Annotated[int | None, typer.Option(help="Override mesh.tp.", min=1)] = None,
    pp: Annotated[int | None, typer.Option(help="Override mesh.pp.", min=1)] = None,
    dp: Annotated[int | None, typer.Option(help="Override mesh.dp.", min=1)] = None,
    ep: Annotated[int | None, typer.Option(help="Override mesh.ep.", min=1)] = None,
    gpu: Annotated[
        str | None, typer.Option(help="Config/checkpoint only: GPU preset, e.g. h100-sxm.")
    ] = None,
    nodes: Annotated[
        int | None,
        typer.Option(help="Config/checkpoint only: nodes (default: enough for the mesh).", min=1),
    ] = None,
    gpus_per_node: Annotated[
        int | None, typer.Option(help="Config/checkpoint only: GPUs per node (8).", min=1)
    ] = None,
    batch: Annotated[
        int | None, typer.Option(help="Config/checkpoint only: concurrent sequences.", min=1)
    ] = None,
    seq: Annotated[
        int | None, typer.Option(help="Config/checkpoint only: tokens per sequence.", min=0)
    ] = None,
    dtype: Annotated[
        str | None, typer.Option(help="Config only: weight dtype (default: the config's).")
    ] = None,
    quantization: Annotated[
        str | None, typer.Option(help="Config/checkpoint only: quantization method (mxfp4 …).")
    ] = None,
    emit_manifest: Annotated[
        Path | None,
        typer.Option(help="Config/checkpoint only: write the manifest the flags imply."),
    ] = None,
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
    only_weights: Annotated[
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

    Examples: [bold]shardctl plan manifests/llama-3-70b-tp8.yaml --json[/bold];
    [bold]shardctl plan ./Llama-3-8B --tp 8 --gpu h100-sxm --batch 32 --seq 8192[/bold]
    """
    from shardctl.api import plan as make_plan
    from shardctl.api import search as run_search
    from shardctl.manifest.from_flags import PlanFlags, emit, manifest_from_flags, source_kind

    flags = PlanFlags(
        tp, pp, dp, ep, gpu, nodes, gpus_per_node, batch, seq, dtype, quantization, only_weights
    )
    overrides = {k: v for k, v in {"tp": tp, "pp": pp, "dp": dp, "ep": ep}.items() if v}
    target: Path | Manifest = source  # a manifest path goes to the API as given
    implied: str | None = None
    if source_kind(source) == "manifest":
        given = flags.model_flags() + (["--emit-manifest"] if emit_manifest else [])
        if given:
            raise UsageError(
                f"{', '.join(given)}: only with a config.json or checkpoint directory",
                hint="a manifest says these itself: edit its hardware/workload sections",
            )
    else:
        target, implied = manifest_from_flags(source, flags)
        overrides = {}  # the mesh flags are in the manifest already
    if search:
        result = run_search(target, gpus=gpus, only_weights=only_weights)
        if emit_manifest is not None and implied is not None:
            emit(emit_manifest, implied)  # only once the input planned: exit 3 writes nothing
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
    result_plan = make_plan(target, mesh=overrides, only_weights=only_weights)
    if emit_manifest is not None and implied is not None:
        emit(emit_manifest, implied)
    if report is not None:
        result_plan.write_report(report)
    if as_json:
        emit_json(result_plan.to_json())
    else:
        from shardctl.plan.render import render_plan

        render_plan(result_plan, all_ranks=all_ranks)
    if result_plan.fits is False:
        raise typer.Exit(EXIT_NEGATIVE)
