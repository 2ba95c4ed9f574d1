"""``plan --search --quant``: layouts and weight formats ranked together, through the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from shardctl.plan.quant_search import FORMATS, QUALITY, parse_formats

ROOT = Path(__file__).resolve().parent.parent
M70 = str(ROOT / "manifests" / "llama-3-70b-tp8.yaml")


def shardctl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shardctl", *args], capture_output=True, text=True, cwd=ROOT
    )


def test_any_ranks_by_gpus_then_headroom_with_sources() -> None:
    proc = shardctl("plan", M70, "--search", "--quant", "any", "--top", "40", "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["schema"] == "shardctl.quant-search/1" and data["manifest_gpus"] == 8
    rows = data["rows"]
    keys = [(r["gpus"], -r["headroom_bytes"]) for r in rows]
    assert keys == sorted(keys) and len(rows) == 40
    for r in rows:
        assert r["format"] in FORMATS and r["method"] == FORMATS[r["format"]]
        assert r["quality"] and r["quality_source"] and r["weights_per_rank_bytes"] > 0
    best = data["best"]
    # 4-bit weights need fewer GPUs than bf16 for Llama-3-70B on 80 GB GPUs.
    assert best["int4-awq"]["gpus"] < best["bf16"]["gpus"]
    assert best["int4-awq"]["weights_per_rank_bytes"] * best["int4-awq"]["mesh"]["tp"] < (
        best["fp8"]["weights_per_rank_bytes"] * best["fp8"]["mesh"]["tp"]
    )
    assert any(line.startswith("int4-awq fits on 2 GPUs") for line in data["fewer_gpus"])
    assert not any(line.startswith("bf16") for line in data["fewer_gpus"])


def test_text_names_the_formats_that_need_fewer_gpus() -> None:
    proc = shardctl("plan", M70, "--search", "--quant", "bf16,fp8,int8,int4-awq,nvfp4")
    assert proc.returncode == 0, proc.stderr
    assert "fewer than the manifest's 8" in proc.stdout
    assert "arXiv:2306.00978" in proc.stdout  # the AWQ row's source


def test_usage() -> None:
    assert parse_formats("any") == tuple(FORMATS) and set(QUALITY) == set(FORMATS)
    assert shardctl("plan", M70, "--search", "--quant", "int3").returncode == 2
    assert shardctl("plan", M70, "--quant", "fp8").returncode == 2
