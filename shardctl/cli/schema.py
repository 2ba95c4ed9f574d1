"""``shardctl schema``: the manifest's JSON Schema."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer


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
