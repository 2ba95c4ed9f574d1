"""Plan refuses what it cannot price (exit 3), says "weights only" when asked, prices bare
counts in their quantized format, and checks the mesh against the declared hardware."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MANIFESTS = ROOT / "manifests"


def shardctl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shardctl", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )


def _write(tmp_path: Path, text: str, name: str = "m.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


BARE = """
model: {parameters: 120e9}
mesh: {tp: 8}
hardware: {gpu: h100-sxm}
"""


# -- workload never silently dropped ------------------------------------------------------------


def test_bare_count_with_workload_is_refused_naming_what(tmp_path: Path) -> None:
    m = _write(tmp_path, BARE + "workload: {batch_size: 8, sequence_length: 4096}\n")
    proc = shardctl("plan", str(m))
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "KV cache and activations" in proc.stderr
    assert "bare count" in proc.stderr and "weights-only" in proc.stderr
    assert proc.stdout == ""


def test_bare_count_training_is_refused(tmp_path: Path) -> None:
    m = _write(tmp_path, BARE + "training: {optimizer: adamw}\nworkload: {sequence_length: 4096}\n")
    proc = shardctl("plan", str(m))
    assert proc.returncode == 3, proc.stderr
    assert "activations" in proc.stderr


def test_search_refuses_the_same(tmp_path: Path) -> None:
    m = _write(tmp_path, BARE + "workload: {batch_size: 8, sequence_length: 4096}\n")
    assert shardctl("plan", str(m), "--search").returncode == 3


@pytest.mark.parametrize("how", ["flag", "mode"])
def test_weights_only_asked_for_is_said(tmp_path: Path, how: str) -> None:
    workload = "workload: {batch_size: 8, sequence_length: 4096"
    workload += ", mode: weights-only}\n" if how == "mode" else "}\n"
    m = _write(tmp_path, BARE + workload)
    extra = ["--weights-only"] if how == "flag" else []
    proc = shardctl("plan", str(m), *extra)
    assert proc.returncode == 0, proc.stderr
    assert "WEIGHTS ONLY" in proc.stdout
    assert "fits (weights only)" in proc.stdout
    doc = json.loads(shardctl("plan", str(m), "--json", *extra).stdout)
    assert doc["weights_only"] is True
    assert all(r["memory"]["kv_cache"] == 0 for r in doc["ranks"])


def test_weights_only_on_a_real_model_drops_kv(tmp_path: Path) -> None:
    name = str(MANIFESTS / "llama-3-70b-tp8.yaml")
    full = json.loads(shardctl("plan", name, "--json").stdout)
    bare = json.loads(shardctl("plan", name, "--json", "--weights-only").stdout)
    assert full["weights_only"] is False and bare["weights_only"] is True
    assert full["ranks"][0]["memory"]["kv_cache"] > 0
    assert bare["ranks"][0]["memory"]["kv_cache"] == 0
    assert bare["ranks"][0]["memory"]["weights"] == full["ranks"][0]["memory"]["weights"]


def test_weights_only_mode_with_training_section_is_refused(tmp_path: Path) -> None:
    m = _write(tmp_path, BARE + "workload: {mode: weights-only}\ntraining: {zero: 1}\n")
    proc = shardctl("plan", str(m))
    assert proc.returncode == 3
    assert "workload.mode" in proc.stderr


# -- quantization honoured for bare counts ------------------------------------------------------

# bytes per parameter for a bare count: payload + scales (docs/memory-model.md)
BYTES_PER_PARAM = {
    "mxfp4": 0.5 + 1 / 32,  # E2M1 + one E8M0 byte per 32
    "nvfp4": 0.5 + 1 / 16,  # E2M1 + one E4M3 byte per 16 (+ 4 B per tensor)
    "fp8": 1.0,  # + 4 B per tensor
    "int8": 1.0,
    "gptq": 0.5 + 2 / 128 + 0.5 / 128,  # int4 + fp16 scale + int4 zero per 128
    "awq": 0.5 + 2 / 128 + 0.5 / 128,
}


@pytest.mark.parametrize("method", sorted(BYTES_PER_PARAM))
def test_bare_count_is_priced_in_its_format(tmp_path: Path, method: str) -> None:
    n = 120_000_000_000
    m = _write(tmp_path, BARE + f"quantization: {{method: {method}}}\n")
    doc = json.loads(shardctl("plan", str(m), "--json").stdout)
    q = doc["model"]["quantization"]
    assert q["method"] == method
    expected = n * BYTES_PER_PARAM[method]
    assert abs(q["weight_bytes"] - expected) <= 8 * 4  # the per-tensor scale of each rank
    assert sum(r["memory"]["weights"] for r in doc["ranks"]) == q["weight_bytes"]


def test_gpt_oss_120b_mxfp4_is_about_its_checkpoint_size(tmp_path: Path) -> None:
    # gpt-oss-120b: 116.83e9 parameters (OpenAI model card); its checkpoint is ~65 GB (MoE
    # weights in MXFP4, the rest in BF16). All in MXFP4 gives 62.1 GB; BF16 gave 217.6 GiB.
    m = _write(
        tmp_path,
        "model: {parameters: 116.83e9}\nhardware: {gpu: h100-sxm}\nquantization: {method: mxfp4}\n",
    )
    proc = shardctl("plan", str(m))
    assert proc.returncode == 0, proc.stderr
    assert "quantized mxfp4" in proc.stdout and "0.5312 B/parameter" in proc.stdout
    doc = json.loads(shardctl("plan", str(m), "--json").stdout)
    assert 60e9 < doc["ranks"][0]["memory"]["weights"] < 66e9


# -- mesh checked against the declared hardware -------------------------------------------------


def test_tp16_on_one_node_of_8_is_refused_naming_both(tmp_path: Path) -> None:
    text = (MANIFESTS / "llama-3-70b-tp8.yaml").read_text().replace("tp: 8", "tp: 16")
    proc = shardctl("plan", str(_write(tmp_path, text)))
    assert proc.returncode == 3, proc.stdout
    assert "TP16 needs 16 GPUs" in proc.stderr
    assert "1 node(s) × 8 GPUs = 8" in proc.stderr


def test_override_beyond_the_hardware_is_refused() -> None:
    proc = shardctl("plan", str(MANIFESTS / "llama-3-8b-tp1.yaml"), "--dp", "16")
    assert proc.returncode == 3
    assert "DP16" in proc.stderr and "= 8" in proc.stderr


def test_tp_across_nodes_is_a_warning(tmp_path: Path) -> None:
    text = (MANIFESTS / "llama-3-70b-tp8.yaml").read_text().replace("tp: 8", "tp: 16")
    text = text.replace("nodes: 1", "nodes: 2")
    path = _write(tmp_path, text)
    proc = shardctl("plan", str(path))
    assert proc.returncode == 0, proc.stderr
    assert "warning: tp 16 spans nodes of 8 GPUs" in proc.stdout
    doc = json.loads(shardctl("plan", str(path), "--json").stdout)
    assert len(doc["warnings"]) == 1
    allowed = _write(
        tmp_path, text.replace("nodes: 2}", "nodes: 2, allow_tp_across_nodes: true}"), "a.yaml"
    )
    doc = json.loads(shardctl("plan", str(allowed), "--json").stdout)
    assert doc["warnings"] == []
