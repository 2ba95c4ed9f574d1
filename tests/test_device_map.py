"""``plan --device-map``: a map transformers loads (CPU and disk entries here: GPU indices
cannot be loaded on a CPU machine), logits equal to a plain load; budgets that count KV cache
and activations; nothing written when it does not fit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from shardctl.plan.device_map import Overhead, Unit, assign
from tests._models import make_checkpoint

ROOT = Path(__file__).resolve().parent.parent
KIB = 1024
NONE = Overhead()


def shardctl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shardctl", *args], capture_output=True, text=True, cwd=ROOT
    )


def _manifest(tmp_path: Path, ckpt: Path) -> Path:
    m = tmp_path / "m.yaml"
    m.write_text(
        f"model: {{checkpoint: {ckpt}}}\n"
        "hardware: {device_memory: 80GiB, gpus_per_node: 2}\n"
        "workload: {batch_size: 1, sequence_length: 64}\n"
    )
    return m


@pytest.mark.parametrize("name", ["llama", "llama-tied-mha", "mixtral", "gpt2", "phi3"])
def test_cpu_and_disk_map_loads_with_identical_logits(tmp_path: Path, name: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    ckpt = make_checkpoint(name, tmp_path / "ckpt", dtype="float32")
    out, offload = tmp_path / "map.json", tmp_path / "offload"
    # --gpus 0 and a CPU budget of ~ two layers: the rest must go to disk.
    proc = shardctl(
        "plan", str(_manifest(tmp_path, ckpt)), "--device-map", str(out), "--gpus", "0",
        "--cpu-memory", "600KiB", "--offload-folder", str(offload),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    device_map = json.loads(out.read_text())
    assert set(device_map.values()) == {"cpu", "disk"}, device_map
    side = json.loads((tmp_path / "map.max_memory.json").read_text())
    assert side["schema"] == "shardctl.device_map/1" and side["fits"] is True
    assert side["max_memory"] == {"cpu": 600 * KIB}
    assert side["offload_folder"] == str(offload) and side["device_map_file"] == "map.json"
    cpu = next(d for d in side["devices"] if d["device"] == "cpu")
    assert cpu["total"] <= cpu["budget"] and cpu["kv_cache"] > 0 and cpu["activations"] > 0

    ids = torch.arange(1, 17)[None]
    plain = AutoModelForCausalLM.from_pretrained(ckpt)
    mapped = AutoModelForCausalLM.from_pretrained(
        ckpt, device_map=device_map, offload_folder=offload
    )
    with torch.no_grad():
        assert torch.equal(plain(ids).logits, mapped(ids).logits)


def test_map_that_does_not_fit_is_not_written(tmp_path: Path) -> None:
    ckpt = make_checkpoint("llama", tmp_path / "ckpt")
    out = tmp_path / "map.json"
    # No offload folder and a CPU of 100 KiB: the layers fit nowhere.
    proc = shardctl(
        "plan", str(_manifest(tmp_path, ckpt)), "--device-map", str(out), "--gpus", "0",
        "--cpu-memory", "100KiB",
    )  # fmt: skip
    assert proc.returncode == 1
    assert "device map not written" in proc.stderr and "--offload-folder" in proc.stderr
    assert not out.exists() and not (tmp_path / "map.max_memory.json").exists()


def _layer(i: int, weights: int, kv: int = 0, acts: int = 0) -> Unit:
    return Unit(f"layer {i}", (f"model.layers.{i}",), weights, kv, acts, is_layer=True)


def _units(n: int, weights: int, kv: int, acts: int) -> list[Unit]:
    embed = Unit("embeddings", ("model.embed_tokens",), weights, 0, 0, is_layer=False)
    head = Unit("head", ("model.norm", "lm_head"), weights, 0, acts // 10, is_layer=False)
    return [embed, *(_layer(i, weights, kv, acts) for i in range(n)), head]


def test_gpu_indices_are_contiguous_stages_within_budget() -> None:
    units = _units(8, weights=100, kv=20, acts=50)
    plan = assign(
        units, gpu_budgets=[700, 700], overhead=Overhead(30), cpu_budget=10**9, offload_folder=None
    )
    assert plan.fits
    order = [plan.device_map[m] for u in units for m in u.modules]
    assert order == sorted(order, key=str) and set(order) == {0, 1}  # 0 … 0, 1 … 1
    assert plan.device_map["model.embed_tokens"] == 0 and plan.device_map["lm_head"] == 1
    for ld in plan.loads:
        assert ld.total <= ld.budget  # type: ignore[operator]
        assert ld.overhead == 30
    frag = assign(units, gpu_budgets=[700, 700], overhead=Overhead(30, 0.5), cpu_budget=10**9,
                  offload_folder=None)  # fmt: skip
    gpus = [ld for ld in frag.loads if isinstance(ld.device, int)]
    assert len(gpus) == 2 and frag.fits
    for ld in gpus:  # half of the tensors on top of the fixed part
        assert ld.overhead == 30 + (ld.weights + ld.kv_cache + ld.activations) // 2
        assert ld.total <= 700
    # GPU 0: 30 + embed 100 + 4 layers × 120 + one layer's activations 50 = 660 ≤ 700.
    gpu0 = plan.loads[0]
    assert gpu0.layers == (0, 3) and gpu0.total == 660
    assert plan.max_memory == {"0": 700, "1": 700, "cpu": 10**9}


def test_kv_and_activations_count_not_only_weights() -> None:
    # Weights alone (10 × 100) would fit one 1100-byte GPU; KV and activations do not.
    units = [_layer(i, 100, kv=30, acts=80) for i in range(10)]
    weights_only = [_layer(i, 100) for i in range(10)]
    assert set(assign(weights_only, gpu_budgets=[1100], overhead=NONE, cpu_budget=10**9,
                      offload_folder=None).device_map.values()) == {0}  # fmt: skip
    plan = assign(units, gpu_budgets=[1100], overhead=NONE, cpu_budget=10**9, offload_folder=None)
    assert plan.fits and "cpu" in plan.device_map.values()
    gpu0 = plan.loads[0]
    # GPU 0 runs the offloaded layers too: their KV and the largest one's weights stay room.
    offloaded = sum(1 for d in plan.device_map.values() if d == "cpu")
    assert gpu0.kv_cache == 30 * 10 and gpu0.total <= 1100
    assert gpu0.weights == 100 * (10 - offloaded) + 100


def test_disk_after_cpu_and_reason_without_folder(tmp_path: Path) -> None:
    units = [_layer(i, 100) for i in range(6)]
    plan = assign(units, gpu_budgets=[], overhead=NONE, cpu_budget=350, offload_folder=tmp_path)
    assert plan.fits
    assert [plan.device_map[f"model.layers.{i}"] for i in range(6)] == ["cpu"] * 2 + ["disk"] * 4
    refused = assign(units, gpu_budgets=[], overhead=NONE, cpu_budget=350, offload_folder=None)
    assert not refused.fits and refused.reason is not None and "first layer 2" in refused.reason
