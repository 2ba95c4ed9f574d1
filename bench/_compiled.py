"""Byte-compile a checkout before timing cold ``python -m shardctl`` processes.

A pip install byte-compiles the package; an editable checkout writes its ``.pyc`` files on the
first import, unless ``PYTHONDONTWRITEBYTECODE`` is set (some CI images and shells set it),
and then every run compiles ~300 modules again: 0.15 s of a 0.5 s ``plan`` at 90,000 tensors
was compiling. The benchmarks time what an installed shardctl does.
"""

from __future__ import annotations

import compileall
from pathlib import Path


def byte_compile(*checkouts: Path) -> None:
    """Write (or refresh) the ``.pyc`` of each checkout's ``shardctl`` package."""
    for root in checkouts:
        if not compileall.compile_dir(root / "shardctl", quiet=1):
            raise SystemExit(f"bench: could not byte-compile {root / 'shardctl'}")
