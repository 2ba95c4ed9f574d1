"""``shardctl plan``: a manifest (or a config / checkpoint plus flags) and overrides → one
:func:`shardctl.api.plan` (or ``search``) call → table or JSON."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from shardctl.cli._common import MAX_AXIS, MAX_TOP, emit_json
from shardctl.errors import EXIT_NEGATIVE, UsageError
from shardctl.manifest.limits import MAX_DIM

if TYPE_CHECKING:
    from shardctl.manifest import Manifest
    from shardctl.manifest.from_flags import PlanFlags
    from shardctl.plan.api import PlanResult


ManifestOpt = Annotated[
    Path,
    typer.Argument(
        help="YAML manifest; or a config.json or checkpoint directory, described by flags."
    ),
]
AsJsonOpt = Annotated[
    bool, typer.Option("--json", help="Print the plan as JSON (schema shardctl.plan/1).")
]
TpOpt = Annotated[int | None, typer.Option(help="Override mesh.tp.", min=1, max=MAX_AXIS)]
PpOpt = Annotated[int | None, typer.Option(help="Override mesh.pp.", min=1, max=MAX_AXIS)]
DpOpt = Annotated[int | None, typer.Option(help="Override mesh.dp.", min=1, max=MAX_AXIS)]
EpOpt = Annotated[int | None, typer.Option(help="Override mesh.ep.", min=1, max=MAX_AXIS)]
GpuOpt = Annotated[
    str | None, typer.Option(help="Config/checkpoint only: GPU preset, e.g. h100-sxm.")
]
NodesOpt = Annotated[
    int | None,
    typer.Option(
        help="Config/checkpoint only: nodes (default: enough for the mesh).",
        min=1,
        max=MAX_AXIS,
    ),
]
GpusPerNodeOpt = Annotated[
    int | None,
    typer.Option(help="Config/checkpoint only: GPUs per node (8).", min=1, max=MAX_AXIS),
]
BatchOpt = Annotated[
    int | None,
    typer.Option(help="Config/checkpoint only: concurrent sequences.", min=1, max=MAX_DIM),
]
SeqOpt = Annotated[
    int | None,
    typer.Option(help="Config/checkpoint only: tokens per sequence.", min=0, max=MAX_DIM),
]
DtypeOpt = Annotated[
    str | None, typer.Option(help="Config only: weight dtype (default: the config's).")
]
QuantizationOpt = Annotated[
    str | None, typer.Option(help="Config/checkpoint only: quantization method (mxfp4 …).")
]
EmitManifestOpt = Annotated[
    Path | None,
    typer.Option(help="Config/checkpoint only: write the manifest the flags imply."),
]
OnlyWeightsOpt = Annotated[
    bool,
    typer.Option(
        "--weights-only",
        help="Plan weights and overhead alone, on purpose (no KV cache, no activations).",
    ),
]
SearchOpt = Annotated[
    bool, typer.Option("--search", help="Search every layout that fits the hardware.")
]
GpusOpt = Annotated[
    int | None,
    typer.Option(
        help="With --search: GPUs available (default: hardware nodes × gpus_per_node). "
        "With --device-map: GPUs of the one node (default: hardware.gpus_per_node; 0: CPU "
        "and disk only).",
        min=0,
        max=MAX_AXIS,
    ),
]
TopOpt = Annotated[int, typer.Option(help="With --search: rows to print.", min=1, max=MAX_TOP)]
ReportOpt = Annotated[
    Path | None, typer.Option(help="Write the memory picture as SVG or HTML (by extension).")
]
AllRanksOpt = Annotated[
    bool,
    typer.Option("--all-ranks", help="One row and bar per rank (default: identical folded)."),
]
MaxImbalanceOpt = Annotated[
    float | None,
    typer.Option(
        "--max-imbalance",
        help="Exit 1 when max/mean of stage peaks exceeds R (a CI gate on the PP split).",
        min=1.0,
        metavar="R",
    ),
]
DeviceMapOpt = Annotated[
    Path | None,
    typer.Option(
        "--device-map",
        help="Write an accelerate/transformers device_map (JSON) that fits each device's "
        "budget incl. KV cache and activations, and FILE's .max_memory.json beside it.",
        metavar="FILE",
    ),
]
OffloadFolderOpt = Annotated[
    Path | None,
    typer.Option(help="With --device-map: allow disk offload into this folder."),
]
QuantOpt = Annotated[
    str | None,
    typer.Option(
        help="With --search: weight formats searched with the layouts, e.g. "
        "bf16,fp8,int8,int4-awq,nvfp4, or any.",
        metavar="FORMATS",
    ),
]
FromLayoutOpt = Annotated[
    Path | None,
    typer.Option(
        "--from",
        help="Rebalance: from this shardctl layout or HF dir to --gpus N: the best mesh, "
        "the bytes each new rank reads from which old files, the reshard command.",
        metavar="LAYOUT_DIR",
    ),
]
CpuMemoryOpt = Annotated[
    str | None,
    typer.Option(help="With --device-map: CPU budget, e.g. 200GiB (default: this host's RAM)."),
]


def plan(
    manifest: ManifestOpt,
    as_json: AsJsonOpt = False,
    tp: TpOpt = None,
    pp: PpOpt = None,
    dp: DpOpt = None,
    ep: EpOpt = None,
    gpu: GpuOpt = None,
    nodes: NodesOpt = None,
    gpus_per_node: GpusPerNodeOpt = None,
    batch: BatchOpt = None,
    seq: SeqOpt = None,
    dtype: DtypeOpt = None,
    quantization: QuantizationOpt = None,
    emit_manifest: EmitManifestOpt = None,
    only_weights: OnlyWeightsOpt = False,
    search: SearchOpt = False,
    gpus: GpusOpt = None,
    top: TopOpt = 10,
    report: ReportOpt = None,
    all_ranks: AllRanksOpt = False,
    max_imbalance: MaxImbalanceOpt = None,
    device_map: DeviceMapOpt = None,
    offload_folder: OffloadFolderOpt = None,
    quant: QuantOpt = None,
    from_layout: FromLayoutOpt = None,
    cpu_memory: CpuMemoryOpt = None,
) -> None:
    """Estimate per-device memory of a layout; exit 1 if a rank does not fit its budget
    (device memory × gpu_memory_utilization when serving, device memory when training).

    Examples: [bold]shardctl plan manifests/llama-3-70b-tp8.yaml --json[/bold];
    [bold]shardctl plan ./Llama-3-8B --tp 8 --gpu h100-sxm --batch 32 --seq 8192[/bold]
    """
    from shardctl.manifest.from_flags import PlanFlags

    flags = PlanFlags(
        tp, pp, dp, ep, gpu, nodes, gpus_per_node, batch, seq, dtype, quantization, only_weights
    )
    others = {"--device-map": device_map, "--from": from_layout, "--quant": quant}
    target, implied = _target(manifest, flags, emit_manifest, others)
    if search and max_imbalance is not None:
        raise UsageError("--max-imbalance gates one plan", hint="drop --search")
    _check_modes(
        search=search,
        device_map=device_map,
        from_layout=from_layout,
        mesh_given=any(v is not None for v in (tp, pp, dp, ep)),
        plan_only=max_imbalance is not None or report is not None,
    )
    if _other_mode(
        manifest,
        from_layout=from_layout,
        device_map=device_map,
        quant=quant,
        search=search,
        gpus=gpus,
        top=top,
        cpu_memory=cpu_memory,
        offload_folder=offload_folder,
        as_json=as_json,
        all_ranks=all_ranks,
    ):
        return
    done = _Emit(emit_manifest, implied)
    if search:
        _search(target, gpus=gpus, top=top, as_json=as_json, only_weights=only_weights, done=done)
        return
    if gpus is not None:
        raise UsageError("--gpus is used only with --search", hint="add --search or drop --gpus")
    # the mesh flags are in the implied manifest already
    overrides = {} if implied is not None else {
        k: v for k, v in {"tp": tp, "pp": pp, "dp": dp, "ep": ep}.items() if v
    }  # fmt: skip
    result_plan = _one_plan(target, overrides, only_weights=only_weights, done=done)
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


def _other_mode(
    manifest: Path,
    *,
    from_layout: Path | None,
    device_map: Path | None,
    quant: str | None,
    search: bool,
    gpus: int | None,
    top: int,
    cpu_memory: str | None,
    offload_folder: Path | None,
    as_json: bool,
    all_ranks: bool,
) -> bool:
    """Run rebalance (``--from``), ``--device-map`` or ``--search --quant``; False if none."""
    if from_layout is not None:
        from shardctl.cli.rebalance import run_rebalance

        run_rebalance(manifest, from_layout, gpus=gpus, as_json=as_json, all_ranks=all_ranks)
        return True
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
        return True
    if offload_folder is not None or cpu_memory is not None:
        raise UsageError("--offload-folder and --cpu-memory go with --device-map")
    if search and gpus == 0:
        raise UsageError("--search needs --gpus 1 or more")
    if quant is not None:
        if not search:
            raise UsageError("--quant goes with --search", hint="add --search")
        from shardctl.cli.quant_search import run_quant_search

        run_quant_search(manifest, quant, gpus=gpus, top=top, as_json=as_json)
        return True
    return False


def _target(
    manifest: Path, flags: PlanFlags, emit_manifest: Path | None, others: Mapping[str, object]
) -> tuple[Path | Manifest, str | None]:
    """(what to plan, the implied manifest's text): a manifest path as given, or a manifest
    built from a config.json / checkpoint directory and the flags."""
    from shardctl.manifest.from_flags import manifest_from_flags, source_kind

    if source_kind(manifest) == "manifest":
        given = flags.model_flags() + (["--emit-manifest"] if emit_manifest else [])
        if given:
            raise UsageError(
                f"{', '.join(given)}: only with a config.json or checkpoint directory",
                hint="a manifest says these itself: edit its hardware/workload sections",
            )
        return manifest, None
    other = [name for name, value in others.items() if value is not None]
    if other:
        raise UsageError(
            f"{', '.join(other)}: needs a manifest",
            hint="write one with --emit-manifest FILE, then plan FILE",
        )
    return manifest_from_flags(manifest, flags)


class _Emit:
    """``--emit-manifest``: written only once the input planned (exit 3 writes nothing)."""

    def __init__(self, path: Path | None, implied: str | None) -> None:
        self.path, self.implied = path, implied

    def __call__(self) -> None:
        if self.path is not None and self.implied is not None:
            from shardctl.manifest.from_flags import emit

            emit(self.path, self.implied)


def _search(
    target: Path | Manifest,
    *,
    gpus: int | None,
    top: int,
    as_json: bool,
    only_weights: bool,
    done: _Emit,
) -> None:
    from shardctl.api import search as run_search

    result = run_search(target, gpus=gpus, only_weights=only_weights)
    done()
    if as_json:
        emit_json(result.to_json())
    else:
        from shardctl.plan.render import render_search

        render_search(result, top=top)
    if not result.has_fit:
        raise typer.Exit(EXIT_NEGATIVE)


def _one_plan(
    target: Path | Manifest, overrides: dict[str, int], *, only_weights: bool, done: _Emit
) -> PlanResult:
    from shardctl.api import plan as make_plan

    result = make_plan(target, mesh=overrides, only_weights=only_weights)
    done()
    return result


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
