"""Byte-compile a checkout before timing cold ``python -m shardctl`` processes.

A pip install byte-compiles the package; an editable checkout writes its ``.pyc`` files on the
first import, unless ``PYTHONDONTWRITEBYTECODE`` is set (some CI images and shells set it),
and then every run compiles ~300 modules again: 0.15 s of a 0.5 s ``plan`` at 90,000 tensors
was compiling. The benchmarks time what an installed shardctl does.
"""

from __future__ import annotations

import compileall
import sys
from importlib import metadata
from pathlib import Path


def byte_compile(*checkouts: Path) -> None:
    """Write (or refresh) the ``.pyc`` of each checkout's ``shardctl`` package, and say which
    typer the timed runs import (0.29 adds ~0.2 s of pydantic to every start; pyproject pins
    it below, a venv may hold another)."""
    for root in checkouts:
        if not compileall.compile_dir(root / "shardctl", quiet=1):
            raise SystemExit(f"bench: could not byte-compile {root / 'shardctl'}")
    typer = metadata.version("typer")
    major, minor = (int(x) for x in typer.split(".")[:2])
    note = "" if (major, minor) < (0, 29) else " — outside pyproject's pin (<0.29): slower start"
    print(f"python {sys.version.split()[0]}, typer {typer}{note}", flush=True)
