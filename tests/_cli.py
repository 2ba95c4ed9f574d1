"""The CLI as users run it: ``python -m shardctl ARGS`` in a subprocess.

One helper for every test that drives the real console entry end to end (exit code, both
streams): run from the repository root with it on ``PYTHONPATH``, so the checkout under test is
the one imported whether or not it is installed. The timeout is a hang guard, not a speed limit.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 900
) -> subprocess.CompletedProcess[str]:
    """``shardctl *args`` in a subprocess; ``env`` adds to (not replaces) the environment."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return subprocess.run(
        [sys.executable, "-m", "shardctl", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONPATH": path, **(env or {})},
        check=False,
    )
