"""``shardctl plan``: a manifest (or a config / checkpoint plus flags) and overrides → one
:func:`shardctl.api.plan` (or ``search``) call → table or JSON."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from shardctl.cli._common import MAX_AXIS, MAX_TOP, emit_json
from shardctl.errors import EXIT_NEGATIVE, UsageError
from shardctl.manifest.fields import MAX_DIM

if TYPE_CHECKING:
    from shardctl.manifest import Manifest
    from shardctl.plan.api import PlanResult


def plan(
    manifest: Annotated[
        Path,
        typer.Argument(
            help="YAML manifest; or a config.json or checkpoint directory, described by flags."
        ),
    ],
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the plan as JSON (schema shardctl.plan/1).")
    ] = False,
    tp: Annotated[int | None, typer.Option(help="Override mesh.tp.", min=1, max=MAX_AXIS)] = None,
    pp: Annotated[int | None, typer.Option(help="Override mesh.pp.", min=1, max=MAX_AXIS)] = None,
    dp: Annotated[int | None, typer.Option(help="Override mesh.dp.", min=1, max=MAX_AXIS)] = None,
    ep: Annotated[int | None, typer.Option(help="Override mesh.ep.", min=1, max=MAX_AXIS)] = None,
    gpu: Annotated[
        str | None, typer.Option(help="Config/checkpoint only: GPU preset, e.g. h100-sxm.")
    ] = None,
    nodes: Annotated[
        int | None,
        typer.Option(
            help="Config/checkpoint only: nodes (default: enough for the mesh).",
            min=1,
            max=MAX_AXIS,
        ),
    ] = None,
    gpus_per_node: Annotated[
        int | None,
        typer.Option(help="Config/checkpoint only: GPUs per node (8).", min=1, max=MAX_AXIS),
    ] = None,
    batch: Annotated[
        int | None,
        typer.Option(help="Config/checkpoint only: concurrent sequences.", min=1, max=MAX_DIM),
    ] = None,
    seq: Annotated[
        int | None,
        typer.Option(help="Config/checkpoint only: tokens per sequence.", min=0, max=MAX_DIM),
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
    only_weights: Annotated[
        bool,
        typer.Option(
            "--weights-only",
            help="Plan weights and overhead alone, on purpose (no KV cache, no activations).",
        ),
    ] = False,
    search: Annotated[
        bool, typer.Option("--search", help="Search every layout that fits the hardware.")
    ] = False,
    gpus: Annotated[
        int | None,
        typer.Option(
            help="With --search: GPUs available (default: hardware nodes × gpus_per_node). "
            "With --device-map: GPUs of the one node (default: hardware.gpus_per_node; 0: CPU "
            "and disk only).",
            min=0,
            max=MAX_AXIS,
        ),
    ] = None,
    top: Annotated[
        int, typer.Option(help="With --search: rows to print.", min=1, max=MAX_TOP)
    ] = 10,
    report: Annotated[
        Path | None, typer.Option(help="Write the memory picture as SVG or HTML (by extension).")
    ] = None,
    all_ranks: Annotated[
        bool,
        typer.Option("--all-ranks", help="One row and bar per rank (default: identical folded)."),
    ] = False,
    max_imbalance: Annotated[
        float | None,
        typer.Option(
            "--max-imbalance",
            help="Exit 1 when max/mean of stage peaks exceeds R (a CI gate on the PP split).",
            min=1.0,
            metavar="R",
        ),
    ] = None,
    device_map: Annotated[
        Path | None,
        typer.Option(
            "--device-map",
            help="Write an accelerate/transformers device_map (JSON) that fits each device's "
            "budget incl. KV cache and activations, and FILE's .max_memory.json beside it.",
            metavar="FILE",
        ),
    ] = None,
    offload_folder: Annotated[
        Path | None,
        typer.Option(help="With --device-map: allow disk offload into this folder."),
    ] = None,
    quant: Annotated[
        str | None,
        typer.Option(
            help="With --search: weight formats searched with the layouts, e.g. "
            "bf16,fp8,int8,int4-awq,nvfp4, or any.",
            metavar="FORMATS",
        ),
    ] = None,
    from_layout: Annotated[
        Path | None,
        typer.Option(
            "--from",
            help="Rebalance: from this shardctl layout or HF dir to --gpus N: the best mesh, "
            "the bytes each new rank reads from which old files, the reshard command.",
            metavar="LAYOUT_DIR",
        ),
    ] = None,
    cpu_memory: Annotated[
        str | None,
        typer.Option(help="With --device-map: CPU budget, e.g. 200GiB (default: this host's RAM)."),
    ] = None,
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
    target: Path | Manifest = manifest  # a manifest path goes to the API as given
    implied: str | None = None
    if source_kind(manifest) == "manifest":
        given = flags.model_flags() + (["--emit-manifest"] if emit_manifest else [])
        if given:
            raise UsageError(
                f"{', '.join(given)}: only with a config.json or checkpoint directory",
                hint="a manifest says these itself: edit its hardware/workload sections",
            )
    else:
        other = [n for n, v in (("--device-map", device_map), ("--from", from_layout),
                                ("--quant", quant)) if v is not None]  # fmt: skip
        if other:
            raise UsageError(
                f"{', '.join(other)}: needs a manifest",
                hint="write one with --emit-manifest FILE, then plan FILE",
            )
        target, implied = manifest_from_flags(manifest, flags)

    if search and max_imbalance is not None:
        raise UsageError("--max-imbalance gates one plan", hint="drop --search")
    _check_modes(
        search=search,
        device_map=device_map,
        from_layout=from_layout,
        mesh_given=any(v is not None for v in (tp, pp, dp, ep)),
        plan_only=max_imbalance is not None or report is not None,
    )
    if from_layout is not None:
        from shardctl.cli.rebalance import run_rebalance

        run_rebalance(manifest, from_layout, gpus=gpus, as_json=as_json, all_ranks=all_ranks)
        return
    if device_map is not None:
        from shardctl.cli.device_map import run_device_map

        run_device_map(
            manifest,
            device_map,
            gpus=gpus,
            cpu_memory=cpu_memory,
            offload_folder=offload_folder,
            as_json=as_json,
        )
        return
    if offload_folder is not None or cpu_memory is not None:
        raise UsageError("--offload-folder and --cpu-memory go with --device-map")
    if search and gpus == 0:
        raise UsageError("--search needs --gpus 1 or more")
    overrides = {k: v for k, v in {"tp": tp, "pp": pp, "dp": dp, "ep": ep}.items() if v}
    if implied is not None:
        overrides = {}  # the mesh flags are in the implied manifest already
    if quant is not None:
        if not search:
            raise UsageError("--quant goes with --search", hint="add --search")
        from shardctl.cli.quant_search import run_quant_search

        run_quant_search(manifest, quant, gpus=gpus, top=top, as_json=as_json)
        return
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
    if max_imbalance is not None:
        _gate_balance(result_plan, max_imbalance)
    if result_plan.fits is False:
        raise typer.Exit(EXIT_NEGATIVE)


def _gate_balance(result_plan: PlanResult, limit: float) -> None:
    """Exit 1 with one line on stderr when max/mean of stage peaks exceeds ``limit``."""
    from shardctl.plan.balance import stage_balance

    balance = stage_balance(result_plan)
    if balance.exceeds(limit):
        typer.echo(balance.excess_line(limit), err=True)
        raise typer.Exit(EXIT_NEGATIVE)


def _check_modes(
    *,
    search: bool,
    device_map: Path | None,
    from_layout: Path | None,
    mesh_given: bool,
    plan_only: bool,
) -> None:
    """``--search``, ``--device-map`` and ``--from`` each choose the layout themselves."""
    modes = [n for n, on in (("--search", search), ("--device-map", device_map is not None),
                             ("--from", from_layout is not None)) if on]  # fmt: skip
    if len(modes) > 1:
        raise UsageError(f"{' and '.join(modes)} do not go together", hint="pick one")
    if mesh_given and (device_map is not None or from_layout is not None):
        raise UsageError(
            f"{modes[0]} chooses the placement itself; --tp/--pp/--dp/--ep do not apply",
            hint="drop the mesh flags",
        )
    if plan_only and (device_map is not None or from_layout is not None):
        raise UsageError(f"--max-imbalance and --report go with a plain plan, not {modes[0]}")
