"""``quantization.keep_16bit`` globs are checked against the model's tensor names: a glob that
matches nothing, or matches decoder matrices the weight model would not price in 16-bit, is
refused (exit 3) instead of silently ignored."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import shardctl

ROOT = Path(__file__).parent.parent
BASE = (ROOT / "manifests" / "llama-3-8b-tp1.yaml").read_text()


def _manifest(tmp_path: Path, keep: str) -> Path:
    path = tmp_path / "q.yaml"
    path.write_text(BASE + f"quantization: {{method: awq, keep_16bit: {keep}}}\n")
    return path


def _plan(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shardctl", "plan", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    ("keep", "needle"),
    [
        ('["*.self_attn.*"]', "model.layers.0.self_attn.k_proj.weight [1024, 4096]"),
        ('["*embed_tokens.*", "*.no_such_module.*"]', "matches no tensor"),
    ],
)
def test_unpriced_or_unmatched_globs_exit_3(tmp_path: Path, keep: str, needle: str) -> None:
    proc = _plan(_manifest(tmp_path, keep))
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert needle in proc.stderr and "quantization.keep_16bit" in proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_keeping_less_quantizes_the_head(tmp_path: Path) -> None:
    default = shardctl.plan(_manifest(tmp_path, '["*embed_tokens.*", "lm_head.*", "*norm*"]'))
    no_head = shardctl.plan(_manifest(tmp_path, '["*embed_tokens.*", "*norm*"]'))
    assert no_head.quantized_weight_bytes() < default.quantized_weight_bytes()
