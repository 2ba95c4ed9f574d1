"""Helpers for the hostile-input groups I (records), J (names, rendering), K (bounds).

``cli(*args)`` drives the real console entry (``shardctl.cli.main``: typer with
``standalone_mode=False`` and the exception mapping of ``shardctl.console``) in process and
returns ``(exit code, stdout, stderr)``; ``sub(*args)`` does the same in a subprocess.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
OK_CODES = {0, 1, 2, 3, 4, 5}


def cli(*args: str) -> tuple[int, str, str]:
    """Run ``shardctl *args`` in process; the exit code and both streams."""
    from shardctl.cli import main

    out, err = io.StringIO(), io.StringIO()
    old_argv = sys.argv
    sys.argv = ["shardctl", *args]
    code: Any = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main()
            except SystemExit as exc:
                code = exc.code
    finally:
        sys.argv = old_argv
        import signal

        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    return (
        (code if isinstance(code, int) else 0 if code is None else 1),
        out.getvalue(),
        err.getvalue(),
    )


def sub(
    *args: str, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if k != "SHARDCTL_DEBUG"}
    full.update(env or {})
    full["PYTHONPATH"] = str(REPO)
    return subprocess.run(
        [sys.executable, "-m", "shardctl", *args],
        capture_output=True,
        text=True,
        encoding="utf-8",
        errors="replace",
        env=full,
        cwd=cwd or REPO,
        timeout=300,
    )


def one_line(code: int, err: str, expected: int | set[int]) -> str:
    """Assert the exit code, no traceback, and one ``shardctl: error:`` line on stderr (none
    needed on 0 and 1)."""
    want = {expected} if isinstance(expected, int) else expected
    assert code in want, (code, err)
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    if code in (0, 1):  # ok / a negative result: the verdict is on stdout
        assert len(lines) <= 1, err
        return lines[0] if lines else ""
    assert len(lines) == 1, err
    assert lines[0].startswith("shardctl: error: "), err
    return lines[0]


def tree_sha(path: Path) -> dict[str, str]:
    """sha256 of every file under ``path`` (relative names); the input-unchanged check."""
    out: dict[str, str] = {}
    for root, _dirs, files in os.walk(path):
        for n in files:
            p = Path(root) / n
            out[str(p.relative_to(path))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def safetensors(path: Path, header: str | bytes, data: bytes) -> Path:
    """A safetensors file from a raw header string (lone surrogates kept) and data bytes."""
    raw = header.encode("utf-8", "surrogatepass") if isinstance(header, str) else header
    raw += b" " * (-len(raw) % 8)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def u8_checkpoint(
    path: Path, tensors: dict[str, int], config: dict[str, Any] | None = None
) -> Path:
    """An HF directory of 1-D U8 tensors (``name -> length``), bytes 1, 2, 3, ..."""
    header: dict[str, Any] = {}
    data = b""
    for i, (name, n) in enumerate(tensors.items()):
        header[name] = {"dtype": "U8", "shape": [n], "data_offsets": [len(data), len(data) + n]}
        data += bytes([(i + 1) % 256]) * n
    safetensors(path / "model.safetensors", json.dumps(header, ensure_ascii=False), data)
    (path / "config.json").write_text(json.dumps(config or {}))
    return path
