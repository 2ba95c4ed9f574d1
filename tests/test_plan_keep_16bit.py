"""``quantization.keep_16bit`` globs are checked against the model's tensor names: a glob that
matches nothing is refused (exit 3) instead of silently ignored. Globs over decoder matrices
are priced in 16-bit (tests/test_plan_precision.py)."""

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
        ('["*embed_tokens.*", "*.no_such_module.*"]', "matches no tensor"),
    ],
)
def test_unmatched_globs_exit_3(tmp_path: Path, keep: str, needle: str) -> None:
    proc = _plan(_manifest(tmp_path, keep))
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert needle in proc.stderr and "quantization.keep_16bit" in proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_keeping_attention_is_priced(tmp_path: Path) -> None:
    proc = _plan(_manifest(tmp_path, '["*embed_tokens.*", "lm_head.*", "*norm*", "*.self_attn.*"]'))
    assert proc.returncode in (0, 1), proc.stderr
    default = shardctl.plan(_manifest(tmp_path, '["*embed_tokens.*", "lm_head.*", "*norm*"]'))
    kept = shardctl.plan(
        _manifest(tmp_path, '["*embed_tokens.*", "lm_head.*", "*norm*", "*.self_attn.*"]')
    )
    assert kept.quantized_weight_bytes() > default.quantized_weight_bytes()


def test_keeping_less_quantizes_the_head(tmp_path: Path) -> None:
    default = shardctl.plan(_manifest(tmp_path, '["*embed_tokens.*", "lm_head.*", "*norm*"]'))
    no_head = shardctl.plan(_manifest(tmp_path, '["*embed_tokens.*", "*norm*"]'))
    assert no_head.quantized_weight_bytes() < default.quantized_weight_bytes()
