"""``plan --max-imbalance R``: a CI gate on the PP split, through the real command."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from shardctl.manifest import load_manifest
from shardctl.plan.api import plan_manifest
from shardctl.plan.balance import stage_balance

ROOT = Path(__file__).resolve().parent.parent
BALANCED = ROOT / "manifests" / "llama-3.1-405b-tp8-pp2.yaml"


def shardctl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shardctl", *args], capture_output=True, text=True, cwd=ROOT
    )


def _lopsided(tmp_path: Path) -> Path:
    # 84 of 126 layers on stage 0: stage 0 is the heavy one (printed ratio 1.320).
    text = BALANCED.read_text().replace(
        "pipeline: {convention: even}", "pipeline: {layers_per_stage: [84, 42]}"
    )
    assert "84, 42" in text
    out = tmp_path / "405b-lopsided.yaml"
    out.write_text(text)
    return out


def test_ratio_is_the_printed_one(tmp_path: Path) -> None:
    m = _lopsided(tmp_path)
    balance = stage_balance(plan_manifest(load_manifest(m)))
    assert balance.stage == 0
    assert len(balance.peaks) == 2 and balance.peaks[0] > balance.peaks[1]
    assert balance.ratio == max(balance.peaks) / (sum(balance.peaks) / 2)
    printed = shardctl("plan", str(m))
    assert printed.returncode == 0, printed.stderr
    assert f"load balance (max/mean of stage peaks): {balance.ratio:.3f}" in printed.stdout


def test_gate_fails_with_one_line_naming_the_stage(tmp_path: Path) -> None:
    proc = shardctl("plan", str(_lopsided(tmp_path)), "--max-imbalance", "1.2")
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "load balance 1.320 exceeds --max-imbalance 1.2: stage 0 peaks at" in lines[0]
    assert "over the limit" in lines[0]


def test_gate_passes_under_the_limit(tmp_path: Path) -> None:
    assert shardctl("plan", str(_lopsided(tmp_path)), "--max-imbalance", "1.4").returncode == 0
    even = shardctl("plan", str(BALANCED), "--json", "--max-imbalance", "1.0")
    assert even.returncode == 0, even.stderr  # pp2 even split: 1.000, equal is within


def test_gate_is_usage_error_with_search_or_below_one() -> None:
    assert shardctl("plan", str(BALANCED), "--search", "--max-imbalance", "1.1").returncode == 2
    assert shardctl("plan", str(BALANCED), "--max-imbalance", "0.5").returncode == 2


def test_plan_modes_do_not_mix(tmp_path: Path) -> None:
    """--search, --device-map and --from each choose the layout: one at a time, no mesh flags."""
    out = str(tmp_path / "map.json")
    cases = [
        ("--search", "--device-map", out),
        ("--device-map", out, "--from", str(tmp_path)),
        ("--device-map", out, "--tp", "2"),
        ("--device-map", out, "--max-imbalance", "1.1"),
        ("--offload-folder", str(tmp_path)),
    ]
    for extra in cases:
        proc = shardctl("plan", str(BALANCED), *extra)
        assert proc.returncode == 2, (extra, proc.stderr)
    assert not (tmp_path / "map.json").exists()
