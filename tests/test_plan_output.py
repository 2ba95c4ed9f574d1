"""``plan``'s text scales: identical ranks fold into one row and one bar, ``--all-ranks`` lists
every rank, the JSON always has every rank, one unit per output, no wrapping in CI logs."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from shardctl.plan.groups import group_ranks

ROOT = Path(__file__).resolve().parent.parent
TRAIN = ROOT / "manifests" / "llama-3-70b-train-tp8-pp4-dp4.yaml"  # 128 GPUs, 4 stages


def plan(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shardctl", "plan", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )


def test_identical_ranks_fold_into_one_row_and_bar_per_stage() -> None:
    proc = plan(str(TRAIN))
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for p, (lo, hi) in enumerate([(0, 31), (32, 63), (64, 95), (96, 127)]):
        row = re.search(rf"^\s*{lo}–{hi}\s+pp{p} dp0–3 tp0–7\s+{p}\s.*×32", out, re.M)
        assert row, out
        assert f"ranks {lo}–{hi} · pp{p} dp0–3 tp0–7 ×32 " in out
    assert len(out.splitlines()) < 25


def test_all_ranks_lists_every_rank_and_json_always_does() -> None:
    proc = plan(str(TRAIN), "--all-ranks")
    assert proc.returncode == 0, proc.stderr
    rows = [ln for ln in proc.stdout.splitlines() if re.match(r"^\s*\d+\s+pp\d dp\d tp\d\s", ln)]
    bars = [ln for ln in proc.stdout.splitlines() if re.match(r"^\s*rank \d+ · ", ln)]
    assert len(rows) == len(bars) == 128
    doc = json.loads(plan(str(TRAIN), "--json").stdout)
    assert [r["rank"] for r in doc["ranks"]] == list(range(128))


def test_one_unit_and_no_wrapping_off_a_terminal() -> None:
    out = plan(str(ROOT / "manifests" / "llama-3-8b-tp1.yaml")).stdout
    assert "GiB" in out and "MiB" not in out and "KiB" not in out
    # The header is longer than 80 columns and stays on one line in a CI log.
    header = out.splitlines()[0]
    assert len(header) > 80 and "parameters" in header and "= 1 GPUs" in header
    # An H100's budget is 0.9 × the 79.22 GiB CUDA reports, not the data sheet's 80 GiB.
    assert "of the budget 71.29 GiB (gpu_memory_utilization 0.9 × 79.22 GiB)" in out


def test_groups_break_on_stage_memory_and_gaps() -> None:
    a, b = {"total": 1}, {"total": 2}
    items = [
        (0, {"tp": 0}, 0, a),
        (1, {"tp": 1}, 0, a),
        (2, {"tp": 0}, 1, a),  # next stage
        (3, {"tp": 1}, 1, b),  # other bytes
        (5, {"tp": 1}, 1, b),  # not a neighbour
    ]
    assert [(g.first, g.last) for g in group_ranks(items)] == [(0, 1), (2, 2), (3, 3), (5, 5)]
    assert len(group_ranks(items, all_ranks=True)) == 5
