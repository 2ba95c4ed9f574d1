"""Interleaved 1F1B and partial recompute, held against Megatron-LM's own accounting.

Megatron-LM ``megatron/training/theoretical_memory_usage.py`` multiplies the first stage's
activations by ``1 + (pp − 1)/(pp·v)`` under the interleaved schedule (``v`` virtual stages);
its ``schedules.py`` runs ``(pp − rank − 1)·2 + (v − 1)·pp`` warm-up chunk forwards. Partial
recompute (``--recompute-method block --recompute-num-layers N``) keeps only the input of N
layers per stage and all activations of the others.
"""

from __future__ import annotations

import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import pytest

import shardctl
from shardctl.errors import InvalidInputError
from shardctl.plan.memory.activations import interleaved_in_flight_chunks
from shardctl.plan.memory.spec import TrainingSpec

MANIFEST = Path(__file__).parent.parent / "manifests" / "llama-3-70b-train-tp8-pp4-dp4.yaml"


def _with(tmp_path: Path, extra: str, *, drop: tuple[str, ...] = ()) -> Path:
    lines = [
        ln
        for ln in MANIFEST.read_text().splitlines()
        if not any(ln.strip().startswith(d) for d in drop)
    ]
    out = tmp_path / "m.yaml"
    out.write_text("\n".join(lines) + "\n" + extra)
    return out


def _stage0(path: Path) -> dict[str, int]:
    return shardctl.plan(path).memory.coords[(0, 0, 0)].detail


@pytest.mark.parametrize(("pp", "v"), [(4, 2), (4, 5), (8, 2), (16, 3)])
def test_first_stage_penalty_is_megatrons(pp: int, v: int) -> None:
    """Stage 0 holds ``pp · (1 + (pp − 1)/(pp·v))`` micro-batches' worth of its layers."""
    chunks = interleaved_in_flight_chunks(0, pp, 1000, v)
    assert Fraction(chunks, v) == pp * (1 + Fraction(pp - 1, pp * v))


def test_interleaved_chunks_bounded_by_the_step() -> None:
    assert interleaved_in_flight_chunks(0, 8, 2, 4) == 8  # m·v = 8 chunk forwards in all
    assert interleaved_in_flight_chunks(7, 8, 64, 2) == 9  # last stage: (v−1)·pp + 1


def test_interleaved_plan_applies_the_penalty(tmp_path: Path) -> None:
    base = _stage0(MANIFEST)
    path = _with(tmp_path, "  virtual_stages: 2\n", drop=("pipeline_schedule",))
    text = path.read_text().replace("training:\n", "training:\n  pipeline_schedule: interleaved\n")
    path.write_text(text)
    inter = _stage0(path)
    # 20 layers per stage, pp 4, v 2: penalty 1 + 3/8 on the 4 micro-batches of 1F1B.
    assert Fraction(inter["activations.layers"], base["activations.layers"]) == Fraction(11, 8)


def test_partial_recompute_interpolates(tmp_path: Path) -> None:
    def layers(extra: str) -> dict[str, int]:
        path = _with(tmp_path, extra, drop=("recompute",))
        return _stage0(path)

    none = layers("  recompute: none\n")
    full = layers("  recompute: full\n")
    zero = layers("  recompute: full\n  recompute_layers: 0\n")
    every = layers("  recompute: full\n  recompute_layers: 20\n")
    five = layers("  recompute: full\n  recompute_layers: 5\n")
    assert zero["activations.layers"] == none["activations.layers"]
    assert zero["activations.recompute_working_set"] == 0
    assert every["activations.layers"] == full["activations.layers"]
    per_none = none["activations.layers"] // 20
    per_full = full["activations.layers"] // 20
    assert five["activations.layers"] == 15 * per_none + 5 * per_full
    assert five["activations.recompute_working_set"] == full["activations.recompute_working_set"]


def test_spec_refusals() -> None:
    with pytest.raises(InvalidInputError, match="virtual_stages"):
        TrainingSpec(pipeline_schedule="interleaved")
    with pytest.raises(InvalidInputError, match="recompute: full"):
        TrainingSpec(recompute="selective", recompute_layers=2)


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ("  virtual_stages: 2\n", "training.virtual_stages"),
        ("  recompute_layers: 4\n", "training.recompute_layers"),
    ],
)
def test_manifest_refusals_exit_3(tmp_path: Path, extra: str, needle: str) -> None:
    path = _with(tmp_path, extra)
    proc = subprocess.run(
        [sys.executable, "-m", "shardctl", "plan", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 3, proc.stderr
    assert needle in proc.stderr and "Traceback" not in proc.stderr
