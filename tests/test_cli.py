"""The CLI as users run it: real subprocesses of ``python -m shardctl``, exit codes, stderr."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shardctl.console import exit_code_for
from shardctl.errors import (
    EnvironmentFailure,
    Interrupted,
    InvalidInputError,
    ManifestError,
    OutputConflictError,
    UsageError,
)

ROOT = Path(__file__).resolve().parents[1]
MANIFESTS = ROOT / "manifests"


def run(
    *args: str,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, **(env or {})}
    full_env.pop("SHARDCTL_DEBUG", None) if env is None or "SHARDCTL_DEBUG" not in env else None
    return subprocess.run(
        [sys.executable, "-m", "shardctl", *args],
        capture_output=True,
        text=True,
        env=full_env,
        cwd=cwd or ROOT,
        timeout=120,
    )


def assert_one_line_error(proc: subprocess.CompletedProcess[str], code: int) -> str:
    assert proc.returncode == code, (proc.returncode, proc.stdout, proc.stderr)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert lines[0].startswith("shardctl: error: ")
    return lines[0]


# -- the exit-code table, in process ---------------------------------------------------------


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (UsageError("bad"), 2),
        (InvalidInputError("bad"), 3),
        (ManifestError("bad", where="m.yaml"), 3),
        (OutputConflictError("exists"), 4),
        (EnvironmentFailure("disk"), 5),
        (OSError(errno.ENOSPC, "No space left on device", "/x"), 5),
        (OSError(errno.EROFS, "Read-only file system"), 5),
        (Interrupted(2), 130),
        (Interrupted(15), 143),
        (RuntimeError("boom"), 70),
    ],
)
def test_exit_code_table(exc: BaseException, code: int) -> None:
    got, line = exit_code_for(exc)
    assert got == code
    assert "\n" not in line


def test_error_renders_where_and_hint() -> None:
    e = ManifestError(
        "expected a positive integer, got 'yes' (line 4)",
        where="m.yaml: mesh.tp",
        hint="write a number like 8",
    )
    assert e.render() == (
        "m.yaml: mesh.tp: expected a positive integer, got 'yes' (line 4); write a number like 8"
    )


def test_internal_error_names_debug_switch() -> None:
    _, line = exit_code_for(KeyError("x"))
    assert "SHARDCTL_DEBUG=1" in line


# -- real subprocesses ---------------------------------------------------------------------


def test_version_and_help() -> None:
    proc = run("--version")
    assert proc.returncode == 0 and proc.stdout.startswith("shardctl ")
    proc = run("--help")
    assert proc.returncode == 0
    for cmd in ("plan", "inspect", "schema"):
        assert cmd in proc.stdout


def test_usage_error_is_exit_2() -> None:
    proc = run("plan")  # missing MANIFEST
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr


def test_missing_manifest_is_exit_3(tmp_path: Path) -> None:
    line = assert_one_line_error(run("plan", str(tmp_path / "nope.yaml")), 3)
    assert "nope.yaml" in line


def test_hostile_manifest_is_exit_3_one_line(tmp_path: Path) -> None:
    m = tmp_path / "evil.yaml"
    m.write_text(
        "model: !!python/object/apply:os.system ['touch " + str(tmp_path / "pwned") + "']\n"
    )
    assert_one_line_error(run("plan", str(m)), 3)
    assert not (tmp_path / "pwned").exists()


def test_debug_env_shows_traceback(tmp_path: Path) -> None:
    m = tmp_path / "bad.yaml"
    m.write_text("mesh: {tp: yes}\n")
    proc = run("plan", str(m), env={"SHARDCTL_DEBUG": "1"})
    assert proc.returncode == 3
    assert "Traceback" in proc.stderr


def test_plan_json_llama3_8b_exact() -> None:
    proc = run("plan", str(MANIFESTS / "llama-3-8b-tp1.yaml"), "--json")
    assert proc.returncode == 0, proc.stderr  # 8B bf16 + 8k KV fits one 80 GiB H100
    doc = json.loads(proc.stdout)
    assert doc["fits"] is True
    assert doc["schema"] == "shardctl.plan/1"
    assert doc["model"]["parameters"] == 8_030_261_248
    assert doc["model"]["weight_bytes"] == 16_060_522_496
    assert doc["ranks"][0]["memory"]["weights"] == 16_060_522_496
    for key in (
        "weights",
        "kv_cache",
        "activations",
        "gradients",
        "optimizer",
        "overhead",
        "total",
    ):
        assert key in doc["ranks"][0]["memory"]


def test_plan_exit_1_when_it_does_not_fit(tmp_path: Path) -> None:
    m = tmp_path / "small-gpu.yaml"
    m.write_text(
        "model:\n  model_type: llama\n  hidden_size: 4096\n  intermediate_size: 14336\n"
        "  num_hidden_layers: 32\n  num_attention_heads: 32\n  num_key_value_heads: 8\n"
        "  vocab_size: 128256\n  tie_word_embeddings: false\n  dtype: bfloat16\n"
        "mesh: {tp: 1}\nhardware: {device_memory: 8GiB}\n"
    )
    proc = run("plan", str(m), "--json")
    assert proc.returncode == 1, proc.stderr
    assert json.loads(proc.stdout)["fits"] is False


def test_plan_path_imports_no_torch_or_numpy() -> None:
    code = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "from shardctl.cli import app\n"
        f"r = CliRunner().invoke(app, ['plan', {str(MANIFESTS / 'llama-3-8b-tp1.yaml')!r}, "
        "'--json'])\n"
        "assert r.exit_code in (0, 1), r.output\n"
        "bad = sorted(m for m in ('torch', 'numpy', 'transformers') if m in sys.modules)\n"
        "print(','.join(bad))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == ""


def test_schema_command_matches_committed_file() -> None:
    proc = run("schema")
    assert proc.returncode == 0
    committed = json.loads((ROOT / "shardctl" / "schema" / "manifest.schema.json").read_text())
    assert json.loads(proc.stdout) == committed


def test_inspect_hf_checkpoint_json() -> None:
    proc = run("inspect", str(ROOT / "examples" / "tiny-llama"), "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["schema"] == "shardctl.inspect/1"
    assert doc["kind"] == "hf"
    assert doc["model"]["architecture"] == "llama"
    # equals the data region of the real file: header excluded
    from shardctl.io.safetensors_header import read_header

    h = read_header(ROOT / "examples" / "tiny-llama" / "model.safetensors")
    assert doc["model"]["weight_bytes"] == h.file_size - h.data_offset
    assert "config.json" in doc["carried"]


def test_inspect_missing_path_is_exit_3(tmp_path: Path) -> None:
    assert_one_line_error(run("inspect", str(tmp_path / "nothing")), 3)
