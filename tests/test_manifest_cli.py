"""A few real CLI runs (subprocesses, so a crash shows as a negative return code): hostile
manifests exit 3 with one line on stderr, and `shardctl schema` prints the committed schema."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def shardctl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shardctl", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "model: {parameters: 1000}\nmesh:\n  tp: yes\n",
            "mesh.tp: expected a positive integer, got 'yes' (line 3)",
        ),
        (
            'a: &a ["lol","lol","lol"]\nb: &b [*a,*a,*a]\nc: &c [*b,*b,*b]\n',
            "anchors/aliases not allowed (anchor &a at line 1)",
        ),
        ("model: " + "[" * 100_000 + "\n", "nesting deeper than 32 levels"),
    ],
    ids=["bool-for-int", "billion-laughs", "deep-nesting"],
)
def test_plan_refuses_hostile_manifests_with_exit_3_and_one_line(
    tmp_path: Path, text: str, message: str
) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    run = shardctl("plan", str(path))
    assert run.returncode == 3, (run.returncode, run.stderr)
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1, run.stderr
    assert message in lines[0] and str(path) in lines[0]
    assert "Traceback" not in run.stderr
    assert run.stdout == ""


def test_schema_command_prints_the_committed_schema() -> None:
    run = shardctl("schema")
    assert run.returncode == 0, run.stderr
    committed = ROOT / "shardctl" / "schema" / "manifest.schema.json"
    assert run.stdout == committed.read_text(encoding="utf-8")
