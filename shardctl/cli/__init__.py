"""The command line: parse options, make one library call, render the result.

This root only wires the commands; each lives in its own module with its renderer
(``shardctl.cli.plan``, ``.inspect``, ``.schema``, ``.reshard``, ``.verify``,
``.watch``).

Heavy imports (torch, numpy, the reshard and verify engines) happen inside the command that
needs them, so ``shardctl plan`` starts in a fraction of a second and never imports torch.
"""

from __future__ import annotations

from typing import Annotated

import typer

from shardctl import __version__
from shardctl.cli import inspect, plan, reshard, schema, verify, watch
from shardctl.console import run_cli

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


for _command in (
    plan.plan,
    inspect.inspect,
    schema.schema,
    reshard.reshard,
    verify.verify,
    watch.watch,
):
    app.command()(_command)


def main() -> None:
    # standalone_mode=False: typer raises its usage exception instead of printing a box, and
    # shardctl.console renders it as one line (exit 2).
    run_cli(lambda: app(prog_name="shardctl", standalone_mode=False))


if __name__ == "__main__":
    main()
