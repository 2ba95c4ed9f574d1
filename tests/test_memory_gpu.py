"""GPU validation of the memory model; skipped without CUDA."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda(), reason="needs a CUDA device")
def test_estimate_within_5_percent_on_gpu() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_memory.py")],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_bench_skips_cleanly_without_cuda() -> None:
    if _cuda():
        pytest.skip("a GPU is present; the gpu-marked test covers it")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_memory.py")],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert proc.returncode == 0 and "skipped" in proc.stdout
