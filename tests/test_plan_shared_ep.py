"""``mesh.expert_placement: shared``: experts over the tp×dp ranks of attention (vLLM
``--enable-expert-parallel``), checked against hand arithmetic on Mixtral-8x22B."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# mistralai/Mixtral-8x22B-v0.1 config.json
MIXTRAL_8X22B = """model:
  model_type: mixtral
  hidden_size: 6144
  intermediate_size: 16384
  num_hidden_layers: 56
  num_attention_heads: 48
  num_key_value_heads: 8
  num_local_experts: 8
  num_experts_per_tok: 2
  vocab_size: 32768
  max_position_embeddings: 65536
  rope_theta: 1000000.0
  tie_word_embeddings: false
  torch_dtype: bfloat16
hardware: {{gpu: h200}}
workload: {{batch_size: 16, sequence_length: 8192}}
mesh: {mesh}
"""
L, H, INTER, E, KV, HD, B, S = 56, 6144, 16384, 8, 8, 128, 16, 8192
EXPERT = 3 * H * INTER * 2 * L  # one whole expert (w1, w2, w3) in every layer, bf16


def shardctl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shardctl", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )


def _plan(tmp_path: Path, mesh: str, *extra: str) -> dict[str, object]:
    path = tmp_path / "m.yaml"
    path.write_text(MIXTRAL_8X22B.format(mesh=mesh))
    proc = shardctl("plan", str(path), "--json", *extra)
    assert proc.returncode in (0, 1), proc.stderr
    doc: dict[str, object] = json.loads(proc.stdout)
    return doc


def _rank0(doc: dict[str, object]) -> dict[str, int]:
    ranks = doc["ranks"]
    assert isinstance(ranks, list)
    memory: dict[str, int] = ranks[0]["memory"]
    return memory


def test_tp8_ep8_shared_gives_one_expert_per_rank_and_tp8_kv(tmp_path: Path) -> None:
    shared = _plan(tmp_path, "{tp: 8, ep: 8, expert_placement: shared}")
    tp8 = _plan(tmp_path, "{tp: 8}")
    assert len(shared["ranks"]) == 8  # type: ignore[arg-type]
    assert shared["expert_parallel"] == {"placement": "shared", "ep": 8, "experts_per_rank": 1}
    # KV = the TP8 figure: 2 · L · (8 kv heads / 8) · 128 · 2 B · 16 seqs · 8192 tokens
    kv = 2 * L * (KV // 8) * HD * 2 * B * S
    assert _rank0(shared)["kv_cache"] == kv == _rank0(tp8)["kv_cache"]
    # weights: TP8 holds 1/8 of every expert's matrices, shared holds 1 whole expert of 8:
    # the same bytes per rank here (tp = ep, dp = 1), the same dense part.
    tp8_experts = E * EXPERT // 8
    assert _rank0(shared)["weights"] - EXPERT == _rank0(tp8)["weights"] - tp8_experts


def test_tp4_dp2_ep8_shared_hand_arithmetic(tmp_path: Path) -> None:
    shared = _plan(tmp_path, "{tp: 4, dp: 2, ep: 8, expert_placement: shared}")
    tp4 = _plan(tmp_path, "{tp: 4}")
    assert len(shared["ranks"]) == 8  # type: ignore[arg-type]
    # KV per attention DP rank: its half of the batch, kv heads / 4
    assert _rank0(shared)["kv_cache"] == 2 * L * (KV // 4) * HD * 2 * (B // 2) * S
    # dense weights as TP4; experts: 1 whole of 8 (not 8 experts / tp 4)
    dense = _rank0(tp4)["weights"] - E * EXPERT // 4
    assert all(r["memory"]["weights"] == dense + EXPERT for r in shared["ranks"])  # type: ignore[attr-defined]


def test_separate_axis_charges_the_whole_batch_per_ep_rank(tmp_path: Path) -> None:
    # The layout: ep 8, tp 1 as an extra axis: every rank holds all KV heads of the
    # whole batch, 8× the shared layout's KV.
    sep = _plan(tmp_path, "{tp: 1, ep: 8}")
    assert sep["expert_parallel"] == {"placement": "separate", "ep": 8, "experts_per_rank": 1}
    assert _rank0(sep)["kv_cache"] == 2 * L * KV * HD * 2 * B * S


@pytest.mark.parametrize(
    ("mesh", "needle"),
    [
        ("{tp: 8, ep: 4, expert_placement: shared}", "tp×dp = 8×1 = 8 attention ranks"),
        ("{tp: 8, ep: 8, expert_placement: mixed}", "expected one of separate, shared"),
    ],
)
def test_inconsistent_shared_mesh_exits_3(tmp_path: Path, mesh: str, needle: str) -> None:
    path = tmp_path / "m.yaml"
    path.write_text(MIXTRAL_8X22B.format(mesh=mesh))
    proc = shardctl("plan", str(path))
    assert proc.returncode == 3, proc.stdout
    assert needle in proc.stderr


def test_shared_text_output_and_search_refusal(tmp_path: Path) -> None:
    path = tmp_path / "m.yaml"
    path.write_text(MIXTRAL_8X22B.format(mesh="{tp: 8, ep: 8, expert_placement: shared}"))
    proc = shardctl("plan", str(path))
    assert proc.returncode == 0, proc.stderr
    assert "experts: EP8 shared over the TP×DP ranks" in proc.stdout
    assert "1 of 8 experts whole on each rank" in proc.stdout
    assert shardctl("plan", str(path), "--search").returncode == 3
