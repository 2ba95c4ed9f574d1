"""The public Python API: cheap to import, the README's example runs as written, and the CLI
passes its options to exactly these functions."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

import shardctl
from shardctl import api
from shardctl.errors import UsageError
from shardctl.io.safetensors_header import read_header

REPO = Path(__file__).resolve().parents[1]
MANIFEST = REPO / "manifests" / "llama-3-70b-tp8.yaml"


def readme_example() -> str:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    m = re.search(r"<!-- api-example[^>]*-->\n```python\n(.*?)```", text, re.S)
    assert m, "README: the API example block is missing"
    return m.group(1)


def python_c(code: str) -> subprocess.CompletedProcess[str]:
    """``python -c code`` from the repository root (a fresh interpreter: import costs show)."""
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_readme_example_runs_as_written() -> None:
    done = python_c(readme_example())
    lines = done.stdout.splitlines()
    assert lines[0].startswith("True PP1×DP1×EP1×TP4")
    assert "{'pp': 1, 'dp': 1, 'tp': 2, 'ep': 1}" in done.stdout
    assert lines[-1].startswith("4 ") and "output exists" in lines[-1]


def test_import_is_cheap_and_names_stay_functions() -> None:
    code = (
        "import sys, shardctl\n"
        "assert 'torch' not in sys.modules and 'shardctl.plan' not in sys.modules\n"
        "from shardctl import plan, search, reshard, verify, inspect, Mesh, ShardctlError\n"
        "assert 'torch' not in sys.modules\n"
        "import shardctl.plan.api, shardctl.reshard.result, shardctl.verify.result\n"
        "from shardctl.checkpoint import summary\n"
        "assert callable(shardctl.plan) and shardctl.plan is plan, shardctl.plan\n"
        "assert shardctl.reshard is reshard and shardctl.verify is verify\n"
        "assert shardctl.inspect is inspect and shardctl.search is search\n"
        "print(','.join(m for m in ('torch', 'numpy') if m in sys.modules))\n"
    )
    assert python_c(code).stdout.strip() == ""


def test_api_docstrings_and_exceptions() -> None:
    for name in ("plan", "search", "reshard", "verify", "inspect"):
        assert getattr(shardctl, name).__doc__, name
    assert issubclass(shardctl.ManifestError, shardctl.ShardctlError)
    assert shardctl.OutputConflictError.exit_code == 4
    with pytest.raises(AttributeError):
        shardctl.no_such_name  # noqa: B018


def test_plan_takes_a_path_or_a_loaded_manifest_and_mesh_overrides() -> None:
    from shardctl.manifest import load_manifest

    by_path = shardctl.plan(MANIFEST, mesh={"tp": 4})
    by_object = shardctl.plan(load_manifest(MANIFEST), mesh=shardctl.Mesh(tp=4))
    assert by_path.to_json() == by_object.to_json()
    assert by_path.mesh.tp == 4
    with pytest.raises(UsageError, match="unknown axis 'xp'"):
        shardctl.plan(MANIFEST, mesh={"xp": 2})
    with pytest.raises(UsageError, match=r"mesh\.tp"):
        shardctl.plan(MANIFEST, mesh={"tp": 0})
    found = shardctl.search(str(MANIFEST), gpus=8)
    assert found.has_fit and found.to_json()["schema"] == "shardctl.search/1"


def test_reshard_result_to_json(tmp_path: Path) -> None:
    src = REPO / "examples" / "tiny-llama"
    result = shardctl.reshard(src, tmp_path / "out", mesh={"tp": 2}, max_shard_size="1MB")
    doc = result.to_json()
    assert doc["schema"] == "shardctl.reshard/1" and doc["format"] == "ranks"
    assert doc["src"] == str(src) and doc["mesh"]["tp"] == 2
    assert json.loads(json.dumps(doc)) == doc
    assert shardctl.inspect(tmp_path / "out").to_json()["layout"]["mesh"]["tp"] == 2
    # tensor bytes: what the written headers hold, every rank file
    written = [read_header(p) for p in (tmp_path / "out").glob("*.safetensors")]
    assert len(written) == 2
    assert doc["tensor_bytes"] == sum(e.nbytes for h in written for e in h.tensors)
    with pytest.raises(UsageError, match="--format"):
        shardctl.reshard(src, tmp_path / "x", format="zip")


# -- the CLI is a thin shell: the exact call it makes ----------------------------------------


class Recorder:
    def __init__(self, result: Any) -> None:
        self.result = result
        self.calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls.append((args, kwargs))
        return self.result


class Doc:
    ok = True
    has_fit = True
    fits = True

    def to_json(self) -> dict[str, Any]:
        return {"schema": "stub"}


def invoke(*args: str) -> Any:
    from shardctl.cli import app

    return CliRunner().invoke(app, list(args))


def test_cli_reshard_makes_one_api_call(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    rec = Recorder(Doc())
    monkeypatch.setattr(api, "reshard", rec)
    out = invoke("reshard", "a", "b", "--tp", "2", "--max-shard-size", "1000", "--json")
    assert out.exit_code == 0, out.output
    assert rec.calls == [
        (
            (Path("a"), Path("b")),
            dict(
                mesh={"tp": 2},
                manifest=None,
                format=None,
                max_shard_size="1000",
                workers=None,
                force=False,
                allow_pickle=False,
                follow_external_symlinks=False,
                verify_input=True,
                resume=True,
                progress=None,
                optimizer=True,
            ),
        )
    ]
    # dcp-optim: --dp and --no-optimizer for DCP training checkpoints
    rec.calls.clear()
    out = invoke("reshard", "a", "b", "--format", "dcp", "--dp", "3", "--no-optimizer", "--json")
    assert out.exit_code == 0, out.output
    assert rec.calls[0][1]["mesh"] == {"dp": 3} and rec.calls[0][1]["optimizer"] is False


def test_cli_plan_verify_inspect_make_one_api_call(monkeypatch: pytest.MonkeyPatch) -> None:
    recs = {name: Recorder(Doc()) for name in ("plan", "search", "verify", "inspect")}
    for name, rec in recs.items():
        monkeypatch.setattr(api, name, rec)
    assert invoke("plan", "m.yaml", "--tp", "2", "--json").exit_code == 0
    assert invoke("plan", "m.yaml", "--search", "--gpus", "8", "--json").exit_code == 0
    assert invoke("verify", "s", "d", "--level", "bitwise", "--json").exit_code == 0
    assert invoke("inspect", "p", "--json").exit_code == 0
    assert recs["plan"].calls == [((Path("m.yaml"),), {"mesh": {"tp": 2}, "only_weights": False})]
    assert recs["search"].calls == [((Path("m.yaml"),), {"gpus": 8, "only_weights": False})]
    assert recs["verify"].calls == [
        (
            (Path("s"), Path("d")),
            {"level": "bitwise", "device": "auto", "launcher": "local", "seed": 0},
        )
    ]
    assert recs["inspect"].calls == [((Path("p"),), {})]


def test_inspect_renderer_prints_names_literally(tmp_path: Path) -> None:
    """File names, paths and architectures come from the checkpoint: never rich markup."""
    import shutil

    from rich.console import Console

    from shardctl.cli.inspect import render_inspect

    src = tmp_path / "[bold]ckpt"
    shutil.copytree(REPO / "examples" / "tiny-llama", src)
    (src / "[red]notes.txt").write_text("x")
    console = Console(width=200, record=True)
    render_inspect(shardctl.inspect(src), console)
    text = console.export_text()
    assert "[bold]ckpt" in text and "[red]notes.txt" in text
