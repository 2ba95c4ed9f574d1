"""``plan --from LAYOUT_DIR --gpus N``: the printed ``shardctl reshard`` command, run through
the real CLI, takes from each old file the bytes the plan said.

Two instruments: (1) the layout record the reshard wrote, put against the old source through
reshard's own box planner (``shardctl.reshard.boxes.plan_boxes``), gives the bytes per (new
rank, old file); (2) a wrapper around the copy engine's one read function
(``Executor._read``) counts the bytes it read per old file. The input-digest check, which may
hash whole input files on its own thread, is not a copy read and is not counted.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from shardctl.checkpoint import record_v2
from shardctl.checkpoint.source import open_source
from shardctl.cli import app
from shardctl.dtypes import nbytes
from shardctl.layout.types import Piece
from shardctl.reshard import columnar, copy
from shardctl.reshard.boxes import plan_boxes
from tests._models import make_checkpoint

ROOT = Path(__file__).resolve().parent.parent
runner = CliRunner()


def shardctl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shardctl", *args], capture_output=True, text=True, cwd=ROOT
    )


def _manifest(tmp_path: Path, ckpt: Path, gpus: int) -> Path:
    m = tmp_path / "m.yaml"
    m.write_text(
        f"model: {{checkpoint: {ckpt}}}\n"
        f"hardware: {{device_memory: 1GiB, gpus_per_node: {gpus}}}\n"
        "overhead: {cuda_context: 0, framework: 0, fragmentation: 0}\n"
        "workload: {batch_size: 1, sequence_length: 64}\n"
    )
    return m


def _counted_reshard(command: list[str], monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Run ``shardctl reshard …`` in this process; bytes the copy read, per input file."""
    counts: dict[str, int] = {}
    real = copy.Executor._read

    def counting(self: Any, file: int, offset: int, mv: memoryview) -> None:
        name = Path(self.input_paths[file]).name
        counts[name] = counts.get(name, 0) + len(mv)
        real(self, file, offset, mv)

    monkeypatch.setattr(copy.Executor, "_read", counting)
    # The short path reads 2 MiB windows (whole rows, shared by every target inside them): an
    # I/O batching that reads neither exactly a box nor once per rank. With it off, every box
    # is one read, which is what the plan's per-rank move bytes count.
    monkeypatch.setattr(copy.Executor, "window_size", lambda self: 0)
    # So does the columnar path (chunks read whole SRC stretches, holes under 64 KiB included).
    monkeypatch.setattr(columnar, "ENABLED", False)
    assert command[:2] == ["shardctl", "reshard"]
    done = runner.invoke(app, command[1:])
    assert done.exit_code == 0, done.output
    return counts


def _boxes_per_rank(src: Path, dst: Path) -> dict[int, dict[str, int]]:
    """Bytes per (new rank, old file name) of reshard's own boxes for the layout at ``dst``."""
    old = open_source(src)
    names = [f.path.name for f in old.files]
    record = record_v2.to_v1(json.loads((dst / "shardctl.layout.json").read_text()))
    targets: list[tuple[int, str, list[Piece]]] = []
    for r in record["ranks"]:
        for sh in r["shards"]:
            pieces = [
                Piece(tuple(p["offsets"]), tuple(p["sizes"]), tuple(p["local_offsets"]))
                for p in sh["pieces"]
            ]
            targets.append((r["rank"], sh["fqn"], pieces))
    if record["format"] == "hf":  # one whole-tensor rank
        for t in record["tensors"]:
            zeros = tuple(0 for _ in t["global_shape"])
            targets.append((0, t["fqn"], [Piece(zeros, tuple(t["global_shape"]), zeros)]))
    out: dict[int, dict[str, int]] = {}
    for rank, fqn, pieces in targets:
        for b in plan_boxes(fqn, pieces, old.shards[fqn]):
            per = out.setdefault(rank, {})
            name = names[b.src.file]
            per[name] = per.get(name, 0) + nbytes(b.src.dtype, math.prod(b.sizes or (1,)))
    return out


@pytest.mark.parametrize(
    ("source_mesh", "gpus"),
    [((), 2), (("--tp", "2"), 4), (("--tp", "2", "--pp", "2"), 2)],
    ids=["hf-to-2", "tp2-to-4", "tp2pp2-to-2"],
)
def test_reshard_reads_what_the_plan_said(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source_mesh: tuple[str, ...], gpus: int
) -> None:
    ckpt = make_checkpoint("llama", tmp_path / "hf")
    src = ckpt
    if source_mesh:
        src = tmp_path / "old"
        made = shardctl("reshard", str(ckpt), str(src), *source_mesh)
        assert made.returncode == 0, made.stderr
    manifest = _manifest(tmp_path, ckpt, gpus)
    proc = shardctl("plan", str(manifest), "--from", str(src), "--gpus", str(gpus), "--json")
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    assert plan["schema"] == "shardctl.rebalance/1" and plan["gpus"] == gpus
    mesh = plan["mesh"]
    assert mesh["tp"] * mesh["pp"] * mesh["ep"] * mesh["dp"] == gpus
    assert len(plan["ranks"]) == mesh["tp"] * mesh["pp"] * mesh["ep"]
    per_rank = {r["rank"]: {f["file"]: f["bytes"] for f in r["files"]} for r in plan["ranks"]}
    planned: dict[str, int] = {}
    for files in per_rank.values():
        for name, n in files.items():
            planned[name] = planned.get(name, 0) + n
    assert sum(planned.values()) == plan["move_bytes"] < plan["full_reload_bytes"]

    counted = _counted_reshard(plan["command"], monkeypatch)
    dst = Path(plan["command"][3])
    record = json.loads((dst / "shardctl.layout.json").read_text())
    assert record["mesh"]["tp"] == mesh["tp"] and record["mesh"]["pp"] == mesh["pp"]
    assert _boxes_per_rank(src, dst) == per_rank  # (1) reshard's boxes, per rank and file
    assert counted == planned  # (2) the copy's reads, per old file


def test_table_and_command_in_text(tmp_path: Path) -> None:
    ckpt = make_checkpoint("llama", tmp_path / "hf")
    proc = shardctl("plan", str(_manifest(tmp_path, ckpt, 2)), "--from", str(ckpt), "--gpus", "2")
    assert proc.returncode == 0, proc.stderr
    assert "best mesh" in proc.stdout and "model.safetensors" in proc.stdout
    assert "movement: the new ranks read" in proc.stdout
    assert f"run: shardctl reshard {ckpt} " in proc.stdout


def test_from_needs_gpus(tmp_path: Path) -> None:
    ckpt = make_checkpoint("llama", tmp_path / "hf")
    proc = shardctl("plan", str(_manifest(tmp_path, ckpt, 2)), "--from", str(ckpt))
    assert proc.returncode == 2 and "--gpus" in proc.stderr
