"""The fam-dense flagship manifests: ``shardctl plan`` from each, bytes checked by hand.

No published ``model.safetensors.index.json`` ``metadata.total_size`` for these checkpoints
could be found to cite (searched: OLMo-2-1124-13B/7B, GLM-4-9B-0414, Gemma-3-27B, StarCoder2-15B,
Command-R v01), so the expected figures here are the architectures' closed forms, written out
from each model's structure (not from shardctl's code): total weight bytes and one TP rank's.
OLMo-2-13B's total, 13,716,198,400 parameters, is the "13.7B" its model card states.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BF16 = 2


def _plan(name: str) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-m", "shardctl", "plan", str(ROOT / "manifests" / name), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    doc: dict[str, Any] = json.loads(done.stdout)
    return doc


def test_olmo2_13b_tp4() -> None:
    h, i, layers, v, tp = 5120, 13824, 40, 100352, 4
    # MHA q/k/v/o 4·h², gated MLP 3·h·I, post-attention + post-MLP norms 2·h, q_norm and k_norm
    # over the whole projection 2·h; embeddings and untied head V·h each; final norm h.
    layer = 4 * h * h + 3 * h * i + 2 * h + 2 * h
    total = layers * layer + 2 * v * h + h
    doc = _plan("olmo-2-13b-tp4.yaml")
    assert doc["model"]["parameters"] == total == 13_716_198_400
    assert doc["model"]["weight_bytes"] == BF16 * total
    # one tp rank: projections and MLP split 4 ways, every norm whole (replicated)
    rank = layers * ((4 * h * h + 3 * h * i) // tp + 4 * h) + 2 * (v // tp) * h + h
    assert {r["memory"]["weights"] for r in doc["ranks"]} == {BF16 * rank}


def test_glm4_9b_0414_tp2() -> None:
    h, i, layers, v, heads, kv, hd, tp = 4096, 13696, 40, 151552, 32, 2, 128, 2
    q, k = heads * hd, kv * hd
    # q/k/v with biases, o without; fused gate_up [2I, H] and down; four norms per layer
    layer = (q + 2 * k) * h + (q + 2 * k) + h * q + 3 * h * i + 4 * h
    total = layers * layer + 2 * v * h + h
    doc = _plan("glm-4-9b-0414-tp2.yaml")
    assert doc["model"]["parameters"] == total
    assert doc["model"]["weight_bytes"] == BF16 * total
    qr, kr = q // tp, k // tp  # 16 query heads and 1 kv head per rank
    rank_layer = (qr + 2 * kr) * (h + 1) + h * qr + 3 * h * (i // tp) + 4 * h
    rank = layers * rank_layer + 2 * (v // tp) * h + h
    assert {r["memory"]["weights"] for r in doc["ranks"]} == {BF16 * rank}


def test_gemma3_27b_text_tp4() -> None:
    h, i, layers, v, heads, kv, hd, tp = 5376, 21504, 62, 262208, 32, 16, 128, 4
    q, k = heads * hd, kv * hd
    # q/k/v/o, gated MLP, four norms [h], per-head q_norm/k_norm [head_dim]; tied table
    layer = (q + 2 * k) * h + h * q + 3 * h * i + 4 * h + 2 * hd
    total = layers * layer + v * h + h
    doc = _plan("gemma-3-27b-text-tp4.yaml")
    assert doc["model"]["parameters"] == total
    assert doc["model"]["weight_bytes"] == BF16 * total
    rank_layer = (q + 2 * k) * h // tp + h * q // tp + 3 * h * i // tp + 4 * h + 2 * hd
    rank = layers * rank_layer + (v // tp) * h + h
    assert {r["memory"]["weights"] for r in doc["ranks"]} == {BF16 * rank}


def test_omni_qwen3_config_is_refused_naming_its_relatives(tmp_path: Path) -> None:
    """model_type "qwen3_omni_moe" (Qwen3-Omni: a thinker with an audio tower, a talker and a
    code-to-wave decoder) is not placed: exit 3, one line that names the relatives that are
    (qwen3_vl_moe, qwen3_moe) and how to place it anyway, with no dangling list."""
    from transformers import AutoConfig

    AutoConfig.for_model("qwen3_omni_moe").save_pretrained(tmp_path)
    done = subprocess.run(
        [sys.executable, "-m", "shardctl", "plan", str(tmp_path / "config.json"), "--tp", "2"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert done.returncode == 3, done.stderr
    lines = [ln for ln in done.stderr.splitlines() if ln.startswith("shardctl: error:")]
    assert len(lines) == 1 and "Traceback" not in done.stderr
    assert "'qwen3_omni_moe'" in lines[0] and "omni-modal" in lines[0]
    assert "'qwen3_vl_moe'" in lines[0] and "'qwen3_moe'" in lines[0]
    assert "shardctl inspect" in lines[0] and not lines[0].rstrip().endswith(":")


def test_gemma3_kv_cache_follows_the_five_to_one_pattern() -> None:
    """Without layer_types, sliding_window_pattern 6: layers 5, 11, …, 59 are global (10 of 62),
    the other 52 keep only the 1,024-token window (HF Gemma3TextConfig.layer_types)."""
    doc = _plan("gemma-3-27b-text-tp4.yaml")
    kv_heads_per_rank, hd, seq, window, batch = 16 // 4, 128, 32768, 1024, 8
    per_token_layer = 2 * kv_heads_per_rank * hd * BF16  # K and V
    tokens = 10 * seq + 52 * window
    assert doc["ranks"][0]["memory"]["kv_cache"] == batch * tokens * per_token_layer
