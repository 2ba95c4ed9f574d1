"""Helpers shared by the command modules."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated

import typer

from shardctl.manifest.limits import MAX_AXIS

# Bounds on sizes from flags, checked by typer before any work (exit 2): a mesh degree has the
# manifest's cap (MAX_AXIS); writer threads beyond a few hundred only cost memory.
MAX_WORKERS = 256
MAX_TOP = 10_000

MaxHeaderBytes = Annotated[
    str | None,
    typer.Option(
        "--max-header-bytes",
        help="Largest safetensors header accepted (default 16MiB, at most 1GiB); raise it only "
        "for trusted files with very many tensors.",
    ),
]


@contextmanager
def header_limit(text: str | None) -> Iterator[None]:
    """Apply ``--max-header-bytes`` to every header read inside the block."""
    from shardctl.io.safetensors_header import header_limit as limit
    from shardctl.units import parse_size

    n = None if text is None else parse_size(text, option="--max-header-bytes")
    with limit(n):
        yield


def emit_json(payload: object) -> None:
    """One JSON document on stdout (the ``--json`` form of every command)."""
    try:
        sys.stdout.write(json.dumps(payload, indent=2, sort_keys=False) + "\n")
        sys.stdout.flush()  # here, not at exit: a reader that left must not change the code
    except BrokenPipeError:
        from shardctl.console import reader_gone

        reader_gone()


__all__ = ["MAX_AXIS", "MAX_TOP", "MAX_WORKERS", "MaxHeaderBytes", "emit_json", "header_limit"]
