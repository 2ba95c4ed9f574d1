"""The command line: parse options, make one library call, render the result.

Heavy imports (torch, numpy, the reshard and verify engines) happen inside the command that
needs them, so ``shardctl plan`` starts in a fraction of a second and never imports torch.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from shardctl import __version__
from shardctl.console import run_cli
from shardctl.errors import EXIT_NEGATIVE, UsageError

app = typer.Typer(
    name="shardctl",
    help="Plan, reshard and verify large-language-model checkpoints.\n\n"
    "Exit codes: 0 ok · 1 negative result (does not fit / not equivalent) · 2 usage · "
    "3 invalid input · 4 output conflict · 5 environment or I/O failure · 70 internal error · "
    "130/143 interrupted.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        print(f"shardctl {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option(
            "--version", help="Print the version and exit.", callback=_version, is_eager=True
        ),
    ] = False,
) -> None:
    """Plan, reshard and verify large-language-model checkpoints."""


def _emit_json(payload: object) -> None:
    sys.stdout.write(json.dumps(payload, indent=2, sort_keys=False) + "\n")


@app.command()
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
) -> None:
    """Estimate per-device memory of a layout; exit 1 if a rank does not fit.

    Example: [bold]shardctl plan manifests/llama-3-70b-tp8.yaml --json[/bold]
    """
    from shardctl.plan.api import make_plan, run_search

    overrides = {k: v for k, v in {"tp": tp, "pp": pp, "dp": dp, "ep": ep}.items() if v}
    if search:
        result = run_search(manifest, gpus=gpus, mesh_overrides=overrides)
        if as_json:
            _emit_json(result.to_json())
        else:
            from shardctl.plan.render import render_search

            render_search(result, top=top)
        if not result.has_fit:
            raise typer.Exit(EXIT_NEGATIVE)
        return
    if gpus is not None:
        raise UsageError("--gpus is used only with --search", hint="add --search or drop --gpus")
    result_plan = make_plan(manifest, mesh_overrides=overrides)
    if report is not None:
        result_plan.write_report(report)
    if as_json:
        _emit_json(result_plan.to_json())
    else:
        from shardctl.plan.render import render_plan

        render_plan(result_plan)
    if result_plan.fits is False:
        raise typer.Exit(EXIT_NEGATIVE)


@app.command()
def inspect(
    path: Annotated[
        Path,
        typer.Argument(help="A checkpoint directory (HF or shardctl layout) or a config.json."),
    ],
    as_json: Annotated[
        bool, typer.Option("--json", help="Print as JSON (schema shardctl.inspect/1).")
    ] = False,
) -> None:
    """Show a checkpoint at a glance without reading tensor data.

    Example: [bold]shardctl inspect ./Llama-3-8B[/bold]
    """
    from shardctl.inspect import inspect_path

    info = inspect_path(path)
    if as_json:
        _emit_json(info.to_json())
    else:
        from shardctl.render_inspect import render_inspect

        render_inspect(info)


@app.command()
def schema(
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="Write to a file instead of stdout.")
    ] = None,
) -> None:
    """Print the manifest's JSON Schema (for editors and CI validation).

    Example: [bold]shardctl schema -o manifest.schema.json[/bold]
    """
    from shardctl.manifest import manifest_json_schema

    text = json.dumps(manifest_json_schema(), indent=2, sort_keys=True) + "\n"
    if output is None:
        sys.stdout.write(text)
    else:
        output.write_text(text, encoding="utf-8")


def main() -> None:
    run_cli(lambda: app(prog_name="shardctl"))


if __name__ == "__main__":
    main()
