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

        render_plan(result_plan, all_ranks=all_ranks)
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


@app.command()
def reshard(
    src: Annotated[Path, typer.Argument(help="Input: an HF checkpoint dir or a shardctl layout.")],
    dst: Annotated[Path, typer.Argument(help="Output directory (must not exist unless --force).")],
    tp: Annotated[int | None, typer.Option(help="Target tensor-parallel degree.", min=1)] = None,
    pp: Annotated[int | None, typer.Option(help="Target pipeline-parallel degree.", min=1)] = None,
    ep: Annotated[int | None, typer.Option(help="Target expert-parallel degree.", min=1)] = None,
    manifest: Annotated[
        Path | None,
        typer.Option(
            help="Take mesh, rules and layout options from this manifest (flags override its mesh)."
        ),
    ] = None,
    fmt: Annotated[
        str | None,
        typer.Option(
            "--format",
            help="ranks (per-rank files) or hf (whole tensors). Default: "
            "ranks when the target has more than one rank, else hf.",
        ),
    ] = None,
    max_shard_size: Annotated[
        str, typer.Option(help="Split output files above this size (5GB = 5·10⁹ B, 5GiB = 2³⁰).")
    ] = "5GB",
    workers: Annotated[
        int | None,
        typer.Option(
            help="Writer threads (each output file has one); default: usable cores, at most 4.",
            min=1,
        ),
    ] = None,
    force: Annotated[
        bool, typer.Option("--force", help="Replace an existing DST atomically.")
    ] = False,
    allow_pickle: Annotated[
        bool,
        typer.Option(
            "--allow-pickle",
            help="Accept .bin/.pt input, loaded only with torch.load(weights_only=True).",
        ),
    ] = False,
    follow_external_symlinks: Annotated[
        bool,
        typer.Option(
            "--follow-external-symlinks", help="Accept shard symlinks that point outside SRC."
        ),
    ] = False,
    no_verify_input: Annotated[
        bool,
        typer.Option(
            "--no-verify-input",
            help="Skip hashing inputs whose digests are known (layout record, HF-cache blob).",
        ),
    ] = False,
    no_resume: Annotated[
        bool,
        typer.Option(
            "--no-resume",
            help="Start clean: do not reuse the finished files of an identical killed run.",
        ),
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress, no summary.")] = False,
) -> None:
    """Split, merge or convert a checkpoint: streaming, constant memory, atomic.

    Examples:
    [bold]shardctl reshard ./Llama-3-8B ./llama-tp4 --tp 4[/bold] (HF → per-rank shards);
    [bold]shardctl reshard ./llama-tp4 ./llama-tp2 --tp 2[/bold] (any-to-any);
    [bold]shardctl reshard ./llama-tp4 ./merged --format hf[/bold] (back to HF).
    """
    from shardctl.reshard_cli import run_reshard

    run_reshard(
        src,
        dst,
        tp=tp,
        pp=pp,
        ep=ep,
        manifest=manifest,
        fmt=fmt,
        max_shard_size=max_shard_size,
        workers=workers,
        force=force,
        allow_pickle=allow_pickle,
        follow_external_symlinks=follow_external_symlinks,
        verify_input=not no_verify_input,
        resume=not no_resume,
        as_json=as_json,
        quiet=quiet,
    )


@app.command()
def verify(
    src: Annotated[
        Path, typer.Argument(help="The original: an HF checkpoint dir (or a shardctl layout).")
    ],
    dst: Annotated[
        Path, typer.Argument(help="The resharded output: a shardctl layout or an HF dir.")
    ],
    level: Annotated[
        str, typer.Option(help="structure | bitwise | forward (cumulative).")
    ] = "forward",
    device: Annotated[
        str, typer.Option(help="auto | cpu | cuda (auto: CUDA when present).")
    ] = "auto",
    launcher: Annotated[
        str, typer.Option(help="local (spawn one process per rank) | torchrun (see README).")
    ] = "local",
    seed: Annotated[int, typer.Option(help="Seed of the random input ids.")] = 0,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the result as JSON (schema shardctl.verify/1).")
    ] = False,
    report: Annotated[
        Path | None, typer.Option(help="Also write the JSON result to this file.")
    ] = None,
) -> None:
    """Prove DST equivalent to SRC: structure, then bits, then a distributed forward.

    Exit 0 equivalent, 1 not equivalent, 3 invalid input, 5 could not verify.

    Example: [bold]shardctl verify ./Llama-3-8B ./llama-tp4 --level forward --json[/bold]
    """
    from shardctl.verify.api import verify as run_verify

    result = run_verify(src, dst, level=level, device=device, launcher=launcher, seed=seed)
    doc = result.to_json()
    if report is not None:
        report.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    if as_json:
        _emit_json(doc)
    else:
        from rich.console import Console

        from shardctl.verify.render import render

        Console().print(render(result))
    if not result.ok:
        raise typer.Exit(EXIT_NEGATIVE)


def main() -> None:
    run_cli(lambda: app(prog_name="shardctl"))


if __name__ == "__main__":
    main()
